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
* Tensors are ``(batch, heads, seqlen, head_dim)`` with arbitrary strides (views of ``(B, N, H, D)``
  storage work). Tiles are addressed by plain pointer arithmetic: a tile's pointers are the head's
  base plus ``rows * stride_row + cols * stride_col``, advanced by one block per loop step. (Block
  pointers, ``tl.make_block_ptr``, were removed in Triton 3.9. Tensor descriptors,
  ``tl.make_tensor_descriptor``, which become TMA copies on Hopper, were measured on the H200 when
  these kernels were ported: built inside the kernel they ran the forward 2-23% slower than plain
  pointers, so the portable Triton kernels keep plain pointers; see the README.)
* ``HEAD_DIM`` is the tile width: ``head_dim`` rounded up to a power of two (>= 16, the smallest tile
  ``tl.dot`` accepts on a GPU). When they differ (``MASK_D``), loads and stores mask the extra columns
  and fill them with zeros, which add nothing to any dot product. Sequence tails need no padding
  either: whatever lies past the tensor reads as zero. Where two full power-of-two tiles make the head
  dim (96 = 64 + 32), a row is two column tiles instead, ``HEAD_DIM`` and ``HEAD_DIM2`` wide
  (``ops._head_tiles``): each product runs once per tile, and nothing is padded.
* Loops run over whole key (or query) blocks; only the blocks that hold a sequence tail or an edge of
  the visible band apply a mask to the scores (``MASK`` constexpr), and blocks outside the band are
  never loaded (``_key_blocks``, ``_query_blocks``).
* The visible band is aligned bottom-right, as in flash-attn 2.1+: query ``i`` sees key ``j`` iff
  ``j <= i + N_K - N_Q + WIN_RIGHT`` (``CAUSAL``: causal attention is ``WIN_RIGHT = 0``) and, with a
  sliding window (``LOCAL``), ``j >= i + N_K - N_Q - WIN_LEFT``. A row that sees no key ends with
  ``l_i == 0``: its output is 0, its LSE is ``-inf`` and every gradient it feeds is 0, never NaN.
* The masks training needs are compile-time options, so a kernel without them is the plain one:
  ``SOFTCAP`` (scores ``c * tanh(s / c)``, and ``1 - tanh^2`` in the backward; 2 for a cap large enough
  to need the accurate tanh near 0), ``HAS_KPM`` (a
  ``(B, N_K)`` key padding mask, read per key block from a row's first padded key on; a padded tail is
  skipped: ``KV_END``, ``fa_lib.key_padding_bounds``) and ``VARLEN`` (packed sequences of different
  lengths, flash-attn's layout: each program finds its sequence in ``cu_seqlens``, ``_varlen_block``).
  ``PAGE`` (forward only: decoding in ``_decode_split``, and a varlen prefill) reads K and V from a pool of
  pages through a block table, key ``j`` at row ``j % PAGE`` of page ``Table[j // PAGE]`` (``_page_index``).
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
from ._interpreter import check_versions as _check_versions, configure as _configure

INTERPRET = _configure()  # before `import triton`'s kernels below are defined
if INTERPRET:
    _check_versions()

import functools  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

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
        _cfg(64, 32, 8, 2, 256), _cfg(128, 32, 8, 1, 256), _cfg(32, 32, 4, 2, 256),
        _cfg(32, 16, 4, 2, 64, 4), _cfg(32, 16, 8, 2, 256, 4),
    ]

# Fixed tables for `deterministic=True`: {kernel: {(elt_bytes, HEAD_DIM): [(max_len, causal, config)]}}.
# The first row whose `max_len` >= max(N_Q, N_K) and whose `causal` matches (None: either) wins.
# 16-bit rows: the autotuner's choices on an H200 over the committed sweep (bf16 and fp16, N = 1k..16k,
# causal and not), see `benchmarks/data/`; float32 rows: the small non-spilling tiles above.
_BIG = 1 << 62
DEFAULT_TABLE = {
    "fwd": {
        (2, 16): [(_BIG, None, (128, 64, 4, 3))],
        (2, 32): [(_BIG, None, (128, 64, 4, 3))],
        (2, 64): [(_BIG, None, (128, 64, 8, 3))],
        (2, 128): [(1024, True, (64, 64, 4, 3)), (_BIG, None, (128, 128, 8, 3))],
        # Head dim 96 as two tiles, 64 + 32: 128 x 64 blocks, 4 warps when causal (H200, bf16, the extended
        # sweep's d = 96 points; benchmarks/data/probe-split-d-configs-nvidia-h200.json); causal up to 1k keys
        # 64 x 32 blocks: the forward took 23% less time at B = 64, N = 256 and 4% less at B = 16, N = 1k,
        # but 3% more at B = 8, N = 2k (H = 20; benchmarks/data/configs-fwd96short-nvidia-h200.json).
        (2, 96): [(1024, True, (64, 32, 4, 3)), (_BIG, False, (128, 64, 8, 3)), (_BIG, True, (128, 64, 4, 3))],
        (2, 256): [(_BIG, None, (128, 64, 8, 2))],
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
        # head dim 256: 128 x 32 blocks, one stage. On the H200 (bf16, B*N = 16k) the whole backward took
        # 14.6 ms instead of 19.2 with (64, 32, 8, 2) at causal N = 16k, 7.4 instead of 9.6 at N = 4k
        # (benchmarks/data/configs-d256-nvidia-h200.json).
        (2, 256): [(_BIG, None, (128, 32, 8, 1))],
    },
}
_FP32_DEFAULT = {"fwd": [(32, 32, 4, 2), (16, 32, 8, 2)], "dkdv": [(16, 32, 4, 2), (16, 32, 8, 2)],
                 "dq": [(32, 16, 4, 2), (32, 16, 8, 2)]}  # (HEAD_DIM <= 64, larger)
_INTERPRETER_DEFAULT = {"fwd": FWD_CONFIGS[0], "dkdv": DKDV_CONFIGS[0], "dq": DQ_CONFIGS[0]} if INTERPRET else {}


def default_config(kernel, elt_bytes, head_dim, causal, n_q, n_k, *, interpret=None):
    """The fixed (BLOCK_M, BLOCK_N, num_warps, num_stages) of `kernel` ("fwd", "dkdv", "dq") for a shape.

    `head_dim` is the tile width HEAD_DIM (a power of two, 16..256), or for two column tiles
    (`ops._head_tiles`) their sum: a row of its own where the table has one, else the power of two
    above. A pure function of its arguments,
    so every process picks the same blocks for the same problem. `interpret`: which table to read, the
    interpreter's one small tile (True) or the GPU's (False); None: the mode this process runs in (so a
    notebook on a CPU can still show what a GPU would launch).
    """
    if INTERPRET if interpret is None else interpret:
        c = _INTERPRETER_DEFAULT[kernel]
        return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages
    if elt_bytes == 4:
        return _FP32_DEFAULT[kernel][0 if head_dim <= 64 else 1]
    n = max(n_q, n_k)
    table = DEFAULT_TABLE[kernel]
    key = (2, head_dim) if (2, head_dim) in table else (2, max(16, triton.next_power_of_2(head_dim)))
    for max_len, row_causal, config in table[key]:
        if n <= max_len and row_causal in (None, causal):
            return config
    raise AssertionError(f"no default configuration for {kernel} at HEAD_DIM {head_dim}")  # tables are total


# Grids smaller than one wave of the H200 (132 SMs) leave SMs idle for the whole launch: 512 queries
# against 8192 keys (a prefill chunk), B = 2, H = 8, D = 256 run 64 programs with 128-row blocks. There the
# measured kernels take blocks of half the rows, on 4 warps (bf16, causal and not; `python -m benchmarks.bench
# --configs`, benchmarks/data/configs-prefill-*-nvidia-h200.json): the forward took 5% (causal) and 26% less
# time, the whole backward with the dQ kernel's blocks replaced 17% and 15% less.
# A grid of little more than one wave is nearly as bad: at d = 96 (two tiles) the same prefill's dQ kernel
# runs 160 programs of 128 rows (B = 2, H = 20), 1.2 waves; with 64 x 32 blocks on 4 warps the whole
# backward took 10% (H_kv = 20) and 14% (H_kv = 5) less time (unmasked, bf16;
# benchmarks/data/configs-dq96prefill-nvidia-h200.json). That row applies below two waves (SMALL_GRID_LIMIT).
# {(kernel, elt_bytes, HEAD_DIM): (the table's config, the small-grid one)}; HEAD_DIM: the tiles' sum.
# The bound is in programs, as measured on the H200's 132 SMs, on every device. Scaling it by another device's SM
# count is not obviously better: on an A100 (108 SMs) 128 programs are 1.19 waves, and the d = 96 row above shows a
# grid of 1.2 waves gaining from the small blocks too. Not measured off the H200.
SMALL_GRID_PROGRAMS = 132
SMALL_GRID = {
    ("fwd", 2, 256): ((128, 64, 8, 2), (64, 64, 4, 2)),
    ("dq", 2, 256): ((128, 32, 8, 1), (64, 32, 4, 2)),
    ("dq", 2, 96): ((128, 64, 8, 3), (64, 32, 4, 3)),
}
SMALL_GRID_LIMIT = {("dq", 2, 96): 2 * SMALL_GRID_PROGRAMS}  # a row's own bound on `programs`, if not one wave


def small_grid_config(kernel, elt_bytes, head_dim, config, programs):
    """`config` (BLOCK_M, BLOCK_N, num_warps, num_stages), the table's answer for `kernel` ("fwd", "dkdv",
    "dq") at `elt_bytes` and tile width `head_dim`, or the small-grid row's blocks where the launch would run
    fewer programs with it than the row's bound (`SMALL_GRID_LIMIT`, else SMALL_GRID_PROGRAMS). Also a pure
    function of its arguments."""
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 0:
        raise ValueError(f"programs must be a non-negative int (the launch's grid size), got {programs!r}")
    row = SMALL_GRID.get((kernel, elt_bytes, head_dim))
    limit = SMALL_GRID_LIMIT.get((kernel, elt_bytes, head_dim), SMALL_GRID_PROGRAMS)
    if row is not None and tuple(config) == row[0] and programs < limit:
        return row[1]
    return config


# Shared memory. The tables above were measured on the H200 (227 KiB of shared memory per block); other GPUs
# have less (an A100 163 KiB, the sm_86/sm_89 cards 99 KiB), and a block that does not fit fails to compile
# (Triton's OutOfResources). Off the H200 a table's row is therefore kept only where `shared_memory` says it
# fits, else shrunk by `fit` (the larger block halved, then the stages cut): conservative blocks, not measured
# blocks. `shared_memory` bounds what Triton allocates from above: the tile that stays in the loop, (stages - 1)
# buffers of each streamed tile, a float32 score tile of scratch and 1 KiB. Compiled ahead of time for sm_80 and
# sm_86 (Triton 3.6), the 40 configurations that fa_lib's tables and decoding launch used 0.66-1.0x of it (at d =
# 128, bf16: the forward's 128 x 128 blocks, 3 stages, 163,840 bytes against a bound of 230,400; decoding's 64 x
# 64 blocks at d = 256, 172,032 against 181,248), and `tests/library/test_shared_memory.py` compiles the fitted
# blocks for sm_86 and checks them against the card's 99 KiB. Every row of the H200's tables fits 227 KiB, so
# the rule changes no launch there at 16-bit; a float32 KV cache at d >= 128 had decoding blocks over it (278,528
# bytes compiled for sm_90 at d = 128), which the rule now shrinks.
SHARED_MEMORY = {  # the opt-in maximum per block, by compute capability, where torch does not report it
    (7, 0): 96 << 10, (7, 5): 64 << 10, (8, 0): 163 << 10, (8, 6): 99 << 10, (8, 7): 163 << 10,
    (8, 9): 99 << 10, (9, 0): 227 << 10, (10, 0): 227 << 10, (12, 0): 99 << 10}
_DEFAULT_SHARED_MEMORY = 99 << 10  # an unknown device: the smallest of the recent ones
_SHARED_MEMORY = {}


def device_shared_memory(device):
    """The shared memory a block may use on `device` (a torch CUDA device), in bytes; None under the interpreter
    (no limit). Read once per device: torch's `shared_memory_per_block_optin`, else `SHARED_MEMORY`."""
    if INTERPRET:
        return None
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SHARED_MEMORY:
        props = torch.cuda.get_device_properties(index)
        optin = getattr(props, "shared_memory_per_block_optin", None)
        _SHARED_MEMORY[index] = int(optin) if isinstance(optin, int) and optin > 0 else SHARED_MEMORY.get(
            (props.major, props.minor), _DEFAULT_SHARED_MEMORY)
    return _SHARED_MEMORY[index]


def shared_memory(kernel, config, head_dim, elt_bytes):
    """An upper bound on the shared memory (bytes) of `kernel` ("fwd", "dkdv", "dq" or "decode") with `config`
    (BLOCK_M, BLOCK_N, num_warps, num_stages), column tiles of `head_dim` in all and inputs of `elt_bytes`."""
    block_m, block_n, _, stages = config
    stays, streams = {"dkdv": (2 * block_n, block_m), "dq": (2 * block_m, block_n)}.get(kernel, (block_m, block_n))
    return elt_bytes * head_dim * (stays + 2 * max(stages - 1, 1) * streams) + 4 * block_m * block_n + 1024


def fit(kernel, config, head_dim, elt_bytes, limit, keep_rows=False):
    """`config` if `shared_memory` says it fits in `limit` bytes (None: no limit), else a smaller one: the larger
    block halved down to 16, then the stages cut (with `keep_rows`, decoding's packed query rows: BLOCK_N, then
    the stages, and BLOCK_M last); 4 warps once a block holds at most 64 x 64. A pure function of its arguments."""
    if limit is None or shared_memory(kernel, config, head_dim, elt_bytes) <= limit:
        return tuple(config)
    block_m, block_n, num_warps, stages = config
    while shared_memory(kernel, (block_m, block_n, num_warps, stages), head_dim, elt_bytes) > limit:
        if block_n > 16 and (keep_rows or block_n >= block_m):
            block_n //= 2
        elif block_m > 16 and not keep_rows:
            block_m //= 2
        elif stages > 1:
            stages -= 1
        elif block_m > 16:  # keep_rows, and nothing else is left to cut
            block_m //= 2
        else:
            break  # 16 x 16 blocks: at most 66 KiB by this bound (float32, d = 256); sm_80 on has 99 KiB or more
    return block_m, block_n, (min(num_warps, 4) if block_m * block_n <= 64 * 64 else num_warps), stages


def _prune(kernel, configs, named_args, **kwargs):
    """Keep the configs written for this head dim and element size (the tables above) that fit the device's
    shared memory; where none does, the smallest of them fitted (`fit`)."""
    args = {**named_args, **kwargs}
    head_dim, elt_bytes = args["HEAD_DIM"] + args["HEAD_DIM2"], args["Q"].element_size()
    same_size = [c for c in configs if c.elt_bytes == elt_bytes] or configs
    fit = min((c.max_head_dim for c in same_size if c.max_head_dim >= head_dim),
              default=max(c.max_head_dim for c in same_size))
    kept = [c for c in same_size if c.max_head_dim == fit]
    limit = device_shared_memory(args["Q"].device)
    fitting = [c for c in kept if limit is None or shared_memory(kernel, _tuple(c), head_dim, elt_bytes) <= limit]
    if fitting:
        return fitting
    smallest = min(kept, key=lambda c: shared_memory(kernel, _tuple(c), head_dim, elt_bytes))
    block_m, block_n, num_warps, stages = fit(kernel, _tuple(smallest), head_dim, elt_bytes, limit)
    return [_cfg(block_m, block_n, num_warps, stages, smallest.max_head_dim, smallest.elt_bytes)]


def _tuple(config):
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def _bench(fn, quantiles):
    # Short tuning runs: each new key is timed once per config, so keep it cheap.
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


# The autotuner's key: Triton adds the dtype of every tensor argument by itself. N_Q_BUCKET and
# N_K_BUCKET (the lengths rounded up to powers of two) keep decoding (N_Q = 1) apart from prefill;
# GROUP keeps grouped-query attention apart from multi-head attention.
def _tune(kernel):
    return dict(key=["N_Q_BUCKET", "N_K_BUCKET", "HEAD_DIM", "HEAD_DIM2", "CAUSAL", "GROUP"],
                prune_configs_by={"early_config_prune": functools.partial(_prune, kernel)}, do_bench=_bench)


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
    below is exact and the result equals the GPU's. (A float32 destination, such as the partial
    results that context parallelism merges, is stored unrounded.)
    """
    if EMULATE_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _load(ptrs, rows, cols, n_rows, n_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a 2-D tile at `ptrs` (row indices `rows`, column indices `cols`), bounds-checking only the
    dimensions that can run past the tensor; whatever lies past it reads as zero."""
    if CHECK_ROWS and CHECK_COLS:
        x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
    elif CHECK_ROWS:
        x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    elif CHECK_COLS:
        x = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _tile(base, start, stride, offs, ADDR: tl.constexpr):
    """The pointers of the tile that starts at row `start`: `base` (a scalar pointer to the head) plus
    `start * stride` plus `offs`, a loop-invariant tile of 32-bit element offsets within one block.

    ADDR says where the offset is summed. "i32": in 32-bit integers, then added to the pointer (one
    LEA per vector in the SASS); the launcher picks it only when every offset within a head fits in
    31 bits (`ops._addr`). "i64": `start * stride` in 64-bit first. Same addresses; they compile to
    different instruction schedules, and were measured on the H200 (benchmarks/data/port-addressing-*.json):
    "i32" is the fastest form everywhere but the causal forward, where "i64" is.
    """
    if ADDR == "i32":
        return base + (start * stride + offs)
    else:
        return base + start.to(tl.int64) * stride + offs


