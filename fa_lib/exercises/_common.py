"""What every checker shares: the failure it raises, the comparison against the reference, return checks."""
import numpy as np

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


def _num(x):
    """A number as Python writes a float (``1.5``, ``-inf``), not as NumPy 2 reprs a scalar (``np.float64(1.5)``)."""
    x = float(x)
    return "NaN" if x != x else repr(x)


def _compare(case, name, got, want, hint=""):
    got = _as_array(case, name, got)
    if got.shape != want.shape:
        _fail(case, f"{name} has shape {got.shape}, expected {want.shape}")
    bad_nan = np.isnan(got) & ~np.isnan(want)
    if bad_nan.any():
        where = tuple(int(i) for i in np.argwhere(bad_nan)[0])
        _fail(case, f"{name}{list(where)} is NaN, expected {_num(want[where])}" + (f" ({hint})" if hint else ""))
    same_inf = (got == want) & np.isinf(want)
    close = np.isclose(got, want, rtol=RTOL, atol=ATOL) | same_inf
    if not close.all():
        where = tuple(int(i) for i in np.argwhere(~close)[0])
        _fail(case, f"{name}{list(where)} = {_num(got[where])}, expected {_num(want[where])}"
                    + (f" ({hint})" if hint else ""))


def _returns(case, out, n, names):
    if not isinstance(out, (tuple, list)) or len(out) != n:
        _fail(case, f"your function should return {n} arrays ({', '.join(names)}), got {type(out).__name__}"
                    + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    return out
