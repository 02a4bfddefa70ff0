"""Function calling on the Berkeley Function-Calling Leaderboard (BFCL), judged by BFCL's own checkers.

Two environments over the data that the ``bfcl-eval`` package ships (the ``trace-gym[bfcl]`` extra):

* ``trace_gym/BFCL-v0`` -- the single-turn AST categories ``simple`` (BFCL's ``simple_python``),
  ``multiple``, ``parallel``, ``parallel_multiple`` and ``irrelevance``. The task's functions are
  the episode's tool schemas; the policy answers with ``<tool_call>`` blocks, which are turned into
  BFCL's model-output format (``[{name: {arg: value}}, ...]``, what BFCL's Qwen/Hermes FC handler
  decodes) and judged by BFCL's ``ast_checker``. An irrelevance task is solved by calling no
  function (for example a plain ``<answer>``). The first well-formed turn is judged and ends the
  episode; a turn the env cannot parse gets an error observation and another try.
* ``trace_gym/BFCLMultiTurn-v0`` -- ``multi_turn_base``: BFCL's API simulators (GorillaFileSystem,
  MathAPI, MessageAPI, TwitterAPI, TicketAPI, TradingBot, TravelAPI, VehicleControlAPI) are the
  stateful tools; their instances live in the episode state, so a snapshot carries the file
  system, the inbox, the bookings. An ``<answer>`` ends a user turn: the next user message comes
  back as the observation with ``info["role"] == "user"``. After the last user turn the episode
  is judged by BFCL's ``multi_turn_checker`` (state and execution-response checks).

Loading BFCL's checker: ``bfcl_eval.eval_checker.ast_eval.ast_checker`` imports
``bfcl_eval.constants.model_config``, which imports every vendor SDK BFCL can drive (openai,
anthropic, ...). The checker reads one name from it, ``MODEL_CONFIG_MAPPING``, and only to look up
``underscore_to_dot`` for the model being judged. Rather than install a dozen SDKs we register a
light stand-in module under that name before importing the checker; it maps our judge name
(:data:`JUDGE_MODEL`) to ``underscore_to_dot=False`` -- function names are matched exactly, dots
included, as for BFCL's Qwen FC models. If the real module is already imported (a process that
also runs BFCL's own pipeline), our entry is added to it instead.
"""

from __future__ import annotations

import ast
import builtins
import copy
import functools
import importlib
import inspect
import itertools
import json
import keyword
import sys
import types
import uuid
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from trace_gym.env.base import AgentEnv, EnvUnavailable, TurnResult
from trace_gym.env.react import ParsedTurn, ToolCall, format_answer, format_tool_call
from trace_gym.task import Split, Task

SINGLE_TURN_CATEGORIES: tuple[str, ...] = ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance")
MULTI_TURN_CATEGORIES: tuple[str, ...] = ("multi_turn_base",)
# Our category names -> BFCL's file/category names (BFCL v4 renamed "simple" to "simple_python").
_BFCL_NAME = {"simple": "simple_python"}
JUDGE_MODEL = "trace-gym"
# What BFCL adds to every function description it shows a model (utils._get_language_specific_hint).
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."
# multi_turn_utils.execute_multi_turn_func_call refuses these names before it evals a call.
_BLOCKED_CALLS = frozenset({"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"})

_INSTALL_HINT = "the BFCL environments need the `bfcl-eval` package: pip install 'trace-gym[bfcl]'"


# ----------------------------------------------------------------------------- loading BFCL


class BFCLUnavailable(EnvUnavailable, ImportError):
    """``bfcl-eval`` (the ``trace-gym[bfcl]`` extra) is not installed. An :class:`EnvUnavailable`
    (registry walkers skip the env) and an ``ImportError`` (what a missing package is)."""


@dataclass(frozen=True)
class _JudgeModelConfig:
    """What BFCL's AST checker reads from a ``ModelConfig``."""

    underscore_to_dot: bool = False


def _install_model_config_stand_in() -> None:
    name = "bfcl_eval.constants.model_config"
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name, "trace-gym stand-in: the names BFCL's checkers read, without vendor SDKs.")
        module.MODEL_CONFIG_MAPPING = {}  # type: ignore[attr-defined]
        sys.modules[name] = module
    module.MODEL_CONFIG_MAPPING.setdefault(JUDGE_MODEL, _JudgeModelConfig(underscore_to_dot=False))  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=None)
