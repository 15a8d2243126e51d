"""fa_lib.interface: flash-attn 2's Python API (flash_attn_interface.py) on fa_lib's kernels.

Under the interpreter in CI, tiny shapes: the wrappers' return values and layouts, the packed variants and their
gradients, the forward's determinism whatever `deterministic` says, errors named in the caller's layout, and the
rules where flash-attn differs from fa_lib's native API (window sides >= seqlen_k, trailing rows after
cu_seqlens[-1], +inf LSE of an empty row, the paged forward on inputs that require grad).
"""
import inspect

import numpy as np
import pytest
import torch

import fa_lib
from fa_lib import interface, kernels, ops, plan
from fa_lib.testing import poisoned_outputs
from kernel_cases import F16, F32

DEVICE = "cpu" if kernels.INTERPRET else "cuda"
INF = float("inf")


def _rand(*shape, seed, dtype=F32, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)
    return t.requires_grad_() if grad else t


def _cu(lengths):
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device=DEVICE)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _pos_inf(lse):
    """fa_lib's native LSE as flash-attn gives it: +inf where a row sees no key."""
    return torch.where(torch.isneginf(lse), INF, lse.detach())


# ---------------------------------------------------------------------------------------------------
# The API: flash-attn 2's names, argument order and defaults, exported from fa_lib.
# ---------------------------------------------------------------------------------------------------
_COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
           ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
_SIGNATURES = {  # flash_attn_interface.py, flash-attn 2.6-2.7: (positional arguments, then those with defaults)
    "flash_attn_func": (["q", "k", "v"], _COMMON),
    "flash_attn_qkvpacked_func": (["qkv"], _COMMON),
    "flash_attn_kvpacked_func": (["q", "kv"], _COMMON),
    "flash_attn_varlen_func": (["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"],
                               _COMMON + [("block_table", None)]),
    "flash_attn_varlen_qkvpacked_func": (["qkv", "cu_seqlens", "max_seqlen"], _COMMON),
    "flash_attn_varlen_kvpacked_func": (["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"],
                                        _COMMON),
    "flash_attn_with_kvcache": (["q", "k_cache", "v_cache"], [
        ("k", None), ("v", None), ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
        ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None), ("softmax_scale", None),
        ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("rotary_interleaved", True),
        ("alibi_slopes", None), ("num_splits", 0), ("return_softmax_lse", False)]),
}


@pytest.mark.parametrize("name", sorted(_SIGNATURES))
def test_the_wrappers_have_flash_attns_signatures_and_are_exported(name):
    positional, defaults = _SIGNATURES[name]
    params = list(inspect.signature(getattr(interface, name)).parameters.values())
    # flash-attn's parameters in its order, then fa_lib's one addition, attention sinks, last
    assert (params[-1].name, params[-1].default) == ("sinks", None)
    params = params[:-1]
    assert [p.name for p in params] == positional + [n for n, _ in defaults]
    assert all(p.default is inspect.Parameter.empty for p in params[:len(positional)])
    assert [(p.name, p.default) for p in params[len(positional):]] == defaults
    assert getattr(fa_lib, name) is getattr(interface, name) and name in fa_lib.__all__ and name in interface.__all__
    assert not hasattr(ops, name) and not hasattr(fa_lib.decode, name)  # one home: fa_lib.interface


# ---------------------------------------------------------------------------------------------------
# 1. return_attn_probs: (out, softmax_lse, None), the LSE in flash-attn's layout, not differentiable, +inf if empty.
# ---------------------------------------------------------------------------------------------------
def test_flash_attn_func_return_attn_probs_gives_out_lse_and_none():
    q, k, v = _rand(2, 6, 4, 16, seed=1, grad=True), _rand(2, 4, 2, 16, seed=2, grad=True), \
        _rand(2, 4, 2, 16, seed=3, grad=True)
    out, lse, s_dmask = fa_lib.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert s_dmask is None and lse.shape == (2, 4, 6) and lse.dtype == torch.float32
    want_o, want_lse = fa_lib.flash_attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, return_lse=True)
    assert torch.equal(out, want_o.transpose(1, 2)) and torch.equal(out, fa_lib.flash_attn_func(q, k, v, causal=True))
    # 6 queries, 4 keys, bottom-right causal: queries 0 and 1 see no key: output 0, LSE +inf (fa_lib native: -inf)
    assert torch.isposinf(lse[:, :, :2]).all() and torch.isneginf(want_lse[:, :, :2]).all()
    assert torch.equal(lse, _pos_inf(want_lse)) and not (out[:, :2] != 0).any()
    # flash-attn's softmax_lse is not differentiable (its backward drops that gradient): returned detached
    assert not lse.requires_grad and lse.grad_fn is None
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_flash_attn_varlen_func_return_attn_probs_gives_the_lse_per_token():
    q, k, v = _rand(9, 4, 16, seed=4), _rand(8, 2, 16, seed=5), _rand(8, 2, 16, seed=6)
    cu_q, cu_k = _cu([3, 0, 6]), _cu([1, 3, 4])  # sequence 1 has no query; sequence 2: 6 queries over 4 keys
    out, lse, s_dmask = fa_lib.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 4, causal=True, return_attn_probs=True)
    want_o, want_lse = fa_lib.flash_attention_varlen(q, k, v, cu_q, cu_k, 6, 4, causal=True, return_lse=True)
    assert s_dmask is None and lse.shape == (4, 9) and torch.equal(out, want_o)
    assert torch.equal(lse, _pos_inf(want_lse)) and torch.isposinf(lse[:, 3:5]).all()  # rows that see no key
    assert not lse.requires_grad


