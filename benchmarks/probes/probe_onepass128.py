"""The one-pass backward at head dim 128 (issue 14's cuDNN gap): the shared-tile Gluon kernel (`_attn_bwd256_ws`, two
warpgroups on one tile of keys, dK and dV by head-dim halves) adding dQ in the same pass, five products a step
instead of the two passes' seven, against the shipped backward (`deterministic=True`: the Gluon dK/dV and dQ
kernels side by side), the shipped `deterministic=False` and SDPA's cuDNN backend. Variants of the one pass:
``one_b<keys>_<tma|atomic>``: keys per program (64 or 128) and dQ added by one TMA reduce-add per warpgroup and
step (`kernels_hopper._tma_reduce_add`) or by element-wise atomics; ``one_split``: FlashAttention-3's split instead
(`_attn_bwd_dkdv_ws` with ONE_PASS: each warpgroup its 64 keys' dK and dV, dS through shared memory, each warpgroup
half of dQ's columns, added by TMA reduce-adds), ``one_local``: the same kernel without the hand-over (ONE_PASS_MODE
2: each warpgroup adds its own keys' share of all of dQ's columns), ``_s<n>``: n Q/dO slots, ``_lf``/``_head``: the
causal programs longest first or by head. First the flash-attn 2x rule at awkward shapes
(every variant, outputs poisoned), then the backward's time at extended-sweep points (least of `--rounds` do_bench
medians of `o.backward(do)`, as the sweep times it). Writes JSON to --out after every row.

    python3 -m benchmarks.probes.probe_onepass128 --out $OUT/probe-onepass128.json
"""
import argparse
import json
import sys
import time
from pathlib import Path


import torch  # noqa: E402

from benchmarks import bench
from fa_lib import kernels_hopper, plan  # noqa: E402
from fa_lib.testing import forward_backward, make_inputs  # noqa: E402

from benchmarks.probes.probe_common import best_backward, judge, recorded  # noqa: E402

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
CHECKS = [  # (B, Hq, Hkv, Nq, Nk, causal, dtype, layout), head dim 128
    (2, 4, 4, 1, 1, False, "bf16", "bhnd"), (2, 4, 4, 17, 17, True, "bf16", "bhnd"),
    (1, 4, 2, 113, 113, True, "fp16", "bhnd"), (2, 4, 4, 1000, 1000, False, "bf16", "bnhd"),
    (1, 8, 2, 1023, 1023, True, "bf16", "bnhd"), (1, 4, 4, 300, 1000, True, "bf16", "bhnd"),
    (1, 4, 4, 1000, 300, True, "bf16", "bhnd"), (1, 2, 2, 4096, 4096, True, "bf16", "bhnd"),
    (1, 4, 1, 2048, 2048, False, "fp16", "bnhd"), (1, 2, 2, 4100, 4100, False, "bf16", "bhnd"),
]
DEFAULTS = (kernels_hopper.ONE_PASS_HEAD_DIMS, dict(kernels_hopper.ONE_PASS_BLOCK_N),
            dict(kernels_hopper.ONE_PASS_DQ_TMA), kernels_hopper.BWD_FORCE, kernels_hopper.ONE_PASS_SPLIT_HEAD_DIMS,
            dict(kernels_hopper.ONE_PASS_STAGES), kernels_hopper.ONE_PASS_LONGEST_FIRST, dict(kernels_hopper.ONE_PASS_MODE))


