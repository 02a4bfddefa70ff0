"""Function calling on the Berkeley Function-Calling Leaderboard (BFCL), judged by BFCL's own checkers.

``trace_gym/BFCL-v0`` (single-turn AST categories) and ``trace_gym/BFCLMultiTurn-v0``
(``multi_turn_base`` with BFCL's API simulators as stateful tools), over the data the
``bfcl-eval`` package ships (the ``trace-gym[bfcl]`` extra). By concept:

* :mod:`~trace_gym.envs.bfcl.vendor` -- importing BFCL's checkers with a stand-in for its
  model config (no vendor SDKs); :func:`require_bfcl`, :class:`BFCLUnavailable`;
* :mod:`~trace_gym.envs.bfcl.schema` -- BFCL function docs as JSON-schema tool specs;
* :mod:`~trace_gym.envs.bfcl.checker` -- BFCL's verdicts and gold answers;
* :mod:`~trace_gym.envs.bfcl.tasks` -- BFCL's data as task sources;
* :mod:`~trace_gym.envs.bfcl.envs` -- the two environments.
"""

from trace_gym.envs.bfcl.checker import ast_verdict, call_string, gold_calls, multi_turn_verdict, parse_ground_truth_call
from trace_gym.envs.bfcl.envs import BFCLEnv, BFCLMultiTurnEnv
from trace_gym.envs.bfcl.schema import PYTHON_HINT, argument_errors, to_tool_schema
from trace_gym.envs.bfcl.tasks import BFCLMultiTurnTasks, BFCLTasks, load_category, multi_turn_function_docs
from trace_gym.envs.bfcl.vendor import (JUDGE_MODEL, MULTI_TURN_CATEGORIES, SINGLE_TURN_CATEGORIES, BFCLUnavailable,
                                        require_bfcl)

__all__ = [
    "JUDGE_MODEL", "MULTI_TURN_CATEGORIES", "PYTHON_HINT", "SINGLE_TURN_CATEGORIES", "BFCLEnv", "BFCLMultiTurnEnv",
    "BFCLMultiTurnTasks", "BFCLTasks", "BFCLUnavailable", "argument_errors", "ast_verdict", "call_string", "gold_calls",
    "load_category", "multi_turn_function_docs", "multi_turn_verdict", "parse_ground_truth_call", "require_bfcl",
    "to_tool_schema",
]
