"""The warp-specialized sm_90 forward and dK/dV kernels (`fa_lib.kernels_hopper`): when `flash_attention` takes
them, and that what they compute passes the same flash-attn 2x rule as the teaching kernels.

CPU part (runs in CI): the routing refuses every tensor that is not on an sm_90 CUDA device, so the
interpreter never sees the Gluon kernel. GPU part (marked ``gpu``, skipped off an sm_90 device): the
route is taken exactly where the kernel's contract holds (16-bit, head dim 64 or 128, plain or causal,
TMA-legal strides), every such case passes the 2x rule forward and backward with poisoned outputs, rows
that see no key give O = 0 and LSE = -inf, the result is the teaching kernel's to rounding, and it is
bit-stable, CUDA-graph capturable and served by the launch cache.
"""
import os

import pytest
import torch

import fa_lib
from fa_lib import dispatch, kernels, launch, ops
from fa_lib.testing import assert_flash_rule, forward_backward, make_inputs, reference_forward_backward
from kernel_cases import BF16, F16, F32, case as _case
from sm90 import compiling_for_sm90

ON_SM90 = (torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
           and torch.cuda.get_device_capability() == (9, 0))
kernels_hopper = ops.kernels_hopper  # None where this Triton lacks the Gluon API it is written in
if kernels_hopper is None:
    pytest.skip("this Triton has no Gluon Hopper API: fa_lib runs the teaching kernel only",
                allow_module_level=True)


@pytest.fixture
def forced(monkeypatch, kernel_opts):
    """Route every eligible forward to the Hopper kernel, where `dispatch.faster` would decline it too."""
    kernel_opts(hopper_forward="always")


@pytest.fixture
def bwd_forced(monkeypatch, kernel_opts):
    """Route every eligible backward's dK/dV to the Hopper kernel, where `faster_backward` would decline it too."""
    kernel_opts(hopper_backward="always")


def _routed_bwd(q, k, v, do, causal=False, grad_dtype=None, one_pass=False, **masks):
    """Whether the backward of `flash_attention(q, k, v, ...)` would compute dK and dV on the Hopper kernel (with
    `one_pass`: and dQ in the same pass, as `deterministic=False` asks)."""
    pb = ops._Problem(q, causal, masks.get("window", (-1, -1)), masks.get("softcap", 0.0),
                      masks.get("key_padding_mask"), n_q=q.shape[2], n_k=k.shape[2], batch=q.shape[0])
    return ops._hopper_backward(q, k, v, do, ops._like(k, grad_dtype), ops._like(v, grad_dtype), pb, one_pass)


def _routed(q, k, v, causal=False, **masks):
    """Whether `flash_attention(q, k, v, ...)` would run its forward on the Hopper kernel."""
    window = masks.get("window", (-1, -1))
    pb = ops._Problem(q, causal, window, masks.get("softcap", 0.0), masks.get("key_padding_mask"),
                      n_q=q.shape[2], n_k=k.shape[2], batch=q.shape[0])
    return ops._hopper_forward(q, k, v, ops._like(q), pb)


def test_never_routed_off_a_cuda_device():
    for dtype in (F16, BF16):
        q, k, v, _ = make_inputs(1, 4, 2, 64, 64, 128, dtype, "cpu", seed=0)
        assert not kernels_hopper.eligible(q, k, v, q)
        assert not _routed(q, k, v, causal=True)


def test_chosen_where_it_was_measured_faster():
    assert all(dispatch.faster(128, n, n, c) for n in (1, 256, 1024, 32768) for c in (False, True))
    assert dispatch.faster(128, 512, 8192, True)
    assert dispatch.faster(64, 4096, 4096, True) and dispatch.faster(64, 32768, 32768, True)
    assert not dispatch.faster(64, 4095, 4095, True) and not dispatch.faster(64, 32768, 32768, False)
    assert not dispatch.faster(64, 512, 8192, True)  # the causal prefill stays on the teaching kernel
    assert all(dispatch.faster(256, n, n, c) for n in (1, 256, 1024, 32768) for c in (False, True))
    assert dispatch.faster(256, 512, 8192, True) and dispatch.faster(256, 512, 8192, False)
    assert not any(dispatch.faster(d, 8192, 8192, True) for d in (32, 96))


def test_backward_chosen_where_it_was_measured_faster():
    assert all(dispatch.faster_backward(128, n, n, c) for n in (2048, 4096, 32768) for c in (False, True))
    assert not dispatch.faster_backward(128, 512, 8192, True) and not dispatch.faster_backward(128, 512, 8192, False)
    assert not any(dispatch.faster_backward(128, n, n, c) for n in (256, 1024) for c in (False, True))
    assert dispatch.faster_backward(64, 4096, 4096, True) and not dispatch.faster_backward(64, 4096, 4096, False)
    assert not dispatch.faster_backward(64, 512, 8192, True) and not dispatch.faster_backward(64, 2048, 2048, True)
    assert not any(dispatch.faster_backward(d, 8192, 8192, True) for d in (32, 96))
    assert all(dispatch.faster_backward(256, n, n, c) for n in (512, 1024, 32768) for c in (False, True))
    assert dispatch.faster_backward(256, 512, 8192, False) and dispatch.faster_backward(256, 257, 257, True)
    assert not any(dispatch.faster_backward(256, 256, 256, c) for c in (False, True))  # short sequences
    assert set(kernels_hopper.BWD_STAGES) == {64, 128, 256}
    # deterministic=False's one pass: at d = 128 unmasked from 4096 tokens, where it measured faster than two
    assert all(dispatch.faster_one_pass(128, n, n, False) for n in (4096, 16384, 32768))
    assert dispatch.faster_one_pass(128, 4096, 8192, False) and not dispatch.faster_one_pass(128, 512, 8192, False)
    assert not any(dispatch.faster_one_pass(128, n, n, True) for n in (4096, 32768))  # causal: two passes
    assert not any(dispatch.faster_one_pass(128, n, n, False) for n in (1024, 2048, 4095))
    assert not any(dispatch.faster_one_pass(d, 16384, 16384, False) for d in (64, 96, 256))


