"""Predictors of V(H) (beta, hashed, oracle) and the calibration metrics."""

from __future__ import annotations

import numpy as np
import pytest

import trace_gym
from trace_gym.allocation.budget import Budget
from trace_gym.allocation.allocator import add_candidates, allocate_step
from trace_gym.predictors.calibration import auc, brier, calibration, ece
from trace_gym.sim import ContrastLabSim, ContrastLabWorld
from trace_gym.forest.forest import TERMINAL, Forest, History


# ----------------------------------------------------------------------------- calibration metrics


def test_brier_by_hand():
    assert brier([0.2, 0.7], [0, 1]) == pytest.approx((0.04 + 0.09) / 2)
    assert brier([0.2, 0.7], [0, 1], [1, 3]) == pytest.approx((0.04 + 3 * 0.09) / 4)
    assert brier([0.5] * 4, [0, 1, 1, 0]) == pytest.approx(0.25)
    # a fractional target counts as its outcomes: V_hat = 0.25 over 4 leaves = 1 success, 3 failures
    assert brier([0.5], [0.25], [4]) == pytest.approx(brier([0.5] * 4, [1, 0, 0, 0]))
    assert np.isnan(brier([], []))


def test_ece_by_hand():
    # bin [0.1, 0.2): mean pred 0.15, mean outcome 0.5 (weight 2); bin [0.8, 0.9): 0.85 vs 1 (weight 1)
    assert ece([0.15, 0.15, 0.85], [0, 1, 1]) == pytest.approx((2 * 0.35 + 0.15) / 3)
    assert ece([1.0, 0.0], [1, 0]) == pytest.approx(0.0)  # 1.0 falls in the last bin
    assert ece([0.3, 0.3, 0.3], [0, 1, 0], n_bins=1) == pytest.approx(abs(0.3 - 1 / 3))


def test_auc_by_hand_with_ties_and_weights():
    assert auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auc([0.5, 0.5], [1, 0]) == pytest.approx(0.5)
    assert auc([0.2, 0.9], [0, 1]) == 1.0 and auc([0.9, 0.2], [0, 1]) == 0.0
    # weights act as repetitions
    assert auc([0.1, 0.4, 0.35], [0, 0, 1], [2, 1, 3]) == pytest.approx(auc([0.1, 0.1, 0.4, 0.35, 0.35, 0.35], [0, 0, 0, 1, 1, 1]))
    # fractional targets split into successes and failures: 0.6 -> (1 success, 1 failure) at weight 2 ... by hand:
    # outcomes (p=0.2, y=1 w=.5), (0.2, 0 w=.5), (0.7, 1 w=1): pairs pos x neg: (0.2 vs 0.2) tie .5*.5*.5, (0.7 vs 0.2) 1*.5
    assert auc([0.2, 0.7], [0.5, 1.0]) == pytest.approx((0.5 * 0.5 * 0.5 + 1 * 0.5) / (1.5 * 0.5))
    assert np.isnan(auc([0.3, 0.4], [1, 1]))


def test_calibration_rejects_bad_input():
    with pytest.raises(ValueError, match="same length"):
        brier([0.1], [0, 1])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        auc([1.5], [1])
    with pytest.raises(ValueError, match="non-negative"):
        ece([0.5], [1], [-1])
    out = calibration([0.2, 0.8], [0, 1])
    assert set(out) == {"brier", "ece", "auc", "weight"} and out["weight"] == 2


# ----------------------------------------------------------------------------- beta and oracle


