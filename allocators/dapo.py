"""``dapo``: DAPO's dynamic sampling within a fixed budget.

DAPO wants a training batch of B groups that are all mixed (verl: keep groups with
0 < successes < G, over-sample to fill). Here B = ``budget.root_trajectories // G``
(G = ``budget.group_size``). Stage 1 samples B random prompts, G rollouts each. Then, round
after round, for every group still missing from the batch (B minus the mixed groups so
far) it samples a fresh prompt (one that has no rollouts yet), G rollouts each, while the
budget and fresh prompts last. Once the batch is full, the budget left goes to further
fresh groups in one last round, whose mixed groups join the batch: every allocator of a
comparison spends the same M (verl's DAPO would start its next step instead; at a fixed
trajectory budget per step that compute is here). All-equal groups are filtered:
:attr:`kept` marks the trees that enter the training batch, and it never holds an
all-equal group. It spends less than the budget only when the fresh prompts run out (or by
less than G, the budget's remainder).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from trace_gym.allocation.budget import Budget
from trace_gym.allocation.allocator import Allocator
from trace_gym.allocators import register
from trace_gym.forest.forest import Forest


@register("dapo")
class DAPOAllocator(Allocator):
    """Filter all-equal groups and re-sample fresh prompts within the same budget.

    Attributes:
        kept: after a step, a boolean per tree: True for the groups kept in the training
            batch (exactly the mixed ones).
    """

    name = "dapo"
    default_predictor: ClassVar[str | None] = None
    advantage: ClassVar[str] = "grpo"

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.kept = np.zeros(0, dtype=bool)

    def batch_groups(self, budget: Budget) -> int:
        """B, the number of mixed groups DAPO wants in its training batch."""
        return max(1, budget.root_trajectories // budget.group_size)

    def plan_roots(self, forest: Forest, budget: Budget, predictor: Any | None) -> np.ndarray:
        g = budget.group_size
        n = min(self.batch_groups(budget), budget.trajectories // g, forest.n_trees)
        counts = np.zeros(forest.n_trees, dtype=np.int64)
        counts[self.rng.choice(forest.n_trees, size=n, replace=False)] = g
        return counts

    def plan_prefixes(self, forest: Forest, budget: Budget, remaining: int, predictor: Any | None) -> list[tuple[int, int]]:
        roots = forest.root_nodes.astype(np.int64)
        mixed = int(np.count_nonzero(forest.leaf_min[roots] < forest.leaf_max[roots]))
        fresh = roots[forest.n_leaves[roots] == 0]
        g = budget.group_size
        missing = self.batch_groups(budget) - mixed
        n = min(missing if missing > 0 else remaining // g, remaining // g, fresh.size)
        if n <= 0:
            return []
        return [(int(r), g) for r in self.rng.choice(fresh, size=n, replace=False)]

    def observe(self, forest: Forest) -> None:
        roots = forest.root_nodes.astype(np.int64)
        self.kept = (forest.n_leaves[roots] > 0) & (forest.leaf_min[roots] < forest.leaf_max[roots])
