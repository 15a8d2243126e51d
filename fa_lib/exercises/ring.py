"""Chapter 14: the log-sum-exp of a row passed around a ring, and one step of ring attention, folding a received
K/V block into the running output."""
import numpy as np

from .. import reference
from ._common import _callable, _fail, _returns


def _block(q, k, v, scale, mask):
    """The block's own normalised (o, lse): attention of q over this block alone."""
    s = scale * (q @ k.T)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    return _normalised(*reference.softmax_state(s, v[None] if v.ndim == 2 else v))


def _normalised(m, l, acc):
    """A state (m, l, acc) as the normalised (o, lse); o = 0, lse = -inf for a row with no key."""
    seen = l > 0
    safe = np.where(seen, l, 1.0)
    return np.where(seen[:, None], acc / safe[:, None], 0.0), np.where(seen, m + np.log(safe), -np.inf)


def _state(o, lse):
    """A normalised (o, lse) as a softmax state (m, l, acc) = (lse, 1, o); (-inf, 0, 0) for a row with no key."""
    seen = np.isfinite(lse)
    return lse, seen.astype(float), np.where(seen[:, None], o, 0.0)


def _merge(o, lse, o_b, lse_b):
    """The exact merge of two normalised states, -inf rows the identity (the answer): `reference.merge_states`."""
    return _normalised(*reference.merge_states(_state(o, lse), _state(o_b, lse_b)))


def _step(o, lse, q, k, v, scale, mask):
    return _merge(o, lse, *_block(q, k, v, scale, mask))


def _averaged(o, lse, q, k, v, scale, mask):
    o_b, lse_b = _block(q, k, v, scale, mask)
    both = np.isfinite(lse) & np.isfinite(lse_b)
    o_new = np.where(both[:, None], (o + o_b) / 2, np.where(np.isfinite(lse)[:, None], o, o_b))
    return o_new, np.logaddexp(lse, lse_b)


def _cases():
    rng = np.random.default_rng(14)
    rows, n, d = 5, 6, 4

    def qkv(size=1.0):
        return (rng.standard_normal((rows, d)) * size, rng.standard_normal((n, d)) * size,
                rng.standard_normal((n, d)))

    def state(shift=0.0):
        return rng.standard_normal((rows, d)), rng.standard_normal(rows) * 2 + shift

    empty = (np.zeros((rows, d)), np.full(rows, -np.inf))
    causal = np.tril(np.ones((rows, n), dtype=bool), 1)
    some_blind = rng.random((rows, n)) < 0.6
    some_blind[[1, 3]] = False  # rows 1 and 3 see no key of this block
    half_empty = (np.where(np.arange(rows)[:, None] < 2, 0.0, rng.standard_normal((rows, d))),
                  np.where(np.arange(rows) < 2, -np.inf, rng.standard_normal(rows)))
    return [
        ("the first block (nothing seen yet: o = 0, lse = -inf)", empty, qkv(), None),
        ("a second block, no mask (the state and the block weigh by exp(lse), not half each)", state(1.5), qkv(),
         None),
        ("a mask hiding part of the block (True = visible)", state(), qkv(), causal),
        ("scores and LSEs near 800 (exp(800) overflows float64: shift by the larger LSE)", state(800.0),
         (np.full((rows, d), 26.0) + rng.standard_normal((rows, d)) * 0.1,
          np.full((n, d), 26.0) + rng.standard_normal((n, d)) * 0.1, rng.standard_normal((n, d))), None),
        ("rows 1 and 3 see no key of this block (their state must stay as it was, no NaN)", state(), qkv(),
         some_blind),
        ("rows 0 and 1 have seen nothing and row 1 sees nothing here (o = 0, lse = -inf, no NaN)", half_empty, qkv(),
         np.where(np.arange(rows)[:, None] == 1, False, some_blind | True)),
    ]


_SCALE = 0.3


def _close(got, want):
    return got.shape == want.shape and bool(np.all(np.isclose(got, want, rtol=1e-9, atol=1e-12)
                                                   | ((got == want) & np.isinf(want))))


