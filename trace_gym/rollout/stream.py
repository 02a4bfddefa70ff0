"""``EngineStream``: trajectories that advance one by one instead of in waves.

:meth:`RolloutEngine.rollout <trace_gym.rollout.engine.RolloutEngine.rollout>` runs *waves*:
every live trajectory generates, then every env steps, then the next wave, so each wave
waits for its slowest env step and its slowest generation. An :class:`EngineStream` keeps
every trajectory moving on its own:

* a trajectory's env step is submitted the moment its turn is generated, and its next turn
  is queued the moment that env step returns (env steps run in the engine's own thread, or on
  Ray env workers with :meth:`~trace_gym.rollout.workers.EnvWorkerPool.submit`);
* generation runs in background threads, one call in flight per engine of the policy (an
  :class:`~trace_gym.rollout.router.EngineRouter` has several); a call takes every queued
  trajectory, once at least ``min_batch`` of the stream's live trajectories are queued or no
  env step is in flight (batches too small waste a batched backend);
* trajectories can be added while others run (:meth:`start`), which is what lets a prompt's
  stage 2 begin when its own stage 1 is done
  (:func:`~trace_gym.allocation.streaming.allocate_step_streaming`).

Everything that touches the forest (nodes, counters, failures) happens in the thread that
calls :meth:`wait`. The nodes a trajectory gets are the same as in wave mode (exact prefix
ids, env snapshots, behaviour log-probs, context limit, failures recorded); which tokens are
sampled depends on how calls were batched, so forests are not those of wave mode.
"""

from __future__ import annotations

import math
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Sequence

import numpy as np

from trace_gym.forest.forest import Forest
from trace_gym.rollout.engine import Failure, RolloutEngine, RolloutError, _Live

__all__ = ["EngineStream"]


