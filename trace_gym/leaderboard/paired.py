"""Rows against a baseline row, paired by seed (``trace-gym leaderboard show --against ROW``).

A seed fixes a run's task draws and its sampling, so a row minus the baseline on the same seed
drops much of the noise the two share; on a handful of seeds that is what can tell a row from
the baseline. For every other row of a group, over the seeds it shares with the baseline:

* the group's rank metric (:data:`~trace_gym.leaderboard.records.RANK_METRIC`: held-out
  accuracy for training, the effective sample ratio under grpo's advantage for allocation)
  minus the baseline's, and on how many seeds the row is ahead;
* the generated tokens, as a multiple of the baseline's;
* training only, the tokens to the baseline's final accuracy: the generated tokens at which
  the row's held-out accuracy first reaches the baseline's final one (linear between its
  evaluations; never, if it does not), as a multiple of the tokens the baseline spent. Where
  the baseline ended no higher than its first evaluation there is no gain to reach (a row
  from the same start would "reach" it with no tokens at all), so that seed's figure is n/a.

Each is a mean with the half-width of a 95% Student t-interval over the seeds (none for one
seed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from trace_gym.leaderboard.records import EvalPoint, Group, Record, Row


def t_interval(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, half-width of the 95% Student t-interval)``; the half-width is NaN for fewer
    than two values, and the mean is inf when any value is."""
    xs = np.asarray(values, dtype=float)
    if xs.size == 0:
        raise ValueError("t_interval needs at least one value")
    if np.isinf(xs).any():
        return math.inf, math.nan
    if xs.size < 2:
        return float(xs[0]), math.nan
    from scipy.stats import t

    half = t.ppf(0.975, xs.size - 1) * xs.std(ddof=1) / math.sqrt(xs.size)
    return float(xs.mean()), float(half)


def first_reach(spent: Sequence[float], accuracy: Sequence[float], target: float) -> float:
    """Where an accuracy curve first reaches ``target``: ``spent`` (tokens, trajectories) and
    ``accuracy`` are the curve's points in order. The first point's spend when it already
    reaches it, linear between the two points around the crossing, inf when none reaches it."""
    if len(spent) != len(accuracy):
        raise ValueError(f"first_reach: {len(spent)} spend values for {len(accuracy)} accuracies")
    for i, acc in enumerate(accuracy):
        # the tolerance keeps a seed-averaged curve that ties the target (summed in another
        # order) from missing it by a rounding error
        if acc >= target - 1e-12:
            if i == 0:
                return float(spent[0])
            # the point before is below target - 1e-12 and this one is not, so acc > a0
            a0 = accuracy[i - 1]
            frac = min(1.0, (target - a0) / (acc - a0))
            return float(spent[i - 1] + frac * (spent[i] - spent[i - 1]))
    return math.inf


def tokens_to_reach(evals: Sequence[EvalPoint], target: float) -> float:
    """Generated tokens at which held-out accuracy first reaches ``target`` over the
    evaluations in step order (:func:`first_reach`)."""
    points = sorted(evals, key=lambda e: e.step)
    return first_reach([e.tokens for e in points], [e.accuracy for e in points], target)


def ratio_to_baseline_final(spent: Sequence[float], accuracy: Sequence[float], baseline_accuracy: Sequence[float],
                            baseline_spent: float) -> float:
    """Where the curve (``spent``, ``accuracy``) first reaches the last of the baseline's
    accuracies (:func:`first_reach`), over ``baseline_spent`` (inf: never). NaN where that
    figure would measure nothing: the baseline's last accuracy is not above its first (no
    gain to reach, and a curve from the same start would "reach" it at once), or it spent
    nothing."""
    if not baseline_spent or (len(baseline_accuracy) > 1 and baseline_accuracy[-1] <= baseline_accuracy[0]):
        return math.nan
    return first_reach(spent, accuracy, baseline_accuracy[-1]) / baseline_spent


def tokens_to_baseline_final(evals: Sequence[EvalPoint], baseline: Sequence[EvalPoint], baseline_tokens: int) -> float:
    """Tokens at which ``evals`` first reach the final accuracy of the ``baseline``
    evaluations, over ``baseline_tokens`` (:func:`ratio_to_baseline_final`: inf never, NaN
    where the baseline did not gain on its first evaluation or spent no tokens)."""
    points = sorted(evals, key=lambda e: e.step)
    base = [e.accuracy for e in sorted(baseline, key=lambda e: e.step)]
    return ratio_to_baseline_final([e.tokens for e in points], [e.accuracy for e in points], base, baseline_tokens)


