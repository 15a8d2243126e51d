"""Chapter 5: the backward pass of a row-wise softmax, without the Jacobian (NumPy only)."""
import numpy as np

from ._common import ATOL, RTOL, _as_array, _callable, _compare, _fail


def _softmax(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _softmax_cases():
    """(what, p, dp): p a row-wise softmax (rows, n), dp = dL/dp (rows, n), float64."""
    rng = np.random.default_rng(5)

    def pdp(rows, n, s=None):
        s = rng.standard_normal((rows, n)) * 2 if s is None else s
        return _softmax(s), rng.standard_normal((rows, n))

    one_hot = rng.standard_normal((4, 6))
    one_hot[0] = [-np.inf, -np.inf, 0.0, -np.inf, -np.inf, -np.inf]  # p = (0, 0, 1, 0, 0, 0)
    one_hot[2] = [-np.inf] * 5 + [3.0]
    return [
        ("4 rows of 7 scores", *pdp(4, 7)),
        ("5 rows of 5 scores (square: a row sum broadcast along the wrong axis still has a shape)",
         *pdp(5, 5)),
        ("rows 0 and 2 are one-hot (p = 1 on one key, 0 elsewhere: their ds is 0)", *pdp(4, 6, one_hot)),
        ("a single key per row, n = 1 (p = 1, so ds = 0)", *pdp(3, 1)),
        ("2 rows of n = 4096 scores (still exact: no n x n Jacobian needed)", *pdp(2, 4096)),
    ]


def _mistakes(p, dp):
    """The common wrong answers on one case: (what went wrong, the array it gives)."""
    d = np.sum(p * dp, axis=-1, keepdims=True)
    out = [
        ("you used p * dp without subtracting rowsum(p * dp) (D)", p * dp),
        ("the row sum is over the wrong axis: D = rowsum(p * dp) sums over the last axis (one number "
         "per row), not down the columns", p * (dp - np.sum(p * dp, axis=0, keepdims=True))),
        ("you multiplied by dp instead of p: ds = p * (dp - D)", dp * (dp - d)),
        ("p and dp are swapped: ds = p * (dp - D), not dp * (p - D)", dp * (p - d)),
        ("D is rowsum(p * dp), not rowsum(dp)", p * (dp - dp.sum(axis=-1, keepdims=True))),
        ("D is rowsum(p * dp), not rowsum(p) (which is 1)", p * (dp - 1.0)),
        ("the factor p is missing: ds = p * (dp - D), not dp - D", dp - d),
        ("the sign is flipped: ds = p * (dp - D), not p * (D - dp)", p * (d - dp)),
    ]
    if p.shape[0] == p.shape[1]:  # rowsum without keepdims: (rows,) broadcasts along the columns
        out.append(("the row sum is over the wrong axis after broadcasting: rowsum(p * dp) has shape "
                    "(rows,) and p * dp - it subtracts row i's sum from column i; keep the axis "
                    "(sum(axis=-1, keepdims=True), or [:, None])", p * (dp - d[:, 0][None, :])))
    return out


def check_softmax_backward(fn):
    """Chapter 5. ``fn(p, dp) -> ds``: the backward pass of ``p = softmax(s)`` over the last axis.

    ``p`` (rows, n) holds the softmax of each row of scores (each row sums to 1), ``dp = dL/dp``
    (rows, n), NumPy float64. Return ``ds = dL/ds`` (rows, n): ``ds = p * (dp - D)`` with
    ``D = rowsum(p * dp)``, one number per row, without forming any (n, n) Jacobian. The cases include
    one-hot rows, rows of a single key (n = 1) and rows of n = 4096 keys, all checked to float64
    rounding.
    """
    _callable(fn)
    cases = _softmax_cases()
    for case, p, dp in cases:
        want = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
        try:
            with np.errstate(all="ignore"):
                got = fn(p.copy(), dp.copy())
        except ValueError as e:  # broadcasting shapes that do not fit
            _fail(case, f"your function raised ValueError: {str(e)[:200]} -- with p and dp {p.shape}, "
                        f"D = rowsum(p * dp) has one number per row: shape ({p.shape[0]}, 1) "
                        f"(sum(axis=-1, keepdims=True)) broadcasts against p")
        got = _as_array(case, "ds", got)
        if got.shape == want.shape and np.allclose(got, want, rtol=RTOL, atol=ATOL):
            continue
        for what, x in _mistakes(p, dp):
            if got.shape == x.shape and np.allclose(got, x, rtol=RTOL, atol=ATOL):
                _fail(case, what)
        _compare(case, "ds", got, want, "ds = p * (dp - D) with D = rowsum(p * dp) over the last axis, "
                                        "one number per row")
    return f"all {len(cases)} hidden cases pass"
