"""The NumPy reference's sliding windows, soft-capping and key padding (issue 13, reference first):
checked against brute force, against torch autograd in float64, and tile by tile against the
skipping rule that the kernels will follow."""
import numpy as np
import pytest
import torch

from fa_lib import reference as R


def _torch_attention(q, k, v, visible, scale, softcap):
    q, k, v = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    vis = torch.tensor(np.broadcast_to(visible, s.shape))
    s = s.masked_fill(~vis, float("-inf"))
    empty = ~vis.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    return p @ v, (q, k, v)


@pytest.mark.parametrize("nq, nk", [(7, 7), (5, 9), (9, 4)])
@pytest.mark.parametrize("window", [(-1, -1), (2, 0), (0, 3), (3, 1), (1, -1), (-1, 2), (0, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_window_visible_is_the_band_around_the_bottom_right_diagonal(nq, nk, window, causal):
    vis = R.window_visible(nq, nk, window, causal)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    for i in range(nq):
        for j in range(nk):
            rel = j - (i + nk - nq)
            expect = (left < 0 or rel >= -left) and (right < 0 or rel <= right)
            assert vis[i, j] == expect, (i, j)


@pytest.mark.parametrize("window, causal, softcap", [((-1, -1), False, 0.0), ((3, 2), False, 0.0),
                                                     ((4, -1), True, 0.0), ((-1, -1), True, 5.0),
                                                     ((2, 2), False, 2.0), ((0, 0), False, 1.0)])
@pytest.mark.parametrize("nq, nk", [(11, 11), (6, 13), (13, 5)])
def test_tiled_forward_and_backward_match_torch_autograd(window, causal, softcap, nq, nk):
    rng = np.random.default_rng(nq * 31 + nk)
    q, k, v, do = (rng.standard_normal(shape) * 2.0 for shape in ((2, nq, 8), (2, nk, 8), (2, nk, 8), (2, nq, 8)))
    vis = R.window_visible(nq, nk, window, causal)
    o_t, leaves = _torch_attention(q, k, v, vis, 8 ** -0.5, softcap)
    o_t.backward(torch.tensor(do))
    o, lse = R.flash_forward(q, k, v, causal=causal, window=window, softcap=softcap, block_q=4, block_k=3)
    np.testing.assert_allclose(o, o_t.detach().numpy(), atol=1e-12)
    o_n, lse_n = R.naive_attention(q, k, v, causal=causal, window=window, softcap=softcap)
    np.testing.assert_allclose(o_n, o, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_n))
    grads = R.flash_backward(q, k, v, o, lse, do, causal=causal, window=window, softcap=softcap, block_q=4, block_k=3)
    naive = R.naive_attention_backward(q, k, v, do, causal=causal, window=window, softcap=softcap)
    for got, ref, t in zip(grads, naive, leaves):
        np.testing.assert_allclose(got, t.grad.numpy(), atol=1e-11)
        np.testing.assert_allclose(ref, t.grad.numpy(), atol=1e-11)


def test_softcap_bounds_the_scores_and_keeps_large_logits_finite():
    q = np.full((1, 3, 4), 100.0)
    k = np.full((1, 5, 4), 100.0)
    s, p = R.attention_scores(q, k, softcap=30.0)
    assert np.all(np.abs(s) <= 30.0) and np.all(np.isfinite(p))
    o, lse = R.naive_attention(q, k, k, softcap=30.0)
    np.testing.assert_allclose(lse, 30.0 * np.tanh(100.0 * 100.0 * 4 / 2 / 30.0) + np.log(5), rtol=1e-12)


def test_skipped_tiles_are_exactly_the_empty_ones():
    for nq, nk, window, causal in [(40, 40, (5, 0), False), (40, 40, (7, 3), False), (33, 50, (4, -1), True),
                                   (50, 33, (-1, 6), False), (40, 40, (-1, -1), True)]:
        classes = R.tile_classes(nq, nk, 8, 8, causal=causal, window=window)
        trace = []
        rng = np.random.default_rng(0)
        q, k = rng.standard_normal((nq, 4)), rng.standard_normal((nk, 4))
        R.flash_forward(q, k, k, causal=causal, window=window, block_q=8, block_k=8, trace=trace)
        computed = {(t.i, t.j) for t in trace}
        assert computed == {(i, j) for (i, j), c in np.ndenumerate(classes) if c != "empty"}


def test_tile_classes_with_a_key_padding_row():
    real = np.arange(40) < 21  # a right-padded row: keys 0..20 real
    plain = R.tile_classes(24, 40, 8, 8, causal=True)
    padded = R.tile_classes(24, 40, 8, 8, causal=True, key_valid=real)
    assert np.array_equal(R.tile_classes(24, 40, 8, 8, causal=True, key_valid=np.ones(40, bool)), plain)
    assert np.all(padded[:, 3:] == "empty")  # key blocks from 24 on hold no real key
    assert np.array_equal(padded[:, :2], plain[:, :2])  # blocks of real keys only: as without padding
    assert set(padded[:, 2]) <= {"empty", "partial"}  # keys 16..23: five real, three padded
    assert np.all(R.tile_classes(24, 40, 8, 8, key_valid=np.zeros(40, bool)) == "empty")
    with pytest.raises(ValueError, match=r"key_valid must have shape \(40,\)"):
        R.tile_classes(24, 40, 8, 8, key_valid=real[:-1])
    with pytest.raises(TypeError, match="key_valid must be a boolean numpy.ndarray"):
        R.tile_classes(24, 40, 8, 8, key_valid=real.astype(np.int8))


def test_key_padding_bounds():
    rows = np.array([[1, 1, 1, 0, 0, 0],   # right-padded: 3 real keys
                     [1, 0, 1, 1, 0, 0],   # a hole at key 1, last real key 3
                     [0, 0, 0, 0, 0, 0],   # no real key
                     [1, 1, 1, 1, 1, 1],   # no padding
                     [0, 1, 1, 1, 1, 1]], dtype=bool)  # padding first
    kv_end, lead = R.key_padding_bounds(rows)
    assert kv_end.tolist() == [3, 4, 0, 6, 6] and lead.tolist() == [3, 1, 0, 6, 0]
    assert kv_end.dtype == lead.dtype == np.int64
    kv_end3, lead3 = R.key_padding_bounds(rows.reshape(5, 1, 6))  # leading dimensions are kept
    assert kv_end3.shape == (5, 1) and kv_end3[:, 0].tolist() == kv_end.tolist()
    assert lead3[:, 0].tolist() == lead.tolist()
    with pytest.raises(TypeError, match="key_valid must be a boolean"):
        R.key_padding_bounds(rows.tolist())
    with pytest.raises(ValueError, match="key_valid must have shape"):
        R.key_padding_bounds(np.array(True))


def test_a_window_costs_o_n_w_not_o_n_squared():
    w, b = 16, 16
    counts = {n: int(np.sum(R.tile_classes(n, n, b, b, window=(w, 0)) != "empty")) for n in (256, 512, 1024)}
    # A window as wide as a block touches the diagonal tile and the one left of it: 2 N / B_c - 1 tiles,
    # linear in N, against N^2 / (2 B_r B_c) for the causal mask alone.
    assert all(c == 2 * n // b - 1 for n, c in counts.items())
    assert int(np.sum(R.tile_classes(1024, 1024, b, b, causal=True) != "empty")) == 64 * 65 // 2


def test_key_padding_with_fully_padded_rows():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 1, 5, 4)) for _ in range(3))
    keep = np.array([[True, True, False, False, False], [False] * 5])  # batch 1: every key padded
    mask = keep[:, None, None, :]
    o, lse = R.flash_forward(q, k, v, mask=mask, block_q=2, block_k=2)
    assert np.all(o[1] == 0) and np.all(np.isneginf(lse[1]))
    o_ref, _ = R.naive_attention(q[:1], k[:1, :, :2], v[:1, :, :2])
    np.testing.assert_allclose(o[:1], o_ref, atol=1e-12)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(window=(-2, 3)), ValueError, "window sizes must be >= 0, or -1"),
    (dict(window=(1.5, 2)), TypeError, "window must be a pair of ints"),
    (dict(window=3), TypeError, "window must be a pair of ints"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap="big"), TypeError, "softcap must be a real number"),
])
def test_bad_window_and_softcap(kwargs, error, match):
    x = np.zeros((3, 4))
    with pytest.raises(error, match=match):
        R.flash_forward(x, x, x, **kwargs)


