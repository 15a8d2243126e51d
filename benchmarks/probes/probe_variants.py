"""Kernel-variant probe on a CUDA machine: time fa_lib's backward kernels per kernel (torch.profiler) with
source-level variants of ``fa_lib/kernels.py`` swapped in, at a few dense and windowed points, and record
each compiled kernel's registers and spills. Variants that skip work (``dq_nounmasked``) are for timing
only (their results are wrong); they place the time inside a kernel, the way METHOD.md suggests (leave one
stage out, take the difference). The measurements in chapter 8 (``benchmarks/data/probe-masks-backward-*.json``)
were made against the kernels before this probe's findings; ``dq_threeloops``, ``dq_oneloop``,
``dkdv_threeloops`` and ``dkdv_nospec`` give the earlier forms of today's ``base`` (the holed loops of
``benchmarks/data/probe-masks-hole-*.json``, the specialised dK/dV kernel).

    python3 -m benchmarks.probes.probe_variants --out $OUT/variants.json
"""
import argparse
import contextlib
import importlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import torch  # noqa: E402

import fa_lib  # noqa: E402
from benchmarks import bench
from fa_lib import kernels  # noqa: E402

SRC = (ROOT / "fa_lib" / "kernels.py").read_text()
SPEC = '@triton.jit(do_not_specialize=["N_Q", "N_K", "WIN_LEFT", "WIN_RIGHT", "N_SEQ"])'
DQ_CALL = """dq, dq2 = _attn_bwd_dq_inner(dq, dq2, q, q2, do, do2, lse2, Di, K_head, V_head, kT_offs, vT_offs,
{i}                             kT2_offs, vT2_offs, stride_kn, stride_vn, KPM_row, {lo}, {hi}, 0, 0,
{i}                             qk_scale, cap, offs_m, offs_d, offs_d2, diag_right, diag_left, N_K, head_dim,
{i}                             BLOCK_N, {mask}, CAUSAL, LOCAL, SOFTCAP, HAS_KPM, MASK_D, HEAD_DIM2,
{i}                             EMULATE_BF16, PRECISION, ADDR, False)"""
FWD_CALL = """_attn_fwd_inner(acc, acc2, l_i, m_i, q, q2, K_head, V_head, kT_offs, v_offs,
                                        kT2_offs, v2_offs, stride_kn, stride_vn, KPM_row, {lo}, {hi},
                                        qk_scale, cap, offs_m, offs_d, offs_d2, diag_right, diag_left,
                                        N_K, head_dim, BLOCK_N, {mask}, CAUSAL, LOCAL, SOFTCAP, HAS_KPM,
                                        MASK_D, HEAD_DIM2, EMULATE_BF16, PRECISION, ADDR)"""


def _dq(lo, hi, mask, indent):
    return " " * indent + DQ_CALL.format(i=" " * indent, lo=lo, hi=hi, mask=mask)


def _between(s, start, end):
    """(a, b): the span of `s` from the text `start` up to (not including) the text `end` after it."""
    if start not in s:
        raise ValueError(f"kernels.py no longer holds {start[:60]!r}: this variant is for another version")
    a = s.index(start)
    return a, s.index(end, a)


