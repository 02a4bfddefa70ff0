"""``RolloutEngine``: runs an allocator's plans over environments with a policy, token in, token out.

The engine is the :data:`~trace_gym.allocation.allocator.RolloutFn` that
:func:`~trace_gym.allocation.allocator.allocate_step` calls: ``engine.rollout(forest, origins)``
starts one trajectory per origin node (a root: a bare rollout; an inner node: a branch)
and runs all of them to the end, one *wave* (one turn of every live trajectory) at a time,
with one batched :meth:`Policy.generate` call per wave.

Exact prefixes. A trajectory is one list of token ids: the root's rendered opening chat,
then, per turn, the generated tokens and the observation tokens the policy's
:meth:`~trace_gym.policies.base.Policy.render_observation` appends. Each node stores its own span
(:class:`TurnRecord`), so the ids of any prefix are the concatenation of the spans on its
path (:func:`prefix_ids`); a branch continues from exactly those ids. Nothing is ever
re-tokenised.

Exact env state. Each node stores the env snapshot taken after its turn. The engine keeps
one env and restores the trajectory's latest snapshot before each step; the first step of
a trajectory restores its origin with a fresh ``branch_id`` (unique per engine), so forks
of a stochastic env diverge, and ``restore(origin snapshot, branch_id)`` + the same actions
replays a trajectory exactly.

Accounting (``forest.counters``): ``trajectories`` and ``generated_tokens`` (the forest
counts them), ``prefill_tokens`` and ``reused_prefix_tokens`` (from the backend's
:class:`~trace_gym.policies.base.Generation` info), ``tool_calls`` (from the env's step info),
and ``failed_trajectories``.

Context limit. A trajectory whose prefix leaves no room for another ``max_new_tokens``
within the policy's ``max_context_tokens`` ends with an empty truncated leaf (reward 0,
``finish_reason="context"``; the env is not stepped for it).

Failures. A turn the backend could not produce (``finish_reason="error"``, e.g. a server
that went away) or an env step that raised ends that trajectory; everything already
generated stays in the forest, the failure is recorded in :attr:`RolloutEngine.failures`,
and once the other trajectories have finished the engine raises :class:`RolloutError`
(or only records it, with ``on_error="record"``).
"""

from __future__ import annotations

import base64
import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from trace_gym.allocation.budget import Budget, Spend
from trace_gym.allocation.allocator import allocate_step, make_allocator
from trace_gym.env.base import AgentEnv, EnvSnapshot
from trace_gym.forest.forest import BRANCH, TERMINAL, TRUNCATED, Forest
from trace_gym.policies.base import Policy, SamplingParams
from trace_gym.env.react import parse_turn
from trace_gym.task import Task

# ----------------------------------------------------------------------------- node payloads


@dataclass
class RootRecord:
    """Payload of a root node: the task, its opening token ids and the env right after reset."""

    task: Task
    token_ids: list[int]
    snapshot: EnvSnapshot
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]


@dataclass
class TurnRecord:
    """Payload of a turn node.

    ``token_ids`` is the node's span: first the ``n_generated`` policy tokens (``mask`` 1,
    ``logprobs`` their behaviour log-probs), then, unless the episode ended here, the
    observation/template tokens that lead to the next turn (``mask`` 0, ``logprobs`` 0).
    ``prefix_len`` is the length of everything before the span, so the node's full ids are
    ``prefix_ids(forest, node)`` and ``len(...) == prefix_len + len(token_ids)``.
    ``snapshot`` is the env after this turn; ``branch_id`` the fork id its trajectory
    restored its origin with.
    """

    token_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    n_generated: int
    prefix_len: int
    action: str
    observation: str
    role: str
    finish_reason: str
    snapshot: EnvSnapshot
    branch_id: int
    reward: float = float("nan")
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Failure:
    """A trajectory the engine could not finish: where it stopped and why."""

    traj: int
    origin: int
    last_node: int
    error: str


