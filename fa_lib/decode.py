"""Decoding with a KV cache: ``fa_lib.flash_attention_with_kvcache`` (forward only).

A decoding step attends a few new queries (one per sequence when sampling, a few hundred when a draft
is verified) to every key cached so far. With so few queries the work is reading the cache, and a
kernel that gives each (sequence, head) one program leaves most of the GPU idle when the batch is
small. So the keys of each sequence are split across ``num_splits`` programs (split-KV): each writes
a partial ``(o, LSE)`` in float32, and they are merged with the exact merge of the book's chapter 2,
by the split kernel's last program of each query tile when the tile's splits fit one load
(``_fused_merge``: one launch per step), else by a second kernel. ``fa_lib.reference.kvcache_attention``
is the NumPy mirror, cut into the same chunks.
"""
import numbers
from typing import Optional

import torch

from . import checks, dispatch, kernels, launch
# The split plan is fa_lib.dispatch's; num_splits_heuristic and wave_time stay public here, the rest for the tests.
from .dispatch import (  # noqa: F401
    _FIXED_BLOCKS, _FUSE_ELEMENTS, _FUSE_ROW_CHUNKS, _INTERPRETER_SMS, _MAX_SPLITS, _config, _fused_merge, _launch_plan,
    _pdl, num_splits_heuristic,
    wave_time)
from .options import current
from .sinks import _with_sinks

__all__ = ["flash_attention_with_kvcache", "num_splits_heuristic", "page_cache", "wave_time", "workspace"]

_MAX_EXPLICIT_SPLITS = 1 << 16  # an explicit num_splits beyond this is refused (partials of that many splits)
_COMBINE_SPLITS = 32  # splits the combine kernel loads per step on a GPU (BLOCK_S): one round trip up to this
# Kernel option `decode_fused_merge` (default True; False: always the separate combine kernel).
# Kernel option `decode_pdl` (default False). True: the split kernel is launched with programmatic dependent launch (compute capability 9+). Off: on the H200
# (benchmarks/data/probe-decode-splits-nvidia-h200.json) it gained nothing alone, since
# the arrival counts' memset runs between two calls; without that memset (counts kept across calls, which two
# calls running at once could not share safely) a one-query step took up to 1.8 us less.
# On the H200 (benchmarks/data/probe-decode-fused-nvidia-h200.json) the fused
# merge took 0.1-1.9 us less per call than the combine kernel at the 12 split points where it runs with one
# load; forced with 4 loads of rows (B = 1, H = 32/8, N_q = 4) it took 2.3 us more, with 2 (B = 8, N_q = 16)
# 3.6 us less: one load is the rule kept, the data for two being a single point.


def workspace(q_or_shape, device=None):
    """A zeroed int32 workspace for `flash_attention_with_kvcache` calls whose queries have this shape (a q
    tensor, or its (B, H_q, N_q, d) shape with `device`): B * H_q * N_q entries, enough for any call with at most
    that many query rows. Calls that share it must run one after another (one stream, or ordered by events);
    each leaves it zero again."""
    if isinstance(q_or_shape, torch.Tensor):
        shape, device = tuple(q_or_shape.shape), q_or_shape.device if device is None else device
    else:
        shape = tuple(q_or_shape)
    if len(shape) != 4 or not all(isinstance(n, numbers.Integral) and n >= 0 for n in shape):
        raise ValueError(f"workspace needs q or its shape (batch, heads, seqlen, head_dim), got {q_or_shape!r}")
    return torch.zeros(max(1, shape[0] * shape[1] * shape[2]), dtype=torch.int32, device=device)


