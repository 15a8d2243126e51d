"""The backward at head dim 256, where the dK/dV kernel spills (benchmarks/data/profile-nvidia-h200.json: 255
registers, 602 MB of local loads at causal N = 4k): the whole backward timed with only one kernel's blocks
replaced (two passes, `deterministic=True`), and the one-pass backward (dQ by TMA reduce-adds,
`ops.ONE_PASS_BACKWARD = 2`) with fixed blocks for its dK/dV kernel; SDPA's FA2 and cuDNN beside them. Each
time the least of `--rounds` do_bench medians; each compiled kernel's registers and spilled bytes are read
from the launch cache. Writes JSON to --out after every row.

    python3 -m benchmarks.probes.probe_d256_bwd --out $OUT/d256-bwd.json
"""
import argparse
import contextlib
import json
import sys
from pathlib import Path


import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks import bench
from fa_lib import kernels, launch, ops  # noqa: E402
from benchmarks.bench_profile import point_inputs  # noqa: E402

POINTS = [dict(dtype="bf16", d=256, causal=c, b=b, hq=8, hkv=8, nq=n, nk=n)
          for c in (True, False) for b, n in ((4, 4096), (1, 16384))]
DKDV = [(32, 64, 16, 2), (64, 64, 16, 2), (64, 64, 16, 1), (16, 64, 8, 2)]
DQ = [(128, 32, 16, 1), (128, 64, 16, 2)]
ONEPASS = [(32, 64, 8, 2), (64, 64, 16, 2)]
VARIANTS = ("table", "dkdv", "dq", "onepass", "tiles128", "sdpa_flash", "sdpa_cudnn")


@contextlib.contextmanager
def tiles_128():
    """The backward's head dim 256 as two column tiles of 128 (`ops._head_tiles`) instead of one of 256."""
    real = ops._head_tiles
    ops._head_tiles = lambda d: (128, 128) if d == 256 else real(d)
    try:
        yield
    finally:
        ops._head_tiles = real


@contextlib.contextmanager
def one_pass(config):
    """deterministic=False with the one-pass backward (TMA reduce-adds) and `config` for its dK/dV kernel."""
    before = ops.ONE_PASS_BACKWARD, kernels._attn_bwd_dkdv_atomic_tuned
    bm, bn, w, s = config
    ops.ONE_PASS_BACKWARD = 2
    kernels._attn_bwd_dkdv_atomic_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)],
        reset_to_zero=["DQ"], key=kernels._TUNE["key"])(kernels._attn_bwd_dkdv_atomic)
    try:
        yield
    finally:
        ops.ONE_PASS_BACKWARD, kernels._attn_bwd_dkdv_atomic_tuned = before


def kernel_stats():
    """{kernel name: [(num_warps, num_stages, BLOCK_M, BLOCK_N, regs, spill bytes)]} of the launch cache and
    of the one-pass autotuner's kernel."""
    out = {}
    for fn, entries in launch._CACHE.items():
        for key, (compiled, _tail) in entries.items():
            kw = dict(key[1][1])
            out.setdefault(fn.fn.__name__ if hasattr(fn, "fn") else str(fn), []).append(
                [kw.get("num_warps"), kw.get("num_stages"), kw.get("BLOCK_M"), kw.get("BLOCK_N"),
                 getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)])
    try:
        for dev, cache in kernels._attn_bwd_dkdv_atomic.device_caches.items():
            for compiled in cache[0].values():
                md = compiled.metadata
                out.setdefault("_attn_bwd_dkdv_atomic", []).append(
                    [md.num_warps, md.num_stages, None, None, compiled.n_regs, compiled.n_spills])
    except Exception as e:  # noqa: BLE001 (diagnostic only)
        out["atomic_error"] = repr(e)
    return {k: sorted({tuple(x) for x in v}, key=str) if isinstance(v, list) else v for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--points", type=int, default=len(POINTS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = ap.parse_args()
    res = {"part": "probe-d256-bwd", "environment": bench.environment(), "convention": __doc__.split("\n\n")[0],
           "rows": []}

    def write():
        res["kernels"] = kernel_stats()
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))

    for p in POINTS[:args.points]:
        q, k, v, do = point_inputs(p)

        ref = []  # the table's gradients: every variant is compared with them

        def timed(fn, det=True):
            o = fn(q, k, v) if fn is not None else ops.flash_attention(q, k, v, causal=p["causal"],
                                                                        deterministic=det)
            q.grad = k.grad = v.grad = None
            o.backward(do, retain_graph=True)
            torch.cuda.synchronize()
            grads = [t.grad.float() for t in (q, k, v)]
            if ref:
                row["max_err_vs_table"] = max((g - r).abs().max().item() for g, r in zip(grads, ref))
            else:
                ref.extend(grads)
            return min(bench._median_ms(lambda: o.backward(do, retain_graph=True), grad_to_none=[q, k, v])
                       for _ in range(args.rounds))

        trials = [("table", None, None, None)]  # always first: the other variants' gradients are checked against it
        trials += [("dkdv", c, None, None) for c in DKDV] + [("dq", c, None, None) for c in DQ]
        trials += [("onepass", c, None, None) for c in ONEPASS] + [("tiles128", None, None, None)]
        trials += [("sdpa_flash", None, None, bench._ext_fn("sdpa_flash", p)),
                   ("sdpa_cudnn", None, None, bench._ext_fn("sdpa_cudnn", p))]
        for name, cfg, _, fn in trials:
            if name != "table" and name not in args.variants:
                continue
            row = dict(p, variant=name, config=cfg, ms=None)
            try:
                if name in ("dkdv", "dq"):
                    with bench.override_config(name, cfg):
                        row["ms"] = timed(None)
                elif name == "tiles128":
                    with tiles_128():
                        row["ms"] = timed(None)
                elif name == "onepass":
                    with one_pass(cfg):
                        row["ms"] = timed(None, det=False)
                else:
                    row["ms"] = timed(fn)
            except Exception as e:  # noqa: BLE001 (a config the compiler refuses)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                torch.cuda.synchronize()
            res["rows"].append(row)
            print(p["causal"], p["nq"], name, cfg, row["ms"] and round(row["ms"], 3), row.get("error", ""),
                  flush=True)
            write()
        del q, k, v, do
        bench._free()
    write()


if __name__ == "__main__":
    main()
