"""Scoped overrides of how fa_lib chooses its kernels: ``with fa_lib.kernel_options(...)``.

fa_lib picks a kernel for each problem by rules measured on the H200 (the rules and their data are in
``fa_lib.ops``, ``fa_lib.kernels_hopper`` and ``fa_lib.decode``). Benchmarks and tests sometimes need another
choice: the portable Triton kernels where the sm_90 Gluon kernels would run, the Gluon kernels forced where they are
slower, one pass or two in the backward. ``kernel_options`` sets that for the calls made inside its block, in
this thread (or asyncio task) only, and puts the previous choice back on leaving::

    with fa_lib.kernel_options(hopper_forward="never", split_head_dim=False):
        o = fa_lib.flash_attention(q, k, v, causal=True)
    o.sum().backward()   # the backward of that call keeps the options its forward ran under

A call's backward runs under the options of its forward, wherever and whenever it runs (autograd may run it in
another thread). An unknown option or a value it cannot take is a ``ValueError`` that names it. Launch plans
(``fa_lib.plan``) are kept per set of options: a call under other options never replays another's plan.
"""
import contextlib
import contextvars
import dataclasses
import numbers

__all__ = ["KernelOptions", "current", "kernel_options", "using"]

_ROUTES = ("auto", "always", "never")


@dataclasses.dataclass(frozen=True, eq=False)
class KernelOptions:
    """One set of kernel options (immutable; equal sets are one object, see `kernel_options`).

    Routes to the sm_90 Gluon kernels (``fa_lib.kernels_hopper``): ``"auto"`` where they measured faster and can
    run, ``"always"`` wherever they can run (where slower too: tests, probes), ``"never"`` (the portable Triton
    kernels):

    * ``hopper_forward``: the forward.
    * ``hopper_backward``: the backward's dK/dV kernel.
    * ``hopper_dq``: the backward's dQ kernel.
    * ``hopper_one_pass``: the one-pass backward of ``deterministic=False`` on the Gluon dK/dV kernel.

    The portable kernels:

    * ``one_pass_backward``: how ``deterministic=False`` adds dQ: ``"auto"`` (as measured), ``0`` (two passes),
      ``1`` (``tl.atomic_add`` from the dK/dV kernel), ``2`` (TMA reduce-adds; 1 where TMA cannot run).
    * ``split_head_dim``: a head dim that is not a power of two as two column tiles (``True``), one padded tile
      (``False``), or two tiles for the head dims in a set.
    * ``prefill_split``: the head dims and masks where a prefill whose grid does not fill the GPU takes the
      decoding path's split kernel: ``{head_dim: (causal values...)}``; ``{}`` never.
    * ``concurrent_backward``: the two-pass backward's dQ kernel on a second stream beside dK/dV.
    * ``decode_fused_merge``: decoding merges its splits inside the split kernel where it can (else a combine
      kernel).
    * ``decode_pdl``: decoding's split kernel with programmatic dependent launch (sm_90).

    The host side:

    * ``plans``: replay recorded launch plans (``fa_lib.plan``); ``False`` decides every call anew.
    * ``cached_launch``: relaunch compiled kernels from fa_lib's cache (``fa_lib.launch``); ``False`` goes
      through Triton's launcher every time.
    """

    hopper_forward: str = "auto"
    hopper_backward: str = "auto"
    hopper_dq: str = "auto"
    hopper_one_pass: str = "auto"
    one_pass_backward: object = "auto"
    split_head_dim: object = True
    prefill_split: tuple = ((64, (False, True)), (256, (True,)))
    concurrent_backward: bool = True
    decode_fused_merge: bool = True
    decode_pdl: bool = False
    plans: bool = True
    cached_launch: bool = True

    def __post_init__(self):
        for name in ("hopper_forward", "hopper_backward", "hopper_dq", "hopper_one_pass"):
            if getattr(self, name) not in _ROUTES:
                raise ValueError(f"kernel option {name} must be one of {_ROUTES}, got {getattr(self, name)!r}")
        mode = self.one_pass_backward
        if isinstance(mode, bool) or mode not in ("auto", 0, 1, 2):
            raise ValueError(f'kernel option one_pass_backward must be "auto", 0, 1 or 2, got {mode!r}')
        for name in ("concurrent_backward", "decode_fused_merge", "decode_pdl", "plans", "cached_launch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"kernel option {name} must be True or False, got {getattr(self, name)!r}")

    def prefill_split_masks(self, head_dim):
        """The causal values for which a prefill of this head dim may take the split kernel."""
        for d, masks in self.prefill_split:
            if d == head_dim:
                return masks
        return ()


def _split_head_dim(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, (set, frozenset, tuple, list)) and all(
            isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in value):
        return frozenset(int(d) for d in value)
    raise ValueError(f"kernel option split_head_dim must be True, False or a set of head dims, got {value!r}")


def _prefill_split(value):
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)
    if not isinstance(value, dict) or not all(
            isinstance(d, int) and not isinstance(d, bool) and isinstance(masks, tuple)
            and all(isinstance(m, bool) for m in masks) for d, masks in value.items()):
        raise ValueError(f"kernel option prefill_split must be a dict of head dim (int) -> masks (a tuple of bools: "
                         f"causal or not), got {value!r}")
    return tuple(sorted(value.items()))


_NORMALIZE = {"split_head_dim": _split_head_dim, "prefill_split": _prefill_split}
FIELDS = tuple(f.name for f in dataclasses.fields(KernelOptions))
_INTERNED = {}


def _intern(values):
    """The one KernelOptions object of these field values (so that a plan's key can hold it by identity)."""
    opts = KernelOptions(**values)  # checks every value first
    return _INTERNED.setdefault(tuple(values[name] for name in FIELDS), opts)


DEFAULT = _intern({f.name: f.default for f in dataclasses.fields(KernelOptions)})
_CURRENT = contextvars.ContextVar("fa_lib_kernel_options", default=DEFAULT)


def current():
    """The options in force here: the innermost `kernel_options` block's, else the defaults."""
    return _CURRENT.get()


@contextlib.contextmanager
def kernel_options(**overrides):
    """Within the block, fa_lib's calls in this thread choose their kernels with these options changed (the others
    as they were). See `KernelOptions` for the names and values; an unknown name or a bad value is a ValueError."""
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown kernel option {unknown[0]!r}; the options are: {', '.join(FIELDS)}")
    base = current()
    values = {name: getattr(base, name) for name in FIELDS}
    for name, value in overrides.items():
        values[name] = _NORMALIZE.get(name, lambda v: v)(value)
    token = _CURRENT.set(_intern(values))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def using(opts):
    """Within the block, the options `opts` (a KernelOptions): how a backward runs under its forward's options."""
    if not isinstance(opts, KernelOptions):
        raise TypeError(f"opts must be a fa_lib.options.KernelOptions, got {type(opts).__name__}")
    token = _CURRENT.set(opts)
    try:
        yield opts
    finally:
        _CURRENT.reset(token)
