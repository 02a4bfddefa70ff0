"""Benchmark suites and the leaderboard: rank allocators at an equal budget.

A *suite* (YAML, validated by :class:`SuiteSpec`) lists tracks of envs x allocators x
seeds at one budget, policy and step count. ``trace-gym leaderboard run quick`` runs one and
writes ``results/RUN/records.jsonl`` (one sealed :class:`Record` per run), ``leaderboard.md``,
a self-contained ``leaderboard.html`` and PNG plots; ``show`` and ``merge`` combine runs from
several machines and refuse bad records, unequal budgets and training rows of one seed
evaluated on different held-out sets (``show --steps N`` reads longer runs as their first N
steps, ``merge --steps N`` writes them so: :func:`~trace_gym.leaderboard.cut.first_steps`;
``--against ROW`` pairs every row with ROW by seed, at the end and, for training, after each
evaluation: :mod:`~trace_gym.leaderboard.paired`); ``compare`` tells which rows of
two runs generated the same (:func:`compare_runs`, by each step's generation fingerprint).

From Python::

    from trace_gym.leaderboard import load_suite, run_suite, load_records, rank, write_leaderboard
    spec = load_suite("quick")
    run_suite(spec, Path("results/quick"))
    groups = rank(load_records(["results/quick"]))     # raises UnequalBudget / RecordError
    write_leaderboard(groups, Path("results/quick"))
"""

from trace_gym.leaderboard.cli import configure_leaderboard
from trace_gym.leaderboard.compare import RowComparison, compare_runs
from trace_gym.leaderboard.records import (
    Group, LoadedRecord, Record, RecordError, Row, UnequalBudget, check_equal_budget, check_equal_evaluation, load_records,
    make_record, rank, write_records,
)
from trace_gym.leaderboard.render import render_html, render_markdown, write_leaderboard, write_plots
from trace_gym.leaderboard.runner import (
    RolloutSource, register_preflight, register_source, register_training_runner, row_spec, run_allocation, run_suite,
)
from trace_gym.leaderboard.spec import SuiteError, SuiteSpec, TrackSpec, load_suite, parse_suite

__all__ = [
    "Group", "LoadedRecord", "Record", "RecordError", "RolloutSource", "Row", "RowComparison", "SuiteError", "SuiteSpec", "TrackSpec",
    "UnequalBudget", "check_equal_budget", "check_equal_evaluation", "compare_runs", "configure_leaderboard", "load_records", "load_suite",
    "make_record", "parse_suite", "rank", "register_source", "register_training_runner", "render_html",
    "render_markdown", "register_preflight", "row_spec", "run_allocation", "run_suite", "write_leaderboard", "write_plots",
    "write_records",
]
