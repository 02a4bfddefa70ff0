"""BFCL-v0 and BFCLMultiTurn-v0 against BFCL's own data and checkers (the trace-gym[bfcl] extra)."""

from __future__ import annotations

import copy
import importlib
import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("bfcl_eval", reason="bfcl-eval (the trace-gym[bfcl] extra) is not installed")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trace_gym
from trace_gym.env.base import EnvSnapshot, EnvUnavailable
from trace_gym.envs import bfcl as B
from trace_gym.envs.bfcl.checker import _allowed, _gold_value
from trace_gym.envs.bfcl.vendor import _BFCL_NAME
from trace_gym.env.react import format_answer, format_tool_call

CHECKER = B.require_bfcl()  # installs the model_config stand-in before BFCL's checker is imported
from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import _compare_instances  # noqa: E402


@pytest.fixture(scope="module")
def bfcl_utils(tmp_path_factory):
    """BFCL's evaluation helpers (``is_function_calling_format_output``, ``is_empty_output``).
    Importing ``bfcl_eval.utils`` creates result folders under BFCL_PROJECT_ROOT, so point it
    at a temporary folder unless another test already imported it."""
    if "bfcl_eval.constants.eval_config" not in sys.modules:
        os.environ.setdefault("BFCL_PROJECT_ROOT", str(tmp_path_factory.mktemp("bfcl-root")))
    return importlib.import_module("bfcl_eval.utils")


@pytest.fixture(scope="module")
def env():
    return trace_gym.make("trace_gym/BFCL-v0")


@pytest.fixture(scope="module")
def mt_env():
    return trace_gym.make("trace_gym/BFCLMultiTurn-v0")


def all_tasks(env):
    return env.tasks().all()


def calls_text(calls):
    """A policy turn carrying ``calls`` (BFCL decoded format) as <tool_call> blocks."""
    if not calls:
        return format_answer("No function fits this request.")
    return "<think>Let me call the functions.</think>\n" + "\n".join(
        format_tool_call(name, args) for call in calls for name, args in call.items()
    )


def bfcl_direct_verdict(task, calls, bfcl_utils):
    """BFCL's verdict computed without the env, the way BFCL's evaluator does it."""
    calls = json.loads(json.dumps(calls))  # what the text carries
    category = task.metadata["category"]
    if category == "irrelevance":  # _evaluate_single_relevance_entry: correct iff no call decoded
        return bfcl_utils.is_empty_output(calls)
    if not bfcl_utils.is_function_calling_format_output(calls):
        return False
    try:
        return bool(ast_checker(task.metadata["functions"], calls, task.ground_truth, CHECKER.Language.PYTHON,
                                _BFCL_NAME.get(category, category), B.JUDGE_MODEL)["valid"])
    except Exception:  # the checker assumes typed outputs; treat a crash as a rejection
        return False


def env_reward(env, task, text):
    env.reset(options={"task": task})
    _, reward, terminated, truncated, info = env.step(text)
    return reward, terminated, info


# ----------------------------------------------------------------------------- single-turn agreement


def first_choice_gold(task):
    """The naive gold answer: the first allowed value of every parameter (omitted when only
    "" is allowed). BFCL's checker rejects a couple of these; the env must agree either way."""
    out = []
    for expected in task.ground_truth or []:
        (name, params), = expected.items()
        out.append({name: {p: _gold_value(_allowed(v)[0]) for p, v in params.items() if _allowed(v)}})
    return out


def test_every_gold_answer_matches_bfcl_checker(env, bfcl_utils):
    tasks = all_tasks(env)
    counts = {c: 0 for c in B.SINGLE_TURN_CATEGORIES}
    naive_rejected = 0
    for task in tasks:
        counts[task.metadata["category"]] += 1
        gold = B.gold_calls(task)
        assert bfcl_direct_verdict(task, gold, bfcl_utils) is True, task.id
        reward, terminated, info = env_reward(env, task, calls_text(gold))
        assert (reward, terminated) == (1.0, True), (task.id, info)
        naive = first_choice_gold(task)
        expected = bfcl_direct_verdict(task, naive, bfcl_utils)
        naive_rejected += not expected
        assert env_reward(env, task, calls_text(naive))[0] == float(expected), task.id
    # BFCL v4 ships 400 simple_python, 200 each of multiple/parallel/parallel_multiple, 240 irrelevance.
    assert counts == {"simple": 400, "multiple": 200, "parallel": 200, "parallel_multiple": 200, "irrelevance": 240}
    assert naive_rejected < 10


