"""flash-attn 2's Python API (``flash_attn.flash_attn_interface``) on fa_lib's kernels: switch with one import.

Thin wrappers in the caller's layout and argument names over the native API (``fa_lib.flash_attention``,
``flash_attention_varlen``, ``flash_attention_with_kvcache``), which keeps (batch, heads, seqlen, head_dim) and its
own conventions. Every wrapper checks its arguments in the caller's layout before anything is transposed, so an
error names the caller's argument (``window_size``, ``k_cache``, ``qkv``) and prints the shape the caller passed.

Where flash-attn's rules differ from fa_lib's native conventions, the wrappers follow flash-attn:

=============================================  ==========================================  ===========================
convention                                     these wrappers (flash-attn 2)               native fa_lib API
=============================================  ==========================================  ===========================
layout of q, k, v, out                         (batch, seqlen, heads, head_dim); varlen    (batch, heads, seqlen,
                                               (total, heads, head_dim)                    head_dim)
LSE layout                                     (batch, heads, seqlen_q); varlen            (batch, heads, seqlen_q);
                                               (heads, total_q)                            varlen (heads, total_q)
LSE of a query row that sees no key            ``+inf`` (output row 0)                     ``-inf`` (output row 0)
LSE differentiable                             no (returned detached, as flash-attn's      yes
                                               gradient into it is dropped)
window side ``>= seqlen_k`` (``max_seqlen_k``  unbounded (-1): with Nq = 10, Nk = 2,        kept: the band stands (rows
varlen, the cache's capacity for kvcache)      ``(-1, 2)`` lets rows 0-5 see every key     0-5 see no key, output 0)
``window_size`` given as tensors               a pair of ints or 0-d integer tensors, or   a pair of Python ints
                                               an integer tensor of two entries
varlen ``cu_seqlens[-1] < tokens``             accepted; the trailing rows are not         ``ValueError``
(a padded buffer kept for CUDA graphs)         attended: output 0, LSE ``+inf``, zero
                                               gradients (flash-attn leaves them
                                               undefined)
paged prefill (``block_table``) on inputs      the forward runs; a backward through it     ``ValueError`` before the
that require grad                              raises ``RuntimeError``                     forward
``deterministic``                              default False; the backward only: the       default True; False also
                                               forward always takes the fixed blocks       autotunes the forward
=============================================  ==========================================  ===========================

Where flash-attn runs something fa_lib does not, the wrappers refuse it rather than return something plausible:
``dropout_p != 0`` and ``alibi_slopes`` (``ValueError``); a window side below -1 and a negative ``softcap``
(``ValueError``; flash-attn reads a negative side as unbounded and a softcap <= 0 as off); a non-bool flag
(``TypeError``). ``return_attn_probs=True``
returns ``(out, softmax_lse, None)``: flash-attn's third entry, ``S_dmask``, is ``None`` too without dropout.

One addition flash-attn 2 does not have: every wrapper takes ``sinks=None``, attention sinks (gpt-oss's learnable
logit per query head, ``(heads_q,)``; vLLM's flash-attn calls it ``s_aux``), as ``fa_lib.flash_attention`` does.

Under ``torch.compile`` the values of ``cu_seqlens`` cannot be read, so there ``cu_seqlens[-1]`` must equal the token
count (as for the native API, nothing is checked while tracing).
"""
import math
import numbers
import weakref

import torch
import torch.nn.functional as F

from . import checks, decode, ops
from .sinks import _with_sinks

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

_DENSE = ("batch", "seqlen", "heads", "head_dim")


# ---------------------------------------------------------------------------------------------------
# Checks in the caller's layout.
# ---------------------------------------------------------------------------------------------------
_type_name = checks._type_name


