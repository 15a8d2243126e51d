"""Where the fixed cost of a one-sequence decoding step goes, and what a split kernel can do about it.

Issue 12's bandwidth target fails at one sequence (B = 1, 32/8 heads, d = 128, bf16, N_k = 16k): fa_lib's step takes
22.8 us per call in a graph of eight for 67.1 MB, 0.8 of the copy bandwidth allows 19.6 us. Fitted over 16k-128k keys
its time is about 7.8 us plus streaming at 4.5 TB/s; the fastest kernel that only reads the bytes
(benchmarks/probes/probe_read_ceiling.py) is 4.0 us plus 4.6 TB/s. This probe times a self-contained copy of the split kernel
(GQA rows packed into one tile, chunks of whole key blocks, the last program of a head merges, as
`fa_lib.kernels._decode_split` does) with parts switched off or done another way, next to fa_lib's step:

  merge 1: the last program to count itself merges (fa_lib's protocol); 0: partials stored, no merge (a lower
    bound, the output is not written); 2: split 0 is the merger and waits for the others' counts (they only add,
    release); 3: no partial stored at all (a lower bound).
  static: chunks cut from N_max instead of the sequence's length (no load before the first key block's address).
  masked: every block masked against the chunk's end (fa_lib's loop); else only whole blocks (the probe's chunks are).
  desc: key and value blocks loaded through TMA descriptors instead of pointers.
  pdl: programmatic dependent launch (fa_lib with a workspace uses it).
  pre: this chunk's first `pre` key and value blocks prefetched into L2 (cp.async.bulk.prefetch.L2) before the wait.
  ahead: the blocks `ahead` blocks ahead prefetched into L2 in the loop.
  merge 4: as 1, the merge taking every split's LSE first, then the outputs split by split.
  bm: the query tile's rows (0: the packed rows rounded up to a power of two, at least 16; 64 makes Triton use
    wgmma).

Each variant is `name=splits,block_n,warps,stages,merge,static,masked,desc,pdl[,pre,ahead,bm]`; timed per call in a CUDA
graph of eight calls on eight caches (as `bench --decode`'s layered time), the least of --rounds medians, and checked
against SDPA (float32) where it writes the output. Writes JSON to --out.

    python3 -m benchmarks.probes.probe_decode_tail --out $OUT/probe-decode-tail.json --set first
    python3 -m benchmarks.probes.probe_decode_tail --out $OUT/probe-decode-prefetch.json
    python3 -m benchmarks.probes.probe_decode_tail --out $OUT/probe-decode-warps.json --points 1,16384,8 4,16384,8 1,65536,8 \
        --variants base=16,128,4,3,1,0,1,0,1 ... (the list in that file's command)
    python3 -m benchmarks.probes.probe_decode_tail --out $OUT/probe-decode-shapes.json --points 1,16384,8 1,65536,8 \
        --variants base=16,128,4,3,1,0,1,0,1 ... (the list in that file's command)
"""
import argparse
import json
import sys
from pathlib import Path


import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

from benchmarks import bench
from fa_lib import decode  # noqa: E402

