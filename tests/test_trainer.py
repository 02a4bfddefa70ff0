"""The RL trainer end to end on CPU: a run killed with SIGKILL mid-step and resumed (after its
newest checkpoint was damaged) produces exactly the metrics of an uninterrupted run; bad
configs name their key; `trace-gym eval` reports mean@k and pass@k.

The policy is a real (micro) Qwen3 model of the tiny preset, warm-started by SFT on
ContrastLab demonstrations of one-step tasks with two options, so its rewards are mixed from
the first step and every RL step makes a real update. The preset and the warm start are
cached in a shared temporary cache, so only the first test session pays for them.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

CACHE = Path(tempfile.gettempdir()) / f"trace-gym-test-cache-{os.getuid()}"

MICRO = {
    "seed": 3,
    "steps": 5,
    "deterministic": True,
    "envs": [{"id": "trace_gym/ContrastLab-v0", "kwargs": {"n_options": 2, "turns": [1, 1], "n_tasks": 256, "n_test": 64}}],
    "model": {
        "name": "tiny",
        "threads": 1,
        "tiny": {"envs": ["trace_gym/ContrastLab-v0"], "hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                 "intermediate_size": 128, "corpus_tasks": 100, "vocab_size": 400},
    },
    "sft": {"envs": [{"id": "trace_gym/ContrastLab-v0", "kwargs": {"n_options": 2, "turns": [1, 1], "n_tasks": 256, "n_test": 64}}],
            "tasks": 320, "epochs": 3, "lr": 5e-3, "batch_size": 16, "strip_thoughts": True},
    "rollout": {"prompts_per_step": 8, "max_new_tokens": 12},
    "allocator": {"name": "trace", "trajectories": 16},
    "predictor": {"name": "hashed"},
    "optim": {"lr": 5e-4},
    "eval": {"every": 2, "tasks": 8, "k": 2},
    "checkpoint": {"every": 1, "keep_last": 2},
    "log": {"tensorboard": False, "progress": False},
}


def _env() -> dict:
    env = dict(os.environ, TRACE_GYM_CACHE=str(CACHE), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _config(tmp_path: Path, name: str, **changes) -> Path:
    cfg = json.loads(json.dumps(MICRO))
    cfg["output_dir"] = str(tmp_path / name)
    cfg.update(changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trace_gym.cli.main", "train", "--config", str(config), *extra],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _comparable(records: list[dict]) -> dict[int, dict]:
    """Per step, every metric except wall-clock times (and the step-0 evaluation, which a
    resumed run does not repeat)."""
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith("time/")} for r in records if r["step"] > 0}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run (it also builds the cached preset and warm start)."""
    tmp = tmp_path_factory.mktemp("ref")
    proc = _train(_config(tmp, "ref"))
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return tmp / "ref", err


def test_uninterrupted_run_learns_and_logs_every_metric(reference):
    run, _ = reference
    records = _records(run)
    steps = [r for r in records if "effective_ratio" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    first = steps[0]
    for key in ("effective_ratio", "effective_sample_ratio", "reward/mean", "reward/std", "predictor/brier", "predictor/ece",
                "predictor/auc", "branches", "depth_hist", "spent/trajectories", "spent/generated_tokens", "spent/tool_calls",
                "time/rollout", "time/update", "update/clip_low", "update/clip_high", "update/entropy", "update/kl",
                "update/grad_norm"):
        assert key in first, key
    assert all(0 < r["spent/trajectories"] <= 16 for r in steps)  # never over the budget
    assert 0 < first["reward/mean"] < 1 and first["effective_ratio"] > 0  # mixed groups: real contrast
    assert all(r["update/trained_tokens"] > 0 and r["update/grad_norm"] > 0 for r in steps)  # real updates
    evals = [r for r in records if "eval/ContrastLab-v0/mean@k" in r]
    assert [r["step"] for r in evals] == [0, 2, 4, 5]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000004", "step-00000005"]


def test_sigkill_mid_step_then_resume_matches_uninterrupted_run(reference, tmp_path):
    ref_run, _ = reference
    config = _config(tmp_path, "killed")
    run = tmp_path / "killed"
    proc = _train(config)
    # wait until step 2 is logged, then kill the process part-way into step 3
    deadline = time.time() + 300
    while time.time() < deadline:
        if (run / "metrics.jsonl").exists() and any(r["step"] == 2 and "effective_ratio" in r for r in _records(run)):
            break
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    step2 = next(r for r in _records(run) if r["step"] == 2 and "effective_ratio" in r)
    time.sleep(0.5 * step2["time/step"])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    done = max(r["step"] for r in _records(run))
    assert done < 5, "the run finished before it could be killed"

    # damage the newest checkpoint: the resumed run must report it and use the one before
    ckpts = sorted((run / "checkpoints").glob("step-*"))
    newest = ckpts[-1] / "model.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))

    proc = _train(config, "--resume")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "corrupt" in err and f"step {int(ckpts[-1].name.split('-')[1])}" in err
    assert f"resumed from the checkpoint of step {int(ckpts[-2].name.split('-')[1])}" in err
    got, want = _comparable(_records(run)), _comparable(_records(ref_run))
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in sorted(want):
        assert got[step] == want[step], f"step {step} differs after resume"


def test_bad_config_names_the_key(tmp_path, capsys):
    from trace_gym.cli.main import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"allocator": {"nmae": "grpo"}, "optim": {"lr": -1}}))
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "allocator.nmae: unknown key (did you mean 'allocator.name'?)" in err
    assert "optim.lr" in err
    assert main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "steps=0"]) == 2
    assert "steps" in capsys.readouterr().err
    # every key is documented once
    assert main(["train", "--help-config"]) == 0
    doc = capsys.readouterr().out
    for key in ("allocator.name:", "loss.eps_high:", "optim.lr:", "model.lora_rank:", "sft.strip_thoughts:", "eval.k:"):
        assert key in doc


def test_eval_reports_mean_and_pass_at_k(reference, tmp_path, capsys, monkeypatch):
    from trace_gym.cli.main import main

    monkeypatch.setenv("TRACE_GYM_CACHE", str(CACHE))
    run, _ = reference
    config = tmp_path / "ref.yaml"
    cfg = dict(MICRO, output_dir=str(run))
    config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "eval.json"
    assert main(["eval", "--config", str(config), "--tasks", "8", "--k", "4", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "step 5" in res["model"]
    r = res["envs"]["trace_gym/ContrastLab-v0"]
    assert r["tasks"] == 8 and r["episodes"] == 32 and r["k"] == 4
    assert 0.0 <= r["mean@k"] <= r["pass@k"] <= 1.0
    assert "mean@k" in capsys.readouterr().out
