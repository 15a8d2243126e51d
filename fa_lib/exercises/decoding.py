"""Chapter 13: the exact merge of split-KV, ``(o_parts, lse_parts) -> (o, lse)``. NumPy only."""
import numpy as np

from .. import reference
from ._common import _as_array, _callable, _fail, _returns


def _split_case(rng, rows, d, lengths, *, offset=0.0, masked_rows=(), scale=1.0):
    """Rows of scores over keys cut into len(lengths) splits.

    Returns ``(o_parts, lse_parts, o, lse)``: each split's output normalised by its own softmax and its
    natural-log LSE (a split whose keys are all masked: o_s = 0, LSE_s = -inf), and the attention of the
    rows over all keys at once, from ``reference.softmax_state`` on the concatenated scores.
    """
    n = sum(lengths)
    s = rng.standard_normal((rows, n)) * scale + offset  # (rows, N_k) scores
    v = rng.standard_normal((n, d))  # (N_k, d)
    s[list(masked_rows)] = -np.inf  # rows that see no key in any split
    o_parts, lse_parts = [], []
    lo = 0
    for length in lengths:
        m_s, l_s, acc_s = reference.softmax_state(s[:, lo:lo + length], v[lo:lo + length])
        with np.errstate(divide="ignore", invalid="ignore"):
            o_parts.append(np.where(l_s[:, None] > 0, acc_s / np.where(l_s > 0, l_s, 1.0)[:, None], 0.0))
            lse_parts.append(m_s + np.log(l_s))  # -inf where the chunk saw no key
        lo += length
    m, l, acc = reference.softmax_state(s, v)  # the whole row at once
    with np.errstate(divide="ignore"):
        lse = m + np.log(l)
    o = np.where(l[:, None] > 0, acc / np.where(l > 0, l, 1.0)[:, None], 0.0)
    return np.stack(o_parts), np.stack(lse_parts), o, lse


def _merge_cases():
    rng = np.random.default_rng(13)
    cases = [("two splits of 3 and 11 keys (their weights differ)", _split_case(rng, 4, 3, (3, 11)))]
    # Five splits, the last two of which saw no key, as split_bounds leaves at the end of a short row:
    # the expected answer is that of the first three splits' keys alone.
    o_p, l_p, o, lse = _split_case(rng, 5, 2, (4, 7, 2))
    o_p = np.concatenate([o_p, np.zeros((2, 5, 2))])  # (S, rows, d) = (5, 5, 2)
    l_p = np.concatenate([l_p, np.full((2, 5), -np.inf)])
    cases.append(("five splits, the last two empty (LSE_s = -inf, o_s = 0)", (o_p, l_p, o, lse)))
    cases.append(("scores near 1000 (exp(LSE_s) overflows float64)",
                  _split_case(rng, 3, 4, (6, 5, 9), offset=1000.0)))
    cases.append(("rows 1 and 3 see no key in any split (expected o = 0, LSE = -inf, never NaN)",
                  _split_case(rng, 4, 3, (5, 8), masked_rows=(1, 3))))
    cases.append(("one split (the merge must return it unchanged)", _split_case(rng, 2, 5, (9,))))
    return cases


_HINT_AVERAGE = ("you averaged the o_parts with equal weights; split s carries the share "
                 "exp(lse_s - lse) of the row's softmax mass, so o = sum_s exp(lse_s - lse) o_s")
_HINT_WEIGHTS = "o must be sum_s exp(lse_s - lse) o_s, each split weighted by its share of the softmax mass"
_HINT_OVERFLOW = ("exp(lse_s) overflows at large LSE (exp(1000) is inf in float64): subtract the largest "
                  "lse_s before exponentiating, lse = m + log(sum_s exp(lse_s - m))")
_HINT_GUARD = ("a row where every split is empty has max lse_s = -inf, and -inf - (-inf) is NaN: "
               "guard it (use 0 in place of a -inf maximum), so that the row gets o = 0 and lse = -inf")
