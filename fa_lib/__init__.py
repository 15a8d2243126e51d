"""fa_lib: FlashAttention, derived and verified.

Two layers, one set of conventions (see the book's introduction):

* ``fa_lib.reference`` -- NumPy, float32/float64, any leading dimensions. The step-by-step mirror
  of the book: naive attention and its explicit backward, safe/online softmax, the (m, l, o) merge,
  the tiled ``flash_forward`` / ``flash_backward`` with an optional per-block ledger.
* ``fa_lib.flash_attention`` -- the Triton kernel (forward and backward) as PyTorch operators with
  autograd; layout ``(batch, heads, seqlen, head_dim)``.
* ``fa_lib.interface`` -- flash-attn 2's API in its ``(batch, seqlen, heads, head_dim)`` layout and argument names
  (``flash_attn_func``, the packed and varlen variants, ``flash_attn_with_kvcache``), re-exported here.

``import fa_lib`` decides, once, whether the Triton kernels run compiled on a CUDA GPU or under
Triton's CPU interpreter (no CUDA device and ``TRITON_INTERPRET`` unset: the interpreter; see
``fa_lib._interpreter``). The kernels themselves are defined the first time ``fa_lib.flash_attention``
(or ``fa_lib.ops``) is touched.
"""
from . import _interpreter
from .options import kernel_options
from .reference import (
    BackwardStep,
    ForwardStep,
    NormalizerStep,
    attention_scores,
    causal_mask,
    flash_backward,
    flash_forward,
    key_padding_bounds,
    kvcache_attention,
    merge_states,
    naive_attention,
    naive_attention_backward,
    online_normalizer,
    online_softmax,
    safe_softmax,
    softmax_state,
    split_bounds,
    tile_classes,
    varlen_attention,
    window_visible,
)

INTERPRET = _interpreter.configure()  # True: fa_lib's Triton kernels run on CPU tensors

__version__ = "0.2.0"

__all__ = [
    "BackwardStep",
    "ForwardStep",
    "INTERPRET",
    "NormalizerStep",
    "attention_scores",
    "causal_mask",
    "flash_attention",
    "kernel_options",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attention_varlen",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attention_with_kvcache",
    "flash_attention_fp8",
    "flash_attn_with_kvcache",
    "flash_backward",
    "flash_forward",
    "key_padding_bounds",
    "kvcache_attention",
    "merge_states",
    "naive_attention",
    "naive_attention_backward",
    "online_normalizer",
    "online_softmax",
    "safe_softmax",
    "softmax_state",
    "split_bounds",
    "tile_classes",
    "varlen_attention",
    "window_visible",
]


_INTERFACE = ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
              "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache")


def __getattr__(name):
    # The torch/Triton half is defined on first use.
    if name in ("flash_attention", "flash_attention_varlen"):
        from . import ops

        globals()[name] = value = getattr(ops, name)  # found directly from now on (no __getattr__ per call)
        return value
    if name in _INTERFACE:
        from . import interface

        globals()[name] = value = getattr(interface, name)
        return value
    # fa_lib.context_parallel.ring_attention, ...; fa_lib.plan.clear; fa_lib.teaching and fa_lib.exercises (the
    # book's kernels and checkers)
    if name in ("context_parallel", "decode", "exercises", "interface", "plan", "teaching"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name == "flash_attention_fp8":
        from . import fp8

        globals()[name] = value = fp8.flash_attention_fp8
        return value
    if name == "flash_attention_with_kvcache":
        from . import decode

        globals()[name] = value = getattr(decode, name)
        return value
    raise AttributeError(f"module 'fa_lib' has no attribute {name!r}")
