"""ContrastLab's learning mode as a policy update: a REINFORCE step of the simulated policy's skills."""

from __future__ import annotations

from typing import Any

import numpy as np

from trace_gym.forest.forest import Forest
from trace_gym.sim.world import ContrastLabWorld


class SimLearning:
    """A :class:`~trace_gym.step.PolicyUpdate`: ``world.reinforce(forest, advantages)`` with
    learning rate ``lr`` on each task's skill and ``shared_lr`` on the skill shared by all
    tasks (which moves held-out tasks too)."""

    def __init__(self, world: ContrastLabWorld, lr: float = 1.0, shared_lr: float = 0.1):
        self.world = world
        self.lr = lr
        self.shared_lr = shared_lr

    def __call__(self, forest: Forest, advantages: np.ndarray) -> dict[str, Any]:
        grad = self.world.reinforce(forest, advantages, lr=self.lr, shared_lr=self.shared_lr)
        return {"update/sim_grad": float(grad)}
