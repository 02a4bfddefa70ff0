"""``trace-gym list [KIND]``: the registered names of each kind, plug-ins included.

Kinds: ``envs``, ``allocators``, ``predictors``, ``advantages``, ``policies``, ``models``.
Each row is a name, a one-line description (the first paragraph of its docstring) and
where it comes from: an entry point (``module:attr`` and the distribution that declares it)
or a registration in this process (a ``--plugin`` module). Entry points not yet loaded are
described from their source file without importing it (so listing imports no torch); one
whose module cannot be read that way is loaded, and if that fails it is listed with the
reason instead of a description.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

KINDS = ("envs", "allocators", "predictors", "advantages", "policies", "models")


def _doc(obj: Any, name: str = "") -> str:
    from trace_gym.cli.play import _short_doc

    return _short_doc(obj, name=name)


def _static_doc(value: str) -> str | None:
    """The docstring of ``"module:attr"`` read from the module's source with :mod:`ast`
    (nothing is imported; the module's own docstring when the class defers to it), or None
    when the source or the definition cannot be found."""
    import ast
    import importlib.util

    module, _, attr = value.partition(":")
    try:
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec is not None else None
        if not origin or not origin.endswith(".py"):
            return None
        with open(origin, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (ImportError, OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == attr:
            doc = ast.get_docstring(node) or ""
            if "module docstring" in doc:
                doc = ast.get_docstring(tree) or doc
            return doc
    return None


def _described(value: str, doc: str | None, env_id: str = "", name: str = "") -> str:
    from trace_gym.cli.play import _short_doc

    holder = type("_Doc", (), {"__doc__": doc})
    return _short_doc(holder, env_id, name)


def _ep_source(ep: Any) -> str:
    dist = getattr(getattr(ep, "dist", None), "name", None) or "an unknown distribution"
    return f"{ep.value} (entry point, {dist})"


def _registry_rows(registry: Any) -> list[dict[str, str]]:
    from trace_gym.registry import PluginError, entry_points

    eps = {ep.name: ep for ep in entry_points(registry.group)} if registry.group else {}
    rows = []
    for name in registry.names():
        row = {"name": name, "description": "", "source": ""}
        pending = registry.entry_point(name)
        static = _static_doc(pending.value) if pending is not None else None
        if static is not None:
            row["description"] = _described(pending.value, static, name=name)
            row["source"] = _ep_source(pending)
            rows.append(row)
            continue
        try:
            obj = registry.get(name)
            row["description"] = _doc(obj, name)
            ep = eps.get(name)
            if ep is not None and ep.module == getattr(obj, "__module__", None):
                row["source"] = _ep_source(ep)
            else:
                module = getattr(obj, "__module__", "?")
                how = "built in" if module.startswith("trace_gym.") else "registered in-process"
                row["source"] = f"{module}:{getattr(obj, '__qualname__', name)} ({how})"
        except PluginError as exc:
            row["description"] = f"(cannot be loaded: {exc})"
            row["source"] = _ep_source(eps[name]) if name in eps else ""
        rows.append(row)
    return rows


def _env_rows() -> list[dict[str, str]]:
    import gymnasium
    from gymnasium.envs.registration import load_env_creator

    from trace_gym.registry import ENV_GROUP, entry_points, env_ids

    eps = {ep.name: ep for ep in entry_points(ENV_GROUP)}
    rows = []
    for env_id in env_ids():
        spec = gymnasium.spec(env_id)
        row = {"name": env_id, "description": "", "source": ""}
        ep = eps.get(env_id)
        row["source"] = _ep_source(ep) if ep is not None and ep.value == spec.entry_point else \
            f"{spec.entry_point if isinstance(spec.entry_point, str) else getattr(spec.entry_point, '__module__', '?')} (registered in-process)"
        static = _static_doc(spec.entry_point) if isinstance(spec.entry_point, str) else None
        if static is not None:
            row["description"] = _described(spec.entry_point, static, env_id)
            rows.append(row)
            continue
        try:
            cls = load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point
            from trace_gym.cli.play import _short_doc

            row["description"] = _short_doc(cls, env_id)
        except Exception as exc:  # the env's module or an extra it needs is missing
            row["description"] = f"(cannot be loaded: {type(exc).__name__}: {exc})"
        rows.append(row)
    return rows


def _model_rows() -> list[dict[str, str]]:
    from trace_gym.policies.models import describe_aliases

    return describe_aliases()


def rows(kind: str) -> list[dict[str, str]]:
    """``[{"name", "description", "source"}]`` for one kind of :data:`KINDS`."""
    if kind == "envs":
        return _env_rows()
    if kind == "models":
        return _model_rows()
    registry: Callable[[], Any] = {
        "allocators": lambda: __import__("trace_gym.allocation.allocator", fromlist=["ALLOCATORS"]).ALLOCATORS,
        "predictors": lambda: __import__("trace_gym.predictors.base", fromlist=["PREDICTORS"]).PREDICTORS,
        "advantages": lambda: __import__("trace_gym.forest.advantages", fromlist=["ADVANTAGES"]).ADVANTAGES,
        "policies": lambda: __import__("trace_gym.policies.base", fromlist=["POLICIES"]).POLICIES,
    }[kind]
    return _registry_rows(registry())


_HOW = {
    "envs": "use as: trace-gym play ID --demo; envs: [ID] in a run spec (the trace_gym/ prefix may be omitted)",
    "allocators": "use as: --allocators NAME or NAME:key=value (e.g. trace:stage1=uniform); allocator: NAME in a suite or config",
    "predictors": "use as: --predictor NAME[:key=value]; 'none' for no predictor",
    "advantages": "use as: --advantage NAME[:key=value] (e.g. trace:scale=group)",
    "policies": "use as: --policy NAME (trace-gym rollout); policy: {name: NAME} in a suite",
    "models": "use as: --model NAME (rollout, eval), model.name=NAME (train); also a local directory or a hub id",
}


def _run_list(args: argparse.Namespace) -> int:
    kinds = [args.kind] if args.kind else list(KINDS)
    data = {kind: rows(kind) for kind in kinds}
    if args.json:
        print(json.dumps(data if not args.kind else data[args.kind], indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=160)
    for kind in kinds:
        table = Table(title=f"{kind} ({len(data[kind])})", title_justify="left", caption=_HOW[kind], caption_justify="left")
        table.add_column("name", style="bold cyan", overflow="fold", no_wrap=False)
        table.add_column("description", overflow="fold")
        table.add_column("from", style="dim", overflow="fold")
        for row in data[kind]:
            table.add_row(escape(row["name"]), escape(row["description"]), escape(row["source"]))
        console.print(table)
    return 0


def configure_list(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``trace-gym list``."""
    parser.add_argument("kind", nargs="?", choices=KINDS, metavar="KIND",
                        help=f"one of {', '.join(KINDS)} (default: all of them)")
    parser.add_argument("--json", action="store_true", help="print the names as JSON")
    parser.set_defaults(func=_run_list)


__all__ = ["KINDS", "configure_list", "rows"]
