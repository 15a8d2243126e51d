"""Symbolic derivations (sympy) behind online softmax: chapter ``ch-online-softmax``.

A *partial softmax state* of a block of scores ``x_j`` with value rows ``v_j`` is the triple

    m = max_j x_j,    l = sum_j exp(x_j - m),    acc = sum_j exp(x_j - m) v_j

(``acc`` is the un-normalised output, written õ in the book). :func:`state` builds it from its
definition; :func:`merge` is the rule that combines two states, the symbolic twin of
``fa_lib.merge_states``::

    m = max(m_a, m_b),   l = l_a e^{m_a - m} + l_b e^{m_b - m},   acc = acc_a e^{m_a - m} + acc_b e^{m_b - m}

Every claim of the chapter is returned as an :class:`fa_lib.symbolic.Identity` whose ``holds()``
checks ``sympy.simplify(lhs - rhs) == 0`` (entry by entry for ``acc``):

* :func:`change_of_reference` -- the one-line lemma behind everything: a sum of ``exp(x_j - r)``
  moves to another reference point ``r'`` by one factor ``exp(r - r')``.
* :func:`rescaling_rule` -- Milakov & Gimelshein's element-wise rule
  ``l_{n+1} = l_n e^{m_n - m_{n+1}} + e^{x_{n+1} - m_{n+1}}``, from the definition of ``l``.
* :func:`rescaling_cases` and :func:`merge_exactness_by_orderings` -- the same claims with the
  maximum *resolved*: every ordering of the scores is written with a top value ``mu`` and
  non-negative gaps ``t_k``, so sympy evaluates every ``Max`` itself. Every real input lies in one
  of these orderings (ties are gaps equal to 0), so checking all of them proves the claim for all
  real scores, and also shows that no exponent the rule evaluates is positive (nothing overflows).
* :func:`merge_exactness` -- the merge of two blocks' states is the state of the concatenated block.
* :func:`fold_exactness` -- folding blocks of any size left to right (what ``online_normalizer``
  and ``flash_forward`` do) gives the state of the whole row.
* :func:`merge_associativity`, :func:`merge_commutativity`, :func:`merge_identity_element` --
  the algebra that lets blocks be merged in any grouping and any order.
* :func:`merge_as_addition` -- why: ``l e^m`` (and ``acc e^m``) of a merge is the *sum* of the
  parts' ``l e^m``; the log of that quantity is the log-sum-exp ``m + log l``.

Every function takes ``merge=`` so that a wrong rule can be fed in and seen to fail;
:func:`merge_without_rescale` is the classic bug (the old state is not multiplied by
``e^{m_a - m}``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import sympy as sp

from .symbolic import Identity

__all__ = [
    "State",
    "Merge",
    "scores",
    "value_rows",
    "generic_state",
    "empty_state",
    "state",
    "merge",
    "merge_without_rescale",
    "fold",
    "orderings",
    "numeric",
    # identities
    "change_of_reference",
    "rescaling_rule",
    "rescaling_cases",
    "merge_exactness",
    "merge_exactness_by_orderings",
    "fold_exactness",
    "merge_associativity",
    "merge_commutativity",
    "merge_identity_element",
    "merge_as_addition",
]


# --------------------------------------------------------------------------------------------
# States and the merge rule
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class State:
    """A symbolic partial softmax state ``(m, l, acc)``; ``acc`` is a 1 x dv row or None."""

    m: Any
    l: Any
    acc: Optional[sp.Matrix] = None


Merge = Callable[[State, State], State]


def scores(n: int, name: str = "x") -> tuple:
    """``n`` real score symbols ``x_1, ..., x_n``."""
    return tuple(sp.Symbol(f"{name}_{j}", real=True) for j in range(1, n + 1))


def value_rows(n: int, dv: int = 2, name: str = "v") -> list:
    """``n`` value rows, each a 1 x dv matrix of real symbols ``v_{j,k}``."""
    return [
        sp.Matrix([[sp.Symbol(f"{name}_{{{j},{k}}}", real=True) for k in range(1, dv + 1)]])
        for j in range(1, n + 1)
    ]


def generic_state(name: str, dv: Optional[int] = 2) -> State:
    """A state with free symbols: ``m_name`` real, ``l_name`` positive, ``acc`` real entries.

    Used to prove properties of :func:`merge` on *all* states, not only those that come from data.
    """
    m = sp.Symbol(f"m_{name}", real=True)
    l = sp.Symbol(rf"\ell_{name}", positive=True)
    acc = None
    if dv is not None:
        acc = sp.Matrix([[sp.Symbol(rf"\tilde{{o}}_{{{name},{k}}}", real=True) for k in range(1, dv + 1)]])
    return State(m, l, acc)


def empty_state(dv: Optional[int] = 2) -> State:
    """``(-oo, 0, 0)``: the state of an empty (or fully masked) block."""
    return State(-sp.oo, sp.Integer(0), None if dv is None else sp.zeros(1, dv))


def state(x: Sequence, v: Optional[Sequence] = None) -> State:
    """The state of one block, from the definition: ``m = max x``, ``l = sum exp(x - m)``,
    ``acc = sum exp(x - m) v``."""
    m = sp.Max(*x)
    w = [sp.exp(xj - m) for xj in x]
    l = sp.Add(*w)
    acc = None
    if v is not None:
        acc = sp.zeros(*v[0].shape)
        for wj, vj in zip(w, v):
            acc += wj * vj
    return State(m, l, acc)


def merge(a: State, b: State) -> State:
    """The exact merge of two states (the rule of ``fa_lib.merge_states``)."""
    m = sp.Max(a.m, b.m)
    alpha = sp.exp(a.m - m)  # rescale factor of a: 1 if a holds the larger max
    beta = sp.exp(b.m - m)
    acc = None if a.acc is None else a.acc * alpha + b.acc * beta
    return State(m, a.l * alpha + b.l * beta, acc)


def merge_without_rescale(a: State, b: State) -> State:
    """A WRONG merge, for the negative examples: the old state ``a`` is not rescaled.

    It is right whenever ``m_a`` is the larger maximum (then ``e^{m_a - m} = 1``), which is why a
    test that only feeds rows whose maximum comes first cannot catch it.
    """
    m = sp.Max(a.m, b.m)
    beta = sp.exp(b.m - m)
    acc = None if a.acc is None else a.acc + b.acc * beta
    return State(m, a.l + b.l * beta, acc)


def fold(x: Sequence, v: Optional[Sequence] = None, block_size: int = 1, merge: Merge = merge) -> list:
    """Read ``x`` (and ``v``) ``block_size`` at a time, merging each block's state into the running
    one, as ``fa_lib.online_normalizer`` does. Returns the running state after every block."""
    dv = None if v is None else v[0].shape[1]
    running = empty_state(dv)
    out = []
    for start in range(0, len(x), block_size):
        block = state(x[start : start + block_size], None if v is None else v[start : start + block_size])
        running = merge(running, block)
        out.append(running)
    return out


def orderings(x: Sequence, top: str = "mu", gap: str = "t") -> Iterator[tuple]:
    """Every weak ordering of the scores ``x``, as a substitution.

    Yields ``(order, subs)``: ``order`` lists the scores from the largest down, and ``subs`` maps
    the largest to ``mu`` (real), the next to ``mu - t_1``, the next to ``mu - t_1 - t_2``, and so
    on, with gaps ``t_k >= 0``. Each real vector fits one of these ``n!`` patterns (a tie is a gap
    equal to 0), and under the substitution sympy can evaluate every ``Max`` of the scores.
    """
    n = len(x)
    mu = sp.Symbol(top, real=True)
    t = [sp.Symbol(f"{gap}_{k}", nonnegative=True) for k in range(1, n)]
    for order in itertools.permutations(range(n)):
        subs = {x[i]: mu - sp.Add(*t[:rank]) for rank, i in enumerate(order)}
        yield tuple(x[i] for i in order), subs


def _substitute(s: State, subs: dict) -> State:
    return State(
        sp.sympify(s.m).subs(subs), sp.sympify(s.l).subs(subs), None if s.acc is None else s.acc.subs(subs)
    )


def _exponents_nonpositive(*exprs) -> bool:
    """True when every ``exp(...)`` inside ``exprs`` has an argument sympy can prove is <= 0."""
    atoms = set()
    for e in exprs:
        atoms |= sp.sympify(e).atoms(sp.exp)
    return all(a.args[0].is_nonpositive for a in atoms)


def numeric(s: State, values: dict) -> tuple:
    """Evaluate a symbolic state at numbers: ``values`` maps symbols to numbers.
    Returns ``(m, l)`` or ``(m, l, acc)`` as Python floats (acc a list)."""
    m = float(sp.sympify(s.m).subs(values))
    l = float(sp.sympify(s.l).subs(values))
    if s.acc is None:
        return m, l
    return m, l, [float(e) for e in s.acc.subs(values)]


def _state_identities(name: str, got: State, want: State) -> dict:
    """The identities ``got.m = want.m``, ``got.l = want.l`` and (if present) ``got.acc = want.acc``."""
    out = {
        "m": Identity(f"{name}: m", got.m, want.m),
        "l": Identity(f"{name}: l", got.l, want.l),
    }
    if got.acc is not None:
        out["acc"] = Identity(f"{name}: acc", got.acc, want.acc)
    return out


# --------------------------------------------------------------------------------------------
# The element-wise rescaling rule
# --------------------------------------------------------------------------------------------
def change_of_reference(n: int = 3) -> Identity:
    """``sum_j e^{x_j - r'} = e^{r - r'} sum_j e^{x_j - r}`` for any reference points ``r, r'``."""
    x = scores(n)
    r, r2 = sp.symbols("r r'", real=True)
    lhs = sp.Add(*[sp.exp(xj - r2) for xj in x])
    rhs = sp.exp(r - r2) * sp.Add(*[sp.exp(xj - r) for xj in x])
    return Identity(f"change of reference point (n={n})", lhs, rhs)


