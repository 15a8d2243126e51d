"""Triton kernels of FlashAttention, forward and backward, in reading order.

This module holds the ``@triton.jit`` kernels only, and the tables of block sizes they run with.
The launchers that check inputs, allocate outputs and pick a configuration live in ``fa_lib.ops``;
read that module for the calling convention.

Reading order (the algorithm's order):

1. ``_attn_fwd_inner`` / ``_attn_fwd``: the forward pass. One program owns ``BLOCK_M`` query rows and
   streams ``BLOCK_N`` keys at a time through an online softmax (running max ``m_i``, running sum
   ``l_i``, unnormalised output ``acc``); it divides by ``l_i`` once at the end (deferred
   normalisation) and stores the natural-log LSE ``m + log(l)`` of every row for the backward pass.
2. ``_attn_bwd_preprocess``: ``D = rowsum(dO * O)`` (minus ``dLSE`` when the LSE itself is
   differentiated), one float32 per query row.
3. ``_attn_bwd_dkdv_inner`` / ``_attn_bwd_dkdv``: one program owns ``BLOCK_N`` keys of one key/value
   head, recomputes ``P^T = exp(S^T - LSE)`` from the saved LSE, and accumulates ``dV = P^T dO`` and
   ``dK = scale * dS^T Q``. Under grouped-query attention it loops over every query head of its group
   itself, so dK and dV are plain sums in registers: no atomics, bitwise-deterministic.
4. ``_attn_bwd_dq_inner`` / ``_attn_bwd_dq``: one program owns ``BLOCK_M`` query rows and accumulates
   ``dQ = scale * dS K``, again recomputing ``P`` from the LSE.

Conventions used by every kernel
--------------------------------
* Tensors are ``(batch, heads, seqlen, head_dim)`` with arbitrary batch, head and sequence strides
  and a contiguous last dimension. Each head is read and written through *tensor descriptors*
  (``tl.make_tensor_descriptor``): a 2-D view ``(seqlen, head_dim)`` of one head, from which a
  program loads whole tiles by their coordinates. On Hopper GPUs a descriptor load is one TMA
  (tensor memory accelerator) copy into shared memory; elsewhere Triton lowers it to ordinary loads.
  Descriptors need a 16-byte aligned base and 16-byte aligned strides; ``fa_lib.ops`` guarantees
  both (it pads or copies the rare input that is not).
* ``HEAD_DIM`` is the tile width: ``head_dim`` rounded up to a power of two (>= 16, the smallest tile
  ``tl.dot`` accepts on a GPU). A descriptor knows the true ``head_dim`` and the true ``seqlen``: a
  tile that runs past either is filled with zeros on load and clipped on store, so the extra
  columns add nothing to any dot product and sequence tails need no padding.
* Loops run over whole key (or query) blocks; only the blocks that hold a sequence tail or the
  causal diagonal apply a mask to the scores (``MASK`` constexpr).
* Causal masks are aligned bottom-right, as in flash-attn 2.1+: query ``i`` sees key ``j`` iff
  ``j <= i + N_K - N_Q``. A row that sees no key ends with ``l_i == 0``: its output is 0, its LSE is
  ``-inf`` and every gradient it feeds is 0, never NaN.
* Scores live in base 2: ``qk_scale = softmax_scale / ln(2)`` so that ``exp(x * scale)`` becomes
  ``exp2(x * qk_scale)`` (``exp2`` is the hardware's native instruction; ``exp`` costs an extra
  multiply). The stored LSE is converted back to natural log.

CPU fallback
------------
``import fa_lib`` decides between compiled kernels and Triton's CPU interpreter (see
``fa_lib._interpreter``): with no CUDA device and ``TRITON_INTERPRET`` unset it sets
``TRITON_INTERPRET=1``, so every kernel below is defined as an interpreted function that runs on CPU
tensors through NumPy. That is how CI and laptops run the same kernels. Two interpreter facts shape
the code:

* bfloat16 is broken twice under the interpreter: ``tl.dot`` on bfloat16 tiles returns garbage
  silently (triton issue 11584; NumPy has no bfloat16 matmul), and float32 -> bfloat16 casts truncate
  instead of rounding to nearest even. The launcher sets ``EMULATE_BF16`` for bfloat16 inputs under
  the interpreter only: ``_dot`` then upcasts both tiles to float32 (exact) before the product, and
  ``_round`` rounds to nearest even by bit arithmetic before each cast. Every value is rounded to
  bfloat16 exactly where, and as, the GPU rounds it, so the CPU tests check the GPU's arithmetic.
  On a GPU ``EMULATE_BF16`` is False and the tensor cores take bfloat16 natively.
* The interpreter runs one program at a time in Python, so it gets one small block configuration.
"""
from ._interpreter import configure as _configure