def edits(name):
    """kernels.py's source with variant `name` applied ("file=PATH": the kernels.py at PATH, e.g. an
    earlier version, for a side-by-side timing in one process). Against today's kernels (one masked dQ loop under a
    window, a specialised dK/dV kernel), these variants are the alternatives chapter 8 reports."""
    s = SRC
    name = name.split("@")[0]
    if name.startswith("file="):
        return Path(name[len("file="):]).read_text()
    if name == "dkdv_nospec":  # the dK/dV kernel as before: integer arguments not specialised
        old = "@triton.jit\ndef _attn_bwd_dkdv("
        _between(s, old, "(")
        s = s.replace(old, SPEC + "\ndef _attn_bwd_dkdv(")
    elif name == "spec":  # every kernel specialises its integer arguments
        s = s.replace(SPEC, "@triton.jit")
    elif name in ("dq_threeloops", "dq_oneloop"):  # the dQ kernel's window as before: three loops (left
        # edge, unmasked, diagonal), or one masked loop over the whole band (the form before the holed loop)
        a, b = _between(s, "    if LOCAL:\n        # A window: both masked edges", "    else:\n")
        calls = ((_dq("lo", "n_lfull", "True", 8), _dq("n_lfull", "n_full", "False", 8), _dq("n_full", "hi", "True", 8))
                 if name == "dq_threeloops" else (_dq("lo", "hi", "True", 8),))
        s = s[:a] + "    if LOCAL:\n" + "\n".join(calls) + "\n" + s[b:]
    elif name == "dq_nounmasked":  # timing only: no unmasked loop (wrong gradients)
        old = "KPM_row, n_lfull, n_full, 0, 0,"
        _between(s, old, ",")
        s = s.replace(old, "KPM_row, n_lfull, n_lfull, 0, 0,")
    elif name in ("dkdv_oneloop", "dkdv_threeloops", "dkdv_hole_all"):  # the dK/dV kernel's band under a
        # window or in a packed batch in one masked loop, or in the dense kernel's three loops (the form
        # before); or the holed form for dense attention too
        holed, dense = "        if LOCAL or VARLEN:\n", "        if not (LOCAL or VARLEN):\n"
        _between(s, holed, dense)
        if name == "dkdv_threeloops":
            s = s.replace(holed, "        if False:\n").replace(dense, "        if True:\n")
        elif name == "dkdv_hole_all":
            s = s.replace(holed, "        if True:\n").replace(dense, "        if False:\n")
        else:
            old = "m_lo, m_hi, m_full, m_lfull,"
            a, b = _between(s, old, "ATOMIC_DQ, True)")
            s = s[:a] + "m_lo, m_hi, 0, 0," + s[a + len(old):b] + "ATOMIC_DQ, False)" + s[b + len("ATOMIC_DQ, True)"):]
            mid = "sm_scale, m_full, m_lfull, 0, 0,"
            _between(s, mid, ",")
            s = s.replace(mid, "sm_scale, m_full, m_full if (LOCAL or VARLEN) else m_lfull, 0, 0,")
    elif name == "fwd_oneloop":  # the forward's window in one masked loop
        a, b = _between(s, "    if LOCAL:  # The window's left edge: masked.", "    # Epilogue: deferred normalisation")
        new = ("    if LOCAL:\n        acc, acc2, l_i, m_i = " + FWD_CALL.format(lo="lo", hi="hi", mask="True") +
               "\n    else:\n        acc, acc2, l_i, m_i = "
               + FWD_CALL.format(lo="n_lfull", hi="n_full", mask="False") +
               "\n        acc, acc2, l_i, m_i = " + FWD_CALL.format(lo="n_full", hi="hi", mask="True") + "\n\n")
        s = s[:a] + new + s[b:]
    elif name != "base":
        raise ValueError(f"unknown variant {name!r}")
    return s


def load_variant(name):
    name = name.split("@")[0]
    tag = "file_" + Path(name[5:]).stem if name.startswith("file=") else name
    path = ROOT / "fa_lib" / f"_kvariant_{tag}.py"
    path.write_text(edits(name))
    return importlib.import_module(f"fa_lib._kvariant_{tag}")


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
    ("window4096-16k", 1, 16384, True, (4096, 0)),
    ("varlen8k", 2, 8192, True, (-1, -1)),
    ("varlen16k", 1, 16384, True, (-1, -1)),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", nargs="*", default=["base", "dq_threeloops", "dkdv_nospec", "dq_nounmasked"],
                    help="base, file=PATH, spec, dkdv_nospec, dkdv_hole_all, dq_threeloops, dq_oneloop, dq_nounmasked, "
                         "dkdv_oneloop, dkdv_threeloops, fwd_oneloop; '@kernel=BM,BN,W,S' replaces that kernel's blocks")
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
