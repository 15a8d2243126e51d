"""Symbolic derivations (sympy) behind the backward pass of attention.

Every result the book derives by hand is rebuilt here by sympy and returned as an
:class:`Identity`: a left-hand side obtained by *differentiating* (or by some other mechanical
route) and a right-hand side that is the closed form the book writes down.  ``Identity.holds()``
checks ``sympy.simplify(lhs - rhs) == 0`` (entry by entry for matrices).  The chapters display
these objects and ``tests/library/test_symbolic.py`` asserts them.

Conventions, the same as in the rest of fa_lib:

* Gradients use the *denominator layout*: ``dX = dL/dX`` has the shape of ``X``.
* The upstream gradient of a matrix ``Y`` is a matrix of free symbols ``G`` and the loss is
  ``L = sum_ij G_ij Y_ij``, so that ``dL/dY = G`` exactly.  Any other loss only changes ``G``.
* Concrete matrices hold symbols named ``X_ij`` with 1-based indices (``A_12``), real-valued.
* Attention: ``S = Q K^T * scale``, ``P = softmax(S)`` row by row, ``O = P V``; the scale
  defaults to ``1/sqrt(d)``.

Sections, in the order of the book: matrix-product gradients (chapter ``ch-matmul-gradients``),
the softmax Jacobian (``ch-softmax-jacobian``), the attention backward chain and the ``D``
identity (``ch-attention-backward``), FLOP counts (``ch-recomputation``), logit softcapping
(``ch-masks``).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import sympy as sp

__all__ = [
    "Identity",
    "FlopCount",
    # building blocks
    "symbol_matrix",
    "symbol_vector",
    "gradient",
    "frobenius",
    "hadamard",
    "rowsum",
    "softmax",
    "softmax_rows",
    "random_rationals",
    # matrix products
    "matmul_local_derivative",
    "matmul_gradients_by_indices",
    "matmul_gradients_by_trace",
    "matmul_gradients_symbolic_sizes",
    "matmul_variants",
    "matmul_scalar_example",
    # softmax
    "softmax_jacobian",
    "softmax_backward",
    "softmax_rowwise_backward",
    "softmax_shift_invariance",
    "softmax_cross_entropy",
    # attention
    "attention_forward",
    "attention_backward",
    "d_identity",
    "d_identity_symbolic_sizes",
    # masks and score modifiers
    "softcap_derivative",
    # cost
    "matmul_flops",
    "attention_flops",
]


# --------------------------------------------------------------------------------------------
# Identity: one checked equation
# --------------------------------------------------------------------------------------------
def _scalar_is_zero(e: sp.Expr) -> bool:
    # ``cancel`` (a common denominator, exp(...) atoms treated as variables) is exact and much
    # cheaper; when it already gives 0, ``simplify`` gives 0 too.  Otherwise ``simplify`` decides.
    return sp.cancel(e) == 0 or sp.simplify(e) == 0


def _is_zero(expr: Any) -> bool:
    """True when ``expr`` simplifies to 0 (a scalar, an explicit Matrix or a matrix expression)."""
    if isinstance(expr, sp.MatrixBase):
        return all(_scalar_is_zero(e) for e in expr)
    if isinstance(expr, sp.MatrixExpr):
        reduced = sp.simplify(expr.doit())
        return bool(reduced == 0 or reduced.is_ZeroMatrix)
    return _scalar_is_zero(expr)


@dataclass(frozen=True)
class Identity:
    """The claim ``lhs == rhs``, checked by ``sympy.simplify(lhs - rhs) == 0``.

    ``lhs`` is what sympy computes mechanically (usually by differentiating a scalar loss);
    ``rhs`` is the closed form.  ``lhs_tex``/``rhs_tex`` are optional short LaTeX names used by
    :meth:`latex` when the explicit expressions would be too long to read.
    """

    name: str
    lhs: Any
    rhs: Any
    lhs_tex: str | None = None
    rhs_tex: str | None = None

    def difference(self) -> Any:
        """``lhs - rhs`` after ``sympy.simplify`` (entry by entry for an explicit Matrix)."""
        diff = self.lhs - self.rhs
        if isinstance(diff, sp.MatrixBase):
            return diff.applyfunc(sp.simplify)
        if isinstance(diff, sp.MatrixExpr):
            return sp.simplify(diff.doit())
        return sp.simplify(diff)

    def holds(self) -> bool:
        """True when ``sympy.simplify(lhs - rhs)`` is zero."""
        return _is_zero(self.lhs - self.rhs)

    def latex(self, explicit: bool = False) -> str:
        """``lhs = rhs`` in LaTeX; the short names when given, unless ``explicit``."""
        left = self.lhs_tex if (self.lhs_tex and not explicit) else sp.latex(self.lhs)
        right = self.rhs_tex if (self.rhs_tex and not explicit) else sp.latex(self.rhs)
        return f"{left} = {right}"

    def __repr__(self) -> str:  # short: the expressions can be large
        return f"Identity({self.name!r})"


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------
def symbol_matrix(name: str, rows: int, cols: int, **assumptions: Any) -> sp.Matrix:
    """A ``rows x cols`` Matrix of real symbols ``name_ij`` (1-based), e.g. ``A_12``."""
    assumptions.setdefault("real", True)
    return sp.Matrix(
        rows, cols, lambda i, j: sp.Symbol(f"{name}_{i + 1}{j + 1}", **assumptions)
    )


def symbol_vector(name: str, n: int, **assumptions: Any) -> sp.Matrix:
    """A column vector ``(n, 1)`` of real symbols ``name_i`` (1-based), e.g. ``s_2``."""
    assumptions.setdefault("real", True)
    return sp.Matrix(n, 1, lambda i, _: sp.Symbol(f"{name}_{i + 1}", **assumptions))


def gradient(loss: sp.Expr, x: sp.Matrix) -> sp.Matrix:
    """``dL/dX`` in denominator layout: entry ``(i, j)`` is ``diff(loss, x[i, j])``."""
    return x.applyfunc(lambda e: sp.diff(loss, e))


def frobenius(g: sp.Matrix, y: sp.Matrix) -> sp.Expr:
    """``sum_ij g_ij y_ij`` = ``tr(g^T y)``: the loss whose gradient with respect to ``y`` is ``g``."""
    if g.shape != y.shape:
        raise ValueError(f"frobenius: shapes differ, g {g.shape} vs y {y.shape}")
    return sp.Add(*[a * b for a, b in zip(g, y)])


def hadamard(x: sp.Matrix, y: sp.Matrix) -> sp.Matrix:
    """Elementwise product ``x ⊙ y``."""
    return x.multiply_elementwise(y)


def rowsum(x: sp.Matrix) -> sp.Matrix:
    """Row sums as a column vector ``(rows, 1)``."""
    return sp.Matrix(x.rows, 1, lambda i, _: sp.Add(*x.row(i)))


def _sub_rows(x: sp.Matrix, col: sp.Matrix) -> sp.Matrix:
    """``x - col`` with the column vector ``col`` broadcast along each row."""
    return sp.Matrix(x.rows, x.cols, lambda i, j: x[i, j] - col[i, 0])


def softmax(s: sp.Matrix) -> sp.Matrix:
    """``p_i = exp(s_i) / sum_k exp(s_k)`` for a column vector ``s``."""
    e = s.applyfunc(sp.exp)
    z = sp.Add(*e)
    return e.applyfunc(lambda t: t / z)


def softmax_rows(s: sp.Matrix) -> sp.Matrix:
    """Softmax of each row of ``s`` independently (as in attention)."""
    e = s.applyfunc(sp.exp)
    z = [sp.Add(*e.row(i)) for i in range(s.rows)]
    return sp.Matrix(s.rows, s.cols, lambda i, j: e[i, j] / z[i])


def random_rationals(symbols: Iterable[sp.Symbol], seed: int, denominator: int = 4) -> dict:
    """A reproducible substitution ``{symbol: k/denominator}`` with ``k`` in ``[-2 den, 2 den]``.

    Used after differentiating, to keep ``simplify`` fast on the larger concrete sizes.
    """
    rng = random.Random(seed)
    return {
        x: sp.Rational(rng.randint(-2 * denominator, 2 * denominator), denominator)
        for x in symbols
    }


# --------------------------------------------------------------------------------------------
# 1. Gradients of a matrix product  (chapter ch-matmul-gradients)
# --------------------------------------------------------------------------------------------
def matmul_local_derivative(m: int = 2, k: int = 3, n: int = 2) -> dict[str, Identity]:
    """The local derivatives of ``Y = AB`` (one entry of ``Y`` against one entry of ``A`` or ``B``).

    ``dY_{i'j}/dA_{ik} = [i' = i] B_{kj}`` and ``dY_{ij'}/dB_{kj} = [j' = j] A_{ik}``, checked for
    every index combination; the four indices are flattened to a ``(m*n, m*k)`` and a
    ``(m*n, k*n)`` matrix (rows: entries of ``Y``; columns: entries of ``A`` or ``B``).
    """
    A, B = symbol_matrix("A", m, k), symbol_matrix("B", k, n)
    Y = A * B
    rows = [(ip, j) for ip in range(m) for j in range(n)]
    a_cols = [(i, p) for i in range(m) for p in range(k)]
    b_cols = [(p, j) for p in range(k) for j in range(n)]
    dY_dA = sp.Matrix(
        len(rows), len(a_cols), lambda r, c: sp.diff(Y[rows[r]], A[a_cols[c]])
    )
    dY_dA_rule = sp.Matrix(
        len(rows),
        len(a_cols),
        lambda r, c: B[a_cols[c][1], rows[r][1]] if rows[r][0] == a_cols[c][0] else 0,
    )
    dY_dB = sp.Matrix(
        len(rows), len(b_cols), lambda r, c: sp.diff(Y[rows[r]], B[b_cols[c]])
    )
    dY_dB_rule = sp.Matrix(
        len(rows),
        len(b_cols),
        lambda r, c: A[rows[r][0], b_cols[c][0]] if rows[r][1] == b_cols[c][1] else 0,
    )
    return {
        "dY/dA": Identity(
            "dY_i'j/dA_ik = [i'=i] B_kj", dY_dA, dY_dA_rule,
            r"\frac{\partial Y_{i'j}}{\partial A_{ik}}", r"[i'=i]\,B_{kj}",
        ),
        "dY/dB": Identity(
            "dY_ij'/dB_kj = [j'=j] A_ik", dY_dB, dY_dB_rule,
            r"\frac{\partial Y_{ij'}}{\partial B_{kj}}", r"[j'=j]\,A_{ik}",
        ),
    }


def matmul_gradients_by_indices(m: int = 2, k: int = 3, n: int = 2) -> dict[str, Any]:
    """``Y = AB`` with ``A (m, k)``, ``B (k, n)``: ``dA = G B^T`` and ``dB = A^T G`` by the chain rule.

    The loss is ``L = sum_ij G_ij Y_ij`` (so ``dL/dY = G``); sympy differentiates ``L`` with
    respect to every entry of ``A`` and ``B``, which *is* the index sum
    ``dL/dA_ik = sum_{i',j} G_{i'j} dY_{i'j}/dA_ik``.  Returns the matrices and two identities.
    """
    A, B, G = symbol_matrix("A", m, k), symbol_matrix("B", k, n), symbol_matrix("G", m, n)
    Y = A * B
    L = frobenius(G, Y)
    dA, dB = gradient(L, A), gradient(L, B)
    return {
        "A": A, "B": B, "G": G, "Y": Y, "L": L,
        "dA": Identity("dA = dY B^T", dA, G * B.T,
                       r"\frac{\partial L}{\partial A}", r"dY\,B^{T}"),
        "dB": Identity("dB = A^T dY", dB, A.T * G,
                       r"\frac{\partial L}{\partial B}", r"A^{T}\,dY"),
        # one entry written as the collapsed index sum sum_j G_ij B_kj, for display
        "dA_11 sum": Identity(
            "dL/dA_11 = sum_j G_1j B_1j", dA[0, 0],
            sp.Add(*[G[0, j] * B[0, j] for j in range(n)]),
            r"\frac{\partial L}{\partial A_{11}}",
        ),
    }


def matmul_gradients_by_trace(m: int = 2, k: int = 3, n: int = 2) -> dict[str, Any]:
    """The differential (trace) method for ``Y = AB`` on concrete sizes.

    With ``dL = tr(G^T dY)``: perturb ``A`` by ``δA`` (``B`` fixed) so ``dY = δA B`` and
    ``dL = tr(G^T δA B) = tr(B G^T δA) = tr((G B^T)^T δA)``; the gradient is the matrix that
    multiplies ``δA`` in that Frobenius product, read off as the coefficient of each ``δA_ik``.
    Likewise ``dY = A δB`` gives ``dL = tr((A^T G)^T δB)``.
    """
    A, B, G = symbol_matrix("A", m, k), symbol_matrix("B", k, n), symbol_matrix("G", m, n)
    dAm, dBm = symbol_matrix(r"\delta A", m, k), symbol_matrix(r"\delta B", k, n)
    dL_A = (G.T * (dAm * B)).trace()  # tr(G^T dY) with dY = δA B
    dL_B = (G.T * (A * dBm)).trace()  # tr(G^T dY) with dY = A δB
    grad_A = gradient(dL_A, dAm)  # coefficient of each δA_ik (dL is linear in δA)
    grad_B = gradient(dL_B, dBm)
    return {
        "A": A, "B": B, "G": G, "deltaA": dAm, "deltaB": dBm,
        "dL_A": dL_A, "dL_B": dL_B,
        "cyclic A": Identity(
            "tr(G^T δA B) = tr((G B^T)^T δA)", dL_A, ((G * B.T).T * dAm).trace(),
            r"\operatorname{tr}(G^{T}\,\delta A\,B)",
            r"\operatorname{tr}\big((G B^{T})^{T}\,\delta A\big)",
        ),
        "cyclic B": Identity(
            "tr(G^T A δB) = tr((A^T G)^T δB)", dL_B, ((A.T * G).T * dBm).trace(),
            r"\operatorname{tr}(G^{T} A\,\delta B)",
            r"\operatorname{tr}\big((A^{T} G)^{T}\,\delta B\big)",
        ),
        "dA": Identity("dA = dY B^T", grad_A, G * B.T,
                       r"\frac{\partial L}{\partial A}", r"dY\,B^{T}"),
        "dB": Identity("dB = A^T dY", grad_B, A.T * G,
                       r"\frac{\partial L}{\partial B}", r"A^{T}\,dY"),
    }


_m, _k, _n, _r = sp.symbols("m k n r", integer=True, positive=True)


def matmul_gradients_symbolic_sizes() -> dict[str, Any]:
    """``Y = AB`` with symbolic sizes ``A (m, k)``, ``B (k, n)``: sympy's matrix calculus.

    ``L = tr(G^T A B)`` is differentiated with ``MatrixSymbol``s, so the result holds for every
    ``m, k, n`` at once.
    """
    A, B = sp.MatrixSymbol("A", _m, _k), sp.MatrixSymbol("B", _k, _n)
    G = sp.MatrixSymbol("G", _m, _n)
    L = sp.Trace(G.T * A * B)
    return {
        "A": A, "B": B, "G": G, "L": L,
        "dA": Identity("dA = dY B^T (any size)", L.diff(A), G * B.T,
                       r"\frac{\partial}{\partial A}\operatorname{tr}(G^{T} A B)"),
        "dB": Identity("dB = A^T dY (any size)", L.diff(B), A.T * G,
                       r"\frac{\partial}{\partial B}\operatorname{tr}(G^{T} A B)"),
    }


@dataclass(frozen=True)
class _Variant:
    forward_tex: str
    build: Callable  # (A, B, C) -> Y
    shapes: dict  # factor -> (rows, cols), in terms of m, k, n, r
    rules: dict  # factor -> (rule(A, B, C, G), rule_tex)


_VARIANTS = [
    _Variant(
        "Y = AB", lambda A, B, C: A * B, {"A": ("m", "k"), "B": ("k", "n")},
        {"A": (lambda A, B, C, G: G * B.T, r"dY\,B^{T}"),
         "B": (lambda A, B, C, G: A.T * G, r"A^{T}\,dY")},
    ),
    _Variant(
        "Y = A^{T}B", lambda A, B, C: A.T * B, {"A": ("k", "m"), "B": ("k", "n")},
        {"A": (lambda A, B, C, G: B * G.T, r"B\,dY^{T}"),
         "B": (lambda A, B, C, G: A * G, r"A\,dY")},
    ),
    _Variant(
        "Y = AB^{T}", lambda A, B, C: A * B.T, {"A": ("m", "k"), "B": ("n", "k")},
        {"A": (lambda A, B, C, G: G * B, r"dY\,B"),
         "B": (lambda A, B, C, G: G.T * A, r"dY^{T} A")},
    ),
    _Variant(
        "Y = ABC", lambda A, B, C: A * B * C,
        {"A": ("m", "k"), "B": ("k", "r"), "C": ("r", "n")},
        {"A": (lambda A, B, C, G: G * (B * C).T, r"dY\,(BC)^{T}"),
         "B": (lambda A, B, C, G: A.T * G * C.T, r"A^{T}\,dY\,C^{T}"),
         "C": (lambda A, B, C, G: (A * B).T * G, r"(AB)^{T}\,dY")},
    ),
]


def matmul_variants(
    symbolic_sizes: bool = False, sizes: dict | None = None
) -> dict[str, dict[str, Identity]]:
    """The table of variants, each row checked by differentiating ``L = sum G ⊙ Y``.

    Rows: ``Y = AB``, ``Y = A^T B``, ``Y = A B^T``, ``Y = ABC``.  On concrete sizes (default
    ``m=2, k=3, n=2, r=2``: every factor rectangular, so a transpose in the wrong place fails)
    sympy differentiates entry by entry; with ``symbolic_sizes=True`` it differentiates
    ``tr(G^T Y)`` with ``MatrixSymbol``s of sizes ``m, k, n, r``.
    Returns ``{forward_tex: {"dA": Identity, "dB": ..., ["dC": ...]}}``.
    """
    dims = {"m": 2, "k": 3, "n": 2, "r": 2}
    if sizes:
        dims.update(sizes)
    table: dict[str, dict[str, Identity]] = {}
    for v in _VARIANTS:
        if symbolic_sizes:
            sym = {"m": _m, "k": _k, "n": _n, "r": _r}
            mats = {f: sp.MatrixSymbol(f, sym[a], sym[b]) for f, (a, b) in v.shapes.items()}
        else:
            mats = {f: symbol_matrix(f, dims[a], dims[b]) for f, (a, b) in v.shapes.items()}
        A, B, C = mats["A"], mats["B"], mats.get("C")
        Y = v.build(A, B, C)
        if symbolic_sizes:
            G = sp.MatrixSymbol("G", Y.shape[0], Y.shape[1])
            L = sp.Trace(G.T * Y)
            grads = {f: L.diff(x) for f, x in mats.items()}
        else:
            G = symbol_matrix("G", *Y.shape)
            L = frobenius(G, Y)
            grads = {f: gradient(L, x) for f, x in mats.items()}
        row = {}
        for f, (rule, rule_tex) in v.rules.items():
            row[f"d{f}"] = Identity(
                f"{v.forward_tex}: d{f} = {rule_tex}", grads[f], rule(A, B, C, G),
                rf"d{f}", rule_tex,
            )
        table[v.forward_tex] = row
    return table


def matmul_scalar_example() -> dict[str, Any]:
    """``A = [a_1, a_2]`` (1x2), ``B = [b_1, b_2]^T`` (2x1): ``Y = a_1 b_1 + a_2 b_2`` is the loss.

    Direct partial derivatives give ``dA = B^T`` and ``dB = A^T``; the general formulas with
    ``dY = 1`` give the same.
    """
    a1, a2, b1, b2 = sp.symbols("a_1 a_2 b_1 b_2", real=True)
    A, B = sp.Matrix([[a1, a2]]), sp.Matrix([[b1], [b2]])
    Y = (A * B)[0, 0]
    dY = sp.Matrix([[1]])
    dA_direct, dB_direct = gradient(Y, A), gradient(Y, B)
    return {
        "A": A, "B": B, "Y": Y,
        "dA direct": Identity("dA = B^T (direct)", dA_direct, B.T,
                              r"\frac{\partial Y}{\partial A}", r"B^{T}"),
        "dB direct": Identity("dB = A^T (direct)", dB_direct, A.T,
                              r"\frac{\partial Y}{\partial B}", r"A^{T}"),
        "dA formula": Identity("dY B^T = B^T", dY * B.T, B.T, r"dY\,B^{T}", r"B^{T}"),
        "dB formula": Identity("A^T dY = A^T", A.T * dY, A.T, r"A^{T}\,dY", r"A^{T}"),
    }


# --------------------------------------------------------------------------------------------
# 2. The softmax Jacobian  (chapter ch-softmax-jacobian)
# --------------------------------------------------------------------------------------------
def softmax_jacobian(N: int = 3) -> dict[str, Any]:
    """``J_ij = dp_i/ds_j`` of ``p = softmax(s)`` by differentiating ``exp(s_i) / sum_k exp(s_k)``.

    Identities: the entries equal ``p_i δ_ij - p_i p_j``; the matrix equals ``diag(p) - p p^T``;
    ``J`` is symmetric; every column of ``J`` sums to 0.
    """
    s = symbol_vector("s", N)
    p = softmax(s)
    J = sp.Matrix(N, N, lambda i, j: sp.diff(p[i], s[j]))
    entries = sp.Matrix(
        N, N, lambda i, j: p[i] * sp.KroneckerDelta(i, j) - p[i] * p[j]
    )
    return {
        "s": s, "p": p, "J": J,
        "entries": Identity(
            "dp_i/ds_j = p_i δ_ij - p_i p_j", J, entries,
            r"\frac{\partial p_i}{\partial s_j}", r"p_i\,\delta_{ij} - p_i\,p_j",
        ),
        "matrix": Identity("J = diag(p) - p p^T", J, sp.diag(*p) - p * p.T,
                           r"J", r"\operatorname{diag}(p) - p\,p^{T}"),
        "symmetric": Identity("J = J^T", J, J.T, r"J", r"J^{T}"),
        "column sums": Identity("1^T J = 0", sp.ones(1, N) * J, sp.zeros(1, N),
                                r"\mathbf{1}^{T} J", r"0"),
    }


def softmax_backward(N: int = 3) -> dict[str, Any]:
    """``ds = J^T dp = p ⊙ (dp - p^T dp)``, two ways.

    * ``"factored"``: with ``p`` and ``dp`` free symbols and ``J = diag(p) - p p^T``, the product
      ``J^T dp`` equals ``p ⊙ dp - (p^T dp) p`` identically (no constraint on ``p`` is needed).
    * ``"derived"``: ``L = sum_i dp_i softmax(s)_i`` differentiated with respect to ``s``.
    """
    pv, dp = symbol_vector("p", N), symbol_vector("dp", N)
    J = sp.diag(*pv) - pv * pv.T
    rho = (pv.T * dp)[0, 0]
    factored = hadamard(pv, dp.applyfunc(lambda t: t - rho))
    s = symbol_vector("s", N)
    ps = softmax(s)
    L = (dp.T * ps)[0, 0]
    rho_s = (ps.T * dp)[0, 0]
    return {
        "p": pv, "dp": dp, "J": J, "rho": rho,
        "factored": Identity(
            "J^T dp = p ⊙ (dp - p^T dp)", J.T * dp, factored,
            r"J^{T} dp", r"p \odot \left(dp - p^{T} dp\right)",
        ),
        "derived": Identity(
            "dL/ds = p ⊙ (dp - p^T dp)", gradient(L, s),
            hadamard(ps, dp.applyfunc(lambda t: t - rho_s)),
            r"\frac{\partial L}{\partial s}", r"p \odot \left(dp - p^{T} dp\right)",
        ),
    }


def softmax_rowwise_backward(rows: int = 2, cols: int = 3) -> dict[str, Any]:
    """Row-wise softmax ``P = softmax(S)``: ``dS = P ⊙ (dP - rowsum(dP ⊙ P))``.

    ``L = sum_ij dP_ij P_ij`` with ``dP`` a matrix of free symbols; sympy differentiates with
    respect to every ``S_ij``.
    """
    S, dP = symbol_matrix("S", rows, cols), symbol_matrix("dP", rows, cols)
    P = softmax_rows(S)
    L = frobenius(dP, P)
    closed = hadamard(P, _sub_rows(dP, rowsum(hadamard(dP, P))))
    return {
        "S": S, "dP": dP, "P": P,
        "dS": Identity(
            "dS = P ⊙ (dP - rowsum(dP ⊙ P))", gradient(L, S), closed,
            r"\frac{\partial L}{\partial S}",
            r"P \odot \left(dP - \operatorname{rowsum}(dP \odot P)\right)",
        ),
    }


def softmax_shift_invariance(N: int = 3) -> dict[str, Any]:
    """``softmax(s + c) = softmax(s)``; a constant upstream gradient ``dp = c 1`` gives ``ds = 0``."""
    s, c = symbol_vector("s", N), sp.Symbol("c", real=True)
    p = softmax(s)
    shifted = softmax(s.applyfunc(lambda t: t + c))
    const = sp.ones(N, 1) * c
    rho = (p.T * const)[0, 0]
    return {
        "shift": Identity("softmax(s + c) = softmax(s)", shifted, p,
                          r"\operatorname{softmax}(s + c\mathbf{1})",
                          r"\operatorname{softmax}(s)"),
        "constant dp": Identity(
            "p ⊙ (c1 - p^T c1) = 0", hadamard(p, const.applyfunc(lambda t: t - rho)),
            sp.zeros(N, 1), r"p \odot \left(c\mathbf{1} - p^{T} c\mathbf{1}\right)", r"0",
        ),
    }


def softmax_cross_entropy(N: int = 3) -> dict[str, Any]:
    """Cross-entropy ``L = -sum_i y_i log p_i`` with ``sum_i y_i = 1``: ``ds = p - y``, ``ρ = -1``.

    ``y_N`` is written as ``1 - (y_1 + ... + y_{N-1})`` so that the constraint is built in.
    """
    s = symbol_vector("s", N)
    free = [sp.Symbol(f"y_{i + 1}", real=True) for i in range(N - 1)]
    y = sp.Matrix(free + [1 - sp.Add(*free)])
    p = softmax(s)
    L = -sp.Add(*[y[i] * sp.log(p[i]) for i in range(N)])
    dp = sp.Matrix(N, 1, lambda i, _: -y[i] / p[i])  # dL/dp_i with p as the variable
    rho = (p.T * dp)[0, 0]
    return {
        "s": s, "y": y, "p": p, "L": L, "dp": dp,
        "ds": Identity("dL/ds = p - y", gradient(L, s), p - y,
                       r"\frac{\partial L}{\partial s}", r"p - y"),
        "rho": Identity("ρ = p^T dp = -1", rho, sp.Integer(-1), r"\rho = p^{T} dp", r"-1"),
        "general form": Identity(
            "p ⊙ (dp - ρ) = p - y", hadamard(p, dp.applyfunc(lambda t: t - rho)), p - y,
            r"p \odot (dp - \rho)", r"p - y",
        ),
    }


# --------------------------------------------------------------------------------------------
# 3. Backward through attention and the D identity  (chapter ch-attention-backward)
# --------------------------------------------------------------------------------------------
def attention_forward(N: int = 2, d: int = 2, scale: Any = None) -> dict[str, Any]:
    """Symbolic ``S = Q K^T * scale``, ``P = softmax(S)``, ``O = P V`` and ``L = sum G ⊙ O``.

    ``Q, K, V, G`` are ``(N, d)`` matrices of symbols; ``scale`` defaults to ``1/sqrt(d)``.
    """
    scale = 1 / sp.sqrt(d) if scale is None else sp.sympify(scale)
    Q, K, V = symbol_matrix("Q", N, d), symbol_matrix("K", N, d), symbol_matrix("V", N, d)
    G = symbol_matrix("dO", N, d)
    S = Q * K.T * scale
    P = softmax_rows(S)
    O = P * V
    return {"Q": Q, "K": K, "V": V, "dO": G, "scale": scale,
            "S": S, "P": P, "O": O, "L": frobenius(G, O)}


def attention_backward(
    N: int = 2, d: int = 2, scale: Any = None, seed: int | None = None
) -> dict[str, Any]:
    """The chain ``dV, dP, dS, dQ, dK`` of attention, each against sympy's own derivative.

    * ``dV = P^T dO`` and ``dQ = dS K scale``, ``dK = dS^T Q scale``: ``L(Q, K, V)`` is
      differentiated directly.
    * ``dP = dO V^T``: ``L`` as a function of a free ``P`` (``O = P V``).
    * ``dS = P ⊙ (dP - rowsum(dP ⊙ P))``: ``L`` as a function of a free ``S``.

    With ``seed`` given, ``Q, K, V`` (and the free ``S``) are replaced by random rationals
    *after* differentiating (``dO`` stays symbolic), which keeps ``simplify`` fast for larger
    ``N, d``; with ``seed=None`` every check is fully symbolic.
    """
    fw = attention_forward(N, d, scale)
    Q, K, V, G, sc, P, L = (fw[x] for x in ("Q", "K", "V", "dO", "scale", "P", "L"))
    dP = G * V.T
    dS = hadamard(P, _sub_rows(dP, rowsum(hadamard(dP, P))))

    # L with P, and with S, as free variables
    Pf, Sf = symbol_matrix("P", N, N), symbol_matrix("S", N, N)
    L_P = frobenius(G, Pf * V)
    Pof = softmax_rows(Sf)
    L_S = frobenius(G, Pof * V)
    dS_free = hadamard(Pof, _sub_rows(dP, rowsum(hadamard(dP, Pof))))

    pairs = {  # name: (sympy's derivative, closed form, plain name, LaTeX)
        "dV": (gradient(L, V), P.T * G, "P^T dO", r"P^{T} dO"),
        "dP": (gradient(L_P, Pf), G * V.T, "dO V^T", r"dO\,V^{T}"),
        "dS": (gradient(L_S, Sf), dS_free, "P ⊙ (dP - rowsum(dP ⊙ P))",
               r"P \odot \left(dP - \operatorname{rowsum}(dP \odot P)\right)"),
        "dQ": (gradient(L, Q), dS * K * sc, "dS K scale", r"dS\,K \cdot \mathrm{scale}"),
        "dK": (gradient(L, K), dS.T * Q * sc, "dS^T Q scale", r"dS^{T} Q \cdot \mathrm{scale}"),
    }
    subs = {}
    if seed is not None:
        subs = random_rationals(list(Q) + list(K) + list(V) + list(Sf), seed)
    out: dict[str, Any] = dict(fw)
    out["dP_matrix"], out["dS_matrix"] = dP, dS
    for name, (lhs, rhs, plain, tex) in pairs.items():
        if subs:
            lhs, rhs = lhs.xreplace(subs), rhs.xreplace(subs)
        out[name] = Identity(f"{name} = {plain}", lhs, rhs,
                             rf"\frac{{\partial L}}{{\partial {name[1:]}}}", tex)
    return out


def d_identity(N: int = 3, d: int = 2) -> dict[str, Any]:
    """``rowsum(dP ⊙ P) = rowsum(dO ⊙ O)`` with ``dP = dO V^T`` and ``O = P V``.

    ``P`` is an arbitrary ``(N, N)`` matrix of symbols: the rows need not sum to 1, because the
    identity only uses ``O = P V`` (exchange ``sum_j`` and ``sum_k`` in
    ``sum_j P_ij sum_k dO_ik V_jk``).  Also returns, for row 1, the two orders of summation as
    explicit double sums (``"row 1, j outer"``/``"row 1, k outer"``) with the identity between them.
    """
    P, V, dO = symbol_matrix("P", N, N), symbol_matrix("V", N, d), symbol_matrix("dO", N, d)
    dP, O = dO * V.T, P * V
    lhs, rhs = rowsum(hadamard(dP, P)), rowsum(hadamard(dO, O))
    # row 0: the two nested sums, unevaluated order made explicit as a list of terms
    j_outer = sp.Add(*[P[0, j] * sp.Add(*[dO[0, k] * V[j, k] for k in range(d)])
                       for j in range(N)], evaluate=False)
    k_outer = sp.Add(*[dO[0, k] * sp.Add(*[P[0, j] * V[j, k] for j in range(N)])
                       for k in range(d)], evaluate=False)
    return {
        "P": P, "V": V, "dO": dO, "dP": dP, "O": O,
        "D": Identity(
            "rowsum(dP ⊙ P) = rowsum(dO ⊙ O)", lhs, rhs,
            r"\operatorname{rowsum}(dP \odot P)", r"\operatorname{rowsum}(dO \odot O)",
        ),
        "row 1": Identity(
            "sum_j P_1j sum_k dO_1k V_jk = sum_k dO_1k sum_j P_1j V_jk", j_outer, k_outer,
            r"\sum_j P_{1j} \sum_k dO_{1k} V_{jk}", r"\sum_k dO_{1k} \sum_j P_{1j} V_{jk}",
        ),
    }


def _push_into_inner_sum(outer: sp.Sum) -> sp.Sum:
    """``sum_a c(a) * sum_b f(a, b)`` -> ``sum_a sum_b c(a) f(a, b)`` (linearity of the inner sum)."""
    (inner,) = [t for t in sp.Mul.make_args(outer.function) if isinstance(t, sp.Sum)]
    factor = outer.function / inner
    return sp.Sum(factor * inner.function, *inner.limits, *outer.limits)


def _factor_out_of_inner_sum(double: sp.Sum) -> sp.Sum:
    """The inverse step, done by sympy: ``factor_sum`` pulls the factors that do not depend on the
    inner index out of the inner sum of ``sum_a sum_b c(a) f(a, b)``."""
    from sympy.simplify.simplify import factor_sum

    inner = sp.Sum(double.function, double.limits[0])
    return sp.Sum(factor_sum(inner), *double.limits[1:])


def _latex_nested(double: sp.Sum) -> str:
    """LaTeX of a multiple sum written as nested sums, outermost first."""
    heads = [rf"\sum_{{{sp.latex(x)}={sp.latex(a)}}}^{{{sp.latex(b)}}}"
             for x, a, b in reversed(double.limits)]
    return " ".join(heads) + " " + sp.latex(double.function)


def d_identity_symbolic_sizes() -> dict[str, Any]:
    """The ``D`` identity for symbolic ``N`` and ``d`` with indexed objects, as a chain of steps.

    Row ``i`` of ``rowsum(dP ⊙ P)`` is ``sum_{j=1}^N P_ij sum_{k=1}^d dO_ik V_jk`` (``"lhs"``)
    and row ``i`` of ``rowsum(dO ⊙ O)`` is ``sum_{k=1}^d dO_ik sum_{j=1}^N P_ij V_jk``
    (``"rhs"``).  sympy's ``simplify`` cannot equate them directly for symbolic bounds, so the
    proof is three checked steps:

    1. ``"linearity lhs"``: ``lhs`` equals the double sum ``sum_j sum_k P_ij dO_ik V_jk``
       (sympy's ``factor_sum`` pulls ``P_ij`` back out of the inner sum);
    2. ``"exchange"``: the two finite sums swap (``Sum.reorder``), giving
       ``sum_k sum_j P_ij dO_ik V_jk``;
    3. ``"linearity rhs"``: that double sum equals ``rhs`` (``factor_sum`` pulls ``dO_ik`` out).
    """
    N, d = sp.symbols("N d", integer=True, positive=True)
    i, j, k = sp.symbols("i j k", integer=True, positive=True)
    P, V, dO = sp.IndexedBase("P"), sp.IndexedBase("V"), sp.IndexedBase("dO")
    lhs = sp.Sum(P[i, j] * sp.Sum(dO[i, k] * V[j, k], (k, 1, d)), (j, 1, N))
    rhs = sp.Sum(dO[i, k] * sp.Sum(P[i, j] * V[j, k], (j, 1, N)), (k, 1, d))
    lhs_double = _push_into_inner_sum(lhs)  # sum_j sum_k (k innermost)
    rhs_double = _push_into_inner_sum(rhs)  # sum_k sum_j (j innermost)
    exchanged = lhs_double.reorder((0, 1))  # sum_k sum_j
    steps = {
        "linearity lhs": Identity("pull P_ij into the k-sum", lhs,
                                  _factor_out_of_inner_sum(lhs_double),
                                  sp.latex(lhs), _latex_nested(lhs_double)),
        "exchange": Identity("exchange the j- and k-sums", exchanged, rhs_double,
                             _latex_nested(lhs_double), _latex_nested(rhs_double)),
        "linearity rhs": Identity("pull dO_ik into the j-sum", rhs,
                                  _factor_out_of_inner_sum(rhs_double),
                                  sp.latex(rhs), _latex_nested(rhs_double)),
    }
    return {
        "lhs": lhs, "rhs": rhs, "lhs double": lhs_double, "rhs double": rhs_double,
        **steps,
        "chain": " = ".join([sp.latex(lhs), _latex_nested(lhs_double),
                             _latex_nested(rhs_double), sp.latex(rhs)]),
    }


# --------------------------------------------------------------------------------------------
# 4. FLOP counts  (chapter ch-recomputation)
# --------------------------------------------------------------------------------------------
def matmul_flops(m: Any, k: Any, n: Any) -> sp.Expr:
    """FLOPs of an ``(m, k) @ (k, n)`` product: ``m n`` dot products of length ``k``, one multiply
    and one add each, so ``2 m k n``."""
    return 2 * sp.sympify(m) * sp.sympify(k) * sp.sympify(n)


@dataclass(frozen=True)
class FlopCount:
    """Matmul FLOPs of attention for ``N`` queries/keys and head dimension ``d``.

    Elementwise work (softmax, ``dS``; ``O(N^2)``) is left out: it is lower order in ``d``.
    ``forward``/``backward``/``backward_recompute`` are sums over the ``*_terms`` lists.
    """

    N: Any
    d: Any
    forward_terms: tuple = field(default=())
    backward_terms: tuple = field(default=())
    recompute_terms: tuple = field(default=())

    @property
    def forward(self) -> sp.Expr:
        return sp.Add(*[f for _, f in self.forward_terms])

    @property
    def backward(self) -> sp.Expr:
        return sp.Add(*[f for _, f in self.backward_terms])

    @property
    def backward_recompute(self) -> sp.Expr:
        return sp.Add(*[f for _, f in self.recompute_terms]) + self.backward

    @property
    def ratio(self) -> sp.Expr:
        """``backward_recompute / backward``: 5/4."""
        return sp.simplify(self.backward_recompute / self.backward)


def attention_flops(N: Any = None, d: Any = None) -> FlopCount:
    """Matmul FLOP counts of attention: forward ``4 N^2 d``, standard backward ``8 N^2 d``,
    backward with recomputation of ``S = Q K^T`` ``10 N^2 d``; ratio 5/4.

    ``N`` and ``d`` default to positive sympy symbols; pass numbers to evaluate.
    """
    N = sp.Symbol("N", positive=True, integer=True) if N is None else sp.sympify(N)
    d = sp.Symbol("d", positive=True, integer=True) if d is None else sp.sympify(d)
    return FlopCount(
        N, d,
        forward_terms=(("S = Q K^T", matmul_flops(N, d, N)),
                       ("O = P V", matmul_flops(N, N, d))),
        backward_terms=(("dV = P^T dO", matmul_flops(N, N, d)),
                        ("dP = dO V^T", matmul_flops(N, d, N)),
                        ("dQ = dS K", matmul_flops(N, N, d)),
                        ("dK = dS^T Q", matmul_flops(N, N, d))),
        recompute_terms=(("S = Q K^T (again)", matmul_flops(N, d, N)),),
    )


# --------------------------------------------------------------------------------------------
# 5. Logit softcapping  (chapter ch-masks)
# --------------------------------------------------------------------------------------------
def softcap_derivative(N: int = 3) -> dict[str, Any]:
    """Logit softcapping (Gemma 2): the capped score ``c tanh(s / c)`` and its derivative.

    ``tanh`` is written through exponentials, ``(e^x - e^-x) / (e^x + e^-x)``, so that sympy
    differentiates a quotient rather than looking up the derivative of ``tanh``.  Identities:

    * ``"derivative"``: ``d/ds [c tanh(s/c)] = 1 - tanh^2(s/c)`` (the cap's local gradient);
    * ``"sech"``: ``1 - tanh^2(x) = sech^2(x)``, so the local gradient lies in ``(0, 1]``;
    * ``"upper"``, ``"lower"``: ``c tanh(s/c) -> +c`` and ``-c`` as ``s -> +oo`` and ``-oo``;
    * ``"small s"``: ``c tanh(s/c) = s - s^3 / (3 c^2) + O(s^5)``: near 0 the cap is the identity;
    * ``"no cap"``: ``c tanh(s/c) -> s`` as ``c -> oo``;
    * ``"attention row"``: for one row of ``N`` raw scores ``s`` and an upstream gradient ``dp``
      of ``p = softmax(c tanh(s/c))``, ``dL/ds = p ⊙ (dp - p^T dp) ⊙ (1 - tanh^2(s/c))``: the
      softmax backward of chapter ``ch-softmax-jacobian`` times the cap's local gradient.

    Returns the symbols ``s``, ``c``, the expressions ``capped`` (exponential form) and
    ``local_gradient`` (``1 - tanh^2(s/c)``), and the identities above.
    """
    s = sp.Symbol("s", real=True)
    c = sp.Symbol("c", positive=True)
    x = s / c
    tanh_exp = (sp.exp(x) - sp.exp(-x)) / (sp.exp(x) + sp.exp(-x))
    capped = c * tanh_exp
    local = 1 - sp.tanh(x) ** 2
    cap_tanh = c * sp.tanh(x)

    sv, dp = symbol_vector("s", N), symbol_vector("dp", N)
    p = softmax(sv.applyfunc(lambda t: c * sp.tanh(t / c)))
    L = (dp.T * p)[0, 0]
    rho = (p.T * dp)[0, 0]
    closed = hadamard(hadamard(p, dp.applyfunc(lambda t: t - rho)),
                      sv.applyfunc(lambda t: 1 - sp.tanh(t / c) ** 2))
    series = sp.series(cap_tanh, s, 0, 5).removeO()
    return {
        "s": s, "c": c, "capped": capped, "local_gradient": local,
        "derivative": Identity(
            "d/ds c tanh(s/c) = 1 - tanh^2(s/c)", sp.diff(capped, s),
            1 - tanh_exp ** 2,
            r"\frac{\partial}{\partial s}\, c \tanh\left(\frac{s}{c}\right)",
            r"1 - \tanh^{2}\left(\frac{s}{c}\right)",
        ),
        "sech": Identity("1 - tanh^2(x) = sech^2(x)", local.rewrite(sp.exp),
                         (sp.sech(x) ** 2).rewrite(sp.exp),
                         r"1 - \tanh^{2}\left(\frac{s}{c}\right)",
                         r"\operatorname{sech}^{2}\left(\frac{s}{c}\right)"),
        "upper": Identity("lim_{s->oo} c tanh(s/c) = c", sp.limit(cap_tanh, s, sp.oo), c,
                          r"\lim_{s \to \infty} c \tanh\left(\frac{s}{c}\right)", r"c"),
        "lower": Identity("lim_{s->-oo} c tanh(s/c) = -c", sp.limit(cap_tanh, s, -sp.oo), -c,
                          r"\lim_{s \to -\infty} c \tanh\left(\frac{s}{c}\right)", r"-c"),
        "small s": Identity("c tanh(s/c) = s - s^3/(3c^2) + O(s^5)", series,
                            s - s**3 / (3 * c**2),
                            r"c \tanh\left(\frac{s}{c}\right) - O(s^{5})",
                            r"s - \frac{s^{3}}{3 c^{2}}"),
        "no cap": Identity("lim_{c->oo} c tanh(s/c) = s", sp.limit(cap_tanh, c, sp.oo), s,
                           r"\lim_{c \to \infty} c \tanh\left(\frac{s}{c}\right)", r"s"),
        "attention row": Identity(
            "dL/ds = p ⊙ (dp - p^T dp) ⊙ (1 - tanh^2(s/c))", gradient(L, sv), closed,
            r"\frac{\partial \mathcal{L}}{\partial s}",
            r"p \odot \left(dp - p^{T} dp\right) \odot "
            r"\left(1 - \tanh^{2}\left(\frac{s}{c}\right)\right)",
        ),
    }
