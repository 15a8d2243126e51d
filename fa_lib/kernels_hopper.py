"""The fast forward and dK/dV on Hopper (sm_90): warp-specialized Gluon kernels, with the contracts of
``kernels._attn_fwd`` and of the two-pass backward's ``kernels._attn_bwd_dkdv`` (the dK/dV kernels are described
where they are defined, below the forward's: ``_attn_bwd_dkdv_ws`` at head dims 64 and 128, ``_attn_bwd256_ws``
at 256, where two warpgroups share one tile of keys).

The portable Triton kernel (``kernels._attn_fwd``) is one tile loop that every warp runs: load K, S = QK^T,
softmax, load V, O += PV, in program order, and Triton's pipeliner overlaps what it can. On an H200 that
keeps the tensor cores about half busy at head dim 128 (chapter 11's profile): each warpgroup waits for
its own softmax between two matrix products. This kernel gives the three jobs to different warps, the
schedule FlashAttention-3 describes for Hopper:

* a **load warp** issues TMA copies of the K and V blocks into a ring of ``STAGES`` shared-memory slots
  and never computes; an mbarrier per slot says "full" (the copy's bytes arrived) and another "empty"
  (both consumers are done with it);
* two **consumer warpgroups** each own 64 of the tile's 128 query rows. Each runs the online softmax of
  chapter 3, but software-pipelined across key blocks: it issues S_j = Q K_j^T and O += P_{j-1} V_{j-1}
  as asynchronous warpgroup MMAs, and computes the softmax of S_j while the second product is still
  on the tensor cores. The two warpgroups drift against each other, so one's softmax also overlaps the
  other's products.

Every score, mask and rescaling is the portable kernel's (base-2 scores, deferred normalisation, the
``-inf``-safe update for rows that have seen no key, bottom-right causal alignment); only the order in
which the hardware is asked to do them changes. At head dim 256 the same schedule runs with blocks of 64
keys instead of 128: a consumer's O (64 x 256 float32) then takes 128 registers per thread, and the scores'
tile 32 more. What it covers: 16-bit inputs, head dim 64, 128 or 256, no mask but causal, any lengths,
GQA, any (B, H, N, D) strides with a contiguous last dimension (TMA descriptors over the 4-D tensors, so a
block never reads or writes past its own head). ``ops`` sends
the other cases to the portable kernel, and the interpreter never sees this one.
"""
import triton

# Gluon is experimental and its API moves between releases: these kernels are written for Triton 3.6's (3.9's
# shared-memory descriptors have no `_reinterpret`, and `make test-compat` compiles nothing here). Another Triton
# gets the portable kernels: fa_lib.ops and fa_lib.dispatch treat this ImportError as "no Gluon".
if tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:2]) != (3, 6):
    raise ImportError(f"fa_lib's sm_90 Gluon kernels need Triton 3.6's Gluon API; this is Triton {triton.__version__}")

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from triton._C.libtriton import ir as _ir
from triton.experimental.gluon.language._core import builtin as _builtin

from . import launch

LN2 = gl.constexpr(0.6931471805599453)
LOG2E = gl.constexpr(1.4426950408889634)


@_builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add the tile `src` (shared memory, the descriptor's block and layout) into global memory at `coord` with one
    TMA reduce-add (``cp.reduce.async.bulk.tensor ... .add``; rows past the tensor's end are clipped), completed
    like a TMA store (`tma.store_wait`). The operation Triton's ``tl`` descriptors expose as ``atomic_add``, which
    Gluon's Hopper TMA module of Triton 3.6 does not wrap."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.constexpr_function
def _wgmma_layout(n):
    """The register layout of a warpgroup's wgmma accumulator with n columns: 16 x n x 16 instructions on 4 warps."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _store_rows(Ptr, base, rows, n_rows, stride_row, x, layout: gl.constexpr, COLS: gl.constexpr):
    """Store x (len(rows) x COLS float32 in `layout`, `rows` in its SliceLayout(1, ...)) unrounded from registers at
    Ptr + base + row * stride_row + column (a unit column stride), the rows >= n_rows left out: the float32 partial
    results the ring of `fa_lib.context_parallel` merges (a TMA store would need twice the 16-bit tile's buffer)."""
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    ptrs = Ptr + base + gl.expand_dims(rows.to(gl.int64) * stride_row, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, x, mask=gl.expand_dims(rows < n_rows, 1))


@gluon.jit
def _softmax_block(s, m_i, l_i, qk_scale, col0, rows, N_K, offset,
                   MASK: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """One key block of the online softmax: (p, m, l, alpha) from the raw scores `s` of keys col0.."""
    if MASK:
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = gl.expand_dims(cols < N_K, 0)
        if CAUSAL:
            visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + offset, 1))
        s = gl.where(visible, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # A row that has seen no key keeps m = -inf: subtract 0 instead, so exp2 gives 0, not NaN.
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - gl.expand_dims(m_safe, 1))
        alpha = gl.exp2(m_i - m_safe)
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, j, n_full, rows, N_K, offset,
             CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """The masked update for the blocks from `n_full` on (the diagonal band, the partial last block)."""
    if j >= n_full:
        p, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, qk_scale, j * BLOCK_N, rows, N_K, offset,
                                            True, CAUSAL, BLOCK_N, s_layout)
    else:
        p, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, qk_scale, j * BLOCK_N, rows, N_K, offset,
                                            False, CAUSAL, BLOCK_N, s_layout)
    return p, m_i, l_i, alpha


@gluon.jit
def _key_blocks(q, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, m_i, l_i, acc, base, n_blocks, n_full, rows,
                N_K, offset, qk_scale, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                STAGES: gl.constexpr):
    """One consumer warpgroup's online softmax over `n_blocks` key blocks, the j-th in ring slot base + j % STAGES
    (K_j and V_j of (BLOCK_N, HEAD_DIM) each, announced by k_ready / v_ready, released on k_empty / v_empty): q is
    the (rows, HEAD_DIM) query tile in shared memory, (m_i, l_i, acc) the running state, in the layouts
    `_consumer` gives them (acc float32, (rows, HEAD_DIM)); blocks from `n_full` on are masked (keys before N_K and,
    CAUSAL, at most row + offset). Software-pipelined: S_j = Q K_j^T and O += P_{j-1} V_{j-1} are in flight at once,
    and the softmax of S_j runs while the second product is still on the tensor cores. Returns (m_i, l_i, acc)."""
    dtype: gl.constexpr = k_bufs.dtype
    BLOCK_M: gl.constexpr = acc.shape[0]
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    tile2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    if n_blocks > 0:
        # Block 0: S_0, its softmax; its product with V waits for the next iteration.
        mbarrier.wait(k_ready.index(base), 0)
        k = k_bufs.index(base)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], tile2d)
        s_tok = warpgroup_mma(q, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s_tok])
        mbarrier.arrive(k_empty.index(base), count=1)
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, 0, n_full, rows, N_K, offset, CAUSAL, BLOCK_N,
                                      s_layout)
        for j in range(1, n_blocks):
            slot = base + j % STAGES
            prev = base + (j - 1) % STAGES
            # S_j = Q K_j^T and O += P_{j-1} V_{j-1}, both in flight at once.
            mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
            k = k_bufs.index(slot)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], tile2d)
            s_tok = warpgroup_mma(q, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
            v = v_bufs.index(prev)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], tile2d)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc_tok = warpgroup_mma(p_op, v, acc, is_async=True)
            # The older group (S_j) is done when at most one is outstanding: its softmax runs while
            # the tensor cores still work on P_{j-1} V_{j-1}.
            s = warpgroup_mma_wait(1, deps=[s_tok])
            mbarrier.arrive(k_empty.index(slot), count=1)
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, j, n_full, rows, N_K, offset, CAUSAL,
                                          BLOCK_N, s_layout)
            acc = warpgroup_mma_wait(0, deps=[acc_tok])
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        last = base + (n_blocks - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
        v = v_bufs.index(last)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], tile2d)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc_tok = warpgroup_mma(p_op, v, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc_tok])
        mbarrier.arrive(v_empty.index(last), count=1)
    return m_i, l_i, acc