def test_backward_never_routed_off_a_cuda_device(monkeypatch, kernel_opts):
    kernel_opts(hopper_backward="always")
    q, k, v, do = make_inputs(1, 4, 2, 64, 64, 128, BF16, "cpu", seed=0)
    assert not kernels_hopper.eligible_backward(q, k, v, do, k, v)
    assert not _routed_bwd(q, k, v, do, causal=True)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_descriptors_equal_gluons_own(dtype, head_dim):
    """`_desc` skips TensorDescriptor's constructor checks (made by `_tma_ready`), not a field: equal descriptors,
    contiguous and as a (B, N, H, D) view."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    base = torch.zeros(2, 96, 4, head_dim, dtype=dtype)
    for t in (base, base.transpose(1, 2)):
        for block, layout in (kernels_hopper._block(dtype, 64, head_dim), kernels_hopper._block(dtype, 32, head_dim)):
            ours = kernels_hopper._desc(t, block, layout)
            assert type(ours) is TensorDescriptor and ours.base is t
            assert ours == TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def test_the_interpreter_never_compiles_it():
    if kernels.INTERPRET:
        q, k, v, _ = make_inputs(1, 2, 2, 64, 64, 64, BF16, "cpu", seed=1)
        assert not _routed(q, k, v)
    assert kernels_hopper.HEAD_DIMS == (64, 128, 256)
    assert set(kernels_hopper.STAGES) == set(kernels_hopper.BLOCK_N) == set(kernels_hopper.HEAD_DIMS)


CASES = [
    _case(2, 4, 4, 1, 1, 128, False, BF16), _case(2, 4, 4, 17, 17, 128, True, BF16),
    _case(1, 4, 2, 113, 113, 128, True, F16), _case(2, 4, 4, 1000, 1000, 128, False, BF16, "bnhd"),
    _case(1, 8, 2, 1023, 1023, 128, True, BF16, "bnhd"), _case(1, 4, 4, 1023, 1023, 64, True, F16),
    _case(1, 4, 4, 1000, 1000, 64, False, BF16, "bnhd"), _case(1, 4, 4, 300, 1000, 128, True, BF16),
    _case(1, 4, 4, 1000, 300, 128, True, F16), _case(1, 4, 1, 200, 4100, 64, True, BF16),
    _case(1, 2, 2, 4096, 4096, 128, True, BF16), _case(1, 2, 2, 2048, 2048, 64, False, F16, "bnhd"),
    _case(3, 2, 2, 129, 255, 64, False, F16), _case(1, 2, 2, 8192, 8192, 128, True, F16),
    _case(2, 4, 4, 1, 1, 256, False, BF16), _case(2, 4, 4, 17, 17, 256, True, BF16),
    _case(1, 4, 2, 113, 113, 256, True, F16), _case(2, 4, 4, 1000, 1000, 256, False, BF16, "bnhd"),
    _case(1, 4, 4, 300, 1000, 256, True, F16), _case(1, 4, 4, 1000, 300, 256, True, BF16),
    _case(1, 2, 2, 4096, 4096, 256, True, BF16), _case(1, 8, 2, 2047, 2047, 256, False, F16),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) CUDA device")
@pytest.mark.parametrize("batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype, layout", CASES)
def test_hopper_forward_flash_rule_gpu(forced, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype,
                                       layout):
    q, k, v, do = make_inputs(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, "cuda",
                              seed=seqlen_q * 7 + seqlen_k + head_dim, layout=layout)
    assert _routed(q, k, v, causal=causal)
    out = forward_backward(q, k, v, do, causal=causal)  # outputs poisoned (NaN) before the launch
    gold = reference_forward_backward(q, k, v, do, causal=causal, upcast=True)
    base = reference_forward_backward(q, k, v, do, causal=causal, upcast=False)
    assert_flash_rule(out, gold, base)
    with fa_lib.kernel_options(hopper_forward="never"):  # the teaching kernel: the same attention to rounding
        assert not _routed(q, k, v, causal=causal)
        teach = forward_backward(q, k, v, do, causal=causal)
    tol = 2e-2 if dtype == BF16 else 4e-3
    torch.testing.assert_close(out["o"], teach["o"], rtol=0, atol=tol)
    torch.testing.assert_close(out["lse"], teach["lse"], rtol=0, atol=1e-4, equal_nan=False)


def _strided(shape, pad, dtype, offset=0):
    """A (B, H, N, D) view of a buffer whose rows are D + pad elements long, starting `offset` elements in."""
    B, H, N, D = shape
    buf = torch.randn(B * H * N * (D + pad) + offset, device="cuda").to(dtype)
    return buf[offset:].view(B, H, N, D + pad)[..., :D]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) CUDA device")
def test_routed_only_where_faster_unless_forced_gpu(monkeypatch, kernel_opts):
    q, k, v, _ = make_inputs(1, 4, 4, 1024, 1024, 64, BF16, "cuda", seed=6)
    assert not _routed(q, k, v, causal=True) and not _routed(q, k, v)
    q2, k2, v2, _ = make_inputs(1, 2, 2, 4096, 4096, 64, BF16, "cuda", seed=7)
    assert _routed(q2, k2, v2, causal=True) and not _routed(q2, k2, v2)
    kernel_opts(hopper_forward="always")
    assert _routed(q, k, v, causal=True) and _routed(q2, k2, v2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) CUDA device")
def test_routed_only_where_the_contract_holds_gpu(forced):
    q, k, v, _ = make_inputs(1, 4, 2, 256, 256, 128, BF16, "cuda", seed=2)
    assert _routed(q, k, v) and _routed(q, k, v, causal=True)
    assert not _routed(q, k, v, window=(64, -1)) and not _routed(q, k, v, causal=True, window=(64, 0))
    assert not _routed(q, k, v, softcap=30.0)
    assert not _routed(q, k, v, key_padding_mask=torch.ones(1, 256, dtype=torch.bool, device="cuda"))
    for d, dtype in ((96, BF16), (256, F32), (40, BF16), (128, F32), (64, F32)):
        q2, k2, v2, _ = make_inputs(1, 2, 2, 64, 64, d, dtype, "cuda", seed=3)
        assert not _routed(q2, k2, v2), (d, dtype)
    # TMA needs 16-byte strides and base: rows of 132 halves (264 bytes) or a base 2 bytes in are refused
    # (the teaching kernel runs them), rows of 136 halves are fine.
    assert not _routed(_strided((1, 2, 64, 128), 4, BF16), k, v)
    assert not _routed(_strided((1, 2, 64, 128), 8, BF16, offset=1), k, v)
    assert _routed(_strided((1, 4, 64, 128), 8, BF16), k, v)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) CUDA device")
def test_refused_layouts_still_give_the_right_answer_gpu():
    q = _strided((1, 4, 300, 128), 4, F16).requires_grad_()
    k = _strided((1, 2, 300, 128), 4, F16).requires_grad_()
    v = _strided((1, 2, 300, 128), 8, F16, offset=1).requires_grad_()
    do = torch.randn(1, 4, 300, 128, device="cuda").to(F16)
    assert not _routed(q, k, v, causal=True)
    out = forward_backward(q, k, v, do, causal=True)
    assert_flash_rule(out, reference_forward_backward(q, k, v, do, causal=True, upcast=True),
                      reference_forward_backward(q, k, v, do, causal=True, upcast=False))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) CUDA device")
def test_rows_without_keys_and_zero_keys_gpu():
    from fa_lib import flash_attention

    q, k, v, _ = make_inputs(1, 4, 2, 1500, 500, 128, BF16, "cuda", seed=4)  # causal: rows 0..999 see no key
    assert _routed(q, k, v, causal=True)
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    assert torch.all(o[:, :, :1000] == 0) and torch.all(lse[:, :, :1000] == float("-inf"))
    assert torch.all(torch.isfinite(lse[:, :, 1000:])) and not torch.isnan(o).any()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) CUDA device")
def test_bit_stable_graph_capturable_and_cached_gpu():
    from fa_lib import flash_attention

    q, k, v, _ = make_inputs(2, 8, 2, 2048, 2048, 128, BF16, "cuda", seed=5)
    with torch.no_grad():
        first = flash_attention(q, k, v, causal=True)
        hits = launch._STATS["hits"]
        again = flash_attention(q, k, v, causal=True)
        assert launch._STATS["hits"] > hits  # the second launch skipped Triton's binder
        assert torch.equal(first, again)
        static = [t.detach().clone() for t in (q, k, v)]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = flash_attention(*static, causal=True)
        for s, t in zip(static, (q, k, v)):
            s.copy_(t.detach().flip(2))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, flash_attention(*(t.detach().flip(2) for t in (q, k, v)), causal=True))


def test_the_tile_order_is_a_valid_setting():
    assert dispatch.HEADS_PER_GROUP is None or (isinstance(dispatch.HEADS_PER_GROUP, int)
                                                      and dispatch.HEADS_PER_GROUP >= 1)


@pytest.mark.parametrize("bad", [0, -2, 2.0, "2", True])
def test_a_bad_tile_order_is_named(monkeypatch, bad):
    monkeypatch.setattr(dispatch, "HEADS_PER_GROUP", bad)
    with pytest.raises(ValueError, match="HEADS_PER_GROUP must be None or a positive int"):
        dispatch.heads_per_group(4096, 128, 2, 132, 50 * 2**20)


def test_heads_are_grouped_only_where_one_group_overflows_l2():
    l2, sms = 50 * 2**20, 132  # the H200
    assert dispatch.heads_per_group(1024, 128, 2, sms, l2) == dispatch.HEADS_PER_GROUP  # 66 MiB
    assert dispatch.heads_per_group(8192, 64, 2, sms, l2) == dispatch.HEADS_PER_GROUP
    assert dispatch.heads_per_group(256, 128, 2, sms, l2) is None  # 64 x 256 tokens: 17 MiB, fits
    assert dispatch.heads_per_group(512, 64, 2, sms, l2) is None


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) CUDA device")
@pytest.mark.parametrize("batch, heads, seqlen_q, seqlen_k, causal", [
    (3, 5, 700, 700, True),  # 15 (batch, head) pairs: groups of 2, 4 and 8 leave a partial last group
    (2, 3, 300, 1000, False), (1, 7, 1000, 300, True), (1, 1, 129, 129, True),
])
def test_any_tile_order_gives_the_same_bits_gpu(forced, monkeypatch, batch, heads, seqlen_q, seqlen_k, causal, kernel_opts):
    """HEADS_PER_GROUP only reorders the programs: every tile's arithmetic, and so every bit, stays."""
    from fa_lib import flash_attention

    q, k, v, _ = make_inputs(batch, heads, heads, seqlen_q, seqlen_k, 128, BF16, "cuda", seed=heads)
    outs = {}
    with torch.no_grad():
        for group in (None, 1, 2, 4, 8, 64):
            monkeypatch.setattr(dispatch, "heads_per_group", lambda *args, g=group: g)
            outs[group] = flash_attention(q, k, v, causal=causal, return_lse=True)
    for group, (o, lse) in outs.items():
        assert torch.equal(o, outs[None][0]) and torch.equal(lse, outs[None][1]), group
    assert _routed(q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) CUDA device")
