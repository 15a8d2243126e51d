"""How fa_lib's Triton kernel is judged: a plain PyTorch reference and the flash-attn error rule.

Shared by ``tests/library/test_kernels.py`` (CPU, Triton interpreter), ``tests/library/test_kernels_gpu.py`` (H200)
and the book's chapters, so that every claim of correctness is checked the same way.

The rule (Dao-AILab/flash-attention ``tests/test_flash_attn.py``): compute the same attention three
times on the same inputs,

* ``gold``: plain PyTorch in float64 (``attention_ref(..., upcast=True)``),
* ``baseline``: plain PyTorch in the kernel's own dtype (``upcast=False``), the error that ordinary
  code in that precision makes anyway,
* ``out``: the kernel,

and require ``max|out - gold| <= 2 * max|baseline - gold| + ATOL`` for the output and for each of
``dq, dk, dv`` (and the LSE). ``ATOL = 1e-5`` is a documented absolute slack for the float32 case and
for tiny problems, where both errors are of the order of 1e-7 and the factor 2 is noise in the last
bits; it is far below the errors of float16 (~1e-3) or bfloat16 (~1e-2), so it changes nothing there.
"""
import contextlib
import math

import torch

__all__ = [
    "ATOL",
    "FACTOR",
    "assert_flash_rule",
    "attention_ref",
    "device_work",
    "forward_backward",
    "make_inputs",
    "poisoned_outputs",
    "reference_forward_backward",
]

FACTOR = 2.0  # the kernel may be at most twice as far from float64 as plain PyTorch in its dtype
ATOL = 1e-5  # absolute slack; see the module docstring


