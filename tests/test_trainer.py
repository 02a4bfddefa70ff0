"""The RL trainer end to end on CPU: a run killed with SIGKILL mid-step and resumed (after its
newest checkpoint was damaged) produces exactly the metrics of an uninterrupted run; bad
configs name their key; `trace-gym eval` reports mean@k and pass@k. Reliability: a run whose
checkpoints are all unreadable is refused by name, metrics history is never deleted, the
fingerprint covers the step count where the schedule depends on it, and NaN behaviour
log-probs under importance-sampling correction stop the update with the backend's name.

The policy is a real (micro) Qwen3 model of the tiny preset, warm-started by SFT on
ContrastLab demonstrations of one-step tasks with two options, so its rewards are mixed from
the first step and every RL step makes a real update. The preset and the warm start are
cached in a shared temporary cache, so only the first test session pays for them.
"""

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
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
    "rollout": {"max_new_tokens": 12},
    "allocator": {"name": "trace"},
    "budget": {"trajectories": 16, "prompts": 8},
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
    return subprocess.Popen([sys.executable, "-m", "trace_gym.cli", "train", "--config", str(config), *extra],
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
                "update/grad_norm", "branch/flip_rate", "branch/pure_trees_mixed", "branch/root_disagree_pred",
                "branch/root_disagree_seen", "branch/inner_disagree_pred", "branch/inner_disagree_seen"):
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
    # the record goes out before the step's checkpoint: wait for that too, so two checkpoints exist
    while not (run / "checkpoints" / "step-00000002").exists() and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.02)
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
    # each task's own score: k = 4 samples of a 0/1 reward, averaging to mean@k
    assert len(r["per_task"]) == 8 and all(4 * x == int(4 * x) for x in r["per_task"])
    assert sum(r["per_task"]) / 8 == pytest.approx(r["mean@k"])


def test_a_training_track_records_each_held_out_tasks_score(reference, tmp_path):
    """A leaderboard training track of the real (micro) model keeps each evaluation's
    per-task scores in its records (their mean is the accuracy), and `show --against` turns
    them into the evaluation's own noise on each row's difference."""
    from trace_gym.leaderboard import load_records

    micro = tmp_path / "micro.yaml"
    micro.write_text(yaml.safe_dump(MICRO))
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({"suite": "micro", "description": "micro model training", "seeds": [3], "tracks": [{
        "name": "micro-training", "kind": "training", "envs": MICRO["envs"],
        "policy": {"name": "hf", "model": "tiny", "max_new_tokens": 12, "warm_start": {"config": str(micro)}},
        "allocators": ["grpo", "trace"], "budget": {"trajectories": 16, "prompts": 8}, "steps": 2,
        "trainer": {"config": str(micro)}, "eval": {"split": "test", "tasks": 8, "k": 2, "every": 2}}]}))
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "trace_gym.cli", "leaderboard", "run", str(suite), "--out", str(out), "--no-progress",
                          "--against", "grpo"], env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [lr.record for lr in load_records([out])]
    assert sorted(r.allocator for r in records) == ["grpo", "trace"]
    for r in records:
        assert [e.step for e in r.evals] == [0, 2]
        for e in r.evals:
            assert len(e.task_scores) == 8 and all(2 * x == int(2 * x) for x in e.task_scores)
            assert sum(e.task_scores) / 8 == pytest.approx(e.accuracy)
    assert "| eval noise (95%, tasks paired) |" in (out / "leaderboard.md").read_text()
    # each step keeps the learning rate after its updates (constant here), which a cut to
    # the first steps reads to refuse a schedule that decays over the run
    assert all(s.metrics["lr"] == pytest.approx(MICRO["optim"]["lr"]) for r in records for s in r.steps)
    # and the figures an allocation track's steps keep: rows with different advantages
    # compare under grpo's, and stage 2's calibration is there to read
    for r in records:
        for s in r.steps:
            assert 0 <= s.metrics["effective_sample_ratio/grpo"] <= 1 and s.metrics["allocator_ms"] >= 0
            assert {"root_disagree_pred", "root_disagree_seen", "inner_disagree_pred", "inner_disagree_seen"} <= set(s.metrics)
    grpo = next(r for r in records if r.allocator == "grpo")
    assert all(s.metrics["effective_sample_ratio/grpo"] == s.metrics["effective_sample_ratio"] for s in grpo.steps)