@pytest.mark.parametrize("batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype, layout", CASES)
def test_hopper_backward_flash_rule_gpu(bwd_forced, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal,
                                        dtype, layout):
    q, k, v, do = make_inputs(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, "cuda",
                              seed=seqlen_q * 5 + seqlen_k + head_dim, layout=layout)
    assert _routed_bwd(q, k, v, do, causal=causal)
    out = forward_backward(q, k, v, do, causal=causal)  # gradients poisoned (NaN) before the launch
    gold = reference_forward_backward(q, k, v, do, causal=causal, upcast=True)
    base = reference_forward_backward(q, k, v, do, causal=causal, upcast=False)
    assert_flash_rule(out, gold, base)
    with fa_lib.kernel_options(hopper_backward="never"):  # the teaching dK/dV kernel: the same gradients to rounding
        assert not _routed_bwd(q, k, v, do, causal=causal)
        teach = forward_backward(q, k, v, do, causal=causal)
    tol = 2e-2 if dtype == BF16 else 4e-3
    for name in ("dk", "dv"):
        scale = teach[name].float().abs().max().item() + 1e-6
        err = (out[name].float() - teach[name].float()).abs().max().item()
        assert err <= tol * max(1.0, scale), (name, err, scale)
    assert torch.equal(out["dq"], teach["dq"])  # the same dQ kernel