def _tensor(name, t, dims):
    """`t` a torch.Tensor with len(dims) dimensions, named `dims` in the error."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {_type_name(t)}")
    if t.dim() != len(dims):
        raise ValueError(f"{name} must be a {len(dims)}-D tensor ({', '.join(dims)}) in flash-attn's layout, got "
                         f"shape {tuple(t.shape)}")
    return t


def _dtypes_devices(named):
    """[(name, tensor)], the first the reference: supported dtypes, one dtype and one device the kernels run on."""
    for name, t in named:
        if t.dtype not in checks._DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; fa_lib supports torch.float16, torch.bfloat16 and "
                            f"torch.float32")
    first, t0 = named[0]
    names = ", ".join(n for n, _ in named)
    for name, t in named[1:]:
        if t.dtype != t0.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {first} has dtype {t0.dtype}; {names} must share one "
                            f"dtype")
        if t.device != t0.device:
            raise ValueError(f"{name} is on device {t.device} but {first} is on {t0.device}; {names} must be on one "
                             f"device")
    device = t0.device
    if device.type == "meta":
        raise ValueError(f"{names} are meta tensors (no data); fa_lib's kernels need tensors on a CUDA device (or CPU "
                         f"tensors under the Triton interpreter)")
    if device.type != "cuda" and not checks._interpreting():
        raise ValueError(f"{names} are on device {device}, but the Triton kernels run on a CUDA device; move them "
                         f"with .cuda()")
    if device.type != "cpu" and checks._interpreting():
        raise ValueError(f"{names} are on device {device}, but fa_lib runs its kernels under the Triton interpreter "
                         f"(TRITON_INTERPRET is on), which takes CPU tensors; move them with .cpu() or unset "
                         f"TRITON_INTERPRET before starting Python")


def _head_dim(name, d):
    if not checks._MIN_HEAD_DIM <= d <= checks._MAX_HEAD_DIM:
        raise ValueError(f"head_dim ({name}) must be between {checks._MIN_HEAD_DIM} and {checks._MAX_HEAD_DIM}, got {d}")


def _heads(q_name, h_q, kv_name, h_kv):
    if h_q < 1 or h_kv < 1 or h_q % h_kv:
        raise ValueError(f"the number of query heads ({h_q}, {q_name}) must be a multiple of the number of key/value "
                         f"heads ({h_kv}, {kv_name}), both at least 1, for grouped-query attention")


def _unsupported(dropout_p, alibi_slopes):
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or dropout_p != 0.0:
        raise ValueError(f"dropout_p={dropout_p!r} is not supported by fa_lib (attention dropout is not "
                         f"implemented); pass 0.0")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes is not supported by fa_lib; pass None")


def _flags(**flags):
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")


def _side(w):
    """One side of a window_size as an int: a Python (or NumPy) int or a 0-d integer tensor; None otherwise."""
    if isinstance(w, torch.Tensor):
        if w.dim() == 0 and not (w.is_floating_point() or w.is_complex() or w.dtype == torch.bool):
            return int(w)
        return None
    if isinstance(w, bool) or not isinstance(w, numbers.Integral):
        return None
    return int(w)


def _window_size(window_size, seqlen_k):
    """flash-attn's ``window_size`` as the native ``window``: a pair of ints or of 0-d integer tensors, or an integer
    tensor of two entries (flash-attn's tests pass it so); each side -1 (unbounded) or >= 0. A side of at least
    ``seqlen_k`` is unbounded, as flash-attn's C++ API makes it before launching."""
    if isinstance(window_size, torch.Tensor):
        ok = window_size.dim() == 1 and window_size.shape[0] == 2 and _side(window_size[0]) is not None
        sides = window_size.tolist() if ok else None
    elif isinstance(window_size, (tuple, list)) and len(window_size) == 2:
        sides = [_side(w) for w in window_size]
        sides = None if None in sides else sides
    else:
        sides = None
    if sides is None:
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 meaning unbounded, got {window_size!r}")
    if any(w < -1 for w in sides):
        raise ValueError(f"window_size sides must be >= 0, or -1 for unbounded, got {tuple(sides)}")
    return tuple(-1 if w >= seqlen_k else w for w in sides)


def _lse(lse):
    """The LSE as flash-attn returns it: not differentiable, +inf for a row that sees no key (fa_lib: -inf). Out of
    place: the LSE may be saved for the backward."""
    lse = lse.detach()
    return torch.where(torch.isneginf(lse), float("inf"), lse)


def _caller_layout(o, q):
    """o (batch, seqlen, heads, head_dim) as flash-attn allocates it, ``empty_like(q)``: q's strides when q is dense
    (the kernels already wrote it so), contiguous otherwise (q a slice of a packed qkv, say), so that
    ``out.view(batch, seqlen, -1)`` works wherever it works with flash-attn."""
    return o if o.stride() == q.stride() else o.contiguous()


# ---------------------------------------------------------------------------------------------------
# Autograd: flash-attn's forward is always deterministic; its `deterministic` chooses the backward only.
# ---------------------------------------------------------------------------------------------------
class _DenseFunction(torch.autograd.Function):
    """`ops._FlashAttnFunction` with the forward on the fixed blocks (deterministic=True) whatever the backward's
    `deterministic`, which the context keeps. Inputs: q, k, v (B, H, N, D views), causal, scale, deterministic,
    window_left, window_right, softcap."""

    @staticmethod
    def forward(ctx, *inputs):
        q, k, v, causal, scale, deterministic, *masks = inputs
        compiling = torch.compiler.is_compiling()
        out = (ops._flash_attn_fwd if compiling else ops._forward_flat)(q, k, v, causal, scale, True, *masks)
        ops._setup_context(ctx, inputs, out)  # ctx.deterministic: the backward's
        ctx.compiled = compiling
        return out

    @staticmethod
    def backward(ctx, do, dlse):
        return ops._backward_op(ctx, do, dlse, None if ctx.compiled else ops._backward_flat)


class _VarlenFunction(torch.autograd.Function):
    """`ops._FlashAttnVarlenFunction` with the forward on the fixed blocks, as `_DenseFunction`. Inputs: as
    `ops._varlen_forward` takes them."""

    @staticmethod
    def forward(ctx, *inputs):
        q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, deterministic, *masks = inputs
        compiling = torch.compiler.is_compiling()
        out = (ops._flash_attn_varlen_fwd if compiling else ops._varlen_forward)(
            q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, True, *masks)
        ops._setup_varlen(ctx, inputs, out)
        ctx.compiled = compiling
        return out

    @staticmethod
    def backward(ctx, do, dlse):
        return ops._backward_varlen(ctx, do, dlse, None if ctx.compiled else ops._varlen_backward)


def _paged_forward(*inputs):
    run = torch.ops.fa_lib.flash_attn_varlen_paged_fwd if torch.compiler.is_compiling() else ops._paged_varlen_forward
    return run(*inputs)


_NO_PAGED_BACKWARD = ("flash_attn_varlen_func with a block_table (a paged KV cache) is forward only: fa_lib has no "
                      "backward over pages. Gather the keys into a packed (total_k, heads_kv, head_dim) tensor and "
                      "call it without block_table to differentiate.")


@torch.library.custom_op("fa_lib::paged_prefill_no_backward", mutates_args=())
def _paged_no_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of a paged prefill: raises when it runs. An operator, so that torch.compile traces it (by its
    fake) and the error comes when a backward runs, not while the forward is compiled."""
    raise RuntimeError(_NO_PAGED_BACKWARD)


@_paged_no_backward.register_fake
def _(do, q, k, v):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _PagedFunction(torch.autograd.Function):
    """The paged prefill on inputs that require grad: the forward runs (flash-attn refuses only a backward), and a
    backward through it raises ``RuntimeError`` instead of returning gradients that no kernel computed."""

    @staticmethod
    def forward(ctx, *inputs):
        o, lse = _paged_forward(*inputs)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(*inputs[:3])
        ctx.n_inputs = len(inputs)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        grads = torch.ops.fa_lib.paged_prefill_no_backward(do, *ctx.saved_tensors)
        return (*grads,) + (None,) * (ctx.n_inputs - 3)


# ---------------------------------------------------------------------------------------------------
# Dense batches.
# ---------------------------------------------------------------------------------------------------
def _dense(q, k, v, softmax_scale, causal, window, softcap, deterministic, return_attn_probs, sinks=None):
    """q, k, v (B, N, H, D), checked in that layout; window already flash-attn's rule; sinks (H_q,) or None."""
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    scale = ops._check_inputs(qh, kh, vh, causal, softmax_scale)  # (shapes, dtypes, devices passed already)
    (left, right), softcap = ops._check_window_softcap(window, softcap)
    sinks = checks._check_sinks(sinks, qh.shape[1], q.device)
    if not torch.compiler.is_compiling() and ops._untracked(qh, kh, vh):
        o, lse = ops._forward_flat(qh, kh, vh, causal, scale, True, left, right, softcap)
    else:
        o, lse = _DenseFunction.apply(qh, kh, vh, causal, scale, deterministic, left, right, softcap)
    if sinks is not None:
        o, lse = _with_sinks(o, lse, sinks.view(1, -1, 1), lambda f: f.unsqueeze(-1))
    o = _caller_layout(o.transpose(1, 2), q)
    return (o, _lse(lse), None) if return_attn_probs else o


def _dense_shapes(q_name, q, k_name, k, v_name, v):
    """q (B, N_q, H_q, D), k and v (B, N_k, H_kv, D), checked 4-D already."""
    if k.shape != v.shape:
        raise ValueError(f"{v_name} must have the shape of {k_name}, (batch, seqlen_k, heads_kv, head_dim) = "
                         f"{tuple(k.shape)}, got {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{q_name} and {k_name} must share batch (dim 0) and head_dim (dim 3) in flash-attn's layout, "
                         f"got {q_name} {tuple(q.shape)} and {k_name} {tuple(k.shape)}")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, sinks=None):
    """flash-attn's ``flash_attn_func``: q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k, heads_kv,
    head_dim) with heads a multiple of heads_kv (GQA/MQA). Returns out (batch, seqlen_q, heads, head_dim), or with
    ``return_attn_probs=True`` ``(out, softmax_lse, None)``, softmax_lse (batch, heads, seqlen_q) float32, not
    differentiable.

    ``causal`` aligns bottom-right (flash-attn 2.1+); ``window_size=(left, right)``, -1 unbounded, a side of at least
    seqlen_k unbounded too; ``softcap`` > 0 caps the scores at ``softcap * tanh(s / softcap)``. ``deterministic``
    (default False) is the backward's: False lets it autotune its blocks and, where that measured faster, add dQ with
    atomics in one pass (see ``fa_lib.flash_attention``); the forward always takes the fixed blocks, so the same
    inputs give the same output bits in every process. See this module's docstring for where fa_lib's conventions
    differ and what it refuses."""
    _unsupported(dropout_p, alibi_slopes)
    _flags(deterministic=deterministic, return_attn_probs=return_attn_probs)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor(name, t, _DENSE)
    _dense_shapes("q", q, "k", k, "v", v)
    _heads("q.shape[2]", q.shape[2], "k.shape[2]", k.shape[2])
    _head_dim("q.shape[3]", q.shape[3])
    _dtypes_devices([("q", q), ("k", k), ("v", v)])
    window = _window_size(window_size, k.shape[1])
    return _dense(q, k, v, softmax_scale, causal, window, softcap, deterministic, return_attn_probs, sinks=sinks)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, return_attn_probs=False, sinks=None):
    """flash-attn's ``flash_attn_qkvpacked_func``: ``flash_attn_func`` on ``qkv`` (batch, seqlen, 3, heads, head_dim),
    q, k and v stacked on dim 2 (as a fused projection leaves them); the gradient flows into ``qkv``. Returns out
    (batch, seqlen, heads, head_dim), contiguous, or ``(out, softmax_lse, None)``."""
    _unsupported(dropout_p, alibi_slopes)
    _flags(deterministic=deterministic, return_attn_probs=return_attn_probs)
    _tensor("qkv", qkv, ("batch", "seqlen", "3", "heads", "head_dim"))
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv must have q, k and v stacked on dim 2, (batch, seqlen, 3, heads, head_dim), got shape "
                         f"{tuple(qkv.shape)}")
    _heads("qkv.shape[3]", qkv.shape[3], "qkv.shape[3]", qkv.shape[3])
    _head_dim("qkv.shape[4]", qkv.shape[4])
    _dtypes_devices([("qkv", qkv)])
    q, k, v = qkv.unbind(2)
    window = _window_size(window_size, qkv.shape[1])
    return _dense(q, k, v, softmax_scale, causal, window, softcap, deterministic, return_attn_probs, sinks=sinks)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                             alibi_slopes=None, deterministic=False, return_attn_probs=False, sinks=None):
    """flash-attn's ``flash_attn_kvpacked_func``: ``flash_attn_func`` with k and v stacked in ``kv`` (batch, seqlen_k,
    2, heads_kv, head_dim); the gradient flows into ``kv``. Returns out (batch, seqlen_q, heads, head_dim) or
    ``(out, softmax_lse, None)``."""
    _unsupported(dropout_p, alibi_slopes)
    _flags(deterministic=deterministic, return_attn_probs=return_attn_probs)
    _tensor("q", q, _DENSE)
    _tensor("kv", kv, ("batch", "seqlen_k", "2", "heads_kv", "head_dim"))
    if kv.shape[2] != 2:
        raise ValueError(f"kv must have k and v stacked on dim 2, (batch, seqlen_k, 2, heads_kv, head_dim), got shape "
                         f"{tuple(kv.shape)}")
    if q.shape[0] != kv.shape[0] or q.shape[3] != kv.shape[4]:
        raise ValueError(f"q and kv must share batch (q.shape[0], kv.shape[0]) and head_dim (q.shape[3], kv.shape[4]), "
                         f"got q {tuple(q.shape)} and kv {tuple(kv.shape)}")
    _heads("q.shape[2]", q.shape[2], "kv.shape[3]", kv.shape[3])
    _head_dim("q.shape[3]", q.shape[3])
    _dtypes_devices([("q", q), ("kv", kv)])
    k, v = kv.unbind(2)
    window = _window_size(window_size, kv.shape[1])
    return _dense(q, k, v, softmax_scale, causal, window, softcap, deterministic, return_attn_probs, sinks=sinks)


