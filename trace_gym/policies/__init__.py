"""Policy backends (``hf``, ``vllm``, ``openai``, ``sim``).

``trace_gym.policies.register("name")`` registers your own;
``trace_gym.make_policy("name", **kwargs)`` builds one.

The built-in backends are registered as lazy factories: their modules (and torch,
transformers, httpx, vllm) are imported only when a policy of that kind is built, so
``import trace_gym`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from trace_gym.policies.base import POLICIES

register = POLICIES.register
names = POLICIES.names


def _lazy(module: str, attr: str) -> Callable[..., Any]:
    def factory(**kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), attr)(**kwargs)

    factory.__name__ = factory.__qualname__ = attr
    factory.__doc__ = f"Build :class:`{module}.{attr}` (imported on first use)."
    return factory


register("hf", _lazy("trace_gym.policies.hf", "HFPolicy"))
register("openai", _lazy("trace_gym.policies.openai", "OpenAIPolicy"))
register("vllm", _lazy("trace_gym.policies.vllm", "VLLMPolicy"))
register("sim", _lazy("trace_gym.sim.policy", "SimPolicy"))
