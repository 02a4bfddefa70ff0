"""``RunSpec``: the one vocabulary of a run, in Python, YAML and on the command line.

A run is envs x policy x allocator x predictor x advantage x budget x seed. Every entry
point (``trace-gym bench``, a leaderboard suite, ``trace-gym rollout``, ``trace-gym train``)
reads these same fields under these same names:

=====================  ==========================================================================
field                  meaning
=====================  ==========================================================================
``envs``               registered env ids with constructor kwargs (``"MathCalc-v0"`` is short for
                       ``"trace_gym/MathCalc-v0"``)
``policy``             a registered policy backend with its kwargs (``"sim"``, ``"hf:model=tiny"``)
``allocator``          a registered allocator with options: ``"trace:stage1=uniform"`` or
                       ``{name: trace, kwargs: {stage1: uniform}}`` (the two forms are equal)
``predictor``          a registered predictor, same two forms; unset: the allocator's own
                       ``default_predictor``; ``"none"``: no predictor
``advantage``          a registered advantage estimator, same two forms (``"trace:scale=group"``);
                       unset: the allocator's own ``advantage``
``budget.trajectories`` M, trajectories per step (bare rollouts plus branch continuations)
``budget.prompts``     B, candidate prompts offered to the allocator per step
``budget.root_fraction`` share of M spent in stage 1
``budget.min_per_prompt`` m_min, fewest stage-1 rollouts of a selected prompt
``budget.max_per_prompt`` cap on one prompt's stage-1 rollouts (unset: none)
``budget.group_size``  G, rollouts per prompt of fixed-group allocators (grpo, dapo, pcl)
``seed``               seeds the candidates, the allocator, the predictor and sampling
=====================  ==========================================================================

:func:`resolve` is the single place where an allocator's defaults (its predictor, its
advantage, the run's seed) are filled in; :class:`~trace_gym.step.Step` runs the result.
"""

from __future__ import annotations

import difflib
import inspect
import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trace_gym.allocation.budget import Budget
from trace_gym.allocation.allocator import Allocator, make_allocator
from trace_gym.predictors.base import Predictor, make_predictor

__all__ = ["BudgetSpec", "ComponentSpec", "EnvSpec", "Resolved", "RunSpec", "check_options", "env_id", "resolve", "row_label"]

ENV_NAMESPACE = "trace_gym"


def env_id(name: str) -> str:
    """A full env id: ``"MathCalc-v0"`` -> ``"trace_gym/MathCalc-v0"``; ids with a namespace unchanged."""
    name = name.strip()
    return name if "/" in name else f"{ENV_NAMESPACE}/{name}"


def parse_assignments(items: list[str], what: str) -> dict[str, Any]:
    """``["levels=[1,2]", "data_files=x.jsonl"]`` -> ``{"levels": [1, 2], "data_files": "x.jsonl"}``.
    Values are read as JSON where they parse (numbers, booleans, lists), else kept as strings;
    an item without ``key=`` raises ``ValueError`` naming ``what``."""
    kwargs: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what}: options are key=value, got {item!r}")
        try:
            kwargs[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key.strip()] = value
    return kwargs


def parse_options(text: str, what: str = "component") -> tuple[str, dict[str, Any]]:
    """``"trace:stage1=uniform:k_max=4"`` -> ``("trace", {"stage1": "uniform", "k_max": 4})``
    (option values as in :func:`parse_assignments`)."""
    name, *opts = text.strip().split(":")
    if not name:
        raise ValueError(f"{what} {text!r}: the name is empty")
    return name, parse_assignments(opts, f"{what} {text!r}")


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ComponentSpec(_Spec):
    """A registered component and its options. Written ``"name:key=value:..."`` or
    ``{name: ..., kwargs: {...}}``; both forms validate to the same spec, and ``str(spec)``
    gives the string form back."""

    name: str = Field(description="Registered name.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Constructor options.")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data: Any) -> Any:
        if isinstance(data, str):
            name, kwargs = parse_options(data)
            return {"name": name, "kwargs": kwargs}
        return data

    def __str__(self) -> str:
        opts = "".join(f":{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in self.kwargs.items())
        return self.name + opts


class EnvSpec(_Spec):
    """One env of a run: a registered id, constructor kwargs, and its share of the prompts.
    Written ``"MathCalc-v0"`` or ``{id: trace_gym/MathCalc-v0, kwargs: {...}, weight: 1}``."""

    id: str = Field(description="Registered env id, e.g. trace_gym/MathCalc-v0 (the trace_gym/ prefix may be omitted).")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Constructor arguments (levels, max_turns, ...).")
    weight: float = Field(1.0, gt=0, description="Share of the prompts drawn from this env.")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"id": env_id(data)}
        if isinstance(data, dict) and isinstance(data.get("id"), str):
            return {**data, "id": env_id(data["id"])}
        return data