def attention_ref(q, k, v, *, causal=False, softmax_scale=None, upcast=True, window=(-1, -1), softcap=0.0,
                  key_padding_mask=None, sinks=None):
    """Textbook attention in plain PyTorch, differentiable; returns ``(o, lse)``.

    Shapes as in ``fa_lib.flash_attention``: q ``(B, H_q, N_q, D)``, k and v ``(B, H_kv, N_k, D)``.
    ``upcast=True`` computes in float64 (the gold standard); ``upcast=False`` computes in the inputs'
    dtype (the same-precision baseline). ``o`` is returned in that compute dtype, ``lse`` in float32
    (float64 when upcast). Conventions: bottom-right causal mask and window, ``softcap`` applied as
    ``c * tanh(S / c)``, ``key_padding_mask`` (B, N_k) True = real key; a row with no visible key has
    output 0 and LSE -inf, and its gradients are 0. ``sinks`` (H_q,): one more score column per head, with
    value 0 (attention sinks), differentiable; a row then sees its sink even when it sees no key.
    """
    dtype = torch.float64 if upcast else q.dtype
    q, k, v = (t.to(dtype) for t in (q, k, v))
    n_q, n_k, d = q.shape[2], k.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (B, H_q, N_k, D): query head h uses k/v head h // group
    v = v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H_q, N_q, N_k)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    visible = None
    if left >= 0 or right >= 0:
        rows = torch.arange(n_q, device=q.device)[:, None] + (n_k - n_q)  # query i sits at key i + N_k - N_q
        cols = torch.arange(n_k, device=q.device)[None, :]
        visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
        if right >= 0:
            visible &= cols <= rows + right
        if left >= 0:
            visible &= cols >= rows - left
    if key_padding_mask is not None:
        kpm = key_padding_mask[:, None, None, :].to(q.device)
        visible = kpm if visible is None else (visible & kpm)
    if sinks is not None:
        if visible is not None:
            s = s.masked_fill(~visible, float("-inf"))
        full = torch.cat([s, sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
        dead = torch.isneginf(full).all(dim=-1, keepdim=True)  # no key and a sink of -inf
        full = full.masked_fill(dead, 0.0)
        p = torch.softmax(full, dim=-1)[..., :-1].masked_fill(dead, 0.0)
        lse = torch.logsumexp(full.to(torch.float64 if upcast else torch.float32), dim=-1)
        return torch.matmul(p, v), lse.masked_fill(dead[..., 0], float("-inf"))
    if visible is not None:
        empty = ~visible.any(dim=-1, keepdim=True)  # rows that see no key
        s = s.masked_fill(~visible, float("-inf"))
        s = s.masked_fill(empty, 0.0)  # keep the softmax finite on empty rows; they are zeroed below
    p = torch.softmax(s, dim=-1)  # (B, H_q, N_q, N_k)
    lse = torch.logsumexp(s.to(torch.float64 if upcast else torch.float32), dim=-1)  # (B, H_q, N_q)
    if visible is not None:
        p = p.masked_fill(empty, 0.0)
        lse = lse.masked_fill(empty[..., 0], float("-inf"))
    o = torch.matmul(p, v)  # (B, H_q, N_q, D)
    return o, lse


def make_inputs(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, device, *, seed,
                layout="bhnd"):
    """Fresh random q, k, v (leaf tensors with requires_grad) and an upstream gradient do.

    ``layout="bnhd"`` returns ``(B, H, N, D)`` views of ``(B, N, H, D)`` storage (non-contiguous),
    as a model that keeps heads next to each other produces with ``.transpose(1, 2)``.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(b, h, n, d):
        if layout == "bnhd":
            t = torch.randn(b, n, h, d, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)
        else:
            t = torch.randn(b, h, n, d, generator=gen).to(device=device, dtype=dtype)
        return t.requires_grad_()

    q = rand(batch, heads_q, seqlen_q, head_dim)
    k = rand(batch, heads_kv, seqlen_k, head_dim)
    v = rand(batch, heads_kv, seqlen_k, head_dim)
    do = rand(batch, heads_q, seqlen_q, head_dim).detach()
    return q, k, v, do


def _grads(o, lse, q, k, v, do, dlse, sinks=None):
    tensors = [o] if dlse is None else [o, lse]
    grads = [do.to(o.dtype)] if dlse is None else [do.to(o.dtype), dlse.to(lse.dtype)]
    if sinks is None:
        dq, dk, dv = torch.autograd.grad(tensors, (q, k, v), grads)
        return dict(o=o.detach(), lse=lse.detach(), dq=dq, dk=dk, dv=dv)
    dq, dk, dv, dsinks = torch.autograd.grad(tensors, (q, k, v, sinks), grads)
    return dict(o=o.detach(), lse=lse.detach(), dq=dq, dk=dk, dv=dv, dsinks=dsinks)


def reference_forward_backward(q, k, v, do, *, causal=False, softmax_scale=None, upcast=True, dlse=None, **masks):
    """``attention_ref`` forward and backward; returns a dict with o, lse, dq, dk, dv. ``masks``: window,
    softcap, key_padding_mask, as ``attention_ref`` takes them."""
    # Gold gradients must be float64 too: autograd returns them in the leaves' dtype.
    leaves = [t.detach().to(torch.float64 if upcast else t.dtype).requires_grad_() for t in (q, k, v)]
    sinks = masks.pop("sinks", None)
    if sinks is not None:  # the sinks in float64 for the gold, in float32 (fa_lib's arithmetic) otherwise
        sinks = sinks.detach().to(torch.float64 if upcast else torch.float32).requires_grad_()
    o, lse = attention_ref(*leaves, causal=causal, softmax_scale=softmax_scale, upcast=upcast, sinks=sinks, **masks)
    return _grads(o, lse, *leaves, do, dlse, sinks)


def forward_backward(q, k, v, do, *, causal=False, softmax_scale=None, dlse=None, **masks):
    """``fa_lib.flash_attention`` forward and backward, outputs poisoned; returns o, lse, dq, dk, dv.
    ``masks``: window, softcap, key_padding_mask, sinks, passed to ``flash_attention`` (with sinks, dsinks too)."""
    from .ops import flash_attention

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    sinks = masks.pop("sinks", None)
    if sinks is not None:
        sinks = sinks.detach().requires_grad_()
    with poisoned_outputs():
        o, lse = flash_attention(*leaves, causal=causal, softmax_scale=softmax_scale, return_lse=True, sinks=sinks,
                                 **masks)
        return _grads(o, lse, *leaves, do, dlse, sinks)


@contextlib.contextmanager
def poisoned_outputs():
    """Inside this block, fa_lib fills every output buffer with NaN before its kernel runs."""
    from . import launch

    before = launch._POISON_OUTPUTS
    launch._POISON_OUTPUTS = True
    try:
        yield
    finally:
        launch._POISON_OUTPUTS = before


def _max_error(x, gold):
    x, gold = x.double(), gold.double()
    both_inf = torch.isinf(gold) & (x == gold)  # an LSE of -inf on an empty row, matched exactly
    diff = torch.where(both_inf, 0.0, (x - gold).abs())
    return diff.max().item() if diff.numel() else 0.0


def assert_flash_rule(out, gold, baseline, *, names=("o", "lse", "dq", "dk", "dv"), factor=FACTOR, atol=ATOL):
    """Check ``max|out - gold| <= factor * max|baseline - gold| + atol`` for each name.

    ``out``, ``gold`` and ``baseline`` are dicts as returned by ``forward_backward`` and
    ``reference_forward_backward``. NaN anywhere in ``out`` fails (poisoned, unwritten elements).
    Returns ``{name: (error, baseline_error, ratio)}`` with ``ratio = error / baseline_error``.
    """
    report, failures = {}, []
    for name in names:
        x, g, b = out[name], gold[name], baseline[name]
        if x.shape != g.shape:
            failures.append(f"{name}: shape {tuple(x.shape)} != reference {tuple(g.shape)}")
            continue
        n_nan = torch.isnan(x).sum().item()
        if n_nan:
            failures.append(f"{name}: {n_nan} NaN element(s) (unwritten output or NaN arithmetic)")
            continue
        err, base = _max_error(x, g), _max_error(b, g)
        ratio = err / base if base > 0 else (0.0 if err == 0 else math.inf)
        report[name] = (err, base, ratio)
        if not err <= factor * base + atol:
            failures.append(f"{name}: max error {err:.3e} > {factor:g} x baseline {base:.3e} + {atol:g} "
                            f"(ratio {ratio:.2f})")
    assert not failures, "flash-attn rule failed: " + "; ".join(failures)
    return report


# PyTorch operators that run no kernel: views and allocations (`device_work` leaves them out).
_NO_KERNEL = frozenset({
    "aten.transpose.int", "aten.permute.default", "aten.unsqueeze.default", "aten.expand.default", "aten.view.default",
    "aten.alias.default", "aten.slice.Tensor", "aten.select.int", "aten.detach.default", "aten.as_strided.default",
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.new_empty.default"})


def device_work(fn):
    """Call ``fn()`` and return ``(launches, operators)``: the names of the Triton kernels fa_lib launched, in
    order, and the PyTorch operators outside those launches that run a kernel of their own (views and
    allocations left out; what the Triton interpreter does inside a launch is not counted). On a GPU each entry
    of either list is one kernel on the stream; inside a CUDA graph each still costs its replay time. Works on
    the CPU too, where it counts what the same call would launch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from . import launch

    if not callable(fn):
        raise TypeError(f"fn must be a callable that takes no arguments, got {type(fn).__name__}")
    launches, operators, inside = [], [], []

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside and str(func) not in _NO_KERNEL:
                operators.append(str(func))
            return func(*args, **(kwargs or {}))

    real = launch.launch

    def counted(kernel, grid, args, kwargs):
        launches.append(kernel.fn.__name__)
        inside.append(1)
        try:
            real(kernel, grid, args, kwargs)
        finally:
            inside.pop()

    launch.launch = counted
    try:
        with _Count():
            fn()
    finally:
        launch.launch = real
    return launches, operators
