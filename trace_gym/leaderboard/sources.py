"""Built-in rollout sources for allocation tracks, and the training-track integration.

* ``sim``: ContrastLab's vectorised fast path (:class:`trace_gym.sim.ContrastLabSim`)
  with the simulated policy, at scale (thousands of trajectories per step in milliseconds).
  The track's env kwargs are :class:`~trace_gym.sim.world.ContrastLabWorld` arguments
  (``difficulty``, ``n_tasks`` ...); the world's seed is the run's seed.
* ``*`` (any model backend): the rollout engine (:mod:`trace_gym.rollout.engine`) with the policy
  built once per track (and SFT-warmed first when the track asks for it).

Candidate prompts are drawn from the train split by a generator seeded with (seed, step)
alone, so every allocator of a seed is offered exactly the same prompts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from trace_gym.leaderboard.records import EvalPoint
from trace_gym.leaderboard.runner import (
    TRAINING_FINAL, AllocationRun, RunResult, eval_steps, mean_metrics, register_source, register_training_runner,
)
from trace_gym.leaderboard.spec import AllocatorEntry, EnvEntry, SuiteError, TrackSpec


def candidate_indices(seed: int, step: int, pool_size: int, n: int) -> np.ndarray:
    """``n`` distinct task indices out of ``pool_size`` for ``step`` (a function of seed and
    step only), sorted."""
    rng = np.random.default_rng([int(seed), int(step), 0xCA9D])
    return np.sort(rng.choice(pool_size, size=min(n, pool_size), replace=False))


@register_source("sim")
class ContrastLabSource:
    """The ``sim`` source: ContrastLab's world and fast path for one seed."""

    def __init__(self, track: TrackSpec, env: EnvEntry, seed: int, cache: dict):
        from trace_gym.sim import ContrastLabEnv, ContrastLabSim, ContrastLabWorld

        if env.id != ContrastLabEnv.env_id:
            raise ValueError(f"the sim policy simulates ContrastLab only; track {track.name!r} asks it to play {env.id!r}")
        kwargs = dict(env.kwargs)
        kwargs.setdefault("seed", seed)
        self.world = ContrastLabWorld(**kwargs)
        self.sim = ContrastLabSim(self.world, seed=seed)
        self.seed = seed

    def candidates(self, step: int, n: int):
        train = self.world.split_indices("train")
        return self.world.candidates(train[candidate_indices(self.seed, step, train.size, n)])

    def rollout(self, forest: Any, origins: np.ndarray) -> None:
        self.sim.rollout(forest, origins)




@register_training_runner("sim")
def contrastlab_training(track: TrackSpec, env: EnvEntry, alloc: AllocatorEntry, seed: int, cache: dict,
                         on_step=None) -> RunResult:
    """A ContrastLab training run in learning mode: each step allocates and rolls out as in
    the allocation track, then the simulated policy takes one REINFORCE step on the forest's
    advantages (the allocator's estimator) with the trainer config's ``model.sim_lr`` and
    ``model.sim_shared_lr``. Held-out accuracy is exact: the mean success probability of
    the first ``eval.tasks`` tasks of ``eval.split`` under the current policy (pass@k
    likewise, ``1 - (1 - v)^k``), so curves carry no evaluation noise."""
    import time

    t0 = time.perf_counter()
    assert track.eval is not None
    rl = base_trainer_config(track)
    run = AllocationRun.build(track, env, alloc, seed, cache)
    world = run.source.world
    held_out = world.split_indices(track.eval.split)[: track.eval.tasks]
    k = track.eval.k
    evals: list[EvalPoint] = []
    spent = [0, 0]

    def evaluate(step: int) -> None:
        v = world.root_value(held_out)
        evals.append(EvalPoint(step=step, trajectories=spent[0], tokens=spent[1], accuracy=float(v.mean()),
                               pass_at_k=float(np.mean(1.0 - (1.0 - v) ** k)), k=k, tasks=int(held_out.size)))

    when = set(eval_steps(track))
    evaluate(0)
    steps = []
    for step in range(track.steps):
        forest, record = run.step(step)
        world.reinforce(forest, forest.advantages(run.advantage), lr=rl.model.sim_lr, shared_lr=rl.model.sim_shared_lr)
        steps.append(record)
        spent[0] += record.trajectories
        spent[1] += record.tokens
        if step + 1 in when:
            evaluate(step + 1)
        if on_step:
            on_step(step)
    run.close()
    final = mean_metrics(steps, TRAINING_FINAL)
    final.update(accuracy=evals[-1].accuracy, pass_at_k=evals[-1].pass_at_k, accuracy_gain=evals[-1].accuracy - evals[0].accuracy)
    return RunResult(steps=steps, evals=evals, final=final, wall_s=time.perf_counter() - t0)