class BudgetSpec(_Spec):
    """What one step may spend: M trajectories over B candidate prompts (PAPER.md sec. 3)."""

    trajectories: int = Field(ge=1, description="M: trajectories per step (bare rollouts plus branch continuations).")
    prompts: int = Field(ge=1, description="B: candidate prompts offered to the allocator per step.")
    root_fraction: float = Field(0.5, gt=0.0, le=1.0, description="Share of M spent on bare rollouts in stage 1.")
    min_per_prompt: int = Field(2, ge=1, description="m_min: fewest stage-1 rollouts of a selected prompt.")
    max_per_prompt: int | None = Field(None, ge=1, description="Cap on one prompt's stage-1 rollouts (None: none).")
    group_size: int = Field(8, ge=1, description="G: rollouts per prompt of fixed-group allocators (grpo, dapo, pcl).")

    @model_validator(mode="after")
    def _check(self) -> "BudgetSpec":
        if self.max_per_prompt is not None and self.max_per_prompt < self.min_per_prompt:
            raise ValueError(f"max_per_prompt ({self.max_per_prompt}) must be at least min_per_prompt ({self.min_per_prompt})")
        return self

    def to_budget(self) -> Budget:
        """The :class:`~trace_gym.allocation.allocator.Budget` one step spends."""
        return Budget(trajectories=self.trajectories, root_fraction=self.root_fraction, min_per_prompt=self.min_per_prompt,
                      max_per_prompt=self.max_per_prompt, group_size=self.group_size)


class RunSpec(_Spec):
    """A run: envs, policy, allocator, predictor, advantage, budget and seed (see the module
    docstring for every field). ``predictor`` and ``advantage`` left unset mean the
    allocator's own; :func:`resolve` fills them in."""

    envs: list[EnvSpec] = Field(min_length=1, description="Envs the prompts come from.")
    policy: ComponentSpec = Field(description="Policy backend and its options (sim, hf:model=tiny, openai:base_url=...).")
    allocator: ComponentSpec = Field(description="Allocator and its options (trace:stage1=uniform).")
    predictor: ComponentSpec | None = Field(None, description="Predictor of V(H); unset: the allocator's own; 'none': no predictor.")
    advantage: ComponentSpec | None = Field(None, description="Advantage estimator; unset: the allocator's own.")
    budget: BudgetSpec = Field(description="M, B and the per-prompt limits.")
    seed: int = Field(0, description="Seeds candidates, allocator, predictor and sampling.")

    @model_validator(mode="after")
    def _check_names(self) -> "RunSpec":
        check_allocator(self.allocator)
        if self.predictor is not None and self.predictor.name != "none":
            check_predictor(self.predictor)
        if self.advantage is not None:
            check_advantage(self.advantage)
        return self


# ----------------------------------------------------------------------------- checks


def _signature_options(factory: Any, skip: int = 0) -> tuple[list[str], bool]:
    """Keyword options ``factory`` takes, and whether it takes any (``**kwargs``)."""
    try:
        params = list(inspect.signature(factory).parameters.values())[skip:]
    except (TypeError, ValueError):
        return [], True
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def check_options(kind: str, spec: ComponentSpec, factory: Any, *, skip: int = 0, ignore: tuple[str, ...] = ()) -> None:
    """Raise ``ValueError`` naming an option ``factory`` does not take, with the ones it does."""
    allowed, open_ended = _signature_options(factory, skip)
    if open_ended:
        return
    for key in spec.kwargs:
        if key in ignore:
            continue
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{kind} {str(spec)!r}: unknown option {key!r}{hint} (options: {', '.join(allowed) or 'none'})")


RUN_OPTIONS = ("predictor", "advantage")
"""Options an allocator spec may carry for its run rather than for the allocator:
``"knapsack:predictor=hashed"`` gives that allocator another predictor than its own."""


def check_allocator(spec: ComponentSpec) -> type:
    """The allocator class of ``spec``; unknown names and options raise ``ValueError``."""
    from trace_gym.allocation.allocator import ALLOCATORS

    cls = ALLOCATORS.get(spec.name)
    check_options("allocator", spec, cls, ignore=RUN_OPTIONS)
    for key in RUN_OPTIONS:
        if key in spec.kwargs:
            sub = ComponentSpec.model_validate(spec.kwargs[key])
            if key == "predictor" and sub.name != "none":
                check_predictor(sub)
            elif key == "advantage":
                check_advantage(sub)
    return cls


def check_predictor(spec: ComponentSpec) -> type:
    """The predictor class of ``spec``; unknown names and options raise ``ValueError``."""
    from trace_gym.predictors.base import PREDICTORS

    cls = PREDICTORS.get(spec.name)
    check_options("predictor", spec, cls)
    return cls


def check_advantage(spec: ComponentSpec) -> None:
    """Unknown estimator names and options raise ``ValueError``."""
    from trace_gym.forest.advantages import resolve_estimator

    resolve_estimator(spec.name, **spec.kwargs)


