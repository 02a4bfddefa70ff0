"""The math environments: ``trace_gym/MathCalc-v0``, ``trace_gym/GSM8K-v0`` and ``trace_gym/MATH-v0``.

Each gives the policy a ``calculator`` tool (:func:`~trace_gym.envs.math.calculator.evaluate_expression`)
and judges a final ``<answer>`` with :func:`~trace_gym.envs.math.judge.judge_math` (the
verdict lands in ``info["verdict"]``). ``python_sandbox=True`` adds a ``python`` tool that runs
code in a sandboxed subprocess (:mod:`trace_gym.envs.sandbox`). ``demonstrate`` writes a
correct trajectory for a task (used for SFT warm starts).
"""

from __future__ import annotations

import random
import re
import zlib
from typing import Any, Iterable

from trace_gym.env.base import AgentEnv, TurnResult
from trace_gym.env.react import ParsedTurn, format_turn
from trace_gym.env.tools import Tool
from trace_gym.envs.math.calculator import CalculatorError, _describe_result, evaluate_expression
from trace_gym.envs.math.datasets import _math_level, _RowTasks, gsm8k_answer, load_rows
from trace_gym.envs.math.generator import LEVELS, MathCalcTasks, _n
from trace_gym.envs.math.judge import judge_math, last_boxed
from trace_gym.task import Task

__all__ = ["GSM8KEnv", "MATHEnv", "MathCalcEnv", "MATH_SYSTEM_PROMPT"]

MATH_SYSTEM_PROMPT = (
    "You are a careful math assistant. In each turn, think inside <think>...</think>. To compute, call a tool as "
    "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"17 * 23\"}}</tool_call>; its result "
    "comes back as the next message. When you know the result, reply with only the final answer (a number or an "
    "expression, no units) inside <answer>...</answer>."
)


class _MathEnv(AgentEnv):
    """Shared parts of the math envs: the calculator (and optional Python) tool, math-verify
    scoring with hacking guards, and the verdict in ``info``."""

    default_max_turns = 8
    system_prompt = MATH_SYSTEM_PROMPT

    def __init__(self, *, python_sandbox: bool = False, sandbox_timeout_s: float = 5.0, **kwargs: Any):
        super().__init__(**kwargs)
        self.python_sandbox = bool(python_sandbox)
        self._sandbox = None
        if self.python_sandbox:
            from trace_gym.envs.sandbox import PythonSandbox

            self._sandbox = PythonSandbox(timeout_s=sandbox_timeout_s, allow_packages=SANDBOX_PACKAGES)

    @classmethod
    def code_isolation(cls) -> dict[str, Any] | None:
        """The Python tool's sandbox on this machine (see :func:`trace_gym.envs.sandbox.isolation_report`)."""
        from trace_gym.envs.sandbox import isolation_report

        return isolation_report()

    def score(self, task: Task, answer: str) -> float:
        """1.0 if math-verify accepts ``answer`` for the task's ground truth (see :func:`judge_math`)."""
        return judge_math(answer, str(task.ground_truth))[0]

    def turn(self, parsed: ParsedTurn, action: str) -> TurnResult:
        """The base turn, with the checker's verdict (``"correct"``, ``"wrong"``, or why an
        answer got 0) in ``info["verdict"]``."""
        if parsed.error is None and parsed.answer is not None:
            assert self.state is not None
            reward, verdict = judge_math(parsed.answer, str(self.state.task.ground_truth))
            return TurnResult("", reward=reward, terminated=True, info={"answer": parsed.answer, "verdict": verdict})
        return super().turn(parsed, action)

    def initial_tool_state(self, task: Task) -> dict[str, Any]:
        return {"ans": None, "history": []}

    def build_tools(self, task: Task) -> list[Tool]:
        def calculator(expression: str) -> str:
            """Evaluate an arithmetic expression exactly and return the result.

            Args:
                expression: For example "17 * 23", "(48 + 24) / 6", "2^10" or "sqrt(2)". Supports + - * / // % ^,
                    parentheses, sqrt, abs, round, floor, ceil, min, max, log, exp, sin, cos, tan, factorial,
                    comb, gcd, lcm, pi, e, and ans (the previous result).
            """
            assert self.state is not None
            tool_state = self.state.tool_state
            value = evaluate_expression(expression, {"ans": tool_state["ans"]})
            text = _describe_result(value)
            tool_state["ans"] = value
            tool_state["history"].append((expression[:200], text))
            return text

        tools = [Tool.from_function(calculator)]
        if self._sandbox is not None:
            tools.append(self._sandbox.as_tool())
        return tools


