"""Input checks shared by fa_lib's public functions (``fa_lib.ops``, ``fa_lib.decode``, ``fa_lib.interface``).

Every check raises a ``TypeError`` or ``ValueError`` that names the argument and what was expected, before
anything is compiled or launched.
"""
import math
import weakref

import numpy as np
import torch

from . import kernels, reference

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_MIN_HEAD_DIM, _MAX_HEAD_DIM = 1, 256


_MAX_SCALE = reference._F32_MAX / 2  # the kernels multiply the scale by 1 / ln 2 = 1.44 in float32


_UNBOUNDED_WINDOW = 2**30  # a window side at least this wide is unbounded (-1): wider than any sequence


def _interpreting():
    return kernels.INTERPRET


class PerTensor:
    """A value computed from a tensor's contents once per tensor and version: reading a GPU tensor's values is a
    device synchronisation, and a model passes the same tensor (descales, cumulative lengths) at every layer and
    step. ``get(t, compute)`` returns ``compute(t)``, computed again only after an in-place change (a new
    ``t._version``) or for another tensor; an entry goes when its tensor does. A ``compute`` that raises stores
    nothing."""

    def __init__(self):
        self._entries = {}

    def get(self, t, compute):
        key = id(t)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is t and entry[1] == t._version:
            return entry[2]
        value = compute(t)
        entries = self._entries
        self._entries[key] = (weakref.ref(t, lambda _, key=key: entries.pop(key, None)), t._version, value)
        return value

    def __contains__(self, t):
        entry = self._entries.get(id(t))
        return entry is not None and entry[0]() is t


# ---------------------------------------------------------------------------------------------------
# Layer 2: input checks and launchers.
# ---------------------------------------------------------------------------------------------------
def _shape(t):
    return tuple(t.shape)


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _check_inputs(q, k, v, causal, softmax_scale, fn="flash_attention"):
    """Validate the arguments of `flash_attention` (or of `fn`, the public function named in the messages, which
    passes q, k and v in this layout); return the softmax scale as a float."""
    _check_4d_tensors(q, k, v)
    _check_dtypes(q, k, v, fn)
    return _check_placement_and_shapes(q, k, v, causal, softmax_scale, fn)


def _check_4d_tensors(q, k, v, what="a torch.Tensor"):
    """q, k and v are tensors (`what` says which, in the message) of 4 dimensions (batch, heads, seqlen, head_dim)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be {what}, got {_type_name(t)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, seqlen, head_dim), "
                             f"got {t.dim()} dimensions with shape {_shape(t)}")


def _check_dtypes(q, k, v, fn):
    """q, k and v (tensors, any layout) of one supported dtype; `fn` names the public function in the message."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; {fn} supports torch.float16, "
                            f"torch.bfloat16 and torch.float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        bad, t = ("k", k) if k.dtype != q.dtype else ("v", v)
        raise TypeError(f"{bad} has dtype {t.dtype} but q has dtype {q.dtype}; q, k and v must share one dtype")


