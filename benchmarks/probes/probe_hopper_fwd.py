"""The warp-specialized sm_90 forward (`fa_lib.kernels_hopper`) against the teaching kernel, SDPA's FA2 and
cuDNN: first the flash-attn 2x rule (forward and backward through `flash_attention`, outputs poisoned) on
awkward shapes, then the forward's time at the extended sweep's head-dim 64 and 128 points (least of
`--rounds` do_bench medians, inputs that need grad, as the sweep times them). Writes JSON to --out.

    python3 -m benchmarks.probes.probe_hopper_fwd --out $OUT/probe-hopper-fwd.json
"""
import argparse
import json
import sys
import time
from pathlib import Path


import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks import bench
from fa_lib import kernels_hopper, plan  # noqa: E402
from benchmarks.bench_profile import point_inputs  # noqa: E402
from fa_lib.testing import assert_flash_rule, forward_backward, make_inputs, reference_forward_backward  # noqa: E402

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
CHECKS = [  # (B, Hq, Hkv, Nq, Nk, D, causal, dtype, layout)
    (2, 4, 4, 1, 1, 128, False, "bf16", "bhnd"), (2, 4, 4, 17, 17, 128, True, "bf16", "bhnd"),
    (1, 4, 2, 113, 113, 128, True, "fp16", "bhnd"), (2, 4, 4, 1000, 1000, 128, False, "bf16", "bnhd"),
    (1, 8, 2, 1023, 1023, 128, True, "bf16", "bnhd"), (1, 4, 4, 1023, 1023, 64, True, "fp16", "bhnd"),
    (1, 4, 4, 1000, 1000, 64, False, "bf16", "bnhd"), (1, 4, 4, 300, 1000, 128, True, "bf16", "bhnd"),
    (1, 4, 4, 1000, 300, 128, True, "bf16", "bhnd"), (1, 4, 1, 200, 4100, 64, True, "bf16", "bhnd"),
    (1, 2, 2, 4096, 4096, 128, True, "bf16", "bhnd"), (1, 2, 2, 2048, 2048, 64, False, "fp16", "bnhd"),
    (2, 4, 4, 1, 1, 256, False, "bf16", "bhnd"), (2, 4, 4, 17, 17, 256, True, "bf16", "bhnd"),
    (1, 4, 2, 113, 113, 256, True, "fp16", "bhnd"), (2, 4, 4, 1000, 1000, 256, False, "bf16", "bnhd"),
    (1, 8, 2, 1023, 1023, 256, True, "bf16", "bnhd"), (1, 4, 4, 300, 1000, 256, True, "fp16", "bhnd"),
    (1, 4, 4, 1000, 300, 256, True, "bf16", "bhnd"), (1, 2, 2, 4096, 4096, 256, True, "bf16", "bhnd"),
    (1, 2, 2, 2048, 2048, 256, False, "fp16", "bnhd"),
]


def check(case):
    b, hq, hkv, nq, nk, d, causal, dt, layout = case
    q, k, v, do = make_inputs(b, hq, hkv, nq, nk, d, DT[dt], "cuda", seed=nq + d, layout=layout)
    from fa_lib import ops
    from fa_lib.ops import _Problem
    o_probe = ops._like(q)
    pb = _Problem(q, causal, (-1, -1), 0.0, None, n_q=nq, n_k=nk, batch=b)
    kernels_hopper.FORCE = True  # check the kernel on every case it can run, chosen or not
    taken = ops._hopper_forward(q, k, v, o_probe, pb)
    try:
        out = forward_backward(q, k, v, do, causal=causal)
        gold = reference_forward_backward(q, k, v, do, causal=causal, upcast=True)
        base = reference_forward_backward(q, k, v, do, causal=causal, upcast=False)
        rep = assert_flash_rule(out, gold, base)
        kernels_hopper.ENABLED = False
        teach = forward_backward(q, k, v, do, causal=causal)
        kernels_hopper.ENABLED, kernels_hopper.FORCE = True, False
        diff = (out["o"].float() - teach["o"].float()).abs().max().item()
        return dict(case=case, hopper=taken, ok=True, ratios={n: r[2] for n, r in rep.items()}, max_diff_teach=diff)
    except AssertionError as e:
        kernels_hopper.ENABLED, kernels_hopper.FORCE = True, False
        return dict(case=case, hopper=taken, ok=False, error=str(e)[:300])


def fwd_ms(fn, q, k, v, rounds):
    best = None
    for _ in range(rounds):
        ms = triton.testing.do_bench(lambda: fn(q, k, v), warmup=10, rep=50, return_mode="median")
        best = ms if best is None else min(best, ms)
    return best


def graph_ms(fn, q, k, v, calls=8):
    """Per call, replaying a CUDA graph of `calls` forwards (no autograd): the kernels' time without the host's."""
    with torch.no_grad():
        fn(q, k, v)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn(q, k, v)
    ms = triton.testing.do_bench(g.replay, warmup=10, rep=50, return_mode="median") / calls
    del g
    return ms


