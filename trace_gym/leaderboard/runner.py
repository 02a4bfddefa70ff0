"""The suite runner: runs every (track, env, allocator, seed) of a suite and writes a record
for each, with progress bars throughout.

Allocation track, for each step (the policy is fixed):

1. draw the step's candidate prompts (the same ones for every allocator of a seed);
2. :func:`trace_gym.allocate_step` runs the allocator's two stages against the track's
   rollout source, with the allocator's predictor (:func:`resolve_predictor`);
3. log effective ratio, effective sample ratio (trajectories and tokens, under the
   advantage estimator matching the allocator, :func:`resolve_advantage`), the calibration
   of the predictions the allocator made before the outcomes were known
   (:func:`step_calibration`: Brier, ECE, AUC), what was spent, and the allocator's own
   time (rollouts excluded);
4. the predictor learns from the step's (history, backed-up value) pairs.

A *rollout source* turns (env, policy, seed) into candidate prompts and a
``rollout(forest, origins)`` function; sources are registered by policy backend name with
:func:`register_source` (``sim`` for ContrastLab's simulated policy, ``*`` for model
backends through the rollout engine). Training tracks hand each allocator to the trainer
(``trace_gym.trainers``) and log held-out accuracy against trajectories and tokens spent.

Records are appended to ``records.jsonl`` as each run finishes, so an interrupted suite
keeps what it finished and ``run`` with the same ``--out`` resumes where it stopped.
"""

from __future__ import annotations

import platform
import socket
import subprocess
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from trace_gym.leaderboard.records import (
    BudgetRecord, EvalPoint, Record, Spent, StepRecord, clean_metric, group_key, load_records,
    make_record, write_records,
)
from trace_gym.leaderboard.spec import AllocatorEntry, EnvEntry, SuiteSpec, TrackSpec, config_hash

# ----------------------------------------------------------------------------- provenance

_VERSION_PACKAGES = ("trace-gym", "numpy", "numba", "gymnasium", "pydantic", "torch", "transformers", "vllm")


def package_versions() -> dict[str, str]:
    """Python and the versions of the packages that decide a result (installed ones only)."""
    out = {"python": platform.python_version()}
    for name in _VERSION_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def git_commit() -> str:
    """The commit of the trace-gym checkout (``+dirty`` with local changes), else ``unknown``."""
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ----------------------------------------------------------------------------- rollout sources


class RolloutSource(Protocol):
    """Where an allocation track's rollouts come from, for one (env, policy, seed)."""

    def candidates(self, step: int, n: int) -> Sequence[Any]:
        """``n`` candidate prompts for ``step`` (objects with ``task_id``, ``prompt`` and
        optionally ``max_turns``/``oracle``, e.g. :class:`trace_gym.History`); deterministic
        in (seed, step), so every allocator of a seed sees the same prompts."""

    def rollout(self, forest: Any, origins: np.ndarray) -> None:
        """Start a trajectory at each node in ``origins`` and run it to its end."""


SourceFactory = Callable[[TrackSpec, EnvEntry, int, dict], RolloutSource]
"""``factory(track, env, seed, cache) -> RolloutSource``; ``cache`` is shared by the runs of
one track, for what is expensive to build (a loaded model)."""

_SOURCES: dict[str, SourceFactory] = {}


def register_source(policy: str, factory: SourceFactory | None = None):
    """Register the rollout source for a policy backend name (``"*"``: any other backend).
    Usable as a decorator."""

    def _add(f: SourceFactory) -> SourceFactory:
        _SOURCES[policy] = f
        return f

    return _add(factory) if factory is not None else _add


def make_source(track: TrackSpec, env: EnvEntry, seed: int, cache: dict) -> RolloutSource:
    """The registered source for ``track.policy.name`` (or the ``*`` fallback)."""
    _load_builtin_sources()
    factory = _SOURCES.get(track.policy.name) or _SOURCES.get("*")
    if factory is None:
        raise RuntimeError(f"no rollout source for policy {track.policy.name!r} (registered: {sorted(_SOURCES)})")
    return factory(track, env, seed, cache)


