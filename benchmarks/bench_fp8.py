"""FP8 (e4m3) forward against bfloat16: ``python -m benchmarks.bench_fp8 --out-dir DIR`` (on a CUDA GPU).

At head dim 128 and B·N = 16k tokens, for N in {4k, 8k, 16k}, H = 16 (and grouped-query 32/8), causal and
not, one forward of

* ``fa_lib.fp8.flash_attention_fp8`` on inputs quantized per batch and key/value head (its
  descales of shape (B, H_kv)); the call's own copy of V into the keys-contiguous layout is timed with it,
  and also alone (``v_copy_ms``),
* ``fa_lib.flash_attention`` in bfloat16 (its default path),
* PyTorch SDPA's cuDNN backend in bfloat16 where it runs (a point it refuses is recorded as null, with why),

timed with ``triton.testing.do_bench`` (median, L2 flushed before each call; ``benchmarks.bench._median_ms``).
TFLOP/s count ``4·B·H_q·d·(visible pairs)`` (bottom-right causal), the convention of
``fa_lib.fp8.flash_attention_fp8``'s docstring; ``ratio_fp8_over_bf16`` is the FP8 call's speed-up over fa_lib's
bfloat16 (bf16 time / FP8 time). Each point's FP8 output is checked on the first group of query heads of batch 0
against ``fa_lib.reference.fp8_error_bound``'s rule, computed by the float64 twin ``fp8_reference_torch`` on the
GPU (the NumPy reference's arrays would not fit at 16k keys).

Writes ``fp8-<device>.json`` (the environment, with the commit, and one record per point) to ``--out-dir``
(default ``benchmarks/data``) and prints one line per point. Without CUDA it stops at once and says so.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

TOKENS, HEAD_DIM = 16384, 128
LENGTHS = (4096, 8192, 16384)
HEADS = ((16, 16), (32, 8))  # (H_q, H_kv)
E4M3_MAX = 448.0


def fp8_reference_torch(q8, k8, v8, q_descale, k_descale, v_descale, *, causal=False, softmax_scale=None,
                        out_unit=2.0 ** -8, chunk=1024):
    """The float64 twin, for torch tensors on any device, of ``fa_lib.reference.fp8_attention(quantize_p=False)``
    and ``fa_lib.reference.fp8_error_bound``: ``(o_ref, lse_ref, bound)``, float64, computed ``chunk`` query
    rows at a time (the (chunk, N_k) scores per head are the memory it needs).

    q8 (B, H_q, N_q, d), k8 and v8 (B, H_kv, N_k, d), ``torch.float8_e4m3fn``; the descales as
    ``flash_attention_fp8`` takes them (one element, or (B, H_kv)). Line for line the NumPy reference's
    arithmetic: S of the dequantized inputs, bottom-right causal mask, e = exp(S - m), and the bound
    ``sum_j max(2^-4 e_j, 2^-10) |v_j| / l + out_unit |o_ref| + 1e-6 max|v|`` over the keys with e_j > 0."""
    import torch

    B, H_q, N_q, D = q8.shape
    H_kv, N_k = k8.shape[1], k8.shape[2]
    group = H_q // H_kv

    def per_head(descale, heads_rep):  # (B, H, 1, 1) float64, H = H_kv * heads_rep
        d = descale.to(q8.device, torch.float64)
        if d.numel() == 1:
            return d.reshape(1, 1, 1, 1)
        return d.reshape(B, H_kv, 1, 1).repeat_interleave(heads_rep, dim=1)

    q = q8.double() * per_head(q_descale, group)
    k = (k8.double() * per_head(k_descale, 1)).repeat_interleave(group, dim=1)  # (B, H_q, N_k, d)
    v = (v8.double() * per_head(v_descale, 1)).repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    v_abs, v_max = v.abs(), v.abs().max() if v.numel() else torch.zeros((), dtype=torch.float64)
    o = torch.empty((B, H_q, N_q, D), dtype=torch.float64, device=q8.device)
    lse = torch.empty((B, H_q, N_q), dtype=torch.float64, device=q8.device)
    bound = torch.empty_like(o)
    keys = torch.arange(N_k, device=q8.device)
    for i in range(0, N_q, chunk):
        rows = torch.arange(i, min(i + chunk, N_q), device=q8.device)
        s = (q[:, :, i:i + chunk] @ k.transpose(-1, -2)) * scale  # (B, H_q, chunk, N_k)
        if causal:
            s = s.masked_fill(keys[None, :] > rows[:, None] + (N_k - N_q), float("-inf"))
        m = s.amax(-1, keepdim=True) if N_k else torch.full(s.shape[:-1] + (1,), float("-inf"), dtype=s.dtype,
                                                             device=s.device)
        e = torch.exp(s - torch.where(torch.isneginf(m), 0.0, m))
        l = e.sum(-1, keepdim=True)
        l_safe = torch.where(l > 0, l, 1.0)
        o_c = (e @ v) / l_safe
        o[:, :, i:i + chunk] = o_c
        lse[:, :, i:i + chunk] = torch.where(l[..., 0] > 0, m[..., 0] + torch.log(l_safe[..., 0]), float("-inf"))
        per_key = torch.where(e > 0, torch.clamp(2.0 ** -4 * e, min=2.0 ** -10), 0.0)
        bound[:, :, i:i + chunk] = (per_key @ v_abs) / l_safe + out_unit * o_c.abs() + 1e-6 * v_max
        del s, e, per_key
    return o, lse, bound


def quantize_per_head(x, heads_kv):
    """``(x8, descale)``: x (B, H, N, d) scaled per batch and key/value head (a query head's group shares its
    key/value head's scale) so that its largest magnitude maps to 448, cast to e4m3; descale (B, H_kv) float32."""
    import torch

    B, H, N, D = x.shape
    amax = x.float().reshape(B, heads_kv, -1).abs().amax(-1)  # (B, H_kv)
    descale = torch.where(amax > 0, amax / E4M3_MAX, 1.0).to(torch.float32)
    scale = descale.repeat_interleave(H // heads_kv, dim=1)[:, :, None, None]
    x8 = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, descale


def points(lengths=LENGTHS, heads=HEADS, causals=(False, True), tokens=TOKENS, d=HEAD_DIM):
    for h_q, h_kv in heads:
        for causal in causals:
            for n in lengths:
                yield {"b": max(1, tokens // n), "hq": h_q, "hkv": h_kv, "n": n, "d": d, "causal": causal}


def point_flops(p):
    from .bench import visible_pairs_causal

    return 4 * p["b"] * p["hq"] * p["d"] * visible_pairs_causal(p["n"], p["n"], p["causal"])


def _cudnn_fn(causal, gqa):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return fn


def check_point(o8, q8, k8, v8, descales, causal, chunk=512):
    """The rule on the first group of query heads of batch 0: every element within the bound."""
    group = q8.shape[1] // k8.shape[1]
    sl = (slice(0, 1), slice(0, group))
    kv = (slice(0, 1), slice(0, 1))
    qd, kd, vd = (d[0:1, 0:1] for d in descales)
    o_ref, _, bound = fp8_reference_torch(q8[sl], k8[kv], v8[kv], qd, kd, vd, causal=causal, chunk=chunk)
    err = (o8[sl].double() - o_ref).abs()
    return {"heads_checked": group, "max_err": float(err.max()), "max_err_over_bound": float((err / bound).max()),
            "ok": bool((err <= bound).all())}


def bench_point(p, warmup, rep, check=True, device="cuda", timer=None):
    """One point's record. `device` and `timer` (default: `benchmarks.bench._median_ms`) let the CPU test run the
    same pipeline under the interpreter with a stand-in timer."""
    import torch

    import fa_lib
    from fa_lib import fp8

    from .bench import _median_ms

    timer = _median_ms if timer is None else timer
    gen = torch.Generator(device=device).manual_seed(p["n"] + 7 * p["hq"] + int(p["causal"]))
    shape_q, shape_kv = (p["b"], p["hq"], p["n"], p["d"]), (p["b"], p["hkv"], p["n"], p["d"])
    q = torch.randn(shape_q, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(shape_kv, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(shape_kv, device=device, dtype=torch.bfloat16, generator=gen)
    (q8, qd), (k8, kd), (v8, vd) = (quantize_per_head(x, p["hkv"]) for x in (q, k, v))
    causal = p["causal"]

    def run_fp8():
        return fp8.flash_attention_fp8(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal)

    flops = point_flops(p)
    out = dict(p, flops=flops)
    o8 = run_fp8()  # compile, and the output checked below
    ms = {"fp8": timer(run_fp8, warmup=warmup, rep=rep),
          "v_copy": timer(lambda: fp8._values_keys_contiguous(v8), warmup=warmup, rep=rep)}
    fa_lib.flash_attention(q, k, v, causal=causal)
    ms["bf16"] = timer(lambda: fa_lib.flash_attention(q, k, v, causal=causal), warmup=warmup, rep=rep)
    cudnn = _cudnn_fn(causal, p["hq"] != p["hkv"])
    try:
        cudnn(q, k, v)
        ms["cudnn_bf16"] = timer(lambda: cudnn(q, k, v), warmup=warmup, rep=rep)
    except RuntimeError as exc:  # cuDNN refuses some shapes (or is absent): recorded, not fatal
        ms["cudnn_bf16"] = None
        out["cudnn_error"] = str(exc).splitlines()[0][:200]
    out["ms"] = {"fp8": ms["fp8"], "bf16": ms["bf16"], "cudnn_bf16": ms["cudnn_bf16"], "v_copy": ms["v_copy"]}
    out["tflops"] = {name: (None if t is None else flops / (t * 1e-3) / 1e12)
                     for name, t in out["ms"].items() if name != "v_copy"}
    out["ratio_fp8_over_bf16"] = ms["bf16"] / ms["fp8"]  # > 1: FP8 is faster
    if check:
        out["check"] = check_point(o8, q8, k8, v8, (qd, kd, vd), causal)
    return out


def _line(r):
    t = r["tflops"]
    cudnn = "   -  " if t["cudnn_bf16"] is None else f"{t['cudnn_bf16']:6.1f}"
    check = r.get("check", {})
    ok = {True: "ok", False: "FAIL"}.get(check.get("ok"), "-")
    ratio = check.get("max_err_over_bound")
    mask = "causal" if r["causal"] else "full  "
    return (f"N={r['n']:>5} B={r['b']:>2} H={r['hq']:>2}/{r['hkv']:<2} d={r['d']} {mask} | fp8 {t['fp8']:6.1f}  "
            f"bf16 {t['bf16']:6.1f}  cudnn {cudnn} TFLOP/s | fp8/bf16 {r['ratio_fp8_over_bf16']:.2f}x "
            f"| v copy {r['ms']['v_copy'] * 1e3:5.0f} us | bound {ok}"
            + ("" if ratio is None else f" (max err/bound {ratio:.3f})"))


def parse_config(text):
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != 4 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"--config takes BLOCK_M,BLOCK_N,num_warps,num_stages, got {text!r}")
    return parts


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_fp8", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "data"),
                        help="where fp8-<device>.json goes (default: benchmarks/data)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="sequence lengths N")
    parser.add_argument("--warmup", type=float, default=25, help="do_bench warm-up, ms (default 25)")
    parser.add_argument("--rep", type=float, default=100, help="do_bench repetitions, ms (default 100)")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness check of each point")
    parser.add_argument("--config", type=parse_config, default=None,
                        help="BLOCK_M,BLOCK_N,num_warps,num_stages for the FP8 kernel at head dim 128 instead of "
                             "fa_lib.fp8.GPU_CONFIGS[128] (recorded in the JSON)")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.lengths):
        parser.error(f"--lengths must be positive, got {args.lengths}")
    return args


def require_cuda():
    """Stop at once, saying why, on a machine without a CUDA GPU that runs FP8 products (compute capability
    8.9 or later)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.bench_fp8 needs a CUDA GPU (FP8 products, compute capability 8.9 or later; "
                         "built for sm_90); torch.cuda.is_available() is False here")
    if torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit(f"benchmarks.bench_fp8 needs FP8 products (compute capability 8.9 or later); "
                         f"{torch.cuda.get_device_name()} has {torch.cuda.get_device_capability()}")


def main(argv=None):
    args = parse_args(argv)
    require_cuda()
    from fa_lib import fp8

    from .bench import _free, _slug, environment

    if args.config is not None:
        fp8.GPU_CONFIGS[128] = args.config
    env = environment()
    results = {"environment": env, "command": "python -m benchmarks.bench_fp8 " + " ".join(sys.argv[1:] if argv is None
                                                                                       else argv),
               "fp8_config_d128": list(fp8.GPU_CONFIGS[128]), "warmup_ms": args.warmup, "rep_ms": args.rep,
               "points": []}
    path = os.path.join(args.out_dir, f"fp8-{_slug(env['device'])}.json")
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"# {env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
    for p in points(lengths=args.lengths):
        r = bench_point(p, args.warmup, args.rep, check=not args.no_check)
        _free()  # the point's tensors are gone with its frame: give their memory back before the next
        results["points"].append(r)
        print(_line(r), flush=True)
        with open(path, "w") as f:  # after every point: a crash keeps what was measured
            json.dump(results, f, indent=1)
    print(f"# wrote {path}")
    failed = [r for r in results["points"] if r.get("check", {}).get("ok") is False]
    if failed:
        raise SystemExit(f"{len(failed)} point(s) broke the FP8 error bound; see {path}")


if __name__ == "__main__":
    main()
