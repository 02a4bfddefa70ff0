"""A user's first hour with ``trace-gym``: every user error is one ``error: ...`` line (what
was wrong and what is allowed) with exit status 2 and no traceback, ``--debug`` /
``TRACE_GYM_DEBUG=1`` show the traceback, a failed start leaves no run folder, servers are
checked before the first step, names are discoverable (``list``, ``--version``, short env
ids, ``--model tiny``) and tables never cut names.

Each command runs as a subprocess, as a user types it (offline: ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

BIN = Path(sys.executable).with_name("trace-gym")
TRACE_GYM = [str(BIN)] if BIN.exists() else [sys.executable, "-c", "import sys; from trace_gym.cli import main; sys.exit(main())"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRACE_GYM_DEBUG", "TRACE_GYM_PLUGINS")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", COLUMNS="100")
    env.update(extra)
    return env


def run(*args: str, cwd: Path | None = None, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(TRACE_GYM + [str(a) for a in args], cwd=cwd, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *expected: str) -> str:
    """Exit status 2, no traceback, and stderr is exactly one ``error: ...`` line holding ``expected``."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for text in expected:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- one-line errors

BAD_COMMANDS = {
    "unknown env": (["rollout", "NoSuch-v0", "--policy", "sim"], ["unknown environment 'trace_gym/NoSuch-v0'", "trace-gym list envs"]),
    "misspelt env": (["play", "MathClac-v0"], ["did you mean 'trace_gym/MathCalc-v0'"]),
    "allocator option key": (["rollout", "MathCalc-v0", "--policy", "sim", "--allocator", "trace:stag1=uniform"],
                             ["unknown option 'stag1'", "did you mean 'stage1'", "options: stage1, stage2"]),
    "allocator option value": (["bench", "allocators", "--allocators", "grpo,trace:stage1=foo", "--steps", "1"],
                               ["--allocators trace:stage1=foo", "stage1 must be one of", "'uniform'"]),
    "world value": (["bench", "allocators", "--world", "step_spread=abc"], ["--world step_spread", "'abc'"]),
    "world shape": (["bench", "allocators", "--world", "turns=-3"], ["--world turns", "turns=[2,6]", "-3"]),
    "world range": (["bench", "allocators", "--world", "turns=[3,1]"], ["--world", "turns must be"]),
    "env argument": (["play", "MathCalc-v0", "--env-arg", "nosuch=1"],
                     ["takes no argument 'nosuch'", "its arguments: seed, levels"]),
    "rollout model": (["rollout", "MathCalc-v0", "--model", "/nonexistent/model"], ["'/nonexistent/model'", "tiny", "smollm2-135m"]),
    "eval env argument": (["eval", "--model", "tiny", "--env", "MathCalc-v0", "--env-arg", "nosuch=1", "--tasks", "1"],
                          ["takes no argument 'nosuch'", "levels"]),
    "eval env": (["eval", "--model", "tiny", "--env", "MathClac-v0", "--tasks", "1"], ["did you mean 'trace_gym/MathCalc-v0'"]),
    "eval model": (["eval", "--model", "/nonexistent/model", "--tasks", "1"], ["'/nonexistent/model'", "tiny"]),
}


@pytest.mark.parametrize("case", list(BAD_COMMANDS))
def test_user_errors_are_one_line(case, tmp_path):
    args, expected = BAD_COMMANDS[case]
    assert_one_line_error(run(*args, cwd=tmp_path), *expected)
    assert not any(tmp_path.iterdir())  # nothing written