class EngineStream:
    """A :class:`~trace_gym.allocation.streaming.RolloutStream` over ``engines`` (one per env,
    sharing one policy) on ``forest``; tree ``t``'s trajectories use ``engines[engine_of_tree[t]]``.

    Args:
        min_batch: share of the stream's live trajectories a generation call waits for while
            env steps are still in flight (0: generate whatever is queued at once).
    """

    def __init__(self, forest: Forest, engines: Sequence[RolloutEngine], engine_of_tree: np.ndarray | None = None, *,
                 min_batch: float = 0.25):
        if not engines:
            raise ValueError("a stream needs at least one engine")
        policies = {id(e.policy) for e in engines}
        if len(policies) != 1:
            raise ValueError("the engines of one stream must share one policy")
        self.forest = forest
        self.engines = list(engines)
        self.engine_of_tree = np.zeros(forest.n_trees, dtype=np.int64) if engine_of_tree is None else np.asarray(engine_of_tree)
        self.policy = engines[0].policy
        self.params = engines[0].params
        self.min_batch = float(min_batch)
        self.slots = max(1, int(getattr(self.policy, "engines", 1)))
        self._gen_pool = ThreadPoolExecutor(max_workers=self.slots, thread_name_prefix="trace-gym-generate")
        self._ready: list[tuple[_Live, int]] = []
        self._inflight: dict[Future, tuple] = {}
        self._ended: list[int] = []
        self._cache: dict[int, list[int]] = {}
        self.failures: list[Failure] = []
        self.calls = 0  # generation calls made
        self.started = self.finished = self.generated_tokens = 0
        forest.counters.setdefault("failed_trajectories", 0)

    @property
    def live(self) -> int:
        """Trajectories started and not yet ended."""
        return self.started - self.finished - len(self.failures)

    def start(self, origins: np.ndarray) -> np.ndarray:
        """Start a trajectory at each node of ``origins``; returns their ids."""
        out = []
        for o in np.asarray(origins, dtype=np.int64).tolist():
            e = int(self.engine_of_tree[self.forest.tree[o]])
            l = self.engines[e].start(self.forest, o, self._cache)
            self._ready.append((l, e))
            out.append(l.traj)
        self.started += len(out)
        return np.asarray(out, dtype=np.int64)

    def wait(self) -> list[int]:
        """Block until a trajectory ends; the ids of those that ended since the last call
        (``[]``: nothing in flight)."""
        while not self._ended:
            self._dispatch()
            if not self._inflight:
                break
            done, _ = wait(list(self._inflight), return_when=FIRST_COMPLETED)
            for fut in done:
                self._complete(fut, self._inflight.pop(fut))
            self._progress()
        out, self._ended = self._ended, []
        return out

    # ------------------------------------------------------------------ internals

    def _dispatch(self) -> None:
        keep = []
        for l, e in self._ready:
            if self.engines[e].fits(l):
                keep.append((l, e))
            else:  # no room for another turn: the episode ends here, truncated, with reward 0
                self.engines[e]._end_at_context_limit(self.forest, l)
                self._end(l.traj)
        self._ready = keep
        gen_busy = sum(1 for v in self._inflight.values() if v[0] == "gen")
        env_busy = len(self._inflight) - gen_busy
        want = max(1, math.ceil(self.min_batch * max(self.live, 1)))
        if self._ready and gen_busy < self.slots and (len(self._ready) >= want or env_busy == 0):
            batch, self._ready = self._ready, []
            params = self.params
            if params.seed is not None:
                params = replace(params, seed=(int(params.seed) * 1_000_003 + 7_919 + self.calls) % (2**63))
            self.calls += 1
            fut = self._gen_pool.submit(self.policy.generate, [l.ids for l, _ in batch], params)
            self._inflight[fut] = ("gen", batch)

    def _complete(self, fut: Future, what: tuple) -> None:
        if what[0] == "gen":
            batch = what[1]
            try:
                gens = fut.result()
                if len(gens) != len(batch):
                    raise RuntimeError(f"policy {self.policy.name!r} returned {len(gens)} generations for {len(batch)} prompts")
            except Exception as exc:  # the whole call failed: its trajectories stop here
                for l, e in batch:
                    self._fail(l, e, f"{type(exc).__name__}: {exc}")
                return
            for (l, e), g in zip(batch, gens):
                if g.finish_reason == "error":
                    self._fail(l, e, str(g.info.get("error", "generation failed")))
                    continue
                env_fut = self.engines[e].submit_env_step((l.snapshot, l.branch_id if l.first else None, g.text))
                self._inflight[env_fut] = ("env", l, e, g)
            return
        _, l, e, g = what
        try:
            result = fut.result()
        except Exception as exc:
            result = f"{type(exc).__name__}: {exc}"
        done = self.engines[e].land(self.forest, l, g, result)
        if isinstance(done, Failure):
            self._record(done, e)
            return
        self.generated_tokens += len(g.token_ids)
        if done:
            self.finished += 1
            self._ended.append(l.traj)
        else:
            self._ready.append((l, e))

    def _end(self, traj: int) -> None:
        self.finished += 1
        self._ended.append(traj)

    def _fail(self, l: _Live, e: int, error: str) -> None:
        self._record(RolloutEngine._failure(self.forest, l, error), e)

    def _record(self, failure: Failure, e: int) -> None:
        self.failures.append(failure)
        self.engines[e].failures.append(failure)
        self.forest.counters["failed_trajectories"] += 1
        self._ended.append(failure.traj)

    def _progress(self) -> None:
        progress = self.engines[0].progress
        if progress is not None:
            progress({"finished": self.finished, "started": self.started, "live": self.live, "failed": len(self.failures),
                      "generated_tokens": self.generated_tokens})

    def close(self) -> None:
        """Stop the generation threads (after what is in flight); raises
        :class:`~trace_gym.rollout.engine.RolloutError` when trajectories failed and an engine
        has ``on_error="raise"``."""
        for fut in list(self._inflight):
            fut.cancel()
        self._gen_pool.shutdown(wait=True)
        if self.failures and any(e.on_error == "raise" for e in self.engines):
            raise RolloutError(self.failures)
