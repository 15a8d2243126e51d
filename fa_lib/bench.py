"""Side-by-side GPU benchmark: ``python -m fa_lib.bench``.

fa_lib's Triton kernel against PyTorch SDPA's backends (FLASH_ATTENTION, CUDNN_ATTENTION,
EFFICIENT_ATTENTION, MATH) and a naive matmul-softmax-matmul, in one run on one GPU.

* Forward and backward are timed separately: the median of ``triton.testing.do_bench``.
* TFLOP/s by the usual convention: forward ``4·B·H·Nq·Nk·D``, halved when causal; backward 2.5x that.
* Peak memory of one forward+backward, above the inputs (``torch.cuda.max_memory_allocated``).
* The card's measured ceilings: a large device-to-device copy (TB/s, bytes read + written) and a
  large bf16 matmul (TFLOP/s, random data).

Default sweep: D in {64, 128}; N in {1k, 2k, 4k, 8k, 16k} with B·N = 16k tokens and H·D = 2048;
causal and not; bf16 and fp16. The results (with the device name and the torch/triton versions) are
written as JSON to ``book/data/`` and printed as a compact table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import time

PROVIDERS = ("fa_lib", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "naive")


def attention_flops(b, h, nq, nk, d, causal, mode):
    """FLOPs by the FlashAttention papers' convention: two matmuls of 2·Nq·Nk·D each in the forward
    (halved when causal), and 2.5x the forward for the backward (five matmuls)."""
    f = 4 * b * h * nq * nk * d
    if causal:
        f //= 2
    return f if mode == "fwd" else int(2.5 * f)


def _naive(q, k, v, causal, scale):
    import torch

    s = (q @ k.transpose(-1, -2)) * scale  # (B, H, Nq, Nk) materialised
    if causal:
        nq, nk = q.shape[-2], k.shape[-2]
        keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def make_fn(provider, causal):
    """A callable (q, k, v) -> o for one provider."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if provider == "fa_lib":
        from . import flash_attention

        return lambda q, k, v: flash_attention(q, k, v, causal=causal)
    if provider == "naive":
        return lambda q, k, v: _naive(q, k, v, causal, 1.0 / math.sqrt(q.shape[-1]))
    backend = {
        "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
        "sdpa_math": SDPBackend.MATH,
    }[provider]

    def fn(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return fn


def bench_one(provider, b, h, n, d, causal, dtype, warmup=25, rep=100):
    """Time fwd and bwd of one provider on one shape; returns a dict (None values when unsupported)."""
    import torch
    from triton.testing import do_bench

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen).requires_grad_() for _ in range(3)
    )
    do = torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
    fn = make_fn(provider, causal)
    row = {"provider": provider}
    try:
        o = fn(q, k, v)
        o.backward(do)  # also compiles / autotunes the backward
        torch.cuda.synchronize()
        row["fwd_ms"] = do_bench(lambda: fn(q, k, v), warmup=warmup, rep=rep, return_mode="median")
        o = fn(q, k, v)
        row["bwd_ms"] = do_bench(
            lambda: o.backward(do, retain_graph=True), warmup=warmup, rep=rep,
            grad_to_none=[q, k, v], return_mode="median",
        )
        del o
        for x in (q, k, v):
            x.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(q, k, v).backward(do)
        torch.cuda.synchronize()
        row["peak_bytes"] = torch.cuda.max_memory_allocated() - base
    except (RuntimeError, torch.OutOfMemoryError) as e:  # unsupported config or out of memory
        row.update(fwd_ms=None, bwd_ms=None, peak_bytes=None, error=str(e).splitlines()[0][:200])
    for mode in ("fwd", "bwd"):
        ms = row.get(f"{mode}_ms")
        row[f"{mode}_tflops"] = None if ms is None else attention_flops(b, h, n, n, d, causal, mode) / (ms * 1e-3) / 1e12
    del q, k, v, do
    torch.cuda.empty_cache()
    return row


def measure_ceilings():
    """The card's measured ceilings: copy bandwidth (TB/s) and bf16 matmul rate (TFLOP/s)."""
    import torch
    from triton.testing import do_bench

    nbytes = 4 << 30
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    copy_tbs = 2 * nbytes / (ms * 1e-3) / 1e12  # bytes read + bytes written
    del a, b
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: x @ y, warmup=25, rep=200, return_mode="median")
    mm_tflops = 2 * m**3 / (ms * 1e-3) / 1e12
    del x, y
    torch.cuda.empty_cache()
    return {"copy_TBps": copy_tbs, "bf16_matmul_TFLOPs": mm_tflops, "copy_bytes": nbytes, "matmul_size": m}


def default_sweep():
    for dtype in ("bf16", "fp16"):
        for d in (64, 128):
            for causal in (False, True):
                for n in (1024, 2048, 4096, 8192, 16384):
                    yield {"dtype": dtype, "d": d, "causal": causal, "n": n, "b": 16384 // n, "h": 2048 // d}


def environment():
    import torch
    import triton

    return {
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d"),
    }


def _slug(name):
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _fmt(x, width=6):
    return f"{x:>{width}.0f}" if x is not None else f"{'-':>{width}}"


def print_table(results):
    provs = [p for p in PROVIDERS if any(r["provider"] == p for c in results["configs"] for r in c["rows"])]
    head = f"{'dtype':>5} {'D':>4} {'causal':>6} {'N':>6} | " + " | ".join(f"{p:>13}" for p in provs)
    print("TFLOP/s fwd/bwd")
    print(head)
    print("-" * len(head))
    for c in results["configs"]:
        by = {r["provider"]: r for r in c["rows"]}
        cells = []
        for p in provs:
            r = by.get(p, {})
            cells.append(f"{_fmt(r.get('fwd_tflops'))}/{_fmt(r.get('bwd_tflops'))}")
        print(f"{c['dtype']:>5} {c['d']:>4} {str(c['causal']):>6} {c['n']:>6} | " + " | ".join(cells))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    parser.add_argument("--d", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--n", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", nargs="+", default=["false", "true"], choices=["false", "true"])
    parser.add_argument("--max-n-quadratic", type=int, default=16384,
                        help="skip sdpa_math and naive above this N (they store the N x N matrix)")
    parser.add_argument("--out", default=None, help="JSON path (default book/data/bench-<device>.json)")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("python -m fa_lib.bench needs a CUDA GPU; the book's performance chapter reads the committed JSON.")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    results = {"environment": environment(), "ceilings": measure_ceilings(), "configs": []}
    print(results["environment"])
    print({k: round(v, 1) if isinstance(v, float) else v for k, v in results["ceilings"].items()})
    for cfg in default_sweep():
        if cfg["dtype"] not in args.dtypes or cfg["d"] not in args.d or cfg["n"] not in args.n:
            continue
        if str(cfg["causal"]).lower() not in args.causal:
            continue
        rows = []
        for p in args.providers:
            if p in ("sdpa_math", "naive") and cfg["n"] > args.max_n_quadratic:
                continue
            rows.append(bench_one(p, cfg["b"], cfg["h"], cfg["n"], cfg["d"], cfg["causal"], dtypes[cfg["dtype"]]))
        results["configs"].append({**cfg, "rows": rows})
        print_table({"configs": [results["configs"][-1]]})
    out = args.out or os.path.join("book", "data", f"bench-{_slug(results['environment']['device'])}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print()
    print_table(results)
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
