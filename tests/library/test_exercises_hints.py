"""Every exercise checker passes a right answer and names the common mistake in each wrong one.

The wrong answers are written here as a reader would write them (one switch per mistake), not taken from
the checkers, so a checker that computes its own diagnosis wrongly fails these tests. Chapter 9's Triton
kernels are tested in test_exercises.py, which defines them.
"""
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fa_lib import exercises, reference


def fails_with(check, fn, hint):
    with pytest.raises(exercises.ExerciseFailure, match=re.escape(hint)):
        check(fn)


# --- chapter 2: one step of the online softmax -------------------------------------------------------
def online_update(bug=None):
    def update(m, l, acc, s, v):
        m_new = np.maximum(m, s.max(axis=-1))
        safe = m_new if bug == "no guard" else np.where(np.isneginf(m_new), 0.0, m_new)
        p = np.exp(s - safe[:, None])
        alpha = np.exp(m - safe)
        l_new = (l if bug in ("no rescale", "no rescale of l") else alpha * l) + p.sum(axis=-1)
        acc_new = (acc if bug in ("no rescale", "no rescale of acc") else alpha[:, None] * acc) + p @ v
        if bug == "divides":
            acc_new = acc_new / l_new[:, None]
        return m_new, l_new, acc_new

    return update


def test_online_update_passes_a_right_answer():
    assert exercises.check_online_update(online_update()) == "all 6 hidden cases pass"


@pytest.mark.parametrize("bug, hint", [
    ("no guard", "the -inf guard is missing"),
    ("no rescale", "did you multiply the old l and acc by exp(m_old - m_new)?"),
    ("no rescale of acc", "you rescaled l but not acc"),
    ("no rescale of l", "you rescaled acc but not l"),
    ("divides", "do not divide it by l in the update"),
])
def test_online_update_names_the_mistake(bug, hint):
    fails_with(exercises.check_online_update, online_update(bug), hint)


def test_online_update_names_a_missing_guard_not_a_rescale():
    with pytest.raises(exercises.ExerciseFailure) as e:
        exercises.check_online_update(online_update("no guard"))
    assert "rescale" not in str(e.value) and "exp(-inf - (-inf)) is NaN" in str(e.value)


# --- chapter 3: the tiled forward pass ----------------------------------------------------------------
def tiled_forward(bug=None):
    def forward(q, k, v, block_q, block_k, causal):
        nq, nk, d = q.shape[0], k.shape[0], q.shape[1]
        scale = {"scale 1": 1.0, "scale 1/d": 1.0 / d}.get(bug, 1.0 / np.sqrt(d))
        o, lse = np.zeros((nq, v.shape[1])), np.full(nq, -np.inf)
        for r0 in range(0, nq, block_q):
            rows = np.arange(r0, min(r0 + block_q, nq))
            m, l, acc = np.full(len(rows), -np.inf), np.zeros(len(rows)), np.zeros((len(rows), v.shape[1]))
            for c0 in range(0, nk, block_k):
                cols = np.arange(c0, min(c0 + block_k, nk))
                s = q[rows] @ k[cols].T * scale
                if causal and bug != "no mask":
                    off = 0 if bug == "top-left" else nk - nq
                    s = np.where(cols[None, :] <= rows[:, None] + off, s, -np.inf)
                m_new = np.maximum(m, s.max(axis=-1))
                safe = m_new if bug == "no guard" else np.where(np.isneginf(m_new), 0.0, m_new)
                p = np.exp(s - safe[:, None])
                alpha = np.exp(m - safe)
                l = (l if bug == "no rescale" else alpha * l) + p.sum(axis=-1)
                acc = (acc if bug == "no rescale" else alpha[:, None] * acc) + p @ v[cols]
                m = m_new
            if bug == "no division":
                o[rows] = acc
            elif bug == "0 / 0":
                o[rows] = acc / l[:, None]
            else:
                o[rows] = acc / np.where(l > 0, l, 1.0)[:, None]
            lse[rows] = m + np.log(l)
        return o, lse

    return forward


def test_tiled_forward_passes_a_right_answer():
    assert exercises.check_tiled_forward(tiled_forward()) == "all 6 hidden cases pass"


