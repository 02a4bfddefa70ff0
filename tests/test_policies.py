"""Policy backends: the chat-template renderer, the ``hf`` backend on a real model
(SmolLM2-135M-Instruct and tiny from-scratch models in local directories), model aliases,
and the ``hf`` backend in bf16 where CUDA exists. The ``vllm`` backend's tests are
tests/test_vllm*.py (``make test-vllm``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shared_smollm2 import smollm2_path, smollm2_policy

torch = pytest.importorskip("torch")

from trace_gym.policies.base import Generation, SamplingParams, make_policy  # noqa: E402

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+3? Answer as <answer>N</answer>."},
]
TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
# a minimal template that does render tools (as Qwen's and Llama 3's do)
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def teacher_forced_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """Log-probs of ``tokens`` after ``prompt`` from one plain forward pass (no cache, no padding)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]


def assert_matches_teacher_forcing(policy, prompts, gens, tol=1e-3):
    for p, g in zip(prompts, gens):
        ref = teacher_forced_logprobs(policy.model, p, g.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, g.logprobs)) < tol


# ----------------------------------------------------------------------------- registry / import


def test_import_trace_gym_does_not_import_torch():
    code = "import sys, trace_gym, trace_gym.policies as p; assert set(p.names()) >= {'hf','vllm','openai','sim'}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_policy_name_suggests_close_names():
    with pytest.raises(KeyError, match="did you mean 'hf'"):
        make_policy("hff")


# ----------------------------------------------------------------------------- model aliases


@pytest.mark.slow
def test_alias_resolves_to_a_converted_safetensors_directory():
    from trace_gym.policies.models import cache_dir, resolve_model

    path = smollm2_path()
    assert path.startswith(str(cache_dir()))
    assert os.path.exists(os.path.join(path, "config.json"))
    assert any(f.endswith(".safetensors") for f in os.listdir(path))
    assert resolve_model("smollm2-135m") == path  # the second call does not convert again
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model("/nonexistent/model/dir")
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


# ----------------------------------------------------------------------------- chat templates


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path())


