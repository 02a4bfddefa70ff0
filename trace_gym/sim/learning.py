"""ContrastLab's learning mode as a policy update: a REINFORCE step of the simulated policy's skills."""

from __future__ import annotations

from typing import Any

import numpy as np

from trace_gym.forest.forest import Forest
from trace_gym.sim.world import ContrastLabWorld


class SimLearning:
    """A :class:`~trace_gym.step.PolicyUpdate`: ``world.reinforce(forest, advantages)`` with
    learning rate ``lr`` on each task's skill and ``shared_lr`` on the skill shared by all
    tasks (which moves held-out tasks too). ``normalize`` (the default) scales each step to
    RMS ``lr`` over the tasks it touches (:meth:`~trace_gym.sim.world.ContrastLabWorld.reinforce`):
    trainers of real models use Adam and clipping, under which an advantage estimator's
    overall scale hardly changes the step, so a scale-free step compares estimators and
    allocators by the direction of their gradients; ``normalize=False`` is plain SGD, where an
    estimator with larger advantages simply takes larger steps."""

    def __init__(self, world: ContrastLabWorld, lr: float = 1.0, shared_lr: float = 0.1, normalize: bool = True):
        self.world = world
        self.lr = lr
        self.shared_lr = shared_lr
        self.normalize = normalize

    def __call__(self, forest: Forest, advantages: np.ndarray) -> dict[str, Any]:
        grad = self.world.reinforce(forest, advantages, lr=self.lr, shared_lr=self.shared_lr, normalize=self.normalize)
        return {"update/sim_grad": float(grad)}
