"""Probe of the masked backward against FlexAttention's (issue 13), on a CUDA machine.

For each point: fa_lib's backward (default blocks, then each candidate block configuration of the dK/dV
and the dQ kernel), FlexAttention's backward (forward+backward minus forward, as ``bench --masks``), and
both split per kernel (torch.profiler, device time per kernel name). Writes JSON to ``--out``.

    python3 -m benchmarks.probes.probe_mask_bwd --out $OUT/probe.json
"""
import argparse
import json
import sys
import time
from pathlib import Path


import torch  # noqa: E402

from benchmarks import bench
from benchmarks.probes.probe_variants import kernel_times as _kernel_times  # noqa: E402


def kernel_times(fn):
    return _kernel_times(fn, reps=10, prefix=None)


DKDV = [(32, 64, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 2),
        (32, 64, 4, 4), (64, 64, 8, 3), (16, 64, 4, 4), (32, 64, 4, 2)]
DQ = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3), (64, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 4),
      (128, 128, 8, 2), (64, 128, 8, 3)]


MODES = (True, False)  # fa_lib.ops.CONCURRENT_BACKWARD, interleaved `--rounds` times
TAGS = {True: "concurrent", False: "serial"}


def time_modes(fns, grads, rounds):
    """Time each of `fns` ({key: fn}, a key holding "{tag}") under each fa_lib.ops.CONCURRENT_BACKWARD
    mode, the modes interleaved `rounds` times: {key with its tag: [ms of each round]}."""
    from fa_lib import ops

    before, out = ops.CONCURRENT_BACKWARD, {}
    try:
        for concurrent in MODES * rounds:
            ops.CONCURRENT_BACKWARD = concurrent
            for key, fn in fns.items():
                fn()  # compiled and warm in this mode
                out.setdefault(key.format(tag=TAGS[concurrent]), []).append(bench._median_ms(fn, grad_to_none=grads))
    finally:
        ops.CONCURRENT_BACKWARD = before
    return out


def dense_streams(ns=(2048, 4096, 16384), tokens=16384, h=16, d=128, rounds=1):
    """fa_lib's dense backward (bf16, B*N = 16k, H = 16, D = 128, causal and not; D = 64 and GQA 32/8 at 4k)
    with the dQ kernel concurrent with the dK/dV kernel and after it."""
    from fa_lib import flash_attention

    rows = []
    shapes = [(n, h, h, d, c) for n in ns for c in (True, False)] + [(4096, h, h, 64, True), (4096, 32, 8, d, True)]
    for n, hq, hkv, dd, causal in shapes:
        b = tokens // n
        q = torch.randn(b, hq, n, dd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, hkv, n, dd, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
        do = torch.randn_like(q)
        o = flash_attention(q, k, v, causal=causal)
        row = dict(n=n, b=b, hq=hq, hkv=hkv, d=dd, causal=causal)
        row.update(time_modes({"{tag}_ms": lambda: o.backward(do, retain_graph=True)}, [q, k, v], rounds))
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--labels", nargs="*", default=["window1024", "window4096", "varlen"])
    ap.add_argument("--ns", nargs="*", type=int, default=[8192, 16384])
    ap.add_argument("--configs", action="store_true", help="also sweep the dK/dV and dQ blocks")
    ap.add_argument("--streams", action="store_true",
                    help="also time fa_lib's backward with the dQ kernel after the dK/dV kernel on one stream "
                         "(fa_lib.ops.CONCURRENT_BACKWARD = False) and forward+backward both ways")
    ap.add_argument("--no-flex", action="store_true", help="fa_lib only")
    ap.add_argument("--rounds", type=int, default=1, help="--streams: time each mode this many times, interleaved")
    args = ap.parse_args()
    pts = [p for p in bench.mask_points(ns=args.ns, kinds=("varlen", "window", "padding", "softcap"))
           if p["label"] in args.labels]
    res = {"env": bench.environment(), "points": []}
    if args.streams:
        res["dense"] = dense_streams(rounds=args.rounds)
        print(json.dumps(res["dense"]), flush=True)
    for p in pts:
        t0 = time.time()
        row = {k: p[k] for k in ("label", "n", "b", "hq", "hkv", "window")}
        q0, k0, v0 = (torch.randn(p["b"] * p["n"], h, p["d"], device="cuda", dtype=torch.bfloat16)
                      for h in (p["hq"], p["hkv"], p["hkv"]))
        do0 = torch.randn_like(q0)
        for prov in ("fa_lib",) if args.no_flex else ("fa_lib", "flex"):
            layout, make = bench.mask_provider(prov, p, "cuda")
            q, k, v, do = (bench._to_layout(x, layout, p["b"], p["n"]).detach().clone().requires_grad_(x is not do0)
                           for x in (q0, k0, v0, do0))
            fn = make(q, k, v)

            def fwd_bwd():
                fn().backward(do)
            if prov == "fa_lib":
                o = fn()
                bwd = lambda: o.backward(do, retain_graph=True)  # noqa: E731
                row["fa_lib_bwd_ms"] = bench._median_ms(bwd, grad_to_none=[q, k, v])
                row["fa_lib_kernels"] = kernel_times(bwd)
                if args.streams:
                    row.update(time_modes({"fa_lib_bwd_{tag}_ms": bwd, "fa_lib_fwd_bwd_{tag}_ms": fwd_bwd},
                                          [q, k, v], args.rounds))
                if args.configs:
                    for kern, cands in (("dkdv", DKDV), ("dq", DQ)):
                        for c in cands:
                            key = f"{kern}:{c}"
                            try:
                                with bench.override_config(kern, c):
                                    o = fn()
                                    o.backward(do, retain_graph=True)
                                    row[key] = bench._median_ms(lambda: o.backward(do, retain_graph=True),
                                                                grad_to_none=[q, k, v])
                            except Exception as e:
                                row[key] = f"{type(e).__name__}: {str(e)[:100]}"
                            print(p["label"], p["n"], key, row[key], flush=True)
                o = None
            else:
                fwd_bwd()
                row["flex_fwd_ms"] = bench._median_ms(fn)
                row["flex_fwd_bwd_ms"] = bench._median_ms(fwd_bwd, grad_to_none=[q, k, v])
                row["flex_bwd_ms"] = row["flex_fwd_bwd_ms"] - row["flex_fwd_ms"]
                row["flex_kernels"] = kernel_times(fwd_bwd)
        row["seconds"] = time.time() - t0
        print(json.dumps({k: v for k, v in row.items()}, default=str), flush=True)
        res["points"].append(row)
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
