"""Trainers (importable as ``trace_gym.trainers``): the RL trainer, SFT warm start, the
tiny from-scratch preset, checkpoints and the policy loss.

``RLTrainer`` and ``RLConfig`` are imported lazily (they import torch and transformers).
"""

from __future__ import annotations

from typing import Any

__all__ = ["RLTrainer", "RLConfig", "load_config", "SFTConfig", "warm_start", "CheckpointManager", "policy_loss"]

_WHERE = {
    "RLTrainer": "trace_gym.trainers.rl",
    "RLConfig": "trace_gym.trainers.config",
    "load_config": "trace_gym.trainers.config",
    "SFTConfig": "trace_gym.trainers.sft",
    "warm_start": "trace_gym.trainers.sft",
    "CheckpointManager": "trace_gym.trainers.checkpoint",
    "policy_loss": "trace_gym.trainers.loss",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'trace_gym.trainers' has no attribute {name!r}")
