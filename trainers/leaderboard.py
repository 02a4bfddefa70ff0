"""The trainers plug-in's part of the leaderboard: model backends' rollout source (``*``),
their training runner (``*``: :class:`~trace_gym.trainers.rl.RLTrainer`) and the SFT warm start
a track may ask for. Registered through the entry-point group ``trace_gym.leaderboard``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trace_gym.leaderboard.records import EvalPoint
from trace_gym.leaderboard.runner import (
    RunResult, failed_share, record_metrics, register_preflight, register_source, register_training_runner, row_spec,
    training_final,
)
from trace_gym.leaderboard.sources import resolve_config_path
from trace_gym.leaderboard.spec import AllocatorEntry, EnvEntry, SuiteError, TrackSpec
from trace_gym.trainers.backends import BACKENDS


@register_source("*")
def engine_source(track: TrackSpec, env: EnvEntry, seed: int, cache: dict):
    """The source for model backends: :class:`trace_gym.rollout.source.EngineSource` over the
    track's env with the track's policy (built once per track, SFT-warmed first when the track
    asks for it, and shared by its runs), with a progress bar of the step's trajectories."""
    import trace_gym
    from trace_gym.policies.base import SamplingParams

    envs = [trace_gym.make(env.id, seed=seed, **env.kwargs)]
    policy = track_policy(track, cache, env_ids=[e.id for e in track.envs])
    params = SamplingParams(max_new_tokens=track.policy.max_new_tokens, temperature=track.policy.temperature)
    return _BarSource(envs, policy, params, seed, cache.get("progress"), track.budget.trajectories)


class _BarSource:
    """An :class:`~trace_gym.rollout.source.EngineSource` that shows the step's trajectories
    on the suite's progress display; :meth:`finish` removes the bar (the policy stays: the
    track's runs share it)."""

    def __init__(self, envs, policy, params, seed, progress, budget):
        from trace_gym.rollout.source import EngineSource

        self.inner = EngineSource(envs, policy, params, seed=seed, progress=self._on_wave)
        self.progress, self.budget, self.bar, self.done = progress, budget, None, 0

    def _on_wave(self, stats: dict[str, int]) -> None:
        # the engine reports per rollout() call; a step may call it several times (stage 1, 2)
        if self.progress is None or self.bar is None:
            return
        self.progress.update(self.bar, completed=self.done + stats["finished"] + stats["failed"])
        if stats["live"] == 0:
            self.done += stats["finished"] + stats["failed"]

    def add_candidates(self, forest, step: int, n: int) -> None:
        if self.progress is not None:
            if self.bar is not None:
                self.progress.remove_task(self.bar)
            self.done = 0
            self.bar = self.progress.add_task(f"  step {step + 1}: trajectories", total=self.budget)
        self.inner.add_candidates(forest, step, n)

    def rollout(self, forest, origins) -> None:
        self.inner.rollout(forest, origins)

    def finish(self) -> None:
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
    cfg, tiny, _ = warm_start_plan(track, env_ids)
    progress = cache.get("progress")
    label = f"SFT warm start of {track.policy.model} (cached after the first run)"
    bar = progress.add_task(label, total=None) if progress is not None else None
    plain = console is not None and cache.get("plain", False)  # a log file: a line a minute
    t0 = last = time.perf_counter()
    if plain:
        console.print(f"{label}: finding or training it", highlight=False, soft_wrap=True)

    def log(figures: dict[str, float]) -> None:
        nonlocal last
        shown = ", ".join(f"{k} {v:.3g}" for k, v in figures.items() if isinstance(v, (int, float)))
        if bar is not None:
            progress.update(bar, description=f"{label}: {shown}")
        if plain and time.perf_counter() - last >= 60:
            last = time.perf_counter()
            console.print(f"{label}: {shown} ({last - t0:.0f} s)", highlight=False, soft_wrap=True)

    path = sft.warm_start(track.policy.model, cfg, tiny=tiny, log=log)
    if bar is not None:
        progress.remove_task(bar)
    if console is not None:
        console.print(f"warm start of {track.policy.model}: {path} ({time.perf_counter() - t0:.1f} s)", highlight=False)
    return str(path)


@register_preflight
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
    sampling, budget, predictor, advantage, evaluation). A track policy named ``hf``,
    ``vllm`` or ``openai`` is the run's ``rollout.backend`` (its kwargs the backend's
    options; ``base_url`` the openai servers)."""
    from trace_gym.trainers.config import RLConfig

    base = base_trainer_config(track)
    data = base.model_dump(mode="json")
    spec = row_spec(track, env, alloc, seed)
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
    data["rollout"].update(max_new_tokens=p.max_new_tokens, temperature=p.temperature)
    if p.name in BACKENDS:
        # the track's policy backend is the run's rollout backend (trainers/backends.py); its
        # kwargs are the backend's options, `base_url` the openai servers
        kwargs = dict(p.kwargs)
        for key in ("model", "tokenizer"):
            kwargs.pop(key, None)
        if "device" in kwargs:
            data["model"]["device"] = kwargs.pop("device")
        urls = kwargs.pop("base_url", None) if p.name == "openai" else None
        data["rollout"].update(backend=p.name, servers=[urls] if isinstance(urls, str) else list(urls or []),
                               policy_kwargs={**data["rollout"].get("policy_kwargs", {}), **kwargs})
        if p.name != "hf" and "is_correction" not in base.loss.model_fields_set:
            data["loss"]["is_correction"] = True  # what the trainer defaults to for this backend
    data["budget"] = b.model_dump(mode="json")
    data["allocator"] = spec.allocator.model_dump(mode="json")
    data["predictor"] = spec.predictor.model_dump(mode="json") if spec.predictor is not None else None
    data["advantage"] = spec.advantage.model_dump(mode="json") if spec.advantage is not None else None
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
                scores = trainer.task_scores.get(name, [])  # the evaluation that wrote ``rec``
                # kept only where they are that evaluation's (a task short of its k episodes
                # would average to another figure): the record is refused otherwise
                fits = EvalPoint.scores_problem(scores, n_tasks, float(acc)) is None
                evals.append(EvalPoint(step=step, trajectories=spent[0], tokens=spent[1], accuracy=float(acc),
                                       pass_at_k=clean_metric(rec.get(f"eval/{name}/pass@k")), k=ev.k, tasks=n_tasks,
                                       task_scores=scores if fits else []))

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
            # the step's figures as an allocation track records them (its step_s: the whole
            # trainer step, update and evaluation included), the update's loss and the learning
            # rate after it (a cut to the first steps checks that it did not decay)
            metrics = {**record_metrics(rec), "loss": rec.get("update/loss"), "lr": rec.get("update/lr")}
            steps.append(StepRecord(step=i, trajectories=traj, tokens=tok, metrics={k: clean_metric(v) for k, v in metrics.items()},
                                    generated=rec["generated"]))
            add_eval(i + 1, rec)
            if on_step:
                on_step(i)
        trainer.close()
    finally:
        if bar is not None:
            progress.remove_task(bar)
        shutil.rmtree(out, ignore_errors=True)
    if not evals or evals[-1].step != track.steps:
        raise RuntimeError(f"the trainer reported no held-out accuracy for {env.id} after step {track.steps}")
    final = training_final(steps, evals)
    final["failed_share"] = failed_share(steps)
    return RunResult(steps=steps, evals=evals, final=final, wall_s=time.perf_counter() - t0)
