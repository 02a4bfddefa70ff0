"""The budget of one step (the paper's M and its split over the two stages) and what an
allocator spent of it."""

from __future__ import annotations

from dataclasses import dataclass


class BudgetExceeded(RuntimeError):
    """An allocator planned more trajectories than its budget allows."""


@dataclass(frozen=True)
class Budget:
    """What one training step may spend.

    Attributes:
        trajectories: M, rollouts per step (bare rollouts plus branch continuations).
        root_fraction: share of M spent in stage 1 on bare rollouts (the rest is stage 2).
        min_per_prompt: m_min, the fewest rollouts a selected prompt gets in stage 1
            (one rollout alone can never be mixed).
        max_per_prompt: cap on one prompt's stage-1 rollouts (None: no cap).
        group_size: rollouts per prompt for fixed-group allocators (GRPO's G).
    """

    trajectories: int
    root_fraction: float = 0.5
    min_per_prompt: int = 2
    max_per_prompt: int | None = None
    group_size: int = 8

    def __post_init__(self) -> None:
        if self.trajectories < 1:
            raise ValueError(f"Budget.trajectories must be at least 1, got {self.trajectories}")
        if not 0.0 < self.root_fraction <= 1.0:
            raise ValueError(f"Budget.root_fraction must be in (0, 1], got {self.root_fraction}")
        if self.min_per_prompt < 1:
            raise ValueError(f"Budget.min_per_prompt must be at least 1, got {self.min_per_prompt}")
        if self.max_per_prompt is not None and self.max_per_prompt < self.min_per_prompt:
            raise ValueError("Budget.max_per_prompt must be at least min_per_prompt")
        if self.group_size < 1:
            raise ValueError(f"Budget.group_size must be at least 1, got {self.group_size}")

    @property
    def root_trajectories(self) -> int:
        """M_root: the stage-1 share of the budget."""
        return int(round(self.trajectories * self.root_fraction))


@dataclass
class Spend:
    """What an allocator planned in the last step."""

    trajectories: int = 0
    roots: int = 0  # bare rollouts (stage 1, and root re-samples in stage 2)
    branches: int = 0  # continuations from inner nodes
    prompts: int = 0  # prompts that received at least one rollout

    def as_dict(self) -> dict[str, int]:
        """The four counts by name (JSON-ready)."""
        return {"trajectories": self.trajectories, "roots": self.roots, "branches": self.branches, "prompts": self.prompts}