@dataclass
class EnvStepResult:
    """What one env step returned: ``env.step``'s five values and the snapshot after it."""

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    snapshot: EnvSnapshot


EnvStep = tuple[EnvSnapshot, "int | None", str]
"""One env step to run: (snapshot to restore, ``branch_id`` for a trajectory's first step else
None, the action text)."""

EnvStepper = Callable[[list[EnvStep]], "list[EnvStepResult | str]"]
"""Runs a wave's env steps; one result per step, in order: an :class:`EnvStepResult`, or the
error text (``"ExcType: message"``) of a step that raised. The engine's default runs them
one after another on its own env; :class:`~trace_gym.rollout.workers.EnvWorkerPool` runs them
on Ray actors."""


def run_env_step(env: AgentEnv, snapshot: EnvSnapshot, branch_id: int | None, action: str) -> EnvStepResult | str:
    """Restore ``snapshot`` into ``env`` (with ``branch_id``: as a fork), step it with ``action``
    and snapshot it. Never raises: a step that raised returns its error text. The result is a
    function of the arguments alone (all env state is in the snapshot), so any env instance,
    in any process, gives the same one."""
    try:
        env.restore(snapshot, branch_id=branch_id)
        obs, reward, terminated, truncated, info = env.step(action)
        return EnvStepResult(obs, float(reward), bool(terminated), bool(truncated), info, env.snapshot())
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


class RolloutError(RuntimeError):
    """Some trajectories could not be finished. The forest keeps every node generated;
    ``failures`` lists the trajectories that stopped early."""

    def __init__(self, failures: Sequence[Failure]):
        self.failures = list(failures)
        first = self.failures[0].error if self.failures else ""
        super().__init__(
            f"{len(self.failures)} trajectories could not be finished (kept in the forest up to their last node); first error: {first}"
        )


def node_text(action: str, observation: str) -> str:
    """The text a node holds for one turn: the action, then the observation on the next line."""
    return f"{action}\n{observation}" if observation else action


def prefix_ids(forest: Forest, node: int) -> list[int]:
    """The exact token ids of the prefix ending at ``node`` (root chat + every span on the path)."""
    root = int(forest.root_nodes[int(forest.tree[node])])
    rec = forest.payload[root]
    if not isinstance(rec, RootRecord):
        raise ValueError(f"root {root} has no rendered prompt (was the tree built by a RolloutEngine?)")
    ids = list(rec.token_ids)
    for i in forest.path(int(node)):
        ids.extend(forest.payload[i].token_ids)
    return ids


@dataclass
class TokenSequence:
    """A trajectory as the trainer sees it: ``ids``; ``mask`` (1 on policy tokens);
    ``logprobs`` (behaviour log-probs, 0 elsewhere); ``node`` (the node that owns each
    token; the root for the prompt), so per-node advantages map to tokens as ``adv[node]``."""

    ids: np.ndarray
    mask: np.ndarray
    logprobs: np.ndarray
    node: np.ndarray


def sequence(forest: Forest, node: int) -> TokenSequence:
    """The :class:`TokenSequence` of the path from the root to ``node`` (usually a leaf)."""
    root = int(forest.root_nodes[int(forest.tree[node])])
    rec = forest.payload[root]
    ids, mask, lps, owner = [list(rec.token_ids)], [[0] * len(rec.token_ids)], [[0.0] * len(rec.token_ids)], [[root] * len(rec.token_ids)]
    for i in forest.path(int(node)):
        p = forest.payload[i]
        ids.append(p.token_ids)
        mask.append(p.mask)
        lps.append(p.logprobs)
        owner.append([i] * len(p.token_ids))
    cat = lambda parts, dt: np.fromiter((x for part in parts for x in part), dtype=dt)  # noqa: E731
    return TokenSequence(cat(ids, np.int64), cat(mask, np.int8), cat(lps, np.float32), cat(owner, np.int32))


# ----------------------------------------------------------------------------- renderers