# ---------------------------------------------------------------------------------------------------
# 2. The packed variants: the unpacked wrappers' bits, the gradient into the packed tensor.
# ---------------------------------------------------------------------------------------------------
def _grads_of(out, do, *leaves):
    return torch.autograd.grad(out, leaves, do)


def test_flash_attn_qkvpacked_func():
    qkv = _rand(2, 9, 3, 2, 16, seed=7, grad=True)
    q, k, v = _leaves(*qkv.detach().unbind(2))
    do = _rand(2, 9, 2, 16, seed=8)
    out, lse, none = fa_lib.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(4, -1), return_attn_probs=True)
    want, want_lse, _ = fa_lib.flash_attn_func(q, k, v, causal=True, window_size=(4, -1), return_attn_probs=True)
    assert none is None and torch.equal(out, want) and torch.equal(lse, want_lse)
    assert out.is_contiguous() and out.view(2, 9, -1).shape == (2, 9, 32)  # as flash-attn's empty_like(q slice)
    (dqkv,) = _grads_of(out, do, qkv)
    assert torch.equal(dqkv, torch.stack(_grads_of(want, do, q, k, v), 2))


def test_flash_attn_kvpacked_func_with_gqa():
    q, kv = _rand(2, 6, 4, 16, seed=9, grad=True), _rand(2, 11, 2, 2, 16, seed=10, grad=True)
    k, v = _leaves(*kv.detach().unbind(2))
    q2 = _leaves(q)[0]
    do = _rand(2, 6, 4, 16, seed=11)
    out = fa_lib.flash_attn_kvpacked_func(q, kv, softmax_scale=0.3, softcap=5.0)
    want = fa_lib.flash_attn_func(q2, k, v, softmax_scale=0.3, softcap=5.0)
    assert torch.equal(out, want) and out.is_contiguous()
    dq, dkv = _grads_of(out, do, q, kv)
    dq2, dk, dv = _grads_of(want, do, q2, k, v)
    assert torch.equal(dq, dq2) and torch.equal(dkv, torch.stack((dk, dv), 2))


def test_flash_attn_varlen_qkvpacked_func():
    qkv = _rand(11, 3, 2, 16, seed=12, grad=True)
    q, k, v = _leaves(*qkv.detach().unbind(1))
    cu = _cu([4, 7])
    do = _rand(11, 2, 16, seed=13)
    out, lse, none = fa_lib.flash_attn_varlen_qkvpacked_func(qkv, cu, 7, causal=True, return_attn_probs=True)
    want, want_lse, _ = fa_lib.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, return_attn_probs=True)
    assert none is None and lse.shape == (2, 11) and torch.equal(out, want) and torch.equal(lse, want_lse)
    (dqkv,) = _grads_of(out, do, qkv)
    assert torch.equal(dqkv, torch.stack(_grads_of(want, do, q, k, v), 1))


def test_flash_attn_varlen_kvpacked_func():
    q, kv = _rand(9, 4, 16, seed=14, grad=True), _rand(12, 2, 2, 16, seed=15, grad=True)
    k, v = _leaves(*kv.detach().unbind(1))
    q2 = _leaves(q)[0]
    cu_q, cu_k = _cu([3, 6]), _cu([5, 7])
    do = _rand(9, 4, 16, seed=16)
    out = fa_lib.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 6, 7, causal=True)
    want = fa_lib.flash_attn_varlen_func(q2, k, v, cu_q, cu_k, 6, 7, causal=True)
    assert torch.equal(out, want)
    dq, dkv = _grads_of(out, do, q, kv)
    dq2, dk, dv = _grads_of(want, do, q2, k, v)
    assert torch.equal(dq, dq2) and torch.equal(dkv, torch.stack((dk, dv), 1))


