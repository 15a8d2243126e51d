"""Attention as models now use it: sinks (`sinks=`, gpt-oss) and a value head dim of its own (d_v != d, MLA).

Sinks: one logit per query head in every row's softmax denominator, forward and backward. The NumPy reference forms
the sink as one more score column (`naive_attention`, `naive_attention_backward`); fa_lib folds it into the kernels'
output and LSE (`fa_lib.sinks`, `reference.apply_sinks`). A value head dim of its own: zero columns padded on the
narrower side. Both checked against float64 by the flash-attn rule, gradients included, with masks, GQA and every
entry point."""
import os

import numpy as np
import pytest
import torch

import fa_lib
from fa_lib import reference
from fa_lib.testing import assert_flash_rule, forward_backward, make_inputs, reference_forward_backward

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
NAMES = ("o", "lse", "dq", "dk", "dv", "dsinks")


# ---------------------------------------------------------------------------------------------------
# NumPy reference
# ---------------------------------------------------------------------------------------------------
def _np_inputs(seed, b=2, h=3, nq=6, nk=9, d=4):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in ((b, h, nq, d), (b, h, nk, d), (b, h, nk, d), (b, h, nq, d))]


def test_reference_sink_is_a_column_of_value_zero_and_apply_sinks_agrees():
    q, k, v, _ = _np_inputs(0)
    sinks = np.array([0.7, -3.0, -np.inf])
    o, lse = reference.naive_attention(q, k, v, causal=True, sinks=sinks)
    o0, lse0 = reference.naive_attention(q, k, v, causal=True)
    o1, lse1 = reference.apply_sinks(o0, lse0, sinks)
    np.testing.assert_allclose(o, o1, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, lse1, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(o[:, 2], o0[:, 2])  # a sink of -inf is no sink
    # a row's probabilities now sum to 1 - p_sink
    _, p = reference.attention_scores(q, k, causal=True, sinks=sinks)
    np.testing.assert_allclose(p.sum(-1)[:, 0], 1 - np.exp(sinks[0] - lse[:, 0]), rtol=1e-12)


def test_reference_gradients_match_finite_differences():
    q, k, v, do = _np_inputs(1)
    sinks = np.array([0.3, -1.0, 2.0])
    dq, dk, dv, dsinks = reference.naive_attention_backward(q, k, v, do, window=(3, 1), sinks=sinks)

    def loss(q=q, k=k, sinks=sinks):
        return float((reference.naive_attention(q, k, v, window=(3, 1), sinks=sinks)[0] * do).sum())

    eps = 1e-6
    for h in range(3):
        up, dn = sinks.copy(), sinks.copy()
        up[h] += eps
        dn[h] -= eps
        assert abs((loss(sinks=up) - loss(sinks=dn)) / (2 * eps) - dsinks[h]) < 1e-7
    up, dn = q.copy(), q.copy()
    up[1, 2, 3, 1] += eps
    dn[1, 2, 3, 1] -= eps
    assert abs((loss(q=up) - loss(q=dn)) / (2 * eps) - dq[1, 2, 3, 1]) < 1e-7


def test_reference_rows_that_see_no_key_see_the_sink():
    q, k, v, do = _np_inputs(2, nq=9, nk=4)
    sinks = np.array([0.5, -np.inf, 1.0])
    o, lse = reference.naive_attention(q, k, v, causal=True, sinks=sinks)
    # causal with Nq = 9 > Nk = 4: rows 0-4 see no key; with a sink their LSE is the sink, without one -inf
    np.testing.assert_array_equal(o[:, :, :5], 0.0)
    np.testing.assert_array_equal(lse[:, 0, :5], 0.5)
    assert np.isneginf(lse[:, 1, :5]).all()
    grads = reference.naive_attention_backward(q, k, v, do, causal=True, sinks=sinks)
    assert all(np.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("sinks, error, match", [
    (np.zeros(2), ValueError, r"sinks must have shape \(heads,\) = \(3,\)"),
    (np.array([0.0, np.nan, 1.0]), ValueError, "finite or -inf"),
    (np.array([0.0, np.inf, 1.0]), ValueError, "finite or -inf"),
    ([0.0, 1.0, 2.0], TypeError, "sinks must be a numpy.ndarray"),
])
def test_reference_names_bad_sinks(sinks, error, match):
    q, k, v, _ = _np_inputs(3)
    with pytest.raises(error, match=match):
        reference.naive_attention(q, k, v, sinks=sinks)


# ---------------------------------------------------------------------------------------------------
# The kernels (the interpreter on a CPU; `make gpu-test` repeats the dense case at full size)
# ---------------------------------------------------------------------------------------------------
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
CASES = [  # (B, H_q, H_kv, N_q, N_k, d, dtype, masks)
    (2, 4, 2, 37, 37, 16, F32, dict(causal=True)),
    (1, 4, 4, 20, 45, 32, F16, dict(window=(6, 2))),
    (2, 2, 1, 50, 17, 16, F32, dict(causal=True, softcap=5.0)),  # rows that see no key: only their sink
    (1, 4, 2, 33, 33, 64, F16, dict()),
]


def _sinks(h, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(h, generator=g) * 2
    s[-1] = float("-inf")  # one head without a sink
    return s.to(DEVICE)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[6]}-{c[3]}x{c[4]}-{sorted(c[7])}")
def test_flash_attention_with_sinks_by_the_flash_rule(case):
    b, hq, hkv, nq, nk, d, dtype, masks = case
    q, k, v, do = make_inputs(b, hq, hkv, nq, nk, d, dtype, DEVICE, seed=nq * nk)
    sinks = _sinks(hq, d)
    out = forward_backward(q, k, v, do, sinks=sinks, **masks)
    gold = reference_forward_backward(q, k, v, do, upcast=True, sinks=sinks, **masks)
    base = reference_forward_backward(q, k, v, do, upcast=False, sinks=sinks, **masks)
    assert_flash_rule(out, gold, base, names=NAMES)
    assert out["dsinks"][-1] == 0  # the head without a sink


def _packed(seqlens, h, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(seqlens)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(seqlens)]), dtype=torch.int32, device=DEVICE)
    return [torch.randn(total, hh, d, generator=g).to(DEVICE, dtype) for hh in h] + [cu]


