"""The context-parallel benchmark (``python -m benchmarks.bench --cp``, issue 11) on CPU.

The helpers (FLOPs, layouts, the order of the points, the slowest-rank median, the longest-sequence
search, the straight-line memory fit, the targets) are checked without processes; then the whole
``--cp --smoke`` pipeline runs once: two gloo processes, fa_lib under the Triton interpreter, the
correctness check, the timing, the memory search with a simulated out of memory, the JSON. About 30 s.
"""
import json
import math

import pytest

from benchmarks import bench, bench_cp


def test_flops_follow_the_convention():
    f = bench_cp.flops(1, 16, 1024, 128, False, "fwd")
    assert f == 4 * 16 * 1024 * 1024 * 128
    assert bench_cp.flops(1, 16, 1024, 128, True, "fwd") == f // 2
    assert bench_cp.flops(1, 16, 1024, 128, False, "fwd_bwd") == int(3.5 * f)
    assert bench_cp.gpus_used("fa_lib_1gpu", 2) == 1 and bench_cp.gpus_used("ring_zigzag", 2) == 2


def test_layouts_match_what_each_provider_expects():
    assert bench_cp.layout_of("ring_zigzag", False) == "zigzag"
    assert bench_cp.layout_of("ring_contiguous", True) == "contiguous"
    # torch's head-tail load balancer is fa_lib's zigzag; it refuses to balance non-causal attention
    for p in ("torch_cp", "torch_cp_alltoall", "ulysses"):
        assert bench_cp.layout_of(p, True) == "zigzag" and bench_cp.layout_of(p, False) == "contiguous"


def test_heads_are_parsed_and_checked():
    assert bench_cp.parse_heads(["16/16", "32/8", "4"]) == [(16, 16), (32, 8), (4, 4)]
    with pytest.raises(ValueError, match="Hq a positive multiple of Hkv"):
        bench_cp.parse_heads(["6/4"])


def test_points_run_the_targets_first_then_cheapest_first():
    pts = bench_cp.points([65536, 32768], [(16, 16), (32, 8)], [False, True])
    keys = [(p["causal"], p["hq"], p["n"]) for p in pts]
    assert keys == [(True, 16, 32768), (True, 16, 65536),  # the targets: causal, H = 16
                    (True, 32, 32768), (False, 16, 32768), (False, 32, 32768),  # then by FLOPs, causal first
                    (True, 32, 65536), (False, 16, 65536), (False, 32, 65536)]
    assert len({tuple(sorted(p.items())) for p in pts}) == 8


def test_time_is_the_median_of_the_slowest_rank():
    assert bench_cp.median_of_slowest([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == 3.0  # per iteration: 3, 5, 2.5


@pytest.mark.parametrize("limit", [1, 16, 40, 100, 1000])
def test_search_finds_the_longest_that_fits(limit):
    calls = []

    def fits(n):
        calls.append(n)
        return n <= limit

    ok, bad, tried = bench_cp.search_lengths(fits, 16, 8, refine=3)
    assert [n for n, _ in tried] == calls
    if limit < 16:
        assert ok is None and bad == 16
        return
    assert ok <= limit < bad and ok % 8 == 0
    assert ok == max(n for n, f in tried if f) and bad == min(n for n, f in tried if not f)
    assert all(f == (n <= limit) for n, f in tried)
    if limit == 100:  # 16 .. 64 fit, 128 does not; bisection: 96 fits, 112 and 104 do not
        assert (ok, bad) == (96, 104)


def test_search_stops_without_a_verdict():
    ok, bad, tried = bench_cp.search_lengths(lambda n: None if n > 32 else True, 16, 8, refine=2)
    assert (ok, bad) == (32, None) and tried[-1] == (64, None)


def test_linear_fit_recovers_bytes_per_token():
    ns = [1000, 2000, 4000]
    fit = bench_cp.linear_fit_max_n(ns, [100 + 3 * n for n in ns], capacity=100 + 3 * 10000)
    assert math.isclose(fit["bytes_per_token"], 3.0) and abs(fit["max_n"] - 10000) <= 1
    assert bench_cp.linear_fit_max_n([1000], [5], 10) is None


def _row(provider, fwd, fwd_bwd, eff=None):
    return {"provider": provider, "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "fwd_efficiency": eff,
            "fwd_bwd_efficiency": eff}


def test_targets_are_evaluated_per_point():
    results = {"environment": {"world_size": 2}, "points": [
        {"label": "a", "n": 131072, "causal": True,
         "rows": [_row("ring_zigzag", 10.0, 30.0, 0.95), _row("torch_cp", 12.0, 29.0), _row("torch_cp_cudnn", 11.0, 40.0)]},
        {"label": "b", "n": 32768, "causal": False, "rows": [_row("ring_zigzag", 1.0, 3.0, 0.5)]},
    ], "search": {"cap_gib": 8, "fa_lib_1gpu": {"longest": 100}, "ring_zigzag": {"longest": 200}}}
    s = bench_cp.evaluate_targets(results)
    assert s["scaling_met"] is True and len(s["scaling"]) == 2  # point b is below 128k and not causal
    assert [e["met"] for e in s["vs_torch"]] == [True, False]  # fwd: 10 < 11; fwd+bwd: 30 > 29
    assert s["vs_torch_met"] is False
    assert s["longest"]["ratio"] == 2.0 and s["longest_met"] is True
    assert results["points"][0]["targets"]["fwd_bwd"] == {"scaling": True, "vs_torch": False}
    assert results["points"][1]["targets"]["fwd"] == {"scaling": None, "vs_torch": None}
    assert bench_cp.table_lines(results)[2].startswith("a")


def test_smoke_pipeline_on_cpu(tmp_path):
    """The whole run: two gloo processes, every phase, the JSON; torch's context_parallel skipped with its
    reason (it needs CUDA); the memory search against a simulated out of memory above 16 tokens."""
    results = bench.main(["--cp", "--smoke", "--out-dir", str(tmp_path), "--cp-total-timeout-s", "240"])
    path = tmp_path / "cp-smoke-cpu-x2.json"
    assert json.loads(path.read_text()) == json.loads(json.dumps(results))
    assert results["environment"]["world_size"] == 2 and results["environment"]["backend"] == "gloo"
    (check,) = results["checks"].values()
    for prov in ("fa_lib_1gpu", "ring_contiguous", "ulysses"):
        assert check[prov]["ok"] is True, check[prov]
    assert check["torch_cp"]["ok"] is None
    (pt,) = results["points"]
    rows = {r["provider"]: r for r in pt["rows"]}
    for prov in ("fa_lib_1gpu", "ring_contiguous", "ulysses"):
        assert rows[prov].get("error") is None, rows[prov]
        assert rows[prov]["fwd_ms"] > 0 and rows[prov]["fwd_bwd_ms"] > 0
        assert len(rows[prov]["fwd_ms_by_rank"]) == 2
    assert rows["ring_contiguous"]["fwd_bwd_efficiency"] > 0 and rows["fa_lib_1gpu"]["gpus"] == 1
    assert "needs CUDA" in rows["torch_cp"]["skipped"]
    search = results["search"]
    for prov in ("fa_lib_1gpu", "ulysses"):
        assert (search[prov]["longest"], search[prov]["first_failed"]) == (16, 24), search[prov]
    assert {"scaling", "vs_torch", "longest"} <= set(results["summary"])