def _check_placement_and_shapes(q, k, v, causal, softmax_scale, fn="flash_attention"):
    """The checks of every kernel entry (`fn`, for the messages) after its type and dtype checks: one device its
    kernels run on, q, k and v shaped alike (grouped-query heads allowed), the head dim, `causal`, and the
    softmax scale, returned as a float."""
    if k.device != q.device or v.device != q.device:
        bad, t = ("k", k) if k.device != q.device else ("v", v)
        raise ValueError(f"{bad} is on device {t.device} but q is on {q.device}; q, k and v must be on one device")
    if q.device.type == "meta":
        raise ValueError(f"q, k and v are meta tensors (no data); {fn} needs tensors on a CUDA device (or CPU tensors "
                         "under the Triton interpreter)" + (". To trace shapes without data, use torch.compile or "
                         "FakeTensorMode: fa_lib's operators have fake implementations" if fn == "flash_attention"
                                                                                        else ""))
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(f"q, k and v are on device {q.device}, but the Triton kernels run on a CUDA device; move "
                         f"them with .cuda() (on a machine without a GPU, fa_lib uses the Triton interpreter "
                         f"instead: TRITON_INTERPRET=1)")
    if q.device.type != "cpu" and _interpreting():
        raise ValueError(f"q, k and v are on device {q.device}, but fa_lib runs its kernels under the Triton "
                         f"interpreter (TRITON_INTERPRET is on), which takes CPU tensors; move them with .cpu() "
                         f"or unset TRITON_INTERPRET before starting Python")
    B, H_Q, N_Q, D = q.shape
    if _shape(v) != _shape(k):
        raise ValueError(f"v must have the same shape as k, (batch, kv_heads, seqlen_k, head_dim) = {_shape(k)}, "
                         f"got {_shape(v)}")
    if k.shape[0] != B:
        raise ValueError(f"k must have the batch size of q ({B}), got shape {_shape(k)}")
    if k.shape[3] != D:
        raise ValueError(f"k must have the head_dim of q ({D}), got shape {_shape(k)}")
    if H_Q < 1 or k.shape[1] < 1:
        raise ValueError(f"q and k must have at least one head, got q {_shape(q)} and k {_shape(k)}")
    if H_Q % k.shape[1] != 0:
        raise ValueError(f"the number of query heads ({H_Q}, q.shape[1]) must be a multiple of the number of "
                         f"key/value heads ({k.shape[1]}, k.shape[1]) for grouped-query attention")
    if not _MIN_HEAD_DIM <= D <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim (q.shape[3]) must be between {_MIN_HEAD_DIM} and {_MAX_HEAD_DIM}, got {D}")
    _check_bool("causal", causal)
    if softmax_scale is None:
        return 1.0 / math.sqrt(D)
    scale = reference._real("softmax_scale", softmax_scale, "a positive float or None",
                            "a positive finite number or None")
    if not (math.isfinite(scale) and 0.0 < scale <= _MAX_SCALE):
        raise ValueError(f"softmax_scale must be a positive finite number (at most {_MAX_SCALE:.3g}, so that the "
                         f"kernels' float32 scale / ln 2 stays finite) or None, got {softmax_scale}")
    return scale


def _check_window_softcap(window, softcap):
    """((left, right), softcap) as ints and a float; a clear error naming the argument otherwise."""
    if type(window) is tuple and window == (-1, -1) and type(window[0]) is int and type(window[1]) is int \
            and type(softcap) is float and softcap == 0.0:
        return (-1, -1), 0.0  # the defaults: what the checks below return for them, without their cost
    if isinstance(window, torch.Tensor) or isinstance(softcap, torch.Tensor):
        raise TypeError("window and softcap must be Python numbers, not tensors")
    (left, right), softcap = reference._check_window_softcap(window, softcap)
    # a side wider than any sequence is unbounded: the same mask, and no int64/int32 overflow downstream
    return tuple(-1 if w >= _UNBOUNDED_WINDOW else w for w in (left, right)), softcap


# cu_seqlens tensors whose values were checked: {id: (weak reference, version, total, longest)}. A training
# step passes one cu_seqlens tensor to every layer; its values are copied to the host (a device sync) the
# first time only, and again only if the tensor is modified in place (its version changes).
_CHECKED_CU = {}


