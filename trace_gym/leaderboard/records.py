"""Leaderboard records: one JSON line per (track, env, allocator, seed) run, and the rules
for merging and ranking them.

A record carries its provenance (config hash, package versions, git commit, host, CPU), the
budget it was given and what it spent, its metrics per step and its final metrics, and a
``digest`` over everything else, so a record edited by hand after it was written is caught.

Loading (:func:`load_records`) refuses anything that is not a record as written: a line
that is not JSON, a missing or unknown field, a value of the wrong type, a budget that does
not add up (steps that spend more than the per-step budget, spent totals that are not the
sum of the steps), or a digest that does not match. Every refusal names the record
(``file:line``) and the field.

Ranking (:func:`rank`) is per *group*: records of the same track kind, env (with its
kwargs) and policy compete. Within a group, every allocator must have spent the same
trajectories over the same seeds, and in training groups every row of a seed must have been
evaluated last on as many held-out tasks with as many samples each (``tasks``, ``k``);
otherwise :class:`UnequalBudget` is raised with the rows that differ. Allocation groups rank by effective sample ratio, training groups by final
held-out accuracy.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, ClassVar, Iterable, Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

SCHEMA = "trace-gym/leaderboard-record/1"

RANK_METRIC = {"allocation": "effective_sample_ratio/grpo", "training": "accuracy"}
"""The final metric each track kind ranks by (higher is better)."""

TABLE_METRICS = {
    "allocation": ["effective_sample_ratio/grpo", "effective_sample_ratio", "effective_ratio", "effective_token_ratio",
                   "branch_flip_rate", "auc_prefix", "auc_root", "brier_prefix", "brier_root", "brier", "ece", "auc", "failed_share"],
    "training": ["accuracy", "accuracy_gain", "pass_at_k", "effective_ratio", "prompts", "mixed_prompts",
                 "effective_sample_ratio", "branch_flip_rate", "reward_mean", "failed_share"],
}
"""Final metrics shown in leaderboard tables, per track kind (absent ones are skipped).
Calibration comes in two kinds: ``auc_prefix``/``auc_root``/``brier_prefix``/``brier_root``,
the predictor after its run on an evaluation set every row of the env and seed shares
(ContrastLab; records also carry the set's Bayes-optimal ``bayes_auc_*`` and its node counts
``eval_prefixes``/``eval_roots``), and ``brier``/``ece``/``auc``, over the nodes each row
predicted during its run (other envs, and ContrastLab records written before the shared set):
rows choose their own nodes, so those are labelled "own nodes" and are not comparable
between rows."""

PROMPT_COUNTS = ("prompts", "mixed_prompts")
"""Metrics every record gets from its steps (:func:`prompt_counts`), records written before
they existed included."""

LOWER_IS_BETTER = {"brier", "ece", "brier_prefix", "brier_root", "failed_share"}


class RecordError(ValueError):
    """A record that cannot be used; ``str()`` is ``file:line: field: problem``."""

    def __init__(self, where: str, field: str, problem: str):
        self.where, self.field, self.problem = where, field, problem
        super().__init__(f"{where}: field {field!r}: {problem}" if field else f"{where}: {problem}")


class UnequalBudget(ValueError):
    """Allocators of one group spent different trajectories, or (training) were evaluated on
    different held-out sets; the message lists the rows."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    _unrecorded_when_empty: ClassVar[tuple[str, ...]] = ()
    """Fields added after records were first written: left out of the JSON while empty, so a
    record written before a field existed reads back as the line it was and keeps its digest."""

    @model_serializer(mode="wrap")
    def _without_unrecorded_fields(self, handler):
        data = handler(self)
        for name in self._unrecorded_when_empty:
            if not data.get(name):
                data.pop(name, None)
        return data


class BudgetRecord(_Strict):
    """The budget a run was given: trajectories per step (M), steps, candidate prompts per step."""

    trajectories_per_step: int = Field(ge=1)
    steps: int = Field(ge=1)
    candidates: int = Field(ge=1)
    root_fraction: float = Field(gt=0.0, le=1.0)
    min_per_prompt: int = Field(ge=1)
    group_size: int = Field(ge=1)


class Spent(_Strict):
    """What a run spent in total: trajectories, generated tokens, wall-clock seconds."""

    trajectories: int = Field(ge=0)
    tokens: int = Field(ge=0)
    wall_s: float = Field(ge=0.0)


