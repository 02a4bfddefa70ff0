"""``vip``: VIP-style allocation, rollouts per prompt that minimise the summed gradient variance.

Nguyen et al., "Adaptive Rollout Allocation for Online Reinforcement Learning with
Verifiable Rewards" (VIP, arXiv:2602.01601, ICLR 2026). For a prompt of success probability
``p`` given ``n`` rollouts, the variance of its group-relative (RLOO) policy-gradient estimate
is ``4 sigma^2 p (1 - p) / (n - 1)`` (their analysis; Dr. GRPO's has the same ``p (1 - p)``
factor). VIP predicts ``p_i`` for the prompts of the training batch and chooses

    minimise  sum_i  p_i (1 - p_i) / (n_i - 1)
    s.t.      sum_i n_i = M,   n_min <= n_i <= n_max,

a separable convex problem: starting from ``n_min`` each, giving the next rollout to the
prompt with the largest variance reduction ``a_i / ((n_i - 1) n_i)`` (``a_i = p_i (1 - p_i)``)
is optimal for integer counts. ``n_min = max(2, budget.min_per_prompt)``, ``n_max`` is
``budget.max_per_prompt`` (none by default); ``a_i`` is floored at 1e-6 so that ties are
broken by the lower index, not by rounding.

"-style": VIP predicts ``p`` with a Gaussian process over prompt embeddings fitted to
recent rollouts; here the run's predictor does (default ``hashed``: a shared model over
the prompt's words plus each prompt's own outcome counts). The training batch is GRPO's:
``M // G`` candidates drawn at random (seeded), so VIP changes how many rollouts each prompt
gets, not which prompts are trained on. No branching; advantage ``grpo``.
"""

from __future__ import annotations

import heapq
from typing import Any, ClassVar

import numpy as np

from trace_gym.allocation.budget import Budget
from trace_gym.allocation.allocator import Allocator
from trace_gym.allocators import register
from trace_gym.forest.forest import Forest
from trace_gym.predictors.base import predict_nodes


def vip_counts(p: np.ndarray, budget: int, n_min: int = 2, n_max: int = 0) -> np.ndarray:
    """Integer counts ``n_i`` in ``[n_min, n_max]`` (``n_max <= 0``: no cap) summing to
    ``min(budget, len(p) * n_max)`` that minimise ``sum p_i (1 - p_i) / (n_i - 1)``; raises
    if ``budget < len(p) * n_min``."""
    p = np.clip(np.asarray(p, dtype=np.float64), 0.0, 1.0)
    if n_min < 2:
        raise ValueError(f"n_min must be at least 2 (one rollout has no group-relative gradient), got {n_min}")
    if budget < p.size * n_min:
        raise ValueError(f"budget {budget} cannot give {p.size} prompts {n_min} rollouts each")
    a = np.maximum(p * (1.0 - p), 1e-6)
    n = np.full(p.size, n_min, dtype=np.int64)
    cap = n_max if n_max > 0 else budget
    heap = [(-a[i] / ((n_min - 1) * n_min), i) for i in range(p.size) if n_min < cap]
    heapq.heapify(heap)
    left = budget - p.size * n_min
    while left > 0 and heap:
        _, i = heapq.heappop(heap)
        n[i] += 1
        left -= 1
        if n[i] < cap:
            heapq.heappush(heap, (-a[i] / ((n[i] - 1) * n[i]), i))
    return n


@register("vip")
class VIPAllocator(Allocator):
    """VIP-style variance-minimising counts on GRPO's random batch (see the module docstring)."""

    name = "vip"
    default_predictor: ClassVar[str | None] = "hashed"
    advantage: ClassVar[str] = "grpo"

    def __init__(self, seed: int = 0):
        super().__init__(seed)

    def plan_roots(self, forest: Forest, budget: Budget, predictor: Any | None) -> np.ndarray:
        if predictor is None:
            raise ValueError("allocator 'vip' needs a predictor of each prompt's success probability (e.g. 'hashed')")
        n_min = max(2, budget.min_per_prompt)
        k = min(budget.trajectories // budget.group_size, forest.n_trees, budget.trajectories // n_min)
        batch = np.sort(self.rng.choice(forest.n_trees, size=k, replace=False))
        roots = forest.root_nodes.astype(np.int64)[batch]
        p = predict_nodes(forest, roots, predictor)
        counts = np.zeros(forest.n_trees, dtype=np.int64)
        if k:
            counts[batch] = vip_counts(p, budget.trajectories, n_min, budget.max_per_prompt or 0)
        return counts
