"""Decoding with a KV cache: fa_lib.flash_attention_with_kvcache (split-KV + combine) and its NumPy mirror.

The kernel tests run under the Triton interpreter on CPU in CI (small shapes: ragged lengths including 0
and N_max, appends, GQA, every split count from 1 to more than the number of key blocks) and, marked
`gpu`, at decoding sizes on a CUDA device. Correctness is judged by the flash-attn 2x rule against a
float64 reference (fa_lib.testing).
"""
import math
import os

import numpy as np
import pytest
import torch

import fa_lib
from fa_lib import decode, reference
from fa_lib.testing import assert_flash_rule, attention_ref, device_work
from kernel_cases import BF16, F16, F32

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if ON_GPU else "cpu"


def _inputs(b, hq, hkv, nq, n_max, d, dtype, lens, n_new, seed, device=DEVICE):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    q = mk(b, hq, nq, d)
    k_cache, v_cache = mk(b, hkv, n_max, d), mk(b, hkv, n_max, d)
    k, v = (mk(b, hkv, n_new, d), mk(b, hkv, n_new, d)) if n_new else (None, None)
    return q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32, device=device), k, v


def _decode_ref(q, k_cache, v_cache, lens_after, causal, upcast, **masks):
    """o, lse of each sequence over its valid keys, by fa_lib.testing.attention_ref (float64 if upcast);
    `masks`: its window and softcap."""
    dt = torch.float64 if upcast else q.dtype
    o = torch.zeros(q.shape, dtype=dt, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float64 if upcast else torch.float32, device=q.device)
    for b, n in enumerate(lens_after):
        if n == 0:
            continue  # no key at all: o = 0, LSE = -inf
        ob, lb = attention_ref(q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n], causal=causal,
                               upcast=upcast, **masks)
        o[b], lse[b] = ob[0], lb[0]
    return dict(o=o, lse=lse)


def _check(dtype, hq, hkv, nq, n_max, d, lens, n_new, causal, splits, seed, **masks):
    q, k_cache, v_cache, seqlens, k, v = _inputs(len(lens), hq, hkv, nq, n_max, d, dtype, lens, n_new, seed)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    o, lse = fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k=k, v=v,
                                                 causal=causal, num_splits=splits, return_lse=True, **masks)
    # The append: exactly the new rows changed, at each sequence's position.
    for b, n in enumerate(lens):
        if n_new:
            assert torch.equal(k_cache[b, :, n:n + n_new], k[b]) and torch.equal(v_cache[b, :, n:n + n_new], v[b])
        keep = torch.ones(n_max, dtype=torch.bool)
        keep[n:n + n_new] = False
        assert torch.equal(k_cache[b, :, keep], before_k[b, :, keep])
        assert torch.equal(v_cache[b, :, keep], before_v[b, :, keep])
    after = [n + n_new for n in lens]
    gold = _decode_ref(q, k_cache, v_cache, after, causal, upcast=True, **masks)
    base = _decode_ref(q, k_cache, v_cache, after, causal, upcast=False, **masks)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    assert_flash_rule(dict(o=o, lse=lse), gold, base, names=("o", "lse"))
    return dict(o=o, lse=lse)


# ---------------------------------------------------------------------------------------------------
# The kernel, under the interpreter (CI) or on the GPU at the same small sizes.
# ---------------------------------------------------------------------------------------------------
# Key blocks are 16 wide under the interpreter: N_max = 70 has 5 blocks, so 7 splits leaves some empty.
@pytest.mark.parametrize("splits", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("causal", [True, False])
def test_every_split_count_matches_the_reference(splits, causal):
    _check(F16, 4, 2, 3, 70, 32, [0, 1, 33, 68], 2, causal, splits, seed=splits + 10 * causal)


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
@pytest.mark.parametrize("hq, hkv, nq", [(4, 4, 1), (8, 2, 1), (4, 1, 5), (6, 3, 20)])
def test_dtypes_gqa_and_query_counts(dtype, hq, hkv, nq):
    _check(dtype, hq, hkv, nq, 50, 24, [50, 17, 0], 0, True, 3, seed=hq * 7 + nq)


def test_append_fills_the_cache_to_n_max_and_queries_see_their_own_keys():
    # Speculative verification: 6 draft tokens appended and attended causally; one sequence ends at N_max.
    _check(F16, 4, 2, 6, 40, 16, [34, 0, 12], 6, True, 4, seed=3)


def test_rows_that_see_no_key_give_zero_and_minus_inf():
    q, k_cache, v_cache, seqlens, _, _ = _inputs(1, 2, 2, 5, 16, 16, F32, [2], 0, seed=4)
    o, lse = fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=2,
                                                 return_lse=True)
    # 5 queries, 2 keys, bottom-right: queries 0..2 see nothing (j <= i - 3), queries 3 and 4 see keys.
    assert torch.all(o[:, :, :3] == 0) and torch.all(torch.isneginf(lse[:, :, :3]))
    assert torch.all(torch.isfinite(lse[:, :, 3:]))


def test_empty_batch_and_no_queries():
    for b, nq in ((0, 1), (2, 0)):
        q, k_cache, v_cache, seqlens, _, _ = _inputs(b, 2, 1, nq, 8, 16, F16, [3] * b, 0, seed=5)
        o, lse = fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, return_lse=True)
        assert o.shape == q.shape and lse.shape == q.shape[:3]


def test_heuristic_split_count_gives_the_same_answer():
    q, k_cache, v_cache, seqlens, _, _ = _inputs(2, 4, 2, 1, 64, 32, F32, [64, 9], 0, seed=6)
    default = fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    one = fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=1)
    torch.testing.assert_close(default, one, rtol=1e-5, atol=1e-5)


def test_the_numpy_mirror_agrees_with_the_kernel():
    q, k_cache, v_cache, seqlens, k, v = _inputs(3, 4, 2, 2, 45, 16, F32, [0, 20, 43], 2, seed=7)
    args = [t.double().cpu().numpy() for t in (q, k_cache, v_cache)]
    o_np, lse_np = reference.kvcache_attention(*args, seqlens.cpu().numpy(), k=k.double().cpu().numpy(),
                                               v=v.double().cpu().numpy(),
                                               num_splits=3, block=16)
    o, lse = fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k=k, v=v, num_splits=3,
                                                 return_lse=True)
    o, lse = o.cpu(), lse.cpu()
    np.testing.assert_allclose(o.double().numpy(), o_np, atol=1e-5)
    assert np.array_equal(np.isneginf(lse.numpy()), np.isneginf(lse_np))
    np.testing.assert_allclose(np.where(np.isneginf(lse_np), 0, lse.double().numpy()),
                               np.where(np.isneginf(lse_np), 0, lse_np), atol=1e-5)
    np.testing.assert_array_equal(k_cache.double().cpu().numpy(), args[1])  # the mirror appended in place too


@pytest.mark.parametrize("hq, hkv, nq, splits, fused", [
    (4, 2, 1, 5, True),  # 2 packed rows, 8 splits' slots: one (2, 8, d) load
    (4, 4, 16, 3, True),  # 16 rows of one head, 4 slots
    (8, 2, 20, 9, False),  # 80 rows, 64 to a tile: four loads of 16 rows, so the combine kernel merges
])
def test_the_split_kernel_merges_its_own_splits_as_the_combine_kernel_does(monkeypatch, hq, hkv, nq, splits, fused, kernel_opts):
    """With few packed rows the last program of each query tile merges the tile's splits (one launch);
    otherwise the combine kernel does. Both agree with each other, and the flash rule holds for both."""
    head_dim = 32
    rows = hq // hkv * nq
    plan = decode._fused_merge(splits, rows, decode._config(head_dim, rows)[0], head_dim)
    assert (plan is not None) == fused
    results = {}
    # Without a fused plan both settings take the combine kernel: one run checks it (the flash rule).
    for on in (True, False) if fused else (True,):
        kernel_opts(decode_fused_merge=on)
        results[on] = _check(F32, hq, hkv, nq, 70, head_dim, [69, 0, 33, 5], 1, True, splits, seed=splits)
    if not fused:
        return
    for name in ("o", "lse"):
        a, b = results[True][name], results[False][name]
        assert torch.equal(torch.isneginf(a), torch.isneginf(b))
        torch.testing.assert_close(torch.where(torch.isneginf(a), 0, a), torch.where(torch.isneginf(b), 0, b),
                                   rtol=1e-6, atol=1e-6)


def test_fused_merge_plan():
    # B = 1, H = 32/8, N_q = 1 on the H200: 15 splits of 4 packed rows, one (4, 16, 128) tile
    assert decode._fused_merge(15, 4, 16, 128) == (16, 4)
    assert decode._fused_merge(1, 4, 16, 128) is None  # one split: the split kernel writes o itself
    assert decode._fused_merge(4, 16, 16, 128) == (4, 16)
    assert decode._fused_merge(16, 16, 16, 128) is None  # four (4, 16, 128) loads: the combine kernel
    assert decode._fused_merge(64, 1, 16, 128) == (64, 1)
    assert decode._fused_merge(65, 1, 16, 128) is None  # 128 slots of 128 > 8192 entries


