"""fa_lib.context_parallel on CPU: gloo process groups of 1 to 4 ranks, kernels under the Triton
interpreter, every rank's output, LSE and gradients judged by the flash-attn 2x rule against attention
over the whole sequence; bad input raises on every rank. A hang fails the test (process timeout) instead
of stalling CI. The NumPy ring (fa_lib.reference.ring_attention) is tested at the end."""

import numpy as np
import pytest

from fa_lib import reference

TIMEOUT_S = 240


def _spawn(world, cases, tmp_path):
    import cp_worker

    results = cp_worker.spawn(cp_worker.run, world, cases, tmp_path, TIMEOUT_S)
    errors = [e for r in results for e in r["errors"]]
    assert not errors, "\n".join(errors)
    assert all(len(r["ok"]) == len(cases) for r in results)
    return results


def _c(kind, layout, causal, dtype="float32", hq=4, hkv=2, n_per_rank=16, **options):
    return dict(kind=kind, layout=layout, causal=causal, dtype=dtype, hq=hq, hkv=hkv, n_per_rank=n_per_rank,
                options=options)


def _p(layout, causal, units, dtype="float32", hq=4, hkv=2, **options):
    return dict(kind="packed", layout=layout, causal=causal, units=units, dtype=dtype, hq=hq, hkv=hkv,
                options=options)


WORLDS = {
    1: [_c("ring", "zigzag", True), _c("ulysses", "contiguous", True), _p("zigzag", True, [3, 0, 2]),
        _c("ring", "zigzag", True, n_per_rank=8, window=(3, 0))],
    2: [_c("ring", "zigzag", True, "float16", one_device=True), _c("ring", "contiguous", False, hkv=4, one_device=True),
        _c("ring", "zigzag", True, "bfloat16", hq=8, hkv=2, n_per_rank=8, head_chunks=2),
        _c("ring", "zigzag", False, n_per_rank=8, window=(5, 3)),
        _c("ring", "zigzag", True, hq=8, hkv=2, n_per_rank=8, strategy="allgather"),
        _c("ulysses", "zigzag", True), _c("ulysses", "contiguous", False, return_lse=False),
        _p("zigzag", True, [2, 1], "bfloat16"), dict(kind="packed_bad"),
        dict(kind="mismatch"), dict(kind="one_rank_bad"), dict(kind="scales_differ"),
        dict(kind="unshard_lengths_differ"), dict(kind="unshard_odd_zigzag"), dict(kind="agree_once"),
        dict(kind="bad_options")],
    3: [_c("ring", "contiguous", True, n_per_rank=8),
        _c("ring", "zigzag", True, "bfloat16", n_per_rank=8, one_device=True),
        _c("ring", "contiguous", False, n_per_rank=8, window=(4, 2), strategy="allgather"),
        _p("contiguous", True, [1, 0, 2]),
        dict(kind="ulysses_heads")],
    4: [_c("ring", "zigzag", True, n_per_rank=8), _c("ring", "contiguous", True, n_per_rank=8, window=(8, 0)),
        _p("zigzag", True, [2, 0, 1], "float16")],
}


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_ring_and_ulysses_match_single_process_attention(world, tmp_path):
    results = _spawn(world, WORLDS[world], tmp_path)
    for r in results:
        for item in r["ok"]:
            if item["case"]["kind"] == "mismatch":
                assert "the ranks disagree on seqlen_q_local: [8, 16]" in item["error"]
            if item["case"]["kind"] == "ulysses_heads":
                assert "must both be divisible by 3" in item["error"]
            if item["case"]["kind"] == "one_rank_bad":  # rank 1 names its reason, rank 0 names rank 1
                assert ("softmax_scale must be a positive finite number" if r["rank"] == 1
                        else "the inputs of rank(s) [1] failed their checks") in item["error"]
            if item["case"]["kind"] == "scales_differ":
                assert "the ranks disagree on softmax_scale" in item["error"]
            if item["case"]["kind"] == "unshard_lengths_differ":
                assert "the ranks disagree on shape_hash" in item["error"]
            if item["case"]["kind"] == "unshard_odd_zigzag":
                assert "x_local.shape[2] = 7 must be divisible by 2" in item["error"]
            if item["case"]["kind"] == "packed_bad":
                assert "the length of document(s) [0, 1] ([3, 13]) must be divisible by 4" in item["error"]
            if item["case"]["kind"] == "agree_once":  # calls with check None, None, True, False, None
                assert item["agree_calls"] == 2
            if item["case"]["kind"] == "bad_options":
                window_neg, window_str, strategy, check = item["errors"]
                assert window_neg.startswith("ValueError: window sizes must be >= 0, or -1 for unbounded")
                assert window_str.startswith("TypeError: window must be a pair of ints")
                assert strategy == "ValueError: strategy must be one of ('ring', 'allgather'), got 'tree'"
                assert check.startswith("TypeError: check must be True")
            options = item["case"].get("options", {})
            if world == 4 and list(options.get("window", [])) == [8, 0] and options.get("strategy") is None:
                # chunks of 8 tokens, a window of 8 back: only the shard of rank - 1 is needed
                assert item["stats"]["steps"] == 2 and item["stats"]["steps_skipped"] == 2, item["stats"]


