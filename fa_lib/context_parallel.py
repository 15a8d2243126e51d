"""Context parallelism: attention over a sequence split across the ranks of a process group.

* ``ring_attention``: every rank keeps its shard of the queries; the K/V shards travel around the ring
  by point-to-point send/recv (the next shard is in flight while the current one is computed), and each
  step's partial ``(o, LSE)`` is merged in float32, in place, by one Triton kernel (the exact merge of
  the book's chapter 2). The backward pass keeps dQ local and sends each shard's dK/dV accumulators on
  with the next step's K/V, in one batched exchange, back to the owner; every block's backward is
  independent because it reuses the global LSE and D = rowsum(dO * O), computed once per rank.
  ``strategy="allgather"`` (Llama 3's scheme) gathers K/V once instead and reduce-scatters dK/dV.
  ``window=(left, right)`` runs a sliding window; the steps whose blocks it hides are skipped.
  ``cu_seqlens`` packs documents (flash-attn's varlen layout), each one split across the ranks on its own.
* ``ulysses_attention``: the head-parallel alternative: asynchronous all-to-alls turn sequence shards into
  head shards, each rank runs ordinary attention over the whole sequence for H / W heads, and an
  all-to-all turns the result back (the LSE travels only with ``return_lse=True``).
* ``shard`` / ``unshard``: split a full sequence into the per-rank shards and back, "zigzag" (rank r
  holds chunks r and 2W - 1 - r, which balances the causal work) or "contiguous".
* ``ring_on_one_device``: a W-rank ring's arithmetic (the same steps, kernels and merges) on one device, no
  process group: its precision can be measured where only one GPU is at hand.

Input agreement: before the first call of a problem (shapes, dtypes, options, group), the ranks compare
their inputs (one all-gather): a rank whose inputs fail their checks, or ranks that disagree, make every
rank raise ``ValueError``. Later calls of the same problem skip it (no host synchronisation per call);
``check=True`` runs it on every call, ``check=False`` never. Failures: an exception on one rank after the
ring started (an out-of-memory error, a bad kernel) is published in the group's store and the group is
aborted, so that the other ranks' pending transfers fail at once; every rank then raises a
``RuntimeError`` naming the failing rank (tested on gloo, whose closed connections wake the peers).

The per-block work runs on the kernels one GPU would run (``fa_lib.ops._forward`` / ``_backward``: on sm_90 the
Gluon forward, dK/dV and dQ kernels, which write the blocks' float32 partial results; elsewhere the portable
Triton kernels);
``fa_lib.reference.ring_attention``, ``allgather_attention`` and ``ring_attention_documents`` are the NumPy
mirrors.
"""
import datetime
import math
import numbers
import struct
import zlib
from collections import OrderedDict

import torch
import torch.distributed as dist

from . import kernels  # noqa: F401  (first: the kernels' mode, interpreter or GPU, is chosen at import)
from . import launch, ops
from .checks import PerTensor, _check_window_softcap
from .reference import ring_chunks

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["ring_attention", "ulysses_attention", "shard", "unshard", "ring_on_one_device", "STATS"]

_LAYOUTS = ("zigzag", "contiguous")


def _rank_world(group):
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: fa_lib.context_parallel needs an initialised torch.distributed process group "
                         "(torch.distributed.init_process_group), or pass one as group=")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the given group")
    return rank, dist.get_world_size(group)


def _check_layout(layout):
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")


def _agree(group, world, error, facts):
    """Decide together: all-gather, from every rank, whether its own checks failed (`error`, the exception
    or None) and a fixed list of integers describing its inputs (`facts`, name -> int). If any rank's
    checks failed, every rank raises (that rank its own error, the others a ValueError naming it); if the
    ranks disagree on a fact, every rank raises the same ValueError. Either way no rank is left waiting in
    a send or a collective that the others never reach."""
    names = list(facts)
    mine = torch.tensor([int(error is not None)] + [int(facts[n]) for n in names], dtype=torch.int64)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    mine = mine.to(device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).cpu()
    failed = [r for r in range(world) if table[r, 0]]
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"the inputs of rank(s) {failed} failed their checks (that rank raised the reason); "
                         f"every rank stops here")
    for i, name in enumerate(names, start=1):
        if not torch.all(table[:, i] == table[0, i]):
            raise ValueError(f"the ranks disagree on {name}: {table[:, i].tolist()} (rank by rank); every rank must "
                             f"pass shards of one shape, dtype and layout, and the same options")


def _dtype_code(dtype):
    return zlib.crc32(str(dtype).encode())  # the same on every process (unlike hash(), which is salted)


def _float_code(x):
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]  # the float's bits, compared exactly


def _check_dim(name, x, dim):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int naming one of {name}'s {x.dim()} dimensions, got {dim!r}")
    return int(dim) % x.dim()


# ---------------------------------------------------------------------------------------------------
# Sharding.
# ---------------------------------------------------------------------------------------------------
def _doc_pieces(x, dim, docs):
    start = 0
    for length in docs:
        yield x.narrow(dim, start, length)
        start += length


def shard(x, group=None, *, layout="zigzag", dim=2, cu_seqlens=None):
    """This rank's shard of the full sequence ``x`` (split along ``dim``, default 2 = the sequence axis of
    (B, H, N, D)). ``layout`` (default "zigzag"): "zigzag" cuts N into 2W chunks and keeps chunks r and
    2W - 1 - r; "contiguous" cuts it into W chunks and keeps chunk r. N must be divisible by 2W (zigzag) or W
    (contiguous). ``group``: default None, the world. With
    ``cu_seqlens`` (packed documents, as ``ring_attention`` takes them) every document is cut so, and
    the shard holds this rank's chunks of every document, in document order."""
    _check_layout(layout)
    dim = _check_dim("x", x, dim)
    rank, world = _rank_world(group)
    ids = ring_chunks(world, layout)[rank]
    n_chunks = world * len(ids)
    if cu_seqlens is not None:
        docs = _documents(cu_seqlens, x.shape[dim], world, len(ids))
        parts = [p.chunk(n_chunks, dim=dim)[i] for p in _doc_pieces(x, dim, docs) if p.shape[dim] for i in ids]
        return torch.cat(parts, dim=dim).contiguous() if parts else x.narrow(dim, 0, 0).contiguous()
    if x.shape[dim] % n_chunks:
        raise ValueError(f"x.shape[{dim}] = {x.shape[dim]} must be divisible by {n_chunks} ({layout} layout over "
                         f"{world} ranks)")
    return _local(x, ids, n_chunks, dim)


