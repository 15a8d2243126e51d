"""Checkers for the book's implement-it-yourself exercises.

Each checker runs a function you wrote on hidden cases (awkward sizes, causal masks, rows that see no
key, scores large enough to overflow ``exp``), compares it with ``fa_lib.reference``, and either
returns a one-line summary or raises :class:`ExerciseFailure` with a message that says which case
failed and how: the shape, the first wrong value, a NaN, a forgotten rescale.

    from fa_lib import exercises
    exercises.check_online_update(my_update)          # chapter 2
    exercises.check_tiled_forward(my_forward)         # chapter 3
    exercises.check_blockwise_backward(my_backward)   # chapter 7
    exercises.check_d_preprocess(my_preprocess)       # chapter 10

All arrays are NumPy float64 unless a checker says otherwise, so that a wrong formula cannot hide
behind rounding.
"""
import numpy as np

from . import reference

__all__ = ["ExerciseFailure", "check_blockwise_backward", "check_d_preprocess", "check_online_update",
           "check_tiled_forward"]

RTOL, ATOL = 1e-9, 1e-12


class ExerciseFailure(AssertionError):
    """Your function gave a wrong answer on one of the hidden cases; the message says which and how."""


def _callable(fn):
    if not callable(fn):
        raise TypeError(f"pass your function itself (e.g. check_tiled_forward(my_tiled_forward)), "
                        f"got {type(fn).__name__}")


def _fail(case, message):
    raise ExerciseFailure(f"case '{case}': {message}")


def _as_array(case, name, x):
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        _fail(case, f"{name} should be a NumPy array of numbers, got {type(x).__name__}")


def _compare(case, name, got, want, hint=""):
    got = _as_array(case, name, got)
    if got.shape != want.shape:
        _fail(case, f"{name} has shape {got.shape}, expected {want.shape}")
    bad_nan = np.isnan(got) & ~np.isnan(want)
    if bad_nan.any():
        where = tuple(int(i) for i in np.argwhere(bad_nan)[0])
        _fail(case, f"{name}{list(where)} is NaN, expected {want[where]!r}" + (f" ({hint})" if hint else ""))
    same_inf = (got == want) & np.isinf(want)
    close = np.isclose(got, want, rtol=RTOL, atol=ATOL) | same_inf
    if not close.all():
        where = tuple(int(i) for i in np.argwhere(~close)[0])
        _fail(case, f"{name}{list(where)} = {got[where]!r}, expected {want[where]!r}"
                    + (f" ({hint})" if hint else ""))


