"""``Step``: the one loop every result comes from.

One step, for any rollout source (the simulator's fast path, the rollout engine over real
envs and a policy):

1. **candidates**: the source adds the step's ``budget.prompts`` prompts as roots of a fresh
   forest (a function of (seed, step) alone: :func:`~trace_gym.task.candidate_indices`);
2. **stage 1 -> rollouts -> stage 2 -> rollouts**:
   :func:`~trace_gym.allocation.allocator.allocate_step` with the run's allocator and predictor;
3. **backup and advantages** under the run's estimator;
4. **metrics**: effective ratio, effective sample ratio under the run's estimator and under
   ``grpo`` and ``trace``, spend, rewards, how often branches turned a pure tree mixed
   (``branch/flip_rate``, ``branch/pure_trees_mixed``: :meth:`~trace_gym.forest.forest.Forest.branch_flips`;
   None in a step without such branches), the calibration of the predictions the allocator
   made before the outcomes were known;
5. **predictor update** on ``(history, V_hat)`` of every non-terminal node with finished leaves
   below it, weighted by its leaf count (its calibration on those nodes is measured first);
6. **policy update** when the step has a :class:`PolicyUpdate` (the trainer's optimizer step,
   ContrastLab's learning mode).

The bench, the leaderboard's tracks, ``trace-gym rollout``, ``trace-gym train`` and the
benchmarks all run this class, so one run spec gives the same numbers everywhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from trace_gym.allocation.budget import Spend
from trace_gym.allocation.allocator import allocate_step
from trace_gym.allocation.streaming import allocate_step_streaming
from trace_gym.allocation.prefix_evidence import BranchEvidence, branch_evidence
from trace_gym.forest.forest import TERMINAL, Forest
from trace_gym.predictors.calibration import calibration
from trace_gym.run import Resolved, RunSpec, resolve_run

__all__ = ["PolicyUpdate", "RolloutSource", "Step", "StepResult", "make_source", "DISAGREEMENT", "DISAGREEMENT_KINDS",
           "disagreement_metric", "disagreement_metrics"]

REPORTED_ADVANTAGES = ("grpo", "trace")
"""Estimators whose effective sample ratios every step reports beside the run's own, so rows
with different estimators can be compared."""


class RolloutSource(Protocol):
    """Where a step's prompts and rollouts come from."""

    def add_candidates(self, forest: Forest, step: int, n: int) -> None:
        """Add the ``n`` candidate prompts of ``step`` as roots of ``forest`` (a function of
        the source's seed and ``step`` only)."""

    def rollout(self, forest: Forest, origins: np.ndarray) -> None:
        """Start a trajectory at each node of ``origins`` and run all of them to their end."""


class PolicyUpdate(Protocol):
    """What learns from a step's forest (the trainer's optimizer step, the simulator's
    learning mode). Returns metrics to log."""

    def __call__(self, forest: Forest, advantages: np.ndarray) -> dict[str, Any]: ...


@dataclass
class StepResult:
    """One step: its forest (backed up), what was spent, the advantages and the metrics.
    ``predictions``/``truths`` are the allocator's predictions of this step and what they are
    scored against (the exact V where the env knows it, else the backed-up value)."""

    step: int
    forest: Forest
    spend: Spend
    advantages: np.ndarray
    metrics: dict[str, Any]
    predictions: np.ndarray = field(default_factory=lambda: np.zeros(0))
    truths: np.ndarray = field(default_factory=lambda: np.zeros(0))
    weights: np.ndarray = field(default_factory=lambda: np.zeros(0))


