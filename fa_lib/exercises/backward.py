"""Chapters 7 and 10: the blockwise backward pass with recomputation, and the D preprocess."""
import numpy as np

from .. import reference
from ._common import _as_array, _callable, _compare, _fail, _returns
from .online import _close, _forward_cases


# ---------------------------------------------------------------------------------------------------
# Chapter 7: the blockwise backward pass with recomputation.
# ---------------------------------------------------------------------------------------------------
def _blockwise(q, k, v, o, lse, do, block_q, block_k, visible, mistake=None):
    """A blockwise backward as a learner writes it, with ``mistake`` one of the names of
    ``_BACKWARD_MISTAKES`` (or None for the right answer): (dq, dk, dv)."""
    scale = 1.0 / np.sqrt(q.shape[1])
    delta = np.zeros(q.shape[0]) if mistake == "no D" else np.sum(do * o, axis=-1)
    lse_safe = np.where(np.isneginf(lse), np.inf, lse)  # P = 0 on a row with no key
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for r0 in range(0, q.shape[0], block_q):
        r = slice(r0, r0 + block_q)
        for c0 in range(0, k.shape[0], block_k):
            c = slice(c0, c0 + block_k)
            s = (1.0 if mistake == "S unscaled" else scale) * (q[r] @ k[c].T)
            s = np.where(visible[r, c], s, -np.inf)
            p = np.exp(s) if mistake == "no lse" else np.exp(s - lse_safe[r, None])
            dp = do[r] @ v[c].T
            d = np.sum(p * dp, axis=-1) if mistake == "local D" else delta[r]
            ds = p * (dp - d[:, None])
            out_scale = 1.0 if mistake == "no scale" else scale
            dq[r] += out_scale * (ds @ k[c])
            dk[c] += out_scale * (ds.T @ q[r])
            dv[c] += p.T @ do[r]
    return dq, dk, dv


_BACKWARD_MISTAKES = [  # (mistake, the mask it uses, what the checker says)
    ("no D", "causal", "dS = P * dP: D is missing; dS = P * (dP - D) with D = rowsum(dO * O)"),
    ("local D", "causal", "dS computed with the row sum of this tile (a local D) instead of D = rowsum(dO * O) "
                          "of the whole row"),
    ("no scale", "causal", "missing scale in dq/dk: dq += scale * dS @ k_j and dk += scale * dS.T @ q_i"),
    ("S unscaled", "causal", "the recomputed scores miss the scale: P = exp(scale * q @ k.T - lse)"),
    ("no lse", "causal", "P not normalised with lse (used exp(s) without subtracting lse): P = exp(S - lse)"),
    (None, "none", "the causal mask is missing when P is recomputed: hidden keys must get P = 0"),
    (None, "top-left", "the causal mask is aligned top-left; fa_lib aligns it bottom-right: query i sees key j iff "
                       "j <= i + N_K - N_Q"),
]


def check_blockwise_backward(fn):
    """Chapter 7. ``fn(q, k, v, o, lse, do, block_q, block_k, causal) -> (dq, dk, dv)``.

    Recompute ``P = exp(S - lse)`` tile by tile from the saved ``lse``, use ``D = rowsum(dO * O)``, and
    return the three gradients with the shapes of ``q``, ``k``, ``v``. The scale is ``1/sqrt(d)``;
    ``causal`` is aligned bottom-right (query i sees key j iff ``j <= i + nk - nq``). Rows that see no
    key (``lse = -inf``) contribute nothing (and must not make NaN).
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
        got = [_as_array(case, name, x) for name, x in zip(("dq", "dk", "dv"), out)]
        if all(_close(g, w) for g, w in zip(got, want)):
            continue
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            if g.shape == w.shape and not np.isfinite(g).all() and np.isneginf(lse).any():
                rows = [int(i) for i in np.flatnonzero(np.isneginf(lse))]
                _fail(case, f"{name} has NaN or inf: NaN from a row with lse = -inf (queries {rows} see no key): "
                            f"exp(S - lse) is exp(+inf), or NaN where S = -inf too; give such rows P = 0, e.g. "
                            f"subtract np.where(lse == -inf, np.inf, lse)")
        nq, nk = q.shape[0], k.shape[0]
        masks = {"causal": reference.causal_mask(nq, nk) if causal else np.ones((nq, nk), dtype=bool),
                 "none": np.ones((nq, nk), dtype=bool), "top-left": np.tril(np.ones((nq, nk), dtype=bool))}
        for mistake, mask, what in _BACKWARD_MISTAKES:
            if mask != "causal" and not causal:
                continue
            with np.errstate(all="ignore"):
                x = _blockwise(q, k, v, o, lse, do, bq, bk, masks[mask], mistake)
            wrong = [i for i in range(3) if not _close(got[i], want[i])]
            if all(_close(got[i], x[i]) for i in wrong):
                _fail(case, f"{', '.join(('dq', 'dk', 'dv')[i] for i in wrong)} wrong: {what}")
        hint = "dS = P * (dP - D) with D = rowsum(dO * O); P = exp(S - lse), 0 where lse = -inf or masked"
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            _compare(case, name, g, w, hint)
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
            mistakes = [("D = rowsum(dO * O): you summed dO alone", do.double().sum(-1)),
                         ("D = rowsum(dO * O): you summed O alone", o.double().sum(-1))]
            if dtype == torch.float16:
                mistakes.append(("you multiplied and summed in float16 and converted at the end: convert o and "
                                 "do to float32 first (o.to(tl.float32) in a kernel), then multiply and sum",
                                 (o * do).sum(-1).double()))
            for what, x in mistakes:
                if (got.double() - x).abs().max().item() <= tol:
                    _fail(case, what)
            i = tuple(int(x) for x in ((got.double() - want).abs() == err).nonzero()[0]) if err == err else (0, 0, 0)
            _fail(case, f"delta{list(i)} = {got[i].item():.6g}, expected {want[i].item():.6g} "
                        f"(sum the products over the head dimension, in float32)")
    return f"all {len(cases)} hidden cases pass"
