"""Registration by name: environments on Gymnasium's registry, and components
(allocators, predictors, advantage estimators, policies) in name -> factory tables.

Every kind registers in two equivalent ways, and the built-ins use them exactly as a
user's plug-in does:

* in-process, with a decorator::

      @trace_gym.register_allocator("my_alloc")
      class MyAllocator(trace_gym.Allocator): ...

      trace_gym.register("myorg/MyEnv-v0", entry_point="mypkg.env:MyEnv")

* from an installed package, through an entry-point group (nothing is imported until the
  name is used)::

      [project.entry-points."trace_gym.allocators"]
      my_alloc = "mypkg.alloc:MyAllocator"

========================  ===============================  ======================================
kind                      entry-point group                decorator / function
========================  ===============================  ======================================
environment               ``trace_gym.envs``               ``trace_gym.register(id, entry_point)``
allocator                 ``trace_gym.allocators``         ``@trace_gym.register_allocator(name)``
predictor                 ``trace_gym.predictors``         ``@trace_gym.register_predictor(name)``
advantage estimator       ``trace_gym.advantages``         ``@trace_gym.register_advantage(name)``
policy backend            ``trace_gym.policies``           ``@trace_gym.register_policy(name)``
``trace-gym`` subcommand  ``trace_gym.commands``           (entry point only, see :mod:`trace_gym.cli`)
========================  ===============================  ======================================

An environment entry is ``"org/Name-v0" = "pkg.module:EnvClass"``; a component entry is
``name = "pkg.module:factory"`` where ``factory(**kwargs)`` builds the component (usually
the class itself).
"""

from __future__ import annotations

import difflib
import json
import warnings
from importlib import metadata
from typing import Any, Callable, Generic, Iterator, TypeVar

import gymnasium

T = TypeVar("T")

ENV_NAMESPACE = "trace_gym"

ENV_GROUP = "trace_gym.envs"
ALLOCATOR_GROUP = "trace_gym.allocators"
PREDICTOR_GROUP = "trace_gym.predictors"
ADVANTAGE_GROUP = "trace_gym.advantages"
POLICY_GROUP = "trace_gym.policies"
COMMAND_GROUP = "trace_gym.commands"
ENTRY_POINT_GROUP = ENV_GROUP  # the environments' group (its historical name)


class UnknownNameError(KeyError):
    """Raised when a name is not registered; the message lists close matches."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0])


class PluginError(ImportError):
    """An entry point could not be loaded (its module failed to import, lacks the attribute,
    or two installed packages claim the same name). The message names the entry point
    (``name = module:attr``), its group and its distribution; ``name`` is the missing
    module's name when the cause was an :class:`ImportError`."""