INTERPRET = _configure()  # before `import triton`'s kernels below are defined

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

LOG2E = tl.constexpr(1.4426950408889634)  # 1/ln(2): exp(x) == exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): log(x) == log2(x) * LN2


# ---------------------------------------------------------------------------------------------------
# Block sizes.
#
# A configuration is (BLOCK_M, BLOCK_N, num_warps, num_stages). By default (`deterministic=True` in
# `fa_lib.flash_attention`) every launch takes its configuration from the fixed tables below, looked
# up by (kernel, element size, HEAD_DIM, causal, sequence-length bucket): the same inputs then give
# the same bits in every process, because the order of every floating-point sum is fixed by the
# block sizes. `autotune=True` instead lets Triton's autotuner time the candidates (`*_CONFIGS`) for
# each key (element size, HEAD_DIM, CAUSAL, the buckets of N_Q and N_K, the GQA group) in this
# process: sometimes faster, but two processes may pick different blocks and round differently.
# Under the interpreter there is one small configuration (a tuning run would mean nothing there and
# the CPU tests must stay fast).
# ---------------------------------------------------------------------------------------------------
def _cfg(block_m, block_n, num_warps, num_stages, max_head_dim, elt_bytes=2):
    """One autotuner config, tagged with the head dims (up to `max_head_dim`) and element size it is for."""
    config = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages)
    config.max_head_dim = max_head_dim  # read by `_prune` only, never passed to a kernel
    config.elt_bytes = elt_bytes
    return config


if INTERPRET:
    # BLOCK_M != BLOCK_N on purpose: the causal loop bounds must not rely on square tiles.
    FWD_CONFIGS = [_cfg(32, 16, 4, 1, 256, 4)]
    DKDV_CONFIGS = [_cfg(16, 32, 4, 1, 256, 4)]
    DQ_CONFIGS = [_cfg(32, 16, 4, 1, 256, 4)]
else:
    # Candidates for `autotune=True` on Hopper (H100/H200). float32 inputs use the ieee dot (FMA, no
    # tensor cores), which only correctness asks for, and get small tiles that do not spill.
    FWD_CONFIGS = [
        _cfg(128, 64, 8, 3, 64), _cfg(128, 64, 4, 3, 64), _cfg(64, 64, 4, 4, 64),
        _cfg(128, 128, 8, 3, 128), _cfg(128, 64, 8, 3, 128), _cfg(64, 64, 4, 3, 128),
        _cfg(128, 64, 8, 2, 256), _cfg(64, 64, 8, 2, 256),
        _cfg(32, 32, 4, 2, 64, 4), _cfg(16, 32, 8, 2, 256, 4),
    ]
    DKDV_CONFIGS = [
        _cfg(32, 64, 4, 3, 64), _cfg(32, 64, 4, 4, 64),
        _cfg(32, 64, 4, 3, 128), _cfg(64, 128, 8, 3, 128),
        _cfg(32, 64, 8, 2, 256), _cfg(32, 32, 8, 1, 256),
        _cfg(16, 32, 4, 2, 64, 4), _cfg(16, 32, 8, 2, 256, 4),
    ]
    DQ_CONFIGS = [
        _cfg(64, 64, 4, 3, 64), _cfg(128, 32, 8, 3, 64),
        _cfg(128, 64, 8, 3, 128), _cfg(64, 64, 4, 2, 128),
        _cfg(64, 32, 8, 2, 256), _cfg(32, 32, 4, 2, 256),
        _cfg(32, 16, 4, 2, 64, 4), _cfg(32, 16, 8, 2, 256, 4),
    ]

