"""FlashAttention-2 in three small Triton kernels, written to be read.

The kernels of ``fa_lib.kernels`` are built for speed: fixed block tables, masks only
where a tile needs one, grouped-query attention, head dims that are not powers of two,
sliding windows, padding masks, packed sequences, bfloat16 emulation under the
interpreter. This module holds the same algorithm with none of that, so that each kernel
fits on one screen:

* ``_teaching_fwd``: one program per (query block, batch * head). It streams the key
  blocks through an online softmax in base 2 (``exp2``), divides by the running sum once
  at the end, and stores the output and the natural-log LSE of every row.
* ``_teaching_bwd_dkdv``: one program per key block; it loops over the query blocks,
  recomputes ``P = exp(S - LSE)`` from the saved LSE and accumulates ``dV = P^T dO`` and
  ``dK = scale dS^T Q``.
* ``_teaching_bwd_dq``: one program per query block; it loops over the key blocks and
  accumulates ``dQ = scale dS K``.

Both backward kernels use ``D = rowsum(dO * O)``, which ``teaching_backward`` computes
in PyTorch.

Conventions are fa_lib's: tensors ``(B, H, N, d)``; the causal mask is aligned
bottom-right (query ``i`` sees key ``j`` iff ``j <= i + N_K - N_Q``); a row that sees no
key gets output 0, LSE ``-inf`` and zero gradients. The launchers copy their inputs to
contiguous memory, so a row of a head starts every ``d`` elements and the kernels need
no strides. ``d`` must be a power of two from 16 to 128. Inputs are float32 or float16
(and bfloat16 on a GPU; the Triton interpreter multiplies bfloat16 tiles wrongly, see
``fa_lib.kernels``).
"""
# fa_lib.kernels first: it picks the GPU or the interpreter before Triton is imported.
from .kernels import INTERPRET, LN2, LOG2E

import math  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["BLOCKS", "BLOCKS_FP32", "teaching_backward", "teaching_forward"]

# (BLOCK_M, BLOCK_N, num_warps) of each kernel: BLOCK_M query rows and BLOCK_N keys per
# tile. Under the interpreter the tiles are small and not square, so that no loop bound
# can rely on BLOCK_M == BLOCK_N. On a GPU float32 tiles take twice the shared memory of
# 16-bit ones and get smaller blocks (BLOCKS_FP32).
if INTERPRET:
    BLOCKS = {"fwd": (32, 16, 4), "dkdv": (16, 32, 4), "dq": (32, 16, 4)}
else:
    BLOCKS = {"fwd": (128, 64, 8), "dkdv": (64, 64, 4), "dq": (64, 64, 4)}
BLOCKS_FP32 = BLOCKS if INTERPRET else {"fwd": (64, 32, 4), "dkdv": (32, 64, 4),
                                        "dq": (64, 32, 4)}


