"""FlashAttention for PyTorch: launchers, the PyTorch operators and the public functions.

Four thin layers, read bottom-up from the kernels:

1. ``fa_lib.kernels``: the ``@triton.jit`` kernels.
2. ``_check_inputs`` / ``_forward`` / ``_backward``: launchers. Every input is checked here, with a
   ``TypeError``/``ValueError`` that names the argument, *before* anything is compiled; each launch
   runs under the inputs' device with a fixed block configuration (or the autotuner's, when asked).
3. ``fa_lib::flash_attn_fwd`` and ``fa_lib::flash_attn_bwd``: ``torch.library`` custom operators with
   fake (meta) implementations, joined by ``register_autograd``. ``torch.compile`` sees two opaque
   operators of known output shapes, never Triton's launcher, so ``fullgraph=True`` works. Eager calls
   skip the operators' dispatcher: a ``torch.autograd.Function`` runs the same forward and backward.
4. ``flash_attention`` and ``flash_attention_varlen`` (layout ``(B, H, N, D)``; packed ``(total, H, D)``): the
   documented public functions. flash-attn's API (``flash_attn_func`` and the rest, in its layout and argument
   names) is ``fa_lib.interface``, thin wrappers over these.

Importing this module imports ``fa_lib.kernels`` first, which defines the kernels for the GPU or for
Triton's CPU interpreter (see ``fa_lib._interpreter``).
"""
import contextlib
import math
import numbers
from typing import Optional

import numpy as np
import torch
import torch.autograd.forward_ad as _fwAD

from . import kernels  # first: defines the kernels in the mode fa_lib chose at import
from . import launch  # noqa: E402
from . import plan  # noqa: E402
from .options import current as _options, using as using_options
# The checks and encodings that ops, decode and interface share live below them (checks, dispatch, launch); the
# names other modules and the book still reach through ops are imported here.
from .sinks import _with_sinks
from .checks import (_MAX_HEAD_DIM, _MIN_HEAD_DIM, _bad_table_rows, _check_block_table, _check_bool,  # noqa: F401
                     _check_cu_seqlens, _check_dtypes, _check_inputs, _check_placement_and_shapes,
                     _check_sinks, _check_window_softcap, _shape)
from .dispatch import (  # noqa: F401  (the routes and blocks: fa_lib.dispatch decides)
    PREFILL_BLOCK_M, _addr, _band, _bucket, _cdiv, _fixed_config, _head_tiles, _hopper_backward, _hopper_dq,
    _hopper_forward, _hopper_problem, _meta, _next_pow2, _one_pass_mode, _one_tile, _plain_gpu_problem,
    _prefill_forward, _softcap_mode, _tile_meta, heads_per_group, tile_group)
from .launch import _device_guard, _empty, _strides  # noqa: F401

try:  # Gluon (triton.experimental.gluon) ships with Triton 3.6; the fast sm_90 forward needs it
    from . import kernels_hopper  # noqa: E402
except ImportError:  # pragma: no cover - an older or newer Triton without the same Gluon API
    kernels_hopper = None
import triton  # noqa: E402

_peek_transforms = torch._C._functorch.peek_interpreter_stack  # None when no torch.func transform runs

__all__ = ["flash_attention", "flash_attention_varlen"]

_PRE_BLOCK = 64  # query rows per program of the backward's preprocessing kernel (D = rowsum(dO * O))


def _like(t, dtype=None):
    """An uninitialised tensor of `t`'s shape in `t`'s memory layout: its strides when `t` is dense and
    non-overlapping (`torch.empty_like`'s preserve_format), else contiguous. The kernels take any strides,
    so a (B, N, H, D) storage viewed as (B, H, N, D), the layout of most models, gets its output and
    gradients in that storage order too: `o.transpose(1, 2).reshape(B, N, H * D)` is then a view, and
    autograd's gradient accumulation, which gives a leaf's .grad the leaf's strides, copies nothing (on the
    H200, at a 1024-key window, N = 8k, that copy of dq, dk, dv took 0.33-0.36 ms of a 1.47 ms backward)."""
    x = torch.empty_like(t, dtype=t.dtype if dtype is None else dtype)
    return x.fill_(float("nan")) if launch._POISON_OUTPUTS else x


def _launch(kernel, tuned, name, grid, args, meta, q, n_q, n_k, deterministic):
    """Launch `kernel` with its fixed configuration, or its autotuned twin when not deterministic."""
    if deterministic:
        tile = meta["HEAD_DIM"] + meta["HEAD_DIM2"]  # two column tiles: their sum
        block_m, block_n, num_warps, num_stages = _fixed_config(name, q.element_size(), tile, meta["CAUSAL"], n_q,
                                                                n_k, grid, kernels.device_shared_memory(q.device))
        launch.launch(kernel, grid({"BLOCK_M": block_m, "BLOCK_N": block_n}), args,
                      dict(meta, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages))
    else:
        plan.taint()  # (the autotuner launches by itself)
        tuned[grid](*args, **meta)


def _z_strides(t, varlen):
    """A tensor's strides for the kernels; a packed (varlen) view gets batch stride 0, since the
    program's batch index is then the sequence index and its rows are found through cu_seqlens."""
    s = tuple(t.stride())
    return (0,) + s[1:] if varlen else s


