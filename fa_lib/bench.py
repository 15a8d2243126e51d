"""Side-by-side GPU benchmark: ``python -m fa_lib.bench``.

fa_lib's Triton kernel against PyTorch SDPA's backends (FLASH_ATTENTION, CUDNN_ATTENTION,
EFFICIENT_ATTENTION, MATH) and a naive matmul-softmax-matmul, in one run on one GPU.

* Forward and backward are timed separately: the median of ``triton.testing.do_bench`` (which
  flushes the L2 cache before every call).
* TFLOP/s by the usual convention (``attention_flops``): forward ``4·B·H·Nq·Nk·D``, halved when
  causal; backward 2.5x the forward.
* Peak memory of one forward+backward above the inputs (``torch.cuda.max_memory_allocated``).
* Every fa_lib point is also checked for correctness on one head of its inputs, by the flash-attn
  rule of ``fa_lib.testing`` (error against float64 at most 2x that of PyTorch in the same dtype).
* The card's measured ceilings: a large device-to-device copy (TB/s, bytes read + written) and a
  large bf16 matmul (TFLOP/s, random data).

Three parts, each written as JSON (with the device name and the torch/triton versions) to
``--out-dir`` (default ``fa_lib/data/``, relative to the working directory: run it from the repository
root to update the measurements that ship with the package, ``fa_lib.data``):

``python -m fa_lib.bench``                 the default sweep + ceilings  -> ``sweep-<device>.json``
    D in {64, 128}; N in {1k, 2k, 4k, 8k, 16k} with B·N = 16k tokens and H·D = 2048; causal and
    not; bf16 and fp16.
``python -m fa_lib.bench --memory``        peak memory of forward+backward against N
    at B = 1, H = 16, D = 128, N = 1k..64k (out of memory recorded as null) -> ``memory-<device>.json``
``python -m fa_lib.bench --experiments``   two experiments on the claims of seed 003
    (a) storing P (the naive path) against recomputing it (fa_lib): time and memory;
    (b) a pre-norm transformer block trained with and without activation checkpointing
    -> ``experiments-<device>.json``
``python -m fa_lib.bench --all``           all three.

``import fa_lib.bench`` and ``--help`` work without CUDA (nothing touches the GPU at import);
the book's performance chapter reads the committed JSON (``fa_lib.data``) and needs no GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import time

PROVIDERS = ("fa_lib", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "naive")
QUADRATIC = ("sdpa_math", "naive")  # providers that store the (N, N) matrix
TOKENS, HIDDEN = 16384, 2048  # the default sweep keeps B·N and H·D fixed
DEVICE = "cuda"


def attention_flops(b, h, nq, nk, d, causal, mode):
    """FLOPs by the FlashAttention papers' convention: two matmuls of 2·Nq·Nk·D each in the forward
    (halved when causal), and 2.5x the forward for the backward (five matmuls)."""
    f = 4 * b * h * nq * nk * d
    if causal:
        f //= 2
    return f if mode == "fwd" else int(2.5 * f)


# ---------------------------------------------------------------------------------------------------
# Providers: one callable (q, k, v) -> o each, all in the (B, H, N, D) layout.
# ---------------------------------------------------------------------------------------------------
def naive_attention(q, k, v, causal):
    """softmax(Q K^T / sqrt(D)) V with every intermediate materialised: autograd stores P."""
    import torch

    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, Nq, Nk)
    if causal:
        nq, nk = q.shape[-2], k.shape[-2]
        keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)  # bottom-right
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v  # (B, H, Nq, D)


def make_fn(provider, causal):
    """A callable (q, k, v) -> o for one provider."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if provider == "fa_lib":
        from .ops import flash_attention

        return lambda q, k, v: flash_attention(q, k, v, causal=causal)
    if provider == "naive":
        return lambda q, k, v: naive_attention(q, k, v, causal)
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