# ---------------------------------------------------------------------------------------------------
# 3. flash_attn_with_kvcache: a contiguous (B, N, H, D) output; its LSE (B, H, N_q), +inf where empty.
# ---------------------------------------------------------------------------------------------------
def test_flash_attn_with_kvcache_returns_a_contiguous_output_and_flash_attns_lse():
    q = _rand(2, 3, 4, 16, seed=17)  # (B, N_q, H_q, d)
    k_cache, v_cache = _rand(2, 8, 2, 16, seed=18), _rand(2, 8, 2, 16, seed=19)
    lens = torch.tensor([1, 8], dtype=torch.int32, device=DEVICE)
    out, lse = fa_lib.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                              return_softmax_lse=True)
    assert out.shape == (2, 3, 4, 16) and out.is_contiguous() and out.view(2, 3, 64).shape == (2, 3, 64)
    want, want_lse = fa_lib.flash_attention_with_kvcache(*(t.transpose(1, 2) for t in (q, k_cache, v_cache)),
                                                         cache_seqlens=lens, causal=True, return_lse=True)
    assert torch.equal(out, want.transpose(1, 2)) and lse.shape == (2, 4, 3)
    # sequence 0: 3 queries over 1 key, causal: queries 0 and 1 see no key
    assert torch.isposinf(lse[0, :, :2]).all() and torch.equal(lse, _pos_inf(want_lse))


# ---------------------------------------------------------------------------------------------------
# 4. deterministic is the backward's: the wrappers' forward always takes the fixed blocks.
# ---------------------------------------------------------------------------------------------------
def _record_launches(monkeypatch, kernel_opts):
    """The `deterministic` of every `ops._launch` (kernel name -> flags), recorded plans off."""
    seen = {}
    real = ops._launch

    def spy(kernel, tuned, name, grid, args, meta, q, n_q, n_k, deterministic):
        seen.setdefault(name, []).append(deterministic)
        return real(kernel, tuned, name, grid, args, meta, q, n_q, n_k, True)  # (no tuning runs in CI)

    monkeypatch.setattr(ops, "_launch", spy)
    kernel_opts(plans=False)
    return seen


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_wrappers_forward_is_deterministic_whatever_the_flag(monkeypatch, kernel_opts, deterministic):
    seen = _record_launches(monkeypatch, kernel_opts)
    q, k, v = (_rand(1, 5, 2, 16, seed=s, grad=True) for s in (20, 21, 22))
    fa_lib.flash_attn_func(q, k, v, causal=True, deterministic=deterministic).sum().backward()
    assert seen == {"fwd": [True], "dkdv": [deterministic], "dq": [deterministic]}
    seen.clear()
    with torch.no_grad():  # the forward alone (no autograd node)
        fa_lib.flash_attn_func(q, k, v, deterministic=deterministic)
    assert seen == {"fwd": [True]}
    seen.clear()
    x = _rand(7, 2, 16, seed=23, grad=True)
    fa_lib.flash_attn_varlen_func(x, x, x, _cu([3, 4]), _cu([3, 4]), 4, 4, deterministic=deterministic).sum().backward()
    assert seen == {"fwd": [True], "dkdv": [deterministic], "dq": [deterministic]}


def test_the_native_deterministic_flag_still_covers_every_launch(monkeypatch, kernel_opts):
    """fa_lib.flash_attention documents `deterministic` for every launch (False autotunes the forward too): kept."""
    seen = _record_launches(monkeypatch, kernel_opts)
    q, k, v = (_rand(1, 2, 5, 16, seed=s, grad=True) for s in (24, 25, 26))
    fa_lib.flash_attention(q, k, v, deterministic=False).sum().backward()
    assert seen == {"fwd": [False], "dkdv": [False], "dq": [False]}


def test_flash_attn_func_under_torch_compile_keeps_the_forward_deterministic(monkeypatch, kernel_opts):
    seen = _record_launches(monkeypatch, kernel_opts)
    q, k, v = (_rand(1, 6, 2, 16, seed=s) for s in (27, 28, 29))
    do = _rand(1, 6, 2, 16, seed=30)
    eager_leaves, compiled_leaves = _leaves(q, k, v), _leaves(q, k, v)

    def step(q, k, v):
        out, lse, _ = fa_lib.flash_attn_func(q, k, v, causal=True, deterministic=False, return_attn_probs=True)
        return out, lse

    want = step(*eager_leaves)
    want_grads = _grads_of(want[0], do, *eager_leaves)
    torch._dynamo.reset()
    seen.clear()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled_leaves)
    got_grads = _grads_of(got[0], do, *compiled_leaves)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
    assert set(seen["fwd"]) == {True} and set(seen["dkdv"]) == {False}


# ---------------------------------------------------------------------------------------------------
# 5. Errors name the caller's arguments, in the caller's layout.
# ---------------------------------------------------------------------------------------------------
def _dense_case(**change):
    args = dict(q=_rand(1, 4, 2, 16, seed=31), k=_rand(1, 5, 1, 16, seed=32), v=_rand(1, 5, 1, 16, seed=33))
    args.update(change)
    return args