class StepRecord(_Strict):
    """One step: what it spent and its metrics (``None`` where a metric is undefined)."""

    step: int = Field(ge=0)
    trajectories: int = Field(ge=0)
    tokens: int = Field(ge=0)
    metrics: dict[str, float | None] = Field(default_factory=dict)
    generated: str = Field(default="", pattern=r"^([0-9a-f]{16})?$")
    """The step's forest's :meth:`~trace_gym.forest.forest.Forest.fingerprint`: equal in two
    records exactly when the step generated the same, to the token (``trace-gym leaderboard
    compare``). Empty in records written before it was recorded, and then left out of the
    JSON, so those keep their digest."""

    _unrecorded_when_empty = ("generated",)


class EvalPoint(_Strict):
    """A held-out evaluation after ``step`` steps, with the cumulative spend at that point."""

    step: int = Field(ge=0)
    trajectories: int = Field(ge=0)
    tokens: int = Field(ge=0)
    accuracy: float = Field(ge=0.0, le=1.0)
    pass_at_k: float | None = Field(default=None, ge=0.0, le=1.0)
    k: int = Field(default=1, ge=1)
    tasks: int = Field(ge=1)
    task_scores: list[Annotated[float, Field(ge=0.0, le=1.0)]] = Field(default_factory=list)
    """Each held-out task's own mean reward over its ``k`` episodes, in task order (their mean
    is ``accuracy``): what :mod:`~trace_gym.leaderboard.paired` pairs two rows of one seed on.
    Empty where the run's evaluation has no sampling noise to pair (ContrastLab's exact
    values) and in records written before it was recorded, and then left out of the JSON, so
    those keep their digest."""

    _unrecorded_when_empty = ("task_scores",)

    @staticmethod
    def scores_problem(scores: Sequence[float], tasks: int, accuracy: float) -> str | None:
        """Why ``scores`` cannot be the ``task_scores`` of an evaluation of ``tasks`` tasks
        with mean ``accuracy`` (another count, another mean), or ``None`` where they can. The
        record validator refuses such scores by field; a runner that builds an evaluation
        asks first and leaves them out, so that a run never loses its record over them."""
        if len(scores) != tasks:
            return f"{len(scores)} scores for {tasks} tasks"
        mean = math.fsum(scores) / tasks
        if abs(mean - accuracy) > 1e-9:
            return f"their mean ({mean:.6f}) is not the accuracy ({accuracy:.6f})"
        return None


class Record(_Strict):
    """One run of one allocator on one env with one seed. See the module docstring."""

    schema_: Literal["trace-gym/leaderboard-record/1"] = Field(alias="schema")
    run: str
    suite: str
    track: str
    kind: Literal["allocation", "training"]
    env: str
    env_id: str
    env_kwargs: dict[str, Any]
    allocator: str
    allocator_name: str
    allocator_kwargs: dict[str, Any]
    policy: dict[str, Any]
    predictor: str | None
    advantage: str
    seed: int
    group: str
    config_hash: str
    budget: BudgetRecord
    spent: Spent
    steps: list[StepRecord]
    evals: list[EvalPoint]
    final: dict[str, float | None]
    versions: dict[str, str]
    git_commit: str
    host: str
    created: str
    digest: str
    cpu: dict[str, str] = Field(default_factory=dict)
    """The host CPU (:func:`trace_gym.provenance.cpu_info`); empty in records written before it
    was recorded, and then left out of the JSON, so those keep their digest."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    _unrecorded_when_empty = ("cpu",)

    @model_validator(mode="after")
    def _budget_adds_up(self) -> "Record":
        b = self.budget
        if len(self.steps) != b.steps:
            raise _FieldProblem("steps", f"{len(self.steps)} steps recorded, but budget.steps is {b.steps}")
        for i, s in enumerate(self.steps):
            if s.step != i:
                raise _FieldProblem(f"steps[{i}].step", f"expected step {i}, found {s.step}")
            if s.trajectories > b.trajectories_per_step:
                raise _FieldProblem(f"steps[{i}].trajectories",
                                    f"{s.trajectories} trajectories exceed budget.trajectories_per_step = {b.trajectories_per_step}")
        total = sum(s.trajectories for s in self.steps)
        if total != self.spent.trajectories:
            raise _FieldProblem("spent.trajectories", f"{self.spent.trajectories} does not equal the sum over steps ({total})")
        tokens = sum(s.tokens for s in self.steps)
        if tokens != self.spent.tokens:
            raise _FieldProblem("spent.tokens", f"{self.spent.tokens} does not equal the sum over steps ({tokens})")
        last = (-1, 0, 0)
        for i, e in enumerate(self.evals):
            if e.step > b.steps or e.trajectories > self.spent.trajectories or e.tokens > self.spent.tokens:
                raise _FieldProblem(f"evals[{i}]", "evaluated after more steps or spend than the run has")
            if (e.step, e.trajectories, e.tokens) < last or e.trajectories < last[1] or e.tokens < last[2]:
                raise _FieldProblem(f"evals[{i}]", "evaluations must be in order of step and cumulative spend")
            last = (e.step, e.trajectories, e.tokens)
            if e.task_scores and (problem := EvalPoint.scores_problem(e.task_scores, e.tasks, e.accuracy)):
                raise _FieldProblem(f"evals[{i}].task_scores", problem)
        if self.kind == "training" and not self.evals:
            raise _FieldProblem("evals", "a training record needs at least one held-out evaluation")
        return self

    # ------------------------------------------------------------------ helpers

    def content_digest(self) -> str:
        """sha256 over the record's canonical JSON without ``digest``."""
        return compute_digest(self.model_dump(mode="json", by_alias=True))

    def to_json(self) -> str:
        """One JSONL line (no trailing newline)."""
        return json.dumps(self.model_dump(mode="json", by_alias=True), sort_keys=True, allow_nan=False)

    @property
    def row_key(self) -> tuple[str, str]:
        """(group, allocator): the leaderboard row this record belongs to."""
        return (self.group, self.allocator)