def _perturb_value(v, rng):
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + int(rng.integers(1, 9))
    if isinstance(v, float):
        return v + 1.5
    if isinstance(v, str):
        return v + " extra" if v else "something"
    if isinstance(v, list):
        return v[:-1] if v else ["extra"]
    if isinstance(v, dict):
        return {**v, "unexpected_key": "x"}
    return "changed"


def _retype(v):
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, str):
        return [v]
    if isinstance(v, list):
        return json.dumps(v)
    return 0


PERTURBATIONS = ("wrong_value", "missing_arg", "extra_arg", "wrong_function", "other_function", "extra_call",
                 "drop_call", "type_change", "int_float_swap", "upper_case", "reorder", "no_call")


def perturb(task, gold, kind, rng):
    """A perturbed answer of ``kind`` (some stay correct: case changes, reorders, ints for floats)."""
    calls = copy.deepcopy(gold)
    if task.metadata["category"] == "irrelevance":
        fn = task.metadata["functions"][int(rng.integers(len(task.metadata["functions"])))]
        props = fn["parameters"].get("properties", {})
        return [{fn["name"]: {p: "x" for p in list(props)[:2]}}]
    if kind == "no_call":
        return []
    i = int(rng.integers(len(calls)))
    (name, args), = calls[i].items()
    keys = sorted(args)
    if kind in ("wrong_value", "missing_arg", "type_change", "int_float_swap", "upper_case") and not keys:
        kind = "extra_arg"
    if kind == "wrong_value":
        k = keys[int(rng.integers(len(keys)))]
        args[k] = _perturb_value(args[k], rng)
    elif kind == "missing_arg":
        del args[keys[int(rng.integers(len(keys)))]]
    elif kind == "extra_arg":
        args["unexpected_param"] = 1
    elif kind == "wrong_function":
        calls[i] = {name + "_v2": args}
    elif kind == "other_function":
        others = [f["name"] for f in task.metadata["functions"] if f["name"] != name]
        calls[i] = {(others[int(rng.integers(len(others)))] if others else name.replace(".", "_") + "x"): args}
    elif kind == "extra_call":
        calls.append(copy.deepcopy(calls[i]))
    elif kind == "drop_call":
        calls.pop(i)
    elif kind == "type_change":
        k = keys[int(rng.integers(len(keys)))]
        args[k] = _retype(args[k])
    elif kind == "int_float_swap":
        nums = [k for k in keys if isinstance(args[k], (int, float)) and not isinstance(args[k], bool)]
        if nums:
            k = nums[0]
            args[k] = float(args[k]) if isinstance(args[k], int) else int(args[k])
        else:
            args[keys[0]] = _retype(args[keys[0]])
    elif kind == "upper_case":
        strs = [k for k in keys if isinstance(args[k], str)]
        k = strs[0] if strs else keys[0]
        args[k] = args[k].upper() if strs else _perturb_value(args[k], rng)
    elif kind == "reorder":
        calls = calls[::-1] if len(calls) > 1 else calls + [{name: {}}]
    return calls


def test_perturbed_answers_match_bfcl_checker(env, bfcl_utils):
    rng = np.random.default_rng(0)
    n, agree_valid, agree_invalid, kinds_seen = 0, 0, 0, set()
    for t, task in enumerate(all_tasks(env)):
        gold = B.gold_calls(task)
        for j in range(2):
            kind = PERTURBATIONS[(2 * t + j) % len(PERTURBATIONS)]
            calls = perturb(task, gold, kind, rng)
            expected = bfcl_direct_verdict(task, calls, bfcl_utils)
            reward, terminated, info = env_reward(env, task, calls_text(calls))
            if len(calls) <= 8:  # more calls than a turn may hold is a format error: reward 0, not judged
                assert terminated, (task.id, kind, info)
            assert reward == float(expected), (task.id, kind, calls, info)
            n += 1
            kinds_seen.add(kind)
            agree_valid += expected
            agree_invalid += not expected
    assert n >= 500 and kinds_seen == set(PERTURBATIONS)
    # Both verdicts occur often enough that a constant reward could not pass.
    assert agree_invalid >= 1000 and agree_valid >= 150, (agree_valid, agree_invalid)


