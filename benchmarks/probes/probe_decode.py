"""Probe of the decoding kernels (issue 12), on a CUDA machine.

For each point: fa_lib's ``flash_attention_with_kvcache`` and SDPA's backends timed from a CUDA graph of
one call (as ``bench --decode``) and per call in a graph of ``--layers`` calls on distinct caches (a
model's decoding step replays one attention per layer back to back, so the graph's launch cost is shared),
the device time of each fa_lib kernel (torch.profiler), and fa_lib's split count and split-kernel blocks
swept. Writes JSON to ``--out``.

    python3 -m benchmarks.probes.probe_decode --out $OUT/probe-decode.json
    python3 -m benchmarks.probes.probe_decode --fused-only --out $OUT/probe-decode-fused.json
"""
import argparse
import json
import sys
import time
from pathlib import Path


import torch  # noqa: E402

from benchmarks import bench
from fa_lib import decode  # noqa: E402
from benchmarks.probes.probe_variants import kernel_times  # noqa: E402

POINTS = [(1, 32, 32, 1, 16384), (1, 32, 8, 1, 16384), (1, 32, 32, 1, 65536), (1, 32, 8, 1, 65536),
          (1, 32, 8, 1, 131072), (1, 32, 32, 1, 4096), (1, 32, 8, 1, 4096), (8, 32, 32, 1, 1024),
          (8, 32, 8, 1, 1024), (64, 32, 8, 1, 1024), (8, 32, 32, 1, 16384)]
CONFIGS = [(128, 4, 3), (64, 4, 3), (64, 4, 4), (128, 4, 2), (64, 2, 4), (128, 8, 3), (32, 4, 4)]


def layered_ms(fns):
    """ms per call of the calls `fns` captured into one CUDA graph, replayed."""
    return bench._graph_ms(lambda: [f() for f in fns]) / len(fns)


