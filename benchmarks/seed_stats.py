"""Statistics over seeds for the benchmarks: 95% t-intervals and paired, seed-by-seed tables.

A benchmark runs each row on the same seeds; a seed fixes the pool, the world and the
policy's draws, so a row minus another on the same seed drops that shared noise
(:func:`paired_table`). Imported by the benchmark scripts of this folder (a script's own
folder is on ``sys.path``).
"""

from __future__ import annotations

import math

# the 95% Student t-interval the leaderboard's paired tables use: one definition for both
from trace_gym.leaderboard.paired import t_interval as interval
from trace_gym.leaderboard.render import markdown_table


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
    lines = markdown_table(head)
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


__all__ = ["fmt", "interval", "paired_table"]
