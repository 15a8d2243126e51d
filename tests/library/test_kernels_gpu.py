"""fa_lib.flash_attention on a real GPU, at full size, by the flash-attn 2x rule.

Run on a CUDA machine with ``make gpu-test`` (``python3 -m pytest tests/library -m gpu``); the tests skip,
saying why, where there is no CUDA device. They repeat the interpreter tests of
``tests/library/test_kernels.py`` at the sizes the kernel is built for: sequence lengths up to 16k, head dims
64, 128 and 256, causal or not, float16 and bfloat16, plus the awkward cases (lengths 1, 17, 113,
1000, 1023; head dims 40, 80, 96; seqlen_q != seqlen_k; grouped-query attention; non-contiguous
views; float32 with exact products). Every case draws fresh inputs from its own seed and poisons the
outputs (NaN) before each launch, after a first call that lets the autotuner settle.

Set ``FA_LIB_GPU_REPORT=/path/file.jsonl`` to append one line per case with the errors and the
error ratios (kernel error / PyTorch-in-dtype error), for the record.
"""
import json
import os
import zlib

import pytest
import torch

import fa_lib
from fa_lib import testing
from fa_lib.testing import assert_flash_rule, forward_backward, make_inputs, reference_forward_backward
from kernel_cases import BF16, F16, F32, case as _case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run `make gpu-test` on a GPU)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 forces the CPU "
                       "interpreter; tests/library/test_kernels.py covers it"),
]


CASES = [
    # The sizes the kernel is built for: every 16-bit dtype x head dim x mask, at an awkward length.
    *[_case(2, 4, 4, 1023, 1023, d, causal, dtype)
      for dtype in (F16, BF16) for d in (64, 128, 256) for causal in (False, True)],
    # Long sequences.
    _case(1, 4, 4, 4096, 4096, 128, False, BF16),
    _case(1, 4, 4, 4096, 4096, 64, True, F16),
    _case(1, 2, 2, 8192, 8192, 256, True, BF16),
    _case(1, 1, 1, 16384, 16384, 128, True, BF16),
    _case(1, 1, 1, 16384, 16384, 64, False, F16),
    # Short and awkward lengths, seqlen_q != seqlen_k (bottom-right causal, rows with no key).
    *[_case(3, 2, 2, n, n, 64, True, BF16) for n in (1, 17, 113)],
    _case(1, 4, 4, 1000, 3000, 128, True, F16),
    _case(1, 4, 4, 3000, 1000, 64, True, BF16),
    _case(1, 4, 4, 1, 2049, 64, True, F16),
    _case(1, 4, 4, 2049, 1, 128, True, BF16),
    _case(1, 4, 4, 700, 1500, 64, False, BF16),
    # Head dims that are not powers of two.
    _case(2, 4, 4, 1000, 1000, 80, True, F16),
    _case(2, 4, 4, 1000, 1000, 96, False, BF16),
    _case(2, 4, 4, 1000, 1000, 40, True, BF16),
    # Two column tiles in the forward (ops._head_tiles): 48 = 32 + 16, 160 = 128 + 32, 192 = 128 + 64; and 72,
    # which takes one tile of 128 (a second tile 64 + 16 would run past the head dim).
    _case(2, 4, 4, 1000, 1000, 48, True, BF16),
    _case(2, 4, 4, 1000, 1000, 72, True, BF16),
    _case(1, 4, 4, 2048, 2048, 160, True, F16),
    _case(1, 4, 4, 1500, 1500, 192, False, BF16),
    _case(2, 8, 2, 1023, 1023, 96, True, BF16, "bnhd"),
    _case(1, 2, 2, 1000, 1000, 96, True, F32),
    # d = 96's own blocks: a short causal forward (64 x 32 up to 1k keys) and a prefill-shaped backward whose dQ
    # grid is under two waves (64 x 32 dQ blocks; kernels.SMALL_GRID_LIMIT).
    _case(4, 4, 4, 256, 256, 96, True, F16),
    _case(1, 4, 4, 256, 2048, 96, False, BF16),
    _case(1, 4, 1, 300, 4000, 96, True, F16),
    # Grouped-query / multi-query attention, non-contiguous (B, N, H, D) storage.
    _case(2, 8, 2, 1023, 1023, 128, True, BF16),
    _case(1, 8, 1, 2000, 2000, 64, False, F16),
    _case(2, 8, 2, 1000, 1000, 64, True, F16, "bnhd"),
    _case(1, 6, 3, 777, 1111, 128, True, BF16, "bnhd"),
    # float32 inputs: exact float32 products ("ieee"), judged against PyTorch's float32 attention.
    _case(1, 2, 2, 1000, 1000, 64, True, F32),
    _case(1, 4, 2, 333, 555, 128, False, F32, "bnhd"),
]


