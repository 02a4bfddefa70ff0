"""MathCalc's procedural problems: arithmetic and word problems at five graded levels.

:class:`MathCalcTasks` is the task source of ``trace_gym/MathCalc-v0``: tasks are
deterministic in (seed, index, split), the splits are disjoint by problem text, and each task
carries its solution steps (expressions over numbers only) and, where one exists, a single
combined expression.
"""

from __future__ import annotations

import math
import re
import zlib
from fractions import Fraction
from typing import Any, Callable, Iterable

import numpy as np

from trace_gym.envs.math.calculator import evaluate_expression, format_number
from trace_gym.task import Split, Task

__all__ = ["LEVELS", "MathCalcTasks"]

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
