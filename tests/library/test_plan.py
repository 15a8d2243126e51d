"""fa_lib.plan: a dense forward's and backward's launches, recorded once per problem and replayed.

The claims: a replay launches what the slow path would have launched on the same call (the same bits out,
every gradient), the key separates every problem the slow path treats differently (shapes, strides, 16-byte
alignment, dtype, options, the module settings), and paths that do other work than launches are never
recorded. Under the interpreter (CI) a replay goes through `launch.launch`; on a GPU (marked `gpu`) through
the compiled kernels directly, the Gluon kernels' TMA descriptors and the backward's second stream included.
"""
import os

import pytest
import torch

import fa_lib
from fa_lib import kernels, ops, plan

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture(autouse=True)
def _fresh_plans():
    plan.clear()
    with fa_lib.kernel_options(plans=True):
        yield
    plan.clear()


def _inputs(b=2, hq=4, hkv=2, nq=40, nk=70, d=32, dtype=torch.float16, seed=0, device=DEVICE):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(device, dtype).requires_grad_()
               for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    return q, k, v


def _step(q, k, v, lse_too=False, **kw):
    """Forward and backward: (o, lse, dq, dk, dv), with the LSE differentiated too when `lse_too`."""
    o, lse = fa_lib.flash_attention(q, k, v, return_lse=True, **kw)
    loss = o.float().square().sum() + (lse.sum() if lse_too else 0)
    wrt = [t for t in (q, k, v) if t.requires_grad]
    return (o, lse, *torch.autograd.grad(loss, wrt))


def _slow(*args, **kw):
    with fa_lib.kernel_options(plans=False):
        return _step(*args, **kw)


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
        assert torch.equal(x, y)


CASES = [
    dict(),
    dict(causal=True),
    dict(causal=True, lse_too=True),
    dict(window=(8, 3)),
    dict(softcap=20.0, causal=True),
    dict(softmax_scale=0.3),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_replay_gives_the_slow_paths_bits(kw):
    q, k, v = _inputs()
    want = _slow(q, k, v, **kw)
    first = _step(q, k, v, **kw)  # records the forward and the backward
    assert plan.info()["recorded"] == 2 and plan.info()["replayed"] == 0
    q2, k2, v2 = _inputs(seed=1)  # other tensors of the same problem: their own results, not the recorded ones
    again = _step(q2, k2, v2, **kw)
    assert plan.info()["replayed"] == 2 and plan.info()["recorded"] == 2
    _same(first, want)
    _same(again, _slow(q2, k2, v2, **kw))


def test_replay_of_views_dtypes_and_partial_gradients():
    # (B, N, H, D) storage viewed as (B, H, N, D); float32; only dq needed; GQA with one KV head.
    base = [t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in _inputs()]
    for q, k, v in (base, _inputs(dtype=torch.float32), _inputs(hq=6, hkv=1, nq=17, nk=17)):
        want = _slow(q, k, v, causal=True)
        _same(_step(q, k, v, causal=True), want)
        _same(_step(q, k, v, causal=True), want)
    q, k, v = _inputs()
    k.requires_grad_(False)
    v.requires_grad_(False)
    want = _slow(q, k, v)
    for _ in range(2):
        _same(_step(q, k, v), want)
    assert plan.info()["replayed"] == 8


def test_the_key_separates_problems():
    q, k, v = _inputs()
    _step(q, k, v)
    n = plan.info()["plans"]
    variants = [
        _inputs(nq=41),  # another length
        [t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)],  # strides
        _inputs(dtype=torch.bfloat16),  # dtype
    ]
    # A data pointer 2 bytes past a 16-byte boundary: Triton and TMA specialise on that alignment.
    flat = torch.randn(q.numel() + 1, dtype=q.dtype, device=q.device)
    variants.append((flat[1:].view(q.shape).requires_grad_(), k, v))
    for qq, kk, vv in variants:
        want = _slow(qq, kk, vv)
        _same(_step(qq, kk, vv), want)
    assert plan.info()["plans"] == n + 2 * len(variants) and plan.info()["replayed"] == 0
    for opts in (dict(causal=True), dict(softmax_scale=0.5), dict(window=(4, 4))):
        before = plan.info()["plans"]
        _step(q, k, v, **opts)
        assert plan.info()["plans"] == before + 2, opts


