"""SFT warm start on ``demonstrate(task)`` trajectories, with the loss on policy tokens only.

A demonstration is played in its env and turned into token ids exactly as the rollout
engine would build the same trajectory: the opening chat from the policy's chat template
(:class:`~trace_gym.policies.chat.ChatTemplate`), then per turn the action's ids followed by
the end-of-turn token (mask 1: what the policy generates) and the rendered observation
(mask 0). Training is plain next-token cross-entropy on the mask-1 tokens, averaged over
the batch's tokens, with AdamW and a linear warm-up / cosine schedule.

:func:`warm_start` is what the RL trainer calls: it returns a model directory warmed with
an :class:`SFTConfig`, cached under ``$TRACE_GYM_CACHE/sft/<hash>`` keyed by the base
model and the config, so later runs (other seeds, other allocators, the eval command)
reuse it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from trace_gym.run import EnvSpec
from trace_gym.task import split_counts
from trace_gym.trainers.batching import micro_batches
from trace_gym.trainers.presets import TinySpec, cache_root, tiny_model_dir




class SFTConfig(BaseModel):
    """The SFT warm start. Every field but ``micro_batch_tokens`` (a memory bound) is part of the
    cache key, with the device it trains on: the key names the weights, whoever builds them."""

    model_config = ConfigDict(extra="forbid")

    envs: list[EnvSpec] = Field(default_factory=lambda: [EnvSpec(id="trace_gym/MathCalc-v0")],
                                description="Envs whose demonstrations are trained on.")
    tasks: int = Field(2000, ge=1, description="Demonstrations (train-split tasks), split over envs by weight.")
    epochs: float = Field(2.0, gt=0, description="Passes over the demonstrations (fractions allowed).")
    lr: float = Field(1e-3, gt=0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup: float = Field(0.05, ge=0, lt=1, description="Share of the steps spent warming the learning rate up linearly.")
    batch_size: int = Field(16, ge=1, description="Sequences per optimizer step.")
    micro_batch_size: int = Field(16, ge=1, description="Sequences per forward pass (gradient accumulation splits batches).")
    micro_batch_tokens: int | None = Field(
        4096, ge=16, description="Most padded tokens per forward pass (None: no bound); a longer sequence goes alone. "
                                 "The loss and the step are the same up to float rounding, so it is not part of the cache key: "
                                 "a machine with less memory reuses a warm start built with more (a rebuild at another "
                                 "bound sums in another order and, like one at another thread count, may differ).")
    max_length: int = Field(1024, ge=16, description=(
        "Demonstrations longer than this (in tokens) are skipped, with a warning per env that loses some; "
        "an env that loses all of them is an error."))
    strip_thoughts: bool = Field(False, description="Drop <think>...</think> blocks from demonstrated turns: shorter turns for small models that do not use them.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient-norm clip.")
    seed: int = Field(0, description="Seeds task order and batching.")
    threads: int = Field(1, ge=1, description="torch CPU threads the SFT trains with, whatever the calling process uses. "
                                              "Part of the cache key: the thread count sets the order of float sums, and "
                                              "over a long run that gives different weights.")


# ----------------------------------------------------------------------------- data


@dataclass
class Example:
    """One demonstration as token ids and a loss mask (1 on policy tokens)."""

    ids: list[int]
    mask: list[int]
    env_id: str
    task_id: str


_THOUGHT = re.compile(r"<think>.*?</think>\s*", re.S)


def demonstration_example(chat: Any, env: Any, task: Any, *, strip_thoughts: bool = False) -> Example:
    """Token ids and loss mask of ``env.demonstrate(task)``, built as the rollout engine
    builds a trajectory (``chat`` is a :class:`~trace_gym.policies.chat.ChatTemplate`)."""
    _, info = env.reset(options={"task": task})
    messages = info.get("messages") or env.messages()
    ids = list(chat.render_prompt(messages, info.get("tools") or []))
    mask = [0] * len(ids)
    for action in env.demonstrate(task):
        if strip_thoughts:
            action = _THOUGHT.sub("", action).strip()
        gen = chat.encode(action) + [int(chat.eot_id)]
        ids += gen
        mask += [1] * len(gen)
        obs, _, terminated, truncated, step_info = env.step(action)
        if terminated or truncated:
            break
        tail = chat.render_observation(obs, role=str(step_info.get("role", "tool")), closed=True)
        ids += tail
        mask += [0] * len(tail)
    return Example(ids, mask, env.env_id, task.id)


def task_counts(envs: Sequence[EnvSpec], total: int) -> list[int]:
    """Tasks per env: ``total`` split by weight (largest remainders), each at least 1."""
    return split_counts([e.weight for e in envs], total)


def build_examples(chat: Any, envs: Sequence[EnvSpec], tasks: int, *, split: str = "train", start: int = 0,
                   strip_thoughts: bool = False) -> list[Example]:
    """Demonstrations of ``tasks`` tasks of ``split`` (indices from ``start``) over ``envs``."""
    import trace_gym

    out: list[Example] = []
    for spec, n in zip(envs, task_counts(envs, tasks)):
        env = trace_gym.make(spec.id, **spec.kwargs)
        src = env.tasks()
        size = int(src.size(split))  # a finite source is cycled through
        for i in range(start, start + n):
            out.append(demonstration_example(chat, env, src.get(i % size, split), strip_thoughts=strip_thoughts))
    return out


def length_grouped_batches(lengths: Sequence[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of indices of similar length (less padding), in random order."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    # sort within windows of 50 batches: similar lengths together, order still random
    window = batch_size * 50
    grouped = []
    for i in range(0, len(order), window):
        grouped += sorted(order[i : i + window], key=lambda j: lengths[j])
    batches = [grouped[i : i + batch_size] for i in range(0, len(grouped), batch_size)]
    rng.shuffle(batches)
    return batches


def pad_batch(examples: Sequence[Example], pad_id: int, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, loss_mask)``."""
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), int(pad_id), dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    loss = torch.zeros((len(examples), width), dtype=torch.float32)
    for r, e in enumerate(examples):
        n = len(e.ids)
        ids[r, :n] = torch.tensor(e.ids)
        attn[r, :n] = 1
        loss[r, :n] = torch.tensor(e.mask, dtype=torch.float32)
    return ids.to(device), attn.to(device), loss.to(device)


