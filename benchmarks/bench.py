"""Side-by-side GPU benchmark: ``python -m benchmarks`` (from the repository root).

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
``--out-dir`` (default ``benchmarks/data/``, relative to the working directory: run it from the repository
root to update the measurements the book reads, ``benchmarks.data``):

``python -m benchmarks.bench``                 the default sweep + ceilings  -> ``sweep-<device>.json``
    D in {64, 128}; N in {1k, 2k, 4k, 8k, 16k} with B·N = 16k tokens and H·D = 2048; causal and
    not; bf16 and fp16.
``python -m benchmarks.bench --memory``        peak memory of forward+backward against N
    at B = 1, H = 16, D = 128, N = 1k..64k (out of memory recorded as null) -> ``memory-<device>.json``
``python -m benchmarks.bench --experiments``   two experiments on the claims of seed 003
    (a) storing P (the naive path) against recomputing it (fa_lib): time and memory;
    (b) a pre-norm transformer block trained with and without activation checkpointing
    -> ``experiments-<device>.json``
``python -m benchmarks.bench --all``           all three.
``python -m benchmarks.bench --masks``         issue 13's training masks against FlexAttention and SDPA
    varlen (packed ragged causal documents), sliding window (1024 and 4096 keys, causal), softcap 50
    (causal), key padding; N in {4k, 8k, 16k}, B·N = 16k, H = 16, D = 128, bf16, plus one GQA 32/8
    varlen point; TFLOP/s over the visible pairs only, fa_lib / FlexAttention ratios against the issue's
    target, a correctness check per mask at the smallest N -> ``masks-<device>.json``.
    ``--masks --smoke`` runs the same pipeline on tiny shapes on CPU (the test of the pipeline).
``python -m benchmarks.bench --decode``        issue 12's KV-cache decoding -> ``decode-<device>.json``
    (``--dec-batches``, ``--dec-hkv``, ``--dec-nk``: a subset; ``--dec-providers``: some of fa_lib and SDPA's
    backends; ``--dec-workspace``: fa_lib with a workspace; ``--dec-page-sizes 16 256``: fa_lib over paged
    copies of the caches too)
``python -m benchmarks.bench --onepass``       the backward's dQ in one pass or two -> ``onepass-<device>.json``
``python -m benchmarks.bench --extended``      issue 14's extended sweep (224 points: D 64..256, GQA, prefill,
    small batches; fa_lib's two paths against SDPA's FA2, cuDNN and efficient backends)
    -> ``extended-<device>.json``. Resumable: ``--ext-resume`` keeps the points already in the file;
    ``--ext-precompile 8`` compiles fa_lib's kernels in 8 processes first; ``--ext-warmup-ms`` and
    ``--ext-rep-ms`` set do_bench's times (the committed run: 10 and 50). On a machine whose calls are
    limited in time, one call per ``--ext-dtypes`` (each file records its commit), then
    ``--ext-join A.json B.json`` makes the one sweep, refusing pieces of different commits or cards.
``python -m benchmarks.bench --profile``       Nsight Compute at one point of each kind of miss: per kernel
    registers, spills, occupancy, tensor-pipe share, plus the host time per call
    (``benchmarks.bench_profile``) -> ``profile-<device>.json``.
``python -m benchmarks.bench --configs``       one kernel's block configurations (``--cfg-kernel``, default dkdv)
    at ``--cfg-shapes`` (default: d = 256, causal 4k and 16k): the table's blocks against each of
    ``--cfg-candidates``, whole-pass times -> ``configs-<--cfg-tag>-<device>.json``.
``python -m benchmarks.bench --cp``            context parallelism over NCCL, one process per GPU
    (``benchmarks.bench_cp``) -> ``cp-<device>-x<W>.json``.

``import benchmarks.bench`` and ``--help`` work without CUDA (nothing touches the GPU at import);
the book's performance chapter reads the committed JSON (``benchmarks.data``) and needs no GPU.
"""
from __future__ import annotations

import argparse
import contextlib
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


FLOP_MODES = ("fwd", "bwd", "fwd_bwd")