def test_other_kernel_options_never_replay_a_plan(kernel_opts):
    q, k, v = _inputs(d=48)
    _step(q, k, v)
    assert plan.info()["plans"] == 2
    kernel_opts(split_head_dim=False)  # d = 48 would have taken two column tiles (32 + 16)
    want = _slow(q, k, v)
    _same(_step(q, k, v), want)  # recorded anew under these options: a plan of its own
    assert plan.info()["plans"] == 4 and plan.info()["replayed"] == 0
    _same(_step(q, k, v), want)
    assert plan.info()["replayed"] == 2


def test_paths_that_are_not_only_launches_are_not_recorded():
    q, k, v = _inputs(b=2, nk=24)
    mask = torch.ones(2, 24, dtype=torch.bool, device=q.device)
    mask[1, 20:] = False
    for _ in range(2):
        fa_lib.flash_attention(q, k, v, key_padding_mask=mask).sum().backward()  # its bounds: torch ops
    assert plan.info() == dict(recorded=0, replayed=0, declined=0, plans=0)
    x = _inputs(hq=2, hkv=2, nq=24, nk=24)[0]  # q is k is v: a replay could not tell the three apart
    for _ in range(2):
        fa_lib.flash_attention(x, x, x)
    assert plan.info()["plans"] == 0 and plan.info()["declined"] == 2
    q2, k2, v2 = _inputs(hq=2, hkv=2, nq=24, nk=24, seed=3)
    _same(_step(q2, k2, v2), _slow(q2, k2, v2))


def test_a_slow_path_that_raises_records_nothing(monkeypatch):
    q, k, v = _inputs()

    def broken(*a, **kw):
        raise RuntimeError("no launch")

    monkeypatch.setattr(ops, "_forward_launch", broken)
    with pytest.raises(RuntimeError, match="no launch"):
        fa_lib.flash_attention(q, k, v)
    assert plan._REC is None and plan.info()["plans"] == 0


def test_bad_input_is_refused_on_a_recorded_problem():
    q, k, v = _inputs()
    _step(q, k, v)
    with pytest.raises(TypeError, match="k has dtype"):
        fa_lib.flash_attention(q, k.double(), v)
    with pytest.raises(ValueError, match="softmax_scale"):
        fa_lib.flash_attention(q, k, v, softmax_scale=-1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d,causal,nq,nk", [(128, False, 256, 256), (128, True, 4096, 4096), (64, True, 512, 8192),
                                            (96, True, 256, 256), (256, True, 1024, 1024)])
def test_gpu_replay_gives_the_slow_paths_bits(d, causal, nq, nk):
    """On the H200 these take the Gluon forward and dK/dV kernels (d = 128, 256), the prefill route (d = 64,
    not recorded), the teaching kernels with two column tiles (d = 96) and the dQ kernel on the second stream."""
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = _inputs(b=2, hq=8, hkv=2, nq=nq, nk=nk, d=d, dtype=dtype)
        want = _slow(q, k, v, causal=causal)
        _step(q, k, v, causal=causal)
        before = plan.info()["replayed"]
        q2, k2, v2 = _inputs(b=2, hq=8, hkv=2, nq=nq, nk=nk, d=d, dtype=dtype, seed=5)
        again = _step(q2, k2, v2, causal=causal)
        torch.cuda.synchronize()
        _same(_step(q, k, v, causal=causal), want)
        _same(again, _slow(q2, k2, v2, causal=causal))
        recorded = 0 if (d == 64 and nq < nk) else 1  # the prefill route's forward is not recorded
        assert plan.info()["replayed"] - before == 2 * (recorded + 1)
