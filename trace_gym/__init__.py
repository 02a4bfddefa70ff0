"""trace-gym: multi-turn agent environments with verifiable rewards, and a
budget-allocation API that decides which prompts get rollouts and from which turn-level
prefixes to branch.

The public API::

    import trace_gym
    env = trace_gym.make("trace_gym/MathCalc-v0")
    alloc = trace_gym.make_allocator("trace")
    pred = trace_gym.make_predictor("hashed")
    forest = trace_gym.Forest()
"""

from trace_gym.allocation.allocator import Allocator, Budget, BudgetExceeded, Spend, allocate_step, make_allocator
from trace_gym.env.base import AgentEnv, AgentText, EnvSnapshot, EnvUnavailable, EpisodeState, TurnResult
from trace_gym.forest.advantages import ADVANTAGES
from trace_gym.forest.forest import History, Forest
from trace_gym.allocation.solvers import solve_prefixes, solve_roots
from trace_gym.policies.base import Generation, Policy, SamplingParams, make_policy
from trace_gym.predictors.base import Predictor, make_predictor
from trace_gym.registry import Registry, env_ids, make, register
from trace_gym.task import Task, TaskSource
from trace_gym.env.tools import Tool, ToolError, tool

import trace_gym.envs  # noqa: E402,F401  (registers the built-in environments)

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGES", "solve_prefixes", "solve_roots",
    "AgentEnv", "AgentText", "Allocator", "Budget", "BudgetExceeded", "EnvSnapshot", "EnvUnavailable", "EpisodeState", "Forest", "Generation",
    "History", "Policy", "Predictor", "Registry", "SamplingParams", "Spend", "Task", "TaskSource", "Tool",
    "ToolError", "TurnResult", "allocate_step", "env_ids", "make", "make_allocator", "make_policy",
    "make_predictor", "register", "tool",
]