def _load_builtin_sources() -> None:
    import trace_gym.leaderboard.sources  # noqa: F401  (registers the built-in sources)


# ----------------------------------------------------------------------------- metrics


def sample_ratios(forest: Any, advantage: str = "trace") -> dict[str, float]:
    """Effective sample ratio: the share of trajectories (and of generated tokens) that
    receive a non-zero advantage under the estimator ``advantage`` (registered in
    :data:`trace_gym.forest.advantages.ADVANTAGES`; the tree-aware ``trace`` by default)."""
    traj_ratio, token_ratio = forest.effective_sample_ratio(forest.advantages(advantage))
    return {"effective_sample_ratio": traj_ratio, "effective_token_ratio": token_ratio}


# ----------------------------------------------------------------------------- allocation runs


@dataclass
class RunResult:
    """What one (track, env, allocator, seed) run produced, before it is sealed as a record."""

    steps: list[StepRecord]
    evals: list[EvalPoint] = field(default_factory=list)
    final: dict[str, float | None] = field(default_factory=dict)
    wall_s: float = 0.0


def step_calibration(forest: Any) -> dict[str, float | None]:
    """Calibration of the predictions the allocator made this step (``forest.pred``, written
    before the step's outcomes were known): against the env's exact success probability
    where it knows it (``forest.oracle``; the expected scores over outcomes), else against
    the backed-up value of each predicted node weighted by its leaves. ``None`` when the
    allocator predicted nothing."""
    from trace_gym.predictors.calibration import calibration

    seen = np.flatnonzero(np.isfinite(forest.pred))
    if seen.size and np.isfinite(forest.oracle[seen]).all():
        target, weight = forest.oracle[seen], np.ones(seen.size)
    else:
        seen = seen[forest.n_leaves[seen] > 0]
        target, weight = forest.value[seen], forest.n_leaves[seen].astype(np.float64)
    if seen.size == 0:
        return {"brier": None, "ece": None, "auc": None}
    cal = calibration(np.clip(forest.pred[seen], 0.0, 1.0), np.clip(target, 0.0, 1.0), weight)
    return {k: clean_metric(cal[k]) for k in ("brier", "ece", "auc")}


def _make_allocator(alloc: AllocatorEntry, seed: int):
    import inspect

    import trace_gym
    from trace_gym.allocation.allocator import ALLOCATORS

    kwargs = dict(alloc.kwargs)
    try:
        params = inspect.signature(ALLOCATORS.get(alloc.name)).parameters
    except (TypeError, ValueError):
        params = {}
    if "seed" in params and "seed" not in kwargs:
        kwargs["seed"] = seed  # allocators with randomness follow the run's seed
    return trace_gym.make_allocator(alloc.name, **kwargs)


