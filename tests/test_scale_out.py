"""Scale-out beyond env workers: several generation engines behind a router
(``EngineRouter``, ``rollout.engines``), streaming instead of waves (``EngineStream``,
``allocate_step_streaming``, ``rollout.streaming``) and async training
(``rollout.mode: async``).

Engines are Ray actors on the module's local Ray (``ray.init(num_cpus=2)``, tests/ray_support.py).
Skipped visibly without ``ray`` (the ``ray`` extra).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'trace-gym[ray]')")

from ray_support import local_ray  # noqa: E402,F401  (the module's local Ray)

from trace_gym.rollout.affinity import PrefixAffinity  # noqa: E402
from trace_gym.rollout.router import EngineRouter  # noqa: E402
from trace_gym.rollout.source import EngineSource  # noqa: E402
from trace_gym.run import RunSpec  # noqa: E402
from trace_gym.sim.env import ContrastLabEnv  # noqa: E402
from trace_gym.step import Step, make_source  # noqa: E402

WORLD = {"n_tasks": 64, "n_test": 16}
SPEC = dict(envs=[{"id": "ContrastLab-v0", "kwargs": WORLD}], policy={"name": "sim", "kwargs": {"fast": False}},
            allocator="trace", budget={"trajectories": 48, "prompts": 12, "group_size": 2}, seed=5)


def _router(spec: RunSpec, engines: int = 2, **kwargs) -> tuple[EngineSource, EngineRouter]:
    base = make_source(spec)
    router = EngineRouter.on_ray("sim", {"world": base.envs[0].world, "seed": spec.seed}, engines=engines, num_cpus=0.5, **kwargs)
    return base, router


def _engine_of(forest, node: int):
    return forest.payload[node].info.get("engine")


def _check_affinity(forest) -> int:
    """Every turn after a trajectory's first, and every branch's first turn, came from the
    engine that generated the node it continues; returns how many branches were checked."""
    branches = 0
    for i in range(forest.n_trees, len(forest)):
        p = int(forest.parent[i])
        if p < 0 or forest.parent[p] < 0:
            continue  # a first turn from a root: its engine was chosen by load
        assert _engine_of(forest, i) == _engine_of(forest, p), f"node {i} left the engine of its prefix {p}"
        if forest.traj[i] != forest.traj[p]:
            branches += 1
    return branches


def test_prefix_affinity_finds_the_longest_recorded_prefix():
    a = PrefixAffinity(max_roots=2)
    a.add_root([1, 2, 3])
    assert a.lookup([1, 2, 3, 4]) is None  # a known opening prompt, no engine yet
    assert a.record([1, 2, 3], 0) and a.record([1, 2, 3, 4, 5], 1)
    assert a.lookup([1, 2, 3, 9]) == 0 and a.lookup([1, 2, 3, 4, 5, 6]) == 1
    assert not a.record([7, 8], 1) and a.lookup([7, 8, 9]) is None  # no opening prompt of its own
    a.add_root([4]), a.add_root([5])  # the oldest root is forgotten
    assert a.lookup([1, 2, 3, 4, 5, 6]) is None and len(a) == 2


def test_router_keeps_prefix_affinity_and_balances_load(local_ray):
    spec = RunSpec(**SPEC)
    base, router = _router(spec)
    try:
        assert router.engines == 2 and router.sync_modes() == frozenset()
        result = Step.from_spec(spec, source=EngineSource(base.envs, router, base.params, seed=spec.seed)).run(0)
        assert result.spend.trajectories == 48 and result.metrics["spent/failed_trajectories"] == 0
        assert _check_affinity(result.forest) > 0  # stage 2 branched, and every branch stayed on its prefix's engine
        per = router.stats["per_engine"]
        assert min(per) > 0 and max(per) <= 1.25 * sum(per) / 2 + 1  # both engines worked, within the load cap
        assert router.stats["affine"] > router.stats["fresh"]
    finally:
        router.close()


def test_an_engine_killed_mid_step_loses_nothing(local_ray):
    spec = RunSpec(**{**SPEC, "envs": [{"id": "ContrastLab-v0", "kwargs": {**WORLD, "tool_latency_s": 0.03}}]})
    base, router = _router(spec)
    try:
        source = EngineSource(base.envs, router, base.params, seed=spec.seed)
        box: dict = {}
        th = threading.Thread(target=lambda: box.setdefault("result", Step.from_spec(spec, source=source).run(0)))
        th.start()
        end = time.monotonic() + 60
        while sum(router.stats["per_engine"]) < 20 and time.monotonic() < end:  # a few waves in
            time.sleep(0.005)
        ray.kill(router._engines[0].handle)
        th.join(120)
        assert not th.is_alive(), "the step did not complete after an engine was killed"
        result = box["result"]
        assert router.stats["lost"] >= 1  # the kill hit a call: its prompts went to the other engine
        assert result.metrics["spent/failed_trajectories"] == 0
        f = result.forest
        leaves = f.traj_leaf[: f.n_trajectories]
        assert f.n_trajectories == 48 and np.isfinite(f.reward[leaves]).all()  # every trajectory reached its reward
        # the replacement takes prompts again (no weights were ever synced)
        again = Step.from_spec(spec, source=EngineSource(base.envs, router, base.params, seed=spec.seed)).run(1)
        assert again.metrics["spent/failed_trajectories"] == 0
    finally:
        router.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_streaming_starts_a_prompts_stage_2_before_the_others_stage_1_ends(local_ray, workers):
    spec = RunSpec(**{**SPEC, "envs": [{"id": "ContrastLab-v0", "kwargs": {**WORLD, "tool_latency_s": 0.01, "tool_latency_jitter": 0.9}}]})
    base = make_source(spec)
    source = EngineSource(base.envs, base.policy, base.params, seed=spec.seed, workers=workers,
                          worker_options={"num_cpus": 0.5})
    try:
        result = Step.from_spec(spec, source=source, streaming=True).run(0)
        f = result.forest
        assert result.spend.trajectories == f.n_trajectories == 48
        assert result.spend.roots + result.spend.branches == 48 and result.spend.branches > 0
        leaves = f.traj_leaf[: f.n_trajectories]
        assert np.isfinite(f.reward[leaves]).all() and result.metrics["spent/failed_trajectories"] == 0
        # nodes are appended as turns land: a stage-2 node landed before stage 1's last one
        stage1 = f.parent[f.traj_origin] < 0
        node_traj = f.traj[: len(f)]
        stage1_nodes = np.flatnonzero((node_traj >= 0) & stage1[np.maximum(node_traj, 0)])
        branch_nodes = np.flatnonzero((node_traj >= 0) & ~stage1[np.maximum(node_traj, 0)])
        assert branch_nodes.min() < stage1_nodes.max()
        # each turn's tokens continue exactly the prefix it was generated from
        from trace_gym.rollout.engine import prefix_ids

        for i in branch_nodes[:10]:
            assert len(prefix_ids(f, int(f.parent[i]))) == f.payload[i].prefix_len
    finally:
        source.close()


def test_streaming_needs_a_source_that_can_stream():
    spec = RunSpec(**{**SPEC, "policy": "sim"})
    with pytest.raises(ValueError, match="fast=false"):
        Step.from_spec(spec, streaming=True)


# ----------------------------------------------------------------------------- the trainer


def _same(a, b) -> bool:
    """Deep equality of state dicts (arrays and tensors by value)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape"):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b