def attention_flops(b, h, nq, nk, d, causal, mode):
    """FLOPs by the FlashAttention papers' convention: two matmuls of 2·Nq·Nk·D each in the forward
    (halved when causal), 2.5x the forward for the backward (five matmuls), 3.5x for both.

    ``mode``: "fwd", "bwd" or "fwd_bwd"; anything else is a ValueError."""
    if mode not in FLOP_MODES:
        raise ValueError(f"mode must be one of {FLOP_MODES}, got {mode!r}")
    f = 4 * b * h * nq * nk * d
    if causal:
        f //= 2
    return {"fwd": f, "bwd": 5 * f // 2, "fwd_bwd": 7 * f // 2}[mode]


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


def sdpa_backend(provider):
    """The SDPA backend a provider name ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math") pins."""
    from torch.nn.attention import SDPBackend

    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa_math": SDPBackend.MATH}[provider]


def make_fn(provider, causal):
    """A callable (q, k, v) -> o for one provider."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    if provider == "fa_lib":
        from fa_lib.ops import flash_attention

        return lambda q, k, v: flash_attention(q, k, v, causal=causal)
    if provider == "naive":
        return lambda q, k, v: naive_attention(q, k, v, causal)
    backend = sdpa_backend(provider)

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
    from fa_lib import ops

    head_dim = sum(ops._head_tiles(q.shape[3]))  # the tiles may be two (ops._head_tiles): their width

    def grid(name):  # the dense launch grids of ops (dK/dV: key blocks; its key/value heads do not matter here)
        rows, block = (n_k, "BLOCK_N") if name == "dkdv" else (q.shape[2], "BLOCK_M")
        return lambda meta: (ops._cdiv(rows, meta[block]), q.shape[1], q.shape[0])

    return {name: dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
                           ops._fixed_config(name, q.element_size(), head_dim, causal, q.shape[2], n_k, grid(name))))
            for name in ("fwd", "dkdv", "dq")}


def _time_fwd_bwd(fn, q, k, v, do, row, timing=True, warmup=25, rep=100):
    """Run fn once forward and backward (compiles, autotunes, picks a backend), then, with `timing`, put the
    median forward and backward ms in row["fwd_ms"], row["bwd_ms"] (do_bench's warmup and rep, in ms)."""
    import torch

    fn(q, k, v).backward(do)
    torch.cuda.synchronize()
    if timing:
        row["fwd_ms"] = _median_ms(lambda: fn(q, k, v), warmup=warmup, rep=rep)
        o = fn(q, k, v)
        row["bwd_ms"] = _median_ms(lambda: o.backward(do, retain_graph=True), grad_to_none=[q, k, v],
                                   warmup=warmup, rep=rep)


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
        _time_fwd_bwd(fn, q, k, v, do, row, timing)
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
    from fa_lib import testing

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
        "commit": _commit(),
    }


def _commit():
    """The commit of the code measured: $FA_LIB_COMMIT (a copy of the tree without .git, as on a lent GPU
    machine, is told it), else `git rev-parse HEAD`, else None."""
    if os.environ.get("FA_LIB_COMMIT"):
        return os.environ["FA_LIB_COMMIT"]
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


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

    from fa_lib.ops import flash_attention

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
PAGED_PROVIDER = "fa_lib_paged"  # + the page size: fa_lib over a paged copy of the cache (`--dec-page-sizes`)
DECODE_LAYERS = 8  # calls per graph in the layered timing, each on its own cache
DECODE_ROUNDS = 3  # each time is the least of this many medians, the providers timed in turn


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


def _decode_fn(provider, q, k_cache, v_cache, seqlens, workspace=False):
    """A call of `provider` over this cache (no arguments; returns o). `workspace`: fa_lib's calls count their
    merges in a workspace of their own (`fa_lib.decode.workspace(q)`, as a decoding loop keeps one)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    import fa_lib

    if provider == "fa_lib":
        ws = fa_lib.decode.workspace(q) if workspace else None
        return lambda: fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                           workspace=ws)
    if provider.startswith(PAGED_PROVIDER):  # the same cache cut into pages of P keys, shuffled over a pool
        ws = fa_lib.decode.workspace(q) if workspace else None
        page = int(provider[len(PAGED_PROVIDER):])
        w = -(-k_cache.shape[2] // page)
        order = torch.randperm(k_cache.shape[0] * w, generator=torch.Generator().manual_seed(page))
        (k_pool, table), (v_pool, _) = (fa_lib.decode.page_cache(c, page, order) for c in (k_cache, v_cache))
        return lambda: fa_lib.flash_attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, causal=True,
                                                           workspace=ws, block_table=table)
    backend = sdpa_backend(provider)
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


def _decode_subset(args):
    """decode_points' keyword arguments from the --dec-* flags that were given (their defaults otherwise)."""
    subset = {}
    if getattr(args, "dec_batches", None):
        subset["batches"] = tuple(args.dec_batches)
    if getattr(args, "dec_hkv", None):
        subset["heads"] = tuple((32, h) for h in args.dec_hkv)
    if getattr(args, "dec_nk", None):
        subset["nks"] = tuple(args.dec_nk)
    return subset


def run_decode(args):
    import torch

    results = {"part": "decode", "environment": environment(), "ceilings": measure_ceilings(),
               "convention": "bytes = K and V cache read (valid keys) + q read + o written; fraction = bytes / "
                             f"time / copy_TBps. ms: the least of {DECODE_ROUNDS} medians of triton.testing.do_bench "
                             "(the providers timed in turn), eager (every call from Python), graph (one call "
                             "replayed from a CUDA graph, as decoding loops run) and layered (per call, in a graph "
                             "of `layers` calls on distinct caches, as a model's step replays one per layer); SDPA "
                             "attends every cached key without a mask",
               "points": [], "ragged": []}
    workspace = bool(getattr(args, "dec_workspace", False))
    if workspace:
        results["workspace"] = True
        results["convention"] += "; fa_lib's calls pass a workspace (fa_lib.decode.workspace(q)), one per call site"
    pages = tuple(getattr(args, "dec_page_sizes", None) or ())
    providers = tuple(getattr(args, "dec_providers", None) or DECODE_PROVIDERS) + tuple(f"{PAGED_PROVIDER}{p}"
                                                                                      for p in pages)
    if pages:
        results["convention"] += (f"; {PAGED_PROVIDER}P: fa_lib over the same cache cut into pages of P keys "
                                  "(fa_lib.decode.page_cache, in a shuffled order) read through a block_table; "
                                  "same_bits: its o equals fa_lib's on the contiguous cache")
    copy = results["ceilings"]["copy_TBps"]
    print(f"copy bandwidth {copy:.2f} TB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    # The floor of a graph-replay timing: one tiny kernel (an 8-element add) replayed and timed the same way.
    tiny = torch.zeros(8, device="cuda")
    results["ceilings"]["graph_floor_ms"] = _graph_ms(lambda: tiny.add_(1.0))
    results["ceilings"]["layered_floor_ms"] = _graph_ms(lambda: [tiny.add_(1.0) for _ in range(DECODE_LAYERS)]) \
        / DECODE_LAYERS
    print(f"graph replay floor {results['ceilings']['graph_floor_ms'] * 1e3:.1f} us, "
          f"{results['ceilings']['layered_floor_ms'] * 1e3:.1f} us per kernel in a graph of {DECODE_LAYERS}", flush=True)

    def measure(p, lens, providers):
        q = torch.randn(p["b"], p["hq"], p["nq"], p["d"], device="cuda", dtype=torch.bfloat16, generator=gen)
        k_cache = torch.randn(p["b"], p["hkv"], p["nk"], p["d"], device="cuda", dtype=torch.bfloat16, generator=gen)
        v_cache = torch.randn_like(k_cache)
        # A model's decoding step replays one attention per layer, each over its own cache, in one graph:
        # up to DECODE_LAYERS caches (while they take at most 32 GiB), timed per call.
        layers = max(1, min(DECODE_LAYERS, (32 << 30) // (2 * k_cache.numel() * 2)))
        caches = [(k_cache, v_cache)] + [(torch.randn_like(k_cache), torch.randn_like(v_cache))
                                         for _ in range(layers - 1)]
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        nbytes = 2 * p["hkv"] * sum(lens) * p["d"] * 2 + 2 * q.numel() * 2
        row = dict(p, lens_sum=sum(lens), bytes=nbytes, layers=layers, providers={})

        def fraction(ms):
            return nbytes / (ms * 1e-3) / 1e12 / copy
        with torch.no_grad():
            fns = {}
            for prov in providers:
                try:
                    fns[prov] = [_decode_fn(prov, q, kc, vc, seqlens, workspace) for kc, vc in caches]
                except Exception as e:  # a backend that refuses the shape: recorded, not fatal
                    row["providers"][prov] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
            best = {}
            for _ in range(DECODE_ROUNDS):  # the providers take turns; each keeps its best round
                for prov, fs in fns.items():
                    times = (_median_ms(fs[0], warmup=10, rep=30), _graph_ms(fs[0]),
                             _graph_ms(lambda fs=fs: [f() for f in fs]) / layers)
                    best[prov] = [min(a, b) for a, b in zip(best.get(prov, times), times)]
            for prov, (eager, graph, layered) in best.items():
                row["providers"][prov] = dict(eager_ms=eager, graph_ms=graph, layered_ms=layered,
                                              fraction_graph=fraction(graph), fraction_eager=fraction(eager),
                                              fraction_layered=fraction(layered))
                if prov.startswith(PAGED_PROVIDER) and "fa_lib" in fns:
                    row["providers"][prov]["same_bits"] = bool(torch.equal(fns[prov][0](), fns["fa_lib"][0]()))
        del q, k_cache, v_cache, caches
        _free()
        return row

    for p in decode_points(**_decode_subset(args)):
        row = measure(p, [p["nk"]] * p["b"], providers)
        results["points"].append(row)
        cells = "  ".join(f"{k} {v['graph_ms'] * 1e3:8.1f}us {v['fraction_graph']:5.2f} (layered "
                          f"{v['layered_ms'] * 1e3:7.1f}, eager {v['eager_ms'] * 1e3:7.1f})"
                          if "graph_ms" in v else f"{k} --" for k, v in row["providers"].items())
        print(f"B{p['b']:<3} H{p['hq']}/{p['hkv']:<3} Nq{p['nq']:<3} Nk{p['nk']:<7} {cells}", flush=True)
        _write(results, args, "decode")
    # Ragged batches: fa_lib reads each sequence's valid keys; SDPA pads the batch to the longest.
    for b, nk in () if getattr(args, "dec_no_ragged", False) else ((8, 16384), (64, 16384), (8, 131072)):
        p = dict(b=b, hq=32, hkv=8, nq=1, nk=nk, d=128, dtype="bf16")
        lens = [max(1, nk * (i + 1) // b) for i in range(b)]
        row = measure(p, lens, providers)
        row["padded_bytes"] = 2 * p["hkv"] * b * nk * p["d"] * 2
        results["ragged"].append(row)
        print("ragged", b, nk, {k: round(v.get("graph_ms", -1) * 1e3, 1) for k, v in row["providers"].items()}, flush=True)
        _write(results, args, "decode")
    return results


# ---------------------------------------------------------------------------------------------------
# The backward's dQ: two passes (deterministic) against the one-pass atomic backward (`--onepass`).
# ---------------------------------------------------------------------------------------------------
ONEPASS_CASES = (  # (label, N, B, Hq, Hkv, D, options): bf16, B * N = 16k tokens
    ("causal", 4096, 4, 16, 16, 128, {"causal": True}), ("causal", 16384, 1, 16, 16, 128, {"causal": True}),
    ("full", 4096, 4, 16, 16, 128, {}), ("full", 16384, 1, 16, 16, 128, {}),
    ("window1023", 16384, 1, 16, 16, 128, {"causal": True, "window": (1023, 0)}),
    ("gqa32/8-causal", 8192, 2, 32, 8, 128, {"causal": True}), ("d64-causal", 8192, 2, 32, 32, 64, {"causal": True}),
)
ONEPASS_MODES = (  # (label, deterministic, kernel option one_pass_backward)
    ("two_pass_fixed", True, 0), ("two_pass_tuned", False, 0), ("one_pass_atomic_add", False, 1),
    ("one_pass_tma", False, 2), ("auto", False, "auto"))


def run_onepass(args):
    """Backward time of each way of accumulating dQ (kernel option one_pass_backward), and each way's largest
    gradient difference from the deterministic two-pass backward."""
    import torch

    from fa_lib import kernel_options
    from fa_lib.options import current
    from fa_lib.ops import flash_attention

    results = {"part": "onepass", "environment": environment(),
               "convention": "bwd_ms: median of triton.testing.do_bench of o.backward (retain_graph, L2 flushed); "
                             "max_diff: largest |gradient - two_pass_fixed gradient| over dq, dk, dv. "
                             "two_pass_fixed = deterministic=True; the others deterministic=False (autotuned "
                             "blocks) with kernel option one_pass_backward = 0 (two passes), 1 (tl.atomic_add), 2 (TMA "
                             "reduce-add), 'auto' (the default rule)",
               "settings": {"concurrent_backward": current().concurrent_backward}, "points": []}
    for label, n, b, hq, hkv, d, opts in ONEPASS_CASES:
        gen = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for h in (hq, hkv, hkv))
        do = torch.randn_like(q)
        row = {"label": label, "n": n, "b": b, "hq": hq, "hkv": hkv, "d": d,
               **{k_: list(v_) if isinstance(v_, tuple) else v_ for k_, v_ in opts.items()}, "modes": {}}
        ref = None
        for name, det, mode in ONEPASS_MODES:
            with kernel_options(one_pass_backward=mode):
                o = flash_attention(q, k, v, deterministic=det, **opts)
            grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
            ref = grads if ref is None else ref
            row["modes"][name] = {
                "bwd_ms": _median_ms(lambda: o.backward(do, retain_graph=True), grad_to_none=[q, k, v]),
                "max_diff": max((g.float() - r.float()).abs().max().item() for g, r in zip(grads, ref))}
        results["points"].append(row)
        print(label, n, {m: round(r["bwd_ms"], 3) for m, r in row["modes"].items()}, flush=True)
        _write(results, args, "onepass")
        del q, k, v, do, o, grads, ref
        _free()
    return results


# ---------------------------------------------------------------------------------------------------
# The extended sweep (issue 14): head dims, GQA, Nq != Nk, small batches (`--extended`).
# ---------------------------------------------------------------------------------------------------
EXT_PROVIDERS = ("fa_lib", "fa_lib_nd", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
EXT_KINDS = ("square", "gqa", "prefill", "small")


def ext_heads(d):
    """Query heads at head dim d: H*d near 2048, a multiple of 4 (so that Hq/Hkv = 4 divides)."""
    return max(4, round(HIDDEN / d / 4) * 4)


def extended_points(dims=(64, 96, 128, 256), ns=(1024, 2048, 4096, 8192, 16384, 32768), dtypes=("bf16", "fp16"),
                    kinds=EXT_KINDS):
    """square: B*N = 16k, Hq = Hkv; gqa: the same with Hq/Hkv = 4; prefill: 512 queries against 8192 keys
    (B = 2); small: B = 64 sequences of N = 256. Causal and not for each."""
    for dtype in dtypes:
        for d in dims:
            hq = ext_heads(d)
            for causal in (False, True):
                base = dict(dtype=dtype, d=d, causal=causal, hq=hq)
                for kind in kinds:
                    if kind in ("square", "gqa"):
                        for n in ns:
                            yield dict(base, kind=kind, b=max(1, TOKENS // n), hkv=hq // 4 if kind == "gqa" else hq,
                                       nq=n, nk=n)
                    elif kind == "prefill":
                        yield dict(base, kind=kind, b=2, hkv=hq, nq=512, nk=8192)
                    elif kind == "small":
                        yield dict(base, kind=kind, b=64, hkv=hq, nq=256, nk=256)
                    else:
                        raise ValueError(f"unknown kind {kind!r}; expected one of {EXT_KINDS}")


def ext_key(p):
    return (p["kind"], p["dtype"], p["d"], p["causal"], p["b"], p["hq"], p["hkv"], p["nq"], p["nk"])


def visible_pairs_causal(nq, nk, causal):
    """(query, key) pairs a bottom-right causal mask lets through (all nq * nk when not causal)."""
    if not causal:
        return nq * nk
    return sum(max(0, min(nk, i + nk - nq + 1)) for i in range(nq))


def ext_flops(p, mode):
    """FLOPs of one pass at an extended-sweep point: ``mode`` "fwd" (two products of 2 d FLOPs per visible
    pair and head) or "bwd" (2.5 times the forward's)."""
    if mode not in ("fwd", "bwd"):
        raise ValueError(f'mode must be "fwd" or "bwd", got {mode!r}')
    f = 4 * p["b"] * p["hq"] * p["d"] * visible_pairs_causal(p["nq"], p["nk"], p["causal"])
    return f if mode == "fwd" else int(2.5 * f)


def _ext_fn(provider, p):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    causal = p["causal"]
    if provider in ("fa_lib", "fa_lib_nd"):
        from fa_lib.ops import flash_attention

        det = provider == "fa_lib"
        return lambda q, k, v: flash_attention(q, k, v, causal=causal, deterministic=det)
    backend = sdpa_backend(provider)
    gqa = p["hq"] != p["hkv"]
    mask = None
    if causal and p["nq"] != p["nk"]:  # SDPA's is_causal is top-left: ask for fa_lib's bottom-right mask
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(p["nq"], p["nk"])

    def fn(q, k, v):
        with sdpa_kernel([backend]):
            if mask is not None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return fn


def ext_bench_one(provider, p, warmup=25, rep=100, timing=True):
    import torch

    from .bench_profile import point_inputs

    q, k, v, do = point_inputs(p)
    fn = _ext_fn(provider, p)
    row = {"provider": provider, "fwd_ms": None, "bwd_ms": None}
    try:
        _time_fwd_bwd(fn, q, k, v, do, row, timing, warmup=warmup, rep=rep)
    except (RuntimeError, torch.OutOfMemoryError) as e:  # a backend that refuses the shape, or OOM
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    for mode in ("fwd", "bwd"):
        ms = row[f"{mode}_ms"]
        row[f"{mode}_tflops"] = None if ms is None else ext_flops(p, mode) / (ms * 1e-3) / 1e12
    del q, k, v, do, fn
    _free()
    return row


def ext_ratios(point):
    """fa_lib time over each SDPA backend's (> 1: fa_lib faster), for the default path and the better
    of fa_lib's two paths, forward and backward; None where a provider has no time."""
    ms = {r["provider"]: r for r in point["rows"]}
    out = {}
    for other in ("sdpa_flash", "sdpa_cudnn"):
        for mode in ("fwd", "bwd"):
            theirs = ms.get(other, {}).get(f"{mode}_ms")
            ours = ms.get("fa_lib", {}).get(f"{mode}_ms")
            best = min((t for t in (ours, ms.get("fa_lib_nd", {}).get(f"{mode}_ms")) if t), default=None)
            out[f"{other}_{mode}"] = theirs / ours if theirs and ours else None
            out[f"{other}_{mode}_best_path"] = theirs / best if theirs and best else None
    return out


# Later runs of parts of the extended sweep, after a kernel change at those points, in the order they
# were made: each file's points take the place of the points with the same key (`ext_key`).
EXT_PARTS = ("extended-prefill256-nvidia-h200.json", "extended-d96-nvidia-h200.json",
              "extended-d96-short-nvidia-h200.json", "extended-1k-nvidia-h200.json",
              "extended-hopper-nvidia-h200.json", "extended-hopper-order-nvidia-h200.json",
              "extended-hopper-bwd-nvidia-h200.json", "extended-hopper-bwd256-nvidia-h200.json",
              "extended-prefill-split-nvidia-h200.json", "extended-hopper-fwd256-nvidia-h200.json",
              "extended-host-nvidia-h200.json", "extended-plan-nvidia-h200.json",
              "extended-hopper-dq-nvidia-h200.json", "extended-hopper-onepass-nvidia-h200.json")


def extended_sweep(base="extended-nvidia-h200.json", parts=EXT_PARTS):
    """The extended sweep as it stands: the run `base` (benchmarks.data) with the points of each file of `parts`
    (later measurements of some of its points, after a kernel change) in their place. Every point keeps the
    sweep's order; a point from a part carries ``"part": <file name>``; the result also holds ``"parts"``, the list
    of files applied. `base` and `parts`: names of JSON files in benchmarks.data, each with a ``"points"`` list as
    ``--extended`` writes it. A part's point the base does not hold is a ValueError (a part measures points of the
    sweep, it does not add new ones); `parts` that is not a sequence of names, a TypeError."""
    from . import data

    if not isinstance(parts, (list, tuple)) or not all(isinstance(name, str) for name in parts):
        raise TypeError(f"parts must be a sequence of data file names, got {parts!r}")
    sweep = data.load_json(base)
    index = {ext_key(p): i for i, p in enumerate(sweep["points"])}
    for name in parts:
        for p in data.load_json(name)["points"]:
            key = ext_key(p)
            if key not in index:
                raise ValueError(f"{name}: point {key} is not in {base}")
            sweep["points"][index[key]] = dict(p, part=name)
    sweep["parts"] = list(parts)
    return sweep


def join_sweeps(pieces):
    """One sweep from the results of consecutive calls (each a dict as ``--extended`` writes, e.g. one per dtype on
    a machine whose calls are limited in time): every piece must record the same commit and device, no point may
    appear twice, and the points come out in `extended_points`' order. The result keeps each call's environment
    and ceilings under ``"calls"``. A piece without a commit, or pieces that differ in commit or device, are a
    ValueError: a sweep measures one version of the code on one card."""
    if not pieces:
        raise ValueError("join_sweeps needs at least one piece")
    envs = [piece.get("environment", {}) for piece in pieces]
    for key in ("commit", "device"):
        values = {env.get(key) for env in envs}
        if None in values or len(values) != 1:
            raise ValueError(f"the pieces of one sweep must share one {key}, got {sorted(map(str, values))}")
    points, seen = [], set()
    for piece in pieces:
        for point in piece["points"]:
            key = ext_key(point)
            if key in seen:
                raise ValueError(f"point {key} appears in more than one piece")
            seen.add(key)
            points.append(point)
    order = {ext_key(p): i for i, p in enumerate(extended_points())}
    unknown = [ext_key(p) for p in points if ext_key(p) not in order]
    if unknown:
        raise ValueError(f"{len(unknown)} point(s) are not in the sweep, the first: {unknown[0]}")
    points.sort(key=lambda p: order[ext_key(p)])
    return dict(pieces[0], environment=envs[0], points=points,
                calls=[{"environment": env, "ceilings": piece.get("ceilings"), "points": len(piece["points"])}
                       for env, piece in zip(envs, pieces)])


def _ext_precompile(todo, args):
    """Fill Triton's on-disk cache for the sweep's fa_lib kernels with `args.ext_precompile` processes at
    once (one per head dim and dtype), so the timed process loads compiled kernels instead of compiling
    them one after another. Their timings are thrown away (the autotuner's choices live in each process)."""
    import subprocess
    import sys

    groups = sorted({(p["dtype"], p["d"]) for p in todo})
    procs, t0 = [], time.perf_counter()
    for dtype, d in groups:
        while len([q for q in procs if q.poll() is None]) >= args.ext_precompile:
            time.sleep(0.5)
        cmd = [sys.executable, "-m", "benchmarks.bench", "--extended", "--ext-compile-only", "--ext-d", str(d),
               "--ext-dtypes", dtype, "--ext-n", *map(str, args.ext_n), "--ext-kinds", *args.ext_kinds,
               "--out-dir", args.out_dir] + (["--ext-resume"] if args.ext_resume else [])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
    failed = [q.args for q in procs if q.wait() != 0]
    print(f"precompiled {len(groups)} groups in {time.perf_counter() - t0:.0f} s"
          + (f"; failed: {failed}" if failed else ""), flush=True)


def run_extended(args):
    """issue 14's extended sweep; with --ext-resume, points already in the output JSON are kept and skipped,
    so the sweep can be run in pieces (each call is limited in time on a lent GPU)."""
    path = os.path.join(args.out_dir, f"extended-{_slug(environment()['device'])}.json")
    results = None
    if args.ext_resume and os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
    if results is None and args.ext_compile_only:
        results = {"points": []}
    if results is None:
        results = {"part": "extended", "environment": environment(), "ceilings": measure_ceilings(),
                   "convention": "FLOPs: 4*B*Hq*D*visible_pairs forward (bottom-right causal), backward 2.5x; "
                                 "ms: median of triton.testing.do_bench (L2 flushed); fa_lib = deterministic=True "
                                 "(fixed blocks), fa_lib_nd = deterministic=False (autotuned, one-pass backward "
                                 "where chosen); SDPA causal with Nq != Nk uses causal_lower_right",
                   "points": []}
    done = {ext_key(p) for p in results["points"]}
    todo = [p for p in extended_points(args.ext_d, args.ext_n, args.ext_dtypes, args.ext_kinds)
            if ext_key(p) not in done]
    if args.ext_compile_only:  # a worker of --ext-precompile: compile and autotune fa_lib, time nothing
        for p in todo:
            for prov in ("fa_lib", "fa_lib_nd"):
                ext_bench_one(prov, p, timing=False)
        return None
    if args.ext_precompile > 1 and todo:
        _ext_precompile(todo, args)
    for p in todo:
        t0 = time.perf_counter()
        point = dict(p, rows=[ext_bench_one(prov, p, args.ext_warmup_ms, args.ext_rep_ms)
                              for prov in args.ext_providers])
        point["timing"] = {"warmup_ms": args.ext_warmup_ms, "rep_ms": args.ext_rep_ms,
                           "point_s": round(time.perf_counter() - t0, 1)}
        point["ratio"] = ext_ratios(point)
        results["points"].append(point)
        r = point["ratio"]
        print(f"{p['kind']:<8}{p['dtype']} d{p['d']:<4}{'causal' if p['causal'] else 'full  '} B{p['b']:<3}"
              f"H{p['hq']}/{p['hkv']:<3} {p['nq']}x{p['nk']:<6} vs FA2 {_r(r['sdpa_flash_fwd'])}/"
              f"{_r(r['sdpa_flash_bwd'])}  vs cuDNN {_r(r['sdpa_cudnn_fwd'])}/{_r(r['sdpa_cudnn_bwd'])}", flush=True)
        _write(results, args, "extended")
    return results


# ---------------------------------------------------------------------------------------------------
# Block configurations, one kernel at a time (`--configs`): the probe that chose the d = 256 dQ blocks,
# as a subcommand, so that the next hypothesis (fewer live registers in the d = 256 dK/dV kernel, a
# smaller forward query block where the grid has fewer programs than SMs) is one command.
# ---------------------------------------------------------------------------------------------------
def parse_shape(text):
    """"B,Hq,Hkv,Nq,Nk,D,causal" -> a point dict (dtype from --cfg-dtype); causal is 0 or 1."""
    parts = text.split(",")
    if len(parts) != 7 or parts[6] not in ("0", "1"):
        raise ValueError(f"--cfg-shapes: expected B,Hq,Hkv,Nq,Nk,D,causal (causal 0 or 1), got {text!r}")
    b, hq, hkv, nq, nk, d = (int(x) for x in parts[:6])
    if min(b, hq, hkv, nq, nk, d) < 1 or hq % hkv:
        raise ValueError(f"--cfg-shapes: sizes must be >= 1 and Hq a multiple of Hkv, got {text!r}")
    return dict(b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, causal=parts[6] == "1")


def parse_config(text):
    """"BLOCK_M,BLOCK_N,warps,stages" -> a 4-tuple of ints."""
    parts = text.split(",")
    if len(parts) != 4 or not all(x.isdigit() and int(x) > 0 for x in parts):
        raise ValueError(f"--cfg-candidates: expected BLOCK_M,BLOCK_N,warps,stages (positive ints), got {text!r}")
    return tuple(int(x) for x in parts)


@contextlib.contextmanager
def override_config(kernel, config):
    """Within the block, fa_lib's fixed table answers `config` for `kernel` ("fwd", "dkdv", "dq")."""
    from fa_lib import kernels

    real = kernels.default_config

    def patched(name, *a, **kw):
        return config if name == kernel and config is not None else real(name, *a, **kw)

    kernels.default_config = patched
    try:
        yield
    finally:
        kernels.default_config = real


def run_configs(args):
    """Time the whole forward (kernel fwd) or backward (dkdv, dq) pass of fa_lib at each shape with the
    kernel's default blocks and with each candidate; the best candidate by geometric mean of time / default."""
    from .bench_profile import point_inputs
    from fa_lib.ops import flash_attention

    shapes = [dict(parse_shape(t), dtype=args.cfg_dtype) for t in args.cfg_shapes]
    candidates = [None] + [parse_config(t) for t in args.cfg_candidates]
    results = {"part": f"configs-{args.cfg_tag}", "environment": environment(),
               "convention": f"ms: median of triton.testing.do_bench (L2 flushed) of the whole "
                             f"{'forward' if args.cfg_kernel == 'fwd' else 'backward'} with only the "
                             f"{args.cfg_kernel} kernel's blocks replaced (None: fa_lib's table); "
                             f"{args.cfg_dtype}; best: lowest geometric mean of ms / default",
               "kernel": args.cfg_kernel, "probe": []}
    for p in shapes:
        q, k, v, do = point_inputs(p)

        def call(q, k, v, causal=p["causal"]):
            return flash_attention(q, k, v, causal=causal)

        for cfg in candidates:
            row = dict(p, config=cfg, ms=None)
            try:
                with override_config(args.cfg_kernel, cfg):
                    if args.cfg_kernel == "fwd":
                        call(q, k, v)
                        row["ms"] = _median_ms(lambda: call(q, k, v))
                    else:
                        o = call(q, k, v)
                        o.backward(do, retain_graph=True)
                        row["ms"] = _median_ms(lambda: o.backward(do, retain_graph=True), grad_to_none=[q, k, v])
            except Exception as e:  # a configuration the compiler refuses (too much shared memory, ...)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            results["probe"].append(row)
            print(f"{p} {cfg}: {row['ms'] if row['ms'] is None else round(row['ms'], 4)} ms"
                  + (f"  {row['error']}" if "error" in row else ""), flush=True)
            _write(results, args, results["part"])
        del q, k, v, do
        _free()
    results["best"] = best_config(results["probe"])
    return results


def best_config(probe):
    """{config: geometric mean over the shapes of ms / the default's ms} and the lowest; a candidate that
    failed at any shape is left out."""
    key = lambda r: (r["b"], r["hq"], r["hkv"], r["nq"], r["nk"], r["d"], r["causal"])  # noqa: E731
    default = {key(r): r["ms"] for r in probe if r["config"] is None}
    by_cfg = {}
    for r in probe:
        if r["config"] is not None:
            by_cfg.setdefault(tuple(r["config"]), []).append(r["ms"] / default[key(r)] if r["ms"] else None)
    geo = {str(c): math.exp(sum(math.log(x) for x in v) / len(v)) for c, v in by_cfg.items() if None not in v}
    return {"geomean_vs_default": geo, "config": min(geo, key=geo.get) if geo else None}


def run_experiments(args):
    results = {"part": "experiments", "environment": environment(), "store_p": [], "checkpointing": []}
    results["store_p"] = experiment_store_p(args)
    _write(results, args, "experiments")
    results["checkpointing"] = experiment_checkpointing(args)
    _write(results, args, "experiments")
    return results


# ---------------------------------------------------------------------------------------------------
# Training masks (issue 13): fa_lib against FlexAttention and SDPA with an explicit mask (`--masks`).
# ---------------------------------------------------------------------------------------------------
MASK_KINDS = ("varlen", "window", "softcap", "padding")
MASK_PROVIDERS = ("fa_lib", "flex", "sdpa")
GEMMA2_SOFTCAP = 50.0  # Gemma 2's attention logit softcap
MASK_TARGET = {"kinds": ["varlen", "window", "softcap"], "min_n": 4096, "min_ratio": 1.0,
               "rule": "issue 13: fa_lib at least as fast as FlexAttention, forward and backward (ratio = "
                       "FlexAttention ms / fa_lib ms >= 1.0 for both), for varlen, sliding window and softcap at "
                       "N >= 4096"}
MASK_CONVENTION = (
    "N: tokens per sequence (dense masks: B sequences of N, B*N = tokens) or per pack (varlen: B packs of N "
    "tokens laid end to end, each a fixed-seed mix of causal documents that ends at the pack's end, one "
    "cu_seqlens over all B*N tokens). visible_pairs: (query, key) pairs the mask lets through, per head, "
    "summed over the batch, counted exactly. FLOPs count visible pairs only: fwd 4*Hq*D*visible_pairs, bwd "
    "2.5x fwd, fwd_bwd 3.5x fwd. ms: median of triton.testing.do_bench (L2 flushed), fwd = forward, bwd = "
    "backward alone (retain_graph), fwd_bwd = forward then backward in one call. ratio = FlexAttention ms / "
    "fa_lib ms (> 1: fa_lib faster). FlexAttention: torch.compile(flex_attention, dynamic=False) with its "
    "default kernel options, a BlockMask built once outside the timed region (create_block_mask, default "
    "128x128 blocks), mask_mod per mask, score_mod for softcap. SDPA: "
    "torch.nn.functional.scaled_dot_product_attention with a boolean attn_mask (True = attend; default backend "
    "choice, recorded; GQA k/v repeated to Hq inside the timed call).")


def document_lengths(n, seed, min_len=16):
    """Ragged document lengths summing to exactly ``n``: a fixed-seed draw, log-uniform between
    ``min_len`` and ``n`` (so a few long documents and many short ones), the last one cut to fit."""
    import random

    rng = random.Random(seed)
    lens, total = [], 0
    while total < n:
        x = int(round(math.exp(rng.uniform(math.log(min_len), math.log(max(n, 2))))))
        x = max(1, min(x, n - total))
        lens.append(x)
        total += x
    return lens


def packed_documents(b, n, seed=0, min_len=16):
    """``b`` packs of ``n`` tokens each, every pack a mix of documents (``document_lengths``) that ends at
    the pack's end; returns the flat list of document lengths (sum ``b * n``) and flash-attn's
    ``cu_seqlens`` over all of them (a list of ints, starting at 0)."""
    lens = [x for i in range(b) for x in document_lengths(n, seed * 1000 + i, min_len)]
    cu = [0]
    for x in lens:
        cu.append(cu[-1] + x)
    return lens, cu


def _window_sides(window, causal):
    left, right = (int(w) for w in window)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def window_pairs(nq, nk, window=(-1, -1), causal=False, nk_valid=None):
    """The number of visible (query, key) pairs of one sequence, counted exactly without forming the mask:
    query ``i`` sees key ``j`` iff ``i + nk - nq - left <= j <= i + nk - nq + right`` (a side of -1 is
    unbounded; ``causal`` sets ``right = 0``), as ``fa_lib.reference.window_visible``; keys at or past
    ``nk_valid`` (a key padding mask's padded tail) are never seen."""
    import numpy as np

    left, right = _window_sides(window, causal)
    last = nk if nk_valid is None else min(nk, nk_valid)
    if nq <= 0 or last <= 0:
        return 0
    rows = np.arange(nq, dtype=np.int64) + (nk - nq)
    lo = np.maximum(rows - left, 0) if left >= 0 else np.zeros_like(rows)
    hi = np.minimum(rows + right, last - 1) if right >= 0 else np.full_like(rows, last - 1)
    return int(np.maximum(hi - lo + 1, 0).sum())


def visible_pairs(point):
    """Visible pairs of a benchmark point, per head, summed over its batch (or its packed documents)."""
    window, causal, n = point["window"], point["causal"], point["n"]
    if point["mask"] == "varlen":
        return sum(window_pairs(x, x, window, causal) for x in point["doc_lens"])
    valid = point.get("valid_lens") or [n] * point["b"]
    return sum(window_pairs(n, n, window, causal, nk_valid=x) for x in valid)


def document_ids(cu_seqlens):
    """Token -> document index (int64 tensor of ``cu_seqlens[-1]`` entries) of a flash-attn ``cu_seqlens``."""
    import torch

    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64).cpu()
    return torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff())


def document_mask(cu_seqlens, n, causal=True, window=(-1, -1)):
    """The boolean (B, n, n) mask (True = visible) of a packed batch cut into B packs of ``n`` tokens:
    a query sees a key of its own document only, with the causal/window rule inside the document (its
    queries and keys have one length, so the rule uses their distance). No document may cross a pack
    boundary (then each pack is an independent dense sequence, the SDPA and reference view)."""
    import torch

    ids = document_ids(cu_seqlens)
    total = ids.numel()
    if n <= 0 or total % n:
        raise ValueError(f"cu_seqlens[-1] = {total} must be a multiple of the pack length n = {n}")
    cu = [int(c) for c in torch.as_tensor(cu_seqlens).tolist()]
    if any((a // n) != ((b - 1) // n) for a, b in zip(cu[:-1], cu[1:]) if b > a):
        raise ValueError("a document crosses a pack boundary; document_mask needs packs of whole documents")
    ids = ids.view(total // n, n)
    pos = torch.arange(n)
    rows, cols = pos[:, None], pos[None, :]
    vis = ids[:, :, None] == ids[:, None, :]
    left, right = _window_sides(window, causal)
    if left >= 0:
        vis &= cols >= rows - left
    if right >= 0:
        vis &= cols <= rows + right
    return vis


def dense_mask(point, batch=None):
    """The boolean visibility of a benchmark point's sequences (True = visible), broadcastable to
    (B, 1, N, N) as SDPA's ``attn_mask`` takes it: (B, 1, N, N) for varlen, (1, 1, N, N) for a window or
    causal mask, (B, 1, 1, N) for a key padding mask. ``batch``: only that batch row (size-1 batch dim)."""
    import torch

    from fa_lib import reference

    n = point["n"]
    if point["mask"] == "varlen":
        m = document_mask(point["cu_seqlens"], n, point["causal"], point["window"])[:, None]
        return m if batch is None else m[batch:batch + 1]
    if point["mask"] == "padding":
        valid = torch.tensor(point["valid_lens"])[:, None, None, None]
        m = torch.arange(n)[None, None, None, :] < valid
        m = m if batch is None else m[batch:batch + 1]
        if point["causal"] or tuple(point["window"]) != (-1, -1):
            m = m & torch.from_numpy(reference.window_visible(n, n, point["window"], point["causal"]))
        return m
    return torch.from_numpy(reference.window_visible(n, n, point["window"], point["causal"]))[None, None]


def mask_points(ns=(4096, 8192, 16384), kinds=MASK_KINDS, windows=(1024, 4096), tokens=TOKENS, h=16, d=128,
                gqa=(32, 8), softcap=GEMMA2_SOFTCAP, dtype="bf16", seed=0):
    """The benchmark's points: every mask kind at every N with B = tokens // N, H heads of D.

    varlen and softcap and window are causal, padding is not (an encoder's key padding mask, a random
    padded tail per batch row). A window of ``left`` keys runs only where ``left < N - 1`` (wider is plain
    causal). ``gqa=(Hq, Hkv)`` adds one grouped-query point: varlen at the middle N (a Llama-3-like shape).
    Each point carries its data (document lengths, ``cu_seqlens``, valid key lengths) and its exact
    ``visible_pairs``.
    """
    import random

    ns = sorted(ns)
    pts = []

    def add(p):
        if p["mask"] == "varlen":
            p["doc_lens"], p["cu_seqlens"] = packed_documents(p["b"], p["n"], seed=seed + p["n"],
                                                              min_len=min(16, max(1, p["n"] // 8)))
            p["max_seqlen"] = max(p["doc_lens"])
        if p["mask"] == "padding":
            rng = random.Random(seed * 1000 + p["n"])
            p["valid_lens"] = [rng.randint(max(1, p["n"] // 4), max(1, p["n"] - 1)) for _ in range(p["b"])]
        p["visible_pairs"] = visible_pairs(p)
        p["density"] = p["visible_pairs"] / (p["b"] * p["n"] * p["n"])
        pts.append(p)

    for kind in kinds:
        if kind not in MASK_KINDS:
            raise ValueError(f"unknown mask kind {kind!r}; expected one of {MASK_KINDS}")
        for n in ns:
            base = dict(mask=kind, label=kind, n=n, b=max(1, tokens // n), hq=h, hkv=h, d=d, dtype=dtype,
                        causal=True, window=[-1, -1], softcap=0.0)
            if kind == "window":
                for left in windows:
                    if left < n - 1:
                        add({**base, "label": f"window{left}", "window": [int(left), 0]})
            elif kind == "softcap":
                add({**base, "label": f"softcap{softcap:g}", "softcap": float(softcap)})
            elif kind == "padding":
                add({**base, "causal": False})
            else:
                add(base)
    if gqa and "varlen" in kinds:
        n = ns[len(ns) // 2]
        add(dict(mask="varlen", label=f"varlen-gqa{gqa[0]}/{gqa[1]}", n=n, b=max(1, tokens // n), hq=gqa[0],
                 hkv=gqa[1], d=d, dtype=dtype, causal=True, window=[-1, -1], softcap=0.0))
    return pts


def mask_flops(point, mode):
    """FLOPs of a point counting its visible pairs only: fwd ``4·Hq·D·pairs``, bwd 2.5x, fwd_bwd 3.5x."""
    f = 4 * point["hq"] * point["d"] * point["visible_pairs"]
    return {"fwd": f, "bwd": int(2.5 * f), "fwd_bwd": int(3.5 * f)}[mode]


def mask_target(point, ratio):
    """Whether a point falls under issue 13's target, and whether it meets it (None: not measured)."""
    applies = point["mask"] in MASK_TARGET["kinds"] and point["n"] >= MASK_TARGET["min_n"]
    if not applies:
        return {"applies": False, "met": None}
    fwd, bwd = ratio.get("fwd"), ratio.get("bwd")
    if fwd is None or bwd is None:
        return {"applies": True, "met": None}
    return {"applies": True, "met": bool(fwd >= MASK_TARGET["min_ratio"] and bwd >= MASK_TARGET["min_ratio"])}


# The layouts the providers take, all views of one (B·N, H, D) storage of random data:
#   "packed" (B·N, H, D): fa_lib varlen; "bhnd" (B, H, N, D): fa_lib dense, FlexAttention dense, SDPA;
#   "flex_packed" (1, H, B·N, D): FlexAttention over a packed batch (document mask on one long row).
def _to_layout(x, layout, b, n):
    if layout == "packed":
        return x
    if layout == "bhnd":
        return x.view(b, n, *x.shape[1:]).transpose(1, 2)
    return x.transpose(0, 1).unsqueeze(0)  # flex_packed


def _from_layout(x, layout, b, n):
    """Back to (B, H, N, D) from a provider's layout."""
    if layout == "packed":
        return x.view(b, n, *x.shape[1:]).transpose(1, 2)
    if layout == "bhnd":
        return x
    return x[0].view(x.shape[1], b, n, x.shape[-1]).transpose(0, 1)


_FLEX_COMPILED = None


def _flex_attention(compiled):
    """FlexAttention, compiled once per process (``dynamic=False``: a static kernel per shape, as its
    benchmarks run it), with Dynamo's recompile limit raised so each (shape, mask) compiles."""
    global _FLEX_COMPILED
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if _FLEX_COMPILED is None:
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED


class _Skip(Exception):
    """A provider that cannot run a point, with the reason recorded in the JSON."""


def mask_provider(provider, point, device, compiled=True, sdpa_max_bytes=4 << 30):
    """``(layout, make)`` for one provider on one point: ``make(q, k, v)`` (tensors in ``layout``) returns
    a callable ``() -> o``. Masks, block masks and cu_seqlens are built here, outside any timed region.
    Raises ``_Skip`` (with the reason) where the provider cannot express the point."""
    import torch

    b, n, hq, hkv = point["b"], point["n"], point["hq"], point["hkv"]
    window, causal, softcap = tuple(point["window"]), point["causal"], point["softcap"]
    if provider == "fa_lib":
        import fa_lib

        if point["mask"] == "varlen":
            if not hasattr(fa_lib, "flash_attention_varlen"):
                raise _Skip("fa_lib.flash_attention_varlen does not exist in this version")
            cu = torch.tensor(point["cu_seqlens"], dtype=torch.int32, device=device)
            m = point["max_seqlen"]
            kw = {"causal": causal}
            if window != (-1, -1):
                kw["window"] = window
            if softcap:
                kw["softcap"] = softcap
            return "packed", lambda q, k, v: (lambda: fa_lib.flash_attention_varlen(q, k, v, cu, cu, m, m, **kw))
        kw = {"causal": causal}
        if window != (-1, -1):
            kw["window"] = window
        if softcap:
            kw["softcap"] = softcap
        if point["mask"] == "padding":
            kw["key_padding_mask"] = (torch.arange(n)[None, :] < torch.tensor(point["valid_lens"])[:, None]).to(device)
        return "bhnd", lambda q, k, v: (lambda: fa_lib.flash_attention(q, k, v, **kw))
    if provider == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        flex = _flex_attention(compiled)
        left, right = _window_sides(window, causal)
        cap = float(softcap)

        def softcap_mod(score, b_, h_, q_idx, kv_idx):  # Gemma 2: cap * tanh(s / cap), s already scaled
            return cap * torch.tanh(score / cap)

        score_mod = softcap_mod if softcap else None

        def in_window(q_idx, kv_idx):
            ok = None
            if left >= 0:
                ok = q_idx - kv_idx <= left
            if right >= 0:
                r = kv_idx - q_idx <= right
                ok = r if ok is None else ok & r
            return ok

        if point["mask"] == "varlen":
            doc = document_ids(point["cu_seqlens"]).to(device=device, dtype=torch.int32)

            def mask_mod(b_, h_, q_idx, kv_idx):
                same = doc[q_idx] == doc[kv_idx]
                w = in_window(q_idx, kv_idx)
                return same if w is None else same & w

            layout, shape = "flex_packed", (None, None, b * n, b * n)
        elif point["mask"] == "padding":
            valid = torch.tensor(point["valid_lens"], dtype=torch.int32, device=device)

            def mask_mod(b_, h_, q_idx, kv_idx):
                keep = kv_idx < valid[b_]
                w = in_window(q_idx, kv_idx)
                return keep if w is None else keep & w

            layout, shape = "bhnd", (b, None, n, n)
        else:
            if left < 0 and right < 0:
                raise ValueError("a dense point without a causal or window mask is not a masks benchmark point")

            def mask_mod(b_, h_, q_idx, kv_idx):
                return in_window(q_idx, kv_idx)

            layout, shape = "bhnd", (None, None, n, n)
        block_mask = create_block_mask(mask_mod, *shape, device=device)
        gqa = hq != hkv
        return layout, lambda q, k, v: (
            lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa))
    if provider == "sdpa":
        import torch.nn.functional as F

        if softcap:
            raise _Skip("n/a: SDPA cannot express softcap (no score modification before the softmax)")
        shape = {"varlen": (b, 1, n, n), "padding": (b, 1, 1, n)}.get(point["mask"], (1, 1, n, n))
        mask_bytes = math.prod(shape)
        if mask_bytes > sdpa_max_bytes:
            raise _Skip(f"the boolean mask {shape} takes {mask_bytes} bytes > --masks-sdpa-max-bytes {sdpa_max_bytes}")
        mask = dense_mask(point).to(device)
        group = hq // hkv

        def make(q, k, v):
            def fn():
                kk, vv = (k, v) if group == 1 else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
                return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
            return fn

        make.mask = mask
        return "bhnd", make
    raise ValueError(f"unknown provider {provider!r}")


def _sdpa_backend(q, mask):
    """The backend SDPA's dispatcher picks for q-shaped inputs and this mask (a label for the JSON)."""
    import torch
    from torch.nn.attention import SDPBackend

    try:
        return SDPBackend(torch._fused_sdp_choice(q, q, q, attn_mask=mask)).name
    except Exception as e:  # private API; only a label
        return f"unknown ({type(e).__name__})"


def _sync(device):
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _cpu_ms(fn, grad_to_none=None, reps=1):
    """The smoke test's timer (no CUDA events): the median of ``reps`` wall-clock calls, in ms."""
    times = []
    for _ in range(reps):
        for x in grad_to_none or ():
            x.grad = None
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def masked_reference(q, k, v, do, visible, *, softcap=0.0, softmax_scale=None, upcast=True):
    """Plain PyTorch attention with a boolean mask and softcap, forward and backward; returns o, dq, dk, dv.

    q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) (GQA by ``repeat_interleave``), ``visible`` broadcastable
    to (B, Hq, Nq, Nk), True = visible. ``upcast=True`` computes in float64 (gold), else in the inputs'
    dtype (the same-precision baseline of the flash-attn rule). A row that sees no key gives 0.
    """
    import torch

    dtype = torch.float64 if upcast else q.dtype
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.matmul(q, kk.transpose(-2, -1)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    visible = visible.to(q.device)
    empty = ~visible.any(dim=-1, keepdim=True)
    s = s.masked_fill(~visible, float("-inf")).masked_fill(empty, 0.0)
    p = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)
    o = torch.matmul(p, vv)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do.to(dtype))
    return {"o": o.detach(), "dq": dq, "dk": dk, "dv": dv}


def _check_slice(x, name, g):
    """The part of a (B, H, N, D) tensor the check compares: batch 0, query heads 0..g-1 or key head 0."""
    return x[:1, :g] if name in ("o", "dq") else x[:1, :1]


def _measure_masked(prov, pt, base, device, timer, args, check):
    """Time one provider on one point (and keep its check slices); returns ``(row, out)``. A provider
    that cannot express the point is ``skipped`` (with the reason), one that fails has an ``error``."""
    import torch

    from fa_lib import testing

    b, n, g = pt["b"], pt["n"], pt["hq"] // pt["hkv"]
    row, out = {"provider": prov}, None
    try:
        t0 = time.perf_counter()
        layout, make = mask_provider(prov, pt, device, compiled=not args.smoke,
                                     sdpa_max_bytes=args.masks_sdpa_max_bytes)
        row["setup_s"] = time.perf_counter() - t0  # masks, block masks, cu_seqlens (untimed)
        grad = not (prov == "flex" and device == "cpu")  # FlexAttention has no CPU backward
        q, k, v, do = (_to_layout(x, layout, b, n).clone(memory_format=torch.contiguous_format)
                       for x in base)  # fresh leaves in the provider's own layout
        if grad:
            q, k, v = (x.requires_grad_() for x in (q, k, v))
        fn = make(q, k, v)
        if prov == "sdpa":
            row["backend"] = _sdpa_backend(q, make.mask)
        t0 = time.perf_counter()
        o = fn()
        if grad:
            o.backward(do)
        _sync(device)
        row["first_call_s"] = time.perf_counter() - t0  # compiles (FlexAttention, Triton) included
        del o
        row["fwd_ms"] = timer(fn)
        if grad:
            try:
                o = fn()
                row["bwd_ms"] = timer(lambda: o.backward(do, retain_graph=True), grad_to_none=[q, k, v])
            except RuntimeError as e:  # a backward that cannot run twice on one graph
                row["bwd_note"] = f"backward alone failed ({str(e)[:160]}); bwd_ms = fwd_bwd_ms - fwd_ms"
            o = None
            row["fwd_bwd_ms"] = timer(lambda: fn().backward(do), grad_to_none=[q, k, v])
            if "bwd_note" in row:
                row["bwd_ms"] = row["fwd_bwd_ms"] - row["fwd_ms"]
        else:
            row["bwd_error"] = "n/a: FlexAttention has no backward on CPU"
        if check and prov in ("fa_lib", "flex"):
            with testing.poisoned_outputs() if prov == "fa_lib" else contextlib.nullcontext():
                o = fn()
                grads = torch.autograd.grad(o, (q, k, v), do) if grad else ()
            out = {"o": _check_slice(_from_layout(o.detach(), layout, b, n), "o", g)}
            for name, x in zip(("dq", "dk", "dv"), grads):
                out[name] = _check_slice(_from_layout(x, layout, b, n), name, g)
    except _Skip as e:
        row["skipped"] = str(e)
    except Exception as e:  # a provider that fails on a point: recorded, the run goes on
        msg = str(e).splitlines()[0][:300] if str(e) else ""
        row["error"] = f"{type(e).__name__}: {msg}"
    for mode in ("fwd", "bwd", "fwd_bwd"):
        ms = row.get(f"{mode}_ms")
        row[f"{mode}_tflops"] = None if ms is None else mask_flops(pt, mode) / (ms * 1e-3) / 1e12
    return row, out


def run_masks(args):
    """issue 13's benchmark: fa_lib against FlexAttention and SDPA with an explicit mask."""
    import torch

    from fa_lib import ops
    from fa_lib.options import current

    smoke = args.smoke
    device = DEVICE if torch.cuda.is_available() else "cpu"
    if smoke:
        ns = args.masks_n or [32]
        pts = mask_points(ns, args.masks_kinds, args.masks_windows or [4, 12], tokens=max(ns), h=2, d=16,
                          gqa=(4, 2), softcap=1.0, dtype=args.masks_dtype)
        timer = _cpu_ms if device == "cpu" else (lambda fn, grad_to_none=None: _median_ms(fn, grad_to_none, 1, 3))
    else:
        ns = args.masks_n or [4096, 8192, 16384]
        pts = mask_points(ns, args.masks_kinds, args.masks_windows or [1024, 4096], dtype=args.masks_dtype)
        timer = _median_ms
    if device == "cpu":
        env = {"device": "cpu", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "note": "CPU smoke run: fa_lib under the Triton interpreter, FlexAttention eager (forward only)"}
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        env = environment()
    providers = list(args.masks_providers)
    part = "masks-smoke" if smoke else "masks"  # a smoke run never overwrites the measurements
    results = {"part": part, "environment": env, "smoke": bool(smoke), "convention": MASK_CONVENTION,
               "target": MASK_TARGET, "providers": providers,
               "settings": {"device": device, "flex_compiled": not smoke,
                            "concurrent_backward": current().concurrent_backward,
                            "timer": "wall clock, one call (smoke)" if smoke and device == "cpu" else
                            "triton.testing.do_bench median" + (" (warmup 1, rep 3: smoke)" if smoke else "")},
               "points": [], "summary": {}}
    start = time.perf_counter()
    print(env, flush=True)
    lines = mask_table_lines([], providers)
    print("\n".join(lines[:3]), flush=True)
    checked = set()
    for pt in pts:
        t_point = time.perf_counter()
        point = {**pt, "rows": []}
        check = pt["label"] not in checked and "fa_lib" in providers and not args.no_check
        checked.add(pt["label"])
        b, n, hq, hkv, d = pt["b"], pt["n"], pt["hq"], pt["hkv"], pt["d"]
        dtype = torch.float32 if pt["dtype"] == "fp32" else _dtype(pt["dtype"])
        gen = torch.Generator(device=device).manual_seed(1000 + n)
        base = [torch.randn(b * n, h, d, device=device, dtype=dtype, generator=gen) for h in (hq, hkv, hkv, hq)]
        outs = {}
        for prov in providers:
            row, out = _measure_masked(prov, pt, base, device, timer, args, check)
            if out is not None:
                outs[prov] = out
            point["rows"].append(row)
            if device != "cpu":
                _free()
        by = {r["provider"]: r for r in point["rows"]}
        fa, fl = by.get("fa_lib", {}), by.get("flex", {})
        point["ratio"] = {m: (fl[f"{m}_ms"] / fa[f"{m}_ms"] if fa.get(f"{m}_ms") and fl.get(f"{m}_ms") else None)
                          for m in ("fwd", "bwd", "fwd_bwd")}
        point["target"] = mask_target(pt, point["ratio"])
        if check:
            try:
                point["check"] = mask_check(pt, base, outs, device)
            except Exception as e:  # e.g. out of memory in the reference: recorded, the run goes on
                point["check"] = {"ok": None, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        point["seconds"] = time.perf_counter() - t_point
        del base, outs
        results["points"].append(point)
        print(mask_table_lines([point], providers)[-1], flush=True)
        results["summary"] = mask_summary(results["points"])
        results["wall_s"] = time.perf_counter() - start
        _write(results, args, part)  # after every point: a run cut short still leaves its data
    print()
    print("\n".join(mask_table_lines(results["points"], providers)))
    print(json.dumps(results["summary"]), flush=True)
    return results


def mask_check(point, base, outs, device):
    """fa_lib (and FlexAttention) against a float64 PyTorch reference of the same mask, on batch 0 (pack
    0 for varlen), query heads 0..g-1 and key head 0 (g = Hq / Hkv); the kernels ran at the benchmarked
    shape. ``ok``: the flash-attn rule of ``fa_lib.testing`` (error at most 2x that of plain PyTorch in the
    same dtype) on o, dq, dk, dv; max abs errors recorded for each."""
    from fa_lib import testing

    b, n, g = point["b"], point["n"], point["hq"] // point["hkv"]
    q, k, v, do = (_check_slice(_to_layout(x, "bhnd", b, n), name, g)
                   for x, name in zip(base, ("o", "dk", "dv", "o")))
    visible = dense_mask(point, batch=0).to(device)
    gold = masked_reference(q, k, v, do, visible, softcap=point["softcap"], upcast=True)
    same = masked_reference(q, k, v, do, visible, softcap=point["softcap"], upcast=False)
    result = {"n": n, "compared": f"batch 0, query heads 0..{g - 1}, key head 0",
              "reference": "float64 PyTorch with the boolean mask", "max_abs_err": {}}
    err = testing._max_error
    result["max_abs_err"]["torch_same_dtype"] = {k_: err(same[k_], gold[k_]) for k_ in gold}
    for prov, out in outs.items():
        result["max_abs_err"][prov] = {k_: err(x, gold[k_]) for k_, x in out.items()}
    if "fa_lib" in outs and "flex" in outs:
        result["max_abs_diff_fa_lib_flex"] = {k_: err(outs["fa_lib"][k_], x) for k_, x in outs["flex"].items()}
    if "fa_lib" not in outs:
        result["ok"] = None
        return result
    names = tuple(k_ for k_ in ("o", "dq", "dk", "dv") if k_ in outs["fa_lib"])
    try:
        report = testing.assert_flash_rule(outs["fa_lib"], gold, same, names=names)
        result["ok"] = True
        result["ratio_to_same_dtype"] = {k_: r for k_, (_, _, r) in report.items()}
    except AssertionError as e:
        result.update(ok=False, error=str(e)[:400])
    return result


def mask_summary(points):
    """The target tally: which points the issue's target covers, how many met it, and the failures."""
    covered = [p for p in points if p["target"]["applies"]]
    met = [p for p in covered if p["target"]["met"]]
    checks = [p["check"]["ok"] for p in points if "check" in p]
    return {"target_points": len(covered), "target_met": len(met),
            "target_all_met": bool(covered) and len(met) == len(covered),
            "target_missed": [f"{p['label']} N={p['n']} fwd {_r(p['ratio']['fwd'])} bwd {_r(p['ratio']['bwd'])}"
                              for p in covered if not p["target"]["met"]],
            "checks": len(checks), "checks_ok": sum(1 for c in checks if c)}


def _r(x):
    return "-" if x is None else f"{x:.2f}"


def mask_table_lines(points, providers):
    """One line per point: fwd/bwd TFLOP/s (visible pairs) per provider, fa_lib / FlexAttention ratios."""
    head = f"{'mask':<16} {'N':>5} {'B':>2} {'Hq/kv':>5} {'vis%':>5} |" + "".join(f" {p:>9} |" for p in providers)
    head += " fa/flex fwd  bwd | target | check"
    lines = ["TFLOP/s over visible pairs, forward/backward (median of do_bench)", head, "-" * len(head)]
    for p in points:
        by = {r["provider"]: r for r in p["rows"]}
        cells = ""
        for prov in providers:
            r = by.get(prov, {})
            cells += (f" {'n/a':>9} |" if "skipped" in r and r["skipped"].startswith("n/a") else
                      f" {_fmt(r.get('fwd_tflops'))}/{_fmt(r.get('bwd_tflops'))} |")
        t = p["target"]
        target = "  -   " if not t["applies"] else {None: "  ?   ", True: " yes  ", False: "  NO  "}[t["met"]]
        ok = p.get("check", {}).get("ok", "")
        ok = {True: "yes", False: "NO", None: "-", "": ""}[ok]
        lines.append(f"{p['label']:<16} {p['n']:>5} {p['b']:>2} {p['hq']:>2}/{p['hkv']:<2} {100 * p['density']:>5.1f} |"
                     f"{cells}        {_r(p['ratio']['fwd']):>4} {_r(p['ratio']['bwd']):>4} | {target} | {ok}")
    return lines


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


def _run_profile(args):
    from .bench_profile import run_profile

    return run_profile(args)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_argument_group("what to run (default: the sweep)")
    what.add_argument("--memory", action="store_true", help="the memory sweep instead")
    what.add_argument("--experiments", action="store_true", help="the two experiments instead")
    what.add_argument("--all", action="store_true", help="sweep, memory sweep and experiments")
    what.add_argument("--decode", action="store_true", help="the decoding benchmark (KV cache) instead")
    what.add_argument("--extended", action="store_true",
                      help="issue 14's extended sweep (head dims, GQA, prefill Nq != Nk, small batches) instead")
    what.add_argument("--onepass", action="store_true",
                      help="the backward's dQ two ways (two passes against the one-pass atomic backward) instead")
    what.add_argument("--masks", action="store_true",
                      help="the training-masks benchmark (issue 13: varlen, sliding window, softcap, key padding) "
                           "against FlexAttention and SDPA with an explicit mask instead")
    what.add_argument("--cp", action="store_true",
                      help="the context-parallel benchmark (issue 11: fa_lib ring/Ulysses against torch's "
                           "context_parallel, one process per GPU; benchmarks.bench_cp) instead; --cp --smoke: on CPU")
    what.add_argument("--profile", action="store_true",
                      help="Nsight Compute (ncu) over fa_lib, FA2 and cuDNN at the points where fa_lib misses "
                           "a target of issue 14: occupancy, registers, spills, throughput per kernel "
                           "(benchmarks.bench_profile) instead")
    what.add_argument("--configs", action="store_true",
                      help="time one kernel's block configurations (default table vs --cfg-candidates) at "
                           "--cfg-shapes instead -> configs-<tag>-<device>.json")
    sweep = parser.add_argument_group("the sweep")
    sweep.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    sweep.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=list(DTYPES))
    sweep.add_argument("--d", nargs="+", type=int, default=[64, 128])
    sweep.add_argument("--n", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    sweep.add_argument("--causal", nargs="+", default=["false", "true"], choices=["false", "true"])
    sweep.add_argument("--max-n-quadratic", type=int, default=16384,
                       help="skip sdpa_math and naive above this N (they store the N x N matrix)")
    sweep.add_argument("--no-check", action="store_true", help="skip the correctness check of fa_lib")
    dec = parser.add_argument_group("the decoding benchmark (--decode); a subset to measure some points")
    dec.add_argument("--dec-batches", nargs="+", type=int, help="batch sizes (default: 1 8 64)")
    dec.add_argument("--dec-hkv", nargs="+", type=int, help="KV heads, with 32 query heads (default: 32 8)")
    dec.add_argument("--dec-nk", nargs="+", type=int, help="cached keys (default: 1k 4k 16k 64k 128k)")
    dec.add_argument("--dec-no-ragged", action="store_true", help="skip the three ragged batches")
    dec.add_argument("--dec-workspace", action="store_true",
                     help="fa_lib's calls pass a workspace (fa_lib.decode.workspace(q)), as a decoding loop would")
    dec.add_argument("--dec-providers", nargs="+", choices=DECODE_PROVIDERS,
                     help="time only these of fa_lib and the SDPA backends (default: all three)")
    dec.add_argument("--dec-page-sizes", nargs="+", type=int,
                     help="also time fa_lib over a paged copy of each cache (block_table), pages of these sizes")
    ext = parser.add_argument_group("the extended sweep (--extended)")
    ext.add_argument("--ext-d", nargs="+", type=int, default=[64, 96, 128, 256])
    ext.add_argument("--ext-n", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384, 32768])
    ext.add_argument("--ext-dtypes", nargs="+", default=["bf16", "fp16"], choices=list(DTYPES))
    ext.add_argument("--ext-kinds", nargs="+", default=list(EXT_KINDS), choices=EXT_KINDS)
    ext.add_argument("--ext-providers", nargs="+", default=list(EXT_PROVIDERS), choices=EXT_PROVIDERS)
    ext.add_argument("--ext-resume", action="store_true",
                     help="keep the points already in the output JSON and measure only the missing ones")
    ext.add_argument("--ext-precompile", type=int, default=0,
                     help="compile fa_lib's kernels for the missing points in this many processes at once first")
    ext.add_argument("--ext-compile-only", action="store_true", help=argparse.SUPPRESS)
    ext.add_argument("--ext-join", nargs="+", metavar="FILE",
                     help="join the JSON files of consecutive --extended calls (one commit, one device) into "
                          "extended-<device>.json in --out-dir, and exit (no GPU needed)")
    ext.add_argument("--ext-warmup-ms", type=float, default=25.0, help="do_bench warm-up per timing (ms)")
    ext.add_argument("--ext-rep-ms", type=float, default=100.0, help="do_bench repetition time per timing (ms)")
    ext.add_argument("--profile-points", nargs="+", default=None,
                     help="with --profile: the names of the points to profile (default: all)")
    cfgs = parser.add_argument_group("block configurations (--configs)")
    cfgs.add_argument("--cfg-kernel", default="dkdv", choices=["fwd", "dkdv", "dq"])
    cfgs.add_argument("--cfg-shapes", nargs="+", default=["4,8,8,4096,4096,256,1", "1,8,8,16384,16384,256,1"],
                      help="B,Hq,Hkv,Nq,Nk,D,causal (causal 0 or 1)")
    cfgs.add_argument("--cfg-candidates", nargs="+", default=["32,32,8,2", "64,32,8,2", "32,32,8,1", "16,32,4,2"],
                      help="BLOCK_M,BLOCK_N,warps,stages")
    cfgs.add_argument("--cfg-dtype", default="bf16", choices=list(DTYPES))
    cfgs.add_argument("--cfg-tag", default="probe", help="names the output file configs-<tag>-<device>.json")
    masks = parser.add_argument_group("the masks benchmark (--masks)")
    masks.add_argument("--masks-n", nargs="+", type=int, default=None,
                       help="N: tokens per sequence (per pack for varlen), B*N = 16k (default 4096 8192 16384; "
                            "32 with --smoke)")
    masks.add_argument("--masks-kinds", nargs="+", default=list(MASK_KINDS), choices=MASK_KINDS)
    masks.add_argument("--masks-windows", nargs="+", type=int, default=None,
                       help="sliding-window sizes, keys to the left (default 1024 4096; 4 12 with --smoke)")
    masks.add_argument("--masks-providers", nargs="+", default=list(MASK_PROVIDERS), choices=MASK_PROVIDERS)
    masks.add_argument("--masks-dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    masks.add_argument("--masks-sdpa-max-bytes", type=int, default=4 << 30,
                       help="skip SDPA (reason recorded) where its boolean mask would take more bytes")
    masks.add_argument("--smoke", action="store_true",
                       help="with --masks: tiny shapes, no torch.compile, one timing call; runs on CPU (fa_lib "
                            "under the Triton interpreter, FlexAttention eager and forward only). A test of the "
                            "pipeline, not a measurement")
    parser.add_argument("--memory-n", nargs="+", type=int, default=[1024 << i for i in range(7)],
                        help="sequence lengths of the memory sweep (default 1k..64k)")
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "data"),
                        help="where the JSON files go (default: benchmarks/data, the committed measurements, "
                             "when run from the repository root)")
    from . import bench_cp

    bench_cp.add_arguments(parser)
    args = parser.parse_args(argv)
    dec_flags = [f"--{name.replace('_', '-')}" for name in ("dec_batches", "dec_hkv", "dec_nk", "dec_no_ragged",
                                                            "dec_workspace", "dec_page_sizes", "dec_providers")
                 if getattr(args, name)]
    if dec_flags and not args.decode:
        parser.error(f"{', '.join(dec_flags)} set the decoding benchmark's points and calls: add --decode")
    if args.cp:
        return bench_cp.run(args)
    if args.ext_join:
        pieces = []
        for name in args.ext_join:
            with open(name) as f:
                pieces.append(json.load(f))
        print(f"wrote {_write(join_sweeps(pieces), args, 'extended')}")
        return None

    import torch

    if not torch.cuda.is_available() and not (args.masks and args.smoke):
        raise SystemExit("python -m benchmarks.bench needs a CUDA GPU; the book's performance chapter reads the "
                         "committed JSON in benchmarks/data/ (benchmarks.data) instead.")
    parts = ["sweep", "memory", "experiments"] if args.all else \
        [p for p, on in (("memory", args.memory), ("experiments", args.experiments), ("decode", args.decode),
                         ("masks", args.masks), ("onepass", args.onepass), ("extended", args.extended),
                         ("profile", args.profile), ("configs", args.configs))
         if on] or ["sweep"]
    run = {"sweep": run_sweep, "memory": run_memory, "experiments": run_experiments, "decode": run_decode,
           "masks": run_masks, "onepass": run_onepass, "extended": run_extended,
           "profile": _run_profile, "configs": run_configs}
    for part in parts:
        results = run[part](args)
        if results is None:  # a worker process (--ext-compile-only)
            continue
        print(f"wrote {_write(results, args, results.get('part', part))}", flush=True)


if __name__ == "__main__":
    main()