def _local(x, ids, n_chunks, dim=2):
    """Chunks `ids` of x's `n_chunks` equal chunks along `dim`, in that order, as one contiguous tensor."""
    pieces = x.chunk(n_chunks, dim=dim)
    return torch.cat([pieces[i] for i in ids], dim=dim).contiguous()


def unshard(x_local, group=None, *, layout="zigzag", dim=2, cu_seqlens=None):
    """The full sequence from every rank's shard (an all-gather, then the chunks put back in order). Every
    rank must pass a shard of one shape and dtype, as ``shard`` makes them (with the same ``layout``, default
    "zigzag", ``dim``, default 2, and ``cu_seqlens``, default None); otherwise every rank raises. ``group``:
    default None, the world."""
    rank, world = _rank_world(group)
    error, facts, docs = None, dict.fromkeys(("shape_hash", "dtype", "dim", "layout"), -1), None
    try:
        _check_layout(layout)
        dim = _check_dim("x_local", x_local, dim)
        per = len(ring_chunks(world, layout)[rank])
        if x_local.shape[dim] % per:
            raise ValueError(f"x_local.shape[{dim}] = {x_local.shape[dim]} must be divisible by {per} (chunks per "
                             f"rank in the {layout} layout)")
        if cu_seqlens is not None:
            docs = _documents(cu_seqlens, x_local.shape[dim] * world, world, per)
        facts = dict(shape_hash=zlib.crc32(repr((tuple(x_local.shape), docs)).encode()),
                     dtype=_dtype_code(x_local.dtype), dim=dim, layout=_LAYOUTS.index(layout))
    except (TypeError, ValueError) as e:
        error = e
    _agree(group, world, error, facts)
    chunks = ring_chunks(world, layout)
    gathered = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(gathered, x_local.contiguous(), group=group)
    per = len(chunks[0])
    out = []
    for length in (docs if docs is not None else [x_local.shape[dim] * world]):
        local = per * (length // (per * world))  # this document's rows in every shard
        by_id = {}
        for r, g in enumerate(gathered):
            for i, piece in zip(chunks[r], g.narrow(dim, 0, local).chunk(per, dim=dim) if local else ()):
                by_id[i] = piece
        out += [by_id[i] for i in sorted(by_id)]
        gathered = [g.narrow(dim, local, g.shape[dim] - local) for g in gathered]
    return torch.cat(out, dim=dim) if out else x_local.narrow(dim, 0, 0)


# ---------------------------------------------------------------------------------------------------
# Agreement once per problem, and failures that abort the group.
# ---------------------------------------------------------------------------------------------------
# Problems (group, then this rank's facts: shapes, dtype, options) whose inputs the group has agreed on.
# A call of a known problem skips `_agree`; its collective and host copy then cost nothing per layer.
_AGREED = OrderedDict()
_AGREED_MAX = 256


def _group_key(group):
    pg = group if group is not None else dist.group.WORLD
    return getattr(pg, "group_name", None) or id(pg)


def _decide(group, world, error, facts, check):
    """`_agree` on the first call of a problem (check=None), on every call (True) or never (False); a rank
    whose own checks failed always joins it (then every rank raises)."""
    key = (_group_key(group), tuple(facts.items()))
    if error is None and (check is False or (check is None and key in _AGREED)):
        if key in _AGREED:
            _AGREED.move_to_end(key)
        return
    _agree(group, world, error, facts)
    _AGREED[key] = None
    while len(_AGREED) > _AGREED_MAX:
        _AGREED.popitem(last=False)


_FAILED_KEY = "fa_lib.context_parallel.failed"


class _PeerLost(RuntimeError):
    """A transfer failed: a peer closed its connections (it aborted the group after an error)."""


def _wait(reqs):
    try:
        for req in reqs:
            req.wait()
    except RuntimeError as e:
        raise _PeerLost(str(e)) from e


def _store(group):
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg.get_group_store()
    except (AttributeError, RuntimeError):
        return dist.distributed_c10d._get_default_store()


def _abort(group):
    """Abort the group: this rank's connections close, so a peer's pending transfer with it fails at once
    (gloo) instead of waiting for the group's timeout. The group cannot be used afterwards."""
    pg = group if group is not None else dist.group.WORLD
    try:
        pg.abort()
    except Exception:  # noqa: BLE001  (a backend without abort: the peers wait for the timeout)
        pass


def _guarded(name, group, rank, world, body):
    """Run `body` (the ring's transfers and computation). An exception on this rank is published in the
    group's store and the group aborted; a rank whose transfer fails because a peer aborted reads who
    failed, aborts too (so that its own peers wake up), and raises. Every rank raises RuntimeError."""
    if world == 1:
        return body()
    try:
        return body()
    except _PeerLost as e:
        msg = None
        try:
            store = _store(group)
            store.wait([_FAILED_KEY], datetime.timedelta(seconds=10))
            msg = store.get(_FAILED_KEY).decode()
        except Exception:  # noqa: BLE001  (no store, or no message: say what this rank saw)
            pass
        _abort(group)
        raise RuntimeError(f"{name} stopped on rank {rank}: {msg or f'a transfer failed ({e})'}; the process group "
                           f"is aborted") from None
    except Exception as e:
        msg = f"rank {rank} failed: {type(e).__name__}: {e}"
        try:
            _store(group).compare_set(_FAILED_KEY, "", msg)
        except Exception:  # noqa: BLE001
            pass
        _abort(group)
        raise RuntimeError(f"{name}: {msg}; the process group is aborted on every rank") from e


# ---------------------------------------------------------------------------------------------------
# The fused merge.
# ---------------------------------------------------------------------------------------------------
def _merge(o, lse, o_b, lse_b):
    """Merge two normalised partial states in float32: LSE = log(e^lse + e^lse_b), o weighted accordingly.
    A state with LSE = -inf (no key seen) is the identity. (The semantics `_merge_` computes in place in
    one kernel; kept as its reference.)"""
    m = torch.maximum(lse, lse_b)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    a, b = torch.exp(lse - m_safe), torch.exp(lse_b - m_safe)
    total = a + b
    seen = total > 0
    denom = torch.where(seen, total, torch.ones_like(total))
    o = (o * a[..., None] + o_b.float() * b[..., None]) / denom[..., None]
    lse = torch.where(seen, m_safe + torch.log(denom), torch.full_like(m, float("-inf")))
    return o, lse


@triton.jit
def _merge_kernel(O, LSE, OB, LSEB, H, N, DIM,
                  so_b, so_h, so_n, so_d, sb_b, sb_h, sb_n, sb_d, sl_b, sl_h, sl_n, sm_b, sm_h, sm_n,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(O, LSE) <- merge((O, LSE), (OB, LSEB)) for BLOCK_M rows of one (batch, head): O float32, OB any
    float dtype, both (B, H, N, DIM) with any strides; LSE, LSEB float32 (B, H, N). A row with LSE = -inf
    on both sides stays o = 0 (if it was), LSE = -inf; no NaN."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    rows = rows.to(tl.int64)
    p_lse = LSE + b * sl_b + h * sl_h + rows * sl_n
    lse_a = tl.load(p_lse, mask=rmask, other=float("-inf"))
    lse_b = tl.load(LSEB + b * sm_b + h * sm_h + rows * sm_n, mask=rmask, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(lse_a - m_safe)
    wb = tl.exp(lse_b - m_safe)
    total = wa + wb
    seen = total > 0
    denom = tl.where(seen, total, 1.0)
    cols = tl.arange(0, BLOCK_D)
    for d0 in range(0, DIM, BLOCK_D):
        c = (d0 + cols).to(tl.int64)
        msk = rmask[:, None] & (c[None, :] < DIM)
        p_o = O + b * so_b + h * so_h + rows[:, None] * so_n + c[None, :] * so_d
        o = tl.load(p_o, mask=msk, other=0.0)
        ob = tl.load(OB + b * sb_b + h * sb_h + rows[:, None] * sb_n + c[None, :] * sb_d, mask=msk,
                     other=0.0).to(tl.float32)
        tl.store(p_o, (o * wa[:, None] + ob * wb[:, None]) / denom[:, None], mask=msk)
    # LSE last, after a barrier: the compiler loads LSE twice, in two register layouts held by different threads
    # (the weights of O's rows, and the rows' new LSE). Stored before the loop, a thread's merged LSE reached
    # memory before another thread had read that row for O's weights: O came out wrong on an H100 (up to 0.55
    # off on random inputs) while LSE was right.
    tl.debug_barrier()
    tl.store(p_lse, tl.where(seen, m_safe + tl.log(denom), float("-inf")), mask=rmask)


_MERGE_BLOCK_M = 64


def _merge_(o, lse, o_b, lse_b):
    """In place, one kernel launch: (o, lse) <- the exact merge of (o, lse) and (o_b, lse_b) (as `_merge`).
    o: float32 (B, H, n, D), lse: float32 (B, H, n), views of any strides; o_b (B, H, n, D), lse_b float32."""
    B, H, n, D = o.shape
    if B * H * n == 0:
        return o, lse
    block_d = max(16, min(128, triton.next_power_of_2(D)))
    grid = (triton.cdiv(n, _MERGE_BLOCK_M), B * H)
    with launch._device_guard(o):
        _merge_kernel[grid](o, lse, o_b, lse_b, H, n, D, *o.stride(), *o_b.stride(), *lse.stride(), *lse_b.stride(),
                            BLOCK_M=_MERGE_BLOCK_M, BLOCK_D=block_d)
    return o, lse


# ---------------------------------------------------------------------------------------------------
# Ring attention.
# ---------------------------------------------------------------------------------------------------
# What the last ring or all-gather call did on this rank: steps run and skipped (a window that hides
# whole steps), blocks computed and skipped. Read by the tests and the book.
STATS = {"steps": 0, "steps_skipped": 0, "blocks": 0, "blocks_skipped": 0}


def _band(x, y, c, causal, window):
    """What query chunk x computes against key chunk y (chunks of c tokens of one sequence): None when the
    mask hides the whole block, else (q0, q1, k0, k1, causal, window): rows q0:q1 of the query chunk
    against rows k0:k1 of the key chunk, with that mask for the kernel (aligned as flash-attn's, query
    and key ranges of one length). Query i sees key j of the block iff lo <= j - i <= hi."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    d = (x - y) * c
    lo = -math.inf if left < 0 else d - left
    hi = math.inf if right < 0 else d + right
    if lo > c - 1 or hi < -(c - 1):
        return None
    if lo > 0:  # the band lies above the diagonal: queries 0:c-lo against keys lo:c, window (0, hi - lo)
        r = hi - lo
        return 0, c - lo, lo, c, False, (0, -1 if r >= c - lo - 1 else int(r))
    if hi < 0:  # below: queries -hi:c against keys 0:c+hi, window (hi - lo, 0)
        s = int(-hi)
        lft = lo + s
        return (s, c, 0, c - s) + ((True, (-1, -1)) if lft <= -(c - s - 1) else (False, (int(-lft), 0)))
    lft = -1 if lo <= -(c - 1) else int(-lo)
    rgt = -1 if hi >= c - 1 else int(hi)
    if rgt == -1 and lft == -1:
        return 0, c, 0, c, False, (-1, -1)
    if rgt == 0 and lft == -1:
        return 0, c, 0, c, True, (-1, -1)
    return 0, c, 0, c, False, (lft, rgt)


def _plan(world, layout, c, causal, window):
    """steps[s][r]: the blocks rank r computes at step s, as (a, b, band) with a, b the chunk positions in
    the query and key shards. Steps after the last one any rank needs are dropped: the ring runs
    len(steps) steps (all W unless a window hides the far shards)."""
    chunks = ring_chunks(world, layout)
    steps = []
    for s in range(world):
        row = []
        for r in range(world):
            blocks = []
            for a, x in enumerate(chunks[r]):
                for b, y in enumerate(chunks[(r - s) % world]):
                    band = _band(x, y, c, causal, window)
                    if band is not None:
                        blocks.append((a, b, band))
            row.append(blocks)
        steps.append(row)
    n = max([s + 1 for s in range(world) if any(steps[s])], default=1)
    return steps[:n]


def _segments(n_local, world, layout, causal, window, docs=None):
    """The ring's plan for one sequence (docs None) or for packed documents (docs: their global
    lengths): [(base, c, steps)] per document with any token, base its first row in the local shard, c
    its chunk length, steps its `_plan`; and the number of ring steps, the most any document needs."""
    per = len(ring_chunks(world, layout)[0])
    segs, base = [], 0
    for length in ([n_local * world] if docs is None else docs):
        c = length // (per * world)
        if c:
            segs.append((base, c, _plan(world, layout, c, causal, window)))
        base += per * c
    return segs, max([len(steps) for _, _, steps in segs], default=1)


def _record(segs, n, world, rank, per):
    blocks = sum(len(step[rank]) for _, _, steps in segs for step in steps)
    STATS.update(steps=n, steps_skipped=world - n, blocks=blocks,
                 blocks_skipped=world * per * per * len(segs) - blocks)


def _blocks(segs, s, rank):
    """(row offset of the query chunk, of the key chunk, band) of every block rank computes at step s."""
    for base, c, steps in segs:
        if s < len(steps):
            for a, b, band in steps[s][rank]:
                yield base + a * c, base + b * c, band


def _peer(group, r):
    return dist.get_global_rank(group, r) if group is not None else r


def _exchange(sends, recvs, dst, src, group):
    """One batched exchange: every tensor of `sends` to rank `dst`, and `recvs` filled from rank `src`
    (group ranks). Returns the pending requests."""
    ops_ = [dist.P2POp(dist.isend, t, _peer(group, dst), group) for t in sends]
    ops_ += [dist.P2POp(dist.irecv, t, _peer(group, src), group) for t in recvs]
    return dist.batch_isend_irecv(ops_) if ops_ else []


def _rows(t, start, r0, r1):
    return t[:, :, start + r0:start + r1]


def _ring_forward(q, k, v, causal, scale, group, layout, window, docs=None):
    """One pass of the ring for q (B, H_q, N_local, d) and k, v (B, H_kv, N_local, d): this rank's
    (o, LSE), o in q's dtype, LSE float32. The K/V shard in flight goes into one of two buffers
    allocated once; the partial results are merged in place into one float32 (o, LSE)."""
    rank, world = _rank_world(group)
    per = len(ring_chunks(world, layout)[0])
    segs, n = _segments(q.shape[2], world, layout, causal, window, docs)
    _record(segs, n, world, rank, per)
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    k, v = k.contiguous(), v.contiguous()
    bufs = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(2, n - 1))]

    def body():
        cur = (k, v)
        for s in range(n):
            pending = None
            if s < n - 1:
                pending = _exchange(cur, bufs[s % 2], (rank + 1) % world, (rank - 1) % world, group)
            _forward_step(q, cur, segs, s, rank, scale, o, lse)
            if pending is not None:
                _wait(pending)
                cur = bufs[s % 2]
        return o.to(q.dtype), lse

    return _guarded("ring_attention", group, rank, world, body)


def _forward_step(q, cur, segs, s, rank, scale, o, lse):
    """Step s of the ring's forward on `rank`, holding the K/V shard `cur`: every block's float32 output and LSE,
    from the fast kernels where they apply (the sm_90 Gluon kernels write float32 partials too), merged unrounded
    into (o, lse) in place (one rounding, at the end)."""
    for qa, kb, (q0, q1, k0, k1, cz, win) in _blocks(segs, s, rank):
        o_p, lse_p = ops._forward(_rows(q, qa, q0, q1), _rows(cur[0], kb, k0, k1), _rows(cur[1], kb, k0, k1),
                                  cz, scale, window=win, out_dtype=torch.float32)
        _merge_(_rows(o, qa, q0, q1), lse[:, :, qa + q0:qa + q1], o_p, lse_p)


def _backward_step(do, neg_delta, zero_o, q, lse, cur, segs, s, rank, scale, dq):
    """Step s of the ring's backward on `rank`, holding the K/V shard `cur`: every block's float32 gradients from
    the global LSE and D (which make each block's backward independent of the others); dQ's added into `dq`,
    and the list of (key offset, k0, k1, dK, dV) parts for the caller to add into the travelling accumulators."""
    parts = []
    for qa, kb, (q0, q1, k0, k1, cz, win) in _blocks(segs, s, rank):
        dq_p, dk_p, dv_p = ops._backward(_rows(do, qa, q0, q1), neg_delta[:, :, qa + q0:qa + q1],
                                         _rows(q, qa, q0, q1), _rows(cur[0], kb, k0, k1),
                                         _rows(cur[1], kb, k0, k1), _rows(zero_o, qa, q0, q1),
                                         lse[:, :, qa + q0:qa + q1], cz, scale, window=win,
                                         grad_dtype=torch.float32)  # summed unrounded
        _rows(dq, qa, q0, q1).add_(dq_p)
        parts.append((kb, k0, k1, dk_p, dv_p))
    return parts


def _add_parts(parts, dk_acc, dv_acc):
    for kb, k0, k1, dk_p, dv_p in parts:
        _rows(dk_acc, kb, k0, k1).add_(dk_p)
        _rows(dv_acc, kb, k0, k1).add_(dv_p)


def _delta_inputs(do, out):
    """D = rowsum(dO * O) in float32, once per rank, handed to each block's backward as its dLSE = -D
    with a zero (stride-0, no memory) output: the kernels' D = rowsum(dO * 0) - dLSE is then D."""
    delta = (do.float() * out.float()).sum(-1)
    zero = torch.zeros((), dtype=out.dtype, device=out.device).expand(out.shape)
    return -delta, zero


def _ring_backward(do, q, k, v, out, lse, causal, scale, group, layout, window, docs=None):
    """The backward of one `_ring_forward` pass: (dq, dk, dv) in the inputs' dtypes. Each step is one
    batched exchange: the next K/V shard and the dK/dV accumulators of the shard just finished, to rank + 1."""
    rank, world = _rank_world(group)
    segs, n = _segments(q.shape[2], world, layout, causal, window, docs)
    do = do.contiguous()
    neg_delta, zero_o = _delta_inputs(do, out)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    k, v = k.contiguous(), v.contiguous()
    bufs = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(2, n - 1))]
    # Two pairs of dK/dV accumulators: the one being sent on and the one being received, in turn. acc[0]
    # starts as this rank's own shard's (zero); at step s >= 1 acc[s % 2] receives the accumulators of the
    # shard this rank now holds.
    acc = [(torch.zeros(k.shape, dtype=torch.float32, device=k.device),
            torch.zeros(v.shape, dtype=torch.float32, device=v.device))]
    if n > 1:
        acc.append((torch.empty(k.shape, dtype=torch.float32, device=k.device),
                    torch.empty(v.shape, dtype=torch.float32, device=v.device)))

    def body():
        cur = (k, v)
        for s in range(n):
            sends, recvs = [], []
            if s < n - 1:
                sends, recvs = list(cur), list(bufs[s % 2])
            if s >= 1:  # the shard finished at step s - 1 goes on with its accumulators
                sends += list(acc[(s - 1) % 2])
                recvs += list(acc[s % 2])
            pending = _exchange(sends, recvs, (rank + 1) % world, (rank - 1) % world, group)
            parts = _backward_step(do, neg_delta, zero_o, q, lse, cur, segs, s, rank, scale, dq)
            _wait(pending)
            _add_parts(parts, *acc[s % 2])
            if s < n - 1:
                cur = bufs[s % 2]
        # The last holder sends the accumulators home: shard (rank - n + 1) to its owner.
        if n > 1:
            home = acc[n % 2]
            _wait(_exchange(list(acc[(n - 1) % 2]), list(home), (rank - n + 1) % world, (rank + n - 1) % world,
                            group))
        else:
            home = acc[0]
        return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype)

    return _guarded("ring_attention (backward)", group, rank, world, body)