def check_ring_step(fn):
    """Chapter 14. ``fn(o, lse, q, k_blk, v_blk, scale, mask) -> (o, lse)``: one step of ring attention.

    ``o`` (rows, dv) and ``lse`` (rows,) are the running, *normalised* output and natural-log LSE of this
    rank's queries ``q`` (rows, d) over the keys seen so far (``o = 0``, ``lse = -inf`` for a row that has
    seen none). ``k_blk`` (n, d), ``v_blk`` (n, dv) is the block that just arrived; ``scale`` multiplies
    the scores; ``mask`` is None or a boolean (rows, n) array, True where a query sees a key. Return the
    state over everything seen, merged exactly by the two LSEs; a row that has still seen nothing keeps
    ``o = 0`` and ``lse = -inf``, never NaN.
    """
    _callable(fn)
    cases = _cases()
    for case, (o, lse), (q, k, v), mask in cases:
        args = (o, lse, q, k, v, _SCALE, mask)
        want_o, want_lse = _step(*args)
        with np.errstate(all="ignore"):
            out = _returns(case, fn(*(a.copy() if isinstance(a, np.ndarray) else a for a in args)), 2, ("o", "lse"))
        try:
            got_o, got_lse = np.asarray(out[0], dtype=np.float64), np.asarray(out[1], dtype=np.float64)
        except (TypeError, ValueError):
            _fail(case, "return NumPy arrays of numbers (o, lse)")
        if _close(got_o, want_o) and _close(got_lse, want_lse):
            continue
        if got_o.shape != want_o.shape or got_lse.shape != want_lse.shape:
            _fail(case, f"o should have shape {want_o.shape} and lse {want_lse.shape}, got {got_o.shape} and "
                        f"{got_lse.shape}")
        if np.isnan(got_o).any() or np.isnan(got_lse).any():
            if "overflow" in case:
                _fail(case, "NaN or inf: exp(lse) overflows. Subtract the larger of the two LSEs (m) before "
                            "exponentiating: weights exp(lse - m) and exp(lse_blk - m)")
            _fail(case, "NaN for a row that sees no key: -inf - (-inf) is NaN. Where both LSEs are -inf, use 0 "
                        "as the shift and leave o = 0, lse = -inf; divide only where the total weight is > 0")
        if np.isinf(got_o).any() or (np.isinf(got_lse) & ~np.isinf(want_lse)).any():
            _fail(case, "inf: exp(lse) overflows. Subtract the larger of the two LSEs before exponentiating")
        with np.errstate(all="ignore"):
            plain = _block(q, k, v, _SCALE, mask)
            wrong = [(((o + plain[0]) / 2, lse), "you averaged the two outputs; weigh each by its softmax mass, "
                                                 "exp(lse - m) / (exp(lse - m) + exp(lse_blk - m))"),
                     (_averaged(*args), "you averaged the two outputs; weigh each by its softmax mass, "
                                        "exp(lse - m) / (exp(lse - m) + exp(lse_blk - m))"),
                     (_step(o, lse, q, k, v, _SCALE ** 2, mask), "the scale is applied twice (scale the scores "
                                                                 "q k^T once)"),
                     (_step(o, lse, q, k, v, 1.0, mask), "the scale is not applied: scores are scale * q k^T"),
                     (_step(o, lse, q, k, v, _SCALE, None), "the mask is ignored: hidden scores are -inf before "
                                                             "the block's softmax")]
        for (w_o, w_lse), hint in wrong:
            if mask is None and "mask" in hint:
                continue
            if _close(got_o, w_o) and (_close(got_lse, w_lse) or "averaged" in hint):
                _fail(case, hint)
        for name, got, want in (("o", got_o, want_o), ("lse", got_lse, want_lse)):
            if not _close(got, want):
                bad = ~(np.isclose(got, want, rtol=1e-9, atol=1e-12) | ((got == want) & np.isinf(want)))
                where = tuple(int(i) for i in np.argwhere(bad)[0])
                _fail(case, f"{name}{list(where)} = {got[where]!r}, expected {want[where]!r} (new lse = "
                            f"log(exp(lse) + exp(lse_blk)), new o = the two outputs weighted by exp(lse - new lse) "
                            f"and exp(lse_blk - new lse))")
    return f"all {len(cases)} hidden cases pass"


def _lse_cases():
    rng = np.random.default_rng(13)
    row = rng.standard_normal(11)
    return [
        ("four ranks, shards of 2, 1, 6 and 2 scores", [row[:2], row[2:3], row[3:9], row[9:]]),
        ("one rank (the ring is one step)", [row[:5]]),
        ("three ranks, scores near 1000 (np.exp overflows: merge the softmax states)",
         [row[:4] + 1000, row[4:5] + 1000, row[5:] + 1000]),
        ("two ranks, one of whose scores are all -inf (a shard the mask hides)", [row[:3], np.full(4, -np.inf)]),
    ]


def check_ring_lse(fn):
    """Chapter 14. ``fn(x_shards) -> list``: ``x_shards`` holds one 1-D float64 array of scores per rank (a
    row of scores cut into W shards, some of them of different lengths); return W numbers, what every rank
    holds after the ring has passed each shard to every rank: the log-sum-exp of the whole row,
    ``log(sum_j exp(x_j))``, exact for scores near 1000 too."""
    _callable(fn)
    for case, shards in _lse_cases():
        whole = np.concatenate(shards)
        top = whole.max()
        want = top + np.log(np.exp(whole - top).sum())
        with np.errstate(all="ignore"):
            out = fn([x.copy() for x in shards])
        try:
            got = np.asarray(out, dtype=np.float64)
        except (TypeError, ValueError):
            _fail(case, f"return a list of {len(shards)} numbers, one per rank, got {type(out).__name__}")
        if got.shape != (len(shards),):
            _fail(case, f"return one number per rank: {len(shards)} of them, got shape {got.shape}")
        if np.allclose(got, want, rtol=0, atol=1e-9):
            continue
        if not np.isfinite(got).all():
            _fail(case, "inf or NaN: exp(x) overflows near 1000. Keep each rank's softmax state (m, l) "
                        "(reference.softmax_state) and merge states (reference.merge_states); the LSE is m + log(l)")
        with np.errstate(all="ignore"):
            own = [np.log(np.exp(x - x.max()).sum()) + x.max() for x in shards]
        if np.allclose(got, own, rtol=0, atol=1e-9):
            _fail(case, "each rank returned the LSE of its own shard: every rank must merge every shard as the "
                        "ring passes it on, W steps in all")
        _fail(case, f"rank values {np.round(got, 6).tolist()}, expected {want:.6f} on every rank")
    return f"all {len(_lse_cases())} hidden cases pass"
