"""Tools: typed Python functions exposed to the policy as JSON-schema function specs.

A tool is an ordinary function with type hints and a Google-style docstring::

    def search(query: str, k: int = 3) -> str:
        \"\"\"Search the passage index.

        Args:
            query: Free-text query.
            k: Number of passages to return.
        \"\"\"

``Tool.from_function(search).schema`` is the OpenAI/Qwen3 function spec that goes to
``tokenizer.apply_chat_template(tools=[...])``. ``Tool.call(arguments)`` validates the
arguments with pydantic and returns the result as text; a bad call gives an error
string (``ToolError``), never an exception that would end the episode.
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import ValidationError, create_model

_ARG_LINE = re.compile(r"^(\w+)\s*(?:\([^)]*\))?:\s*(.*)$")
_SECTIONS = {"Args:", "Arguments:", "Parameters:", "Returns:", "Raises:", "Yields:", "Examples:", "Example:"}


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (first paragraph, {arg: description})."""
    doc = inspect.cleandoc(doc or "")
    summary = doc.split("\n\n", 1)[0].split("\nArgs:", 1)[0].replace("\n", " ").strip()
    args: dict[str, str] = {}
    section, current, arg_indent = None, None, 0
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in _SECTIONS:
            section, current = stripped, None
            continue
        if section not in ("Args:", "Arguments:", "Parameters:") or not stripped:
            continue
        m = _ARG_LINE.match(stripped)
        indent = len(line) - len(line.lstrip())
        if m and (current is None or indent <= arg_indent):
            current, arg_indent = m.group(1), indent
            args[current] = m.group(2).strip()
        elif current:
            args[current] = (args[current] + " " + stripped).strip()
    return summary, args


class ToolError(Exception):
    """Raised inside a tool to report a user-facing error (bad input, missing file ...)."""


@dataclass
class Tool:
    """A callable tool with its JSON schema."""

    name: str
    fn: Callable[..., Any]
    description: str
    parameters: dict[str, Any]
    _model: Any = field(repr=False, default=None)

    @classmethod
    def from_function(cls, fn: Callable[..., Any], name: str | None = None, description: str | None = None) -> "Tool":
        """Build a tool from a typed function; every parameter needs a type hint."""
        try:
            # Resolve string annotations (``from __future__ import annotations``) in the tool's
            # own module, where names such as ``Literal`` are defined.
            sig = inspect.signature(fn, eval_str=True)
        except (NameError, TypeError, SyntaxError):
            sig = inspect.signature(fn)
        summary, arg_docs = _parse_docstring(fn.__doc__ or "")
        fields: dict[str, Any] = {}
        for pname, p in sig.parameters.items():
            if pname in ("self", "cls"):
                continue
            if p.annotation is inspect.Parameter.empty:
                raise TypeError(f"tool {fn.__name__!r}: parameter {pname!r} needs a type hint")
            default = ... if p.default is inspect.Parameter.empty else p.default
            fields[pname] = (p.annotation, default)
        model = create_model(f"{fn.__name__}_args", **fields)  # type: ignore[call-overload]
        schema = model.model_json_schema()
        schema.pop("title", None)
        for pname, prop in schema.get("properties", {}).items():
            prop.pop("title", None)
            if pname in arg_docs:
                prop["description"] = arg_docs[pname]
        schema.setdefault("required", [])
        return cls(name=name or fn.__name__, fn=fn, description=description or summary, parameters=schema, _model=model)

    @property
    def schema(self) -> dict[str, Any]:
        """The function spec in the format chat templates take (``{"type": "function", ...}``)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def call(self, arguments: Any) -> str:
        """Run the tool on ``arguments`` (a dict, or a JSON string of one) and return text.

        Invalid arguments and :class:`ToolError` become ``"Error: ..."`` strings; any other
        exception raised by the tool is reported the same way, so a broken tool cannot end
        the episode.
        """
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                return f"Error: arguments of {self.name} are not valid JSON ({exc.msg})."
        if not isinstance(arguments, dict):
            return f"Error: arguments of {self.name} must be a JSON object, got {type(arguments).__name__}."
        try:
            args = self._model.model_validate(arguments)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors())
            return f"Error: invalid arguments for {self.name}: {problems}."
        try:
            result = self.fn(**{k: getattr(args, k) for k in type(args).model_fields})
        except ToolError as exc:
            return f"Error: {exc}"
        except Exception as exc:  # a broken tool is an observation, not a crash
            return f"Error: {self.name} failed: {type(exc).__name__}: {exc}"
        if isinstance(result, str):
            return result
        try:
            return json.dumps(result, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            return str(result)


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None):
    """Decorator form of :meth:`Tool.from_function`."""

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool.from_function(f, name=name, description=description)

    return wrap(fn) if fn is not None else wrap
