"""Policy backends (``hf``, ``vllm``, ``openai``, ``sim``).

``trace_gym.policies.register("name")`` registers your own;
``trace_gym.make_policy("name", **kwargs)`` builds one.
"""

from trace_gym.policy import POLICIES

register = POLICIES.register
names = POLICIES.names
