"""Rollout backends of training, evaluation and leaderboards (``rollout.backend``).

One config key chooses the engine every rollout and evaluation of a run goes through:

* ``hf``: the trained module itself generates (in this process). On CPU (and with
  ``model.bf16: false``) the policy shares the fp32 module, so it is current after every
  optimizer step with no copy. On CUDA with ``model.bf16: true`` the policy holds a bf16 copy
  of the weights (master weights stay fp32 in the trainer) and :func:`push_weights` copies
  the trained weights into it after each update (LoRA: merged into the base weights).
* ``vllm``: :class:`~trace_gym.policies.vllm.VLLMPolicy`, vLLM's engine in this process,
  built from the same starting weights; after each update it receives the full weights
  (in memory), or, when training LoRA, the adapter (saved with peft into the run's
  ``weight-sync/`` directory).
* ``openai``: :class:`~trace_gym.policies.openai.OpenAIPolicy` over ``rollout.servers``
  (``vllm serve`` replicas or any OpenAI-compatible server). Full weights are written as
  safetensors to the policy's ``sync_dir`` and reloaded by every server; LoRA adapters are
  loaded by name. A server that can take neither can roll out and evaluate, and the trainer
  refuses to train through it (:func:`check_trainable`).

Non-hf backends sample outside the trainer's own forward pass, so the trainer switches
``loss.is_correction`` on for them unless the config sets it (:func:`with_backend_defaults`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

BACKENDS = ("hf", "vllm", "openai")


def with_backend_defaults(cfg: Any) -> Any:
    """``cfg`` with the defaults its backend implies: ``loss.is_correction`` on for a
    backend other than ``hf``, and for ``rollout.mode: async`` (rollouts one or more updates
    old), when the config does not set it (a copy; ``cfg`` is unchanged)."""
    off_policy = cfg.rollout.backend != "hf" or cfg.rollout.mode == "async"
    if off_policy and "is_correction" not in cfg.loss.model_fields_set:
        cfg = cfg.model_copy(deep=True)
        cfg.loss.is_correction = True
    return cfg


def build_policy(rollout: Any, model_dir: str, *, tokenizer: Any = None, model: Any = None, device: str | None = None,
                 lora_rank: int = 0) -> Any:
    """The rollout policy of ``rollout`` (a :class:`~trace_gym.trainers.config.RolloutSection`)
    starting from the weights in ``model_dir``.

    ``hf``: ``model`` (a module to generate with, e.g. the trained one) or, without one, the
    model loaded from ``model_dir`` on ``device``. ``vllm``: an engine on ``model_dir``, with
    LoRA support up to ``lora_rank`` when > 0. ``openai``: a client of ``rollout.servers`` that
    renders chats with ``tokenizer`` (default: ``model_dir``'s). ``rollout.policy_kwargs`` go
    to the backend's constructor.
    """
    from trace_gym.policies.base import make_policy

    kwargs = dict(rollout.policy_kwargs)
    if rollout.backend == "hf":
        kwargs.setdefault("max_batch_size", rollout.max_batch_size)
        if model is not None:
            return make_policy("hf", model=model, tokenizer=tokenizer, **kwargs)
        return make_policy("hf", model=model_dir, device=device, **kwargs)
    if rollout.backend == "vllm":
        if lora_rank > 0:
            kwargs.setdefault("lora_rank", lora_rank)
        return make_policy("vllm", model=model_dir, **kwargs)
    if rollout.backend == "openai":
        if not rollout.servers:
            raise ValueError("rollout.backend=openai needs rollout.servers: the API roots of the servers, e.g. [http://127.0.0.1:8000/v1]")
        return make_policy("openai", base_url=list(rollout.servers), tokenizer=tokenizer if tokenizer is not None else model_dir,
                           **kwargs)
    raise ValueError(f"rollout.backend must be one of {', '.join(BACKENDS)}, got {rollout.backend!r}")


def build_router(rollout: Any, model_dir: str, *, tokenizer: Any, device: str = "cpu", lora_rank: int = 0) -> Any:
    """``rollout.engines`` Ray actors, each holding the ``hf`` or ``vllm`` backend on the
    weights in ``model_dir``, behind an :class:`~trace_gym.rollout.router.EngineRouter` that
    renders chats here with ``tokenizer``. On CUDA each actor asks Ray for one GPU."""
    from trace_gym.policies.chat import ChatTemplate
    from trace_gym.rollout.router import EngineRouter

    if rollout.backend not in ("hf", "vllm"):
        raise ValueError(f"rollout.engines runs the 'hf' or 'vllm' backend in Ray actors, not {rollout.backend!r}")
    kwargs = dict(rollout.policy_kwargs)
    kwargs["model"] = model_dir
    if rollout.backend == "hf":
        kwargs.setdefault("max_batch_size", rollout.max_batch_size)
        kwargs["device"] = device
    elif lora_rank > 0:
        kwargs.setdefault("lora_rank", lora_rank)
    renderer = ChatTemplate(tokenizer, chat_template=kwargs.get("chat_template"), tools_in_template=kwargs.get("tools_in_template"))
    return EngineRouter.on_ray(rollout.backend, kwargs, rollout.engines, renderer=renderer,
                               num_gpus=1.0 if device == "cuda" else 0.0, num_cpus=rollout.actor_cpus)


def check_trainable(policy: Any, lora: bool) -> None:
    """Raise ``ValueError`` when a trainer cannot push its weights into ``policy``: training
    through it would roll out a policy that never changes. LoRA training needs ``"adapter"``
    or ``"weights"`` (merged), full training ``"weights"``."""
    modes = policy.sync_modes()
    if "weights" in modes or (lora and "adapter" in modes):
        return
    help_ = policy.sync_help() if hasattr(policy, "sync_help") else f"the {policy.name!r} backend cannot take new weights"
    raise ValueError(
        f"rollout.backend={policy.name}: {help_}. Training would keep rolling out the old weights, so `train` refuses; "
        "such a server can still roll out (`trace-gym rollout`, allocation tracks) and evaluate (`trace-gym eval`), "
        "or train with update_policy=false (predictor only)"
        + ("" if lora else "; with model.lora_rank > 0 a server that loads LoRA adapters is enough")
    )


def merged_state(model: Any) -> dict[str, Any]:
    """Full weights of a (possibly peft LoRA) model under the base model's key names, each
    LoRA layer's delta added to its base weight. Computed out of place: the trained weights
    are not touched (peft's merge/unmerge would round them a little each time)."""
    import torch

    if not hasattr(model, "peft_config"):
        return model.state_dict()
    inner = model.get_base_model()
    with torch.no_grad():
        state = {k.replace(".base_layer", ""): v.detach() for k, v in inner.state_dict().items() if "lora_" not in k}
        for name, module in inner.named_modules():
            if not (hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")):
                continue
            for adapter in getattr(module, "active_adapters", []):
                if adapter in getattr(module, "lora_A", {}):
                    key = f"{name}.weight"
                    state[key] = state[key] + module.get_delta_weight(adapter).to(state[key].dtype)
    return state


def push_weights(policy: Any, model: Any, scratch: Path, version: int) -> str:
    """Send ``model``'s current weights to ``policy``; returns what was sent (``"weights"``,
    ``"merged"`` or ``"adapter"``).

    A LoRA model sends its adapter when the policy loads adapters (saved with peft into
    ``scratch/adapter-{version % 2}``: the previous directory stays intact while the new one
    is written), else its merged weights; a full model sends its state dict.
    """
    lora = hasattr(model, "peft_config")
    modes = policy.sync_modes()
    if lora and "adapter" in modes:
        path = scratch / f"adapter-{version % 2}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(path))
        policy.load_adapter(str(path))
        return "adapter"
    if "weights" not in modes:
        check_trainable(policy, lora)
    if lora:
        policy.load_weights(merged_state(model))
        return "merged"
    policy.load_weights(model.state_dict())
    return "weights"


def param_version(model: Any) -> int:
    """A counter that changes whenever a parameter of ``model`` is modified in place
    (optimizer steps, ``load_state_dict``): the sum of the tensors' version counters."""
    return sum(int(p._version) for p in model.parameters())


def bf16_copy_wanted(cfg: Any, device: Any) -> bool:
    """Whether the hf backend generates with a bf16 copy (CUDA and ``model.bf16``)."""
    return cfg.rollout.backend == "hf" and getattr(device, "type", str(device)) == "cuda" and bool(cfg.model.bf16)


def load_generation_copy(model_dir: str, device: Any, *, bf16: bool = False) -> Any:
    """The model in ``model_dir`` on ``device`` (in bf16 with ``bf16``, else fp32), for
    generation only: a copy that receives the trained weights at each sync."""
    import torch
    from transformers import AutoModelForCausalLM

    gen = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if bf16 else torch.float32).to(device)
    gen.eval()
    for p in gen.parameters():
        p.requires_grad_(False)
    return gen


def eval_policy(cfg: Any, model_dir: str, state: dict[str, Any] | None, *, device: str | None = None) -> tuple[Any, str]:
    """The policy ``trace-gym eval`` evaluates with ``cfg.rollout.backend``: the weights of
    ``model_dir`` with a checkpoint's model ``state`` applied (LoRA states merged first).
    Returns ``(policy, note)``; ``note`` says what an ``openai`` server evaluates when it
    cannot take the weights (its own), else is empty."""
    r = cfg.rollout
    full = _full_state(cfg, model_dir, state) if state is not None else None
    policy = build_policy(r, model_dir, device=device)
    if r.backend == "openai" and "weights" not in policy.sync_modes():
        return policy, f"{policy.sync_help()}: evaluating the weights the server(s) hold"
    if full is not None:
        policy.load_weights(full)
    elif r.backend == "openai":
        policy.load_weights(os.path.abspath(model_dir))  # the servers may hold any weights: send the start's
    return policy, ""


def _full_state(cfg: Any, model_dir: str, state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's model state as full weights under the base model's key names."""
    if cfg.model.lora_rank <= 0:
        return state
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=cfg.model.lora_rank, lora_alpha=cfg.model.lora_alpha,
                                            target_modules=cfg.model.lora_targets, task_type="CAUSAL_LM"))
    model.load_state_dict(state)
    return model.merge_and_unload().state_dict()
