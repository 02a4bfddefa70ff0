"""Registration by name: environments on Gymnasium's registry, and components
(allocators, predictors, policies, advantage estimators) in small name -> factory tables.

Built-ins register themselves exactly as a user's plug-in would::

    import trace_gym
    trace_gym.register("myorg/MyEnv-v0", entry_point="mypkg.env:MyEnv", max_episode_steps=None)
    env = trace_gym.make("myorg/MyEnv-v0")          # or gymnasium.make(...)

    @trace_gym.allocators.register("my_alloc")
    class MyAllocator(trace_gym.Allocator): ...

Third-party packages can also expose environments through the entry-point group
``trace_gym.envs``: each entry is ``"org/Name-v0" = "pkg.module:EnvClass"``.
"""

from __future__ import annotations

import difflib
import json
from importlib import metadata
from typing import Any, Callable, Generic, Iterator, TypeVar

import gymnasium

T = TypeVar("T")

ENV_NAMESPACE = "trace_gym"
ENTRY_POINT_GROUP = "trace_gym.envs"


class UnknownNameError(KeyError):
    """Raised when a name is not registered; the message lists close matches."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0])


class Registry(Generic[T]):
    """A table of named factories for one kind of component.

    ``kind`` is used in error messages ("unknown allocator 'trac'; did you mean 'trace'?").
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._table: dict[str, Callable[..., T]] = {}

    def register(self, name: str, factory: Callable[..., T] | None = None, *, overwrite: bool = False):
        """Register ``factory`` under ``name``; usable as a decorator when ``factory`` is omitted."""

        def _add(f: Callable[..., T]) -> Callable[..., T]:
            if not overwrite and name in self._table and self._table[name] is not f:
                raise ValueError(f"{self.kind} {name!r} is already registered; pass overwrite=True to replace it")
            self._table[name] = f
            return f

        return _add(factory) if factory is not None else _add

    def get(self, name: str) -> Callable[..., T]:
        """The factory registered under ``name``."""
        try:
            return self._table[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._table, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}{hint} (registered: {', '.join(sorted(self._table)) or 'none'})"
            ) from None

    def parse(self, spec: str) -> tuple[str, dict[str, Any]]:
        """Split a spec string ``"name:key=value:key=value"`` into the registered name and
        its options (values read as JSON where they parse, else kept as strings):
        ``"trace:scale=group"`` -> ``("trace", {"scale": "group"})``. Unknown names raise
        :class:`UnknownNameError` with suggestions; a malformed option raises ``ValueError``."""
        name, *opts = spec.strip().split(":")
        self.get(name)
        kwargs: dict[str, Any] = {}
        for opt in opts:
            if "=" not in opt:
                raise ValueError(f"{self.kind} {spec!r}: options are key=value, got {opt!r}")
            key, value = opt.split("=", 1)
            try:
                kwargs[key] = json.loads(value)
            except json.JSONDecodeError:
                kwargs[key] = value
        return name, kwargs

    def make(self, name: str, /, **kwargs: Any) -> T:
        """Build the component registered under ``name`` with ``kwargs``."""
        return self.get(name)(**kwargs)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


# ----------------------------------------------------------------------------- environments

def register(id: str, entry_point: Any, **spec: Any) -> None:
    """Register an environment on Gymnasium's registry.

    ``id`` is ``"namespace/Name-vN"``; ``entry_point`` a class, a callable or a
    ``"module:attr"`` string; ``spec`` any other :func:`gymnasium.register` argument
    (``kwargs``, ``max_episode_steps`` ...). Episode length is bounded by the env itself
    (``max_turns``), so ``max_episode_steps`` defaults to ``None`` and no TimeLimit wrapper
    is added; env checking is left to the test-suite (``disable_env_checker=True``)
    because Gymnasium's passive checker warns on text spaces.
    """
    spec.setdefault("disable_env_checker", True)
    gymnasium.register(id=id, entry_point=entry_point, **spec)
    _registered_ids.add(id)


_registered_ids: set[str] = set()
_plugins_loaded = False


def load_plugins() -> list[str]:
    """Register environments that installed packages expose under the ``trace_gym.envs`` group.

    Returns the ids registered. Safe to call more than once; a broken plug-in is reported
    with its name, not silently skipped.
    """
    global _plugins_loaded
    added: list[str] = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in gymnasium.registry:
            continue
        try:
            register(ep.name, entry_point=ep.value)
        except Exception as exc:  # pragma: no cover - depends on third-party packages
            raise RuntimeError(f"entry point {ep.name!r} = {ep.value!r} of group {ENTRY_POINT_GROUP!r} failed: {exc}") from exc
        added.append(ep.name)
    _plugins_loaded = True
    return added


def make(id: str, **kwargs: Any) -> gymnasium.Env:
    """Build a registered environment (``trace_gym.make("trace_gym/MathCalc-v0", seed=0)``).

    Unlike :func:`gymnasium.make` this returns the env unwrapped, so ``snapshot()`` and
    ``restore()`` are reachable directly, and it suggests close ids on a typo.
    """
    if not _plugins_loaded:
        load_plugins()
    if id not in gymnasium.registry:
        ours = [k for k in gymnasium.registry if k.startswith(ENV_NAMESPACE + "/")]
        close = difflib.get_close_matches(id, ours, n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise UnknownNameError(f"unknown environment {id!r}{hint} (see `trace-gym envs`)")
    kwargs.setdefault("disable_env_checker", True)
    return gymnasium.make(id, **kwargs).unwrapped


def env_ids() -> list[str]:
    """Ids of the environments registered through :func:`register` or the entry-point group."""
    if not _plugins_loaded:
        load_plugins()
    return sorted(i for i in _registered_ids if i in gymnasium.registry)