@pytest.mark.slow
def test_tools_go_into_the_system_prompt_when_the_template_ignores_them(tokenizer):
    from trace_gym.policies.chat import ChatTemplate

    chat = ChatTemplate(tokenizer)
    assert not chat.tools_in_template  # SmolLM2's template drops tools=
    text = tokenizer.decode(chat.render_prompt(MESSAGES, [TOOL]), skip_special_tokens=False)
    assert text.index('"name": "calculator"') < text.index("What is 2+3?")
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert text.endswith("<|im_start|>assistant\n")

    native = ChatTemplate(tokenizer, chat_template=TOOLS_TEMPLATE)
    assert native.tools_in_template
    text = tokenizer.decode(native.render_prompt(MESSAGES, [TOOL]), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nTOOLS ") and text.count("calculator") == 1


@pytest.mark.slow
@pytest.mark.parametrize("closed", [True, False])
def test_rendered_turns_reproduce_the_chat_template(tokenizer, closed):
    from trace_gym.policies.chat import ChatTemplate

    chat = ChatTemplate(tokenizer)
    answer, final = "Let me compute.", "<answer>5</answer>"
    # a generated turn that stopped by itself ends with the end-of-turn token; one cut by the
    # token limit does not, and render_observation closes it
    turn = chat.encode(answer) + ([chat.eot_id] if closed else [])
    ids = chat.render_prompt(MESSAGES) + turn + chat.render_observation("5", role="tool", closed=closed) + chat.encode(final) + [chat.eot_id]
    conversation = MESSAGES + [{"role": "assistant", "content": answer}, {"role": "tool", "content": "5"},
                               {"role": "assistant", "content": final}]
    expected = tokenizer.apply_chat_template(conversation, tokenize=False)
    # (the newline the template writes after the last <|im_end|> would open the next observation)
    assert tokenizer.decode(ids, skip_special_tokens=False) + "\n" == expected
    assert chat.eot_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.slow
def test_tokenizer_without_template_gets_chatml_and_rejected_roles_fall_back_to_user(tokenizer):
    from trace_gym.policies.chat import ChatTemplate

    bare = ChatTemplate(tokenizer, chat_template=None)
    tokenizer_copy = type(tokenizer).from_pretrained(smollm2_path())
    tokenizer_copy.chat_template = None
    chatml = ChatTemplate(tokenizer_copy)
    assert tokenizer.decode(chatml.render_prompt(MESSAGES), skip_special_tokens=False) == \
        tokenizer.decode(bare.render_prompt(MESSAGES), skip_special_tokens=False)
    strict = (
        "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    chat = ChatTemplate(tokenizer, chat_template=strict)
    with pytest.warns(UserWarning, match="rejects role 'tool'"):
        ids = chat.render_observation("42", role="tool")
    assert tokenizer.decode(ids, skip_special_tokens=False) == "\n<|im_start|>user\n42<|im_end|>\n<|im_start|>assistant\n"


# ----------------------------------------------------------------------------- hf generation


@pytest.fixture(scope="module")
def policy():
    pol = smollm2_policy()
    pol.reset_cache()
    return pol


@pytest.mark.slow
def test_batched_generation_with_shared_and_cached_prefixes_matches_teacher_forcing(policy):
    p = policy.render_prompt(MESSAGES)
    q = policy.render_prompt([MESSAGES[0], {"role": "user", "content": "Name a colour."}])
    prompts = [p, p, p, q, p[:-2]]  # identical prompts, a prefix of them, and a different one
    policy.reset_cache()
    gens = policy.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=0))
    assert all(isinstance(g, Generation) and 1 <= len(g.token_ids) == len(g.logprobs) <= 12 for g in gens)
    assert_matches_teacher_forcing(policy, prompts, gens)
    # the shared prefix of the first group was computed once, not per row
    assert sum(g.info["prefill_tokens"] for g in gens) < sum(map(len, prompts)) / 2
    assert all(g.info["prefill_tokens"] + g.info["reused_prefix_tokens"] == len(pr) for g, pr in zip(gens, prompts))

    # the next turn of each: previous prompt + generated tokens + an observation
    nxt = [pr + g.token_ids + policy.render_observation("Error: try again", closed=g.finish_reason == "stop") for pr, g in zip(prompts, gens)]
    gens2 = policy.generate(nxt, SamplingParams(max_new_tokens=8, temperature=1.0, seed=1))
    assert_matches_teacher_forcing(policy, nxt, gens2)
    for pr, g, g2 in zip(prompts, gens, gens2):
        # everything up to the last generated token came from the prefix store
        assert g2.info["reused_prefix_tokens"] >= len(pr) + len(g.token_ids) - 1


@pytest.mark.slow
def test_turns_stop_at_end_of_turn_or_at_the_token_limit(policy):
    prompt = policy.render_prompt([{"role": "user", "content": "What is 1+1? Reply with just the number."}])
    short = policy.generate([prompt, prompt], SamplingParams(max_new_tokens=3, temperature=0))
    (full,) = policy.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0))
    for g in short:
        assert g.finish_reason == "length" and len(g.token_ids) == 3
    assert full.finish_reason == "stop" and 3 < len(full.token_ids) < 24 and full.token_ids[-1] in policy.stop_ids
    assert not any(t in policy.stop_ids for t in full.token_ids[:-1])
    assert "<|im_end|>" not in full.text and full.text == policy.decode(full.token_ids)
    assert full.token_ids[:3] == short[0].token_ids  # greedy: the same turn, cut at the limit


@pytest.mark.slow
def test_prefill_accounting_with_and_without_reuse(policy):
    from trace_gym.policies.hf import HFPolicy

    prompt = policy.render_prompt(MESSAGES)
    n, k = len(prompt), 4
    policy.reset_cache()
    gens = policy.generate([prompt] * k, SamplingParams(max_new_tokens=4, seed=3))
    assert sum(g.info["prefill_tokens"] for g in gens) == n + (k - 1)  # the prefix once, then one token per copy
    assert sum(g.info["reused_prefix_tokens"] for g in gens) == (k - 1) * (n - 1)
    assert len({tuple(g.token_ids) for g in gens}) > 1  # the copies still sample independently

    plain = HFPolicy(policy.model, tokenizer=policy.tokenizer, share_prefix=False, kv_cache_tokens=0)
    gens = plain.generate([prompt] * k, SamplingParams(max_new_tokens=4, seed=3))
    assert [g.info["prefill_tokens"] for g in gens] == [n] * k
    assert all(g.info["reused_prefix_tokens"] == 0 for g in gens)


