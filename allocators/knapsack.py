"""``knapsack``: Knapsack RL's budget allocation.

With a success estimate p_i per candidate prompt (by default the per-prompt ``beta``
posterior, i.e. the prompt's pass-rate history), choose N_i rollouts per prompt to

    maximise  sum_i (1 - p_i^N_i - (1 - p_i)^N_i) * p_i (1 - p_i)^2     ("InfoGain" value)
    s.t.      sum_i N_i <= budget.trajectories,  0 <= N_i <= n_max,

by exact dynamic programming over the budget (the value is not concave in N: one rollout
alone is worth nothing, so a greedy can be wrong). Ties go to spending more. No branching.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numba as nb
import numpy as np

from trace_gym.allocation.budget import Budget
from trace_gym.allocation.allocator import Allocator
from trace_gym.allocators import register
from trace_gym.forest.forest import Forest
from trace_gym.predictors.base import predict_nodes


def knapsack_value(p: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Knapsack RL's value of ``n`` rollouts on a prompt of success probability ``p``."""
    p = np.asarray(p, dtype=np.float64)
    n = np.asarray(n)
    return np.where(n > 0, 1.0 - p**n - (1.0 - p) ** n, 0.0) * p * (1.0 - p) ** 2


@nb.njit(cache=True, nogil=True)
def _knapsack_kernel(value, budget):
    """value[i, n] for n = 0..n_max; returns the counts maximising sum value[i, N_i] with
    sum N_i <= budget (ties: larger N_i)."""
    n_items, width = value.shape
    best = np.zeros(budget + 1)
    choice = np.zeros((n_items, budget + 1), dtype=np.int32)
    new = np.empty(budget + 1)
    for i in range(n_items):
        for c in range(budget + 1):
            top = best[c] + value[i, 0]
            arg = 0
            for n in range(1, min(width - 1, c) + 1):
                x = best[c - n] + value[i, n]
                if x >= top:
                    top = x
                    arg = n
            new[c] = top
            choice[i, c] = arg
        best[:] = new
    out = np.zeros(n_items, dtype=np.int64)
    c = budget
    for i in range(n_items - 1, -1, -1):
        out[i] = choice[i, c]
        c -= out[i]
    return out


def knapsack_counts(p: np.ndarray, budget: int, n_max: int) -> np.ndarray:
    """Exact maximiser of the Knapsack RL objective (see the module docstring)."""
    p = np.clip(np.asarray(p, dtype=np.float64), 0.0, 1.0)
    if budget < 0 or n_max < 0:
        raise ValueError("budget and n_max must be non-negative")
    n_max = min(n_max, budget)
    if p.size == 0 or budget == 0 or n_max == 0:
        return np.zeros(p.size, dtype=np.int64)
    table = knapsack_value(p[:, None], np.arange(n_max + 1)[None, :])
    return _knapsack_kernel(np.ascontiguousarray(table), int(budget))


@register("knapsack")
class KnapsackAllocator(Allocator):
    """Knapsack RL (see the module docstring).

    Args:
        n_max: most rollouts per prompt (``budget.max_per_prompt`` lowers it further);
            the DP costs O(prompts x budget x n_max).
    """

    name = "knapsack"
    default_predictor: ClassVar[str | None] = "beta"
    advantage: ClassVar[str] = "grpo"

    def __init__(self, n_max: int = 32):
        super().__init__()
        if n_max < 1:
            raise ValueError(f"n_max must be at least 1, got {n_max}")
        self.n_max = int(n_max)

    def plan_roots(self, forest: Forest, budget: Budget, predictor: Any | None) -> np.ndarray:
        if predictor is None:
            raise ValueError("allocator 'knapsack' needs a predictor of each prompt's success rate (e.g. 'beta')")
        roots = forest.root_nodes.astype(np.int64)
        p = predict_nodes(forest, roots, predictor)
        cap = min(self.n_max, budget.max_per_prompt or self.n_max)
        return knapsack_counts(p, budget.trajectories, cap)
