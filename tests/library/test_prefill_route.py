"""The prefill route of `flash_attention`'s forward (`ops._prefill_forward`): fewer queries than keys on a grid
that would not fill the GPU, at the head dims and masks of the kernel option `prefill_split`, runs on the decoding path's split
kernel (`decode._attend`). CPU part: the route is never taken off a CUDA device or under the interpreter. GPU part
(marked ``gpu``): taken exactly where it should be, the flash-attn 2x rule forward and backward (the backward
reads the route's LSE), the teaching forward's answer to rounding, bit-stable and CUDA-graph capturable."""
import os

import pytest
import torch

import fa_lib.options
from fa_lib import ops
from fa_lib.testing import assert_flash_rule, forward_backward, make_inputs, reference_forward_backward
from kernel_cases import BF16, F16

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def _routed(q, k, causal=False, **masks):
    pb = ops._Problem(q, causal, masks.get("window", (-1, -1)), masks.get("softcap", 0.0),
                      masks.get("key_padding_mask"), n_q=q.shape[2], n_k=k.shape[2], batch=q.shape[0])
    return ops._prefill_forward(q, k, ops._like(q), pb)


def _no_gluon_forward(kernel_opts):
    """The route's own forward at d = 256 too: on sm_90 `ops._forward` asks the Gluon forward first, and it takes
    d = 256 (where it is the faster); off, the route is what runs, as on devices that kernel cannot run on."""
    if ops.kernels_hopper is not None:
        kernel_opts(hopper_forward="never")


def test_the_route_is_where_it_was_measured_faster():
    assert fa_lib.options.DEFAULT.prefill_split == ((64, (False, True)), (256, (True,))) and ops.PREFILL_BLOCK_M == 64


@pytest.mark.parametrize("bad", [None, {64: True}, {"64": (True,)}, {64: (1,)}])
def test_a_bad_route_setting_is_named(bad, kernel_opts):
    with pytest.raises(ValueError, match="prefill_split must be a dict"):
        kernel_opts(prefill_split=bad)


def test_never_routed_off_a_cuda_device(kernel_opts):
    q, k, _, _ = make_inputs(1, 2, 2, 16, 64, 64, BF16, "cpu", seed=0)
    assert not _routed(q, k) and not _routed(q, k, causal=True)


CASES = [  # (B, Hq, Hkv, Nq, Nk, D, causal, dtype, layout)
    (2, 8, 8, 512, 8192, 256, True, BF16, "bhnd"), (1, 8, 2, 300, 5000, 256, True, F16, "bnhd"),
    (2, 8, 8, 512, 8192, 64, False, BF16, "bhnd"), (1, 4, 1, 1, 777, 64, True, F16, "bhnd"),
    (3, 4, 4, 100, 1000, 64, True, BF16, "bnhd"), (2, 4, 2, 129, 130, 64, False, F16, "bhnd"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype, layout", CASES)
def test_prefill_route_flash_rule_gpu(kernel_opts, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal,
                                      dtype, layout):
    _no_gluon_forward(kernel_opts)
    q, k, v, do = make_inputs(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, "cuda",
                              seed=seqlen_q + seqlen_k, layout=layout)
    assert _routed(q, k, causal=causal)
    out = forward_backward(q, k, v, do, causal=causal)  # outputs poisoned (NaN) before the launch
    gold = reference_forward_backward(q, k, v, do, causal=causal, upcast=True)
    base = reference_forward_backward(q, k, v, do, causal=causal, upcast=False)
    assert_flash_rule(out, gold, base)
    kernel_opts(prefill_split={})
    assert not _routed(q, k, causal=causal)
    teach = forward_backward(q, k, v, do, causal=causal)
    tol = 2e-2 if dtype == BF16 else 4e-3
    assert (out["o"].float() - teach["o"].float()).abs().max().item() <= tol
    assert (out["lse"] - teach["lse"]).abs().max().item() <= 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_prefill_route_only_where_it_should_be_gpu():
    q, k, v, _ = make_inputs(2, 8, 8, 512, 8192, 64, BF16, "cuda", seed=1)
    assert _routed(q, k) and _routed(q, k, causal=True)
    assert not _routed(q, k, window=(128, -1)) and not _routed(q, k, softcap=30.0)
    assert not _routed(q, k, key_padding_mask=torch.ones(2, 8192, dtype=torch.bool, device="cuda"))
    assert not _routed(k, k)  # as many queries as keys
    q_big, _, _, _ = make_inputs(4, 8, 8, 512, 8192, 64, BF16, "cuda", seed=2)  # 256 programs: not a small grid
    assert not _routed(q_big, k[:1].expand(4, -1, -1, -1))
    for d, causal in ((256, False), (128, True), (96, True)):
        q2, k2, _, _ = make_inputs(1, 8, 8, 512, 8192, d, BF16, "cuda", seed=3)
        assert not _routed(q2, k2, causal=causal), (d, causal)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_prefill_route_is_bit_stable_and_graph_capturable_gpu(kernel_opts):
    _no_gluon_forward(kernel_opts)
    q, k, v, _ = make_inputs(1, 8, 2, 300, 5000, 256, BF16, "cuda", seed=4)
    assert _routed(q, k, causal=True)
    runs = [ops._forward(q, k, v, True, 256 ** -0.5) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        o, lse = ops._forward(q, k, v, True, 256 ** -0.5)
    o.fill_(float("nan"))
    lse.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, runs[0][0]) and torch.equal(lse, runs[0][1])