# ---------------------------------------------------------------------------------------------------
# The split heuristic.
# ---------------------------------------------------------------------------------------------------
def test_heuristic_fills_the_machine_and_respects_its_limits():
    assert decode.num_splits_heuristic(programs=264, n_blocks=1024, sm_count=132) == 1  # already 2 waves
    s = decode.num_splits_heuristic(programs=8, n_blocks=1024, sm_count=132)  # B = 1, 8 KV heads
    assert s == 16  # one wave of 128 programs, 64 blocks each (not 14 or 15, which leave more SMs idle)
    assert decode.num_splits_heuristic(programs=8, n_blocks=3, sm_count=132) == 3  # at most one per block
    assert decode.num_splits_heuristic(programs=16, n_blocks=256, sm_count=132) == 8
    assert decode.num_splits_heuristic(programs=64, n_blocks=128, sm_count=132) == 2  # B = 8, 8 KV heads

    def time(p, n_blocks, s):  # the docstring's wave model, in whole waves x (blocks of a chunk + 2)
        per = math.ceil(n_blocks / s)
        return math.ceil(p * math.ceil(n_blocks / per) / 132) * (per + decode._FIXED_BLOCKS)

    for n_blocks in (8, 100, 1024):
        # t splits of whole blocks leave this many chunks that are not empty
        chunks = [math.ceil(n_blocks / math.ceil(n_blocks / t)) for t in range(1, min(128, n_blocks) + 1)]
        for programs in range(1, 140):
            s = decode.num_splits_heuristic(programs, n_blocks, 132)
            if programs >= 0.8 * 132:
                assert s == 1
            else:
                assert s in chunks  # no empty chunk
                best = min(time(programs, n_blocks, c) for c in chunks)
                assert time(programs, n_blocks, s) == best  # the least modelled time ...
                assert s == min(c for c in chunks if time(programs, n_blocks, c) == best)  # ... fewest chunks
    assert decode.num_splits_heuristic(programs=8, n_blocks=8, sm_count=132) == 8  # not 7: 4 chunks of 2
    for p, n, s_, sms in ((8, 128, 16, 132), (8, 128, 33, 132), (32, 8, 7, 132), (16, 256, 13, 108)):
        assert decode.wave_time(p, n, s_, sms) == (time(p, n, s_) if sms == 132 else 44,
                                                   math.ceil(n / math.ceil(n / s_)))
    assert decode.wave_time(8, 128, 16, 132) == (10, 16) and decode.wave_time(8, 128, 33, 132) == (12, 32)


@pytest.mark.parametrize("kwargs, name", [
    (dict(programs=0, n_blocks=8, num_splits=2, sm_count=132), "programs"),
    (dict(programs=8, n_blocks=0, num_splits=2, sm_count=132), "n_blocks"),
    (dict(programs=8, n_blocks=8, num_splits=2.0, sm_count=132), "num_splits"),
    (dict(programs=8, n_blocks=8, num_splits=2, sm_count=True), "sm_count"),
])
def test_wave_time_names_a_bad_count(kwargs, name):
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
        decode.wave_time(**kwargs)


# ---------------------------------------------------------------------------------------------------
# Bad input: clear errors before any launch.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, error, match", [
    (dict(cache_seqlens=torch.tensor([1, 2], dtype=torch.int64)), TypeError, "cache_seqlens must be a torch.int32"),
    (dict(cache_seqlens=torch.tensor([1], dtype=torch.int32)), ValueError, r"cache_seqlens must have shape \(batch,\)"),
    (dict(cache_seqlens=torch.tensor([1, 16], dtype=torch.int32), n_new=1), ValueError, r"cache_seqlens\[1\] = 16"),
    (dict(cache_seqlens=torch.tensor([-1, 2], dtype=torch.int32)), ValueError, r"cache_seqlens\[0\] = -1"),
    (dict(only_k=True), ValueError, "k and v must be given together"),
    (dict(num_splits=0), ValueError, "num_splits must be a positive int"),
    (dict(num_splits=True), TypeError, "num_splits must be a positive int"),
    (dict(num_splits=2**40), ValueError, r"num_splits must be a positive int \(at most 65536\)"),
    (dict(expanded_cache=True, n_new=1), ValueError, "an expanded view"),
    (dict(hq=3), ValueError, "must be a multiple of k_cache's heads"),
    (dict(requires_grad=True), ValueError, "forward-only"),
    (dict(v_cache_short=True), ValueError, "v_cache must have the shape of k_cache"),
    (dict(check_lengths=1), TypeError, "check_lengths must be a bool"),
    (dict(n_new=17, check_lengths=False), ValueError, "append 17 keys, more than the cache holds"),
    # the flag is checked on every call, not only when rotary tables are given
    (dict(extra=dict(rotary_interleaved="no")), TypeError, "rotary_interleaved must be a bool, got str"),
    (dict(extra=dict(sinks=torch.tensor([0.0, 1.0, float("inf"), 0.0]))), ValueError,
     r"sinks must be finite or -inf .*sinks\[2\] = inf"),
    # the messages name this function, and q's heads as the caller passed them
    (dict(q_int32=True), TypeError, "q has dtype torch.int32; flash_attention_with_kvcache supports"),
    (dict(no_q_heads=True), ValueError,
     r"q's heads \(0\) must be a multiple of k_cache's heads \(2\), both at least 1"),
])
def test_bad_input_names_the_argument(change, error, match):
    hq = change.get("hq", 4)
    q, k_cache, v_cache, _, k, v = _inputs(2, hq, 2, 1, 16, 16, F16, [1, 2], change.get("n_new", 0), seed=8)
    if change.get("q_int32"):
        q = q.to(torch.int32)
    if change.get("no_q_heads"):
        q = q[:, :0]
    seqlens = change.get("cache_seqlens", torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)).to(DEVICE)
    if change.get("only_k"):
        k, v = torch.zeros_like(q[:, :2]), None
    if change.get("requires_grad"):
        q.requires_grad_()
    if change.get("v_cache_short"):
        v_cache = v_cache[:, :, :8]
    if change.get("expanded_cache"):  # one cache shared by both sequences through a zero batch stride
        k_cache, v_cache = k_cache[:1].expand_as(k_cache), v_cache[:1].expand_as(v_cache)
    with pytest.raises(error, match=match):
        fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k=k, v=v,
                                            num_splits=change.get("num_splits"),
                                            check_lengths=change.get("check_lengths", True),
                                            **{n: t.to(DEVICE) if isinstance(t, torch.Tensor) else t
                                               for n, t in change.get("extra", {}).items()})


@pytest.mark.parametrize("n_new", [0, 2])
def test_unchecked_lengths_same_answer_and_bad_ones_clamped_inside_the_cache(n_new):
    """check_lengths=False: valid lengths give the checked call's bits; lengths outside [0, N_max - n_new]
    are clamped into it by the kernel and the append (the same answer as the clamped lengths; no read or
    write outside the cache, which is padded here with guard rows that must stay untouched)."""
    lens = [3, 14 - n_new]
    q, k_cache, v_cache, seqlens, k, v = _inputs(2, 4, 2, 3, 14, 16, F16, lens, n_new, seed=21)
    args = dict(k=k, v=v, num_splits=2, return_lse=True)
    kc, vc = k_cache.clone(), v_cache.clone()
    o1, l1 = fa_lib.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, **args)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    o2, l2 = fa_lib.flash_attention_with_kvcache(q, kc2, vc2, cache_seqlens=seqlens, check_lengths=False, **args)
    assert torch.equal(o1, o2) and torch.equal(l1, l2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    # bad lengths, in caches that are views into larger buffers with guard rows after N_max
    big_k = torch.full((2, 2, 20, 16), 7.0, dtype=F16, device=DEVICE)
    big_v = big_k.clone()
    big_k[:, :, :14], big_v[:, :, :14] = k_cache, v_cache
    bad = torch.tensor([-5, 40], dtype=torch.int32, device=DEVICE)
    o3, l3 = fa_lib.flash_attention_with_kvcache(q, big_k[:, :, :14], big_v[:, :, :14], cache_seqlens=bad,
                                                 check_lengths=False, **args)
    assert torch.all(big_k[:, :, 14:] == 7.0) and torch.all(big_v[:, :, 14:] == 7.0)
    clamped = torch.tensor([0, 14 - n_new], dtype=torch.int32, device=DEVICE)
    kc4, vc4 = k_cache.clone(), v_cache.clone()
    o4, l4 = fa_lib.flash_attention_with_kvcache(q, kc4, vc4, cache_seqlens=clamped, **args)
    assert torch.equal(o3, o4) and torch.equal(l3, l4)
    assert torch.equal(big_k[:, :, :14], kc4) and torch.equal(big_v[:, :, :14], vc4)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = -5"):
        fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=bad, **args)


def test_numpy_split_count_and_an_empty_cache():
    q, k_cache, v_cache, seqlens, _, _ = _inputs(2, 4, 2, 3, 16, 16, F32, [5, 16], 0, seed=4)
    want = fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=3)
    got = fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=np.int64(3))
    assert torch.equal(got, want)
    empty = torch.zeros(2, dtype=torch.int32, device=DEVICE)  # N_max = 0: every row sees nothing
    o, lse = fa_lib.flash_attention_with_kvcache(q, k_cache[:, :, :0], v_cache[:, :, :0], cache_seqlens=empty,
                                                 return_lse=True)
    assert torch.all(o == 0) and torch.all(torch.isneginf(lse))
    assert decode.num_splits_heuristic(programs=8, n_blocks=0, sm_count=132) == 1


# ---------------------------------------------------------------------------------------------------
# The NumPy mirror on its own.
# ---------------------------------------------------------------------------------------------------
def test_split_bounds_cut_whole_blocks_and_cover_the_keys():
    for n in (0, 1, 15, 16, 17, 100):
        for splits in (1, 2, 3, 8, 40):
            bounds = reference.split_bounds(n, splits, 16)
            assert len(bounds) == splits and bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, in order
            assert all(lo % 16 == 0 or lo == n for lo, _ in bounds)


