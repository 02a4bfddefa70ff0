"""``grpo``: the GRPO baseline. G = ``budget.group_size`` rollouts on each of
``budget.trajectories // G`` prompts drawn uniformly at random (seeded) from the
candidates; no branching, no predictor."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from trace_gym.allocation.budget import Budget
from trace_gym.allocation.allocator import Allocator
from trace_gym.allocators import register
from trace_gym.forest.forest import Forest


@register("grpo")
class GRPOAllocator(Allocator):
    """Fixed groups of G on random prompts (GRPO / TRL's GRPOTrainer)."""

    name = "grpo"
    default_predictor: ClassVar[str | None] = None
    advantage: ClassVar[str] = "grpo"

    def __init__(self, seed: int = 0):
        super().__init__(seed)

    def plan_roots(self, forest: Forest, budget: Budget, predictor: Any | None) -> np.ndarray:
        g = budget.group_size
        n = min(budget.trajectories // g, forest.n_trees)
        counts = np.zeros(forest.n_trees, dtype=np.int64)
        counts[self.rng.choice(forest.n_trees, size=n, replace=False)] = g
        return counts
