"""The ``Policy`` interface: token prefixes in, one generated turn per prefix out.

Token in, token out: the rollout engine keeps every trajectory as token ids and never
re-tokenises text between turns or when it branches. Backends (``hf``, ``vllm``,
``openai``, ``sim``) register by name in :data:`POLICIES` (entry-point group
``trace_gym.policies``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from trace_gym.registry import POLICY_GROUP, Registry


@dataclass
class Generation:
    """One generated turn.

    ``token_ids`` are the policy's tokens (the loss is taken on these only), ``logprobs``
    their behaviour log-probabilities under the sampling distribution, ``text`` their
    decoding, ``finish_reason`` ``"stop"`` (end of turn) or ``"length"`` (token limit).
    A turn that stopped by itself ends with its stop token (e.g. ``<|im_end|>``), which
    is a policy token like any other.

    A backend that could not produce the turn (a server that went away) returns
    ``finish_reason="error"`` with ``info["error"]`` and no tokens; the rollout engine
    reports such trajectories instead of dropping them.

    Accounting keys a backend may set in ``info`` (the engine sums them into
    ``forest.counters``): ``prefill_tokens`` (prompt tokens this call actually computed
    for this turn) and ``reused_prefix_tokens`` (prompt tokens served from a KV/prefix
    cache). When absent the engine counts the whole prompt as prefilled.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str = "stop"
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class SamplingParams:
    """How a policy samples one turn: at most ``max_new_tokens`` tokens, at ``temperature``
    (``<= 0``: greedy where the backend supports it) with nucleus ``top_p``. ``seed``, when
    set, makes a backend's sampling reproducible (same prompts and seed, same tokens);
    behaviour log-probs are those of this sampling distribution."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


class Policy(ABC):
    """Generates one turn for each of a batch of token prefixes.

    Besides :meth:`generate`, a policy owns the tokenizer side of the conversation, so the
    rollout engine never touches text-to-token conversion itself:

    * :meth:`render_prompt` turns the env's opening messages (and tool schemas) into the
      token ids the first turn is generated from;
    * :meth:`render_observation` turns an observation into the token ids appended after a
      generated turn (closing the turn if needed, and opening the next assistant turn);
    * :meth:`decode` turns generated ids into the action text the env steps on.

    Trainers additionally use :meth:`sync_modes`, :meth:`load_weights` and
    :meth:`load_adapter` (weight sync after an optimizer step) and :meth:`reset_cache`.
    Backends built on a Hugging Face tokenizer implement the three rendering methods with
    :class:`trace_gym.policies.chat.ChatTemplate`.
    """

    name: str = "policy"

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """One :class:`Generation` per prompt (token-id prefix), generated as one batch."""

    def render_prompt(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the opening chat (``messages`` with ``tools``), ending with the first
        assistant header: the prefix of every trajectory of that task."""
        raise NotImplementedError(f"policy {self.name!r} does not render chats to tokens")

    def render_observation(self, observation: str, *, role: str = "tool", closed: bool = True) -> list[int]:
        """Token ids appended after a generated turn: the end-of-turn marker unless ``closed``
        (the turn already ended with a stop token), ``observation`` as a ``role`` message,
        and the next assistant header. These tokens are not trained on (loss mask 0)."""
        raise NotImplementedError(f"policy {self.name!r} does not render observations to tokens")

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of generated ``token_ids`` without special tokens."""
        raise NotImplementedError(f"policy {self.name!r} does not decode tokens")

    def load_weights(self, weights: Any) -> None:
        """Weight sync: replace the policy's weights (a state dict, a model directory, or a
        module whose state dict is copied). Generations after the call use only the new
        weights (cached KV of the old ones is dropped). Backends that cannot do it raise."""
        raise NotImplementedError(f"policy {self.name!r} cannot load new weights")

    def load_adapter(self, path: str) -> None:
        """LoRA sync: from now on generate with the peft LoRA adapter saved in directory
        ``path`` (``adapter_config.json`` + ``adapter_model.safetensors``) on top of the base
        weights, replacing any adapter loaded before. Backends that cannot do it raise."""
        raise NotImplementedError(f"policy {self.name!r} cannot load LoRA adapters")

    def sync_modes(self) -> frozenset[str]:
        """What a trainer can push into this policy: ``"weights"`` (:meth:`load_weights`)
        and/or ``"adapter"`` (:meth:`load_adapter`). Empty: neither (the policy rolls out
        and evaluates with the weights it has, and cannot be trained through). The default
        is what the subclass implements; servers answer after probing their endpoints."""
        cls = type(self)
        modes = set()
        if cls.load_weights is not Policy.load_weights:
            modes.add("weights")
        if cls.load_adapter is not Policy.load_adapter:
            modes.add("adapter")
        return frozenset(modes)

    def reset_cache(self) -> None:
        """Drop cached prefix KV, so the next :meth:`generate` does not depend on earlier
        calls (:class:`~trace_gym.rollout.source.EngineSource` calls it at the start of every step).
        The default does nothing."""

    def close(self) -> None:
        """Release resources (HTTP clients, engines). Safe to call more than once."""


POLICIES: Registry[Policy] = Registry("policy", group=POLICY_GROUP)
"""Name -> policy backend factory; also the entry-point group ``trace_gym.policies``."""


def register_policy(name: str, factory: Callable[..., Policy] | None = None, *, overwrite: bool = False):
    """Register a policy backend under ``name`` (a decorator when ``factory`` is omitted).

    ``factory(**kwargs)`` (usually the :class:`Policy` subclass itself) builds it. A taken
    name raises ``ValueError`` unless ``overwrite=True``. Installed packages can instead
    declare ``name = "pkg.module:Class"`` in the entry-point group ``trace_gym.policies``;
    the module is imported only when a policy of that name is built.
    """
    return POLICIES.register(name, factory, overwrite=overwrite)


def make_policy(name: str, **kwargs: Any) -> Policy:
    """Build the policy backend registered as ``name`` (``hf``, ``vllm``, ``openai``, ``sim``
    or a plug-in's) with ``kwargs``, importing its module (and torch, vllm ...) only now.
    An unknown name raises :class:`~trace_gym.registry.UnknownNameError` listing close
    names; a backend that fails to import raises :class:`~trace_gym.registry.PluginError`."""
    return POLICIES.make(name, **kwargs)
