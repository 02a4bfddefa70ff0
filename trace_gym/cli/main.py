"""The ``trace-gym`` command.

Subcommands are entry points of the group ``trace_gym.commands``, the built-in ones
included (declared in this project's ``pyproject.toml``)::

    [project.entry-points."trace_gym.commands"]
    my-command = "mypkg.cli:my_command"

``my_command(subparsers)`` adds the subcommand's parser
(``subparsers.add_parser("my-command", ...)``), defines its arguments and sets
``parser.set_defaults(func=...)``; ``func(args)`` returns the exit status. The first line
of its docstring is the command's one-line help in ``trace-gym --help``. Only the entry
point of the command being run is called, so keep the module that defines it light and
import the command's implementation inside the function: ``trace-gym --help`` stays fast.

Built-in: ``envs``, ``play``, ``bench``, ``rollout``, ``leaderboard`` (defined below),
``train`` and ``eval`` (:mod:`trace_gym.trainers.cli`), ``serve-retriever``
(:mod:`trace_gym.envs`).
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from typing import Any, Callable

from trace_gym.registry import COMMAND_GROUP, PluginError, entry_points, load_entry_point

Configure = Callable[[argparse.ArgumentParser], None]


def _help(fn: Callable[..., Any]) -> str:
    return ((fn.__doc__ or "").strip().splitlines() or [""])[0]


def add_command(subparsers: Any, name: str, command: Callable[..., Any], configure: Configure) -> argparse.ArgumentParser:
    """Add subcommand ``name`` to ``subparsers`` with the first docstring line of ``command``
    as its help, and let ``configure(parser)`` define its arguments and ``func``."""
    help_ = _help(command)
    parser = subparsers.add_parser(name, help=help_, description=help_)
    configure(parser)
    return parser


# ----------------------------------------------------------------------------- built-in commands

def envs_command(subparsers: Any) -> argparse.ArgumentParser:
    """list the registered environments"""
    from trace_gym.cli.play import configure_envs

    return add_command(subparsers, "envs", envs_command, configure_envs)


def play_command(subparsers: Any) -> argparse.ArgumentParser:
    """play an environment turn by turn in the terminal"""
    from trace_gym.cli.play import configure_play

    return add_command(subparsers, "play", play_command, configure_play)


def bench_command(subparsers: Any) -> argparse.ArgumentParser:
    """benchmarks: `bench allocators` compares allocators on ContrastLab at an equal budget"""
    from trace_gym.cli.bench import configure_bench

    return add_command(subparsers, "bench", bench_command, configure_bench)


def rollout_command(subparsers: Any) -> argparse.ArgumentParser:
    """collect one step of rollout trees and write them as JSONL"""
    from trace_gym.cli.rollout import configure_rollout

    return add_command(subparsers, "rollout", rollout_command, configure_rollout)


def leaderboard_command(subparsers: Any) -> argparse.ArgumentParser:
    """run a benchmark suite, or show / merge leaderboard records"""
    from trace_gym.leaderboard.cli import configure_leaderboard

    return add_command(subparsers, "leaderboard", leaderboard_command, configure_leaderboard)


# ----------------------------------------------------------------------------- the command

def commands() -> dict[str, metadata.EntryPoint]:
    """The installed subcommands: name -> entry point of the group ``trace_gym.commands``."""
    return {ep.name: ep for ep in sorted(entry_points(COMMAND_GROUP), key=lambda ep: ep.name)}


def _load(ep: metadata.EntryPoint) -> Callable[..., Any]:
    return load_entry_point(ep, COMMAND_GROUP, f"command {ep.name!r}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``trace-gym`` parser: every installed subcommand listed with its help, and the
    arguments of ``only`` (the command being run) defined by its entry point."""
    parser = argparse.ArgumentParser(prog="trace-gym", description="Multi-turn agent gym with budget-allocation for RL.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, ep in commands().items():
        if name == only:
            _load(ep)(sub)
            if name not in sub.choices:
                raise PluginError(f"command {name!r}: entry point {name} = {ep.value!r} (group {COMMAND_GROUP!r}) "
                                  f"did not add a parser named {name!r}")
            continue
        try:
            help_ = _help(_load(ep))
        except PluginError as exc:
            help_ = f"(cannot be loaded: {exc.__cause__!r})"
        sub.add_parser(name, help=help_, description=help_)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``trace-gym`` with ``argv`` (default: the process's arguments); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is not None and command not in commands():
        build_parser().parse_args(argv)  # argparse reports the unknown command with choices
        return 2
    parser = build_parser(only=command)
    args = parser.parse_args(argv)
    if command is None or not hasattr(args, "func"):
        parser.print_help()
        return 0 if command is None else 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
