"""Every identity in fa_lib.symbolic, asserted with sympy; plus wrong formulas that must fail.

Each check is ``sympy.simplify(lhs - rhs) == 0`` (``Identity.holds``).  The negative tests make
sure that check can fail: a transpose in the wrong place, a missing scale, an uncentred softmax
gradient are all detected.  The file runs in well under a minute on a laptop CPU.
"""
import sympy as sp
import pytest

from fa_lib import symbolic as sym


def _all_hold(ids):
    bad = [name for name, x in ids.items() if isinstance(x, sym.Identity) and not x.holds()]
    assert not bad, f"identities that do not hold: {bad}"


# ---------------------------------------------------------------------------------------------
# Identity itself
# ---------------------------------------------------------------------------------------------
def test_identity_scalar_matrix_and_matrix_expression():
    x, y = sp.symbols("x y", real=True)
    assert sym.Identity("sq", (x + y) ** 2, x**2 + 2 * x * y + y**2).holds()
    assert not sym.Identity("sq wrong", (x + y) ** 2, x**2 + y**2).holds()
    A = sym.symbol_matrix("A", 2, 2)
    assert sym.Identity("transpose twice", A.T.T, A).holds()
    assert not sym.Identity("transpose", A.T, A).holds()
    n = sp.Symbol("n", integer=True, positive=True)
    M = sp.MatrixSymbol("M", n, n)
    assert sym.Identity("M + M", M + M, 2 * M).holds()
    assert not sym.Identity("M != M^T", M, M.T).holds()


def test_helpers():
    A = sym.symbol_matrix("A", 2, 3)
    assert A.shape == (2, 3) and str(A[1, 2]) == "A_23"
    G = sym.symbol_matrix("G", 2, 3)
    assert sym.gradient(sym.frobenius(G, A), A) == G  # dL/dY = G for L = sum G ⊙ Y
    assert sym.rowsum(sp.Matrix([[1, 2], [3, 4]])) == sp.Matrix([3, 7])
    p = sym.softmax(sp.Matrix([0, 0, 0]))
    assert p == sp.Matrix([sp.Rational(1, 3)] * 3)
    P = sym.softmax_rows(sp.Matrix([[0, 0], [1, 1]]))
    assert P == sp.Matrix([[sp.Rational(1, 2)] * 2] * 2)
    with pytest.raises(ValueError, match="shapes differ"):
        sym.frobenius(G, A.T)
    a = sym.random_rationals(sp.symbols("a b c"), seed=1)
    assert a == sym.random_rationals(sp.symbols("a b c"), seed=1)  # reproducible


# ---------------------------------------------------------------------------------------------
# Matrix products
# ---------------------------------------------------------------------------------------------
def test_matmul_local_derivative():
    _all_hold(sym.matmul_local_derivative(2, 3, 2))


@pytest.mark.parametrize("m,k,n", [(2, 3, 2), (1, 2, 1), (3, 1, 2)])
def test_matmul_gradients_by_indices(m, k, n):
    r = sym.matmul_gradients_by_indices(m, k, n)
    _all_hold(r)
    assert r["dA"].lhs.shape == (m, k) and r["dB"].lhs.shape == (k, n)


def test_matmul_gradients_by_trace():
    r = sym.matmul_gradients_by_trace(2, 3, 2)
    _all_hold(r)
    # dL is linear in the perturbation: no quadratic term survives
    assert all(sp.diff(r["dL_A"], a, 2) == 0 for a in r["deltaA"])


def test_matmul_gradients_symbolic_sizes():
    _all_hold(sym.matmul_gradients_symbolic_sizes())


@pytest.mark.parametrize("symbolic_sizes", [False, True], ids=["concrete", "symbolic-sizes"])
def test_matmul_variants_table(symbolic_sizes):
    table = sym.matmul_variants(symbolic_sizes=symbolic_sizes)
    assert list(table) == ["Y = AB", "Y = A^{T}B", "Y = AB^{T}", "Y = ABC"]
    assert sorted(table["Y = ABC"]) == ["dA", "dB", "dC"]
    for row in table.values():
        _all_hold(row)


def test_matmul_scalar_example():
    r = sym.matmul_scalar_example()
    _all_hold(r)
    a1, a2, b1, b2 = sp.symbols("a_1 a_2 b_1 b_2", real=True)
    assert r["Y"] == a1 * b1 + a2 * b2
    assert r["dA direct"].lhs == sp.Matrix([[b1, b2]])
    assert r["dB direct"].lhs == sp.Matrix([[a1], [a2]])