def test_reference_split_kv_equals_naive_attention_for_every_split():
    rng = np.random.default_rng(9)
    q, kc, vc = rng.standard_normal((2, 4, 3, 8)), rng.standard_normal((2, 2, 30, 8)), rng.standard_normal((2, 2, 30, 8))
    lens = np.array([30, 11])
    for causal in (True, False):
        gold = []
        for b, n in enumerate(lens):
            k, v = np.repeat(kc[b, :, :n], 2, 0), np.repeat(vc[b, :, :n], 2, 0)
            gold.append(reference.naive_attention(q[b], k, v, causal=causal)[0])
        for splits in (1, 2, 4, 11, 31):
            o, _ = reference.kvcache_attention(q, kc.copy(), vc.copy(), lens, causal=causal, num_splits=splits)
            np.testing.assert_allclose(o, np.stack(gold), atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# A paged cache (block_table): the pages of each sequence anywhere in one pool.
# ---------------------------------------------------------------------------------------------------
def _paged_case(dtype, hq, hkv, nq, n_max, d, lens, n_new, page, seed, device=DEVICE):
    """The inputs of `_inputs`, and the same caches cut into pages of `page` keys, spread over a pool in a
    shuffled order with two spare pages (so that no page sits where the contiguous cache has it)."""
    q, k_cache, v_cache, seqlens, k, v = _inputs(len(lens), hq, hkv, nq, n_max, d, dtype, lens, n_new, seed, device)
    b, w = len(lens), -(-n_max // page)
    order = torch.randperm(b * w + 2, generator=torch.Generator().manual_seed(seed))
    table = order[:b * w].view(b, w).to(device=device, dtype=torch.int32)  # page w of sequence b: slot table[b, w]
    pools = []
    for cache in (k_cache, v_cache):
        pool = torch.full((b * w + 2, hkv, page, d), 5.0, dtype=dtype, device=device)  # two spare pages
        padded = torch.zeros((b, hkv, w * page, d), dtype=dtype, device=device)
        padded[:, :, :n_max] = cache
        pool[table.long()] = padded.view(b, hkv, w, page, d).transpose(1, 2)
        pools.append(pool)
    return q, k_cache, v_cache, seqlens, k, v, pools[0], pools[1], table


@pytest.mark.parametrize("page", [1, 5, 16, 24, 32])
@pytest.mark.parametrize("splits, n_new", [(1, 0), (3, 2), (7, 1)])
def test_a_paged_cache_gives_the_contiguous_bits_and_appends_into_its_pages(page, splits, n_new):
    """Pages of 16 and 32 keys hold whole key blocks (16 keys under the interpreter: one index per block);
    1, 5 and 24 do not (one index per key). Either way: the contiguous cache's bits, o and LSE, and the
    append lands in the right rows of the right pages, every other row of the pool untouched."""
    lens, n_max = [0, 13, 40 - n_new], 40
    q, k_cache, v_cache, seqlens, k, v, k_pool, v_pool, table = _paged_case(F16, 4, 2, 3, n_max, 16, lens, n_new,
                                                                           page, seed=page + splits)
    before = k_pool.clone()
    want = fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k=k, v=v,
                                               num_splits=splits, return_lse=True)
    got = fa_lib.flash_attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, k=k, v=v,
                                              num_splits=splits, return_lse=True, block_table=table)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    view = lambda pool: torch.from_numpy(reference.paged_view(pool.cpu().float().numpy(),  # noqa: E731
                                                              table.cpu().numpy()))[:, :, :n_max]
    assert torch.equal(view(k_pool), k_cache.cpu().float()) and torch.equal(view(v_pool), v_cache.cpu().float())
    written = torch.zeros(k_pool.shape[:1] + k_pool.shape[2:3], dtype=torch.bool)  # (page, row) of each append
    for b, n in enumerate(lens):
        for j in range(n, n + n_new):
            written[table[b, j // page], j % page] = True
    assert torch.equal(k_pool.cpu().transpose(1, 2)[~written], before.cpu().transpose(1, 2)[~written])


@pytest.mark.parametrize("page", [5, 16])
def test_a_paged_cache_with_a_window_and_a_soft_cap_gives_the_contiguous_bits(page):
    q, kc, vc, lens, k, v, k_pool, v_pool, table = _paged_case(F16, 4, 2, 3, 64, 16, [0, 20, 61], 3, page, seed=page)
    for window, softcap in (((9, 0), 0.0), ((30, -1), 20.0)):
        want = fa_lib.flash_attention_with_kvcache(q, kc.clone(), vc.clone(), cache_seqlens=lens, k=k, v=v,
                                                   num_splits=3, window=window, softcap=softcap)
        got = fa_lib.flash_attention_with_kvcache(q, k_pool.clone(), v_pool.clone(), cache_seqlens=lens, k=k, v=v,
                                                  num_splits=3, window=window, softcap=softcap, block_table=table)
        assert torch.equal(want, got)


def test_pages_before_a_window_may_be_freed():
    """With a window's left edge, a server frees the pages that fell out of every query's window. Entries of -1
    there pass the check and change nothing; the pages from the window's first key (rounded down to 128 keys,
    a multiple of every key block) on must be valid, and a freed one among them is refused by name."""
    page, left, n = 16, 40, 300  # the first query sees keys from 300 - 2 - 40 = 258: block 256, page 16
    q, kc, vc, lens, _, _, k_pool, v_pool, table = _paged_case(F16, 4, 2, 2, n, 16, [n], 0, page, seed=13)
    want = fa_lib.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, window=(left, 0), num_splits=3)
    freed = table.clone()
    freed[0, :16] = -1  # keys 0 .. 255
    k_pool[table[0, :16].long()], v_pool[table[0, :16].long()] = float("nan"), float("nan")  # and reused, say
    got = fa_lib.flash_attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=lens, window=(left, 0), num_splits=3,
                                              block_table=freed)
    assert torch.equal(got, want)
    assert all(c[1] % 16 == 0 and decode._WINDOW_READ_ALIGN % c[1] == 0 for c in (
        decode._config(d, rows, waves=w, n_keys=n_k, interpret=i) for d in (64, 128, 256) for rows in (1, 4, 64)
        for w in (0.0, 1.5, 5.0) for n_k in (1024, 65536) for i in (True, False)))
    freed[0, 16] = -1  # keys 256 .. 271: read
    with pytest.raises(ValueError, match=r"block_table\[0\] must hold page indices .* for its pages 16 to 18"):
        fa_lib.flash_attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=lens, window=(left, 0),
                                            block_table=freed)


def test_sequences_that_share_prefix_pages_read_them_once_stored():
    """Prefix caching the way serving systems store it: two sequences list the same pages for a common
    prefix of 32 keys (two pages of 16) and their own pages after it. Their answers are those of two
    contiguous caches that each hold a copy of the prefix."""
    g = torch.Generator().manual_seed(11)
    d, page, hkv = 16, 16, 2
    pool_k = torch.randn(7, hkv, page, d, generator=g).to(DEVICE, F16)
    pool_v = torch.randn(7, hkv, page, d, generator=g).to(DEVICE, F16)
    table = torch.tensor([[4, 1, 6, 0], [4, 1, 2, 5]], dtype=torch.int32, device=DEVICE)  # pages 4, 1 shared
    lens = torch.tensor([60, 45], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, 2, d, generator=g).to(DEVICE, F16)
    contiguous = [torch.from_numpy(reference.paged_view(pool.cpu().numpy(), table.cpu().numpy())).to(DEVICE)
                  for pool in (pool_k, pool_v)]
    assert torch.equal(contiguous[0][0, :, :32], contiguous[0][1, :, :32])  # one prefix, stored once
    want = fa_lib.flash_attention_with_kvcache(q, *contiguous, cache_seqlens=lens, num_splits=3)
    got = fa_lib.flash_attention_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens, num_splits=3, block_table=table)
    assert torch.equal(want, got)


def test_the_numpy_mirror_of_a_paged_cache_agrees_with_the_kernel():
    q, _, _, seqlens, k, v, k_pool, v_pool, table = _paged_case(F32, 4, 2, 2, 45, 16, [0, 20, 43], 2, 7, seed=7)
    args = [t.double().cpu().numpy() for t in (q, k_pool, v_pool)]
    o_np, lse_np = reference.kvcache_attention(*args, seqlens.cpu().numpy(), k=k.double().cpu().numpy(),
                                               v=v.double().cpu().numpy(), num_splits=3, block=16,
                                               block_table=table.cpu().numpy())
    o, lse = fa_lib.flash_attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, k=k, v=v, num_splits=3,
                                                 return_lse=True, block_table=table)
    np.testing.assert_allclose(o.cpu().double().numpy(), o_np, atol=1e-5)
    assert np.array_equal(np.isneginf(lse.cpu().numpy()), np.isneginf(lse_np))
    np.testing.assert_array_equal(k_pool.double().cpu().numpy(), args[1])  # both appended into the same pages