def test_judge_matches_function_names_exactly(env):
    task = next(t for t in all_tasks(env) if t.metadata["bfcl_id"] == "simple_python_1")  # math.factorial
    gold = B.gold_calls(task)
    assert list(gold[0]) == ["math.factorial"]
    assert env_reward(env, task, calls_text(gold))[0] == 1.0
    assert env_reward(env, task, calls_text([{"math_factorial": gold[0]["math.factorial"]}]))[0] == 0.0


def test_model_config_stand_in_has_only_the_judge_entry():
    module = sys.modules["bfcl_eval.constants.model_config"]
    assert module.MODEL_CONFIG_MAPPING[B.JUDGE_MODEL].underscore_to_dot is False
    # The vendor SDKs BFCL's real module would import stay absent.
    assert "openai" not in sys.modules and "anthropic" not in sys.modules


def test_tool_schemas_are_json_schema(env):
    json_types = {"object", "array", "string", "number", "integer", "boolean", "null"}

    def walk(schema, where):
        assert schema["type"] in json_types, where
        for k, sub in schema.get("properties", {}).items():
            walk(sub, f"{where}.{k}")
        if isinstance(schema.get("items"), dict):
            walk(schema["items"], where + "[]")

    for task in all_tasks(env)[::7]:
        _, info = env.reset(options={"task": task})
        tools = info["tools"]
        assert [t["function"]["name"] for t in tools] == [f["name"] for f in task.metadata["functions"]]
        for tool in tools:
            assert tool["type"] == "function" and tool["function"]["parameters"]["type"] == "object"
            walk(tool["function"]["parameters"], tool["function"]["name"])
            json.dumps(tool)
    float_param = B.to_tool_schema({"name": "f", "description": "d", "parameters": {"type": "dict", "properties": {
        "x": {"type": "float", "description": "x"}, "t": {"type": "tuple", "items": {"type": "integer"}}}, "required": ["x"]}})
    props = float_param["function"]["parameters"]["properties"]
    assert props["x"]["type"] == "number" and props["t"] == {"type": "array", "items": {"type": "integer"}}


def test_demonstrate_earns_reward_on_100_tasks(env):
    tasks = all_tasks(env)
    idx = np.random.default_rng(1).choice(len(tasks), size=100, replace=False)
    for i in idx:
        task = tasks[int(i)]
        env.reset(options={"task": task})
        demo = env.demonstrate(task)
        assert len(demo) == 1
        _, reward, terminated, _, _ = env.step(demo[0])
        assert reward == 1.0 and terminated, task.id


def test_category_kwarg_and_splits():
    env = trace_gym.make("trace_gym/BFCL-v0", category="parallel")
    sizes = {s: env.tasks().size(s) for s in ("train", "validation", "test")}
    assert sum(sizes.values()) == 200 and min(sizes.values()) > 0
    ids = {env.tasks().get(i, s).id for s in sizes for i in range(sizes[s])}
    assert len(ids) == 200 and all(i.startswith("bfcl/parallel_") for i in ids)
    obs, info = env.reset(seed=3)
    assert info["task_id"].startswith("bfcl/parallel_") and obs
    assert env.reset(options={"task_id": "parallel_7"})[1]["task_id"] == "bfcl/parallel_7"
    with pytest.raises(ValueError, match="unknown BFCL category"):
        trace_gym.make("trace_gym/BFCL-v0", category="exec_simple")


