"""FlashAttention for PyTorch: launchers, the autograd Function and the public ``flash_attention``.

Four thin layers, read bottom-up from the kernels:

1. ``fa_lib.kernels``: the ``@triton.jit`` kernels.
2. ``_check_inputs`` / ``_forward`` / ``_backward``: launchers. Every input is checked here, with a
   ``TypeError``/``ValueError`` that names the argument, *before* anything is compiled.
3. ``_FlashAttention``: the ``torch.autograd.Function`` (saves q, k, v, o and the LSE, nothing else).
4. ``flash_attention``: the documented public function.

Importing this module imports ``fa_lib.kernels`` first, which switches Triton to its CPU interpreter
when no CUDA device is present (see that module's docstring).
"""
import math
import numbers

import torch

from . import kernels  # first: may set TRITON_INTERPRET before Triton defines any kernel
import triton  # noqa: E402

__all__ = ["flash_attention"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MIN_HEAD_DIM, _MAX_HEAD_DIM = 16, 256

# Test hook: when True, every output buffer (o, lse, delta, dq, dk, dv) starts filled with NaN instead
# of uninitialised memory, so an element a kernel forgets to write shows up. `fa_lib.testing` toggles it.
_POISON_OUTPUTS = False


def _interpreting():
    return kernels.INTERPRET


# ---------------------------------------------------------------------------------------------------
# Layer 2: input checks and launchers.
# ---------------------------------------------------------------------------------------------------
def _shape(t):
    return tuple(t.shape)


def _check_inputs(q, k, v, causal, softmax_scale):
    """Validate the arguments of `flash_attention`; return the softmax scale as a float."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, seqlen, head_dim), "
                             f"got {t.dim()} dimensions with shape {_shape(t)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; flash_attention supports torch.float16, "
                            f"torch.bfloat16 and torch.float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        bad, t = ("k", k) if k.dtype != q.dtype else ("v", v)
        raise TypeError(f"{bad} has dtype {t.dtype} but q has dtype {q.dtype}; q, k and v must share one dtype")
    if k.device != q.device or v.device != q.device:
        bad, t = ("k", k) if k.device != q.device else ("v", v)
        raise ValueError(f"{bad} is on device {t.device} but q is on {q.device}; q, k and v must be on one device")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(f"q, k and v are on device {q.device}, but the Triton kernels run on a CUDA device; move "
                         f"them with .cuda() (on a machine without a GPU, fa_lib uses the Triton interpreter "
                         f"instead: TRITON_INTERPRET=1)")
    B, H_Q, N_Q, D = q.shape
    if _shape(v) != _shape(k):
        raise ValueError(f"v must have the same shape as k, (batch, kv_heads, seqlen_k, head_dim) = {_shape(k)}, "
                         f"got {_shape(v)}")
    if k.shape[0] != B:
        raise ValueError(f"k must have the batch size of q ({B}), got shape {_shape(k)}")
    if k.shape[3] != D:
        raise ValueError(f"k must have the head_dim of q ({D}), got shape {_shape(k)}")
    for name, size in (("batch", B), ("heads", H_Q), ("seqlen_q", N_Q), ("head_dim", D)):
        if size < 1:
            raise ValueError(f"q must have at least one element along every dimension, got {name} = {size} "
                             f"in shape {_shape(q)}")
    if k.shape[1] < 1 or k.shape[2] < 1:
        raise ValueError(f"k must have at least one head and one key, got shape {_shape(k)}")
    if H_Q % k.shape[1] != 0:
        raise ValueError(f"the number of query heads ({H_Q}, q.shape[1]) must be a multiple of the number of "
                         f"key/value heads ({k.shape[1]}, k.shape[1]) for grouped-query attention")
    if not _MIN_HEAD_DIM <= D <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim (q.shape[3]) must be between {_MIN_HEAD_DIM} and {_MAX_HEAD_DIM}, got {D}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if softmax_scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a positive float or None, got {type(softmax_scale).__name__}")
    softmax_scale = float(softmax_scale)
    if not (math.isfinite(softmax_scale) and softmax_scale > 0.0):
        raise ValueError(f"softmax_scale must be a positive finite number or None, got {softmax_scale}")
    return softmax_scale


def _empty(shape, dtype, device):
    if _POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _strides(t):
    return tuple(t.stride())


def _meta(q, causal):
    """Compile-time arguments shared by the four kernels."""
    D = q.shape[3]
    HEAD_DIM = max(16, triton.next_power_of_2(D))  # tile width: a power of two, >= the smallest GPU dot
    return dict(
        HEAD_DIM=HEAD_DIM,
        CAUSAL=causal,
        MASK_D=D != HEAD_DIM,
        # bf16 tl.dot and bf16 rounding are broken under the interpreter (triton issue 11584);
        # emulate them there with float32 arithmetic (see fa_lib.kernels).
        EMULATE_BF16=_interpreting() and q.dtype == torch.bfloat16,
        # float32 inputs: exact float32 products ("ieee"), not TF32 -- correctness first; see
        # `flash_attention`'s docstring. 16-bit inputs ignore this setting.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


def _bucket(n_q, n_k):
    """Autotuning key for the sequence length: nearby lengths share one tuning run."""
    return max(16, triton.next_power_of_2(max(n_q, n_k)))


def _forward(q, k, v, causal, softmax_scale):
    """Launch the forward kernel. Returns o (B, H_q, N_q, D) in q's dtype and lse (B, H_q, N_q) float32."""
    B, H_Q, N_Q, D = q.shape
    H_KV, N_K = k.shape[1], k.shape[2]
    o = _empty((B, H_Q, N_Q, D), q.dtype, q.device)
    lse = _empty((B, H_Q, N_Q), torch.float32, q.device)

    def grid(META):
        return (triton.cdiv(N_Q, META["BLOCK_M"]), H_Q, B)

    kernels._attn_fwd[grid](
        q, k, v, softmax_scale, lse, o,  #
        *_strides(q), *_strides(k), *_strides(v), *_strides(o),  #
        H_Q, H_Q // H_KV, N_Q, N_K, D, _bucket(N_Q, N_K),  #
        **_meta(q, causal))
    return o, lse


def _backward(do, dlse, q, k, v, o, lse, causal, softmax_scale):
    """Launch the three backward kernels. Returns dq, dk, dv with the shapes and dtype of q, k, v."""
    B, H_Q, N_Q, D = q.shape
    H_KV, N_K = k.shape[1], k.shape[2]
    meta = _meta(q, causal)

    # D = rowsum(dO * O) - dLSE, one float32 per query row.
    delta = _empty((B, H_Q, N_Q), torch.float32, q.device)
    PRE_BLOCK = 64
    has_dlse = dlse is not None
    kernels._attn_bwd_preprocess[(triton.cdiv(N_Q, PRE_BLOCK), H_Q, B)](
        o, do, dlse.contiguous() if has_dlse else delta, delta,  #
        *_strides(o), *_strides(do),  #
        H_Q, N_Q, D,  #
        HEAD_DIM=meta["HEAD_DIM"], BLOCK_M=PRE_BLOCK, HAS_DLSE=has_dlse)

    dq = _empty((B, H_Q, N_Q, D), q.dtype, q.device)
    dk = _empty((B, H_KV, N_K, D), k.dtype, k.device)
    dv = _empty((B, H_KV, N_K, D), v.dtype, v.device)
    bucket = _bucket(N_Q, N_K)

    def grid_dkdv(META):
        return (triton.cdiv(N_K, META["BLOCK_N"]), H_KV, B)

    kernels._attn_bwd_dkdv[grid_dkdv](
        q, k, v, do, lse, delta, dk, dv, softmax_scale,  #
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv),  #
        H_Q, H_KV, H_Q // H_KV, N_Q, N_K, D, bucket,  #
        GQA=H_Q != H_KV, **meta)

    def grid_dq(META):
        return (triton.cdiv(N_Q, META["BLOCK_M"]), H_Q, B)

    kernels._attn_bwd_dq[grid_dq](
        q, k, v, do, lse, delta, dq, softmax_scale,  #
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),  #
        H_Q, H_Q // H_KV, N_Q, N_K, D, bucket,  #
        **meta)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------
