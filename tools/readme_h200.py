"""README's "Triton kernel on the NVIDIA H200": the table and the numbers of its summary, from the package data.

    .venv/bin/python tools/readme_h200.py

Prints the markdown table (one row per sweep point) and the ranges that README.md quotes, computed from
fa_lib/data/sweep-nvidia-h200.json and port-comparison-nvidia-h200.json, so that the section is pasted
from this output instead of typed. Chapter 11 (book/11_performance.ipynb) computes and asserts the same
numbers.
"""
import math

import fa_lib.data


def geomean(values):
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main():
    sweep = fa_lib.data.load_json("sweep-nvidia-h200.json")
    ceilings = {"first": sweep["ceilings"], "second": sweep["ceilings_second_run"]}
    print("ceilings: " + "; ".join(f"{run} run {c['copy_TBps']:.2f} TB/s, {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
                                   for run, c in ceilings.items()))
    print("runs: " + ", ".join(f"{run}: {sorted({'causal' if c['causal'] else 'no mask' for c in sweep['configs'] if c['run'] == run})}"
                               for run in ceilings) + "\n")

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
    run_of = {(c["dtype"], c["d"], c["causal"], c["n"]): c["run"] for c in sweep["configs"]}
    rate = {(c["dtype"], c["d"], c["causal"], c["n"]): {r["provider"]: r for r in c["rows"]}["fa_lib"] for c in sweep["configs"]}
    best = max(keys, key=lambda k: rate[k]["fwd_tflops"])
    ceiling = ceilings[run_of[best]]["bf16_matmul_TFLOPs"]
    print(f"fastest fa_lib point {best} ({run_of[best]} run): forward {rate[best]['fwd_tflops']:.0f} TFLOP/s, "
          f"{rate[best]['fwd_tflops'] / ceiling:.0%} of its run's matmul ceiling ({ceiling:.0f}), "
          f"backward {rate[best]['bwd_tflops']:.0f}")

    port = fa_lib.data.load_json("port-comparison-nvidia-h200.json")
    on_sweep = [r for r in port["rows"] if (r["point"]["dtype"], r["point"]["d"], r["point"]["causal"], r["point"]["n"]) in run_of
                and "hkv" not in r["point"]]
    assert len(on_sweep) == len(keys)
    for m in ("fwd", "bwd"):
        s = [min(r["ms"]["old"][m]) / min(r["ms"]["new"][m]) for r in on_sweep]  # above 1: shipped is faster
        print(f"shipped / block pointers, {m} (old time / new time, {len(s)} sweep points): "
              f"geometric mean {geomean(s):.2f}, {min(s):.2f}–{max(s):.2f}")


if __name__ == "__main__":
    main()
