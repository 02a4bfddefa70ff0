"""``oracle``: returns the environment's exact success probability (``History.oracle``).

Only environments that know V(H) exactly (ContrastLab) fill ``History.oracle``, and a forest
hands it out only to oracle components (``reads_oracle = True``, as here:
:func:`~trace_gym.predictors.base.histories_for`); on any other history the oracle raises.
It learns nothing. Use it for ceilings and tests.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from trace_gym.forest.forest import History
from trace_gym.predictors.base import Predictor
from trace_gym.predictors import register


@register("oracle")
class OraclePredictor(Predictor):
    """``predict`` returns ``History.oracle``; raises ``ValueError`` where it is NaN."""

    name = "oracle"
    reads_oracle = True

    def predict(self, histories: Sequence[History]) -> np.ndarray:
        v = np.array([h.oracle for h in histories], dtype=np.float64)
        if np.isnan(v).any():
            raise ValueError("the oracle predictor needs histories with a known success probability "
                             "(History.oracle): only the ContrastLab simulator provides it, and a forest hands it out "
                             "only when asked, forest.histories(nodes, oracle=True) (histories_for does for oracle components)")
        return v

    def update(self, histories: Sequence[History], targets: np.ndarray, weights: np.ndarray | None = None) -> None:
        """Nothing to learn."""
