"""fa_lib.context_parallel over NCCL on 2 GPUs (``pytest -m multigpu``; skipped without 2 CUDA devices).

The gloo tests (tests/library/test_context_parallel.py) at real sizes: two processes, one GPU each, N = 8k total,
D = 128, bf16 (and one fp16 case), H = 16 and GQA 32/8; ring_attention in both layouts, causal and not,
and ulysses_attention. Each rank's shard of the output, LSE and gradients is judged by the flash-attn 2x
rule against float64 attention over the whole sequence (computed on each rank, a few heads at a time).
Mismatched shards across ranks must raise on every rank. Every collective has a timeout (the process
group's), and the test kills ranks still running after ``TIMEOUT_S``: a hang fails instead of stalling.

Set ``CP_NCCL_REPORT=/path/file.json`` to keep the error ratios (the closing note quotes them).
"""
import datetime
import json
import os
import traceback

import pytest
import torch

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)"),
]

WORLD = 2
N = 8192
D = 128
TIMEOUT_S = 540  # the whole group of processes; every collective also times out (COLLECTIVE_TIMEOUT_S)
COLLECTIVE_TIMEOUT_S = 180


def _c(kind, layout, causal, hq=16, hkv=16, dtype="bfloat16", n=N):
    return dict(kind=kind, layout=layout, causal=causal, hq=hq, hkv=hkv, dtype=dtype, n=n)


CASES = [
    _c("ring", "zigzag", True), _c("ring", "zigzag", False), _c("ring", "contiguous", True),
    _c("ring", "contiguous", False), _c("ring", "zigzag", True, hq=32, hkv=8),
    _c("ring", "contiguous", False, hq=32, hkv=8), _c("ring", "zigzag", True, dtype="float16"),
    _c("ulysses", "zigzag", True), _c("ulysses", "contiguous", False), _c("ulysses", "zigzag", True, hq=32, hkv=8),
    dict(kind="mismatch"),
]


def _gold(testing, q, k, v, do, causal, upcast, kv_chunk):
    """reference_forward_backward over the whole sequence, ``kv_chunk`` key/value heads (and their query
    heads) at a time, so that float64 N x N matrices of a few heads are alive at once."""
    g = q.shape[1] // k.shape[1]
    parts = []
    for h in range(0, k.shape[1], kv_chunk):
        hs, qs = slice(h, h + kv_chunk), slice(h * g, (h + kv_chunk) * g)
        r = testing.reference_forward_backward(q[:, qs], k[:, hs], v[:, hs], do[:, qs], causal=causal, upcast=upcast)
        parts.append({name: t.detach() for name, t in r.items()})
        del r
    return {name: torch.cat([p[name] for p in parts], dim=1) for name in parts[0]}


def _case(cp, testing, rank, case):
    dtype = getattr(torch, case["dtype"])
    n, hq, hkv, causal, layout = case["n"], case["hq"], case["hkv"], case["causal"], case["layout"]
    dev = torch.device("cuda", rank)
    g = torch.Generator().manual_seed(2024 + n + hq)  # every rank draws the same full tensors
    q, do = (torch.randn(1, hq, n, D, generator=g).to(dev, dtype) for _ in range(2))
    k, v = (torch.randn(1, hkv, n, D, generator=g).to(dev, dtype) for _ in range(2))
    chunk = max(1, 4 // (hq // hkv))
    gold = _gold(testing, q, k, v, do, causal, True, chunk)
    base = _gold(testing, q, k, v, do, causal, False, chunk)
    fn = {"ring": cp.ring_attention, "ulysses": cp.ulysses_attention}[case["kind"]]
    loc = [cp.shard(t, layout=layout).requires_grad_() for t in (q, k, v)]
    with testing.poisoned_outputs():
        o, lse = fn(*loc, causal=causal, layout=layout, return_lse=True)
        o.backward(cp.shard(do, layout=layout))
    out = dict(o=o.detach(), lse=lse, dq=loc[0].grad, dk=loc[1].grad, dv=loc[2].grad)

    def mine(t):
        return cp.shard(t, layout=layout) if t.dim() == 4 else cp.shard(t[..., None], layout=layout)[..., 0]

    report = testing.assert_flash_rule(out, {k_: mine(t) for k_, t in gold.items()},
                                       {k_: mine(t) for k_, t in base.items()})
    return {name: [float(f"{r[0]:.3e}"), float(f"{r[1]:.3e}"), round(r[2], 3)] for name, r in report.items()}


def run(rank, world, port, cases, out_path):
    result = {"rank": rank, "ok": [], "errors": []}
    try:
        import torch.distributed as dist

        from fa_lib import context_parallel as cp, testing

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        for case in cases:
            try:
                if case["kind"] == "mismatch":  # rank 1 passes a shard of another length: every rank must raise
                    n = 1024 if rank != 1 else 2048
                    x = torch.randn(1, 4, n, D, device="cuda", dtype=torch.bfloat16)
                    try:
                        cp.ring_attention(x, x, x, layout="contiguous")
                        result["errors"].append(f"{case}: no error")
                    except ValueError as e:
                        result["ok"].append(dict(case=case, error=str(e)))
                else:
                    result["ok"].append(dict(case=case, ratios=_case(cp, testing, rank, case)))
            except Exception:
                result["errors"].append(f"{case}: {traceback.format_exc()}")
            torch.cuda.empty_cache()
        dist.destroy_process_group()
    except Exception:
        result["errors"].append(traceback.format_exc())
    with open(out_path, "w") as f:
        json.dump(result, f)


def test_ring_and_ulysses_over_nccl_match_attention_over_the_whole_sequence(tmp_path):
    import cp_worker

    results = cp_worker.spawn(run, WORLD, CASES, tmp_path, TIMEOUT_S)
    if os.environ.get("CP_NCCL_REPORT"):
        with open(os.environ["CP_NCCL_REPORT"], "w") as f:
            json.dump(dict(world=WORLD, n=N, d=D, device=torch.cuda.get_device_name(0), torch=torch.__version__,
                           results=results), f, indent=1)
    errors = [e for r in results for e in r["errors"]]
    assert not errors, "\n".join(errors)
    for r in results:
        assert len(r["ok"]) == len(CASES)
        for item in r["ok"]:
            if item["case"]["kind"] == "mismatch":
                assert "the ranks disagree on seqlen_q_local: [1024, 2048]" in item["error"]
            else:
                print(r["rank"], item["case"], item["ratios"])
