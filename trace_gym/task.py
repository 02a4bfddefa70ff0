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

    def get(self, index: int, split: Split = "train") -> Task: ...

    def size(self, split: Split = "train") -> int:
        """Number of tasks in ``split``; procedural sources may return a large bound."""
        ...
