"""NumPy reference: the step-by-step mirror of the book.

Every function takes NumPy arrays with any leading dimensions: ``q`` is ``(..., Nq, d)``, ``k`` is
``(..., Nk, d)`` and ``v`` is ``(..., Nk, dv)`` (usually ``dv == d``); the leading dimensions of the
three must be equal. float32 and float64 are accepted and the result has the input dtype; the LSE is
float32 for float32 input and float64 for float64 input.

Conventions (the whole project shares them):

* ``softmax_scale`` defaults to ``1 / sqrt(d)``.
* ``mask`` is boolean, broadcastable to ``(..., Nq, Nk)``; ``True`` means *visible*.
* ``causal=True`` is aligned bottom-right: query ``i`` sees key ``j`` iff ``j <= i + Nk - Nq``.
  For ``Nq = 3, Nk = 5`` (``x`` visible, ``.`` hidden)::

        k: 0 1 2 3 4
      q0   x x x . .
      q1   x x x x .
      q2   x x x x x

  With ``Nq > Nk`` the first ``Nq - Nk`` query rows see no key at all.
* A query row with no visible key has output 0, LSE ``-inf`` and zero gradients. No NaN, no warning:
  the code never evaluates ``-inf - (-inf)``.
* LSE is the natural-log ``m + log(l)`` per query row.

Names follow the FlashAttention papers and the Triton kernel: ``m`` running row maximum, ``l`` running
sum of ``exp(s - m)``, ``acc`` the un-normalised output ``sum_j exp(s_j - m) v_j``, ``alpha`` the
rescale factor ``exp(m_old - m_new)``.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import numpy as np

_F32_TINY, _F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)

__all__ = [
    "BackwardStep",
    "apply_sinks",
    "ForwardStep",
    "NormalizerStep",
    "attention_scores",
    "causal_mask",
    "flash_backward",
    "flash_forward",
    "fp8_attention",
    "fp8_error_bound",
    "merge_states",
    "naive_attention",
    "naive_attention_backward",
    "online_normalizer",
    "online_softmax",
    "quantize_e4m3",
    "rotary_embedding",
    "round_e4m3",
    "safe_softmax",
    "softmax_state",
    "varlen_attention",
]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


# ----------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------
def _check_array(name: str, x, min_ndim: int = 1) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name} must have dtype float32 or float64, got {x.dtype}")
    if x.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {x.shape}")
    return x


def _check_block(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def _real(name, x, kind, finite_kind):
    """`x` as a float: a TypeError naming `name` if it is not a real number (a bool is not), a ValueError
    for an int too large for a float. The caller checks the range; `kind` and `finite_kind` complete the
    messages ("softcap must be <kind>, got ...")."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be {kind}, got {x!r}")
    try:
        return float(x)
    except OverflowError:
        raise ValueError(f"{name} must be {finite_kind}, got an int of {len(str(x))} digits") from None


def _check_window_softcap(window, softcap):
    """Validate ``window = (left, right)`` (each an int >= 0, or -1 for unbounded) and ``softcap``
    (a real >= 0; 0 switches it off); return them as ``((left, right), softcap)``."""
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) for w in window)):
        raise TypeError(f"window must be a pair of ints (left, right), -1 meaning unbounded, got {window!r}")
    if any(w < -1 for w in window):
        raise ValueError(f"window sizes must be >= 0, or -1 for unbounded, got {tuple(window)}")
    cap = _real("softcap", softcap, "a real number >= 0 (0 = off)", "a finite number >= 0 (0 = off)")
    if not (math.isfinite(cap) and cap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap}")
    if cap != 0 and not _F32_TINY <= cap <= _F32_MAX:  # the kernels compute with c and 1/c in float32
        raise ValueError(f"softcap must be 0 (off) or between {_F32_TINY:.3g} and {_F32_MAX:.3g} (a normal "
                         f"float32), got {softcap}")
    return (int(window[0]), int(window[1])), cap


def _check_count(name, n, least):
    """An int (not a bool) of at least `least`, as a Python int."""
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral) or n < least:
        raise ValueError(f"{name} must be an int >= {least}, got {n!r}")
    return int(n)


def _scale_and_causal(softmax_scale, causal, d):
    """The softmax scale (``None``: 1 / sqrt(d)) as a finite float, and ``causal`` checked as a bool."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    scale = _real("softmax_scale", softmax_scale, "a real number or None", "finite")
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    return scale


def window_visible(nq: int, nk: int, window=(-1, -1), causal: bool = False) -> np.ndarray:
    """The (Nq, Nk) boolean matrix of a sliding window, aligned bottom-right like the causal mask:
    query i (at key position i + Nk - Nq) sees key j iff ``i + Nk - Nq - left <= j <= i + Nk - Nq + right``
    (a side of -1 is unbounded). ``causal`` sets ``right`` to 0 (or keeps a smaller one)."""
    (left, right), _ = _check_window_softcap(window, 0.0)
    nq, nk = _check_count("nq", nq, 0), _check_count("nk", nk, 0)
    _scale_and_causal(None, causal, 1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    rows = np.arange(nq)[:, None] + (nk - nq)
    cols = np.arange(nk)[None, :]
    vis = np.ones((nq, nk), dtype=bool)
    if left >= 0:
        vis &= cols >= rows - left
    if right >= 0:
        vis &= cols <= rows + right
    return vis


def _key_valid(key_valid, nk=None):
    """A key padding mask as a boolean array (..., nk), checked: True = a real key."""
    if not isinstance(key_valid, np.ndarray) or key_valid.dtype != np.bool_:
        raise TypeError(f"key_valid must be a boolean numpy.ndarray (True = a real key), got "
                        f"{type(key_valid).__name__}"
                        f"{' of dtype ' + str(key_valid.dtype) if isinstance(key_valid, np.ndarray) else ''}")
    if key_valid.ndim < 1 or (nk is not None and key_valid.shape != (nk,)):
        raise ValueError(f"key_valid must have shape {(nk,) if nk is not None else '(..., Nk)'}, "
                         f"got {key_valid.shape}")
    return key_valid


def key_padding_bounds(key_valid):
    """What the Triton kernels keep of a key padding mask (``KV_END``): for each row of ``key_valid``
    (..., Nk) booleans (True = a real key), ``kv_end``, one past its last real key (0 for a row with none),
    and ``lead``, the number of real keys before its first padded one (Nk for a row with none padded).
    Both int64 arrays of shape (...,). A right-padded row has ``lead == kv_end``. The kernels load no key
    from ``kv_end`` on and run unmasked only the whole key blocks below ``lead``."""
    key_valid = _key_valid(key_valid)
    nk = key_valid.shape[-1]
    kv_end = np.where(key_valid.any(-1), nk - np.argmax(key_valid[..., ::-1], axis=-1), 0)
    lead = np.where(key_valid.all(-1), nk, np.argmin(key_valid, axis=-1))
    return kv_end.astype(np.int64), lead.astype(np.int64)


def tile_classes(nq: int, nk: int, block_q: int, block_k: int, *, causal=False, window=(-1, -1),
                 key_valid=None) -> np.ndarray:
    """The tile-skipping rule: for each (query block, key block) tile, "empty" (no visible pair: the
    kernel never loads it), "full" (every pair visible: no mask needed) or "partial" (masked).
    A sliding window of width w leaves O(N w) visible pairs, so the non-empty tiles number O(N w / B_c).
    ``key_valid``: one batch row of a key padding mask, (nk,) booleans (True = a real key); a pair is
    visible only if its key is real too. Returns an object array (cdiv(nq, block_q), cdiv(nk, block_k))
    of those three strings."""
    block_q, block_k = _check_count("block_q", block_q, 1), _check_count("block_k", block_k, 1)
    vis = window_visible(nq, nk, window, causal)
    if key_valid is not None:
        vis = vis & _key_valid(key_valid, nk)[None, :]
    out = np.empty((-(-nq // block_q), -(-nk // block_k)), dtype=object)
    for i, r0 in enumerate(range(0, nq, block_q)):
        for j, c0 in enumerate(range(0, nk, block_k)):
            t = vis[r0:r0 + block_q, c0:c0 + block_k]
            out[i, j] = "empty" if not t.any() else ("full" if t.all() else "partial")
    return out


def _softcap(s, softcap):
    """``softcap * tanh(s / softcap)`` (Gemma 2 / Grok), and its derivative ``1 - tanh^2``; identity at 0."""
    if not softcap:
        return s, None
    t = np.tanh(s / s.dtype.type(softcap))
    return (s.dtype.type(softcap) * t).astype(s.dtype), (1 - t * t).astype(s.dtype)


def _check_attention_inputs(q, k, v, causal, softmax_scale, mask):
    """Validate (q, k, v, mask) and return (scale, mask) where mask is None or a read-only view of
    the user's mask broadcast to (..., Nq, Nk) in its last two axes (no copy). Causality is not
    folded in here: :func:`_tile_visibility` computes it per tile, so no Nq x Nk array is formed."""
    q = _check_array("q", q, 2)
    k = _check_array("k", k, 2)
    if v is None:  # scores only
        v = k
    v = _check_array("v", v, 2)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.ndim == k.ndim == v.ndim) or not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(
            "q, k and v must have the same leading dimensions: expected q (..., Nq, d), "
            f"k (..., Nk, d), v (..., Nk, dv); got {q.shape}, {k.shape}, {v.shape}"
        )
    nq, d = q.shape[-2:]
    nk = k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"k must have head dim {d} like q, got k.shape={k.shape}")
    if v.shape[-2] != nk:
        raise ValueError(f"v must have Nk={nk} rows like k, got v.shape={v.shape}")
    if nq == 0 or nk == 0 or d == 0 or v.shape[-1] == 0:
        raise ValueError(f"sequence lengths and head dims must be >= 1, got q {q.shape}, k {k.shape}, v {v.shape}")
    scale = _scale_and_causal(softmax_scale, causal, d)
    visible = None
    if mask is not None:
        if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_:
            raise TypeError(
                f"mask must be a boolean numpy.ndarray (True = visible), got "
                f"{type(mask).__name__}{'' if not isinstance(mask, np.ndarray) else ' of dtype ' + str(mask.dtype)}"
            )
        target = q.shape[:-1] + (nk,)
        try:
            np.broadcast_shapes(mask.shape, target)
        except ValueError:
            raise ValueError(f"mask of shape {mask.shape} is not broadcastable to (..., Nq, Nk) = {target}") from None
        if len(np.broadcast_shapes(mask.shape, target)) != len(target):
            raise ValueError(f"mask of shape {mask.shape} has more dimensions than (..., Nq, Nk) = {target}")
        lead = mask.shape[:-2] if mask.ndim >= 2 else ()
        visible = np.broadcast_to(mask, lead + (nq, nk))
    return scale, visible


def causal_mask(nq: int, nk: int) -> np.ndarray:
    """Bottom-right aligned causal mask, shape ``(nq, nk)``, ``True`` = visible.

    Query ``i`` sees key ``j`` iff ``j <= i + nk - nq`` (flash-attn 2.1+ convention): the last query
    is aligned with the last key. For ``nq == nk`` this is the usual lower triangle.
    """
    nq = _check_block("nq", nq)
    nk = _check_block("nk", nk)
    i = np.arange(nq)[:, None]  # (nq, 1)
    j = np.arange(nk)[None, :]  # (1, nk)
    return j <= i + (nk - nq)


# ----------------------------------------------------------------------------------------------
# Softmax: three passes, two passes, one pass per block, and the merge of partial states
# ----------------------------------------------------------------------------------------------
def safe_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically safe softmax along ``axis`` in three passes over the data.

    Pass 1: ``m = max(x)``. Pass 2: ``l = sum(exp(x - m))``. Pass 3: ``y = exp(x - m) / l``.
    Subtracting ``m`` changes nothing mathematically and keeps every exponent <= 0, so nothing
    overflows. A slice that is entirely ``-inf`` (fully masked) gives zeros, not NaN.
    """
    x = _check_array("x", x)
    m = np.max(x, axis=axis, keepdims=True)  # pass 1
    m = np.where(np.isneginf(m), 0.0, m).astype(x.dtype)
    e = np.exp(x - m)
    l = np.sum(e, axis=axis, keepdims=True)  # pass 2
    return e / np.where(l == 0, 1.0, l).astype(x.dtype)  # pass 3


