"""SFT warm start: demonstrations become exactly the token sequences the rollout engine
builds (loss only on policy tokens), the tiny preset is a usable chat model, a warm start is
cached by config, and after it the policy acts in the env's format."""

import os
import tempfile
import time
import warnings
from pathlib import Path

import pytest

import trace_gym
from trace_gym.forest.forest import Forest
from trace_gym.policies.base import Generation, SamplingParams

pytestmark = pytest.mark.slow

CACHE = Path(tempfile.gettempdir()) / f"trace-gym-test-cache-{os.getuid()}"
CL = {"n_options": 2, "turns": [1, 1], "n_tasks": 256, "n_test": 64}


@pytest.fixture(autouse=True)
def _cache(monkeypatch):
    monkeypatch.setenv("TRACE_GYM_CACHE", str(CACHE))


def _micro(envs):
    from trace_gym.trainers.presets import TinySpec

    return TinySpec(envs=tuple(envs), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                    corpus_tasks=100, vocab_size=400 if envs == ["trace_gym/ContrastLab-v0"] else 600)


def _scripted_policy(model_dir, script):
    """The real hf backend (tokenizer, chat template, observation rendering), whose
    generation replays ``script[task prompt]``: the demonstration's turns."""
    from trace_gym.policies.hf import HFPolicy

    class Replay(HFPolicy):
        def generate(self, prompts, params):
            out = []
            for p in prompts:
                text = self.tokenizer.decode(p)
                key = next(k for k in script if k in text)
                turn = text.count("<|im_start|>assistant")
                ids = self.chat.encode(script[key][turn - 1]) + [self.chat.eot_id]
                out.append(Generation(token_ids=ids, logprobs=[0.0] * len(ids), text=self.chat.decode(ids), finish_reason="stop"))
            return out

    return Replay(model=str(model_dir))


@pytest.mark.parametrize("env_id,kwargs", [("trace_gym/MathCalc-v0", {}), ("trace_gym/ToolCalls-v0", {})])
def test_demonstrations_tokenise_exactly_like_engine_rollouts(env_id, kwargs):
    from trace_gym.rollout.engine import RolloutEngine, sequence
    from trace_gym.trainers.presets import tiny_model_dir
    from trace_gym.trainers.sft import demonstration_example

    model_dir = tiny_model_dir(_micro(["trace_gym/MathCalc-v0", "trace_gym/ToolCalls-v0"]))
    env = trace_gym.make(env_id, **kwargs)
    tasks = [env.tasks().get(i, "train") for i in range(6)]
    script = {t.prompt: env.demonstrate(t) for t in tasks}
    policy = _scripted_policy(model_dir, script)
    engine = RolloutEngine(env, policy, SamplingParams(max_new_tokens=512))
    forest = Forest()
    roots = engine.add_roots(forest, tasks)
    engine.rollout(forest, roots)
    for t, task in enumerate(tasks):
        seq = sequence(forest, int(forest.traj_leaf[t]))
        assert forest.reward[forest.traj_leaf[t]] == 1.0  # the demonstration solves it
        ex = demonstration_example(policy.chat, env, task)
        assert ex.ids == seq.ids.tolist()
        assert ex.mask == seq.mask.tolist()
        # the loss-mask tokens are exactly the demonstrated turns, each closed by <|im_end|>
        trained = [i for i, m in zip(ex.ids, ex.mask) if m]
        assert policy.tokenizer.decode(trained) == "".join(a + "<|im_end|>" for a in env.demonstrate(task))


def test_tiny_preset_is_a_chat_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trace_gym.policies.chat import ChatTemplate
    from trace_gym.trainers.presets import tiny_model_dir

    d = tiny_model_dir(_micro(["trace_gym/MathCalc-v0", "trace_gym/ToolCalls-v0"]))
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d)
    chat = ChatTemplate(tok)
    assert chat.tools_in_template and tok.decode([chat.eot_id]) == "<|im_end|>"
    env = trace_gym.make("trace_gym/MathCalc-v0")
    _, info = env.reset(options={"index": 0})
    text = tok.decode(chat.render_prompt(info["messages"], info["tools"]))
    assert "calculator(expression)" in text and text.endswith("<|im_start|>assistant\n")
    # single tokens for the ReAct tags and one token per digit
    for tag in ("<tool_call>", "</tool_call>", "<answer>", "</answer>", "<think>"):
        assert len(chat.encode(tag)) == 1
    assert len(chat.encode("12345")) == 5
    assert model.config.model_type == "qwen3" and sum(p.numel() for p in model.parameters()) < 1_000_000


