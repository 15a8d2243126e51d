"""Why decoding over a paged cache of small pages is slower than over a contiguous one (H200: 0.66 of the copy
bandwidth with 16-key pages at B = 8, 16k keys, against 0.94 unpaged; `benchmarks/data/decode-paged-nvidia-h200.json`).

For each point (B, cached keys, queries; 32/8 heads, d = 128, bf16, every key valid): fa_lib's step per call in a
CUDA graph of up to eight calls on distinct caches (as `bench --decode`'s layered timing), over the contiguous
cache and over paged copies: pages of several sizes in a shuffled pool order (as an allocator leaves them after
churn) and in order (page w of sequence b in slot b * W + w, so that a sequence's pages lie end to end), and
16-key pages under other split-kernel blocks (BLOCK_N, num_warps, num_stages; `decode._config` replaced for the
call). Each time is the least of `--rounds` medians. Writes JSON to --out.

    python3 -m benchmarks.probes.probe_paged_decode --out $OUT/probe-paged-decode.json
"""
import argparse
import json
import sys
from pathlib import Path


import torch  # noqa: E402

from benchmarks import bench
from fa_lib import decode, flash_attention_with_kvcache  # noqa: E402

POINTS = ("1,16384,1", "8,16384,1", "8,65536,1", "8,16384,16", "64,16384,1")  # B, cached keys, queries
CONFIGS = ((64, 4, 3), (64, 4, 4), (128, 4, 4), (128, 8, 3), (32, 4, 4), (64, 8, 4), (128, 4, 2))


def _with_config(cfg, fn):
    """fn() with the split kernel's (BLOCK_N, num_warps, num_stages) set to cfg (None: the library's)."""
    if cfg is None:
        return fn()
    original = decode._config

    def forced(*a, **kw):
        return (original(*a, **kw)[0],) + tuple(cfg)
    decode._config = forced
    decode._launch_plan.cache_clear()
    try:
        return fn()
    finally:
        decode._config = original
        decode._launch_plan.cache_clear()


def measure(points, pages, rounds, *, heads=(32, 8), d=128, layers_max=8, dtype=torch.bfloat16, device="cuda",
            graph_ms=None, copy=None, sms=None):
    """One row per point (B, cached keys, queries): each variant's time per call (`graph_ms(fn)`: fn's time in ms,
    default `bench._graph_ms`, a CUDA graph's replay) and fraction of the copy bandwidth (`copy` TB/s, default
    measured), the paged outputs checked for the contiguous cache's bits, and the library's plan (`sms`: the SM
    count it plans for, default the GPU's)."""
    hq, hkv = heads
    graph_ms = graph_ms or bench._graph_ms
    gen = torch.Generator(device=device).manual_seed(0)
    copy = copy or bench.measure_ceilings()["copy_TBps"]
    sms = sms or torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for b, nk, nq in points:
        q = torch.randn(b, hq, nq, d, device=device, dtype=dtype, generator=gen)
        cache_bytes = 2 * b * hkv * nk * d * q.element_size()
        layers = max(1, min(layers_max, (24 << 30) // cache_bytes))
        caches = [tuple(torch.randn(b, hkv, nk, d, device=device, dtype=dtype, generator=gen)
                        for _ in "kv") for _ in range(layers)]
        seqlens = torch.full((b,), nk, dtype=torch.int32, device=device)
        ws = decode.workspace(q)
        row = dict(b=b, nk=nk, nq=nq, hq=hq, hkv=hkv, d=d, layers=layers, bytes=cache_bytes + 2 * q.numel() * q.element_size(),
                   us={}, fraction={}, same_bits={})

        def run(name, sets, cfg=None, table=None):
            def calls():
                return [(lambda kc=kc, vc=vc: flash_attention_with_kvcache(
                    q, kc, vc, cache_seqlens=seqlens, workspace=ws, block_table=table)) for kc, vc in sets]
            fns = calls()
            best = min(_with_config(cfg, lambda: graph_ms(lambda: [f() for f in fns])) for _ in range(rounds))
            row["us"][name] = best / len(fns) * 1e3
            row["fraction"][name] = row["bytes"] / (best / len(fns) * 1e-3) / 1e12 / copy
            return _with_config(cfg, fns[0])

        with torch.no_grad():
            want = run("unpaged", caches)
            for page in pages:
                for shuffled in (True, False):
                    w = -(-nk // page)
                    order = torch.randperm(b * w, generator=torch.Generator().manual_seed(page)) if shuffled else None
                    pools = [tuple(decode.page_cache(c, page, order) for c in kv) for kv in caches]
                    sets = [(kp, vp) for (kp, table), (vp, _) in pools]
                    table = pools[0][0][1]
                    name = f"paged{page}" + ("" if shuffled else "_inorder")
                    row["same_bits"][name] = bool(torch.equal(run(name, sets, table=table), want))
                    if page == min(pages) and shuffled:
                        for cfg in CONFIGS:
                            run(f"{name}_cfg{'-'.join(map(str, cfg))}", sets, cfg, table)
                    del pools, sets, table
            for cfg in CONFIGS:
                run(f"unpaged_cfg{'-'.join(map(str, cfg))}", caches, cfg)
        plan = decode._launch_plan(b, hkv, nq * hq // hkv, nk, d, sms)
        row["plan"] = dict(num_splits=plan[0], config=list(plan[1]))
        rows.append(row)
        print(b, nk, nq, plan, " ".join(f"{n}={u:.1f}us/{row['fraction'][n]:.2f}" for n, u in row["us"].items()),
              flush=True)
        del q, caches, ws
        if device == "cuda":
            bench._free()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--points", nargs="+", default=list(POINTS), help="B,keys,queries")
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    args = ap.parse_args()
    points = [tuple(map(int, p.split(","))) for p in args.points]
    res = {"part": "probe-paged-decode", "environment": bench.environment(), "convention": __doc__.split("\n\n")[1],
           "points": []}
    for p in points:
        res["points"] += measure([p], args.pages, args.rounds)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
