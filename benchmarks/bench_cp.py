"""Context-parallel benchmark (issue 11): ``python -m benchmarks.bench --cp``.

One process per GPU, started here (``torch.multiprocessing``, NCCL, rendezvous on a free localhost
port), so one command runs the whole thing. bf16, B = 1, D = 128, H = 16 and GQA 32/8, total N in
{32k, 64k, 128k, 256k}, causal and not, forward and forward+backward, side by side:

* ``fa_lib_1gpu``       ``fa_lib.flash_attention`` on the whole sequence on one GPU (every rank runs
                        it at once on its own GPU, so the ranks stay in step; the slowest is reported)
* ``ring_zigzag``       ``fa_lib.context_parallel.ring_attention``, zigzag (head-tail) shards
* ``ring_contiguous``   the same with contiguous shards (the causal imbalance left in)
* ``ulysses``           ``fa_lib.context_parallel.ulysses_attention`` (all-to-all over heads)
* ``torch_cp``          PyTorch's ``torch.distributed.tensor.experimental.context_parallel``: SDPA
                        inside the context manager, its default rotate method ("allgather") and the
                        SDPA backend PyTorch picks (recorded); head-tail shards when causal (its
                        load balancer), contiguous otherwise
* ``torch_cp_alltoall`` the same with ``set_rotate_method("alltoall")``
* ``torch_cp_cudnn``    the same ("allgather") with SDPA restricted to the cuDNN backend

Per point and provider: time (CUDA events; each iteration starts after a barrier; an iteration's time
is the slowest rank's; the median over the iterations after warmup), TFLOP/s per GPU (forward
4·B·H·N²·D, halved when causal; forward+backward 3.5x that; divided by the GPUs used), scaling
efficiency (1-GPU time / (W x W-GPU time)) and the peak memory per GPU
(``torch.cuda.max_memory_allocated`` after a reset; inputs included). One correctness check per
configuration (causal x heads x provider) at the smallest N (at most ``--cp-check-n``): every rank's
output and gradient shards gathered, judged on rank 0 by the flash-attn 2x rule (``fa_lib.testing``) on
the heads that share key/value head 0, and compared with ``fa_lib.flash_attention`` on the whole sequence.

The longest sequence that fits: forward+backward, causal, H = 16, N doubled until out of memory, then
bisected, every rank agreeing on "it fitted" through an all-reduce of a flag (over a gloo group, so that
the agreement itself cannot hang). To keep the run short the search runs under a per-process memory cap
(``--cp-cap-gib``, ``torch.cuda.set_per_process_memory_fraction``): the lengths found are those that
fit in that many GiB per GPU, and the ratio to one GPU is what the issue's target judges. The ring runs
with ``head_chunks`` (``--cp-search-head-chunks``, default: one group per key/value head), one group of
heads after another, so that its K/V transfers, float32 dK/dV accumulators and dQ take 1/head_chunks of
their memory (chapter 14 counts what stays). The longest
sequence on the whole card is also estimated by a straight-line fit of the measured peak memory against N.

The points run in order of importance (causal H = 16 at every N first, then the others cheapest first)
under a time budget (``--cp-budget-s``): a point predicted to overrun it is skipped with the reason
recorded (on 2 H200s the default budget leaves out the costliest non-causal and GQA points at 256k). The JSON
(``<out-dir>/cp-<device>-x<W>.json``) is rewritten after every point, so a run cut short keeps its data.

``--smoke`` runs the same pipeline on CPU with gloo, 2 processes and tiny shapes (fa_lib under the
Triton interpreter; ``torch_cp`` skipped with its reason; the memory search with a simulated out of
memory): a test of the pipeline (``tests/benchmarks/test_bench_cp.py``), not a measurement; it writes
``cp-smoke-cpu-x2.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import time

PROVIDERS = ("fa_lib_1gpu", "ring_zigzag", "ring_contiguous", "ulysses", "torch_cp", "torch_cp_alltoall",
             "torch_cp_cudnn")
TORCH_CP = ("torch_cp", "torch_cp_alltoall", "torch_cp_cudnn")
SEARCH_PROVIDERS = ("fa_lib_1gpu", "ring_zigzag", "ulysses", "torch_cp")
# --smoke keeps CI short: every kernel launch costs about 0.3 s under the Triton interpreter, and the ring's
# zigzag layout launches three times as many as the contiguous one (same code path here; the ring itself is
# tested by tests/library/test_context_parallel.py).
SMOKE_PROVIDERS = ("fa_lib_1gpu", "ring_contiguous", "ulysses", "torch_cp")
SMOKE_SEARCH = ("fa_lib_1gpu", "ulysses")
MODES = ("fwd", "fwd_bwd")
TARGETS = {
    "scaling": "scaling efficiency >= 0.9 for ring_zigzag, causal, N >= 128k (forward+backward and forward)",
    "vs_torch": "ring_zigzag faster than the fastest torch context_parallel variant at every point, forward and "
                "forward+backward (the speedups of ring_contiguous and ulysses are recorded beside it)",
    "longest": "ring_zigzag fits at least twice the longest sequence of one GPU (forward+backward, causal)",
}
CONVENTION = ("time: median over iterations of the slowest rank's CUDA-event time, each iteration after a barrier; "
              "TFLOP/s per GPU: forward 4*B*Hq*N^2*D (halved when causal), forward+backward 3.5x that, divided by "
              "the number of GPUs the provider uses; scaling efficiency: fa_lib_1gpu time / (W x provider time); "
              "peak: torch.cuda.max_memory_allocated per GPU after a reset, inputs included, largest over ranks")


def add_arguments(parser):
    """The ``--cp-*`` options (``python -m benchmarks.bench --cp ...``)."""
    g = parser.add_argument_group("the context-parallel benchmark (--cp, issue 11)")
    g.add_argument("--cp-world", type=int, default=None,
                   help="processes (one GPU each; default: every visible GPU; 2 with --smoke)")
    g.add_argument("--cp-n", nargs="+", type=int, default=None,
                   help="total sequence lengths (default 32768 65536 131072 262144; 16 with --smoke)")
    g.add_argument("--cp-heads", nargs="+", default=None,
                   help="head configurations Hq/Hkv (default 16/16 32/8; 4/2 with --smoke)")
    g.add_argument("--cp-causal", nargs="+", default=None, choices=["true", "false"],
                   help="default: true false (true with --smoke)")
    g.add_argument("--cp-providers", nargs="+", default=None, choices=PROVIDERS,
                   help=f"default: all of {', '.join(PROVIDERS)} (with --smoke: {', '.join(SMOKE_PROVIDERS)})")
    g.add_argument("--cp-dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    g.add_argument("--cp-warmup", type=int, default=1, help="warmup iterations per point and mode (default 1)")
    g.add_argument("--cp-iters", type=int, default=3, help="timed iterations per point and mode (default 3)")
    g.add_argument("--cp-budget-s", type=float, default=330.0,
                   help="seconds for the timed points (default 330); a point predicted to overrun is skipped")
    g.add_argument("--cp-check-n", type=int, default=16384,
                   help="the correctness check runs at min(smallest N, this) (default 16384)")
    g.add_argument("--cp-cap-gib", type=float, default=8.0,
                   help="memory cap per GPU for the longest-sequence search (default 8 GiB; 0: the whole card, "
                        "which takes far longer)")
    g.add_argument("--cp-search-providers", nargs="+", default=None, choices=PROVIDERS,
                   help=f"default: {', '.join(SEARCH_PROVIDERS)} (with --smoke: {', '.join(SMOKE_SEARCH)})")
    g.add_argument("--cp-search-budget-s", type=float, default=90.0,
                   help="seconds for the longest-sequence search (default 90)")
    g.add_argument("--cp-no-search", action="store_true", help="skip the longest-sequence search")
    g.add_argument("--cp-search-head-chunks", type=int, default=None,
                   help="ring_attention's head_chunks in the longest-sequence search (default: one group per "
                        "key/value head, the least memory; chapter 14's ledger; the timed points use 1)")
    g.add_argument("--cp-timeout-s", type=float, default=300.0,
                   help="timeout of every collective (process groups), seconds (default 300)")
    g.add_argument("--cp-total-timeout-s", type=float, default=570.0,
                   help="the processes are killed after this many seconds (default 570: inside the lent machines' "
                        "10-minute command limit; the JSON written after each point stays)")
    return g


# ---------------------------------------------------------------------------------------------------
# Pure helpers (tested on CPU without processes).
# ---------------------------------------------------------------------------------------------------
def flops(b, hq, n, d, causal, mode):
    """Attention FLOPs over the whole sequence: forward 4·B·Hq·N²·D (halved when causal); forward+backward
    3.5x the forward (the backward is 2.5x)."""
    f = 4 * b * hq * n * n * d
    if causal:
        f //= 2
    return f if mode == "fwd" else int(3.5 * f)


def gpus_used(provider, world):
    return 1 if provider == "fa_lib_1gpu" else world


def layout_of(provider, causal):
    """The shard layout each provider is fed: head-tail (zigzag) when causal, except ring_contiguous;
    contiguous when not causal (torch's load balancer refuses non-causal; it would only cost a copy)."""
    if provider == "ring_zigzag":
        return "zigzag"
    if provider == "ring_contiguous":
        return "contiguous"
    return "zigzag" if causal else "contiguous"


def parse_heads(items):
    out = []
    for s in items:
        a, _, b = str(s).partition("/")
        hq, hkv = int(a), int(b or a)
        if hq <= 0 or hkv <= 0 or hq % hkv:
            raise ValueError(f"--cp-heads: {s!r} is not Hq/Hkv with Hq a positive multiple of Hkv")
        out.append((hq, hkv))
    return out


def points(ns, heads, causals, b=1, d=128, dtype="bf16"):
    """The points in order of importance, so that a time budget cuts the least useful: first the issue's
    targets (causal when measured, the first head configuration, N ascending), then every other point
    by its cost (FLOPs), cheapest first."""
    causal0 = True if True in causals else causals[0]
    pts = [dict(b=b, hq=hq, hkv=hkv, n=n, d=d, causal=c, dtype=dtype)
           for hq, hkv in heads for c in causals for n in ns]
    first = [p for p in pts if p["causal"] == causal0 and (p["hq"], p["hkv"]) == heads[0]]
    rest = [p for p in pts if p not in first]
    return (sorted(first, key=lambda p: p["n"]) +
            sorted(rest, key=lambda p: (flops(b, p["hq"], p["n"], d, p["causal"], "fwd"), not p["causal"],
                                        heads.index((p["hq"], p["hkv"])))))


def label(p):
    return f"N={p['n']} H={p['hq']}/{p['hkv']} {'causal' if p['causal'] else 'full'}"


def median_of_slowest(times_by_rank):
    """times_by_rank: [rank][iteration] ms -> the median over iterations of the slowest rank."""
    per_iter = [max(col) for col in zip(*times_by_rank)]
    return statistics.median(per_iter) if per_iter else None


def search_lengths(fits, start, quantum, refine, limit=None):
    """The longest N (a multiple of ``quantum``) with ``fits(N)`` true: doubling from ``start`` until a
    failure, then ``refine`` bisection steps between the last success and the first failure. Returns
    (longest that fitted or None, first that failed or None, [(N, fitted), ...] in order tried)."""
    tried, ok, bad = [], None, None
    n = start
    while True:
        if limit is not None and n > limit:
            break
        f = fits(n)
        tried.append((n, f))
        if f is None:  # stopped (budget): no verdict
            return ok, bad, tried
        if f:
            ok = n
            n *= 2
        else:
            bad = n
            break
    if ok is None or bad is None:
        return ok, bad, tried
    for _ in range(refine):
        mid = (ok + bad) // 2 // quantum * quantum
        if mid <= ok or mid >= bad:
            break
        f = fits(mid)
        tried.append((mid, f))
        if f is None:
            break
        if f:
            ok = mid
        else:
            bad = mid
    return ok, bad, tried


def linear_fit_max_n(ns, peaks, capacity):
    """Fit peak = a + b·N by least squares; the N at which the peak reaches ``capacity`` (None without two
    distinct points or a positive slope)."""
    pairs = [(n, p) for n, p in zip(ns, peaks) if p is not None]
    if len({n for n, _ in pairs}) < 2:
        return None
    mn = sum(n for n, _ in pairs) / len(pairs)
    mp = sum(p for _, p in pairs) / len(pairs)
    var = sum((n - mn) ** 2 for n, _ in pairs)
    slope = sum((n - mn) * (p - mp) for n, p in pairs) / var
    if slope <= 0:
        return None
    a = mp - slope * mn
    return dict(intercept_bytes=a, bytes_per_token=slope, max_n=int((capacity - a) / slope))


def evaluate_targets(results):
    """The issue's targets, per point and overall, from results['points'] and results['search']."""
    w = results["environment"].get("world_size")
    scaling, vs_torch = [], []
    for pt in results["points"]:
        rows = {r["provider"]: r for r in pt.get("rows", [])}
        zz = rows.get("ring_zigzag", {})
        for mode in MODES:
            eff = zz.get(f"{mode}_efficiency")
            if pt["causal"] and pt["n"] >= 131072 and eff is not None:
                scaling.append(dict(point=pt["label"], mode=mode, efficiency=eff, met=eff >= 0.9))
            torch_ms = [rows[p][f"{mode}_ms"] for p in TORCH_CP if p in rows and rows[p].get(f"{mode}_ms")]
            if zz.get(f"{mode}_ms") and torch_ms:
                best = min(torch_ms)
                entry = dict(point=pt["label"], mode=mode, ring_zigzag_ms=zz[f"{mode}_ms"], torch_cp_best_ms=best,
                             speedup=best / zz[f"{mode}_ms"], met=zz[f"{mode}_ms"] < best)
                for p in ("ring_contiguous", "ulysses"):
                    if rows.get(p, {}).get(f"{mode}_ms"):
                        entry[f"{p}_speedup"] = best / rows[p][f"{mode}_ms"]
                vs_torch.append(entry)
            pt.setdefault("targets", {})[mode] = dict(
                scaling=(None if not (pt["causal"] and pt["n"] >= 131072) or eff is None else eff >= 0.9),
                vs_torch=(None if not (zz.get(f"{mode}_ms") and torch_ms) else zz[f"{mode}_ms"] < min(torch_ms)))
    out = {"world_size": w, "scaling": scaling, "vs_torch": vs_torch}
    out["scaling_met"] = all(s["met"] for s in scaling) if scaling else None
    out["vs_torch_met"] = all(s["met"] for s in vs_torch) if vs_torch else None
    longest = None
    search = results.get("search") or {}
    one, zz = search.get("fa_lib_1gpu", {}).get("longest"), search.get("ring_zigzag", {}).get("longest")
    if one and zz:
        longest = dict(one_gpu=one, ring_zigzag=zz, ratio=zz / one, met=zz >= 2 * one,
                       cap_gib=search.get("cap_gib"))
    est = search.get("estimate_full_card") or {}
    if est.get("fa_lib_1gpu") and est.get("ring_zigzag"):
        e1, ez = est["fa_lib_1gpu"]["max_n"], est["ring_zigzag"]["max_n"]
        out["longest_estimate_full_card"] = dict(one_gpu=e1, ring_zigzag=ez, ratio=ez / e1 if e1 else None,
                                                 met=ez >= 2 * e1)
    out["longest"] = longest
    out["longest_met"] = None if longest is None else longest["met"]
    return out


def _f(x, spec):
    return "-" if x is None else format(x, spec)


def table_lines(results):
    lines = [f"{'point':<28} {'provider':<18} {'fwd ms':>9} {'TF/s/GPU':>8} {'eff':>5} {'f+b ms':>9} "
             f"{'TF/s/GPU':>8} {'eff':>5} {'peak GiB':>8}  note"]
    lines.append("-" * len(lines[0]))
    for pt in results["points"]:
        if pt.get("skipped"):
            lines.append(f"{pt['label']:<28} skipped: {pt['skipped']}")
            continue
        for r in pt["rows"]:
            peak = r.get("peak_bytes")
            lines.append(f"{pt['label']:<28} {r['provider']:<18} {_f(r.get('fwd_ms'), '9.2f')} "
                         f"{_f(r.get('fwd_tflops_per_gpu'), '8.1f')} {_f(r.get('fwd_efficiency'), '5.2f')} "
                         f"{_f(r.get('fwd_bwd_ms'), '9.2f')} {_f(r.get('fwd_bwd_tflops_per_gpu'), '8.1f')} "
                         f"{_f(r.get('fwd_bwd_efficiency'), '5.2f')} "
                         f"{_f(None if peak is None else peak / 2**30, '8.2f')}  "
                         f"{r.get('error') or r.get('skipped') or r.get('sdpa_backend') or ''}")
    return lines


# ---------------------------------------------------------------------------------------------------
# The worker (one per rank).
# ---------------------------------------------------------------------------------------------------
class _Ctx:
    """What one rank knows: rank, world, device, the process groups, the timer."""

    def __init__(self, rank, world, device, cpu_group, smoke):
        self.rank, self.world, self.device, self.cpu_group, self.smoke = rank, world, device, cpu_group, smoke
        self.cuda = device.startswith("cuda")

    def sync(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def barrier(self):
        import torch.distributed as dist

        if self.cuda:
            dist.barrier(device_ids=[self.rank])
            self.sync()
        else:
            dist.barrier()

    def gather_obj(self, obj):
        """Every rank's small Python object (over the gloo group: never the NCCL one)."""
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def any_(self, flag):
        return any(self.gather_obj(bool(flag)))


def _rand(shape, dtype, device, seed):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, device=device, dtype=dtype, generator=gen)


class _TorchCP:
    """PyTorch's context_parallel around SDPA, entered once per (point, provider)."""

    def __init__(self, provider, causal, n, ctx, group=None):
        import torch
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.tensor.experimental import _attention as tattn

        self.tattn, self.provider, self.causal = tattn, provider, causal
        if group is not None:
            self.mesh = DeviceMesh.from_group(group, "cuda")
        else:
            if getattr(ctx, "mesh", None) is None:
                ctx.mesh = init_device_mesh("cuda", (ctx.world,))
            self.mesh = ctx.mesh
        self.pos = torch.arange(n, device=ctx.device)[None]  # a buffer for the load balancer to size itself by
        self.method = "alltoall" if provider == "torch_cp_alltoall" else "allgather"
        self.backend = "CUDNN_ATTENTION" if provider == "torch_cp_cudnn" else None

    def __enter__(self):
        from torch.distributed.tensor.experimental import context_parallel

        opts = self.tattn._cp_options
        self._saved = (opts.enable_load_balance, opts.rotate_method)
        opts.enable_load_balance = bool(self.causal)  # head-tail shards when causal; it refuses them otherwise
        self.tattn.set_rotate_method(self.method)
        self._cm = context_parallel(self.mesh, buffers=[self.pos], buffer_seq_dims=[1],
                                    no_restore_buffers={self.pos})
        self._cm.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            return self._cm.__exit__(*exc)
        finally:
            opts = self.tattn._cp_options
            opts.enable_load_balance, opts.rotate_method = self._saved

    def fn(self, gqa):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        causal, backend = self.causal, self.backend

        def run(q, k, v):
            if backend is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        return run


def _sdpa_choice(q, k, v, causal, gqa, backend):
    import torch
    from torch.nn.attention import SDPBackend

    if backend is not None:
        return backend + " (forced)"
    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=causal, enable_gqa=gqa)).name
    except Exception as e:  # private API; only a label
        return f"unknown ({type(e).__name__})"


