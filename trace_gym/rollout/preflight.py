"""Checks before a run's first step: the servers it will call answer, and whether the
Hugging Face Hub can be reached at all.

* :func:`check_servers` asks every server a run's envs (:meth:`AgentEnv.servers
  <trace_gym.env.base.AgentEnv.servers>`) and its policy (an ``openai`` backend's
  ``base_url``) will call for an answer, and raises :class:`ServerUnavailable` naming the URL of
  the first that does not answer. Training (``trace-gym train``) and leaderboard suites call it
  before anything is built, so a dead retrieval server is a failed start, not a run of zero
  rewards.
* :func:`hub_unreachable` tells within about a second whether the Hub can be reached
  (``HF_HUB_OFFLINE`` set, or no TCP connection to the Hub's endpoint or the proxy in front
  of it); :func:`go_offline` then sets the offline switches of ``huggingface_hub``,
  ``datasets`` and ``transformers`` for this process, so loaders fail at once instead of
  retrying. :func:`hub_dataset_cached` says whether a Hub dataset is in the local cache.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import urlsplit

__all__ = ["ServerUnavailable", "check_servers", "go_offline", "hub_dataset_cached", "hub_unreachable", "probe", "run_servers"]

_TRUE = ("1", "true", "yes", "on")
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


class ServerUnavailable(ConnectionError):
    """A server a run needs does not answer; the message names what needs it and the URL."""


# ----------------------------------------------------------------------------- servers


def probe(url: str, timeout: float = 3.0) -> str | None:
    """``None`` when an HTTP server answers a GET of ``url`` within ``timeout`` seconds (any
    status counts: the server is up), else why not (``"ConnectError: ..."``). Proxies from the
    environment are not used: the servers of a run are normally local."""
    import httpx

    try:
        with httpx.Client(timeout=httpx.Timeout(timeout), trust_env=False) as client:
            client.get(url)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except ValueError as exc:  # not a URL httpx can request
        return f"not a valid URL ({exc})"
    return None


def _env_class(env_id: str) -> Any:
    import gymnasium
    from gymnasium.envs.registration import load_env_creator

    from trace_gym.registry import full_env_id

    spec = gymnasium.spec(full_env_id(env_id))
    return load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point


def _as_pair(item: Any, key: str = "id") -> tuple[str, dict[str, Any]]:
    if isinstance(item, str):
        return item, {}
    if isinstance(item, tuple):
        return item[0], dict(item[1] or {})
    if isinstance(item, dict):
        return item[key], dict(item.get("kwargs") or {})
    return getattr(item, key), dict(getattr(item, "kwargs", None) or {})


def _policy_servers(name: str, kwargs: dict[str, Any]) -> list[str]:
    """The servers a policy backend calls: its class's ``servers(**kwargs)`` when it has one,
    else its ``base_url`` option (a URL or a list of replicas; or that option's default) when
    it takes one."""
    import inspect

    from trace_gym.policies.base import POLICIES

    factory = POLICIES.get(name)
    hook = getattr(factory, "servers", None)
    if callable(hook):
        return list(hook(**kwargs))
    if kwargs.get("base_url"):
        urls = kwargs["base_url"]
        return [str(u) for u in urls] if isinstance(urls, (list, tuple)) else [str(urls)]
    try:
        param = inspect.signature(factory).parameters.get("base_url")
    except (TypeError, ValueError):
        return []
    if param is not None and isinstance(param.default, str) and param.default:
        return [param.default]
    return []


def run_servers(envs: Iterable[Any], policy: Any = None) -> list[tuple[str, str]]:
    """``[(what, url)]``: the servers a run with ``envs`` and ``policy`` will call.

    ``envs`` are env ids, ``(id, kwargs)`` pairs, ``{"id", "kwargs"}`` dicts or objects with
    ``id`` and ``kwargs`` (an :class:`~trace_gym.run.EnvSpec`, a suite's env entry, a trainer
    config's env); ``policy`` is ``None``, a backend name, a ``(name, kwargs)`` pair, a dict or
    an object with ``name`` and ``kwargs`` (a :class:`~trace_gym.run.ComponentSpec`)."""
    out: list[tuple[str, str]] = []
    for item in envs:
        env_id, kwargs = _as_pair(item)
        hook = getattr(_env_class(env_id), "servers", None)
        for url in hook(**kwargs) if callable(hook) else []:
            out.append((f"environment {env_id}", str(url)))
    if policy is not None:
        name, kwargs = _as_pair(policy, key="name")
        for url in _policy_servers(name, kwargs):
            out.append((f"policy {name!r}", str(url)))
    return list(dict.fromkeys(out))


def check_servers(envs: Iterable[Any], policy: Any = None, *, timeout: float = 3.0) -> None:
    """Raise :class:`ServerUnavailable` unless every server of :func:`run_servers` answers
    within ``timeout`` seconds. The message names what needs the server and its URL. A retrieval
    server is asked at its ``/health`` route, an OpenAI-compatible one at ``/models``."""
    for what, url in run_servers(envs, policy):
        base = url.rstrip("/")
        if base.endswith("/retrieve"):
            base = base[: -len("/retrieve")]
        target = base + ("/models" if what.startswith("policy") else "/health")
        problem = probe(target, timeout)
        if problem is not None:
            hint = ("start the model server (e.g. `vllm serve MODEL`) or fix the policy's base_url"
                    if what.startswith("policy") else
                    "start it (`trace-gym serve-retriever` serves a passage index) or fix the env's server argument")
            raise ServerUnavailable(f"the server at {url} ({what}) does not answer: {problem}; {hint}")


# ----------------------------------------------------------------------------- the Hub


def _hub_endpoint() -> tuple[str, int]:
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)


def _proxy_for(host: str, scheme: str = "https") -> tuple[str, int] | None:
    no_proxy = os.environ.get("no_proxy") or os.environ.get("NO_PROXY") or ""
    for entry in (e.strip().lstrip(".") for e in no_proxy.split(",")):
        if entry == "*" or (entry and (host == entry or host.endswith("." + entry))):
            return None
    names = (f"{scheme}_proxy", f"{scheme.upper()}_PROXY", "all_proxy", "ALL_PROXY")
    proxy = next((os.environ[n] for n in names if os.environ.get(n)), None)
    if not proxy:
        return None
    url = urlsplit(proxy if "://" in proxy else "http://" + proxy)
    return (url.hostname or "", url.port or (443 if url.scheme == "https" else 80)) if url.hostname else None


_HUB_STATUS: dict[str, str | None] = {}


def hub_unreachable(timeout: float = 1.5) -> str | None:
    """``None`` when the Hugging Face Hub looks reachable, else why not: an offline switch is
    set (``HF_HUB_OFFLINE`` ...), or no TCP connection to ``HF_ENDPOINT`` (default
    huggingface.co:443), or to the proxy the environment puts in front of it, opens within
    ``timeout`` seconds. Remembered for the process."""
    if "status" in _HUB_STATUS:
        return _HUB_STATUS["status"]
    for var in _OFFLINE_VARS:
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return f"{var} is set"
    host, port = _hub_endpoint()
    scheme = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").scheme or "https"
    proxy = _proxy_for(host, scheme)
    target = proxy or (host, port)
    where = f"the proxy {target[0]}:{target[1]}" if proxy else f"{host}:{port}"
    result: dict[str, str | None] = {}

    def connect() -> None:  # name resolution ignores socket timeouts: run it where we can stop waiting
        try:
            with socket.create_connection(target, timeout=timeout):
                result["status"] = None
        except OSError as exc:
            result["status"] = f"cannot connect to {where} ({type(exc).__name__}: {exc})"

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(timeout + 0.5)
    status = result["status"] if "status" in result else f"no answer from {where} within {timeout:g} s"
    _HUB_STATUS["status"] = status
    return status


def go_offline() -> None:
    """Switch ``huggingface_hub``, ``datasets`` and ``transformers`` to offline mode in this
    process (the environment variables, and the constants of those already imported), so a
    load that needs the network fails at once instead of retrying. :func:`hub_unreachable`
    keeps reporting the reason it found before."""
    hub_unreachable()
    for var in _OFFLINE_VARS:
        os.environ[var] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    config = sys.modules.get("datasets.config")
    if config is not None:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            if hasattr(config, name):
                setattr(config, name, True)


def _hf_home() -> Path:
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")


def hub_dataset_cached(repo_id: str) -> bool:
    """Whether Hub dataset ``repo_id`` (``"org/name"``) is in a local cache (the Hub cache, or
    ``datasets``' own), so it may load offline."""
    hub = Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or _hf_home() / "hub")
    if (hub / ("datasets--" + repo_id.replace("/", "--"))).is_dir():
        return True
    ds_cache = Path(os.environ.get("HF_DATASETS_CACHE") or _hf_home() / "datasets")
    return (ds_cache / repo_id.replace("/", "___")).is_dir()
