"""``pcl``: prompt curriculum by a value model (PCL). The predictor scores every candidate
prompt; the ``budget.trajectories // G`` prompts whose predicted success is closest to 1/2
get G = ``budget.group_size`` rollouts each (ties broken at random). No branching."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from trace_gym.allocation.budget import Budget
from trace_gym.allocation.allocator import Allocator
from trace_gym.allocators import register
from trace_gym.forest.forest import Forest
from trace_gym.predictors.base import predict_nodes


def nearest_half(values: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of the ``n`` entries of ``values`` (predicted success probabilities) closest to
    1/2, nearest first, ties in a random order drawn from ``rng`` (one draw per entry)."""
    values = np.asarray(values)
    return np.lexsort((rng.random(values.size), np.abs(values - 0.5)))[:n]


@register("pcl")
class PCLAllocator(Allocator):
    """Groups of G on the prompts predicted nearest to 50% success."""

    name = "pcl"
    default_predictor: ClassVar[str | None] = "hashed"
    advantage: ClassVar[str] = "grpo"

    def __init__(self, seed: int = 0):
        super().__init__(seed)

    def plan_roots(self, forest: Forest, budget: Budget, predictor: Any | None) -> np.ndarray:
        if predictor is None:
            raise ValueError("allocator 'pcl' needs a predictor (its value model of the prompt)")
        roots = forest.root_nodes.astype(np.int64)
        v = predict_nodes(forest, roots, predictor)
        g = budget.group_size
        n = min(budget.trajectories // g, forest.n_trees)
        counts = np.zeros(forest.n_trees, dtype=np.int64)
        counts[nearest_half(v, n, self.rng)] = g
        return counts