def test_train_with_a_missing_model_leaves_no_run_folder(tmp_path):
    proc = run("train", "model.name=/nonexistent/model", f"output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_one_line_error(proc, "'/nonexistent/model'", "tiny")
    assert not (tmp_path / "run").exists()


def test_a_start_that_fails_inside_the_trainer_removes_its_run_folder(tmp_path, capsys):
    # the trainer creates its folder, then refuses the simulated policy on a text env (in
    # process: the subprocess cases above already cover the one-line report)
    from trace_gym.cli.main import main

    assert main(["train", "model.name=sim", f"output_dir={tmp_path / 'run'}", "steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "ContrastLab" in err
    assert not (tmp_path / "run").exists()


def test_leaderboard_run_into_a_folder_with_a_corrupt_record_file(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "records.jsonl").write_text("{not a record\n")
    suite = tmp_path / "s.yaml"
    suite.write_text(textwrap.dedent("""\
        suite: tiny
        tracks:
          - {name: t, kind: allocation, envs: [ContrastLab-v0], policy: {name: sim}, allocators: [grpo],
             budget: {trajectories: 8, prompts: 4}, steps: 1}
    """))
    proc = run("leaderboard", "run", suite, "--out", out, "--no-progress", cwd=tmp_path)
    assert_one_line_error(proc, f"{out / 'records.jsonl'}:1", "--fresh")
    assert (out / "records.jsonl").read_text() == "{not a record\n"  # left as it was


@pytest.mark.parametrize("how", ["--debug", "TRACE_GYM_DEBUG"])
def test_debug_shows_the_traceback(how):
    args = ["play", "MathCalc-v0", "--env-arg", "nosuch=1"]
    proc = run(*args, "--debug") if how == "--debug" else run(*args, TRACE_GYM_DEBUG="1")
    assert proc.returncode != 0 and "Traceback (most recent call last)" in proc.stderr
    assert "takes no argument 'nosuch'" in proc.stderr


def test_an_internal_error_says_so_and_points_at_debug(tmp_path):
    plugin = tmp_path / "broken.py"
    plugin.write_text(textwrap.dedent("""\
        import trace_gym
        from trace_gym.cli import main as cli_main

        def boom(args):
            raise TypeError("a bug")

        def cmd(subparsers):
            p = subparsers.add_parser("boom")
            p.set_defaults(func=boom)
            return p
    """))
    # an entry point of a throwaway distribution adds the command
    dist = tmp_path / "broken_cmd-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-cmd\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[trace_gym.commands]\nboom = broken:cmd\n")
    proc = run("boom", PYTHONPATH=str(tmp_path))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("error: internal error: TypeError: a bug (run with --debug or TRACE_GYM_DEBUG=1 for the "
                                   "traceback)")


# ----------------------------------------------------------------------------- servers before the first step


def test_train_stops_before_the_first_step_when_the_retrieval_server_is_down(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    config = tmp_path / "run.yaml"
    config.write_text(f"envs:\n  - id: MultiHopQA-v0\n    kwargs: {{retriever: '{url}'}}\noutput_dir: {tmp_path / 'run'}\n")
    proc = run("train", "--config", config, cwd=tmp_path)
    assert_one_line_error(proc, f"the server at {url}", "environment trace_gym/MultiHopQA-v0", "does not answer")
    assert not (tmp_path / "run").exists()


def test_leaderboard_stops_before_the_first_step_when_the_model_server_is_down(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    suite = tmp_path / "s.yaml"
    suite.write_text(textwrap.dedent(f"""\
        suite: served
        tracks:
          - {{name: t, kind: allocation, envs: [MathCalc-v0], policy: {{name: openai, kwargs: {{base_url: "{url}"}}}},
             allocators: [grpo], budget: {{trajectories: 4, prompts: 2}}, steps: 1}}
    """))
    proc = run("leaderboard", "run", suite, "--out", tmp_path / "out", "--no-progress", cwd=tmp_path)
    assert_one_line_error(proc, f"the server at {url}", "policy 'openai'", "vllm serve")
    assert not (tmp_path / "out").exists()


def test_rollout_checks_the_retrieval_server_first(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    proc = run("rollout", "MultiHopQA-v0", "--policy", "sim", "--env-arg", f"retriever={url}", cwd=tmp_path)
    assert_one_line_error(proc, f"the server at {url}")


# ----------------------------------------------------------------------------- names


def test_version():
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"trace-gym {metadata.version('trace-gym')}"


def test_list_names_every_kind_including_plugins(tmp_path):
    # a plug-in distribution (dist-info with entry points) and an in-process plug-in (--plugin)
    (tmp_path / "acme_alloc.py").write_text(textwrap.dedent("""\
        import numpy as np
        import trace_gym
        from trace_gym import Allocator

        class EveryOther(Allocator):
            \"\"\"Two rollouts for every other prompt (a test plug-in).\"\"\"
            name = "acme-every-other"

            def plan_roots(self, forest, budget, predictor):
                counts = np.zeros(forest.n_trees, dtype=np.int64)
                counts[::2] = 2
                counts[np.cumsum(counts) > budget.trajectories] = 0
                return counts

        def acme_model_dir():
            \"\"\"A test alias that is never built.\"\"\"
            raise AssertionError("not built by a listing")
    """))
    dist = tmp_path / "acme_alloc-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-alloc\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[trace_gym.allocators]\nacme-every-other = acme_alloc:EveryOther\n\n"
                                           "[trace_gym.models]\nacme-model = acme_alloc:acme_model_dir\n")
    (tmp_path / "mine.py").write_text(textwrap.dedent("""\
        import trace_gym
        from trace_gym.allocators.grpo import GRPOAllocator

        @trace_gym.register_allocator("my-grpo")
        class MyGRPO(GRPOAllocator):
            \"\"\"GRPO under another name, registered in-process.\"\"\"
            name = "my-grpo"
    """))
    proc = run("--plugin", tmp_path / "mine.py", "list", "--json", PYTHONPATH=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    listing = json.loads(proc.stdout)
    assert set(listing) == {"envs", "allocators", "predictors", "advantages", "policies", "models"}
    names = {kind: {r["name"]: r for r in rows} for kind, rows in listing.items()}
    assert {"grpo", "trace", "acme-every-other", "my-grpo"} <= set(names["allocators"])
    assert "acme-alloc" in names["allocators"]["acme-every-other"]["source"]
    assert "registered in-process" in names["allocators"]["my-grpo"]["source"]
    assert {"tiny", "smollm2-135m", "acme-model"} <= set(names["models"])
    assert {"hashed", "beta"} <= set(names["predictors"]) and {"grpo", "trace"} <= set(names["advantages"])
    assert {"hf", "openai", "sim"} <= set(names["policies"]) and "trace_gym/MathCalc-v0" in names["envs"]
    # a module docstring opening with its registered name as a label ("``greso``: GRESO's ...")
    # is shown without the label, which the name column already shows
    assert names["allocators"]["greso"]["description"].startswith("GRESO's selective rollouts")
    assert names["predictors"]["beta"]["description"].startswith("A Beta posterior per prompt")
    labelled = [(kind, n) for kind, rows in names.items() for n, r in rows.items()
                if r["description"].startswith((n + ":", n[:1].upper() + n[1:] + ":"))]
    assert not labelled, labelled
    # the plug-ins reach the commands: an in-process one with --plugin, an installed one by name
    bench = run("--plugin", tmp_path / "mine.py", "bench", "allocators", "--allocators", "grpo,my-grpo,acme-every-other",
                "--steps", "1", "--prompts", "16", "--trajectories", "32", "--tasks", "64", "--quiet", PYTHONPATH=str(tmp_path))
    assert bench.returncode == 0, bench.stderr
    assert "my-grpo" in bench.stdout and "acme-every-other" in bench.stdout
    one = run("list", "models")
    assert one.returncode == 0 and "tiny" in one.stdout and "smollm2-135m" in one.stdout


def test_play_takes_a_short_env_id_and_plays_the_demonstration():
    proc = run("play", "MathCalc-v0", "--demo")
    assert proc.returncode == 0, proc.stderr
    assert "reward 1" in proc.stdout and "agent, turn 1" in proc.stdout


def test_model_tiny_is_an_alias(tmp_path):
    proc = run("rollout", "ToolCalls-v0", "--model", "tiny", "--trajectories", "2", "--prompts", "1", "--max-new-tokens",
               "4", "--max-turns", "1", "--out", tmp_path / "trees.jsonl", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stderr[proc.stderr.index("{"):])
    assert summary["spend"]["trajectories"] == 2 and (tmp_path / "trees.jsonl").stat().st_size > 0


# ----------------------------------------------------------------------------- tables


def _bench_result(names: list[str], spends: list[float]) -> dict:
    row = lambda t: {"effective_ratio": 0.5, "effective_sample_ratio": {"trajectories": 0.4, "tokens": 0.3, "advantage": "trace"},  # noqa: E731
                     "effective_sample_ratio_by_advantage": {"grpo": {"trajectories": 0.4}, "trace": {"trajectories": 0.35}},
                     "trajectories": t, "tokens": 123456.0, "prompts": 64.0, "brier": 0.2, "auc": 0.7, "ms_per_step": 1.5}
    out = {"config": {"trajectories": 10, "prompts": 64, "steps": 5, "difficulty": "beta:0.5,0.5"},
           "allocators": {n: row(t) for n, t in zip(names, spends)}}
    for n in names[1:]:  # rows that branch
        out["allocators"][n]["branch_flips"] = {"flip_rate": 0.125, "pure_trees_mixed": 0.25}
    return out


def _column(text: str, index: int) -> str:
    """The cells of table column ``index`` (rich's box drawing), top to bottom, joined."""
    return "".join(line.split("│")[index].strip() for line in text.splitlines() if line.count("│") > index)


@pytest.mark.parametrize("width", [80, 120])
def test_bench_table_never_cuts_names_and_flags_unequal_spend(width):
    from rich.console import Console

    from trace_gym.cli.bench import print_table

    names = ["grpo", "trace:stage1=uniform:stage2=uniform", "trace:stage1=uniform", "trace:stage2=uniform"]
    out = io.StringIO()
    print_table(_bench_result(names, [8.0, 10.0, 10.0, 10.0]), Console(file=out, width=width, color_system=None))
    text = out.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= width
    tables = [t for t in text.split("┏")[1:]]
    headers: dict[str, str] = {}
    for t in tables:  # a table too wide is split in several, each repeating the allocator column whole
        assert _column(t, 1) == "".join(names)
        head = [h.strip() for line in t.splitlines() if line.startswith("┃") for h in line.split("┃")[1:-1]]
        headers.update({h: _column(t, i + 1) for i, h in enumerate(head) if h})
    assert {"allocator", "adv.", "ESR", "traj/step", "tokens/step", "Brier", "AUC", "ms/step"} <= set(headers)
    assert headers["traj/step"].replace(" ", "").startswith("8.000*")  # grpo spent 8 of 10 ...
    assert headers["tokens/step"].replace(" ", "") == "123,456" * 4
    assert headers["flips"].replace(" ", "") == "-" + "12.5%" * 3  # grpo never branches
    flat = " ".join(text.split())
    assert "* spent a different number of trajectories per step than most rows (10)" in flat  # ... and it says so
    assert "ESR: effective sample ratio" in flat and "ms/step:" in flat  # the legend


def test_bench_table_without_unequal_spend_has_no_flag():
    from rich.console import Console

    from trace_gym.cli.bench import print_table

    out = io.StringIO()
    print_table(_bench_result(["grpo", "trace"], [10.0, 10.0]), Console(file=out, width=200, color_system=None))
    assert "*" not in out.getvalue()
