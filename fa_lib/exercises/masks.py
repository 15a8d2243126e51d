"""Chapter 8: the tile classes of a causal or sliding-window mask (which tiles a kernel skips, which need
no mask, which need one). NumPy alone."""
import numpy as np

from .. import reference
from ._common import _callable, _fail

EMPTY, FULL, PARTIAL = 0, 1, 2  # the codes your function returns

# (n_q, n_k, block_m, block_n, causal, window): square and not, lengths that are not multiples of the
# block, both alignments' worst cases (n_q < n_k and n_q > n_k), one-sided and two-sided windows.
_CASES = [
    (16, 16, 4, 4, True, (-1, -1)),
    (12, 20, 4, 4, True, (-1, -1)),
    (20, 12, 4, 4, True, (-1, -1)),
    (5, 9, 4, 4, True, (-1, -1)),
    (13, 13, 4, 8, False, (-1, -1)),
    (10, 14, 8, 4, True, (-1, -1)),
    (32, 32, 8, 8, True, (10, 0)),
    (32, 32, 4, 4, True, (8, 0)),
    (24, 40, 8, 8, False, (6, 3)),
    (37, 29, 8, 4, True, (5, -1)),
    (19, 19, 4, 4, False, (-1, 2)),
    (1, 23, 1, 8, True, (7, 0)),
    (3, 3, 4, 4, True, (-1, -1)),
]


