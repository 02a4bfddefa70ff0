"""``trace``: TRACE's two-stage active allocation (PAPER.md sec. 3).

Stage 1 (``stage1="active"``): the predictor scores every candidate prompt, and
:func:`~trace_gym.solvers.solve_roots` picks rollouts per prompt maximising the expected
number of mixed groups, ``sum 1 - v^m - (1-v)^m`` with ``m`` in ``{0} u [m_min, m_max]``,
within ``M_root = root_fraction * M``.

Stage 2 (``stage2="active"``): every prefix whose subtree is still pure (all leaves below
it share the outcome ``r``), from the roots that got rollouts down to the last non-terminal
turn, is a candidate. The predictor scores each, and
:func:`~trace_gym.solvers.solve_prefixes` spreads the remaining budget to maximise
``sum 1 - (r V + (1-r)(1 - V))^k``, the expected number of prefixes whose subtree becomes
mixed. A prefix whose subtree is already mixed has nothing left to gain there and is not
a candidate; if no pure prefix is left at all, the budget goes out uniformly.

Two options go beyond the paper's single pass (both off by default): ``rounds=R`` spends
the stage-2 budget in R equal rounds, re-planning with the outcomes seen so far;
``scope="tree"`` keeps only prefixes of trees that are still pure at the root, i.e.
maximises mixed *prompts* (the effective ratio) instead of mixed *subtrees* (the contrast
the tree-aware advantage uses).

Either stage set to ``"uniform"`` uses the :mod:`uniform <trace_gym.allocators.uniform>`
allocator's rule instead: that is the ablation grid. Predictions are written to
``forest.pred`` so that their calibration can be measured later.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from trace_gym.allocator import Allocator, Budget
from trace_gym.allocators import register
from trace_gym.allocators.uniform import uniform_prefixes, uniform_roots
from trace_gym.forest import TERMINAL, Forest
from trace_gym.solvers import solve_prefixes, solve_roots

STAGES = ("uniform", "active")


@register("trace")
class TraceAllocator(Allocator):
    """TRACE (see the module docstring).

    Args:
        stage1, stage2: ``"active"`` (predictor + greedy solver) or ``"uniform"``.
        k_max: most continuations from one prefix in stage 2 (0: no cap).
        rounds: stage 2 spends its budget in this many equal rounds, re-planning after each
            with the outcomes seen so far (1: the paper's single greedy pass).
        scope: ``"subtree"`` (the paper: every pure prefix is a candidate) or ``"tree"``
            (only prefixes of trees not yet mixed).
        seed: seeds the uniform stages.
    """

    name = "trace"
    default_predictor: ClassVar[str | None] = "hashed"
    advantage: ClassVar[str] = "trace"

    def __init__(self, stage1: str = "active", stage2: str = "active", k_max: int = 0, rounds: int = 1,
                 scope: str = "subtree", seed: int = 0):
        super().__init__()
        for label, stage in (("stage1", stage1), ("stage2", stage2)):
            if stage not in STAGES:
                raise ValueError(f"{label} must be one of {STAGES}, got {stage!r}")
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        if scope not in ("subtree", "tree"):
            raise ValueError(f"scope must be 'subtree' or 'tree', got {scope!r}")
        self.stage1, self.stage2, self.scope = stage1, stage2, scope
        self.k_max, self.rounds = int(k_max), int(rounds)
        self._round = 0  # stage-2 rounds played in the current step
        self.rng = np.random.default_rng(seed)

    def values(self, forest: Forest, nodes: np.ndarray, predictor: Any | None) -> np.ndarray:
        """V(H) of ``nodes`` as the allocator sees it (here: the predictor's), also stored in
        ``forest.pred``."""
        if predictor is None:
            raise ValueError(f"allocator {self.name!r} with an active stage needs a predictor (e.g. make_predictor('hashed'))")
        v = np.clip(np.asarray(predictor.predict(forest.histories(nodes)), dtype=np.float64), 0.0, 1.0)
        forest.pred[nodes] = v
        return v

    def plan_roots(self, forest: Forest, budget: Budget, predictor: Any | None) -> np.ndarray:
        self._round = 0
        if self.stage1 == "uniform":
            return uniform_roots(forest.n_trees, budget, self.rng)
        v = self.values(forest, forest.root_nodes.astype(np.int64), predictor)
        return solve_roots(v, budget.root_trajectories, budget.min_per_prompt, budget.max_per_prompt or 0)

    def plan_prefixes(self, forest: Forest, budget: Budget, remaining: int, predictor: Any | None) -> list[tuple[int, int]]:
        if self.stage2 == "uniform":
            return uniform_prefixes(forest, remaining, self.rng)
        rounds_left = max(1, self.rounds - self._round)
        self._round += 1
        remaining = -(-remaining // rounds_left)  # this round's equal share, rounded up
        pure = ((forest.flags & TERMINAL) == 0) & (forest.n_leaves > 0) & (forest.leaf_min == forest.leaf_max)
        if self.scope == "tree":
            roots = forest.root_nodes[forest.tree]
            pure &= forest.leaf_min[roots] == forest.leaf_max[roots]
        nodes = np.flatnonzero(pure)
        if nodes.size == 0:
            return uniform_prefixes(forest, remaining, self.rng)
        v = self.values(forest, nodes, predictor)
        ks = solve_prefixes(v, forest.leaf_min[nodes], remaining, self.k_max)
        keep = ks > 0
        return list(zip(nodes[keep].tolist(), ks[keep].tolist()))

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
