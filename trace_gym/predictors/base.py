"""Predictors of V(H), the conditional success probability of a prefix history.

One predictor serves both allocation stages: stage 1 asks about roots (H = the prompt),
stage 2 about inner nodes. It is trained online on (history, backed-up value) pairs,
weighted by the number of leaves under each node. It serves the allocator only and never
enters the policy gradient.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import numpy as np

from trace_gym.forest.forest import History
from trace_gym.registry import Registry


class Predictor(ABC):
    """``predict(histories) -> p`` in [0, 1]; ``update(histories, targets, weights)``."""

    name: str = "predictor"

    @abstractmethod
    def predict(self, histories: Sequence[History]) -> np.ndarray:
        """Predicted success probability for each history (float64 array)."""

    @abstractmethod
    def update(self, histories: Sequence[History], targets: np.ndarray, weights: np.ndarray | None = None) -> None:
        """Learn from backed-up values ``targets`` (in [0, 1]) with optional ``weights``."""

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


PREDICTORS: Registry[Predictor] = Registry("predictor")
"""Name -> predictor class. Register with ``trace_gym.predictors.register("name")``."""


def make_predictor(name: str, **kwargs: Any) -> Predictor:
    """Build a registered predictor by name (``make_predictor("hashed")``)."""
    import trace_gym.predictors  # noqa: F401  (registers the built-ins)

    return PREDICTORS.make(name, **kwargs)
