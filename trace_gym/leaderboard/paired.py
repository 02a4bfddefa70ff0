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
  evaluations), as a multiple of the tokens the baseline spent; a row that does not reach it
  within its run shows "not by" its own token multiple (the figure is above it). Where
  the baseline ended no higher than its first evaluation there is no gain to reach (a row
  from the same start would "reach" it with no tokens at all), so that seed's figure is n/a;
* training only, the held-out accuracy at equal tokens: the row's accuracy minus the
  baseline's at the fewer of the two runs' last-evaluated tokens, each curve linear between
  its evaluations (:func:`accuracy_at`). Where the curves flatten the figure to reach the
  baseline's final accuracy divides by a slope near zero and swings over much of a run; this
  one does not. Its bias is stated instead: the run that spent more is read between two of
  its evaluations, and the chord of a curve that flattens lies below it, so the figure leans
  toward the run that spent fewer tokens (evaluating more often shrinks it).

Each is a mean with the half-width of a 95% Student t-interval over the seeds (none for one
seed).

Training records that keep their final evaluation's per-task scores
(:attr:`~trace_gym.leaderboard.records.EvalPoint.task_scores`) also give the evaluation's
own noise on the held-out accuracy difference: on each seed the row's and the baseline's
scores are paired task by task (both evaluated the same held-out tasks), the variance of the
mean difference is their sample variance over the tasks divided by the task count, and the
seeds' variances add up to that of the mean over seeds (:func:`eval_noise`). A difference
inside it is one the evaluation cannot tell from zero, on however many seeds; the t-interval
over seeds holds the training's variance as well.
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


def _bracket(spent: Sequence[float], at: float) -> tuple[int, int, float] | None:
    """``(i, j, w)`` such that a curve with points at ``spent`` (in order) reads
    ``(1 - w) * y[i] + w * y[j]`` at ``at``: the first point at ``at`` itself (``i == j``), else
    the two around it; None outside the curve's span."""
    for j, x in enumerate(spent):
        if x < at:
            continue
        if x == at:
            return j, j, 1.0
        if j == 0:
            return None
        return j - 1, j, (at - spent[j - 1]) / (x - spent[j - 1])
    return None


def curve_at(spent: Sequence[float], accuracy: Sequence[float], at: float) -> float:
    """An accuracy curve's value at spend ``at`` (``spent``, ``accuracy``: its points in
    order): a point's own where one is there, else linear between the two around it; NaN
    outside the curve's span. The reading :func:`first_reach` inverts."""
    if len(spent) != len(accuracy):
        raise ValueError(f"curve_at: {len(spent)} spend values for {len(accuracy)} accuracies")
    where = _bracket(spent, at)
    if where is None:
        return math.nan
    i, j, w = where
    return float(accuracy[j]) if i == j else (1 - w) * accuracy[i] + w * accuracy[j]


def difference_at_equal_spend(spent: Sequence[float], accuracy: Sequence[float], base_spent: Sequence[float],
                               base_accuracy: Sequence[float]) -> float:
    """A curve's accuracy minus a baseline curve's at the fewer of the two curves' last spend,
    both read by :func:`curve_at` (points in order of spend)."""
    at = min(spent[-1], base_spent[-1])
    return curve_at(spent, accuracy, at) - curve_at(base_spent, base_accuracy, at)


def accuracy_at(evals: Sequence[EvalPoint], tokens: float) -> tuple[float, list[float] | None]:
    """Held-out accuracy of ``evals`` (in step order) at ``tokens`` generated tokens
    (:func:`curve_at`), with the per-task scores mixed by the same weights (None where either
    evaluation lacks them). NaN and None outside the evaluated span. Raises ``ValueError``
    for no evaluations."""
    points = sorted(evals, key=lambda e: e.step)
    if not points:
        raise ValueError("accuracy_at needs at least one evaluation")
    where = _bracket([e.tokens for e in points], tokens)
    if where is None:
        return math.nan, None
    i, j, w = where
    a, e = points[i], points[j]
    if i == j:
        return e.accuracy, list(e.task_scores) if e.task_scores else None
    scores = None
    if a.task_scores and e.task_scores and len(a.task_scores) == len(e.task_scores):
        scores = [(1 - w) * x + w * y for x, y in zip(a.task_scores, e.task_scores)]
    return (1 - w) * a.accuracy + w * e.accuracy, scores


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


