"""The read ceiling at issue 12's one-sequence decoding sizes: how fast can any kernel read the bytes a decoding step
must read? For the caches of B = 1, H_kv = 8, d = 128, bf16 at N_k = 16k, 64k and 128k keys (K and V: 67, 268 and
537 MB), timed the way `bench --decode` times a step (per call in a CUDA graph of `--layers` calls, each on its own
cache, and one call per graph; the least of `--rounds` medians): a Triton kernel that only reads the cache and sums it
(pointer loads; grids of 1 to 8 programs per SM, blocks of 32 to 128 rows, and a TMA-descriptor version), torch's
`sum` over the same bytes, a device-to-device copy of them, and fa_lib's decoding step at N_q = 1 and 32/8 heads
(with a workspace). Fractions are of the copy bandwidth measured in the same run (`bench.measure_ceilings`).
Writes JSON to --out.

    python3 -m benchmarks.probes.probe_read_ceiling --out $OUT/probe-read-ceiling.json
"""
import argparse
import json
import sys
from pathlib import Path


import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks import bench
from fa_lib import decode  # noqa: E402

D = 128


@triton.jit
def _read_ptr(X, Out, rows_per_prog, n_rows, BLOCK: tl.constexpr, D: tl.constexpr):
    """Program p sums rows [p * rows_per_prog, + rows_per_prog) of X (n_rows, D) into Out[p]."""
    pid = tl.program_id(0)
    offs_r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([BLOCK, D], dtype=tl.float32)
    start = pid * rows_per_prog
    for r in range(start, tl.minimum(start + rows_per_prog, n_rows), BLOCK):
        rows = r + offs_r
        x = tl.load(X + rows[:, None].to(tl.int64) * D + offs_d[None, :], mask=rows[:, None] < n_rows, other=0.0)
        acc += x.to(tl.float32)
    tl.store(Out + pid, tl.sum(acc))


@triton.jit
def _read_desc(X, Out, rows_per_prog, n_rows, BLOCK: tl.constexpr, D: tl.constexpr):
    """As `_read_ptr`, the rows loaded through a TMA descriptor (rows_per_prog a multiple of BLOCK)."""
    pid = tl.program_id(0)
    desc = tl.make_tensor_descriptor(X, shape=[n_rows, D], strides=[D, 1], block_shape=[BLOCK, D])
    acc = tl.zeros([BLOCK, D], dtype=tl.float32)
    start = pid * rows_per_prog
    for r in tl.range(start, tl.minimum(start + rows_per_prog, n_rows), BLOCK):
        acc += desc.load([r, 0]).to(tl.float32)
    tl.store(Out + pid, tl.sum(acc))