def _dist_name(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return getattr(dist, "name", None) or "an unknown distribution"


def _describe(ep: metadata.EntryPoint, group: str) -> str:
    return f"entry point {ep.name} = {ep.value!r} (group {group!r}, from {_dist_name(ep)})"


_EP_CACHE: Any = None


def entry_points(group: str, *, fresh: bool = False) -> list[metadata.EntryPoint]:
    """The installed entry points of ``group``. Installed metadata is read once per process
    (one pass over every distribution serves all groups); ``fresh`` reads it again."""
    global _EP_CACHE
    if fresh or _EP_CACHE is None:
        _EP_CACHE = metadata.entry_points()
    return list(_EP_CACHE.select(group=group))


def load_entry_point(ep: metadata.EntryPoint, group: str, what: str) -> Any:
    """``ep.load()``; a failure raises :class:`PluginError` naming ``what`` (``"allocator
    'acme'"``) and the entry point. Its ``name`` is the module that failed to import, or the
    entry point's module when that lacks the attribute."""
    try:
        return ep.load()
    except Exception as exc:
        name = exc.name if isinstance(exc, ImportError) else ep.module
        raise PluginError(f"{what}: {_describe(ep, group)} failed to load: {type(exc).__name__}: {exc}",
                          name=name) from exc


class Registry(Generic[T]):
    """A table of named factories for one kind of component.

    ``kind`` is used in messages ("unknown allocator 'trac'; did you mean 'trace'?");
    ``group``, when given, is the entry-point group whose entries also register here. The
    group is read on first use (:meth:`get`, :meth:`names`, ``in``, iteration, or a
    registration), and an entry's module is imported only when :meth:`get` asks for that
    name, so listing names imports nothing.
    """

    def __init__(self, kind: str, group: str | None = None):
        self.kind = kind
        self.group = group
        self._table: dict[str, Callable[..., T]] = {}
        self._pending: dict[str, metadata.EntryPoint] = {}
        self._conflicts: dict[str, list[metadata.EntryPoint]] = {}
        self._scanned = group is None
        self._loading: str | None = None

    # ------------------------------------------------------------------ entry points

    def _scan(self, fresh: bool = False) -> None:
        if self._scanned:
            return
        self._scanned = True
        assert self.group is not None
        for ep in entry_points(self.group, fresh=fresh):
            if ep.name in self._table:
                if not self._is_target(ep, self._table[ep.name]):
                    warnings.warn(f"{self.kind} {ep.name!r} registered in this process shadows "
                                  f"{_describe(ep, self.group)}", stacklevel=3)
                continue
            other = self._pending.get(ep.name)
            if other is None:
                self._pending[ep.name] = ep
            elif other.value != ep.value:
                self._conflicts.setdefault(ep.name, [other]).append(ep)

    def refresh(self) -> list[str]:
        """Read the entry-point group again (packages installed since the first read);
        returns the names that were added."""
        before = set(self._table) | set(self._pending)
        if self.group is not None:
            self._scanned = False
            self._scan(fresh=True)
        return sorted((set(self._table) | set(self._pending)) - before)

    @staticmethod
    def _is_target(ep: metadata.EntryPoint, obj: Any) -> bool:
        return ep.module == getattr(obj, "__module__", None) and ep.attr == getattr(obj, "__qualname__", None)

    def entry_point(self, name: str) -> metadata.EntryPoint | None:
        """The not-yet-loaded entry point that provides ``name``, if any."""
        self._scan()
        return self._pending.get(name)

    # ------------------------------------------------------------------ registration

    def register(self, name: str, factory: Callable[..., T] | None = None, *, overwrite: bool = False):
        """Register ``factory`` under ``name``; usable as a decorator when ``factory`` is omitted.

        A name that is already taken (by another registration, or by an installed entry point
        that names a different object) raises ``ValueError`` unless ``overwrite=True``. The
        module an entry point names may register its own target with this decorator.
        """

        def _add(f: Callable[..., T]) -> Callable[..., T]:
            self._scan()
            current = self._table.get(name)
            if not overwrite and current is not None and current is not f:
                raise ValueError(f"{self.kind} {name!r} is already registered; pass overwrite=True to replace it")
            ep = self._pending.get(name)
            if not overwrite and ep is not None and self._loading != name and not self._is_target(ep, f):
                raise ValueError(f"{self.kind} {name!r} is already provided by {_describe(ep, self.group or '')}; "
                                 "pass overwrite=True to replace it")
            self._pending.pop(name, None)
            self._conflicts.pop(name, None)
            self._table[name] = f
            return f

        return _add(factory) if factory is not None else _add

    # ------------------------------------------------------------------ lookup

    def _unknown(self, name: str) -> UnknownNameError:
        known = self.names()
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        return UnknownNameError(f"unknown {self.kind} {name!r}{hint} (registered: {', '.join(known) or 'none'})")

    def get(self, name: str) -> Callable[..., T]:
        """The factory registered under ``name``, importing its entry point on first use.

        Raises :class:`UnknownNameError` (with close matches) for an unknown name and
        :class:`PluginError` (naming the entry point) when its entry point fails to load.
        """
        f = self._table.get(name)
        if f is not None:
            return f
        self._scan()
        if name in self._conflicts:
            claims = "; ".join(_describe(ep, self.group or "") for ep in self._conflicts[name])
            raise PluginError(f"{self.kind} {name!r} is claimed by several installed packages: {claims}")
        ep = self._pending.get(name)
        if ep is None:
            raise self._unknown(name)
        self._loading = name
        try:
            obj = load_entry_point(ep, self.group or "", f"{self.kind} {name!r}")
        finally:
            self._loading = None
        if not callable(obj):
            raise PluginError(f"{self.kind} {name!r}: {_describe(ep, self.group or '')} is not callable")
        self._pending.pop(name, None)
        self._table[name] = obj  # what the entry point names wins over what its module registered
        return obj

    def parse(self, spec: str) -> tuple[str, dict[str, Any]]:
        """Split a spec string ``"name:key=value:key=value"`` into the registered name and
        its options (values read as JSON where they parse, else kept as strings):
        ``"trace:scale=group"`` -> ``("trace", {"scale": "group"})``. Unknown names raise
        :class:`UnknownNameError` with suggestions; a malformed option raises ``ValueError``.
        Nothing is imported."""
        name, *opts = spec.strip().split(":")
        if name not in self:
            raise self._unknown(name)
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
        """Registered names (entry points included, loaded or not), sorted."""
        self._scan()
        return sorted(set(self._table) | set(self._pending) | set(self._conflicts))

    def __contains__(self, name: object) -> bool:
        if name in self._table:
            return True
        self._scan()
        return name in self._pending or name in self._conflicts

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, group={self.group!r})"