class _TextChatAdapter:
    """Renders chats for policies that expose ``chat_ids(messages)`` and ``encode(text)``
    but not :meth:`Policy.render_prompt` (the ``sim`` policy): ``role: content`` lines,
    with the assistant's line opened for the policy to complete."""

    def __init__(self, policy: Any):
        self.policy = policy

    def render_prompt(self, messages, tools=None) -> list[int]:
        return list(self.policy.chat_ids(messages)) + list(self.policy.encode("assistant: "))

    def render_observation(self, observation: str, *, role: str = "tool", closed: bool = True) -> list[int]:
        return (list(self.policy.encode("\n")) + list(self.policy.chat_ids([{"role": role, "content": observation}]))
                + list(self.policy.encode("assistant: ")))


def chat_renderer(policy: Policy) -> Any:
    """What renders chats to token ids for ``policy``: the policy itself when it implements
    :meth:`Policy.render_prompt`, else an adapter for policies with ``chat_ids``/``encode``
    (the ``sim`` policy)."""
    overrides = type(policy).render_prompt is not Policy.render_prompt
    if overrides:
        return policy
    if hasattr(policy, "chat_ids") and hasattr(policy, "encode"):
        return _TextChatAdapter(policy)
    raise TypeError(f"policy {policy.name!r} cannot render chats to tokens (implement Policy.render_prompt/render_observation)")


# ----------------------------------------------------------------------------- the engine


@dataclass
class _Live:
    traj: int
    origin: int
    ids: list[int]
    snapshot: EnvSnapshot
    branch_id: int
    first: bool = True


