"""Predictors of V(H): ``beta``, ``hashed``, ``lm``, ``oracle``.

``@trace_gym.register_predictor("name")`` (alias ``trace_gym.predictors.register``)
registers your own; ``trace_gym.make_predictor("name", **kwargs)`` builds one.

The built-ins are entry points of the group ``trace_gym.predictors`` (declared in this
project's ``pyproject.toml``, exactly as a third-party predictor would be), imported when a
predictor of that name is first built (``lm`` imports torch and transformers).
"""

from __future__ import annotations

from trace_gym.predictors.base import PREDICTORS, register_predictor

register = register_predictor
names = PREDICTORS.names

__all__ = ["PREDICTORS", "names", "register"]
