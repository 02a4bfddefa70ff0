"""Built-in allocators (importable as ``trace_gym.allocators``).

``trace_gym.allocators.register("name")`` is the decorator for your own allocator;
``trace_gym.make_allocator("name", **kwargs)`` builds one.

Built-ins: ``grpo``, ``uniform``, ``trace`` (``stage1``/``stage2`` in {uniform, active}),
``dapo``, ``pcl``, ``knapsack``, ``oracle``. Each class also names the predictor it is
meant to be used with (``default_predictor``, None when it needs none) and the advantage
estimator that matches its forests (``advantage``).
"""

from trace_gym.allocation.allocator import ALLOCATORS

register = ALLOCATORS.register
names = ALLOCATORS.names

# the built-ins register themselves exactly as a user's allocator would
from trace_gym.allocators import dapo, grpo, knapsack, oracle, pcl, trace, uniform  # noqa: E402,F401
