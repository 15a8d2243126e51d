"""Chapter 4: the gradients of a matrix product (NumPy only)."""
import numpy as np

from ._common import ATOL, RTOL, _as_array, _callable, _compare, _fail, _returns


def _matmul_cases():
    """(what, a, b, dc): a (m, k), b (k, n), dc (m, n), float64."""
    rng = np.random.default_rng(4)

    def abdc(m, k, n):
        return rng.standard_normal((m, k)), rng.standard_normal((k, n)), rng.standard_normal((m, n))

    return [
        ("square: A, B and dC all (4, 4) (every product has a shape; only the values tell)", *abdc(4, 4, 4)),
        ("A (3, 5), B (5, 2), dC (3, 2) (three different sizes: a transposition changes the shape)",
         *abdc(3, 5, 2)),
        ("A (6, 6), B (6, 3), dC (6, 3) (m = k)", *abdc(6, 6, 3)),
        ("a single row: A (1, 7), B (7, 4), dC (1, 4)", *abdc(1, 7, 4)),
        ("an outer product: A (5, 1), B (1, 3), dC (5, 3) (k = 1)", *abdc(5, 1, 3)),
    ]


def _products(x, y, names, want):
    """The products of x or x.T with y or y.T, in both orders, that are not the right answer:
    ("expression", array) for each one the shapes allow."""
    (nx, ny), out = names, []
    for left, right in (((x, nx), (y, ny)), ((y, ny), (x, nx))):
        for tl in (False, True):
            for tr in (False, True):
                a = left[0].T if tl else left[0]
                b = right[0].T if tr else right[0]
                if a.shape[1] != b.shape[0]:
                    continue
                expr = f"{left[1]}{'.T' if tl else ''} @ {right[1]}{'.T' if tr else ''}"
                if expr != want:
                    out.append((expr, a @ b))
    return out


def _same(got, x):
    return got.shape == x.shape and bool(np.allclose(got, x, rtol=RTOL, atol=ATOL))


_WHY = {  # the named mistakes; any other product is reported by its expression
    "dc @ b": "b not transposed",
    "b @ dc.T": "the transpose of the answer: (dc @ b.T).T",
    "a @ dc": "a not transposed",
    "dc.T @ a": "the transpose of the answer: (a.T @ dc).T",
}


def check_matmul_backward(fn):
    """Chapter 4. ``fn(a, b, dc) -> (da, db)``: the gradients of ``C = A @ B``.

    ``a`` (m, k), ``b`` (k, n) and ``dc = dL/dC`` (m, n), NumPy float64. Return ``da = dc @ b.T``
    (m, k), shaped like ``a``, and ``db = a.T @ dc`` (k, n), shaped like ``b``. The cases are 2-D
    only; square ones let a transposed answer through the shapes, so only its values tell.
    """
    _callable(fn)
    cases = _matmul_cases()
    for case, a, b, dc in cases:
        want = {"da": dc @ b.T, "db": a.T @ dc}
        try:
            out = _returns(case, fn(a.copy(), b.copy(), dc.copy()), 2, ("da", "db"))
        except ValueError as e:  # NumPy's matmul: shapes that do not fit
            _fail(case, f"your function raised ValueError: {str(e)[:200]} -- with a {a.shape}, b {b.shape} "
                        f"and dc {dc.shape}, da = dc @ b.T is {want['da'].shape} like a, and "
                        f"db = a.T @ dc is {want['db'].shape} like b")
        got = {"da": _as_array(case, "da", out[0]), "db": _as_array(case, "db", out[1])}
        if not (_same(got["da"], want["da"]) and _same(got["db"], want["db"])) and \
                _same(got["da"], want["db"]) and _same(got["db"], want["da"]):
            _fail(case, "you returned (db, da): return (da, db), in the order of the arguments a, b")
        candidates = {"da": _products(dc, b, ("dc", "b"), "dc @ b.T") + [("a.T @ dc", want["db"])],
                      "db": _products(a, dc, ("a", "dc"), "a.T @ dc") + [("dc @ b.T", want["da"])]}
        right = {"da": "dc @ b.T", "db": "a.T @ dc"}
        for name in ("da", "db"):
            g, w = got[name], want[name]
            if _same(g, w):
                continue
            for expr, x in candidates[name]:
                if _same(g, x):
                    why = _WHY.get(expr, "the factors in the wrong order or transposed")
                    if expr == right["db" if name == "da" else "da"]:
                        why = f"that is {'db' if name == 'da' else 'da'}"
                    _fail(case, f"{name} is {expr} ({why}): {name} = {right[name]}, shaped like "
                                f"{'a' if name == 'da' else 'b'} {w.shape}")
            _compare(case, name, g, w, f"{name} = {right[name]}")
    return f"all {len(cases)} hidden cases pass"
