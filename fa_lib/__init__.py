"""fa_lib: FlashAttention, derived and verified.

Two layers, one set of conventions (see the book's introduction):

* ``fa_lib.reference`` -- NumPy, float32/float64, any leading dimensions. The step-by-step mirror
  of the book: naive attention and its explicit backward, safe/online softmax, the (m, l, o) merge,
  the tiled ``flash_forward`` / ``flash_backward`` with an optional per-block ledger.
* ``fa_lib.flash_attention`` -- the Triton kernel (forward and backward) behind a
  ``torch.autograd.Function``; layout ``(batch, heads, seqlen, head_dim)``.

``import fa_lib`` is cheap: it imports NumPy only. torch and Triton are imported the first time
``fa_lib.flash_attention`` (or ``fa_lib.ops``) is touched; on a machine without CUDA, fa_lib then
switches Triton to its CPU interpreter before any kernel is defined.
"""
from .reference import (
    BackwardStep,
    ForwardStep,
    NormalizerStep,
    attention_scores,
    causal_mask,
    flash_backward,
    flash_forward,
    merge_states,
    naive_attention,
    naive_attention_backward,
    online_normalizer,
    online_softmax,
    safe_softmax,
    softmax_state,
)

__version__ = "0.1.0"

__all__ = [
    "BackwardStep",
    "ForwardStep",
    "NormalizerStep",
    "attention_scores",
    "causal_mask",
    "flash_attention",
    "flash_backward",
    "flash_forward",
    "merge_states",
    "naive_attention",
    "naive_attention_backward",
    "online_normalizer",
    "online_softmax",
    "safe_softmax",
    "softmax_state",
]


def __getattr__(name):
    # Lazy: the torch/Triton half is loaded on first use, so NumPy-only users never pay for it.
    if name == "flash_attention":
        from .ops import flash_attention

        return flash_attention
    raise AttributeError(f"module 'fa_lib' has no attribute {name!r}")
