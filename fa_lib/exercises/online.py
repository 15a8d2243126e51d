"""Chapters 2 and 3: one step of the online softmax, and the tiled forward pass."""
import numpy as np

from .. import reference
from ._common import _callable, _compare, _returns


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