def test_varlen_with_sinks_is_each_sequence_alone():
    seqlens = [5, 0, 23, 1]
    q, k, v, cu = _packed(seqlens, (4, 2, 2), 16, F32, 5)
    sinks = _sinks(4, 1)
    o = fa_lib.flash_attention_varlen(q, k, v, cu, cu, 23, 23, causal=True, sinks=sinks)
    for a, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if a == e:
            continue
        one = fa_lib.flash_attention(*(t[a:e].transpose(0, 1)[None] for t in (q, k, v)), causal=True, sinks=sinks)
        torch.testing.assert_close(o[a:e], one[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_kvcache_and_wrappers_with_sinks():
    g = torch.Generator().manual_seed(7)
    B, hq, hkv, n_max, d = 2, 4, 2, 40, 16
    kc, vc = (torch.randn(B, hkv, n_max, d, generator=g).to(DEVICE) for _ in range(2))
    q = torch.randn(B, hq, 3, d, generator=g).to(DEVICE)
    lens = torch.tensor([12, 37], dtype=torch.int32, device=DEVICE)
    sinks = _sinks(hq, 3)
    o = fa_lib.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, sinks=sinks)
    for b in range(B):
        n = int(lens[b])
        one = fa_lib.flash_attention(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n], causal=True, sinks=sinks)
        torch.testing.assert_close(o[b:b + 1], one, rtol=1e-6, atol=1e-6)
    wrapped = fa_lib.flash_attn_with_kvcache(q.transpose(1, 2), kc.transpose(1, 2).contiguous(),
                                             vc.transpose(1, 2).contiguous(), cache_seqlens=lens, causal=True,
                                             sinks=sinks)
    torch.testing.assert_close(wrapped.transpose(1, 2), o, rtol=0, atol=0)
    # the dense wrapper: same bits as the native call on the transposed views, and the same gradients
    qd, kd, vd, _ = make_inputs(1, hq, hkv, 19, 19, d, F32, DEVICE, seed=8, layout="bnhd")
    leaf = sinks.clone().requires_grad_()
    out = fa_lib.flash_attn_func(qd.transpose(1, 2), kd.transpose(1, 2), vd.transpose(1, 2), causal=True, sinks=leaf)
    native = fa_lib.flash_attention(qd, kd, vd, causal=True, sinks=leaf)
    torch.testing.assert_close(out.transpose(1, 2), native, rtol=0, atol=0)
    g1 = torch.autograd.grad(out.sum(), leaf)[0]
    g2 = torch.autograd.grad(native.sum(), leaf)[0]
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)


