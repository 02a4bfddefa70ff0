"""``EngineRouter``: several generation engines behind one :class:`~trace_gym.policies.base.Policy`.

The rollout engine sees one policy; the router splits each :meth:`~EngineRouter.generate`
call over its engines and runs the parts at the same time:

* **engines**: local policies (each called from its own thread), or Ray actors that each
  build a backend (``hf``, ``vllm``, ``sim``, a plug-in's) with :meth:`EngineRouter.on_ray`,
  on one machine or spread over a cluster. A list of OpenAI-compatible server URLs is served
  by the ``openai`` backend itself (``base_url=[...]``), which routes by the same rule.
* **prefix affinity**: every prompt goes to the engine that served its longest recorded
  prefix (:class:`~trace_gym.rollout.affinity.PrefixAffinity`): a trajectory's next turn and a
  branch from any of its prefixes go where that prefix's KV is cached; the first rollout of an
  opening prompt goes to the least loaded engine, and the prompt's other rollouts follow it.
* **load balance**: no engine gets more than ``ceil(slack x n / engines)`` of a call's ``n``
  prompts; prompts over that cap, and prompts with no recorded prefix, go to the least loaded
  engine.
* **faults**: an engine (actor) that dies mid-call loses nothing: its prompts are generated
  again by the surviving engines (a prompt *is* the trajectory's state), a replacement actor is
  started, and it takes prompts again once it has received the current weights (at the next
  weight sync; at once when no sync has happened). With no engine left the prompts come back
  as ``finish_reason="error"`` generations, which the rollout engine records as failed
  trajectories.
* **weight sync** (:meth:`load_weights`, :meth:`load_adapter`) and :meth:`reset_cache` go to
  every engine; :meth:`sync_modes` is what all of them accept.

Each generation's ``info["engine"]`` is the index of the engine that produced it. Rendering
(:meth:`render_prompt`, :meth:`render_observation`, :meth:`decode`) is done here, by
``renderer`` (a local policy or a :class:`~trace_gym.policies.chat.ChatTemplate`), so token ids
never depend on which engine generated a turn.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

from trace_gym.policies.base import Generation, Policy, SamplingParams
from trace_gym.rollout.affinity import PrefixAffinity

__all__ = ["EngineActor", "EngineRouter"]


class EngineActor:
    """The body of one engine actor: a policy backend built in the actor's process."""

    def __init__(self, backend: str, kwargs: dict[str, Any]):
        from trace_gym.policies.base import make_policy

        self.policy = make_policy(backend, **kwargs)

    def describe(self) -> dict[str, Any]:
        """Where the actor runs (Ray node, pid) and its backend's context limit."""
        import os

        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "max_context_tokens": getattr(self.policy, "max_context_tokens", None),
                "sync_modes": sorted(self.policy.sync_modes())}

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """The backend's :meth:`~trace_gym.policies.base.Policy.generate`, run in the actor."""
        return self.policy.generate(prompts, params)

    def load_weights(self, weights: Any) -> None:
        """Load new policy weights into the actor's backend."""
        self.policy.load_weights(weights)

    def load_adapter(self, path: str) -> None:
        """Load the LoRA adapter saved at ``path`` into the actor's backend."""
        self.policy.load_adapter(path)

    def reset_cache(self) -> None:
        """Drop the backend's prefix cache (its entries were computed with old weights)."""
        self.policy.reset_cache()