def _classes_of(vis, block_m, block_n):
    """Codes of every tile of a boolean (n_q, n_k) element mask, counting only the real rows/cols."""
    nq, nk = vis.shape
    out = np.empty((-(-nq // block_m), -(-nk // block_n)), dtype=np.int64)
    for a, r0 in enumerate(range(0, nq, block_m)):
        for b, c0 in enumerate(range(0, nk, block_n)):
            t = vis[r0:r0 + block_m, c0:c0 + block_n]
            out[a, b] = EMPTY if not t.any() else (FULL if t.all() else PARTIAL)
    return out


def _expected(nq, nk, bm, bn, causal, window):
    return _classes_of(reference.window_visible(nq, nk, window, causal), bm, bn)


def _rule(rows, cols, shift, causal, window):
    """The visibility rule on arbitrary row/col indices, with the diagonal at j = i + shift."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    i, j = np.asarray(rows)[:, None], np.asarray(cols)[None, :]
    vis = np.ones((i.size, j.size), dtype=bool)
    if left >= 0:
        vis &= j >= i + shift - left
    if right >= 0:
        vis &= j <= i + shift + right
    return vis


# The common wrong answers, each with what to say when yours matches it.
def _top_left(nq, nk, bm, bn, causal, window):
    return _classes_of(_rule(range(nq), range(nk), 0, causal, window), bm, bn)


def _nominal_blocks(nq, nk, bm, bn, causal, window):
    # the last block taken at its full size, its missing rows/cols following the rule as if they existed
    nr, nc = -(-nq // bm) * bm, -(-nk // bn) * bn
    return _classes_of(_rule(range(nr), range(nc), nk - nq, causal, window), bm, bn)


def _missing_hidden(nq, nk, bm, bn, causal, window):
    # the last block taken at its full size, its missing rows/cols counted as hidden pairs
    nr, nc = -(-nq // bm) * bm, -(-nk // bn) * bn
    vis = np.zeros((nr, nc), dtype=bool)
    vis[:nq, :nk] = reference.window_visible(nq, nk, window, causal)
    return _classes_of(vis, bm, bn)


def _no_left_edge(nq, nk, bm, bn, causal, window):
    return _expected(nq, nk, bm, bn, causal, (-1, window[1]))


_HINTS = [
    (_top_left, "your mask is aligned top-left; fa_lib aligns bottom-right: query i sees key "
                "j <= i + N_K - N_Q (+ right), not j <= i, so the last query sits on the last key"),
    (_nominal_blocks, "you treated the partial last block as a whole block: a last block cut short by N_Q or "
                      "N_K holds only its real rows/cols (r1 = min(r0 + block_m, n_q), "
                      "c1 = min(c0 + block_n, n_k)); the rows/cols past the end do not exist"),
    (_missing_hidden, "you ignored the partial last block's real extent: its missing rows/cols are not hidden "
                      "pairs, they do not exist, so a cut-short tile whose real pairs are all visible is "
                      "full (1), not partial; use r1 = min(r0 + block_m, n_q), c1 = min(c0 + block_n, n_k)"),
    (_no_left_edge, "you forgot the window's left edge: with left >= 0, query i sees key j only if "
                    "j >= i + N_K - N_Q - left, so tiles far left of the diagonal are empty (0) and the "
                    "tiles the left edge crosses are partial (2)"),
]

_DIAGONAL = ("you treated a tile that the diagonal (the right edge j = i + N_K - N_Q + right) passes through as "
             "full: a tile is full only if its top-right corner (r0, c1 - 1) is visible, i.e. "
             "(c1 - 1) - r0 <= N_K - N_Q + right; otherwise some of its pairs are hidden and it is partial (2)")


def _describe(case):
    nq, nk, bm, bn, causal, window = case
    return f"n_q={nq}, n_k={nk}, block_m={bm}, block_n={bn}, causal={causal}, window={window}"


def _as_classes(case, got, shape):
    if isinstance(got, np.ndarray) and got.dtype.kind in "OUS":
        _fail(case, "return integer codes, not strings: 0 = fully masked (skip), 1 = fully visible (no mask), "
                    "2 = partially masked")
    try:
        arr = np.asarray(got)
    except (TypeError, ValueError):
        _fail(case, f"return a NumPy int array, got {type(got).__name__}")
    if arr.dtype.kind in "OUS":
        _fail(case, "return integer codes, not strings: 0 = fully masked (skip), 1 = fully visible (no mask), "
                    "2 = partially masked")
    if arr.shape != shape:
        _fail(case, f"the classes have shape {arr.shape}, expected {shape} = (ceil(n_q / block_m), "
                    f"ceil(n_k / block_n)): one entry per tile, the last block of each axis included even "
                    f"when it is cut short")
    if arr.dtype.kind not in "biu" or not np.isin(arr, (EMPTY, FULL, PARTIAL)).all():
        _fail(case, f"every entry must be one of the ints 0, 1, 2, got values {sorted(set(arr.ravel().tolist()))[:6]}")
    return arr.astype(np.int64)


def _only_diagonal(case, got, want):
    """True when every wrong tile is a partial one called full whose hidden pairs all lie right of the band."""
    nq, nk, bm, bn, causal, window = case
    wrong = np.argwhere(got != want)
    if len(wrong) == 0:
        return False
    vis = reference.window_visible(nq, nk, window, causal)
    below = _rule(range(nq), range(nk), nk - nq, False, (window[0], -1))  # only the left edge applied
    for a, b in wrong:
        if not (want[a, b] == PARTIAL and got[a, b] == FULL):
            return False
        rows, cols = slice(a * bm, (a + 1) * bm), slice(b * bn, (b + 1) * bn)
        hidden = ~vis[rows, cols]
        if (hidden & ~below[rows, cols]).any():  # some pair is hidden by the left edge, not the diagonal
            return False
    return True


def check_tile_classes(fn):
    """Chapter 8. ``fn(n_q, n_k, block_m, block_n, causal, window) -> classes``.

    ``classes`` is an int array of shape ``(ceil(n_q / block_m), ceil(n_k / block_n))``, one entry per tile
    of ``block_m`` query rows by ``block_n`` key columns: 0 = fully masked (the kernel skips it), 1 = fully
    visible (no mask needed), 2 = partially masked (the mask is applied elementwise). The mask is fa_lib's:
    aligned bottom-right, query i sees key j iff ``j <= i + n_k - n_q + right`` (``causal``: right = 0) and,
    when ``left >= 0``, ``j >= i + n_k - n_q - left``; ``window = (left, right)``, -1 = unbounded. A last
    block cut short by ``n_q`` or ``n_k`` counts only its real rows/cols.

    The expected classes come from the element mask ``fa_lib.reference.window_visible``.
    """
    _callable(fn)
    for case in _CASES:
        name = _describe(case)
        want = _expected(*case)
        with np.errstate(all="ignore"):
            got = _as_classes(name, fn(*case), want.shape)
        if np.array_equal(got, want):
            continue
        for wrong, hint in _HINTS:
            if np.array_equal(got, wrong(*case)):
                _fail(name, hint)
        if _only_diagonal(case, got, want):
            _fail(name, _DIAGONAL)
        a, b = (int(x) for x in np.argwhere(got != want)[0])
        nq, nk, bm, bn = case[:4]
        r0, c0 = a * bm, b * bn
        _fail(name, f"tile [{a}, {b}] (rows {r0}..{min(r0 + bm, nq) - 1}, cols {c0}..{min(c0 + bn, nk) - 1}) "
                    f"is {int(got[a, b])}, expected {int(want[a, b])} "
                    f"({('fully masked', 'fully visible', 'partially masked')[want[a, b]]})")
    return f"all {len(_CASES)} hidden cases pass"
