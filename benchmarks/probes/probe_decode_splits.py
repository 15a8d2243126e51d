"""Decoding at B = 1 (issue 12's bandwidth miss): the split count of `decode.num_splits_heuristic` (a wave-time
model) against the rule it replaced (`previous_splits`: within 85% of the best wave efficiency), and the split
kernel launched with programmatic dependent launch (`decode._PDL`), with and without the arrival counts'
memset per call (`probe_decode._KeptCounts`), and the library's way to drop that memset: a caller's workspace
(`workspace=decode.workspace(q)`, which also launches the split kernel with PDL on Hopper). Each point: graph time of one
call and per call in a graph of `--layers` calls on distinct caches, the least of `--rounds` medians, the
variants timed in turn; outputs compared with the first variant's. Writes JSON to --out.

    python3 -m benchmarks.probes.probe_decode_splits --out $OUT/probe-decode-splits.json

A variant ``cfg:S,BLOCK_N,WARPS,STAGES`` times the split kernel with a workspace at S splits and that block
configuration (the query tile as the library picks it), in place of `decode._launch_plan`'s choice;
``cfg:S,BLOCK_N,WARPS,STAGES,CHUNKS,ELEMENTS`` also sets the fused merge's limits (`decode._FUSE_ROW_CHUNKS`,
`decode._FUSE_ELEMENTS`), so that more splits can still merge in the split kernel.
"""
import argparse
import json
import math
import sys
from pathlib import Path


import torch  # noqa: E402

from benchmarks import bench
from fa_lib import decode, ops  # noqa: E402
from benchmarks.probes.probe_decode import _KeptCounts, layered_ms  # noqa: E402

POINTS = [(1, 32, 8, nq, nk) for nk in (16384, 65536, 131072) for nq in (1, 4, 16)]
POINTS += [(1, 32, 32, 1, 16384), (8, 32, 8, 1, 16384), (1, 32, 8, 1, 4096)]
FUSE = (decode._FUSE_ROW_CHUNKS, decode._FUSE_ELEMENTS)


def previous_splits(programs, n_blocks, sm_count, limit=128):
    """`decode.num_splits_heuristic` before 2026-12-02: the fewest chunks whose wave efficiency (programs x
    chunks over whole waves of sm_count) is within 85% of the best reachable."""
    if programs >= 0.8 * sm_count or n_blocks < 1:
        return 1

    def chunks(s):
        return math.ceil(n_blocks / math.ceil(n_blocks / s))

    eff = [programs * chunks(s) / (math.ceil(programs * chunks(s) / sm_count) * sm_count)
           for s in range(1, min(limit, n_blocks) + 1)]
    return chunks(next(s for s, e in enumerate(eff, start=1) if e >= 0.85 * max(eff)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["previous", "heuristic", "heuristic_pdl", "heuristic_pdl_kept",
                                                      "workspace"])
    ap.add_argument("--points", nargs="+", help="B,Hq,Hkv,Nq,Nk (default: the probe's twelve)")
    args = ap.parse_args()
    points = [tuple(map(int, x.split(","))) for x in args.points] if args.points else POINTS
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"part": "probe-decode-splits", "environment": bench.environment(), "layers": args.layers,
           "convention": __doc__.split("\n\n")[0], "points": []}
    kept = _KeptCounts()
    real_torch = decode.torch
    real_plan = decode._launch_plan
    for b, hq, hkv, nq, nk in points:
        rows = hq // hkv * nq
        new, (bm, bn, _, _) = decode._launch_plan(b, hkv, rows, nk, 128, sms)
        old = previous_splits(b * hkv * ops._cdiv(rows, bm), ops._cdiv(nk, bn), sms)
        variants = {"previous": (old, False, False), "heuristic": (new, False, False),
                    "heuristic_pdl": (new, True, False), "heuristic_pdl_kept": (new, True, True),
                    "workspace": (new, False, False)}
        for v in args.variants:
            if v.startswith("cfg:"):
                variants[v] = tuple(map(int, v[4:].split(",")))
        variants = {v: variants[v] for v in args.variants}
        q = torch.randn(b, hq, nq, 128, device="cuda", dtype=torch.bfloat16)
        caches = [tuple(torch.randn(b, hkv, nk, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
                  for _ in range(args.layers)]
        lens = torch.full((b,), nk, dtype=torch.int32, device="cuda")
        row = dict(b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, block_n=bn, splits={"previous": old, "heuristic": new},  # noqa: E501
                   bytes=2 * b * hkv * nk * 128 * 2 + 2 * q.numel() * 2, maxdiff={},
                   times={v: {"graph_ms": [], "layered_ms": []} for v in variants})

        def fns(v):
            decode._launch_plan = real_plan
            decode._FUSE_ROW_CHUNKS, decode._FUSE_ELEMENTS = FUSE
            if v.startswith("cfg:"):
                splits, block_n, warps, stages, *fuse = variants[v]
                if fuse:
                    decode._FUSE_ROW_CHUNKS, decode._FUSE_ELEMENTS = fuse
                block_m = real_plan(b, hkv, rows, nk, 128, sms)[1][0]
                decode._launch_plan = lambda *a, **k: (splits, (block_m, block_n, warps, stages))
                s, pdl, keep = splits, False, False
            else:
                s, pdl, keep = variants[v]
            decode._PDL = pdl
            decode.torch = kept if keep else real_torch

            ws = decode.workspace(q) if v == "workspace" or v.startswith("cfg:") else None

            def make(kc, vc):
                return lambda: decode.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=s,
                                                                   workspace=ws)
            return [make(kc, vc) for kc, vc in caches]

        try:
            with torch.no_grad():
                ref = None
                for v in variants:
                    o = fns(v)[0]()
                    ref = o if ref is None else ref
                    row["maxdiff"][v] = (o.float() - ref.float()).abs().max().item()
                for _ in range(args.rounds):
                    for v in variants:
                        f = fns(v)
                        row["times"][v]["graph_ms"].append(bench._graph_ms(f[0]))
                        row["times"][v]["layered_ms"].append(layered_ms(f))
        finally:
            decode._PDL, decode.torch, decode._launch_plan = False, real_torch, real_plan
            decode._FUSE_ROW_CHUNKS, decode._FUSE_ELEMENTS = FUSE
        row["best"] = {v: {k: min(t) for k, t in ts.items()} for v, ts in row["times"].items()}
        res["points"].append(row)
        print(f"B{b} {hq}/{hkv} Nq{nq} {nk // 1024}k splits {old}->{new}: " + "  ".join(
            f"{v} {t['graph_ms'] * 1e3:.1f}/{t['layered_ms'] * 1e3:.1f}us" for v, t in row["best"].items())
            + f"  (bytes/4.25TB/s {row['bytes'] / 4.25e6:.1f}us) maxdiff {max(row['maxdiff'].values()):.3g}",
            flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        del caches
        bench._free()


if __name__ == "__main__":
    main()
