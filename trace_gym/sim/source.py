"""The simulator as a rollout source: ContrastLab's world and vectorised fast path for one seed."""

from __future__ import annotations

from typing import Any

import numpy as np

from trace_gym.forest.forest import Forest
from trace_gym.sim.fast import ContrastLabSim
from trace_gym.sim.world import ContrastLabWorld
from trace_gym.task import candidate_indices


class SimSource:
    """Candidates and rollouts from ContrastLab's fast path (thousands of trajectories per
    step in milliseconds), with the simulated policy at temperature 1.

    ``world_kwargs`` are :class:`~trace_gym.sim.world.ContrastLabWorld` arguments (the
    ``trace_gym/ContrastLab-v0`` env's kwargs); the world's seed defaults to ``seed``.
    ``rng_state``/``set_rng_state`` let a trainer checkpoint the sampling stream.
    """

    def __init__(self, world_kwargs: dict[str, Any] | None = None, seed: int = 0, *, world: ContrastLabWorld | None = None):
        if world is None:
            kwargs = dict(world_kwargs or {})
            kwargs.setdefault("seed", seed)
            world = ContrastLabWorld(**kwargs)
        self.world = world
        self.sim = ContrastLabSim(world, seed=seed)
        self.seed = seed

    def add_candidates(self, forest: Forest, step: int, n: int) -> None:
        """Add the ``n`` train prompts of ``step`` as roots of ``forest``."""
        train = self.world.split_indices("train")
        idx = np.asarray(candidate_indices(self.seed, step, int(train.size), n), dtype=np.int64)
        for h in self.world.candidates(train[idx]):
            forest.add_root(h.task_id, h.prompt, max_turns=h.max_turns, oracle=h.oracle)

    def rollout(self, forest: Forest, origins: np.ndarray) -> None:
        """Start a trajectory at each node of ``origins`` and run all of them to their end."""
        self.sim.rollout(forest, origins)

    def rng_state(self) -> dict[str, Any]:
        """The sampling stream's state (for checkpoints)."""
        return self.sim.rng.bit_generator.state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`rng_state` returned."""
        self.sim.rng.bit_generator.state = state
