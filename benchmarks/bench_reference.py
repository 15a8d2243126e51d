"""CPU benchmark of the NumPy reference: ``python -m benchmarks.bench_reference``.

Times ``naive_attention`` against ``flash_forward`` (float32, one head, d = 64) and measures the peak
memory of each with ``tracemalloc`` (NumPy reports its allocations to it). Targets from the project's
issue: at N = 4096 and 8192 the tiled forward is within 1.5x the naive time, and at N = 8192 its peak
memory is at least 8x lower. Timings are the median of ``--repeats`` runs; memory is measured in a
separate, untimed run because tracing slows allocation down.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import tracemalloc

import numpy as np

from fa_lib import reference as ref


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_bytes(fn, *args, **kwargs) -> int:
    """Peak bytes allocated while ``fn(*args, **kwargs)`` runs, above what was live before the call,
    as tracemalloc sees them (NumPy reports its array allocations to it)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    try:
        fn(*args, **kwargs)
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def run(ns=(4096, 8192), d=64, block_q=256, block_k=1024, repeats=3, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for n in ns:
        q, k, v = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(3))
        naive = lambda: ref.naive_attention(q, k, v)  # noqa: E731
        flash = lambda: ref.flash_forward(q, k, v, block_q=block_q, block_k=block_k)  # noqa: E731
        o_n, _ = naive()
        o_f, _ = flash()
        row = {
            "n": n,
            "d": d,
            "block_q": block_q,
            "block_k": block_k,
            "max_abs_diff": float(np.max(np.abs(o_n - o_f))),
            "naive_s": _median_seconds(naive, repeats),
            "flash_s": _median_seconds(flash, repeats),
            "naive_peak_bytes": peak_bytes(naive),
            "flash_peak_bytes": peak_bytes(flash),
        }
        row["time_ratio"] = row["flash_s"] / row["naive_s"]
        row["memory_ratio"] = row["naive_peak_bytes"] / row["flash_peak_bytes"]
        rows.append(row)
    return {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "dtype": "float32",
        "repeats": repeats,
        "rows": rows,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--block-q", type=int, default=256)
    parser.add_argument("--block-k", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    result = run(args.n, args.d, args.block_q, args.block_k, args.repeats)
    print(f"{result['machine']['processor']}, {result['machine']['cpu_count']} cores, numpy {np.__version__}")
    print(f"{'N':>6} {'naive s':>8} {'flash s':>8} {'time x':>7} {'naive MiB':>10} {'flash MiB':>10} {'mem /':>6}  target")
    for r in result["rows"]:
        ok_time = r["time_ratio"] <= 1.5
        ok_mem = r["n"] < 8192 or r["memory_ratio"] >= 8
        print(
            f"{r['n']:>6} {r['naive_s']:>8.3f} {r['flash_s']:>8.3f} {r['time_ratio']:>7.2f} "
            f"{r['naive_peak_bytes'] / 2**20:>10.1f} {r['flash_peak_bytes'] / 2**20:>10.1f} "
            f"{r['memory_ratio']:>6.1f}  {'met' if ok_time and ok_mem else 'MISSED'}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
