"""The sm_90 backward at head dim 256 (`fa_lib.kernels_hopper._attn_bwd256_ws`: two warpgroups share a tile of
64 keys, S^T and dP^T split by query rows, dK, dV and dQ by head-dim halves) against the teaching kernels, SDPA's
FA2 and cuDNN: first the flash-attn 2x rule (forward and backward through `flash_attention`, outputs poisoned)
on awkward shapes, both `deterministic` settings, the gradients compared to the teaching kernels'; then the
backward's time at extended-sweep points (least of `--rounds` do_bench medians of `o.backward(do)`, as the
sweep times it). Providers: teach / hopper (deterministic=True: dK/dV by the teaching or the Gluon kernel, dQ by
the teaching dQ kernel), teach_nd (deterministic=False, the teaching kernels' choice) and hopper_nd (deterministic=False
with the Gluon kernel's one pass, dQ added atomically: `kernels_hopper.ONE_PASS_HEAD_DIMS = (256,)`), sdpa_flash, sdpa_cudnn. Writes JSON to --out after every row.

    python3 -m benchmarks.probes.probe_hopper_bwd256 --out $OUT/probe-hopper-bwd256.json
"""
import argparse
import json
import sys
import time
from pathlib import Path


import torch  # noqa: E402

from benchmarks import bench
from fa_lib import kernels_hopper  # noqa: E402
from fa_lib.testing import forward_backward, make_inputs  # noqa: E402

from benchmarks.probes.probe_common import best_backward, judge, recorded  # noqa: E402

DEFAULT_ONE_PASS = kernels_hopper.ONE_PASS_HEAD_DIMS
DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
CHECKS = [  # (B, Hq, Hkv, Nq, Nk, causal, dtype, layout), all at head dim 256
    (2, 4, 4, 1, 1, False, "bf16", "bhnd"), (2, 4, 4, 17, 17, True, "bf16", "bhnd"),
    (1, 4, 2, 113, 113, True, "fp16", "bhnd"), (2, 4, 4, 1000, 1000, False, "bf16", "bnhd"),
    (1, 8, 2, 1023, 1023, True, "bf16", "bnhd"), (1, 4, 4, 300, 1000, True, "bf16", "bhnd"),
    (1, 4, 4, 1000, 300, True, "bf16", "bhnd"), (1, 4, 1, 200, 4100, True, "bf16", "bhnd"),
    (1, 4, 4, 1000, 300, False, "fp16", "bhnd"), (1, 2, 2, 2048, 2048, False, "fp16", "bnhd"),
    (1, 2, 2, 4096, 4096, True, "bf16", "bhnd"),
]


def check(case, deterministic):
    b, hq, hkv, nq, nk, causal, dt, layout = case
    q, k, v, do = make_inputs(b, hq, hkv, nq, nk, 256, DT[dt], "cuda", seed=nq + nk, layout=layout)
    row = dict(case=case, deterministic=deterministic)
    with recorded(row):
        kernels_hopper.BWD_ENABLED = True
        kernels_hopper.ONE_PASS_HEAD_DIMS = () if deterministic else (256,)  # check the one pass too
        kernels_hopper.ONE_PASS_FORCE = not deterministic
        out = forward_backward(q, k, v, do, causal=causal, deterministic=deterministic)
        if deterministic:
            again = forward_backward(q, k, v, do, causal=causal, deterministic=deterministic)
            row["bitwise_repeat"] = all(torch.equal(out[n], again[n]) for n in ("dq", "dk", "dv"))
        kernels_hopper.BWD_ENABLED = False
        teach = forward_backward(q, k, v, do, causal=causal, deterministic=deterministic)
        kernels_hopper.BWD_ENABLED = True
        row["max_diff_teach"] = {n: (out[n].float() - teach[n].float()).abs().max().item() for n in ("dk", "dv", "dq")}
        judge(row, out, q, k, v, do, causal, digits=3)
    kernels_hopper.BWD_ENABLED, kernels_hopper.ONE_PASS_HEAD_DIMS = True, DEFAULT_ONE_PASS
    kernels_hopper.ONE_PASS_FORCE = False
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--kinds", nargs="+", default=["square", "gqa", "prefill", "small"])
    ap.add_argument("--dtypes", nargs="+", default=["bf16"])
    ap.add_argument("--ns", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--providers", nargs="+",
                    default=["hopper", "hopper_nd", "teach", "teach_nd", "sdpa_flash", "sdpa_cudnn"])
    args = ap.parse_args()
    res = {"part": "probe-hopper-bwd256", "environment": bench.environment(),
           "convention": __doc__.split("\n\n")[0], "checks": [], "points": []}
    if not args.no_check:
        for case in CHECKS:
            for det in (True, False):
                res["checks"].append(check(case, det))
                print("check", res["checks"][-1], flush=True)
                Path(args.out).write_text(json.dumps(res, indent=1))
    for p in bench.extended_points(dims=(256,), dtypes=tuple(args.dtypes), kinds=tuple(args.kinds),
                                   ns=tuple(args.ns)):
        row = dict(p, bwd_ms={}, fwd_ms={})
        t0 = time.time()
        for name in args.providers:
            kernels_hopper.BWD_ENABLED = name.startswith("hopper")
            kernels_hopper.ONE_PASS_HEAD_DIMS = (256,) if name == "hopper_nd" else DEFAULT_ONE_PASS
            kernels_hopper.ONE_PASS_FORCE = name == "hopper_nd"
            provider = name if name.startswith("sdpa") else "fa_lib_nd" if name.endswith("_nd") else "fa_lib"
            best_backward(row, name, provider, p, args.rounds)
        kernels_hopper.BWD_ENABLED, kernels_hopper.ONE_PASS_HEAD_DIMS = True, DEFAULT_ONE_PASS
        kernels_hopper.ONE_PASS_FORCE = False
        bw = row["bwd_ms"]
        row["seconds"] = round(time.time() - t0, 1)
        res["points"].append(row)
        Path(args.out).write_text(json.dumps(res, indent=1))
        fa2 = bw.get("sdpa_flash")
        print(p["dtype"], p["kind"], "causal" if p["causal"] else "full", p["b"], p["nq"], p["nk"],
              " ".join(f"{n}={v:.3f}" for n, v in bw.items()),
              " vsFA2 " + " ".join(f"{n}:{fa2 / v:.2f}" for n, v in bw.items() if fa2 and not n.startswith("sdpa")),
              flush=True)


if __name__ == "__main__":
    main()
