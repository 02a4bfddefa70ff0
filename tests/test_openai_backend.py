"""The ``openai`` backend against a real OpenAI-compatible server on loopback:
``transformers serve`` (from ``transformers[serving]``) serving the converted SmolLM2 directory
offline. It takes text prompts only, so the backend must say so, fall back to text, and
measure the re-tokenisation drift; killing it mid-run must give clear errors and lose no
finished node."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="transformers serve needs the 'serving' extra (transformers[serving])")
pytest.importorskip("uvicorn", reason="transformers serve needs the 'serving' extra (transformers[serving])")
pytest.importorskip("httpx")

import trace_gym  # noqa: E402
from trace_gym.allocation.allocator import Budget  # noqa: E402
from trace_gym.forest.forest import Forest  # noqa: E402
from trace_gym.policies.base import SamplingParams, make_policy  # noqa: E402
from trace_gym.rollout.engine import RolloutEngine, RolloutError, TurnRecord, write_jsonl  # noqa: E402

from rollout_checks import Recording, check_exact_prefixes, check_replay  # noqa: E402
from servers import free_port, wait_until_serving  # noqa: E402
from shared_smollm2 import smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow


class Server:
    """``transformers serve MODEL_DIR`` on a free loopback port, offline."""

    def __init__(self, model_dir: str):
        self.port = free_port()
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "transformers.cli.transformers", "serve", model_dir, "--host", "127.0.0.1",
             "--port", str(self.port), "--device", "cpu", "--log-level", "error"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.url = f"http://127.0.0.1:{self.port}/v1"
        wait_until_serving(self.proc, self.url, name="transformers serve", timeout_s=120, poll_s=0.5,
                           output=lambda: self.proc.stderr.read()[-2000:], stop=self.kill)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def servers():
    running: list[Server] = []
    yield running
    for s in running:
        s.kill()


@pytest.fixture
def server(servers):
    """A live server, shared by the module's tests; restarted if a test killed it."""
    if not servers or servers[-1].proc.poll() is not None:
        servers.append(Server(smollm2_path()))
    return servers[-1]


def test_text_only_server_is_detected_and_drift_is_measured(server):
    policy = make_policy("openai", base_url=server.url, tokenizer=smollm2_path())
    tok = policy.tokenizer
    prompt = policy.render_prompt([{"role": "user", "content": "Count from one to five."}])
    # a prompt whose ids are not the tokenizer's own split ("hel" + "lo" instead of "hello"):
    # the server re-tokenises the decoded text, so this one must show up as drift
    odd = policy.render_prompt([{"role": "user", "content": "Say"}])[:-5] + tok("hel", add_special_tokens=False)["input_ids"] \
        + tok("lo", add_special_tokens=False)["input_ids"] + policy.render_prompt([{"role": "user", "content": "x"}])[-5:]
    prompts = [prompt, prompt, prompt, odd]
    with pytest.warns(RuntimeWarning, match="does not serve token-level completions"):
        gens = policy.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=0))
    assert policy.dialect == "transformers" and not policy.token_level
    for g in gens:
        assert g.finish_reason in ("stop", "length") and 1 <= len(g.token_ids) <= 13
        assert g.info["retokenized"] and all(math.isnan(x) for x in g.logprobs)
        assert g.token_ids[-1] == policy.chat.eot_id if g.finish_reason == "stop" else True
    assert len({g.text for g in gens[:3]}) > 1  # it samples (the server's default config is greedy)
    expected_prompt_drift = [abs(len(tok(tok.decode(p, skip_special_tokens=False), add_special_tokens=False)["input_ids"]) - len(p)) for p in prompts]
    assert expected_prompt_drift[-1] > 0
    assert policy.drift["prompts"] == 4
    assert policy.drift["prompt_token_diff"] == sum(expected_prompt_drift)
    assert policy.drift["prompt_mismatch"] == sum(d > 0 for d in expected_prompt_drift)
    assert [g.info["prompt_drift_tokens"] for g in gens] == expected_prompt_drift
    assert policy.drift["completions"] == 4 and 0 <= policy.drift["completion_mismatch"] <= 4


