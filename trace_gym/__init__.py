"""trace-gym: multi-turn agent environments with verifiable rewards, and a
budget-allocation API that decides which prompts get rollouts and from which turn-level
prefixes to branch.

The public API is :data:`__all__`::

    import trace_gym
    env = trace_gym.make("trace_gym/MathCalc-v0")
    alloc = trace_gym.make_allocator("trace")
    pred = trace_gym.make_predictor("hashed")
    forest = trace_gym.Forest()

Environments, allocators, predictors, advantage estimators and policy backends register
by name, with a decorator (:func:`register`, :func:`register_allocator`,
:func:`register_predictor`, :func:`register_advantage`, :func:`register_policy`) or from
an installed package through the entry-point groups ``trace_gym.envs``,
``trace_gym.allocators``, ``trace_gym.predictors``, ``trace_gym.advantages`` and
``trace_gym.policies`` (see :mod:`trace_gym.registry`).

``import trace_gym`` imports no environment, allocator, trainer or model code (no torch):
``RolloutEngine``, ``RunSpec`` and ``Step`` are imported on first access.
"""

import importlib as _importlib
from typing import Any as _Any

from trace_gym.allocation.allocator import (Allocator, Budget, BudgetExceeded, allocate_step, make_allocator,
                                            register_allocator)
from trace_gym.env.base import AgentEnv, EnvSnapshot, EnvUnavailable
from trace_gym.env.tools import Tool, tool
from trace_gym.forest.advantages import register_advantage
from trace_gym.forest.forest import Forest, History
from trace_gym.policies.base import Generation, Policy, SamplingParams, make_policy, register_policy
from trace_gym.predictors.base import Predictor, make_predictor, register_predictor
from trace_gym.registry import env_ids, make, register
from trace_gym.registry import load_plugins as _load_plugins
from trace_gym.task import Task, TaskSource

__version__ = "0.1.0"

__all__ = [
    # environments
    "AgentEnv", "EnvSnapshot", "EnvUnavailable", "Task", "TaskSource", "Tool", "tool", "env_ids", "make", "register",
    # forest and allocation
    "Allocator", "Budget", "BudgetExceeded", "Forest", "History", "allocate_step", "make_allocator",
    "register_advantage", "register_allocator",
    # predictors and policies
    "Generation", "Policy", "Predictor", "SamplingParams", "make_policy", "make_predictor", "register_policy",
    "register_predictor",
    # running
    "RolloutEngine", "RunSpec", "Step",
]

# imported on first access: they pull in the rollout machinery (and, for some policies, torch)
_LAZY = {
    "RolloutEngine": "trace_gym.rollout.engine",
    "RunSpec": "trace_gym.run",
    "Step": "trace_gym.step",
}


def __getattr__(name: str) -> _Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trace_gym' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__ + ["__version__"])


# Built-in and installed environments, registered on Gymnasium's registry from the
# ``trace_gym.envs`` entry points (string entry points: no env module is imported), so
# ``gymnasium.make("trace_gym/MathCalc-v0")`` works after ``import trace_gym``.
_load_plugins(strict=False, fresh=False)