def test_a_failure_mid_ring_stops_every_rank(tmp_path):
    """Rank 1 raises in its second block: it aborts the group, and every rank raises RuntimeError naming
    rank 1 within seconds, instead of waiting in a transfer until the group's timeout."""
    import cp_worker

    results = cp_worker.spawn(cp_worker.run_failure, 3, [], tmp_path, TIMEOUT_S)
    assert not [e for r in results for e in r["errors"]], results
    for r in results:
        (item,) = r["ok"]
        assert "rank 1 failed: MemoryError: injected failure" in item["error"], item
        assert item["seconds"] < 60


# ---------------------------------------------------------------------------------------------------
# The NumPy mirror.
# ---------------------------------------------------------------------------------------------------
def _shards(x, world, layout):
    chunks = reference.ring_chunks(world, layout)
    c = x.shape[-2] // (world * len(chunks[0]))
    return [np.concatenate([x[..., i * c:(i + 1) * c, :] for i in ids], axis=-2) for ids in chunks]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_numpy_ring_is_exact(world, layout, causal):
    rng = np.random.default_rng(world)
    n = 2 * world * 3
    q, k, v = (rng.standard_normal((2, n, 4)) for _ in range(3))
    ledger = []
    o, lse = reference.ring_attention(_shards(q, world, layout), _shards(k, world, layout), _shards(v, world, layout),
                                      causal=causal, layout=layout, ledger=ledger)
    o_ref, lse_ref = reference.naive_attention(q, k, v, causal=causal)
    for a, b in zip(o, _shards(o_ref, world, layout)):
        np.testing.assert_allclose(a, b, atol=1e-12)
    for a, b in zip(lse, _shards(lse_ref[..., None], world, layout)):
        np.testing.assert_allclose(a, b[..., 0], atol=1e-12)
    assert len(ledger) == world * world  # one entry per (step, rank)
    # Every rank sees every K/V shard exactly once.
    for r in range(world):
        seen = sorted(tuple(e["holds"]) for e in ledger if e["rank"] == r)
        assert seen == sorted(tuple(c) for c in reference.ring_chunks(world, layout))