def rescaling_rule(n: int = 3, merge: Merge = merge) -> dict:
    """The element-wise rule after ``n`` scores have been read, from the definition of ``l``.

    ``old`` is the state of ``x_1..x_n`` and ``definition`` the state of ``x_1..x_{n+1}``, both
    computed from the definition; ``rule`` is ``merge(old, state([x_{n+1}]))``, which for a single
    new element reads ``l_n e^{m_n - m_{n+1}} + e^{x_{n+1} - m_{n+1}}``. Returns those states and
    the identities ``m`` (``max(m_n, x_{n+1}) = m_{n+1}``) and ``l`` (rule = definition), for
    symbolic scores and the maximum left as a symbolic ``Max``.
    """
    x = scores(n + 1)
    old = state(x[:n])
    definition = state(x)
    rule = merge(old, state(x[n:]))
    return {
        "x": x,
        "old": old,
        "definition": definition,
        "rule": rule,
        "m": Identity(f"rescaling rule, n={n}: m", rule.m, definition.m),
        "l": Identity(
            f"rescaling rule, n={n}: l",
            rule.l,
            definition.l,
            rf"\ell_{{{n}}}\, e^{{m_{{{n}}} - m_{{{n + 1}}}}} + e^{{x_{{{n + 1}}} - m_{{{n + 1}}}}}",
            rf"\ell_{{{n + 1}}}",
        ),
    }