def test_missing_extra_raises_a_clear_error(monkeypatch):
    B.require_bfcl.cache_clear()
    monkeypatch.setitem(sys.modules, "bfcl_eval", None)
    try:
        for make in (B.BFCLEnv, B.BFCLMultiTurnEnv, lambda: trace_gym.make("trace_gym/BFCL-v0")):
            with pytest.raises(EnvUnavailable, match=r"trace-gym\[bfcl\]") as info:
                make()
            assert isinstance(info.value, ImportError)
    finally:
        monkeypatch.undo()
        B.require_bfcl.cache_clear()
        B.require_bfcl()


# ----------------------------------------------------------------------------- fork


def replay_matches(env, reset_options, actions):
    """Run ``actions``, snapshotting before every turn; restoring each snapshot and replaying the
    rest must reproduce the observations and rewards exactly."""
    env.reset(options=reset_options)
    snaps, outs = [], []
    for a in actions:
        snaps.append(env.snapshot())
        obs, r, term, trunc, info = env.step(a)
        outs.append((obs, r, term, trunc, info.get("role")))
        if term or trunc:
            break
    for t, snap in enumerate(snaps):
        env.restore(EnvSnapshot.from_bytes(snap.to_bytes()) if t % 2 else snap)
        for k in range(t, len(outs)):
            obs, r, term, trunc, info = env.step(actions[k])
            assert (obs, r, term, trunc, info.get("role")) == outs[k], (t, k)
    return outs


def test_fork_single_turn(env):
    task = env.tasks().by_id("parallel_multiple_3")
    actions = ["no tags at all", "<tool_call>{broken</tool_call>", env.demonstrate(task)[0]]
    outs = replay_matches(env, {"task": task}, actions)
    assert outs[0][0].startswith("Error") and outs[-1][1] == 1.0


FS_CALLS = ["ls()", "pwd()", "cd(folder='document')", "cd(folder='..')", "mkdir(dir_name='forked')",
            "touch(file_name='new.txt')", "echo(content='hello', file_name='new.txt')", "cat(file_name='new.txt')",
            "rm(file_name='new.txt')", "find(path='.', name='report')", "du(human_readable=True)"]


def random_actions(env, task, rng, n):
    """A mix of BFCL ground-truth calls, random simulator calls, answers and junk."""
    demo = env.demonstrate(task)
    junk = ["", "<tool_call>{\"name\": 1}</tool_call>", "<answer>ok</answer>", "plain text",
            format_tool_call("no_such_function", {"x": 1})]
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.4:
            out.append(demo[int(rng.integers(len(demo)))])
        elif u < 0.75:
            name, args = B.parse_ground_truth_call(FS_CALLS[int(rng.integers(len(FS_CALLS)))], ["GorillaFileSystem"])
            out.append(format_tool_call(name, args))
        else:
            out.append(junk[int(rng.integers(len(junk)))])
    return out


def test_fork_multi_turn_restores_file_system(mt_env):
    task = mt_env.tasks().by_id("multi_turn_base_0")  # GorillaFileSystem + TwitterAPI
    demo = mt_env.demonstrate(task)
    outs = replay_matches(mt_env, {"task": task}, demo)
    assert outs[-1][1] == 1.0 and outs[-1][2]
    assert [o[4] for o in outs].count("user") == len(task.metadata["user_turns"]) - 1
    rng = np.random.default_rng(0)
    for _ in range(3):
        replay_matches(mt_env, {"task": task}, random_actions(mt_env, task, rng, 25))
    # The file system itself is restored: a directory made after the snapshot disappears.
    mt_env.reset(options={"task": task})
    before = copy.deepcopy(mt_env.state.tool_state["instances"]["GorillaFileSystem"])
    snap = mt_env.snapshot()
    obs = mt_env.step(format_tool_call("mkdir", {"dir_name": "forked"}))[0]
    assert "forked" in mt_env.step(format_tool_call("ls", {}))[0]
    mt_env.restore(snap)
    restored = mt_env.state.tool_state["instances"]["GorillaFileSystem"]
    assert _compare_instances(restored, before)[0]
    assert "forked" not in mt_env.step(format_tool_call("ls", {}))[0], obs


