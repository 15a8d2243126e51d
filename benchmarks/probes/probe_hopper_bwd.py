"""The warp-specialized sm_90 dK/dV kernel (`fa_lib.kernels_hopper.backward_dkdv`) against the teaching
dK/dV kernel, SDPA's FA2 and cuDNN: first the flash-attn 2x rule (forward and backward through
`flash_attention`, outputs poisoned) on awkward shapes, with the gradients compared to the teaching
kernel's, then the backward's time at extended-sweep points (least of `--rounds` do_bench medians of
`o.backward(do)`, as the sweep times it). Writes JSON to --out after every row.

    python3 -m benchmarks.probes.probe_hopper_bwd --out $OUT/probe-hopper-bwd.json
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

DEFAULT_STAGES = dict(kernels_hopper.BWD_STAGES)
DEFAULT_KERNEL = kernels_hopper._attn_bwd_dkdv_ws


def alt_kernel(path):
    """The `_attn_bwd_dkdv_ws` of the module at `path` (same signature as the committed kernel's)."""
    import importlib.util

    if not path:
        raise SystemExit("a hopper_alt provider needs --alt PATH")
    spec = importlib.util.spec_from_file_location("_bwd_alt", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._attn_bwd_dkdv_ws


def taken(q, k, v, do, causal):
    pb = ops._Problem(q, causal, (-1, -1), 0.0, None, n_q=q.shape[2], n_k=k.shape[2], batch=q.shape[0])
    return ops._hopper_backward(q, k, v, do, ops._like(k), ops._like(v), pb)


def check(case):
    b, hq, hkv, nq, nk, d, causal, dt, layout = case
    q, k, v, do = make_inputs(b, hq, hkv, nq, nk, d, DT[dt], "cuda", seed=nq + d, layout=layout)
    kernels_hopper.BWD_FORCE = True  # check the kernel on every case it can run, chosen or not
    row = dict(case=case, hopper=taken(q, k, v, do, causal))
    with recorded(row):
        kernels_hopper.BWD_ENABLED = True
        out = forward_backward(q, k, v, do, causal=causal)
        kernels_hopper.BWD_ENABLED = False
        teach = forward_backward(q, k, v, do, causal=causal)
        kernels_hopper.BWD_ENABLED = True
        row["max_diff_teach"] = {n: (out[n].float() - teach[n].float()).abs().max().item() for n in ("dk", "dv", "dq")}
        judge(row, out, q, k, v, do, causal)
    kernels_hopper.BWD_ENABLED, kernels_hopper.BWD_FORCE = True, False
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--kinds", nargs="+", default=["square", "gqa", "prefill", "small"])
    ap.add_argument("--dtypes", nargs="+", default=["bf16"])
    ap.add_argument("--ns", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--providers", nargs="+", default=["hopper", "teach", "sdpa_flash", "sdpa_cudnn"],
                    help="hopper[_s<n>] (n Q/dO slots), hopper_alt[_s<n>] (the kernel of --alt), teach, sdpa_*")
    ap.add_argument("--alt", help="a copy of fa_lib/kernels_hopper.py with another _attn_bwd_dkdv_ws (hopper_alt)")
    args = ap.parse_args()
    res = {"part": "probe-hopper-bwd", "environment": bench.environment(),
           "convention": __doc__.split("\n\n")[0], "checks": [], "points": []}
    if not args.no_check:
        for case in CHECKS:
            res["checks"].append(check(case))
            print("check", res["checks"][-1], flush=True)
            Path(args.out).write_text(json.dumps(res, indent=1))
    for p in bench.extended_points(dims=tuple(args.dims), dtypes=tuple(args.dtypes), kinds=tuple(args.kinds),
                                   ns=tuple(args.ns)):
        row = dict(p, bwd_ms={}, fwd_ms={})
        t0 = time.time()
        for name in args.providers:
            kernels_hopper.BWD_ENABLED = name != "teach"
            kernels_hopper.BWD_FORCE = name.startswith("hopper")  # time the kernel where the route declines it too
            kernels_hopper.BWD_STAGES.update(DEFAULT_STAGES)
            kernels_hopper._attn_bwd_dkdv_ws = DEFAULT_KERNEL
            if name.startswith("hopper") and "_s" in name:  # hopper[_alt]_s<n>: n slots for Q and dO
                kernels_hopper.BWD_STAGES[p["d"]] = int(name.rsplit("_s", 1)[1])
            if name.startswith("hopper_alt"):  # another version of the kernel, from the module --alt names
                kernels_hopper._attn_bwd_dkdv_ws = alt_kernel(args.alt)
            plan.clear()  # (BWD_STAGES changed in place: no recorded launch plan may outlive it)
            best_backward(row, name, name if name.startswith("sdpa") else "fa_lib", p, args.rounds)
        kernels_hopper.BWD_ENABLED, kernels_hopper.BWD_FORCE = True, False
        kernels_hopper.BWD_STAGES.update(DEFAULT_STAGES)
        kernels_hopper._attn_bwd_dkdv_ws = DEFAULT_KERNEL
        bw = row["bwd_ms"]
        row["seconds"] = round(time.time() - t0, 1)
        res["points"].append(row)
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(p["dtype"], p["d"], p["kind"], "causal" if p["causal"] else "full", p["b"], p["nq"], p["nk"],
              " ".join(f"{n}={v:.3f}" for n, v in bw.items()),
              " hopper/teach %.2f" % (bw["teach"] / bw["hopper"]) if "hopper" in bw and "teach" in bw else "",
              " vsFA2 %.2f" % (bw["sdpa_flash"] / bw["hopper"]) if "hopper" in bw and "sdpa_flash" in bw else "",
              " vscuDNN %.2f" % (bw["sdpa_cudnn"] / bw["hopper"]) if "hopper" in bw and "sdpa_cudnn" in bw else "",
              flush=True)


if __name__ == "__main__":
    main()
