"""One-step-off async: the generation of step t+1 overlaps the policy update of step t.

:class:`AsyncStep` wraps a :class:`~trace_gym.step.Step` and its policy update. ``run(t)``
takes step t's forest (generated in the background while update t-1 ran, or now for the
first step), calls ``sync()`` to hand the trainer's current weights to the generator, starts
the generation (candidates, allocation, rollouts, advantages, predictor update: everything
of :meth:`Step.run` but the update) of step t+1 in a background thread, and then runs the
update of step t in the calling thread. So:

* **Staleness bound 1.** Step t+1 is generated with the weights after update t-1 while
  update t runs; the update of step t+1 then trains on data one version behind the trainer
  (``async/staleness`` = 1; 0 for the first step). No step runs further ahead: generation of
  t+2 waits for ``run(t+1)``.
* **Importance-sampling correction.** Every policy token keeps its behaviour log-prob
  (:class:`~trace_gym.rollout.engine.TurnRecord.logprobs`); the update must weight the loss
  by the truncated ratio against them (the trainer's ``loss.is_correction``), as it already
  must for any engine that is not the trained module itself.
* **Off-policy share logged.** ``async/off_policy_share`` is the share of the step's
  generated tokens that came from weights older than the ones the update starts from.

Contract on the update and the generator: ``update`` may change only the trainer's own
weights; the generator sees new weights only through ``sync`` (called between generations,
never during one). A policy that reads the trainer's module in place (``hf`` sharing the
module) does not satisfy this: give it a copy that ``sync`` refreshes, or stay synchronous.
The predictor is updated inside each step's generation, in step order, as in sync mode.

In sync mode (``Step`` alone) nothing here runs; for the same seed the forests of an
:class:`AsyncStep` equal the sync ones when the update does not change the policy (e.g. a
simulated update), since step t+1's candidates and sampling seeds depend on (seed, t+1) only.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from trace_gym.step import PolicyUpdate, Step, StepResult

__all__ = ["AsyncStep"]


class AsyncStep:
    """One-step-off async around ``step`` (whose own ``update`` must be None) and ``update``.

    Args:
        step: the :class:`~trace_gym.step.Step` that generates (``step.update`` is None).
        update: the policy update, run on each step's forest and advantages.
        sync: called before each generation starts (after the first): hands the weights the
            trainer has at that moment to the generator. None when nothing needs handing over.
    """

    def __init__(self, step: Step, update: PolicyUpdate, *, sync: Callable[[], None] | None = None):
        if step.update is not None:
            raise ValueError("AsyncStep runs the update itself: build the Step without update=")
        self.step = step
        self.update = update
        self.sync = sync
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trace-gym-generate")
        self._next: tuple[int, Future[StepResult], int] | None = None  # (step, future, version it generates with)
        self.version = 0  # updates applied so far

    def _generate(self, t: int) -> tuple[Future[StepResult], int]:
        if self.sync is not None and self.version > 0:
            self.sync()
        return self._pool.submit(self.step.run, t), self.version

    def run(self, t: int) -> StepResult:
        """Step ``t``: its forest (waiting for its generation if needed), then its update, with
        the generation of ``t + 1`` running meanwhile. Steps must be run in order."""
        t0 = time.perf_counter()
        if self._next is not None and self._next[0] == t:
            _, fut, gen_version = self._next
        else:  # the first step, or out of order: generate now
            self._drain()
            fut, gen_version = self._generate(t)
        result = fut.result()
        waited = time.perf_counter() - t0
        self._next = (t + 1, *self._generate(t + 1))
        t1 = time.perf_counter()
        metrics: dict[str, Any] = dict(self.update(result.forest, result.advantages) or {})
        t_upd = time.perf_counter() - t1
        staleness = self.version - gen_version
        self.version += 1
        result.metrics.update(metrics)
        gen_tokens = float(result.metrics.get("spent/generated_tokens", 0) or 0)
        result.metrics.update({
            "async/staleness": staleness,
            "async/off_policy_share": 1.0 if staleness > 0 and gen_tokens > 0 else 0.0,
            "time/generation_wait": waited,
            "time/update": t_upd,
            "time/step": time.perf_counter() - t0,
        })
        return result

    def _drain(self) -> None:
        if self._next is not None:
            try:
                self._next[1].result()
            except Exception:
                pass
            self._next = None

    def close(self) -> None:
        """Wait for a generation in flight and stop the background thread."""
        self._drain()
        self._pool.shutdown(wait=True)
