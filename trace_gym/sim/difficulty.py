"""ContrastLab difficulty distributions: how root success probabilities are drawn (``beta:A,B``, mixtures, files)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np



DEFAULT_DIFFICULTY = "0.5*beta:0.3,3+0.5*beta:3,0.3"

OPTIONS = "ABCDEFGH"

# ----------------------------------------------------------------------------- difficulty


class DifficultyError(ValueError):
    """A difficulty specification could not be understood; the message says why."""


@dataclass(frozen=True)
class Difficulty:
    """A distribution of root success probabilities.

    Either a mixture of Beta distributions (``components`` of ``(weight, a, b)``, weights
    summing to 1) or an explicit list of ``values`` (task ``i`` gets ``values[i % len]``).
    Build one with :func:`parse_difficulty`.
    """

    components: tuple[tuple[float, float, float], ...] = ()
    values: tuple[float, ...] = ()
    spec: str = ""

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` success probabilities (float64 in [0, 1])."""
        if self.values:
            v = np.asarray(self.values, dtype=np.float64)
            return v[np.arange(n) % v.size].copy()
        w = np.array([c[0] for c in self.components])
        which = rng.choice(len(self.components), size=n, p=w / w.sum())
        out = np.empty(n)
        for j, (_, a, b) in enumerate(self.components):
            sel = which == j
            out[sel] = rng.beta(a, b, size=int(sel.sum()))
        return out

    def __str__(self) -> str:
        return self.spec


def _float(text: str, what: str, spec: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise DifficultyError(f"bad difficulty spec {spec!r}: {what} {text.strip()!r} is not a number") from None
    if not math.isfinite(x):
        raise DifficultyError(f"bad difficulty spec {spec!r}: {what} must be finite, got {text.strip()!r}")
    return x


def _values(values: Sequence[float], spec: str) -> Difficulty:
    vals = tuple(float(v) for v in values)
    if not vals:
        raise DifficultyError(f"bad difficulty spec {spec!r}: the list of probabilities is empty")
    bad = [v for v in vals if not (0.0 <= v <= 1.0)]
    if bad:
        raise DifficultyError(f"bad difficulty spec {spec!r}: probabilities must lie in [0, 1], got {bad[0]!r}")
    return Difficulty(values=vals, spec=spec)


def parse_difficulty(spec: "str | Sequence[float] | Difficulty") -> Difficulty:
    """Parse a difficulty distribution.

    Accepted forms:

    * ``"beta:A,B"``: Beta(A, B) with A, B > 0;
    * a mixture ``"W1*beta:A,B+W2*beta:C,D"`` whose weights sum to 1
      (e.g. ``"0.5*beta:0.3,3+0.5*beta:3,0.3"``);
    * a path to a file of probabilities (whitespace-, comma- or newline-separated, or a
      JSON list): task ``i`` gets the ``i``-th value, cycling;
    * a Python sequence of probabilities (same meaning), or a :class:`Difficulty`.

    Raises :class:`DifficultyError` naming the problem.
    """
    if isinstance(spec, Difficulty):
        return spec
    if not isinstance(spec, str):
        return _values(list(spec), f"<list of {len(spec)} values>")
    text = spec.strip()
    if not text:
        raise DifficultyError("bad difficulty spec '': give beta:A,B, a mixture such as 0.5*beta:0.3,3+0.5*beta:3,0.3, or a file")
    if "beta:" not in text:
        path = Path(text).expanduser()
        if not path.is_file():
            raise DifficultyError(
                f"bad difficulty spec {spec!r}: not beta:A,B, not a mixture of W*beta:A,B terms, and no file of that name exists"
            )
        raw = path.read_text()
        tokens = [t for t in re.split(r"[\s,\[\]]+", raw) if t]
        return _values([_float(t, "value", spec) for t in tokens], spec)
    components = []
    for term in text.split("+"):
        term = term.strip()
        if not term:
            raise DifficultyError(f"bad difficulty spec {spec!r}: empty term in the mixture")
        if "*" in term:
            w_text, dist = term.split("*", 1)
            weight = _float(w_text, "mixture weight", spec)
        else:
            weight, dist = 1.0, term
        dist = dist.strip()
        if not dist.startswith("beta:"):
            raise DifficultyError(f"bad difficulty spec {spec!r}: unknown distribution {dist!r} (only beta:A,B is supported)")
        params = dist[len("beta:"):].split(",")
        if len(params) != 2:
            raise DifficultyError(f"bad difficulty spec {spec!r}: beta needs two parameters A,B, got {dist!r}")
        a, b = (_float(p, "beta parameter", spec) for p in params)
        if a <= 0 or b <= 0:
            raise DifficultyError(f"bad difficulty spec {spec!r}: beta parameters must be positive, got {a:g},{b:g}")
        if weight <= 0:
            raise DifficultyError(f"bad difficulty spec {spec!r}: mixture weights must be positive, got {weight:g}")
        components.append((weight, a, b))
    total = sum(c[0] for c in components)
    if abs(total - 1.0) > 1e-6:
        raise DifficultyError(f"bad difficulty spec {spec!r}: mixture weights sum to {total:g}, expected 1")
    return Difficulty(components=tuple(components), spec=text)


# ----------------------------------------------------------------------------- text