def ring_on_one_device(q, k, v, world, *, causal=False, softmax_scale=None, layout="zigzag", do=None):
    """The ring's arithmetic for `world` ranks, run on one device with no process group: q (B, H_q, N, d) and k, v
    (B, H_kv, N, d) are whole sequences; each rank's shard (`shard`'s layout) goes through the same steps
    (`_forward_step`, `_backward_step`: the same kernels, the same float32 merges and sums, in the same order)
    that `ring_attention` runs on rank r, where step s holds the K/V shard of rank r - s. Returns (o, lse) in the
    sequence's order, and with `do` (the gradient of o) also (dq, dk, dv): the numbers a `world`-GPU ring produces,
    for checking its precision where only one GPU is at hand. No window, no packed documents.

    q, k, v, do: float16, bfloat16 or float32, one dtype and device, as ``fa_lib.flash_attention`` takes them, with
    one sequence length N divisible by 2 * world (zigzag) or world (contiguous); do of q's shape and dtype. o is
    in q's dtype, lse float32 (B, H_q, N), the gradients in their inputs' dtypes.

    Args:
        world: the number of ranks simulated, a positive int.
        causal: default False; as ``fa_lib.flash_attention`` (the mask by the tokens' global positions).
        softmax_scale: default None, meaning ``1 / sqrt(head_dim)``; otherwise a positive number.
        layout: default "zigzag" (rank r holds chunks r and 2 * world - 1 - r of 2 * world), or "contiguous"
            (rank r holds chunk r of world), as ``shard`` cuts the sequence.
        do: default None (forward only); the gradient of o, to also return (dq, dk, dv).

    Raises:
        TypeError: a non-tensor q, k or v, an unsupported or mismatched dtype, a non-bool ``causal``, a
            ``world`` that is not an int (``2.0`` included).
        ValueError: ``world`` below 1, a ``layout`` other than "zigzag" or "contiguous", q, k, v not 4-D or of
            mismatched shapes or devices, k's sequence length not q's, N not divisible by the chunks, a ``do``
            that is not a tensor of q's shape and dtype, a non-positive ``softmax_scale``."""
    scale = ops._check_inputs(q, k, v, causal, softmax_scale, "ring_on_one_device")
    _check_layout(layout)
    ids = ring_chunks(world, layout)
    n, n_chunks = q.shape[2], world * len(ids[0])
    if k.shape[2] != n:
        raise ValueError(f"k and v must have q's sequence length {n} (one sequence, split over the ranks), got "
                         f"{k.shape[2]}")
    if n % n_chunks:
        raise ValueError(f"q.shape[2] = {n} must be divisible by {n_chunks} ({layout} layout over {world} ranks)")
    if do is not None and (not isinstance(do, torch.Tensor) or do.shape != q.shape or do.dtype != q.dtype):
        raise ValueError(f"do must be a tensor of q's shape {tuple(q.shape)} and dtype {q.dtype}, got "
                         f"{tuple(do.shape) + (do.dtype,) if isinstance(do, torch.Tensor) else type(do).__name__}")

    def local(x, r):
        return _local(x, ids[r], n_chunks)

    def natural(xs):  # the ranks' shards back in the sequence's order
        return _natural(torch.stack(xs), ids, n // n_chunks)

    qs, ks, vs = ([local(x, r) for r in range(world)] for x in (q, k, v))
    segs, steps = _segments(n // world, world, layout, causal, (-1, -1))
    outs, lses = [], []
    for r in range(world):
        o = torch.zeros(qs[r].shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qs[r].shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for s in range(steps):
            _forward_step(qs[r], (ks[(r - s) % world], vs[(r - s) % world]), segs, s, r, scale, o, lse)
        outs.append(o.to(q.dtype))
        lses.append(lse)
    result = natural(outs), natural([x.unsqueeze(-1) for x in lses]).squeeze(-1)
    if do is None:
        return result
    dos = [local(do, r) for r in range(world)]
    dqs = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in qs]
    dks = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in ks]
    dvs = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in vs]
    deltas = [_delta_inputs(dos[r], outs[r]) for r in range(world)]
    for s in range(steps):  # steps outside: each shard's accumulators gather their parts in the ring's order
        for r in range(world):
            owner = (r - s) % world  # the shard rank r holds at step s, whose accumulators travel with it
            parts = _backward_step(dos[r], *deltas[r], qs[r], lses[r], (ks[owner], vs[owner]), segs, s, r, scale,
                                   dqs[r])
            _add_parts(parts, dks[owner], dvs[owner])
    return result + tuple(natural([g.to(x.dtype) for g in gs]) for gs, x in ((dqs, q), (dks, k), (dvs, v)))


