"""Attention sinks (gpt-oss): a logit per query head that joins every row's softmax as a key with value 0.

The kernels compute attention without the sink; the sink is then folded into their output and LSE exactly, by
the same merge that combines two partial softmaxes (``fa_lib.reference.apply_sinks`` is the NumPy mirror):
``lse' = logaddexp(lse, sink)`` and ``o' = o * exp(lse - lse') = o * sigmoid(lse - sink)``. Written with torch
operators, it is differentiable in o, lse and the sinks; the kernels' backward receives the gradient of the
LSE like any other (``return_lse``), so the gradients of q, k and v and of the sinks need no kernel of their own.
"""
import torch


def _with_sinks(o, lse, sinks, to_rows):
    """(o, lse) of attention whose rows also see a sink logit (a key with value 0): lse' = logaddexp(lse, sink),
    o' = o * sigmoid(lse - sink) = o * exp(lse - lse'), in float32 and differentiable in o, lse and sinks.
    `sinks` is viewed to broadcast against lse; `to_rows` maps lse's layout to o's (a factor per row). A sink
    of -inf leaves its rows as they are, and a row that sees no key keeps o = 0 (its LSE becomes the sink)."""
    s = sinks.to(torch.float32)
    none = torch.isneginf(s)
    s = torch.where(none, 0.0, s)  # (no -inf reaches logaddexp or sigmoid: no NaN in either direction)
    lse_new = torch.where(none, lse, torch.logaddexp(lse, s))
    factor = torch.where(none, 1.0, torch.sigmoid(lse - s))
    return (o.to(torch.float32) * to_rows(factor)).to(o.dtype), lse_new
