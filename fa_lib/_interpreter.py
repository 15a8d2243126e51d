"""Compiled Triton or Triton's CPU interpreter: decided once, at ``import fa_lib``.

Triton decides per kernel, when ``@triton.jit`` runs, whether the kernel is compiled for a GPU or
interpreted through NumPy on CPU tensors: it reads the environment variable ``TRITON_INTERPRET``
(true for ``1``, ``true``, ``on``, ``yes`` or ``y`` in any case). fa_lib follows the same rule:

* ``TRITON_INTERPRET`` set by the user, to any value: obeyed as Triton reads it.
* unset, and ``torch.cuda.is_available()``: compiled kernels.
* unset, and no CUDA device: fa_lib sets ``TRITON_INTERPRET=1`` so that its kernels run on CPU.

Triton's own library functions (``tl.max``, ``tl.sum``, ...) are ``@triton.jit`` functions too,
defined when ``triton.language`` is first imported. If something imported Triton before fa_lib did
(``torch.compile`` does), they were defined for the compiler and the interpreter cannot call them.
On a machine without CUDA the compiler has nothing to run on, so fa_lib re-defines them as
interpreted functions. On a machine with CUDA, where other code may be using compiled kernels,
fa_lib refuses instead and says what to do.
"""
import os
import sys

__all__ = ["TRUE_VALUES", "check_versions", "configure", "env_value"]

TRUE_VALUES = ("1", "true", "on", "yes", "y")  # Triton's getenv_bool, compared in lower case


def env_value():
    """``TRITON_INTERPRET`` as Triton reads it: True, False, or None when it is not set."""
    value = os.environ.get("TRITON_INTERPRET")
    return None if value is None else value.lower() in TRUE_VALUES


def _language_modules():
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name == "triton.language" or name.startswith("triton.language."))]


def _rebind_for_interpreter(cuda_available):
    """Turn the compiled-mode ``@jit`` functions of an already imported ``triton.language`` into
    interpreted ones; return how many were re-defined."""
    modules = _language_modules()
    if not modules:  # triton not imported yet: its @jit functions will be defined in the right mode
        return 0
    from triton.runtime.jit import JITFunction

    compiled = [(m, name, f) for m in modules for name, f in vars(m).items() if isinstance(f, JITFunction)]
    if not compiled:
        return 0
    if cuda_available:
        raise ImportError(
            "TRITON_INTERPRET asks for Triton's CPU interpreter, but triton was imported before fa_lib "
            "with the interpreter off, and this machine has a CUDA device that other compiled kernels may "
            "be using. Set TRITON_INTERPRET=1 in the environment before starting Python (or before the "
            "first `import triton` / `torch.compile`), or unset it to run fa_lib's kernels on the GPU.")
    from triton.runtime.interpreter import InterpretedFunction

    for module, name, f in compiled:
        setattr(module, name, InterpretedFunction(f.fn))
    return len(compiled)


def configure():
    """Apply the rule above; return True when fa_lib's kernels will run under the interpreter."""
    requested = env_value()
    if requested is False:
        return False
    import torch

    cuda = torch.cuda.is_available()
    if requested is None:
        if cuda:
            return False
        os.environ["TRITON_INTERPRET"] = "1"
    _rebind_for_interpreter(cuda)
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
