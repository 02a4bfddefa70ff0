"""``beta``: a Beta posterior per prompt (MoPPS-style), the simplest learned predictor.

Each prompt (``History.task_id``) keeps a Beta(a, b) posterior over its root success
probability. The prior is centred on the running mean of every outcome seen so far, with
strength ``prior_strength`` pseudo-outcomes, so an unseen prompt is predicted at the
population's success rate. Only root histories (depth 0) update it: a root's backed-up
value ``V_hat`` with weight n adds ``n V_hat`` successes and ``n (1 - V_hat)`` failures.
The predictor ignores the prefix: an inner node gets its prompt's posterior mean.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from trace_gym.forest.forest import History
from trace_gym.predictors.base import Predictor
from trace_gym.predictors import register


@register("beta")
class BetaPredictor(Predictor):
    """Per-prompt Beta posterior mean (see the module docstring).

    Args:
        prior_strength: pseudo-outcomes of the prior (a + b for an unseen prompt).
        prior_mean: the prior mean before any outcome is seen.
    """

    name = "beta"

    def __init__(self, prior_strength: float = 2.0, prior_mean: float = 0.5):
        if prior_strength <= 0:
            raise ValueError(f"prior_strength must be positive, got {prior_strength}")
        if not 0.0 < prior_mean < 1.0:
            raise ValueError(f"prior_mean must be in (0, 1), got {prior_mean}")
        self.prior_strength = float(prior_strength)
        self.prior_mean = float(prior_mean)
        self.successes: dict[str, float] = {}
        self.failures: dict[str, float] = {}
        self.total_success = 0.0
        self.total = 0.0

    def population_mean(self) -> float:
        """Mean outcome over everything seen (the prior mean until then)."""
        return self.total_success / self.total if self.total > 0 else self.prior_mean

    def predict_beta(self, histories: Sequence[History]) -> tuple[np.ndarray, np.ndarray]:
        """``(mean, concentration)`` of each history's prompt posterior ``Beta(a, b)``:
        ``a / (a + b)`` and ``a + b`` for roots; inner nodes get the same mean with
        concentration ``inf`` (a point estimate, as :class:`~trace_gym.predictors.hashed.HashedPredictor`
        gives them)."""
        m = self.population_mean()
        a0, b0 = self.prior_strength * m, self.prior_strength * (1 - m)
        s, f = self.successes, self.failures
        mean, conc = np.empty(len(histories)), np.empty(len(histories))
        for k, h in enumerate(histories):
            a = a0 + s.get(h.task_id, 0.0)
            total = a + b0 + f.get(h.task_id, 0.0)
            mean[k], conc[k] = a / total, total if h.depth == 0 else np.inf
        return mean, conc

    def predict(self, histories: Sequence[History]) -> np.ndarray:
        return self.predict_beta(histories)[0]

    def update(self, histories: Sequence[History], targets: np.ndarray, weights: np.ndarray | None = None) -> None:
        t = np.asarray(targets, dtype=np.float64)
        w = np.ones_like(t) if weights is None else np.asarray(weights, dtype=np.float64)
        if t.shape != (len(histories),) or w.shape != t.shape:
            raise ValueError("targets and weights need one value per history")
        for h, tk, wk in zip(histories, t.tolist(), w.tolist()):
            if h.depth != 0 or wk <= 0 or tk != tk:
                continue
            self.successes[h.task_id] = self.successes.get(h.task_id, 0.0) + wk * tk
            self.failures[h.task_id] = self.failures.get(h.task_id, 0.0) + wk * (1 - tk)
            self.total_success += wk * tk
            self.total += wk

    def state_dict(self) -> dict[str, Any]:
        return {"successes": dict(self.successes), "failures": dict(self.failures),
                "total_success": self.total_success, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.successes = dict(state["successes"])
        self.failures = dict(state["failures"])
        self.total_success = float(state["total_success"])
        self.total = float(state["total"])
