"""Built-in allocators (importable as ``trace_gym.allocators``).

``@trace_gym.register_allocator("name")`` (alias ``trace_gym.allocators.register``) is the
decorator for your own allocator; ``trace_gym.make_allocator("name", **kwargs)`` builds one.

Built-ins: ``grpo``, ``uniform``, ``trace`` (the measured default: stage and predictor
options for ablations), ``trace-paper`` (the paper's exact rule), ``dapo``, ``pcl``,
``knapsack``, ``greso``, ``vip``, and on the simulator ``oracle`` (TRACE with true values) and
``oracle-er`` (the effective-ratio ceiling). They are entry points of the group
``trace_gym.allocators`` in this project's ``pyproject.toml``, exactly as a third-party
allocator would be, so a module here is imported only when its allocator is first built.
Each class also names the predictor it is meant to be used with (``default_predictor``,
None when it needs none) and the advantage estimator that matches its forests
(``advantage``).
"""

from trace_gym.allocation.allocator import ALLOCATORS, register_allocator

register = register_allocator
names = ALLOCATORS.names

__all__ = ["names", "register"]
