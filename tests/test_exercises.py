"""The exercise checkers accept a correct solution and reject broken ones with a message that says why."""
import numpy as np
import pytest
import torch

from fa_lib import exercises, reference


# --- chapter 2: the online update ------------------------------------------------------------------
def good_update(m, l, acc, s, v):
    m_new = np.maximum(m, s.max(axis=-1))
    safe = np.where(np.isinf(m_new), 0.0, m_new)  # a row that has seen nothing yet
    p = np.exp(s - safe[:, None])
    alpha = np.exp(m - safe)
    return m_new, alpha * l + p.sum(-1), alpha[:, None] * acc + p @ v


def no_rescale_update(m, l, acc, s, v):
    m_new = np.maximum(m, s.max(axis=-1))
    safe = np.where(np.isinf(m_new), 0.0, m_new)
    p = np.exp(s - safe[:, None])
    return m_new, l + p.sum(-1), acc + p @ v  # forgets exp(m_old - m_new)


def unsafe_update(m, l, acc, s, v):
    m_new = np.maximum(m, s.max(axis=-1))
    p = np.exp(s - m_new[:, None])  # -inf - (-inf) = NaN on a row that has seen nothing
    alpha = np.exp(m - m_new)
    return m_new, alpha * l + p.sum(-1), alpha[:, None] * acc + p @ v


def test_online_update_accepts_a_correct_solution():
    assert exercises.check_online_update(good_update) == "all 6 hidden cases pass"


@pytest.mark.parametrize("fn, match", [(no_rescale_update, "rescale|multiply the old l"),
                                       (unsafe_update, "is NaN")])
def test_online_update_rejects_broken_solutions(fn, match):
    with pytest.raises(exercises.ExerciseFailure, match=match):
        exercises.check_online_update(fn)


# --- chapter 3: the tiled forward -------------------------------------------------------------------
def good_forward(q, k, v, block_q, block_k, causal):
    return reference.flash_forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k)


def top_left_causal_forward(q, k, v, block_q, block_k, causal):
    if causal:
        mask = np.tril(np.ones((q.shape[0], k.shape[0]), dtype=bool))  # top-left: the wrong alignment
        return reference.flash_forward(q, k, v, mask=mask, block_q=block_q, block_k=block_k)
    return good_forward(q, k, v, block_q, block_k, causal)


def nan_on_empty_rows_forward(q, k, v, block_q, block_k, causal):
    o, lse = good_forward(q, k, v, block_q, block_k, causal)
    o[np.isinf(lse)] = np.nan  # as 0/0 would give
    return o, lse


def no_maximum_forward(q, k, v, block_q, block_k, causal):
    s = q @ k.T / np.sqrt(q.shape[1])
    if causal:
        s = np.where(reference.causal_mask(*s.shape), s, -np.inf)
    e = np.exp(s)  # overflows for large scores
    l = e.sum(-1)
    with np.errstate(all="ignore"):
        return np.where(l[:, None] > 0, e @ v / l[:, None], 0.0), np.log(l)


def test_tiled_forward_accepts_a_correct_solution():
    assert exercises.check_tiled_forward(good_forward) == "all 6 hidden cases pass"


@pytest.mark.parametrize("fn, match", [
    (top_left_causal_forward, "causal, 6 queries"),
    (nan_on_empty_rows_forward, "no key.*is NaN"),
    (no_maximum_forward, "scores near a thousand"),
    (lambda q, k, v, bq, bk, c: good_forward(q, k, v, bq, bk, c)[0], "should return 2 arrays"),
    (lambda q, k, v, bq, bk, c: (good_forward(q, k, v, bq, bk, c)[0].T, None), "has shape"),
])
def test_tiled_forward_rejects_broken_solutions(fn, match):
    with pytest.raises(exercises.ExerciseFailure, match=match):
        exercises.check_tiled_forward(fn)


# --- chapter 7: the blockwise backward -------------------------------------------------------------
def good_backward(q, k, v, o, lse, do, block_q, block_k, causal):
    return reference.flash_backward(q, k, v, o, lse, do, causal=causal, block_q=block_q, block_k=block_k)


def no_d_backward(q, k, v, o, lse, do, block_q, block_k, causal):
    # Forgets D: dS = P * dP. Equivalent to a zero O in the D identity.
    return reference.flash_backward(q, k, v, np.zeros_like(o), lse, do, causal=causal, block_q=block_q,
                                    block_k=block_k)


def test_blockwise_backward_accepts_a_correct_solution():
    assert exercises.check_blockwise_backward(good_backward) == "all 6 hidden cases pass"


def test_blockwise_backward_rejects_a_missing_d():
    with pytest.raises(exercises.ExerciseFailure, match="dS = P \\* \\(dP - D\\)"):
        exercises.check_blockwise_backward(no_d_backward)


# --- chapter 10: the D preprocess -------------------------------------------------------------------
def test_d_preprocess_accepts_a_correct_solution():
    assert exercises.check_d_preprocess(lambda o, do: (o.float() * do.float()).sum(-1)) == "all 3 hidden cases pass"


@pytest.mark.parametrize("fn, match", [
    (lambda o, do: (o.float() * do.float()).sum(-2), "has shape"),
    (lambda o, do: (o * do).sum(-1), "dtype"),
    (lambda o, do: (o.float() * do.float()).sum(-1) * 1.01, "expected"),
    (lambda o, do: (o.float() * do.float()).sum(-1).numpy(), "torch.Tensor"),
])
def test_d_preprocess_rejects_broken_solutions(fn, match):
    with pytest.raises(exercises.ExerciseFailure, match=match):
        exercises.check_d_preprocess(fn)


def test_d_preprocess_accepts_fa_libs_own_kernel():
    # The library's preprocess kernel, launched as the chapter's exercise would launch the reader's.
    import triton

    from fa_lib import kernels

    def kernel_preprocess(o, do):
        b, h, n, d = o.shape
        delta = torch.empty(b, h, n, dtype=torch.float32)
        kernels._attn_bwd_preprocess[(triton.cdiv(n, 64), h, b)](
            o, do, delta, delta, *o.stride(), *do.stride(), h, n, d,
            HEAD_DIM=max(16, triton.next_power_of_2(d)), BLOCK_M=64, HAS_DLSE=False)
        return delta

    if not kernels.INTERPRET:
        pytest.skip("runs the kernel on CPU tensors under the interpreter")
    assert exercises.check_d_preprocess(kernel_preprocess) == "all 3 hidden cases pass"


@pytest.mark.parametrize("checker", [exercises.check_online_update, exercises.check_tiled_forward,
                                     exercises.check_blockwise_backward, exercises.check_d_preprocess])
def test_checkers_say_what_to_pass(checker):
    with pytest.raises(TypeError, match="pass your function itself"):
        checker(3)  # e.g. the result of calling the function instead of the function
