"""``uniform``: uniform roots and uniform branching, the tree baseline without a predictor.

Stage 1 picks ``M_root // m_min`` prompts uniformly at random (all of them if fewer) and
spreads ``M_root`` evenly over them (at least ``m_min`` each, ``max_per_prompt`` as a cap).
Stage 2 spreads the remaining budget evenly over the branchable prefixes (non-root,
non-terminal nodes), the leftover units going to randomly chosen ones; when there is none
(single-turn episodes, failed trajectories) it re-samples the prompts stage 1 chose. The
two stage functions are also TRACE's ``uniform`` ablation settings.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from trace_gym.allocation.budget import Budget
from trace_gym.allocation.allocator import Allocator
from trace_gym.allocators import register
from trace_gym.forest.forest import Forest


def uniform_roots(n_trees: int, budget: Budget, rng: np.random.Generator) -> np.ndarray:
    """Stage 1, uniform: ``M_root`` spread evenly over random prompts, ``m_min`` or more
    each (nothing when ``M_root < m_min``)."""
    counts = np.zeros(n_trees, dtype=np.int64)
    total, m_min = budget.root_trajectories, budget.min_per_prompt
    k = min(n_trees, total // m_min)
    if k == 0:
        return counts
    chosen = rng.choice(n_trees, size=k, replace=False)
    per = np.full(k, total // k, dtype=np.int64)
    per[: total % k] += 1  # chosen is already in random order
    if budget.max_per_prompt is not None:
        per = np.minimum(per, budget.max_per_prompt)
    counts[chosen] = per
    return counts


def uniform_prefixes(forest: Forest, remaining: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Stage 2, uniform: ``remaining`` continuations spread evenly over the branchable
    prefixes; the leftover units go to random ones. With no branchable prefix (every episode
    ended after one turn, or every trajectory failed) the empty prefix is the only one left:
    the continuations are fresh rollouts of the prompts stage 1 sampled, so that the step
    still spends its budget, as a tree-less allocator would."""
    if remaining <= 0:
        return []
    nodes = forest.branchable()
    if nodes.size == 0:
        nodes = sampled_roots(forest)
    if nodes.size == 0:
        return []
    ks = np.full(nodes.size, remaining // nodes.size, dtype=np.int64)
    ks[rng.choice(nodes.size, size=remaining % nodes.size, replace=False)] += 1
    keep = ks > 0
    return list(zip(nodes[keep].tolist(), ks[keep].tolist()))


def sampled_roots(forest: Forest) -> np.ndarray:
    """Root node ids of the prompts that got at least one trajectory."""
    if forest.n_trajectories == 0:
        return np.zeros(0, dtype=np.int64)
    trees = np.unique(forest.tree[forest.traj_origin])
    return forest.root_nodes[trees].astype(np.int64)


@register("uniform")
class UniformAllocator(Allocator):
    """Uniform roots, then uniform branching (see the module docstring)."""

    name = "uniform"
    default_predictor: ClassVar[str | None] = None
    advantage: ClassVar[str] = "trace"

    def __init__(self, seed: int = 0):
        super().__init__(seed)

    def plan_roots(self, forest: Forest, budget: Budget, predictor: Any | None) -> np.ndarray:
        return uniform_roots(forest.n_trees, budget, self.rng)

    def plan_prefixes(self, forest: Forest, budget: Budget, remaining: int, predictor: Any | None) -> list[tuple[int, int]]:
        return uniform_prefixes(forest, remaining, self.rng)
