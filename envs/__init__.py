"""Built-in environments (importable as ``trace_gym.envs``).

They are registered through the entry-point group ``trace_gym.envs`` in this project's
``pyproject.toml``, exactly as a third-party package's environments are, with string entry
points: importing trace_gym loads no environment module (and none of their dependencies)
until an env is made.

This package also provides the ``trace-gym serve-retriever`` command (entry-point group
``trace_gym.commands``).
"""

from __future__ import annotations

import argparse
from typing import Any


def serve_retriever_command(subparsers: Any) -> argparse.ArgumentParser:
    """serve a passage index over the Search-R1 retrieval API"""
    from trace_gym.envs.multihop.serve import configure_serve_retriever

    help_ = (serve_retriever_command.__doc__ or "").strip()
    parser = subparsers.add_parser("serve-retriever", help=help_, description=help_)
    configure_serve_retriever(parser)
    return parser
