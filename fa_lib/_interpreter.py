"""Compiled Triton or Triton's CPU interpreter: decided once, at ``import fa_lib``.

Triton decides per kernel, when ``@triton.jit`` runs, whether the kernel is compiled for a GPU or
interpreted through NumPy on CPU tensors: it reads the environment variable ``TRITON_INTERPRET``
(true for ``1``, ``true``, ``on``, ``yes`` or ``y`` in any case). fa_lib follows the same rule:

* ``TRITON_INTERPRET`` set by the user, to any value: obeyed as Triton reads it.
* unset, and ``torch.cuda.is_available()``: compiled kernels.
* unset, and no CUDA device: fa_lib sets ``TRITON_INTERPRET=1`` so that its kernels run on CPU.

Nothing else changes at import: Triton's own ``triton.language`` is left as it is. Two things need care,
and both are confined to the duration of one launch of an fa_lib kernel (``contain``):

* Triton's library functions (``tl.max``, ``tl.sum``, ``tl.cdiv``, ...) are ``@triton.jit`` functions
  too, defined when ``triton.language`` is first imported. If something imported Triton before fa_lib
  did (``torch.compile`` does), they were defined for the compiler, and an interpreted kernel cannot call
  them. During each launch their interpreted twins stand in; afterwards the compiled ones are back. On a
  machine with CUDA, where other code may be running compiled kernels, fa_lib refuses instead and says
  what to do.
* Triton 3.6's interpreter patches ``triton.language.core`` with its own builtins whenever a kernel calls
  a library ``@jit`` function, and never restores them: a later Gluon or Triton compile in the same
  process then fails inside ``gl.cdiv`` ("'block_argument' object has no attribute 'dtype'"). Each
  launch puts ``triton.language`` back as it found it.
"""
import contextlib
import functools
import os
import sys

__all__ = ["TRUE_VALUES", "check_versions", "configure", "contain", "contain_module", "env_value",
           "language_restored"]

TRUE_VALUES = ("1", "true", "on", "yes", "y")  # Triton's getenv_bool, compared in lower case


def env_value():
    """``TRITON_INTERPRET`` as Triton reads it: True, False, or None when it is not set."""
    value = os.environ.get("TRITON_INTERPRET")
    return None if value is None else value.lower() in TRUE_VALUES


def _language_modules():
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name == "triton.language" or name.startswith("triton.language."))]


def _compiled_library_functions():
    """(module, name, JITFunction) of every compiled-mode ``@jit`` function of an imported ``triton.language``."""
    modules = _language_modules()
    if not modules:
        return []
    from triton.runtime.jit import JITFunction

    return [(m, name, f) for m in modules for name, f in vars(m).items() if isinstance(f, JITFunction)]


def _refuse_compiled_triton_with_cuda(cuda_available):
    """Where a GPU exists and ``triton.language`` was imported for the compiler, other code may be running
    compiled kernels that call its functions: refuse the interpreter, with the fix."""
    if cuda_available and _compiled_library_functions():
        raise ImportError(
            "TRITON_INTERPRET asks for Triton's CPU interpreter, but triton was imported before fa_lib "
            "with the interpreter off, and this machine has a CUDA device that other compiled kernels may "
            "be using. Set TRITON_INTERPRET=1 in the environment before starting Python (or before the "
            "first `import triton` / `torch.compile`), or unset it to run fa_lib's kernels on the GPU.")


_MISSING = object()
_TWINS = {}  # id(compiled JITFunction) -> (it, its InterpretedFunction twin), made once


def _language_state():
    """What the interpreter may change in ``triton.language``: its modules' namespaces and two tensor classes."""
    import triton.language.core as core

    return ([(vars(m), dict(vars(m))) for m in _language_modules()],
            [(c, dict(vars(c))) for c in (core.tensor, core.tensor_descriptor_base)])


def _restore(state):
    modules, classes = state
    for namespace, saved in modules:
        for name, value in saved.items():
            if namespace.get(name, _MISSING) is not value:
                namespace[name] = value
        # Names the interpreter added to a module (its own globals, given to the library functions it
        # rewrites) stay: the rewritten functions it caches look them up at every later call.
    for cls, saved in classes:
        for name in [n for n in vars(cls) if n not in saved]:
            delattr(cls, name)
        for name, value in saved.items():
            if vars(cls).get(name, _MISSING) is not value:
                setattr(cls, name, value)


@contextlib.contextmanager
def language_restored():
    """Inside: ``triton.language``'s compiled-mode library functions have interpreted twins standing in.
    On leaving: ``triton.language`` is as it was found (see the module docstring)."""
    from triton.runtime.interpreter import InterpretedFunction

    state = _language_state()
    try:
        for module, name, f in _compiled_library_functions():
            if id(f) not in _TWINS:
                _TWINS[id(f)] = (f, InterpretedFunction(f.fn))
            setattr(module, name, _TWINS[id(f)][1])
        yield
    finally:
        _restore(state)


def contain(kernel):
    """Make every launch of ``kernel`` (an interpreted ``@triton.jit`` function) run inside
    ``language_restored()``; return ``kernel``. Anything else is returned unchanged."""
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction) or getattr(kernel.run, "_fa_lib_contained", False):
        return kernel
    run = kernel.run

    @functools.wraps(run)
    def contained(*args, **kwargs):
        with language_restored():
            return run(*args, **kwargs)

    contained._fa_lib_contained = True
    kernel.run = contained  # an instance attribute: `kernel[grid](...)` and Triton's autotuner both call it
    return kernel


def contain_module(namespace):
    """``contain`` every interpreted ``@triton.jit`` function of a module's namespace (its ``globals()``)."""
    for value in list(namespace.values()):
        contain(value)


def configure():
    """Apply the rule above; return True when fa_lib's kernels will run under the interpreter."""
    requested = env_value()
    if requested is False:
        return False
    try:
        import torch
    except ImportError:  # NumPy alone: fa_lib.reference and fa_lib.exercises work, the kernels cannot run
        return False
    cuda = torch.cuda.is_available()
    if requested is None:
        if cuda:
            return False
        os.environ["TRITON_INTERPRET"] = "1"
    _refuse_compiled_triton_with_cuda(cuda)
    return True


def _version(text):
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2])


def check_versions():
    """Refuse, with the fix, the one known-broken interpreter combination: Triton < 3.7 with NumPy >= 2.4
    fails on any loop with a run-time bound (triton issue 9171), i.e. on every fa_lib kernel."""
    import importlib.metadata

    import numpy

    triton_version = importlib.metadata.version("triton")
    if _version(triton_version) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        raise ImportError(
            f"fa_lib's kernels run under Triton's CPU interpreter here, and the interpreter of Triton "
            f"{triton_version} fails with NumPy {numpy.__version__} (NumPy >= 2.4; triton issue 9171). Install "
            f"'numpy<2.4' or 'triton>=3.7' (both combinations are tested), or run on a CUDA GPU.")
