"""The warp-specialized sm_90 dQ kernel (`fa_lib.kernels_hopper.backward_dq`) against the teaching dQ kernel, SDPA's
FA2 and cuDNN: first the flash-attn 2x rule (forward and backward through `flash_attention`, outputs poisoned) on
the forward probe's awkward shapes at head dims 64 and 128, with dQ compared to the teaching kernel's, then the
backward's time at extended-sweep points (least of `--rounds` do_bench medians of `o.backward(do)`, as the sweep
times it). Providers: gluon[_n<BLOCK_N>_s<STAGES>] (the kernel forced, with those blocks), teach (the teaching dQ
kernel), sdpa_flash, sdpa_cudnn. Writes JSON to --out after every row.

    python3 -m benchmarks.probes.probe_hopper_dq --out $OUT/probe-hopper-dq.json
"""
import argparse
import json
import sys
import time
from pathlib import Path


import torch  # noqa: E402

from benchmarks import bench
from fa_lib import kernels_hopper, ops, plan  # noqa: E402
from fa_lib.testing import forward_backward, make_inputs  # noqa: E402

from benchmarks.probes.probe_common import best_backward, judge, recorded  # noqa: E402
from benchmarks.probes.probe_hopper_fwd import CHECKS, DT  # noqa: E402  (the forward probe's awkward shapes)

DEFAULT = (dict(kernels_hopper.DQ_BLOCK_N), dict(kernels_hopper.DQ_STAGES))


def setting(name, d):
    """Put the dQ kernel's settings for provider `name` at head dim `d` in place (and drop the launch plans)."""
    kernels_hopper.DQ_BLOCK_N.update(DEFAULT[0])
    kernels_hopper.DQ_STAGES.update(DEFAULT[1])
    kernels_hopper.DQ_ENABLED = name != "teach"
    kernels_hopper.DQ_FORCE = name.startswith("gluon")
    if name.startswith("gluon_n"):
        bn, st = name[len("gluon_n"):].split("_s")
        kernels_hopper.DQ_BLOCK_N[d], kernels_hopper.DQ_STAGES[d] = int(bn), int(st)
    plan.clear()


def taken(q, k, v, do, causal):
    pb = ops._Problem(q, causal, (-1, -1), 0.0, None, n_q=q.shape[2], n_k=k.shape[2], batch=q.shape[0])
    return ops._hopper_dq(q, k, v, do, ops._like(q), pb)


def check(case):
    b, hq, hkv, nq, nk, d, causal, dt, layout = case
    q, k, v, do = make_inputs(b, hq, hkv, nq, nk, d, DT[dt], "cuda", seed=nq + d, layout=layout)
    setting("gluon", d)
    row = dict(case=case, gluon=taken(q, k, v, do, causal))
    with recorded(row):
        out = forward_backward(q, k, v, do, causal=causal)
        setting("teach", d)
        teach = forward_backward(q, k, v, do, causal=causal)
        row["max_diff_teach"] = {n: (out[n].float() - teach[n].float()).abs().max().item() for n in ("dk", "dv", "dq")}
        judge(row, out, q, k, v, do, causal)
    setting("default", d)
    kernels_hopper.DQ_ENABLED, kernels_hopper.DQ_FORCE = True, False
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--dims", type=int, nargs="+", default=[128])
    ap.add_argument("--kinds", nargs="+", default=["square", "gqa"])
    ap.add_argument("--dtypes", nargs="+", default=["bf16"])
    ap.add_argument("--ns", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--providers", nargs="+", default=["gluon", "gluon_n128_s2", "teach", "sdpa_flash", "sdpa_cudnn"])
    args = ap.parse_args()
    res = {"part": "probe-hopper-dq", "environment": bench.environment(), "convention": __doc__.split("\n\n")[0],
           "default_blocks": {str(d): [DEFAULT[0][d], DEFAULT[1][d]] for d in DEFAULT[0]}, "checks": [], "points": []}
    if not args.no_check:
        for case in CHECKS:
            if case[5] in kernels_hopper.DQ_BLOCK_N:
                res["checks"].append(check(case))
                print("check", res["checks"][-1], flush=True)
                Path(args.out).write_text(json.dumps(res, indent=1))
    for p in bench.extended_points(dims=tuple(args.dims), dtypes=tuple(args.dtypes), kinds=tuple(args.kinds),
                                   ns=tuple(args.ns)):
        row = dict(p, bwd_ms={})
        t0 = time.time()
        for name in args.providers:
            setting(name, p["d"])
            best_backward(row, name, name if name.startswith("sdpa") else "fa_lib", p, args.rounds)
        setting("default", p["d"])
        kernels_hopper.DQ_ENABLED, kernels_hopper.DQ_FORCE = True, False
        bw = row["bwd_ms"]
        row["seconds"] = round(time.time() - t0, 1)
        res["points"].append(row)
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(p["dtype"], p["d"], p["kind"], "causal" if p["causal"] else "full", p["b"], p["nq"], p["nk"],
              " ".join(f"{n}={v:.3f}" for n, v in bw.items()),
              " gluon/teach %.2f" % (bw["teach"] / bw["gluon"]) if "gluon" in bw and "teach" in bw else "",
              " vscuDNN %.2f" % (bw["sdpa_cudnn"] / min(v for n, v in bw.items() if n.startswith("gluon")))
              if "gluon" in bw and "sdpa_cudnn" in bw else "", flush=True)


if __name__ == "__main__":
    main()
