"""The forward at head dims that are not powers of two, one column tile against two (`ops._head_tiles`,
`kernels._attn_fwd`'s HEAD_DIM2): at d = 96 one tile is 128 columns wide, two are 64 + 32. Every point of the
extended sweep's d = 96 (bf16 and fp16), and a few points at d = 80, 160 and 192, timed forward only (inputs
that need grad, as the sweep times them), the variants in turn inside one process, each the least of `--rounds`
do_bench medians; SDPA's FA2 and cuDNN beside them. Also, at a few d = 96 points, the split with other
block configurations than the table's (--configs). --bwd: the backward too (o.backward, as the sweep times
it), with the variant's setting held through it. Writes JSON to --out.

    python3 -m benchmarks.probes.probe_split_d --configs --out $OUT/split-d-configs.json   # before the table had d = 96
    python3 -m benchmarks.probes.probe_split_d --out $OUT/split-d.json
    python3 -m benchmarks.probes.probe_split_d --bwd --rounds 2 --out $OUT/split-d-bwd.json   # after the backward's port
"""
import argparse
import contextlib
import json
import sys
import time
from pathlib import Path


import torch  # noqa: E402

from benchmarks import bench
from fa_lib import ops  # noqa: E402
from benchmarks.bench_profile import point_inputs  # noqa: E402

VARIANTS = ("one_tile", "split")
CONFIGS = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3)]


def points(quick, kinds=bench.EXT_KINDS, others=True):
    pts = list(bench.extended_points(dims=(96,), dtypes=("bf16",) if quick else ("bf16", "fp16"), kinds=kinds))
    for d in (80, 160, 192) if others else ():
        pts += [p for p in bench.extended_points(dims=(d,), dtypes=("bf16",), kinds=("square", "small"))
                if p["kind"] == "small" or p["nq"] in (4096, 16384)]
    return pts


def time_ms(fn, q, k, v, rounds):
    fn(q, k, v)
    torch.cuda.synchronize()
    return min(bench._median_ms(lambda: fn(q, k, v)) for _ in range(rounds))


@contextlib.contextmanager
def split_set(split):
    before = ops.SPLIT_HEAD_DIM
    ops.SPLIT_HEAD_DIM = split
    try:
        yield
    finally:
        ops.SPLIT_HEAD_DIM = before


def time_bwd_ms(fn, q, k, v, do, rounds, split=None):
    """The backward of fn's output (do_bench medians, least of `rounds`), under `split` if given."""
    with split_set(ops.SPLIT_HEAD_DIM if split is None else split):
        o = fn(q, k, v)
        o.backward(do, retain_graph=True)
        torch.cuda.synchronize()
        return min(bench._median_ms(lambda: o.backward(do, retain_graph=True), grad_to_none=[q, k, v])
                   for _ in range(rounds))


def fa(p, split, config=None):
    def fn(q, k, v):
        before = ops.SPLIT_HEAD_DIM
        ops.SPLIT_HEAD_DIM = split
        try:
            if config is None:
                return ops.flash_attention(q, k, v, causal=p["causal"])
            with bench.override_config("fwd", config):
                return ops.flash_attention(q, k, v, causal=p["causal"])
        finally:
            ops.SPLIT_HEAD_DIM = before
    return fn


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="bf16 only at d = 96")
    ap.add_argument("--configs", action="store_true", help="also time the split with other blocks")
    ap.add_argument("--bwd", action="store_true", help="also time the backward")
    ap.add_argument("--kinds", nargs="+", default=list(bench.EXT_KINDS), help="the d = 96 kinds to time")
    ap.add_argument("--no-others", action="store_true", help="d = 96 only")
    args = ap.parse_args()
    out = {"part": "probe-split-d", "environment": bench.environment(),
           "convention": "fwd ms: least of --rounds do_bench medians (L2 flushed), inputs need grad; one_tile: "
                         "SPLIT_HEAD_DIM = False; split: True; configs: the split with the fwd table's answer "
                         "replaced; bwd_ms (--bwd): o.backward(do) the same way, the setting held through it",
           "bwd": args.bwd, "points": []}
    t0 = time.time()
    for p in points(args.quick, args.kinds, not args.no_others):
        q, k, v, do = point_inputs(p)
        row = dict(p, ms={}, bwd_ms={})
        for name in VARIANTS:
            row["ms"][name] = time_ms(fa(p, name == "split"), q, k, v, args.rounds)
            if args.bwd:
                row["bwd_ms"][name] = time_bwd_ms(fa(p, name == "split"), q, k, v, do, args.rounds,
                                                  split=name == "split")
        for prov in ("sdpa_flash", "sdpa_cudnn"):
            try:
                row["ms"][prov] = time_ms(bench._ext_fn(prov, p), q, k, v, args.rounds)
                if args.bwd:
                    row["bwd_ms"][prov] = time_bwd_ms(bench._ext_fn(prov, p), q, k, v, do, args.rounds)
            except RuntimeError as e:
                row["ms"][prov] = None
                row[f"{prov}_error"] = str(e).splitlines()[0][:200]
        if args.configs and p["d"] == 96 and p["dtype"] == "bf16" and p["kind"] in ("square", "small") and \
                (p["kind"] == "small" or p["nq"] in (1024, 4096, 16384)):
            row["configs"] = {}
            for c in CONFIGS:
                try:
                    row["configs"][",".join(map(str, c))] = time_ms(fa(p, True, c), q, k, v, args.rounds)
                except Exception as e:  # noqa: BLE001 -- a config that does not compile or fit
                    row["configs"][",".join(map(str, c))] = f"{type(e).__name__}: {str(e)[:120]}"
        ms = row["ms"]
        print(p["kind"], p["dtype"], p["d"], p["causal"], p["b"], p["hq"], p["hkv"], p["nq"], p["nk"],
              " ".join(f"{k}={v:.4f}" for k, v in ms.items() if v is not None),
              f"split/one={ms['one_tile'] / ms['split']:.3f}",
              f"vsFA2={ms['sdpa_flash'] / ms['split']:.3f}" if ms.get("sdpa_flash") else "",
              " ".join(f"bwd_{k}={v:.4f}" for k, v in row["bwd_ms"].items()),
              f"bwd split/one={row['bwd_ms']['one_tile'] / row['bwd_ms']['split']:.3f}" if args.bwd else "",
              f"bwd vsFA2={row['bwd_ms']['sdpa_flash'] / row['bwd_ms']['split']:.3f}"
              if row["bwd_ms"].get("sdpa_flash") else "",
              row.get("configs", ""), flush=True)
        out["points"].append(row)
        del q, k, v, do
        bench._free()
        Path(args.out).write_text(json.dumps(out, indent=1))
    out["seconds"] = time.time() - t0
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
