"""FP8 (e4m3) attention forward for Hopper (sm_90), in Triton: ``flash_attention_fp8``.

The oracle is ``fa_lib.reference.fp8_attention`` and the rule ``fa_lib.reference.fp8_error_bound``; this
module is the kernel that meets them. Reading order:

1. ``_round_p``: P in [0, 1] rounded to e4m3 for the P @ V product (and, under the interpreter, the same
   rounding done by hand, since the interpreter's float32 -> float8 cast truncates).
2. ``_attn_fwd_fp8_inner`` / ``_attn_fwd_fp8``: the forward of ``fa_lib.kernels._attn_fwd`` (online
   softmax in base 2, deferred normalisation, causal blocks cut by ``kernels._key_blocks``) with FP8 tiles:
   ``S = q8 @ k8^T`` in float32, scaled by ``q_descale * k_descale * softmax_scale``; ``P = exp(S - m)``
   rounded to e4m3 for ``acc += P8 @ v8``, while the row sum ``l`` adds the unrounded P; at the end
   ``O = acc * v_descale / l``.
3. ``_check_fp8_inputs`` / ``_check_descale``: the input checks, with messages that name the argument.
4. ``flash_attention_fp8``: the public function (forward only).

V is read transposed. Hopper's FP8 matrix multiply (wgmma) takes its B operand from shared memory with the
reduction axis contiguous ("K-major"). For ``S = Q K^T`` that is K's head dim, already contiguous; for
``O = P V`` it is the key axis, so the launcher passes V as ``(B, H_kv, head_dim, N_k)`` with the keys
contiguous (one copy of V per call), as Triton's fused-attention tutorial does for FP8.
"""

import torch

# first: fa_lib.kernels defines the kernels, and decides the mode (compiled or interpreted), at import
from .kernels import INTERPRET, LN2, LOG2E, _key_blocks, _load, _round, _visible
from .checks import PerTensor, _check_4d_tensors, _check_bool, _check_placement_and_shapes, _shape, _type_name
from .dispatch import _cdiv, _next_pow2
from .launch import _device_guard, _empty

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["flash_attention_fp8"]

FP8_DTYPE = torch.float8_e4m3fn  # e4m3, no infinity, largest 448: Triton's tl.float8e4nv
OUT_DTYPES = (torch.bfloat16, torch.float16)

# Block sizes (BLOCK_M, BLOCK_N, num_warps, num_stages) by head-dim tile. On a GPU: 128 x 128 tiles and 8 warps
# (two warpgroups of 64 query rows each) up to a 128-wide head, with 3 stages of K and V in flight
# (q 16 KiB + 3 x (16 + 16) KiB of shared memory at d = 128); a 256-wide head halves BLOCK_N so that its
# accumulator (128 x 256 float32, 128 registers a thread) and its stages still fit. The head-dim tile is at
# least 32 on a GPU, the K of one FP8 wgmma. These are the shapes of Triton's fused-attention tutorial, chosen
# without timing them here; `python -m benchmarks.bench_fp8 --config BM,BN,W,S` times another one at d = 128.
# Compiled for sm_90 (ptxas -v), d = 128 uses 253 registers a thread without spills (causal: 255, 112 bytes
# spilled), d = 256 causal spills 260 bytes. Under the interpreter, one small configuration (BLOCK_M != BLOCK_N
# on purpose: the causal bounds must not rely on square tiles).
GPU_CONFIGS = {32: (128, 128, 8, 3), 64: (128, 128, 8, 3), 128: (128, 128, 8, 3), 256: (128, 64, 8, 2)}
INTERPRETER_CONFIG = (32, 16, 4, 1)
_MIN_TILE = 16 if INTERPRET else 32


def head_dim_tile(head_dim):
    """The tile width of a head dim: the power of two >= head_dim, at least 16 (interpreter) or 32 (GPU: the
    K of one FP8 wgmma); the columns past head_dim are masked and read as zeros."""
    return max(_next_pow2(head_dim), _MIN_TILE)