# ---------------------------------------------------------------------------------------------------
# Measuring.
# ---------------------------------------------------------------------------------------------------
def _median_ms(fn, grad_to_none=None, warmup=25, rep=100):
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def _free():
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _inputs(b, h, n, d, dtype, seed=0):
    import torch

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v, do = (torch.randn(b, h, n, d, device=DEVICE, dtype=dtype, generator=gen) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def peak_bytes(fn, q, k, v, do):
    """Peak memory of one forward+backward, above what is allocated before it (the inputs)."""
    import torch

    for x in (q, k, v):
        x.grad = None
    _free()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(q, k, v).backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for x in (q, k, v):
        x.grad = None
    return peak


def fa_lib_configs(q, n_k, causal):
    """The fixed block configurations (BLOCK_M, BLOCK_N, num_warps, num_stages) fa_lib's default,
    deterministic path launches for inputs like `q`, per kernel (fwd, dkdv, dq)."""
    from . import kernels, ops

    head_dim = ops._meta(q, causal)["HEAD_DIM"]
    return {name: dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
                           kernels.default_config(name, q.element_size(), head_dim, causal, q.shape[2], n_k)))
            for name in ("fwd", "dkdv", "dq")}


def bench_one(provider, b, h, n, d, causal, dtype, timing=True):
    """Time forward and backward of one provider on one shape, and its peak memory.

    Returns a dict; values are None (with ``error``) when the provider refuses the shape or runs
    out of memory.
    """
    import torch

    q, k, v, do = _inputs(b, h, n, d, dtype)
    fn = make_fn(provider, causal)
    row = {"provider": provider, "fwd_ms": None, "bwd_ms": None, "peak_bytes": None}
    try:
        fn(q, k, v).backward(do)  # compiles, autotunes, picks a backend
        torch.cuda.synchronize()
        if timing:
            row["fwd_ms"] = _median_ms(lambda: fn(q, k, v))
            o = fn(q, k, v)
            row["bwd_ms"] = _median_ms(lambda: o.backward(do, retain_graph=True), grad_to_none=[q, k, v])
            del o
        row["peak_bytes"] = peak_bytes(fn, q, k, v, do)
        if provider == "fa_lib":
            row["configs"] = fa_lib_configs(q, k.shape[2], causal)
    except (RuntimeError, torch.OutOfMemoryError) as e:  # a backend that refuses the shape, or OOM
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    for mode in ("fwd", "bwd"):
        ms = row[f"{mode}_ms"]
        flops = attention_flops(b, h, n, n, d, causal, mode)
        row[f"{mode}_tflops"] = None if ms is None else flops / (ms * 1e-3) / 1e12
    del q, k, v, do, fn
    _free()
    return row


def check_fa_lib(b, h, n, d, causal, dtype, seed=1):
    """fa_lib on the full shape, judged on head 0 by the flash-attn rule; returns the error ratios.

    The kernel runs at the benchmarked shape (so with the block sizes the benchmark used) with its
    outputs poisoned; the float64 gold and the same-dtype PyTorch baseline are computed for one head.
    """
    from . import testing

    q, k, v, do = _inputs(b, h, n, d, dtype, seed=seed)
    out = testing.forward_backward(q, k, v, do, causal=causal)
    nan = {name: bool(t.isnan().any()) for name, t in out.items()}
    one = [t[:1, :1].detach() for t in (q, k, v, do)]  # (1, 1, N, D)
    head0 = {name: t[:1, :1] for name, t in out.items()}
    del out
    gold = testing.reference_forward_backward(*one, causal=causal, upcast=True)
    base = testing.reference_forward_backward(*one, causal=causal, upcast=False)
    result = {"ok": True}
    try:
        report = testing.assert_flash_rule(head0, gold, base)
        result["ratio"] = {name: r for name, (_, _, r) in report.items()}
    except AssertionError as e:
        result.update(ok=False, error=str(e)[:400])
    if any(nan.values()):
        result.update(ok=False, nan=nan)
    del q, k, v, do, one, head0, gold, base
    _free()
    return result


def measure_ceilings():
    """The card's measured ceilings: copy bandwidth (TB/s) and bf16 matmul rate (TFLOP/s)."""
    import torch

    nbytes = 4 << 30
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = _median_ms(lambda: b.copy_(a), rep=200)
    copy_tbs = 2 * nbytes / (ms * 1e-3) / 1e12  # bytes read + bytes written
    del a, b
    m = 8192
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16, generator=gen)  # random data, never zeros
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16, generator=gen)
    ms = _median_ms(lambda: x @ y, rep=200)
    mm_tflops = 2 * m**3 / (ms * 1e-3) / 1e12
    del x, y
    _free()
    return {"copy_TBps": copy_tbs, "bf16_matmul_TFLOPs": mm_tflops, "copy_bytes": nbytes, "matmul_size": m}


