"""Chapter 6: one tile of FlashAttention's backward pass, with the global LSE and D (NumPy only)."""
import numpy as np

from .. import reference
from ._common import ATOL, RTOL, _as_array, _callable, _compare, _fail, _returns


def _tile_cases():
    """(what, q, k, v, do, mask, scale, block_q, block_k): the whole problem, float64, cut into
    block_q x block_k tiles. mask is None or hides whole query rows (they see no key)."""
    rng = np.random.default_rng(6)

    def qkvdo(nq, nk, d):
        return (rng.standard_normal((nq, d)), rng.standard_normal((nk, d)), rng.standard_normal((nk, d)),
                rng.standard_normal((nq, d)))

    empty_rows = np.ones((6, 8), dtype=bool)
    empty_rows[[1, 4]] = False  # queries 1 and 4 see no key: lse = -inf
    return [
        ("square tiles: 8 queries, 8 keys, d = 4, tiles of 4 x 4 (a transposed dS still has a shape)",
         *qkvdo(8, 8, 4), None, 0.5, 4, 4),
        ("8 queries, 10 keys, d = 4, scale 1/sqrt(d), tiles of 4 queries x 5 keys (two key tiles per row)",
         *qkvdo(8, 10, 4), None, 0.5, 4, 5),
        ("9 queries, 16 keys, d = 6, scale 0.3 (not 1/sqrt(d)), tiles of 3 queries x 8 keys",
         *qkvdo(9, 16, 6), None, 0.3, 3, 8),
        ("queries 1 and 4 see no key (their lse = -inf, delta = 0), 6 queries, 8 keys, tiles of 3 x 4",
         *qkvdo(6, 8, 5), empty_rows, 1 / np.sqrt(5), 3, 4),
        ("a single query against three tiles of 7 keys (the last one partial: 20 keys), d = 3",
         *qkvdo(1, 20, 3), None, 0.8, 1, 7),
    ]


def _tile(q, k, v, do, lse, delta, scale, mistake=None):
    """The tile's (dq, dk, dv); with ``mistake``, the answer of that common mistake (an entry None
    where the mistake's shapes do not fit)."""
    s = (1.0 if mistake == "S unscaled" else scale) * (q @ k.T)  # (m, n)
    if mistake == "no lse":
        p = np.exp(s)
    elif mistake == "tile softmax":
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
    else:
        p = np.exp(s - np.where(np.isneginf(lse), np.inf, lse)[:, None])  # P = 0 on a row with no key
    dv = p.T @ do  # (n, d)
    dp = do @ v.T  # (m, n)
    d = {"local D": np.sum(dp * p, axis=-1), "no D": np.zeros_like(delta)}.get(mistake, delta)
    ds = p * (dp - d[:, None])  # (m, n)
    out_scale = 1.0 if mistake == "no scale" else scale
    dq, dk = out_scale * (ds @ k), out_scale * (ds.T @ q)
    square = p.shape[0] == p.shape[1]
    if mistake == "P not transposed":
        dv = p @ do if square else None
    elif mistake == "dS transposed":
        dq, dk = ((out_scale * (ds.T @ k), out_scale * (ds @ q)) if square else (None, None))
    return dq, dk, dv


_MISTAKES = [  # (mistake, what the checker says)
    ("no scale", "missing scale in dq/dk: dq = scale * dS @ k and dk = scale * dS.T @ q"),
    ("S unscaled", "the scores miss the scale: P = exp(scale * q @ k.T - lse)"),
    ("local D", "dS computed with the row sum of this tile (a local D) instead of the global delta: "
                "use dS = P * (dP - delta[:, None]), delta is D = rowsum(dO * O) of the whole row"),
    ("no D", "dS = P * dP: delta is missing, dS = P * (dP - delta[:, None])"),
    ("no lse", "P not normalised with lse (used exp(s) without subtracting lse): "
               "P = exp(scale * q @ k.T - lse[:, None])"),
    ("tile softmax", "P is the softmax of this tile alone: normalise with the global lse instead, "
                     "P = exp(scale * q @ k.T - lse[:, None])"),
    ("P not transposed", "dv is P @ do (P not transposed): dv = P.T @ do"),
    ("dS transposed", "dS is transposed in dq or dk: dq = scale * dS @ k, dk = scale * dS.T @ q"),
]