def page_cache(cache, page_size, order=None):
    """A contiguous cache (B, H_kv, N_max, d) cut into pages for ``flash_attention_with_kvcache(block_table=)``:
    returns ``(pool, block_table)``, the pool (B * W, H_kv, page_size, d) with W = ceil(N_max / page_size) (the
    last page of each sequence padded with zeros) and block_table (B, W) ``torch.int32``. Page w of sequence b goes
    to pool slot ``order[b * W + w]``: ``order`` is a permutation of ``range(B * W)`` (a list or a tensor; default
    in order), so the pages can lie anywhere in the pool, as a serving system's allocator leaves them."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"cache must be a torch.Tensor (batch, kv_heads, N_max, head_dim), got {type(cache).__name__}")
    if cache.dim() != 4:
        raise ValueError(f"cache must be 4-D (batch, kv_heads, N_max, head_dim), got shape {tuple(cache.shape)}")
    if isinstance(page_size, bool) or not isinstance(page_size, numbers.Integral) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    B, H_KV, N_MAX, D = cache.shape
    W = dispatch._cdiv(N_MAX, page_size)
    slots = torch.arange(B * W) if order is None else torch.as_tensor(order).cpu()
    if slots.shape != (B * W,) or not torch.equal(slots.sort().values, torch.arange(B * W)):
        raise ValueError(f"order must be a permutation of range(B * W) = range({B * W}), got {order!r}")
    padded = torch.zeros((B, H_KV, W * page_size, D), dtype=cache.dtype, device=cache.device)
    padded[:, :, :N_MAX] = cache
    pool = torch.empty((B * W, H_KV, page_size, D), dtype=cache.dtype, device=cache.device)
    pool[slots.to(cache.device)] = padded.view(B, H_KV, W, page_size, D).transpose(1, 2).reshape(B * W, H_KV,
                                                                                                  page_size, D)
    return pool, slots.view(B, W).to(device=cache.device, dtype=torch.int32)


def page_packed(keys, cu_seqlens_k, page_size, order=None):
    """Packed keys (or values) in flash-attn's varlen layout, (total_k, H_kv, d) with sequence b at rows
    ``cu_seqlens_k[b] .. cu_seqlens_k[b + 1]``, cut into pages for ``flash_attention_varlen(block_table=)``: returns
    ``(pool, block_table)``, the pool (B * W, page_size, H_kv, d) with W the most pages a sequence needs (at least
    1; rows past a sequence's keys are zeros) and block_table (B, W) ``torch.int32``. Page w of sequence b goes to
    pool slot ``order[b * W + w]`` (a permutation of ``range(B * W)``; default in order)."""
    if not isinstance(keys, torch.Tensor) or keys.dim() != 3:
        raise ValueError(f"keys must be a 3-D torch.Tensor (total_k, kv_heads, head_dim), got "
                         f"{tuple(keys.shape) if isinstance(keys, torch.Tensor) else type(keys).__name__}")
    if isinstance(page_size, bool) or not isinstance(page_size, numbers.Integral) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    cu = checks._check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, keys.shape[0], cu_seqlens_k.device
                               if isinstance(cu_seqlens_k, torch.Tensor) else keys.device)[0].tolist()
    lens = [b - a for a, b in zip(cu, cu[1:])]
    W = max([dispatch._cdiv(n, page_size) for n in lens] + [1])
    padded = keys.new_zeros((len(lens), W * page_size) + tuple(keys.shape[1:]))  # (B, W * P, H_kv, d)
    for b, n in enumerate(lens):
        padded[b, :n] = keys[cu[b]:cu[b + 1]]
    pool, table = page_cache(padded.transpose(1, 2), page_size, order)  # (B * W, H_kv, P, d)
    return pool.transpose(1, 2).contiguous(), table


def _tracing(q):
    """True while a CUDA graph is captured on q's device or torch.compile traces: no value can be read back."""
    return (q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()) or torch.compiler.is_compiling()


_NAME = "flash_attention_with_kvcache"  # (the function the shared checks name in their messages)
_WINDOW_READ_ALIGN = 128  # every split-kernel key block (16 to 128 keys) divides it: see `_check`'s pages


def _check(q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale, num_splits, return_lse, check_lengths,
           workspace=None, block_table=None, left=-1, cache_batch_idx=None, cache_leftpad=None, rotary=None):
    tensors = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens)]
    # (integer tensors of shape (B,), checked as cache_seqlens is below)
    indices = [(n, t) for n, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad))
               if t is not None]
    if block_table is not None:
        tensors.append(("block_table", block_table))
        if indices:
            raise ValueError(f"block_table cannot be combined with {indices[0][0]}: a block table already says "
                             f"where each sequence's keys lie (pass one or the other)")
    tensors += indices
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and their values) or both be None")
    if k is not None:
        tensors += [("k", k), ("v", v)]
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if torch.is_grad_enabled() and any(t.requires_grad for _, t in tensors):
        raise ValueError("flash_attention_with_kvcache is forward-only (no autograd): call it under "
                         "torch.no_grad() or torch.inference_mode(), or pass detached tensors")
    for name, t in tensors:
        if name not in ("cache_seqlens", "block_table", "cache_batch_idx", "cache_leftpad") and t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}")
    B, H_Q, N_Q, D = q.shape
    H_KV, N_MAX = k_cache.shape[1], k_cache.shape[2]
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if block_table is not None:
        checks._check_block_table(block_table, q.device)
        if block_table.dim() != 2 or block_table.shape[0] != B:
            raise ValueError(f"block_table must have shape (batch, pages per sequence) = ({B}, W), got "
                             f"{tuple(block_table.shape)}")
        if k_cache.shape[3] != D or k_cache.shape[0] < 1 or k_cache.shape[2] < 1:
            raise ValueError(f"with a block_table, k_cache must be a pool of pages (num_pages >= 1, kv_heads, "
                             f"page_size >= 1, head_dim = {D}), got shape {tuple(k_cache.shape)}")
        N_MAX = block_table.shape[1] * k_cache.shape[2]  # W pages of page_size keys
    elif cache_batch_idx is not None:
        if k_cache.shape[0] < 1 or k_cache.shape[3] != D:
            raise ValueError(f"with cache_batch_idx, k_cache must be (cache rows >= 1, kv_heads, N_max, head_dim = "
                             f"{D}), got shape {tuple(k_cache.shape)}")
    elif k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"k_cache must be (batch, kv_heads, N_max, head_dim) with q's batch {B} and head_dim {D}, "
                         f"got shape {tuple(k_cache.shape)}")
    if H_KV < 1 or H_Q < 1 or H_Q % H_KV:
        raise ValueError(f"q's heads ({H_Q}) must be a multiple of k_cache's heads ({H_KV}), both at least 1 "
                         f"(grouped-query attention)")
    # dtypes, devices, head dim range, causal and softmax_scale: the checks of flash_attention.
    if block_table is None and cache_batch_idx is None:
        scale = checks._check_inputs(q, k_cache, v_cache, causal, softmax_scale, _NAME)
    else:  # a pool of pages (or of cache rows) has no batch dimension: checked as one page per sequence
        scale = checks._check_inputs(q, k_cache[:1].expand(B, -1, -1, -1), v_cache[:1].expand(B, -1, -1, -1), causal,
                                     softmax_scale, _NAME)
    for name, t in [("cache_seqlens", cache_seqlens)] + indices:
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be a torch.int32 tensor, got {t.dtype}")
        if tuple(t.shape) != (B,):
            raise ValueError(f"{name} must have shape (batch,) = ({B},), got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    n_new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            if t.dtype != q.dtype or t.device != q.device:
                raise TypeError(f"{name} must have q's dtype {q.dtype} and device {q.device}, got {t.dtype} on "
                                f"{t.device}")
            if t.shape[0] != B or t.shape[1] != H_KV or t.shape[3] != D or t.shape != k.shape:
                raise ValueError(f"k and v must both have shape (batch, kv_heads, n_new, head_dim) = "
                                 f"({B}, {H_KV}, n_new, {D}), got {tuple(k.shape)} and {tuple(v.shape)}")
        n_new = k.shape[2]
        if n_new > N_MAX:
            where = ("block_table.shape[1] * k_cache.shape[2]" if block_table is not None else "k_cache.shape[2]")
            raise ValueError(f"k and v append {n_new} keys, more than the cache holds (N_max = {where} = "
                             f"{N_MAX})")
    checks._check_bool("check_lengths", check_lengths)
    # One small device-to-host copy, so that a bad length never reaches the kernel. Inside CUDA-graph
    # capture (how decoding loops are usually run) or while torch.compile traces no copy can be made, and with
    # check_lengths=False none is: the lengths are then the caller's duty (a bad one is clamped into
    # [0, N_max - n_new], never read past).
    lens = cache_seqlens.tolist() if check_lengths and not _tracing(q) else []
    bad = [(b, n) for b, n in enumerate(lens) if n < 0 or n + n_new > N_MAX]
    if bad:
        b, n = bad[0]
        where = "block_table.shape[1] * k_cache.shape[2]" if block_table is not None else "k_cache.shape[2]"
        raise ValueError(f"cache_seqlens[{b}] = {n}: every cache_seqlens[b] + n_new ({n_new}) must lie in "
                         f"[0, N_max = {where} = {N_MAX}]")
    if cache_batch_idx is not None and lens:
        rows = cache_batch_idx.tolist()
        bad = [(b, r) for b, r in enumerate(rows) if not 0 <= r < k_cache.shape[0]]
        if bad:
            raise ValueError(f"cache_batch_idx[{bad[0][0]}] = {bad[0][1]}: every entry must be a row of k_cache, in "
                             f"[0, k_cache.shape[0] = {k_cache.shape[0]})")
        if k is not None and len(set(rows)) < len(rows):
            raise ValueError(f"cache_batch_idx = {rows} lists a cache row twice while k and v are appended: two "
                             f"sequences would write the same row")
    if cache_leftpad is not None and lens:
        bad = [(b, p, n) for b, (p, n) in enumerate(zip(cache_leftpad.tolist(), lens)) if not 0 <= p <= n]
        if bad:
            b, p, n = bad[0]
            raise ValueError(f"cache_leftpad[{b}] = {p}: every cache_leftpad[b] must lie in [0, cache_seqlens[b]] "
                             f"(here [0, {n}]): a sequence's keys start there")
    if rotary is not None:  # (rotary_cos, rotary_sin, rotary_interleaved, the queries rotated one place apart)
        _check_rotary(q, n_new, *rotary, lens)
    if block_table is not None and lens:
        # The pages each sequence's keys (after the append) lie in: indices into the pool, checked with the lengths.
        # With a window's left edge the kernel reads from the window's first key rounded down to its key block, so
        # only the pages from there (rounded down to _WINDOW_READ_ALIGN keys) are in use: a server may free the rest.
        page = k_cache.shape[2]
        first = [0 if left < 0 else max(0, n + n_new - N_Q - left) // _WINDOW_READ_ALIGN * _WINDOW_READ_ALIGN // page
                 for n in lens]
        rows = checks._bad_table_rows(block_table, first, [dispatch._cdiv(n + n_new, page) for n in lens],
                                   k_cache.shape[0]).nonzero()[0]
        if rows.size:
            b = int(rows[0])
            n_b, first_b = lens[b] + n_new, first[b]
            used = block_table[b, first_b:dispatch._cdiv(n_b, page)].tolist()
            pages = f"pages {first_b} to {dispatch._cdiv(n_b, page) - 1}" if first_b else f"first {len(used)} pages"
            raise ValueError(f"block_table[{b}] must hold page indices in [0, num_pages = k_cache.shape[0] = "
                             f"{k_cache.shape[0]}) for its {pages} (cache_seqlens[{b}] + n_new = {n_b} "
                             f"keys), got {used}")
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
            raise TypeError(f"num_splits must be a positive int or None, got {type(num_splits).__name__}")
        if not 1 <= num_splits <= _MAX_EXPLICIT_SPLITS:
            raise ValueError(f"num_splits must be a positive int (at most {_MAX_EXPLICIT_SPLITS}) or None, "
                             f"got {num_splits}")
    if k is not None and 0 in k_cache.stride()[:3] + v_cache.stride()[:3]:
        raise ValueError("k_cache and v_cache must own one slot per (sequence, head, position) to append k and "
                         "v into them; an expanded view (a zero stride) would write one slot for several")
    checks._check_bool("return_lse", return_lse)
    if workspace is not None:
        if not isinstance(workspace, torch.Tensor):
            raise TypeError(f"workspace must be a torch.Tensor (fa_lib.decode.workspace(q)) or None, got "
                            f"{type(workspace).__name__}")
        if workspace.dtype != torch.int32 or workspace.device != q.device:
            raise TypeError(f"workspace must be an int32 tensor on q's device {q.device}, got {workspace.dtype} on "
                            f"{workspace.device}")
        if workspace.dim() != 1 or not workspace.is_contiguous() or workspace.numel() < B * H_Q * N_Q:
            raise ValueError(f"workspace must be a contiguous 1-D tensor of at least B * H_q * N_q = {B * H_Q * N_Q} "
                             f"entries (fa_lib.decode.workspace(q)), got shape {tuple(workspace.shape)}")
    return scale, n_new, bool(lens) or B == 0


def flash_attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k=None, v=None, causal=True,
                                 softmax_scale=None, num_splits=None, return_lse=False, check_lengths=True,
                                 workspace=None, block_table=None, window=(-1, -1), softcap=0.0, cache_batch_idx=None,
                                 cache_leftpad=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                                 sinks=None):
    """Attention of new queries over a KV cache, for decoding (forward only, no autograd).

    Layout (batch, heads, seqlen, head_dim), as ``flash_attention``:

    * ``q`` (B, H_q, N_q, d): the new queries, N_q small (1 when sampling; up to a few hundred when a
      speculative draft is verified);
    * ``k_cache``, ``v_cache`` (B, H_kv, N_max, d): the cache, H_q a multiple of H_kv (grouped-query
      attention: the H_q / H_kv query heads of a cache head are packed into one tile, so the cache is
      read once per cache head);
    * ``cache_seqlens`` (B,) ``torch.int32``: how many cached keys of each sequence are valid;
    * ``k``, ``v`` (B, H_kv, N_new, d), optional: new keys and values, written into the caches **in
      place** at positions ``cache_seqlens[b] .. cache_seqlens[b] + N_new - 1`` before attending (so the
      sequence then has ``cache_seqlens[b] + N_new`` keys; ``cache_seqlens`` itself is not changed).
      Every length is checked against N_max on the host first (``check_lengths``), except during
      CUDA-graph capture, which the function supports (no host synchronisation then).

    q, the caches, k and v share one dtype, ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``, and one
    device; any ``1 <= d <= 256``. ``softmax_scale`` (default None, meaning ``1 / sqrt(d)``): otherwise a positive
    number multiplying ``q @ k^T``, as in ``flash_attention``. Forward only: with grad mode on, an input that
    requires grad raises ``ValueError``; call it under ``torch.no_grad()`` (or ``torch.inference_mode()``), or
    pass detached tensors.

    ``causal`` (default True) aligns the mask bottom-right over each sequence's valid keys: query i
    sees key j iff ``j <= i + n_b - N_q``, with ``n_b`` the valid length after the append. A query that
    sees no key gets o = 0 and LSE = -inf. ``num_splits`` (default None): into how many chunks each sequence's
    keys are cut, an int from 1 to 65536 (None: ``num_splits_heuristic`` from the GPU's SM count); the result
    does not depend on it beyond rounding. Returns o (B, H_q, N_q, d) in q's dtype, and with ``return_lse``
    also the natural-log LSE (B, H_q, N_q) float32.

    ``check_lengths`` (default True): copy ``cache_seqlens`` to the host and raise a ``ValueError`` for a
    length outside ``[0, N_max - N_new]``. The copy waits for the stream, so in an eager decoding loop
    the host cannot run ahead of the GPU: on the H200 (``benchmarks/data/probe-host-launch-nvidia-h200.json``) an eager
    step of B = 8, H = 32/8, 16k cached keys took about twice as long with the check as without.
    ``False`` skips it (as CUDA-graph capture does): the lengths are then the caller's duty, and a bad
    one is clamped into that range by the kernel and the append (a wrong result, never a read or write
    outside the cache).

    ``workspace`` (default None): an int32 tensor of zeros from ``fa_lib.decode.workspace(q)``, kept by the
    caller and passed to every call of a decoding loop. It holds the counts by which the split kernel's last
    program of a query tile knows it is the last (the fused merge); each call leaves them zero again. Without
    it every call zeroes a fresh buffer first, one more GPU operation per call; with it there is none, and on
    Hopper the split kernel is launched as a programmatic dependent of the kernel before it, so that its
    launch overlaps that kernel's tail. Calls that share a workspace must not run at the same time (on two
    streams, or two CUDA graphs replayed side by side): they would count into the same places and merge too
    early, a wrong result. One workspace per stream (or per captured graph) is safe.

    ``window=(left, right)`` and ``softcap``: as ``flash_attention`` takes them (a sliding window aligned like the
    causal mask over each sequence's valid keys, -1 for an unbounded side; scores ``c tanh(s / c)``). With a left
    edge only the last ``N_q + left`` keys of each sequence are read, and split.

    Under ``torch.compile`` (``fullgraph=True`` too) the call is one operator, ``fa_lib::kvcache_attn``, which
    mutates the caches (the append) and the workspace; the lengths are then not copied to the host.

    ``block_table`` (default None): a paged cache, as vLLM and flash-attn keep one. ``k_cache`` and ``v_cache`` are
    then one pool of pages, (num_pages, H_kv, page_size, d), any page_size >= 1, and ``block_table`` (B, W)
    ``torch.int32`` lists each sequence's pages in order: key j of sequence b is row ``j % page_size`` of page
    ``block_table[b, j // page_size]``, so N_max = W * page_size, and the append writes into those pages.
    Sequences may share pages (a common prefix stored once); appending into a shared page changes it for
    every sequence that lists it, so give each sequence its own page from where it writes. Entries past a
    sequence's pages are never read; the ones in use are checked with the lengths (``check_lengths``), and
    without the check one outside the pool is clamped into it (a wrong result, never a read outside it). With a
    window's left edge the pages before the one holding the window's first key, rounded down to a multiple of
    128 keys, are not read either: they may be freed (any entry, -1 say).

    ``cache_batch_idx`` (B,) ``torch.int32`` (default None): sequence b's cache is row ``cache_batch_idx[b]`` of
    ``k_cache``, ``v_cache`` (B_cache, H_kv, N_max, d), which may have more rows than the batch (a server's
    slots, of which this step uses some); the append writes into that row. Rows must be distinct when k, v are
    appended. ``cache_leftpad`` (B,) ``torch.int32`` (default None): sequence b's keys start at cache position
    ``cache_leftpad[b]`` (a left-padded batch), so it has ``cache_seqlens[b] + N_new - cache_leftpad[b]`` valid
    keys, over which the masks are aligned; the append still writes at ``cache_seqlens[b]``. Both are checked
    with the lengths (``0 <= cache_leftpad[b] <= cache_seqlens[b]``, rows inside the cache) and otherwise
    clamped into range; neither combines with ``block_table``. A row of cache_batch_idx is read as a page
    holding the whole N_max (a one-entry block table), so both take the paged kernel's path.

    ``rotary_cos``, ``rotary_sin`` (seqlen_ro, rotary_dim / 2), floating point (default None): the rotary
    embedding, applied by the call as flash-attn applies it. The first rotary_dim channels of the new keys are
    rotated at positions ``cache_seqlens[b] + j`` before the append, and those of the queries at
    ``cache_seqlens[b] + i`` (causal or windowed) or all at ``cache_seqlens[b]`` (otherwise), in float32, rounded
    to q's dtype; ``rotary_interleaved`` (default True; a bool, checked on every call) pairs channels (0, 1),
    (2, 3), ... (GPT-J) when True, or c and c + rotary_dim / 2 (GPT-NeoX) when False. Fused: one kernel rotates
    the queries, and the append kernel rotates the keys as it writes them. A position past seqlen_ro is refused
    when the lengths are checked, else clamped to the last one.

    ``sinks`` (H_q,) floating point (default None): attention sinks, one logit per query head, as in
    ``flash_attention`` (finite, or -inf for no sink).

    Raises:
        TypeError: a non-tensor q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_batch_idx,
            cache_leftpad or workspace; an unsupported dtype, or k, v not of q's dtype and device; an index
            tensor (cache_seqlens, block_table, cache_batch_idx, cache_leftpad) that is not ``torch.int32``; a
            workspace that is not int32 on q's device; rotary tables that are not floating-point tensors on
            q's device (or only one of them); a non-bool flag (``causal``, ``return_lse``, ``check_lengths``,
            ``rotary_interleaved``); a ``num_splits`` that is not an int; a ``window``, ``softmax_scale``,
            ``softcap`` or ``sinks`` of the wrong type, as in ``flash_attention``.
        ValueError: an input that requires grad (forward only); tensors of the wrong rank or shapes (caches
            unlike, heads of q not a multiple of the cache's, head dims unlike or outside ``[1, 256]``, index
            tensors not ``(B,)``, a block table not ``(B, W)``, more new keys than the cache holds); k without
            v; mismatched devices or meta tensors; block_table with cache_batch_idx or cache_leftpad; with the
            lengths checked, a length outside ``[0, N_max - N_new]``, a page, cache row or left pad out of
            range, a cache row listed twice while appending, a rotary position past the tables; a
            ``num_splits`` outside ``[1, 65536]``; an append into an expanded (zero-stride) cache; a workspace
            too small or not a contiguous 1-D tensor; rotary tables of the wrong shape; and the value errors of
            ``flash_attention`` (scale, window, softcap, sinks with NaN or ``+inf``).
    """
    (left, right), softcap = checks._check_window_softcap(window, softcap)
    checks._check_bool("rotary_interleaved", rotary_interleaved)  # (on every call, as causal: not only with rotary)
    rotary = None
    if rotary_cos is not None or rotary_sin is not None:
        rotary = (rotary_cos, rotary_sin, rotary_interleaved, causal is True or (left, right) != (-1, -1))
    scale, _, checked = _check(q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale, num_splits,
                               return_lse, check_lengths, workspace, block_table, left, cache_batch_idx, cache_leftpad,
                               rotary)
    sinks = checks._check_sinks(sinks, q.shape[1], q.device)
    if cache_batch_idx is not None:  # each sequence's row of the cache as one page of N_max keys
        block_table = cache_batch_idx[:, None]
    # Traced by torch.compile: one opaque operator (its fake returns the shapes); eager: the same function directly.
    run = torch.ops.fa_lib.kvcache_attn if torch.compiler.is_compiling() else _kvcache_attn_impl
    out, lse = run(q, k_cache, v_cache, cache_seqlens, k, v, causal, scale, int(num_splits or 0), workspace,
                   block_table, checked, left, right, softcap, cache_leftpad, *(rotary or (None, None, True, False)))
    if sinks is not None:
        out, lse = _with_sinks(out, lse, sinks.view(1, -1, 1), lambda f: f.unsqueeze(-1))
    return (out, lse) if return_lse else out


