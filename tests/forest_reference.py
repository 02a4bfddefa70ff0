"""Plain-Python reference implementations of the forest kernels and the allocation
solvers, written straight from the definitions (PAPER.md, trace_gym.forest.advantages), plus a
random-forest builder. The tests compare the numba kernels with these; the benchmark
(benchmarks/forest_bench.py) times them side by side.

Nothing here imports the kernels it checks: a forest is read once into plain lists.
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
from dataclasses import dataclass

import numpy as np

from trace_gym.forest.forest import Forest

ZERO_ATOL = 1e-12


def snap(x: float) -> float:
    return 0.0 if abs(x) <= ZERO_ATOL else x


@dataclass
class Plain:
    """A forest as Python lists."""

    parent: list[int]
    tree: list[int]
    flags: list[int]
    reward: list[float]
    n_tokens: list[int]
    traj: list[int]
    roots: list[int]
    n_traj: int

    @classmethod
    def of(cls, f: Forest) -> "Plain":
        return cls(f.parent.tolist(), f.tree.tolist(), f.flags.tolist(), f.reward.tolist(), f.n_tokens.tolist(),
                   f.traj.tolist(), f.root_nodes.tolist(), f.n_trajectories)

    def finished(self, i: int) -> bool:
        return bool(self.flags[i] & 1) and not math.isnan(self.reward[i])

    def children(self) -> list[list[int]]:
        ch: list[list[int]] = [[] for _ in self.parent]
        for i, p in enumerate(self.parent):
            if p >= 0:
                ch[p].append(i)
        return ch

    def leaves_below(self) -> list[list[int]]:
        """Finished leaves below (or at) each node, by walking up from every leaf."""
        out: list[list[int]] = [[] for _ in self.parent]
        for leaf in range(len(self.parent)):
            if self.finished(leaf):
                y = leaf
                while y >= 0:
                    out[y].append(leaf)
                    y = self.parent[y]
        return out


# ----------------------------------------------------------------------------- backup

def backup_mean(f: Plain) -> tuple[list[int], list[float]]:
    """n_y and V(y) = mean reward of the finished leaves below y (NaN without leaves)."""
    below = f.leaves_below()
    n = [len(b) for b in below]
    v = [statistics.fmean(f.reward[l] for l in b) if b else math.nan for b in below]
    return n, v


def backup_recursive(f: Plain) -> tuple[list[int], list[float]]:
    """The weighted recursive form: V(leaf) = r, V(y) = (1/n_y) sum_c n_c V(c)."""
    ch = f.children()
    n = [0] * len(f.parent)
    v = [math.nan] * len(f.parent)
    # post-order without recursion limits: a node is finished after all of its children
    for root in f.roots:
        stack = [(root, False)]
        while stack:
            y, done = stack.pop()
            if not done:
                stack.append((y, True))
                stack.extend((c, False) for c in ch[y])
                continue
            if f.finished(y):
                n[y], v[y] = 1, f.reward[y]
            else:
                n[y] = sum(n[c] for c in ch[y])
                v[y] = sum(n[c] * v[c] for c in ch[y] if n[c]) / n[y] if n[y] else math.nan
    return n, v


def effective_ratio(f: Plain) -> float:
    below = f.leaves_below()
    seen = [r for r in f.roots if below[r]]
    mixed = [r for r in seen if len({f.reward[l] for l in below[r]}) > 1]
    return len(mixed) / len(seen) if seen else 0.0


def effective_sample_ratio(f: Plain, adv) -> tuple[float, float]:
    hit = {f.traj[i] for i in range(len(f.parent)) if adv[i] != 0 and f.traj[i] >= 0}
    tok = sum(f.n_tokens)
    tok_hit = sum(f.n_tokens[i] for i in range(len(f.parent)) if adv[i] != 0)
    return (len(hit) / f.n_traj if f.n_traj else 0.0, tok_hit / tok if tok else 0.0)


# ----------------------------------------------------------------------------- advantages

def _group_adv(r: float, group: list[float], scale_std: float | None, eps: float) -> float:
    """(r - mean) / (std + eps) (or without division if scale_std is None); 0 for a group
    of one or of equal rewards."""
    if len(group) < 2 or len(set(group)) == 1:
        return 0.0
    d = r - statistics.fmean(group)
    return d if scale_std is None else d / (scale_std + eps)


def _node_means(f: Plain, leaf_adv: dict[int, float]) -> list[float]:
    below = f.leaves_below()
    return [snap(statistics.fmean(leaf_adv[l] for l in below[y])) if below[y] and f.parent[y] >= 0 else 0.0
            for y in range(len(f.parent))]


def adv_grpo(f: Plain, scale: str = "group", eps: float = 1e-4) -> list[float]:
    below = f.leaves_below()
    all_r = [f.reward[i] for i in range(len(f.parent)) if f.finished(i)]
    batch_std = statistics.stdev(all_r) if len(all_r) >= 2 else 0.0
    leaf_adv = {}
    for root in f.roots:
        group = [f.reward[l] for l in below[root]]
        for l in below[root]:
            std = None if scale == "none" else (batch_std if scale == "batch" else
                                                (statistics.stdev(group) if len(group) >= 2 else 0.0))
            leaf_adv[l] = _group_adv(f.reward[l], group, std, eps)
    return _node_means(f, leaf_adv)


def adv_rloo(f: Plain) -> list[float]:
    below = f.leaves_below()
    leaf_adv = {}
    for root in f.roots:
        ls = below[root]
        for l in ls:
            others = [f.reward[o] for o in ls if o != l]
            leaf_adv[l] = f.reward[l] - statistics.fmean(others) if len(ls) >= 2 else 0.0
    return _node_means(f, leaf_adv)


def adv_treerl(f: Plain) -> list[float]:
    _, v = backup_mean(f)
    below = f.leaves_below()
    out = []
    for y in range(len(f.parent)):
        p = f.parent[y]
        if p < 0 or not below[y]:
            out.append(0.0)
            continue
        root = f.roots[f.tree[y]]
        out.append(snap((v[y] - v[root] + v[y] - v[p]) / math.sqrt(len(below[y]))))
    return out


def adv_tree_grpo(f: Plain, scale: str = "group", eps: float = 1e-4) -> list[float]:
    below = f.leaves_below()
    ch = f.children()

    def grpo_in(l: int, node: int) -> float:
        group = [f.reward[x] for x in below[node]]
        std = (statistics.stdev(group) if len(group) >= 2 else 0.0) if scale == "group" else None
        return _group_adv(f.reward[l], group, std, eps)

    leaf_adv = {}
    for l in range(len(f.parent)):
        if not f.finished(l):
            continue
        root = f.roots[f.tree[l]]
        a = f.parent[l]
        while a >= 0 and len(ch[a]) < 2:
            a = f.parent[a]
        intra = grpo_in(l, a) if a >= 0 and a != root else 0.0
        leaf_adv[l] = grpo_in(l, root) + intra
    return _node_means(f, leaf_adv)


def adv_trace(f: Plain, scale: str = "none", eps: float = 1e-4) -> list[float]:
    _, v = backup_mean(f)
    adv = [snap(v[y] - v[f.parent[y]]) if f.parent[y] >= 0 and not math.isnan(v[y]) else 0.0 for y in range(len(f.parent))]
    if scale == "none":
        return adv
    below = f.leaves_below()
    all_r = [f.reward[i] for i in range(len(f.parent)) if f.finished(i)]
    batch_std = statistics.stdev(all_r) if len(all_r) >= 2 else 0.0
    root_of = {f.tree[r]: r for r in f.roots}
    out = []
    for y, a in enumerate(adv):
        group = [f.reward[l] for l in below[root_of[f.tree[y]]]]
        std = batch_std if scale == "batch" else (statistics.stdev(group) if len(group) >= 2 else 0.0)
        out.append(a / (std + eps))
    return out


ADVANTAGES = {
    "grpo": adv_grpo,
    "dr_grpo": lambda f: adv_grpo(f, scale="none"),
    "rloo": adv_rloo,
    "treerl": adv_treerl,
    "tree_grpo": adv_tree_grpo,
    "trace": adv_trace,
}


# ----------------------------------------------------------------------------- stage 1

def v_root(v: float, m: int) -> float:
    return 1.0 - v**m - (1.0 - v) ** m if m > 0 else 0.0


def v_pref(v: float, r: float, k: int) -> float:
    s = min(max(r * v + (1 - r) * (1 - v), 0.0), 1.0)
    return 1.0 - s**k


def _choices(m_min: int, m_max: int, budget: int) -> list[int]:
    cap = m_max if m_max > 0 else budget
    return [0] + list(range(m_min, min(cap, budget) + 1))


def roots_brute(v, budget: int, m_min: int, m_max: int) -> dict[int, float]:
    """Best objective for every exact spend s (enumerates every feasible allocation)."""
    best: dict[int, float] = {}
    for ms in itertools.product(_choices(m_min, m_max, budget), repeat=len(v)):
        s = sum(ms)
        if s <= budget:
            val = math.fsum(v_root(x, m) for x, m in zip(v, ms))
            best[s] = max(best.get(s, -1.0), val)
    return best


def roots_dp(v, budget: int, m_min: int, m_max: int) -> dict[int, float]:
    """Best objective for every exact spend s, by dynamic programming over prompts."""
    best = {0: 0.0}
    for x in v:
        nxt: dict[int, float] = {}
        for s, val in best.items():
            for m in _choices(m_min, m_max, budget):
                if s + m <= budget:
                    cand = val + v_root(x, m)
                    if cand > nxt.get(s + m, -1.0):
                        nxt[s + m] = cand
        best = nxt
    return best


def optimum(best_by_spend: dict[int, float], tol: float = 1e-12) -> tuple[float, int]:
    """(optimal objective, most units any (near-)optimal allocation spends)."""
    top = max(best_by_spend.values())
    return top, max(s for s, val in best_by_spend.items() if val >= top - tol)


def solve_roots(v, budget: int, m_min: int = 2, m_max: int = 0) -> list[int]:
    """The exact stage-1 algorithm of trace_gym.allocation.solvers in plain Python (heapq): the top-K
    prompts by min(v, 1-v), extras by unit greedy, K swept from its largest value down."""
    n = len(v)
    kmax = min(n, budget // m_min)
    out = [0] * n
    if kmax <= 0:
        return out
    order = sorted(range(n), key=lambda i: (-min(v[i], 1 - v[i]), i))
    ps = [min(v[i], 1 - v[i]) for i in order[:kmax]]
    extra_cap = m_max - m_min if m_max > 0 else budget

    def gain(j: int, m: int) -> float:  # gain of unit m >= 2
        p = ps[j]
        return p * (1 - p) * (p ** (m - 2) + (1 - p) ** (m - 2))

    def fill(K: int, R: int, taken: list[int], heap: list, placed: list) -> None:
        while placed[0] < R and heap:
            g, j = heap[0]
            if j >= K:
                heapq.heappop(heap)
                continue
            placed[0] += 1
            placed[1] += -g
            gained[j] += -g
            taken[j] += 1
            if taken[j] >= extra_cap:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (-gain(j, m_min + taken[j] + 1), j))

    taken = [0] * kmax
    gained = [0.0] * kmax
    heap = [(-gain(j, m_min + 1), j) for j in range(kmax)] if extra_cap > 0 else []
    heapq.heapify(heap)
    placed = [0, 0.0]
    base = [v_root(p, m_min) for p in ps]
    value, spend = {0: 0.0}, {0: 0}
    for K in range(kmax, 0, -1):
        fill(K, budget - K * m_min, taken, heap, placed)
        value[K] = sum(base[:K]) + placed[1]
        spend[K] = K * m_min + placed[0]
        placed[0] -= taken[K - 1]
        placed[1] -= gained[K - 1]
    top = max(value.values())
    tol = 1e-13 * max(1.0, top)
    best = max((K for K in value if value[K] >= top - tol), key=lambda K: (spend[K], K))
    if best == 0:
        return out
    taken = [0] * best
    gained = [0.0] * best
    heap = [(-gain(j, m_min + 1), j) for j in range(best)] if extra_cap > 0 else []
    heapq.heapify(heap)
    fill(best, budget - best * m_min, taken, heap, [0, 0.0])
    for j in range(best):
        out[order[j]] = m_min + taken[j]
    return out


# ----------------------------------------------------------------------------- stage 2

def prefixes_dp(v, r, budget: int, k_max: int) -> dict[int, float]:
    """Best stage-2 objective for every exact spend s."""
    cap = k_max if k_max > 0 else budget
    best = {0: 0.0}
    for x, y in zip(v, r):
        nxt: dict[int, float] = {}
        for s, val in best.items():
            for k in range(0, min(cap, budget - s) + 1):
                cand = val + v_pref(x, y, k)
                if cand > nxt.get(s + k, -1.0):
                    nxt[s + k] = cand
        best = nxt
    return best


def solve_prefixes(v, r, budget: int, k_max: int = 0) -> list[int]:
    """Stage-2 unit greedy in plain Python (heapq), ties to the lower index."""
    cap = k_max if k_max > 0 else budget
    s = [min(max(y * x + (1 - y) * (1 - x), 0.0), 1.0) for x, y in zip(v, r)]
    out = [0] * len(s)
    heap = [(-(1.0 - sj), j) for j, sj in enumerate(s)]
    heapq.heapify(heap)
    for _ in range(budget):
        if not heap:
            break
        _, j = heap[0]
        out[j] += 1
        if out[j] >= cap:
            heapq.heappop(heap)
        else:
            heapq.heapreplace(heap, (-(s[j] ** out[j]) * (1.0 - s[j]), j))
    return out


# ----------------------------------------------------------------------------- random forests

def random_forest(seed: int, n_trees: int = 6, rewards: str = "binary", p_unfinished: float = 0.15,
                  max_depth: int = 5, n_branches: int = 8) -> Forest:
    """A forest with random trees, random branching (from roots and inner nodes), some
    unfinished trajectories (including ones with no node at all), and rewards drawn from
    ``binary`` {0, 1}, ``dyadic`` {0, .25, .5, .75, 1} or ``uniform`` [0, 1]."""
    rng = np.random.default_rng(seed)
    f = Forest(capacity=16)

    def reward() -> float:
        if rewards == "binary":
            return float(rng.integers(0, 2))
        if rewards == "dyadic":
            return float(rng.integers(0, 5)) / 4
        return float(rng.random())

    def run(origin: int) -> None:
        t = f.start_trajectory(origin)
        depth = int(rng.integers(0, max_depth + 1)) if rng.random() < p_unfinished else int(rng.integers(1, max_depth + 1))
        finish = rng.random() >= p_unfinished
        for d in range(depth):
            last = d == depth - 1 and finish
            if rng.random() < 0.5:
                f.add_node(t, n_tokens=int(rng.integers(0, 20)), terminal=last, reward=reward() if last else float("nan"))
            else:
                f.add_nodes(np.array([t]), n_tokens=np.array([rng.integers(0, 20)]), terminal=np.array([last]),
                            reward=np.array([reward() if last else np.nan]))

    for i in range(n_trees):
        root = f.add_root(f"t{i}", f"prompt {i}")
        for _ in range(int(rng.integers(0, 5))):
            run(root)
    for _ in range(n_branches):
        open_nodes = np.flatnonzero((f.flags & 1) == 0)
        run(int(rng.choice(open_nodes)))
    return f


# ----------------------------------------------------------------------------- one allocation step

def step(f: Plain, v_roots: list[float], root_budget: int, pred: list[float], prefix_budget: int, m_min: int = 2):
    """One bookkeeping + allocation step in plain Python, the way one would write it
    without numba (a reverse sweep over lists rather than the definitional walks above):
    backup, effective ratio, trace advantages, stage 1 on ``v_roots``, stage 2 on every
    branchable prefix (``pred`` as v, the backed-up value as r).

    Returns (value, effective ratio, advantages, root counts, branchable nodes, prefix counts).
    """
    n = len(f.parent)
    parent, flags, reward = f.parent, f.flags, f.reward
    n_leaves = [0] * n
    rsum = [0.0] * n
    lo = [math.inf] * n
    hi = [-math.inf] * n
    for i in range(n):
        if flags[i] & 1 and reward[i] == reward[i]:
            n_leaves[i], rsum[i], lo[i], hi[i] = 1, reward[i], reward[i], reward[i]
    for i in range(n - 1, -1, -1):
        p = parent[i]
        if p >= 0:
            n_leaves[p] += n_leaves[i]
            rsum[p] += rsum[i]
            if lo[i] < lo[p]:
                lo[p] = lo[i]
            if hi[i] > hi[p]:
                hi[p] = hi[i]
    value = [rsum[i] / n_leaves[i] if n_leaves[i] else math.nan for i in range(n)]
    seen = [r for r in f.roots if n_leaves[r]]
    ratio = sum(1 for r in seen if lo[r] < hi[r]) / len(seen) if seen else 0.0
    adv = [0.0] * n
    for i in range(n):
        p = parent[i]
        if p >= 0 and n_leaves[i] and lo[p] < hi[p]:
            adv[i] = snap(value[i] - value[p])
    counts = solve_roots(v_roots, root_budget, m_min)
    nodes = [i for i in range(n) if parent[i] >= 0 and not flags[i] & 1]
    k = solve_prefixes([pred[i] for i in nodes], [value[i] for i in nodes], prefix_budget)
    return value, ratio, adv, counts, nodes, k


# ----------------------------------------------------------------------------- trees as duplicated trajectories


def leaf_advantages(forest: Forest, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(per-trajectory leaf advantage, per-node mean over the finished leaves below)``: a
    leaf-level estimator's shape (grpo, tree_grpo), with random leaf values."""
    forest.backup()
    rng = np.random.default_rng(seed)
    leaf_adv = rng.normal(size=forest.n_trajectories)
    total, count = np.zeros(len(forest)), np.zeros(len(forest))
    finished = set(np.flatnonzero(forest.finished()).tolist())
    for t in range(forest.n_trajectories):
        leaf = int(forest.traj_leaf[t])
        if leaf in finished:
            for n in forest.path(leaf):
                total[n] += leaf_adv[t]
                count[n] += 1
    assert np.array_equal(count[forest.parent >= 0], forest.n_leaves[forest.parent >= 0])
    adv = np.where(count > 0, total / np.maximum(count, 1), 0.0)
    adv[forest.root_nodes] = 0.0
    return leaf_adv, adv


