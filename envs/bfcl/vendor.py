"""Loading ``bfcl-eval`` (the ``trace-gym[bfcl]`` extra) without the vendor SDKs it imports.

BFCL's ``bfcl_eval.eval_checker.ast_eval.ast_checker`` imports
``bfcl_eval.constants.model_config``, which imports every vendor SDK BFCL can drive (openai,
anthropic, ...). The checker reads one name from it, ``MODEL_CONFIG_MAPPING``, and only to look
up ``underscore_to_dot`` for the model being judged. Rather than install a dozen SDKs,
:func:`require_bfcl` registers a light stand-in module under that name before importing the
checker; it maps our judge name (:data:`JUDGE_MODEL`) to ``underscore_to_dot=False`` --
function names are matched exactly, dots included, as for BFCL's Qwen FC models. If the real
module is already imported (a process that also runs BFCL's own pipeline), our entry is added
to it instead.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from dataclasses import dataclass

from trace_gym.env.base import EnvUnavailable

__all__ = ["JUDGE_MODEL", "MULTI_TURN_CATEGORIES", "SINGLE_TURN_CATEGORIES", "BFCLUnavailable", "require_bfcl"]

SINGLE_TURN_CATEGORIES: tuple[str, ...] = ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance")
MULTI_TURN_CATEGORIES: tuple[str, ...] = ("multi_turn_base",)
# Our category names -> BFCL's file/category names (BFCL v4 renamed "simple" to "simple_python").
_BFCL_NAME = {"simple": "simple_python"}
JUDGE_MODEL = "trace-gym"

_INSTALL_HINT = "the BFCL environments need the `bfcl-eval` package: pip install 'trace-gym[bfcl]'"


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
