"""Does a warp-specialised split kernel stream a one-sequence decoding step faster than Triton's pipelined loop?

benchmarks/probes/probe_decode_tail.py found that no variant of the Triton split kernel reads the 67.1 MB of B = 1, 32/8 heads,
16k keys under the 19.6 us that 0.8 of the copy bandwidth allows, even with no merge at all (19.84 us at best). Its
conclusion: in Triton's code every key block waits for the previous block's softmax and products. This probe writes
the other schedule in Gluon, as `fa_lib.kernels_hopper._attn_fwd_ws` does for the forward: one program per (chunk,
cache head), a load warp that only issues TMA copies of K and V blocks into two rings, and two consumer warpgroups
that only compute, each over its own half of the chunk (the packed GQA rows of the cache head, padded to a 64-row
wgmma tile), each writing its own partial (o, LSE). Only the streaming is measured: there is no merge (the partials
are merged on the host for the check), so the times are lower bounds, to compare with the Triton kernel's without
its merge (`nomerge` rows, the probe_decode_tail kernel, in the same process).

Variants `ws:splits,block_n,stages`; timed per call in a CUDA graph of eight calls on eight caches, the least of
--rounds medians. N_q = 1 only (no causal mask is needed). Writes JSON to --out.

    python3 -m benchmarks.probes.probe_decode_ws --out $OUT/probe-decode-ws.json
"""
import argparse
import json
import sys
from pathlib import Path


import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma  # noqa: E402

from benchmarks import bench
from fa_lib import kernels_hopper as kh  # noqa: E402
# by name: a Gluon function that names a module of fa_lib (watched by fa_lib.plan) does not compile
from fa_lib.kernels_hopper import _key_blocks, _wgmma_layout  # noqa: E402

D = 128
ROWS_M = 64  # the wgmma tile's rows: the packed rows of one cache head, padded


@gluon.jit
def _ws_consumer(q_bufs, q_bar, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, O_part, LSE_part,
                 hk, pid_s, start_w, nb_w, n_k, qk_scale, H_Q,
                 WG: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                 STAGES: gl.constexpr):
    """One warpgroup: the online softmax of the 64-row tile over nb_w key blocks from key start_w, from ring WG;
    then its partial (o, LSE) for the first ROWS rows, as split 2 * pid_s + WG."""
    BLOCK_M: gl.constexpr = 64
    dtype: gl.constexpr = k_bufs.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    q2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    q = q_bufs.index(0)._reinterpret(dtype, [BLOCK_M, HEAD_DIM], q2d)
    rows = gl.arange(0, BLOCK_M, layout=row_s)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    n_rel = n_k - start_w  # keys of this range's sequence, counted from its start
    n_full = gl.maximum(gl.minimum(n_rel, nb_w * BLOCK_N), 0) // BLOCK_N
    mbarrier.wait(q_bar.index(0), 0)
    # the forward's pipelined key loop (fa_lib.kernels_hopper._key_blocks), over this warpgroup's ring
    m_i, l_i, acc = _key_blocks(q, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, m_i, l_i, acc, WG * STAGES,
                                nb_w, n_full, rows, n_rel, 0, qk_scale, False, BLOCK_N, HEAD_DIM, STAGES)
    empty = l_i == 0.0
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    row0 = (2 * pid_s + WG) * H_Q + hk * ROWS  # packed row r of cache head hk is query row hk * ROWS + r
    gl.store(LSE_part + row0 + rows, lse, mask=rows < ROWS)
    inv = gl.convert_layout(1.0 / gl.where(empty, 1.0, l_i), row_o)
    o = acc * gl.expand_dims(inv, 1)
    rows_o = gl.arange(0, BLOCK_M, layout=row_o)
    cols_o = gl.arange(0, HEAD_DIM, layout=col_o)
    ptrs = O_part + gl.expand_dims((row0 + rows_o).to(gl.int64) * HEAD_DIM, 1) + gl.expand_dims(cols_o, 0)
    gl.store(ptrs, o, mask=gl.expand_dims(rows_o < ROWS, 1))


@gluon.jit
def _ws_loader(q_desc, k_desc, v_desc, q_bufs, q_bar, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
               hk, q_row, lo, nb0, nb1, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the packed queries once, then each warpgroup's K and V blocks into its ring, alternately."""
    mbarrier.expect(q_bar.index(0), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [0, 0, q_row, 0], q_bar.index(0), q_bufs.index(0))
    for j in range(gl.maximum(nb0, nb1)):
        for w in gl.static_range(2):
            if w == 0:
                n_w = nb0
                start = lo + j * BLOCK_N
            else:
                n_w = nb1
                start = lo + (nb0 + j) * BLOCK_N
            if j < n_w:
                slot = w * STAGES + j % STAGES
                phase = (j // STAGES) & 1
                mbarrier.wait(k_empty.index(slot), phase ^ 1)
                mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [0, hk, start, 0], k_ready.index(slot), k_bufs.index(slot))
                mbarrier.wait(v_empty.index(slot), phase ^ 1)
                mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [0, hk, start, 0], v_ready.index(slot), v_bufs.index(slot))