# ----------------------------------------------------------------------------- environments

def register(id: str, entry_point: Any, **spec: Any) -> None:
    """Register an environment on Gymnasium's registry.

    ``id`` is ``"namespace/Name-vN"``; ``entry_point`` a class, a callable or a
    ``"module:attr"`` string (imported when the env is first made); ``spec`` any other
    :func:`gymnasium.register` argument (``kwargs``, ``max_episode_steps`` ...). Episode
    length is bounded by the env itself (``max_turns``), so ``max_episode_steps`` defaults
    to ``None`` and no TimeLimit wrapper is added; env checking is left to the test-suite
    (``disable_env_checker=True``) because Gymnasium's passive checker warns on text spaces.
    Installed packages register through the entry-point group ``trace_gym.envs`` instead.
    """
    spec.setdefault("disable_env_checker", True)
    gymnasium.register(id=id, entry_point=entry_point, **spec)
    _registered_ids.add(id)


_registered_ids: set[str] = set()
_env_entry_points: dict[str, metadata.EntryPoint] = {}
_plugins_loaded = False


def load_plugins(*, strict: bool = True, fresh: bool = True) -> list[str]:
    """Register the environments that installed packages (this one included) expose under
    the entry-point group ``trace_gym.envs``, without importing them.

    Returns the ids registered by this call. Safe to call more than once (ids already on
    Gymnasium's registry are left alone); ``fresh=False`` reuses the installed metadata
    this process already read. An entry that cannot be registered raises
    :class:`PluginError` naming it, or, with ``strict=False``, is reported as a warning.
    """
    global _plugins_loaded
    added: list[str] = []
    for ep in entry_points(ENV_GROUP, fresh=fresh):
        if ep.name in gymnasium.registry:
            continue
        try:
            register(ep.name, entry_point=ep.value)
        except Exception as exc:
            msg = f"environment {ep.name!r}: {_describe(ep, ENV_GROUP)} could not be registered: {exc}"
            if strict:
                raise PluginError(msg) from exc
            warnings.warn(msg, stacklevel=2)
            continue
        _env_entry_points[ep.name] = ep
        added.append(ep.name)
    _plugins_loaded = True
    return added


_MAKE_KWARGS = frozenset({"max_episode_steps", "autoreset", "apply_api_compatibility", "disable_env_checker",
                          "order_enforce"})
"""Keyword arguments :func:`gymnasium.make` takes for itself (not passed to the env)."""


def full_env_id(id: str) -> str:
    """The registered id ``id`` names: ``"MathCalc-v0"`` is short for ``"trace_gym/MathCalc-v0"``
    (used when no env is registered under the short id itself); other ids are returned unchanged."""
    id = id.strip()
    if not _plugins_loaded:
        load_plugins(strict=False, fresh=False)
    if id in gymnasium.registry or "/" in id:
        return id
    full = f"{ENV_NAMESPACE}/{id}"
    return full if full in gymnasium.registry else id