def block_config(head_dim):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a launch for this head dim."""
    return INTERPRETER_CONFIG if INTERPRET else GPU_CONFIGS[head_dim_tile(head_dim)]


# ---------------------------------------------------------------------------------------------------
# Layer 1: the kernel.
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _round_p(p, EMULATE_FP8: tl.constexpr):
    """P (float32, in [0, 1]) rounded to e4m3 to nearest even, as the P @ V operand.

    On a GPU: a cast to float8e4nv (cvt.rn.satfinite). EMULATE_FP8 (the interpreter, whose float32 -> float8
    cast truncates): the same rounding by arithmetic, returned as float16 (every e4m3 number is a float16
    number, so the product below stays exact). At or above 2^-6 (e4m3's normal numbers) the float32 mantissa
    is rounded to 3 bits (add half a unit, ties to even, clear the low 20 bits); below it (subnormals, steps of
    2^-9) p * 2^9 is rounded to an integer by adding and subtracting 2^23, where float32's spacing is 1."""
    if EMULATE_FP8:
        bits = p.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFFF + ((bits >> 20) & 1)
        normal = ((bits >> 20) << 20).to(tl.float32, bitcast=True)
        subnormal = ((p * 512.0 + 8388608.0) - 8388608.0) * 0.001953125  # 2^9, 2^23, 2^-9
        return tl.where(p < 0.015625, subnormal, normal).to(tl.float16)  # 0.015625 = 2^-6
    else:
        return p.to(tl.float8e4nv)


@triton.jit
def _attn_fwd_fp8_inner(acc, l_i, m_i, q, K_head, VT_head, kT_offs, vT_offs, stride_kn, stride_vn,  #
                        lo, hi, qk_scale, offs_m, offs_d, diag_right, N_K, head_dim,  #
                        BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, MASK_D: tl.constexpr,
                        EMULATE_FP8: tl.constexpr):
    """Online softmax over the key blocks [lo, hi), as ``kernels._attn_fwd_inner``. MASK: the blocks hold the
    causal diagonal or the tail. P is rounded to e4m3 for the product with V; l_i sums the unrounded P."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        kT = _load(K_head + start_n.to(tl.int64) * stride_kn + kT_offs, offs_d, cols, head_dim, N_K, MASK_D,
                   MASK)  # (HEAD_DIM, BLOCK_N) e4m3
        qk = tl.dot(q, kT)  # (BLOCK_M, BLOCK_N) float32: the e4m3 products are exact
        if MASK:
            visible = _visible(offs_m, cols, N_K, diag_right, diag_right, K_head, CAUSAL, False, False)
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            # A row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
            m_ij_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            qk -= m_ij_safe[:, None]
        else:
            # Every score is finite here; scaling after the max saves a multiply (qk_scale > 0).
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_ij_safe = m_ij
            qk = qk * qk_scale - m_ij[:, None]
        p = tl.math.exp2(qk)  # in [0, 1]
        alpha = tl.math.exp2(m_i - m_ij_safe)
        l_i = l_i * alpha + tl.sum(p, 1)  # the unrounded P, as the reference's l
        acc = acc * alpha[:, None]
        vT = _load(VT_head + start_n.to(tl.int64) * stride_vn + vT_offs, offs_d, cols, head_dim, N_K, MASK_D,
                   MASK)  # (HEAD_DIM, BLOCK_N) e4m3, keys contiguous
        if EMULATE_FP8:
            v = tl.trans(vT).to(tl.float16)  # exact
        else:
            v = tl.trans(vT)  # (BLOCK_N, HEAD_DIM): the K-major B operand of the FP8 wgmma
        acc = tl.dot(_round_p(p, EMULATE_FP8), v, acc)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def _attn_fwd_fp8(Q, K, VT, QD, KD, VD, sm_scale, LSE, Out,  #
                  stride_qz, stride_qh, stride_qm, stride_qd,  #
                  stride_kz, stride_kh, stride_kn, stride_kd,  #
                  stride_vz, stride_vh, stride_vd, stride_vn,  #
                  stride_oz, stride_oh, stride_om, stride_od,  #
                  stride_qdz, stride_qdh, stride_kdz, stride_kdh, stride_vdz, stride_vdh,  #
                  stride_lz, stride_lh,  #
                  GROUP, N_Q, N_K, head_dim,  #
                  HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASK_D: tl.constexpr,  #
                  EMULATE_FP8: tl.constexpr, EMULATE_BF16: tl.constexpr,  #
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(N_Q, BLOCK_M), H_Q, batch). Q (B, H_Q, N_Q, head_dim) and K (B, H_KV, N_K, head_dim) in e4m3,
    any strides; VT (B, H_KV, head_dim, N_K) in e4m3, V with its keys along the last axis (stride_vn);
    QD, KD, VD the descales (B, H_KV) float32, indexed by the key/value head (strides 0 for one per tensor).
    Writes Out (B, H_Q, N_Q, head_dim) and the natural-log LSE (B, H_Q, N_Q) float32. CAUSAL: query i sees
    key j iff j <= i + N_K - N_Q (bottom-right); a row that sees no key gets o = 0 and LSE = -inf."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and HEAD_DIM >= 16)  # smallest dot tile
    start_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_z = tl.program_id(2).to(tl.int64)
    off_h_kv = (off_h // GROUP).to(tl.int64)  # grouped-query attention: GROUP query heads share one k/v head
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + off_z * stride_qz + off_h.to(tl.int64) * stride_qh \
        + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd  # (BLOCK_M, HEAD_DIM)
    K_head = K + off_z * stride_kz + off_h_kv * stride_kh
    VT_head = VT + off_z * stride_vz + off_h_kv * stride_vh
    kT_offs = offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn  # K^T tiles (HEAD_DIM, BLOCK_N)
    vT_offs = offs_d[:, None] * stride_vd + offs_n[None, :] * stride_vn  # V^T tiles (HEAD_DIM, BLOCK_N)

    q_descale = tl.load(QD + off_z * stride_qdz + off_h_kv * stride_qdh)
    k_descale = tl.load(KD + off_z * stride_kdz + off_h_kv * stride_kdh)
    v_descale = tl.load(VD + off_z * stride_vdz + off_h_kv * stride_vdh)
    # The dot gives q8 . k8; the score is q8 . k8 * q_descale * k_descale * softmax_scale, in base 2.
    qk_scale = q_descale * k_descale * sm_scale * LOG2E

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")  # running max (base-2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i), unrounded
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running sum of e4m3(exp2(s - m_i)) v8
    q = _load(q_ptrs, offs_m, offs_d, N_Q, head_dim, True, MASK_D)  # stays on chip for the whole loop

    lo, n_lfull, n_full, hi, diag_right, diag_left = _key_blocks(start_m, N_Q, N_K, 0, 0, Q, off_z, BLOCK_M,
                                                                 BLOCK_N, CAUSAL, False, False, False)
    # Whole blocks that every row sees: unmasked.
    acc, l_i, m_i = _attn_fwd_fp8_inner(acc, l_i, m_i, q, K_head, VT_head, kT_offs, vT_offs, stride_kn, stride_vn,
                                        lo, n_full, qk_scale, offs_m, offs_d, diag_right, N_K, head_dim,
                                        BLOCK_N, False, CAUSAL, MASK_D, EMULATE_FP8)
    # The diagonal band (causal) and the partial last block: masked.
    acc, l_i, m_i = _attn_fwd_fp8_inner(acc, l_i, m_i, q, K_head, VT_head, kT_offs, vT_offs, stride_kn, stride_vn,
                                        n_full, hi, qk_scale, offs_m, offs_d, diag_right, N_K, head_dim,
                                        BLOCK_N, True, CAUSAL, MASK_D, EMULATE_FP8)

    # Epilogue: deferred normalisation and the value descale, once per row. l_i == 0 iff the row saw no key.
    empty = l_i == 0.0
    acc = acc * (v_descale / tl.where(empty, 1.0, l_i))[:, None]
    lse = (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2  # natural log m + log(l); -inf if empty
    tl.store(LSE + off_z * stride_lz + off_h.to(tl.int64) * stride_lh + offs_m, lse, mask=offs_m < N_Q)
    o_ptrs = Out + off_z * stride_oz + off_h.to(tl.int64) * stride_oh \
        + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, _round(acc, Out.type.element_ty, EMULATE_BF16),
             mask=(offs_m[:, None] < N_Q) & (offs_d[None, :] < head_dim))


# ---------------------------------------------------------------------------------------------------
# Layer 2: input checks and the launcher.
# ---------------------------------------------------------------------------------------------------
def _check_fp8_inputs(q, k, v, causal, softmax_scale, return_lse, out_dtype):
    """Validate the arguments of `flash_attention_fp8` but the descales; return the softmax scale as a float."""
    _check_4d_tensors(q, k, v, "a torch.Tensor of dtype torch.float8_e4m3fn")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != FP8_DTYPE:
            raise TypeError(f"{name} has dtype {t.dtype}; flash_attention_fp8 takes torch.float8_e4m3fn inputs "
                            f"(quantize them first, e.g. (x / descale).to(torch.float8_e4m3fn)); for 16-bit "
                            f"inputs use fa_lib.flash_attention")
    scale = _check_placement_and_shapes(q, k, v, causal, softmax_scale, fn="flash_attention_fp8")
    if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(q.device)
        raise ValueError(f"q is on {q.device}, a GPU of compute capability {major}.{minor}; FP8 matrix products "
                         f"need 8.9 or later (Ada, Hopper: sm_90, which this kernel is built for)")
    _check_bool("return_lse", return_lse)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype!r}")
    return scale


# Descale tensors on a GPU whose values were checked, once per tensor and version (a read is a synchronisation).
_CHECKED_DESCALES = PerTensor()


def _check_descale(name, descale, q, heads_kv):
    """A descale: None (1.0), or a float32 tensor on q's device of one element (per tensor) or of shape
    (batch, heads_kv) (per batch and key/value head, FlashAttention-3's layout), positive and finite.
    Returns it as a (batch, heads_kv) view (strides 0 for one element)."""
    batch = q.shape[0]
    if descale is None:
        return torch.ones((), dtype=torch.float32, device=q.device).expand(batch, heads_kv)
    if not isinstance(descale, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype torch.float32 (one element, or shape (batch, "
                        f"heads_kv) = ({batch}, {heads_kv})) or None, got {_type_name(descale)}")
    if descale.dtype != torch.float32:
        raise TypeError(f"{name} must have dtype torch.float32, got {descale.dtype}")
    if descale.device != q.device:
        raise ValueError(f"{name} is on device {descale.device} but q is on {q.device}")
    if descale.numel() == 1 and descale.dim() <= 1:
        out = descale.reshape(()).expand(batch, heads_kv)
    elif _shape(descale) == (batch, heads_kv):
        out = descale
    else:
        raise ValueError(f"{name} must have one element (per tensor: shape () or (1,)) or shape (batch, "
                         f"heads_kv) = ({batch}, {heads_kv}) (per batch and key/value head), got shape "
                         f"{_shape(descale)}")
    if descale.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad, but flash_attention_fp8 is forward only (no gradients); "
                         f"pass {name}.detach()")
    if torch.compiler.is_compiling():  # values cannot be read while tracing
        return out
    if descale.is_cuda:
        _CHECKED_DESCALES.get(descale, lambda t: _check_descale_values(name, t))
    else:  # (a CPU tensor: no synchronisation to save)
        _check_descale_values(name, descale)
    return out


def _check_descale_values(name, descale):
    if descale.numel() and not bool(torch.all(torch.isfinite(descale) & (descale > 0))):  # one host copy
        raise ValueError(f"{name} must be positive and finite (x = x8 * descale), got "
                         f"{descale.detach().cpu().flatten()[:8].tolist()}")


def _values_keys_contiguous(v):
    """V as (B, H_kv, head_dim, N_k) with the keys contiguous (the K-major B operand of O = P V), its rows
    padded to a multiple of 16 keys so that every row starts 16-byte aligned; returns the transposed view
    (B, H_kv, N_k, head_dim) of that storage, whose strides the kernel takes."""
    B, H, N, D = v.shape
    vT = torch.empty((B, H, D, _cdiv(N, 16) * 16), dtype=v.dtype, device=v.device)
    vT[..., :N].copy_(v.transpose(-1, -2))
    return vT[..., :N].transpose(-1, -2)  # (B, H, N, D), stride 1 along the keys


def _forward_fp8(q, k, v, qd, kd, vd, causal, softmax_scale, out_dtype):
    """Launch `_attn_fwd_fp8`; return (o, lse)."""
    B, H_Q, N_Q, D = q.shape
    H_KV, N_K = k.shape[1], k.shape[2]
    o = _empty((B, H_Q, N_Q, D), out_dtype, q.device)
    lse = _empty((B, H_Q, N_Q), torch.float32, q.device)
    if B == 0 or N_Q == 0:
        return o, lse
    if N_K == 0:  # no key at all: every row is empty
        return o.zero_(), lse.fill_(float("-inf"))
    # The FP8 wgmma reads its operands from shared memory with the reduction axis (here head_dim) contiguous:
    # q and k in any other layout are copied (a (B, N, H, d) view keeps its storage: its head_dim is contiguous).
    q, k = (x if x.stride(3) == 1 else x.contiguous() for x in (q, k))
    v_kn = _values_keys_contiguous(v)
    tile = head_dim_tile(D)
    block_m, block_n, num_warps, num_stages = block_config(D)
    grid = (_cdiv(N_Q, block_m), H_Q, B)
    with _device_guard(q):
        _attn_fwd_fp8[grid](
            q, k, v_kn, qd, kd, vd, softmax_scale, lse, o,
            *q.stride(), *k.stride(), v_kn.stride(0), v_kn.stride(1), v_kn.stride(3), v_kn.stride(2),
            *o.stride(), *qd.stride(), *kd.stride(), *vd.stride(), lse.stride(0), lse.stride(1),
            H_Q // H_KV, N_Q, N_K, D,
            HEAD_DIM=tile, CAUSAL=causal, MASK_D=tile != D, EMULATE_FP8=INTERPRET,
            EMULATE_BF16=INTERPRET and out_dtype == torch.bfloat16,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)
    return o, lse


# ---------------------------------------------------------------------------------------------------
# Layer 4: the public function (forward only: no autograd layer).
# ---------------------------------------------------------------------------------------------------
def flash_attention_fp8(q, k, v, *, q_descale=None, k_descale=None, v_descale=None, causal=False,
                        softmax_scale=None, return_lse=False, out_dtype=torch.bfloat16):
    """Attention of FP8 (e4m3) inputs, ``softmax(scale * q @ k^T) @ v`` of the dequantized tensors
    ``q = q8 * q_descale`` (and k, v alike), with the FlashAttention algorithm and FP8 matrix products
    (Triton; built for Hopper, sm_90). Forward only.

    Args:
        q: queries, shape ``(batch, heads_q, seqlen_q, head_dim)``, dtype ``torch.float8_e4m3fn``.
        k: keys, shape ``(batch, heads_kv, seqlen_k, head_dim)``, ``torch.float8_e4m3fn``. ``heads_q`` must be a
            multiple of ``heads_kv``: query head ``h`` attends with key/value head ``h // (heads_q // heads_kv)``
            (grouped-query attention).
        v: values, the shape and dtype of ``k``. All three on one device (a CUDA GPU of compute capability
            8.9 or later; CPU only under the Triton interpreter), any strides (a q or k whose head_dim is not
            contiguous is copied first), any ``1 <= head_dim <= 256`` (tiles are a power of two >= 32 wide on
            a GPU, the extra columns masked; 64, 128 and 256 are the sizes it is built for), any
            ``batch, seqlen_q, seqlen_k >= 0``. V is copied once per call into a layout with the keys
            contiguous (the FP8 matrix product's operand layout).
        q_descale, k_descale, v_descale: default ``None`` (1.0). The factors that undo each input's
            quantization, ``x ≈ x8 * descale`` (FlashAttention-3's arguments): a ``torch.float32`` tensor on
            q's device, either one element (per tensor, shape ``()`` or ``(1,)``) or of shape
            ``(batch, heads_kv)`` (per batch and key/value head; ``q_descale`` too is indexed by the
            key/value head of each query head). Positive and finite (checked once per tensor on a GPU, and
            again after an in-place change). ``fa_lib.reference.quantize_e4m3`` makes such pairs.
        causal: default ``False``. If ``True``, a causal mask aligned to the bottom-right corner, as
            ``fa_lib.flash_attention`` (whose docstring draws it for ``seqlen_q < seqlen_k`` and
            ``seqlen_q > seqlen_k``): query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``. A query
            row that sees no key gets output 0 and LSE ``-inf`` (never NaN).
        softmax_scale: default ``None``, meaning ``1 / sqrt(head_dim)``; otherwise a positive finite number.
        return_lse: default ``False``. If ``True``, also return the natural-log log-sum-exp of each row's
            dequantized scores, ``lse = m + log(l)``, float32 of shape ``(batch, heads_q, seqlen_q)``.
        out_dtype: ``torch.bfloat16`` (default) or ``torch.float16``, the dtype of the output.

    Returns:
        ``o`` of shape ``(batch, heads_q, seqlen_q, head_dim)`` in ``out_dtype``, or ``(o, lse)``.

    What it computes: per key block, ``S = (q8 @ k8^T) * q_descale * k_descale * softmax_scale`` from an FP8
    matrix product with float32 results, the online softmax of ``fa_lib.flash_attention`` (base 2, running
    max ``m`` and sum ``l``), ``P = exp(S - m)`` in [0, 1] rounded to e4m3 for ``acc += P8 @ v8`` (the FP8
    product needs both operands in FP8, as FlashAttention-3), while ``l`` adds the unrounded ``P``; at the end
    ``o = acc * v_descale / l``. ``m`` is the running maximum, so a P rounded before the row's maximum
    arrived is rescaled after rounding (FlashAttention-3 does the same); the rule below holds either way.

    Correctness rule (``tests/library/test_fp8_kernel.py``): elementwise
    ``|o - o_ref| <= fa_lib.reference.fp8_error_bound(q8, k8, v8, q_descale, k_descale, v_descale, ...)``
    with ``o_ref = fa_lib.reference.fp8_attention(..., quantize_p=False)``, the exact float64 attention of
    the dequantized inputs. The bound is derived from e4m3's rounding of P, not tuned: each P moves by at
    most ``max(2^-4 P, 2^-10)`` (relative error of a normal e4m3 number, absolute error of a subnormal),
    summed over the keys with weights ``|v_j| / l``, plus the output's rounding (``2^-8 |o_ref|`` for
    bfloat16) and ``1e-6 max|v|`` for float32 accumulation. The error of the inputs' own quantization is
    the caller's: the reference starts from the same e4m3 values. The LSE carries no rounding of P: it
    differs from the reference's by the scores' arithmetic only (float32 under the interpreter: within
    1e-5 relative plus 1e-4 in the tests). On sm_90 the FP8 products accumulate as Triton's FP8 dots do by
    default there, with the tensor cores' fast accumulation, coarser than float32, which the bound does not
    itemize: the GPU test checks the bound at full size.

    Speed is counted as ``4 * batch * heads_q * head_dim * (visible query-key pairs)`` FLOPs per forward
    (bottom-right causal: about half of ``seqlen_q * seqlen_k``), as for ``fa_lib.flash_attention``
    (``benchmarks/bench_fp8.py``).

    Raises:
        TypeError: a non-tensor input, a dtype other than ``torch.float8_e4m3fn``, a descale that is not a
            float32 tensor, a non-bool flag, an ``out_dtype`` other than bfloat16 or float16.
        ValueError: wrong rank or shapes, ``heads_q`` not a multiple of ``heads_kv``, ``head_dim`` outside
            ``[1, 256]``, mismatched devices (descales included), meta tensors, CPU tensors with no interpreter,
            a GPU older than compute capability 8.9, a descale of the wrong shape or not positive and finite
            or requiring grad, a non-positive ``softmax_scale``.

    Example::

        def quantize(x):  # per tensor: its largest magnitude maps to e4m3's largest, 448
            descale = x.abs().amax().float() / 448
            return (x.float() / descale).to(torch.float8_e4m3fn), descale

        (q8, qd), (k8, kd), (v8, vd) = quantize(q), quantize(k), quantize(v)  # q, k, v: bfloat16, (B, H, N, d)
        o = flash_attention_fp8(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
        # o: bfloat16, (batch, heads_q, seqlen_q, head_dim)
    """
    softmax_scale = _check_fp8_inputs(q, k, v, causal, softmax_scale, return_lse, out_dtype)
    heads_kv = k.shape[1]
    qd = _check_descale("q_descale", q_descale, q, heads_kv)
    kd = _check_descale("k_descale", k_descale, q, heads_kv)
    vd = _check_descale("v_descale", v_descale, q, heads_kv)
    o, lse = _forward_fp8(q, k, v, qd, kd, vd, causal, softmax_scale, out_dtype)
    return (o, lse) if return_lse else o


if INTERPRET:  # every launch leaves triton.language as it found it (fa_lib._interpreter)
    from ._interpreter import contain_module as _contain_module

    _contain_module(globals())
