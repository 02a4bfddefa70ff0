"""Advantage estimators over a rollout forest, registered by name.

Each estimator is a small pure function ``fn(forest, **kw) -> float64 array`` of
``len(forest)``: the advantage of every node, whose generated tokens all get that value
(in the spirit of verl's ``core_algos.py``). ``Forest.advantages(name, **kw)`` backs the
forest up and calls it. A user adds one with ``@trace_gym.register_advantage("name")``,
or from an installed package through the entry-point group ``trace_gym.advantages``
(``name = "pkg.module:fn"``).

Conventions shared by all estimators:

* A *finished leaf* is a terminal node that carries a reward. Unfinished trajectories
  (no finished leaf below a node) get advantage 0 on all their nodes, and so do roots.
* V(y) is the backed-up value: the mean reward of the finished leaves below y; n_y their
  number; a node is *mixed* when those rewards are not all equal.
* Leaf-level estimators (``grpo``, ``dr_grpo``, ``rloo``, ``tree_grpo``) define an
  advantage A(l) per finished leaf; a node's advantage is the mean of A(l) over the
  finished leaves below it. A prefix shared by several trajectories gets their average;
  a node on an unbranched path gets its trajectory's leaf advantage.
* A group (a set of finished leaves that is compared) of one leaf, or whose rewards are
  all equal, gives 0, never a raw score (verl's group-of-one pitfall).
* Exact zeros: advantages with ``|A| <= ZERO_ATOL`` (1e-12) are set to 0. They can only be
  rounding residue of an exact cancellation (e.g. V(y) = V(parent) computed through
  different sums), and "non-zero advantage" is what the effective sample ratio counts.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable

import numba as nb
import numpy as np

from trace_gym.registry import ADVANTAGE_GROUP, Registry

if TYPE_CHECKING:  # the forest imports this module (Forest.advantages); estimators only read its arrays
    from trace_gym.forest.forest import Forest

__all__ = ["ADVANTAGES", "ZERO_ATOL", "register_advantage", "resolve_estimator", "grpo", "dr_grpo", "rloo", "treerl", "tree_grpo", "trace", "node_std"]

ADVANTAGES: Registry[np.ndarray] = Registry("advantage estimator", group=ADVANTAGE_GROUP)
"""Name -> estimator ``fn(forest, **kw) -> float64[len(forest)]``; also the entry-point
group ``trace_gym.advantages``."""


def register_advantage(name: str, fn: Callable[..., np.ndarray] | None = None, *, overwrite: bool = False):
    """Register an advantage estimator under ``name`` (a decorator when ``fn`` is omitted).

    ``fn(forest, **options) -> np.ndarray`` receives a backed-up :class:`Forest` and returns
    a float64 array of ``len(forest)``: the advantage of every node (0 at roots), which all
    of the node's generated tokens get. Its keyword parameters are the estimator's options
    (``forest.advantages("name:opt=value")``); it must not modify the forest. A taken name
    raises ``ValueError`` unless ``overwrite=True``. Installed packages can instead declare
    ``name = "pkg.module:fn"`` in the entry-point group ``trace_gym.advantages``.
    """
    return ADVANTAGES.register(name, fn, overwrite=overwrite)

ZERO_ATOL = 1e-12


def resolve_estimator(spec: str, **kwargs: Any) -> tuple[Callable[..., np.ndarray], dict[str, Any]]:
    """The estimator named by ``spec`` (``"trace"``, or with options ``"trace:scale=group"``)
    and its keyword arguments (``kwargs`` override the spec's options). Unknown names raise
    with suggestions; an option the estimator does not take raises ``ValueError`` naming it
    and the ones it does take."""
    name, options = ADVANTAGES.parse(spec)
    fn = ADVANTAGES.get(name)
    kwargs = {**options, **kwargs}
    if kwargs:
        params = list(inspect.signature(fn).parameters.values())
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            allowed = [p.name for p in params[1:]]  # the first is the forest
            for key in kwargs:
                if key not in allowed:
                    raise ValueError(f"advantage estimator {name!r}: unknown option {key!r} "
                                     f"(options: {', '.join(allowed) or 'none'})")
    return fn, kwargs


# ----------------------------------------------------------------------------- kernels

@nb.njit(cache=True, nogil=True)
def node_std_kernel(parent, tree, flags, reward, value, root_nodes, n_leaves):
    """Sample standard deviation (ddof=1) of the finished-leaf rewards below every node
    (NaN where fewer than two). Sums are shifted by the tree's mean, so the one-pass
    formula does not cancel catastrophically."""
    n = parent.shape[0]
    s1 = np.zeros(n)
    s2 = np.zeros(n)
    for i in range(n):
        if (flags[i] & 1) and not np.isnan(reward[i]):
            d = reward[i] - value[root_nodes[tree[i]]]
            s1[i] = d
            s2[i] = d * d
    for i in range(n - 1, -1, -1):
        p = parent[i]
        if p >= 0:
            s1[p] += s1[i]
            s2[p] += s2[i]
    out = np.full(n, np.nan)
    for i in range(n):
        k = n_leaves[i]
        if k >= 2:
            out[i] = np.sqrt(max(k * s2[i] - s1[i] * s1[i], 0.0) / (k * (k - 1.0)))
    return out


@nb.njit(cache=True, nogil=True)
def _snap(x, atol):
    return 0.0 if abs(x) <= atol else x


@nb.njit(cache=True, nogil=True)
def centered_kernel(parent, tree, n_leaves, value, root_nodes, coef, atol):
    """``coef[tree] * (V(y) - V(root))`` at every non-root node with finished leaves: the
    mean over y's leaves of ``coef * (r - mean of the tree's leaves)``."""
    n = parent.shape[0]
    out = np.zeros(n)
    for i in range(n):
        if parent[i] >= 0 and n_leaves[i] > 0:
            t = tree[i]
            c = coef[t]
            if c != 0.0:
                out[i] = _snap(c * (value[i] - value[root_nodes[t]]), atol)
    return out


@nb.njit(cache=True, nogil=True)
def trace_kernel(parent, n_leaves, value, leaf_min, leaf_max, atol):
    """A(y) = V(y) - V(parent(y)); 0 at roots, below an unmixed parent, and without leaves."""
    n = parent.shape[0]
    out = np.zeros(n)
    for i in range(n):
        p = parent[i]
        if p >= 0 and n_leaves[i] > 0 and leaf_min[p] < leaf_max[p]:
            out[i] = _snap(value[i] - value[p], atol)
    return out


@nb.njit(cache=True, nogil=True)
def treerl_kernel(parent, tree, n_leaves, value, leaf_min, leaf_max, root_nodes, atol):
    """TreeRL: (V(y) - V(root) + V(y) - V(parent)) / sqrt(n_y) at every non-root node."""
    n = parent.shape[0]
    out = np.zeros(n)
    for i in range(n):
        p = parent[i]
        if p < 0 or n_leaves[i] == 0:
            continue
        root = root_nodes[tree[i]]
        a = value[i] - value[root] if leaf_min[root] < leaf_max[root] else 0.0
        b = value[i] - value[p] if leaf_min[p] < leaf_max[p] else 0.0
        out[i] = _snap((a + b) / np.sqrt(n_leaves[i]), atol)
    return out


@nb.njit(cache=True, nogil=True)
def tree_grpo_kernel(parent, tree, flags, reward, n_children, n_leaves, value, leaf_min, leaf_max, std, root_nodes,
                     inter_coef, use_std, eps, atol):
    """Tree-GRPO; see :func:`tree_grpo` for the definition."""
    n = parent.shape[0]
    # nearest strict ancestor with >= 2 children (-1 if none); parent[i] < i makes one sweep enough
    anchor = np.full(n, -1, dtype=np.int64)
    for i in range(n):
        p = parent[i]
        if p >= 0:
            anchor[i] = p if n_children[p] >= 2 else anchor[p]
    intra = np.zeros(n)
    for i in range(n):
        if (flags[i] & 1) and not np.isnan(reward[i]):
            a = anchor[i]
            if a >= 0 and parent[a] >= 0 and n_leaves[a] >= 2 and leaf_min[a] < leaf_max[a]:
                d = reward[i] - value[a]
                intra[i] = d / (std[a] + eps) if use_std else d
    for i in range(n - 1, -1, -1):
        p = parent[i]
        if p >= 0:
            intra[p] += intra[i]
    out = np.zeros(n)
    for i in range(n):
        if parent[i] >= 0 and n_leaves[i] > 0:
            t = tree[i]
            x = intra[i] / n_leaves[i]
            if inter_coef[t] != 0.0:
                x += inter_coef[t] * (value[i] - value[root_nodes[t]])
            out[i] = _snap(x, atol)
    return out


# ----------------------------------------------------------------------------- helpers

def _arrays(forest: Forest):
    forest.ensure_backed_up()
    return forest.parent, forest.tree, forest.n_leaves, forest.value, forest.leaf_min, forest.leaf_max, forest.root_nodes


def _tree_groups(forest: Forest) -> tuple[np.ndarray, np.ndarray]:
    """Per tree: does its leaf group count (at least two leaves, not all equal), and its size."""
    roots = forest.root_nodes
    size = forest.n_leaves[roots].astype(np.float64)
    live = (size >= 2) & (forest.leaf_min[roots] < forest.leaf_max[roots])
    return live, size


def node_std(forest: Forest) -> np.ndarray:
    """Sample std (ddof=1) of the finished-leaf rewards below each node; NaN under two leaves."""
    forest.ensure_backed_up()
    return node_std_kernel(forest.parent, forest.tree, forest.flags, forest.reward, forest.value, forest.root_nodes,
                           forest.n_leaves)


# ----------------------------------------------------------------------------- estimators

@register_advantage("grpo")
def grpo(forest: Forest, scale: str = "group", eps: float = 1e-4) -> np.ndarray:
    """GRPO as TRL computes it, with the prompt's tree as the group.

    Leaf l of tree T: ``A(l) = (r_l - mean_T) / (std_T + eps)``, where mean_T and std_T
    (unbiased, ddof=1) are over the finished leaves of T. ``scale``: ``"group"`` as
    above; ``"batch"`` divides by the std of all finished leaves of the forest instead;
    ``"none"`` does not divide (Dr. GRPO). A tree with one finished leaf, or whose leaves
    all score the same, gives 0. A node's advantage is the mean over its finished leaves:
    ``(V(y) - mean_T) / (std + eps)``.
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"grpo scale must be 'group', 'batch' or 'none', got {scale!r}")
    parent, tree, n_leaves, value, _, _, roots = _arrays(forest)
    live, _ = _tree_groups(forest)
    if scale == "group":
        coef = 1.0 / (node_std(forest)[roots] + eps)
    elif scale == "batch":
        r = forest.reward[forest.finished()]
        coef = np.full(roots.shape[0], 1.0 / ((np.std(r, ddof=1) if r.size >= 2 else 0.0) + eps))
    else:
        coef = np.ones(roots.shape[0])
    coef = np.where(live, coef, 0.0)
    return centered_kernel(parent, tree, n_leaves, value, roots, coef, ZERO_ATOL)


