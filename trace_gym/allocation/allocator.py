"""The budget-allocation API: the ``Allocator`` base class and registry, and the driver
that runs an allocator's two stages against any way of producing rollouts.

An allocator sees only the forest and a predictor:

* ``plan_roots(forest, budget, predictor) -> counts`` (stage 1): the forest holds one root
  per candidate prompt and nothing else; return how many bare rollouts each root gets.
* ``plan_prefixes(forest, budget, remaining, predictor) -> [(node, k), ...]`` (stage 2):
  the forest now holds the finished rollouts (backed up); return branch points and how
  many continuations each gets. A root node is allowed (k fresh rollouts of that prompt,
  which is how re-sampling allocators such as DAPO spend their budget). The driver calls
  it again while budget remains and the plan is non-empty.

:func:`allocate_step` runs both stages, checks that no plan overspends, and backs the
forest up at the end. The rollout engine (real models) and the simulator bench call the
same function, so an allocator behaves identically in both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from trace_gym.allocation.budget import Budget, BudgetExceeded, Spend
from trace_gym.forest.forest import TERMINAL, Forest
from trace_gym.registry import ALLOCATOR_GROUP, Registry


class Allocator(ABC):
    """Decides where a step's rollout budget goes. See the module docstring."""

    name: ClassVar[str] = "allocator"
    default_predictor: ClassVar[str | None] = None
    """Predictor the bench, leaderboard and trainer build for this allocator (None: it needs none)."""
    advantage: ClassVar[str] = "grpo"
    """Advantage estimator that matches what the allocator optimises (``"trace"`` for tree allocators)."""

    def __init__(self, seed: int | None = None) -> None:
        self.spent = Spend()
        self.rng: np.random.Generator | None = np.random.default_rng(seed) if seed is not None else None
        """The allocator's random stream (allocators that draw pass ``seed``); checkpointed by :meth:`state_dict`."""

    @abstractmethod
    def plan_roots(self, forest: Forest, budget: Budget, predictor: Any | None) -> np.ndarray:
        """Stage 1: rollouts per tree (an int array of length ``forest.n_trees``)."""

    def plan_prefixes(self, forest: Forest, budget: Budget, remaining: int, predictor: Any | None) -> list[tuple[int, int]]:
        """Stage 2: ``(node, k)`` pairs spending at most ``remaining`` trajectories. Default: none."""
        return []

    def observe(self, forest: Forest) -> None:
        """Called with the finished, backed-up forest at the end of a step (for allocators with memory)."""

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint: the random stream, if any (allocators with memory extend this)."""
        return {"rng": self.rng.bit_generator.state} if self.rng is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if self.rng is not None and "rng" in state:
            self.rng.bit_generator.state = state["rng"]


ALLOCATORS: Registry[Allocator] = Registry("allocator", group=ALLOCATOR_GROUP)
"""Name -> allocator factory; also the entry-point group ``trace_gym.allocators``."""


def register_allocator(name: str, factory: Callable[..., Allocator] | None = None, *, overwrite: bool = False):
    """Register an allocator under ``name`` (a decorator when ``factory`` is omitted).

    ``factory(**kwargs)`` (usually the :class:`Allocator` subclass itself) builds it; its
    keyword arguments are the allocator's options (``"name:key=value"`` in a spec), and it
    may take ``seed``. A taken name raises ``ValueError`` unless ``overwrite=True``.
    Installed packages can instead declare ``name = "pkg.module:Class"`` in the entry-point
    group ``trace_gym.allocators``; the bench, suites and the trainer then find it by name.
    """
    return ALLOCATORS.register(name, factory, overwrite=overwrite)


def make_allocator(name: str, **kwargs: Any) -> Allocator:
    """Build the allocator registered as ``name`` (built-in, decorated or from an entry point)
    with ``kwargs`` (``make_allocator("trace", stage1="uniform")``). An unknown name raises
    :class:`~trace_gym.registry.UnknownNameError` listing close names; a plug-in that fails
    to import raises :class:`~trace_gym.registry.PluginError` naming its entry point."""
    return ALLOCATORS.make(name, **kwargs)


RolloutFn = Callable[[Forest, np.ndarray], None]
"""``rollout(forest, origins)``: start one trajectory at each node id in ``origins`` (with
``forest.start_trajectory``) and run all of them to their end, appending their nodes."""


def _check(plan_total: int, limit: int, allocator: Allocator, stage: str) -> None:
    if plan_total > limit:
        raise BudgetExceeded(f"allocator {allocator.name!r} planned {plan_total} trajectories in {stage}, but only {limit} remain")


def allocate_step(
    forest: Forest,
    allocator: Allocator,
    budget: Budget,
    predictor: Any | None,
    rollout: RolloutFn,
    *,
    max_rounds: int = 64,
) -> Spend:
    """Run stage 1 and then stage 2 (repeatedly, while budget remains) on ``forest``.

    ``forest`` must hold the candidate roots only. Raises :class:`BudgetExceeded` if a plan
    asks for more than the budget; returns what was spent (also in ``allocator.spent``).
    """
    if forest.n_trajectories:
        raise ValueError("allocate_step expects a forest that holds candidate roots only")
    allocator.spent = spend = Spend()
    counts = plan_stage1(forest, allocator, budget, predictor)
    origins = np.repeat(forest.root_nodes.astype(np.int64), counts)
    if origins.size:
        rollout(forest, origins)
    spend.roots += int(counts.sum())
    forest.backup()
    run_stage2_rounds(forest, allocator, budget, predictor, rollout, spend, max_rounds)
    return finish_step(forest, allocator, spend)


def finish_step(forest: Forest, allocator: Allocator, spend: Spend) -> Spend:
    """The end of a step's allocation: back up, count what was spent (trajectories, prompts
    that got a rollout), let the allocator observe the forest; returns ``spend``."""
    forest.backup()
    spend.trajectories = forest.n_trajectories
    spend.prompts = int(np.count_nonzero(forest.n_leaves[forest.root_nodes] > 0)) if forest.n_trees else 0
    allocator.observe(forest)
    return spend


def run_stage2_rounds(forest: Forest, allocator: Allocator, budget: Budget, predictor: Any | None, rollout: RolloutFn,
                      spend: Spend, max_rounds: int = 64) -> None:
    """Stage 2: ask ``allocator.plan_prefixes`` for branch points while budget remains and the
    plan is non-empty, checking each plan, rolling it out and backing up; adds to ``spend``."""
    for _ in range(max_rounds):
        remaining = budget.trajectories - forest.n_trajectories
        if remaining <= 0:
            break
        plan = allocator.plan_prefixes(forest, budget, remaining, predictor)
        if not plan:
            break
        nodes, ks = check_plan(forest, allocator, plan, remaining, "stage 2", spend)
        rollout(forest, np.repeat(nodes, ks))
        forest.backup()


def plan_stage1(forest: Forest, allocator: Allocator, budget: Budget, predictor: Any | None) -> np.ndarray:
    """``allocator.plan_roots``, checked: one non-negative count per tree, within the budget."""
    counts = np.asarray(allocator.plan_roots(forest, budget, predictor), dtype=np.int64)
    if counts.shape != (forest.n_trees,):
        raise ValueError(f"allocator {allocator.name!r}: plan_roots returned shape {counts.shape}, expected ({forest.n_trees},)")
    if counts.size and counts.min() < 0:
        raise ValueError(f"allocator {allocator.name!r}: negative rollout counts")
    _check(int(counts.sum()), budget.trajectories, allocator, "stage 1")
    return counts


def check_plan(forest: Forest, allocator: Allocator, plan: Sequence[tuple[int, int]], limit: int, stage: str,
               spend: Spend) -> tuple[np.ndarray, np.ndarray]:
    """A stage-2 plan as ``(nodes, ks)`` arrays, checked (counts >= 0, nodes in ``forest`` and
    not terminal, at most ``limit`` trajectories) and added to ``spend``."""
    nodes = np.fromiter((int(n) for n, _ in plan), dtype=np.int64, count=len(plan))
    ks = np.fromiter((int(k) for _, k in plan), dtype=np.int64, count=len(plan))
    if ks.min() < 0:
        raise ValueError(f"allocator {allocator.name!r}: negative branch counts")
    if nodes.min() < 0 or nodes.max() >= len(forest):
        raise ValueError(f"allocator {allocator.name!r}: branch point outside the forest")
    if np.any(forest.flags[nodes] & TERMINAL):
        raise ValueError(f"allocator {allocator.name!r}: cannot branch from a terminal node")
    _check(int(ks.sum()), limit, allocator, stage)
    is_root = forest.parent[nodes] < 0
    spend.roots += int(ks[is_root].sum())
    spend.branches += int(ks[~is_root].sum())
    return nodes, ks


def add_candidates(forest: Forest, histories: Sequence[Any]) -> np.ndarray:
    """Add one root per candidate (objects with ``task_id``, ``prompt`` and optional
    ``oracle``/``max_turns``, e.g. :class:`~trace_gym.forest.forest.History`); returns root ids."""
    return np.array(
        [forest.add_root(h.task_id, h.prompt, max_turns=getattr(h, "max_turns", 0), oracle=getattr(h, "oracle", float("nan"))) for h in histories],
        dtype=np.int64,
    )