def masked_nll(model: Any, ids: torch.Tensor, attn: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token NLL over tokens with ``loss_mask`` 1, and their count."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    target = ids[:, 1:]
    m = loss_mask[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none").view_as(m)
    return (nll * m).sum(), m.sum()


def lr_lambda(total_steps: int, warmup: float) -> Callable[[int], float]:
    """Linear warm-up over ``warmup * total_steps`` steps, then cosine decay to 10%."""
    w = max(1, int(round(warmup * total_steps)))

    def f(step: int) -> float:
        if step < w:
            return (step + 1) / w
        t = (step - w) / max(1, total_steps - w)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))

    return f


def fitting_examples(examples: Sequence[Example], max_length: int) -> list[Example]:
    """The ``examples`` of at most ``max_length`` tokens. Warns for every env that lost some;
    raises ``ValueError`` for an env that lost all (or when ``examples`` is empty)."""
    if not examples:
        raise ValueError("no demonstrations to train on")
    kept = [e for e in examples if len(e.ids) <= max_length]
    by_env: dict[str, list[int]] = {}
    for e in examples:
        by_env.setdefault(e.env_id, []).append(len(e.ids))
    lost = []
    for env_id, lengths in by_env.items():
        over = sorted(n for n in lengths if n > max_length)
        if len(over) == len(lengths):
            raise ValueError(f"{env_id}: none of its {len(lengths)} demonstrations fits sft.max_length={max_length} "
                             f"(the shortest has {over[0]} tokens, the longest {over[-1]}): raise max_length to at "
                             f"least {over[-1]}, or leave the env out of the SFT")
        if over:
            lost.append(f"{env_id} {len(over)} of {len(lengths)} (up to {over[-1]} tokens)")
    if lost:
        warnings.warn(f"SFT skips demonstrations longer than max_length={max_length}: " + "; ".join(lost), stacklevel=3)
    return kept


