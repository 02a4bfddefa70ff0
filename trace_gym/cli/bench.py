"""``trace-gym bench allocators``: allocators side by side on ContrastLab at an equal budget
(the figures are defined in :mod:`trace_gym.sim.bench`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

from trace_gym.sim.bench import DEFAULT_ALLOCATORS, BenchConfig, run_bench
from trace_gym.sim.difficulty import DEFAULT_DIFFICULTY, DifficultyError

LEGEND = ("eff. ratio: share of sampled prompts whose tree holds a success and a failure; "
          "ESR: effective sample ratio, the share of trajectories with a non-zero advantage, under the row's own "
          "advantage (adv.), under grpo and under trace; tok: the same share of generated tokens; "
          "Brier/AUC: the allocator's predictions against the exact V; ms/step: allocator time, rollouts excluded.")


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None:
        return "-"
    if pct:
        return f"{100 * x:.1f}%"
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) < 10 else f"{x:,.0f}"
    return str(x)


def print_table(result: dict[str, Any], console: Any = None) -> None:
    """Print the figures of :func:`~trace_gym.sim.bench.run_bench` as a table, with a legend."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # files and pipes get the whole table, not an 80-column squeeze
            console = Console(width=200)
    cfg = result["config"]
    world = "".join(f", {k}={v}" for k, v in cfg.get("world", {}).items())
    table = Table(title=f"ContrastLab, M = {cfg['trajectories']} trajectories/step, B = {cfg['prompts']} prompts, "
                        f"{cfg['steps']} steps, difficulty {cfg['difficulty']}{world}")
    for col in ("allocator", "adv.", "eff. ratio", "ESR", "ESR tok", "ESR grpo", "ESR trace", "traj/step", "tokens/step",
                "prompts", "Brier", "AUC", "ms/step"):
        table.add_column(col, justify="left" if col in ("allocator", "adv.") else "right", overflow="fold")
    spends = {round(r["trajectories"] or 0) for r in result["allocators"].values()}
    for spec, r in result["allocators"].items():
        esr = r["effective_sample_ratio"]
        by = r["effective_sample_ratio_by_advantage"]
        spent = _fmt(r["trajectories"]) + ("*" if len(spends) > 1 else "")
        table.add_row(spec, esr["advantage"], _fmt(r["effective_ratio"], True), _fmt(esr["trajectories"], True),
                      _fmt(esr["tokens"], True), _fmt(by["grpo"]["trajectories"], True), _fmt(by["trace"]["trajectories"], True),
                      spent, _fmt(r["tokens"]), _fmt(r["prompts"]), _fmt(r["brier"]), _fmt(r["auc"]), f"{r['ms_per_step']:.1f}")
    console.print(table)
    console.print(LEGEND, style="dim")
    if len(spends) > 1:
        console.print("* rows spent different numbers of trajectories per step: compare their ratios, not their totals.")


def _world_settings(text: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--world takes key=value pairs, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"--world {key.strip()}: {value!r} is not a number, list or quoted string") from None
    return out


def _allocators_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    try:
        config = BenchConfig(
            allocators=[a for a in args.allocators.split(",") if a.strip()], difficulty=args.difficulty, steps=args.steps,
            prompts=args.prompts, trajectories=args.trajectories, tasks=args.tasks, seed=args.seed, predictor=args.predictor,
            advantage=args.advantage, root_fraction=args.root_fraction, min_per_prompt=args.min_per_prompt,
            group_size=args.group_size, learn=args.learn, world=_world_settings(args.world),
        )
        config.validate()
    except (ValueError, KeyError, DifficultyError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
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
    p.add_argument("--prompts", type=int, default=512, help="B: candidate prompts per step (default: %(default)s)")
    p.add_argument("--trajectories", type=int, default=1024, help="M: trajectories per step (default: %(default)s)")
    p.add_argument("--tasks", type=int, default=2048, help="train tasks of the world (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--predictor", default=None,
                   help="predictor for every allocator that uses one, options as name:key=value, e.g. hashed:lr=0.03 "
                        "(default: each allocator's own)")
    p.add_argument("--advantage", default=None,
                   help="advantage estimator for every allocator, options as name:key=value (default: each allocator's own)")
    p.add_argument("--root-fraction", type=float, default=0.5, help="stage-1 share of M (default: %(default)s)")
    p.add_argument("--min-per-prompt", type=int, default=2, help="m_min (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=8, help="G for grpo, dapo, pcl (default: %(default)s)")
    p.add_argument("--learn", type=float, default=0.0, help="learning rate of the simulated policy (0: frozen policy)")
    p.add_argument("--world", default=None, metavar="K=V,...",
                   help="ContrastLab settings, e.g. step_spread=1.5,obs_noise=0.1 (see ContrastLabWorld)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_allocators_command)