_HINT_LOGSUM = ("you returned log(sum_s lse_s), the log of the sum of the LSEs; the merged LSE is the "
                "logsumexp over splits, log(sum_s exp(lse_s))")
_HINT_LSE = "lse must be the logsumexp over splits, log(sum_s exp(lse_s)), computed with the largest lse_s taken out"


def _close(got, want):
    return np.isclose(got, want, rtol=1e-9, atol=1e-12) | ((got == want) & np.isinf(want))


def _first_bad(case, name, got, want, hint):
    where = tuple(int(i) for i in np.argwhere(~_close(got, want))[0])
    _fail(case, f"{name}{list(where)} = {got[where]!r}, expected {want[where]!r} ({hint})")


def _judge(case, o_parts, lse_parts, got_o, got_lse, want_o, want_lse):
    all_empty = np.isneginf(lse_parts).all(axis=0)  # (rows,)
    big = np.isfinite(lse_parts).any() and np.nanmax(np.where(np.isfinite(lse_parts), lse_parts, -np.inf)) > 700
    for name, got, want in (("lse", got_lse, want_lse), ("o", got_o, want_o)):
        bad_nan = np.isnan(got) & ~np.isnan(want)
        bad_inf = np.isinf(got) & ~np.isinf(want)
        rows_bad = (bad_nan | bad_inf) if got.ndim == 1 else (bad_nan | bad_inf).any(axis=-1)
        if rows_bad.any():
            if (rows_bad & all_empty).any() and np.isnan(got).any():
                _first_bad(case, name, got, want, _HINT_GUARD)
            if big:
                _first_bad(case, name, got, want, _HINT_OVERFLOW)
    if not _close(got_lse, want_lse).all():
        with np.errstate(all="ignore"):
            log_sum = np.log(np.sum(lse_parts, axis=0))
        if np.allclose(got_lse, log_sum, equal_nan=True):
            _first_bad(case, "lse", got_lse, want_lse, _HINT_LOGSUM)
        _first_bad(case, "lse", got_lse, want_lse, _HINT_LSE)
    if not _close(got_o, want_o).all():
        if np.allclose(got_o, o_parts.mean(axis=0)):
            _first_bad(case, "o", got_o, want_o, _HINT_AVERAGE)
        _first_bad(case, "o", got_o, want_o, _HINT_WEIGHTS)


def check_split_merge(fn):
    """Chapter 13. ``fn(o_parts, lse_parts) -> (o, lse)`` merges S splits of the keys exactly.

    ``o_parts``: (S, rows, d), split s's attention output normalised by its own softmax;
    ``lse_parts``: (S, rows), its natural-log log-sum-exp of the scores (``-inf`` for a split that saw
    no key, whose ``o_s`` is 0). The result is the attention over all the splits' keys at once:
    ``lse = log(sum_s exp(lse_s))`` and ``o = sum_s exp(lse_s - lse) o_s``, computed without overflow;
    a row whose every split is empty gets ``o = 0`` and ``lse = -inf``, never NaN. The expected values
    come from ``fa_lib.reference.softmax_state`` over the concatenated keys, not from a merge.
    """
    _callable(fn)
    cases = _merge_cases()
    for case, (o_parts, lse_parts, want_o, want_lse) in cases:
        with np.errstate(all="ignore"):
            out = _returns(case, fn(o_parts.copy(), lse_parts.copy()), 2, ("o", "lse"))
        got_o, got_lse = _as_array(case, "o", out[0]), _as_array(case, "lse", out[1])
        for name, got, want in (("o", got_o, want_o), ("lse", got_lse, want_lse)):
            if got.shape != want.shape:
                _fail(case, f"{name} has shape {got.shape}, expected {want.shape}")
        _judge(case, o_parts, lse_parts, got_o, got_lse, want_o, want_lse)
    return f"all {len(cases)} hidden cases pass"
