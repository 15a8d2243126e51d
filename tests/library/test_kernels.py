"""fa_lib.flash_attention (the Triton kernel) against plain PyTorch, by the flash-attn 2x rule.

On a machine without CUDA (CI, laptops) fa_lib runs the very same kernels under the Triton
interpreter on CPU tensors, so these tests use small, deliberately awkward shapes: sequence lengths
1, 17, 113 (no multiple of any block size), head dims 16, 40, 64 and non-powers of two 80, 96,
crossed with causal masks, seqlen_q != seqlen_k (bottom-right alignment, rows that see no key),
grouped-query attention, the three dtypes and non-contiguous views. Every case draws fresh inputs
from its own seed and runs with outputs poisoned (NaN) so an unwritten element fails the test.
``tests/library/test_kernels_gpu.py`` repeats the checks at full size on a GPU.
"""
import zlib

import pytest
import torch

from fa_lib import kernels, ops, testing
from fa_lib.testing import assert_flash_rule, forward_backward, make_inputs, reference_forward_backward
from kernel_cases import BF16, F16, F32, case as _case

DEVICE = "cpu" if kernels.INTERPRET else "cuda"


CASES = [
    # Square problems: N in {1, 17, 113} with D in {16, 40, 64}, every dtype, causal or not.
    *[_case(b, hq, hkv, n, n, d, causal, dtype)
      for dtype in (F16, BF16, F32)
      for causal in (False, True)
      for (b, hq, hkv, n, d) in ((2, 2, 1, 1, 16), (2, 3, 1, 17, 40), (1, 2, 1, 113, 64))],
    # seqlen_q != seqlen_k: bottom-right causal alignment; N_q > N_k leaves rows with no visible key.
    *[_case(1, 2, 1, nq, nk, d, causal, F16)
      for causal in (False, True)
      for (nq, nk, d) in ((17, 113, 32), (113, 17, 16), (1, 113, 16), (113, 1, 32))],
    *[_case(1, 2, 1, nq, nk, d, True, dtype)
      for dtype in (BF16, F32)
      for (nq, nk, d) in ((17, 113, 32), (113, 17, 16), (1, 113, 16), (113, 1, 32))],
    # Head dims that are not powers of two (padded to the next one with masked loads).
    _case(1, 2, 2, 33, 33, 80, True, F16),
    _case(1, 2, 1, 17, 29, 96, False, BF16),
    _case(1, 1, 1, 20, 20, 24, True, BF16),
    _case(1, 2, 1, 17, 17, 96, True, F32),
    # Two column tiles in the forward (ops._head_tiles): 48 = 32 + 16, 160 = 128 + 32.
    _case(1, 2, 1, 21, 35, 48, True, F16),
    _case(1, 1, 1, 19, 19, 160, False, F32),
    # Head dims below 16 and rows that are not a multiple of 16 bytes (zero-padded before the launch).
    _case(1, 2, 1, 9, 12, 1, True, F16),
    _case(1, 2, 2, 17, 17, 7, False, BF16),
    _case(1, 1, 1, 10, 10, 3, True, F32),
    _case(2, 2, 1, 5, 5, 12, False, F16, "bnhd"),
    # Non-contiguous views of (B, N, H, D) storage, with grouped-query attention.
    _case(2, 4, 2, 50, 50, 32, True, F16, "bnhd"),
    _case(1, 4, 2, 37, 61, 40, True, BF16, "bnhd"),
    _case(1, 4, 1, 61, 37, 32, False, F32, "bnhd"),
]


