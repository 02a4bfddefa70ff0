"""Exact greedy solvers for the two allocation stages (PAPER.md sec. 3), in numba.

Stage 1, :func:`solve_roots`: rollouts per candidate prompt,

    maximise  sum_i V_root(v_i, m_i),   V_root(v, m) = 1 - v^m - (1-v)^m  (0 for m = 0)
    s.t.      m_i in {0} u [m_min, m_max],   sum_i m_i <= budget.

Stage 2, :func:`solve_prefixes`: continuations per prefix,

    maximise  sum_j V_pref(v_j, r_j, k_j),  V_pref(v, r, k) = 1 - (r v + (1-r)(1-v))^k
    s.t.      0 <= k_j <= k_max,   sum_j k_j <= budget.

:func:`solve_prefixes_beta` is stage 2 with each prefix's value uncertain: ``V ~ Beta(c v,
c (1 - v))`` updated with the ``n`` outcomes already seen below the prefix (all equal to
``r``, the prefix being pure), so the chance that ``k`` more continuations all agree with
them is ``prod_{j<k} (A + j) / (c + n + j)``, ``A = c (r v + (1-r)(1-v)) + n``.

Stage 2 is separable and concave in k: taking the largest marginal gain from a heap, one
unit at a time, is optimal. Stage 1 is not concave at the start (V_root(v, 1) = 0, so the
first ``m_min`` units of a prompt only pay off together), and neither the unit greedy nor
a greedy over "blocks of m_min" is optimal. What makes it exact and still fast:

* Write p = min(v, 1-v). V_root(v, m) depends on p only and is non-decreasing in p for
  every m (d/dp = m[(1-p)^(m-1) - p^(m-1)] >= 0 on [0, 1/2]). So in any solution, moving
  the allocation of an active prompt to an inactive prompt with larger p loses nothing:
  some optimal solution activates exactly the K prompts with the largest p.
* For a fixed active set, each prompt holds m_min units plus "extras", and V_root is
  concave in the extras (the gain of unit m >= 2 is p q (p^(m-2) + q^(m-2)), q = 1-p,
  non-increasing in m), so the best use of the R_K = budget - K m_min extras is the unit
  greedy over the active prompts.
* Sweep K from its largest value down to 0: dropping the K-th prompt frees its extras
  and m_min units, which go greedily to the others. Each K's optimum is thus one heap
  sweep, and the best K (ties: more units spent, then more prompts) is re-solved once.
  More prompts on a tie: when no unit can raise the objective (every prediction 0 or 1,
  e.g. after a step in which every rollout failed), the budget goes out in groups of
  ``m_min`` over as many prompts as it covers instead of piling onto one prompt.

Ties between equal gains go to the lower index (stage 1: larger p, then lower index), so
results are deterministic. Both solvers spend the whole budget whenever the caps allow:
units with zero gain still go somewhere (stage 1 among the optimal solutions prefers the
one that spends the most), and neither ever spends more than the budget.
"""

from __future__ import annotations

import operator

import numba as nb
import numpy as np

__all__ = ["solve_roots", "solve_prefixes", "solve_prefixes_beta", "v_root", "v_pref", "v_pref_beta", "agreement"]

# Two stage-1 candidates whose objectives differ by less than this (relative) are a tie.
_TIE_RTOL = 1e-13


def v_root(v, m):
    """V_root(v, m) = 1 - v^m - (1-v)^m for m >= 1, 0 for m = 0: the chance that m
    rollouts of a prompt with success probability v are mixed (vectorised)."""
    v = np.asarray(v, dtype=np.float64)
    m = np.asarray(m)
    return np.where(m > 0, 1.0 - v**m - (1.0 - v) ** m, 0.0)


def v_pref(v, r, k):
    """V_pref(v, r, k) = 1 - (r v + (1-r)(1-v))^k: the chance that at least one of k
    continuations from a prefix of value v disagrees with the observed outcome r."""
    return 1.0 - agreement(v, r) ** np.asarray(k)


def agreement(v, r) -> np.ndarray:
    """``r v + (1 - r)(1 - v)`` clipped to [0, 1]: the chance that one continuation from a
    prefix of value ``v`` ends with the outcome ``r`` seen below it."""
    v = np.asarray(v, dtype=np.float64)
    r = np.asarray(r, dtype=np.float64)
    return np.clip(r * v + (1.0 - r) * (1.0 - v), 0.0, 1.0)


