"""The performance chapters' record: every figure they quote, read from the measurement files and checked.

The pages 11b_forward, 11c_backward, 11d_host and 11f_appendix of the book (and a hidden cell of 11a_measuring)
state what was measured on NVIDIA H200s. This module reads every measurement file those pages quote
(``benchmarks/data/*-nvidia-h200.json``, through ``benchmarks.data.load_json``), derives the figures the pages
state and asserts each one, so a measurement file that changes fails the book's tests when a page imports the
module. It prints, displays and draws nothing.

Each page imports, in a hidden cell, exactly the names it uses::

    from benchmarks.performance_facts import best, geomean, now, rng

Among them: ``rate`` (TFLOP/s of a provider at a point of the sweep), ``best`` (fa_lib's speed relative to another
provider at a point of the extended sweep, over fa_lib's two paths), ``geomean``, ``rng`` (a list of ratios as
"min-max"), ``now`` (the extended sweep's 224 points with every part of ``bench.EXT_PARTS`` in place) and, over
those points, ``count_now``, ``geo_now``, ``now_fwd`` and ``now_bwd``; ``abl`` is the table of what was tried and
kept (change, where, pass, old time / new, data file).
"""
import ast
import inspect

import numpy as np
import torch
import triton

import benchmarks.data
import fa_lib
from benchmarks import bench, bench_profile
from fa_lib import dispatch, kernels, kernels_hopper, ops, symbolic


def rng(xs):
    """A list of ratios as "min-max" (one value alone as itself), two decimals."""
    return f"{min(xs):.2f}-{max(xs):.2f}" if len(xs) > 1 else f"{xs[0]:.2f}"


def geomean(values):
    return float(np.exp(np.mean(np.log(list(values)))))


# The sweep (sweep-nvidia-h200.json): 40 points, fa_lib against PyTorch's SDPA backends; peak memory; the
# recomputation and checkpointing experiments.
sweep = benchmarks.data.load_json("sweep-nvidia-h200.json")
memory = benchmarks.data.load_json("memory-nvidia-h200.json")
experiments = benchmarks.data.load_json("experiments-nvidia-h200.json")

env = sweep["environment"]
STACK = ("device", "torch", "triton", "cuda", "cudnn")


def same_stack(part):
    """Whether a measurement file's device and software are the sweep's."""
    return {k: part["environment"][k] for k in STACK} == {k: env[k] for k in STACK}


def ext_part(index, name, date):
    """Part `index` of the extended sweep (``bench.EXT_PARTS``), read and checked: its file is `name`, measured on
    `date` with the sweep's device and software, and its ratios are those of its times."""
    assert bench.EXT_PARTS[index] == name
    part = benchmarks.data.load_json(name)
    assert part["environment"]["date"] == date and same_stack(part)
    assert all(p["ratio"] == bench.ext_ratios(p) for p in part["points"])
    return part


for part in (memory, experiments):
    assert same_stack(part)
EARLIER = memory["environment"]["date"]
assert (
    env["date"] == "2026-12-01"
    and "on 2026-11-30" in sweep["run"]
    and sweep["run"].startswith("One run")
)
assert EARLIER == experiments["environment"]["date"] == "2026-11-29"

assert set(sweep) == {
    "part",
    "environment",
    "ceilings",
    "convention",
    "run",
    "carried",
    "configs",
}

carried = [
    (c["dtype"], c["d"], c["causal"], c["n"], r["provider"], r["carried_from"])
    for c in sweep["configs"]
    for r in c["rows"]
    if "carried_from" in r
]
carried_providers = sorted({row[4] for row in carried})
assert {row[5] for row in carried} == {EARLIER} and carried_providers == [
    "naive",
    "sdpa_math",
]
assert (
    len(carried) == 2 * len(sweep["configs"]) == 80
    and sum(len(c["rows"]) for c in sweep["configs"]) == 240
)

COPY_TBPS = sweep["ceilings"]["copy_TBps"]
MATMUL_TFLOPS = sweep["ceilings"]["bf16_matmul_TFLOPs"]

EARLIER_COPY_TBPS, EARLIER_MATMUL_TFLOPS = 4.2565, 708.127
assert (
    env["device"] == "NVIDIA H200"
    and env["triton"] == "3.6.0"
    and env["torch"].startswith("2.11")
)
assert (
    sweep["ceilings"]["copy_bytes"] == 4 * 2**30
    and sweep["ceilings"]["matmul_size"] == 8192
)
assert abs(COPY_TBPS - 4.26) < 0.005 and abs(MATMUL_TFLOPS - 694.1) < 0.05
assert (
    round(100 * (COPY_TBPS / EARLIER_COPY_TBPS - 1), 2) == -0.02
    and round(100 * (MATMUL_TFLOPS / EARLIER_MATMUL_TFLOPS - 1), 1) == -2.0
)

again = {
    (c["dtype"], c["d"], c["causal"], c["n"]): c["remeasured"]
    for c in sweep["configs"]
    if "remeasured" in c
}
((AGAIN, remeasured),) = again.items()
values = remeasured["values"]

for provider, v in values.items():
    row = next(
        r
        for c in sweep["configs"]
        if "remeasured" in c
        for r in c["rows"]
        if r["provider"] == provider
    )
    assert all(
        row[f] == np.median(v[f])
        for f in ("fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops")
    )
run_spread = {
    (p, m): max(v[f"{m}_tflops"]) / min(v[f"{m}_tflops"]) - 1
    for p, v in values.items()
    for m in ("fwd", "bwd")
}
assert AGAIN == ("fp16", 128, True, 1024) and len(remeasured["runs"]) == 4
assert [round(t) for t in values["fa_lib"]["fwd_tflops"]] == [209, 238, 315, 325]
assert (
    round(np.median(values["fa_lib"]["fwd_tflops"])) == 276
    and "327 in the port comparison run" in remeasured["why"]
)
assert (
    round(100 * run_spread["fa_lib", "fwd"]) == 55
    and max(s for k, s in run_spread.items() if k != ("fa_lib", "fwd")) < 0.04
)
assert "kernel alone in four more fresh processes gave 313-328" in remeasured["why"]
fc = symbolic.attention_flops()
for n, d in [(1024, 64), (4096, 128), (16384, 128)]:
    assert bench.attention_flops(1, 1, n, n, d, False, "fwd") == fc.forward.subs(
        {fc.N: n, fc.d: d}
    )
    assert bench.attention_flops(
        1, 1, n, n, d, False, "bwd"
    ) == fc.backward_recompute.subs({fc.N: n, fc.d: d})
    assert 2 * bench.attention_flops(
        1, 1, n, n, d, True, "fwd"
    ) == bench.attention_flops(1, 1, n, n, d, False, "fwd")

f_fwd = bench.attention_flops(4, 16, 4096, 4096, 128, False, "fwd")
f_bwd = bench.attention_flops(4, 16, 4096, 4096, 128, False, "bwd")
assert f_fwd == 549_755_813_888 and f_bwd == 1_374_389_534_720
points = {
    (c["dtype"], c["d"], c["causal"], c["n"]): {r["provider"]: r for r in c["rows"]}
    for c in sweep["configs"]
}


def rate(key, provider, mode):
    return points[key][provider][f"{mode}_tflops"]


ratio = {
    (key, mode, other): rate(key, "fa_lib", mode) / rate(key, other, mode)
    for key in points
    for mode in ("fwd", "bwd")
    for other in ("sdpa_flash", "sdpa_cudnn")
}

misses = sorted(
    {
        key
        for (key, mode, other), r in ratio.items()
        if other == "sdpa_flash" and r < 1.0
    }
)
summary = {}
for mode in ("fwd", "bwd"):
    for other in ("sdpa_flash", "sdpa_cudnn"):
        r = {key: ratio[key, mode, other] for key in points}
        lo, hi = min(r, key=r.get), max(r, key=r.get)
        geo = float(np.exp(np.mean(np.log(list(r.values())))))
        summary[mode, other] = (r[lo], r[hi], geo)

assert len(points) == 40 and not misses
narrowest = min(
    ((key, mode) for key in points for mode in ("fwd", "bwd")),
    key=lambda km: ratio[km[0], km[1], "sdpa_flash"],
)
assert (
    narrowest == (AGAIN, "fwd") and round(ratio[(*narrowest, "sdpa_flash")], 2) == 1.12
)
expected = {
    ("fwd", "sdpa_flash"): (1.12, 1.57, 1.41),
    ("bwd", "sdpa_flash"): (1.18, 1.58, 1.34),
    ("fwd", "sdpa_cudnn"): (0.66, 0.98, 0.87),
    ("bwd", "sdpa_cudnn"): (0.73, 0.98, 0.79),
}
for k, v in expected.items():
    assert np.allclose(summary[k], v, atol=0.005), (k, summary[k])

per_run = {
    other: [
        a / b
        for a, b in zip(values["fa_lib"]["fwd_tflops"], values[other]["fwd_tflops"])
    ]
    for other in ("sdpa_flash", "sdpa_cudnn")
}
others = {
    other: min((k for k in points if k != AGAIN), key=lambda k: ratio[k, "fwd", other])
    for other in ("sdpa_flash", "sdpa_cudnn")
}
assert [round(r, 2) for r in per_run["sdpa_flash"]] == [0.85, 0.97, 1.28, 1.32]
assert [round(r, 2) for r in per_run["sdpa_cudnn"]] == [0.49, 0.58, 0.76, 0.78]
assert round(ratio[others["sdpa_flash"], "fwd", "sdpa_flash"], 2) == 1.31 and others[
    "sdpa_flash"
] == ("bf16", 128, False, 1024)
assert round(ratio[others["sdpa_cudnn"], "fwd", "sdpa_cudnn"], 2) == 0.74 and others[
    "sdpa_cudnn"
] == ("bf16", 128, True, 1024)

assert min(ratio[k, "bwd", "sdpa_flash"] for k in points) > 1.18

best = max(points, key=lambda k: rate(k, "fa_lib", "fwd"))
assert (
    best == ("bf16", 128, False, 8192)
    and abs(rate(best, "fa_lib", "fwd") - 536.5) < 0.05
)
assert round(rate(best, "fa_lib", "bwd")) == 405
assert (
    round(1.4 * rate(best, "fa_lib", "bwd")) == 566
    and round(100 * rate(best, "fa_lib", "fwd") / MATMUL_TFLOPS) == 77
)
checks = [c["check"] for c in sweep["configs"]]
worst = {
    name: max(c["ratio"][name] for c in checks)
    for name in ("o", "lse", "dq", "dk", "dv")
}
assert (
    all(c["ok"] for c in checks)
    and round(max(worst.values()), 2) == 1.31
    and max(worst, key=worst.get) == "dk"
)
STYLE = {
    "fa_lib": ("C0", "o", "fa_lib (Triton)"),
    "sdpa_flash": ("C1", "s", "SDPA flash (FA2)"),
    "sdpa_cudnn": ("C2", "^", "SDPA cuDNN"),
    "sdpa_efficient": ("C3", "v", "SDPA efficient"),
    "sdpa_math": ("C4", "x", "SDPA math"),
    "naive": ("C5", "+", "naive"),
}
NS = [1024, 2048, 4096, 8192, 16384]
SWEEP_PANELS = [(64, False), (64, True), (128, False), (128, True)]
for mode in ("fwd", "bwd"):
    # every provider has a rate at every N of the four bf16 panels (the sweep figure's curves)
    assert [sum(p in points["bf16", d, c, n] for p in STYLE for n in NS) for d, c in SWEEP_PANELS] == [6 * 5] * 4
    assert all(rate(("bf16", d, c, n), p, mode) > 0 for d, c in SWEEP_PANELS for p in STYLE for n in NS)
    assert all(
        rate(("bf16", d, c, n), "fa_lib", mode)
        > rate(("bf16", d, c, n), "sdpa_flash", mode)
        for d in (64, 128)
        for c in (False, True)
        for n in NS
    )
ridge = MATMUL_TFLOPS / COPY_TBPS


def attainable(intensity):
    return np.minimum(MATMUL_TFLOPS, COPY_TBPS * np.asarray(intensity, dtype=float))


full_bf16 = [k for k in points if k[0] == "bf16" and not k[2]]

fa = [(k[3] / 2, rate(k, "fa_lib", "fwd")) for k in full_bf16]
nv = [(k[1] / 3, rate(k, "naive", "fwd")) for k in full_bf16]
tile = {  # B_r N / (B_r + N), B_r the forward block's rows
    k: bm * k[3] / (bm + k[3])
    for k in full_bf16
    for bm in [points[k]["fa_lib"]["configs"]["fwd"]["BLOCK_M"]]
}

bound = {k: float(attainable(tile[k])) for k in full_bf16}
at_bound = [k for k in full_bf16 if rate(k, "fa_lib", "fwd") / bound[k] > 0.995]
assert abs(ridge - 163.1) < 0.05

assert all(i > ridge for i, _ in fa) and all(t < MATMUL_TFLOPS for _, t in fa)
assert all(t < attainable(i) for i, t in nv)
closest = max(full_bf16, key=lambda k: rate(k, "fa_lib", "fwd") / bound[k])
near = {
    k: rate(k, "fa_lib", "fwd") / bound[k]
    for k in full_bf16
    if rate(k, "fa_lib", "fwd") / bound[k] > 0.98
}
assert all(points[k]["fa_lib"]["configs"]["fwd"]["BLOCK_M"] == 128 for k in full_bf16)
assert round(COPY_TBPS * 128) == 545 and [
    round(min(bound.values())),
    round(max(bound.values())),
] == [484, 541]
assert [round(min(t for _, t in fa)), round(max(t for _, t in fa))] == [398, 536]
assert closest == ("bf16", 128, False, 8192) and at_bound == [closest]

assert round(100 * rate(closest, "fa_lib", "fwd") / bound[closest], 1) == 100.0
assert (
    sorted(near) == [("bf16", 128, False, n) for n in (4096, 8192, 16384)]
    and min(near.values()) > 0.987
)

naive_frac = [t / attainable(i) for i, t in nv]
assert round(100 * min(naive_frac)) == 49 and round(100 * max(naive_frac)) == 78
assert (
    round(100 * min(t for _, t in fa) / MATMUL_TFLOPS) == 57
    and round(100 * max(t for _, t in fa) / MATMUL_TFLOPS) == 77
)

assert [len(fa), len(nv)] == [10, 10]
assert all(t <= attainable(i) for i, t in fa + nv)
mem = {}
for r in memory["rows"]:
    mem.setdefault(r["provider"], {})[r["n"]] = r["peak_bytes"]
shape = memory["shape"]
slopes = {}
for p in ("fa_lib", "sdpa_flash", "sdpa_math", "naive"):
    ok = {n: b for n, b in mem[p].items() if b is not None}
    slopes[p] = np.polyfit(np.log2(list(ok)), np.log2(list(ok.values())), 1)[0]
assert len(slopes) == len(mem) == 4
assert [sum(b is not None for b in mem[p].values()) for p in slopes] == [7, 7, 5, 5]
assert abs(slopes["fa_lib"] - 1) < 0.01 and abs(slopes["sdpa_flash"] - 1) < 0.01
assert abs(slopes["naive"] - 2) < 0.05 and abs(slopes["sdpa_math"] - 2) < 0.05
assert sorted(n for n, b in mem["naive"].items() if b is None) == [32768, 65536]
assert sorted(n for n, b in mem["sdpa_math"].items() if b is None) == [32768, 65536]
assert (
    round(mem["fa_lib"][32768] / 2**30, 3) == 0.504
    and round(mem["fa_lib"][65536] / 2**30, 3) == 1.008
)
assert round(env["memory_bytes"] / 2**30, 1) == 139.8
b, h, d = shape["b"], shape["h"], shape["d"]
for n, peak in mem["fa_lib"].items():
    assert peak == 4 * 2 * b * h * n * d + 2 * 4 * b * h * n
p_bytes = {n: 2 * b * h * n * n for n in mem["naive"]}
assert abs(mem["naive"][16384] / p_bytes[16384] - 4.016) < 0.001
assert round(mem["naive"][16384] / mem["fa_lib"][16384]) == 128
store = {r["n"]: r for r in experiments["store_p"] if r["strategy"] == "store_P"}
recomp = {r["n"]: r for r in experiments["store_p"] if r["strategy"] == "recompute_P"}
recompute_gain = {}
for n in sorted(store):
    s, r = store[n], recomp[n]
    recompute_gain[n] = (s["fwd_ms"] + s["bwd_ms"]) / (r["fwd_ms"] + r["bwd_ms"])
assert all(
    recomp[n]["bwd_ms"] < store[n]["bwd_ms"]
    and recomp[n]["fwd_ms"] < store[n]["fwd_ms"]
    for n in store
)
assert (
    round(min(recompute_gain.values()), 2) == 2.14 and round(max(recompute_gain.values()), 2) == 2.70
)
n = 16384
s = store[n]

t_read = s["p_bytes"] / (COPY_TBPS * 1e12) * 1e3

t_recompute = 2 * s["b"] * s["h"] * n * n * s["d"] / (MATMUL_TFLOPS * 1e12) * 1e3

earlier_ratio = EARLIER_MATMUL_TFLOPS / EARLIER_COPY_TBPS / s["d"]

share_time = {n: recomp[n]["fwd_ms"] / recomp[n]["bwd_ms"] for n in recomp}
assert (
    abs(t_read / t_recompute - ridge / s["d"]) < 1e-9
    and round(t_read / t_recompute, 2) == 1.27
)
assert round(earlier_ratio, 2) == 1.30
assert (
    round(100 * min(share_time.values()), 1) == 30.1
    and round(100 * max(share_time.values()), 1) == 32.4
)
ck = {(r["seq"], r["checkpoint"]): r for r in experiments["checkpointing"]}
slow, saved = {}, {}
for seq in (4096, 8192):
    base = ck[seq, "none"]
    for mode in ("none", "attention", "mlp", "block"):
        r = ck[seq, mode]
        slow[seq, mode] = r["step_ms"] / base["step_ms"] - 1
        saved[seq, mode] = 1 - r["peak_bytes"] / base["peak_bytes"]
