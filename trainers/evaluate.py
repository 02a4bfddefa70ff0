"""Held-out evaluation: mean@k and pass@k per env, through the same rollout engine as training.

For each of ``tasks`` held-out tasks the policy samples ``k`` complete episodes. mean@k is
the mean reward over all samples (accuracy when rewards are 0/1); pass@k is the share of
tasks with at least one success (for graded rewards: the mean of each task's best reward).
Also reported: the share of episodes that called a tool at least once, that ended with an
answer (rather than the turn limit or a parse-error loop), mean turns and generated tokens,
and each task's own mean reward over its ``k`` episodes (``per_task``, in task order: what a
comparison of two policies on the same tasks pairs).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Sequence

import numpy as np

from trace_gym.forest.forest import TRUNCATED, Forest
from trace_gym.policies.base import Policy, SamplingParams


def sample_episodes(policy: Policy, env: Any, tasks: Sequence[Any], k: int, params: SamplingParams) -> Forest:
    """``k`` complete episodes of each task in ``tasks`` with ``policy`` on ``env``, one tree per
    task in order; an episode the engine cannot finish stays recorded (no reward)."""
    from trace_gym.rollout.engine import RolloutEngine

    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    engine = RolloutEngine(env, policy, params, on_error="record")
    forest = Forest()
    roots = engine.add_roots(forest, list(tasks))
    engine.rollout(forest, np.repeat(roots, k))
    return forest


def episode_rewards(forest: Forest) -> np.ndarray:
    """Each trajectory's reward, 0 where the episode did not finish (turn limit, failure) or
    has no reward: the score mean@k averages."""
    leaves = forest.traj_leaf
    return np.where(forest.finished()[leaves], forest.reward[leaves], 0.0)


def task_scores(forest: Forest) -> np.ndarray:
    """Each tree's mean :func:`episode_rewards` over its episodes, in tree order (0 for a tree
    with none)."""
    tree = forest.tree[forest.traj_leaf]
    total = np.bincount(tree, weights=episode_rewards(forest), minlength=forest.n_trees)
    count = np.bincount(tree, minlength=forest.n_trees)
    return np.divide(total, count, out=np.zeros(forest.n_trees), where=count > 0)


def evaluate_env(policy: Policy, env: Any, tasks: Sequence[Any], k: int, params: SamplingParams) -> dict[str, Any]:
    """Roll out ``k`` episodes of each task in ``tasks`` with ``policy`` on ``env``; see the
    module docstring. Every figure is a float or int but ``per_task`` (a list of floats)."""
    from trace_gym.rollout.engine import TurnRecord

    t0 = time.perf_counter()
    forest = sample_episodes(policy, env, tasks, k, params)
    leaves = forest.traj_leaf
    reward = episode_rewards(forest)
    tree = forest.tree[leaves]
    best = np.zeros(forest.n_trees)
    np.maximum.at(best, tree, reward)
    called = np.zeros(forest.n_trajectories, dtype=bool)
    answered = np.zeros(forest.n_trajectories, dtype=bool)
    for node in range(len(forest)):
        rec = forest.payload[node]
        if isinstance(rec, TurnRecord):
            t = int(forest.traj[node])
            if int(rec.info.get("tool_calls", 0) or 0) > 0:
                called[t] = True
            if "answer" in rec.info:
                answered[t] = True
    truncated = (forest.flags[leaves] & TRUNCATED) != 0
    return {
        "mean@k": float(reward.mean()) if reward.size else 0.0,
        "pass@k": float(best.mean()) if best.size else 0.0,
        "tool_call_rate": float(called.mean()) if called.size else 0.0,
        "answer_rate": float(answered.mean()) if answered.size else 0.0,
        "truncated_rate": float(truncated.mean()) if truncated.size else 0.0,
        "turns": float(forest.depth[leaves].mean()) if leaves.size else 0.0,
        "tokens_per_episode": forest.counters["generated_tokens"] / max(1, forest.n_trajectories),
        "episodes": int(forest.n_trajectories),
        "tasks": int(forest.n_trees),
        "k": int(k),
        "failed": int(forest.counters.get("failed_trajectories", 0)),
        "seconds": time.perf_counter() - t0,
        "per_task": task_scores(forest).tolist(),
    }


def held_out_tasks(env: Any, n: int, *, split: str = "test", start: int = 0) -> list[Any]:
    """The first ``n`` tasks of ``split`` from index ``start`` (deterministic)."""
    src = env.tasks()
    n = min(int(n), int(src.size(split)) - start)
    return [src.get(start + i, split) for i in range(n)]


def env_labels(ids: Sequence[str]) -> list[str]:
    """One label per evaluated env, in order: its id where the id occurs once, else
    ``<id>#<n>`` (n from 1, in order), so that two specs of one env (say MathCalc's easy and hard
    levels) each keep their figures instead of the second overwriting the first."""
    counts = Counter(ids)
    seen: dict[str, int] = {}
    labels = []
    for i in ids:
        seen[i] = seen.get(i, 0) + 1
        labels.append(i if counts[i] == 1 else f"{i}#{seen[i]}")
    return labels
