"""``trace-gym envs`` with the network unreachable: it finishes in seconds (the Hub is found
unreachable at once and loaders are switched offline, no retries), gives full reasons, and
never marks an env that cannot load as "ok", with or without ``--no-tools``.

"Unreachable" is simulated without touching any real host: the Hub endpoint and every proxy
point at a closed local port, the offline switches are unset, and ``HF_HOME`` is an empty
folder (nothing cached).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

TRACE_GYM = [sys.executable, "-m", "trace_gym.cli"]
HUB_DATASET_ENVS = ["trace_gym/GSM8K-v0", "trace_gym/MATH-v0", "trace_gym/HotpotQA-v0"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def unreachable(tmp_path) -> dict[str, str]:
    port = _closed_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "NO_PROXY", "no_proxy")}
    dead = f"http://127.0.0.1:{port}"
    env.update(HF_ENDPOINT=dead, HTTPS_PROXY=dead, HTTP_PROXY=dead, https_proxy=dead, http_proxy=dead, ALL_PROXY=dead,
               HF_HOME=str(tmp_path / "hf"), COLUMNS="80")
    return env


def _run(args: list[str], env: dict[str, str], timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run(TRACE_GYM + args, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def _assert_quiet(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "Retry" not in proc.stderr and "huggingface.co" not in proc.stderr, proc.stderr[-2000:]


def test_envs_finishes_within_5_s_and_reports_hub_envs_unavailable(unreachable):
    proc, elapsed = _run(["envs", "--json"], unreachable)
    _assert_quiet(proc)
    rows = {r["id"]: r for r in json.loads(proc.stdout)}
    for env_id in HUB_DATASET_ENVS:
        status = rows[env_id]["status"]
        assert status.startswith("unavailable") and "Hugging Face Hub" in status and "cannot connect" in status, status
        assert status.endswith("arguments)")  # the whole reason, not cut
    assert rows["trace_gym/MathCalc-v0"]["status"] == "ok" and rows["trace_gym/MathCalc-v0"]["tools"] == ["calculator"]
    if elapsed >= 5.0:
        # a loaded machine: the time must still be building, not waiting on the network; the
        # same listing with the Hub switched off explicitly is the reference
        reference = dict(unreachable, HF_HUB_OFFLINE="1")
        _, ref_elapsed = _run(["envs", "--json"], reference)
        assert elapsed < ref_elapsed + 2.0, f"{elapsed:.1f} s offline-undetected vs {ref_elapsed:.1f} s with HF_HUB_OFFLINE=1"


def test_no_tools_never_marks_a_hub_env_ok(unreachable):
    proc, _ = _run(["envs", "--no-tools", "--json"], unreachable)
    _assert_quiet(proc)
    rows = {r["id"]: r for r in json.loads(proc.stdout)}
    for env_id in HUB_DATASET_ENVS:
        assert rows[env_id]["status"] != "ok" and "Hugging Face Hub" in rows[env_id]["status"]
    assert rows["trace_gym/ToolCalls-v0"]["status"] == "ok"


def test_the_table_shows_whole_reasons_on_a_narrow_terminal(unreachable):
    proc, _ = _run(["envs", "--no-tools"], unreachable)
    _assert_quiet(proc)
    assert "…" not in proc.stdout  # nothing ellipsised
    # the reason's last words survive, folded over lines inside the status column
    cells = "".join(line.split("│")[3].strip() for line in proc.stdout.splitlines() if line.count("│") >= 4)
    assert "trace_gym/GSM8K-v0" in "".join(line.split("│")[1].strip() for line in proc.stdout.splitlines()
                                           if line.count("│") >= 4)
    assert "data_files/patharguments)" in cells.replace(" ", "").replace("(see its", "")


def test_hub_probe_is_fast_and_says_why(unreachable, monkeypatch):
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in unreachable.items():
        monkeypatch.setenv(key, value)
    from trace_gym.rollout import preflight

    monkeypatch.setattr(preflight, "_HUB_STATUS", {})
    t0 = time.monotonic()
    reason = preflight.hub_unreachable()
    assert time.monotonic() - t0 < 2.5
    assert reason is not None and "proxy 127.0.0.1" in reason
    monkeypatch.setattr(preflight, "_HUB_STATUS", {})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert preflight.hub_unreachable() == "HF_HUB_OFFLINE is set"
    assert not preflight.hub_dataset_cached("openai/gsm8k")
    cached = Path(unreachable["HF_HOME"]) / "hub" / "datasets--openai--gsm8k"
    cached.mkdir(parents=True)
    assert preflight.hub_dataset_cached("openai/gsm8k")