def test_zigzag_balances_causal_work():
    for world in (2, 3, 4, 8):
        for layout, balanced in (("zigzag", True), ("contiguous", False)):
            ledger = []
            n = 2 * world
            x = np.zeros((1, n, 2))
            reference.ring_attention(_shards(x, world, layout), _shards(x, world, layout), _shards(x, world, layout),
                                     causal=True, layout=layout, ledger=ledger)
            # Work in units of half a pair: a full chunk pair costs 2, a diagonal one 1.
            per = len(reference.ring_chunks(world, layout)[0])
            work = [sum((2 if kind == "full" else 1) * (2 // per) ** 2 for e in ledger if e["rank"] == r
                        for _, _, kind in e["computes"]) for r in range(world)]
            assert (len(set(work)) == 1) == balanced, (layout, work)


def test_bad_layout_is_refused():
    with pytest.raises(ValueError, match="layout must be 'zigzag' or 'contiguous'"):
        reference.ring_chunks(2, "striped")


def test_bad_layout_and_missing_process_group_are_named(tmp_path):
    import torch
    import torch.distributed as dist

    from fa_lib import context_parallel as cp

    x = torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.shard(x, layout="striped")
    for bad, error, match in ((torch.zeros(8), ValueError, "dim must be an int naming one of x's 1 dimensions"),
                              ([1, 2, 3, 4], TypeError, "x must be a torch.Tensor")):
        with pytest.raises(error, match=match):
            cp.shard(bad)
    with pytest.raises(ValueError, match="dim must be an int"):
        cp.shard(x, dim="2")
    for call in (lambda: cp.ring_attention(x, x, x), lambda: cp.unshard(x), lambda: cp.shard(x)):
        with pytest.raises(ValueError, match="needs an initialised torch.distributed process group"):
            call()
    # with a group (one rank here), each argument's own check
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="layout must be one of"):
            cp.ring_attention(x, x, x, layout="striped")
        for bad in (0, 1.5, True):
            with pytest.raises(ValueError, match="head_chunks must be a positive int"):
                cp.ring_attention(x, x, x, head_chunks=bad)
        with pytest.raises(TypeError, match="causal must be a bool"):
            cp.ring_attention(x, x, x, causal=torch.tensor([True, False]))
        with pytest.raises(ValueError, match="dim must be an int naming one of x_local's 4 dimensions"):
            cp.unshard(x, dim=5)
    finally:
        dist.destroy_process_group()


def test_reference_decoding_and_split_inputs_are_checked():
    with pytest.raises(ValueError, match="n must be a non-negative int"):
        reference.split_bounds(-1, 2)
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        reference.split_bounds(10, 0)
    q = np.zeros((1, 2, 1, 4))
    cache = np.zeros((1, 1, 8, 4))
    with pytest.raises(ValueError, match=r"cache_seqlens must be integers of shape \(1,\)"):
        reference.kvcache_attention(q, cache, cache.copy(), np.array([1.5]))
    with pytest.raises(ValueError, match=r"every cache_seqlens\[b\] \+ N_new must lie in \[0, N_max=8\]"):
        reference.kvcache_attention(q, cache, cache.copy(), np.array([9]))
    with pytest.raises(ValueError, match="k and v must be given together"):
        reference.kvcache_attention(q, cache, cache.copy(), np.array([1]), k=np.zeros((1, 1, 1, 4)))
    with pytest.raises(ValueError, match="window sizes must be >= 0"):
        reference.window_visible(4, 4, (-3, 0))
    with pytest.raises(ValueError, match="every q shard must have one shape"):
        reference.ring_attention([np.zeros((3, 4))] * 2, [np.zeros((3, 4))] * 2, [np.zeros((3, 4))] * 2,
                                 layout="zigzag")


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal, window", [(True, (3, 0)), (False, (5, 2)), (False, (0, -1)), (True, (-1, -1))])
def test_numpy_ring_and_allgather_with_a_window(world, layout, causal, window):
    rng = np.random.default_rng(7)
    n = 2 * world * 4
    q, k, v = (rng.standard_normal((2, n, 4)) for _ in range(3))
    o_ref, lse_ref = reference.naive_attention(q, k, v, causal=causal, window=window)
    shards = [_shards(t, world, layout) for t in (q, k, v)]
    ledger = []
    ring = reference.ring_attention(*shards, causal=causal, layout=layout, window=window, ledger=ledger)
    gathered = reference.allgather_attention(*shards, causal=causal, layout=layout, window=window)
    for o, lse in (ring, gathered):
        for a, b in zip(o, _shards(o_ref, world, layout)):
            np.testing.assert_allclose(a, b, atol=1e-12)
        for a, b in zip(lse, _shards(lse_ref[..., None], world, layout)):
            np.testing.assert_allclose(a, b[..., 0], atol=1e-12)
    c = n // (world * len(reference.ring_chunks(world, layout)[0]))
    needed = reference.ring_steps_needed(world, layout, c, causal, window)
    busy = [e["step"] for e in ledger if e["computes"]]
    assert needed == max(busy) + 1
    if window != (-1, -1):
        per = len(reference.ring_chunks(world, layout)[0])
        hidden = sum(len(e["skips"]) for e in ledger)
        assert hidden + sum(len(e["computes"]) for e in ledger) == world * world * per * per