def v_pref_beta(v, r, n, c, k):
    """V_pref under uncertainty: the chance that at least one of ``k`` continuations from a
    prefix disagrees with the ``n`` equal outcomes ``r`` already seen below it, when the
    prefix's value is ``Beta(c v, c (1-v))`` before them (``c = inf``: :func:`v_pref`).
    Vectorised over equal-shaped arrays; ``k`` up to a few hundred."""
    v, r, n, c, k = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (v, r, n, c, k)))
    s = agreement(v, r)
    out = np.empty(v.shape)
    point = np.isinf(c)
    out[point] = 1.0 - s[point] ** k[point]
    if np.any(~point):
        cc, nn, kk = c[~point], n[~point], k[~point]
        a = cc * s[~point] + nn
        j = np.arange(int(kk.max()) if kk.size else 0)
        terms = np.where(j[None, :] < kk[..., None], (a[..., None] + j) / (cc[..., None] + nn[..., None] + j), 1.0)
        out[~point] = 1.0 - np.prod(terms, axis=-1)
    return out


# ----------------------------------------------------------------------------- heap

@nb.njit(cache=True, nogil=True)
def _ahead(key, a, b):
    """Heap order: larger key first, then the lower item id."""
    return key[a] > key[b] or (key[a] == key[b] and a < b)


@nb.njit(cache=True, nogil=True)
def _sift_down(heap, size, pos, key):
    item = heap[pos]
    while True:
        child = 2 * pos + 1
        if child >= size:
            break
        if child + 1 < size and _ahead(key, heap[child + 1], heap[child]):
            child += 1
        if _ahead(key, heap[child], item):
            heap[pos] = heap[child]
            pos = child
        else:
            break
    heap[pos] = item