def test_beta_posterior_by_hand():
    beta = trace_gym.make_predictor("beta")
    a, b = History("t/a", "prompt a"), History("t/b", "prompt b")
    assert beta.predict([a, b]).tolist() == [0.5, 0.5]
    inner = History("t/a", "prompt a", steps=("x",))
    beta.update([a, inner], np.array([0.75, 0.0]), np.array([4.0, 1.0]))  # the inner node is ignored
    # population mean 3/4; prior 1.5 : 0.5; task a: (1.5 + 3) / (2 + 4)
    assert beta.predict([a, b, inner]).tolist() == pytest.approx([0.75, 0.75, 0.75])
    beta.update([b], np.array([0.0]), np.array([2.0]))
    m = 3 / 6
    assert beta.predict([a, b]).tolist() == pytest.approx([(2 * m + 3) / 6, (2 * m + 0) / 4])
    clone = trace_gym.make_predictor("beta")
    clone.load_state_dict(beta.state_dict())
    assert clone.predict([a, b]).tolist() == beta.predict([a, b]).tolist()


def test_beta_predictive_distribution_by_hand():
    beta = trace_gym.make_predictor("beta", prior_strength=2.0)
    a, inner = History("t/a", "prompt a"), History("t/a", "prompt a", steps=("x",))
    beta.update([a], np.array([1.0]), np.array([3.0]))  # 3 successes; population mean 1
    mean, conc = beta.predict_beta([a, inner])
    # prior Beta(2 * 1, 0) + 3 successes: a = 5, b = 0
    assert mean.tolist() == pytest.approx([1.0, 1.0]) and conc[0] == pytest.approx(5.0) and np.isinf(conc[1])
    assert beta.predict([a]).tolist() == mean[:1].tolist()


def test_oracle_predictor_reads_exact_values():
    oracle = trace_gym.make_predictor("oracle")
    assert oracle.predict([History("t", "p", oracle=0.3)]).tolist() == [0.3]
    with pytest.raises(ValueError, match="only the ContrastLab simulator"):
        oracle.predict([History("t", "p")])


def test_histories_carry_true_values_only_for_oracle_components():
    from trace_gym.predictors.base import histories_for

    world = ContrastLabWorld(16, n_test=0, seed=0)
    f = Forest()
    add_candidates(f, world.candidates(np.arange(16)))
    ContrastLabSim(world, seed=0).rollout(f, np.repeat(f.root_nodes.astype(np.int64), 2))
    nodes = np.arange(len(f))
    assert np.isfinite(f.oracle).all()  # the env knows every value ...
    assert all(np.isnan(h.oracle) for h in f.histories(nodes))  # ... and a history does not show it
    assert all(np.isnan(h.oracle) for h in histories_for(f, nodes, trace_gym.make_predictor("hashed")))
    oracle = trace_gym.make_predictor("oracle")
    shown = histories_for(f, nodes, oracle)
    assert [h.oracle for h in shown] == f.oracle.tolist()
    assert oracle.predict(shown).tolist() == f.oracle.tolist()
    with pytest.raises(ValueError, match="oracle=True"):
        oracle.predict(f.histories(nodes[:3]))
    # an oracle predictor still works as a run's predictor: the step asks for the values
    from trace_gym.sim.bench import BenchConfig, run_bench

    res = run_bench(BenchConfig(allocators=["trace"], predictor="oracle", steps=2, prompts=16, trajectories=32, tasks=32,
                                eval_prompts=8))["allocators"]
    assert res["trace[pred=oracle]"]["calibration"]["prefixes"]["brier_excess"] == pytest.approx(0.0)


def test_blanking_true_values_changes_nothing(monkeypatch):
    """No non-oracle predictor or allocator reads a true value: the same runs with histories
    that carry them give the same figures, to the last digit."""
    from trace_gym.sim.bench import BenchConfig, run_bench

    cfg = BenchConfig(allocators=["trace", "trace-paper", "pcl", "knapsack", "vip", "greso",
                                  "trace:stage1=posterior:predictor=beta"], steps=5, prompts=64, trajectories=128,
                      tasks=128, seed=1, eval_prompts=16)
    blanked = run_bench(cfg)["allocators"]
    original = Forest.history
    monkeypatch.setattr(Forest, "history", lambda self, node, *, oracle=False: original(self, node, oracle=True))
    f = Forest()
    f.add_root("t", "p", oracle=0.25)
    assert f.histories([0])[0].oracle == 0.25  # the patch is in force: every history shows its value
    shown = run_bench(cfg)["allocators"]
    assert list(shown) == list(blanked)
    for name in blanked:
        a, b = dict(blanked[name]), dict(shown[name])
        for k in ("ms_per_step", "predictor_update_ms"):
            a.pop(k), b.pop(k)
        assert a == b, name