# Fixed tables for `deterministic=True`: {kernel: {(elt_bytes, HEAD_DIM): [(max_len, causal, config)]}}.
# The first row whose `max_len` >= max(N_Q, N_K) and whose `causal` matches (None: either) wins.
# 16-bit rows: the autotuner's choices on an H200 over the committed sweep (bf16 and fp16, N = 1k..16k,
# causal and not), see `book/data/`; float32 rows: the small non-spilling tiles above.
_BIG = 1 << 62
DEFAULT_TABLE = {
    "fwd": {
        (2, 16): [(_BIG, None, (128, 64, 4, 3))],
        (2, 32): [(_BIG, None, (128, 64, 4, 3))],
        (2, 64): [(_BIG, None, (128, 64, 8, 3))],
        (2, 128): [(1024, True, (64, 64, 4, 3)), (_BIG, None, (128, 128, 8, 3))],
        (2, 256): [(_BIG, None, (64, 64, 8, 2))],
    },
    "dkdv": {
        (2, 16): [(_BIG, None, (32, 64, 4, 3))],
        (2, 32): [(_BIG, None, (32, 64, 4, 3))],
        (2, 64): [(_BIG, None, (32, 64, 4, 3))],
        (2, 128): [(4096, None, (32, 64, 4, 3)), (8192, True, (32, 64, 4, 3)), (_BIG, None, (64, 128, 8, 3))],
        (2, 256): [(_BIG, None, (32, 64, 8, 2))],
    },
    "dq": {
        (2, 16): [(_BIG, None, (64, 64, 4, 3))],
        (2, 32): [(_BIG, None, (64, 64, 4, 3))],
        (2, 64): [(2048, None, (64, 64, 4, 3)), (_BIG, False, (128, 32, 8, 3)), (_BIG, True, (64, 64, 4, 3))],
        (2, 128): [(_BIG, None, (128, 64, 8, 3))],
        (2, 256): [(_BIG, None, (64, 32, 8, 2))],
    },
}
_FP32_DEFAULT = {"fwd": [(32, 32, 4, 2), (16, 32, 8, 2)], "dkdv": [(16, 32, 4, 2), (16, 32, 8, 2)],
                 "dq": [(32, 16, 4, 2), (32, 16, 8, 2)]}  # (HEAD_DIM <= 64, larger)
_INTERPRETER_DEFAULT = {"fwd": FWD_CONFIGS[0], "dkdv": DKDV_CONFIGS[0], "dq": DQ_CONFIGS[0]} if INTERPRET else {}


def default_config(kernel, elt_bytes, head_dim, causal, n_q, n_k):
    """The fixed (BLOCK_M, BLOCK_N, num_warps, num_stages) of `kernel` ("fwd", "dkdv", "dq") for a shape.

    `head_dim` is the tile width HEAD_DIM (a power of two, 16..256). A pure function of its arguments,
    so every process picks the same blocks for the same problem.
    """
    if INTERPRET:
        c = _INTERPRETER_DEFAULT[kernel]
        return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages
    if elt_bytes == 4:
        return _FP32_DEFAULT[kernel][0 if head_dim <= 64 else 1]
    n = max(n_q, n_k)
    for max_len, row_causal, config in DEFAULT_TABLE[kernel][(2, head_dim)]:
        if n <= max_len and row_causal in (None, causal):
            return config
    raise AssertionError(f"no default configuration for {kernel} at HEAD_DIM {head_dim}")  # tables are total


def _prune(configs, named_args, **kwargs):
    """Keep the configs written for this head dim and element size (the tables above)."""
    args = {**named_args, **kwargs}
    head_dim, elt_bytes = args["HEAD_DIM"], args["Q"].element_size()
    same_size = [c for c in configs if c.elt_bytes == elt_bytes] or configs
    fit = min((c.max_head_dim for c in same_size if c.max_head_dim >= head_dim),
              default=max(c.max_head_dim for c in same_size))
    return [c for c in same_size if c.max_head_dim == fit]