@pytest.mark.parametrize("sinks, error, match", [
    ([0.0] * 4, TypeError, "sinks must be a torch.Tensor"),
    (torch.zeros(4, dtype=torch.int64), TypeError, "floating-point dtype"),
    (torch.zeros(3), ValueError, r"sinks must have shape \(heads_q,\) = \(4,\)"),
    (torch.zeros(4, device="meta"), ValueError, "sinks is on device meta"),
    (torch.tensor([0.0, float("nan"), 1.0, 2.0]), ValueError, r"sinks must be finite or -inf .*sinks\[1\] = nan"),
    (torch.tensor([float("inf"), 0.0, 1.0, 2.0]), ValueError, r"sinks must be finite or -inf .*sinks\[0\] = inf"),
])
def test_bad_sinks_are_named(sinks, error, match):
    q, k, v, _ = make_inputs(1, 4, 2, 8, 8, 16, F32, DEVICE, seed=0)
    with pytest.raises(error, match=match):
        fa_lib.flash_attention(q, k, v, sinks=sinks)
    with pytest.raises(error, match=match):
        fa_lib.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), sinks=sinks)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_plus_inf_sinks_are_refused_by_every_entry_point(bad):
    """A NaN sink made its head's outputs NaN, a +inf one made them 0 with LSE +inf: every entry point refuses
    both before anything runs, and a -inf sink (no sink) stays accepted."""
    sinks = torch.tensor([0.5, bad], device=DEVICE)
    match = "sinks must be finite or -inf"
    g = torch.Generator().manual_seed(3)
    x3 = torch.randn(4, 2, 8, generator=g).to(DEVICE)  # (total, heads, d)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    x4 = torch.randn(1, 2, 4, 8, generator=g).to(DEVICE)  # (B, H, N, d)
    calls = {
        "flash_attention_varlen": lambda s: fa_lib.flash_attention_varlen(x3, x3, x3, cu, cu, 4, 4, sinks=s),
        "flash_attention_with_kvcache": lambda s: fa_lib.flash_attention_with_kvcache(
            x4[:, :, :1], x4, x4, cache_seqlens=cu[1:], sinks=s),
        "flash_attn_varlen_func": lambda s: fa_lib.flash_attn_varlen_func(x3, x3, x3, cu, cu, 4, 4, sinks=s),
        "flash_attn_qkvpacked_func": lambda s: fa_lib.flash_attn_qkvpacked_func(
            torch.stack([x4.transpose(1, 2)] * 3, 2), sinks=s),
        "flash_attn_with_kvcache": lambda s: fa_lib.flash_attn_with_kvcache(
            x4[:, :, :1].transpose(1, 2), x4.transpose(1, 2), x4.transpose(1, 2), cache_seqlens=4, sinks=s),
    }
    with torch.no_grad():
        for name, call in calls.items():
            with pytest.raises(ValueError, match=match):
                call(sinks)
            assert torch.isfinite(call(torch.tensor([0.5, float("-inf")], device=DEVICE))).all(), name


def test_sinks_values_are_read_once_per_tensor(monkeypatch):
    """Reading a GPU tensor's values is a device synchronisation: a tensor whose read waits (a CUDA one; here a CPU
    one made to count as such) is read at its first call only, not after the in-place changes an optimiser makes at
    every step; another tensor is read again; a CPU tensor's read costs nothing and is made at every call."""
    from fa_lib import checks

    reads = []
    check = checks._check_sink_values
    monkeypatch.setattr(checks, "_check_sink_values", lambda s: reads.append(1) or check(s))
    q, k, v, _ = make_inputs(1, 2, 2, 8, 8, 16, F32, DEVICE, seed=0)
    sinks = torch.tensor([0.5, -1.0], device=DEVICE)
    fa_lib.flash_attention(q, k, v, sinks=sinks)
    fa_lib.flash_attention(q, k, v, sinks=sinks)
    assert len(reads) == (1 if checks._reads_wait(sinks) else 2)
    monkeypatch.setattr(checks, "_reads_wait", lambda t: True)
    reads.clear()
    for _ in range(3):
        fa_lib.flash_attention(q, k, v, sinks=sinks)
    assert len(reads) == 1 and sinks in checks._CHECKED_SINKS
    sinks[1] = -2.0  # an in-place change (an optimiser step): not read again
    fa_lib.flash_attention(q, k, v, sinks=sinks)
    assert len(reads) == 1
    bad = torch.tensor([0.5, float("nan")], device=DEVICE)  # another tensor: read, and refused
    with pytest.raises(ValueError, match=r"sinks\[1\] = nan"):
        fa_lib.flash_attention(q, k, v, sinks=bad)
    with pytest.raises(ValueError, match=r"sinks\[1\] = nan"):  # (a refused tensor is not remembered as checked)
        fa_lib.flash_attention(q, k, v, sinks=bad)
    assert len(reads) == 3


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (run `make gpu-test` on a GPU)")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_sinks_at_full_size_by_the_flash_rule(causal, dtype):
    q, k, v, do = make_inputs(2, 16, 4, 4096, 4096, 128, dtype, DEVICE, seed=11)
    sinks = _sinks(16, 4)
    out = forward_backward(q, k, v, do, causal=causal, sinks=sinks, window=(1023, -1) if causal else (-1, -1))
    gold = reference_forward_backward(q, k, v, do, upcast=True, causal=causal, sinks=sinks,
                                      window=(1023, -1) if causal else (-1, -1))
    base = reference_forward_backward(q, k, v, do, upcast=False, causal=causal, sinks=sinks,
                                      window=(1023, -1) if causal else (-1, -1))
    assert_flash_rule(out, gold, base, names=NAMES)