CASES_256 = [
    _case(2, 4, 4, 1, 1, 256, False, BF16), _case(2, 4, 4, 17, 17, 256, True, BF16),
    _case(1, 4, 2, 113, 113, 256, True, F16), _case(2, 4, 4, 1000, 1000, 256, False, BF16, "bnhd"),
    _case(1, 8, 2, 1023, 1023, 256, True, BF16, "bnhd"), _case(1, 4, 4, 300, 1000, 256, True, BF16),
    _case(1, 4, 4, 1000, 300, 256, True, F16), _case(1, 4, 1, 200, 4100, 256, True, BF16),
    _case(1, 4, 4, 1000, 300, 256, False, F16), _case(1, 2, 2, 2048, 2048, 256, False, F16, "bnhd"),
    _case(1, 2, 2, 4096, 4096, 256, True, BF16),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) CUDA device")
@pytest.mark.parametrize("one_pass", [False, True], ids=["two_passes", "one_pass"])
@pytest.mark.parametrize("batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype, layout", CASES_256)
def test_hopper_backward_256_flash_rule_gpu(bwd_forced, monkeypatch, kernel_opts, one_pass, batch, heads_q, heads_kv, seqlen_q,
                                            seqlen_k, head_dim, causal, dtype, layout):
    """d = 256: the two passes (this kernel's dK/dV, the teaching dQ) and the one pass (dQ added atomically by
    the same kernel, deterministic=False) pass the 2x rule; dK and dV are the teaching kernel's to rounding."""
    q, k, v, do = make_inputs(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, "cuda",
                              seed=seqlen_q * 3 + seqlen_k, layout=layout)
    monkeypatch.setattr(dispatch, "ONE_PASS_HEAD_DIMS", (256,) if one_pass else ())
    kernel_opts(hopper_one_pass="always" if one_pass else "auto")
    assert _routed_bwd(q, k, v, do, causal=causal) and _routed_bwd(q, k, v, do, causal=causal, one_pass=True) == one_pass
    out = forward_backward(q, k, v, do, causal=causal, deterministic=not one_pass)
    gold = reference_forward_backward(q, k, v, do, causal=causal, upcast=True)
    base = reference_forward_backward(q, k, v, do, causal=causal, upcast=False)
    assert_flash_rule(out, gold, base)
    kernel_opts(hopper_backward="never")
    assert not _routed_bwd(q, k, v, do, causal=causal)
    teach = forward_backward(q, k, v, do, causal=causal)
    tol = 2e-2 if dtype == BF16 else 4e-3
    for name in ("dk", "dv") + (("dq",) if one_pass else ()):
        scale = teach[name].float().abs().max().item() + 1e-6
        err = (out[name].float() - teach[name].float()).abs().max().item()
        assert err <= tol * max(1.0, scale), (name, err, scale)
    if not one_pass:
        assert torch.equal(out["dq"], teach["dq"])  # the same dQ kernel


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) CUDA device")
@pytest.mark.parametrize("batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype, layout",
                         [c for c in CASES if c.values[5] == 128] + [_case(1, 4, 1, 4100, 4100, 128, False, BF16),
                                                                     _case(2, 2, 2, 4096, 4096, 128, False, F16, "bnhd")])
