"""Env workers on Ray (``EngineSource(workers=N)``, ``rollout.workers``): the same forests and
metrics as the in-process path in sync mode, actors spread over a two-node cluster, and a
worker killed in the middle of a step.

One local Ray (``ray.init(num_cpus=2)``) is shared by the module and shut down after it; the
two-node ``ray.cluster_utils.Cluster`` test starts its own. Skipped visibly without ``ray``
(the ``ray`` extra).
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'trace-gym[ray]')")

from ray_support import local_ray  # noqa: E402,F401  (the module's local Ray)

from trace_gym.rollout.engine import RootRecord, TurnRecord  # noqa: E402
from trace_gym.rollout.source import EngineSource  # noqa: E402
from trace_gym.run import RunSpec  # noqa: E402
from trace_gym.sim.env import ContrastLabEnv  # noqa: E402
from trace_gym.step import Step, make_source  # noqa: E402

WORLD = {"n_tasks": 64, "n_test": 16}
SPEC = dict(envs=[{"id": "ContrastLab-v0", "kwargs": WORLD}], policy={"name": "sim", "kwargs": {"fast": False}},
            allocator="trace", budget={"trajectories": 24, "prompts": 8, "group_size": 2}, seed=5)


def _sources(workers: int, latency_s: float = 0.0, **worker_options):
    """(local source, Ray source): the same spec, built twice (no shared state)."""
    spec = RunSpec(**SPEC)
    local = make_source(spec)
    base = make_source(spec)
    if latency_s:
        base.envs = [ContrastLabEnv(world=base.envs[0].world, seed=spec.seed, tool_latency_s=latency_s)]
    remote = EngineSource(base.envs, base.policy, base.params, seed=spec.seed, workers=workers, worker_options=worker_options)
    return spec, local, remote


def _forest_key(forest):
    """Everything a forest holds that the two paths must agree on (snapshots by their turn)."""
    n = len(forest)
    nan_eq = lambda a: np.where(np.isnan(a[:n]), -7.0, a[:n]).tolist()  # noqa: E731
    spans = []
    for p in forest.payload[:n]:
        if isinstance(p, RootRecord):
            spans.append(("root", tuple(p.token_ids), p.snapshot.turn))
        elif isinstance(p, TurnRecord):
            spans.append((tuple(p.token_ids), tuple(p.logprobs), p.observation, p.role, p.branch_id, p.snapshot.turn, sorted(p.info.items())))
        else:
            spans.append(None)
    return (forest.parent[:n].tolist(), forest.tree[:n].tolist(), forest.flags[:n].tolist(), nan_eq(forest.reward),
            nan_eq(forest.oracle), forest.n_tokens[:n].tolist(), list(forest.text[:n]), spans, dict(forest.counters))


def _metrics(result):
    return {k: v for k, v in result.metrics.items() if not k.startswith("time/")}


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def test_env_workers_give_the_local_forests_and_metrics(local_ray):
    spec, local, remote = _sources(workers=2)
    a, b = Step.from_spec(spec, source=local), Step.from_spec(spec, source=remote)
    try:
        for step in range(2):
            ra, rb = a.run(step), b.run(step)
            assert _forest_key(ra.forest) == _forest_key(rb.forest)
            ma, mb = _metrics(ra), _metrics(rb)
            assert ma.keys() == mb.keys() and all(_same(ma[k], mb[k]) for k in ma), {k: (ma[k], mb[k]) for k in ma if not _same(ma[k], mb[k])}
            assert rb.metrics["spent/trajectories"] == 24 and rb.metrics["spent/tool_calls"] > 0
        # the env steps ran on the workers: the driver's env was only reset (for the roots), never stepped
        assert remote.pool is not None and len(remote.pool.actors) == 2
        assert local.envs[0].state.turn > 0 and remote.envs[0].state.turn == 0
    finally:
        remote.close()


def _run_and_kill(step: Step, source: EngineSource, victim: int = 0):
    """Run step 0 in a thread and ``ray.kill`` worker ``victim`` while its first chunk is in a tool call."""
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("result", step.run(0)))
    th.start()
    end = time.monotonic() + 60
    while (source.pool is None or not source.pool.in_flight) and time.monotonic() < end:
        time.sleep(0.005)
    assert source.pool is not None and source.pool.in_flight, "no wave was dispatched to the workers"
    time.sleep(0.05)  # inside the first tool calls of the chunk
    ray.kill(source.pool.actors[victim])
    th.join(120)
    assert not th.is_alive(), "the step did not complete after a worker was killed"
    return box["result"]


def test_a_worker_killed_mid_step_is_rerun_from_its_snapshots(local_ray):
    spec, local, remote = _sources(workers=2, latency_s=0.05, num_cpus=0.5)
    try:
        reference = Step.from_spec(spec, source=local).run(0)
        result = _run_and_kill(Step.from_spec(spec, source=remote), remote)
        assert remote.pool.lost >= 1  # the kill landed on a chunk in flight
        assert result.metrics["spent/failed_trajectories"] == 0 and not remote.failures
        assert _forest_key(result.forest) == _forest_key(reference.forest)  # nothing lost, nothing changed
    finally:
        remote.close()


def test_a_worker_lost_past_its_retries_fails_only_its_trajectories(local_ray):
    spec, _, remote = _sources(workers=2, latency_s=0.05, num_cpus=0.5, max_retries=0)
    try:
        result = _run_and_kill(Step.from_spec(spec, source=remote), remote)
        failed = result.metrics["spent/failed_trajectories"]
        assert remote.pool.lost == 1 and failed >= 1 and len(remote.failures) == failed
        assert all("env worker lost" in f.error for f in remote.failures)
        # the step completed: every trajectory was started and the others reached a leaf with a reward
        assert result.spend.trajectories == result.forest.n_trajectories == 24
        leaves = result.forest.traj_leaf[: result.forest.n_trajectories]
        finished = np.isfinite(result.forest.reward[leaves])
        assert finished.sum() == 24 - failed
    finally:
        remote.close()


def test_a_hung_worker_is_given_up_after_its_time_limit(local_ray):
    from trace_gym.rollout.workers import EnvWorkerPool

    env = ContrastLabEnv(world=make_source(RunSpec(**SPEC)).envs[0].world, seed=0, tool_latency_s=60.0)  # never answers in time
    env.reset(options={"task": env.tasks().get(0)})
    items = [(env.snapshot(), 0, '<tool_call>{"name": "act", "arguments": {"option": "A"}}</tool_call>')] * 2
    pool = EnvWorkerPool([env], 2, num_cpus=0.5, max_retries=0, chunk_timeout_s=1.0)
    try:
        t0 = time.monotonic()
        out = pool.step(0, items)
        assert time.monotonic() - t0 < 30
        assert pool.lost == 2 and all(isinstance(r, str) and "env worker lost" in r for r in out)
    finally:
        pool.close()


def test_workers_spread_over_a_two_node_cluster():
    """Last in the module: it stops the module's local Ray to start a cluster of its own."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        spec, local, remote = _sources(workers=2)
        try:
            rb = Step.from_spec(spec, source=remote).run(0)
            assert len({node for node, _ in remote.pool.placement}) == 2  # one worker on each node
            ra = Step.from_spec(spec, source=local).run(0)
            assert _forest_key(ra.forest) == _forest_key(rb.forest)
        finally:
            remote.close()
    finally:
        ray.shutdown()
        cluster.shutdown()