def eval_noise(rows: Sequence[Sequence[float]], baselines: Sequence[Sequence[float]]) -> float:
    """Half-width of the 95% normal interval that evaluation noise alone puts on the mean over
    seeds of (row's accuracy - baseline's), from each seed's per-task scores of the row and of
    the baseline (same tasks, same order): ``1.96 * sqrt(sum_s var_s) / S`` with ``var_s`` the
    sample variance of the per-task differences over the ``n`` tasks, over ``n``. NaN where
    the differences do not vary on any seed (as when the rows agree on every task): there is
    no spread to estimate the noise from, and a half-width of 0 would claim a certainty the
    evaluation does not have. Raises ``ValueError`` for no seeds, scores of unequal length or
    fewer than two tasks."""
    if not rows or len(rows) != len(baselines):
        raise ValueError(f"eval_noise: {len(rows)} rows' scores for {len(baselines)} baselines' (one each per seed, at least one)")
    total = 0.0
    for r, b in zip(rows, baselines):
        if len(r) != len(b) or len(r) < 2:
            raise ValueError(f"eval_noise: per-task scores of {len(r)} and {len(b)} tasks (the same tasks, at least two)")
        d = np.asarray(r, dtype=float) - np.asarray(b, dtype=float)
        total += float(d.var(ddof=1)) / d.size
    if total == 0.0:
        return math.nan
    return 1.959964 * math.sqrt(total) / len(rows)


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
    first evaluation: :func:`tokens_to_baseline_final`; None for allocation groups);
    ``eval_noise``: see the field."""

    allocator: str
    seeds: list[int]
    metric_diff: list[float]
    token_ratio: list[float]
    tokens_to_baseline: list[float] | None
    eval_noise: float | None = None
    """:func:`eval_noise` over the row's seeds (training only; None where a record of those
    seeds has no per-task scores of its final evaluation; NaN where the per-task differences
    do not vary on any seed)."""
    equal_tokens_diff: list[float] | None = None
    """Training only: held-out accuracy minus the baseline's at the fewer of the two runs'
    last-evaluated tokens, each by :func:`accuracy_at` (NaN where a curve does not span them)."""
    equal_tokens_noise: float | None = None
    """:func:`eval_noise` on :attr:`equal_tokens_diff`, from the per-task scores mixed as the
    accuracies are (None where some evaluation it reads has no per-task scores)."""

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
    training = group.kind == "training"
    out = []
    for row in group.rows:
        if row.allocator == against:
            continue
        mine = _by_seed(row)
        seeds = sorted(set(mine) & set(base))
        if not seeds:
            continue
        diff, ratio, reach, equal, equal_scores = [], [], [], [], []
        for seed in seeds:
            r, b = mine[seed], base[seed]
            if r.final.get(metric) is not None and b.final.get(metric) is not None:
                diff.append(r.final[metric] - b.final[metric])
            ratio.append(r.spent.tokens / b.spent.tokens if b.spent.tokens else math.nan)
            if training and b.evals and r.evals:
                reach.append(tokens_to_baseline_final(r.evals, b.evals, b.spent.tokens))
                at = min(r.evals[-1].tokens, b.evals[-1].tokens)
                (ra, rs), (ba, bs) = accuracy_at(r.evals, at), accuracy_at(b.evals, at)
                equal.append(ra - ba)
                equal_scores.append((rs, bs))
        noise = equal_noise = None
        if training:
            noise = _noise_where_scored([(_final_scores(mine[seed]), _final_scores(base[seed])) for seed in seeds])
            equal_noise = _noise_where_scored(equal_scores)
        out.append(PairedRow(row.allocator, seeds, diff, ratio, reach if training else None, noise,
                             equal if training else None, equal_noise))
    return out


def _noise_where_scored(pairs: Sequence[tuple[Sequence[float] | None, Sequence[float] | None]]) -> float | None:
    """:func:`eval_noise` over per-seed ``(row, baseline)`` per-task scores; None where there
    are no seeds or some seed lacks scores on either side or has them of unequal length."""
    if not pairs or not all(r and b and len(r) == len(b) for r, b in pairs):
        return None
    return eval_noise([r for r, _ in pairs], [b for _, b in pairs])


def _final_scores(record: Record) -> list[float]:
    """The per-task scores of the record's last evaluation (empty where it has none; a
    record's evaluations are in step order, which loading checks)."""
    return record.evals[-1].task_scores if record.evals else []


PAIRED_LEGEND = ("paired by seed: each row minus (or over) {row} on each seed both ran, mean ± half-width of the 95% "
                 "Student t-interval over those seeds (no ± for one seed); ahead on: seeds on which the row's ranked "
                 "metric is above {row}'s (level: equal to it); tokens to {row}'s final acc.: generated tokens when the row's held-out "
                 "accuracy first reaches {row}'s final one (linear between evaluations), over {row}'s tokens "
                 "(not by x: the row did not reach it within its own tokens, x times {row}'s, so the figure is above x; "
                 "n/a: {row}'s final acc. is not above its first evaluation, so there is no gain to reach).")
"""The legend under a paired table (``{row}``: the baseline row)."""

EVAL_NOISE = "eval noise (95%, tasks paired)"
"""The header of the column of :attr:`PairedRow.eval_noise`, present where a row has it."""

EVAL_NOISE_LEGEND = (" eval noise: the 95% half-width that the held-out evaluation's own sampling puts on the held-out "
                     "acc. difference (the final evaluations' per-task scores paired task by task, normal approximation): "
                     "a difference inside it is not told apart by the evaluation, on however many seeds "
                     "(n/a: the per-task differences do not vary on any seed, as when the rows agree on every task, "
                     "so there is no spread to estimate it from).")