def test_a_store_lookup_depends_only_on_what_was_stored_since_it_was_emptied():
    """Several entries can match a prompt equally far (a branch's prefix lies in every
    trajectory that went on from it). Which one serves it must not depend on how many
    entries the store held before its last clear(): a leaderboard track's rows share one
    policy, and each step empties the store."""
    from trace_gym.policies.hf import PrefixKVStore

    prefix = list(range(100, 132))  # two blocks of 16
    branch = prefix + [7]

    def served(earlier: int):
        store = PrefixKVStore(max_tokens=10_000)
        for k in range(earlier):  # an earlier step's entries, then the step's clear()
            store.put(list(range(1000 + 40 * k, 1032 + 40 * k)), [("earlier", k)])
        store.clear()
        store.put(prefix + [1, 2, 3], [("first",)])
        store.put(prefix + [4, 5, 6], [("second",)])
        entry, length = store.match(branch)
        return store.get(entry), length

    chosen = {earlier: served(earlier) for earlier in range(12)}
    assert all(length == len(prefix) for _, length in chosen.values())
    assert {kv[0] for kv, _ in chosen.values()} == {("second",)}  # the newest, whatever came before


@pytest.mark.slow
def test_a_small_store_evicting_entries_mid_call_stays_exact(policy):
    """Chunks of one call store new entries that evict older ones another chunk matched:
    the matched KV must stay usable, and every log-prob exact."""
    from trace_gym.policies.hf import HFPolicy

    prompts = [policy.render_prompt([{"role": "user", "content": f"Add {i} and {i + 1}."}]) for i in range(4)]
    small = HFPolicy(policy.model, tokenizer=policy.tokenizer, max_batch_size=2, kv_cache_tokens=3 * len(prompts[0]) + 16)
    params = SamplingParams(max_new_tokens=4, seed=0)
    for _ in range(3):
        gens = small.generate(prompts, params)
        assert_matches_teacher_forcing(small, prompts, gens)
        prompts = [p + g.token_ids + small.render_observation("ok", closed=g.finish_reason == "stop") for p, g in zip(prompts, gens)]
    assert small.store.tokens <= small.store.max_tokens
    assert sum(g.info["reused_prefix_tokens"] for g in gens) > 0


def test_the_batch_caps_leave_a_wave_they_do_not_split_as_sampled(policy):
    """max_batch_size and max_batch_tokens are part of a run (HFPolicy's docstring): a wave
    that two settings both generate in one chunk samples the same tokens from the same seed."""
    from trace_gym.policies.hf import HFPolicy

    prompts = [policy.render_prompt([{"role": "user", "content": f"Add {i} and {i + 1}."}]) for i in range(4)]
    params = SamplingParams(max_new_tokens=6, seed=11)
    runs = [HFPolicy(policy.model, tokenizer=policy.tokenizer, max_batch_size=size, kv_cache_tokens=0).generate(prompts, params)
            for size in (4, 64)]
    assert [g.token_ids for g in runs[0]] == [g.token_ids for g in runs[1]]


def test_the_row_sampler_samples_the_same_tokens_under_any_batch_caps(policy):
    """sampler="row" (HFPolicy's docstring): prompt i's token t uses entry (i, t) of a table of
    uniforms drawn up front, so chunking a wave differently (and the rows around it) changes no
    row's tokens, where the default "wave" stream hands the chunks other draws."""
    from trace_gym.policies.hf import HFPolicy

    prompts = [policy.render_prompt([{"role": "user", "content": f"Add {i} and {i + 1}{'!' * i}."}]) for i in range(5)]
    params = SamplingParams(max_new_tokens=8, seed=3)

    def tokens(sampler, size, rows=prompts):
        small = HFPolicy(policy.model, tokenizer=policy.tokenizer, max_batch_size=size, kv_cache_tokens=0, sampler=sampler)
        gens = small.generate(rows, params)
        assert_matches_teacher_forcing(small, rows, gens)
        return [g.token_ids for g in gens]

    whole = tokens("row", 64)
    assert tokens("row", 2) == whole
    assert tokens("row", 1) == whole
    # a row's tokens do not depend on the rows beside it, only on its index in the call
    swapped = prompts[:2] + [prompts[0]] + prompts[3:]
    assert [t for i, t in enumerate(tokens("row", 64, swapped)) if i != 2] == [t for i, t in enumerate(whole) if i != 2]
    # the contrast: the wave stream gives the chunks other draws (and seeds differ per call)
    assert tokens("wave", 1) != tokens("wave", 64)
    assert tokens("row", 64) != [g.token_ids for g in HFPolicy(policy.model, tokenizer=policy.tokenizer, sampler="row")
                                 .generate(prompts, SamplingParams(max_new_tokens=8, seed=4))]


