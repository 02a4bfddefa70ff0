"""``ChatTemplate``: the tokenizer side of a policy, shared by the ``hf``, ``vllm`` and ``openai`` backends.

The rollout engine keeps a trajectory as one growing list of token ids. Text is turned
into ids at exactly two places, both here:

* :meth:`ChatTemplate.render_prompt`: the opening chat (system + user messages, tool
  schemas) up to and including the first assistant header;
* :meth:`ChatTemplate.render_observation`: what follows a generated turn: the end-of-turn
  marker (only when the turn was cut by the token limit; a turn that stopped by itself
  already ends with it), the observation as a message, and the next assistant header.

Generated tokens are never re-tokenised. Both renderings come from the tokenizer's own
chat template, so a trajectory's ids are what the template would produce for the same
conversation (up to the tokenisation boundary around the observation, which is the same
one the template's special tokens impose).

Templates that silently drop ``tools=`` (SmolLM2's does) are detected with a probe, and
the tool schemas then go into the system message in the Hermes/Qwen format that
:mod:`trace_gym.env.react` parses. A tokenizer without any chat template gets ChatML.
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Sequence

from trace_gym.policies.base import Policy

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""The template used for tokenizers that have none (e.g. a from-scratch tokenizer)."""

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "trace_gym_probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}, "required": []},
    },
}
_PLACEHOLDER = "\u2063TRACE_GYM_TURN\u2063"


def tools_system_text(tools: Sequence[dict[str, Any]]) -> str:
    """The tool block appended to the system message for templates that ignore ``tools=``."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


class ChatTemplate:
    """Renders chats to token ids with a Hugging Face tokenizer's chat template.

    Attributes:
        tokenizer: the tokenizer.
        eot_id: the token that ends an assistant turn in this template (``<|im_end|>`` for
            ChatML templates), found by rendering a probe conversation.
        stop_ids: token ids that end a generated turn (``eot_id`` and the tokenizer's EOS).
        tools_in_template: whether the template renders ``tools=``; when False the schemas
            are put into the system message (:func:`tools_system_text`).
    """

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None, tools_in_template: bool | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None) or CHATML_TEMPLATE
        self._role_map: dict[str, str] = {}
        self.tools_in_template = self._probe_tools() if tools_in_template is None else bool(tools_in_template)
        self.eot_id, self._eot_text = self._probe_end_of_turn()
        stop = {self.eot_id}
        eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            stop.add(eos)
        self.stop_ids: frozenset[int] = frozenset(stop)

    # ------------------------------------------------------------------ rendering

    def _apply(self, messages: list[dict[str, Any]], *, tools: Sequence[dict[str, Any]] | None = None, generation_prompt: bool = False) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation_prompt, "chat_template": self.chat_template}
        if tools:
            kwargs["tools"] = list(tools)
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no BOS/EOS added (chat templates write their own)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` without special tokens (what the env sees as the action)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def with_tools(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """``(messages, tools)`` to hand to the template: unchanged when it renders tools,
        otherwise with the schemas moved into the system message."""
        messages = [dict(m) for m in messages]
        if not tools or self.tools_in_template:
            return messages, list(tools) if tools else None
        block = tools_system_text(tools)
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{block}"
        else:
            messages.insert(0, {"role": "system", "content": block})
        return messages, None

    def render_prompt(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the opening chat, ending with the first assistant header."""
        msgs, tools_arg = self.with_tools(messages, tools)
        return self.encode(self._apply(msgs, tools=tools_arg, generation_prompt=True))

    def render_observation(self, observation: str, *, role: str = "tool", closed: bool = True) -> list[int]:
        """Token ids that follow a generated turn: end of turn (unless ``closed``, i.e. the
        turn already ended with a stop token), ``observation`` as a ``role`` message, and
        the next assistant header. Roles the template rejects fall back to ``user``."""
        text = self._observation_text(observation, role)
        if closed and text.startswith(self._eot_text):
            text = text[len(self._eot_text):]
        return self.encode(text)

    # ------------------------------------------------------------------ probes

    def _observation_text(self, observation: str, role: str) -> str:
        role = self._role_map.get(role, role)
        base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": _PLACEHOLDER}]
        try:
            rendered = self._apply(base + [{"role": role, "content": observation}], generation_prompt=True)
        except Exception as exc:  # jinja raises on roles a template does not know
            if role == "user":
                raise
            warnings.warn(f"the chat template rejects role {role!r} ({exc}); observations are rendered as user messages", stacklevel=3)
            self._role_map[role] = "user"
            return self._observation_text(observation, "user")
        at = rendered.find(_PLACEHOLDER)
        if at < 0:
            raise ValueError("the chat template dropped the assistant message; cannot render observations with it")
        return rendered[at + len(_PLACEHOLDER):]

    def _probe_tools(self) -> bool:
        msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        try:
            text = self._apply(msgs, tools=[_PROBE_TOOL], generation_prompt=True)
        except Exception:
            return False
        return "trace_gym_probe_tool" in text

    def _probe_end_of_turn(self) -> tuple[int, str]:
        tail = self._observation_text("O", "user")
        ids = self.encode(tail)
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        if ids and ids[0] in special:
            return ids[0], self.tokenizer.decode([ids[0]], skip_special_tokens=False)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            return eos, ""
        raise ValueError(
            "cannot find the end-of-turn token of this chat template (the text after an assistant "
            f"message starts with {tail[:20]!r}, which is not a special token) and the tokenizer has no EOS token"
        )


class ChatPolicy(Policy):
    """A :class:`~trace_gym.policies.base.Policy` whose tokenizer side is a :class:`ChatTemplate`
    kept in ``self.chat`` (the ``hf``, ``openai`` and ``vllm`` backends): rendering and
    decoding are the template's, generation is the backend's."""

    chat: ChatTemplate

    def render_prompt(self, messages, tools=None) -> list[int]:
        return self.chat.render_prompt(messages, tools)

    def render_observation(self, observation: str, *, role: str = "tool", closed: bool = True) -> list[int]:
        return self.chat.render_observation(observation, role=role, closed=closed)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.chat.decode(token_ids)
