"""Why a point is slow: ``python -m benchmarks.bench --profile`` (issue 14's "measured reason").

Runs Nsight Compute (``ncu``, hardware counters; ``--clock-control none`` so the clocks are the card's
own) over one forward and one backward of each provider at the points where fa_lib misses a target,
and writes per kernel: duration, registers per thread, shared memory per block, theoretical and
achieved occupancy, the occupancy limiter, SM and memory throughput (% of peak), DRAM bytes, local
memory (register spill) traffic, and the tensor-core rate the kernel reached (the point's FLOPs
divided by the summed kernel time of the pass, against the measured bf16 matmul ceiling).

How the kernels are attributed: a child process (this module with ``--child``) runs every region
(point x provider x pass) twice to compile and warm up, then once more between ``cudaProfilerStart`` and
``cudaProfilerStop`` (ncu ``--profile-from-start off``), with a tiny marker kernel launched before each
region. The ncu rows are split at the
markers, in order. -> ``profile-<device>.json``.
"""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys

# The miss categories of the extended sweep and the d = 96/256 runs (issue 14), one point each.
POINTS = (
    dict(name="d128-full-8k", dtype="bf16", d=128, causal=False, b=2, hq=16, hkv=16, nq=8192, nk=8192),
    dict(name="d128-causal-8k", dtype="bf16", d=128, causal=True, b=2, hq=16, hkv=16, nq=8192, nk=8192),
    dict(name="d256-causal-4k", dtype="bf16", d=256, causal=True, b=4, hq=8, hkv=8, nq=4096, nk=4096),
    dict(name="d96-causal-4k", dtype="bf16", d=96, causal=True, b=4, hq=20, hkv=20, nq=4096, nk=4096),
    dict(name="prefill-512x8k", dtype="bf16", d=128, causal=False, b=2, hq=16, hkv=16, nq=512, nk=8192),
    dict(name="small-64x256", dtype="bf16", d=128, causal=True, b=64, hq=16, hkv=16, nq=256, nk=256),
)
PROFILE_PROVIDERS = ("fa_lib", "fa_lib_nd", "sdpa_flash", "sdpa_cudnn")
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "ComputeWorkloadAnalysis")
SPILL_METRICS = "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum"
MARKER = "_fa_profile_marker"

# ncu raw columns kept per kernel (renamed); every column whose name holds "local" is kept too (spills).
COLUMNS = {
    "gpu__time_duration.sum": "ms",
    "launch__registers_per_thread": "registers",
    "launch__shared_mem_per_block": "smem_per_block",
    "launch__block_size": "block_size",
    "launch__grid_size": "grid_size",
    "launch__occupancy_limit_registers": "blocks_limit_registers",
    "launch__occupancy_limit_shared_mem": "blocks_limit_smem",
    "launch__occupancy_limit_warps": "blocks_limit_warps",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical_occupancy_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_throughput_pct",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "memory_throughput_pct",
    "dram__bytes.sum": "dram_bytes",
    "launch__waves_per_multiprocessor": "waves",
}


