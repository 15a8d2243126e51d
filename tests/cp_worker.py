"""The body of the context-parallel tests: runs in each spawned process of a gloo group (see
tests/library/test_context_parallel.py). Each case compares this rank's shard of ring/Ulysses attention (output,
LSE and gradients) with single-process attention over the whole sequence, by the flash-attn 2x rule."""
import datetime
import json
import multiprocessing
import socket
import traceback

import torch
import torch.distributed as dist


def _case(cp, testing, rank, fn, layout, causal, dtype, hq, hkv, n_per_rank, d=16, **options):
    g = torch.Generator().manual_seed(1234)  # every rank draws the same full tensors
    world = dist.get_world_size()
    n = n_per_rank * world
    q, do = (torch.randn(1, hq, n, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, hkv, n, d, generator=g).to(dtype) for _ in range(2))
    one_device = options.pop("one_device", False)
    masks = {"window": tuple(options["window"])} if "window" in options else {}
    if masks:
        options["window"] = masks["window"]
    gold = testing.reference_forward_backward(q, k, v, do, causal=causal, upcast=True, **masks)
    base = testing.reference_forward_backward(q, k, v, do, causal=causal, upcast=False, **masks)
    loc = [cp.shard(t, layout=layout).requires_grad_() for t in (q, k, v)]
    with_lse = options.pop("return_lse", True)
    if with_lse:
        o, lse = fn(*loc, causal=causal, layout=layout, return_lse=True, **options)
    else:
        o, lse = fn(*loc, causal=causal, layout=layout, **options), None
    stats = dict(cp.STATS)
    o.backward(cp.shard(do, layout=layout))
    out = dict(o=o.detach(), lse=lse, dq=loc[0].grad, dk=loc[1].grad, dv=loc[2].grad)
    mine = {name: cp.shard(t, layout=layout) if t.dim() == 4 else cp.shard(t[..., None], layout=layout)[..., 0]
            for name, t in gold.items()}
    theirs = {name: cp.shard(t, layout=layout) if t.dim() == 4 else cp.shard(t[..., None], layout=layout)[..., 0]
              for name, t in base.items()}
    names = ("o", "lse", "dq", "dk", "dv") if with_lse else ("o", "dq", "dk", "dv")
    report = testing.assert_flash_rule(out, mine, theirs, names=names)
    if one_device:  # the one-device simulation of this ring: the same bits, every rank's shard
        sim = dict(zip(("o", "lse", "dq", "dk", "dv"),
                       cp.ring_on_one_device(q, k, v, world, causal=causal, layout=layout, do=do)))
        for name in names:
            t = sim[name]
            shard = cp.shard(t, layout=layout) if t.dim() == 4 else cp.shard(t[..., None], layout=layout)[..., 0]
            if not torch.equal(shard, out[name]):
                raise AssertionError(f"ring_on_one_device's {name} differs from the ring's on rank {rank}: largest "
                                     f"difference {(shard.double() - out[name].double()).abs().max().item()}")
    return {name: round(r[2], 3) for name, r in report.items()}, stats


def run_failure(rank, world, port, cases, out_path):
    """Rank 1's second block computation raises: every rank must raise RuntimeError naming rank 1, soon."""
    import time

    result = {"rank": rank, "ok": [], "errors": []}
    try:
        from fa_lib import context_parallel as cp, ops

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        if rank == 1:
            forward, calls = ops._forward, []

            def failing(*a, **kw):
                calls.append(1)
                if len(calls) == 2:
                    raise MemoryError("injected failure")
                return forward(*a, **kw)

            ops._forward = failing
        x = torch.randn(1, 2, 8, 16)
        start = time.time()
        try:
            cp.ring_attention(x, x, x, causal=True)
            result["errors"].append("no error")
        except RuntimeError as e:
            result["ok"].append(dict(error=str(e), seconds=time.time() - start))
    except Exception:
        result["errors"].append(traceback.format_exc())
    with open(out_path, "w") as f:
        json.dump(result, f)


def _packed_case(cp, testing, rank, layout, causal, dtype, hq, hkv, units, d=16, **options):
    """Packed documents (cu_seqlens): every rank's shard of output, LSE and gradients against attention
    within each document of the whole sequence."""
    g = torch.Generator().manual_seed(4321)
    world = dist.get_world_size()
    per = 2 if layout == "zigzag" else 1
    lengths = [u * per * world for u in units]
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    n = sum(lengths)
    q, do = (torch.randn(1, hq, n, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, hkv, n, d, generator=g).to(dtype) for _ in range(2))
    refs = []
    for upcast in (True, False):
        parts = [testing.reference_forward_backward(*(t[:, :, a:b] for t in (q, k, v, do)), causal=causal,
                                                    upcast=upcast) for a, b in zip(cu.tolist(), cu.tolist()[1:])
                 if b > a]
        refs.append({name: torch.cat([p_[name] for p_ in parts], dim=2) for name in parts[0]})
    loc = [cp.shard(t, layout=layout, cu_seqlens=cu).requires_grad_() for t in (q, k, v)]
    o, lse = cp.ring_attention(*loc, causal=causal, layout=layout, return_lse=True, cu_seqlens=cu, **options)
    o.backward(cp.shard(do, layout=layout, cu_seqlens=cu))
    out = dict(o=o.detach(), lse=lse, dq=loc[0].grad, dk=loc[1].grad, dv=loc[2].grad)

    def mine(t):
        if t.dim() == 4:
            return cp.shard(t, layout=layout, cu_seqlens=cu)
        return cp.shard(t[..., None], layout=layout, cu_seqlens=cu)[..., 0]

    report = testing.assert_flash_rule(out, *({name: mine(t) for name, t in r.items()} for r in refs))
    back = cp.unshard(o.detach(), layout=layout, cu_seqlens=cu)  # the whole output, in document order
    assert back.shape == q.shape and torch.equal(cp.shard(back, layout=layout, cu_seqlens=cu), o.detach())
    return {name: round(r[2], 3) for name, r in report.items()}, dict(cp.STATS)


