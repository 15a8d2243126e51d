"""fa_lib.launch: the launch cache that skips Triton's per-call argument binding.

Its claim: every kernel Triton would pick for a launch is a function of `launch.signature_key`, and the
arguments it appends after `args` are the ones Triton binds. Checked on CPU against Triton's own binder
(`create_function_from_signature` for an sm_90 target, the function `JITFunction.run` calls) on the
launches fa_lib's forward, backward and decoding make: calls with the same key (other tensors of the same
dtype and 16-byte alignment, other float values) get the same specialisation; and the key separates what
Triton does specialise on. On a GPU (marked `gpu`): the cached launch gives the bits of `kernel[grid]`.
"""
import os

import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

import fa_lib
from fa_lib import decode, kernels, launch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if ON_GPU else "cpu"


def _twin(kernel):
    """The JITFunction of a kernel: itself on a GPU, rebuilt from the source under the interpreter."""
    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, **kernel.kwargs)


_BINDERS = {}


def _bind(kernel, args, kwargs):
    """Triton's (bound parameters, specialisation, options) for this call, as `JITFunction.run` gets them."""
    twin = _twin(kernel)
    if kernel not in _BINDERS:
        _BINDERS[kernel] = (twin, create_function_from_signature(twin.signature, twin.params,
                                                                 make_backend(GPUTarget("cuda", 90, 32))))
    twin, binder = _BINDERS[kernel]
    return twin, binder(*args, **kwargs, debug=False, instrumentation_mode="")


def _recorded_launches():
    """(kernel, grid, args, kwargs) of every launch of a forward + backward (causal, GQA, d = 72, bf16 and
    float32), a masked and windowed forward, and two decoding steps (split, with an append)."""
    calls = []
    real = launch.launch

    def record(kernel, grid, args, kwargs):
        calls.append((kernel, grid, args, dict(kwargs)))
        return real(kernel, grid, args, kwargs)

    g = torch.Generator().manual_seed(0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "launch", record)
        for dtype in (torch.bfloat16, torch.float32):
            q = torch.randn(1, 4, 40, 72, generator=g).to(DEVICE, dtype).requires_grad_()
            k, v = (torch.randn(1, 2, 40, 72, generator=g).to(DEVICE, dtype).requires_grad_() for _ in "kv")
            fa_lib.flash_attention(q, k, v, causal=True).sum().backward()
        q, k, v = (torch.randn(2, 2, 24, 32, generator=g).to(DEVICE, torch.float16) for _ in "qkv")
        mask = torch.ones(2, 24, dtype=torch.bool, device=DEVICE)
        mask[1, 20:] = False
        fa_lib.flash_attention(q, k, v, window=(8, 4), key_padding_mask=mask)
        qd = torch.randn(2, 4, 1, 64, generator=g).to(DEVICE, torch.bfloat16)
        kc, vc = (torch.randn(2, 2, 96, 64, generator=g).to(DEVICE, torch.bfloat16) for _ in "kv")
        lens = torch.tensor([5, 90], dtype=torch.int32, device=DEVICE)
        kn, vn = (torch.randn(2, 2, 1, 64, generator=g).to(DEVICE, torch.bfloat16) for _ in "kv")
        with torch.no_grad():
            fa_lib.flash_attention_with_kvcache(qd, kc, vc, cache_seqlens=lens, num_splits=3)
            fa_lib.flash_attention_with_kvcache(qd, kc, vc, cache_seqlens=lens, k=kn, v=vn, num_splits=2)
            with fa_lib.kernel_options(decode_fused_merge=False):  # the separate combine kernel too
                fa_lib.flash_attention_with_kvcache(qd, kc, vc, cache_seqlens=lens, num_splits=3)
    return calls


@pytest.fixture(scope="module")
def launches():
    return _recorded_launches()