_OPENERS = ["", "Let me work through this.", "I'll do this step by step.", "Let me set this up.",
            "Breaking it into steps.", "First things first."]
_BRIDGES = ["The calculator gives {r}.", "That comes to {r}.", "Got {r}.", "So that's {r}.", "{r}, good."]
_CLOSERS = ["So the answer is {a}.", "That gives {a}.", "The answer is {a}.", "So {label} is {a}.",
            "Putting it together: {a}."]


def _pretty(expr: str) -> str:
    return expr.replace(" * ", " × ").replace("*", "×")


def _calc(expression: str) -> tuple[str, dict[str, Any]]:
    return ("calculator", {"expression": expression})


SANDBOX_PACKAGES = ("sympy", "numpy")
"""Packages the optional Python tool may import (read-only); nothing else of site-packages is visible."""


class MathCalcEnv(_MathEnv):
    """Procedural arithmetic and word problems at five difficulty levels, with a calculator tool.

    Keyword arguments: ``seed`` (the task source's seed), ``split``, ``levels`` (a subset of
    1..5; level 1 is one small operation, 5 multi-step word problems with percentages,
    ratios and fractions), ``python_sandbox`` (add a sandboxed ``python`` tool),
    ``max_turns``, ``demo_styles`` (which solution styles :meth:`demonstrate` may use, a
    subset of ``DEMO_STYLES``; a small model warm-started from scratch learns the tool
    faster from ``["combined"]`` alone). ``task.metadata`` holds ``level``, ``kind`` and
    the solution ``steps``.
    """

    env_id = "trace_gym/MathCalc-v0"
    default_max_turns = 6
    #: Demonstration styles: mental arithmetic (one easy step), one combined calculator
    #: expression, one call per step, independent steps as parallel calls.
    DEMO_STYLES = ("direct", "combined", "stepwise", "parallel")

    def __init__(self, *, seed: int = 0, levels: Iterable[int] = LEVELS,
                 demo_styles: Iterable[str] = DEMO_STYLES, **kwargs: Any):
        super().__init__(seed=seed, **kwargs)
        self._source = MathCalcTasks(seed=seed, levels=levels)
        self._demo_styles = tuple(demo_styles)
        unknown = sorted(set(self._demo_styles) - set(self.DEMO_STYLES))
        if unknown or not self._demo_styles:
            raise ValueError(f"demo_styles must be a non-empty subset of {list(self.DEMO_STYLES)}, "
                             f"got {list(self._demo_styles)}")

    def tasks(self) -> MathCalcTasks:
        return self._source

    def demonstrate(self, task: Task) -> list[str]:
        """A correct trajectory: mental arithmetic for one easy step, otherwise calculator
        calls (one combined expression, one call per step, or independent steps in
        parallel) followed by the answer. The style is chosen deterministically per task."""
        rng = random.Random(zlib.crc32(task.id.encode()))
        steps = [tuple(s) for s in task.metadata["steps"]]
        answer = str(task.ground_truth)
        last_label = steps[-1][0]
        closer = rng.choice(_CLOSERS).format(a=answer, label=last_label)
        level = int(task.metadata.get("level", 3))
        weights = [3 if level == 1 else 1 if level == 2 else 0, 2, 3, 2]
        weights = [w if name in self._demo_styles else 0 for name, w in zip(self.DEMO_STYLES, weights)]
        if not any(weights):  # only "direct" allowed, but this task has more than one step
            weights = [0, 0, 1, 0]
        style = rng.choices(self.DEMO_STYLES, weights=weights)[0]
        if style == "parallel" and not (len(steps) >= 3 and not steps[0][3] and not steps[1][3]):
            style = "stepwise"
        if style == "combined" and not task.metadata.get("combined"):
            style = "stepwise"
        opener = rng.choice(_OPENERS)

        if style == "direct":
            _, expr, res, _ = steps[0]
            return [format_turn(f"{_pretty(expr)} = {res}. {closer}".strip(), answer=answer)]
        if style == "combined":
            expr = task.metadata["combined"]
            first = format_turn(f"{opener} I can do it in one expression: {_pretty(expr)}.".strip(), [_calc(expr)])
            return [first, format_turn(f"{rng.choice(_BRIDGES).format(r=answer)} {closer}", answer=answer)]
        turns: list[str] = []
        start, prev_res, note = 0, None, opener
        if style == "parallel":
            (l1, e1, r1, _), (l2, e2, r2, _) = steps[0], steps[1]
            turns.append(format_turn(f"{opener} I need {l1} ({_pretty(e1)}) and {l2} ({_pretty(e2)}); both at once.".strip(),
                                     [_calc(e1), _calc(e2)]))
            start, note = 2, f"{l1.capitalize()} is {r1} and {l2} is {r2}."
        for label, expr, res, uses in steps[start:]:
            shown = expr
            if prev_res is not None:
                note = rng.choice(_BRIDGES).format(r=prev_res)
                if uses and rng.random() < 0.35:
                    # Use the calculator's memory for the previous result when it appears verbatim.
                    pattern = rf"(?<![\d.]){re.escape(_n(prev_res))}(?![\d.])"
                    if re.search(pattern, expr):
                        shown = re.sub(pattern, "ans", expr, count=1)
            if prev_res is not None or start:
                thought = f"{note} Now {label}: {_pretty(shown)}."
            elif len(steps) == 1:
                thought = f"{note} I'll compute {_pretty(shown)} with the calculator."
            else:
                thought = f"{note} First, {label}: {_pretty(shown)}."
            turns.append(format_turn(thought, [_calc(shown)]))
            prev_res = res
        turns.append(format_turn(f"{rng.choice(_BRIDGES).format(r=prev_res)} {closer}", answer=answer))
        return turns


