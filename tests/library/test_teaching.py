"""fa_lib.teaching: the small Triton kernels of chapters 9 and 10, against the float64 references.

On the CPU they run under the Triton interpreter at small sizes (lengths 1, 17, 64, 100, N_q != N_k, causal
or not, head dims 16 to 64); the GPU test runs them compiled at N = 1024 and judges them by the flash-attn rule
of ``fa_lib.testing``, as ``tests/library/test_kernels_gpu.py`` judges the production kernels.
"""
import os

import numpy as np
import pytest
import torch

from fa_lib import reference, teaching, testing

CPU = pytest.mark.skipif(not teaching.INTERPRET, reason="the CPU tests run the kernels under the Triton interpreter")


def _run(q, k, v, do, causal, softmax_scale=None):
    o, lse = teaching.teaching_forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    dq, dk, dv = teaching.teaching_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale)
    return dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv)


def _inputs(b, h, n_q, n_k, d, dtype, device="cpu", seed=0):
    q, k, v, do = testing.make_inputs(b, h, h, n_q, n_k, d, dtype, device, seed=seed)
    return q.detach(), k.detach(), v.detach(), do


@CPU
@pytest.mark.parametrize("n_q, n_k, d, causal", [
    (1, 1, 16, False), (1, 17, 16, True), (17, 17, 32, True), (64, 64, 16, False),
    (100, 100, 64, True), (100, 17, 16, True), (17, 100, 32, False), (17, 100, 64, True),
])
def test_float32_matches_float64_reference(n_q, n_k, d, causal):
    q, k, v, do = _inputs(2, 1, n_q, n_k, d, torch.float32, seed=n_q * 1000 + n_k + d)
    out = _run(q, k, v, do, causal)
    gold = testing.reference_forward_backward(q, k, v, do, causal=causal)  # float64
    for name, x in out.items():
        assert x.shape == gold[name].shape and not torch.isnan(x).any(), name
        err = (x.double() - gold[name]).abs().nan_to_num(0.0).max().item()  # -inf == -inf on empty rows
        assert err < 5e-6, (name, err)
    base = testing.reference_forward_backward(q, k, v, do, causal=causal, upcast=False)
    testing.assert_flash_rule(out, gold, base)


@CPU
def test_matches_the_numpy_reference():
    q, k, v, do = _inputs(1, 2, 40, 24, 32, torch.float32, seed=3)
    out = _run(q, k, v, do, causal=True, softmax_scale=0.3)
    q64, k64, v64, do64 = (t.double().numpy() for t in (q, k, v, do))
    o, lse = reference.naive_attention(q64, k64, v64, causal=True, softmax_scale=0.3)
    grads = reference.naive_attention_backward(q64, k64, v64, do64, causal=True, softmax_scale=0.3)
    for name, want in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads)):
        got = out[name].double().numpy()
        assert np.array_equal(np.isneginf(got), np.isneginf(want)), name
        finite = ~np.isneginf(want)
        assert np.abs(got[finite] - want[finite]).max() < 5e-6, name


@CPU
@pytest.mark.parametrize("causal", [False, True])
def test_float16_passes_the_flash_rule(causal):
    q, k, v, do = _inputs(1, 2, 100, 64, 32, torch.float16, seed=7)
    out = _run(q, k, v, do, causal)
    assert out["o"].dtype == out["dq"].dtype == out["dk"].dtype == torch.float16 and out["lse"].dtype == torch.float32
    gold, base = (testing.reference_forward_backward(q, k, v, do, causal=causal, upcast=up) for up in (True, False))
    testing.assert_flash_rule(out, gold, base)


@CPU
def test_rows_that_see_no_key():
    # causal, N_q = 40 > N_k = 8: rows 0..31 see no key (bottom-right alignment).
    q, k, v, do = _inputs(1, 1, 40, 8, 16, torch.float32, seed=5)
    out = _run(q, k, v, do, causal=True)
    assert torch.all(out["o"][..., :32, :] == 0)
    assert torch.all(out["lse"][..., :32] == float("-inf")) and torch.isfinite(out["lse"][..., 32:]).all()
    assert torch.all(out["dq"][..., :32, :] == 0)
    assert not any(torch.isnan(x).any() for x in out.values())
    gold = testing.reference_forward_backward(q, k, v, do, causal=True)
    base = testing.reference_forward_backward(q, k, v, do, causal=True, upcast=False)
    testing.assert_flash_rule(out, gold, base)


