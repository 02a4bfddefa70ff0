"""Suite specs: which envs, allocators, seeds, budget, policy and steps a benchmark runs.

A suite is a YAML file (``configs/suites/quick.yaml`` and friends) validated by the
pydantic models below. A suite holds *tracks*:

* ``allocation``: the policy is fixed; every allocator spends the same budget on the same
  candidate prompts, and the leaderboard ranks them by effective sample ratio (the
  budget-normalised contrast metric), with effective ratio, predictor calibration and spend
  beside it.
* ``training``: the same trainer runs once per allocator at the same trajectory budget; the
  leaderboard ranks by held-out accuracy and plots it against trajectories and tokens spent.

Every name a suite mentions (environment ids, allocators, predictors, policy backends) is
checked against the registries when the suite is loaded, and a bad key fails with its
location in the file and a hint (``tracks[1].allocators[0]: unknown allocator 'trac'; did you
mean 'trace'?``), before anything runs.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trace_gym.run import BudgetSpec, ComponentSpec, check_allocator, check_predictor, env_id

SUITE_DIRS: tuple[Path, ...] = (Path(__file__).resolve().parents[2] / "configs" / "suites", Path("configs") / "suites")
"""Where preset suites are looked up by name (the repository's ``configs/suites`` and the
working directory's)."""


class SuiteError(ValueError):
    """A suite file that cannot be loaded; the message names the offending key and a hint."""


def _did_you_mean(name: str, choices: list[str] | set[str]) -> str:
    close = difflib.get_close_matches(str(name), sorted(choices), n=3, cutoff=0.5)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""


def _check_registered(kind: str, name: str) -> str:
    """Raise ``ValueError`` with a did-you-mean hint unless ``name`` is a registered ``kind``."""
    if kind == "environment":
        from trace_gym.registry import env_ids

        known = env_ids()
    elif kind == "allocator":
        from trace_gym.allocation.allocator import ALLOCATORS

        known = ALLOCATORS.names()
    elif kind == "predictor":
        from trace_gym.predictors.base import PREDICTORS

        known = PREDICTORS.names()
    elif kind == "policy":
        from trace_gym.policies.base import POLICIES

        known = POLICIES.names()
    elif kind == "advantage estimator":
        from trace_gym.forest.advantages import ADVANTAGES

        known = ADVANTAGES.names()
    else:  # pragma: no cover - programming error
        raise AssertionError(kind)
    if name not in known:
        raise ValueError(f"unknown {kind} {name!r}{_did_you_mean(name, known)} (registered: {', '.join(known) or 'none'})")
    return name


def _check_estimator(spec: str | None) -> str | None:
    if spec is not None:
        _check_registered("advantage estimator", spec.split(":", 1)[0])  # options: "trace:scale=group"
        from trace_gym.forest.advantages import resolve_estimator

        resolve_estimator(spec)  # the options the estimator takes
    return spec


def _check_predictor_spec(v: ComponentSpec | None) -> ComponentSpec | None:
    if v is not None and v.name != "none":
        _check_registered("predictor", v.name)
        check_predictor(v)
    return v


def _check_advantage_spec(v: ComponentSpec | None) -> ComponentSpec | None:
    if v is not None:
        _check_estimator(str(v))
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EnvEntry(_Strict):
    """One environment of a track: a registered id, constructor kwargs, and a display label."""

    id: str
    kwargs: dict[str, Any] = Field(default_factory=dict)
    label: str | None = None

    @field_validator("id")
    @classmethod
    def _registered(cls, v: str) -> str:
        return _check_registered("environment", env_id(v))

    @property
    def name(self) -> str:
        """The label shown on the leaderboard (default: the id without its namespace)."""
        return self.label or self.id.split("/")[-1]


class _Overrides(_Strict):
    """The predictor and advantage estimator that a track, or one allocator of it, may set;
    each is checked against its registry when the suite loads."""

    predictor: ComponentSpec | None = None
    advantage: ComponentSpec | None = None

    @field_validator("predictor")
    @classmethod
    def _predictor(cls, v: ComponentSpec | None) -> ComponentSpec | None:
        return _check_predictor_spec(v)

    @field_validator("advantage")
    @classmethod
    def _estimator(cls, v: ComponentSpec | None) -> ComponentSpec | None:
        return _check_advantage_spec(v)


class AllocatorEntry(_Overrides):
    """One allocator of a track, written as everywhere else (``"trace:stage1=uniform"`` or
    ``{name: trace, kwargs: {stage1: uniform}}``), with an optional display label and,
    optionally, the predictor it runs with (default: the track's, else the allocator's own;
    ``"none"`` for no predictor) and the advantage estimator (``"trace:scale=group"``;
    default: the track's, else the allocator's own)."""

    name: str
    kwargs: dict[str, Any] = Field(default_factory=dict)
    label: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data: Any) -> Any:
        if isinstance(data, str):
            spec = ComponentSpec.model_validate(data)
            return {"name": spec.name, "kwargs": dict(spec.kwargs)}
        return data

    @field_validator("name")
    @classmethod
    def _registered(cls, v: str) -> str:
        return _check_registered("allocator", v)

    @model_validator(mode="after")
    def _options(self) -> "AllocatorEntry":
        check_allocator(self.spec)  # the options the allocator takes
        return self

    @property
    def spec(self) -> ComponentSpec:
        """The allocator as a :class:`~trace_gym.run.ComponentSpec`."""
        return ComponentSpec(name=self.name, kwargs=dict(self.kwargs))

    @property
    def key(self) -> str:
        """The row name on the leaderboard: the label, else ``name(k=v,...)``, with
        ``[pred=...]``/``[adv=...]`` where the entry sets its own predictor or estimator."""
        if self.label:
            return self.label
        key = self.name
        if self.kwargs:
            key += "(" + ",".join(f"{k}={v}" for k, v in sorted(self.kwargs.items())) + ")"
        if self.predictor is not None:
            key += f"[pred={self.predictor}]"
        return key + (f"[adv={self.advantage}]" if self.advantage else "")


