"""The built-in allocators: budgets are never exceeded, and each behaves as documented."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import trace_gym
from trace_gym.allocation.budget import Budget
from trace_gym.allocation.allocator import add_candidates, allocate_step
from trace_gym.allocators.knapsack import knapsack_counts, knapsack_value
from trace_gym.allocators.pcl import nearest_half
from trace_gym.allocators.trace import solve_roots_beta, v_root_beta
from trace_gym.allocators.uniform import uniform_prefixes
from trace_gym.sim import ContrastLabSim, ContrastLabWorld
from trace_gym.forest.forest import TERMINAL, Forest
from trace_gym.allocation.solvers import solve_roots, v_root
from trace_gym.allocators.greso import GRESOAllocator
from trace_gym.allocators.vip import vip_counts
from trace_gym.run import ComponentSpec
from trace_gym.sim.bench import BenchConfig, run_bench

SPECS = [
    ("grpo", {}), ("uniform", {}), ("trace", {}), ("trace", {"stage1": "uniform"}), ("trace", {"stage2": "uniform"}),
    ("trace", {"rounds": 3, "k_max": 2}), ("trace", {"scope": "tree"}), ("trace", {"scope": "mixed"}), ("trace", {"uncertainty": False}), ("dapo", {}),
    ("pcl", {}), ("knapsack", {"n_max": 8}),
    ("oracle", {}), ("oracle-er", {}), ("greso", {}), ("vip", {}), ("trace", {"stage2": "none"}),
    ("trace", {"stage1": "paper", "scope": "tree"}), ("trace-paper", {}), ("trace", {"rescue": 4}),
    ("trace", {"m_max": "m_min"}),
]


def _step(world, alloc, budget, predictor, pool=None, seed=0, sim=None):
    forest = Forest()
    add_candidates(forest, world.candidates(np.arange(world.n_tasks) if pool is None else pool))
    sim = sim or ContrastLabSim(world, seed=seed)
    spend = allocate_step(forest, alloc, budget, predictor, sim.rollout)
    return forest, spend


def _predictor_for(alloc):
    name = getattr(alloc, "default_predictor", None)
    if not name:
        return None
    spec = ComponentSpec.model_validate(name)
    return trace_gym.make_predictor(spec.name, **spec.kwargs)


def _stage2_origins(world, alloc, budget, predictor, seed=1):
    """Run one step; return, per stage-2 round, (origins, origin pure?, origin's tree mixed?) as
    the forest stood before the round."""
    forest = Forest()
    add_candidates(forest, world.candidates(np.arange(world.n_tasks)))
    sim = ContrastLabSim(world, seed=seed)
    rounds = []

    def rollout(f, origins):
        if f.n_trajectories:
            roots = f.root_nodes[f.tree[origins]]
            rounds.append((origins.copy(), f.leaf_min[origins] == f.leaf_max[origins], f.leaf_min[roots] != f.leaf_max[roots]))
        sim.rollout(f, origins)

    allocate_step(forest, alloc, budget, predictor, rollout)
    return forest, rounds


@settings(max_examples=40, deadline=None)
@given(
    spec=st.sampled_from(SPECS),
    m=st.integers(1, 160),
    pool=st.integers(1, 40),
    difficulty=st.sampled_from(["beta:0.3,0.3", "beta:2,2", "0.5*beta:0.3,3+0.5*beta:3,0.3", "list"]),
    group=st.integers(1, 10),
    m_min=st.integers(1, 4),
    root_fraction=st.floats(0.05, 1.0),
    seed=st.integers(0, 3),
)
def test_no_allocator_overspends(spec, m, pool, difficulty, group, m_min, root_fraction, seed):
    diff = [0.0, 1.0, 0.5, 0.02] if difficulty == "list" else difficulty
    world = ContrastLabWorld(pool, n_test=0, difficulty=diff, seed=seed)
    budget = Budget(m, root_fraction=root_fraction, min_per_prompt=m_min, group_size=group)
    alloc = trace_gym.make_allocator(spec[0], **spec[1])
    predictor = _predictor_for(alloc)
    sim = ContrastLabSim(world, seed=seed)
    for _ in range(2):  # the second step runs with a trained predictor
        forest, spend = _step(world, alloc, budget, predictor, sim=sim)
        assert spend.trajectories <= m
        assert alloc.spent is spend
        assert forest.n_trajectories == spend.trajectories == spend.roots + spend.branches
        assert spend.prompts <= pool
        if predictor is not None:
            nodes = np.flatnonzero(((forest.flags & TERMINAL) == 0) & (forest.n_leaves > 0))
            predictor.update(forest.histories(nodes), forest.value[nodes], forest.n_leaves[nodes].astype(float))


@pytest.mark.parametrize("episodes", ["one turn", "failed"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s[0] + "".join(f":{k}={v}" for k, v in s[1].items()))
def test_every_allocator_spends_its_budget_when_nothing_can_be_branched(world, spec, episodes):
    """Episodes that end after one turn (a single-turn env) or trajectories that all fail (a
    backend that errors) leave no prefix to branch from. Every allocator still spends M, so
    rows stay comparable at an equal budget; the tree allocators re-sample the prompts stage
    1 chose (before, they stopped at stage 1's M / 2)."""
    rng = np.random.default_rng(0)
    calls = []

    def rollout(f, origins):
        calls.append(f.tree[origins].tolist())
        for o in origins:
            t = f.start_trajectory(int(o))
            if episodes == "one turn":
                f.add_node(t, text="answer", n_tokens=3, terminal=True, reward=float(rng.random() < 0.5))

    alloc = trace_gym.make_allocator(spec[0], **spec[1])
    forest = Forest()
    add_candidates(forest, world.candidates(np.arange(32)))
    spend = allocate_step(forest, alloc, Budget(64, group_size=4), _predictor_for(alloc), rollout)
    assert spend.trajectories == forest.n_trajectories == 64
    if spec[0] in ("uniform", "trace", "trace-paper", "oracle") and spec[1].get("stage2") != "none":
        # stage 2 happened, and its re-samples went to the prompts stage 1 chose
        assert len(calls) > 1 and set(sum(calls[1:], [])) <= set(calls[0])


@pytest.fixture(scope="module")
def world():
    return ContrastLabWorld(96, n_test=0, seed=0)


def test_grpo_gives_g_each_to_random_prompts(world):
    counts = []
    for seed in (0, 1):
        alloc = trace_gym.make_allocator("grpo", seed=seed)
        forest, spend = _step(world, alloc, Budget(100, group_size=8), None)
        per_tree = forest.n_leaves[forest.root_nodes]
        assert sorted(set(per_tree.tolist())) == [0, 8] and (per_tree == 8).sum() == 12
        assert spend.trajectories == 96 and spend.branches == 0
        counts.append(per_tree)
    assert not np.array_equal(counts[0], counts[1])
    small = ContrastLabWorld(5, n_test=0, seed=0)
    forest, _ = _step(small, trace_gym.make_allocator("grpo"), Budget(100, group_size=8), None)
    assert forest.n_leaves[forest.root_nodes].tolist() == [8] * 5


def test_uniform_spreads_evenly(world):
    alloc = trace_gym.make_allocator("uniform", seed=0)
    forest, spend = _step(world, alloc, Budget(200, root_fraction=0.5, min_per_prompt=2), None)
    roots = forest.root_nodes
    bare = np.bincount(forest.tree[forest.traj_origin[forest.parent[forest.traj_origin] < 0]], minlength=96)
    assert (bare > 0).sum() == 50 and set(bare[bare > 0].tolist()) == {2}
    assert spend.roots == 100 and spend.branches == 100
    # stage 2 alone: continuations differ by at most one between prefixes
    f2 = Forest()
    add_candidates(f2, world.candidates(np.arange(8)))
    ContrastLabSim(world).rollout(f2, np.repeat(f2.root_nodes.astype(np.int64), 2))
    f2.backup()
    plan = uniform_prefixes(f2, 37, np.random.default_rng(0))
    ks = dict(plan)
    per = [ks.get(int(n), 0) for n in f2.branchable()]
    assert sum(per) == 37 and max(per) - min(per) <= 1
    assert len(roots) == 96


def test_trace_ablation_switches_change_behaviour(world):
    budget = Budget(256)
    oracle = trace_gym.make_predictor("oracle")
    uni = trace_gym.make_allocator("uniform", seed=3)
    f_uni, _ = _step(world, uni, budget, None, seed=1)
    # stage1=uniform: the same roots as the uniform allocator (at the same m_min), whatever the predictor says
    t_u = trace_gym.make_allocator("trace", stage1="uniform", stage2="uniform", m_min="budget", seed=3)
    f_tu, _ = _step(world, t_u, budget, oracle, seed=1)
    assert np.array_equal(f_tu.n_leaves[f_tu.root_nodes], f_uni.n_leaves[f_uni.root_nodes])
    # stage1=active: exactly the stage-1 solver on the predictions (groups of at least G/2 by
    # default), written to forest.pred
    t_a = trace_gym.make_allocator("trace", stage2="uniform")
    f_ta, spend = _step(world, t_a, budget, oracle, seed=1)
    v = f_ta.oracle[f_ta.root_nodes]
    bare = np.bincount(f_ta.tree[f_ta.traj_origin[f_ta.parent[f_ta.traj_origin] < 0]], minlength=96)
    assert np.array_equal(bare, solve_roots(v, budget.root_trajectories, budget.group_size // 2))
    assert np.allclose(f_ta.pred[f_ta.root_nodes], v)
    # stage2=active: continuations only from prefixes whose subtree was pure
    _, rounds = _stage2_origins(world, trace_gym.make_allocator("trace"), budget, oracle)
    assert rounds[0][1].all()
    # active beats uniform on the contrast it targets, over a few steps with the true values
    mixed = {}
    for name, kw in (("active", {}), ("uniform", {"stage2": "uniform"})):
        alloc = trace_gym.make_allocator("trace", **kw)
        sim = ContrastLabSim(world, seed=5)
        rates = []
        for _ in range(4):
            f, _ = _step(world, alloc, budget, oracle, sim=sim)
            rates.append(f.effective_sample_ratio(f.advantages("trace"))[0])
        mixed[name] = np.mean(rates)
    assert mixed["active"] > mixed["uniform"] + 0.05
    with pytest.raises(ValueError, match="stage1"):
        trace_gym.make_allocator("trace", stage1="greedy")
    with pytest.raises(ValueError, match="needs a predictor"):
        _step(world, trace_gym.make_allocator("trace"), budget, None)


def test_trace_stage2_scopes(world):
    budget = Budget(256)
    oracle = trace_gym.make_predictor("oracle")
    # "mixed": every branch starts at a pure prefix of a tree stage 1 found mixed
    _, rounds = _stage2_origins(world, trace_gym.make_allocator("trace", scope="mixed"), budget, oracle)
    origins, pure, in_mixed = rounds[0]
    assert origins.size == budget.trajectories - budget.root_trajectories
    assert pure.all() and in_mixed.all()
    # the paper's "subtree" (the default): pure prefixes of pure trees compete too, and some win here
    assert trace_gym.make_allocator("trace").scope == "subtree"
    _, rounds = _stage2_origins(world, trace_gym.make_allocator("trace"), budget, oracle)
    assert rounds[0][1].all() and not rounds[0][2].all()
    # "tree": only trees still pure
    _, rounds = _stage2_origins(world, trace_gym.make_allocator("trace", scope="tree"), budget, oracle)
    assert rounds[0][1].all() and not rounds[0][2].any()
    # with no mixed tree (every prompt always fails or always succeeds) "mixed" falls back to
    # every pure prefix and still spends the budget
    flat = ContrastLabWorld(24, n_test=0, difficulty=[0.0, 1.0], seed=0)
    forest, rounds = _stage2_origins(flat, trace_gym.make_allocator("trace", scope="mixed"), Budget(64),
                                     trace_gym.make_predictor("hashed"))
    assert forest.n_trajectories == 64
    assert rounds and all(r[1].all() and not r[2].any() for r in rounds)
    with pytest.raises(ValueError, match="scope"):
        trace_gym.make_allocator("trace", scope="prefix")


def test_oracle_allocator_needs_true_values(world):
    forest = Forest()
    forest.add_root("x", "a prompt without a known value")
    with pytest.raises(ValueError, match="ContrastLab"):
        allocate_step(forest, trace_gym.make_allocator("oracle"), Budget(8), None, lambda f, o: None)
    f, spend = _step(world, trace_gym.make_allocator("oracle"), Budget(256), None)
    assert spend.trajectories == 256 and spend.branches > 0


def test_dapo_keeps_only_mixed_groups_and_resamples(world):
    alloc = trace_gym.make_allocator("dapo", seed=0)
    budget = Budget(512, group_size=8)  # batch of B = 32 groups
    forest, spend = _step(world, alloc, budget, None)
    roots = forest.root_nodes
    sampled = forest.n_leaves[roots] > 0
    mixed = forest.leaf_min[roots] < forest.leaf_max[roots]
    assert np.array_equal(alloc.kept, sampled & mixed)
    assert not np.any(alloc.kept & ~mixed)
    assert sampled.sum() > 32  # all-equal groups were replaced by fresh prompts
    fresh_left = (~sampled).sum() > 0 and budget.trajectories - spend.trajectories >= 8
    assert alloc.kept.sum() >= 32 or not fresh_left
    # prompts this close to 1/2 fill the batch early: the rest of the budget still goes to fresh groups
    easy = ContrastLabWorld(400, n_test=0, difficulty="beta:8,8", seed=0)
    alloc = trace_gym.make_allocator("dapo", seed=1)
    forest, spend = _step(easy, alloc, budget, None)
    assert spend.trajectories == budget.trajectories and alloc.kept.sum() > 32
    # a world where every group is all-equal: DAPO re-samples until budget or prompts run out, keeps nothing
    solved = ContrastLabWorld(40, n_test=0, difficulty=[0.0, 1.0], seed=0)
    alloc = trace_gym.make_allocator("dapo")
    forest, spend = _step(solved, alloc, Budget(200, group_size=8), None)
    assert spend.trajectories == 200 // 8 * 8 and not alloc.kept.any()


def test_pcl_picks_prompts_nearest_one_half(world):
    alloc = trace_gym.make_allocator("pcl")
    forest, _ = _step(world, alloc, Budget(128, group_size=8), trace_gym.make_predictor("oracle"))
    v = forest.oracle[forest.root_nodes]
    chosen = forest.n_leaves[forest.root_nodes] > 0
    assert chosen.sum() == 16
    assert np.abs(v[chosen] - 0.5).max() <= np.abs(v[~chosen] - 0.5).min()
    assert set(forest.n_leaves[forest.root_nodes][chosen].tolist()) == {8}


def test_nearest_half_ranks_by_distance_and_breaks_ties_at_random():
    v = np.array([0.9, 0.5, 0.3, 0.5, 0.55, 0.0, 0.5])
    first = nearest_half(v, 3, np.random.default_rng(0))
    assert sorted(first.tolist()) == [1, 3, 6]  # the three exact halves, before 0.55
    assert nearest_half(v, 4, np.random.default_rng(0))[3] == 4
    orders = {tuple(nearest_half(v, 3, np.random.default_rng(s)).tolist()) for s in range(20)}
    assert len(orders) > 1  # tied entries come in an order drawn from the generator
    assert nearest_half(v, 10, np.random.default_rng(0)).tolist()[-1] == 5  # n beyond the size: all, farthest last


@pytest.mark.parametrize("seed", range(6))
def test_knapsack_dp_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, budget, n_max = int(rng.integers(1, 5)), int(rng.integers(0, 9)), int(rng.integers(1, 5))
    p = rng.random(n)
    if seed == 0:
        p[0] = 1 / 3  # the InfoGain weight's maximum
    counts = knapsack_counts(p, budget, n_max)
    assert counts.sum() <= budget and counts.max(initial=0) <= n_max
    best = max(
        knapsack_value(p, np.array(c)).sum()
        for c in itertools.product(range(min(n_max, budget) + 1), repeat=n) if sum(c) <= budget
    )
    assert knapsack_value(p, counts).sum() == pytest.approx(best, abs=1e-12)


def test_knapsack_allocator_spends_the_budget_on_uncertain_prompts(world):
    alloc = trace_gym.make_allocator("knapsack")
    forest, spend = _step(world, alloc, Budget(300), trace_gym.make_predictor("oracle"))
    assert spend.trajectories == 300 and spend.branches == 0
    v = forest.oracle[forest.root_nodes]
    n = forest.n_leaves[forest.root_nodes]
    assert n[(v > 0.1) & (v < 0.6)].mean() > n[(v < 0.01) | (v > 0.99)].mean()


# ----------------------------------------------------------------------------- trace: stage 1 under uncertainty


def test_v_root_beta_is_the_beta_binomial_mixing_probability():
    from math import lgamma

    def log_beta(x, y):
        return lgamma(x) + lgamma(y) - lgamma(x + y)

    mean, conc = np.array([0.5, 0.1, 0.93, 0.3]), np.array([1.0, 0.4, 7.0, np.inf])
    table = v_root_beta(mean, conc, 6)
    assert table.shape == (4, 7) and np.all(table[:, :2] == 0.0)
    for i in range(3):
        a, b = mean[i] * conc[i], (1 - mean[i]) * conc[i]
        for m in range(1, 7):
            pure = np.exp(log_beta(a + m, b) - log_beta(a, b)) + np.exp(log_beta(a, b + m) - log_beta(a, b))
            assert table[i, m] == pytest.approx(1.0 - pure, abs=1e-12)
    assert table[3].tolist() == pytest.approx(v_root(0.3, np.arange(7)).tolist())  # inf: the point estimate
    # uncertainty about v lowers the chance of a mixed group at every m >= 2
    t = v_root_beta(np.full(3, 0.5), np.array([0.5, 5.0, np.inf]), 8)
    assert np.all(t[0, 2:] < t[1, 2:]) and np.all(t[1, 2:] < t[2, 2:])
    with pytest.raises(ValueError, match="positive"):
        v_root_beta(np.array([0.5]), np.array([0.0]), 3)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 4),
    budget=st.integers(0, 10),
    m_min=st.integers(1, 3),
    m_max=st.sampled_from([0, 3, 5]),
    seed=st.integers(0, 10_000),
)
def test_solve_roots_beta_is_optimal_on_small_instances(n, budget, m_min, m_max, seed):
    if 0 < m_max < m_min:
        m_max = m_min
    rng = np.random.default_rng(seed)
    mean = rng.random(n)
    conc = np.where(rng.random(n) < 0.25, np.inf, rng.exponential(3.0, n) + 0.05)
    counts = solve_roots_beta(mean, conc, budget, m_min, m_max)
    cap = min(m_max, budget) if m_max > 0 else budget
    assert counts.sum() <= budget and np.all((counts == 0) | ((counts >= m_min) & (counts <= cap)))
    table = v_root_beta(mean, conc, max(cap, 1))
    choices = [0] + list(range(m_min, cap + 1))
    best = max(sum(table[i, c[i]] for i in range(n)) for c in itertools.product(choices, repeat=n) if sum(c) <= budget)
    assert sum(table[i, counts[i]] for i in range(n)) == pytest.approx(best, abs=1e-12)
    # with point estimates it reaches the optimum of the paper's stage-1 solver
    point = solve_roots_beta(mean, np.full(n, np.inf), budget, m_min, m_max)
    exact = solve_roots(mean, budget, m_min, m_max)
    assert v_root(mean, point).sum() == pytest.approx(v_root(mean, exact).sum(), abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_solve_roots_beta_cap_bound_loses_nothing(seed):
    # many near-hopeless prompts and a few very uncertain ones, whose gains fall slowly: the
    # bounded cap must reach the optimum of the DP whose cap is the whole budget
    rng = np.random.default_rng(seed)
    n, budget = 150, 200
    mean = np.where(rng.random(n) < 0.1, rng.uniform(0.3, 0.7, n), rng.uniform(0.0005, 0.01, n))
    conc = np.where(mean > 0.1, rng.uniform(0.05, 0.5, n), np.where(rng.random(n) < 0.5, np.inf, 50.0))
    fast = solve_roots_beta(mean, conc, budget)
    full = solve_roots_beta(mean, conc, budget, m_max=budget)
    table = v_root_beta(mean, conc, budget)
    assert table[np.arange(n), fast].sum() == pytest.approx(table[np.arange(n), full].sum(), abs=1e-12)
    assert fast.sum() == budget


def test_solve_roots_beta_raises_its_cap_when_the_solution_needs_it():
    # one uncertain prompt and a large budget: every unit goes to it, far beyond the first cap of 32
    assert solve_roots_beta(np.array([0.5]), np.array([1.0]), 100).tolist() == [100]
    assert solve_roots_beta(np.array([0.5]), np.array([1.0]), 100, m_max=40).tolist() == [40]
    assert solve_roots_beta(np.array([0.5, 0.5]), np.array([1.0, 1.0]), 1).tolist() == [0, 0]  # below m_min
    with pytest.raises(ValueError, match="m_max"):
        solve_roots_beta(np.array([0.5]), np.array([1.0]), 10, m_min=3, m_max=2)


def test_trace_stage1_plans_on_the_predictive_distribution(world):
    budget = Budget(256)
    hashed = trace_gym.make_predictor("hashed", bits=14, counts=True)
    sim = ContrastLabSim(world, seed=2)
    for _ in range(2):  # train the predictor so the roots have counts
        forest, _ = _step(world, trace_gym.make_allocator("uniform", seed=1), budget, None, sim=sim)
        nodes = np.flatnonzero(((forest.flags & TERMINAL) == 0) & (forest.n_leaves > 0))
        hashed.update(forest.histories(nodes), forest.value[nodes], forest.n_leaves[nodes].astype(float))
    plans = {}
    for uncertainty in (True, False):
        alloc = trace_gym.make_allocator("trace", stage2="uniform", uncertainty=uncertainty)
        f, _ = _step(world, alloc, budget, hashed, seed=4)
        plans[uncertainty] = np.bincount(f.tree[f.traj_origin[f.parent[f.traj_origin] < 0]], minlength=world.n_tasks)
        mean, conc = hashed.predict_beta(f.histories(f.root_nodes))
        assert np.allclose(f.pred[f.root_nodes], mean)
    assert np.isfinite(conc).all()
    m_min = budget.group_size // 2  # trace's default stage-1 group minimum
    assert np.array_equal(plans[True], solve_roots_beta(mean, conc, budget.root_trajectories, m_min))
    assert np.array_equal(plans[False], solve_roots(mean, budget.root_trajectories, m_min))
    assert not np.array_equal(plans[True], plans[False])
    # the oracle allocator plans on the exact values whatever predictor it is handed
    f, _ = _step(world, trace_gym.make_allocator("oracle", stage2="uniform"), budget, hashed, seed=4)
    v = f.oracle[f.root_nodes]
    bare = np.bincount(f.tree[f.traj_origin[f.parent[f.traj_origin] < 0]], minlength=world.n_tasks)
    assert np.array_equal(bare, solve_roots(v, budget.root_trajectories, m_min)) and np.allclose(f.pred[f.root_nodes], v)


# ----------------------------------------------------------------------------- stage options, the paper's rule


def test_trace_stage1_group_minimum(world):
    """trace's stage 1 gives each sampled prompt at least G/2 rollouts by default (so with
    root_fraction 0.5 it samples at most M / G prompts, as many as grpo); m_min (a count or a
    fraction of G) and root_fraction override the budget's; trace-paper keeps the paper's m_min."""
    oracle = trace_gym.make_predictor("oracle")

    def bare_counts(spec, budget, **kw):
        alloc = trace_gym.make_allocator(spec, stage2="uniform", **kw)  # uniform stage 2 never extends a root
        f, _ = _step(world, alloc, budget, oracle, seed=2)
        counts = np.bincount(f.tree[f.traj_origin[f.parent[f.traj_origin] < 0]], minlength=f.n_trees)
        return counts[counts > 0]

    budget = Budget(256, group_size=8)
    default = bare_counts("trace", budget)
    assert default.min() >= 4 and default.sum() == budget.root_trajectories
    assert default.size <= budget.trajectories // budget.group_size
    paper = bare_counts("trace-paper", budget)
    assert paper.min() < 4 and paper.size > default.size  # groups from 2 up: more prompts
    assert bare_counts("trace", budget, m_min="budget").size > default.size
    fixed = bare_counts("trace", budget, m_min=6, root_fraction=0.375)
    assert fixed.min() >= 6 and fixed.sum() == 96
    # a fraction of G scales with the group: ceil(0.75 G) is 6 at G = 8 and 3 at G = 4
    scaled = bare_counts("trace", budget, m_min=0.75, root_fraction=0.375)
    assert scaled.min() >= 6 and scaled.sum() == 96 and scaled.size <= 16
    small = bare_counts("trace", Budget(64, group_size=4), m_min=0.75, root_fraction=0.375)
    assert small.min() >= 3 and small.sum() == 24 and small.size <= 8
    # the fraction rounds up, but not past a float product's last bit: 0.3 x 10 is 3
    assert trace_gym.make_allocator("trace", m_min=0.3).stage1_budget(Budget(100, group_size=10)).min_per_prompt == 3
    # a small group keeps the budget's m_min (G/2 never goes below it)
    assert bare_counts("trace", Budget(32, group_size=2)).min() == 2
    for bad in (0, "pairs", 1.5, 1.0, 0.0, True):
        with pytest.raises(ValueError, match="m_min"):
            trace_gym.make_allocator("trace", m_min=bad)
    with pytest.raises(ValueError, match="root_fraction"):
        trace_gym.make_allocator("trace", root_fraction=0.0)


def test_trace_spreads_stage1_when_every_prompt_is_predicted_to_fail(world):
    """A real policy that failed everywhere so far makes the predictor say 0 for every prompt:
    no allocation can be mixed in expectation, and stage 1 must still sample groups over many
    prompts (before, the whole stage-1 budget went to one prompt)."""
    zero = trace_gym.make_predictor("hashed")
    zero.predict = lambda histories: np.zeros(len(histories))
    budget = Budget(128, group_size=4)
    alloc = trace_gym.make_allocator("trace", stage2="uniform")
    f, spend = _step(world, alloc, budget, zero, pool=np.arange(64), seed=1)
    roots = f.traj_origin[f.parent[f.traj_origin] < 0]
    counts = np.bincount(f.tree[roots], minlength=f.n_trees)
    assert counts.sum() == budget.root_trajectories
    assert (counts > 0).sum() == budget.root_trajectories // 2 and set(counts[counts > 0].tolist()) == {2}


class _RootBeliefs:
    """A predictor whose roots' Beta predictive is set by task id (inner nodes: 0.5)."""

    def __init__(self, means, concentration):
        self.means, self.concentration = means, concentration

    def predict(self, histories):
        return self.predict_beta(histories)[0]

    def predict_beta(self, histories):
        mean = np.array([self.means[h.task_id] if not h.steps else 0.5 for h in histories])
        return mean, np.full(mean.size, self.concentration)


def test_trace_m_max_caps_stage_one_groups(world):
    """``m_max``: the most stage-1 rollouts one prompt gets; ``"m_min"`` makes every selected
    prompt's group exactly m_min, so stage 1 samples M_root / m_min prompts where the
    uncapped rule concentrates on the prompts it believes nearest 1/2."""
    ids = [c.task_id for c in world.candidates(np.arange(16))]
    means = {t: (0.5 if i < 4 else 0.05) for i, t in enumerate(ids)}  # four even prompts, twelve nearly hopeless
    budget = Budget(32, group_size=4)  # M_root = 16, m_min = G/2 = 2

    def plan(**kw):
        f = Forest()
        add_candidates(f, world.candidates(np.arange(16)))
        return trace_gym.make_allocator("trace", **kw).plan_roots(f, budget, _RootBeliefs(means, 50.0))

    free, capped, three = plan(), plan(m_max="m_min"), plan(m_max=3)
    assert free.sum() == capped.sum() == three.sum() == 16
    assert free.max() > 3 and (free > 0).sum() < 8  # uncapped: more than 3 on the even prompts, fewer prompts
    assert sorted(capped[capped > 0].tolist()) == [2] * 8  # exactly pairs, on 8 prompts
    assert (capped[:4] == 2).all()  # the even prompts first
    assert three.max() == 3 and set(three[three > 0].tolist()) <= {2, 3}
    # the budget's own cap still applies when m_max is unset
    f = Forest()
    add_candidates(f, world.candidates(np.arange(16)))
    capped_budget = Budget(32, group_size=4, max_per_prompt=2)
    assert trace_gym.make_allocator("trace").plan_roots(f, capped_budget, _RootBeliefs(means, 50.0)).max() == 2
    for bad in (0, -1, True, 1.5, "m_max"):
        with pytest.raises(ValueError, match="m_max"):
            trace_gym.make_allocator("trace", m_max=bad)
    with pytest.raises(ValueError, match="at least m_min"):
        trace_gym.make_allocator("trace", m_min=3, m_max=2)
    with pytest.raises(ValueError, match="at least m_min"):  # G/2 = 4 here, above the cap of 3
        trace_gym.make_allocator("trace", m_max=3).plan_roots(Forest(), Budget(32, group_size=8), None)


def test_trace_rescue_spends_single_rollouts_on_pure_prompts_worth_mixing(world):
    """``rescue=R``: up to R rounds of one fresh rollout for each pure prompt whose next
    outcome, under the root's predictive updated with the step's equal outcomes, disagrees
    with probability p such that p (n + 1) > 1; then the usual stage 2."""
    ids = [c.task_id for c in world.candidates(np.arange(8))]
    means = {t: (0.5 if i < 4 else 0.02) for i, t in enumerate(ids)}  # four even prompts, four hopeless
    budget = Budget(64, group_size=4)

    def run(rescue, concentration):
        f, seen = Forest(), []
        add_candidates(f, world.candidates(np.arange(8)))

        def rollout(forest, origins):  # every rollout fails: every prompt stays pure
            seen.append([(int(o), int(forest.tree[o]), bool(forest.parent[o] < 0)) for o in origins])
            for o in origins:
                t = forest.start_trajectory(int(o))
                forest.add_node(t, text="turn", n_tokens=2)
                forest.add_node(t, text="end", n_tokens=2, terminal=True, reward=0.0)

        spend = allocate_step(f, trace_gym.make_allocator("trace", rescue=rescue), budget,
                              _RootBeliefs(means, concentration), rollout)
        assert spend.trajectories == 64
        return seen

    # a firm belief at 1/2 (concentration 20) survives a failed group: three rounds of one
    # root rollout for each even prompt, none for the hopeless ones, then the usual stage 2
    seen = run(3, 20.0)
    for wave in seen[1:4]:
        trees = [tree for _, tree, is_root in wave if is_root]
        assert len(trees) == len(wave) == len(set(trees)) > 0
        assert {ids[t] for t in trees} <= set(ids[:4])
    assert sum(len(w) for w in seen[4:]) == 64 - sum(len(w) for w in seen[:4])
    # a weak one (Beta(1, 1)) after the failed group puts success at 1/(2 + n): a single rollout
    # gains less than one effective trajectory, so nothing is rescued and the step is the default's
    assert run(3, 2.0) == run(0, 2.0)
    for bad in (-1, True, 1.5, "yes"):
        with pytest.raises(ValueError, match="rescue"):
            trace_gym.make_allocator("trace", rescue=bad)


def test_trace_stage_names_and_the_papers_rule(world):
    budget = Budget(256, root_fraction=0.5)
    # stage2="none": stage 1 spends the whole budget and nothing branches
    forest, spend = _step(world, trace_gym.make_allocator("trace", stage2="none"), budget, trace_gym.make_predictor("hashed"))
    assert spend.trajectories == 256 and spend.branches == 0 and spend.roots == 256
    # stage1="paper" is the point-estimate rule whatever `uncertainty` says; "posterior" the Beta one
    assert trace_gym.make_allocator("trace", stage1="paper").uncertainty is False
    assert trace_gym.make_allocator("trace", stage1="posterior", uncertainty=False).uncertainty is True
    plans = {}
    for spec in ({"stage1": "paper"}, {"stage1": "active", "uncertainty": False}):
        pred = trace_gym.make_predictor("hashed")
        f = Forest()
        add_candidates(f, world.candidates(np.arange(world.n_tasks)))
        plans[str(spec)] = trace_gym.make_allocator("trace", **spec).plan_roots(f, budget, pred)
    a, b = plans.values()
    assert np.array_equal(a, b)
    paper = trace_gym.make_allocator("trace-paper")
    assert (paper.stage1, paper.uncertainty, paper.stage2, paper.scope, paper.rounds) == ("active", False, "active", "subtree", 1)
    from trace_gym.run import defaults

    pred, adv = defaults("trace-paper")
    assert str(pred) == "hashed" and str(adv) == "trace"
    # the measured default differs from the paper's rule in the advantage and the stage-1
    # group minimum (README "Measured")
    assert [str(x) for x in defaults("trace")] == ["hashed", "grpo"]
    default = trace_gym.make_allocator("trace")
    assert (default.m_min, default.scope) == ("half-group", "subtree")
    assert trace_gym.make_predictor("hashed").counts is False
    with pytest.raises(ValueError, match="stage2"):
        trace_gym.make_allocator("trace", stage2="paper")


# ----------------------------------------------------------------------------- competitors and the ratio ceiling


def test_greso_skips_by_its_formula_and_adapts():
    g = GRESOAllocator(p_easy=0.5, p_hard=0.8, target_zero_variance=0.3, delta_p=0.05)
    g.streak = {"a": 2, "b": 1, "c": 0}
    g.hard = {"a": False, "b": True}
    assert np.allclose(g.skip_probability(["a", "b", "c", "new"]), [1 - 0.5**2, 1 - 0.8, 0.0, 0.0])
    forest = Forest()
    for t, rewards in (("a", [1, 1]), ("b", [0, 1]), ("c", [0, 0])):
        root = forest.add_root(t, t)
        for r in rewards:
            forest.add_node(forest.start_trajectory(root), terminal=True, reward=float(r))
    forest.backup()
    g.observe(forest)
    assert g.streak == {"a": 3, "b": 0, "c": 1} and g.hard["a"] is False and g.hard["c"] is True
    # one easy and one hard zero-variance group of three: 1/3 > 0.3/3 easy and 1/3 > 0.2 hard, so both skip more
    assert g.p_easy == pytest.approx(0.45) and g.p_hard == pytest.approx(0.75)
    # with the filter certain to skip "a", the budget goes to the others first
    g.streak, g.hard, g.p_easy = {"a": 50}, {"a": False}, 0.01
    f = Forest()
    for t in ("a", "b", "c"):
        f.add_root(t, t)
    counts = g.plan_roots(f, Budget(16, group_size=8), None)
    assert counts.tolist() == [0, 8, 8] and g.skipped == 1


def _brute_vip(p, budget, n_min, n_max):
    best = np.inf
    for n in itertools.product(range(n_min, n_max + 1), repeat=len(p)):
        if sum(n) == budget:
            best = min(best, sum(max(x * (1 - x), 1e-6) / (k - 1) for x, k in zip(p, n)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_vip_counts_minimise_the_summed_variance(seed):
    rng = np.random.default_rng(seed)
    p = rng.random(4) * np.array([1, 1, 0.1, 1])
    n_min, n_max = 2, 7
    budget = int(rng.integers(4 * n_min, 4 * n_max + 1))
    n = vip_counts(p, budget, n_min, n_max)
    assert n.sum() == budget and n.min() >= n_min and n.max() <= n_max
    got = sum(max(x * (1 - x), 1e-6) / (k - 1) for x, k in zip(p, n))
    assert got == pytest.approx(_brute_vip(p, budget, n_min, n_max), rel=1e-12)
    # prompts the predictor thinks settled get the minimum; the most uncertain get the most
    q = np.array([0.5, 0.01, 0.99, 0.3])
    n = vip_counts(q, 20)
    assert n[1] == n[2] == 2 and n[0] == n.max()
    with pytest.raises(ValueError, match="cannot give"):
        vip_counts(q, 7)


def test_oracle_er_tops_the_effective_ratio_at_equal_prompts():
    cfg = BenchConfig(allocators=["grpo", "pcl", "trace", "trace:scope=tree", "oracle", "oracle-er", "greso", "vip"], steps=4,
                      prompts=128, trajectories=256, tasks=512, seed=2, eval_prompts=32)
    res = run_bench(cfg)["allocators"]
    er = {k: r["effective_ratio"] for k, r in res.items()}
    assert er["oracle-er"] == max(er.values()) and er["oracle-er"] > er["oracle"]
    assert res["oracle-er"]["prompts"] == 256 // 8  # as many prompts as grpo samples
    assert all(r["trajectories"] == 256 for r in res.values())
