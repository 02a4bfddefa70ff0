"""``trace-gym envs`` (list the registered environments) and ``trace-gym play ENV`` (play one
episode turn by turn in the terminal).

In ``play`` a turn is what a policy would write (``<think>...</think>``, then
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` or ``<answer>...</answer>``),
typed over one or more lines and ended by a line holding only ``.`` (or by end of input).
The env's observation is shown after each turn, and the reward when the episode ends.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, TextIO

__all__ = ["configure_envs", "configure_play", "env_rows", "parse_env_args", "play", "read_turn"]


def _short_doc(obj: Any, env_id: str = "", name: str = "") -> str:
    """The first paragraph of a docstring as plain text (reST roles and literals unwrapped,
    a leading repetition of the env id, or a leading ``name:`` label, dropped: the listing
    shows both in their own column); a class docstring that defers to its module ("see the
    module docstring") is replaced by the module's."""

    def first_paragraph(doc: str | None) -> str:
        text = " ".join((doc or "").strip().split("\n\n", 1)[0].split())
        text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text).replace("``", "")
        if env_id and text.startswith(env_id):
            text = text[len(env_id):].lstrip(" :;—-")
        if name and re.match(rf"{re.escape(name)}\s*:", text):
            text = text[len(name):].lstrip(" :")
        return text[:1].upper() + text[1:]

    text = first_paragraph(getattr(obj, "__doc__", None))
    if "module docstring" in text:
        module = sys.modules.get(getattr(obj, "__module__", ""), None)
        text = first_paragraph(getattr(module, "__doc__", None)) or text
    return text


def _unavailable(exc: BaseException) -> str:
    message = " ".join(str(exc).split())
    return f"unavailable ({type(exc).__name__}): {message}"


def _build_row(env_id: str, row: dict[str, Any]) -> None:
    from trace_gym.registry import make

    try:
        env = make(env_id)
        try:
            _, info = env.reset(seed=0)
            row["tools"] = [t["function"]["name"] for t in info.get("tools", [])]
        finally:
            env.close()
    except Exception as exc:  # a missing extra or dataset: listed, not fatal
        row["status"] = _unavailable(exc)


def _build_in_child(env_id: str, conn: Any) -> None:
    row: dict[str, Any] = {"tools": [], "status": "ok"}
    _build_row(env_id, row)
    conn.send(row)
    conn.close()


def _build_rows(todo: list[dict[str, Any]], deadline: float, timeout_s: float) -> None:
    """Build the env of each row, concurrently, until ``deadline``: in forked processes where
    the platform has ``fork`` (builds are CPU-bound: they then use every core), else in
    threads. Fills in ``tools`` and ``status``; a build still running at the deadline is
    stopped and reported."""
    import multiprocessing
    import threading
    import time

    late = f"not built within {timeout_s:g} s (a download, or a slow build; raise --timeout)"
    if "fork" not in multiprocessing.get_all_start_methods():
        threads = []
        for row in todo:
            t = threading.Thread(target=_build_row, args=(row["id"], row), daemon=True)  # daemon: never blocks exit
            t.start()
            threads.append((t, row))
        for t, row in threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                row["status"] = late
        return
    ctx = multiprocessing.get_context("fork")
    jobs = []
    for row in todo:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_build_in_child, args=(row["id"], send), daemon=True)
        proc.start()
        send.close()
        jobs.append((proc, recv, row))
    for proc, recv, row in jobs:
        if recv.poll(max(0.0, deadline - time.monotonic())):
            try:
                row.update(recv.recv())
            except EOFError:
                row["status"] = f"unavailable: building it ended its process (exit code {proc.exitcode})"
        else:
            row["status"] = late
        proc.join(0.1)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _needs_the_hub(cls: Any) -> str | None:
    """Why an env class with default arguments cannot load here because of the Hub datasets it
    downloads (the ``datasets`` package missing, or the Hub unreachable and a dataset not in the
    local cache); None when nothing is known to be missing. Probes the Hub only when needed."""
    import importlib.util

    from trace_gym.rollout.preflight import hub_dataset_cached, hub_unreachable

    hook = getattr(cls, "hub_datasets", None)
    needed = list(hook()) if callable(hook) else []
    if not needed:
        return None
    if importlib.util.find_spec("datasets") is None:
        return f"unavailable: loads {', '.join(needed)} from the Hugging Face Hub, which needs `pip install 'trace-gym[datasets]'`"
    missing = [d for d in needed if not hub_dataset_cached(d)]
    if not missing:
        return None
    reason = hub_unreachable()
    if reason is None:
        return None
    return (f"unavailable: needs {', '.join(missing)} from the Hugging Face Hub, which cannot be reached ({reason}) "
            f"and which is not in the local cache; pass local files (see its data_files/path arguments)")