class WarmStartSpec(_Strict):
    """An SFT warm start on ``demonstrate()`` trajectories before the policy is used.

    ``config`` is a trainer config file (``configs/quick.yaml``); ``overrides`` replace its
    fields. The trainer caches the warmed checkpoint, so later runs reuse it.
    """

    method: Literal["sft"] = "sft"
    config: str | None = None
    overrides: dict[str, Any] = Field(default_factory=dict)


class PolicySpec(_Strict):
    """The policy of a track: a registered backend (``sim``, ``hf``, ``vllm``, ``openai``),
    the model (an alias such as ``tiny`` or ``smollm2-135m``, or a path), backend kwargs,
    sampling settings, and an optional warm start."""

    name: str
    model: str | None = None
    kwargs: dict[str, Any] = Field(default_factory=dict)
    max_new_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    warm_start: WarmStartSpec | None = None

    @field_validator("name")
    @classmethod
    def _registered(cls, v: str) -> str:
        return _check_registered("policy", v)


class EvalSpec(_Strict):
    """Held-out evaluation of a training track: ``tasks`` held-out tasks, ``k`` samples each
    (mean@k and pass@k), every ``every`` steps and after the last one."""

    split: Literal["test", "validation"] = "test"
    tasks: int = Field(default=64, ge=1)
    k: int = Field(default=1, ge=1)
    every: int = Field(default=5, ge=1)


class TrainerSpec(_Strict):
    """The trainer of a training track: a trainer config file and field overrides."""

    config: str | None = None
    overrides: dict[str, Any] = Field(default_factory=dict)


def _entries(v: Any, entry: type[BaseModel], key: str) -> Any:
    """Accept ``"name"`` as shorthand for ``{key: "name"}`` (allocators parse their own
    ``"name:key=value"`` form), and one entry where a list is expected."""
    if isinstance(v, (str, dict)):
        v = [v]
    if isinstance(v, list) and entry is not AllocatorEntry:
        return [{key: x} if isinstance(x, str) else x for x in v]
    return v


class TrackSpec(_Overrides):
    """One track of a suite: envs x allocators x seeds at one budget, policy and step count.

    ``seeds`` defaults to the suite's. ``predictor`` (``"hashed:lr=0.03"``) overrides
    the predictor of every allocator (default: each allocator's own ``default_predictor``;
    ``"none"``: no predictor); it is built fresh for each run and trained online on the
    run's (history, backed-up value) pairs. ``advantage`` overrides the estimator under
    which a sample counts as effective (default: the one matching each allocator).
    Training tracks add ``trainer`` and ``eval``.
    """

    name: str
    kind: Literal["allocation", "training"]
    envs: list[EnvEntry] = Field(min_length=1)
    allocators: list[AllocatorEntry] = Field(min_length=1)
    policy: PolicySpec
    budget: BudgetSpec
    steps: int = Field(ge=1)
    seeds: list[int] | None = None
    trainer: TrainerSpec | None = None
    eval: EvalSpec | None = None

    @field_validator("envs", mode="before")
    @classmethod
    def _env_shorthand(cls, v: Any) -> Any:
        return _entries(v, EnvEntry, "id")

    @field_validator("allocators", mode="before")
    @classmethod
    def _alloc_shorthand(cls, v: Any) -> Any:
        return _entries(v, AllocatorEntry, "name")

    @model_validator(mode="after")
    def _consistent(self) -> "TrackSpec":
        keys = [a.key for a in self.allocators]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"allocators: {dup} appear more than once; give them distinct `label`s")
        names = [e.name for e in self.envs]
        dup = sorted({k for k in names if names.count(k) > 1})
        if dup:
            raise ValueError(f"envs: {dup} appear more than once; give them distinct `label`s")
        if self.kind == "training" and self.eval is None:
            raise ValueError("a training track needs an `eval` section (held-out accuracy is what it ranks by)")
        if self.kind == "allocation" and (self.trainer is not None or self.eval is not None):
            raise ValueError("`trainer` and `eval` belong to training tracks; this track is kind: allocation")
        return self