def _bench(fn, quantiles):
    # Short tuning runs: each new key is timed once per config, so keep it cheap.
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


# The autotuner's key: Triton adds the dtype of every tensor argument by itself. N_Q_BUCKET and
# N_K_BUCKET (the lengths rounded up to powers of two) keep decoding (N_Q = 1) apart from prefill;
# GROUP keeps grouped-query attention apart from multi-head attention.
_TUNE = dict(key=["N_Q_BUCKET", "N_K_BUCKET", "HEAD_DIM", "CAUSAL", "GROUP"],
             prune_configs_by={"early_config_prune": _prune}, do_bench=_bench)


# ---------------------------------------------------------------------------------------------------
# Small helpers.
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _dot(a, b, acc, EMULATE_BF16: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b, accumulated in float32.

    EMULATE_BF16 (interpreter + bfloat16 only): upcast the tiles first, see the module docstring.
    PRECISION: "ieee" for float32 inputs (exact float32 products), "tf32" (ignored) for 16-bit ones.
    """
    if EMULATE_BF16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _round(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Round a float32 tile to `dtype` (a dot operand or a result to store), to nearest even.

    EMULATE_BF16: the interpreter truncates float32 -> bfloat16 instead of rounding; round the bits
    by hand first (add half an ulp of bfloat16, ties to even, clear the low 16 bits) so the cast
    below is exact and the result equals the GPU's.
    """
    if EMULATE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _head(T, off_z, off_h, stride_z, stride_h, stride_n, seqlen, head_dim, BLOCK: tl.constexpr,
          HEAD_DIM: tl.constexpr):
    """A tensor descriptor over one head of a (batch, heads, seqlen, head_dim) tensor: tiles of
    (BLOCK, HEAD_DIM), zero-filled past `seqlen` rows and `head_dim` columns on load, clipped on store."""
    base = T + off_z.to(tl.int64) * stride_z + off_h.to(tl.int64) * stride_h
    return tl.make_tensor_descriptor(base, shape=[seqlen, head_dim], strides=[stride_n, 1],
                                     block_shape=[BLOCK, HEAD_DIM])


# ---------------------------------------------------------------------------------------------------
# 1. Forward.
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, k_desc, v_desc,  #
                    lo, hi, qk_scale, offs_m, diag_offset, N_K,  #
                    BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,  #
                    EMULATE_BF16: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over the key blocks [lo, hi). MASK: the blocks hold the diagonal or the tail."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = k_desc.load([start_n, 0])  # (BLOCK_N, HEAD_DIM)
        qk = _dot(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32), EMULATE_BF16, PRECISION)
        if MASK:
            cols = start_n + offs_n
            visible = cols[None, :] < N_K
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + diag_offset)
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
        p = tl.math.exp2(qk)
        l_ij = tl.sum(p, 1)
        # -- rescale what was accumulated under the old max, then add this block --
        alpha = tl.math.exp2(m_i - m_ij_safe)
        l_i = l_i * alpha + l_ij
        acc = acc * alpha[:, None]
        v = v_desc.load([start_n, 0])  # (BLOCK_N, HEAD_DIM)
        acc = _dot(_round(p, v.dtype, EMULATE_BF16), v, acc, EMULATE_BF16, PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def _attn_fwd(Q, K, V, sm_scale, LSE, Out,  #
              stride_qz, stride_qh, stride_qm,  #
              stride_kz, stride_kh, stride_kn,  #
              stride_vz, stride_vh, stride_vn,  #
              stride_oz, stride_oh, stride_om,  #
              H_Q, GROUP, N_Q, N_K, head_dim, N_Q_BUCKET, N_K_BUCKET,  #
              HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,  #
              EMULATE_BF16: tl.constexpr, PRECISION: tl.constexpr,  #
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(N_Q, BLOCK_M), H_Q, batch). Writes Out (B, H_Q, N_Q, head_dim) and LSE (B, H_Q, N_Q)."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and HEAD_DIM >= 16)  # smallest GPU dot tile
    start_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_z = tl.program_id(2)
    off_h_kv = off_h // GROUP  # grouped-query attention: GROUP query heads share one k/v head
    q_desc = _head(Q, off_z, off_h, stride_qz, stride_qh, stride_qm, N_Q, head_dim, BLOCK_M, HEAD_DIM)
    k_desc = _head(K, off_z, off_h_kv, stride_kz, stride_kh, stride_kn, N_K, head_dim, BLOCK_N, HEAD_DIM)
    v_desc = _head(V, off_z, off_h_kv, stride_vz, stride_vh, stride_vn, N_K, head_dim, BLOCK_N, HEAD_DIM)
    o_desc = _head(Out, off_z, off_h, stride_oz, stride_oh, stride_om, N_Q, head_dim, BLOCK_M, HEAD_DIM)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")  # running max (base-2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running sum of exp2(s - m_i) v, unnormalised
    qk_scale = sm_scale * LOG2E  # fold 1/ln(2) into the scale: one exp2 per score instead of exp
    q = q_desc.load([start_m * BLOCK_M, 0])  # stays on chip for the whole loop

    # Bottom-right causal alignment: query i sees key j iff j <= i + diag_offset.
    diag_offset = N_K - N_Q
    if CAUSAL:
        # Keys j <= start_m * BLOCK_M + diag_offset are visible to every row of this block ...
        n_full = tl.maximum(start_m * BLOCK_M + diag_offset + 1, 0)
        # ... and no row sees a key at or past this one.
        hi = tl.minimum((start_m + 1) * BLOCK_M + diag_offset, N_K)
    else:
        n_full = N_K
        hi = N_K
    n_full = n_full // BLOCK_N * BLOCK_N  # whole, fully visible blocks: no mask at all
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_desc, v_desc, 0, n_full, qk_scale, offs_m,
                                    diag_offset, N_K, BLOCK_N, False, CAUSAL, EMULATE_BF16, PRECISION)
    # The diagonal band (causal) and the partial last block (any): masked.
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_desc, v_desc, n_full, hi, qk_scale, offs_m,
                                    diag_offset, N_K, BLOCK_N, True, CAUSAL, EMULATE_BF16, PRECISION)

    # Epilogue: deferred normalisation, once per row. l_i == 0 iff the row saw no key at all.
    empty = l_i == 0.0
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2  # natural log m + log(l); -inf if empty
    lse_ptrs = LSE + (off_z.to(tl.int64) * H_Q + off_h) * N_Q + offs_m
    tl.store(lse_ptrs, lse, mask=offs_m < N_Q)
    o_desc.store([start_m * BLOCK_M, 0], _round(acc, Out.type.element_ty, EMULATE_BF16))


