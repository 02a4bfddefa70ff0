"""``trace-gym bench allocators``: allocators side by side on ContrastLab at an equal budget.

Every allocator gets the same world (tasks and policy), the same candidate pool at each
step (``pool`` prompts drawn from the ``tasks`` train tasks, so prompts recur across steps
and predictors can learn), the same budget of ``budget`` trajectories per step, and its own
fresh predictor (its class's ``default_predictor``, or ``--predictor``). Rollouts come from
the vectorised fast path (:class:`~trace_gym.sim.ContrastLabSim`), seeded
identically for every allocator. One step:

1. the pool's roots go into a fresh :class:`~trace_gym.forest.forest.Forest`;
2. :func:`~trace_gym.allocation.allocator.allocate_step` runs the allocator's two stages;
3. the figures below are taken;
4. the predictor is updated on every non-terminal node that has leaves, with target
   V_hat and weight n (PAPER.md sec. 3); in ``--learn`` mode the simulated policy also
   takes a REINFORCE step on the forest's advantages.

Figures per allocator (means over steps unless noted):

* ``effective_ratio``: share of prompts with rollouts whose tree is mixed
  (``effective_ratio_last_third``: the same over the last third of the steps, once the
  predictors have warmed up);
* ``effective_sample_ratio``: share of trajectories, and of generated tokens, with a
  non-zero advantage. By default under the same estimator for every allocator, ``grpo``
  (leaf-level ``r - mean`` over the prompt's tree, PAPER.md's alternative to the trace
  advantage); ``--advantage NAME`` picks another for all, ``auto`` the one each allocator
  declares (``trace`` for tree allocators, ``grpo`` for the others). The figures under
  ``grpo`` and ``trace`` are always given too (``effective_sample_ratio_by_advantage``);
* ``trajectories``, ``tokens``: spent per step;
* ``brier``, ``auc``: calibration of every prediction the allocator made (written to
  ``forest.pred``), pooled over steps. Predictions are made before the predictor is
  updated on that step's outcomes; they are scored against the simulator's exact success
  probability of each node, i.e. the expected Brier score and AUC over outcomes
  (:mod:`trace_gym.predictors.calibration`); ``brier_excess`` is the mean of ``(pred - V)^2``, the
  part due to the predictor (0 for the oracle, whose Brier is the irreducible one).
  ``null`` for allocators that predict nothing;
* ``ms_per_step``: wall time inside the allocator's two stages (predictions and history
  building included, rollouts excluded).

Predictors are named like allocators, with options: ``--predictor hashed:lr=0.03`` gives
every allocator that uses a predictor that one; an allocator spec's ``predictor=NAME``
option (``knapsack:predictor=hashed``) gives that allocator another predictor than its
class's, so peers can be compared on the same predictor.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from trace_gym.allocation.allocator import Budget, allocate_step, add_candidates, make_allocator
from trace_gym.predictors.calibration import auc, brier
from trace_gym.sim import DEFAULT_DIFFICULTY, ContrastLabSim, ContrastLabWorld, DifficultyError, parse_difficulty
from trace_gym.forest.forest import TERMINAL, Forest
from trace_gym.predictors.base import make_predictor

DEFAULT_ALLOCATORS = ("grpo,uniform,trace,trace:stage1=uniform,trace:stage2=uniform,dapo,pcl,knapsack,oracle")


@dataclass
class BenchConfig:
    """What ``bench allocators`` runs (see the module docstring)."""

    allocators: list[str] = field(default_factory=lambda: DEFAULT_ALLOCATORS.split(","))
    difficulty: str = DEFAULT_DIFFICULTY
    steps: int = 30
    pool: int = 512
    budget: int = 1024
    tasks: int = 2048
    seed: int = 0
    predictor: str | None = None
    advantage: str = "grpo"
    root_fraction: float = 0.5
    min_per_prompt: int = 2
    group_size: int = 8
    learn: float = 0.0
    world: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        if not self.allocators:
            raise ValueError("--allocators: give at least one allocator")
        for name, value, low in (("--steps", self.steps, 1), ("--pool", self.pool, 1), ("--budget", self.budget, 1),
                                 ("--tasks", self.tasks, 1), ("--group-size", self.group_size, 1),
                                 ("--min-per-prompt", self.min_per_prompt, 1)):
            if value < low:
                raise ValueError(f"{name} must be at least {low}, got {value}")
        if self.pool > self.tasks:
            raise ValueError(f"--pool ({self.pool}) cannot exceed --tasks ({self.tasks})")
        if not 0 < self.root_fraction <= 1:
            raise ValueError(f"--root-fraction must be in (0, 1], got {self.root_fraction}")
        if self.learn < 0:
            raise ValueError(f"--learn must be >= 0, got {self.learn}")
        parse_difficulty(self.difficulty)
        allowed = set(inspect.signature(ContrastLabWorld).parameters) - {"n_tasks", "n_test", "difficulty", "seed"}
        unknown = sorted(set(self.world) - allowed)
        if unknown:
            raise ValueError(f"--world: unknown setting {unknown[0]!r} (settings: {', '.join(sorted(allowed))})")
        if self.advantage != "auto":
            from trace_gym.forest.advantages import resolve_estimator

            resolve_estimator(self.advantage)  # unknown names and options raise with suggestions
        for spec in self.allocators:
            parse_allocator(spec)
        if self.predictor:
            parse_predictor(self.predictor)


def parse_allocator(spec: str) -> tuple[str, dict[str, Any]]:
    """``"trace:stage1=uniform:k_max=4"`` -> ``("trace", {"stage1": "uniform", "k_max": 4})``."""
    import trace_gym.allocators as allocators

    name, kwargs = allocators.ALLOCATORS.parse(spec)  # unknown names raise with suggestions
    if "predictor" in kwargs:
        parse_predictor(str(kwargs["predictor"]))
    return name, kwargs


def parse_predictor(spec: str) -> tuple[str, dict[str, Any]]:
    """``"hashed:lr=0.03:counts=false"`` -> ``("hashed", {"lr": 0.03, "counts": False})``."""
    import trace_gym.predictors as predictors

    name, kwargs = predictors.PREDICTORS.parse(spec)  # unknown names raise with suggestions
    cls = predictors.PREDICTORS.get(name)
    params = inspect.signature(cls).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            raise ValueError(f"predictor {spec!r}: unknown option {unknown[0]!r} (options: {', '.join(params) or 'none'})")
    return name, kwargs


def _pools(world: ContrastLabWorld, config: BenchConfig) -> list[np.ndarray]:
    rng = np.random.default_rng([config.seed, 0xB00])
    return [np.sort(rng.choice(config.tasks, size=config.pool, replace=False)) for _ in range(config.steps)]


def run_allocator(spec: str, world: ContrastLabWorld, pools: list[np.ndarray], config: BenchConfig,
                  on_step: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run one allocator (``spec`` as for :func:`parse_allocator`) for ``len(pools)`` steps;
    returns its figures (see the module docstring)."""
    import trace_gym.allocators as allocators

    name, kwargs = parse_allocator(spec)
    own_predictor = kwargs.pop("predictor", None)
    if "seed" in inspect.signature(allocators.ALLOCATORS.get(name)).parameters:
        kwargs.setdefault("seed", config.seed)
    allocator = make_allocator(name, **kwargs)
    pred_name = getattr(allocator, "default_predictor", None)
    if pred_name is not None and config.predictor:
        pred_name = config.predictor
    if own_predictor is not None:
        pred_name = str(own_predictor)
    if pred_name:
        p_name, p_kwargs = parse_predictor(pred_name)
        predictor = make_predictor(p_name, **p_kwargs)
    else:
        predictor = None
    adv_name = getattr(allocator, "advantage", "trace") if config.advantage == "auto" else config.advantage
    world = world.copy() if config.learn > 0 else world
    sim = ContrastLabSim(world, seed=config.seed)
    budget = Budget(config.budget, root_fraction=config.root_fraction, min_per_prompt=config.min_per_prompt,
                    group_size=config.group_size)
    rollout_s = [0.0]

    def rollout(forest: Forest, origins: np.ndarray) -> None:
        t = time.perf_counter()
        sim.rollout(forest, origins)
        rollout_s[0] += time.perf_counter() - t

    rows: dict[str, list[float]] = {k: [] for k in ("er", "esr_traj", "esr_tok", "traj", "tok", "prompts", "ms", "update_ms")}
    preds, truths = [], []
    for pool in pools:
        forest = Forest(capacity=8 * config.budget)
        add_candidates(forest, world.candidates(pool))
        rollout_s[0] = 0.0
        t0 = time.perf_counter()
        spend = allocate_step(forest, allocator, budget, predictor, rollout)
        rows["ms"].append(1e3 * (time.perf_counter() - t0 - rollout_s[0]))
        if spend.trajectories > config.budget:  # allocate_step checks plans; this checks the outcome
            raise RuntimeError(f"allocator {spec!r} spent {spend.trajectories} > {config.budget} trajectories")
        adv = forest.advantages(adv_name)
        traj_ratio, tok_ratio = forest.effective_sample_ratio(adv)
        rows["er"].append(forest.effective_ratio())
        rows["esr_traj"].append(traj_ratio)
        rows["esr_tok"].append(tok_ratio)
        for extra in ("grpo", "trace"):
            a = adv if extra == adv_name else forest.advantages(extra)
            e_traj, e_tok = forest.effective_sample_ratio(a)
            rows.setdefault(f"{extra}_traj", []).append(e_traj)
            rows.setdefault(f"{extra}_tok", []).append(e_tok)
        rows["traj"].append(spend.trajectories)
        rows["tok"].append(forest.counters["generated_tokens"])
        rows["prompts"].append(spend.prompts)
        seen = np.flatnonzero(np.isfinite(forest.pred))
        if seen.size:
            preds.append(forest.pred[seen].copy())
            truths.append(forest.oracle[seen].copy())
        if predictor is not None:
            t1 = time.perf_counter()
            nodes = np.flatnonzero(((forest.flags & TERMINAL) == 0) & (forest.n_leaves > 0))
            predictor.update(forest.histories(nodes), forest.value[nodes], forest.n_leaves[nodes].astype(np.float64))
            rows["update_ms"].append(1e3 * (time.perf_counter() - t1))
        if config.learn > 0:
            world.reinforce(forest, adv, lr=config.learn)
        if on_step is not None:
            on_step()
    p = np.concatenate(preds) if preds else np.zeros(0)
    y = np.concatenate(truths) if truths else np.zeros(0)
    mean = lambda k: float(np.mean(rows[k])) if rows[k] else None  # noqa: E731
    tail = rows["er"][-max(1, len(rows["er"]) // 3):]
    out = {
        "effective_ratio": mean("er"),
        "effective_ratio_last_third": float(np.mean(tail)),
        "effective_sample_ratio": {"trajectories": mean("esr_traj"), "tokens": mean("esr_tok"), "advantage": adv_name},
        "effective_sample_ratio_by_advantage": {
            extra: {"trajectories": mean(f"{extra}_traj"), "tokens": mean(f"{extra}_tok")} for extra in ("grpo", "trace")
        },
        "trajectories": mean("traj"),
        "tokens": mean("tok"),
        "prompts": mean("prompts"),
        "brier": brier(p, np.clip(y, 0, 1)) if p.size else None,
        "brier_excess": float(np.mean((p - y) ** 2)) if p.size else None,
        "auc": auc(p, np.clip(y, 0, 1)) if p.size else None,
        "ms_per_step": mean("ms"),
        "predictor": pred_name,
        "predictor_update_ms": mean("update_ms"),
    }
    for k in ("brier", "auc"):
        if out[k] is not None and math.isnan(out[k]):
            out[k] = None
    if config.learn > 0:
        out["final_success"] = world.mean_success("train")
        out["final_test_success"] = world.mean_success("test")
    return out


def _warm_up() -> None:
    """Load (or compile) every numba kernel a step uses, so the first allocator's timings
    do not include it."""
    from trace_gym.allocators.knapsack import knapsack_counts
    from trace_gym.allocators.trace import solve_roots_beta
    from trace_gym.allocation.solvers import solve_prefixes, solve_roots

    world = ContrastLabWorld(4, n_test=0)
    forest = Forest()
    add_candidates(forest, world.candidates(np.arange(4)))
    ContrastLabSim(world).rollout(forest, np.repeat(forest.root_nodes.astype(np.int64), 2))
    forest.backup()
    for name in ("grpo", "trace"):
        forest.effective_sample_ratio(forest.advantages(name))
    forest.effective_ratio()
    solve_roots(np.full(4, 0.5), 8), solve_prefixes(np.full(4, 0.5), np.zeros(4), 4), knapsack_counts(np.full(4, 0.5), 8, 4)
    solve_roots_beta(np.full(4, 0.5), np.full(4, 2.0), 8)
    hashed = make_predictor("hashed", bits=8)
    hashed.update(forest.histories(np.arange(len(forest))), np.full(len(forest), 0.5))
    hashed.predict(forest.histories([0]))


def run_bench(config: BenchConfig, progress: Callable[[str, int], Callable[[], None]] | None = None) -> dict[str, Any]:
    """Run every allocator of ``config``; returns ``{"config": ..., "allocators": {spec: figures}}``.
    ``progress(spec, steps)`` may return a per-step callback."""
    config.validate()
    _warm_up()
    world = ContrastLabWorld(config.tasks, n_test=max(1, config.tasks // 4), difficulty=config.difficulty, seed=config.seed,
                             **config.world)
    pools = _pools(world, config)
    results = {}
    for spec in config.allocators:
        cb = progress(spec, config.steps) if progress else None
        results[spec] = run_allocator(spec, world, pools, config, cb)
    cfg = asdict(config)
    cfg["initial_success"] = world.mean_success("train")
    return {"config": cfg, "allocators": results}


# ----------------------------------------------------------------------------- CLI


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}%" if pct else (f"{x:.3f}" if isinstance(x, float) and abs(x) < 10 else f"{x:,.0f}" if isinstance(x, float) else str(x))


def print_table(result: dict[str, Any], console: Any = None) -> None:
    """Print the figures of :func:`run_bench` as a rich table."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # files and pipes get the whole table, not an 80-column squeeze
            console = Console(width=160)
    cfg = result["config"]
    world = "".join(f", {k}={v}" for k, v in cfg.get("world", {}).items())
    table = Table(title=f"ContrastLab, budget {cfg['budget']} trajectories/step, pool {cfg['pool']}, {cfg['steps']} steps, "
                        f"difficulty {cfg['difficulty']}{world}")
    adv = next(iter(result["allocators"].values()))["effective_sample_ratio"]["advantage"] if result["allocators"] else ""
    for col in ("allocator", "eff. ratio", f"ESR traj ({adv})", "ESR tok", "ESR traj (trace)", "traj/step", "tokens/step",
                "prompts", "Brier", "AUC", "ms/step"):
        table.add_column(col, justify="left" if col == "allocator" else "right")
    for spec, r in result["allocators"].items():
        esr = r["effective_sample_ratio"]
        table.add_row(spec, _fmt(r["effective_ratio"], True), _fmt(esr["trajectories"], True), _fmt(esr["tokens"], True),
                      _fmt(r["effective_sample_ratio_by_advantage"]["trace"]["trajectories"], True),
                      _fmt(r["trajectories"]), _fmt(r["tokens"]), _fmt(r["prompts"]),
                      _fmt(r["brier"]), _fmt(r["auc"]), f"{r['ms_per_step']:.1f}")
    console.print(table)


def _world_settings(text: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        if "=" not in item:
            raise SystemExit(f"error: --world takes key=value pairs, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = json.loads(value)
    return out


def _allocators_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    config = BenchConfig(
        allocators=[a for a in args.allocators.split(",") if a.strip()], difficulty=args.difficulty, steps=args.steps,
        pool=args.pool, budget=args.budget, tasks=args.tasks, seed=args.seed, predictor=args.predictor,
        advantage=args.advantage, root_fraction=args.root_fraction, min_per_prompt=args.min_per_prompt,
        group_size=args.group_size, learn=args.learn, world=_world_settings(args.world),
    )
    try:
        config.validate()
    except (ValueError, KeyError, DifficultyError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=args.quiet or not console.is_terminal) as bar:
        def progress(spec: str, steps: int) -> Callable[[], None]:
            task = bar.add_task(spec, total=steps)
            return lambda: bar.advance(task)

        result = run_bench(config, progress)
    print_table(result, console)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        console.print(f"wrote {path}")
    return 0


def configure_bench(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``trace-gym bench`` (subcommand ``allocators``)."""
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    p = sub.add_parser("allocators", help="compare allocators on ContrastLab at an equal budget",
                       description="Run allocators side by side on ContrastLab at an equal budget and print their "
                                   "effective ratio, effective sample ratio, spend, predictor calibration and "
                                   "time per step (the figures are defined in trace_gym/sim/bench.py).")
    p.add_argument("--allocators", default=DEFAULT_ALLOCATORS,
                   help="comma-separated allocators, options as name:key=value (default: %(default)s)")
    p.add_argument("--difficulty", default=DEFAULT_DIFFICULTY,
                   help="root success distribution: beta:A,B, a mixture like 0.5*beta:0.3,3+0.5*beta:3,0.3, or a file of "
                        "probabilities (default: %(default)s)")
    p.add_argument("--steps", type=int, default=30, help="allocation steps (default: %(default)s)")
    p.add_argument("--pool", type=int, default=512, help="candidate prompts per step (default: %(default)s)")
    p.add_argument("--budget", type=int, default=1024, help="trajectories per step, M (default: %(default)s)")
    p.add_argument("--tasks", type=int, default=2048, help="train tasks the pools are drawn from (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--predictor", default=None,
                   help="predictor for every allocator that uses one, options as name:key=value, e.g. hashed:lr=0.03 "
                        "(default: each allocator's own)")
    p.add_argument("--advantage", default="grpo",
                   help="advantage estimator of the effective sample ratio, for every allocator, or 'auto' for each "
                        "allocator's own (default: %(default)s)")
    p.add_argument("--root-fraction", type=float, default=0.5, help="stage-1 share of the budget (default: %(default)s)")
    p.add_argument("--min-per-prompt", type=int, default=2, help="m_min (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=8, help="G for grpo, dapo, pcl (default: %(default)s)")
    p.add_argument("--learn", type=float, default=0.0, help="learning rate of the simulated policy (0: frozen policy)")
    p.add_argument("--world", default=None, metavar="K=V,...",
                   help="ContrastLab settings, e.g. step_spread=1.5,obs_noise=0.1 (see ContrastLabWorld)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_allocators_command)
