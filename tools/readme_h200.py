"""README's "Triton kernel on the NVIDIA H200": the table and the numbers of its summary, from the package data.

    .venv/bin/python tools/readme_h200.py              # the sweep's table and summary
    .venv/bin/python tools/readme_h200.py --extended   # the extended sweep's table (issue 14) and its misses

Prints the markdown table (one row per sweep point) and the ranges that README.md quotes, computed from
fa_lib/data/sweep-nvidia-h200.json (one run, one set of ceilings; one point measured four times, kept as
the median) and port-comparison-nvidia-h200.json, so that the section is pasted from this output instead
of typed. Chapter 11 (book/11_performance.ipynb) computes and asserts the same
numbers.
"""
import math

import fa_lib.bench
import fa_lib.data


def geomean(values):
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main():
    sweep = fa_lib.data.load_json("sweep-nvidia-h200.json")
    env, ceilings = sweep["environment"], sweep["ceilings"]
    print(f"one run, dated {env['date']} (UTC, when it ended): torch {env['torch']}, triton {env['triton']}, "
          f"CUDA {env['cuda']}, cuDNN {env['cudnn']}")
    print(f"ceilings: copy {ceilings['copy_TBps']:.2f} TB/s, bf16 matmul {ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    carried = sorted({(r["provider"], r["carried_from"]) for c in sweep["configs"] for r in c["rows"] if "carried_from" in r})
    print("carried over: " + ", ".join(f"{p} from {d}" for p, d in carried))
    for c in sweep["configs"]:
        if "remeasured" in c:
            values = c["remeasured"]["values"]  # every provider, every run; the row keeps the median
            fa, row = values["fa_lib"], {r["provider"]: r for r in c["rows"]}["fa_lib"]
            print(f"remeasured: {c['dtype']} D={c['d']} causal={c['causal']} N={c['n']}, runs {c['remeasured']['runs']}: "
                  f"fa_lib fwd " + ", ".join(f"{t:.0f}" for t in fa["fwd_tflops"]) + f" TFLOP/s, kept (median) {row['fwd_tflops']:.0f}; "
                  f"bwd " + ", ".join(f"{t:.0f}" for t in fa["bwd_tflops"]) + f", kept {row['bwd_tflops']:.0f}")
            for other in ("sdpa_flash", "sdpa_cudnn"):
                print(f"  fa_lib / {other} fwd, run by run: " + ", ".join(
                    f"{a / b:.2f}" for a, b in zip(fa["fwd_tflops"], values[other]["fwd_tflops"])))
    print()

    print("| dtype | D | causal | N | fa_lib fwd / bwd | FA2 fwd / bwd | cuDNN fwd / bwd | fa_lib ÷ FA2 fwd / bwd |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    ratio = {}
    for c in sweep["configs"]:
        rows = {r["provider"]: r for r in c["rows"]}
        key = (c["dtype"], c["d"], c["causal"], c["n"])
        cells = [" / ".join(f"{rows[p][f'{m}_tflops']:.0f}" for m in ("fwd", "bwd")) for p in ("fa_lib", "sdpa_flash", "sdpa_cudnn")]
        for m in ("fwd", "bwd"):
            for other in ("sdpa_flash", "sdpa_cudnn"):
                ratio[key, m, other] = rows["fa_lib"][f"{m}_tflops"] / rows[other][f"{m}_tflops"]
        cells.append(" / ".join(f"{ratio[key, m, 'sdpa_flash']:.2f}" for m in ("fwd", "bwd")))
        print(f"| {c['dtype']} | {c['d']} | {'yes' if c['causal'] else 'no'} | {c['n']} | " + " | ".join(cells) + " |")
    print()

    keys = [(c["dtype"], c["d"], c["causal"], c["n"]) for c in sweep["configs"]]
    for other in ("sdpa_flash", "sdpa_cudnn"):
        for m in ("fwd", "bwd"):
            r = [ratio[k, m, other] for k in keys]
            print(f"fa_lib / {other} {m}: {min(r):.2f}–{max(r):.2f} (geometric mean {geomean(r):.2f}), "
                  f"faster at {sum(x > 1 for x in r)} of {len(r)}")
            rest = [ratio[k, m, other] for k, c in zip(keys, sweep["configs"]) if "remeasured" not in c]
            print(f"  without the point measured four times: {min(rest):.2f}–{max(rest):.2f}")
    rate = {(c["dtype"], c["d"], c["causal"], c["n"]): {r["provider"]: r for r in c["rows"]}["fa_lib"] for c in sweep["configs"]}
    best = max(keys, key=lambda k: rate[k]["fwd_tflops"])
    ceiling = ceilings["bf16_matmul_TFLOPs"]
    print(f"fastest fa_lib point {best}: forward {rate[best]['fwd_tflops']:.0f} TFLOP/s, "
          f"{rate[best]['fwd_tflops'] / ceiling:.0%} of the matmul ceiling ({ceiling:.0f}), "
          f"backward {rate[best]['bwd_tflops']:.0f}")

    port = fa_lib.data.load_json("port-comparison-nvidia-h200.json")
    point = lambda r: (r["point"]["dtype"], r["point"]["d"], r["point"]["causal"], r["point"]["n"])
    on_sweep = [r for r in port["rows"] if point(r) in rate and "hkv" not in r["point"]]
    assert len(on_sweep) == len(keys)
    speedup = lambda r, m: min(r["ms"]["old"][m]) / min(r["ms"]["new"][m])  # above 1: shipped is faster
    spread = lambda r, p, m: max(r["ms"][p][m]) / min(r["ms"][p][m]) - 1  # of the two repetitions
    for m in ("fwd", "bwd"):
        s = [speedup(r, m) for r in on_sweep]
        print(f"shipped / block pointers, {m} (old time / new time, {len(s)} sweep points): "
              f"geometric mean {geomean(s):.3f}, {min(s):.3f}–{max(s):.3f}")
        for r in on_sweep:
            if speedup(r, m) < 1:
                print(f"  below 1: {point(r)} {speedup(r, m):.3f}; spread of the two repetitions: "
                      f"new {spread(r, 'new', m):.1%}, old {spread(r, 'old', m):.1%}")
    # The first plain-pointer port, for comparison: pointer tiles without a mask, recomputed pointers with one.
    first = {causal: fa_lib.data.load_json(f"port-{name}-nvidia-h200.json")["rows"]
             for causal, name in ((False, "pointer-tiles"), (True, "recomputed-pointers"))}
    for i, r in enumerate(port["rows"]):
        if r not in on_sweep:
            before = first[r["point"]["causal"]][i]
            assert before["point"] == r["point"]
            print(f"off the sweep, {r['point']}: " + ", ".join(
                f"{m} {speedup(r, m):.3f} (first port {speedup(before, m):.3f})" for m in ("fwd", "bwd")))


def extended():
    """The extended sweep as it stands (`fa_lib.bench.extended_sweep()`: fa_lib/data/extended-nvidia-h200.json with
    the later reruns in place), one row per head dim and kind: how many
    points, fa_lib / FA2 forward and backward (range; points at >= 1 with the better of fa_lib's two
    paths), fa_lib / cuDNN (geometric means). Then the issue's three targets, counted."""
    ext = fa_lib.bench.extended_sweep()
    pts = ext["points"]
    assert len(pts) == 224
    r = lambda p, other, m: p["ratio"][f"{other}_{m}_best_path"]
    print("| D | kind | points | ÷ FA2 fwd | ÷ FA2 bwd | ≥ FA2 fwd / bwd | ÷ cuDNN fwd / bwd (geo. mean) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for d in (64, 96, 128, 256):
        for kind in ("square", "gqa", "prefill", "small"):
            g = [p for p in pts if p["d"] == d and p["kind"] == kind]
            f, b = ([r(p, "sdpa_flash", m) for p in g] for m in ("fwd", "bwd"))
            print(f"| {d} | {kind} | {len(g)} | {min(f):.2f}–{max(f):.2f} | {min(b):.2f}–{max(b):.2f} | "
                  f"{sum(x >= 1 for x in f)} / {sum(x >= 1 for x in b)} | "
                  f"{geomean(r(p, 'sdpa_cudnn', 'fwd') for p in g):.2f} / "
                  f"{geomean(r(p, 'sdpa_cudnn', 'bwd') for p in g):.2f} |")
    print()
    for m in ("fwd", "bwd"):
        x = [r(p, "sdpa_flash", m) for p in pts]
        d0 = [p["ratio"][f"sdpa_flash_{m}"] for p in pts]
        print(f"fa_lib >= FA2 {m}: {sum(v >= 1 for v in x)} of {len(x)} (deterministic=True alone: "
              f"{sum(v >= 1 for v in d0)})")
    core = [p for p in pts if p["d"] == 128 and p["dtype"] == "bf16" and p["nq"] >= 4096 and p["nq"] == p["nk"]]
    for m in ("fwd", "bwd"):
        x = [r(p, "sdpa_cudnn", m) for p in core]
        print(f"d = 128, bf16, N >= 4k ({len(core)} points) / cuDNN {m}: {min(x):.2f}–{max(x):.2f}, "
              f"at >= 0.95: {sum(v >= 0.95 for v in x)}")
    print(f"geometric mean / cuDNN, whole sweep, both passes: "
          f"{geomean(r(p, 'sdpa_cudnn', m) for p in pts for m in ('fwd', 'bwd')):.2f}")


if __name__ == "__main__":
    import sys

    extended() if "--extended" in sys.argv[1:] else main()