# Layer 3: autograd.
# ---------------------------------------------------------------------------------------------------
class _FlashAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale):
        o, lse = _forward(q, k, v, causal, softmax_scale)
        ctx.save_for_backward(q, k, v, o, lse)  # the LSE per row is all the backward needs of the softmax
        ctx.causal = causal
        ctx.softmax_scale = softmax_scale
        ctx.set_materialize_grads(False)  # an unused output (often the LSE) gets grad None, not zeros
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:  # only the LSE was differentiated
            do = torch.zeros_like(o)
        dq, dk, dv = _backward(do, dlse, q, k, v, o, lse, ctx.causal, ctx.softmax_scale)
        return dq, dk, dv, None, None


# ---------------------------------------------------------------------------------------------------
# Layer 4: the public function.
# ---------------------------------------------------------------------------------------------------
def flash_attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False):
    """Exact attention ``softmax(scale * q @ k^T) @ v`` with the FlashAttention algorithm (Triton).

    Never forms the ``(seqlen_q, seqlen_k)`` score matrix: the forward pass streams key blocks through
    an online softmax and saves one log-sum-exp per query row; the backward pass recomputes the
    probabilities from it. Differentiable through ``torch.autograd``; the backward is deterministic
    (no atomics: gradients are bitwise identical from run to run).

    Args:
        q: queries, shape ``(batch, heads_q, seqlen_q, head_dim)``.
        k: keys, shape ``(batch, heads_kv, seqlen_k, head_dim)``. ``heads_q`` must be a multiple of
            ``heads_kv``: query head ``h`` attends with key/value head ``h // (heads_q // heads_kv)``
            (grouped-query attention; ``heads_kv == 1`` is multi-query attention).
        v: values, shape ``(batch, heads_kv, seqlen_k, head_dim)``, like ``k``.
            All three share one dtype (``torch.float16``, ``torch.bfloat16`` or ``torch.float32``)
            and one device (CUDA; CPU only under the Triton interpreter, which fa_lib selects by
            itself on a machine without CUDA). Any ``seqlen_q, seqlen_k >= 1`` and any
            ``16 <= head_dim <= 256`` (not only powers of two); any strides, e.g. a
            ``.transpose(1, 2)`` view of ``(batch, seqlen, heads, head_dim)`` storage.
        causal: default ``False``. If ``True``, apply a causal mask aligned to the bottom-right
            corner of the score matrix, as flash-attn 2.1+ does: query ``i`` sees key ``j`` iff
            ``j <= i + seqlen_k - seqlen_q``. With ``seqlen_q == seqlen_k`` this is the usual
            lower-triangular mask. For example (``x`` = visible)::

                seqlen_q = 2, seqlen_k = 5        seqlen_q = 5, seqlen_k = 2
                        k0 k1 k2 k3 k4                    k0 k1
                    q0   x  x  x  x  .                q0   .  .    <- sees no key
                    q1   x  x  x  x  x                q1   .  .    <- sees no key
                                                      q2   .  .    <- sees no key
                                                      q3   x  .
                                                      q4   x  x

            A query row that sees no key gets output 0, LSE ``-inf`` and zero gradients (never NaN).
        softmax_scale: default ``None``, meaning ``1 / sqrt(head_dim)``. Otherwise a positive finite
            number multiplying ``q @ k^T`` before the softmax.
        return_lse: default ``False``. If ``True``, also return the natural-log log-sum-exp of each
            query row's scaled scores, ``lse[b, h, i] = log(sum_j exp(scale * q_i . k_j))`` over the
            visible keys, float32 of shape ``(batch, heads_q, seqlen_q)``. It is differentiable too.

    Returns:
        ``o`` of shape ``(batch, heads_q, seqlen_q, head_dim)`` in the dtype of ``q`` (contiguous),
        or ``(o, lse)`` when ``return_lse=True``.

    Precision: products of 16-bit inputs run on the tensor cores with float32 accumulation, and the
    softmax is in float32. float32 inputs use exact float32 products (Triton's ``"ieee"``), not
    TF32: several times slower on a GPU, but as accurate as PyTorch's float32 attention.

    Raises:
        TypeError: a non-tensor input, an unsupported or mismatched dtype, a non-bool ``causal``.
        ValueError: wrong rank or shapes, ``heads_q`` not a multiple of ``heads_kv``, ``head_dim``
            outside ``[16, 256]``, an empty dimension, mismatched devices, CPU tensors with no
            interpreter, a non-positive ``softmax_scale``.

    Example::

        q = torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 2, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        o = flash_attention(q, k, v, causal=True)   # (2, 8, 1024, 64)
        o.sum().backward()
    """
    softmax_scale = _check_inputs(q, k, v, causal, softmax_scale)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    o, lse = _FlashAttention.apply(q, k, v, causal, softmax_scale)
    return (o, lse) if return_lse else o
