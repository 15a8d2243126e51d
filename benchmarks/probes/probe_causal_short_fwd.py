"""The causal forward at 1k-2k keys, where the extended sweep left fa_lib below FA2 (d = 64 GQA, d = 128 fp16,
d = 256 GQA at N = 1k): the table's forward blocks against smaller ones, the whole forward timed (least of
`--rounds` do_bench medians, inputs that need grad, as the sweep times them), FA2 beside them; and each
candidate checked by the flash-attn 2x rule (forward and backward, only the forward's blocks replaced) at a
smaller shape of the same head dim. Writes JSON to --out after every row.

    python3 -m benchmarks.probes.probe_causal_short_fwd --out $OUT/probe-causal-short-fwd.json
"""
import argparse
import json
import sys
from pathlib import Path


import torch  # noqa: E402

from benchmarks import bench
from fa_lib import ops  # noqa: E402
from benchmarks.bench_profile import point_inputs  # noqa: E402
from fa_lib.testing import assert_flash_rule, forward_backward, make_inputs, reference_forward_backward  # noqa: E402

POINTS = [  # (the sweep's point, candidates)
    (dict(kind="gqa", dtype="bf16", d=64, causal=True, b=16, hq=32, hkv=8, nq=1024, nk=1024),
     [(64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3), (128, 64, 4, 3)]),
    (dict(kind="gqa", dtype="bf16", d=64, causal=True, b=8, hq=32, hkv=8, nq=2048, nk=2048),
     [(64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3), (128, 64, 4, 3)]),
    (dict(kind="square", dtype="fp16", d=128, causal=True, b=16, hq=16, hkv=16, nq=1024, nk=1024),
     [(64, 32, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3)]),
    (dict(kind="gqa", dtype="bf16", d=256, causal=True, b=16, hq=8, hkv=2, nq=1024, nk=1024),
     [(64, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2)]),
    (dict(kind="gqa", dtype="bf16", d=256, causal=True, b=8, hq=8, hkv=2, nq=2048, nk=2048),
     [(64, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2)]),
]
DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def checked(p, cfg):
    """The 2x rule at B = 1, N = 1023 (causal), with `cfg` as the forward's blocks: None if it holds, else why."""
    q, k, v, do = make_inputs(1, p["hq"], p["hkv"], 1023, 1023, p["d"], DT[p["dtype"]], "cuda", seed=p["d"])
    try:
        with bench.override_config("fwd", cfg):
            out = forward_backward(q, k, v, do, causal=True)
        gold = reference_forward_backward(q, k, v, do, causal=True, upcast=True)
        base = reference_forward_backward(q, k, v, do, causal=True, upcast=False)
        assert_flash_rule(out, gold, base)
        return None
    except AssertionError as e:
        return str(e).splitlines()[0][:200]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    res = {"part": "probe-causal-short-fwd", "environment": bench.environment(),
           "convention": __doc__.split("\n\n")[0], "rows": []}
    for p, cands in POINTS:
        q, k, v, _ = point_inputs(p)
        fa2 = bench._ext_fn("sdpa_flash", p)

        def t(fn):
            fn(q, k, v)
            torch.cuda.synchronize()
            return bench._median_ms(lambda: fn(q, k, v))

        row = dict(p, table=None, candidates={}, checks={})
        # in turn, each round: the table's blocks, FA2, every candidate
        times = {"table": [], "sdpa_flash": [], **{str(c): [] for c in cands}}
        for _ in range(args.rounds):
            times["table"].append(t(lambda q, k, v: ops.flash_attention(q, k, v, causal=True)))
            times["sdpa_flash"].append(t(fa2))
            for c in cands:
                with bench.override_config("fwd", c):
                    times[str(c)].append(t(lambda q, k, v: ops.flash_attention(q, k, v, causal=True)))
        row["ms"] = {name: min(ts) for name, ts in times.items()}
        for c in cands:
            row["checks"][str(c)] = checked(p, c)
        res["rows"].append(row)
        print(p["kind"], p["dtype"], p["d"], p["nq"], {n: round(x, 4) for n, x in row["ms"].items()},
              "checks failed:", {n: e for n, e in row["checks"].items() if e}, flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        del q, k, v
        bench._free()


if __name__ == "__main__":
    main()