@register_advantage("dr_grpo")
def dr_grpo(forest: Forest) -> np.ndarray:
    """Dr. GRPO: :func:`grpo` with ``scale="none"``, ``A(l) = r_l - mean_T``."""
    return grpo(forest, scale="none")


@register_advantage("rloo")
def rloo(forest: Forest) -> np.ndarray:
    """RLOO: ``A(l) = r_l - (mean of the other finished leaves of l's tree)``
    ``= n/(n-1) (r_l - mean_T)``; 0 for a tree with one finished leaf or all-equal rewards.
    A node gets the mean over its finished leaves, ``n/(n-1) (V(y) - mean_T)``."""
    parent, tree, n_leaves, value, _, _, roots = _arrays(forest)
    live, size = _tree_groups(forest)
    coef = np.where(live, size / np.maximum(size - 1.0, 1.0), 0.0)
    return centered_kernel(parent, tree, n_leaves, value, roots, coef, ZERO_ATOL)


@register_advantage("treerl")
def treerl(forest: Forest) -> np.ndarray:
    """TreeRL at every node (not a leaf mean): with L(y) the finished leaves below y,
    ``A(y) = (V(y) - V(root) + V(y) - V(parent(y))) / sqrt(|L(y)|)``; 0 at roots and at
    nodes without finished leaves. (A difference against an unmixed ancestor is exactly 0.)"""
    parent, tree, n_leaves, value, lo, hi, roots = _arrays(forest)
    return treerl_kernel(parent, tree, n_leaves, value, lo, hi, roots, ZERO_ATOL)


