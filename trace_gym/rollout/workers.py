"""Env workers on Ray: a wave's env steps (tools included) run in parallel in N Ray actors.

:class:`EnvWorkerPool` is an :data:`~trace_gym.rollout.engine.EnvStepper` provider: the
rollout engine still generates each wave in the driver with one batched
:meth:`~trace_gym.policies.base.Policy.generate` call, then hands the wave's env steps to
:meth:`EnvWorkerPool.step`, which splits them into N contiguous chunks, one per actor, and
returns the results in the wave's order. A step is a pure function of (snapshot,
``branch_id``, action) (:func:`~trace_gym.rollout.engine.run_env_step`), so a trajectory's
turns may run on any worker: snapshots travel as bytes
(:meth:`~trace_gym.env.base.EnvSnapshot.to_bytes`) both ways and no worker keeps a
trajectory's state between steps. Hence, in sync mode with a fixed seed, the forests and
metrics equal the in-process path's.

Each actor holds its own copy of the source's envs (shipped once, pickled with Ray's
cloudpickle), so envs must be picklable after construction (the built-in ones are), and on
a multi-node cluster ``trace_gym`` (and any env plug-in) must be importable on every node.

Faults. An actor that dies in the middle of a wave (``ray.kill``, a crashed node, an OOM
kill) loses only its chunk: the pool starts a replacement actor and re-runs that chunk from
the trajectories' last snapshots, which gives exactly the results the lost actor would have
returned. After ``max_retries`` lost attempts for one chunk its steps come back as error
texts, and the engine records those trajectories as failed (``on_error="record"``) while the
rest of the step completes. An env step that raises is not a fault of the worker: its error
text comes back like the local path's.

Ray is imported here only, when a pool is built; ``import trace_gym`` never imports it.
Install it with the ``ray`` extra (``pip install 'trace-gym[ray]'``).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Sequence

from trace_gym.env.base import AgentEnv, EnvSnapshot
from trace_gym.rollout.engine import EnvStep, EnvStepResult, run_env_step

__all__ = ["EnvWorker", "EnvWorkerPool", "WorkerLost", "ensure_ray"]

_Wire = tuple[str, float, bool, bool, dict, bytes]  # an EnvStepResult on the wire (snapshot as bytes)


def _unwire(r: _Wire | str) -> EnvStepResult | str:
    return r if isinstance(r, str) else EnvStepResult(r[0], r[1], r[2], r[3], r[4], EnvSnapshot.from_bytes(r[5]))


class WorkerLost(RuntimeError):
    """A chunk of env steps whose worker died more than ``max_retries`` times."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - exercised where ray is absent
        raise ImportError("rollout.workers > 0 needs Ray: pip install 'trace-gym[ray]' (or 'ray>=2.9')") from exc
    return ray


def ensure_ray(**init_kwargs: Any) -> Any:
    """Return the ``ray`` module, connected: an already initialised Ray is used as is; else
    ``ray.init(**init_kwargs)``, which joins the cluster named by ``RAY_ADDRESS`` or started on
    this machine with ``ray start --head``, or else starts a local one."""
    ray = _ray()
    if not ray.is_initialized():
        init_kwargs.setdefault("log_to_driver", False)
        init_kwargs.setdefault("include_dashboard", False)
        ray.init(**init_kwargs)
    return ray