def rescaling_cases(n: int = 2, merge: Merge = merge) -> list:
    """The rescaling rule on every ordering of ``x_1..x_{n+1}`` (see :func:`orderings`).

    One record per ordering: ``order`` (largest first), ``case`` (``"new max"`` when ``x_{n+1}``
    is on top, else ``"old max"``), ``m_old``, ``m_new``, ``alpha = e^{m_n - m_{n+1}}``, the
    ``identity`` rule = definition with every ``Max`` evaluated, and ``safe``: every exponent the
    rule evaluates is <= 0.
    """
    x = scores(n + 1)
    records = []
    for order, subs in orderings(x):
        vals = [subs[xi] for xi in x]
        old = state(vals[:n])
        definition = state(vals)
        rule = merge(old, state(vals[n:]))
        records.append(
            {
                "order": order,
                "subs": subs,
                "case": "new max" if order[0] == x[n] else "old max",
                "m_old": old.m,
                "m_new": rule.m,
                "alpha": sp.exp(old.m - rule.m),
                "identity": Identity(f"rescaling rule, order {order}", rule.l, definition.l),
                "m_identity": Identity(f"rescaling rule max, order {order}", rule.m, definition.m),
                "safe": _exponents_nonpositive(rule.l),
            }
        )
    return records


# --------------------------------------------------------------------------------------------
# Merging blocks
# --------------------------------------------------------------------------------------------
def merge_exactness(n_a: int = 2, n_b: int = 2, dv: Optional[int] = 2, merge: Merge = merge) -> dict:
    """``merge(state(A), state(B)) = state(A ++ B)`` for symbolic scores and value rows.

    Returns the identities ``m``, ``l`` and (with ``dv``) ``acc``, plus the three states."""
    x = scores(n_a + n_b)
    v = None if dv is None else value_rows(n_a + n_b, dv)
    a = state(x[:n_a], None if v is None else v[:n_a])
    b = state(x[n_a:], None if v is None else v[n_a:])
    merged = merge(a, b)
    whole = state(x, v)
    out = _state_identities(f"merge exactness ({n_a}+{n_b})", merged, whole)
    out.update({"a": a, "b": b, "merged": merged, "whole": whole, "x": x, "v": v})
    return out