class RolloutEngine:
    """Grows rollout trees with a policy and an env (see the module docstring).

    Args:
        env: an :class:`~trace_gym.env.base.AgentEnv` or a registered env id. The engine steps
            this one instance, restoring each trajectory's snapshot before its turn.
        policy: a :class:`~trace_gym.policies.base.Policy` (``hf``, ``vllm``, ``openai``, ``sim``...).
        params: sampling parameters of every turn (``max_new_tokens`` is the per-turn
            limit). A ``seed`` is advanced per wave so waves do not repeat their draws.
        on_error: ``"raise"`` (default) raises :class:`RolloutError` at the end of a
            ``rollout`` call that had failures; ``"record"`` only records them.
        progress: called after every wave with ``{"finished", "started", "live", "failed",
            "generated_tokens"}`` for this call.
        env_steps: an :data:`EnvStepper` that runs each wave's env steps (e.g. on Ray env
            workers); by default they run here, one after another, on ``env``. Either way the
            forest is the same: steps are applied in the wave's order.
        env_submit: runs one env step in the background and returns a future of its result
            (streaming, :class:`~trace_gym.rollout.stream.EngineStream`; e.g. on a Ray env
            worker); by default it runs in a thread of this engine, on ``env``.
    """

    def __init__(
        self,
        env: AgentEnv | str,
        policy: Policy,
        params: SamplingParams | None = None,
        *,
        on_error: str = "raise",
        progress: Callable[[dict[str, int]], None] | None = None,
        env_steps: EnvStepper | None = None,
        env_submit: "Callable[[EnvStep], Future] | None" = None,
    ):
        if isinstance(env, str):
            from trace_gym.registry import make

            env = make(env)
        if on_error not in ("raise", "record"):
            raise ValueError(f"on_error must be 'raise' or 'record', got {on_error!r}")
        self.env: AgentEnv = env  # type: ignore[assignment]
        self.policy = policy
        self.renderer = chat_renderer(policy)
        self.params = params or SamplingParams()
        self.on_error = on_error
        self.progress = progress
        self.env_steps: EnvStepper = env_steps or (lambda items: [run_env_step(self.env, *item) for item in items])
        self._env_submit = env_submit
        self._env_thread: ThreadPoolExecutor | None = None
        self.failures: list[Failure] = []
        self._next_branch = 0
        self._waves = 0

    # ------------------------------------------------------------------ roots

    def add_roots(self, forest: Forest, tasks: Sequence[Task]) -> np.ndarray:
        """Add one root per task, with its rendered opening chat and reset env state."""
        return np.array([self._add_root(forest, task) for task in tasks], dtype=np.int64)

    def _root_record(self, task: Task) -> tuple[RootRecord, dict[str, Any]]:
        _, info = self.env.reset(options={"task": task})
        messages, tools = info.get("messages") or self.env.messages(), info.get("tools") or []
        ids = self.renderer.render_prompt(messages, tools)
        return RootRecord(task, list(ids), self.env.snapshot(), messages, tools), info

    def _add_root(self, forest: Forest, task: Task) -> int:
        rec, info = self._root_record(task)
        return forest.add_root(task.id, task.prompt, max_turns=self.env.max_turns,
                               oracle=float(info.get("success_probability", math.nan)), payload=rec)

    def _ensure_root(self, forest: Forest, root: int) -> RootRecord:
        rec = forest.payload[root]
        if not isinstance(rec, RootRecord):
            # a root added by plain Forest.add_root / add_candidates: look its task up by id
            task_id = forest.task_ids[int(forest.tree[root])]
            rec, _ = self._root_record(self.env.task_by_id(task_id))
            forest.payload[root] = rec
        return rec

    # ------------------------------------------------------------------ rollouts

    def step(self, forest: Forest, allocator: Any, budget: Budget, predictor: Any | None = None) -> Spend:
        """One allocation step on ``forest`` (candidate roots only): stage 1 and stage 2
        of ``allocator`` (an :class:`~trace_gym.allocation.allocator.Allocator` or its name), rolled out here."""
        if isinstance(allocator, str):
            allocator = make_allocator(allocator)
        return allocate_step(forest, allocator, budget, predictor, self.rollout)

    def __call__(self, forest: Forest, origins: Sequence[int] | np.ndarray) -> None:
        """An engine is itself a :data:`~trace_gym.allocation.allocator.RolloutFn`: same as :meth:`rollout`."""
        self.rollout(forest, origins)

    def rollout(self, forest: Forest, origins: Sequence[int] | np.ndarray) -> None:
        """Start one trajectory at each node in ``origins`` and run all of them to the end."""
        cache: dict[int, list[int]] = {}
        live = [self.start(forest, o, cache) for o in np.asarray(origins, dtype=np.int64).tolist()]
        counters = forest.counters
        counters.setdefault("failed_trajectories", 0)
        started, finished, failures = len(live), 0, []
        gen_tokens = 0
        while live:
            fits = []
            for l in live:
                if self.fits(l):
                    fits.append(l)
                else:  # no room for another turn: the episode ends here, truncated, with reward 0
                    self._end_at_context_limit(forest, l)
                    finished += 1
            live = fits
            if not live:
                break
            params = self.params
            if params.seed is not None:
                params = replace(params, seed=(int(params.seed) * 1_000_003 + self._waves) % (2**63))
            self._waves += 1
            try:
                gens = self.policy.generate([l.ids for l in live], params)
            except Exception as exc:  # the whole call failed: every live trajectory stops here
                failures += [self._failure(forest, l, f"{type(exc).__name__}: {exc}") for l in live]
                break
            if len(gens) != len(live):
                raise RuntimeError(f"policy {self.policy.name!r} returned {len(gens)} generations for {len(live)} prompts")
            nxt: list[_Live] = []
            stepped = iter(self.env_steps([(l.snapshot, l.branch_id if l.first else None, g.text)
                                           for l, g in zip(live, gens) if g.finish_reason != "error"]))
            for l, g in zip(live, gens):
                if g.finish_reason == "error":
                    failures.append(self._failure(forest, l, str(g.info.get("error", "generation failed"))))
                    continue
                done = self.land(forest, l, g, next(stepped))
                if isinstance(done, Failure):
                    failures.append(done)
                    continue
                gen_tokens += len(g.token_ids)
                if done:
                    finished += 1
                else:
                    nxt.append(l)
            live = nxt
            if self.progress is not None:
                self.progress({"finished": finished, "started": started, "live": len(live), "failed": len(failures), "generated_tokens": gen_tokens})
        counters["failed_trajectories"] += len(failures)
        self.failures.extend(failures)
        if failures and self.on_error == "raise":
            raise RolloutError(failures)

    def start(self, forest: Forest, origin: int, cache: dict[int, list[int]] | None = None) -> _Live:
        """Open a trajectory at node ``origin`` (a root: a bare rollout; else a branch) with the
        exact prefix ids and env snapshot it continues from; ``cache`` shares prefix ids between
        trajectories of the same origin."""
        if forest.parent[origin] < 0:
            rec = self._ensure_root(forest, origin)
            ids, snap = rec.token_ids, rec.snapshot
        else:
            rec = forest.payload[origin]
            if not isinstance(rec, TurnRecord):
                raise ValueError(f"node {origin} was not generated by a RolloutEngine: it has no tokens or env snapshot to branch from")
            ids = cache.get(origin) if cache is not None else None
            if ids is None:
                ids = prefix_ids(forest, origin)
                if cache is not None:
                    cache[origin] = ids
            snap = rec.snapshot
        t = forest.start_trajectory(origin)
        live = _Live(t, origin, list(ids), snap, self._next_branch)
        self._next_branch += 1
        return live

    def submit_env_step(self, item: EnvStep) -> Future:
        """Run one env step in the background (see ``env_submit``); a future of its
        :class:`EnvStepResult` or error text."""
        if self._env_submit is not None:
            return self._env_submit(item)
        if self._env_thread is None:  # one thread: the engine's env is one instance
            self._env_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trace-gym-env")
        return self._env_thread.submit(run_env_step, self.env, *item)

    @staticmethod
    def _failure(forest: Forest, l: _Live, error: str) -> Failure:
        return Failure(l.traj, l.origin, int(forest.traj_leaf[l.traj]), error)

    def land(self, forest: Forest, l: _Live, g: Any, result: EnvStepResult | str) -> bool | Failure:
        """Record trajectory ``l``'s turn (generation ``g``, env step ``result``): True when the
        episode ended, False when it goes on, a :class:`Failure` when the env step failed."""
        forest.counters["prefill_tokens"] += int(g.info.get("prefill_tokens", len(l.ids)))
        forest.counters["reused_prefix_tokens"] += int(g.info.get("reused_prefix_tokens", 0))
        if isinstance(result, str):
            return self._failure(forest, l, f"env step failed: {result}")
        try:
            return self._advance(forest, l, g, result)
        except Exception as exc:
            return self._failure(forest, l, f"env step failed: {type(exc).__name__}: {exc}")

    def fits(self, l: _Live) -> bool:
        """Whether trajectory ``l`` has room for another turn within the policy's context."""
        max_ctx = getattr(self.policy, "max_context_tokens", None)
        return not max_ctx or len(l.ids) + self.params.max_new_tokens <= max_ctx

    def _end_at_context_limit(self, forest: Forest, l: _Live) -> None:
        """Close a trajectory that has no room left for a turn with an empty, truncated leaf
        (``finish_reason="context"``, reward 0; the env is not stepped)."""
        rec = TurnRecord([], [], [], 0, len(l.ids), "", "", "", "context", l.snapshot, l.branch_id, 0.0, False, True,
                         {"context_limit": getattr(self.policy, "max_context_tokens", None)})
        forest.add_node(l.traj, text="", n_tokens=0, truncated=True, reward=0.0, payload=rec)

    def _advance(self, forest: Forest, l: _Live, g: Any, r: EnvStepResult) -> bool:
        """Append the node of trajectory ``l``'s turn (generation ``g``, env step ``r``); True when it ended."""
        obs, reward, terminated, truncated, info, snap = r.observation, r.reward, r.terminated, r.truncated, r.info, r.snapshot
        done = bool(terminated or truncated)
        role = str(info.get("role", "tool"))
        span, mask, lps = list(g.token_ids), [1] * len(g.token_ids), [float(x) for x in g.logprobs]
        if not done:
            tail = self.renderer.render_observation(obs, role=role, closed=g.finish_reason == "stop")
            span += tail
            mask += [0] * len(tail)
            lps += [0.0] * len(tail)
        keep = {k: v for k, v in info.items() if k in ("parse_error", "answer", "tool_calls", "success_probability", "on_track")}
        if "engine" in g.info:  # which engine of a router generated the turn
            keep["engine"] = g.info["engine"]
        rec = TurnRecord(span, mask, lps, len(g.token_ids), len(l.ids), g.text, obs, role, g.finish_reason, snap, l.branch_id,
                         float(reward) if done else math.nan, bool(terminated), bool(truncated and not terminated), keep)
        forest.add_node(l.traj, text=node_text(g.text, obs), n_tokens=len(g.token_ids), terminal=bool(terminated),
                        truncated=bool(truncated and not terminated), reward=float(reward) if done else math.nan,
                        oracle=float(info.get("success_probability", math.nan)), payload=rec)
        calls = info.get("tool_calls")
        if not isinstance(calls, int):  # envs with their own turn logic may not report it
            calls = len(parse_turn(g.text).tool_calls)
        forest.counters["tool_calls"] += calls
        l.ids.extend(span)
        l.snapshot = snap
        l.first = False
        return done