@pytest.mark.parametrize("change, error, match", [
    (dict(q=np.zeros((1, 4, 2, 16), np.float32)), TypeError, "q must be a torch.Tensor, got numpy.ndarray"),
    (dict(k=torch.zeros(5, 1, 16)), ValueError, r"k must be a 4-D tensor \(batch, seqlen, heads, head_dim\)"),
    (dict(v=torch.zeros(1, 6, 1, 16)), ValueError,
     r"v must have the shape of k, \(batch, seqlen_k, heads_kv, head_dim\) = \(1, 5, 1, 16\), got \(1, 6, 1, 16\)"),
    (dict(q=torch.zeros(1, 4, 2, 8)), ValueError, r"q \(1, 4, 2, 8\) and k \(1, 5, 1, 16\)"),
    (dict(k=torch.zeros(1, 5, 3, 16), v=torch.zeros(1, 5, 3, 16)), ValueError,
     r"query heads \(2, q.shape\[2\]\) must be a multiple of the number of key/value heads \(3, k.shape\[2\]\)"),
    (dict(q=torch.zeros(1, 4, 1, 300), k=torch.zeros(1, 5, 1, 300), v=torch.zeros(1, 5, 1, 300)), ValueError,
     r"head_dim \(q.shape\[3\]\) must be between 1 and 256, got 300"),
    (dict(k=torch.zeros(1, 5, 1, 16, dtype=torch.float64)), TypeError, "k has dtype torch.float64"),
    (dict(v=torch.zeros(1, 5, 1, 16, dtype=F16)), TypeError, "v has dtype torch.float16 but q has dtype torch.float32"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size sides must be >= 0, or -1 for unbounded, got \(-2, 0\)"),
    (dict(window_size=(1.5, 0)), TypeError, "window_size must be a pair of ints"),
    (dict(window_size=torch.tensor([1.0, 0.0])), TypeError, "window_size must be a pair of ints"),
    (dict(window_size=torch.tensor([1, 2, 3])), TypeError, "window_size must be a pair of ints"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool"),
    (dict(return_attn_probs=None), TypeError, "return_attn_probs must be a bool"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale must be a positive"),
    (dict(dropout_p=0.1), ValueError, "dropout_p=0.1 is not supported"),
])
def test_flash_attn_func_names_the_callers_argument(change, error, match):
    with pytest.raises(error, match=match):
        fa_lib.flash_attn_func(**_dense_case(**change))


@pytest.mark.parametrize("call, error, match", [
    (lambda: fa_lib.flash_attn_qkvpacked_func(np.zeros((1, 4, 3, 2, 16))), TypeError,
     "qkv must be a torch.Tensor, got numpy.ndarray"),
    (lambda: fa_lib.flash_attn_qkvpacked_func(torch.zeros(1, 4, 3, 16)), ValueError,
     r"qkv must be a 5-D tensor \(batch, seqlen, 3, heads, head_dim\)"),
    (lambda: fa_lib.flash_attn_qkvpacked_func(torch.zeros(1, 4, 2, 2, 16)), ValueError,
     r"qkv must have q, k and v stacked on dim 2, \(batch, seqlen, 3, heads, head_dim\), got shape \(1, 4, 2, 2, 16\)"),
    (lambda: fa_lib.flash_attn_qkvpacked_func(torch.zeros(1, 4, 3, 2, 16, dtype=torch.int32)), TypeError,
     "qkv has dtype torch.int32"),
    (lambda: fa_lib.flash_attn_kvpacked_func(torch.zeros(1, 4, 2, 16), torch.zeros(1, 5, 3, 1, 16)), ValueError,
     r"kv must have k and v stacked on dim 2, \(batch, seqlen_k, 2, heads_kv, head_dim\)"),
    (lambda: fa_lib.flash_attn_kvpacked_func(torch.zeros(1, 4, 2, 16), torch.zeros(1, 5, 2, 1, 16, dtype=F16)),
     TypeError, "kv has dtype torch.float16 but q has dtype torch.float32"),
    (lambda: fa_lib.flash_attn_kvpacked_func(torch.zeros(1, 4, 2, 16), torch.zeros(1, 5, 2, 3, 16)), ValueError,
     r"query heads \(2, q.shape\[2\]\) must be a multiple of the number of key/value heads \(3, kv.shape\[3\]\)"),
    (lambda: fa_lib.flash_attn_kvpacked_func(torch.zeros(1, 4, 2, 16), [1, 2]), TypeError,
     "kv must be a torch.Tensor, got list"),
])
def test_the_dense_packed_wrappers_name_the_callers_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _varlen_case(**change):
    args = dict(q=_rand(9, 2, 16, seed=34), k=_rand(8, 1, 16, seed=35), v=_rand(8, 1, 16, seed=36),
                cu_seqlens_q=_cu([4, 5]), cu_seqlens_k=_cu([3, 5]), max_seqlen_q=5, max_seqlen_k=5)
    args.update(change)
    return args


@pytest.mark.parametrize("change, error, match", [
    (dict(q=np.zeros((9, 2, 16))), TypeError, "q must be a torch.Tensor, got numpy.ndarray"),
    (dict(k=torch.zeros(1, 8, 1, 16)), ValueError, r"k must be a 3-D tensor \(total_k, heads_kv, head_dim\)"),
    (dict(v=torch.zeros(7, 1, 16)), ValueError,
     r"v must have the shape of k, \(total_k, heads_kv, head_dim\) = \(8, 1, 16\), got \(7, 1, 16\)"),
    (dict(k=torch.zeros(8, 3, 16), v=torch.zeros(8, 3, 16)), ValueError,
     r"query heads \(2, q.shape\[1\]\) must be a multiple of the number of key/value heads \(3, k.shape\[1\]\)"),
    (dict(q=torch.zeros(9, 2, 300), k=torch.zeros(8, 1, 300), v=torch.zeros(8, 1, 300)), ValueError,
     r"head_dim \(q.shape\[2\]\) must be between"),
    (dict(cu_seqlens_q=_cu([4, 6])), ValueError, r"cu_seqlens_q\[-1\] = 10 is more than the 9 packed tokens of "
                                                 r"q.shape\[0\]"),
    (dict(cu_seqlens_k=_cu([3, 5]).long()), TypeError, "cu_seqlens_k must have dtype torch.int32"),
    (dict(max_seqlen_k=2), ValueError, r"max_seqlen_k = 2 is smaller than the longest sequence in cu_seqlens_k"),
    (dict(window_size="full"), TypeError, "window_size must be a pair of ints"),
    (dict(window_size=[0, -5]), ValueError, "window_size sides must be >= 0, or -1"),
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int32)), ValueError,
     r"k must be a 4-D tensor \(num_blocks, page_block_size, heads_kv, head_dim\) in flash-attn's layout"),
])
def test_flash_attn_varlen_func_names_the_callers_argument(change, error, match):
    with pytest.raises(error, match=match):
        fa_lib.flash_attn_varlen_func(**_varlen_case(**change))


