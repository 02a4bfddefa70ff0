"""A record cut to its run's first steps (``trace-gym leaderboard show --steps N``).

A leaderboard ranks rows at an equal budget, so a run of 12 steps cannot sit in a table with
one of 8. But the first 8 steps of the longer run are an 8-step run: a step does not know how
many follow it (the schedule, the seed's draws and the step's metrics depend only on the
steps before), so its records of those steps are what an 8-step run of the same row writes.
:func:`first_steps` rebuilds that record from the longer one:

* ``budget.steps``, ``steps`` and ``spent`` (trajectories and tokens summed over the kept
  steps; ``wall_s`` is not recorded by step, so it is the run's prorated by tokens);
* the evaluations after the kept steps; a training record must have been evaluated after
  step N itself, as an N-step run is after its last step;
* ``final``: the metrics that are means over steps (:data:`~trace_gym.leaderboard.runner.ALLOCATION_FINAL`;
  training: :func:`~trace_gym.leaderboard.runner.training_final`, which also reads the held-out
  accuracy, pass@k and accuracy gain from the last kept evaluation) and the failed share, again
  over the kept steps.
  Any other final metric (the shared calibration set's AUCs, scored on the predictor as the
  whole run left it) cannot be had for step N and reads None;
* the digest, sealed anew. Everything else (run, config hash, host, commit) is the longer
  run's, so the provenance still names where the steps came from.

The one difference from a real N-step run is a learning-rate schedule that depends on the
run's length: a trainer whose schedule decays over ``steps`` (``optim.schedule: cosine``)
took its first N steps at other rates than an N-step run would. Training records keep each
step's learning rate (the step metric ``lr``), and a record whose rate fell during its run
is refused; a record written before the rate was kept cannot be checked. ``trace-gym
leaderboard compare`` tells, by the steps' generation fingerprints, whether a cut record and
a shorter run generated the same.
"""

from __future__ import annotations

from typing import Sequence

from trace_gym.leaderboard.records import LoadedRecord, Record, make_record
from trace_gym.leaderboard.runner import ALLOCATION_FINAL, failed_share, mean_metrics, training_final


class CutError(ValueError):
    """A record that cannot be cut to the steps asked for: it ran fewer, (training) it was not
    evaluated after the last of them, or its learning rate fell during its run."""


def decayed_rate(record: Record) -> tuple[float, float] | None:
    """``(highest, last)`` learning rate of a record whose rate fell during its run, from the
    steps' ``lr`` metric (a warm-up rises, a constant rate stays); None where it never fell
    or the steps do not record it."""
    rates = [r for r in (s.metrics.get("lr") for s in record.steps) if r is not None]
    top = 0.0
    for r in rates:
        # relative tolerance: a float32 optimizer's rate read back may differ in its last bits
        if r < top * (1 - 1e-6):
            return top, rates[-1]
        top = max(top, r)
    return None


def first_steps(record: Record, steps: int) -> Record:
    """``record`` as its run's first ``steps`` steps (the module docstring says what changes).
    The record itself where it ran exactly ``steps``. Raises :class:`CutError` where it ran
    fewer, where ``steps`` is below 1, where a training record has no evaluation after step
    ``steps``, or where its learning rate fell during the run (:func:`decayed_rate`)."""
    ran = record.budget.steps
    if steps < 1:
        raise CutError(f"cannot cut to {steps} steps: a record keeps at least one")
    if steps > ran:
        raise CutError(f"ran {ran} steps, fewer than the {steps} asked for")
    if steps == ran:
        return record
    decay = decayed_rate(record)
    if decay is not None:
        raise CutError(f"its learning rate fell from {decay[0]:.3g} to {decay[1]:.3g} over its {ran} steps: a schedule over the "
                       f"run's length (as optim.schedule: cosine), so its first {steps} steps ran at other rates than a "
                       f"{steps}-step run; run {steps} steps instead")
    kept = record.steps[:steps]
    evals = [e for e in record.evals if e.step <= steps]
    if record.kind == "training" and (not evals or evals[-1].step != steps):
        at = ", ".join(str(e.step) for e in record.evals)
        raise CutError(f"was not evaluated after step {steps} (evaluated after steps {at}), so it has no held-out "
                       f"accuracy there; cut at one of those steps")
    tokens = sum(s.tokens for s in kept)
    trajectories = sum(s.trajectories for s in kept)
    wall = record.spent.wall_s * tokens / record.spent.tokens if record.spent.tokens else 0.0
    final: dict[str, float | None] = {name: None for name in record.final}
    if record.kind == "training":
        final.update(training_final(kept, evals))
    else:
        final.update(mean_metrics(kept, [name for name in record.final if name in ALLOCATION_FINAL]))
    if "failed_share" in record.final:
        final["failed_share"] = failed_share(kept)
    fields = record.model_dump(by_alias=False, exclude={"schema_", "digest"})
    fields.update(budget={**fields["budget"], "steps": steps}, steps=[s.model_dump() for s in kept],
                  evals=[e.model_dump() for e in evals], final=final,
                  spent={"trajectories": trajectories, "tokens": tokens, "wall_s": wall})
    return make_record(**fields)


def cut_records(records: Sequence[LoadedRecord], steps: int) -> list[LoadedRecord]:
    """Every record as its run's first ``steps`` steps (:func:`first_steps`), each still
    naming where it was read (``file:line (first N steps)`` where it was cut). Raises
    :class:`CutError` naming every record that cannot be cut and why."""
    out, problems = [], []
    for lr in records:
        try:
            rec = first_steps(lr.record, steps)
        except CutError as exc:
            problems.append(f"  {lr.record.allocator}, seed {lr.record.seed} ({lr.where}): {exc}")
            continue
        out.append(lr if rec is lr.record else LoadedRecord(rec, f"{lr.where} (first {steps} steps)"))
    if problems:
        raise CutError(f"cannot show the first {steps} steps of {len(problems)} record(s):\n" + "\n".join(problems))
    return out


__all__ = ["CutError", "cut_records", "decayed_rate", "first_steps"]
