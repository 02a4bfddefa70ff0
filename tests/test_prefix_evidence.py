"""Stage 2 under the posterior of a prefix's value (``trace:stage2=posterior``): the solver,
the evidence read from finished forests, the fitted concentration and the allocator."""

import itertools

import numpy as np
import pytest

from trace_gym.allocation.budget import Budget
from trace_gym.allocation.prefix_evidence import (CONCENTRATIONS, BranchEvidence, branch_evidence, fit_concentration,
                                                   group_log_likelihoods, log_likelihood)
from trace_gym.allocation.solvers import solve_prefixes, solve_prefixes_beta, v_pref, v_pref_beta
from trace_gym import make_allocator
from trace_gym.forest.forest import Forest
from trace_gym.step import disagreement_metrics


def test_solve_prefixes_beta_is_exact_and_is_the_paper_solver_at_infinite_concentration():
    rng = np.random.default_rng(0)
    for _ in range(150):
        m = int(rng.integers(1, 5))
        v, r = rng.random(m), (rng.random(m) < 0.5).astype(float)
        n = rng.integers(1, 4, m).astype(float)
        budget = int(rng.integers(0, 7))
        inf = np.full(m, np.inf)
        assert solve_prefixes_beta(v, r, n, inf, budget).tolist() == solve_prefixes(v, r, budget).tolist()
        c = rng.choice([0.05, 1.0, 8.0, np.inf], m)
        k = solve_prefixes_beta(v, r, n, c, budget)
        best = max(v_pref_beta(v, r, n, c, np.array(ks)).sum()
                   for ks in itertools.product(range(budget + 1), repeat=m) if sum(ks) == budget)
        assert k.sum() == budget and v_pref_beta(v, r, n, c, k).sum() >= best - 1e-12
    assert solve_prefixes_beta([0.5, 0.5], [0, 0], [1, 1], [np.inf, np.inf], 5, k_max=2).tolist() == [2, 2]
    # a settled prefix (small c, one failure seen) is worth less than a fresh rollout's chance
    assert v_pref_beta(0.5, 0.0, 1, 0.1, 1) < 0.05 < v_pref(0.5, 0.0, 1)


@pytest.mark.parametrize("bad, match", [
    (dict(n=[-1.0]), "n .* >= 0"),
    (dict(c=[0.0]), "positive"),
    (dict(n=[1.0, 1.0]), "one length"),
])
def test_solve_prefixes_beta_rejects_bad_input(bad, match):
    args = dict(v=[0.5], r=[0.0], n=[1.0], c=[1.0]) | bad
    with pytest.raises(ValueError, match=match):
        solve_prefixes_beta(args["v"], args["r"], args["n"], args["c"], 3)


def _simulated_evidence(c: float, groups: int, rng) -> BranchEvidence:
    """Groups as a run produces them: a prefix of prior mean v, its value drawn around v,
    n outcomes seen (kept only when they agree: the prefix is pure), then t continuations."""
    rows = []
    while len(rows) < groups:
        v = rng.uniform(0.2, 0.8)
        value = v if np.isinf(c) else rng.beta(c * v, c * (1 - v))
        n, t = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        seen = rng.random(n) < value
        if seen.min() != seen.max():
            continue
        r = float(seen[0])
        s = int(np.count_nonzero((rng.random(t) < value) != bool(r)))
        rows.append((0, r * v + (1 - r) * (1 - v), n, t, s))
    d, a, n, t, s = (np.asarray(x, dtype=float) for x in zip(*rows))
    return BranchEvidence(d.astype(np.int64), a, n, t, s)


def test_fit_concentration_tells_settled_prefixes_from_open_ones():
    rng = np.random.default_rng(1)
    settled = fit_concentration(_simulated_evidence(0.3, 800, rng))
    assert 0.1 <= settled <= 1.0
    assert fit_concentration(_simulated_evidence(np.inf, 800, rng)) >= 100.0
    assert fit_concentration(BranchEvidence.empty()) == np.inf


