"""``greso``: GRESO's selective rollouts (pre-rollout filtering by reward dynamics).

Zheng et al., "Act Only When It Pays: Efficient Reinforcement Learning for LLM Reasoning via
Selective Rollouts" (GRESO, arXiv:2506.02177, 2025). A prompt whose rollout groups were
*zero-variance* (all correct or all wrong) in its last ``z_i`` consecutive samplings is skipped
before rollout with probability

    p_skip(i) = 1 - p_e ** z_i,        p_e = p_easy if its last group was all correct, else p_hard

(``z_i = 0``: never skipped; a mixed group resets ``z_i`` to 0). The exploration
probabilities adapt after every step: with ``alpha`` the target share of zero-variance groups
(``alpha / 3`` all-correct and ``2 alpha / 3`` all-wrong: this split, the defaults
``p_easy = p_hard = 0.5``, ``alpha = 0.25`` and ``delta_p = 0.01`` follow the authors' training
scripts and a public re-implementation, not the paper's own code), each ``p`` moves by
``delta_p`` down when its kind of
zero-variance group exceeded its target share of the step's groups (skip more) and up
otherwise, within ``[delta_p, 1]``.

Within trace-gym's fixed budget: the candidates are visited in a random (seeded) order and
the first ``M // G`` that survive the filter get ``G`` rollouts each (GRPO's groups). GRESO
draws further prompts from the dataset when too few survive; here the candidate pool is
the step's, so the remaining groups go to the filtered prompts in the same random order,
and every row of a bench spends the same budget. Memory is per prompt (``History.task_id``).
No predictor; advantage ``grpo``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from trace_gym.allocation.budget import Budget
from trace_gym.allocation.allocator import Allocator
from trace_gym.allocators import register
from trace_gym.forest.forest import Forest


@register("greso")
class GRESOAllocator(Allocator):
    """GRESO (see the module docstring).

    Args:
        p_easy, p_hard: initial exploration probabilities of prompts last seen all correct /
            all wrong.
        target_zero_variance: ``alpha``, the target share of zero-variance groups.
        delta_p: the step of the adaptation.
        seed: seeds the visiting order and the skips.

    Attributes:
        streak: per prompt, consecutive zero-variance samplings ``z_i``; ``hard``: whether
            its last zero-variance group was all wrong.
    """

    name = "greso"
    default_predictor: ClassVar[str | None] = None
    advantage: ClassVar[str] = "grpo"

    def __init__(self, p_easy: float = 0.5, p_hard: float = 0.5, target_zero_variance: float = 0.25,
                 delta_p: float = 0.01, seed: int = 0):
        super().__init__(seed)
        for label, x in (("p_easy", p_easy), ("p_hard", p_hard), ("target_zero_variance", target_zero_variance)):
            if not 0.0 <= x <= 1.0:
                raise ValueError(f"{label} must be in [0, 1], got {x}")
        if not 0.0 < delta_p <= 1.0:
            raise ValueError(f"delta_p must be in (0, 1], got {delta_p}")
        self.p_easy, self.p_hard = float(p_easy), float(p_hard)
        self.alpha_easy, self.alpha_hard = target_zero_variance / 3.0, 2.0 * target_zero_variance / 3.0
        self.delta_p = float(delta_p)
        self.streak: dict[str, int] = {}
        self.hard: dict[str, bool] = {}
        self.skipped = 0

    def skip_probability(self, task_ids: list[str]) -> np.ndarray:
        """``1 - p_e ** z_i`` for each prompt."""
        z = np.array([self.streak.get(t, 0) for t in task_ids], dtype=np.float64)
        pe = np.array([self.p_hard if self.hard.get(t, False) else self.p_easy for t in task_ids])
        return np.where(z > 0, 1.0 - pe**z, 0.0)

    def plan_roots(self, forest: Forest, budget: Budget, predictor: Any | None) -> np.ndarray:
        g = budget.group_size
        n = min(budget.trajectories // g, forest.n_trees)
        order = self.rng.permutation(forest.n_trees)
        p_skip = self.skip_probability([forest.task_ids[i] for i in order])
        skip = self.rng.random(order.size) < p_skip
        chosen = np.concatenate([order[~skip], order[skip]])[:n]  # survivors first, then the filtered ones
        self.skipped = int(np.count_nonzero(skip))
        counts = np.zeros(forest.n_trees, dtype=np.int64)
        counts[chosen] = g
        return counts

    def observe(self, forest: Forest) -> None:
        roots = forest.root_nodes.astype(np.int64)
        sampled = forest.n_leaves[roots] > 0
        if not sampled.any():
            return
        lo, hi = forest.leaf_min[roots], forest.leaf_max[roots]
        easy = hard = 0
        for i in np.flatnonzero(sampled):
            t = forest.task_ids[i]
            if lo[i] < hi[i]:
                self.streak[t] = 0
            else:
                self.streak[t] = self.streak.get(t, 0) + 1
                self.hard[t] = bool(hi[i] <= 0.0)
                hard += self.hard[t]
                easy += not self.hard[t]
        n = float(np.count_nonzero(sampled))
        step = self.delta_p
        self.p_easy = float(np.clip(self.p_easy + (-step if easy / n > self.alpha_easy else step), step, 1.0))
        self.p_hard = float(np.clip(self.p_hard + (-step if hard / n > self.alpha_hard else step), step, 1.0))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "streak": dict(self.streak), "hard": dict(self.hard),
                "p_easy": self.p_easy, "p_hard": self.p_hard}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.streak = {k: int(v) for k, v in state["streak"].items()}
        self.hard = {k: bool(v) for k, v in state["hard"].items()}
        self.p_easy, self.p_hard = float(state["p_easy"]), float(state["p_hard"])