class _FieldProblem(ValueError):
    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"{field}: {problem}")


def compute_digest(data: dict[str, Any]) -> str:
    """The digest of a record's JSON data (``digest`` itself excluded)."""
    body = {k: v for k, v in data.items() if k != "digest"}
    blob = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def clean_metric(x: Any) -> float | None:
    """A metric as JSON can hold it: float, or ``None`` for undefined (NaN, inf, missing)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def make_record(**fields: Any) -> Record:
    """Build a record from its fields (everything but ``schema``, ``created`` and
    ``digest``, which are filled in) and seal it with its digest."""
    data = dict(fields)
    data["schema"] = SCHEMA
    data.setdefault("created", datetime.now(timezone.utc).isoformat(timespec="seconds"))
    data["digest"] = ""
    rec = Record.model_validate(data)
    sealed = rec.model_dump(mode="json", by_alias=True)
    sealed["digest"] = compute_digest(sealed)
    return Record.model_validate(sealed)


# ----------------------------------------------------------------------------- reading / writing


def write_records(path: Path, records: Iterable[Record], *, append: bool = False) -> None:
    """Write records as JSONL (one per line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a" if append else "w") as fh:
        for r in records:
            fh.write(r.to_json() + "\n")


def _records_file(p: Path) -> Path:
    if p.is_dir():
        f = p / "records.jsonl"
        if not f.is_file():
            raise RecordError(str(p), "", "this run folder has no records.jsonl")
        return f
    if not p.is_file():
        raise RecordError(str(p), "", "no such run folder or records file")
    return p


def _field_of(err: dict[str, Any]) -> str:
    out = ""
    for part in err["loc"]:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def parse_record_line(line: str, where: str) -> Record:
    """Parse and check one JSONL line; raises :class:`RecordError` naming ``where`` and the field."""
    try:
        data = json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"{c} is not JSON")))
    except ValueError as exc:
        raise RecordError(where, "", f"not a JSON record ({exc})") from None
    if not isinstance(data, dict):
        raise RecordError(where, "", f"a record is a JSON object, got {type(data).__name__}")
    if data.get("schema") != SCHEMA:
        raise RecordError(where, "schema", f"expected {SCHEMA!r}, got {data.get('schema')!r}")
    try:
        rec = Record.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, _FieldProblem):
            raise RecordError(where, cause.field, cause.problem) from None
        field = _field_of(err)
        problem = {"missing": "missing", "extra_forbidden": "not a field of the record schema"}.get(err["type"], err["msg"])
        more = f" (and {len(exc.errors()) - 1} more problems)" if len(exc.errors()) > 1 else ""
        raise RecordError(where, field, problem + more) from None
    if data.get("digest") != compute_digest(data):
        raise RecordError(where, "digest", "does not match the record's content: it was changed after it was written")
    return rec


@dataclass
class LoadedRecord:
    """A record and where it came from (``file:line``)."""

    record: Record
    where: str


