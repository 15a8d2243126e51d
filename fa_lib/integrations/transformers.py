"""HuggingFace transformers on fa_lib's kernels: ``attn_implementation="fa_lib"``.

``register(name="fa_lib")`` registers two functions with transformers under one name:

* the **attention function** ``fa_lib_attention_forward``, with ``transformers.AttentionInterface``: what
  every attention layer calls instead of ``scaled_dot_product_attention``. It runs
  ``fa_lib.flash_attention`` (forward and backward) and returns ``(output, None)`` with the output in the
  ``(batch, seqlen, heads, head_dim)`` layout that the layers expect;
* the **mask function** ``fa_lib_mask``, with ``transformers.masking_utils.AttentionMaskInterface``: what
  the model calls once per forward (per kind of layer) to build the mask that every layer then receives.

Why the mask function is needed: a model whose attention implementation has no registered mask function
gets ``attention_mask=None`` in every layer (transformers' ``_preprocess_mask_arguments`` skips the mask
for names it does not know). A left-padded batch then attends to its padding tokens, and its logits are
silently wrong. ``fa_lib_mask`` instead returns a ``FaLibMask``: the mask in the terms fa_lib computes
exactly, with no ``(seqlen_q, seqlen_k)`` tensor formed:

* a key padding mask, ``(batch, seqlen_k)`` bool (from the model's 2-D ``attention_mask``), or ``None``;
* a causal band with an optional sliding window, aligned bottom-right as fa_lib aligns it (query ``i``
  sees key ``j`` iff ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``), which
  is what a KV cache needs: the last query is the last key. transformers describes the same mask by
  absolute positions (``q_offset``, ``kv_offset``); ``fa_lib_mask`` converts them, and drops the keys
  that no query can see (a static cache's unwritten slots), so that the bottom-right alignment holds.

Every query row sees exactly the keys that transformers' own ``sdpa``/``eager`` masks let it see. A row
that sees no key (a left-padding query, which sees only padding) gets output 0, never NaN; ``sdpa``'s
output there is meaningless anyway, as it is padding.

Supported: causal and bidirectional attention, a key padding mask (left or right padding), sliding
windows (``create_sliding_window_causal_mask``: Mistral, Qwen2, Gemma 2, ...; and the bidirectional
one), grouped-query and multi-query attention (``k``/``v`` with fewer heads), ``scaling``, ``softcap``
(Gemma 2's ``attn_logit_softcapping``), a value head dim smaller or larger than the query's, training
(autograd through fa_lib), and ``generate`` with a dynamic, sliding-window or static KV cache. The
attention function also accepts a 4-D mask (bool, or float with only 0 and ``-inf``/dtype-min) when it
equals one of the masks above, checked exactly, and a 2-D ``(batch, seqlen_k)`` key padding mask.

Refused with a ``ValueError`` (never computed approximately):

* attention dropout (``dropout > 0``, i.e. a model with ``attention_dropout > 0`` in training mode);
* ``output_attentions=True``: fa_lib never forms the attention probabilities;
* a mask it cannot express: a 4-D float mask with other values (additive biases, ALiBi), a custom
  ``or_mask_function``/``and_mask_function``, chunked attention (Llama 4), block-wise overlays, packed
  sequences found from ``position_ids`` (several sequences in one row), or a 4-D mask of another shape;
* ``position_bias`` (T5-style biases);
* a layer whose ``sliding_window`` contradicts the mask that the model built for it.

Usage::

    import fa_lib.integrations.transformers as fa_hf
    fa_hf.register()           # name="fa_lib"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="fa_lib")
    # or, on a loaded model: model.set_attn_implementation("fa_lib")

Tested with transformers 5.25.0 (see ``tests/library/test_integration_transformers.py``): Llama's logits, loss
and every parameter's gradient, left- and right-padded batches and greedy ``generate`` (dynamic and static
KV cache) against ``sdpa``; Mistral's sliding window against ``sdpa``; Gemma 2's softcap and alternating
sliding/full layers against ``eager``. Importing this module imports transformers if it is
installed; ``register()`` raises an ``ImportError`` if it is not. ``import fa_lib`` never imports it.
"""
from __future__ import annotations

import math
import numbers

import torch

__all__ = ["FaLibMask", "fa_lib_attention_forward", "fa_lib_mask", "register"]

try:  # optional: only register() needs it, and it says so
    from transformers import masking_utils as _mu
