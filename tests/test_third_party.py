"""A third-party allocator registered by entry point runs in `trace-gym bench`, a suite and
`trace-gym train`, without touching this project."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TRACE_GYM = str(Path(sys.executable).with_name("trace-gym"))

PACKAGE = '''
import numpy as np
from trace_gym import Allocator


class EveryOther(Allocator):
    """Gives `k` rollouts to every other candidate prompt and never branches."""

    name = "every-other"
    default_predictor = None
    advantage = "grpo"

    def __init__(self, k: int = 4):
        super().__init__()
        self.k = k

    def plan_roots(self, forest, budget, predictor):
        counts = np.zeros(forest.n_trees, dtype=np.int64)
        take = min((forest.n_trees + 1) // 2, budget.trajectories // self.k)
        counts[::2][:take] = self.k
        return counts
'''


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("site")
    (root / "everyother_pkg").mkdir()
    (root / "everyother_pkg" / "__init__.py").write_text(PACKAGE)
    info = root / "everyother_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: everyother-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[trace_gym.allocators]\nevery-other = everyother_pkg:EveryOther\n")
    return root


def _run(args: list[str], plugin_path: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(plugin_path)}
    return subprocess.run([TRACE_GYM, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_plugin_allocator_runs_in_bench(plugin_path, tmp_path):
    out = tmp_path / "bench.json"
    r = _run(["bench", "allocators", "--allocators", "grpo,every-other:k=4", "--steps", "2", "--prompts", "32",
              "--trajectories", "64", "--tasks", "128", "--quiet", "--json", str(out)], plugin_path, tmp_path)
    assert r.returncode == 0, r.stderr + r.stdout
    rows = json.loads(out.read_text())["allocators"]
    assert rows["every-other:k=4"]["trajectories"] == 64 and rows["every-other:k=4"]["prompts"] == 16


def test_plugin_allocator_runs_in_a_suite(plugin_path, tmp_path):
    suite = tmp_path / "suite.yaml"
    suite.write_text(textwrap.dedent("""
        suite: plugin
        tracks:
          - name: sim
            kind: allocation
            envs: [ContrastLab-v0]
            policy: {name: sim}
            allocators: [grpo, "every-other:k=4"]
            budget: {trajectories: 64, prompts: 32}
            steps: 2
    """))
    r = _run(["leaderboard", "run", str(suite), "--out", str(tmp_path / "out"), "--no-progress"], plugin_path, tmp_path)
    assert r.returncode == 0, r.stderr + r.stdout
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines() if line.strip()]
    assert {rec["allocator_name"] for rec in records} == {"grpo", "every-other"}


def test_plugin_allocator_runs_in_train(plugin_path, tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text(textwrap.dedent(f"""
        steps: 2
        output_dir: {tmp_path / 'run'}
        deterministic: false
        envs: [{{id: trace_gym/ContrastLab-v0, kwargs: {{n_tasks: 128, n_test: 32}}}}]
        model: {{name: sim}}
        sft: {{enabled: false}}
        allocator: "every-other:k=4"
        budget: {{trajectories: 64, prompts: 32}}
        eval: {{every: 0}}
        checkpoint: {{every: 0}}
        log: {{progress: false, tensorboard: false}}
    """))
    r = _run(["train", "--config", str(config)], plugin_path, tmp_path)
    assert r.returncode == 0, r.stderr + r.stdout
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [m["spent/trajectories"] for m in metrics] == [64, 64]
    assert all(m["spent/prompts"] == 16 for m in metrics)