def test_page_cache_and_paged_view_are_inverse():
    cache = torch.randn(2, 3, 10, 4)
    pool, table = decode.page_cache(cache, 4, order=[5, 0, 3, 1, 4, 2])
    assert pool.shape == (6, 3, 4, 4) and table.tolist() == [[5, 0, 3], [1, 4, 2]] and table.dtype == torch.int32
    view = reference.paged_view(pool.numpy(), table.numpy())
    assert np.array_equal(view[:, :, :10], cache.numpy()) and not view[:, :, 10:].any()
    with pytest.raises(ValueError, match="order must be a permutation"):
        decode.page_cache(cache, 4, order=[0, 0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        decode.page_cache(cache, 0)
    with pytest.raises(TypeError, match="cache must be a torch.Tensor"):
        decode.page_cache(cache.numpy(), 4)
    with pytest.raises(ValueError, match="cache must be 4-D"):
        decode.page_cache(cache[0], 4)
    with pytest.raises(ValueError, match="block_table must hold page indices in"):
        reference.paged_view(pool.numpy(), np.array([[0, 6]]))


@pytest.mark.parametrize("change, error, match", [
    (dict(dtype=torch.int64), TypeError, "block_table must be a torch.int32 tensor"),
    (dict(shape=(8,)), ValueError, r"block_table must have shape \(batch, pages per sequence\) = \(2, W\)"),
    (dict(shape=(3, 4)), ValueError, r"block_table must have shape"),
    (dict(entry=(1, 1, 9)), ValueError, r"block_table\[1\] must hold page indices in \[0, num_pages"),
    (dict(entry=(0, 0, -1)), ValueError, r"block_table\[0\] must hold page indices"),
    (dict(lens=[1, 17]), ValueError, r"N_max = block_table.shape\[1\] \* k_cache.shape\[2\] = 16"),
    (dict(table_type=True), TypeError, "block_table must be a torch.Tensor"),
])
def test_a_bad_block_table_is_named(change, error, match):
    # pool of 8 pages of 4 keys; each sequence lists 4 pages (N_max = 16) and uses the first ones only
    q = torch.randn(2, 4, 1, 16).to(DEVICE, F16)
    pool = torch.randn(8, 2, 4, 16).to(DEVICE, F16)
    table = torch.tensor([[3, 1, -1, -1], [0, 2, 5, 7]], dtype=change.get("dtype", torch.int32))
    if "shape" in change:
        table = torch.zeros(change["shape"], dtype=torch.int32)
    if "entry" in change:
        b, w, p = change["entry"]
        table[b, w] = p
    lens = torch.tensor(change.get("lens", [6, 13]), dtype=torch.int32, device=DEVICE)
    table = table.tolist() if change.get("table_type") else table.to(DEVICE)
    with pytest.raises(error, match=match):
        fa_lib.flash_attention_with_kvcache(q, pool, pool, cache_seqlens=lens, block_table=table)
    # the unused entries (-1 past a sequence's pages) are never read: the good table passes
    good = torch.tensor([[3, 1, -1, -1], [0, 2, 5, 7]], dtype=torch.int32, device=DEVICE)
    fa_lib.flash_attention_with_kvcache(q, pool, pool, cache_seqlens=torch.tensor([6, 13], dtype=torch.int32,
                                                                                  device=DEVICE), block_table=good)


def test_unchecked_page_indices_outside_the_pool_are_clamped_into_it():
    """check_lengths=False skips the host copy of the table too: an entry outside [0, num_pages) then reads
    (and appends into) the nearest page of the pool, as if the table said so; never a page outside it."""
    q = torch.randn(1, 2, 1, 16).to(DEVICE, F16)
    pool_k, pool_v = (torch.randn(4, 1, 8, 16).to(DEVICE, F16) for _ in "kv")
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    k, v = (torch.randn(1, 1, 1, 16).to(DEVICE, F16) for _ in "kv")
    bad = torch.tensor([[-7, 2, 40]], dtype=torch.int32, device=DEVICE)
    clamped = torch.tensor([[0, 2, 3]], dtype=torch.int32, device=DEVICE)
    kb, vb, kc, vc = pool_k.clone(), pool_v.clone(), pool_k.clone(), pool_v.clone()
    got = fa_lib.flash_attention_with_kvcache(q, kb, vb, cache_seqlens=lens, k=k, v=v, block_table=bad,
                                              check_lengths=False, num_splits=2)
    want = fa_lib.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k=k, v=v, block_table=clamped,
                                               num_splits=2)
    assert torch.equal(got, want) and torch.equal(kb, kc) and torch.equal(vb, vc)
    assert torch.equal(kc[3, :, 4], k[0, :, 0])  # key 20 = row 4 of the third page, page 40 -> 3


# ---------------------------------------------------------------------------------------------------
# cache_batch_idx (a server's cache rows) and cache_leftpad (left-padded batches).
# ---------------------------------------------------------------------------------------------------
def _rows_case(n_max, seed, lens=(0, 13, 38), n_new=2, rows_total=5):
    """Three sequences whose caches are rows 4, 0 and 2 of a cache of 5 rows, keys from positions 0, 5 and 31."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE, F16)  # noqa: E731
    q = mk(3, 4, 3, 16)
    kc, vc = mk(rows_total, 2, n_max, 16), mk(rows_total, 2, n_max, 16)
    k, v = (mk(3, 2, n_new, 16), mk(3, 2, n_new, 16)) if n_new else (None, None)
    as_int = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return q, kc, vc, k, v, as_int(list(lens)), as_int([4, 0, 2]), as_int([0, 5, 31])


@pytest.mark.parametrize("n_max", [40, 48])  # key rows of 40 keys: a block across the row's end; 48: whole blocks
@pytest.mark.parametrize("use", ["idx", "pad", "both"])
@pytest.mark.parametrize("splits, masks", [(1, {}), (3, {}), (2, dict(window=(9, -1), softcap=20.0))])
def test_cache_batch_idx_and_leftpad_give_the_bits_of_the_keys_they_select(n_max, use, splits, masks):
    """Sequence b reads row cache_batch_idx[b] of the cache from position cache_leftpad[b] on: the same bits as a
    call on a cache that holds exactly those keys from position 0, the append lands in that row at
    cache_seqlens[b], and no other row or position changes."""
    q, kc, vc, k, v, lens, idx, pad = _rows_case(n_max, seed=n_max + splits)
    idx = idx if use in ("idx", "both") else None
    pad = pad if use in ("pad", "both") else None
    if idx is None:  # one row per sequence
        kc, vc = kc[:3].clone(), vc[:3].clone()
    before_k, before_v = kc.clone(), vc.clone()
    o, lse = fa_lib.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k=k, v=v, num_splits=splits,
                                                 return_lse=True, cache_batch_idx=idx, cache_leftpad=pad, **masks)
    rows = idx.tolist() if idx is not None else [0, 1, 2]
    starts = pad.tolist() if pad is not None else [0, 0, 0]
    for b, (r, p, n) in enumerate(zip(rows, starts, lens.tolist())):
        assert torch.equal(kc[r, :, n:n + 2], k[b]) and torch.equal(vc[r, :, n:n + 2], v[b])  # the append
        before_k[r, :, n:n + 2], before_v[r, :, n:n + 2] = k[b], v[b]
        # the keys it selects, moved to position 0 of a cache of its own
        ob, lb = fa_lib.flash_attention_with_kvcache(
            q[b:b + 1], kc[r:r + 1, :, p:].contiguous(), vc[r:r + 1, :, p:].contiguous(),
            cache_seqlens=torch.tensor([n + 2 - p], dtype=torch.int32, device=DEVICE), num_splits=splits,
            return_lse=True, **masks)
        assert torch.equal(o[b:b + 1], ob) and torch.equal(lse[b:b + 1], lb)
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)  # nothing else written
    # the NumPy mirror (float32) agrees, on the caches after the append
    ro, rl = reference.kvcache_attention(
        q.float().cpu().numpy(), kc.float().cpu().numpy(), vc.float().cpu().numpy(), lens.cpu().numpy() + 2,
        num_splits=splits, block=16, cache_batch_idx=None if idx is None else idx.cpu().numpy(),
        cache_leftpad=None if pad is None else pad.cpu().numpy(), **masks)
    np.testing.assert_allclose(o.float().cpu().numpy(), ro, atol=2e-3)
    np.testing.assert_allclose(lse.cpu().numpy(), rl, atol=1e-3)


def test_the_numpy_mirror_of_leftpad_and_cache_rows_is_the_shifted_cache():
    """reference.kvcache_attention: cache_leftpad[b] and cache_batch_idx[b] give what the keys they select give
    from position 0 of a cache of their own, append included (float64, to rounding)."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 3, 8))
    kc, vc = rng.standard_normal((4, 2, 30, 8)), rng.standard_normal((4, 2, 30, 8))
    k, v = rng.standard_normal((2, 2, 2, 8)), rng.standard_normal((2, 2, 2, 8))
    lens, idx, pad = np.array([9, 27]), np.array([3, 1]), np.array([4, 0])
    kc2, vc2 = kc.copy(), vc.copy()
    o, lse = reference.kvcache_attention(q, kc2, vc2, lens, k=k, v=v, num_splits=2, block=4, cache_batch_idx=idx,
                                         cache_leftpad=pad, window=(5, -1))
    for b in range(2):
        r, p = idx[b], pad[b]
        assert np.array_equal(kc2[r, :, lens[b]:lens[b] + 2], k[b])
        ob, lb = reference.kvcache_attention(q[b:b + 1], kc2[r:r + 1, :, p:].copy(), vc2[r:r + 1, :, p:].copy(),
                                             np.array([lens[b] + 2 - p]), window=(5, -1))
        np.testing.assert_allclose(o[b:b + 1], ob, atol=1e-12)
        np.testing.assert_allclose(lse[b:b + 1], lb, atol=1e-12)
    for kwargs, match in ((dict(cache_leftpad=np.array([10, 0])), r"0 <= cache_leftpad\[b\] <= cache_seqlens\[b\]"),
                          (dict(cache_batch_idx=np.array([4, 0])), r"cache_batch_idx must be integers of shape"),
                          (dict(cache_batch_idx=idx, block_table=np.zeros((2, 1), int)), "block_table cannot")):
        with pytest.raises(ValueError, match=match):
            rows = 2 if "cache_batch_idx" not in kwargs else 4
            reference.kvcache_attention(q, kc[:rows].copy(), vc[:rows].copy(), lens, **kwargs)


@pytest.mark.parametrize("change, error, match", [
    (dict(idx=torch.tensor([0, 1], dtype=torch.int64)), TypeError, "cache_batch_idx must be a torch.int32 tensor"),
    (dict(idx=torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError, r"cache_batch_idx must have shape \(batch,\)"),
    (dict(idx=torch.tensor([0, 3], dtype=torch.int32)), ValueError,
     r"cache_batch_idx\[1\] = 3: every entry must be a row of k_cache, in \[0, k_cache.shape\[0\] = 3\)"),
    (dict(idx=torch.tensor([-1, 0], dtype=torch.int32)), ValueError, r"cache_batch_idx\[0\] = -1"),
    (dict(idx=torch.tensor([2, 2], dtype=torch.int32), append=True), ValueError,
     "lists a cache row twice while k and v are appended"),
    (dict(idx=[0, 1]), TypeError, "cache_batch_idx must be a torch.Tensor"),
    (dict(pad=torch.tensor([0, 7], dtype=torch.int32)), ValueError,
     r"cache_leftpad\[1\] = 7: every cache_leftpad\[b\] must lie in \[0, cache_seqlens\[b\]\] \(here \[0, 6\]\)"),
    (dict(pad=torch.tensor([-1, 0], dtype=torch.int32)), ValueError, r"cache_leftpad\[0\] = -1"),
    (dict(pad=torch.tensor([[0, 0]], dtype=torch.int32)), ValueError, r"cache_leftpad must have shape \(batch,\)"),
    (dict(pad=torch.tensor([0, 0], dtype=torch.int32), table=True), ValueError,
     "block_table cannot be combined with cache_leftpad"),
    (dict(idx=torch.tensor([0, 1], dtype=torch.int32), table=True), ValueError,
     "block_table cannot be combined with cache_batch_idx"),
    (dict(idx=torch.tensor([0, 1], dtype=torch.int32), kc=(3, 2, 8, 32)), ValueError,
     r"with cache_batch_idx, k_cache must be \(cache rows >= 1, kv_heads, N_max, head_dim = 16\)"),
])
def test_bad_cache_batch_idx_or_leftpad_is_named(change, error, match):
    q = torch.randn(2, 4, 1, 16).to(DEVICE, F16)
    kc = torch.randn(*change.get("kc", (3 if "idx" in change else 2, 2, 8, 16))).to(DEVICE, F16)
    lens = torch.tensor([3, 6], dtype=torch.int32, device=DEVICE)
    new = dict(k=kc[:2, :, :1].clone(), v=kc[:2, :, :1].clone()) if change.get("append") else {}
    to = lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t  # noqa: E731
    table = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE) if change.get("table") else None
    with pytest.raises(error, match=match):
        fa_lib.flash_attention_with_kvcache(q, kc, kc.clone(), cache_seqlens=lens, cache_batch_idx=to(change.get("idx")),
                                            cache_leftpad=to(change.get("pad")), block_table=table, **new)


def test_unchecked_cache_rows_and_leftpads_are_clamped_into_range():
    """check_lengths=False: a row of cache_batch_idx outside the cache reads (and appends into) the nearest row, a
    left pad outside [0, cache_seqlens[b]] is clamped into it; never a read or write outside the cache."""
    q, kc, vc, k, v, lens, idx, pad = _rows_case(40, seed=5)
    bad_idx, bad_pad = torch.tensor([9, -3, 2], dtype=torch.int32, device=DEVICE), pad.new_tensor([-4, 99, 31])
    good_idx, good_pad = bad_idx.clamp(0, 4), torch.minimum(bad_pad.clamp(min=0), lens)
    kb, vb, kg, vg = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    got = fa_lib.flash_attention_with_kvcache(q, kb, vb, cache_seqlens=lens, k=k, v=v, cache_batch_idx=bad_idx,
                                              cache_leftpad=bad_pad, check_lengths=False, num_splits=2)
    want = fa_lib.flash_attention_with_kvcache(q, kg, vg, cache_seqlens=lens, k=k, v=v, cache_batch_idx=good_idx,
                                               cache_leftpad=good_pad, num_splits=2)
    assert torch.equal(got, want) and torch.equal(kb, kg) and torch.equal(vb, vg)


@pytest.mark.parametrize("paged", [False, True])
def test_flash_attn_with_kvcache_takes_flash_attns_layout_and_gives_the_same_bits(paged):
    """flash-attn's drop-in: (batch, seqlen, heads, head_dim) tensors, appends into that layout's cache (or its
    pool of pages), an int or a tensor for cache_seqlens, num_splits=0 for the heuristic; the bits of
    flash_attention_with_kvcache on the (batch, heads, seqlen, head_dim) views."""
    lens, n_new = [0, 13, 38], 2
    q, k_cache, v_cache, seqlens, k, v, k_pool, v_pool, table = _paged_case(F16, 4, 2, 3, 40, 16, lens, n_new, 8, 3)
    caches = (k_pool, v_pool) if paged else (k_cache, v_cache)
    # the same caches stored (., seqlen, heads, .), as flash-attn keeps them
    kc_s, vc_s = (c.transpose(1, 2).contiguous() for c in caches)
    table = table if paged else None
    want, want_lse = fa_lib.flash_attention_with_kvcache(q, *caches, cache_seqlens=seqlens, k=k, v=v, causal=True,
                                                         num_splits=3, return_lse=True, block_table=table)
    got, got_lse = fa_lib.flash_attn_with_kvcache(q.transpose(1, 2), kc_s, vc_s, k.transpose(1, 2), v.transpose(1, 2),
                                                  cache_seqlens=seqlens, block_table=table, causal=True, num_splits=3,
                                                  return_softmax_lse=True)
    assert got.shape == (3, 3, 4, 16) and torch.equal(got.transpose(1, 2), want) and got.is_contiguous()
    # flash-attn's LSE of a query that sees no key (sequence 0's first: 3 queries, 2 keys) is +inf; native: -inf
    assert torch.isposinf(got_lse[0, :, 0]).all() and torch.equal(got_lse, want_lse.nan_to_num(neginf=float("inf")))
    assert torch.equal(kc_s.transpose(1, 2), caches[0]) and torch.equal(vc_s.transpose(1, 2), caches[1])  # appended
    # an int length, no append, flash-attn's default causal=False and num_splits=0
    full = fa_lib.flash_attn_with_kvcache(q.transpose(1, 2), kc_s, vc_s, cache_seqlens=20, block_table=table)
    assert torch.equal(full.transpose(1, 2), fa_lib.flash_attention_with_kvcache(
        q, *caches, cache_seqlens=torch.full((3,), 20, dtype=torch.int32, device=DEVICE), causal=False,
        block_table=table))
    # no cache_seqlens: every slot is a key (N_max = 40, or W pages of 8 = 40)
    every = fa_lib.flash_attn_with_kvcache(q.transpose(1, 2), kc_s, vc_s, block_table=table)
    assert torch.equal(every, fa_lib.flash_attn_with_kvcache(q.transpose(1, 2), kc_s, vc_s, cache_seqlens=40,
                                                             block_table=table))


def _rotary_tables(n_pos, rotary_dim, base=10000.0):
    """cos and sin (n_pos, rotary_dim / 2) of the angles pos * base^(-2c / rotary_dim), and the angles."""
    inv = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    theta = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(theta).float(), torch.sin(theta).float(), theta


def _rotate_complex(x, theta, pos, interleaved):
    """The rotary embedding as complex multiplication: channel pairs (2c, 2c + 1) (interleaved) or (c, c + half)
    as the real and imaginary parts of one number, times e^{i theta[pos]}. x (B, N, H, d), pos (B, N)."""
    half = theta.shape[1]
    xr = x[..., :2 * half].double()
    re, im = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., :half], xr[..., half:])
    z = torch.complex(re, im) * torch.polar(torch.ones_like(theta[pos]), theta[pos])[:, :, None, :]
    out = torch.stack((z.real, z.imag), dim=-1).flatten(-2) if interleaved else torch.cat((z.real, z.imag), -1)
    return torch.cat((out.to(x.dtype), x[..., 2 * half:]), dim=-1)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal, window, rows", [(True, (-1, -1), False), (False, (-1, -1), False),
                                                  (False, (6, 0), False), (True, (-1, -1), True)])