# ---------------------------------------------------------------------------------------------------
# Packed variable-length batches.
# ---------------------------------------------------------------------------------------------------
# The last entry of CUDA cu_seqlens tensors: {id: (weak reference, version, end)}, read once per tensor and version
# (a device sync), as `checks._CHECKED_CU` checks the values.
_ENDS = {}


def _end(cu):
    """cu[-1] as a Python int."""
    if not cu.is_cuda:
        return int(cu[-1])
    seen = _ENDS.get(id(cu))
    if seen is not None and seen[0]() is cu and seen[1] == cu._version:
        return seen[2]
    end = int(cu[-1])
    if len(_ENDS) > 64:
        for key in [key for key, val in _ENDS.items() if val[0]() is None]:
            del _ENDS[key]
    _ENDS[id(cu)] = (weakref.ref(cu), cu._version, end)
    return end


def _cu_seqlens(name, cu, total, tokens_name, device):
    """(cu, longest sequence, cu[-1]) of a checked cu_seqlens; `total`: the packed tokens it may end before (None:
    anywhere, as the keys over pages). While torch.compile traces: (cu, None, total)."""
    cu, longest = ops._check_cu_seqlens(name, cu, None, device)  # int32, 1-D, from 0, non-decreasing
    if longest is None:
        return cu, None, total
    end = _end(cu)
    if total is not None and end > total:
        raise ValueError(f"{name}[-1] = {end} is more than the {total} packed tokens of {tokens_name}")
    return cu, longest, end


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
            softcap, deterministic, return_attn_probs, block_table, names, sinks=None):
    """q (total_q, H_q, D); k, v (total_k, H_kv, D) or pools of pages, checked in that layout. `names`: the caller's
    names of q's and k's tensors, of the two cu_seqlens and the two max_seqlen."""
    paged = block_table is not None
    cu_q, longest_q, end_q = _cu_seqlens(names["cu_q"], cu_seqlens_q, q.shape[0], f"{names['q']}.shape[0]", q.device)
    cu_k, longest_k, end_k = _cu_seqlens(names["cu_k"], cu_seqlens_k, None if paged else k.shape[0],
                                         f"{names['k']}.shape[0]", q.device)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"{names['cu_q']} and {names['cu_k']} must both have length batch + 1, got {cu_q.shape[0]} "
                         f"and {cu_k.shape[0]}")
    max_q = ops._check_max_seqlen(names["max_q"], max_seqlen_q, longest_q, names["cu_q"])
    max_k = ops._check_max_seqlen(names["max_k"], max_seqlen_k, longest_k, names["cu_k"])
    window = _window_size(window_size, max_k)
    # Rows past cu_seqlens[-1] belong to no sequence: cut off here, given back as zeros below.
    qs = q if end_q == q.shape[0] else q[:end_q]
    ks, vs = (k, v) if paged or end_k == k.shape[0] else (k[:end_k], v[:end_k])
    q4, k4, v4 = (ops._heads_view(t) for t in (qs, k[0] if paged else ks, v[0] if paged else vs))
    scale = ops._check_inputs(q4, k4, v4, causal, softmax_scale)  # (shapes, dtypes, devices passed already)
    (left, right), softcap = ops._check_window_softcap(window, softcap)
    sinks = checks._check_sinks(sinks, q.shape[1], q.device)
    if paged:
        checks._check_block_table(block_table, q.device)
        table = ops._check_table(qs, k, cu_k, block_table)
        inputs = (qs, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, table)
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        o, lse = _PagedFunction.apply(*inputs) if needs_grad else _paged_forward(*inputs)
    elif torch.compiler.is_compiling() or not ops._untracked(q, k, v):
        o, lse = _VarlenFunction.apply(qs, ks, vs, cu_q, cu_k, max_q, max_k, causal, scale, deterministic, left,
                                       right, softcap)
    else:
        o, lse = ops._varlen_forward(qs, ks, vs, cu_q, cu_k, max_q, max_k, causal, scale, True, left, right, softcap)
    if sinks is not None:  # lse (H_q, total_q)
        o, lse = _with_sinks(o, lse, sinks.view(-1, 1), lambda f: f.t().unsqueeze(-1))
    pad = q.shape[0] - qs.shape[0]
    if pad:
        o = F.pad(o, (0, 0, 0, 0, 0, pad))  # zeros (differentiable: their gradient is dropped)
    if not return_attn_probs:
        return o
    lse = _lse(lse)
    return o, (F.pad(lse, (0, pad), value=math.inf) if pad else lse), None


