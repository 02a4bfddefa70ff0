"""The simulator's rollout source and training runner for leaderboard tracks.

* ``sim`` source: ContrastLab's vectorised fast path (:class:`trace_gym.sim.source.SimSource`)
  with the simulated policy, at scale (thousands of trajectories per step in milliseconds).
  The track's env kwargs are :class:`~trace_gym.sim.world.ContrastLabWorld` arguments
  (``difficulty``, ``n_tasks`` ...); the world's seed is the run's seed.
* ``sim`` shared evaluation: after an allocation run, its predictor is scored on ContrastLab's
  one evaluation set (:func:`trace_gym.sim.evaluation.evaluation_set`, built once per env and
  seed, so every row of a seed is scored on the same histories), roots and prefixes apart,
  exactly as ``trace-gym bench`` scores it (:func:`trace_gym.sim.bench.predictor_calibration`).
* ``sim`` training runner: ContrastLab's learning mode (:class:`~trace_gym.sim.learning.SimLearning`)
  on top of the same :class:`~trace_gym.step.Step`.

Model backends' sources and training runners come from the trainers plug-in (entry-point
group ``trace_gym.leaderboard``), which can SFT-warm a model first.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from trace_gym.leaderboard.records import EvalPoint
from trace_gym.leaderboard.runner import (
    RunResult, allocation_step, calibration_metrics, eval_steps, register_preflight,
    register_shared_evaluation, register_source, register_training_runner, step_record, training_final,
)
from trace_gym.leaderboard.spec import AllocatorEntry, EnvEntry, SuiteError, TrackSpec

@register_source("sim")
def contrastlab_source(track: TrackSpec, env: EnvEntry, seed: int, cache: dict):
    """The ``sim`` source: ContrastLab's world and fast path for one seed."""
    from trace_gym.sim.env import ContrastLabEnv
    from trace_gym.sim.source import SimSource

    if env.id != ContrastLabEnv.env_id:
        raise ValueError(f"the sim policy simulates ContrastLab only; track {track.name!r} asks it to play {env.id!r}")
    return SimSource(dict(env.kwargs), seed=seed)


@register_shared_evaluation("sim")
def contrastlab_calibration(track: TrackSpec, env: EnvEntry, seed: int, step: Any, cache: dict) -> dict[str, float | None]:
    """The row's predictor after its run on ContrastLab's evaluation set for this env and seed
    (the bench's defaults: 512 train prompts, 4 bare rollouts each, from the set's own stream),
    built from a fresh world once per track, env and seed and shared by every row of it."""
    from trace_gym.sim.bench import predictor_calibration
    from trace_gym.sim.evaluation import evaluation_set

    key = ("evaluation_set", env.id, json.dumps(env.kwargs, sort_keys=True, default=str), seed)
    if key not in cache:
        cache[key] = evaluation_set(contrastlab_source(track, env, seed, cache).world)
    es = cache[key]
    return calibration_metrics(predictor_calibration(step, es), es.references(), roots=int(es.roots.size),
                               prefixes=int(es.prefixes.size))


def resolve_config_path(path: str) -> Path:
    """A config path from a suite: as given (relative to the working directory), else
    relative to the trace-gym checkout (so ``configs/quick.yaml`` works from anywhere)."""
    p = Path(path)
    if p.is_file():
        return p
    repo = Path(__file__).resolve().parents[2] / path
    if repo.is_file():
        return repo
    raise FileNotFoundError(f"config file {path!r} not found (looked in {Path.cwd()} and {repo.parent})")


def sim_learning_rates(track: TrackSpec) -> tuple[float, float]:
    """``(model.sim_lr, model.sim_shared_lr)`` of a track's trainer config file and overrides
    (defaults 1.0 and 0.1): ContrastLab's learning mode reads these two keys only."""
    data: dict[str, Any] = {}
    spec = track.trainer
    if spec is not None and spec.config:
        try:
            data = yaml.safe_load(resolve_config_path(spec.config).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise SuiteError(f"track {track.name!r}, trainer: {exc}") from None
    model = dict(data.get("model") or {})
    for key, value in (spec.overrides if spec else {}).items():
        if key.startswith("model."):
            model[key.split(".", 1)[1]] = value
    try:
        return float(model.get("sim_lr", 1.0)), float(model.get("sim_shared_lr", 0.1))
    except (TypeError, ValueError) as exc:
        raise SuiteError(f"track {track.name!r}, trainer: model.sim_lr / sim_shared_lr: {exc}") from None


@register_training_runner("sim")
def contrastlab_training(track: TrackSpec, env: EnvEntry, alloc: AllocatorEntry, seed: int, cache: dict,
                         on_step=None) -> RunResult:
    """A ContrastLab training run in learning mode: each step is the allocation track's
    :class:`~trace_gym.step.Step` followed by one REINFORCE step of the simulated policy on
    the forest's advantages (the row's estimator), with the trainer config's ``model.sim_lr``
    and ``model.sim_shared_lr``. Held-out accuracy is exact: the mean success probability of
    the first ``eval.tasks`` tasks of ``eval.split`` under the current policy (pass@k
    likewise, ``1 - (1 - v)^k``), so curves carry no evaluation noise."""
    from trace_gym.sim.learning import SimLearning

    t0 = time.perf_counter()
    assert track.eval is not None
    lr, shared_lr = sim_learning_rates(track)
    step = allocation_step(track, env, alloc, seed, cache)
    world = step.source.world
    step.update = SimLearning(world, lr=lr, shared_lr=shared_lr)
    held_out = world.split_indices(track.eval.split)[: track.eval.tasks]
    k = track.eval.k
    evals: list[EvalPoint] = []
    spent = [0, 0]

    def evaluate(i: int) -> None:
        v = world.root_value(held_out)
        evals.append(EvalPoint(step=i, trajectories=spent[0], tokens=spent[1], accuracy=float(v.mean()),
                               pass_at_k=float(np.mean(1.0 - (1.0 - v) ** k)), k=k, tasks=int(held_out.size)))

    when = set(eval_steps(track))
    evaluate(0)
    steps = []
    for i in range(track.steps):
        record = step_record(step.run(i))
        steps.append(record)
        spent[0] += record.trajectories
        spent[1] += record.tokens
        if i + 1 in when:
            evaluate(i + 1)
        if on_step:
            on_step(i)
    return RunResult(steps=steps, evals=evals, final=training_final(steps, evals), wall_s=time.perf_counter() - t0)


@register_preflight
def _check_sim_track(track: TrackSpec) -> None:
    if track.policy.name == "sim" and track.kind == "training":
        sim_learning_rates(track)