def test_fork_branch_ids_replay_identically(mt_env):
    task = mt_env.tasks().by_id("multi_turn_base_120")
    mt_env.reset(options={"task": task})
    demo = mt_env.demonstrate(task)
    mt_env.step(demo[0])
    snap = mt_env.snapshot()
    runs = []
    for _ in range(2):
        mt_env.restore(snap, branch_id=7)
        runs.append([mt_env.step(a)[:3] for a in demo[1:]])
    assert runs[0] == runs[1] and runs[0][-1][1] == 1.0


# ----------------------------------------------------------------------------- multi-turn


def test_multi_turn_demonstrate_earns_reward_on_100_tasks(mt_env):
    tasks = mt_env.tasks().all()
    assert len(tasks) == 200
    for task in tasks[::2]:
        mt_env.reset(options={"task": task})
        roles = []
        for action in mt_env.demonstrate(task):
            obs, reward, terminated, truncated, info = mt_env.step(action)
            roles.append(info["role"])
        assert terminated and not truncated and reward == 1.0, (task.id, info.get("bfcl"))
        assert roles.count("user") == len(task.ground_truth) - 1
    # The checker's instance cache is cleaned after every verdict.
    assert not [k for k in vars(multi_turn_utils) if k.startswith("tracegym")]


def test_multi_turn_wrong_or_missing_calls_fail(mt_env):
    failures = 0
    for task in mt_env.tasks().all()[:40]:
        demo = mt_env.demonstrate(task)
        calls = [i for i, a in enumerate(demo) if a.startswith("<tool_call>")]
        if not calls:
            continue
        # Skip the last ground-truth call: BFCL's state or response check must notice.
        skipped = [a for i, a in enumerate(demo) if i != calls[-1]]
        mt_env.reset(options={"task": task})
        for a in skipped:
            out = mt_env.step(a)
        failures += out[1] == 0.0
        # Answering every user turn without calling anything fails too.
        mt_env.reset(options={"task": task})
        for _ in task.ground_truth:
            out = mt_env.step("<answer>I did it.</answer>")
        assert out[2] and out[1] == 0.0
    assert failures >= 30


def test_multi_turn_checker_verdict_equals_direct_call(mt_env):
    """The env's verdict is BFCL's multi_turn_checker on the recorded calls."""
    for task in mt_env.tasks().all()[::25]:
        mt_env.reset(options={"task": task})
        for a in mt_env.demonstrate(task)[:-1]:
            mt_env.step(a)
        record = copy.deepcopy(mt_env.state.tool_state["record"])
        expected = CHECKER.multi_turn_checker(record, task.ground_truth,
                                              {"id": task.metadata["bfcl_id"], "initial_config": task.metadata["initial_config"],
                                               "involved_classes": task.metadata["involved_classes"]},
                                              "multi_turn_base", "direct_test_model")
        for k in [k for k in vars(multi_turn_utils) if k.startswith("direct_test_model")]:
            del vars(multi_turn_utils)[k]
        assert mt_env.score(task, "") == 1.0  # the reward if the last user turn were answered now
        assert mt_env.step("<answer>Done.</answer>")[1] == float(expected["valid"]) == 1.0
        mt_env.reset(options={"task": task})
        assert mt_env.score(task, "") == 0.0
        assert record == [[[B.call_string(*B.parse_ground_truth_call(c, task.metadata["involved_classes"]))] for c in turn]
                          for turn in task.ground_truth]


def test_multi_turn_unsafe_calls_are_not_replayed(mt_env, tmp_path):
    task = mt_env.tasks().by_id("multi_turn_base_0")
    target = tmp_path / "pwned"
    mt_env.reset(options={"task": task})
    evil = [
        {"name": "cd", "arguments": {f"folder='x',x=__import__('os').system('touch {target}'),y": 1}},
        {"name": f"__import__('os').system('touch {target}')", "arguments": {}},
        {"name": "open", "arguments": {"file": str(target), "mode": "w"}},
        {"name": "exec", "arguments": {"source": f"open('{target}', 'w')"}},
        {"name": "\uff4f\uff50\uff45\uff4e", "arguments": {"file": str(target), "mode": "w"}},  # NFKC-folds to open
        {"name": "cd", "arguments": {"\uff46\uff4f\uff4c\uff44\uff45\uff52": "document"}},
    ]
    for call in evil:
        obs = mt_env.step("<tool_call>" + json.dumps(call) + "</tool_call>")[0]
        assert obs.startswith("Error during execution"), obs
    assert mt_env.state.tool_state["record"] == [[]]
    for _ in task.ground_truth:
        mt_env.step("<answer>done</answer>")
    assert not target.exists()