seed_case = {
    seq: ck[seq, "block"]["step_ms"] / ck[seq, "mlp"]["step_ms"] - 1
    for seq in (4096, 8192)
}
pct = {k: round(100 * v, 1) for k, v in slow.items()}
assert [pct[s, "attention"] for s in (4096, 8192)] == [13.0, 14.3] and [
    pct[s, "mlp"] for s in (4096, 8192)
] == [8.8, 7.2]
assert [pct[s, "block"] for s in (4096, 8192)] == [22.8, 23.0]

assert [round(100 * seed_case[s], 1) for s in (4096, 8192)] == [12.8, 14.8]
assert [ck[s, "none"]["batch"] for s in (4096, 8192)] == [4, 2]

assert all(slow[s, "mlp"] < slow[s, "attention"] for s in (4096, 8192))
assert all(
    ck[4096, m]["peak_bytes"] == ck[8192, m]["peak_bytes"]
    for m in ("none", "attention", "mlp", "block")
)
assert [round(100 * saved[4096, m]) for m in ("attention", "mlp", "block")] == [
    31,
    41,
    66,
]

# The port from block pointers to plain pointers (port-*-nvidia-h200.json): best old time / best new
# time at the sweep's 40 points and four more, for the kernels shipped and three other forms.
port = {
    f: benchmarks.data.load_json(f"port-{f}-nvidia-h200.json")
    for f in ("comparison", "pointer-tiles", "recomputed-pointers", "descriptors")
}
for part in port.values():
    assert part["env"] == {"torch": env["torch"], "device": env["device"]}
assert (
    port["comparison"]["date"] == env["date"]
    and "--no-tuned" in port["comparison"]["method"]
)


def point_key(p):
    return (p["dtype"], p["d"], p["causal"], p["n"], p.get("hkv"))


def speedup(row, new, mode):
    """Best old time / best new time: above 1 the new kernels are faster."""
    return min(row["ms"]["old"][mode]) / min(row["ms"][new][mode])


OFF_SWEEP = {
    ("bf16", 256, False, 4096, None): "d = 256",
    ("bf16", 256, True, 4096, None): "d = 256, causal",
    ("bf16", 128, True, 4096, 4): "GQA 16/4, causal",
    ("bf16", 96, False, 4096, None): "d = 96",
}
keys = [point_key(r["point"]) for r in port["comparison"]["rows"]]
assert all(
    [point_key(r["point"]) for r in part["rows"]] == keys for part in port.values()
)
on_sweep = keys[:40]
assert [k[:4] for k in on_sweep] == list(points) and keys[40:] == list(OFF_SWEEP)
assert all(
    (r["point"]["b"], r["point"]["h"]) == (c["b"], c["h"])
    for r, c in zip(port["comparison"]["rows"], sweep["configs"])
)
reps = {
    (f, p): len(port[f]["rows"][0]["ms"][p]["fwd"])
    for f in port
    for p in port[f]["rows"][0]["ms"]
}
assert reps == {
    **{(f, p): 2 for f in port for p in ("old", "new")},
    ("pointer-tiles", "tuned"): 1,
    ("descriptors", "tuned"): 1,
}
sp = {
    (f, new, mode): {
        point_key(r["point"]): speedup(r, new, mode) for r in port[f]["rows"]
    }
    for f in port
    for new in port[f]["rows"][0]["ms"]
    if new != "old"
    for mode in ("fwd", "bwd")
}

PICKED = {False: "pointer-tiles", True: "recomputed-pointers"}
for mode in ("fwd", "bwd"):
    sp["by-mask", "new", mode] = {k: sp[PICKED[k[2]], "new", mode][k] for k in keys}

VARIANTS = (("descriptors", "new"), ("descriptors", "tuned"), ("by-mask", "new"), ("comparison", "new"))

assert all((f, new, mode) in sp for f, new in VARIANTS for mode in ("fwd", "bwd"))
assert all(len(sp[f, new, mode]) == len(keys) == 44 for f, new in VARIANTS for mode in ("fwd", "bwd"))
g = {v: geomean(sp[v][k] for k in on_sweep) for v in sp}
lo = {v: min(sp[v][k] for k in on_sweep) for v in sp}
hi = {v: max(sp[v][k] for k in on_sweep) for v in sp}
off = {(v, name): sp[v][k] for v in sp for k, name in OFF_SWEEP.items()}

desc = sp["descriptors", "new", "fwd"]
by_n = {n: geomean(desc[k] for k in on_sweep if k[3] == n) for n in NS}
assert (
    round(g["descriptors", "new", "fwd"], 2) == 0.93
    and round(lo["descriptors", "new", "fwd"], 2) == 0.77
)
assert min(on_sweep, key=desc.get) == ("bf16", 128, True, 1024, None)
assert [round(by_n[n], 2) for n in (1024, 16384)] == [0.85, 0.98] and list(
    by_n.values()
) == sorted(by_n.values())
assert [
    round(off[("descriptors", "new", "fwd"), s], 2)
    for s in ("d = 256", "d = 256, causal")
] == [0.61, 0.63]
assert [
    round(off[("descriptors", "tuned", "fwd"), s], 2)
    for s in ("d = 256", "d = 256, causal")
] == [1.17, 1.13]

assert [round(hi["descriptors", new, "fwd"], 2) for new in ("new", "tuned")] == [
    1.01,
    1.04,
]
assert round(g["descriptors", "new", "bwd"], 2) == 0.98 and [
    round(lo["descriptors", "new", "bwd"], 2),
    round(hi["descriptors", "new", "bwd"], 2),
] == [0.79, 1.06]

by_mask = {
    (f, mode, causal): geomean(
        sp[f, "new", mode][k] for k in on_sweep if k[2] == causal
    )
    for f in PICKED.values()
    for mode in ("fwd", "bwd")
    for causal in (False, True)
}
bm = {k: round(v, 2) for k, v in by_mask.items()}
assert [bm["pointer-tiles", m, False] for m in ("fwd", "bwd")] == [0.99, 1.00]
assert [bm["recomputed-pointers", m, False] for m in ("fwd", "bwd")] == [0.96, 0.96]
assert [bm["pointer-tiles", m, True] for m in ("fwd", "bwd")] == [1.01, 0.99]
assert [bm["recomputed-pointers", m, True] for m in ("fwd", "bwd")] == [1.03, 1.04]

assert all(
    by_mask[PICKED[c], m, c] > by_mask[PICKED[not c], m, c]
    for m in ("fwd", "bwd")
    for c in (False, True)
)
slow = {
    (k, m): sp["by-mask", "new", m][k]
    for k in keys
    for m in ("fwd", "bwd")
    if sp["by-mask", "new", m][k] < 0.975
}
slow_on = [v for (k, m), v in slow.items() if k in on_sweep]
assert len(slow_on) == 5 and [
    round(100 * (1 - max(slow_on))),
    round(100 * (1 - min(slow_on))),
] == [3, 8]
assert round(slow[("bf16", 128, True, 1024, None), "fwd"], 3) == 0.922
assert round(slow[("bf16", 96, False, 4096, None), "fwd"], 2) == 0.88
assert [round(g["by-mask", "new", m], 2) for m in ("fwd", "bwd")] == [1.01, 1.02]
assert [(k[1], m) for k, m in slow if k not in on_sweep] == [(256, "bwd"), (96, "fwd")]
assert round(slow[("bf16", 256, False, 4096, None), "bwd"], 2) == 0.97 and all(
    k[1] == 128 for k, m in slow if k in on_sweep
)

# Three ways of addressing the tiles (port-addressing-nvidia-h200.json), and the forward's blocks in two of
# them.
addressing = benchmarks.data.load_json("port-addressing-nvidia-h200.json")
assert (addressing["device"], addressing["torch"], addressing["triton"]) == (
    env["device"],
    env["torch"],
    env["triton"],
)
FORMS = ("T1", "R0", "I2")  # pointer tiles, 64-bit offsets, 32-bit offsets
assert (
    set(addressing["forms"]) == {"old", *FORMS}
    and "56a7977" in addressing["forms"]["old"]
)
assert all(
    len(r["ms"][f][m]) == 3
    for r in addressing["addressing"]
    for f in r["ms"]
    for m in ("fwd", "bwd")
)
sweep_shape = {k: (c["b"], c["h"]) for k, c in zip(points, sweep["configs"])}
form_sp = {
    (tuple(r["point"][:4]), f, m): speedup(r, f, m)
    for r in addressing["addressing"]
    for f in FORMS
    for m in ("fwd", "bwd")
}
apoints = [tuple(r["point"][:4]) for r in addressing["addressing"]]
a_sweep = [
    k
    for k, r in zip(apoints, addressing["addressing"])
    if sweep_shape.get(k) == tuple(r["point"][4:])
]
a_off = {("bf16", 96, False, 4096): "d = 96", ("bf16", 256, False, 4096): "d = 256"}
assert [k for k in apoints if k not in a_sweep] == list(a_off)
a_mask = {c: [k for k in a_sweep if k[2] == c] for c in (False, True)}

form_g = {
    (f, m, c): geomean(form_sp[k, f, m] for k in a_mask[c])
    for f in FORMS
    for m in ("fwd", "bwd")
    for c in (False, True)
}

SHIPPED = {
    (False, "fwd"): "I2",
    (False, "bwd"): "I2",
    (True, "fwd"): "R0",
    (True, "bwd"): "I2",
}

behind = {
    (k, m): max(form_sp[k, f, m] for f in FORMS) / form_sp[k, "I2", m] - 1
    for k in apoints
    for m in ("fwd", "bwd")
}
causal_fwd = {
    k: form_sp[k, "R0", "fwd"] / form_sp[k, "I2", "fwd"] - 1 for k in a_mask[True]
}
fg = {k: round(v, 3) for k, v in form_g.items()}
assert len(a_mask[False]) == 8 and len(a_mask[True]) == 4
assert [fg["I2", "fwd", False], fg["T1", "fwd", False], fg["R0", "fwd", False]] == [
    1.040,
    0.987,
    0.943,
]

assert [fg[f, "bwd", False] for f in FORMS] == [1.003, 1.003, 1.003]
assert [fg["R0", "fwd", True], fg["I2", "fwd", True], fg["T1", "fwd", True]] == [
    1.039,
    1.030,
    1.008,
]
assert [fg["I2", "bwd", True], fg["T1", "bwd", True], fg["R0", "bwd", True]] == [
    1.054,
    1.044,
    1.019,
]
assert all(
    max(FORMS, key=lambda f: form_g[f, m, c]) == SHIPPED[c, m]
    for c, m in SHIPPED
    if (c, m) != (False, "bwd")
)
assert (
    round(100 * max(v for (k, m), v in behind.items() if not (k[2] and m == "fwd")), 1)
    == 3.2
)
assert max(behind, key=behind.get) == (("fp16", 128, False, 4096), "bwd")

assert all(behind[k, "fwd"] == 0 for k in apoints if not k[2])
assert [round(100 * causal_fwd[k], 1) for k in a_mask[True]] == [
    0.5,
    2.6,
    2.7,
    -2.1,
] and a_mask[True][3][1] == 64
assert [round(form_sp[k, f, "fwd"], 3) for k in a_off for f in ("I2", "T1", "R0")] == [
    0.952,
    0.896,
    0.846,
    1.142,
    1.011,
    0.894,
]
bt = {
    k: max(form_sp[k, f, m] for f in FORMS) / min(form_sp[k, f, m] for f in FORMS) - 1
    for k in apoints
    for m in ("bwd",)
}
assert round(100 * max(bt.values()), 1) == 6.4