@pytest.mark.parametrize("call, error, match", [
    (lambda: fa_lib.flash_attn_varlen_qkvpacked_func(torch.zeros(9, 2, 2, 16), _cu([4, 5]), 5), ValueError,
     r"qkv must have q, k and v stacked on dim 1, \(total, 3, heads, head_dim\), got shape \(9, 2, 2, 16\)"),
    (lambda: fa_lib.flash_attn_varlen_qkvpacked_func(torch.zeros(9, 3, 2, 16), _cu([4, 5]).long(), 5), TypeError,
     "cu_seqlens must have dtype torch.int32"),
    (lambda: fa_lib.flash_attn_varlen_qkvpacked_func(torch.zeros(9, 3, 2, 16), _cu([4, 5]), 3), ValueError,
     r"max_seqlen = 3 is smaller than the longest sequence in cu_seqlens \(5\)"),
    (lambda: fa_lib.flash_attn_varlen_qkvpacked_func(torch.zeros(9, 3, 2, 16), _cu([4, 6]), 6), ValueError,
     r"cu_seqlens\[-1\] = 10 is more than the 9 packed tokens of qkv.shape\[0\]"),
    (lambda: fa_lib.flash_attn_varlen_kvpacked_func(torch.zeros(9, 2, 16), torch.zeros(8, 2, 1, 8), _cu([4, 5]),
                                                    _cu([3, 5]), 5, 5), ValueError,
     r"q and kv must share head_dim \(q.shape\[2\], kv.shape\[3\]\), got q \(9, 2, 16\) and kv \(8, 2, 1, 8\)"),
    (lambda: fa_lib.flash_attn_varlen_kvpacked_func(torch.zeros(9, 2, 16), torch.zeros(8, 2, 1, 16), _cu([4, 5]),
                                                    _cu([3, 6]), 5, 6), ValueError,
     r"cu_seqlens_k\[-1\] = 9 is more than the 8 packed tokens of kv.shape\[0\]"),
])
def test_the_varlen_packed_wrappers_name_the_callers_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _kvcache_case(paged=False, **change):
    """q (2, 1, 4, 16); a cache (2, 8, 2, 16), or a pool of 5 pages of 4 keys with a (2, 2) block table."""
    args = dict(q=_rand(2, 1, 4, 16, seed=37), k_cache=_rand(2, 8, 2, 16, seed=38),
                v_cache=_rand(2, 8, 2, 16, seed=39), cache_seqlens=torch.tensor([3, 8], dtype=torch.int32))
    if paged:
        args.update(k_cache=_rand(5, 4, 2, 16, seed=40), v_cache=_rand(5, 4, 2, 16, seed=41),
                    block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    args.update(change)
    return {n: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for n, t in args.items()}


@pytest.mark.parametrize("paged, change, error, match", [
    (False, dict(q=np.zeros((2, 1, 4, 16), np.float32)), TypeError, "q must be a torch.Tensor, got numpy.ndarray"),
    (False, dict(k_cache=np.zeros((2, 8, 2, 16), np.float32)), TypeError,
     "k_cache must be a torch.Tensor, got numpy.ndarray"),
    (False, dict(v_cache=torch.zeros(2, 8, 1, 16)), ValueError,
     r"v_cache must have the shape of k_cache, \(batch, seqlen_cache, heads_kv, head_dim\) = \(2, 8, 2, 16\), got "
     r"\(2, 8, 1, 16\)"),
    (False, dict(k_cache=torch.zeros(3, 8, 2, 16), v_cache=torch.zeros(3, 8, 2, 16)), ValueError,
     r"k_cache must be \(batch, seqlen_cache, heads_kv, head_dim\) with q's batch 2 and head_dim 16, got shape "
     r"\(3, 8, 2, 16\)"),
    (False, dict(k_cache=torch.zeros(2, 8, 3, 16), v_cache=torch.zeros(2, 8, 3, 16)), ValueError,
     r"query heads \(4, q.shape\[2\]\) must be a multiple of the number of key/value heads \(3, k_cache.shape\[2\]\)"),
    (False, dict(k_cache=torch.zeros(2, 8, 2, 16, dtype=F16)), TypeError,
     "k_cache has dtype torch.float16 but q has dtype torch.float32"),
    (False, dict(window_size=(-2, 0)), ValueError, r"window_size sides must be >= 0, or -1"),
    (False, dict(cache_seqlens=torch.tensor([3, 9], dtype=torch.int32)), ValueError,
     r"cache_seqlens\[1\] = 9: every cache_seqlens\[b\] \+ n_new \(0\) must lie in \[0, N_max = k_cache.shape\[1\] = "
     r"8\]"),
    (False, dict(k=torch.zeros(2, 9, 2, 16), v=torch.zeros(2, 9, 2, 16)), ValueError,
     r"k and v append 9 keys, more than the cache holds \(k_cache.shape\[1\] = 8\)"),
    (False, dict(k=torch.zeros(2, 1, 1, 16), v=torch.zeros(2, 1, 1, 16)), ValueError,
     r"k and v must both have shape \(batch, seqlen_new, heads_kv, head_dim\) = \(2, seqlen_new, 2, 16\), got "
     r"\(2, 1, 1, 16\)"),
    (False, dict(cache_seqlens=2.0), TypeError, "cache_seqlens must be an int, a \\(batch,\\) torch.int32 tensor"),
    (False, dict(return_softmax_lse=1), TypeError, "return_softmax_lse must be a bool"),
    (False, dict(q=torch.zeros(2, 1, 4, 16, requires_grad=True)), ValueError,
     r"flash_attn_with_kvcache is forward-only \(no autograd\)"),
    (True, dict(cache_seqlens=torch.tensor([3, 9], dtype=torch.int32)), ValueError,
     r"cache_seqlens\[1\] = 9: .* \[0, N_max = block_table.shape\[1\] \* k_cache.shape\[1\] = 8\]"),
    (True, dict(k_cache=torch.zeros(5, 4, 2, 8), v_cache=torch.zeros(5, 4, 2, 8)), ValueError,
     r"with a block_table, k_cache must be a pool of pages \(num_blocks >= 1, page_block_size >= 1, heads_kv, "
     r"head_dim = 16\), got shape \(5, 4, 2, 8\)"),
    (True, dict(block_table=torch.tensor([[9, 1], [2, 3]], dtype=torch.int32)), ValueError,
     r"block_table\[0\] must hold page indices in \[0, num_pages = k_cache.shape\[0\] = 5\)"),
    (True, dict(k=torch.zeros(2, 9, 2, 16), v=torch.zeros(2, 9, 2, 16)), ValueError,
     r"more than the cache holds \(block_table.shape\[1\] \* k_cache.shape\[1\] = 8\)"),
])
def test_flash_attn_with_kvcache_names_the_callers_argument(paged, change, error, match):
    with pytest.raises(error, match=match):
        fa_lib.flash_attn_with_kvcache(**_kvcache_case(paged, **change))


# ---------------------------------------------------------------------------------------------------
# 6a. window_size as tensors, as flash-attn's tests pass it.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [torch.tensor([3, 0]), [torch.tensor(3), torch.tensor(0)], (np.int64(3), 0),
                                    torch.tensor([3, 0], dtype=torch.int32)])