class _Local:
    """A local policy as an engine: calls run in its own thread."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trace-gym-engine")
        self.max_context_tokens = getattr(policy, "max_context_tokens", None)
        self.modes = policy.sync_modes()

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> Future:
        return self.pool.submit(self.policy.generate, prompts, params)

    def call(self, method: str, *args: Any) -> None:
        getattr(self.policy, method)(*args)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.policy.close()


class _Remote:
    """A Ray actor as an engine."""

    def __init__(self, handle: Any, info: dict[str, Any]):
        self.handle = handle
        self.info = info
        self.max_context_tokens = info.get("max_context_tokens")
        self.modes = frozenset(info.get("sync_modes", ()))

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> Future:
        return self.handle.generate.remote(prompts, params).future()

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.handle, method).remote(*args)

    def close(self) -> None:
        import ray

        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:
            pass


def _lost(exc: BaseException) -> bool:
    """Whether ``exc`` means the engine itself is gone (not a bad request)."""
    try:
        import ray
    except ImportError:  # pragma: no cover - local engines only
        return False
    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError))


class EngineRouter(Policy):
    """Several engines behind one policy (see the module docstring).

    Args:
        engines: local :class:`~trace_gym.policies.base.Policy` objects (or use :meth:`on_ray`).
        renderer: renders chats and decodes tokens (a policy or a
            :class:`~trace_gym.policies.chat.ChatTemplate`); default: the first engine.
        slack: how far above an even share one engine's part of a call may grow for affinity.
        max_retries: how many times prompts of a lost engine are sent to the others.

    Attributes:
        stats: running counts: ``affine`` (prompts sent to the engine of their prefix),
            ``spilled`` (had one, sent elsewhere by the load cap), ``fresh`` (had none),
            ``lost`` (engine calls lost to a dead engine), ``per_engine`` (prompts each engine got).
    """

    name = "router"

    def __init__(self, engines: Sequence[Policy], *, renderer: Any = None, slack: float = 1.25, max_retries: int = 2):
        if not engines:
            raise ValueError("an engine router needs at least one engine")
        self._engines: list[Any] = [_Local(p) for p in engines]
        self._set_renderer(renderer if renderer is not None else engines[0])
        self._factory: Callable[[], Any] | None = None
        self._init(slack, max_retries)

    def _init(self, slack: float, max_retries: int) -> None:
        if slack < 1.0:
            raise ValueError(f"slack must be >= 1 (1: an even split), got {slack}")
        self.slack = float(slack)
        self.max_retries = int(max_retries)
        self.affinity = PrefixAffinity()
        self._ready = [True] * len(self._engines)  # False: a replacement that has not got the current weights
        self._synced = False  # a weight sync happened (replacements must wait for the next one)
        self._lock = threading.Lock()
        self.stats: dict[str, Any] = {"affine": 0, "spilled": 0, "fresh": 0, "lost": 0, "per_engine": [0] * len(self._engines)}
        limits = [e.max_context_tokens for e in self._engines if e.max_context_tokens]
        self.max_context_tokens: int | None = min(limits) if limits else None

    @classmethod
    def on_ray(cls, backend: str, kwargs: dict[str, Any] | None = None, engines: int = 2, *, renderer: Any = None,
               num_cpus: float = 1.0, num_gpus: float = 0.0, spread: bool = True, start_timeout_s: float = 300.0,
               ray_init: dict[str, Any] | None = None, slack: float = 1.25, max_retries: int = 2) -> "EngineRouter":
        """A router over ``engines`` Ray actors, each building ``backend`` with ``kwargs``
        (e.g. ``("hf", {"model": path, "device": "cuda"}, 4, num_gpus=1)``). ``renderer``
        defaults to the backend built here once more when it is ``sim``, else to a
        :class:`~trace_gym.policies.chat.ChatTemplate` of ``kwargs["model"]``'s tokenizer."""
        from trace_gym.rollout.workers import ensure_ray

        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines}")
        ray = ensure_ray(**(ray_init or {}))
        kwargs = dict(kwargs or {})
        opts: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": 0}
        if spread:
            opts["scheduling_strategy"] = "SPREAD"
        actor_cls = ray.remote(EngineActor).options(**opts)

        def start() -> Any:
            return actor_cls.remote(backend, kwargs)

        handles = [start() for _ in range(engines)]
        try:
            infos = ray.get([h.describe.remote() for h in handles], timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"engine actors did not start within {start_timeout_s:.0f} s: does the Ray cluster have "
                               f"the resources they ask for ({engines} x {opts})? {ray.cluster_resources()}") from exc
        self = cls.__new__(cls)
        self._engines = [_Remote(h, i) for h, i in zip(handles, infos)]
        self._factory = start
        self._set_renderer(renderer if renderer is not None else _default_renderer(backend, kwargs))
        self._init(slack, max_retries)
        return self

    @property
    def engines(self) -> int:
        """Number of engines the router spreads generation over."""
        return len(self._engines)

    # ------------------------------------------------------------------ rendering

    def _set_renderer(self, renderer: Any) -> None:
        from trace_gym.rollout.engine import chat_renderer

        self._decoder = renderer
        self._renderer = chat_renderer(renderer) if isinstance(renderer, Policy) else renderer

    def render_prompt(self, messages, tools=None) -> list[int]:
        ids = list(self._renderer.render_prompt(messages, tools))
        with self._lock:
            self.affinity.add_root(ids)
        return ids

    def render_observation(self, observation: str, *, role: str = "tool", closed: bool = True) -> list[int]:
        return list(self._renderer.render_observation(observation, role=role, closed=closed))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._decoder.decode(token_ids)

    # ------------------------------------------------------------------ routing

    def assign(self, prompts: Sequence[Sequence[int]]) -> list[int]:
        """The engine of each prompt (and record it): affinity first, within the load cap."""
        live = [k for k, ok in enumerate(self._ready) if ok]
        if not live:
            return []
        cap = max(1, math.ceil(self.slack * len(prompts) / len(live)))
        load = {k: 0 for k in live}
        out = []
        with self._lock:
            for p in prompts:
                pref = self.affinity.lookup(p)
                if pref is not None and pref in load and load[pref] < cap:
                    k = pref
                    self.stats["affine"] += 1
                else:
                    self.stats["spilled" if pref is not None else "fresh"] += 1
                    k = min(live, key=lambda j: (load[j], self.stats["per_engine"][j]))
                load[k] += 1
                self.stats["per_engine"][k] += 1
                self.affinity.record(p, k)
                out.append(k)
        return out

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        prompts = [list(map(int, p)) for p in prompts]
        out: list[Generation | None] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        for attempt in range(self.max_retries + 1):
            if not todo:
                break
            where = self.assign([prompts[i] for i in todo])
            if not where:
                break
            parts: dict[int, list[int]] = {}
            for i, k in zip(todo, where):
                parts.setdefault(k, []).append(i)
            futures = {k: self._engines[k].submit([prompts[i] for i in idx], params) for k, idx in parts.items()}
            todo = []
            for k, fut in futures.items():
                idx = parts[k]
                try:
                    gens = fut.result()
                except Exception as exc:
                    if not _lost(exc):
                        raise
                    self._replace(k)
                    todo += idx
                    continue
                for i, g in zip(idx, gens):
                    g.info["engine"] = k
                    out[i] = g
            todo.sort()
        for i in todo:
            out[i] = Generation([], [], "", "error", info={"error": "every engine that took this prompt was lost"})
        if any(g is None for g in out):  # no engine ready at all
            return [g or Generation([], [], "", "error", info={"error": "no engine is ready (all lost and waiting for weights)"})
                    for g in out]
        return out  # type: ignore[return-value]

    def _replace(self, k: int) -> None:
        """Engine ``k`` died: start a replacement (Ray engines), which takes prompts once it has
        the current weights."""
        self.stats["lost"] += 1
        with self._lock:
            self.affinity.forget(k)  # its cached prefixes are gone
            if self._factory is None:
                self._ready[k] = False
                return
            self._engines[k].close()
            self._engines[k] = _Remote(self._factory(), self._engines[k].info)
            self._ready[k] = not self._synced

    # ------------------------------------------------------------------ weights and caches

    def _broadcast(self, method: str, *args: Any) -> None:
        results = [e.call(method, *args) for e in self._engines]
        refs = [r for r in results if r is not None]
        if refs:
            import ray

            ray.get(refs)

    def load_weights(self, weights: Any) -> None:
        """Send ``weights`` to every engine (once through Ray's object store for actors)."""
        if any(isinstance(e, _Remote) for e in self._engines) and not isinstance(weights, str):
            import ray

            if not isinstance(weights, dict) and hasattr(weights, "state_dict"):
                weights = weights.state_dict()
            weights = ray.put(weights)
        self._broadcast("load_weights", weights)
        self._synced = True
        self._ready = [True] * len(self._engines)

    def load_adapter(self, path: str) -> None:
        self._broadcast("load_adapter", path)
        self._synced = True
        self._ready = [True] * len(self._engines)

    def sync_modes(self) -> frozenset[str]:
        modes = None
        for e in self._engines:
            modes = e.modes if modes is None else modes & e.modes
        return frozenset(modes or ())

    def reset_cache(self) -> None:
        self._broadcast("reset_cache")
        with self._lock:
            self.affinity.clear()

    def close(self) -> None:
        for e in self._engines:
            e.close()
        self._engines = []


def _default_renderer(backend: str, kwargs: dict[str, Any]) -> Any:
    """What renders chats in the driver for engines of ``backend``."""
    if backend == "sim":
        from trace_gym.policies.base import make_policy

        return make_policy("sim", **kwargs)
    model = kwargs.get("tokenizer") or kwargs.get("model")
    if not isinstance(model, str):
        raise ValueError(f"cannot build a renderer for {backend!r} engines without a model path: pass renderer=")
    from transformers import AutoTokenizer

    from trace_gym.policies.chat import ChatTemplate
    from trace_gym.policies.models import resolve_model

    return ChatTemplate(AutoTokenizer.from_pretrained(resolve_model(model)),
                        chat_template=kwargs.get("chat_template"), tools_in_template=kwargs.get("tools_in_template"))