@dataclass
class AllocationRun:
    """The moving parts of one run: the source, the allocator, its predictor, the budget and
    the advantage estimator. :meth:`step` is one step of the allocation track (and the
    rollout phase of a training step)."""

    source: RolloutSource
    allocator: Any
    predictor: Any | None
    budget: Any
    advantage: str
    candidates: int

    @classmethod
    def build(cls, track: TrackSpec, env: EnvEntry, alloc: AllocatorEntry, seed: int, cache: dict) -> "AllocationRun":
        import trace_gym

        pred_name, pred_kwargs = resolve_predictor(track, alloc)
        return cls(
            source=make_source(track, env, seed, cache), allocator=_make_allocator(alloc, seed),
            predictor=trace_gym.make_predictor(pred_name, **pred_kwargs) if pred_name else None,
            budget=track.budget.to_budget(), advantage=resolve_advantage(track, alloc), candidates=track.budget.candidates,
        )

    def step(self, step: int) -> tuple[Any, StepRecord]:
        """Allocate and roll out one step, measure it, and train the predictor on it.
        Returns the backed-up forest and the step's record."""
        import trace_gym
        from trace_gym.allocation.allocator import add_candidates
        from trace_gym.forest.forest import TERMINAL

        ts = time.perf_counter()
        rollout_s = [0.0]

        def rollout(forest: Any, origins: np.ndarray) -> None:
            t = time.perf_counter()
            self.source.rollout(forest, origins)
            rollout_s[0] += time.perf_counter() - t

        forest = trace_gym.Forest()
        add_candidates(forest, self.source.candidates(step, self.candidates))
        spend = trace_gym.allocate_step(forest, self.allocator, self.budget, self.predictor, rollout)
        allocator_ms = 1e3 * (time.perf_counter() - ts - rollout_s[0])
        forest.backup()
        metrics: dict[str, float | None] = {"effective_ratio": forest.effective_ratio(), **sample_ratios(forest, self.advantage)}
        metrics.update(step_calibration(forest))
        finished = forest.finished() if hasattr(forest, "finished") else (forest.flags & TERMINAL) != 0
        metrics["reward_mean"] = float(np.mean(forest.reward[finished])) if finished.any() else None
        if self.predictor is not None:
            nodes = np.flatnonzero(((forest.flags & TERMINAL) == 0) & (forest.n_leaves > 0))
            if nodes.size:
                self.predictor.update(forest.histories(nodes), forest.value[nodes].astype(np.float64),
                                      forest.n_leaves[nodes].astype(np.float64))
        metrics.update(prompts=spend.prompts, branches=spend.branches, allocator_ms=allocator_ms,
                       failed_trajectories=forest.counters.get("failed_trajectories", 0),
                       rollout_s=rollout_s[0], step_s=time.perf_counter() - ts)
        record = StepRecord(step=step, trajectories=int(spend.trajectories), tokens=int(forest.counters["generated_tokens"]),
                            metrics={k: clean_metric(v) for k, v in metrics.items()})
        return forest, record

    def close(self) -> None:
        if hasattr(self.source, "close"):
            self.source.close()


ALLOCATION_FINAL = ("effective_ratio", "effective_sample_ratio", "effective_token_ratio", "brier", "ece", "auc", "allocator_ms")


def run_allocation(track: TrackSpec, env: EnvEntry, alloc: AllocatorEntry, seed: int, cache: dict,
                   on_step: Callable[[int], None] | None = None) -> RunResult:
    """One allocation-track run; see the module docstring for what each step does."""
    t0 = time.perf_counter()
    run = AllocationRun.build(track, env, alloc, seed, cache)
    steps: list[StepRecord] = []
    for step in range(track.steps):
        _, record = run.step(step)
        steps.append(record)
        if on_step:
            on_step(step)
    run.close()
    return RunResult(steps=steps, final=mean_metrics(steps, ALLOCATION_FINAL), wall_s=time.perf_counter() - t0)


def resolve_predictor(track: TrackSpec, alloc: AllocatorEntry) -> tuple[str | None, dict[str, Any]]:
    """The predictor an allocator runs with: its entry's, else the track's, else the
    allocator class's ``default_predictor`` (None: it needs none)."""
    if alloc.predictor is not None:
        return (None if alloc.predictor == "none" else alloc.predictor), dict(alloc.predictor_kwargs)
    if track.predictor is not None:
        return (None if track.predictor == "none" else track.predictor), dict(track.predictor_kwargs)
    from trace_gym.allocation.allocator import ALLOCATORS

    return getattr(ALLOCATORS.get(alloc.name), "default_predictor", None), {}


def resolve_advantage(track: TrackSpec, alloc: AllocatorEntry) -> str:
    """The advantage estimator that decides which samples are effective (and, in a training
    track, what the policy is updated with): the allocator entry's, else the track's, else
    the one matching the allocator's forests (its class's ``advantage``), else ``trace``."""
    if alloc.advantage is not None:
        return alloc.advantage
    if track.advantage is not None:
        return track.advantage
    from trace_gym.allocation.allocator import ALLOCATORS

    return getattr(ALLOCATORS.get(alloc.name), "advantage", "trace")


