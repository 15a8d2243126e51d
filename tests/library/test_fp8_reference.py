"""The FP8 (e4m3) reference and the error rule an FP8 forward is judged by (`fa_lib.reference.fp8_*`).

The rule is derived from e4m3's rounding, not tuned to pass: a kernel rounds each exp(s - m) in [0, 1] to e4m3 for
the P @ V product, which moves it by at most max(2^-4 p, 2^-10); `fp8_error_bound` sums that over the keys. Here the
NumPy model of such a kernel (`fp8_attention(quantize_p=True)`) meets the bound, uses a fair part of it, and a
kernel that quantized the scores instead of P breaks it."""
import numpy as np
import pytest
import torch

from fa_lib import reference as R


def test_round_e4m3_is_torchs_float8_e4m3fn():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(50_000) * np.exp(rng.uniform(-12, 7, 50_000))  # subnormals to saturation
    x = np.concatenate([x, [0.0, 448.0, 449.0, -1e4, 2.0 ** -9, 1.5 * 2.0 ** -9, 1.0625, 1.1875]])
    np.testing.assert_array_equal(R.round_e4m3(x), torch.tensor(x).to(torch.float8_e4m3fn).double().numpy())


def test_rounding_errors_are_the_rules_units():
    x = np.linspace(2.0 ** -6, 1.0, 20_001)  # normal numbers: relative error at most 2^-4
    assert np.max(np.abs(R.round_e4m3(x) - x) / x) <= R.E4M3_UNIT
    x = np.linspace(0.0, 2.0 ** -6, 5_001)  # subnormals: absolute error at most 2^-10
    assert np.max(np.abs(R.round_e4m3(x) - x)) <= R.E4M3_SUBNORMAL_ERROR


def _problem(seed, b=2, h=3, n=64, d=32, per_head=False, spread=3.0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((b, h, n, d)) * spread for _ in range(3))
    return [t for x in (q, k, v) for t in R.quantize_e4m3(x, axis=-2 if per_head else None)]


@pytest.mark.parametrize("seed, causal, per_head", [(0, False, False), (1, True, False), (2, True, True)])
def test_a_kernel_that_rounds_p_to_e4m3_meets_the_bound(seed, causal, per_head):
    q8, qs, k8, ks, v8, vs = _problem(seed, per_head=per_head)
    ref, lse = R.fp8_attention(q8, k8, v8, qs, ks, vs, causal=causal)
    kernel, lse_k = R.fp8_attention(q8, k8, v8, qs, ks, vs, causal=causal, quantize_p=True)
    bound = R.fp8_error_bound(q8, k8, v8, qs, ks, vs, causal=causal, out_unit=0.0)
    err = np.abs(kernel - ref)
    assert (err <= bound).all()
    assert err.max() > 0.05 * bound.max()  # the bound is not vacuous: the kernel uses a fair part of it
    np.testing.assert_array_equal(lse, lse_k)  # the LSE comes from unrounded scores
    # the reference is the float64 attention of the dequantized inputs
    o64, _ = R.naive_attention(q8 * qs, k8 * ks, v8 * vs, causal=causal)
    np.testing.assert_allclose(ref, o64, rtol=1e-12, atol=1e-12)


def test_rounding_the_scores_instead_of_p_breaks_the_bound():
    """Quantizing S (before the exponential) instead of P: an error of 2^-4 |s| in the exponent, far outside."""
    q8, qs, k8, ks, v8, vs = _problem(3)
    q, k, v = q8 * qs, k8 * ks, v8 * vs
    s, _ = R.attention_scores(q, k)
    e = np.exp(R.round_e4m3(s) - R.round_e4m3(s).max(-1, keepdims=True))
    o_bad = (e @ v) / e.sum(-1, keepdims=True)
    ref, _ = R.fp8_attention(q8, k8, v8, qs, ks, vs)
    assert (np.abs(o_bad - ref) > R.fp8_error_bound(q8, k8, v8, qs, ks, vs, out_unit=0.0)).any()


def test_quantize_e4m3_per_tensor_and_per_head():
    x = np.random.default_rng(4).standard_normal((2, 3, 5, 4))
    x8, s = R.quantize_e4m3(x)
    assert np.ndim(s) == 0 and np.abs(x8).max() == R.E4M3_MAX
    np.testing.assert_allclose(x8 * s, x, rtol=R.E4M3_UNIT, atol=s * R.E4M3_SUBNORMAL_ERROR)
    x8, s = R.quantize_e4m3(x, axis=-2)
    assert s.shape == (2, 3, 1, 1) and (np.abs(x8).max(axis=(-2, -1)) == R.E4M3_MAX).all()


@pytest.mark.parametrize("call, error, match", [
    (lambda: R.quantize_e4m3([1.0, 2.0]), TypeError, "x must be a numpy.ndarray"),
    (lambda: R.quantize_e4m3(np.array([1.0, np.nan])), ValueError, "x must be finite"),
    (lambda: R.quantize_e4m3(np.ones((2, 3)), axis=2), ValueError, r"axis must be None or an int in \[-2, 2\)"),
    (lambda: R.fp8_attention(np.ones((4, 8)), np.ones((4, 8)), np.ones((4, 8)), 0.0, 1.0, 1.0), ValueError,
     "q_descale must be a positive finite"),
    (lambda: R.fp8_error_bound(np.ones((4, 8)), np.ones((4, 8)), np.ones((4, 8)), 1.0, "1", 1.0), ValueError,
     "k_descale must be a positive finite"),
    (lambda: R.fp8_attention(np.ones(8), np.ones((4, 8)), np.ones((4, 8)), 1.0, 1.0, 1.0), ValueError,
     "q8 must have at least 2 dimensions"),
])
def test_fp8_reference_names_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()
