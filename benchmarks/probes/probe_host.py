"""Host-side cost of fa_lib's calls on a CUDA machine: how long Python takes to enqueue a forward, a
backward and a forward+backward (no synchronisation inside the timed loop), next to the device time
(do_bench medians), at the masks benchmark's N = 4096 and 8192 points. When the host time of a
forward+backward comes near its device time, a timing of one call measures the host as much as the GPU. Also a cProfile
of the forward+backward calls (the top functions by cumulative time). Writes JSON to --out.

    python3 -m benchmarks.probes.probe_host --out $OUT/host.json
    python3 -m benchmarks.probes.probe_host --dense-only --out $OUT/host-dense.json
    python3 -m benchmarks.probes.probe_host --launch-only --out $OUT/host-launch.json
"""
import argparse
import contextlib
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path


import torch  # noqa: E402

from benchmarks import bench


def enqueue_ms(fn, reps=8, rounds=7):
    """Host ms per call of `fn`: `reps` calls issued back to back from an idle device, the least mean of
    `rounds` such bursts. The bursts are short so that the launch queue never fills (a full queue makes
    the host wait for the device, and the loop would time the device instead)."""
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, time.perf_counter() - t0)
    torch.cuda.synchronize()
    return best * 1e3 / reps


def profile_text(fn, calls=50, sort="cumulative", lines=30):
    """cProfile of `calls` calls of `fn`, device idle before and after: the top `lines` functions by `sort`."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(lines)
    return out.getvalue()



def dense_no_grad_points():
    """(b, n, causal, q, k, v, fa) at the dense probes' four points (bf16, H = 16, d = 128): fa() is
    fa_lib's forward without grad on q, k, v."""
    import fa_lib

    for b, n in ((64, 256), (4, 4096)):
        for causal in (False, True):
            q, k, v = (torch.randn(b, 16, n, 128, device="cuda", dtype=torch.bfloat16) for _ in "qkv")

            def fa(q=q, k=k, v=v, causal=causal):
                with torch.no_grad():
                    return fa_lib.flash_attention(q, k, v, causal=causal)

            yield b, n, causal, q, k, v, fa

def decode_rows():
    """Decoding (B = 1 and 8, Hq/Hkv = 32/8, D = 128, N_k = 1k and 16k, bf16): host ms per call and
    device ms, with the default length check (a device-to-host copy of cache_seqlens, which waits for the
    stream) and without it (the check skipped as under CUDA-graph capture), and the split and combine
    launches alone."""
    from unittest import mock

    import fa_lib
    from fa_lib import decode

    rows = []
    for b, nk in ((1, 1024), (1, 16384), (8, 16384)):
        q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(b, 8, nk, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        lens = torch.full((b,), nk, dtype=torch.int32, device="cuda")

        def call():
            with torch.no_grad():
                return fa_lib.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens)

        row = {"b": b, "nk": nk}
        for tag, ctx in (("checked", mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False)),
                         ("unchecked", mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True))):
            with ctx:
                call()
                row[f"{tag}_host_ms"] = enqueue_ms(call)
                row[f"{tag}_ms"] = [bench._median_ms(call) for _ in range(3)]
        with mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True):
            row["profile_unchecked"] = profile_text(call, sort="tottime", lines=25)[:4000]
        row["splits"] = decode._launch_plan(b, 8, 4, nk, 128, torch.cuda.get_device_properties(0).multi_processor_count)[0]
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("profile")}), flush=True)
        rows.append(row)
    return rows