def use(variant):
    """Set kernels_hopper for a provider: ``one_split`` takes the one pass at d = 128 in FlashAttention-3's split
    (`_attn_bwd_dkdv_ws` with ONE_PASS), ``one_b<n>_<tma|atomic>`` in the shared-tile kernel with n keys per
    program, anything else the shipped settings. Returns the provider name bench.ext_bench_one times."""
    heads, block_n, dq_tma, force, split, stages, longest, mode = DEFAULTS
    kernels_hopper.ONE_PASS_MODE.update(mode)
    kernels_hopper.ONE_PASS_BLOCK_N.update(block_n)
    kernels_hopper.ONE_PASS_DQ_TMA.update(dq_tma)
    kernels_hopper.ONE_PASS_STAGES.update(stages)
    kernels_hopper.ONE_PASS_HEAD_DIMS, kernels_hopper.BWD_FORCE = heads, force
    kernels_hopper.ONE_PASS_SPLIT_HEAD_DIMS, kernels_hopper.ONE_PASS_LONGEST_FIRST = split, longest
    kernels_hopper.ONE_PASS_FORCE = False
    if variant.startswith(("one_split", "one_local")):  # one_<split|local>[_s<slots>][_lf|_head]
        kernels_hopper.ONE_PASS_HEAD_DIMS, kernels_hopper.BWD_FORCE = (128,), True
        kernels_hopper.ONE_PASS_SPLIT_HEAD_DIMS, kernels_hopper.ONE_PASS_FORCE = (128,), True
        kernels_hopper.ONE_PASS_MODE[128] = 2 if variant.startswith("one_local") else 1
        for part in variant.split("_")[2:]:
            if part.startswith("s"):
                kernels_hopper.ONE_PASS_STAGES[128] = int(part[1:])
            else:
                kernels_hopper.ONE_PASS_LONGEST_FIRST = part == "lf"
    elif variant.startswith("one_"):
        _, b, how = variant.split("_")
        kernels_hopper.ONE_PASS_BLOCK_N[128] = int(b[1:])
        kernels_hopper.ONE_PASS_DQ_TMA[128] = how == "tma"
        kernels_hopper.ONE_PASS_HEAD_DIMS, kernels_hopper.BWD_FORCE = (128,), True
        kernels_hopper.ONE_PASS_SPLIT_HEAD_DIMS, kernels_hopper.ONE_PASS_FORCE = (), True
    plan.clear()  # (dicts changed in place)
    return "fa_lib_nd" if variant.startswith("one_") else variant


def check(case, variant):
    b, hq, hkv, nq, nk, causal, dt, layout = case
    q, k, v, do = make_inputs(b, hq, hkv, nq, nk, 128, DT[dt], "cuda", seed=nq + hq, layout=layout)
    row = dict(case=case, variant=variant)
    with recorded(row):
        use(variant)
        judge(row, forward_backward(q, k, v, do, causal=causal, deterministic=False), q, k, v, do, causal)
    use("fa_lib")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kinds", nargs="+", default=["square", "gqa"])
    ap.add_argument("--dtypes", nargs="+", default=["bf16"])
    ap.add_argument("--ns", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--causal", nargs="+", default=["no", "yes"])
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--providers", nargs="+", default=["fa_lib", "fa_lib_nd", "one_b128_tma", "one_b128_atomic",
                                                       "one_b64_tma", "one_b64_atomic", "sdpa_cudnn"])
    args = ap.parse_args()
    res = {"part": "probe-onepass128", "environment": bench.environment(),
           "convention": __doc__.split("\n\n")[0], "checks": [], "points": []}
    if not args.no_check:
        for variant in [v for v in args.providers if v.startswith("one_")]:
            for case in CHECKS:
                res["checks"].append(check(case, variant))
                r = res["checks"][-1]
                print("check", variant, case, "ok" if r["ok"] else "FAIL " + r["error"][-600:], flush=True)
                Path(args.out).write_text(json.dumps(res, indent=1))
    causals = tuple(c == "yes" for c in args.causal)
    for p in bench.extended_points(dims=(128,), dtypes=tuple(args.dtypes), kinds=tuple(args.kinds),
                                   ns=tuple(args.ns)):
        if p["causal"] not in causals:
            continue
        row = dict(p, bwd_ms={}, fwd_ms={})
        t0 = time.time()
        for name in args.providers:
            provider = use(name)
            best_backward(row, name, provider, p, args.rounds)
        use("fa_lib")
        row["bwd_tflops"] = {n: bench.ext_flops(p, "bwd") / (ms * 1e-3) / 1e12 for n, ms in row["bwd_ms"].items()}
        row["seconds"] = round(time.time() - t0, 1)
        res["points"].append(row)
        Path(args.out).write_text(json.dumps(res, indent=1))
        bw = row["bwd_ms"]
        cud = bw.get("sdpa_cudnn")
        print(p["dtype"], p["kind"], "causal" if p["causal"] else "full", p["b"], p["hq"], p["hkv"], p["nk"],
              " ".join(f"{n}={v:.3f}" + (f"({cud / v:.2f})" if cud else "") for n, v in bw.items()), flush=True)


if __name__ == "__main__":
    main()