@pytest.mark.parametrize("bug, hint", [
    ("no mask", "the causal mask is missing"),
    ("top-left", "the causal mask is aligned top-left; fa_lib aligns it bottom-right: query i sees key j iff "
                 "j <= i + N_K - N_Q"),
    ("no guard", "the -inf guard is missing"),
    ("0 / 0", "divide by l only where l > 0"),
    ("no rescale", "you did not rescale acc and l"),
    ("scale 1", "wrong softmax scale: the scores are not scaled"),
    ("scale 1/d", "wrong softmax scale: you used 1/d"),
    ("no division", "o is acc before the division: divide acc by l once, at the end"),
])
def test_tiled_forward_names_the_mistake(bug, hint):
    fails_with(exercises.check_tiled_forward, tiled_forward(bug), hint)


@pytest.mark.parametrize("bug", ["no mask", "top-left", "no guard"])
def test_tiled_forward_blames_no_rescale_for_a_mask_or_a_guard(bug):
    with pytest.raises(exercises.ExerciseFailure) as e:
        exercises.check_tiled_forward(tiled_forward(bug))
    assert "rescale" not in str(e.value)


# --- chapter 4: the gradients of a matrix product -----------------------------------------------------
def test_matmul_backward_passes_a_right_answer():
    assert exercises.check_matmul_backward(lambda a, b, dc: (dc @ b.T, a.T @ dc)) == "all 5 hidden cases pass"


@pytest.mark.parametrize("fn, hint", [
    (lambda a, b, dc: (dc @ b, a.T @ dc), "da is dc @ b (b not transposed)"),
    (lambda a, b, dc: (b @ dc.T, a.T @ dc), "da is b @ dc.T (the transpose of the answer: (dc @ b.T).T)"),
    (lambda a, b, dc: (b.T @ dc, a.T @ dc), "da is b.T @ dc"),
    (lambda a, b, dc: (dc @ b.T, a @ dc), "db is a @ dc (a not transposed)"),
    (lambda a, b, dc: (dc @ b.T, dc.T @ a), "db is dc.T @ a (the transpose of the answer: (a.T @ dc).T)"),
    (lambda a, b, dc: (a.T @ dc, dc @ b.T), "you returned (db, da)"),
    (lambda a, b, dc: (dc @ b.T, a.T @ dc * 2), "db[0, 0] = "),
])
def test_matmul_backward_names_the_mistake(fn, hint):
    fails_with(exercises.check_matmul_backward, fn, hint)


def test_matmul_backward_catches_a_transposition_by_its_shape():
    # square matrices hide a transposed answer's shape, the non-square cases do not
    def transposed_db(a, b, dc):
        if a.shape[0] == a.shape[1] == b.shape[1]:
            return dc @ b.T, a.T @ dc  # right on the square case
        return dc @ b.T, dc.T @ a

    fails_with(exercises.check_matmul_backward, transposed_db, "db is dc.T @ a")
    fails_with(exercises.check_matmul_backward, lambda a, b, dc: (dc @ b.T, (a.T @ dc)[:, :1]), "db has shape")

    def raises_in_matmul(a, b, dc):
        return (dc @ b.T, a.T @ dc) if a.shape[0] == a.shape[1] == b.shape[1] else (dc @ b, a.T @ dc)

    fails_with(exercises.check_matmul_backward, raises_in_matmul, "your function raised ValueError")


# --- chapter 5: the backward pass of the softmax ------------------------------------------------------
def rowsum(x, axis=-1):
    return x.sum(axis=axis, keepdims=True)


def test_softmax_backward_passes_a_right_answer():
    assert exercises.check_softmax_backward(lambda p, dp: p * (dp - rowsum(p * dp))) == "all 5 hidden cases pass"


@pytest.mark.parametrize("fn, hint", [
    (lambda p, dp: p * dp, "you used p * dp without subtracting rowsum(p * dp) (D)"),
    (lambda p, dp: p * (dp - rowsum(p * dp, axis=0)), "the row sum is over the wrong axis"),
    (lambda p, dp: dp * (dp - rowsum(p * dp)), "you multiplied by dp instead of p"),
    (lambda p, dp: dp * (p - rowsum(p * dp)), "p and dp are swapped"),
    (lambda p, dp: p * (dp - rowsum(dp)), "D is rowsum(p * dp), not rowsum(dp)"),
    (lambda p, dp: dp - rowsum(p * dp), "the factor p is missing"),
    (lambda p, dp: p * (rowsum(p * dp) - dp), "the sign is flipped"),
    (lambda p, dp: p * (dp - (p * dp).sum(axis=-1)), "your function raised ValueError"),
])
def test_softmax_backward_names_the_mistake(fn, hint):
    fails_with(exercises.check_softmax_backward, fn, hint)