def test_trainer_steps_its_envs_on_workers_with_the_rollout_workers_key(local_ray, tmp_path):
    from trace_gym.trainers.config import RLConfig
    from trace_gym.trainers.rl import RLTrainer

    def run(workers: int) -> list[dict]:
        cfg = RLConfig.model_validate({
            "seed": 5, "steps": 2, "output_dir": str(tmp_path / f"w{workers}"), "deterministic": False,
            "envs": [{"id": "trace_gym/ContrastLab-v0", "kwargs": WORLD}],
            "model": {"name": "sim", "sim_fast": False}, "sft": {"enabled": False}, "allocator": "trace",
            "budget": SPEC["budget"], "rollout": {"workers": workers}, "eval": {"every": 0},
            "checkpoint": {"every": 0}, "log": {"progress": False, "tensorboard": False}})
        trainer = RLTrainer(cfg, log=lambda msg: None)
        try:
            assert (trainer.source.workers if hasattr(trainer.source, "workers") else 0) == workers
            records = [trainer.step() for _ in range(2)]
            assert (trainer.source.pool is not None) == (workers > 0)  # the env steps ran on the workers
            return records
        finally:
            trainer.source.close()

    local, remote = run(0), run(2)
    for a, b in zip(local, remote):
        for key in ("effective_ratio", "effective_sample_ratio", "spent/trajectories", "spent/generated_tokens", "reward/mean"):
            assert a[key] == b[key]
