"""Policy backends (``hf``, ``vllm``, ``openai``, ``sim``).

``@trace_gym.register_policy("name")`` (alias ``trace_gym.policies.register``) registers
your own; ``trace_gym.make_policy("name", **kwargs)`` builds one.

The built-in backends are entry points of the group ``trace_gym.policies`` (declared in
this project's ``pyproject.toml``, exactly as a third-party backend would be): their modules
(and torch, transformers, httpx, vllm) are imported only when a policy of that name is
built, so ``import trace_gym`` stays light.
"""

from __future__ import annotations

from trace_gym.policies.base import POLICIES, register_policy

register = register_policy
names = POLICIES.names

__all__ = ["POLICIES", "names", "register"]