def test_flash_attn_with_kvcache_rotary_embedding(interleaved, causal, window, rows):
    """flash-attn's rotary embedding: the new keys rotated at cache_seqlens + j before the append, the queries at
    cache_seqlens + i (causal or windowed) or all at cache_seqlens; 12 of 16 channels rotated. The same bits as
    rotating q and k by complex multiplication first (in float64, rounded to float32) and calling without it, to
    float32 rounding. `rows`: with cache_batch_idx and cache_leftpad too (positions stay the cache's, as in
    flash-attn)."""
    lens, n_new = [0, 13, 33], 3
    q, k_cache, v_cache, seqlens, k, v = _inputs(3, 4, 2, 3, 40, 16, F32, lens, n_new, seed=21)
    sel = {}
    if rows:  # the three sequences in rows 4, 0 and 2 of five, from positions 0, 5 and 30
        k_cache, v_cache = (torch.cat((c, c.flip(0)[:2])).roll(1, 0) for c in (k_cache, v_cache))
        sel = dict(cache_batch_idx=torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE),
                   cache_leftpad=torch.tensor([0, 5, 30], dtype=torch.int32, device=DEVICE))
    cos, sin, theta = _rotary_tables(64, 12)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    q_s, k_s, v_s, kc_s, vc_s = (t.transpose(1, 2) for t in (q, k, v, k_cache.clone(), v_cache.clone()))
    got = fa_lib.flash_attn_with_kvcache(q_s, kc_s, vc_s, k_s, v_s, rotary_cos=cos, rotary_sin=sin,
                                         cache_seqlens=seqlens, causal=causal, window_size=window,
                                         rotary_interleaved=interleaved, num_splits=2, **sel)
    start = seqlens.long().cpu()[:, None]
    q_pos = start + torch.arange(3)[None, :] if causal or window != (-1, -1) else start.expand(3, 3)
    q_r = _rotate_complex(q_s.cpu(), theta, q_pos, interleaved).to(DEVICE)
    k_r = _rotate_complex(k_s.cpu(), theta, start + torch.arange(n_new)[None, :], interleaved).to(DEVICE)
    kc2, vc2 = (t.transpose(1, 2) for t in (k_cache.clone(), v_cache.clone()))
    want = fa_lib.flash_attn_with_kvcache(q_r, kc2, vc2, k_r, v_s, cache_seqlens=seqlens, causal=causal,
                                          window_size=window, num_splits=2, **sel)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(kc_s, kc2, rtol=2e-6, atol=2e-6)  # the rotated keys were appended
    r = 0 if rows else 1  # sequence 1's cache row
    assert not torch.equal(kc_s[r, 13:16, :, :12], k_s[1, :, :, :12])  # ... rotated: not the raw ones
    assert torch.equal(kc_s[r, 13:16, :, 12:], k_s[1, :, :, 12:])  # the last 4 channels pass through


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(rotary_cos=torch.zeros(4, 4)), TypeError, "rotary_sin must be a torch.Tensor"),
    (dict(rotary_cos=torch.zeros(4, 9), rotary_sin=torch.zeros(4, 9)), ValueError, r"rotary_dim <= head_dim = 16"),
    (dict(rotary_cos=torch.zeros(4, 4), rotary_sin=torch.zeros(4, 4)), ValueError,
     r"cover positions 0 to 3, but cache_seqlens up to 8"),  # no cache_seqlens: all 8 keys, the query at 8
    (dict(rotary_cos=torch.zeros(4, 4), rotary_sin=torch.zeros(4, 4), cache_seqlens=4), ValueError,
     r"cover positions 0 to 3, but cache_seqlens up to 4 puts a key or query at 4"),
    (dict(cache_batch_idx=torch.zeros(2)), TypeError, "cache_batch_idx must be a torch.int32 tensor"),
    (dict(cache_leftpad=torch.tensor([0, 9], dtype=torch.int32)), ValueError, r"cache_leftpad\[1\] = 9"),
    (dict(alibi_slopes=torch.zeros(1)), ValueError, "alibi_slopes is not supported"),
    (dict(window_size=4), TypeError, r"window_size must be a pair of ints"),
    (dict(window_size=(-3, 0)), ValueError, r"window"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(num_splits=-1), ValueError, r"num_splits must be an int from 0 \(the heuristic's count\) to 65536"),
    (dict(num_splits=2**16 + 1), ValueError, "num_splits must be an int from 0"),
    (dict(k="k"), TypeError, "k must be a torch.Tensor"),
    (dict(append=True), ValueError, "cache_seqlens is needed to append"),
    (dict(flat_q=True), ValueError, r"q must be a 4-D tensor \(batch, seqlen_q, heads, head_dim\) in flash-attn's "
                                    r"layout"),
])
def test_flash_attn_with_kvcache_refuses_what_it_does_not_do(kwargs, error, match):
    q = torch.randn(2, 1, 4, 16).to(DEVICE, F16)
    kc = torch.randn(2, 8, 2, 16).to(DEVICE, F16)
    kwargs = {n: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for n, t in kwargs.items()}
    if kwargs.pop("append", False):
        kwargs.update(k=kc[:, :1].clone(), v=kc[:, :1].clone())
    if kwargs.pop("flat_q", False):
        q = q[:, 0]
    with pytest.raises(error, match=match):
        fa_lib.flash_attn_with_kvcache(q, kc, kc.clone(), **kwargs)


