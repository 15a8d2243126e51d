"""Chapters 2 and 3: one step of the online softmax, and the tiled forward pass."""
import numpy as np

from .. import reference
from ._common import ATOL, RTOL, _as_array, _callable, _compare, _fail, _num, _returns


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


def _close(got, x):
    return x is not None and got.shape == np.shape(x) and bool(np.allclose(got, x, rtol=RTOL, atol=ATOL))


def _update_mistakes(m, l, acc, s, v):
    """The common wrong updates of one case: (what went wrong, (l, acc) it gives)."""
    m_new = np.maximum(m, s.max(axis=-1))
    safe = np.where(np.isneginf(m_new), 0.0, m_new)  # the -inf guard
    p = np.exp(s - safe[:, None])
    alpha = np.exp(m - safe)
    l_p, acc_p = p.sum(-1), p @ v
    own = np.exp(s - np.where(np.isneginf(s.max(-1)), 0.0, s.max(-1))[:, None])  # the block's own maximum
    l_right, acc_right = alpha * l + l_p, alpha[:, None] * acc + acc_p
    return [
        ("you did not rescale the old state: did you multiply the old l and acc by exp(m_old - m_new)?",
         (l + l_p, acc + acc_p)),
        ("you rescaled l but not acc: multiply the old acc by alpha = exp(m_old - m_new) too",
         (l_right, acc + acc_p)),
        ("you rescaled acc but not l: multiply the old l by alpha = exp(m_old - m_new) too",
         (l + l_p, acc_right)),
        ("alpha is exp(m_old - m_new), at most 1; you used exp(m_new - m_old)",
         (l / np.where(alpha > 0, alpha, np.nan) + l_p, acc / np.where(alpha > 0, alpha, np.nan)[:, None] + acc_p)),
        ("the new block's exponentials use the block's own maximum; shift them by the new running "
         "maximum instead: p = exp(s - m_new)", (alpha * l + own.sum(-1), alpha[:, None] * acc + own @ v)),
        ("acc is the un-normalised sum of exp(s - m) v: do not divide it by l in the update (o = acc / l "
         "comes once, at the end)", (l_right, acc_right / np.where(l_right > 0, l_right, np.nan)[:, None])),
    ]


def check_online_update(fn):
    """Chapter 2. ``fn(m, l, acc, s, v) -> (m, l, acc)`` folds one block into a running softmax state.

    ``m``, ``l``: (rows,) running maximum and running sum of ``exp(s - m)``; ``acc``: (rows, dv) running
    sum of ``exp(s - m) v``. ``s``: (rows, n) the new block's scores, ``v``: (n, dv) its values. The
    result must be the state of everything seen so far, as ``fa_lib.merge_states`` computes it. A row
    that has seen no key yet has ``m = -inf``, ``l = 0`` and ``acc = 0``, and must not turn NaN.
    """
    _callable(fn)
    cases = _update_cases()
    for case, (m, l, acc), s, v in cases:
        want = reference.merge_states((m, l, acc), reference.softmax_state(s, v))
        with np.errstate(all="ignore"):
            out = _returns(case, fn(m.copy(), l.copy(), acc.copy(), s.copy(), v.copy()), 3, ("m", "l", "acc"))
        got = [_as_array(case, name, x) for name, x in zip(("m", "l", "acc"), out)]
        _compare(case, "m", got[0], want[0], "m is the larger of the old maximum and the block's maximum")
        if _close(got[1], want[1]) and _close(got[2], want[2]):
            continue
        for name, g, w in (("l", got[1], want[1]), ("acc", got[2], want[2])):
            if g.shape == w.shape and not np.isfinite(g).all():
                where = [int(i) for i in np.argwhere(~np.isfinite(g))[0]]
                if np.isneginf(want[0][where[0]]):
                    _fail(case, f"{name}{where} is {_num(g[tuple(where)])}, expected {_num(w[tuple(where)])}: "
                                f"the -inf guard is missing: this row has seen no key, so m_old = m_new = -inf and "
                                f"exp(-inf - (-inf)) is NaN; use 0 in place of m_new where m_new = -inf")
                if np.abs(s[np.isfinite(s)]).max(initial=0) > 700:
                    _fail(case, f"{name}{where} is {_num(g[tuple(where)])}, expected {_num(w[tuple(where)])}: "
                                f"exp overflowed: subtract the new running maximum first, p = exp(s - m_new)")
        with np.errstate(all="ignore"):
            mistakes = _update_mistakes(m, l, acc, s, v)
        for what, (l_x, acc_x) in mistakes:
            if _close(got[1], l_x) and _close(got[2], acc_x):
                _fail(case, what)
        hint = ("l = alpha * l_old + rowsum(p) and acc = alpha * acc_old + p @ v, with p = exp(s - m_new) and "
                "alpha = exp(m_old - m_new)")
        _compare(case, "l", got[1], want[1], hint)
        _compare(case, "acc", got[2], want[2], hint)
    return f"all {len(cases)} hidden cases pass"


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


