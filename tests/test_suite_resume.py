"""Re-running a suite into the same ``--out`` never loses a record: another seed adds its
records beside the earlier ones (byte for byte unchanged), records the suite no longer
produces are kept in ``records.earlier.jsonl`` (and reused if the suite asks for them
again), and ``--fresh`` moves the old files aside under timestamped names. Also: the
leaderboard's terminal tables never cut a name, say which advantage produced each row's
sample ratios, explain their abbreviations and flag rows whose spend differs.

Suites here run ContrastLab's simulated policy at a tiny budget (seconds).
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import yaml

from trace_gym.cli.main import main
from trace_gym.leaderboard import load_records, rank
from trace_gym.leaderboard.render import _table, legend_line, render_markdown, rich_tables

ALLOCATORS = ["grpo", "uniform", "trace:stage1=uniform:stage2=uniform"]
KEYS = ["grpo", "uniform", "trace(stage1=uniform,stage2=uniform)"]


def write_suite(path: Path, *, seeds=(0,), steps: int = 1) -> Path:
    path.write_text(yaml.safe_dump({
        "suite": "resume", "seeds": list(seeds),
        "tracks": [{"name": "lab", "kind": "allocation", "envs": ["ContrastLab-v0"], "policy": {"name": "sim"},
                    "allocators": ALLOCATORS, "budget": {"trajectories": 32, "prompts": 16}, "steps": steps}],
    }, sort_keys=False))
    return path


def run(suite: Path, out: Path, *extra: str) -> None:
    assert main(["leaderboard", "run", str(suite), "--out", str(out), "--no-progress", *extra]) == 0


def lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> Path:
    """A results folder after one run of the suite with seed 0."""
    root = tmp_path_factory.mktemp("resume")
    run(write_suite(root / "s.yaml"), root / "out")
    return root / "out"


def _copy(first: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(first, tmp_path / "out")
    return tmp_path / "out"


def test_one_more_seed_keeps_every_earlier_record_and_adds_the_new_ones(first, tmp_path):
    out = _copy(first, tmp_path)
    before = lines(out / "records.jsonl")
    assert len(before) == len(ALLOCATORS)
    run(write_suite(tmp_path / "s.yaml", seeds=(0, 1)), out)
    after = lines(out / "records.jsonl")
    assert after[: len(before)] == before  # untouched, byte for byte
    records = [lr.record for lr in load_records([out])]
    assert sorted((r.allocator, r.seed) for r in records) == sorted((a, s) for a in KEYS for s in (0, 1))
    assert not (out / "records.earlier.jsonl").exists()


def test_fresh_moves_the_old_file_aside_under_a_timestamped_name(first, tmp_path, capsys):
    out = _copy(first, tmp_path)
    before = (out / "records.jsonl").read_text()
    run(write_suite(tmp_path / "s.yaml"), out, "--fresh")
    moved = [p for p in out.iterdir() if re.fullmatch(r"records-\d{8}-\d{6}(-\d+)?\.jsonl", p.name)]
    assert len(moved) == 1 and moved[0].read_text() == before
    assert str(moved[0]) in capsys.readouterr().err
    # a new run: the same runs again (same seed: same figures), new records
    assert len(lines(out / "records.jsonl")) == len(ALLOCATORS) and (out / "records.jsonl").read_text() != before


def test_records_a_changed_suite_no_longer_runs_are_kept_and_reused(first, tmp_path):
    out = _copy(first, tmp_path)
    original = lines(out / "records.jsonl")
    run(write_suite(tmp_path / "s.yaml", steps=2), out)  # every row runs again at the new step count
    assert sorted(lines(out / "records.earlier.jsonl")) == sorted(original)
    assert {r.record.budget.steps for r in load_records([out])} == {2}
    assert "records.earlier.jsonl" in (out / "leaderboard.md").read_text()  # shown as such
    two_steps = lines(out / "records.jsonl")
    run(write_suite(tmp_path / "s.yaml", steps=1), out)  # back: the kept records are used, nothing reruns
    assert sorted(lines(out / "records.jsonl")) == sorted(original)
    assert sorted(lines(out / "records.earlier.jsonl")) == sorted(two_steps)


def test_tracks_run_one_at_a_time_fill_one_folder(tmp_path):
    """``--tracks A`` then ``--tracks B`` into one folder: B's run leaves A's records where they
    are (not set aside as no longer run), and the leaderboard shows both tracks."""
    suite = tmp_path / "two.yaml"
    track = {"kind": "allocation", "envs": ["ContrastLab-v0"], "policy": {"name": "sim"}, "allocators": ["grpo", "uniform"],
             "budget": {"trajectories": 32, "prompts": 16}, "steps": 1}
    suite.write_text(yaml.safe_dump({"suite": "two", "seeds": [0], "tracks": [{"name": "a", **track},
                                                                               {"name": "b", **track, "envs": [{"id": "ContrastLab-v0", "kwargs": {"difficulty": "beta:2,2"}}]}]}))
    out = tmp_path / "out"
    run(suite, out, "--tracks", "a")
    a = lines(out / "records.jsonl")
    run(suite, out, "--tracks", "b")
    both = lines(out / "records.jsonl")
    assert both[: len(a)] == a and len(both) == 4 and not (out / "records.earlier.jsonl").exists()
    assert {r.record.track for r in load_records([out])} == {"a", "b"}
    md = (out / "leaderboard.md").read_text()
    assert "a / ContrastLab-v0" in md and "b / ContrastLab-v0" in md
    run(suite, out)  # the whole suite: everything is there, nothing runs again
    assert lines(out / "records.jsonl") == both


# ----------------------------------------------------------------------------- tables


@pytest.fixture(scope="module")
def two_seeds(first, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tables")
    out = _copy(first, root)
    run(write_suite(root / "s.yaml", seeds=(0, 1)), out)
    return out


def _render(tables, width: int) -> str:
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None)
    for t in tables:
        console.print(t)
    return buf.getvalue()


@pytest.mark.parametrize("width", [60, 100])
def test_leaderboard_tables_never_cut_names(two_seeds, width):
    groups = rank(load_records([two_seeds]))
    text = _render(rich_tables(groups, width=width), width)
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= width
    in_order = "".join(row[1] for row in _table(groups[0])[1])
    parts = text.split("┏")[1:]
    assert parts
    for part in parts:  # each table (a split one repeats the rank and allocator columns) holds every name whole
        names = "".join(line.split("│")[2].strip() for line in part.splitlines() if line.count("│") > 3)
        assert names == in_order and sorted(KEYS) == sorted(row[1] for row in _table(groups[0])[1])


def test_each_table_names_the_advantage_and_explains_its_abbreviations(two_seeds):
    (group,) = rank(load_records([two_seeds]))
    head, body = _table(group)
    adv = {row[1]: row[head.index("adv.")] for row in body}
    from trace_gym.run import defaults

    own = {name: str(defaults(name)[1]) for name in ("grpo", "uniform", "trace")}  # each allocator's own estimator
    assert adv == {"grpo": own["grpo"], "uniform": own["uniform"], "trace(stage1=uniform,stage2=uniform)": own["trace"]}
    legend = legend_line(group)
    assert "under the row's advantage estimator (adv.)" in legend and "eff. ratio:" in legend and "±" in legend
    md = render_markdown([group])
    assert legend in md and "| adv. |" in md


def test_rows_whose_spend_differs_are_flagged(two_seeds):
    records = load_records([two_seeds])
    uneven = [lr for lr in records if not (lr.record.allocator == "grpo" and lr.record.seed == 1)]
    (group,) = rank(uneven, check=False)  # grpo now has one seed, the other rows two
    head, body = _table(group)
    spent = {row[1]: row[head.index("trajectories/seed")] for row in body}
    assert spent["grpo"].endswith("*") and not any(spent[k].endswith("*") for k in KEYS[1:])
    assert "* marks rows that spent different trajectories" in render_markdown([group])
    (even,) = rank(records)
    assert not any(row[head.index("trajectories/seed")].endswith("*") for row in _table(even)[1])


def test_parallel_suite_writes_the_records_a_sequential_run_writes(tmp_path):
    """benchmarks/parallel_suite.py runs each (track, allocator) of a suite in its own process
    and merges them; `leaderboard run` on the merged folder then finds every record (same
    rows, budgets and seeds) and runs nothing."""
    import subprocess
    import sys

    import yaml

    repo = Path(__file__).resolve().parents[1]
    suite = tmp_path / "two.yaml"
    suite.write_text(yaml.safe_dump({"suite": "two", "seeds": [0, 1], "tracks": [{
        "name": "cl", "kind": "allocation", "envs": ["trace_gym/ContrastLab-v0"], "policy": {"name": "sim"},
        "allocators": ["grpo", {"name": "trace", "kwargs": {"stage2": "uniform"}, "label": "trace-u"}],
        "budget": {"trajectories": 64, "prompts": 32}, "steps": 2}]}))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(repo / "benchmarks" / "parallel_suite.py"), str(suite), "--out", str(out),
                           "--jobs", "2", "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 of 2 rows finished" in done.stdout
    assert sorted(p.name for p in (out / "parts").glob("*.yaml")) == ["00.yaml", "01.yaml"]
    lines = (out / "records.jsonl").read_text().splitlines()
    assert len(lines) == 4  # 2 allocators x 2 seeds
    again = subprocess.run([sys.executable, "-m", "trace_gym.cli", "leaderboard", "run", str(suite), "--out", str(out),
                            "--no-progress"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert (out / "records.jsonl").read_text().splitlines() == lines  # nothing run again, nothing set aside
    assert not (out / "records.earlier.jsonl").exists()
