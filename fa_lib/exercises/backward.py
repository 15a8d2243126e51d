"""Chapters 7 and 10: the blockwise backward pass with recomputation, and the D preprocess."""
import numpy as np

from .. import reference
from ._common import _callable, _compare, _fail, _returns
from .online import _forward_cases


# ---------------------------------------------------------------------------------------------------
# Chapter 7: the blockwise backward pass with recomputation.
# ---------------------------------------------------------------------------------------------------
def check_blockwise_backward(fn):
    """Chapter 7. ``fn(q, k, v, o, lse, do, block_q, block_k, causal) -> (dq, dk, dv)``.

    Recompute ``P = exp(S - lse)`` tile by tile from the saved ``lse``, use ``D = rowsum(dO * O)``, and
    return the three gradients with the shapes of ``q``, ``k``, ``v``. Rows that see no key contribute
    nothing (and must not make NaN).
    """
    _callable(fn)
    cases = _forward_cases()
    rng = np.random.default_rng(7)
    for case, (q, k, v), bq, bk, causal in cases:
        o, lse = reference.naive_attention(q, k, v, causal=causal)
        do = rng.standard_normal(o.shape)
        want = reference.naive_attention_backward(q, k, v, do, causal=causal)
        with np.errstate(all="ignore"):
            out = _returns(case, fn(q.copy(), k.copy(), v.copy(), o.copy(), lse.copy(), do.copy(), bq, bk, causal),
                           3, ("dq", "dk", "dv"))
        hint = "dS = P * (dP - D) with D = rowsum(dO * O); P = exp(S - lse), 0 where lse = -inf or masked"
        for name, got, w in zip(("dq", "dk", "dv"), out, want):
            _compare(case, name, got, w, hint)
    return f"all {len(cases)} hidden cases pass"


# ---------------------------------------------------------------------------------------------------
# Chapter 10: the D preprocess (on torch tensors, e.g. a Triton kernel under the interpreter).
# ---------------------------------------------------------------------------------------------------
def check_d_preprocess(fn):
    """Chapter 10. ``fn(o, do) -> delta``: ``delta[b, h, i] = sum_d o[b, h, i, d] * do[b, h, i, d]``.

    ``o`` and ``do`` are torch tensors (B, H, N, d) (float16 or float32, any strides, on CPU); return a
    float32 tensor (B, H, N). Accumulate in float32 even for float16 inputs.
    """
    _callable(fn)
    import torch

    gen = torch.Generator().manual_seed(10)
    cases = [
        ("float32, 1 x 2 x 70 x 16", (1, 2, 70, 16), torch.float32, False),
        ("float16 inputs, 2 x 3 x 33 x 40 (accumulate in float32)", (2, 3, 33, 40), torch.float16, False),
        ("a (B, N, H, D) storage viewed as (B, H, N, D) (strides, not contiguity)", (2, 4, 17, 32), torch.float32,
         True),
    ]
    for case, shape, dtype, transposed in cases:
        b, h, n, d = shape
        if transposed:
            o, do = (torch.randn(b, n, h, d, generator=gen).to(dtype).transpose(1, 2) for _ in range(2))
        else:
            o, do = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(2))
        want = (o.double() * do.double()).sum(-1)
        got = fn(o, do)
        if not isinstance(got, torch.Tensor):
            _fail(case, f"return a torch.Tensor, got {type(got).__name__}")
        if tuple(got.shape) != (b, h, n):
            _fail(case, f"delta has shape {tuple(got.shape)}, expected {(b, h, n)}: one number per query row")
        if got.dtype != torch.float32:
            _fail(case, f"delta has dtype {got.dtype}, expected torch.float32")
        err = (got.double() - want).abs().max().item()
        tol = 1e-5 * max(1.0, want.abs().max().item())
        if not err <= tol:  # also catches NaN
            i = tuple(int(x) for x in ((got.double() - want).abs() == err).nonzero()[0]) if err == err else (0, 0, 0)
            _fail(case, f"delta{list(i)} = {got[i].item():.6g}, expected {want[i].item():.6g} "
                        f"(sum the products over the head dimension, in float32)")
    return f"all {len(cases)} hidden cases pass"
