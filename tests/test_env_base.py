"""The env base: ReAct turn parsing, typed tools, the registry (incl. entry-point plug-ins),
and AgentEnv's reset/step/snapshot/restore/branch contract."""

from __future__ import annotations  # on purpose: tools must resolve string annotations

import json
import sys
import textwrap
from typing import Literal

import gymnasium
import numpy as np
import pytest
from pydantic import ValidationError

import trace_gym
from trace_gym.env.base import (MAX_ACTION_CHARS, TEXT_CHARSET, AgentEnv, AgentText, EnvSnapshot, EnvUnavailable,
                           TurnResult, clean_text)
from trace_gym.env.react import MAX_TOOL_CALLS_PER_TURN, format_answer, format_tool_call, format_turn, parse_turn
from trace_gym.registry import ENTRY_POINT_GROUP, Registry, UnknownNameError, load_plugins
from trace_gym.task import Task
from trace_gym.env.tools import Tool, ToolError, tool

# ----------------------------------------------------------------------------- parse_turn


def test_parse_answer_with_thought():
    p = parse_turn("<think>\n17*23 is 391.\n</think>\n\n<answer> 391 </answer>")
    assert (p.thought, p.answer, p.tool_calls, p.error) == ("17*23 is 391.", "391", [], None)


def test_parse_tool_calls_in_order():
    text = format_turn("two lookups", [("search", {"query": "a"}), ("search", {"query": "b", "k": 2})])
    p = parse_turn(text)
    assert p.error is None and p.answer is None
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("search", {"query": "a"}), ("search", {"query": "b", "k": 2})]


def test_parse_qwen3_completion_without_opening_think():
    # Qwen3's template opens <think> in the prompt, so the completion shows only </think>.
    p = parse_turn("I should add.\n</think>\n<answer>5</answer>")
    assert p.thought == "I should add." and p.answer == "5"


def test_parse_answer_inside_thought_is_not_an_answer():
    p = parse_turn("<think>maybe <answer>4</answer>?</think><answer>5</answer>")
    assert p.answer == "5"
    p = parse_turn("<think>still thinking <answer>4</answer>")
    assert p.answer is None and "not closed" in p.error


def test_parse_accepts_parameters_alias_and_double_encoded_arguments():
    p = parse_turn('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>')
    assert p.tool_calls[0].arguments == {"x": 1}
    p = parse_turn('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert p.tool_calls[0].arguments == {"x": 2}


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("", "no action found"),
        ("just prose, 42", "no action found"),
        ("<answer>1</answer><answer>2</answer>", "exactly one"),
        ('<tool_call>{"name": "f", "arguments": {}}</tool_call><answer>1</answer>', "not both"),
        ("<answer><answer>1</answer></answer>", "nested"),
        ('<answer><tool_call>{"name": "f"}</tool_call></answer>', "nested"),
        ("<answer>1", "not closed"),
        ("<tool_call>{", "not closed"),
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "needs a string \"name\""),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "f", "arguments": "not json"}</tool_call>', "not a JSON object"),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "nested more than"),
        ('<tool_call>{"name": "f", "arguments": {"n": 1' + "0" * 5000 + "}}</tool_call>", "not valid JSON"),
    ],
)
def test_parse_errors_are_messages_not_exceptions(text, fragment):
    p = parse_turn(text)
    assert p.error is not None and fragment in p.error
    assert p.answer is None and p.tool_calls == []


def test_parse_limits_tool_calls_per_turn():
    calls = [("f", {"i": i}) for i in range(MAX_TOOL_CALLS_PER_TURN + 1)]
    assert "at most" in parse_turn(format_turn("", calls)).error
    assert len(parse_turn(format_turn("", calls[:-1])).tool_calls) == MAX_TOOL_CALLS_PER_TURN


def test_parse_keeps_brackets_inside_json_strings():
    code = "x = " + "[" * 200 + "]" * 200
    p = parse_turn(format_tool_call("python", {"code": code}))
    assert p.error is None and p.tool_calls[0].arguments["code"] == code


