"""The ``trace-gym`` command: one module per command."""

from trace_gym.cli.main import main

__all__ = ["main"]
