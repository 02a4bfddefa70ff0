"""Checks shared by the rollout-engine tests: a recording wrapper around a real policy, the
exact-prefix, replay and accounting checks a finished forest must pass, and the check that a
step does not depend on what its policy generated before it."""

from __future__ import annotations

from typing import Any

import numpy as np

import trace_gym
from trace_gym.forest.forest import BRANCH, TERMINAL, Forest
from trace_gym.policies.base import Generation, Policy, SamplingParams
from trace_gym.rollout.engine import RootRecord, TurnRecord, chat_renderer, prefix_ids


class Recording(Policy):
    """Passes every call to a real policy and records what it was asked and what it produced."""

    def __init__(self, inner: Policy):
        self.inner = inner
        self.renderer = chat_renderer(inner)
        self.name = inner.name
        self.calls: list[tuple[list[list[int]], list[Generation]]] = []

    def generate(self, prompts, params):
        gens = self.inner.generate(prompts, params)
        self.calls.append(([list(p) for p in prompts], gens))
        return gens

    def render_prompt(self, messages, tools=None):
        return self.renderer.render_prompt(messages, tools)

    def render_observation(self, observation, *, role="tool", closed=True):
        return self.renderer.render_observation(observation, role=role, closed=closed)

    def decode(self, token_ids):
        return self.inner.decode(token_ids)

    def seen(self) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(prompt ids, generated ids) of every generation."""
        return {(tuple(p), tuple(g.token_ids)) for prompts, gens in self.calls for p, g in zip(prompts, gens)}


def trajectory_nodes(forest: Forest, t: int) -> list[int]:
    return [int(i) for i in np.flatnonzero(forest.traj == t)]


def check_exact_prefixes(forest: Forest, policy: Recording) -> int:
    """Every node was generated from exactly the ids of its parent's prefix, and a branch's
    first prompt is its origin's prefix, which its origin's own continuation also extends.
    Returns the number of branches checked."""
    seen = policy.seen()
    branches = 0
    for i in range(len(forest)):
        rec = forest.payload[i]
        if not isinstance(rec, TurnRecord):
            continue
        parent = int(forest.parent[i])
        ids = prefix_ids(forest, parent)
        assert rec.prefix_len == len(ids)
        assert (tuple(ids), tuple(rec.token_ids[: rec.n_generated])) in seen, f"node {i} was not generated from its parent's exact ids"
        assert rec.mask == [1] * rec.n_generated + [0] * (len(rec.token_ids) - rec.n_generated)
        # behaviour log-probs are <= 0 (NaN where a text-only server gives none); 0 off-policy
        assert not any(lp > 0.0 for lp in rec.logprobs[: rec.n_generated]) and not any(rec.logprobs[rec.n_generated:])
        if forest.flags[i] & BRANCH:
            branches += 1
            for sibling in np.flatnonzero(forest.parent == parent):
                assert prefix_ids(forest, int(sibling))[: len(ids)] == ids
    return branches


def check_replay(env_id: str, env_kwargs: dict[str, Any], forest: Forest) -> None:
    """Each trajectory's observations and rewards are reproduced by a fresh env restored
    from the origin's snapshot (with the branch id) and stepped with the same actions."""
    env = trace_gym.make(env_id, **env_kwargs)
    for t in range(forest.n_trajectories):
        nodes = trajectory_nodes(forest, t)
        if not nodes:
            continue
        origin = forest.payload[int(forest.traj_origin[t])]
        env.restore(origin.snapshot, branch_id=forest.payload[nodes[0]].branch_id)
        for i in nodes:
            rec = forest.payload[i]
            obs, reward, terminated, truncated, _ = env.step(rec.action)
            assert obs == rec.observation
            assert terminated == rec.terminated and (truncated and not terminated) == rec.truncated
            if terminated or truncated:
                assert reward == forest.reward[i]
        assert bool(forest.flags[nodes[-1]] & TERMINAL)


def check_accounting(forest: Forest, policy: Recording) -> None:
    c = forest.counters
    gens = [(p, g) for prompts, gens in policy.calls for p, g in zip(prompts, gens)]
    assert c["trajectories"] == forest.n_trajectories
    assert c["generated_tokens"] == sum(len(g.token_ids) for _, g in gens) == int(forest.n_tokens.sum())
    assert c["prefill_tokens"] + c["reused_prefix_tokens"] == sum(len(p) for p, _ in gens)
    assert c["failed_trajectories"] == 0


def check_step_ignores_earlier_generations(policy: Policy) -> None:
    """A leaderboard track's rows share one policy, so a step must not depend on what the
    policy's prefix cache kept from before it: step 0 of a small trace run, then other
    generations of the same opening prompts (which leave their KV behind, from other
    batches), then the same step again must give the same forest: tokens, shape, counters."""
    from trace_gym.rollout.source import EngineSource
    from trace_gym.run import RunSpec
    from trace_gym.step import Step

    env_kwargs = {"levels": [1], "max_turns": 2}
    spec = RunSpec(envs=[{"id": "trace_gym/MathCalc-v0", "kwargs": env_kwargs}], policy=policy.name, allocator="trace",
                   budget={"trajectories": 8, "prompts": 4, "group_size": 4}, seed=0)

    def step_zero() -> Forest:
        env = trace_gym.make("trace_gym/MathCalc-v0", seed=0, **env_kwargs)
        source = EngineSource([env], policy, SamplingParams(max_new_tokens=16, temperature=1.0), seed=0)
        return Step.from_spec(spec, source=source).run(0).forest

    def key(forest: Forest):
        spans = [tuple(p.token_ids) for p in forest.payload[: len(forest)] if isinstance(p, TurnRecord)]
        return spans, forest.parent[: len(forest)].tolist(), dict(forest.counters)

    policy.reset_cache()
    first = step_zero()
    openings = [list(r.token_ids) for r in first.payload[: len(first)] if isinstance(r, RootRecord)]
    policy.generate(openings[::-1] * 2, SamplingParams(max_new_tokens=16, temperature=1.0, seed=99))
    again = step_zero()
    assert key(again) == key(first)
    assert again.fingerprint() == first.fingerprint()  # what a leaderboard record keeps of the step
    assert again.counters["reused_prefix_tokens"] > 0  # the step still reuses its own prefixes