def _kvcache_attn_impl(q, k_cache, v_cache, cache_seqlens, k, v, causal, scale, num_splits, workspace, block_table,
                       checked, window_left=-1, window_right=-1, softcap=0.0, cache_leftpad=None, rotary_cos=None,
                       rotary_sin=None, rotary_interleaved=True, rotary_per_query=False):
    """`flash_attention_with_kvcache` once its inputs are checked (`checked`: the lengths too): the rotary
    embedding of the queries, the append of k, v into the caches (or their pages), then the launches;
    num_splits 0 for the heuristic's. Returns (o, lse). Eager calls run it directly (no dispatcher on the host's
    path); torch.compile sees it as `_kvcache_attn`."""
    B, H_Q, N_Q, D = q.shape
    n_new = 0 if k is None else k.shape[2]
    rotary = None if rotary_cos is None else (rotary_cos.contiguous(), rotary_sin.contiguous(), rotary_interleaved)
    if rotary is not None and B and N_Q:
        q = _rotate_queries(q, cache_seqlens, *rotary, rotary_per_query)
    if n_new and B:
        _append(q, k, v, k_cache, v_cache, cache_seqlens, block_table, rotary)
    if B == 0 or N_Q == 0:
        return q.new_zeros((B, H_Q, N_Q, D)), q.new_zeros((B, H_Q, N_Q), dtype=torch.float32)
    out = launch._empty((B, H_Q, N_Q, D), q.dtype, q.device)
    lse = launch._empty((B, H_Q, N_Q), torch.float32, q.device)
    _attend(q, k_cache, v_cache, cache_seqlens, n_new, causal, scale, num_splits or None, out, lse, workspace,
            block_table, (window_left, window_right), softcap, cache_leftpad)
    return out, lse