def _same_key_args(args, seed):
    """`args` with every tensor replaced by a different tensor of the same dtype and 16-byte alignment (other
    shape, storage, strides) and every float by another float: what `signature_key` cannot tell apart."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            n = int(torch.randint(8, 200, (), generator=g))
            base = torch.zeros(n + 64, dtype=a.dtype, device=a.device)
            start = 0
            while (base[start:].data_ptr() % 16 == 0) != (a.data_ptr() % 16 == 0):
                start += 1
            start += (16 // base.element_size()) * int(torch.randint(0, 3, (), generator=g))
            out.append(base[start:start + n])
        elif type(a) is float:
            out.append(float(torch.rand((), generator=g)) * 7 + 0.5)
        else:
            out.append(a)
    return tuple(out)


def test_recorded_every_kernel(launches):
    names = {k.__name__ if hasattr(k, "__name__") else k.fn.__name__ for k, *_ in launches}
    assert {"_attn_fwd", "_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq", "_decode_split",
            "_decode_combine"} <= names


def test_bound_tail_is_what_triton_binds(launches):
    for kernel, grid, args, kwargs in launches:
        twin, (bound, _, _) = _bind(kernel, args, kwargs)
        assert launch.bound_tail(twin.params, len(args), kwargs) == tuple(list(bound.values())[len(args):])
        assert len(args) + len(launch.bound_tail(twin.params, len(args), kwargs)) == len(twin.params)


def test_equal_keys_get_triton_s_specialisation(launches):
    for i, (kernel, grid, args, kwargs) in enumerate(launches):
        key = launch.signature_key(args, kwargs)
        assert key is not None
        _, (_, spec, options) = _bind(kernel, args, kwargs)
        for seed in range(3):
            other = _same_key_args(args, 100 * i + seed)
            assert launch.signature_key(other, kwargs) == key
            _, (_, spec_other, options_other) = _bind(kernel, other, kwargs)
            assert spec_other == spec
            assert options_other == options


def test_key_separates_what_triton_specialises_on(launches):
    """Triton's specialisation does change with a pointer's alignment and an int's divisibility by 16 and
    value 1 (so the test above could fail), and the key changes with it."""
    kernel, grid, args, kwargs = next(c for c in launches if c[0] is kernels._attn_fwd)
    _, (_, spec, _) = _bind(kernel, args, kwargs)
    pos_t = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.data_ptr() % 16 == 0)
    misaligned = list(args)
    base = torch.zeros(64, dtype=args[pos_t].dtype, device=args[pos_t].device)
    misaligned[pos_t] = base[1:]
    _, (_, spec_m, _) = _bind(kernel, tuple(misaligned), kwargs)
    assert spec_m != spec
    assert launch.signature_key(tuple(misaligned), kwargs) != launch.signature_key(args, kwargs)
    twin = _twin(kernel)
    specialised = [i for i, a in enumerate(args) if type(a) is int and not twin.params[i].do_not_specialize]
    assert specialised
    for value in (1, 16, 17):
        changed = list(args)
        changed[specialised[0]] = value
        _, (_, spec_c, _) = _bind(kernel, tuple(changed), kwargs)
        assert launch.signature_key(tuple(changed), kwargs) != launch.signature_key(args, kwargs) or \
            args[specialised[0]] == value
        if value == 1:
            assert spec_c[specialised[0]] == ("constexpr", 1)


def test_signature_key_refuses_unknown_argument_kinds():
    import numpy as np
    assert launch.signature_key((np.int64(3),), {}) is None
    assert launch.signature_key((1, True, None, 2.0), {"A": 1}) == ((1, (True,), None, float), (("A", 1),))
    assert launch.signature_key((True,), {}) != launch.signature_key((1,), {})


def test_fast_path_allowed_by_default_and_not_with_a_hook():
    """Triton 3.6's launch hooks are HookChain objects, empty by default (not None): the cached launch must
    recognise them as no hook, and give way to Triton's run() (which calls the hook) once one is added."""
    from triton import knobs
    assert launch._fast_ok()

    def hook(metadata):
        pass
    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton has no HookChain")
    chain.add(hook)
    try:
        assert not launch._fast_ok()
    finally:
        chain.remove(hook)
    assert launch._fast_ok()


