"""The allocation bench: allocators side by side on ContrastLab at an equal budget.

Every allocator runs the same :class:`~trace_gym.run.RunSpec` but for its allocator: the
same world (``trace_gym/ContrastLab-v0`` with the bench's settings), the same candidate
prompts at each step, the same budget and seed, its own predictor and advantage (the
allocator's own unless the bench names one for all), one :class:`~trace_gym.step.Step` per
step on the simulator's fast path. In learning mode (``learn > 0``) the simulated policy
also takes a REINFORCE step on the forest's advantages after each step
(:class:`~trace_gym.sim.learning.SimLearning` with ``lr = learn``, ``shared_lr`` and
``normalize``: scale-free and charged for waste by default).

Figures per allocator (means over steps unless noted):

* ``effective_ratio``: share of prompts with rollouts whose tree is mixed
  (``effective_ratio_last_third``: the same over the last third of the steps);
* ``effective_sample_ratio``: share of trajectories, and of generated tokens, with a
  non-zero advantage under the run's estimator (``advantage`` says which);
  ``effective_sample_ratio_by_advantage`` gives them under ``grpo`` and ``trace`` too;
* ``trajectories``, ``tokens``, ``prompts``: spent per step;
* ``calibration``: the run's predictor after its last update, scored on the bench's one
  evaluation set (:mod:`trace_gym.sim.evaluation`: the same histories for every allocator),
  ``{"roots": {"auc", "brier", "brier_excess", "n"}, "prefixes": {...}}`` against the exact
  V; an oracle allocator is scored with the exact values; ``None`` for allocators that
  predict nothing. ``auc``/``brier`` are the prefixes' figures (``None`` likewise);
* ``own_nodes``: the same scores over the predictions the allocator made during its run
  (nodes it chose, so not comparable between allocators; kept for diagnosis);
* ``in_run_auc``: ``{"nodes", "roots"}``, the step means of the trainer's
  ``predictor/auc`` and ``predictor/root_auc``: each step's predictions on the nodes it
  sampled, made before the predictor saw their outcomes, against their backed-up values
  (as a real run logs them; ``None`` without a predictor);
* ``branch_flips``: ``{"flip_rate", "pure_trees_mixed"}``, the step means of how often a
  branch in a tree whose root rollouts agreed ended with the other outcome, and how often
  such a tree ended mixed (:meth:`~trace_gym.forest.forest.Forest.branch_flips`; ``None``
  for allocators that never branch);
* ``disagreement``: ``{"root_pred", "root_seen", "inner_pred", "inner_seen"}``, the step means
  of stage 2's calibration (:func:`trace_gym.step.disagreement_metrics`: continuations from
  pure prefixes, the predictor's chance that one disagrees with what the prefix had shown and
  the share that did; ``root``: fresh rollouts of a still-pure prompt, ``inner``: turn-level
  prefixes; ``None`` where the run had none);
* ``ms_per_step``: the allocator's own time (rollouts excluded);
* ``steps``: per-step effective ratio, effective sample ratio and spend;
* in learning mode, ``final_success``/``final_test_success`` and ``curve``: held-out
  accuracy (exact mean success of the test tasks) and cumulative trajectories and tokens
  after every step.

The result's ``evaluation`` holds the evaluation set's reference predictors (exact V, the
Bayes-optimal posterior given the history, the same without the answer key, the regex on
the last observation) in the same form. Rows are labelled by :func:`trace_gym.run.row_label`:
a run-wide ``predictor``/``advantage`` that replaces an allocator's own shows in its name.
In learning mode every run's policy differs, so its calibration is scored on an evaluation
set drawn from its own final policy (with the same prompts and seed).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from trace_gym.predictors.calibration import auc, brier
from trace_gym.run import ComponentSpec, RunSpec, check_advantage, check_allocator, check_predictor, row_label
from trace_gym.sim.difficulty import DEFAULT_DIFFICULTY, parse_difficulty
from trace_gym.sim.evaluation import EvaluationSet, evaluation_set, summary_line
from trace_gym.sim.source import SimSource
from trace_gym.sim.world import ContrastLabWorld
from trace_gym.step import DISAGREEMENT, Step, disagreement_metric

DEFAULT_ALLOCATORS = "grpo,uniform,trace,trace:stage1=uniform,trace:stage2=uniform,dapo,pcl,knapsack,greso,vip,oracle,oracle-er"

REPORTED_ADVANTAGES = ("grpo", "trace", "treerl", "tree_grpo")
"""Estimators under which every row's effective sample ratio is reported (a scaled ``trace``
has the non-zero pattern of ``trace``, hence the same ratio)."""


@dataclass
class BenchConfig:
    """What the bench runs. ``trajectories`` is M and ``prompts`` B (as in
    :class:`~trace_gym.run.BudgetSpec`); ``tasks`` the train tasks of the world (a quarter as
    many held-out ones); ``world`` other :class:`~trace_gym.sim.world.ContrastLabWorld`
    settings; ``predictor``/``advantage`` None: each allocator's own; ``learn``,
    ``shared_lr``, ``normalize``, ``prefix_weight``: the learning mode's step (``learn = 0``:
    a frozen policy; :class:`~trace_gym.sim.learning.SimLearning`);
    ``eval_prompts``/``eval_rollouts``: the size of the one evaluation set."""

    allocators: list[str] = field(default_factory=lambda: DEFAULT_ALLOCATORS.split(","))
    difficulty: str = DEFAULT_DIFFICULTY
    steps: int = 30
    prompts: int = 512
    trajectories: int = 1024
    tasks: int = 2048
    seed: int = 0
    predictor: str | None = None
    advantage: str | None = None
    root_fraction: float = 0.5
    min_per_prompt: int = 2
    group_size: int = 8
    learn: float = 0.0
    shared_lr: float = 0.1
    normalize: bool = True
    prefix_weight: float = 0.0
    world: dict[str, Any] = field(default_factory=dict)
    eval_prompts: int = 512
    eval_rollouts: int = 4

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        if not self.allocators:
            raise ValueError("--allocators: give at least one allocator")
        for name, value, low in (("--steps", self.steps, 1), ("--prompts", self.prompts, 1), ("--trajectories", self.trajectories, 1),
                                 ("--tasks", self.tasks, 1), ("--group-size", self.group_size, 1),
                                 ("--min-per-prompt", self.min_per_prompt, 1), ("eval_prompts", self.eval_prompts, 1),
                                 ("eval_rollouts", self.eval_rollouts, 1)):
            if value < low:
                raise ValueError(f"{name} must be at least {low}, got {value}")
        if self.prompts > self.tasks:
            raise ValueError(f"--prompts ({self.prompts}) cannot exceed --tasks ({self.tasks})")
        if not 0 < self.root_fraction <= 1:
            raise ValueError(f"--root-fraction must be in (0, 1], got {self.root_fraction}")
        if self.learn < 0:
            raise ValueError(f"--learn must be >= 0, got {self.learn}")
        parse_difficulty(self.difficulty)
        import inspect

        allowed = set(inspect.signature(ContrastLabWorld).parameters) - {"n_tasks", "n_test", "difficulty", "seed"}
        unknown = sorted(set(self.world) - allowed)
        if unknown:
            raise ValueError(f"--world: unknown setting {unknown[0]!r} (settings: {', '.join(sorted(allowed))})")
        if self.advantage is not None:
            check_advantage(ComponentSpec.model_validate(self.advantage))
        for spec in self.allocators:
            check_allocator(ComponentSpec.model_validate(spec))
        if self.predictor:
            check_predictor(ComponentSpec.model_validate(self.predictor))

    def world_kwargs(self) -> dict[str, Any]:
        """The ContrastLab env kwargs of every run of the bench."""
        return {"n_tasks": self.tasks, "n_test": max(1, self.tasks // 4), "difficulty": self.difficulty, **self.world}

    def label(self, allocator: str) -> str:
        """The row name of ``allocator`` in this bench (:func:`~trace_gym.run.row_label`)."""
        return row_label(allocator, predictor=self.predictor, advantage=self.advantage)

    def run_spec(self, allocator: str) -> RunSpec:
        """The run of one allocator."""
        return RunSpec.model_validate({
            "envs": [{"id": "trace_gym/ContrastLab-v0", "kwargs": self.world_kwargs()}], "policy": "sim",
            "allocator": allocator, "predictor": self.predictor, "advantage": self.advantage, "seed": self.seed,
            "budget": {"trajectories": self.trajectories, "prompts": self.prompts, "root_fraction": self.root_fraction,
                       "min_per_prompt": self.min_per_prompt, "group_size": self.group_size},
        })


def predictor_calibration(step: Step, eval_set: EvaluationSet) -> dict[str, Any] | None:
    """The calibration of ``step``'s predictor, in its current state, on ``eval_set``
    (:meth:`EvaluationSet.score`: roots and prefixes apart, against the exact V): an oracle
    allocator (``reads_oracle``) is scored with the exact values, a run without a predictor
    gets ``None``. The bench and the leaderboard's ContrastLab rows both score this way."""
    if getattr(step.allocator, "reads_oracle", False):
        return eval_set.score(eval_set.truth[eval_set.roots], eval_set.truth[eval_set.prefixes])
    if step.predictor is not None:
        return eval_set.predict(step.predictor)
    return None