@pytest.mark.parametrize("batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype, layout", CASES)
def test_flash_attention_matches_reference(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype,
                                           layout):
    seed = zlib.crc32(repr((batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype, layout)).encode())
    q, k, v, do = make_inputs(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, DEVICE, seed=seed,
                              layout=layout)
    out = forward_backward(q, k, v, do, causal=causal)
    gold = reference_forward_backward(q, k, v, do, causal=causal, upcast=True)
    base = reference_forward_backward(q, k, v, do, causal=causal, upcast=False)
    assert out["o"].shape == (batch, heads_q, seqlen_q, head_dim) and out["o"].dtype == dtype
    assert out["lse"].shape == (batch, heads_q, seqlen_q) and out["lse"].dtype == torch.float32
    assert out["dk"].shape == k.shape and out["dk"].dtype == dtype
    assert_flash_rule(out, gold, base)


def test_rows_without_visible_key_give_zero_and_minus_inf():
    # causal with N_q = 40 > N_k = 8: query i sees key j iff j <= i - 32, so rows 0..31 see nothing.
    q, k, v, do = make_inputs(1, 2, 1, 40, 8, 32, F16, DEVICE, seed=1)
    out = forward_backward(q, k, v, do, causal=True)
    for name in ("o", "lse", "dq", "dk", "dv"):
        assert not torch.isnan(out[name]).any(), name
    assert torch.all(out["o"][:, :, :32] == 0)
    assert torch.all(out["lse"][:, :, :32] == float("-inf"))
    assert torch.all(torch.isfinite(out["lse"][:, :, 32:]))
    assert torch.all(out["dq"][:, :, :32] == 0)
    gold = reference_forward_backward(q, k, v, do, causal=True, upcast=True)
    base = reference_forward_backward(q, k, v, do, causal=True, upcast=False)
    assert_flash_rule(out, gold, base)


