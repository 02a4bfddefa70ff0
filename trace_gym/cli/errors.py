"""How ``trace-gym`` reports a failure: one line, ``error: ...``, on stderr.

Contract of every subcommand (:func:`trace_gym.cli.main.main` enforces it):

* A *user error* (a bad name, option, value, path or file; an env, dataset or server that is
  not available) ends the command with exit status 2 and one line
  ``error: <what was wrong and what is allowed>``, no traceback. Commands signal one by
  raising: :class:`ValueError` (pydantic's ``ValidationError``, ``SuiteError``,
  ``ConfigError`` ... are ValueErrors), :class:`KeyError` (``UnknownNameError``),
  :class:`LookupError`, :class:`OSError` (a missing file, an unreachable server), an
  :class:`ImportError` (a missing optional package), an
  :class:`~trace_gym.env.base.EnvUnavailable`, a :class:`~trace_gym.registry.PluginError`,
  or :class:`UsageError`.
* Any other exception is a bug: exit status 1 and one line ``error: internal error:
  <type>: <message> (run with --debug ...)``.
* ``--debug`` anywhere on the command line, or ``TRACE_GYM_DEBUG=1``, lets the exception
  propagate with its full traceback instead.
"""

from __future__ import annotations

import os
import sys
from typing import Any

DEBUG_ENV = "TRACE_GYM_DEBUG"
"""Environment variable that, set to 1, makes ``trace-gym`` show tracebacks (as ``--debug``)."""

USER_ERROR_STATUS = 2
INTERNAL_ERROR_STATUS = 1


class UsageError(ValueError):
    """A command-line mistake found by a command itself (not by argparse); reported as
    ``error: <message>`` with exit status 2."""


def debug_enabled(argv: list[str] | None = None) -> bool:
    """Whether tracebacks are wanted: ``--debug`` in ``argv`` or ``TRACE_GYM_DEBUG`` set to a true value."""
    if argv is not None and "--debug" in argv:
        return True
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _user_error_types() -> tuple[type[BaseException], ...]:
    from trace_gym.env.base import EnvUnavailable
    from trace_gym.registry import PluginError

    return (ValueError, LookupError, OSError, ImportError, EnvUnavailable, PluginError)


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` reports a mistake in the input or the environment rather than a bug."""
    return isinstance(exc, _user_error_types())


def _validation_message(exc: Any) -> str:
    """pydantic's multi-line ``ValidationError`` as ``field: problem; field: problem``."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if not (isinstance(p, str) and p.startswith("function-")))
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def one_line(text: str) -> str:
    """``text`` on one line: its non-blank lines joined by ``; `` (by a space after a line
    ending in ``:``), runs of spaces collapsed."""
    out = ""
    for line in (" ".join(raw.split()) for raw in str(text).splitlines()):
        if line:
            out += ("" if not out else " " if out.endswith(":") else "; ") + line
    return out


def error_message(exc: BaseException) -> str:
    """The text after ``error: `` for ``exc``: its message on one line (pydantic errors as
    ``field: problem``; the lines of a multi-line message joined by ``; ``)."""
    try:
        from pydantic import ValidationError
    except ImportError:  # pragma: no cover - pydantic is a dependency
        ValidationError = ()  # type: ignore[assignment,misc]
    if isinstance(exc, ValidationError):
        text = _validation_message(exc)
    elif isinstance(exc, KeyError) and len(exc.args) == 1 and type(exc).__str__ is KeyError.__str__:
        text = str(exc.args[0])  # KeyError quotes its argument
    else:
        text = str(exc)
    text = one_line(text)
    if not is_user_error(exc):
        return f"internal error: {type(exc).__name__}: {text} (run with --debug or {DEBUG_ENV}=1 for the traceback)"
    return text or type(exc).__name__


def report(exc: BaseException, stream: Any = None) -> int:
    """Print ``error: ...`` for ``exc`` on ``stream`` (default stderr); return the exit status
    (2 for a user error, 1 for anything else)."""
    stream = stream if stream is not None else sys.stderr
    print(f"error: {error_message(exc)}", file=stream, flush=True)
    return USER_ERROR_STATUS if is_user_error(exc) else INTERNAL_ERROR_STATUS


def fail(message: str) -> int:
    """Print ``error: message`` on stderr (one line) and return 2: for commands that find a
    user error themselves and prefer returning to raising."""
    print(f"error: {one_line(message)}", file=sys.stderr, flush=True)
    return USER_ERROR_STATUS


__all__ = ["DEBUG_ENV", "UsageError", "debug_enabled", "error_message", "fail", "is_user_error", "one_line", "report"]
