"""fa_lib.reference against torch.autograd (float64), against itself (naive vs tiled), and on the
seed documents' worked examples."""
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_lib import reference as ref

# Any RuntimeWarning (overflow, invalid value, divide by zero) from the reference is a failure.
pytestmark = pytest.mark.filterwarnings("error")


# ----------------------------------------------------------------------------------------------
# A torch float64 oracle: autograd through the textbook formula, with the project's conventions.
# ----------------------------------------------------------------------------------------------
def torch_attention(q, k, v, *, causal=False, softmax_scale=None, mask=None):
    """O = softmax(q kᵀ scale) v with autograd; rows with no visible key give 0 (not NaN)."""
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    s = (q @ k.transpose(-1, -2)) * scale  # (..., Nq, Nk)
    vis = torch.ones(s.shape, dtype=torch.bool)
    if mask is not None:
        vis = vis & torch.as_tensor(mask)
    if causal:
        vis = vis & torch.as_tensor(ref.causal_mask(nq, nk))
    empty = ~vis.any(-1, keepdim=True)  # (..., Nq, 1)
    s = torch.where(vis, s, -torch.inf)
    s = torch.where(empty, 0.0, s)  # keep softmax finite on empty rows, then zero them
    p = torch.softmax(s, dim=-1) * (~empty)
    lse = torch.where(empty[..., 0], -torch.inf, torch.logsumexp(s, dim=-1))
    return p @ v, lse


def autograd_reference(q, k, v, do, **kw):
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    o, lse = torch_attention(tq, tk, tv, **kw)
    o.backward(torch.tensor(do, dtype=torch.float64))
    return o.detach().numpy(), lse.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