def _tiled(q, k, v, block_q, block_k, visible, rescale_l=True, rescale_acc=True):
    """A tiled forward that can forget to rescale l or acc: (o, lse), as a learner's loop gives them."""
    nq, nk = q.shape[0], k.shape[0]
    s_all = np.where(visible, q @ k.T / np.sqrt(q.shape[1]), -np.inf)
    o, lse = np.zeros((nq, v.shape[1])), np.full(nq, -np.inf)
    for r0 in range(0, nq, block_q):
        r = slice(r0, min(r0 + block_q, nq))
        m, l, acc = np.full(r.stop - r0, -np.inf), np.zeros(r.stop - r0), np.zeros((r.stop - r0, v.shape[1]))
        for c0 in range(0, nk, block_k):
            c = slice(c0, min(c0 + block_k, nk))
            m_new = np.maximum(m, s_all[r, c].max(axis=-1))
            safe = np.where(np.isneginf(m_new), 0.0, m_new)
            p, alpha = np.exp(s_all[r, c] - safe[:, None]), np.exp(m - safe)
            l = (alpha * l if rescale_l else l) + p.sum(-1)
            acc = (alpha[:, None] * acc if rescale_acc else acc) + p @ v[c]
            m = m_new
        o[r] = acc / np.where(l > 0, l, 1.0)[:, None]
        lse[r] = np.where(l > 0, m + np.log(np.where(l > 0, l, 1.0)), -np.inf)
    return o, lse


def _forward_mistakes(q, k, v, block_q, block_k, causal):
    """The common wrong answers of one case: (what went wrong, o or None, lse or None)."""
    nq, nk, d = q.shape[0], k.shape[0], q.shape[1]
    visible = reference.causal_mask(nq, nk) if causal else np.ones((nq, nk), dtype=bool)
    out = []
    if causal:
        out.append(("the causal mask is missing", *reference.naive_attention(q, k, v)))
        top_left = np.tril(np.ones((nq, nk), dtype=bool))
        out.append((f"the causal mask is aligned top-left; fa_lib aligns it bottom-right: query i sees key j "
                    f"iff j <= i + N_K - N_Q (here j <= i {'+' if nk >= nq else '-'} {abs(nk - nq)})",
                    *reference.naive_attention(q, k, v, mask=top_left)))
    for scale, what in ((1.0, "the scores are not scaled"), (1.0 / d, "you used 1/d"),
                        (np.sqrt(d), "you multiplied by sqrt(d)")):
        out.append((f"wrong softmax scale: {what}; S = q @ k.T / sqrt(d)",
                    *reference.naive_attention(q, k, v, causal=causal, softmax_scale=scale)))
    want_o, want_lse = reference.naive_attention(q, k, v, causal=causal)
    s = np.where(visible, q @ k.T / np.sqrt(d), -np.inf)
    row_max = s.max(axis=-1)
    seen = np.isfinite(row_max)
    l_final = np.where(seen, np.exp(want_lse - np.where(seen, row_max, 0.0)), 0.0)  # l in units of the row max
    out += [
        ("o is acc before the division: divide acc by l once, at the end (o = acc / l)",
         want_o * l_final[:, None], None),
        ("you did not rescale acc and l: multiply both by alpha = exp(m_old - m_new) whenever the maximum grows",
         *_tiled(q, k, v, block_q, block_k, visible, rescale_l=False, rescale_acc=False)),
        ("you rescaled l but not acc: multiply acc by alpha = exp(m_old - m_new) too",
         _tiled(q, k, v, block_q, block_k, visible, rescale_acc=False)[0], None),
        ("you rescaled acc but not l: multiply l by alpha = exp(m_old - m_new) too",
         *_tiled(q, k, v, block_q, block_k, visible, rescale_l=False)),
        ("this lse is in log2: the lse is in natural log, m + log(l)", None, want_lse / np.log(2)),
        ("lse = m + log(l): you left out m", None, np.where(seen, want_lse - np.where(seen, row_max, 0.0), -np.inf)),
        ("lse = m + log(l): you left out log(l)", None, row_max),
    ]
    return out


