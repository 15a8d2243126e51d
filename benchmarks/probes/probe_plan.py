"""Launch plans (fa_lib.plan) on and off, in one process, at the extended sweep's host-bound points (the small
batches and the prefills, inputs that need grad, as the sweep times them): per point and pass (forward;
backward as `o.backward(do, retain_graph=True)`), fa_lib's host ms per call (`probe_host.enqueue_ms`) and
do_bench median with plans off and on, in alternating rounds (the least of each), the forward's device ms
replayed from a CUDA graph, and the same host and do_bench times for SDPA's FA2 backend. Writes JSON to --out.

    python3 -m benchmarks.probes.probe_plan --out $OUT/probe-plan.json
"""
import argparse
import json
import sys
from pathlib import Path


import torch  # noqa: E402

from benchmarks import bench
from fa_lib import plan  # noqa: E402
from benchmarks.bench_profile import point_inputs  # noqa: E402
from benchmarks.probes.probe_host import enqueue_ms  # noqa: E402


def _calls(fn, q, k, v, do):
    fwd = lambda: fn(q, k, v)  # noqa: E731
    o = fn(q, k, v)

    def bwd():
        q.grad = k.grad = v.grad = None
        o.backward(do, retain_graph=True)

    return fwd, bwd


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 96, 128, 256])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    res = {"part": "probe-plan", "environment": bench.environment(), "convention": __doc__.split("\n\n")[0],
           "points": []}
    for p in bench.extended_points(dims=tuple(args.dims), dtypes=tuple(args.dtypes), kinds=("small", "prefill")):
        q, k, v, do = point_inputs(p)
        row = dict(p)
        fa = bench._ext_fn("fa_lib", p)
        fa(q, k, v).backward(do)  # compile, record
        fwd, bwd = _calls(fa, q, k, v, do)
        with torch.no_grad():
            row["fa_lib_graph_fwd_ms"] = bench._graph_ms(fwd)
        for tag in ("off", "on"):
            row[f"plan_{tag}"] = {m: {"host_ms": float("inf"), "do_bench_ms": float("inf")} for m in ("fwd", "bwd")}
        for _ in range(args.rounds):
            for tag in ("off", "on"):
                plan.ENABLED = tag == "on"
                for m, call in (("fwd", fwd), ("bwd", bwd)):
                    call()
                    r = row[f"plan_{tag}"][m]
                    r["host_ms"] = min(r["host_ms"], enqueue_ms(call))
                    r["do_bench_ms"] = min(r["do_bench_ms"], bench._median_ms(call, grad_to_none=[q, k, v]
                                                                              if m == "bwd" else None))
        plan.ENABLED = True
        sd = bench._ext_fn("sdpa_flash", p)
        sd(q, k, v).backward(do)
        sfwd, sbwd = _calls(sd, q, k, v, do)
        row["sdpa_flash"] = {m: {"host_ms": enqueue_ms(c), "do_bench_ms": min(bench._median_ms(c) for _ in range(2))}
                             for m, c in (("fwd", sfwd), ("bwd", sbwd))}
        res["points"].append(row)
        print(f"{p['kind']:7} {p['dtype']} d{p['d']:<3} c{int(p['causal'])} graph {row['fa_lib_graph_fwd_ms'] * 1e3:6.1f}us "
              + "  ".join(f"{m}: host off/on/FA2 {row['plan_off'][m]['host_ms'] * 1e3:5.0f}/"
                          f"{row['plan_on'][m]['host_ms'] * 1e3:5.0f}/{row['sdpa_flash'][m]['host_ms'] * 1e3:5.0f}us "
                          f"bench {row['plan_off'][m]['do_bench_ms'] * 1e3:5.0f}/{row['plan_on'][m]['do_bench_ms'] * 1e3:5.0f}/"
                          f"{row['sdpa_flash'][m]['do_bench_ms'] * 1e3:5.0f}us" for m in ("fwd", "bwd")), flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        del q, k, v, do, fwd, bwd, sfwd, sbwd
    res["plan_info"] = plan.info()
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("plans", json.dumps(plan.info()))


if __name__ == "__main__":
    main()
