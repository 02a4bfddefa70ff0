"""ToolCalls-v0: procedural multi-turn function calling with state-checked success."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trace_gym
from trace_gym.env.base import EnvSnapshot
from trace_gym.envs import toolcalls as TC
from trace_gym.env.react import format_answer, format_tool_call


@pytest.fixture(scope="module")
def env():
    return trace_gym.make("trace_gym/ToolCalls-v0")


def run(env, task, actions):
    env.reset(options={"task": task})
    out = []
    for a in actions:
        out.append(env.step(a))
        if out[-1][2] or out[-1][3]:
            break
    return out


def test_tasks_are_deterministic_in_seed_index_split():
    a, b = TC.ToolCallsTasks(seed=0), TC.ToolCallsTasks(seed=0)
    assert a.get(17, "train") == b.get(17, "train")
    assert a.get(17, "train") != a.get(17, "test") != a.get(18, "test")
    assert a.get(17, "train") != TC.ToolCallsTasks(seed=1).get(17, "train")
    env1, env2 = trace_gym.make("trace_gym/ToolCalls-v0", seed=5), trace_gym.make("trace_gym/ToolCalls-v0", seed=5)
    assert env1.reset(seed=9) == env2.reset(seed=9)
    assert env1.reset(options={"task_id": "toolcalls/validation/3"})[1]["task_id"] == "toolcalls/validation/3"


def test_difficulty_is_graded():
    src = TC.ToolCallsTasks(seed=0)
    stats = {}
    for d in TC.DIFFICULTIES:
        tasks = [TC.ToolCallsTasks(seed=0, difficulty=d).get(i, "train") for i in range(60)]
        calls = [sum(len(p) for p in TC.solve(t.metadata["world"], t.metadata["goals"])[0]) for t in tasks]
        lookups = [sum(g["kind"] in TC._LEVELS[2] + TC._LEVELS[3] for g in t.metadata["goals"]) for t in tasks]
        stats[d] = (np.mean([len(t.metadata["goals"]) for t in tasks]), np.mean(calls), np.mean(lookups),
                    max(len(t.metadata["user_turns"]) for t in tasks))
        assert all(t.metadata["difficulty"] == d for t in tasks)
    goals, calls, lookups, turns = zip(*(stats[d] for d in TC.DIFFICULTIES))
    assert list(goals) == [1, 2, 3, 4]
    assert all(x < y for x, y in zip(calls, calls[1:])) and lookups[0] == 0 and lookups[1] >= 1
    assert turns == (1, 1, 1, 2)
    assert [src.get(i).metadata["difficulty"] for i in range(8)] == [1, 2, 3, 4, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        TC.ToolCallsTasks(difficulty=7)


def test_demonstrate_earns_reward_on_100_tasks(env):
    for i in range(100):
        task = env.tasks().get(i, "test")
        out = run(env, task, env.demonstrate(task))
        obs, reward, terminated, truncated, info = out[-1]
        assert terminated and reward == 1.0 and info["goal_reached"], task.id
        assert not any(o[0].startswith("Error") for o in out), task.id
        roles = [o[4]["role"] for o in out]
        assert roles.count("user") == len(task.metadata["user_turns"]) - 1


def test_success_is_the_world_state_not_the_words(env):
    failures = {"skip": 0, "extra": 0, "answer_only": 0}
    for i in range(40):
        task = env.tasks().get(i, "train")
        demo = env.demonstrate(task)
        calls = [k for k, a in enumerate(demo) if a.startswith("<tool_call>") and ('"name": "get_' not in a and '"name": "find_' not in a and '"name": "list_' not in a)]
        # Skipping the last state-changing call leaves the world short of the goal.
        failures["skip"] += run(env, task, [a for k, a in enumerate(demo) if k != calls[-1]])[-1][1] == 0.0
        # One extra side effect (a stray transfer) spoils it too.
        people = [p for p in task.metadata["world"]["accounts"] if p != TC.SHOP]
        stray = format_tool_call("transfer", {"source": TC.SHOP, "target": people[0], "amount": 1})
        failures["extra"] += run(env, task, [stray] + demo)[-1][1] == 0.0
        # Claiming success without acting earns nothing, whatever the answer says.
        answers = [format_answer("Done. All requests completed successfully.")] * len(task.metadata["user_turns"])
        failures["answer_only"] += run(env, task, answers)[-1][1] == 0.0
        # Read-only lookups do not matter: extra ones keep the reward.
        assert run(env, task, [format_tool_call("list_accounts", {})] + demo)[-1][1] == 1.0
    assert failures == {"skip": 40, "extra": 40, "answer_only": 40}


def test_events_are_compared_without_their_ids(env):
    task = next(t for t in (env.tasks().get(i, "train") for i in range(200)) if t.metadata["goals"][0]["kind"] == "create_event"
                and len(t.metadata["goals"]) == 1)
    g = task.metadata["goals"][0]
    detour = [format_tool_call("create_event", {"title": "oops", "day": 1, "hour": 9, "attendees": []})]
    detour.append(format_tool_call("cancel_event", {"event_id": f"EV-{task.metadata['world']['next_event']}"}))
    out = run(env, task, detour + env.demonstrate(task))
    assert out[-1][1] == 1.0 and g["title"] in json.dumps(env.state.tool_state["world"]["events"])


def test_tools_validate_and_report_errors(env):
    task = env.tasks().get(0, "train")
    env.reset(options={"task": task})
    names = {t["function"]["name"] for t in env.tool_schemas}
    assert {"transfer", "get_balance", "find_item", "move_item", "create_event", "write_file"} <= names
    transfer = next(t for t in env.tool_schemas if t["function"]["name"] == "transfer")["function"]
    assert transfer["parameters"]["properties"]["amount"]["type"] == "integer" and transfer["description"]
    cases = [("transfer", {"source": "Nobody", "target": TC.SHOP, "amount": 5}, "no account"),
             ("transfer", {"source": TC.SHOP, "target": TC.SHOP, "amount": 5}, "differ"),
             ("transfer", {"source": TC.SHOP, "target": TC.SHOP, "amount": "lots"}, "invalid arguments"),
             ("transfer", {"source": TC.SHOP}, "invalid arguments"),
             ("move_item", {"sku": "SKU-0", "location": "moon"}, "unknown location"),
             ("create_event", {"title": "x", "day": 9, "hour": 9, "attendees": []}, "day must be"),
             ("read_file", {"path": "missing.txt"}, "no file"),
             ("teleport", {"to": "mars"}, "unknown tool")]
    before = json.dumps(env.state.tool_state["world"], sort_keys=True)
    for name, args, msg in cases:
        obs = env.step(format_tool_call(name, args))[0]
        assert obs.startswith("Error") and msg in obs, (name, obs)
    assert json.dumps(env.state.tool_state["world"], sort_keys=True) == before


def test_fork_replays_identically_with_world_state(env):
    rng = np.random.default_rng(0)
    junk = ["", "<tool_call>{oops</tool_call>", format_tool_call("list_items", {}), "<answer>done</answer>",
            format_tool_call("transfer", {"source": TC.SHOP, "target": "Alice", "amount": 3})]
    for i in range(12):
        task = env.tasks().get(i, "validation")
        demo = env.demonstrate(task)
        actions = [demo[k] if rng.random() < 0.6 else junk[int(rng.integers(len(junk)))] for k in range(len(demo))] + demo
        env.reset(options={"task": task})
        snaps, outs, worlds = [], [], []
        for a in actions:
            snaps.append(env.snapshot())
            worlds.append(json.dumps(env.state.tool_state["world"], sort_keys=True))
            o = env.step(a)
            outs.append((o[0], o[1], o[2], o[3], o[4]["role"]))
            if o[2] or o[3]:
                break
        for t, snap in enumerate(snaps):
            env.restore(EnvSnapshot.from_bytes(snap.to_bytes()))
            assert json.dumps(env.state.tool_state["world"], sort_keys=True) == worlds[t]
            for k in range(t, len(outs)):
                o = env.step(actions[k])
                assert (o[0], o[1], o[2], o[3], o[4]["role"]) == outs[k], (task.id, t, k)


ADVERSARIAL = [
    "", "x" * (1 << 20), "<tool_call>{\"name\": \"transfer\", \"arguments\": {</tool_call>",
    "<tool_call>" + "{\"a\":" * 3000 + "</tool_call>", "<tool_call><answer>1</answer></tool_call>",
    "<answer>1</answer><answer>2</answer>", "\ud83d \u0000 \u202e ʕ•ᴥ•ʔ",
    format_tool_call("nope", {}), format_tool_call("get_balance", {"account": ["Alice"]}),
    format_tool_call("set_quantity", {"sku": "SKU-1", "quantity": -4}),
]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(action=st.one_of(st.text(max_size=200), st.sampled_from(ADVERSARIAL),
                        st.builds(lambda n, a: format_tool_call(n, a),
                                  st.sampled_from(["transfer", "move_item", "create_event", "write_file", "x"]),
                                  st.dictionaries(st.sampled_from(["source", "target", "amount", "sku", "day", "path"]),
                                                  st.one_of(st.integers(), st.text(max_size=10), st.none()), max_size=4))))
def test_fuzzed_actions_never_raise(env, action):
    env.reset(options={"index": 2})
    obs, reward, terminated, truncated, info = env.step(action)
    assert env.observation_space.contains(obs) and reward in (0.0, 1.0)
    if "parse_error" in info:
        assert obs.startswith("Error") and not terminated


def test_adversarial_actions_give_error_observations(env):
    for action in ADVERSARIAL:
        env.reset(options={"index": 3})
        obs = env.step(action)[0]
        assert obs.startswith("Error"), (action[:60], obs[:200])


def test_check_env_passes():
    from gymnasium.utils.env_checker import check_env

    e = trace_gym.make("trace_gym/ToolCalls-v0", difficulty=2)
    check_env(e, skip_render_check=True)
    e.reset(seed=0)
    assert "ToolCalls" in e.render()
