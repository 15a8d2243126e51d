"""The forward of a prefill (few queries, many keys: a grid smaller than the GPU) through the split-KV decoding
kernels (`fa_lib.flash_attention_with_kvcache` with every key valid, `num_splits` chunks, then the merge)
against `flash_attention`'s forward and SDPA's FA2 and cuDNN. Forward only, under torch.no_grad; each time the
least of `--rounds` do_bench medians (L2 flushed). Writes JSON to --out.

    python3 -m benchmarks.probes.probe_split_fwd --out $OUT/probe-split-fwd.json
"""
import argparse
import json
import sys
from pathlib import Path


import torch  # noqa: E402
import triton  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from benchmarks import bench
from fa_lib import flash_attention, flash_attention_with_kvcache  # noqa: E402

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dims", type=int, nargs="+", default=[256, 128, 64])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    ap.add_argument("--shapes", nargs="+", default=["2,8,8,512,8192", "1,8,8,1024,16384", "2,8,2,512,8192"],
                    help="B,Hq,Hkv,Nq,Nk")
    args = ap.parse_args()
    res = {"part": "probe-split-fwd", "environment": bench.environment(), "convention": __doc__.split("\n\n")[0],
           "points": []}
    for shape in args.shapes:
        b, hq, hkv, nq, nk = map(int, shape.split(","))
        for d in args.dims:
            for causal in (True, False):
                g = torch.Generator(device="cuda").manual_seed(nq + d)
                q = torch.randn(b, hq, nq, d, device="cuda", dtype=torch.bfloat16, generator=g)
                k = torch.randn(b, hkv, nk, d, device="cuda", dtype=torch.bfloat16, generator=g)
                v = torch.randn(b, hkv, nk, d, device="cuda", dtype=torch.bfloat16, generator=g)
                lens = torch.full((b,), nk, dtype=torch.int32, device="cuda")
                fns = {"flash_attention": lambda: flash_attention(q, k, v, causal=causal, return_lse=True)}
                for s in args.splits + [None]:
                    fns[f"split_{s}"] = (lambda s=s: flash_attention_with_kvcache(
                        q, k, v, cache_seqlens=lens, causal=causal, num_splits=s, return_lse=True,
                        check_lengths=False))
                for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                                      ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                    def run(backend=backend):
                        with sdpa_kernel(backend):
                            kk, vv = (k, v) if hq == hkv else (k.repeat_interleave(hq // hkv, 1),
                                                               v.repeat_interleave(hq // hkv, 1))
                            return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal) if nq == nk or not causal \
                                else F.scaled_dot_product_attention(q, kk, vv, attn_mask=_bottom_right(nq, nk))
                    fns[name] = run
                row = dict(b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, causal=causal, ms={}, maxdiff={})
                with torch.no_grad():
                    o_ref, lse_ref = fns["flash_attention"]()
                    for name, fn in fns.items():
                        try:
                            out = fn()
                            if name.startswith("split"):
                                row["maxdiff"][name] = max((out[0].float() - o_ref.float()).abs().max().item(),
                                                           (out[1] - lse_ref).abs().max().item())
                            row["ms"][name] = min(triton.testing.do_bench(fn, warmup=10, rep=50)
                                                  for _ in range(args.rounds))
                        except Exception as e:  # a backend that refuses the shape
                            row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:200]}"
                res["points"].append(row)
                Path(args.out).write_text(json.dumps(res, indent=1))
                ms = row["ms"]
                best = min((v, n) for n, v in ms.items() if n.startswith("split"))
                print(shape, d, "causal" if causal else "full", " ".join(f"{n}={v:.4f}" for n, v in ms.items()),
                      f"| best split {best[1]} fa/best {ms['flash_attention'] / best[0]:.2f} "
                      f"FA2/best {ms.get('sdpa_flash', float('nan')) / best[0]:.2f} "
                      f"FA2/fa {ms.get('sdpa_flash', float('nan')) / ms['flash_attention']:.2f}", flush=True)


def _bottom_right(nq, nk):
    i = torch.arange(nq, device="cuda")[:, None]
    j = torch.arange(nk, device="cuda")[None, :]
    return j <= i + nk - nq


if __name__ == "__main__":
    main()