# ---------------------------------------------------------------------------------------------------
# All-gather K/V (Llama 3's scheme).
# ---------------------------------------------------------------------------------------------------
def _natural(x_ranks, chunks, c):
    """(W, B, H, N_local, d) rank-ordered shards -> (B, H, N, d) in sequence order."""
    where = {i: (r, p) for r, ids in enumerate(chunks) for p, i in enumerate(ids)}
    return torch.cat([x_ranks[where[i][0], :, :, where[i][1] * c:(where[i][1] + 1) * c] for i in sorted(where)],
                     dim=2)


def _key_range(x, c, n, causal, window):
    """(k0, k1, causal, window) for query chunk x against the gathered sequence of n tokens: the keys it
    can see, and the kernel's mask with flash-attn's bottom-right alignment put on the chunk's positions."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    k0 = 0 if left < 0 else max(0, x * c - left)
    if right == 0 and left < 0:
        return k0, (x + 1) * c, True, (-1, -1)
    k1 = n if right < 0 else min(n, (x + 1) * c + right)
    shift = k1 - (x + 1) * c  # the kernel puts query i at key k1 - c + i: shift tokens after its position
    return k0, k1, False, (-1 if left < 0 else left + shift, -1 if right < 0 else right - shift)


def _allgather(x, group, world):
    out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    return out, dist.all_gather(list(out.unbind(0)), x.contiguous(), group=group, async_op=True)


def _allgather_forward(q, k, v, causal, scale, group, layout, window):
    """Gather every rank's K/V shard (one all-gather each, asynchronous), put them in sequence order, and
    run each local query chunk against the keys it can see: one kernel call per chunk, no merge."""
    rank, world = _rank_world(group)
    chunks = ring_chunks(world, layout)
    per = len(chunks[0])
    c = q.shape[2] // per
    STATS.update(steps=1, steps_skipped=0, blocks=per, blocks_skipped=0)

    def body():
        (kg, wk), (vg, wv) = _allgather(k, group, world), _allgather(v, group, world)
        _wait([wk, wv])
        kn, vn = _natural(kg, chunks, c), _natural(vg, chunks, c)
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        for a, x in enumerate(chunks[rank]):
            k0, k1, cz, win = _key_range(x, c, kn.shape[2], causal, window)
            o_a, lse_a = ops._forward(_rows(q, a * c, 0, c), kn[:, :, k0:k1], vn[:, :, k0:k1], cz, scale, window=win)
            _rows(o, a * c, 0, c).copy_(o_a)
            lse[:, :, a * c:(a + 1) * c] = lse_a
        return o, lse

    return _guarded("ring_attention (allgather)", group, rank, world, body)


def _allgather_backward(do, q, k, v, out, lse, causal, scale, group, layout, window):
    """The backward of `_allgather_forward`: K/V gathered again (no gathered copy is kept between the
    passes), dK/dV summed over the ranks onto their owners (a reduce-scatter)."""
    rank, world = _rank_world(group)
    chunks = ring_chunks(world, layout)
    per = len(chunks[0])
    c = q.shape[2] // per
    do = do.contiguous()
    neg_delta, zero_o = _delta_inputs(do, out)

    def body():
        (kg, wk), (vg, wv) = _allgather(k, group, world), _allgather(v, group, world)
        _wait([wk, wv])
        kn, vn = _natural(kg, chunks, c), _natural(vg, chunks, c)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dkn = torch.zeros(kn.shape, dtype=torch.float32, device=kn.device)
        dvn = torch.zeros(vn.shape, dtype=torch.float32, device=vn.device)
        for a, x in enumerate(chunks[rank]):
            k0, k1, cz, win = _key_range(x, c, kn.shape[2], causal, window)
            dq_a, dk_a, dv_a = ops._backward(_rows(do, a * c, 0, c), neg_delta[:, :, a * c:(a + 1) * c],
                                             _rows(q, a * c, 0, c), kn[:, :, k0:k1], vn[:, :, k0:k1],
                                             _rows(zero_o, a * c, 0, c), lse[:, :, a * c:(a + 1) * c], cz, scale,
                                             window=win, grad_dtype=torch.float32)
            _rows(dq, a * c, 0, c).copy_(dq_a)
            dkn[:, :, k0:k1] += dk_a
            dvn[:, :, k0:k1] += dv_a
        # Back to rank order, then every rank keeps the sum of its own shard's slices.
        def reduce_home(full):
            ranked = torch.stack([torch.cat([full[:, :, i * c:(i + 1) * c] for i in ids], dim=2) for ids in chunks])
            if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter: all-reduce, keep this rank's part
                _wait([dist.all_reduce(ranked, group=group, async_op=True)])
                return ranked[rank]
            mine = torch.empty(ranked.shape[1:], dtype=torch.float32, device=ranked.device)
            _wait([dist.reduce_scatter(mine, list(ranked.unbind(0)), group=group, async_op=True)])
            return mine

        return dq, reduce_home(dkn).to(k.dtype), reduce_home(dvn).to(v.dtype)

    return _guarded("ring_attention (allgather backward)", group, rank, world, body)


def _head_groups(q, k, head_chunks):
    """(query-head slice, key/value-head slice) of each of the `head_chunks` groups, in order."""
    gq, gk = q.shape[1] // head_chunks, k.shape[1] // head_chunks
    return [(slice(j * gq, (j + 1) * gq), slice(j * gk, (j + 1) * gk)) for j in range(head_chunks)]


_STRATEGIES = ("ring", "allgather")


class _Ring(torch.autograd.Function):
    """The ring (or the all-gather), forward and backward, once per group of heads (`head_chunks` groups,
    one after another): each group's output and gradients are written into one full-size tensor."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, layout, head_chunks, window, strategy, docs):
        extra = () if docs is None else (docs,)
        fwd = _ring_forward if strategy == "ring" else _allgather_forward
        if head_chunks == 1:
            out, lse = fwd(q, k, v, causal, scale, group, layout, window, *extra)
        else:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            for hq, hk in _head_groups(q, k, head_chunks):
                out[:, hq], lse[:, hq] = fwd(q[:, hq], k[:, hk], v[:, hk], causal, scale, group, layout, window,
                                             *extra)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, group, layout, head_chunks, window, strategy, extra)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, group, layout, head_chunks, window, strategy, extra = ctx.args
        bwd = _ring_backward if strategy == "ring" else _allgather_backward
        do = do.contiguous()
        if head_chunks == 1:
            dq, dk, dv = bwd(do, q, k, v, out, lse, causal, scale, group, layout, window, *extra)
        else:
            dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
            for hq, hk in _head_groups(q, k, head_chunks):
                dq[:, hq], dk[:, hk], dv[:, hk] = bwd(do[:, hq], q[:, hq], k[:, hk], v[:, hk], out[:, hq],
                                                      lse[:, hq], causal, scale, group, layout, window, *extra)
        return dq, dk, dv, None, None, None, None, None, None, None, None