def test_warm_start_is_cached_and_teaches_the_answer_format():
    from trace_gym.trainers.evaluate import evaluate_env, held_out_tasks
    from trace_gym.trainers.presets import tiny_model_dir
    from trace_gym.trainers.sft import EnvSpec, SFTConfig, warm_start

    spec = _micro(["trace_gym/ContrastLab-v0"])
    cfg = SFTConfig(envs=[EnvSpec(id="trace_gym/ContrastLab-v0", kwargs=CL)], tasks=320, epochs=3, lr=5e-3, batch_size=16,
                    strip_thoughts=True)
    logged = []
    import torch

    caller = torch.get_num_threads()
    torch.set_num_threads(2)  # the caller's thread count: the SFT trains with cfg.threads (1) and gives it back
    try:
        seen_threads = set()

        def log(r):
            logged.append(r)
            seen_threads.add(torch.get_num_threads())

        d = warm_start("tiny", cfg, tiny=spec, log=log, rebuild=True)  # trained here, not left by an earlier run
        assert seen_threads == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(caller)
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    logged.clear()
    t0 = time.perf_counter()
    assert warm_start("tiny", cfg, tiny=spec, log=logged.append) == d
    assert not logged and time.perf_counter() - t0 < 5 and (d / "model.safetensors").stat().st_mtime_ns == stamp
    other = cfg.model_copy(update={"lr": 1e-3})
    from trace_gym.trainers.sft import resolve_base, sft_key

    ident = resolve_base("tiny", spec)[1]
    assert sft_key(ident, other) != sft_key(ident, cfg)
    # the thread count and the device train other weights, so they key other warm starts
    assert sft_key(ident, cfg.model_copy(update={"threads": 2})) != sft_key(ident, cfg) != sft_key(ident, cfg, "cuda")
    # the install it was trained with travels with it (the key holds the config and device, not the install)
    import json
    from importlib import metadata

    summary = json.loads((d / "sft_summary.json").read_text())
    assert summary["threads"] == 1 and summary["device"] == "cpu"
    versions = summary["versions"]
    assert versions["torch"] == metadata.version("torch") and versions["transformers"] == metadata.version("transformers")
    from trace_gym.provenance import cpu_info

    assert summary["cpu"] == cpu_info() and summary["cpu"]["cpu"]  # and the CPU: math libraries pick kernels by it

    env = trace_gym.make("trace_gym/ContrastLab-v0", **CL)
    tasks = held_out_tasks(env, 16)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=0)
    before = evaluate_env(trace_gym.make_policy("hf", model=str(tiny_model_dir(spec))), env, tasks, 4, params)
    after = evaluate_env(trace_gym.make_policy("hf", model=str(d)), env, tasks, 4, params)
    # from scratch it never answers in format; warmed, nearly always (two options: ~half right)
    assert before["mean@k"] == 0.0
    assert after["mean@k"] > 0.3 and after["pass@k"] > 0.6