blocks = addressing["forward_blocks"]["rows"]
best_cfg = {
    (tuple(r["point"][:4]), form): max(
        (c for c in r["ms"] if c.endswith(form)),
        key=lambda c: min(r["ms"]["old"]) / min(r["ms"][c]),
    )
    for r in blocks
    for form in "TR"
}
best_sp = {
    (tuple(r["point"][:4]), form): (
        min(r["ms"]["old"]) / min(r["ms"][best_cfg[tuple(r["point"][:4]), form]])
    )
    for r in blocks
    for form in "TR"
}
old_cfg = {
    tuple(r["point"][:4]): "{BLOCK_M}x{BLOCK_N}w{num_warps}s{num_stages}".format(
        **dict(kv.split(": ") for kv in r["old_config"].split(", "))
    )
    for r in blocks
}
n_cfg = {len([c for c in r["ms"] if c != "old"]) // 2 for r in blocks}
same = [
    k
    for k in old_cfg
    if best_cfg[k, "T"] == old_cfg[k] + "T" and best_cfg[k, "R"] == old_cfg[k] + "R"
]
no_mask_128 = [k for k in old_cfg if not k[2] and k[1] == 128]
assert (
    len(blocks) == 11
    and len(same) == 9
    and all(k[1] == 96 for k in old_cfg if k not in same)
)
assert (
    len(no_mask_128) == 5
    and max(best_sp[k, f] for k in no_mask_128 for f in "TR") < 1.002
)
assert [
    round(min(best_sp[k, "T"] for k in no_mask_128), 3),
    round(max(best_sp[k, "R"] for k in no_mask_128), 3),
] == [0.973, 0.954]
assert [round(best_sp[("bf16", 96, False, 4096), f], 3) for f in "TR"] == [0.931, 0.847]
assert [
    round(max(best_sp[k, "T"] for k in no_mask_128), 3),
    round(min(best_sp[k, "R"] for k in no_mask_128), 3),
] == [1.001, 0.934]
assert sorted(n_cfg) == [7, 8]
outside = [v for (k, m), v in behind.items() if not (k[2] and m == "fwd")]
assert (sum(v == 0 for v in outside), len(outside)) == (17, 24)
fwd, bwd = sp["comparison", "new", "fwd"], sp["comparison", "new", "bwd"]
spread = {
    (p, mode, k): max(r["ms"][p][mode]) / min(r["ms"][p][mode]) - 1
    for r in port["comparison"]["rows"]
    for k in [point_key(r["point"])]
    for p in ("old", "new")
    for mode in ("fwd", "bwd")
}
low = min(on_sweep, key=fwd.get)

agree = {
    (k, m): points[k[:4]]["fa_lib"][f"{m}_ms"] / min(r["ms"]["new"][m])
    for k, r in zip(on_sweep, port["comparison"]["rows"])
    for m in ("fwd", "bwd")
}
rest = [v for (k, m), v in agree.items() if (k[:4], m) != (AGAIN, "fwd")]
again_row = port["comparison"]["rows"][on_sweep.index((*AGAIN, None))]
again_tflops = again_row["tflops"]["new"]["fwd"]
drift = {
    (a, b): [
        min(ra["ms"]["old"][m]) / min(rb["ms"]["old"][m])
        for ra, rb in zip(port[a]["rows"], port[b]["rows"])
        for m in ("fwd", "bwd")
    ]
    for a in port
    for b in port
    if a < b
}

assert round(g["comparison", "new", "fwd"], 3) == 1.045 and [
    round(lo["comparison", "new", "fwd"], 3),
    round(hi["comparison", "new", "fwd"], 3),
] == [0.978, 1.154]
assert round(g["comparison", "new", "bwd"], 3) == 1.038 and [
    round(lo["comparison", "new", "bwd"], 3),
    round(hi["comparison", "new", "bwd"], 3),
] == [0.998, 1.109]
assert [k for k in on_sweep if fwd[k] < 1] == [low] and low == (
    "fp16",
    64,
    False,
    4096,
    None,
)
assert sorted(k[:4] for k in on_sweep if bwd[k] < 1) == [
    ("bf16", 128, False, 2048),
    ("fp16", 64, True, 16384),
]
assert min(bwd[k] for k in on_sweep) > 0.997
assert [round(100 * spread[p, "fwd", low], 1) for p in ("new", "old")] == [
    12.8,
    5.7,
] and min(spread[p, "fwd", low] for p in ("new", "old")) > 1 - fwd[low]
assert (
    round(100 * np.median(list(spread.values())), 1) == 1.1
    and round(100 * max(spread.values()), 1) == 16.3
)
assert [round(fwd[k], 2) for k in OFF_SWEEP] == [1.13, 1.16, 1.06, 0.96] and [
    round(bwd[k], 2) for k in OFF_SWEEP
] == [1.03, 1.08, 1.02, 1.01]
assert (
    round(fwd["bf16", 96, False, 4096, None], 3) == 0.961
    and round(sp["by-mask", "new", "fwd"]["bf16", 96, False, 4096, None], 3) == 0.883
)

assert all(sp["comparison", "new", m][k] > 0.96 for k, m in slow)
assert (
    round(min(sp["comparison", "new", m][k] for k, m in slow if k in on_sweep), 3)
    == 0.998
)
assert [round(min(rest), 2), round(max(rest), 2)] == [0.94, 1.06] and round(
    agree[(*AGAIN, None), "fwd"], 2
) == 1.21
assert round(again_tflops) == 327
assert round(100 * (1 - fwd[low]), 1) == 2.2
assert round(sp["comparison", "new", "fwd"]["bf16", 128, True, 1024, None], 3) == 1.148
assert [
    round(min(min(v) for v in drift.values()), 2),
    round(max(max(v) for v in drift.values()), 2),
] == [0.90, 1.12]

# The matrix products per tile pair, read from the backward kernels' source: seven in two passes, five in
# one; the one-pass dQ's read-modify-write against the products it saves, at the measured ceilings.
NAMES = {"qkT": "S", "qk": "S", "dv": "dV", "dpT": "dP", "dp": "dP", "dk": "dK",
         "dq": "dQ"}


def products(fn):
    found = []

    def walk(node, atomic):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "HEAD_DIM2" in ast.unparse(child.test):
                continue
            inner = atomic or (
                isinstance(child, ast.If) and "ATOMIC_DQ" in ast.unparse(child.test)
            )
            if isinstance(child, ast.Assign) and any(
                isinstance(n, ast.Call) and ast.unparse(n.func) == "_dot"
                for n in ast.walk(child.value)
            ):
                found.append((NAMES[child.targets[0].id], atomic))
            walk(child, inner)

    source = inspect.getsource(fn.fn)
    assert "tl.dot" not in source
    walk(ast.parse(source), False)
    return found


dkdv = products(kernels._attn_bwd_dkdv_inner)
dq = products(kernels._attn_bwd_dq_inner)
rows = {
    "two passes: dK/dV kernel": [g for g, a in dkdv if not a],
    "two passes: dQ kernel": [g for g, a in dq],
    "one pass: dK/dV kernel, ATOMIC_DQ": [g for g, a in dkdv],
}
TWO_PASS = len(rows["two passes: dK/dV kernel"]) + len(rows["two passes: dQ kernel"])
ONE_PASS = len(rows["one pass: dK/dV kernel, ATOMIC_DQ"])
assert rows["two passes: dK/dV kernel"] == ["S", "dV", "dP", "dK"]
assert rows["two passes: dQ kernel"] == ["S", "dP", "dQ"]
assert rows["one pass: dK/dV kernel, ATOMIC_DQ"] == ["S", "dV", "dP", "dK", "dQ"]
assert (TWO_PASS, ONE_PASS) == (7, 5) and TWO_PASS / ONE_PASS == 1.4

max_len, _, (BR, BC, _, _) = kernels.DEFAULT_TABLE["dkdv"][(2, 128)][-1]
assert max_len >= 16384 and (BR, BC) == (64, 128)
d_t = 128
tile_flops = ONE_PASS * 2 * BR * BC * d_t
saved_flops = (TWO_PASS - ONE_PASS) * 2 * BR * BC * d_t
sent = 4 * BR * d_t
rmw = 2 * sent
intensity = tile_flops / rmw
t_saved = saved_flops / (MATMUL_TFLOPS * 1e12) * 1e9
t_rmw = rmw / (COPY_TBPS * 1e12) * 1e9
t_tile = tile_flops / (MATMUL_TFLOPS * 1e12) * 1e9
assert intensity == 1.25 * BC == 160 and round(ridge, 1) == 163.1
assert [round(tile_flops / 1e6, 1), round(saved_flops / 1e6, 1)] == [10.5, 4.2]
assert (sent, rmw) == (32 * 1024, 64 * 1024)
assert [round(t_saved, 1), round(t_rmw, 1)] == [6.0, 15.4]
assert round(t_rmw / t_saved, 1) == 2.5
assert round(t_tile, 1) == 15.1

# One pass against two (onepass-nvidia-h200.json): backward times of five modes at seven cases.
onepass = benchmarks.data.load_json("onepass-nvidia-h200.json")
oenv = onepass["environment"]
assert onepass["part"] == "onepass" and oenv["date"] == "2026-12-01"

assert onepass["settings"] == {"concurrent_backward": True} and fa_lib.options.DEFAULT.concurrent_backward
assert same_stack(onepass)

MODES = [name for name, _, _ in bench.ONEPASS_MODES]
cases = onepass["points"]
assert [
    (c["label"], c["n"], c["b"], c["hq"], c["hkv"], c["d"]) for c in cases
] == [case[:6] for case in bench.ONEPASS_CASES]
assert all(list(c["modes"]) == MODES for c in cases)
assert all(c["b"] * c["n"] == 16384 for c in cases)


def case_name(c):
    return f"{c['label']} {c['n'] // 1024}k"


def picks_one_pass(c):
    """What `deterministic=False` does at this case by default: fa_lib's own rule."""
    q = torch.empty(c["b"], c["hq"], c["n"], c["d"], device="meta")
    k = torch.empty(c["b"], c["hkv"], c["n"], c["d"], device="meta")
    causal, local, _, _ = ops._band(c.get("causal", False), tuple(c.get("window", (-1, -1))))
    return ops._one_pass_mode(q, k, c["d"], c["n"], causal=causal, local=local) != 0


assert fa_lib.options.DEFAULT.one_pass_backward == "auto"
ms = {case_name(c): {m: r["bwd_ms"] for m, r in c["modes"].items()} for c in cases}
auto_one = {case_name(c): picks_one_pass(c) for c in cases}
best_two = {n: min(t["two_pass_fixed"], t["two_pass_tuned"]) for n, t in ms.items()}

fastest = {name: min(MODES[:4], key=t.get) for name, t in ms.items()}
tma_gain = {name: t["two_pass_fixed"] / t["one_pass_tma"] for name, t in ms.items()}
diff = {m: max(c["modes"][m]["max_diff"] for c in cases) for m in MODES}

one_pass_won = {name: ms[name]["one_pass_tma"] < best_two[name] for name in ms}

assert all(c["d"] in (64, 128) for c in cases)

assert all(max(MODES, key=t.get) == "one_pass_atomic_add" for t in ms.values())
assert fastest == {
    "causal 4k": "two_pass_fixed", "causal 16k": "one_pass_tma",
    "full 4k": "two_pass_tuned", "full 16k": "two_pass_fixed",
    "window1023 16k": "two_pass_fixed", "gqa32/8-causal 8k": "two_pass_fixed",
    "d64-causal 8k": "two_pass_tuned",
}
assert [round(g, 3) for g in tma_gain.values()] == [
    0.899, 1.039, 1.015, 0.991, 0.921, 0.904, 0.899]
assert [round(ms["causal 16k"][m], 2) for m in MODES] == [7.0, 7.18, 8.41, 6.74, 6.74]
d64 = ms["d64-causal 8k"]
assert [round(d64["two_pass_fixed"], 2), round(d64["one_pass_tma"], 2)] == [4.41, 4.91]

assert all(one_pass_won[n] for n in ms if auto_one[n])
assert not any(auto_one[n] for n in ms if not one_pass_won[n])
assert [n for n in ms if auto_one[n]] == ["causal 16k"] == [n for n in ms if one_pass_won[n]]

assert round(best_two["full 16k"] / ms["full 16k"]["one_pass_tma"], 3) == 0.991
assert ms["full 16k"]["one_pass_tma"] < ms["full 16k"]["two_pass_tuned"]
assert [round(v, 4) for v in diff.values()] == [0, 0.002, 0.002, 0.002, 0.002]
atomic_vs_fixed = {
    n: t["one_pass_atomic_add"] / t["two_pass_fixed"] for n, t in ms.items()
}
auto_gain = {n: t["two_pass_fixed"] / t["auto"] for n, t in ms.items()}
assert max(atomic_vs_fixed, key=atomic_vs_fixed.get) == "gqa32/8-causal 8k"
assert round(max(atomic_vs_fixed.values()), 2) == 1.42
assert round(ms["gqa32/8-causal 8k"]["one_pass_tma"], 2) == 8.07
assert round(ms["gqa32/8-causal 8k"]["two_pass_fixed"], 2) == 7.30
assert [round(auto_gain[n], 3) for n in ms if auto_one[n]] == [1.039]
assert [round(auto_gain[n], 3) for n in ("causal 4k", "full 4k")] == [0.938, 1.036]
vs_fixed = {m: [t["two_pass_fixed"] / t[m] for t in ms.values()] for m in MODES}  # speed / deterministic=True's
assert sum(map(len, vs_fixed.values())) == 35 and list(vs_fixed) == MODES
assert all(h < 1 for h in vs_fixed["one_pass_atomic_add"])
assert [round(h, 3) for h in vs_fixed["one_pass_tma"]] == [
    round(g, 3) for g in tma_gain.values()]
assert sum(h > 1 for h in vs_fixed["one_pass_tma"]) == 2
assert all(0.6 < h < 1.15 for hs in vs_fixed.values() for h in hs)

# Head dims 96 and 256 (sweep-d96-d256-nvidia-h200.json) and the d = 256 block probe
# (configs-d256-nvidia-h200.json); the extended sweep's base file; the Nsight Compute profile.
more = benchmarks.data.load_json("sweep-d96-d256-nvidia-h200.json")
probe = benchmarks.data.load_json("configs-d256-nvidia-h200.json")
ext = benchmarks.data.load_json("extended-nvidia-h200.json")
prof = benchmarks.data.load_json("profile-nvidia-h200.json")
for part in (more, ext, prof):
    assert same_stack(part)
penv = probe["environment"]
assert (penv["device"], penv["triton"]) == (env["device"], env["triton"])
assert env["torch"].startswith(penv["torch"])
assert {p["environment"]["date"] for p in (more, probe, ext, prof)} == {"2026-12-01"}
note = more["note"]
assert triton.next_power_of_2(96) == 128
assert "--d 96 256 --n 1024 4096 16384 --dtypes bf16" in note


def by_provider(rows):
    return {r["provider"]: r for r in rows}


OTHERS = {"sdpa_flash": "FA2", "sdpa_cudnn": "cuDNN"}

vs = {}
for c in more["configs"]:
    r = by_provider(c["rows"])
    for mode in ("fwd", "bwd"):
        for other in OTHERS:
            vs[c["d"], c["causal"], c["n"], mode, other] = (
                r[other][f"{mode}_ms"] / r["fa_lib"][f"{mode}_ms"]
            )
more_keys = [(c["d"], c["causal"], c["n"]) for c in more["configs"]]
assert sorted(more_keys) == sorted(
    (d, c, n) for d in (96, 256) for c in (False, True) for n in (1024, 4096, 16384)
)
assert all(c["b"] * c["n"] == 16384 and c["dtype"] == "bf16" for c in more["configs"])
assert [c["h"] for c in more["configs"]] == [21] * 6 + [8] * 6

misses = {k: x for k, x in vs.items() if k[4] == "sdpa_flash" and x < 1}


def span(d, mode, other):
    xs = [x for k, x in vs.items() if k[0] == d and k[3] == mode and k[4] == other]
    return min(xs), max(xs)


assert len(misses) == 12 and 2 * len(more_keys) == 24
worst = min((k for k in misses if k[3] == "bwd"), key=misses.get)
assert worst[:3] == (256, False, 16384)
assert [round(x, 3) for k, x in misses.items() if k[0] == 96] == [
    0.962, 0.995, 0.812, 0.932, 0.996]
assert [(k[1], k[2], k[3]) for k, x in misses.items() if k[0] == 96] == [
    (False, 1024, "fwd"), (False, 4096, "bwd"), (True, 1024, "fwd"),
    (True, 4096, "fwd"), (True, 16384, "fwd")]

assert [k[3] for k in misses if k[0] == 256] == ["fwd"] + ["bwd"] * 6
assert [round(x, 2) for x in span(256, "bwd", "sdpa_flash")] == [0.67, 0.91]
assert [round(x, 2) for x in span(256, "fwd", "sdpa_flash")] == [0.96, 1.60]
assert round(misses[256, False, 1024, "fwd", "sdpa_flash"], 3) == 0.958
assert round(min(x for k, x in vs.items() if k[0] == 256 and k[3:] == (
    "fwd", "sdpa_flash") and k[1:3] != (False, 1024)), 2) == 1.04
assert [round(x, 2) for x in span(96, "bwd", "sdpa_flash")] == [0.99, 1.25]

assert all(x < 1 for k, x in vs.items() if k[4] == "sdpa_cudnn")
assert [round(x, 2) for x in span(256, "bwd", "sdpa_cudnn")] == [0.48, 0.55]
assert [round(x, 2) for x in span(96, "fwd", "sdpa_cudnn")] == [0.60, 0.82]
vs_fa2 = {(k, m): vs[k + (m, "sdpa_flash")] for m in ("fwd", "bwd") for k in more_keys}
below = [key for key, x in vs_fa2.items() if x < 1]
assert len(vs_fa2) == 24 and len(below) == 12
assert all((k, "bwd") in below for k in more_keys if k[0] == 256)
assert [k for k, m in below if m == "bwd" and k[0] == 96] == [(96, False, 4096)]
assert all(0.5 < x < 1.7 for x in vs_fa2.values())

t_probe = {
    (p["kernel"], p["config"] and tuple(p["config"]), p["n"], p["causal"]): p["ms"]
    for p in probe["probe"]
}
probe_points = list(dict.fromkeys((n, c) for _, _, n, c in t_probe))
OLD = {"fwd": (128, 64, 8, 2), "dkdv": (32, 64, 8, 2), "dq": (64, 32, 8, 2)}
assert probe_points == [(1024, True), (4096, False), (16384, True)]
assert all(f"{k} {v}" in probe["convention"] for k, v in OLD.items())
rel = {}
for (kernel, blocks, n, causal), ms in t_probe.items():
    rel[kernel, blocks, n, causal] = ms / t_probe[kernel, None, n, causal]
geo = {
    (kernel, blocks): geomean(rel[kernel, blocks, n, c] for n, c in probe_points)
    for kernel, blocks, _, _ in rel
}
for (kernel, blocks), g in geo.items():
    assert abs(probe["best"][kernel]["all"][str(blocks)] - g) < 1e-12
best = {k: min((b for kk, b in geo if kk == k), key=lambda b: geo[k, b]) for k in OLD}

cut = {(n, c): 1 - rel["dq", best["dq"], n, c] for n, c in probe_points}

((_, _, table_dq),) = kernels.DEFAULT_TABLE["dq"][(2, 256)]
((_, _, table_dkdv),) = kernels.DEFAULT_TABLE["dkdv"][(2, 256)]
((_, _, table_fwd),) = kernels.DEFAULT_TABLE["fwd"][(2, 256)]
assert best == {"fwd": None, "dkdv": None, "dq": (128, 32, 8, 1)}
assert table_dq == best["dq"] and str(table_dq) == probe["best"]["dq"]["config"]
assert (table_fwd, table_dkdv) == (OLD["fwd"], OLD["dkdv"])
assert round(geo["dq", best["dq"]], 3) == 0.776
assert [round(100 * x, 1) for x in cut.values()] == [20.5, 22.6, 24.2]
assert [round(t_probe["dq", b, 16384, True], 1) for b in (None, best["dq"])] == [
    19.2, 14.6]

dkdv_geo = {b: g for (k, b), g in geo.items() if k == "dkdv" and b}
assert min(dkdv_geo, key=dkdv_geo.get) == (32, 32, 4, 2) and len(dkdv_geo) == 6
assert round(dkdv_geo[32, 32, 4, 2], 3) == 1.096
assert max(b[1] for b in dkdv_geo) == 64
faster = [(b, n) for (k, b, n, c), x in rel.items() if k == "dkdv" and x < 1]
assert faster == [((64, 64, 8, 1), 4096)]
assert round(rel["dkdv", (64, 64, 8, 1), 4096, False], 3) == 0.998

for c in more["configs"]:
    blocks = by_provider(c["rows"])["fa_lib"]["configs"]["dq"]
    assert (c["d"] != 256) or tuple(blocks.values()) == table_dq
assert round(geo["dq", (64, 64, 8, 1)], 3) == 0.942

for n, c in probe_points:
    r = by_provider(next(x for x in more["configs"]
                         if (x["d"], x["causal"], x["n"]) == (256, c, n))["rows"])
    assert abs(r["fa_lib"]["bwd_ms"] / t_probe["dq", best["dq"], n, c] - 1) < 0.01
assert [round(by_provider(c["rows"])[p]["bwd_ms"], 2) for p in ("fa_lib", "sdpa_flash")
        for c in more["configs"] if (c["d"], c["causal"], c["n"]) == (256, True, 16384)
        ] == [14.55, 10.82]

# The extended sweep's base file (extended-nvidia-h200.json): 224 points, fa_lib against FA2 and cuDNN.
ext_points = ext["points"]
planned = list(bench.extended_points())
assert [bench.ext_key(p) for p in ext_points] == [bench.ext_key(p) for p in planned]
assert all(p["ratio"] == bench.ext_ratios(p) for p in ext_points)
noted = [p for p in ext_points if "note" in p]
untimed = [p for p in ext_points if "timing" not in p]
assert len(ext_points) == 224 and len(noted) == 2
assert all("before the eager-call host-cost change" in p["note"] for p in noted)
assert {(p["kind"], p["d"], p["causal"]) for p in noted} == {("prefill", 256, True),
                                                          ("small", 256, True)}

assert sorted((p["kind"], p["dtype"], p["d"], p["nq"]) for p in untimed) == sorted(
    [("gqa", "bf16", 128, 4096)] * 2 + [("gqa", "bf16", 128, 16384)] * 2)
assert {(t["warmup_ms"], t["rep_ms"]) for p in ext_points if "timing" in p
        for t in [p["timing"]]} == {(10.0, 50.0)}


def best(p, other, mode):
    return p["ratio"][f"{other}_{mode}_best_path"]


def count_at_fa2(points):
    """How many points fa_lib (its faster path) is at least as fast as FlashAttention-2, by pass."""
    return {m: sum(best(p, "sdpa_flash", m) >= 1 for p in points) for m in ("fwd", "bwd")}


def of_cudnn(points):
    """fa_lib's speed over cuDNN's (its faster path), geometric mean over the points, by pass."""
    return {m: geomean(best(p, "sdpa_cudnn", m) for p in points) for m in ("fwd", "bwd")}


def of_cudnn_all(points):
    """The same over both passes together."""
    return geomean(best(p, "sdpa_cudnn", m) for p in points for m in ("fwd", "bwd"))


def core_points(points):
    """The points the cuDNN comparison is quoted at: d = 128, bf16, square and GQA, N >= 4k."""
    return [p for p in points if (p["d"], p["dtype"]) == (128, "bf16") and p["kind"] in ("square", "gqa")
            and p["nq"] >= 4096]


def standing(parts):
    """The extended sweep with `parts` in place: its points, the counts at or above FA2, the geometric means
    against cuDNN (by pass and over both), the d = 128, bf16, N >= 4k ratios to cuDNN, and the points below FA2."""
    pts = bench.extended_sweep(parts=parts)["points"]
    count = count_at_fa2(pts)
    geo = of_cudnn(pts)
    geo_all = of_cudnn_all(pts)
    core = core_points(pts)
    misses = {m: [(p["kind"], p["dtype"], p["d"], "causal" if p["causal"] else "full",
                   round(best(p, "sdpa_flash", m), 2)) for p in pts if best(p, "sdpa_flash", m) < 1]
              for m in ("fwd", "bwd")}
    return (pts, count, geo, geo_all, [best(p, "sdpa_cudnn", "fwd") for p in core],
            [best(p, "sdpa_cudnn", "bwd") for p in core], misses["fwd"], misses["bwd"])


count = {
    (path, m): sum(p["ratio"][f"sdpa_flash_{m}{path}"] >= 1 for p in ext_points)
    for path in ("", "_best_path") for m in ("fwd", "bwd")
}
cudnn_geo = of_cudnn_all(ext_points)
core = core_points(ext_points)
core_span = {m: (min(best(p, "sdpa_cudnn", m) for p in core),
                 max(best(p, "sdpa_cudnn", m) for p in core)) for m in ("fwd", "bwd")}
assert [count[k] for k in count] == [187, 150, 188, 155]
assert round(cudnn_geo, 2) == 0.73 and len(core) == 16
assert [round(x, 2) for x in core_span["fwd"] + core_span["bwd"]] == [
    0.70, 0.92, 0.69, 0.77]
assert not any(best(p, "sdpa_cudnn", m) >= 0.95 for p in core for m in ("fwd", "bwd"))
KINDS = ("square", "gqa", "prefill", "small")
ext_vs_fa2 = {m: [best(p, "sdpa_flash", m) for p in ext_points if p["kind"] in KINDS] for m in ("fwd", "bwd")}
below = {m: [p for p in ext_points if best(p, "sdpa_flash", m) < 1] for m in ("fwd", "bwd")}
assert sum(map(len, ext_vs_fa2.values())) == 2 * 224
assert sum(x < 1 for x in ext_vs_fa2["fwd"]) == len(below["fwd"]) == 36
assert sum(x < 1 for x in ext_vs_fa2["bwd"]) == len(below["bwd"]) == 69
assert all(0.3 < x < 2 for xs in ext_vs_fa2.values() for x in xs)
assert all(best(p, "sdpa_flash", "bwd") < 1 for p in ext_points
           if p["d"] == 256 and p["kind"] in ("square", "gqa"))


def group(p, m):
    if p["kind"] == "small":
        return "small batches (64 x 256)"
    if p["kind"] == "prefill":
        return f"prefill, d = {p['d']}"
    if p["kind"] in ("square", "gqa") and p["d"] == 96:
        return "d = 96, square and GQA"
    if p["kind"] in ("square", "gqa") and p["d"] == 256 and m == "bwd":
        return "d = 256 backward, square and GQA"
    return "other"


REASON = {
    "d = 256 backward, square and GQA": "dK/dV kernel spills registers"
                                        " (d256-causal-4k)",
    "d = 96, square and GQA": "tiles 128 wide for 96 columns (d96-causal-4k,"
                              " forward)",
    "small batches (64 x 256)": "host time per call longer than the kernel"
                                " (small-64x256)",
    "prefill, d = 96": "as d = 96 (not profiled at this shape)",
    "prefill, d = 256": "as d = 256 (not profiled at this shape)",
    "other": "none measured",
}
miss = {}
for p in ext_points:
    for m in ("fwd", "bwd"):
        if best(p, "sdpa_flash", m) < 1:
            miss.setdefault(group(p, m), {}).setdefault(m, []).append(
                best(p, "sdpa_flash", m))
counts = {g: (len(r.get("fwd", [])), len(r.get("bwd", []))) for g, r in miss.items()}
stray = [(bench.ext_key(p), m, round(best(p, "sdpa_flash", m), 3)) for p in ext_points
         for m in ("fwd", "bwd") if best(p, "sdpa_flash", m) < 1
         and group(p, m) == "other"]
assert set(miss) == set(REASON)
assert counts == {"d = 256 backward, square and GQA": (0, 48),
                  "d = 96, square and GQA": (21, 13), "small batches (64 x 256)": (8, 0),
                  "prefill, d = 96": (0, 4),
                  "prefill, d = 256": (4, 4), "other": (3, 0)}
assert sum(map(sum, counts.values())) == 36 + 69

assert sum(p["kind"] in ("square", "gqa") and p["d"] == 256 for p in ext_points) == 48
assert all(best(p, "sdpa_flash", "bwd") >= 1 for p in ext_points
           if p["kind"] == "small")
assert [(k[0], k[1], k[2], k[3], k[7], m) for k, m, _ in stray] == [
    ("gqa", "bf16", 64, True, 1024, "fwd"), ("gqa", "bf16", 256, True, 1024, "fwd"),
    ("square", "fp16", 128, True, 1024, "fwd")]
assert [x for _, _, x in stray] == [0.935, 0.732, 0.982]
d96_fwd = miss["d = 96, square and GQA"]["fwd"]
d256_bwd = miss["d = 256 backward, square and GQA"]["bwd"]
assert [round(min(d256_bwd), 2), round(max(d256_bwd), 2)] == [0.64, 0.93]
assert [round(min(d96_fwd), 3), round(max(d96_fwd), 3)] == [0.812, 0.998]

# The profile (profile-nvidia-h200.json): the main kernel's readings at six shapes, host time per call.
pts_prof = {p["name"]: p for p in prof["points"]}
assert list(pts_prof) == [p["name"] for p in bench_profile.POINTS]
assert set(bench_profile.PROFILE_PROVIDERS) == {r["provider"] for r in prof["regions"]}
assert prof["convention"].startswith("ncu --clock-control none")
TENSOR = "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"
LOCAL_LD = "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum"
region = {(r["point"], r["provider"], r["mode"]): r for r in prof["regions"]}
assert len(region) == 6 * 4 * 2


def main_kernel(point, provider, mode):
    """The pass's longest kernel, with all its readings."""
    return max(region[point, provider, mode]["kernels"], key=lambda k: k["ms"])


for r in prof["regions"]:
    assert r["summary"]["main_kernel"]["kernel"] == main_kernel(
        r["point"], r["provider"], r["mode"])["kernel"]

track = {}
for name in ("d128-full-8k", "d128-causal-8k", "d256-causal-4k", "d96-causal-4k",
             "prefill-512x8k"):
    f, c = main_kernel(name, "fa_lib", "fwd"), main_kernel(name, "sdpa_cudnn", "fwd")
    track[name] = (c["ms"] / f["ms"], f[TENSOR] / c[TENSOR])
f, c = main_kernel("d128-full-8k", "fa_lib", "fwd"), main_kernel(
    "d128-full-8k", "sdpa_cudnn", "fwd")
sms = prof["environment"]["sm_count"]
assert (f["block_size"], f["registers"], f["smem_per_block"]) == (256, 244, 230400)
assert f["theoretical_occupancy_pct"] == 12.5 and f["blocks_limit_registers"] == 1
assert (f["grid_size"], round(f["waves"], 2)) == (2048, 15.52)
assert (c["block_size"], c["registers"], c["grid_size"]) == (384, 168, sms)
assert c["block_size"] // 128 == 3 and c["theoretical_occupancy_pct"] == 18.75
assert [round(x, 1) for x in (f[TENSOR], c[TENSOR])] == [55.4, 76.5]
k2 = [main_kernel("d128-causal-8k", p, "fwd")[TENSOR] for p in ("fa_lib", "sdpa_cudnn")]
assert [round(x, 1) for x in k2] == [49.0, 73.1]
assert [round(x, 2) for x in track["d128-full-8k"]] == [0.77, 0.72]
assert [round(x, 2) for x in track["d128-causal-8k"]] == [0.71, 0.67]

assert all(0 < s - t < 0.07 for s, t in track.values())

assert all(main_kernel(n, "sdpa_cudnn", m)["registers"] == 168 for n in pts_prof
           for m in ("fwd", "bwd"))
b128 = {p: main_kernel("d128-full-8k", p, "bwd")[TENSOR]
        for p in ("fa_lib", "sdpa_cudnn")}
dq128 = max(k[TENSOR] for k in region["d128-full-8k", "fa_lib", "bwd"]["kernels"])
assert [round(x, 1) for x in (b128["fa_lib"], dq128, b128["sdpa_cudnn"])] == [
    52.8, 71.5, 66.8]
ours = region["d256-causal-4k", "fa_lib", "bwd"]
dkdv = next(k for k in ours["kernels"] if k["kernel"] == "_attn_bwd_dkdv")
dq = next(k for k in ours["kernels"] if k["kernel"] == "_attn_bwd_dq")
fa2 = main_kernel("d256-causal-4k", "sdpa_flash", "bwd")
same128 = next(k for k in region["d128-causal-8k", "fa_lib", "bwd"]["kernels"]
               if k["kernel"] == "_attn_bwd_dkdv")
share = dkdv["ms"] / ours["summary"]["kernel_ms"]
fa2_ms = region["d256-causal-4k", "sdpa_flash", "bwd"]["summary"]["kernel_ms"]
sweep_pt = next(p for p in ext_points if bench.ext_key(p) == (
    "square", "bf16", 256, True, 4, 8, 8, 4096, 4096))
assert (dkdv["registers"], fa2["registers"]) == (255, 255) and fa2[LOCAL_LD] == 0
assert round(dkdv[LOCAL_LD] / 1e6) == 602 and round(dq[LOCAL_LD] / 1e6) == 13
assert round(dkdv[TENSOR], 1) == 34.1 and round(fa2[TENSOR], 1) == 40.3
assert round(share, 2) == 0.68 and [round(x, 2) for x in (
    ours["summary"]["kernel_ms"], fa2_ms)] == [3.90, 3.16]
assert same128[LOCAL_LD] == 0 and round(same128[TENSOR], 1) == 52.1

elsewhere = [main_kernel("d128-full-8k", "sdpa_flash", "fwd")[LOCAL_LD],
             main_kernel("d128-full-8k", "sdpa_cudnn", "bwd")[LOCAL_LD],
             main_kernel("d256-causal-4k", "sdpa_cudnn", "bwd")[LOCAL_LD]]
assert [round(x / 1e6) for x in elsewhere] == [2285, 101, 61]
assert round(main_kernel("d128-full-8k", "sdpa_flash", "fwd")[TENSOR]) == 57
assert round(sweep_pt["ratio"]["sdpa_flash_bwd"], 2) == 0.81

f96, fa2_96 = (main_kernel("d96-causal-4k", p, "fwd") for p in ("fa_lib", "sdpa_flash"))
assert [round(x, 1) for x in (f96[TENSOR], fa2_96[TENSOR])] == [43.7, 53.7]
assert round(f96[TENSOR] * 96 / 128, 1) == 32.7 and f96["registers"] == 255
assert [round(x, 3) for x in (f96["ms"], fa2_96["ms"])] == [0.898, 0.856]
bwd96 = [region["d96-causal-4k", p, "bwd"]["summary"]["kernel_ms"]
         for p in ("fa_lib", "sdpa_flash")]
assert [round(x, 2) for x in bwd96] == [2.56, 2.87]
miss96 = [p for p in ext_points if p["d"] == 96 and p["kind"] in ("square", "gqa")
          and best(p, "sdpa_flash", "bwd") < 1]
assert len(miss96) == 13 and all(p["nq"] >= 4096 for p in miss96)
assert not any(p["kind"] == "square" and p["causal"] for p in miss96)
host_before = {(r["point"], r["provider"], r["mode"]): r for r in prof["host"]}
host_after = {(r["point"], r["provider"], r["mode"]): r
              for r in prof["host_after_change"]["rows"]}
small_f = ("small-64x256", "fa_lib", "fwd")
fa2_f = ("small-64x256", "sdpa_flash", "fwd")
got = [host_before[small_f]["host_ms"], host_after[small_f]["host_ms"],
       region[small_f]["summary"]["kernel_ms"], host_after[fa2_f]["host_ms"],
       host_after[fa2_f]["stream_ms"]]
assert [round(1e3 * x) for x in got] == [293, 172, 118, 50, 138]

for h in (host_before, host_after):
    assert abs(h[small_f]["stream_ms"] / h[small_f]["host_ms"] - 1) < 0.01

sb = ("small-64x256", "fa_lib", "bwd")
assert [round(h[sb]["host_ms"], 3) for h in (host_before, host_after)] == [0.551, 0.549]
pre_f = ("prefill-512x8k", "fa_lib", "fwd")
assert [round(h[pre_f]["host_ms"], 3) for h in (host_before, host_after)] == [
    0.259, 0.144]

bd = prof["host_breakdown"]["small-64x256"]
sig = next(f for f in bd["fwd_top"] if "_signature_from_callable" in f["function"])
assert [round(x) for x in (bd["fwd_host_us"], sig["cum_us_per_call"],
                           bd["launch_only_fwd_us"])] == [352, 139, 43]
small_miss = [p for p in ext_points if p["kind"] == "small"
              and best(p, "sdpa_flash", "fwd") < 1]
fa_ms = [min(r["fwd_ms"] for r in p["rows"] if r["provider"] in ("fa_lib", "fa_lib_nd"))
         for p in small_miss]
assert [round(min(fa_ms), 2), round(max(fa_ms), 2)] == [0.15, 0.35]
small_pt = next(p for p in ext_points if bench.ext_key(p) == (
    "small", "bf16", 128, True, 64, 16, 16, 256, 256))
assert round(best(small_pt, "sdpa_flash", "fwd"), 2) == 1.16

# Half-size blocks where a d = 256 prefill fills less than one wave (configs-prefill-*256-nvidia-h200.json).
probe_fwd = benchmarks.data.load_json("configs-prefill-fwd256-nvidia-h200.json")
probe_dq = benchmarks.data.load_json("configs-prefill-dq256-nvidia-h200.json")
big_fwd, small_fwd = kernels.SMALL_GRID[("fwd", 2, 256)]
big_dq, small_dq = kernels.SMALL_GRID[("dq", 2, 256)]
assert kernels.default_config("fwd", 2, 256, True, 512, 8192, interpret=False) == big_fwd
assert kernels.default_config("dq", 2, 256, True, 512, 8192, interpret=False) == big_dq
programs = {rows: 2 * 8 * -(-512 // rows) for rows in (big_fwd[0], small_fwd[0])}
assert programs == {128: 64, 64: 128} and programs[128] < kernels.SMALL_GRID_PROGRAMS == env["sm_count"]
gain = {}
for name, probe, small in (("forward", probe_fwd, small_fwd), ("backward (dQ blocks)", probe_dq, small_dq)):
    for causal in (True, False):
        rows = [r for r in probe["probe"] if r["causal"] is causal and r["nq"] == 512]
        base = next(r["ms"] for r in rows if r["config"] is None)
        fastest = min((r for r in rows if r["config"]), key=lambda r: r["ms"])
        assert tuple(fastest["config"]) == small
        gain[name, causal] = base / fastest["ms"]
assert [round(100 * (g - 1)) for g in gain.values()] == [5, 35, 20, 17]
assert [round(100 * (1 - 1 / g)) for g in gain.values()] == [5, 26, 17, 15]
assert probe_fwd["environment"]["date"] == probe_dq["environment"]["date"] == "2026-12-02"

again = benchmarks.data.load_json("extended-prefill256-nvidia-h200.json")
assert again["environment"]["date"] == "2026-12-02"
before = {bench.ext_key(p): p for p in ext_points}
moved = {}
for p in again["points"]:
    p0 = before[bench.ext_key(p)]
    assert (p0["kind"], p0["d"]) == ("prefill", 256)
    moved[p["dtype"], p["causal"]] = [round(x, 2) for x in (
        p0["ratio"]["sdpa_flash_fwd"], p["ratio"]["sdpa_flash_fwd"],
        p0["ratio"]["sdpa_flash_bwd"], p["ratio"]["sdpa_flash_bwd"])]
assert moved == {("bf16", False): [0.81, 0.99, 0.58, 0.72], ("bf16", True): [0.64, 0.67, 0.58, 0.72],
                 ("fp16", False): [0.81, 1.0, 0.59, 0.73], ("fp16", True): [0.63, 0.67, 0.58, 0.72]}

# Two column tiles for head dims between powers of two (probe-split-d*-nvidia-h200.json).
split_run = benchmarks.data.load_json("probe-split-d-nvidia-h200.json")
split_cfg = benchmarks.data.load_json("probe-split-d-configs-nvidia-h200.json")
for run in (split_run, split_cfg):
    assert run["environment"]["device"] == env["device"] and run["environment"]["date"] == "2026-12-02"
tiles = {d: ops._head_tiles(d) for d in (80, 96, 160, 192, 72, 128)}
assert tiles == {80: (64, 16), 96: (64, 32), 160: (128, 32), 192: (128, 64), 72: (128, 0), 128: (128, 0)}


def split_groups(run, field):
    """{(d, kind, mask): [[one tile, FA2, cuDNN] times over the split's, per point]} of a split-d probe's
    `field` ("ms": the forward, "bwd_ms": the backward)."""
    out = {}
    for p in run["points"]:
        ms = p[field]
        key = (p["d"], p["kind"], "causal" if p["causal"] else "full")
        out.setdefault(key, []).append(
            [ms["one_tile"] / ms["split"], ms["sdpa_flash"] / ms["split"], ms["sdpa_cudnn"] / ms["split"]])
    return out


groups = split_groups(split_run, "ms")
gain = [r[0] for rows in groups.values() for r in rows]
fa2 = {key: [r[1] for r in rows] for key, rows in groups.items()}
d96_fa2 = [x for (d, _, _), xs in fa2.items() if d == 96 for x in xs]
below = sorted((key, round(min(xs), 2)) for key, xs in fa2.items() if min(xs) < 1)
assert len(split_run["points"]) == 74 and len(d96_fa2) == 56
assert (round(min(gain), 2), round(max(gain), 2)) == (1.07, 1.51)
assert sum(x >= 1 for x in d96_fa2) == 54
assert below == [((80, "small", "full"), 0.99), ((96, "small", "causal"), 0.93), ((192, "small", "causal"), 0.93)]
sq96 = [r[2] for (d, kind, mask), rows in groups.items() if (d, kind, mask) == (96, "square", "full") for r in rows]
assert (round(min(sq96), 2), round(max(sq96), 2)) == (0.96, 1.02)

pick = {}
for p in split_cfg["points"]:
    if "configs" not in p:
        continue
    pick[(p["kind"], p["causal"], p["nq"])] = min(p["configs"], key=p["configs"].get)
assert set(pick.values()) == {"128,64,8,3", "128,64,4,3"} and len(pick) == 8
row_gain = [p["ms"]["split"] / min(p["configs"].values()) for p in split_cfg["points"] if "configs" in p]
assert all(len(p["configs"]) == 5 for p in split_cfg["points"] if "configs" in p)
assert (round(min(row_gain), 2), round(max(row_gain), 2)) == (1.04, 1.35)
assert all(v == ("128,64,4,3" if causal else "128,64,8,3") for (_, causal, _), v in pick.items())
assert kernels.default_config("fwd", 2, 96, False, 4096, 4096, interpret=False) == (128, 64, 8, 3)
assert kernels.default_config("fwd", 2, 96, True, 4096, 4096, interpret=False) == (128, 64, 4, 3)
tiles_alone = [p["ms"]["one_tile"] / p["ms"]["split"] for p in split_cfg["points"]]
assert (round(min(tiles_alone), 2), round(max(tiles_alone), 2)) == (1.07, 1.5) and len(tiles_alone) == 74
before96 = sum(best(p, "sdpa_flash", "fwd") >= 1 for p in ext_points if p["d"] == 96)
assert before96 == 31

bwd_run = benchmarks.data.load_json("probe-split-d-bwd-nvidia-h200.json")
bwd_again = benchmarks.data.load_json("probe-split-d-bwd-small-nvidia-h200.json")
for run in (bwd_run, bwd_again):
    assert run["environment"]["device"] == env["device"] and run["environment"]["date"] == "2026-12-02"
    assert run["bwd"] is True


bg, bg2 = split_groups(bwd_run, "bwd_ms"), split_groups(bwd_again, "bwd_ms")
long = [r for (d, kind, _), rows in bg.items() if kind in ("square", "gqa") for r in rows]
assert len(bwd_run["points"]) == 58 and len(bwd_again["points"]) == 8 and len(long) == 50
assert [(round(min(r[j] for r in long), 2), round(max(r[j] for r in long), 2)) for j in range(3)] == [
    (1.03, 1.28), (1.13, 1.63), (0.74, 0.92)]
first = {bench.ext_key(p): p["bwd_ms"] for p in bwd_run["points"]}
moved = []
for p in bwd_again["points"]:
    a, b = first[bench.ext_key(p)], p["bwd_ms"]
    r1, r2 = a["one_tile"] / a["split"], b["one_tile"] / b["split"]
    moved.append((p["kind"], max(r1, r2) / min(r1, r2)))
small_move = max(m for kind, m in moved if kind == "small")
assert round(small_move, 2) == 1.98
prefill_full = [r[1] for g in (bg, bg2) for r in g[(96, "prefill", "full")]]
assert (round(min(prefill_full), 2), round(max(prefill_full), 2)) == (0.86, 0.95)

# The parts of the extended sweep (bench.EXT_PARTS): each replaces the base file's timings at its points.
# bench.extended_sweep(parts=bench.EXT_PARTS[:k]) is the sweep with the first k parts in place.
part = benchmarks.data.load_json("extended-d96-nvidia-h200.json")
assert part["environment"]["date"] == "2026-12-02"
assert same_stack(part)
first_run = {bench.ext_key(p): p for p in ext_points}
assert sorted(bench.ext_key(p) for p in part["points"]) == sorted(
    k for k, p in first_run.items() if p["d"] == 96)
assert all(p["ratio"] == bench.ext_ratios(p) for p in part["points"])
part2 = benchmarks.data.load_json("extended-d96-short-nvidia-h200.json")
assert part2["environment"]["date"] == "2026-12-02" and len(part2["points"]) == 16
assert {bench.ext_key(p) for p in part2["points"]} <= {bench.ext_key(p) for p in part["points"]}
assert bench.EXT_PARTS[:4] == ("extended-prefill256-nvidia-h200.json", "extended-d96-nvidia-h200.json",
                                "extended-d96-short-nvidia-h200.json",
                                "extended-1k-nvidia-h200.json")

now = bench.extended_sweep(parts=bench.EXT_PARTS[:4])
now_points = now["points"]
assert [bench.ext_key(p) for p in now_points] == [bench.ext_key(p) for p in ext_points]
assert [sum(p.get("part") == name for p in now_points) for name in bench.EXT_PARTS[:4]] == [4, 40, 16, 24]

part1k = benchmarks.data.load_json("extended-1k-nvidia-h200.json")
assert part1k["environment"]["date"] == "2026-12-02" and {p["d"] for p in part1k["points"]} == {64, 128, 256}
flips = sorted((bench.ext_key(p)[:4], m, round(best(first_run[bench.ext_key(p)], "sdpa_flash", m), 2),
                round(best(p, "sdpa_flash", m), 2)) for p in part1k["points"] for m in ("fwd", "bwd")
               if best(first_run[bench.ext_key(p)], "sdpa_flash", m) < 1 <= best(p, "sdpa_flash", m))
assert len(flips) == 5 and not any(best(first_run[bench.ext_key(p)], "sdpa_flash", m) >= 1 > best(p, "sdpa_flash", m)
                                   for p in part1k["points"] for m in ("fwd", "bwd"))
sq96 = {m: [best(p, "sdpa_cudnn", m) for p in part["points"] if p["kind"] in ("square", "gqa")]
        for m in ("fwd", "bwd")}
count_now = count_at_fa2(now_points)
geo_now = of_cudnn_all(now_points)
d96_count = count_at_fa2(part["points"])
assert d96_count == {"fwd": 54, "bwd": 53}
now96 = [p for p in now_points if p["d"] == 96]
d96_now = count_at_fa2(now96)
first_small = {bench.ext_key(p): p for p in part["points"]}
moved_small = [(p["dtype"], p["causal"], round(best(first_small[bench.ext_key(p)], "sdpa_flash", "fwd"), 2),
                round(best(p, "sdpa_flash", "fwd"), 2)) for p in part2["points"] if p["kind"] == "small"]
assert d96_now == {"fwd": 55, "bwd": 56}
assert [sum(best(first_run[bench.ext_key(p)], "sdpa_flash", m) >= 1 for p in part["points"])
        for m in ("fwd", "bwd")] == [31, 39]
assert all(best(p, "sdpa_flash", m) >= 1 for p in part["points"] if p["kind"] in ("square", "gqa")
           for m in ("fwd", "bwd"))
assert [(round(min(x), 2), round(max(x), 2)) for x in sq96.values()] == [(0.75, 1.08), (0.80, 0.97)]
assert count_now == {"fwd": 216, "bwd": 174} and round(geo_now, 2) == 0.77
assert all(best(p, "sdpa_flash", "fwd") < 1 for p in part["points"]
           if p["kind"] == "small" and p["causal"])
assert moved_small == [("bf16", False, 1.18, 0.93), ("bf16", True, 0.93, 1.13), ("fp16", False, 1.06, 1.16),
                       ("fp16", True, 0.93, 1.11)]

# The warp-specialized (Gluon) forward at d = 64 and 128 (probe-hopper-fwd-nvidia-h200.json) and the order
# of its tiles (probe-hopper-order-nvidia-h200.json).
hop_probe = benchmarks.data.load_json("probe-hopper-fwd-nvidia-h200.json")
assert hop_probe["environment"]["date"] == "2026-12-03"
assert same_stack(hop_probe)
hp = hop_probe["points"]


def routed(p):
    return dispatch.faster(p["d"], p["nq"], p["nk"], p["causal"])


def hop_gain(p):
    return p["ms"]["teach"] / p["ms"]["hopper"]


hop_taken = [hop_gain(p) for p in hp if routed(p)]
hop_left = [hop_gain(p) for p in hp if not routed(p)]
hcore = core_points(hp)
top = max(hcore, key=lambda p: p["tflops"]["hopper"])
s3 = [p["ms"]["hopper"] / p["ms"]["hopper_s3"] for p in hp if p["d"] == 128]
assert len(hp) == 95 and len(hop_taken) == 64
assert all(routed(p) for p in hp if p["d"] == 128)
assert (round(min(hop_taken), 2), round(max(hop_taken), 2), round(geomean(hop_taken), 2)) == (1.02, 1.78, 1.26)
assert (round(min(hop_left), 2), round(max(hop_left), 2)) == (0.75, 1.13)
assert len(hcore) == 16 and round(top["tflops"]["hopper"]) == 657 and (top["kind"], top["causal"], top["nq"]) == (
    "gqa", True, 16384)
assert round(geomean(s3), 2) == 0.97
d128_gain = [hop_gain(p) for p in hp if p["d"] == 128]
d64_gain = [hop_gain(p) for p in hp if p["d"] == 64 and routed(p)]
assert [round(x, 2) for x in (min(d128_gain), max(d128_gain), min(d64_gain), max(d64_gain))] == [1.05, 1.78, 1.02, 1.17]
span = {k: (round(min(p["tflops"][k] for p in hcore)), round(max(p["tflops"][k] for p in hcore)))
        for k in ("hopper", "teach", "sdpa_cudnn")}
assert span == {"hopper": (528, 657), "teach": (346, 556), "sdpa_cudnn": (582, 685)}
prefill64 = [hop_gain(p) for p in hp if (p["d"], p["kind"], p["causal"]) == (64, "prefill", True)]
assert [round(x, 2) for x in prefill64] == [1.13]

order = benchmarks.data.load_json("probe-hopper-order-nvidia-h200.json")
assert order["environment"]["date"] == "2026-12-03"
assert same_stack(order)
op = order["points"]
assert len(op) == 56 and all(all(p["same_bits"].values()) for p in op)
GROUPS = (1, 2, 3, 4, 8, 16)
L2_BYTES = 50 * 2**20
kv_head = 2 * 1024 * 128 * 2
assert 132 * kv_head > L2_BYTES


def order_gain(p, g):
    return p["ms"]["hopper"] / p["ms"][f"hopper_g{g}"]


sets = {
    "d = 128, all 28": lambda p: p["d"] == 128,
    "d = 128, square, N <= 2k": lambda p: p["d"] == 128 and p["kind"] == "square" and p["nq"] <= 2048,
    "d = 128, square and GQA, N >= 4k": lambda p: p["d"] == 128 and p["kind"] in ("square", "gqa") and p["nq"] >= 4096,
    "d = 64, routed": lambda p: p["d"] == 64 and routed(p),
}
og = {}
for name, sel in sets.items():
    ps = [p for p in op if sel(p)]
    og[name] = {g: [order_gain(p, g) for p in ps] for g in GROUPS}
assert dispatch.HEADS_PER_GROUP == 2
two = {name: (round(geomean(x[2]), 2), round(min(x[2]), 2), round(max(x[2]), 2)) for name, x in og.items()}
assert two == {"d = 128, all 28": (1.05, 0.87, 1.63), "d = 128, square, N <= 2k": (1.21, 1.17, 1.26),
               "d = 128, square and GQA, N >= 4k": (1.01, 0.96, 1.08), "d = 64, routed": (1.03, 0.96, 1.15)}
assert all(geomean(og["d = 128, square, N <= 2k"][g]) > 1.15 for g in GROUPS)

hpart = ext_part(4, "extended-hopper-nvidia-h200.json", "2026-12-03")
assert sorted(bench.ext_key(p) for p in hpart["points"]) == sorted(
    k for k, p in first_run.items() if p["d"] == 128 or (p["d"] == 64 and p["nk"] >= 4096 and p["kind"] != "small"))
hop_now = bench.extended_sweep(parts=bench.EXT_PARTS[:5])["points"]
before = {bench.ext_key(p): p for p in now_points}
d128 = [p for p in hop_now if p["d"] == 128]
lift = [best(p, "sdpa_flash", "fwd") / best(before[bench.ext_key(p)], "sdpa_flash", "fwd") for p in d128]
count_hop = count_at_fa2(hop_now)
geo_hop = of_cudnn(hop_now)
geo_hop_all = of_cudnn_all(hop_now)
core_hop = core_points(hop_now)
core_fwd = [best(p, "sdpa_cudnn", "fwd") for p in core_hop]
core_bwd = [best(p, "sdpa_cudnn", "bwd") for p in core_hop]
misses_fwd = [(p["kind"], p["dtype"], p["d"], "causal" if p["causal"] else "full",
               round(best(p, "sdpa_flash", "fwd"), 2)) for p in hop_now if best(p, "sdpa_flash", "fwd") < 1]
assert (round(min(best(p, "sdpa_flash", "fwd") for p in d128), 2), round(geomean(lift), 2)) == (1.15, 1.24)
assert count_hop == {"fwd": 217, "bwd": 174} and round(geo_hop_all, 2) == 0.80
assert [round(geo_hop[m], 2) for m in ("fwd", "bwd")] == [0.86, 0.75]
assert sum(x >= 0.95 for x in core_fwd) == 13 and not any(x >= 0.95 for x in core_bwd)
assert [round(x, 2) for x in (min(core_fwd), max(core_fwd), min(core_bwd), max(core_bwd))] == [0.84, 1.19, 0.72, 0.80]
assert sorted(misses_fwd) == sorted([
    ("prefill", "bf16", 256, "full", 0.99), ("prefill", "bf16", 256, "causal", 0.67),
    ("prefill", "fp16", 256, "causal", 0.67), ("small", "bf16", 256, "causal", 0.73),
    ("small", "fp16", 256, "causal", 0.32), ("small", "bf16", 96, "full", 0.93), ("small", "fp16", 64, "causal", 0.78)])
below_before = [(p["kind"], p["dtype"], round(best(before[bench.ext_key(p)], "sdpa_flash", "fwd"), 2))
                for p in d128 if best(before[bench.ext_key(p)], "sdpa_flash", "fwd") < 1]
short = [(p["kind"], p["nq"] // 1024) for p in core_hop if best(p, "sdpa_cudnn", "fwd") < 0.95]
beat = sum(x > 1 for x in core_fwd)
assert below_before == [("small", "fp16", 0.69)] and beat == 8
assert short == [("square", 4), ("square", 8), ("square", 32)] and not any(p["causal"] for p in core_hop
                                                                              if best(p, "sdpa_cudnn", "fwd") < 0.95)
assert {p["d"] for p in hop_now if best(p, "sdpa_flash", "bwd") < 1} == {256}

opart = ext_part(5, "extended-hopper-order-nvidia-h200.json", "2026-12-03")
assert sorted(bench.ext_key(p) for p in opart["points"]) == sorted(
    k for k, p in first_run.items() if p["d"] == 128 and p["kind"] != "small")
final = bench.extended_sweep(parts=bench.EXT_PARTS[:6])["points"]
fifth = {bench.ext_key(p): p for p in hop_now}
moved = [best(p, "sdpa_cudnn", "fwd") / best(fifth[bench.ext_key(p)], "sdpa_cudnn", "fwd") for p in opart["points"]]
sq_short = [best(p, "sdpa_cudnn", "fwd") / best(fifth[bench.ext_key(p)], "sdpa_cudnn", "fwd")
            for p in opart["points"] if p["kind"] == "square" and p["nq"] <= 2048]
count_final = count_at_fa2(final)
geo_final = of_cudnn(final)
geo_final_all = of_cudnn_all(final)
core_final = core_points(final)
final_fwd = [best(p, "sdpa_cudnn", "fwd") for p in core_final]
final_bwd = [best(p, "sdpa_cudnn", "bwd") for p in core_final]
short_final = [(p["kind"], "causal" if p["causal"] else "full", p["nq"] // 1024, round(best(p, "sdpa_cudnn", "fwd"), 2))
               for p in core_final if best(p, "sdpa_cudnn", "fwd") < 0.95]
bwd_odd = [(p["kind"], p["dtype"], p["d"], "causal" if p["causal"] else "full", round(best(p, "sdpa_flash", "bwd"), 2),
            round(best(fifth[bench.ext_key(p)], "sdpa_flash", "bwd"), 2))
           for p in final if best(p, "sdpa_flash", "bwd") < 1 and p["d"] != 256]
assert (round(min(sq_short), 2), round(max(sq_short), 2), round(geomean(moved), 2)) == (1.00, 1.24, 1.02)
assert count_final == {"fwd": 217, "bwd": 173} and round(geo_final_all, 2) == 0.80
assert [round(geo_final[m], 2) for m in ("fwd", "bwd")] == [0.86, 0.74]
assert sum(x >= 0.95 for x in final_fwd) == 15 and sum(x > 1 for x in final_fwd) == 12
assert not any(x >= 0.95 for x in final_bwd) and short_final == [("gqa", "full", 16, 0.93)]
assert [round(x, 2) for x in (min(final_bwd), max(final_bwd))] == [0.74, 0.80]
assert bwd_odd == [("prefill", "bf16", 128, "full", 0.8, 1.31)]
gqa16 = next(p for p in core_final if (p["kind"], p["causal"], p["nq"]) == ("gqa", False, 16384))
assert round(best(fifth[bench.ext_key(gqa16)], "sdpa_cudnn", "fwd"), 2) == 1.02

# The backward kernels in the profile.
kern = {(r["point"], k["kernel"]): k for r in prof["regions"] if r["provider"] == "fa_lib" and r["mode"] == "bwd"
        for k in r["kernels"]}
tensor = {p: kern[p, "_attn_bwd_dkdv"][TENSOR] for p in ("d128-full-8k", "d256-causal-4k")}
assert [round(tensor[p], 1) for p in tensor] == [52.8, 34.1]
assert round(kern["d128-full-8k", "_attn_bwd_dq"][TENSOR], 1) == 71.5
assert kern["d128-full-8k", "_attn_bwd_dkdv"]["registers"] == 255
assert round(kern["d256-causal-4k", "_attn_bwd_dkdv"][LOCAL_LD] / 1e6) == 602

# The warp-specialized dK/dV kernel (probe-hopper-bwd-nvidia-h200.json).
bprobe = benchmarks.data.load_json("probe-hopper-bwd-nvidia-h200.json")
assert bprobe["environment"]["date"] == "2026-12-03"
assert same_stack(bprobe)
assert len(bprobe["runs"]) == 3 and all(c["ok"] and c["hopper"] for r in bprobe["runs"] for c in r["checks"])
assert all(len(r["checks"]) == 12 for r in bprobe["runs"])

same_bits = [all(v == 0.0 for v in c["max_diff_teach"].values()) for r in bprobe["runs"][:2] for c in r["checks"]]
assert all(same_bits)


def routed_bwd(p):
    return dispatch.faster_backward(p["d"], p["nq"], p["nk"], p["causal"])


COMMITTED = ((0, "hopper"), (1, "hopper"), (2, "hopper_alt"))
bgain = {}
for run, name in COMMITTED:
    for p in bprobe["runs"][run]["points"]:
        ms = p["bwd_ms"]
        if name in ms and "teach" in ms:
            key = (p["d"], p["kind"], "causal" if p["causal"] else "full", routed_bwd(p))
            bgain.setdefault(key, []).append(ms["teach"] / ms[name])
taken_b = [x for key, xs in bgain.items() if key[3] for x in xs]
variants = {}
for run, name in ((1, "hopper_s3"), (1, "hopper_pipe"), (2, "hopper"), (2, "hopper_s3")):
    ref = COMMITTED[run][1]
    xs = [p["bwd_ms"][ref] / p["bwd_ms"][name] for p in bprobe["runs"][run]["points"]
          if name in p["bwd_ms"] and routed_bwd(p) and p["d"] == 128]
    variants[run, name] = xs
d128_taken = [x for key, xs in bgain.items() if key[3] and key[0] == 128 for x in xs]
d64_taken = [x for key, xs in bgain.items() if key[3] and key[0] == 64 for x in xs]
assert (len(taken_b), round(min(taken_b), 2), round(max(taken_b), 2), round(geomean(taken_b), 2)) == (
    28, 1.04, 1.19, 1.10)
assert (round(min(d128_taken), 2), round(max(d128_taken), 2)) == (1.04, 1.19)
assert (round(min(d64_taken), 2), round(max(d64_taken), 2)) == (1.04, 1.08)
assert [round(geomean(xs), 2) for xs in variants.values()] == [1.00, 0.90, 0.90, 0.85]
short = bgain[128, "square", "causal", False] + bgain[128, "small", "full", False]
assert round(min(short), 2) == 0.52 and all(x < 1 for x in short)
assert (kernels_hopper.BWD_BLOCK_N, kernels_hopper.BWD_BLOCK_M, kernels_hopper.BWD_STAGES[128]) == (128, 64, 2)
assert 256 // kernels_hopper.BWD_BLOCK_M == 4
assert [round(x, 2) for x in bgain[128, "square", "causal", False]] == [0.86]
assert rng(bgain[128, "prefill", "full", False]) == "0.67-1.28"
dq_rows = kernels.default_config("dq", 2, 128, False, 512, 8192, interpret=False)[0]
dq_programs = 2 * 16 * -(-512 // dq_rows)
dkdv_programs = 2 * 16 * -(-8192 // kernels_hopper.BWD_BLOCK_N)
assert dkdv_programs == 16 * dq_programs
bpart = ext_part(6, "extended-hopper-bwd-nvidia-h200.json", "2026-12-03")
assert sorted(bench.ext_key(p) for p in bpart["points"]) == sorted(
    k for k, p in first_run.items()
    if p["d"] == 128 or (p["d"] == 64 and p["kind"] in ("square", "gqa") and p["nq"] >= 4096))
now7 = bench.extended_sweep(parts=bench.EXT_PARTS[:7])["points"]
six = {bench.ext_key(p): p for p in final}
core_now = core_points(now7)
now_fwd = [best(p, "sdpa_cudnn", "fwd") for p in core_now]
now_bwd = [best(p, "sdpa_cudnn", "bwd") for p in core_now]
was_bwd = [best(six[bench.ext_key(p)], "sdpa_cudnn", "bwd") for p in core_now]
lift_b = [a / b for a, b in zip(now_bwd, was_bwd)]
routed_now = [p for p in bpart["points"] if routed_bwd(p)]
lift_r = [best(p, "sdpa_flash", "bwd") / best(six[bench.ext_key(p)], "sdpa_flash", "bwd") for p in routed_now]
count_now = count_at_fa2(now7)
geo_now = of_cudnn(now7)
geo_now_all = of_cudnn_all(now7)
fwd_miss = [(p["kind"], p["dtype"], p["d"], "causal" if p["causal"] else "full", round(best(p, "sdpa_flash", "fwd"), 2))
            for p in now7 if best(p, "sdpa_flash", "fwd") < 1]
bwd_miss = [(p["kind"], p["dtype"], p["d"], "causal" if p["causal"] else "full", round(best(p, "sdpa_flash", "bwd"), 2))
            for p in now7 if best(p, "sdpa_flash", "bwd") < 1 and p["d"] != 256]
assert [round(x, 2) for x in (min(now_bwd), max(now_bwd), min(was_bwd), max(was_bwd))] == [0.80, 0.91, 0.74, 0.80]
assert (round(min(lift_b), 2), round(max(lift_b), 2), round(geomean(lift_b), 2)) == (1.02, 1.17, 1.09)
assert len(routed_now) == 56 and (
    round(min(lift_r), 2), round(max(lift_r), 2), round(geomean(lift_r), 2)) == (1.03, 1.17, 1.10)
assert count_now == {"fwd": 216, "bwd": 174} and round(geo_now_all, 2) == 0.81
assert [round(geo_now[m], 2) for m in ("fwd", "bwd")] == [0.87, 0.76]
assert (round(min(now_fwd), 2), round(max(now_fwd), 2), sum(x >= 0.95 for x in now_fwd)) == (0.94, 1.17, 15)
assert bwd_miss == [] and len(fwd_miss) == 8 and ("small", "bf16", 128, "full", 0.97) in fwd_miss
assert sum(p["d"] == 256 for p in now7 if best(p, "sdpa_flash", "bwd") < 1) == 50
assert (round(min(best(p, "sdpa_flash", "bwd") for p in routed_now), 2),
        round(max(best(p, "sdpa_flash", "bwd") for p in routed_now), 2)) == (1.21, 1.83)
small128 = ("bf16", 128, False, "small")


def small128_point(pts):
    return next(p for p in pts if (p["dtype"], p["d"], p["causal"], p["kind"]) == small128)


assert [round(best(small128_point(x), "sdpa_flash", "fwd"), 2) for x in (hop_now, now7)] == [1.15, 0.97]
assert "forward at 0.73x FA2's" in opart["runs"]

# The d = 256 backward: registers and shared memory of one program, and the Gluon kernel with two
# warpgroups on one key tile (probe-hopper-bwd256-nvidia-h200.json).
HD = 256
threads = 128


def acc_regs(keys, cols):
    return 2 * keys * cols // threads


whole, half = acc_regs(64, HD), acc_regs(64, HD // 2)
bm, bn = kernels_hopper.BWD256_BLOCK_M, kernels_hopper.BWD256_BLOCK_N
slots = kernels_hopper.BWD_STAGES[HD]
smem = {"K and V, both column halves": 2 * bn * HD * 2,
        f"Q and dO, {slots} slots": 2 * slots * bm * HD * 2,
        "P and dS, two buffers each": 2 * 2 * bm * bn * 2}

limit_msg = next(r["error"] for r in benchmarks.data.load_json("probe-d256-bwd-nvidia-h200.json")["runs"][0]["rows"]
                 if r.get("error"))
smem_limit = int(limit_msg.split("Hardware limit: ")[1].split(".")[0])
assert (whole, half) == (256, 128) and (bm, bn, slots) == (64, 64, 2)
assert sum(smem.values()) == 224 * 1024 and smem_limit == 232448

b256 = benchmarks.data.load_json("probe-hopper-bwd256-nvidia-h200.json")
assert b256["environment"]["date"] == "2026-12-04"
assert same_stack(b256)
checks = b256["runs"][0]["checks"]
det = [c for c in checks if c["deterministic"]]
nondet = [c for c in checks if not c["deterministic"]]
same_dkdv = [c["max_diff_teach"]["dk"] == c["max_diff_teach"]["dv"] == 0.0 for c in det]
assert all(c["ok"] for c in checks) and len(det) == len(nondet) == 11 and all(same_dkdv)
assert all(c["bitwise_repeat"] for c in det) and all(c["max_diff_teach"]["dq"] == 0.0 for c in det)
assert sum(c["max_diff_teach"]["dq"] > 0 for c in nondet) == 9

g256 = {}
for run in b256["runs"]:
    for p in run["points"]:
        ms = p["bwd_ms"]
        g256[p["kind"], "causal" if p["causal"] else "full", p["nq"]] = (
            ms["teach"] / ms["hopper"], ms["hopper_nd"] / ms["hopper"] if "hopper_nd" in ms else None,
            ms["sdpa_flash"] / ms["hopper"] if "sdpa_flash" in ms else None)
taken256 = [g for (kind, _, n), (g, _, _) in g256.items() if n > dispatch.BWD256_SHORT_KEYS]
one_pass = [one for _, one, _ in g256.values() if one is not None]
fa2_256 = [fa2 for _, _, fa2 in g256.values() if fa2 is not None]
left = benchmarks.data.load_json("extended-hopper-bwd256-nvidia-h200.json")["left_out"]
short_ms = {m: [next(r["bwd_ms"] for r in p["rows"] if r["provider"] == "fa_lib") for run in left["runs"]
                for p in run["points"] if p["causal"] is (m == "causal")] for m in ("full", "causal")}
short_fa2 = [next(r["bwd_ms"] for r in p["rows"] if r["provider"] == "sdpa_flash") for run in left["runs"]
             for p in run["points"]]
assert len(taken256) == 18 and (round(min(taken256), 2), round(max(taken256), 2), round(geomean(taken256), 2)) == (
    1.47, 1.91, 1.65)
assert (round(min(one_pass), 2), round(max(one_pass), 2)) == (1.01, 1.26) and 256 not in dispatch.ONE_PASS_HEAD_DIMS
assert (round(min(fa2_256), 2), round(max(fa2_256), 2)) == (1.07, 1.39)
assert [round(g256["small", m, 256][0], 2) for m in ("full", "causal")] == [0.88, 1.12]
assert 256 // kernels_hopper.BWD256_BLOCK_M == 4
assert dispatch.BWD256_SHORT_KEYS == 256 and not dispatch.faster_backward(256, 256, 256, True)
assert rng(short_ms["full"]) == "0.46-0.71" and rng(short_ms["causal"]) == "0.38-0.70" and rng(short_fa2) == "0.62-0.74"

# Prefill on the split kernel (probe-split-fwd-nvidia-h200.json).
sfwd = benchmarks.data.load_json("probe-split-fwd-nvidia-h200.json")
assert sfwd["environment"]["date"] == "2026-12-04"
assert same_stack(sfwd)
sg = {}
for p in sfwd["points"]:
    ms = p["ms"]
    sg.setdefault((p["d"], "causal" if p["causal"] else "full"), []).append(ms["flash_attention"] / ms["split_None"])
split_gain = [x for (d, mask), xs in sg.items()
              if (mask == "causal") in fa_lib.options.DEFAULT.prefill_split_masks(d) for x in xs]
assert all(max(p["maxdiff"].values()) < 1e-3 for p in sfwd["points"])

r8 = ext_part(7, "extended-hopper-bwd256-nvidia-h200.json", "2026-12-04")
r9 = ext_part(8, "extended-prefill-split-nvidia-h200.json", "2026-12-04")
assert sorted(bench.ext_key(p) for p in r8["points"]) == sorted(
    k for k, p in first_run.items() if p["d"] == 256 and p["kind"] != "small")
assert sorted(bench.ext_key(p) for p in r9["points"]) == sorted(
    k for k, p in first_run.items() if p["d"] == 256 and p["kind"] == "prefill")
now9 = bench.extended_sweep(parts=bench.EXT_PARTS[:9])["points"]
seven = {bench.ext_key(p): p for p in now7}
d256_now = [p for p in now9 if p["d"] == 256 and p["kind"] != "small"]
pre256 = {(p["dtype"], "causal" if p["causal"] else "full"): round(best(p, "sdpa_flash", "fwd"), 2)
          for p in now9 if p["d"] == 256 and p["kind"] == "prefill"}
count_now = count_at_fa2(now9)
geo_now = of_cudnn(now9)
geo_now_all = of_cudnn_all(now9)
core_now = core_points(now9)
now_fwd = [best(p, "sdpa_cudnn", "fwd") for p in core_now]
now_bwd = [best(p, "sdpa_cudnn", "bwd") for p in core_now]
fwd_miss = [(p["kind"], p["dtype"], p["d"], "causal" if p["causal"] else "full", round(best(p, "sdpa_flash", "fwd"), 2))
            for p in now9 if best(p, "sdpa_flash", "fwd") < 1]
bwd_miss = [(p["kind"], p["dtype"], p["d"], "causal" if p["causal"] else "full", round(best(p, "sdpa_flash", "bwd"), 2))
            for p in now9 if best(p, "sdpa_flash", "bwd") < 1]
assert (len(split_gain), round(min(split_gain), 2), round(max(split_gain), 2)) == (9, 1.17, 1.50)
assert pre256 == {("bf16", "full"): 0.99, ("bf16", "causal"): 0.97, ("fp16", "full"): 0.99, ("fp16", "causal"): 0.97}
assert count_now == {"fwd": 215, "bwd": 223} and round(geo_now_all, 2) == 0.87
assert [round(geo_now[m], 2) for m in ("fwd", "bwd")] == [0.87, 0.86]
assert bwd_miss == [("prefill", "fp16", 256, "causal", 0.98)] and len(fwd_miss) == 9
assert [round(x, 2) for x in (min(now_fwd), max(now_fwd), min(now_bwd), max(now_bwd))] == [0.94, 1.17, 0.80, 0.91]
assert sum(x >= 0.95 for x in now_fwd) == 15 and not any(x >= 0.95 for x in now_bwd)
assert [round(f(best(p, "sdpa_flash", "bwd") for p in d256_now), 2) for f in (min, max)] == [0.98, 1.74]
assert [round(f(best(seven[bench.ext_key(p)], "sdpa_flash", "bwd") for p in d256_now), 2)
        for f in (min, max)] == [0.64, 1.12]
assert [round(f(best(p, "sdpa_cudnn", "bwd") for p in d256_now), 2) for f in (min, max)] == [0.67, 1.14]
pre_bwd = [best(p, "sdpa_flash", "bwd") for p in now9 if p["d"] == 256 and p["kind"] == "prefill"]
was_slow = sum(best(seven[bench.ext_key(p)], "sdpa_flash", "bwd") < 1 for p in d256_now)
assert rng(pre_bwd) == "0.98-1.08" and (len(d256_now), was_slow) == (52, 50)

# The Gluon forward at d = 256: registers and shared memory of one program, its timings
# (probe-hopper-fwd256-nvidia-h200.json).
rows_c = kernels_hopper.BLOCK_M // 2


def fwd_regs(keys):
    return {"O": rows_c * HD // threads, "S": rows_c * keys // threads, "P": rows_c * keys // 2 // threads}


def fwd_smem(keys, slots):
    return 2 * rows_c * HD * 2 + slots * 2 * keys * HD * 2


assert (rows_c, HD, threads) == (64, 256, 128)
assert fwd_regs(64) == {"O": 128, "S": 32, "P": 16} and sum(fwd_regs(128).values()) == 224
assert (fwd_smem(128, 1) <= smem_limit < fwd_smem(128, 2)
        and fwd_smem(64, 2) == 192 * 1024 < smem_limit < fwd_smem(64, 3))
assert (kernels_hopper.BLOCK_N[256], kernels_hopper.STAGES[256], kernels_hopper.CONSUMER_REGS) == (64, 2, 240)
f256 = benchmarks.data.load_json("probe-hopper-fwd256-nvidia-h200.json")
assert f256["environment"]["date"] == "2026-12-04"
assert same_stack(f256)
fchecks = f256["checks"]
assert len(fchecks) == 9 and all(c["ok"] and c["hopper"] for c in fchecks) and {c["case"][5] for c in fchecks} == {256}
fp = f256["points"]
gain256 = [hop_gain(p) for p in fp]
slower256 = [(p["kind"], p["dtype"], "causal" if p["causal"] else "full", round(hop_gain(p), 2))
             for p in fp if hop_gain(p) < 1]
won256 = [g for g in gain256 if g >= 1]
core256 = [p for p in fp if p["kind"] in ("square", "gqa")]
c256 = [p["ms"]["sdpa_cudnn"] / p["ms"]["hopper"] for p in core256]
f2_256 = [p["ms"]["sdpa_flash"] / p["ms"]["hopper"] for p in fp]
top256 = max(p["tflops"]["hopper"] for p in core256)
twin = next(hop_gain(p) for p in fp if (p["kind"], p["dtype"], p["causal"]) == ("small", "bf16", True))
pre_c = next(p for p in fp if (p["kind"], p["dtype"], p["causal"]) == ("prefill", "bf16", True))
assert len(fp) == 56 and all(routed(p) for p in fp)
assert len(won256) == 55 and rng(won256) == "1.21-1.88" and round(geomean(gain256), 2) == 1.43
assert slower256 == [("small", "fp16", "causal", 0.78)] and round(twin, 2) == 1.32
assert round(hop_gain(pre_c), 2) == 1.29 and rng(c256) == "0.72-1.14" and round(geomean(c256), 2) == 0.99
assert round(top256) == 741 and rng(f2_256) == "0.66-2.51"

N256 = sorted({p["nq"] for p in core256})
panel256 = {(p["kind"], p["causal"], p["nq"]): p["tflops"] for p in core256 if p["dtype"] == "bf16"}
assert N256 == [1024, 2048, 4096, 8192, 16384, 32768] and sorted(panel256) == sorted(
    (k, c, n) for k in ("gqa", "square") for c in (False, True) for n in N256
) and all({"hopper", "teach", "sdpa_flash", "sdpa_cudnn"} <= set(t) for t in panel256.values())
assert all(p["tflops"]["hopper"] > max(p["tflops"]["teach"], p["tflops"]["sdpa_flash"]) for p in core256)
r10 = ext_part(9, "extended-hopper-fwd256-nvidia-h200.json", "2026-12-04")
assert sorted(bench.ext_key(p) for p in r10["points"]) == sorted(k for k, p in first_run.items() if p["d"] == 256)
now10 = bench.extended_sweep(parts=bench.EXT_PARTS[:10])["points"]
nine = {bench.ext_key(p): p for p in now9}
core10 = [p for p in now10 if p["d"] == 256 and p["kind"] in ("square", "gqa")]
fc10 = [best(p, "sdpa_cudnn", "fwd") for p in core10]
fc9 = [best(nine[bench.ext_key(p)], "sdpa_cudnn", "fwd") for p in core10]
pre10 = {(p["dtype"], "causal" if p["causal"] else "full"): round(best(p, "sdpa_flash", "fwd"), 2)
         for p in now10 if p["d"] == 256 and p["kind"] == "prefill"}
count10 = count_at_fa2(now10)
geo10 = of_cudnn_all(now10)
geo10_fwd = geomean(best(p, "sdpa_cudnn", "fwd") for p in now10)
miss10 = [(p["kind"], p["dtype"], p["d"], "causal" if p["causal"] else "full", m, round(best(p, "sdpa_flash", m), 2))
          for p in now10 for m in ("fwd", "bwd") if best(p, "sdpa_flash", m) < 1]
low10 = min(core10, key=lambda p: best(p, "sdpa_cudnn", "fwd"))
low_probe = next(p["ms"]["sdpa_cudnn"] / p["ms"]["hopper"] for p in fp if bench.ext_key(p) == bench.ext_key(low10))
pre_probe = next(p["ms"]["sdpa_flash"] / p["ms"]["hopper"] for p in fp
                 if (p["kind"], p["dtype"], p["causal"]) == ("prefill", "fp16", True))
assert rng(fc10) == "0.56-1.23" and round(geomean(fc10), 2) == 1.03
assert (low10["kind"], low10["dtype"], low10["causal"], low10["nq"]) == ("gqa", "bf16", True, 1024) and round(
    low_probe, 2) == 0.94
assert rng(fc9) == "0.58-0.84" and round(geomean(fc9), 2) == 0.69 and round(pre_probe, 2) == 1.25
assert pre10 == {("bf16", "full"): 1.24, ("bf16", "causal"): 1.27, ("fp16", "full"): 1.25, ("fp16", "causal"): 0.81}
assert count10 == {"fwd": 218, "bwd": 223} and round(geo10, 3) == 0.907 and round(geo10_fwd, 2) == 0.95
assert all(kind in ("small", "prefill") for kind, *_ in miss10) and len(miss10) == 7

# Host time per call (probe-host-fwd*-nvidia-h200.json) and launch plans (probe-plan-nvidia-h200.json).
hosts = [benchmarks.data.load_json(f"probe-host-fwd{s}-nvidia-h200.json") for s in ("", "-after")]
for h in hosts:
    assert h["environment"]["date"] == "2026-12-04" and same_stack(h)
    assert len(h["points"]) == 32 and {p["kind"] for p in h["points"]} == {"small", "prefill"}
kernel_gain = [p["sdpa_flash"]["graph_ms"] / p["fa_lib"]["graph_ms"] for h in hosts for p in h["points"]]
host_us = {n: [p[n]["host_ms"] * 1e3 for h in hosts for p in h["points"]] for n in ("fa_lib", "sdpa_flash")}
slow = [(h is hosts[1], p) for h in hosts for p in h["points"]
        if p["fa_lib"]["do_bench_ms"] > p["sdpa_flash"]["do_bench_ms"]]
host_bound = [p["fa_lib"]["host_ms"] > p["fa_lib"]["graph_ms"]
              and p["fa_lib"]["do_bench_ms"] > 1.1 * p["fa_lib"]["graph_ms"] for _, p in slow]
same_kernel = [h2["fa_lib"]["graph_ms"] / h1["fa_lib"]["graph_ms"] for h1, h2 in zip(*(h["points"] for h in hosts))]
fa2_host_up = [h2["sdpa_flash"]["host_ms"] / h1["sdpa_flash"]["host_ms"]
               for h1, h2 in zip(*(h["points"] for h in hosts))]
r11 = ext_part(10, "extended-host-nvidia-h200.json", "2026-12-04")
assert sorted(bench.ext_key(p) for p in r11["points"]) == sorted(
    k for k, p in first_run.items() if p["kind"] in ("small", "prefill"))



now, count_now, geo_now, geo_now_all, now_fwd, now_bwd, fwd_miss, bwd_miss = standing(bench.EXT_PARTS[:11])
assert rng(kernel_gain) == "1.05-2.30" and len(slow) == 21 and all(host_bound)
assert [round(x) for x in (min(host_us["fa_lib"]), max(host_us["fa_lib"]), min(host_us["sdpa_flash"]),
                           max(host_us["sdpa_flash"]))] == [84, 355, 41, 159]
assert rng(same_kernel) == "1.00-1.01" and rng(fa2_host_up) == "0.48-2.14"
assert count_now == {"fwd": 222, "bwd": 221} and round(geo_now_all, 3) == 0.905
assert (count_now["fwd"] - count10["fwd"], count_now["bwd"] - count10["bwd"]) == (4, -2)
bwd256_now = [best(p, "sdpa_flash", "bwd") for p in now if p["d"] == 256 and p["kind"] != "small"]
assert len(bwd256_now) == 52 and min(bwd256_now) >= 1
assert [round(geo_now[m], 2) for m in ("fwd", "bwd")] == [0.96, 0.86]
assert fwd_miss == [("small", "fp16", 96, "causal", 0.73), ("small", "fp16", 256, "causal", 0.53)]
assert bwd_miss == [("prefill", "bf16", 128, "causal", 0.9), ("small", "bf16", 128, "causal", 0.98),
                    ("small", "fp16", 128, "causal", 0.87)]
assert [round(x, 2) for x in (min(now_fwd), max(now_fwd), min(now_bwd), max(now_bwd))] == [0.94, 1.17, 0.80, 0.91]
pre_now = {(p["dtype"], "causal" if p["causal"] else "full"): (round(best(p, "sdpa_flash", "fwd"), 2),
                                                                round(best(p, "sdpa_flash", "bwd"), 2))
           for p in now if p["d"] == 256 and p["kind"] == "prefill"}
assert pre_now == {("bf16", "full"): (1.24, 1.08), ("bf16", "causal"): (1.26, 1.07), ("fp16", "full"): (1.24, 1.08),
                   ("fp16", "causal"): (1.27, 1.07)}
plans = benchmarks.data.load_json("probe-plan-nvidia-h200.json")
assert plans["environment"]["date"] == "2026-12-04" and same_stack(plans)
pp = plans["points"]
assert len(pp) == 32 and {p["kind"] for p in pp} == {"small", "prefill"}
host_pl = {(m, t): [p[t][m]["host_ms"] * 1e3 for p in pp]
           for m in ("fwd", "bwd") for t in ("plan_off", "plan_on", "sdpa_flash")}
plan_gain = {m: [a / b for a, b in zip(host_pl[m, "plan_off"], host_pl[m, "plan_on"])] for m in ("fwd", "bwd")}
at_fa2 = {(m, t): sum(p["sdpa_flash"][m]["do_bench_ms"] >= p[t][m]["do_bench_ms"] for p in pp)
          for m in ("fwd", "bwd") for t in ("plan_off", "plan_on")}
waiting = [sum(p[t]["fwd"]["host_ms"] > p["fa_lib_graph_fwd_ms"] for p in pp) for t in ("plan_off", "plan_on")]
r12 = ext_part(11, "extended-plan-nvidia-h200.json", "2026-12-04")
assert sorted(bench.ext_key(p) for p in r12["points"]) == sorted(bench.ext_key(p) for p in r11["points"])
r12_at = count_at_fa2(r12["points"])
r12_bwd = [best(p, "sdpa_flash", "bwd") for p in r12["points"]]

now, count_now, geo_now, geo_now_all, now_fwd, now_bwd, fwd_miss, bwd_miss = standing(bench.EXT_PARTS[:12])
miss_pt = next(p for p in pp if (p["kind"], p["dtype"], p["d"], p["causal"]) == ("small", "fp16", 256, True))
miss_probe = miss_pt["sdpa_flash"]["fwd"]["do_bench_ms"] / miss_pt["plan_on"]["fwd"]["do_bench_ms"]
shortest = sorted(pp, key=lambda p: p["fa_lib_graph_fwd_ms"])[:2]
assert [round(x) for m in ("fwd", "bwd") for t in ("plan_off", "plan_on", "sdpa_flash")
        for x in (min(host_pl[m, t]), max(host_pl[m, t]))] == [77, 176, 50, 142, 37, 146, 252, 634, 158, 367, 122, 228]
assert rng(plan_gain["fwd"]) == "0.78-1.84" and rng(plan_gain["bwd"]) == "1.09-2.63"
assert [round(geomean(plan_gain[m]), 2) for m in ("fwd", "bwd")] == [1.44, 1.70]
assert [at_fa2[m, t] for m in ("fwd", "bwd") for t in ("plan_off", "plan_on")] == [27, 32, 31, 32]
assert waiting == [6, 3] and plans["plan_info"]["plans"] == 64 and plans["plan_info"]["declined"] == 0
assert r12_at == {"fwd": 31, "bwd": 32} and rng(r12_bwd) == "1.04-1.89"
assert count_now == {"fwd": 223, "bwd": 224} and round(geo_now_all, 3) == 0.913
assert [round(geo_now[m], 2) for m in ("fwd", "bwd")] == [0.96, 0.87]
assert fwd_miss == [("small", "fp16", 256, "causal", 0.95)] and bwd_miss == []
assert round(miss_probe, 2) == 1.13 and miss_pt in shortest and {p["d"] for p in shortest} == {256}
assert [round(x, 2) for x in (min(now_fwd), max(now_fwd), min(now_bwd), max(now_bwd))] == [0.94, 1.17, 0.80, 0.91]

# The warp-specialized dQ kernel (probe-hopper-dq-nvidia-h200.json).
dqp = benchmarks.data.load_json("probe-hopper-dq-nvidia-h200.json")
assert dqp["environment"]["date"] == "2026-12-04" and same_stack(dqp)
checks_ok = [ch["ok"] and ch["gluon"] for ch in dqp["checks"]]
same_dq = [ch["max_diff_teach"]["dq"] == 0 for ch in dqp["checks"]]
dq_gain = {v: [p["bwd_ms"]["teach"] / p["bwd_ms"][v] for p in dqp["points"]] for v in ("gluon", "gluon_n128_s2")}
dq_cudnn = {v: [p["bwd_ms"]["sdpa_cudnn"] / p["bwd_ms"][v] for p in dqp["points"]] for v in ("teach", "gluon_n128_s2")}
assert kernels_hopper.DQ_BLOCK_N[128] == 128 and kernels_hopper.DQ_STAGES[128] == 2 and dispatch.DQ_HEAD_DIMS == (128,)
r13 = ext_part(12, "extended-hopper-dq-nvidia-h200.json", "2026-12-04")
assert len(r13["points"]) == 48 and {(p["d"], p["kind"]) for p in r13["points"]} == {(128, "square"), (128, "gqa")}
before13 = {bench.ext_key(p): p for p in now}
bwd_moved = [best(p, "sdpa_cudnn", "bwd") / best(before13[bench.ext_key(p)], "sdpa_cudnn", "bwd")
             for p in r13["points"]]

now, count_now, geo_now, geo_now_all, now_fwd, now_bwd, fwd_miss, bwd_miss = standing(bench.EXT_PARTS[:13])
assert checks_ok == [True] * 12 and same_dq == [True] * 12
assert rng(dq_gain["gluon"]) == "1.03-1.08" and rng(dq_gain["gluon_n128_s2"]) == "1.04-1.11"
assert round(geomean(dq_gain["gluon_n128_s2"]), 3) == 1.069
assert rng(dq_cudnn["teach"]) == "0.79-0.91" and rng(dq_cudnn["gluon_n128_s2"]) == "0.84-0.97"
assert rng(bwd_moved) == "1.00-1.09" and round(geomean(bwd_moved), 3) == 1.061
assert count_now == {"fwd": 223, "bwd": 224} and round(geo_now_all, 3) == 0.920
assert [round(geo_now[m], 2) for m in ("fwd", "bwd")] == [0.96, 0.88]
assert fwd_miss == [("small", "fp16", 256, "causal", 0.95)] and bwd_miss == []
assert [round(x, 2) for x in (min(now_fwd), max(now_fwd), min(now_bwd), max(now_bwd))] == [0.95, 1.20, 0.84, 0.96]
assert [sum(x >= 0.95 for x in xs) for xs in (now_fwd, now_bwd)] == [15, 2]
bwd_at = [(p["kind"], p["causal"]) for p in now if (p["d"], p["dtype"]) == (128, "bf16")
          and p["kind"] in ("square", "gqa") and p["nq"] >= 4096 and best(p, "sdpa_cudnn", "bwd") >= 0.95]
assert bwd_at == [("gqa", True)] * 2

# Two passes against the matrix-multiply ceiling: what 0.95 of cuDNN's backward would need.
ceil13 = r13["ceilings"]["bf16_matmul_TFLOPs"]
pts13 = [p for p in r13["points"] if p["dtype"] == "bf16" and p["nk"] >= 4096]
rows13 = [{r["provider"]: r for r in p["rows"]} for p in pts13]
real_two = [r["fa_lib"]["bwd_tflops"] * 7 / 5 / ceil13 for r in rows13]
cudnn_share = [r["sdpa_cudnn"]["bwd_tflops"] / ceil13 for r in rows13]
need_two = [0.95 * 7 / 5 * x for x in cudnn_share]
assert len(pts13) == 16 and round(ceil13) == 687
assert rng(real_two) == "0.84-0.98" and rng(cudnn_share) == "0.65-0.80"
assert rng(need_two) == "0.86-1.06" and sum(x > 1 for x in need_two) == 11 and sum(
    x > max(real_two) for x in need_two) == 12


# The one-pass backward at d = 128 (probe-onepass*-nvidia-h200.json).
def regs(rows, cols):
    return rows * cols // 128


held = {"dK and dV (64 keys x 128)": 2 * regs(64, 128), "S^T and dP^T (64 keys x 64 queries)": 2 * regs(64, 64),
        "half of the step's dQ (64 queries x 64)": regs(64, 64)}
assert list(held.values()) == [128, 64, 32] and sum(held.values()) <= kernels_hopper.CONSUMER_REGS == 240
op_shared = benchmarks.data.load_json("probe-onepass128-nvidia-h200.json")
op_split = benchmarks.data.load_json("probe-onepass-split-nvidia-h200.json")
op_var = benchmarks.data.load_json("probe-onepass-split-variants-nvidia-h200.json")
op_local = benchmarks.data.load_json("probe-onepass-local-nvidia-h200.json")
for f in (op_shared, op_split, op_var, op_local):
    assert f["environment"]["date"] == "2026-12-04" and same_stack(f)
    assert all(ch["ok"] for ch in f["checks"]) and len(f["points"]) == 8
    cases = {tuple(ch["case"]) for ch in f["checks"]}
    assert len(cases) == 10 and min(min(x[3], x[4]) for x in cases) == 1 and max(max(x[3], x[4]) for x in cases) == 4100
    assert len(f["checks"]) == 10 * len({ch["variant"] for ch in f["checks"]})


def two_over(f, variant, causal):
    return [p["bwd_ms"]["fa_lib"] / p["bwd_ms"][variant] for p in f["points"] if p["causal"] is causal]


SHARED = ("one_b128_tma", "one_b128_atomic", "one_b64_tma", "one_b64_atomic")
shared_all = [x for v in SHARED for c in (False, True) for x in two_over(op_shared, v, c)]
split_un = two_over(op_split, "one_split", False) + two_over(op_var, "one_split", False)
split_c = two_over(op_split, "one_split", True) + two_over(op_var, "one_split", True)
lf_c = two_over(op_var, "one_split_lf", True)
s3 = [x for v in ("one_split_s3", "one_split_s3_lf") for x in two_over(op_var, v, True)]
local = [x for c in (False, True) for x in two_over(op_local, "one_local", c)]
split_un += two_over(op_local, "one_split", False)
split_c += two_over(op_local, "one_split", True)
assert [p["checks"] for p in (op_shared,)] and len(op_shared["checks"]) == 40 and len(op_var["checks"]) == 40
assert rng(shared_all) == "0.47-0.79" and rng(split_un) == "1.05-1.11" and rng(split_c) == "0.73-1.01"
assert rng(lf_c) == "0.92-1.01" and max(s3) < 0.87 and rng(local) == "0.63-0.87" and len(op_local["checks"]) == 20
assert kernels_hopper.ONE_PASS_SPLIT_HEAD_DIMS == (128,) and kernels_hopper.ONE_PASS_LONGEST_FIRST is False
assert [dispatch.faster_one_pass(128, n, n, c)
        for n, c in ((4096, False), (32768, False), (4096, True), (2048, False))] == [True, True, False, False]

# The last part of the extended sweep (extended-hopper-onepass-nvidia-h200.json): `now` and the figures
# over it are the sweep as the pages quote it.
r14 = ext_part(13, "extended-hopper-onepass-nvidia-h200.json", "2026-12-04")
assert len(bench.EXT_PARTS) == 14  # the last part
assert sorted(bench.ext_key(p) for p in r14["points"]) == sorted(bench.ext_key(p) for p in r13["points"])
rows14 = {bench.ext_key(p): {r["provider"]: r for r in p["rows"]} for p in r14["points"]}
long14 = [p for p in r14["points"] if p["nk"] >= 4096]
nd_over = [rows14[bench.ext_key(p)]["fa_lib"]["bwd_ms"] / rows14[bench.ext_key(p)]["fa_lib_nd"]["bwd_ms"]
           for p in long14 if not p["causal"]]
before14 = {bench.ext_key(p): p for p in now}
moved = {c: [best(p, "sdpa_cudnn", "bwd") / best(before14[bench.ext_key(p)], "sdpa_cudnn", "bwd")
             for p in long14 if p["causal"] is c] for c in (False, True)}
share14 = [rows14[bench.ext_key(p)]["fa_lib_nd"]["bwd_tflops"] / r14["ceilings"]["bf16_matmul_TFLOPs"]
           for p in long14 if not p["causal"] and p["dtype"] == "bf16"]

now, count_now, geo_now, geo_now_all, now_fwd, now_bwd, fwd_miss, bwd_miss = standing(bench.EXT_PARTS)
assert len(bench.EXT_PARTS) == 14 and now == bench.extended_sweep()["points"]
un_bwd = [best(p, "sdpa_cudnn", "bwd") for p in now if (p["d"], p["dtype"]) == (128, "bf16")
          and p["kind"] in ("square", "gqa") and p["nq"] >= 4096 and not p["causal"]]
assert rng(nd_over) == "1.04-1.12" and round(geomean(nd_over), 3) == 1.090 and rng(share14) == "0.70-0.75"
assert rng(moved[False]) == "1.03-1.13" and round(geomean(moved[False]), 3) == 1.097
assert rng(moved[True]) == "0.95-1.04" and round(geomean(moved[True]), 3) == 0.999
assert count_now == {"fwd": 223, "bwd": 224} and round(geo_now_all, 3) == 0.923
assert [round(geo_now[m], 2) for m in ("fwd", "bwd")] == [0.97, 0.88]
assert fwd_miss == [("small", "fp16", 256, "causal", 0.95)] and bwd_miss == []
assert [round(x, 2) for x in (min(now_fwd), max(now_fwd), min(now_bwd), max(now_bwd))] == [0.94, 1.19, 0.82, 1.00]
assert [sum(x >= 0.95 for x in xs) for xs in (now_fwd, now_bwd)] == [15, 3] and rng(un_bwd) == "0.90-0.97"

# What was tried and kept (the appendix's table): change, where, pass, old time / new time, data file.
abl = []

for m, name in (("fwd", "fwd"), ("bwd", "bwd")):
    xs = [speedup(r, "new", m) for r in port["comparison"]["rows"][:40]]
    abl.append(("plain pointers (the port)", "40 sweep points", name,
                f"{geomean(xs):.3f} (geo.)", "port-comparison"))

streams = benchmarks.data.load_json("probe-streams-nvidia-h200.json")
xs = [min(r["serial_ms"]) / min(r["concurrent_ms"]) for r in streams["dense"]]
xs += [min(r["fa_lib_bwd_serial_ms"]) / min(r["fa_lib_bwd_concurrent_ms"]) for r in streams["points"]]
abl.append(("dQ kernel on a second stream", f"{len(xs)} points", "bwd",
            rng(xs), "probe-streams"))
stream_gain = xs

d256 = benchmarks.data.load_json("configs-d256-nvidia-h200.json")
xs = []
for n, causal in {(r["n"], r["causal"]) for r in d256["probe"] if r["kernel"] == "dq"}:
    rows = {tuple(r["config"]) if r["config"] else None: r["ms"] for r in d256["probe"]
            if r["kernel"] == "dq" and (r["n"], r["causal"]) == (n, causal)}
    xs.append(rows[None] / rows[kernels.DEFAULT_TABLE["dq"][(2, 256)][0][2]])
abl.append(("dQ blocks 128 x 32, d = 256", f"{len(xs)} points", "bwd", rng(xs), "configs-d256"))
d256_gain = xs

for name, probe_x, kern in (("fwd", probe_fwd, "fwd"), ("bwd", probe_dq, "dq")):
    small = kernels.SMALL_GRID[(kern, 2, 256)][1]
    xs = []
    for causal in (False, True):
        rows = [r for r in probe_x["probe"] if r["causal"] is causal and r["nq"] == 512]
        base = next(r["ms"] for r in rows if r["config"] is None)
        xs.append(base / next(r["ms"] for r in rows if r["config"] and tuple(r["config"]) == small))
    abl.append(("half-size blocks, < 1 wave", "d = 256 prefill", name, rng(xs),
                probe_x["part"]))

tma = {case_name(c): c["modes"]["two_pass_fixed"]["bwd_ms"] / c["modes"]["one_pass_tma"]["bwd_ms"]
       for c in onepass["points"] if picks_one_pass(c)}
abl.append(("one-pass backward (TMA dQ)", ", ".join(tma), "bwd, not det.",
            rng(list(tma.values())), "onepass"))

launch_rows = [r for r in benchmarks.data.load_json("probe-host-launch-nvidia-h200.json")["launch"]
               if r.get("call") == "forward, no grad"]
xs = [r["triton"]["host_ms"] / r["cached"]["host_ms"] for r in launch_rows]
abl.append(("launch cache (host time)", f"{len(xs)} points", "fwd, no grad",
            rng(xs), "probe-host-launch"))
launch_gain = xs

abl.append(("two column tiles", f"{len(tiles_alone)} points, d = 80-192",
            "fwd", rng(tiles_alone), "probe-split-d-configs"))
abl.append(("block rows for 64 + 32 columns", f"{len(row_gain)} points, d = 96", "fwd",
            rng(row_gain), "probe-split-d-configs"))
abl.append(("two column tiles, backward", f"{len(long)} points, d = 80-96", "bwd",
            rng([r[0] for r in long]), "probe-split-d-bwd"))


def config_gain(name, cfg):
    probe = benchmarks.data.load_json(f"configs-{name}-nvidia-h200.json")["probe"]

    def key(r):
        return (r["b"], r["hkv"], r["nq"], r["nk"])

    base = {key(r): r["ms"] for r in probe if r["config"] is None}
    return {key(r): base[key(r)] / r["ms"] for r in probe if r["config"] == list(cfg)}


short96 = config_gain("fwd96short", kernels.DEFAULT_TABLE["fwd"][(2, 96)][0][2])
taken = [x for (b, _, nq, _), x in short96.items() if nq <= kernels.DEFAULT_TABLE["fwd"][(2, 96)][0][0]]
abl.append(("d = 96 causal to 1k: 64 x 32", f"{len(taken)} points", "fwd", rng(taken), "configs-fwd96short"))
dq96 = config_gain("dq96prefill", kernels.SMALL_GRID[("dq", 2, 96)][1])
abl.append(("d = 96 dQ under 2 waves: 64 x 32", "d = 96 prefill", "bwd", rng(list(dq96.values())),
            "configs-dq96prefill"))

abl.append(("warp-specialized forward (Gluon)", f"{len(hop_taken)} points, d = 64, 128", "fwd",
            rng(hop_taken), "probe-hopper-fwd"))

abl.append(("Hopper tiles in pairs of heads", "d = 128, square, N <= 2k", "fwd",
            rng(og["d = 128, square, N <= 2k"][2]), "probe-hopper-order"))

abl.append(("warp-specialized dK/dV (Gluon)", f"{len(taken_b)} timings, d = 64, 128", "bwd",
            rng(taken_b), "probe-hopper-bwd"))

abl.append(("two warpgroups on one key tile (Gluon)", f"{len(taken256)} points, d = 256", "bwd",
            rng(taken256), "probe-hopper-bwd256"))

abl.append(("prefill on the split kernel", f"{len(split_gain)} timings, d = 64, 256", "fwd",
            rng(split_gain), "probe-split-fwd"))

abl.append(("Gluon forward at d = 256", f"{len(gain256)} points, d = 256", "fwd", rng(gain256),
            "probe-hopper-fwd256"))

for m in ("fwd", "bwd"):
    abl.append(("launch plans (host time)", "32 points", m, rng(plan_gain[m]), "probe-plan"))

abl.append(("warp-specialized dQ (Gluon)", f"{len(dq_gain['gluon_n128_s2'])} points, d = 128", "bwd",
            rng(dq_gain["gluon_n128_s2"]), "probe-hopper-dq"))

abl.append(("one pass at d = 128 (split, TMA dQ)", f"{len(split_un)} timings, unmasked", "bwd, not det.",
            rng(split_un), "probe-onepass-split"))
assert [round(geomean([speedup(r, "new", m) for r in port["comparison"]["rows"][:40]]), 3)
        for m in ("fwd", "bwd")] == [1.045, 1.038]
assert (round(min(stream_gain), 3), round(max(stream_gain), 3), len(stream_gain)) == (1.001, 1.084, 16)
assert (round(min(d256_gain), 2), round(max(d256_gain), 2)) == (1.26, 1.32)
assert list(tma) == ["causal 16k"] and round(tma["causal 16k"], 3) == 1.039
assert (round(min(launch_gain), 2), round(max(launch_gain), 2)) == (1.26, 1.49)
assert [round(x, 2) for x in sorted(taken)] == [1.04, 1.30] and round(short96[8, 20, 2048, 2048], 2) == 0.97
assert [round(x, 2) for x in sorted(dq96.values())] == [1.11, 1.16]
assert abl[13][1:4] == ("64 points, d = 64, 128", "fwd", "1.02-1.78") and abl[14][3] == "1.17-1.26"
assert abl[15][1:4] == ("28 timings, d = 64, 128", "bwd", "1.04-1.19")
assert (abl[16][1:4] == ("18 points, d = 256", "bwd", "1.47-1.91")
        and abl[17][1:4] == ("9 timings, d = 64, 256", "fwd", "1.17-1.50"))
assert abl[18][1:4] == ("56 points, d = 256", "fwd", "0.78-1.88")
assert len(abl) == 23 and abl[21][3] == "1.04-1.11" and abl[22][3] == "1.05-1.11" and [
    abl[j][3] for j in (19, 20)] == ["0.78-1.84", "1.09-2.63"]

# ---------------------------------------------------------------------------------------------------------------
# Figures of a review of the pages 11a-11f.
# The matrix rate is a reference, not a bound: each run of the extended sweep measured it again, and kernels of the
# sweep go above the default sweep's 694.1 TFLOP/s (11a, 11c).
ext_matmul = {name: benchmarks.data.load_json(name)["ceilings"]["bf16_matmul_TFLOPs"]
              for name in ("extended-nvidia-h200.json",) + bench.EXT_PARTS}
top_fa_fwd = max(now, key=lambda p: next(r["fwd_tflops"] for r in p["rows"] if r["provider"] == "fa_lib"))
top_fa_fwd_tflops = next(r["fwd_tflops"] for r in top_fa_fwd["rows"] if r["provider"] == "fa_lib")
assert [round(min(ext_matmul.values())), round(max(ext_matmul.values()))] == [673, 711]
assert round(top_fa_fwd_tflops) == 742 and top_fa_fwd["d"] == 256 and top_fa_fwd_tflops > MATMUL_TFLOPS
ceil14 = r14["ceilings"]["bf16_matmul_TFLOPs"]
assert round(ceil13, 1) == 687.0 and round(ceil14, 1) == 679.2
assert ext_matmul["extended-hopper-dq-nvidia-h200.json"] == ceil13
assert sum(x > 1 for x in need_two) == 11 and len(need_two) == 16

# The fastest point of the portable backward in the default sweep (11c).
fastest_bwd = max(points, key=lambda k: rate(k, "fa_lib", "bwd"))
assert fastest_bwd == ("bf16", 128, False, 16384) and round(rate(fastest_bwd, "fa_lib", "bwd")) == 410
assert round(TWO_PASS / ONE_PASS * rate(fastest_bwd, "fa_lib", "bwd")) == 574

# The Gluon forward at d = 64 where dispatch.faster does not take it (11b): faster at some points, by little.
d64_left = [hop_gain(p) for p in hp if p["d"] == 64 and not routed(p)]
d64_left_won = [hop_gain(p) for p in hp if p["d"] == 64 and not routed(p) and hop_gain(p) > 1
                and not (p["kind"] == "prefill" and p["causal"])]
assert d64_left == hop_left and len(d64_left) == 31 and sum(g > 1 for g in d64_left) == 14
assert len(d64_left_won) == 13 and round(max(d64_left_won), 2) == 1.08 and [round(g, 2) for g in prefill64] == [1.13]
assert not any(routed(p) for p in hp if p["d"] == 64 and p["kind"] == "prefill")
assert all(p["causal"] and p["nq"] >= dispatch.D64_CAUSAL_MIN_TOKENS == 4096 for p in hp if p["d"] == 64 and routed(p))
assert rng(d64_gain) == "1.02-1.17" and len(d64_gain) == 8

# Small grids (11b): the table's rows, and the Gluon forward at the d = 256 prefill (64 programs of 128 rows).
assert sorted(kernels.SMALL_GRID) == [("dq", 2, 96), ("dq", 2, 256), ("fwd", 2, 256)]
assert kernels_hopper.BLOCK_M == 128 and all(dispatch.faster(256, 512, 8192, c) for c in (False, True))
assert 256 not in dispatch.DQ_HEAD_DIMS and 96 not in dispatch.DQ_HEAD_DIMS
pre256_gain = [hop_gain(p) for p in fp if p["kind"] == "prefill"]
assert rng(pre256_gain) == "1.24-1.29" and len(pre256_gain) == 4
assert 2 * 8 * 512 // kernels_hopper.BLOCK_M == 64

# The profile's waves (11b): 2048 programs, one per SM a round.
assert round(2048 / env["sm_count"], 2) == 15.52 and env["sm_count"] == 132 and env["capability"] == [9, 0]
# The L2 arithmetic of the heads' order (11b): K and V of one head at 1k tokens, d = 128, bf16.
assert 132 * kv_head == 66 * 2**20 and L2_BYTES == 50 * 2**20
# A second tile that would run past the head dim is not taken (11b).
assert dispatch._head_tiles(72) == (128, 0) and 64 + 16 - 72 == 8
assert "illegal memory access at d = 40, bf16, causal" in " ".join(dispatch._head_tiles.__doc__.split())
# Triton 3.6's automatic warp specialization (11b).
assert "only supported on Blackwell GPUs and only works on simple matmul loops" in " ".join(
    triton.language.range.__doc__.split())
# The Gluon dK/dV kernel's Q/dO slots (11c).
assert kernels_hopper.BWD_STAGES == {64: 3, 128: 2, 256: 2}
# The Gluon dQ kernel: 128 keys a step; its bit-for-bit check was of the 64-key variant (11c).
assert kernels_hopper.DQ_BLOCK_N[128] == 128 and "gluon: 64 keys a step" in dqp["note"] and len(same_dq) == 12

# The portable one-pass rule (11c, 11f): one timed win, at d = 128, 16k tokens; 8k not timed, 4k lost.
op_cases = {case_name(c): c for c in onepass["points"]}
assert list(tma) == ["causal 16k"] and round(tma["causal 16k"], 3) == 1.039 and op_cases["causal 16k"]["d"] == 128
assert not any(c["d"] == 128 and c.get("causal") and c["hq"] == c["hkv"] and c["n"] == 8192
               for c in onepass["points"])
assert one_pass_won["causal 4k"] is False and op_cases["causal 4k"]["d"] == 128
# ... and at d = 96 (a 128-wide tile, so the rule's) on the H200 the extended sweep has deterministic=False slower.
nd96 = [next(r["bwd_ms"] for r in p["rows"] if r["provider"] == "fa_lib_nd")
        / next(r["bwd_ms"] for r in p["rows"] if r["provider"] == "fa_lib")
        for p in now if p["d"] == 96 and p["causal"] and p["hq"] == p["hkv"] and max(p["nq"], p["nk"]) >= 8192]
assert rng(nd96) == "1.12-1.68" and len(nd96) == 8 and triton.next_power_of_2(65) == 128

# The host (11d). do_bench empties L2 by zero-filling a 256 MiB buffer before it records each call's start event.
_bench_src = inspect.getsource(triton.testing.do_bench)
assert _bench_src.index("runtime.driver.active.clear_cache(cache)\n        # record time of `fn`") < _bench_src.index(
    "start_event[i].record()")
assert "cache_size = 256 * 1024 * 1024" in inspect.getsource(
    triton.backends.nvidia.driver.CudaDriver.get_empty_cache_for_benchmark)
FILL_BYTES = 256 * 2**20
fill_us = FILL_BYTES / (COPY_TBPS * 1e12) * 1e6  # a zero-fill writes each byte once; the copy's rate counts bytes
assert round(fill_us) == 63                      # read plus bytes written
# fa_lib's figures from the second call of the probe alone (its code is what fa_lib runs); FA2's host time and
# fa_lib's kernel time compared between the two calls.
after = hosts[1]["points"]
kernel_gain_a = [p["sdpa_flash"]["graph_ms"] / p["fa_lib"]["graph_ms"] for p in after]
host_us_a = {n: [p[n]["host_ms"] * 1e3 for p in after] for n in ("fa_lib", "sdpa_flash")}
slow_a = [p for p in after if p["fa_lib"]["do_bench_ms"] > p["sdpa_flash"]["do_bench_ms"]]
waited_a = [p for p in after if p["fa_lib"]["do_bench_ms"] > 1.1 * p["fa_lib"]["graph_ms"]]
assert rng(kernel_gain_a) == "1.05-2.30" and len(kernel_gain_a) == 32 and len(slow_a) == 11
assert [round(x) for n in ("fa_lib", "sdpa_flash")
        for x in (min(host_us_a[n]), max(host_us_a[n]))] == [96, 193, 44, 159]
assert all(p["fa_lib"]["host_ms"] > p["fa_lib"]["graph_ms"] for p in slow_a)
host_over_a = [p for p in after if p["fa_lib"]["host_ms"] > p["fa_lib"]["graph_ms"]]
assert all(p in host_over_a for p in waited_a) and (len(waited_a), len(host_over_a)) == (17, 21)
assert rng([p["fa_lib"]["do_bench_ms"] / p["fa_lib"]["graph_ms"] for p in waited_a]) == "1.12-1.99"
assert sum(p["fa_lib"]["host_ms"] * 1e3 > p["fa_lib"]["graph_ms"] * 1e3 + fill_us for p in waited_a) == 3
assert "host_ms: the least mean of seven bursts of eight calls" in hosts[0]["note"]
assert sum(p["fa_lib"]["host_ms"] * 1e3 > p["fa_lib"]["graph_ms"] * 1e3 + fill_us for p in slow_a) == 1
small_graph = [p["fa_lib_graph_fwd_ms"] for p in pp if p["kind"] == "small"]
assert rng(small_graph) == "0.10-0.13" and len(small_graph) == 16