def test_an_unknown_sampler_is_refused(policy):
    from trace_gym.policies.hf import HFPolicy

    with pytest.raises(ValueError, match="sampler must be one of 'wave', 'row'"):
        HFPolicy(policy.model, tokenizer=policy.tokenizer, sampler="per-row")


@pytest.mark.slow
def test_weight_sync_changes_the_policy_and_invalidates_the_prefix_store(policy, tmp_path):
    prompt = policy.render_prompt(MESSAGES)
    original = {k: v.clone() for k, v in policy.model.state_dict().items()}
    try:
        policy.reset_cache()
        policy.generate([prompt], SamplingParams(max_new_tokens=4, seed=0))
        (warm,) = policy.generate([prompt], SamplingParams(max_new_tokens=4, seed=0))
        assert warm.info["reused_prefix_tokens"] > 0
        changed = {k: (v * 1.5 if k.endswith("norm.weight") else v) for k, v in original.items()}
        policy.load_weights(changed)
        (after,) = policy.generate([prompt], SamplingParams(max_new_tokens=4, seed=0))
        assert after.info["reused_prefix_tokens"] == 0  # stale KV is never reused
        assert_matches_teacher_forcing(policy, [prompt], [after])
        assert after.logprobs != warm.logprobs
        # an in-place update (an optimizer step on the shared module) also clears the store
        policy.generate([prompt], SamplingParams(max_new_tokens=4, seed=0))
        with torch.no_grad():
            policy.model.model.norm.weight.mul_(1.0)
        (again,) = policy.generate([prompt], SamplingParams(max_new_tokens=4, seed=0))
        assert again.info["reused_prefix_tokens"] == 0
        with pytest.raises(ValueError, match="unexpected keys"):
            policy.load_weights({"not.a.weight": torch.zeros(1)})
    finally:
        policy.load_weights(smollm2_path())  # back to the released weights, from the directory
    for k, v in policy.model.state_dict().items():
        assert torch.equal(v, original[k])