def test_hopper_one_pass_128_flash_rule_gpu(bwd_forced, monkeypatch, kernel_opts, batch, heads_q, heads_kv, seqlen_q, seqlen_k,
                                            head_dim, causal, dtype, layout):
    """d = 128, deterministic=False: the one pass (FlashAttention-3's split, dQ by TMA reduce-adds) passes the 2x rule
    (forced onto every case; unmasked from 4096 tokens it is the default), and its dK and dV are the two passes' to
    rounding."""
    q, k, v, do = make_inputs(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, "cuda",
                              seed=seqlen_q * 7 + seqlen_k, layout=layout)
    default = dispatch.faster_one_pass(head_dim, seqlen_q, seqlen_k, causal)
    assert _routed_bwd(q, k, v, do, causal=causal, one_pass=True) == default
    kernel_opts(hopper_one_pass="always")
    assert _routed_bwd(q, k, v, do, causal=causal, one_pass=True)
    out = forward_backward(q, k, v, do, causal=causal, deterministic=False)
    gold = reference_forward_backward(q, k, v, do, causal=causal, upcast=True)
    base = reference_forward_backward(q, k, v, do, causal=causal, upcast=False)
    assert_flash_rule(out, gold, base)
    two = forward_backward(q, k, v, do, causal=causal)
    tol = 2e-2 if dtype == BF16 else 4e-3
    for name in ("dk", "dv", "dq"):
        scale = two[name].float().abs().max().item() + 1e-6
        err = (out[name].float() - two[name].float()).abs().max().item()
        assert err <= tol * max(1.0, scale), (name, err, scale)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) CUDA device")
def test_backward_256_takes_two_passes_by_default_and_is_bit_stable_gpu():
    q, k, v, do = make_inputs(1, 8, 2, 777, 1500, 256, BF16, "cuda", seed=10)
    assert _routed_bwd(q, k, v, do, causal=True)
    runs = [forward_backward(q, k, v, do, causal=True, deterministic=det) for det in (True, True, False)]
    for name in ("dq", "dk", "dv"):  # deterministic=False takes the same two passes: the same bits
        assert torch.equal(runs[0][name], runs[1][name]) and torch.equal(runs[0][name], runs[2][name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) CUDA device")
def test_backward_routed_only_where_the_contract_holds_gpu(bwd_forced):
    q, k, v, do = make_inputs(1, 4, 2, 256, 256, 128, BF16, "cuda", seed=2)
    assert _routed_bwd(q, k, v, do) and _routed_bwd(q, k, v, do, causal=True)
    assert not _routed_bwd(q, k, v, do, window=(64, -1)) and not _routed_bwd(q, k, v, do, softcap=30.0)
    assert not _routed_bwd(q, k, v, do, key_padding_mask=torch.ones(1, 256, dtype=torch.bool, device="cuda"))
    assert _routed_bwd(q, k, v, do, grad_dtype=torch.float32)  # the ring's float32 partial gradients (GRAD_F32)
    assert not _routed_bwd(q, k, v, do.new_zeros(1, 1, 1, 128).expand_as(do))  # a broadcast dO: stride 0
    assert not _routed_bwd(q, k, v, _strided((1, 4, 256, 128), 4, BF16))  # rows of 264 bytes
    for d, dtype in ((96, BF16), (32, F16), (128, F32), (256, F32)):
        q2, k2, v2, do2 = make_inputs(1, 2, 2, 64, 64, d, dtype, "cuda", seed=3)
        assert not _routed_bwd(q2, k2, v2, do2), (d, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) CUDA device")
def test_backward_routed_only_where_faster_unless_forced_gpu(monkeypatch, kernel_opts):
    q, k, v, do = make_inputs(1, 4, 4, 1024, 1024, 128, BF16, "cuda", seed=6)
    q2, k2, v2, do2 = make_inputs(1, 2, 2, 4096, 4096, 128, BF16, "cuda", seed=7)
    assert not _routed_bwd(q, k, v, do, causal=True) and _routed_bwd(q2, k2, v2, do2)
    kernel_opts(hopper_backward="always")
    assert _routed_bwd(q, k, v, do, causal=True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) CUDA device")
@pytest.mark.parametrize("head_dim", [128, 256])
def test_backward_is_bit_stable_and_graph_capturable_gpu(bwd_forced, head_dim):
    q, k, v, do = make_inputs(2, 8, 2, 777, 1500, head_dim, BF16, "cuda", seed=8)
    from fa_lib import ops as _ops

    o, lse = _ops._forward(q, k, v, True, q.shape[-1] ** -0.5)
    grads = [_ops._backward(do, None, q, k, v, o, lse, True, q.shape[-1] ** -0.5) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        captured = _ops._backward(do, None, q, k, v, o, lse, True, q.shape[-1] ** -0.5)
    for t in captured:
        t.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, grads[0]))