# ----------------------------------------------------------------------------- hashed learns


def _forests(world, pools, seed):
    sim = ContrastLabSim(world, seed=seed)
    alloc = trace_gym.make_allocator("uniform", seed=seed)
    out = []
    for pool in pools:
        f = Forest()
        add_candidates(f, world.candidates(pool))
        allocate_step(f, alloc, Budget(512), None, sim.rollout)
        out.append(f)
    return out


def _nodes(f):
    return np.flatnonzero(((f.flags & TERMINAL) == 0) & (f.n_leaves > 0))


def test_hashed_beats_a_constant_on_held_out_histories():
    world = ContrastLabWorld(1024, n_test=256, seed=0)
    rng = np.random.default_rng(0)
    train = _forests(world, [rng.choice(1024, 256, replace=False) for _ in range(12)], seed=0)
    test = _forests(world, [world.split_indices("test")], seed=1)[0]  # prompts never seen in training
    hashed = trace_gym.make_predictor("hashed")
    targets = []
    for f in train:
        nodes = _nodes(f)
        hashed.update(f.histories(nodes), f.value[nodes], f.n_leaves[nodes].astype(float))
        targets.append(np.repeat(f.value[nodes], f.n_leaves[nodes]))
    constant = float(np.concatenate(targets).mean())
    nodes = _nodes(test)
    truth = test.oracle[nodes]
    p = hashed.predict(test.histories(nodes))
    assert brier(p, truth) < brier(np.full_like(p, constant), truth) - 0.02
    assert auc(p, truth) > 0.8
    roots = test.parent[nodes] < 0
    assert auc(p[roots], truth[roots]) > 0.7  # difficulty read from the prompt alone
    # the last observation moves the prediction the right way: on-track prefixes above off-track ones
    inner = nodes[~roots]
    on = np.isclose(test.oracle[inner], world.value(np.array([world.index_of(test.task_ids[t]) for t in test.tree[inner]]),
                                                    test.depth[inner], 1))
    pi = hashed.predict(test.histories(inner))
    assert pi[on].mean() > pi[~on].mean() + 0.1


def test_hashed_state_round_trip_and_bad_targets():
    h = trace_gym.make_predictor("hashed", bits=12, counts=True)
    hist = [History("t/1", "a hard job", steps=("tool error: step 1",), max_turns=3), History("t/2", "an easy job", max_turns=2)]
    h.update(hist, np.array([0.0, 1.0]))
    clone = trace_gym.make_predictor("hashed", bits=12, counts=True)
    clone.load_state_dict(h.state_dict())
    assert clone.predict(hist).tolist() == h.predict(hist).tolist()
    assert h.predict(hist)[0] < 0.5 < h.predict(hist)[1]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        h.update(hist, np.array([2.0, 0.0]))
    with pytest.raises(ValueError, match="bits"):
        trace_gym.make_predictor("hashed", bits=30)