# ----------------------------------------------------------------------------- resolution


@dataclass
class Resolved:
    """A run's components, built: the allocator, its predictor (None: it uses none), the
    advantage estimator that scores its forests, and the budget."""

    allocator: Allocator
    predictor: Predictor | None
    predictor_spec: ComponentSpec | None
    advantage: ComponentSpec
    budget: Budget


def defaults(allocator: ComponentSpec | str) -> tuple[ComponentSpec | None, ComponentSpec]:
    """``(predictor, advantage)`` an allocator runs with when a run sets neither: its class's
    ``default_predictor`` (None: none) and ``advantage``, unless the allocator spec carries
    ``predictor=``/``advantage=`` options."""
    spec = ComponentSpec.model_validate(allocator)
    cls = check_allocator(spec)
    pred = spec.kwargs.get("predictor", getattr(cls, "default_predictor", None))
    adv = spec.kwargs.get("advantage", getattr(cls, "advantage", "grpo"))
    pred_spec = None if pred in (None, "none") else ComponentSpec.model_validate(pred)
    return pred_spec, ComponentSpec.model_validate(adv)


def row_label(allocator: ComponentSpec | str, *, predictor: ComponentSpec | str | None = None,
              advantage: ComponentSpec | str | None = None, base: str | None = None) -> str:
    """The name a table gives a run of ``allocator`` under a run-wide ``predictor``/``advantage``
    override: ``base`` (default ``str(allocator)``), followed by ``[pred=...]`` when the
    override replaces the allocator's own predictor (as :func:`resolve` applies it) and by
    ``[adv=...]`` when it replaces its own advantage. So a row never carries an allocator's
    plain name (``trace``) while it runs with another predictor or advantage than that
    name's."""
    spec = ComponentSpec.model_validate(allocator)
    label = str(spec) if base is None else base
    own_pred, own_adv = defaults(spec)
    if predictor is not None and "predictor" not in spec.kwargs:
        override = ComponentSpec.model_validate(predictor)
        applies = override.name == "none" or own_pred is not None
        if applies and override != (own_pred or ComponentSpec(name="none")):
            label += f"[pred={override}]"
    if advantage is not None and "advantage" not in spec.kwargs:
        override = ComponentSpec.model_validate(advantage)
        if override != own_adv:
            label += f"[adv={override}]"
    return label


def resolve(allocator: ComponentSpec | str, budget: BudgetSpec, *, predictor: ComponentSpec | str | None = None,
            advantage: ComponentSpec | str | None = None, seed: int = 0) -> Resolved:
    """Build a run's allocator, predictor and advantage: the one place defaults are filled in.

    ``predictor``/``advantage`` None take the allocator's own (:func:`defaults`); a predictor
    named ``"none"`` means none. A run's ``predictor`` replaces the allocator's own only for an
    allocator that uses one; ``predictor=``/``advantage=`` options in the allocator's spec
    (``"knapsack:predictor=hashed"``) win over the run's. An allocator or predictor whose constructor takes ``seed``
    gets the run's seed unless its spec sets one.
    """
    spec = ComponentSpec.model_validate(allocator)
    cls = check_allocator(spec)
    own_pred, own_adv = defaults(spec)
    pred_spec = own_pred
    if predictor is not None and "predictor" not in spec.kwargs:
        override = ComponentSpec.model_validate(predictor)
        if override.name == "none" or own_pred is not None:  # an allocator that predicts nothing gets no predictor
            pred_spec = override
    if pred_spec is not None and pred_spec.name == "none":
        pred_spec = None
    adv_spec = own_adv if advantage is None or "advantage" in spec.kwargs else ComponentSpec.model_validate(advantage)
    check_advantage(adv_spec)
    kwargs = {k: v for k, v in spec.kwargs.items() if k not in RUN_OPTIONS}
    allowed, open_ended = _signature_options(cls)
    if "seed" in allowed and "seed" not in kwargs:
        kwargs["seed"] = seed
    built = make_allocator(spec.name, **kwargs)
    pred = None
    if pred_spec is not None:
        pred_cls = check_predictor(pred_spec)
        pred_kwargs = dict(pred_spec.kwargs)
        if "seed" in _signature_options(pred_cls)[0] and "seed" not in pred_kwargs:
            pred_kwargs["seed"] = seed
        pred = make_predictor(pred_spec.name, **pred_kwargs)
    return Resolved(allocator=built, predictor=pred, predictor_spec=pred_spec, advantage=adv_spec, budget=budget.to_budget())


def resolve_run(spec: RunSpec) -> Resolved:
    """:func:`resolve` for a :class:`RunSpec`."""
    return resolve(spec.allocator, spec.budget, predictor=spec.predictor, advantage=spec.advantage, seed=spec.seed)