# ----------------------------------------------------------------------------- reliability

SIM = {
    "seed": 1, "steps": 3,
    "envs": [{"id": "trace_gym/ContrastLab-v0", "kwargs": {"n_tasks": 64, "n_test": 16}}],
    "model": {"name": "sim"}, "sft": {"enabled": False}, "allocator": "trace", "budget": {"trajectories": 16, "prompts": 8},
    "checkpoint": {"every": 1, "keep_last": 2}, "log": {"tensorboard": False, "progress": False},
}


def test_eval_env_args_reach_the_evaluated_env(tmp_path):
    # `--env` with a short id keeps the config's kwargs for that env; `--env-arg` goes on top
    import trace_gym
    from trace_gym.cli.main import main

    config = tmp_path / "sim.yaml"
    config.write_text(yaml.safe_dump(dict(SIM, output_dir=str(tmp_path / "run"))))

    def exact(*args: str) -> float:
        out = tmp_path / "eval.json"
        assert main(["eval", "--config", str(config), "--env", "ContrastLab-v0", *args, "--k", "1", "--json", str(out)]) == 0
        return json.loads(out.read_text())["envs"]["eval/ContrastLab-v0/exact_success"]

    def truth(**kwargs) -> float:
        return trace_gym.make("trace_gym/ContrastLab-v0", seed=SIM["seed"], **kwargs).unwrapped.world.mean_success("test")

    as_configured, changed = truth(n_tasks=64, n_test=16), truth(n_tasks=64, n_test=3)
    assert as_configured != changed
    assert exact() == pytest.approx(as_configured)
    assert exact("--env-arg", "n_test=3") == pytest.approx(changed)


def test_eval_keeps_the_figures_of_each_spec_of_an_env_given_twice(tmp_path):
    # easy and hard MathCalc as two specs of one env: each keeps its own figures
    from trace_gym.cli.main import main
    from trace_gym.trainers.evaluate import env_labels

    assert env_labels(["a", "b", "a", "c", "a"]) == ["a#1", "b", "a#2", "c", "a#3"]
    config = tmp_path / "two.yaml"
    config.write_text(yaml.safe_dump({
        "envs": [{"id": "MathCalc-v0", "kwargs": {"levels": [1]}}, {"id": "MathCalc-v0", "kwargs": {"levels": [5]}}],
        "sft": {"enabled": False}, "output_dir": str(tmp_path / "run")}))
    out = tmp_path / "eval.json"
    assert main(["eval", "--config", str(config), "--model", "tiny", "--tasks", "2", "--k", "1",
                 "--max-new-tokens", "8", "--json", str(out)]) == 0
    envs = json.loads(out.read_text())["envs"]
    assert list(envs) == ["trace_gym/MathCalc-v0#1", "trace_gym/MathCalc-v0#2"]
    assert [r["episodes"] for r in envs.values()] == [2, 2]


def _sim_config(tmp_path: Path, **changes):
    from trace_gym.trainers.config import RLConfig

    cfg = json.loads(json.dumps(SIM))
    cfg["output_dir"] = str(tmp_path / "run")
    cfg.update(changes)
    return RLConfig.model_validate(cfg)