def merge_exactness_by_orderings(n_a: int = 2, n_b: int = 2, dv: Optional[int] = 1, merge: Merge = merge) -> list:
    """:func:`merge_exactness` on every ordering of the ``n_a + n_b`` scores.

    One record per ordering: ``order``, ``winner`` (``"A"`` or ``"B"``: the block holding the top
    score), ``identities`` (m, l, acc with every ``Max`` evaluated) and ``safe`` (every exponent the
    merge evaluates, inside the blocks and in the rescale factors, is <= 0)."""
    x = scores(n_a + n_b)
    v = None if dv is None else value_rows(n_a + n_b, dv)
    records = []
    for order, subs in orderings(x):
        vals = [subs[xi] for xi in x]
        a = state(vals[:n_a], None if v is None else v[:n_a])
        b = state(vals[n_a:], None if v is None else v[n_a:])
        merged = merge(a, b)
        whole = state(vals, v)
        records.append(
            {
                "order": order,
                "winner": "A" if x.index(order[0]) < n_a else "B",
                "identities": _state_identities(f"merge exactness, order {order}", merged, whole),
                "safe": _exponents_nonpositive(merged.l, *([] if merged.acc is None else list(merged.acc))),
            }
        )
    return records


def fold_exactness(n: int = 5, block_size: int = 2, dv: Optional[int] = 2, merge: Merge = merge) -> dict:
    """Folding ``n`` scores ``block_size`` at a time gives the state of the whole row."""
    x = scores(n)
    v = None if dv is None else value_rows(n, dv)
    final = fold(x, v, block_size, merge)[-1]
    return _state_identities(f"fold of {n} scores in blocks of {block_size}", final, state(x, v))


def merge_associativity(dv: Optional[int] = 2, merge: Merge = merge) -> dict:
    """``merge(merge(a, b), c) = merge(a, merge(b, c))`` for arbitrary states a, b, c."""
    a, b, c = (generic_state(s, dv) for s in "abc")
    return _state_identities("associativity", merge(merge(a, b), c), merge(a, merge(b, c)))


def merge_commutativity(dv: Optional[int] = 2, merge: Merge = merge) -> dict:
    """``merge(a, b) = merge(b, a)`` for arbitrary states a, b."""
    a, b = (generic_state(s, dv) for s in "ab")
    return _state_identities("commutativity", merge(a, b), merge(b, a))


def merge_identity_element(dv: Optional[int] = 2, merge: Merge = merge) -> dict:
    """``merge(empty, a) = a = merge(a, empty)`` with ``empty = (-oo, 0, 0)``.

    Returns ``{"left": {...}, "right": {...}}`` of identities."""
    a = generic_state("a", dv)
    e = empty_state(dv)
    return {
        "left": _state_identities("identity element (left)", merge(e, a), a),
        "right": _state_identities("identity element (right)", merge(a, e), a),
    }


def merge_as_addition(dv: Optional[int] = 2, merge: Merge = merge) -> dict:
    """The merge is addition in disguise: with ``Z = l e^m`` (the plain sum ``sum_j e^{x_j}``),
    ``Z(merge(a, b)) = Z(a) + Z(b)``, and likewise ``acc e^m``. Hence associativity and
    commutativity, and ``log Z = m + log l`` is the log-sum-exp of the row."""
    a, b = (generic_state(s, dv) for s in "ab")
    r = merge(a, b)
    out = {
        "l": Identity(
            "merge is addition: l e^m",
            r.l * sp.exp(r.m),
            a.l * sp.exp(a.m) + b.l * sp.exp(b.m),
            r"\ell\, e^{m}",
            r"\ell_a e^{m_a} + \ell_b e^{m_b}",
        )
    }
    if dv is not None:
        out["acc"] = Identity(
            "merge is addition: acc e^m",
            r.acc * sp.exp(r.m),
            a.acc * sp.exp(a.m) + b.acc * sp.exp(b.m),
            r"\tilde{o}\, e^{m}",
            r"\tilde{o}_a e^{m_a} + \tilde{o}_b e^{m_b}",
        )
    return out