def environment():
    import torch
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "sm_count": props.multi_processor_count,
        "memory_bytes": props.total_memory,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "date": time.strftime("%Y-%m-%d"),
    }


# ---------------------------------------------------------------------------------------------------
# Part 1: the default sweep.
# ---------------------------------------------------------------------------------------------------
def default_sweep(dtypes=("bf16", "fp16"), dims=(64, 128), causals=(False, True),
                  lengths=(1024, 2048, 4096, 8192, 16384)):
    for dtype in dtypes:
        for d in dims:
            for causal in causals:
                for n in lengths:
                    yield {"dtype": dtype, "d": d, "causal": causal, "n": n, "b": TOKENS // n, "h": HIDDEN // d}


DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def _dtype(name):
    import torch

    return getattr(torch, DTYPES[name])


def _fmt(x, width=4):
    return f"{x:>{width}.0f}" if x is not None else f"{'-':>{width}}"


def table_lines(configs, providers):
    """The compact table: one line per point, fwd/bwd TFLOP/s per provider, fa_lib / FA2 ratios."""
    short = {"fa_lib": "fa_lib", "sdpa_flash": "FA2", "sdpa_cudnn": "cuDNN", "sdpa_efficient": "eff",
             "sdpa_math": "math", "naive": "naive"}
    head = f"{'dtype':<5} {'D':>3} {'mask':<6} {'N':>5} |" + "".join(f" {short[p]:>9} |" for p in providers)
    head += " fa/FA2 fwd bwd | ok"
    lines = ["TFLOP/s, forward/backward (median of do_bench)", head, "-" * len(head)]
    for c in configs:
        by = {r["provider"]: r for r in c["rows"]}
        cells = "".join(f" {_fmt(by.get(p, {}).get('fwd_tflops'))}/{_fmt(by.get(p, {}).get('bwd_tflops'))} |"
                        for p in providers)
        fa, fl = by.get("fa_lib", {}), by.get("sdpa_flash", {})
        ratios = []
        for mode in ("fwd", "bwd"):
            x, y = fa.get(f"{mode}_tflops"), fl.get(f"{mode}_tflops")
            ratios.append(f"{x / y:4.2f}" if x and y else "   -")
        check = c.get("check", {}).get("ok")
        lines.append(f"{c['dtype']:<5} {c['d']:>3} {'causal' if c['causal'] else 'full':<6} {c['n']:>5} |{cells}"
                     f"      {ratios[0]} {ratios[1]} | {'-' if check is None else 'yes' if check else 'NO'}")
    return lines


def run_sweep(args):
    providers = list(args.providers)
    points = list(default_sweep(args.dtypes, args.d, [c == "true" for c in args.causal], args.n))
    results = {"part": "sweep", "environment": environment(), "ceilings": measure_ceilings(),
               "convention": "fwd 4*B*H*N*N*D (halved if causal), bwd 2.5x fwd; median of triton.testing.do_bench",
               "configs": []}
    print(results["environment"])
    print({k: round(v, 2) if isinstance(v, float) else v for k, v in results["ceilings"].items()})
    lines = table_lines([], providers)
    print("\n".join(lines[:3]), flush=True)
    for cfg in points:
        rows = []
        for p in providers:
            if p in QUADRATIC and cfg["n"] > args.max_n_quadratic:
                continue
            rows.append(bench_one(p, cfg["b"], cfg["h"], cfg["n"], cfg["d"], cfg["causal"], _dtype(cfg["dtype"])))
        point = {**cfg, "rows": rows}
        if "fa_lib" in providers and not args.no_check:
            point["check"] = check_fa_lib(cfg["b"], cfg["h"], cfg["n"], cfg["d"], cfg["causal"], _dtype(cfg["dtype"]))
        results["configs"].append(point)
        print(table_lines([point], providers)[-1], flush=True)
        _write(results, args, "sweep")  # after every point: a run cut short still leaves its data
    print()
    print("\n".join(table_lines(results["configs"], providers)))
    return results


# ---------------------------------------------------------------------------------------------------
# Part 2: memory against N.
# ---------------------------------------------------------------------------------------------------
MEMORY_PROVIDERS = ("fa_lib", "sdpa_flash", "sdpa_math", "naive")


def run_memory(args):
    """Peak memory of one forward+backward at B = 1, H = 16, D = 128 (H·D = 2048), bf16, N = 1k..64k."""
    b, h, d = 1, 16, 128
    results = {"part": "memory", "environment": environment(),
               "shape": {"b": b, "h": h, "d": d, "dtype": "bf16", "causal": False}, "rows": []}
    print(f"peak memory of forward+backward, B={b} H={h} D={d} bf16, GiB (above the inputs)")
    for n in args.memory_n:
        line = f"N={n:>6}"
        for p in MEMORY_PROVIDERS:
            row = {"n": n, **bench_one(p, b, h, n, d, False, _dtype("bf16"), timing=False)}
            row["input_bytes"] = 4 * b * h * n * d * 2  # q, k, v, do in bf16
            results["rows"].append(row)
            pk = row["peak_bytes"]
            line += f"  {p}: {'OOM' if pk is None else f'{pk / 2**30:8.3f}'}"
        print(line, flush=True)
        _write(results, args, "memory")
    return results


# ---------------------------------------------------------------------------------------------------
# Part 3: experiments on seed 003's claims.
# ---------------------------------------------------------------------------------------------------
def experiment_store_p(args, d=128, h=16, lengths=(1024, 2048, 4096, 8192, 16384)):
    """(a) Store P (naive: autograd keeps the (N, N) probabilities) against recompute P (fa_lib).

    Same shapes as the sweep (B·N = 16k tokens), D = 128, H = 16, bf16, not causal.
    """
    rows = []
    for n in lengths:
        b = TOKENS // n
        for provider, label in (("naive", "store_P"), ("fa_lib", "recompute_P")):
            r = bench_one(provider, b, h, n, d, False, _dtype("bf16"))
            rows.append({"n": n, "b": b, "h": h, "d": d, "strategy": label, **r,
                         "p_bytes": b * h * n * n * 2})  # P in bf16
            print(f"(a) N={n:>6} {label:<12} fwd {r['fwd_ms']} ms  bwd {r['bwd_ms']} ms  "
                  f"peak {None if r['peak_bytes'] is None else round(r['peak_bytes'] / 2**30, 3)} GiB", flush=True)
    return rows


def _transformer(d_model, n_heads, n_layers, mode, dtype):
    """A stack of pre-norm blocks (attention with fa_lib, causal; GELU MLP 4x), checkpointed per `mode`.

    mode: "none" (no checkpointing), "attention" (checkpoint the attention sub-block),
    "mlp" (checkpoint the MLP sub-block) or "block" (checkpoint the whole block).
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from .ops import flash_attention

    def ckpt(f, x, on):
        return checkpoint(f, x, use_reentrant=False) if on else f(x)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
            self.proj = nn.Linear(d_model, d_model, bias=False)
            self.fc1 = nn.Linear(d_model, 4 * d_model, bias=False)
            self.fc2 = nn.Linear(4 * d_model, d_model, bias=False)

        def attention(self, x):  # (B, N, d_model) -> (B, N, d_model)
            B, N, _ = x.shape
            qkv = self.qkv(self.ln1(x)).view(B, N, 3, n_heads, d_model // n_heads)  # (B, N, 3, H, hd)
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # (B, H, N, hd) views
            o = flash_attention(q, k, v, causal=True)  # (B, H, N, hd)
            return self.proj(o.transpose(1, 2).reshape(B, N, d_model))

        def mlp(self, x):
            return self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

        def inner(self, x):
            x = x + ckpt(self.attention, x, mode == "attention")
            return x + ckpt(self.mlp, x, mode == "mlp")

        def forward(self, x):
            return ckpt(self.inner, x, mode == "block")

    return nn.Sequential(*[Block() for _ in range(n_layers)]).to(device=DEVICE, dtype=dtype)


def experiment_checkpointing(args, d_model=2048, n_heads=16, n_layers=4, seqs=(4096, 8192)):
    """(b) Time and peak memory of a training step with and without activation checkpointing.

    A stack of `n_layers` pre-norm blocks (d_model 2048, 16 heads of 128, causal fa_lib attention,
    GELU MLP of 4x), bf16, B·seq = 16k tokens; plain SGD, so the step is forward + backward + update.
    """
    import torch

    rows = []
    for seq in seqs:
        batch = max(1, TOKENS // seq)
        for mode in ("none", "attention", "mlp", "block"):
            torch.manual_seed(0)
            model = _transformer(d_model, n_heads, n_layers, mode, torch.bfloat16)
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            x = torch.randn(batch, seq, d_model, device=DEVICE, dtype=torch.bfloat16)

            def step():
                opt.zero_grad(set_to_none=True)
                loss = model(x).float().square().mean()
                loss.backward()
                opt.step()

            step()
            step()
            opt.zero_grad(set_to_none=True)
            _free()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()  # parameters and inputs
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            ms = _median_ms(step, warmup=200, rep=1000)
            rows.append({"seq": seq, "batch": batch, "d_model": d_model, "n_heads": n_heads, "n_layers": n_layers,
                         "checkpoint": mode, "step_ms": ms, "peak_bytes": peak})
            print(f"(b) seq={seq} batch={batch} checkpoint={mode:<9} step {ms:8.2f} ms  peak {peak / 2**30:6.2f} GiB",
                  flush=True)
            del model, opt, x
            _free()
    return rows


# ---------------------------------------------------------------------------------------------------
# Decoding: fa_lib.flash_attention_with_kvcache against SDPA over a KV cache (`--decode`).
# ---------------------------------------------------------------------------------------------------
DECODE_PROVIDERS = ("fa_lib", "sdpa_flash", "sdpa_cudnn")


def _graph_ms(fn, rep=30):
    """Median ms of `fn` replayed from a CUDA graph (how decoding loops run): no launch overhead."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()  # warm up (compile, allocate) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return _median_ms(g.replay, warmup=5, rep=rep)


def _decode_fn(provider, q, k_cache, v_cache, seqlens):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fa_lib

    if provider == "fa_lib":
        return lambda: fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[provider]
    gqa = q.shape[1] != k_cache.shape[1]

    def fn():
        # Every cached key (no mask): the same bytes as the causal pass over a full cache when N_q <= 16
        # queries sit at its end (they differ by at most 15 keys per row).
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=gqa)

    with torch.no_grad():
        fn()  # raises here if the backend refuses the shape
    return fn


