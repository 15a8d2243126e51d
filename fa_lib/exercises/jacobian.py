"""Chapter 5: the softmax Jacobian as a matrix, J = diag(p) - p p^T (NumPy only)."""
import numpy as np

from ._common import ATOL, RTOL, _as_array, _callable, _compare, _fail


def _softmax(s):
    e = np.exp(s - s.max())
    return e / e.sum()


def _jacobian_cases():
    """(what, p): p a probability vector (n,), float64."""
    rng = np.random.default_rng(55)
    one_hot = np.zeros(5)
    one_hot[2] = 1.0
    return [
        ("n = 3, the chapter's symbolic size, p = softmax of 3 random scores",
         _softmax(rng.standard_normal(3) * 2)),
        ("n = 50 (p = softmax of 50 random scores)", _softmax(rng.standard_normal(50) * 2)),
        ("a one-hot p = (0, 0, 1, 0, 0): a saturated softmax, J = 0", one_hot),
        ("n = 1, p = (1,): a softmax of one score is constant, J = [[0]]", np.ones(1)),
    ]


def _mistakes(p):
    """The common wrong answers on one case: (what went wrong, the (n, n) array it gives)."""
    outer = np.outer(p, p)
    q = _softmax(p)  # p taken for scores and put through the softmax again
    return [
        ("the diagonal term diag(p) is missing: J = diag(p) - p p^T, not -p p^T", -outer),
        ("the outer product is missing: J = diag(p) - p p^T, not diag(p) alone", np.diag(p)),
        ("the sign is flipped: J = diag(p) - p p^T, not p p^T - diag(p)", outer - np.diag(p)),
        ("p p^T is subtracted on the diagonal only (diag(p - p**2)): the off-diagonal entries "
         "are -p_i p_j, so J = diag(p) - np.outer(p, p)", np.diag(p - p * p)),
        ("p @ p.T on a 1-D array is the scalar p . p, not the outer product: use np.outer(p, p) "
         "(or p[:, None] * p[None, :])", np.diag(p) - p @ p),
        ("you applied the softmax to p: p is already the probability vector (softmax(s)), "
         "J = diag(p) - p p^T uses p itself, not softmax(p)", np.diag(q) - np.outer(q, q)),
    ]


def check_softmax_jacobian(fn):
    """Chapter 5. ``fn(p) -> J``: the Jacobian of the softmax at the probability vector ``p``.

    ``p`` (n,) is ``softmax(s)`` for some scores ``s`` (its entries are >= 0 and sum to 1), NumPy
    float64. Return ``J`` (n, n) with ``J[i, j] = dp_i / ds_j``, that is ``J = diag(p) - p p^T``
    (symmetric, so its transpose is the same matrix). The cases are n = 3, n = 50, a one-hot p and
    n = 1, all checked to float64 rounding.
    """
    _callable(fn)
    cases = _jacobian_cases()
    for case, p in cases:
        want = np.diag(p) - np.outer(p, p)
        with np.errstate(all="ignore"):
            got = fn(p.copy())
        got = _as_array(case, "J", got)
        if got.shape == want.shape and np.allclose(got, want, rtol=RTOL, atol=ATOL):
            continue
        if got.shape != want.shape and got.size == p.size:
            _fail(case, f"J has shape {got.shape}, expected {want.shape}: the Jacobian is an (n, n) "
                        f"matrix, one row per output p_i and one column per score s_j")
        for what, x in _mistakes(p):
            if got.shape == x.shape and np.allclose(got, x, rtol=RTOL, atol=ATOL):
                _fail(case, what)
        _compare(case, "J", got, want, "J = diag(p) - p p^T: J[i, i] = p_i (1 - p_i), "
                                       "J[i, j] = -p_i p_j for i != j")
    return f"all {len(cases)} hidden cases pass"
