"""Built-in allocators (importable as ``trace_gym.allocators``).

``trace_gym.allocators.register("name")`` is the decorator for your own allocator;
``trace_gym.make_allocator("name", **kwargs)`` builds one.
"""

from trace_gym.allocator import ALLOCATORS

register = ALLOCATORS.register
names = ALLOCATORS.names