def test_hashed_shapes_generalise_over_numbers_and_operators():
    """shapes=True: an operator symbol is a feature and a number counts by its digits, so a
    rule like "division fails, addition of small numbers succeeds" carries over to prompts
    with numbers never seen; the plain words (the default) see neither and stay at chance.
    The default's features are unchanged, and a checkpoint holds which features it has."""
    rng = np.random.default_rng(0)

    def prompts(n, held_out):  # held-out prompts use numbers no training prompt has
        out, ys = [], []
        for _ in range(n):
            if rng.random() < 0.5:
                a, b = (rng.integers(1000, 2000), rng.integers(31, 50)) if held_out else (rng.integers(100, 1000), rng.integers(11, 31))
                out.append(f"What is {a} \u00f7 {b}?"), ys.append(0.0)
            else:
                a, b = rng.integers(50, 100, size=2) if held_out else rng.integers(1, 50, size=2)
                out.append(f"What is {a} + {b}?"), ys.append(1.0)
        return [History(f"t/{i}/{p}", p, max_turns=4) for i, p in enumerate(out)], np.array(ys)

    train, y = prompts(400, held_out=False)
    test, y_test = prompts(200, held_out=True)
    plain, shaped = trace_gym.make_predictor("hashed", seed=0), trace_gym.make_predictor("hashed", seed=0, shapes=True)
    for pred in (plain, shaped):
        pred.update(train, y)
    assert auc(shaped.predict(test), y_test) > 0.95
    assert auc(plain.predict(test), y_test) < 0.7
    assert shaped._prompt_ids("What is 1188 \u00f7 18?").size == plain._prompt_ids("What is 1188 \u00f7 18?").size + 6
    # the default reads what it always read: words of [a-z0-9_]
    assert plain._words("Compute (3 + 4)!") == (["compute", "3", "4"], [])
    assert shaped._words("Compute (3 + 4)!") == (["compute", "(", "#1", "+", "#1", ")", "!"], ["3", "4"])
    with pytest.raises(ValueError, match="shapes"):
        trace_gym.make_predictor("hashed", seed=0).load_state_dict(shaped.state_dict())


# ----------------------------------------------------------------------------- hashed: empirical-Bayes root counts


def _root(task, prompt="a job"):
    return History(task, prompt, max_turns=3)


def _child(task, prompt="a job", step="progress"):
    return History(task, prompt, steps=(step,), max_turns=3)


def test_hashed_root_counts_by_hand():
    h = trace_gym.make_predictor("hashed", bits=12, prior_strength=3.0, counts=True)
    a, b = _root("t/a"), _root("t/b")
    # a's tree: V_hat 0.75 over 8 leaves, from 4 bare rollouts (4 depth-1 children): evidence 4, not 8
    hist = [a, *[_child("t/a", step=f"s{k}") for k in range(4)]]
    m_before = h.predict_shared([a])[0]
    h.update(hist, np.array([0.75, 1.0, 1.0, 0.5, 0.5]), np.array([8.0, 2, 2, 2, 2]))
    m = h.predict_shared([a, b])
    mean, conc = h.predict_beta([a, b, _child("t/a")])
    assert mean[0] == pytest.approx((3.0 * m[0] + 3.0) / (3.0 + 4.0))
    assert conc[:2].tolist() == [7.0, 3.0] and np.isinf(conc[2])
    assert mean[1] == pytest.approx(m[1])  # an unseen prompt: the shared model's prediction
    assert mean[2] == pytest.approx(h.predict_shared([_child("t/a")])[0])  # inner nodes: the shared model alone
    assert h.predict([a, b]).tolist() == pytest.approx(mean[:2].tolist())
    assert m_before == pytest.approx(0.5)
    # a root without children in the batch counts with its weight
    h.update([b], np.array([0.0]), np.array([2.0]))
    mean, conc = h.predict_beta([b])
    assert conc[0] == 5.0 and mean[0] == pytest.approx(3.0 * h.predict_shared([b])[0] / 5.0)
    # off: the plain shared model, point estimates everywhere
    plain = trace_gym.make_predictor("hashed", bits=12, counts=False)
    plain.update(hist, np.array([0.75, 1.0, 1.0, 0.5, 0.5]), np.array([8.0, 2, 2, 2, 2]))
    mean, conc = plain.predict_beta([a])
    assert np.isinf(conc).all() and mean[0] == pytest.approx(plain.predict_shared([a])[0])


