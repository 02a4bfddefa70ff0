"""Acceptance tests that walk the registry: every registered env (built-in or plug-in) passes
Gymnasium's env checker, forks exactly, has demonstrations that earn reward 1, survives
fuzzed and adversarial actions, and gives hedged answers 0. Envs that need a missing extra
or dataset are skipped with the reason. Also the ``trace-gym envs`` / ``trace-gym play``
commands."""

from __future__ import annotations

import io
import json
import math
import random
import subprocess
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trace_gym
from trace_gym.env.base import EnvSnapshot, EnvUnavailable
from trace_gym.env.react import format_answer, format_tool_call, parse_turn

DATA = Path(__file__).parent / "data"

# Local files for envs whose data would otherwise come from the Hub.
_LOCAL_FILES = {
    "trace_gym/GSM8K-v0": {"data_files": {"train": DATA / "gsm8k_train.jsonl", "test": DATA / "gsm8k_test.jsonl"}},
    "trace_gym/MATH-v0": {"data_files": DATA / "math_sample.jsonl"},
    "trace_gym/HotpotQA-v0": {"data_files": DATA / "hotpotqa_distractor_sample.json"},
    "trace_gym/2WikiMultiHopQA-v0": {"data_files": DATA / "2wikimultihopqa_sample.json"},
    "trace_gym/MuSiQue-v0": {"data_files": DATA / "musique_sample.jsonl"},
}


def _as_str(x: Any) -> Any:
    return {k: str(v) for k, v in x.items()} if isinstance(x, dict) else str(x)


LOCAL_KWARGS = {
    env_id: {k: _as_str(v) for k, v in kw.items()}
    for env_id, kw in _LOCAL_FILES.items()
    if all(Path(p).exists() for v in kw.values() for p in (v.values() if isinstance(v, dict) else [v]))
}

ENV_IDS = trace_gym.env_ids()
N_DEMOS = 100  # per env (fewer when its split is smaller)
N_FORK_TASKS = 3
FUZZ_EXAMPLES = 12

_ENVS: dict[str, Any] = {}


def make_env(env_id: str, fresh: bool = False):
    """The env (cached per id unless ``fresh``), or a visible skip when an extra or dataset is
    missing. A registered env whose own module is missing is a failure, not a skip."""
    if not fresh and env_id in _ENVS:
        return _ENVS[env_id]
    try:
        env = trace_gym.make(env_id, **LOCAL_KWARGS.get(env_id, {}))
    except EnvUnavailable as exc:
        pytest.skip(f"{env_id} unavailable here: {exc}")
    except ImportError as exc:
        missing = getattr(exc, "name", None) or ""
        if missing.split(".")[0] == "trace_gym":
            raise
        pytest.skip(f"{env_id} needs the optional package {missing or exc}")
    if not fresh:
        _ENVS[env_id] = env
    return env


def _n_tasks(env, cap: int) -> int:
    return min(cap, env.tasks().size(env.split))


def _episode(env, turns: list[str]) -> list[tuple]:
    out = []
    for turn in turns:
        obs, reward, terminated, truncated, _ = env.step(turn)
        out.append((obs, float(reward), terminated, truncated))
        if terminated or truncated:
            break
    return out


# ----------------------------------------------------------------------------- check_env


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_check_env(env_id):
    from gymnasium.utils.env_checker import check_env

    env = make_env(env_id, fresh=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env)
    complaints = [str(w.message) for w in caught if "WARN" in str(w.message)]
    assert complaints == []


# ----------------------------------------------------------------------------- fork