@torch.library.custom_op("fa_lib::kvcache_attn", mutates_args=("k_cache", "v_cache", "workspace"))
def _kvcache_attn(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                  k: Optional[torch.Tensor], v: Optional[torch.Tensor], causal: bool, scale: float, num_splits: int,
                  workspace: Optional[torch.Tensor], block_table: Optional[torch.Tensor], checked: bool,
                  window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                  cache_leftpad: Optional[torch.Tensor] = None, rotary_cos: Optional[torch.Tensor] = None,
                  rotary_sin: Optional[torch.Tensor] = None, rotary_interleaved: bool = True,
                  rotary_per_query: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return _kvcache_attn_impl(q, k_cache, v_cache, cache_seqlens, k, v, causal, scale, num_splits, workspace,
                              block_table, checked, window_left, window_right, softcap, cache_leftpad, rotary_cos,
                              rotary_sin, rotary_interleaved, rotary_per_query)


@_kvcache_attn.register_fake
def _(q, k_cache, v_cache, cache_seqlens, k, v, causal, scale, num_splits, workspace, block_table, checked,
      window_left=-1, window_right=-1, softcap=0.0, cache_leftpad=None, rotary_cos=None, rotary_sin=None,
      rotary_interleaved=True, rotary_per_query=False):
    B, H_Q, N_Q, D = q.shape
    return q.new_empty((B, H_Q, N_Q, D)), q.new_empty((B, H_Q, N_Q), dtype=torch.float32)


def _check_rotary(q, n_new, cos, sin, interleaved, per_query, lens):
    """The rotary embedding's arguments of `flash_attention_with_kvcache` (q (B, H_q, N_q, d)), and with the
    lengths copied to the host (`lens`, empty when they are not) that every position it rotates lies in cos."""
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (seqlen_ro, rotary_dim / 2) with rotary_cos and "
                            f"rotary_sin both given, got {type(t).__name__}")
        if t.dim() != 2 or t.shape != cos.shape or not 1 <= 2 * t.shape[1] <= q.shape[3] or t.shape[0] < 1:
            raise ValueError(f"rotary_cos and rotary_sin must both have shape (seqlen_ro, rotary_dim / 2) with "
                             f"rotary_dim <= head_dim = {q.shape[3]}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
        if t.device != q.device or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor on q's device {q.device}, got {t.dtype} on "
                            f"{t.device}")
    n_pos = max(q.shape[2] if per_query else 1, n_new)
    if lens and max(lens) + n_pos > cos.shape[0]:
        raise ValueError(f"rotary_cos and rotary_sin cover positions 0 to {cos.shape[0] - 1}, but cache_seqlens up "
                         f"to {max(lens)} puts a key or query at {max(lens) + n_pos - 1}")


