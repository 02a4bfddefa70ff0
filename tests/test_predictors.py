"""Predictors of V(H) (beta, hashed, oracle) and the calibration metrics."""

from __future__ import annotations

import numpy as np
import pytest

import trace_gym
from trace_gym.allocator import Budget, add_candidates, allocate_step
from trace_gym.calibration import auc, brier, calibration, ece
from trace_gym.envs.contrastlab import ContrastLabSim, ContrastLabWorld
from trace_gym.forest import TERMINAL, Forest, History


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


def test_oracle_predictor_reads_exact_values():
    oracle = trace_gym.make_predictor("oracle")
    assert oracle.predict([History("t", "p", oracle=0.3)]).tolist() == [0.3]
    with pytest.raises(ValueError, match="only the ContrastLab simulator"):
        oracle.predict([History("t", "p")])


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
    h = trace_gym.make_predictor("hashed", bits=12)
    hist = [History("t/1", "a hard job", steps=("tool error: step 1",), max_turns=3), History("t/2", "an easy job", max_turns=2)]
    h.update(hist, np.array([0.0, 1.0]))
    clone = trace_gym.make_predictor("hashed", bits=12)
    clone.load_state_dict(h.state_dict())
    assert clone.predict(hist).tolist() == h.predict(hist).tolist()
    assert h.predict(hist)[0] < 0.5 < h.predict(hist)[1]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        h.update(hist, np.array([2.0, 0.0]))
    with pytest.raises(ValueError, match="bits"):
        trace_gym.make_predictor("hashed", bits=30)
