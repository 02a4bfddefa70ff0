"""``trace-gym leaderboard``: ``run`` a suite, ``show`` runs, ``merge`` runs into one.

::

    trace-gym leaderboard run quick                     # preset configs/suites/quick.yaml
    trace-gym leaderboard run my_suite.yaml --out results/mine
    trace-gym leaderboard show results/quick results/other-machine
    trace-gym leaderboard show results/a results/b --allocators grpo,trace --against grpo
    trace-gym leaderboard show results/a --seeds 3,4 --allocators "grpo,trace(m_max=m_min,scope=tree)"
    trace-gym leaderboard show results/trace-12-steps results/grpo-8-steps --steps 8 --against grpo
    trace-gym leaderboard merge results/a results/b --out results/merged
    trace-gym leaderboard compare results/a results/a-rerun  # which rows generated the same
    trace-gym leaderboard suites                        # list the presets

Exit status: 0 on success, 1 when records are refused (a bad record, or allocators of one
group that spent different trajectories), 2 for a bad suite, bad arguments, a results folder
holding a bad record file, or a server that does not answer (one ``error:`` line). ``compare``
exits 3 when a row both runs hold did not generate the same at every step (or it cannot tell).

``run`` into a folder that already holds records never deletes any: the suite's new runs are
added, and records it no longer produces are kept in ``records.earlier.jsonl`` (not ranked);
``--fresh`` moves the folder's record files aside under timestamped names first.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

from trace_gym.leaderboard.records import RecordError, UnequalBudget, load_records, rank, write_records
from trace_gym.leaderboard.render import rich_tables, write_leaderboard
from trace_gym.leaderboard.spec import SuiteError, load_suite, preset_names, resolve_suite_path


def _console(stderr: bool = False):
    from rich.console import Console

    probe = Console(stderr=stderr)
    # a pipe or a log file gets the full table rather than rich's 80-column default
    return probe if probe.is_terminal else Console(stderr=stderr, width=200)


def _provenance(records) -> str:
    runs = sorted({lr.record.run for lr in records})
    commits = sorted({lr.record.git_commit[:12] for lr in records})
    hosts = sorted({lr.record.host for lr in records})
    # a record made with kernels held to another ISA says so: it rounds as another CPU would
    cpus = sorted({lr.record.cpu.get("cpu", "") + (f" [{lr.record.cpu['kernel_env']}]" if lr.record.cpu.get("kernel_env") else "")
                   for lr in records} - {""})
    versions = records[0].record.versions
    pkg = ", ".join(f"{k} {v}" for k, v in versions.items())
    cpu = f"CPU(s) {', '.join(cpus)}; " if cpus else ""  # records written before the CPU was recorded have none
    return (f"{len(records)} records from run(s) {', '.join(runs)}; host(s) {', '.join(hosts)}; {cpu}"
            f"commit(s) {', '.join(commits)}; {pkg}")


def _rows(records) -> list[str]:
    """The row names (allocators) the records hold, sorted."""
    return sorted({lr.record.allocator for lr in records})


def _check_against(records, against: str | None) -> None:
    """A ``--against`` row that no record has is a usage error naming the rows there are."""
    present = _rows(records)
    if against and against not in present:
        from trace_gym.cli.errors import UsageError

        raise UsageError(f"--against {against!r}: no row of that name (rows: {', '.join(present)})")


def _render(records, out_dir: Path | None, title: str, notes: list[str] | None = None, against: str | None = None) -> int:
    """Rank ``records``, print the tables (and ``notes`` under them; with ``against``, each
    group's rows against that row, paired by seed), and write the leaderboard files into ``out_dir``."""
    groups = rank(records)
    console = _console()
    for table in rich_tables(groups, width=console.width, against=against):
        console.print(table)
    for note in notes or []:
        console.print(note, highlight=False, soft_wrap=True)
    if out_dir is not None:
        files = write_leaderboard(groups, out_dir, title=title, provenance=_provenance(records), notes=notes, against=against)
        console.print(f"leaderboard written to {out_dir}/: " + ", ".join(p.name for p in files.values()))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """``leaderboard run SUITE|FILE``: run the suite, then write and print its leaderboard.
    A bad suite, a bad record file in ``--out`` or a server that does not answer is raised
    before anything runs (one ``error:`` line, exit status 2)."""
    from trace_gym.leaderboard.runner import EARLIER_FILE, plan_suite, preflight, run_suite, sort_records

    err = _console(stderr=True)
    try:
        whole = load_suite(args.suite)
        spec = whole.select(args.tracks.split(",") if args.tracks else None)
    except SuiteError as exc:
        raise SuiteError(f"bad suite: {exc}") from None
    out = Path(args.out) if args.out else Path("results") / f"{spec.suite}-{datetime.now():%Y%m%d-%H%M%S}"
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and not args.fresh:
        sort_records(out, plan_suite(whole))  # a bad record file: its file:line, before anything runs
    rows = sorted({plan.row for plan in plan_suite(spec)})
    if args.against and args.against not in rows:
        raise SuiteError(f"--against {args.against!r}: not a row of the suite (rows: {', '.join(rows)})")
    preflight(spec)
    err.print(f"suite {spec.suite!r} from {resolve_suite_path(args.suite)}: {len(spec.tracks)} track(s); results in {out}/",
              highlight=False, soft_wrap=True)
    run_suite(spec, out, show_progress=not args.no_progress, fresh=args.fresh, console=err, whole=whole)
    notes = []
    earlier = out / EARLIER_FILE
    if earlier.is_file() and earlier.stat().st_size:
        n = sum(1 for line in earlier.read_text().splitlines() if line.strip())
        notes.append(f"{n} earlier record(s) of this folder that the suite no longer runs are kept in {earlier} "
                     f"(not ranked here).")
    try:
        records = load_records([out])
        return _render(records, out, title=f"trace-gym leaderboard: {spec.suite}", notes=notes, against=args.against)
    except (RecordError, UnequalBudget) as exc:
        err.print(f"[red]refused:[/red] {exc}", markup=True, highlight=False, soft_wrap=True)
        return 1


def split_rows(value: str) -> list[str]:
    """The row names of an ``--allocators`` value: split at the commas outside parentheses,
    so a row label that holds commas (``trace(m_max=m_min,scope=tree)``) stays one name."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(value):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            names.append(value[start:i])
            start = i + 1
    names.append(value[start:])
    return [n.strip() for n in names if n.strip()]


def _only(records, allocators: str | None, seeds: str | None = None):
    """The records of the ``--allocators`` rows and the ``--seeds`` seeds (all when None); a
    name or seed no record has is a usage error naming the ones there are."""
    from trace_gym.cli.errors import UsageError

    if allocators:
        wanted = split_rows(allocators)
        present = _rows(records)
        unknown = [a for a in wanted if a not in present]
        if unknown:
            raise UsageError(f"--allocators: no records of {', '.join(map(repr, unknown))} (rows there: {', '.join(present)})")
        records = [lr for lr in records if lr.record.allocator in wanted]
    if seeds:
        try:
            chosen = {int(x) for x in seeds.split(",") if x.strip()}
        except ValueError:
            raise UsageError(f"--seeds {seeds!r}: give whole numbers separated by commas (e.g. 3,4)") from None
        there = sorted({lr.record.seed for lr in records})
        unknown = sorted(chosen - set(there))
        if unknown or not chosen:
            raise UsageError(f"--seeds: no records of seed(s) {', '.join(map(str, unknown)) or '(none given)'} "
                             f"(seeds there: {', '.join(map(str, there))})")
        records = [lr for lr in records if lr.record.seed in chosen]
    return records


def cmd_show(args: argparse.Namespace) -> int:
    """``leaderboard show RUN...``: merge the runs' records in memory and print the tables;
    ``--allocators`` keeps some rows, ``--seeds`` some seeds, ``--steps N`` reads every run
    as its first N steps (:func:`~trace_gym.leaderboard.cut.first_steps`), ``--against ROW``
    adds each row against ROW paired by seed."""
    try:
        records, notes = _first_steps(_only(load_records(args.runs), args.allocators, args.seeds), args.steps)
        _check_against(records, args.against)
        return _render(records, None, title="trace-gym leaderboard", notes=notes, against=args.against)
    except (RecordError, UnequalBudget) as exc:
        _console(stderr=True).print(f"[red]refused:[/red] {exc}", markup=True, highlight=False, soft_wrap=True)
        return 1


def _first_steps(records, steps: int | None):
    """The records cut to their runs' first ``steps`` steps (``--steps``; None: as they are),
    and the notes under the tables: one saying how many were cut and which final metrics that
    left out, none where no record was longer; a record that cannot be cut is a usage error
    naming each and why."""
    from trace_gym.cli.errors import UsageError
    from trace_gym.leaderboard.cut import CutError, cut_records

    if steps is None:
        return records, []
    try:
        out = cut_records(records, steps)
    except CutError as exc:
        raise UsageError(f"--steps {steps}: {exc}") from None
    cut = [(a.record, b.record) for a, b in zip(records, out) if a is not b]
    if not cut:
        return out, []
    lost = sorted({name for a, b in cut for name, value in a.final.items() if value is not None and b.final.get(name) is None})
    return out, [f"--steps {steps}: {len(cut)} of {len(out)} record(s) read as their runs' first {steps} steps"
                 + (f"; measured after the whole run, their {', '.join(lost)} are left out." if lost else ".")]


def cmd_merge(args: argparse.Namespace) -> int:
    """``leaderboard merge RUN... --out DIR``: one records.jsonl and leaderboard from several
    runs; ``--steps N`` writes every record cut to its run's first N steps."""
    out = Path(args.out)
    try:
        records, notes = _first_steps(load_records(args.runs), args.steps)
        _check_against(records, args.against)
        rank(records)  # refuse before writing anything
    except (RecordError, UnequalBudget) as exc:
        _console(stderr=True).print(f"[red]refused:[/red] {exc}", markup=True, highlight=False, soft_wrap=True)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    write_records(out / "records.jsonl", [lr.record for lr in records])
    return _render(records, out, title=args.title, notes=notes, against=args.against)


def cmd_compare(args: argparse.Namespace) -> int:
    """``leaderboard compare A B``: for each row both runs hold, the first step at which their
    generations part (:mod:`trace_gym.leaderboard.compare`); 0 when every such row is the same."""
    from rich.table import Table

    from trace_gym.cli.errors import UsageError
    from trace_gym.leaderboard.compare import compare_runs
    from trace_gym.leaderboard.records import RANK_METRIC

    try:
        a, b = load_records([args.a]), load_records([args.b])
    except RecordError as exc:
        _console(stderr=True).print(f"[red]refused:[/red] {exc}", markup=True, highlight=False, soft_wrap=True)
        return 1
    try:
        rows = compare_runs(a, b)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    shared = [r for r in rows if r.a is not None and r.b is not None]
    if not shared:
        raise UsageError(f"no row (track kind, env, allocator, seed) is in both {args.a} and {args.b}")
    console = _console()
    console.print(f"A: {_provenance(a)}\nB: {_provenance(b)}", highlight=False, soft_wrap=True)

    def final(r) -> str:
        v = r.final.get(RANK_METRIC[r.kind]) if r is not None else None
        return "" if v is None else f"{v:.3f}"

    def tokens(r) -> str:
        return "" if r is None else f"{r.spent.tokens:,}"

    table = Table(title="rows of A and B, step by step (generation fingerprints)")
    for col in ("track", "env", "allocator", "seed", "generations", "tokens A", "tokens B", "final A", "final B"):
        table.add_column(col, overflow="fold")
    for r in rows:
        rec = r.a or r.b
        style = {"same": "green", "parted": "red", "unknown": "yellow"}.get(r.verdict)
        table.add_row(rec.track, rec.env, rec.allocator, str(rec.seed), r.describe(), tokens(r.a), tokens(r.b),
                      final(r.a), final(r.b), style=style)
    console.print(table)
    same = sum(r.verdict == "same" for r in shared)
    console.print(f"{same} of {len(shared)} row(s) both runs hold generated the same at every step", highlight=False)
    return 0 if same == len(shared) else 3


def cmd_suites(args: argparse.Namespace) -> int:
    """``leaderboard suites``: the preset suites and their tracks."""
    console = _console()
    for name in preset_names():
        try:
            spec = load_suite(name)
            tracks = "; ".join(f"{t.name} ({t.kind}: {', '.join(e.name for e in t.envs)} x {len(t.allocators)} allocators, "
                               f"M={t.budget.trajectories} x {t.steps} steps)" for t in spec.tracks)
            console.print(f"[bold]{name}[/bold]: {spec.description.strip()}\n    {tracks}", highlight=False)
        except SuiteError as exc:
            console.print(f"[bold]{name}[/bold]: [red]invalid here:[/red] {exc}", highlight=False)
    return 0


_AGAINST_HELP = ("under each table, every row against ROW (e.g. grpo), paired by seed: the ranked metric's difference "
                 "and the tokens, with 95%% intervals (training: also the accuracy at equal tokens and the tokens to ROW's "
                 "final accuracy, the evaluation's own noise on the differences where the records keep per-task "
                 "scores, and a second table reading each row after every evaluation against ROW's curve at equal "
                 "tokens)")


_STEPS_HELP = ("read every run as its first N steps, so that a longer run ranks beside a run of N steps at the same "
               "budget (a training run must have been evaluated after step N; final metrics measured after the whole "
               "run, such as the shared calibration AUCs, read as missing; a training record whose learning rate "
               "fell during its run, as under a cosine schedule, is refused: its first N steps ran at other rates "
               "than an N-step run)")


def configure_leaderboard(parser: argparse.ArgumentParser) -> None:
    """Add the ``run``, ``show``, ``merge``, ``compare`` and ``suites`` subcommands to ``parser``."""
    sub = parser.add_subparsers(dest="leaderboard_command", metavar="ACTION", required=True)
    p = sub.add_parser("run", help="run a benchmark suite and write its leaderboard",
                       description="Run a suite (a preset name such as quick/standard/paper, or a YAML file), write "
                                   "records.jsonl, leaderboard.md, leaderboard.html and PNG plots into --out, and print "
                                   "the leaderboard. Re-running with the same --out resumes an interrupted suite and "
                                   "adds what a changed suite runs anew (more seeds, steps); records it no longer "
                                   "produces are kept in records.earlier.jsonl, never deleted.")
    p.add_argument("suite", metavar="SUITE|FILE", help=f"preset ({', '.join(preset_names()) or 'none found'}) or a YAML file")
    p.add_argument("--out", metavar="DIR", help="results folder (default: results/SUITE-TIMESTAMP)")
    p.add_argument("--tracks", metavar="A,B", help="run only these tracks of the suite (records of its other tracks in --out stay, and "
                                                   "the leaderboard shows every track there)")
    p.add_argument("--fresh", action="store_true",
                   help="move the records already in --out aside (records-TIMESTAMP.jsonl) and run everything again")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--against", metavar="ROW", help=_AGAINST_HELP)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("show", help="print the leaderboard of one or more runs (merged in memory)",
                       description="Read records from run folders (or records.jsonl files), refuse bad records and "
                                   "unequal budgets, and print the ranked tables.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folder or records.jsonl")
    p.add_argument("--allocators", metavar="A,B", help="show only these rows (e.g. the rows that ran on every seed); a comma "
                                                       "inside a row's parentheses belongs to its name")
    p.add_argument("--seeds", metavar="S,T", help="show only the records of these seeds (e.g. the seeds every row ran)")
    p.add_argument("--steps", metavar="N", type=int, help=_STEPS_HELP)
    p.add_argument("--against", metavar="ROW", help=_AGAINST_HELP)
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("merge", help="merge the records of several runs or machines into one leaderboard",
                       description="Merge records from several runs (checked: schema, budget arithmetic, digest, "
                                   "duplicates, equal budgets per group) into --out with records.jsonl, "
                                   "leaderboard.md, leaderboard.html and plots.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folder or records.jsonl")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the merged leaderboard")
    p.add_argument("--title", default="trace-gym leaderboard (merged)", help="page title")
    p.add_argument("--steps", metavar="N", type=int, help=_STEPS_HELP + "; the records written are the cut ones")
    p.add_argument("--against", metavar="ROW", help=_AGAINST_HELP)
    p.set_defaults(func=cmd_merge)
    p = sub.add_parser("compare", help="which rows of two runs generated the same, and the step where the others part",
                       description="Pair the rows of two runs (track kind, env, allocator, seed) and compare them step "
                                   "by step by their generation fingerprints (records written before those existed: by "
                                   "token counts). Exit status 0 when every row both runs hold generated the same at "
                                   "every step both ran, 3 otherwise.")
    p.add_argument("a", metavar="A", help="run folder or records.jsonl")
    p.add_argument("b", metavar="B", help="run folder or records.jsonl")
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("suites", help="list the preset suites")
    p.set_defaults(func=cmd_suites)


if __name__ == "__main__":  # pragma: no cover
    from trace_gym.cli.main import main

    sys.exit(main(["leaderboard", *sys.argv[1:]]))
