"""Parsing one ReAct turn in the tag format of Qwen3 / Hermes chat templates.

A policy turn looks like::

    <think>I need 17*23 first.</think>
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "17*23"}}
    </tool_call>

or ends the episode with ``<answer>391</answer>``. :func:`parse_turn` never raises:
anything malformed comes back as ``ParsedTurn.error`` with a message the env shows to
the policy as its observation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

MAX_TOOL_CALLS_PER_TURN = 8

_THINK = re.compile(r"<think>(.*?)(?:</think>|$)", re.S)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_OPEN_TAG = re.compile(r"<(tool_call|answer)>")


@dataclass
class ToolCall:
    """One requested call: tool name and its arguments (a dict)."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    """What a policy turn asked for.

    Exactly one of these holds: ``answer`` is set (final answer), ``tool_calls`` is
    non-empty, or ``error`` explains why the turn could not be understood.
    """

    thought: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    answer: str | None = None
    error: str | None = None


def _strip_think(text: str) -> tuple[str, str]:
    thoughts = [m.group(1).strip() for m in _THINK.finditer(text)]
    return "\n".join(thoughts), _THINK.sub("", text)


def _load_call(body: str) -> ToolCall | str:
    body = body.strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"the tool call is not valid JSON ({exc.msg} at position {exc.pos})"
    if not isinstance(obj, dict):
        return "a tool call must be a JSON object with \"name\" and \"arguments\""
    name, args = obj.get("name"), obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or not name:
        return "a tool call needs a string \"name\""
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return f"the arguments of {name} are not a JSON object"
    if not isinstance(args, dict):
        return f"the arguments of {name} must be a JSON object"
    return ToolCall(name=name, arguments=args)


def parse_turn(text: str) -> ParsedTurn:
    """Parse a policy turn. Never raises; see :class:`ParsedTurn`."""
    if not isinstance(text, str):
        return ParsedTurn(error="the action must be text")
    thought, body = _strip_think(text)
    answers = [m.group(1).strip() for m in _ANSWER.finditer(body)]
    calls_raw = [m.group(1) for m in _TOOL_CALL.finditer(body)]
    if any(_OPEN_TAG.search(a) for a in answers) or any(_OPEN_TAG.search(c) for c in calls_raw):
        return ParsedTurn(thought=thought, error="tags are nested; give one <tool_call> or one <answer> at a time")
    if answers and calls_raw:
        return ParsedTurn(thought=thought, error="a turn either calls tools or answers, not both")
    if len(answers) > 1:
        return ParsedTurn(thought=thought, error="give exactly one <answer>...</answer>")
    if answers:
        return ParsedTurn(thought=thought, answer=answers[0])
    if calls_raw:
        if len(calls_raw) > MAX_TOOL_CALLS_PER_TURN:
            return ParsedTurn(thought=thought, error=f"at most {MAX_TOOL_CALLS_PER_TURN} tool calls per turn")
        calls: list[ToolCall] = []
        for raw in calls_raw:
            parsed = _load_call(raw)
            if isinstance(parsed, str):
                return ParsedTurn(thought=thought, error=parsed)
            calls.append(parsed)
        return ParsedTurn(thought=thought, tool_calls=calls)
    if "<tool_call>" in body or "<answer>" in body:
        return ParsedTurn(thought=thought, error="an opening tag is not closed")
    return ParsedTurn(
        thought=thought,
        error="no action found: call a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> "
        "or finish with <answer>...</answer>",
    )


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one tool call in the same format, for demonstrations."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def format_answer(answer: str) -> str:
    """The text of a final answer, for demonstrations."""
    return f"<answer>{answer}</answer>"