class SuiteSpec(_Strict):
    """A benchmark suite: a name, default seeds, and its tracks."""

    suite: str
    description: str = ""
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    tracks: list[TrackSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_tracks(self) -> "SuiteSpec":
        names = [t.name for t in self.tracks]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"tracks: names {dup} appear more than once")
        return self

    def track_seeds(self, track: TrackSpec) -> list[int]:
        """The seeds a track runs (its own, else the suite's)."""
        return list(track.seeds if track.seeds is not None else self.seeds)

    def select(self, tracks: list[str] | None) -> "SuiteSpec":
        """The same suite restricted to the named tracks (a hint on an unknown name)."""
        if not tracks:
            return self
        names = [t.name for t in self.tracks]
        for n in tracks:
            if n not in names:
                raise SuiteError(f"unknown track {n!r}{_did_you_mean(n, names)} (this suite has: {', '.join(names)})")
        return self.model_copy(update={"tracks": [t for t in self.tracks if t.name in tracks]})


# ----------------------------------------------------------------------------- loading


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model whose field list applies at ``loc`` (for did-you-mean on extra keys)."""
    model: Any = SuiteSpec
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        ann = field.annotation
        # unwrap list[X] / X | None down to a model class
        for _ in range(3):
            args = getattr(ann, "__args__", None)
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                break
            if not args:
                break
            ann = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), args[0])
        model = ann
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def format_validation_error(exc: ValidationError, source: str) -> str:
    """Turn pydantic's errors into ``source: key: problem; hint`` lines."""
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        # drop pydantic's "function-after[...]"-style tags
        loc = tuple(p for p in loc if not (isinstance(p, str) and "[" in p and "(" not in p and p.endswith("]")))
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            fields = sorted(parent.model_fields) if parent else []
            msg = f"unknown key {loc[-1]!r}{_did_you_mean(str(loc[-1]), fields)}" + (
                f" (allowed: {', '.join(fields)})" if fields else "")
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif err["type"] == "literal_error":
            msg = f"{msg} (got {err.get('input')!r})"
            expected = (err.get("ctx") or {}).get("expected", "")
            choices = [c.strip().strip("'") for c in str(expected).replace(" or ", ",").split(",") if c.strip()]
            msg += _did_you_mean(str(err.get("input")), choices)
        lines.append(f"{source}: {_loc(loc)}: {msg}")
    return "\n".join(lines)


def parse_suite(data: Any, source: str = "<suite>") -> SuiteSpec:
    """Validate a suite given as plain data (what ``yaml.safe_load`` returns)."""
    if not isinstance(data, dict):
        raise SuiteError(f"{source}: a suite is a mapping with keys suite, seeds, tracks (got {type(data).__name__})")
    try:
        return SuiteSpec.model_validate(data)
    except ValidationError as exc:
        raise SuiteError(format_validation_error(exc, source)) from None


def preset_names() -> list[str]:
    """Names of the preset suites found in :data:`SUITE_DIRS`."""
    return sorted({p.stem for d in SUITE_DIRS if d.is_dir() for p in d.glob("*.yaml")})


def resolve_suite_path(name_or_path: str) -> Path:
    """A suite file from a preset name (``quick``) or a path; a hint on a typo."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise SuiteError(f"suite file {str(p)!r} does not exist")
        return p
    for d in SUITE_DIRS:
        cand = d / f"{name_or_path}.yaml"
        if cand.is_file():
            return cand
    names = preset_names()
    raise SuiteError(f"unknown suite {name_or_path!r}{_did_you_mean(name_or_path, names)} "
                     f"(presets: {', '.join(names) or 'none'}; or give a path to a YAML file)")


def load_suite(name_or_path: str) -> SuiteSpec:
    """Load and validate a suite by preset name or file path; raises :class:`SuiteError`."""
    path = resolve_suite_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SuiteError(f"{path}: not valid YAML: {exc}") from None
    return parse_suite(data, str(path))


def config_hash(obj: Any) -> str:
    """A short, stable hash of a JSON-able config (sorted keys)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


__all__ = [
    "AllocatorEntry", "BudgetSpec", "EnvEntry", "EvalSpec", "PolicySpec", "SUITE_DIRS", "SuiteError", "SuiteSpec",
    "TrackSpec", "TrainerSpec", "WarmStartSpec", "config_hash", "format_validation_error", "load_suite",
    "parse_suite", "preset_names", "resolve_suite_path",
]
