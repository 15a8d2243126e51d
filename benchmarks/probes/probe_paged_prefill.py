"""A prefill over a paged KV cache (`fa_lib.flash_attention_varlen(..., block_table=)`: vLLM's chunked prefill and
prefix caching) against the same keys laid end to end (the unpaged varlen forward). Each sequence of a point
prefills `new` queries over `keys` keys (its cached ones and the new ones), causal, bottom-right; 32/8 heads,
d = 128, bf16, forward only. For each page size: whether the paged call gives the unpaged call's bits, and each
call's time: `ms`, the least of `--rounds` do_bench medians (L2 flushed), eager calls with their host checks
(the paged one copies its key counts and one flag to the host); `graph_ms`, the median replay of one call captured
in a CUDA graph (no checks run while a graph is captured: the kernel's time). Writes JSON to --out.

    python3 -m benchmarks.probes.probe_paged_prefill --out $OUT/probe-paged-prefill.json
"""
import argparse
import json
import sys
from pathlib import Path


import torch  # noqa: E402

from benchmarks import bench
from fa_lib import decode, flash_attention_varlen  # noqa: E402

POINTS = ("4,512,8192", "4,2048,8192", "1,2048,32768", "16,128,4096", "64,16,2048")  # B, new queries, keys


def _cu(lengths, device):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def measure(points, pages, timer, graph_timer=lambda fn: None, *, heads=(32, 8), d=128, dtype=torch.bfloat16,
            device="cuda"):
    """One row per point (B, new queries, keys per sequence): `timer(fn)` gives fn's time in ms (it may call fn),
    `graph_timer(fn)` its time replayed from a CUDA graph (None: not timed);
    the paged calls over pools cut by `decode.page_packed` in a shuffled order, checked for the unpaged bits."""
    hq, hkv = heads
    rows = []
    for b, new, keys in points:
        g = torch.Generator().manual_seed(b * new + keys)
        q = torch.randn(b * new, hq, d, generator=g).to(device, dtype)
        k, v = (torch.randn(b * keys, hkv, d, generator=g).to(device, dtype) for _ in "kv")
        cu_q, cu_k = _cu([new] * b, device), _cu([keys] * b, device)
        args = (cu_q, cu_k, new, keys)
        row = dict(b=b, new=new, keys=keys, hq=hq, hkv=hkv, d=d, dtype=str(dtype).split(".")[-1], ms={},
                   graph_ms={}, same_bits={})
        with torch.no_grad():
            unpaged = lambda: flash_attention_varlen(q, k, v, *args, causal=True)  # noqa: E731
            want = unpaged()
            row["ms"]["unpaged"] = timer(unpaged)
            row["graph_ms"]["unpaged"] = graph_timer(unpaged)
            for page in pages:
                w = -(-keys // page)
                order = torch.randperm(b * w, generator=g)
                (k_pool, table), (v_pool, _) = (decode.page_packed(t, cu_k, page, order) for t in (k, v))
                paged = (lambda k_pool=k_pool, v_pool=v_pool, table=table: flash_attention_varlen(
                    q, k_pool, v_pool, *args, causal=True, block_table=table))
                row["same_bits"][page] = bool(torch.equal(paged(), want))
                row["ms"][f"paged{page}"] = timer(paged)
                row["graph_ms"][f"paged{page}"] = graph_timer(paged)
        # causal scores of the new rows (each sees the keys before it and itself), two matmuls of 2 d FLOPs each
        scores = b * sum(keys - new + i + 1 for i in range(new)) * hq
        row["tflops"] = {n: 4 * d * scores / (ms * 1e-3) / 1e12 for n, ms in row["ms"].items()}
        row["graph_tflops"] = {n: 4 * d * scores / (ms * 1e-3) / 1e12 for n, ms in row["graph_ms"].items()
                               if ms is not None}
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--points", nargs="+", default=list(POINTS), help="B,new,keys")
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 256])
    args = ap.parse_args()
    import triton

    def timer(fn):
        fn()  # compile first
        return min(triton.testing.do_bench(fn, warmup=10, rep=50) for _ in range(args.rounds))

    points = [tuple(map(int, p.split(","))) for p in args.points]
    res = {"part": "probe-paged-prefill", "environment": bench.environment(), "convention": __doc__.split("\n\n")[0],
           "points": measure(points, args.pages, timer, bench._graph_ms)}
    Path(args.out).write_text(json.dumps(res, indent=1))
    for r in res["points"]:
        print(r["b"], r["new"], r["keys"], " ".join(f"{n}={ms:.4f}/{r['graph_ms'][n]:.4f}"
                                                    for n, ms in r["ms"].items()),
              "same bits:", r["same_bits"], flush=True)


if __name__ == "__main__":
    main()
