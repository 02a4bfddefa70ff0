"""Starting OpenAI-compatible servers on loopback for the ``openai`` backend tests
(``test_openai_backend.py``: ``transformers serve``; ``test_vllm_serve.py``: ``vllm serve``):
a free port, and waiting until a started server answers."""

from __future__ import annotations

import socket
import subprocess
import time
from typing import Callable

import httpx


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(proc: subprocess.Popen, url: str, *, name: str, timeout_s: float, poll_s: float,
                       output: Callable[[], str], stop: Callable[[], None]) -> None:
    """Return once ``GET {url}/models`` answers 200. Raises ``RuntimeError`` with the tail of
    ``output()`` (the server's log) if ``proc`` exits first, or after calling ``stop()`` if
    ``timeout_s`` pass first; ``name`` says which server in those messages."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{output()}")
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop()
            raise RuntimeError(f"{name} did not come up within {timeout_s} s:\n{output()}")
        time.sleep(poll_s)