def _varlen_shapes(q_name, q, k_name, k, v_name, v, paged):
    """q (total_q, H_q, D); k, v (total_k, H_kv, D), or (num_blocks, page_block_size, H_kv, D) pools when paged."""
    if k.shape != v.shape:
        what = "(num_blocks, page_block_size, heads_kv, head_dim)" if paged else "(total_k, heads_kv, head_dim)"
        raise ValueError(f"{v_name} must have the shape of {k_name}, {what} = {tuple(k.shape)}, got {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{q_name} and {k_name} must share head_dim (the last dimension), got {q_name} "
                         f"{tuple(q.shape)} and {k_name} {tuple(k.shape)}")
    if paged and (k.shape[0] < 1 or k.shape[1] < 1):
        raise ValueError(f"with a block_table, {k_name} must be a pool of pages (num_blocks >= 1, page_block_size "
                         f">= 1, heads_kv, head_dim), got shape {tuple(k.shape)}")


_VARLEN_NAMES = dict(q="q", k="k", cu_q="cu_seqlens_q", cu_k="cu_seqlens_k", max_q="max_seqlen_q",
                     max_k="max_seqlen_k")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, sinks=None):
    """flash-attn's ``flash_attn_varlen_func``: a packed batch, q (total_q, heads, head_dim), k and v (total_k,
    heads_kv, head_dim), sequence b at rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` (and the same for keys);
    ``cu_seqlens_*`` int32 (batch + 1,), ``max_seqlen_*`` at least the longest sequence. Returns out (total_q, heads,
    head_dim), or ``(out, softmax_lse, None)`` with softmax_lse (heads, total_q) float32, not differentiable.

    ``cu_seqlens_q[-1]`` and ``cu_seqlens_k[-1]`` may be less than the packed tokens (a buffer padded for CUDA
    graphs): the rows after them belong to no sequence; their output rows are 0 (flash-attn leaves them undefined),
    their LSE +inf, their gradients 0. A window side of at least ``max_seqlen_k`` is unbounded, as in flash-attn.

    ``block_table`` (batch, W) int32: k and v are then pools of pages (num_blocks, page_block_size, heads_kv,
    head_dim), any page size, and key j of sequence b is row ``j % page_block_size`` of page
    ``block_table[b, j // page_block_size]`` (``cu_seqlens_k`` gives the key counts). Forward only: it runs on inputs
    that require grad, and a backward through it raises ``RuntimeError``. Other arguments as ``flash_attn_func``."""
    _unsupported(dropout_p, alibi_slopes)
    _flags(deterministic=deterministic, return_attn_probs=return_attn_probs)
    paged = block_table is not None
    _tensor("q", q, ("total_q", "heads", "head_dim"))
    kv_dims = ("num_blocks", "page_block_size", "heads_kv", "head_dim") if paged else ("total_k", "heads_kv",
                                                                                      "head_dim")
    _tensor("k", k, kv_dims)
    _tensor("v", v, kv_dims)
    _varlen_shapes("q", q, "k", k, "v", v, paged)
    _heads("q.shape[1]", q.shape[1], f"k.shape[{k.dim() - 2}]", k.shape[-2])
    _head_dim("q.shape[2]", q.shape[2])
    _dtypes_devices([("q", q), ("k", k), ("v", v)])
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
                   softcap, deterministic, return_attn_probs, block_table, _VARLEN_NAMES, sinks=sinks)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, sinks=None):
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: ``flash_attn_varlen_func`` on ``qkv`` (total, 3, heads,
    head_dim), one ``cu_seqlens`` and ``max_seqlen`` for queries and keys; the gradient flows into ``qkv``. Returns
    out (total, heads, head_dim) or ``(out, softmax_lse, None)``."""
    _unsupported(dropout_p, alibi_slopes)
    _flags(deterministic=deterministic, return_attn_probs=return_attn_probs)
    _tensor("qkv", qkv, ("total", "3", "heads", "head_dim"))
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must have q, k and v stacked on dim 1, (total, 3, heads, head_dim), got shape "
                         f"{tuple(qkv.shape)}")
    _heads("qkv.shape[2]", qkv.shape[2], "qkv.shape[2]", qkv.shape[2])
    _head_dim("qkv.shape[3]", qkv.shape[3])
    _dtypes_devices([("qkv", qkv)])
    q, k, v = qkv.unbind(1)
    names = dict(q="qkv", k="qkv", cu_q="cu_seqlens", cu_k="cu_seqlens", max_q="max_seqlen", max_k="max_seqlen")
    return _varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale, causal, window_size, softcap,
                   deterministic, return_attn_probs, None, names, sinks=sinks)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, sinks=None):
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: ``flash_attn_varlen_func`` with k and v stacked in ``kv``
    (total_k, 2, heads_kv, head_dim); the gradient flows into ``kv``. Returns out (total_q, heads, head_dim) or
    ``(out, softmax_lse, None)``."""
    _unsupported(dropout_p, alibi_slopes)
    _flags(deterministic=deterministic, return_attn_probs=return_attn_probs)
    _tensor("q", q, ("total_q", "heads", "head_dim"))
    _tensor("kv", kv, ("total_k", "2", "heads_kv", "head_dim"))
    if kv.shape[1] != 2:
        raise ValueError(f"kv must have k and v stacked on dim 1, (total_k, 2, heads_kv, head_dim), got shape "
                         f"{tuple(kv.shape)}")
    if q.shape[2] != kv.shape[3]:
        raise ValueError(f"q and kv must share head_dim (q.shape[2], kv.shape[3]), got q {tuple(q.shape)} and kv "
                         f"{tuple(kv.shape)}")
    _heads("q.shape[1]", q.shape[1], "kv.shape[2]", kv.shape[2])
    _head_dim("q.shape[2]", q.shape[2])
    _dtypes_devices([("q", q), ("kv", kv)])
    k, v = kv.unbind(1)
    names = dict(_VARLEN_NAMES, k="kv")
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
                   softcap, deterministic, return_attn_probs, None, names, sinks=sinks)


