"""The tiny from-scratch preset: a byte-level BPE tokenizer trained offline on env text and
a small Qwen3-architecture causal LM built from a transformers config.

The result is an ordinary model directory (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` with a chat template), so every backend and
trainer loads it exactly like a pretrained chat model. The chat template uses the
Qwen/Hermes tag format the envs parse: ``<|im_start|>role ... <|im_end|>`` turns, tools
listed in the system turn inside ``<tools></tools>`` (by default without the env's system
text, see :func:`chat_template`; and compactly, one ``name(arg, ...)``
line per tool rather than the full JSON schema: a few-million-parameter model learns the
tools from demonstrations, and short contexts keep it fast), tool results as a user turn inside
``<tool_response></tool_response>``, ``<|im_end|>`` ends every turn (the model's EOS).

Building is deterministic in the :class:`TinySpec` and cached under
``$TRACE_GYM_CACHE/presets/tiny-<hash>`` (default ``~/.cache/trace-gym``), so it is paid once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Tags of the ReAct format get a token each: a tiny model learns them far faster that way.
TAG_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<answer>", "</answer>",
              "<tool_response>", "</tool_response>", "<tools>", "</tools>"]

_HEAD_FULL = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' + system + '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{%- set f = tool['function'] if 'function' in tool else tool %}"
    "{{- '\\n' + f['name'] + '(' + ((f.get('parameters') or {}).get('properties') or {}) | list | join(', ') + ')' }}"
    "{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif system %}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}"
    "{%- endif %}"
)
_HEAD_TOOLS = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n<tools>' }}"
    "{%- for tool in tools %}{%- set f = tool['function'] if 'function' in tool else tool %}"
    "{{- '\\n' + f['name'] + '(' + ((f.get('parameters') or {}).get('properties') or {}) | list | join(', ') + ')' }}"
    "{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
)
_BODY = (
    "{%- for message in rest %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_SPLIT_SYSTEM = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
)


def chat_template(system: str = "full") -> str:
    """The preset's chat template. ``system="full"`` renders the system message and the
    tool list; ``"tools"`` renders only the tool list in the system turn (the env's English
    instructions carry nothing a model trained from scratch on demonstrations can read, and
    leaving them out halves its sequences)."""
    if system not in ("full", "tools"):
        raise ValueError(f"system must be 'full' or 'tools', got {system!r}")
    return _SPLIT_SYSTEM + (_HEAD_FULL if system == "full" else _HEAD_TOOLS) + _BODY


CHAT_TEMPLATE = chat_template("full")


class TinySpec(BaseModel):
    """What the tiny preset builds. Its hash names the cache directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    envs: tuple[str, ...] = Field(("trace_gym/MathCalc-v0", "trace_gym/ToolCalls-v0"), description="Envs whose prompts, tool schemas and demonstrations train the tokenizer.")
    corpus_tasks: int = Field(1000, description="Tasks per env (train and test splits) rendered as chats for tokenizer training.")
    vocab_size: int = Field(1024, description="BPE vocabulary size (bytes, merges, special and tag tokens).")
    hidden_size: int = Field(256, description="Transformer width.")
    num_layers: int = Field(4, description="Transformer blocks.")
    num_heads: int = Field(4, description="Attention heads.")
    num_kv_heads: int = Field(2, description="Key/value heads (grouped-query attention).")
    intermediate_size: int = Field(768, description="MLP width.")
    max_positions: int = Field(2048, description="Longest sequence the rotary embedding is configured for.")
    system: Literal["full", "tools"] = Field("tools", description="Chat template: 'full' renders the env's system message, 'tools' only the tool list (see chat_template).")
    seed: int = Field(0, description="Initialisation seed.")

    def key(self) -> str:
        """A short hash of the spec (and of the chat template), for cache directories."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True) + chat_template(self.system)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def cache_root() -> Path:
    """``$TRACE_GYM_CACHE`` or ``~/.cache/trace-gym`` (the model cache of
    :func:`trace_gym.policies.models.cache_dir`): presets and warmed checkpoints live under it."""
    from trace_gym.policies.models import cache_dir

    return cache_dir()


def _pre_tokenizer():
    from tokenizers import pre_tokenizers

    # One token per digit (as Qwen's tokenizer does): numbers never seen in training are
    # still copied digit by digit from a tool result into the answer.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])


def _blank_tokenizer(template: str = CHAT_TEMPLATE):
    """A tokenizer object with the template and special tokens but no merges (to render chats)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template)


def env_chats(env_ids: Iterable[str], n_tasks: int) -> Iterator[tuple[list[dict[str, str]], list[dict]]]:
    """Demonstrated episodes of each env as ``(messages, tools)``: the system and user turns,
    then each demonstrated assistant turn followed by the env's observation (as a ``tool``
    message, or the role the env reports). Train and test splits alternate."""
    import trace_gym

    for env_id in env_ids:
        env = trace_gym.make(env_id)
        src = env.tasks()
        for i in range(n_tasks):
            split = "train" if i % 2 == 0 else "test"
            task = src.get(i // 2, split)
            _, info = env.reset(options={"task": task})
            yield demonstration_chat(env, task, info)


def demonstration_chat(env, task, info) -> tuple[list[dict[str, str]], list[dict]]:
    """Play ``env.demonstrate(task)`` in ``env`` (already reset to ``task``); return the chat
    ``(messages, tools)`` it produces, observations included."""
    messages = [dict(m) for m in info["messages"]]
    tools = info.get("tools") or []
    for action in env.demonstrate(task):
        messages.append({"role": "assistant", "content": action})
        obs, _, terminated, truncated, step_info = env.step(action)
        if terminated or truncated:
            break
        messages.append({"role": step_info.get("role", "tool"), "content": obs})
    return messages, tools


def train_tokenizer(texts: Iterable[str], vocab_size: int, template: str = CHAT_TEMPLATE):
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``) trained on ``texts``, with the
    chat template, ``<|im_end|>`` as EOS and ``<|endoftext|>`` as padding."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False) for t in TAG_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=template,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def build_tiny(spec: TinySpec, directory: Path) -> Path:
    """Train the tokenizer on env chats and write a freshly initialised Qwen3 model to ``directory``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per weight file is noise in a training log

    template = chat_template(spec.system)
    blank = _blank_tokenizer(template)
    texts = [blank.apply_chat_template(m, tools=t or None, tokenize=False) for m, t in env_chats(spec.envs, spec.corpus_tasks)]
    tokenizer = train_tokenizer(texts, spec.vocab_size, template)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "trace_gym_preset.json").write_text(json.dumps({"preset": "tiny", "spec": spec.model_dump(mode="json"),
                                                                 "corpus_chats": len(texts)}, indent=1))
    return directory


def tiny_model_dir(spec: TinySpec | None = None, *, rebuild: bool = False) -> Path:
    """The cached model directory of the tiny preset, built on first use (atomically: a
    concurrent or killed build never leaves a half-written directory behind)."""
    spec = spec or TinySpec()
    final = cache_root() / "presets" / f"tiny-{spec.key()}"
    if final.is_dir() and not rebuild:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build_tiny(spec, tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError:
        if not final.is_dir():  # another process won the race: use theirs
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