@gluon.jit
def _consumer(q_bufs, q_bars, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, o_desc, LSE,
              off_b, off_h, start_m, N_Q, N_K, qk_scale, n_full, n_blocks, stride_lb, stride_lh,
              O, stride_ob, stride_oh, stride_om,
              HALF: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, O_F32: gl.constexpr):
    """One warpgroup: rows [start_m * BLOCK_M + HALF * BLOCK_M / 2, + BLOCK_M / 2) of one head. O_F32: O is
    written unrounded to the float32 tensor at O (strides stride_ob, stride_oh, stride_om, 1), not through o_desc."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, HEAD_DIM], dtype)

    row0 = start_m * BLOCK_M + HALF * HALF_M
    rows = row0 + gl.arange(0, HALF_M, layout=row_s)
    offset = N_K - N_Q
    q_smem = q_bufs.index(HALF)
    q = q_smem._reinterpret(dtype, [HALF_M, HEAD_DIM], q2d)
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, row_s)
    l_i = gl.full([HALF_M], 0.0, gl.float32, row_s)
    acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)
    mbarrier.wait(q_bars.index(HALF), 0)
    m_i, l_i, acc = _key_blocks(q, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, m_i, l_i, acc, 0, n_blocks,
                                n_full, rows, N_K, offset, qk_scale, CAUSAL, BLOCK_N, HEAD_DIM, STAGES)

    # Epilogue: deferred normalisation; l == 0 iff the row saw no key (output 0, LSE -inf).
    empty = l_i == 0.0
    lse = (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * LN2
    gl.store(LSE + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + rows, lse, mask=rows < N_Q)
    inv = gl.convert_layout(1.0 / gl.where(empty, 1.0, l_i), row_o)
    if O_F32:
        _store_rows(O, off_b.to(gl.int64) * stride_ob + off_h.to(gl.int64) * stride_oh,
                    row0 + gl.arange(0, HALF_M, layout=row_o), N_Q, stride_om, acc * gl.expand_dims(inv, 1),
                    o_layout, HEAD_DIM)
    else:
        o = (acc * gl.expand_dims(inv, 1)).to(dtype)
        # Q's buffer is free once the last S product has finished: O goes out through it, by TMA (which
        # clips the rows past N_Q).
        q.store(o)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [off_b, off_h, row0, 0], q_smem)
        tma.store_wait(0)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_bufs, q_bars, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
            off_b, off_h, off_hkv, start_m, n_blocks,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the two Q halves once, then K_j and V_j into slot j % STAGES as soon as it is empty."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    for half in gl.static_range(2):
        mbarrier.expect(q_bars.index(half), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [off_b, off_h, start_m * BLOCK_M + half * HALF_M, 0],
                                        q_bars.index(half), q_bufs.index(half))
    for j in range(n_blocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        # A fresh mbarrier counts as having completed the phase before phase 0: the first pass waits on
        # phase 1 and goes straight through.
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [off_b, off_hkv, j * BLOCK_N, 0], k_ready.index(slot),
                                        k_bufs.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [off_b, off_hkv, j * BLOCK_N, 0], v_ready.index(slot),
                                        v_bufs.index(slot))


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr):
    """The mbarriers of a ring of STAGES slots holding two tiles each (K and V in the forward, Q and dO in the
    dK/dV kernels): (ready_a, ready_b, empty_a, empty_b), each [STAGES, 1], allocated in this order and
    initialised by `_init_ring`."""
    ready_a = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_a = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    return ready_a, ready_b, empty_a, empty_b


@gluon.jit
def _init_ring(ready_a, ready_b, empty_a, empty_b, STAGES: gl.constexpr):
    """A slot is ready when the load warp's copy has landed (one arrival, with its byte count) and empty when
    both consumer warpgroups are done with it (two arrivals)."""
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_a.index(i), count=1)
        mbarrier.init(ready_b.index(i), count=1)
        mbarrier.init(empty_a.index(i), count=2)
        mbarrier.init(empty_b.index(i), count=2)


@gluon.jit
def _query_tile(N_Q, N_K, H_Q, GROUP, HEADS_PER_GROUP, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr):
    """This program's query tile in a grid of B * H_Q * cdiv(N_Q, BLOCK_M) programs (the forward's and the dQ
    kernel's order, described at `_attn_fwd_ws`) and the key blocks it sees: (batch, query head, key/value head,
    tile, key blocks before the first masked one, key blocks in all)."""
    num_m = gl.cdiv(N_Q, BLOCK_M)
    pid = gl.program_id(0)
    per_group = HEADS_PER_GROUP * num_m
    first_bh = (pid // per_group) * HEADS_PER_GROUP
    in_group = gl.minimum(HEADS_PER_GROUP, gl.num_programs(0) // num_m - first_bh)
    r = pid % per_group
    start_m = r // in_group
    bh = first_bh + r % in_group
    off_b = bh // H_Q
    off_h = bh % H_Q
    if CAUSAL:
        start_m = num_m - 1 - start_m
    off_hkv = off_h // GROUP
    offset = N_K - N_Q
    if CAUSAL:
        hi = gl.minimum(N_K, (start_m + 1) * BLOCK_M + offset)  # keys visible to the tile's last row
        lo_row = gl.minimum(N_K, start_m * BLOCK_M + offset + 1)  # ... and to its first row
        n_blocks = gl.cdiv(gl.maximum(hi, 0), BLOCK_N)
        n_full = gl.maximum(lo_row, 0) // BLOCK_N
    else:
        n_blocks = gl.cdiv(N_K, BLOCK_N)
        n_full = N_K // BLOCK_N
    return off_b, off_h, off_hkv, start_m, n_full, n_blocks


@gluon.jit
def _attn_fwd_ws(q_desc, k_desc, v_desc, o_desc, LSE, sm_scale, N_Q, N_K, H_Q, GROUP, HEADS_PER_GROUP,
                 stride_lb, stride_lh, O, stride_ob, stride_oh, stride_om,
                 CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                 STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, O_F32: gl.constexpr = False):
    """Grid (B * H_Q * cdiv(N_Q, BLOCK_M),). Writes O through `o_desc` and LSE (B, H_Q, N_Q), natural log. O_F32:
    O goes to the float32 tensor O instead (strides stride_ob, stride_oh, stride_om, 1), unrounded; `o_desc` is
    then not written (Q's descriptor will do).

    Program ids run over groups of HEADS_PER_GROUP (batch, head) pairs; within a group, over the query
    tiles, the group's heads fastest. Programs that run at the same time then share the K and V of few
    heads, which stay in L2 (one head per program would stream every head's K and V from device
    memory at once). Causal: within a group the tiles with the most key blocks (the last rows) come
    first, so the long programs start first and the short ones fill the gaps."""
    off_b, off_h, off_hkv, start_m, n_full, n_blocks = _query_tile(N_Q, N_K, H_Q, GROUP, HEADS_PER_GROUP, CAUSAL,
                                                                  BLOCK_M, BLOCK_N)
    qk_scale = sm_scale * 1.4426950408889634

    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready, v_ready, k_empty, v_empty = _ring_barriers(STAGES)
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    _init_ring(k_ready, v_ready, k_empty, v_empty, STAGES)

    FIRST: gl.constexpr = 0
    SECOND: gl.constexpr = 1
    gl.warp_specialize([
        (_consumer, (q_bufs, q_bars, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, o_desc, LSE,
                     off_b, off_h, start_m, N_Q, N_K, qk_scale, n_full, n_blocks, stride_lb, stride_lh,
                     O, stride_ob, stride_oh, stride_om, FIRST, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, O_F32)),
        (_consumer, (q_bufs, q_bars, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, o_desc, LSE,
                     off_b, off_h, start_m, N_Q, N_K, qk_scale, n_full, n_blocks, stride_lb, stride_lh,
                     O, stride_ob, stride_oh, stride_om, SECOND, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, O_F32)),
        (_loader, (q_desc, k_desc, v_desc, q_bufs, q_bars, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                   off_b, off_h, off_hkv, start_m, n_blocks, BLOCK_M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


# ---------------------------------------------------------------------------------------------------
# The backward's dK and dV: one program per tile of 128 keys, looping over the query blocks of every query
# head that shares its K and V head. The same three jobs as the forward: a load warp streams Q_i and dO_i
# into a ring of STAGES slots; two consumer warpgroups each own 64 of the tile's keys, whose K and V rows
# stay in shared memory (every product reads them from there: none is held in registers, which is what
# made the portable kernel spill). Per query block, with the tile kept transposed as in the portable
# kernel: S^T = K Q^T and dP^T = V dO^T in flight together; P^T = exp2(S^T log2e scale - LSE log2e) while
# dP^T is still on the tensor cores; dV += P^T dO issued before dS^T = P^T (dP^T - D) is formed; dK += dS^T Q.
# ---------------------------------------------------------------------------------------------------
@gluon.jit
def _bwd_consumer(k_bufs, v_bufs, kv_bar, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty,
                  dk_desc, dv_desc, LSE, Delta, off_b, off_hkv, start_n, m_start, n_m, n_iter, GROUP,
                  N_Q, N_K, sm_scale, stride_lb, stride_lh, ds_bufs, pair_bars, dq_bufs, dq_desc,
                  DK, DV, stride_dkb, stride_dkh, stride_dkm, stride_dvb, stride_dvh, stride_dvm,
                  HALF: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, ONE_PASS: gl.constexpr, GRAD_F32: gl.constexpr):
    """One warpgroup: dK and dV of keys [start_n * BLOCK_N + HALF * BLOCK_N / 2, + BLOCK_N / 2) of one key/value
    head, over the n_iter = GROUP * n_m query blocks that see them. Each step waits for its last product
    before the next begins: a product left in flight across the loop's back edge makes ptxas serialize
    every warpgroup MMA of the kernel (its warning C7514), so the overlap comes from the two warpgroups
    drifting against each other, and within a step from the order: S^T and dP^T issued together, P^T
    formed while dP^T runs, dV issued before dS^T is formed.

    ONE_PASS 1 (FlashAttention-3's split of the one-pass backward): dQ too, in the same pass. Each warpgroup
    writes its dS^T (its 64 keys x the step's queries) to shared memory; once both halves are there (an
    mbarrier per buffer, two buffers), it computes the columns [HALF * d/2, + d/2) of the step's
    dQ = dS K over all the tile's keys and adds them to dq_desc's float32 tensor with one TMA reduce-add.
    ONE_PASS 2 (measured slower, kept for the probe): no hand-over; each warpgroup adds its own keys' share of
    all of dQ's columns, two TMA reduce-adds a step.
    GRAD_F32: dK and dV go unrounded to the float32 tensors DK and DV (their strides given, a unit last one) instead
    of through dk_desc and dv_desc."""
    HALF_N: gl.constexpr = BLOCK_N // 2
    HALF_D: gl.constexpr = HEAD_DIM // 2
    dtype: gl.constexpr = k_bufs.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    kv2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_N, HEAD_DIM], dtype)
    q2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    dq_layout: gl.constexpr = _wgmma_layout(HALF_D)
    dq2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF_D], gl.float32)

    row0 = start_n * BLOCK_N + HALF * HALF_N
    keys = row0 + gl.arange(0, HALF_N, layout=row_s)
    offset = N_K - N_Q
    qk_scale = sm_scale * LOG2E
    k_smem = k_bufs.index(HALF)
    v_smem = v_bufs.index(HALF)
    k = k_smem._reinterpret(dtype, [HALF_N, HEAD_DIM], kv2d)
    v = v_smem._reinterpret(dtype, [HALF_N, HEAD_DIM], kv2d)
    dk = gl.zeros([HALF_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([HALF_N, HEAD_DIM], gl.float32, acc_layout)
    # The first query block whose every row sees every key of this tile: from there on, no mask.
    first_full = start_n * BLOCK_N + BLOCK_N - 1 - offset
    mbarrier.wait(kv_bar, 0)
    for t in range(n_iter):
        slot = t % STAGES
        phase = (t // STAGES) & 1
        head = off_hkv * GROUP + t // n_m
        m0 = (m_start + t % n_m) * BLOCK_M
        cols = m0 + gl.arange(0, BLOCK_M, layout=col_s)
        row_base = off_b.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh
        in_q = cols < N_Q
        lse = gl.load(LSE + row_base + cols, mask=in_q, other=0.0)
        delta = gl.load(Delta + row_base + cols, mask=in_q, other=0.0)
        # Base-2 LSE; a row that saw no key (LSE = -inf) gets +inf, so its P is exp2(-inf) = 0.
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        mbarrier.wait(q_ready.index(slot), phase)
        q = q_bufs.index(slot)._reinterpret(dtype, [BLOCK_M, HEAD_DIM], q2d)
        # (Each product gets a zero accumulator of its own: one shared by both makes ptxas serialize them.)
        st_tok = warpgroup_mma(k, q.permute((1, 0)), gl.zeros([HALF_N, BLOCK_M], gl.float32, s_layout),
                               use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(slot), phase)
        do = do_bufs.index(slot)._reinterpret(dtype, [BLOCK_M, HEAD_DIM], q2d)
        dpt_tok = warpgroup_mma(v, do.permute((1, 0)), gl.zeros([HALF_N, BLOCK_M], gl.float32, s_layout),
                                use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=[st_tok])
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
        if CAUSAL:
            if m0 < first_full:
                visible = gl.expand_dims(keys, 1) <= gl.expand_dims(cols + offset, 0)
                pt = gl.where(visible, pt, 0.0)
        pt16 = gl.convert_layout(pt.to(dtype), op_layout)
        dv_tok = warpgroup_mma(pt16, do, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=[dpt_tok])
        dst = pt * (dpt - gl.expand_dims(delta, 0))
        ds16 = gl.convert_layout(dst.to(dtype), op_layout)
        dk_tok = warpgroup_mma(ds16, q, dk, is_async=True)
        if ONE_PASS == 2:
            # This warpgroup's share of dQ, over its own 64 keys only (the other's share is added by it): all
            # of dQ's columns, in two halves, with dS from this warpgroup's own shared-memory slot.
            ds_me = ds_bufs.index(HALF)
            ds_me.store(dst.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            dq_lo_tok = warpgroup_mma(ds_me.permute((1, 0)), k.slice(0, HALF_D, dim=1),
                                      gl.zeros([BLOCK_M, HALF_D], gl.float32, dq_layout), use_acc=False, is_async=True)
            dq_hi_tok = warpgroup_mma(ds_me.permute((1, 0)), k.slice(HALF_D, HALF_D, dim=1),
                                      gl.zeros([BLOCK_M, HALF_D], gl.float32, dq_layout), use_acc=False, is_async=True)
            dv, dk, dq_lo, dq_hi = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq_lo_tok, dq_hi_tok])
        else:
            if ONE_PASS == 1:
                buf = t % 2
                ds_bufs.index(buf).slice(HALF * HALF_N, HALF_N).store(dst.to(dtype))
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(pair_bars.index(buf), count=1)
            dv, dk = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok])
        mbarrier.arrive(q_empty.index(slot), count=1)
        mbarrier.arrive(do_empty.index(slot), count=1)
        if ONE_PASS == 2:
            tma.store_wait(0)  # this warpgroup's previous reduce-adds have read its two slots
            gl.thread_barrier()
            dq_bufs.index(2 * HALF)._reinterpret(gl.float32, [BLOCK_M, HALF_D], dq2d).store(dq_lo * sm_scale)
            dq_bufs.index(2 * HALF + 1)._reinterpret(gl.float32, [BLOCK_M, HALF_D], dq2d).store(dq_hi * sm_scale)
            fence_async_shared()
            gl.thread_barrier()
            _tma_reduce_add(dq_desc, [off_b, head, m0, 0], dq_bufs.index(2 * HALF))
            _tma_reduce_add(dq_desc, [off_b, head, m0, HALF_D], dq_bufs.index(2 * HALF + 1))
        if ONE_PASS == 1:
            # dQ[:, HALF * d/2 : +d/2] = dS K = sum over both key halves j of (dS^T_j)^T K_j[:, HALF * d/2 : +d/2]
            mbarrier.wait(pair_bars.index(buf), (t // 2) & 1)
            ds_t = ds_bufs.index(buf)
            dq = warpgroup_mma(ds_t.slice(0, HALF_N).permute((1, 0)),
                               k_bufs.index(0)._reinterpret(dtype, [HALF_N, HEAD_DIM], kv2d).slice(HALF * HALF_D,
                                                                                                   HALF_D, dim=1),
                               gl.zeros([BLOCK_M, HALF_D], gl.float32, dq_layout), use_acc=False, is_async=True)
            dq = warpgroup_mma(ds_t.slice(HALF_N, HALF_N).permute((1, 0)),
                               k_bufs.index(1)._reinterpret(dtype, [HALF_N, HEAD_DIM], kv2d).slice(HALF * HALF_D,
                                                                                                   HALF_D, dim=1),
                               dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=[dq])
            dq_smem = dq_bufs.index(HALF)
            tma.store_wait(0)  # this warpgroup's previous reduce-add has read its slot
            gl.thread_barrier()
            dq_smem._reinterpret(gl.float32, [BLOCK_M, HALF_D], dq2d).store(dq * sm_scale)
            fence_async_shared()
            gl.thread_barrier()
            _tma_reduce_add(dq_desc, [off_b, head, m0, HALF * HALF_D], dq_smem)
    # Epilogue: dK = scale * dS^T Q; both go out through this warpgroup's K and V buffers by TMA, which
    # clips the rows past N_K. In one pass the other warpgroup reads this one's K for its dQ until its last
    # step: both arrive on the last step's pair barrier's next use before either overwrites its K.
    if ONE_PASS:
        tma.store_wait(0)
    if ONE_PASS == 1:
        mbarrier.arrive(pair_bars.index(2), count=1)
        mbarrier.wait(pair_bars.index(2), 0)
    if GRAD_F32:
        rows_k = row0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, acc_layout))
        _store_rows(DK, off_b.to(gl.int64) * stride_dkb + off_hkv.to(gl.int64) * stride_dkh, rows_k, N_K,
                    stride_dkm, dk * sm_scale, acc_layout, HEAD_DIM)
        _store_rows(DV, off_b.to(gl.int64) * stride_dvb + off_hkv.to(gl.int64) * stride_dvh, rows_k, N_K,
                    stride_dvm, dv, acc_layout, HEAD_DIM)
    else:
        k.store((dk * sm_scale).to(dtype))
        v.store(dv.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [off_b, off_hkv, row0, 0], k_smem)
        tma.async_copy_shared_to_global(dv_desc, [off_b, off_hkv, row0, 0], v_smem)
        tma.store_wait(0)


@gluon.jit
def _bwd_loader(q_desc, do_desc, k_desc, v_desc, k_bufs, v_bufs, kv_bar, q_bufs, do_bufs, q_ready, do_ready,
                q_empty, do_empty, off_b, off_hkv, start_n, m_start, n_m, n_iter, GROUP,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    HALF_N: gl.constexpr = BLOCK_N // 2
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for half in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [off_b, off_hkv, start_n * BLOCK_N + half * HALF_N, 0], kv_bar,
                                        k_bufs.index(half))
        tma.async_copy_global_to_shared(v_desc, [off_b, off_hkv, start_n * BLOCK_N + half * HALF_N, 0], kv_bar,
                                        v_bufs.index(half))
    for t in range(n_iter):
        slot = t % STAGES
        phase = (t // STAGES) & 1
        head = off_hkv * GROUP + t // n_m
        m0 = (m_start + t % n_m) * BLOCK_M
        mbarrier.wait(q_empty.index(slot), phase ^ 1)
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [off_b, head, m0, 0], q_ready.index(slot), q_bufs.index(slot))
        mbarrier.wait(do_empty.index(slot), phase ^ 1)
        mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [off_b, head, m0, 0], do_ready.index(slot), do_bufs.index(slot))


@gluon.jit
def _key_tile(N_Q, N_K, H_KV, GROUP, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              LONGEST_FIRST: gl.constexpr = False):
    """This program's key tile and the query steps that see it, for the dK/dV kernels' grid of B * H_KV *
    cdiv(N_K, BLOCK_N) programs (the tiles of one key/value head consecutive; LONGEST_FIRST: every head's first
    tile, then every head's second, ...: under a causal mask the first tiles have the most query steps, so the
    longest programs start first): (batch, key/value head, tile, first query block, query blocks per query head,
    steps = GROUP query heads times those blocks)."""
    num_n = gl.cdiv(N_K, BLOCK_N)
    pid = gl.program_id(0)
    if LONGEST_FIRST:
        n_bh = gl.num_programs(0) // num_n
        bh = pid % n_bh
        start_n = pid // n_bh
    else:
        bh = pid // num_n
        start_n = pid % num_n
    off_b = bh // H_KV
    off_hkv = bh % H_KV
    offset = N_K - N_Q
    num_m = gl.cdiv(N_Q, BLOCK_M)
    if CAUSAL:
        # The first query row that sees this tile's first key: row + offset >= key.
        m_start = gl.minimum(gl.maximum(start_n * BLOCK_N - offset, 0) // BLOCK_M, num_m)
    else:
        m_start = 0
    n_m = num_m - m_start
    return off_b, off_hkv, start_n, m_start, n_m, GROUP * n_m


@gluon.jit
def _attn_bwd_dkdv_ws(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, Delta, sm_scale, N_Q, N_K, H_KV,
                      GROUP, stride_lb, stride_lh, dq_desc,
                      DK, DV, stride_dkb, stride_dkh, stride_dkm, stride_dvb, stride_dvh, stride_dvm,
                      CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                      STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, ONE_PASS: gl.constexpr = 0,
                      LONGEST_FIRST: gl.constexpr = False, GRAD_F32: gl.constexpr = False):
    """Grid (B * H_KV * cdiv(N_K, BLOCK_N),): one program per key tile, the tiles of one head consecutive
    (programs that run together read the same heads' Q and dO). LSE, Delta: (B, H_Q, N_Q) float32 with
    strides (stride_lb, stride_lh, 1). ONE_PASS: dq_desc describes a zeroed float32 (B, H_Q, N_Q, HEAD_DIM)
    tensor in blocks of (1, 1, BLOCK_M, HEAD_DIM / 2), to which the kernel adds dQ; else it is not read.
    LONGEST_FIRST: the programs' order of `_key_tile`. GRAD_F32: dK and dV go unrounded to the float32 tensors DK
    and DV (strides given, a unit last one); dk_desc and dv_desc are then not written (K's and V's will do)."""
    off_b, off_hkv, start_n, m_start, n_m, n_iter = _key_tile(N_Q, N_K, H_KV, GROUP, CAUSAL, BLOCK_M, BLOCK_N,
                                                              LONGEST_FIRST)

    dtype: gl.constexpr = q_desc.dtype
    k_bufs = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready, do_ready, q_empty, do_empty = _ring_barriers(STAGES)
    mbarrier.init(kv_bar, count=1)
    _init_ring(q_ready, do_ready, q_empty, do_empty, STAGES)
    if ONE_PASS == 1:  # two dS^T buffers of the whole tile (both warpgroups' keys), and a float32 dQ slot each
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
        dq_bufs = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
        pair_bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(3):
            mbarrier.init(pair_bars.index(i), count=2)
    elif ONE_PASS == 2:  # a dS^T slot of its own keys per warpgroup, and two float32 dQ slots each
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N // 2, BLOCK_M], dtype)
        ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N // 2, BLOCK_M], ds_layout)
        dq_bufs = gl.allocate_shared_memory(gl.float32, [4] + dq_desc.block_type.shape, dq_desc.layout)
        pair_bars = kv_bar  # (not read)
    else:
        ds_bufs, dq_bufs, pair_bars = q_bufs, q_bufs, kv_bar  # (not read)

    FIRST: gl.constexpr = 0
    SECOND: gl.constexpr = 1
    gl.warp_specialize([
        (_bwd_consumer, (k_bufs, v_bufs, kv_bar, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty,
                         dk_desc, dv_desc, LSE, Delta, off_b, off_hkv, start_n, m_start, n_m, n_iter, GROUP,
                         N_Q, N_K, sm_scale, stride_lb, stride_lh, ds_bufs, pair_bars, dq_bufs, dq_desc,
                         DK, DV, stride_dkb, stride_dkh, stride_dkm, stride_dvb, stride_dvh, stride_dvm,
                         FIRST, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, ONE_PASS, GRAD_F32)),
        (_bwd_consumer, (k_bufs, v_bufs, kv_bar, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty,
                         dk_desc, dv_desc, LSE, Delta, off_b, off_hkv, start_n, m_start, n_m, n_iter, GROUP,
                         N_Q, N_K, sm_scale, stride_lb, stride_lh, ds_bufs, pair_bars, dq_bufs, dq_desc,
                         DK, DV, stride_dkb, stride_dkh, stride_dkm, stride_dvb, stride_dvh, stride_dvm,
                         SECOND, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, ONE_PASS, GRAD_F32)),
        (_bwd_loader, (q_desc, do_desc, k_desc, v_desc, k_bufs, v_bufs, kv_bar, q_bufs, do_bufs, q_ready,
                       do_ready, q_empty, do_empty, off_b, off_hkv, start_n, m_start, n_m, n_iter, GROUP,
                       BLOCK_M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


# ---------------------------------------------------------------------------------------------------
# The dK/dV kernel at head dim 256 (and, with ATOMIC_DQ, dQ in the same pass). At d = 256 one warpgroup
# cannot hold the dK and dV of 64 keys (2 x 64 x 256 float32: 256 registers per thread), so the two
# consumer warpgroups share one tile of 64 keys and split its work twice: S^T and dP^T by query rows (each
# computes 32 of the step's 64 queries, over the whole head dim), dK, dV (and dQ) by head-dim halves (each
# accumulates 128 of the 256 columns). Between the two splits P and dS go through shared memory: each
# warpgroup writes its 32 rows of P and dS, and an mbarrier per buffer says both halves are there.
# ---------------------------------------------------------------------------------------------------
@gluon.jit
def _bwd256_consumer(k_bufs, v_bufs, kv_bar, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty,
                     p_bufs, ds_bufs, pair_bars, done_bar, dk_desc, dv_desc, DQ, dq_desc, dq_bufs, LSE, Delta,
                     off_b, off_hkv, start_n, m_start, n_m, n_iter, GROUP, N_Q, N_K, sm_scale,
                     stride_lb, stride_lh, stride_qb, stride_qh, stride_qm,
                     HALF: gl.constexpr, CAUSAL: gl.constexpr, ATOMIC_DQ: gl.constexpr, DQ_TMA: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HALF_D: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: query rows [HALF * BLOCK_M / 2, + BLOCK_M / 2) of every step's S^T and dP^T, and head-dim
    columns [HALF * HALF_D, + HALF_D) of the tile's dK and dV (and of each step's dQ)."""
    ROWS: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = dk_desc.dtype
    s_layout: gl.constexpr = _wgmma_layout(ROWS)
    acc_layout: gl.constexpr = _wgmma_layout(HALF_D)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    half2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF_D], dtype)
    qhalf2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF_D], dtype)
    dq2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF_D], gl.float32)

    row0 = start_n * BLOCK_N
    keys = row0 + gl.arange(0, BLOCK_N, layout=row_s)
    offset = N_K - N_Q
    qk_scale = sm_scale * LOG2E
    k_lo = k_bufs.index(0)._reinterpret(dtype, [BLOCK_N, HALF_D], half2d)
    k_hi = k_bufs.index(1)._reinterpret(dtype, [BLOCK_N, HALF_D], half2d)
    v_lo = v_bufs.index(0)._reinterpret(dtype, [BLOCK_N, HALF_D], half2d)
    v_hi = v_bufs.index(1)._reinterpret(dtype, [BLOCK_N, HALF_D], half2d)
    k_me = k_bufs.index(HALF)._reinterpret(dtype, [BLOCK_N, HALF_D], half2d)
    dk = gl.zeros([BLOCK_N, HALF_D], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HALF_D], gl.float32, acc_layout)
    first_full = row0 + BLOCK_N - 1 - offset  # from this query block on, every row sees every key of the tile
    ragged = row0 + BLOCK_N > N_K  # the last tile: rows past N_K are TMA's zeros, kept out of P
    mbarrier.wait(kv_bar, 0)
    for t in range(n_iter):
        slot = t % STAGES
        phase = (t // STAGES) & 1
        buf = t % 2
        head = off_hkv * GROUP + t // n_m
        m0 = (m_start + t % n_m) * BLOCK_M
        cols = m0 + HALF * ROWS + gl.arange(0, ROWS, layout=col_s)
        row_base = off_b.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh
        in_q = cols < N_Q
        lse = gl.load(LSE + row_base + cols, mask=in_q, other=0.0)
        delta = gl.load(Delta + row_base + cols, mask=in_q, other=0.0)
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        mbarrier.wait(q_ready.index(slot), phase)
        q_lo = q_bufs.index(2 * slot)._reinterpret(dtype, [BLOCK_M, HALF_D], qhalf2d)
        q_hi = q_bufs.index(2 * slot + 1)._reinterpret(dtype, [BLOCK_M, HALF_D], qhalf2d)
        st = warpgroup_mma(k_lo, q_lo.slice(HALF * ROWS, ROWS).permute((1, 0)),
                           gl.zeros([BLOCK_N, ROWS], gl.float32, s_layout), use_acc=False, is_async=True)
        st = warpgroup_mma(k_hi, q_hi.slice(HALF * ROWS, ROWS).permute((1, 0)), st, is_async=True)
        mbarrier.wait(do_ready.index(slot), phase)
        do_lo = do_bufs.index(2 * slot)._reinterpret(dtype, [BLOCK_M, HALF_D], qhalf2d)
        do_hi = do_bufs.index(2 * slot + 1)._reinterpret(dtype, [BLOCK_M, HALF_D], qhalf2d)
        dpt = warpgroup_mma(v_lo, do_lo.slice(HALF * ROWS, ROWS).permute((1, 0)),
                            gl.zeros([BLOCK_N, ROWS], gl.float32, s_layout), use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_hi, do_hi.slice(HALF * ROWS, ROWS).permute((1, 0)), dpt, is_async=True)
        st = warpgroup_mma_wait(2, deps=[st])
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
        if CAUSAL:
            if m0 < first_full:
                visible = gl.expand_dims(keys, 1) <= gl.expand_dims(cols + offset, 0)
                pt = gl.where(visible, pt, 0.0)
        if ragged:
            pt = gl.where(gl.expand_dims(keys < N_K, 1), pt, 0.0)
        p_half = p_bufs.index(buf).slice(HALF * ROWS, ROWS).permute((1, 0))
        p_half.store(pt.to(dtype))
        dpt = warpgroup_mma_wait(0, deps=[dpt])
        dst = pt * (dpt - gl.expand_dims(delta, 0))
        ds_half = ds_bufs.index(buf).slice(HALF * ROWS, ROWS).permute((1, 0))
        ds_half.store(dst.to(dtype))
        # Both warpgroups' rows of P and dS written: every thread's stores, then one arrival per warpgroup.
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(pair_bars.index(buf), count=1)
        mbarrier.wait(pair_bars.index(buf), (t // 2) & 1)
        p = p_bufs.index(buf)
        ds = ds_bufs.index(buf)
        do_me = do_bufs.index(2 * slot + HALF)._reinterpret(dtype, [BLOCK_M, HALF_D], qhalf2d)
        q_me = q_bufs.index(2 * slot + HALF)._reinterpret(dtype, [BLOCK_M, HALF_D], qhalf2d)
        dv_tok = warpgroup_mma(p.permute((1, 0)), do_me, dv, is_async=True)
        dk_tok = warpgroup_mma(ds.permute((1, 0)), q_me, dk, is_async=True)
        if ATOMIC_DQ:
            dq_tok = warpgroup_mma(ds, k_me, gl.zeros([BLOCK_M, HALF_D], gl.float32, acc_layout), use_acc=False,
                                   is_async=True)
            dv, dk, dq = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq_tok])
        else:
            dv, dk = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok])
        mbarrier.arrive(q_empty.index(slot), count=1)
        mbarrier.arrive(do_empty.index(slot), count=1)
        if ATOMIC_DQ:
            if DQ_TMA:
                # This warpgroup's columns of the step's dQ go through its own float32 slot by one TMA
                # reduce-add (rows past N_Q clipped); the slot is rewritten only once the previous reduce has
                # read it.
                dq_smem = dq_bufs.index(HALF)
                tma.store_wait(0)
                dq_smem._reinterpret(gl.float32, [BLOCK_M, HALF_D], dq2d).store(dq * sm_scale)
                fence_async_shared()
                gl.thread_barrier()
                _tma_reduce_add(dq_desc, [off_b, head, m0, HALF * HALF_D], dq_smem)
            else:
                rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
                dcols = HALF * HALF_D + gl.arange(0, HALF_D, layout=gl.SliceLayout(0, acc_layout))
                base = DQ + off_b.to(gl.int64) * stride_qb + head.to(gl.int64) * stride_qh
                ptrs = base + gl.expand_dims(rows * stride_qm, 1) + gl.expand_dims(dcols, 0)
                gl.atomic_add(ptrs, dq * sm_scale, mask=gl.expand_dims(rows < N_Q, 1), sem="relaxed")
    # Epilogue: both warpgroups are done with every column of K and V; each writes its columns of dK and dV
    # through its own half of the K and V buffers (TMA clips the rows past N_K).
    mbarrier.arrive(done_bar, count=1)
    mbarrier.wait(done_bar, 0)
    k_smem = k_bufs.index(HALF)
    v_smem = v_bufs.index(HALF)
    k_me.store((dk * sm_scale).to(dtype))
    v_bufs.index(HALF)._reinterpret(dtype, [BLOCK_N, HALF_D], half2d).store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [off_b, off_hkv, row0, HALF * HALF_D], k_smem)
    tma.async_copy_shared_to_global(dv_desc, [off_b, off_hkv, row0, HALF * HALF_D], v_smem)
    tma.store_wait(0)