def load_records(paths: Sequence[str | Path]) -> list[LoadedRecord]:
    """Read records from run folders or JSONL files, refusing any bad record or duplicate.

    The same record (same digest) read twice is kept once, so merging a run with a merge
    that already holds it is harmless; two different records for the same group, allocator
    and seed are refused (which one to keep is the user's call).
    """
    out: list[LoadedRecord] = []
    seen_digest: set[str] = set()
    seen_key: dict[tuple[str, str, int], str] = {}
    for p in paths:
        f = _records_file(Path(p))
        for i, line in enumerate(f.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{f}:{i}"
            rec = parse_record_line(line, where)
            if rec.digest in seen_digest:
                continue
            key = (rec.group, rec.allocator, rec.seed)
            if key in seen_key:
                raise RecordError(where, "seed", f"a different record for allocator {rec.allocator!r}, seed {rec.seed} "
                                                 f"in the same group is already at {seen_key[key]}; keep one of them")
            seen_digest.add(rec.digest)
            seen_key[key] = where
            out.append(LoadedRecord(rec, where))
    if not out:
        raise RecordError(", ".join(map(str, paths)), "", "no records found")
    return out


# ----------------------------------------------------------------------------- ranking


@dataclass
class Row:
    """One leaderboard row: an allocator's records in a group, aggregated over seeds."""

    allocator: str
    records: list[LoadedRecord]
    rank: int = 0
    mean: dict[str, float | None] = field(default_factory=dict)
    std: dict[str, float | None] = field(default_factory=dict)

    @property
    def seeds(self) -> list[int]:
        """The row's seeds, sorted."""
        return sorted(r.record.seed for r in self.records)

    @property
    def trajectories(self) -> int:
        """Trajectories spent, summed over seeds."""
        return sum(r.record.spent.trajectories for r in self.records)

    @property
    def tokens(self) -> int:
        """Generated tokens spent, summed over seeds."""
        return sum(r.record.spent.tokens for r in self.records)

    def spend_by_seed(self) -> list[tuple[int, int]]:
        """``(seed, trajectories spent)`` for each of the row's records, by seed."""
        return sorted((r.record.seed, r.record.spent.trajectories) for r in self.records)


@dataclass
class Group:
    """Records that compete: same track kind, env and policy. Rows sorted by rank."""

    key: str
    kind: str
    env: str
    track: str
    policy: dict[str, Any]
    budget: BudgetRecord
    rows: list[Row]

    @property
    def rank_metric(self) -> str:
        """The metric the group's rows are ranked by (it depends on the track kind)."""
        return RANK_METRIC[self.kind]

    @property
    def title(self) -> str:
        """``track / env (kind, policy model)``, the heading of the group's table."""
        model = self.policy.get("model") or self.policy.get("name")
        return f"{self.track} / {self.env} ({self.kind}, policy {model})"


def group_key(kind: str, env_id: str, env_kwargs: dict[str, Any], policy: dict[str, Any]) -> str:
    """The key under which records compete (budget and steps deliberately excluded: they are
    what the equal-budget check compares)."""
    blob = json.dumps({"kind": kind, "env": env_id, "env_kwargs": env_kwargs, "policy": policy}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def prompt_counts(record: Record) -> dict[str, float | None]:
    """A run's prompts a step and, of them, those whose tree held both a success and a
    failure (``mixed_prompts``: the step's prompts times its effective ratio, the count that
    ratio was taken over), each a mean over the steps that record both; None where none do.
    Under grpo's advantage these are the prompts whose trajectories move the policy."""
    pairs = [(s.metrics.get("prompts"), s.metrics.get("effective_ratio")) for s in record.steps]
    pairs = [(p, e) for p, e in pairs if p is not None and e is not None]
    if not pairs:
        return {m: None for m in PROMPT_COUNTS}
    return {"prompts": float(np.mean([p for p, _ in pairs])),
            "mixed_prompts": float(np.mean([round(p * e) for p, e in pairs]))}


def _aggregate(values: list[float | None]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    return float(np.mean(vals)), float(np.std(vals))


def check_equal_budget(group: Group) -> None:
    """Raise :class:`UnequalBudget` unless every row spent the same trajectories per seed,
    over the same seeds. The message lists each row's spend and where its records are."""
    spends = {row.allocator: row.spend_by_seed() for row in group.rows}
    if len({tuple(s) for s in spends.values()}) <= 1:
        return
    ref = max(spends.values(), key=lambda s: sum(1 for x in spends.values() if x == s))
    lines = [f"refusing to rank {group.title}: allocators spent different trajectories "
             f"(an equal-budget comparison needs the same trajectories per seed, over the same seeds):"]
    for row in group.rows:
        s = spends[row.allocator]
        mark = "  " if s == ref else "!!"
        per_seed = ", ".join(f"seed {seed}: {t}" for seed, t in s)
        files = ", ".join(r.where for r in row.records)
        lines.append(f"  {mark} {row.allocator}: {per_seed} (total {row.trajectories}; records {files})")
    lines.append("Re-run the differing rows at the same budget, or show those runs separately (trace-gym leaderboard show "
                 "--seeds or --allocators keeps the records that match).")
    raise UnequalBudget("\n".join(lines))


def check_equal_evaluation(group: Group) -> None:
    """Raise :class:`UnequalBudget` unless, on every seed, every row of a training group was
    evaluated last on as many held-out tasks with as many samples each: the first ``tasks``
    tasks of a split, so another count is another test set, and another ``k`` another noise
    and pass@k. Allocation groups have no evaluation and always pass."""
    if group.kind != "training":
        return
    seen: dict[int, dict[tuple[int, int], list[str]]] = {}
    for row in group.rows:
        for lr in row.records:
            if lr.record.evals:
                last = lr.record.evals[-1]  # in step order: the record's validator checks it
                seen.setdefault(lr.record.seed, {}).setdefault((last.tasks, last.k), []).append(f"{row.allocator} ({lr.where})")
    unequal = {seed: by for seed, by in sorted(seen.items()) if len(by) > 1}
    if not unequal:
        return
    lines = [f"refusing to rank {group.title}: rows of one seed were evaluated on different held-out sets "
             f"(their accuracies compare only on the same tasks, sampled as often):"]
    for seed, by in unequal.items():
        for (tasks, k), rows in sorted(by.items()):
            lines.append(f"  seed {seed}: {tasks} tasks x k = {k}: {', '.join(rows)}")
    lines.append("Re-run the differing rows with the same eval settings, or show those runs separately (trace-gym "
                 "leaderboard show --seeds or --allocators keeps the records that match).")
    raise UnequalBudget("\n".join(lines))


def rank(records: Sequence[LoadedRecord], *, check: bool = True) -> list[Group]:
    """Group records, check equal budgets and (training) evaluations (unless ``check=False``:
    :func:`check_equal_budget`, :func:`check_equal_evaluation`) and rank rows in each group.

    Raises :class:`UnequalBudget` naming the group and rows that differ.
    """
    by_group: dict[str, list[LoadedRecord]] = {}
    for lr in records:
        by_group.setdefault(lr.record.group, []).append(lr)
    groups = []
    for key, recs in by_group.items():
        first = recs[0].record
        rows_by_alloc: dict[str, list[LoadedRecord]] = {}
        for lr in recs:
            rows_by_alloc.setdefault(lr.record.allocator, []).append(lr)
        rows = [Row(a, rs) for a, rs in rows_by_alloc.items()]
        for row in rows:
            finals = [{**prompt_counts(r.record), **r.record.final} for r in row.records]
            for m in sorted({m for f in finals for m in f}):
                row.mean[m], row.std[m] = _aggregate([f.get(m) for f in finals])
        group = Group(key, first.kind, first.env, first.track, first.policy, first.budget, rows)
        if check:
            check_equal_budget(group)
            check_equal_evaluation(group)
        metric = group.rank_metric
        score = lambda r: r.mean.get(metric) if r.mean.get(metric) is not None else -math.inf  # noqa: E731
        rows.sort(key=lambda r: (-score(r), r.allocator))
        for row in rows:  # equal scores share a rank (1, 1, 3, ...)
            row.rank = 1 + sum(1 for other in rows if score(other) > score(row))
        groups.append(group)
    groups.sort(key=lambda g: (g.kind != "allocation", g.track, g.env))
    return groups


__all__ = [
    "BudgetRecord", "EvalPoint", "Group", "LOWER_IS_BETTER", "LoadedRecord", "RANK_METRIC", "Record", "RecordError", "Row",
    "PROMPT_COUNTS", "SCHEMA", "Spent", "StepRecord", "TABLE_METRICS", "UnequalBudget", "check_equal_budget", "check_equal_evaluation", "clean_metric",
    "compute_digest", "group_key", "load_records", "make_record", "parse_record_line", "prompt_counts", "rank", "write_records",
]