def build_tiny_model(path, arch: str = "llama", hidden: int = 32, heads: int = 4) -> dict[str, int]:
    """Save a randomly initialised causal LM with a character-level tokenizer that has no
    chat template (so ChatML is used) to ``path``, as the trainer's from-scratch presets are.
    Returns the vocabulary."""
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = {c: i for i, c in enumerate(["<pad>", "<|im_start|>", "<|im_end|>", *sorted(set(string.printable))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    small = dict(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                 num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=4096,
                 pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**small))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // heads, **small))
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return vocab


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_any_local_model_directory_loads_and_generates(tmp_path, arch):
    vocab = build_tiny_model(tmp_path, arch)
    pol = make_policy("hf", model=str(tmp_path), device="cpu")
    assert pol.chat.eot_id == vocab["<|im_end|>"]
    prompt = pol.render_prompt([{"role": "user", "content": "what is 2+3?"}])
    assert pol.tokenizer.decode(prompt, skip_special_tokens=False).replace(" ", "").startswith("<|im_start|>user")
    gens = pol.generate([prompt, prompt, prompt[:-1]], SamplingParams(max_new_tokens=6, seed=0))
    assert all(0 < len(g.token_ids) <= 6 for g in gens)
    assert_matches_teacher_forcing(pol, [prompt, prompt, prompt[:-1]], gens)


# ----------------------------------------------------------------------------- CUDA (the vllm backend: tests/test_vllm*.py)


def _cuda() -> bool:
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_hf_backend_on_cuda_in_bf16_drives_the_engine(tmp_path):
    import trace_gym
    from trace_gym.allocation.budget import Budget
    from trace_gym.forest.forest import Forest
    from trace_gym.rollout.engine import RolloutEngine

    from rollout_checks import Recording, check_accounting, check_exact_prefixes, check_replay

    build_tiny_model(tmp_path, "qwen3", hidden=256, heads=4)
    pol = make_policy("hf", model=str(tmp_path))
    assert pol.device.type == "cuda" and pol.model.dtype == torch.bfloat16
    prompt = pol.render_prompt(MESSAGES, [TOOL])
    prompts = [prompt, prompt, prompt[:-3]]
    gens = pol.generate(prompts, SamplingParams(max_new_tokens=16, seed=0))
    with torch.no_grad():  # bf16: batched and unbatched kernels round differently, so a loose tolerance
        for p, g in zip(prompts, gens):
            logits = pol.model(torch.tensor([p + g.token_ids], device=pol.device)).logits[0].float()
            ref = torch.log_softmax(logits, -1)[torch.arange(len(p) - 1, len(p) - 1 + len(g.token_ids)), torch.tensor(g.token_ids)]
            assert torch.allclose(ref.cpu(), torch.tensor(g.logprobs), atol=0.1)
    nxt = [p + g.token_ids + pol.render_observation("5", closed=g.finish_reason == "stop") for p, g in zip(prompts, gens)]
    gens2 = pol.generate(nxt, SamplingParams(max_new_tokens=8, seed=1))
    assert all(g2.info["reused_prefix_tokens"] >= len(p) + len(g.token_ids) - 1 for p, g, g2 in zip(prompts, gens, gens2))

    env = trace_gym.make("trace_gym/ContrastLab-v0", seed=0)
    spy = Recording(pol)
    engine = RolloutEngine(env, spy, SamplingParams(max_new_tokens=24, seed=0))
    forest = Forest()
    engine.add_roots(forest, [env.tasks().get(i) for i in range(4)])
    spend = engine.step(forest, "uniform", Budget(trajectories=16, root_fraction=0.5, min_per_prompt=2))
    assert spend.trajectories == 16 and check_exact_prefixes(forest, spy) == spend.branches > 0
    check_replay("trace_gym/ContrastLab-v0", {"seed": 0}, forest)
    check_accounting(forest, spy)


def test_sampling_follows_the_temperature_scaled_distribution():
    """The hf backend's sampler draws each row's token from softmax(logits / T) (top-p
    truncated), never a zero-probability token, reproducibly under a seeded generator, and
    returns each token's log-prob under that distribution."""
    from trace_gym.policies.base import SamplingParams
    from trace_gym.policies.hf import _sample

    logits = torch.log(torch.tensor([0.1, 0.0, 0.6, 0.3, 1e-30])).repeat(40_000, 1)
    tok, lp = _sample(logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    freq = torch.bincount(tok, minlength=5).double() / tok.numel()
    assert torch.allclose(freq, torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0], dtype=torch.double), atol=0.01)
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1))
    again, _ = _sample(logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert torch.equal(tok, again)
    hot, _ = _sample(logits[:, [0, 2]], SamplingParams(temperature=2.0), torch.Generator().manual_seed(1))
    p0 = (0.1 ** 0.5) / (0.1 ** 0.5 + 0.6 ** 0.5)  # softmax(log p / 2)
    assert abs((hot == 0).double().mean().item() - p0) < 0.01
    nucleus, _ = _sample(logits, SamplingParams(temperature=1.0, top_p=0.5), torch.Generator().manual_seed(2))
    assert set(nucleus.tolist()) == {2}  # the smallest set with mass >= 0.5 is the 0.6 token alone


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "all -inf"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_sampler_refuses_a_row_without_a_distribution(bad, temperature):
    """A row whose logits hold a NaN or +inf (or only -inf) stops the call with an error naming
    it, instead of yielding an arbitrary token with a NaN log-prob for the trainer to use."""
    from trace_gym.policies.hf import _sample

    logits = torch.randn(4, 10)
    logits[:, 3] = float("-inf")  # a masked token is a valid distribution
    tok, lp = _sample(logits, SamplingParams(temperature=temperature), torch.Generator().manual_seed(0))
    assert torch.isfinite(lp).all() and not (tok == 3).any()
    if bad == "all -inf":
        logits[2] = float("-inf")
    else:
        logits[2, 5] = bad
    with pytest.raises(FloatingPointError, match=r"1 of 4 rows \(rows \[2\]\)"):
        _sample(logits, SamplingParams(temperature=temperature), torch.Generator().manual_seed(0))
