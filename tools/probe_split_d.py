"""The forward at head dims that are not powers of two, one column tile against two (`ops._head_tiles`,
`kernels._attn_fwd`'s HEAD_DIM2): at d = 96 one tile is 128 columns wide, two are 64 + 32. Every point of the
extended sweep's d = 96 (bf16 and fp16), and a few points at d = 80, 160 and 192, timed forward only (inputs
that need grad, as the sweep times them), the variants in turn inside one process, each the least of `--rounds`
do_bench medians; SDPA's FA2 and cuDNN beside them. Also, at a few d = 96 points, the split with other
block configurations than the table's (--configs). Writes JSON to --out.

    python3 tools/probe_split_d.py --configs --out $OUT/split-d-configs.json   # before the table had d = 96
    python3 tools/probe_split_d.py --out $OUT/split-d.json
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fa_lib import bench, ops  # noqa: E402
from fa_lib.bench_profile import point_inputs  # noqa: E402

VARIANTS = ("one_tile", "split")
CONFIGS = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3)]


def points(quick):
    pts = list(bench.extended_points(dims=(96,), dtypes=("bf16",) if quick else ("bf16", "fp16")))
    for d in (80, 160, 192):
        pts += [p for p in bench.extended_points(dims=(d,), dtypes=("bf16",), kinds=("square", "small"))
                if p["kind"] == "small" or p["nq"] in (4096, 16384)]
    return pts


def time_ms(fn, q, k, v, rounds):
    fn(q, k, v)
    torch.cuda.synchronize()
    return min(bench._median_ms(lambda: fn(q, k, v)) for _ in range(rounds))


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
    args = ap.parse_args()
    out = {"part": "probe-split-d", "environment": bench.environment(),
           "convention": "fwd ms: least of --rounds do_bench medians (L2 flushed), inputs need grad; one_tile: "
                         "SPLIT_HEAD_DIM = False; split: True; configs: the split with the fwd table's answer "
                         "replaced", "points": []}
    t0 = time.time()
    for p in points(args.quick):
        q, k, v, _ = point_inputs(p)
        row = dict(p, ms={})
        for name in VARIANTS:
            row["ms"][name] = time_ms(fa(p, name == "split"), q, k, v, args.rounds)
        for prov in ("sdpa_flash", "sdpa_cudnn"):
            try:
                row["ms"][prov] = time_ms(bench._ext_fn(prov, p), q, k, v, args.rounds)
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
              row.get("configs", ""), flush=True)
        out["points"].append(row)
        del q, k, v
        bench._free()
        Path(args.out).write_text(json.dumps(out, indent=1))
    out["seconds"] = time.time() - t0
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
