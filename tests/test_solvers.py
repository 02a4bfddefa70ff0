"""The two allocation solvers: exact optimality against brute force / dynamic programming,
the budget and per-prompt constraints, and agreement with the plain-Python reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import forest_reference as ref
from trace_gym.allocation.solvers import solve_prefixes, solve_roots, v_pref, v_root

probs = st.one_of(st.sampled_from([0.0, 1.0, 0.5, 0.25, 0.9]), st.floats(0.0, 1.0))


def _roots_objective(v, m) -> float:
    return math.fsum(ref.v_root(x, int(k)) for x, k in zip(v, m))


def _check_roots(v, budget, m_min, m_max, best_by_spend):
    m = solve_roots(np.array(v, dtype=float), budget, m_min, m_max)
    assert m.dtype == np.int64 and m.shape == (len(v),)
    assert m.sum() <= budget
    active = m[m > 0]
    assert np.all(active >= m_min)
    if m_max > 0:
        assert np.all(active <= m_max)
    top, spend = ref.optimum(best_by_spend)
    assert abs(_roots_objective(v, m) - top) <= 1e-12 * max(1.0, top)
    assert m.sum() == spend  # the most units any optimal allocation spends
    return m


@settings(max_examples=150, deadline=None)
@given(st.lists(probs, min_size=1, max_size=4), st.integers(0, 10), st.integers(1, 3), st.sampled_from([0, 0, 1, 3]))
def test_solve_roots_is_optimal_against_brute_force(v, budget, m_min, extra):
    m_max = 0 if extra == 0 else m_min + extra - 1
    _check_roots(v, budget, m_min, m_max, ref.roots_brute(v, budget, m_min, m_max))


@settings(max_examples=40, deadline=None)
@given(st.lists(probs, min_size=1, max_size=12), st.integers(0, 30), st.integers(1, 4), st.sampled_from([0, 0, 2, 5]))
def test_solve_roots_is_optimal_against_dynamic_programming(v, budget, m_min, extra):
    m_max = 0 if extra == 0 else m_min + extra
    m = _check_roots(v, budget, m_min, m_max, ref.roots_dp(v, budget, m_min, m_max))
    assert m.tolist() == ref.solve_roots(v, budget, m_min, m_max)  # same tie-breaking as the reference


def test_solve_roots_is_optimal_on_medium_instances():
    rng = np.random.default_rng(7)
    for _ in range(8):
        n, budget, m_min = 60, int(rng.integers(20, 90)), int(rng.integers(1, 5))
        m_max = int(rng.choice([0, m_min + 2, m_min + 6]))
        v = rng.beta(0.4, 0.4, n)
        v[:5] = rng.choice([0.0, 1.0], 5)
        m = _check_roots(v.tolist(), budget, m_min, m_max, ref.roots_dp(v.tolist(), budget, m_min, m_max))
        assert m.tolist() == ref.solve_roots(v.tolist(), budget, m_min, m_max)


def test_solve_roots_beats_the_block_density_greedy():
    # budget 4: the prompt with the larger v(1-v) alone gets 0.875; two prompts get 0.98
    g1, g2 = 0.25, 0.24
    v = [0.5, (1 - math.sqrt(1 - 4 * g2)) / 2]
    m = solve_roots(np.array(v), 4)
    assert m.tolist() == [2, 2]
    assert math.isclose(v_root(np.array(v), m).sum(), 2 * g1 + 2 * g2)


def test_solve_roots_spends_the_whole_budget_when_it_can():
    rng = np.random.default_rng(0)
    v = rng.random(1024)
    v[:100] = rng.choice([0.0, 1.0], size=100)
    m = solve_roots(v, 512)
    assert m.sum() == 512 and set(np.unique(m)) >= {0, 2}
    # zero-gain prompts only: units still go somewhere, deterministically
    z = solve_roots(np.array([0.0, 1.0, 0.0]), 5)
    assert z.sum() == 5 and z.tolist() == solve_roots(np.array([0.0, 1.0, 0.0]), 5).tolist()


def test_solve_roots_spreads_units_that_cannot_raise_the_objective():
    # every prediction 0 (a policy that failed everywhere so far): no allocation has value, so
    # the budget goes out in groups of m_min over as many prompts as it covers, not onto one
    m = solve_roots(np.zeros(64), 64, 2)
    assert m.sum() == 64 and (m > 0).sum() == 32 and set(m[m > 0].tolist()) == {2}
    m = solve_roots(np.ones(10), 64, 4)  # fewer prompts than groups: every prompt gets a group
    assert m.sum() == 64 and (m >= 4).all()
    assert solve_roots(np.zeros(64), 64, 2).tolist() == ref.solve_roots([0.0] * 64, 64, 2, 0)
    # caps that make the full budget impossible: spend what the caps allow, never more
    assert solve_roots(np.array([0.5, 0.5]), 7, 2, 3).tolist() == [3, 3]
    assert solve_roots(np.array([0.5]), 1, 2).tolist() == [0]
    assert solve_roots(np.zeros(0), 5).shape == (0,)


def test_solve_roots_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        solve_roots(np.array([0.5, np.nan]), 4)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        solve_roots(np.array([1.5]), 4)
    with pytest.raises(ValueError, match="budget"):
        solve_roots(np.array([0.5]), -1)
    with pytest.raises(TypeError, match="budget"):
        solve_roots(np.array([0.5]), 2.5)
    with pytest.raises(ValueError, match="m_min"):
        solve_roots(np.array([0.5]), 4, m_min=0)
    with pytest.raises(ValueError, match="m_max"):
        solve_roots(np.array([0.5]), 4, m_min=3, m_max=2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(probs, st.sampled_from([0.0, 1.0, 0.5, 0.3])), min_size=1, max_size=6),
       st.integers(0, 14), st.sampled_from([0, 1, 2, 4]))
def test_solve_prefixes_is_optimal_and_spends_what_caps_allow(vr, budget, k_max):
    v, r = [x for x, _ in vr], [y for _, y in vr]
    k = solve_prefixes(np.array(v), np.array(r), budget, k_max)
    assert k.dtype == np.int64 and np.all(k >= 0) and k.sum() <= budget
    if k_max > 0:
        assert np.all(k <= k_max)
    assert k.sum() == min(budget, len(v) * (k_max if k_max > 0 else budget))
    top, _ = ref.optimum(ref.prefixes_dp(v, r, budget, k_max))
    got = math.fsum(ref.v_pref(x, y, int(n)) for x, y, n in zip(v, r, k))
    assert abs(got - top) <= 1e-12 * max(1.0, top)
    assert k.tolist() == ref.solve_prefixes(v, r, budget, k_max)
    assert math.isclose(v_pref(np.array(v), np.array(r), k).sum(), got, abs_tol=1e-12)


def test_solve_prefixes_large_instance_matches_reference():
    rng = np.random.default_rng(1)
    v, r = rng.random(3000), (rng.random(3000) < 0.4).astype(float)
    k = solve_prefixes(v, r, 700, k_max=4)
    assert k.sum() == 700 and k.max() <= 4
    assert k.tolist() == ref.solve_prefixes(v.tolist(), r.tolist(), 700, 4)


def test_solve_prefixes_rejects_bad_input():
    with pytest.raises(ValueError, match="same length"):
        solve_prefixes(np.array([0.5]), np.array([0.5, 0.5]), 3)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        solve_prefixes(np.array([0.5]), np.array([np.nan]), 3)
    with pytest.raises(ValueError, match="budget"):
        solve_prefixes(np.array([0.5]), np.array([1.0]), -2)