@triton.jit
def _teaching_fwd(Q, K, V, O, LSE, N_Q, N_K, qk_scale, CAUSAL: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  PRECISION: tl.constexpr):
    """O and LSE for BLOCK_M query rows of one (batch, head).

    Grid (cdiv(N_Q, BLOCK_M), B * H). Q, O: (B * H, N_Q, HEAD_DIM); K, V: (B * H, N_K,
    HEAD_DIM); LSE: (B * H, N_Q); all contiguous. qk_scale = softmax scale / ln 2."""
    start_m = tl.program_id(0)  # which block of query rows
    bh = tl.program_id(1).to(tl.int64)  # which (batch, head)
    Q, O, LSE = Q + bh * N_Q * HEAD_DIM, O + bh * N_Q * HEAD_DIM, LSE + bh * N_Q
    K, V = K + bh * N_K * HEAD_DIM, V + bh * N_K * HEAD_DIM
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q_offs = rows[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(Q + q_offs, mask=rows[:, None] < N_Q, other=0.0)  # (BLOCK_M, HEAD_DIM)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running maximum (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # unnormalised output
    hi = N_K
    if CAUSAL:  # no row of this block sees a key past its last row's diagonal
        hi = tl.minimum((start_m + 1) * BLOCK_M + N_K - N_Q, N_K)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kT = tl.load(K + cols[None, :] * HEAD_DIM + dims[:, None],
                     mask=cols[None, :] < N_K, other=0.0)  # (HEAD_DIM, BLOCK_N): K^T
        v = tl.load(V + cols[:, None] * HEAD_DIM + dims[None, :],
                    mask=cols[:, None] < N_K, other=0.0)  # (BLOCK_N, HEAD_DIM)
        s = tl.dot(q, kT, input_precision=PRECISION) * qk_scale  # base-2 scores
        visible = cols[None, :] < N_K
        if CAUSAL:  # bottom-right: row i sees key j iff j <= i + N_K - N_Q
            visible = visible & (cols[None, :] <= rows[:, None] + N_K - N_Q)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)  # rescales the old state; 0 in the first block
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row that saw no key: o = 0, lse = -inf
    o = acc / l_safe[:, None]
    tl.store(O + q_offs, o.to(O.dtype.element_ty), mask=rows[:, None] < N_Q)
    lse = (m_i + tl.log2(l_safe)) * LN2  # back to natural log
    tl.store(LSE + rows, lse, mask=rows < N_Q)


@triton.jit
def _teaching_bwd_dkdv(Q, K, V, DO, LSE, Delta, DK, DV, N_Q, N_K, sm_scale,
                       CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr):
    """dK and dV for BLOCK_N keys of one (batch, head).

    Grid (cdiv(N_K, BLOCK_N), B * H). Layouts as in _teaching_fwd; DO like Q; DK, DV
    like K; Delta = rowsum(dO * O) like LSE."""
    start_n = tl.program_id(0)  # which block of keys
    bh = tl.program_id(1).to(tl.int64)
    Q, DO = Q + bh * N_Q * HEAD_DIM, DO + bh * N_Q * HEAD_DIM
    LSE, Delta = LSE + bh * N_Q, Delta + bh * N_Q
    K, V = K + bh * N_K * HEAD_DIM, V + bh * N_K * HEAD_DIM
    DK, DV = DK + bh * N_K * HEAD_DIM, DV + bh * N_K * HEAD_DIM
    cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    kv_offs = cols[:, None] * HEAD_DIM + dims[None, :]
    k = tl.load(K + kv_offs, mask=cols[:, None] < N_K, other=0.0)  # kept on chip
    v = tl.load(V + kv_offs, mask=cols[:, None] < N_K, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)

    lo = 0
    if CAUSAL:  # rows before start_n * BLOCK_N - (N_K - N_Q) see none of these keys
        lo = tl.maximum(start_n * BLOCK_N - (N_K - N_Q), 0) // BLOCK_M * BLOCK_M
    for start_m in range(lo, N_Q, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q_offs = rows[:, None] * HEAD_DIM + dims[None, :]
        q = tl.load(Q + q_offs, mask=rows[:, None] < N_Q, other=0.0)
        do = tl.load(DO + q_offs, mask=rows[:, None] < N_Q, other=0.0)
        lse = tl.load(LSE + rows, mask=rows < N_Q, other=0.0)
        Di = tl.load(Delta + rows, mask=rows < N_Q, other=0.0)
        visible = (rows[:, None] < N_Q) & (cols[None, :] < N_K)
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + N_K - N_Q)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # unscaled scores
        p = tl.exp2(s * sm_scale * LOG2E - lse[:, None] * LOG2E)
        p = tl.where(visible, p, 0.0)  # P = exp(S - LSE)
        dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # dP = dO V^T
        ds = p * (dp - Di[:, None])  # dS = P * (dP - D)
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=PRECISION)

    dk = dk * sm_scale  # dK = scale * dS^T Q
    tl.store(DK + kv_offs, dk.to(DK.dtype.element_ty), mask=cols[:, None] < N_K)
    tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=cols[:, None] < N_K)