def _rotate_queries(q, cache_seqlens, cos, sin, interleaved, per_query):
    """q (B, H_q, N_q, d) rotated (`kernels._rotary_q`) into a new (B, H_q, N_q, d) tensor; cos, sin contiguous."""
    B, H_Q, N_Q, D = q.shape
    out = torch.empty((B, N_Q, H_Q, D), dtype=q.dtype, device=q.device).transpose(1, 2)  # q's usual layout
    meta = dispatch._meta(q, False)
    block_m = min(16, dispatch._next_pow2(N_Q))
    with launch._device_guard(q):
        launch.launch(kernels._rotary_q, (dispatch._cdiv(N_Q, block_m), B * H_Q), (
            q, out, cache_seqlens.contiguous(), cos, sin, *launch._strides(q), *launch._strides(out), H_Q, N_Q, D,
            cos.shape[1], cos.shape[0]), dict(
            HEAD_DIM=meta["HEAD_DIM"], BLOCK_M=block_m, PER_QUERY=bool(per_query), INTERLEAVED=bool(interleaved),
            EMULATE_BF16=meta["EMULATE_BF16"], num_warps=4))
    return out


def _paging(k_cache, block_table, cache_seqlens):
    """The kernels' view of a cache: (PAGE, number of pages, table, N_MAX). Paged: the page size, the pool's pages,
    the block table with its entries at stride 1, and the table's width times the page size; contiguous: 0, 1,
    any int32 pointer in place of the table (never read) and the cache's length."""
    if block_table is not None:
        return k_cache.shape[2], k_cache.shape[0], block_table.contiguous(), block_table.shape[1] * k_cache.shape[2]
    return 0, 1, cache_seqlens, k_cache.shape[2]


