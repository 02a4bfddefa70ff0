"""Forest bookkeeping kernels against the plain-Python reference on random forests."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import forest_reference as ref
from trace_gym import Forest
from trace_gym.forest.forest import BRANCH, TERMINAL

SETTINGS = settings(max_examples=40, deadline=None)
forests = st.builds(
    ref.random_forest,
    seed=st.integers(0, 2**32 - 1),
    n_trees=st.integers(1, 6),
    rewards=st.sampled_from(["binary", "dyadic", "uniform"]),
    p_unfinished=st.sampled_from([0.0, 0.15, 0.5]),
)


def _close(a, b, tol=1e-12):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return np.allclose(a, b, rtol=tol, atol=tol, equal_nan=True)


@SETTINGS
@given(forests)
def test_backup_equals_mean_of_leaves_and_weighted_recursion(f):
    f.backup()
    plain = ref.Plain.of(f)
    n_mean, v_mean = ref.backup_mean(plain)
    n_rec, v_rec = ref.backup_recursive(plain)
    assert f.n_leaves.tolist() == n_mean == n_rec
    assert _close(f.value, v_mean) and _close(f.value, v_rec)
    below = plain.leaves_below()
    for y, ls in enumerate(below):
        rs = [plain.reward[l] for l in ls]
        assert f.leaf_min[y] == (min(rs) if rs else np.inf)
        assert f.leaf_max[y] == (max(rs) if rs else -np.inf)
        assert math.isclose(f.reward_sum[y], math.fsum(rs), abs_tol=1e-12)


@SETTINGS
@given(forests)
def test_effective_ratio_matches_reference(f):
    assert f.effective_ratio() == pytest.approx(ref.effective_ratio(ref.Plain.of(f)), abs=1e-15)


@SETTINGS
@given(forests, st.integers(0, 2**32 - 1))
def test_effective_sample_ratio_matches_reference(f, seed):
    # arbitrary advantages with many exact zeros, so both ratios are exercised
    rng = np.random.default_rng(seed)
    adv = np.where(rng.random(len(f)) < 0.6, 0.0, rng.normal(size=len(f)))
    got = f.effective_sample_ratio(adv)
    want = ref.effective_sample_ratio(ref.Plain.of(f), adv.tolist())
    assert got == pytest.approx(want, abs=1e-15)


@SETTINGS
@given(forests)
def test_structure_invariants(f):
    n = len(f)
    idx = np.arange(n)
    assert np.all(f.parent < idx)
    child = f.parent >= 0
    assert np.array_equal(f.depth[child], f.depth[f.parent[child]] + 1)
    assert np.array_equal(f.tree[child], f.tree[f.parent[child]])
    assert np.array_equal(np.bincount(f.parent[child], minlength=n), f.n_children)
    assert np.all(f.traj[~child] == -1) and np.all(f.traj[child] >= 0)
    # every trajectory's nodes form a path that starts below its origin
    for t in range(f.n_trajectories):
        nodes = np.flatnonzero(f.traj == t)
        if nodes.size:
            assert f.parent[nodes[0]] == f.traj_origin[t]
            assert np.array_equal(f.parent[nodes[1:]], nodes[:-1])
            assert f.traj_leaf[t] == nodes[-1]
            assert bool(f.flags[nodes[0]] & BRANCH) == (f.parent[f.traj_origin[t]] >= 0)
    # only terminal nodes carry rewards and none of them has children
    assert np.all(np.isnan(f.reward[(f.flags & TERMINAL) == 0]))
    assert np.all(f.n_children[(f.flags & TERMINAL) != 0] == 0)


def test_effective_sample_ratio_counts_unfinished_trajectories_and_tokens():
    f = Forest()
    root = f.add_root("a")
    t0, t1, t2 = f.start_trajectory(root), f.start_trajectory(root), f.start_trajectory(root)
    f.add_node(t0, n_tokens=10, terminal=True, reward=1.0)
    f.add_node(t1, n_tokens=30, terminal=True, reward=0.0)
    f.add_node(t2, n_tokens=60)  # never finishes: paid for, no advantage
    adv = f.advantages("trace")
    assert adv.tolist() == [0.0, 0.5, -0.5, 0.0]
    assert f.effective_sample_ratio(adv) == pytest.approx((2 / 3, 40 / 100))
    with pytest.raises(ValueError, match="one entry per node"):
        f.effective_sample_ratio(adv[:2])


def test_branch_flips_count_what_branching_bought_on_pure_trees():
    """Only trees whose root rollouts (two or more, finished) agree count; a branch flips
    when its reward differs from theirs; unfinished branches and mixed trees are left out."""
    f = Forest()

    def rollout(origin, reward, turns=2):
        t = f.start_trajectory(origin)
        nodes = [f.add_node(t, n_tokens=5) for _ in range(turns - 1)]
        if reward is not None:
            nodes.append(f.add_node(t, n_tokens=5, terminal=True, reward=reward))
        return nodes

    a = f.add_root("a")  # pure (two failures), three branches: one flips, one fails, one never ends
    mid = rollout(a, 0.0)[0]
    rollout(a, 0.0)
    rollout(mid, 1.0, turns=1)
    rollout(mid, 0.0, turns=1)
    t = f.start_trajectory(mid)
    f.add_node(t, n_tokens=5)
    b = f.add_root("b")  # pure (two successes), one branch that agrees: not mixed
    mid_b = rollout(b, 1.0)[0]
    rollout(b, 1.0)
    rollout(mid_b, 1.0, turns=1)
    c = f.add_root("c")  # mixed at the root: its branch does not count
    mid_c = rollout(c, 0.0)[0]
    rollout(c, 1.0)
    rollout(mid_c, 1.0, turns=1)
    d = f.add_root("d")  # one root rollout: not known to be pure
    mid_d = rollout(d, 0.0)[0]
    rollout(mid_d, 1.0, turns=1)
    e = f.add_root("e")  # pure without branches
    rollout(e, 0.0)
    rollout(e, 0.0)
    assert f.branch_flips() == {"trees": 2, "trees_mixed": 1, "branches": 3, "flipped": 1}
    assert Forest().branch_flips() == {"trees": 0, "trees_mixed": 0, "branches": 0, "flipped": 0}


def test_empty_forest_ratios_are_zero():
    f = Forest()
    assert f.effective_ratio() == 0.0
    assert f.effective_sample_ratio(np.zeros(0)) == (0.0, 0.0)
    f.add_root("a")
    assert f.effective_ratio() == 0.0
    assert f.advantages("grpo").tolist() == [0.0]


def test_backup_is_redone_after_growth():
    f = Forest()
    root = f.add_root("a")
    t = f.start_trajectory(root)
    f.add_node(t, terminal=True, reward=1.0)
    assert f.effective_ratio() == 0.0
    t = f.start_trajectory(root)
    f.add_node(t, terminal=True, reward=0.0)
    assert f.effective_ratio() == 1.0
    assert f.value[root] == 0.5


def test_add_nodes_matches_add_node():
    def build(vectorised: bool) -> Forest:
        f = Forest(capacity=1)
        roots = [f.add_root(str(i)) for i in range(3)]
        trajs = np.array([f.start_trajectory(r) for r in roots for _ in range(2)])
        for turn in range(3):
            term = np.array([turn == 2 and t % 2 == 0 for t in trajs])
            rew = np.where(term, (trajs % 3 == 0).astype(float), np.nan)
            toks = trajs + turn
            if vectorised:
                f.add_nodes(trajs, n_tokens=toks, terminal=term, reward=rew)
            else:
                for t, k, te, r in zip(trajs, toks, term, rew):
                    f.add_node(int(t), n_tokens=int(k), terminal=bool(te), reward=float(r))
            trajs = trajs[~term]
        return f

    a, b = build(True), build(False)
    for name in ("parent", "tree", "depth", "traj", "flags", "n_tokens", "n_children"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert np.array_equal(a.reward, b.reward, equal_nan=True)
    assert a.counters == b.counters


def test_fingerprint_names_what_was_generated_to_the_token():
    """Forests built alike share a fingerprint; one token, one word of text, one reward or one
    node's place in the tree more gives another (what ``leaderboard compare`` relies on)."""
    from types import SimpleNamespace

    def build(ids=(5, 6, 7), text="call add", reward=1.0, parent_of_last=None) -> Forest:
        f = Forest()
        r = f.add_root("task-0", "2 + 3?", payload=SimpleNamespace(token_ids=[1, 2, 3]))
        t = f.start_trajectory(r)
        n = f.add_node(t, n_tokens=3, text=text, payload=SimpleNamespace(token_ids=list(ids)))
        f.add_node(t, n_tokens=1, terminal=True, reward=0.0, text="5")
        f.add_node(f.start_trajectory(n if parent_of_last is None else parent_of_last), n_tokens=1, terminal=True,
                   reward=reward, text="5")
        return f

    base = build().fingerprint()
    assert len(base) == 16 and int(base, 16) >= 0
    assert build().fingerprint() == base
    for other in (build(ids=(5, 6, 8)), build(text="call sub"), build(reward=0.0), build(parent_of_last=0)):
        assert other.fingerprint() != base


def test_bad_growth_is_refused():
    f = Forest()
    root = f.add_root("a")
    t = f.start_trajectory(root)
    leaf = f.add_node(t, terminal=True, reward=1.0)
    with pytest.raises(ValueError, match="already ended"):
        f.add_node(t)
    with pytest.raises(ValueError, match="terminal"):
        f.start_trajectory(leaf)
    with pytest.raises(ValueError, match="needs a reward"):
        f.add_node(f.start_trajectory(root), terminal=True)
    with pytest.raises(ValueError, match="at most once"):
        u = f.start_trajectory(root)
        f.add_nodes(np.array([u, u]))