@gluon.jit
def _bwd256_loader(q_desc, do_desc, k_desc, v_desc, k_bufs, v_bufs, kv_bar, q_bufs, do_bufs, q_ready, do_ready,
                   q_empty, do_empty, off_b, off_hkv, start_n, m_start, n_m, n_iter, GROUP,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HALF_D: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for half in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [off_b, off_hkv, start_n * BLOCK_N, half * HALF_D], kv_bar,
                                        k_bufs.index(half))
        tma.async_copy_global_to_shared(v_desc, [off_b, off_hkv, start_n * BLOCK_N, half * HALF_D], kv_bar,
                                        v_bufs.index(half))
    for t in range(n_iter):
        slot = t % STAGES
        phase = (t // STAGES) & 1
        head = off_hkv * GROUP + t // n_m
        m0 = (m_start + t % n_m) * BLOCK_M
        mbarrier.wait(q_empty.index(slot), phase ^ 1)
        mbarrier.expect(q_ready.index(slot), 2 * q_desc.block_type.nbytes)
        for half in gl.static_range(2):
            tma.async_copy_global_to_shared(q_desc, [off_b, head, m0, half * HALF_D], q_ready.index(slot),
                                            q_bufs.index(2 * slot + half))
        mbarrier.wait(do_empty.index(slot), phase ^ 1)
        mbarrier.expect(do_ready.index(slot), 2 * do_desc.block_type.nbytes)
        for half in gl.static_range(2):
            tma.async_copy_global_to_shared(do_desc, [off_b, head, m0, half * HALF_D], do_ready.index(slot),
                                            do_bufs.index(2 * slot + half))


@gluon.jit
def _attn_bwd256_ws(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, DQ, dq_desc, LSE, Delta, sm_scale, N_Q, N_K,
                    H_KV, GROUP, stride_lb, stride_lh, stride_qb, stride_qh, stride_qm,
                    CAUSAL: gl.constexpr, ATOMIC_DQ: gl.constexpr, DQ_TMA: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, HALF_D: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Grid (B * H_KV * cdiv(N_K, BLOCK_N),), as `_attn_bwd_dkdv_ws`. Every descriptor's block is (1, 1, 64,
    HALF_D): half a row of the head dim. DQ (ATOMIC_DQ): float32 (B, H_Q, N_Q, 2 * HALF_D), zero, unit column
    stride, to which each step adds sm_scale * dS K."""
    off_b, off_hkv, start_n, m_start, n_m, n_iter = _key_tile(N_Q, N_K, H_KV, GROUP, CAUSAL, BLOCK_M, BLOCK_N)

    dtype: gl.constexpr = q_desc.dtype
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    k_bufs = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES] + do_desc.block_type.shape, do_desc.layout)
    p_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], pds_layout)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], pds_layout)
    if DQ_TMA:  # one float32 dQ slot per warpgroup, for its TMA reduce-adds
        dq_bufs = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    else:
        dq_bufs = p_bufs  # (not read)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    done_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    pair_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_ready, do_ready, q_empty, do_empty = _ring_barriers(STAGES)
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(done_bar, count=2)
    for i in gl.static_range(2):
        mbarrier.init(pair_bars.index(i), count=2)
    _init_ring(q_ready, do_ready, q_empty, do_empty, STAGES)

    FIRST: gl.constexpr = 0
    SECOND: gl.constexpr = 1
    gl.warp_specialize([
        (_bwd256_consumer, (k_bufs, v_bufs, kv_bar, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty,
                            p_bufs, ds_bufs, pair_bars, done_bar, dk_desc, dv_desc, DQ, dq_desc, dq_bufs, LSE,
                            Delta, off_b, off_hkv, start_n, m_start, n_m, n_iter, GROUP, N_Q, N_K, sm_scale,
                            stride_lb, stride_lh, stride_qb, stride_qh, stride_qm,
                            FIRST, CAUSAL, ATOMIC_DQ, DQ_TMA, BLOCK_M, BLOCK_N, HALF_D, STAGES)),
        (_bwd256_consumer, (k_bufs, v_bufs, kv_bar, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty,
                            p_bufs, ds_bufs, pair_bars, done_bar, dk_desc, dv_desc, DQ, dq_desc, dq_bufs, LSE,
                            Delta, off_b, off_hkv, start_n, m_start, n_m, n_iter, GROUP, N_Q, N_K, sm_scale,
                            stride_lb, stride_lh, stride_qb, stride_qh, stride_qm,
                            SECOND, CAUSAL, ATOMIC_DQ, DQ_TMA, BLOCK_M, BLOCK_N, HALF_D, STAGES)),
        (_bwd256_loader, (q_desc, do_desc, k_desc, v_desc, k_bufs, v_bufs, kv_bar, q_bufs, do_bufs, q_ready,
                          do_ready, q_empty, do_empty, off_b, off_hkv, start_n, m_start, n_m, n_iter, GROUP,
                          BLOCK_M, BLOCK_N, HALF_D, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


# ---------------------------------------------------------------------------------------------------
# The backward's dQ: the forward's schedule with three products a step instead of two. One program per tile of
# 128 query rows (two consumer warpgroups of 64, the forward's order of programs); a load warp loads the tile's
# Q and dO once and streams K_j and V_j into a ring of STAGES slots. Per key block: S = Q K_j^T and
# dP = dO V_j^T in flight together; P = exp2(S log2e scale - LSE log2e) while dP is still on the tensor
# cores; dS = P (dP - D); dQ += dS K_j, with dS from registers. dQ = scale * dQ goes out by TMA through Q's buffer.
# ---------------------------------------------------------------------------------------------------
@gluon.jit
def _dq_consumer(q_bufs, do_bufs, q_bars, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, dq_desc, LSE, Delta,
                 off_b, off_h, start_m, N_Q, N_K, sm_scale, n_full, n_blocks, stride_lb, stride_lh,
                 DQ, stride_dqb, stride_dqh, stride_dqm,
                 HALF: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, DQ_F32: gl.constexpr):
    """One warpgroup: dQ of rows [start_m * BLOCK_M + HALF * BLOCK_M / 2, + BLOCK_M / 2) of one query head. DQ_F32:
    dQ goes unrounded to the float32 tensor DQ (strides given, a unit last one), not through dq_desc."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    tile2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, HEAD_DIM], dtype)

    row0 = start_m * BLOCK_M + HALF * HALF_M
    rows = row0 + gl.arange(0, HALF_M, layout=row_s)
    offset = N_K - N_Q
    qk_scale = sm_scale * LOG2E
    row_base = off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh
    in_q = rows < N_Q
    lse = gl.load(LSE + row_base + rows, mask=in_q, other=0.0)
    delta = gl.load(Delta + row_base + rows, mask=in_q, other=0.0)
    # Base-2 LSE; a row that saw no key (LSE = -inf) gets +inf, so its P is exp2(-inf) = 0.
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    q_smem = q_bufs.index(HALF)
    q = q_smem._reinterpret(dtype, [HALF_M, HEAD_DIM], q2d)
    do = do_bufs.index(HALF)._reinterpret(dtype, [HALF_M, HEAD_DIM], q2d)
    dq = gl.zeros([HALF_M, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(q_bars.index(HALF), 0)
    mbarrier.wait(q_bars.index(2 + HALF), 0)
    for j in range(n_blocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        k = k_bufs.index(slot)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], tile2d)
        # (Each product gets a zero accumulator of its own: one shared by both makes ptxas serialize them.)
        s_tok = warpgroup_mma(q, k.permute((1, 0)), gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout),
                              use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(slot), phase)
        v = v_bufs.index(slot)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], tile2d)
        dp_tok = warpgroup_mma(do, v.permute((1, 0)), gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout),
                               use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_tok])
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
        if j >= n_full:  # the diagonal band or the last, partial block (TMA's zero rows past N_K stay out)
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_s)
            visible = gl.expand_dims(cols < N_K, 0)
            if CAUSAL:
                visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + offset, 1))
            p = gl.where(visible, p, 0.0)
        dp = warpgroup_mma_wait(0, deps=[dp_tok])
        mbarrier.arrive(v_empty.index(slot), count=1)
        ds = p * (dp - gl.expand_dims(delta, 1))
        ds16 = gl.convert_layout(ds.to(dtype), op_layout)
        dq_tok = warpgroup_mma(ds16, k, dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq_tok])
        mbarrier.arrive(k_empty.index(slot), count=1)
    if DQ_F32:
        _store_rows(DQ, off_b.to(gl.int64) * stride_dqb + off_h.to(gl.int64) * stride_dqh,
                    row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, acc_layout)), N_Q, stride_dqm,
                    dq * sm_scale, acc_layout, HEAD_DIM)
    else:
        # Q's buffer is free after the last S product: dQ goes out through it (TMA clips the rows past N_Q).
        q.store((dq * sm_scale).to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dq_desc, [off_b, off_h, row0, 0], q_smem)
        tma.store_wait(0)


