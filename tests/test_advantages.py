"""Advantage estimators against the plain-Python reference, plus the behaviours a trainer
relies on (groups of one, unbranched paths, the registry)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import forest_reference as ref
from trace_gym import Forest
from trace_gym.forest.advantages import ADVANTAGES, grpo, tree_grpo
from trace_gym.registry import UnknownNameError

forests = st.builds(
    ref.random_forest,
    seed=st.integers(0, 2**32 - 1),
    n_trees=st.integers(1, 5),
    rewards=st.sampled_from(["binary", "dyadic", "uniform"]),
    p_unfinished=st.sampled_from([0.0, 0.2]),
)

CASES = [
    ("trace", {}, "trace"),
    ("trace", {"scale": "group"}, lambda f: ref.adv_trace(f, scale="group")),
    ("trace", {"scale": "batch"}, lambda f: ref.adv_trace(f, scale="batch")),
    ("grpo", {}, lambda f: ref.adv_grpo(f)),
    ("grpo", {"scale": "batch"}, lambda f: ref.adv_grpo(f, scale="batch")),
    ("grpo", {"scale": "none"}, lambda f: ref.adv_grpo(f, scale="none")),
    ("dr_grpo", {}, "dr_grpo"),
    ("rloo", {}, "rloo"),
    ("treerl", {}, "treerl"),
    ("tree_grpo", {}, "tree_grpo"),
    ("tree_grpo", {"scale": "none"}, lambda f: ref.adv_tree_grpo(f, scale="none")),
]


@settings(max_examples=25, deadline=None)
@given(forests)
def test_every_estimator_matches_reference(f):
    plain = ref.Plain.of(f)
    for name, kw, want in CASES:
        want = ref.ADVANTAGES[want] if isinstance(want, str) else want
        expected = np.array(want(plain))
        got = f.advantages(name, **kw)
        assert got.dtype == np.float64 and got.shape == (len(f),)
        # eps = 1e-4 can amplify rounding by up to 1e4; values are O(1..1e4)
        np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9, err_msg=f"{name} {kw}")
        # the zero pattern (what the effective sample ratio counts) must agree exactly
        assert np.array_equal(got == 0, expected == 0), f"{name} {kw}: zero pattern"
        assert f.effective_sample_ratio(got) == pytest.approx(ref.effective_sample_ratio(plain, expected), abs=1e-15)
        assert np.all(got[f.root_nodes] == 0)
        assert np.all(got[f.n_leaves == 0] == 0)


def _tree(rewards_by_path):
    """One tree; each entry is a list of (branch-from-depth, reward) trajectories built as
    a comb: the first trajectory is a chain of 3 turns, later ones branch at the node of
    the given depth on the first trajectory and take one turn."""
    f = Forest()
    root = f.add_root("a")
    t = f.start_trajectory(root)
    chain = [f.add_node(t, n_tokens=1) for _ in range(2)]
    chain.append(f.add_node(t, n_tokens=1, terminal=True, reward=rewards_by_path[0][1]))
    for depth, r in rewards_by_path[1:]:
        origin = root if depth == 0 else chain[depth - 1]
        u = f.start_trajectory(origin)
        f.add_node(u, n_tokens=1, terminal=True, reward=r)
    return f, root, chain


def test_group_of_one_gets_zero_not_its_raw_score():
    f, root, chain = _tree([(0, 1.0)])
    for name in ADVANTAGES:
        assert np.all(f.advantages(name) == 0), name


def test_grpo_matches_trl_formula_and_spreads_over_prefixes():
    # leaves: chain leaf r=1, branch at depth 2 r=0, branch at depth 0 (the root) r=0
    f, root, chain = _tree([(0, 1.0), (2, 0.0), (0, 0.0)])
    r = np.array([1.0, 0.0, 0.0])
    a_leaf = (r - r.mean()) / (r.std(ddof=1) + 1e-4)
    adv = f.advantages("grpo")
    leaves = f.leaves()
    assert np.allclose(adv[leaves], a_leaf)
    # the prefix chain[1] is shared by leaves 0 and 1: it gets their average
    assert math.isclose(adv[chain[1]], (a_leaf[0] + a_leaf[1]) / 2)
    assert math.isclose(adv[chain[0]], adv[chain[1]])  # unbranched above: same value
    assert np.allclose(grpo(f, scale="none")[leaves], r - r.mean())
    assert np.allclose(f.advantages("rloo")[leaves], [1.0, -0.5, -0.5])


def test_trace_is_zero_on_single_child_edges_and_contrasts_siblings():
    f, root, chain = _tree([(0, 1.0), (2, 0.0)])
    adv = f.advantages()  # default: trace
    assert adv[chain[0]] == 0.0 and adv[chain[1]] == 0.0  # root and chain[0] have one child
    assert adv[chain[2]] == 0.5 and adv[f.leaves()[1]] == -0.5
    assert f.effective_sample_ratio(adv)[0] == 1.0


def test_tree_grpo_intra_group_is_the_nearest_branching_ancestor():
    # chain leaf r=1 and a branch at depth 2 with r=0 share the branching node chain[1];
    # a third rollout from the root (r=1) has only the root above it (intra term 0).
    f, root, chain = _tree([(0, 1.0), (2, 0.0), (0, 1.0)])
    eps = 1e-4
    r_all = np.array([1.0, 0.0, 1.0])
    inter = (r_all - r_all.mean()) / (r_all.std(ddof=1) + eps)
    pair = np.array([1.0, 0.0])
    intra = (pair - pair.mean()) / (pair.std(ddof=1) + eps)
    adv = tree_grpo(f)
    leaves = f.leaves()
    assert np.allclose(adv[leaves], inter + np.array([intra[0], intra[1], 0.0]))


def test_treerl_formula():
    f, root, chain = _tree([(0, 1.0), (2, 0.0), (0, 0.0)])
    f.backup()
    v = f.value
    y = chain[1]
    want = (v[y] - v[root] + v[y] - v[chain[0]]) / math.sqrt(2)
    assert math.isclose(f.advantages("treerl")[y], want)


def test_registry_names_and_errors():
    assert {"grpo", "dr_grpo", "rloo", "treerl", "tree_grpo", "trace"} <= set(ADVANTAGES.names())
    f, *_ = _tree([(0, 1.0), (2, 0.0)])
    with pytest.raises(UnknownNameError, match="did you mean 'trace'"):
        f.advantages("trac")
    with pytest.raises(ValueError, match="scale"):
        f.advantages("grpo", scale="batchwise")
    with pytest.raises(ValueError, match="scale"):
        f.advantages("trace", scale="tree")


def test_options_in_the_name_are_the_estimators_kwargs():
    # "name:key=value" is how configs and the CLI name an estimator with options
    f, *_ = _tree([(0, 1.0), (2, 0.0), (0, 0.0)])
    assert np.array_equal(f.advantages("trace:scale=group"), f.advantages("trace", scale="group"))
    assert np.array_equal(f.advantages("grpo:scale=none:eps=0.01"), f.advantages("grpo", scale="none", eps=0.01))
    assert ADVANTAGES.parse("grpo:eps=0.5") == ("grpo", {"eps": 0.5})
    with pytest.raises(ValueError, match="key=value"):
        f.advantages("trace:group")
    with pytest.raises(UnknownNameError, match="did you mean 'trace'"):
        f.advantages("trac:scale=group")
    with pytest.raises(ValueError, match=r"unknown option 'sale' \(options: scale, eps\)"):
        f.advantages("trace:sale=group")
    with pytest.raises(ValueError, match="unknown option 'scale'"):
        f.advantages("treerl", scale="group")


def test_scaled_trace_changes_magnitudes_not_which_nodes_learn():
    f, *_ = _tree([(0, 1.0), (2, 0.0), (0, 0.0), (1, 1.0)])
    plain, scaled = f.advantages("trace"), f.advantages("trace", scale="group")
    assert np.array_equal(plain == 0, scaled == 0)
    r = f.reward[f.leaves()]
    assert np.allclose(scaled, plain / (np.std(r, ddof=1) + 1e-4))
