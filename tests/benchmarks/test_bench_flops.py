"""The FLOP convention of `benchmarks.bench.attention_flops`, checked on CPU."""
import pytest

from benchmarks import bench
from fa_lib.exercises import performance


def test_the_modes_are_the_exercises():
    assert bench.FLOP_MODES == performance.MODES == ("fwd", "bwd", "fwd_bwd")
    f = bench.attention_flops(4, 16, 4096, 4096, 128, False, "fwd")
    assert f == 549_755_813_888
    assert bench.attention_flops(4, 16, 4096, 4096, 128, False, "bwd") == 5 * f // 2
    assert bench.attention_flops(4, 16, 4096, 4096, 128, False, "fwd_bwd") == 7 * f // 2
    assert 2 * bench.attention_flops(4, 16, 4096, 4096, 128, True, "fwd") == f
    for case, *args in performance._CASES:
        assert bench.attention_flops(*args) == performance.attention_flops(*args), case


@pytest.mark.parametrize("mode", ["both", "forward", "FWD", "", None])
def test_an_unknown_mode_is_a_value_error(mode):
    with pytest.raises(ValueError, match=r"mode must be one of \('fwd', 'bwd', 'fwd_bwd'\)"):
        bench.attention_flops(1, 1, 8, 8, 4, False, mode)