def train_sft(model: Any, pad_id: int, examples: Sequence[Example], cfg: SFTConfig,
              log: Callable[[dict[str, float]], None] | None = None) -> dict[str, float]:
    """SFT ``model`` in place on ``examples``; returns summary figures (first and last loss,
    tokens, seconds, demonstrations skipped).

    Demonstrations longer than ``cfg.max_length`` are skipped, with a warning naming each env
    that lost some; an env none of whose demonstrations fits is a ``ValueError`` (the warm
    start would never have seen it), naming the length that would keep them.
    """
    offered = len(examples)
    examples = fitting_examples(examples, cfg.max_length)
    device = next(model.parameters()).device
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    lengths = [len(e.ids) for e in examples]
    per_epoch = math.ceil(len(examples) / cfg.batch_size)
    total = max(1, int(round(per_epoch * cfg.epochs)))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, cfg.warmup))
    model.train()
    batches: list[list[int]] = []
    first = last = float("nan")
    tokens = 0
    t0 = time.perf_counter()
    for step in range(total):
        if not batches:
            batches = length_grouped_batches(lengths, cfg.batch_size, rng)
        batch = [examples[i] for i in batches.pop()]
        n_tok = sum(sum(e.mask[1:]) for e in batch)
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for micro in micro_batches([e.ids for e in batch], cfg.micro_batch_tokens, cfg.micro_batch_size):
            ids, attn, m = pad_batch([batch[i] for i in micro], pad_id, device)
            with _autocast(device):
                nll, _ = masked_nll(model, ids, attn, m)
            (nll / max(n_tok, 1)).backward()
            loss_sum += float(nll.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        loss = loss_sum / max(n_tok, 1)
        first = loss if step == 0 else first
        last = loss
        tokens += sum(len(e.ids) for e in batch)
        if log is not None:
            log({"step": step + 1, "steps": total, "loss": loss, "lr": sched.get_last_lr()[0]})
    model.eval()
    return {"first_loss": first, "last_loss": last, "steps": total, "examples": len(examples),
            "skipped": offered - len(examples), "tokens": tokens,
            "seconds": time.perf_counter() - t0}


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


# ----------------------------------------------------------------------------- cached warm start


def resolve_base(model: str, tiny: TinySpec | None = None) -> tuple[str, str]:
    """``(path, identity)`` of a base model: ``"tiny"`` builds/loads the tiny preset; aliases
    and directories go through :func:`trace_gym.policies.models.resolve_model`. ``identity`` is what
    the SFT cache key records."""
    if model == "tiny":
        spec = tiny or TinySpec()
        return str(tiny_model_dir(spec)), f"tiny-{spec.key()}"
    from trace_gym.policies.models import resolve_model

    path = resolve_model(model)
    ident = model
    cfg = Path(path) / "config.json"
    if cfg.is_file():  # a local directory: its contents, not just its name, identify it
        ident = f"{model}:{hashlib.sha256(cfg.read_bytes()).hexdigest()[:12]}"
        weights = sorted(Path(path).glob("*.safetensors"))
        if weights:
            st = weights[0].stat()
            ident += f":{st.st_size}"
    return path, ident


def sft_key(identity: str, cfg: SFTConfig, device: str = "cpu") -> str:
    """Cache key of a warm start: the base model's identity, the config and the device type
    it trains on (``"cpu"`` or ``"cuda"``: their kernels sum in different orders)."""
    blob = json.dumps({"base": identity, "sft": cfg.model_dump(mode="json", exclude={"micro_batch_tokens"}), "device": device},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warm_start(model: str, cfg: SFTConfig, *, tiny: TinySpec | None = None,
               log: Callable[[dict[str, float]], None] | None = None, rebuild: bool = False) -> Path:
    """The directory of ``model`` after SFT with ``cfg``, trained on first use and cached
    (``$TRACE_GYM_CACHE/sft/<name>-<key>``, :func:`sft_key`; ``sft_summary.json`` inside has
    the figures, the device, the torch threads and the package versions it was trained
    with). The SFT runs with ``cfg.threads`` torch threads; the process's setting is restored
    afterwards."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trace_gym.policies.chat import ChatTemplate
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per weight file is noise in a training log

    path, ident = resolve_base(model, tiny)
    name = Path(path).name if model != "tiny" else "tiny"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    final = cache_root() / "sft" / f"{name}-{sft_key(ident, cfg, device)}"
    if (final / "sft_summary.json").is_file() and not rebuild:
        return final
    tokenizer = AutoTokenizer.from_pretrained(path)
    net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    chat = ChatTemplate(tokenizer)
    examples = build_examples(chat, cfg.envs, cfg.tasks, strip_thoughts=cfg.strip_thoughts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else chat.eot_id
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        summary = train_sft(net, int(pad), examples, cfg, log=log)
        summary["threads"] = torch.get_num_threads()
    finally:
        torch.set_num_threads(caller_threads)
    # the key holds the config and the device, not the install: a warm start rebuilt under
    # other package versions can differ, so the summary says which
    from trace_gym.provenance import cpu_info, package_versions

    summary.update(base=ident, config=cfg.model_dump(mode="json"), device=device, versions=package_versions(), cpu=cpu_info())
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        net.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "sft_summary.json").write_text(json.dumps(summary, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