def _append(q, k, v, k_cache, v_cache, cache_seqlens, block_table, rotary):
    """The append of k, v (B, H_kv, N_new, d) into the caches or their pages (`kernels._append_kv`), the keys
    rotated on the way when `rotary` is (cos, sin, interleaved), cos and sin contiguous."""
    B, H_KV, N_NEW, D = k.shape
    page, n_pages, table, N_MAX = _paging(k_cache, block_table, cache_seqlens)
    cos, sin, interleaved = rotary if rotary is not None else (cache_seqlens, cache_seqlens, True)  # (never read)
    meta = dispatch._meta(q, False)
    block_n = min(16, dispatch._next_pow2(N_NEW))
    with launch._device_guard(q):
        launch.launch(kernels._append_kv, (dispatch._cdiv(N_NEW, block_n), B * H_KV), (
            k, v, k_cache, v_cache, cache_seqlens.contiguous(), table, cos, sin, *launch._strides(k), *launch._strides(v),
            *launch._strides(k_cache), *launch._strides(v_cache), table.stride(0), n_pages, H_KV, N_NEW, N_MAX, D,
            cos.shape[1] if rotary is not None else 0, cos.shape[0] if rotary is not None else 1), dict(
            HEAD_DIM=meta["HEAD_DIM"], BLOCK_N=block_n, PAGE=page, ROTARY=rotary is not None,
            INTERLEAVED=bool(interleaved), EMULATE_BF16=meta["EMULATE_BF16"], num_warps=4))