def run_allocator(spec: str, world: ContrastLabWorld, config: BenchConfig,
                  on_step: Callable[[], None] | None = None, eval_set: EvaluationSet | None = None) -> dict[str, Any]:
    """Run one allocator for ``config.steps`` steps on ``world``; returns its figures. Its
    predictor is scored on ``eval_set`` at the end (learning mode: on a set drawn from the
    run's final policy)."""
    from trace_gym.sim.learning import SimLearning

    run = config.run_spec(spec)
    world = world.copy() if config.learn > 0 else world
    update = (SimLearning(world, lr=config.learn, shared_lr=config.shared_lr, normalize=config.normalize,
                          prefix_weight=config.prefix_weight) if config.learn > 0 else None)
    step = Step.from_spec(run, SimSource(world=world, seed=config.seed), update=update)
    adv_name = str(step.advantage)
    rows: dict[str, list[float]] = {}
    preds, truths = [], []
    per_step = []
    curve = [{"step": 0, "trajectories": 0, "tokens": 0, "test_success": world.mean_success("test")}] if config.learn > 0 else []
    for i in range(config.steps):
        r = step.run(i)
        m = r.metrics
        for key in ("effective_ratio", "effective_sample_ratio", "effective_token_ratio", "spent/trajectories",
                    "spent/generated_tokens", "spent/prompts", "time/allocator", "time/predictor"):
            rows.setdefault(key, []).append(float(m[key]))
        for key in ("predictor/auc", "predictor/root_auc", "branch/flip_rate", "branch/pure_trees_mixed",
                    *(disagreement_metric(kind, what) for kind, what in DISAGREEMENT)):
            if m.get(key) is not None:
                rows.setdefault(key, []).append(float(m[key]))
        for a in REPORTED_ADVANTAGES:
            if f"effective_sample_ratio/{a}" in m:
                traj, tok = m[f"effective_sample_ratio/{a}"], m[f"effective_token_ratio/{a}"]
            else:
                traj, tok = r.forest.effective_sample_ratio(r.forest.advantages(a))
            rows.setdefault(f"effective_sample_ratio/{a}", []).append(float(traj))
            rows.setdefault(f"effective_token_ratio/{a}", []).append(float(tok))
        per_step.append({"effective_ratio": m["effective_ratio"], "effective_sample_ratio": m["effective_sample_ratio"],
                         "effective_token_ratio": m["effective_token_ratio"], "trajectories": m["spent/trajectories"],
                         "tokens": m["spent/generated_tokens"], "prompts": m["spent/prompts"], "branches": m["branches"]})
        if r.predictions.size:
            preds.append(r.predictions)
            truths.append(r.truths)
        if config.learn > 0:
            curve.append({"step": i + 1, "trajectories": curve[-1]["trajectories"] + int(m["spent/trajectories"]),
                          "tokens": curve[-1]["tokens"] + int(m["spent/generated_tokens"]),
                          "test_success": world.mean_success("test")})
        if on_step is not None:
            on_step()
    p = np.concatenate(preds) if preds else np.zeros(0)
    y = np.concatenate(truths) if truths else np.zeros(0)
    mean = lambda k: float(np.mean(rows[k])) if rows.get(k) else None  # noqa: E731
    tail = rows["effective_ratio"][-max(1, len(rows["effective_ratio"]) // 3):]
    if config.learn > 0 or eval_set is None:
        eval_set = evaluation_set(world, config.eval_prompts, config.eval_rollouts)
    calib = predictor_calibration(step, eval_set)
    own = None
    if p.size:
        a = auc(p, y)
        own = {"brier": brier(p, y), "brier_excess": float(np.mean((p - y) ** 2)), "auc": None if math.isnan(a) else a,
               "n": int(p.size)}
    out = {
        "effective_ratio": mean("effective_ratio"),
        "effective_ratio_last_third": float(np.mean(tail)),
        "effective_sample_ratio": {"trajectories": mean("effective_sample_ratio"), "tokens": mean("effective_token_ratio"),
                                   "advantage": adv_name},
        "effective_sample_ratio_by_advantage": {
            a: {"trajectories": mean(f"effective_sample_ratio/{a}"), "tokens": mean(f"effective_token_ratio/{a}")}
            for a in REPORTED_ADVANTAGES
        },
        "trajectories": mean("spent/trajectories"),
        "tokens": mean("spent/generated_tokens"),
        "prompts": mean("spent/prompts"),
        "calibration": calib,
        "auc": calib["prefixes"]["auc"] if calib else None,
        "brier": calib["prefixes"]["brier"] if calib else None,
        "own_nodes": own,
        "in_run_auc": {"nodes": mean("predictor/auc"), "roots": mean("predictor/root_auc")},
        "branch_flips": {"flip_rate": mean("branch/flip_rate"), "pure_trees_mixed": mean("branch/pure_trees_mixed")},
        "disagreement": {f"{kind}_{what}": mean(disagreement_metric(kind, what)) for kind, what in DISAGREEMENT},
        "ms_per_step": 1e3 * mean("time/allocator"),
        "allocator": spec,
        "predictor": str(step.resolved.predictor_spec) if step.resolved.predictor_spec else None,
        "predictor_update_ms": 1e3 * mean("time/predictor") if step.predictor is not None else None,
        "steps": per_step,
    }
    if config.learn > 0:
        out["final_success"] = world.mean_success("train")
        out["final_test_success"] = world.mean_success("test")
        out["curve"] = curve
        out["evaluation"] = eval_set.references()
    return out


def _warm_up() -> None:
    """Compile (or load) the numba kernels a step uses, so the first allocator's timings do not include it."""
    cfg = BenchConfig(allocators=["grpo"], steps=1, prompts=4, trajectories=8, tasks=8)
    Step.from_spec(cfg.run_spec("grpo")).run(0)
    from trace_gym.allocation.solvers import solve_prefixes, solve_roots

    solve_roots(np.full(4, 0.5), 8), solve_prefixes(np.full(4, 0.5), np.zeros(4), 4)


def run_bench(config: BenchConfig, progress: Callable[[str, int], Callable[[], None]] | None = None) -> dict[str, Any]:
    """Run every allocator of ``config``; returns ``{"config": ..., "allocators": {spec: figures}}``.
    ``progress(spec, steps)`` may return a per-step callback."""
    config.validate()
    _warm_up()
    world = ContrastLabWorld(seed=config.seed, **config.world_kwargs())
    eval_set = evaluation_set(world, config.eval_prompts, config.eval_rollouts)
    results = {}
    for spec in config.allocators:
        label = config.label(spec)
        cb = progress(label, config.steps) if progress else None
        results[label] = run_allocator(spec, world, config, cb, eval_set=eval_set)
    cfg = asdict(config)
    cfg["initial_success"] = world.mean_success("train")
    return {"config": cfg, "evaluation": eval_set.references(), "allocators": results}


LEGEND = ("eff. ratio: share of sampled prompts whose tree holds a success and a failure; ESR: effective sample "
          "ratio, the share of trajectories with a non-zero advantage, under the row's own advantage (adv.) and under "
          "grpo's and trace's; tok: the same share of generated tokens; AUC roots / prefixes: the row's predictor "
          "after its run, on one evaluation set shared by every row, against the exact V (the reference line gives "
          "the Bayes-optimal AUC on the same set); ms/step: allocator time, rollouts excluded.")


def print_table(result: dict[str, Any], console: Any = None) -> None:
    """Print :func:`run_bench`'s figures as a table, the evaluation set's reference AUCs
    (exact V, Bayes-optimal, regex) beside the rows' own, and a legend."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=220)
    cfg = result["config"]
    world = "".join(f", {k}={v}" for k, v in cfg.get("world", {}).items())
    table = Table(title=f"ContrastLab, M = {cfg['trajectories']} trajectories/step, B = {cfg['prompts']} prompts, "
                        f"{cfg['steps']} steps, difficulty {cfg['difficulty']}{world}")
    cols = ["allocator", "adv.", "eff. ratio", "ESR", "ESR tok", "ESR grpo", "ESR trace", "traj/step", "prompts",
            "AUC roots", "AUC prefixes", "ms/step"]
    if cfg.get("learn", 0) > 0:
        cols.insert(-1, "test acc.")
    for col in cols:
        table.add_column(col, justify="left" if col in ("allocator", "adv.") else "right", overflow="fold")

    def f(x: Any, pct: bool = False) -> str:
        return "-" if x is None else (f"{100 * x:.1f}%" if pct else (f"{x:.3f}" if abs(x) < 10 else f"{x:,.0f}"))

    for label, r in result["allocators"].items():
        esr, by, cal = r["effective_sample_ratio"], r["effective_sample_ratio_by_advantage"], r.get("calibration") or {}
        cells = [label, esr["advantage"], f(r["effective_ratio"], True), f(esr["trajectories"], True), f(esr["tokens"], True),
                 f(by["grpo"]["trajectories"], True), f(by["trace"]["trajectories"], True), f(r["trajectories"]),
                 f(r["prompts"]), f((cal.get("roots") or {}).get("auc")), f((cal.get("prefixes") or {}).get("auc")),
                 f"{r['ms_per_step']:.1f}"]
        if cfg.get("learn", 0) > 0:
            cells.insert(-1, f(r.get("final_test_success")))
        table.add_row(*cells)
    console.print(table)
    if result.get("evaluation"):
        console.print(summary_line(result["evaluation"]))
    console.print(LEGEND, style="dim")