@register_advantage("tree_grpo")
def tree_grpo(forest: Forest, scale: str = "group", eps: float = 1e-4) -> np.ndarray:
    """Tree-GRPO with agent-step nodes: an inter-tree plus an intra-tree GRPO term.

    For a finished leaf l of tree T with reward r_l::

        A(l) = (r_l - mean(L(root))) / (std(L(root)) + eps)      # inter: all leaves of T
             + (r_l - mean(L(a)))    / (std(L(a))    + eps)      # intra

    where L(x) is the set of finished leaves below x, std is unbiased (ddof=1), and ``a``
    is l's nearest *branching* ancestor: the nearest strict ancestor with at least two
    children (``n_children >= 2``, unfinished children included). The intra term is 0 when
    that ancestor is the root or does not exist; either term is 0 when its group has
    fewer than two leaves or all its rewards are equal. ``scale="none"`` drops both
    divisions. A node's advantage is the mean of A(l) over its finished leaves.
    """
    if scale not in ("group", "none"):
        raise ValueError(f"tree_grpo scale must be 'group' or 'none', got {scale!r}")
    parent, tree, n_leaves, value, lo, hi, roots = _arrays(forest)
    live, _ = _tree_groups(forest)
    use_std = scale == "group"
    std = node_std(forest) if use_std else np.zeros(len(forest))
    inter = np.where(live, 1.0 / (std[roots] + eps) if use_std else 1.0, 0.0)
    return tree_grpo_kernel(parent, tree, forest.flags, forest.reward, forest.n_children, n_leaves, value, lo, hi, std,
                            roots, inter, use_std, float(eps), ZERO_ATOL)


