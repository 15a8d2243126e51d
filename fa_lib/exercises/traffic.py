"""Chapter 7: the HBM traffic of one head's backward pass, stored P against recomputation (NumPy only).

The accounting is the book's: chapter 7 (recomputation) charges a stored P one write (in the forward
pass) and one read (in the backward pass), the least it can cost, and says that the standard backward
also writes and reads dP and dS, while FlashAttention's backward moves only Q, K, V, O, dO, the
gradients and the per-row LSE and D. Counted in elements, for n queries and n keys of head dimension d,
each array that goes to or from HBM counted once per direction::

    standard        reads Q, K, V, dO                 4nd
                    writes dQ, dK, dV                 3nd
                    P, dP, dS: each written and read  6n^2     -> 7nd + 6n^2
    FlashAttention  reads Q, K, V, O, dO              5nd
                    writes dQ, dK, dV                 3nd
                    LSE, D: each written and read     4n       -> 8nd + 4n
"""
import numbers

from ._common import _callable, _fail, _returns


def _traffic(n, d):
    """(standard, flash): the elements one head's backward pass moves through HBM (the module's model)."""
    standard = 4 * n * d + 3 * n * d + 3 * 2 * n * n  # inputs, gradients, P, dP, dS written and read
    flash = 5 * n * d + 3 * n * d + 2 * 2 * n  # inputs with O, gradients, LSE, D written and read
    return standard, flash


def _traffic_cases():
    """(what, n, d)."""
    return [
        ("n = 4096, d = 64 (the chapter's example)", 4096, 64),
        ("n = 1024, d = 128", 1024, 128),
        ("n = 100, d = 7", 100, 7),
        ("n = 3, d = 5 (a head dimension larger than the sequence)", 3, 5),
        ("n = 1, d = 1", 1, 1),
    ]


def _standard_mistakes(n, d):
    nd = 7 * n * d
    return [
        ("the N x N terms are missing: the standard backward also moves P, dP and dS, each written "
         "and read (6 n^2 elements)", nd),
        ("P is counted once: a stored P is written by the forward pass and read by the backward "
         "pass (2 n^2), and so are dP and dS", nd + 5 * n * n),
        ("each N x N array is counted once: P, dP and dS are each written and read, 6 n^2 in all",
         nd + 3 * n * n),
        ("only P is counted: the standard backward also writes and reads dP and dS", nd + 2 * n * n),
        ("n and d are swapped: the N x N terms are 6 n^2, not 6 d^2", nd + 6 * d * d),
        ("you counted bytes (2 per bf16 element): count elements", 2 * _traffic(n, d)[0]),
    ]


def _flash_mistakes(n, d):
    nd = 8 * n * d
    return [
        ("the LSE and D vectors are missing: each is written and read, 4 n elements", nd),
        ("the LSE and D vectors are counted once each: each is written and read, 4 n in all",
         nd + 2 * n),
        ("O is missing: FlashAttention's backward reads O to form D = rowsum(dO * O)",
         7 * n * d + 4 * n),
        ("n and d are swapped: the vector terms are 4 n, not 4 d", nd + 4 * d),
        ("the N x N terms are counted for FlashAttention: its P, dP and dS tiles are recomputed "
         "on chip and never reach HBM", nd + 4 * n + 6 * n * n),
        ("you counted bytes (2 per bf16 element): count elements", 2 * _traffic(n, d)[1]),
    ]


def _number(case, name, x):
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        _fail(case, f"{name} should be a number of elements (an int), got {type(x).__name__}")
    return x


def check_memory_traffic(fn):
    """Chapter 7. ``fn(n, d) -> (standard, flash)``: HBM traffic of one head's backward pass, in elements.

    ``n`` queries and ``n`` keys, head dimension ``d`` (ints), no mask. Count each array once for
    each time it goes to or from HBM:

    * ``standard`` (the forward pass stored P): reads Q, K, V and dO, writes dQ, dK and dV, and
      moves the N x N matrices P, dP and dS, each written once and read once: ``7nd + 6n^2``;
    * ``flash`` (P recomputed on chip): reads Q, K, V, O and dO (O for ``D = rowsum(dO * O)``),
      writes dQ, dK and dV, and moves the LSE and D vectors (n each), each written once and read
      once: ``8nd + 4n``.

    The answers must be exact.
    """
    _callable(fn)
    cases = _traffic_cases()
    for case, n, d in cases:
        want = _traffic(n, d)
        out = _returns(case, fn(n, d), 2, ("standard", "flash"))
        got = tuple(_number(case, name, x) for name, x in zip(("standard", "flash"), out))
        if got == want:
            continue
        if got == want[::-1]:
            _fail(case, "you returned (flash, standard): return (standard, flash)")
        for name, g, w, mistakes in (("standard", got[0], want[0], _standard_mistakes(n, d)),
                                     ("flash", got[1], want[1], _flash_mistakes(n, d))):
            if g == w:
                continue
            for what, x in mistakes:
                if g == x:
                    _fail(case, f"{name} = {g:,}: {what}")
            _fail(case, f"{name} = {g:,}, expected {w:,} "
                        + ("(7nd + 6n^2: Q, K, V, dO read, dQ, dK, dV written, P, dP, dS each "
                           "written and read)" if name == "standard" else
                           "(8nd + 4n: Q, K, V, O, dO read, dQ, dK, dV written, LSE and D each "
                           "written and read)"))
    return f"all {len(cases)} hidden cases pass"