def _check_cu_seqlens(name, cu, total, device):
    """Check `cu`'s type, dtype, shape and device, and (once per tensor, see `_CHECKED_CU`) its values;
    return (cu, the longest sequence, or None while torch.compile traces)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype torch.int32, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32 (flash-attn's cumulative sequence lengths), got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D of length batch + 1, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on device {cu.device} but q is on {device}")
    cu = cu if cu.is_contiguous() else cu.contiguous()
    if torch.compiler.is_compiling():  # values cannot be read while tracing
        return cu, None
    # A CUDA tensor is checked once per (tensor, version): the check copies it to the host, a device
    # synchronisation. A CPU tensor is checked at every call, since that costs nothing and its memory can
    # change without a new version (a NumPy view, a reused `from_numpy` buffer, `.data`).
    seen = _CHECKED_CU.get(id(cu)) if cu.is_cuda else None
    if seen is not None and seen[0]() is cu and seen[1] == cu._version and seen[2] == total:
        return cu, seen[3]
    arr = reference.check_cu_seqlens(name, cu.detach().cpu().numpy(), total)  # one host copy
    longest = int((arr[1:] - arr[:-1]).max()) if arr.shape[0] > 1 else 0
    if len(_CHECKED_CU) > 64:  # forget tensors that are gone
        for key in [key for key, val in _CHECKED_CU.items() if val[0]() is None]:
            del _CHECKED_CU[key]
    _CHECKED_CU[id(cu)] = (weakref.ref(cu), cu._version, total, longest)
    return cu, longest


def _type_name(x):
    """The type of `x` as a user reads it: ``int``, ``numpy.ndarray``."""
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _check_block_table(block_table, device):
    """A paged cache's block table: an int32 torch.Tensor on `device` (q's); its shape is the caller's to check."""
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor, got {_type_name(block_table)}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be a torch.int32 tensor, got {block_table.dtype}")
    if block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {device}")


def _bad_table_rows(table, first, stop, num_pages):
    """Which rows of a block table (B, W) hold an entry outside [0, num_pages) among their columns [first[b],
    stop[b]) (first, stop: sequences of B ints): a (B,) NumPy bool array, from one copy of the table to the host (a
    table has B * N_max / page_size entries; a Python loop over them took 51 ms of an eager call at B = 64, 64k keys
    and 16-key pages on the H200, and a check of a few tensor operations on the GPU 0.3 ms at B = 1)."""
    entries = table.cpu().numpy()
    cols = np.arange(entries.shape[1])
    used = (cols >= np.asarray(first)[:, None]) & (cols < np.asarray(stop)[:, None])
    return (used & ((entries < 0) | (entries >= num_pages))).any(1)


# Sinks tensors on a GPU whose values were checked, once per tensor: a read is a synchronisation. A model passes the
# same sinks (a parameter) to every call of a layer, and its optimiser changes them in place at every step: reading
# them again after each change would synchronise every layer of every training step, so only the first sight is read.
_CHECKED_SINKS = PerTensor()


def _reads_wait(t):
    """Whether reading `t`'s values on the host waits for a device (a CUDA tensor): such a read is made once per
    tensor. A CPU tensor's is made at every call: it costs no synchronisation, and its memory can
    change without a new version (a NumPy view, ``.data``)."""
    return t.is_cuda


def _check_sinks(sinks, heads_q, device):
    """Attention sinks: None, or a floating-point tensor of shape (heads_q,) on `device`, one logit per query
    head, each finite or -inf (no sink). The values are read on the host (`_check_sink_values`): a CPU tensor's at
    every call, a GPU tensor's the first time it is passed (`_CHECKED_SINKS`; values an optimiser writes into it
    later are not read), none while torch.compile traces or a CUDA graph is captured."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor of shape (heads_q,) or None, got {_type_name(sinks)}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must have a floating-point dtype (one logit per query head), got {sinks.dtype}")
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"sinks must have shape (heads_q,) = ({heads_q},), got {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks is on device {sinks.device} but q is on {device}")
    if torch.compiler.is_compiling() or (sinks.is_cuda and torch.cuda.is_current_stream_capturing()):
        return sinks  # values cannot be read while tracing or capturing
    if _reads_wait(sinks):
        if sinks not in _CHECKED_SINKS:
            _CHECKED_SINKS.get(sinks, _check_sink_values)
    else:
        _check_sink_values(sinks)
    return sinks


def _check_sink_values(sinks):
    """Every sink finite or -inf: NaN would make every output of its head NaN, +inf every output 0 and the LSE
    +inf. One host copy of a boolean (and of the sinks, to name a bad one)."""
    if sinks.numel() and not bool(torch.all(sinks.detach() < math.inf)):  # (NaN < inf is False)
        bad = sinks.detach().cpu().float()
        head = int(torch.nonzero(~(bad < math.inf))[0, 0])
        raise ValueError(f"sinks must be finite or -inf (a head without a sink), got sinks[{head}] = "
                         f"{bad[head].item()}: NaN and +inf are refused")