class EnvWorker:
    """The body of one env-worker actor: a copy of each env of the source, stepped on request.

    ``step(e, items)`` runs ``items`` (``(snapshot bytes, branch_id, action)``) one after
    another on env ``e`` and returns, per item, either the error text of a step that raised
    or ``(observation, reward, terminated, truncated, info, snapshot bytes)``.
    """

    def __init__(self, envs: Sequence[AgentEnv]):
        self.envs = list(envs)

    def where(self) -> tuple[str, int]:
        """(Ray node id, process id) of this worker."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def step(self, e: int, items: list[tuple[bytes, int | None, str]]) -> list[_Wire | str]:
        """Run serialised ``(snapshot, branch_id, action)`` items on env ``e``, in order; one
        result per item, an error text where the step failed."""
        env = self.envs[e]
        out: list[_Wire | str] = []
        for snap, branch_id, action in items:
            r = run_env_step(env, EnvSnapshot.from_bytes(snap), branch_id, action)
            out.append(r if isinstance(r, str) else (r.observation, r.reward, r.terminated, r.truncated, r.info, r.snapshot.to_bytes()))
        return out


class EnvWorkerPool:
    """``workers`` Ray actors, each with a copy of ``envs``, that run waves of env steps.

    Args:
        envs: the source's envs (env ``e`` of :meth:`step` is ``envs[e]``); pickled once and
            shipped to every actor.
        workers: number of actors (>= 1).
        num_cpus: CPUs each actor reserves from Ray's scheduler (lower it, e.g. to 0.25, to
            run more workers than cores for envs that wait on tools or servers).
        max_retries: how many times one chunk is re-run after its actor died before its
            steps come back as errors ("env worker lost ...").
        spread: place the actors with Ray's ``SPREAD`` strategy (over the nodes of a cluster).
        start_timeout_s: how long to wait for the actors to start; a cluster without the
            resources they ask for fails here with a clear ``TimeoutError`` instead of hanging.
        ray_init: arguments of ``ray.init`` when Ray is not yet initialised (:func:`ensure_ray`).
        chunk_timeout_s: a chunk that has not returned after this many seconds counts as lost:
            its actor is killed and replaced and the chunk re-run (or given up) as for a dead
            one, so a hung worker cannot hang the step. None (default): no limit.

    Attributes:
        actors: the live actor handles (a dead one is replaced in place).
        lost: how many chunks were re-run or given up because their actor died.
        in_flight: chunks submitted and not yet returned (0 between waves).
    """

    def __init__(self, envs: Sequence[AgentEnv], workers: int, *, num_cpus: float = 1.0, max_retries: int = 2,
                 spread: bool = True, start_timeout_s: float = 120.0, ray_init: dict[str, Any] | None = None,
                 chunk_timeout_s: float | None = None):
        if workers < 1:
            raise ValueError(f"an env worker pool needs at least one worker, got {workers}")
        self.ray = ensure_ray(**(ray_init or {}))
        self.workers = int(workers)
        self.max_retries = int(max_retries)
        self.start_timeout_s = float(start_timeout_s)
        self.chunk_timeout_s = chunk_timeout_s
        self.lost = 0
        self.in_flight = 0
        self._lock = threading.Lock()
        self._load: list[int] = [0] * self.workers  # single steps in flight per actor (submit)
        opts: dict[str, Any] = {"num_cpus": num_cpus, "max_restarts": 0}
        if spread:
            opts["scheduling_strategy"] = "SPREAD"
        self._cls = self.ray.remote(EnvWorker).options(**opts)
        self._envs = self.ray.put(list(envs))
        self.actors = [self._cls.remote(self._envs) for _ in range(self.workers)]
        self.placement = self._ready(self.actors)

    def _ready(self, actors: list[Any]) -> list[tuple[str, int]]:
        try:
            return self.ray.get([a.where.remote() for a in actors], timeout=self.start_timeout_s)
        except self.ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"env workers did not start within {self.start_timeout_s:.0f} s: does the Ray cluster have "
                               f"the CPUs they ask for ({self.workers} x num_cpus)? {self.ray.cluster_resources()}") from exc

    def _replace(self, k: int, dead: Any = None) -> None:
        """Start a fresh actor in slot ``k`` (its predecessor, ``dead`` when given, died)."""
        with self._lock:
            if dead is not None and self.actors[k] is not dead:
                return  # replaced already
            self.ray.kill(self.actors[k], no_restart=True)  # a no-op for a dead actor; frees a hung one
            self.actors[k] = self._cls.remote(self._envs)

    def submit(self, e: int, item: EnvStep) -> Future:
        """Run one env step on env ``e`` of the least busy worker, in the background: a future
        of its :class:`~trace_gym.rollout.engine.EnvStepResult` or error text (streaming). A
        worker that dies is replaced and the step re-run from its snapshot, up to
        ``max_retries`` times."""
        out: Future = Future()
        self._send(e, (item[0].to_bytes(), item[1], item[2]), out, 0)
        return out

    def _send(self, e: int, wire: tuple[bytes, int | None, str], out: Future, tries: int) -> None:
        with self._lock:
            k = min(range(self.workers), key=self._load.__getitem__)
            self._load[k] += 1
            actor = self.actors[k]
        ref = actor.step.remote(e, [wire])
        ref.future().add_done_callback(lambda f: self._landed(f, e, wire, out, tries, k, actor))

    def _landed(self, f: Future, e: int, wire: tuple[bytes, int | None, str], out: Future, tries: int, k: int, actor: Any) -> None:
        with self._lock:
            self._load[k] -= 1
        ray = self.ray
        try:
            (r,) = f.result()
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError) as exc:
            self.lost += 1
            self._replace(k, actor)
            if tries < self.max_retries:
                self._send(e, wire, out, tries + 1)
            else:
                out.set_result(f"{WorkerLost.__name__}: env worker lost {tries + 1} times ({type(exc).__name__})")
            return
        except Exception as exc:
            out.set_result(f"{type(exc).__name__}: {exc}")
            return
        out.set_result(_unwire(r))

    def step(self, e: int, items: list[EnvStep]) -> list[EnvStepResult | str]:
        """Run ``items`` on env ``e`` of the workers, in parallel; one result per item, in order
        (an :data:`~trace_gym.rollout.engine.EnvStepper` for env ``e``)."""
        if not items:
            return []
        ray = self.ray
        wire = [(s.to_bytes(), b, a) for s, b, a in items]
        n = min(self.workers, len(wire))
        size = -(-len(wire) // n)
        chunks = [(k * size, wire[k * size:(k + 1) * size]) for k in range(n) if wire[k * size:(k + 1) * size]]
        out: list[Any] = [None] * len(wire)
        pending = {self.actors[k].step.remote(e, chunk): (k, start, chunk, 0) for k, (start, chunk) in enumerate(chunks)}
        since = {ref: time.monotonic() for ref in pending}
        while pending:
            self.in_flight = len(pending)
            done, _ = ray.wait(list(pending), num_returns=1, timeout=self.chunk_timeout_s)
            if not done:  # kill the actors of chunks past the time limit; ray.get then reports them dead
                now = time.monotonic()
                for late in [r for r in pending if now - since[r] >= self.chunk_timeout_s]:
                    ray.kill(self.actors[pending[late][0]], no_restart=True)
                continue
            ref = done[0]
            k, start, chunk, tries = pending.pop(ref)
            try:
                res = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError) as exc:
                self.lost += 1
                self._replace(k)
                if tries < self.max_retries:  # re-run the chunk from its snapshots on the fresh actor
                    retry = self.actors[k].step.remote(e, chunk)
                    pending[retry], since[retry] = (k, start, chunk, tries + 1), time.monotonic()
                    continue
                msg = f"{WorkerLost.__name__}: env worker lost {tries + 1} times ({type(exc).__name__})"
                res = [msg] * len(chunk)
            out[start:start + len(res)] = res
        self.in_flight = 0
        return [_unwire(r) for r in out]

    def submitter(self, e: int) -> Any:
        """One env step of env ``e`` in the background (the engine's ``env_submit``)."""
        return lambda item: self.submit(e, item)

    def stepper(self, e: int) -> Any:
        """The :data:`~trace_gym.rollout.engine.EnvStepper` of env ``e``."""
        return lambda items: self.step(e, items)

    def close(self) -> None:
        """Stop the actors (Ray itself stays up)."""
        for a in self.actors:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:
                pass
        self.actors = []