_GSM8K_CALC = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


class GSM8KEnv(_MathEnv):
    """GSM8K grade-school word problems (``openai/gsm8k``, config ``main``) with a calculator.

    Offline, pass ``data_files=`` with JSONL rows ``{"question": ..., "answer": "... #### 42"}``
    (or ``path=`` a local dataset directory). ``demonstrate`` replays the reference
    solution's calculator annotations (``<<48/2=24>>``) as tool calls.
    """

    env_id = "trace_gym/GSM8K-v0"
    hub_path, hub_config = "openai/gsm8k", "main"

    @classmethod
    def hub_datasets(cls, *, path: str | None = None, data_files: Any = None, **kwargs: Any) -> list[str]:
        """The Hub dataset it downloads unless ``data_files=`` or ``path=`` is given."""
        return [] if data_files is not None or path is not None else [cls.hub_path]

    def __init__(self, *, path: str | None = None, name: str | None = None, data_files: Any = None, **kwargs: Any):
        super().__init__(**kwargs)
        rows = load_rows("trace_gym/GSM8K-v0", self.hub_path, self.hub_config, path=path, name=name,
                         data_files=data_files, fields=("question", "answer"))
        self._source = _RowTasks("trace_gym/GSM8K-v0", rows, self._to_task)

    @staticmethod
    def _to_task(row: dict[str, Any], split: str, index: int) -> Task:
        return Task(id=f"GSM8K-v0/{split}/{index}", prompt=str(row["question"]).strip(),
                    ground_truth=gsm8k_answer(str(row["answer"])), split=split,  # type: ignore[arg-type]
                    metadata={"solution": str(row["answer"])})

    def tasks(self) -> _RowTasks:
        return self._source

    def demonstrate(self, task: Task) -> list[str]:
        """The reference solution as a trajectory: its annotated computations as calculator
        calls (one per turn, or all at once), or, for some tasks, worked in the thought alone."""
        rng = random.Random(zlib.crc32(task.id.encode()))
        solution = str(task.metadata.get("solution", "")).rsplit("####", 1)[0].strip()
        answer = str(task.ground_truth)
        lines = [ln.strip() for ln in solution.splitlines() if ln.strip()]
        calls: list[tuple[str, str, str]] = []  # (text before the computation, whole line, expression)
        for ln in lines:
            for m in _GSM8K_CALC.finditer(ln):
                expr = m.group(1).strip()
                try:
                    evaluate_expression(expr)
                except CalculatorError:
                    continue
                before = _GSM8K_CALC.sub("", ln[: m.start()]).strip().rstrip("=$ ").strip()
                calls.append((before, _GSM8K_CALC.sub("", ln).strip(), expr))
        clean = " ".join(_GSM8K_CALC.sub("", ln) for ln in lines)
        closer = rng.choice(_CLOSERS).format(a=answer, label="the answer")
        style = rng.choice(["stepwise", "stepwise", "batched", "mental"]) if calls else "mental"
        if style == "batched" and len(calls) > 8:  # at most 8 tool calls per turn
            style = "stepwise"
        if style == "mental":
            return [format_turn(f"{clean} {closer}".strip(), answer=answer)]
        if style == "batched":
            turns = [format_turn(f"{rng.choice(_OPENERS)} The computations I need: "
                                 f"{'; '.join(_pretty(e) for _, _, e in calls)}.".strip(), [_calc(e) for _, _, e in calls])]
            return turns + [format_turn(f"{clean} {closer}".strip(), answer=answer)]
        # One computation per turn; each thought restates the previous line with its result.
        turns, prev_line = [], ""
        for before, line, expr in calls:
            recap = prev_line if prev_line and prev_line != line else ""
            step = before if before and before != expr else f"Next, {_pretty(expr)}"
            turns.append(format_turn(f"{recap} {step}.".strip(), [_calc(expr)]))
            prev_line = line
        return turns + [format_turn(f"{prev_line} {closer}".strip(), answer=answer)]


