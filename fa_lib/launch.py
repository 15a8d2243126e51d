"""Launching a compiled Triton kernel again without Triton's per-call argument binding.

``kernel[grid](*args, **kwargs)`` on a ``triton.jit`` function binds every argument (a native
specialisation call per argument: its type, a pointer's 16-byte alignment, an integer's divisibility by
16 and whether it is 1), builds the compiled-kernel cache key, checks the kernel's globals and only then
launches. For fa_lib's kernels, with 20 to 50 arguments, that is most of the host time of a launch, and on
small shapes the host time is the step's time (`benchmarks/data/probe-host-launch-nvidia-h200.json`). ``launch`` keeps, per kernel, the
compiled kernel of each *exact* argument signature: the integers' values, each tensor's dtype and 16-byte
alignment, the other arguments' types, the keyword arguments (constexprs and launch options) and the
device. Everything Triton specialises on is a function of that key, so a hit can launch the kernel that
``kernel[grid]`` would pick, directly; a miss goes through ``kernel[grid]`` (which compiles or finds the
kernel) and records it. The key is finer than Triton's (two lengths that Triton compiles alike are two
entries here), which costs a slower first call per exact shape, never a wrong kernel. The test
``tests/library/test_launch.py`` checks that claim against Triton's own binder.

Under the interpreter, with launch hooks installed (profilers), or in Triton's debug or instrumentation
modes, every call goes through ``kernel[grid]``.
"""
import contextlib

import torch
from triton import knobs
from triton.runtime import driver

from . import kernels
from .options import current

__all__ = ["launch", "signature_key", "entry", "bound_tail", "cache_info", "clear_cache"]

_MAX_ENTRIES = 256  # per kernel: exact signatures kept (a loop over ever-new shapes stops adding past this)
_CACHE = {}  # {kernel: {key: (compiled, tail)}}
_STATS = {"hits": 0, "misses": 0, "slow": 0}
_Tensor = torch.Tensor
_int = int
try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor
except ImportError:  # pragma: no cover - a Triton without Gluon
    _GluonDescriptor = None


def signature_key(args, kwargs):
    """The cache key of one call: an exact description of everything Triton specialises a launch on, or
    None (launch through Triton) for an argument of another kind. Integers and bools by value (and type),
    None as itself, Python floats by their type (Triton passes every one as a float32 scalar), tensors by
    (dtype, data pointer 16-byte aligned), Gluon's host TMA descriptors by (dtype, block shape, layout,
    padding); keyword arguments by (name, value)."""
    out = []
    for a in args:
        ta = type(a)
        if ta is _int or a is None:
            out.append(a)
        elif ta is bool:
            out.append((a,))  # not equal to the ints 0 and 1
        elif ta is _Tensor or isinstance(a, _Tensor):
            out.append(a.dtype)
            out.append(a.data_ptr() & 15 == 0)
        elif ta is float:
            out.append(float)
        elif ta is _GluonDescriptor:
            # Triton specialises a host TMA descriptor on its type alone: dtype, block shape and shared
            # layout (its shape and strides are runtime arguments, its base is 16-byte aligned by contract).
            out.append((_GluonDescriptor, a.base.dtype, tuple(a.block_shape), a.layout, a.padding))
        else:
            return None
    return tuple(out), tuple(kwargs.items())


def _no_hook(hook):
    """True for a launch hook that does nothing: None, or (Triton 3.6's default) an empty HookChain."""
    return hook is None or not getattr(hook, "calls", True)


def _fast_ok():
    """Whether a cached launch may skip Triton's run(): no launch hook to call (Triton then builds each
    launch's metadata for it), no debug or instrumentation mode (options of the compiled kernel)."""
    return (_no_hook(knobs.runtime.launch_enter_hook) and _no_hook(knobs.runtime.launch_exit_hook)
            and not knobs.runtime.debug and not knobs.compilation.instrumentation_mode)


# A callback that sees every launch before it happens, or None: `fa_lib.plan` sets it while it records a call's
# launches. The launch layer calls it and knows nothing above it.
_RECORDER = None


def set_recorder(fn):
    """Have `fn(kernel, grid, args, kwargs)` called before each launch (None: stop)."""
    global _RECORDER
    _RECORDER = fn


def launch(kernel, grid, args, kwargs):
    """``kernel[grid](*args, **kwargs)``, where ``grid`` is a tuple of 1 to 3 ints and every argument of
    ``kernel`` that is not in ``args`` (its leading parameters, in order) is in ``kwargs`` or has a
    default. Returns nothing."""
    if _RECORDER is not None:
        _RECORDER(kernel, grid, args, kwargs)
    if not current().cached_launch or kernels.INTERPRET or kernel.pre_run_hooks or not _fast_ok():
        _STATS["slow"] += 1
        kernel[grid](*args, **kwargs)
        return
    sig = signature_key(args, kwargs)
    if sig is None:
        _STATS["slow"] += 1
        kernel[grid](*args, **kwargs)
        return
    device = driver.active.get_current_device()
    key = (device, sig)
    entries = _CACHE.setdefault(kernel, {})
    hit = entries.get(key)
    if hit is None:
        _STATS["misses"] += 1
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # an asynchronous compile
            compiled = compiled.result()
        if len(entries) < _MAX_ENTRIES:
            entries[key] = (compiled, bound_tail(kernel.params, len(args), kwargs))
        return
    _STATS["hits"] += 1
    compiled, tail = hit
    stream = driver.active.get_current_stream(device)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *tail)


def entry(kernel, device, args, kwargs):
    """The (compiled kernel, bound tail) this cache keeps for a call of `kernel` with `args` and `kwargs` on
    `device` (a torch.device), or None: what `fa_lib.plan` replays without binding the arguments again."""
    if device.type != "cuda":
        return None
    sig = signature_key(args, kwargs)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return None if sig is None else _CACHE.get(kernel, {}).get((index, sig))


def bound_tail(params, n_args, kwargs):
    """The values of the parameters after the first `n_args`, as Triton binds them: from `kwargs` (the
    constexprs), else the parameter's default. `params`: the kernel's ``JITFunction.params``."""
    return tuple(kwargs[p.name] if p.name in kwargs else p.default for p in params[n_args:])


def cache_info():
    """{"hits", "misses", "slow"} counts of this process, and "entries": signatures kept per kernel name."""
    return dict(_STATS, entries={getattr(k, "__name__", repr(k)): len(v) for k, v in _CACHE.items()})


def clear_cache():
    _CACHE.clear()
    for k in _STATS:
        _STATS[k] = 0


# Buffers and devices of a launch.
# Test hook: when True, every output buffer (o, lse, delta, dq, dk, dv) starts filled with NaN instead
# of uninitialised memory, so an element a kernel forgets to write shows up. `fa_lib.testing` toggles it.
_POISON_OUTPUTS = False


def _empty(shape, dtype, device):
    if _POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _strides(t):
    return tuple(t.stride())


def _device_guard(t):
    """Run launches on `t`'s device, whatever device is current (Triton launches on the current one)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