# ---------------------------------------------------------------------------------------------------
# 2. Backward preprocess: D = rowsum(dO * O) (= rowsum(dP * P)), minus dLSE when the LSE has a grad.
# ---------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["N_Q"])
def _attn_bwd_preprocess(Out, DO, DLSE, Delta,  #
                         stride_oz, stride_oh, stride_om, stride_od,  #
                         stride_dz, stride_dh, stride_dm, stride_dd,  #
                         H_Q, N_Q, head_dim,  #
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr):
    """Grid (cdiv(N_Q, BLOCK_M), H_Q, batch). Delta and DLSE are contiguous (B, H_Q, N_Q) float32."""
    start_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_z = tl.program_id(2).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_m[:, None] < N_Q) & (offs_d[None, :] < head_dim)
    o = tl.load(Out + off_z * stride_oz + off_h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om
                + offs_d[None, :] * stride_od, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + off_z * stride_dz + off_h.to(tl.int64) * stride_dh + offs_m[:, None] * stride_dm
                 + offs_d[None, :] * stride_dd, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    row = (off_z * H_Q + off_h) * N_Q + offs_m
    if HAS_DLSE:
        # dLSE_i / dS_ij = P_ij, so dS = P * (dP - D) + P * dLSE = P * (dP - (D - dLSE)).
        delta -= tl.load(DLSE + row, mask=offs_m < N_Q, other=0.0)
    tl.store(Delta + row, delta, mask=offs_m < N_Q)


# ---------------------------------------------------------------------------------------------------
# 3. dK and dV: one program per key block, looping over query blocks (and the heads of its group).
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, q_desc, do_desc, LSE, Delta,  #
                         lo, hi, qk_scale, offs_n, diag_offset, N_Q,  #
                         BLOCK_M: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,  #
                         EMULATE_BF16: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dK, dV of this key block over the query blocks [lo, hi); scores kept transposed."""
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = q_desc.load([start_m, 0])  # (BLOCK_M, HEAD_DIM)
        if MASK:
            lse = tl.load(LSE + offs_m, mask=offs_m < N_Q, other=0.0)
            Di = tl.load(Delta + offs_m, mask=offs_m < N_Q, other=0.0)
        else:
            lse = tl.load(LSE + offs_m)
            Di = tl.load(Delta + offs_m)
        # Base-2 LSE; an empty row (LSE = -inf) gets +inf so that its P is exp2(-inf) = 0.
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        # Recompute P^T = exp(S^T - LSE) from the saved LSE: no (N_Q, N_K) matrix was stored.
        qkT = _dot(k, tl.trans(q), tl.zeros([k.shape[0], BLOCK_M], dtype=tl.float32), EMULATE_BF16, PRECISION)
        pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])  # (BLOCK_N, BLOCK_M)
        if MASK:
            visible = offs_m[None, :] < N_Q
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + diag_offset)
            pT = tl.where(visible, pT, 0.0)
        do = do_desc.load([start_m, 0])  # (BLOCK_M, HEAD_DIM)
        # dV += P^T dO
        dv = _dot(_round(pT, do.dtype, EMULATE_BF16), do, dv, EMULATE_BF16, PRECISION)
        # dP^T = V dO^T ;  dS^T = P^T * (dP^T - D)
        dpT = _dot(v, tl.trans(do), tl.zeros([k.shape[0], BLOCK_M], dtype=tl.float32), EMULATE_BF16, PRECISION)
        dsT = pT * (dpT - Di[None, :])
        # dK += dS^T Q   (times softmax_scale, applied once at the end)
        dk = _dot(_round(dsT, q.dtype, EMULATE_BF16), q, dk, EMULATE_BF16, PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def _attn_bwd_dkdv(Q, K, V, DO, LSE, Delta, DK, DV, sm_scale,  #
                   stride_qz, stride_qh, stride_qm,  #
                   stride_kz, stride_kh, stride_kn,  #
                   stride_vz, stride_vh, stride_vn,  #
                   stride_doz, stride_doh, stride_dom,  #
                   stride_dkz, stride_dkh, stride_dkn,  #
                   stride_dvz, stride_dvh, stride_dvn,  #
                   H_Q, H_KV, GROUP, N_Q, N_K, head_dim, N_Q_BUCKET, N_K_BUCKET,  #
                   HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, GQA: tl.constexpr,  #
                   EMULATE_BF16: tl.constexpr, PRECISION: tl.constexpr,  #
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(N_K, BLOCK_N), H_KV, batch). Writes DK, DV (B, H_KV, N_K, head_dim)."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and HEAD_DIM >= 16)
    start_n = tl.program_id(0) * BLOCK_N
    off_h_kv = tl.program_id(1)
    off_z = tl.program_id(2)
    k_desc = _head(K, off_z, off_h_kv, stride_kz, stride_kh, stride_kn, N_K, head_dim, BLOCK_N, HEAD_DIM)
    v_desc = _head(V, off_z, off_h_kv, stride_vz, stride_vh, stride_vn, N_K, head_dim, BLOCK_N, HEAD_DIM)
    # K and V of this block stay on chip while every query block streams past.
    k = k_desc.load([start_n, 0])  # (BLOCK_N, HEAD_DIM)
    v = v_desc.load([start_n, 0])
    offs_n = start_n + tl.arange(0, BLOCK_N)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    # Which query blocks touch this key block (bottom-right causal: query i sees key j iff
    # j <= i + diag_offset)? Rows below m_lo see none of its keys; rows from m_full on see all of
    # them. [m_lo, m_full) is the diagonal band (masked), [m_full, m_end) whole blocks (unmasked),
    # [max(m_full, m_end), N_Q) the partial last query block (masked).
    diag_offset = N_K - N_Q
    if CAUSAL:
        m_lo = tl.maximum(start_n - diag_offset, 0) // BLOCK_M * BLOCK_M
        m_full = tl.maximum(start_n + BLOCK_N - 1 - diag_offset, 0)
        m_full = (m_full + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:
        m_lo = 0
        m_full = 0
    m_end = N_Q // BLOCK_M * BLOCK_M
    m_band_hi = tl.minimum(m_full, N_Q)
    m_tail = tl.maximum(m_full, m_end)

    # Grouped-query attention: this k/v head serves GROUP query heads; sum their contributions here,
    # in a fixed order, instead of with atomics across programs. (Plain multi-head attention skips
    # the loop at compile time: wrapped around the three pipelined loops it costs registers.)
    for g in range(GROUP if GQA else 1):
        off_h = off_h_kv * GROUP + g
        q_desc = _head(Q, off_z, off_h, stride_qz, stride_qh, stride_qm, N_Q, head_dim, BLOCK_M, HEAD_DIM)
        do_desc = _head(DO, off_z, off_h, stride_doz, stride_doh, stride_dom, N_Q, head_dim, BLOCK_M, HEAD_DIM)
        row_offset = (off_z.to(tl.int64) * H_Q + off_h) * N_Q
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_desc, do_desc, LSE + row_offset, Delta + row_offset,
                                      m_lo, m_band_hi, qk_scale, offs_n, diag_offset, N_Q,
                                      BLOCK_M, True, CAUSAL, EMULATE_BF16, PRECISION)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_desc, do_desc, LSE + row_offset, Delta + row_offset,
                                      m_full, m_end, qk_scale, offs_n, diag_offset, N_Q,
                                      BLOCK_M, False, CAUSAL, EMULATE_BF16, PRECISION)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_desc, do_desc, LSE + row_offset, Delta + row_offset,
                                      m_tail, N_Q, qk_scale, offs_n, diag_offset, N_Q,
                                      BLOCK_M, True, CAUSAL, EMULATE_BF16, PRECISION)

    dk *= sm_scale  # S = scale * Q K^T, so dK = scale * dS^T Q
    dk_desc = _head(DK, off_z, off_h_kv, stride_dkz, stride_dkh, stride_dkn, N_K, head_dim, BLOCK_N, HEAD_DIM)
    dv_desc = _head(DV, off_z, off_h_kv, stride_dvz, stride_dvh, stride_dvn, N_K, head_dim, BLOCK_N, HEAD_DIM)
    dk_desc.store([start_n, 0], _round(dk, DK.type.element_ty, EMULATE_BF16))
    dv_desc.store([start_n, 0], _round(dv, DV.type.element_ty, EMULATE_BF16))


# ---------------------------------------------------------------------------------------------------
# 4. dQ: one program per query block, looping over key blocks exactly like the forward pass.
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse2, Di, k_desc, v_desc,  #
                       lo, hi, qk_scale, offs_m, diag_offset, N_K,  #
                       BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,  #
                       EMULATE_BF16: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dQ of this query block over the key blocks [lo, hi)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = k_desc.load([start_n, 0])  # (BLOCK_N, HEAD_DIM)
        v = v_desc.load([start_n, 0])
        qk = _dot(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32), EMULATE_BF16, PRECISION)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])  # P recomputed from the LSE
        if MASK:
            cols = start_n + offs_n
            visible = cols[None, :] < N_K
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + diag_offset)
            p = tl.where(visible, p, 0.0)
        # dP = dO V^T ;  dS = P * (dP - D) ;  dQ += dS K   (times softmax_scale at the end)
        dp = _dot(do, tl.trans(v), tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32), EMULATE_BF16, PRECISION)
        ds = p * (dp - Di[:, None])
        dq = _dot(_round(ds, k.dtype, EMULATE_BF16), k, dq, EMULATE_BF16, PRECISION)
    return dq


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def _attn_bwd_dq(Q, K, V, DO, LSE, Delta, DQ, sm_scale,  #
                 stride_qz, stride_qh, stride_qm,  #
                 stride_kz, stride_kh, stride_kn,  #
                 stride_vz, stride_vh, stride_vn,  #
                 stride_doz, stride_doh, stride_dom,  #
                 stride_dqz, stride_dqh, stride_dqm,  #
                 H_Q, GROUP, N_Q, N_K, head_dim, N_Q_BUCKET, N_K_BUCKET,  #
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,  #
                 EMULATE_BF16: tl.constexpr, PRECISION: tl.constexpr,  #
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(N_Q, BLOCK_M), H_Q, batch). Writes DQ (B, H_Q, N_Q, head_dim)."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and HEAD_DIM >= 16)
    start_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_z = tl.program_id(2)
    off_h_kv = off_h // GROUP
    q_desc = _head(Q, off_z, off_h, stride_qz, stride_qh, stride_qm, N_Q, head_dim, BLOCK_M, HEAD_DIM)
    do_desc = _head(DO, off_z, off_h, stride_doz, stride_doh, stride_dom, N_Q, head_dim, BLOCK_M, HEAD_DIM)
    k_desc = _head(K, off_z, off_h_kv, stride_kz, stride_kh, stride_kn, N_K, head_dim, BLOCK_N, HEAD_DIM)
    v_desc = _head(V, off_z, off_h_kv, stride_vz, stride_vh, stride_vn, N_K, head_dim, BLOCK_N, HEAD_DIM)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row = (off_z.to(tl.int64) * H_Q + off_h) * N_Q + offs_m
    q = q_desc.load([start_m * BLOCK_M, 0])  # (BLOCK_M, HEAD_DIM)
    do = do_desc.load([start_m * BLOCK_M, 0])
    lse = tl.load(LSE + row, mask=offs_m < N_Q, other=0.0)
    Di = tl.load(Delta + row, mask=offs_m < N_Q, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # empty row -> P = 0
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    # Same split of the key range as the forward pass.
    diag_offset = N_K - N_Q
    if CAUSAL:
        n_full = tl.maximum(start_m * BLOCK_M + diag_offset + 1, 0)
        hi = tl.minimum((start_m + 1) * BLOCK_M + diag_offset, N_K)
    else:
        n_full = N_K
        hi = N_K
    n_full = n_full // BLOCK_N * BLOCK_N
    dq = _attn_bwd_dq_inner(dq, q, do, lse2, Di, k_desc, v_desc, 0, n_full, qk_scale, offs_m,
                            diag_offset, N_K, BLOCK_N, False, CAUSAL, EMULATE_BF16, PRECISION)
    dq = _attn_bwd_dq_inner(dq, q, do, lse2, Di, k_desc, v_desc, n_full, hi, qk_scale, offs_m,
                            diag_offset, N_K, BLOCK_N, True, CAUSAL, EMULATE_BF16, PRECISION)

    dq *= sm_scale  # S = scale * Q K^T, so dQ = scale * dS K
    dq_desc = _head(DQ, off_z, off_h, stride_dqz, stride_dqh, stride_dqm, N_Q, head_dim, BLOCK_M, HEAD_DIM)
    dq_desc.store([start_m * BLOCK_M, 0], _round(dq, DQ.type.element_ty, EMULATE_BF16))


# Opt-in autotuned versions of the three tiled kernels (`autotune=True`): the same kernels, with
# BLOCK_M, BLOCK_N, num_warps and num_stages timed from the candidates above for each key.
_attn_fwd_tuned = triton.autotune(configs=FWD_CONFIGS, **_TUNE)(_attn_fwd)
_attn_bwd_dkdv_tuned = triton.autotune(configs=DKDV_CONFIGS, **_TUNE)(_attn_bwd_dkdv)
_attn_bwd_dq_tuned = triton.autotune(configs=DQ_CONFIGS, **_TUNE)(_attn_bwd_dq)
