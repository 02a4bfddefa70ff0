"""Math environments, all judged by math-verify.

* ``trace_gym/MathCalc-v0``: procedural arithmetic and word problems at five graded
  difficulty levels (:mod:`~trace_gym.envs.math.generator`), with a ``calculator`` tool
  (:mod:`~trace_gym.envs.math.calculator`: a safe AST evaluator, exact fractions, bounded
  sizes, no ``eval``/``exec``). Tasks are deterministic in (seed, index, split), and the
  splits are disjoint by problem text.
* ``trace_gym/GSM8K-v0`` and ``trace_gym/MATH-v0``: the datasets, loaded through
  ``datasets`` (the ``datasets`` extra; :mod:`~trace_gym.envs.math.datasets`). Offline, pass
  local files of the same schema with ``data_files=`` (or ``path=``); otherwise the
  constructor raises :class:`~trace_gym.env.base.EnvUnavailable` saying so.

Answers are judged by :func:`judge_math` (:mod:`~trace_gym.envs.math.judge`); the envs are
in :mod:`~trace_gym.envs.math.envs`. Every math env takes ``python_sandbox=True`` to add a
``python`` tool that runs code in a sandboxed subprocess (:mod:`trace_gym.envs.sandbox`).
"""

from trace_gym.envs.math.calculator import CalculatorError, evaluate_expression, format_number
from trace_gym.envs.math.datasets import gsm8k_answer, load_rows
from trace_gym.envs.math.envs import MATH_SYSTEM_PROMPT, GSM8KEnv, MATHEnv, MathCalcEnv
from trace_gym.envs.math.generator import LEVELS, MathCalcTasks
from trace_gym.envs.math.judge import judge_math, last_boxed, score_math, several_answers

__all__ = [
    "LEVELS", "MATH_SYSTEM_PROMPT", "CalculatorError", "GSM8KEnv", "MATHEnv", "MathCalcEnv", "MathCalcTasks",
    "evaluate_expression", "format_number", "gsm8k_answer", "judge_math", "last_boxed", "load_rows", "score_math",
    "several_answers",
]