@register_advantage("trace")
def trace(forest: Forest, scale: str = "none", eps: float = 1e-4) -> np.ndarray:
    """TRACE's tree-aware advantage: ``A(y) = V(y) - V(parent(y))`` at every non-root node
    with finished leaves below it. 0 at roots, and 0 whenever the parent is not mixed, in
    particular when the parent has a single child: no contrast, no signal.

    ``scale``: ``"none"`` (the paper's form, the default); ``"group"`` divides every
    node's advantage by ``std_T + eps``, the unbiased std of its tree's finished-leaf
    rewards, as GRPO does; ``"batch"`` by the std of all finished leaves of the forest.
    Scaling changes magnitudes only, never which nodes get a non-zero advantage. It
    matters when the optimiser is not scale-invariant (plain SGD, as in ContrastLab's
    learning mode): unscaled value differences are several times smaller than GRPO's
    unit-variance advantages, so an equal learning rate would compare step sizes, not
    allocators.
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"trace scale must be 'group', 'batch' or 'none', got {scale!r}")
    parent, tree, n_leaves, value, lo, hi, roots = _arrays(forest)
    adv = trace_kernel(parent, n_leaves, value, lo, hi, ZERO_ATOL)
    if scale == "group":
        std = node_std(forest)[roots]
        adv = adv / (np.where(np.isnan(std), 0.0, std)[tree] + eps)
    elif scale == "batch":
        r = forest.reward[forest.finished()]
        adv = adv / ((np.std(r, ddof=1) if r.size >= 2 else 0.0) + eps)
    return adv