class Step:
    """Runs steps of one run: ``Step(source, resolved, prompts)``, or
    :meth:`from_spec` to build everything from a :class:`~trace_gym.run.RunSpec`.

    ``update``, when given, is called with each step's forest and advantages after the
    predictor update. ``update_predictor=False`` keeps the predictor frozen.

    ``streaming=True`` rolls out trajectory by trajectory instead of in waves, and starts a
    prompt's stage 2 when its own stage 1 is done
    (:func:`~trace_gym.allocation.streaming.allocate_step_streaming`, with ``stream_share`` of
    the stage-2 budget planned per prompt); the source must offer ``stream(forest)`` (the
    rollout engine's :class:`~trace_gym.rollout.source.EngineSource` does).
    """

    def __init__(self, source: RolloutSource, resolved: Resolved, prompts: int, *, update: PolicyUpdate | None = None,
                 update_predictor: bool = True, streaming: bool = False, stream_share: float = 1.0):
        self.source = source
        self.allocator = resolved.allocator
        self.predictor = resolved.predictor
        self.advantage = resolved.advantage
        self.budget = resolved.budget
        self.resolved = resolved
        self.prompts = prompts
        self.update = update
        self.update_predictor = update_predictor
        if streaming and not hasattr(source, "stream"):
            raise ValueError(f"streaming needs a source that can stream trajectories; {type(source).__name__} cannot "
                             "(the simulator's fast path runs whole steps at once: use the sim policy with fast=false)")
        self.streaming = bool(streaming)
        self.stream_share = float(stream_share)

    @classmethod
    def from_spec(cls, spec: RunSpec, source: RolloutSource | None = None, **kwargs: Any) -> "Step":
        """A step for ``spec``; ``source`` defaults to :func:`make_source` of the spec."""
        return cls(source if source is not None else make_source(spec), resolve_run(spec), spec.budget.prompts, **kwargs)

    def run(self, step: int) -> StepResult:
        """Run step number ``step`` (0-based; it picks the candidates and sampling seeds)."""
        t_step = time.perf_counter()
        forest = Forest(capacity=max(1024, 8 * self.budget.trajectories))
        self.source.add_candidates(forest, step, self.prompts)
        t_roll = [0.0]

        def rollout(f: Forest, origins: np.ndarray) -> None:
            t0 = time.perf_counter()
            self.source.rollout(f, origins)
            t_roll[0] += time.perf_counter() - t0

        t0 = time.perf_counter()
        if self.streaming:
            stream = self.source.stream(forest)  # type: ignore[attr-defined]
            try:
                spend = allocate_step_streaming(forest, self.allocator, self.budget, self.predictor, stream, share=self.stream_share)
            finally:
                stream.close()
            t_roll[0] = time.perf_counter() - t0  # rollouts and planning overlap: all of it counts as rollout time
        else:
            spend = allocate_step(forest, self.allocator, self.budget, self.predictor, rollout)
        t_alloc = time.perf_counter() - t0 - t_roll[0]
        if spend.trajectories > self.budget.trajectories:  # allocate_step checks plans; this checks the outcome
            raise RuntimeError(f"allocator {self.allocator.name!r} spent {spend.trajectories} > {self.budget.trajectories} trajectories")

        t0 = time.perf_counter()
        forest.backup()
        adv = forest.advantages(self.advantage.name, **self.advantage.kwargs)
        metrics = forest_metrics(forest, adv, spend)
        for name in REPORTED_ADVANTAGES:
            a = adv if (name == self.advantage.name and not self.advantage.kwargs) else forest.advantages(name)
            traj, tok = forest.effective_sample_ratio(a)
            metrics[f"effective_sample_ratio/{name}"] = traj
            metrics[f"effective_token_ratio/{name}"] = tok
        preds, truths, weights = allocator_predictions(forest)
        metrics.update(_calibration("calibration/", preds, truths, weights))
        t_adv = time.perf_counter() - t0

        t0 = time.perf_counter()
        if self.predictor is not None and self.update_predictor:
            metrics.update(update_predictor(self.predictor, forest))
        t_pred = time.perf_counter() - t0

        t_upd = 0.0
        if self.update is not None:
            t0 = time.perf_counter()
            metrics.update(self.update(forest, adv))
            t_upd = time.perf_counter() - t0
        metrics.update({"time/rollout": t_roll[0], "time/allocator": t_alloc, "time/advantages": t_adv,
                        "time/predictor": t_pred, "time/update": t_upd, "time/step": time.perf_counter() - t_step})
        return StepResult(step, forest, spend, adv, metrics, preds, truths, weights)


# ----------------------------------------------------------------------------- metrics