def dense_rows():
    """Dense forwards (bf16, H = 16, D = 128; B = 64 x N = 256 and B = 4 x N = 4096, causal and not): host
    ms per call of fa_lib's forward, of the same call with every kernel launch skipped (fa_lib's Python
    alone), of its kernel launch alone (the recorded `ops._launch` call replayed), and of SDPA's FA2 and
    cuDNN forwards; device ms of fa_lib and SDPA; a cProfile of fa_lib's forward by own time."""
    from unittest import mock

    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from fa_lib import ops

    rows = []
    for b, n, causal, q, k, v, fa in dense_no_grad_points():
        row = {"b": b, "n": n, "causal": causal}
        fa()
        row["fa_lib_host_ms"] = enqueue_ms(fa)
        row["fa_lib_ms"] = min(bench._median_ms(fa) for _ in range(3))
        recorded = []
        with mock.patch.object(ops, "_launch", lambda *a, **kw: recorded.append((a, kw))):
            fa()
            row["fa_lib_python_only_host_ms"] = enqueue_ms(fa)
        a, kw = recorded[0]
        row["fa_lib_launch_only_host_ms"] = enqueue_ms(lambda: ops._launch(*a, **kw))
        for prov in ("sdpa_flash", "sdpa_cudnn"):
            backend = bench.sdpa_backend(prov)

            def sd():
                with sdpa_kernel(backend), torch.no_grad():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            sd()
            row[f"{prov}_host_ms"] = enqueue_ms(sd)
            row[f"{prov}_ms"] = min(bench._median_ms(sd) for _ in range(3))
        row["profile"] = profile_text(fa, calls=200, sort="tottime", lines=25)[:5000]
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        rows.append(row)
    return rows


