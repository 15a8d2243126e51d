"""fa_lib.exercises.check_ring_lse and check_ring_step (chapter 14): a right answer passes, each classic mistake
gets its hint, and the checkers need NumPy alone."""
import inspect
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fa_lib import reference
from fa_lib.exercises import ExerciseFailure, check_ring_lse, check_ring_step


def good_step(o, lse, q, k_blk, v_blk, scale, mask):
    s = scale * (q @ k_blk.T)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m_blk = s.max(axis=1)
    p = np.exp(s - np.where(np.isneginf(m_blk), 0.0, m_blk)[:, None])
    l_blk = p.sum(axis=1)
    seen_blk = l_blk > 0
    o_blk = np.where(seen_blk[:, None], (p @ v_blk) / np.where(seen_blk, l_blk, 1.0)[:, None], 0.0)
    lse_blk = np.where(seen_blk, m_blk + np.log(np.where(seen_blk, l_blk, 1.0)), -np.inf)
    m = np.maximum(lse, lse_blk)
    m = np.where(np.isneginf(m), 0.0, m)
    a, b = np.exp(lse - m), np.exp(lse_blk - m)
    total = a + b
    seen = total > 0
    t = np.where(seen, total, 1.0)
    return (o * a[:, None] + o_blk * b[:, None]) / t[:, None], np.where(seen, m + np.log(t), -np.inf)


GOOD = inspect.getsource(good_step)


def _block(q, k, v, scale, mask, guard=True):
    s = scale * (q @ k.T)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = s.max(axis=1)
    p = np.exp(s - (np.where(np.isneginf(m), 0.0, m) if guard else m)[:, None])
    l = p.sum(axis=1)
    if guard:
        return np.where(l[:, None] > 0, (p @ v) / np.where(l > 0, l, 1)[:, None], 0.0), \
            np.where(l > 0, m + np.log(np.where(l > 0, l, 1)), -np.inf)
    return (p @ v) / l[:, None], m + np.log(l)


def averaged(o, lse, q, k, v, scale, mask):
    o_b, lse_b = _block(q, k, v, scale, mask)
    return (o + o_b) / 2, np.logaddexp(lse, lse_b)


def no_shift(o, lse, q, k, v, scale, mask):
    o_b, lse_b = _block(q, k, v, scale, mask)
    a, b = np.exp(lse), np.exp(lse_b)
    return (o * a[:, None] + o_b * b[:, None]) / (a + b)[:, None], np.log(a + b)


def nan_for_empty_rows(o, lse, q, k, v, scale, mask):
    o_b, lse_b = _block(q, k, v, scale, mask, guard=False)  # -inf - (-inf) for a row with no visible key
    m = np.maximum(lse, lse_b)
    a, b = np.exp(lse - m), np.exp(lse_b - m)
    return (o * a[:, None] + o_b * b[:, None]) / (a + b)[:, None], m + np.log(a + b)


def scale_twice(o, lse, q, k, v, scale, mask):
    return good_step(o, lse, q, k, v, scale * scale, mask)


def no_scale(o, lse, q, k, v, scale, mask):
    return good_step(o, lse, q, k, v, 1.0, mask)


def mask_ignored(o, lse, q, k, v, scale, mask):
    return good_step(o, lse, q, k, v, scale, None)


def test_a_right_answer_passes():
    assert check_ring_step(good_step) == "all 6 hidden cases pass"


@pytest.mark.parametrize("wrong, hint", [
    (averaged, "you averaged the two outputs"),
    (no_shift, "exp(lse) overflows. Subtract the larger of the two LSEs"),
    (nan_for_empty_rows, "NaN for a row that sees no key"),
    (scale_twice, "the scale is applied twice"),
    (no_scale, "the scale is not applied"),
    (mask_ignored, "the mask is ignored"),
])
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(ExerciseFailure, match=hint.replace("(", r"\(").replace(")", r"\)")):
        check_ring_step(wrong)


def test_wrong_shapes_and_types_are_named():
    with pytest.raises(TypeError, match="pass your function itself"):
        check_ring_step("good_step")
    with pytest.raises(ExerciseFailure, match="should return 2 arrays"):
        check_ring_step(lambda *a: a[0])
    with pytest.raises(ExerciseFailure, match="o should have shape"):
        check_ring_step(lambda o, lse, *a: (o[:, :1], lse))


def test_the_checker_needs_numpy_alone():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None
        sys.modules["triton"] = None
        import numpy as np
        from fa_lib.exercises import check_ring_step
    """) + GOOD + textwrap.dedent("""
        assert check_ring_step(good_step) == "all 6 hidden cases pass"
        assert "torch" not in [m for m, v in sys.modules.items() if v is not None]
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


def ring_lse(x_shards):
    world = len(x_shards)
    held = list(range(world))  # rank r holds the shard that started on rank held[r]
    states = [None] * world
    for _ in range(world):
        for r in range(world):
            part = reference.softmax_state(x_shards[held[r]])
            states[r] = part if states[r] is None else reference.merge_states(states[r], part)
        held = [held[(r - 1) % world] for r in range(world)]
    return [float(m + np.log(ell)) for m, ell in states]


def test_ring_lse_right_answer_passes():
    assert check_ring_lse(ring_lse) == "all 4 hidden cases pass"


@pytest.mark.parametrize("wrong, hint", [
    (lambda shards: [float(np.log(np.exp(np.concatenate(shards)).sum()))] * len(shards), "inf or NaN: exp\\(x\\) overflows"),
    (lambda shards: [float(x.max() + np.log(np.exp(x - x.max()).sum())) for x in shards], "the LSE of its own shard"),
    (lambda shards: ring_lse(shards)[:1], "return one number per rank"),
    (lambda shards: [v + 1e-3 for v in ring_lse(shards)], "expected .* on every rank"),
])
def test_ring_lse_mistakes_get_their_hints(wrong, hint):
    with pytest.raises(ExerciseFailure, match=hint):
        check_ring_lse(wrong)
    with pytest.raises(TypeError, match="pass your function itself"):
        check_ring_lse("ring_lse")