def test_lse_values():
    q, k, v, do = make_inputs(2, 2, 2, 45, 70, 64, F32, DEVICE, seed=2)
    out = forward_backward(q, k, v, do, causal=False, softmax_scale=0.3)
    scores = torch.matmul(q.double(), k.double().transpose(-2, -1)) * 0.3  # (B, H, N_q, N_k)
    torch.testing.assert_close(out["lse"].double(), torch.logsumexp(scores, dim=-1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_lse_is_differentiable(dtype):
    q, k, v, do = make_inputs(1, 4, 2, 30, 45, 32, dtype, DEVICE, seed=3)
    dlse = torch.randn(1, 4, 30, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = forward_backward(q, k, v, do, causal=True, dlse=dlse)
    gold = reference_forward_backward(q, k, v, do, causal=True, upcast=True, dlse=dlse)
    base = reference_forward_backward(q, k, v, do, causal=True, upcast=False, dlse=dlse)
    assert_flash_rule(out, gold, base)


def test_custom_softmax_scale():
    q, k, v, do = make_inputs(1, 2, 1, 40, 40, 48, F16, DEVICE, seed=5)
    out = forward_backward(q, k, v, do, causal=True, softmax_scale=0.5)
    gold = reference_forward_backward(q, k, v, do, causal=True, softmax_scale=0.5, upcast=True)
    base = reference_forward_backward(q, k, v, do, causal=True, softmax_scale=0.5, upcast=False)
    assert_flash_rule(out, gold, base)


def test_backward_is_deterministic():
    # Grouped-query attention: dK/dV sum over 4 query heads; no atomics, so runs agree bit for bit.
    q, k, v, do = make_inputs(1, 4, 1, 50, 50, 32, BF16, DEVICE, seed=6)
    first = forward_backward(q, k, v, do, causal=True)
    second = forward_backward(q, k, v, do, causal=True)
    for name in ("o", "lse", "dq", "dk", "dv"):
        assert torch.equal(first[name], second[name]), name


def test_broadcast_upstream_gradient():
    # o.sum().backward() hands the kernel a dO with all strides 0.
    q, k, v, _ = make_inputs(1, 2, 2, 20, 20, 16, F32, DEVICE, seed=7)
    o = ops.flash_attention(q, k, v, causal=True)
    o.sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = testing.attention_ref(*leaves, causal=True)
    ref.sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), leaves):
        torch.testing.assert_close(got.double(), want.grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fwd, dkdv, dq", [((16, 64), (64, 16), (16, 64)), ((64, 32), (32, 64), (64, 32))],
                         ids=["narrow-m", "wide-m"])
def test_other_block_shapes(monkeypatch, fwd, dkdv, dq):
    # The GPU uses other BLOCK_M/BLOCK_N; the loop bounds must be right for any pair, not just the default.
    blocks = {"fwd": fwd, "dkdv": dkdv, "dq": dq}
    monkeypatch.setattr(kernels, "default_config", lambda name, *shape, **kw: (*blocks[name], 4, 1))
    for (nq, nk, causal, seed) in ((113, 70, True, 8), (70, 113, True, 9), (81, 81, False, 10)):
        q, k, v, do = make_inputs(1, 2, 1, nq, nk, 32, F16, DEVICE, seed=seed)
        out = forward_backward(q, k, v, do, causal=causal)
        gold = reference_forward_backward(q, k, v, do, causal=causal, upcast=True)
        base = reference_forward_backward(q, k, v, do, causal=causal, upcast=False)
        assert_flash_rule(out, gold, base)


# ---------------------------------------------------------------------------------------------------
# Input checks: a clear TypeError/ValueError naming the argument, raised before any kernel is touched.
# ---------------------------------------------------------------------------------------------------
def _t(*shape, dtype=F16, device=None):
    return torch.randn(*shape).to(dtype=dtype, device=device or DEVICE)


BAD_INPUTS = [
    ("q-not-tensor", lambda: ([[1.0]], _t(1, 1, 4, 16), _t(1, 1, 4, 16)), {}, TypeError, "q must be a torch.Tensor"),
    ("k-rank-3", lambda: (_t(1, 1, 4, 16), _t(1, 4, 16), _t(1, 4, 16)), {}, ValueError, "k must have 4 dimensions"),
    ("q-float64", lambda: (_t(1, 1, 4, 16, dtype=torch.float64),) * 3, {}, TypeError,
     "q has dtype torch.float64"),
    ("v-dtype-mismatch", lambda: (_t(1, 1, 4, 16), _t(1, 1, 4, 16), _t(1, 1, 4, 16, dtype=F32)), {}, TypeError,
     "v has dtype torch.float32 but q has dtype torch.float16"),
    ("k-device-mismatch", lambda: (_t(1, 1, 4, 16), _t(1, 1, 4, 16, device="meta"), _t(1, 1, 4, 16)), {},
     ValueError, "k is on device meta"),
    ("head-dim-zero", lambda: (_t(1, 1, 4, 0),) * 3, {}, ValueError, r"head_dim \(q.shape\[3\]\) must be"),
    ("head-dim-too-large", lambda: (_t(1, 1, 4, 264),) * 3, {}, ValueError, "between 1 and 256, got 264"),
    ("heads-not-multiple", lambda: (_t(1, 3, 4, 16), _t(1, 2, 4, 16), _t(1, 2, 4, 16)), {}, ValueError,
     r"query heads \(3, q.shape\[1\]\) must be a multiple"),
    ("v-shape", lambda: (_t(1, 1, 4, 16), _t(1, 1, 4, 16), _t(1, 1, 5, 16)), {}, ValueError,
     "v must have the same shape as k"),
    ("k-batch", lambda: (_t(2, 1, 4, 16), _t(1, 1, 4, 16), _t(1, 1, 4, 16)), {}, ValueError,
     r"k must have the batch size of q \(2\)"),
    ("k-head-dim", lambda: (_t(1, 1, 4, 16), _t(1, 1, 4, 32), _t(1, 1, 4, 32)), {}, ValueError,
     r"k must have the head_dim of q \(16\)"),
    ("no-heads", lambda: (_t(1, 0, 4, 16), _t(1, 0, 4, 16), _t(1, 0, 4, 16)), {}, ValueError,
     "at least one head"),
    ("meta-tensors", lambda: (_t(1, 1, 4, 16, device="meta"),) * 3, {}, ValueError, "meta tensors"),
    ("causal-not-bool", lambda: (_t(1, 1, 4, 16),) * 3, {"causal": "yes"}, TypeError, "causal must be a bool"),
    ("scale-negative", lambda: (_t(1, 1, 4, 16),) * 3, {"softmax_scale": -1.0}, ValueError,
     "softmax_scale must be a positive finite number"),
    ("scale-not-number", lambda: (_t(1, 1, 4, 16),) * 3, {"softmax_scale": "0.1"}, TypeError,
     "softmax_scale must be a positive float or None"),
    ("return-lse-not-bool", lambda: (_t(1, 1, 4, 16),) * 3, {"return_lse": 1}, TypeError,
     "return_lse must be a bool"),
    ("deterministic-not-bool", lambda: (_t(1, 1, 4, 16),) * 3, {"deterministic": None}, TypeError,
     "deterministic must be a bool"),
]


@pytest.mark.parametrize("make, kwargs, error, match", [pytest.param(*c[1:], id=c[0]) for c in BAD_INPUTS])
def test_bad_input_raises_before_any_kernel(monkeypatch, make, kwargs, error, match):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("a kernel was launched before the inputs were checked")

    for name in ("_attn_fwd", "_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_fwd_tuned",
                 "_attn_bwd_dkdv_tuned", "_attn_bwd_dq_tuned"):
        monkeypatch.setattr(kernels, name, NoLaunch())
    with pytest.raises(error, match=match):
        ops.flash_attention(*make(), **kwargs)


def test_the_gpu_block_table_can_be_read_on_any_machine():
    """`interpret=False` reads the GPU's table whatever mode this process runs in (chapters 11 and 13 show
    what the H200 launches from a CPU), `interpret=True` the interpreter's one tile."""
    from fa_lib import decode

    assert kernels.default_config("dq", 2, 256, True, 16384, 16384, interpret=False) == (128, 32, 8, 1)
    assert kernels.default_config("fwd", 2, 128, False, 4096, 4096, interpret=False) == (128, 128, 8, 3)
    # the forward's two tiles: 64 + 32 has rows of its own, 64 + 16 reads the row of 128
    assert kernels.default_config("fwd", 2, 96, True, 4096, 4096, interpret=False) == (128, 64, 4, 3)
    assert kernels.default_config("fwd", 2, 96, False, 4096, 4096, interpret=False) == (128, 64, 8, 3)
    assert kernels.default_config("fwd", 2, 80, False, 4096, 4096, interpret=False) == (128, 128, 8, 3)
    tile = kernels._INTERPRETER_DEFAULT or {"fwd": kernels.FWD_CONFIGS[0]}
    if kernels.INTERPRET:
        c = tile["fwd"]
        assert kernels.default_config("fwd", 2, 128, False, 4096, 4096, interpret=True) == (
            c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
    assert decode._config(128, 64, interpret=False) == (64, 64, 4, 3)
    assert decode._config(128, 4, interpret=False) == (16, 128, 4, 3)
    # an unsplit grid of one to a few waves: small key blocks (and at 1k keys up to 8 waves)
    assert decode._config(128, 4, waves=1.9, n_keys=131072, interpret=False) == (16, 32, 4, 4)
    assert decode._config(128, 4, waves=3.9, n_keys=1024, interpret=False) == (16, 32, 4, 4)
    assert decode._config(128, 4, waves=3.9, n_keys=4096, interpret=False) == (16, 128, 4, 3)
    assert decode._config(128, 4, waves=15.5, n_keys=1024, interpret=False) == (16, 128, 4, 3)
    assert decode._config(128, 64, waves=1.9, n_keys=1024, interpret=False) == (64, 64, 4, 3)
    # the launcher's plan (splits, blocks) on the H200's 132 SMs: (B, H_kv, GROUP * N_Q rows, N_max)
    plan = {shape: decode._launch_plan(*shape, 128, 132, interpret=False) for shape in
            [(1, 8, 4, 16384), (64, 8, 4, 1024), (64, 8, 4, 4096), (8, 32, 1, 131072), (64, 32, 1, 1024)]}
    assert list(plan.values()) == [(16, (16, 128, 4, 3)), (1, (16, 32, 4, 4)), (1, (16, 128, 4, 3)),
                                   (1, (16, 32, 4, 4)), (1, (16, 128, 4, 3))]
    assert decode._launch_plan(1, 8, 4, 16384, 128, 132, 3, interpret=False) == (3, (16, 128, 4, 3))


def test_small_grids_take_half_the_rows_at_head_dim_256():
    # Fewer programs than one H200 wave with the table's blocks: the measured small-grid row instead
    # (benchmarks/data/configs-prefill-*); never under other head dims, kernels or an overridden config.
    big_fwd, small_fwd = kernels.SMALL_GRID[("fwd", 2, 256)]
    assert kernels.default_config("fwd", 2, 256, True, 512, 8192, interpret=False) == big_fwd
    assert kernels.small_grid_config("fwd", 2, 256, big_fwd, 2 * 8 * 4) == small_fwd
    assert kernels.small_grid_config("fwd", 2, 256, big_fwd, kernels.SMALL_GRID_PROGRAMS) == big_fwd
    big_dq, small_dq = kernels.SMALL_GRID[("dq", 2, 256)]
    assert kernels.default_config("dq", 2, 256, False, 512, 8192, interpret=False) == big_dq
    assert kernels.small_grid_config("dq", 2, 256, big_dq, 64) == small_dq
    assert kernels.small_grid_config("dkdv", 2, 256, (32, 64, 8, 2), 1) == (32, 64, 8, 2)
    assert kernels.small_grid_config("fwd", 2, 128, (128, 128, 8, 3), 1) == (128, 128, 8, 3)
    assert kernels.small_grid_config("fwd", 2, 256, (64, 32, 4, 2), 1) == (64, 32, 4, 2)  # not the table's
    for kernel, (big, small) in kernels.SMALL_GRID.items():
        assert small[0] < big[0] and small[0] >= 16 and small[2] <= big[2]


def test_the_d96_prefill_dq_takes_half_the_rows_below_two_waves():
    # head dim 96 as two tiles (64 + 32): the dQ kernel's blocks come from the 128-column row, and under two
    # H200 waves of them (a prefill of 512 queries, B = 2, H = 20: 160 programs) the half-row blocks instead
    big, small = kernels.SMALL_GRID[("dq", 2, 96)]
    assert kernels.default_config("dq", 2, 96, False, 512, 8192, interpret=False) == big
    assert kernels.small_grid_config("dq", 2, 96, big, 160) == small == (64, 32, 4, 3)
    assert kernels.small_grid_config("dq", 2, 96, big, 2 * kernels.SMALL_GRID_PROGRAMS) == big
    assert kernels.small_grid_config("dq", 2, 128, big, 160) == big  # one padded tile of 128: not this row
    assert kernels.small_grid_config("dq", 2, 256, kernels.SMALL_GRID[("dq", 2, 256)][0], 160) == \
        kernels.SMALL_GRID[("dq", 2, 256)][0]  # d = 256 keeps one wave as its bound
    # the sweep's square shapes at d = 96 (B * N = 16k, H = 20) run 2560 dQ programs: the table's blocks
    assert kernels.small_grid_config("dq", 2, 96, big, 16384 // 128 * 20) == big


def test_short_causal_forward_at_d96_takes_small_blocks():
    # causal up to 1k keys, 64 x 32 (benchmarks/data/configs-fwd96short-nvidia-h200.json); longer, 128 x 64
    assert kernels.default_config("fwd", 2, 96, True, 256, 256, interpret=False) == (64, 32, 4, 3)
    assert kernels.default_config("fwd", 2, 96, True, 1024, 1024, interpret=False) == (64, 32, 4, 3)
    assert kernels.default_config("fwd", 2, 96, True, 2048, 2048, interpret=False) == (128, 64, 4, 3)
    assert kernels.default_config("fwd", 2, 96, False, 256, 256, interpret=False) == (128, 64, 8, 3)


@pytest.mark.parametrize("programs", [-1, 2.0, True, None])
def test_small_grid_config_names_a_bad_grid_size(programs):
    with pytest.raises(ValueError, match="programs must be a non-negative int"):
        kernels.small_grid_config("fwd", 2, 256, kernels.SMALL_GRID[("fwd", 2, 256)][0], programs)


def test_head_tiles_cover_the_head_dim_with_fewer_columns(monkeypatch, kernel_opts):
    """ops._head_tiles: one power-of-two tile, or two whose widths are powers of two >= 16, the second
    narrower than the first, that make the head dim exactly, with fewer columns than the one tile."""
    for d in range(1, 257):
        one = max(16, ops._next_pow2(d))
        first, second = ops._head_tiles(d)
        if second == 0:
            assert first == one
            continue
        assert first & (first - 1) == 0 and second & (second - 1) == 0 and 16 <= second < first
        assert first < d == first + second < one, d
    expected = {96: (64, 32), 80: (64, 16), 72: (128, 0), 40: (64, 0), 48: (32, 16), 160: (128, 32),
                192: (128, 64), 64: (64, 0), 100: (128, 0), 24: (32, 0), 7: (16, 0), 256: (256, 0)}
    assert {d: ops._head_tiles(d) for d in expected} == expected
    kernel_opts(split_head_dim=False)
    assert {d: ops._head_tiles(d) for d in expected} == {d: (max(16, ops._next_pow2(d)), 0) for d in expected}
    kernel_opts(split_head_dim=frozenset({96}))
    assert ops._head_tiles(96) == (64, 32) and ops._head_tiles(80) == (128, 0)
    with pytest.raises(ValueError, match="split_head_dim must be True, False or a set of head dims, got 'yes'"):
        kernel_opts(split_head_dim="yes")


@pytest.mark.parametrize("d", [80, 96])
def test_two_column_tiles_agree_with_one(monkeypatch, d, kernel_opts):
    """The kernels with two column tiles give what one padded tile gives (float32: only the order of the
    sums differs), forward and backward, with every mask on, dense and packed (varlen)."""
    q, k, v, do = make_inputs(2, 4, 2, 29, 45, d, F32, DEVICE, seed=d)
    kpm = torch.ones(2, 45, dtype=torch.bool, device=DEVICE)
    kpm[1, 30:] = False
    cu = torch.tensor([0, 13, 29], dtype=torch.int32, device=DEVICE)
    packed = [t.detach()[0].transpose(0, 1)[:29].contiguous().requires_grad_() for t in (q, k, v)]
    runs = {}
    for split in (False, True):
        kernel_opts(split_head_dim=split)
        o, lse = ops.flash_attention(q, k, v, causal=True, window=(20, 3), softcap=5.0, key_padding_mask=kpm,
                                     return_lse=True)
        grads = torch.autograd.grad(o, (q, k, v), do)
        o_packed = ops.flash_attention_varlen(*packed, cu, cu, 16, 16, causal=True)
        grads_packed = torch.autograd.grad(o_packed, packed, do[0].transpose(0, 1))
        runs[split] = (o.detach(), lse.detach(), *grads, o_packed.detach(), *grads_packed)
    assert ops._head_tiles(d)[1] > 0  # the second run took two tiles
    for one_tile, two_tiles in zip(runs[False], runs[True]):
        assert not torch.isnan(two_tiles).any()
        torch.testing.assert_close(two_tiles, one_tile, rtol=0, atol=1e-5)
