"""One-step-off async (:class:`trace_gym.rollout.async_step.AsyncStep`): the generation of step
t+1 runs while the update of step t does, staleness stays at 1, and with an update that does
not change the policy the steps equal the sync ones."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from trace_gym.rollout.async_step import AsyncStep
from trace_gym.run import RunSpec
from trace_gym.step import Step, make_source

SPEC = dict(envs=[{"id": "ContrastLab-v0", "kwargs": {"n_tasks": 64, "n_test": 16}}], policy="sim", allocator="trace",
            budget={"trajectories": 32, "prompts": 8, "group_size": 2}, seed=2)


class Watched:
    """A rollout source that tells which step's candidates were last requested."""

    def __init__(self, inner):
        self.inner = inner
        self.started: dict[int, threading.Event] = {}

    def add_candidates(self, forest, step, n):
        self.started.setdefault(step, threading.Event()).set()
        self.inner.add_candidates(forest, step, n)

    def rollout(self, forest, origins):
        self.inner.rollout(forest, origins)


def test_generation_of_the_next_step_overlaps_the_update_and_matches_sync():
    spec = RunSpec(**SPEC)
    seen, overlapped = [], []
    source = Watched(make_source(spec))

    def update(forest, adv):
        t = len(seen)
        seen.append(forest.n_trajectories)
        ev = source.started.setdefault(t + 1, threading.Event())
        overlapped.append(ev.wait(timeout=20))  # sync would deadlock here: step t+1 starts only after this returns
        return {"update/seen": t}

    a = AsyncStep(Step.from_spec(spec, source=source), update)
    try:
        results = [a.run(t) for t in range(3)]
    finally:
        a.close()
    assert overlapped == [True, True, True]
    assert [r.metrics["async/staleness"] for r in results] == [0, 1, 1]
    assert [r.metrics["async/off_policy_share"] for r in results] == [0.0, 1.0, 1.0]
    assert [r.metrics["update/seen"] for r in results] == [0, 1, 2]
    sync = Step.from_spec(spec)
    for t, r in enumerate(results):
        s = sync.run(t)
        assert np.array_equal(s.forest.parent[: len(s.forest)], r.forest.parent[: len(r.forest)])
        assert np.array_equal(s.advantages, r.advantages)
        assert s.metrics["effective_ratio"] == r.metrics["effective_ratio"]


def test_async_step_refuses_a_step_that_updates_itself():
    spec = RunSpec(**SPEC)
    with pytest.raises(ValueError, match="without update"):
        AsyncStep(Step.from_spec(spec, update=lambda f, a: {}), lambda f, a: {})