EXPECTED_ERRORS = ("packed_bad", "mismatch", "ulysses_heads", "one_rank_bad", "scales_differ", "unshard_lengths_differ",
                   "unshard_odd_zigzag")


def run(rank, world, port, cases, out_path):
    result = {"rank": rank, "ok": [], "errors": []}
    try:
        import fa_lib
        from fa_lib import context_parallel as cp, testing

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=90))
        fns = {"ring": cp.ring_attention, "ulysses": cp.ulysses_attention}
        for case in cases:
            kind = case["kind"]
            try:
                if kind == "mismatch":  # rank 1 passes a shard of another length: every rank must raise
                    n = 8 if rank != 1 else 16
                    x = torch.randn(1, 2, n, 16)
                    cp.ring_attention(x, x, x, layout="contiguous")
                    result["errors"].append(f"{case}: no error")
                elif kind == "ulysses_heads":
                    x = torch.randn(1, 4, 8, 16)
                    cp.ulysses_attention(x, x, x, layout="contiguous")
                    result["errors"].append(f"{case}: no error")
                elif kind == "one_rank_bad":  # only rank 1's input fails its checks: every rank must raise
                    x = torch.randn(1, 2, 8, 16)
                    cp.ring_attention(x, x, x, softmax_scale=-1.0 if rank == 1 else 0.25)
                    result["errors"].append(f"{case}: no error")
                elif kind == "scales_differ":  # valid on every rank, but not the same
                    x = torch.randn(1, 2, 8, 16)
                    cp.ring_attention(x, x, x, softmax_scale=0.5 if rank == 1 else 0.25)
                    result["errors"].append(f"{case}: no error")
                elif kind == "unshard_lengths_differ":
                    cp.unshard(torch.randn(1, 1, 6 if rank == 1 else 4, 1))
                    result["errors"].append(f"{case}: no error")
                elif kind == "agree_once":  # the agreement runs once per problem, or as check= says
                    calls = []
                    agree = cp._agree
                    cp._agree = lambda *a: (calls.append(1), agree(*a))[1]
                    try:
                        x = torch.randn(1, 2, 6, 16)
                        for check in (None, None, True, False, None):
                            cp.ring_attention(x, x, x, layout="contiguous", softmax_scale=0.3, check=check)
                    finally:
                        cp._agree = agree
                    result["ok"].append(dict(case=case, agree_calls=len(calls)))
                elif kind == "bad_options":  # every rank passes the same bad option: each names the argument
                    x = torch.randn(1, 2, 8, 16)
                    msgs = []
                    for kw in (dict(window=(-3, 0)), dict(window="wide"), dict(strategy="tree"), dict(check="yes")):
                        try:
                            cp.ring_attention(x, x, x, **kw)
                            msgs.append(f"{kw}: no error")
                        except (TypeError, ValueError) as e:
                            msgs.append(f"{type(e).__name__}: {e}")
                    result["ok"].append(dict(case=case, errors=msgs))
                elif kind == "unshard_odd_zigzag":  # a zigzag shard holds two chunks: its length must be even
                    cp.unshard(torch.randn(1, 1, 7, 1))
                    result["errors"].append(f"{case}: no error")
                elif kind == "packed":
                    ratios, stats = _packed_case(cp, testing, rank, case["layout"], case["causal"],
                                                 getattr(torch, case["dtype"]), case["hq"], case["hkv"],
                                                 case["units"], **dict(case.get("options", {})))
                    result["ok"].append(dict(case=case, ratios=ratios, stats=stats))
                elif kind == "packed_bad":  # a document whose length the ranks cannot split evenly
                    x = torch.randn(1, 2, 8, 16)
                    cp.ring_attention(x, x, x, cu_seqlens=torch.tensor([0, 3, 8 * world], dtype=torch.int32))
                    result["errors"].append(f"{case}: no error")
                else:
                    dtype = getattr(torch, case["dtype"])
                    ratios, stats = _case(cp, testing, rank, fns[kind], case["layout"], case["causal"], dtype,
                                          case["hq"], case["hkv"], case["n_per_rank"], **dict(case.get("options", {})))
                    result["ok"].append(dict(case=case, ratios=ratios, stats=stats))
            except ValueError as e:
                if kind in EXPECTED_ERRORS:
                    result["ok"].append(dict(case=case, error=str(e)))
                else:
                    result["errors"].append(f"{case}: {traceback.format_exc()}")
            except Exception:
                result["errors"].append(f"{case}: {traceback.format_exc()}")
        dist.destroy_process_group()
    except Exception:
        result["errors"].append(traceback.format_exc())
    with open(out_path, "w") as f:
        json.dump(result, f)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(target, world, cases, tmp_path, timeout_s):
    """Run ``target(rank, world, port, cases, out_path)`` in ``world`` spawned processes and return each
    rank's JSON report. Ranks still running after ``timeout_s`` are killed and the test fails: a hang in a
    collective or a send/recv fails instead of stalling CI. Shared by the gloo and the NCCL tests."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    paths = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = [ctx.Process(target=target, args=(r, world, port, cases, str(paths[r]))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} still running after {timeout_s} s: a collective or send/recv hangs"
    missing = [r for r, p in enumerate(paths) if not p.exists()]
    assert not missing, f"ranks {missing} died without a report (exit codes {[p.exitcode for p in procs]})"
    return [json.loads(p.read_text()) for p in paths]