@CPU
def test_non_contiguous_inputs():
    q, k, v, do = testing.make_inputs(1, 2, 2, 17, 33, 16, torch.float32, "cpu", seed=9, layout="bnhd")
    assert not q.is_contiguous()
    out = _run(q.detach(), k.detach(), v.detach(), do, causal=True)
    gold = testing.reference_forward_backward(q, k, v, do, causal=True)
    assert max((out[n].double() - gold[n]).abs().max().item() for n in ("o", "dq", "dk", "dv")) < 5e-6


@CPU
def test_the_blocks_are_small_and_not_square():
    assert teaching.BLOCKS == {"fwd": (32, 16, 4), "dkdv": (16, 32, 4), "dq": (32, 16, 4)}
    assert teaching.BLOCKS_FP32 == teaching.BLOCKS


def _bad_calls():
    q = torch.randn(1, 2, 8, 16)
    return [
        ("not a tensor", lambda: teaching.teaching_forward(q.numpy(), q, q), TypeError, "q must be a torch.Tensor"),
        ("3-d", lambda: teaching.teaching_forward(q[0], q, q), ValueError, "q must have 4 dimensions"),
        ("head dims differ", lambda: teaching.teaching_forward(q, torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32)),
         ValueError, "k must have shape"),
        ("v differs", lambda: teaching.teaching_forward(q, q, torch.randn(1, 2, 9, 16)), ValueError, "v must have the shape of k"),
        ("head dim 24", lambda: teaching.teaching_forward(*[torch.randn(1, 1, 4, 24)] * 3), ValueError,
         "must be 16, 32, 64 or 128"),
        ("empty", lambda: teaching.teaching_forward(*[torch.randn(1, 1, 0, 16)] * 3), ValueError, "at least one row"),
        ("float64", lambda: teaching.teaching_forward(*[q.double()] * 3), TypeError, "float32, float16 or bfloat16"),
        ("mixed dtypes", lambda: teaching.teaching_forward(q, q.half(), q), TypeError, "k must have the dtype of q"),
        ("bfloat16", lambda: teaching.teaching_forward(*[q.bfloat16()] * 3), ValueError, "bfloat16 is not supported"),
        ("meta device", lambda: teaching.teaching_forward(*[q.to("meta")] * 3), ValueError, "must be on a cpu device"),
        ("scale", lambda: teaching.teaching_forward(q, q, q, softmax_scale=-1.0), ValueError, "softmax_scale"),
        ("lse shape", lambda: teaching.teaching_backward(q, q, q, q, q, torch.zeros(1, 2, 9)), ValueError,
         "lse must have shape"),
        ("lse dtype", lambda: teaching.teaching_backward(q, q, q, q, q, torch.zeros(1, 2, 8).double()), TypeError,
         "lse must be float32"),
        ("do shape", lambda: teaching.teaching_backward(q[:, :, :4], q, q, q, q, torch.zeros(1, 2, 8)), ValueError,
         "do must have the shape of q"),
    ]


@CPU
@pytest.mark.parametrize("what, call, error, match", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_is_refused(what, call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run `make gpu-test` on a GPU)")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 forces the interpreter")
@pytest.mark.parametrize("d, causal, dtype", [
    *[(d, causal, dtype) for dtype in (torch.float16, torch.bfloat16) for d in (64, 128) for causal in (False, True)],
    (64, True, torch.float32), (128, False, torch.float32),  # exact float32 products, smaller blocks
])
def test_flash_rule_on_the_gpu(d, causal, dtype):
    q, k, v, do = _inputs(2, 4, 1024, 1024, d, dtype, device="cuda", seed=d + causal)
    out = _run(q, k, v, do, causal)
    gold, base = (testing.reference_forward_backward(q, k, v, do, causal=causal, upcast=up) for up in (True, False))
    testing.assert_flash_rule(out, gold, base)