@pytest.mark.parametrize("one_pass", [1, 2])
def test_one_pass_compiles_for_sm90_without_a_gpu(one_pass):
    """The one pass's dK/dV kernel compiled ahead of time for sm_90 on this machine (no GPU needed: Triton's own
    ptxas): dQ leaves by TMA reduce-adds (`_tma_reduce_add`, an operation Gluon's Hopper module does not wrap, so a
    Triton that renamed it fails here first) and the shared memory fits the H200's 227 KiB."""
    d, n, h = 128, 4096, 4
    q = torch.empty(1, h, n, d, dtype=BF16)
    lse = torch.empty(1, h, n)
    dq = torch.empty(1, h, n, d)
    desc = kernels_hopper._desc(q, *kernels_hopper._block(BF16, 64, d))
    dq_desc = kernels_hopper._desc(dq, *kernels_hopper._block(torch.float32, 64, d // 2))
    with compiling_for_sm90():
        compiled = kernels_hopper._attn_bwd_dkdv_ws.warmup(
            desc, desc, desc, desc, desc, desc, lse, lse, 0.1, n, n, h, 1, lse.stride(0), lse.stride(1), dq_desc,
            q, q, *q.stride()[:3], *q.stride()[:3],
            CAUSAL=True, BLOCK_M=64, BLOCK_N=128, HEAD_DIM=d, STAGES=2, CONSUMER_REGS=kernels_hopper.CONSUMER_REGS,
            ONE_PASS=one_pass, num_warps=kernels_hopper.NUM_WARPS, maxnreg=kernels_hopper.MAX_REGS, grid=(1,))
    ptx = compiled.asm["ptx"]
    assert ptx.count("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add") == 2 * one_pass
    assert "wgmma.mma_async" in ptx and compiled.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("args, error, match", [
    ((128.0, 4096, 4096, False), TypeError, "head_dim must be an int, got float"),
    ((128, -1, 4096, False), ValueError, "n_q must be >= 0, got -1"),
    ((128, 4096, True, False), TypeError, "n_k must be an int, got bool"),
    ((128, 4096, 4096, 1), TypeError, "causal must be a bool, got int")])
def test_faster_one_pass_names_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        dispatch.faster_one_pass(*args)


@pytest.mark.parametrize("setting, value", [("ONE_PASS_MODE", 3), ("ONE_PASS_MODE", True), ("ONE_PASS_STAGES", 1),
                                            ("ONE_PASS_BLOCK_N", 96), ("ONE_PASS_DQ_TMA", 1)])
def test_a_one_pass_setting_it_cannot_run_is_named(monkeypatch, setting, value):
    for head_dim in (128, 256):
        kernels_hopper._check_one_pass_settings(head_dim)  # the shipped settings pass
    """An unknown ONE_PASS_MODE would compile a kernel that adds no dQ (a silent wrong answer): every one-pass
    setting is checked before the launch, on any machine."""
    monkeypatch.setitem(getattr(kernels_hopper, setting), 128, value)
    q, k, v, do = make_inputs(1, 4, 2, 64, 64, 128, BF16, "cpu", seed=9)
    lse = torch.zeros(1, 4, 64)
    with pytest.raises(ValueError, match=f"kernels_hopper.{setting}\\[128\\] must be one of"):
        kernels_hopper.backward_dkdv(q, k, v, do, lse, lse, k, v, False, 0.1, dq_acc=q.float())


def test_backward_dkdv_names_bad_input():
    q, k, v, do = make_inputs(1, 4, 2, 64, 64, 128, BF16, "cpu", seed=9)
    lse = torch.zeros(1, 4, 64)
    args = dict(k=k, v=v, do=do, dk=k, dv=v, causal=False, sm_scale=0.1)
    with pytest.raises(TypeError, match="q must be float16 or bfloat16"):
        kernels_hopper.backward_dkdv(q.float(), lse=lse, delta=lse, **args)
    q96, k96, v96, do96 = make_inputs(1, 4, 2, 64, 64, 96, BF16, "cpu", seed=9)
    with pytest.raises(ValueError, match="head dim must be one of \\[64, 128, 256\\], got 96"):
        kernels_hopper.backward_dkdv(q96, k96, v96, do96, lse, lse, k96, v96, False, 0.1)
    q64, k64, v64, do64 = make_inputs(1, 4, 2, 64, 64, 64, BF16, "cpu", seed=9)
    with pytest.raises(ValueError, match="dq_acc is taken at head dims \\[128, 256\\] only, got q's head dim 64"):
        kernels_hopper.backward_dkdv(q64, k64, v64, do64, lse, lse, k64, v64, False, 0.1, dq_acc=q64.float())
    q256, k256, v256, do256 = make_inputs(1, 4, 2, 64, 64, 256, BF16, "cpu", seed=9)
    args256 = dict(k=k256, v=v256, do=do256, dk=k256, dv=v256, causal=False, sm_scale=0.1, lse=lse, delta=lse)
    with pytest.raises(ValueError, match="dq_acc must be float32 of q's shape \\(1, 4, 64, 256\\)"):
        kernels_hopper.backward_dkdv(q256, dq_acc=q256, **args256)  # bf16
    with pytest.raises(ValueError, match="unit last stride"):
        kernels_hopper.backward_dkdv(q256, dq_acc=torch.zeros(1, 4, 256, 64).transpose(2, 3), **args256)
    with pytest.raises(TypeError, match="lse and delta must be float32"):
        kernels_hopper.backward_dkdv(q, lse=lse.double(), delta=lse, **args)
    with pytest.raises(ValueError, match="lse and delta must have shape \\(1, 4, 64\\)"):
        kernels_hopper.backward_dkdv(q, lse=lse[:, :2], delta=lse, **args)
    with pytest.raises(ValueError, match="must share strides"):
        kernels_hopper.backward_dkdv(q, lse=lse, delta=torch.zeros(1, 64, 4).transpose(1, 2), **args)
    # the ring's float32 partial gradients: both float32, at the head dims of GRAD_F32_HEAD_DIMS, two passes
    f32 = dict(args, dk=k.float(), dv=v.float())
    with pytest.raises(TypeError, match="dk and dv must both be in q's dtype torch.bfloat16 or both float32"):
        kernels_hopper.backward_dkdv(q, lse=lse, delta=lse, **dict(f32, dv=v))
    with pytest.raises(TypeError, match="got torch.float16 and torch.float16"):
        kernels_hopper.backward_dkdv(q, lse=lse, delta=lse, **dict(args, dk=k.half(), dv=v.half()))
    with pytest.raises(ValueError, match="float32 dk and dv are written by the two-pass kernel at head dims "
                                         "\\(64, 128\\) only, got head dim 256"):
        kernels_hopper.backward_dkdv(q256, **dict(args256, dk=k256.float(), dv=v256.float()))
    with pytest.raises(ValueError, match="got head dim 128 and a dq_acc"):
        kernels_hopper.backward_dkdv(q, lse=lse, delta=lse, dq_acc=q.float(), **f32)


@pytest.fixture
def dq_forced(monkeypatch, kernel_opts):
    """Route every eligible backward's dQ to the Hopper dQ kernel, where `faster_dq` would decline it too."""
    kernel_opts(hopper_dq="always")


def _routed_dq(q, k, v, do, causal=False, grad_dtype=None):
    """Whether the backward of `flash_attention(q, k, v, causal=causal)` would compute dQ on the Hopper dQ kernel."""
    pb = ops._Problem(q, causal, (-1, -1), 0.0, None, n_q=q.shape[2], n_k=k.shape[2], batch=q.shape[0])
    return ops._hopper_dq(q, k, v, do, ops._like(q, grad_dtype), pb)


def test_dq_kernel_never_routed_off_a_cuda_device(dq_forced):
    q, k, v, do = make_inputs(1, 4, 2, 64, 64, 128, BF16, "cpu", seed=3)
    assert not _routed_dq(q, k, v, do) and not _routed_dq(q, k, v, do, causal=True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) CUDA device")
@pytest.mark.parametrize("batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype, layout",
                         [c for c in CASES if c.values[5] in (64, 128)])
def test_hopper_dq_flash_rule_gpu(dq_forced, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype,
                                  layout):
    q, k, v, do = make_inputs(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, "cuda",
                              seed=seqlen_q * 7 + seqlen_k + head_dim, layout=layout)
    # 16-bit dQ, and the ring's float32 partial dQ (DQ_F32)
    assert _routed_dq(q, k, v, do, causal=causal) and _routed_dq(q, k, v, do, causal=causal, grad_dtype=torch.float32)
    out = forward_backward(q, k, v, do, causal=causal)  # gradients poisoned (NaN) before the launch
    gold = reference_forward_backward(q, k, v, do, causal=causal, upcast=True)
    base = reference_forward_backward(q, k, v, do, causal=causal, upcast=False)
    assert_flash_rule(out, gold, base)
    with fa_lib.kernel_options(hopper_dq="never"):  # the teaching dQ kernel: the same dQ to rounding, dK and dV
        assert not _routed_dq(q, k, v, do, causal=causal)
        teach = forward_backward(q, k, v, do, causal=causal)
    tol = 2e-2 if dtype == BF16 else 4e-3
    scale = teach["dq"].float().abs().max().item() + 1e-6
    err = (out["dq"].float() - teach["dq"].float()).abs().max().item()
    assert err <= tol * max(1.0, scale), (err, scale)
    assert torch.equal(out["dk"], teach["dk"]) and torch.equal(out["dv"], teach["dv"])


def test_backward_dq_names_bad_input():
    q, k, v, do = make_inputs(1, 4, 2, 64, 64, 128, BF16, "cpu", seed=9)
    lse = torch.zeros(1, 4, 64)
    args = dict(k=k, v=v, do=do, dq=q, causal=False, sm_scale=0.1)
    with pytest.raises(TypeError, match="q must be float16 or bfloat16"):
        kernels_hopper.backward_dq(q.float(), lse=lse, delta=lse, **args)
    q96, k96, v96, do96 = make_inputs(1, 4, 2, 64, 64, 96, BF16, "cpu", seed=9)
    with pytest.raises(ValueError, match="head dim must be one of \\[64, 128\\], got 96"):
        kernels_hopper.backward_dq(q96, k96, v96, do96, lse, lse, q96, False, 0.1)
    with pytest.raises(TypeError, match="lse and delta must be float32"):
        kernels_hopper.backward_dq(q, lse=lse.double(), delta=lse, **args)
    with pytest.raises(ValueError, match="lse and delta must have shape \\(1, 4, 64\\)"):
        kernels_hopper.backward_dq(q, lse=lse[:, :2], delta=lse, **args)
    with pytest.raises(ValueError, match="must share strides"):
        kernels_hopper.backward_dq(q, lse=lse, delta=torch.zeros(1, 64, 4).transpose(1, 2), **args)
    with pytest.raises(TypeError, match="dq must be in q's dtype torch.bfloat16 or float32, got torch.float16"):
        kernels_hopper.backward_dq(q, lse=lse, delta=lse, **dict(args, dq=q.half()))


def test_dq_kernel_chosen_where_it_was_measured_faster():
    faster = dispatch.faster_dq
    assert all(faster(128, n, n, c) for n in (1024, 4096, 32768) for c in (False, True))
    assert not faster(128, 512, 8192, True) and not faster(128, 256, 256, False)  # the prefill, the small batch
    assert not faster(64, 4096, 4096, True) and not faster(256, 4096, 4096, True)  # not timed there
    assert (kernels_hopper.DQ_BLOCK_N[128], kernels_hopper.DQ_STAGES[128]) == (128, 2)


@pytest.mark.parametrize("kernel", ["forward", "dkdv", "dq"])
def test_float32_outputs_compile_for_sm90_without_a_gpu(kernel):
    """The ring's float32 partials (O_F32, GRAD_F32, DQ_F32) compiled ahead of time for sm_90: stored from registers
    (no TMA store of the output), in the 16-bit kernel's shared memory."""
    d, n, h = 128, 4096, 4
    q = torch.empty(1, h, n, d, dtype=BF16)
    f32 = torch.empty(1, h, n, d)
    lse = torch.empty(1, h, n)
    common = dict(CONSUMER_REGS=kernels_hopper.CONSUMER_REGS, num_warps=kernels_hopper.NUM_WARPS,
                  maxnreg=kernels_hopper.MAX_REGS, grid=(1,), CAUSAL=True)
    compiled = {}
    for on in (False, True):
        out = f32 if on else q
        with compiling_for_sm90():
            if kernel == "forward":
                qb, ql, kb, kl = kernels_hopper._blocks(BF16, d)
                qd, kd = kernels_hopper._desc(q, qb, ql), kernels_hopper._desc(q, kb, kl)
                compiled[on] = kernels_hopper._attn_fwd_ws.warmup(
                    qd, kd, kd, qd, lse, 0.1, n, n, h, 1, h, lse.stride(0), lse.stride(1), out, *out.stride()[:3],
                    BLOCK_M=128, BLOCK_N=128, HEAD_DIM=d, STAGES=kernels_hopper.STAGES[d],
                    **kernels_hopper._flag("O_F32", on), **common)
            elif kernel == "dkdv":
                desc = kernels_hopper._desc(q, *kernels_hopper._block(BF16, 64, d))
                compiled[on] = kernels_hopper._attn_bwd_dkdv_ws.warmup(
                    desc, desc, desc, desc, desc, desc, lse, lse, 0.1, n, n, h, 1, lse.stride(0), lse.stride(1), desc,
                    out, out, *out.stride()[:3], *out.stride()[:3], BLOCK_M=64, BLOCK_N=128, HEAD_DIM=d,
                    STAGES=kernels_hopper.BWD_STAGES[d], ONE_PASS=0, **kernels_hopper._flag("GRAD_F32", on), **common)
            else:
                qd = kernels_hopper._desc(q, *kernels_hopper._block(BF16, 64, d))
                kd = kernels_hopper._desc(q, *kernels_hopper._block(BF16, 128, d))
                compiled[on] = kernels_hopper._attn_bwd_dq_ws.warmup(
                    qd, kd, kd, qd, qd, lse, lse, 0.1, n, n, h, 1, h, lse.stride(0), lse.stride(1), out,
                    *out.stride()[:3], BLOCK_M=128, BLOCK_N=128, HEAD_DIM=d, STAGES=kernels_hopper.DQ_STAGES[d],
                    **kernels_hopper._flag("DQ_F32", on), **common)
    tma_store = "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group"
    assert tma_store in compiled[False].asm["ptx"] and tma_store not in compiled[True].asm["ptx"]
    assert "wgmma.mma_async" in compiled[True].asm["ptx"]
    assert compiled[True].metadata.shared <= compiled[False].metadata.shared + 64
