"""Statistics over seeds for the benchmarks: 95% t-intervals and paired, seed-by-seed tables.

A benchmark runs each row on the same seeds; a seed fixes the pool, the world and the
policy's draws, so a row minus another on the same seed drops that shared noise
(:func:`paired_table`). Imported by the benchmark scripts of this folder (a script's own
folder is on ``sys.path``).
"""

from __future__ import annotations

import math
import statistics

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def t975(df: int) -> float:
    """Student's t 97.5% quantile: the table to 9 degrees of freedom, beyond it the
    Cornish-Fisher expansion around the normal quantile (within 0.003 of the exact value)."""
    if df in T975:
        return T975[df]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def interval(xs: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval); inf if any value is inf; half-width nan for one value."""
    if any(math.isinf(x) for x in xs):
        return math.inf, math.nan
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, math.nan
    return m, t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def fmt(mi: tuple[float, float], pct: bool = False, digits: int = 2) -> str:
    """A (mean, half-width) pair as `m ± h` (`digits` decimals; percent points with `pct`); "not reached" for inf."""
    m, h = mi
    if math.isinf(m):
        return "not reached"
    if pct:
        return f"{100 * m:.1f} ± {100 * h:.1f}" if not math.isnan(h) else f"{100 * m:.1f}"
    return f"{m:.{digits}f} ± {h:.{digits}f}" if not math.isnan(h) else f"{m:.{digits}f}"


def paired_table(values: dict[str, dict[int, float]], against: str, what: str, scale: float = 1.0,
                 higher_is_better: bool = True, digits: int = 2) -> list[str]:
    """Markdown: every row's ``values`` minus ``against``'s on the same seed (times ``scale``),
    mean ± 95% interval to ``digits`` decimals, and on how many seeds the row is ahead; seeds
    where either value is not finite are left out and counted. Rows in the order given."""
    head = ["row", f"{what}: row − {against}", "row ahead on", "seeds left out"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    base = values[against]
    for key, by_seed in values.items():
        if key == against:
            continue
        seeds = sorted(set(by_seed) & set(base))
        both = [s for s in seeds if math.isfinite(by_seed[s]) and math.isfinite(base[s])]
        diff = [scale * (by_seed[s] - base[s]) for s in both]
        ahead = sum((d > 0) if higher_is_better else (d < 0) for d in diff)
        text = fmt(interval(diff), digits=digits) if diff else "–"
        lines.append(f"| {key} | {text} | {ahead} of {len(diff)} | {len(seeds) - len(both)} |")
    return lines


__all__ = ["T975", "fmt", "interval", "paired_table", "t975"]
