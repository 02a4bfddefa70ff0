"""Math environments, all judged by math-verify.

* ``trace_gym/MathCalc-v0``: procedural arithmetic and word problems at five graded
  difficulty levels, with a ``calculator`` tool (a safe AST evaluator: exact fractions,
  bounded sizes, no ``eval``/``exec``). Tasks are deterministic in (seed, index, split),
  and the splits are disjoint by problem text.
* ``trace_gym/GSM8K-v0`` and ``trace_gym/MATH-v0``: the datasets, loaded through
  ``datasets`` (the ``datasets`` extra). Offline, pass local files of the same schema with
  ``data_files=`` (or ``path=``); otherwise the constructor raises
  :class:`~trace_gym.env.base.EnvUnavailable` saying so.

Every math env takes ``python_sandbox=True`` to add a ``python`` tool that runs code in a
sandboxed subprocess (:mod:`trace_gym.envs.sandbox`).

Answer checking (:func:`judge_math`) is math-verify with its signal-based timeouts turned off,
so it is safe in threads; time is bounded here instead: answers are length-limited, and
expressions whose value could not be computed quickly (``10^{10^{10}}``, ``(10^6)!``) get 0
before math-verify sees them. Reward hacking gets 0: several answers at once
(``1 or 2 or 3``, ``\\boxed{1}\\boxed{2}``), a list of numbers, an answer with more parts
than the ground truth.
"""

from __future__ import annotations

import ast
import logging
import math
import operator
import os
import random
import re
import zlib
import warnings
from fractions import Fraction
from functools import lru_cache
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from trace_gym.env.base import AgentEnv, EnvUnavailable, TurnResult
from trace_gym.env.react import ParsedTurn, format_turn
from trace_gym.task import Split, Task
from trace_gym.env.tools import Tool, ToolError

__all__ = [
    "CalculatorError", "GSM8KEnv", "MATHEnv", "MathCalcEnv", "MathCalcTasks", "evaluate_expression",
    "format_number", "judge_math", "last_boxed", "score_math",
]

Number = Fraction | float

# ============================================================================ calculator

MAX_EXPRESSION_CHARS = 500
MAX_EXPRESSION_NODES = 200
MAX_EXPONENT = 1000
MAX_RESULT_BITS = 4096  # ~1233 decimal digits: far beyond any task, small enough to stay instant
MAX_FACTORIAL = 300


class CalculatorError(ToolError):
    """An expression the calculator cannot or will not evaluate; the message is for the policy."""


def _check_size(x: Number) -> Number:
    if isinstance(x, Fraction):
        if max(x.numerator.bit_length(), x.denominator.bit_length()) > MAX_RESULT_BITS:
            raise CalculatorError("the result is too large")
        return x
    if not math.isfinite(x):
        raise CalculatorError("the result is not a finite number")
    return x


def _exact_root(x: Fraction, q: int) -> Fraction | None:
    """The exact q-th root of a non-negative fraction, if it is rational."""

    def iroot(n: int) -> int | None:
        r = round(n ** (1.0 / q)) if n.bit_length() < 1000 else None
        if r is None:
            return None
        for c in (r - 1, r, r + 1):
            if c >= 0 and c**q == n:
                return c
        return None

    p, d = iroot(x.numerator), iroot(x.denominator)
    return Fraction(p, d) if p is not None and d is not None else None


def _as_int(x: Number, what: str) -> int:
    if isinstance(x, Fraction) and x.denominator == 1:
        return int(x)
    if isinstance(x, float) and x.is_integer():
        return int(x)
    raise CalculatorError(f"{what} must be a whole number")


def _power(base: Number, exp: Number) -> Number:
    if isinstance(exp, Fraction) and exp.denominator == 1:
        n = int(exp)
        if abs(n) > MAX_EXPONENT:
            raise CalculatorError(f"exponents are limited to {MAX_EXPONENT} in absolute value")
        if isinstance(base, Fraction):
            if base == 0 and n < 0:
                raise CalculatorError("division by zero")
            if max(base.numerator.bit_length(), base.denominator.bit_length()) * abs(n) > MAX_RESULT_BITS:
                raise CalculatorError("the result is too large")
            return base**n
    fb, fe = float(base), float(exp)
    if fb < 0:
        raise CalculatorError("a negative number to a fractional power is not a real number")
    if isinstance(base, Fraction) and isinstance(exp, Fraction) and exp.denominator <= 12:
        root = _exact_root(base, exp.denominator)
        if root is not None:
            return _power(root, Fraction(exp.numerator))
    try:
        return math.pow(fb, fe)
    except OverflowError:
        raise CalculatorError("the result is too large") from None