class _Problem:
    """What one launch of the tiled kernels computes, beyond q, k, v: the masks, and (varlen) how the
    packed batch is cut into sequences. `n_q`, `n_k` are the (largest) sequence lengths, `batch` the
    number of sequences; `lse_strides` the (batch, head) strides of the LSE and Delta arrays."""

    def __init__(self, q, causal, window, softcap, key_padding_mask, cu_seqlens_q=None, cu_seqlens_k=None,
                 n_q=None, n_k=None, batch=None):
        self.varlen = cu_seqlens_q is not None
        self.causal, self.local, self.win_left, self.win_right = _band(causal, window)
        self.softcap = float(softcap)
        self.kpm = key_padding_mask
        self.cu_q, self.cu_k = cu_seqlens_q, cu_seqlens_k
        self.n_q, self.n_k, self.batch = n_q, n_k, batch
        dummy = q  # an unused pointer argument (never dereferenced when its flag is off)
        # KV_END (B, 2) int32: per batch row, one past its last real key (a padded tail is skipped, not
        # just masked) and its count of leading real keys (the keys before it need no mask); computed on
        # the device, no synchronisation: fa_lib.key_padding_bounds is its NumPy twin.
        kv_end = None
        if self.kpm is not None:
            real = self.kpm.to(torch.int32)
            last = (real * torch.arange(1, real.shape[1] + 1, dtype=torch.int32, device=real.device)).amax(1)
            kv_end = torch.stack((last, real.cumprod(1).sum(1)), 1).to(torch.int32).contiguous()
        self.pointers = (dummy if self.kpm is None else self.kpm, dummy if kv_end is None else kv_end,
                         dummy if self.cu_q is None else self.cu_q, dummy if self.cu_k is None else self.cu_k,
                         self.softcap if self.softcap else 1.0)
        self.kpm_stride = 0 if self.kpm is None else self.kpm.stride(0)
        self.flags = dict(LOCAL=self.local, SOFTCAP=_softcap_mode(self.softcap), HAS_KPM=self.kpm is not None,
                          VARLEN=self.varlen)

    def config_lengths(self, kernel):
        """The lengths that pick the fixed block configuration. For dK/dV under a window bounded on both
        sides, a column is seen by at most left + right + 1 rows, and the table's row for that length
        fits better (on the H200: window 1023 at N = 16k, 7% faster with (32, 64) blocks than with N's
        (64, 128); window 4095 unchanged). The forward keeps N's: its (64, 64) configuration measured
        0.41 ms in one process and 0.52 ms in another at window 1023, N = 16k."""
        if kernel == "dkdv" and self.local and self.causal:
            span = self.win_left + self.win_right + 1
            return min(self.n_q, span), min(self.n_k, span)
        return self.n_q, self.n_k

    def grid(self, tokens, block, heads, keys=False):
        """Dense: (cdiv(length, block), heads, batch). Varlen: one program per block of each sequence,
        numbered as `kernels._varlen_block` reads them: (tokens // block + sequences, heads, 1)."""
        if self.varlen:
            return (tokens // block + self.batch, heads, 1)
        return (_cdiv(self.n_k if keys else self.n_q, block), heads, self.batch)

    def lse_strides(self, total_q, h_q):
        return (0, total_q) if self.varlen else (h_q * self.n_q, self.n_q)


def _forward(q, k, v, causal, softmax_scale, deterministic=True, *, window=(-1, -1), softcap=0.0,
             key_padding_mask=None, out_dtype=None):
    """Launch the forward kernel. Returns o (B, H_q, N_q, D) in q's dtype (or `out_dtype`: float32 keeps
    a partial result unrounded, for a later merge) and lse (B, H_q, N_q) float32."""
    B, H_Q, N_Q, D = q.shape
    N_K = k.shape[2]
    out_dtype = q.dtype if out_dtype is None else out_dtype
    if B == 0 or N_Q == 0 or N_K == 0:  # nothing to launch; a row with no key: o = 0, LSE = -inf
        return (q.new_zeros((B, H_Q, N_Q, D), dtype=out_dtype),
                q.new_full((B, H_Q, N_Q), float("-inf"), dtype=torch.float32))
    o = _like(q, out_dtype)  # (B, H_Q, N_Q, D) in q's layout
    lse = _empty((B, H_Q, N_Q), torch.float32, q.device)
    key = None
    opts = _options()
    if opts.plans and key_padding_mask is None:  # this problem's launches, if they were recorded (fa_lib.plan)
        key = ("fwd", opts, q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device, causal,
               softmax_scale, deterministic, window, softcap, out_dtype, q.data_ptr() & 15, k.data_ptr() & 15,
               v.data_ptr() & 15)
        recorded = plan.get(key)
        if recorded is not None:
            recorded.run((q, k, v, o, lse), _empty)
            return o, lse
        plan.start((q, k, v, o, lse), q.device)
    try:
        pb = _Problem(q, causal, window, softcap, key_padding_mask, n_q=N_Q, n_k=N_K, batch=B)
        if _hopper_forward(q, k, v, o, pb):
            with _device_guard(q):
                kernels_hopper.forward(q, k, v, o, lse, pb.causal, softmax_scale, tile_group(q, N_K))
        elif _prefill_forward(q, k, o, pb):
            from . import decode

            plan.taint()  # (the fill below is not a launch)
            with _device_guard(q):
                every_key = torch.full((B,), N_K, dtype=torch.int32, device=q.device)  # (a fill a CUDA graph replays)
                decode._attend(q, k, v, every_key, 0, pb.causal, softmax_scale, None, o, lse)
        else:
            _forward_launch(q, k, v, o, lse, softmax_scale, deterministic, pb)
    except BaseException:
        if key is not None:
            plan.abort()
        raise
    if key is not None:
        plan.finish(key)
    return o, lse


def _forward_launch(q, k, v, o, lse, softmax_scale, deterministic, pb, block_table=None):
    """q, k, v, o: (batch or 1, heads, tokens, D) views; lse: its (batch or 1, H_q, tokens) array.
    `block_table` (B, W) int32 contiguous: k and v are then pools of pages, (num_pages, heads, page_size, D)
    views (a paged prefill: `_paged_varlen_forward`), one column tile."""
    H_Q, H_KV, D = q.shape[1], k.shape[1], q.shape[3]

    def grid(META):
        return pb.grid(q.shape[2], META["BLOCK_M"], H_Q)

    kv_strides = (_strides(k), _strides(v)) if block_table is not None else \
        (_z_strides(k, pb.varlen), _z_strides(v, pb.varlen))  # a pool's page stride is its batch stride
    args = (q, k, v, softmax_scale, lse, o, *pb.pointers,
            *_z_strides(q, pb.varlen), *kv_strides[0], *kv_strides[1],
            *_z_strides(o, pb.varlen), pb.kpm_stride, *pb.lse_strides(q.shape[2], H_Q),
            H_Q, H_Q // H_KV, pb.n_q, pb.n_k, pb.win_left, pb.win_right, D, _bucket(pb.n_q), _bucket(pb.n_k),
            pb.batch)
    meta = dict(_meta(q, pb.causal, _addr(pb.causal, k, v)), **pb.flags)
    meta.update(_tile_meta(D, split=block_table is None))
    if block_table is not None:
        meta.update(Table=block_table, stride_tz=block_table.stride(0), N_PAGES=k.shape[0], PAGE=k.shape[2])
        deterministic = True  # the fixed configuration (the autotuner's keys do not cover the pages)
    with _device_guard(q):
        _launch(kernels._attn_fwd, kernels._attn_fwd_tuned, "fwd", grid, args, meta, q, *pb.config_lengths("fwd"),
                deterministic)


def _backward(do, dlse, q, k, v, o, lse, causal, softmax_scale, deterministic=True, need_dq=True, need_dkdv=True,
              *, window=(-1, -1), softcap=0.0, key_padding_mask=None, grad_dtype=None):
    """Launch the backward kernels. Returns dq, dk, dv with the shapes and dtype of q, k, v (or
    `grad_dtype`: float32 keeps partial gradients unrounded, for a later sum); a gradient that is not
    needed (`need_dq`, `need_dkdv`) comes back as an empty tensor and costs no launch."""
    B, H_Q, N_Q, D = q.shape
    N_K = k.shape[2]
    gd = q.dtype if grad_dtype is None else grad_dtype
    if B == 0 or N_Q == 0 or N_K == 0:  # no score at all: every gradient is zero
        return (q.new_zeros(q.shape if need_dq else (0,), dtype=gd),
                k.new_zeros(k.shape if need_dkdv else (0,), dtype=gd),
                v.new_zeros(v.shape if need_dkdv else (0,), dtype=gd))
    dq = _like(q, gd) if need_dq else q.new_empty((0,), dtype=gd)  # each in its input's layout
    dk = _like(k, gd) if need_dkdv else k.new_empty((0,), dtype=gd)
    dv = _like(v, gd) if need_dkdv else v.new_empty((0,), dtype=gd)
    key = None
    opts = _options()
    if opts.plans and key_padding_mask is None:  # as in _forward
        key = ("bwd", opts, q.shape, q.stride(), k.shape, k.stride(), v.stride(), do.stride(), o.stride(), lse.stride(),
               None if dlse is None else (dlse.shape, dlse.stride(), dlse.dtype, dlse.data_ptr() & 15), q.dtype,
               q.device, causal, softmax_scale, deterministic, need_dq, need_dkdv, window, softcap, grad_dtype,
               q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15, do.data_ptr() & 15, o.data_ptr() & 15,
               lse.data_ptr() & 15, do.dtype, o.dtype, lse.dtype)
        slots = (do, dlse, q, k, v, o, lse, dq, dk, dv)
        recorded = plan.get(key)
        if recorded is not None:
            recorded.run(slots, _empty)
            return dq, dk, dv
        plan.start(slots, q.device)
    try:
        pb = _Problem(q, causal, window, softcap, key_padding_mask, n_q=N_Q, n_k=N_K, batch=B)
        _backward_launch(do, dlse, q, k, v, o, lse, dq, dk, dv, softmax_scale, deterministic, pb, need_dq,
                         need_dkdv)
    except BaseException:
        if key is not None:
            plan.abort()
        raise
    if key is not None:
        plan.finish(key)
    return dq, dk, dv


# The two-pass backward's dK/dV and dQ kernels read the same inputs and write different outputs. True: on
# a GPU the dQ kernel goes to a second stream, launched after the dK/dV kernel, so its programs can fill
# the SMs that the dK/dV kernel's last wave leaves idle; the caller's stream waits for both. False: one
# after the other on the caller's stream. The gradients are the same bits either way. On the H200 (bf16,
# B*N = 16k, H = 16, D = 128; three interleaved rounds, the file
# benchmarks/data/probe-streams-nvidia-h200.json) the fastest of three concurrent runs was faster than the
# fastest of three serial ones at all 16 points, by 0.1-8.4% (geometric mean 2.8%; packed documents
# 3-6%, GQA 32/8 3.6%, causal N = 2k 8.4%); single runs vary by about 5%. The kernel option
# `concurrent_backward` (default True).
_SIDE_STREAMS = {}


def _side_stream(device):
    """One side stream per device, made once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _allocator(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator():
    """Descriptors built on the device need scratch memory from `triton.set_allocator`. Install one
    (torch's caching allocator) unless the caller installed their own in this thread."""
    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # a Triton without this module: install ours
        pass
    triton.set_allocator(_allocator)


def _backward_launch(do, dlse, q, k, v, o, lse, dq, dk, dv, softmax_scale, deterministic, pb, need_dq, need_dkdv):
    """All tensors (batch or 1, heads, tokens, D) views; lse, dlse (batch or 1, H_q, tokens)."""
    opts = _options()
    B1, H_Q, T_Q, D = q.shape  # T_Q: the query rows of the LSE array (N_Q, or total_q when varlen)
    H_KV = k.shape[1]
    lse = plan.contiguous(lse)  # the kernels index it as a contiguous (B, H_q, N_q) array
    meta = _meta(q, pb.causal, _addr(False, q, k, v, do))
    tail = (pb.n_q, pb.n_k, pb.win_left, pb.win_right, D, _bucket(pb.n_q), _bucket(pb.n_k), pb.batch)
    with _device_guard(q):
        # D = rowsum(dO * O) - dLSE, one float32 per query row (per token: the batch structure is irrelevant).
        delta = _empty((B1, H_Q, T_Q), torch.float32, q.device)
        plan.scratch(delta)
        has_dlse = dlse is not None
        launch.launch(kernels._attn_bwd_preprocess, (_cdiv(T_Q, _PRE_BLOCK), H_Q, B1),
                      (o, do, plan.contiguous(dlse) if has_dlse else delta, delta, *_strides(o), *_strides(do),
                       H_Q, T_Q, D),
                      dict(HEAD_DIM=meta["HEAD_DIM"], BLOCK_M=_PRE_BLOCK, HAS_DLSE=has_dlse))
        common = (*pb.pointers,)
        lse_strides = pb.lse_strides(T_Q, H_Q)
        # deterministic=False: one pass, dQ added atomically by the dK/dV kernel into a float32 buffer.
        # Where dispatch.faster_one_pass holds, the sm_90 Gluon dK/dV kernel takes the one pass.
        hopper_one_pass = (not deterministic and need_dq and need_dkdv and opts.one_pass_backward == "auto"
                           and _hopper_backward(q, k, v, do, dk, dv, pb, one_pass=True))
        if hopper_one_pass:
            atomic = 1
        elif not deterministic and need_dq and need_dkdv and not (
                opts.one_pass_backward == "auto" and _hopper_backward(q, k, v, do, dk, dv, pb)):
            atomic = _one_pass_mode(q, k, meta["HEAD_DIM"], max(pb.n_q, pb.n_k), causal=pb.causal, local=pb.local)
        else:  # deterministic, one gradient only, or (auto) where the Gluon two passes run: see dispatch._one_pass_mode
            atomic = 0
        if not atomic:  # the dK/dV and dQ kernels take the forward's column tiles (one in the one-pass backward)
            meta.update(_tile_meta(D))
        if atomic:
            plan.taint()  # (the zeroing and copy of the float32 dQ are not launches)
            dq_acc = (dq if dq.dtype == torch.float32 and (dq.stride(3) == 1 or not hopper_one_pass) else
                      torch.empty(q.shape, dtype=torch.float32, device=q.device))
            dq_acc.zero_()
            if atomic == 2:
                _ensure_allocator()
        concurrent = (opts.concurrent_backward and need_dkdv and need_dq and not atomic and q.device.type == "cuda"
                      and not kernels.INTERPRET)
        if concurrent:
            main = torch.cuda.current_stream(q.device)
            side = _side_stream(q.device)
            plan.wait_stream(side, main)  # inputs and delta are ready on the caller's stream
        if need_dkdv:
            def grid_dkdv(META):
                return pb.grid(k.shape[2], META["BLOCK_N"], H_KV, keys=True)

            dq_args = (dq_acc, *_z_strides(dq_acc, pb.varlen)) if atomic else (q, 0, 0, 0, 0)
            args = (q, k, v, do, lse, delta, dk, dv, softmax_scale, *common,
                    *(s for t in (q, k, v, do, dk, dv) for s in _z_strides(t, pb.varlen)),
                    *dq_args, pb.kpm_stride, *lse_strides, H_Q, H_KV, H_Q // H_KV, *tail)
            if hopper_one_pass or (not atomic and _hopper_backward(q, k, v, do, dk, dv, pb)):
                kernels_hopper.backward_dkdv(q, k, v, do, lse, delta, dk, dv, pb.causal, softmax_scale,
                                             dq_acc if hopper_one_pass else None)
            else:
                _launch(kernels._attn_bwd_dkdv_atomic if atomic else kernels._attn_bwd_dkdv,
                        kernels._attn_bwd_dkdv_atomic_tuned if atomic else kernels._attn_bwd_dkdv_tuned, "dkdv",
                        grid_dkdv, args, dict(meta, GQA=H_Q != H_KV, ATOMIC_DQ=atomic, **pb.flags), q,
                        *pb.config_lengths("dkdv"), deterministic)
        if atomic:
            if dq_acc is not dq:
                dq.copy_(dq_acc)
        elif need_dq:
            def grid_dq(META):
                return pb.grid(q.shape[2], META["BLOCK_M"], H_Q)

            args = (q, k, v, do, lse, delta, dq, softmax_scale, *common,
                    *(s for t in (q, k, v, do, dq) for s in _z_strides(t, pb.varlen)),
                    pb.kpm_stride, *lse_strides, H_Q, H_Q // H_KV, *tail)
            with torch.cuda.stream(side) if concurrent else contextlib.nullcontext():
                if _hopper_dq(q, k, v, do, dq, pb):
                    kernels_hopper.backward_dq(q, k, v, do, lse, delta, dq, pb.causal, softmax_scale,
                                               tile_group(q, k.shape[2]))
                else:
                    _launch(kernels._attn_bwd_dq, kernels._attn_bwd_dq_tuned, "dq", grid_dq, args,
                            dict(meta, **pb.flags), q, *pb.config_lengths("dq"), deterministic)
            if concurrent:
                plan.wait_stream(main, side)  # (every tensor the dQ kernel touched was made on `main`: no
                # allocation can reuse it before this join)


# ---------------------------------------------------------------------------------------------------
# Layer 3: PyTorch operators and their autograd.
# ---------------------------------------------------------------------------------------------------
# The operators' bodies, with the masks as flat arguments (the operators' schema); the eager
# `_FlashAttnFunction` calls them too.
def _forward_flat(q, k, v, causal, softmax_scale, deterministic, window_left=-1, window_right=-1, softcap=0.0,
                  key_padding_mask=None):
    return _forward(q, k, v, causal, softmax_scale, deterministic, window=(window_left, window_right),
                    softcap=softcap, key_padding_mask=key_padding_mask)


def _backward_flat(do, dlse, q, k, v, o, lse, causal, softmax_scale, deterministic, need_dq, need_dkdv,
                   window_left=-1, window_right=-1, softcap=0.0, key_padding_mask=None):
    return _backward(do, dlse, q, k, v, o, lse, causal, softmax_scale, deterministic, need_dq, need_dkdv,
                     window=(window_left, window_right), softcap=softcap, key_padding_mask=key_padding_mask)


@torch.library.custom_op("fa_lib::flash_attn_fwd", mutates_args=())
def _flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
                    deterministic: bool, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                    key_padding_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_flat(q, k, v, causal, softmax_scale, deterministic, window_left, window_right, softcap,
                         key_padding_mask)


@_flash_attn_fwd.register_fake
def _(q, k, v, causal, softmax_scale, deterministic, window_left=-1, window_right=-1, softcap=0.0,
      key_padding_mask=None):
    B, H_Q, N_Q, D = q.shape
    return torch.empty_like(q), q.new_empty((B, H_Q, N_Q), dtype=torch.float32)  # o in q's layout, as _forward


@torch.library.custom_op("fa_lib::flash_attn_bwd", mutates_args=())
def _flash_attn_bwd(do: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, causal: bool, softmax_scale: float,
                    deterministic: bool, need_dq: bool, need_dkdv: bool, window_left: int = -1,
                    window_right: int = -1, softcap: float = 0.0, key_padding_mask: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_flat(do, dlse, q, k, v, o, lse, causal, softmax_scale, deterministic, need_dq, need_dkdv,
                          window_left, window_right, softcap, key_padding_mask)


@_flash_attn_bwd.register_fake
def _(do, dlse, q, k, v, o, lse, causal, softmax_scale, deterministic, need_dq, need_dkdv, window_left=-1,
      window_right=-1, softcap=0.0, key_padding_mask=None):
    return (torch.empty_like(q) if need_dq else q.new_empty((0,)),  # each in its input's layout, as _backward
            torch.empty_like(k) if need_dkdv else k.new_empty((0,)),
            torch.empty_like(v) if need_dkdv else v.new_empty((0,)))


def _forward_options():
    """The kernel options a forward runs under, for its backward; None while torch.compile traces (the compiled
    graph's operators read the options in force when they run)."""
    return None if torch.compiler.is_compiling() else _options()


def _backward_options(ctx):
    return contextlib.nullcontext() if ctx.options is None else using_options(ctx.options)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, deterministic, *masks = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)  # the LSE per row is all the backward needs of the softmax
    ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic
    ctx.masks = tuple(masks)  # window_left, window_right, softcap, key_padding_mask (as given)
    ctx.options = _forward_options()  # the backward runs under its forward's kernel options (fa_lib.options)
    ctx.set_materialize_grads(False)  # an unused output (often the LSE) gets grad None, not zeros


class _OnceDifferentiable(torch.autograd.Function):
    """Identity on the gradients that raises if anything differentiates through them (double backward)."""

    @staticmethod
    def forward(ctx, n, *tensors):
        return tensors[:n]  # the gradients; the rest only connect them to the graph

    @staticmethod
    def backward(ctx, *unused):
        raise RuntimeError(
            "fa_lib.flash_attention does not support double backward (differentiating its gradients, e.g. "
            "for a gradient penalty): its backward is a fused kernel with no derivative of its own. Use "
            "torch.nn.functional.scaled_dot_product_attention's math backend for that term.")


def _once(grads, anchors=()):
    """Under create_graph=True, make a second differentiation of `grads` fail loudly. The kernels' outputs
    are not part of any graph, so `anchors` (the backward's inputs: dO and the saved q, k, v) tie them to
    the graph that a gradient penalty would differentiate."""
    if torch.is_grad_enabled():
        live = [g for g in grads if g is not None]
        marked = iter(_OnceDifferentiable.apply(len(live), *live, *(a for a in anchors if a is not None)))
        grads = tuple(None if g is None else next(marked) for g in grads)
    return grads


def _backward_op(ctx, do, dlse, bwd=None):
    q, k, v, o, lse = ctx.saved_tensors
    n_extra = 3 + len(ctx.masks)  # causal, softmax_scale, deterministic and the mask arguments get no grad
    need_q, need_k, need_v = ctx.needs_input_grad[:3]
    if not (need_q or need_k or need_v):
        return (None,) * (3 + n_extra)
    if do is None:  # only the LSE was differentiated
        do = torch.zeros_like(o)
    with _backward_options(ctx):
        dq, dk, dv = (bwd or _flash_attn_bwd)(do, dlse, q, k, v, o, lse, ctx.causal, ctx.softmax_scale,
                                              ctx.deterministic, need_q, need_k or need_v, *ctx.masks)
    grads = _once((dq if need_q else None, dk if need_k else None, dv if need_v else None), (do, q, k, v))
    return (*grads,) + (None,) * n_extra


torch.library.register_autograd("fa_lib::flash_attn_fwd", _backward_op, setup_context=_setup_context)


class _FlashAttnFunction(torch.autograd.Function):
    """The eager path of `flash_attention`: the forward and backward of the `fa_lib::flash_attn_fwd`
    operator, called without the custom-op dispatcher. Outside `torch.compile` that dispatch (argument
    schema, default filling, the autograd wrapper) cost several times the host time of the rest of a
    call, which on small shapes is longer than the kernels. `torch.compile` traces the operator instead.

    The forward takes `ctx` itself (no separate `setup_context`): with a `setup_context`,
    `Function.apply` binds the arguments through `inspect.signature` on every call, which the H200
    machine's profile of a small forward (benchmarks/data/profile-nvidia-h200.json, `host_breakdown`) put
    among the largest host costs. Callers pass every argument positionally."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward_flat(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, do, dlse):
        return _backward_op(ctx, do, dlse, _backward_flat)


# Variable-length (packed) batches: flash-attn's layout, q (total_q, H_q, D), k and v (total_k, H_kv, D).
def _varlen_problem(q, causal, window_left, window_right, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k):
    return _Problem(q, causal, (window_left, window_right), softcap, None, cu_seqlens_q, cu_seqlens_k,
                    n_q=max_seqlen_q, n_k=max_seqlen_k, batch=cu_seqlens_q.shape[0] - 1)


def _heads_view(t):
    """(tokens, heads, D) -> a (1, heads, tokens, D) view: the kernels' layout, no copy."""
    return t.permute(1, 0, 2).unsqueeze(0)


def _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                    deterministic, window_left, window_right, softcap):
    T_Q, H_Q, D = q.shape
    o = _empty((T_Q, H_Q, D), q.dtype, q.device)
    lse = _empty((H_Q, T_Q), torch.float32, q.device)
    pb = _varlen_problem(q, causal, window_left, window_right, softcap, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k)
    if T_Q == 0 or pb.batch == 0:
        return o.zero_(), lse.fill_(float("-inf"))
    if k.shape[0] == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return o.zero_(), lse.fill_(float("-inf"))
    _forward_launch(_heads_view(q), _heads_view(k), _heads_view(v), _heads_view(o), lse.unsqueeze(0),
                    softmax_scale, deterministic, pb)
    return o, lse


@torch.library.custom_op("fa_lib::flash_attn_varlen_fwd", mutates_args=())
def _flash_attn_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                           softmax_scale: float, deterministic: bool, window_left: int, window_right: int,
                           softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                           softmax_scale, deterministic, window_left, window_right, softcap)


@_flash_attn_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, deterministic,
      window_left, window_right, softcap):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _varlen_backward(do, dlse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                     softmax_scale, deterministic, window_left, window_right, softcap):
    dq, dk, dv = (_empty(t.shape, t.dtype, t.device) for t in (q, k, v))
    pb = _varlen_problem(q, causal, window_left, window_right, softcap, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k)
    if q.shape[0] == 0 or k.shape[0] == 0 or pb.batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    _backward_launch(_heads_view(do), None if dlse is None else dlse.unsqueeze(0), _heads_view(q), _heads_view(k),
                     _heads_view(v), _heads_view(o), lse.unsqueeze(0), _heads_view(dq), _heads_view(dk),
                     _heads_view(dv), softmax_scale, deterministic, pb, True, True)
    return dq, dk, dv


@torch.library.custom_op("fa_lib::flash_attn_varlen_bwd", mutates_args=())
def _flash_attn_varlen_bwd(do: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                           softmax_scale: float, deterministic: bool, window_left: int, window_right: int,
                           softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _varlen_backward(do, dlse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            causal, softmax_scale, deterministic, window_left, window_right, softcap)


@_flash_attn_varlen_bwd.register_fake
def _(do, dlse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      deterministic, window_left, window_right, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *rest = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.rest = tuple(rest)  # max_seqlen_q, max_seqlen_k, causal, softmax_scale, deterministic, window, softcap
    ctx.options = _forward_options()
    ctx.set_materialize_grads(False)


def _backward_varlen(ctx, do, dlse, bwd=None):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    nones = (None,) * (2 + len(ctx.rest))
    if not any(ctx.needs_input_grad[:3]):
        return (None, None, None) + nones
    if do is None:
        do = torch.zeros_like(o)
    with _backward_options(ctx):
        dq, dk, dv = (bwd or _flash_attn_varlen_bwd)(do, dlse, q, k, v, o, lse, cu_q, cu_k, *ctx.rest)
    need = ctx.needs_input_grad[:3]
    grads = _once(tuple(g if n else None for g, n in zip((dq, dk, dv), need)), (do, q, k, v))
    return (*grads,) + nones


torch.library.register_autograd("fa_lib::flash_attn_varlen_fwd", _backward_varlen, setup_context=_setup_varlen)


class _FlashAttnVarlenFunction(torch.autograd.Function):
    """The eager path of `flash_attention_varlen`, as `_FlashAttnFunction` is `flash_attention`'s (and,
    like it, a forward that takes `ctx`: no per-call argument binding)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _varlen_forward(*inputs)
        _setup_varlen(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, do, dlse):
        return _backward_varlen(ctx, do, dlse, _varlen_backward)


# ---------------------------------------------------------------------------------------------------
# Layer 4: the public functions.
# ---------------------------------------------------------------------------------------------------
def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
                    key_padding_mask=None, return_lse=False, deterministic=True, sinks=None):
    """Exact attention ``softmax(scale * q @ k^T) @ v`` with the FlashAttention algorithm (Triton).

    **Layout: (batch, heads, seqlen, head_dim)**, as in ``torch.nn.functional.scaled_dot_product_attention``.
    flash-attn's ``flash_attn_func`` takes (batch, seqlen, heads, head_dim) instead: use
    ``fa_lib.flash_attn_func`` for that layout (or pass ``x.transpose(1, 2)`` views here; no copy is made).

    Never forms the ``(seqlen_q, seqlen_k)`` score matrix: the forward pass streams key blocks through
    an online softmax and saves one log-sum-exp per query row; the backward pass recomputes the
    probabilities from it. Differentiable through ``torch.autograd`` (once: double backward raises),
    and usable under ``torch.compile(fullgraph=True)``: forward and backward are the PyTorch operators
    ``torch.ops.fa_lib.flash_attn_fwd`` and ``torch.ops.fa_lib.flash_attn_bwd``. Only the gradients
    that are needed are computed.

    Args:
        q: queries, shape ``(batch, heads_q, seqlen_q, head_dim)``.
        k: keys, shape ``(batch, heads_kv, seqlen_k, head_dim)``. ``heads_q`` must be a multiple of
            ``heads_kv``: query head ``h`` attends with key/value head ``h // (heads_q // heads_kv)``
            (grouped-query attention; ``heads_kv == 1`` is multi-query attention).
        v: values, shape ``(batch, heads_kv, seqlen_k, head_dim_v)``, like ``k`` except perhaps its head dim
            (``head_dim_v != head_dim``, as DeepSeek's MLA prefill has 192 for q and k, 128 for v: the narrower
            side is padded with zero columns, which changes no result; the output has ``head_dim_v`` columns).
            All three share one dtype (``torch.float16``, ``torch.bfloat16`` or ``torch.float32``)
            and one device (CUDA; CPU only under the Triton interpreter, which fa_lib selects by
            itself on a machine without CUDA). Any ``batch, seqlen_q, seqlen_k >= 0`` (empty inputs
            give empty outputs and zero gradients) and any ``1 <= head_dim <= 256`` (tiles are a power of
            two >= 16 wide; the extra columns are masked); any strides, e.g. a
            ``.transpose(1, 2)`` view of ``(batch, seqlen, heads, head_dim)`` storage. The output has the memory
            layout of ``q``, and each gradient that of its input (when dense; contiguous otherwise): with
            such views, ``out.transpose(1, 2)`` is contiguous and autograd copies no gradient.
        causal: default ``False``. If ``True``, apply a causal mask aligned to the bottom-right
            corner of the score matrix, as flash-attn 2.1+ does: query ``i`` sees key ``j`` iff
            ``j <= i + seqlen_k - seqlen_q``. With ``seqlen_q == seqlen_k`` this is the usual
            lower-triangular mask. For example (``x`` = visible)::

                seqlen_q = 2, seqlen_k = 5        seqlen_q = 5, seqlen_k = 2
                        k0 k1 k2 k3 k4                    k0 k1
                    q0   x  x  x  x  .                q0   .  .    <- sees no key
                    q1   x  x  x  x  x                q1   .  .    <- sees no key
                                                      q2   .  .    <- sees no key
                                                      q3   x  .
                                                      q4   x  x

            A query row that sees no key gets output 0, LSE ``-inf`` and zero gradients (never NaN).
        softmax_scale: default ``None``, meaning ``1 / sqrt(head_dim)``. Otherwise a positive number,
            at most half of float32's largest (1.7e38), multiplying ``q @ k^T`` before the softmax.
        window: default ``(-1, -1)`` (no window). ``(left, right)``: local (sliding-window) attention,
            aligned bottom-right like ``causal``: query ``i`` sees key ``j`` iff
            ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``; ``-1`` leaves
            that side unbounded, and so does any side of ``2**30`` or more. ``causal=True`` sets ``right``
            to 0 (Mistral's window is ``causal=True, window=(4095, -1)``). Key blocks outside every row's
            window are never loaded: the cost is O(seqlen * window), not O(seqlen^2).
        softcap: default ``0.0`` (off). ``softcap > 0`` caps the scores as Gemma 2 does:
            ``S = softcap * tanh(scale * q @ k^T / softcap)`` before the softmax (and its derivative
            ``1 - tanh^2`` in the backward); a normal float32 (at least ``1.2e-38``). Caps above 100 run
            a tanh that stays accurate for scores far below the cap.
        key_padding_mask: default ``None``. A ``(batch, seqlen_k)`` ``torch.bool`` tensor on q's device,
            ``True`` for a real key and ``False`` for padding, which no query sees (it receives zero
            gradients). Combines with ``causal`` and ``window``. For batches with much padding,
            ``flash_attention_varlen`` on the packed tokens does less work.
        return_lse: default ``False``. If ``True``, also return the natural-log log-sum-exp of each
            query row's scaled scores, ``lse[b, h, i] = log(sum_j exp(scale * q_i . k_j))`` over the
            visible keys, float32 of shape ``(batch, heads_q, seqlen_q)``. It is differentiable too.
        sinks: default ``None``. Attention sinks as gpt-oss uses them: a floating-point tensor of shape
            ``(heads_q,)`` on q's device, one logit per query head that joins every row's softmax
            denominator as a key with value 0, ``p_ij = exp(s_ij) / (sum_j' exp(s_ij') + exp(sinks[h]))``
            (not scaled, not capped; finite, or ``-inf`` for no sink). The LSE then includes it, and
            ``sinks`` gets a gradient (float32 arithmetic, returned in its dtype). Computed exactly from the
            kernels' output and LSE: ``o * sigmoid(lse - sink)``, ``logaddexp(lse, sink)``
            (``fa_lib.reference.apply_sinks``), one extra rounding of the output to its dtype. NaN and
            ``+inf`` raise ``ValueError``: the values are read on the host for that check, a CPU tensor's at
            every call, a CUDA tensor's the first time it is passed (one device synchronisation; values an
            optimiser later writes into the same tensor are not read, which would synchronise every
            step), none while torch.compile traces or a CUDA graph is captured.
        deterministic: default ``True``: every launch uses a fixed block configuration, chosen from
            (GPU, dtype, head dim, causal, sequence-length bucket), so the same inputs give bitwise
            identical outputs and gradients in every run and every process (the backward uses no
            atomics). ``False`` lets Triton's autotuner time several configurations per shape in
            this process, and where it measured faster (multi-head attention, head dim 128,
            N >= 8192 on the H200) runs the backward in one pass: the dK/dV kernel also adds each
            tile's share of dQ into a float32 buffer with TMA reduce-adds, instead of a second
            kernel recomputing P and dP for dQ (five matrix products per tile pair instead of
            seven). Results may then differ in the last bits from run to run (the order of the
            additions is not fixed), and each new shape bucket costs a tuning run.

    Returns:
        ``o`` of shape ``(batch, heads_q, seqlen_q, head_dim_v)`` in the dtype of ``q`` (contiguous),
        or ``(o, lse)`` when ``return_lse=True``.

    Precision: products of 16-bit inputs run on the tensor cores with float32 accumulation, and the
    softmax is in float32. float32 inputs use exact float32 products (Triton's ``"ieee"``), not
    TF32: several times slower on a GPU, but as accurate as PyTorch's float32 attention.

    Raises:
        TypeError: a non-tensor input, an unsupported or mismatched dtype, a non-bool flag (``causal``,
            ``return_lse``, ``deterministic``); a ``window`` that is not a pair of ints (``(1.5, -1)``, a
            tensor side); a ``softmax_scale`` or ``softcap`` that is not a real number (a bool, a string, a
            tensor); a ``key_padding_mask`` that is not a tensor or not ``torch.bool`` (float, uint8); a
            ``sinks`` that is not a tensor (a list) or not floating point (an int dtype).
        ValueError: wrong rank or shapes, ``heads_q`` not a multiple of ``heads_kv``, ``head_dim``
            or the value head dim ``head_dim_v`` outside ``[1, 256]``, mismatched devices, meta tensors,
            CPU tensors with no interpreter, a ``softmax_scale`` not positive and finite or above 1.7e38, a
            window side below -1, a ``softcap`` that is negative, not finite, or positive but outside the
            normal float32 range (below 1.18e-38, above 3.4e38), a ``key_padding_mask`` of the wrong shape or
            device, a ``sinks`` whose shape is not ``(heads_q,)``, on another device, or holding NaN or
            ``+inf``.
        RuntimeError: differentiating the gradients (double backward).

    Example::

        q = torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 2, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        o = flash_attention(q, k, v, causal=True)   # (2, 8, 1024, 64)
        o.sum().backward()
    """
    if _value_dim_differs(q, k, v, dim=3):
        return _with_value_dim(flash_attention, q, k, v, softmax_scale, dim=3, causal=causal, window=window,
                               softcap=softcap, key_padding_mask=key_padding_mask, return_lse=return_lse,
                               deterministic=deterministic, sinks=sinks)
    softmax_scale = _check_inputs(q, k, v, causal, softmax_scale)
    (window_left, window_right), softcap = _check_window_softcap(window, softcap)
    key_padding_mask = _check_key_padding_mask(key_padding_mask, k)
    _check_bool("return_lse", return_lse)
    _check_bool("deterministic", deterministic)
    if torch.compiler.is_compiling():
        fwd = _flash_attn_fwd
    elif _untracked(q, k, v):
        fwd = _forward_flat  # nothing to differentiate: no autograd node to build
    else:
        fwd = _FlashAttnFunction.apply
    sinks = _check_sinks(sinks, q.shape[1], q.device)
    o, lse = fwd(q, k, v, causal, softmax_scale, deterministic, window_left, window_right, softcap, key_padding_mask)
    if sinks is not None:
        o, lse = _with_sinks(o, lse, sinks.view(1, -1, 1), lambda f: f.unsqueeze(-1))
    return (o, lse) if return_lse else o


def _value_dim_differs(q, k, v, dim):
    """Whether v's head dim (axis `dim`) differs from q's and k's, which agree, the tensors having dim + 1 axes."""
    return (all(isinstance(t, torch.Tensor) and t.dim() == dim + 1 for t in (q, k, v))
            and q.shape[dim] == k.shape[dim] != v.shape[dim] and v.shape[:dim] == k.shape[:dim])


def _with_value_dim(call, q, k, v, softmax_scale, dim, **kwargs):
    """Attention whose values have a head dim of their own (d_v != d, as DeepSeek's MLA prefill: 192 / 128): the
    narrower side padded with zero columns to max(d, d_v), which changes no score (q and k: zero products) and no
    output column (v: zero columns, cut off), then `call` on the padded tensors with the unpadded scale (default
    1 / sqrt(d)). The kernels compute max(d, d_v) columns on both products, where 2·N_q·N_k·(d + d_v) FLOPs are
    needed. The gradients flow back through the padding and the cut."""
    d, d_v = q.shape[dim], v.shape[dim]
    if not (_MIN_HEAD_DIM <= d_v <= _MAX_HEAD_DIM):
        raise ValueError(f"the value head dim (v.shape[{dim}]) must be between {_MIN_HEAD_DIM} and {_MAX_HEAD_DIM}, "
                         f"got {d_v}")
    if softmax_scale is None and _MIN_HEAD_DIM <= d:
        softmax_scale = 1.0 / math.sqrt(d)
    pad = [0, 0] * (q.dim() - 1 - dim)  # (no axes after the head dim: the pad is on the last axis)
    if d < d_v:
        q, k = (torch.nn.functional.pad(t, pad + [0, d_v - d]) for t in (q, k))
    else:
        v = torch.nn.functional.pad(v, pad + [0, d - d_v])
    out = call(q, k, v, softmax_scale=softmax_scale, **kwargs)
    o, lse = out if isinstance(out, tuple) else (out, None)
    o = o.narrow(dim, 0, d_v).contiguous()
    return o if lse is None else (o, lse)


def _untracked(q, k, v):
    """True when no autograd of any kind sees this call: gradients off or no input requiring one, no
    forward-mode AD level open and no torch.func transform running. Then the forward kernel is called
    directly, without `torch.autograd.Function.apply` (whose own host time, several microseconds, is a
    noticeable part of a small inference call); otherwise `apply`, which also raises the clear errors of
    forward-mode AD and vmap on a function that defines neither."""
    return ((not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad or v.requires_grad))
            and _fwAD._current_level < 0 and _peek_transforms() is None)


def _check_key_padding_mask(mask, k):
    """A (batch, seqlen_k) bool tensor on k's device with a unit last stride, or None."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be a torch.Tensor of dtype torch.bool or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must have dtype torch.bool (True = real key, False = padding), got {mask.dtype}")
    B, N_K = k.shape[0], k.shape[2]
    if tuple(mask.shape) != (B, N_K):
        raise ValueError(f"key_padding_mask must have shape (batch, seqlen_k) = ({B}, {N_K}), got {tuple(mask.shape)}")
    if mask.device != k.device:
        raise ValueError(f"key_padding_mask is on device {mask.device} but k is on {k.device}")
    return mask if mask.stride(1) == 1 or N_K <= 1 else mask.contiguous()


def _check_max_seqlen(name, value, longest, cu_name):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a non-negative int, got {value!r}")
    if not 0 <= value < 2**31:  # the kernels take lengths as int32
        raise ValueError(f"{name} must be a non-negative int below 2**31, got {value}")
    if longest is not None and value < longest:
        raise ValueError(f"{name} = {value} is smaller than the longest sequence in {cu_name} ({longest})")
    return int(value)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                           softmax_scale=None, window=(-1, -1), softcap=0.0, return_lse=False, deterministic=True,
                           block_table=None, sinks=None):
    """Attention over a packed batch of variable-length sequences (flash-attn's varlen layout).

    The sequences of a batch are laid end to end with no padding: ``q`` is ``(total_q, heads_q, head_dim)``,
    ``k`` and ``v`` are ``(total_k, heads_kv, head_dim)``. Sequence ``b`` owns the query tokens
    ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` and the key tokens ``cu_seqlens_k[b] : cu_seqlens_k[b + 1]``;
    its tokens attend only to its own keys, so nothing is spent on padding or across documents.

    Args:
        q, k, v: as above; one dtype (float16, bfloat16, float32) and device; heads_q a multiple of
            heads_kv (GQA); any ``1 <= head_dim <= 256``; any strides; v may have a head dim of its own, as in
            ``flash_attention`` (not over a paged cache).
        cu_seqlens_q, cu_seqlens_k: ``torch.int32`` tensors of shape ``(batch + 1,)`` on q's device,
            starting at 0, non-decreasing (a sequence may be empty), ending at ``total_q`` / ``total_k``.
        max_seqlen_q, max_seqlen_k: ints, at least the longest sequence (they size the launch grid).
        causal, softmax_scale, window, softcap, deterministic: as in ``flash_attention``, per sequence
            (bottom-right alignment uses each sequence's own lengths).
        return_lse: also return the LSE, float32 of shape ``(heads_q, total_q)`` (flash-attn's layout).
        sinks: attention sinks, ``(heads_q,)``, as in ``flash_attention``.

    Returns ``o`` of shape ``(total_q, heads_q, head_dim_v)`` in q's dtype, ``head_dim_v`` being v's head dim
    (``head_dim`` unless v has its own), or ``(o, lse)``; differentiable in q, k, v.
    A query with no visible key (its sequence has no keys, or the mask hides them) gets o = 0, LSE -inf.

    The values of ``cu_seqlens_*`` are checked on the host: for a CUDA tensor one small copy (a device
    sync) the first time it is passed, none when the same, unmodified tensor comes again (every layer of
    a training step); a CPU tensor at every call (no sync to save); none while ``torch.compile`` traces.
    Errors name the argument: not int32, not starting at 0, decreasing, not ending at the token count, a
    ``max_seqlen`` below the longest sequence.

    ``block_table`` (batch, W) ``torch.int32`` (default None): the keys are in a paged KV cache, as vLLM keeps
    one, and the queries are a prefill over it (chunked prefill; a prompt whose prefix is already cached).
    ``k`` and ``v`` are then one pool of pages, ``(num_pages, page_size, heads_kv, head_dim)`` (flash-attn's
    paged layout, any page size), and key j of sequence b is row ``j % page_size`` of page
    ``block_table[b, j // page_size]``; ``cu_seqlens_k`` gives each sequence's key count (its last entry is
    not tied to the pool), at most ``W * page_size``. Forward only: refused when a gradient is asked for.
    The key counts and the pages they use are checked on the host (one copy), except while a CUDA graph is
    captured or torch.compile traces; unchecked, a count is clamped to the table's width and a page index
    into the pool. One column tile per head (no two-tile split of head dims such as 96), the fixed block
    configuration, and the portable kernel on every device.

    Raises:
        TypeError: a non-tensor q, k, v; an unsupported or mismatched dtype; a ``cu_seqlens_*`` that is not a
            tensor or not ``torch.int32`` (int64 included); a ``max_seqlen_*`` that is not an int; a
            ``block_table`` that is not an int32 tensor; a non-bool flag; a ``window``, ``softmax_scale``,
            ``softcap`` or ``sinks`` of the wrong type, as in ``flash_attention``.
        ValueError: everything else: q, k, v of the wrong rank or shapes (k and v unlike, head dims unlike,
            no heads, ``heads_q`` not a multiple of ``heads_kv``, a head dim outside ``[1, 256]``); mismatched
            devices or meta tensors; a ``cu_seqlens_*`` not 1-D, on another device, not starting at 0,
            decreasing, not ending at the token count (not checked for ``cu_seqlens_k`` over pages), or the
            two of different lengths; a ``max_seqlen_*`` negative, of ``2**31`` or more, or below the longest
            sequence; a block table of the wrong shape, too narrow for a sequence's keys or listing a page
            outside the pool, or given with inputs that require grad; and the value errors of
            ``flash_attention`` (scale, window, softcap, sinks, NaN or ``+inf`` sinks among them).
    """
    paged = block_table is not None
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if paged and name != "q":
            if t.dim() != 4:
                raise ValueError(f"with a block_table, {name} must be a pool of pages (num_pages, page_size, heads, "
                                 f"head_dim), got shape {_shape(t)}")
        elif t.dim() != 3:
            raise ValueError(f"{name} must have 3 dimensions (total_tokens, heads, head_dim) in the varlen layout, "
                             f"got shape {_shape(t)}")
    if not paged and _value_dim_differs(q, k, v, dim=2):
        return _with_value_dim(flash_attention_varlen, q, k, v, softmax_scale, dim=2, cu_seqlens_q=cu_seqlens_q,
                               cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                               causal=causal, window=window, softcap=softcap, return_lse=return_lse,
                               deterministic=deterministic, sinks=sinks)
    if paged:
        _check_pool(q, k, v, block_table)
    _check_dtypes(q, k, v, "flash_attention_varlen")
    _check_varlen_shapes(q, k, v, paged)
    # The dense checks on (1, heads, tokens, head_dim) views (a pool's first page stands in for it): devices and
    # scale; the shapes they check passed above, in the caller's layout.
    q4, k4, v4 = _heads_view(q), _heads_view(k[0] if paged else k), _heads_view(v[0] if paged else v)
    softmax_scale = _check_placement_and_shapes(q4, k4, v4, causal, softmax_scale, "flash_attention_varlen")
    (window_left, window_right), softcap = _check_window_softcap(window, softcap)
    cu_q, longest_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    # (over pages the key counts are not tied to the pool's size)
    cu_k, longest_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, None if paged else k.shape[0], q.device)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have length batch + 1, got {cu_q.shape[0]} "
                         f"and {cu_k.shape[0]}")
    sinks = _check_sinks(sinks, q.shape[1], q.device)
    max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q, longest_q, "cu_seqlens_q")
    max_seqlen_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k, longest_k, "cu_seqlens_k")
    _check_bool("return_lse", return_lse)
    _check_bool("deterministic", deterministic)
    if paged:
        table = _check_table(q, k, cu_k, block_table)
        run = torch.ops.fa_lib.flash_attn_varlen_paged_fwd if torch.compiler.is_compiling() else \
            _paged_varlen_forward
        o, lse = run(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left,
                     window_right, softcap, table)
    else:
        fwd = _flash_attn_varlen_fwd if torch.compiler.is_compiling() else _FlashAttnVarlenFunction.apply
        o, lse = fwd(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, deterministic,
                     window_left, window_right, softcap)
    if sinks is not None:  # lse (heads_q, total_q), o (total_q, heads_q, head_dim)
        o, lse = _with_sinks(o, lse, sinks.view(-1, 1), lambda f: f.t().unsqueeze(-1))
    return (o, lse) if return_lse else o


def _check_varlen_shapes(q, k, v, paged):
    """`flash_attention_varlen`'s shapes in its layout: q (total_q, heads_q, head_dim); k and v (total_k, heads_kv,
    head_dim) alike, or pools of pages (num_pages, page_size, heads_kv, head_dim) (checked alike by `_check_pool`);
    head_dim shared and in range; heads_q a positive multiple of heads_kv."""
    if not paged and _shape(v) != _shape(k):
        raise ValueError(f"v must have the shape of k, (total_k, heads_kv, head_dim) = {_shape(k)}, got {_shape(v)}")
    if k.shape[-1] != q.shape[2]:
        raise ValueError(f"k must have the head_dim of q ({q.shape[2]}, q.shape[2]), got k of shape {_shape(k)}")
    h_q, h_kv = q.shape[1], k.shape[-2]
    if h_q < 1 or h_kv < 1:
        raise ValueError(f"q and k must have at least one head, got q {_shape(q)} and k {_shape(k)}")
    if h_q % h_kv:
        raise ValueError(f"the number of query heads ({h_q}, q.shape[1]) must be a multiple of the number of "
                         f"key/value heads ({h_kv}, k.shape[{k.dim() - 2}]) for grouped-query attention")
    if not _MIN_HEAD_DIM <= q.shape[2] <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim (q.shape[2]) must be between {_MIN_HEAD_DIM} and {_MAX_HEAD_DIM}, got "
                         f"{q.shape[2]}")


def _check_pool(q, k, v, block_table):
    """`flash_attention_varlen`'s checks of a paged call before the shared ones: forward only, k and v one pool of
    pages (4-D, checked by the caller), the table an int32 tensor on q's device."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("flash_attention_varlen over a paged cache (block_table) is forward only (no autograd): "
                         "call it under torch.no_grad() or torch.inference_mode(), or pass detached tensors")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)} (a pool of pages), got {tuple(v.shape)}")
    _check_block_table(block_table, q.device)
    if k.shape[0] < 1 or k.shape[1] < 1:
        raise ValueError(f"k must be a pool of pages (num_pages >= 1, page_size >= 1, heads, head_dim), got shape "
                         f"{tuple(k.shape)}")


def _check_table(q, k, cu_k, block_table):
    """The block table of a paged `flash_attention_varlen` against the checked key counts: its shape, and (on the
    host, except while a CUDA graph is captured or torch.compile traces) that each sequence's keys fit its row and
    use pages of the pool. Returns the table with its entries at stride 1 (the kernel reads its width as its row
    stride)."""
    batch, page = cu_k.shape[0] - 1, k.shape[1]
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must have shape (batch, pages per sequence) = ({batch}, W), got "
                         f"{tuple(block_table.shape)}")
    table = block_table.contiguous()
    from .decode import _tracing  # (decode imports this module)

    if not _tracing(q):
        n_keys = (cu_k[1:] - cu_k[:-1]).tolist()
        stop = [_cdiv(n, page) for n in n_keys]  # pages in use: [0, stop[b])
        bad = _bad_table_rows(table, [0] * len(stop), stop, k.shape[0]) | (np.array(stop) > table.shape[1])
        rows = np.flatnonzero(bad).tolist()
        if rows:
            b = rows[0]
            n = n_keys[b]
            raise ValueError(f"sequence {b} has {n} keys (cu_seqlens_k): block_table[{b}] must list "
                             f"cdiv({n}, page_size = {page}) = {_cdiv(n, page)} pages in [0, num_pages = "
                             f"{k.shape[0]}), within its {table.shape[1]} entries; got {table[b].tolist()}")
    return table


def _paged_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                          window_left, window_right, softcap, block_table):
    """The launch of a paged varlen prefill, inputs checked: q (total_q, H_q, D); k, v pools (num_pages, page_size,
    H_kv, D); block_table contiguous. Returns o (total_q, H_q, D) and lse (H_q, total_q)."""
    T_Q, H_Q, D = q.shape
    o = _empty((T_Q, H_Q, D), q.dtype, q.device)
    lse = _empty((H_Q, T_Q), torch.float32, q.device)
    pb = _varlen_problem(q, causal, window_left, window_right, softcap, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k)
    if T_Q == 0 or pb.batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return o.zero_(), lse.fill_(float("-inf"))
    _forward_launch(_heads_view(q), k.transpose(1, 2), v.transpose(1, 2), _heads_view(o), lse.unsqueeze(0),
                    softmax_scale, True, pb, block_table)
    return o, lse


@torch.library.custom_op("fa_lib::flash_attn_varlen_paged_fwd", mutates_args=())
def _flash_attn_varlen_paged_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                                 softmax_scale: float, window_left: int, window_right: int, softcap: float,
                                 block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _paged_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                 softmax_scale, window_left, window_right, softcap, block_table)


@_flash_attn_varlen_paged_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left,
      window_right, softcap, block_table):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)

