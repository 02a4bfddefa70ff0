"""Predictors of V(H), the conditional success probability of a prefix history.

One predictor serves both allocation stages: stage 1 asks about roots (H = the prompt),
stage 2 about inner nodes. It is trained online on (history, backed-up value) pairs,
weighted by the number of leaves under each node. It serves the allocator only and never
enters the policy gradient.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

import numpy as np

from trace_gym.forest.forest import History
from trace_gym.registry import PREDICTOR_GROUP, Registry


class Predictor(ABC):
    """Predicts V(H), the probability that a rollout continued from history H succeeds.

    Contract: :meth:`predict` maps a batch of :class:`~trace_gym.forest.forest.History` to
    a float64 array of probabilities in [0, 1], one per history, without changing state;
    :meth:`update` learns from backed-up values (targets in [0, 1], optional non-negative
    weights, typically the number of leaves under each node). :meth:`state_dict` /
    :meth:`load_state_dict` round-trip everything a checkpoint needs. A predictor serves
    the allocator only; it never enters the policy gradient.
    """

    name: str = "predictor"
    reads_oracle: bool = False
    """True only for oracle components (``oracle``): they receive histories with the env's
    exact values (:func:`histories_for`); every other predictor gets them blanked."""

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


def histories_for(forest: Any, nodes: Any, predictor: Any) -> list[History]:
    """The histories of ``nodes`` as ``predictor`` may see them: with the env's exact values
    only if the predictor is an oracle component (``reads_oracle``), blanked otherwise
    (:meth:`~trace_gym.forest.forest.Forest.histories`). Allocators call this, not
    ``forest.histories``, to build a predictor's input."""
    return forest.histories(nodes, oracle=bool(getattr(predictor, "reads_oracle", False)))


def predict_nodes(forest: Any, nodes: Any, predictor: Any) -> np.ndarray:
    """``predictor``'s V of ``nodes`` (float64, as predicted), from :func:`histories_for`, also
    written to ``forest.pred`` so the step scores the allocator's predictions."""
    v = np.asarray(predictor.predict(histories_for(forest, nodes, predictor)), dtype=np.float64)
    forest.pred[nodes] = v
    return v


PREDICTORS: Registry[Predictor] = Registry("predictor", group=PREDICTOR_GROUP)
"""Name -> predictor factory; also the entry-point group ``trace_gym.predictors``."""


def register_predictor(name: str, factory: Callable[..., Predictor] | None = None, *, overwrite: bool = False):
    """Register a predictor under ``name`` (a decorator when ``factory`` is omitted).

    ``factory(**kwargs)`` (usually the :class:`Predictor` subclass itself) builds it; it may
    take ``seed``. A taken name raises ``ValueError`` unless ``overwrite=True``. Installed
    packages can instead declare ``name = "pkg.module:Class"`` in the entry-point group
    ``trace_gym.predictors``.
    """
    return PREDICTORS.register(name, factory, overwrite=overwrite)


def make_predictor(name: str, **kwargs: Any) -> Predictor:
    """Build the predictor registered as ``name`` with ``kwargs`` (``make_predictor("hashed")``).
    An unknown name raises :class:`~trace_gym.registry.UnknownNameError` listing close
    names; a plug-in that fails to import raises :class:`~trace_gym.registry.PluginError`."""
    return PREDICTORS.make(name, **kwargs)