# ---------------------------------------------------------------------------------------------------
# Decoding with a KV cache.
# ---------------------------------------------------------------------------------------------------
# The native API's words in the errors `flash_attn_with_kvcache` cannot raise first: the check of the lengths (its axis
# of the cache) and of autograd.
_KVCACHE_WORDS = (("k_cache.shape[2]", "k_cache.shape[1]"),
                  ("flash_attention_with_kvcache is forward-only", "flash_attn_with_kvcache is forward-only"))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, sinks=None):
    """flash-attn's ``flash_attn_with_kvcache``, on fa_lib's split kernel (``flash_attention_with_kvcache``): same
    argument names, order and defaults (``causal=False``); forward only.

    **Layout: (batch, seqlen, heads, head_dim)**: q (B, N_q, H_q, d); k_cache, v_cache (B, seqlen_cache, H_kv, d),
    or with ``block_table`` (B, W) int32 a pool of pages (num_blocks, page_block_size, H_kv, d), any page size; k, v
    (B, N_new, H_kv, d), appended in place. ``cache_seqlens``: an int, a (B,) int32 tensor, or None for every cached
    key (then k and v cannot be appended: their position would be unknown; rotary positions start after the last
    key). ``num_splits=0``: the heuristic's count. ``window_size`` and ``softcap`` as in flash-attn (a window side
    of at least the cache's capacity, seqlen_cache or W * page_block_size, is unbounded). Returns o (B, N_q, H_q, d),
    contiguous, and with ``return_softmax_lse`` also the LSE (B, H_q, N_q) float32, +inf for a query that sees no
    key.

    ``rotary_cos``, ``rotary_sin`` (seqlen_ro, rotary_dim / 2), as flash-attn takes them: the first rotary_dim
    channels of the new keys are rotated at positions ``cache_seqlens[b] + j`` before the append, and those of
    the queries at ``cache_seqlens[b] + i`` (causal or windowed) or all at ``cache_seqlens[b]`` (otherwise);
    ``rotary_interleaved`` pairs channels (0, 1), (2, 3), ... (GPT-J) or c and c + rotary_dim / 2 (GPT-NeoX). It is
    applied in float32 and rounded to q's dtype, fused (see ``flash_attention_with_kvcache``); a position past
    seqlen_ro is refused when the lengths are checked, else clamped.

    ``cache_batch_idx`` (B,) int32: sequence b's cache is row ``cache_batch_idx[b]`` of k_cache, v_cache (B_cache,
    seqlen_cache, H_kv, d); ``cache_leftpad`` (B,) int32: sequence b's keys start at cache position
    ``cache_leftpad[b]`` (rotary positions stay the cache positions, as in flash-attn). Neither with ``block_table``;
    see ``flash_attention_with_kvcache``. Refused with a ``ValueError`` rather than ignored: ``alibi_slopes``."""
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes is not supported by fa_lib's flash_attn_with_kvcache; pass None")
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or \
            not 0 <= num_splits <= decode._MAX_EXPLICIT_SPLITS:
        raise ValueError(f"num_splits must be an int from 0 (the heuristic's count) to {decode._MAX_EXPLICIT_SPLITS}, "
                         f"got {num_splits!r}")
    _flags(return_softmax_lse=return_softmax_lse)
    paged = block_table is not None
    _tensor("q", q, ("batch", "seqlen_q", "heads", "head_dim"))
    cache_dims = (("num_blocks", "page_block_size", "heads_kv", "head_dim") if paged else
                  ("batch", "seqlen_cache", "heads_kv", "head_dim"))
    _tensor("k_cache", k_cache, cache_dims)
    _tensor("v_cache", v_cache, cache_dims)
    for name, t in (("k", k), ("v", v)):
        if t is not None:
            _tensor(name, t, ("batch", "seqlen_new", "heads_kv", "head_dim"))
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and their values) or both be None")
    B, _, H_Q, D = q.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache, ({', '.join(cache_dims)}) = {tuple(k_cache.shape)}, "
                         f"got {tuple(v_cache.shape)}")
    if paged:
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor, got {_type_name(block_table)}")
        if block_table.dim() != 2 or block_table.shape[0] != B:
            raise ValueError(f"block_table must have shape (batch, pages per sequence) = ({B}, W), got "
                             f"{tuple(block_table.shape)}")
        if k_cache.shape[0] < 1 or k_cache.shape[1] < 1 or k_cache.shape[3] != D:
            raise ValueError(f"with a block_table, k_cache must be a pool of pages (num_blocks >= 1, page_block_size "
                             f">= 1, heads_kv, head_dim = {D}), got shape {tuple(k_cache.shape)}")
        capacity, capacity_name = block_table.shape[1] * k_cache.shape[1], "block_table.shape[1] * k_cache.shape[1]"
    else:
        if cache_batch_idx is not None:
            if k_cache.shape[0] < 1 or k_cache.shape[3] != D:
                raise ValueError(f"with cache_batch_idx, k_cache must be (cache rows >= 1, seqlen_cache, heads_kv, "
                                 f"head_dim = {D}), got shape {tuple(k_cache.shape)}")
        elif k_cache.shape[0] != B or k_cache.shape[3] != D:
            raise ValueError(f"k_cache must be (batch, seqlen_cache, heads_kv, head_dim) with q's batch {B} and "
                             f"head_dim {D}, got shape {tuple(k_cache.shape)}")
        capacity, capacity_name = k_cache.shape[1], "k_cache.shape[1]"
    _heads("q.shape[2]", H_Q, "k_cache.shape[2]", k_cache.shape[2])
    _head_dim("q.shape[3]", D)
    if k is not None:
        if k.shape != v.shape or k.shape[0] != B or k.shape[2] != k_cache.shape[2] or k.shape[3] != D:
            raise ValueError(f"k and v must both have shape (batch, seqlen_new, heads_kv, head_dim) = ({B}, "
                             f"seqlen_new, {k_cache.shape[2]}, {D}), got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.shape[1] > capacity:
            raise ValueError(f"k and v append {k.shape[1]} keys, more than the cache holds ({capacity_name} = "
                             f"{capacity})")
    _dtypes_devices([("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
                    + ([("k", k), ("v", v)] if k is not None else []))
    window = _window_size(window_size, capacity)
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens is needed to append k and v (it says where each sequence's new keys go)")
        cache_seqlens = capacity
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((B,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    elif not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be an int, a (batch,) torch.int32 tensor or None, got "
                        f"{_type_name(cache_seqlens)}")
    to_heads = (lambda t: None if t is None else t.transpose(1, 2))  # noqa: E731  (., heads, seqlen, .) views
    try:
        out, lse = decode.flash_attention_with_kvcache(
            to_heads(q), to_heads(k_cache), to_heads(v_cache), cache_seqlens=cache_seqlens, k=to_heads(k),
            v=to_heads(v), causal=causal, softmax_scale=softmax_scale, num_splits=num_splits or None, return_lse=True,
            block_table=block_table, window=window, softcap=softcap, cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            rotary_interleaved=rotary_interleaved, sinks=sinks)
    except ValueError as e:  # the few checks that need the lengths, in the native layout's words: rephrased
        message = str(e)
        for native, caller in _KVCACHE_WORDS:
            message = message.replace(native, caller)
        if message == str(e):
            raise
        raise ValueError(message) from None
    out = out.transpose(1, 2).contiguous()  # (B, N_q, H_q, d); no copy at N_q = 1
    if not return_softmax_lse:
        return out
    return out, lse.masked_fill_(torch.isneginf(lse), float("inf"))


# ---------------------------------------------------------------------------------------------------
# The arguments and errors every wrapper shares, appended to its docstring (so that help() shows them).
# ---------------------------------------------------------------------------------------------------
_ATTENTION_DOC = """

    Args, as flash-attn names them, with fa_lib's limits:
        q, k, v (qkv, kv): ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``, one dtype and one device
            (CUDA; CPU under the Triton interpreter); ``1 <= head_dim <= 256``; heads a multiple of heads_kv.
        dropout_p: must be 0.0 (the default): attention dropout is not implemented.
        softmax_scale: default None, meaning ``1 / sqrt(head_dim)``; otherwise a positive finite number.
        causal: default False (aligned bottom-right). window_size: default (-1, -1). softcap: default 0.0 (off).
        alibi_slopes: must be None (the default): ALiBi is not implemented.
        deterministic, return_attn_probs: bools, default False.
        sinks: default None. Not in flash-attn 2: attention sinks, a floating-point tensor (heads,) on q's
            device, one logit per query head, finite or -inf (no sink), as ``fa_lib.flash_attention`` takes it.

    Where these wrappers' conventions differ from fa_lib's native API (the LSE of a row that sees no key, wide
    window sides, padded ``cu_seqlens``, ``deterministic``): ``help(fa_lib.interface)``.

    Raises:
        TypeError: a non-tensor input, an unsupported or mismatched dtype, a non-bool flag, a ``window_size``
            that is not a pair of ints, a ``softmax_scale`` or ``softcap`` that is not a number, a ``sinks`` that
            is not a floating-point tensor; varlen: a ``cu_seqlens`` that is not an int32 tensor, a
            ``max_seqlen`` that is not an int.
        ValueError: ``dropout_p`` other than 0 or ``alibi_slopes`` given (refused, not ignored); the wrong rank
            or shapes, heads, a head dim outside ``[1, 256]``; mismatched devices or meta tensors; a window side
            below -1; a negative or non-finite ``softcap``; a ``softmax_scale`` that is not positive and finite;
            a ``sinks`` of the wrong shape or device, or holding NaN or +inf; varlen: a ``cu_seqlens`` that is
            not 1-D, not from 0, decreasing or ending past the packed tokens, a ``max_seqlen`` below the longest
            sequence, a block table of the wrong shape or listing a page outside the pool.
        RuntimeError: a backward through a paged prefill (``block_table``); double backward.
    """

_KVCACHE_DOC = """

    Args, with fa_lib's limits:
        q, k_cache, v_cache, k, v: ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``, one dtype and
            one device (CUDA; CPU under the Triton interpreter); ``1 <= head_dim <= 256``.
        softmax_scale: default None, meaning ``1 / sqrt(head_dim)``; otherwise a positive finite number.
        causal: default False. rotary_interleaved: default True, a bool (checked on every call).
        alibi_slopes: must be None (the default): ALiBi is not implemented.
        num_splits: default 0 (the heuristic's count); otherwise an int up to 65536.
        return_softmax_lse: default False.
        sinks: default None. Not in flash-attn 2: attention sinks, as ``flash_attn_func`` takes them.

    Forward only: with grad mode on, an input that requires grad raises ``ValueError``; call it under
    ``torch.no_grad()`` (or ``torch.inference_mode()``).

    Raises:
        TypeError: a non-tensor q, k_cache, v_cache, k, v or block_table, a ``cache_seqlens`` that is neither an
            int nor a tensor, an unsupported or mismatched dtype, an index tensor that is not ``torch.int32``,
            a non-bool flag, a ``window_size`` that is not a pair of ints, a ``softmax_scale``, ``softcap`` or
            ``sinks`` of the wrong type.
        ValueError: ``alibi_slopes`` given; a ``num_splits`` that is not an int in ``[0, 65536]``; an input
            that requires grad; the wrong rank or shapes; mismatched devices; k without v, or k and v without
            ``cache_seqlens``; a length, page, cache row or left pad out of range (checked on the host); the
            value errors of ``flash_attn_func`` (window, softcap, scale, sinks).
    """

for _f in (flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func, flash_attn_varlen_func,
           flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func):
    if _f.__doc__:  # (None under python -OO)
        _f.__doc__ += _ATTENTION_DOC
if flash_attn_with_kvcache.__doc__:
    flash_attn_with_kvcache.__doc__ += _KVCACHE_DOC
del _f