I32 = np.int32
X3 = np.zeros((9, 2, 4))


@pytest.mark.parametrize("q, k, cu_q, cu_k, error, match", [
    (X3, X3, np.array([0, 4, 9], np.int64), np.array([0, 4, 9], I32), TypeError, "cu_seqlens_q must be int32"),
    (X3, X3, np.array([0, 4, 9], I32), np.array([1, 4, 9], I32), ValueError, r"cu_seqlens_k must start at 0"),
    (X3, X3, np.array([0, 6, 4, 9], I32), np.array([0, 4, 4, 9], I32), ValueError,
     "cu_seqlens_q must be non-decreasing"),
    (X3, X3, np.array([0, 4, 8], I32), np.array([0, 4, 9], I32), ValueError,
     r"cu_seqlens_q\[-1\] = 8 must equal the number of packed tokens, 9"),
    (X3, X3, np.array([0, 9], I32), np.array([0, 4, 9], I32), ValueError,
     "cu_seqlens_q and cu_seqlens_k must have the same length"),
    (np.zeros((9, 3, 4)), X3, np.array([0, 9], I32), np.array([0, 9], I32), ValueError,
     "H_q = 3 must be a multiple of H_kv = 2"),
    (np.zeros((1, 9, 2, 4)), X3, np.array([0, 9], I32), np.array([0, 9], I32), ValueError,
     r"q must be \(total_q, H_q, d\)"),
])
def test_varlen_reference_bad_input_names_the_argument(q, k, cu_q, cu_k, error, match):
    with pytest.raises(error, match=match):
        R.varlen_attention(q, k, k, cu_q, cu_k)