def test_window_size_may_be_tensors(window):
    q, k, v = _rand(1, 9, 2, 16, seed=42), _rand(1, 9, 1, 16, seed=43), _rand(1, 9, 1, 16, seed=44)
    assert torch.equal(fa_lib.flash_attn_func(q, k, v, window_size=window),
                       fa_lib.flash_attn_func(q, k, v, window_size=(3, 0)))
    x = q[0]
    args = (x, x, x, _cu([4, 5]), _cu([4, 5]), 5, 5)
    assert torch.equal(fa_lib.flash_attn_varlen_func(*args, window_size=window),
                       fa_lib.flash_attn_varlen_func(*args, window_size=(3, 0)))
    case = _kvcache_case()
    assert torch.equal(fa_lib.flash_attn_with_kvcache(**case, window_size=window),
                       fa_lib.flash_attn_with_kvcache(**case, window_size=(3, 0)))


# ---------------------------------------------------------------------------------------------------
# 6b. A window side of at least seqlen_k is unbounded (flash-attn); the native API keeps the band.
# ---------------------------------------------------------------------------------------------------
def test_a_right_window_side_at_least_seqlen_k_is_unbounded():
    q, k, v = _rand(1, 10, 1, 16, seed=45), _rand(1, 2, 1, 16, seed=46), _rand(1, 2, 1, 16, seed=47)
    got, lse, _ = fa_lib.flash_attn_func(q, k, v, window_size=(-1, 2), return_attn_probs=True)
    full = fa_lib.flash_attn_func(q, k, v)
    assert torch.equal(got, full) and torch.isfinite(lse).all()  # rows 0-5 attend too
    native = fa_lib.flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window=(-1, 2))
    # (row 6 sees key 0 only; rows 7-9 both)
    assert not native[:, :, :6].any() and torch.equal(native[:, :, 7:], full.transpose(1, 2)[:, :, 7:])
    # right = 1 < seqlen_k: the band stands in both (rows 0-6 see no key)
    band = fa_lib.flash_attn_func(q, k, v, window_size=(-1, 1))
    assert not band[:, :7].any() and band[:, 7:].any()
    # the left side: a side >= seqlen_k is unbounded too (the same mask: it reaches past key 0 from every row)
    assert torch.equal(fa_lib.flash_attn_func(q, k, v, window_size=(2, 0)),
                       fa_lib.flash_attn_func(q, k, v, window_size=(-1, 0)))
    assert torch.equal(fa_lib.flash_attn_func(q, k, v, window_size=(5, 7)), full)