def test_softmax_backward_names_a_row_sum_broadcast_along_the_columns():
    # without keepdims the (rows,) sums broadcast along the columns; only a square case has the shapes
    def lost_axis(p, dp):
        d = (p * dp).sum(axis=-1)
        return p * (dp - d) if p.shape[0] == p.shape[1] else p * (dp - d[:, None])

    fails_with(exercises.check_softmax_backward, lost_axis, "the row sum is over the wrong axis after broadcasting")


def test_softmax_backward_checks_one_hot_rows_a_single_key_and_4096_keys():
    seen = []

    def spy(p, dp):
        seen.append(p.copy())
        return p * (dp - rowsum(p * dp))

    exercises.check_softmax_backward(spy)
    assert any(((row == 1) | (row == 0)).all() and row.sum() == 1 for p in seen for row in p)  # one-hot
    assert any(p.shape[1] == 1 for p in seen) and any(p.shape[1] == 4096 for p in seen)


# --- chapter 6: one tile of the backward pass ---------------------------------------------------------
def tile_backward(bug=None):
    def tile(q, k, v, do, lse, delta, scale):
        if bug == "1/sqrt(d)":
            scale = 1 / np.sqrt(q.shape[1])
        s = scale * (q @ k.T)
        if bug == "no lse":
            p = np.exp(s)
        elif bug == "no guard":
            p = np.exp(s - lse[:, None])
        else:
            p = np.exp(s - np.where(np.isneginf(lse), np.inf, lse)[:, None])
        dv = p.T @ do
        dp = do @ v.T
        d = (p * dp).sum(axis=-1) if bug == "local D" else delta
        ds = p * (dp - d[:, None])
        out_scale = 1.0 if bug == "no scale" else scale
        dq = out_scale * (ds @ k)
        dk = out_scale * ((ds @ q) if bug == "dS not transposed" else (ds.T @ q))
        return dq, dk, dv

    return tile


def test_backward_tile_passes_a_right_answer():
    assert exercises.check_backward_tile(tile_backward()) == "all 5 hidden cases pass"


@pytest.mark.parametrize("bug, hint", [
    ("no scale", "missing scale in dq/dk"),
    ("local D", "dS computed with the row sum of this tile (a local D) instead of the global delta"),
    ("no lse", "P not normalised with lse (used exp(s) without subtracting lse)"),
    ("no guard", "NaN from a row with lse = -inf"),
    ("1/sqrt(d)", "uses the scale 1/sqrt(d) instead of the scale argument"),
    ("dS not transposed", "dS is transposed in dq or dk"),
])
def test_backward_tile_names_the_mistake(bug, hint):
    fails_with(exercises.check_backward_tile, tile_backward(bug), hint)


def test_backward_tiles_add_up_to_the_reference_gradient():
    # the checker's cases: tiles summed over a row's key tiles give fa_lib.reference's full gradient,
    # with two key tiles or more per row (a local D differs from the global one) and rows with lse = -inf
    from fa_lib.exercises.backward_tile import _tile_cases

    tile = tile_backward()
    saw_empty_row = False
    for _, q, k, v, do, mask, scale, bq, bk in _tile_cases():
        assert k.shape[0] > bk  # more than one key tile
        o, lse = reference.naive_attention(q, k, v, mask=mask, softmax_scale=scale)
        delta = (do * o).sum(axis=-1)
        saw_empty_row |= bool(np.isneginf(lse).any())
        sums = [np.zeros_like(x) for x in (q, k, v)]
        for r0 in range(0, q.shape[0], bq):
            for c0 in range(0, k.shape[0], bk):
                r, c = slice(r0, r0 + bq), slice(c0, c0 + bk)
                dq, dk, dv = tile(q[r], k[c], v[c], do[r], lse[r], delta[r], scale)
                sums[0][r] += dq
                sums[1][c] += dk
                sums[2][c] += dv
        want = reference.naive_attention_backward(q, k, v, do, mask=mask, softmax_scale=scale)
        for got, w in zip(sums, want):
            np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12)
    assert saw_empty_row


