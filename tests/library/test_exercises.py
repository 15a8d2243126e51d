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
                                     exercises.check_matmul_backward, exercises.check_softmax_backward,
                                     exercises.check_backward_tile, exercises.check_blockwise_backward,
                                     exercises.check_d_preprocess, exercises.check_triton_forward_loop])
def test_checkers_say_what_to_pass(checker):
    with pytest.raises(TypeError, match="pass your function itself"):
        checker(3)  # e.g. the result of calling the function instead of the function


# --- chapter 9: a Triton forward kernel's key-block loop ------------------------------------------
# The kernels are defined at import, in the mode fa_lib chose: under the interpreter on a machine
# without a GPU (the checker launches them on CPU tensors), compiled on a GPU machine (skipped there).
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import fa_lib  # noqa: E402,F401  (sets TRITON_INTERPRET=1 before any kernel below is defined)

# One kernel body with a switch for each mistake the checker must name.
OK, NO_ALPHA_ON_ACC, NO_NORMALISE, NO_TAIL_MASK, UNMASKED_LOAD, UNMASKED_STORE, NO_SCALE = range(7)


@triton.jit
def _forward_body(Q, K, V, O, LSE, N_Q, N_K, sm_scale, HEAD_DIM: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BUG: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=offs_m[:, None] < N_Q,
                other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, N_K, BLOCK_N):
        cols = start_n + offs_n
        if BUG == UNMASKED_LOAD:
            kT = tl.load(K + cols[None, :] * HEAD_DIM + offs_d[:, None])
            v = tl.load(V + cols[:, None] * HEAD_DIM + offs_d[None, :])
        else:
            kT = tl.load(K + cols[None, :] * HEAD_DIM + offs_d[:, None], mask=cols[None, :] < N_K,
                         other=0.0)
            v = tl.load(V + cols[:, None] * HEAD_DIM + offs_d[None, :], mask=cols[:, None] < N_K,
                        other=0.0)
        if BUG == NO_SCALE:
            s = tl.dot(q, kT)
        else:
            s = tl.dot(q, kT) * sm_scale
        if BUG != NO_TAIL_MASK:
            s = tl.where(cols[None, :] < N_K, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if BUG != NO_ALPHA_ON_ACC:
            acc = acc * alpha[:, None]
        acc = tl.dot(p, v, acc)
        m_i = m_new
    if BUG != NO_NORMALISE:
        acc = acc / l_i[:, None]
    lse = m_i + tl.log(l_i)
    if BUG == UNMASKED_STORE:
        tl.store(O + offs_m[:, None] * HEAD_DIM + offs_d[None, :], acc)
    else:
        tl.store(O + offs_m[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=offs_m[:, None] < N_Q)
    tl.store(LSE + offs_m, lse, mask=offs_m < N_Q)


@triton.jit
def correct_kernel(Q, K, V, O, LSE, N_Q, N_K, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    _forward_body(Q, K, V, O, LSE, N_Q, N_K, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, OK)


@triton.jit
def no_alpha_on_acc_kernel(Q, K, V, O, LSE, N_Q, N_K, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    _forward_body(Q, K, V, O, LSE, N_Q, N_K, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NO_ALPHA_ON_ACC)


@triton.jit
def no_normalise_kernel(Q, K, V, O, LSE, N_Q, N_K, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    _forward_body(Q, K, V, O, LSE, N_Q, N_K, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NO_NORMALISE)


@triton.jit
def no_tail_mask_kernel(Q, K, V, O, LSE, N_Q, N_K, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    _forward_body(Q, K, V, O, LSE, N_Q, N_K, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NO_TAIL_MASK)


@triton.jit
def unmasked_load_kernel(Q, K, V, O, LSE, N_Q, N_K, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    _forward_body(Q, K, V, O, LSE, N_Q, N_K, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, UNMASKED_LOAD)


@triton.jit
def unmasked_store_kernel(Q, K, V, O, LSE, N_Q, N_K, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    _forward_body(Q, K, V, O, LSE, N_Q, N_K, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, UNMASKED_STORE)


@triton.jit
def no_scale_kernel(Q, K, V, O, LSE, N_Q, N_K, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    _forward_body(Q, K, V, O, LSE, N_Q, N_K, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NO_SCALE)


needs_interpreter = pytest.mark.skipif(not fa_lib.INTERPRET, reason="the checker launches the kernel on "
                                       "CPU tensors, under Triton's interpreter")


@needs_interpreter
def test_triton_forward_loop_accepts_a_correct_kernel():
    assert exercises.check_triton_forward_loop(correct_kernel) == "all 6 hidden cases pass"


@needs_interpreter
@pytest.mark.parametrize("kernel, match", [
    (no_alpha_on_acc_kernel, "lse is right.*multiply acc by alpha"),
    (no_normalise_kernel, "acc before the division"),
    (no_tail_mask_kernel, "partial.*zero-filled keys past N_K"),
    (unmasked_load_kernel, "partial.*read without a mask"),
    (unmasked_store_kernel, "wrote past row N_Q"),
    (no_scale_kernel, "the scores miss the softmax scale"),
])
def test_triton_forward_loop_rejects_broken_kernels(kernel, match):
    with pytest.raises(exercises.ExerciseFailure, match=match):
        exercises.check_triton_forward_loop(kernel)


def test_triton_forward_loop_wants_a_triton_kernel():
    def plain(Q, K, V, O, LSE, N_Q, N_K, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N):
        pass

    with pytest.raises(TypeError, match="decorated with @triton.jit"):
        exercises.check_triton_forward_loop(plain)


def test_reference_and_numpy_exercises_run_with_numpy_alone():
    # A reader without torch or Triton (pip install numpy sympy): fa_lib, its reference and the NumPy checkers work.
    import inspect
    import subprocess
    import sys
    import textwrap

    solutions = "\n".join(textwrap.dedent(inspect.getsource(f)) for f in (good_update, good_forward, good_backward))
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # import torch / import triton now raise ImportError
        sys.modules["triton"] = None
        import numpy as np
        import fa_lib
        from fa_lib import exercises, reference
        assert not fa_lib.INTERPRET
        q = np.random.default_rng(0).standard_normal((2, 9, 8))
        o, lse = reference.flash_forward(q, q, q, causal=True, block_q=4, block_k=4)
        o2, lse2 = reference.naive_attention(q, q, q, causal=True)
        assert np.allclose(o, o2) and np.allclose(lse, lse2)
    """) + solutions + textwrap.dedent("""
        for check, fn in ((exercises.check_online_update, good_update), (exercises.check_tiled_forward, good_forward),
                          (exercises.check_blockwise_backward, good_backward)):
            assert check(fn) == "all 6 hidden cases pass"
        assert "torch" not in [m for m, v in sys.modules.items() if v is not None]
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
