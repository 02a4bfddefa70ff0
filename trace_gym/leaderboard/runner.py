"""The suite runner: runs every (track, env, allocator, seed) of a suite and writes a record
for each, with progress bars throughout.

Allocation track: each row (env x allocator x seed) is one :class:`~trace_gym.run.RunSpec`
(:func:`row_spec`) run for ``steps`` steps of :class:`~trace_gym.step.Step` on the track's
rollout source; the policy is fixed. Its predictor's calibration is then scored on an
evaluation set every row of the same env and seed shares, where the env has one (ContrastLab:
:mod:`trace_gym.sim.evaluation`, as the bench scores it; :func:`register_shared_evaluation`),
and otherwise only over the nodes the row predicted itself (not comparable between rows).
Training tracks add a policy update to each step (the simulator's learning mode, or the
trainer) and log held-out accuracy against trajectories and tokens spent.

A *rollout source* (:class:`trace_gym.step.RolloutSource`) is registered by policy backend
name with :func:`register_source` (``sim`` for ContrastLab's simulated policy; the trainers
plug-in registers ``*`` for model backends through the rollout engine); training runners
likewise with :func:`register_training_runner`. Both are found through the entry-point
group :data:`PLUGIN_GROUP`.

Records are appended to ``records.jsonl`` as each run finishes, so an interrupted suite
keeps what it finished and ``run`` with the same ``--out`` resumes where it stopped. Records
are never deleted (:func:`run_suite`): re-running a changed suite into the same folder adds
its new runs (another seed, more steps); the records it no longer produces are kept, in
``records.earlier.jsonl`` beside it (not ranked; reused if the suite asks for them again);
``fresh=True`` (``--fresh``) first moves the folder's record files aside under timestamped
names.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from trace_gym.leaderboard.records import (
    BudgetRecord, EvalPoint, Record, RecordError, Spent, StepRecord, clean_metric, group_key, make_record,
    parse_record_line, write_records,
)
from trace_gym.leaderboard.spec import AllocatorEntry, EnvEntry, SuiteSpec, TrackSpec, config_hash
from trace_gym.provenance import provenance
from trace_gym.run import ComponentSpec, RunSpec, defaults, row_label
from trace_gym.step import DISAGREEMENT, RolloutSource, Step, StepResult, disagreement_metric

# ----------------------------------------------------------------------------- rollout sources


SourceFactory = Callable[[TrackSpec, EnvEntry, int, dict], RolloutSource]
"""``factory(track, env, seed, cache) -> RolloutSource`` (see :class:`trace_gym.step.RolloutSource`);
``cache`` is shared by the runs of one track, for what is expensive to build (a loaded model)."""

_SOURCES: dict[str, SourceFactory] = {}

PLUGIN_GROUP = "trace_gym.leaderboard"
"""Entry-point group of modules that register rollout sources and training runners when
imported (the trainers plug-in registers the model backends' ones this way)."""


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
        raise RuntimeError(f"no rollout source for policy {track.policy.name!r} (registered: {sorted(_SOURCES)}); "
                           f"is the trainers plug-in installed?")
    return factory(track, env, seed, cache)


_plugins_loaded = False


PREFLIGHTS: list[Callable[[TrackSpec], None]] = []
"""Checks the registered plug-ins run on every track before a suite starts (raise ``SuiteError``)."""


def register_preflight(check: Callable[[TrackSpec], None]) -> Callable[[TrackSpec], None]:
    """Add a track check run before a suite starts (decorator)."""
    PREFLIGHTS.append(check)
    return check


def _load_builtin_sources() -> None:
    """Import the modules of the group :data:`PLUGIN_GROUP` (the simulator's
    ``trace_gym.leaderboard.sources`` and the trainers plug-in's), which register sources,
    training runners and preflight checks."""
    global _plugins_loaded
    if not _plugins_loaded:
        for ep in metadata.entry_points(group=PLUGIN_GROUP):
            ep.load()
        _plugins_loaded = True


# ----------------------------------------------------------------------------- allocation runs


@dataclass
class RunResult:
    """What one (track, env, allocator, seed) run produced, before it is sealed as a record."""

    steps: list[StepRecord]
    evals: list[EvalPoint] = field(default_factory=list)
    final: dict[str, float | None] = field(default_factory=dict)
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first distinct rollout errors (not recorded; reported)


def failed_share(steps: Sequence[StepRecord]) -> float | None:
    """Share of a run's trajectories that failed (a generation or env error), None when none did:
    the ``failed_share`` column, which tables show only when some row has failures."""
    failed = sum(float(s.metrics.get("failed_trajectories") or 0.0) for s in steps)
    spent = sum(s.trajectories for s in steps)
    return failed / spent if failed > 0 and spent > 0 else None


def row_spec(track: TrackSpec, env: EnvEntry, alloc: AllocatorEntry, seed: int) -> RunSpec:
    """The :class:`~trace_gym.run.RunSpec` of one leaderboard row and seed."""
    policy = {"name": track.policy.name, "kwargs": {**track.policy.kwargs, **({"model": track.policy.model} if track.policy.model else {}),
                                                    "max_new_tokens": track.policy.max_new_tokens,
                                                    "temperature": track.policy.temperature}}
    return RunSpec(envs=[{"id": env.id, "kwargs": dict(env.kwargs)}], policy=policy, allocator=alloc.spec,
                   predictor=alloc.predictor if alloc.predictor is not None else track.predictor,
                   advantage=alloc.advantage if alloc.advantage is not None else track.advantage,
                   budget=track.budget, seed=seed)


def allocation_step(track: TrackSpec, env: EnvEntry, alloc: AllocatorEntry, seed: int, cache: dict, **kwargs: Any) -> Step:
    """The :class:`~trace_gym.step.Step` of one row: the row's run spec on the track's source."""
    spec = row_spec(track, env, alloc, seed)
    return Step.from_spec(spec, make_source(track, env, seed, cache), **kwargs)


def record_metrics(m: dict[str, Any]) -> dict[str, Any]:
    """The figures of one step's metrics (:class:`~trace_gym.step.Step`'s names) that every
    track's step record keeps, under the record's names (None where the step has none)."""
    allocator_s = m.get("time/allocator")
    metrics = {
        "effective_ratio": m.get("effective_ratio"), "effective_sample_ratio": m.get("effective_sample_ratio"),
        "effective_token_ratio": m.get("effective_token_ratio"), "brier": m.get("calibration/brier"),
        "ece": m.get("calibration/ece"), "auc": m.get("calibration/auc"), "reward_mean": m.get("reward/mean"),
        "prompts": m.get("spent/prompts"), "branches": m.get("branches"),
        "allocator_ms": None if allocator_s is None else 1e3 * allocator_s,
        "failed_trajectories": m.get("spent/failed_trajectories"), "rollout_s": m.get("time/rollout"), "step_s": m.get("time/step"),
        "branch_flip_rate": m.get("branch/flip_rate"),
        # stage 2's calibration: predicted and seen disagreement of continuations of pure prefixes
        **{f"{kind}_disagree_{what}": m.get(disagreement_metric(kind, what)) for kind, what in DISAGREEMENT},
    }
    for k in ("effective_sample_ratio/grpo", "effective_sample_ratio/trace"):
        if k in m:
            metrics[k] = m[k]
    return metrics


def step_record(result: StepResult) -> StepRecord:
    """A step's figures as the leaderboard records them (:func:`record_metrics`, and the
    simulated policy update's where the step has one)."""
    m = result.metrics
    metrics = record_metrics(m)
    for k in ("update/loss", "update/sim_grad"):
        if k in m:
            metrics[k] = m[k]
    return StepRecord(step=result.step, trajectories=int(result.spend.trajectories), tokens=int(m["spent/generated_tokens"]),
                      metrics={k: clean_metric(v) for k, v in metrics.items()}, generated=result.forest.fingerprint())


ALLOCATION_FINAL = ("effective_ratio", "effective_sample_ratio", "effective_sample_ratio/grpo", "effective_token_ratio", "brier", "ece",
                    "auc", "allocator_ms", "branch_flip_rate")

OWN_NODE_CALIBRATION = ("brier", "ece", "auc")
"""Final metrics averaged from the steps' ``calibration/*``: the row's predictor on the nodes
it predicted during its run. Each allocator chooses its own nodes, so they are not comparable
between rows; a row scored on a shared evaluation set (:func:`register_shared_evaluation`)
records :data:`SHARED_CALIBRATION` instead (its steps keep these, for diagnosis)."""

SHARED_CALIBRATION = ("auc_prefix", "auc_root", "brier_prefix", "brier_root", "bayes_auc_prefix", "bayes_auc_root",
                      "eval_prefixes", "eval_roots")
"""Final metrics of a row scored on its env's shared evaluation set (:func:`calibration_metrics`)."""

SharedEvaluation = Callable[[TrackSpec, EnvEntry, int, Step, dict], "dict[str, float | None] | None"]
"""``evaluate(track, env, seed, step, cache) -> metrics`` after a row's last step: its
predictor scored on an evaluation set every row of the same env and seed shares
(:data:`SHARED_CALIBRATION`), or None where the env has none."""

_EVALUATIONS: dict[str, SharedEvaluation] = {}


def register_shared_evaluation(policy: str, evaluate: SharedEvaluation | None = None):
    """Register the shared-evaluation-set scorer of a policy backend name (the simulator's
    ``sim``: ContrastLab's :mod:`trace_gym.sim.evaluation`). Usable as a decorator."""

    def _add(f: SharedEvaluation) -> SharedEvaluation:
        _EVALUATIONS[policy] = f
        return f

    return _add(evaluate) if evaluate is not None else _add


def calibration_metrics(calibration: dict[str, Any] | None, references: dict[str, Any],
                        roots: int, prefixes: int) -> dict[str, float | None]:
    """A row's :data:`SHARED_CALIBRATION` metrics from an evaluation set's scores:
    ``calibration`` as :meth:`trace_gym.sim.evaluation.EvaluationSet.score` returns it (None:
    the row predicts nothing), ``references`` as
    :meth:`~trace_gym.sim.evaluation.EvaluationSet.references` (its ``bayes`` AUCs are kept),
    ``roots``/``prefixes`` the set's node counts."""
    def part(scores: dict[str, Any] | None, name: str, key: str) -> float | None:
        return clean_metric(((scores or {}).get(name) or {}).get(key))

    return {"auc_prefix": part(calibration, "prefixes", "auc"), "auc_root": part(calibration, "roots", "auc"),
            "brier_prefix": part(calibration, "prefixes", "brier"), "brier_root": part(calibration, "roots", "brier"),
            "bayes_auc_prefix": part(references.get("bayes"), "prefixes", "auc"),
            "bayes_auc_root": part(references.get("bayes"), "roots", "auc"),
            "eval_prefixes": float(prefixes), "eval_roots": float(roots)}


def shared_calibration(track: TrackSpec, env: EnvEntry, seed: int, step: Step, cache: dict) -> dict[str, float | None] | None:
    """The row's predictor scored by the scorer registered for ``track.policy.name`` (None:
    none registered, or the env has no shared evaluation set)."""
    _load_builtin_sources()
    evaluate = _EVALUATIONS.get(track.policy.name)
    return None if evaluate is None else evaluate(track, env, seed, step, cache)


def run_allocation(track: TrackSpec, env: EnvEntry, alloc: AllocatorEntry, seed: int, cache: dict,
                   on_step: Callable[[int], None] | None = None) -> RunResult:
    """One allocation-track run: ``track.steps`` steps of the row's :class:`~trace_gym.step.Step`.
    Where the env has a shared evaluation set (ContrastLab), the predictor is then scored on
    it (:data:`SHARED_CALIBRATION`) in place of the own-node :data:`OWN_NODE_CALIBRATION`."""
    from trace_gym.rollout.source import distinct_errors, source_failures

    t0 = time.perf_counter()
    step = allocation_step(track, env, alloc, seed, cache)
    steps: list[StepRecord] = []
    errors: list[str] = []
    for i in range(track.steps):
        steps.append(step_record(step.run(i)))
        distinct_errors(source_failures(step.source), seen=errors)
        if on_step:
            on_step(i)
    final = mean_metrics(steps, ALLOCATION_FINAL)
    final["failed_share"] = failed_share(steps)
    shared = shared_calibration(track, env, seed, step, cache)
    if shared is not None:
        for k in OWN_NODE_CALIBRATION:
            final.pop(k, None)
        final.update(shared)
    if hasattr(step.source, "finish"):
        step.source.finish()
    return RunResult(steps=steps, final=final, wall_s=time.perf_counter() - t0, errors=errors)


def resolve_predictor(track: TrackSpec, alloc: AllocatorEntry) -> ComponentSpec | None:
    """The predictor an allocator runs with: its entry's, else the track's, else the
    allocator's own (None: no predictor), resolved by :func:`trace_gym.run.defaults`."""
    spec = alloc.predictor if alloc.predictor is not None else track.predictor
    if spec is None:
        return defaults(alloc.spec)[0]
    return None if spec.name == "none" else spec


def resolve_advantage(track: TrackSpec, alloc: AllocatorEntry) -> ComponentSpec:
    """The advantage estimator of a row: the entry's, else the track's, else the allocator's own."""
    spec = alloc.advantage if alloc.advantage is not None else track.advantage
    return spec if spec is not None else defaults(alloc.spec)[1]


def _name(spec: ComponentSpec | None) -> str | None:
    return None if spec is None else str(spec)


def mean_metrics(steps: Sequence[StepRecord], names: Sequence[str]) -> dict[str, float | None]:
    """Mean of each named metric over the steps that report it."""
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


TRAINING_FINAL = ("effective_ratio", "effective_sample_ratio", "effective_token_ratio", "reward_mean", "branch_flip_rate")


def training_final(steps: Sequence[StepRecord], evals: Sequence[EvalPoint]) -> dict[str, float | None]:
    """A training run's final metrics: the means over its steps of :data:`TRAINING_FINAL`,
    and from its evaluations (in step order, at least one) the last one's held-out accuracy
    and pass@k and the accuracy gained since the first."""
    final = mean_metrics(steps, TRAINING_FINAL)
    final.update(accuracy=evals[-1].accuracy, pass_at_k=evals[-1].pass_at_k, accuracy_gain=evals[-1].accuracy - evals[0].accuracy)
    return final


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
        """Hash of the row's configuration; with the seed, the key a finished record is found by."""
        return config_hash(row_config(self.track, self.env, self.alloc))

    @property
    def row(self) -> str:
        """The row name the record and the leaderboard give the run: the allocator's key, with
        the track-wide predictor or advantage marked where it replaces the allocator's own."""
        t, a = self.track, self.alloc
        return row_label(a.spec, base=a.key, predictor=None if a.predictor is not None else t.predictor,
                         advantage=None if a.advantage is not None else t.advantage)

    @property
    def label(self) -> str:
        """``track / env / allocator / seed``, as progress and errors name the run."""
        return f"{self.track.name} / {self.env.name} / {self.alloc.key} / seed {self.seed}"


def preflight(spec: SuiteSpec, *, servers: bool = True) -> None:
    """Check every track before the suite starts: the registered plug-in checks (trainer and
    warm-start configs; they raise :class:`~trace_gym.leaderboard.spec.SuiteError`), then,
    with ``servers``, that every server a track calls answers (its envs' retrieval servers, an
    ``openai`` policy's ``base_url``; :class:`~trace_gym.rollout.preflight.ServerUnavailable`
    names the URL)."""
    from trace_gym.rollout.preflight import check_servers

    _load_builtin_sources()
    for track in spec.tracks:
        for check in PREFLIGHTS:
            check(track)
    if servers:
        for track in spec.tracks:
            check_servers(track.envs, (track.policy.name, track.policy.kwargs))


def plan_suite(spec: SuiteSpec) -> list[RunPlan]:
    """Every run of a suite, in the order they run (track, env, seed, allocator)."""
    return [RunPlan(t, e, a, s) for t in spec.tracks for e in t.envs for s in spec.track_seeds(t) for a in t.allocators]


def _seal(spec: SuiteSpec, plan: RunPlan, result: RunResult, run_id: str, provenance: dict[str, Any]) -> Record:
    t = plan.track
    policy = t.policy.model_dump(mode="json")
    return make_record(
        run=run_id, suite=spec.suite, track=t.name, kind=t.kind, env=plan.env.name, env_id=plan.env.id,
        env_kwargs=plan.env.kwargs, allocator=plan.row,
        allocator_name=plan.alloc.name,
        allocator_kwargs=plan.alloc.kwargs, policy=policy, predictor=_name(resolve_predictor(t, plan.alloc)),
        advantage=str(resolve_advantage(t, plan.alloc)), seed=plan.seed,
        group=group_key(t.kind, plan.env.id, plan.env.kwargs, policy), config_hash=plan.config_hash,
        budget=BudgetRecord(trajectories_per_step=t.budget.trajectories, steps=t.steps, candidates=t.budget.prompts,
                            root_fraction=t.budget.root_fraction, min_per_prompt=t.budget.min_per_prompt,
                            group_size=t.budget.group_size),
        spent=Spent(trajectories=sum(s.trajectories for s in result.steps), tokens=sum(s.tokens for s in result.steps),
                    wall_s=round(result.wall_s, 3)),
        steps=result.steps, evals=result.evals, final={k: clean_metric(v) for k, v in result.final.items()},
        **provenance,
    )


EARLIER_FILE = "records.earlier.jsonl"
"""Where :func:`run_suite` keeps the records of a results folder that its suite no longer produces."""


def read_record_file(path: Path) -> list[Record]:
    """Every record of one JSONL file, each checked (:func:`~trace_gym.leaderboard.records.parse_record_line`),
    duplicates allowed; a bad line raises :class:`~trace_gym.leaderboard.records.RecordError`
    naming ``file:line``. A missing file has no records."""
    if not path.exists():
        return []
    return [parse_record_line(line, f"{path}:{i}") for i, line in enumerate(path.read_text().splitlines(), start=1)
            if line.strip()]


def _write_atomically(path: Path, records: Sequence[Record]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write_records(tmp, records)
    os.replace(tmp, path)


def move_aside(out_dir: Path, stamp: str | None = None) -> list[Path]:
    """Move the record files of ``out_dir`` (``records.jsonl``, ``records.earlier.jsonl``) to
    timestamped names (``records-20261130-101500.jsonl`` ...) that nothing reads by default;
    returns the new paths. Nothing is deleted."""
    stamp = stamp or f"{datetime.now():%Y%m%d-%H%M%S}"
    moved = []
    for name in ("records.jsonl", EARLIER_FILE):
        src = out_dir / name
        if not src.exists():
            continue
        stem = name[: -len(".jsonl")]
        dst, n = out_dir / f"{stem}-{stamp}.jsonl", 1
        while dst.exists():
            n += 1
            dst = out_dir / f"{stem}-{stamp}-{n}.jsonl"
        os.replace(src, dst)
        moved.append(dst)
    return moved


@dataclass
class SuiteRecords:
    """What a results folder holds for a suite: the records it runs that are already there
    (``current``), and those it no longer produces (``earlier``: kept in :data:`EARLIER_FILE`)."""

    current: dict[tuple[str, int], Record]
    earlier: list[Record]


def sort_records(out_dir: Path, plans: Sequence[RunPlan]) -> SuiteRecords:
    """Split the records of ``out_dir`` (``records.jsonl`` and :data:`EARLIER_FILE`) into the
    ones ``plans`` reuse and the rest, and rewrite the two files accordingly (the earlier file
    first, then ``records.jsonl`` atomically: a crash in between leaves a record in both files,
    never in neither). Raises :class:`~trace_gym.leaderboard.records.RecordError` (with what to
    do) for a file that holds a line that is not a record."""
    records_path, earlier_path = out_dir / "records.jsonl", out_dir / EARLIER_FILE
    try:
        in_main, in_earlier = read_record_file(records_path), read_record_file(earlier_path)
    except RecordError as exc:
        raise RecordError(exc.where, exc.field, f"{exc.problem}; fix or remove that line, or re-run with --fresh to move "
                                                f"the folder's records aside (nothing is deleted)") from None
    wanted = {(p.config_hash, p.seed) for p in plans}
    current: dict[tuple[str, int], Record] = {}
    earlier: list[Record] = []
    seen: set[str] = set()
    for r in in_main + in_earlier:
        if r.digest in seen:
            continue
        seen.add(r.digest)
        key = (r.config_hash, r.seed)
        if key in wanted and key not in current:
            current[key] = r
        else:
            earlier.append(r)
    kept_main = [r for r in in_main if current.get((r.config_hash, r.seed)) is r]
    if [r.digest for r in earlier] != [r.digest for r in in_earlier]:
        _write_atomically(earlier_path, earlier)
    if len(kept_main) != len(in_main) or len(current) != len(kept_main):
        order = {(p.config_hash, p.seed): i for i, p in enumerate(plans)}
        _write_atomically(records_path, sorted(current.values(), key=lambda r: order[(r.config_hash, r.seed)]))
    if not earlier and earlier_path.exists() and not earlier_path.stat().st_size:
        earlier_path.unlink()
    return SuiteRecords(current, earlier)


def run_suite(spec: SuiteSpec, out_dir: Path, *, show_progress: bool = True, resume: bool = True,
              console: Any = None, fresh: bool = False, whole: SuiteSpec | None = None) -> list[Record]:
    """Run every run of ``spec`` not already in ``out_dir/records.jsonl`` and append its record.
    ``whole``: the suite ``spec`` was selected from (``--tracks``); the records of its other
    tracks stay in ``records.jsonl`` as they are, neither run nor set aside.

    Returns all records of the suite in ``out_dir`` (finished earlier and now). Nothing is
    ever deleted: records in the folder that the suite no longer produces (it changed steps,
    seeds, budget or allocators) are kept in :data:`EARLIER_FILE` and reported on ``console``;
    ``fresh=True`` (or ``resume=False``) first moves the folder's record files aside
    (:func:`move_aside`). A record file with a bad line raises
    :class:`~trace_gym.leaderboard.records.RecordError` before anything runs. Progress is a
    rich progress bar (one bar for the suite, one for the current run's steps); where
    ``console`` is not a terminal (a log file, ``nohup``), on which rich draws no bars, it is
    one line per finished step instead.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records_path = out_dir / "records.jsonl"
    console = console or Console(stderr=True)
    plans = plan_suite(spec)
    mine = {(p.config_hash, p.seed) for p in plans}
    others = [p for p in plan_suite(whole) if (p.config_hash, p.seed) not in mine] if whole is not None else []
    if fresh or not resume:
        for path in move_aside(out_dir):
            console.print(f"--fresh: moved the earlier records to {path}", highlight=False, soft_wrap=True)
    found = sort_records(out_dir, plans + others)
    done = found.current
    if found.earlier:
        console.print(f"kept {len(found.earlier)} earlier record(s) that this suite no longer runs (other seeds, steps, "
                      f"budget or allocators) in {out_dir / EARLIER_FILE}: not ranked; see them with "
                      f"`trace-gym leaderboard show {out_dir / EARLIER_FILE}`", highlight=False, soft_wrap=True)
    run_id = out_dir.name
    where = provenance()
    todo = [p for p in plans if (p.config_hash, p.seed) not in done]
    records: list[Record] = [done[(p.config_hash, p.seed)] for p in plans if (p.config_hash, p.seed) in done]
    caches: dict[str, dict] = {}
    # rich draws bars only on a terminal; a log file would show nothing for hours of a long row
    plain = show_progress and not console.is_terminal
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=console, disable=not show_progress, transient=False) as progress:
        total_steps = sum(p.track.steps for p in todo)
        suite_bar = progress.add_task(f"suite {spec.suite}", total=total_steps)
        for plan in todo:
            run_bar = progress.add_task(plan.label, total=plan.track.steps)

            def on_step(step: int, _bar=run_bar, _plan=plan, _t0=time.perf_counter()) -> None:
                progress.advance(_bar)
                progress.advance(suite_bar)
                if plain:
                    console.print(f"{_plan.label}: step {step + 1}/{_plan.track.steps} done "
                                  f"({time.perf_counter() - _t0:.0f} s)", highlight=False, soft_wrap=True)

            cache = caches.setdefault(plan.track.name, {"progress": progress, "console": console, "plain": plain})
            runner = run_allocation if plan.track.kind == "allocation" else run_training
            result = runner(plan.track, plan.env, plan.alloc, plan.seed, cache, on_step)
            share = result.final.get("failed_share")
            if share:
                spent = sum(s.trajectories for s in result.steps)
                console.print(f"[yellow]warning:[/yellow] {plan.label}: {share * spent:.0f} of {spent} trajectories failed (counted "
                              f"as spent; the table's 'failed' column)" + (": " + " | ".join(result.errors) if result.errors else ""),
                              highlight=False, soft_wrap=True)
            record = _seal(spec, plan, result, run_id, where)
            write_records(records_path, [record], append=True)
            records.append(record)
            progress.remove_task(run_bar)
    return records


__all__ = [
    "ALLOCATION_FINAL", "EARLIER_FILE", "OWN_NODE_CALIBRATION", "RolloutSource", "SHARED_CALIBRATION", "SuiteRecords",
    "allocation_step", "calibration_metrics", "failed_share", "move_aside", "register_shared_evaluation", "shared_calibration",
    "read_record_file", "sort_records", "row_spec", "record_metrics", "step_record", "RunPlan", "RunResult", "TRAINING_FINAL", "eval_steps", "training_final",
    "mean_metrics", "preflight", "make_source", "plan_suite",
    "register_source", "register_training_runner", "resolve_advantage", "resolve_predictor", "row_config", "run_allocation", "run_suite", "run_training",

]
