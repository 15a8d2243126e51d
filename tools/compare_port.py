"""The kernel port, measured: the block-pointer kernels of commit 56a7977 (autotuned, as they shipped)
against today's kernels (fixed blocks, the default; and `deterministic=False`, autotuned), on the
committed sweep's 40 points plus four off-sweep shapes, in one process, interleaved, two repetitions
each (the best of the two medians is kept). On a CUDA machine, from the repository root:

    mkdir -p /tmp/old && git archive 56a7977 fa_lib | tar -x -C /tmp/old && mv /tmp/old/fa_lib /tmp/old/fa_lib_old
    FA_LIB_OLD=/tmp/old PYTHONPATH=. OUT=. python3 tools/compare_port.py

Writes compare.json to $OUT; the H200 result is fa_lib/data/port-comparison-nvidia-h200.json.
"""
import json, os, sys, time
sys.path.insert(0, os.environ.get("FA_LIB_OLD", "/tmp/old"))
import torch
import fa_lib, fa_lib_old
from fa_lib import kernels
from fa_lib.bench import _inputs, _median_ms, attention_flops, default_sweep

OUT = os.environ.get("OUT", "/tmp")
points = list(default_sweep())
if "--quick" in sys.argv:
    points = points[::7]
extra = [dict(dtype="bf16", d=256, causal=c, n=4096, b=4, h=8) for c in (False, True)]
extra += [dict(dtype="bf16", d=128, causal=True, n=4096, b=4, h=16, hkv=4), dict(dtype="bf16", d=96, causal=False, n=4096, b=4, h=16)]
points += extra

def cfg(c):
    return None if c is None else [c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages]

def fns(causal):
    f = {
        "old": lambda q, k, v: fa_lib_old.flash_attention(q, k, v, causal=causal),
        "new": lambda q, k, v: fa_lib.flash_attention(q, k, v, causal=causal),
        "tuned": lambda q, k, v: fa_lib.flash_attention(q, k, v, causal=causal, deterministic=False),
    }
    if "--no-tuned" in sys.argv:
        del f["tuned"]
    return f

rows = []
t0 = time.time()
print(f"{'point':34s} {'old f/b':>13s} {'new f/b':>13s}  new/old f,b", flush=True)
for p in points:
    dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[p["dtype"]])
    q, k, v, do = _inputs(p["b"], p["h"], p["n"], p["d"], dtype)
    if p.get("hkv"):
        k = k[:, :p["hkv"]].detach().clone().requires_grad_(); v = v[:, :p["hkv"]].detach().clone().requires_grad_()
    fl = {m: attention_flops(p["b"], p["h"], p["n"], p["n"], p["d"], p["causal"], m) for m in ("fwd", "bwd")}
    res = {name: {"fwd": [], "bwd": []} for name in fns(False)}
    for name, fn in fns(p["causal"]).items():
        fn(q, k, v).backward(do)  # compile / tune
    torch.cuda.synchronize()
    tuned_cfg = {} if "--no-tuned" in sys.argv else {n: cfg(getattr(t, "best_config", None)) for n, t in
                 (("fwd", kernels._attn_fwd_tuned), ("dkdv", kernels._attn_bwd_dkdv_tuned), ("dq", kernels._attn_bwd_dq_tuned))}
    for rep in range(2):
        for name, fn in fns(p["causal"]).items():
            if rep == 1 and name == "tuned":
                continue
            res[name]["fwd"].append(_median_ms(lambda: fn(q, k, v)))
            o = fn(q, k, v)
            res[name]["bwd"].append(_median_ms(lambda: o.backward(do, retain_graph=True), grad_to_none=[q, k, v]))
            del o
    best = {n: {m: min(r[m]) for m in r} for n, r in res.items()}
    tf = {n: {m: fl[m] / (best[n][m] * 1e-3) / 1e12 for m in ("fwd", "bwd")} for n in best}
    row = dict(point=p, ms=res, tflops=tf, tuned_configs=tuned_cfg)
    rows.append(row)
    label = f"{p['dtype']} d{p['d']} n{p['n']} b{p['b']} h{p['h']}{'/'+str(p['hkv']) if p.get('hkv') else ''} {'C' if p['causal'] else 'F'}"
    r = lambda a, b, m: best[a][m] / best[b][m]
    print(f"{label:34s} {tf['old']['fwd']:6.0f}/{tf['old']['bwd']:<6.0f} {tf['new']['fwd']:6.0f}/{tf['new']['bwd']:<6.0f} "
          f" new/old {1/r('new','old','fwd'):.3f},{1/r('new','old','bwd'):.3f}"
          f"  rep-spread old {max(res['old']['fwd'])/min(res['old']['fwd']):.3f} "
          f"new {max(res['new']['fwd'])/min(res['new']['fwd']):.3f}", flush=True)
    del q, k, v, do
    torch.cuda.empty_cache()
    json.dump(dict(env=dict(torch=torch.__version__, device=torch.cuda.get_device_name()), rows=rows),
              open(os.path.join(OUT, "compare.json"), "w"), indent=1)  # after every point
print("total", time.time() - t0)