def _attend(q, k_cache, v_cache, cache_seqlens, n_new, causal, scale, num_splits, out, lse, workspace=None,
            block_table=None, window=(-1, -1), softcap=0.0, cache_leftpad=None):
    """The launches of `flash_attention_with_kvcache` once its inputs are checked and appended: attention of q
    (B, H_q, N_q, d) over the first ``cache_seqlens[b] + n_new`` keys of each sequence's cache, written to out
    (B, H_q, N_q, d, any strides, q's dtype) and lse (B, H_q, N_q) float32 contiguous. B, N_q >= 1. `workspace`,
    `block_table`, `cache_leftpad`: as `flash_attention_with_kvcache` takes them (checked), or None (cache_batch_idx
    as its one-column block table); `window`, `softcap` checked."""
    B, H_Q, N_Q, D = q.shape
    H_KV = k_cache.shape[1]
    page, n_pages, table, N_MAX = _paging(k_cache, block_table, cache_seqlens)
    cache_seqlens = cache_seqlens.contiguous()  # the kernel reads entry b at offset b
    meta = dispatch._meta(q, causal)
    group = H_Q // H_KV
    sms = _INTERPRETER_SMS if kernels.INTERPRET else torch.cuda.get_device_properties(q.device).multi_processor_count
    num_splits = None if num_splits is None else int(num_splits)  # a NumPy integer is a launch argument too
    right_edge, local, win_left, win_right = dispatch._band(causal, window)
    # with a left edge a sequence's chunks cut at most its last N_q + left keys (and a block's rounding)
    fitted = dict(elt_bytes=k_cache.element_size(), shared_memory=kernels.device_shared_memory(q.device))
    n_read = min(N_MAX, N_Q + win_left + _config(meta["HEAD_DIM"], group * N_Q, **fitted)[1]) if local else N_MAX
    num_splits, (block_m, block_n, num_warps, num_stages) = _launch_plan(
        B, H_KV, group * N_Q, n_read, meta["HEAD_DIM"], sms, num_splits, **fitted)
    split = num_splits > 1
    m_tiles = dispatch._cdiv(group * N_Q, block_m)
    fused = _fused_merge(num_splits, group * N_Q, block_m, meta["HEAD_DIM"]) if current().decode_fused_merge else None
    with launch._device_guard(q):
        if split:
            o_part = torch.empty((num_splits, B, H_Q, N_Q, meta["HEAD_DIM"]), dtype=torch.float32,
                                 device=q.device)
            lse_part = torch.empty((num_splits, B, H_Q, N_Q), dtype=torch.float32, device=q.device)
        else:
            o_part = lse_part = lse  # unused
        # the fused merge's arrival counts, one per (b, h_kv, query tile): the caller's workspace (zero, and left
        # zero by the last arrival of each tile), or zeroed for this call
        if not fused:
            arrived = lse
        elif workspace is not None:
            arrived = workspace
        else:
            arrived = torch.zeros((B * H_KV * m_tiles,), dtype=torch.int32, device=q.device)
        launch.launch(kernels._decode_split, (num_splits, B * H_KV, m_tiles), (
            q, k_cache, v_cache, cache_seqlens, n_new, N_MAX, scale, o_part, lse_part, out, lse, arrived,
            table, table.stride(0), n_pages,
            *launch._strides(q), *launch._strides(k_cache), *launch._strides(v_cache), *launch._strides(out),
            B, H_Q, H_KV, group, N_Q, D, num_splits), dict(
            HEAD_DIM=meta["HEAD_DIM"], CAUSAL=right_edge, MASK_D=meta["MASK_D"], EMULATE_BF16=meta["EMULATE_BF16"],
            PRECISION=meta["PRECISION"], SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n,
            FUSED=fused is not None, BLOCK_S=fused[0] if fused else 1, ROWS_C=fused[1] if fused else 1,
            PAGE=page, num_warps=num_warps, num_stages=num_stages, **_pdl(q, workspace is not None),
            **({} if not (local or softcap or win_right) else dict(
                WIN_LEFT=win_left, WIN_RIGHT=win_right, softcap=float(softcap), LOCAL=local,
                SOFTCAP=dispatch._softcap_mode(softcap))),
            **({} if cache_leftpad is None else dict(LeftPad=cache_leftpad.contiguous(), LEFTPAD=True))))
        if split and not fused:
            block_s = 4 if kernels.INTERPRET else min(_COMBINE_SPLITS, dispatch._next_pow2(num_splits))
            launch.launch(kernels._decode_combine, (B * H_Q * N_Q,), (
                o_part, lse_part, out, lse, *launch._strides(out), B, H_Q, N_Q, D, num_splits), dict(
                HEAD_DIM=meta["HEAD_DIM"], EMULATE_BF16=meta["EMULATE_BF16"], BLOCK_S=block_s, num_warps=4))