def test_a_groups_log_likelihood_does_not_depend_on_the_other_groups():
    rng = np.random.default_rng(2)
    a, b = _simulated_evidence(0.3, 40, rng), _simulated_evidence(np.inf, 30, rng)
    both = group_log_likelihoods(a.concat(b), CONCENTRATIONS)
    assert both.shape == (CONCENTRATIONS.size, 70)
    # bit for bit: a sliding window that keeps its columns fits what a refit would
    assert np.array_equal(both, np.concatenate([group_log_likelihoods(a, CONCENTRATIONS),
                                                group_log_likelihoods(b, CONCENTRATIONS)], axis=1))
    assert np.array_equal(log_likelihood(a, CONCENTRATIONS), group_log_likelihoods(a, CONCENTRATIONS).sum(axis=1))
    assert group_log_likelihoods(BranchEvidence.empty(), CONCENTRATIONS).shape == (CONCENTRATIONS.size, 0)


def _rollout(f: Forest, origin: int, reward, turns: int = 2) -> list[int]:
    t = f.start_trajectory(origin)
    nodes = [f.add_node(t, n_tokens=5) for _ in range(turns - 1)]
    if reward is not None:
        nodes.append(f.add_node(t, n_tokens=5, terminal=True, reward=reward))
    return nodes


def test_branch_evidence_counts_groups_started_from_pure_prefixes():
    f = Forest()
    a, b = f.add_root("a"), f.add_root("b")
    mid = _rollout(f, a, 0.0)[0]  # stage 1: a fails twice, b is mixed
    _rollout(f, a, 0.0)
    mid_b = _rollout(f, b, 0.0)[0]
    _rollout(f, b, 1.0)
    f.pred[[a, b, mid, mid_b]] = [0.4, 0.5, 0.3, 0.6]
    _rollout(f, a, 1.0), _rollout(f, a, 0.0), _rollout(f, a, None)  # a group of 3 at a: 2 finished, 1 flips
    _rollout(f, mid, 0.0, turns=1)  # fresh rollouts from a do not pass mid: it saw one failure
    _rollout(f, mid_b, 1.0, turns=1)  # mid_b saw one failure
    f.backup()
    ev = branch_evidence(f)
    assert ev.depth.tolist() == [0, 1, 1]
    assert ev.n.tolist() == [2, 1, 1] and ev.t.tolist() == [2, 1, 1] and ev.s.tolist() == [1, 0, 1]
    assert np.allclose(ev.agree, [0.6, 0.7, 0.4])  # agreeing with a failure: 1 - v
    assert len(branch_evidence(Forest())) == 0
    # the step metrics a run logs from it: predicted chance to disagree (weighted by continuations) and the share seen
    assert disagreement_metrics(ev) == pytest.approx({"branch/root_disagree_pred": 0.4, "branch/root_disagree_seen": 0.5,
                                                      "branch/inner_disagree_pred": 0.45, "branch/inner_disagree_seen": 0.5})
    assert set(disagreement_metrics(BranchEvidence.empty()).values()) == {None}


class _Flat:
    """A predictor that knows nothing: 0.5 for every history."""

    def predict(self, histories):
        return np.full(len(histories), 0.5)


def _stage1_forest() -> Forest:
    """Four prompts after stage 1: two rollouts each, all failed (every tree pure)."""
    f = Forest()
    for i in range(4):
        root = f.add_root(f"p{i}")
        _rollout(f, root, 0.0), _rollout(f, root, 0.0)
    f.backup()
    return f