# ---------------------------------------------------------------------------------------------------
# A decoding step's device work: the append (and the rotary embedding) in kernels of their own.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rotary", [False, True])
def test_a_decoding_step_is_its_launches_and_nothing_else(rotary):
    """One step of flash-attn's decoding call with a workspace, unchecked lengths (as in a CUDA graph), a new key
    appended and, with `rotary`, the rotary embedding: the queries' rotation, the append and the split kernel,
    and no other device work. (Appending by indexing in PyTorch ran six operators, and the rotary embedding
    about thirty more.)"""
    q, k_cache, v_cache, seqlens, k, v = _inputs(2, 4, 2, 1, 40, 16, F16, [5, 30], 1, seed=9)
    ws = decode.workspace(q)
    cos, sin, _ = _rotary_tables(64, 8)
    extra = dict(rotary_cos=cos.to(DEVICE), rotary_sin=sin.to(DEVICE)) if rotary else {}

    def step():
        fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k=k, v=v, num_splits=2,
                                            check_lengths=False, workspace=ws, **extra)

    launches, aten = device_work(step)
    assert launches == ["_rotary_q"] * rotary + ["_append_kv", "_decode_split"] and aten == []
    # without a workspace: one more, the zeroing of the fused merge's counts
    launches, aten = device_work(lambda: fa_lib.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, k=k, v=v, num_splits=2, check_lengths=False))
    assert launches == ["_append_kv", "_decode_split"] and aten == ["aten.zeros.default"]
    with pytest.raises(TypeError, match="fn must be a callable that takes no arguments, got Tensor"):
        device_work(q)


_COMPILE_APPEND = """
import json, sys
import torch
sys.path[:0] = sys.argv[1:2]
from sm90 import compiling_for_sm90
from fa_lib import kernels

out = []
k = torch.empty(4, 8, 1, 128, dtype=torch.bfloat16)
lens = torch.empty(4, dtype=torch.int32)
cos = torch.empty(4096, 64)
for page, rotary, inter in ((0, False, True), (0, True, True), (16, True, False), (256, False, True)):
    cache = torch.empty(64, 8, page, 128, dtype=torch.bfloat16) if page else torch.empty(4, 8, 4096, 128,
                                                                                         dtype=torch.bfloat16)
    table = torch.empty(4, 16, dtype=torch.int32)
    with compiling_for_sm90():
        kernels._append_kv.warmup(k, k, cache, cache, lens, table, cos, cos, *k.stride(), *k.stride(),
                                  *cache.stride(), *cache.stride(), 16, 64, 8, 1, 4096, 128, 64, 4096, HEAD_DIM=128,
                                  BLOCK_N=1, PAGE=page, ROTARY=rotary, INTERLEAVED=inter, EMULATE_BF16=False,
                                  num_warps=4, grid=(1,))
    out.append(f"append {page} {rotary} {inter}")
q = torch.empty(4, 32, 4, 128, dtype=torch.bfloat16)
for per_query, inter in ((True, True), (False, False)):
    with compiling_for_sm90():
        kernels._rotary_q.warmup(q, q, lens, cos, cos, *q.stride(), *q.stride(), 32, 4, 128, 64, 4096, HEAD_DIM=128,
                                 BLOCK_M=4, PER_QUERY=per_query, INTERLEAVED=inter, EMULATE_BF16=False, num_warps=4,
                                 grid=(1,))
    out.append(f"rotary_q {per_query} {inter}")
print(json.dumps(out))
"""


def test_the_append_and_rotary_kernels_compile_for_sm90():
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", _COMPILE_APPEND, str(root / "tests")], capture_output=True,
                         text=True, env=dict(os.environ, TRITON_INTERPRET="0"), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(json.loads(run.stdout.strip().splitlines()[-1])) == 6


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_traces_a_decoding_step(backend):
    """A model's decoding step under torch.compile(fullgraph=True): fa_lib's decoding call is one operator
    (fa_lib::kvcache_attn) that appends into the caches in place; the compiled step gives the eager step's
    bits and leaves the same caches, contiguous or paged, through either API, with a workspace."""
    lens, n_new = [0, 13, 38], 1
    q, k_cache, v_cache, seqlens, k, v, k_pool, v_pool, table = _paged_case(F16, 4, 2, 1, 40, 16, lens, n_new, 8, 4)
    ws = decode.workspace(q)

    def step(q, kc, vc, k, v, table):
        o = fa_lib.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k=k, v=v, num_splits=3,
                                                block_table=table, workspace=ws)
        o2 = fa_lib.flash_attn_with_kvcache(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                            cache_seqlens=seqlens + 1, block_table=table, causal=True,
                                            window_size=(20, 0), softcap=30.0)
        return o * 2 + o2.transpose(1, 2)

    for caches, tab in (((k_cache, v_cache), None), ((k_pool, v_pool), table)):
        eager_caches = [c.clone() for c in caches]
        want = step(q, *eager_caches, k, v, tab)
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend=backend)
        got_caches = [c.clone() for c in caches]
        got = compiled(q, *got_caches, k, v, tab)
        assert torch.equal(got, want) and not ws.any()
        assert all(torch.equal(a, b) for a, b in zip(got_caches, eager_caches))


def test_torch_compile_fullgraph_with_cache_rows_leftpads_and_rotary():
    """cache_batch_idx (a one-column block table made inside the traced call), cache_leftpad and the rotary
    embedding (operands of fa_lib::kvcache_attn) under torch.compile(fullgraph=True): the eager step's bits and
    caches."""
    q, kc, vc, k, v, lens, idx, pad = _rows_case(40, seed=8)
    cos, sin, _ = _rotary_tables(64, 8)

    def step(q, kc, vc, k, v):
        return fa_lib.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k=k, v=v, num_splits=2,
                                                   cache_batch_idx=idx, cache_leftpad=pad, rotary_cos=cos.to(DEVICE),
                                                   rotary_sin=sin.to(DEVICE), rotary_interleaved=False)

    eager = [kc.clone(), vc.clone()]
    want = step(q, *eager, k, v)
    torch._dynamo.reset()
    got_caches = [kc.clone(), vc.clone()]
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, *got_caches, k, v)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_caches, eager))


def test_the_decoding_operator_has_a_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 4, 3, 16, device=DEVICE, dtype=F16)
        kc = torch.empty(2, 2, 40, 16, device=DEVICE, dtype=F16)
        lens = torch.empty(2, device=DEVICE, dtype=torch.int32)
        o, lse = torch.ops.fa_lib.kvcache_attn(q, kc, kc, lens, None, None, True, 0.25, 0, None, None, False)
    assert o.shape == (2, 4, 3, 16) and o.dtype == F16 and lse.shape == (2, 4, 3) and lse.dtype == torch.float32
    q, k_cache, v_cache, seqlens, k, v = _inputs(2, 4, 2, 1, 40, 16, F16, [5, 39], 1, seed=2)
    torch.library.opcheck(torch.ops.fa_lib.kvcache_attn.default,
                          (q, k_cache, v_cache, seqlens, k, v, True, 0.25, 2, None, None, True),
                          test_utils=("test_schema", "test_faketensor"))
    pad = torch.tensor([2, 30], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(torch.ops.fa_lib.kvcache_attn.default,
                          (q, k_cache, v_cache, seqlens, k, v, True, 0.25, 2, None, None, True, -1, -1, 0.0, pad),
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------------
# Sliding windows and soft caps while decoding.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal, window", [(True, (5, -1)), (True, (0, 0)), (True, (17, 0)), (False, (6, 3)),
                                            (False, (-1, 2)), (True, (200, -1))])
@pytest.mark.parametrize("softcap", [0.0, 3.0, 150.0])
def test_windows_and_soft_caps_match_the_reference(causal, window, softcap):
    """Against plain attention over each sequence with the same window and cap (the flash rule), with appends,
    GQA, a draft of 3 queries, ragged lengths (0 and N_max among them) and more splits than the window has
    blocks; and the NumPy mirror, whose chunks start at the window's first block as the kernel's do."""
    lens, n_new, splits = [0, 9, 45, 61], 3, 3
    q, k_cache, v_cache, seqlens, k, v = _inputs(4, 4, 2, 3, 64, 16, F32, lens, n_new, seed=len(str(window)))
    args = [t.double().cpu().numpy() for t in (q, k_cache, v_cache, k, v)]
    o, lse = fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k=k, v=v, causal=causal,
                                                 num_splits=splits, return_lse=True, window=window, softcap=softcap)
    for b, n in enumerate(lens):
        kb, vb = (c[b].double().cpu().numpy().repeat(2, axis=0)[:, :n + n_new] for c in (k_cache, v_cache))
        o_b, lse_b = reference.naive_attention(args[0][b], kb, vb, causal=causal, window=window, softcap=softcap)
        np.testing.assert_allclose(o[b].cpu().double().numpy(), o_b, atol=2e-5)
        assert np.array_equal(np.isneginf(lse[b].cpu().numpy()), np.isneginf(lse_b))
    trace = []
    o_m, _ = reference.kvcache_attention(args[0], args[1].copy(), args[2].copy(), np.array(lens), k=args[3], v=args[4],
                                         causal=causal, window=window, softcap=softcap, num_splits=splits, block=16,
                                         trace=trace)
    np.testing.assert_allclose(o.cpu().double().numpy(), o_m, atol=2e-5)
    if window[0] >= 0:  # the chunks of the last sequence (64 keys) start at its window's first block
        first = min(t["lo"] for t in trace if t["b"] == 3 and t["hi"] > t["lo"])
        assert first == max(0, 64 - 3 - window[0]) // 16 * 16


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(window=(-3, 0)), ValueError, r"window sizes must be >= 0, or -1 for unbounded, got \(-3, 0\)"),
    (dict(window=5), TypeError, "window must be a pair of ints"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap="a"), TypeError, "softcap must be a real number"),
])
def test_a_bad_window_or_soft_cap_is_named(kwargs, error, match):
    q, k_cache, v_cache, seqlens, _, _ = _inputs(1, 2, 1, 1, 8, 16, F16, [4], 0, seed=1)
    with pytest.raises(error, match=match):
        fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, **kwargs)


