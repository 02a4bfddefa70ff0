"""The ``Policy`` interface: token prefixes in, one generated turn per prefix out.

Token in, token out: the rollout engine keeps every trajectory as token ids and never
re-tokenises text between turns or when it branches. Backends (``hf``, ``vllm``,
``openai``, ``sim``) register by name in :data:`policies`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

from trace_gym.registry import Registry


@dataclass
class Generation:
    """One generated turn.

    ``token_ids`` are the policy's tokens (the loss is taken on these only), ``logprobs``
    their behaviour log-probabilities under the sampling distribution, ``text`` their
    decoding, ``finish_reason`` ``"stop"`` (end of turn) or ``"length"`` (token limit).
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str = "stop"
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class SamplingParams:
    """How to sample one turn."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


class Policy(ABC):
    """Generates one turn for each of a batch of token prefixes."""

    name: str = "policy"

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """One :class:`Generation` per prompt (token-id prefix), generated as one batch."""


POLICIES: Registry[Policy] = Registry("policy")
"""Name -> policy backend. Register with ``trace_gym.policies.register("name")``."""


def make_policy(name: str, **kwargs: Any) -> Policy:
    """Build a registered policy backend by name."""
    import trace_gym.policies  # noqa: F401  (registers the built-ins)

    return POLICIES.make(name, **kwargs)