def test_varlen_and_kvcache_take_max_seqlen_k_and_the_cache_capacity_as_seqlen_k():
    q, k = _rand(10, 1, 16, seed=48), _rand(2, 1, 16, seed=49)
    cu_q, cu_k = _cu([10]), _cu([2])
    unbounded = fa_lib.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 10, 2, window_size=(-1, 2))
    assert torch.equal(unbounded, fa_lib.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 10, 2))
    # flash-attn compares with max_seqlen_k, not each sequence's length: with max_seqlen_k = 3 the band stands
    banded = fa_lib.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 10, 3, window_size=(-1, 2))
    assert not banded[:6].any() and torch.equal(banded[7:], unbounded[7:])
    # kvcache: seqlen_k is the cache's capacity (k_cache.shape[1]): 2 valid keys of 4, 10 queries
    qc, cache = q.view(1, 10, 1, 16), torch.cat((k, torch.zeros_like(k))).view(1, 4, 1, 16)
    lens = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    out, lse = fa_lib.flash_attn_with_kvcache(qc, cache, cache, cache_seqlens=lens, window_size=(-1, 4),
                                              return_softmax_lse=True)
    assert torch.isfinite(lse).all() and torch.equal(out, fa_lib.flash_attn_with_kvcache(qc, cache, cache,
                                                                                         cache_seqlens=lens))
    out = fa_lib.flash_attn_with_kvcache(qc, cache, cache, cache_seqlens=lens, window_size=(-1, 3))
    assert not out[:, :5].any() and out[:, 5:].any()  # 3 < 4: the band stands (row i sees j <= i - 5)


