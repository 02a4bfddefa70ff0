"""The ``calculator`` tool of the math envs: a safe arithmetic evaluator.

:func:`evaluate_expression` parses the text with :mod:`ast` (no ``eval``/``exec``) and
allows only numbers, ``+ - * / // % **`` (``^`` is power), parentheses, a fixed table of
functions and the constants ``pi``, ``e``, ``tau``. Integers and decimals stay exact
(:class:`~fractions.Fraction`); sizes are bounded (expression length and parts, exponents,
result bits, factorials), so no input can hang or exhaust memory. :func:`format_number` is
how results and ground truths are written.
"""

from __future__ import annotations

import ast
import math
import operator
import warnings
from fractions import Fraction
from typing import Callable, Mapping

from trace_gym.env.tools import ToolError

__all__ = ["CalculatorError", "Number", "evaluate_expression", "format_number"]

Number = Fraction | float

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
