"""The checkers of exercises 5.4 (the softmax Jacobian), 6.4 (the standard attention backward) and 7.3
(the HBM traffic of one head's backward pass): a right answer passes, each common mistake is named.

As in test_exercises_hints.py, the wrong answers are written here as a reader would write them (one
switch per mistake), not taken from the checkers.
"""
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fa_lib import exercises


def fails_with(check, fn, hint):
    with pytest.raises(exercises.ExerciseFailure, match=re.escape(hint)):
        check(fn)


# --- chapter 5: the softmax Jacobian --------------------------------------------------------------------
def jacobian(bug=None):
    def jac(p):
        if bug == "softmax of p":
            e = np.exp(p - p.max())
            p = e / e.sum()
        outer = p @ p.T if bug == "1-D matmul" else np.outer(p, p)
        return {"no diag": -outer,
                "diag only": np.diag(p),
                "sign": outer - np.diag(p),
                "diagonal only": np.diag(p) - np.diag(p**2),
                "vector": p * (1 - p)}.get(bug, np.diag(p) - outer)

    return jac


def test_softmax_jacobian_passes_a_right_answer():
    assert exercises.check_softmax_jacobian(jacobian()) == "all 4 hidden cases pass"


@pytest.mark.parametrize("bug, hint", [
    ("no diag", "the diagonal term diag(p) is missing"),
    ("diag only", "the outer product is missing: J = diag(p) - p p^T, not diag(p) alone"),
    ("sign", "the sign is flipped: J = diag(p) - p p^T, not p p^T - diag(p)"),
    ("diagonal only", "p p^T is subtracted on the diagonal only"),
    ("1-D matmul", "p @ p.T on a 1-D array is the scalar p . p"),
    ("softmax of p", "you applied the softmax to p"),
    ("vector", "the Jacobian is an (n, n) matrix"),
])
def test_softmax_jacobian_names_the_mistake(bug, hint):
    fails_with(exercises.check_softmax_jacobian, jacobian(bug), hint)


def test_softmax_jacobian_names_the_case():
    with pytest.raises(exercises.ExerciseFailure, match=r"^case 'n = 3, the chapter's symbolic size"):
        exercises.check_softmax_jacobian(jacobian("sign"))


def test_softmax_jacobian_reports_a_wrong_entry():
    def off(p):
        j = np.diag(p) - np.outer(p, p)
        j[0, 1] += 1e-3
        return j

    fails_with(exercises.check_softmax_jacobian, off, "J[0, 1] = ")


# --- chapter 6: the standard attention backward, with the N x N matrices ---------------------------------
def attention_backward(bug=None):
    def backward(q, k, v, do, scale):
        if bug == "1/sqrt(d)":
            scale = 1 / np.sqrt(q.shape[1])  # the scale argument ignored
        s = q @ k.T * (1.0 if bug == "S unscaled" else scale)
        if bug == "no max":
            e = np.exp(s)
            p = e / e.sum(axis=-1, keepdims=True)
        elif bug == "columns":
            e = np.exp(s - s.max(axis=0, keepdims=True))
            p = e / e.sum(axis=0, keepdims=True)
        else:
            e = np.exp(s - s.max(axis=-1, keepdims=True))
            p = e / e.sum(axis=-1, keepdims=True)
        dv = p @ do if bug == "dv = P dO" else p.T @ do
        dp = do @ v.T
        d = np.sum(dp * p, axis=0 if bug == "D columns" else -1, keepdims=True)
        ds = p * dp if bug == "no D" else p * (dp - d)
        out_scale = 1.0 if bug == "no scale" else scale
        dq = ds @ k * out_scale
        dk = (ds @ q if bug == "dk = dS Q" else ds.T @ q) * out_scale
        if bug == "order":
            return dk, dq, dv
        if bug == "order dv first":
            return dv, dq, dk
        return dq, dk, dv

    return backward


def test_attention_backward_passes_a_right_answer():
    assert exercises.check_attention_backward(attention_backward()) == "all 5 hidden cases pass"


@pytest.mark.parametrize("bug, hint", [
    ("no scale", "dq: the scale is missing in dq and dk"),
    ("S unscaled", "the scores miss the scale: P = softmax(scale * q @ k.T)"),
    ("1/sqrt(d)", "dq uses the scale 1/sqrt(d) instead of the scale argument (0.7 here)"),
    ("no D", "dS = P * dP: the row sum is not subtracted"),
    ("D columns", "the row sum is over the wrong axis"),
    ("dv = P dO", "dv is P @ do (P not transposed): dv = P.T @ do"),
    ("dk = dS Q", "dk is dS @ q (dS not transposed): dk = scale * dS.T @ q"),
    ("order", "you returned (dk, dq, dv): return (dq, dk, dv)"),
    ("order dv first", "you returned (dv, dq, dk): return (dq, dk, dv)"),
    ("columns", "the softmax is over the wrong axis"),
    ("no max", "subtract each row's maximum before exp"),
])
def test_attention_backward_names_the_mistake(bug, hint):
    fails_with(exercises.check_attention_backward, attention_backward(bug), hint)