"""Appended to the legend where the table has the eval-noise column."""

EQUAL_TOKENS_LEGEND = (" acc. at equal tokens: the row's held-out accuracy minus {row}'s at the fewer of the two runs' "
                       "last-evaluated tokens, each curve linear between its evaluations (eval ±: the evaluation's own "
                       "noise on it, per-task scores mixed the same way); unlike the tokens to {row}'s final acc. it does "
                       "not swing where the curves flatten, but it leans toward the run that spent fewer tokens: the other "
                       "is read between two evaluations, below a curve that flattens.")
"""Appended to the legend of a training group's paired table (``{row}``: the baseline row)."""

EQUAL_TOKENS = "held-out acc. − {row}'s at equal tokens"
"""The header of the column of :attr:`PairedRow.equal_tokens_diff` (``{row}``: the baseline row)."""


def _mean_pm(values: Sequence[float], digits: int, signed: bool = False) -> str:
    if not values:
        return "-"
    m, h = t_interval(values)
    sign = "+" if signed else ""
    return f"{m:{sign}.{digits}f}" + ("" if math.isnan(h) else f" ± {h:.{digits}f}")


def _reach_cell(values: Sequence[float], spent: Sequence[float], seeds: Sequence[int]) -> str:
    # a run that stopped before reaching the target is censored at its own spend, not
    # "never": the figure is above that spend, which decides a target below it
    defined = [v for v in values if not math.isnan(v)]
    reached = [v for v in defined if not math.isinf(v)]
    texts = ["n/a" if math.isnan(v) else f"not by {x:.2f}" if math.isinf(v) else f"{v:.2f}" for v, x in zip(values, spent)]
    if 0 < len(reached) < len(values):
        # "not by 0.76 / 0.72" would read as two censored seeds: name each seed where they mix
        per_seed = "; ".join(f"seed {seed}: {text}" for seed, text in zip(seeds, texts))
    else:
        per_seed = " / ".join(texts)
    if len(values) == 1 or not defined:
        return per_seed
    if len(reached) == len(values):
        return f"{_mean_pm(values, 2)} ({per_seed})"
    na = len(values) - len(defined)
    return f"reached on {len(reached)} of {len(defined)} seeds" + (f", {na} n/a" if na else "") + f" ({per_seed})"


def _equal_tokens_cell(values: Sequence[float], noise: float | None) -> str:
    defined = [v for v in values if not math.isnan(v)]
    na = len(values) - len(defined)
    cell = _mean_pm(defined, 3, signed=True) if defined else "n/a"
    if noise is not None and defined:
        cell += " (eval n/a)" if math.isnan(noise) else f" (eval ± {noise:.3f})"
    return cell + (f"; n/a on {na} of {len(values)} seeds" if na and defined else "")


def paired_table(group: Group, against: str) -> tuple[list[str], list[list[str]]]:
    """Header and cells of :func:`paired`'s table, mean ± 95% t half-width over seeds; the
    :data:`EVAL_NOISE` column (after the accuracy difference) only where a row has the figure."""
    metric = "held-out acc." if group.kind == "training" else "eff. sample ratio (grpo adv.)"
    header = ["allocator", "seeds", f"{metric} − {against}'s", "ahead on", f"tokens (x {against}'s)"]
    if group.kind == "training":
        header += [EQUAL_TOKENS.format(row=against), f"tokens to {against}'s final acc. (x {against}'s tokens; by seed)"]
    rows = paired(group, against)
    noise = any(p.eval_noise is not None for p in rows)
    if noise:
        header.insert(3, EVAL_NOISE)
    cells = []
    for p in rows:
        row = [p.allocator, ", ".join(map(str, p.seeds)), _mean_pm(p.metric_diff, 3, signed=True),
               f"{p.ahead} of {len(p.metric_diff)}" + (f" ({p.level} level)" if p.level else ""), _mean_pm(p.token_ratio, 2)]
        if noise:
            row.insert(3, "-" if p.eval_noise is None else "n/a" if math.isnan(p.eval_noise) else f"± {p.eval_noise:.3f}")
        if p.equal_tokens_diff is not None:
            row.append(_equal_tokens_cell(p.equal_tokens_diff, p.equal_tokens_noise) if p.equal_tokens_diff else "-")
        if p.tokens_to_baseline is not None:
            row.append(_reach_cell(p.tokens_to_baseline, p.token_ratio, p.seeds) if p.tokens_to_baseline else "-")
        cells.append(row)
    return header, cells


__all__ = ["EQUAL_TOKENS", "EQUAL_TOKENS_LEGEND", "EVAL_NOISE", "EVAL_NOISE_LEGEND", "PAIRED_LEGEND", "PairedRow", "accuracy_at", "curve_at", "difference_at_equal_spend", "eval_noise", "paired", "paired_table", "ratio_to_baseline_final", "t_interval", "tokens_to_baseline_final", "tokens_to_reach"]
