"""``trace-gym bench allocators``: allocators side by side on ContrastLab at an equal budget
(the figures are defined in :mod:`trace_gym.sim.bench`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

from trace_gym.cli.errors import UsageError
from trace_gym.sim.bench import DEFAULT_ALLOCATORS, BenchConfig, run_bench
from trace_gym.sim.difficulty import DEFAULT_DIFFICULTY

LEGEND = ("eff. ratio: share of sampled prompts whose tree holds a success and a failure; "
          "ESR: effective sample ratio, the share of trajectories with a non-zero advantage, under the row's own "
          "advantage estimator (adv.), and under grpo's (ESR grpo) and trace's (ESR trace) for every row; ESR tok: "
          "the same share of generated tokens; traj/step, tokens/step, prompts: spent per step; flips: of the branches "
          "in trees whose rollouts from the root all agreed, the share that ended with the other outcome (-: it never "
          "branched in such a tree); Brier/AUC: the "
          "allocator's predictor against the exact V (-: it predicts nothing); ms/step: allocator time, rollouts excluded.")


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None:
        return "-"
    if pct:
        return f"{100 * x:.1f}%"
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) < 10 else f"{x:,.0f}"
    return str(x)


def print_table(result: dict[str, Any], console: Any = None) -> None:
    """Print the figures of :func:`~trace_gym.sim.bench.run_bench` as a table, then a legend.

    Names are never cut: a table wider than the console is split into narrower ones that
    each repeat the allocator column, and every column folds rather than ending a name with an
    ellipsis (:mod:`trace_gym.cli.tables`). Rows that spent a different
    number of trajectories per step than the others are marked ``*`` and a line under the
    table says so."""
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:  # files and pipes get the whole table, not an 80-column squeeze
            console = Console(width=200)
    from trace_gym.cli.tables import fitted_tables

    cfg = result["config"]
    world = "".join(f", {k}={v}" for k, v in cfg.get("world", {}).items())
    title = (f"ContrastLab, M = {cfg['trajectories']} trajectories/step, B = {cfg['prompts']} prompts, "
             f"{cfg['steps']} steps, difficulty {cfg['difficulty']}{world}")
    headers = ["allocator", "adv.", "eff. ratio", "ESR", "ESR tok", "ESR grpo", "ESR trace", "traj/step", "tokens/step",
               "prompts", "flips", "Brier", "AUC", "ms/step"]
    spends = [round(r["trajectories"] or 0) for r in result["allocators"].values()]
    counts = sorted((spends.count(x) for x in set(spends)), reverse=True)
    usual = max(set(spends), key=spends.count) if spends and (len(counts) < 2 or counts[0] > counts[1]) else None
    rows = []
    for spec, r in result["allocators"].items():
        esr = r["effective_sample_ratio"]
        by = r["effective_sample_ratio_by_advantage"]
        spent = _fmt(r["trajectories"]) + ("*" if round(r["trajectories"] or 0) != usual else "")
        rows.append([spec, str(esr["advantage"]), _fmt(r["effective_ratio"], True), _fmt(esr["trajectories"], True),
                     _fmt(esr["tokens"], True), _fmt(by["grpo"]["trajectories"], True), _fmt(by["trace"]["trajectories"], True),
                     spent, _fmt(r["tokens"]), _fmt(r["prompts"]), _fmt((r.get("branch_flips") or {}).get("flip_rate"), True),
                     _fmt(r.get("brier")), _fmt(r.get("auc")),
                     f"{r['ms_per_step']:.1f}"])
    for table in fitted_tables(headers, rows, console.width, title=title, left=("allocator", "adv.")):
        console.print(table)
    if result.get("evaluation"):
        try:
            from trace_gym.sim.evaluation import summary_line

            console.print(summary_line(result["evaluation"]), highlight=False)
        except ImportError:  # an older simulator without a shared evaluation set
            pass
    console.print(LEGEND, style="dim", highlight=False)
    if len(set(spends)) > 1:
        most = f" than most rows ({usual:,})" if usual is not None else " than other rows"
        console.print(f"* spent a different number of trajectories per step{most}: "
                      f"compare ratios, not totals (an allocator may leave budget unspent, e.g. grpo with M not a "
                      f"multiple of its group size).", highlight=False)


def _split_top_level(text: str) -> list[str]:
    """Split ``text`` at commas outside brackets and quotes: ``a=1,b=[2,6]`` -> ``["a=1", "b=[2,6]"]``."""
    items, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c in "[{(":
            depth += 1
        elif c in "]})":
            depth -= 1
        elif c == "," and depth <= 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def world_settings(text: str | None) -> dict[str, Any]:
    """``--world step_spread=1.5,turns=[2,6]`` as a dict (values read as JSON); raises
    :class:`~trace_gym.cli.errors.UsageError` naming a malformed item."""
    out: dict[str, Any] = {}
    for item in _split_top_level(text or ""):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--world takes key=value pairs separated by commas, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            raise UsageError(f"--world {key.strip()}: {value!r} is not a number, list or quoted string") from None
    return out


def check_world(config: BenchConfig) -> None:
    """Raise :class:`~trace_gym.cli.errors.UsageError` for a ``--world`` setting of the wrong
    shape (``turns=-3`` where ``turns=[2,6]`` is meant) or value, naming the setting."""
    import inspect

    from trace_gym.sim.world import ContrastLabWorld

    params = inspect.signature(ContrastLabWorld).parameters
    for key, value in config.world.items():
        param = params.get(key)
        if param is None:
            continue  # config.validate() names unknown settings
        default = param.default
        if isinstance(default, tuple):
            if not isinstance(value, list) or len(value) != len(default) or \
                    not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                example = json.dumps(list(default)).replace(" ", "")
                raise UsageError(f"--world {key}: expects a list of {len(default)} numbers such as {key}={example}, "
                                 f"got {json.dumps(value)}")
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise UsageError(f"--world {key}: expects a number (default {default}), got {json.dumps(value)}")
    try:
        ContrastLabWorld(seed=config.seed, **config.world_kwargs())
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--world: {exc}") from None


def check_allocators(config: BenchConfig) -> None:
    """Build every allocator of ``config`` once (with its predictor), so a bad option value
    (``trace:stage1=foo``) is reported before anything runs, naming the allocator."""
    from trace_gym.run import BudgetSpec, resolve

    budget = BudgetSpec(trajectories=config.trajectories, prompts=config.prompts, root_fraction=config.root_fraction,
                        min_per_prompt=config.min_per_prompt, group_size=config.group_size)
    for spec in config.allocators:
        try:
            resolve(spec, budget, predictor=config.predictor, advantage=config.advantage, seed=config.seed)
        except (TypeError, ValueError, KeyError) as exc:
            msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
            raise UsageError(f"--allocators {spec}: {msg}") from None


def _allocators_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    config = BenchConfig(
        allocators=[a for a in args.allocators.split(",") if a.strip()], difficulty=args.difficulty, steps=args.steps,
        prompts=args.prompts, trajectories=args.trajectories, tasks=args.tasks, seed=args.seed, predictor=args.predictor,
        advantage=args.advantage, root_fraction=args.root_fraction, min_per_prompt=args.min_per_prompt,
        group_size=args.group_size, learn=args.learn, world=world_settings(args.world),
    )
    config.validate()  # ValueError, UnknownNameError, DifficultyError: one `error:` line (trace_gym.cli.errors)
    check_world(config)
    check_allocators(config)
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