def forest_metrics(forest: Forest, adv: np.ndarray, spend: Spend) -> dict[str, Any]:
    """What a step's forest shows: effective ratios under ``adv``, rewards, spend, shape."""
    traj_ratio, token_ratio = forest.effective_sample_ratio(adv)
    leaves = forest.leaves()
    rewards = forest.reward[leaves]
    rewards = rewards[~np.isnan(rewards)]
    c = forest.counters
    depth = forest.depth[leaves]
    hist = np.bincount(depth, minlength=int(depth.max()) + 1 if depth.size else 1)
    origins = forest.traj_origin[: forest.n_trajectories]
    branch_depth = forest.depth[origins[forest.parent[origins] >= 0]]
    flips = forest.branch_flips()
    return {
        "effective_ratio": forest.effective_ratio(),
        "effective_sample_ratio": traj_ratio,
        "effective_token_ratio": token_ratio,
        "reward/mean": float(rewards.mean()) if rewards.size else 0.0,
        "reward/std": float(rewards.std()) if rewards.size else 0.0,
        "advantage/nonzero_nodes": float(np.mean(adv[forest.parent >= 0] != 0)) if len(forest) > forest.n_trees else 0.0,
        "spent/trajectories": int(spend.trajectories),
        "spent/generated_tokens": int(c.get("generated_tokens", 0)),
        "spent/prefill_tokens": int(c.get("prefill_tokens", 0)),
        "spent/reused_prefix_tokens": int(c.get("reused_prefix_tokens", 0)),
        "spent/tool_calls": int(c.get("tool_calls", 0)),
        "spent/failed_trajectories": int(c.get("failed_trajectories", 0)),
        "spent/prompts": int(spend.prompts),
        "spent/roots": int(spend.roots),
        "branches": int(spend.branches),
        "branch_depth_mean": float(branch_depth.mean()) if branch_depth.size else 0.0,
        "branch/flip_rate": flips["flipped"] / flips["branches"] if flips["branches"] else None,
        "branch/pure_trees_mixed": flips["trees_mixed"] / flips["trees"] if flips["trees"] else None,
        **disagreement_metrics(branch_evidence(forest)),
        "leaf_depth_mean": float(depth.mean()) if depth.size else 0.0,
        "depth_hist": hist.tolist(),
    }


DISAGREEMENT_KINDS = ("root", "inner")
"""The prefixes :func:`disagreement_metrics` reports apart: ``root``, fresh rollouts of a
still-pure prompt; ``inner``, continuations of a pure turn-level prefix."""

DISAGREEMENT = tuple((kind, what) for kind in DISAGREEMENT_KINDS for what in ("pred", "seen"))
"""The ``(kind, what)`` of the metrics of :func:`disagreement_metrics`, named by
:func:`disagreement_metric`."""


def disagreement_metric(kind: str, what: str) -> str:
    """The step metric of stage 2's calibration for ``kind`` (one of ``DISAGREEMENT_KINDS``)
    and ``what`` (``"pred"``: predicted, ``"seen"``: measured): ``branch/{kind}_disagree_{what}``."""
    return f"branch/{kind}_disagree_{what}"


def disagreement_metrics(evidence: BranchEvidence) -> dict[str, float | None]:
    """Stage 2's calibration, from a step's continuations started from pure prefixes: the
    share of them that ended with another outcome than the prefix had shown
    (``branch/{root,inner}_disagree_seen``) against the predictor's chance of it
    (``..._pred``, ``1 - (r v + (1 - r)(1 - v))``, what the paper's stage 2 maximises on);
    ``root``: fresh rollouts of a still-pure prompt, ``inner``: continuations of a turn-level
    prefix. None where the step has no such continuation."""
    out: dict[str, float | None] = {}
    for kind, mask in zip(DISAGREEMENT_KINDS, (evidence.depth == 0, evidence.depth > 0)):
        t = evidence.t[mask]
        total = float(t.sum())
        out[disagreement_metric(kind, "pred")] = float(np.dot(1.0 - evidence.agree[mask], t) / total) if total else None
        out[disagreement_metric(kind, "seen")] = float(evidence.s[mask].sum() / total) if total else None
    return out