def test_multi_turn_step_limit_force_terminates(mt_env):
    task = mt_env.tasks().by_id("multi_turn_base_3")
    mt_env.reset(options={"task": task})
    for i in range(CHECKER.MAXIMUM_STEP_LIMIT):
        assert not mt_env.step(format_tool_call("pwd", {}))[2]
    obs, reward, terminated, truncated, info = mt_env.step(format_tool_call("pwd", {}))
    assert terminated and reward == 0.0 and obs.startswith("Error")


# ----------------------------------------------------------------------------- bad input

ADVERSARIAL = [
    "",
    "x" * (1 << 20),
    "<tool_call>" + "a" * (1 << 20) + "</tool_call>",
    "<tool_call>{\"name\": \"ls\", \"arguments\": {</tool_call>",
    "<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>",
    "<tool_call>[1, 2]</tool_call>",
    "<tool_call>" + "[" * 5000 + "</tool_call>",
    "<tool_call><tool_call>{}</tool_call></tool_call>",
    "<answer><answer>1</answer></answer>",
    "<answer>1</answer><answer>2</answer>",
    "<tool_call>{\"name\": \"ls\", \"arguments\": {}}",
    "\ud800\udfff \u202e \x00 \U0001F600 日本語",
    format_tool_call("no_such_function", {"x": 1}),
    format_tool_call("cd", {"folder": 123}),
    format_tool_call("ls", {"a": {"b": [1, {"c": None}]}}),
    "<tool_call>{\"name\": \"cd\", \"arguments\": \"not json\"}</tool_call>",
    "<think>" * 100,
]


def _check_step(env, action):
    obs, reward, terminated, truncated, info = env.step(action)
    assert env.observation_space.contains(obs)
    assert 0.0 <= reward <= 1.0
    if "parse_error" in info:
        assert obs.startswith("Error") and reward == 0.0
    return obs, info


def test_adversarial_actions_give_error_observations(env, mt_env):
    st_task = env.tasks().by_id("simple_python_0")
    mt_task = mt_env.tasks().by_id("multi_turn_base_0")
    for action in ADVERSARIAL:
        env.reset(options={"task": st_task})
        obs, info = _check_step(env, action)
        assert obs.startswith("Error"), (action[:80], obs)  # malformed, or a call the checker rejects
        mt_env.reset(options={"task": mt_task})
        obs, info = _check_step(mt_env, action)
        assert "error" in obs.lower(), (action[:80], obs)
        # The episode is still usable afterwards.
        assert mt_env.step(format_tool_call("pwd", {}))[0].startswith("{")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(action=st.one_of(st.text(max_size=300), st.sampled_from(ADVERSARIAL),
                        st.builds(lambda name, v: "<tool_call>" + json.dumps({"name": name, "arguments": {"folder": v}}) + "</tool_call>",
                                  st.sampled_from(["cd", "ls", "cat", "grep", "post_tweet", "zzz", "mv"]),
                                  st.one_of(st.text(max_size=20), st.integers(), st.none(), st.lists(st.integers(), max_size=3)))))
def test_fuzzed_actions_never_raise(env, mt_env, action):
    env.reset(options={"index": 5})
    _check_step(env, action)
    mt_env.reset(options={"index": 5})
    _check_step(mt_env, action)
    if not mt_env.state.done:
        _check_step(mt_env, action)


def test_check_env_passes():
    from gymnasium.utils.env_checker import check_env

    for env_id in ("trace_gym/BFCL-v0", "trace_gym/BFCLMultiTurn-v0"):
        e = trace_gym.make(env_id)
        check_env(e, skip_render_check=True)
        e.reset(seed=0)
        assert e.render() is not None