def test_wrong_matmul_gradients_are_detected():
    # square sizes so that the wrong formulas are at least well-formed
    r = sym.matmul_gradients_by_indices(2, 2, 2)
    A, B, G = r["A"], r["B"], r["G"]
    dA, dB = r["dA"].lhs, r["dB"].lhs
    assert not sym.Identity("dA = B^T dY (wrong order)", dA, B.T * G).holds()
    assert not sym.Identity("dA = dY B (no transpose)", dA, G * B).holds()
    assert not sym.Identity("dB = dY A^T (wrong order)", dB, G * A.T).holds()
    # with rectangular factors the wrong order cannot even be formed: the shape mnemonic
    r = sym.matmul_gradients_by_indices(2, 3, 2)
    with pytest.raises(sp.ShapeError):
        r["B"].T * r["G"]


def test_wrong_variant_is_detected():
    # Y = A^T B with A (2, 2), B (2, 3): the plain-product rule dA = dY B^T is well-formed here
    # (both are 2x2) but wrong; the table's dA = B dY^T is right.
    row = sym.matmul_variants(sizes={"m": 2, "k": 2, "n": 3})["Y = A^{T}B"]
    B, G = sym.symbol_matrix("B", 2, 3), sym.symbol_matrix("G", 2, 3)
    assert sym.Identity("table", row["dA"].lhs, B * G.T).holds()
    assert not sym.Identity("plain-product rule", row["dA"].lhs, G * B.T).holds()


# ---------------------------------------------------------------------------------------------
# Softmax
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("N", [2, 3, 4])
def test_softmax_jacobian(N):
    r = sym.softmax_jacobian(N)
    _all_hold(r)
    assert r["J"].shape == (N, N)


@pytest.mark.parametrize("N", [2, 3, 4])
def test_softmax_backward(N):
    _all_hold(sym.softmax_backward(N))


def test_softmax_rowwise_backward():
    r = sym.softmax_rowwise_backward(2, 3)
    _all_hold(r)
    assert r["dS"].lhs.shape == (2, 3)


def test_softmax_shift_invariance():
    _all_hold(sym.softmax_shift_invariance(3))


def test_softmax_cross_entropy():
    _all_hold(sym.softmax_cross_entropy(3))


def test_softmax_seed_example_exact():
    # s = (1, 2): p_1 = 1/(1+e), and every Jacobian entry is +-p_1 p_2 = +-e/(1+e)^2
    r = sym.softmax_jacobian(2)
    at = dict(zip(r["s"], [1, 2]))
    p1 = sp.simplify(r["p"][0].subs(at))
    assert sp.simplify(p1 - 1 / (1 + sp.E)) == 0
    J = r["J"].subs(at).applyfunc(sp.simplify)
    q = sp.E / (1 + sp.E) ** 2
    assert (J - sp.Matrix([[q, -q], [-q, q]])).applyfunc(sp.simplify) == sp.zeros(2, 2)
    assert abs(float(q) - 0.19661193) < 1e-8


def test_wrong_softmax_gradients_are_detected():
    r = sym.softmax_backward(3)
    p, dp = r["p"], r["dp"]
    assert not sym.Identity("ds = p ⊙ dp (not centred)", r["factored"].lhs,
                            sym.hadamard(p, dp)).holds()
    J = sym.softmax_jacobian(3)
    P = J["p"]
    assert not sym.Identity("J = diag(p)", J["J"], sp.diag(*P)).holds()
    assert not sym.Identity("J = diag(p) - p p^T with p p^T dropped on the diagonal",
                            J["J"], sp.diag(*P) - P * P.T + sp.diag(*[x**2 for x in P])).holds()


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def attention_tau():
    # d = 1 would make 1/sqrt(d) = 1 and hide a misplaced scale: use a free symbol instead
    return sym.attention_backward(2, 1, scale=sp.Symbol("tau", positive=True))


def test_attention_backward_symbolic_scale(attention_tau):
    _all_hold(attention_tau)


def test_attention_backward_default_scale():
    r = sym.attention_backward(2, 2)
    assert r["scale"] == 1 / sp.sqrt(2)
    _all_hold(r)


def test_attention_backward_larger_with_rationals():
    r = sym.attention_backward(3, 2, seed=0)
    for name in ("dV", "dP", "dS"):
        assert r[name].holds(), name


def test_wrong_attention_gradients_are_detected(attention_tau):
    r = attention_tau
    dS, K, Q, sc = r["dS_matrix"], r["K"], r["Q"], r["scale"]
    dQ, dK = r["dQ"].lhs, r["dK"].lhs
    assert not sym.Identity("dQ without the scale", dQ, dS * K).holds()
    assert not sym.Identity("dK = dS Q (no transpose)", dK, dS * Q * sc).holds()
    P, dO = r["P"], r["dO"]
    assert not sym.Identity("dV = P dO (no transpose)", r["dV"].lhs, P * dO).holds()