@gluon.jit
def _dq_loader(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, q_bars, k_bufs, v_bufs, k_ready, v_ready, k_empty,
               v_empty, off_b, off_h, off_hkv, start_m, n_blocks,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the two halves of Q and of dO once (q_bars 0-1 and 2-3), then K_j and V_j as the forward's."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    for half in gl.static_range(2):
        mbarrier.expect(q_bars.index(half), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [off_b, off_h, start_m * BLOCK_M + half * HALF_M, 0],
                                        q_bars.index(half), q_bufs.index(half))
        mbarrier.expect(q_bars.index(2 + half), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [off_b, off_h, start_m * BLOCK_M + half * HALF_M, 0],
                                        q_bars.index(2 + half), do_bufs.index(half))
    for j in range(n_blocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [off_b, off_hkv, j * BLOCK_N, 0], k_ready.index(slot),
                                        k_bufs.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [off_b, off_hkv, j * BLOCK_N, 0], v_ready.index(slot),
                                        v_bufs.index(slot))


@gluon.jit
def _attn_bwd_dq_ws(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, Delta, sm_scale, N_Q, N_K, H_Q, GROUP,
                    HEADS_PER_GROUP, stride_lb, stride_lh, DQ, stride_dqb, stride_dqh, stride_dqm,
                    CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, DQ_F32: gl.constexpr = False):
    """Grid (B * H_Q * cdiv(N_Q, BLOCK_M),), in the forward's order. Writes dQ (in q's dtype) through `dq_desc`
    from LSE (natural log) and Delta = rowsum(dO * O) - dLSE, both (B, H_Q, N_Q) float32 with strides
    (stride_lb, stride_lh, 1). DQ_F32: dQ goes unrounded to the float32 tensor DQ instead (strides given, a unit
    last one); dq_desc is then not written (Q's will do)."""
    off_b, off_h, off_hkv, start_m, n_full, n_blocks = _query_tile(N_Q, N_K, H_Q, GROUP, HEADS_PER_GROUP, CAUSAL,
                                                                  BLOCK_M, BLOCK_N)
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [2] + do_desc.block_type.shape, do_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    k_ready, v_ready, k_empty, v_empty = _ring_barriers(STAGES)
    for i in gl.static_range(4):
        mbarrier.init(q_bars.index(i), count=1)
    _init_ring(k_ready, v_ready, k_empty, v_empty, STAGES)

    FIRST: gl.constexpr = 0
    SECOND: gl.constexpr = 1
    gl.warp_specialize([
        (_dq_consumer, (q_bufs, do_bufs, q_bars, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, dq_desc, LSE,
                        Delta, off_b, off_h, start_m, N_Q, N_K, sm_scale, n_full, n_blocks, stride_lb, stride_lh,
                        DQ, stride_dqb, stride_dqh, stride_dqm, FIRST, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                        DQ_F32)),
        (_dq_consumer, (q_bufs, do_bufs, q_bars, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, dq_desc, LSE,
                        Delta, off_b, off_h, start_m, N_Q, N_K, sm_scale, n_full, n_blocks, stride_lb, stride_lh,
                        DQ, stride_dqb, stride_dqh, stride_dqm, SECOND, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                        DQ_F32)),
        (_dq_loader, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, q_bars, k_bufs, v_bufs, k_ready, v_ready,
                      k_empty, v_empty, off_b, off_h, off_hkv, start_m, n_blocks, BLOCK_M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


# ---------------------------------------------------------------------------------------------------
# Host side.
# ---------------------------------------------------------------------------------------------------
# Whether a problem takes these kernels is `ops`' decision (`faster*` below, `eligible*`), overridden per scope with
# `fa_lib.kernel_options(hopper_forward=..., hopper_backward=..., hopper_dq=..., hopper_one_pass=...)`.
HEAD_DIMS = (64, 128, 256)
BLOCK_M, NUM_WARPS = 128, 4
# Keys per block, by head dim. At 256 a consumer's O is 64 x 256 float32, 128 registers per thread, so the
# scores' tile is halved (64 x 64: 32 registers) to stay within CONSUMER_REGS.
BLOCK_N = {64: 128, 128: 128, 256: 64}
# K and V slots: 2 x 32 KB per slot at d = 128 and at d = 256 (64 keys), with Q's 32 KB (64 KB at 256), of 227 KB
STAGES = {64: 3, 128: 2, 256: 2}
CONSUMER_REGS, MAX_REGS = 240, 168  # 2 x 128 threads at 240, the load warp's group at 24: 168 x 384 in all


def eligible(q, k, v, o):
    """Whether this kernel can run the forward of (q, k, v) into o, all (B, H, N, D) CUDA tensors of one
    16-bit dtype (o may be float32 instead: a partial result kept unrounded, `_outputs_ready`): an sm_90 device,
    head dim 64, 128 or 256, and what a TMA descriptor needs (last dimension contiguous, the other strides and the
    base 16-byte aligned). The masks and options it lacks are the caller's to rule out."""
    return q.shape[-1] in HEAD_DIMS and _tma_ready(q, k, v) and _outputs_ready(q, o)


def _outputs_ready(q, *outs):
    """Whether these outputs can be written: all in q's 16-bit dtype and TMA-ready (`_tma_ready`), or all float32 on
    q's device with a unit last stride (stored from registers, `_store_rows`)."""
    import torch

    if all(t.dtype == torch.float32 for t in outs):
        return all(t.device == q.device and t.stride(-1) == 1 for t in outs)
    return _tma_ready(q, *outs)


def _tma_ready(*tensors):
    """Whether TMA descriptors can cover these tensors: CUDA tensors on an sm_90 device, one 16-bit dtype, last
    dimension contiguous, the other strides and the base 16-byte aligned."""
    q = tensors[0]
    if q.dtype not in _GL_DTYPES or not (q.is_cuda and _capability(q.device) == (9, 0)):
        return False
    return all(t.dtype == q.dtype and t.device == q.device and _tma_aligned(t) for t in tensors)


def _tma_aligned(t):
    """Whether a TMA descriptor can address `t`'s memory: the base and every stride but the last 16-byte aligned,
    the last stride 1."""
    *lead, last = t.stride()
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and last == 1 and all(s * size % 16 == 0 for s in lead)


def eligible_backward(q, k, v, do, dk, dv):
    """Whether the dK/dV kernel can run this backward: a head dim of BWD_STAGES, and what TMA
    needs of every operand (`_tma_ready`; no stride of 0 either: a broadcast gradient is not a TMA tensor).
    Float32 dk and dv (`_outputs_ready`) at the head dims of GRAD_F32_HEAD_DIMS."""
    if q.shape[-1] not in BWD_STAGES or not (_tma_ready(q, k, v, do) and _outputs_ready(q, dk, dv)):
        return False
    if dk.dtype != q.dtype and q.shape[-1] not in GRAD_F32_HEAD_DIMS:
        return False
    return all(s != 0 for t in (q, k, v, do, dk, dv) for s, n in zip(t.stride(), t.shape) if n > 1)


def forward(q, k, v, o, lse, causal, sm_scale, group=None):
    """Launch the forward: o (B, H_q, N_q, D) in q's dtype, or float32 (unrounded, for a later merge), and lse
    (B, H_q, N_q) float32 (contiguous). `group`: the (batch, head) pairs whose tiles run together
    (`fa_lib.dispatch.tile_group`); None: all of them."""
    import torch

    B, H_Q, N_Q, D = q.shape
    H_KV, N_K = k.shape[1], k.shape[2]
    q_block, q_layout, kv_block, kv_layout = _blocks(q.dtype, D)
    grid = (B * H_Q * triton.cdiv(N_Q, BLOCK_M),)
    group = group or B * H_Q
    o_f32 = o.dtype == torch.float32
    q_desc = _desc(q, q_block, q_layout)
    args = (q_desc, _desc(k, kv_block, kv_layout), _desc(v, kv_block, kv_layout),
            q_desc if o_f32 else _desc(o, q_block, q_layout), lse, float(sm_scale), N_Q, N_K, H_Q, H_Q // H_KV, group,
            lse.stride(0), lse.stride(1), o, *_f32_strides(o_f32, o))
    launch.launch(_attn_fwd_ws, grid, args,
                  dict(CAUSAL=bool(causal), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N[D], HEAD_DIM=D, STAGES=STAGES[D],
                       CONSUMER_REGS=CONSUMER_REGS, num_warps=NUM_WARPS, maxnreg=MAX_REGS, **_flag("O_F32", o_f32)))


# The backward's dK/dV kernel (kernel option `hopper_backward`).
BWD_BLOCK_M, BWD_BLOCK_N = 64, 128  # query rows per step (the ring's slots), keys per program (2 x 64)
BWD_STAGES = {64: 3, 128: 2, 256: 2}  # Q and dO slots: 2 x 16 KB per slot at d = 128, with K's and V's 64 KB;
# at d = 256 (`_attn_bwd256_ws`) 2 x 32 KB per slot, with K's and V's 64 KB and P's and dS's 2 x 16 KB
BWD256_BLOCK_M, BWD256_BLOCK_N = 64, 64  # d = 256: query rows per step, keys per program (shared by both warpgroups)
# The head dims at which the two-pass dK/dV kernel also writes float32 dK and dV (the ring's unrounded partial
# gradients, `_store_rows`); at 256 (`_attn_bwd256_ws`) they take the portable kernel.
GRAD_F32_HEAD_DIMS = (64, 128)


# The one pass's shared-tile kernel by head dim: keys per program, and whether a step's dQ goes out by one TMA
# reduce-add per warpgroup (through a float32 slot of BLOCK_M x d/2 in shared memory) instead of element-wise
# atomics. At 256 the slots would not fit beside the kernel's 224 KiB.
ONE_PASS_BLOCK_N = {128: 128, 256: BWD256_BLOCK_N}
ONE_PASS_DQ_TMA = {128: True, 256: False}
# The head dims at which the one pass takes FlashAttention-3's split instead (`_attn_bwd_dkdv_ws` with ONE_PASS:
# each warpgroup keeps its 64 keys' dK and dV, and the step's dS goes through shared memory so that each computes
# half of dQ's columns over all 128 keys, added by a TMA reduce-add).
ONE_PASS_SPLIT_HEAD_DIMS = (128,)
# 1: the split above; 2: no hand-over between the warpgroups, each adding its own 64 keys' share of all of dQ's
# columns (two reduce-adds a step instead of one, no mbarrier between the warpgroups).
ONE_PASS_MODE = {128: 1}
ONE_PASS_STAGES = {128: 2}  # Q and dO slots of the split one pass (3: 229 KB of shared memory with the dS and dQ buffers)
ONE_PASS_LONGEST_FIRST = False  # causal one pass: the programs in `_key_tile`'s longest-first order


def _check_one_pass_settings(head_dim):
    """The one pass's module settings at this head dim, checked before a launch: an unknown ONE_PASS_MODE would
    compile a kernel that adds no dQ at all (a silent wrong answer), and other values a kernel that does not fit."""
    checks = (("ONE_PASS_MODE", ONE_PASS_MODE, (1, 2)), ("ONE_PASS_STAGES", ONE_PASS_STAGES, (2, 3)),
              ("ONE_PASS_BLOCK_N", ONE_PASS_BLOCK_N, (64, 128)), ("ONE_PASS_DQ_TMA", ONE_PASS_DQ_TMA, (False, True)))
    for name, table, allowed in checks:
        if head_dim in ONE_PASS_SPLIT_HEAD_DIMS or name in ("ONE_PASS_BLOCK_N", "ONE_PASS_DQ_TMA"):
            value = table.get(head_dim)
            if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
                raise ValueError(f"kernels_hopper.{name}[{head_dim}] must be one of {allowed}, got {value!r}")


def backward_dkdv(q, k, v, do, lse, delta, dk, dv, causal, sm_scale, dq_acc=None):
    """Launch the dK/dV kernel: dk, dv (B, H_kv, N_k, D) written in q's 16-bit dtype from q, do (B, H_q, N_q, D),
    k, v (B, H_kv, N_k, D), and the float32 lse (natural log) and delta = rowsum(dO * O) - dLSE, both
    (B, H_q, N_q) with the same strides and a unit row stride. D: 64, 128 or 256. `dq_acc` (D = 128 or 256, the
    keys of ONE_PASS_BLOCK_N): a zeroed float32 (B, H_q, N_q, D) tensor with a unit last stride, to which the same
    pass adds dQ (atomically: the sum's order, and so its last bits, vary); at the head dims of
    ONE_PASS_SPLIT_HEAD_DIMS, when TMA can address it, by TMA reduce-adds from `_attn_bwd_dkdv_ws` (ONE_PASS_MODE),
    else from the shared-tile kernel `_attn_bwd256_ws`. The caller checks
    `eligible_backward` (device, strides) and the problem (plain or causal); a dtype, head dim, lse/delta or
    dq_acc that this launch cannot take is a TypeError or ValueError naming it."""
    import torch

    B, H_Q, N_Q, D = q.shape
    H_KV, N_K = k.shape[1], k.shape[2]
    if q.dtype not in _GL_DTYPES:
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
    if D not in BWD_STAGES:
        raise ValueError(f"q's head dim must be one of {sorted(BWD_STAGES)}, got {D}")
    if dq_acc is not None:
        if D not in ONE_PASS_BLOCK_N:
            raise ValueError(f"dq_acc is taken at head dims {sorted(ONE_PASS_BLOCK_N)} only, got q's head dim {D}")
        if dq_acc.dtype != torch.float32 or tuple(dq_acc.shape) != tuple(q.shape) or dq_acc.stride(3) != 1:
            raise ValueError(f"dq_acc must be float32 of q's shape {tuple(q.shape)} with a unit last stride, got "
                             f"{dq_acc.dtype} {tuple(dq_acc.shape)} strides {dq_acc.stride()}")
    if lse.dtype != torch.float32 or delta.dtype != lse.dtype:
        raise TypeError(f"lse and delta must be float32, got {lse.dtype} and {delta.dtype}")
    if tuple(lse.shape) != (B, H_Q, N_Q) or tuple(delta.shape) != (B, H_Q, N_Q):
        raise ValueError(f"lse and delta must have shape {(B, H_Q, N_Q)}, got {tuple(lse.shape)} and "
                         f"{tuple(delta.shape)}")
    if lse.stride() != delta.stride() or lse.stride(2) != 1:
        raise ValueError(f"lse and delta must share strides with a unit row stride, got {lse.stride()} and "
                         f"{delta.stride()}")
    grad_f32 = dk.dtype == torch.float32
    if dv.dtype != dk.dtype or not (grad_f32 or dk.dtype == q.dtype):
        raise TypeError(f"dk and dv must both be in q's dtype {q.dtype} or both float32, got {dk.dtype} and {dv.dtype}")
    if grad_f32 and (dq_acc is not None or D not in GRAD_F32_HEAD_DIMS):
        raise ValueError(f"float32 dk and dv are written by the two-pass kernel at head dims {GRAD_F32_HEAD_DIMS} "
                         f"only, got head dim {D}" + (" and a dq_acc" if dq_acc is not None else ""))
    if dq_acc is not None:
        _check_one_pass_settings(D)
    dq_tma_ready = dq_acc is not None and _tma_aligned(dq_acc)  # dQ can be added by TMA reduce-adds
    split = dq_tma_ready and D in ONE_PASS_SPLIT_HEAD_DIMS
    if D == 256 or (dq_acc is not None and not split):
        # The shared-tile kernel: every descriptor's block is half a row of the head dim (Q and dO BLOCK_M rows,
        # K, V, dK and dV the tile's keys).
        block_n = ONE_PASS_BLOCK_N[D] if dq_acc is not None else BWD256_BLOCK_N
        qb, kvb = _block(q.dtype, BWD256_BLOCK_M, D // 2), _block(q.dtype, block_n, D // 2)
        descs = [_desc(t, *b) for t, b in ((q, qb), (k, kvb), (v, kvb), (do, qb), (dk, kvb), (dv, kvb))]
        dq = dq_acc if dq_acc is not None else lse  # (not read without ATOMIC_DQ)
        dq_strides = dq_acc.stride()[:3] if dq_acc is not None else (0, 0, 0)
        dq_tma = dq_tma_ready and ONE_PASS_DQ_TMA[D]
        dq_desc = _desc(dq_acc, *_block(torch.float32, BWD256_BLOCK_M, D // 2)) if dq_tma else descs[4]  # (else not read)
        launch.launch(_attn_bwd256_ws, (B * H_KV * triton.cdiv(N_K, block_n),),
                      (*descs, dq, dq_desc, lse, delta, float(sm_scale), N_Q, N_K, H_KV, H_Q // H_KV, lse.stride(0),
                       lse.stride(1), *dq_strides),
                      dict(CAUSAL=bool(causal), ATOMIC_DQ=dq_acc is not None, DQ_TMA=dq_tma, BLOCK_M=BWD256_BLOCK_M,
                           BLOCK_N=block_n, HALF_D=D // 2, STAGES=BWD_STAGES[D], CONSUMER_REGS=CONSUMER_REGS,
                           num_warps=NUM_WARPS, maxnreg=MAX_REGS))
        return
    q_block, q_layout = _block(q.dtype, BWD_BLOCK_M, D)
    kv_block, kv_layout = _block(q.dtype, BWD_BLOCK_N // 2, D)
    grid = (B * H_KV * triton.cdiv(N_K, BWD_BLOCK_N),)
    k_desc, v_desc = _desc(k, kv_block, kv_layout), _desc(v, kv_block, kv_layout)
    dk_desc = k_desc if grad_f32 else _desc(dk, kv_block, kv_layout)  # (float32: K's, not written)
    dv_desc = v_desc if grad_f32 else _desc(dv, kv_block, kv_layout)
    dq_desc = _desc(dq_acc, *_block(torch.float32, BWD_BLOCK_M, D // 2)) if split else dk_desc  # (else not read)
    args = (_desc(q, q_block, q_layout), k_desc, v_desc, _desc(do, q_block, q_layout), dk_desc, dv_desc,
            lse, delta, float(sm_scale), N_Q, N_K, H_KV, H_Q // H_KV, lse.stride(0), lse.stride(1), dq_desc,
            dk, dv, *_f32_strides(grad_f32, dk, dv))
    launch.launch(_attn_bwd_dkdv_ws, grid, args,
                  dict(CAUSAL=bool(causal), BLOCK_M=BWD_BLOCK_M, BLOCK_N=BWD_BLOCK_N, HEAD_DIM=D,
                       STAGES=ONE_PASS_STAGES[D] if split else BWD_STAGES[D], CONSUMER_REGS=CONSUMER_REGS,
                       ONE_PASS=ONE_PASS_MODE[D] if split else 0,
                       LONGEST_FIRST=split and bool(causal) and ONE_PASS_LONGEST_FIRST,
                       num_warps=NUM_WARPS, maxnreg=MAX_REGS, **_flag("GRAD_F32", grad_f32)))


# The backward's dQ kernel (`_attn_bwd_dq_ws`; kernel option `hopper_dq`).
DQ_BLOCK_N = {64: 128, 128: 128}  # keys per step (the ring's slots)
DQ_STAGES = {64: 2, 128: 2}  # K and V slots: at d = 128, 2 x 2 x 32 KB beside Q's and dO's 2 x 2 x 16 KB


def eligible_dq(q, k, v, do, dq):
    """Whether the dQ kernel can run this backward: a head dim of DQ_BLOCK_N, and what TMA needs of every
    operand (`_tma_ready`; no stride of 0 either); dq may be float32 (`_outputs_ready`)."""
    if q.shape[-1] not in DQ_BLOCK_N or not (_tma_ready(q, k, v, do) and _outputs_ready(q, dq)):
        return False
    return all(s != 0 for t in (q, k, v, do, dq) for s, n in zip(t.stride(), t.shape) if n > 1)


def backward_dq(q, k, v, do, lse, delta, dq, causal, sm_scale, group=None):
    """Launch the dQ kernel: dq (B, H_q, N_q, D) written in q's 16-bit dtype (or float32, unrounded) from q, do, k, v
    and the float32 lse
    (natural log) and delta = rowsum(dO * O) - dLSE, both (B, H_q, N_q) with the same strides and a unit row
    stride. D: a key of DQ_BLOCK_N. The caller checks `eligible_dq` and the problem (plain or causal); a dtype,
    head dim or lse/delta that this launch cannot take is a TypeError or ValueError naming it. `group`: as in
    `forward`."""
    import torch

    B, H_Q, N_Q, D = q.shape
    H_KV, N_K = k.shape[1], k.shape[2]
    if q.dtype not in _GL_DTYPES:
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
    if D not in DQ_BLOCK_N:
        raise ValueError(f"q's head dim must be one of {sorted(DQ_BLOCK_N)}, got {D}")
    if lse.dtype != torch.float32 or delta.dtype != lse.dtype:
        raise TypeError(f"lse and delta must be float32, got {lse.dtype} and {delta.dtype}")
    if tuple(lse.shape) != (B, H_Q, N_Q) or tuple(delta.shape) != (B, H_Q, N_Q):
        raise ValueError(f"lse and delta must have shape {(B, H_Q, N_Q)}, got {tuple(lse.shape)} and "
                         f"{tuple(delta.shape)}")
    if lse.stride() != delta.stride() or lse.stride(2) != 1:
        raise ValueError(f"lse and delta must share strides with a unit row stride, got {lse.stride()} and "
                         f"{delta.stride()}")
    if dq.dtype not in (q.dtype, torch.float32):
        raise TypeError(f"dq must be in q's dtype {q.dtype} or float32, got {dq.dtype}")
    dq_f32 = dq.dtype == torch.float32
    q_block, q_layout = _block(q.dtype, BLOCK_M // 2, D)
    kv_block, kv_layout = _block(q.dtype, DQ_BLOCK_N[D], D)
    group = group or B * H_Q
    q_desc = _desc(q, q_block, q_layout)
    args = (q_desc, _desc(k, kv_block, kv_layout), _desc(v, kv_block, kv_layout),
            _desc(do, q_block, q_layout), q_desc if dq_f32 else _desc(dq, q_block, q_layout), lse, delta,
            float(sm_scale), N_Q, N_K, H_Q, H_Q // H_KV, group, lse.stride(0), lse.stride(1), dq,
            *_f32_strides(dq_f32, dq))
    launch.launch(_attn_bwd_dq_ws, (B * H_Q * triton.cdiv(N_Q, BLOCK_M),), args,
                  dict(CAUSAL=bool(causal), BLOCK_M=BLOCK_M, BLOCK_N=DQ_BLOCK_N[D], HEAD_DIM=D, STAGES=DQ_STAGES[D],
                       CONSUMER_REGS=CONSUMER_REGS, num_warps=NUM_WARPS, maxnreg=MAX_REGS, **_flag("DQ_F32", dq_f32)))


def _f32_strides(on, *outs):
    """The (batch, head, row) strides of float32 outputs, or zeros where the output goes by TMA (unread): a 16-bit
    launch's arguments, and so its launch-cache key, do not vary with its output's strides."""
    return tuple(s for t in outs for s in (t.stride()[:3] if on else (0, 0, 0)))


def _flag(name, on):
    """A launch's float32-output flag, named only when set: the 16-bit launches (and their recorded decisions) are
    those without it."""
    return {name: True} if on else {}


def _block(dtype, rows, head_dim):
    """A TMA block of `rows` rows of one head, (1, 1, rows, head_dim), and its shared-memory layout (cached)."""
    key = (dtype, rows, head_dim)
    if key not in _BLOCKS:
        block = [1, 1, rows, head_dim]
        gl_dtype = _GL_DTYPES[dtype] if dtype in _GL_DTYPES else gl.float32  # float32: the one pass's dQ
        _BLOCKS[key] = (block, gl.NVMMASharedLayout.get_default_for(block, gl_dtype))
    return _BLOCKS[key]


def _desc(t, block, layout):
    """The host TMA descriptor of `t` in blocks `block` (a list) of shared layout `layout`: the TensorDescriptor
    Gluon builds, without the checks of its constructor, which `_tma_ready` has made for every tensor this
    module launches on (16-byte aligned base and strides, a contiguous last dimension; no empty dimension
    reaches a launch). Those checks took about a sixth of a small forward's host time under cProfile on the H200
    (benchmarks/data/probe-host-fwd-nvidia-h200.json); `tests/library/test_kernels_hopper.py` checks that both ways build equal descriptors."""
    desc = _new(TensorDescriptor)
    desc.__dict__.update(base=t, shape=list(t.shape), strides=list(t.stride()), block_shape=block, layout=layout,
                         padding="zero")
    return desc


_new = object.__new__


_BLOCKS = {}


def _blocks(dtype, head_dim):
    """The TMA blocks of Q/O (half a tile: one consumer's rows) and of K/V, with their shared layouts."""
    return _block(dtype, BLOCK_M // 2, head_dim) + _block(dtype, BLOCK_N[head_dim], head_dim)


_DEVICES = {}


def _device(device):
    """(capability, SM count, L2 bytes) of a CUDA device, read once per device."""
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _DEVICES:
        props = torch.cuda.get_device_properties(idx)
        # An L2 size this torch does not report counts as 0: the heads are then always grouped.
        _DEVICES[idx] = ((props.major, props.minor), props.multi_processor_count, getattr(props, "L2_cache_size", 0))
    return _DEVICES[idx]


def _capability(device):
    return _device(device)[0]


def _dtypes():
    import torch

    return {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


_GL_DTYPES = _dtypes()