@pytest.mark.filterwarnings("ignore:dialect 'transformers'")
def test_engine_branches_over_the_server(server):
    env_kwargs = {"seed": 0, "max_turns": 2}
    env = trace_gym.make("trace_gym/MathCalc-v0", **env_kwargs)
    policy = Recording(make_policy("openai", base_url=server.url, tokenizer=smollm2_path(), dialect="transformers"))
    engine = RolloutEngine(env, policy, SamplingParams(max_new_tokens=8, seed=0))
    forest = Forest()
    engine.add_roots(forest, [env.tasks().get(0)])
    spend = engine.step(forest, "uniform", Budget(trajectories=4, root_fraction=0.5, min_per_prompt=2))
    assert spend.roots == 2 and spend.branches == 2 and forest.counters["failed_trajectories"] == 0
    assert check_exact_prefixes(forest, policy) == 2
    check_replay("trace_gym/MathCalc-v0", env_kwargs, forest)


@pytest.mark.filterwarnings("ignore:dialect 'transformers'")
def test_killing_the_server_mid_run_gives_clear_errors_and_keeps_the_trees(server, tmp_path):
    doomed = server
    try:
        env = trace_gym.make("trace_gym/MathCalc-v0", seed=0, max_turns=3)
        policy = make_policy("openai", base_url=doomed.url, tokenizer=smollm2_path(), dialect="transformers",
                             max_retries=2, backoff=0.05, timeout=30)
        waves = []

        def after_wave(stats):
            waves.append(dict(stats))
            if len(waves) == 1:
                doomed.kill()  # the server dies between the first and the second turn

        engine = RolloutEngine(env, policy, SamplingParams(max_new_tokens=8, seed=0), progress=after_wave)
        forest = Forest()
        roots = engine.add_roots(forest, [env.tasks().get(0), env.tasks().get(1)])
        start = time.monotonic()
        with pytest.raises(RolloutError, match="could not be finished") as err:
            engine.rollout(forest, np.repeat(roots, 2))
        assert time.monotonic() - start < 120
    finally:
        doomed.kill()
    live_after_first = waves[0]["live"]
    assert live_after_first > 0 and len(err.value.failures) == live_after_first
    assert all("failed after retries" in f.error and "Connect" in f.error for f in err.value.failures)
    assert forest.counters["failed_trajectories"] == live_after_first
    # nothing generated before the kill is lost: one first-turn node per trajectory
    turns = [i for i in range(len(forest)) if isinstance(forest.payload[i], TurnRecord)]
    assert len(turns) == 4 and sorted(int(forest.traj[i]) for i in turns) == [0, 1, 2, 3]
    assert {f.last_node for f in err.value.failures} <= set(turns)
    path = tmp_path / "trees.jsonl"
    assert write_jsonl(forest, str(path)) == len(forest) == 6
    assert [json.loads(line)["node"] for line in path.read_text().splitlines()] == list(range(6))


def test_token_level_responses_parse_to_exact_ids_and_log_probs():
    """The ``vllm`` dialect's response format (vLLM's /v1/completions with
    ``return_tokens_as_token_ids``), as documented: ids and log-probs come back verbatim,
    cached prompt tokens are reported, and a turn that stopped without its stop token in
    the output is closed with the end-of-turn token."""
    policy = make_policy("openai", base_url="http://127.0.0.1:9/v1", tokenizer=smollm2_path(), dialect="vllm")
    eot = policy.chat.eot_id
    hello = policy.chat.encode("Hello there")
    data = {
        "choices": [{"index": 0, "text": "Hello there", "finish_reason": "stop",
                     "logprobs": {"tokens": [f"token_id:{t}" for t in hello + [eot]], "token_logprobs": [-0.5, -1.25, -0.01]}}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 32}},
    }
    g = policy._parse_tokens(data, list(range(40)))
    assert g.token_ids == hello + [eot] and g.logprobs == [-0.5, -1.25, -0.01] and g.finish_reason == "stop"
    assert g.text == "Hello there" and g.info == {"prefill_tokens": 8, "reused_prefix_tokens": 32}
    data["choices"][0]["logprobs"] = {"tokens": [f"token_id:{t}" for t in hello], "token_logprobs": [-0.5, -1.25]}
    g = policy._parse_tokens(data, list(range(40)))
    assert g.token_ids == hello + [eot] and math.isnan(g.logprobs[-1])
    data["choices"][0].update(finish_reason="length", token_ids=hello, logprobs=None)  # newer vLLM: return_token_ids
    g = policy._parse_tokens(data, list(range(40)))
    assert g.token_ids == hello and g.finish_reason == "length" and all(math.isnan(x) for x in g.logprobs)
    del data["choices"][0]["token_ids"]
    assert policy._parse_tokens(data, list(range(40))) is None  # text only: the caller falls back to a text dialect
