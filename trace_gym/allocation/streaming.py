"""Streaming allocation: a prompt's stage 2 starts as soon as its own stage-1 rollouts are done.

:func:`~trace_gym.allocation.allocator.allocate_step` waits for every stage-1 rollout before
stage 2 plans anything, so the step waits for its slowest trajectory twice. With a source
that can roll out trajectories in the background (a :class:`RolloutStream`),
:func:`allocate_step_streaming` runs:

1. **stage 1** as usual: ``plan_roots`` on every candidate, all trajectories started at once;
2. **per prompt**: when the last stage-1 rollout of a prompt finishes, the allocator plans that
   prompt alone (``plan_prefixes`` on :meth:`~trace_gym.forest.forest.Forest.select` of its
   tree) with its *share* of the stage-2 budget: ``share x (M - stage-1 spend)`` split in
   proportion to the prompt's stage-1 rollouts (floored, so the shares never sum past the
   budget); the branches start at once, beside the other prompts' rollouts still running;
3. **the rest, globally**: once nothing is in flight, what the per-prompt plans left unspent
   goes through the usual stage-2 rounds over the whole forest.

Spend is checked against the step's budget as in the synchronous driver (a plan over its
share raises :class:`~trace_gym.allocation.budget.BudgetExceeded`). The allocator decides per
prompt from that prompt's tree only, so the forests differ from the synchronous driver's;
``share=0`` plans nothing per prompt (stage 2 entirely global, still overlapping nothing).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from trace_gym.allocation.allocator import Allocator, check_plan, finish_step, plan_stage1, run_stage2_rounds
from trace_gym.allocation.budget import Budget, Spend
from trace_gym.forest.forest import Forest

__all__ = ["RolloutStream", "allocate_step_streaming"]


class RolloutStream(Protocol):
    """Trajectories rolling out in the background on one forest."""

    def start(self, origins: np.ndarray) -> np.ndarray:
        """Start one trajectory at each node of ``origins``; returns their trajectory ids."""

    def wait(self) -> list[int]:
        """Block until at least one trajectory ended (finished or failed); return the ids of
        those that ended since the last call. ``[]`` when nothing is in flight."""


def allocate_step_streaming(forest: Forest, allocator: Allocator, budget: Budget, predictor: Any | None,
                            stream: RolloutStream, *, share: float = 1.0, max_rounds: int = 64) -> Spend:
    """Stage 1, stage 2 per prompt as its stage 1 ends, then global stage-2 rounds (see the
    module docstring). ``forest`` must hold candidate roots only; returns what was spent."""
    if forest.n_trajectories:
        raise ValueError("allocate_step_streaming expects a forest that holds candidate roots only")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    allocator.spent = spend = Spend()
    counts = plan_stage1(forest, allocator, budget, predictor)
    total1 = int(counts.sum())
    spend.roots += total1
    stage2 = budget.trajectories - total1
    shares = np.floor(share * stage2 * counts / max(total1, 1)).astype(np.int64)
    outstanding = counts.copy()
    if total1:  # stage 1 is trajectories 0 .. total1 - 1: the forest held none before
        stream.start(np.repeat(forest.root_nodes.astype(np.int64), counts))
    while True:
        ended = stream.wait()
        if not ended:
            break
        for tr in ended:
            if tr >= total1:
                continue  # a trajectory of a per-prompt plan
            t = int(forest.tree[forest.traj_origin[tr]])
            outstanding[t] -= 1
            if outstanding[t] == 0 and shares[t] > 0:
                _plan_one(forest, allocator, budget, predictor, stream, int(t), int(shares[t]), spend)
    forest.backup()
    run_stage2_rounds(forest, allocator, budget, predictor, lambda f, o: _run(stream, o), spend, max_rounds)
    return finish_step(forest, allocator, spend)


def _plan_one(forest: Forest, allocator: Allocator, budget: Budget, predictor: Any | None, stream: RolloutStream,
              tree: int, limit: int, spend: Spend) -> None:
    """Plan stage 2 for ``tree`` alone (at most ``limit`` trajectories) and start it."""
    sub, nodes = forest.select([tree])
    plan = allocator.plan_prefixes(sub, budget, limit, predictor)
    seen = np.isfinite(sub.pred)
    forest.pred[nodes[seen]] = sub.pred[seen]  # the allocator's predictions, for the step's calibration
    if not plan:
        return
    local, ks = check_plan(sub, allocator, plan, limit, "stage 2 (per prompt)", spend)
    stream.start(np.repeat(nodes[local], ks))


def _run(stream: RolloutStream, origins: np.ndarray) -> None:
    """Start ``origins`` and wait for everything in flight to end (a synchronous rollout)."""
    stream.start(origins)
    while stream.wait():
        pass