def flush_probe(out, reps=30):
    """One graph replay of fa_lib's decoding step timed after three ways of emptying the L2 cache:
    writing a 256 MiB buffer (as triton.testing.do_bench does: it leaves the L2 full of dirty lines),
    reading it (the L2 left full of clean lines), and writing it then reading a second buffer (the
    dirty lines written back before the timed call). Median ms each, B = 1, H = 32/8, N_q = 1."""
    buf, buf2 = (torch.empty(256 << 20, dtype=torch.int8, device="cuda") for _ in range(2))
    flushes = {"write": lambda: buf.zero_(), "read": lambda: buf.sum(dtype=torch.int32),
               "write_then_read": lambda: (buf.zero_(), buf2.sum(dtype=torch.int32))}
    rows = []
    for nk in (1024, 16384, 131072):
        q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(1, 8, nk, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        lens = torch.full((1,), nk, dtype=torch.int32, device="cuda")
        fn = bench._decode_fn("fa_lib", q, kc, vc, lens)
        for _ in range(3):
            fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        row = {"nk": nk, "do_bench_ms": bench._median_ms(g.replay, warmup=5, rep=30)}
        for name, flush in flushes.items():
            ts = []
            for _ in range(reps):
                flush()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b))
            row[f"{name}_ms"] = sorted(ts)[len(ts) // 2]
        rows.append(row)
        print(json.dumps(row), flush=True)
    out["flush"] = rows


FUSED_POINTS = [(1, 32, 8, 1, 1024), (1, 32, 8, 1, 4096), (1, 32, 8, 1, 16384), (1, 32, 8, 1, 65536),
                (1, 32, 8, 1, 131072), (1, 32, 32, 1, 1024), (1, 32, 32, 1, 16384), (1, 32, 32, 4, 16384),
                (1, 32, 32, 16, 16384), (1, 32, 8, 4, 16384), (1, 32, 8, 16, 16384), (8, 32, 8, 1, 1024),
                (8, 32, 8, 1, 16384), (8, 32, 8, 4, 4096), (8, 32, 8, 16, 16384)]
class _KeptCounts:
    """Stands in for `torch` inside fa_lib.decode: `zeros` of int32 returns a slice of one buffer zeroed
    once (the split kernel's last arrivals set their counts back to 0), so no memset runs per call;
    everything else is torch's. Probe only: one stream, calls in order."""

    def __init__(self):
        self.buf = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")

    def zeros(self, shape, dtype=None, device=None):
        if dtype == torch.int32:
            return self.buf[:shape[0]]
        return torch.zeros(shape, dtype=dtype, device=device)

    def __getattr__(self, name):
        return getattr(torch, name)


VARIANTS = {"combine": dict(_FUSE=False), "fused": dict(_FUSE=True, _FUSE_ROW_CHUNKS=1),
            "fused_chunks4": dict(_FUSE=True, _FUSE_ROW_CHUNKS=4),
            "fused_chunks16": dict(_FUSE=True, _FUSE_ROW_CHUNKS=16),
            "fused_kept_counts": dict(_FUSE=True, _FUSE_ROW_CHUNKS=1, torch="kept")}


def fused_probe(out, layers, rounds=3):
    """The split kernel's own merge (decode._FUSE, one launch) against the separate combine kernel
    (two launches), the fused merge with up to 4 or 16 row chunks, and with its counts kept zeroed in one
    buffer instead of a memset per call (`_KeptCounts`): per point the least of `rounds`
    medians of the graph time of one call and of the layered time (`layers` calls on distinct caches),
    the variants timed in turn; also the graph time of the counters' memset next to a tiny kernel."""
    saved = {k: getattr(decode, k) for v in VARIANTS.values() for k in v}
    kept = _KeptCounts()
    tiny = torch.zeros(8, device="cuda")
    counts = torch.zeros(64, dtype=torch.int32, device="cuda")
    out["memset"] = {"tiny_ms": min(bench._graph_ms(lambda: tiny.add_(1.0)) for _ in range(rounds)),
                     "tiny_and_zeros_ms": min(bench._graph_ms(lambda: (tiny.add_(1.0), torch.zeros_like(counts)))
                                              for _ in range(rounds))}
    print(json.dumps(out["memset"]), flush=True)
    rows = []
    for b, hq, hkv, nq, nk in FUSED_POINTS:
        q = torch.randn(b, hq, nq, 128, device="cuda", dtype=torch.bfloat16)
        caches = [(torch.randn(b, hkv, nk, 128, device="cuda", dtype=torch.bfloat16),
                   torch.randn(b, hkv, nk, 128, device="cuda", dtype=torch.bfloat16)) for _ in range(layers)]
        lens = torch.full((b,), nk, dtype=torch.int32, device="cuda")
        row = dict(b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, bytes=2 * b * hkv * nk * 128 * 2 + 2 * q.numel() * 2)
        ref = None
        with torch.no_grad():
            for name, v in VARIANTS.items():
                for k, val in v.items():
                    setattr(decode, k, kept if val == "kept" else val)
                o = decode.flash_attention_with_kvcache(q, *caches[0], cache_seqlens=lens)
                if ref is None:
                    ref = o
                row[f"{name}_maxdiff"] = (o.float() - ref.float()).abs().max().item()
            times = {name: {"graph_ms": [], "layered_ms": []} for name in VARIANTS}
            for _ in range(rounds):
                for name, v in VARIANTS.items():
                    for k, val in v.items():
                        setattr(decode, k, kept if val == "kept" else val)
                    fns = [bench._decode_fn("fa_lib", q, kc, vc, lens) for kc, vc in caches]
                    times[name]["graph_ms"].append(bench._graph_ms(fns[0]))
                    times[name]["layered_ms"].append(layered_ms(fns))
            for name in VARIANTS:
                row[name] = {k: min(t) for k, t in times[name].items()}
        for k, val in saved.items():
            setattr(decode, k, val)
        rows.append(row)
        print(f"B{b} H{hq}/{hkv} Nq{nq} Nk{nk}: " + "  ".join(
            f"{n} {row[n]['graph_ms'] * 1e3:.1f}/{row[n]['layered_ms'] * 1e3:.1f}us" for n in VARIANTS), flush=True)
        del caches
        bench._free()
    out["fused"] = rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--sweep", action="store_true", help="also sweep the split kernel's blocks")
    ap.add_argument("--flush-only", action="store_true", help="only the L2-flush probe (flush_probe)")
    ap.add_argument("--fused-only", action="store_true", help="only the fused-merge probe (fused_probe)")
    args = ap.parse_args()
    res = {"env": bench.environment(), "layers": args.layers, "points": []}
    tiny = torch.zeros(8, device="cuda")
    res["graph_floor_ms"] = bench._graph_ms(lambda: tiny.add_(1.0))
    res["layered_floor_ms"] = layered_ms([lambda: tiny.add_(1.0)] * args.layers)
    print(json.dumps(res), flush=True)
    if args.fused_only:
        fused_probe(res, args.layers)
        Path(args.out).write_text(json.dumps(res, indent=1))
        return
    if args.flush_only:
        flush_probe(res)
        Path(args.out).write_text(json.dumps(res, indent=1))
        return
    real_config = decode._config
    for b, hq, hkv, nq, nk in POINTS:
        t0 = time.time()
        q = torch.randn(b, hq, nq, 128, device="cuda", dtype=torch.bfloat16)
        caches = [(torch.randn(b, hkv, nk, 128, device="cuda", dtype=torch.bfloat16),
                   torch.randn(b, hkv, nk, 128, device="cuda", dtype=torch.bfloat16)) for _ in range(args.layers)]
        lens = torch.full((b,), nk, dtype=torch.int32, device="cuda")
        row = dict(b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, bytes=2 * b * hkv * nk * 128 * 2 + 2 * q.numel() * 2)
        with torch.no_grad():
            for prov in bench.DECODE_PROVIDERS:
                fns = [bench._decode_fn(prov, q, kc, vc, lens) for kc, vc in caches]
                row[prov] = dict(graph_ms=bench._graph_ms(fns[0]), layered_ms=layered_ms(fns))
            fn0 = bench._decode_fn("fa_lib", q, *caches[0], lens)
            row["fa_lib"]["kernels"] = kernel_times(fn0, reps=20, prefix="_decode")
            block_m, block_n, _, _ = real_config(128, hq // hkv * nq)
            h = decode.num_splits_heuristic(b * hkv * -(-hq // hkv * nq // block_m), -(-nk // block_n), 132)
            row["heuristic_splits"] = h
            def per_call(s=None):
                return layered_ms([lambda kc=kc, vc=vc: decode.flash_attention_with_kvcache(
                    q, kc, vc, cache_seqlens=lens, num_splits=s) for kc, vc in caches])
            row["splits"] = {s: per_call(s) for s in sorted({1, h - 2, h - 1, h, h + 1, h + 2, 16, 32, 2 * h} & set(range(1, 129)))}
            sweep = {}
            if args.sweep:
                for bn, warps, stages in CONFIGS:
                    decode._config = lambda hd, rows, waves=0.0, interpret=None, c=(bn, warps, stages): (
                        real_config(hd, rows)[0], *c)
                    for s in sorted({max(1, h // 2), h, 2 * h, 4 * h, 8 * h} & set(range(1, 129))):
                        fns = [lambda kc=kc, vc=vc, s=s: decode.flash_attention_with_kvcache(
                            q, kc, vc, cache_seqlens=lens, num_splits=s) for kc, vc in caches]
                        try:
                            sweep[f"{bn},{warps},{stages},s{s}"] = layered_ms(fns)
                        except Exception as e:  # noqa: BLE001 (a config that does not compile: recorded)
                            sweep[f"{bn},{warps},{stages},s{s}"] = f"{type(e).__name__}: {str(e)[:100]}"
                decode._config = real_config
            row["sweep"] = sweep
            best = min((v, k) for k, v in sweep.items() if isinstance(v, float)) if sweep else None
            row["best"] = best
        res["points"].append(row)
        gb = row["bytes"] / 1e9
        print(f"B{b} H{hq}/{hkv} Nk{nk}: " + "  ".join(
            f"{p} {row[p]['graph_ms'] * 1e3:.1f}/{row[p]['layered_ms'] * 1e3:.1f}us "
            f"({gb / row[p]['layered_ms'] / 4.28:.2f})" for p in bench.DECODE_PROVIDERS)
            + f"  kernels {row['fa_lib']['kernels']}  h={h} splits "
            + " ".join(f"{s}:{v * 1e3:.1f}" for s, v in row["splits"].items()) + f" best {best}  [{time.time() - t0:.0f}s]",
            flush=True)
        del caches
        bench._free()
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
