"""One run spec, one step: every entry point runs the same Step with the same defaults."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from trace_gym.run import BudgetSpec, ComponentSpec, RunSpec, defaults, resolve, resolve_run
from trace_gym.step import Step

WORLD = {"n_tasks": 256, "n_test": 64, "difficulty": "0.5*beta:0.3,3+0.5*beta:3,0.3"}
BUDGET = {"trajectories": 128, "prompts": 64, "group_size": 4}
STEPS = 4


def _spec(allocator: str, seed: int = 3) -> RunSpec:
    return RunSpec(envs=[{"id": "ContrastLab-v0", "kwargs": WORLD}], policy="sim", allocator=allocator, budget=BUDGET, seed=seed)


def _bench_steps(allocator: str) -> list[dict]:
    from trace_gym.sim.bench import BenchConfig, run_bench

    cfg = BenchConfig(allocators=[allocator], steps=STEPS, prompts=64, trajectories=128, tasks=256, seed=3, group_size=4,
                      difficulty=WORLD["difficulty"])
    assert cfg.world_kwargs() == WORLD
    return run_bench(cfg)["allocators"][allocator]["steps"]


def _leaderboard_steps(allocator: str) -> list[dict]:
    from trace_gym.leaderboard.runner import run_allocation
    from trace_gym.leaderboard.spec import parse_suite

    suite = parse_suite({"suite": "t", "tracks": [{
        "name": "a", "kind": "allocation", "envs": [{"id": "trace_gym/ContrastLab-v0", "kwargs": WORLD}],
        "policy": {"name": "sim"}, "allocators": [allocator], "budget": BUDGET, "steps": STEPS}]})
    track = suite.tracks[0]
    result = run_allocation(track, track.envs[0], track.allocators[0], 3, {})
    return [{"effective_ratio": s.metrics["effective_ratio"], "effective_sample_ratio": s.metrics["effective_sample_ratio"],
             "trajectories": s.trajectories, "tokens": s.tokens} for s in result.steps]


def _trainer(allocator: str, tmp_path, **extra):
    from trace_gym.trainers.config import RLConfig
    from trace_gym.trainers.rl import RLTrainer

    cfg = RLConfig.model_validate({
        "seed": 3, "steps": STEPS, "output_dir": str(tmp_path / allocator.replace(":", "_")), "deterministic": False,
        "envs": [{"id": "trace_gym/ContrastLab-v0", "kwargs": WORLD}], "model": {"name": "sim"}, "sft": {"enabled": False},
        "allocator": allocator, "budget": BUDGET, "update_policy": False, "eval": {"every": 0},
        "checkpoint": {"every": 0}, "log": {"progress": False, "tensorboard": False}, **extra})
    return RLTrainer(cfg, log=lambda msg: None)


def _trainer_steps(allocator: str, tmp_path) -> list[dict]:
    trainer = _trainer(allocator, tmp_path)
    out = []
    for _ in range(STEPS):
        r = trainer.step()
        out.append({"effective_ratio": r["effective_ratio"], "effective_sample_ratio": r["effective_sample_ratio"],
                    "trajectories": r["spent/trajectories"], "tokens": r["spent/generated_tokens"]})
    return out


@pytest.mark.parametrize("allocator", ["grpo", "trace", "trace:stage1=uniform"])
def test_one_spec_gives_the_same_steps_in_bench_leaderboard_and_trainer(allocator, tmp_path):
    bench = _bench_steps(allocator)
    board = _leaderboard_steps(allocator)
    train = _trainer_steps(allocator, tmp_path)
    direct = [r.metrics for r in (lambda s: [s.run(i) for i in range(STEPS)])(Step.from_spec(_spec(allocator)))]
    assert len(bench) == len(board) == len(train) == STEPS
    for i in range(STEPS):
        for key in ("effective_ratio", "effective_sample_ratio"):
            assert bench[i][key] == pytest.approx(board[i][key], abs=1e-12) == pytest.approx(train[i][key], abs=1e-12)
            assert bench[i][key] == pytest.approx(direct[i][key], abs=1e-12)
        assert bench[i]["trajectories"] == board[i]["trajectories"] == train[i]["trajectories"] == BUDGET["trajectories"]
        assert bench[i]["tokens"] == board[i]["tokens"] == train[i]["tokens"]
    # the steps differ from one another: the comparison is not between constants
    assert len({round(s["effective_ratio"], 9) for s in bench}) > 1


def _rollout_args(allocator: str) -> argparse.Namespace:
    from trace_gym.cli.rollout import configure_rollout

    parser = argparse.ArgumentParser()
    configure_rollout(parser)
    return parser.parse_args(["ContrastLab-v0", "--policy", "sim", "--allocator", allocator])


@pytest.mark.parametrize("allocator", ["grpo", "trace", "pcl"])
def test_every_entry_point_gives_an_allocator_its_own_predictor_and_advantage(allocator, tmp_path):
    from trace_gym.cli.rollout import rollout_spec
    from trace_gym.leaderboard.runner import resolve_advantage, resolve_predictor
    from trace_gym.leaderboard.spec import parse_suite
    from trace_gym.sim.bench import BenchConfig, run_bench

    own_pred, own_adv = defaults(allocator)
    from trace_gym.allocation.allocator import ALLOCATORS

    cls = ALLOCATORS.get(allocator)
    assert (own_pred.name if own_pred else None) == cls.default_predictor
    assert own_adv.name == cls.advantage.split(":")[0]
    # bench
    row = run_bench(BenchConfig(allocators=[allocator], steps=1, prompts=16, trajectories=32, tasks=64))["allocators"][allocator]
    assert row["predictor"] == (str(own_pred) if own_pred else None)
    assert row["effective_sample_ratio"]["advantage"] == str(own_adv)
    # leaderboard
    track = parse_suite({"suite": "t", "tracks": [{
        "name": "a", "kind": "allocation", "envs": ["trace_gym/ContrastLab-v0"], "policy": {"name": "sim"},
        "allocators": [allocator], "budget": {"trajectories": 32, "prompts": 16}, "steps": 1}]}).tracks[0]
    assert resolve_predictor(track, track.allocators[0]) == own_pred
    assert resolve_advantage(track, track.allocators[0]) == own_adv
    # trainer
    trainer = _trainer(allocator, tmp_path)
    assert (trainer.predictor is None) == (own_pred is None)
    if own_pred is not None:
        assert trainer.predictor.name == own_pred.name
    assert trainer.advantage == own_adv
    # trace-gym rollout
    resolved = resolve_run(rollout_spec(_rollout_args(allocator)))
    assert resolved.advantage == own_adv
    assert (resolved.predictor_spec == own_pred)


def test_both_allocator_forms_are_one_spec_and_bad_options_name_the_allowed_ones():
    a = ComponentSpec.model_validate("trace:stage1=uniform:k_max=4")
    b = ComponentSpec.model_validate({"name": "trace", "kwargs": {"stage1": "uniform", "k_max": 4}})
    assert a == b and str(a) == "trace:stage1=uniform:k_max=4"
    with pytest.raises(ValueError, match=r"unknown option 'stag1'; did you mean 'stage1'\? \(options: .*stage1"):
        _spec("trace:stag1=uniform")
    with pytest.raises(ValueError, match="unknown option"):
        resolve("grpo:nope=1", BudgetSpec(**BUDGET))
    with pytest.raises(ValueError):
        BudgetSpec(trajectories=0, prompts=4)


def test_suite_accepts_the_string_form_of_an_allocator():
    from trace_gym.leaderboard.spec import parse_suite

    track = parse_suite({"suite": "t", "tracks": [{
        "name": "a", "kind": "allocation", "envs": ["ContrastLab-v0"], "policy": {"name": "sim"},
        "allocators": ["trace:stage1=uniform", {"name": "trace", "kwargs": {"stage2": "uniform"}}],
        "budget": {"trajectories": 32, "prompts": 16}, "steps": 1}]}).tracks[0]
    assert [a.spec for a in track.allocators] == [ComponentSpec(name="trace", kwargs={"stage1": "uniform"}),
                                                  ComponentSpec(name="trace", kwargs={"stage2": "uniform"})]
    assert track.envs[0].id == "trace_gym/ContrastLab-v0"


def test_candidates_are_a_function_of_seed_and_step_and_cover_the_split_each_epoch():
    from trace_gym.task import candidate_indices

    first = [candidate_indices(5, s, 10, 4) for s in range(5)]  # 20 draws = two epochs of 10
    assert first == [candidate_indices(5, s, 10, 4) for s in range(5)]
    flat = [i for step in first for i in step]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert candidate_indices(6, 0, 10, 4) != first[0]
    assert np.all(np.asarray(candidate_indices(0, 0, 3, 7)) < 3)
