"""The ``trace-gym`` command.

Each subcommand lives in the module that implements it, as a function
``configure(parser)`` that adds its arguments and sets ``parser.set_defaults(func=...)``;
``func(args)`` returns the exit status. Modules are imported only when their subcommand
runs, so ``trace-gym --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name: (module, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "envs": ("trace_gym.cli.play", "list the registered environments"),
    "play": ("trace_gym.cli.play", "play an environment turn by turn in the terminal"),
    "bench": ("trace_gym.sim.bench", "benchmarks: `bench allocators` compares allocators on ContrastLab at an equal budget"),
    "serve-retriever": ("trace_gym.envs.retrieval", "serve a passage index over the Search-R1 retrieval API"),
    "rollout": ("trace_gym.rollout.engine", "collect one step of rollout trees and write them as JSONL"),
    "train": ("trace_gym.trainers.cli", "train a policy with an allocator (RL, with an optional SFT warm start)"),
    "eval": ("trace_gym.trainers.cli", "evaluate a policy: mean@k and pass@k on held-out tasks"),
    "leaderboard": ("trace_gym.leaderboard", "run a benchmark suite, or show / merge leaderboard records"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trace-gym", description="Multi-turn agent gym with budget-allocation for RL.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if only == name:
            configure = getattr(importlib.import_module(module), "configure_" + name.replace("-", "_"))
            configure(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is not None and command not in COMMANDS:
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
