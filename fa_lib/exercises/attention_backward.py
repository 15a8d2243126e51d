"""Chapter 6: the standard attention backward pass with the full N x N matrices (NumPy only)."""
import itertools

import numpy as np

from .. import reference
from ._common import ATOL, RTOL, _as_array, _callable, _compare, _fail, _returns


def _backward_cases():
    """(what, q, k, v, do, scale): q and do (nq, d), k and v (nk, d), float64, no mask."""
    rng = np.random.default_rng(66)

    def qkvdo(nq, nk, d, size=1.0):
        return (rng.standard_normal((nq, d)) * size, rng.standard_normal((nk, d)) * size,
                rng.standard_normal((nk, d)), rng.standard_normal((nq, d)))

    return [
        ("5 queries, 5 keys, d = 5, scale 0.7 (square: a missing transpose still has a shape)",
         *qkvdo(5, 5, 5), 0.7),
        ("6 queries, 9 keys, d = 4, scale 1/sqrt(d)", *qkvdo(6, 9, 4), 0.5),
        ("8 queries, 3 keys, d = 6, scale 0.25 (not 1/sqrt(d))", *qkvdo(8, 3, 6), 0.25),
        ("a single query against 7 keys, d = 3, scale 1.3", *qkvdo(1, 7, 3), 1.3),
        ("4 queries, 6 keys, d = 8, scores up to about 1000 (exp overflows unless the row maximum is "
         "subtracted first)", *qkvdo(4, 6, 8, size=12.0), 1.0),
    ]