def host_us(fn, q, k, v, calls=200):
    """Host time per eager call (inputs that need grad), the GPU left to run behind."""
    for _ in range(3):
        fn(q, k, v)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(q, k, v)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--kinds", nargs="+", default=["square", "gqa", "prefill", "small"])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"])
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--stages", type=int, nargs="*", default=[], help="also time the kernel with these K/V slot counts")
    ap.add_argument("--groups", type=int, nargs="*", default=[],
                    help="also time the kernel with its tiles in groups of this many heads (kernels_hopper.heads_per_group forced)")
    ap.add_argument("--graph", action="store_true", help="also time each forward in a CUDA graph, and its host time")
    args = ap.parse_args()
    res = {"part": "probe-hopper-fwd", "environment": bench.environment(),
           "convention": __doc__.split("\n\n")[0], "checks": [], "points": []}
    if not args.no_check:
        for case in CHECKS:
            if case[5] not in args.dims:
                continue
            res["checks"].append(check(case))
            print("check", res["checks"][-1], flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    for p in bench.extended_points(dims=tuple(args.dims), dtypes=tuple(args.dtypes), kinds=tuple(args.kinds)):
        q, k, v, _ = point_inputs(p)
        row = dict(p, ms={})
        t0 = time.time()
        names = (["hopper"] + [f"hopper_s{n}" for n in args.stages] + [f"hopper_g{n}" for n in args.groups]
                 + ["teach", "sdpa_flash", "sdpa_cudnn"])
        default_stages = dict(kernels_hopper.STAGES)
        default_group = kernels_hopper.heads_per_group
        o_default = None
        for name in names:
            kernels_hopper.heads_per_group = default_group
            kernels_hopper.ENABLED = name != "teach"
            kernels_hopper.FORCE = name.startswith("hopper")  # time the kernel where the route declines it too
            kernels_hopper.STAGES.update(default_stages)
            if name.startswith("hopper_s"):
                kernels_hopper.STAGES[p["d"]] = int(name[len("hopper_s"):])
            if name.startswith("hopper_g"):
                kernels_hopper.heads_per_group = lambda *a, g=int(name[len("hopper_g"):]): g  # forced
            plan.clear()  # (STAGES changed in place: no recorded launch plan may outlive it)
            fn = bench._ext_fn(name if name.startswith("sdpa") else "fa_lib", p)
            if name.startswith("hopper"):  # the tile order must not change a single bit of the output
                with torch.no_grad():
                    o = fn(q, k, v)
                if o_default is None:
                    o_default = o.clone()
                elif name.startswith("hopper_g"):
                    row.setdefault("same_bits", {})[name] = bool(torch.equal(o, o_default))
                del o
            try:
                row["ms"][name] = fwd_ms(fn, q, k, v, args.rounds)
                if args.graph:
                    row.setdefault("graph_ms", {})[name] = graph_ms(fn, q, k, v)
                    row.setdefault("host_us", {})[name] = host_us(fn, q, k, v)
            except RuntimeError as e:
                row["ms"][name] = None
                row.setdefault("errors", {})[name] = str(e).splitlines()[0][:200]
        kernels_hopper.ENABLED, kernels_hopper.FORCE = True, False
        kernels_hopper.STAGES.update(default_stages)
        kernels_hopper.heads_per_group = default_group
        del o_default
        row["tflops"] = {n: (bench.ext_flops(p, "fwd") / (ms * 1e-3) / 1e12 if ms else None) for n, ms in row["ms"].items()}
        row["s"] = round(time.time() - t0, 1)
        res["points"].append(row)
        Path(args.out).write_text(json.dumps(res, indent=1))
        del q, k, v
    print(f"{'kind':8} {'dt':4} {'d':>3} {'c':1} {'n':>5} {'hopper':>7} {'teach':>7} {'fa2':>7} {'cudnn':>7}"
          f" {'h/teach':>7} {'h/fa2':>6} {'h/cud':>6}")
    for r in res["points"]:
        ms = r["ms"]
        extra = " ".join(f"{n}={ms['hopper'] / ms[n]:.2f}x" for n in ms
                         if n.startswith(("hopper_s", "hopper_g")) and ms[n] and ms["hopper"])
        if r.get("same_bits") and not all(r["same_bits"].values()):
            extra += " DIFFERENT BITS " + str(r["same_bits"])
        t = r["tflops"]
        f = lambda x: f"{x:7.0f}" if x else "   none"
        rat = lambda a, b: f"{ms[b] / ms[a]:6.2f}" if ms[a] and ms[b] else "  none"
        print(f"{r['kind']:8} {r['dtype']:4} {r['d']:3} {int(r['causal'])} {r['nq']:5} {f(t['hopper'])} {f(t['teach'])}"
              f" {f(t['sdpa_flash'])} {f(t['sdpa_cudnn'])} {rat('hopper', 'teach'):>7} {rat('hopper', 'sdpa_flash')}"
              f" {rat('hopper', 'sdpa_cudnn')} {extra}")
    if args.graph:
        print("graph ms per call (hopper teach fa2 cudnn) and host us per eager call (hopper teach fa2)")
        for r in res["points"]:
            g, h = r.get("graph_ms", {}), r.get("host_us", {})
            fmt = lambda d, n, spec: format(d[n], spec) if d.get(n) else "none"
            print(f"{r['kind']:8} {r['dtype']:4} {r['d']:3} {int(r['causal'])} {r['nq']:5} "
                  + " ".join(fmt(g, n, "7.4f") for n in ("hopper", "teach", "sdpa_flash", "sdpa_cudnn"))
                  + "  " + " ".join(fmt(h, n, "6.1f") for n in ("hopper", "teach", "sdpa_flash")))


if __name__ == "__main__":
    main()
