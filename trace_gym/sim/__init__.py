"""ContrastLab, the simulator: a multi-turn agent world whose success probability V(H) is
exact for every prefix, its text env, its vectorised fast path and its simulated policy.

* :class:`ContrastLabWorld` (``world.py``): tasks, skills, exact values, learning mode;
* :class:`ContrastLabEnv` (``env.py``): ``trace_gym/ContrastLab-v0``, stepped with text;
* :class:`ContrastLabSim` (``fast.py``): grows a whole forest at once, same process;
* :class:`SimPolicy` (``policy.py``): the simulated policy as a token-level ``Policy``;
* difficulty distributions (``difficulty.py``);
* one evaluation set for every predictor, with the Bayes-optimal posterior beside it
  (``evaluation.py``).
"""

from trace_gym.sim.difficulty import DEFAULT_DIFFICULTY, Difficulty, DifficultyError, parse_difficulty
from trace_gym.sim.env import ContrastLabEnv
from trace_gym.sim.evaluation import EvaluationSet, evaluation_set
from trace_gym.sim.fast import ContrastLabSim
from trace_gym.sim.world import ContrastLabWorld, word_tokens

__all__ = [
    "DEFAULT_DIFFICULTY", "ContrastLabEnv", "ContrastLabSim", "ContrastLabWorld", "Difficulty", "DifficultyError",
    "EvaluationSet", "evaluation_set", "parse_difficulty", "word_tokens",
]