def env_rows(build: bool = True, ids: list[str] | None = None, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """One row per registered env (or per id in ``ids``): ``id``, ``description`` (the env
    class's docstring summary), ``tools`` (names of the first task's tools; only when
    ``build``) and ``status`` (``"ok"``, or why the env is not available here, in full).

    An env is never ``"ok"`` when it is known not to load: its class fails to import, or it
    downloads Hub datasets (:meth:`~trace_gym.env.base.AgentEnv.hub_datasets`) that are not
    cached while the Hub is unreachable (checked without building it, also when ``build`` is
    False), or, when ``build``, building and resetting it fails. When the Hub is unreachable,
    this process is switched to offline mode first, so no loader waits on retries. Envs are
    built concurrently (in forked processes where possible), all within ``timeout_s`` seconds
    in total; one still building then is stopped and reported as such.
    """
    import time

    import gymnasium
    from gymnasium.envs.registration import load_env_creator

    from trace_gym.registry import env_ids, full_env_id
    from trace_gym.rollout.preflight import go_offline, hub_unreachable

    rows, todo = [], []
    deadline = time.monotonic() + timeout_s
    if build and hub_unreachable() is not None:
        go_offline()  # loaders that would retry the Hub fail at once instead
    for env_id in ids if ids is not None else env_ids():
        env_id = full_env_id(env_id)
        spec = gymnasium.spec(env_id)
        row: dict[str, Any] = {"id": env_id, "description": "", "tools": [], "status": "ok"}
        rows.append(row)
        try:
            cls = load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point
            row["description"] = _short_doc(cls, env_id)
            report = cls.code_isolation() if hasattr(cls, "code_isolation") else None
            if report:
                row["sandbox"] = report["summary"]
            blocked = _needs_the_hub(cls)
        except Exception as exc:  # the env's module or an extra it imports is missing
            row["status"] = _unavailable(exc)
            continue
        if blocked:
            row["status"] = blocked
            continue
        if build:
            todo.append(row)
    if todo:
        _build_rows(todo, deadline, timeout_s)
    return rows


def _run_envs(args: argparse.Namespace) -> int:
    rows = env_rows(build=not args.no_tools, timeout_s=args.timeout)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # a pipe or a file gets whole lines, not an 80-column squeeze
        console = Console(width=160)
    table = Table(title="trace-gym environments", show_lines=False,
                  caption="ok: builds here" + (" (not built: --no-tools)" if args.no_tools else ", with the tools listed")
                  + "; play one with `trace-gym play ID --demo`", caption_justify="left")
    table.add_column("id", style="bold cyan", overflow="fold")
    table.add_column("description", overflow="fold")
    table.add_column("tools" if not args.no_tools else "status", overflow="fold")
    for row in rows:
        if row["status"] != "ok":
            last = f"[dim]{escape(row['status'])}[/dim]"
        else:
            last = escape(", ".join(row["tools"])) or ("—" if not args.no_tools else "ok")
        if row.get("sandbox"):
            last += f"\n[dim]code sandbox: {escape(row['sandbox'])}[/dim]"
        table.add_row(escape(row["id"]), escape(row["description"]), last)
    console.print(table)
    return 0


def configure_envs(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``trace-gym envs``."""
    parser.add_argument("--no-tools", action="store_true", help="do not build each env to list its tools (faster)")
    parser.add_argument("--json", action="store_true", help="print the list as JSON")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for the envs to build, all together (default 10)")
    parser.set_defaults(func=_run_envs)


# ---------------------------------------------------------------------------------- play

def parse_env_args(items: list[str]) -> dict[str, Any]:
    """``["levels=[1,2]", "data_files=x.jsonl"]`` -> ``{"levels": [1, 2], "data_files": "x.jsonl"}``
    (values are JSON when they parse as JSON, else strings)."""
    from trace_gym.run import parse_assignments

    return parse_assignments(items, "--env-arg")


def read_turn(stream: TextIO) -> str | None:
    """Read one turn: lines up to a line holding only ``.``, or to end of input.
    Returns ``None`` at end of input when nothing was typed."""
    lines: list[str] = []
    while True:
        line = stream.readline()
        if line == "":
            return "\n".join(lines) if lines else None
        if line.rstrip("\r\n") == ".":
            return "\n".join(lines)
        lines.append(line.rstrip("\r\n"))


def play(env_id: str, *, seed: int = 0, task_id: str | None = None, index: int | None = None, split: str = "train",
         demo: bool = False, env_kwargs: dict[str, Any] | None = None, stdin: TextIO | None = None,
         console: Any = None) -> dict[str, Any]:
    """Play one episode of ``env_id``: turns come from ``stdin`` (or the env's own
    demonstration with ``demo=True``), observations go to ``console``. Returns a summary
    ``{"task_id", "turns", "reward", "terminated", "truncated", "finished"}``."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.text import Text

    from trace_gym.registry import make

    stdin = stdin if stdin is not None else sys.stdin
    console = console or Console(highlight=False)
    kwargs = dict(env_kwargs or {})
    if split != "train":
        kwargs.setdefault("split", split)
    env = make(env_id, **kwargs)
    options: dict[str, Any] = {}
    if task_id is not None:
        options["task_id"] = task_id
    elif index is not None:
        options["index"] = index
    obs, info = env.reset(seed=seed, options=options)
    task = env.state.task  # type: ignore[attr-defined]
    tools = ", ".join(t["function"]["name"] for t in info.get("tools", [])) or "none"
    console.print(Panel(Text(obs), title=f"{env_id}  task {info['task_id']}", subtitle=f"tools: {tools}"))
    planned = list(env.demonstrate(task)) if demo else None  # type: ignore[attr-defined]
    summary = {"task_id": info["task_id"], "turns": 0, "reward": 0.0, "terminated": False, "truncated": False,
               "finished": False}
    while True:
        if planned is not None:
            if not planned:
                break
            action = planned.pop(0)
            console.print(Panel(Text(action), title=f"agent, turn {summary['turns'] + 1}", border_style="blue"))
        else:
            console.print(Text(f"Your turn {summary['turns'] + 1} (end it with a line holding only '.'):", style="bold"))
            action = read_turn(stdin)
            if action is None:
                console.print(Text("End of input; the episode is left unfinished.", style="yellow"))
                break
        obs, reward, terminated, truncated, info = env.step(action)
        summary.update(turns=summary["turns"] + 1, reward=float(reward), terminated=terminated, truncated=truncated)
        is_error = bool(info.get("parse_error")) or obs.startswith("Error")
        if obs:
            console.print(Panel(Text(obs), title="error" if is_error else "observation",
                                border_style="red" if is_error else "green"))
        if terminated or truncated:
            how = "answered" if terminated else f"out of turns ({env.max_turns})"  # type: ignore[attr-defined]
            verdict = f", {info['verdict']}" if "verdict" in info else ""
            console.print(Text(f"Episode over ({how}{verdict}): reward {float(reward):g}", style="bold magenta"))
            summary["finished"] = True
            break
    env.close()
    return summary


def _run_play(args: argparse.Namespace) -> int:
    """``trace-gym play``; a bad env id, argument or task is raised (one ``error:`` line, exit 2)."""
    from rich.console import Console

    console = Console(highlight=False)
    kwargs = parse_env_args(args.env_arg)
    play(args.env, seed=args.seed, task_id=args.task_id, index=args.index, split=args.split, demo=args.demo,
         env_kwargs=kwargs, console=console)
    return 0


def configure_play(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``trace-gym play``."""
    parser.add_argument("env", help="environment id, e.g. MathCalc-v0 (short for trace_gym/MathCalc-v0); see `trace-gym list envs`")
    parser.add_argument("--seed", type=int, default=0, help="reset seed (picks the task when no --task-id/--index)")
    parser.add_argument("--task-id", help="play this task (ids as shown in the header)")
    parser.add_argument("--index", type=int, help="play the task at this index of the split")
    parser.add_argument("--split", default="train", choices=["train", "validation", "test"])
    parser.add_argument("--demo", action="store_true",
                        help="play the env's own demonstration (its demonstrate() turns) instead of reading turns")
    parser.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="constructor keyword argument (VALUE is JSON when it parses), repeatable")
    parser.set_defaults(func=_run_play)
