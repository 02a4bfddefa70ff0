"""The rollout engine: stage-1 and stage-2 plans on real envs, exact token prefixes for
every branch, env replay, accounting, failure reporting, JSONL output and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

import trace_gym
from trace_gym.allocation.budget import Budget
from trace_gym.forest.forest import Forest
from trace_gym.policies.base import Generation, Policy, SamplingParams, make_policy
from trace_gym.rollout.engine import (
    RolloutEngine, RolloutError, RootRecord, TurnRecord, node_records, prefix_ids, sequence, write_jsonl,
)

from rollout_checks import Recording, check_accounting, check_exact_prefixes, check_replay, check_step_ignores_earlier_generations
from shared_smollm2 import smollm2_path, smollm2_policy


# ----------------------------------------------------------------------------- real model


@pytest.mark.slow
@pytest.mark.parametrize("env_id,n_prompts", [("trace_gym/MathCalc-v0", 2), ("trace_gym/ToolCalls-v0", 1)])
def test_smollm2_stage1_and_stage2_branch_from_exact_prefixes(env_id, n_prompts):
    env_kwargs = {"seed": 0, "max_turns": 2}
    env = trace_gym.make(env_id, **env_kwargs)
    policy = Recording(smollm2_policy())
    engine = RolloutEngine(env, policy, SamplingParams(max_new_tokens=16, temperature=1.0, seed=0))
    forest = Forest()
    tasks = [env.tasks().get(i) for i in range(n_prompts)]
    roots = engine.add_roots(forest, tasks)
    for r, task in zip(roots, tasks):  # a root's ids are the policy's rendering of the env's opening chat
        rec = forest.payload[r]
        assert rec.token_ids == policy.render_prompt(rec.messages, rec.tools) and rec.task == task

    spend = engine.step(forest, "uniform", Budget(trajectories=4 * n_prompts, root_fraction=0.5, min_per_prompt=2))
    assert spend.roots == 2 * n_prompts and spend.branches == 2 * n_prompts
    assert forest.n_trajectories == 4 * n_prompts
    assert check_exact_prefixes(forest, policy) == 2 * n_prompts
    check_replay(env_id, env_kwargs, forest)
    check_accounting(forest, policy)
    assert forest.counters["reused_prefix_tokens"] > forest.counters["prefill_tokens"]  # branches reuse their prefix's KV
    # one batched call per wave: stage 1 has at most max_turns waves, and so does stage 2
    assert len(policy.calls) <= 2 * env.max_turns
    # the trainer's view of a trajectory: prompt + spans, loss on policy tokens only
    leaf = int(forest.leaves()[0])
    seq = sequence(forest, leaf)
    assert seq.ids.tolist() == prefix_ids(forest, leaf)
    assert int(seq.mask.sum()) == sum(int(forest.n_tokens[i]) for i in forest.path(leaf))
    assert set(np.unique(seq.node[seq.mask == 1])) == set(forest.path(leaf))


@pytest.mark.slow
def test_a_step_replays_exactly_whatever_the_policy_generated_before():
    policy = smollm2_policy()
    check_step_ignores_earlier_generations(policy)
    assert len(policy.store) > 0  # the other generations did leave entries behind


# ----------------------------------------------------------------------------- scripted tool use


class Demonstrator(Policy):
    """Plays ``env.demonstrate(task)`` turn by turn through a real tokenizer's chat template,
    so trajectories reach tool states that a zero-shot model never does."""

    name = "demonstrator"

    def __init__(self, env, tasks):
        from trace_gym.policies.chat import ChatTemplate
        from transformers import AutoTokenizer

        self.chat = ChatTemplate(AutoTokenizer.from_pretrained(smollm2_path()))
        self.script = {}
        for task in tasks:
            _, info = env.reset(options={"task": task})
            self.script[tuple(self.render_prompt(info["messages"], info["tools"]))] = env.demonstrate(task)

    def generate(self, prompts, params):
        out = []
        header = self.chat.encode("<|im_start|>assistant\n")
        for p in prompts:
            root = next(k for k in self.script if tuple(p[: len(k)]) == k)
            turn = sum(1 for j in range(len(p)) if p[j: j + len(header)] == header) - 1
            ids = self.chat.encode(self.script[root][turn]) + [self.chat.eot_id]
            out.append(Generation(ids, [-0.5] * len(ids), self.chat.decode(ids), "stop"))
        return out

    def render_prompt(self, messages, tools=None):
        return self.chat.render_prompt(messages, tools)

    def render_observation(self, observation, *, role="tool", closed=True):
        return self.chat.render_observation(observation, role=role, closed=closed)

    def decode(self, token_ids):
        return self.chat.decode(token_ids)


@pytest.mark.slow
def test_branches_restore_tool_state_and_replay_exactly():
    env_kwargs = {"seed": 0}
    env = trace_gym.make("trace_gym/ToolCalls-v0", **env_kwargs)
    tasks = [env.tasks().get(i) for i in (1, 3)]  # 4 and 11 demonstration turns, the second over two user turns
    policy = Recording(Demonstrator(env, tasks))
    engine = RolloutEngine(env, policy, SamplingParams(max_new_tokens=256))
    forest = Forest()
    roots = engine.add_roots(forest, tasks)
    engine.rollout(forest, roots)
    assert np.all(forest.reward[forest.leaves()] == 1.0)  # the demonstrations succeed
    assert forest.counters["tool_calls"] > 0
    # branch from every inner node: each continuation must see the tools' state at that node
    inner = forest.branchable()
    engine.rollout(forest, np.repeat(inner, 2))
    assert forest.n_trajectories == 2 + 2 * len(inner)
    assert np.all(forest.reward[forest.leaves()] == 1.0)
    assert check_exact_prefixes(forest, policy) == 2 * len(inner)
    check_replay("trace_gym/ToolCalls-v0", env_kwargs, forest)
    users = [i for i in range(len(forest)) if isinstance(forest.payload[i], TurnRecord) and forest.payload[i].role == "user"]
    assert users  # the follow-up request arrived as a user message
    rec = forest.payload[users[0]]
    tail = policy.decode(rec.token_ids[rec.n_generated:])
    assert "Next, please do the following" in tail


# ----------------------------------------------------------------------------- sim policy, failures, JSONL


def sim_engine(**kwargs):
    env = trace_gym.make("trace_gym/ContrastLab-v0", seed=0)
    policy = Recording(make_policy("sim", world=env.world))
    return env, policy, RolloutEngine(env, policy, SamplingParams(max_new_tokens=64, seed=1), **kwargs)


def test_sim_policy_runs_through_the_same_engine_path():
    env, policy, engine = sim_engine()
    forest = Forest()
    engine.add_roots(forest, [env.tasks().get(i) for i in range(6)])
    spend = engine.step(forest, "trace", Budget(trajectories=32, root_fraction=0.5), trace_gym.make_predictor("hashed"))
    assert spend.trajectories == forest.n_trajectories == 32 and spend.branches > 0
    assert check_exact_prefixes(forest, policy) == spend.branches
    check_replay("trace_gym/ContrastLab-v0", {"seed": 0}, forest)
    check_accounting(forest, policy)
    leaves = forest.leaves()
    assert np.all(np.isfinite(forest.oracle[leaves])) and set(np.unique(forest.reward[leaves])) <= {0.0, 1.0}
    assert 0.0 <= forest.effective_ratio() <= 1.0


def test_roots_added_by_task_id_and_the_context_limit():
    """Roots from plain ``Forest.add_root`` are rendered on first use; a trajectory with no
    room for another turn ends in a truncated leaf with reward 0."""
    env = trace_gym.make("trace_gym/ContrastLab-v0", seed=0)
    policy = make_policy("sim", world=env.world)
    task = env.tasks().get(0)
    forest = Forest()
    root = forest.add_root(task.id, task.prompt)
    engine = RolloutEngine(env, policy, SamplingParams(max_new_tokens=64, seed=0))
    first = len(engine.renderer.render_prompt(env.reset(options={"task": task})[1]["messages"]))
    policy.max_context_tokens = first + 64 + 20  # room for one turn only
    engine.rollout(forest, [root, root])
    assert isinstance(forest.payload[root], RootRecord) and forest.payload[root].task == task
    for leaf in forest.leaves():
        rec = forest.payload[leaf]
        assert forest.depth[leaf] == 2 and rec.finish_reason == "context" and rec.truncated and forest.reward[leaf] == 0.0
        assert rec.n_generated == 0 and forest.n_tokens[leaf] == 0


def test_node_records_and_jsonl_keep_every_node(tmp_path):
    env, policy, engine = sim_engine()
    forest = Forest()
    roots = engine.add_roots(forest, [env.tasks().get(i) for i in range(3)])
    engine.rollout(forest, np.repeat(roots, 2))
    path = tmp_path / "trees.jsonl"
    assert write_jsonl(forest, str(path)) == len(forest)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["node"] for r in records] == list(range(len(forest)))
    by_id = {r["node"]: r for r in records}
    for r in records:
        if r["parent"] >= 0:
            ids, node = [], r["node"]
            while node >= 0:
                ids = by_id[node]["token_ids"] + ids
                node = by_id[node]["parent"]
            assert ids == prefix_ids(forest, r["node"])
            assert sum(r["mask"]) == r["n_tokens"]
    from trace_gym.env.base import EnvSnapshot
    import base64

    snap = EnvSnapshot.from_bytes(base64.b64decode(records[-1]["snapshot"]))
    assert snap == forest.payload[len(forest) - 1].snapshot
    assert all("snapshot" not in r for r in node_records(forest, snapshots=False))


def test_a_dead_server_fails_clearly_and_keeps_the_trees():
    """Every turn fails (nothing listens on the port): the engine reports each trajectory
    with the reason and leaves the forest consistent."""
    env = trace_gym.make("trace_gym/MathCalc-v0", seed=0)
    policy = make_policy("openai", base_url="http://127.0.0.1:9/v1", tokenizer=smollm2_path(), max_retries=1, backoff=0.01, timeout=5)
    engine = RolloutEngine(env, policy, SamplingParams(max_new_tokens=8))
    forest = Forest()
    roots = engine.add_roots(forest, [env.tasks().get(0), env.tasks().get(1)])
    with pytest.raises(RolloutError, match="could not be finished") as info:
        engine.rollout(forest, np.repeat(roots, 2))
    assert len(info.value.failures) == 4 and "ConnectError" in info.value.failures[0].error
    assert forest.counters["failed_trajectories"] == 4 and forest.n_trajectories == 4
    assert len(forest) == 2 and all(isinstance(forest.payload[r], RootRecord) for r in roots)
    recorded = RolloutEngine(env, policy, SamplingParams(max_new_tokens=8), on_error="record")
    recorded.rollout(forest, roots)
    assert len(recorded.failures) == 2 and forest.counters["failed_trajectories"] == 6


def test_branching_needs_engine_nodes():
    env, _, engine = sim_engine()
    forest = Forest()
    root = forest.add_root("x")
    traj = forest.start_trajectory(root)
    node = forest.add_node(traj, text="a turn from elsewhere")
    with pytest.raises(ValueError, match="not generated by a RolloutEngine"):
        engine.rollout(forest, [node])


def test_rollout_cli_writes_one_record_per_node(tmp_path, capsys):
    from trace_gym.cli.main import main

    out = tmp_path / "trees.jsonl"
    code = main(["rollout", "ContrastLab-v0", "--policy", "sim", "--allocator", "trace", "--trajectories", "16", "--prompts", "4",
                 "--out", str(out)])
    assert code == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sum(r["parent"] < 0 for r in records) == 4
    assert len({r["traj"] for r in records if r["traj"] >= 0}) == 16
    assert all(r["token_ids"] for r in records)  # token-level trees from the rollout engine
    err = capsys.readouterr().err
    assert "rollout" in err and '"effective_ratio"' in err and '"trajectories": 16' in err


@pytest.mark.slow
def test_rollout_cli_with_smollm2(tmp_path, capsys):
    from trace_gym.cli.main import main

    out = tmp_path / "trees.jsonl"
    code = main(["rollout", "MathCalc-v0", "--model", smollm2_path(), "--allocator", "grpo", "--trajectories", "4", "--prompts", "2",
                 "--max-new-tokens", "8", "--max-turns", "1", "--out", str(out), "--no-snapshots"])
    assert code == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 + 4 and all("snapshot" not in r for r in records)
    assert all(r["terminal"] for r in records if r["parent"] >= 0)
    assert "effective_ratio" in capsys.readouterr().err
