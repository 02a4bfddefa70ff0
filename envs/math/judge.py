"""Answer judging for the math envs: math-verify with guards against hedging and huge values.

:func:`judge_math` is math-verify with its signal-based timeouts turned off, so it is safe in
threads; time is bounded here instead: answers are length-limited, and expressions whose value
could not be computed quickly (``10^{10^{10}}``, ``(10^6)!``) get 0 before math-verify sees
them. Reward hacking gets 0: several answers at once (``1 or 2 or 3``,
``\\boxed{1}\\boxed{2}``), a list of numbers, an answer with more parts than the ground truth
(:func:`several_answers`).
"""

from __future__ import annotations

import logging
import math
import re
from functools import lru_cache
from typing import Any, Iterable

__all__ = ["judge_math", "last_boxed", "score_math", "several_answers"]

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