def _attn_fn(provider, causal, group=None, head_chunks=1):
    """(q, k, v) -> o on this rank's tensors, for the fa_lib providers (`head_chunks`: the ring's)."""
    from fa_lib import context_parallel as cp
    from fa_lib.ops import flash_attention

    if provider == "fa_lib_1gpu":
        return lambda q, k, v: flash_attention(q, k, v, causal=causal)
    if provider in ("ring_zigzag", "ring_contiguous"):
        lay = layout_of(provider, causal)
        return lambda q, k, v: cp.ring_attention(q, k, v, causal=causal, layout=lay, group=group,
                                                 head_chunks=head_chunks)
    if provider == "ulysses":
        lay = layout_of(provider, causal)
        return lambda q, k, v: cp.ulysses_attention(q, k, v, causal=causal, layout=lay, group=group)
    raise ValueError(provider)


def _timed(ctx, fn, before, warmup, iters):
    """Run fn warmup + iters times, each after `before()` and a barrier; returns this rank's ms per timed
    iteration."""
    import torch

    times = []
    for i in range(warmup + iters):
        before()
        ctx.barrier()
        if ctx.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t) * 1e3
        if i >= warmup:
            times.append(ms)
    return times


def _oom_types():
    import torch

    return (torch.cuda.OutOfMemoryError,)