@dataclass
class PairedRow:
    """One row against the baseline, seed by seed (lists in the order of ``seeds``).

    ``metric_diff``: the rank metric minus the baseline's; ``token_ratio``: generated tokens
    over the baseline's; ``tokens_to_baseline``: tokens to the baseline's final accuracy over
    the baseline's tokens (inf where never reached, NaN where the baseline did not gain on its
    first evaluation: :func:`tokens_to_baseline_final`; None for allocation groups)."""

    allocator: str
    seeds: list[int]
    metric_diff: list[float]
    token_ratio: list[float]
    tokens_to_baseline: list[float] | None

    @property
    def ahead(self) -> int:
        """Seeds on which the row's rank metric is above the baseline's."""
        return sum(d > 0 for d in self.metric_diff)

    @property
    def level(self) -> int:
        """Seeds on which the row's rank metric equals the baseline's."""
        return sum(d == 0 for d in self.metric_diff)


def _by_seed(row: Row) -> dict[int, Record]:
    return {lr.record.seed: lr.record for lr in row.records}


def paired(group: Group, against: str) -> list[PairedRow]:
    """Every row of ``group`` but ``against``, paired by seed with the ``against`` row (in the
    group's rank order). Raises ``KeyError`` naming the group's rows when ``against`` is not
    one of them. A row's seeds are those it shares with the baseline; a row sharing none is
    left out, and a seed on which either has no rank metric is skipped for that metric."""
    rows = {row.allocator: row for row in group.rows}
    if against not in rows:
        raise KeyError(f"--against {against!r} is not a row of {group.title} (rows: {', '.join(rows)})")
    base = _by_seed(rows[against])
    metric = group.rank_metric
    out = []
    for row in group.rows:
        if row.allocator == against:
            continue
        mine = _by_seed(row)
        seeds = sorted(set(mine) & set(base))
        if not seeds:
            continue
        diff, ratio, reach = [], [], []
        for seed in seeds:
            r, b = mine[seed], base[seed]
            if r.final.get(metric) is not None and b.final.get(metric) is not None:
                diff.append(r.final[metric] - b.final[metric])
            ratio.append(r.spent.tokens / b.spent.tokens if b.spent.tokens else math.nan)
            if group.kind == "training" and b.evals and r.evals:
                reach.append(tokens_to_baseline_final(r.evals, b.evals, b.spent.tokens))
        out.append(PairedRow(row.allocator, seeds, diff, ratio, reach if group.kind == "training" else None))
    return out


PAIRED_LEGEND = ("paired by seed: each row minus (or over) {row} on each seed both ran, mean ± half-width of the 95% "
                 "Student t-interval over those seeds (no ± for one seed); ahead on: seeds on which the row's ranked "
                 "metric is above {row}'s (level: equal to it); tokens to {row}'s final acc.: generated tokens when the row's held-out "
                 "accuracy first reaches {row}'s final one (linear between evaluations), over {row}'s tokens "
                 "(n/a: {row}'s final acc. is not above its first evaluation, so there is no gain to reach).")
"""The legend under a paired table (``{row}``: the baseline row)."""


def _mean_pm(values: Sequence[float], digits: int, signed: bool = False) -> str:
    if not values:
        return "-"
    m, h = t_interval(values)
    sign = "+" if signed else ""
    return f"{m:{sign}.{digits}f}" + ("" if math.isnan(h) else f" ± {h:.{digits}f}")


def _reach_cell(values: Sequence[float]) -> str:
    defined = [v for v in values if not math.isnan(v)]
    reached = [v for v in defined if not math.isinf(v)]
    per_seed = " / ".join("n/a" if math.isnan(v) else "never" if math.isinf(v) else f"{v:.2f}" for v in values)
    if len(values) == 1 or not defined:
        return per_seed
    if len(reached) == len(values):
        return f"{_mean_pm(values, 2)} ({per_seed})"
    na = len(values) - len(defined)
    return f"reached on {len(reached)} of {len(defined)} seeds" + (f", {na} n/a" if na else "") + f" ({per_seed})"


def paired_table(group: Group, against: str) -> tuple[list[str], list[list[str]]]:
    """Header and cells of :func:`paired`'s table, mean ± 95% t half-width over seeds."""
    metric = "held-out acc." if group.kind == "training" else "eff. sample ratio (grpo adv.)"
    header = ["allocator", "seeds", f"{metric} − {against}'s", "ahead on", f"tokens (x {against}'s)"]
    if group.kind == "training":
        header.append(f"tokens to {against}'s final acc. (x {against}'s tokens; by seed)")
    cells = []
    for p in paired(group, against):
        row = [p.allocator, ", ".join(map(str, p.seeds)), _mean_pm(p.metric_diff, 3, signed=True),
               f"{p.ahead} of {len(p.metric_diff)}" + (f" ({p.level} level)" if p.level else ""), _mean_pm(p.token_ratio, 2)]
        if p.tokens_to_baseline is not None:
            row.append(_reach_cell(p.tokens_to_baseline) if p.tokens_to_baseline else "-")
        cells.append(row)
    return header, cells


__all__ = ["PAIRED_LEGEND", "PairedRow", "paired", "paired_table", "ratio_to_baseline_final", "t_interval", "tokens_to_baseline_final", "tokens_to_reach"]