def allocator_predictions(forest: Forest) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(predictions, truths, weights)``: every prediction the allocator wrote to
    ``forest.pred`` this step, against the env's exact success probability where it knows it
    (weight 1: the expected scores over outcomes), else the backed-up value of the node
    (weighted by its leaves)."""
    seen = np.flatnonzero(np.isfinite(forest.pred))
    if seen.size and np.isfinite(forest.oracle[seen]).all():
        return np.clip(forest.pred[seen], 0, 1), np.clip(forest.oracle[seen], 0, 1), np.ones(seen.size)
    seen = seen[forest.n_leaves[seen] > 0]
    return np.clip(forest.pred[seen], 0, 1), np.clip(forest.value[seen], 0, 1), forest.n_leaves[seen].astype(np.float64)


def _calibration(prefix: str, pred: np.ndarray, truth: np.ndarray, weight: np.ndarray) -> dict[str, float | None]:
    if pred.size == 0:
        return {f"{prefix}{k}": None for k in ("brier", "ece", "auc")}
    cal = calibration(pred, truth, weight)
    return {f"{prefix}{k}": (None if v is None or not np.isfinite(v) else float(v)) for k, v in cal.items() if k in ("brier", "ece", "auc")}


def update_predictor(predictor: Any, forest: Forest) -> dict[str, Any]:
    """Train ``predictor`` on the forest's ``(history, V_hat)`` pairs (non-terminal nodes with
    finished leaves, weighted by their leaf count); returns its calibration on those nodes
    measured before the update (``predictor/...``: data it has not seen)."""
    nodes = np.flatnonzero(((forest.flags & TERMINAL) == 0) & (forest.n_leaves > 0))
    if nodes.size == 0:
        return {}
    hist = forest.histories(nodes, oracle=bool(getattr(predictor, "reads_oracle", False)))  # true values: oracles only
    target = forest.value[nodes].astype(np.float64)
    weight = forest.n_leaves[nodes].astype(np.float64)
    before = np.clip(np.asarray(predictor.predict(hist), dtype=np.float64), 0.0, 1.0)
    out = _calibration("predictor/", before, target, weight)
    roots = forest.parent[nodes] < 0
    if roots.any():
        out.update(_calibration("predictor/root_", before[roots], target[roots], weight[roots]))
    predictor.update(hist, target, weight)
    out["predictor/pairs"] = int(nodes.size)
    return out


# ----------------------------------------------------------------------------- sources


def make_source(spec: RunSpec, *, policy: Any = None, progress: Any = None, workers: int = 0, engines: int = 0,
                actor_cpus: float = 1.0) -> RolloutSource:
    """The rollout source of a run: the simulator's fast path for the ``sim`` policy on
    ContrastLab (without a tool latency, workers or engines), else the rollout engine over the
    run's envs with its policy (``policy`` overrides building it from ``spec.policy``).
    ``workers``: env steps in that many Ray actors; ``engines``: the policy in that many Ray
    actors behind an :class:`~trace_gym.rollout.router.EngineRouter`; each actor reserves
    ``actor_cpus`` CPUs."""
    from trace_gym.sim.env import ContrastLabEnv

    if spec.policy.name == "sim" and policy is None and len(spec.envs) == 1 and spec.envs[0].id == ContrastLabEnv.env_id \
            and spec.policy.kwargs.get("fast", True) and not spec.envs[0].kwargs.get("tool_latency_s") and not (workers or engines):
        from trace_gym.sim.source import SimSource

        return SimSource(spec.envs[0].kwargs, seed=spec.seed)
    from trace_gym.policies.base import SamplingParams, make_policy
    from trace_gym.rollout.source import EngineSource, build_envs

    envs = build_envs(spec.envs, spec.seed)
    if policy is None:
        kwargs = {k: v for k, v in spec.policy.kwargs.items() if k not in SAMPLING_KEYS + ("fast",)}
        if spec.policy.name == "sim":
            kwargs.setdefault("world", getattr(envs[0], "world", None))
            kwargs.setdefault("seed", spec.seed)
        if engines:
            from trace_gym.rollout.router import EngineRouter

            policy = EngineRouter.on_ray(spec.policy.name, kwargs, engines, num_cpus=actor_cpus)
        else:
            policy = make_policy(spec.policy.name, **kwargs)
    sampling = {k: spec.policy.kwargs[k] for k in SAMPLING_KEYS if k in spec.policy.kwargs}
    return EngineSource(envs, policy, SamplingParams(**sampling), seed=spec.seed, weights=[e.weight for e in spec.envs],
                        progress=progress, workers=workers, worker_options={"num_cpus": actor_cpus})


SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p")
"""Policy options that are sampling settings (:class:`~trace_gym.policies.base.SamplingParams`), not backend arguments."""