def _measure(ctx, provider, pt, args, simulate_oom=None, expand_kv=False):
    """One provider at one point, forward then forward+backward. Returns the row (rank 0's view of every
    rank's numbers) — every rank returns the same row. ``expand_kv``: torch_cp with GQA where SDPA's
    ``enable_gqa`` is refused under context_parallel: K/V heads repeated to Hq once, outside the timing."""
    import torch

    b, hq, hkv, n, d, causal = pt["b"], pt["hq"], pt["hkv"], pt["n"], pt["d"], pt["causal"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[pt["dtype"]]
    w = gpus_used(provider, ctx.world)
    row = {"provider": provider, "gpus": w, "layout": None if provider == "fa_lib_1gpu" else layout_of(provider, causal)}
    if provider in TORCH_CP and not ctx.cuda:
        row["skipped"] = "torch context_parallel needs CUDA (DeviceMesh over NCCL, SDPA's fused backends)"
        return row
    n_loc = n if provider == "fa_lib_1gpu" else n // ctx.world
    err, times, peak = None, {}, None
    q = k = v = do = tensors = None
    try:
        if simulate_oom is not None and n > simulate_oom:
            raise torch.cuda.OutOfMemoryError(f"simulated: N = {n} > {simulate_oom} (smoke)")
        seed = 17 * ctx.rank + n
        q = _rand((b, hq, n_loc, d), dtype, ctx.device, seed).requires_grad_()
        k = _rand((b, hkv, n_loc, d), dtype, ctx.device, seed + 1).requires_grad_()
        v = _rand((b, hkv, n_loc, d), dtype, ctx.device, seed + 2).requires_grad_()
        do = _rand((b, hq, n_loc, d), dtype, ctx.device, seed + 3)
        tensors = (q, k, v, do)

        def zero():
            for t in (q, k, v):
                t.grad = None

        def timings(attn):
            def fwd():
                with torch.no_grad():
                    attn(q, k, v)

            def fwd_bwd():
                attn(q, k, v).backward(do)

            out = {}
            out["fwd"] = _timed(ctx, fwd, zero, args.cp_warmup, args.cp_iters)
            if ctx.cuda:
                torch.cuda.reset_peak_memory_stats()
            out["fwd_bwd"] = _timed(ctx, fwd_bwd, zero, args.cp_warmup, args.cp_iters)
            return out

        if provider in TORCH_CP:
            tcp = _TorchCP(provider, causal, n, ctx)
            gqa = hq != hkv
            if gqa and expand_kv:
                k, v = (t.detach().repeat_interleave(hq // hkv, dim=1).requires_grad_() for t in (k, v))
                tensors, gqa = (q, k, v, do), False
                row["gqa"] = "K/V heads repeated to Hq before the call (outside the timing): enable_gqa refused"
            row["rotate_method"] = tcp.method
            row["sdpa_backend"] = _sdpa_choice(q, k, v, causal, gqa, tcp.backend)
            with tcp:
                times = timings(tcp.fn(gqa))
        else:
            times = timings(_attn_fn(provider, causal))
        if ctx.cuda:
            ctx.sync()
            peak = torch.cuda.max_memory_allocated()
    except _oom_types() as e:
        err = f"OutOfMemoryError: {str(e).splitlines()[0][:160]}"
    except Exception as e:  # a provider that refuses the shape: recorded, the run goes on
        err = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    q = k = v = do = tensors = None  # freed before the next provider (or the retry) allocates
    _free(ctx)
    every = ctx.gather_obj(dict(err=err, times=times, peak=peak))
    errs = [f"rank {r}: {e['err']}" for r, e in enumerate(every) if e["err"]]
    if (errs and provider in TORCH_CP and hq != hkv and not expand_kv and len(errs) == ctx.world
            and not any("OutOfMemoryError" in e for e in errs)):
        retry = _measure(ctx, provider, pt, args, simulate_oom, expand_kv=True)
        retry["enable_gqa_error"] = errs[0][:300]
        return retry
    if errs:
        row["error"] = "; ".join(errs)[:400]
        return row
    for mode in MODES:
        ms = median_of_slowest([e["times"][mode] for e in every])
        row[f"{mode}_ms"] = ms
        row[f"{mode}_ms_by_rank"] = [statistics.median(e["times"][mode]) for e in every]
        row[f"{mode}_tflops_per_gpu"] = flops(b, hq, n, d, causal, mode) / (ms * 1e-3) / 1e12 / w if ms else None
    row["iters"] = args.cp_iters
    row["peak_bytes_by_rank"] = [e["peak"] for e in every]
    row["peak_bytes"] = max(e["peak"] for e in every) if ctx.cuda else None
    return row


def _free(ctx):
    import gc

    import torch

    gc.collect()
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _check(ctx, pt, providers, check_n):
    """Correctness per provider at a small N: every rank's output and gradient shards gathered, judged on
    rank 0 by the flash-attn rule on the query heads of key/value head 0; plus the largest difference to
    fa_lib.flash_attention on the whole sequence. Every rank returns the same dict."""
    import torch

    from fa_lib import context_parallel as cp, testing
    from fa_lib.ops import flash_attention

    b, hq, hkv, d, causal = pt["b"], pt["hq"], pt["hkv"], pt["d"], pt["causal"]
    n = check_n
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[pt["dtype"]]
    full = [_rand((b, h, n, d), dtype, ctx.device, 4242 + i) for i, h in enumerate((hq, hkv, hkv, hq))]
    g = hq // hkv
    gold = base = None
    # fa_lib on the whole sequence: every rank runs it (they are idle otherwise; under the interpreter this
    # is also where each process pays its first-call cost), rank 0 judges it.
    with testing.poisoned_outputs():
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in full[:3])
        o1 = flash_attention(qq, kk, vv, causal=causal)
        o1.backward(full[3])
        single = dict(o=o1.detach(), dq=qq.grad, dk=kk.grad, dv=vv.grad)
        del qq, kk, vv, o1
    if ctx.rank == 0:
        heads = [t[:, :g] if t.shape[1] == hq else t[:, :1] for t in full]
        gold = testing.reference_forward_backward(*heads, causal=causal, upcast=True)
        base = testing.reference_forward_backward(*heads, causal=causal, upcast=False)
        gold.pop("lse"), base.pop("lse")
    out = {"n": n}
    for prov in providers:
        if prov == "fa_lib_1gpu":  # the run above, on rank 0
            res, err = None, None
            if ctx.rank == 0:
                try:
                    sl = {name: (t[:, :g] if name in ("o", "dq") else t[:, :1]) for name, t in single.items()}
                    report = testing.assert_flash_rule(sl, gold, base, names=("o", "dq", "dk", "dv"))
                    res = {"ok": True, "ratio": {k_: round(r[2], 3) for k_, r in report.items()}}
                except AssertionError as e:
                    res = {"ok": False, "error": str(e)[:400]}
            out[prov] = ctx.gather_obj(res)[0]
            continue
        if prov in TORCH_CP and not ctx.cuda:
            out[prov] = {"ok": None, "skipped": "needs CUDA"}
            continue
        for expand in (False, True):
            res, err = None, None
            try:
                lay = layout_of(prov, causal)
                loc = [cp.shard(t, layout=lay) for t in full]
                q, k, v = (t.requires_grad_() for t in loc[:3])
                with testing.poisoned_outputs():
                    if prov in TORCH_CP:
                        tcp = _TorchCP(prov, causal, n, ctx)
                        attn = tcp.fn(hq != hkv and not expand)
                        if expand:  # K/V heads repeated inside the graph: the gradients sum back to K/V
                            attn = (lambda f: lambda q_, k_, v_: f(q_, k_.repeat_interleave(g, dim=1),
                                                                    v_.repeat_interleave(g, dim=1)))(attn)
                        with tcp:
                            o = attn(q, k, v)
                            o.backward(loc[3])
                    else:
                        o = _attn_fn(prov, causal)(q, k, v)
                        o.backward(loc[3])
                got = dict(o=o.detach(), dq=q.grad, dk=k.grad, dv=v.grad)
                got = {name: cp.unshard(t.contiguous(), layout=lay) for name, t in got.items()}
                if ctx.rank == 0:
                    sl = {name: (t[:, :g] if name in ("o", "dq") else t[:, :1]) for name, t in got.items()}
                    report = testing.assert_flash_rule(sl, gold, base, names=("o", "dq", "dk", "dv"))
                    res = {"ok": True, "ratio": {k_: round(r[2], 3) for k_, r in report.items()},
                           "max_diff_vs_fa_lib_1gpu": {name: float((got[name].float() - single[name].float())
                                                                   .abs().max()) for name in got}}
                    if expand:
                        res["gqa"] = "K/V heads repeated to Hq (enable_gqa refused)"
            except AssertionError as e:
                err = str(e)[:400]
            except Exception as e:
                err = f"{type(e).__name__}: {str(e)[:300]}"
            every = ctx.gather_obj(err)
            errs = [f"rank {r}: {e}" for r, e in enumerate(every) if e]
            res = ctx.gather_obj(res)[0]
            out[prov] = {"ok": False, "error": "; ".join(errs)[:500]} if errs else res
            _free(ctx)
            if not (errs and prov in TORCH_CP and hq != hkv and not expand and len(errs) == ctx.world):
                break
    del full, gold, base, single
    _free(ctx)
    return out


def _fits(ctx, provider, n, pt, args, group, simulate_oom):
    """One forward+backward at N; True if it ran on every rank, False if any rank ran out of memory."""
    import torch

    b, hq, hkv, d = pt["b"], pt["hq"], pt["hkv"], pt["d"]
    dtype = torch.bfloat16 if pt["dtype"] == "bf16" else getattr(torch, {"fp16": "float16"}.get(pt["dtype"], "float32"))
    n_loc = n if provider == "fa_lib_1gpu" else n // ctx.world
    err, oom, peak = None, False, None
    _free(ctx)
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    def attempt():  # its tensors die with its frame, also when it raises
        if simulate_oom is not None and n > simulate_oom:
            raise torch.cuda.OutOfMemoryError(f"simulated: N = {n} > {simulate_oom} (smoke)")
        q = _rand((b, hq, n_loc, d), dtype, ctx.device, n).requires_grad_()
        k = _rand((b, hkv, n_loc, d), dtype, ctx.device, n + 1).requires_grad_()
        v = _rand((b, hkv, n_loc, d), dtype, ctx.device, n + 2).requires_grad_()
        do = _rand((b, hq, n_loc, d), dtype, ctx.device, n + 3)
        if provider in TORCH_CP:
            tcp = _TorchCP(provider, True, n, ctx, group=group)
            with tcp:
                tcp.fn(hq != hkv)(q, k, v).backward(do)
        else:
            chunks = (args.cp_search_head_chunks or hkv) if provider.startswith("ring") else 1
            _attn_fn(provider, True, group=group, head_chunks=chunks)(q, k, v).backward(do)
        ctx.sync()
        return torch.cuda.max_memory_allocated() if ctx.cuda else None

    try:
        peak = attempt()
    except _oom_types() as e:
        oom, err = True, str(e).splitlines()[0][:160]
    except Exception as e:
        err = f"{type(e).__name__}: {str(e)[:200]}"
    _free(ctx)
    every = ctx.gather_obj(dict(oom=oom, err=err, peak=peak))
    others = [e["err"] for e in every if e["err"] and not e["oom"]]
    if others:
        raise RuntimeError(f"{provider} at N = {n}: {others[0]}")
    return not any(e["oom"] for e in every), max((e["peak"] or 0) for e in every)


def _search(ctx, args, results, smoke, deadline, save=lambda: None):
    """The longest sequence per provider (forward+backward, causal), under the memory cap; the JSON is
    saved after each provider (a rank left hanging by another's out of memory ends the run by timeout)."""
    import torch
    import torch.distributed as dist

    out = {"providers": {}}
    pt = dict(b=1, hq=4 if smoke else 16, hkv=4 if smoke else 16, d=16 if smoke else 128, dtype=args.cp_dtype)
    quantum = 2 * ctx.world * (2 if smoke else 4096)
    simulate = 16 if smoke else None  # smoke: "out of memory" above 16 tokens, raised on every rank before any work
    cap = args.cp_cap_gib
    out.update(cap_gib=cap if ctx.cuda else None, mode="fwd_bwd", causal=True, heads=f"{pt['hq']}/{pt['hkv']}",
               quantum=quantum, simulated_oom_above=simulate,
               ring_head_chunks=args.cp_search_head_chunks or pt["hkv"])
    group = None
    if ctx.cuda:
        total = torch.cuda.get_device_properties(ctx.rank).total_memory
        if cap > 0:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**30 / total))
        # A group of its own with a short timeout: if one rank ran out of memory inside a collective while the
        # other waits in it, the watchdog ends the run in a minute instead of five (the JSON is already written).
        group = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=60))
    start_n = 16 if smoke else (32768 if cap and cap <= 16 else 262144)
    try:
        for prov in args.cp_search_providers:
            if prov in TORCH_CP and not ctx.cuda:
                out["providers"][prov] = {"skipped": "torch context_parallel needs CUDA"}
                continue
            tried_peaks = {}

            def fits(n, prov=prov):
                if ctx.any_(time.perf_counter() > deadline):
                    return None
                ok, peak = _fits(ctx, prov, n, pt, args, group if prov != "fa_lib_1gpu" else None, simulate)
                tried_peaks[n] = peak
                return ok

            try:
                ok, bad, tried = search_lengths(fits, start_n, quantum, 1 if smoke else 3)
                out["providers"][prov] = {"longest": ok, "first_failed": bad,
                                          "tried": [dict(n=n, fits=f, peak_bytes=tried_peaks.get(n)) for n, f in tried]}
                if tried and tried[-1][1] is None:
                    out["providers"][prov]["stopped"] = "search time budget"
            except RuntimeError as e:
                out["providers"][prov] = {"error": str(e)[:300]}
            results["search"] = out
            save()
            if ctx.rank == 0:
                print(f"longest sequence ({prov}): {out['providers'][prov]}", flush=True)
    finally:
        if ctx.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
    out.update(out.pop("providers"))  # search[provider]
    if ctx.cuda:
        total = torch.cuda.get_device_properties(ctx.rank).total_memory
        est = {}
        for prov in SEARCH_PROVIDERS:
            ns, peaks = [], []
            for p in results["points"]:
                if p.get("skipped") or not p["causal"] or (p["hq"], p["hkv"]) != (16, 16):
                    continue
                r = {x["provider"]: x for x in p["rows"]}.get(prov)
                if r and r.get("peak_bytes"):
                    ns.append(p["n"])
                    peaks.append(r["peak_bytes"])
            est[prov] = linear_fit_max_n(ns, peaks, total)
        out["estimate_full_card"] = dict(est, capacity_bytes=total,
                                         method="straight line through the forward+backward peak memory of the "
                                                "causal H = 16 points")
    return out