@triton.jit
def _teaching_bwd_dq(Q, K, V, DO, LSE, Delta, DQ, N_Q, N_K, sm_scale,
                     CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PRECISION: tl.constexpr):
    """dQ for BLOCK_M query rows of one (batch, head). Grid (cdiv(N_Q, BLOCK_M), B * H).

    Layouts as in _teaching_bwd_dkdv; DQ like Q."""
    start_m = tl.program_id(0)  # which block of query rows
    bh = tl.program_id(1).to(tl.int64)
    Q, DO = Q + bh * N_Q * HEAD_DIM, DO + bh * N_Q * HEAD_DIM
    DQ = DQ + bh * N_Q * HEAD_DIM
    LSE, Delta = LSE + bh * N_Q, Delta + bh * N_Q
    K, V = K + bh * N_K * HEAD_DIM, V + bh * N_K * HEAD_DIM
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q_offs = rows[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(Q + q_offs, mask=rows[:, None] < N_Q, other=0.0)  # kept on chip
    do = tl.load(DO + q_offs, mask=rows[:, None] < N_Q, other=0.0)
    lse = tl.load(LSE + rows, mask=rows < N_Q, other=0.0)
    Di = tl.load(Delta + rows, mask=rows < N_Q, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    hi = N_K
    if CAUSAL:  # the forward's bound
        hi = tl.minimum((start_m + 1) * BLOCK_M + N_K - N_Q, N_K)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kv_offs = cols[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(K + kv_offs, mask=cols[:, None] < N_K, other=0.0)
        v = tl.load(V + kv_offs, mask=cols[:, None] < N_K, other=0.0)
        visible = cols[None, :] < N_K
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + N_K - N_Q)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # unscaled scores
        p = tl.exp2(s * sm_scale * LOG2E - lse[:, None] * LOG2E)
        p = tl.where(visible, p, 0.0)  # P = exp(S - LSE)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # dP = dO V^T
        ds = p * (dp - Di[:, None])  # dS = P * (dP - D)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)

    dq = dq * sm_scale  # dQ = scale * dS K
    tl.store(DQ + q_offs, dq.to(DQ.dtype.element_ty), mask=rows[:, None] < N_Q)


# -----------------------------------------------------------------------------------
# Launchers
# -----------------------------------------------------------------------------------
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check(q, k, v, softmax_scale):
    """Check q, k and v; return (B, H, N_Q, N_K, d, scale)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, seqlen, "
                             f"head_dim), got shape {tuple(t.shape)}")
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    if k.shape != (b, h, n_k, d):
        raise ValueError(f"k must have shape (batch, heads, N_k, head_dim) = "
                         f"({b}, {h}, N_k, {d}) as q, got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got "
                         f"{tuple(v.shape)}")
    if n_q < 1 or n_k < 1:
        raise ValueError(f"q and k need at least one row each, got N_q = {n_q}, "
                         f"N_k = {n_k}")
    if d not in (16, 32, 64, 128):
        raise ValueError(f"the head dim (q.shape[3]) must be 16, 32, 64 or 128 in the "
                         f"teaching kernels, got {d}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got "
                            f"{t.dtype}")
    if q.dtype == torch.bfloat16 and INTERPRET:
        raise ValueError("bfloat16 is not supported by the teaching kernels under "
                         "the Triton interpreter (its tl.dot on bfloat16 tiles is "
                         "wrong); use float32 or float16, or a GPU")
    _check_devices(q, (("k", k), ("v", v)))
    if q.device.type != ("cpu" if INTERPRET else "cuda"):
        where = "Triton's CPU interpreter" if INTERPRET else "a CUDA GPU"
        want = "cpu" if INTERPRET else "cuda"
        raise ValueError(f"the teaching kernels run on {where} here, so q, k and v "
                         f"must be on a {want} device, got {q.device}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    elif (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
          or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale must be a positive finite number or None, got "
                         f"{softmax_scale!r}")
    return b, h, n_q, n_k, d, float(softmax_scale)


def _check_devices(q, named):
    for name, t in named:
        if t.device != q.device:
            raise ValueError(f"{name} is on device {t.device} but q is on {q.device}; "
                             f"all must be on one device")


def _flat(t):
    """(B, H, N, d) -> contiguous (B * H, N, d)."""
    return t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3]).contiguous()


def _precision(dtype):
    # exact float32 products for float32 inputs (not TF32); 16-bit inputs ignore it
    return "ieee" if dtype == torch.float32 else "tf32"


def _blocks(kernel, dtype):
    return (BLOCKS_FP32 if dtype == torch.float32 else BLOCKS)[kernel]


def teaching_forward(q, k, v, causal=False, softmax_scale=None):
    """Attention ``softmax(scale q k^T) v`` by ``_teaching_fwd``; returns ``(o, lse)``.

    q ``(B, H, N_q, d)``, k and v ``(B, H, N_k, d)``; ``o`` has q's shape and dtype,
    ``lse`` is float32 ``(B, H, N_q)``, natural log. ``causal``: bottom-right aligned
    mask. ``softmax_scale`` defaults to ``1 / sqrt(d)``."""
    b, h, n_q, n_k, d, scale = _check(q, k, v, softmax_scale)
    o = torch.empty(b * h, n_q, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b * h, n_q, dtype=torch.float32, device=q.device)
    block_m, block_n, warps = _blocks("fwd", q.dtype)
    grid = (triton.cdiv(n_q, block_m), b * h)
    _teaching_fwd[grid](_flat(q), _flat(k), _flat(v), o, lse, n_q, n_k,
                        scale * LOG2E.value, CAUSAL=bool(causal), HEAD_DIM=d,
                        BLOCK_M=block_m, BLOCK_N=block_n,
                        PRECISION=_precision(q.dtype), num_warps=warps)
    return o.view(b, h, n_q, d), lse.view(b, h, n_q)


def teaching_backward(do, q, k, v, o, lse, causal=False, softmax_scale=None):
    """Gradients ``(dq, dk, dv)`` of ``teaching_forward``'s output.

    ``do``: the loss's gradient with respect to ``o``; ``o`` and ``lse``: what the
    forward returned. Shapes and dtypes as the forward's; the gradients have the shapes
    and dtypes of q, k and v."""
    b, h, n_q, n_k, d, scale = _check(q, k, v, softmax_scale)
    for name, t in (("do", do), ("o", o), ("lse", lse)):
        _check_tensor(name, t)
    _check_devices(q, (("do", do), ("o", o), ("lse", lse)))
    for name, t in (("do", do), ("o", o)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got "
                             f"{tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got "
                            f"{t.dtype}")
    if lse.shape != q.shape[:3]:
        raise ValueError(f"lse must have shape (B, H, N_q) = {tuple(q.shape[:3])}, got "
                         f"{tuple(lse.shape)}")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse must be float32, as teaching_forward returns it, got "
                        f"{lse.dtype}")
    qf, kf, vf, dof = (_flat(t) for t in (q, k, v, do))
    lse_f = lse.reshape(b * h, n_q).contiguous()
    delta = (do.float() * o.float()).sum(-1)  # D = rowsum(dO * O), float32
    delta = delta.reshape(b * h, n_q).contiguous()
    dq, dk, dv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
    meta = dict(CAUSAL=bool(causal), HEAD_DIM=d, PRECISION=_precision(q.dtype))
    block_m, block_n, warps = _blocks("dkdv", q.dtype)
    _teaching_bwd_dkdv[(triton.cdiv(n_k, block_n), b * h)](
        qf, kf, vf, dof, lse_f, delta, dk, dv, n_q, n_k, scale,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, **meta)
    block_m, block_n, warps = _blocks("dq", q.dtype)
    _teaching_bwd_dq[(triton.cdiv(n_q, block_m), b * h)](
        qf, kf, vf, dof, lse_f, delta, dq, n_q, n_k, scale,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, **meta)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


if INTERPRET:  # each launch leaves triton.language as it found it (fa_lib._interpreter)
    from ._interpreter import contain_module as _contain_module

    _contain_module(globals())
