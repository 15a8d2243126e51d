"""Chapter 11's checker: the FLOP convention of the benchmarks, a hint for each usual mistake, no torch needed."""
import subprocess
import sys
import textwrap

import pytest

from benchmarks import bench
from fa_lib import exercises
from fa_lib.exercises import performance


def good(batch, heads, n_q, n_k, head_dim, causal, mode):
    f = 4 * batch * heads * n_q * n_k * head_dim
    if causal:
        f /= 2
    return f * {"fwd": 1, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


def one_matmul(batch, heads, n_q, n_k, head_dim, causal, mode):
    return good(batch, heads, n_q, n_k, head_dim, causal, mode) / 2


def not_halved(batch, heads, n_q, n_k, head_dim, causal, mode):
    return good(batch, heads, n_q, n_k, head_dim, False, mode)


def backward_twice(batch, heads, n_q, n_k, head_dim, causal, mode):
    f = good(batch, heads, n_q, n_k, head_dim, causal, "fwd")
    return f * {"fwd": 1, "bwd": 2, "fwd_bwd": 3}[mode]


def square(batch, heads, n_q, n_k, head_dim, causal, mode):
    return good(batch, heads, n_q, n_q, head_dim, causal, mode)


def fwd_bwd_as_bwd(batch, heads, n_q, n_k, head_dim, causal, mode):
    return good(batch, heads, n_q, n_k, head_dim, causal, "bwd" if mode == "fwd_bwd" else mode)


def test_a_correct_solution_passes():
    assert exercises.check_attention_flops(good) == "all 8 hidden cases pass"
    assert exercises.check_attention_flops(performance.attention_flops) == "all 8 hidden cases pass"


@pytest.mark.parametrize("fn, match", [
    (one_matmul, "two matrix products"),
    (not_halved, "halves the count"),
    (backward_twice, "five products"),
    (square, "n_q and n_k mixed up"),
    (fwd_bwd_as_bwd, "forward plus the backward"),
    (lambda *a: "many", "a number of FLOPs"),
])
def test_each_mistake_gets_its_hint(fn, match):
    with pytest.raises(exercises.ExerciseFailure, match=match):
        exercises.check_attention_flops(fn)


def test_not_a_function_is_a_type_error():
    with pytest.raises(TypeError, match="pass your function itself"):
        exercises.check_attention_flops(42)


def test_the_count_is_the_benchmarks_count():
    # The checker's reference is the convention of benchmarks.bench.attention_flops (which the sweeps use).
    for case, *args in performance._CASES:
        assert performance.attention_flops(*args) == bench.attention_flops(*args), case


@pytest.mark.parametrize("args, error, match", [
    ((1.5, 1, 8, 8, 4, False, "fwd"), TypeError, "batch must be an int"),
    ((1, 1, -8, 8, 4, False, "fwd"), ValueError, "n_q must be >= 0"),
    ((1, 1, 8, 8, 4, 1, "fwd"), TypeError, "causal must be a bool"),
    ((1, 1, 8, 8, 4, False, "both"), ValueError, "mode must be one of"),
])
def test_the_reference_names_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        performance.attention_flops(*args)


def test_the_checker_imports_without_torch():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # import torch / import triton now raise ImportError
        sys.modules["triton"] = None
        from fa_lib import exercises
        print(exercises.check_attention_flops(lambda b, h, nq, nk, d, c, m:
              4 * b * h * nq * nk * d // (2 if c else 1) * {"fwd": 2, "bwd": 5, "fwd_bwd": 7}[m] // 2))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "all 8 hidden cases pass", run.stdout + run.stderr
