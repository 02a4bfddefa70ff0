"""Tasks: one episode's problem statement and ground truth."""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

Split = Literal["train", "validation", "test"]


class Task(BaseModel):
    """One problem an agent environment can pose.

    ``prompt`` is the user's message; ``ground_truth`` whatever the env's verifier needs
    (a number, an answer string with aliases, a list of expected calls ...); ``metadata``
    holds anything else (difficulty, hops, category) and must be JSON-serialisable so
    tasks can be logged and replayed.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(description="Stable identifier, unique within its source and split.")
    prompt: str = Field(description="The user's request, as shown to the policy.")
    ground_truth: Any = Field(default=None, description="What the verifier compares the answer with.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Difficulty, category, hops, ...")
    split: Split = Field(default="train", description="Which split the task belongs to.")


@runtime_checkable
class TaskSource(Protocol):
    """A deterministic, indexable collection of tasks: ``source.get(i, split)`` always
    returns the same task for the same (seed, i, split)."""

    def get(self, index: int, split: Split = "train") -> Task:
        """Task ``index`` of ``split`` (the same task every call, for the source's seed)."""
        ...

    def size(self, split: Split = "train") -> int:
        """Number of tasks in ``split``; procedural sources may return a large bound."""
        ...


def candidate_indices(seed: int, step: int, size: int, n: int) -> list[int]:
    """The ``n`` task indices (out of ``size``) offered at ``step``: a pass through the split
    in an order shuffled once per epoch, so every task is offered once per epoch and the
    draw is a function of ``(seed, step)`` alone: every allocator, entry point and resumed
    run of a seed is offered exactly the same prompts. ``n > size`` repeats tasks."""
    import numpy as np

    if size < 1:
        raise ValueError("candidate_indices: the split holds no tasks")
    import math

    out: list[int] = []
    start = step * n
    while len(out) < n:
        epoch, offset = divmod(start + len(out), size)
        rng = np.random.default_rng([int(seed), int(epoch), 0xCA9D])
        take = min(n - len(out), size - offset)
        if size <= _MAX_MATERIALISED:
            order = rng.permutation(size)
            out.extend(int(i) for i in order[offset:offset + take])
        else:  # procedural sources (10^9 tasks): an affine bijection of the split, never materialised
            a = int(rng.integers(1, size))
            while math.gcd(a, size) != 1:
                a = int(rng.integers(1, size))
            c = int(rng.integers(0, size))
            out.extend((a * i + c) % size for i in range(offset, offset + take))
    return out


_MAX_MATERIALISED = 1 << 22
"""Splits up to this size are shuffled with a stored permutation; larger ones (procedural
sources that report a huge bound) with an affine bijection ``i -> (a i + c) mod size``."""


def split_counts(weights: "list[float]", total: int) -> list[int]:
    """``total`` prompts split over sources by weight (largest remainders), each at least 1."""
    import numpy as np

    w = np.asarray(weights, dtype=np.float64)
    raw = total * w / w.sum()
    counts = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - counts))[: total - counts.sum()]:
        counts[i] += 1
    return [max(1, int(c)) for c in counts]