def _allocator(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def variants(sms):
    out = {}
    for per_sm in (1, 2, 4, 8):
        for block, warps, stages in ((32, 4, 1), (64, 4, 1), (64, 8, 1), (128, 8, 1)):
            out[f"ptr_p{per_sm}_b{block}_w{warps}"] = ("ptr", per_sm * sms, block, warps, stages)
    for per_sm in (1, 2, 4):
        for block, stages in ((64, 3), (64, 4), (128, 3)):
            out[f"desc_p{per_sm}_b{block}_s{stages}"] = ("desc", per_sm * sms, block, 4, stages)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=bench.DECODE_LAYERS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nks", type=int, nargs="+", default=[16384, 65536, 131072])
    args = ap.parse_args()
    triton.set_allocator(_allocator)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"part": "probe-read-ceiling", "environment": bench.environment(), "layers": args.layers,
           "convention": __doc__.split("\n\n")[0], "ceilings": bench.measure_ceilings(), "points": []}
    copy = res["ceilings"]["copy_TBps"]
    print(f"copy {copy:.3f} TB/s", flush=True)
    for nk in args.nks:
        h_kv, h_q = 8, 32
        n_rows = 2 * h_kv * nk  # K and V of one sequence, one buffer per layer
        nbytes = n_rows * D * 2
        bufs = [torch.randn(2, 1, h_kv, nk, D, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]
        copies = [torch.empty_like(b) for b in bufs]
        q = torch.randn(1, h_q, 1, D, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((1,), nk, dtype=torch.int32, device="cuda")
        ws = decode.workspace(q)
        fns = {"fa_lib_decode": [lambda b=b: decode.flash_attention_with_kvcache(
                   q, b[0], b[1], cache_seqlens=lens, workspace=ws) for b in bufs],
               "torch_sum": [lambda b=b: b.sum(dtype=torch.float32) for b in bufs],
               "copy": [lambda b=b, c=c: c.copy_(b) for b, c in zip(bufs, copies)]}
        outs = {}
        for name, (kind, programs, block, warps, stages) in variants(sms).items():
            rows_per_prog = triton.cdiv(triton.cdiv(n_rows, programs), block) * block
            grid = (triton.cdiv(n_rows, rows_per_prog),)
            out = outs[name] = torch.empty(grid[0], device="cuda", dtype=torch.float32)
            kern = _read_ptr if kind == "ptr" else _read_desc
            fns[name] = [lambda b=b, kern=kern, grid=grid, out=out, rpp=rows_per_prog, block=block, warps=warps,
                         stages=stages: kern[grid](b, out, rpp, n_rows, BLOCK=block, D=D, num_warps=warps,
                                                   num_stages=stages) for b in bufs]
        row = dict(b=1, hq=h_q, hkv=h_kv, nq=1, nk=nk, bytes=nbytes, times={}, errors={})
        with torch.no_grad():
            ref = float(bufs[0].sum(dtype=torch.float64))
            for name, f in fns.items():
                try:
                    r = f[0]()
                    if name.startswith(("ptr", "desc")):  # the read kernels sum what they read: all of it
                        got = float(outs[name].sum(dtype=torch.float64))
                        if abs(got - ref) > 1e-3 * max(1.0, abs(ref)) + 1.0:
                            raise AssertionError(f"sum {got} != {ref}")
                    del r
                    row["times"][name] = {"graph_ms": [], "layered_ms": []}
                except Exception as e:  # a variant that does not compile or does not read everything
                    row["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
            for _ in range(args.rounds):
                for name in row["times"]:
                    f = fns[name]
                    row["times"][name]["graph_ms"].append(bench._graph_ms(f[0]))
                    row["times"][name]["layered_ms"].append(bench._graph_ms(lambda f=f: [g() for g in f]) / len(f))
        best = {n: {k: min(v) for k, v in t.items()} for n, t in row["times"].items()}
        # a copy moves the bytes twice (read + write); everything else reads them once
        row["fraction_layered"] = {n: (2 if n == "copy" else 1) * nbytes / (t["layered_ms"] * 1e-3) / 1e12 / copy
                                   for n, t in best.items()}
        row["best"] = best
        reads = {n: t for n, t in best.items() if n.startswith(("ptr", "desc", "torch_sum"))}
        row["fastest_read"] = min(reads, key=lambda n: reads[n]["layered_ms"]) if reads else None
        res["points"].append(row)
        Path(args.out).write_text(json.dumps(res, indent=1))
        fr = row["fastest_read"]
        print(f"Nk {nk // 1024}k, {nbytes / 1e6:.0f} MB: fa_lib {best['fa_lib_decode']['layered_ms'] * 1e3:.1f} us "
              f"({row['fraction_layered']['fa_lib_decode']:.2f}), fastest read {fr} "
              f"{best[fr]['layered_ms'] * 1e3:.1f} us ({row['fraction_layered'][fr]:.2f}), torch_sum "
              f"{row['fraction_layered'].get('torch_sum', 0):.2f}, copy {row['fraction_layered'].get('copy', 0):.2f}; "
              f"0.8 needs {nbytes / (0.8 * copy * 1e12) * 1e6:.1f} us; errors {sorted(row['errors'])}", flush=True)
        for n in sorted(best, key=lambda n: best[n]["layered_ms"])[:8]:
            print(f"   {n:28s} {best[n]['layered_ms'] * 1e3:7.1f} us layered  {best[n]['graph_ms'] * 1e3:7.1f} us one "
                  f"{row['fraction_layered'][n]:.3f}", flush=True)
        del bufs, copies, fns
        bench._free()


if __name__ == "__main__":
    main()
