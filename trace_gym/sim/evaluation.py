"""One evaluation set for every predictor on ContrastLab, and the best any predictor can do on it.

:func:`evaluation_set` rolls out a fixed sample of train prompts (uniformly drawn, a few bare
rollouts each) with the ``sim`` policy, from its own random stream, so that every allocator
of a bench is scored on the *same* histories: its predictor (as trained by the allocator's
run) predicts the roots and the prefixes (non-terminal inner nodes) of this set, and
calibration is reported for roots and prefixes apart (:meth:`EvaluationSet.score`).
Targets are the exact V(H) of each history; Brier and AUC are their expectations over
outcomes drawn from it (:mod:`trace_gym.predictors.calibration`).

Beside a predictor's figures the set carries three reference predictors, computed from the
world's model, never shown to an allocator:

* ``bayes``: the Bayes-optimal posterior of V given the whole history: the task (hence its
  skills, turn count and hidden answer key: a history shows which options were chosen, and
  whoever knows a task's key reads from them whether each choice was right) and every
  observation. It is ``P(on track | history)`` by a forward filter over the latent bit
  (a correct choice keeps an on-track agent on track and recovers an off-track one with
  probability ``recovery``, a wrong one derails it; each observation multiplies by its
  likelihood, :meth:`~trace_gym.sim.world.ContrastLabWorld.cue_likelihood`), then
  ``V = P(on) v_on(t) + P(off) v_off(t)``. No predictor given the same history can have a
  higher expected AUC.
* ``bayes_cues``: the same filter without the answer key (each choice is right with the
  policy's probability ``q`` of the turn): the best a predictor can do that knows every task
  but has not learnt which options are right, i.e. that reads the prompt and the tools'
  observations only.
* ``regex``: the last observation read by a regular expression, progress 1 / neutral 0.5 /
  tool error 0 (prefixes only): what the cue alone gives away. The world's default
  ``cue_flip`` keeps its AUC at or below 0.75.

``exact``: the AUC of V itself (the oracle), the ceiling of all of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from trace_gym.allocation.allocator import add_candidates
from trace_gym.forest.forest import TERMINAL, Forest, History
from trace_gym.predictors.calibration import auc, brier
from trace_gym.sim.fast import ContrastLabSim
from trace_gym.sim.world import CAT_NONE, ContrastLabWorld

__all__ = ["EvaluationSet", "bayes_values", "evaluation_set", "last_observation_score", "EVAL_SEED"]

EVAL_SEED = 0xE7A1
"""Seeds the evaluation set's prompts and rollouts, apart from every run's own streams."""

_PROGRESS = re.compile(r"(?m)^progress\b")
_ERROR = re.compile(r"(?m)^tool error\b")


def last_observation_score(text: str) -> float:
    """The three-way regex reading of a turn's observation: 1.0 for ``progress``, 0.0 for a
    ``tool error``, 0.5 otherwise (neutral, or no observation)."""
    if _PROGRESS.search(text):
        return 1.0
    if _ERROR.search(text):
        return 0.0
    return 0.5


def bayes_values(world: ContrastLabWorld, forest: Forest, info: dict[str, np.ndarray], *, answer_key: bool = True) -> np.ndarray:
    """The posterior success probability of every node of ``forest`` given its history (see
    the module docstring): with ``answer_key`` the filter knows whether each choice was
    right (``info["correct"]``), without it only the policy's probability of a right choice.
    ``info`` is :meth:`ContrastLabSim.node_info` of the sim that grew the forest. Roots get
    their exact value, finished leaves their reward."""
    n = len(forest)
    task = np.array([world.index_of(t) for t in forest.task_ids], dtype=np.int64)[forest.tree]
    depth = forest.depth.astype(np.int64)
    like = world.cue_likelihood()  # [category, state]
    belief = np.ones(n)  # P(on track) after the node's turn
    r = world.recovery
    for d in range(1, int(depth.max(initial=0)) + 1):
        nodes = np.flatnonzero(depth == d)
        prev = belief[forest.parent[nodes]]
        if answer_key:
            right = info["correct"][nodes] == 1
            b = np.where(right, prev + (1.0 - prev) * r, 0.0)
        else:
            q = world.q[task[nodes], d]
            b = prev * q + (1.0 - prev) * q * r
        cat = info["category"][nodes].astype(np.int64)
        seen = cat != CAT_NONE
        c = np.where(seen, cat, 0)
        on_l, off_l = like[c, 1], like[c, 0]
        post = b * on_l / np.maximum(b * on_l + (1.0 - b) * off_l, 1e-300)
        belief[nodes] = np.where(seen, post, b)
    d = np.minimum(depth, world.turns[task])
    value = belief * world.v_on[task, d] + (1.0 - belief) * world.v_off[task, d]
    done = (forest.flags & TERMINAL) != 0
    value[done] = forest.reward[done]
    return np.clip(value, 0.0, 1.0)


def _scores(pred: np.ndarray, truth: np.ndarray) -> dict[str, float | None]:
    if pred.size == 0:
        return {"auc": None, "brier": None, "brier_excess": None, "n": 0}
    a = auc(pred, truth)
    return {"auc": None if np.isnan(a) else a, "brier": brier(pred, truth),
            "brier_excess": float(np.mean((pred - truth) ** 2)), "n": int(pred.size)}


@dataclass
class EvaluationSet:
    """Histories every predictor of a bench is scored on (built by :func:`evaluation_set`).

    ``roots``/``prefixes``: node ids of the prompts and of the non-terminal inner nodes;
    ``truth``: exact V per node; ``bayes``/``bayes_cues``/``regex``: the reference
    predictions of the module docstring, per node."""

    forest: Forest
    roots: np.ndarray
    prefixes: np.ndarray
    truth: np.ndarray
    bayes: np.ndarray
    bayes_cues: np.ndarray
    regex: np.ndarray

    def histories(self, nodes: np.ndarray) -> list[History]:
        """The histories of ``nodes`` as a predictor sees them (no true values)."""
        return self.forest.histories(nodes)

    def score(self, roots: np.ndarray | None, prefixes: np.ndarray | None) -> dict[str, Any]:
        """AUC, Brier and ``brier_excess`` (mean squared distance to V) of predictions for
        :attr:`roots` and :attr:`prefixes`, each against the exact V (None: not predicted)."""
        out: dict[str, Any] = {}
        for part, nodes, pred in (("roots", self.roots, roots), ("prefixes", self.prefixes, prefixes)):
            out[part] = None if pred is None else _scores(np.clip(np.asarray(pred, dtype=np.float64), 0, 1), self.truth[nodes])
        return out

    def references(self) -> dict[str, Any]:
        """The scores of the exact V, the two Bayes posteriors and the regex (prefixes only)."""
        return {
            "exact": self.score(self.truth[self.roots], self.truth[self.prefixes]),
            "bayes": self.score(self.bayes[self.roots], self.bayes[self.prefixes]),
            "bayes_cues": self.score(self.bayes_cues[self.roots], self.bayes_cues[self.prefixes]),
            "regex": self.score(None, self.regex[self.prefixes]),
        }

    def predict(self, predictor: Any) -> dict[str, Any]:
        """Score ``predictor`` (anything with ``predict(histories)``) on the set. An oracle
        component (``reads_oracle``) gets the histories with their true values."""
        oracle = bool(getattr(predictor, "reads_oracle", False))
        out = []
        for nodes in (self.roots, self.prefixes):
            hist = self.forest.histories(nodes, oracle=oracle)
            out.append(np.asarray(predictor.predict(hist), dtype=np.float64) if len(hist) else np.zeros(0))
        return self.score(*out)


def evaluation_set(world: ContrastLabWorld, prompts: int = 512, rollouts: int = 4, seed: int = EVAL_SEED) -> EvaluationSet:
    """``rollouts`` bare rollouts of each of ``prompts`` train tasks drawn uniformly (without
    replacement) under the world's current policy, from a stream seeded by ``seed`` alone."""
    rng = np.random.default_rng([int(seed), 0xE5])
    train = world.split_indices("train")
    tasks = np.sort(rng.choice(train, size=min(prompts, train.size), replace=False))
    forest = Forest(capacity=max(1024, 8 * rollouts * tasks.size))
    roots = add_candidates(forest, world.candidates(tasks))
    sim = ContrastLabSim(world, seed=int(rng.integers(2**31)))
    sim.rollout(forest, np.repeat(roots, rollouts))
    forest.backup()
    info = sim.node_info(forest)
    prefixes = np.flatnonzero(((forest.flags & TERMINAL) == 0) & (forest.parent >= 0))
    regex = np.full(len(forest), 0.5)
    regex[prefixes] = [last_observation_score(forest.text[i]) for i in prefixes]
    return EvaluationSet(forest=forest, roots=roots, prefixes=prefixes, truth=np.clip(forest.oracle.copy(), 0, 1),
                         bayes=bayes_values(world, forest, info), bayes_cues=bayes_values(world, forest, info, answer_key=False),
                         regex=regex)


def summary_line(refs: dict[str, Any]) -> str:
    """One line of the reference AUCs (prefixes; roots in brackets where they differ)."""
    def f(x: Sequence[Any] | Any) -> str:
        return "-" if x is None else f"{x:.3f}"

    return (f"evaluation set, AUC on prefixes (roots): exact V {f(refs['exact']['prefixes']['auc'])} "
            f"({f(refs['exact']['roots']['auc'])}), Bayes-optimal given the history {f(refs['bayes']['prefixes']['auc'])}, "
            f"Bayes without the answer key {f(refs['bayes_cues']['prefixes']['auc'])}, "
            f"regex on the last observation {f(refs['regex']['prefixes']['auc'])}")