@register_source("*")
class EngineSource:
    """The source for model backends: :class:`trace_gym.rollout.engine.RolloutEngine` over the
    track's env with the track's policy (built once per track and shared by its runs)."""

    def __init__(self, track: TrackSpec, env: EnvEntry, seed: int, cache: dict):
        import trace_gym
        from trace_gym.policies.base import SamplingParams
        from trace_gym.rollout.engine import RolloutEngine

        self.env = trace_gym.make(env.id, seed=seed, **env.kwargs)
        self.seed = seed
        policy = track_policy(track, cache, env_ids=[e.id for e in track.envs])
        params = SamplingParams(max_new_tokens=track.policy.max_new_tokens, temperature=track.policy.temperature, seed=seed)
        # a trajectory the engine cannot finish (a context limit, a server gone) stays in the
        # forest as spent budget without a reward; the step records how many there were
        self.engine = RolloutEngine(self.env, policy, params, on_error="record", progress=self._on_wave)
        self.progress = cache.get("progress")
        self.bar = None
        self.budget = track.budget.trajectories
        self.done = 0

    def _on_wave(self, stats: dict[str, int]) -> None:
        # the engine reports per rollout() call; a step may call it several times (stage 1, 2)
        if self.progress is None or self.bar is None:
            return
        self.progress.update(self.bar, completed=self.done + stats["finished"] + stats["failed"])
        if stats["live"] == 0:
            self.done += stats["finished"] + stats["failed"]

    def candidates(self, step: int, n: int):
        from trace_gym.forest.forest import History

        if self.progress is not None:
            if self.bar is not None:
                self.progress.remove_task(self.bar)
            self.done = 0
            self.bar = self.progress.add_task(f"  step {step + 1}: trajectories", total=self.budget)

        tasks = self.env.tasks()
        idx = candidate_indices(self.seed, step, tasks.size("train"), n)
        out = []
        for i in idx.tolist():
            task = tasks.get(i, "train")
            out.append(History(task.id, task.prompt, max_turns=self.env.max_turns))
        return out

    def rollout(self, forest: Any, origins: np.ndarray) -> None:
        self.engine.rollout(forest, origins)

    def close(self) -> None:
        """Remove this run's progress bar (the policy stays: the track's runs share it)."""
        if self.progress is not None and self.bar is not None:
            self.progress.remove_task(self.bar)
            self.bar = None


def track_policy(track: TrackSpec, cache: dict, env_ids: list[str]):
    """The track's policy, built once and kept in the track's ``cache``; SFT-warmed first when
    the track asks for a warm start (the warmed checkpoint is cached by the trainer)."""
    import trace_gym

    if "policy" not in cache:
        spec = track.policy
        kwargs = dict(spec.kwargs)
        model = spec.model
        if spec.warm_start is not None:
            model = warm_start(track, env_ids, cache)
        elif model is not None and spec.name in ("hf", "vllm"):
            from trace_gym.trainers.sft import resolve_base

            model = resolve_base(model)[0]  # "tiny" builds the from-scratch preset; aliases resolve offline
        if model is not None:
            kwargs.setdefault("model", model)
        cache["policy"] = trace_gym.make_policy(spec.name, **kwargs)
    return cache["policy"]


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


def warm_start_plan(track: TrackSpec, env_ids: list[str]):
    """``(SFTConfig, TinySpec, threads)`` of a track's warm start. The config file is a
    trainer config (``configs/quick.yaml``): its ``sft`` section, its ``model.tiny`` (the
    architecture "tiny" builds) and ``model.threads``; then the spec's ``overrides`` (SFT
    fields); envs default to the config's, else the track's. The trainer caches the warmed
    model by (base model, SFT config), so tracks and ``trace-gym train`` runs with the same
    settings share one warm start."""
    from trace_gym.trainers.config import load_config

    ws = track.policy.warm_start
    rl = load_config(resolve_config_path(ws.config) if ws.config else None)
    data = rl.sft.sft().model_dump(mode="json")
    if not ws.config:
        data["envs"] = [{"id": e} for e in env_ids]
    data.update(ws.overrides)
    from trace_gym.trainers.sft import SFTConfig

    return SFTConfig.model_validate(data), rl.model.tiny, rl.model.threads