def test_a_short_window_needs_few_ring_steps():
    # 4 ranks, contiguous chunks of 8 tokens, a causal window of 8: a rank needs its own and the previous shard
    assert reference.ring_steps_needed(4, "contiguous", 8, True, (8, 0)) == 2
    assert reference.ring_steps_needed(4, "contiguous", 8, True, (-1, -1)) == 4
    # zigzag puts neighbouring chunks on far ranks (chunk 5 on rank 2 needs chunk 4 on rank 3): every step
    assert reference.ring_steps_needed(4, "zigzag", 4, True, (3, 0)) == 4


def test_fused_merge_is_merge_in_place():
    """The ring's one-kernel merge (interpreter here) against `_merge` and the NumPy mirror's merge_states:
    strided views, a bf16 partial, rows with LSE = -inf on either side or both (no NaN)."""
    import torch

    from fa_lib import context_parallel as cp

    g = torch.Generator().manual_seed(3)
    B, H, n, D = 1, 2, 70, 40
    o, o_b = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g).to(torch.bfloat16)
    lse, lse_b = torch.randn(B, H, n, generator=g), torch.randn(B, H, n, generator=g)
    lse[0, 0, :5], o[0, 0, :5] = float("-inf"), 0.0  # no key seen yet; rows 3-4: nor in the block
    lse_b[0, 0, 3:8], o_b[0, 0, 3:8] = float("-inf"), 0.0
    want_o, want_lse = cp._merge(o, lse, o_b, lse_b)
    lse0 = lse.clone()
    big = torch.full((B, H, n + 20, D), 7.0)
    big[:, :, 10:10 + n] = o
    view = big[:, :, 10:10 + n]
    cp._merge_(view, lse, o_b, lse_b)
    torch.testing.assert_close(view, want_o, rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)) and torch.isneginf(lse[0, 0, 3:5]).all()
    torch.testing.assert_close(lse.nan_to_num(neginf=0), want_lse.nan_to_num(neginf=0), rtol=1e-6, atol=1e-6)
    assert not torch.isnan(big).any() and (big[:, :, :10] == 7).all() and (big[:, :, 10 + n:] == 7).all()
    assert (view[0, 0, 3:5] == 0).all()
    # the mirror: a normalised (o, lse) is the state (m, l, acc) = (lse, 1, o), or (-inf, 0, 0) with no key
    def state(o_, lse_):
        lse_ = lse_.double().numpy()
        seen = np.isfinite(lse_)
        return lse_, seen.astype(float), np.where(seen[..., None], o_.double().numpy(), 0.0)

    m, l, acc = reference.merge_states(state(o, lse0), state(o_b, lse_b))
    np.testing.assert_allclose(acc / np.where(l > 0, l, 1)[..., None], view.double().numpy(), atol=1e-5)
    np.testing.assert_allclose(np.where(l > 0, m + np.log(np.where(l > 0, l, 1)), -np.inf), lse.double().numpy(),
                               atol=1e-5)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_numpy_ring_over_packed_documents(world, layout, causal):
    rng = np.random.default_rng(world)
    per = len(reference.ring_chunks(world, layout)[0])
    lengths = [3 * per * world, 0, per * world, 2 * per * world]
    cu = np.cumsum([0] + lengths)
    q, k, v = (rng.standard_normal((2, cu[-1], 4)) for _ in range(3))
    shards = [reference.shard_documents(t, cu, world, layout) for t in (q, k, v)]
    o, lse = reference.ring_attention_documents(*shards, cu, causal=causal, layout=layout)
    o_ref, lse_ref = np.zeros_like(q), np.zeros(q.shape[:-1])
    for a, b in zip(cu, cu[1:]):  # attention within each document
        if b > a:
            o_ref[:, a:b], lse_ref[:, a:b] = reference.naive_attention(q[:, a:b], k[:, a:b], v[:, a:b], causal=causal)
    for x, y in zip(o, reference.shard_documents(o_ref, cu, world, layout)):
        np.testing.assert_allclose(x, y, atol=1e-12)
    for x, y in zip(lse, reference.shard_documents(lse_ref[..., None], cu, world, layout)):
        np.testing.assert_allclose(x, y[..., 0], atol=1e-12)
    with pytest.raises(ValueError, match="every document length must be divisible"):
        reference.shard_documents(q, [0, 1, cu[-1]], 2, "zigzag")


