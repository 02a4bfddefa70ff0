"""``trace``: TRACE's two-stage active allocation (PAPER.md sec. 3).

Stage 1 (``stage1="active"``): the predictor scores every candidate prompt, and
:func:`~trace_gym.allocation.solvers.solve_roots` picks rollouts per prompt maximising the expected
number of mixed groups, ``sum 1 - v^m - (1-v)^m`` with ``m`` in ``{0} u [m_min, m_max]``,
within ``M_root = root_fraction * M``. The paper's ``m_min`` is the budget's
``min_per_prompt`` (2); the default here is half of the budget's group size G (``m_min=
"half-group"``), so that with ``root_fraction`` 0.5 stage 1 samples at most M / G prompts,
as many as GRPO.

Stage 2 (``stage2="active"``): a prefix whose subtree is still pure (all leaves below it
share the outcome ``r``), from the roots that got rollouts down to the last non-terminal
turn, is a candidate. The predictor scores each, and
:func:`~trace_gym.allocation.solvers.solve_prefixes` spreads the remaining budget to maximise
``sum 1 - (r V + (1-r)(1 - V))^k``, the expected number of prefixes whose subtree becomes
mixed. A prefix whose subtree is already mixed has nothing left to gain there and is not
a candidate; if no pure prefix is left at all, the budget goes out uniformly. Which pure
prefixes compete is ``scope``: every one (``"subtree"``, the paper's and the default), only
those of trees stage 1 already found mixed (``"mixed"``: every branch lands where GRPO's
advantage is non-zero), or only those of trees still pure (``"tree"``: mixing more prompts).

``stage2="posterior"`` scores a pure prefix under the posterior of its value given the ``n``
equal outcomes already below it, ``V ~ Beta(c v + n [r = 1], c (1 - v) + n [r = 0])``, and
:func:`~trace_gym.allocation.solvers.solve_prefixes_beta` maximises the same expected number of
newly mixed prefixes under it. The concentration ``c`` is fitted by maximum likelihood to the
run's own branches (:mod:`~trace_gym.allocation.prefix_evidence`), one per depth (0, 1, 2, and
one for deeper prefixes; a depth with fewer than ``EVIDENCE_MIN`` groups uses the pooled fit),
on the last ``EVIDENCE_MEMORY`` groups; before any evidence it is ``inf``, the paper's point
estimate. Where a prefix's outcome is settled once it is written (small ``c``), stage 2 moves
its budget to prefixes that can still disagree, such as fresh rollouts of a still-pure prompt.

Either stage set to ``"uniform"`` uses the :mod:`uniform <trace_gym.allocators.uniform>`
allocator's rule instead, and ``stage2="none"`` gives stage 1 the whole budget: that is the
ablation grid (``benchmarks/ablation_grid.py``). Predictions are written to
``forest.pred`` so that their calibration can be measured later.

**The defaults are the grid's measured best for training**: the combination that reached
GRPO's final held-out accuracy with the fewest generated tokens in ContrastLab's learning
mode (3 seeds): active stage 1, active stage 2 over every pure prefix, the shared
``hashed`` predictor (no per-prompt counts) and the ``grpo`` advantage (``advantage``, read
by :func:`trace_gym.run.defaults`), with stage-1 groups of at least G/2 (measured against the
paper's pairs in the README's "Stage-1 groups"). The paper's exact rule, with the tree-aware
advantage, is ``trace-paper`` (:class:`TracePaperAllocator`). Stage 2 over the pure prefixes of
mixed trees only (``scope="mixed"``) learns faster in ContrastLab's learning mode but slower on
the quick preset's real model, which decides. ``stage2="posterior"`` mixes more prompts than the
default on the quick preset's real model and trains no better on more tokens, and ties or
trails it in ContrastLab's learning mode. The figures and why the default differs: the
README's "Measured" and "Design notes".

Options beyond the paper's single pass:

* ``uncertainty=True`` (the default; ``stage1="posterior"`` forces it, ``stage1="paper"``
  turns it off): when the predictor offers a predictive distribution
  (``predictor.predict_beta(histories) -> (mean, concentration)``, a Beta per history, as
  :class:`~trace_gym.predictors.hashed.HashedPredictor` with ``counts=True`` and
  :class:`~trace_gym.predictors.beta.BetaPredictor` do for roots), stage 1 maximises
  the *expected* number of mixed groups under it,

      E[V_root(p, m)] = 1 - P(m successes) - P(m failures),   p ~ Beta(c v, c (1 - v)),

  the beta-binomial probability that ``m`` rollouts are mixed (``c = inf`` gives back
  ``V_root(v, m)``), solved exactly by :func:`solve_roots_beta` (dynamic programming over
  the budget: the gains are non-increasing after the first unit, but prompts no longer
  share one ordering). ``uncertainty=False``, or a predictor without a predictive
  distribution (``hashed`` without counts, the default; ``oracle``, ``lm``), gives the
  paper's point-estimate stage 1. Stage 2 always uses point estimates.
* ``rounds=R`` (default 1): stage 2 spends its budget in R equal rounds, re-planning with
  the outcomes seen so far.
* ``scope``: which pure prefixes are stage 2's candidates. ``"subtree"`` (the paper's and the
  default): every pure prefix; ``"mixed"``: those of trees already mixed (every pure prefix
  when no tree is mixed), so no branch is spent on a prompt that may stay without contrast,
  at the cost of fewer prompts with contrast; ``"tree"``: only those of trees still pure at
  the root, i.e. stage 2 maximises mixed *prompts* (the effective ratio) instead of mixed
  *subtrees*.

* ``rescue=R`` (default 0, off): before stage 2's objective, up to R rounds in which every
  still-pure prompt whose next outcome is likely enough to disagree (``P(disagree) (n + 1) >
  1`` for a prompt of n rollouts, under the root's Beta predictive updated with the step's
  outcomes; :meth:`TraceAllocator.rescue_plan`) gets one fresh rollout. It raises the
  effective sample ratio under grpo's advantage, most with a predictor that has a
  predictive distribution (``hashed:counts=true``), and learns slower in ContrastLab's
  learning mode, so it is off by default (the README's "Measured").

Why these options, and what was tried and dropped: the README's "Design notes".
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, ClassVar

import numba as nb
import numpy as np

from trace_gym.allocation.budget import Budget
from trace_gym.allocation.allocator import Allocator
from trace_gym.allocators import register
from trace_gym.allocators.uniform import uniform_prefixes, uniform_roots
from trace_gym.forest.forest import TERMINAL, Forest
from trace_gym.predictors.base import histories_for
from trace_gym.allocation.prefix_evidence import (CONCENTRATIONS, BranchEvidence, best_concentration, branch_evidence,
                                                   group_log_likelihoods)
from trace_gym.allocation.solvers import solve_prefixes, solve_prefixes_beta, solve_roots

EVIDENCE_MEMORY = 4096  # most recent branch groups stage2="posterior" fits its concentrations on
EVIDENCE_MIN = 30  # groups a depth needs before it gets its own concentration (else the pooled one)
EVIDENCE_DEPTHS = 3  # depths 0, 1, 2 get their own concentration; deeper prefixes share one

STAGES1 = ("uniform", "active", "paper", "posterior")
STAGES2 = ("none", "uniform", "active", "posterior")
STAGES = ("uniform", "active")  # the values both stages take
M_MIN_RULES = ("budget", "half-group")
SCOPES = ("subtree", "mixed", "tree")  # stage 2's candidates (see ``scope``)


def v_root_beta(mean: np.ndarray, concentration: np.ndarray, m_max: int) -> np.ndarray:
    """``out[i, m]`` for ``m = 0..m_max``: the probability that ``m`` rollouts of prompt ``i``
    are mixed when its success probability is ``Beta(c v, c (1 - v))`` with ``v = mean[i]``
    and ``c = concentration[i]`` (``inf``: exactly ``v``, i.e. ``V_root(v, m)``)."""
    v = np.clip(np.asarray(mean, dtype=np.float64), 0.0, 1.0)
    c = np.asarray(concentration, dtype=np.float64)
    if v.shape != c.shape or v.ndim != 1:
        raise ValueError(f"mean and concentration must be 1-d of one length, got {v.shape} and {c.shape}")
    if np.any(~(c > 0)):
        raise ValueError("concentrations must be positive (inf for a point estimate)")
    j = np.arange(max(int(m_max), 0), dtype=np.float64)[None, :]
    point = np.isinf(c)
    cc = np.where(point, 1.0, c)[:, None]
    a, b = v[:, None] * cc, (1.0 - v[:, None]) * cc
    # P(first m all succeed) = prod_{j<m} (a + j) / (c + j); for c = inf it is v^m
    all_s = np.where(point[:, None], v[:, None] ** (j + 1), np.cumprod((a + j) / (cc + j), axis=1))
    all_f = np.where(point[:, None], (1.0 - v[:, None]) ** (j + 1), np.cumprod((b + j) / (cc + j), axis=1))
    out = np.zeros((v.size, j.shape[1] + 1))
    out[:, 1:] = np.clip(1.0 - all_s - all_f, 0.0, 1.0)
    return out


@nb.njit(cache=True, nogil=True)
def _solve_table_kernel(value, budget, m_min):
    """Exact DP: counts ``m_i`` in ``{0} u [m_min, width-1]`` with ``sum m_i <= budget``
    maximising ``sum value[i, m_i]``; among optima the one spending the most units, then
    (per prompt, last to first) the larger count. Returns the counts."""
    n, width = value.shape
    best = np.zeros(budget + 1)  # best[c]: optimum of the prompts so far with at most c units
    used = np.zeros(budget + 1, dtype=np.int64)  # units that optimum spends
    new_best = np.empty(budget + 1)
    new_used = np.empty(budget + 1, dtype=np.int64)
    choice = np.zeros((n, budget + 1), dtype=np.int32)
    for i in range(n):
        for c in range(budget + 1):
            top, top_used, arg = best[c], used[c], 0
            for m in range(m_min, min(width - 1, c) + 1):
                x = best[c - m] + value[i, m]
                u = used[c - m] + m
                # a relative tolerance keeps float noise from deciding between equal optima
                if x > top + 1e-12 * (1.0 + abs(top)) or (x >= top - 1e-12 * (1.0 + abs(top)) and u >= top_used):
                    top, top_used, arg = x, u, m
            new_best[c], new_used[c], choice[i, c] = top, top_used, arg
        best[:] = new_best
        used[:] = new_used
    out = np.zeros(n, dtype=np.int64)
    c = budget
    for i in range(n - 1, -1, -1):
        out[i] = choice[i, c]
        c -= out[i]
    return out


def solve_roots_beta(mean: np.ndarray, concentration: np.ndarray, budget: int, m_min: int = 2,
                     m_max: int = 0) -> np.ndarray:
    """Stage 1 under uncertainty: rollouts per prompt maximising the expected number of
    mixed groups, ``sum_i v_root_beta(mean_i, concentration_i)[m_i]``, with every ``m_i`` in
    ``{0} u [m_min, m_max]`` and ``sum m_i <= budget`` (``m_max <= 0``: no cap).

    Exact dynamic programming over the budget, O(prompts x budget x cap). Without a cap the
    DP runs with the smallest cap no optimal solution can exceed: at most ``budget // m_min``
    prompts are active, so when there are more prompts some prompt ``j`` with
    ``f_j(m_min) >= F`` (the ``budget // m_min + 1``-th largest ``f(m_min)``) is idle, and
    moving the last ``m_min`` units of a prompt holding ``m >= 2 m_min`` to it must not pay;
    the gains ``g(k)`` being non-increasing for ``k > m_min``, that gives
    ``g(m - m_min + 1) >= F / m_min``, which bounds ``m``. Without idle prompts the cap is
    the budget. Among optimal allocations the DP prefers the one spending the most units.
    """
    budget = operator.index(budget)
    m_min, m_max = operator.index(m_min), operator.index(m_max)
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if m_min < 1:
        raise ValueError(f"m_min must be >= 1, got {m_min}")
    if m_max > 0 and m_max < m_min:
        raise ValueError(f"m_max ({m_max}) must be 0 (no cap) or at least m_min ({m_min})")
    mean = np.asarray(mean, dtype=np.float64)
    if mean.size == 0 or budget < m_min:
        v_root_beta(mean, concentration, 0)  # still validates the input
        return np.zeros(mean.size, dtype=np.int64)
    limit = min(m_max, budget) if m_max > 0 else budget
    cap = limit
    active = budget // m_min
    if m_max <= 0 and mean.size > active:
        first = v_root_beta(mean, concentration, m_min)[:, m_min]
        tau = np.partition(first, mean.size - active - 1)[mean.size - active - 1] / m_min
        width = min(limit, max(32, 2 * m_min))
        while tau > 0.0 and width < limit:
            gains = np.diff(v_root_beta(mean, concentration, width), axis=1)[:, m_min:]  # units m_min+1 .. width
            if np.any(gains[:, -1] >= tau):  # some prompt may still want more: look further
                width = min(2 * width, limit)
                continue
            above = gains >= tau
            # k*: the last unit whose gain reaches tau (gains fall with k, so the units reaching it come first)
            k_star = np.where(above.any(axis=1), m_min + above.shape[1] - np.argmax(above[:, ::-1], axis=1), m_min)
            cap = min(limit, max(2 * m_min - 1, int(k_star.max()) + m_min - 1))
            break
    table = v_root_beta(mean, concentration, cap)
    return _solve_table_kernel(np.ascontiguousarray(table), int(budget), int(m_min))


@register("trace")
class TraceAllocator(Allocator):
    """TRACE (see the module docstring).

    Args:
        stage1: ``"active"`` (predictor + exact solver; under the predictor's uncertainty
            when ``uncertainty`` is on), ``"paper"`` (active at the point estimate, the
            paper's rule, whatever ``uncertainty`` says), ``"posterior"`` (active under the
            predictive distribution) or ``"uniform"``.
        stage2: ``"active"`` (predictor + greedy solver), ``"posterior"`` (the same, with each
            prefix's value conditioned on the outcomes below it, at concentrations fitted to
            the run's branches; see the module docstring), ``"uniform"``, or ``"none"`` (no
            branching: stage 1 spends the whole budget, as if ``root_fraction`` were 1).
        k_max: most continuations from one prefix in stage 2 (0: no cap).
        rounds: stage 2 spends its budget in this many equal rounds, re-planning after each
            with the outcomes seen so far (1: the paper's single greedy pass).
        scope: ``"subtree"`` (the paper: every pure prefix), ``"mixed"`` (pure prefixes of
            trees already mixed; every pure prefix when no tree is mixed) or ``"tree"`` (only
            prefixes of trees not yet mixed).
        uncertainty: stage 1 maximises the expected number of mixed groups under the
            predictor's predictive distribution when it offers one (``predict_beta``);
            False: at its point estimate, as in the paper.
        m_min: fewest stage-1 rollouts of a selected prompt: an integer, a fraction ``f`` in
            (0, 1) of the budget's ``group_size`` G (``ceil(f G)``, at least its
            ``min_per_prompt``), ``"budget"`` (the
            budget's ``min_per_prompt``, the paper's ``m_min``) or ``"half-group"`` (the
            default: half of the budget's ``group_size`` G, and at least its
            ``min_per_prompt``; with ``root_fraction`` 0.5 stage 1 then samples at most
            M / G prompts, as many as GRPO's groups).
        m_max: most stage-1 rollouts of a prompt: None (the default: the budget's
            ``max_per_prompt``, no cap unless it sets one), an integer at least ``m_min``, or
            ``"m_min"`` (exactly ``m_min`` for every selected prompt: stage 1 then samples
            ``M_root / m_min`` prompts whenever that many candidates are left).
        root_fraction: stage 1's share of M (None: the budget's ``root_fraction``).
        seed: seeds the uniform stages.
    """

    name = "trace"
    default_predictor: ClassVar[str | None] = "hashed"
    advantage: ClassVar[str] = "grpo"

    def __init__(self, stage1: str = "active", stage2: str = "active", k_max: int = 0, rounds: int = 1,
                 scope: str = "subtree", uncertainty: bool = True, m_min: int | float | str = "half-group",
                 root_fraction: float | None = None, rescue: int = 0, seed: int = 0, m_max: int | str | None = None):
        super().__init__(seed)
        if isinstance(rescue, bool) or not isinstance(rescue, int) or rescue < 0:
            raise ValueError(f"rescue must be an integer >= 0 (rounds of single rollouts; 0: off), got {rescue!r}")
        self.rescue = rescue
        if isinstance(m_min, bool) or not (
                m_min in M_MIN_RULES or (isinstance(m_min, int) and m_min >= 1)
                or (isinstance(m_min, float) and 0.0 < m_min < 1.0)):
            raise ValueError(f"m_min must be an integer >= 1, a fraction of the group size in (0, 1) or one of "
                             f"{M_MIN_RULES}, got {m_min!r}")
        if root_fraction is not None and not 0.0 < root_fraction <= 1.0:
            raise ValueError(f"root_fraction must be in (0, 1] (or None: the budget's), got {root_fraction}")
        if m_max is not None and m_max != "m_min" and (isinstance(m_max, bool) or not isinstance(m_max, int) or m_max < 1):
            raise ValueError(f"m_max must be None (the budget's max_per_prompt), an integer >= 1 or 'm_min', got {m_max!r}")
        if isinstance(m_max, int) and isinstance(m_min, int) and m_max < m_min:
            raise ValueError(f"m_max ({m_max}) must be at least m_min ({m_min})")
        self.m_min, self.m_max, self.root_fraction = m_min, m_max, root_fraction
        for label, stage, allowed in (("stage1", stage1, STAGES1), ("stage2", stage2, STAGES2)):
            if stage not in allowed:
                raise ValueError(f"{label} must be one of {allowed}, got {stage!r}")
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        self.stage1, self.stage2, self.scope = stage1, stage2, scope
        self.k_max, self.rounds = int(k_max), int(rounds)
        self.uncertainty = bool(uncertainty)
        if stage1 in ("paper", "posterior"):
            self.stage1, self.uncertainty = "active", stage1 == "posterior"
        self._round = 0  # stage-2 rounds played in the current step
        self._rescued = 0  # rescue rounds played in the current step
        self.evidence = BranchEvidence.empty()
        self.concentration = np.full(EVIDENCE_DEPTHS + 1, np.inf)
        """``stage2="posterior"``: the fitted ``c`` of prefixes at depth 0, 1, 2 and deeper."""

    @property
    def evidence(self) -> BranchEvidence:
        """``stage2="posterior"``: the branch groups its concentrations are fitted on (the last
        ``EVIDENCE_MEMORY``)."""
        return self._evidence

    @evidence.setter
    def evidence(self, value: BranchEvidence) -> None:
        self._evidence = value
        # each group's log-likelihood at every grid concentration, one column per group: a
        # step adds its own groups' columns instead of recomputing the whole window's
        self._ll = group_log_likelihoods(value, CONCENTRATIONS)

    def observe(self, forest: Forest) -> None:
        if self.stage2 != "posterior":
            return
        new = branch_evidence(forest)
        self._evidence = self._evidence.concat(new).tail(EVIDENCE_MEMORY)
        ll = np.concatenate([self._ll, group_log_likelihoods(new, CONCENTRATIONS)], axis=1)
        self._ll = np.ascontiguousarray(ll[:, ll.shape[1] - len(self._evidence):])
        self._fit()

    def _fit(self) -> None:
        """The maximum-likelihood concentration per depth bucket on the evidence window (the
        pooled one for a bucket with fewer than ``EVIDENCE_MIN`` groups)."""
        pooled = best_concentration(self._ll.sum(axis=1)) if len(self.evidence) >= EVIDENCE_MIN else np.inf
        bucket = np.minimum(self.evidence.depth, EVIDENCE_DEPTHS)
        for d in range(EVIDENCE_DEPTHS + 1):
            mine = bucket == d
            self.concentration[d] = best_concentration(self._ll[:, mine].sum(axis=1)) if mine.sum() >= EVIDENCE_MIN else pooled

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.stage2 == "posterior":
            state["evidence"] = self.evidence.to_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "evidence" in state:
            self.evidence = BranchEvidence.from_dict(state["evidence"])
            self._fit()

    def values(self, forest: Forest, nodes: np.ndarray, predictor: Any | None) -> np.ndarray:
        """V(H) of ``nodes`` as the allocator sees it (here: the predictor's), also stored in
        ``forest.pred``."""
        if predictor is None:
            raise ValueError(f"allocator {self.name!r} with an active stage needs a predictor (e.g. make_predictor('hashed'))")
        v = np.clip(np.asarray(predictor.predict(histories_for(forest, nodes, predictor)), dtype=np.float64), 0.0, 1.0)
        forest.pred[nodes] = v
        return v

    def beliefs(self, forest: Forest, nodes: np.ndarray, predictor: Any | None) -> tuple[np.ndarray, np.ndarray | None]:
        """``(mean, concentration)`` of V(H) for ``nodes``: the predictor's Beta predictive
        distribution where it offers one and ``uncertainty`` is on, else ``(values, None)``
        (point estimates). The mean is stored in ``forest.pred``."""
        beta = getattr(predictor, "predict_beta", None) if self.uncertainty else None
        if beta is None:
            return self.values(forest, nodes, predictor), None
        mean, conc = beta(histories_for(forest, nodes, predictor))
        mean = np.clip(np.asarray(mean, dtype=np.float64), 0.0, 1.0)
        forest.pred[nodes] = mean
        return mean, np.asarray(conc, dtype=np.float64)

    def stage1_budget(self, budget: Budget) -> Budget:
        """``budget`` with this allocator's own stage-1 settings (``m_min``, ``m_max``,
        ``root_fraction``; ``stage2="none"``: stage 1 spends all of M)."""
        changes: dict[str, Any] = {}
        if isinstance(self.m_min, float):
            # the tolerance keeps 0.3 x 10 at 3: the float product is 3.0000000000000004
            m_min = max(budget.min_per_prompt, math.ceil(self.m_min * budget.group_size - 1e-9))
        else:
            m_min = {"budget": budget.min_per_prompt,
                     "half-group": max(budget.min_per_prompt, budget.group_size // 2)}.get(self.m_min, self.m_min)
        if m_min != budget.min_per_prompt:
            changes["min_per_prompt"] = m_min
            if budget.max_per_prompt is not None:
                changes["max_per_prompt"] = max(budget.max_per_prompt, m_min)
        if self.m_max is not None:
            m_max = m_min if self.m_max == "m_min" else self.m_max
            if m_max < m_min:
                raise ValueError(f"m_max ({m_max}) must be at least m_min ({m_min}, from m_min={self.m_min!r} and the budget)")
            changes["max_per_prompt"] = m_max
        if self.root_fraction is not None:
            changes["root_fraction"] = self.root_fraction
        if self.stage2 == "none":
            changes["root_fraction"] = 1.0
        return dataclasses.replace(budget, **changes) if changes else budget

    def rescue_plan(self, forest: Forest, remaining: int, predictor: Any | None) -> list[tuple[int, int]]:
        """One fresh rollout for each still-pure prompt whose next outcome is expected to
        disagree often enough to pay: ``P(disagree) (n + 1) > 1``, where mixing a prompt of
        ``n`` rollouts makes all of them and the new one effective, and one rollout into a
        mixed prompt earns 1. ``P(disagree)`` comes from the root's belief as :meth:`beliefs`
        gives it: a Beta predictive (``predict_beta``, with ``uncertainty`` on) is updated with
        the prompt's ``n`` equal outcomes of this step; a point estimate is used as it is.
        Best first, at most ``remaining``."""
        roots = forest.root_nodes.astype(np.int64)
        pure = (forest.n_leaves[roots] > 0) & (forest.leaf_min[roots] == forest.leaf_max[roots])
        cand = roots[pure]
        if cand.size == 0:
            return []
        n = forest.n_leaves[cand].astype(np.float64)
        succeeded = forest.leaf_min[cand] >= 0.5
        mean, conc = self.beliefs(forest, cand, predictor)
        if conc is None:
            conc = np.full(cand.size, np.inf)
        finite = np.isfinite(conc)
        post = mean.copy()
        post[finite] = (conc[finite] * mean[finite] + n[finite] * succeeded[finite]) / (conc[finite] + n[finite])
        gain = np.where(succeeded, 1.0 - post, post) * (n + 1.0)
        worth = np.flatnonzero(gain > 1.0)
        order = worth[np.argsort(-gain[worth], kind="stable")][:remaining]
        return [(int(node), 1) for node in cand[order]]

    def plan_roots(self, forest: Forest, budget: Budget, predictor: Any | None) -> np.ndarray:
        self._round = 0
        self._rescued = 0
        budget = self.stage1_budget(budget)
        if self.stage1 == "uniform":
            return uniform_roots(forest.n_trees, budget, self.rng)
        v, conc = self.beliefs(forest, forest.root_nodes.astype(np.int64), predictor)
        if conc is None or np.all(np.isinf(conc)):
            return solve_roots(v, budget.root_trajectories, budget.min_per_prompt, budget.max_per_prompt or 0)
        return solve_roots_beta(v, conc, budget.root_trajectories, budget.min_per_prompt, budget.max_per_prompt or 0)

    def plan_prefixes(self, forest: Forest, budget: Budget, remaining: int, predictor: Any | None) -> list[tuple[int, int]]:
        if self.stage2 == "none":
            return []
        if self.stage2 == "uniform":
            return uniform_prefixes(forest, remaining, self.rng)
        if self._rescued < self.rescue:
            self._rescued += 1
            plan = self.rescue_plan(forest, remaining, predictor)
            if plan:
                return plan
            self._rescued = self.rescue  # nothing worth a rescue now: stage 2's objective has the rest of the step
        rounds_left = max(1, self.rounds - self._round)
        self._round += 1
        remaining = -(-remaining // rounds_left)  # this round's equal share, rounded up
        pure = ((forest.flags & TERMINAL) == 0) & (forest.n_leaves > 0) & (forest.leaf_min == forest.leaf_max)
        if self.scope != "subtree":
            roots = forest.root_nodes[forest.tree]
            tree_pure = forest.leaf_min[roots] == forest.leaf_max[roots]
            if self.scope == "tree":
                pure &= tree_pure
            elif np.any(pure & ~tree_pure):  # "mixed"; with no mixed tree, every pure prefix
                pure &= ~tree_pure
        nodes = np.flatnonzero(pure)
        if nodes.size == 0:
            return uniform_prefixes(forest, remaining, self.rng)
        v = self.values(forest, nodes, predictor)
        if self.stage2 == "posterior":
            c = self.concentration[np.minimum(forest.depth[nodes], EVIDENCE_DEPTHS)]
            ks = solve_prefixes_beta(v, forest.leaf_min[nodes], forest.n_leaves[nodes], c, remaining, self.k_max)
        else:
            ks = solve_prefixes(v, forest.leaf_min[nodes], remaining, self.k_max)
        keep = ks > 0
        return list(zip(nodes[keep].tolist(), ks[keep].tolist()))


@register("trace-paper")
class TracePaperAllocator(TraceAllocator):
    """The paper's exact rule (PAPER.md sec. 3), kept by name beside the measured default
    ``trace``: stage 1 at the predictor's point estimate (``V_root``), stage 2 over every
    pure prefix (``scope="subtree"``), one greedy pass, one shared predictor (``hashed``, no
    per-prompt counts) and the tree-aware advantage ``V(y) - V(parent)`` unscaled (PAPER.md
    marks that advantage as this project's reading of the paper). Options as for ``trace``;
    its defaults are the paper's (``m_min`` the budget's, 2 by default). It differs from the
    default ``trace`` in the advantage and the stage-1 group minimum, and in ContrastLab's
    learning mode it learns no faster than ``grpo`` (the README's "Measured")."""

    name = "trace-paper"
    default_predictor: ClassVar[str | None] = "hashed"
    advantage: ClassVar[str] = "trace"

    def __init__(self, stage1: str = "paper", stage2: str = "active", k_max: int = 0, rounds: int = 1,
                 scope: str = "subtree", uncertainty: bool = False, m_min: int | float | str = "budget",
                 root_fraction: float | None = None, rescue: int = 0, seed: int = 0, m_max: int | str | None = None):
        super().__init__(stage1=stage1, stage2=stage2, k_max=k_max, rounds=rounds, scope=scope, uncertainty=uncertainty,
                         m_min=m_min, root_fraction=root_fraction, rescue=rescue, seed=seed, m_max=m_max)