def launch_rows():
    """The launch cache (fa_lib.launch) against Triton's kernel[grid], in one process, modes timed in turn:
    "triton" (launch._FAST = False: every launch binds its arguments in Triton) and "cached" (the default),
    and for the no-grad calls also "autograd" (kernel[grid] and the call through torch.autograd.Function,
    as before the no-grad path skipped it). Per call: host ms (enqueue_ms) and do_bench ms (least of 3
    medians). Calls: dense no-grad forwards (bf16, H = 16, D = 128; B = 64 x 256 and B = 4 x 4096, causal
    and not), the training forward and backward of the extended sweep's small point (B = 64, N = 256,
    causal, bf16, D = 64 and 128: inputs requiring grad), and eager decoding steps (B = 1 and 8, H = 32/8,
    N_k = 1k and 16k; the length check on, and "cached_unchecked": check_lengths=False); SDPA's FA2 and
    cuDNN next to each. cProfile (by own time) of two cached calls."""
    from unittest import mock

    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    import fa_lib
    from fa_lib import launch, ops

    def modes(no_grad):
        out = [("triton", dict(fast=False, untracked=None)), ("cached", dict(fast=True, untracked=None))]
        if no_grad:
            out.insert(0, ("autograd", dict(fast=False, untracked=lambda *a: False)))
        return out

    def measure(fn, cfg, grad_to_none=None):
        saved = launch._FAST
        patch = mock.patch.object(ops, "_untracked", cfg["untracked"]) if cfg["untracked"] else contextlib.nullcontext()
        try:
            launch._FAST = cfg["fast"]
            with patch:
                fn()
                fn()
                return dict(host_ms=enqueue_ms(fn),
                            ms=min(bench._median_ms(fn, grad_to_none=grad_to_none) for _ in range(3)))
        finally:
            launch._FAST = saved

    def sdpa(prov, q, k, v, causal, **kw):
        backend = bench.sdpa_backend(prov)

        def fn():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)
        return fn

    rows = []
    for b, n, causal, q, k, v, fa in dense_no_grad_points():
        row = {"call": "forward, no grad", "b": b, "n": n, "d": 128, "causal": causal}
        for name, cfg in modes(True):
            row[name] = measure(fa, cfg)
        if b == 64 and not causal:
            row["profile_cached"] = profile_text(fa, calls=200, sort="tottime", lines=30)[:6000]
        for prov in ("sdpa_flash", "sdpa_cudnn"):
            f = sdpa(prov, q, k, v, causal)
            with torch.no_grad():
                f()
                row[prov] = dict(host_ms=enqueue_ms(f), ms=min(bench._median_ms(f) for _ in range(3)))
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("profile")}), flush=True)
        rows.append(row)
    for d in (64, 128):
        q, k, v = (torch.randn(64, 16 if d == 128 else 32, 256, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in "qkv")
        do = torch.randn_like(q)
        for part in ("forward", "backward"):
            row = {"call": f"training {part}", "b": 64, "n": 256, "d": d, "causal": True}
            if part == "forward":
                fa = lambda: fa_lib.flash_attention(q, k, v, causal=True)  # noqa: E731
            else:
                o = fa_lib.flash_attention(q, k, v, causal=True)
                fa = lambda: o.backward(do, retain_graph=True)  # noqa: E731
            for name, cfg in modes(False):
                row[name] = measure(fa, cfg, grad_to_none=[q, k, v])
            for prov in ("sdpa_flash", "sdpa_cudnn"):
                f = sdpa(prov, q, k, v, True)
                if part == "backward":
                    o2 = f()
                    f = (lambda o2: lambda: o2.backward(do, retain_graph=True))(o2)
                f()
                row[prov] = dict(host_ms=enqueue_ms(f),
                                 ms=min(bench._median_ms(f, grad_to_none=[q, k, v]) for _ in range(3)))
            print(json.dumps({k: v for k, v in row.items() if not k.startswith("profile")}), flush=True)
            rows.append(row)
    for b, nk in ((1, 1024), (1, 16384), (8, 16384)):
        q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(b, 8, nk, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        lens = torch.full((b,), nk, dtype=torch.int32, device="cuda")

        def dec(check=True):
            with torch.no_grad():
                return fa_lib.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, check_lengths=check)
        row = {"call": "decoding step", "b": b, "nk": nk, "hq": 32, "hkv": 8, "d": 128}
        for name, cfg in modes(False):
            row[name] = measure(dec, cfg)
        unchecked = lambda: dec(False)  # noqa: E731
        row["cached_unchecked"] = measure(unchecked, dict(fast=True, untracked=None))
        if b == 8:
            row["profile_cached_unchecked"] = profile_text(unchecked, calls=200, sort="tottime", lines=30)[:6000]
        for prov in ("sdpa_flash", "sdpa_cudnn"):
            f = sdpa(prov, q, kc, vc, False, enable_gqa=True)
            with torch.no_grad():
                f()
                row[prov] = dict(host_ms=enqueue_ms(f), ms=min(bench._median_ms(f) for _ in range(3)))
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("profile")}), flush=True)
        rows.append(row)
    rows.append({"cache_info": launch.cache_info()})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", action="store_true", help="also the decoding rows (decode_rows)")
    ap.add_argument("--dense-only", action="store_true", help="only the dense forward rows (dense_rows)")
    ap.add_argument("--launch-only", action="store_true", help="only the launch cache rows (launch_rows)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--labels", nargs="*", default=["varlen", "window1024", "softcap50", "padding"])
    ap.add_argument("--ns", nargs="*", type=int, default=[4096, 8192])
    args = ap.parse_args()
    pts = [p for p in bench.mask_points(ns=args.ns) if p["label"] in args.labels]
    res = {"env": bench.environment(), "points": []}
    if args.launch_only:
        res["launch"] = launch_rows()
        Path(args.out).write_text(json.dumps(res, indent=1))
        return
    if args.dense_only:
        res["dense"] = dense_rows()
        Path(args.out).write_text(json.dumps(res, indent=1))
        return
    if args.decode:
        res["decode"] = decode_rows()
        Path(args.out).write_text(json.dumps(res, indent=1))
    for p in pts:
        q0, k0, v0 = (torch.randn(p["b"] * p["n"], h, p["d"], device="cuda", dtype=torch.bfloat16)
                      for h in (p["hq"], p["hkv"], p["hkv"]))
        do0 = torch.randn_like(q0)
        layout, make = bench.mask_provider("fa_lib", p, "cuda")
        q, k, v, do = (bench._to_layout(x, layout, p["b"], p["n"]).detach().clone().requires_grad_(x is not do0)
                       for x in (q0, k0, v0, do0))
        fn = make(q, k, v)
        o = fn()
        o.backward(do, retain_graph=True)

        def fwd_bwd():
            fn().backward(do)

        def bwd():
            o.backward(do, retain_graph=True)

        row = {"label": p["label"], "n": p["n"], "b": p["b"]}
        for name, f in (("fwd", fn), ("bwd", bwd), ("fwd_bwd", fwd_bwd)):
            f()
            row[f"{name}_enqueue_ms"] = enqueue_ms(f)
            row[f"{name}_ms"] = [bench._median_ms(f, grad_to_none=[q, k, v]) for _ in range(3)]
        row["profile"] = profile_text(fwd_bwd)[-6000:]
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        res["points"].append(row)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