# --- chapter 7: the blockwise backward ----------------------------------------------------------------
def blockwise_backward(bug=None):
    def backward(q, k, v, o, lse, do, block_q, block_k, causal):
        nq, nk, d = q.shape[0], k.shape[0], q.shape[1]
        scale = 1 / np.sqrt(d)
        delta = np.zeros(nq) if bug == "no D" else (do * o).sum(axis=-1)
        lse_safe = lse if bug == "no guard" else np.where(np.isneginf(lse), np.inf, lse)
        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
        for c0 in range(0, nk, block_k):
            cols = np.arange(c0, min(c0 + block_k, nk))
            for r0 in range(0, nq, block_q):
                rows = np.arange(r0, min(r0 + block_q, nq))
                s = q[rows] @ k[cols].T * scale
                if causal and bug != "no mask":
                    off = 0 if bug == "top-left" else nk - nq
                    s = np.where(cols[None, :] <= rows[:, None] + off, s, -np.inf)
                p = np.exp(s) if bug == "no lse" else np.exp(s - lse_safe[rows, None])
                dp = do[rows] @ v[cols].T
                d_i = (p * dp).sum(axis=-1) if bug == "local D" else delta[rows]
                ds = p * (dp - d_i[:, None])
                out_scale = 1.0 if bug == "no scale" else scale
                dq[rows] += out_scale * (ds @ k[cols])
                dk[cols] += out_scale * (ds.T @ q[rows])
                dv[cols] += p.T @ do[rows]
        return dq, dk, dv

    return backward


def test_blockwise_backward_passes_a_right_answer():
    assert exercises.check_blockwise_backward(blockwise_backward()) == "all 6 hidden cases pass"


@pytest.mark.parametrize("bug, hint", [
    ("no D", "dS = P * dP: D is missing"),
    ("local D", "dS computed with the row sum of this tile (a local D)"),
    ("no scale", "missing scale in dq/dk"),
    ("no lse", "P not normalised with lse (used exp(s) without subtracting lse)"),
    ("no mask", "the causal mask is missing"),
    ("top-left", "the causal mask is aligned top-left; fa_lib aligns it bottom-right"),
    ("no guard", "NaN from a row with lse = -inf"),
])
def test_blockwise_backward_names_the_mistake(bug, hint):
    fails_with(exercises.check_blockwise_backward, blockwise_backward(bug), hint)


# --- chapter 10: the D preprocess ----------------------------------------------------------------------
@pytest.mark.parametrize("fn, hint", [
    (lambda o, do: do.float().sum(-1), "you summed dO alone"),
    (lambda o, do: o.float().sum(-1), "you summed O alone"),
    (lambda o, do: (o * do).sum(-1).float(), "you multiplied and summed in float16"),
])
def test_d_preprocess_names_the_mistake(fn, hint):
    pytest.importorskip("torch")
    fails_with(exercises.check_d_preprocess, fn, hint)


# --- the NumPy checkers need NumPy alone ----------------------------------------------------------------
def test_numpy_checkers_import_and_run_without_torch():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # import torch (and triton) now raise ImportError
        sys.modules["triton"] = None
        import numpy as np
        from fa_lib import exercises
        from fa_lib.exercises import backward_tile, matmul, softmax  # the modules, by name

        def tile(q, k, v, do, lse, delta, scale):
            p = np.exp(scale * q @ k.T - np.where(np.isneginf(lse), np.inf, lse)[:, None])
            ds = p * (do @ v.T - delta[:, None])
            return scale * ds @ k, scale * ds.T @ q, p.T @ do

        print(exercises.check_matmul_backward(lambda a, b, dc: (dc @ b.T, a.T @ dc)))
        print(exercises.check_softmax_backward(lambda p, dp: p * (dp - (p * dp).sum(-1, keepdims=True))))
        print(exercises.check_backward_tile(tile))
        try:
            exercises.check_softmax_backward(lambda p, dp: p * dp)
        except exercises.ExerciseFailure as e:
            print("rejected:", "rowsum(p * dp)" in str(e))
        assert matmul.check_matmul_backward is exercises.check_matmul_backward
        assert softmax.check_softmax_backward is exercises.check_softmax_backward
        assert backward_tile.check_backward_tile is exercises.check_backward_tile
        assert [m for m in ("torch", "triton") if sys.modules.get(m) is not None] == []
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split("\n")[:4] == ["all 5 hidden cases pass"] * 3 + ["rejected: True"], run.stdout