# ---------------------------------------------------------------------------------------------------
# 1. Forward.
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _tanh(x, ACCURATE: tl.constexpr = False):
    """tanh from exp2 (1 - 2 / (e^{2x} + 1)): saturates to +-1 without overflow, and runs unchanged
    under the interpreter (which has no libdevice tanh). Its absolute error is ~1e-7 everywhere, so near
    0 its relative error grows like 1e-7 / |x|: a cap c then adds an error of ~1e-7 c to every capped
    score. ACCURATE (the launcher sets it for caps above `dispatch._FAST_TANH_MAX_CAP`): below |x| = 1/4 the
    odd Taylor polynomial to x^9 instead, whose error there is below 1e-8 relative."""
    t = 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)
    if ACCURATE:
        x2 = x * x
        poly = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
        t = tl.where(tl.abs(x) < 0.25, poly, t)
    return t


@triton.jit
def _scores(qk, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """Raw dot products -> scores in base-2 units: `qk * scale / ln 2`, or with a soft cap c,
    `c * tanh(qk * scale / c) / ln 2` (`qk_scale` is then scale / c and `softcap` is c / ln 2).
    Also returns tanh (for the backward's chain rule; 0 without a cap)."""
    if SOFTCAP:
        t = _tanh(qk * qk_scale, SOFTCAP == 2)
        return t * softcap, t
    else:
        return qk * qk_scale, qk


@triton.jit
def _scales(sm_scale, softcap, SOFTCAP: tl.constexpr):
    """(qk_scale, cap) for `_scores`: without a cap, scale / ln 2 (1/ln 2 folded into the scale, so each
    score takes one exp2 instead of exp); with a cap c, scale / c and c / ln 2."""
    if SOFTCAP:
        return sm_scale / softcap, softcap * LOG2E
    else:
        return sm_scale * LOG2E, 0.0


@triton.jit
def _visible(offs_m, cols, N_K, diag_right, diag_left, KPM_row,  #
             CAUSAL: tl.constexpr, LOCAL: tl.constexpr, HAS_KPM: tl.constexpr):
    """The (rows, cols) visibility of a tile: the key exists (`cols < N_K`); with CAUSAL it is not
    right of the band (`j <= i + diag_right`); with LOCAL not left of it (`j >= i + diag_left`); with a
    key padding mask it is a real key (`KPM_row[j]`)."""
    visible = cols[None, :] < N_K
    if CAUSAL:
        visible = visible & (cols[None, :] <= offs_m[:, None] + diag_right)
    if LOCAL:
        visible = visible & (cols[None, :] >= offs_m[:, None] + diag_left)
    if HAS_KPM:
        visible = visible & (tl.load(KPM_row + cols, mask=cols < N_K, other=0) != 0)[None, :]
    return visible


_ASM_LOADS = tl.constexpr(not INTERPRET)  # the interpreter runs no inline PTX


@triton.jit
def _page_index(ptrs):
    """The int32 entries at `ptrs` (a block table's), by a load in inline PTX on the GPU. To Triton's software
    pipeliner a K or V load whose address comes from a `tl.load` in the same loop is an indirect load, and it
    then buffers it once and waits for it at once (no overlap with the loop's compute); through this load the
    K and V loads are pipelined as unpaged ones, two blocks ahead. The entries are then read as the loop
    reaches them, from L1 or L2 (a table row is a few lines)."""
    if _ASM_LOADS:
        return tl.inline_asm_elementwise("ld.global.b32 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=True,
                                         pack=1)
    else:
        return tl.load(ptrs)


@triton.jit
def _attn_fwd_inner(acc, acc2, l_i, m_i, q, q2, K_head, V_head, kT_offs, v_offs, kT2_offs, v2_offs,  #
                    stride_kn, stride_vn, KPM_row,  #
                    lo, hi, qk_scale, softcap, offs_m, offs_d, offs_d2, diag_right, diag_left, N_K, head_dim,  #
                    BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, LOCAL: tl.constexpr,  #
                    SOFTCAP: tl.constexpr, HAS_KPM: tl.constexpr,  #
                    MASK_D: tl.constexpr, HEAD_DIM2: tl.constexpr,  #
                    EMULATE_BF16: tl.constexpr, PRECISION: tl.constexpr, ADDR: tl.constexpr,  #
                    Table=None, k_page_stride=0, v_page_stride=0, n_pages=1, PAGE: tl.constexpr = 0):
    """Online softmax over the key blocks [lo, hi). MASK: the blocks hold an edge of the visible band
    (the causal diagonal, a window's edge), the tail, or (HAS_KPM) keys from the row's first padded key on.

    `K_head`, `V_head` point at this head's first key; `kT_offs`, `v_offs` are the element offsets of
    one tile within a block. ADDR: see `_tile`. HEAD_DIM2 > 0 (see `_attn_fwd`): a row's columns come
    in two tiles, and `q2`, `acc2`, `kT2_offs`, `v2_offs`, `offs_d2` are the second tile's (otherwise
    they are unused).

    PAGE > 0 (a paged KV cache, decoding): key j lies at row j % PAGE of page Table[j // PAGE] (an entry
    outside [0, n_pages) is clamped into it: never a read outside the pool), each key row addressed on its
    own, so a block may span pages of any size. `K_head`, `V_head` then point at this head in page 0, pages
    lie `k_page_stride`, `v_page_stride` elements apart, and `kT_offs`, `v_offs` hold only the head_dim
    offsets, (HEAD_DIM, 1) and (1, HEAD_DIM)."""
    tl.static_assert(PAGE == 0 or HEAD_DIM2 == 0)
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if PAGE > 0:
            if PAGE % BLOCK_N == 0:  # the block lies in one page: one index, the block's rows in it
                page = _page_index(Table + start_n // PAGE)
                slot = start_n % PAGE + offs_n
            else:  # a block across pages: one index per key row (past the keys: the last one's page)
                page = _page_index(Table + tl.minimum(cols, N_K - 1) // PAGE)
                slot = cols % PAGE
            page = tl.minimum(tl.maximum(page, 0), n_pages - 1).to(tl.int64)
            k_rows = page * k_page_stride + slot.to(tl.int64) * stride_kn  # (BLOCK_N,) element offsets of the rows
            v_rows = page * v_page_stride + slot.to(tl.int64) * stride_vn
            k_tile = K_head + k_rows[None, :] + kT_offs
        else:
            k_tile = _tile(K_head, start_n, stride_kn, kT_offs, ADDR)
        kT = _load(k_tile, offs_d, cols, head_dim, N_K, MASK_D, MASK)  # (HEAD_DIM, BLOCK_N)
        qk = _dot(q, kT, tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32), EMULATE_BF16, PRECISION)
        if HEAD_DIM2 > 0:  # S = Q K^T summed over both column tiles
            kT2 = _load(_tile(K_head, start_n, stride_kn, kT2_offs, ADDR), offs_d2, cols, head_dim, N_K,
                        False, MASK)  # (HEAD_DIM2, BLOCK_N)
            qk = _dot(q2, kT2, qk, EMULATE_BF16, PRECISION)
        if MASK:
            visible = _visible(offs_m, cols, N_K, diag_right, diag_left, KPM_row, CAUSAL, LOCAL, HAS_KPM)
            qk = tl.where(visible, _scores(qk, qk_scale, softcap, SOFTCAP)[0], float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            # A row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
            m_ij_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            qk -= m_ij_safe[:, None]
        elif SOFTCAP:
            qk = _scores(qk, qk_scale, softcap, SOFTCAP)[0]
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            m_ij_safe = m_ij
            qk -= m_ij[:, None]
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
        if PAGE > 0:
            v_tile = V_head + v_rows[:, None] + v_offs
        else:
            v_tile = _tile(V_head, start_n, stride_vn, v_offs, ADDR)
        v = _load(v_tile, cols, offs_d, N_K, head_dim, MASK, MASK_D)  # (BLOCK_N, HEAD_DIM)
        p = _round(p, v.dtype, EMULATE_BF16)
        acc = _dot(p, v, acc, EMULATE_BF16, PRECISION)
        if HEAD_DIM2 > 0:
            acc2 = acc2 * alpha[:, None]
            v2 = _load(_tile(V_head, start_n, stride_vn, v2_offs, ADDR), cols, offs_d2, N_K, head_dim,
                       MASK, False)  # (BLOCK_N, HEAD_DIM2)
            acc2 = _dot(p, v2, acc2, EMULATE_BF16, PRECISION)
        m_i = m_ij
    return acc, acc2, l_i, m_i


@triton.jit
def _varlen_block(CU, N_SEQ, BLOCK: tl.constexpr):
    """Packed (varlen) batches: the (sequence, block) of this program. Programs are numbered sequence by
    sequence; sequence b's first is CU[b] // BLOCK + b, which leaves room for its cdiv(len_b, BLOCK)
    blocks, so a grid of total // BLOCK + N_SEQ programs covers every sequence with at most one idle
    program per sequence (a grid of max_len / BLOCK programs per sequence would idle most of them on a
    batch of short documents). Bisection over CU finds the last b whose first program is <= ours."""
    pid = tl.program_id(0)
    lo = pid * 0
    hi = lo + N_SEQ - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(CU + mid) // BLOCK + mid <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo.to(tl.int64), pid - (tl.load(CU + lo) // BLOCK + lo)


@triton.jit
def _sequence(CU_Q, CU_K, off_z):
    """Packed batches: where sequence `off_z`'s queries and keys start, and how many there are."""
    q_start = tl.load(CU_Q + off_z).to(tl.int64)
    k_start = tl.load(CU_K + off_z).to(tl.int64)
    n_q = (tl.load(CU_Q + off_z + 1) - q_start).to(tl.int32)
    n_k = (tl.load(CU_K + off_z + 1) - k_start).to(tl.int32)
    return q_start, k_start, n_q, n_k


@triton.jit
def _key_blocks(start_m, N_Q, N_K, WIN_LEFT, WIN_RIGHT, KV_END, off_z,  #
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, LOCAL: tl.constexpr,  #
                VARLEN: tl.constexpr, HAS_KPM: tl.constexpr):
    """The key range of query block `start_m`, cut at block boundaries into three loops:
    [lo, n_lfull) masked (the window's left edge), [n_lfull, n_full) unmasked (every pair visible),
    [n_full, hi) masked (the diagonal or right edge, and the tail). Keys outside [lo, hi) are visible
    to no row of the block and are never loaded. Also returns diag_right and diag_left: query i sees key
    j iff j <= i + diag_right (CAUSAL) and j >= i + diag_left (LOCAL), bottom-right aligned.
    VARLEN: a block past its sequence's end (one per sequence) gets an empty range. HAS_KPM: keys past
    the batch row's last real key (KV_END[off_z, 0], a padded tail) are left out, and the unmasked loop
    stops at the last whole block before its first padded key (KV_END[off_z, 1]): a right-padded row
    (every real key before every padded one, the usual case) masks one block only."""
    diag_offset = N_K - N_Q
    diag_right = diag_offset + WIN_RIGHT  # causal: WIN_RIGHT = 0
    diag_left = diag_offset - WIN_LEFT
    if CAUSAL:
        # Keys j <= start_m * BLOCK_M + diag_right are visible to every row of this block (right edge) ...
        n_full = tl.maximum(start_m * BLOCK_M + diag_right + 1, 0)
        # ... and no row sees a key at or past this one.
        hi = tl.minimum((start_m + 1) * BLOCK_M + diag_right, N_K)
    else:
        n_full = N_K
        hi = N_K
    if CAUSAL:
        n_full = tl.minimum(n_full, N_K)  # (WIN_RIGHT > 0 can reach past the last key)
    n_full = n_full // BLOCK_N * BLOCK_N  # whole, fully visible blocks: no mask at all
    if LOCAL:
        # No row sees a key before the first row's left edge; every row sees keys from the last row's on.
        lo = tl.maximum(start_m * BLOCK_M + diag_left, 0) // BLOCK_N * BLOCK_N
        n_lfull = tl.maximum((start_m + 1) * BLOCK_M - 1 + diag_left, 0)
        n_lfull = (n_lfull + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        hi = tl.maximum(hi, 0)
        n_lfull = tl.minimum(n_lfull, hi)
        n_full = tl.minimum(tl.maximum(n_full, n_lfull), hi)  # lo <= n_lfull <= n_full <= hi
    else:
        lo = 0
        n_lfull = 0  # (a constant: the unmasked loop starts at key 0, as in the kernels without windows)
    if VARLEN:  # a block past this sequence's end (at most one per sequence): nothing to do
        hi = tl.where(start_m * BLOCK_M < N_Q, hi, 0)
        n_full = tl.minimum(n_full, tl.maximum(hi, 0))
        if LOCAL:
            n_lfull = tl.minimum(n_lfull, tl.maximum(hi, 0))
    if HAS_KPM:
        # Keys past this row's last real key (a padded tail) are never loaded, and only whole blocks
        # before its first padded key run unmasked: the masked loop reads the padding mask for the rest.
        kv_end = tl.load(KV_END + 2 * off_z)
        kv_first_pad = tl.load(KV_END + 2 * off_z + 1)
        hi = tl.minimum(hi, kv_end)
        n_full = tl.maximum(tl.minimum(n_full, kv_first_pad // BLOCK_N * BLOCK_N), lo)
        n_lfull = tl.minimum(n_lfull, n_full)
    return lo, n_lfull, n_full, hi, diag_right, diag_left


@triton.jit(do_not_specialize=["N_Q", "N_K", "WIN_LEFT", "WIN_RIGHT", "N_SEQ"])
def _attn_fwd(Q, K, V, sm_scale, LSE, Out, KPM, KV_END, CU_Q, CU_K, softcap,  #
              stride_qz, stride_qh, stride_qm, stride_qd,  #
              stride_kz, stride_kh, stride_kn, stride_kd,  #
              stride_vz, stride_vh, stride_vn, stride_vd,  #
              stride_oz, stride_oh, stride_om, stride_od,  #
              stride_kpmz, stride_lz, stride_lh,  #
              H_Q, GROUP, N_Q, N_K, WIN_LEFT, WIN_RIGHT, head_dim, N_Q_BUCKET, N_K_BUCKET, N_SEQ,  #
              HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, LOCAL: tl.constexpr, SOFTCAP: tl.constexpr,  #
              HAS_KPM: tl.constexpr, VARLEN: tl.constexpr, MASK_D: tl.constexpr,  #
              HEAD_DIM2: tl.constexpr,  #
              EMULATE_BF16: tl.constexpr, PRECISION: tl.constexpr, ADDR: tl.constexpr,  #
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  #
              Table=None, stride_tz=0, N_PAGES=1, PAGE: tl.constexpr = 0):
    """Grid (cdiv(N_Q, BLOCK_M), H_Q, batch). Writes Out (B, H_Q, N_Q, head_dim) and LSE (B, H_Q, N_Q).

    HEAD_DIM2 = 0: a row of q, k, v or o is one tile of HEAD_DIM columns (MASK_D: it runs past head_dim).
    HEAD_DIM2 > 0: two full tiles, columns [0, HEAD_DIM) and [HEAD_DIM, HEAD_DIM + HEAD_DIM2 = head_dim),
    so that a head dim of 96 costs products 64 + 32 wide instead of 128 (`ops._head_tiles`): S sums one
    product per tile, and o keeps one accumulator per tile.

    Masks, each compiled in only when used: CAUSAL bounds the visible band on the right (query i sees
    key j iff j <= i + N_K - N_Q + WIN_RIGHT; plain causal is WIN_RIGHT = 0), LOCAL on the left
    (j >= i + N_K - N_Q - WIN_LEFT), HAS_KPM reads a key padding mask KPM (B, N_K), SOFTCAP caps the
    scores at +-softcap. VARLEN: the batch is packed (flash-attn's varlen layout) into N_SEQ sequences;
    the grid is (total_q // BLOCK_M + N_SEQ, H_Q, 1) and `_varlen_block` gives each program its sequence
    b, whose rows are CU_Q[b]..CU_Q[b+1] and keys CU_K[b]..CU_K[b+1] (N_Q, N_K are then the largest
    lengths, for the block configuration), and the LSE row of token t of head h is at h * stride_lh + t.

    PAGE > 0 (a prefill over a paged cache; forward only, HEAD_DIM2 = 0, no KPM): K and V are pools of N_PAGES
    pages, (N_PAGES, H_KV, PAGE, head_dim) as strides (stride_kz steps from page to page), and key j of
    sequence b is row j % PAGE of page Table[b * stride_tz + j // PAGE] (`_attn_fwd_inner`); CU_K (VARLEN) then
    gives only each sequence's key count."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and HEAD_DIM >= 16)  # smallest GPU dot tile
    off_h = tl.program_id(1)
    off_h_kv = off_h // GROUP  # grouped-query attention: GROUP query heads share one k/v head
    if VARLEN:  # this program's sequence: where its queries and keys start, and how many there are
        off_z, start_m = _varlen_block(CU_Q, N_SEQ, BLOCK_M)
        q_start, k_start, N_Q, N_K = _sequence(CU_Q, CU_K, off_z)
        if PAGE > 0:  # at most the table's width (contiguous: stride_tz) of pages: an unchecked length is clamped
            N_K = tl.minimum(N_K, stride_tz * PAGE)
    else:
        start_m = tl.program_id(0)
        off_z = tl.program_id(2).to(tl.int64)
        q_start = 0
        k_start = 0
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + off_z * stride_qz + off_h.to(tl.int64) * stride_qh \
        + (q_start + offs_m[:, None].to(tl.int64)) * stride_qm + offs_d[None, :] * stride_qd  # (BLOCK_M, HEAD_DIM)
    if PAGE > 0:  # this head in page 0; the pages and rows are found key by key (`_attn_fwd_inner`)
        tl.static_assert(HEAD_DIM2 == 0 and not HAS_KPM)
        K_head = K + off_h_kv.to(tl.int64) * stride_kh
        V_head = V + off_h_kv.to(tl.int64) * stride_vh
        kT_offs = offs_d[:, None] * stride_kd
        v_offs = offs_d[None, :] * stride_vd
        Table_row = Table + off_z * stride_tz
    else:
        K_head = K + off_z * stride_kz + off_h_kv.to(tl.int64) * stride_kh + k_start * stride_kn
        V_head = V + off_z * stride_vz + off_h_kv.to(tl.int64) * stride_vh + k_start * stride_vn
        # K is read transposed, as K^T tiles (HEAD_DIM, BLOCK_N), so that S = Q K^T is a plain dot.
        kT_offs = offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn
        v_offs = offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd  # (BLOCK_N, HEAD_DIM)
        Table_row = Table
    KPM_row = KPM + off_z * stride_kpmz  # this sequence's key padding mask (HAS_KPM only)
    if HEAD_DIM2 > 0:  # the second column tile
        offs_d2 = HEAD_DIM + tl.arange(0, HEAD_DIM2)
        kT2_offs = offs_d2[:, None] * stride_kd + offs_n[None, :] * stride_kn
        v2_offs = offs_n[:, None] * stride_vn + offs_d2[None, :] * stride_vd
    else:  # unused
        offs_d2, kT2_offs, v2_offs = offs_d, kT_offs, v_offs

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")  # running max (base-2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running sum of exp2(s - m_i) v, unnormalised
    qk_scale, cap = _scales(sm_scale, softcap, SOFTCAP)  # one exp2 per score instead of exp
    q = _load(q_ptrs, offs_m, offs_d, N_Q, head_dim, True, MASK_D)  # stays on chip for the whole loop
    if HEAD_DIM2 > 0:
        q2_ptrs = Q + off_z * stride_qz + off_h.to(tl.int64) * stride_qh \
            + (q_start + offs_m[:, None].to(tl.int64)) * stride_qm + offs_d2[None, :] * stride_qd
        q2 = _load(q2_ptrs, offs_m, offs_d2, N_Q, head_dim, True, False)  # (BLOCK_M, HEAD_DIM2)
        acc2 = tl.zeros([BLOCK_M, HEAD_DIM2], dtype=tl.float32)
    else:
        q2, acc2 = q, acc

    lo, n_lfull, n_full, hi, diag_right, diag_left = _key_blocks(start_m, N_Q, N_K, WIN_LEFT, WIN_RIGHT, KV_END,
                                                                 off_z, BLOCK_M, BLOCK_N, CAUSAL, LOCAL, VARLEN,
                                                                 HAS_KPM)
    if LOCAL:  # The window's left edge: masked.
        acc, acc2, l_i, m_i = _attn_fwd_inner(acc, acc2, l_i, m_i, q, q2, K_head, V_head, kT_offs, v_offs,
                                              kT2_offs, v2_offs, stride_kn, stride_vn, KPM_row, lo, n_lfull,
                                              qk_scale, cap, offs_m, offs_d, offs_d2, diag_right, diag_left,
                                              N_K, head_dim, BLOCK_N, True, CAUSAL, LOCAL, SOFTCAP, HAS_KPM,
                                              MASK_D, HEAD_DIM2, EMULATE_BF16, PRECISION, ADDR,
                                              Table_row, stride_kz, stride_vz, N_PAGES, PAGE)
    # Whole blocks that every row sees: unmasked.
    acc, acc2, l_i, m_i = _attn_fwd_inner(acc, acc2, l_i, m_i, q, q2, K_head, V_head, kT_offs, v_offs,
                                          kT2_offs, v2_offs, stride_kn, stride_vn, KPM_row, n_lfull, n_full,
                                          qk_scale, cap, offs_m, offs_d, offs_d2, diag_right, diag_left,
                                          N_K, head_dim, BLOCK_N, False, CAUSAL, LOCAL, SOFTCAP, HAS_KPM,
                                          MASK_D, HEAD_DIM2, EMULATE_BF16, PRECISION, ADDR,
                                          Table_row, stride_kz, stride_vz, N_PAGES, PAGE)
    # The diagonal band (causal), the window's right edge and the partial last block (any): masked.
    acc, acc2, l_i, m_i = _attn_fwd_inner(acc, acc2, l_i, m_i, q, q2, K_head, V_head, kT_offs, v_offs,
                                          kT2_offs, v2_offs, stride_kn, stride_vn, KPM_row, n_full, hi,
                                          qk_scale, cap, offs_m, offs_d, offs_d2, diag_right, diag_left,
                                          N_K, head_dim, BLOCK_N, True, CAUSAL, LOCAL, SOFTCAP, HAS_KPM,
                                          MASK_D, HEAD_DIM2, EMULATE_BF16, PRECISION, ADDR,
                                          Table_row, stride_kz, stride_vz, N_PAGES, PAGE)

    # Epilogue: deferred normalisation, once per row. l_i == 0 iff the row saw no key at all.
    empty = l_i == 0.0
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2  # natural log m + log(l); -inf if empty
    tl.store(LSE + off_z * stride_lz + off_h.to(tl.int64) * stride_lh + q_start + offs_m, lse, mask=offs_m < N_Q)
    o_ptrs = Out + off_z * stride_oz + off_h.to(tl.int64) * stride_oh \
        + (q_start + offs_m[:, None].to(tl.int64)) * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, _round(acc, Out.type.element_ty, EMULATE_BF16),
             mask=(offs_m[:, None] < N_Q) & (offs_d[None, :] < head_dim))
    if HEAD_DIM2 > 0:
        acc2 = acc2 / tl.where(empty, 1.0, l_i)[:, None]
        o2_ptrs = Out + off_z * stride_oz + off_h.to(tl.int64) * stride_oh \
            + (q_start + offs_m[:, None].to(tl.int64)) * stride_om + offs_d2[None, :] * stride_od
        tl.store(o2_ptrs, _round(acc2, Out.type.element_ty, EMULATE_BF16), mask=offs_m[:, None] < N_Q)


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
def _holed(start, skip_lo, skip_hi, HOLE: tl.constexpr):
    """A loop with a hole: steps `start` = lo, lo + BLOCK, ... of a range shortened by the hole's length
    map to the blocks of [lo, hi) outside [skip_lo, skip_hi) (the hole's ends are block-aligned from lo).
    The backward kernels walk the two masked edges of a band (the diagonal, a window's far edge, a
    sequence's partial last block) in one such loop and the unmasked middle in a second: two loops
    instead of three, so the compiled kernel is shorter and keeps fewer tiles in flight."""
    if HOLE:
        start = start + tl.where(start >= skip_lo, skip_hi - skip_lo, 0)
    return start


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, dk2, dv2, k, v, k2, v2, kpm, Q_head, DO_head, qT_offs, do_offs, qT2_offs,  #
                         do2_offs, stride_qm, stride_dom, LSE, Delta, DQ_head, dq_offs, stride_dqm, sm_scale,  #
                         lo, hi, skip_lo, skip_hi, qk_scale, softcap, offs_n, offs_d, offs_d2, diag_right,  #
                         diag_left, N_Q, head_dim, BLOCK_M: tl.constexpr, MASK: tl.constexpr,  #
                         CAUSAL: tl.constexpr, LOCAL: tl.constexpr, SOFTCAP: tl.constexpr, HAS_KPM: tl.constexpr,  #
                         MASK_D: tl.constexpr, HEAD_DIM2: tl.constexpr, EMULATE_BF16: tl.constexpr,  #
                         PRECISION: tl.constexpr, ADDR: tl.constexpr, ATOMIC_DQ: tl.constexpr, HOLE: tl.constexpr):
    """Accumulate dK, dV of this key block over the query blocks [lo, hi); tiles kept transposed.
    HOLE: leave out the blocks [skip_lo, skip_hi) (whole blocks inside [lo, hi)), so that one masked
    loop covers both edges of the band around the unmasked middle (see `_holed`).
    `kpm` (HAS_KPM): this block's keys that are real, (BLOCK_N,) booleans. ATOMIC_DQ (the
    `deterministic=False` backward): also add each query block's share of dQ, scale * dS K, into the
    float32 DQ_head with atomics, so that no second kernel recomputes P and dP for dQ (five matrix
    products per tile pair instead of seven; the order of the additions, hence the rounding, varies
    from run to run). HEAD_DIM2 > 0: the second column tile (`_attn_fwd`), whose `k2`, `v2`, `dk2`, `dv2`,
    `qT2_offs`, `do2_offs`, `offs_d2` are otherwise unused."""
    for start_m in range(lo, hi - (skip_hi - skip_lo if HOLE else 0), BLOCK_M):
        start_m = tl.multiple_of(_holed(start_m, skip_lo, skip_hi, HOLE), BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qT = _load(_tile(Q_head, start_m, stride_qm, qT_offs, ADDR), offs_d, offs_m, head_dim, N_Q,
                   MASK_D, MASK)  # (HEAD_DIM, BLOCK_M)
        if HEAD_DIM2 > 0:
            qT2 = _load(_tile(Q_head, start_m, stride_qm, qT2_offs, ADDR), offs_d2, offs_m, head_dim, N_Q,
                        False, MASK)  # (HEAD_DIM2, BLOCK_M)
        if MASK:
            lse = tl.load(LSE + offs_m, mask=offs_m < N_Q, other=0.0)
            Di = tl.load(Delta + offs_m, mask=offs_m < N_Q, other=0.0)
        else:
            lse = tl.load(LSE + offs_m)
            Di = tl.load(Delta + offs_m)
        # Base-2 LSE; an empty row (LSE = -inf) gets +inf so that its P is exp2(-inf) = 0.
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        # Recompute P^T = exp(S^T - LSE) from the saved LSE: no (N_Q, N_K) matrix was stored.
        qkT = _dot(k, qT, tl.zeros([k.shape[0], BLOCK_M], dtype=tl.float32), EMULATE_BF16, PRECISION)
        if HEAD_DIM2 > 0:
            qkT = _dot(k2, qT2, qkT, EMULATE_BF16, PRECISION)
        sT, tT = _scores(qkT, qk_scale, softcap, SOFTCAP)
        pT = tl.math.exp2(sT - lse2[None, :])  # (BLOCK_N, BLOCK_M)
        if MASK:
            visible = offs_m[None, :] < N_Q
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + diag_right)
            if LOCAL:
                visible = visible & (offs_n[:, None] >= offs_m[None, :] + diag_left)
            pT = tl.where(visible, pT, 0.0)
        if HAS_KPM:
            pT = tl.where(kpm[:, None], pT, 0.0)
        do = _load(_tile(DO_head, start_m, stride_dom, do_offs, ADDR), offs_m, offs_d, N_Q, head_dim,
                   MASK, MASK_D)  # (BLOCK_M, HEAD_DIM)
        # dV += P^T dO
        pT16 = _round(pT, do.dtype, EMULATE_BF16)
        dv = _dot(pT16, do, dv, EMULATE_BF16, PRECISION)
        # dP^T = V dO^T ;  dS^T = P^T * (dP^T - D)
        dpT = _dot(v, tl.trans(do), tl.zeros([k.shape[0], BLOCK_M], dtype=tl.float32), EMULATE_BF16, PRECISION)
        if HEAD_DIM2 > 0:
            do2 = _load(_tile(DO_head, start_m, stride_dom, do2_offs, ADDR), offs_m, offs_d2, N_Q, head_dim,
                        MASK, False)  # (BLOCK_M, HEAD_DIM2)
            dv2 = _dot(pT16, do2, dv2, EMULATE_BF16, PRECISION)
            dpT = _dot(v2, tl.trans(do2), dpT, EMULATE_BF16, PRECISION)
        dsT = pT * (dpT - Di[None, :])
        if SOFTCAP:  # chain rule through s = c tanh(s_raw / c): ds_raw = ds * (1 - tanh^2)
            dsT = dsT * (1.0 - tT * tT)
        # dK += dS^T Q   (times softmax_scale, applied once at the end)
        dsT = _round(dsT, qT.dtype, EMULATE_BF16)
        dk = _dot(dsT, tl.trans(qT), dk, EMULATE_BF16, PRECISION)
        if HEAD_DIM2 > 0:
            dk2 = _dot(dsT, tl.trans(qT2), dk2, EMULATE_BF16, PRECISION)
        if ATOMIC_DQ:  # dQ[rows of this block] += scale * dS K
            dq = _dot(tl.trans(dsT), k, tl.zeros([BLOCK_M, k.shape[1]], dtype=tl.float32), EMULATE_BF16,
                      PRECISION) * sm_scale
            if ATOMIC_DQ == 2:  # one bulk reduce-add of the tile (TMA on Hopper), clipped to the head's rows
                DQ_head.atomic_add([start_m, 0], dq)
            else:
                tl.atomic_add(DQ_head + start_m * stride_dqm + dq_offs, dq,
                              mask=(offs_m[:, None] < N_Q) & (offs_d[None, :] < head_dim), sem="relaxed")
    return dk, dv, dk2, dv2


@triton.jit
def _query_blocks(start_n, N_Q, N_K, WIN_LEFT, WIN_RIGHT, KV_END, off_z,  #
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, LOCAL: tl.constexpr,  #
                  VARLEN: tl.constexpr, HAS_KPM: tl.constexpr):
    """The query range that sees key block `start_n` (the transpose of `_key_blocks`), cut into
    [m_lo, m_full) masked (the diagonal band or right edge), [m_full, m_lfull) unmasked (every row sees
    every key of the block), [m_lfull, m_hi) masked (the window's left edge and the partial last query
    block). Rows outside [m_lo, m_hi) see none of the block's keys. Also returns diag_right, diag_left.
    VARLEN: a key block past its sequence's end gets an empty range; HAS_KPM: so does a block of padding
    only (at or past KV_END[off_z, 0]): its dK and dV are 0."""
    diag_offset = N_K - N_Q
    diag_right = diag_offset + WIN_RIGHT
    diag_left = diag_offset - WIN_LEFT
    if CAUSAL:
        # query i sees key j iff j <= i + diag_right: rows below m_lo see none of this block's keys,
        # rows from m_full on see all of them (from the right edge's side).
        m_lo = tl.maximum(start_n - diag_right, 0) // BLOCK_M * BLOCK_M
        m_full = tl.maximum(start_n + BLOCK_N - 1 - diag_right, 0)
        m_full = (m_full + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:
        m_lo = 0
        m_full = 0
    if LOCAL:
        # query i sees key j iff j >= i + diag_left: rows past the last key's edge see none of them,
        # rows up to the first key's edge see all of them.
        m_hi = tl.minimum(tl.maximum(start_n + BLOCK_N - diag_left, 0), N_Q)
        m_lfull = tl.minimum(tl.maximum(start_n - diag_left + 1, 0), N_Q) // BLOCK_M * BLOCK_M
    else:
        m_hi = N_Q
        m_lfull = N_Q // BLOCK_M * BLOCK_M
    m_full = tl.minimum(m_full, m_hi)
    m_lfull = tl.minimum(tl.maximum(m_lfull, m_full), m_hi)  # m_lo <= m_full <= m_lfull <= m_hi
    if VARLEN:
        m_hi = tl.where(start_n < N_K, m_hi, 0)  # a block past this sequence's keys: nothing to do
        m_full = tl.minimum(m_full, m_hi)
        m_lfull = tl.minimum(m_lfull, m_hi)
    if HAS_KPM:  # a block of padding only (past the row's last real key): dK = dV = 0
        m_hi = tl.where(start_n < tl.load(KV_END + 2 * off_z), m_hi, 0)
        m_full = tl.minimum(m_full, m_hi)
        m_lfull = tl.minimum(m_lfull, m_hi)
    return m_lo, m_full, m_lfull, m_hi, diag_right, diag_left


# The dK/dV kernel lets Triton specialise its integer arguments (divisibility by 16), unlike the other two:
# on the H200 that made it 3-9% faster under a sliding window (bf16, N = 8k-16k; benchmarks/probes/probe_variants.py),
# at the cost of at most a few compiled variants per shape class.
@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, Delta, DK, DV, sm_scale, KPM, KV_END, CU_Q, CU_K, softcap,  #
                   stride_qz, stride_qh, stride_qm, stride_qd,  #
                   stride_kz, stride_kh, stride_kn, stride_kd,  #
                   stride_vz, stride_vh, stride_vn, stride_vd,  #
                   stride_doz, stride_doh, stride_dom, stride_dod,  #
                   stride_dkz, stride_dkh, stride_dkn, stride_dkd,  #
                   stride_dvz, stride_dvh, stride_dvn, stride_dvd,  #
                   DQ, stride_dqz, stride_dqh, stride_dqm, stride_dqd,  #
                   stride_kpmz, stride_lz, stride_lh,  #
                   H_Q, H_KV, GROUP, N_Q, N_K, WIN_LEFT, WIN_RIGHT, head_dim, N_Q_BUCKET, N_K_BUCKET, N_SEQ,  #
                   HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, LOCAL: tl.constexpr, SOFTCAP: tl.constexpr,  #
                   HAS_KPM: tl.constexpr, VARLEN: tl.constexpr, MASK_D: tl.constexpr, HEAD_DIM2: tl.constexpr,  #
                   GQA: tl.constexpr, EMULATE_BF16: tl.constexpr, PRECISION: tl.constexpr, ADDR: tl.constexpr,  #
                   ATOMIC_DQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(N_K, BLOCK_N), H_KV, batch). Writes DK, DV (B, H_KV, N_K, head_dim).
    Masks and VARLEN as in `_attn_fwd`; LSE and Delta share the LSE's layout. ATOMIC_DQ: also adds
    dQ into the zeroed float32 DQ (B, H_Q, N_Q, head_dim) (see `_attn_bwd_dkdv_inner`); otherwise DQ
    is never touched. HEAD_DIM2: two column tiles, as in `_attn_fwd` (not with ATOMIC_DQ)."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and HEAD_DIM >= 16)
    tl.static_assert(HEAD_DIM2 == 0 or not ATOMIC_DQ)
    off_h_kv = tl.program_id(1)
    if VARLEN:
        off_z, start_n = _varlen_block(CU_K, N_SEQ, BLOCK_N)
        start_n = start_n * BLOCK_N
        q_start, k_start, N_Q, N_K = _sequence(CU_Q, CU_K, off_z)
    else:
        start_n = tl.program_id(0) * BLOCK_N
        off_z = tl.program_id(2).to(tl.int64)
        q_start = 0
        k_start = 0
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    k_ptrs = K + off_z * stride_kz + off_h_kv.to(tl.int64) * stride_kh \
        + (k_start + offs_n[:, None].to(tl.int64)) * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + off_z * stride_vz + off_h_kv.to(tl.int64) * stride_vh \
        + (k_start + offs_n[:, None].to(tl.int64)) * stride_vn + offs_d[None, :] * stride_vd
    # K and V of this block stay on chip while every query block streams past.
    k = _load(k_ptrs, offs_n, offs_d, N_K, head_dim, True, MASK_D)  # (BLOCK_N, HEAD_DIM)
    v = _load(v_ptrs, offs_n, offs_d, N_K, head_dim, True, MASK_D)
    if HAS_KPM:
        kpm = tl.load(KPM + off_z * stride_kpmz + offs_n, mask=offs_n < N_K, other=0) != 0
    else:
        kpm = offs_n < N_K  # unused
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale, cap = _scales(sm_scale, softcap, SOFTCAP)
    qT_offs = offs_d[:, None] * stride_qd + offs_m[None, :] * stride_qm  # (HEAD_DIM, BLOCK_M) within a head
    do_offs = offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod  # (BLOCK_M, HEAD_DIM)
    dq_offs = offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
    if HEAD_DIM2 > 0:  # the second column tile of K, V, dK, dV and of each Q and dO block
        offs_d2 = HEAD_DIM + tl.arange(0, HEAD_DIM2)
        k2_ptrs = K + off_z * stride_kz + off_h_kv.to(tl.int64) * stride_kh \
            + (k_start + offs_n[:, None].to(tl.int64)) * stride_kn + offs_d2[None, :] * stride_kd
        v2_ptrs = V + off_z * stride_vz + off_h_kv.to(tl.int64) * stride_vh \
            + (k_start + offs_n[:, None].to(tl.int64)) * stride_vn + offs_d2[None, :] * stride_vd
        k2 = _load(k2_ptrs, offs_n, offs_d2, N_K, head_dim, True, False)  # (BLOCK_N, HEAD_DIM2)
        v2 = _load(v2_ptrs, offs_n, offs_d2, N_K, head_dim, True, False)
        dk2 = tl.zeros([BLOCK_N, HEAD_DIM2], dtype=tl.float32)
        dv2 = tl.zeros([BLOCK_N, HEAD_DIM2], dtype=tl.float32)
        qT2_offs = offs_d2[:, None] * stride_qd + offs_m[None, :] * stride_qm
        do2_offs = offs_m[:, None] * stride_dom + offs_d2[None, :] * stride_dod
    else:  # unused
        offs_d2, k2, v2, dk2, dv2, qT2_offs, do2_offs = offs_d, k, v, dk, dv, qT_offs, do_offs

    # Which query blocks touch this key block? [m_lo, m_full) is the diagonal band (masked),
    # [m_full, m_lfull) whole blocks (unmasked), [m_lfull, m_hi) the window's left edge and the
    # partial last query block (masked).
    m_lo, m_full, m_lfull, m_hi, diag_right, diag_left = _query_blocks(start_n, N_Q, N_K, WIN_LEFT, WIN_RIGHT,
                                                                       KV_END, off_z, BLOCK_M, BLOCK_N, CAUSAL,
                                                                       LOCAL, VARLEN, HAS_KPM)

    # Grouped-query attention: this k/v head serves GROUP query heads; sum their contributions here,
    # in a fixed order, instead of with atomics across programs. (Plain multi-head attention skips
    # the loop at compile time: wrapped around the three pipelined loops it costs registers.)
    for g in range(GROUP if GQA else 1):
        off_h = off_h_kv * GROUP + g
        Q_head = Q + off_z * stride_qz + off_h.to(tl.int64) * stride_qh + q_start * stride_qm
        DO_head = DO + off_z * stride_doz + off_h.to(tl.int64) * stride_doh + q_start * stride_dom
        row_offset = off_z * stride_lz + off_h.to(tl.int64) * stride_lh + q_start
        DQ_head = DQ + off_z * stride_dqz + off_h.to(tl.int64) * stride_dqh + q_start * stride_dqm
        if ATOMIC_DQ == 2:
            DQ_head = tl.make_tensor_descriptor(DQ_head, shape=[N_Q, head_dim], strides=[stride_dqm, 1],
                                                block_shape=[BLOCK_M, HEAD_DIM])
        # The diagonal band (masked), the unmasked middle [m_full, m_lfull), the partial last query block
        # (masked). Under a window or in a packed batch both masked edges (the diagonal band; the window's far
        # edge or the sequence's partial last query block) run first, in one loop around the middle.
        if LOCAL or VARLEN:
            dk, dv, dk2, dv2 = _attn_bwd_dkdv_inner(dk, dv, dk2, dv2, k, v, k2, v2, kpm, Q_head, DO_head,
                                                    qT_offs, do_offs, qT2_offs, do2_offs, stride_qm, stride_dom,
                                                    LSE + row_offset, Delta + row_offset, DQ_head, dq_offs,
                                                    stride_dqm, sm_scale, m_lo, m_hi, m_full, m_lfull, qk_scale, cap,
                                                    offs_n, offs_d, offs_d2, diag_right, diag_left, N_Q, head_dim,
                                                    BLOCK_M, True, CAUSAL, LOCAL, SOFTCAP, HAS_KPM, MASK_D,
                                                    HEAD_DIM2, EMULATE_BF16, PRECISION, ADDR, ATOMIC_DQ, True)
        else:
            dk, dv, dk2, dv2 = _attn_bwd_dkdv_inner(dk, dv, dk2, dv2, k, v, k2, v2, kpm, Q_head, DO_head,
                                                    qT_offs, do_offs, qT2_offs, do2_offs, stride_qm, stride_dom,
                                                    LSE + row_offset, Delta + row_offset, DQ_head, dq_offs,
                                                    stride_dqm, sm_scale, m_lo, m_full, 0, 0, qk_scale, cap,
                                                    offs_n, offs_d, offs_d2, diag_right, diag_left, N_Q, head_dim,
                                                    BLOCK_M, True, CAUSAL, LOCAL, SOFTCAP, HAS_KPM, MASK_D,
                                                    HEAD_DIM2, EMULATE_BF16, PRECISION, ADDR, ATOMIC_DQ, False)
        dk, dv, dk2, dv2 = _attn_bwd_dkdv_inner(dk, dv, dk2, dv2, k, v, k2, v2, kpm, Q_head, DO_head,
                                                qT_offs, do_offs, qT2_offs, do2_offs, stride_qm, stride_dom,
                                                LSE + row_offset, Delta + row_offset, DQ_head, dq_offs,
                                                stride_dqm, sm_scale, m_full, m_lfull, 0, 0, qk_scale, cap,
                                                offs_n, offs_d, offs_d2, diag_right, diag_left, N_Q, head_dim,
                                                BLOCK_M, False, CAUSAL, LOCAL, SOFTCAP, HAS_KPM, MASK_D,
                                                HEAD_DIM2, EMULATE_BF16, PRECISION, ADDR, ATOMIC_DQ, False)
        if not (LOCAL or VARLEN):
            dk, dv, dk2, dv2 = _attn_bwd_dkdv_inner(dk, dv, dk2, dv2, k, v, k2, v2, kpm, Q_head, DO_head,
                                                    qT_offs, do_offs, qT2_offs, do2_offs, stride_qm, stride_dom,
                                                    LSE + row_offset, Delta + row_offset, DQ_head, dq_offs,
                                                    stride_dqm, sm_scale, m_lfull, m_hi, 0, 0, qk_scale, cap,
                                                    offs_n, offs_d, offs_d2, diag_right, diag_left, N_Q, head_dim,
                                                    BLOCK_M, True, CAUSAL, LOCAL, SOFTCAP, HAS_KPM, MASK_D,
                                                    HEAD_DIM2, EMULATE_BF16, PRECISION, ADDR, ATOMIC_DQ, False)

    dk *= sm_scale  # S = scale * Q K^T, so dK = scale * dS^T Q
    mask = (offs_n[:, None] < N_K) & (offs_d[None, :] < head_dim)
    dk_ptrs = DK + off_z * stride_dkz + off_h_kv.to(tl.int64) * stride_dkh \
        + (k_start + offs_n[:, None].to(tl.int64)) * stride_dkn + offs_d[None, :] * stride_dkd
    dv_ptrs = DV + off_z * stride_dvz + off_h_kv.to(tl.int64) * stride_dvh \
        + (k_start + offs_n[:, None].to(tl.int64)) * stride_dvn + offs_d[None, :] * stride_dvd
    tl.store(dk_ptrs, _round(dk, DK.type.element_ty, EMULATE_BF16), mask=mask)
    tl.store(dv_ptrs, _round(dv, DV.type.element_ty, EMULATE_BF16), mask=mask)
    if HEAD_DIM2 > 0:
        dk2 *= sm_scale
        dk2_ptrs = DK + off_z * stride_dkz + off_h_kv.to(tl.int64) * stride_dkh \
            + (k_start + offs_n[:, None].to(tl.int64)) * stride_dkn + offs_d2[None, :] * stride_dkd
        dv2_ptrs = DV + off_z * stride_dvz + off_h_kv.to(tl.int64) * stride_dvh \
            + (k_start + offs_n[:, None].to(tl.int64)) * stride_dvn + offs_d2[None, :] * stride_dvd
        tl.store(dk2_ptrs, _round(dk2, DK.type.element_ty, EMULATE_BF16), mask=offs_n[:, None] < N_K)
        tl.store(dv2_ptrs, _round(dv2, DV.type.element_ty, EMULATE_BF16), mask=offs_n[:, None] < N_K)


# ---------------------------------------------------------------------------------------------------
# 4. dQ: one program per query block, looping over key blocks exactly like the forward pass.
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _attn_bwd_dq_inner(dq, dq2, q, q2, do, do2, lse2, Di, K_head, V_head, kT_offs, vT_offs, kT2_offs, vT2_offs,  #
                       stride_kn, stride_vn, KPM_row, lo, hi, skip_lo, skip_hi, qk_scale, softcap, offs_m,  #
                       offs_d, offs_d2, diag_right, diag_left, N_K, head_dim, BLOCK_N: tl.constexpr,  #
                       MASK: tl.constexpr, CAUSAL: tl.constexpr, LOCAL: tl.constexpr, SOFTCAP: tl.constexpr,  #
                       HAS_KPM: tl.constexpr, MASK_D: tl.constexpr, HEAD_DIM2: tl.constexpr,  #
                       EMULATE_BF16: tl.constexpr, PRECISION: tl.constexpr, ADDR: tl.constexpr, HOLE: tl.constexpr):
    """Accumulate dQ of this query block over the key blocks [lo, hi), less [skip_lo, skip_hi) with HOLE.
    HEAD_DIM2 > 0: the second column tile (`_attn_fwd`); `dq2`, `q2`, `do2`, `kT2_offs`, `vT2_offs`,
    `offs_d2` are otherwise unused."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi - (skip_hi - skip_lo if HOLE else 0), BLOCK_N):
        start_n = tl.multiple_of(_holed(start_n, skip_lo, skip_hi, HOLE), BLOCK_N)
        cols = start_n + offs_n
        kT = _load(_tile(K_head, start_n, stride_kn, kT_offs, ADDR), offs_d, cols, head_dim, N_K,
                   MASK_D, MASK)  # (HEAD_DIM, BLOCK_N)
        vT = _load(_tile(V_head, start_n, stride_vn, vT_offs, ADDR), offs_d, cols, head_dim, N_K,
                   MASK_D, MASK)
        qk = _dot(q, kT, tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32), EMULATE_BF16, PRECISION)
        if HEAD_DIM2 > 0:
            kT2 = _load(_tile(K_head, start_n, stride_kn, kT2_offs, ADDR), offs_d2, cols, head_dim, N_K,
                        False, MASK)  # (HEAD_DIM2, BLOCK_N)
            vT2 = _load(_tile(V_head, start_n, stride_vn, vT2_offs, ADDR), offs_d2, cols, head_dim, N_K,
                        False, MASK)
            qk = _dot(q2, kT2, qk, EMULATE_BF16, PRECISION)
        s, t = _scores(qk, qk_scale, softcap, SOFTCAP)
        p = tl.math.exp2(s - lse2[:, None])  # P recomputed from the LSE
        if MASK:
            visible = _visible(offs_m, cols, N_K, diag_right, diag_left, KPM_row, CAUSAL, LOCAL, HAS_KPM)
            p = tl.where(visible, p, 0.0)
        # dP = dO V^T ;  dS = P * (dP - D) ;  dQ += dS K   (times softmax_scale at the end)
        dp = _dot(do, vT, tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32), EMULATE_BF16, PRECISION)
        if HEAD_DIM2 > 0:
            dp = _dot(do2, vT2, dp, EMULATE_BF16, PRECISION)
        ds = p * (dp - Di[:, None])
        if SOFTCAP:  # chain rule through the cap
            ds = ds * (1.0 - t * t)
        ds = _round(ds, kT.dtype, EMULATE_BF16)
        dq = _dot(ds, tl.trans(kT), dq, EMULATE_BF16, PRECISION)
        if HEAD_DIM2 > 0:
            dq2 = _dot(ds, tl.trans(kT2), dq2, EMULATE_BF16, PRECISION)
    return dq, dq2


@triton.jit(do_not_specialize=["N_Q", "N_K", "WIN_LEFT", "WIN_RIGHT", "N_SEQ"])
def _attn_bwd_dq(Q, K, V, DO, LSE, Delta, DQ, sm_scale, KPM, KV_END, CU_Q, CU_K, softcap,  #
                 stride_qz, stride_qh, stride_qm, stride_qd,  #
                 stride_kz, stride_kh, stride_kn, stride_kd,  #
                 stride_vz, stride_vh, stride_vn, stride_vd,  #
                 stride_doz, stride_doh, stride_dom, stride_dod,  #
                 stride_dqz, stride_dqh, stride_dqm, stride_dqd,  #
                 stride_kpmz, stride_lz, stride_lh,  #
                 H_Q, GROUP, N_Q, N_K, WIN_LEFT, WIN_RIGHT, head_dim, N_Q_BUCKET, N_K_BUCKET, N_SEQ,  #
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, LOCAL: tl.constexpr, SOFTCAP: tl.constexpr,  #
                 HAS_KPM: tl.constexpr, VARLEN: tl.constexpr, MASK_D: tl.constexpr, HEAD_DIM2: tl.constexpr,  #
                 EMULATE_BF16: tl.constexpr, PRECISION: tl.constexpr, ADDR: tl.constexpr,  #
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(N_Q, BLOCK_M), H_Q, batch). Writes DQ (B, H_Q, N_Q, head_dim). Masks and HEAD_DIM2 as
    in `_attn_fwd`."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and HEAD_DIM >= 16)
    off_h = tl.program_id(1)
    off_h_kv = off_h // GROUP
    if VARLEN:
        off_z, start_m = _varlen_block(CU_Q, N_SEQ, BLOCK_M)
        q_start, k_start, N_Q, N_K = _sequence(CU_Q, CU_K, off_z)
    else:
        start_m = tl.program_id(0)
        off_z = tl.program_id(2).to(tl.int64)
        q_start = 0
        k_start = 0
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + off_z * stride_qz + off_h.to(tl.int64) * stride_qh \
        + (q_start + offs_m[:, None].to(tl.int64)) * stride_qm + offs_d[None, :] * stride_qd
    do_ptrs = DO + off_z * stride_doz + off_h.to(tl.int64) * stride_doh \
        + (q_start + offs_m[:, None].to(tl.int64)) * stride_dom + offs_d[None, :] * stride_dod
    K_head = K + off_z * stride_kz + off_h_kv.to(tl.int64) * stride_kh + k_start * stride_kn
    V_head = V + off_z * stride_vz + off_h_kv.to(tl.int64) * stride_vh + k_start * stride_vn
    kT_offs = offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn  # (HEAD_DIM, BLOCK_N) within a head
    vT_offs = offs_d[:, None] * stride_vd + offs_n[None, :] * stride_vn
    KPM_row = KPM + off_z * stride_kpmz
    row = off_z * stride_lz + off_h.to(tl.int64) * stride_lh + q_start + offs_m
    q = _load(q_ptrs, offs_m, offs_d, N_Q, head_dim, True, MASK_D)  # (BLOCK_M, HEAD_DIM)
    do = _load(do_ptrs, offs_m, offs_d, N_Q, head_dim, True, MASK_D)
    lse = tl.load(LSE + row, mask=offs_m < N_Q, other=0.0)
    Di = tl.load(Delta + row, mask=offs_m < N_Q, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # empty row -> P = 0
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale, cap = _scales(sm_scale, softcap, SOFTCAP)
    if HEAD_DIM2 > 0:  # the second column tile
        offs_d2 = HEAD_DIM + tl.arange(0, HEAD_DIM2)
        q2_ptrs = Q + off_z * stride_qz + off_h.to(tl.int64) * stride_qh \
            + (q_start + offs_m[:, None].to(tl.int64)) * stride_qm + offs_d2[None, :] * stride_qd
        do2_ptrs = DO + off_z * stride_doz + off_h.to(tl.int64) * stride_doh \
            + (q_start + offs_m[:, None].to(tl.int64)) * stride_dom + offs_d2[None, :] * stride_dod
        q2 = _load(q2_ptrs, offs_m, offs_d2, N_Q, head_dim, True, False)  # (BLOCK_M, HEAD_DIM2)
        do2 = _load(do2_ptrs, offs_m, offs_d2, N_Q, head_dim, True, False)
        kT2_offs = offs_d2[:, None] * stride_kd + offs_n[None, :] * stride_kn
        vT2_offs = offs_d2[:, None] * stride_vd + offs_n[None, :] * stride_vn
        dq2 = tl.zeros([BLOCK_M, HEAD_DIM2], dtype=tl.float32)
    else:  # unused
        offs_d2, q2, do2, kT2_offs, vT2_offs, dq2 = offs_d, q, do, kT_offs, vT_offs, dq

    # Same split of the key range as the forward pass.
    lo, n_lfull, n_full, hi, diag_right, diag_left = _key_blocks(start_m, N_Q, N_K, WIN_LEFT, WIN_RIGHT, KV_END,
                                                                 off_z, BLOCK_M, BLOCK_N, CAUSAL, LOCAL, VARLEN,
                                                                 HAS_KPM)
    if LOCAL:
        # A window: both masked edges (the left edge [lo, n_lfull) and the diagonal [n_full, hi)) in one
        # loop around the unmasked middle, then the middle. Two loops, as without a window: in three
        # (left edge, unmasked, diagonal) the kernel's code was 1.6x as long and slower on the H200 than
        # even one masked loop over the whole band; the holed loop took the dQ kernel 7-9% below that
        # one loop at a 4096-key window (bf16, N = 8k and 16k; benchmarks/probes/probe_variants.py, chapter 8).
        dq, dq2 = _attn_bwd_dq_inner(dq, dq2, q, q2, do, do2, lse2, Di, K_head, V_head, kT_offs, vT_offs,
                                     kT2_offs, vT2_offs, stride_kn, stride_vn, KPM_row, lo, hi, n_lfull, n_full,
                                     qk_scale, cap, offs_m, offs_d, offs_d2, diag_right, diag_left, N_K, head_dim,
                                     BLOCK_N, True, CAUSAL, LOCAL, SOFTCAP, HAS_KPM, MASK_D, HEAD_DIM2,
                                     EMULATE_BF16, PRECISION, ADDR, True)
        dq, dq2 = _attn_bwd_dq_inner(dq, dq2, q, q2, do, do2, lse2, Di, K_head, V_head, kT_offs, vT_offs,
                                     kT2_offs, vT2_offs, stride_kn, stride_vn, KPM_row, n_lfull, n_full, 0, 0,
                                     qk_scale, cap, offs_m, offs_d, offs_d2, diag_right, diag_left, N_K, head_dim,
                                     BLOCK_N, False, CAUSAL, LOCAL, SOFTCAP, HAS_KPM, MASK_D, HEAD_DIM2,
                                     EMULATE_BF16, PRECISION, ADDR, False)
    else:
        dq, dq2 = _attn_bwd_dq_inner(dq, dq2, q, q2, do, do2, lse2, Di, K_head, V_head, kT_offs, vT_offs,
                                     kT2_offs, vT2_offs, stride_kn, stride_vn, KPM_row, n_lfull, n_full, 0, 0,
                                     qk_scale, cap, offs_m, offs_d, offs_d2, diag_right, diag_left, N_K, head_dim,
                                     BLOCK_N, False, CAUSAL, LOCAL, SOFTCAP, HAS_KPM, MASK_D, HEAD_DIM2,
                                     EMULATE_BF16, PRECISION, ADDR, False)
        dq, dq2 = _attn_bwd_dq_inner(dq, dq2, q, q2, do, do2, lse2, Di, K_head, V_head, kT_offs, vT_offs,
                                     kT2_offs, vT2_offs, stride_kn, stride_vn, KPM_row, n_full, hi, 0, 0,
                                     qk_scale, cap, offs_m, offs_d, offs_d2, diag_right, diag_left, N_K, head_dim,
                                     BLOCK_N, True, CAUSAL, LOCAL, SOFTCAP, HAS_KPM, MASK_D, HEAD_DIM2,
                                     EMULATE_BF16, PRECISION, ADDR, False)

    dq *= sm_scale  # S = scale * Q K^T, so dQ = scale * dS K
    dq_ptrs = DQ + off_z * stride_dqz + off_h.to(tl.int64) * stride_dqh \
        + (q_start + offs_m[:, None].to(tl.int64)) * stride_dqm + offs_d[None, :] * stride_dqd
    tl.store(dq_ptrs, _round(dq, DQ.type.element_ty, EMULATE_BF16),
             mask=(offs_m[:, None] < N_Q) & (offs_d[None, :] < head_dim))
    if HEAD_DIM2 > 0:
        dq2 *= sm_scale
        dq2_ptrs = DQ + off_z * stride_dqz + off_h.to(tl.int64) * stride_dqh \
            + (q_start + offs_m[:, None].to(tl.int64)) * stride_dqm + offs_d2[None, :] * stride_dqd
        tl.store(dq2_ptrs, _round(dq2, DQ.type.element_ty, EMULATE_BF16), mask=offs_m[:, None] < N_Q)


# Opt-in autotuned versions of the three tiled kernels (`autotune=True`): the same kernels, with
# BLOCK_M, BLOCK_N, num_warps and num_stages timed from the candidates above for each key.
_attn_fwd_tuned = triton.autotune(configs=FWD_CONFIGS, **_tune("fwd"))(_attn_fwd)
_attn_bwd_dkdv_tuned = triton.autotune(configs=DKDV_CONFIGS, **_tune("dkdv"))(_attn_bwd_dkdv)
_attn_bwd_dq_tuned = triton.autotune(configs=DQ_CONFIGS, **_tune("dq"))(_attn_bwd_dq)
# The one-pass backward of `deterministic=False` (ATOMIC_DQ) runs the dK/dV kernel without integer
# specialisation, as it was compiled when its GPU tests passed: with specialisation two of its six GPU tests
# failed on the H200 (one of them the 1023-key window with softcap, bf16, N = 4096, TMA reduce-adds; the
# output did not name the other), for a reason not yet found.
# Each timed trial of its autotuned twin adds into DQ, so the autotuner zeroes it before each one.
_attn_bwd_dkdv_atomic = triton.jit(do_not_specialize=["N_Q", "N_K", "WIN_LEFT", "WIN_RIGHT", "N_SEQ"])(
    _attn_bwd_dkdv.fn)
_attn_bwd_dkdv_atomic_tuned = triton.autotune(configs=DKDV_CONFIGS, reset_to_zero=["DQ"], **_tune("dkdv"))(
    _attn_bwd_dkdv_atomic)


# ---------------------------------------------------------------------------------------------------
# 5. Decoding: split-KV over a KV cache, then an exact combine (fa_lib.decode launches them).
# ---------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["N_Q", "N_NEW"])
def _decode_split(Q, K, V, CacheSeqLens, N_NEW, N_MAX, sm_scale, O_part, LSE_part, Out, LSE, Arrived,  #
                  Table, stride_tz, N_PAGES,  #
                  stride_qz, stride_qh, stride_qm, stride_qd,  #
                  stride_kz, stride_kh, stride_kn, stride_kd,  #
                  stride_vz, stride_vh, stride_vn, stride_vd,  #
                  stride_oz, stride_oh, stride_om, stride_od,  #
                  B, H_Q, H_KV, GROUP, N_Q, head_dim, NUM_SPLITS,  #
                  HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASK_D: tl.constexpr,  #
                  EMULATE_BF16: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,  #
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  #
                  FUSED: tl.constexpr = False, BLOCK_S: tl.constexpr = 1, ROWS_C: tl.constexpr = 1,  #
                  PDL: tl.constexpr = False, PAGE: tl.constexpr = 0,  #
                  WIN_LEFT=0, WIN_RIGHT=0, softcap=0.0, LOCAL: tl.constexpr = False, SOFTCAP: tl.constexpr = 0,  #
                  LeftPad=None, LEFTPAD: tl.constexpr = False):
    """Grid (NUM_SPLITS, B * H_KV, cdiv(GROUP * N_Q, BLOCK_M)). One program: one chunk of one sequence's
    keys (`CacheSeqLens[b] + N_NEW` valid keys, cut as `reference.split_bounds` cuts them) for the GROUP query heads
    that share cache head `h_kv`, packed into one tile of GROUP * N_Q rows (row = g * N_Q + i), so the
    cache is read once per KV head. SPLIT: write the normalised partial (o, LSE) in float32 to O_part
    (NUM_SPLITS, B, H_Q, N_Q, HEAD_DIM) and LSE_part for `_decode_combine`; else (one split) write the
    final Out and LSE directly. FUSED (with SPLIT): no second kernel; the last of a tile's NUM_SPLITS
    programs to finish merges the tile's partials itself (`_merge_tile`). Each program counts itself in
    Arrived (one zeroed int32 per (b, h_kv, query tile)) after its partial is stored, and the one that
    finds NUM_SPLITS - 1 programs there before it is the last. PDL (launched with programmatic dependent
    launch, Hopper on): wait for the kernel before this one in the stream to finish (its writes to the
    cache, the queries, the lengths) before reading anything, and let the next kernel's programs be
    scheduled from the start, so that a launch's latency overlaps the previous kernel's tail.
    PAGE > 0: a paged cache. K and V are pools of N_PAGES pages (N_PAGES, H_KV, PAGE, HEAD_DIM) (their
    stride_kz, stride_vz step from page to page) and sequence b's key j lies at row j % PAGE of page
    Table[b * stride_tz + j // PAGE]; N_MAX is the table's width times PAGE.
    The band (`ops._band`), bottom-right over the n_k valid keys: CAUSAL, a right edge (query i sees key j only if
    j <= i + n_k - N_Q + WIN_RIGHT; plain causal is WIN_RIGHT = 0); LOCAL, a left edge (j >= i + n_k - N_Q -
    WIN_LEFT), before which no query sees a key, so the chunks cut the keys from there (rounded down to a block)
    on. SOFTCAP: scores c tanh(s / c) with c = `softcap` (`_scores`; 2: the accurate tanh).
    LEFTPAD: sequence b's keys start at cache position LeftPad[b] (clamped into [0, CacheSeqLens[b]]), not 0: K and
    V are read from that row on, and every key index here (chunks, masks, pages) counts from it."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and HEAD_DIM >= 16)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid_s = tl.program_id(0)
    pid_zh = tl.program_id(1)
    pid_m = tl.program_id(2)
    off_z = (pid_zh // H_KV).to(tl.int64)
    off_hk = pid_zh % H_KV
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    g = rows // N_Q
    i = rows - g * N_Q  # query position of each row
    row_ok = rows < GROUP * N_Q
    h = (off_hk * GROUP + g).to(tl.int64)  # query head of each row
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + off_z * stride_qz + h[:, None] * stride_qh + i[:, None].to(tl.int64) * stride_qm
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    # this sequence's valid keys, appended ones included; a length outside [0, N_MAX - N_NEW] (possible only
    # when the host check was skipped) is clamped into it, so that no read leaves the cache
    n_k = tl.minimum(tl.maximum(tl.load(CacheSeqLens + off_z), 0), N_MAX - N_NEW) + N_NEW
    if LEFTPAD:  # a left-padded sequence: its n_k - pad keys are the cache's rows from pad on
        pad = tl.minimum(tl.maximum(tl.load(LeftPad + off_z), 0), n_k - N_NEW)
        n_k -= pad
    if LOCAL:  # keys before the first query's window: seen by no query, not cut into the chunks
        k_lo = tl.maximum(n_k - N_Q - WIN_LEFT, 0) // BLOCK_N * BLOCK_N
    else:
        k_lo = n_k * 0
    chunk = tl.cdiv(tl.cdiv(n_k - k_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = tl.minimum(k_lo + pid_s * chunk, n_k)
    hi = tl.minimum(lo + chunk, n_k)
    if PAGE > 0:  # this head in page 0; the pages and rows are found key by key
        K_head = K + off_hk.to(tl.int64) * stride_kh
        V_head = V + off_hk.to(tl.int64) * stride_vh
        kT_offs = offs_d[:, None] * stride_kd
        v_offs = offs_d[None, :] * stride_vd
    else:
        K_head = K + off_z * stride_kz + off_hk.to(tl.int64) * stride_kh
        V_head = V + off_z * stride_vz + off_hk.to(tl.int64) * stride_vh
        kT_offs = offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn
        v_offs = offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    if LEFTPAD:  # key j is row pad + j (paged: only where a page holds the whole N_MAX, as cache_batch_idx's do)
        K_head += pad.to(tl.int64) * stride_kn
        V_head += pad.to(tl.int64) * stride_vn
    diag_offset = n_k - N_Q  # bottom-right: query i sees key j iff j <= i + n_k - N_Q

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # The forward pass's masked loop over this chunk's key blocks: keys at or past `hi` (the chunk's end)
    # are neither loaded nor seen, and row i's causal limit is i + diag_offset.
    qk_scale, cap = _scales(sm_scale, softcap, SOFTCAP)
    acc, _, l_i, m_i = _attn_fwd_inner(acc, acc, l_i, m_i, q, q, K_head, V_head, kT_offs, v_offs, kT_offs, v_offs,
                                       stride_kn, stride_vn, K_head, lo, hi, qk_scale, cap, i, offs_d,
                                       offs_d, diag_offset + WIN_RIGHT, diag_offset - WIN_LEFT, hi, head_dim,
                                       BLOCK_N, True, CAUSAL, LOCAL, SOFTCAP, False, MASK_D, 0, EMULATE_BF16,
                                       PRECISION, "i64",
                                       Table + off_z * stride_tz, stride_kz, stride_vz, N_PAGES, PAGE)

    empty = l_i == 0.0  # no visible key in this chunk (or for this row at all)
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    i64 = i.to(tl.int64)
    if SPLIT:
        prow = ((pid_s * B + off_z) * H_Q + h) * N_Q + i64
        tl.store(LSE_part + prow, lse, mask=row_ok)
        tl.store(O_part + prow[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])
        if FUSED:
            # Release: every thread's stores above are done (the barrier) before one thread's atomic
            # publishes them at GPU scope; the last arrival acquires them all before reading.
            tl.debug_barrier()
            tile = pid_zh * tl.num_programs(2) + pid_m
            if tl.atomic_add(Arrived + tile, 1, sem="acq_rel") == NUM_SPLITS - 1:
                tl.store(Arrived + tile, 0)  # the count back to 0: the buffer can serve the next call
                _merge_tile(O_part, LSE_part, Out, LSE, stride_oz, stride_oh, stride_om, stride_od,
                            off_z, off_hk, pid_m * BLOCK_M, tl.minimum(BLOCK_M, GROUP * N_Q - pid_m * BLOCK_M),
                            B, H_Q, GROUP, N_Q, head_dim, NUM_SPLITS,
                            HEAD_DIM, EMULATE_BF16, BLOCK_S, ROWS_C)
    else:
        tl.store(LSE + (off_z * H_Q + h) * N_Q + i64, lse, mask=row_ok)
        tl.store(Out + off_z * stride_oz + h[:, None] * stride_oh + i64[:, None] * stride_om
                 + offs_d[None, :] * stride_od, _round(o, Out.type.element_ty, EMULATE_BF16),
                 mask=row_ok[:, None] & (offs_d[None, :] < head_dim))


@triton.jit
def _merge_tile(O_part, LSE_part, Out, LSE, stride_oz, stride_oh, stride_om, stride_od,  #
                off_z, off_hk, row0, n_rows, B, H_Q, GROUP, N_Q, head_dim, NUM_SPLITS,  #
                HEAD_DIM: tl.constexpr, EMULATE_BF16: tl.constexpr, BLOCK_S: tl.constexpr,
                ROWS_C: tl.constexpr):
    """The combine of `_decode_combine` for the `n_rows` packed rows from `row0` of one (b, h_kv) tile,
    ROWS_C rows at a time and all NUM_SPLITS <= BLOCK_S splits of each row in one load: a
    (ROWS_C, BLOCK_S, HEAD_DIM) tile of partial outputs and a (ROWS_C, BLOCK_S) tile of LSE_s, merged
    as LSE = m + log sum_s exp(LSE_s - m), o = sum_s exp(LSE_s - LSE) o_s with m the largest LSE_s (0
    when every split is empty: weights 0, o = 0, LSE = -inf). The partials are read past L1 (`.cg`):
    other SMs wrote them."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < NUM_SPLITS
    for r0 in range(0, n_rows, ROWS_C):
        r = r0 + tl.arange(0, ROWS_C)
        r_ok = r < n_rows
        rows = row0 + r
        g = rows // N_Q
        i = (rows - g * N_Q).to(tl.int64)
        h = (off_hk * GROUP + g).to(tl.int64)
        prow = ((offs_s[None, :] * B + off_z) * H_Q + h[:, None]) * N_Q + i[:, None]  # (ROWS_C, BLOCK_S)
        ok = r_ok[:, None] & s_ok[None, :]
        lse_s = tl.load(LSE_part + prow, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o_s = tl.load(O_part + prow[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=ok[:, :, None],
                      other=0.0, cache_modifier=".cg")
        m = tl.max(lse_s, axis=1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse_s - m_safe[:, None])  # empty split: 0
        l = tl.sum(w, axis=1)
        empty = l == 0.0
        o = tl.sum(w[:, :, None] * o_s, axis=1) / tl.where(empty, 1.0, l)[:, None]
        tl.store(LSE + (off_z * H_Q + h) * N_Q + i, tl.where(empty, float("-inf"),
                 m_safe + tl.log(tl.where(empty, 1.0, l))), mask=r_ok)
        tl.store(Out + off_z * stride_oz + h[:, None] * stride_oh + i[:, None] * stride_om
                 + offs_d[None, :] * stride_od, _round(o, Out.type.element_ty, EMULATE_BF16),
                 mask=r_ok[:, None] & (offs_d[None, :] < head_dim))


@triton.jit(do_not_specialize=["N_Q"])
def _decode_combine(O_part, LSE_part, Out, LSE,  #
                    stride_oz, stride_oh, stride_om, stride_od,  #
                    B, H_Q, N_Q, head_dim, NUM_SPLITS,  #
                    HEAD_DIM: tl.constexpr, EMULATE_BF16: tl.constexpr, BLOCK_S: tl.constexpr):
    """Grid (B * H_Q * N_Q,): one program per query row. Merge the NUM_SPLITS partial (o_s, LSE_s) of
    the row exactly: LSE = log sum_s exp(LSE_s), o = sum_s exp(LSE_s - LSE) o_s (the merge of the
    book's chapter 2, in its normalised form). BLOCK_S splits are loaded at once, their LSE_s and o_s
    together, and merged into the running (m, l, acc) as the forward pass merges key blocks, so a row
    with at most BLOCK_S splits reads its partials in one round trip (a small batch has few rows: a
    row's splits must not be read one after another). A row whose every split is empty keeps o = 0,
    LSE = -inf."""
    row = tl.program_id(0).to(tl.int64)
    n_rows = B * H_Q * N_Q
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    z = row // (H_Q * N_Q)
    h = (row // N_Q) % H_Q
    i = row % N_Q
    m = tl.zeros([1], dtype=tl.float32) - float("inf")
    l = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([1, HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        s_ok = s0 + offs_s < NUM_SPLITS
        prow = (s0 + offs_s) * n_rows + row
        lse_s = tl.load(LSE_part + prow, mask=s_ok, other=float("-inf"))
        o_s = tl.load(O_part + prow[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse_s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split seen a key yet: weights 0, not NaN
        w = tl.exp(lse_s - m_safe)  # empty split: 0
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(w, axis=0)
        acc = acc * alpha[:, None] + tl.sum(w[:, None] * o_s, axis=0)[None, :]
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    empty = l == 0.0
    o = acc / tl.where(empty, 1.0, l)[:, None]
    one = tl.arange(0, 1)
    tl.store(LSE + row + one, tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, l))))
    tl.store(Out + z * stride_oz + h * stride_oh + i * stride_om + offs_d[None, :] * stride_od,
             _round(o, Out.type.element_ty, EMULATE_BF16), mask=offs_d[None, :] < head_dim)


@triton.jit
def _row_block(H, N, BLOCK: tl.constexpr):
    """Grid (cdiv(N, BLOCK), B * H): this program's sequence and head (int64), its BLOCK rows, and which of them lie
    below N."""
    pid_zh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    return (pid_zh // H).to(tl.int64), (pid_zh % H).to(tl.int64), rows, rows < N


@triton.jit
def _rope(X, x_offs, d_stride, offs_d, row_ok, pos, Cos, Sin, head_dim, ROT_HALF,
          INTERLEAVED: tl.constexpr, EMULATE_BF16: tl.constexpr, dtype: tl.constexpr):
    """The rows of X at element offsets `x_offs` (ROWS, 1), columns `offs_d`, with the rotary embedding applied at
    positions `pos` (ROWS,) (an index into Cos and Sin, (n_ro, ROT_HALF) contiguous), rounded to `dtype`: channel c
    is paired with c ^ 1 (INTERLEAVED, GPT-J) or c +- ROT_HALF (GPT-NeoX), the first of a pair becoming
    x1 cos - x2 sin and the second x2 cos + x1 sin, in float32; channels from 2 * ROT_HALF on pass through."""
    rot = offs_d < 2 * ROT_HALF
    if INTERLEAVED:
        partner = offs_d ^ 1
        angle = offs_d // 2
        first = offs_d % 2 == 0
    else:
        partner = tl.where(offs_d < ROT_HALF, offs_d + ROT_HALF, offs_d - ROT_HALF)
        angle = tl.where(offs_d < ROT_HALF, offs_d, offs_d - ROT_HALF)
        first = offs_d < ROT_HALF
    col_ok = offs_d < head_dim
    x = tl.load(X + x_offs + offs_d[None, :] * d_stride, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    p = tl.load(X + x_offs + partner[None, :] * d_stride, mask=row_ok[:, None] & rot[None, :], other=0.0)
    cs_offs = pos[:, None].to(tl.int64) * ROT_HALF + angle[None, :]
    cs_ok = row_ok[:, None] & rot[None, :]
    c = tl.load(Cos + cs_offs, mask=cs_ok, other=1.0).to(tl.float32)
    s = tl.load(Sin + cs_offs, mask=cs_ok, other=0.0).to(tl.float32)
    xf, pf = x.to(tl.float32), p.to(tl.float32)
    out = tl.where(rot[None, :], xf * c + tl.where(first[None, :], -pf, pf) * s, xf)
    return _round(out, dtype, EMULATE_BF16)


@triton.jit(do_not_specialize=["N_NEW"])
def _append_kv(K_new, V_new, K_cache, V_cache, CacheSeqLens, Table, Cos, Sin,  #
               stride_knz, stride_knh, stride_knn, stride_knd,  #
               stride_vnz, stride_vnh, stride_vnn, stride_vnd,  #
               stride_kz, stride_kh, stride_kn, stride_kd,  #
               stride_vz, stride_vh, stride_vn, stride_vd,  #
               stride_tz, N_PAGES, H_KV, N_NEW, N_MAX, head_dim, ROT_HALF, N_RO,  #
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, ROTARY: tl.constexpr,  #
               INTERLEAVED: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Grid (cdiv(N_NEW, BLOCK_N), B * H_KV). The append of `flash_attention_with_kvcache`: new keys and values
    (B, H_KV, N_NEW, head_dim) written into the caches at positions CacheSeqLens[b] + j (clamped into
    [0, N_MAX - N_NEW], as `_decode_split` clamps the length), or with PAGE > 0 into row pos % PAGE of page
    Table[b * stride_tz + pos // PAGE] of the pools (an index clamped into [0, N_PAGES)). ROTARY: the keys are
    rotated first (`_rope`) at positions CacheSeqLens[b] + j clamped into [0, N_RO). One launch, where indexing in
    PyTorch took six."""
    off_z, off_h, rows, row_ok = _row_block(H_KV, N_NEW, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < head_dim
    seqlen = tl.load(CacheSeqLens + off_z)
    pos = (tl.minimum(tl.maximum(seqlen, 0), N_MAX - N_NEW) + rows).to(tl.int64)
    if PAGE > 0:
        page = tl.load(Table + off_z * stride_tz + pos // PAGE, mask=row_ok, other=0)
        page = tl.minimum(tl.maximum(page, 0), N_PAGES - 1).to(tl.int64)
        k_dst = page * stride_kz + off_h * stride_kh + (pos % PAGE) * stride_kn
        v_dst = page * stride_vz + off_h * stride_vh + (pos % PAGE) * stride_vn
    else:
        k_dst = off_z * stride_kz + off_h * stride_kh + pos * stride_kn
        v_dst = off_z * stride_vz + off_h * stride_vh + pos * stride_vn
    k_src = (off_z * stride_knz + off_h * stride_knh + rows.to(tl.int64) * stride_knn)[:, None]
    if ROTARY:
        ro_pos = tl.minimum(tl.maximum(seqlen + rows, 0), N_RO - 1)
        k = _rope(K_new, k_src, stride_knd, offs_d, row_ok, ro_pos, Cos, Sin, head_dim, ROT_HALF, INTERLEAVED,
                  EMULATE_BF16, K_cache.type.element_ty)
    else:
        k = tl.load(K_new + k_src + offs_d[None, :] * stride_knd, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(K_cache + k_dst[:, None] + offs_d[None, :] * stride_kd, k, mask=row_ok[:, None] & d_ok[None, :])
    v = tl.load(V_new + (off_z * stride_vnz + off_h * stride_vnh + rows.to(tl.int64) * stride_vnn)[:, None]
                + offs_d[None, :] * stride_vnd, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(V_cache + v_dst[:, None] + offs_d[None, :] * stride_vd, v, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["N_Q"])
def _rotary_q(Q, Out, CacheSeqLens, Cos, Sin,  #
              stride_qz, stride_qh, stride_qm, stride_qd,  #
              stride_oz, stride_oh, stride_om, stride_od,  #
              H_Q, N_Q, head_dim, ROT_HALF, N_RO,  #
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, PER_QUERY: tl.constexpr, INTERLEAVED: tl.constexpr,
              EMULATE_BF16: tl.constexpr):
    """Grid (cdiv(N_Q, BLOCK_M), B * H_Q). The queries of a decoding step (B, H_Q, N_Q, head_dim) rotated into Out
    (`_rope`): query i of sequence b at position CacheSeqLens[b] + i (PER_QUERY: causal or windowed, each query at
    its own place) or CacheSeqLens[b] (every query of the step at one place), clamped into [0, N_RO)."""
    off_z, off_h, rows, row_ok = _row_block(H_Q, N_Q, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    seqlen = tl.load(CacheSeqLens + off_z)
    ro_pos = tl.minimum(tl.maximum(seqlen + (rows if PER_QUERY else rows * 0), 0), N_RO - 1)
    src = (off_z * stride_qz + off_h * stride_qh + rows.to(tl.int64) * stride_qm)[:, None]
    q = _rope(Q, src, stride_qd, offs_d, row_ok, ro_pos, Cos, Sin, head_dim, ROT_HALF, INTERLEAVED, EMULATE_BF16,
              Out.type.element_ty)
    dst = (off_z * stride_oz + off_h * stride_oh + rows.to(tl.int64) * stride_om)[:, None]
    tl.store(Out + dst + offs_d[None, :] * stride_od, q, mask=row_ok[:, None] & (offs_d[None, :] < head_dim))


if INTERPRET:  # every launch leaves triton.language as it found it (fa_lib._interpreter)
    from ._interpreter import contain_module as _contain_module

    _contain_module(globals())