def warm_start(track: TrackSpec, env_ids: list[str], cache: dict) -> str:
    """Directory of the track's SFT-warmed model (trained on first use, then cached by the
    trainer under ``$TRACE_GYM_CACHE/sft``)."""
    import time

    from trace_gym.trainers import sft

    console = cache.get("console")
    cfg, tiny, threads = warm_start_plan(track, env_ids)
    progress = cache.get("progress")
    label = f"SFT warm start of {track.policy.model} (cached after the first run)"
    bar = progress.add_task(label, total=None) if progress is not None else None

    def log(figures: dict[str, float]) -> None:
        if bar is not None:
            shown = ", ".join(f"{k} {v:.3g}" for k, v in figures.items() if isinstance(v, (int, float)))
            progress.update(bar, description=f"{label}: {shown}")

    t0 = time.perf_counter()
    path = sft.warm_start(track.policy.model, cfg, tiny=tiny, threads=threads, log=log)
    if bar is not None:
        progress.remove_task(bar)
    if console is not None:
        console.print(f"warm start of {track.policy.model}: {path} ({time.perf_counter() - t0:.1f} s)", highlight=False)
    return str(path)


def preflight(track: TrackSpec) -> None:
    """Check what a track reads from other files before anything runs: its trainer config
    (and overrides) and its warm-start config. Raises
    :class:`~trace_gym.leaderboard.spec.SuiteError` naming the problem."""
    if track.kind == "training":
        base_trainer_config(track)
    ws = track.policy.warm_start
    if ws is not None:
        try:
            warm_start_plan(track, [e.id for e in track.envs])
        except Exception as exc:  # a missing file, a bad key, a bad value: all the user's to fix
            raise SuiteError(f"track {track.name!r}, policy.warm_start: {exc}") from None


def base_trainer_config(track: TrackSpec):
    """The track's trainer config file (defaults without one) with its ``overrides``
    (dotted keys, as on the ``trace-gym train`` command line); a bad key raises
    :class:`~trace_gym.leaderboard.spec.SuiteError` naming it."""
    import yaml

    from trace_gym.trainers.config import ConfigError, load_config

    spec = track.trainer
    overrides = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                 for k, v in (spec.overrides if spec else {}).items()]
    try:
        return load_config(resolve_config_path(spec.config) if spec and spec.config else None, overrides)
    except (ConfigError, FileNotFoundError) as exc:
        raise SuiteError(f"track {track.name!r}, trainer: {exc}") from None


def trainer_config(track: TrackSpec, env: EnvEntry, alloc: AllocatorEntry, seed: int, output_dir: Path):
    """The :class:`~trace_gym.trainers.config.RLConfig` of one training-track run: the
    track's trainer config file and overrides, then everything the suite fixes so that every
    allocator of the track runs under the same budget (env, seed, steps, model, warm start,
    sampling, budget, predictor, advantage, evaluation)."""
    from trace_gym.leaderboard.runner import resolve_advantage, resolve_predictor
    from trace_gym.trainers.config import RLConfig

    data = base_trainer_config(track).model_dump(mode="json")
    pred_name, pred_kwargs = resolve_predictor(track, alloc)
    b, p, ev = track.budget, track.policy, track.eval
    data.update(seed=seed, steps=track.steps, output_dir=str(output_dir), envs=[{"id": env.id, "kwargs": dict(env.kwargs)}])
    data["model"]["name"] = p.model or data["model"]["name"]
    if p.warm_start is not None:
        sft, tiny, threads = warm_start_plan(track, [e.id for e in track.envs])
        data["sft"] = {**sft.model_dump(mode="json"), "enabled": True}
        data["model"]["tiny"] = tiny.model_dump(mode="json")
        if threads:
            data["model"]["threads"] = threads
    else:
        data["sft"]["enabled"] = False
    data["rollout"].update(prompts_per_step=b.candidates, max_new_tokens=p.max_new_tokens, temperature=p.temperature)
    data["allocator"] = {"name": alloc.name, "kwargs": dict(alloc.kwargs), "trajectories": b.trajectories,
                         "root_fraction": b.root_fraction, "min_per_prompt": b.min_per_prompt,
                         "max_per_prompt": b.max_per_prompt, "group_size": b.group_size}
    data["predictor"] = {"name": pred_name, "kwargs": pred_kwargs}
    data["loss"]["advantage"] = resolve_advantage(track, alloc)
    data["eval"].update(every=ev.every, tasks=ev.tasks, k=ev.k, split=ev.split)
    data["checkpoint"].update(every=0)
    data["log"].update(progress=False, tensorboard=False)
    return RLConfig.model_validate(data)