def test_posterior_stage2_spends_where_outcomes_are_not_settled():
    budget = Budget(trajectories=16, group_size=4)
    paper, post = make_allocator("trace"), make_allocator("trace", stage2="posterior")
    f = _stage1_forest()
    plan = dict(paper.plan_prefixes(f, budget, 8, _Flat()))
    assert np.any(f.depth[list(plan)] == 1)  # the point estimate: every pure prefix is a 0.5 chance alike
    before = dict(post.plan_prefixes(_stage1_forest(), budget, 8, _Flat()))
    assert before == plan  # no evidence yet: the paper's point estimate
    # a run in which every depth-1 branch agreed with its prefix and fresh rollouts of pure prompts flipped often
    rows = 200
    post.evidence = BranchEvidence(np.r_[np.zeros(rows, np.int64), np.ones(rows, np.int64)], np.full(2 * rows, 0.5),
                                   np.r_[np.full(rows, 2.0), np.ones(rows)], np.ones(2 * rows),
                                   np.r_[np.tile([1.0, 0.0, 0.0], rows)[:rows], np.zeros(rows)])
    post._fit()
    assert post.concentration[1] < 0.1 < post.concentration[0]
    f = _stage1_forest()
    plan = dict(post.plan_prefixes(f, budget, 8, _Flat()))
    assert sum(plan.values()) == 8 and np.all(f.parent[list(plan)] < 0)  # fresh rollouts of the pure prompts
    # the evidence survives a checkpoint
    other = make_allocator("trace", stage2="posterior")
    other.load_state_dict(post.state_dict())
    assert np.array_equal(other.concentration, post.concentration) and len(other.evidence) == 2 * rows
    assert "evidence" not in paper.state_dict()


def test_posterior_stage2_learns_its_concentrations_in_a_run():
    from trace_gym.sim.bench import BenchConfig
    from trace_gym.sim.source import SimSource
    from trace_gym.sim.world import ContrastLabWorld
    from trace_gym.step import Step

    config = BenchConfig(steps=3, prompts=64, trajectories=256, tasks=256, seed=0)
    step = Step.from_spec(config.run_spec("trace:stage2=posterior"), SimSource(world=ContrastLabWorld(n_tasks=256, seed=0), seed=0))
    alloc = step.allocator
    assert alloc.concentration.tolist() == [np.inf] * 4
    seen = 0
    for i in range(3):
        r = step.run(i)
        seen += len(branch_evidence(r.forest))
        assert r.metrics["spent/trajectories"] == 256
    assert len(alloc.evidence) == seen > 30
    assert np.all(np.isfinite(alloc.concentration) | (alloc.concentration == np.inf))
    assert alloc.concentration[0] == fit_concentration(alloc.evidence.where(alloc.evidence.depth == 0)) or (
        np.count_nonzero(alloc.evidence.depth == 0) < 30)
    with pytest.raises(ValueError, match="stage2 must be one of"):
        make_allocator("trace", stage2="posteriors")


def test_posterior_stage2_fits_the_last_groups_it_saw_as_a_refit_would(monkeypatch):
    import trace_gym.allocators.trace as trace_module
    from trace_gym.sim.bench import BenchConfig
    from trace_gym.sim.source import SimSource
    from trace_gym.sim.world import ContrastLabWorld
    from trace_gym.step import Step

    monkeypatch.setattr(trace_module, "EVIDENCE_MEMORY", 80)  # a window the run overflows
    config = BenchConfig(steps=4, prompts=64, trajectories=256, tasks=256, seed=1)
    step = Step.from_spec(config.run_spec("trace:stage2=posterior"), SimSource(world=ContrastLabWorld(n_tasks=256, seed=1), seed=1))
    alloc = step.allocator
    seen = BranchEvidence.empty()
    for i in range(4):
        seen = seen.concat(branch_evidence(step.run(i).forest))
        window = seen.tail(80)
        assert np.array_equal(alloc.evidence.n, window.n) and np.array_equal(alloc.evidence.agree, window.agree)
        bucket = np.minimum(window.depth, trace_module.EVIDENCE_DEPTHS)
        pooled = fit_concentration(window) if len(window) >= trace_module.EVIDENCE_MIN else np.inf
        refit = [fit_concentration(window.where(bucket == d)) if np.count_nonzero(bucket == d) >= trace_module.EVIDENCE_MIN
                 else pooled for d in range(trace_module.EVIDENCE_DEPTHS + 1)]
        assert alloc.concentration.tolist() == refit
    assert len(seen) > 80 and np.isfinite(alloc.concentration).any()
    restored = make_allocator("trace", stage2="posterior")
    restored.load_state_dict(alloc.state_dict())
    assert restored.concentration.tolist() == alloc.concentration.tolist()
