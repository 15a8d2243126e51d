"""Kernel-variant probe on a CUDA machine: time fa_lib's backward kernels per kernel (torch.profiler) with
source-level variants of ``fa_lib/kernels.py`` swapped in, at a few dense and windowed points, and record
each compiled kernel's registers and spills. Variants that skip work are for timing only (their results are
wrong); they place the time inside a kernel, the way METHOD.md suggests (leave one stage out, take the
difference).

    python3 tools/probe_variants.py --out $OUT/variants.json
"""
import argparse
import contextlib
import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import fa_lib  # noqa: E402
from fa_lib import bench, kernels  # noqa: E402

SRC = (ROOT / "fa_lib" / "kernels.py").read_text()
DQ_LEFT = """    if LOCAL:
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, Di, K_head, V_head, kT_offs, vT_offs, stride_kn, stride_vn,
                                KPM_row, lo, n_lfull,"""
DQ_DIAG = """    dq = _attn_bwd_dq_inner(dq, q, do, lse2, Di, K_head, V_head, kT_offs, vT_offs, stride_kn, stride_vn,
                            KPM_row, n_full, hi,"""
SPEC = '@triton.jit(do_not_specialize=["N_Q", "N_K", "WIN_LEFT", "WIN_RIGHT", "N_SEQ"])'


def edits(name):
    s = SRC
    name = name.split("@")[0]
    if name == "dkdv_spec":  # specialise the integer arguments of the dK/dV kernel only
        a = s.index("def _attn_bwd_dkdv(")
        b = s.rindex(SPEC, 0, a)
        s = s[:b] + "@triton.jit" + s[b + len(SPEC):]
    elif name == "spec":
        s = s.replace(SPEC, "@triton.jit")
    elif name == "dq_noleft":
        assert DQ_LEFT in s
        s = s.replace(DQ_LEFT, DQ_LEFT.replace("    if LOCAL:", "    if False:"))
    elif name == "dq_nodiag":
        assert DQ_DIAG in s
        s = s.replace(DQ_DIAG, DQ_DIAG.replace("KPM_row, n_full, hi,", "KPM_row, n_full, n_full,"))
    elif name == "dq_swap":  # LOCAL: the unmasked loop first, then the left edge, then the diagonal
        a = s.index(DQ_LEFT)
        b = s.index("    dq = _attn_bwd_dq_inner(", a + len(DQ_LEFT))
        c = s.index("    dq = _attn_bwd_dq_inner(", b + 10)
        s = s[:a] + s[b:c] + s[a:b] + s[c:]
    elif name == "dq_oneloop":  # one masked loop over [lo, hi) instead of three
        a = s.index(DQ_LEFT)
        b = s.index("    dq *= sm_scale", a)
        one = """    dq = _attn_bwd_dq_inner(dq, q, do, lse2, Di, K_head, V_head, kT_offs, vT_offs, stride_kn, stride_vn,
                            KPM_row, lo, hi, qk_scale, cap, offs_m, offs_d, diag_right, diag_left,
                            N_K, head_dim, BLOCK_N, True, CAUSAL, LOCAL, SOFTCAP, HAS_KPM,
                            MASK_D, EMULATE_BF16, PRECISION, ADDR)

"""
        s = s[:a] + one + s[b:]
    elif name in ("dkdv_oneloop", "dkdv_oneloop_varlen"):
        first = "        dk, dv = _attn_bwd_dkdv_inner("
        a = s.index(first)
        b = s.index("\n\n    dk *= sm_scale", a)
        three = s[a:b]
        one = three[:three.index(first, 10)].replace("m_lo, m_full,", "m_lo, m_hi,")
        cond = "LOCAL or VARLEN" if name.endswith("varlen") else "LOCAL"
        indent = lambda t: "\n".join(("    " + x) if x else x for x in t.split("\n"))  # noqa: E731
        s = s[:a] + f"        if {cond}:\n" + indent(one.rstrip("\n")) + "\n        else:\n" + indent(three) + s[b:]
    elif name == "fwd_oneloop":
        a = s.index("    if LOCAL:  # The window's left edge: masked.")
        b = s.index("    # Epilogue: deferred normalisation")
        call = """_attn_fwd_inner(acc, l_i, m_i, q, K_head, V_head, kT_offs, v_offs,
                                        stride_kn, stride_vn, KPM_row, {lo}, {hi}, qk_scale, cap,
                                        offs_m, offs_d, diag_right, diag_left, N_K, head_dim,
                                        BLOCK_N, {mask}, CAUSAL, LOCAL, SOFTCAP, HAS_KPM,
                                        MASK_D, EMULATE_BF16, PRECISION, ADDR)"""
        new = ("    if LOCAL:\n        acc, l_i, m_i = " + call.format(lo="lo", hi="hi", mask="True") +
               "\n    else:\n        acc, l_i, m_i = " + call.format(lo="n_lfull", hi="n_full", mask="False") +
               "\n        acc, l_i, m_i = " + call.format(lo="n_full", hi="hi", mask="True") + "\n\n")
        s = s[:a] + new + s[b:]
    elif name == "dq_oneloop_varlen":
        old = "    if LOCAL:\n        # A window: one masked loop"
        assert old in s
        s = s.replace(old, "    if LOCAL or VARLEN:\n        # A window: one masked loop")
    elif name == "dq_nounmasked":
        old = "KPM_row, n_lfull, n_full, qk_scale"
        assert old in s
        s = s.replace(old, "KPM_row, n_lfull, n_lfull, qk_scale")
    return s


