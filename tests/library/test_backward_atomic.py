"""``deterministic=False``: the one-pass backward, dQ added atomically by the dK/dV kernel.

The kernel option ``one_pass_backward`` ("auto") picks it only where it measured faster; these tests force it on (TMA
reduce-adds on a GPU, ``tl.atomic_add`` under the interpreter, which has no descriptor reduce).

Judged like every kernel test, by the flash-attn 2x rule against plain PyTorch (float64 gold, the
kernel's dtype as baseline), outputs poisoned before each launch, under the interpreter on a machine
without CUDA; ``-m gpu`` repeats it at full size. dK and dV do not depend on the option's atomics: under
the interpreter (one block configuration for both) they must equal the deterministic ones bit for bit.
"""
import os
import zlib

import pytest
import torch

import fa_lib
from fa_lib import kernels, ops, testing
from fa_lib.testing import assert_flash_rule, make_inputs, reference_forward_backward
from kernel_cases import BF16, F16, F32

DEVICE = "cpu" if kernels.INTERPRET else "cuda"
ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
gpu = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (run `make gpu-test` on a GPU)")]


@pytest.fixture(autouse=True)
def one_pass(monkeypatch, kernel_opts):
    kernel_opts(one_pass_backward=2)


def _grads(q, k, v, do, deterministic, **options):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with testing.poisoned_outputs():
        o, lse = fa_lib.flash_attention(*leaves, return_lse=True, deterministic=deterministic, **options)
        dq, dk, dv = torch.autograd.grad(o, leaves, do)
    return dict(o=o.detach(), lse=lse.detach(), dq=dq, dk=dk, dv=dv)


def _check(shape, dtype, **options):
    b, hq, hkv, nq, nk, d = shape
    q, k, v, do = make_inputs(b, hq, hkv, nq, nk, d, dtype, DEVICE, seed=zlib.crc32(repr((shape, dtype,
                                                                                          options)).encode()))
    out = _grads(q, k, v, do, False, **options)
    assert_flash_rule(out, reference_forward_backward(q, k, v, do, upcast=True, **options),
                      reference_forward_backward(q, k, v, do, upcast=False, **options))
    return q, k, v, do, out


CASES = [
    # (name, (B, Hq, Hkv, Nq, Nk, D), dtype, options)
    ("mha-full", (2, 2, 2, 45, 45, 32), F16, dict()),
    ("gqa-causal-nq<nk", (1, 4, 2, 29, 70, 16), BF16, dict(causal=True)),
    ("f32-causal-nq>nk", (1, 2, 1, 70, 29, 24), F32, dict(causal=True)),
    ("window-softcap", (1, 2, 1, 60, 60, 16), F16, dict(causal=True, window=(9, -1), softcap=10.0)),
]


@pytest.mark.parametrize("shape, dtype, options", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_one_pass_backward_matches_reference(shape, dtype, options):
    q, k, v, do, out = _check(shape, dtype, **options)
    if kernels.INTERPRET:  # same blocks both ways: only dQ's summation differs
        det = _grads(q, k, v, do, True, **options)
        for name in ("o", "lse", "dk", "dv"):
            assert torch.equal(out[name], det[name]), name


def test_one_pass_backward_with_key_padding_and_varlen():
    mask = torch.rand(2, 50, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[1] = False  # a batch row with no real key: its dQ stays 0
    _check((2, 2, 1, 50, 50, 16), F16, causal=True, key_padding_mask=mask.to(DEVICE))
    lens = [0, 1, 17, 40]  # a sequence of length 0 and one of length 1
    cu = torch.tensor([0, 0, 1, 18, 58], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(58, h, 16, generator=gen).to(DEVICE, F16) for h in (4, 2, 2, 4))
    grads = {}
    for det in (True, False):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with testing.poisoned_outputs():
            o = fa_lib.flash_attention_varlen(*leaves, cu, cu, max(lens), max(lens), causal=True,
                                              deterministic=det)
            grads[det] = torch.autograd.grad(o, leaves, do)
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)
    for a, b in zip(grads[True][1:], grads[False][1:]):
        assert torch.equal(a, b) or not kernels.INTERPRET  # dK, dV: no atomics


def test_only_dq_or_only_dkdv_still_runs_the_kernel_that_is_needed():
    q, k, v, do = make_inputs(1, 2, 2, 33, 33, 16, F32, DEVICE, seed=3)
    for needs in ((True, False, False), (False, True, True)):
        leaves = [t.detach().requires_grad_(r) for t, r in zip((q, k, v), needs)]
        o = fa_lib.flash_attention(*leaves, causal=True, deterministic=False)
        grads = torch.autograd.grad(o, [t for t in leaves if t.requires_grad], do)
        ref = reference_forward_backward(q, k, v, do, upcast=True, causal=True)
        for g, name in zip(grads, [n for n, r in zip(("dq", "dk", "dv"), needs) if r]):
            torch.testing.assert_close(g.double(), ref[name], rtol=0, atol=1e-4)


def test_one_pass_is_chosen_where_it_measured_faster(monkeypatch, kernel_opts):
    kernel_opts(one_pass_backward="auto")
    q, k = torch.empty(1, 16, 1, 128), torch.empty(1, 16, 1, 128)
    causal = dict(causal=True, local=False)
    assert ops._one_pass_mode(q.to(DEVICE), k.to(DEVICE), 128, 16384, **causal) == (2 if ON_GPU else 1)
    assert ops._one_pass_mode(q, k, 128, 4096, **causal) == 0  # short sequences: two passes
    assert ops._one_pass_mode(q, k[:, :4], 128, 16384, **causal) == 0  # GQA: two passes
    assert ops._one_pass_mode(q[..., :64], k[..., :64], 64, 16384, **causal) == 0  # head dim 64: two passes
    assert ops._one_pass_mode(q, k, 128, 16384, causal=False, local=False) == 0  # no mask: two passes
    assert ops._one_pass_mode(q, k, 128, 16384, causal=True, local=True) == 0  # a window: two passes


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("dtype, causal, hkv, options", [
    pytest.param(F16, False, 16, {}, marks=gpu), pytest.param(BF16, True, 4, {}, marks=gpu),
    pytest.param(BF16, True, 16, dict(window=(1023, -1), softcap=30.0), marks=gpu)])
def test_gpu_one_pass_backward(monkeypatch, mode, dtype, causal, hkv, options, kernel_opts):
    kernel_opts(one_pass_backward=mode)  # 1: tl.atomic_add, 2: TMA reduce-add
    _check((2, 16, hkv, 4096, 4096, 128), dtype, causal=causal, **options)


def test_a_callers_triton_allocator_is_kept():
    """The TMA one-pass backward needs `triton.set_allocator`; fa_lib installs one only where none is."""
    import contextvars

    import triton
    from triton.runtime import _allocation

    def run():
        ops._ensure_allocator()
        assert _allocation._allocator.get() is ops._allocator  # none before: fa_lib's

        def mine(size, alignment, stream):
            return None

        triton.set_allocator(mine)
        ops._ensure_allocator()
        assert _allocation._allocator.get() is mine  # the caller's stays

    contextvars.copy_context().run(run)  # leave this thread's allocator as it was


def test_a_bad_one_pass_setting_is_named(kernel_opts):
    for bad in ("tma", 3, True):
        with pytest.raises(ValueError, match="one_pass_backward must be"):
            kernel_opts(one_pass_backward=bad)



def test_a_bad_concurrency_setting_is_named(kernel_opts):
    with pytest.raises(ValueError, match="concurrent_backward must be True or False"):
        kernel_opts(concurrent_backward="yes")