def point_inputs(p):
    """q, k, v (requiring grad) and dO of one point, on the GPU, seeded."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[p["dtype"]]
    q = torch.randn(p["b"], p["hq"], p["nq"], p["d"], device="cuda", dtype=dt, generator=gen)
    k, v = (torch.randn(p["b"], p["hkv"], p["nk"], p["d"], device="cuda", dtype=dt, generator=gen)
            for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, torch.randn_like(q)


def child(points, providers, regions_path):
    """Run every region twice to warm up, then once between cudaProfilerStart/Stop with a marker before each."""
    import torch
    import triton
    import triton.language as tl

    from .bench import _ext_fn

    @triton.jit
    def _fa_profile_marker(X):
        tl.store(X, 1.0)

    flag = torch.zeros(1, device="cuda")
    prepared = []
    for p in points:
        q, k, v, do = point_inputs(p)
        for prov in providers:
            prepared.append((p, prov, _ext_fn(prov, p), (q, k, v, do)))
    regions = []

    def run_all(mark):
        for p, prov, fn, (q, k, v, do) in prepared:
            for t in (q, k, v):
                t.grad = None
            if mark:
                _fa_profile_marker[(1,)](flag)
                regions.append((p["name"], prov, "fwd"))
            try:
                o = fn(q, k, v)
            except RuntimeError as e:  # a backend that refuses the shape: no kernels, empty region
                if mark:
                    _fa_profile_marker[(1,)](flag)
                    regions.append((p["name"], prov, "bwd"))
                    print(f"{p['name']} {prov}: {str(e).splitlines()[0][:120]}", flush=True)
                continue
            if mark:
                torch.cuda.synchronize()
                _fa_profile_marker[(1,)](flag)
                regions.append((p["name"], prov, "bwd"))
            o.backward(do)
            torch.cuda.synchronize()

    run_all(False)
    run_all(False)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()  # cudaProfilerStart: process-wide, so autograd's backward thread is seen too
    run_all(True)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    with open(regions_path, "w") as f:
        json.dump(regions, f)


def host_costs(points, providers, calls=30):
    """Per point, provider and pass: the host's time to issue one call (perf_counter around `calls` calls
    issued back to back, no synchronisation inside) and the time per call of the same stream of calls on
    the GPU (CUDA events, no L2 flush). A pass whose host time is the larger is host-bound: the GPU
    waits for Python."""
    import time

    import torch

    from .bench import _ext_fn

    out = []
    for p in points:
        q, k, v, do = point_inputs(p)
        for prov in providers:
            fn = _ext_fn(prov, p)
            try:
                for _ in range(3):
                    fn(q, k, v).backward(do)
            except RuntimeError:
                continue
            o = fn(q, k, v)
            calls_of = {"fwd": lambda: fn(q, k, v), "bwd": lambda: o.backward(do, retain_graph=True)}
            for mode, call in calls_of.items():
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                for _ in range(calls):
                    call()
                end.record()
                host = (time.perf_counter() - t0) / calls * 1e3
                end.synchronize()
                out.append(dict(point=p["name"], provider=prov, mode=mode, host_ms=host,
                                stream_ms=start.elapsed_time(end) / calls))
            del o
    return out


def _kept(col):
    """Raw ncu columns kept besides COLUMNS: local-memory (spill) bytes, and the tensor pipes' busy share
    (any tensor pipe; Hopper's warpgroup MMA "gmma", which Triton and cuDNN use; the warp-level "hmma"
    of FA2) as the average over SMs of the percentage of peak while active."""
    if "local" in col and col.endswith(".sum"):
        return True
    return col.endswith(".avg.pct_of_peak_sustained_active") and any(
        t in col for t in ("pipe_tensor_cycles_active", "pipe_tensor_op_gmma_cycles", "pipe_tensor_op_hmma_cycles"))


def _float(s):
    try:
        return float(s.replace(",", ""))
    except (AttributeError, ValueError):
        return s


def parse_ncu_csv(text):
    """ncu --csv --page raw: a header row, a units row, then one row per kernel -> list of dicts with the
    kept columns (durations converted to ms from ncu's unit)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise RuntimeError("no ncu CSV in the output:\n" + text[-2000:])
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, units, body = rows[0], rows[1], rows[2:]
    out = []
    for r in body:
        if len(r) != len(header):
            continue
        cell = dict(zip(header, r))
        unit = dict(zip(header, units))
        k = {"kernel": cell.get("Kernel Name", "")}
        for col, name in COLUMNS.items():
            if col in cell:
                k[name] = _float(cell[col])
                if name == "ms":
                    k["ms_unit"] = unit[col]
                    k[name] = k[name] * {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0,
                                         "ms": 1.0, "second": 1e3, "s": 1e3}.get(unit[col], float("nan"))
        for col in header:
            if _kept(col):
                k[col] = _float(cell[col])
        out.append(k)
    return out


def split_regions(kernels, regions):
    """Split the ncu rows at the marker kernels: the i-th marker starts the i-th region."""
    groups, current = [], None
    for k in kernels:
        if MARKER in k["kernel"]:
            current = []
            groups.append(current)
        elif current is not None:
            current.append(k)
    if len(groups) != len(regions):
        raise RuntimeError(f"{len(groups)} markers profiled for {len(regions)} regions")
    return [dict(point=n, provider=prov, mode=mode, kernels=ks) for (n, prov, mode), ks in zip(regions, groups)]


def summarize(region, point, matmul_tflops):
    """The pass's summed kernel time, its TFLOP/s and the share of the matmul ceiling, and the longest
    kernel's occupancy figures (the one that sets the pass's speed)."""
    from .bench import ext_flops

    ks = region["kernels"]
    total = sum(k.get("ms", 0.0) for k in ks)
    out = {"kernel_ms": total}
    if ks and total > 0:
        tf = ext_flops(point, region["mode"]) / (total * 1e-3) / 1e12
        out.update(tflops=tf, of_matmul_ceiling=tf / matmul_tflops)
        main = max(ks, key=lambda k: k.get("ms", 0.0))
        out["main_kernel"] = {key: main.get(key) for key in ("kernel", "ms", "registers", "smem_per_block",
                                                             "theoretical_occupancy_pct", "achieved_occupancy_pct",
                                                             "sm_throughput_pct", "memory_throughput_pct",
                                                             "grid_size", "waves")}
        out["local_bytes"] = sum(v for k in ks for c, v in k.items() if "local" in c and isinstance(v, float))
    return out


def run_profile(args):
    from .bench import _write, environment, measure_ceilings

    ncu = shutil.which("ncu") or "/opt/nvidia/nsight-compute/2025.3.1/ncu"
    points = [p for p in POINTS if not args.profile_points or p["name"] in args.profile_points]
    regions_path = os.path.join(args.out_dir, ".profile-regions.json")
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
           "--target-processes", "all"]
    for s in SECTIONS:
        cmd += ["--section", s]
    child_cmd = [sys.executable, "-m", "benchmarks.bench_profile", "--child", "--regions", regions_path,
                 "--points", *[p["name"] for p in points]]
    proc = subprocess.run(cmd + ["--metrics", SPILL_METRICS] + child_cmd, capture_output=True, text=True)
    if proc.returncode != 0:  # an ncu that does not know the spill metrics: the sections alone
        print(f"ncu with the spill metrics failed ({proc.returncode}): {proc.stdout[-500:]}", flush=True)
        proc = subprocess.run(cmd + child_cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        with open(os.path.join(args.out_dir, "profile-ncu-failed.txt"), "w") as f:
            f.write(proc.stdout[-200000:] + "\n---stderr---\n" + proc.stderr[-50000:])
        raise RuntimeError(f"ncu failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(regions_path) as f:
        regions = [tuple(r) for r in json.load(f)]
    os.remove(regions_path)
    ceilings = measure_ceilings()
    by_name = {p["name"]: p for p in points}
    try:
        split = split_regions(parse_ncu_csv(proc.stdout), regions)
    except RuntimeError:
        with open(os.path.join(args.out_dir, "profile-ncu-failed.txt"), "w") as f:
            f.write(proc.stdout[-2000000:])
        raise
    for r in split:
        r["summary"] = summarize(r, by_name[r["point"]], ceilings["bf16_matmul_TFLOPs"])
        s = r["summary"]
        m = s.get("main_kernel", {})
        print(f"{r['point']:<16}{r['provider']:<12}{r['mode']}  {s['kernel_ms']:.3f} ms  "
              f"{s.get('tflops', 0):.0f} TFLOP/s  main {str(m.get('kernel'))[:40]:<40} regs {m.get('registers')} "
              f"occ {m.get('theoretical_occupancy_pct')}/{m.get('achieved_occupancy_pct')} "
              f"local {s.get('local_bytes')}", flush=True)
    results = {"part": "profile", "environment": environment(), "ceilings": ceilings, "points": points,
               "regions": split}
    _write(results, args, "profile")  # the counters first: the host timings below are the cheap part
    hosts = host_costs(points, PROFILE_PROVIDERS)
    for h in hosts:
        print(f"{h['point']:<16}{h['provider']:<12}{h['mode']}  host {h['host_ms'] * 1e3:.0f} us/call, "
              f"stream {h['stream_ms'] * 1e3:.0f} us/call", flush=True)
    breakdown = host_breakdown()
    print(json.dumps({k: v for k, v in breakdown.items() if not k.endswith("_top")}), flush=True)
    results = {"part": "profile", "environment": environment(), "ceilings": ceilings,
               "convention": "ncu --clock-control none, sections " + ", ".join(SECTIONS) + "; one forward and "
                             "one backward per provider after two warm-up runs; kernel_ms is the sum of the "
                             "pass's kernel durations under ncu (serialised, so without overlap or host gaps); "
                             "tflops counts the FlashAttention-convention FLOPs of the pass over that time",
               "points": points, "regions": split, "host": hosts, "host_breakdown": breakdown}
    _write(results, args, "profile")
    return results


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--regions", required=True)
    ap.add_argument("--points", nargs="+", default=[p["name"] for p in POINTS])
    ap.add_argument("--providers", nargs="+", default=list(PROFILE_PROVIDERS))
    a = ap.parse_args(argv)
    points = [p for p in POINTS if p["name"] in a.points]
    child(points, a.providers, a.regions)


if __name__ == "__main__":
    main()


def host_breakdown(point_name="small-64x256", calls=200):
    """Where the host time of fa_lib's eager forward and backward goes at one point: cProfile over `calls`
    forward calls and `calls` backward calls (each backward after its own forward), the 25 functions
    with the most own time, in microseconds per call; and the time of the Triton launches alone, each
    kernel of the forward launched again with the same arguments (no fa_lib code around it)."""
    import cProfile
    import pstats
    import time

    import torch

    from fa_lib import ops

    p = next(p for p in POINTS if p["name"] == point_name)
    q, k, v, do = point_inputs(p)
    for _ in range(5):
        ops.flash_attention(q, k, v, causal=p["causal"]).backward(do)
    torch.cuda.synchronize()
    out = {"point": point_name, "calls": calls}

    def top(prof, n_calls):
        st = pstats.Stats(prof)
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:25]
        return [{"function": f"{os.path.basename(f)}:{line}({fn})", "own_us_per_call": tt / n_calls * 1e6,
                 "cum_us_per_call": ct / n_calls * 1e6, "calls_per_call": nc / n_calls}
                for (f, line, fn), (cc, nc, tt, ct, _callers) in rows]

    t0 = time.perf_counter()
    for _ in range(calls):
        ops.flash_attention(q, k, v, causal=p["causal"])
    torch.cuda.synchronize()
    out["fwd_host_us"] = (time.perf_counter() - t0) / calls * 1e6
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        ops.flash_attention(q, k, v, causal=p["causal"])
    prof.disable()
    torch.cuda.synchronize()
    out["fwd_top"] = top(prof, calls)
    os_ = [ops.flash_attention(q, k, v, causal=p["causal"]) for _ in range(calls)]
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for o in os_:
        o.backward(do)
    prof.disable()
    torch.cuda.synchronize()
    out["bwd_top"] = top(prof, calls)

    # The bare launch: Triton's JITFunction.__getitem__(grid)(...) with fa_lib's forward arguments.
    captured = {}
    real = ops._launch

    def capture(*a, **kw):
        captured.setdefault(a[2], (a, kw))
        return real(*a, **kw)

    ops._launch = capture
    try:
        ops.flash_attention(q, k, v, causal=p["causal"]).backward(do)
    finally:
        ops._launch = real
    torch.cuda.synchronize()
    for name, (a, kw) in captured.items():
        t0 = time.perf_counter()
        for _ in range(calls):
            real(*a, **kw)
        out[f"launch_only_{name}_us"] = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
    return out