D = 128
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _prefetch_l2(ptr, nbytes):
    """One thread of the program asks the TMA unit to bring `nbytes` (a multiple of 16) from `ptr` into L2: a hint,
    safe before `gdc_wait` since L2 is where the previous kernel's writes land."""
    tl.inline_asm_elementwise(
        "{ .reg .u32 t; .reg .pred p; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _dec(Q, K, V, Lens, O_part, LSE_part, Out, Arrived, N_MAX, sm_scale, NUM_SPLITS,
         H_KV: tl.constexpr, GROUP: tl.constexpr, NQ: tl.constexpr, D: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, RC: tl.constexpr,
         MERGE: tl.constexpr, STATIC: tl.constexpr, MASKED: tl.constexpr, DESC: tl.constexpr, PDL: tl.constexpr,
         PRE: tl.constexpr = 0, AHEAD: tl.constexpr = 0):
    pid_s = tl.program_id(0)
    hk = tl.program_id(1)
    BLOCK_BYTES: tl.constexpr = BLOCK_N * D * 2
    if PRE > 0:  # before the wait: this chunk's first PRE key and value blocks into L2, by a length maybe stale
        n_pre = tl.load(Lens, cache_modifier=".cg")
        chunk_pre = tl.cdiv(tl.cdiv(n_pre, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo_pre = tl.minimum(pid_s * chunk_pre, N_MAX)
        for j in tl.static_range(PRE):
            start_pre = lo_pre + j * BLOCK_N
            if start_pre + BLOCK_N <= N_MAX:
                _prefetch_l2(K + (hk.to(tl.int64) * N_MAX + start_pre) * D, BLOCK_BYTES)
                _prefetch_l2(V + (hk.to(tl.int64) * N_MAX + start_pre) * D, BLOCK_BYTES)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    H_Q: tl.constexpr = H_KV * GROUP
    rows = tl.arange(0, BLOCK_M)
    g = rows // NQ
    i = rows % NQ
    row_ok = rows < GROUP * NQ
    h = hk * GROUP + g
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + (h * NQ + i)[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if STATIC:
        n_k = N_MAX
    else:
        n_k = tl.load(Lens)
    chunk = tl.cdiv(tl.cdiv(n_k, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = tl.minimum(pid_s * chunk, n_k)
    hi = tl.minimum(lo + chunk, n_k)
    K_head = K + hk.to(tl.int64) * N_MAX * D
    V_head = V + hk.to(tl.int64) * N_MAX * D
    if DESC:
        k_desc = tl.make_tensor_descriptor(K, shape=[H_KV * N_MAX, D], strides=[D, 1], block_shape=[BLOCK_N, D])
        v_desc = tl.make_tensor_descriptor(V, shape=[H_KV * N_MAX, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    qk_scale = sm_scale * LOG2E
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        cols = start + offs_n
        if AHEAD > 0:
            ahead = start + AHEAD * BLOCK_N
            if ahead + BLOCK_N <= hi:
                _prefetch_l2(K_head + ahead * D, BLOCK_BYTES)
                _prefetch_l2(V_head + ahead * D, BLOCK_BYTES)
        if DESC:
            kT = tl.trans(k_desc.load([hk * N_MAX + start, 0]))
        elif MASKED:
            kT = tl.load(K_head + cols[None, :] * D + offs_d[:, None], mask=cols[None, :] < hi, other=0.0)
        else:
            kT = tl.load(K_head + cols[None, :] * D + offs_d[:, None])
        qk = tl.dot(q, kT)
        if MASKED:
            qk = tl.where(cols[None, :] < hi, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            qk -= m_ij[:, None]
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_ij[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DESC:
            v = v_desc.load([hk * N_MAX + start, 0])
        elif MASKED:
            v = tl.load(V_head + cols[:, None] * D + offs_d[None, :], mask=cols[:, None] < hi, other=0.0)
        else:
            v = tl.load(V_head + cols[:, None] * D + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) / LOG2E)
    prow = (pid_s * H_Q + h) * NQ + i
    if MERGE == 3:  # nothing stored unless impossible: keeps the loop alive
        tl.store(LSE_part + prow, tl.sum(o, 1) + lse, mask=row_ok & (lse == 12345.0))
    else:
        tl.store(LSE_part + prow, lse, mask=row_ok)
        tl.store(O_part + prow[:, None] * D + offs_d[None, :], o, mask=row_ok[:, None])
    last = pid_s < 0
    if MERGE == 1 or MERGE == 4:
        tl.debug_barrier()
        last = tl.atomic_add(Arrived + hk, 1, sem="acq_rel") == NUM_SPLITS - 1
        if last:
            tl.store(Arrived + hk, 0)
    if MERGE == 2:
        tl.debug_barrier()
        if pid_s == 0:
            seen = tl.atomic_add(Arrived + hk, 0, sem="acquire")
            while seen < NUM_SPLITS - 1:
                seen = tl.atomic_add(Arrived + hk, 0, sem="acquire")
            tl.store(Arrived + hk, 0)
        else:
            tl.atomic_add(Arrived + hk, 1, sem="release")
        last = pid_s == 0
    if last:
        if MERGE == 4:
            _merge_by_split(O_part, LSE_part, Out, hk, NUM_SPLITS, H_Q, GROUP, NQ, D, BLOCK_M, BLOCK_S)
        else:
            _merge(O_part, LSE_part, Out, hk, NUM_SPLITS, H_Q, GROUP, NQ, D, BLOCK_S, RC)


@triton.jit
def _merge_by_split(O_part, LSE_part, Out, hk, NUM_SPLITS, H_Q: tl.constexpr, GROUP: tl.constexpr,
                    NQ: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """The merge in two phases: every split's LSE of every row at once, then the outputs split by split
    (a (BLOCK_M, D) tile each, all loads independent of the sums), o = sum_s exp(LSE_s - LSE) o_s."""
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * NQ
    g = rows // NQ
    i = rows % NQ
    h = hk * GROUP + g
    offs_d = tl.arange(0, D)
    offs_s = tl.arange(0, BLOCK_S)
    pr = (offs_s[None, :] * H_Q + h[:, None]) * NQ + i[:, None]  # (BLOCK_M, BLOCK_S)
    lse_s = tl.load(LSE_part + pr, mask=row_ok[:, None] & (offs_s[None, :] < NUM_SPLITS), other=float("-inf"),
                    cache_modifier=".cg")
    m = tl.max(lse_s, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    lsum = tl.sum(tl.exp(lse_s - m_safe[:, None]), axis=1)
    lse = m_safe + tl.log(tl.where(lsum == 0.0, 1.0, lsum))
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    row0 = h * NQ + i
    for s in tl.static_range(BLOCK_S):
        if s < NUM_SPLITS:
            ls = tl.load(LSE_part + s * H_Q * NQ + row0, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
            o_s = tl.load(O_part + (s * H_Q * NQ + row0)[:, None] * D + offs_d[None, :], mask=row_ok[:, None],
                          other=0.0, cache_modifier=".cg")
            acc += tl.exp(ls - lse)[:, None] * o_s
    tl.store(Out + row0[:, None] * D + offs_d[None, :], acc.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge(O_part, LSE_part, Out, hk, NUM_SPLITS, H_Q: tl.constexpr, GROUP: tl.constexpr, NQ: tl.constexpr,
           D: tl.constexpr, BLOCK_S: tl.constexpr, RC: tl.constexpr):
    """The merge the probe's variants were timed with: `fa_lib.kernels._merge_tile`'s combine for B = 1, with its
    row chunks unrolled and without the merged LSE's store (kept as timed: the committed files stay reproducible)."""
    ROWS: tl.constexpr = GROUP * NQ
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    s_ok = offs_s < NUM_SPLITS
    for r0 in tl.static_range(0, ROWS, RC):
        rows = r0 + tl.arange(0, RC)
        row_ok = rows < ROWS
        g = rows // NQ
        i = rows % NQ
        h = hk * GROUP + g
        pr = (offs_s[None, :] * H_Q + h[:, None]) * NQ + i[:, None]  # (RC, BLOCK_S)
        ok = row_ok[:, None] & s_ok[None, :]
        lse_s = tl.load(LSE_part + pr, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o_s = tl.load(O_part + pr[:, :, None] * D + offs_d[None, None, :], mask=ok[:, :, None], other=0.0,
                      cache_modifier=".cg")
        m = tl.max(lse_s, axis=1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse_s - m_safe[:, None])
        lsum = tl.sum(w, axis=1)
        res = tl.sum(w[:, :, None] * o_s, axis=1) / tl.where(lsum == 0.0, 1.0, lsum)[:, None]
        tl.store(Out + (h * NQ + i)[:, None] * D + offs_d[None, :], res.to(Out.dtype.element_ty),
                 mask=row_ok[:, None])


def calls(c, q, caches, lens):
    """The calls of variant `c` (a `parse` dict) over each of `caches` ((k, v) pairs, (1, H_kv, N, D)) for the
    queries q (1, H_q, N_q, D) and lengths `lens`, with their buffers, and the output (q's shape) they write."""
    h_q, n_q, h_kv, n_k, s = q.shape[1], q.shape[2], caches[0][0].shape[1], caches[0][0].shape[2], c["splits"]
    o_part = torch.empty(s, h_q, n_q, D, device="cuda", dtype=torch.float32)
    lse_part = torch.empty(s, h_q, n_q, device="cuda", dtype=torch.float32)
    out = torch.zeros_like(q)
    arrived = torch.zeros(h_kv, dtype=torch.int32, device="cuda")
    kw = constexprs(c, h_kv, h_q // h_kv, n_q)
    if c["pdl"]:
        kw["launch_pdl"] = True
    return [lambda kc=kc, vc=vc: _dec[(s, h_kv)](q, kc, vc, lens, o_part, lse_part, out, arrived, n_k, D ** -0.5,
                                                 s, **kw) for kc, vc in caches], out


def measure(row, fns, output, gold, rounds, copy):
    """Call each of `fns` (name -> the calls of one graph, one per cache) once and compare `output(name, result)`
    (None: nothing to compare) with `gold` (a variant off by more than 2e-2 is recorded as an error and not timed),
    then time the rest per call in a graph of all of them, the least of `rounds` medians; fills row's times, errors,
    maxdiff, best_us and fraction (of `copy` TB/s, for row["bytes"])."""
    row.update(times={}, errors={}, maxdiff={})
    with torch.no_grad():
        for name, f in fns.items():
            try:
                got = output(name, f[0]())
                torch.cuda.synchronize()
                if got is not None:
                    row["maxdiff"][name] = float((got.float() - gold).abs().max())
                    if not row["maxdiff"][name] <= 2e-2:
                        raise AssertionError(f"maxdiff {row['maxdiff'][name]}")
                row["times"][name] = []
            except Exception as e:
                row["errors"][name] = f"{type(e).__name__}: {str(e)[-600:]}"
                print(name, row["errors"][name], flush=True)
        for _ in range(rounds):
            for name in row["times"]:
                f = fns[name]
                row["times"][name].append(bench._graph_ms(lambda f=f: [g() for g in f]) / len(f))
    row["best_us"] = {n: min(t) * 1e3 for n, t in row["times"].items()}
    row["fraction"] = {n: row["bytes"] / (t * 1e-6) / 1e12 / copy for n, t in row["best_us"].items()}


def report(row, title, copy):
    """Print a point's variants, fastest first, with the time 0.8 of the copy bandwidth allows."""
    allowed = row["bytes"] / (0.8 * copy * 1e12) * 1e6
    print(f"{title} {row['bytes'] / 1e6:.1f} MB; 0.8 needs {allowed:.1f} us", flush=True)
    for n in sorted(row["best_us"], key=row["best_us"].get):
        print(f"   {n:16s} {row['best_us'][n]:7.2f} us  {row['fraction'][n]:.3f}  diff "
              f"{row['maxdiff'].get(n, float('nan')):.2e}", flush=True)


def rows_c(rows, splits):
    """Rows the merge takes per load: all of them, or as many as keep the tile at 8192 float32 entries."""
    return max(1, min(triton.next_power_of_2(rows), 8192 // (triton.next_power_of_2(splits) * D)))


def constexprs(c, h_kv, group, nq):
    """The launch's keyword arguments of variant `c` (a `parse` dict) at this point."""
    s = c["splits"]
    return dict(H_KV=h_kv, GROUP=group, NQ=nq, D=D, BLOCK_M=c["bm"] or max(16, triton.next_power_of_2(group * nq)),
                BLOCK_N=c["block_n"], BLOCK_S=triton.next_power_of_2(s), RC=rows_c(group * nq, s), MERGE=c["merge"],
                STATIC=c["static"], MASKED=c["masked"], DESC=c["desc"], PDL=c["pdl"], PRE=c["pre"], AHEAD=c["ahead"],
                num_warps=c["warps"], num_stages=c["stages"])


def _allocator(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


FIELDS = ("splits", "block_n", "warps", "stages", "merge", "static", "masked", "desc", "pdl", "pre", "ahead", "bm")


def parse(spec):
    name, vals = spec.split("=")
    cfg = dict(zip(FIELDS, (int(x) for x in vals.split(","))))
    return name, {f: cfg.get(f, 0) for f in FIELDS}


# the second call: L2 prefetches (`pre` blocks before the wait, `ahead` blocks ahead in the loop), the merge by splits
PREFETCH_VARIANTS = {
    1: ["base=16,128,4,3,1,0,1,0,1", "even=16,128,4,3,1,0,0,0,1", "pre1=16,128,4,3,1,0,0,0,1,1,0",
        "pre2=16,128,4,3,1,0,0,0,1,2,0", "pre4=16,128,4,3,1,0,0,0,1,4,0", "ahead2=16,128,4,3,1,0,0,0,1,0,2",
        "ahead4=16,128,4,3,1,0,0,0,1,0,4", "pre2ahead2=16,128,4,3,1,0,0,0,1,2,2",
        "pre2nomerge=16,128,4,3,0,0,0,0,1,2,0", "pre2m4=16,128,4,3,4,0,0,0,1,2,0",
        "n64s4pre4=16,64,4,4,1,0,0,0,1,4,0", "n64s4pre4ahead4=16,64,4,4,1,0,0,0,1,4,4",
        "s32n64pre2=32,64,4,3,1,0,0,0,1,2,0", "s32n64nomerge=32,64,4,3,0,0,0,0,1,0,0"],
    4: ["base=16,128,4,3,1,0,1,0,1", "m4=16,128,4,3,4,0,0,0,1", "pre2=16,128,4,3,1,0,0,0,1,2,0",
        "pre2m4=16,128,4,3,4,0,0,0,1,2,0", "pre2m4ahead2=16,128,4,3,4,0,0,0,1,2,2", "nomerge=16,128,4,3,0,0,0,0,1"],
    16: ["m4=16,64,4,3,4,0,0,0,1", "m4pre2=16,64,4,3,4,0,0,0,1,2,0", "m4pre4=16,64,4,3,4,0,0,0,1,4,0",
         "nomerge=16,64,4,3,0,0,0,0,1"],
    "mha": ["base=4,128,4,3,1,0,1,0,1", "even=4,128,4,3,1,0,0,0,1", "pre2=4,128,4,3,1,0,0,0,1,2,0",
            "ahead2=4,128,4,3,1,0,0,0,1,0,2", "ahead4=4,128,4,3,1,0,0,0,1,0,4", "pre2ahead2=4,128,4,3,1,0,0,0,1,2,2",
            "desc64s4=4,64,4,4,1,0,0,1,1"],
}

# the first call
DEFAULT_VARIANTS = {
    1: ["base=16,128,4,3,1,0,1,0,1", "even=16,128,4,3,1,0,0,0,1", "static=16,128,4,3,1,1,1,0,1",
        "nomerge=16,128,4,3,0,0,1,0,1", "nostore=16,128,4,3,3,0,1,0,1", "merger=16,128,4,3,2,0,1,0,1",
        "nopdl=16,128,4,3,1,0,1,0,0", "w8=16,128,8,3,1,0,1,0,1", "n64s4=16,64,4,4,1,0,1,0,1",
        "n64s6w8=16,64,8,6,1,0,1,0,1", "desc=16,128,4,3,1,0,0,1,1", "desc64s4=16,64,4,4,1,0,0,1,1",
        "desc64s6=16,64,4,6,1,0,0,1,1", "s32n64=32,64,4,3,1,0,1,0,1", "s32n64w8=32,64,8,3,1,0,1,0,1",
        "lean=16,128,4,3,1,1,0,0,1", "leannomerge=16,128,4,3,0,1,0,0,1"],
    4: ["base=16,128,4,3,1,0,1,0,1", "nomerge=16,128,4,3,0,0,1,0,1", "nostore=16,128,4,3,3,0,1,0,1",
        "lean=16,128,4,3,1,1,0,0,1", "w8=16,128,8,3,1,0,1,0,1", "desc=16,128,4,3,1,0,0,1,1"],
    "mha": ["base=4,128,4,3,1,0,1,0,1", "lean=4,128,4,3,1,1,0,0,1", "w8=4,128,8,3,1,0,1,0,1",
            "n64s4=4,64,4,4,1,0,1,0,1", "desc=4,128,4,3,1,0,0,1,1", "desc64s4=4,64,4,4,1,0,0,1,1",
            "desc64s6=4,64,4,6,1,0,0,1,1", "s8n64=8,64,4,3,1,0,1,0,1"],
    16: ["base=16,64,4,3,1,0,1,0,1", "nomerge=16,64,4,3,0,0,1,0,1", "nostore=16,64,4,3,3,0,1,0,1",
         "lean=16,64,4,3,1,1,0,0,1", "w8=16,64,8,3,1,0,1,0,1", "n128=16,128,4,3,1,0,1,0,1",
         "desc=16,64,4,3,1,0,0,1,1", "desc128=16,128,8,3,1,0,0,1,1"],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=bench.DECODE_LAYERS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--points", nargs="+", default=["1,16384,8", "4,16384,8", "16,16384,8", "1,65536,8",
                                                    "1,65536,32"], help="nq,nk,hkv (B = 1, 32 query heads)")
    ap.add_argument("--variants", nargs="*", default=None, help="name=" + ",".join(FIELDS) + " (all points)")
    ap.add_argument("--set", choices=("first", "prefetch"), default="prefetch", help="the variants when none are given")
    args = ap.parse_args()
    triton.set_allocator(_allocator)
    res = {"part": "probe-decode-tail", "environment": bench.environment(), "layers": args.layers,
           "convention": __doc__.split("\n\n")[0], "ceilings": bench.measure_ceilings(), "points": []}
    copy = res["ceilings"]["copy_TBps"]
    print(f"copy {copy:.3f} TB/s", flush=True)
    h_q = 32
    for point in args.points:
        nq, nk, h_kv = (int(x) for x in point.split(","))
        nbytes = 2 * h_kv * nk * D * 2
        caches = [(torch.randn(1, h_kv, nk, D, device="cuda", dtype=torch.bfloat16),
                   torch.randn(1, h_kv, nk, D, device="cuda", dtype=torch.bfloat16)) for _ in range(args.layers)]
        q = torch.randn(1, h_q, nq, D, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((1,), nk, dtype=torch.int32, device="cuda")
        ws = decode.workspace(q)
        with torch.no_grad():
            gold = torch.nn.functional.scaled_dot_product_attention(
                q.float(), caches[0][0].float(), caches[0][1].float(), enable_gqa=True)
        fns = {"fa_lib": [lambda c=c: decode.flash_attention_with_kvcache(
            q, c[0], c[1], cache_seqlens=lens, causal=False, workspace=ws) for c in caches]}
        for prov in ("sdpa_flash", "sdpa_cudnn"):
            fns[prov] = [bench._decode_fn(prov, q, c[0], c[1], lens) for c in caches]
        outs = {}
        specs = args.variants if args.variants is not None else (DEFAULT_VARIANTS if args.set == "first" else
                                                          PREFETCH_VARIANTS)["mha" if h_kv == h_q else nq]
        cfgs = dict(parse(s) for s in specs)
        for name, c in cfgs.items():
            fns[name], outs[name] = calls(c, q, caches, lens)
        row = dict(b=1, hq=h_q, hkv=h_kv, nq=nq, nk=nk, bytes=nbytes, variants=cfgs)

        def output(name, r):  # what a call wrote that SDPA's output can be compared with, or None
            if name in ("fa_lib", "sdpa_flash", "sdpa_cudnn"):
                return r
            return outs[name] if cfgs[name]["merge"] in (1, 2, 4) else None

        measure(row, fns, output, gold, args.rounds, copy)
        res["points"].append(row)
        Path(args.out).write_text(json.dumps(res, indent=1))
        report(row, f"Nq {nq} Nk {nk // 1024}k", copy)
        del caches, fns
        bench._free()


if __name__ == "__main__":
    main()
