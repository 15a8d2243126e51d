"""Context parallelism: attention over a sequence split across the ranks of a process group.

* ``ring_attention``: every rank keeps its shard of the queries; the K/V shards travel around the ring
  by point-to-point send/recv (the next shard is in flight while the current one is computed), and each
  step's partial ``(o, LSE)`` is merged in float32 with the exact merge of the book's chapter 2. The
  backward pass keeps dQ local and sends dK/dV around the ring with their K/V shard, back to the owner;
  every block's backward is independent because it reuses the global LSE and D = rowsum(dO * O).
* ``ulysses_attention``: the head-parallel alternative: an all-to-all turns sequence shards into head
  shards, each rank runs ordinary attention over the whole sequence for H / W heads, and a second
  all-to-all turns the result back.
* ``shard`` / ``unshard``: split a full sequence into the per-rank shards and back, "zigzag" (rank r
  holds chunks r and 2W - 1 - r, which balances the causal work) or "contiguous".

The per-block work runs on fa_lib's Triton kernels (``fa_lib.ops._forward`` / ``_backward``);
``fa_lib.reference.ring_attention`` is the NumPy mirror, with a ledger of every step.
"""
import numbers
import struct
import zlib

import torch
import torch.distributed as dist

from . import ops
from .reference import _chunk_pair, ring_chunks

__all__ = ["ring_attention", "ulysses_attention", "shard", "unshard"]

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
def shard(x, group=None, *, layout="zigzag", dim=2):
    """This rank's shard of the full sequence ``x`` (split along ``dim``, default 2 = the sequence axis of
    (B, H, N, D)): "zigzag" cuts N into 2W chunks and keeps chunks r and 2W - 1 - r; "contiguous" cuts it
    into W chunks and keeps chunk r. N must be divisible by 2W (zigzag) or W (contiguous)."""
    _check_layout(layout)
    dim = _check_dim("x", x, dim)
    rank, world = _rank_world(group)
    ids = ring_chunks(world, layout)[rank]
    n_chunks = world * len(ids)
    if x.shape[dim] % n_chunks:
        raise ValueError(f"x.shape[{dim}] = {x.shape[dim]} must be divisible by {n_chunks} ({layout} layout over "
                         f"{world} ranks)")
    pieces = x.chunk(n_chunks, dim=dim)
    return torch.cat([pieces[i] for i in ids], dim=dim).contiguous()


def unshard(x_local, group=None, *, layout="zigzag", dim=2):
    """The full sequence from every rank's shard (an all-gather, then the chunks put back in order). Every
    rank must pass a shard of one shape and dtype, as ``shard`` makes them; otherwise every rank raises."""
    rank, world = _rank_world(group)
    error, facts = None, dict.fromkeys(("shape_hash", "dtype", "dim", "layout"), -1)
    try:
        _check_layout(layout)
        dim = _check_dim("x_local", x_local, dim)
        per = len(ring_chunks(world, layout)[rank])
        if x_local.shape[dim] % per:
            raise ValueError(f"x_local.shape[{dim}] = {x_local.shape[dim]} must be divisible by {per} (chunks per "
                             f"rank in the {layout} layout)")
        facts = dict(shape_hash=zlib.crc32(repr(tuple(x_local.shape)).encode()), dtype=_dtype_code(x_local.dtype),
                     dim=dim, layout=_LAYOUTS.index(layout))
    except (TypeError, ValueError) as e:
        error = e
    _agree(group, world, error, facts)
    chunks = ring_chunks(world, layout)
    gathered = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(gathered, x_local.contiguous(), group=group)
    by_id = {}
    for r, g in enumerate(gathered):
        for i, piece in zip(chunks[r], g.chunk(len(chunks[r]), dim=dim)):
            by_id[i] = piece
    return torch.cat([by_id[i] for i in sorted(by_id)], dim=dim)


# ---------------------------------------------------------------------------------------------------
# Ring attention.
# ---------------------------------------------------------------------------------------------------
def _merge(o, lse, o_b, lse_b):
    """Merge two normalised partial states in float32: LSE = log(e^lse + e^lse_b), o weighted accordingly.
    A state with LSE = -inf (no key seen) is the identity."""
    m = torch.maximum(lse, lse_b)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    a, b = torch.exp(lse - m_safe), torch.exp(lse_b - m_safe)
    total = a + b
    seen = total > 0
    denom = torch.where(seen, total, torch.ones_like(total))
    o = (o * a[..., None] + o_b.float() * b[..., None]) / denom[..., None]
    lse = torch.where(seen, m_safe + torch.log(denom), torch.full_like(m, float("-inf")))
    return o, lse