def _tiny_config(tmp_path, name: str, **rollout):
    from test_trainer import CACHE, MICRO

    from trace_gym.trainers.config import RLConfig

    os.environ.setdefault("TRACE_GYM_CACHE", str(CACHE))
    cfg = {**MICRO, "steps": 3, "output_dir": str(tmp_path / name), "deterministic": False, "eval": {"every": 0},
           "checkpoint": {"every": 0}, "rollout": {**MICRO["rollout"], **rollout}}
    return RLConfig.model_validate(cfg)


@pytest.mark.slow
def test_async_training_overlaps_generation_with_the_update_within_the_staleness_bound(local_ray, tmp_path):
    from trace_gym.trainers.rl import RLTrainer

    trainer = RLTrainer(_tiny_config(tmp_path, "async", mode="async"), log=lambda m: None)
    try:
        assert trainer.cfg.loss.is_correction  # rollouts from older weights are importance-weighted
        assert not trainer._shares_weights  # the hf backend generates with its own copy
        records = [trainer.step() for _ in range(3)]
    finally:
        trainer.close()
    assert [r["async/staleness"] for r in records] == [0, 1, 1]
    assert [r["async/off_policy_share"] for r in records] == [0.0, 1.0, 1.0]
    for r in records:
        assert np.isfinite(r["update/loss"]) and r["update/trained_tokens"] > 0
        assert 0 < r["update/is_weight"] <= trainer.cfg.loss.is_cap
    # step 2 trained on rollouts of the weights before update 1: the behaviour log-probs differ
    assert records[1]["update/behaviour_logp_gap"] > 1e-4