def _softmax(s, axis=-1):
    e = np.exp(s - s.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _grads(q, k, v, do, scale, mistake=None):
    """(dq, dk, dv) with ``mistake`` (None: the right answer); an entry is None where the mistake's
    shapes do not fit."""
    s = (1.0 if mistake == "S unscaled" else scale) * (q @ k.T)  # (nq, nk)
    p = _softmax(s, axis=0 if mistake in ("P columns", "P columns, D columns") else -1)
    dv = p.T @ do  # (nk, d)
    dp = do @ v.T  # (nq, nk)
    d_axis = 0 if mistake in ("D columns", "P columns, D columns") else -1
    d = np.sum(dp * p, axis=d_axis, keepdims=True)
    ds = p * dp if mistake == "no D" else p * (dp - d)
    out_scale = 1.0 if mistake == "no scale" else scale
    dq, dk = out_scale * (ds @ k), out_scale * (ds.T @ q)
    square = p.shape[0] == p.shape[1]
    if mistake == "P not transposed":
        dv = p @ do if square else None
    elif mistake == "dS not transposed in dk":
        dk = out_scale * (ds @ q) if square else None
    elif mistake == "dS transposed in dq":
        dq = out_scale * (ds.T @ k) if square else None
    return dq, dk, dv


_MISTAKES = [  # (mistake, what the checker says)
    ("no scale", "the scale is missing in dq and dk: dq = scale * dS @ k, dk = scale * dS.T @ q "
                 "(S = scale * q @ k.T, so the chain rule brings the scale back)"),
    ("S unscaled", "the scores miss the scale: P = softmax(scale * q @ k.T)"),
    ("no D", "dS = P * dP: the row sum is not subtracted, dS = P * (dP - rowsum(dP * P))"),
    ("D columns", "the row sum is over the wrong axis: D = rowsum(dP * P) sums over the keys "
                  "(axis=-1, keepdims=True), one number per query row"),
    ("P columns", "the softmax is over the wrong axis: P = softmax(S) normalises each row (over "
                  "the keys, axis=-1), not each column"),
    ("P columns, D columns", "the softmax is over the wrong axis: P = softmax(S) normalises each "
                             "row (over the keys, axis=-1), not each column"),
    ("P not transposed", "dv is P @ do (P not transposed): dv = P.T @ do"),
    ("dS not transposed in dk", "dk is dS @ q (dS not transposed): dk = scale * dS.T @ q"),
    ("dS transposed in dq", "dq is dS.T @ k (dS transposed): dq = scale * dS @ k"),
]

_NAMES = ("dq", "dk", "dv")


def _same(got, x):
    return x is not None and got.shape == x.shape and bool(np.allclose(got, x, rtol=RTOL, atol=ATOL))


def check_attention_backward(fn):
    """Chapter 6. ``fn(q, k, v, do, scale) -> (dq, dk, dv)``: the standard attention backward pass.

    ``q`` and ``do = dL/dO`` (nq, d), ``k`` and ``v`` (nk, d), NumPy float64, and ``scale`` the
    softmax scale (not always 1/sqrt(d)); no mask. Form the full (nq, nk) matrices::

        P  = softmax(scale * q @ k.T)        # over the keys: each row sums to 1
        dv = P.T @ do                        # (nk, d)
        dP = do @ v.T                        # (nq, nk)
        dS = P * (dP - rowsum(dP * P))       # (nq, nk), one row sum per query
        dq = scale * dS @ k                  # (nq, d)
        dk = scale * dS.T @ q                # (nk, d)

    and return ``(dq, dk, dv)``, in the order of ``q, k, v``. The cases include a square one (where
    a missing transpose keeps its shape), a scale other than 1/sqrt(d), a single query, and scores
    up to about 1000, where ``exp`` overflows unless each row's maximum is subtracted first. The
    answer is compared with ``fa_lib.reference.naive_attention_backward``.
    """
    _callable(fn)
    cases = _backward_cases()
    for case, q, k, v, do, scale in cases:
        want = reference.naive_attention_backward(q, k, v, do, softmax_scale=scale)
        nq, nk, d = q.shape[0], k.shape[0], q.shape[1]
        try:
            with np.errstate(all="ignore"):
                out = _returns(case, fn(q.copy(), k.copy(), v.copy(), do.copy(), scale), 3, _NAMES)
        except ValueError as e:  # NumPy: shapes that do not fit
            _fail(case, f"your function raised ValueError: {str(e)[:200]} -- with q and do ({nq}, {d}), "
                        f"k and v ({nk}, {d}): P, dP and dS are ({nq}, {nk}); dv = P.T @ do ({nk}, {d}), "
                        f"dq = scale * dS @ k ({nq}, {d}), dk = scale * dS.T @ q ({nk}, {d})")
        got = [_as_array(case, name, x) for name, x in zip(_NAMES, out)]
        if all(_same(g, w) for g, w in zip(got, want)):
            continue
        for order in itertools.permutations(range(3)):
            if order != (0, 1, 2) and all(_same(got[i], want[j]) for i, j in enumerate(order)):
                returned = ", ".join(_NAMES[j] for j in order)
                _fail(case, f"you returned ({returned}): return (dq, dk, dv), in the order of the "
                            f"arguments q, k, v")
        for i, name in enumerate(_NAMES):
            g = got[i]
            if _same(g, want[i]):
                continue
            if g.shape == want[i].shape and not np.isfinite(g).all():
                _fail(case, f"{name} has NaN or inf: exp overflowed on scores up to "
                            f"{float(np.abs(scale * q @ k.T).max()):.0f}; subtract each row's maximum "
                            f"before exp (softmax(s) = softmax(s - max(s)))")
            if scale != 1 / np.sqrt(d) and _same(g, _grads(q, k, v, do, 1 / np.sqrt(d))[i]):
                _fail(case, f"{name} uses the scale 1/sqrt(d) instead of the scale argument "
                            f"({scale:.4g} here)")
            for mistake, what in _MISTAKES:
                with np.errstate(all="ignore"):
                    x = _grads(q, k, v, do, scale, mistake)[i]
                if _same(g, x):
                    _fail(case, f"{name}: {what}")
            _compare(case, name, g, want[i], "P = softmax(scale * q @ k.T), dS = P * (dP - rowsum(dP * P)), "
                                             "dq = scale * dS @ k, dk = scale * dS.T @ q, dv = P.T @ do")
    return f"all {len(cases)} hidden cases pass"