def _returns(case, out, n, names):
    if not isinstance(out, (tuple, list)) or len(out) != n:
        _fail(case, f"your function should return {n} arrays ({', '.join(names)}), got {type(out).__name__}"
                    + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    return out


# ---------------------------------------------------------------------------------------------------
# Chapter 2: one step of the online softmax.
# ---------------------------------------------------------------------------------------------------
def _update_cases():
    rng = np.random.default_rng(2026)
    s0 = rng.standard_normal((3, 5))
    v0 = rng.standard_normal((5, 4))
    m_a, l_a, acc_a = reference.softmax_state(s0, v0)
    s1 = rng.standard_normal((3, 6)) * 3
    v1 = rng.standard_normal((6, 4))
    empty = (np.full(3, -np.inf), np.zeros(3), np.zeros((3, 4)))
    return [
        ("the first block (the state is still empty: m = -inf, l = 0)", empty, s0, v0),
        ("a second block whose scores are larger (the old state must be rescaled)", (m_a, l_a, acc_a), s1 + 5, v1),
        ("a second block whose scores are smaller (the maximum stays)", (m_a, l_a, acc_a), s1 - 5, v1),
        ("scores near 1000 (exp would overflow without the running maximum)", (m_a + 1000, l_a, acc_a),
         s1 + 1000, v1),
        ("a block that is fully masked (all scores -inf: the state must not change, and no NaN)",
         (m_a, l_a, acc_a), np.full((3, 6), -np.inf), v1),
        ("a fully masked block before any visible key (m stays -inf; -inf - (-inf) is NaN, so guard it)",
         empty, np.full((3, 6), -np.inf), v1),
    ]


def check_online_update(fn):
    """Chapter 2. ``fn(m, l, acc, s, v) -> (m, l, acc)`` folds one block into a running softmax state.

    ``m``, ``l``: (rows,) running maximum and running sum of ``exp(s - m)``; ``acc``: (rows, dv) running
    sum of ``exp(s - m) v``. ``s``: (rows, n) the new block's scores, ``v``: (n, dv) its values. The
    result must be the state of everything seen so far, as ``fa_lib.merge_states`` computes it.
    """
    _callable(fn)
    for case, (m, l, acc), s, v in _update_cases():
        want = reference.merge_states((m, l, acc), reference.softmax_state(s, v))
        with np.errstate(all="ignore"):
            out = _returns(case, fn(m.copy(), l.copy(), acc.copy(), s.copy(), v.copy()), 3, ("m", "l", "acc"))
        hint = "did you multiply the old l and acc by exp(m_old - m_new)?"
        _compare(case, "m", out[0], want[0], "m is the larger of the old maximum and the block's maximum")
        _compare(case, "l", out[1], want[1], hint)
        _compare(case, "acc", out[2], want[2], hint)
    return f"all {len(_update_cases())} hidden cases pass"


# ---------------------------------------------------------------------------------------------------
# Chapter 3: the tiled forward pass.
# ---------------------------------------------------------------------------------------------------
def _forward_cases():
    rng = np.random.default_rng(3)

    def qkv(nq, nk, d, scale=1.0):
        return (rng.standard_normal((nq, d)) * scale, rng.standard_normal((nk, d)) * scale,
                rng.standard_normal((nk, d)))

    return [
        ("8 queries, 8 keys, blocks of 4 (the blocks divide the lengths)", qkv(8, 8, 4), 4, 4, False),
        ("7 queries, 10 keys, blocks of 3 and 4 (the last blocks are partial)", qkv(7, 10, 5), 3, 4, False),
        ("blocks larger than the sequence", qkv(5, 6, 3), 16, 16, False),
        ("causal, 6 queries and 9 keys (bottom-right: query i sees keys j <= i + 3)", qkv(6, 9, 4), 2, 4, True),
        ("causal, 9 queries and 4 keys (queries 0 to 4 see no key: o = 0, lse = -inf)", qkv(9, 4, 3), 4, 3, True),
        ("scores near a thousand (exp would overflow without the running maximum)", qkv(6, 7, 4, scale=30.0),
         3, 2, False),
    ]


def check_tiled_forward(fn):
    """Chapter 3. ``fn(q, k, v, block_q, block_k, causal) -> (o, lse)``: tiled attention with an online softmax.

    ``q`` (nq, d), ``k`` and ``v`` (nk, d); scale ``1/sqrt(d)``; ``causal`` aligned bottom-right. Return
    ``o`` (nq, d) and the natural-log ``lse`` (nq,). A row that sees no key has ``o = 0`` and
    ``lse = -inf``. Never form the whole (nq, nk) score matrix.
    """
    _callable(fn)
    for case, (q, k, v), bq, bk, causal in _forward_cases():
        want_o, want_lse = reference.naive_attention(q, k, v, causal=causal)
        with np.errstate(all="ignore"):
            out = _returns(case, fn(q.copy(), k.copy(), v.copy(), bq, bk, causal), 2, ("o", "lse"))
        hint = ("a row that sees no key keeps l = 0: divide by l only where l > 0" if "no key" in case
                else "rescale acc and l by exp(m_old - m_new) whenever the maximum grows, and divide by l once "
                     "at the end")
        _compare(case, "o", out[0], want_o, hint)
        _compare(case, "lse", out[1], want_lse, "lse = m + log(l) in natural log, -inf for a row with no key")
    return f"all {len(_forward_cases())} hidden cases pass"


# ---------------------------------------------------------------------------------------------------
# Chapter 7: the blockwise backward pass with recomputation.
# ---------------------------------------------------------------------------------------------------
def check_blockwise_backward(fn):
    """Chapter 7. ``fn(q, k, v, o, lse, do, block_q, block_k, causal) -> (dq, dk, dv)``.

    Recompute ``P = exp(S - lse)`` tile by tile from the saved ``lse``, use ``D = rowsum(dO * O)``, and
    return the three gradients with the shapes of ``q``, ``k``, ``v``. Rows that see no key contribute
    nothing (and must not make NaN).
    """
    _callable(fn)
    cases = _forward_cases()
    rng = np.random.default_rng(7)
    for case, (q, k, v), bq, bk, causal in cases:
        o, lse = reference.naive_attention(q, k, v, causal=causal)
        do = rng.standard_normal(o.shape)
        want = reference.naive_attention_backward(q, k, v, do, causal=causal)
        with np.errstate(all="ignore"):
            out = _returns(case, fn(q.copy(), k.copy(), v.copy(), o.copy(), lse.copy(), do.copy(), bq, bk, causal),
                           3, ("dq", "dk", "dv"))
        hint = "dS = P * (dP - D) with D = rowsum(dO * O); P = exp(S - lse), 0 where lse = -inf or masked"
        for name, got, w in zip(("dq", "dk", "dv"), out, want):
            _compare(case, name, got, w, hint)
    return f"all {len(cases)} hidden cases pass"


# ---------------------------------------------------------------------------------------------------
# Chapter 10: the D preprocess (on torch tensors, e.g. a Triton kernel under the interpreter).
# ---------------------------------------------------------------------------------------------------
def check_d_preprocess(fn):
    """Chapter 10. ``fn(o, do) -> delta``: ``delta[b, h, i] = sum_d o[b, h, i, d] * do[b, h, i, d]``.

    ``o`` and ``do`` are torch tensors (B, H, N, D) (float16 or float32, any strides, on CPU); return a
    float32 tensor (B, H, N). Accumulate in float32 even for float16 inputs.
    """
    _callable(fn)
    import torch

    gen = torch.Generator().manual_seed(10)
    cases = [
        ("float32, 1 x 2 x 70 x 16", (1, 2, 70, 16), torch.float32, False),
        ("float16 inputs, 2 x 3 x 33 x 40 (accumulate in float32)", (2, 3, 33, 40), torch.float16, False),
        ("a (B, N, H, D) storage viewed as (B, H, N, D) (strides, not contiguity)", (2, 4, 17, 32), torch.float32,
         True),
    ]
    for case, shape, dtype, transposed in cases:
        b, h, n, d = shape
        if transposed:
            o, do = (torch.randn(b, n, h, d, generator=gen).to(dtype).transpose(1, 2) for _ in range(2))
        else:
            o, do = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(2))
        want = (o.double() * do.double()).sum(-1)
        got = fn(o, do)
        if not isinstance(got, torch.Tensor):
            _fail(case, f"return a torch.Tensor, got {type(got).__name__}")
        if tuple(got.shape) != (b, h, n):
            _fail(case, f"delta has shape {tuple(got.shape)}, expected {(b, h, n)}: one number per query row")
        if got.dtype != torch.float32:
            _fail(case, f"delta has dtype {got.dtype}, expected torch.float32")
        err = (got.double() - want).abs().max().item()
        tol = 1e-5 * max(1.0, want.abs().max().item())
        if not err <= tol:  # also catches NaN
            i = tuple(int(x) for x in ((got.double() - want).abs() == err).nonzero()[0]) if err == err else (0, 0, 0)
            _fail(case, f"delta{list(i)} = {got[i].item():.6g}, expected {want[i].item():.6g} "
                        f"(sum the products over the head dimension, in float32)")
    return f"all {len(cases)} hidden cases pass"
