"""Which kernels run, with which blocks: the rules, each with the measurement it rests on.

fa_lib decides here, from the problem (shapes, strides, dtypes, 16-byte alignment, masks, options, the device),
which kernels a call launches and how:

* the route of a dense forward (`_hopper_forward`: the sm_90 Gluon kernel; `_prefill_forward`: the decoding path's
  split kernel; else the portable Triton kernel) and of a backward's dK/dV and dQ (`_hopper_backward`,
  `_hopper_dq`, `_one_pass_mode`), by the rules `faster`, `faster_backward`, `faster_one_pass`, `faster_dq`
  measured on the H200, and what each kernel needs of its operands (`fa_lib.kernels_hopper.eligible*`);
* the Gluon forward's tile order (`heads_per_group`);
* the portable kernels' column tiles (`_head_tiles`, `_tile_meta`), addressing (`_addr`), blocks (`_fixed_config`:
  `fa_lib.kernels`' tables) and compile-time arguments (`_meta`, `_band`, `_softcap_mode`);
* decoding's splits of a KV cache and its blocks (`_launch_plan`), and whether the split kernel merges its own
  splits (`_fused_merge`).

Every rule can be overridden for a scope with `fa_lib.kernel_options` (``fa_lib.options``); there are no
module-level switches. The decisions for a golden set of problems on a simulated sm_90 and sm_80 are pinned by
``tests/library/test_decisions.py``. Decoding's split plan is here too (`num_splits_heuristic`, `_launch_plan`,
`_fused_merge`; ``fa_lib.decode`` launches it). The block tables themselves stay beside their kernels
(``fa_lib.kernels``' tables, ``fa_lib.kernels_hopper``'s), and so does what each kernel needs of its operands.
"""
import functools
import math
import numbers

import torch

from . import kernels, reference
from .options import current as _options

try:  # the sm_90 Gluon kernels need Triton's Gluon (Triton 3.6)
    from . import kernels_hopper
except ImportError:  # pragma: no cover
    kernels_hopper = None

# Above this cap the kernels use the accurate tanh near 0 (SOFTCAP = 2): the fast one adds ~1.2e-7 c to
# every capped score, 1.2e-5 at c = 100 (Gemma 2 caps at 50 and 30).
_FAST_TANH_MAX_CAP = 100.0


def _next_pow2(n):
    """The smallest power of two >= n (n >= 1). Plain Python: Triton's `next_power_of_2` and `cdiv` are
    constexpr functions whose calls cost microseconds of host time on every launch."""
    return 1 << (n - 1).bit_length()