def mean_metrics(steps: Sequence[StepRecord], names: Sequence[str]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for m in names:
        vals = [s.metrics.get(m) for s in steps if s.metrics.get(m) is not None]
        out[m] = float(np.mean(vals)) if vals else None
    return out


# ----------------------------------------------------------------------------- training runs

TrainingRunner = Callable[[TrackSpec, EnvEntry, AllocatorEntry, int, dict, Callable[[int], None] | None], RunResult]
"""``runner(track, env, allocator, seed, cache, on_step) -> RunResult`` with ``evals`` filled in."""

_TRAINING: dict[str, TrainingRunner] = {}


def register_training_runner(policy: str, runner: TrainingRunner | None = None):
    """Register the training-track runner for a policy backend name (``"*"``: any other
    backend). Usable as a decorator."""

    def _add(f: TrainingRunner) -> TrainingRunner:
        _TRAINING[policy] = f
        return f

    return _add(runner) if runner is not None else _add


def run_training(track: TrackSpec, env: EnvEntry, alloc: AllocatorEntry, seed: int, cache: dict,
                 on_step: Callable[[int], None] | None = None) -> RunResult:
    """One training-track run: train at this allocator and budget, evaluating on held-out
    tasks before the first step, every ``eval.every`` steps and after the last."""
    _load_builtin_sources()
    runner = _TRAINING.get(track.policy.name) or _TRAINING.get("*")
    if runner is None:
        raise RuntimeError(f"no training runner for policy {track.policy.name!r} (registered: {sorted(_TRAINING)})")
    return runner(track, env, alloc, seed, cache, on_step)


def eval_steps(track: TrackSpec) -> list[int]:
    """Steps after which a training track evaluates: 0 (the starting policy), every
    ``eval.every`` steps, and the last."""
    assert track.eval is not None
    return sorted({0, *range(track.eval.every, track.steps + 1, track.eval.every), track.steps})


TRAINING_FINAL = ("effective_ratio", "effective_sample_ratio", "effective_token_ratio", "reward_mean")


# ----------------------------------------------------------------------------- the suite


def row_config(track: TrackSpec, env: EnvEntry, alloc: AllocatorEntry) -> dict[str, Any]:
    """The resolved config of one leaderboard row (what its config hash covers; not the seed)."""
    d = track.model_dump(mode="json", exclude={"allocators", "envs", "seeds", "name"})
    d["env"] = env.model_dump(mode="json")
    d["allocator"] = alloc.model_dump(mode="json")
    return d


@dataclass
class RunPlan:
    """One unit of work of a suite."""

    track: TrackSpec
    env: EnvEntry
    alloc: AllocatorEntry
    seed: int

    @property
    def config_hash(self) -> str:
        return config_hash(row_config(self.track, self.env, self.alloc))

    @property
    def label(self) -> str:
        return f"{self.track.name} / {self.env.name} / {self.alloc.key} / seed {self.seed}"


def preflight(spec: SuiteSpec) -> None:
    """Check every track's trainer and warm-start configs before the suite starts (raises
    :class:`~trace_gym.leaderboard.spec.SuiteError`)."""
    _load_builtin_sources()
    from trace_gym.leaderboard.sources import preflight as check_track

    for track in spec.tracks:
        check_track(track)


def plan_suite(spec: SuiteSpec) -> list[RunPlan]:
    """Every run of a suite, in the order they run (track, env, seed, allocator)."""
    return [RunPlan(t, e, a, s) for t in spec.tracks for e in t.envs for s in spec.track_seeds(t) for a in t.allocators]


def _seal(spec: SuiteSpec, plan: RunPlan, result: RunResult, run_id: str, provenance: dict[str, Any]) -> Record:
    t = plan.track
    policy = t.policy.model_dump(mode="json")
    return make_record(
        run=run_id, suite=spec.suite, track=t.name, kind=t.kind, env=plan.env.name, env_id=plan.env.id,
        env_kwargs=plan.env.kwargs, allocator=plan.alloc.key, allocator_name=plan.alloc.name,
        allocator_kwargs=plan.alloc.kwargs, policy=policy, predictor=resolve_predictor(t, plan.alloc)[0],
        advantage=resolve_advantage(t, plan.alloc), seed=plan.seed,
        group=group_key(t.kind, plan.env.id, plan.env.kwargs, policy), config_hash=plan.config_hash,
        budget=BudgetRecord(trajectories_per_step=t.budget.trajectories, steps=t.steps, candidates=t.budget.candidates,
                            root_fraction=t.budget.root_fraction, min_per_prompt=t.budget.min_per_prompt,
                            group_size=t.budget.group_size),
        spent=Spent(trajectories=sum(s.trajectories for s in result.steps), tokens=sum(s.tokens for s in result.steps),
                    wall_s=round(result.wall_s, 3)),
        steps=result.steps, evals=result.evals, final={k: clean_metric(v) for k, v in result.final.items()},
        **provenance,
    )


def run_suite(spec: SuiteSpec, out_dir: Path, *, show_progress: bool = True, resume: bool = True,
              console: Any = None) -> list[Record]:
    """Run every run of ``spec`` not already in ``out_dir/records.jsonl`` and append its record.

    Returns all records of the suite in ``out_dir`` (finished earlier and now). Progress is a
    rich progress bar (one bar for the suite, one for the current run's steps).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records_path = out_dir / "records.jsonl"
    console = console or Console(stderr=True)
    plans = plan_suite(spec)
    wanted = {(p.config_hash, p.seed) for p in plans}
    done: dict[tuple[str, int], Record] = {}
    if resume and records_path.exists() and records_path.stat().st_size:
        kept = [lr.record for lr in load_records([records_path])]
        stale = [r for r in kept if (r.config_hash, r.seed) not in wanted]
        if stale:
            # records of an earlier version of the suite would compete with the new ones at
            # another budget; the folder holds one suite (combine folders with `merge`)
            console.print(f"dropping {len(stale)} record(s) in {records_path} that this suite no longer runs")
            kept = [r for r in kept if (r.config_hash, r.seed) in wanted]
            write_records(records_path, kept)
        done = {(r.config_hash, r.seed): r for r in kept}
    elif records_path.exists():
        records_path.unlink()
    run_id = out_dir.name
    provenance = {"versions": package_versions(), "git_commit": git_commit(), "host": socket.gethostname()}
    todo = [p for p in plans if (p.config_hash, p.seed) not in done]
    records: list[Record] = [done[(p.config_hash, p.seed)] for p in plans if (p.config_hash, p.seed) in done]
    caches: dict[str, dict] = {}
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=console, disable=not show_progress, transient=False) as progress:
        total_steps = sum(p.track.steps for p in todo)
        suite_bar = progress.add_task(f"suite {spec.suite}", total=total_steps)
        for plan in todo:
            run_bar = progress.add_task(plan.label, total=plan.track.steps)

            def on_step(step: int, _bar=run_bar) -> None:
                progress.advance(_bar)
                progress.advance(suite_bar)

            cache = caches.setdefault(plan.track.name, {"progress": progress, "console": console})
            runner = run_allocation if plan.track.kind == "allocation" else run_training
            result = runner(plan.track, plan.env, plan.alloc, plan.seed, cache, on_step)
            record = _seal(spec, plan, result, run_id, provenance)
            write_records(records_path, [record], append=True)
            records.append(record)
            progress.remove_task(run_bar)
    return records


__all__ = [
    "ALLOCATION_FINAL", "AllocationRun", "RolloutSource", "RunPlan", "RunResult", "TRAINING_FINAL", "eval_steps",
    "git_commit", "mean_metrics", "preflight", "step_calibration", "make_source", "package_versions", "plan_suite",
    "register_source", "register_training_runner", "resolve_advantage", "resolve_predictor", "row_config", "run_allocation", "run_suite", "run_training",
    "sample_ratios",
]