@gluon.jit
def _dec_ws(q_desc, k_desc, v_desc, O_part, LSE_part, Lens, sm_scale, NUM_SPLITS, H_Q,
            ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
            CONSUMER_REGS: gl.constexpr):
    """Grid (NUM_SPLITS, H_KV), B = 1: chunk pid_s of cache head program_id(1)'s keys, cut as fa_lib cuts them,
    its first half of key blocks to warpgroup 0 and the rest to warpgroup 1."""
    pid_s = gl.program_id(0)
    hk = gl.program_id(1)
    n_k = gl.load(Lens)
    chunk = gl.cdiv(gl.cdiv(n_k, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = gl.minimum(pid_s * chunk, n_k)
    hi = gl.minimum(lo + chunk, n_k)
    nb = gl.cdiv(hi - lo, BLOCK_N)
    nb0 = gl.cdiv(nb, 2)
    nb1 = nb - nb0
    qk_scale = sm_scale * 1.4426950408889634
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [1] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar.index(0), count=1)
    for i in gl.static_range(2 * STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    FIRST: gl.constexpr = 0
    SECOND: gl.constexpr = 1
    gl.warp_specialize([
        (_ws_consumer, (q_bufs, q_bar, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, O_part, LSE_part,
                        hk, pid_s, lo, nb0, n_k, qk_scale, H_Q, FIRST, ROWS, BLOCK_N, HEAD_DIM, STAGES)),
        (_ws_consumer, (q_bufs, q_bar, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, O_part, LSE_part,
                        hk, pid_s, lo + nb0 * BLOCK_N, nb1, n_k, qk_scale, H_Q, SECOND, ROWS, BLOCK_N, HEAD_DIM,
                        STAGES)),
        (_ws_loader, (q_desc, k_desc, v_desc, q_bufs, q_bar, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                      hk, hk * ROWS, lo, nb0, nb1, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


def launch(q, k_cache, v_cache, lens, o_part, lse_part, splits, block_n, stages):
    """One step's split kernel: q (1, H_q, 1, D) bf16, caches (1, H_kv, N, D); o_part (2 * splits, H_q, 1, D) and
    lse_part (2 * splits, H_q, 1) float32 receive the partials."""
    h_q, h_kv = q.shape[1], k_cache.shape[1]
    rows = h_q // h_kv
    qv = q.view(1, 1, h_q, D)
    q_desc = kh._desc(qv, *kh._block(q.dtype, ROWS_M, D))
    k_desc = kh._desc(k_cache, *kh._block(k_cache.dtype, block_n, D))
    v_desc = kh._desc(v_cache, *kh._block(v_cache.dtype, block_n, D))
    _dec_ws[(splits, h_kv)](q_desc, k_desc, v_desc, o_part, lse_part, lens, D ** -0.5, splits, h_q,
                            ROWS=rows, BLOCK_N=block_n, HEAD_DIM=D, STAGES=stages,
                            CONSUMER_REGS=kh.CONSUMER_REGS, num_warps=kh.NUM_WARPS, maxnreg=kh.MAX_REGS)


def merge(o_part, lse_part):
    """The partials merged on the host side (torch): o (H_q, 1, D)."""
    lse = torch.logsumexp(lse_part, dim=0)
    w = torch.exp(lse_part - lse).nan_to_num(0.0)
    return (w[..., None] * o_part).sum(0)


def parse(spec):
    s, n, st = (int(x) for x in spec.split(":")[1].split(","))
    return dict(splits=s, block_n=n, stages=st)


def main():
    from benchmarks.probes import probe_decode_tail as tail

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=bench.DECODE_LAYERS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nks", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--variants", nargs="+", default=["ws:16,64,3", "ws:16,64,2", "ws:16,32,6", "ws:8,64,3"])
    args = ap.parse_args()
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    res = {"part": "probe-decode-ws", "environment": bench.environment(), "layers": args.layers,
           "convention": __doc__.split("\n\n")[0], "ceilings": bench.measure_ceilings(), "points": []}
    copy = res["ceilings"]["copy_TBps"]
    h_q, h_kv = 32, 8
    for nk in args.nks:
        nbytes = 2 * h_kv * nk * D * 2
        caches = [(torch.randn(1, h_kv, nk, D, device="cuda", dtype=torch.bfloat16),
                   torch.randn(1, h_kv, nk, D, device="cuda", dtype=torch.bfloat16)) for _ in range(args.layers)]
        q = torch.randn(1, h_q, 1, D, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((1,), nk, dtype=torch.int32, device="cuda")
        with torch.no_grad():
            gold = torch.nn.functional.scaled_dot_product_attention(
                q.float(), caches[0][0].float(), caches[0][1].float(), enable_gqa=True)[0]
        fns, parts = {}, {}
        for spec in args.variants:
            c = parse(spec)
            o_part = torch.empty(2 * c["splits"], h_q, 1, D, device="cuda", dtype=torch.float32)
            lse_part = torch.empty(2 * c["splits"], h_q, 1, device="cuda", dtype=torch.float32)
            parts[spec] = (o_part, lse_part)
            fns[spec] = [lambda kc=kc, vc=vc, o_part=o_part, lse_part=lse_part, c=c: launch(
                q, kc, vc, lens, o_part, lse_part, c["splits"], c["block_n"], c["stages"]) for kc, vc in caches]
        # the Triton split kernel of probe_decode_tail without its merge, and with it, in this process
        for name, tspec in (("triton_nomerge", "16,128,4,3,0,0,0,0,1"), ("triton_even", "16,128,4,3,1,0,0,0,1")):
            fns[name], out = tail.calls(tail.parse("x=" + tspec)[1], q, caches, lens)
            if name == "triton_even":
                parts[name] = out
        row = dict(b=1, hq=h_q, hkv=h_kv, nq=1, nk=nk, bytes=nbytes)

        def output(name, r):  # the partials merged on the host, or the Triton kernel's merged output
            if name not in parts:
                return None
            return merge(*parts[name]) if name.startswith("ws") else parts[name][0]

        tail.measure(row, fns, output, gold, args.rounds, copy)
        res["points"].append(row)
        Path(args.out).write_text(json.dumps(res, indent=1))
        tail.report(row, f"Nk {nk // 1024}k", copy)
        del caches, fns
        bench._free()


if __name__ == "__main__":
    main()