def _junk(rng: random.Random, tool_names: list[str]) -> str:
    name = rng.choice(tool_names) if tool_names else "missing"
    return rng.choice([
        "", "I am not sure.", "<tool_call>{broken</tool_call>", format_tool_call("no_such_tool", {}),
        format_tool_call(name, {"unexpected": rng.randint(0, 9)}), format_answer(f"wrong {rng.randint(0, 999)}"),
        "<answer>1</answer><answer>2</answer>",
    ])


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_fork_replays_exactly_from_every_turn(env_id):
    """Random action sequences (demonstration turns, which change tool state, mixed with junk)
    replayed after restoring a snapshot taken before every turn give identical observations
    and rewards, in the same env and in a fresh one built from the snapshot's bytes."""
    env = make_env(env_id)
    replayer = make_env(env_id, fresh=True)
    rng = random.Random(zlib.crc32(env_id.encode()))
    for index in range(_n_tasks(env, N_FORK_TASKS)):
        _, info = env.reset(seed=index, options={"index": index})
        tool_names = [t["function"]["name"] for t in info.get("tools", [])]
        demo = env.demonstrate(env.state.task)
        actions: list[str] = []
        for turn in demo:
            while rng.random() < 0.3:
                actions.append(_junk(rng, tool_names))
            actions.append(turn)
        env.reset(seed=index, options={"index": index})
        snapshots, reference = [], []
        for action in actions:
            snapshots.append(env.snapshot())
            obs, reward, terminated, truncated, _ = env.step(action)
            reference.append((obs, float(reward), terminated, truncated))
            if terminated or truncated:
                break
        assert reference, "no turn was played"
        for t, snap in enumerate(snapshots):
            env.restore(snap)
            assert _episode(env, actions[t:len(reference)]) == reference[t:]
            replayer.restore(EnvSnapshot.from_bytes(snap.to_bytes()))
            assert _episode(replayer, actions[t:len(reference)]) == reference[t:]
        # Forks: the same branch id replays identically.
        mid = snapshots[len(snapshots) // 2]
        env.restore(mid, branch_id=7)
        first = _episode(env, actions[len(snapshots) // 2:len(reference)])
        replayer.restore(mid, branch_id=7)
        assert _episode(replayer, actions[len(snapshots) // 2:len(reference)]) == first


# ----------------------------------------------------------------------------- demonstrations


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_demonstrations_earn_reward_one(env_id):
    env = make_env(env_id)
    n = _n_tasks(env, N_DEMOS)
    assert n > 0
    failures = []
    for i in range(n):
        env.reset(seed=i, options={"index": i})
        task = env.state.task
        turns = env.demonstrate(task)
        bad = [t for t in turns if parse_turn(t).error is not None]
        result = _episode(env, turns)
        if bad or not result or result[-1][1] != 1.0 or not result[-1][2]:
            failures.append((task.id, bad[:1], result[-1:] if result else None))
    assert failures == [], f"{len(failures)} of {n} demonstrations failed"


# ----------------------------------------------------------------------------- fuzzing

_DEEP = "[" * 5000 + "]" * 5000
ADVERSARIAL = [
    "", " ", "\n" * 1000, "x" * (1 << 20), "<answer>" + "9" * (1 << 20) + "</answer>", "<tool_call>" * 90_000,
    "<answer>" * 100_000, "<think>" + "y" * 100_000, "</think>" * 50_000,
    "<tool_call>{broken json</tool_call>", "<tool_call>{}</tool_call>", "<tool_call>null</tool_call>",
    '<tool_call>{"name": 42, "arguments": {}}</tool_call>', '<tool_call>{"name": "x", "arguments": "[1,2"}</tool_call>',
    '<tool_call>{"name": "x", "arguments": ' + _DEEP + "}</tool_call>",
    '<tool_call>{"name": "x", "arguments": {"n": 1' + "0" * 10_000 + "}}</tool_call>",
    "<answer><answer>1</answer></answer>", "<answer><tool_call>{}</tool_call></answer>",
    "<tool_call><answer>1</answer></tool_call>", "<think><answer>1</answer></think>",
    "<answer>🎲 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 \U0010ffff</answer>", "<answer>\ud800\udfff</answer>", "\x00\x01\x02<answer>\x00</answer>",
    "<answer>" + "1 or " * 1000 + "1</answer>", "<answer></answer>", "<answer>   </answer>",
    "".join(format_tool_call("no_such_tool", {"i": i}) for i in range(9)),
    "<ANSWER>1</ANSWER>", "< answer >1</ answer >", "<tool_call>\n" + json.dumps({"name": "🎲", "arguments": {}}) + "\n</tool_call>",
]

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_unicode = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=200)


@st.composite
def actions(draw, tools: list[dict]):
    kind = draw(st.sampled_from(["adversarial", "text", "answer", "tool", "tool_valid_names"]))
    if kind == "adversarial":
        return draw(st.sampled_from(ADVERSARIAL))
    if kind == "text":
        return draw(_unicode)
    if kind == "answer":
        return format_answer(draw(_unicode))
    names = [t["function"]["name"] for t in tools] or ["missing"]
    name = draw(st.sampled_from(names) if kind == "tool_valid_names" else st.text(max_size=12) | st.sampled_from(names))
    spec = next((t for t in tools if t["function"]["name"] == name), None)
    keys = list(spec["function"]["parameters"].get("properties", {})) if spec else []
    key = st.sampled_from(keys) | st.text(max_size=8) if keys else st.text(max_size=8)
    args = draw(st.dictionaries(key, _json_values, max_size=4))
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}, allow_nan=True) + "</tool_call>"


def _check_step(env, action: str) -> bool:
    obs, reward, terminated, truncated, info = env.step(action)
    assert isinstance(obs, str) and env.observation_space.contains(obs)
    assert isinstance(terminated, bool) and isinstance(truncated, bool)
    assert math.isfinite(reward) and 0.0 <= reward <= 1.0
    if parse_turn(action).error is not None:
        assert info.get("parse_error") or obs.startswith("Error"), "a malformed turn must give an error observation"
        assert reward == 0.0
    return terminated or truncated


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_fuzzed_actions_give_observations_not_exceptions(env_id):
    env = make_env(env_id)
    _, info = env.reset(seed=0, options={"index": 0})
    tools = info.get("tools", [])
    n_tasks = max(1, _n_tasks(env, 20))

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(index=st.integers(0, n_tasks - 1), turns=st.lists(actions(tools), min_size=1, max_size=3))
    def run(index, turns):
        env.reset(seed=index, options={"index": index})
        for action in turns:
            if _check_step(env, action):
                break
        env.snapshot()  # whatever happened, the state still forks

    run()


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_every_adversarial_action(env_id):
    env = make_env(env_id)
    for action in ADVERSARIAL:
        env.reset(seed=0, options={"index": 0})
        _check_step(env, action)


# ----------------------------------------------------------------------------- reward hacking


def _hedges(answer: str, wrong: list[str]) -> list[str]:
    w1, w2 = wrong[0], wrong[1 % len(wrong)]
    hedges = [
        format_answer(f"{answer} or {w1} or {w2}"), format_answer(f"{w1} or {answer}"),
        format_answer(f"{w1}, {answer}, {w2}"), format_answer(f"{w1}; {answer}"),
        format_answer(", ".join(wrong[:20] + [answer])), format_answer(answer) + format_answer(w1),
        format_answer("\n".join([w1, answer])),
    ]
    try:
        value = float(answer)
    except ValueError:
        return hedges
    if value.is_integer() and abs(value) < 10_000:
        hedges.append(format_answer(" ".join(str(i) for i in range(int(value) - 300, int(value) + 300))))
        hedges.append(format_answer(", ".join(str(i) for i in range(int(value) - 300, int(value) + 300))))
    return hedges


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_hedged_answers_get_zero(env_id):
    env = make_env(env_id)
    n = _n_tasks(env, 12)
    finals: list[tuple[int, list[str], str]] = []
    for i in range(n):
        env.reset(seed=i, options={"index": i})
        turns = env.demonstrate(env.state.task)
        answer = parse_turn(turns[-1]).answer
        if answer is not None:
            finals.append((i, turns, answer))
    if len(finals) < 2:
        pytest.skip(f"{env_id}: fewer than two demonstrations end with an <answer>; hedging does not apply")
    checked = 0
    for i, turns, answer in finals[:6]:
        env.reset(seed=i, options={"index": i})
        _episode(env, turns[:-1])
        before = env.snapshot()
        # Wrong answers: other tasks' answers that this task scores 0.
        wrong = []
        for _, _, other in finals:
            env.restore(before)
            if other.strip() != answer.strip() and env.step(format_answer(other))[1] == 0.0:
                wrong.append(other)
        if not wrong:
            continue
        for hedge in _hedges(answer, wrong):
            env.restore(before)
            reward = env.step(hedge)[1]
            assert reward == 0.0, f"{env_id} task {i}: hedged answer {hedge[:120]!r} got reward {reward}"
            checked += 1
        env.restore(before)
        assert env.step(format_answer(answer))[1] == 1.0  # the plain answer still counts
    if checked == 0:
        pytest.skip(f"{env_id}: every task's answer text earns the reward (the env scores state, not the answer's "
                    "text), so hedging does not apply")


# ----------------------------------------------------------------------------- the CLI


def test_envs_command_lists_the_registry(capsys):
    from trace_gym.cli.main import main
    from trace_gym.cli.play import env_rows

    assert main(["envs", "--json", "--no-tools"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in rows] == ENV_IDS
    math_row = next(r for r in rows if r["id"] == "trace_gym/MathCalc-v0")
    assert math_row["description"].startswith("Procedural arithmetic") and math_row["status"] == "ok"
    built = {r["id"]: r for r in env_rows(build=True, ids=["trace_gym/MathCalc-v0", "trace_gym/ToolCalls-v0"])}
    assert built["trace_gym/MathCalc-v0"]["tools"] == ["calculator"] and built["trace_gym/MathCalc-v0"]["status"] == "ok"
    assert main(["envs", "--timeout", "5"]) == 0
    table = capsys.readouterr().out
    assert "MathCalc-v0" in table and "calculator" in table


def test_play_reads_turns_from_stdin_until_a_dot_line(monkeypatch, capsys):
    from trace_gym.cli.main import main

    env = trace_gym.make("trace_gym/MathCalc-v0")
    env.reset(options={"index": 2})
    task = env.state.task
    turns = [
        "<think>first the calculator</think>",
        '<tool_call>{"name": "calculator", "arguments": {"expression": "' + task.metadata["combined"] + '"}}</tool_call>',
        ".",
        "this line is not a valid turn",
        ".",
        f"<answer>{task.ground_truth}</answer>",
        ".",
    ]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(turns) + "\n"))
    assert main(["play", "trace_gym/MathCalc-v0", "--task-id", task.id]) == 0
    out = capsys.readouterr().out
    assert task.prompt[:30] in out and "calculator" in out
    assert "error" in out and "no action found" in out
    assert "reward 1" in out and "correct" in out


def test_play_end_of_input_and_errors(monkeypatch, capsys):
    from trace_gym.cli.main import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("<answer>-1</answer>"))  # EOF ends the turn and the game
    assert main(["play", "trace_gym/MathCalc-v0", "--seed", "3"]) == 0
    assert "reward 0" in capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["play", "trace_gym/MathCalc-v0", "--index", "1"]) == 0
    assert "unfinished" in capsys.readouterr().out
    assert main(["play", "trace_gym/MathCalk-v0"]) == 2
    assert "did you mean" in capsys.readouterr().err  # errors go to stderr, one `error:` line
    assert main(["play", "trace_gym/MathCalc-v0", "--task-id", "nope"]) == 2
    assert main(["play", "trace_gym/GSM8K-v0", "--env-arg", f"data_files={DATA / 'gsm8k_test.jsonl'}", "--demo"]) == 0
    assert "reward 1" in capsys.readouterr().out


def test_play_as_a_real_command():
    """The installed ``trace-gym`` command, driven through a pipe."""
    env = trace_gym.make("trace_gym/MathCalc-v0", levels=[1])
    env.reset(options={"index": 0})
    task = env.state.task
    stdin = f"<answer>{task.ground_truth}</answer>\n.\n"
    proc = subprocess.run([sys.executable, "-m", "trace_gym.cli", "play", "trace_gym/MathCalc-v0", "--task-id", task.id],
                          input=stdin, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert task.prompt in proc.stdout and "reward 1" in proc.stdout
