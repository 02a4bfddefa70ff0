"""Which rows of two runs generated the same, step by step.

A rerun (another machine, another commit, the rows in another order) is the same run only if
every step generated the same tokens. :func:`compare_runs` pairs the rows of two runs (same
track kind, env, allocator and seed) and finds, for each, the first step at which they part,
by the steps' generation fingerprints (:attr:`~trace_gym.leaderboard.records.StepRecord.generated`).
Records written before steps carried fingerprints are compared by their token counts: a
count that differs shows where two rows part, equal counts show nothing, and the verdict
says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, Sequence

from trace_gym.leaderboard.records import LoadedRecord, Record

Verdict = Literal["same", "parted", "unknown", "only_a", "only_b"]


@dataclass
class RowComparison:
    """One row of two runs: ``a``/``b`` its records (None where a run lacks the row).

    ``verdict`` is ``same`` (every step both ran has the same fingerprint), ``parted`` (from
    step ``first_different`` on, by fingerprint or by token count), ``unknown`` (no difference
    found, but some step has no fingerprint in one of the records: equal up to step
    ``fingerprinted`` exclusive by fingerprint, and by token count after), or ``only_a`` /
    ``only_b``."""

    a: Record | None
    b: Record | None
    verdict: Verdict
    first_different: int | None = None
    fingerprinted: int = 0
    by_tokens: bool = False
    """``parted`` found by token counts: that step has no fingerprint in one of the records."""

    def describe(self) -> str:
        """The verdict in words."""
        a, b = self.a, self.b
        if a is None or b is None:
            return f"only in run {'B' if a is None else 'A'}"
        n = min(len(a.steps), len(b.steps))
        extra = f" (A ran {len(a.steps)}, B {len(b.steps)})" if len(a.steps) != len(b.steps) else ""
        if self.verdict == "same":
            return f"same at all {n} steps{extra}"
        if self.verdict == "parted":
            k = self.first_different
            how = " (token counts differ)" if self.by_tokens else ""
            before = f"; {_steps_to(k - 1)} the same" if k and self.fingerprinted >= k else ""
            return f"parts at step {k} of {n}{how}{before}{extra}"
        if self.fingerprinted:
            return f"same at {_steps_to(self.fingerprinted - 1)} of {n}, then no fingerprint; token counts equal{extra}"
        return f"unknown: no fingerprints (older records); token counts equal at all {n} steps{extra}"


def _steps_to(last: int) -> str:
    return "step 0" if last == 0 else f"steps 0-{last}"


def _pair_key(r: Record) -> tuple[str, str, str, str, int]:
    return (r.kind, r.env_id, json.dumps(r.env_kwargs, sort_keys=True, default=str), r.allocator, r.seed)


def _index(records: Sequence[LoadedRecord], run: str) -> dict[tuple, Record]:
    out: dict[tuple, Record] = {}
    for lr in records:
        k = _pair_key(lr.record)
        if k in out:
            raise ValueError(f"run {run} holds two rows of allocator {lr.record.allocator!r}, seed {lr.record.seed} on "
                             f"{lr.record.env} (other policies or budgets): compare the records files of one each")
        out[k] = lr.record
    return out


def compare_rows(a: Record, b: Record) -> RowComparison:
    """Compare two records of one row step by step (see :class:`RowComparison`)."""
    fingerprinted = 0
    for sa, sb in zip(a.steps, b.steps):
        if sa.generated and sb.generated:
            if sa.generated != sb.generated:
                return RowComparison(a, b, "parted", first_different=sa.step, fingerprinted=fingerprinted)
            if fingerprinted == sa.step:
                fingerprinted = sa.step + 1
        elif sa.tokens != sb.tokens or sa.trajectories != sb.trajectories:
            return RowComparison(a, b, "parted", first_different=sa.step, fingerprinted=fingerprinted, by_tokens=True)
    n = min(len(a.steps), len(b.steps))
    return RowComparison(a, b, "same" if fingerprinted == n else "unknown", fingerprinted=fingerprinted)


def compare_runs(a: Sequence[LoadedRecord], b: Sequence[LoadedRecord]) -> list[RowComparison]:
    """Pair the rows of runs ``a`` and ``b`` (track kind, env and its kwargs, allocator, seed)
    and compare each pair; rows in only one run come last. Raises ``ValueError`` when a run
    holds two rows under one key (the same allocator and seed under two policies or budgets)."""
    ia, ib = _index(a, "A"), _index(b, "B")
    out = [compare_rows(ia[k], ib[k]) for k in ia if k in ib]
    out += [RowComparison(ia[k], None, "only_a") for k in ia if k not in ib]
    out += [RowComparison(None, ib[k], "only_b") for k in ib if k not in ia]
    return out


__all__ = ["RowComparison", "Verdict", "compare_rows", "compare_runs"]
