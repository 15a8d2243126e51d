"""The ring's precision at long sequences, on one GPU: ``python -m benchmarks.cp_precision --out-dir DIR``.

`fa_lib.context_parallel.ring_on_one_device` runs the arithmetic of a W-rank ring (the same blocks, kernels and
float32 merges as `ring_attention` on W GPUs) on one device, so its error against a float64 reference can be
measured at 128k tokens without W GPUs. For each ring (W = 2, 4, 8 zigzag, W = 2 contiguous; causal), the ring on
the fast kernels (the sm_90 Gluon forward and backward writing float32 partials) and on the portable Triton
kernels (`kernel_options(hopper_*="never")`), and one-GPU `flash_attention`, each against attention computed in
float64 (chunked over query rows): the largest absolute error of o, dq, dk, dv, and of the LSE. Writes
``cp-precision-<device>.json``."""
import argparse
import contextlib
import json
import os
import time

import torch

from fa_lib import context_parallel as cp
from fa_lib import kernel_options, kernels_hopper
from fa_lib.ops import flash_attention

from .bench import _slug, environment


def reference64(q, k, v, do, causal, chunk=4096):
    """(o, lse, dq, dk, dv) in float64, row chunk by row chunk (the scores of a chunk: chunk x N float64)."""
    q, k, v, do = (t.double() for t in (q, k, v, do))
    b, h, n, d = q.shape
    group = h // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = d ** -0.5
    o, lse, dq = torch.empty_like(q), q.new_empty(q.shape[:3]), torch.empty_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    cols = torch.arange(n, device=q.device)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        s = q[:, :, r0:r1] @ k.transpose(-1, -2) * scale
        if causal:
            s.masked_fill_(cols[None, :] > torch.arange(r0, r1, device=q.device)[:, None], float("-inf"))
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        del s
        l = p.sum(-1, keepdim=True)
        p /= l
        lse[:, :, r0:r1] = (m + l.log())[..., 0]
        o_c = p @ v
        o[:, :, r0:r1] = o_c
        delta = (do[:, :, r0:r1] * o_c).sum(-1, keepdim=True)
        dp = do[:, :, r0:r1] @ v.transpose(-1, -2)
        ds = p * (dp - delta)
        del dp
        dq[:, :, r0:r1] = ds @ k * scale
        dk += ds.transpose(-1, -2) @ q[:, :, r0:r1] * scale
        dv += p.transpose(-1, -2) @ do[:, :, r0:r1]
        del p, ds
    if group > 1:
        dk, dv = (t.unflatten(1, (-1, group)).sum(2) for t in (dk, dv))
    return o, lse, dq, dk, dv


def errors(got, gold):
    return {name: float((g.double() - r).abs().max()) for name, g, r in zip(("o", "lse", "dq", "dk", "dv"), got, gold)}


@contextlib.contextmanager
def gluon_launches():
    """Inside: a dict counting the Gluon launches (forward, dK/dV, dQ) made, to say which kernels ran; the module's
    functions are put back on exit."""
    calls = {"forward": 0, "backward_dkdv": 0, "backward_dq": 0}
    originals = {name: getattr(kernels_hopper, name) for name in calls}

    def counted(name):
        def wrapped(*a, **kw):
            calls[name] += 1
            return originals[name](*a, **kw)
        return wrapped

    for name in calls:
        setattr(kernels_hopper, name, counted(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(kernels_hopper, name, original)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cp_precision", description=__doc__)
    parser.add_argument("--n", type=int, default=131072)
    parser.add_argument("--heads", default="2/2", help="Hq/Hkv (default 2/2)")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "data"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m benchmarks.cp_precision needs a CUDA GPU")
    hq, hkv = (int(x) for x in args.heads.split("/"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(1, hq, args.n, args.d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, hkv, args.n, args.d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    t0 = time.perf_counter()
    gold = reference64(q, k, v, do, causal=True)
    torch.cuda.synchronize()
    results = {"part": "cp-precision", "environment": environment(),
               "problem": dict(b=1, hq=hq, hkv=hkv, n=args.n, d=args.d, dtype="bf16", causal=True),
               "reference_s": round(time.perf_counter() - t0, 1), "rows": []}
    with gluon_launches() as calls:
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        o, lse = flash_attention(qs, ks, vs, causal=True, return_lse=True)
        o.backward(do)
        one_gpu = errors((o, lse, qs.grad, ks.grad, vs.grad), gold)
        results["rows"].append(dict(provider="fa_lib_1gpu", errors=one_gpu, gluon_calls=dict(calls)))
        for world, layout in ((2, "zigzag"), (4, "zigzag"), (8, "zigzag"), (2, "contiguous")):
            for kernels in ("fast", "portable"):
                calls.update({name: 0 for name in calls})
                never = dict(hopper_forward="never", hopper_backward="never", hopper_dq="never")
                with kernel_options(**(never if kernels == "portable" else {})):
                    got = cp.ring_on_one_device(q, k, v, world, causal=True, layout=layout, do=do)
                torch.cuda.synchronize()
                row = dict(provider=f"ring_{layout}", world=world, kernels=kernels, errors=errors(got, gold),
                           gluon_calls=dict(calls))
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"cp-precision-{_slug(results['environment']['device'])}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
