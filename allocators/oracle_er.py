"""``oracle-er``: maximises the expected effective ratio with the exact V(H): a ceiling on it.

The effective ratio is the share of sampled prompts whose tree is mixed. With the true
success probability of every prompt and prefix (``forest.oracle``, ContrastLab only):

* **Which prompts.** Sampling fewer prompts raises the ratio for free (one prompt with the
  whole budget is almost surely mixed), so the ceiling is taken at a fixed number of
  prompts: ``prompts`` (default ``budget.trajectories // budget.group_size``, as many as
  GRPO, PCL, DAPO, GRESO and VIP sample). For a fixed number of prompts the ratio is their
  mean probability of ending mixed, so it picks the ``prompts`` candidates with ``V`` nearest
  1/2 (largest ``min(V, 1 - V)``, ties to the lower index) and gives each ``m_min`` bare
  rollouts (the fewest that can mix).
* **Where the rest goes.** A tree whose leaves all have outcome ``r`` becomes mixed as soon
  as one continuation disagrees. A continuation from node ``H`` of the tree (the root
  included) disagrees with probability ``d(H) = 1 - (r V(H) + (1 - r)(1 - V(H)))``, so the
  tree's best branch point is its node of largest ``d``, and ``k`` continuations from it
  leave the tree pure with probability ``(1 - d)^k``. Over the trees still pure, the
  expected number of trees that get mixed, ``sum 1 - (1 - d_j)^k_j``, is maximised by the
  greedy of :func:`~trace_gym.allocation.solvers.solve_prefixes` on each tree's best node.
  The budget is spent in ``rounds`` equal rounds, each re-planned on the outcomes so far
  (a tree that got mixed gets nothing more).
* Budget left once every sampled tree is mixed (or none can be) goes to fresh rollouts of
  the sampled prompts, spread evenly: it cannot change the ratio, and every row of a bench
  spends the same budget.

Greedy and adaptive, not a proof of optimality: the bench checks that no allocator sampling
as many prompts beats it. Its advantage is ``grpo`` (it maximises mixed prompts, not
mixed subtrees).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from trace_gym.allocation.budget import Budget
from trace_gym.allocation.allocator import Allocator
from trace_gym.allocation.solvers import solve_prefixes
from trace_gym.allocators import register
from trace_gym.forest.forest import TERMINAL, Forest


def _exact(forest: Forest, nodes: np.ndarray) -> np.ndarray:
    v = forest.oracle[nodes]
    if np.isnan(v).any():
        raise ValueError("the oracle-er allocator needs the true success probability of every node (forest.oracle); "
                         "only the ContrastLab simulator provides it")
    return np.clip(v.astype(np.float64), 0.0, 1.0)


@register("oracle-er")
class OracleERAllocator(Allocator):
    """The effective-ratio ceiling with true values (see the module docstring).

    Args:
        prompts: prompts to sample (None: ``budget.trajectories // budget.group_size``).
        rounds: re-planning rounds of the continuation budget.
    """

    name = "oracle-er"
    default_predictor: ClassVar[str | None] = None
    advantage: ClassVar[str] = "grpo"
    reads_oracle: ClassVar[bool] = True

    def __init__(self, prompts: int | None = None, rounds: int = 8):
        super().__init__()
        if prompts is not None and prompts < 1:
            raise ValueError(f"prompts must be at least 1 (or None), got {prompts}")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.prompts, self.rounds = prompts, int(rounds)
        self._round = 0
        self._chosen = np.zeros(0, dtype=np.int64)

    def plan_roots(self, forest: Forest, budget: Budget, predictor: Any | None) -> np.ndarray:
        self._round = 0
        roots = forest.root_nodes.astype(np.int64)
        v = _exact(forest, roots)
        forest.pred[roots] = v
        k = self.prompts if self.prompts is not None else budget.trajectories // budget.group_size
        m = budget.min_per_prompt
        k = max(0, min(k, forest.n_trees, budget.trajectories // m))
        order = np.lexsort((np.arange(v.size), -np.minimum(v, 1.0 - v)))
        self._chosen = np.sort(order[:k])
        counts = np.zeros(forest.n_trees, dtype=np.int64)
        counts[self._chosen] = m
        return counts

    def plan_prefixes(self, forest: Forest, budget: Budget, remaining: int, predictor: Any | None) -> list[tuple[int, int]]:
        roots = forest.root_nodes.astype(np.int64)[self._chosen]
        if roots.size == 0 or remaining <= 0:
            return []
        rounds_left = max(1, self.rounds - self._round)
        self._round += 1
        share = -(-remaining // rounds_left)
        pure_tree = (forest.n_leaves[roots] > 0) & (forest.leaf_min[roots] == forest.leaf_max[roots])
        plan: list[tuple[int, int]] = []
        if pure_tree.any():
            tree_ids = forest.tree[roots[pure_tree]]
            cand = np.flatnonzero(((forest.flags & TERMINAL) == 0) & np.isin(forest.tree, tree_ids))
            v = _exact(forest, cand)
            r = forest.leaf_min[forest.root_nodes[forest.tree[cand]]]
            d = 1.0 - (r * v + (1.0 - r) * (1.0 - v))
            # the best branch point of each pure tree: its node of largest d (ties: the lower id)
            order = np.lexsort((cand, -d, forest.tree[cand]))
            first = np.r_[True, forest.tree[cand][order][1:] != forest.tree[cand][order][:-1]]
            best = order[first]
            useful = d[best] > 0
            best = best[useful]
            if best.size:
                ks = solve_prefixes(v[best], r[best], share)
                plan = [(int(n), int(k)) for n, k in zip(cand[best], ks) if k > 0]
        if not plan:  # nothing left that can mix: spread the rest evenly over the sampled prompts
            per = np.full(roots.size, remaining // roots.size, dtype=np.int64)
            per[: remaining % roots.size] += 1
            plan = [(int(n), int(k)) for n, k in zip(roots, per) if k > 0]
        return plan
