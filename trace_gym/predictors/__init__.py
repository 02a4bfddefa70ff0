"""Built-in predictors of V(H).

``trace_gym.predictors.register("name")`` registers your own;
``trace_gym.make_predictor("name", **kwargs)`` builds one.
"""

from trace_gym.predictors.base import PREDICTORS

register = PREDICTORS.register
names = PREDICTORS.names

# the built-ins register themselves exactly as a user's predictor would
from trace_gym.predictors import beta, hashed, oracle  # noqa: E402,F401


def _lm(**kwargs):
    """Build the ``lm`` predictor (imported on first use: it needs torch and transformers)."""
    from trace_gym.predictors.lm import LMPredictor

    return LMPredictor(**kwargs)


register("lm", _lm)
