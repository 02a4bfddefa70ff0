"""BFCL function docs as JSON-schema tool specs, and argument checks against a doc."""

from __future__ import annotations

import copy
from typing import Any

from trace_gym.envs.bfcl.vendor import require_bfcl

__all__ = ["PYTHON_HINT", "argument_errors", "to_tool_schema"]

# What BFCL adds to every function description it shows a model (utils._get_language_specific_hint).
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."


def _cast_property(prop: dict[str, Any], mapping: dict[str, str]) -> dict[str, Any]:
    # Mirrors BFCL's model_handler.utils._cast_to_openai_type, applied at every nesting level.
    btype = prop.get("type")
    if btype == "float":
        prop["format"] = "float"
        if isinstance(prop.get("description"), str):
            prop["description"] += " This is a float type value."
    prop["type"] = mapping.get(btype, "string") if isinstance(btype, str) else "string"
    if isinstance(prop.get("properties"), dict):
        prop["properties"] = {k: _cast_property(v, mapping) for k, v in prop["properties"].items() if isinstance(v, dict)}
    if isinstance(prop.get("items"), dict):
        prop["items"] = _cast_property(prop["items"], mapping)
    return prop


def to_tool_schema(function_doc: dict[str, Any]) -> dict[str, Any]:
    """A BFCL function doc as the JSON-schema function spec chat templates take
    (``{"type": "function", "function": {name, description, parameters}}``).

    BFCL's types become JSON-schema types through BFCL's own ``GORILLA_TO_OPENAPI`` table
    (``dict`` -> ``object``, ``float`` -> ``number`` with ``format: float``, ``tuple`` -> ``array``,
    ``any`` -> ``string``), nested properties and items included; the description gets BFCL's
    Python hint. Names keep their dots. The input is not modified.
    """
    mapping = require_bfcl().GORILLA_TO_OPENAPI
    doc = copy.deepcopy(function_doc)
    params = doc.get("parameters") if isinstance(doc.get("parameters"), dict) else {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    parameters = dict(params)
    parameters["type"] = "object"
    parameters["properties"] = {k: _cast_property(v, mapping) for k, v in props.items() if isinstance(v, dict)}
    parameters.setdefault("required", [])
    spec: dict[str, Any] = {
        "name": str(doc.get("name", "")),
        "description": str(doc.get("description", "")) + PYTHON_HINT,
        "parameters": parameters,
    }
    if "response" in doc:  # multi-turn docs describe what a call returns; BFCL passes it on too
        spec["response"] = doc["response"]
    return {"type": "function", "function": spec}


_TYPE_CHECKS: dict[str, Any] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "tuple": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
    "object": lambda v: isinstance(v, dict),
}


def argument_errors(doc: dict[str, Any], arguments: dict[str, Any]) -> list[str]:
    """What is wrong with ``arguments`` for the BFCL function ``doc``: unknown or missing
    parameters, values of the wrong JSON type (array items checked one level deep, as BFCL's
    AST checker does). Empty when the call fits the doc."""
    params = doc.get("parameters", {})
    props: dict[str, Any] = params.get("properties", {})
    errors = [f"unexpected argument {k!r}" for k in arguments if k not in props]
    errors += [f"missing required argument {k!r}" for k in params.get("required", []) if k not in arguments]
    for k, v in arguments.items():
        spec = props.get(k)
        if not isinstance(spec, dict):
            continue
        check = _TYPE_CHECKS.get(spec.get("type", "any"))
        if check is not None and not check(v):
            errors.append(f"{k!r} must be of type {spec['type']}, got {type(v).__name__}")
            continue
        item_check = _TYPE_CHECKS.get(spec.get("items", {}).get("type", "any")) if isinstance(spec.get("items"), dict) else None
        if item_check is not None and isinstance(v, list) and not all(item_check(x) for x in v):
            errors.append(f"the items of {k!r} must be of type {spec['items']['type']}")
    return errors
