"""The allocation bench: allocators side by side on ContrastLab at an equal budget.

Every allocator runs the same :class:`~trace_gym.run.RunSpec` but for its allocator: the
same world (``trace_gym/ContrastLab-v0`` with the bench's settings), the same candidate
prompts at each step, the same budget and seed, its own predictor and advantage (the
allocator's own unless the bench names one for all), one :class:`~trace_gym.step.Step` per
step on the simulator's fast path. In learning mode (``learn > 0``) the simulated policy
also takes a REINFORCE step on the forest's advantages after each step.

Figures per allocator (means over steps unless noted):

* ``effective_ratio``: share of prompts with rollouts whose tree is mixed
  (``effective_ratio_last_third``: the same over the last third of the steps);
* ``effective_sample_ratio``: share of trajectories, and of generated tokens, with a
  non-zero advantage under the run's estimator (``advantage`` says which);
  ``effective_sample_ratio_by_advantage`` gives them under ``grpo`` and ``trace`` too;
* ``trajectories``, ``tokens``, ``prompts``: spent per step;
* ``brier``, ``brier_excess``, ``auc``: calibration of every prediction the allocator made,
  pooled over steps, against the simulator's exact V of each node (``brier_excess``: the
  mean of ``(pred - V)^2``); ``None`` for allocators that predict nothing;
* ``ms_per_step``: the allocator's own time (rollouts excluded);
* ``steps``: per-step effective ratio, effective sample ratio and spend.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from trace_gym.predictors.calibration import auc, brier
from trace_gym.run import ComponentSpec, RunSpec, check_advantage, check_allocator, check_predictor
from trace_gym.sim.difficulty import DEFAULT_DIFFICULTY, parse_difficulty
from trace_gym.sim.source import SimSource
from trace_gym.sim.world import ContrastLabWorld
from trace_gym.step import Step

DEFAULT_ALLOCATORS = "grpo,uniform,trace,trace:stage1=uniform,trace:stage2=uniform,dapo,pcl,knapsack,oracle"


@dataclass
class BenchConfig:
    """What the bench runs. ``trajectories`` is M and ``prompts`` B (as in
    :class:`~trace_gym.run.BudgetSpec`); ``tasks`` the train tasks of the world (a quarter as
    many held-out ones); ``world`` other :class:`~trace_gym.sim.world.ContrastLabWorld`
    settings; ``predictor``/``advantage`` None: each allocator's own."""

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
    world: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        if not self.allocators:
            raise ValueError("--allocators: give at least one allocator")
        for name, value, low in (("--steps", self.steps, 1), ("--prompts", self.prompts, 1), ("--trajectories", self.trajectories, 1),
                                 ("--tasks", self.tasks, 1), ("--group-size", self.group_size, 1),
                                 ("--min-per-prompt", self.min_per_prompt, 1)):
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

    def run_spec(self, allocator: str) -> RunSpec:
        """The run of one allocator."""
        return RunSpec.model_validate({
            "envs": [{"id": "trace_gym/ContrastLab-v0", "kwargs": self.world_kwargs()}], "policy": "sim",
            "allocator": allocator, "predictor": self.predictor, "advantage": self.advantage, "seed": self.seed,
            "budget": {"trajectories": self.trajectories, "prompts": self.prompts, "root_fraction": self.root_fraction,
                       "min_per_prompt": self.min_per_prompt, "group_size": self.group_size},
        })


def run_allocator(spec: str, world: ContrastLabWorld, config: BenchConfig,
                  on_step: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run one allocator for ``config.steps`` steps on ``world``; returns its figures."""
    from trace_gym.sim.learning import SimLearning

    run = config.run_spec(spec)
    world = world.copy() if config.learn > 0 else world
    update = SimLearning(world, lr=config.learn, shared_lr=config.shared_lr) if config.learn > 0 else None
    step = Step.from_spec(run, SimSource(world=world, seed=config.seed), update=update)
    adv_name = str(step.advantage)
    rows: dict[str, list[float]] = {}
    preds, truths = [], []
    per_step = []
    for i in range(config.steps):
        r = step.run(i)
        m = r.metrics
        for key in ("effective_ratio", "effective_sample_ratio", "effective_token_ratio", "spent/trajectories",
                    "spent/generated_tokens", "spent/prompts", "time/allocator", "time/predictor",
                    "effective_sample_ratio/grpo", "effective_token_ratio/grpo", "effective_sample_ratio/trace",
                    "effective_token_ratio/trace"):
            rows.setdefault(key, []).append(float(m[key]))
        per_step.append({"effective_ratio": m["effective_ratio"], "effective_sample_ratio": m["effective_sample_ratio"],
                         "effective_token_ratio": m["effective_token_ratio"], "trajectories": m["spent/trajectories"],
                         "tokens": m["spent/generated_tokens"], "prompts": m["spent/prompts"], "branches": m["branches"]})
        if r.predictions.size:
            preds.append(r.predictions)
            truths.append(r.truths)
        if on_step is not None:
            on_step()
    p = np.concatenate(preds) if preds else np.zeros(0)
    y = np.concatenate(truths) if truths else np.zeros(0)
    mean = lambda k: float(np.mean(rows[k])) if rows.get(k) else None  # noqa: E731
    tail = rows["effective_ratio"][-max(1, len(rows["effective_ratio"]) // 3):]
    out = {
        "effective_ratio": mean("effective_ratio"),
        "effective_ratio_last_third": float(np.mean(tail)),
        "effective_sample_ratio": {"trajectories": mean("effective_sample_ratio"), "tokens": mean("effective_token_ratio"),
                                   "advantage": adv_name},
        "effective_sample_ratio_by_advantage": {
            a: {"trajectories": mean(f"effective_sample_ratio/{a}"), "tokens": mean(f"effective_token_ratio/{a}")} for a in ("grpo", "trace")
        },
        "trajectories": mean("spent/trajectories"),
        "tokens": mean("spent/generated_tokens"),
        "prompts": mean("spent/prompts"),
        "brier": brier(p, y) if p.size else None,
        "brier_excess": float(np.mean((p - y) ** 2)) if p.size else None,
        "auc": auc(p, y) if p.size else None,
        "ms_per_step": 1e3 * mean("time/allocator"),
        "predictor": str(step.resolved.predictor_spec) if step.resolved.predictor_spec else None,
        "predictor_update_ms": 1e3 * mean("time/predictor") if step.predictor is not None else None,
        "steps": per_step,
    }
    for k in ("brier", "auc"):
        if out[k] is not None and math.isnan(out[k]):
            out[k] = None
    if config.learn > 0:
        out["final_success"] = world.mean_success("train")
        out["final_test_success"] = world.mean_success("test")
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
    results = {}
    for spec in config.allocators:
        cb = progress(spec, config.steps) if progress else None
        results[spec] = run_allocator(spec, world, config, cb)
    cfg = asdict(config)
    cfg["initial_success"] = world.mean_success("train")
    return {"config": cfg, "allocators": results}
