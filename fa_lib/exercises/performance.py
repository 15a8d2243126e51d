"""Chapter 11: the FLOP count by which every attention speed of the book is reported.

The convention is the FlashAttention papers' (and ``benchmarks.bench.attention_flops``, which the
benchmarks use; ``tests/library/test_exercise_performance.py`` checks that the two agree): the forward pass
does two matrix products, ``S = Q K^T`` and ``O = P V``, of ``2 * n_q * n_k * head_dim`` FLOPs each per head,
so ``4 * batch * heads * n_q * n_k * head_dim``; a causal mask halves it; the backward counts five products,
2.5 times the forward; forward and backward together, 3.5 times. NumPy and torch are not needed.
"""
import numbers

from ._common import _callable, _fail

MODES = ("fwd", "bwd", "fwd_bwd")


def attention_flops(batch, heads, n_q, n_k, head_dim, causal, mode):
    """FLOPs credited to one attention call by the convention of the module docstring (an int).

    ``batch``, ``heads``, ``n_q``, ``n_k``, ``head_dim``: non-negative ints; ``causal``: a bool;
    ``mode``: "fwd", "bwd" or "fwd_bwd". Other arguments are a TypeError or ValueError naming them.
    """
    for name, value in (("batch", batch), ("heads", heads), ("n_q", n_q), ("n_k", n_k), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    f = 4 * batch * heads * n_q * n_k * head_dim  # two products of 2 * n_q * n_k * head_dim per head
    if causal:
        f //= 2  # the mask skips half of the score matrix
    return {"fwd": f, "bwd": 5 * f // 2, "fwd_bwd": 7 * f // 2}[mode]


# (name, batch, heads, n_q, n_k, head_dim, causal, mode): the order matters, each case is the first to
# tell one mistake apart from the right answer.
_CASES = (
    ("forward, no mask", 2, 3, 64, 64, 32, False, "fwd"),
    ("forward, causal", 2, 3, 64, 64, 32, True, "fwd"),
    ("forward, 48 queries against 80 keys", 1, 2, 48, 80, 16, False, "fwd"),
    ("backward, no mask", 2, 3, 64, 64, 32, False, "bwd"),
    ("backward, causal", 4, 16, 4096, 4096, 128, True, "bwd"),
    ("forward + backward, no mask", 1, 4, 128, 128, 64, False, "fwd_bwd"),
    ("forward + backward, causal", 3, 8, 1024, 1024, 128, True, "fwd_bwd"),
    ("backward, 512 queries against 8192 keys", 2, 8, 512, 8192, 256, False, "bwd"),
)


def _hint(batch, heads, n_q, n_k, head_dim, causal, mode, got):
    """The mistake that gives `got` on this case, in words ('' if none of the known ones does)."""
    def flops(pairs=None, halve=causal, factor=None):
        f = 4 * batch * heads * (n_q * n_k if pairs is None else pairs) * head_dim
        if halve:
            f //= 2
        return f * ({"fwd": 2, "bwd": 5, "fwd_bwd": 7}[mode] if factor is None else factor) // 2

    if got == flops() // 2:
        return ("it is half the expected count: the forward does two matrix products, S = Q K^T and O = P V, "
                "each 2 * n_q * n_k * head_dim FLOPs per head, so 4 * n_q * n_k * head_dim, not 2")
    if causal and got == flops(halve=False):
        return "causal: the mask skips half of the score matrix, so the convention halves the count"
    if mode == "bwd" and got == flops(factor=4):
        return "the backward counts five products (S again, dV, dP, dQ, dK): 2.5 times the forward, not 2"
    if mode == "fwd_bwd" and got == flops(factor=6):
        return "forward + backward is 1 + 2.5 = 3.5 times the forward: the backward is 2.5x, not 2x"
    if mode == "fwd_bwd" and got == flops(factor=5):
        return "fwd_bwd is the forward plus the backward: 3.5 times the forward, not the backward's 2.5"
    if n_q != n_k and got in (flops(pairs=n_q * n_q), flops(pairs=n_k * n_k)):
        return "n_q and n_k mixed up: the score matrix is n_q x n_k, so count n_q * n_k pairs, not a square"
    return ""


def check_attention_flops(fn):
    """Chapter 11. ``fn(batch, heads, n_q, n_k, head_dim, causal, mode) -> flops``.

    Return the FLOPs the FlashAttention convention credits to one attention call: forward
    ``4 * batch * heads * n_q * n_k * head_dim``, halved when ``causal`` (the hidden causal cases have
    ``n_q == n_k``), ``mode="bwd"`` 2.5 times the forward and ``mode="fwd_bwd"`` 3.5 times. An int, or a
    float equal to it.
    """
    _callable(fn)
    for case, *args in _CASES:
        want = attention_flops(*args)
        got = fn(*args)
        if isinstance(got, bool) or not isinstance(got, numbers.Real):
            _fail(case, f"your function should return a number of FLOPs, got {type(got).__name__}")
        if got != want and abs(got - want) > 1e-12 * want:
            hint = _hint(*args, got)
            _fail(case, f"{args} gave {got:,}, expected {want:,}" + (f" ({hint})" if hint else ""))
    return f"all {len(_CASES)} hidden cases pass"