def _pairs(chunks, rank, src, causal):
    """The (query chunk index a, key chunk index b, diagonal?) pairs rank `rank` computes against the K/V
    shard that started on rank `src`; pairs a causal mask hides entirely are left out."""
    for a, x in enumerate(chunks[rank]):
        for b, y in enumerate(chunks[src]):
            kind = _chunk_pair(x, y, causal)
            if kind != "none":
                yield a, b, kind == "diagonal"


def _exchange(tensors, rank, world, group):
    """Send `tensors` (one packed buffer) to rank + 1 and receive the same shapes from rank - 1; returns the
    pending requests and the receive buffer."""
    send = torch.cat([t.reshape(-1) for t in tensors]).contiguous()
    recv = torch.empty_like(send)
    nxt = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    prv = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    ops_ = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
    return dist.batch_isend_irecv(ops_), recv


def _finish(pending, like):
    """Wait for an `_exchange` and return the received tensors, shaped like `like`."""
    reqs, buf = pending
    for req in reqs:
        req.wait()
    return _unpack(buf, like)


def _unpack(buf, like):
    out, start = [], 0
    for t in like:
        out.append(buf[start:start + t.numel()].view(t.shape))
        start += t.numel()
    return out


def _ring_forward(q, k, v, causal, scale, group, layout):
    """One pass of the ring for q (B, H_q, N_local, d) and k, v (B, H_kv, N_local, d): this rank's
    (o, LSE), o in q's dtype, LSE float32."""
    rank, world = _rank_world(group)
    chunks = ring_chunks(world, layout)
    per = len(chunks[0])
    c = q.shape[2] // per
    qs = [q[:, :, a * c:(a + 1) * c] for a in range(per)]
    o = [torch.zeros(*qx.shape, dtype=torch.float32, device=q.device) for qx in qs]
    lse = [torch.full(qx.shape[:3], float("-inf"), dtype=torch.float32, device=q.device) for qx in qs]
    k_cur, v_cur = k.contiguous(), v.contiguous()
    for step in range(world):
        src = (rank - step) % world
        pending = _exchange([k_cur, v_cur], rank, world, group) if step < world - 1 else None
        for a, b, diagonal in _pairs(chunks, rank, src, causal):
            # float32 partials: each block's output is merged unrounded (one rounding, at the end)
            o_p, lse_p = ops._forward(qs[a], k_cur[:, :, b * c:(b + 1) * c], v_cur[:, :, b * c:(b + 1) * c],
                                      diagonal, scale, out_dtype=torch.float32)
            o[a], lse[a] = _merge(o[a], lse[a], o_p, lse_p)
        if pending is not None:
            k_cur, v_cur = _finish(pending, [k_cur, v_cur])
    return torch.cat(o, dim=2).to(q.dtype), torch.cat(lse, dim=2)


def _ring_backward(do, q, k, v, out, lse, causal, scale, group, layout):
    """The backward of one `_ring_forward` pass: (dq, dk, dv) in the inputs' dtypes."""
    rank, world = _rank_world(group)
    chunks = ring_chunks(world, layout)
    per = len(chunks[0])
    c = q.shape[2] // per
    sl = lambda t, a: t[:, :, a * c:(a + 1) * c]  # noqa: E731
    do = do.contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    # The dK/dV accumulators of the shard this rank holds; they travel with the shard, one rank on per step.
    dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    pending_acc = None
    for step in range(world):
        src = (rank - step) % world
        # The next K/V shard is in flight while this one is computed (as in the forward pass).
        pending = _exchange([k_cur, v_cur], rank, world, group) if step < world - 1 else None
        parts = []
        for a, b, diagonal in _pairs(chunks, rank, src, causal):
            # The global LSE and o (hence D = rowsum(dO * o)) make this block's backward independent;
            # ops._backward makes the LSE slice contiguous itself.
            dq_p, dk_p, dv_p = ops._backward(sl(do, a), None, sl(q, a), sl(k_cur, b), sl(v_cur, b),
                                             sl(out, a), lse[:, :, a * c:(a + 1) * c], diagonal, scale,
                                             grad_dtype=torch.float32)  # summed unrounded
            dq[:, :, a * c:(a + 1) * c] += dq_p
            parts.append((b, dk_p, dv_p))
        # This shard's accumulators were sent by rank - 1 at the end of its previous step: that transfer
        # ran under the computation above. Add this rank's part and pass them on, without waiting; the
        # W-th pass brings them home to the shard's owner.
        if pending_acc is not None:
            dk_acc, dv_acc = _finish(pending_acc, [dk_acc, dv_acc])
        for b, dk_p, dv_p in parts:
            dk_acc[:, :, b * c:(b + 1) * c] += dk_p
            dv_acc[:, :, b * c:(b + 1) * c] += dv_p
        if world > 1:
            pending_acc = _exchange([dk_acc, dv_acc], rank, world, group)
        if pending is not None:
            k_cur, v_cur = _finish(pending, [k_cur, v_cur])
    if pending_acc is not None:
        dk_acc, dv_acc = _finish(pending_acc, [dk_acc, dv_acc])
    return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