# ---------------------------------------------------------------------------------------------------
# A value head dim of its own (d_v != d): the kernels on zero-padded columns, the same attention
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d, d_v, dtype, masks", [(32, 16, F32, dict(causal=True)), (16, 48, F16, dict(window=(5, 1))),
                                                  (48, 32, F32, dict(sinks=True))])
def test_value_head_dim_of_its_own_by_the_flash_rule(d, d_v, dtype, masks):
    b, hq, hkv, n = 2, 4, 2, 29
    g = torch.Generator().manual_seed(d * d_v)
    q, k = (torch.randn(b, h, n, d, generator=g).to(DEVICE, dtype).requires_grad_() for h in (hq, hkv))
    v = torch.randn(b, hkv, n, d_v, generator=g).to(DEVICE, dtype).requires_grad_()
    do = torch.randn(b, hq, n, d_v, generator=g).to(DEVICE, dtype)
    masks = dict(masks)
    if masks.pop("sinks", False):
        masks["sinks"] = _sinks(hq, 5)
    out = forward_backward(q, k, v, do, **masks)
    gold = reference_forward_backward(q, k, v, do, upcast=True, **masks)
    base = reference_forward_backward(q, k, v, do, upcast=False, **masks)
    assert out["o"].shape == (b, hq, n, d_v) and out["o"].is_contiguous()
    assert_flash_rule(out, gold, base, names=NAMES if "sinks" in masks else NAMES[:-1])


def test_value_head_dim_of_its_own_in_varlen_and_its_checks():
    seqlens = [7, 0, 12]
    q, k, cu = _packed(seqlens, (4, 2), 32, F32, 9)
    v = _packed(seqlens, (2,), 16, F32, 10)[0]
    o = fa_lib.flash_attention_varlen(q, k, v, cu, cu, 12, 12, causal=True)
    assert o.shape == (19, 4, 16)
    for a, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if a < e:
            one = fa_lib.flash_attention(*(t[a:e].transpose(0, 1)[None] for t in (q, k, v)), causal=True)
            torch.testing.assert_close(o[a:e], one[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"value head dim \(v.shape\[3\]\) must be between 1 and 256, got 300"):
        fa_lib.flash_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                               torch.zeros(1, 2, 19, 300, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (run `make gpu-test` on a GPU)")
@pytest.mark.parametrize("d, d_v", [(192, 128), (128, 64)])
def test_value_head_dim_at_full_size_by_the_flash_rule(d, d_v):
    b, hq, hkv, n = 1, 16, 16, 4096
    g = torch.Generator().manual_seed(d + d_v)
    q, k = (torch.randn(b, h, n, d, generator=g).to(DEVICE, BF16).requires_grad_() for h in (hq, hkv))
    v = torch.randn(b, hkv, n, d_v, generator=g).to(DEVICE, BF16).requires_grad_()
    do = torch.randn(b, hq, n, d_v, generator=g).to(DEVICE, BF16)
    out = forward_backward(q, k, v, do, causal=True)
    gold = reference_forward_backward(q, k, v, do, upcast=True, causal=True)
    base = reference_forward_backward(q, k, v, do, upcast=False, causal=True)
    assert_flash_rule(out, gold, base, names=NAMES[:-1])
