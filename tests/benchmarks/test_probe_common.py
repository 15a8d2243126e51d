"""benchmarks/probes/probe_common.py, what the backward's GPU probes share, checked on CPU: the best of the timing rounds, an
error that ends them, and a check row judged by the flash-attn 2x rule, failures recorded instead of raised."""
import sys

import torch
from book_toc import ROOT

from benchmarks import bench
from fa_lib.testing import make_inputs, reference_forward_backward

from benchmarks.probes import probe_common


def test_best_backward_keeps_the_least_backward_round(monkeypatch):
    rounds = iter([dict(fwd_ms=1.0, bwd_ms=3.0), dict(fwd_ms=2.0, bwd_ms=2.0), dict(fwd_ms=0.5, bwd_ms=4.0)])
    monkeypatch.setattr(bench, "ext_bench_one", lambda provider, p, warmup, rep: next(rounds))
    row = dict(bwd_ms={}, fwd_ms={})
    probe_common.best_backward(row, "x", "fa_lib", {}, 3)
    assert row == dict(bwd_ms={"x": 2.0}, fwd_ms={"x": 2.0})
    rounds = iter([dict(fwd_ms=1.0, bwd_ms=3.0)])
    row = dict(bwd_ms={})  # a row without forward times gets none
    probe_common.best_backward(row, "y", "fa_lib", {}, 1)
    assert row == dict(bwd_ms={"y": 3.0})


def test_an_error_ends_the_rounds(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "ext_bench_one", lambda *a, **k: calls.append(1) or dict(error="OOM", bwd_ms=None))
    row = dict(bwd_ms={}, fwd_ms={})
    probe_common.best_backward(row, "x", "sdpa_cudnn", {}, 3)
    assert row == dict(bwd_ms={}, fwd_ms={}, errors={"x": "OOM"}) and len(calls) == 1


def test_a_check_row_records_pass_and_failure():
    q, k, v, do = make_inputs(1, 2, 1, 17, 23, 16, torch.float32, "cpu", seed=3)
    out = reference_forward_backward(q, k, v, do, causal=True, upcast=False)  # the baseline itself: ratio 1
    row = {}
    with probe_common.recorded(row):
        probe_common.judge(row, out, q, k, v, do, True, digits=3)
    assert row["ok"] and set(row["ratios"]) == {"o", "lse", "dq", "dk", "dv"}
    bad = dict(out, dq=out["dq"] + 1.0)
    row = {}
    with probe_common.recorded(row):
        probe_common.judge(row, bad, q, k, v, do, True)
    assert row["ok"] is False and "dq" in row["error"]
    row = {}
    with probe_common.recorded(row):
        raise RuntimeError("a launch failed")
    assert row["ok"] is False and "RuntimeError: a launch failed" in row["error"]