# ---------------------------------------------------------------------------------------------------
# 6c. varlen: rows after cu_seqlens[-1] (a padded buffer) are accepted: output 0, LSE +inf, zero gradients.
# ---------------------------------------------------------------------------------------------------
def test_varlen_rows_after_the_last_sequence_are_accepted_and_zero():
    q, k, v = _rand(12, 2, 16, seed=50, grad=True), _rand(14, 1, 16, seed=51, grad=True), \
        _rand(14, 1, 16, seed=52, grad=True)
    do = _rand(12, 2, 16, seed=53)
    cu_q, cu_k = _cu([4, 5]), _cu([6, 5])  # 9 of 12 query rows, 11 of 14 key rows
    with poisoned_outputs():  # an unwritten element would be NaN
        out, lse, _ = fa_lib.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True, return_attn_probs=True)
    assert out.shape == (12, 2, 16) and lse.shape == (2, 12)
    assert not out[9:].any() and torch.isposinf(lse[:, 9:]).all()
    q2, k2, v2 = _leaves(q[:9], k[:11], v[:11])
    want, want_lse = fa_lib.flash_attention_varlen(q2, k2, v2, cu_q, cu_k, 5, 6, causal=True, return_lse=True)
    assert torch.equal(out[:9], want) and torch.equal(lse[:, :9], _pos_inf(want_lse))
    dq, dk, dv = _grads_of(out, do, q, k, v)
    dq2, dk2, dv2 = _grads_of(want, do[:9], q2, k2, v2)
    assert torch.equal(dq[:9], dq2) and torch.equal(dk[:11], dk2) and torch.equal(dv[:11], dv2)
    assert not dq[9:].any() and not dk[11:].any() and not dv[11:].any()
    # the packed variant too
    qkv = _rand(12, 3, 2, 16, seed=57)
    out = fa_lib.flash_attn_varlen_qkvpacked_func(qkv, _cu([4, 5]), 5)
    assert out.shape == (12, 2, 16) and not out[9:].any()


# ---------------------------------------------------------------------------------------------------
# 6e. A paged prefill runs its forward on inputs that require grad; a backward through it raises.
# ---------------------------------------------------------------------------------------------------
def test_a_paged_forward_runs_on_inputs_that_require_grad_and_its_backward_raises():
    from fa_lib import decode

    q, k, v = _rand(9, 2, 16, seed=54), _rand(17, 1, 16, seed=55), _rand(17, 1, 16, seed=56)
    cu_q, cu_k = _cu([3, 6]), _cu([11, 6])
    (k_pool, table), (v_pool, _) = (decode.page_packed(t, cu_k, 4) for t in (k, v))
    want = fa_lib.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 11, causal=True)
    leaves = _leaves(q, k_pool, v_pool)
    out, lse, _ = fa_lib.flash_attn_varlen_func(*leaves, cu_q, cu_k, 6, 11, causal=True, block_table=table,
                                                return_attn_probs=True)
    assert torch.equal(out.detach(), want) and out.requires_grad and not lse.requires_grad
    with pytest.raises(RuntimeError, match=r"with a block_table \(a paged KV cache\) is forward only"):
        out.sum().backward()
    with pytest.raises(ValueError, match=r"over a paged cache \(block_table\) is forward only"):  # native: unchanged
        fa_lib.flash_attention_varlen(*leaves, cu_q, cu_k, 6, 11, block_table=table)
    # under torch.compile too: the forward compiles and runs; the backward raises when it runs
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: fa_lib.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 11, causal=True,
                                                                           block_table=table),
                             fullgraph=True, backend="aot_eager")
    out = compiled(*leaves)
    assert torch.equal(out.detach(), want) and out.requires_grad
    with pytest.raises(RuntimeError, match="is forward only"):
        out.sum().backward()


# ---------------------------------------------------------------------------------------------------
# 7. The module docstring sets the two conventions side by side.
# ---------------------------------------------------------------------------------------------------
def test_the_module_docstring_tables_both_conventions():
    doc = interface.__doc__
    for row in ("LSE of a query row that sees no key", "window side ``>= seqlen_k``", "``cu_seqlens[-1] < tokens``",
                "paged prefill (``block_table``) on inputs", "layout of q, k, v, out", "``deterministic``"):
        assert row in doc
    assert "``+inf`` (output row 0)" in doc and "``-inf`` (output row 0)" in doc
    assert all(f"``{name}``" in doc or name in doc for name in ("dropout_p", "alibi_slopes", "return_attn_probs"))
    for name in interface.__all__:  # every wrapper documents itself
        assert getattr(interface, name).__doc__.startswith(f"flash-attn's ``{name}``")


def test_every_wrapper_documents_its_arguments_and_errors_in_help():
    """help(fa_lib.flash_attn_func) does not show the module docstring: each wrapper's own states the dtypes, the
    softmax_scale default, sinks, what is refused, and its Raises."""
    for name in interface.__all__:
        fn = getattr(interface, name)
        doc = inspect.getdoc(fn)
        params = inspect.signature(fn).parameters
        for words in ("torch.float16", "softmax_scale: default None, meaning ``1 / sqrt(head_dim)``", "sinks:",
                      "alibi_slopes: must be None", "Raises:\n    TypeError:", "    ValueError:"):
            assert words in doc, (name, words)
        if "dropout_p" in params:
            assert "dropout_p: must be 0.0" in doc, name
        assert doc.index("Raises:") > doc.index("Args")
    assert "num_splits: default 0" in inspect.getdoc(interface.flash_attn_with_kvcache)