def test_hashed_count_decay_forgets_old_outcomes():
    h = trace_gym.make_predictor("hashed", bits=12, prior_strength=1.0, count_decay=0.5, counts=True)
    a, other = _root("t/a"), _root("t/z", "another job")
    h.update([a], np.array([1.0]), np.array([4.0]))
    assert h.predict_beta([a])[1][0] == pytest.approx(1.0 + 4.0)
    h.update([other], np.array([0.0]), np.array([1.0]))  # a is not in this update: its counts halve
    h.update([other], np.array([0.0]), np.array([1.0]))
    assert h.predict_beta([a])[1][0] == pytest.approx(1.0 + 1.0)
    h.update([a], np.array([0.0]), np.array([2.0]))  # decayed old counts plus the new ones
    mean, conc = h.predict_beta([a])
    assert conc[0] == pytest.approx(1.0 + 0.5 + 2.0)
    assert mean[0] == pytest.approx((h.predict_shared([a])[0] + 0.5) / 3.5)
    with pytest.raises(ValueError, match="count_decay"):
        trace_gym.make_predictor("hashed", count_decay=0.0)
    with pytest.raises(ValueError, match="prior_strength"):
        trace_gym.make_predictor("hashed", prior_strength=-1.0)


@pytest.mark.parametrize("concentration, low, high", [(0.6, 0.0, 2.5), (60.0, 20.0, 1e9)])
def test_hashed_learns_the_prior_strength_from_the_counts(concentration, low, high):
    # identical prompt texts: the shared model can learn the population mean only, so the counts'
    # likelihood must find how much prompts differ around it (Beta(c/2, c/2) success rates)
    rng = np.random.default_rng(0)
    n_prompts = 400
    p = rng.beta(concentration / 2, concentration / 2, size=n_prompts)
    h = trace_gym.make_predictor("hashed", bits=10, counts=True)
    assert h.strength() == 2.0  # nothing seen yet: a uniform Beta at 1/2
    for _ in range(6):
        idx = rng.choice(n_prompts, size=100, replace=False)
        k = rng.binomial(4, p[idx])
        h.update([_root(f"t/{i}") for i in idx], k / 4.0, np.full(idx.size, 4.0))
    assert low < h.strength() < high
    # and the posterior means are better calibrated than the shared model's on the prompts seen
    seen = [i for i in range(n_prompts) if f"t/{i}" in h.root_counts]
    hist = [_root(f"t/{i}") for i in seen]
    gain = brier(h.predict_shared(hist), p[seen]) - brier(h.predict(hist), p[seen])
    assert gain > (0.05 if concentration < 1 else -0.002)  # a lot where prompts differ, no harm where they do not


def test_hashed_counts_survive_a_checkpoint():
    h = trace_gym.make_predictor("hashed", bits=12, counts=True)
    hist = [_root("t/a"), _child("t/a"), _child("t/a", step="tool error")]
    h.update(hist, np.array([0.5, 1.0, 0.0]), np.array([2.0, 1.0, 1.0]))
    h.update([_root("t/b")], np.array([1.0]), np.array([3.0]))
    clone = trace_gym.make_predictor("hashed", bits=12, counts=True)
    clone.load_state_dict(h.state_dict())
    probe = [_root("t/a"), _root("t/b"), _root("t/c"), _child("t/a")]
    for x, y in zip(clone.predict_beta(probe), h.predict_beta(probe)):
        assert x.tolist() == y.tolist()
    assert clone.strength() == h.strength()
    # a checkpoint from before the counts existed loads with none
    old = {k: v for k, v in h.state_dict().items() if k not in ("root_counts", "strength_loglik", "n_root_updates")}
    legacy = trace_gym.make_predictor("hashed", bits=12, counts=True)
    legacy.load_state_dict(old)
    assert legacy.root_counts == {} and legacy.predict(probe[:1]).tolist() == legacy.predict_shared(probe[:1]).tolist()