@dataclass(frozen=True)
class NormalizerStep:
    """One step of :func:`online_normalizer` (a row of the book's ledger table).

    ``values``: the block read at this step, shape (..., block_size); ``m_block``: its maximum;
    ``m``: the running maximum after the step; ``scale``: ``exp(m_old - m)``, the factor applied
    to the old running sum (0 at the first step, where ``m_old = -inf``); ``l``: the running sum
    ``sum exp(x_j - m)`` over everything read so far.
    """

    step: int
    values: np.ndarray
    m_block: np.ndarray
    m: np.ndarray
    scale: np.ndarray
    l: np.ndarray


def _exp_shift(x, m):
    """``exp(x - m)`` with ``-inf - (-inf)`` read as ``exp(-inf) = 0`` instead of NaN."""
    m_safe = np.where(np.isneginf(m), 0.0, m).astype(np.result_type(x, m))
    return np.exp(x - m_safe)


def softmax_state(s: np.ndarray, v: Optional[np.ndarray] = None):
    """The partial softmax state of one block of scores, along the last axis.

    ``s``: scores (..., n). Returns ``(m, l)`` with ``m = max_j s_j`` and ``l = sum_j exp(s_j - m)``,
    both (...,); with ``v`` (..., n, dv) (leading dims broadcast against s's, so one value block
    (n, dv) can serve every row of a score tile) it returns ``(m, l, acc)`` where
    ``acc = sum_j exp(s_j - m) v_j`` is the un-normalised output, (..., dv).
    A block whose scores are all ``-inf`` gives ``(-inf, 0, 0)``, the identity of :func:`merge_states`.
    """
    s = _check_array("s", s)
    m = np.max(s, axis=-1)  # (...,)
    p = _exp_shift(s, m[..., None])  # (..., n)
    l = np.sum(p, axis=-1)
    if v is None:
        return m, l
    v = _check_array("v", v, 2)
    if v.dtype != s.dtype:
        raise TypeError(f"v must have dtype {s.dtype} like s, got {v.dtype}")
    try:
        ok = v.shape[-2] == s.shape[-1] and np.broadcast_shapes(v.shape[:-2], s.shape[:-1]) is not None
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"v must have shape (..., n, dv) with n = {s.shape[-1]} and leading dims broadcastable "
                         f"to {s.shape[:-1]}, got {v.shape}")
    acc = np.einsum("...n,...nd->...d", p, v)  # (..., dv)
    return m, l, acc


def merge_states(a, b):
    """Merge two partial softmax states exactly: ``(m_a, l_a[, acc_a]) + (m_b, l_b[, acc_b])``.

    ``m = max(m_a, m_b)``, ``l = l_a e^{m_a - m} + l_b e^{m_b - m}`` and likewise
    ``acc = acc_a e^{m_a - m} + acc_b e^{m_b - m}``. The result is the state of the concatenated
    blocks, whatever the split; the merge is associative and commutative (the book proves it with
    sympy), which is what lets FlashAttention tile the key axis and Ring Attention split it across
    devices. ``(-inf, 0, 0)`` is the identity (an empty or fully masked block).
    """
    if len(a) != len(b) or len(a) not in (2, 3):
        raise ValueError("a and b must both be (m, l) or both be (m, l, acc)")
    for name, state in (("a", a), ("b", b)):
        m_x, l_x = np.shape(state[0]), np.shape(state[1])
        if m_x != l_x or (len(state) == 3 and np.shape(state[2])[:-1] != m_x):
            raise ValueError(
                f"{name} must be (m, l[, acc]) with m and l of one shape (...,) and acc (..., dv); "
                f"got shapes {[np.shape(x) for x in state]}"
            )
    m_a, m_b = np.asarray(a[0]), np.asarray(b[0])
    m = np.maximum(m_a, m_b)
    alpha = _exp_shift(m_a, m)  # rescale factor of the old state; 0 when m_a = -inf
    beta = _exp_shift(m_b, m)
    l = a[1] * alpha + b[1] * beta
    if len(a) == 2:
        return m, l
    acc = a[2] * alpha[..., None] + b[2] * beta[..., None]
    return m, l, acc


def online_normalizer(x: np.ndarray, *, block_size: int = 1, trace: Optional[list] = None):
    """One pass over the last axis of ``x`` that keeps the running max ``m`` and the rescaled sum ``l``.

    ``x``: (..., n). Reads ``block_size`` elements at a time (1 reproduces Milakov & Gimelshein's
    element-wise recurrence ``l <- l e^{m_old - m} + e^{x_i - m}``) and merges each block's state
    with :func:`merge_states`. Returns ``(m, l)``, each (...,), equal to ``max(x)`` and
    ``sum(exp(x - max(x)))``. If ``trace`` is a list, one :class:`NormalizerStep` per block is
    appended to it.
    """
    x = _check_array("x", x)
    block_size = _check_block("block_size", block_size)
    n = x.shape[-1]
    state = (np.full(x.shape[:-1], -np.inf, x.dtype), np.zeros(x.shape[:-1], x.dtype))
    for step, start in enumerate(range(0, n, block_size)):
        block = x[..., start : start + block_size]
        m_old = state[0]
        block_state = softmax_state(block)
        state = merge_states(state, block_state)
        if trace is not None:
            trace.append(
                NormalizerStep(
                    step=step,
                    values=block.copy(),
                    m_block=block_state[0],
                    m=state[0],
                    scale=_exp_shift(m_old, state[0]),
                    l=state[1],
                )
            )
    return state