def test_token_bounded_micro_batches_change_memory_not_the_step():
    """micro_batch_tokens splits a batch into smaller forward passes (a sequence longer than
    the bound goes alone); the summed, token-normalised loss and its gradients are those of
    one pass, and the warm start's cache key ignores the bound."""
    import torch
    from transformers import AutoModelForCausalLM

    from trace_gym.trainers.presets import tiny_model_dir
    from trace_gym.trainers.batching import micro_batches
    from trace_gym.trainers.sft import Example, SFTConfig, masked_nll, pad_batch, resolve_base, sft_key

    rng = torch.Generator().manual_seed(0)
    lengths = [40, 12, 33, 7, 90, 25]
    batch = [Example(ids=torch.randint(5, 300, (n,), generator=rng).tolist(), mask=[0] * 3 + [1] * (n - 3), env_id="e",
                     task_id=str(i)) for i, n in enumerate(lengths)]
    parts = [[batch[i] for i in idx] for idx in micro_batches([e.ids for e in batch], 80, 4)]
    assert sorted(int(e.task_id) for p in parts for e in p) == list(range(len(batch)))  # each example once
    assert all(len(p) * max(len(e.ids) for e in p) <= 80 or len(p) == 1 for p in parts) and any(len(p) == 1 and
                                                                                                 len(p[0].ids) == 90 for p in parts)
    assert [len(p) for p in micro_batches([e.ids for e in batch], None, 4)] == [4, 2]

    spec = _micro(["trace_gym/ContrastLab-v0"])
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir(spec)))
    n_tok = sum(sum(e.mask[1:]) for e in batch)

    def grads(split):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for micro in split:
            nll, _ = masked_nll(model, *pad_batch(micro, 0))
            (nll / n_tok).backward()
            total += float(nll)
        return total, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    loss_one, g_one = grads([batch])
    loss_split, g_split = grads(parts)
    assert loss_split == pytest.approx(loss_one, rel=1e-5)
    assert torch.allclose(g_split, g_one, atol=1e-6, rtol=1e-4)
    ident = resolve_base("tiny", spec)[1]
    assert sft_key(ident, SFTConfig(micro_batch_tokens=None)) == sft_key(ident, SFTConfig(micro_batch_tokens=512))


def test_demonstrations_over_max_length_are_skipped_with_a_warning_and_an_env_that_loses_all_is_an_error():
    from trace_gym.trainers.sft import Example, fitting_examples

    def ex(env, n):
        return Example(ids=[1] * n, mask=[1] * n, env_id=env, task_id=f"{env}-{n}")

    fine = [ex("a", 10), ex("a", 20), ex("b", 30)]
    assert fitting_examples(fine, 30) == fine
    with pytest.warns(UserWarning, match=r"b 1 of 2 \(up to 40 tokens\)"):
        kept = fitting_examples(fine[:2] + [ex("b", 30), ex("b", 40)], 30)
    assert [e.task_id for e in kept] == ["a-10", "a-20", "b-30"]
    with pytest.raises(ValueError, match=r"b: none of its 2 demonstrations fits sft.max_length=30 .*at least 45"):
        fitting_examples(fine[:2] + [ex("b", 35), ex("b", 45)], 30)


def test_every_shipped_suite_warm_start_keeps_demonstrations_of_each_of_its_envs():
    """A suite's SFT warm start must see every env it lists: a ToolCalls demonstration is
    about 1,650 smollm2 tokens, and at the default max_length of 1024 the smollm2 warm start
    once trained on none of them (and scored 0 on ToolCalls). Each warm start is tokenised
    by its own model's tokenizer (the tiny preset's is built from its corpus)."""
    from transformers import AutoTokenizer

    from trace_gym.leaderboard import load_suite
    from trace_gym.policies.chat import ChatTemplate
    from trace_gym.trainers.leaderboard import warm_start_plan
    from trace_gym.trainers.presets import tiny_model_dir
    from trace_gym.trainers.sft import build_examples, fitting_examples, resolve_base

    suites = sorted((Path(__file__).parents[1] / "configs" / "suites").glob("*.yaml"))
    checked = set()
    for path in suites:
        spec = load_suite(str(path))
        for track in spec.tracks:
            ws = track.policy.warm_start
            if ws is None:
                continue
            cfg, tiny, _ = warm_start_plan(track, [e.id for e in track.envs])
            key = (track.policy.model, cfg.model_dump_json())
            if key in checked:
                continue
            checked.add(key)
            model_dir = tiny_model_dir(tiny) if track.policy.model == "tiny" else resolve_base(track.policy.model)[0]
            chat = ChatTemplate(AutoTokenizer.from_pretrained(str(model_dir)))
            for env in cfg.envs:
                examples = build_examples(chat, [env], 8, strip_thoughts=cfg.strip_thoughts)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # a few long ones may go; none kept is the failure
                    assert fitting_examples(examples, cfg.max_length), (path.name, env.id)
    assert {model for model, _ in checked} >= {"tiny", "smollm2-135m"}