@register_training_runner("*")
def model_training(track: TrackSpec, env: EnvEntry, alloc: AllocatorEntry, seed: int, cache: dict,
                   on_step=None) -> RunResult:
    """A training run of a real model with :class:`trace_gym.trainers.RLTrainer`: SFT warm
    start (cached), then ``steps`` RL steps at the track's budget; held-out mean@k and pass@k
    before the first step, every ``eval.every`` steps and after the last (the trainer's
    :meth:`~trace_gym.trainers.rl.RLTrainer.evaluate`)."""
    import shutil
    import tempfile
    import time

    from trace_gym.leaderboard.records import StepRecord, clean_metric
    from trace_gym.trainers.evaluate import held_out_tasks
    from trace_gym.trainers.rl import RLTrainer

    t0 = time.perf_counter()
    assert track.eval is not None
    out = Path(tempfile.mkdtemp(prefix=f"trace-gym-{track.name}-"))
    console = cache.get("console")
    progress = cache.get("progress")
    bar = progress.add_task(f"  {alloc.key}: SFT warm start and model", total=None) if progress is not None else None
    try:
        cfg = trainer_config(track, env, alloc, seed, out)
        trainer = RLTrainer(cfg, log=(lambda msg: console.print(msg, highlight=False)) if console is not None else None)
        name = trainer.envs[0].env_id.split("/")[-1]
        ev = track.eval
        n_tasks = len(held_out_tasks(trainer.envs[0], ev.tasks, split=cfg.eval.split))
        evals: list[EvalPoint] = []
        spent = [0, 0]

        def add_eval(step: int, rec: dict[str, Any]) -> None:
            acc = rec.get(f"eval/{name}/mean@k")
            if acc is not None:
                evals.append(EvalPoint(step=step, trajectories=spent[0], tokens=spent[1], accuracy=float(acc),
                                       pass_at_k=clean_metric(rec.get(f"eval/{name}/pass@k")), k=ev.k, tasks=n_tasks))

        if bar is not None:
            progress.update(bar, description=f"  {alloc.key}: held-out evaluation before training")
        add_eval(0, trainer.evaluate(0))
        steps: list[StepRecord] = []
        for i in range(track.steps):
            if bar is not None:
                progress.update(bar, description=f"  {alloc.key}: RL step {i + 1}/{track.steps}")
            rec = trainer.step()
            traj, tok = int(rec["spent/trajectories"]), int(rec["spent/generated_tokens"])
            spent[0] += traj
            spent[1] += tok
            metrics = {"effective_ratio": rec.get("effective_ratio"), "effective_sample_ratio": rec.get("effective_sample_ratio"),
                       "effective_token_ratio": rec.get("effective_token_ratio"), "reward_mean": rec.get("reward/mean"),
                       "brier": rec.get("predictor/brier"), "ece": rec.get("predictor/ece"), "auc": rec.get("predictor/auc"),
                       "loss": rec.get("update/loss"), "step_s": rec.get("time/step"), "branches": rec.get("branches"),
                       "prompts": rec.get("spent/prompts")}
            steps.append(StepRecord(step=i, trajectories=traj, tokens=tok, metrics={k: clean_metric(v) for k, v in metrics.items()}))
            add_eval(i + 1, rec)
            if on_step:
                on_step(i)
        trainer.policy.close()
    finally:
        if bar is not None:
            progress.remove_task(bar)
        shutil.rmtree(out, ignore_errors=True)
    if not evals or evals[-1].step != track.steps:
        raise RuntimeError(f"the trainer reported no held-out accuracy for {env.id} after step {track.steps}")
    final = mean_metrics(steps, TRAINING_FINAL)
    final.update(accuracy=evals[-1].accuracy, pass_at_k=evals[-1].pass_at_k, accuracy_gain=evals[-1].accuracy - evals[0].accuracy)
    return RunResult(steps=steps, evals=evals, final=final, wall_s=time.perf_counter() - t0)
