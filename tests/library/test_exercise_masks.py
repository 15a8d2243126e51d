"""fa_lib.exercises.check_tile_classes (chapter 8): a right answer passes, each common wrong answer is named."""
import math

import numpy as np
import pytest

from fa_lib import exercises


def _band(n_q, n_k, causal, window, shift=None):
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    shift = n_k - n_q if shift is None else shift
    lo = shift - left if left >= 0 else -math.inf
    hi = shift + right if right >= 0 else math.inf
    return lo, hi


def make_solution(shift_zero=False, nominal=False, diagonal_full=False, no_left=False):
    """The tile rule from the corners of each tile, with one of the common mistakes switched on."""

    def classes(n_q, n_k, block_m, block_n, causal, window):
        win = (-1, window[1]) if no_left else window
        lo, hi = _band(n_q, n_k, causal, win, 0 if shift_zero else None)
        out = np.zeros((-(-n_q // block_m), -(-n_k // block_n)), dtype=np.int64)
        for a in range(out.shape[0]):
            for b in range(out.shape[1]):
                r0, c0 = a * block_m, b * block_n
                r1 = r0 + block_m if nominal else min(r0 + block_m, n_q)
                c1 = c0 + block_n if nominal else min(c0 + block_n, n_k)
                d_min, d_max = c0 - (r1 - 1), (c1 - 1) - r0
                if d_max < lo or d_min > hi:
                    out[a, b] = 0
                elif lo <= d_min and (d_max <= hi or (diagonal_full and d_min <= hi)):
                    out[a, b] = 1
                else:
                    out[a, b] = 2
        return out

    return classes


def test_a_right_answer_passes():
    assert exercises.check_tile_classes(make_solution()) == "all 13 hidden cases pass"


def test_a_right_answer_from_the_element_mask_passes():
    import fa_lib

    def from_mask(n_q, n_k, block_m, block_n, causal, window):
        codes = {"empty": 0, "full": 1, "partial": 2}
        cl = fa_lib.tile_classes(n_q, n_k, block_m, block_n, causal=causal, window=window)
        return np.vectorize(codes.get)(cl).astype(int)

    assert exercises.check_tile_classes(from_mask).startswith("all ")


@pytest.mark.parametrize("mistake, hint", [
    ({"shift_zero": True}, "aligned top-left; fa_lib aligns bottom-right"),
    ({"nominal": True}, "partial last block"),
    ({"diagonal_full": True}, "the diagonal"),
    ({"no_left": True}, "forgot the window's left edge"),
])
def test_each_common_mistake_gets_its_hint(mistake, hint):
    with pytest.raises(exercises.ExerciseFailure) as err:
        exercises.check_tile_classes(make_solution(**mistake))
    assert hint in str(err.value), str(err.value)


def test_cut_tiles_counted_as_masked_get_the_partial_block_hint():
    right = make_solution()

    def missing_hidden(n_q, n_k, block_m, block_n, causal, window):
        out = right(n_q, n_k, block_m, block_n, causal, window)
        cut_r, cut_c = n_q % block_m != 0, n_k % block_n != 0
        mark = np.zeros(out.shape, dtype=bool)  # the tiles cut short by n_q or n_k
        if cut_r:
            mark[-1, :] = True
        if cut_c:
            mark[:, -1] = True
        out[(out == 1) & mark] = 2
        return out

    with pytest.raises(exercises.ExerciseFailure, match="partial last block"):
        exercises.check_tile_classes(missing_hidden)


def test_bad_returns_are_named():
    def strings(n_q, n_k, block_m, block_n, causal, window):
        import fa_lib
        return fa_lib.tile_classes(n_q, n_k, block_m, block_n, causal=causal, window=window)

    with pytest.raises(exercises.ExerciseFailure, match="integer codes, not strings"):
        exercises.check_tile_classes(strings)

    def floor_shape(n_q, n_k, block_m, block_n, causal, window):  # drops the cut-short last blocks
        return make_solution()(n_q, n_k, block_m, block_n, causal, window)[:n_q // block_m, :n_k // block_n]

    with pytest.raises(exercises.ExerciseFailure, match="expected .* = \\(ceil"):
        exercises.check_tile_classes(floor_shape)

    with pytest.raises(TypeError, match="pass your function itself"):
        exercises.check_tile_classes(np.zeros(3))


def test_another_wrong_answer_names_the_tile():
    right = make_solution()

    def off(n_q, n_k, block_m, block_n, causal, window):
        out = right(n_q, n_k, block_m, block_n, causal, window)
        out[0, 0] = (out[0, 0] + 1) % 3
        return out

    with pytest.raises(exercises.ExerciseFailure, match=r"tile \[0, 0\] \(rows 0\.\.3, cols 0\.\.3\) is"):
        exercises.check_tile_classes(off)


def test_the_checker_imports_and_runs_without_torch():
    import inspect
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # import torch / import triton now raise ImportError
        sys.modules["triton"] = None
        import math
        import numpy as np
        from fa_lib.exercises import check_tile_classes
        from fa_lib.exercises.masks import check_tile_classes as same
        assert same is check_tile_classes
    """) + textwrap.dedent(inspect.getsource(_band)) + textwrap.dedent(inspect.getsource(make_solution)) + textwrap.dedent("""
        print(check_tile_classes(make_solution()))
        assert "torch" not in [m for m, v in sys.modules.items() if v is not None]
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