def _report(name, report):
    path = os.environ.get("FA_LIB_GPU_REPORT")
    if path:
        line = {"case": name, **{k: {"err": e, "base": b, "ratio": r} for k, (e, b, r) in report.items()}}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def _seed(*params):
    return zlib.crc32(repr(params).encode())


def _check(request, q, k, v, do, *, causal, softmax_scale=None, dlse=None):
    forward_backward(q, k, v, do, causal=causal, softmax_scale=softmax_scale)  # let the autotuner settle
    out = forward_backward(q, k, v, do, causal=causal, softmax_scale=softmax_scale, dlse=dlse)  # poisoned
    gold = reference_forward_backward(q, k, v, do, causal=causal, softmax_scale=softmax_scale, upcast=True, dlse=dlse)
    base = reference_forward_backward(q, k, v, do, causal=causal, softmax_scale=softmax_scale, upcast=False,
                                      dlse=dlse)
    try:
        report = assert_flash_rule(out, gold, base)
    finally:
        del gold, base
        torch.cuda.empty_cache()
    _report(request.node.name, report)
    return out


@pytest.mark.parametrize("batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype, layout", CASES)
def test_flash_attention_matches_reference_gpu(request, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim,
                                               causal, dtype, layout):
    seed = _seed(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype, layout)
    q, k, v, do = make_inputs(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, "cuda", seed=seed,
                              layout=layout)
    out = _check(request, q, k, v, do, causal=causal)
    assert out["o"].shape == (batch, heads_q, seqlen_q, head_dim) and out["o"].dtype == dtype
    assert out["dk"].shape == k.shape and out["dv"].dtype == dtype


def test_rows_without_visible_key_gpu(request):
    # causal, N_q = 1500 > N_k = 500: rows 0..999 see no key.
    q, k, v, do = make_inputs(1, 4, 2, 1500, 500, 128, BF16, "cuda", seed=11)
    out = _check(request, q, k, v, do, causal=True)
    assert torch.all(out["o"][:, :, :1000] == 0)
    assert torch.all(out["lse"][:, :, :1000] == float("-inf"))
    assert torch.all(torch.isfinite(out["lse"][:, :, 1000:]))
    assert torch.all(out["dq"][:, :, :1000] == 0)


def test_lse_is_differentiable_gpu(request):
    q, k, v, do = make_inputs(2, 4, 2, 1000, 1200, 64, F16, "cuda", seed=12)
    dlse = torch.randn(2, 4, 1000, generator=torch.Generator().manual_seed(13)).cuda()
    _check(request, q, k, v, do, causal=True, dlse=dlse)


def test_custom_softmax_scale_gpu(request):
    q, k, v, do = make_inputs(2, 4, 4, 1000, 1000, 128, BF16, "cuda", seed=14)
    _check(request, q, k, v, do, causal=False, softmax_scale=0.3)


def test_backward_is_deterministic_gpu():
    # GQA: each dK/dV program sums 4 query heads itself; no atomics, so runs agree bit for bit.
    q, k, v, do = make_inputs(2, 8, 2, 2048, 2048, 128, BF16, "cuda", seed=15)
    runs = [forward_backward(q, k, v, do, causal=True) for _ in range(3)]
    for name in ("o", "lse", "dq", "dk", "dv"):
        assert torch.equal(runs[1][name], runs[0][name]) and torch.equal(runs[2][name], runs[0][name]), name