def require_bfcl() -> types.SimpleNamespace:
    """Import BFCL's checkers and constants; raise :class:`BFCLUnavailable` when the extra is absent.

    Returns a namespace with ``ast_checker``, ``Language``, ``multi_turn_checker``,
    ``multi_turn_utils`` (the module whose globals the multi-turn checker uses), the
    ``CLASS_FILE_PATH_MAPPING`` / ``MULTI_TURN_FUNC_DOC_FILE_MAPPING`` / ``STATELESS_CLASSES``
    tables, ``GORILLA_TO_OPENAPI``, ``MAXIMUM_STEP_LIMIT``, ``VERSION_PREFIX`` and ``data_dir``.
    """
    try:
        importlib.import_module("bfcl_eval")
    except ImportError as exc:
        raise BFCLUnavailable(_INSTALL_HINT) from exc
    _install_model_config_stand_in()
    from importlib import resources

    from bfcl_eval.constants.category_mapping import VERSION_PREFIX
    from bfcl_eval.constants.default_prompts import MAXIMUM_STEP_LIMIT
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.constants.executable_backend_config import (
        CLASS_FILE_PATH_MAPPING,
        MULTI_TURN_FUNC_DOC_FILE_MAPPING,
        STATELESS_CLASSES,
    )
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    return types.SimpleNamespace(
        ast_checker=ast_checker,
        Language=Language,
        multi_turn_checker=multi_turn_checker,
        multi_turn_utils=multi_turn_utils,
        CLASS_FILE_PATH_MAPPING=CLASS_FILE_PATH_MAPPING,
        MULTI_TURN_FUNC_DOC_FILE_MAPPING=MULTI_TURN_FUNC_DOC_FILE_MAPPING,
        STATELESS_CLASSES=STATELESS_CLASSES,
        GORILLA_TO_OPENAPI=GORILLA_TO_OPENAPI,
        MAXIMUM_STEP_LIMIT=int(MAXIMUM_STEP_LIMIT),
        VERSION_PREFIX=VERSION_PREFIX,
        data_dir=resources.files("bfcl_eval") / "data",
    )


def _read_jsonl(path: Any) -> list[dict[str, Any]]:
    with path.open("r", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@functools.lru_cache(maxsize=None)
def load_category(category: str) -> tuple[tuple[dict[str, Any], Any], ...]:
    """BFCL's entries of one category, each paired with its possible answer (``None`` for
    irrelevance), in BFCL's order. Read once per process."""
    if category not in SINGLE_TURN_CATEGORIES + MULTI_TURN_CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; choose from {SINGLE_TURN_CATEGORIES + MULTI_TURN_CATEGORIES}")
    bfcl = require_bfcl()
    name = _BFCL_NAME.get(category, category)
    prompt_file = bfcl.data_dir / f"{bfcl.VERSION_PREFIX}_{name}.json"
    entries = _read_jsonl(prompt_file)
    if category == "irrelevance":
        return tuple((e, None) for e in entries)
    answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(bfcl.data_dir / "possible_answer" / prompt_file.name)}
    missing = [e["id"] for e in entries if e["id"] not in answers]
    if missing:
        raise ValueError(f"BFCL data is inconsistent: no possible answer for {missing[:3]}")
    return tuple((e, answers[e["id"]]) for e in entries)


@functools.lru_cache(maxsize=None)
def multi_turn_function_docs(class_name: str) -> tuple[dict[str, Any], ...]:
    """The function docs BFCL shows a model for one API simulator class."""
    bfcl = require_bfcl()
    return tuple(_read_jsonl(bfcl.data_dir / "multi_turn_func_doc" / bfcl.MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]))


def _split_of(bfcl_id: str) -> Split:
    # A fixed hash of BFCL's id: the same task always lands in the same split (70/10/20).
    bucket = zlib.crc32(bfcl_id.encode()) % 10
    return "test" if bucket < 2 else "validation" if bucket == 2 else "train"


def _user_text(messages: list[dict[str, Any]]) -> str:
    return "\n".join(str(m.get("content", "")) for m in messages)


# ----------------------------------------------------------------------------- tool schemas


def _cast_property(prop: dict[str, Any], mapping: dict[str, str]) -> dict[str, Any]:
    # Mirrors BFCL's model_handler.utils._cast_to_openai_type, applied at every nesting level.
    btype = prop.get("type")
    if btype == "float":
        prop["format"] = "float"
        if isinstance(prop.get("description"), str):
            prop["description"] += " This is a float type value."
    prop["type"] = mapping.get(btype, "string") if isinstance(btype, str) else "string"
    if isinstance(prop.get("properties"), dict):
        prop["properties"] = {k: _cast_property(v, mapping) for k, v in prop["properties"].items() if isinstance(v, dict)}
    if isinstance(prop.get("items"), dict):
        prop["items"] = _cast_property(prop["items"], mapping)
    return prop