def test_ring_on_one_device_names_bad_input():
    import torch

    from fa_lib import context_parallel as cp

    x = torch.zeros(1, 2, 12, 8)
    with pytest.raises(ValueError, match=r"q.shape\[2\] = 12 must be divisible by 8 \(zigzag layout over 4 ranks\)"):
        cp.ring_on_one_device(x, x, x, 4, causal=True)
    with pytest.raises(ValueError, match="layout must be"):
        cp.ring_on_one_device(x, x, x, 2, layout="spiral")
    with pytest.raises(ValueError, match="k and v must have q's sequence length 12"):
        cp.ring_on_one_device(x, x[:, :, :8], x[:, :, :8], 2)
    with pytest.raises(ValueError, match=r"do must be a tensor of q's shape \(1, 2, 12, 8\)"):
        cp.ring_on_one_device(x, x, x, 3, do=x[:, :, :6])
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        cp.ring_on_one_device(x.numpy(), x, x, 2)
    with pytest.raises(ValueError, match="world must be a positive int, got 0"):
        cp.ring_on_one_device(x, x, x, 0)
    with pytest.raises(TypeError, match="world must be a positive int, got 2.0"):
        cp.ring_on_one_device(x, x, x, 2.0)
    with pytest.raises(TypeError, match="q has dtype torch.int32; ring_on_one_device supports"):
        cp.ring_on_one_device(x.int(), x.int(), x.int(), 2)
    assert "ring_on_one_device" in cp.__all__  # public (the README names it)


def test_cu_seqlens_is_read_once_per_tensor_and_version(monkeypatch):
    """The documents' lengths are copied to the host once per cu_seqlens tensor (a GPU synchronisation saved for
    every later layer), again after an in-place change, and forgotten with the tensor."""
    import gc

    import torch

    from fa_lib import context_parallel as cp

    reads = []
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    original_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or original_tolist(self))
    assert cp._documents(cu, 16, 2, 2) == (8, 8) and cp._documents(cu, 16, 2, 2) == (8, 8)
    assert len(reads) == 1
    cu[1] = 4  # an in-place change: read again
    assert cp._documents(cu, 16, 2, 2) == (4, 12) and len(reads) == 2
    assert cu in cp._HOST_VALUES
    entries = cp._HOST_VALUES._entries
    key = id(cu)
    del cu
    gc.collect()
    assert key not in entries