def test_the_numpy_mirror_names_a_bad_block_table():
    q, pool = np.zeros((1, 2, 1, 16)), np.zeros((3, 1, 4, 16))
    for table, match in ((np.zeros((2, 2), int), r"block_table must be integers of shape \(B=1"),
                         (np.zeros(2), r"block_table must be integers of shape"),
                         (np.array([[9, 0]]), r"block_table\[0\] must hold page indices in \[0, 3\)")):
        with pytest.raises(ValueError, match=match):
            reference.kvcache_attention(q, pool, pool, np.array([5]), block_table=table)


def test_a_window_reads_only_its_keys():
    """Keys before the first query's window are never read: NaN there changes nothing (a read would
    poison the sums, since 0 * NaN is NaN)."""
    q, k_cache, v_cache, seqlens, _, _ = _inputs(2, 4, 2, 1, 96, 16, F16, [96, 40], 0, seed=5)
    want = fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, window=(20, 0),
                                               num_splits=2)
    k_cache[0, :, :64], v_cache[0, :, :64] = float("nan"), float("nan")  # sequence 0 reads keys 75 ..; block 64 ..
    k_cache[1, :, :16], v_cache[1, :, :16] = float("nan"), float("nan")  # sequence 1 reads keys 19 ..; block 16 ..
    got = fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, window=(20, 0),
                                              num_splits=2)
    assert torch.equal(got, want) and not got.isnan().any()


def test_flash_attn_with_kvcache_passes_window_size_and_softcap():
    q, k_cache, v_cache, seqlens, _, _ = _inputs(2, 4, 2, 2, 40, 16, F16, [40, 7], 0, seed=6)
    want = fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, window=(9, 0),
                                               softcap=20.0)
    got = fa_lib.flash_attn_with_kvcache(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                         cache_seqlens=seqlens, causal=True, window_size=(9, -1), softcap=20.0)
    assert torch.equal(got.transpose(1, 2), want)


_COMPILE_PAGED = """
import json, sys
import torch
sys.path[:0] = sys.argv[1:2]
from sm90 import compiling_for_sm90
from fa_lib import kernels

out = {}
lens = torch.empty(1, dtype=torch.int32)
pad = dict(LeftPad=lens, LEFTPAD=True)
for page, band in ((0, {}), (256, {}), (16, {}), (0, dict(WIN_LEFT=4095, softcap=50.0, LOCAL=True, SOFTCAP=1)),
                   (16, dict(WIN_LEFT=127, WIN_RIGHT=3, softcap=500.0, LOCAL=True, SOFTCAP=2)), (0, pad),
                   (16384, pad)):
    q = torch.empty(1, 32, 1, 128, dtype=torch.bfloat16)
    pool = torch.empty(4 if page == 16384 else 64, 8, page, 128, dtype=torch.bfloat16) if page else \
        torch.empty(1, 8, 16384, 128, dtype=torch.bfloat16)
    table = torch.empty(1, 64, dtype=torch.int32)
    part = torch.empty(16, 1, 32, 1, 128)
    with compiling_for_sm90():
        k = kernels._decode_split.warmup(
            q, pool, pool, lens, 0, 16384, 0.1, part, part[..., 0], q, part[0, ..., 0], lens, table, 64, 64,
            *q.stride(), *pool.stride(), *pool.stride(), *q.stride(), 1, 32, 8, 4, 1, 128, 16,
            HEAD_DIM=128, CAUSAL=True, MASK_D=False, EMULATE_BF16=False, PRECISION="tf32", SPLIT=True, BLOCK_M=16,
            BLOCK_N=128, FUSED=True, BLOCK_S=16, ROWS_C=4, PDL=True, PAGE=page, num_warps=4, num_stages=3, grid=(1,),
            **band)
    out[f"{page}{'p' if 'LEFTPAD' in band else 'w' if band else ''}"] = dict(copies=k.asm["ttgir"].count("async_copy_global_to_local"),
                                             shared=k.metadata.shared)
print(json.dumps(out))
"""


def test_the_paged_kernel_compiles_for_sm90_with_the_unpaged_pipeline():
    """The paged split kernel, compiled ahead of time for the H200 on this CPU machine: its K and V loads are
    pipelined as the unpaged kernel's (the same shared-memory buffers, the same asynchronous copies), pages of
    whole blocks or not, with a window and a soft cap or not, with left pads, and with cache rows as pages. With the block table read by `tl.load` they were
    buffered once (72 KiB, not 136)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", _COMPILE_PAGED, str(root / "tests")], capture_output=True, text=True,
                         env=dict(os.environ, TRITON_INTERPRET="0"), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["0"]["shared"] == 136 * 1024 and got["0"]["copies"] == 6  # K and V: two blocks ahead, then one a step
    assert got["256"] == got["0"] and got["16"] == got["0"]
    assert got["0w"] == got["0"] and got["16w"] == got["0"]  # windows and soft caps: the same pipeline
    assert got["0p"] == got["0"] and got["16384p"] == got["0"]  # left pads; a cache row as one page (cache_batch_idx)


# ---------------------------------------------------------------------------------------------------
# On the GPU, at decoding sizes.
# ---------------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (run `make gpu-test` on a GPU)")


def _capture(step):
    """A CUDA graph of `step()` (warmed up on a side stream first, as capture requires) and the outputs it
    writes on each replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = step()
    return g, captured


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("b, hq, hkv, nq, n_max, lens, n_new", [
    (1, 32, 8, 1, 16384, [16000], 1),
    (4, 32, 32, 4, 4096, [0, 1, 4000, 4092], 4),
    (8, 32, 8, 16, 2048, [2048 - 16, 7, 1000, 1500, 0, 16, 333, 2000], 16),
])
def test_gpu_decoding_sizes(dtype, b, hq, hkv, nq, n_max, lens, n_new):
    for splits in (None, 1, 3):
        _check(dtype, hq, hkv, nq, n_max, 128, lens, n_new, True, splits, seed=b + nq)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("masks", [dict(window=(4096, -1)), dict(window=(127, 0), softcap=50.0),
                                   dict(softcap=30.0), dict(window=(1000, 0), softcap=500.0)])
def test_gpu_decoding_with_windows_and_soft_caps(masks):
    """Mistral's and Gemma 2's decoding at decoding sizes (16k cached keys, bf16), by the flash rule."""
    for nq, splits in ((1, None), (4, 3)):
        _check(BF16, 32, 8, nq, 16384, 128, [16000, 3, 9000], nq, True, splits, seed=nq, **masks)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fuse, pdl", [(True, False), (False, False), (True, True), (False, True)])
