"""The ``trace-gym`` command. Subcommands are entry points of the group
``trace_gym.commands`` (see :mod:`trace_gym.cli.main`); each lives in the module that
implements it."""

from trace_gym.cli.main import main

__all__ = ["main"]