_FACTS = ("batch", "heads_q", "heads_kv", "seqlen_q_local", "seqlen_k_local", "head_dim", "dtype", "causal",
          "layout", "head_chunks", "softmax_scale", "return_lse", "window_left", "window_right", "strategy",
          "strides", "device", "documents")


# Host copies of cu_seqlens tensors, once per tensor and version (a copy from a GPU is a synchronisation).
_HOST_VALUES = PerTensor()


def _documents(cu_seqlens, total, world, per):
    """The global document lengths that `cu_seqlens` describes, checked against the shards."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 \
            or cu_seqlens.shape[0] < 2:
        raise TypeError("cu_seqlens must be a 1-D torch.int32 tensor of cumulative document lengths (flash-attn's "
                        f"varlen layout: 0, L0, L0 + L1, ..., N), got {cu_seqlens!r:.80}")
    cu = _HOST_VALUES.get(cu_seqlens, torch.Tensor.tolist)  # (the plan of the blocks depends on the lengths)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if cu[0] != 0 or min(lengths) < 0 or cu[-1] != total:
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the whole sequence's length "
                         f"{total} (W * N_local), got {cu}")
    bad = [i for i, length in enumerate(lengths) if length % (per * world)]
    if bad:
        raise ValueError(f"with cu_seqlens every document is split into {per * world} chunks: the length of "
                         f"document(s) {bad} ({[lengths[i] for i in bad]}) must be divisible by {per * world}")
    return tuple(lengths)


def _check(q, k, v, causal, softmax_scale, group, layout, return_lse, name, head_chunks=1, window=(-1, -1),
           strategy="ring", check=None, cu_seqlens=None):
    """Check this rank's inputs, then decide with the other ranks (`_agree`, once per problem unless
    `check` says otherwise): a rank whose inputs fail, or ranks whose inputs differ, make every rank raise
    before any transfer."""
    rank, world = _rank_world(group)
    error, facts, scale, docs = None, dict.fromkeys(_FACTS, -1), None, None
    try:
        if check is not None and not isinstance(check, bool):
            check = True
            raise TypeError(f"check must be True (agree on every call), False (never) or None (once per problem), "
                            f"got {check!r}")
        _check_layout(layout)
        if strategy not in _STRATEGIES:
            raise ValueError(f"strategy must be one of {_STRATEGIES}, got {strategy!r}")
        ops._check_bool("return_lse", return_lse)
        ops._check_bool("causal", causal)
        if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
            raise ValueError(f"head_chunks must be a positive int, got {head_chunks!r}")
        window, _ = _check_window_softcap(window, 0.0)  # its errors name `window`
        for n, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(f"{n} must be this rank's shard (batch, heads, seqlen_local, head_dim), got shape "
                                 f"{tuple(t.shape)}")
        if k.shape[1] % head_chunks:
            raise ValueError(f"head_chunks = {head_chunks} must divide the key/value heads ({k.shape[1]})")
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"{name} needs query and key shards of one length (self-attention over one sequence), "
                             f"got q {tuple(q.shape)} and k {tuple(k.shape)}")
        per = len(ring_chunks(world, layout)[rank])
        if q.shape[2] % per:
            raise ValueError(f"the local sequence length {q.shape[2]} must be divisible by {per} (chunks per rank in "
                             f"the {layout} layout)")
        scale = ops._check_inputs(q, k, v, causal, softmax_scale, name)
        if cu_seqlens is not None:
            if strategy != "ring":
                raise ValueError(f"cu_seqlens works with strategy='ring', got strategy={strategy!r}")
            if q.shape[0] != 1:
                raise ValueError(f"with cu_seqlens the documents are packed along the sequence: batch must be 1, got "
                                 f"q of shape {tuple(q.shape)}")
            docs = _documents(cu_seqlens, q.shape[2] * world, world, per)
        facts = dict(batch=q.shape[0], heads_q=q.shape[1], heads_kv=k.shape[1], seqlen_q_local=q.shape[2],
                     seqlen_k_local=k.shape[2], head_dim=q.shape[3], dtype=_dtype_code(q.dtype), causal=causal,
                     layout=_LAYOUTS.index(layout), head_chunks=head_chunks, softmax_scale=_float_code(scale),
                     return_lse=return_lse, window_left=window[0], window_right=window[1],
                     strategy=_STRATEGIES.index(strategy),
                     strides=zlib.crc32(repr((q.stride(), k.stride(), v.stride())).encode()),
                     device=zlib.crc32(q.device.type.encode()),
                     documents=-1 if docs is None else zlib.crc32(repr(docs).encode()))
    except (TypeError, ValueError) as e:
        error = e
    _decide(group, world, error, facts, check)
    return rank, world, scale, window, docs


def ring_attention(q, k, v, *, causal=False, softmax_scale=None, group=None, return_lse=False, layout="zigzag",
                   head_chunks=1, window=(-1, -1), strategy="ring", check=None, cu_seqlens=None):
    """Exact attention over a sequence sharded across the ranks of ``group`` (default: the world).

    Each rank passes its shard of q (B, H_q, N_local, d) and of k, v (B, H_kv, N_local, d) (fp16, bf16 or
    fp32, one dtype; H_q a multiple of H_kv), laid out as ``shard(..., layout=layout)`` makes them (N_local
    divisible by the chunks per rank: 2 for "zigzag", 1 for "contiguous"); returns its shard of the output
    (B, H_q, N_local, d) in q's dtype (and of the natural-log LSE, (B, H_q, N_local) float32, with
    ``return_lse``). Differentiable; ``causal`` masks by the tokens' global positions (the layout says
    which they are). Every rank must pass shards of one shape, dtype and layout: a rank that does not
    makes every rank raise ``ValueError``.

    ``window=(left, right)``: a sliding window over global positions (query i sees keys i - left to
    i + right; -1 unbounded; with ``causal``, right = 0). Blocks the window hides are not computed, and
    the ring stops after the last step any rank needs (``STATS`` counts what was skipped).

    ``strategy``: "ring" (default) passes K/V shards around the ring, overlapping each transfer with a
    step's compute; "allgather" (Llama 3's scheme) gathers every K/V shard once and runs each local
    query chunk against the keys it sees, then reduce-scatters dK/dV in the backward pass: cheap when
    K/V are small next to Q (grouped-query attention), and no partial results to merge.

    ``cu_seqlens`` (1-D int32, the same on every rank): documents packed along the sequence, flash-attn's
    varlen layout (cumulative lengths 0, L0, L0 + L1, ..., N), batch 1. Attention stays within each
    document, and each document is balanced on its own: it is cut into 2W chunks (zigzag; W when
    contiguous) and rank r holds chunks r and 2W - 1 - r of every document, in document order, as
    ``shard(x, cu_seqlens=...)`` makes them; every length must be divisible by 2W (W). The plan of the
    blocks depends on its values: they are copied to the host once per tensor (again only after an in-place
    change), so a model that passes the same ``cu_seqlens`` to every layer synchronises once.

    ``check``: the cross-rank agreement on the inputs (one all-gather and a host copy): None (default)
    runs it on the first call of each problem (shapes, strides, dtype, options, group) and skips it for
    the later calls of that problem; True on every call; False never (then mismatched inputs are not
    diagnosed). A rank that sees a problem for the first time while the others do not must pass True.

    ``head_chunks`` (default 1; must divide H_kv, and be the same on every rank) runs the ring once per
    group of H_kv / head_chunks key/value heads (and their query heads), one group after another, forward
    and backward. The result is the same; what changes is the memory a step needs beyond the saved
    inputs: the K/V shard in flight, the float32 dK/dV accumulators travelling round the ring and the
    float32 dQ, each 1 / head_chunks of the whole, for head_chunks times as many (smaller) transfers.
    A longer sequence then fits.

    An exception on one rank after the transfers started (out of memory, a kernel error) aborts the
    group; every rank raises ``RuntimeError`` naming the rank that failed.
    """
    rank, world, scale, window, docs = _check(q, k, v, causal, softmax_scale, group, layout, return_lse,
                                              "ring_attention", head_chunks, window, strategy, check, cu_seqlens)
    o, lse = _Ring.apply(q, k, v, causal, scale, group, layout, head_chunks, window, strategy, docs)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------------
# Ulysses (head-parallel) attention.
# ---------------------------------------------------------------------------------------------------
def _a2a_start(x, group, world, to_heads):
    """Start one asynchronous all-to-all: (B, H, N_local, D) sequence shard -> head shard (to_heads) or back.
    Returns (receive buffers, request)."""
    parts = [p.contiguous() for p in x.chunk(world, dim=1 if to_heads else 2)]
    got = [torch.empty_like(parts[0]) for _ in range(world)]
    return got, dist.all_to_all(got, parts, group=group, async_op=True)


def _a2a_all(xs, group, world, to_heads):
    """Every tensor of `xs` through its all-to-all; all are in flight together, then waited for."""
    started = [_a2a_start(x, group, world, to_heads) for x in xs]
    _wait([req for _, req in started])
    return [torch.cat(got, dim=2 if to_heads else 1) for got, _ in started]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, world, to_heads, *xs):
        ctx.args = (group, world, to_heads)
        out = tuple(_a2a_all(xs, group, world, to_heads))
        ctx.like = [(o.shape, o.dtype, o.device) for o in out]
        return out

    @staticmethod
    def backward(ctx, *gs):
        group, world, to_heads = ctx.args
        gs = [torch.zeros(s, dtype=d, device=dev) if g is None else g.contiguous()
              for g, (s, d, dev) in zip(gs, ctx.like)]
        return (None, None, None, *_a2a_all(gs, group, world, not to_heads))


def _order(layout, world, n_local):
    """Permutation from the gathered rank-order sequence to natural order, and back."""
    chunks = ring_chunks(world, layout)
    per = len(chunks[0])
    c = n_local // per
    ids = [i for r in range(world) for i in chunks[r]]  # chunk id at each gathered position
    to_natural = torch.cat([torch.arange(ids.index(i) * c, ids.index(i) * c + c) for i in range(len(ids))])
    return to_natural, torch.argsort(to_natural)


def ulysses_attention(q, k, v, *, causal=False, softmax_scale=None, group=None, return_lse=False, layout="zigzag",
                      check=None):
    """Head-parallel ("Ulysses") context parallelism; the result of ``ring_attention`` (this rank's shard of the
    output, and of the LSE with ``return_lse``) for the same shards.

    It takes fewer arguments than ``ring_attention`` (no ``window``, ``strategy``, ``head_chunks`` or
    ``cu_seqlens``): q (B, H_q, N_local, d), k, v (B, H_kv, N_local, d), this rank's shards as ``shard`` makes
    them, fp16, bf16 or fp32, one dtype; ``causal`` (default False); ``softmax_scale`` (default None:
    ``1 / sqrt(d)``); ``group`` (default None: the world); ``return_lse`` (default False); ``layout`` (default
    "zigzag", or "contiguous"); ``check`` (default None), each as ``ring_attention`` takes it.

    Asynchronous all-to-alls (q, k and v in flight together): sequence shards -> head shards (every rank
    then holds the whole sequence for H_q / W query heads and H_kv / W key/value heads), ordinary
    ``fa_lib.flash_attention``, and back; the LSE travels back only with ``return_lse=True``. Needs both
    head counts divisible by the world size; differentiable. ``check`` as in ``ring_attention``.
    """
    rank, world, scale, _, _ = _check(q, k, v, causal, softmax_scale, group, layout, return_lse,
                                      "ulysses_attention", check=check)
    if q.shape[1] % world or k.shape[1] % world:
        raise ValueError(f"ulysses_attention splits the heads across the {world} ranks: the query heads "
                         f"({q.shape[1]}) and key/value heads ({k.shape[1]}) must both be divisible by {world}; "
                         f"use ring_attention otherwise")
    to_natural, back = _order(layout, world, q.shape[2])
    to_natural, back = to_natural.to(q.device), back.to(q.device)
    qh, kh, vh = (t.index_select(2, to_natural) for t in _AllToAll.apply(group, world, True, q, k, v))
    o, lse = ops.flash_attention(qh, kh, vh, causal=causal, softmax_scale=scale, return_lse=True)
    if not return_lse:
        return _AllToAll.apply(group, world, False, o.index_select(2, back))[0]
    o, lse = _AllToAll.apply(group, world, False, o.index_select(2, back),
                             lse.detach()[..., None].index_select(2, back))
    return o, lse[..., 0]