def test_gpu_split_decoding_same_bits_eager_and_graph(monkeypatch, fuse, pdl, kernel_opts):
    """Split decoding (16 splits, merged by the split kernel's last programs) replayed from a CUDA graph of
    several calls, as a model's decoding step runs them, gives the eager calls' bits; so does the separate
    combine kernel; and so does the split kernel launched with programmatic dependent launch (`_PDL`),
    whose bits are also those of the plain launch."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=BF16, generator=gen)
    caches = [tuple(torch.randn(1, 8, 16384, 128, device="cuda", dtype=BF16, generator=gen) for _ in "kv")
              for _ in range(3)]
    lens = torch.tensor([16000], dtype=torch.int32, device="cuda")
    kernel_opts(decode_fused_merge=fuse)

    def step():
        return [fa_lib.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, return_lse=True)
                for kc, vc in caches]
    plain = step()
    kernel_opts(decode_pdl=pdl)
    eager = step()
    for (o1, l1), (o2, l2) in zip(plain, eager):
        assert torch.equal(o1, o2) and torch.equal(l1, l2)
    g, captured = _capture(step)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    for (o1, l1), (o2, l2) in zip(eager, captured):
        assert torch.equal(o1, o2) and torch.equal(l1, l2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("page", [256, 16, 48])
def test_gpu_a_paged_cache_gives_the_contiguous_bits_eager_and_in_a_graph(page):
    """At decoding sizes on the GPU (128-key blocks: pages of 256 hold whole blocks, 16 and 48 do not), with
    appends and ragged lengths: the paged call's bits are the contiguous call's, eager and replayed from a graph."""
    for nq, hkv in ((1, 8), (4, 32)):
        lens = [4000, 0, 1, 2047 + page, 4095 - nq]
        q, k_cache, v_cache, seqlens, k, v, k_pool, v_pool, table = _paged_case(
            BF16, 32, hkv, nq, 4096 + page, 128, lens, nq, page, seed=page + nq)
        want = fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k=k, v=v,
                                                   return_lse=True)
        got = fa_lib.flash_attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, k=k, v=v,
                                                  return_lse=True, block_table=table)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
        ws = decode.workspace(q)

        def step():
            return fa_lib.flash_attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, return_lse=True,
                                                       block_table=table, workspace=ws)
        eager = step()
        g, captured = _capture(step)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(eager[0], captured[0]) and torch.equal(eager[1], captured[1]) and not ws.any()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("nq, splits", [(1, None), (4, 5)])
def test_gpu_cache_rows_and_leftpads_at_decoding_sizes(nq, splits):
    """cache_batch_idx (rows 5, 0, 3, 1 of six) and cache_leftpad at 8k keys, bf16, appends: by the flash rule
    against the float64 reference over the keys each sequence selects."""
    lens, pad, rows, n_new = [8000, 300, 4096, 7000], [0, 100, 4000, 6999], [5, 0, 3, 1], nq
    g = torch.Generator().manual_seed(nq)
    mk = lambda *shape: torch.randn(*shape, generator=g).to("cuda", BF16)  # noqa: E731
    q, kc, vc = mk(4, 32, nq, 128), mk(6, 8, 8192, 128), mk(6, 8, 8192, 128)
    k, v = mk(4, 8, n_new, 128), mk(4, 8, n_new, 128)
    as_int = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    o, lse = fa_lib.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=as_int(lens), k=k, v=v, num_splits=splits,
                                                 return_lse=True, cache_batch_idx=as_int(rows),
                                                 cache_leftpad=as_int(pad))
    sel_k, sel_v = torch.zeros_like(kc[:4]), torch.zeros_like(vc[:4])  # each sequence's keys from position 0
    after = [n + n_new - p for n, p in zip(lens, pad)]
    for b, (r, p, n) in enumerate(zip(rows, pad, after)):
        sel_k[b, :, :n], sel_v[b, :, :n] = kc[r, :, p:p + n], vc[r, :, p:p + n]
    gold = _decode_ref(q, sel_k, sel_v, after, True, upcast=True)
    base = _decode_ref(q, sel_k, sel_v, after, True, upcast=False)
    assert_flash_rule(dict(o=o, lse=lse), gold, base, names=("o", "lse"))


@pytest.mark.parametrize("kwargs, name", [
    (dict(programs="8", n_blocks=8, sm_count=132), "programs"),
    (dict(programs=8, n_blocks=-1, sm_count=132), "n_blocks"),
    (dict(programs=8, n_blocks=8, sm_count=0), "sm_count"),
    (dict(programs=True, n_blocks=8, sm_count=132), "programs"),
])
def test_num_splits_heuristic_names_a_bad_count(kwargs, name):
    with pytest.raises(ValueError, match=f"{name} must be an int"):
        decode.num_splits_heuristic(**kwargs)


@pytest.mark.parametrize("hq, hkv, nq, splits", [(4, 2, 1, 3), (4, 4, 3, 5), (8, 2, 2, 9)])
def test_a_workspace_gives_the_same_bits_and_is_left_zero(monkeypatch, hq, hkv, nq, splits, kernel_opts):
    """With a caller's workspace the fused merge counts there instead of in a fresh zeroed buffer: the same
    bits, every entry zero again after each call, so the next call (another shape, fewer rows) can reuse it."""
    kernel_opts(decode_fused_merge=True)
    q, k_cache, v_cache, lens, _, _ = _inputs(2, hq, hkv, nq, 150, 32, F16, [150, 77], 0, seed=hq + nq)
    assert decode._fused_merge(splits, hq // hkv * nq, 16, 32) is not None  # the split kernel merges: counts used
    ws = decode.workspace(q)
    assert ws.dtype == torch.int32 and ws.numel() == 2 * hq * nq and not ws.any()
    plain = fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=splits,
                                                return_lse=True)
    for _ in range(2):
        with_ws = fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=splits,
                                                      return_lse=True, workspace=ws)
        assert torch.equal(plain[0], with_ws[0]) and torch.equal(plain[1], with_ws[1])
        assert not ws.any()
    # The counts really are the caller's: from a count that is not zero (left by an interrupted call, or by one
    # running at the same time) the merge comes at the wrong time, here never, and every program of a tile adds
    # its one (why the docstring forbids sharing one workspace across concurrent calls).
    tiles = 2 * hkv  # one query tile per (sequence, cache head): at most 16 packed rows here
    programs = decode._launch_plan(2, hkv, hq // hkv * nq, 150, 32, decode._INTERPRETER_SMS if fa_lib.INTERPRET else
                                   torch.cuda.get_device_properties(q.device).multi_processor_count, splits)[0]
    stale = torch.zeros_like(ws)
    stale[:tiles] = 1000
    fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=splits, workspace=stale)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert stale[:tiles].tolist() == [1000 + programs] * tiles and not stale[tiles:].any()
    small = fa_lib.flash_attention_with_kvcache(q[:1, :, :1], k_cache[:1], v_cache[:1], cache_seqlens=lens[:1],
                                                num_splits=splits, workspace=ws)
    assert torch.equal(small, fa_lib.flash_attention_with_kvcache(q[:1, :, :1], k_cache[:1], v_cache[:1],
                                                                 cache_seqlens=lens[:1], num_splits=splits))
    assert not ws.any()


@pytest.mark.parametrize("ws, error, match", [
    ([0, 0], TypeError, "workspace must be a torch.Tensor"),
    (torch.zeros(64, dtype=torch.int64), TypeError, "workspace must be an int32 tensor"),
    (torch.zeros(7, dtype=torch.int32), ValueError, "at least B \\* H_q \\* N_q = 8 entries"),
    (torch.zeros(4, 4, dtype=torch.int32), ValueError, "contiguous 1-D tensor"),
    (torch.zeros(32, dtype=torch.int32)[::2], ValueError, "contiguous 1-D tensor"),
])
def test_a_bad_workspace_is_named(ws, error, match):
    q, k_cache, v_cache, lens, _, _ = _inputs(2, 4, 2, 1, 40, 32, F16, [40, 3], 0, seed=1, device="cpu")
    if isinstance(ws, torch.Tensor) and DEVICE == "cuda":  # the same strides there (`.cuda()` packs a strided view)
        ws = torch.empty_strided(ws.shape, ws.stride(), dtype=ws.dtype, device="cuda").copy_(ws)
    q, k_cache, v_cache, lens = (t.to(DEVICE) for t in (q, k_cache, v_cache, lens))
    with pytest.raises(error, match=match):
        fa_lib.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, workspace=ws)


def test_workspace_names_a_bad_shape():
    assert fa_lib.decode is decode  # reachable as fa_lib.decode.workspace after a plain `import fa_lib`
    assert decode.workspace((2, 8, 3, 64), "cpu").numel() == 48 and decode.workspace((0, 8, 3, 64), "cpu").numel() == 1
    with pytest.raises(ValueError, match="workspace needs q or its shape"):
        decode.workspace((2, 8, 3))
    with pytest.raises(ValueError, match="workspace needs q or its shape"):
        decode.workspace((2, -1, 3, 64))


@pytest.mark.gpu
@gpu
def test_gpu_a_workspace_gives_the_same_bits_eager_and_in_a_graph():
    """A decoding step of several calls sharing one workspace (no memset per call; on Hopper the split kernel
    launched as a programmatic dependent): the bits of the default calls, eager and replayed from a CUDA
    graph, and the workspace zero after every replay."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=BF16, generator=gen)
    caches = [tuple(torch.randn(1, 8, 16384, 128, device="cuda", dtype=BF16, generator=gen) for _ in "kv")
              for _ in range(3)]
    lens = torch.tensor([16000], dtype=torch.int32, device="cuda")
    ws = decode.workspace(q)

    def step(workspace):
        return [fa_lib.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, return_lse=True,
                                                    workspace=workspace) for kc, vc in caches]
    plain, eager = step(None), step(ws)
    for (o1, l1), (o2, l2) in zip(plain, eager):
        assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert not ws.any()
    g, captured = _capture(lambda: step(ws))
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert not ws.any()
    for (o1, l1), (o2, l2) in zip(plain, captured):
        assert torch.equal(o1, o2) and torch.equal(l1, l2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("interleaved", [True, False])
def test_gpu_rotary_embedding_at_decoding_sizes(interleaved):
    """flash-attn's decoding call with the rotary embedding (fused: `_rotary_q` and the append kernel), 4 sequences,
    32/8 heads, d = 128 with 64 channels rotated, bf16, a draft of 4 appended: against rotating q and k by complex
    multiplication in float64 first and calling without it (bf16 rounding of the rotated inputs apart)."""
    lens = [4000, 0, 17, 2500]
    q, k_cache, v_cache, seqlens, k, v = _inputs(4, 32, 8, 4, 4096, 128, BF16, lens, 4, seed=31)
    cos, sin, theta = _rotary_tables(4096, 64)
    q_s, k_s, v_s = (t.transpose(1, 2) for t in (q, k, v))
    kc_a, vc_a = (t.transpose(1, 2).clone() for t in (k_cache, v_cache))
    got = fa_lib.flash_attn_with_kvcache(q_s, kc_a, vc_a, k_s, v_s, rotary_cos=cos.cuda(), rotary_sin=sin.cuda(),
                                         cache_seqlens=seqlens, causal=True, rotary_interleaved=interleaved)
    start = seqlens.long().cpu()[:, None]
    pos = start + torch.arange(4)[None, :]
    q_r = _rotate_complex(q_s.cpu(), theta, pos, interleaved).cuda()
    k_r = _rotate_complex(k_s.cpu(), theta, pos, interleaved).cuda()
    kc_b, vc_b = (t.transpose(1, 2).clone() for t in (k_cache, v_cache))
    want = fa_lib.flash_attn_with_kvcache(q_r, kc_b, vc_b, k_r, v_s, cache_seqlens=seqlens, causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=3e-2)
    torch.testing.assert_close(kc_a, kc_b, rtol=0, atol=1.6e-2)  # one bf16 rounding of a rotated key apart


def test_the_numpy_rotary_embedding_is_complex_multiplication():
    """reference.rotary_embedding, both pairings, against complex multiplication in float64; bad input named."""
    rng = np.random.default_rng(17)
    x = rng.standard_normal((2, 5, 3, 16))  # (B, N, H, d)
    cos, sin, theta = _rotary_tables(40, 12)
    pos = torch.tensor([[0, 3, 9, 10, 39], [7, 7, 7, 7, 7]])
    for interleaved in (True, False):
        want = _rotate_complex(torch.from_numpy(x), theta, pos, interleaved).numpy()
        got = reference.rotary_embedding(x.transpose(0, 2, 1, 3), theta.cos().numpy(), theta.sin().numpy(),
                                         pos.numpy()[:, None, :].repeat(3, 1), interleaved=interleaved)
        np.testing.assert_allclose(got.transpose(0, 2, 1, 3), want, atol=1e-12)
    with pytest.raises(ValueError, match=r"positions must be integers of shape \(2, 5, 3\) in \[0, 40\)"):
        reference.rotary_embedding(x, cos.numpy(), sin.numpy(), np.full((2, 5, 3), 40))
    with pytest.raises(ValueError, match=r"cos and sin must both be \(n_ro, r\) with 2 r <= d = 16"):
        reference.rotary_embedding(x, np.zeros((4, 9)), np.zeros((4, 9)), np.zeros((2, 5, 3), int))
