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

Errors: a command reports a user error by raising (``ValueError``, ``KeyError``,
``OSError``, ``EnvUnavailable`` ...); :func:`main` prints it as one ``error: ...`` line
with exit status 2 (see :mod:`trace_gym.cli.errors`).

Built-in: ``envs``, ``list``, ``play``, ``bench``, ``rollout``, ``leaderboard`` (defined below),
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


def list_command(subparsers: Any) -> argparse.ArgumentParser:
    """list registered names: envs, allocators, predictors, advantages, policies, models"""
    from trace_gym.cli.listing import configure_list

    return add_command(subparsers, "list", list_command, configure_list)


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
    parser = argparse.ArgumentParser(prog="trace-gym", description="Multi-turn agent gym with budget-allocation for RL.",
                                     epilog=GLOBAL_OPTIONS, formatter_class=argparse.RawDescriptionHelpFormatter)
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


GLOBAL_OPTIONS = """global options (before the command; --debug anywhere):
  --version        print the installed trace-gym version and exit
  --debug          show the full traceback of an error (or set TRACE_GYM_DEBUG=1)
  --plugin MODULE  import MODULE (a module name or a .py file) first, so what it registers
                   (@trace_gym.register_allocator ...) reaches the command; repeatable;
                   also TRACE_GYM_PLUGINS=mod1,mod2"""

PLUGINS_ENV = "TRACE_GYM_PLUGINS"


def version() -> str:
    """The installed distribution's version (``trace_gym.__version__`` when not installed)."""
    try:
        return metadata.version("trace-gym")
    except metadata.PackageNotFoundError:
        import trace_gym

        return trace_gym.__version__


def import_plugin(name: str) -> None:
    """Import a plug-in module by dotted name, or a Python file by path, for its registrations.
    Raises :class:`~trace_gym.cli.errors.UsageError` naming it when it cannot be imported."""
    import importlib
    import importlib.util
    import os

    from trace_gym.cli.errors import UsageError

    if name.endswith(".py") or os.sep in name:
        if not os.path.isfile(name):
            raise UsageError(f"--plugin {name!r}: no such file")
        mod_name = "trace_gym_plugin_" + os.path.splitext(os.path.basename(name))[0].replace("-", "_")
        spec = importlib.util.spec_from_file_location(mod_name, name)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
        return
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            raise UsageError(f"--plugin {name!r}: no module named {exc.name!r} (give a module name on the Python path "
                             f"or a path to a .py file)") from None
        raise


def _split_globals(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Take the global options off the front of ``argv`` (``--debug`` from anywhere)."""
    from trace_gym.cli.errors import UsageError

    opts: dict[str, Any] = {"debug": False, "version": False, "plugins": []}
    rest = list(argv)
    while rest and rest[0].startswith("-") and rest[0] not in ("-h", "--help"):
        arg = rest.pop(0)
        if arg == "--debug":
            opts["debug"] = True
        elif arg == "--version":
            opts["version"] = True
        elif arg == "--plugin" or arg.startswith("--plugin="):
            value = arg.partition("=")[2] if "=" in arg else (rest.pop(0) if rest else "")
            if not value:
                raise UsageError("--plugin takes a module name or a .py file")
            opts["plugins"].append(value)
        else:
            rest.insert(0, arg)
            break
    if "--debug" in rest:
        opts["debug"] = True
        rest = [a for a in rest if a != "--debug"]
    return opts, rest


def _run(argv: list[str], opts: dict[str, Any]) -> int:
    if opts["version"]:
        print(f"trace-gym {version()}")
        return 0
    import os

    for name in [p for p in os.environ.get(PLUGINS_ENV, "").split(",") if p.strip()] + opts["plugins"]:
        import_plugin(name.strip())
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


def main(argv: list[str] | None = None) -> int:
    """Run ``trace-gym`` with ``argv`` (default: the process's arguments); returns the exit
    status: 0 on success, 2 for a user error (one ``error: ...`` line on stderr, see
    :mod:`trace_gym.cli.errors`), 1 for an internal error; ``--debug`` (or
    ``TRACE_GYM_DEBUG=1``) shows the traceback instead."""
    from trace_gym.cli.errors import debug_enabled, report

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_enabled(argv)
    try:
        opts, rest = _split_globals(argv)
        return _run(rest, opts)
    except KeyboardInterrupt:
        if debug:
            raise
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            raise
        return report(exc)


if __name__ == "__main__":
    sys.exit(main())
