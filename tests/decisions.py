"""Which kernels fa_lib launches, with which blocks and grids, for a problem on a GPU it does not have.

Kernels are selected, not run: inside `simulated_gpu(capability, sms)` the tensors are fake CUDA tensors (torch's
FakeTensorMode: shapes, strides and dtypes, no data), the device reports the given compute capability and SM count,
and `fa_lib.launch.launch` (and every autotuned launch) records what it was asked to launch instead of launching it.
`decide(problem)` then runs fa_lib's own launchers for the problem's forward and backward and returns the launches.

The golden file `tests/library/golden_decisions.json` holds these decisions for the benchmarks' points (the extended
sweep, masks, varlen, decode, paged decode and paged prefill) and a few hundred random problems on an sm_90 with 132 SMs (the H200) and an sm_80 with 108 (the A100); the test beside it
requires fa_lib to decide the same today. A change of decision is meant to be made on purpose: rewrite the file
(`python tests/decisions.py --write`) and give the measurement that justifies it in the commit message.

    python tests/decisions.py --write     # from the repository root: the golden file from today's code
    python tests/decisions.py --problems tests/library/golden_decisions.json --write /tmp/x.json  # same problems
"""
from __future__ import annotations

import contextlib
import json
import random
import sys
import types
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "library" / "golden_decisions.json"
DEVICES = {"sm90-132": ((9, 0), 132, 50 * 2**20), "sm80-108": ((8, 0), 108, 40 * 2**20)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _value(x):
    """A launch argument as JSON: tensors and descriptors by kind and shape of their block, numbers as they are."""
    if isinstance(x, torch.Tensor):
        return f"tensor:{str(x.dtype).replace('torch.', '')}"
    if type(x).__name__ == "TensorDescriptor":
        return f"desc:{list(x.block_shape)}"
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return round(x, 9)
    return type(x).__name__  # a layout object, a dtype: its kind is enough


def _digest(values):
    """A short fingerprint of a launch's positional arguments (dozens of strides and sizes): equal or not."""
    import hashlib

    return hashlib.sha1(json.dumps(values).encode()).hexdigest()[:12]


class _Stream:
    def __init__(self, name):
        self.name, self.cuda_stream = name, id(self)

    def wait_stream(self, other):
        pass


class _Recorder:
    def __init__(self):
        self.launches, self.stream = [], "main"

    def launch(self, kernel, grid, args, kwargs):
        name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", repr(kernel))
        self.launches.append(dict(kernel=name, grid=[int(g) for g in grid], stream=self.stream,
                                  args=_digest([_value(a) for a in args]),
                                  kwargs={k: _value(v) for k, v in sorted(kwargs.items())}))

    def tuned(self, kernel_name):
        recorder = self

        class _Tuned:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    recorder.launches.append(dict(kernel=kernel_name, grid="autotuned", stream=recorder.stream,
                                                  args=_digest([_value(a) for a in args]),
                                                  kwargs={k: _value(v) for k, v in sorted(kwargs.items())}))
                return run
        return _Tuned()


@contextlib.contextmanager
def simulated_gpu(capability, sms, l2_bytes):
    """fa_lib deciding for a CUDA device of this compute capability, SM count and L2 size; launches recorded in
    the yielded recorder's `.launches`. Everything patched is put back on leaving."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa_lib import decode, dispatch, kernel_options, kernels, kernels_hopper, launch, ops

    rec = _Recorder()
    props = types.SimpleNamespace(major=capability[0], minor=capability[1], multi_processor_count=sms,
                                  L2_cache_size=l2_bytes, name="simulated")
    main, side = _Stream("main"), _Stream("side")

    @contextlib.contextmanager
    def on_stream(stream):
        before, rec.stream = rec.stream, stream.name
        try:
            yield
        finally:
            rec.stream = before

    patches = [
        (kernels, "INTERPRET", False), (launch, "launch", rec.launch), (kernels, "_SHARED_MEMORY", {}),
        (kernels_hopper, "_DEVICES", {0: (tuple(capability), sms, l2_bytes)}),
        (ops, "_SIDE_STREAMS", {0: side}), (ops, "_ensure_allocator", lambda: None),
        (torch.cuda, "get_device_properties", lambda *a, **k: props),
        (torch.cuda, "get_device_capability", lambda *a, **k: tuple(capability)),
        (torch.cuda, "current_device", lambda: 0), (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "is_current_stream_capturing", lambda: False),
        (torch.cuda, "current_stream", lambda *a, **k: main), (torch.cuda, "stream", on_stream),
        (torch.cuda, "device", lambda *a, **k: contextlib.nullcontext()),
        # a copy between fake CUDA tensors asks for a CUDA build; what is copied does not change a decision
        (torch.Tensor, "copy_", lambda self, src, non_blocking=False: self),
    ]
    for name in dir(kernels):
        if name.endswith("_tuned"):
            patches.append((kernels, name, rec.tuned(name[:-len("_tuned")])))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    dispatch._major.cache_clear()
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        with warnings.catch_warnings(), kernel_options(plans=False), FakeTensorMode(allow_non_fake_inputs=False):
            warnings.simplefilter("ignore")
            yield rec
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
        dispatch._major.cache_clear()


def _tensor(shape, dtype, layout="bhnd"):
    """A fake CUDA tensor (B, H, N, D); layout "bnhd": a (B, N, H, D) storage viewed as (B, H, N, D)."""
    if layout == "bnhd":
        b, h, n, d = shape
        return torch.empty(b, n, h, d, dtype=dtype, device="cuda").transpose(1, 2)
    return torch.empty(shape, dtype=dtype, device="cuda")


def decide(p):
    """The launches of problem `p` (a dict, see `problems`) inside `simulated_gpu`: {"fwd": [...], "bwd": [...]}."""
    from fa_lib import decode, ops

    rec = _current[0]
    dtype = DTYPES[p["dtype"]]
    out = {}
    window, softcap = tuple(p.get("window", (-1, -1))), float(p.get("softcap", 0.0))
    det = p.get("deterministic", True)
    if p["kind"] == "decode":
        b, hq, hkv, nq, nk, d = (p[x] for x in ("b", "hq", "hkv", "nq", "nk", "d"))
        q = _tensor((b, hq, nq, d), dtype, "bnhd")
        page = p.get("page_size")
        table = None
        if page:  # a pool of pages (num_pages, H_kv, page, d) in flash-attn's storage, and its block table
            pages = -(-nk // page)
            cache = torch.empty(b * pages, page, hkv, d, dtype=dtype, device="cuda").transpose(1, 2)
            table = torch.empty(b, pages, dtype=torch.int32, device="cuda")
        else:
            cache = _tensor((b, hkv, nk, d), dtype, "bnhd")
        lens = torch.empty(b, dtype=torch.int32, device="cuda")
        o = _tensor((b, hq, nq, d), dtype, "bnhd")
        lse = torch.empty(b, hq, nq, device="cuda")
        rec.launches.clear()
        decode._attend(q, cache, cache, lens, 0, bool(p["causal"]), d ** -0.5, p.get("num_splits"), o, lse,
                       block_table=table, window=window, softcap=softcap)
        out["fwd"] = list(rec.launches)
        return out
    if p["kind"] == "paged_prefill":
        total_q, hq, hkv, d, page, pages = (p[x] for x in ("total_q", "hq", "hkv", "d", "page_size", "pages"))
        q = torch.empty(total_q, hq, d, dtype=dtype, device="cuda")
        pool = torch.empty(p["batch"] * pages, page, hkv, d, dtype=dtype, device="cuda")
        cu = torch.empty(p["batch"] + 1, dtype=torch.int32, device="cuda")
        table = torch.empty(p["batch"], pages, dtype=torch.int32, device="cuda")
        rec.launches.clear()
        ops._paged_varlen_forward(q, pool, pool, cu, cu, p["max_q"], p["max_k"], bool(p["causal"]), d ** -0.5,
                                  window[0], window[1], softcap, table)
        out["fwd"] = list(rec.launches)
        return out
    if p["kind"] == "varlen":
        total_q, total_k, hq, hkv, d = (p[x] for x in ("total_q", "total_k", "hq", "hkv", "d"))
        q = torch.empty(total_q, hq, d, dtype=dtype, device="cuda")
        k = torch.empty(total_k, hkv, d, dtype=dtype, device="cuda")
        cu = torch.empty(p["batch"] + 1, dtype=torch.int32, device="cuda")
        args = (cu, cu, p["max_q"], p["max_k"], bool(p["causal"]), d ** -0.5, det, window[0], window[1], softcap)
        rec.launches.clear()
        o, lse = ops._varlen_forward(q, k, k, *args)
        out["fwd"] = list(rec.launches)
        rec.launches.clear()
        ops._varlen_backward(torch.empty_like(q), None, q, k, k, o, lse, *args)
        out["bwd"] = list(rec.launches)
        return out
    b, hq, hkv, nq, nk, d = (p[x] for x in ("b", "hq", "hkv", "nq", "nk", "d"))
    layout = p.get("layout", "bhnd")
    q = _tensor((b, hq, nq, d), dtype, layout)
    k, v = (_tensor((b, hkv, nk, d), dtype, layout) for _ in range(2))
    kpm = torch.empty(b, nk, dtype=torch.bool, device="cuda") if p.get("padding") else None
    rec.launches.clear()
    o, lse = ops._forward(q, k, v, bool(p["causal"]), d ** -0.5, det, window=window, softcap=softcap,
                          key_padding_mask=kpm)
    out["fwd"] = list(rec.launches)
    rec.launches.clear()
    ops._backward(torch.empty_like(o), None, q, k, v, o, lse, bool(p["causal"]), d ** -0.5, det, window=window,
                  softcap=softcap, key_padding_mask=kpm)
    out["bwd"] = list(rec.launches)
    return out


_current = [None]


def decisions(device, probs):
    """[decide(p) for p in probs] on the simulated `device` (a key of DEVICES)."""
    with simulated_gpu(*DEVICES[device]) as rec:
        _current[0] = rec
        try:
            return [decide(p) for p in probs]
        finally:
            _current[0] = None


def problems(seed=0, n_random=300):
    """The benchmarks' points (the extended sweep, its off-sweep head dims, masks, varlen, decode) and `n_random`
    random problems, each a dict with a "kind" and its sizes."""
    from benchmarks import bench

    probs = []
    for pt in bench.extended_points():
        for det in (True, False):
            probs.append(dict(kind="dense", dtype=pt["dtype"], d=pt["d"], causal=pt["causal"], b=pt["b"], hq=pt["hq"],
                              hkv=pt["hkv"], nq=pt["nq"], nk=pt["nk"], deterministic=det, source=pt["kind"]))
    for d in (16, 32, 40, 48, 80, 112, 160, 192, 200):  # off the sweep's head dims
        for causal in (False, True):
            probs.append(dict(kind="dense", dtype="bf16", d=d, causal=causal, b=2, hq=8, hkv=8, nq=4096, nk=4096,
                              source="head dims"))
    for pt in bench.mask_points():
        base = dict(dtype=pt["dtype"], d=pt["d"], causal=pt["causal"], hq=pt["hq"], hkv=pt["hkv"],
                    window=list(pt["window"]), softcap=pt["softcap"], source=f"masks {pt['label']}")
        if pt["mask"] == "varlen":
            probs.append(dict(base, kind="varlen", batch=len(pt["doc_lens"]), total_q=pt["b"] * pt["n"],
                              total_k=pt["b"] * pt["n"], max_q=pt["max_seqlen"], max_k=pt["max_seqlen"]))
        else:
            probs.append(dict(base, kind="dense", b=pt["b"], nq=pt["n"], nk=pt["n"],
                              padding=pt["mask"] == "padding"))
    for pt in bench.decode_points():
        probs.append(dict(kind="decode", dtype=pt["dtype"], d=pt["d"], causal=True, b=pt["b"], hq=pt["hq"],
                          hkv=pt["hkv"], nq=pt["nq"], nk=pt["nk"], source="decode"))
    for pt in bench.decode_points(batches=(1, 8, 64), heads=((32, 8),), nks=(16384, 65536), nqs=(1, 4, 16)):
        for page in (16, 256):  # the paged decoding benchmark's pages
            probs.append(dict(kind="decode", dtype=pt["dtype"], d=pt["d"], causal=True, b=pt["b"], hq=pt["hq"],
                              hkv=pt["hkv"], nq=pt["nq"], nk=pt["nk"], page_size=page, source="paged decode"))
    for chunk, keys, page in ((2048, 8192, 256), (512, 8192, 16), (2048, 16384, 256)):  # paged prefill
        probs.append(dict(kind="paged_prefill", dtype="bf16", d=128, causal=True, hq=32, hkv=8, batch=2,
                          total_q=2 * chunk, max_q=chunk, max_k=keys, page_size=page, pages=-(-keys // page),
                          source="paged prefill"))
    rng = random.Random(seed)
    for _ in range(n_random):
        hkv = rng.choice((1, 2, 4, 8, 16))
        p = dict(kind="dense", dtype=rng.choice(("bf16", "fp16", "fp32")), d=rng.choice((32, 64, 96, 128, 256, 72)),
                 causal=rng.random() < 0.5, b=rng.choice((1, 2, 4, 16)), hkv=hkv, hq=hkv * rng.choice((1, 2, 4)),
                 nq=rng.choice((1, 17, 113, 512, 1023, 2048, 4096, 8192)),
                 nk=rng.choice((1, 17, 113, 512, 1023, 2048, 4096, 8192, 16384)),
                 deterministic=rng.random() < 0.8, layout=rng.choice(("bhnd", "bnhd")), source="random")
        r = rng.random()
        if r < 0.1:
            p["window"] = [rng.choice((64, 1023)), 0]
        elif r < 0.15:
            p["softcap"] = 30.0
        elif r < 0.2:
            p["padding"] = True
        probs.append(p)
    return probs


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", nargs="?", const=str(GOLDEN), default=None,
                        help=f"write the file (default {GOLDEN.relative_to(ROOT)})")
    parser.add_argument("--problems", help="take the problems from this golden file instead of generating them")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    probs = json.loads(Path(args.problems).read_text())["problems"] if args.problems else problems()
    text = dumps(dict(problems=probs, decisions={dev: decisions(dev, probs) for dev in DEVICES}))
    if args.write:
        Path(args.write).write_text(text, encoding="utf-8")
    print(f"{len(probs)} problems on {len(DEVICES)} devices, {len(text) / 1e6:.1f} MB")


def dumps(golden):
    """The golden file's text: one problem, or one problem's decisions, per line (a change shows as its lines)."""
    def lines(items):
        return "[\n" + ",\n".join(json.dumps(x, separators=(",", ":"), sort_keys=True) for x in items) + "\n]"

    decided = ",\n".join(f"{json.dumps(dev)}: {lines(d)}" for dev, d in golden["decisions"].items())
    return f'{{"problems": {lines(golden["problems"])},\n"decisions": {{\n{decided}\n}}}}\n'


if __name__ == "__main__":
    main()