def decode_points(nqs=(1, 4, 16), nks=(1024, 4096, 16384, 65536, 131072), batches=(1, 8, 64),
                  heads=((32, 32), (32, 8)), d=128, max_cache_bytes=48 << 30):
    for b in batches:
        for hq, hkv in heads:
            for nk in nks:
                if 2 * b * hkv * nk * d * 2 > max_cache_bytes:
                    continue  # the K and V caches alone would not fit next to the rest
                for nq in nqs:
                    yield dict(b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, dtype="bf16")


def run_decode(args):
    import torch

    results = {"part": "decode", "environment": environment(), "ceilings": measure_ceilings(),
               "convention": "bytes = K and V cache read (valid keys) + q read + o written; fraction = bytes / "
                             "time / copy_TBps. ms: median of triton.testing.do_bench, eager (every call from "
                             "Python) and graph (replayed from a CUDA graph, as decoding loops run); SDPA attends "
                             "every cached key without a mask", "points": [], "ragged": []}
    copy = results["ceilings"]["copy_TBps"]
    print(f"copy bandwidth {copy:.2f} TB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def measure(p, lens, providers):
        q = torch.randn(p["b"], p["hq"], p["nq"], p["d"], device="cuda", dtype=torch.bfloat16, generator=gen)
        k_cache = torch.randn(p["b"], p["hkv"], p["nk"], p["d"], device="cuda", dtype=torch.bfloat16, generator=gen)
        v_cache = torch.randn_like(k_cache)
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        nbytes = 2 * p["hkv"] * sum(lens) * p["d"] * 2 + 2 * q.numel() * 2
        row = dict(p, lens_sum=sum(lens), bytes=nbytes, providers={})
        with torch.no_grad():
            for prov in providers:
                try:
                    fn = _decode_fn(prov, q, k_cache, v_cache, seqlens)
                    eager, graph = _median_ms(fn, warmup=10, rep=30), _graph_ms(fn)
                    row["providers"][prov] = dict(eager_ms=eager, graph_ms=graph,
                                                  fraction_graph=nbytes / (graph * 1e-3) / 1e12 / copy,
                                                  fraction_eager=nbytes / (eager * 1e-3) / 1e12 / copy)
                except Exception as e:  # a backend that refuses the shape: recorded, not fatal
                    row["providers"][prov] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
        del q, k_cache, v_cache
        _free()
        return row

    for p in decode_points():
        row = measure(p, [p["nk"]] * p["b"], DECODE_PROVIDERS)
        results["points"].append(row)
        cells = "  ".join(f"{k} {v['graph_ms'] * 1e3:8.1f}us {v['fraction_graph']:5.2f} (eager {v['eager_ms'] * 1e3:7.1f})"
                          if "graph_ms" in v else f"{k} --" for k, v in row["providers"].items())
        print(f"B{p['b']:<3} H{p['hq']}/{p['hkv']:<3} Nq{p['nq']:<3} Nk{p['nk']:<7} {cells}", flush=True)
        _write(results, args, "decode")
    # Ragged batches: fa_lib reads each sequence's valid keys; SDPA pads the batch to the longest.
    for b, nk in ((8, 16384), (64, 16384), (8, 131072)):
        p = dict(b=b, hq=32, hkv=8, nq=1, nk=nk, d=128, dtype="bf16")
        lens = [max(1, nk * (i + 1) // b) for i in range(b)]
        row = measure(p, lens, DECODE_PROVIDERS)
        row["padded_bytes"] = 2 * p["hkv"] * b * nk * p["d"] * 2
        results["ragged"].append(row)
        print("ragged", b, nk, {k: round(v.get("graph_ms", -1) * 1e3, 1) for k, v in row["providers"].items()}, flush=True)
        _write(results, args, "decode")
    return results


def run_experiments(args):
    results = {"part": "experiments", "environment": environment(), "store_p": [], "checkpointing": []}
    results["store_p"] = experiment_store_p(args)
    _write(results, args, "experiments")
    results["checkpointing"] = experiment_checkpointing(args)
    _write(results, args, "experiments")
    return results


# ---------------------------------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------------------------------
def _slug(name):
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _write(results, args, part):
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"{part}-{_slug(results['environment']['device'])}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fa_lib.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_argument_group("what to run (default: the sweep)")
    what.add_argument("--memory", action="store_true", help="the memory sweep instead")
    what.add_argument("--experiments", action="store_true", help="the two experiments instead")
    what.add_argument("--all", action="store_true", help="sweep, memory sweep and experiments")
    what.add_argument("--decode", action="store_true", help="the decoding benchmark (KV cache) instead")
    sweep = parser.add_argument_group("the sweep")
    sweep.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    sweep.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=list(DTYPES))
    sweep.add_argument("--d", nargs="+", type=int, default=[64, 128])
    sweep.add_argument("--n", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    sweep.add_argument("--causal", nargs="+", default=["false", "true"], choices=["false", "true"])
    sweep.add_argument("--max-n-quadratic", type=int, default=16384,
                       help="skip sdpa_math and naive above this N (they store the N x N matrix)")
    sweep.add_argument("--no-check", action="store_true", help="skip the correctness check of fa_lib")
    parser.add_argument("--memory-n", nargs="+", type=int, default=[1024 << i for i in range(7)],
                        help="sequence lengths of the memory sweep (default 1k..64k)")
    parser.add_argument("--out-dir", default=os.path.join("fa_lib", "data"),
                        help="where the JSON files go (default: fa_lib/data, the packaged measurements, "
                             "when run from the repository root)")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("python -m fa_lib.bench needs a CUDA GPU; the book's performance chapter reads the "
                         "committed JSON in fa_lib/data/ (fa_lib.data) instead.")
    parts = ["sweep", "memory", "experiments"] if args.all else \
        [p for p, on in (("memory", args.memory), ("experiments", args.experiments), ("decode", args.decode))
         if on] or ["sweep"]
    run = {"sweep": run_sweep, "memory": run_memory, "experiments": run_experiments, "decode": run_decode}
    for part in parts:
        results = run[part](args)
        print(f"wrote {_write(results, args, part)}", flush=True)


if __name__ == "__main__":
    main()