def test_attention_backward_catches_a_transpose_on_the_square_case():
    with pytest.raises(exercises.ExerciseFailure, match=r"^case '5 queries, 5 keys, d = 5"):
        exercises.check_attention_backward(attention_backward("dv = P dO"))


def test_attention_backward_explains_shapes_that_do_not_fit():
    def transposed_product(q, k, v, do, scale):
        if q.shape[0] == k.shape[0]:  # right on the square case, to reach the next one
            return attention_backward()(q, k, v, do, scale)
        s = q @ k.T * scale
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        return p @ k, p.T @ q, p @ do  # (6, 9) @ (9, 4) fits, (6, 9) @ (6, 4) does not

    fails_with(exercises.check_attention_backward, transposed_product,
               "with q and do (6, 4), k and v (9, 4): P, dP and dS are (6, 9)")


# --- chapter 7: the HBM traffic of one head's backward pass ----------------------------------------------
def traffic(bug=None):
    def count(n, d):
        nn = {"no N x N": 0, "P once": 5 * n * n, "swap": 6 * d * d}.get(bug, 6 * n * n)
        vec = {"no vectors": 0, "swap": 4 * d}.get(bug, 4 * n)
        standard = 4 * n * d + 3 * n * d + nn  # Q, K, V, dO read; dQ, dK, dV written
        flash = 5 * n * d + 3 * n * d + vec  # Q, K, V, O, dO read; dQ, dK, dV written
        if bug == "flash with N x N":
            flash += 6 * n * n
        if bug == "bytes":
            return 2 * standard, 2 * flash
        return (flash, standard) if bug == "order" else (standard, flash)

    return count


def test_memory_traffic_passes_a_right_answer():
    assert exercises.check_memory_traffic(traffic()) == "all 5 hidden cases pass"


def test_memory_traffic_matches_the_book_at_its_example():
    standard, flash = traffic()(4096, 64)
    # the N x N part at N = 4096: P written and read is chapter 7's 2 N^2 (its 44.7 us at 1.5 TB/s)
    assert 2 * 2 * 4096**2 / 1.5e12 * 1e6 == pytest.approx(44.7, abs=0.05)
    assert standard - 7 * 4096 * 64 == 3 * 2 * 4096**2
    assert flash == 8 * 4096 * 64 + 4 * 4096


@pytest.mark.parametrize("bug, hint", [
    ("no N x N", "standard = 1,835,008: the N x N terms are missing"),
    ("P once", "P is counted once: a stored P is written by the forward pass and read by the backward"),
    ("no vectors", "flash = 2,097,152: the LSE and D vectors are missing"),
    ("swap", "n and d are swapped"),
    ("order", "you returned (flash, standard): return (standard, flash)"),
    ("flash with N x N", "the N x N terms are counted for FlashAttention"),
    ("bytes", "you counted bytes (2 per bf16 element): count elements"),
])
def test_memory_traffic_names_the_mistake(bug, hint):
    fails_with(exercises.check_memory_traffic, traffic(bug), hint)


def test_memory_traffic_wants_numbers():
    fails_with(exercises.check_memory_traffic, lambda n, d: ("n^2", 0), "should be a number of elements")
    fails_with(exercises.check_memory_traffic, lambda n, d: 7 * n * d, "should return 2 arrays")


# --- the three modules need NumPy alone -------------------------------------------------------------------
def test_new_checkers_import_and_run_without_torch():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # import torch (and triton) now raise ImportError
        sys.modules["triton"] = None
        import numpy as np
        from fa_lib import exercises
        from fa_lib.exercises import attention_backward, jacobian, traffic  # the modules, by name

        def backward(q, k, v, do, scale):
            s = scale * q @ k.T
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            dp = do @ v.T
            ds = p * (dp - (dp * p).sum(-1, keepdims=True))
            return scale * ds @ k, scale * ds.T @ q, p.T @ do

        print(exercises.check_softmax_jacobian(lambda p: np.diag(p) - np.outer(p, p)))
        print(exercises.check_attention_backward(backward))
        print(exercises.check_memory_traffic(lambda n, d: (7 * n * d + 6 * n * n, 8 * n * d + 4 * n)))
        try:
            exercises.check_softmax_jacobian(lambda p: -np.outer(p, p))
        except exercises.ExerciseFailure as e:
            print("rejected:", "diag(p) is missing" in str(e))
        assert jacobian.check_softmax_jacobian is exercises.check_softmax_jacobian
        assert attention_backward.check_attention_backward is exercises.check_attention_backward
        assert traffic.check_memory_traffic is exercises.check_memory_traffic
        assert [m for m in ("torch", "triton") if sys.modules.get(m) is not None] == []
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split("\n")[:4] == ["all 4 hidden cases pass", "all 5 hidden cases pass",
                                          "all 5 hidden cases pass", "rejected: True"], run.stdout