def to_tool_schema(function_doc: dict[str, Any]) -> dict[str, Any]:
    """A BFCL function doc as the JSON-schema function spec chat templates take
    (``{"type": "function", "function": {name, description, parameters}}``).

    BFCL's types become JSON-schema types through BFCL's own ``GORILLA_TO_OPENAPI`` table
    (``dict`` -> ``object``, ``float`` -> ``number`` with ``format: float``, ``tuple`` -> ``array``,
    ``any`` -> ``string``), nested properties and items included; the description gets BFCL's
    Python hint. Names keep their dots. The input is not modified.
    """
    mapping = require_bfcl().GORILLA_TO_OPENAPI
    doc = copy.deepcopy(function_doc)
    params = doc.get("parameters") if isinstance(doc.get("parameters"), dict) else {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    parameters = dict(params)
    parameters["type"] = "object"
    parameters["properties"] = {k: _cast_property(v, mapping) for k, v in props.items() if isinstance(v, dict)}
    parameters.setdefault("required", [])
    spec: dict[str, Any] = {
        "name": str(doc.get("name", "")),
        "description": str(doc.get("description", "")) + PYTHON_HINT,
        "parameters": parameters,
    }
    if "response" in doc:  # multi-turn docs describe what a call returns; BFCL passes it on too
        spec["response"] = doc["response"]
    return {"type": "function", "function": spec}


# ----------------------------------------------------------------------------- single-turn verdicts


def _checker_category(task: Task) -> str:
    category = task.metadata["category"]
    return _BFCL_NAME.get(category, category)


def ast_verdict(task: Task, calls: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """BFCL's verdict on ``calls`` (BFCL's decoded format ``[{name: {arg: value}}, ...]``) for a
    single-turn ``task``: ``{"valid": bool, "error": [...], "error_type": str}``.

    Non-irrelevance categories go through BFCL's ``ast_checker`` exactly as its evaluator calls it
    (the raw function docs, the possible answer, Python, the category). Irrelevance is BFCL's
    relevance rule: correct iff no function is called. Should the checker raise on an output it
    was not written for, the verdict is invalid with ``error_type="checker_exception"``.
    """
    if task.metadata.get("category") == "irrelevance":
        if calls:
            return {"valid": False, "error": ["Valid syntax. Successfully decode AST when it should not."],
                    "error_type": "irrelevance_error:decoder_success"}
        return {"valid": True, "error": []}
    bfcl = require_bfcl()
    try:
        result = bfcl.ast_checker(
            task.metadata["functions"], calls, task.ground_truth, bfcl.Language.PYTHON, _checker_category(task), JUDGE_MODEL
        )
    except Exception as exc:  # the checker assumes well-typed outputs; anything else is a wrong answer
        return {"valid": False, "error": [f"BFCL's checker raised {type(exc).__name__}: {exc}"], "error_type": "checker_exception"}
    return {"valid": bool(result.get("valid")), "error": list(result.get("error", [])), "error_type": result.get("error_type", "")}


def _allowed(values: list[Any]) -> list[Any]:
    return [v for v in values if v != ""]


def _gold_value(value: Any) -> Any:
    # A possible answer lists allowed values; dict values list allowed values per key.
    if isinstance(value, dict):
        return {k: _allowed(v)[0] for k, v in value.items() if isinstance(v, list) and _allowed(v)}
    if isinstance(value, list) and value and all(isinstance(d, dict) for d in value):
        return [_gold_value(d) for d in value]
    return value


def _param_options(allowed: list[Any]) -> list[tuple[bool, Any]]:
    opts = [(True, _gold_value(v)) for v in _allowed(allowed)]
    if "" in allowed:
        opts.append((False, None))  # optional: omitting it is allowed
    return opts


def gold_calls(task: Task, max_tries: int = 512) -> list[dict[str, dict[str, Any]]]:
    """A correct answer to a single-turn ``task`` in BFCL's decoded format, built from the
    possible answer and confirmed by BFCL's checker.

    For each expected call, parameter choices (each allowed value, or omission when ``""`` is
    allowed) are tried in BFCL's order until BFCL's checker accepts the call; the first choice
    passes for all but a handful of tasks. Irrelevance tasks return ``[]``. Raises
    ``ValueError`` when no combination passes within ``max_tries``.
    """
    if task.metadata.get("category") == "irrelevance":
        return []
    bfcl = require_bfcl()
    functions = task.metadata["functions"]
    out: list[dict[str, dict[str, Any]]] = []
    for expected in task.ground_truth:
        (name, params), = expected.items()
        doc = next((f for f in functions if f.get("name") == name), None)
        names = list(params)
        found = None
        for i, combo in enumerate(itertools.product(*(_param_options(params[p]) for p in names))):
            if i >= max_tries:
                break
            call = {name: {p: v for p, (use, v) in zip(names, combo) if use}}
            try:
                ok = doc is not None and bfcl.ast_checker([doc], [call], [expected], bfcl.Language.PYTHON, "simple", JUDGE_MODEL)["valid"]
            except Exception:
                ok = False
            if ok:
                found = call
                break
        if found is None:
            raise ValueError(f"{task.id}: no answer built from BFCL's possible answer passes BFCL's checker")
        out.append(found)
    if not ast_verdict(task, out)["valid"]:
        raise ValueError(f"{task.id}: the calls built from BFCL's possible answer fail BFCL's checker together")
    return out


def _error_text(verdict: dict[str, Any]) -> str:
    errors = verdict.get("error") or []
    first = errors[0] if errors else ""
    if not isinstance(first, str):
        first = json.dumps(first, ensure_ascii=False, default=str)
    kind = verdict.get("error_type", "")
    return f"BFCL's checker rejected the answer ({kind}): {first}".strip()


# ----------------------------------------------------------------------------- task sources


class BFCLTasks:
    """BFCL's single-turn tasks of the chosen categories as a :class:`~trace_gym.task.TaskSource`.

    Each BFCL entry is assigned to a split by a fixed hash of its id (70% train, 10% validation,
    20% test). A task's id is ``"bfcl/<BFCL id>"``; its ``metadata`` holds ``bfcl_id``,
    ``category`` and ``functions`` (BFCL's raw docs, what the checker reads); ``ground_truth`` is
    BFCL's possible answer (``None`` for irrelevance).
    """

    def __init__(self, categories: Sequence[str] = SINGLE_TURN_CATEGORIES):
        unknown = [c for c in categories if c not in SINGLE_TURN_CATEGORIES]
        if unknown or not categories:
            raise ValueError(f"unknown BFCL categories {unknown or list(categories)}; choose from {SINGLE_TURN_CATEGORIES}")
        self.categories = tuple(categories)
        self._tasks: dict[str, list[Task]] = {"train": [], "validation": [], "test": []}
        self._by_id: dict[str, Task] = {}
        for category in self.categories:
            for entry, answer in load_category(category):
                split = _split_of(entry["id"])
                task = Task(
                    id=f"bfcl/{entry['id']}",
                    prompt=_user_text(entry["question"][0]),
                    ground_truth=answer,
                    metadata={"bfcl_id": entry["id"], "category": category, "functions": entry["function"]},
                    split=split,
                )
                self._tasks[split].append(task)
                self._by_id[task.id] = task

    def get(self, index: int, split: Split = "train") -> Task:
        """The ``index``-th task of ``split`` (BFCL's order, categories concatenated)."""
        tasks = self._tasks[split]
        if not 0 <= index < len(tasks):
            raise IndexError(f"BFCL {split} split has {len(tasks)} tasks; index {index} is out of range")
        return tasks[index]

    def size(self, split: Split = "train") -> int:
        """Number of tasks in ``split``."""
        return len(self._tasks[split])

    def by_id(self, task_id: str) -> Task:
        """Look a task up by its id (``bfcl/<BFCL id>``) or by BFCL's id."""
        task = self._by_id.get(task_id) or self._by_id.get(f"bfcl/{task_id}")
        if task is None:
            raise KeyError(f"no BFCL task with id {task_id!r} in categories {self.categories}")
        return task

    def all(self) -> list[Task]:
        """Every task, all splits."""
        return list(self._by_id.values())


class BFCLMultiTurnTasks(BFCLTasks):
    """BFCL's ``multi_turn_base`` tasks. ``prompt`` is the first user message;
    ``metadata["user_turns"]`` all of them; ``initial_config`` and ``involved_classes`` set up
    the simulators; ``ground_truth`` is BFCL's call sequence per user turn."""

    def __init__(self, categories: Sequence[str] = MULTI_TURN_CATEGORIES):
        unknown = [c for c in categories if c not in MULTI_TURN_CATEGORIES]
        if unknown or not categories:
            raise ValueError(f"unknown BFCL multi-turn categories {unknown or list(categories)}; choose from {MULTI_TURN_CATEGORIES}")
        self.categories = tuple(categories)
        self._tasks = {"train": [], "validation": [], "test": []}
        self._by_id = {}
        for category in self.categories:
            for entry, answer in load_category(category):
                split = _split_of(entry["id"])
                turns = [_user_text(t) for t in entry["question"]]
                task = Task(
                    id=f"bfcl/{entry['id']}",
                    prompt=turns[0],
                    ground_truth=answer,
                    metadata={
                        "bfcl_id": entry["id"],
                        "category": category,
                        "user_turns": turns,
                        "initial_config": entry.get("initial_config", {}),
                        "involved_classes": list(entry["involved_classes"]),
                    },
                    split=split,
                )
                self._tasks[split].append(task)
                self._by_id[task.id] = task


@functools.lru_cache(maxsize=None)
def _task_source(kind: str, categories: tuple[str, ...]) -> BFCLTasks:
    return BFCLMultiTurnTasks(categories) if kind == "multi" else BFCLTasks(categories)


def _categories(category: str | Sequence[str] | None, allowed: tuple[str, ...]) -> tuple[str, ...]:
    if category is None or category == "all":
        return allowed
    cats = (category,) if isinstance(category, str) else tuple(category)
    bad = [c for c in cats if c not in allowed]
    if bad or not cats:
        raise ValueError(f"unknown BFCL category {bad or list(cats)}; choose from {allowed} or 'all'")
    return cats


# ----------------------------------------------------------------------------- single-turn env

_SINGLE_TURN_SYSTEM = (
    "You are an expert in composing function calls. You are given a question and a set of functions. "
    "Call the function(s) that answer the question, each as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> "
    "(several calls in one turn if the question needs several). If none of the functions can be used, "
    "say so inside <answer>...</answer> and call nothing. You may think first inside <think>...</think>."
)


class _BFCLEnvBase(AgentEnv):
    """What the single- and multi-turn BFCL envs share: ``category`` (one of the subclass's
    ``categories_allowed``, a list of them, or ``"all"``) picks the tasks from BFCL's data."""

    task_kind: ClassVar[str]
    categories_allowed: ClassVar[tuple[str, ...]]

    def __init__(self, *, category: str | Sequence[str] | None = "all", **kwargs: Any):
        self._bfcl = require_bfcl()
        super().__init__(**kwargs)
        self.categories = _categories(category, self.categories_allowed)
        self._source = _task_source(self.task_kind, self.categories)

    def tasks(self) -> BFCLTasks:
        return self._source


class BFCLEnv(_BFCLEnvBase):
    """``trace_gym/BFCL-v0``: BFCL's single-turn AST categories, judged by BFCL's ``ast_checker``.

    ``category`` is one of :data:`SINGLE_TURN_CATEGORIES`, a list of them, or ``"all"`` (the
    default). Reward is 1 when BFCL's checker accepts the first well-formed turn, else 0; that
    turn ends the episode (``info["bfcl"]`` holds the verdict). Turns that cannot be parsed get an
    error observation and another try, up to ``max_turns`` (default 3). Creating the env without
    ``bfcl-eval`` installed raises ``ImportError`` naming the extra.
    """

    env_id: ClassVar[str] = "trace_gym/BFCL-v0"
    default_max_turns: ClassVar[int] = 3
    system_prompt: ClassVar[str] = _SINGLE_TURN_SYSTEM
    task_kind: ClassVar[str] = "single"
    categories_allowed: ClassVar[tuple[str, ...]] = SINGLE_TURN_CATEGORIES

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The task's BFCL functions as JSON-schema function specs."""
        if self.state is None:
            return []
        return [to_tool_schema(f) for f in self.state.task.metadata.get("functions", [])]

    def score(self, task: Task, answer: str) -> float:
        """Reward of a plain answer (no calls): 1 for irrelevance tasks, else 0."""
        return float(ast_verdict(task, [])["valid"])

    def turn(self, parsed: ParsedTurn, action: str) -> TurnResult:
        assert self.state is not None
        if parsed.error is not None:
            return TurnResult(self.error_observation(parsed.error), info={"parse_error": parsed.error})
        calls = [{c.name: c.arguments} for c in parsed.tool_calls]
        verdict = ast_verdict(self.state.task, calls)
        obs = "" if verdict["valid"] else self.error_observation(_error_text(verdict))
        info = {"bfcl": verdict, "tool_calls": len(calls)}
        if parsed.answer is not None:
            info["answer"] = parsed.answer
        return TurnResult(obs, reward=float(verdict["valid"]), terminated=True, info=info)

    def demonstrate(self, task: Task) -> list[str]:
        """One turn: the gold calls (see :func:`gold_calls`), or a refusal for irrelevance."""
        calls = gold_calls(task)
        if not calls:
            return [format_answer("None of the available functions can do what is asked, so I will not call any.")]
        return ["\n".join(format_tool_call(name, args) for call in calls for name, args in call.items())]


# ----------------------------------------------------------------------------- multi-turn env

_MULTI_TURN_SYSTEM = (
    "You are an assistant that fulfils a user's requests by calling the functions you are given. "
    "Call functions as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> (several per turn if "
    "needed); their results come back to you. When you have done what the user asked (or cannot), "
    "reply to the user inside <answer>...</answer>; the user may then ask for more. "
    "You may think first inside <think>...</think>."
)


def _stringify(result: Any) -> str:
    # execute_multi_turn_func_call's conversion of a return value to the text a model sees.
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except Exception:
            return str(result)
    return str(result)


def call_string(name: str, arguments: dict[str, Any]) -> str:
    """A call in BFCL's executable format, as BFCL's ``convert_to_function_call`` writes it:
    ``name(k1=repr(v1),k2=repr(v2))``."""
    return f"{name}({','.join(f'{k}={v!r}' for k, v in arguments.items())})"


_TYPE_CHECKS: dict[str, Any] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "tuple": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
    "object": lambda v: isinstance(v, dict),
}


def argument_errors(doc: dict[str, Any], arguments: dict[str, Any]) -> list[str]:
    """What is wrong with ``arguments`` for the BFCL function ``doc``: unknown or missing
    parameters, values of the wrong JSON type (array items checked one level deep, as BFCL's
    AST checker does). Empty when the call fits the doc."""
    params = doc.get("parameters", {})
    props: dict[str, Any] = params.get("properties", {})
    errors = [f"unexpected argument {k!r}" for k in arguments if k not in props]
    errors += [f"missing required argument {k!r}" for k in params.get("required", []) if k not in arguments]
    for k, v in arguments.items():
        spec = props.get(k)
        if not isinstance(spec, dict):
            continue
        check = _TYPE_CHECKS.get(spec.get("type", "any"))
        if check is not None and not check(v):
            errors.append(f"{k!r} must be of type {spec['type']}, got {type(v).__name__}")
            continue
        item_check = _TYPE_CHECKS.get(spec.get("items", {}).get("type", "any")) if isinstance(spec.get("items"), dict) else None
        if item_check is not None and isinstance(v, list) and not all(item_check(x) for x in v):
            errors.append(f"the items of {k!r} must be of type {spec['items']['type']}")
    return errors


def _safe_unknown_name(name: str, bfcl: types.SimpleNamespace) -> bool:
    # A name BFCL's replay would eval to a NameError: an ASCII identifier (Python folds other
    # identifiers to NFKC, so "ｏｐｅｎ" would run open) that is no keyword, builtin, private name
    # or global of multi_turn_utils, whose namespace the replay evals in.
    return (
        name.isascii()
        and name.isidentifier()
        and not keyword.iskeyword(name)
        and not name.startswith("_")
        and not name.endswith("_instance")
        and not hasattr(builtins, name)
        and name not in vars(bfcl.multi_turn_utils)
    )


class BFCLMultiTurnEnv(_BFCLEnvBase):
    """``trace_gym/BFCLMultiTurn-v0``: BFCL ``multi_turn_base`` with BFCL's API simulators as
    stateful tools, judged by BFCL's ``multi_turn_checker``.

    Tool calls run on the episode's simulator instances (kept in ``state.tool_state``, so
    snapshots carry them) with BFCL's semantics: a result is shown as BFCL shows it, an exception
    becomes ``"Error during execution: ..."``. Each turn's calls are recorded in BFCL's executable
    format for the checker, which replays them on fresh instances. Two kinds of calls are
    answered with an error and not recorded: calls whose arguments do not fit the function's doc
    (unknown or missing parameters, wrong JSON types; see :func:`argument_errors`) -- BFCL would
    pass them to the simulator untyped -- and calls whose name or argument names could not be
    replayed safely (not identifiers, builtins ...), from which BFCL's replay would get a
    ``NameError``/``SyntaxError`` that changes no state. More than BFCL's ``MAXIMUM_STEP_LIMIT`` (20) steps in one user turn ends the episode
    with reward 0, as BFCL's force-termination does.
    """

    env_id: ClassVar[str] = "trace_gym/BFCLMultiTurn-v0"
    default_max_turns: ClassVar[int] = 64
    system_prompt: ClassVar[str] = _MULTI_TURN_SYSTEM
    task_kind: ClassVar[str] = "multi"
    categories_allowed: ClassVar[tuple[str, ...]] = MULTI_TURN_CATEGORIES

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The function docs of the task's simulator classes as JSON-schema function specs."""
        if self.state is None:
            return []
        return [to_tool_schema(f) for c in self.state.task.metadata["involved_classes"] for f in multi_turn_function_docs(c)]

    def initial_tool_state(self, task: Task) -> dict[str, Any]:
        """Fresh simulator instances loaded with the task's scenario (as BFCL loads them), plus
        the record of calls per user turn."""
        bfcl = self._bfcl
        instances: dict[str, Any] = {}
        for class_name in task.metadata["involved_classes"]:
            module = importlib.import_module(bfcl.CLASS_FILE_PATH_MAPPING[class_name])
            instance = getattr(module, class_name)()
            if class_name not in bfcl.STATELESS_CLASSES:
                instance._load_scenario(copy.deepcopy(task.metadata["initial_config"].get(class_name, {})), long_context=False)
            instances[class_name] = instance
        return {"instances": instances, "record": [[]], "user_turn": 0, "steps": 0}

    def _docs(self) -> dict[str, dict[str, Any]]:
        assert self.state is not None
        return {d["name"]: d for c in self.state.task.metadata["involved_classes"] for d in multi_turn_function_docs(c)}

    def _methods(self) -> dict[str, Any]:
        # Method name -> bound method; a later class wins a name clash, as in BFCL's mapping.
        assert self.state is not None
        table: dict[str, Any] = {}
        for instance in self.state.tool_state["instances"].values():
            for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    table[name] = method
        return table

    def _execute(self, call: ToolCall, methods: dict[str, Any]) -> tuple[str, str | None]:
        """Run one call; return (result text, the call as recorded for the checker or None)."""
        name, args = call.name, call.arguments
        bad_keys = [k for k in args if not (k.isascii() and k.isidentifier() and not keyword.iskeyword(k))]
        if bad_keys:
            return f"Error during execution: invalid argument name(s) {bad_keys!r} for {name!r}.", None
        if name in _BLOCKED_CALLS:
            recorded = call_string(name, args) if (name in methods or _safe_unknown_name(name, self._bfcl)) else None
            return f"Error during execution: Function call {name} is not allowed.", recorded
        method = methods.get(name)
        if method is None:
            recorded = call_string(name, args) if _safe_unknown_name(name, self._bfcl) else None
            return f"Error during execution: name {name!r} is not defined", recorded
        doc = self._docs().get(name)
        problems = argument_errors(doc, args) if doc is not None else []
        if problems:
            return f"Error: invalid arguments for {name}: {'; '.join(problems)}.", None
        try:
            result = _stringify(method(**args))
        except Exception as exc:  # BFCL shows the exception text to the model
            result = f"Error during execution: {exc}"
        return result, call_string(name, args)

    def turn(self, parsed: ParsedTurn, action: str) -> TurnResult:
        assert self.state is not None
        st = self.state.tool_state
        turns: list[str] = self.state.task.metadata["user_turns"]
        if parsed.answer is None:
            st["steps"] += 1
            if st["steps"] > self._bfcl.MAXIMUM_STEP_LIMIT:
                msg = f"more than {self._bfcl.MAXIMUM_STEP_LIMIT} steps in one user turn; the episode ends (BFCL force-terminates here)"
                return TurnResult(self.error_observation(msg), terminated=True, info={"bfcl": {"valid": False, "error_type": "multi_turn:force_terminated"}})
        if parsed.error is not None:
            return TurnResult(self.error_observation(parsed.error), info={"parse_error": parsed.error})
        if parsed.tool_calls:
            methods = self._methods()
            results, recorded = [], []
            for call in parsed.tool_calls:
                text, rec = self._execute(call, methods)
                results.append(text)
                if rec is not None:
                    recorded.append(rec)
            if recorded:
                st["record"][st["user_turn"]].append(recorded)
            return TurnResult("\n".join(results), info={"tool_calls": len(parsed.tool_calls)})
        # An answer ends the user turn.
        st["user_turn"] += 1
        st["steps"] = 0
        if st["user_turn"] < len(turns):
            st["record"].append([])
            return TurnResult(turns[st["user_turn"]], info={"role": "user", "answer": parsed.answer})
        verdict = multi_turn_verdict(self.state.task, st["record"])
        obs = "" if verdict["valid"] else self.error_observation(_mt_error_text(verdict))
        return TurnResult(obs, reward=float(verdict["valid"]), terminated=True, info={"bfcl": verdict, "answer": parsed.answer})

    def score(self, task: Task, answer: str) -> float:
        """BFCL's verdict (1 or 0) on the calls recorded so far in the current episode of
        ``task``; user turns not yet reached count as unanswered, so this is 0 before the last
        one. :meth:`turn` applies it when the last user turn is answered."""
        if self.state is None or self.state.task.id != task.id:
            return 0.0
        return float(multi_turn_verdict(task, self.state.tool_state["record"])["valid"])

    def demonstrate(self, task: Task) -> list[str]:
        """BFCL's ground-truth calls, one call per turn, and an ``<answer>`` closing each user turn."""
        out: list[str] = []
        for user_turn, gt_calls in enumerate(task.ground_truth):
            for text in gt_calls:
                name, args = parse_ground_truth_call(text, task.metadata["involved_classes"])
                out.append(format_tool_call(name, args))
            out.append(format_answer("Done." if gt_calls else "I cannot do that with the functions I have."))
        return out


def _mt_error_text(verdict: dict[str, Any]) -> str:
    return f"BFCL's multi-turn checker rejected the episode ({verdict.get('error_type', '')}): {verdict.get('error_message', '')}"


def multi_turn_verdict(task: Task, record: list[list[list[str]]]) -> dict[str, Any]:
    """BFCL's ``multi_turn_checker`` verdict on ``record`` (per user turn, per step, the calls in
    BFCL's executable format) for a multi-turn ``task``: ``{"valid": bool, "error_type", "error_message"}``.

    The checker caches simulator instances in its module's globals under names built from the
    model name; each call here uses a fresh model name and removes its instances afterwards, so
    repeated and forked episodes are judged independently.
    """
    bfcl = require_bfcl()
    ground_truth = task.ground_truth
    if len(record) != len(ground_truth):
        return {"valid": False, "error_type": "multi_turn:force_terminated",
                "error_message": f"{len(record)} user turns answered, {len(ground_truth)} expected"}
    entry = {
        "id": task.metadata["bfcl_id"],
        "initial_config": task.metadata["initial_config"],
        "involved_classes": task.metadata["involved_classes"],
    }
    token = f"tracegym{uuid.uuid4().hex}"
    scope = vars(bfcl.multi_turn_utils)
    try:
        result = bfcl.multi_turn_checker(copy.deepcopy(record), ground_truth, entry, task.metadata["category"], token)
    except Exception as exc:
        result = {"valid": False, "error_type": "checker_exception", "error_message": f"{type(exc).__name__}: {exc}"}
    finally:
        for key in [k for k in scope if token in k]:
            del scope[key]
    return {"valid": bool(result.get("valid")), "error_type": result.get("error_type", ""),
            "error_message": str(result.get("error_message", ""))}


def parse_ground_truth_call(text: str, involved_classes: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """Turn one of BFCL's ground-truth call strings (``"mv(source='a', destination='b')"``,
    positional arguments allowed) into ``(name, {arg: value})`` using the simulator's signature."""
    bfcl = require_bfcl()
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain call: {text!r}")
    name = node.func.id
    args: dict[str, Any] = {}
    if node.args:
        method = None
        for class_name in involved_classes:
            cls = getattr(importlib.import_module(bfcl.CLASS_FILE_PATH_MAPPING[class_name]), class_name)
            method = getattr(cls, name, method)
        if method is None:
            raise ValueError(f"{name!r} is not a method of {list(involved_classes)}")
        params = [p for p in inspect.signature(method).parameters if p != "self"]
        for pname, value in zip(params, node.args):
            args[pname] = ast.literal_eval(value)
    for kw in node.keywords:
        args[str(kw.arg)] = ast.literal_eval(kw.value)
    return name, args
