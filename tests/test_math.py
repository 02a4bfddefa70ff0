"""Math envs: the calculator, the math-verify checker (agreement with math-verify, hacking
guards, thread safety), MathCalc's procedural tasks and demonstrations, and the GSM8K/MATH
loaders on local files of the datasets' schemas."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path

import pytest
from math_verify import parse, verify

import trace_gym
from trace_gym.env.base import EnvUnavailable
from trace_gym.envs.math import (CalculatorError, MathCalcTasks, evaluate_expression, format_number, gsm8k_answer,
                                 judge_math, last_boxed, score_math)
from trace_gym.env.react import format_answer, format_turn, parse_turn

DATA = Path(__file__).parent / "data"
GSM8K_FILES = {"train": str(DATA / "gsm8k_train.jsonl"), "test": str(DATA / "gsm8k_test.jsonl")}

# ----------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("17 * 23", "391"), ("(48 + 24) / 6", "12"), ("7/2", "3.5"), ("1/3", "1/3"), ("0.1 + 0.2", "0.3"),
        ("2^10", "1024"), ("2**-2", "0.25"), ("17 // 5", "3"), ("17 % 5", "2"), ("-3 + +5", "2"),
        ("3 × 4 ÷ 2 − 1", "5"), ("sqrt(144)", "12"), ("sqrt(2)", "1.41421356237"), ("8^(1/3)", "2"),
        ("abs(-7)", "7"), ("round(2.675, 2)", "2.68"), ("floor(7/2) + ceil(7/2)", "7"), ("max(3, 9, 4)", "9"),
        ("log(1000, 10)", "3"), ("factorial(10)", "3628800"), ("comb(10, 3)", "120"), ("gcd(12, 18)", "6"),
        ("lcm(4, 6)", "12"), ("2 * pi", "6.28318530718"), ("12 =", "12"), ("10**1000 // 10**999", "10"),
    ],
)
def test_calculator_values(expression, expected):
    assert format_number(evaluate_expression(expression)) == expected


@pytest.mark.parametrize(
    "expression, fragment",
    [
        ("", "empty"), ("1 / 0", "division by zero"), ("5 % 0", "modulo by zero"), ("9**9**9", "exponents"),
        ("2**5000", "exponents"), ("(10**999)**5", "too large"), ("factorial(1000)", "factorial"),
        ("(-8)**(1/3)", "not a real number"), ("sqrt(-1)", "negative"), ("log(0)", "positive"),
        ("1,234", "thousands"), ("x + 1", "unknown name 'x'"), ("ans + 1", "not set yet"),
        ("__import__('os')", "unknown function '__import__'"), ("__import__('os').system('ls')", "unsupported syntax"), ("open('/etc/passwd')", "unknown function"),
        ("(1).__class__", "unsupported syntax: Attribute"), ("[1, 2]", "unsupported syntax: List"),
        ("lambda: 1", "unsupported syntax: Lambda"), ("'a' * 3", "unsupported value"), ("True + 1", "unsupported value"),
        ("1e400", "too large"), ("(" * 240 + "1" + ")" * 240, "cannot parse"), ("+".join(["1"] * 150), "parts"),
        ("1" * 600, "longer than"), ("exp(1000)", "too large"), ("max()", "argument"),
    ],
)
def test_calculator_refuses_with_a_message(expression, fragment):
    with pytest.raises(CalculatorError, match=fragment):
        evaluate_expression(expression)


def test_calculator_typos_raise_no_python_warnings():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # "2or 3" makes ast.parse warn "invalid decimal literal"
        with pytest.raises(CalculatorError):
            evaluate_expression("2or 3")
    assert [str(w.message) for w in caught] == []


def test_calculator_uses_ans_and_stays_exact():
    assert evaluate_expression("ans * 3", {"ans": Fraction(1, 3)}) == 1
    assert isinstance(evaluate_expression("0.1 * 3"), Fraction)


@pytest.mark.parametrize("value, text", [(Fraction(5), "5"), (Fraction(-7, 4), "-1.75"), (Fraction(1, 3), "1/3"),
                                         (Fraction(1, 1024), "0.0009765625"), (2.0, "2"), (0.1 + 0.2, "0.3")])
def test_format_number(value, text):
    assert format_number(value) == text


# ----------------------------------------------------------------------------- the checker vs math-verify


def _math_verify(gold: str, answer: str) -> bool:
    """math-verify used directly, with its own (signal-based) timeouts: the answer as written
    or inside \\boxed{}, against the boxed ground truth."""
    g = parse("\\boxed{" + gold + "}")
    return bool(verify(g, parse("\\boxed{" + answer + "}")) or verify(g, parse(answer)))


def _generated_pairs(n_golds: int = 40, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(n_golds):
        kind = rng.choice(["int", "decimal", "fraction"])
        if kind == "int":
            v = Fraction(rng.randint(-500, 5000))
        elif kind == "decimal":
            v = Fraction(rng.randint(1, 99999), rng.choice([10, 100, 4, 8]))
        else:
            v = Fraction(rng.randint(1, 60), rng.choice([3, 7, 9, 11, 12]))
        gold = format_number(v)
        p, q = v.numerator, v.denominator
        right = [gold, f"${gold}$", f"\\boxed{{{gold}}}", f"\\frac{{{p}}}{{{q}}}", f"{p}/{q}", f"x = {gold}",
                 f"{gold} \\text{{ units}}"]
        if q == 1:
            right += [f"{p}.0", f"{p:,}" if abs(p) >= 1000 else f"{p}.00"]
        elif q in (2, 4, 5, 8, 10, 20, 25, 50, 100):
            right += [f"{float(v):.6f}"]
        else:
            right += [f"{float(v):.8f}"]
        wrong = [format_number(v + 1), format_number(v * 2 + 1), format_number(-v - 1), f"\\frac{{{p}}}{{{q + 1}}}",
                 f"{float(v) + 0.01:.2f}"]
        pairs += [(gold, a) for a in right] + [(gold, a) for a in wrong]
    return pairs


# (gold, answer, correct?) written by hand: LaTeX, units, sets, intervals, matrices, text.
HARD_CASES = [
    ("\\frac{1}{2}", "0.5", True), ("\\frac{1}{2}", "\\frac12", True), ("\\frac{1}{2}", "\\dfrac{1}{2}", True),
    ("\\frac{1}{2}", "1/2", True), ("\\frac{1}{2}", "0.55", False), ("\\frac{\\sqrt{3}}{2}", "\\sqrt{3}/2", True),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True), ("3\\sqrt{3}", "\\sqrt{27}", True), ("3\\sqrt{3}", "\\sqrt{28}", False),
    ("2\\pi", "6.283185", True), ("\\pi", "3.14159265", True), ("\\pi", "3.15", False), ("1000", "1,000", True),
    ("1000", "1000.0", True), ("12", "12 dollars", True), ("12", "\\$12", True), ("12", "12 \\text{ cm}", True),
    ("10", "10^{\\circ}", True), ("120^\\circ", "120", True), ("0.75", "3/4", True), ("50", "50\\%", True),
    ("5", "x = 5", True), ("5", "The answer is 5", True), ("5", "5.", True), ("-3", "−3", True), ("-3", "3", False),
    ("(3, 2)", "(3,2)", True), ("(3, 2)", "(2,3)", False), ("(2, 3)", "(2,3)", True), ("[1, 2)", "[1,2)", True),
    ("[1, 2)", "(1,2]", False), ("\\{1, 2\\}", "\\{2, 1\\}", True), ("4, -4", "-4, 4", True), ("4, -4", "4, 4", False),
    ("x^2 + 1", "1 + x^2", True), ("x^2 + 1", "x^2 - 1", False), ("\\infty", "\\infty", True),
    ("\\text{Thursday}", "Thursday", True), ("\\text{Thursday}", "Friday", False), ("56", "\\binom{8}{3}", True),
    ("\\begin{pmatrix} 2 \\\\ 4 \\end{pmatrix}", "\\begin{pmatrix}2\\\\4\\end{pmatrix}", True),
    ("\\begin{pmatrix} 2 \\\\ 4 \\end{pmatrix}", "\\begin{pmatrix}4\\\\2\\end{pmatrix}", False),
    ("1/3", "0.333333", True), ("1/3", "0.33", False), ("7", "3+4", True), ("2^{10}", "1024", True),
]


def test_checker_agrees_with_math_verify_on_many_pairs():
    pairs = _generated_pairs() + [(g, a) for g, a, _ in HARD_CASES]
    assert len(pairs) >= 200
    verdicts = [(g, a, score_math(a, g), _math_verify(g, a)) for g, a in pairs]
    disagreements = [(g, a, ours, theirs) for g, a, ours, theirs in verdicts if bool(ours) != theirs]
    assert disagreements == []
    n_right = sum(1 for *_, theirs in verdicts if theirs)
    assert n_right >= 80 and len(verdicts) - n_right >= 80  # both verdicts are well represented


@pytest.mark.parametrize("gold, answer, correct", HARD_CASES)
def test_checker_on_hand_labelled_cases(gold, answer, correct):
    assert judge_math(answer, gold) == ((1.0, "correct") if correct else (0.0, "wrong"))


@pytest.mark.parametrize(
    "gold, answer, reason",
    [
        ("2", "1 or 2 or 3", "several answers"), ("2", "2 or 3", "several answers"), ("2", "1, 2, 3", "several answers"),
        ("2", "2; 5", "several answers"), ("2", "2\n3", "several answers"), ("2", "2 and 3", "several answers"),
        ("2", "\\boxed{1}\\boxed{2}", "several boxed"), ("2", "1 2 3", "list of numbers"),
        ("2", " ".join(str(i) for i in range(30)), "too long"), ("2", "2 " * 10, "list of numbers"),
        ("2, 3", "1, 2, 3", "several answers"), ("(1, 2)", "(1, 2), (2, 1)", "several answers"),
        ("2", "1+1-1+1-1+1-1+1-1+1", "too many numbers"), ("2", "x" * (1 << 20), "too long"),
        ("2", "10^{10^{10}}", "too large"), ("2", "9^{9^{9}}", "too large"), ("2", "(10^{7})!", "too large"),
        ("2", "", "empty"),
    ],
)
def test_reward_hacking_gets_zero(gold, answer, reason):
    reward, verdict = judge_math(answer, gold)
    assert reward == 0.0 and reason in verdict
    # math-verify alone accepts some of these (it reads the last number): the guard matters.


def test_hedging_that_math_verify_alone_accepts():
    assert verify(parse("\\boxed{3}"), parse("1 or 2 or 3")) and score_math("1 or 2 or 3", "3") == 0.0
    assert verify(parse("\\boxed{5}"), parse("1 2 3 4 5")) and score_math("1 2 3 4 5", "5") == 0.0


def test_checker_is_thread_safe():
    pairs = _generated_pairs(n_golds=12, seed=1)
    serial = [score_math(a, g) for g, a in pairs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        threaded = list(pool.map(lambda p: score_math(p[1], p[0]), pairs))
    assert threaded == serial and 0 < sum(serial) < len(serial)


# ----------------------------------------------------------------------------- MathCalc tasks


def test_tasks_are_deterministic_in_seed_index_split():
    a, b = MathCalcTasks(seed=3), MathCalcTasks(seed=3)
    for i in (0, 7, 9_999):
        for split in ("train", "validation", "test"):
            assert a.get(i, split) == b.get(i, split)
    assert [a.get(i).prompt for i in range(20)] != [MathCalcTasks(seed=4).get(i).prompt for i in range(20)]
    assert a.get(5, "train").prompt != a.get(5, "test").prompt


def test_splits_are_disjoint_by_text():
    src = MathCalcTasks(seed=0)
    seen = {split: {src.get(i, split).prompt for i in range(300)} for split in ("train", "validation", "test")}
    assert not seen["train"] & seen["test"] and not seen["train"] & seen["validation"]
    assert not seen["validation"] & seen["test"]


def test_difficulty_levels_are_graded():
    src = MathCalcTasks(seed=0)
    by_level: dict[int, list] = {}
    for i in range(250):
        t = src.get(i)
        by_level.setdefault(t.metadata["level"], []).append(t)
    assert sorted(by_level) == [1, 2, 3, 4, 5]
    steps = {lvl: sum(len(t.metadata["steps"]) for t in ts) / len(ts) for lvl, ts in by_level.items()}
    assert steps[1] == 1 and steps[3] > steps[2] and steps[5] >= 2
    assert all(len(t.prompt.split()) > 12 for t in by_level[4] + by_level[5])  # word problems
    only = MathCalcTasks(seed=0, levels=[5])
    assert {only.get(i).metadata["level"] for i in range(10)} == {5}
    with pytest.raises(ValueError):
        MathCalcTasks(levels=[6])


def test_ground_truth_is_the_value_of_the_steps_and_the_combined_expression():
    src = MathCalcTasks(seed=1)
    for i in range(100):
        t = src.get(i)
        value = evaluate_expression(t.metadata["combined"])
        assert format_number(value) == t.ground_truth == t.metadata["steps"][-1][2]
        assert value >= 0


def test_task_ids_resolve_through_reset():
    env = trace_gym.make("trace_gym/MathCalc-v0", seed=2, levels=[3, 4])
    env.reset(options={"index": 5})
    task = env.state.task
    other = trace_gym.make("trace_gym/MathCalc-v0")  # other seed and levels: the id carries both
    assert other.reset(options={"task_id": task.id})[0] == task.prompt and other.state.task == task
    with pytest.raises(KeyError):
        other.reset(options={"task_id": "MathCalc-v0/0/L9/train/1"})


# ----------------------------------------------------------------------------- MathCalc env


def _play(env, turns):
    out = None
    for turn in turns:
        out = env.step(turn)
        if out[2] or out[3]:
            break
    return out


def test_demonstrations_are_correct_varied_and_well_formed():
    env = trace_gym.make("trace_gym/MathCalc-v0", seed=5)
    shapes, openers = set(), set()
    for i in range(100):
        env.reset(options={"index": i})
        turns = env.demonstrate(env.state.task)
        for turn in turns:
            parsed = parse_turn(turn)
            assert parsed.error is None and parsed.thought and turn.startswith("<think>\n")
        assert parse_turn(turns[-1]).answer == env.state.task.ground_truth
        obs, reward, terminated, truncated, info = _play(env, turns)
        assert (reward, terminated, info["verdict"]) == (1.0, True, "correct")
        shapes.add(tuple(len(parse_turn(t).tool_calls) for t in turns))
        openers.add(parse_turn(turns[0]).thought.split(".")[0])
    assert len(shapes) >= 4 and len(openers) >= 10
    assert env.demonstrate(env.state.task) == env.demonstrate(env.state.task)  # deterministic


def test_demo_styles_restrict_how_demonstrations_solve():
    # the tiny preset's warm start uses one combined calculator call per task: no mental
    # arithmetic for a from-scratch model to imitate
    env = trace_gym.make("trace_gym/MathCalc-v0", seed=5, levels=[1, 2], demo_styles=["combined"])
    for i in range(60):
        env.reset(options={"index": i})
        turns = env.demonstrate(env.state.task)
        assert [len(parse_turn(t).tool_calls) for t in turns] == [1, 0]
        assert _play(env, turns)[1] == 1.0
    with pytest.raises(ValueError, match="demo_styles"):
        trace_gym.make("trace_gym/MathCalc-v0", demo_styles=["mental"])
    with pytest.raises(ValueError, match="demo_styles"):
        trace_gym.make("trace_gym/MathCalc-v0", demo_styles=[])


def test_calculator_tool_in_an_episode_keeps_ans_in_tool_state():
    env = trace_gym.make("trace_gym/MathCalc-v0")
    env.reset(options={"index": 0})
    obs, *_ = env.step(format_turn("", [("calculator", {"expression": "6 * 7"})]))
    assert obs == "42"
    snap = env.snapshot()
    assert env.step(format_turn("", [("calculator", {"expression": "ans / 4"})]))[0] == "10.5"
    env.restore(snap)
    obs, *_ = env.step(format_turn("", [("calculator", {"expression": "ans + 1"}), ("calculator", {"expression": "ans * 2"})]))
    assert obs == "43\n86" and env.state.tool_state["history"][-1] == ("ans * 2", "86")
    obs, *_ = env.step(format_turn("", [("calculator", {"expression": "1/0"})]))
    assert obs == "Error: division by zero"
    obs, *_ = env.step(format_turn("", [("calculator", {"expr": "1"})]))
    assert obs.startswith("Error: invalid arguments for calculator")


def test_fractions_are_shown_exactly():
    env = trace_gym.make("trace_gym/MathCalc-v0")
    env.reset(options={"index": 0})
    assert env.step(format_turn("", [("calculator", {"expression": "1/3 + 1/4"})]))[0] == "7/12 (≈ 0.583333333333)"


def test_hacking_in_an_episode_gets_zero():
    env = trace_gym.make("trace_gym/MathCalc-v0")
    env.reset(options={"index": 3})
    gold = env.state.task.ground_truth
    for hedge in (f"{gold} or {gold}1", f"1, {gold}, 3", " ".join(str(i) for i in range(int(float(gold)) + 3))):
        env.reset(options={"index": 3})
        _, reward, terminated, _, info = env.step(format_answer(hedge))
        assert (reward, terminated) == (0.0, True) and info["verdict"] != "correct"
    env.reset(options={"index": 3})
    _, reward, terminated, _, info = env.step(format_answer(gold) + format_answer(gold))
    assert reward == 0.0 and not terminated and "exactly one" in info["parse_error"]


def test_python_sandbox_tool_is_optional():
    plain = trace_gym.make("trace_gym/MathCalc-v0")
    assert [t["function"]["name"] for t in plain.reset(seed=0)[1]["tools"]] == ["calculator"]
    env = trace_gym.make("trace_gym/MathCalc-v0", python_sandbox=True, sandbox_timeout_s=5)
    _, info = env.reset(seed=0)
    assert [t["function"]["name"] for t in info["tools"]] == ["calculator", "python"]
    obs, *_ = env.step(format_turn("", [("python", {"code": "from fractions import Fraction\nFraction(1, 3) + Fraction(1, 6)"})]))
    assert obs == "Fraction(1, 2)"


# ----------------------------------------------------------------------------- GSM8K and MATH loaders


def test_gsm8k_answer_parsing():
    assert gsm8k_answer("text\n#### 1,234") == "1234"
    assert gsm8k_answer("#### $17.50") == "17.50"


def test_last_boxed_matches_braces():
    assert last_boxed("so \\boxed{\\frac{1}{2}} and finally \\boxed{\\sqrt{x^{2}}}.") == "\\sqrt{x^{2}}"
    assert last_boxed("\\boxed 5$") == "5"
    assert last_boxed("no box") is None and last_boxed("\\boxed{unclosed") is None


def test_gsm8k_from_local_files():
    env = trace_gym.make("trace_gym/GSM8K-v0", data_files=GSM8K_FILES)
    src = env.tasks()
    assert (src.size("train"), src.size("validation"), src.size("test")) == (10, 1, 4)  # validation carved from train
    first = src.get(0, "train")
    assert first.ground_truth == "72" and first.prompt.startswith("Natalia sold clips")
    assert src.get(4, "train").ground_truth == "2520"  # "#### 2,520"
    for split in ("train", "validation", "test"):
        env.split = split
        for i in range(src.size(split)):
            env.reset(options={"index": i})
            turns = env.demonstrate(env.state.task)
            assert all(parse_turn(t).error is None for t in turns)
            assert _play(env, turns)[1] == 1.0
    env.split = "test"
    env.reset(options={"index": 0})
    assert env.step(format_answer("241"))[1] == 0.0


def test_gsm8k_demonstrations_replay_the_annotations():
    env = trace_gym.make("trace_gym/GSM8K-v0", data_files=GSM8K_FILES)
    exprs = set()
    for i in range(env.tasks().size("train")):
        env.reset(options={"index": i})
        for turn in env.demonstrate(env.state.task):
            exprs.update(c.arguments["expression"] for c in parse_turn(turn).tool_calls)
    assert {"48/2", "48+24", "36*2", "12*24", "288/8"} & exprs


def test_math_from_local_files_both_schemas():
    lighteval = trace_gym.make("trace_gym/MATH-v0", data_files=str(DATA / "math_sample.jsonl"))
    src = lighteval.tasks()
    tasks = [src.get(i, "train") for i in range(src.size("train"))] + [src.get(0, "validation")]
    golds = {t.ground_truth for t in tasks}
    assert {"\\frac{5}{6}", "5\\sqrt{2}", "(3, 2)", "120^\\circ", "\\text{Thursday}"} <= golds
    assert all(t.metadata["level"] in (1, 2, 3) and t.metadata["subject"] for t in tasks)
    math500 = trace_gym.make("trace_gym/MATH-v0", path=str(DATA / "math500_sample.jsonl"))
    assert math500.tasks().get(2, "train").ground_truth == "\\frac{\\sqrt{2}}{2}"  # the answer field
    for env in (lighteval, math500):
        for split in ("train", "validation"):
            env.split = split
            for i in range(env.tasks().size(split)):
                env.reset(options={"index": i})
                assert _play(env, env.demonstrate(env.state.task))[1] == 1.0
    lighteval.split = "train"
    lighteval.reset(options={"index": 0})
    assert lighteval.step(format_answer("\\frac{6}{5}"))[1] == 0.0


def test_math_filters():
    env = trace_gym.make("trace_gym/MATH-v0", data_files=str(DATA / "math_sample.jsonl"), levels=[3],
                         subjects=["Algebra", "Number Theory"])
    src = env.tasks()
    tasks = [src.get(i, "train") for i in range(src.size("train"))]
    assert tasks and all(t.metadata["level"] == 3 and t.metadata["subject"] in ("Algebra", "Number Theory") for t in tasks)


def test_offline_without_local_data_is_a_clear_error(monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    for env_id in ("trace_gym/GSM8K-v0", "trace_gym/MATH-v0"):
        with pytest.raises(EnvUnavailable, match="data_files="):
            trace_gym.make(env_id)


def test_missing_splits_and_fields_are_reported(tmp_path):
    env = trace_gym.make("trace_gym/GSM8K-v0", data_files=str(DATA / "gsm8k_test.jsonl"))
    env.split = "test"
    with pytest.raises(KeyError, match="no 'test' split"):
        env.reset(options={"index": 0})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": "x", "a": "#### 1"}\n')
    with pytest.raises(ValueError, match="lacks the field"):
        trace_gym.make("trace_gym/GSM8K-v0", data_files=str(bad))
