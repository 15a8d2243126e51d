"""The identities of fa_lib.symbolic_online (chapter ch-online-softmax), each checked as
``sympy.simplify(lhs - rhs) == 0``, plus negative tests: wrong merge rules must be caught."""
import math

import numpy as np
import pytest
import sympy as sp

import fa_lib
from fa_lib import symbolic_online as so


def all_hold(identities):
    return all(i.holds() for i in identities.values())


def _wrong_sign(a, b):
    """Another wrong rule, for the negative tests: rescales by e^{m - m_a} instead of e^{m_a - m}."""
    m = sp.Max(a.m, b.m)
    acc = None if a.acc is None else a.acc * sp.exp(m - a.m) + b.acc * sp.exp(b.m - m)
    return so.State(m, a.l * sp.exp(m - a.m) + b.l * sp.exp(b.m - m), acc)


# ------------------------------------------------------------------------------------------------
# The element-wise rule
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3])
def test_change_of_reference(n):
    assert so.change_of_reference(n).holds()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_rescaling_rule_from_definition(n):
    r = so.rescaling_rule(n)
    assert r["m"].holds()  # max(m_n, x_{n+1}) = m_{n+1}
    assert r["l"].holds()  # l_n e^{m_n - m_{n+1}} + e^{x_{n+1} - m_{n+1}} = l_{n+1}


def test_orderings_cover_every_weak_order():
    x = so.scores(3)
    found = list(so.orderings(x))
    assert len(found) == math.factorial(3)
    assert len({order for order, _ in found}) == 6
    for order, subs in found:
        for hi, lo in zip(order, order[1:]):
            assert (subs[hi] - subs[lo]).is_nonnegative  # listed largest first, ties allowed


@pytest.mark.parametrize("n", [2, 3])
def test_rescaling_rule_in_both_cases(n):
    records = so.rescaling_cases(n)
    assert len(records) == math.factorial(n + 1)
    assert sum(r["case"] == "new max" for r in records) == math.factorial(n)
    for r in records:
        assert r["identity"].holds() and r["m_identity"].holds()
        assert r["safe"]  # no exponent the rule evaluates is positive
        assert (r["alpha"] == 1) == (r["case"] == "old max")


# ------------------------------------------------------------------------------------------------
# The merge of two states
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_a,n_b", [(1, 1), (2, 1), (2, 2)])
def test_merge_is_exact(n_a, n_b):
    ids = so.merge_exactness(n_a, n_b, dv=2)
    assert ids["m"].holds() and ids["l"].holds() and ids["acc"].holds()


def test_merge_is_exact_and_safe_in_every_ordering():
    records = so.merge_exactness_by_orderings(2, 2, dv=1)
    assert len(records) == 24
    assert sum(r["winner"] == "B" for r in records) == 12
    for r in records:
        assert all_hold(r["identities"]) and r["safe"]


@pytest.mark.parametrize("block_size", [1, 3])
def test_fold_gives_the_state_of_the_row(block_size):
    assert all_hold(so.fold_exactness(4, block_size, dv=2))


def test_merge_is_associative():
    assert all_hold(so.merge_associativity(dv=2))


def test_merge_is_commutative():
    assert all_hold(so.merge_commutativity(dv=2))


def test_empty_state_is_the_identity_element():
    ids = so.merge_identity_element(dv=2)
    assert all_hold(ids["left"]) and all_hold(ids["right"])


def test_merge_is_addition_of_l_exp_m():
    assert all_hold(so.merge_as_addition(dv=2))


# ------------------------------------------------------------------------------------------------
# The symbolic rule is the rule fa_lib runs on numbers
# ------------------------------------------------------------------------------------------------
def test_symbolic_merge_matches_merge_states():
    rng = np.random.default_rng(0)
    x = so.scores(5)
    v = so.value_rows(5, 2)
    xs, vs = rng.normal(size=5) * 3, rng.normal(size=(5, 2))
    values = dict(zip(x, xs))
    values.update({sym: float(val) for row, vrow in zip(v, vs) for sym, val in zip(row, vrow)})
    m, l, acc = so.numeric(so.merge(so.state(x[:2], v[:2]), so.state(x[2:], v[2:])), values)
    m_ref, l_ref, acc_ref = fa_lib.merge_states(fa_lib.softmax_state(xs[:2], vs[:2]), fa_lib.softmax_state(xs[2:], vs[2:]))
    assert m == m_ref
    assert l == pytest.approx(l_ref, rel=1e-14)
    assert acc == pytest.approx(list(acc_ref), rel=1e-13, abs=1e-15)


def test_symbolic_fold_matches_online_normalizer_trace():
    x = so.scores(4)
    values = dict(zip(x, [1.0, 3.0, 2.0, 5.0]))
    trace = []
    fa_lib.online_normalizer(np.array([1.0, 3.0, 2.0, 5.0]), trace=trace)
    for st_sym, st in zip(so.fold(x), trace, strict=True):
        m, l = so.numeric(st_sym, values)
        assert m == st.m and l == pytest.approx(st.l, rel=1e-14)


# ------------------------------------------------------------------------------------------------
# Negative tests: a wrong rule is detected
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("wrong", [so.merge_without_rescale, _wrong_sign], ids=["no-rescale", "wrong-sign"])
def test_wrong_rescaling_rule_is_detected(wrong):
    for n in (1, 2):
        r = so.rescaling_rule(n, merge=wrong)
        assert r["m"].holds()  # the max is right ...
        assert not r["l"].holds()  # ... the sum is not
    ids = so.merge_exactness(2, 1, dv=2, merge=wrong)
    assert not ids["l"].holds() and not ids["acc"].holds()
    assert not all_hold(so.fold_exactness(3, 1, dv=None, merge=wrong))


def test_forgetting_to_rescale_fails_exactly_when_the_new_block_wins():
    # The bug hides whenever the old state holds the maximum: only some orderings expose it.
    cases = so.rescaling_cases(2, merge=so.merge_without_rescale)
    assert [r["identity"].holds() for r in cases] == [r["case"] == "old max" for r in cases]
    records = so.merge_exactness_by_orderings(2, 2, dv=None, merge=so.merge_without_rescale)
    assert [all_hold(r["identities"]) for r in records] == [r["winner"] == "A" for r in records]
    # On numbers: [1, 3, 2, 5] gives 1 + 1 + e^-1 + 1 instead of e^-4 + e^-2 + e^-3 + 1.
    x = so.scores(4)
    _, l = so.numeric(so.fold(x, merge=so.merge_without_rescale)[-1], dict(zip(x, [1, 3, 2, 5])))
    assert l == pytest.approx(3 + math.exp(-1), rel=1e-14)


def test_wrong_rule_breaks_the_algebra():
    assert not all_hold(so.merge_associativity(dv=2, merge=so.merge_without_rescale))
    assert not all_hold(so.merge_commutativity(dv=2, merge=so.merge_without_rescale))
    assert not all_hold(so.merge_as_addition(dv=2, merge=so.merge_without_rescale))
