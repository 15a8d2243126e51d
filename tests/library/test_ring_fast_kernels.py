"""The ring of `fa_lib.context_parallel` on the fast kernels: the sm_90 Gluon forward, dK/dV and dQ kernels write the
ring's float32 partial results (unrounded, merged or summed later), and `ring_on_one_device` (the ring's arithmetic
for W ranks on one GPU) stays within the precision of the ring on the portable kernels. GPU only (`make gpu-test`);
the bit-for-bit agreement of `ring_on_one_device` with a real ring runs on CPU in test_context_parallel.py."""
import pytest
import torch

from fa_lib import context_parallel as cp
from benchmarks.cp_precision import gluon_launches
from fa_lib import kernel_options, kernels_hopper, ops

CUDA = torch.cuda.is_available()
SM90 = CUDA and torch.cuda.get_device_capability() == (9, 0) and kernels_hopper is not None
ALWAYS = dict(hopper_forward="always", hopper_backward="always", hopper_dq="always")
NEVER = dict(hopper_forward="never", hopper_backward="never", hopper_dq="never")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU and Triton's Gluon (run `make gpu-test` there)")]


def _inputs(b, hq, hkv, n, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, do = (torch.randn(b, hq, n, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, hkv, n, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, do


def _reference64(q, k, v, do, causal):
    """(o, lse, dq, dk, dv) in float64, dense (small n)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        n_q, n_k = s.shape[-2:]
        s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).triu(n_k - n_q + 1), float("-inf"))
    o = torch.softmax(s, -1) @ v.repeat_interleave(group, 1)
    o.backward(do.double())
    return o.detach(), torch.logsumexp(s, -1).detach(), q.grad, k.grad, v.grad


def _errors(got, gold):
    return [float((g.double() - r).abs().max()) for g, r in zip(got, gold)]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [4, 1])
def test_gluon_kernels_write_float32_partials(d, causal, hkv):
    """ops._forward / _backward with float32 outputs take the Gluon kernels, and their float32 results are as close
    to float64 attention as the portable kernels' (the same products; only the summation order differs)."""
    q, k, v, do = _inputs(2, 4, hkv, 1000, d)  # 1000: a partial last tile of queries and of keys
    gold = _reference64(q, k, v, do, causal)
    scale = d ** -0.5
    runs = {}
    for name, opts in (("fast", ALWAYS), ("portable", NEVER)):
        with kernel_options(**opts), gluon_launches() as calls:
            o, lse = ops._forward(q, k, v, causal, scale, out_dtype=torch.float32)
            neg_delta, zero_o = cp._delta_inputs(do, o)
            dq, dk, dv = ops._backward(do, neg_delta, q, k, v, zero_o, lse, causal, scale, grad_dtype=torch.float32)
        assert all(t.dtype == torch.float32 for t in (o, dq, dk, dv))
        runs[name] = _errors((o, lse, dq, dk, dv), gold)
        assert calls == ({"forward": 1, "backward_dkdv": 1, "backward_dq": 1} if name == "fast" else
                         {"forward": 0, "backward_dkdv": 0, "backward_dq": 0}), (name, calls)
    fast, portable = runs["fast"], runs["portable"]
    for name, e_fast, e_portable in zip(("o", "lse", "dq", "dk", "dv"), fast, portable):
        assert e_fast <= 2 * e_portable + 1e-5, (name, fast, portable)
    # float32 partials: far below a bf16 rounding of o (2^-9 relative)
    assert fast[0] < 2.0 ** -9 * float(gold[0].abs().max()), fast


@pytest.mark.parametrize("world, layout", [(2, "zigzag"), (4, "zigzag"), (2, "contiguous")])
def test_ring_on_the_fast_kernels_keeps_its_precision(world, layout):
    """The W-rank ring's arithmetic (`ring_on_one_device`) on the Gluon kernels against float64 attention: within 2x
    the error of the same ring on the portable kernels (flash-attn's rule, the portable ring as the baseline)."""
    q, k, v, do = _inputs(1, 4, 2, 4096, 128, seed=1)
    gold = _reference64(q, k, v, do, True)
    with kernel_options(**ALWAYS), gluon_launches() as calls:
        fast = _errors(cp.ring_on_one_device(q, k, v, world, causal=True, layout=layout, do=do), gold)
    assert calls["forward"] > 0 and calls["backward_dkdv"] > 0 and calls["backward_dq"] > 0, calls
    with kernel_options(**NEVER):
        portable = _errors(cp.ring_on_one_device(q, k, v, world, causal=True, layout=layout, do=do), gold)
    for name, e_fast, e_portable in zip(("o", "lse", "dq", "dk", "dv"), fast, portable):
        assert e_fast <= 2 * e_portable + 1e-5, (name, fast, portable)
