"""``oracle``: TRACE's allocation (its objective, its stages and options) with the exact
success probabilities instead of a predictor: what a perfect predictor would bring to
TRACE's rule. It is not a ceiling on the effective ratio (TRACE's stage 2 maximises mixed
*subtrees*, not mixed prompts): ``oracle-er`` is. It reads ``forest.oracle`` (filled by the
ContrastLab simulator for every node) and works only where the environment knows V(H)
exactly."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from trace_gym.allocators import register
from trace_gym.allocators.trace import TraceAllocator
from trace_gym.forest.forest import Forest


@register("oracle")
class OracleAllocator(TraceAllocator):
    """TRACE on the true V(H) (``stage1``/``stage2`` as for ``trace``); ignores the predictor."""

    name = "oracle"
    default_predictor: ClassVar[str | None] = None
    reads_oracle: ClassVar[bool] = True

    def values(self, forest: Forest, nodes: np.ndarray, predictor: Any | None) -> np.ndarray:
        v = forest.oracle[nodes]
        if np.isnan(v).any():
            raise ValueError("the oracle allocator needs the true success probability of every node (forest.oracle); "
                             "only the ContrastLab simulator provides it")
        forest.pred[nodes] = v
        return v.astype(np.float64)

    def beliefs(self, forest: Forest, nodes: np.ndarray, predictor: Any | None) -> tuple[np.ndarray, None]:
        """The exact values, with no uncertainty (whatever predictor is passed)."""
        return self.values(forest, nodes, predictor), None