def env_parameters(id: str) -> tuple[list[str], bool] | None:
    """``(keyword parameters, open-ended)`` of the constructor of env ``id`` (its entry point is
    imported): the constructor's own keyword parameters, plus, where it takes ``**kwargs``, those
    of the base classes it may pass them on to; ``open-ended`` is whether it takes ``**kwargs``.
    ``None`` when the signature cannot be read."""
    import inspect

    from gymnasium.envs.registration import load_env_creator

    spec = gymnasium.registry[full_env_id(id)]
    try:
        creator = load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point
        params = list(inspect.signature(creator).parameters.values())
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params)
    if open_ended and isinstance(creator, type):
        for base in creator.__mro__[1:]:
            init = base.__dict__.get("__init__")
            if init is None or base is object or base.__module__.startswith("gymnasium"):
                continue
            try:
                more = list(inspect.signature(init).parameters.values())[1:]
            except (TypeError, ValueError):
                break
            names += [p.name for p in more if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in names]
            if not any(p.kind is p.VAR_KEYWORD for p in more):
                break
    return names, open_ended


def _bad_argument(id: str, key: str, names: list[str], open_ended: bool) -> ValueError:
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(f"environment {id!r} takes no argument {key!r}{hint} (its arguments: {', '.join(names) or 'none'})")


def check_env_kwargs(id: str, kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming a keyword argument env ``id``'s constructor does not take,
    with the ones it does. A constructor with ``**kwargs`` is not checked here (:func:`make`
    reports the ``TypeError`` it raises for an unknown argument the same way)."""
    found = env_parameters(id)
    if found is None or found[1]:
        return
    for key in kwargs:
        if key not in _MAKE_KWARGS and key != "render_mode" and key not in found[0]:
            raise _bad_argument(full_env_id(id), key, *found)


def check_env(id: str, kwargs: dict[str, Any] | None = None) -> str:
    """The full id of env ``id`` after checking, without building it, that it is registered
    (:class:`UnknownNameError` with close ids otherwise) and that its constructor takes
    ``kwargs`` (``ValueError``, see :func:`check_env_kwargs`)."""
    if not _plugins_loaded:
        load_plugins(strict=False, fresh=False)
    full = full_env_id(id)
    if full not in gymnasium.registry:
        raise _unknown_env(full)
    if kwargs:
        check_env_kwargs(full, kwargs)
    return full


def _unknown_env(id: str) -> UnknownNameError:
    ours = [k for k in gymnasium.registry if k.startswith(ENV_NAMESPACE + "/")] + sorted(_registered_ids)
    candidates = list(dict.fromkeys(ours))
    short = {k.split("/", 1)[1]: k for k in candidates if "/" in k}
    close = difflib.get_close_matches(id, candidates, n=3) or \
        [short[c] for c in difflib.get_close_matches(id.split("/")[-1], list(short), n=3)]
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    return UnknownNameError(f"unknown environment {id!r}{hint} (see `trace-gym list envs`)")


def make(id: str, **kwargs: Any) -> gymnasium.Env:
    """Build a registered environment (``trace_gym.make("trace_gym/MathCalc-v0", seed=0)``;
    ``"MathCalc-v0"`` is short for ``"trace_gym/MathCalc-v0"``).

    Unlike :func:`gymnasium.make` this returns the env unwrapped, so ``snapshot()`` and
    ``restore()`` are reachable directly; it suggests close ids on a typo
    (:class:`UnknownNameError`), an env from an entry point whose module fails to import
    raises :class:`PluginError` naming that entry point, and a keyword argument the env's
    constructor does not take raises ``ValueError`` listing the ones it does. ``kwargs`` go
    to the env's constructor.
    """
    if not _plugins_loaded:
        load_plugins(strict=False, fresh=False)
    id = full_env_id(id)
    if id not in gymnasium.registry:
        raise _unknown_env(id)
    ep = _env_entry_points.get(id)
    if ep is not None and gymnasium.registry[id].entry_point == ep.value:
        load_entry_point(ep, ENV_GROUP, f"environment {id!r}")
    if kwargs:
        check_env_kwargs(id, kwargs)
    kwargs.setdefault("disable_env_checker", True)
    try:
        return gymnasium.make(id, **kwargs).unwrapped
    except TypeError as exc:
        import re

        m = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
        found = env_parameters(id) if m and m.group(1) in kwargs else None
        if m is None or found is None:
            raise
        raise _bad_argument(id, m.group(1), *found) from exc


def env_ids() -> list[str]:
    """Ids of the environments registered through :func:`register` or the entry-point group
    ``trace_gym.envs``, sorted."""
    if not _plugins_loaded:
        load_plugins(strict=False, fresh=False)
    return sorted(i for i in _registered_ids if i in gymnasium.registry)
