"""Host time of `flash_attention`'s forward at the extended sweep's host-bound points (the small batches and the
prefills, inputs that need grad, as the sweep times them): the host ms per call (`probe_host.enqueue_ms`), the
device ms of the same forward replayed from a CUDA graph (no host in it), do_bench's median (what the sweep
reports), and the same three for SDPA's FA2 backend; a cProfile of fa_lib's forward by own time and by cumulative
time at `--profile` points. Writes JSON to --out.

    python3 -m benchmarks.probes.probe_host_fwd --out $OUT/probe-host-fwd.json
"""
import argparse
import json
import sys
from pathlib import Path


import torch  # noqa: E402

from benchmarks import bench
from fa_lib import ops  # noqa: E402
from benchmarks.bench_profile import point_inputs  # noqa: E402
from benchmarks.probes.probe_host import enqueue_ms, profile_text  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 96, 128, 256])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"])
    ap.add_argument("--profile", nargs="*", default=["small,256,1", "small,96,0"],
                    help="kind,d,causal points (bf16) to profile")
    args = ap.parse_args()
    res = {"part": "probe-host-fwd", "environment": bench.environment(), "convention": __doc__.split("\n\n")[0],
           "points": []}
    for p in bench.extended_points(dims=tuple(args.dims), dtypes=tuple(args.dtypes), kinds=("small", "prefill")):
        q, k, v, _ = point_inputs(p)
        row = dict(p)
        for prov in ("fa_lib", "sdpa_flash"):
            fn = bench._ext_fn(prov, p)
            call = lambda fn=fn: fn(q, k, v)  # noqa: E731
            call()
            with torch.no_grad():
                graph = bench._graph_ms(call)
            row[prov] = dict(host_ms=enqueue_ms(call), graph_ms=graph,
                             do_bench_ms=min(bench._median_ms(call) for _ in range(3)))
        tag = f"{p['kind']},{p['d']},{int(p['causal'])}"
        if p["dtype"] == "bf16" and tag in args.profile:
            fn = bench._ext_fn("fa_lib", p)
            row["profile_tottime"] = profile_text(lambda: fn(q, k, v), calls=200, sort="tottime", lines=30)[:6000]
            row["profile_cumulative"] = profile_text(lambda: fn(q, k, v), calls=200, sort="cumulative",
                                                     lines=40)[:8000]
        res["points"].append(row)
        print(f"{p['kind']:7} {p['dtype']} d{p['d']:<3} c{int(p['causal'])}  " + "  ".join(
            f"{n}: host {row[n]['host_ms'] * 1e3:6.1f}us graph {row[n]['graph_ms'] * 1e3:6.1f}us "
            f"do_bench {row[n]['do_bench_ms'] * 1e3:6.1f}us" for n in ("fa_lib", "sdpa_flash")), flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        del q, k, v
    print("launch cache", json.dumps(ops.launch.cache_info() if hasattr(ops, "launch") else {}))


if __name__ == "__main__":
    main()