@nb.njit(cache=True, nogil=True)
def _heapify(heap, size, key):
    for pos in range(size // 2 - 1, -1, -1):
        _sift_down(heap, size, pos, key)


@nb.njit(cache=True, nogil=True)
def _pop_top(heap, size, key):
    """Remove the top item; returns the new size."""
    size -= 1
    if size > 0:
        heap[0] = heap[size]
        _sift_down(heap, size, 0, key)
    return size


# ----------------------------------------------------------------------------- stage 1

@nb.njit(cache=True, nogil=True)
def _fill_extras(K, R, ps, qs, pp, qq, key, taken, gained, heap, size, extra_cap, acc):
    """Give extras (units beyond m_min) greedily to active items 0..K-1 until R are placed
    or every active item is capped. Items >= K still in the heap are dropped lazily.
    ``acc`` = [extras placed, value sum, Neumaier compensation]; returns the heap size."""
    while acc[0] < R and size > 0:
        j = heap[0]
        if j >= K:
            size = _pop_top(heap, size, key)
            continue
        g = key[j]
        s = acc[1] + g
        if abs(acc[1]) >= abs(g):
            acc[2] += (acc[1] - s) + g
        else:
            acc[2] += (g - s) + acc[1]
        acc[1] = s
        acc[0] += 1.0
        taken[j] += 1
        gained[j] += g
        pp[j] *= ps[j]
        qq[j] *= qs[j]
        key[j] = ps[j] * qs[j] * (pp[j] + qq[j])
        if taken[j] >= extra_cap:
            size = _pop_top(heap, size, key)
        else:
            _sift_down(heap, size, 0, key)
    return size


@nb.njit(cache=True, nogil=True)
def _init_extras(kmax, ps, qs, m_min, pp, qq, key, taken, gained, heap):
    for j in range(kmax):
        # the next unit is unit m_min + 1 >= 2; its gain is p q (p^(m-2) + q^(m-2))
        pp[j] = ps[j] ** (m_min - 1)
        qq[j] = qs[j] ** (m_min - 1)
        key[j] = ps[j] * qs[j] * (pp[j] + qq[j])
        taken[j] = 0
        gained[j] = 0.0
        heap[j] = j


@nb.njit(cache=True, nogil=True)
def _solve_roots_kernel(v, budget, m_min, m_max, tie_rtol):
    n = v.shape[0]
    out = np.zeros(n, dtype=np.int64)
    kmax = min(n, budget // m_min)
    if kmax <= 0:
        return out
    p = np.empty(n)
    for i in range(n):
        p[i] = min(v[i], 1.0 - v[i])
    order = np.argsort(-p, kind="mergesort")  # stable: equal p keep index order
    extra_cap = (m_max - m_min) if m_max > 0 else budget
    ps = np.empty(kmax)
    qs = np.empty(kmax)
    base = np.empty(kmax)
    for j in range(kmax):
        ps[j] = p[order[j]]
        qs[j] = 1.0 - ps[j]
        base[j] = 1.0 - ps[j] ** m_min - qs[j] ** m_min
    pp = np.empty(kmax)
    qq = np.empty(kmax)
    key = np.empty(kmax)
    taken = np.zeros(kmax, dtype=np.int64)
    gained = np.zeros(kmax)  # value of each item's extras, removed from the total when it is dropped
    heap = np.empty(kmax, dtype=np.int64)
    _init_extras(kmax, ps, qs, m_min, pp, qq, key, taken, gained, heap)
    size = kmax if extra_cap > 0 else 0
    _heapify(heap, size, key)

    # base sums for the top-K prefix, compensated
    base_sum = np.zeros(kmax + 1)
    s = 0.0
    c = 0.0
    for j in range(kmax):
        t = s + base[j]
        if abs(s) >= abs(base[j]):
            c += (s - t) + base[j]
        else:
            c += (base[j] - t) + s
        s = t
        base_sum[j + 1] = s + c

    value = np.zeros(kmax + 1)
    spend = np.zeros(kmax + 1, dtype=np.int64)
    acc = np.zeros(3)  # extras placed, value of extras, compensation
    K = kmax
    while K >= 1:
        size = _fill_extras(K, budget - K * m_min, ps, qs, pp, qq, key, taken, gained, heap, size, extra_cap, acc)
        value[K] = base_sum[K] + (acc[1] + acc[2])
        spend[K] = K * m_min + int(acc[0])
        # drop item K-1 (smallest p): its extras return to the pool
        K -= 1
        g = -gained[K]
        t = acc[1] + g
        if abs(acc[1]) >= abs(g):
            acc[2] += (acc[1] - t) + g
        else:
            acc[2] += (g - t) + acc[1]
        acc[1] = t
        acc[0] -= taken[K]

    best = 0
    top = 0.0
    for K in range(kmax + 1):
        if value[K] > top:
            top = value[K]
    tol = tie_rtol * max(1.0, top)
    for K in range(1, kmax + 1):
        if value[K] >= top - tol and (value[best] < top - tol or spend[K] >= spend[best]):
            best = K
    if best == 0:
        return out

    _init_extras(best, ps, qs, m_min, pp, qq, key, taken, gained, heap)
    size = best if extra_cap > 0 else 0
    _heapify(heap, size, key)
    acc[:] = 0.0
    _fill_extras(best, budget - best * m_min, ps, qs, pp, qq, key, taken, gained, heap, size, extra_cap, acc)
    for j in range(best):
        out[order[j]] = m_min + taken[j]
    return out


def _as_budget(budget) -> int:
    try:
        b = operator.index(budget)
    except TypeError:
        raise TypeError(f"budget must be an integer, got {budget!r}") from None
    if b < 0:
        raise ValueError(f"budget must be >= 0, got {b}")
    return b


def _as_probabilities(x, name: str) -> np.ndarray:
    a = np.ascontiguousarray(x, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {a.shape}")
    if a.size and not bool(np.all((a >= 0.0) & (a <= 1.0))):
        bad = a[~((a >= 0.0) & (a <= 1.0))][:3]
        raise ValueError(f"{name} must hold probabilities in [0, 1] (no NaN); got e.g. {bad.tolist()}")
    return a


def solve_roots(v: np.ndarray, budget: int, m_min: int = 2, m_max: int = 0) -> np.ndarray:
    """Stage 1: rollouts per prompt, the exact maximiser of sum_i V_root(v_i, m_i).

    Args:
        v: predicted success probability of each candidate prompt, in [0, 1] (0 and 1
            allowed: such a prompt can never be mixed).
        budget: most rollouts to hand out (M_root).
        m_min: fewest rollouts a selected prompt gets (>= 1).
        m_max: most rollouts one prompt gets; ``<= 0`` means no cap.

    Returns:
        int64 array ``m`` of ``len(v)`` with every ``m_i`` in ``{0} u [m_min, m_max]`` and
        ``sum(m) <= budget``, maximising the objective. Among optimal allocations the one
        spending the most units is chosen, so the whole budget is spent whenever the caps
        allow it (zero-gain units included). Deterministic: equal gains go to the prompt
        with ``min(v, 1-v)`` nearer 1/2, then to the lower index.
    """
    v = _as_probabilities(v, "v")
    budget = _as_budget(budget)
    m_min, m_max = operator.index(m_min), operator.index(m_max)
    if m_min < 1:
        raise ValueError(f"m_min must be >= 1, got {m_min}")
    if m_max > 0 and m_max < m_min:
        raise ValueError(f"m_max ({m_max}) must be 0 (no cap) or at least m_min ({m_min})")
    return _solve_roots_kernel(v, budget, m_min, m_max, _TIE_RTOL)


# ----------------------------------------------------------------------------- stage 2

@nb.njit(cache=True, nogil=True)
def _solve_prefixes_kernel(s, n, c, budget, k_max):
    """The unit greedy of both stage-2 solvers (``c = inf``: the point estimate ``s``)."""
    m = s.shape[0]
    out = np.zeros(m, dtype=np.int64)
    if m == 0 or budget <= 0:
        return out
    cap = k_max if k_max > 0 else budget
    agree = np.empty(m)  # chance that all units so far agree
    key = np.empty(m)
    heap = np.empty(m, dtype=np.int64)
    for j in range(m):
        agree[j] = 1.0
        key[j] = 1.0 - _q(s[j], n[j], c[j], 0)
        heap[j] = j
    size = m
    _heapify(heap, size, key)
    spent = 0
    while spent < budget and size > 0:
        j = heap[0]
        agree[j] *= _q(s[j], n[j], c[j], out[j])
        out[j] += 1
        spent += 1
        key[j] = agree[j] * (1.0 - _q(s[j], n[j], c[j], out[j]))
        if out[j] >= cap:
            size = _pop_top(heap, size, key)
        else:
            _sift_down(heap, size, 0, key)
    return out


@nb.njit(cache=True, nogil=True)
def _q(s, n, c, k):
    """Chance that continuation k + 1 agrees, given that the k before it and the n seen did."""
    if np.isinf(c):
        return s
    return (c * s + n + k) / (c + n + k)


def solve_prefixes_beta(v: np.ndarray, r: np.ndarray, n: np.ndarray, concentration: np.ndarray, budget: int,
                        k_max: int = 0) -> np.ndarray:
    """Stage 2 under uncertainty: continuations per prefix, the exact maximiser of
    ``sum_j v_pref_beta(v_j, r_j, n_j, c_j, k_j)``.

    Args:
        v: predicted value of each prefix (the prior mean), in [0, 1].
        r: the observed outcome below each prefix, in [0, 1].
        n: how many finished leaves below each prefix share that outcome (>= 0).
        concentration: ``c`` of each prefix's Beta prior, > 0; ``inf`` gives the point
            estimate, so all-``inf`` returns exactly :func:`solve_prefixes`.
        budget, k_max: as for :func:`solve_prefixes`.

    Returns:
        int64 array ``k`` as :func:`solve_prefixes`. The objective stays concave in ``k``
        (each further agreement is likelier than the one before it), so the unit greedy is
        optimal.
    """
    v = _as_probabilities(v, "v")
    r = _as_probabilities(r, "r")
    n = np.asarray(n, dtype=np.float64)
    c = np.asarray(concentration, dtype=np.float64)
    if not (v.shape == r.shape == n.shape == c.shape):
        raise ValueError(f"v, r, n and concentration must have one length, got {v.shape}, {r.shape}, {n.shape} and {c.shape}")
    if np.any(~(n >= 0)):
        raise ValueError("n (outcomes seen below each prefix) must be >= 0")
    if np.any(~(c > 0)):
        raise ValueError("concentrations must be positive (inf for a point estimate)")
    budget = _as_budget(budget)
    return _solve_prefixes_kernel(agreement(v, r), n, c, budget, operator.index(k_max))


def solve_prefixes(v: np.ndarray, r: np.ndarray, budget: int, k_max: int = 0) -> np.ndarray:
    """Stage 2: continuations per prefix, the exact maximiser of sum_j V_pref(v_j, r_j, k_j).

    Args:
        v: predicted value V(H) of each prefix, in [0, 1].
        r: the observed outcome below each prefix, in [0, 1] (a leaf's reward; for a node
            with several leaves, its backed-up value).
        budget: most continuations to hand out (the stage-2 budget).
        k_max: most continuations from one prefix; ``<= 0`` means no cap.

    Returns:
        int64 array ``k`` of ``len(v)``, ``0 <= k_j <= k_max``, ``sum(k) == min(budget,
        len(v) * k_max)`` (``== budget`` uncapped, when ``len(v) > 0``): V_pref is concave
        in k, so the unit greedy (largest marginal gain first, ties to the lower index) is
        optimal, and zero-gain units are still placed.
    """
    v = _as_probabilities(v, "v")
    r = _as_probabilities(r, "r")
    if v.shape != r.shape:
        raise ValueError(f"v and r must have the same length, got {v.shape[0]} and {r.shape[0]}")
    budget = _as_budget(budget)
    return _solve_prefixes_kernel(agreement(v, r), np.zeros(v.size), np.full(v.size, np.inf), budget, operator.index(k_max))
