"""ContrastLab's learning mode as a policy update: a REINFORCE step of the simulated policy's skills."""

from __future__ import annotations

from typing import Any

import numpy as np

from trace_gym.forest.forest import Forest
from trace_gym.sim.world import ContrastLabWorld


class SimLearning:
    """A :class:`~trace_gym.step.PolicyUpdate`: ``world.reinforce(forest, advantages)`` with
    learning rate ``lr`` on each task's skill and ``shared_lr`` on the skill shared by all
    tasks (which moves held-out tasks too). ``normalize`` (the default) makes the step
    scale-free and charges it for waste (:meth:`~trace_gym.sim.world.ContrastLabWorld.reinforce`):
    the advantages are scaled to unit RMS over the turns where they are non-zero, as PPO
    implementations normalise a batch's advantages (trainers of real models use Adam and
    clipping, under which an estimator's overall scale hardly sets the step), and the shared
    skill moves by the mean over every generated turn, as a token-mean loss averages over
    every generated token, so turns without an advantage dilute it. ``normalize=False`` is
    plain SGD, where an estimator with larger advantages simply takes larger steps and the
    shared step averages over the turns with an advantage only. ``prefix_weight`` counts a
    turn shared by n trajectories ``n ** prefix_weight`` times, as the trainer's
    ``loss.prefix_weight`` does a token."""

    def __init__(self, world: ContrastLabWorld, lr: float = 1.0, shared_lr: float = 0.1, normalize: bool = True,
                 prefix_weight: float = 0.0):
        self.world = world
        self.lr = lr
        self.shared_lr = shared_lr
        self.normalize = normalize
        self.prefix_weight = prefix_weight

    def __call__(self, forest: Forest, advantages: np.ndarray) -> dict[str, Any]:
        grad = self.world.reinforce(forest, advantages, lr=self.lr, shared_lr=self.shared_lr, normalize=self.normalize,
                                    prefix_weight=self.prefix_weight)
        return {"update/sim_grad": float(grad)}