def _div(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalculatorError("division by zero")
    return a / b


def _floordiv(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalculatorError("division by zero")
    return Fraction(a // b) if isinstance(a, Fraction) and isinstance(b, Fraction) else float(a // b)


def _mod(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalculatorError("modulo by zero")
    return a % b


_BINOPS: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: _div,
    ast.FloorDiv: _floordiv, ast.Mod: _mod, ast.Pow: _power,
}


def _sqrt(x: Number) -> Number:
    if x < 0:
        raise CalculatorError("sqrt of a negative number")
    if isinstance(x, Fraction):
        root = _exact_root(x, 2)
        if root is not None:
            return root
    return math.sqrt(float(x))


def _log(x: Number, base: Number | None = None) -> float:
    if x <= 0 or (base is not None and (base <= 0 or base == 1)):
        raise CalculatorError("log needs a positive argument (and a positive base other than 1)")
    return math.log(float(x)) if base is None else math.log(float(x), float(base))


def _exp(x: Number) -> float:
    if x > 700:
        raise CalculatorError("the result is too large")
    return math.exp(float(x))


def _round(x: Number, ndigits: Number | None = None) -> Number:
    if ndigits is None:
        return Fraction(round(x))
    n = _as_int(ndigits, "the number of digits")
    if not -20 <= n <= 20:
        raise CalculatorError("round to at most 20 digits")
    return round(x, n) if isinstance(x, Fraction) else round(float(x), n)


def _factorial(n: Number) -> Fraction:
    k = _as_int(n, "the factorial's argument")
    if not 0 <= k <= MAX_FACTORIAL:
        raise CalculatorError(f"factorial is defined here for 0..{MAX_FACTORIAL}")
    return Fraction(math.factorial(k))


def _comb(n: Number, k: Number) -> Fraction:
    a, b = _as_int(n, "n"), _as_int(k, "k")
    if not (0 <= a <= 10 * MAX_FACTORIAL and 0 <= b):
        raise CalculatorError("comb(n, k) needs 0 <= n <= 3000 and k >= 0")
    return Fraction(math.comb(a, b))


def _int_fn(fn: Callable[..., int]) -> Callable[..., Fraction]:
    def wrapped(*args: Number) -> Fraction:
        if not args:
            raise CalculatorError("needs at least one argument")
        return Fraction(fn(*(_as_int(a, "each argument") for a in args)))

    return wrapped


def _float_fn(fn: Callable[[float], float]) -> Callable[[Number], float]:
    def wrapped(x: Number) -> float:
        try:
            return fn(float(x))
        except (ValueError, OverflowError) as exc:
            raise CalculatorError(f"math error: {exc}") from None

    return wrapped


def _minmax(fn: Callable[..., Number]) -> Callable[..., Number]:
    def wrapped(*args: Number) -> Number:
        if not args:
            raise CalculatorError("needs at least one argument")
        return fn(args)

    return wrapped


_FUNCTIONS: dict[str, tuple[Callable[..., Number], tuple[int, int]]] = {
    # name: (function, (min args, max args))
    "sqrt": (_sqrt, (1, 1)), "abs": (abs, (1, 1)), "round": (_round, (1, 2)),
    "floor": (lambda x: Fraction(math.floor(x)), (1, 1)), "ceil": (lambda x: Fraction(math.ceil(x)), (1, 1)),
    "min": (_minmax(min), (1, 64)), "max": (_minmax(max), (1, 64)),
    "log": (_log, (1, 2)), "ln": (_log, (1, 1)), "log10": (lambda x: _log(x, Fraction(10)), (1, 1)),
    "log2": (lambda x: _log(x, Fraction(2)), (1, 1)), "exp": (_exp, (1, 1)),
    "sin": (_float_fn(math.sin), (1, 1)), "cos": (_float_fn(math.cos), (1, 1)), "tan": (_float_fn(math.tan), (1, 1)),
    "factorial": (_factorial, (1, 1)), "comb": (_comb, (2, 2)),
    "gcd": (_int_fn(math.gcd), (1, 64)), "lcm": (_int_fn(math.lcm), (1, 64)),
}
_CONSTANTS: dict[str, Number] = {"pi": math.pi, "e": math.e, "tau": math.tau}
_REWRITES = (("^", "**"), ("×", "*"), ("·", "*"), ("÷", "/"), ("−", "-"), ("–", "-"))


def evaluate_expression(expression: str, variables: Mapping[str, Number] | None = None) -> Number:
    """Evaluate an arithmetic expression without ``eval``: the text is parsed with :mod:`ast`
    and only numbers, ``+ - * / // % **`` (``^`` means power), parentheses, the functions in
    ``_FUNCTIONS``, ``pi``/``e``/``tau`` and ``variables`` are allowed.

    Integers and decimals stay exact (:class:`~fractions.Fraction`); irrational steps give
    floats. Sizes are bounded (exponents, result bits, factorials), so no input can hang or
    exhaust memory. Raises :class:`CalculatorError` with a message for the policy.
    """
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be text")
    text = expression.strip().rstrip("=").strip()
    if not text:
        raise CalculatorError("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    for old, new in _REWRITES:
        text = text.replace(old, new)
    try:
        with warnings.catch_warnings():  # "2x" is a model's typo, not a warning for the user's terminal
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"cannot parse {expression.strip()[:80]!r} as an arithmetic expression") from None
    nodes = 0
    for _ in ast.walk(tree):
        nodes += 1
        if nodes > MAX_EXPRESSION_NODES:
            raise CalculatorError(f"the expression has more than {MAX_EXPRESSION_NODES} parts; split it up")
    env = {**_CONSTANTS, **(variables or {})}

    def ev(node: ast.AST) -> Number:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise CalculatorError(f"unsupported value {v!r}")
            if isinstance(v, float):
                if not math.isfinite(v):
                    raise CalculatorError("the number is too large")
                return Fraction(repr(v))  # "0.1" stays exactly 1/10
            return _check_size(Fraction(v))
        if isinstance(node, ast.Name):
            if node.id in env and env[node.id] is not None:
                return env[node.id]
            if node.id == "ans":
                raise CalculatorError("'ans' (the previous result) is not set yet")
            raise CalculatorError(f"unknown name {node.id!r}")
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            return _check_size(_BINOPS[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
            if node.func.id not in _FUNCTIONS:
                raise CalculatorError(f"unknown function {node.func.id!r} (known: {', '.join(sorted(_FUNCTIONS))})")
            fn, (lo, hi) = _FUNCTIONS[node.func.id]
            if not lo <= len(node.args) <= hi:
                raise CalculatorError(f"{node.func.id} takes {lo}{'' if lo == hi else f' to {hi}'} argument(s)")
            args = [ev(a) for a in node.args]
            result = fn(*args)
            return _check_size(Fraction(result) if isinstance(result, int) else result)
        if isinstance(node, ast.Tuple):
            raise CalculatorError("write numbers without thousands separators (1234, not 1,234)")
        raise CalculatorError(f"unsupported syntax: {type(node).__name__}")

    try:
        return ev(tree)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None
    except (OverflowError, ZeroDivisionError, ValueError, TypeError) as exc:
        raise CalculatorError(f"math error: {exc}") from None


def _terminates(q: int) -> bool:
    for p in (2, 5):
        while q % p == 0:
            q //= p
    return q == 1


def format_number(x: Number) -> str:
    """How results and ground truths are written: integers plainly, terminating fractions as
    exact decimals, other fractions as ``p/q``, floats with 12 significant digits."""
    if isinstance(x, float):
        if x.is_integer() and abs(x) < 1e15:
            return str(int(x))
        return f"{x:.12g}"
    if x.denominator == 1:
        return str(x.numerator)
    if _terminates(x.denominator):
        digits = 0
        while (x * 10**digits).denominator != 1:
            digits += 1
        if digits <= 20:
            sign = "-" if x < 0 else ""
            n = abs(x.numerator) * 10**digits // x.denominator
            whole, frac = divmod(n, 10**digits)
            return f"{sign}{whole}.{frac:0{digits}d}"
    return f"{x.numerator}/{x.denominator}"


def _describe_result(x: Number) -> str:
    text = format_number(x)
    if isinstance(x, Fraction) and "/" in text:
        return f"{text} (≈ {float(x):.12g})"
    return text


# ============================================================================ answer checking

MAX_ANSWER_CHARS = 512
_MAX_LOG10 = 5000.0  # values beyond 10^5000 are not compared (sympy would need too long)
_MAX_NODES = 1000

logger = logging.getLogger(__name__)


class _ExpectedTimeoutWarning(logging.Filter):
    """math-verify warns once per process that its timeouts are off; they are off on
    purpose here (they rely on signals, so they break in threads) and sizes are bounded
    instead, so the warning is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_ExpectedTimeoutWarning())

_SEPARATORS = re.compile(r"\s+(?:or|and)\s+|[,;\n|]|\\q?quad\b|\\lor\b|\\vee\b|\\text\{\s*(?:or|and)\s*\}", re.I)
_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mbox|textrm)\{([^{}]*)\}")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_SPACED_NUMBERS = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s+\d+(?:\.\d+)?(?![\w.])")


def _normalise_for_parts(text: str) -> str:
    text = text.replace("$", " ").replace("\\!", "").replace("\\,", " ")
    text = _TEXT_CMD.sub(r" \1 ", text)
    prev = None
    while prev != text:  # 1,000,000 -> 1000000
        prev, text = text, _THOUSANDS.sub("", text)
    return text


def _top_level_parts(text: str) -> int:
    """Number of answer parts separated by top-level separators (commas, "or", ...)."""
    depth, pieces, start = 0, [], 0
    masked = []
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth = max(0, depth - 1)
        masked.append(c if depth == 0 else "x")
    flat = "".join(masked)
    for m in _SEPARATORS.finditer(flat):
        pieces.append(text[start:m.start()])
        start = m.end()
    pieces.append(text[start:])
    return sum(1 for p in pieces if re.search(r"\w", p))


def several_answers(answer: str, gold: str) -> str | None:
    """Why ``answer`` hedges between several answers compared with ``gold``, or ``None``.

    Rules: more than one ``\\boxed``; more top-level parts (split at commas, semicolons,
    "or"/"and", newlines, ``\\quad``) than the ground truth has; numbers separated only by
    whitespace; many more numbers than the ground truth contains.
    """
    if answer.count("\\boxed") + answer.count("\\fbox") > 1:
        return "several boxed answers"
    a, g = _normalise_for_parts(answer), _normalise_for_parts(gold)
    if _top_level_parts(a) > max(1, _top_level_parts(g)):
        return "several answers at once"
    if _SPACED_NUMBERS.search(a) and not _SPACED_NUMBERS.search(g):
        return "a list of numbers"
    n_a, n_g = len(_NUMBER.findall(a)), len(_NUMBER.findall(g))
    if n_a > max(8, 4 * n_g):
        return "too many numbers"
    return None


def _log10_bound(e: Any, budget: list[int]) -> float:
    """An upper bound on log10 of the magnitude of a sympy expression's value (or of any
    intermediate value sympy may compute while comparing it); ``inf`` when unbounded."""
    import sympy

    budget[0] -= 1
    if budget[0] < 0:
        return math.inf
    if isinstance(e, sympy.Rational):  # Integer included
        bits = max(abs(int(e.p)).bit_length(), abs(int(e.q)).bit_length())
        return bits * 0.30103
    if isinstance(e, sympy.Float):
        try:
            v = abs(float(e))
        except (OverflowError, ValueError):
            return math.inf
        return math.log10(v) + 1 if v > 1 else 1.0
    if isinstance(e, sympy.Pow):
        lb = _log10_bound(e.base, budget)
        if isinstance(e.exp, sympy.Rational):
            n = abs(float(e.exp))
            # Expanding a symbolic power is the slow part; numeric powers cost their size.
            if e.base.free_symbols and n > 200:
                return math.inf
            return max(lb, 0.0) * n + 1.0
        lx = _log10_bound(e.exp, budget)
        if lx > 7:
            return math.inf
        return max(lb, 1.0) * 10**lx
    if isinstance(e, (sympy.factorial, sympy.gamma, sympy.factorial2, sympy.subfactorial, sympy.binomial,
                      sympy.RisingFactorial, sympy.FallingFactorial)):
        ln = max((_log10_bound(a, budget) for a in e.args), default=1.0)
        if ln > 6:
            return math.inf
        v = 10**ln
        return v * math.log10(v + 1) + 1
    if isinstance(e, sympy.MatrixBase):
        return max((_log10_bound(x, budget) for x in e), default=1.0)
    if isinstance(e, sympy.Mul):
        return sum(max(_log10_bound(a, budget), 0.0) for a in e.args)
    args = getattr(e, "args", ())
    if not args:
        return 1.0
    if isinstance(e, sympy.Add):
        return max(_log10_bound(a, budget) for a in e.args) + math.log10(len(e.args))
    return max(_log10_bound(a, budget) for a in args) + 1.0


def _too_large(parsed: Iterable[Any]) -> bool:
    import sympy

    for e in parsed:
        if isinstance(e, (sympy.Basic, sympy.MatrixBase)):
            budget = [_MAX_NODES]
            if _log10_bound(e, budget) > _MAX_LOG10:
                return True
    return False


def _mv_parse(text: str) -> list[Any]:
    from math_verify import parse

    # parsing_timeout=None: math-verify's timeout uses signals (main thread only); we bound
    # input sizes instead.
    return parse(text, parsing_timeout=None)


@lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple[Any, ...]:
    parsed = _mv_parse("\\boxed{" + gold + "}") or _mv_parse(gold)
    return tuple(parsed)


def _plain(text: str) -> str:
    text = _TEXT_CMD.sub(r"\1", text)
    return re.sub(r"[\s$\\{}]", "", text).lower()


def judge_math(answer: str, gold: str) -> tuple[float, str]:
    """(reward, verdict) for a final ``answer`` against the ground truth ``gold``.

    Reward is 1.0 when math-verify finds them equal (the answer parsed as written, or as if
    it were inside ``\\boxed{}``) and no hedging rule of :func:`several_answers` fires; the
    verdict is ``"correct"``, ``"wrong"`` or the reason for a 0 (``"too long"``, ``"several
    answers at once"``, ``"too large to verify"`` ...). Never raises; safe in threads.
    """
    from math_verify import verify

    if not isinstance(answer, str):
        return 0.0, "not text"
    a = answer.strip()
    if not a:
        return 0.0, "empty answer"
    if len(a) > min(MAX_ANSWER_CHARS, max(64, 4 * len(gold))):
        return 0.0, "too long"
    reason = several_answers(a, str(gold))
    if reason:
        return 0.0, reason
    gold_parsed = list(_parse_gold(str(gold)))
    if not gold_parsed:  # a gold math-verify cannot read (free text): compare normalised text
        return (1.0, "correct") if _plain(a) == _plain(str(gold)) else (0.0, "wrong")
    try:
        for candidate in ("\\boxed{" + a + "}", a):
            parsed = _mv_parse(candidate)
            if not parsed:
                continue
            if _too_large(parsed):
                return 0.0, "too large to verify"
            if verify(gold_parsed, parsed, timeout_seconds=None):
                return 1.0, "correct"
    except Exception as exc:  # math-verify and sympy have many failure modes on odd input
        logger.debug("math-verify failed on %r vs %r: %s", a, gold, exc)
        return 0.0, f"unverifiable ({type(exc).__name__})"
    return 0.0, "wrong"


def score_math(answer: str, gold: str) -> float:
    """The reward of :func:`judge_math`."""
    return judge_math(answer, gold)[0]


# ============================================================================ procedural tasks

_NAMES = [
    ("Ava", "she"), ("Liam", "he"), ("Maya", "she"), ("Noah", "he"), ("Zoe", "she"), ("Omar", "he"),
    ("Priya", "she"), ("Kenji", "he"), ("Lucia", "she"), ("Tom", "he"), ("Amara", "she"), ("Diego", "he"),
    ("Sofia", "she"), ("Ivan", "he"), ("Mei", "she"), ("Samuel", "he"), ("Hana", "she"), ("Felix", "he"),
    ("Nadia", "she"), ("Ravi", "he"),
]
_ITEMS = [("notebook", "notebooks"), ("pen", "pens"), ("apple", "apples"), ("ticket", "tickets"), ("book", "books"),
          ("cupcake", "cupcakes"), ("plant", "plants"), ("candle", "candles"), ("mug", "mugs"), ("scarf", "scarves")]
_COLLECTIBLES = ["marbles", "stickers", "stamps", "cards", "shells", "coins", "beads", "pebbles"]
_GOODS = ["toys", "jars of jam", "loaves of bread", "bottles of juice", "bars of soap", "candles"]
_GARMENTS = ["jacket", "bike", "lamp", "backpack", "guitar", "tent", "printer", "chair"]

_SPLIT_CODES = {"train": 0, "validation": 1, "test": 2}
LEVELS = (1, 2, 3, 4, 5)


def _split_of(prompt: str) -> Split:
    # Splits are disjoint by text: a problem's split is a function of its wording.
    bucket = zlib.crc32(prompt.encode()) % 20
    return "test" if bucket == 0 else "validation" if bucket == 1 else "train"


class _Problem:
    """A generated problem: prompt, solution steps ``[label, expression, result]`` (each
    expression uses only numbers) and, when one exists, a single combined expression."""

    def __init__(self, kind: str, prompt: str):
        self.kind, self.prompt = kind, prompt
        self.steps: list[tuple[str, str, bool]] = []  # (label, expression, uses an earlier result)
        self.combined: str | None = None

    def step(self, label: str, expression: str, uses_previous: bool = False) -> str:
        self.steps.append((label, expression, uses_previous))
        return format_number(evaluate_expression(expression))

    @property
    def answer(self) -> str:
        return format_number(evaluate_expression(self.steps[-1][1]))


def _n(x: str) -> str:
    """An intermediate result written into a later expression."""
    return f"({x})" if "/" in x or x.startswith("-") else x


def _pick(rng: np.random.Generator, seq: list[Any]) -> Any:
    return seq[int(rng.integers(len(seq)))]


def _ri(rng: np.random.Generator, lo: int, hi: int) -> int:
    return int(rng.integers(lo, hi + 1))


def _level1(rng: np.random.Generator) -> _Problem:
    kind = _pick(rng, ["add", "sub", "mul"])
    if kind == "add":
        a, b, sym, word = _ri(rng, 10, 99), _ri(rng, 10, 99), "+", "plus"
    elif kind == "sub":
        a = _ri(rng, 20, 99)
        b, sym, word = _ri(rng, 1, a - 1), "-", "minus"
    else:
        a, b, sym, word = _ri(rng, 2, 12), _ri(rng, 2, 12), "*", "times"
    shown = {"+": "+", "-": "-", "*": "×"}[sym]
    prompt = _pick(rng, [f"What is {a} {shown} {b}?", f"Compute {a} {shown} {b}.", f"Calculate {a} {word} {b}."])
    p = _Problem(f"arithmetic-{kind}", prompt)
    p.step("the result", f"{a} {sym} {b}")
    p.combined = f"{a} {sym} {b}"
    return p


def _level2(rng: np.random.Generator) -> _Problem:
    kind = _pick(rng, ["mul", "add_sub", "div", "word_add"])
    if kind == "mul":
        a, b = _ri(rng, 11, 99), _ri(rng, 11, 99)
        p = _Problem("arithmetic-mul", _pick(rng, [f"What is {a} × {b}?", f"Multiply {a} by {b}."]))
        p.step("the product", f"{a} * {b}")
        p.combined = f"{a} * {b}"
    elif kind == "add_sub":
        a, b = _ri(rng, 100, 999), _ri(rng, 100, 999)
        c = _ri(rng, 10, a + b - 1)
        p = _Problem("arithmetic-add-sub", _pick(rng, [f"Compute {a} + {b} - {c}.", f"What is {a} + {b} − {c}?"]))
        s = p.step("the sum", f"{a} + {b}")
        p.step("the result", f"{s} - {c}", True)
        p.combined = f"{a} + {b} - {c}"
    elif kind == "div":
        q, d = _ri(rng, 11, 99), _ri(rng, 3, 19)
        p = _Problem("arithmetic-div", _pick(rng, [f"What is {q * d} ÷ {d}?", f"Divide {q * d} by {d}."]))
        p.step("the quotient", f"{q * d} / {d}")
        p.combined = f"{q * d} / {d}"
    else:
        (name, pron), thing = _pick(rng, _NAMES), _pick(rng, _COLLECTIBLES)
        a, b = _ri(rng, 120, 900), _ri(rng, 45, 400)
        p = _Problem("word-one-step", f"{name} has {a} {thing} and gets {b} more from a friend. "
                                      f"How many {thing} does {pron} have now?")
        p.step(f"{thing} in total", f"{a} + {b}")
        p.combined = f"{a} + {b}"
    return p


def _level3(rng: np.random.Generator) -> _Problem:
    form = int(rng.integers(4))
    if form == 0:
        a, b, c = _ri(rng, 12, 99), _ri(rng, 12, 99), _ri(rng, 3, 19)
        d = _ri(rng, 10, (a + b) * c - 1)
        p = _Problem("expression", f"Evaluate ({a} + {b}) × {c} − {d}.")
        s = p.step("the sum in parentheses", f"{a} + {b}")
        t = p.step("the product", f"{s} * {c}", True)
        p.step("the result", f"{t} - {d}", True)
        p.combined = f"({a} + {b}) * {c} - {d}"
    elif form == 1:
        a, b, c, d = _ri(rng, 12, 99), _ri(rng, 3, 29), _ri(rng, 12, 99), _ri(rng, 3, 29)
        p = _Problem("expression", f"Evaluate {a} × {b} + {c} × {d}.")
        s = p.step("the first product", f"{a} * {b}")
        t = p.step("the second product", f"{c} * {d}")
        p.step("the sum", f"{s} + {t}", True)
        p.combined = f"{a} * {b} + {c} * {d}"
    elif form == 2:
        a = _ri(rng, 50, 300)
        b, c, d = _ri(rng, 5, a - 1), _ri(rng, 5, 60), _ri(rng, 5, 60)
        p = _Problem("expression", f"Evaluate ({a} − {b}) × ({c} + {d}).")
        s = p.step("the first factor", f"{a} - {b}")
        t = p.step("the second factor", f"{c} + {d}")
        p.step("the product", f"{s} * {t}", True)
        p.combined = f"({a} - {b}) * ({c} + {d})"
    else:
        q, d, c = _ri(rng, 12, 150), _ri(rng, 4, 25), _ri(rng, 100, 999)
        p = _Problem("expression", f"Evaluate {q * d} ÷ {d} + {c} × 3.")
        s = p.step("the quotient", f"{q * d} / {d}")
        t = p.step("the product", f"{c} * 3")
        p.step("the sum", f"{s} + {t}", True)
        p.combined = f"{q * d} / {d} + {c} * 3"
    return p


def _level4(rng: np.random.Generator) -> _Problem:
    (name, pron), form = _pick(rng, _NAMES), int(rng.integers(6))
    poss = "her" if pron == "she" else "his"
    if form == 0:
        (i1, i1s), (i2, i2s) = [_ITEMS[k] for k in rng.choice(len(_ITEMS), 2, replace=False)]
        n1, p1, n2, p2 = _ri(rng, 2, 9), _ri(rng, 2, 25), _ri(rng, 2, 9), _ri(rng, 2, 25)
        p = _Problem("word-shopping", f"{name} buys {n1} {i1s} at ${p1} each and {n2} {i2s} at ${p2} each. "
                                      f"How many dollars does {pron} spend in total?")
        s = p.step(f"the {i1s} cost", f"{n1} * {p1}")
        t = p.step(f"the {i2s} cost", f"{n2} * {p2}")
        p.step("the total", f"{s} + {t}", True)
        p.combined = f"{n1} * {p1} + {n2} * {p2}"
    elif form == 1:
        (_, i1s) = _pick(rng, _ITEMS)
        n1, p1 = _ri(rng, 2, 8), _ri(rng, 3, 12)
        bill = _pick(rng, [b for b in (20, 50, 100) if b > n1 * p1] or [200])
        p = _Problem("word-change", f"{name} buys {n1} {i1s} that cost ${p1} each and pays with a ${bill} bill. "
                                    f"How much change, in dollars, does {pron} get?")
        s = p.step("the cost", f"{n1} * {p1}")
        p.step("the change", f"{bill} - {s}", True)
        p.combined = f"{bill} - {n1} * {p1}"
    elif form == 2:
        v1, t1, v2, t2 = _ri(rng, 40, 120), _ri(rng, 2, 6), _ri(rng, 40, 120), _ri(rng, 1, 5)
        p = _Problem("word-travel", f"A train travels at {v1} km/h for {t1} hours and then at {v2} km/h for {t2} hours. "
                                    f"How many kilometres does it travel in total?")
        s = p.step("the first leg", f"{v1} * {t1}")
        t = p.step("the second leg", f"{v2} * {t2}")
        p.step("the total distance", f"{s} + {t}", True)
        p.combined = f"{v1} * {t1} + {v2} * {t2}"
    elif form == 3:
        goods = _pick(rng, _GOODS)
        per_day, box = _ri(rng, 12, 90), _pick(rng, [4, 5, 6, 8, 10, 12, 20, 24])
        days = box * _ri(rng, 1, 6) // math.gcd(box, per_day)  # makes per_day * days a multiple of box
        p = _Problem("word-packing", f"A workshop makes {per_day} {goods} a day for {days} days. They are packed in boxes "
                                     f"of {box}. How many boxes are filled?")
        s = p.step(f"{goods} made", f"{per_day} * {days}")
        p.step("boxes", f"{s} / {box}", True)
        p.combined = f"{per_day} * {days} / {box}"
    elif form == 4:
        save, weeks = _ri(rng, 5, 40), _ri(rng, 4, 20)
        spend = _ri(rng, 1, save * weeks - 1)
        p = _Problem("word-savings", f"{name} saves ${save} every week. After {weeks} weeks {pron} spends ${spend} on a gift. "
                                     f"How many dollars does {pron} have left?")
        s = p.step("the savings", f"{save} * {weeks}")
        p.step("what is left", f"{s} - {spend}", True)
        p.combined = f"{save} * {weeks} - {spend}"
    else:
        age, k, years = _ri(rng, 4, 14), _ri(rng, 3, 5), _ri(rng, 2, 15)
        p = _Problem("word-age", f"{name} is {age} years old, and {poss} grandmother is {k} times as old. "
                                 f"How old will {poss} grandmother be in {years} years?")
        s = p.step("the grandmother's age now", f"{age} * {k}")
        p.step(f"her age in {years} years", f"{s} + {years}", True)
        p.combined = f"{age} * {k} + {years}"
    return p


def _level5(rng: np.random.Generator) -> _Problem:
    (name, pron), form = _pick(rng, _NAMES), int(rng.integers(6))
    poss = "her" if pron == "she" else "his"
    if form == 0:
        thing = _pick(rng, _GARMENTS)
        price, off, tax = 20 * _ri(rng, 2, 30), _pick(rng, [10, 15, 20, 25, 30, 40]), _pick(rng, [5, 8, 10, 12])
        p = _Problem("word-discount", f"A {thing} costs ${price}. It is on sale for {off}% off, and then a {tax}% sales tax "
                                      f"is added to the sale price. What is the final price in dollars?")
        s = p.step("the sale price", f"{price} * (100 - {off}) / 100")
        p.step("the price with tax", f"{_n(s)} * (100 + {tax}) / 100", True)
        p.combined = f"{price} * (100 - {off}) / 100 * (100 + {tax}) / 100"
    elif form == 1:
        k = _ri(rng, 3, 5)
        scores = [_ri(rng, 60, 98) for _ in range(k)]
        # The needed score lies in [40, 100].
        target = _ri(rng, max(60, -(-(sum(scores) + 40) // (k + 1))), min(98, (sum(scores) + 100) // (k + 1)))
        listed = ", ".join(map(str, scores[:-1])) + f" and {scores[-1]}"
        p = _Problem("word-average", f"{name} scored {listed} on {poss} first {k} tests. What score does {pron} need on the "
                                     f"next test to average exactly {target} over all {k + 1} tests?")
        s = p.step("the total needed", f"{target} * {k + 1}")
        t = p.step("the points so far", " + ".join(map(str, scores)))
        p.step("the score needed", f"{s} - {t}", True)
        p.combined = f"{target} * {k + 1} - ({' + '.join(map(str, scores))})"
    elif form == 2:
        (name2, _) = _pick(rng, [n for n in _NAMES if n[0] != name])
        r1, r2 = _ri(rng, 1, 7), _ri(rng, 1, 7)
        total = (r1 + r2) * _ri(rng, 5, 60)
        p = _Problem("word-ratio", f"{name} and {name2} share ${total} in the ratio {r1}:{r2}. How many dollars does "
                                   f"{name2} get?")
        s = p.step("one share", f"{total} / ({r1} + {r2})")
        p.step(f"{name2}'s part", f"{_n(s)} * {r2}", True)
        p.combined = f"{total} / ({r1} + {r2}) * {r2}"
    elif form == 3:
        a, b = _ri(rng, 2, 12), _ri(rng, 2, 12)
        p = _Problem("word-work-rate", f"One pipe fills a tank in {a} hours and another fills it in {b} hours. "
                                       f"How many hours do they take to fill it together? Give an exact answer.")
        s = p.step("the combined rate per hour", f"1/{a} + 1/{b}")
        p.step("the time", f"1 / {_n(s)}", True)
        p.combined = f"1 / (1/{a} + 1/{b})"
    elif form == 4:
        pop, g1, g2 = 10000 * _ri(rng, 1, 60), _pick(rng, [5, 10, 20, 25]), _pick(rng, [4, 5, 10, 20])
        p = _Problem("word-growth", f"A town has {pop} residents. Its population grows by {g1}% in the first year and by "
                                    f"{g2}% in the second year. How many residents does it have after two years?")
        s = p.step("after the first year", f"{pop} * (100 + {g1}) / 100")
        p.step("after the second year", f"{_n(s)} * (100 + {g2}) / 100", True)
        p.combined = f"{pop} * (100 + {g1}) / 100 * (100 + {g2}) / 100"
    else:
        v = _pick(rng, [3, 4, 5, 6, 8, 10, 12])
        d = Fraction(_ri(rng, 2, 40), _pick(rng, [1, 2, 4, 5]))
        dist = format_number(d)
        p = _Problem("word-minutes", f"{name} walks {dist} km at a steady {v} km/h. How many minutes does the walk take?")
        s = p.step("the time in hours", f"{dist} / {v}")
        p.step("the time in minutes", f"{_n(s)} * 60", True)
        p.combined = f"{dist} / {v} * 60"
    return p


_GENERATORS: dict[int, Callable[[np.random.Generator], _Problem]] = {1: _level1, 2: _level2, 3: _level3, 4: _level4, 5: _level5}


class MathCalcTasks:
    """Procedural math tasks, deterministic in (seed, index, split).

    Index ``i`` gets difficulty level ``levels[i % len(levels)]``; the task is drawn from a
    generator seeded by (seed, level, split, i // len(levels)) and redrawn until its text
    falls in ``split`` (so no problem appears in two splits). Task ids look like
    ``MathCalc-v0/0/L3/train/17`` and are resolved by :meth:`by_id` whatever ``levels`` is.
    """

    SIZES: dict[str, int] = {"train": 10**9, "validation": 10_000, "test": 10_000}

    def __init__(self, seed: int = 0, levels: Iterable[int] = LEVELS):
        self.seed = int(seed)
        self.levels = tuple(sorted(set(int(x) for x in levels)))
        if not self.levels or any(x not in _GENERATORS for x in self.levels):
            raise ValueError(f"levels must be a non-empty subset of {LEVELS}, got {levels!r}")

    def size(self, split: Split = "train") -> int:
        """Number of tasks in ``split`` (a bound: the generator never runs out)."""
        return self.SIZES[split]

    def get(self, index: int, split: Split = "train") -> Task:
        """The task at ``index`` of ``split``."""
        if split not in _SPLIT_CODES:
            raise KeyError(f"unknown split {split!r}")
        index = int(index)
        if not 0 <= index < self.size(split):
            raise IndexError(f"task index {index} out of range for split {split!r}")
        level = self.levels[index % len(self.levels)]
        return self.generate(level, split, index // len(self.levels))

    def generate(self, level: int, split: Split, inner: int) -> Task:
        """The ``inner``-th task of difficulty ``level`` in ``split``."""
        rng = np.random.default_rng([self.seed, level, _SPLIT_CODES[split], inner])
        for _ in range(1000):
            problem = _GENERATORS[level](rng)
            if _split_of(problem.prompt) == split:
                break
        else:  # pragma: no cover - probability ~ (19/20)^1000
            raise RuntimeError("could not draw a task for this split")
        results = [format_number(evaluate_expression(expr)) for _, expr, _ in problem.steps]
        return Task(
            id=f"MathCalc-v0/{self.seed}/L{level}/{split}/{inner}",
            prompt=problem.prompt,
            ground_truth=problem.answer,
            split=split,
            metadata={
                "level": level, "kind": problem.kind, "combined": problem.combined,
                "steps": [[label, expr, res, uses] for (label, expr, uses), res in zip(problem.steps, results, strict=True)],
            },
        )

    def by_id(self, task_id: str) -> Task:
        """The task with id ``task_id`` (as produced by :meth:`get`)."""
        m = re.fullmatch(r"MathCalc-v0/(-?\d+)/L(\d)/(train|validation|test)/(\d+)", task_id)
        if not m or int(m.group(2)) not in _GENERATORS:
            raise KeyError(f"trace_gym/MathCalc-v0: no task with id {task_id!r}")
        src = self if int(m.group(1)) == self.seed else MathCalcTasks(int(m.group(1)), self.levels)
        return src.generate(int(m.group(2)), m.group(3), int(m.group(4)))  # type: ignore[arg-type]


# ============================================================================ environments

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

            self._sandbox = PythonSandbox(timeout_s=sandbox_timeout_s)

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


# ---------------------------------------------------------------------------- datasets

_DATA_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_ROWS_CACHE: dict[Any, dict[str, list[dict[str, Any]]]] = {}


def _freeze(x: Any) -> Any:
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return str(x)


def _builder_for(data_files: Any) -> str:
    files = list(data_files.values()) if isinstance(data_files, dict) else [data_files]
    flat = [f for x in files for f in (x if isinstance(x, (list, tuple)) else [x])]
    kinds = {_DATA_EXTENSIONS.get(os.path.splitext(str(f))[1].lower()) for f in flat}
    if len(kinds) != 1 or None in kinds:
        raise ValueError(f"data_files must all be one of {sorted(_DATA_EXTENSIONS)}; got {flat!r}")
    return kinds.pop()  # type: ignore[return-value]


def load_rows(env_name: str, hub_path: str, hub_config: str | None, *, path: str | None = None,
              name: str | None = None, data_files: Any = None, fields: tuple[str, ...] = ()) -> dict[str, list[dict[str, Any]]]:
    """Rows of a dataset by split, through ``datasets``.

    ``data_files`` (a file, a list, or ``{split: files}``; JSONL, JSON, CSV or Parquet) or a
    local ``path`` are used as given; otherwise the hub dataset ``hub_path``/``hub_config``
    is loaded, and when that fails (offline, ``HF_HUB_OFFLINE=1``) :class:`EnvUnavailable`
    says how to pass local files with ``fields``.
    """
    key = (hub_path, path, name, _freeze(data_files))
    if key in _ROWS_CACHE:
        return _ROWS_CACHE[key]
    try:
        import datasets
    except ImportError as exc:
        raise EnvUnavailable(f"{env_name} needs the 'datasets' package: pip install 'trace-gym[datasets]'") from exc
    if data_files is None and path is not None and os.path.isfile(path):
        data_files, path = path, None
    schema = f"with the fields {', '.join(fields)}" if fields else "of the same schema"
    try:
        if data_files is not None:
            ds = datasets.load_dataset(_builder_for(data_files), data_files=data_files)
        else:
            config = name if name is not None else (hub_config if path is None else None)
            ds = datasets.load_dataset(path or hub_path, config)
    except Exception as exc:  # offline, unreachable, unknown dataset: connection errors come in many types
        if data_files is not None:
            raise
        raise EnvUnavailable(
            f"{env_name}: the dataset {path or hub_path!r} could not be loaded ({type(exc).__name__}); offline, pass "
            f"local files {schema} with data_files='file.jsonl' (or {{'train': ..., 'test': ...}}) or path='dir'. "
            f"Cause: {str(exc)[:300]}"
        ) from exc
    rows = {str(split): [dict(r) for r in ds[split]] for split in ds}
    missing = sorted({f for split_rows in rows.values() for r in split_rows[:1] for f in fields if f not in r})
    if missing:
        raise ValueError(f"{env_name}: the data lacks the field(s) {missing}; expected rows {schema}")
    _ROWS_CACHE[key] = rows
    return rows


class _RowTasks:
    """Tasks from dataset rows: ``get(i, split)`` is row ``i`` of ``split``. Datasets without a
    validation split get one carved from the end of train (``min(500, 10%)`` rows)."""

    def __init__(self, env_name: str, rows: dict[str, list[dict[str, Any]]], to_task: Callable[[dict[str, Any], str, int], Task],
                 keep: Callable[[dict[str, Any]], bool] | None = None):
        rows = {k: [r for r in v if keep is None or keep(r)] for k, v in rows.items()}
        if "validation" not in rows and "train" in rows:
            n_val = min(500, len(rows["train"]) // 10)
            if n_val:
                rows["validation"], rows["train"] = rows["train"][-n_val:], rows["train"][:-n_val]
        self.env_name, self.rows, self.to_task = env_name, rows, to_task

    def size(self, split: Split = "train") -> int:
        """Rows in ``split`` (0 when the data has no such split)."""
        return len(self.rows.get(split, ()))

    def get(self, index: int, split: Split = "train") -> Task:
        """The task of row ``index`` of ``split``."""
        if split not in self.rows:
            raise KeyError(f"{self.env_name}: the data has no {split!r} split (it has {sorted(self.rows)})")
        rows = self.rows[split]
        if not 0 <= index < len(rows):
            raise IndexError(f"{self.env_name}: index {index} out of range for {split!r} ({len(rows)} tasks)")
        return self.to_task(rows[index], split, index)


_GSM8K_CALC = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


def gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K solution (after ``####``), without thousands separators."""
    tail = solution.rsplit("####", 1)[-1].strip()
    return tail.replace(",", "").replace("$", "").strip()


class GSM8KEnv(_MathEnv):
    """GSM8K grade-school word problems (``openai/gsm8k``, config ``main``) with a calculator.

    Offline, pass ``data_files=`` with JSONL rows ``{"question": ..., "answer": "... #### 42"}``
    (or ``path=`` a local dataset directory). ``demonstrate`` replays the reference
    solution's calculator annotations (``<<48/2=24>>``) as tool calls.
    """

    env_id = "trace_gym/GSM8K-v0"
    hub_path, hub_config = "openai/gsm8k", "main"

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


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces matched."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        m = re.match(r"\\boxed\s+(\S+)", text[start:])  # "\boxed 5"
        return m.group(1).rstrip("$.") if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
    return None


def _math_level(row: dict[str, Any]) -> int | None:
    m = re.search(r"\d+", str(row.get("level", "")))
    return int(m.group()) if m else None


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
