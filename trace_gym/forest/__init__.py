"""The forest: one step's rollout trees as flat arrays, and the kernels on them.

* ``forest.py``: :class:`Forest` (node arrays, growth, backup, effective ratios) and
  :class:`History` (what a predictor reads of a node);
* ``advantages.py``: the advantage estimators, registered by name
  (``@trace_gym.register_advantage``, entry-point group ``trace_gym.advantages``).
"""

from trace_gym.forest.forest import BRANCH, TERMINAL, TRUNCATED, Forest, History, NodeArray

__all__ = ["BRANCH", "TERMINAL", "TRUNCATED", "Forest", "History", "NodeArray"]