def load_variant(name):
    name = name.split("@")[0]
    path = ROOT / "fa_lib" / f"_kvariant_{name}.py"
    path.write_text(edits(name))
    return importlib.import_module(f"fa_lib._kvariant_{name}")


def kernel_times(fn, reps=20, prefix="_attn"):
    """{kernel name: device ms per call} of `fn` over `reps` calls (torch.profiler): the kernels whose
    names start with `prefix`, or (prefix None) the eight longest of any name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and (prefix is None or e.name.startswith(prefix)):
            out[e.name[:80]] = out.get(e.name[:80], 0.0) + e.device_time / 1e3 / reps
    return out if prefix else dict(sorted(out.items(), key=lambda kv: -kv[1])[:8])


def compiled_info(jitfn, dump=None):
    info = []
    for dev_cache in getattr(jitfn, "device_caches", {}).values():
        for ck in dev_cache[0].values():
            md = ck.metadata
            info.append({"n_regs": getattr(ck, "n_regs", None), "n_spills": getattr(ck, "n_spills", None),
                         "num_warps": md.num_warps, "num_stages": md.num_stages,
                         "shared": getattr(md, "shared", None)})
            if dump:
                import subprocess
                path = Path(dump) / f"{jitfn.__name__}-{len(info)}-w{md.num_warps}.cubin"
                path.write_bytes(ck.asm["cubin"])
                sass = subprocess.run(["cuobjdump", "-sass", str(path)], capture_output=True, text=True).stdout
                path.with_suffix(".sass").write_text(sass)
                path.unlink()
                info[-1]["sass_lines"] = sass.count("\n")
    return info


POINTS = [  # (label, b, n, causal, window); "varlen": bench --masks' packed documents at N = 8k
    ("causal8k", 2, 8192, True, (-1, -1)),
    ("window4096-8k", 2, 8192, True, (4096, 0)),
    ("window1024-8k", 2, 8192, True, (1024, 0)),
    ("window1024-16k", 1, 16384, True, (1024, 0)),
    ("varlen8k", 2, 8192, True, (-1, -1)),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", nargs="*", default=["base", "spec", "dq_noleft", "dq_nodiag", "dq_nounmasked"])
    ap.add_argument("--dump", default=None, help="folder for the SASS of the dQ kernels")
    ap.add_argument("--dump-variants", nargs="*", default=["base"])
    ap.add_argument("--points", nargs="*", default=None, help="labels of POINTS to run (default: all)")
    args = ap.parse_args()
    orig = {n: getattr(kernels, n) for n in ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_bwd_preprocess")}
    res = {"env": bench.environment(), "rows": []}
    for var in args.variants:
        base, _, cfg = var.partition("@")  # "variant@kernel=BM,BN,W,S": that kernel's blocks replaced
        mod = kernels if base == "base" else load_variant(base)
        if cfg:
            kern, blocks = cfg.split("=")
            override = bench.override_config(kern, tuple(int(x) for x in blocks.split(",")))
        else:
            override = contextlib.nullcontext()
        override.__enter__()
        for n in orig:
            setattr(kernels, n, getattr(mod, n))
        for label, b, n, causal, window in POINTS:
            if args.points and label not in args.points:
                continue
            h, d = 16, 128
            if label.startswith("varlen"):
                pt = [p for p in bench.mask_points(ns=[n], kinds=("varlen",), gqa=None)][0]
                _, make = bench.mask_provider("fa_lib", pt, "cuda")
                q, k, v, do = (torch.randn(b * n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                q, k, v = (x.requires_grad_() for x in (q, k, v))
                fwd = make(q, k, v)
            else:
                q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                q, k, v = (x.requires_grad_() for x in (q, k, v))
                fwd = lambda: fa_lib.flash_attention(q, k, v, causal=causal, window=window)  # noqa: E731
            o = fwd()
            bwd = lambda: o.backward(do, retain_graph=True)  # noqa: E731
            row = {"variant": var, "point": label, "fwd_ms": bench._median_ms(fwd),
                   "bwd_ms": bench._median_ms(bwd, grad_to_none=[q, k, v]), "kernels": kernel_times(bwd)}
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
            del q, k, v, do, o
        res.setdefault("compiled", {})[var] = {n: compiled_info(getattr(mod, n), args.dump if var in args.dump_variants else None)
                                               for n in ("_attn_bwd_dq",)}
        print(var, json.dumps(res["compiled"][var]), flush=True)
        override.__exit__(None, None, None)
        Path(args.out).write_text(json.dumps(res, indent=1))
    for n, f in orig.items():
        setattr(kernels, n, f)


if __name__ == "__main__":
    main()
