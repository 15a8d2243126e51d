"""check_split_merge (chapter 13) accepts an exact merge of split-KV partials and names each usual mistake."""
import subprocess
import sys

import numpy as np
import pytest

from fa_lib import exercises


def good_merge(o_parts, lse_parts):
    m = lse_parts.max(axis=0)  # (rows,)
    m_safe = np.where(np.isneginf(m), 0.0, m)  # a row whose every split is empty
    w = np.exp(lse_parts - m_safe)  # (S, rows), each at most 1
    total = w.sum(axis=0)
    lse = m_safe + np.log(total)  # -inf where total is 0
    o = (w[..., None] * o_parts).sum(axis=0) / np.where(total > 0, total, 1.0)[:, None]
    return o, lse


def averaged_merge(o_parts, lse_parts):
    _, lse = good_merge(o_parts, lse_parts)
    return o_parts.mean(axis=0), lse  # equal weights


def overflowing_merge(o_parts, lse_parts):
    w = np.exp(lse_parts)  # inf once lse_s passes ~709
    total = w.sum(axis=0)
    return (w[..., None] * o_parts).sum(axis=0) / np.where(total > 0, total, 1.0)[:, None], np.log(total)


def unguarded_merge(o_parts, lse_parts):
    m = lse_parts.max(axis=0)
    w = np.exp(lse_parts - m)  # -inf - (-inf) = NaN on a row with no key
    total = w.sum(axis=0)
    return (w[..., None] * o_parts).sum(axis=0) / total[:, None], m + np.log(total)


def log_sum_merge(o_parts, lse_parts):
    o, _ = good_merge(o_parts, lse_parts)
    return o, np.log(lse_parts.sum(axis=0))  # not a logsumexp


def test_accepts_a_correct_merge():
    assert exercises.check_split_merge(good_merge) == "all 5 hidden cases pass"


@pytest.mark.parametrize("fn, text", [
    (averaged_merge, "you averaged the o_parts with equal weights"),
    (overflowing_merge, "exp(lse_s) overflows at large LSE"),
    (unguarded_merge, "-inf - (-inf) is NaN: guard it"),
    (log_sum_merge, "log(sum_s lse_s), the log of the sum of the LSEs"),
])
def test_each_mistake_gets_its_hint(fn, text):
    with pytest.raises(exercises.ExerciseFailure) as info:
        exercises.check_split_merge(fn)
    assert text in str(info.value)


def test_wrong_return_and_argument_are_named():
    with pytest.raises(exercises.ExerciseFailure, match="should return 2 arrays"):
        exercises.check_split_merge(lambda o, l: o.sum(axis=0))
    with pytest.raises(TypeError, match="pass your function itself"):
        exercises.check_split_merge("good_merge")


def test_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from fa_lib.exercises import decoding\n"
            "print(decoding.check_split_merge.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "check_split_merge"