def rel_err(a, b):
    """max|a - b| / max|b|, with the denominator floored at 1e-3 so an exactly-zero reference
    (e.g. a gradient that vanishes by symmetry) is judged by an absolute error instead."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    finite = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), finite), "infinities differ"
    scale = max(np.max(np.abs(b[finite]), initial=0.0), 1e-3)
    return np.max(np.abs(a[finite] - b[finite]), initial=0.0) / scale


def make_inputs(rng, lead, nq, nk, d, dv=None, dtype=np.float64, scale=1.0):
    dv = d if dv is None else dv
    q = (rng.standard_normal(lead + (nq, d)) * scale).astype(dtype)
    k = (rng.standard_normal(lead + (nk, d)) * scale).astype(dtype)
    v = rng.standard_normal(lead + (nk, dv)).astype(dtype)
    do = rng.standard_normal(lead + (nq, dv)).astype(dtype)
    return q, k, v, do


CASES = [
    # lead, nq, nk, d, dv, causal, block_q, block_k
    ((), 1, 1, 1, 1, False, 64, 64),
    ((2,), 17, 17, 8, 8, True, 4, 4),
    ((2, 3), 33, 20, 16, 16, False, 8, 7),
    ((2, 3), 20, 33, 16, 16, True, 5, 8),  # Nq < Nk: bottom-right causal
    ((1, 2), 30, 9, 8, 4, True, 7, 3),  # Nq > Nk: the first 21 rows see no key
    ((3,), 129, 65, 32, 32, True, 64, 64),  # blocks that do not divide the lengths
]


@pytest.mark.parametrize("lead,nq,nk,d,dv,causal,bq,bk", CASES)
def test_against_torch_autograd_float64(lead, nq, nk, d, dv, causal, bq, bk):
    rng = np.random.default_rng(nq * 1000 + nk)
    q, k, v, do = make_inputs(rng, lead, nq, nk, d, dv)
    o_t, lse_t, dq_t, dk_t, dv_t = autograd_reference(q, k, v, do, causal=causal)

    o_n, lse_n = ref.naive_attention(q, k, v, causal=causal)
    grads_n = ref.naive_attention_backward(q, k, v, do, causal=causal)
    o_f, lse_f = ref.flash_forward(q, k, v, causal=causal, block_q=bq, block_k=bk)
    grads_f = ref.flash_backward(q, k, v, o_f, lse_f, do, causal=causal, block_q=bq, block_k=bk)

    for got, want in [(o_n, o_t), (lse_n, lse_t), (o_f, o_t), (lse_f, lse_t)]:
        assert got.dtype == np.float64 and got.shape == want.shape
        assert rel_err(got, want) <= 1e-10
    for got, want in zip(grads_n + grads_f, (dq_t, dk_t, dv_t) * 2):
        assert got.shape == want.shape
        assert rel_err(got, want) <= 1e-10


def test_mask_and_scale_against_torch():
    rng = np.random.default_rng(7)
    q, k, v, do = make_inputs(rng, (2, 2), 11, 13, 6)
    mask = rng.random((2, 1, 11, 13)) < 0.6  # broadcast over heads
    mask[0, 0, 3] = False  # an empty row
    kw = dict(softmax_scale=0.37, mask=mask, causal=True)
    o_t, lse_t, *grads_t = autograd_reference(q, k, v, do, **kw)
    o_f, lse_f = ref.flash_forward(q, k, v, block_q=4, block_k=5, **kw)
    grads_f = ref.flash_backward(q, k, v, o_f, lse_f, do, block_q=3, block_k=4, **kw)
    assert rel_err(o_f, o_t) <= 1e-10 and rel_err(lse_f, lse_t) <= 1e-10
    for got, want in zip(grads_f, grads_t):
        assert rel_err(got, want) <= 1e-10
    assert np.all(o_f[0, :, 3] == 0) and np.all(np.isneginf(lse_f[0, :, 3]))
    assert np.all(grads_f[0][0, :, 3] == 0)  # dq of the empty row


# ----------------------------------------------------------------------------------------------
# Property tests: tiled == naive on any shape, block size, mask; float32 at extreme magnitudes.
# ----------------------------------------------------------------------------------------------
@st.composite
def attention_problem(draw):
    lead = tuple(draw(st.lists(st.integers(1, 2), max_size=2)))
    nq, nk = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    d, dv = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    causal = draw(st.booleans())
    use_mask = draw(st.booleans())
    bq, bk = draw(st.integers(1, 30)), draw(st.integers(1, 30))
    seed = draw(st.integers(0, 2**32 - 1))
    return lead, nq, nk, d, dv, causal, use_mask, bq, bk, seed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attention_problem())
def test_tiled_equals_naive_property(problem):
    lead, nq, nk, d, dv, causal, use_mask, bq, bk, seed = problem
    rng = np.random.default_rng(seed)
    q, k, v, do = make_inputs(rng, lead, nq, nk, d, dv)
    mask = None
    if use_mask:
        mask = rng.random(lead + (nq, nk)) < 0.5
        mask[..., 0, :] = False  # at least one empty row
    kw = dict(causal=causal, mask=mask)
    o_n, lse_n = ref.naive_attention(q, k, v, **kw)
    o_f, lse_f = ref.flash_forward(q, k, v, block_q=bq, block_k=bk, **kw)
    assert rel_err(o_f, o_n) <= 1e-12 and rel_err(lse_f, lse_n) <= 1e-12
    grads_n = ref.naive_attention_backward(q, k, v, do, **kw)
    grads_f = ref.flash_backward(q, k, v, o_f, lse_f, do, block_q=bq, block_k=bk, **kw)
    for got, want in zip(grads_f, grads_n):
        assert np.all(np.isfinite(got))
        assert rel_err(got, want) <= 1e-11
    # Rows with no visible key: output 0, LSE -inf, zero dq.
    empty = ~np.isfinite(lse_f)
    assert np.all(o_f[empty] == 0) and np.all(grads_f[0][empty] == 0)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 3, 8]), st.sampled_from([1e2, 1e3, 1e4]))
def test_float32_extreme_scores_stay_finite_and_accurate(seed, block, magnitude):
    """Scores near ±magnitude in float32: finite and close to the float64 result on the same inputs."""
    rng = np.random.default_rng(seed)
    n = 19
    q = rng.uniform(-1, 1, (n, 1)).astype(np.float32)
    k = rng.uniform(-1, 1, (n, 1)).astype(np.float32)
    v = rng.standard_normal((n, 4)).astype(np.float32)
    do = rng.standard_normal((n, 4)).astype(np.float32)
    kw = dict(softmax_scale=magnitude, causal=True, block_q=block, block_k=block)
    o32, lse32 = ref.flash_forward(q, k, v, **kw)
    o64, lse64 = ref.flash_forward(*(x.astype(np.float64) for x in (q, k, v)), **kw)
    assert o32.dtype == np.float32 and lse32.dtype == np.float32
    assert np.all(np.isfinite(o32)) and np.all(np.isfinite(lse32))
    # Scores carry an absolute rounding error of ~|s|·eps32, which moves probabilities relatively by as much.
    tol = 8 * magnitude * np.finfo(np.float32).eps + 1e-5
    assert np.max(np.abs(o32 - o64)) <= tol * np.max(np.abs(v))
    assert np.max(np.abs(lse32 - lse64) / np.maximum(np.abs(lse64), 1)) <= 1e-6
    grads = ref.flash_backward(q, k, v, o32, lse32, do, **kw)
    assert all(np.all(np.isfinite(g)) for g in grads)


def test_float32_in_float32_out():
    rng = np.random.default_rng(3)
    q, k, v, do = make_inputs(rng, (2,), 40, 40, 16, dtype=np.float32)
    o, lse = ref.flash_forward(q, k, v, causal=True, block_q=16, block_k=16)
    grads = ref.flash_backward(q, k, v, o, lse, do, causal=True, block_q=16, block_k=16)
    assert o.dtype == lse.dtype == np.float32 and all(g.dtype == np.float32 for g in grads)
    o64 = ref.naive_attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True)[0]
    assert np.max(np.abs(o - o64)) < 1e-5


# ----------------------------------------------------------------------------------------------
# Softmax pieces and the merge
# ----------------------------------------------------------------------------------------------
def test_softmax_variants_agree_and_handle_masked_rows():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 11)) * 30
    x[1, 2] = -np.inf  # a fully masked row
    x[0, 0, :4] = -np.inf
    want = ref.safe_softmax(x)
    assert np.allclose(ref.online_softmax(x), want, rtol=1e-14, atol=0)
    assert np.all(want[1, 2] == 0)
    with np.errstate(over="ignore", invalid="ignore"):
        direct = np.exp(x[0, 1]) / np.exp(x[0, 1]).sum()
    assert np.allclose(want[0, 1], direct, rtol=1e-12)
    assert np.allclose(want.sum(-1)[np.isfinite(x).any(-1)], 1.0)


def test_seed000_online_normalizer_example():
    """Seed 000: x = [1, 3, 2, 5] gives m = 5 and l = e^-4 + e^-2 + e^-3 + 1 ≈ 1.2034."""
    trace = []
    m, l = ref.online_normalizer(np.array([1.0, 3.0, 2.0, 5.0]), trace=trace)
    assert m == 5.0 and abs(l - 1.2034) < 5e-5
    assert math.isclose(l, math.exp(-4) + math.exp(-2) + math.exp(-3) + 1, rel_tol=1e-15)
    assert [round(float(s.l), 4) for s in trace] == [1.0, 1.1353, 1.5032, 1.2034]
    assert [round(float(s.scale), 4) for s in trace] == [0.0, 0.1353, 1.0, 0.1353]
    assert [float(s.m) for s in trace] == [1.0, 3.0, 3.0, 5.0]


@pytest.mark.parametrize("block_size", [1, 2, 3, 7, 100])
def test_online_normalizer_blocks(block_size):
    x = np.random.default_rng(block_size).standard_normal((4, 23)) * 10
    m, l = ref.online_normalizer(x, block_size=block_size)
    assert np.array_equal(m, x.max(-1))
    assert np.allclose(l, np.exp(x - x.max(-1, keepdims=True)).sum(-1), rtol=1e-14)


def test_merge_is_exact_and_associative():
    rng = np.random.default_rng(11)
    s = rng.standard_normal((3, 30)) * 5
    v = rng.standard_normal((3, 30, 4))
    parts = [(0, 7), (7, 8), (8, 20), (20, 30)]
    states = [ref.softmax_state(s[:, a:b], v[:, a:b]) for a, b in parts]
    whole = ref.softmax_state(s, v)
    left = states[0]
    for st_ in states[1:]:
        left = ref.merge_states(left, st_)
    right = states[-1]
    for st_ in reversed(states[:-1]):
        right = ref.merge_states(st_, right)
    tree = ref.merge_states(ref.merge_states(states[0], states[1]), ref.merge_states(states[2], states[3]))
    for merged in (left, right, tree, ref.merge_states(states[1], states[0]) and left):
        for got, want in zip(merged, whole):
            assert np.allclose(got, want, rtol=1e-13, atol=0)
    # (-inf, 0, 0) is the identity: an empty block changes nothing and produces no NaN.
    empty = ref.softmax_state(np.full((3, 2), -np.inf), np.zeros((3, 2, 4)))
    for got, want in zip(ref.merge_states(empty, whole), whole):
        assert np.array_equal(got, want)
    both_empty = ref.merge_states(empty, empty)
    assert np.all(np.isneginf(both_empty[0])) and np.all(both_empty[1] == 0)


def test_merge_commutes():
    rng = np.random.default_rng(12)
    a = ref.softmax_state(rng.standard_normal((5, 6)), rng.standard_normal((5, 6, 2)))
    b = ref.softmax_state(rng.standard_normal((5, 9)) + 3, rng.standard_normal((5, 9, 2)))
    for x, y in zip(ref.merge_states(a, b), ref.merge_states(b, a)):
        assert np.allclose(x, y, rtol=1e-15)


# ----------------------------------------------------------------------------------------------
# The seeds' worked examples
# ----------------------------------------------------------------------------------------------
def test_seed000_softmax_jacobian_example():
    """Seed 000: s = (1, 2), dp = (1, 0) gives ds ≈ (0.197, -0.197).

    With q = [[1]], k = [[1], [2]] and scale 1 the scores are s; with V = I the output is p, so
    dP = dO Vᵀ = dp, and dK = dSᵀ q = ds."""
    q = np.array([[1.0]])
    k = np.array([[1.0], [2.0]])
    v = np.eye(2)
    do = np.array([[1.0, 0.0]])
    o, _ = ref.naive_attention(q, k, v, softmax_scale=1.0)
    assert np.allclose(o, [[0.268941, 0.731059]], atol=1e-6)
    _, dk, _ = ref.naive_attention_backward(q, k, v, do, softmax_scale=1.0)
    ds = dk[:, 0]
    assert np.allclose(ds, [0.197, -0.197], atol=5e-4)
    p1 = 1 / (1 + math.e)
    assert math.isclose(ds[0], p1 * (1 - p1), rel_tol=1e-14) and ds[0] == -ds[1]


SEED002_Q = np.array([[0.2, -0.3], [0.5, 0.1], [-0.4, 0.7], [0.6, -0.2], [0.1, 0.8]])
SEED002_K = np.array([[0.3, 0.5], [-0.2, 0.4], [0.7, -0.1], [0.1, -0.6], [-0.5, 0.2]])
SEED002_V = np.array([[1.0, 0.0], [0.0, 2.0], [-1.0, 1.0], [2.0, -1.0], [0.5, 0.3]])
SEED002_G = np.array([[0.2, -0.1], [0.3, 0.5], [-0.4, 0.2], [0.1, -0.3], [0.6, 0.4]])


def test_seed002_five_position_causal_example():
    q, k, v, g = SEED002_Q, SEED002_K, SEED002_V, SEED002_G
    fwd_trace, bwd_trace = [], []
    o, lse = ref.flash_forward(q, k, v, causal=True, block_q=2, block_k=2, trace=fwd_trace)
    grads = ref.flash_backward(q, k, v, o, lse, g, causal=True, block_q=2, block_k=2, trace=bwd_trace)
    o_t, lse_t, *grads_t = autograd_reference(q, k, v, g, causal=True)
    o_n, _ = ref.naive_attention(q, k, v, causal=True)
    assert np.max(np.abs(o - o_t)) < 1e-14 and np.max(np.abs(o - o_n)) < 1e-14
    assert np.max(np.abs(lse - lse_t)) < 1e-14
    for got, want in zip(grads, grads_t):
        assert np.max(np.abs(got - want)) < 1e-14
    # 6 tiles on or below the diagonal of the 3x3 tile grid; 15 visible query-key pairs.
    assert [(s.i, s.j) for s in fwd_trace] == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    visible = sum(int(s.visible.sum()) if s.visible is not None else s.p.size for s in bwd_trace)
    assert visible == 15 == int(ref.causal_mask(5, 5).sum())
    assert max(s.p.size for s in bwd_trace) == 4  # at most one 2x2 probability tile alive
    assert lse.size == 5 and ref.attention_scores(q, k, causal=True)[1].size == 25
    # The last ledger row of each query block is that block's output.
    for s in fwd_trace:
        if s.j == s.i:
            assert np.allclose(s.o, o[s.rows.start : s.rows.stop], rtol=0, atol=1e-15)


@pytest.mark.parametrize("mask_shape", [(3, 1, 1, 7), (3, 1, 9, 1), (1, 9, 7), (7,)])
def test_broadcast_masks_with_several_blocks(mask_shape):
    """Masks with singleton query or key axes (key-padding masks) broadcast inside every tile."""
    rng = np.random.default_rng(4)
    q, k, v, do = make_inputs(rng, (3, 2), 9, 7, 4)
    mask = rng.random(mask_shape) < 0.7
    o_n, lse_n = ref.naive_attention(q, k, v, mask=mask, causal=True)
    o_f, lse_f = ref.flash_forward(q, k, v, mask=mask, causal=True, block_q=2, block_k=3)
    assert rel_err(o_f, o_n) <= 1e-12 and rel_err(lse_f, lse_n) <= 1e-12
    g_n = ref.naive_attention_backward(q, k, v, do, mask=mask, causal=True)
    g_f = ref.flash_backward(q, k, v, o_f, lse_f, do, mask=mask, causal=True, block_q=2, block_k=3)
    for got, want in zip(g_f, g_n):
        assert rel_err(got, want) <= 1e-11


def test_trace_skips_invisible_tiles_and_matches_output():
    rng = np.random.default_rng(5)
    q, k, v, _ = make_inputs(rng, (), 9, 6, 3)
    trace = []
    o, lse = ref.flash_forward(q, k, v, causal=True, block_q=3, block_k=2, trace=trace)
    # bottom-right: query i sees keys j <= i - 3; rows 0..2 see nothing, so query block 0 does no work.
    assert all(s.i > 0 for s in trace)
    assert np.all(o[:3] == 0) and np.all(np.isneginf(lse[:3]))
    for s in trace:
        assert s.m.shape == (3,) and s.acc.shape == (3, 3)


# ----------------------------------------------------------------------------------------------
# Memory: the tiled path never holds an N x N array
# ----------------------------------------------------------------------------------------------
def peak_bytes(fn):
    """Peak bytes NumPy allocates while ``fn()`` runs, above what was live before (tracemalloc sees them)."""
    import tracemalloc

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_tiled_memory_is_linear_not_quadratic():
    rng = np.random.default_rng(0)
    n, d, b = 1024, 16, 64
    q, k, v, do = make_inputs(rng, (), n, n, d)
    o, lse = ref.flash_forward(q, k, v, block_q=b, block_k=b, causal=True)
    nn_bytes = n * n * 8
    naive = peak_bytes(lambda: ref.naive_attention(q, k, v))
    # causal=True: the mask is built per tile, so not even an N x N boolean array appears.
    fwd = peak_bytes(lambda: ref.flash_forward(q, k, v, block_q=b, block_k=b, causal=True))
    bwd = peak_bytes(lambda: ref.flash_backward(q, k, v, o, lse, do, block_q=b, block_k=b, causal=True))
    assert naive >= 2 * nn_bytes  # S and P
    tile, row = b * b * 8, n * 8
    # Beyond the outputs themselves (o and lse; dq, dk, dv and D), only a handful of tiles are alive.
    assert fwd - (n * d * 8 + row) < 8 * tile
    assert bwd - (3 * n * d * 8 + row) < 8 * tile
    assert max(fwd, bwd) < nn_bytes / 8


# ----------------------------------------------------------------------------------------------
# Bad input: a clear error that names the argument
# ----------------------------------------------------------------------------------------------
def _good():
    rng = np.random.default_rng(0)
    return make_inputs(rng, (2,), 4, 5, 3)


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda q, k, v: (q.tolist(), k, v), TypeError, "q must be a numpy.ndarray"),
        (lambda q, k, v: (q.astype(np.int64), k, v), TypeError, "q must have dtype float32 or float64"),
        (lambda q, k, v: (q.astype(np.float16), k, v), TypeError, "q must have dtype"),
        (lambda q, k, v: (q, k.astype(np.float32), v), TypeError, "share one dtype"),
        (lambda q, k, v: (q[0, 0], k, v), ValueError, "q must have at least 2 dimensions"),
        (lambda q, k, v: (q, k[..., :2], v), ValueError, "k must have head dim 3"),
        (lambda q, k, v: (q, k, v[..., :4, :]), ValueError, "v must have Nk=5 rows"),
        (lambda q, k, v: (q[None], k, v), ValueError, "same leading dimensions"),
        (lambda q, k, v: (q[:, :0], k, v), ValueError, ">= 1"),
    ],
)
@pytest.mark.parametrize("fn", ["naive_attention", "flash_forward"])
def test_bad_input_raises_clear_errors(mutate, exc, match, fn):
    q, k, v, _ = _good()
    with pytest.raises(exc, match=match):
        getattr(ref, fn)(*mutate(q, k, v))


def test_bad_options_raise_clear_errors():
    q, k, v, do = _good()
    with pytest.raises(TypeError, match="mask must be a boolean"):
        ref.flash_forward(q, k, v, mask=np.ones((4, 5)))
    with pytest.raises(ValueError, match="mask of shape"):
        ref.flash_forward(q, k, v, mask=np.ones((4, 6), bool))
    with pytest.raises(TypeError, match="causal must be a bool"):
        ref.flash_forward(q, k, v, causal="yes")
    with pytest.raises(TypeError, match="softmax_scale"):
        ref.flash_forward(q, k, v, softmax_scale="0.5")
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        ref.flash_forward(q, k, v, softmax_scale=float("nan"))
    with pytest.raises(ValueError, match="block_q must be a positive int"):
        ref.flash_forward(q, k, v, block_q=0)
    with pytest.raises(TypeError, match="block_k must be a positive int"):
        ref.flash_forward(q, k, v, block_k=2.5)
    o, lse = ref.flash_forward(q, k, v)
    with pytest.raises(ValueError, match="do must have the shape"):
        ref.flash_backward(q, k, v, o, lse, do[..., :2])
    with pytest.raises(ValueError, match="lse must have shape"):
        ref.flash_backward(q, k, v, o, lse[..., :2], do)
    with pytest.raises(TypeError, match="do must have dtype"):
        ref.naive_attention_backward(q, k, v, do.astype(np.float32))
    with pytest.raises(ValueError, match="a and b must both be"):
        ref.merge_states((1.0, 1.0), (1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="a must be \\(m, l"):
        ref.merge_states((np.zeros(3), np.zeros(2)), (np.zeros(3), np.zeros(3)))
    with pytest.raises(ValueError, match="v must have shape \\(..., n, dv\\)"):
        ref.softmax_state(np.zeros((2, 5)), np.zeros((2, 4, 3)))
    with pytest.raises(TypeError, match="v must have dtype"):
        ref.softmax_state(np.zeros((2, 5), np.float32), np.zeros((2, 5, 3)))
    with pytest.raises(TypeError, match="v must be a numpy.ndarray"):
        ref.softmax_state(np.zeros((2, 5)), [[0.0] * 5] * 2)


def test_causal_mask_bottom_right():
    m = ref.causal_mask(3, 5)
    assert m.tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]
    assert not ref.causal_mask(5, 3)[:2].any()  # Nq > Nk: the first Nq - Nk rows see nothing
    assert np.array_equal(ref.causal_mask(4, 4), np.tril(np.ones((4, 4), bool)))


def test_reference_ring_kvcache_and_tile_helpers_name_bad_arguments():
    """Inputs that used to run silently wrong (k shards longer than q shards, broadcast leading dims, a NaN
    scale) or fail deep inside (block size 0, a float length) raise a clear error naming the argument."""
    rng = np.random.default_rng(0)
    qs = [rng.standard_normal((1, 4, 4)) for _ in range(2)]
    longer = [rng.standard_normal((1, 6, 4)) for _ in range(2)]
    broad = [rng.standard_normal((3, 4, 4)) for _ in range(2)]
    for ks in (longer, broad):
        with pytest.raises(ValueError, match=r"k_shards\[0\] must be an array with the leading dimensions"):
            ref.ring_attention(qs, ks, ks)
    with pytest.raises(ValueError, match="every q shard must be a non-empty array"):
        ref.ring_attention([np.zeros((1, 0, 4))] * 2, [np.zeros((1, 0, 4))] * 2, [np.zeros((1, 0, 4))] * 2)
    q, kc = rng.standard_normal((1, 2, 1, 4)), rng.standard_normal((1, 1, 6, 4))
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        ref.kvcache_attention(q, kc, kc, np.array([3]), softmax_scale=float("nan"))
    with pytest.raises(TypeError, match="causal must be a bool"):
        ref.kvcache_attention(q, kc, kc, np.array([3]), causal="no")
    with pytest.raises(TypeError, match="softmax_scale must be a real number"):
        ref.ring_attention(qs, qs, qs, softmax_scale="x")
    for bad in (0, -1, True, 1.5, None):
        with pytest.raises(ValueError, match="block_q must be an int >= 1"):
            ref.tile_classes(4, 4, bad, 2)
    for bad in (-1, 2.0, "2"):
        with pytest.raises(ValueError, match="nq must be an int >= 0"):
            ref.window_visible(bad, 3)