def _cdiv(a, b):
    return -(-a // b)


def _one_tile(head_dim):
    """The tiled kernels' column tiles as one padded tile: the head dim rounded up to a power of two, at least the
    smallest GPU dot (HEAD_DIM2 = 0), and whether the tile runs past the head dim (MASK_D)."""
    tile = max(16, _next_pow2(head_dim))
    return dict(HEAD_DIM=tile, HEAD_DIM2=0, MASK_D=head_dim != tile)


def _meta(q, causal, addr="i64"):
    """Compile-time arguments shared by the tiled kernels; `addr`: see `_addr`. The column tiles are one
    padded tile here (HEAD_DIM2 = 0); the launchers that take two update them from `ops._tile_meta`."""
    return dict(
        **_one_tile(q.shape[3]),
        CAUSAL=causal,
        # bf16 tl.dot and bf16 rounding are broken under the interpreter (triton issue 11584);
        # emulate them there with float32 arithmetic (see fa_lib.kernels).
        EMULATE_BF16=kernels.INTERPRET and q.dtype == torch.bfloat16,
        # float32 inputs: exact float32 products ("ieee"), not TF32 -- correctness first; see
        # `flash_attention`'s docstring. 16-bit inputs ignore this setting.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        ADDR=addr,
    )


def _softcap_mode(softcap):
    """The kernels' SOFTCAP: 0 (no cap), 1 (the fast tanh) or 2 (the accurate tanh, for large caps)."""
    return 0 if softcap == 0 else (1 if softcap <= _FAST_TANH_MAX_CAP else 2)


def _band(causal, window):
    """The kernels' view of the mask band: (CAUSAL, LOCAL, WIN_LEFT, WIN_RIGHT). Query i sees key j iff
    j <= i + N_K - N_Q + WIN_RIGHT (when CAUSAL: the band has a right edge; plain causal is WIN_RIGHT = 0)
    and j >= i + N_K - N_Q - WIN_LEFT (when LOCAL: a left edge)."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return right >= 0, left >= 0, max(left, 0), max(right, 0)


# ---------------------------------------------------------------------------------------------------
# The sm_90 Gluon kernels: where they are the faster kernels (measured on the H200).
# ---------------------------------------------------------------------------------------------------
# The order of the tiles: groups of this many (batch, head) pairs, all the query tiles of a group before the
# next group's; None: one group (every head's first tile, then every head's second, ...). Pairs of heads
# keep the K and V that programs running at the same time read few enough to stay in L2: on the H200 the
# forward ran 1.05x as fast as with one group over the 28 bf16 d = 128 points of the extended sweep
# (geometric mean; 1.17-1.26x at 1k and 2k tokens, square, where one group streams 132 heads' K and V at
# once), 1.03x over the 8 routed d = 64 points (
# benchmarks/data/probe-hopper-order-nvidia-h200.json). The order changes no bit of the output.
# `heads_per_group` groups only where one group's K and V would not fit in L2: at 64 sequences of 256
# tokens they do (17 MiB at d = 128), so pairs cannot gain there, and the unmasked small batch was slower
# with them in both runs that timed it (0.87x in the probe; 0.73x FA2's forward in a later sweep, where one
# group had been 1.15x; host-bound, such a point moves between runs).
HEADS_PER_GROUP = 2


def heads_per_group(n_k, head_dim, elt_bytes, sm_count, l2_bytes):
    """The tile order of one launch (ints: keys per sequence, head dim, bytes per element of K and V, the
    device's SM count and L2 bytes): HEADS_PER_GROUP when the K and V of one head per SM overflow L2,
    else None (one group). A HEADS_PER_GROUP that is neither None nor a positive int is a ValueError."""
    if HEADS_PER_GROUP is not None and (isinstance(HEADS_PER_GROUP, bool) or not isinstance(HEADS_PER_GROUP, int)
                                        or HEADS_PER_GROUP < 1):
        raise ValueError(f"dispatch.HEADS_PER_GROUP must be None or a positive int, got {HEADS_PER_GROUP!r}")
    if HEADS_PER_GROUP is None or sm_count * 2 * n_k * head_dim * elt_bytes <= l2_bytes:
        return None
    return HEADS_PER_GROUP


# Where this kernel is the faster forward, measured against the portable kernel at every point of the
# extended sweep (benchmarks/data/probe-hopper-fwd-nvidia-h200.json): at head dim
# 128 everywhere (1.05-1.78x); at head dim 64 only causal with at least 4096 queries and keys
# (1.02-1.17x). Elsewhere at 64 the portable kernel is as fast or faster (0.75-1.08x), and on the
# causal prefill (512 queries, 8192 keys) one sweep run timed this kernel at 0.65x the portable one.
# At head dim 256 (benchmarks/data/probe-hopper-fwd256-nvidia-h200.json):
# 1.21-1.88x the forward it replaces at 55 of the 56 points (the causal prefill's was the split kernel of
# `ops._prefill_forward`, 1.29x), geometric mean 1.43x; the one slower point, the fp16 causal small batch
# (64 x 256 tokens, 0.78x), is host-bound, and its bf16 twin ran 1.32x.
D64_CAUSAL_MIN_TOKENS = 4096


def tile_group(q, n_k):
    """The Gluon forward's and dQ kernel's tile order for q (B, H_q, N_q, D) against n_k keys: `heads_per_group` with
    the device's SM count and L2 size, else one group of every (batch, head) pair."""
    _, sm_count, l2_bytes = kernels_hopper._device(q.device)
    B, H_Q, _, D = q.shape
    return heads_per_group(n_k, D, q.element_size(), sm_count, l2_bytes) or B * H_Q


def faster(head_dim, n_q, n_k, causal):
    """Whether this kernel beats the portable kernel on a problem of this head dim, length and mask."""
    if head_dim in (128, 256):
        return True
    return head_dim == 64 and bool(causal) and min(n_q, n_k) >= D64_CAUSAL_MIN_TOKENS


# Where this kernel's backward was the faster one, timed against the portable dK/dV kernel in the whole
# two-pass backward (the dQ kernel beside it on its side stream; three runs,
# benchmarks/data/probe-hopper-bwd-nvidia-h200.json): at head dim 128 with 4096 tokens and more 1.04-1.19x;
# at 1024 tokens 0.86x (causal square) to 1.18x; on 64 sequences of 256 tokens 0.52-1.02x (short programs:
# the K and V loads and the TMA stores of a tile are not hidden behind four query blocks); on the prefill
# of 512 queries against 8192 keys 0.67-1.28x with the same kernel in three runs (its 128 dQ programs and
# 2048 dK/dV programs share the SMs in an order that seems to decide). At head dim 64 1.04-1.08x causal
# with 4096 tokens and more, 0.97-1.02x unmasked.
BWD_MIN_TOKENS = 2048


# At head dim 256 (`_attn_bwd256_ws`; benchmarks/data/probe-hopper-bwd256-nvidia-h200.json)
# the whole backward took 0.52-0.68x the portable Triton kernels' time at every square, GQA and prefill point of the
# extended sweep, causal or not; on 64 sequences of 256 tokens 1.14x unmasked and 0.90x causal, where three
# sweep calls then timed the whole backward at 0.46-0.71 ms unmasked and 0.38-0.70 ms causal (FA2 0.62-0.74;
# benchmarks/data/extended-hopper-bwd256-nvidia-h200.json, "left_out"): short programs whose order beside the
# dQ kernel's seems to decide, as at d = 128 below. Sequences of at most this many keys stay on the portable
# kernels:
BWD256_SHORT_KEYS = 256


BWD_D64_CAUSAL_MIN_TOKENS = 4096


def faster_backward(head_dim, n_q, n_k, causal):
    """Whether this dK/dV kernel beats the portable one on a problem of this head dim, length and mask."""
    if head_dim == 256:
        return n_k > BWD256_SHORT_KEYS
    if head_dim == 128:
        return min(n_q, n_k) >= BWD_MIN_TOKENS
    return head_dim == 64 and bool(causal) and min(n_q, n_k) >= BWD_D64_CAUSAL_MIN_TOKENS


# The head dims at which a `deterministic=False` backward takes a one pass of these kernels (dQ added atomically by
# the dK/dV kernel, five products instead of seven), where `faster_one_pass` also holds. At d = 256 it is
# `_attn_bwd256_ws` with ATOMIC_DQ, not taken: on the H200 (
# benchmarks/data/probe-hopper-bwd256-nvidia-h200.json) it took 1.01-1.26x the time of the two passes (this kernel's
# dK/dV, the portable dQ kernel beside it) at every point timed. At d = 128 it is FlashAttention-3's split
# (`_attn_bwd_dkdv_ws` with ONE_PASS), taken without a mask from 4096 tokens: on the H200 (
# benchmarks/data/probe-onepass-split-nvidia-h200.json and probe-onepass-split-variants-nvidia-h200.json; bf16, square
# and GQA, 4k and 16k tokens) the whole backward ran 1.05-1.11x as fast as the two passes unmasked, but 0.73-1.01x
# causal (0.92-1.01x with the programs longest first, ONE_PASS_LONGEST_FIRST; three Q/dO slots were slower), the
# shared-tile kernel's one pass 0.47-0.79x (probe-onepass128-nvidia-h200.json) and ONE_PASS_MODE 2 0.63-0.87x
# (probe-onepass-local-nvidia-h200.json).
ONE_PASS_HEAD_DIMS = (128,)


ONE_PASS_MIN_TOKENS = 4096


def faster_one_pass(head_dim, n_q, n_k, causal, force=False):
    """Whether a `deterministic=False` backward takes the one pass: `head_dim`, `n_q` and `n_k` (query and key
    lengths) are non-negative ints, `causal` a bool; a head dim of ONE_PASS_HEAD_DIMS, and unless `force` (kernel
    option ``hopper_one_pass="always"``: every length and mask), no mask and at least ONE_PASS_MIN_TOKENS queries
    and keys. Other arguments are a TypeError or ValueError naming them."""
    for name, value in (("head_dim", head_dim), ("n_q", n_q), ("n_k", n_k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    return head_dim in ONE_PASS_HEAD_DIMS and (force or (not causal and min(n_q, n_k) >= ONE_PASS_MIN_TOKENS))


# Where it is the faster dQ kernel. On the H200 (benchmarks/data/probe-hopper-dq-nvidia-h200.json;
# bf16, d = 128, square and GQA 32/8, causal or not, N = 1k-32k) the whole backward took 1.04-1.11x less time with it
# than with the portable dQ kernel at all 20 points, with 128 keys a step on two slots (64 keys on three: 1.03-1.08x).
# Head dim 64 and shorter sequences were not timed, so they keep the portable kernel.
DQ_HEAD_DIMS = (128,)


DQ_MIN_TOKENS = 1024


def faster_dq(head_dim, n_q, n_k, causal):
    """Whether this dQ kernel beats the portable one on a problem of this head dim, length and mask."""
    return head_dim in DQ_HEAD_DIMS and min(n_q, n_k) >= DQ_MIN_TOKENS


# ---------------------------------------------------------------------------------------------------
# Routes and blocks of a problem.
# ---------------------------------------------------------------------------------------------------
# The forward and backward kernels can cover a head dim that is not a power of two with two column tiles
# instead of one wider tile (HEAD_DIM2, `kernels._attn_fwd`): 96 = 64 + 32 and 80 = 64 + 16 instead of 128,
# 192 = 128 + 64 instead of 256. On the H200 the forward took 1.07-1.51x less time that way at every point
# measured at d = 80, 96, 160 and 192 (benchmarks/data/probe-split-d-nvidia-h200.json), the backward 1.03-1.28x
# less at every point not bound by the host (benchmarks/data/probe-split-d-bwd-*.json). The kernel option
# `split_head_dim` says where (default True: every head dim that two full tiles make exactly; False: never, one
# padded tile; or a set of head dims). The one-pass backward (`deterministic=False`, ATOMIC_DQ) always takes one tile.
def _head_tiles(head_dim):
    """The tiled kernels' column tiles for `head_dim`: (HEAD_DIM, HEAD_DIM2), both powers of two >= 16, with
    HEAD_DIM2 = 0 for one tile. Two tiles where the split is on (option `split_head_dim`) and two full tiles make
    exactly `head_dim`: the first half the one tile's width, the second the rest. A second tile that would
    run past the head dim (40 = 32 + 8 of 16, 72 = 64 + 8 of 16) is not taken: masked, it read out of
    bounds on the H200 (an illegal memory access at d = 40, bf16, causal), for a reason not yet found."""
    one = max(16, _next_pow2(head_dim))
    split = _options().split_head_dim
    on = split if isinstance(split, bool) else head_dim in split
    first = one // 2
    second = max(16, _next_pow2(head_dim - first)) if head_dim > first else 0
    if on and first >= 16 and second and first + second == head_dim < one:
        return first, second
    return one, 0


def _tile_meta(head_dim, split=True):
    """The tiled kernels' column tiles: HEAD_DIM, HEAD_DIM2 (`_head_tiles`; without `split`, one tile: the
    head dim rounded up to a power of two, at least the smallest GPU dot) and MASK_D (the tiles run past the
    head dim)."""
    if not split:
        return _one_tile(head_dim)
    first, second = _head_tiles(head_dim)
    return dict(HEAD_DIM=first, HEAD_DIM2=second, MASK_D=head_dim != first + second)


def _addr(forward_causal, *tensors):
    """How the inner loops sum their tile offsets (see `kernels._tile`): "i32" where every offset within
    one head of `tensors` fits in 31 bits, with room for a block past the end; else "i64". The causal
    forward always takes "i64": measured fastest on the H200 (benchmarks/data/port-addressing-*.json)."""
    if forward_causal:
        return "i64"
    fits = all((t.shape[2] + 256) * t.stride(2) + 256 * t.stride(3) < 2**31 for t in tensors)
    return "i32" if fits else "i64"


def _bucket(n):
    """A sequence length rounded up to a power of two: the autotuner's key (nearby lengths share a run)."""
    return max(16, _next_pow2(n))


def _fixed_config(name, elt_bytes, head_dim, causal, n_q, n_k, grid, shared_memory=None):
    """The deterministic path's (BLOCK_M, BLOCK_N, num_warps, num_stages) of kernel `name`: the table's,
    or its small-grid row where `grid` (META -> the launch grid) would hold less than one wave, fitted to the
    device's `shared_memory` bytes (`kernels.fit`; None: no limit)."""
    config = kernels.default_config(name, elt_bytes, head_dim, causal, n_q, n_k)
    programs = math.prod(grid({"BLOCK_M": config[0], "BLOCK_N": config[1]}))
    config = kernels.small_grid_config(name, elt_bytes, head_dim, config, programs)
    return kernels.fit(name, config, head_dim, elt_bytes, shared_memory)


# A prefill (fewer queries than keys) whose grid would not fill the GPU with 64-row query blocks runs faster on
# the decoding path's split kernel (`decode._attend`, every key valid; its heuristic does not split such grids)
# than on the portable forward, at these head dims and masks. On the H200 (bf16;
# benchmarks/data/probe-split-fwd-nvidia-h200.json: B = 2, H = 8/8 and 8/2 with 512 queries and 8192 keys, B = 1,
# H = 8/8 with 1024 and 16384) it took 0.78-0.86x the portable forward's time at d = 64, causal or not, and
# 0.67-0.73x at d = 256 causal; at d = 256 unmasked 1.02-1.06x, and at d = 128, where the Gluon forward runs,
# 0.75-1.26x. On sm_90 the Gluon forward is asked first (`_forward`) and now takes d = 256 too: at the causal
# prefill it ran 1.29x as fast as this route (benchmarks/data/probe-hopper-fwd256-nvidia-h200.json). The d = 256
# entry stays for devices that kernel cannot run on, where the comparison above, with the Gluon forward off,
# is the one that applies. The kernel option `prefill_split` holds it: {head dim: masks (causal True/False) routed},
# by default {64: (False, True), 256: (True,)}.
PREFILL_BLOCK_M = 64  # the rows of a query block in the grid count below


def _prefill_forward(q, k, o, pb):
    """Whether this forward takes the decoding path's split kernel (option `prefill_split`): a problem of
    `_plain_gpu_problem`, fewer queries than keys, a head dim and mask of `prefill_split`, and at most one program per
    SM with PREFILL_BLOCK_M-row blocks over the packed query rows of each key/value head."""
    if not (_plain_gpu_problem(q, pb, o) and pb.n_q < pb.n_k):
        return False
    if bool(pb.causal) not in _options().prefill_split_masks(q.shape[3]):
        return False
    B, H_Q, N_Q, _ = q.shape
    H_KV = k.shape[1]
    programs = B * H_KV * _cdiv(H_Q // H_KV * N_Q, PREFILL_BLOCK_M)
    return programs <= torch.cuda.get_device_properties(q.device).multi_processor_count


def _plain_gpu_problem(q, pb, out, float32_out=False):
    """Whether a problem is one the fast paths (the sm_90 Gluon kernels, the prefill route) cover: CUDA tensors
    outside the interpreter, plain or causal attention (no window, cap, padding mask or packed batch), and the
    output (`out`: O, or dK) in the input's dtype, or (`float32_out`) in float32: the unrounded partial results of
    the ring of `fa_lib.context_parallel`."""
    if kernels.INTERPRET or not q.is_cuda:
        return False
    out_ok = out.dtype == q.dtype or (float32_out and out.dtype == torch.float32)
    return not (pb.varlen or pb.local or pb.softcap or pb.kpm is not None or pb.win_right) and out_ok


def _hopper_problem(q, pb, out):
    """Whether a problem is one the sm_90 Gluon kernels (`fa_lib.kernels_hopper`) cover: `_plain_gpu_problem` (a
    float32 output too: the kernels' `eligible*` say where they write one), with a Triton that has Gluon's Hopper
    API."""
    return kernels_hopper is not None and _plain_gpu_problem(q, pb, out, float32_out=True)


def _hopper_forward(q, k, v, o, pb):
    """Whether the forward of this problem takes the warp-specialized sm_90 kernel: a problem it covers
    (`_hopper_problem`), where it is the faster forward (`faster`), and what that kernel needs of
    the device, dtype, head dim and strides (`kernels_hopper.eligible`)."""
    if not _hopper_problem(q, pb, o):
        return False
    route = _options().hopper_forward
    if route == "never" or not (route == "always" or faster(q.shape[3], pb.n_q, pb.n_k, pb.causal)):
        return False
    return kernels_hopper.eligible(q, k, v, o)


def _hopper_backward(q, k, v, do, dk, dv, pb, one_pass=False):
    """Whether the dK/dV of this backward take the warp-specialized sm_90 kernel
    (`kernels_hopper.backward_dkdv`): a problem it covers (`_hopper_problem`, gradients in the inputs' dtype),
    where it is the faster kernel (`faster_backward`), and what it needs of every operand
    (`kernels_hopper.eligible_backward`). `one_pass`: with dQ added by the same kernel, where
    `faster_one_pass` holds."""
    if not _hopper_problem(q, pb, dk) or (one_pass and dk.dtype != q.dtype):  # (float32 dK/dV: two passes)
        return False
    opts = _options()
    if one_pass and (opts.hopper_one_pass == "never" or not faster_one_pass(
            q.shape[3], pb.n_q, pb.n_k, pb.causal, force=opts.hopper_one_pass == "always")):
        return False
    route = opts.hopper_backward
    if route == "never" or not (route == "always" or faster_backward(q.shape[3], pb.n_q, pb.n_k,
                                                                                     pb.causal)):
        return False
    return kernels_hopper.eligible_backward(q, k, v, do, dk, dv)


def _hopper_dq(q, k, v, do, dq, pb):
    """Whether the dQ of this backward takes the warp-specialized sm_90 kernel (`kernels_hopper.backward_dq`): a
    problem it covers (`_hopper_problem`, dQ in the inputs' dtype), where it is the faster kernel
    (`faster_dq`), and what it needs of every operand (`kernels_hopper.eligible_dq`)."""
    if not _hopper_problem(q, pb, dq):
        return False
    route = _options().hopper_dq
    if route == "never" or not (route == "always" or faster_dq(q.shape[3], pb.n_q, pb.n_k, pb.causal)):
        return False
    return kernels_hopper.eligible_dq(q, k, v, do, dq)


# How `deterministic=False` accumulates dQ. "auto": one pass with TMA reduce-adds where it measured
# faster on the H200 (bf16, B*N = 16k tokens; benchmarks/data/onepass-nvidia-h200.json, from
# `python -m benchmarks.bench --onepass`, two passes on two streams): causal N = 16k, H = 16, D = 128
# took 6.74 ms against 7.00 ms for the deterministic two passes; but unmasked N = 16k (13.61 against
# 13.49), a 1023-key window at 16k (1.18 against 1.09), causal N = 4k (2.05 against 1.84), D = 64 (4.91
# against 4.40 autotuned) and GQA 32/8 (8.07 against 7.30) were slower. So: causal multi-head attention
# without a window, a 128-wide head tile, and N >= 8192.
# The kernel option `one_pass_backward`: "auto" (this rule), 0 = always two passes, 1 = tl.atomic_add from the dK/dV
# kernel, 2 = always TMA reduce-adds.
# This rule was measured on the portable kernels, before the Gluon backward existed; `faster_one_pass` (unmasked,
# N >= 4096) against the Gluon two passes. Where both could apply, the data decide: on the H200 the causal d = 128
# points with N >= 8192, where this rule took the portable one pass, ran their backward in 1.11-1.23x the time of the
# Gluon two passes (bf16 and fp16, N = 8k, 16k, 32k; benchmarks/data/extended-hopper-onepass-nvidia-h200.json,
# fa_lib_nd against fa_lib). So with "auto", wherever the Gluon dK/dV kernel runs the two passes
# (`_hopper_backward`), the backward keeps them unless the Gluon one pass is faster; this rule applies elsewhere.
def _one_pass_mode(q, k, head_dim_tile, n_max, *, causal, local):
    """ATOMIC_DQ for the dK/dV kernel of a `deterministic=False` backward that needs every gradient.
    `causal`, `local`: the mask band's edges (`_band`)."""
    mode = _options().one_pass_backward
    if mode == "auto":
        mode = 2 if (q.shape[1] == k.shape[1] and head_dim_tile == 128 and n_max >= 8192 and causal
                     and not local) else 0
    if mode == 2 and (q.device.type != "cuda" or q.shape[3] % 4):
        mode = 1  # the interpreter has no descriptor reduce; TMA rows must be 16-byte multiples
    return mode


# ---------------------------------------------------------------------------------------------------
# Decoding: how a KV cache is split across the GPU (fa_lib.decode launches the plan).
# ---------------------------------------------------------------------------------------------------
_MAX_SPLITS = 128


_INTERPRETER_SMS = 8  # what the heuristic assumes under the CPU interpreter (no SM count to read)


_FUSE_ELEMENTS = 8192  # the fused merge's (rows, splits, head_dim) tile: at most this many float32 entries


_FUSE_ROW_CHUNKS = 1  # ... and at most this many such tiles, one after another, per query tile


def _config(head_dim_tile, rows, *, waves=0.0, n_keys=0, interpret=None, elt_bytes=2, shared_memory=None):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the split kernel for `rows` = GROUP * N_Q packed rows,
    `waves` = the unsplit grid's programs per SM and `n_keys` = N_max; `interpret` as in
    `kernels.default_config` (None: this process's mode; False: the GPU's blocks); the blocks fitted to
    `shared_memory` bytes for a cache of `elt_bytes` (`kernels.fit`, BLOCK_M kept; None: no limit)."""
    config = _split_config(head_dim_tile, rows, waves, n_keys, interpret)
    return kernels.fit("decode", config, head_dim_tile, elt_bytes, shared_memory, keep_rows=True)


def _split_config(head_dim_tile, rows, waves, n_keys, interpret):
    block_m = min(64, max(16, _next_pow2(rows)))
    if kernels.INTERPRET if interpret is None else interpret:
        return block_m, 16, 4, 1  # small key blocks: the tests cross many block and split boundaries
    if block_m < 64 and head_dim_tile <= 128 and 1.0 <= waves and (waves < 3.0 or (waves < 8.0 and n_keys <= 1024)):
        # A grid of one to a few programs per SM is not split, and its last wave leaves SMs idle: small key
        # blocks (64 KiB of shared memory in four stages) fit three programs on an SM and even the waves
        # out. On the H200 (bf16, D = 128, N_q = 1, `bench --decode`): B = 8, H = 32/32 (1.9 programs per
        # SM) took 2.4% less time at 1k keys and 0 to 1.2% less from 4k to 128k with (32 keys, 4 warps, 4
        # stages) than with (128, 4, 3); B = 64, H = 32/8 (3.9 per SM) 10% less at 1k keys but 1 to 2% more
        # from 4k on, and B = 64, H = 32/32 (15.5 per SM) 1 to 2% more at every length.
        return block_m, 32, 4, 4
    # 64 keys per block once the query tile is 64 rows (a GQA draft of 16 queries): on the H200, B = 64,
    # H = 32/8, N_q = 16, N_k = 16k ran in 0.98 ms with 64-key blocks and 1.18 ms with 128.
    block_n = 128 if head_dim_tile <= 128 and block_m < 64 else 64
    return block_m, block_n, 4, 3


_FIXED_BLOCKS = 2  # a program's fixed cost (start, partial store, merge) in key blocks' streaming time


def wave_time(programs, n_blocks, num_splits, sm_count):
    """(time, chunks) of one split launch by the wave model of `num_splits_heuristic`: ``n_blocks`` key blocks
    cut into ``num_splits`` chunks of whole blocks leave ``chunks = ceil(n_blocks / ceil(n_blocks / num_splits))``
    that hold keys; the launch runs ``ceil(programs * chunks / sm_count)`` whole waves of one program per SM,
    each as long as a program: its chunk's key blocks plus ``_FIXED_BLOCKS``. The time is in key blocks'
    streaming time (an int). All four arguments are positive ints."""
    programs, n_blocks, num_splits, sm_count = (
        reference._check_count(name, value, 1) for name, value in (
            ("programs", programs), ("n_blocks", n_blocks), ("num_splits", num_splits), ("sm_count", sm_count)))
    per = math.ceil(n_blocks / num_splits)  # key blocks of a chunk
    chunks = math.ceil(n_blocks / per)  # the chunks that hold keys
    return math.ceil(programs * chunks / sm_count) * (per + _FIXED_BLOCKS), chunks


def num_splits_heuristic(programs, n_blocks, sm_count):
    """How many chunks to cut each sequence's keys into.

    ``programs``: the split kernel's programs without splitting (batch x KV heads x query tiles);
    ``n_blocks``: key blocks of the longest possible sequence; ``sm_count``: the GPU's multiprocessors.
    With enough programs to fill the machine, one split. Otherwise the split count whose launch takes
    the least time by the wave model of `wave_time` (whole waves of one program per SM, each as long as
    a chunk's key blocks plus a fixed cost worth ``_FIXED_BLOCKS`` blocks); the fewest chunks among equal
    times, at most 128 splits and at most one per key block. Chunks are whole blocks, so a split count is
    judged by the chunks that are not empty, and that is what is returned: 7 splits of 8 blocks are 4
    chunks of 2 blocks.
    """
    programs = reference._check_count("programs", programs, 0)
    n_blocks = reference._check_count("n_blocks", n_blocks, 0)
    sm_count = reference._check_count("sm_count", sm_count, 1)
    if programs >= 0.8 * sm_count or n_blocks < 1:
        return 1
    # the chunk counts grow with the splits asked for, so the first least time has the fewest chunks
    return min((wave_time(programs, n_blocks, s, sm_count) for s in range(1, min(_MAX_SPLITS, n_blocks) + 1)),
               key=lambda t: t[0])[1]


# The plan is a pure function of a few integers, and `num_splits_heuristic` searches the split counts in
# Python: cached, so a decoding loop pays for it once per shape. On the H200 (
# benchmarks/data/probe-host-decode-nvidia-h200.json) a decoding call's host time without the length check went
# from 0.17-0.31 to 0.15-0.17 ms; the rest is mostly Triton's two launches and the checks.
@functools.lru_cache(maxsize=4096)
def _launch_plan(batch, h_kv, rows, n_max, head_dim_tile, sm_count, num_splits=None, *, interpret=None,
                 elt_bytes=2, shared_memory=None):
    """(num_splits, (BLOCK_M, BLOCK_N, num_warps, num_stages)) of the split kernel, as
    ``flash_attention_with_kvcache`` launches it: ``rows`` = GROUP * N_Q packed query rows per cache head,
    ``num_splits`` None for ``num_splits_heuristic``'s choice (judged with the blocks of a split grid);
    ``interpret``, ``elt_bytes`` and ``shared_memory`` as in ``_config``."""
    fitted = dict(interpret=interpret, elt_bytes=elt_bytes, shared_memory=shared_memory)
    block_m, block_n = _config(head_dim_tile, rows, **fitted)[:2]  # the blocks of a split grid
    programs = batch * h_kv * _cdiv(rows, block_m)
    if num_splits is None:
        num_splits = num_splits_heuristic(programs, _cdiv(n_max, block_n), sm_count)
    waves = 0.0 if num_splits > 1 else programs / sm_count
    return num_splits, _config(head_dim_tile, rows, waves=waves, n_keys=n_max, **fitted)


def _fused_merge(num_splits, rows, block_m, head_dim_tile):
    """(BLOCK_S, ROWS_C) of the split kernel's own merge (`kernels._merge_tile`), or None for the
    separate combine kernel: the merge is fused when a query tile's ``min(rows, block_m)`` rows, ROWS_C at
    a time, take at most ``_FUSE_ROW_CHUNKS`` loads of all ``num_splits`` splits (``BLOCK_S``, a power of
    two) in a tile of at most ``_FUSE_ELEMENTS`` float32 entries. Then a step is one launch."""
    block_s = _next_pow2(num_splits)
    rows_c = min(_next_pow2(min(rows, block_m)), _FUSE_ELEMENTS // (block_s * head_dim_tile))
    if num_splits < 2 or rows_c < 1 or _cdiv(min(rows, block_m), rows_c) > _FUSE_ROW_CHUNKS:
        return None
    return block_s, rows_c


@functools.lru_cache(maxsize=None)
def _major(index):
    return torch.cuda.get_device_capability(index)[0]


def _pdl(q, workspace=False):
    """The split kernel's PDL constexpr and launch option: on where option `decode_pdl` is set, or a workspace is given
    (`workspace`), and the GPU has it (compute capability 9+)."""
    if not (_options().decode_pdl or workspace) or kernels.INTERPRET or _major(q.device.index if q.device.index is not None else
                                                              torch.cuda.current_device()) < 9:
        return {}
    return dict(PDL=True, launch_pdl=True)