def check_backward_tile(fn):
    """Chapter 6. ``fn(q, k, v, do, lse, delta, scale) -> (dq, dk, dv)``: one tile of the backward pass.

    ``q`` and ``do`` (m, d) are a tile of query rows and their output gradients, ``k`` and ``v``
    (n, d) a tile of keys and values, NumPy float64; ``lse`` and ``delta`` (m,) are the GLOBAL
    log-sum-exp and ``D = rowsum(dO * O)`` of the whole rows (over every key, not only this tile's);
    ``scale`` the softmax scale (not always 1/sqrt(d)). Return this tile's contributions::

        P  = exp(scale * q @ k.T - lse[:, None])   # (m, n), already normalised
        dv = P.T @ do                              # (n, d)
        dP = do @ v.T                              # (m, n)
        dS = P * (dP - delta[:, None])             # (m, n)
        dq = scale * dS @ k                        # (m, d)
        dk = scale * dS.T @ q                      # (n, d)

    A row with ``lse = -inf`` sees no key: it contributes 0, never NaN. The checker cuts each hidden
    problem into tiles, calls ``fn`` on every tile, and checks each tile's answer and the sums over
    the tiles (dq over a row's key tiles, dk and dv over a key's query tiles) against
    ``fa_lib.reference.naive_attention_backward``.
    """
    _callable(fn)
    cases = _tile_cases()
    for case, q, k, v, do, mask, scale, bq, bk in cases:
        o, lse = reference.naive_attention(q, k, v, mask=mask, softmax_scale=scale)
        delta = np.sum(do * o, axis=-1)  # D = rowsum(dO * O), 0 on a row with no key
        want_sum = reference.naive_attention_backward(q, k, v, do, mask=mask, softmax_scale=scale)
        sums = [np.zeros_like(x) for x in (q, k, v)]
        nq, nk, d = q.shape[0], k.shape[0], q.shape[1]
        for r0 in range(0, nq, bq):
            for c0 in range(0, nk, bk):
                r, c = slice(r0, min(r0 + bq, nq)), slice(c0, min(c0 + bk, nk))
                args = (q[r], k[c], v[c], do[r], lse[r], delta[r], scale)
                where = f"{case}, tile of queries {r.start}:{r.stop} x keys {c.start}:{c.stop}"
                try:
                    with np.errstate(all="ignore"):
                        out = _returns(where, fn(*(np.array(x) for x in args[:6]), scale), 3, ("dq", "dk", "dv"))
                except ValueError as e:  # NumPy: shapes that do not fit
                    m, n = r.stop - r.start, c.stop - c.start
                    _fail(where, f"your function raised ValueError: {str(e)[:200]} -- with q and do "
                                 f"({m}, {d}), k and v ({n}, {d}): P, dP and dS are ({m}, {n}); "
                                 f"dv = P.T @ do ({n}, {d}), dq = scale * dS @ k ({m}, {d}), "
                                 f"dk = scale * dS.T @ q ({n}, {d})")
                want = _tile(*args)
                for i, name in enumerate(("dq", "dk", "dv")):
                    got = _as_array(where, name, out[i])
                    if got.shape == want[i].shape and np.allclose(got, want[i], rtol=RTOL, atol=ATOL):
                        sums[i][(r, c, c)[i]] += got
                        continue
                    if np.isneginf(lse[r]).any() and got.shape == want[i].shape and not np.isfinite(got).all():
                        rows = [int(j) for j in np.flatnonzero(np.isneginf(lse[r])) + r.start]
                        _fail(where, f"{name} has NaN or inf: NaN from a row with lse = -inf (queries "
                                     f"{rows} see no key): exp(s - lse) is exp(+inf) there; give such "
                                     f"rows P = 0, e.g. subtract np.where(lse == -inf, np.inf, lse)")
                    if scale != 1 / np.sqrt(d):
                        sqrt_d = _tile(*args[:6], 1 / np.sqrt(d))[i]
                        if got.shape == sqrt_d.shape and np.allclose(got, sqrt_d, rtol=RTOL, atol=ATOL):
                            _fail(where, f"{name} uses the scale 1/sqrt(d) instead of the scale argument "
                                         f"({scale:.4g} here)")
                    for mistake, what in _MISTAKES:
                        x = _tile(*args, mistake=mistake)[i]
                        if x is not None and got.shape == x.shape and np.allclose(got, x, rtol=RTOL, atol=ATOL):
                            _fail(where, f"{name}: {what}")
                    _compare(where, name, got, want[i], "P = exp(scale * q @ k.T - lse), dS = P * (dP - delta), "
                                                        "dq = scale * dS @ k, dk = scale * dS.T @ q, dv = P.T @ do")
        for name, got, w in zip(("dq", "dk", "dv"), sums, want_sum):
            _compare(f"{case}, summed over the tiles", name, got, w,
                     "each tile's answer is right, yet the sums differ from the full gradient")
    return f"all {len(cases)} hidden cases pass"