class MATHEnv(_MathEnv):
    """Competition problems of the MATH benchmark (Hendrycks et al.) with a calculator.

    Loads ``DigitalLearningGmbH/MATH-lighteval`` by default (fields ``problem``,
    ``solution``, ``level`` like "Level 3", ``type``); any dataset of that schema works, and
    an ``answer`` field, when present, is used as the ground truth instead of the solution's
    last ``\\boxed{}``. Filter with ``levels=[1, 2]`` and ``subjects=["Algebra"]``. Offline,
    pass ``data_files=`` or ``path=``.
    """

    env_id = "trace_gym/MATH-v0"
    hub_path, hub_config = "DigitalLearningGmbH/MATH-lighteval", "default"

    @classmethod
    def hub_datasets(cls, *, path: str | None = None, data_files: Any = None, **kwargs: Any) -> list[str]:
        """The Hub dataset it downloads unless ``data_files=`` or ``path=`` is given."""
        return [] if data_files is not None or path is not None else [cls.hub_path]

    def __init__(self, *, path: str | None = None, name: str | None = None, data_files: Any = None,
                 levels: Iterable[int] | None = None, subjects: Iterable[str] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        rows = load_rows("trace_gym/MATH-v0", self.hub_path, self.hub_config, path=path, name=name,
                         data_files=data_files, fields=("problem", "solution"))
        level_set = set(int(x) for x in levels) if levels is not None else None
        subject_set = set(subjects) if subjects is not None else None

        def keep(row: dict[str, Any]) -> bool:
            if self._gold(row) is None:
                return False
            if level_set is not None and _math_level(row) not in level_set:
                return False
            return subject_set is None or str(row.get("type", row.get("subject", ""))) in subject_set

        self._source = _RowTasks("trace_gym/MATH-v0", rows, self._to_task, keep)

    @staticmethod
    def _gold(row: dict[str, Any]) -> str | None:
        ans = row.get("answer")
        return str(ans).strip() if ans not in (None, "") else last_boxed(str(row.get("solution", "")))

    def _to_task(self, row: dict[str, Any], split: str, index: int) -> Task:
        return Task(id=f"MATH-v0/{split}/{index}", prompt=str(row["problem"]).strip(), ground_truth=self._gold(row),
                    split=split,  # type: ignore[arg-type]
                    metadata={"level": _math_level(row), "subject": str(row.get("type", row.get("subject", ""))),
                              "solution": str(row.get("solution", ""))})

    def tasks(self) -> _RowTasks:
        return self._source

    def demonstrate(self, task: Task) -> list[str]:
        """The reference solution as the thought, then the ground truth as the answer."""
        solution = str(task.metadata.get("solution", "")).strip()
        return [format_turn(solution or "I know this one.", answer=str(task.ground_truth))]