def _head_groups(q, k, head_chunks):
    """(query-head slice, key/value-head slice) of each of the `head_chunks` groups, in order."""
    gq, gk = q.shape[1] // head_chunks, k.shape[1] // head_chunks
    return [(slice(j * gq, (j + 1) * gq), slice(j * gk, (j + 1) * gk)) for j in range(head_chunks)]


class _Ring(torch.autograd.Function):
    """The ring, forward and backward, once per group of heads (`head_chunks` groups, one after another):
    each group's output and gradients are written into one full-size tensor allocated once."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, layout, head_chunks):
        if head_chunks == 1:
            out, lse = _ring_forward(q, k, v, causal, scale, group, layout)
        else:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            for hq, hk in _head_groups(q, k, head_chunks):
                out[:, hq], lse[:, hq] = _ring_forward(q[:, hq], k[:, hk], v[:, hk], causal, scale, group, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, group, layout, head_chunks)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, group, layout, head_chunks = ctx.args
        do = do.contiguous()
        if head_chunks == 1:
            dq, dk, dv = _ring_backward(do, q, k, v, out, lse, causal, scale, group, layout)
        else:
            dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
            for hq, hk in _head_groups(q, k, head_chunks):
                dq[:, hq], dk[:, hk], dv[:, hk] = _ring_backward(do[:, hq], q[:, hq], k[:, hk], v[:, hk],
                                                                 out[:, hq], lse[:, hq], causal, scale, group,
                                                                 layout)
        return dq, dk, dv, None, None, None, None, None


_FACTS = ("batch", "heads_q", "heads_kv", "seqlen_q_local", "seqlen_k_local", "head_dim", "dtype", "causal",
          "layout", "head_chunks", "softmax_scale", "return_lse")


def _check(q, k, v, causal, softmax_scale, group, layout, return_lse, name, head_chunks=1):
    """Check this rank's inputs, then decide with the other ranks (`_agree`): a rank whose inputs fail, or
    ranks whose inputs differ, make every rank raise before any transfer."""
    rank, world = _rank_world(group)
    error, facts, scale = None, dict.fromkeys(_FACTS, -1), None
    try:
        _check_layout(layout)
        ops._check_bool("return_lse", return_lse)
        ops._check_bool("causal", causal)
        if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
            raise ValueError(f"head_chunks must be a positive int, got {head_chunks!r}")
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
        scale = ops._check_inputs(q, k, v, causal, softmax_scale)
        facts = dict(batch=q.shape[0], heads_q=q.shape[1], heads_kv=k.shape[1], seqlen_q_local=q.shape[2],
                     seqlen_k_local=k.shape[2], head_dim=q.shape[3], dtype=_dtype_code(q.dtype), causal=causal,
                     layout=_LAYOUTS.index(layout), head_chunks=head_chunks, softmax_scale=_float_code(scale),
                     return_lse=return_lse)
    except (TypeError, ValueError) as e:
        error = e
    _agree(group, world, error, facts)
    return rank, world, scale


def ring_attention(q, k, v, *, causal=False, softmax_scale=None, group=None, return_lse=False, layout="zigzag",
                   head_chunks=1):
    """Exact attention over a sequence sharded across the ranks of ``group`` (default: the world).

    Each rank passes its shard of q (B, H_q, N_local, d) and of k, v (B, H_kv, N_local, d) (fp16, bf16 or
    fp32, one dtype; H_q a multiple of H_kv), laid out as ``shard(..., layout=layout)`` makes them (N_local
    divisible by the chunks per rank: 2 for "zigzag", 1 for "contiguous"); returns its shard of the output
    (B, H_q, N_local, d) in q's dtype (and of the natural-log LSE, (B, H_q, N_local) float32, with
    ``return_lse``). Differentiable; ``causal`` masks by the tokens' global positions (the layout says
    which they are). Every rank must pass shards of one shape, dtype and layout: a rank that does not
    makes every rank raise ``ValueError``.

    ``head_chunks`` (default 1; must divide H_kv, and be the same on every rank) runs the ring once per
    group of H_kv / head_chunks key/value heads (and their query heads), one group after another, forward
    and backward. The result is the same; what changes is the memory a step needs beyond the saved
    inputs: the K/V shard in flight, the float32 dK/dV accumulators travelling round the ring and the
    float32 dQ, each 1 / head_chunks of the whole, for head_chunks times as many (smaller) transfers.
    A longer sequence then fits.
    """
    rank, world, scale = _check(q, k, v, causal, softmax_scale, group, layout, return_lse, "ring_attention",
                                head_chunks)
    o, lse = _Ring.apply(q, k, v, causal, scale, group, layout, head_chunks)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------------
# Ulysses (head-parallel) attention.
# ---------------------------------------------------------------------------------------------------
def _seq_to_heads(x, group, world):
    """(B, H, N_local, D) sequence shard -> (B, H / W, N, D) head shard (chunks still in rank order)."""
    parts = list(x.chunk(world, dim=1))  # head groups, one per destination rank
    got = [torch.empty_like(parts[0]) for _ in range(world)]
    dist.all_to_all(got, [p.contiguous() for p in parts], group=group)
    return torch.cat(got, dim=2)  # sequence shards of every rank, in rank order


def _heads_to_seq(x, group, world):
    parts = list(x.chunk(world, dim=2))  # sequence shards, one per destination rank
    got = [torch.empty_like(parts[0]) for _ in range(world)]
    dist.all_to_all(got, [p.contiguous() for p in parts], group=group)
    return torch.cat(got, dim=1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, world, to_heads):
        ctx.args = (group, world, to_heads)
        return _seq_to_heads(x, group, world) if to_heads else _heads_to_seq(x, group, world)

    @staticmethod
    def backward(ctx, g):
        group, world, to_heads = ctx.args
        g = g.contiguous()
        return (_heads_to_seq(g, group, world) if to_heads else _seq_to_heads(g, group, world)), None, None, None


def _order(layout, world, n_local):
    """Permutation from the gathered rank-order sequence to natural order, and back."""
    chunks = ring_chunks(world, layout)
    per = len(chunks[0])
    c = n_local // per
    ids = [i for r in range(world) for i in chunks[r]]  # chunk id at each gathered position
    to_natural = torch.cat([torch.arange(ids.index(i) * c, ids.index(i) * c + c) for i in range(len(ids))])
    return to_natural, torch.argsort(to_natural)


def ulysses_attention(q, k, v, *, causal=False, softmax_scale=None, group=None, return_lse=False, layout="zigzag"):
    """Head-parallel ("Ulysses") context parallelism; same arguments and result as ``ring_attention``.

    Two all-to-alls: sequence shards -> head shards (every rank then holds the whole sequence for
    H_q / W query heads and H_kv / W key/value heads), ordinary ``fa_lib.flash_attention``, and back.
    Needs both head counts divisible by the world size; differentiable.
    """
    rank, world, scale = _check(q, k, v, causal, softmax_scale, group, layout, return_lse, "ulysses_attention")
    if q.shape[1] % world or k.shape[1] % world:
        raise ValueError(f"ulysses_attention splits the heads across the {world} ranks: the query heads "
                         f"({q.shape[1]}) and key/value heads ({k.shape[1]}) must both be divisible by {world}; "
                         f"use ring_attention otherwise")
    to_natural, back = _order(layout, world, q.shape[2])
    to_natural, back = to_natural.to(q.device), back.to(q.device)
    qh, kh, vh = (_AllToAll.apply(t, group, world, True).index_select(2, to_natural) for t in (q, k, v))
    o, lse = ops.flash_attention(qh, kh, vh, causal=causal, softmax_scale=scale, return_lse=True)
    o = _AllToAll.apply(o.index_select(2, back), group, world, False)
    lse = _AllToAll.apply(lse.detach()[..., None].index_select(2, back), group, world, False)[..., 0]
    return (o, lse) if return_lse else o