def test_d_identity_concrete():
    for N, d in [(3, 2), (2, 3)]:
        _all_hold(sym.d_identity(N, d))


def test_d_identity_symbolic_sizes():
    r = sym.d_identity_symbolic_sizes()
    for step in ("linearity lhs", "exchange", "linearity rhs"):
        assert r[step].holds(), step
    # the chain really starts at rowsum(dP ⊙ P) and ends at rowsum(dO ⊙ O): evaluate at N=3, d=2
    N, d = sp.symbols("N d", integer=True, positive=True)
    i = sp.Symbol("i", integer=True, positive=True)
    conc = sym.d_identity(3, 2)
    P, V, dO = (sp.IndexedBase(x) for x in ("P", "V", "dO"))
    to_matrix = {P[a + 1, b + 1]: conc["P"][a, b] for a in range(3) for b in range(3)}
    to_matrix.update({V[a + 1, b + 1]: conc["V"][a, b] for a in range(3) for b in range(2)})
    to_matrix.update({dO[a + 1, b + 1]: conc["dO"][a, b] for a in range(3) for b in range(2)})
    for side, col in (("lhs", conc["D"].lhs), ("rhs", conc["D"].rhs)):
        row1 = r[side].subs({N: 3, d: 2, i: 1}).doit().subs(to_matrix)
        assert sp.expand(row1 - col[0]) == 0, side


def test_wrong_d_identity_is_detected():
    r = sym.d_identity(3, 2)
    P, V, dO = r["P"], r["V"], r["dO"]
    assert not sym.Identity("rowsum(dP ⊙ P) = rowsum(dO ⊙ V)", r["D"].lhs,
                            sym.rowsum(sym.hadamard(dO, V))).holds()


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------
def test_flops():
    f = sym.attention_flops()
    N, d = f.N, f.d
    assert sp.simplify(f.forward - 4 * N**2 * d) == 0
    assert sp.simplify(f.backward - 8 * N**2 * d) == 0
    assert sp.simplify(f.backward_recompute - 10 * N**2 * d) == 0
    assert f.ratio == sp.Rational(5, 4)
    g = sym.attention_flops(4096, 64)
    assert g.forward == 4 * 4096**2 * 64
    assert sym.matmul_flops(2, 3, 4) == 48


# ---------------------------------------------------------------------------------------------
# Logit softcapping
# ---------------------------------------------------------------------------------------------
def test_softcap_derivative():
    r = sym.softcap_derivative()
    for name in ("derivative", "sech", "upper", "lower", "small s", "no cap"):
        assert sp.simplify(r[name].lhs - r[name].rhs) == 0, name  # scalar identities
    assert r["attention row"].holds()
    assert r["attention row"].difference() == sp.zeros(3, 1)
    s, c = r["s"], r["c"]
    # the derivative really is 1 - tanh^2: evaluate both at a few points
    for sv, cv in [(0, 1), (3, 2), (-7, 50), (sp.Rational(1, 3), 5)]:
        at = {s: sv, c: cv}
        got = sp.N(r["derivative"].lhs.subs(at), 30)
        assert abs(got - sp.N(1 - sp.tanh(sp.Rational(sv) / cv) ** 2, 30)) < 1e-25
    # the local gradient lies in (0, 1] and is 1 only at s = 0
    assert r["local_gradient"].subs(s, 0) == 1
    assert 0 < sp.N(r["local_gradient"].subs({s: 100, c: 1})) < 1e-80


def test_wrong_softcap_derivative_is_detected():
    r = sym.softcap_derivative()
    s, c = r["s"], r["c"]
    lhs = r["derivative"].lhs
    x = s / c
    tanh_exp = (sp.exp(x) - sp.exp(-x)) / (sp.exp(x) + sp.exp(-x))
    assert not sym.Identity("missing square", lhs, 1 - tanh_exp).holds()
    assert not sym.Identity("extra 1/c", lhs, (1 - tanh_exp**2) / c).holds()
    row = r["attention row"]
    # without the cap's local gradient the softmax backward alone is wrong
    sv = sym.symbol_vector("s", 3)
    dp = sym.symbol_vector("dp", 3)
    p = sym.softmax(sv.applyfunc(lambda t: c * sp.tanh(t / c)))
    rho = (p.T * dp)[0, 0]
    plain = sym.hadamard(p, dp.applyfunc(lambda t: t - rho))
    assert not sym.Identity("no local gradient", row.lhs, plain).holds()
