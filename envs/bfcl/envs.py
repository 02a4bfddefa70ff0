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

The envs load BFCL through :func:`~trace_gym.envs.bfcl.vendor.require_bfcl`, which imports
BFCL's checkers without the vendor SDKs BFCL's model config would pull in.
"""

from __future__ import annotations

import builtins
import copy
import importlib
import inspect
import json
import keyword
import types
from typing import Any, ClassVar, Sequence

from trace_gym.env.base import AgentEnv, TurnResult
from trace_gym.env.react import ParsedTurn, ToolCall, format_answer, format_tool_call
from trace_gym.envs.bfcl.checker import (_error_text, _mt_error_text, ast_verdict, call_string, gold_calls,
                                         multi_turn_verdict, parse_ground_truth_call)
from trace_gym.envs.bfcl.schema import argument_errors, to_tool_schema
from trace_gym.envs.bfcl.tasks import BFCLTasks, _categories, _task_source, multi_turn_function_docs
from trace_gym.envs.bfcl.vendor import MULTI_TURN_CATEGORIES, SINGLE_TURN_CATEGORIES, require_bfcl
from trace_gym.task import Task

__all__ = ["BFCLEnv", "BFCLMultiTurnEnv"]

# multi_turn_utils.execute_multi_turn_func_call refuses these names before it evals a call.
_BLOCKED_CALLS = frozenset({"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"})


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