def _quiet(msg: str) -> None:
    pass


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_resume_refuses_when_every_checkpoint_is_unreadable(tmp_path, capsys):
    from trace_gym.cli.main import main
    from trace_gym.trainers.checkpoint import CheckpointError
    from trace_gym.trainers.rl import RLTrainer

    cfg = _sim_config(tmp_path)
    RLTrainer(cfg, log=_quiet).train()
    run = Path(cfg.output_dir)
    ckpts = sorted((run / "checkpoints").glob("step-*"))
    assert [c.name for c in ckpts] == ["step-00000002", "step-00000003"]
    for c in ckpts:
        data = bytearray((c / "trainer.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (c / "trainer.pt").write_bytes(bytes(data))
    metrics = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(CheckpointError) as info:
        RLTrainer(cfg, resume=True, log=_quiet)
    for c in ckpts:
        assert str(c) in str(info.value)
    # nothing was touched: no history lost, no checkpoint written or pruned
    assert (run / "metrics.jsonl").read_bytes() == metrics and not (run / "metrics.replaced.jsonl").exists()
    assert sorted((run / "checkpoints").glob("step-*")) == ckpts
    # the command line says why and exits 2
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert main(["train", "--config", str(config), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "none of the 2 checkpoints" in err and str(ckpts[0]) in err
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_metrics_history_is_never_deleted(tmp_path):
    import shutil

    from trace_gym.trainers.rl import RLTrainer

    cfg = _sim_config(tmp_path)
    RLTrainer(cfg, log=_quiet).train()
    run = Path(cfg.output_dir)
    written = _lines(run / "metrics.jsonl")
    assert [json.loads(line)["step"] for line in written] == [1, 2, 3]

    def kept() -> list[str]:
        return _lines(run / "metrics.replaced.jsonl") + _lines(run / "metrics.jsonl")

    # resumed from an earlier checkpoint: the record of step 3 moves aside, then is written again
    shutil.rmtree(run / "checkpoints" / "step-00000003")
    RLTrainer(cfg, resume=True, log=_quiet).train()
    assert [json.loads(line)["step"] for line in _lines(run / "metrics.replaced.jsonl")] == [3]
    assert [json.loads(line)["step"] for line in _lines(run / "metrics.jsonl")] == [1, 2, 3]
    assert all(line in kept() for line in written)
    written = kept()
    # no checkpoint at all (a run killed before its first one): --resume starts again, keeping the records
    shutil.rmtree(run / "checkpoints")
    RLTrainer(cfg, resume=True, log=_quiet).train()
    assert all(line in kept() for line in written)
    written = kept()
    # and so does a fresh run into the same directory
    shutil.rmtree(run / "checkpoints")
    RLTrainer(cfg, log=_quiet).train()
    assert all(line in kept() for line in written)
    assert [json.loads(line)["step"] for line in _lines(run / "metrics.jsonl")] == [1, 2, 3]


def test_fingerprint_covers_steps_when_the_schedule_depends_on_it(tmp_path):
    from trace_gym.trainers.config import RLConfig
    from trace_gym.trainers.rl import RLTrainer

    def fp(steps: int, schedule: str) -> str:
        return RLConfig.model_validate({"steps": steps, "optim": {"schedule": schedule}}).fingerprint()

    assert fp(10, "cosine") != fp(20, "cosine")
    assert fp(10, "constant") == fp(20, "constant")  # a constant-rate run can be extended
    assert RLConfig.model_validate({"loss": {"packing": "trajectory"}}).fingerprint() != RLConfig().fingerprint()

    cfg = _sim_config(tmp_path, steps=2, optim={"schedule": "cosine"})
    RLTrainer(cfg, log=_quiet).train()
    longer = cfg.model_copy(update={"steps": 4})
    with pytest.raises(ValueError, match="another config"):
        RLTrainer(longer, resume=True, log=_quiet)
    constant = _sim_config(tmp_path / "c", steps=2)
    RLTrainer(constant, log=_quiet).train()
    records = RLTrainer(constant.model_copy(update={"steps": 4}), resume=True, log=_quiet).train()
    assert [r["step"] for r in records] == [1, 2, 3, 4]


def test_nan_behaviour_logprobs_with_is_correction_name_the_backend(tmp_path, monkeypatch):
    from trace_gym.trainers.config import RLConfig
    from trace_gym.trainers.rl import RLTrainer

    monkeypatch.setenv("TRACE_GYM_CACHE", str(CACHE))
    cfg = RLConfig.model_validate({
        "seed": 0, "steps": 2, "output_dir": str(tmp_path / "run"), "envs": MICRO["envs"],
        "model": {"name": "tiny", "tiny": MICRO["model"]["tiny"]}, "sft": {"enabled": False}, "rollout": {"max_new_tokens": 6},
        "allocator": "grpo", "budget": {"trajectories": 4, "prompts": 2, "group_size": 2},
        "loss": {"is_correction": True, "skip_zero_advantage": False}, "log": {"tensorboard": False, "progress": False}})
    trainer = RLTrainer(cfg, log=_quiet)
    generate = trainer.policy.generate

    def without_end_logprob(prompts, params):
        """A backend that reports no log-prob for the end token it appends (as vLLM's and servers' may)."""
        gens = generate(prompts, params)
        for g in gens:
            g.logprobs = list(g.logprobs[:-1]) + [float("nan")]
        return gens

    trainer.policy.generate = without_end_logprob
    with pytest.raises(ValueError, match="backend 'hf' returned no behaviour log-prob") as info:
        trainer.step()
    assert "loss.is_correction" in str(info.value)
    # without the correction the same rollouts train: the NaNs never reach the loss
    trainer.cfg.loss.is_correction = False
    record = trainer.step()
    assert record["update/trained_tokens"] > 0
    assert all(math.isfinite(record[k]) for k in ("update/loss", "update/grad_norm", "update/behaviour_logp_gap"))


def test_policy_encoder_predictor_reads_the_updated_weights(tmp_path, monkeypatch):
    """predictor lm:encoder=policy encodes histories with the policy being trained: after a
    step's update it sees that step's weights, not embeddings cached from the weights before;
    where it cannot (async updates, the simulated policy) the trainer refuses by name."""
    pytest.importorskip("transformers")
    from trace_gym.forest.forest import History
    from trace_gym.trainers.config import RLConfig
    from trace_gym.trainers.rl import RLTrainer

    monkeypatch.setenv("TRACE_GYM_CACHE", str(CACHE))
    # the micro warm start (shared with the other tests) has mixed rewards from the first step
    base = {**json.loads(json.dumps(MICRO)), "output_dir": str(tmp_path / "run"), "predictor": "lm:encoder=policy"}
    trainer = RLTrainer(RLConfig.model_validate(base), log=_quiet)
    history = History(task_id="probe", prompt="Pick the option that wins.", steps=("option 1",), max_turns=2)
    before = trainer.predictor.features([history]).clone()
    assert torch.equal(trainer.predictor.features([history]), before)  # cached while the weights stand
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    for _ in range(6):  # a step whose rewards are all equal trains nothing: step until one does
        trainer.step()
        if not all(torch.equal(w, p) for w, p in zip(weights, trainer.model.parameters())):
            break
    else:
        pytest.fail("six steps left the policy's weights unchanged")
    after = trainer.predictor.features([history])
    assert not torch.allclose(after, before)
    assert torch.equal(trainer.predictor.features([history]), after)

    for changes, message in (({"rollout": {"max_new_tokens": 12, "mode": "async"}}, "rollout.mode=async"),
                             ({"model": {"name": "sim"}, "sft": {"enabled": False}}, "transformer policy")):
        with pytest.raises(ValueError, match=message):
            RLTrainer(RLConfig.model_validate({**base, **changes}), log=_quiet)


def test_a_step_with_failed_generations_warns_with_the_error(tmp_path, monkeypatch):
    """Failed trajectories are spent budget without an outcome: the trainer says so in its log
    for the step, with the error text, and the step's record counts them."""
    from trace_gym.trainers.config import RLConfig
    from trace_gym.trainers.rl import RLTrainer

    monkeypatch.setenv("TRACE_GYM_CACHE", str(CACHE))
    cfg = RLConfig.model_validate({
        "seed": 0, "steps": 1, "output_dir": str(tmp_path / "run"), "envs": MICRO["envs"],
        "model": {"name": "tiny", "tiny": MICRO["model"]["tiny"]}, "sft": {"enabled": False}, "rollout": {"max_new_tokens": 6},
        "allocator": "grpo", "budget": {"trajectories": 4, "prompts": 2, "group_size": 2},
        "loss": {"skip_zero_advantage": False}, "log": {"tensorboard": False, "progress": False}})
    said: list[str] = []
    trainer = RLTrainer(cfg, log=said.append)

    def broken(prompts, params):
        raise RuntimeError("device lost (planted by the test)")

    trainer.policy.generate = broken
    record = trainer.step()
    assert record["spent/failed_trajectories"] == 4
    warnings = [m for m in said if m.startswith("warning: step 1")]
    assert warnings and "4 of 4 trajectories failed" in warnings[0] and "device lost (planted by the test)" in warnings[0]