# ----------------------------------------------------------------------------- JSONL


def _num(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def node_records(forest: Forest, *, snapshots: bool = True) -> list[dict[str, Any]]:
    """One JSON-ready dict per node (roots first in id order, as stored): tree structure,
    flags, reward, backed-up value, text, token span, loss mask, log-probs and (base64)
    env snapshot."""
    forest.backup()
    out = []
    for i in range(len(forest)):
        p = forest.payload[i]
        tree = int(forest.tree[i])
        flags = int(forest.flags[i])
        rec: dict[str, Any] = {
            "node": i, "parent": int(forest.parent[i]), "tree": tree, "task_id": forest.task_ids[tree],
            "depth": int(forest.depth[i]), "traj": int(forest.traj[i]),
            "origin": int(forest.traj_origin[forest.traj[i]]) if forest.traj[i] >= 0 else None,
            "terminal": bool(flags & TERMINAL), "truncated": bool(flags & TRUNCATED), "branch": bool(flags & BRANCH),
            "reward": _num(float(forest.reward[i])), "value": _num(float(forest.value[i])), "n_leaves": int(forest.n_leaves[i]),
            "oracle": _num(float(forest.oracle[i])), "n_tokens": int(forest.n_tokens[i]), "text": forest.text[i],
        }
        if isinstance(p, RootRecord):
            rec.update(token_ids=p.token_ids, mask=[0] * len(p.token_ids), prefix_len=0, messages=p.messages, tools=p.tools)
            snap = p.snapshot
        elif isinstance(p, TurnRecord):
            rec.update(action=p.action, observation=p.observation, role=p.role, finish_reason=p.finish_reason,
                       prefix_len=p.prefix_len, token_ids=p.token_ids, mask=p.mask, logprobs=p.logprobs,
                       branch_id=p.branch_id, info=p.info)
            snap = p.snapshot
        else:
            snap = None
        if snapshots and snap is not None:
            rec["snapshot"] = base64.b64encode(snap.to_bytes()).decode("ascii")
        out.append(rec)
    return out


def write_jsonl(forest: Forest, path: str, *, snapshots: bool = True) -> int:
    """Write :func:`node_records` to ``path`` (one JSON object per line); returns the count."""
    records = node_records(forest, snapshots=snapshots)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)
    return len(records)


__all__ = [
    "EnvStep", "EnvStepResult", "EnvStepper", "Failure", "RolloutEngine", "run_env_step", "chat_renderer", "RolloutError", "RootRecord", "TokenSequence", "TurnRecord",
    "node_records", "node_text", "prefix_ids", "sequence", "write_jsonl",
]