@pytest.mark.timeout(30)
@pytest.mark.parametrize("unit", ["<tool_call>", "<answer>", "<think>", "</think>", "<tool_call>{", "x"])
def test_parse_is_linear_on_megabyte_inputs(unit):
    # A regex with a lazy group is quadratic here (minutes for 1 MB); the scanner is linear.
    text = unit * (MAX_ACTION_CHARS // len(unit))
    p = parse_turn(text)
    assert p.error is not None or p.thought is not None


def test_format_helpers_round_trip():
    turn = format_turn("thinking", answer="\\frac{1}{2}")
    assert turn.startswith("<think>\nthinking\n</think>") and parse_turn(turn).answer == "\\frac{1}{2}"
    assert format_answer("7") == "<answer>7</answer>"
    assert json.loads(format_tool_call("f", {"a": "é"}).split("\n")[1]) == {"name": "f", "arguments": {"a": "é"}}
    with pytest.raises(ValueError):
        format_turn("x")
    with pytest.raises(ValueError):
        format_turn("x", [("f", {})], answer="1")


# ----------------------------------------------------------------------------- tools


def lookup(city: str, units: Literal["metric", "imperial"] = "metric", days: int = 1, tags: list[str] | None = None) -> dict:
    """Look up the weather forecast.

    Args:
        city: City name, e.g. "Paris".
        units: Unit system.
        days: How many days
            to forecast.
        tags: Optional labels.
    """
    if city == "Atlantis":
        raise ToolError("no such city")
    if city == "Crash":
        raise RuntimeError("backend down")
    return {"city": city, "units": units, "days": days}


def test_tool_schema_for_chat_templates():
    t = Tool.from_function(lookup)
    s = t.schema
    assert s["type"] == "function" and s["function"]["name"] == "lookup"
    assert s["function"]["description"] == "Look up the weather forecast."
    params = s["function"]["parameters"]
    assert params["type"] == "object" and params["required"] == ["city"]
    props = params["properties"]
    assert props["city"] == {"type": "string", "description": 'City name, e.g. "Paris".'}
    assert props["units"]["enum"] == ["metric", "imperial"]  # resolved from a string annotation
    assert props["days"]["type"] == "integer" and props["days"]["description"] == "How many days to forecast."
    json.dumps(s)  # serialisable, as apply_chat_template needs


def test_tool_schema_matches_transformers_get_json_schema():
    transformers_utils = pytest.importorskip("transformers.utils")

    def add(a: int, b: float, label: str, flags: list[int]) -> float:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
            label: A name for the sum.
            flags: Some integers.
        """
        return a + b

    ours = Tool.from_function(add).schema["function"]
    theirs = transformers_utils.get_json_schema(add)["function"]
    assert ours["name"] == theirs["name"] and ours["description"] == theirs["description"]
    assert ours["parameters"]["properties"] == theirs["parameters"]["properties"]
    assert sorted(ours["parameters"]["required"]) == sorted(theirs["parameters"]["required"])


def test_tool_call_validates_and_reports_errors_as_text():
    t = tool(lookup)
    assert json.loads(t.call({"city": "Oslo", "days": "3"})) == {"city": "Oslo", "units": "metric", "days": 3}
    assert json.loads(t.call('{"city": "Rome"}'))["city"] == "Rome"
    assert t.call({"days": 2}).startswith("Error: invalid arguments for lookup: city")
    assert "units" in t.call({"city": "Oslo", "units": "kelvin"})
    assert t.call({"city": "Atlantis"}) == "Error: no such city"
    assert t.call({"city": "Crash"}) == "Error: lookup failed: RuntimeError: backend down"
    assert t.call("{broken").startswith("Error: arguments of lookup are not valid JSON")
    assert t.call([1, 2]).startswith("Error: arguments of lookup must be a JSON object")


def test_tool_needs_type_hints():
    def bad(x):
        """No hints."""

    with pytest.raises(TypeError, match="needs a type hint"):
        Tool.from_function(bad)


# ----------------------------------------------------------------------------- a tiny env


class DiceEnv(AgentEnv):
    """Roll dice with a tool; answer the running total. Its tool state and episode RNG make
    snapshot/restore/branch semantics observable."""

    env_id = "test/Dice-v0"
    default_max_turns = 4

    class _Tasks:
        def size(self, split="train"):
            return 50

        def get(self, index, split="train"):
            if not 0 <= index < 50:
                raise IndexError(index)
            return Task(id=f"Dice-v0/{split}/{index}", prompt=f"Roll {index % 3 + 1} dice and report the total.",
                        ground_truth=index % 3 + 1, split=split)

    def tasks(self):
        return self._Tasks()

    def initial_tool_state(self, task):
        return {"total": 0, "rolls": []}

    def build_tools(self, task):
        def roll() -> str:
            """Roll one die."""
            value = int(self.state.rng.integers(1, 7))
            self.state.tool_state["total"] += value
            self.state.tool_state["rolls"].append(value)
            return str(value)

        return [Tool.from_function(roll)]

    def score(self, task, answer):
        st = self.state.tool_state
        return float(len(st["rolls"]) == task.ground_truth and answer.strip() == str(st["total"]))

    def demonstrate(self, task):
        return [format_turn("roll", [("roll", {})]) for _ in range(task.ground_truth)]


ROLL = format_turn("", [("roll", {})])


def test_reset_options_and_info():
    env = DiceEnv(seed=3)
    obs, info = env.reset(options={"index": 4})
    assert obs == "Roll 2 dice and report the total." and info["task_id"] == "Dice-v0/train/4"
    assert [t["function"]["name"] for t in info["tools"]] == ["roll"]
    assert [m["role"] for m in info["messages"]] == ["system", "user"]
    assert env.reset(options={"task_id": "Dice-v0/train/7"})[1]["task_id"] == "Dice-v0/train/7"
    custom = Task(id="custom/1", prompt="Roll once.", ground_truth=1)
    assert env.reset(options={"task": custom})[0] == "Roll once."
    assert env.reset(options={"task": custom.model_dump()})[1]["task_id"] == "custom/1"
    with pytest.raises(KeyError):
        env.reset(options={"task_id": "nonsense"})
    # Without options the task index comes from the seeded RNG: same seed, same task.
    assert DiceEnv().reset(seed=11)[1]["task_id"] == DiceEnv().reset(seed=11)[1]["task_id"]


def test_step_contract():
    env = DiceEnv()
    with pytest.raises(RuntimeError, match="reset"):
        env.step(ROLL)
    env.reset(options={"index": 0})
    obs, reward, terminated, truncated, info = env.step("no tags")
    assert obs.startswith("Error:") and info["parse_error"] and reward == 0.0 and not terminated
    obs, *_ = env.step(format_turn("", [("dance", {})]))
    assert obs == "Error: unknown tool 'dance' (available: roll)."
    obs, *_ = env.step(ROLL)
    assert obs in {"1", "2", "3", "4", "5", "6"}
    total = env.state.tool_state["total"]
    obs, reward, terminated, truncated, info = env.step(format_answer(str(total)))
    assert (reward, terminated, truncated, info["answer"]) == (1.0, True, False, str(total))
    with pytest.raises(RuntimeError, match="ended"):
        env.step(ROLL)


def test_max_turns_truncates():
    env = DiceEnv(max_turns=2)
    env.reset(options={"index": 2})
    assert env.step(ROLL)[3] is False
    _, reward, terminated, truncated, _ = env.step(ROLL)
    assert (reward, terminated, truncated) == (0.0, False, True)
    with pytest.raises(ValueError):
        DiceEnv(max_turns=0)


def test_observations_stay_in_the_text_space():
    env = DiceEnv()
    env.reset(options={"task": Task(id="t/train/0", prompt="emoji 🎲 and \ud800 surrogate", ground_truth=1)})
    obs, *_ = env.step("<tool_call>" + "x" * 100 + "🎲</tool_call>")
    assert env.observation_space.contains(obs) and env.observation_space.contains(env.state.transcript[0][1])
    assert env.observation_space.contains(env.reset(options={"task": Task(id="t/train/1", prompt="🎲", ground_truth=1)})[0])


def test_render_modes(capsys):
    env = DiceEnv(render_mode="human")
    env.reset(options={"index": 0})
    env.step(ROLL)
    assert env.render() is None and "AGENT: " in capsys.readouterr().out
    ansi = DiceEnv(render_mode="ansi")
    ansi.reset(options={"index": 0})
    assert ansi.render().startswith("[test/Dice-v0] task Dice-v0/train/0")
    with pytest.raises(ValueError):
        DiceEnv(render_mode="rgb_array")


def test_clean_text():
    assert clean_text("plain ascii", 100) == "plain ascii"
    assert clean_text("astral 🎲", 100) == "astral \ufffd"
    long = clean_text("a" * 1000, 100)
    assert len(long) <= 100 and "truncated" in long
    assert set(clean_text("".join(map(chr, range(0x0, 0x3000))), 1 << 16)) <= TEXT_CHARSET


def test_agent_text_space_is_a_gymnasium_text_space():
    space = AgentText(1000, seed=0)
    assert isinstance(space, gymnasium.spaces.Text)
    samples = [space.sample() for _ in range(20)]
    assert all(space.contains(s) and len(s) <= 1000 for s in samples)
    assert AgentText(1000, seed=5).sample() == AgentText(1000, seed=5).sample()
    assert space == gymnasium.spaces.Text(1000, min_length=0, charset=TEXT_CHARSET)
    assert not space.contains("🎲")
    masked = space.sample(mask=(3, None))
    assert len(masked) == 3 and space.contains(masked)


# ----------------------------------------------------------------------------- fork


def _run(env, actions):
    return [env.step(a)[:4] for a in actions]


def test_snapshot_restore_replays_exactly_including_tool_state():
    env = DiceEnv(seed=1)
    env.reset(options={"index": 2})
    env.step(ROLL)
    snap = env.snapshot()
    state_before = (dict(env.state.tool_state), env.state.turn)
    first = _run(env, [ROLL, ROLL, format_answer("7")])
    # Same env, restored.
    env.restore(snap)
    assert (env.state.tool_state["total"], env.state.turn) == (state_before[0]["total"], state_before[1])
    assert _run(env, [ROLL, ROLL, format_answer("7")]) == first
    # A fresh env from serialised bytes: tool state travels in the snapshot.
    other = DiceEnv(seed=1)
    other.restore(EnvSnapshot.from_bytes(snap.to_bytes()))
    assert _run(other, [ROLL, ROLL, format_answer("7")]) == first
    assert other.state.transcript[0][0] == ROLL  # history before the snapshot is kept


def test_restoring_does_not_alias_the_snapshot():
    env = DiceEnv()
    env.reset(options={"index": 1})
    snap = env.snapshot()
    env.step(ROLL)
    env.restore(snap)
    env.step(ROLL)
    env.restore(snap)
    assert env.state.tool_state == {"total": 0, "rolls": []} and env.state.turn == 0


def test_branch_ids_derive_fork_randomness():
    env = DiceEnv(seed=9)
    env.reset(options={"index": 2})
    env.step(ROLL)
    snap = env.snapshot()

    def rolls(branch_id):
        env.restore(snap, branch_id=branch_id)
        return [env.step(ROLL)[0] for _ in range(2)]

    assert rolls(5) == rolls(5)  # same (seed, branch id): same fork
    outcomes = {tuple(rolls(b)) for b in range(12)}
    assert len(outcomes) > 1  # different branch ids diverge
    # The fork's RNG comes from the snapshot's episode seed, not from the env restoring it ...
    other = DiceEnv(seed=10)
    other.restore(snap, branch_id=5)
    env.restore(snap, branch_id=5)
    assert other.state.rng.integers(0, 1 << 30, size=4).tolist() == env.state.rng.integers(0, 1 << 30, size=4).tolist()
    # ... and the same turn of an episode with another seed forks differently.
    other.reset(seed=10, options={"index": 2})
    other.step(ROLL)
    other.restore(other.snapshot(), branch_id=5)
    env.restore(snap, branch_id=5)
    assert other.state.rng.integers(0, 1 << 30, size=4).tolist() != env.state.rng.integers(0, 1 << 30, size=4).tolist()


def test_snapshot_guards():
    env = DiceEnv()
    with pytest.raises(RuntimeError):
        env.snapshot()
    env.reset(options={"index": 0})
    snap = env.snapshot()
    with pytest.raises(ValueError, match="cannot be restored"):
        trace_gym.make("trace_gym/MathCalc-v0").restore(snap)


def test_turn_result_defaults():
    r = TurnResult("obs")
    assert (r.reward, r.terminated, r.info) == (0.0, False, {})


def test_task_model():
    t = Task(id="x/train/0", prompt="p", ground_truth={"a": [1]}, metadata={"level": 2})
    assert Task.model_validate_json(t.model_dump_json()) == t
    with pytest.raises(ValidationError):
        Task(id="x", prompt="p", unknown=1)
    with pytest.raises(ValidationError):
        t.prompt = "changed"  # frozen


# ----------------------------------------------------------------------------- registry


def test_builtin_envs_through_gymnasium_make():
    ids = trace_gym.env_ids()
    assert {"trace_gym/MathCalc-v0", "trace_gym/GSM8K-v0", "trace_gym/MATH-v0"} <= set(ids)
    env = gymnasium.make("trace_gym/MathCalc-v0")
    assert type(env.unwrapped).__name__ == "MathCalcEnv"
    obs, info = env.reset(seed=0)
    assert isinstance(obs, str) and info["tools"][0]["function"]["name"] == "calculator"
    direct = trace_gym.make("trace_gym/MathCalc-v0", levels=[1])
    assert direct is direct.unwrapped and hasattr(direct, "snapshot")


def test_make_suggests_close_ids():
    with pytest.raises(UnknownNameError, match="did you mean 'trace_gym/MathCalc-v0'"):
        trace_gym.make("trace_gym/MathCalk-v0")


@pytest.fixture
def cleanup_registry():
    added: list[str] = []
    yield added
    from trace_gym import registry as reg

    for env_id in added:
        gymnasium.registry.pop(env_id, None)
        reg._registered_ids.discard(env_id)


def test_register_a_user_env(cleanup_registry):
    trace_gym.register("test/Dice-v0", entry_point=DiceEnv)
    cleanup_registry.append("test/Dice-v0")
    assert "test/Dice-v0" in trace_gym.env_ids()
    env = trace_gym.make("test/Dice-v0", seed=2)
    assert isinstance(env, DiceEnv) and env.seed_value == 2


def test_entry_point_plugins_are_discovered(tmp_path, monkeypatch, cleanup_registry):
    # A third-party distribution, installed as a dist-info next to its module.
    (tmp_path / "acme_envs.py").write_text(textwrap.dedent('''
        from trace_gym import AgentEnv, Task

        class EchoEnv(AgentEnv):
            """Repeat the word."""
            env_id = "acme/Echo-v0"

            class _Tasks:
                def size(self, split="train"):
                    return 3

                def get(self, index, split="train"):
                    return Task(id=f"echo/{split}/{index}", prompt=f"Say w{index}.", ground_truth=f"w{index}")

            def tasks(self):
                return self._Tasks()

            def score(self, task, answer):
                return float(answer == task.ground_truth)

            def demonstrate(self, task):
                return [f"<answer>{task.ground_truth}</answer>"]
    '''))
    dist = tmp_path / "acme_envs-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-envs\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nacme/Echo-v0 = acme_envs:EchoEnv\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cleanup_registry.append("acme/Echo-v0")
    assert "acme/Echo-v0" in load_plugins()
    assert "acme/Echo-v0" in trace_gym.env_ids() and "acme/Echo-v0" not in load_plugins()  # idempotent
    env = trace_gym.make("acme/Echo-v0")
    env.reset(options={"index": 1})
    assert env.step("<answer>w1</answer>")[1] == 1.0
    assert gymnasium.make("acme/Echo-v0").reset(seed=0)[0].startswith("Say w")
    sys.modules.pop("acme_envs", None)


def test_component_registry():
    reg: Registry[int] = Registry("widget")

    @reg.register("double")
    def double(x: int = 1) -> int:
        return 2 * x

    assert reg.make("double", x=4) == 8 and "double" in reg and list(reg) == ["double"]
    with pytest.raises(ValueError, match="already registered"):
        reg.register("double", lambda: 0)
    reg.register("double", lambda x=1: 3 * x, overwrite=True)
    assert reg.make("double", x=2) == 6
    with pytest.raises(UnknownNameError, match="did you mean 'double'"):
        reg.get("doubel")


def test_env_unavailable_is_a_runtime_error():
    assert issubclass(EnvUnavailable, RuntimeError)


def test_env_random_generator_is_seeded():
    env = DiceEnv()
    env.reset(seed=4)
    a = env.np_random.integers(0, 1 << 30)
    env.reset(seed=4)
    assert env.np_random.integers(0, 1 << 30) == a
    assert isinstance(env.state.rng, np.random.Generator)
