"""`python -m benchmarks.bench --profile`: parsing Nsight Compute's CSV and splitting it at the marker kernels
(checked on CPU with a small CSV in ncu's raw format), and the committed H200 profile's consistency."""
import pytest

import benchmarks.data
from benchmarks import bench_profile as bp

CSV = '''==PROF== Connected to process 1
"ID","Kernel Name","gpu__time_duration.sum","launch__registers_per_thread","l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum","sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active","sm__pipe_tensor_cycles_active.max.pct_of_peak_sustained_active"
"","","ns","register/thread","byte","%","%"
"0","_fa_profile_marker","1,024","16","0","0","0"
"1","_attn_fwd","2,000,000","244","0","55.5","60"
"2","_fa_profile_marker","1,000","16","0","0","0"
"3","_attn_bwd_preprocess","35,000","36","0","0","0"
"4","_attn_bwd_dkdv","4,000,000","255","2,097,152","53","57"
'''


def test_parse_converts_units_and_keeps_the_named_columns():
    rows = bp.parse_ncu_csv(CSV)
    assert [r["kernel"] for r in rows] == ["_fa_profile_marker", "_attn_fwd", "_fa_profile_marker",
                                           "_attn_bwd_preprocess", "_attn_bwd_dkdv"]
    fwd = rows[1]
    assert fwd["ms"] == pytest.approx(2.0) and fwd["registers"] == 244.0
    tensor = "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"
    assert fwd[tensor] == 55.5
    assert "sm__pipe_tensor_cycles_active.max.pct_of_peak_sustained_active" not in fwd  # only the average
    assert rows[4]["l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum"] == 2097152.0  # "2,097,152": spills


def test_split_at_markers_and_summary():
    regions = bp.split_regions(bp.parse_ncu_csv(CSV), [("p", "fa_lib", "fwd"), ("p", "fa_lib", "bwd")])
    assert [len(r["kernels"]) for r in regions] == [1, 2]
    point = dict(b=1, hq=1, d=64, nq=1024, nk=1024, causal=False)
    s = bp.summarize(regions[1], point, 700.0)
    assert s["kernel_ms"] == pytest.approx(4.035)
    assert s["main_kernel"]["kernel"] == "_attn_bwd_dkdv"  # the longest kernel of the pass
    assert s["tflops"] == pytest.approx(2.5 * 4 * 1024 * 1024 * 64 / 4.035e-3 / 1e12)
    assert s["local_bytes"] == 2097152.0
    with pytest.raises(RuntimeError, match="2 markers profiled for 3 regions"):
        bp.split_regions(bp.parse_ncu_csv(CSV), [("p", "a", "fwd")] * 3)
    with pytest.raises(RuntimeError, match="no ncu CSV"):
        bp.parse_ncu_csv("==ERROR== the application returned an error\n")


def test_committed_profile_is_complete():
    prof = benchmarks.data.load_json("profile-nvidia-h200.json")
    names = {p["name"] for p in bp.POINTS}
    seen = {(r["point"], r["provider"], r["mode"]) for r in prof["regions"]}
    assert seen == {(n, prov, m) for n in names for prov in bp.PROFILE_PROVIDERS for m in ("fwd", "bwd")}
    for r in prof["regions"]:
        assert r["kernels"], r  # every pass launched at least one kernel
        assert r["summary"]["kernel_ms"] == pytest.approx(sum(k["ms"] for k in r["kernels"]))
    assert {(h["point"], h["provider"], h["mode"]) for h in prof["host"]} == seen


def test_configs_probe_parsing_override_and_best():
    from benchmarks import bench
    from fa_lib import kernels

    assert bench.parse_shape("2,8,2,512,8192,256,1") == dict(b=2, hq=8, hkv=2, nq=512, nk=8192, d=256,
                                                             causal=True)
    for bad in ("2,8,2,512,8192,256", "2,8,3,512,8192,256,0", "2,8,2,512,8192,256,yes", "0,8,8,1,1,64,0"):
        with pytest.raises(ValueError, match="--cfg-shapes"):
            bench.parse_shape(bad)
    assert bench.parse_config("64,32,8,2") == (64, 32, 8, 2)
    for bad in ("64,32,8", "64,32,8,0", "a,32,8,2"):
        with pytest.raises(ValueError, match="--cfg-candidates"):
            bench.parse_config(bad)
    before = kernels.default_config("dq", 2, 256, True, 4096, 4096, interpret=False)
    with bench.override_config("dkdv", (16, 32, 4, 2)):
        assert kernels.default_config("dkdv", 2, 256, True, 4096, 4096) == (16, 32, 4, 2)
        assert kernels.default_config("dq", 2, 256, True, 4096, 4096, interpret=False) == before
    assert kernels.default_config("dkdv", 2, 256, True, 4096, 4096, interpret=False) == (32, 64, 8, 2)
    shape = dict(b=1, hq=1, hkv=1, nq=1, nk=1, d=64)
    probe = [dict(shape, causal=c, config=cfg, ms=ms) for c, cfg, ms in (
        (False, None, 2.0), (False, (1, 1, 1, 1), 1.0), (False, (2, 2, 2, 2), None),
        (True, None, 1.0), (True, (1, 1, 1, 1), 4.0), (True, (2, 2, 2, 2), 0.5))]
    best = bench.best_config(probe)
    assert best["geomean_vs_default"] == {"(1, 1, 1, 1)": pytest.approx(2 ** 0.5)}  # (2,2,2,2) failed once
    assert best["config"] == "(1, 1, 1, 1)"
