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

_OPEN_TAG = re.compile(r"<(tool_call|answer)>")
# Deeply nested JSON ("[[[[...") makes the json module recurse; a bound keeps parsing linear
# and lets the policy see a clear error instead of a RecursionError.
_MAX_JSON_DEPTH = 64


def _spans(text: str, open_tag: str, close_tag: str, *, to_end: bool = False) -> tuple[list[tuple[int, int, int, int]], bool]:
    """Non-overlapping ``open ... close`` spans, scanned left to right in linear time.

    Returns ``([(start, body_start, body_end, end), ...], unclosed)``; an opening tag
    without a closing tag stops the scan (``to_end`` makes it span to the end of the text).
    Same matches as the regex ``open(.*?)close`` but without its quadratic worst case.
    """
    spans: list[tuple[int, int, int, int]] = []
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            return spans, False
        body = start + len(open_tag)
        stop = text.find(close_tag, body)
        if stop < 0:
            if to_end:
                spans.append((start, body, len(text), len(text)))
            return spans, True
        spans.append((start, body, stop, stop + len(close_tag)))
        pos = stop + len(close_tag)


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


def _strip_think(text: str) -> tuple[str, str, bool]:
    """(thoughts, text without them, whether a <think> block was left open).

    Qwen3's chat template opens ``<think>`` in the generation prompt, so a completion may
    start inside the thought and show only ``</think>``: text before a leading
    ``</think>`` counts as thought too.
    """
    thoughts: list[str] = []
    first_close, first_open = text.find("</think>"), text.find("<think>")
    if first_close >= 0 and (first_open < 0 or first_close < first_open):
        thoughts.append(text[:first_close].strip())
        text = text[first_close + len("</think>"):]
    spans, unclosed = _spans(text, "<think>", "</think>", to_end=True)
    if not spans:
        return "\n".join(thoughts), text, False
    pieces, pos = [], 0
    for start, body, stop, end in spans:
        thoughts.append(text[body:stop].strip())
        pieces.append(text[pos:start])
        pos = end
    pieces.append(text[pos:])
    return "\n".join(thoughts), "".join(pieces), unclosed


def _json_depth_exceeds(body: str, limit: int) -> bool:
    """Whether JSON text nests objects/arrays deeper than ``limit`` (strings are skipped)."""
    if body.count("[") + body.count("{") <= limit:
        return False
    depth, in_string, escaped = 0, False, False
    for c in body:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            if depth > limit:
                return True
        elif c in "]}":
            depth -= 1
    return False


def _load_call(body: str) -> ToolCall | str:
    body = body.strip()
    if _json_depth_exceeds(body, _MAX_JSON_DEPTH):
        return f"the tool call is nested more than {_MAX_JSON_DEPTH} levels deep"
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"the tool call is not valid JSON ({exc.msg} at position {exc.pos})"
    except (RecursionError, ValueError) as exc:  # ValueError: e.g. an integer with too many digits
        return f"the tool call is not valid JSON ({type(exc).__name__}: {exc})"
    if not isinstance(obj, dict):
        return "a tool call must be a JSON object with \"name\" and \"arguments\""
    name, args = obj.get("name"), obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or not name:
        return "a tool call needs a string \"name\""
    if isinstance(args, str):  # some models double-encode the arguments
        if _json_depth_exceeds(args, _MAX_JSON_DEPTH):
            return f"the arguments of {name} are nested more than {_MAX_JSON_DEPTH} levels deep"
        try:
            args = json.loads(args)
        except (RecursionError, ValueError):
            return f"the arguments of {name} are not a JSON object"
    if not isinstance(args, dict):
        return f"the arguments of {name} must be a JSON object"
    return ToolCall(name=name, arguments=args)


def parse_turn(text: str) -> ParsedTurn:
    """Parse a policy turn. Never raises; see :class:`ParsedTurn`."""
    if not isinstance(text, str):
        return ParsedTurn(error="the action must be text")
    thought, body, think_open = _strip_think(text)
    answer_spans, answer_open = _spans(body, "<answer>", "</answer>")
    call_spans, call_open = _spans(body, "<tool_call>", "</tool_call>")
    answers = [body[b:e].strip() for _, b, e, _ in answer_spans]
    calls_raw = [body[b:e] for _, b, e, _ in call_spans]
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
    if answer_open or call_open:
        return ParsedTurn(thought=thought, error="an opening tag is not closed")
    if think_open:
        return ParsedTurn(thought=thought, error="the <think> block is not closed; close it with </think> before acting")
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


def format_turn(thought: str = "", tool_calls: list[tuple[str, dict[str, Any]]] | None = None, answer: str | None = None) -> str:
    """A whole policy turn as Qwen3 writes it: ``<think>`` block, then tool calls or an answer.

    Exactly one of ``tool_calls`` (non-empty) and ``answer`` must be given.
    """
    if bool(tool_calls) == (answer is not None):
        raise ValueError("a turn has either tool calls or an answer")
    parts = [f"<think>\n{thought.strip()}\n</think>"] if thought.strip() else []
    if tool_calls:
        parts.extend(format_tool_call(name, args) for name, args in tool_calls)
    else:
        parts.append(format_answer(str(answer)))
    return "\n\n".join(parts)