def _environment(ctx, args):
    import torch

    if ctx.cuda:
        from .bench import environment

        env = environment()
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:
            env["nccl"] = f"unknown ({type(e).__name__})"
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(ctx.world)]
        env["backend"] = "nccl"
        env["nvls"] = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")}
    else:
        env = {"device": "cpu", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "backend": "gloo",
               "note": "CPU smoke run: fa_lib under the Triton interpreter, gloo; a test of the pipeline"}
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    env["world_size"] = ctx.world
    return env


def _path(args, env, smoke):
    from .bench import _slug

    part = "cp-smoke" if smoke else "cp"
    return os.path.join(args.out_dir, f"{part}-{_slug(env['device'])}-x{env['world_size']}.json")


def _write(results, path):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)
    return path


def _worker(rank, world, port, args):
    import torch
    import torch.distributed as dist

    smoke = args.smoke
    cuda = not smoke and torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)  # the ranks share the CPU's cores
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=args.cp_timeout_s)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if cuda else None
    ctx = _Ctx(rank, world, device, cpu_group, smoke)
    t0 = time.perf_counter()
    env = _environment(ctx, args)
    path = _path(args, env, smoke)
    heads = parse_heads(args.cp_heads or (["4/2"] if smoke else ["16/16", "32/8"]))
    ns = args.cp_n or ([16] if smoke else [32768, 65536, 131072, 262144])
    causals = [c == "true" for c in (args.cp_causal or (["true"] if smoke else ["true", "false"]))]
    pts = points(ns, heads, causals, d=16 if smoke else 128, dtype=args.cp_dtype)
    providers = list(args.cp_providers or (SMOKE_PROVIDERS if smoke else PROVIDERS))
    args.cp_search_providers = list(args.cp_search_providers or (SMOKE_SEARCH if smoke else SEARCH_PROVIDERS))
    results = {"part": "cp-smoke" if smoke else "cp", "environment": env, "smoke": bool(smoke),
               "convention": CONVENTION, "targets_stated": TARGETS, "providers": providers,
               "settings": {"warmup": args.cp_warmup, "iters": args.cp_iters, "budget_s": args.cp_budget_s,
                            "check_n": args.cp_check_n, "cap_gib": args.cp_cap_gib, "ns": ns,
                            "heads": [f"{a}/{b}" for a, b in heads], "causal": causals,
                            "timer": "CUDA events" if cuda else "wall clock (smoke)",
                            "collective_timeout_s": args.cp_timeout_s,
                            "command": "python -m benchmarks.bench --cp" + (" --smoke" if smoke else "")},
               "checks": {}, "points": [], "search": None, "summary": None}
    if rank == 0:
        print(json.dumps(env), flush=True)
        print("\n".join(table_lines(results)), flush=True)
    sec_per_flop = None
    deadline = t0 + args.cp_budget_s
    checked = set()
    for pt in pts:
        pt = dict(pt, label=label(pt))
        cfg = (pt["causal"], pt["hq"], pt["hkv"])
        # Predict this point's seconds from the FLOPs done so far; skip it (every rank alike) if it would overrun.
        work = sum(flops(pt["b"], pt["hq"], pt["n"], pt["d"], pt["causal"], m) * gpus_used(p, world) ** -1 * world
                   for p in providers for m in MODES) * (args.cp_warmup + args.cp_iters)
        now = time.perf_counter()
        predicted = None if sec_per_flop is None else sec_per_flop * work
        late = ctx.any_(predicted is not None and now + predicted > deadline or now > deadline)
        if late:
            pt["skipped"] = (f"time budget: {now - t0:.0f} s spent of {args.cp_budget_s:.0f}, about "
                             f"{predicted or 0:.0f} s predicted")
        else:
            if cfg not in checked and not args.no_check:  # once per configuration, at the smallest N
                checked.add(cfg)
                check_n = min(args.cp_check_n, min(ns))
                check_n -= check_n % (2 * world)
                results["checks"][f"H={pt['hq']}/{pt['hkv']} {'causal' if pt['causal'] else 'full'}"] = \
                    _check(ctx, pt, providers, check_n)
            t_point = time.perf_counter()
            pt["rows"] = [_measure(ctx, p, pt, args) for p in providers]
            by = {r["provider"]: r for r in pt["rows"]}
            one = by.get("fa_lib_1gpu", {})
            for r in pt["rows"]:
                for mode in MODES:
                    t1, tw = one.get(f"{mode}_ms"), r.get(f"{mode}_ms")
                    r[f"{mode}_efficiency"] = (t1 / (r["gpus"] * tw) if t1 and tw and r["provider"] != "fa_lib_1gpu"
                                               else None)
            pt["seconds"] = time.perf_counter() - t_point
            sec_per_flop = pt["seconds"] / work  # the latest point's rate: the closest in size to the next
        results["points"].append(pt)
        results["summary"] = evaluate_targets(results)
        results["wall_s"] = time.perf_counter() - t0
        if rank == 0:
            print("\n".join(table_lines({"points": [pt]})[2:]), flush=True)
            _write(results, path)
    if not args.cp_no_search:
        save = (lambda: _write(results, path)) if rank == 0 else (lambda: None)
        results["search"] = _search(ctx, args, results, smoke, time.perf_counter() + args.cp_search_budget_s, save)
    results["summary"] = evaluate_targets(results)
    results["wall_s"] = time.perf_counter() - t0
    if rank == 0:
        _write(results, path)
        print()
        print("\n".join(table_lines(results)))
        print(json.dumps(results["summary"], indent=1), flush=True)
        print(f"wrote {path}", flush=True)
    ctx.gather_obj(None)  # everyone done before the groups go
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args):
    """Start one process per rank, wait for them (with a deadline), return the results JSON."""
    import torch
    import torch.multiprocessing as mp

    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("python -m benchmarks.bench --cp needs CUDA GPUs (or --smoke for the CPU pipeline test)")
    world = args.cp_world or (2 if smoke else torch.cuda.device_count())
    if world < 1 or (not smoke and world > torch.cuda.device_count()):
        raise SystemExit(f"--cp-world {world}: {torch.cuda.device_count() if not smoke else 'any'} GPUs visible")
    if smoke:  # the defaults shrink to one untimed-warmup-free call (explicit values are kept)
        if args.cp_warmup == 1:
            args.cp_warmup = 0
        if args.cp_iters == 3:
            args.cp_iters = 1
    # NVLink multicast stays off (the lent machines require it; nothing here uses it anyway).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    # --smoke: one BLAS/OpenMP thread per process (the ranks share the cores; oversubscribed, the interpreter
    # runs at half speed). Set for the children only, and put back.
    threads = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")} if smoke else {}
    saved = {k: os.environ.get(k) for k in threads}
    os.environ.update(threads)
    port = _free_port()
    try:
        pc = mp.start_processes(_worker, args=(world, port, args), nprocs=world, join=False, start_method="spawn")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = time.perf_counter() + args.cp_total_timeout_s
    try:
        while not pc.join(timeout=5):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"python -m benchmarks.bench --cp: still running after {args.cp_total_timeout_s:.0f} s")
    finally:
        for p in pc.processes:
            if p.is_alive():
                p.kill()
    env = {"device": torch.cuda.get_device_name(0) if not smoke else "cpu", "world_size": world}
    path = _path(args, env, smoke)
    with open(path) as f:
        return json.load(f)


def main(argv=None):
    """``python -m benchmarks.bench_cp`` = ``python -m benchmarks.bench --cp``."""
    from . import bench

    bench.main(["--cp", *(argv if argv is not None else __import__("sys").argv[1:])])


if __name__ == "__main__":
    main()
