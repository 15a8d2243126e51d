"""The benchmark records the block configurations fa_lib's launcher picks."""
import torch

from fa_lib import kernels


def test_bench_reports_the_blocks_the_launcher_picks(monkeypatch):
    # fa_lib_configs (what the benchmark files record) goes through the launcher's choice, small grids too;
    # the GPU's table is read here (under the interpreter the launcher has one small tile)
    from benchmarks import bench

    real = kernels.default_config
    monkeypatch.setattr(kernels, "default_config", lambda *a, **kw: real(*a, **kw, interpret=False))
    prefill = bench.fa_lib_configs(torch.empty(2, 8, 512, 256, dtype=torch.bfloat16), 8192, True)
    assert tuple(prefill["fwd"].values()) == kernels.SMALL_GRID[("fwd", 2, 256)][1]  # 64 programs
    assert tuple(prefill["dq"].values()) == kernels.SMALL_GRID[("dq", 2, 256)][1]
    assert tuple(prefill["dkdv"].values()) == real("dkdv", 2, 256, True, 512, 8192, interpret=False)
    square = bench.fa_lib_configs(torch.empty(4, 8, 4096, 256, dtype=torch.bfloat16), 4096, True)  # 1024
    assert tuple(square["fwd"].values()) == kernels.SMALL_GRID[("fwd", 2, 256)][0]
    assert tuple(square["dq"].values()) == kernels.SMALL_GRID[("dq", 2, 256)][0]