def test_interpreter_always_goes_through_triton():
    if ON_GPU:
        pytest.skip("interpreter only")
    launch.clear_cache()
    q = torch.randn(1, 1, 16, 16)
    fa_lib.flash_attention(q, q, q)
    info = launch.cache_info()
    assert info["hits"] == info["misses"] == 0 and info["slow"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_cached_launch_same_bits_gpu():
    """Forward + backward and decoding: the second call (a cache hit) gives the bits of kernel[grid]."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 300, 128, generator=g).cuda().bfloat16().requires_grad_()
    k, v = (torch.randn(2, 2, 300, 128, generator=g).cuda().bfloat16().requires_grad_() for _ in "kv")
    qd = torch.randn(1, 32, 1, 128, generator=g).cuda().bfloat16()
    kc, vc = (torch.randn(1, 8, 4096, 128, generator=g).cuda().bfloat16() for _ in "kv")
    lens = torch.tensor([4000], dtype=torch.int32, device="cuda")

    def step():
        o = fa_lib.flash_attention(q, k, v, causal=True)
        grads = torch.autograd.grad(o.float().square().sum(), (q, k, v))
        with torch.no_grad():
            od = fa_lib.flash_attention_with_kvcache(qd, kc, vc, cache_seqlens=lens)
        return (o, *grads, od)

    with fa_lib.kernel_options(cached_launch=False):
        slow = step()
    launch.clear_cache()
    first = step()
    hits_before = launch.cache_info()["hits"]
    second = step()
    assert launch.cache_info()["hits"] > hits_before
    for a, b, c in zip(slow, first, second):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_gluon_descriptor_key_is_triton_s_specialisation():
    """The Hopper forward (a Gluon kernel) takes host TMA descriptors: Triton specialises one on its type
    (dtype, block shape, shared layout) and passes shape and strides at run time, so descriptors of other
    batch sizes and strides (the integer arguments kept equal: the key holds those by value) share a key
    and a specialisation, and another dtype or block changes both."""
    from fa_lib import ops
    kh = ops.kernels_hopper
    if kh is None:
        pytest.skip("this Triton has no Gluon Hopper API")
    kernel = kh._attn_fwd_ws
    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    kwargs = dict(CAUSAL=True, BLOCK_M=128, BLOCK_N=128, HEAD_DIM=128, STAGES=2, CONSUMER_REGS=240, num_warps=4,
                  maxnreg=168)

    def args(B, H, N, dtype, view=False):
        buf = torch.zeros(B, N, H, 128, dtype=dtype)
        q = buf.transpose(1, 2) if view else buf.view(B, H, N, 128)
        lse = torch.zeros(B, H, N)
        qb, ql, kb, kl = kh._blocks(dtype, 128)
        return (kh._desc(q, qb, ql), kh._desc(q, kb, kl), kh._desc(q, kb, kl), kh._desc(q, qb, ql), lse, 0.125,
                N, N, H, 1, 4, lse.stride(0), lse.stride(1), q, 0, 0, 0)

    def bound(a):
        _, spec, options = binder(*a, **kwargs, debug=False, instrumentation_mode="")
        return spec, options

    first = args(1, 2, 300, torch.bfloat16)
    key = launch.signature_key(first, kwargs)
    assert key is not None
    for other in (args(2, 2, 300, torch.bfloat16), args(3, 2, 300, torch.bfloat16, view=True)):
        assert launch.signature_key(other, kwargs) == key
        assert bound(other) == bound(first)
    half = args(1, 2, 300, torch.float16)
    assert launch.signature_key(half, kwargs) != key and bound(half)[0][:4] != bound(first)[0][:4]
    swapped = (first[1],) + first[1:]  # a K/V-shaped block where Q's goes
    assert launch.signature_key(swapped, kwargs) != key and bound(swapped)[0][0] != bound(first)[0][0]
