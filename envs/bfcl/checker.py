"""BFCL's verdicts: single-turn answers through BFCL's ``ast_checker``, multi-turn episodes
through its ``multi_turn_checker``; gold answers built from BFCL's possible answers; BFCL's
executable call format."""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import itertools
import json
import uuid
from typing import Any, Sequence

from trace_gym.envs.bfcl.vendor import _BFCL_NAME, JUDGE_MODEL, require_bfcl
from trace_gym.task import Task

__all__ = ["ast_verdict", "call_string", "gold_calls", "multi_turn_verdict", "parse_ground_truth_call"]

def _checker_category(task: Task) -> str:
    category = task.metadata["category"]
    return _BFCL_NAME.get(category, category)


def ast_verdict(task: Task, calls: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """BFCL's verdict on ``calls`` (BFCL's decoded format ``[{name: {arg: value}}, ...]``) for a
    single-turn ``task``: ``{"valid": bool, "error": [...], "error_type": str}``.

    Non-irrelevance categories go through BFCL's ``ast_checker`` exactly as its evaluator calls it
    (the raw function docs, the possible answer, Python, the category). Irrelevance is BFCL's
    relevance rule: correct iff no function is called. Should the checker raise on an output it
    was not written for, the verdict is invalid with ``error_type="checker_exception"``.
    """
    if task.metadata.get("category") == "irrelevance":
        if calls:
            return {"valid": False, "error": ["Valid syntax. Successfully decode AST when it should not."],
                    "error_type": "irrelevance_error:decoder_success"}
        return {"valid": True, "error": []}
    bfcl = require_bfcl()
    try:
        result = bfcl.ast_checker(
            task.metadata["functions"], calls, task.ground_truth, bfcl.Language.PYTHON, _checker_category(task), JUDGE_MODEL
        )
    except Exception as exc:  # the checker assumes well-typed outputs; anything else is a wrong answer
        return {"valid": False, "error": [f"BFCL's checker raised {type(exc).__name__}: {exc}"], "error_type": "checker_exception"}
    return {"valid": bool(result.get("valid")), "error": list(result.get("error", [])), "error_type": result.get("error_type", "")}


def _allowed(values: list[Any]) -> list[Any]:
    return [v for v in values if v != ""]


def _gold_value(value: Any) -> Any:
    # A possible answer lists allowed values; dict values list allowed values per key.
    if isinstance(value, dict):
        return {k: _allowed(v)[0] for k, v in value.items() if isinstance(v, list) and _allowed(v)}
    if isinstance(value, list) and value and all(isinstance(d, dict) for d in value):
        return [_gold_value(d) for d in value]
    return value


def _param_options(allowed: list[Any]) -> list[tuple[bool, Any]]:
    opts = [(True, _gold_value(v)) for v in _allowed(allowed)]
    if "" in allowed:
        opts.append((False, None))  # optional: omitting it is allowed
    return opts


def gold_calls(task: Task, max_tries: int = 512) -> list[dict[str, dict[str, Any]]]:
    """A correct answer to a single-turn ``task`` in BFCL's decoded format, built from the
    possible answer and confirmed by BFCL's checker.

    For each expected call, parameter choices (each allowed value, or omission when ``""`` is
    allowed) are tried in BFCL's order until BFCL's checker accepts the call; the first choice
    passes for all but a handful of tasks. Irrelevance tasks return ``[]``. Raises
    ``ValueError`` when no combination passes within ``max_tries``.
    """
    if task.metadata.get("category") == "irrelevance":
        return []
    bfcl = require_bfcl()
    functions = task.metadata["functions"]
    out: list[dict[str, dict[str, Any]]] = []
    for expected in task.ground_truth:
        (name, params), = expected.items()
        doc = next((f for f in functions if f.get("name") == name), None)
        names = list(params)
        found = None
        for i, combo in enumerate(itertools.product(*(_param_options(params[p]) for p in names))):
            if i >= max_tries:
                break
            call = {name: {p: v for p, (use, v) in zip(names, combo) if use}}
            try:
                ok = doc is not None and bfcl.ast_checker([doc], [call], [expected], bfcl.Language.PYTHON, "simple", JUDGE_MODEL)["valid"]
            except Exception:
                ok = False
            if ok:
                found = call
                break
        if found is None:
            raise ValueError(f"{task.id}: no answer built from BFCL's possible answer passes BFCL's checker")
        out.append(found)
    if not ast_verdict(task, out)["valid"]:
        raise ValueError(f"{task.id}: the calls built from BFCL's possible answer fail BFCL's checker together")
    return out


def _error_text(verdict: dict[str, Any]) -> str:
    errors = verdict.get("error") or []
    first = errors[0] if errors else ""
    if not isinstance(first, str):
        first = json.dumps(first, ensure_ascii=False, default=str)
    kind = verdict.get("error_type", "")
    return f"BFCL's checker rejected the answer ({kind}): {first}".strip()


def call_string(name: str, arguments: dict[str, Any]) -> str:
    """A call in BFCL's executable format, as BFCL's ``convert_to_function_call`` writes it:
    ``name(k1=repr(v1),k2=repr(v2))``."""
    return f"{name}({','.join(f'{k}={v!r}' for k, v in arguments.items())})"


def _mt_error_text(verdict: dict[str, Any]) -> str:
    return f"BFCL's multi-turn checker rejected the episode ({verdict.get('error_type', '')}): {verdict.get('error_message', '')}"


def multi_turn_verdict(task: Task, record: list[list[list[str]]]) -> dict[str, Any]:
    """BFCL's ``multi_turn_checker`` verdict on ``record`` (per user turn, per step, the calls in
    BFCL's executable format) for a multi-turn ``task``: ``{"valid": bool, "error_type", "error_message"}``.

    The checker caches simulator instances in its module's globals under names built from the
    model name; each call here uses a fresh model name and removes its instances afterwards, so
    repeated and forked episodes are judged independently.
    """
    bfcl = require_bfcl()
    ground_truth = task.ground_truth
    if len(record) != len(ground_truth):
        return {"valid": False, "error_type": "multi_turn:force_terminated",
                "error_message": f"{len(record)} user turns answered, {len(ground_truth)} expected"}
    entry = {
        "id": task.metadata["bfcl_id"],
        "initial_config": task.metadata["initial_config"],
        "involved_classes": task.metadata["involved_classes"],
    }
    token = f"tracegym{uuid.uuid4().hex}"
    scope = vars(bfcl.multi_turn_utils)
    try:
        result = bfcl.multi_turn_checker(copy.deepcopy(record), ground_truth, entry, task.metadata["category"], token)
    except Exception as exc:
        result = {"valid": False, "error_type": "checker_exception", "error_message": f"{type(exc).__name__}: {exc}"}
    finally:
        for key in [k for k in scope if token in k]:
            del scope[key]
    return {"valid": bool(result.get("valid")), "error_type": result.get("error_type", ""),
            "error_message": str(result.get("error_message", ""))}


def parse_ground_truth_call(text: str, involved_classes: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """Turn one of BFCL's ground-truth call strings (``"mv(source='a', destination='b')"``,
    positional arguments allowed) into ``(name, {arg: value})`` using the simulator's signature."""
    bfcl = require_bfcl()
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain call: {text!r}")
    name = node.func.id
    args: dict[str, Any] = {}
    if node.args:
        method = None
        for class_name in involved_classes:
            cls = getattr(importlib.import_module(bfcl.CLASS_FILE_PATH_MAPPING[class_name]), class_name)
            method = getattr(cls, name, method)
        if method is None:
            raise ValueError(f"{name!r} is not a method of {list(involved_classes)}")
        params = [p for p in inspect.signature(method).parameters if p != "self"]
        for pname, value in zip(params, node.args):
            args[pname] = ast.literal_eval(value)
    for kw in node.keywords:
        args[str(kw.arg)] = ast.literal_eval(kw.value)
    return name, args