def online_softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis in two passes: the one-pass :func:`online_normalizer` for
    ``(m, l)``, then ``y = exp(x - m) / l``. Equal to :func:`safe_softmax` (fully masked rows give 0)."""
    m, l = online_normalizer(x)
    return _exp_shift(x, m[..., None]) / np.where(l == 0, 1.0, l)[..., None].astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# Standard attention: materialises S and P
# ----------------------------------------------------------------------------------------------
def attention_scores(q, k, *, causal=False, softmax_scale=None, mask=None, window=(-1, -1), softcap=0.0,
                     sinks=None):
    """``S = q kᵀ · scale`` with hidden positions set to ``-inf``, and ``P = softmax(S)`` row-wise.

    Returns ``(s, p)``, each (..., Nq, Nk): the two N×N arrays that standard attention stores and
    FlashAttention never forms. A row with no visible key has ``p = 0``. ``window = (left, right)``: a
    sliding window aligned like the causal mask (:func:`window_visible`); ``softcap > 0``: the scores
    become ``softcap * tanh(S / softcap)`` before the mask and the softmax. ``sinks``: one logit per head
    (:func:`_check_sinks`) that joins each row's softmax as a key with no value: ``p`` is then
    ``exp(S - LSE)`` with ``LSE = log(sum_j exp(S_ij) + exp(sink))``, and a row's ``p`` sums to less than 1.
    """
    scale, mask = _check_attention_inputs(q, k, None, causal, softmax_scale, mask)
    window, softcap = _check_window_softcap(window, softcap)
    sinks = _check_sinks(sinks, q)
    nq, nk = q.shape[-2], k.shape[-2]
    s, _ = _softcap((q @ np.swapaxes(k, -1, -2)) * q.dtype.type(scale), softcap)  # (..., Nq, Nk)
    visible = _tile_visibility(mask, causal, q.shape[:-2], nq, nk, 0, nq, 0, nk, window)
    if visible is not None:
        s = np.where(visible, s, -np.inf).astype(q.dtype)
    if sinks is None:
        return s, safe_softmax(s)
    # the sink as one more column of scores, then dropped: it takes its share of each row's softmax
    with_sink = np.concatenate([s, np.broadcast_to(sinks[:, None], s.shape[:-1] + (1,))], axis=-1)
    return s, safe_softmax(with_sink)[..., :nk]


def _check_sinks(sinks, q):
    """``sinks`` as a (heads, 1) array of q's dtype, or None: a 1-D float array with one logit per head of q
    (..., heads, Nq, d), each finite or ``-inf`` (no sink for that head)."""
    if sinks is None:
        return None
    sinks = _check_array("sinks", sinks)
    if sinks.ndim != 1 or q.ndim < 3 or sinks.shape[0] != q.shape[-3]:
        raise ValueError(f"sinks must have shape (heads,) = ({q.shape[-3] if q.ndim >= 3 else '?'},) for q of "
                         f"shape (..., heads, Nq, d) = {q.shape}, got {sinks.shape}")
    if np.isnan(sinks).any() or np.isposinf(sinks).any():
        raise ValueError("sinks must be finite or -inf (no sink), got NaN or +inf")
    return sinks.astype(q.dtype)[:, None]


def apply_sinks(o, lse, sinks):
    """Attention with sinks from attention without them: ``(o', lse')`` from the output ``o`` (..., heads, Nq,
    dv) and LSE (..., heads, Nq) of the same attention computed without sinks, and ``sinks`` (heads,).

    A sink is a key with logit ``sink`` and value 0, so it adds ``exp(sink)`` to each row's denominator and
    nothing to its numerator: ``lse' = log(exp(lse) + exp(sink))`` and ``o' = o · exp(lse - lse')``, the
    factor being ``sigmoid(lse - sink)``. Exact: the kernels' output and LSE, rescaled."""
    sinks = _check_sinks(sinks, o)
    if sinks is None:
        return o, lse
    lse_new = np.logaddexp(lse, sinks)
    factor = np.where(np.isneginf(lse_new), 0.0, _exp_shift(lse, lse_new))
    return (o * factor[..., None]).astype(o.dtype), lse_new.astype(lse.dtype)


# FP8 (e4m3): 4 exponent bits (bias 7), 3 mantissa bits, no infinity, largest 448, smallest normal 2^-6 and
# subnormals in steps of 2^-9. Rounding to nearest (ties to even) has a relative error of at most 2^-4 for a
# normal number and an absolute error of at most 2^-10 below 2^-6.
E4M3_MAX = 448.0
E4M3_UNIT = 2.0 ** -4  # the largest relative rounding error of a normal e4m3 number
E4M3_SUBNORMAL_ERROR = 2.0 ** -10  # the largest absolute rounding error below the smallest normal, 2^-6


def round_e4m3(x):
    """``x`` rounded to the nearest e4m3 number (ties to even), saturated at ±448, as float64 (NaN stays NaN)."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), E4M3_MAX)
    exponent = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    step = 2.0 ** (np.maximum(exponent, -6.0) - 3.0)  # the spacing of e4m3 numbers around a
    return np.sign(x) * np.minimum(np.round(a / step) * step, E4M3_MAX)  # np.round: half to even


def quantize_e4m3(x, axis=None):
    """``(x8, descale)``: ``x`` scaled so that its largest magnitude maps to 448, rounded to e4m3, and the float
    descale that undoes the scaling, ``x ≈ x8 * descale`` (FlashAttention-3's ``q_descale`` etc.). ``axis=None``:
    one scale for the whole array (per tensor); else the axes from ``axis`` on share one (``axis=-2`` on a
    (B, H, N, d) array: per head, descales of shape (B, H, 1, 1))."""
    x = _check_array("x", x)
    if not np.isfinite(x).all():
        raise ValueError("x must be finite to be quantized (its largest magnitude sets the scale)")
    if axis is not None and (isinstance(axis, bool) or not isinstance(axis, numbers.Integral)
                             or not -x.ndim <= axis < x.ndim):
        raise ValueError(f"axis must be None or an int in [-{x.ndim}, {x.ndim}) for x of shape {x.shape}, got {axis!r}")
    x = x.astype(np.float64)
    axes = None if axis is None else tuple(range(axis % x.ndim, x.ndim))
    amax = np.max(np.abs(x), axis=axes, keepdims=axis is not None)
    descale = np.where(amax > 0, amax / E4M3_MAX, 1.0)
    return round_e4m3(x / descale), descale


def _dequantize(q8, k8, v8, q_descale, k_descale, v_descale):
    """(q, k, v) in float64 from e4m3 arrays and their descales (positive finite scalars or broadcasting arrays)."""
    out = []
    for name, x8, descale in (("q8", q8, q_descale), ("k8", k8, k_descale), ("v8", v8, v_descale)):
        x8 = _check_array(name, x8, 2)
        d = np.asarray(descale, dtype=np.float64) if isinstance(descale, (numbers.Real, np.ndarray)) else None
        if d is None or not (np.isfinite(d).all() and (d > 0).all()):
            raise ValueError(f"{name[0]}_descale must be a positive finite number or array, got {descale!r}")
        out.append(x8.astype(np.float64) * d)
    return out


def fp8_attention(q8, k8, v8, q_descale, k_descale, v_descale, *, causal=False, softmax_scale=None,
                  quantize_p=False):
    """Attention of e4m3 inputs (values on the e4m3 grid, as float arrays; see :func:`quantize_e4m3`) with their
    descales (scalars or arrays that broadcast, e.g. per head): ``(o, lse)`` in float64.

    ``quantize_p=False``: the reference, exact attention of the dequantized inputs ``q8 * q_descale`` etc.
    ``quantize_p=True``: what an FP8 kernel computes when it rounds the probabilities to e4m3 for the P @ V
    product, as the hardware's FP8 matrix multiply needs (FlashAttention-3): with ``m`` the row maximum, each
    ``exp(s - m)`` in [0, 1] is rounded to e4m3, multiplied with V, and divided by the unrounded row sum.
    :func:`fp8_error_bound` bounds the difference between the two."""
    q, k, v = _dequantize(q8, k8, v8, q_descale, k_descale, v_descale)
    s, _ = attention_scores(q, k, causal=causal, softmax_scale=softmax_scale)
    m = np.max(s, axis=-1, keepdims=True)
    e = _exp_shift(s, m)
    l = e.sum(axis=-1, keepdims=True)
    lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)), -np.inf)
    e_used = round_e4m3(e) if quantize_p else e
    return (e_used @ v) / np.where(l > 0, l, 1.0), lse


def fp8_error_bound(q8, k8, v8, q_descale, k_descale, v_descale, *, causal=False, softmax_scale=None,
                    out_unit=2.0 ** -8):
    """The largest error an FP8 forward may make against :func:`fp8_attention`'s reference, per output element,
    derived from e4m3's rounding of P: each ``exp(s - m)`` in [0, 1] moves by at most ``max(2^-4 · p, 2^-10)``, so
    ``|o - o_ref| <= sum_j max(2^-4 e_j, 2^-10) |v_j| / l``, plus the rounding of the output to its dtype,
    ``out_unit · |o_ref|`` (bfloat16: 2^-8), plus 1e-6 · max|v| for float32 accumulation. Returns an array of o's
    shape."""
    q, k, v = _dequantize(q8, k8, v8, q_descale, k_descale, v_descale)
    s, _ = attention_scores(q, k, causal=causal, softmax_scale=softmax_scale)
    e = _exp_shift(s, np.max(s, axis=-1, keepdims=True))
    l = e.sum(axis=-1, keepdims=True)
    visible = e > 0
    per_key = np.where(visible, np.maximum(E4M3_UNIT * e, E4M3_SUBNORMAL_ERROR), 0.0)
    o_ref = (e @ v) / np.where(l > 0, l, 1.0)
    bound = (per_key @ np.abs(v)) / np.where(l > 0, l, 1.0)
    return bound + out_unit * np.abs(o_ref) + 1e-6 * np.max(np.abs(v))


def naive_attention(q, k, v, *, causal=False, softmax_scale=None, mask=None, window=(-1, -1), softcap=0.0,
                    sinks=None):
    """Standard attention ``O = softmax(q kᵀ · scale) v``, materialising S and P.

    Shapes: q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv) -> o (..., Nq, dv), lse (..., Nq).
    ``lse = log sum_j exp(S_ij)`` over the visible keys (``-inf`` for a row with none).
    ``sinks`` (heads,): attention sinks as gpt-oss uses them, one logit per head (q (..., heads, Nq, d))
    that joins every row's softmax denominator (:func:`attention_scores`); the LSE includes it.
    Memory: O(Nq·Nk) per head, the quantity FlashAttention removes.
    """
    _check_attention_inputs(q, k, v, causal, softmax_scale, mask)
    s, p = attention_scores(q, k, causal=causal, softmax_scale=softmax_scale, mask=mask, window=window,
                            softcap=softcap, sinks=sinks)
    if sinks is not None:
        s = np.concatenate([s, np.broadcast_to(_check_sinks(sinks, q)[:, None], s.shape[:-1] + (1,))], axis=-1)
    m = np.max(s, axis=-1)  # (..., Nq)
    l = np.sum(_exp_shift(s, m[..., None]), axis=-1)
    lse = np.where(l > 0, m + np.log(np.where(l > 0, l, 1.0)), -np.inf).astype(q.dtype)
    return p @ v, lse


def naive_attention_backward(q, k, v, do, *, causal=False, softmax_scale=None, mask=None, window=(-1, -1),
                             softcap=0.0, sinks=None):
    """Explicit backward of :func:`naive_attention`, using the stored P (an N×N array).

    Shapes: q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv), do = dL/dO (..., Nq, dv)
    -> (dq, dk, dv) with the shapes of (q, k, v). The five formulas of the book::

        dV = Pᵀ dO                      # matrix-product rule on O = P V
        dP = dO Vᵀ
        dS = P ⊙ (dP − rowsum(dP ⊙ P))  # softmax Jacobian, row by row
        dQ = dS K · scale               # matrix-product rule on S = Q Kᵀ · scale
        dK = dSᵀ Q · scale

    With ``softcap`` the scores are ``c tanh(S_raw / c)``, and dS is multiplied by ``1 - tanh^2`` before
    the two products (the chain rule through the cap).

    With ``sinks`` (heads,) P is normalised with the sink in the denominator and a fourth array is returned,
    ``dsinks`` (heads,): the sink is a score column with value 0, so its ``dP`` is 0 and its ``dS`` is
    ``-p_sink · rowsum(dP ⊙ P)``, summed over every row of the head.
    """
    scale, _ = _check_attention_inputs(q, k, v, causal, softmax_scale, mask)
    window, softcap = _check_window_softcap(window, softcap)
    do = _check_array("do", do, 2)
    expected = q.shape[:-1] + (v.shape[-1],)
    if do.shape != expected:
        raise ValueError(f"do must have the shape of the output {expected}, got {do.shape}")
    if do.dtype != q.dtype:
        raise TypeError(f"do must have dtype {q.dtype} like q, got {do.dtype}")
    s, p = attention_scores(q, k, causal=causal, softmax_scale=softmax_scale, mask=mask, window=window,
                            softcap=softcap, sinks=sinks)
    s_t = q.dtype.type(scale)
    dv = np.swapaxes(p, -1, -2) @ do  # (..., Nk, dv)
    dp = do @ np.swapaxes(v, -1, -2)  # (..., Nq, Nk)
    delta = np.sum(dp * p, axis=-1, keepdims=True)  # (..., Nq, 1): D = rowsum(dO ⊙ O)
    ds = p * (dp - delta)  # (..., Nq, Nk)
    if softcap:
        ds = ds * _softcap((q @ np.swapaxes(k, -1, -2)) * s_t, softcap)[1]
    dq = (ds @ k) * s_t  # (..., Nq, d)
    dk = (np.swapaxes(ds, -1, -2) @ q) * s_t  # (..., Nk, d)
    if sinks is None:
        return dq, dk, dv
    _, lse = naive_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, mask=mask, window=window,
                             softcap=softcap, sinks=sinks)
    p_sink = _exp_shift(_check_sinks(sinks, q), lse)  # (..., heads, Nq): the sink's probability in each row
    ds_sink = -p_sink * delta[..., 0]
    dsinks = ds_sink.reshape(-1, ds_sink.shape[-2], ds_sink.shape[-1]).sum(axis=(0, 2))
    return dq, dk, dv, dsinks.astype(q.dtype)


# ----------------------------------------------------------------------------------------------
# FlashAttention: tiled forward and backward, never more than one block_q x block_k tile of scores
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForwardStep:
    """One tile of :func:`flash_forward` (a row of the book's block ledger).

    ``i``, ``j``: query-block and key-block indices; ``rows``, ``cols``: their index ranges.
    Arrays cover the block's query rows, with the leading dimensions of q:
    ``m_tile`` (..., rows) the row maximum of this tile's visible scores; ``m`` the running maximum
    after it; ``alpha = exp(m_old - m)`` the factor applied to the old ``l`` and ``acc``; ``l`` the
    running sum; ``acc`` (..., rows, dv) the un-normalised output; ``o = acc / l`` the output of the
    keys read so far (the prefix output), 0 for rows that have seen no visible key yet.
    """

    i: int
    j: int
    rows: range
    cols: range
    m_tile: np.ndarray
    m: np.ndarray
    alpha: np.ndarray
    l: np.ndarray
    acc: np.ndarray
    o: np.ndarray


@dataclass(frozen=True)
class BackwardStep:
    """One tile of :func:`flash_backward`.

    ``p`` (..., rows, cols) the probabilities recomputed as ``exp(S - LSE)``; ``visible`` the tile's
    mask (None when every pair is visible); ``dp = dO Vᵀ`` and ``ds = P ⊙ (dP − D)`` on the tile;
    ``dk``, ``dv`` the running sums of the key block's gradients after this tile.
    """

    i: int
    j: int
    rows: range
    cols: range
    visible: Optional[np.ndarray]
    p: np.ndarray
    dp: np.ndarray
    ds: np.ndarray
    dk: np.ndarray
    dv: np.ndarray


def _tile_visibility(mask, causal, lead_shape, nq, nk, r0, r1, c0, c1, window=(-1, -1)):
    """The visible-mask of the tile rows [r0, r1) x cols [c0, c1), shape (..., r1-r0, c1-c0), or None
    when every pair in it is visible. The causal part is computed for the tile alone (bottom-right:
    key j is visible to query i iff j <= i + nk - nq), never for the whole Nq x Nk grid."""
    vis = None
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    off = nk - nq
    cut_right = right >= 0 and c1 - 1 > r0 + off + right  # some pair lies right of the window / diagonal
    cut_left = left >= 0 and c0 < r1 - 1 + off - left  # some pair lies left of the window
    if cut_right or cut_left:
        rows = np.arange(r0, r1)[:, None] + off
        cols = np.arange(c0, c1)[None, :]
        vis = np.ones((r1 - r0, c1 - c0), dtype=bool)
        if cut_right:
            vis &= cols <= rows + right
        if cut_left:
            vis &= cols >= rows - left
    if mask is not None:
        tile = mask[..., r0:r1, c0:c1]
        vis = tile if vis is None else (tile & vis)
    if vis is None:
        return None
    return np.broadcast_to(vis, lead_shape + (r1 - r0, c1 - c0))


def flash_forward(
    q, k, v, *, causal=False, softmax_scale=None, mask=None, block_q=64, block_k=64, trace=None,
    window=(-1, -1), softcap=0.0,
):
    """Tiled attention forward (FlashAttention-2 order): online softmax, division deferred to the end.

    Shapes: q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv) -> o (..., Nq, dv), lse (..., Nq).
    The outer loop walks query blocks of ``block_q`` rows, the inner loop key blocks of ``block_k``
    columns (any sizes: the last block may be partial). Per query block it keeps only
    ``m`` (running max), ``l`` (running sum) and ``acc`` (un-normalised output); the score tile
    ``S_ij`` is the only block_q x block_k array alive at any time. Tiles with no visible pair
    (above the causal diagonal, or fully masked) are skipped. At the end ``o = acc / l`` and
    ``lse = m + log(l)``. If ``trace`` is a list, one :class:`ForwardStep` per computed tile is
    appended. ``window`` and ``softcap``: as in :func:`attention_scores`; tiles outside the window are
    skipped like those above the causal diagonal (:func:`tile_classes`).
    """
    scale, mask = _check_attention_inputs(q, k, v, causal, softmax_scale, mask)
    window, softcap = _check_window_softcap(window, softcap)
    block_q = _check_block("block_q", block_q)
    block_k = _check_block("block_k", block_k)
    dtype = q.dtype
    lead, nq, nk, dv_dim = q.shape[:-2], q.shape[-2], k.shape[-2], v.shape[-1]
    s_t = dtype.type(scale)
    o = np.zeros(lead + (nq, dv_dim), dtype)
    lse = np.full(lead + (nq,), -np.inf, dtype)
    for i, r0 in enumerate(range(0, nq, block_q)):
        r1 = min(r0 + block_q, nq)
        q_i = q[..., r0:r1, :] * s_t  # (..., br, d): fold the scale into Q once
        m_i = np.full(lead + (r1 - r0,), -np.inf, dtype)  # running max
        l_i = np.zeros(lead + (r1 - r0,), dtype)  # running sum of exp(s - m)
        acc = np.zeros(lead + (r1 - r0, dv_dim), dtype)  # un-normalised output
        for j, c0 in enumerate(range(0, nk, block_k)):
            c1 = min(c0 + block_k, nk)
            vis = _tile_visibility(mask, causal, lead, nq, nk, r0, r1, c0, c1, window)
            if vis is not None and not vis.any():
                continue  # nothing visible in this tile: no work, as in the kernel
            s_ij, _ = _softcap(q_i @ np.swapaxes(k[..., c0:c1, :], -1, -2), softcap)  # (..., br, bc)
            if vis is not None:
                s_ij = np.where(vis, s_ij, -np.inf).astype(dtype)
            m_tile = np.max(s_ij, axis=-1)
            m_new = np.maximum(m_i, m_tile)
            p_ij = _exp_shift(s_ij, m_new[..., None])  # (..., br, bc), entries in [0, 1]
            alpha = _exp_shift(m_i, m_new)  # rescale of the old state; 0 on the first visible tile
            l_i = alpha * l_i + np.sum(p_ij, axis=-1)
            acc = alpha[..., None] * acc + p_ij @ v[..., c0:c1, :]
            m_i = m_new
            if trace is not None:
                trace.append(
                    ForwardStep(
                        i=i, j=j, rows=range(r0, r1), cols=range(c0, c1),
                        m_tile=m_tile, m=m_i.copy(), alpha=alpha, l=l_i.copy(), acc=acc.copy(),
                        o=acc / np.where(l_i > 0, l_i, 1.0)[..., None].astype(dtype),
                    )
                )
        seen = l_i > 0
        o[..., r0:r1, :] = acc / np.where(seen, l_i, 1.0)[..., None].astype(dtype)
        lse[..., r0:r1] = np.where(seen, m_i + np.log(np.where(seen, l_i, 1.0)), -np.inf)
    return o, lse


def flash_backward(
    q, k, v, o, lse, do, *, causal=False, softmax_scale=None, mask=None, block_q=64, block_k=64, trace=None,
    window=(-1, -1), softcap=0.0,
):
    """Tiled attention backward with recomputation (FlashAttention-2, Algorithm 2 order).

    Shapes: q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv), o and do (..., Nq, dv), lse (..., Nq)
    -> (dq, dk, dv) shaped like (q, k, v). Only O and the LSE come from the forward; no N×N array
    is formed. First ``D = rowsum(dO ⊙ O)`` (equal to ``rowsum(dP ⊙ P)``). Then the outer loop walks
    key blocks, keeping ``dK_j`` and ``dV_j`` as accumulators, and the inner loop walks query blocks:
    ``P_ij = exp(S_ij − LSE_i)`` (already normalised), ``dV_j += P_ijᵀ dO_i``,
    ``dP_ij = dO_i V_jᵀ``, ``dS_ij = P_ij ⊙ (dP_ij − D_i)``, ``dQ_i += dS_ij K_j · scale``,
    ``dK_j += dS_ijᵀ Q_i · scale``. Rows with LSE ``-inf`` (no visible key) get zero gradients.
    If ``trace`` is a list, one :class:`BackwardStep` per computed tile is appended. ``window``,
    ``softcap``: as in :func:`flash_forward` (the cap's derivative ``1 - tanh^2`` multiplies dS).
    """
    scale, mask = _check_attention_inputs(q, k, v, causal, softmax_scale, mask)
    window, softcap = _check_window_softcap(window, softcap)
    block_q = _check_block("block_q", block_q)
    block_k = _check_block("block_k", block_k)
    dtype = q.dtype
    lead, nq, nk = q.shape[:-2], q.shape[-2], k.shape[-2]
    out_shape = lead + (nq, v.shape[-1])
    for name, x in (("o", o), ("do", do)):
        _check_array(name, x, 2)
        if x.shape != out_shape:
            raise ValueError(f"{name} must have the shape of the output {out_shape}, got {x.shape}")
        if x.dtype != dtype:
            raise TypeError(f"{name} must have dtype {dtype} like q, got {x.dtype}")
    _check_array("lse", lse, 1)
    if lse.shape != lead + (nq,):
        raise ValueError(f"lse must have shape (..., Nq) = {lead + (nq,)}, got {lse.shape}")
    s_t = dtype.type(scale)
    delta = np.sum(do * o, axis=-1)  # D = rowsum(dO ⊙ O), (..., Nq)
    lse_safe = np.where(np.isneginf(lse), np.inf, lse).astype(dtype)  # exp(s - inf) = 0 on empty rows
    dq = np.zeros(q.shape, dtype)
    dk = np.zeros(k.shape, dtype)
    dv = np.zeros(v.shape, dtype)
    for j, c0 in enumerate(range(0, nk, block_k)):
        c1 = min(c0 + block_k, nk)
        k_j, v_j = k[..., c0:c1, :], v[..., c0:c1, :]
        dk_j = np.zeros(k_j.shape, dtype)  # accumulators of this key block
        dv_j = np.zeros(v_j.shape, dtype)
        for i, r0 in enumerate(range(0, nq, block_q)):
            r1 = min(r0 + block_q, nq)
            vis = _tile_visibility(mask, causal, lead, nq, nk, r0, r1, c0, c1, window)
            if vis is not None and not vis.any():
                continue
            q_i, do_i = q[..., r0:r1, :], do[..., r0:r1, :]
            s_ij, dcap = _softcap((q_i @ np.swapaxes(k_j, -1, -2)) * s_t, softcap)  # recompute the scores
            if vis is not None:
                s_ij = np.where(vis, s_ij, -np.inf).astype(dtype)
            p_ij = np.exp(s_ij - lse_safe[..., r0:r1, None])  # normalised P, no division needed
            dv_j += np.swapaxes(p_ij, -1, -2) @ do_i
            dp_ij = do_i @ np.swapaxes(v_j, -1, -2)
            ds_ij = p_ij * (dp_ij - delta[..., r0:r1, None])
            if dcap is not None:
                ds_ij = ds_ij * dcap  # through the cap: d(c tanh(x/c))/dx = 1 - tanh^2
            dq[..., r0:r1, :] += (ds_ij @ k_j) * s_t
            dk_j += (np.swapaxes(ds_ij, -1, -2) @ q_i) * s_t
            if trace is not None:
                trace.append(
                    BackwardStep(
                        i=i, j=j, rows=range(r0, r1), cols=range(c0, c1), visible=vis,
                        p=p_ij, dp=dp_ij, ds=ds_ij, dk=dk_j.copy(), dv=dv_j.copy(),
                    )
                )
        dk[..., c0:c1, :] = dk_j
        dv[..., c0:c1, :] = dv_j
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Decoding with a KV cache: split-KV and the exact merge (the book's chapter on decoding).
# ----------------------------------------------------------------------------------------------
def split_bounds(n: int, num_splits: int, block: int = 1) -> list:
    """The key ranges ``[(lo, hi), ...]`` of a split-KV pass over ``n`` keys: ``num_splits`` chunks of
    ``ceil(ceil(n / num_splits) / block) * block`` keys each (whole blocks), the last ones possibly
    short or empty. fa_lib's decoding kernel cuts each sequence's keys exactly this way."""
    num_splits = _check_block("num_splits", num_splits)
    block = _check_block("block", block)
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    chunk = -(-(-(-n // num_splits)) // block) * block
    return [(min(s * chunk, n), min((s + 1) * chunk, n)) for s in range(num_splits)]


def kvcache_attention(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, causal=True,
                      softmax_scale=None, num_splits=1, block=1, trace: Optional[list] = None, block_table=None,
                      window=(-1, -1), softcap=0.0, cache_batch_idx=None, cache_leftpad=None):
    """Attention of a few new queries over a KV cache, computed split-KV and merged exactly.

    ``q`` (B, H_q, N_q, d); ``k_cache``, ``v_cache`` (B, H_kv, N_max, d) with H_q a multiple of H_kv
    (grouped-query attention: query head h reads cache head h // (H_q / H_kv)); ``cache_seqlens`` (B,)
    integers, the number of valid keys of each sequence. ``k``, ``v`` (B, H_kv, N_new, d), optional:
    written into the caches **in place** at positions ``cache_seqlens[b] ..`` first, so that sequence b
    then has ``L_b = cache_seqlens[b] + N_new`` valid keys. With ``causal`` the alignment is bottom-right
    over the valid keys: query i sees key j iff ``j <= i + L_b - N_q``; a query that sees no key gets
    o = 0 and LSE = -inf.

    The keys of each sequence are cut by :func:`split_bounds` (``num_splits`` chunks of whole blocks of
    ``block`` keys); each chunk gives a partial state ``(m, l, acc)`` (:func:`softmax_state`) and the
    chunks are combined with :func:`merge_states`, as fa_lib's split-KV kernel and its combine kernel do.
    Returns ``(o, lse)``: (B, H_q, N_q, d) and (B, H_q, N_q). ``trace``, if a list, receives one dict per
    (sequence, chunk) with the chunk's bounds and its partial ``(m, l)``.

    ``window = (left, right)`` and ``softcap``: as in :func:`naive_attention`, aligned bottom-right over the
    valid keys (:func:`window_visible`): query i sees key j iff ``L_b - N_q + i - left <= j <= L_b - N_q + i +
    right``. With a left edge the keys before ``L_b - N_q - left`` are seen by no query, so only the keys from
    there (rounded down to a whole block) are cut into the ``num_splits`` chunks.

    ``block_table`` (B, W) integers, optional: a paged cache. ``k_cache``, ``v_cache`` are then a pool of
    pages (P_total, H_kv, P, d), and key j of sequence b lies in page ``block_table[b, j // P]`` at row
    ``j % P`` (:func:`paged_view` gathers it), so a sequence holds up to N_max = W * P keys; the append
    writes into those pages. Pages may be shared between sequences (a common prefix stored once).

    ``cache_batch_idx`` (B,) integers, optional: sequence b's cache is row ``cache_batch_idx[b]`` of ``k_cache``,
    ``v_cache`` (B_cache, H_kv, N_max, d), which may hold more rows than the batch (a server's slots); the append
    writes into that row. Not with ``block_table``.

    ``cache_leftpad`` (B,) integers, optional: sequence b's keys start at cache position ``cache_leftpad[b]``
    instead of 0 (a left-padded batch), so its valid keys are positions ``cache_leftpad[b] .. L_b - 1``. The masks
    are aligned bottom-right over those ``L_b - cache_leftpad[b]`` keys; the append still writes at
    ``cache_seqlens[b]``. ``0 <= cache_leftpad[b] <= cache_seqlens[b]``. Not with ``block_table``.
    """
    q = _check_array("q", q, 4)
    k_cache = _check_array("k_cache", k_cache, 4)
    v_cache = _check_array("v_cache", v_cache, 4)
    if q.ndim != 4 or k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q must be (B, H_q, N_q, d) and k_cache, v_cache one shape (B, H_kv, N_max, d); got "
                         f"{q.shape}, {k_cache.shape}, {v_cache.shape}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    B, H_q, N_q, d = q.shape
    H_kv, N_max = k_cache.shape[1], k_cache.shape[2]
    if block_table is not None and (cache_batch_idx is not None or cache_leftpad is not None):
        raise ValueError("block_table cannot be combined with cache_batch_idx or cache_leftpad: a block table "
                         "already says where each sequence's keys lie")
    rows = np.arange(B)  # the cache row of each sequence
    if cache_batch_idx is not None:
        rows = np.asarray(cache_batch_idx)
        if rows.shape != (B,) or not np.issubdtype(rows.dtype, np.integer) or np.any(rows < 0) \
                or np.any(rows >= k_cache.shape[0]):
            raise ValueError(f"cache_batch_idx must be integers of shape ({B},) in [0, k_cache.shape[0] = "
                             f"{k_cache.shape[0]}), got {rows.dtype} {rows.tolist()}")
    if block_table is not None:
        table = np.asarray(block_table)
        if table.ndim != 2 or table.shape[0] != B or not np.issubdtype(table.dtype, np.integer):
            raise ValueError(f"block_table must be integers of shape (B={B}, pages per sequence), got "
                             f"{table.dtype} {table.shape}")
        N_max = table.shape[1] * k_cache.shape[2]  # W pages of P keys
    elif k_cache.shape[0] != B and cache_batch_idx is None:
        raise ValueError(f"k_cache must be (B={B}, H_kv, N_max, d={d}), got {k_cache.shape}")
    if k_cache.shape[3] != d or H_kv < 1 or H_q % H_kv:
        raise ValueError(f"k_cache must be (B={B}, H_kv, N_max, d={d}) (or a pool of pages (P_total, H_kv, P, "
                         f"d={d})) with H_q={H_q} a multiple of H_kv, got {k_cache.shape}")
    lens = np.asarray(cache_seqlens)
    if lens.shape != (B,) or not np.issubdtype(lens.dtype, np.integer):
        raise ValueError(f"cache_seqlens must be integers of shape ({B},), got {lens.dtype} {lens.shape}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and their values) or both be None")
    n_new = 0
    if k is not None:
        k = _check_array("k", k, 4)
        v = _check_array("v", v, 4)
        if k.shape != v.shape or k.shape[:2] != (B, H_kv) or k.shape[3] != d:
            raise ValueError(f"k and v must both be (B={B}, H_kv={H_kv}, N_new, d={d}), got {k.shape}, {v.shape}")
        n_new = k.shape[2]
    if np.any(lens < 0) or np.any(lens + n_new > N_max):
        raise ValueError(f"every cache_seqlens[b] + N_new must lie in [0, N_max={N_max}] (N_new={n_new}), "
                         f"got cache_seqlens={lens.tolist()}")
    pad = np.zeros(B, np.int64)  # where each sequence's keys start
    if cache_leftpad is not None:
        pad = np.asarray(cache_leftpad)
        if pad.shape != (B,) or not np.issubdtype(pad.dtype, np.integer) or np.any(pad < 0) or np.any(pad > lens):
            raise ValueError(f"cache_leftpad must be integers of shape ({B},) with 0 <= cache_leftpad[b] <= "
                             f"cache_seqlens[b], got {pad.tolist()} for cache_seqlens={lens.tolist()}")
    scale = _scale_and_causal(softmax_scale, causal, d)
    (left, _), softcap = _check_window_softcap(window, softcap)
    if block_table is not None:
        P = k_cache.shape[2]
        for b in range(B):  # every page a sequence's keys (after the append) lie in must be in the pool
            used = table[b, :-(-(int(lens[b]) + n_new) // P)]
            if np.any((used < 0) | (used >= k_cache.shape[0])):
                raise ValueError(f"block_table[{b}] must hold page indices in [0, {k_cache.shape[0]}) for its "
                                 f"first {len(used)} pages, got {used.tolist()}")
        for b in range(B):  # the append, in place, into the pages
            for t in range(n_new):
                j = int(lens[b]) + t
                k_cache[table[b, j // P], :, j % P] = k[b, :, t]
                v_cache[table[b, j // P], :, j % P] = v[b, :, t]
        # the entries past a sequence's pages are never read: any valid page stands in for them
        table = np.where((table >= 0) & (table < k_cache.shape[0]), table, 0)
        k_cache, v_cache = paged_view(k_cache, table), paged_view(v_cache, table)
    else:
        for b in range(B):  # the append, in place (into the sequence's cache row)
            if n_new:
                k_cache[rows[b], :, lens[b]:lens[b] + n_new] = k[b]
                v_cache[rows[b], :, lens[b]:lens[b] + n_new] = v[b]
        k_cache, v_cache = k_cache[rows], v_cache[rows]  # (B, H_kv, N_max, d): sequence b's row (a copy)
    group = H_q // H_kv
    o = np.zeros(q.shape, q.dtype)
    lse = np.full(q.shape[:3], -np.inf, q.dtype)
    for b in range(B):
        L = int(lens[b]) + n_new - int(pad[b])  # valid keys: cache positions pad[b] .. pad[b] + L - 1
        kb = np.repeat(k_cache[b, :, pad[b]:pad[b] + L], group, axis=0)  # (H_q, L, d)
        vb = np.repeat(v_cache[b, :, pad[b]:pad[b] + L], group, axis=0)
        state = None
        visible = window_visible(N_q, L, window, causal)  # (N_q, L), bottom-right over the valid keys
        k_lo = 0 if left < 0 else max(0, L - N_q - left) // block * block  # keys before: seen by no query
        for lo, hi in ((k_lo + a, k_lo + z) for a, z in split_bounds(L - k_lo, num_splits, block)):
            s = _softcap(scale * np.einsum("hid,hjd->hij", q[b], kb[:, lo:hi]), softcap)[0]  # (H_q, N_q, hi - lo)
            s = np.where(visible[:, lo:hi], s, -np.inf)
            if hi == lo:
                part = (np.full((H_q, N_q), -np.inf, q.dtype), np.zeros((H_q, N_q), q.dtype),
                        np.zeros((H_q, N_q, d), q.dtype))
            else:
                part = softmax_state(s, vb[:, None, lo:hi])
            if trace is not None:
                trace.append(dict(b=b, lo=lo, hi=hi, m=part[0].copy(), l=part[1].copy()))
            state = part if state is None else merge_states(state, part)
        m, l, acc = state
        seen = l > 0
        o[b] = np.where(seen[..., None], acc / np.where(seen, l, 1.0)[..., None], 0.0)
        lse[b] = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)
    return o, lse


def rotary_embedding(x, cos, sin, positions, *, interleaved=True):
    """The rotary embedding (RoPE) of the rows of ``x`` (..., N, d) at ``positions`` (..., N) integers, as
    flash-attn's decoding call applies it: ``cos``, ``sin`` (n_ro, r) give the angle of each channel pair at
    each position, and the first 2r channels are rotated pair by pair, ``(x1, x2) -> (x1 cos - x2 sin,
    x1 sin + x2 cos)``; a pair is channels (2c, 2c + 1) when ``interleaved`` (GPT-J) and (c, c + r)
    otherwise (GPT-NeoX); channels from 2r on pass through. Returns a new array of x's dtype."""
    x = _check_array("x", x, 2)
    cos, sin = np.asarray(cos), np.asarray(sin)
    if cos.ndim != 2 or sin.shape != cos.shape or not 1 <= 2 * cos.shape[1] <= x.shape[-1]:
        raise ValueError(f"cos and sin must both be (n_ro, r) with 2 r <= d = {x.shape[-1]}, got {cos.shape} and "
                         f"{sin.shape}")
    pos = np.asarray(positions)
    if pos.shape != x.shape[:-1] or not np.issubdtype(pos.dtype, np.integer) or np.any(pos < 0) \
            or np.any(pos >= cos.shape[0]):
        raise ValueError(f"positions must be integers of shape {x.shape[:-1]} in [0, {cos.shape[0]}), got "
                         f"{pos.dtype} {pos.shape}")
    r = cos.shape[1]
    c, s = cos[pos].astype(x.dtype), sin[pos].astype(x.dtype)  # (..., N, r)
    x1, x2 = (x[..., 0:2 * r:2], x[..., 1:2 * r:2]) if interleaved else (x[..., :r], x[..., r:2 * r])
    y1, y2 = x1 * c - x2 * s, x1 * s + x2 * c
    out = x.copy()
    if interleaved:
        out[..., 0:2 * r:2], out[..., 1:2 * r:2] = y1, y2
    else:
        out[..., :r], out[..., r:2 * r] = y1, y2
    return out


def paged_view(pages, block_table):
    """The contiguous cache (B, H_kv, W * P, d) that a paged one describes: ``pages`` (P_total, H_kv, P, d),
    ``block_table`` (B, W) page indices; row j of sequence b is row ``j % P`` of page ``block_table[b, j // P]``.
    A copy (NumPy's gather); the kernel reads the pages where they lie instead."""
    pages, table = np.asarray(pages), np.asarray(block_table)
    if pages.ndim != 4 or table.ndim != 2:
        raise ValueError(f"pages must be (P_total, H_kv, P, d) and block_table (B, W), got {pages.shape} and "
                         f"{table.shape}")
    if not np.issubdtype(table.dtype, np.integer) or np.any((table < 0) | (table >= pages.shape[0])):
        raise ValueError(f"block_table must hold page indices in [0, {pages.shape[0]}), got {table.tolist()}")
    B, W = table.shape
    _, H_kv, P, d = pages.shape
    return pages[table].transpose(0, 2, 1, 3, 4).reshape(B, H_kv, W * P, d)  # (B, W, H_kv, P, d) -> ...


def check_cu_seqlens(name: str, cu, total: Optional[int]) -> np.ndarray:
    """Validate flash-attn's ``cu_seqlens``: int32, 1-D, starting at 0, non-decreasing, ending at
    ``total`` (the packed tensor's token count; None: anywhere, as for the keys of a paged cache).
    Sequence b is tokens ``cu[b] .. cu[b+1]``."""
    arr = np.asarray(cu)
    if arr.dtype != np.int32:
        raise TypeError(f"{name} must be int32 (flash-attn's cumulative sequence lengths), got {arr.dtype}")
    if arr.ndim != 1 or arr.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D of length batch + 1, got shape {arr.shape}")
    if arr[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {int(arr[0])}")
    if np.any(np.diff(arr) < 0):
        b = int(np.argmax(np.diff(arr) < 0))
        raise ValueError(f"{name} must be non-decreasing (sequence lengths >= 0), got {name}[{b}] = {int(arr[b])} "
                         f"> {name}[{b + 1}] = {int(arr[b + 1])}")
    if total is not None and arr[-1] != total:
        raise ValueError(f"{name}[-1] = {int(arr[-1])} must equal the number of packed tokens, {total}")
    return arr


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, softmax_scale=None, window=(-1, -1),
                     softcap=0.0, do=None, block_table=None):
    """Attention over a packed batch of variable-length sequences, flash-attn's varlen layout.

    ``q`` (total_q, H_q, d), ``k`` and ``v`` (total_k, H_kv, d): the sequences laid end to end, no
    padding. Sequence b owns query tokens ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]`` and key tokens
    ``cu_seqlens_k[b] .. cu_seqlens_k[b+1]`` (int32 arrays of length B + 1, from 0 to the totals); a
    sequence of length 0 is allowed. Tokens attend only within their own sequence, with ``causal``,
    ``window`` and ``softcap`` applied per sequence exactly as :func:`naive_attention` applies them
    (bottom-right alignment uses that sequence's own lengths). GQA: query head h reads key head
    h // (H_q / H_kv).

    Returns ``(o, lse)``: (total_q, H_q, d) and (H_q, total_q) (flash-attn's varlen LSE layout). With
    ``do`` (total_q, H_q, d) also returns ``(dq, dk, dv)`` of the shapes of q, k, v.

    ``block_table`` (B, W) integers, optional: the keys live in a paged cache (a prefill over cached
    pages, as vLLM runs chunked prefill and prefix caching). ``k``, ``v`` are then a pool of pages
    (P_total, P, H_kv, d) and key j of sequence b is row ``j % P`` of page ``block_table[b, j // P]``;
    ``cu_seqlens_k`` still gives each sequence's key count, and may end anywhere. Forward only (no ``do``).
    """
    q = _check_array("q", q, 3)
    paged = block_table is not None
    k = _check_array("k", k, 4 if paged else 3)
    v = _check_array("v", v, 4 if paged else 3)
    want = "a pool of pages (P_total, P, H_kv, d)" if paged else "(total_k, H_kv, d)"
    if q.ndim != 3 or k.ndim != 3 + paged or v.shape != k.shape or k.shape[-1] != q.shape[2]:
        raise ValueError(f"q must be (total_q, H_q, d) and k, v one shape {want}; got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    H_q, H_kv = q.shape[1], k.shape[-2]
    if H_kv < 1 or H_q % H_kv:
        raise ValueError(f"H_q = {H_q} must be a multiple of H_kv = {H_kv}")
    cq = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    ck = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, None if paged else k.shape[0])
    if cq.shape != ck.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{cq.shape[0]} and {ck.shape[0]}")
    if paged:
        if do is not None:
            raise ValueError("varlen_attention over a paged cache (block_table) is forward only: pass do=None")
        table, P = np.asarray(block_table), k.shape[1]
        if table.ndim != 2 or table.shape[0] != cq.shape[0] - 1 or not np.issubdtype(table.dtype, np.integer):
            raise ValueError(f"block_table must be integers of shape (B={cq.shape[0] - 1}, pages per sequence), "
                             f"got {table.dtype} {table.shape}")
        lens = np.diff(ck)
        for b, n in enumerate(lens):
            used = table[b, :-(-int(n) // P)]
            if n > table.shape[1] * P or np.any((used < 0) | (used >= k.shape[0])):
                raise ValueError(f"sequence {b} has {n} keys: block_table[{b}] must list ceil({n} / {P}) pages in "
                                 f"[0, {k.shape[0]}), got {table[b].tolist()}")
        # the keys laid end to end, as the unpaged layout holds them (a copy; the kernel reads the pages). The
        # entries past a sequence's pages are never read: any valid page stands in for them.
        table = np.where((table >= 0) & (table < k.shape[0]), table, 0)
        views = (paged_view(x.transpose(0, 2, 1, 3), table) for x in (k, v))  # (B, H_kv, W * P, d) each
        k, v = (np.concatenate([view[b, :, :n].transpose(1, 0, 2) for b, n in enumerate(lens)] or [x[:0, 0]])
                for view, x in zip(views, (k, v)))
    group = H_q // H_kv
    o = np.zeros(q.shape, q.dtype)
    lse = np.full((H_q, q.shape[0]), -np.inf, q.dtype)
    grads = (np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)) if do is not None else None
    for b in range(cq.shape[0] - 1):
        q0, q1, k0, k1 = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if q1 == q0 or k1 == k0:  # no query, or no key: o = 0, LSE = -inf, no gradient
            continue
        qb = q[q0:q1].transpose(1, 0, 2)  # (H_q, n_q, d)
        kb = np.repeat(k[k0:k1].transpose(1, 0, 2), group, axis=0)  # (H_q, n_k, d)
        vb = np.repeat(v[k0:k1].transpose(1, 0, 2), group, axis=0)
        opts = dict(causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap)
        ob, lb = naive_attention(qb, kb, vb, **opts)
        o[q0:q1] = ob.transpose(1, 0, 2)
        lse[:, q0:q1] = lb
        if do is not None:
            dqb, dkb, dvb = naive_attention_backward(qb, kb, vb, do[q0:q1].transpose(1, 0, 2), **opts)
            grads[0][q0:q1] = dqb.transpose(1, 0, 2)
            grads[1][k0:k1] = dkb.reshape(H_kv, group, k1 - k0, -1).sum(1).transpose(1, 0, 2)
            grads[2][k0:k1] = dvb.reshape(H_kv, group, k1 - k0, -1).sum(1).transpose(1, 0, 2)
    return (o, lse) if do is None else (o, lse, *grads)


# ----------------------------------------------------------------------------------------------
# Context parallelism: a ring of W simulated devices (the book's chapter on context parallelism).
# ----------------------------------------------------------------------------------------------
def ring_chunks(world: int, layout: str = "zigzag") -> list:
    """The sequence chunks each of ``world`` ranks holds: ``[[chunk ids of rank 0], ...]``.

    "contiguous": W chunks, rank r holds chunk r. "zigzag": 2W chunks, rank r holds chunks r and
    2W - 1 - r (one from the head of the sequence and one from its tail), so that under a causal mask
    every rank does the same amount of work."""
    world = _check_block("world", world)
    if layout == "contiguous":
        return [[r] for r in range(world)]
    if layout == "zigzag":
        return [[r, 2 * world - 1 - r] for r in range(world)]
    raise ValueError(f"layout must be 'zigzag' or 'contiguous', got {layout!r}")


def _chunk_pair(x: int, y: int, causal: bool) -> str:
    """How query chunk x sees key chunk y (equal-sized chunks): 'full', 'diagonal' or 'none'."""
    if not causal or y < x:
        return "full"
    return "diagonal" if y == x else "none"


def ring_attention(q_shards, k_shards, v_shards, *, causal=False, softmax_scale=None, layout="contiguous",
                   ledger: Optional[list] = None, window=(-1, -1)):
    """Ring attention over W simulated devices, step by step: the NumPy mirror of
    ``fa_lib.context_parallel.ring_attention``.

    ``q_shards[r]``, ``k_shards[r]``, ``v_shards[r]``: rank r's shard (..., N_local, d), holding the
    chunks ``ring_chunks(W, layout)[r]`` of the sequence in that order. At step s every rank r computes
    its queries against the K/V shard it holds (the one that started on rank (r - s) mod W), folds the
    partial state into its running ``(m, l, acc)`` with :func:`merge_states`, and passes the shard on to
    rank r + 1. After W steps each rank has seen every key; the result is exact. Returns
    ``(o_shards, lse_shards)``. ``ledger``, if a list, receives one dict per (step, rank): the chunks it
    holds, the chunk pairs it computes (with 'full' or 'diagonal'), what it sends and receives.

    ``window=(left, right)`` (default unbounded): a sliding window over the tokens' global positions
    (query i sees keys i - left to i + right, -1 unbounded; with ``causal``, right is 0). Each chunk
    pair is then masked by global positions, a pair the window hides entirely is skipped, and each
    ledger entry also lists ``skips``, the hidden pairs; the ledger's computes mark pairs 'window'.
    """
    world = len(q_shards)
    if not (world == len(k_shards) == len(v_shards)) or world == 0:
        raise ValueError("q_shards, k_shards and v_shards must be non-empty lists of one length (the world size)")
    chunks = ring_chunks(world, layout)
    per_rank = len(chunks[0])
    if any(not isinstance(t, np.ndarray) or t.ndim < 2 or 0 in t.shape for t in q_shards):
        raise ValueError(f"every q shard must be a non-empty array (..., N_local, d), got "
                         f"{[getattr(t, 'shape', type(t).__name__) for t in q_shards]}")
    n_local = q_shards[0].shape[-2]
    if any(s.shape != q_shards[0].shape for s in q_shards) or n_local % per_rank:
        raise ValueError(f"every q shard must have one shape (..., N_local, d) with N_local divisible by {per_rank} "
                         f"(chunks per rank, layout {layout!r}); got {[s.shape for s in q_shards]}")
    for name, shards in (("k_shards", k_shards), ("v_shards", v_shards)):
        for r, t in enumerate(shards):
            if not isinstance(t, np.ndarray) or t.shape[:-1] != q_shards[0].shape[:-1] or (
                    name == "k_shards" and t.shape[-1] != q_shards[0].shape[-1]):
                raise ValueError(f"{name}[{r}] must be an array with the leading dimensions and N_local of the q "
                                 f"shards, {q_shards[0].shape[:-1]} (and, for k, their head dim "
                                 f"{q_shards[0].shape[-1]}), got {getattr(t, 'shape', type(t).__name__)}")
    c = n_local // per_rank
    d = q_shards[0].shape[-1]
    scale = _scale_and_causal(softmax_scale, causal, d)
    windowed = tuple(window) != (-1, -1)
    if windowed:
        window, _ = _check_window_softcap(window, 0.0)
    state = [[None] * per_rank for _ in range(world)]
    held = list(range(world))  # rank r holds the K/V shard that started on rank held[r]
    for step in range(world):
        for r in range(world):
            src = held[r]
            pairs, skips = [], []
            for a, x in enumerate(chunks[r]):
                qx = q_shards[r][..., a * c:(a + 1) * c, :]
                for b, y in enumerate(chunks[src]):
                    if windowed:
                        visible = _chunk_window(x, y, c, causal, window)
                        kind = "window" if visible.any() else "none"
                        if kind == "none":
                            skips.append((x, y))
                    else:
                        kind = _chunk_pair(x, y, causal)
                    if kind == "none":
                        continue
                    pairs.append((x, y, kind))
                    s = scale * np.einsum("...id,...jd->...ij", qx, k_shards[src][..., b * c:(b + 1) * c, :])
                    if kind == "diagonal":
                        s = np.where(np.tril(np.ones((c, c), dtype=bool)), s, -np.inf)
                    if kind == "window":
                        s = np.where(visible, s, -np.inf)
                    part = softmax_state(s, v_shards[src][..., None, b * c:(b + 1) * c, :])
                    state[r][a] = part if state[r][a] is None else merge_states(state[r][a], part)
            if ledger is not None:
                ledger.append(dict(step=step, rank=r, holds=list(chunks[src]), computes=pairs,
                                   sends_to=(r + 1) % world if step < world - 1 else None,
                                   receives_from=(r - 1) % world if step < world - 1 else None,
                                   **({"skips": skips} if windowed else {})))
        held = [held[(r - 1) % world] for r in range(world)]  # every shard moves one rank on
    o_shards, lse_shards = [], []
    for r in range(world):
        os_, ls_ = [], []
        for a in range(per_rank):
            m, l, acc = state[r][a]
            os_.append(acc / l[..., None])
            ls_.append(m + np.log(l))
        o_shards.append(np.concatenate(os_, axis=-2))
        lse_shards.append(np.concatenate(ls_, axis=-1))
    return o_shards, lse_shards


def _chunk_window(x: int, y: int, c: int, causal: bool, window) -> np.ndarray:
    """The (c, c) visibility of key chunk y to query chunk x (chunks of c tokens) under a sliding window
    over global positions, ``causal`` setting right = 0: query gi sees key gj iff
    ``gi - left <= gj <= gi + right`` (a side of -1 unbounded)."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    gi = x * c + np.arange(c)[:, None]
    gj = y * c + np.arange(c)[None, :]
    visible = np.ones((c, c), dtype=bool)
    if left >= 0:
        visible &= gj >= gi - left
    if right >= 0:
        visible &= gj <= gi + right
    return visible


def ring_steps_needed(world: int, layout: str, c: int, causal: bool = False, window=(-1, -1)) -> int:
    """How many of the ring's W steps any rank needs: one more than the last step at which some rank's
    query chunks see some key of the shard it holds (chunks of c tokens). A window shorter than the
    sequence hides the far shards: the ring can stop early, and the far transfers never happen."""
    chunks = ring_chunks(world, layout)
    window, _ = _check_window_softcap(window, 0.0)
    last = 0
    for step in range(world):
        for r in range(world):
            src = (r - step) % world
            if any(_chunk_window(x, y, c, causal, window).any() for x in chunks[r] for y in chunks[src]):
                last = step
    return last + 1


def allgather_attention(q_shards, k_shards, v_shards, *, causal=False, softmax_scale=None, layout="contiguous",
                        window=(-1, -1)):
    """The all-gather scheme of context parallelism (Llama 3's), over W simulated ranks: the NumPy mirror
    of ``fa_lib.context_parallel.ring_attention(..., strategy="allgather")``.

    Every rank gathers all K/V shards once and puts them in sequence order, then runs each of its query
    chunks against the keys it sees (causal and ``window`` by global positions): one attention call per
    chunk, nothing to merge. Shards as in :func:`ring_attention`; returns ``(o_shards, lse_shards)``.
    """
    world = len(q_shards)
    if not (world == len(k_shards) == len(v_shards)) or world == 0:
        raise ValueError("q_shards, k_shards and v_shards must be non-empty lists of one length (the world size)")
    chunks = ring_chunks(world, layout)
    per_rank = len(chunks[0])
    n_local = q_shards[0].shape[-2]
    if any(not isinstance(t, np.ndarray) or t.shape[-2] != n_local for t in (*q_shards, *k_shards, *v_shards)) \
            or n_local % per_rank:
        raise ValueError(f"every shard must be an array (..., N_local, d) of one N_local divisible by {per_rank} "
                         f"(chunks per rank, layout {layout!r})")
    window, _ = _check_window_softcap(window, 0.0)
    c = n_local // per_rank
    where = {i: (r, p) for r, ids in enumerate(chunks) for p, i in enumerate(ids)}

    def natural(shards):
        return np.concatenate([shards[where[i][0]][..., where[i][1] * c:(where[i][1] + 1) * c, :]
                               for i in sorted(where)], axis=-2)

    k, v = natural(k_shards), natural(v_shards)
    n = k.shape[-2]
    o_shards, lse_shards = [], []
    for r in range(world):
        os_, ls_ = [], []
        for a, x in enumerate(chunks[r]):
            visible = np.concatenate([_chunk_window(x, y, c, causal, window) for y in range(n // c)], axis=1)
            o, lse = naive_attention(q_shards[r][..., a * c:(a + 1) * c, :], k, v, softmax_scale=softmax_scale,
                                     mask=visible)
            os_.append(o)
            ls_.append(lse)
        o_shards.append(np.concatenate(os_, axis=-2))
        lse_shards.append(np.concatenate(ls_, axis=-1))
    return o_shards, lse_shards


def _document_lengths(cu_seqlens, total: int, world: int, per_rank: int) -> list:
    cu = [int(x) for x in np.asarray(cu_seqlens).reshape(-1)]
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if len(cu) < 2 or cu[0] != 0 or min(lengths) < 0 or cu[-1] != total:
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the sequence length {total}, "
                         f"got {cu}")
    if any(length % (world * per_rank) for length in lengths):
        raise ValueError(f"every document length must be divisible by {world * per_rank} (its chunks), got {lengths}")
    return lengths


def shard_documents(x: np.ndarray, cu_seqlens, world: int, layout: str = "zigzag") -> list:
    """Every rank's shard of packed documents ``x`` (..., N, d), ``cu_seqlens`` their cumulative
    lengths (0, L0, L0 + L1, ..., N): each document is cut into the chunks of
    ``ring_chunks(world, layout)`` and rank r keeps its chunks of every document, in document order.
    The load balance is per document: under a causal mask every document's work is spread as the
    zigzag layout spreads one sequence's."""
    chunks = ring_chunks(world, layout)
    lengths = _document_lengths(cu_seqlens, x.shape[-2], world, len(chunks[0]))
    shards = [[] for _ in range(world)]
    start = 0
    for length in lengths:
        c = length // (world * len(chunks[0]))
        for r, ids in enumerate(chunks):
            shards[r] += [x[..., start + i * c:start + (i + 1) * c, :] for i in ids]
        start += length
    return [np.concatenate(s, axis=-2) for s in shards]


def ring_attention_documents(q_shards, k_shards, v_shards, cu_seqlens, *, causal=False, softmax_scale=None,
                             layout="zigzag", window=(-1, -1)):
    """Ring attention over packed documents (flash-attn's varlen layout, ``cu_seqlens``), sharded by
    :func:`shard_documents`: the NumPy mirror of ``fa_lib.context_parallel.ring_attention(...,
    cu_seqlens=...)``. The K/V shards carry every document's pieces around the ring together; a query
    attends only to keys of its own document, so each document is a ring of its own, run here with
    :func:`ring_attention` on its rows of every shard. Returns ``(o_shards, lse_shards)``."""
    world = len(q_shards)
    chunks = ring_chunks(world, layout)
    per = len(chunks[0])
    lengths = _document_lengths(cu_seqlens, q_shards[0].shape[-2] * world, world, per)
    o_parts = [[] for _ in range(world)]
    lse_parts = [[] for _ in range(world)]
    base = 0
    for length in lengths:
        rows = per * (length // (world * per))  # this document's rows in every shard
        if rows:
            sl = slice(base, base + rows)
            o, lse = ring_attention([t[..., sl, :] for t in q_shards], [t[..., sl, :] for t in k_shards],
                                    [t[..., sl, :] for t in v_shards], causal=causal, softmax_scale=softmax_scale,
                                    layout=layout, window=window)
            for r in range(world):
                o_parts[r].append(o[r])
                lse_parts[r].append(lse[r])
        base += rows
    return ([np.concatenate(p, axis=-2) for p in o_parts], [np.concatenate(p, axis=-1) for p in lse_parts])
