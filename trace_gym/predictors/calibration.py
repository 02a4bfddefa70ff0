"""Calibration metrics of a success predictor: Brier score, expected calibration error, AUC.

All three take predictions ``pred`` in [0, 1], targets ``target`` in [0, 1] and optional
non-negative ``weight``. A target may be fractional: a node whose n leaves have mean reward
``V_hat`` is passed as ``(pred, V_hat, n)`` and counts exactly like its n binary outcomes
(``n * V_hat`` successes and ``n * (1 - V_hat)`` failures, all with the same prediction).
An exact success probability (the simulator's oracle) can be passed the same way; the
metrics are then the expectations over outcomes drawn from it.

* :func:`brier`: weighted mean of ``(pred - y)^2`` over the outcomes (for a fractional
  target: ``(pred - t)^2 + t (1 - t)``). 0 is perfect; a constant 0.5 scores 0.25.
* :func:`ece`: weighted mean over ``n_bins`` equal-width prediction bins of
  ``|mean pred - mean outcome|``.
* :func:`auc`: probability that a random success outcome got a higher prediction than a
  random failure outcome (ties count one half), with the weights above (Mann-Whitney).
"""

from __future__ import annotations

import numpy as np

__all__ = ["brier", "ece", "auc", "calibration"]


def _check(pred, target, weight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    p = np.asarray(pred, dtype=np.float64).ravel()
    t = np.asarray(target, dtype=np.float64).ravel()
    w = np.ones_like(p) if weight is None else np.asarray(weight, dtype=np.float64).ravel()
    if not (p.shape == t.shape == w.shape):
        raise ValueError(f"pred, target and weight must have the same length, got {p.size}, {t.size}, {w.size}")
    if p.size and not (np.all((p >= 0) & (p <= 1)) and np.all((t >= 0) & (t <= 1))):
        raise ValueError("pred and target must lie in [0, 1] (no NaN)")
    if p.size and not np.all(w >= 0):
        raise ValueError("weights must be non-negative (no NaN)")
    return p, t, w


def brier(pred, target, weight=None) -> float:
    """Weighted Brier score (see the module docstring); NaN when the total weight is 0."""
    p, t, w = _check(pred, target, weight)
    total = w.sum()
    if total <= 0:
        return float("nan")
    return float(np.sum(w * ((p - t) ** 2 + t * (1 - t))) / total)


def ece(pred, target, weight=None, n_bins: int = 10) -> float:
    """Weighted expected calibration error over ``n_bins`` equal-width bins of ``pred``
    (the last bin includes 1.0); NaN when the total weight is 0."""
    if n_bins < 1:
        raise ValueError(f"n_bins must be at least 1, got {n_bins}")
    p, t, w = _check(pred, target, weight)
    total = w.sum()
    if total <= 0:
        return float("nan")
    b = np.minimum((p * n_bins).astype(np.int64), n_bins - 1)
    pb = np.bincount(b, weights=w * p, minlength=n_bins)
    tb = np.bincount(b, weights=w * t, minlength=n_bins)
    return float(np.sum(np.abs(pb - tb)) / total)


def auc(pred, target, weight=None) -> float:
    """Weighted ROC AUC (see the module docstring); NaN without both a success and a failure."""
    p, t, w = _check(pred, target, weight)
    pos, neg = w * t, w * (1 - t)
    if pos.sum() <= 0 or neg.sum() <= 0:
        return float("nan")
    uniq, inv = np.unique(p, return_inverse=True)  # sorted distinct predictions
    pos_u = np.bincount(inv, weights=pos, minlength=uniq.size)
    neg_u = np.bincount(inv, weights=neg, minlength=uniq.size)
    neg_below = np.cumsum(neg_u) - neg_u  # failures with a strictly lower prediction
    wins = np.sum(pos_u * (neg_below + 0.5 * neg_u))
    return float(wins / (pos.sum() * neg.sum()))


def calibration(pred, target, weight=None, n_bins: int = 10) -> dict[str, float]:
    """``{"brier", "ece", "auc", "weight"}`` in one call (``weight``: the total weight)."""
    p, t, w = _check(pred, target, weight)
    return {"brier": brier(p, t, w), "ece": ece(p, t, w, n_bins), "auc": auc(p, t, w), "weight": float(w.sum())}