def unrolled(forest: Forest, leaf_adv: np.ndarray) -> tuple[Forest, np.ndarray]:
    """The same trajectories with no shared node: each one repeats its whole root-to-leaf path
    (what a trainer that duplicates a branch's prefix trains), every node carrying its
    trajectory's leaf advantage (0 where the trajectory did not finish)."""
    from trace_gym.forest.forest import TERMINAL, TRUNCATED

    finished = forest.finished()
    out = Forest()
    roots = [out.add_root(forest.task_ids[t], forest.prompts[t], max_turns=forest.max_turns[t], payload=forest.payload[int(r)])
             for t, r in enumerate(forest.root_nodes)]
    adv = [0.0] * len(roots)
    for t in range(forest.n_trajectories):
        leaf = int(forest.traj_leaf[t])
        path = forest.path(leaf)
        if not path:
            continue
        u = out.start_trajectory(roots[int(forest.tree[leaf])])
        a = float(leaf_adv[t]) if finished[leaf] else 0.0
        for n in path:
            flags = int(forest.flags[n])
            out.add_node(u, text=forest.text[n], n_tokens=int(forest.n_tokens[n]), terminal=bool(flags & TERMINAL),
                         truncated=bool(flags & TRUNCATED), reward=float(forest.reward[n]), payload=forest.payload[n])
            adv.append(a)
    return out, np.asarray(adv)