def test_outputs_are_fully_written_gpu():
    # Poisoned outputs must come back free of NaN: a direct check, independent of the error rule.
    q, k, v, do = make_inputs(1, 2, 1, 4111, 3003, 96, F16, "cuda", seed=16)
    testing.forward_backward(q, k, v, do, causal=True)
    out = testing.forward_backward(q, k, v, do, causal=True)
    for name in ("o", "dq", "dk", "dv"):
        assert not torch.isnan(out[name]).any(), name
    assert not torch.isnan(out["lse"]).any()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_launches_run_on_the_inputs_device_gpu():
    # Tensors on cuda:1 while cuda:0 is current: every launch (forward, backward) must run on cuda:1.
    torch.cuda.set_device(0)
    q, k, v, do = make_inputs(1, 4, 2, 777, 777, 64, BF16, "cuda:1", seed=17)
    out = forward_backward(q, k, v, do, causal=True)
    assert torch.cuda.current_device() == 0
    for name, t in out.items():
        assert t.device == torch.device("cuda:1"), name
    gold = reference_forward_backward(q, k, v, do, causal=True, upcast=True)
    base = reference_forward_backward(q, k, v, do, causal=True, upcast=False)
    assert_flash_rule(out, gold, base)
    # The same inputs computed on cuda:0 give the same bits (fixed blocks, same kernels).
    on0 = forward_backward(*(t.detach().to("cuda:0") for t in (q, k, v, do)), causal=True)
    for name in out:
        assert torch.equal(out[name].cpu(), on0[name].cpu()), name


def test_torch_compile_fullgraph_on_gpu():
    # A module calling fa_lib inside torch.compile(fullgraph=True), forward and backward, against eager.
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(512, 3 * 512, dtype=BF16)

        def forward(self, x):
            B, N, C = x.shape
            q, k, v = self.qkv(x).view(B, N, 3, 8, C // 8).permute(2, 0, 3, 1, 4)
            from fa_lib import flash_attention
            return flash_attention(q, k, v, causal=True).transpose(1, 2).reshape(B, N, C)

    torch.manual_seed(0)
    model = Block().cuda()
    x = torch.randn(2, 1000, 512, device="cuda", dtype=BF16)
    eager = model(x)
    eager.float().square().mean().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    got = compiled(x)
    got.float().square().mean().backward()
    torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=5e-2, atol=5e-3)


def test_concurrent_backward_same_bits_any_stream_and_cuda_graph():
    # The kernel option concurrent_backward runs the dQ kernel on a side stream beside the dK/dV kernel: the
    # gradients are the serial ones bit for bit, called from a user's own stream too, and a CUDA graph
    # that captures the forward and backward replays them (the side streams fork from and join the
    # capturing stream).
    from fa_lib import flash_attention, ops

    q, k, v, do = make_inputs(2, 8, 2, 3000, 3000, 128, BF16, "cuda", seed=77)

    def grads():
        for t in (q, k, v):
            t.grad = None
        flash_attention(q, k, v, causal=True, window=(700, -1)).backward(do)
        return [t.grad.clone() for t in (q, k, v)]

    with fa_lib.kernel_options(concurrent_backward=False):
        serial = grads()
    for got, want in zip(grads(), serial):
        assert torch.equal(got, want)
    user = torch.cuda.Stream()
    user.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(user):
        got_user = grads()
    torch.cuda.current_stream().wait_stream(user)
    for got, want in zip(got_user, serial):
        assert torch.equal(got, want)
    static = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        flash_attention(*static, causal=True, window=(700, -1)).backward(do)
    torch.cuda.current_stream().wait_stream(warm)
    for t in static:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flash_attention(*static, causal=True, window=(700, -1)).backward(do)
    for t in static:
        t.grad.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for t, want in zip(static, serial):
        assert torch.equal(t.grad, want)