@pytest.mark.slow
def test_an_async_run_resumes_from_its_checkpoint(local_ray, tmp_path):
    from trace_gym.trainers.config import RLConfig
    from trace_gym.trainers.rl import RLTrainer

    cfg = _tiny_config(tmp_path, "resume", mode="async").model_dump()
    cfg["checkpoint"] = {"every": 1, "keep_last": 2}
    cfg = RLConfig.model_validate(cfg)
    first = RLTrainer(cfg, log=lambda m: None)
    try:
        before = [first.step() for _ in range(2)]
        saved = first._async_state  # the generator side as it was when step 2's forest was taken
    finally:
        first.close()
    assert before[1]["async/staleness"] == 1
    resumed = RLTrainer(cfg, resume=True, log=lambda m: None)
    try:
        assert resumed.step_index == 2
        # the predictor as it was after step 2's generation, not after step 3's (which ran ahead)
        assert _same(resumed.predictor.state_dict(), saved["predictor"])
        assert not _same(resumed.predictor.state_dict(), first.predictor.state_dict())
        record = resumed.step()
    finally:
        resumed.close()
    assert record["step"] == 3 and record["async/staleness"] == 0 and np.isfinite(record["update/loss"])


@pytest.mark.slow
def test_training_through_two_engine_actors_syncs_their_weights(local_ray, tmp_path):
    from trace_gym.trainers.rl import RLTrainer

    trainer = RLTrainer(_tiny_config(tmp_path, "engines", engines=2, streaming=True), log=lambda m: None)
    try:
        assert isinstance(trainer.policy, EngineRouter) and trainer.policy.engines == 2
        records = [trainer.step() for _ in range(3)]
    finally:
        trainer.close()
    for r in records:
        assert 8 <= r["spent/trajectories"] <= 16 and np.isfinite(r["update/loss"])  # trace may leave stage 2 unspent
        # on-policy: the engines generated with the trainer's current weights (synced after each update)
        assert r["update/behaviour_logp_gap"] < 1e-3
    assert min(trainer.policy.stats["per_engine"]) > 0


def test_rollout_command_runs_on_workers_and_engines_streaming(local_ray, tmp_path, capsys):
    import json

    from trace_gym.cli.main import main

    out = tmp_path / "trees.jsonl"
    status = main(["rollout", "ContrastLab-v0", "--policy", "sim", "--env-arg", "n_tasks=64", "--allocator", "trace",
                   "--trajectories", "24", "--prompts", "8", "--workers", "2", "--engines", "2", "--actor-cpus", "0.25", "--streaming", "--out", str(out)])
    assert status == 0
    nodes = [json.loads(line) for line in out.read_text().splitlines()]
    engines = {n["info"]["engine"] for n in nodes if n.get("info") and "engine" in n["info"]}
    assert engines == {0, 1}  # both engine actors generated turns
    assert sum(1 for n in nodes if n["parent"] >= 0 and n["terminal"]) == 24  # every trajectory reached its end