def check_tiled_forward(fn):
    """Chapter 3. ``fn(q, k, v, block_q, block_k, causal) -> (o, lse)``: tiled attention with an online softmax.

    ``q`` (nq, d), ``k`` and ``v`` (nk, d); scale ``1/sqrt(d)``; ``causal`` aligned bottom-right (query i
    sees key j iff ``j <= i + nk - nq``). Return ``o`` (nq, d) and the natural-log ``lse`` (nq,). A row
    that sees no key has ``o = 0`` and ``lse = -inf``. Never form the whole (nq, nk) score matrix.
    """
    _callable(fn)
    cases = _forward_cases()
    for case, (q, k, v), bq, bk, causal in cases:
        want_o, want_lse = reference.naive_attention(q, k, v, causal=causal)
        with np.errstate(all="ignore"):
            out = _returns(case, fn(q.copy(), k.copy(), v.copy(), bq, bk, causal), 2, ("o", "lse"))
        got_o, got_lse = _as_array(case, "o", out[0]), _as_array(case, "lse", out[1])
        same_lse = got_lse.shape == want_lse.shape and bool(
            np.all(np.isclose(got_lse, want_lse, rtol=RTOL, atol=ATOL) | (got_lse == want_lse)))
        if _close(got_o, want_o) and same_lse:
            continue
        empty = np.isneginf(want_lse)  # rows that see no key
        if got_o.shape == want_o.shape and got_lse.shape == want_lse.shape:
            bad = ~np.isfinite(got_o).all(axis=-1) | np.isnan(got_lse) | (np.isinf(got_lse) & ~empty)
            if bad.any() and (empty | ~bad).all():  # only rows that see no key went wrong
                row = int(np.flatnonzero(bad)[0])
                if np.isnan(got_lse[bad]).any():
                    _fail(case, f"row {row} sees no key and its lse is NaN: the -inf guard is missing: m stays "
                                f"-inf, and exp(-inf - (-inf)) is NaN; use 0 in place of m_new where m_new = -inf")
                _fail(case, f"o[{row}] is NaN, expected 0.0 (a row that sees no key keeps l = 0: divide by l only "
                            f"where l > 0)")
            if bad.any() and np.abs(q @ k.T / np.sqrt(q.shape[1])).max() > 700:
                row = int(np.flatnonzero(bad)[0])
                _fail(case, f"row {row} is NaN or inf: exp overflowed (scores near a thousand); subtract the "
                            f"running maximum first, p = exp(s - m_new)")
        with np.errstate(all="ignore"):
            mistakes = _forward_mistakes(q, k, v, bq, bk, causal)
        if not _close(got_o, want_o):
            for what, o_x, _ in mistakes:
                if _close(got_o, o_x):
                    _fail(case, f"o is wrong: {what}")
            _compare(case, "o", got_o, want_o,
                     "look for -inf - (-inf), inf - inf or 0 / 0" if not np.isfinite(got_o).all() else
                     "no common mistake matches: check the mask, that acc and l are rescaled by "
                     "exp(m_old - m_new) whenever the maximum grows, and that o = acc / l once, at the end")
        for what, _, lse_x in mistakes:
            if lse_x is not None and got_lse.shape == lse_x.shape and np.all(
                    np.isclose(got_lse, lse_x, rtol=RTOL, atol=ATOL) | (got_lse == lse_x)):
                _fail(case, f"o is right, lse is wrong: {what}")
        _compare(case, "lse", got_lse, want_lse, "lse = m + log(l) in natural log, -inf for a row with no key")
    return f"all {len(cases)} hidden cases pass"
