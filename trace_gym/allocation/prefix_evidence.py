"""What a pure prefix's outcomes say about its next one: the evidence behind stage 2's
posterior (``trace:stage2=posterior``).

Stage 2 scores a pure prefix by the chance that more continuations from it end with
another outcome than the ``n`` leaves already below it. The paper reads that chance off
the predictor's value ``v`` alone, as if the ``n`` equal outcomes said nothing. Under the
model

    V(prefix) ~ Beta(c v, c (1 - v)),  outcomes below it i.i.d. Bernoulli(V(prefix)),

they say a lot when ``c`` is small (a prefix's outcome is nearly settled once it is written,
e.g. after a model's first tool call) and little when ``c`` is large (the paper's point
estimate is ``c = inf``). ``c`` is not known in advance and differs by depth, so it is
estimated from the run itself: every group of continuations started from a prefix whose
earlier leaves all agreed is one observation (:func:`branch_evidence`), and
:func:`fit_concentration` takes the maximum-likelihood ``c`` of the beta-binomial over a
grid that includes ``inf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np
from scipy.special import gammaln

from trace_gym.allocation.solvers import agreement
from trace_gym.forest.forest import TERMINAL, Forest

__all__ = ["BranchEvidence", "branch_evidence", "group_log_likelihoods", "log_likelihood", "best_concentration",
           "fit_concentration", "CONCENTRATIONS"]

CONCENTRATIONS = np.concatenate([np.logspace(-2, 4, 61), [np.inf]])
"""The grid :func:`fit_concentration` searches (0.01 to 10^4, ten points a decade, and inf)."""

_EDGE = 1e-3  # predictions of exactly 0 or 1 would make one outcome impossible under any c


@dataclass
class BranchEvidence:
    """One row per group of continuations started together from a pure prefix.

    Attributes (1-d arrays of one length):
        depth: the prefix's depth (0: a prompt, i.e. fresh rollouts of a sampled prompt).
        agree: the predicted chance that one continuation agrees with the outcome seen below
            (:func:`~trace_gym.allocation.solvers.agreement`: ``r v + (1 - r)(1 - v)`` with the
            prefix's prediction ``v`` from ``forest.pred``).
        n: finished leaves below the prefix before the group started (all with outcome ``r``).
        t: the group's finished continuations.
        s: those among them whose reward differs from ``r``.
    """

    depth: np.ndarray
    agree: np.ndarray
    n: np.ndarray
    t: np.ndarray
    s: np.ndarray

    def __len__(self) -> int:
        return int(self.depth.size)

    @classmethod
    def empty(cls) -> "BranchEvidence":
        """No rows."""
        return cls(np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0))

    def concat(self, other: "BranchEvidence") -> "BranchEvidence":
        """These rows, then ``other``'s."""
        return BranchEvidence(*(np.concatenate([getattr(self, f), getattr(other, f)]) for f in _FIELDS))

    def tail(self, size: int) -> "BranchEvidence":
        """The last ``size`` rows (the most recent evidence)."""
        return BranchEvidence(*(getattr(self, f)[-size:] if size else getattr(self, f)[:0] for f in _FIELDS))

    def where(self, mask: np.ndarray) -> "BranchEvidence":
        """The rows where ``mask`` (a boolean array of this length) holds."""
        return BranchEvidence(*(getattr(self, f)[mask] for f in _FIELDS))

    def to_dict(self) -> dict[str, list]:
        """Plain lists by field, for a checkpoint; :meth:`from_dict` reads them back."""
        return {f: getattr(self, f).tolist() for f in _FIELDS}

    @classmethod
    def from_dict(cls, d: dict[str, list]) -> "BranchEvidence":
        """The evidence :meth:`to_dict` wrote."""
        return cls(np.asarray(d["depth"], np.int64), *(np.asarray(d[f], np.float64) for f in _FIELDS[1:]))


_FIELDS = ("depth", "agree", "n", "t", "s")


def branch_evidence(forest: Forest) -> BranchEvidence:
    """The groups of continuations in a finished forest that started from a pure prefix.

    Trajectories are taken in the order they were started; a group is a run of consecutive
    trajectories with one origin (an allocator's ``(node, k)`` plan entry). The group counts
    when the finished trajectories started before it that pass through its origin number at
    least one and share one reward ``r``, and the origin carries a prediction. A prompt's
    first rollouts (stage 1) have nothing before them and never count. Two plans in a row
    that end and start at one node make one group: its likelihood is still exact (the
    beta-binomial chain rule: the second plan's outcomes conditioned on the first's), though
    the group's ``s`` then counts the second plan's continuations even where the first's
    already disagreed."""
    T = forest.n_trajectories
    if T == 0:
        return BranchEvidence.empty()
    parent, depth = forest.parent, forest.depth
    origin = forest.traj_origin.astype(np.int64)
    leaf = forest.traj_leaf.astype(np.int64)
    reward = forest.reward[leaf]
    done = ((forest.flags[leaf] & TERMINAL) != 0) & ~np.isnan(reward)
    max_depth = int(depth[leaf].max())
    anc = np.full((T, max_depth + 1), -1, dtype=np.int64)  # anc[i, d]: trajectory i's node at depth d
    node = leaf.copy()
    for _ in range(max_depth + 1):
        ok = node >= 0
        anc[np.flatnonzero(ok), depth[node[ok]]] = node[ok]
        node = np.where(ok, parent[np.maximum(node, 0)], -1)
    rows = _groups_kernel(origin, anc, done, reward, depth, forest.pred)
    if rows.shape[0] == 0:
        return BranchEvidence.empty()
    return BranchEvidence(rows[:, 0].astype(np.int64), agreement(rows[:, 1], rows[:, 2]), rows[:, 3].copy(),
                          rows[:, 4].copy(), rows[:, 5].copy())


@nb.njit(cache=True, nogil=True)
def _groups_kernel(origin, anc, done, reward, depth, pred):
    """Rows ``(depth, v, r, n, t, s)`` of :func:`branch_evidence`, one per counted group: the
    prefix's prediction ``v`` and the outcome ``r`` seen below it, for ``agree``."""
    T = origin.shape[0]
    out = np.empty((T, 6))
    k = 0
    i0 = 0
    while i0 < T:
        o = origin[i0]
        i1 = i0 + 1
        while i1 < T and origin[i1] == o:
            i1 += 1
        d = depth[o]
        v = pred[o]
        n = 0
        r = 0.0
        pure = True
        for i in range(i0):
            if done[i] and anc[i, d] == o:
                if n == 0:
                    r = reward[i]
                elif reward[i] != r:
                    pure = False
                    break
                n += 1
        if n > 0 and pure and not np.isnan(v):
            t = 0
            s = 0
            for i in range(i0, i1):
                if done[i]:
                    t += 1
                    if reward[i] != r:
                        s += 1
            if t > 0:
                out[k, 0] = d
                out[k, 1] = v
                out[k, 2] = r
                out[k, 3] = n
                out[k, 4] = t
                out[k, 5] = s
                k += 1
        i0 = i1
    return out[:k]


def group_log_likelihoods(evidence: BranchEvidence, c: np.ndarray) -> np.ndarray:
    """``(len(c), len(evidence))``: each group's log-likelihood of its outcomes (as a
    sequence) for each concentration in ``c``, given what its prefix had shown before it. A
    group's entries do not depend on the other groups, so a sliding window of evidence can
    keep its columns and compute only the new groups'."""
    c = np.atleast_1d(np.asarray(c, dtype=np.float64))
    p = np.clip(evidence.agree, _EDGE, 1.0 - _EDGE)[None, :]
    n, t, s = evidence.n[None, :], evidence.t[None, :], evidence.s[None, :]
    out = np.empty((c.size, len(evidence)))
    point = np.isinf(c)
    out[point] = (t - s) * np.log(p) + s * np.log1p(-p)
    cc = c[~point][:, None]
    if cc.size:
        a, b = cc * p + n, cc * (1.0 - p)
        out[~point] = gammaln(a + t - s) - gammaln(a) + gammaln(b + s) - gammaln(b) - gammaln(a + b + t) + gammaln(a + b)
    return out


def log_likelihood(evidence: BranchEvidence, c: np.ndarray) -> np.ndarray:
    """Log-likelihood of the groups' outcomes (as sequences) for each concentration in ``c``,
    given what each group's prefix had shown before it: the row sums of
    :func:`group_log_likelihoods`."""
    return group_log_likelihoods(evidence, c).sum(axis=1)


def best_concentration(ll: np.ndarray, grid: np.ndarray = CONCENTRATIONS) -> float:
    """The concentration of ``grid`` whose log-likelihood ``ll`` (one per grid point) is
    largest; ties (within rounding) go to the larger ``c``, i.e. trust the predictor when the
    evidence cannot tell."""
    ll = np.asarray(ll, dtype=np.float64)
    best = np.flatnonzero(ll >= ll.max() - 1e-9 * (1.0 + abs(ll.max())))
    return float(np.asarray(grid, dtype=np.float64)[best[-1]])


def fit_concentration(evidence: BranchEvidence, grid: np.ndarray = CONCENTRATIONS) -> float:
    """The maximum-likelihood concentration ``c`` on ``grid`` (:func:`best_concentration`);
    ``inf`` without evidence."""
    if len(evidence) == 0:
        return float("inf")
    return best_concentration(log_likelihood(evidence, grid), grid)