except ImportError as _e:  # pragma: no cover - exercised only without transformers
    _mu, _IMPORT_ERROR = None, _e
else:
    _IMPORT_ERROR = None

# transformers' own implementation names and the substrings it reads meaning into: "flash" (flash-attn
# checks and FA-only code paths), "sdpa", "flex_attention", "paged|" (continuous batching).
_RESERVED = ("eager", "sdpa", "flash", "flex_attention", "paged")


def _transformers():
    """transformers' masking_utils module and AttentionInterface, or a clear ImportError."""
    if _mu is None:
        raise ImportError(
            "fa_lib.integrations.transformers needs HuggingFace transformers (tested with 5.25.0): "
            "pip install transformers") from _IMPORT_ERROR
    from transformers import AttentionInterface

    missing = [n for n in ("AttentionMaskInterface", "and_masks", "causal_mask_function",
                           "bidirectional_mask_function", "sliding_window_overlay",
                           "sliding_window_bidirectional_overlay") if not hasattr(_mu, n)]
    if missing:
        import transformers

        raise ImportError(f"transformers {transformers.__version__} lacks masking_utils.{', '.join(missing)}: "
                          "fa_lib.integrations.transformers needs transformers 5 (tested with 5.25.0)")
    return _mu, AttentionInterface


def register(name="fa_lib"):
    """Register fa_lib with transformers as ``attn_implementation=name``: its attention function
    (``transformers.AttentionInterface``) and its mask function
    (``transformers.masking_utils.AttentionMaskInterface``), both under ``name``.

    Both are needed: with only the attention function, transformers hands every layer
    ``attention_mask=None``, and padded batches attend to their padding. Registering again (the same or
    another name) is harmless.

    Example::

        import fa_lib.integrations.transformers as fa_hf
        fa_hf.register()           # name="fa_lib"
        model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="fa_lib")

    Raises:
        ImportError: transformers is not installed, or is too old to have these interfaces.
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is empty, or contains a substring that transformers reads meaning into
            (``eager``, ``sdpa``, ``flash``, ``flex_attention``, ``paged``): such a name would turn on
            code paths that are meant for another implementation.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not name or any(r in name for r in _RESERVED) or "|" in name:
        raise ValueError(f"name must be a non-empty string without '|' and without any of {_RESERVED} "
                         f"(transformers treats such names specially), got {name!r}")
    mu, attention_interface = _transformers()
    attention_interface.register(name, fa_lib_attention_forward)
    mu.AttentionMaskInterface.register(name, fa_lib_mask)


class FaLibMask:
    """The mask that ``fa_lib_mask`` builds and ``fa_lib_attention_forward`` consumes, in fa_lib's terms.

    Attributes:
        key_padding_mask: ``(batch, num_keys)`` bool, ``True`` for a real key, or ``None`` (no padding).
        num_keys: how many of the layer's keys take part (the first ``num_keys``); the rest are seen by
            no query (a static cache's slots beyond the current token) and are dropped, so that the
            band below is aligned to the bottom-right corner of ``(seqlen_q, num_keys)``.
        causal, window: ``fa_lib.flash_attention``'s ``causal`` and ``window`` for those keys.
        kv_length: the number of keys the layer will pass (checked).
        max_delta, window_lo, window_hi: the largest ``q_position - kv_position`` in this call and the
            mask's bounds on it (``None``: unbounded), to check a layer's ``sliding_window`` against the mask.

    It has ``shape == (batch, 1, seqlen_q, kv_length)`` and ``ndim == 4`` so that transformers passes it
    on unchanged, as it does a prepared 4-D mask (e.g. when ``generate`` builds the masks in advance for a
    static cache). It is not a tensor: code that needs a dense mask must not receive it.
    """

    __slots__ = ("key_padding_mask", "num_keys", "causal", "window", "batch_size", "q_length", "kv_length",
                 "max_delta", "window_lo", "window_hi")

    def __init__(self, key_padding_mask, num_keys, causal, window, batch_size, q_length, kv_length,
                 max_delta=None, window_lo=None, window_hi=None):
        self.key_padding_mask = key_padding_mask
        self.num_keys = num_keys
        self.causal = causal
        self.window = window
        self.batch_size = batch_size
        self.q_length = q_length
        self.kv_length = kv_length
        self.max_delta = max_delta
        self.window_lo = window_lo
        self.window_hi = window_hi

    @property
    def shape(self):
        return torch.Size((self.batch_size, 1, self.q_length, self.kv_length))

    @property
    def ndim(self):
        return 4

    def dim(self):
        return 4

    def to(self, *args, **kwargs):
        """A copy with the key padding mask moved (``.to(device)``); its dtype stays bool."""
        kpm = self.key_padding_mask
        if kpm is not None:
            device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
            kpm = kpm.to(device=device) if device is not None else kpm
        return FaLibMask(kpm, self.num_keys, self.causal, self.window, self.batch_size, self.q_length,
                         self.kv_length, self.max_delta, self.window_lo, self.window_hi)

    def __repr__(self):
        kpm = None if self.key_padding_mask is None else tuple(self.key_padding_mask.shape)
        return (f"FaLibMask(shape={tuple(self.shape)}, num_keys={self.num_keys}, causal={self.causal}, "
                f"window={self.window}, key_padding_mask={kpm})")


# ---------------------------------------------------------------------------------------------------
# The mask function.
# ---------------------------------------------------------------------------------------------------
def _closure(fn):
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def _window_size(value, least, what):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least:
        raise ValueError(f"{what} must be an integer >= {least} for fa_lib, got {value!r}")
    return int(value)


def _delta_band(mask_function):
    """transformers' mask pattern as a band on ``delta = q_position - kv_position``: ``(lo, hi)`` with the
    pattern true iff ``lo <= delta <= hi`` (``None``: unbounded). Recognises the patterns that
    transformers' ``create_*_mask`` functions build: causal, bidirectional, and either with a sliding
    window. Anything else (a custom or_/and_mask_function, chunks, block overlays, packed sequences)
    raises, as fa_lib cannot be told that it computes the same thing."""
    mu = _mu
    if mask_function is mu.causal_mask_function:
        return 0, None
    if mask_function is mu.bidirectional_mask_function:
        return None, None
    and_code = mu.and_masks(mu.causal_mask_function).__code__
    if getattr(mask_function, "__code__", None) is and_code:
        parts = tuple(_closure(mask_function).get("mask_functions", ()))
        if len(parts) == 2:
            overlay, base = parts
            code = getattr(overlay, "__code__", None)
            if base is mu.causal_mask_function and code is mu.sliding_window_overlay(1).__code__:
                # kv_idx > q_idx - sliding_window  <=>  delta <= sliding_window - 1
                w = _window_size(_closure(overlay)["sliding_window"], 1, "sliding_window")
                return 0, w - 1
            if (base is mu.bidirectional_mask_function
                    and code is mu.sliding_window_bidirectional_overlay(1).__code__):
                # abs(q_idx - kv_idx) <= sliding_window
                w = _window_size(_closure(overlay)["sliding_window"], 0, "sliding_window")
                return -w, w
    name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
    raise ValueError(
        f"fa_lib cannot express this attention mask (mask_function {name}): it computes causal or "
        "bidirectional attention, optionally with a sliding window, and a key padding mask. Custom "
        "or_mask_function/and_mask_function, chunked attention, block-wise overlays and packed sequences "
        "(several sequences in one row, found from position_ids) are not supported; use "
        "attn_implementation='sdpa' or 'eager' for them")


def fa_lib_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                attention_mask=None, **kwargs):
    """transformers' mask function for ``attn_implementation="fa_lib"``: returns a ``FaLibMask``.

    transformers calls it (through ``AttentionMaskInterface``) with the same arguments as its
    ``sdpa_mask``: the query rows ``q_offset .. q_offset + q_length - 1`` and the key positions
    ``kv_offset .. kv_offset + kv_length - 1`` (absolute positions in the sequence), a
    ``mask_function(batch, head, q_position, kv_position)`` describing the pattern, and the model's 2-D
    ``attention_mask`` (``(batch, >= kv_offset + kv_length)``, ``True``/1 for a real token), indexed by
    absolute key position; a shorter one counts the positions past its end as padding, as ``sdpa_mask``
    does. Other keyword arguments (``config``, ``device``, ``dtype``, ...) are ignored.

    With ``delta = q_position - kv_position`` the pattern is a band ``lo <= delta <= hi``; in fa_lib's
    bottom-right terms, with ``s = q_offset - kv_offset`` and ``t = num_keys - q_length``, that is
    ``window = (hi + t - s, s - t - lo)``. Keys past the last query's reach are dropped (``num_keys``),
    which makes the right side >= 0; a left side below 0 (keys missing before the queries' positions)
    cannot be expressed and raises.

    Raises:
        ValueError: a pattern fa_lib cannot express (see ``fa_lib.integrations.transformers``), a 2-D
            mask with the wrong batch size.
    """
    if _mu is None:
        _transformers()  # the ImportError
    if isinstance(attention_mask, FaLibMask):
        # built in advance (generate with a static cache calls create_masks_for_generate, then the model
        # calls create_*_mask again with the result): transformers returns prepared 4-D tensors as they are
        return attention_mask
    if mask_function is None:
        mask_function = _mu.causal_mask_function
    lo, hi = _delta_band(mask_function)
    q_offset, kv_offset = int(q_offset), int(kv_offset)  # a StaticCache's q_offset is a 0-d tensor
    q_length, kv_length, batch_size = int(q_length), int(kv_length), int(batch_size)
    s = q_offset - kv_offset  # delta = i - j + s for query row i and key index j

    num_keys = kv_length
    if lo is not None:  # key j is visible to no row once j > (q_length - 1) + s - lo
        num_keys = max(0, min(kv_length, q_length + s - lo))
    t = num_keys - q_length  # fa_lib: query row i sees key j iff -right <= i - j + t <= left
    if num_keys == 0:
        causal, window = False, (-1, -1)  # no key at all: every row is 0
    else:
        right = -1 if lo is None else s - t - lo  # >= 0 by the choice of num_keys
        left = -1 if hi is None else hi + t - s
        if hi is not None and left < 0:
            raise ValueError(
                f"fa_lib cannot express this mask: with q_offset={q_offset}, q_length={q_length}, "
                f"kv_offset={kv_offset} and kv_length={kv_length}, the window's left edge falls right of the "
                "bottom-right diagonal (fa_lib aligns masks to the last key)")
        causal = right == 0
        window = (left, -1) if causal else (left, right)

    kpm = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise ValueError("attention_mask must be a 2-D (batch, kv_length) padding mask for fa_lib's mask "
                             f"function, got {getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
        am = attention_mask.to(torch.bool)
        if am.shape[0] == 1 and batch_size != 1:
            am = am.expand(batch_size, -1)
        if am.shape[0] != batch_size:
            raise ValueError(f"attention_mask has batch size {am.shape[0]}, expected {batch_size}")
        end = kv_offset + num_keys
        if am.shape[1] < end:  # as sdpa_mask: positions past the mask's end are padding
            am = torch.nn.functional.pad(am, (0, end - am.shape[1]), value=False)
        kpm = am[:, kv_offset:end]
        if not torch.compiler.is_compiling() and bool(kpm.all()):
            kpm = None  # no padding: the kernels then skip the mask
        elif kpm.stride(-1) != 1:
            kpm = kpm.contiguous()
    return FaLibMask(kpm, num_keys, causal, window, batch_size, q_length, kv_length,
                     max_delta=q_length - 1 + s, window_lo=lo, window_hi=hi)


# ---------------------------------------------------------------------------------------------------
# Masks that did not come from fa_lib_mask.
# ---------------------------------------------------------------------------------------------------
def _from_dense(mask, batch, q_length, kv_length, sliding_window):
    """A ``FaLibMask`` equal to a dense 4-D mask (bool, or float with 0 and -inf/dtype-min only), or raise.

    The key padding mask is read off as the keys some query sees; trailing keys nobody sees are dropped;
    then causal with the layer's sliding window, plain causal and no band are tried, each checked
    element by element against the mask."""
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[2] != q_length or mask.shape[3] < kv_length:
        raise ValueError(f"attention_mask: a 4-D mask must have shape (batch or 1, heads or 1, seqlen_q, >= seqlen_k) "
                         f"= ({batch}, 1, {q_length}, {kv_length}), got {tuple(mask.shape)}")
    mask = mask[..., :kv_length]
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.is_floating_point():
        visible = mask == 0
        blocked = mask <= torch.finfo(mask.dtype).min / 2  # -inf or transformers' dtype-min fill
        if not bool((visible | blocked).all()):
            raise ValueError("fa_lib cannot express a float attention_mask with values other than 0 and -inf "
                             "(or the dtype's minimum): additive biases are not supported")
    else:
        raise TypeError(f"attention_mask: a 4-D mask must be bool or floating point, got {mask.dtype}")
    if visible.shape[1] != 1:
        if not bool((visible == visible[:, :1]).all()):
            raise ValueError("fa_lib cannot express an attention_mask that differs between heads")
        visible = visible[:, :1]
    visible = visible[:, 0].expand(batch, q_length, kv_length)
    seen = visible.any(dim=1)  # (batch, kv_length): keys that some query sees
    cols = seen.any(dim=0).nonzero()
    num_keys = int(cols.max()) + 1 if cols.numel() else 0
    visible, seen = visible[..., :num_keys], seen[:, :num_keys]
    i = torch.arange(q_length, device=mask.device)[:, None]
    j = torch.arange(num_keys, device=mask.device)[None, :]
    t = num_keys - q_length
    candidates = []
    if sliding_window is not None:
        w = _window_size(sliding_window, 1, "sliding_window")
        candidates.append((True, w - 1, (j <= i + t) & (j >= i + t - (w - 1))))
    candidates += [(True, -1, j <= i + t), (False, -1, torch.ones_like(j <= i, dtype=torch.bool))]
    for causal, left, band in candidates:
        if torch.equal(band[None] & seen[:, None, :], visible):
            kpm = None if bool(seen.all()) else seen.contiguous()
            return FaLibMask(kpm, num_keys, causal, (left, -1), batch, q_length, kv_length)
    raise ValueError(
        "fa_lib cannot express this 4-D attention_mask: it is not a causal (bottom-right aligned, optionally "
        "with the layer's sliding window) or full mask combined with a key padding mask")


def _from_flags(key_padding_mask, batch, q_length, kv_length, causal, sliding_window):
    """No mask from fa_lib_mask: the layer's ``is_causal`` and ``sliding_window``, as flash-attn reads them."""
    if causal and q_length > 1 and q_length != kv_length:
        raise ValueError(
            f"attention_mask=None with is_causal and seqlen_q={q_length} != seqlen_k={kv_length}: the alignment of "
            "the causal mask is ambiguous (sdpa aligns it top-left, a KV cache needs bottom-right). Register the "
            "mask function too (fa_lib.integrations.transformers.register()) so that the model builds the mask")
    left = -1
    if sliding_window is not None:
        if not causal:
            raise ValueError("a sliding_window without a mask is only supported for causal attention")
        left = _window_size(sliding_window, 1, "sliding_window") - 1
    return FaLibMask(key_padding_mask, kv_length, bool(causal), (left, -1), batch, q_length, kv_length)


# ---------------------------------------------------------------------------------------------------
# The attention function.
# ---------------------------------------------------------------------------------------------------
_REFUSED_KWARGS = {
    "position_bias": "position biases (T5-style) are additive biases, which fa_lib does not take",
    "cu_seq_lens_q": "packed sequences through cu_seq_lens are not supported by this integration",
    "cu_seq_lens_k": "packed sequences through cu_seq_lens are not supported by this integration",
}


def fa_lib_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                             sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """transformers' attention function for ``attn_implementation="fa_lib"``: ``fa_lib.flash_attention``.

    Args (as transformers passes them to every attention function):
        module: the attention layer; its ``is_causal`` is read only when no mask was built.
        query: ``(batch, heads_q, seqlen_q, head_dim)``.
        key, value: ``(batch, heads_kv, seqlen_k, head_dim)`` (``heads_q`` a multiple of ``heads_kv``: GQA);
            the value head dim may differ (its output is cut or padded back to it).
        attention_mask: a ``FaLibMask`` from ``fa_lib_mask`` (what a registered model passes); ``None``
            (the layer's ``is_causal`` and ``sliding_window`` then decide; causal needs
            ``seqlen_q == seqlen_k`` or ``seqlen_q == 1``); a ``(batch, seqlen_k)`` key padding mask
            (bool or 0/1); or a 4-D bool or 0/-inf float mask that equals one fa_lib can express.
        dropout: must be 0 (attention dropout is not implemented).
        scaling: the softmax scale (default ``1/sqrt(head_dim)``).
        sliding_window: the layer's window (transformers' meaning: ``q - kv < sliding_window``); checked
            against the mask, or used when no mask was built.
        softcap: Gemma 2's ``attn_logit_softcapping``: ``softcap * tanh(scores / softcap)``.
        is_causal: overrides ``module.is_causal`` when no mask was built.
        kwargs: ``s_aux`` (gpt-oss's attention sinks, one logit per query head; ``sinks`` is read the same way)
            goes to ``flash_attention(sinks=)``; ``output_attentions`` must be false; ``position_bias`` and
            ``cu_seq_lens_q/k`` must be None; the rest (``position_ids``, ``use_cache``, ...) are ignored.

    Returns:
        ``(attn_output, None)``: the output as ``(batch, seqlen_q, heads_q, head_dim_v)``, and no weights.

    Raises:
        ValueError: dropout > 0, ``output_attentions``, a refused keyword, a mask fa_lib cannot express,
            a mask whose sizes do not match the tensors, a ``sliding_window`` that contradicts the mask;
            and ``fa_lib.flash_attention``'s own errors on the tensors.
    """
    from .. import ops

    if kwargs.get("output_attentions", False):
        raise ValueError("output_attentions=True is not supported by attn_implementation='fa_lib': fa_lib never "
                         "forms the attention probabilities; use attn_implementation='eager' to get them")
    if not isinstance(dropout, numbers.Real) or dropout != 0:
        raise ValueError(f"attention dropout ({dropout!r}) is not supported by fa_lib: set the model's "
                         "attention_dropout to 0.0, or run it in eval mode")
    for name, why in _REFUSED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: {why}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, heads, seqlen, head_dim), got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    batch, _, q_length, head_dim = query.shape
    kv_length = key.shape[2]
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(f"value must match key in (batch, heads, seqlen): {tuple(key.shape)} vs {tuple(value.shape)}")

    mask = attention_mask
    if isinstance(mask, FaLibMask):
        if (mask.batch_size, mask.q_length, mask.kv_length) != (batch, q_length, kv_length):
            raise ValueError(f"attention_mask was built for (batch, seqlen_q, seqlen_k) = ({mask.batch_size}, "
                             f"{mask.q_length}, {mask.kv_length}), but the layer has "
                             f"({batch}, {q_length}, {kv_length})")
        if sliding_window is not None and mask.window_lo == 0 and mask.max_delta is not None:
            layer_hi = _window_size(sliding_window, 1, "sliding_window") - 1

            def bound(hi):  # a bound at or beyond the largest delta of this call bounds nothing
                return None if hi is None or hi >= mask.max_delta else hi

            if bound(layer_hi) != bound(mask.window_hi):
                raise ValueError(f"the layer's sliding_window={sliding_window} contradicts its mask (window bound "
                                 f"{mask.window_hi} on q - kv): the model built the mask for another kind of layer")
    else:
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        if mask is None:
            mask = _from_flags(None, batch, q_length, kv_length, is_causal, sliding_window)
        elif isinstance(mask, torch.Tensor) and mask.dim() == 2:
            if tuple(mask.shape) != (batch, kv_length):
                raise ValueError(f"attention_mask: a 2-D mask must be a (batch, seqlen_k) = ({batch}, {kv_length}) key "
                                 f"padding mask, got {tuple(mask.shape)}")
            kpm = mask.to(torch.bool)
            mask = _from_flags(None if bool(kpm.all()) else kpm.contiguous(), batch, q_length, kv_length,
                               is_causal, sliding_window)
        elif isinstance(mask, torch.Tensor) and mask.dim() == 4:
            mask = _from_dense(mask, batch, q_length, kv_length, sliding_window)
        else:
            raise ValueError("attention_mask must be the mask built by fa_lib's mask function, None, a "
                             f"(batch, seqlen_k) key padding mask or a 4-D mask, got {type(mask).__name__} "
                             f"{tuple(getattr(mask, 'shape', ()))}")

    n = mask.num_keys
    if n != kv_length:  # keys no query sees (a static cache's unwritten slots)
        key, value = key[:, :, :n], value[:, :, :n]
    kpm = mask.key_padding_mask
    if kpm is not None and kpm.device != key.device:
        kpm = kpm.to(key.device)

    # a value head dim unlike the query's (e.g. MLA): zero columns change no score and no output column
    v_dim = value.shape[-1]
    softmax_scale = (1.0 / math.sqrt(head_dim)) if scaling is None else float(scaling)
    if v_dim < head_dim:
        value = torch.nn.functional.pad(value, (0, head_dim - v_dim))
    elif v_dim > head_dim:
        query = torch.nn.functional.pad(query, (0, v_dim - head_dim))
        key = torch.nn.functional.pad(key, (0, v_dim - head_dim))

    out = ops.flash_attention(query, key, value, causal=mask.causal, softmax_scale=softmax_scale,
                              window=mask.window, softcap=0.0 if softcap is None else float(softcap),
                              key_padding_mask=kpm, sinks=sinks)
    if v_dim < head_dim:
        out = out[..., :v_dim]
    return out.transpose(1, 2), None
