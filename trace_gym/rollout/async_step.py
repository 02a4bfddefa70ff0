"""Async steps: the generation of the next steps overlaps the policy update of this one.

:class:`AsyncStep` wraps a :class:`~trace_gym.step.Step` and its policy update. ``run(t)``
takes step t's forest (generated in the background while earlier updates ran, or now for the
first step), queues the generation (candidates, allocation, rollouts, advantages, predictor
update: everything of :meth:`Step.run` but the update) of steps up to t + ``max_staleness``
on a background thread, and then runs the update of step t in the calling thread. Each
generation starts by calling ``sync()``, which hands the trainer's current weights to the
generator, under a lock that every update holds, so a generation never sees half an update.
So:

* **Staleness bound.** A step's generation starts with the weights after at least
  ``t - max_staleness`` updates: with the default 1, step t+1 is generated with the weights
  after update t-1 while update t runs, and trains on data one version behind the trainer
  (``async/staleness`` = 1; 0 for the first step). No step runs further ahead.
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

Checkpoints: ``before_next(result)`` is called when step t's forest is taken and before any
generation of a later step starts, which is the moment a trainer snapshots the state a
resumed run continues from (the predictor and allocator are updated by generations). A
resumed run regenerates its first step with the weights it resumed with (staleness 0 there).

In sync mode (``Step`` alone) nothing here runs; for the same seed the forests of an
:class:`AsyncStep` equal the sync ones when the update does not change the policy (e.g. a
simulated update), since step t+1's candidates and sampling seeds depend on (seed, t+1) only.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from trace_gym.step import PolicyUpdate, Step, StepResult

__all__ = ["AsyncStep"]


@dataclass
class _Generation:
    step: int
    future: Future
    started: threading.Event = field(default_factory=threading.Event)
    version: int = -1  # updates applied when it started


class AsyncStep:
    """Async steps around ``step`` (whose own ``update`` must be None) and ``update``.

    Args:
        step: the :class:`~trace_gym.step.Step` that generates (``step.update`` is None).
        update: the policy update, run on each step's forest and advantages.
        sync: called at the start of each generation, between updates (never during one):
            hands the weights the trainer has at that moment to the generator. None when
            nothing needs handing over.
        max_staleness: how many updates a step's data may lag the weights it trains (>= 1).
        before_next: called with step t's result once it is taken, before any later step's
            generation starts (see "Checkpoints" in the module docstring).
    """

    def __init__(self, step: Step, update: PolicyUpdate, *, sync: Callable[[], None] | None = None, max_staleness: int = 1,
                 before_next: Callable[[StepResult], None] | None = None):
        if step.update is not None:
            raise ValueError("AsyncStep runs the update itself: build the Step without update=")
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1 (0 is the synchronous Step), got {max_staleness}")
        self.step = step
        self.update = update
        self.sync = sync
        self.max_staleness = int(max_staleness)
        self.before_next = before_next
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trace-gym-generate")
        self._lock = threading.Lock()  # held by every update and by every generation's sync
        self._queue: list[_Generation] = []
        self.version = 0  # updates applied so far

    def _generate(self, t: int) -> _Generation:
        g = _Generation(t, Future())

        def body() -> StepResult:
            with self._lock:
                if self.sync is not None and self.version > 0:
                    self.sync()
                g.version = self.version
            g.started.set()
            return self.step.run(t)

        g.future = self._pool.submit(body)
        self._queue.append(g)
        return g

    def run(self, t: int, *, prefetch: int | None = None) -> StepResult:
        """Step ``t``: its forest (waiting for its generation if needed), then its update,
        with the generation of the next steps running meanwhile. Steps must be run in order.
        ``prefetch`` caps how many later steps are generated ahead (default ``max_staleness``;
        0 on the last step of a run)."""
        t0 = time.perf_counter()
        if not self._queue or self._queue[0].step != t:  # the first step, or out of order: generate now
            self._drain()
            self._generate(t)
        g = self._queue.pop(0)
        result = g.future.result()
        waited = time.perf_counter() - t0
        if self.before_next is not None:
            self.before_next(result)
        ahead = self.max_staleness if prefetch is None else max(0, min(int(prefetch), self.max_staleness))
        last = self._queue[-1].step if self._queue else t
        for s in range(last + 1, t + ahead + 1):
            self._generate(s)
        if self._queue and not self._queue[0].future.done():
            self._queue[0].started.wait()  # let the next generation take its weights before this update changes them
        t1 = time.perf_counter()
        with self._lock:
            metrics: dict[str, Any] = dict(self.update(result.forest, result.advantages) or {})
            staleness = self.version - g.version
            self.version += 1
        t_upd = time.perf_counter() - t1
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

    def wait_idle(self) -> None:
        """Wait until no generation is running (their results are kept for their steps)."""
        for g in list(self._queue):
            try:
                g.future.result()
            except Exception:
                pass

    def _drain(self) -> None:
        self.wait_idle()
        self._queue.clear()

    def close(self) -> None:
        """Wait for generations in flight and stop the background thread."""
        self._drain()
        self._pool.shutdown(wait=True)
