"""``Forest``: one training step's rollout trees as flat arrays.

A node is one ReAct turn; a tree's root (depth 0) is the prompt. A trajectory is a path
from the node it started at (its *origin*: the root for a bare rollout, an inner node for
a stage-2 branch) down to its leaf; every non-root node belongs to exactly one trajectory,
the one that generated it. A leaf whose episode ended carries the terminal reward.

Nodes are only ever appended, and a node's parent is always added before it
(``parent[i] < i``). The kernels rely on that: one reverse sweep visits every child before
its parent, so bookkeeping is O(nodes) with no per-node Python objects.

Per-node Python payloads (turn text, token ids, log-probs, env snapshots) live in
``Forest.payload``; everything the kernels read is a numpy array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence, overload

import numba as nb
import numpy as np

# node flags
TERMINAL = np.uint8(1)  # the episode ended at this node: it carries a reward and cannot be branched
TRUNCATED = np.uint8(2)  # ended by the turn limit rather than by an answer (also TERMINAL)
BRANCH = np.uint8(4)  # first node of a stage-2 continuation


@dataclass(frozen=True)
class History:
    """The prefix a predictor scores: a prompt and the turns taken since, ending at a node.

    ``steps`` are the turn texts (action and observation) from the root's child down to
    the node; ``depth == len(steps)``. ``oracle`` is the environment's exact conditional
    success probability where it knows it (the simulator) and an oracle component asked for
    it (:meth:`Forest.histories` with ``oracle=True``), else NaN.
    """

    task_id: str
    prompt: str
    steps: tuple[str, ...] = ()
    oracle: float = float("nan")
    max_turns: int = 0

    @property
    def depth(self) -> int:
        """Number of turns in the history (0 for a task's opening)."""
        return len(self.steps)


# ----------------------------------------------------------------------------- kernels


@nb.njit(cache=True, nogil=True)
def backup_kernel(parent, flags, reward, n_leaves, reward_sum, value, leaf_min, leaf_max):
    """Back up leaf rewards: n_leaves, reward sums, V_hat = mean leaf reward, and the range
    of leaf rewards under every node (a node is *mixed* when ``leaf_min < leaf_max``)."""
    n = parent.shape[0]
    for i in range(n):
        if (flags[i] & 1) and not np.isnan(reward[i]):
            n_leaves[i] = 1
            reward_sum[i] = reward[i]
            leaf_min[i] = reward[i]
            leaf_max[i] = reward[i]
        else:
            n_leaves[i] = 0
            reward_sum[i] = 0.0
            leaf_min[i] = np.inf
            leaf_max[i] = -np.inf
    # children come after their parent, so in a reverse sweep node i is complete when reached
    for i in range(n - 1, -1, -1):
        value[i] = reward_sum[i] / n_leaves[i] if n_leaves[i] > 0 else np.nan
        p = parent[i]
        if p >= 0:
            n_leaves[p] += n_leaves[i]
            reward_sum[p] += reward_sum[i]
            if leaf_min[i] < leaf_min[p]:
                leaf_min[p] = leaf_min[i]
            if leaf_max[i] > leaf_max[p]:
                leaf_max[p] = leaf_max[i]


@nb.njit(cache=True, nogil=True)
def effective_ratio_kernel(root_nodes, n_leaves, leaf_min, leaf_max):
    """Share of trees with at least one finished leaf whose leaf rewards are not all equal."""
    seen = 0
    mixed = 0
    for r in root_nodes:
        if n_leaves[r] > 0:
            seen += 1
            if leaf_min[r] < leaf_max[r]:
                mixed += 1
    return mixed / seen if seen > 0 else 0.0


@nb.njit(cache=True, nogil=True)
def effective_sample_ratio_kernel(traj, n_tokens, adv, n_traj):
    """(share of trajectories owning a node with ``adv != 0``, share of generated tokens in
    such nodes); every trajectory and every token counts in the denominators."""
    hit = np.zeros(n_traj, dtype=np.bool_)
    tok_all = 0.0
    tok_hit = 0.0
    for i in range(traj.shape[0]):
        tok_all += n_tokens[i]
        if adv[i] != 0.0:
            tok_hit += n_tokens[i]
            t = traj[i]
            if t >= 0:
                hit[t] = True
    n_hit = 0
    for t in range(n_traj):
        if hit[t]:
            n_hit += 1
    traj_ratio = n_hit / n_traj if n_traj > 0 else 0.0
    token_ratio = tok_hit / tok_all if tok_all > 0 else 0.0
    return traj_ratio, token_ratio


# ----------------------------------------------------------------------------- the forest

class NodeArray:
    """A per-node array of :class:`Forest`, read as ``forest.<name>``: a writable view of
    length ``len(forest)`` into the forest's storage (so ``forest.pred[roots] = p`` writes
    through). Re-read it after adding nodes: growth may move the storage. Assigning the
    attribute itself (``forest.pred = p``) is an error."""

    def __init__(self, dtype: Any, fill: Any, doc: str):
        self.dtype = np.dtype(dtype)
        self.fill = fill
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> "NodeArray": ...

    @overload
    def __get__(self, obj: "Forest", objtype: type | None = None) -> np.ndarray: ...

    def __get__(self, obj: "Forest | None", objtype: type | None = None) -> "np.ndarray | NodeArray":
        if obj is None:
            return self
        return obj._arr[self.name][: obj._n]

    def __set__(self, obj: "Forest", value: Any) -> None:
        raise AttributeError(f"Forest.{self.name} is a view of the node array; write into it "
                             f"(forest.{self.name}[nodes] = values) instead of replacing it")


class Forest:
    """A batch of rollout trees (one per prompt) as struct-of-arrays.

    Contract: nodes are only appended (:meth:`add_root`, :meth:`start_trajectory` then
    :meth:`add_node` / :meth:`add_nodes`), a node's parent always precedes it, and a
    terminal node carries a reward and is never continued. Every trajectory started counts
    once against the budget (``n_trajectories``).

    Node arrays are attributes of length ``len(forest)`` (:class:`NodeArray` views, listed
    below): ``parent``, ``tree``, ``depth``, ``traj``, ``flags``, ``reward``, ``n_tokens``,
    ``n_children``, ``pred``, ``oracle``, and, as of :meth:`backup`, ``n_leaves``,
    ``reward_sum``, ``value`` (V_hat), ``leaf_min``/``leaf_max``. Per tree: ``root_nodes``,
    ``task_ids``, ``prompts``, ``max_turns``. Per trajectory: ``traj_origin`` (node it
    started from) and ``traj_leaf`` (its current last node). Per node, outside the kernels:
    ``text`` and ``payload`` (token ids, log-probs, env snapshots).
    """

    parent = NodeArray(np.int32, -1, "int32: the parent node, -1 at roots; ``parent[i] < i``.")
    tree = NodeArray(np.int32, -1, "int32: index of the node's tree (its prompt), in ``root_nodes`` order.")
    depth = NodeArray(np.int32, 0, "int32: turns from the root (0 at roots).")
    traj = NodeArray(np.int32, -1, "int32: the trajectory that generated the node, -1 at roots.")
    flags = NodeArray(np.uint8, 0, "uint8: ``TERMINAL | TRUNCATED | BRANCH`` bits.")
    reward = NodeArray(np.float64, np.nan, "float64: the terminal reward, NaN at non-terminal nodes.")
    n_tokens = NodeArray(np.int32, 0, "int32: policy tokens generated at the node.")
    n_children = NodeArray(np.int32, 0, "int32: number of child nodes.")
    pred = NodeArray(np.float64, np.nan, "float64: the predictor's value where an allocator wrote one, else NaN.")
    oracle = NodeArray(np.float64, np.nan, "float64: the env's exact conditional success probability where it knows it, else NaN.")
    n_leaves = NodeArray(np.int32, 0, "int32: finished leaves below the node, itself included (set by :meth:`backup`).")
    reward_sum = NodeArray(np.float64, 0.0, "float64: sum of the finished-leaf rewards below the node (set by :meth:`backup`).")
    value = NodeArray(np.float64, np.nan, "float64: V_hat, the mean finished-leaf reward below the node, NaN without leaves (set by :meth:`backup`).")
    leaf_min = NodeArray(np.float64, np.inf, "float64: smallest finished-leaf reward below the node, +inf without leaves (set by :meth:`backup`).")
    leaf_max = NodeArray(np.float64, -np.inf, "float64: largest finished-leaf reward below the node, -inf without leaves (set by :meth:`backup`).")

    def __init__(self, capacity: int = 1024):
        self._cap = max(16, int(capacity))
        self._n = 0
        self._arr: dict[str, np.ndarray] = {k: np.full(self._cap, fill, dtype=dt) for k, (dt, fill) in _NODE_ARRAYS.items()}
        self.payload: list[Any] = []
        self.text: list[str] = []
        self.task_ids: list[str] = []
        self.prompts: list[str] = []
        self.max_turns: list[int] = []
        self._root_nodes = np.zeros(16, dtype=np.int32)
        self._n_trees = 0
        self._traj_origin = np.zeros(16, dtype=np.int32)
        self._traj_leaf = np.zeros(16, dtype=np.int32)
        self._n_traj = 0
        self.counters: dict[str, int] = {
            "trajectories": 0, "generated_tokens": 0, "prefill_tokens": 0, "reused_prefix_tokens": 0, "tool_calls": 0,
        }
        self._backed_up = False

    # ------------------------------------------------------------------ array access

    def __len__(self) -> int:
        return self._n

    @property
    def root_nodes(self) -> np.ndarray:
        """int32 per tree: its root node."""
        return self._root_nodes[: self._n_trees]

    @property
    def n_trees(self) -> int:
        """Number of trees (prompts)."""
        return self._n_trees

    @property
    def n_trajectories(self) -> int:
        """Number of trajectories started (each counts once against the budget)."""
        return self._n_traj

    @property
    def traj_origin(self) -> np.ndarray:
        """int32 per trajectory: the node it started from (a root, or a stage-2 branch point)."""
        return self._traj_origin[: self._n_traj]

    @property
    def traj_leaf(self) -> np.ndarray:
        """int32 per trajectory: its current last node."""
        return self._traj_leaf[: self._n_traj]

    def _reserve(self, extra: int) -> None:
        need = self._n + extra
        if need <= self._cap:
            return
        cap = max(need, 2 * self._cap)  # amortised doubling
        for k, (dt, fill) in _NODE_ARRAYS.items():
            new = np.full(cap, fill, dtype=dt)
            new[: self._n] = self._arr[k][: self._n]
            self._arr[k] = new
        self._cap = cap

    @staticmethod
    def _grow(a: np.ndarray, need: int) -> np.ndarray:
        if need <= a.shape[0]:
            return a
        new = np.zeros(max(need, 2 * a.shape[0]), dtype=a.dtype)
        new[: a.shape[0]] = a
        return new

    # ------------------------------------------------------------------ building

    def add_root(self, task_id: str, prompt: str = "", *, max_turns: int = 0, oracle: float = float("nan"), payload: Any = None) -> int:
        """Add a tree for one prompt; returns its root node."""
        self._reserve(1)
        i = self._n
        a = self._arr
        a["parent"][i], a["tree"][i], a["depth"][i], a["oracle"][i] = -1, self._n_trees, 0, oracle
        self._root_nodes = self._grow(self._root_nodes, self._n_trees + 1)
        self._root_nodes[self._n_trees] = i
        self._n_trees += 1
        self.task_ids.append(task_id)
        self.prompts.append(prompt)
        self.max_turns.append(int(max_turns))
        self.payload.append(payload)
        self.text.append(prompt)
        self._n += 1
        self._backed_up = False
        return i

    def start_trajectory(self, origin: int) -> int:
        """Open a new trajectory continuing from node ``origin``; returns its id.

        Counts one trajectory against the budget. ``origin`` must not be terminal.
        """
        if not 0 <= origin < self._n:
            raise IndexError(f"node {origin} is not in the forest (size {self._n})")
        if self._arr["flags"][origin] & TERMINAL:
            raise ValueError(f"node {origin} is terminal: a finished episode cannot be continued")
        t = self._n_traj
        self._traj_origin = self._grow(self._traj_origin, t + 1)
        self._traj_leaf = self._grow(self._traj_leaf, t + 1)
        self._traj_origin[t] = origin
        self._traj_leaf[t] = origin
        self._n_traj += 1
        self.counters["trajectories"] += 1
        return t

    def add_node(
        self,
        traj: int,
        *,
        text: str = "",
        n_tokens: int = 0,
        terminal: bool = False,
        truncated: bool = False,
        reward: float = float("nan"),
        oracle: float = float("nan"),
        payload: Any = None,
    ) -> int:
        """Append the next turn of trajectory ``traj`` (under its current last node)."""
        if not 0 <= traj < self._n_traj:
            raise IndexError(f"trajectory {traj} does not exist")
        parent = int(self._traj_leaf[traj])
        a = self._arr
        if a["flags"][parent] & TERMINAL:
            raise ValueError(f"trajectory {traj} has already ended")
        if terminal and np.isnan(reward):
            raise ValueError("a terminal node needs a reward")
        self._reserve(1)
        i = self._n
        a["parent"][i] = parent
        a["tree"][i] = a["tree"][parent]
        a["depth"][i] = a["depth"][parent] + 1
        a["traj"][i] = traj
        flags = (TERMINAL if terminal or truncated else 0) | (TRUNCATED if truncated else 0)
        if parent == self._traj_origin[traj]:
            flags |= BRANCH if a["parent"][parent] >= 0 else 0
        a["flags"][i] = flags
        a["reward"][i] = reward if (terminal or truncated) else np.nan
        a["n_tokens"][i] = n_tokens
        a["oracle"][i] = oracle
        a["n_children"][parent] += 1
        self._traj_leaf[traj] = i
        self.payload.append(payload)
        self.text.append(text)
        self.counters["generated_tokens"] += int(n_tokens)
        self._n += 1
        self._backed_up = False
        return i

    def add_nodes(
        self,
        trajs: np.ndarray,
        *,
        n_tokens: np.ndarray | None = None,
        terminal: np.ndarray | None = None,
        reward: np.ndarray | None = None,
        oracle: np.ndarray | None = None,
        texts: Sequence[str] | None = None,
    ) -> np.ndarray:
        """Vectorised :meth:`add_node`: the next turn of each trajectory in ``trajs`` (distinct ids)."""
        trajs = np.asarray(trajs, dtype=np.int64)
        k = trajs.shape[0]
        if k == 0:
            return np.zeros(0, dtype=np.int64)
        if np.unique(trajs).shape[0] != k:
            raise ValueError("add_nodes takes each trajectory at most once per call")
        if trajs.min() < 0 or trajs.max() >= self._n_traj:
            raise IndexError("unknown trajectory id")
        parents = self._traj_leaf[trajs].astype(np.int64)
        a = self._arr
        if np.any(a["flags"][parents] & TERMINAL):
            raise ValueError("some trajectories have already ended")
        term = np.zeros(k, dtype=bool) if terminal is None else np.asarray(terminal, dtype=bool)
        rew = np.full(k, np.nan) if reward is None else np.asarray(reward, dtype=np.float64)
        if np.any(term & np.isnan(rew)):
            raise ValueError("a terminal node needs a reward")
        self._reserve(k)
        ids = np.arange(self._n, self._n + k)
        a["parent"][ids] = parents
        a["tree"][ids] = a["tree"][parents]
        a["depth"][ids] = a["depth"][parents] + 1
        a["traj"][ids] = trajs
        starts = (parents == self._traj_origin[trajs]) & (a["parent"][parents] >= 0)
        a["flags"][ids] = np.where(term, TERMINAL, 0) | np.where(starts, BRANCH, 0)
        a["reward"][ids] = np.where(term, rew, np.nan)
        toks = np.zeros(k, dtype=np.int32) if n_tokens is None else np.asarray(n_tokens, dtype=np.int32)
        a["n_tokens"][ids] = toks
        a["oracle"][ids] = np.nan if oracle is None else oracle
        np.add.at(a["n_children"], parents, 1)
        self._traj_leaf[trajs] = ids
        self.payload.extend([None] * k)
        self.text.extend(texts if texts is not None else [""] * k)
        self.counters["generated_tokens"] += int(toks.sum())
        self._n += k
        self._backed_up = False
        return ids

    # ------------------------------------------------------------------ bookkeeping

    def backup(self) -> "Forest":
        """Back up leaf rewards into ``n_leaves``, ``reward_sum``, ``value``, ``leaf_min/max``."""
        a, n = self._arr, self._n
        backup_kernel(a["parent"][:n], a["flags"][:n], a["reward"][:n], a["n_leaves"][:n], a["reward_sum"][:n],
                      a["value"][:n], a["leaf_min"][:n], a["leaf_max"][:n])
        self._backed_up = True
        return self

    def ensure_backed_up(self) -> "Forest":
        """:meth:`backup` unless nothing changed since the last one (node appends reset it)."""
        if not self._backed_up:
            self.backup()
        return self

    _ensure_backed_up = ensure_backed_up

    def finished(self) -> np.ndarray:
        """Boolean mask of finished leaves: terminal nodes that carry a reward."""
        return ((self.flags & TERMINAL) != 0) & ~np.isnan(self.reward)

    def prefix_weights(self, alpha: float) -> np.ndarray:
        """Each node's weight ``max(n, 1) ** alpha`` (float64), n the finished leaves below it:
        the number of trajectories through the node, i.e. how often a trainer that gives every
        trajectory its own sequence repeats it, to the power ``alpha`` in [0, 1] (the trainer's
        ``loss.prefix_weight``; 0 gives every node 1)."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"prefix_weight must be in [0, 1], got {alpha}")
        if alpha == 0.0:
            return np.ones(len(self))
        self.ensure_backed_up()
        return np.maximum(np.asarray(self.n_leaves, dtype=np.float64), 1.0) ** alpha

    def effective_ratio(self) -> float:
        """Share of prompts (trees with at least one finished rollout) that hold both a
        success and a failure leaf (for graded rewards: two different leaf rewards)."""
        self._ensure_backed_up()
        return float(effective_ratio_kernel(self.root_nodes, self.n_leaves, self.leaf_min, self.leaf_max))

    def effective_sample_ratio(self, adv: np.ndarray) -> tuple[float, float]:
        """``(traj_ratio, token_ratio)`` for per-node advantages ``adv`` (length ``len(self)``).

        ``traj_ratio``: share of the sampled trajectories (``n_trajectories``; the ids in
        ``traj``) that own at least one node with a non-zero advantage. ``token_ratio``:
        share of generated tokens (``n_tokens`` summed over all nodes) that lie in nodes
        with a non-zero advantage. Trajectories that never finished stay in the
        denominator: they were paid for. Both are 0.0 when their denominator is empty.
        """
        adv = np.ascontiguousarray(adv, dtype=np.float64)
        if adv.shape != (self._n,):
            raise ValueError(f"adv must have one entry per node ({self._n}), got shape {adv.shape}")
        a = self._arr
        tr, tok = effective_sample_ratio_kernel(a["traj"][: self._n], a["n_tokens"][: self._n], adv, self._n_traj)
        return float(tr), float(tok)

    def branch_flips(self) -> dict[str, int]:
        """How often branching turned a pure tree mixed. A tree counts when its rollouts from
        the root (stage 1, and any stage-2 rollout from the root) finished at least twice,
        all with one reward, and it holds finished branches (trajectories continued from an
        inner prefix). Returns ``{"trees", "trees_mixed", "branches", "flipped"}``: such
        trees, those among them whose leaves end with two different rewards, their finished
        branches, and the branches whose reward differs from the root rollouts'."""
        n = self._n_traj
        out = {"trees": 0, "trees_mixed": 0, "branches": 0, "flipped": 0}
        if n == 0:
            return out
        parent, reward = self._arr["parent"][: self._n], self._arr["reward"][: self._n]
        leaf = self.traj_leaf
        r = reward[leaf]
        done = ((self._arr["flags"][leaf] & TERMINAL) != 0) & ~np.isnan(r)
        tree = self._arr["tree"][leaf].astype(np.int64)
        branch = parent[self.traj_origin] >= 0  # continued from an inner prefix, not from the root
        root = done & ~branch
        k = self._n_trees
        n_root = np.bincount(tree[root], minlength=k)
        lo = np.full(k, np.inf)
        hi = np.full(k, -np.inf)
        np.minimum.at(lo, tree[root], r[root])
        np.maximum.at(hi, tree[root], r[root])
        pure = (n_root >= 2) & (lo == hi)
        counted = done & branch & pure[tree]
        flipped = counted & (r != lo[tree])
        out.update(trees=int(np.unique(tree[counted]).size), trees_mixed=int(np.unique(tree[flipped]).size),
                   branches=int(counted.sum()), flipped=int(flipped.sum()))
        return out

    def advantages(self, name: str = "trace", **kwargs: Any) -> np.ndarray:
        """Per-node advantages from the estimator registered as ``name`` in
        :data:`trace_gym.forest.advantages.ADVANTAGES` (``trace``, ``grpo``, ``dr_grpo``, ``rloo``,
        ``treerl``, ``tree_grpo``, or a user's); ``kwargs`` go to the estimator, and
        ``name`` may carry options itself (``"trace:scale=group"``). Backs the forest up
        first. Returns float64 of ``len(self)``, 0 at roots; the tokens of node
        ``y`` get ``adv[y]``."""
        from trace_gym.forest.advantages import resolve_estimator

        fn, kwargs = resolve_estimator(name, **kwargs)
        self.ensure_backed_up()
        adv = np.asarray(fn(self, **kwargs), dtype=np.float64)
        if adv.shape != (self._n,):
            raise ValueError(f"advantage estimator {name!r} returned shape {adv.shape}, expected ({self._n},)")
        return adv

    def select(self, trees: Sequence[int] | np.ndarray) -> tuple["Forest", np.ndarray]:
        """A new forest holding only ``trees`` (every node and trajectory of them, backed up),
        and ``nodes``: the id in this forest of each of its nodes (``sub`` node ``i`` is
        ``self`` node ``nodes[i]``). Text and payloads are shared, not copied. This is how an
        allocator plans for one prompt while the others are still rolling out."""
        trees = np.asarray(trees, dtype=np.int64)
        keep = np.isin(self.tree, trees)
        nodes = np.flatnonzero(keep)
        sub = Forest(capacity=max(16, nodes.size))
        remap = np.full(self._n, -1, dtype=np.int64)
        remap[nodes] = np.arange(nodes.size)
        tree_map = np.full(self._n_trees, -1, dtype=np.int64)
        tree_map[np.sort(trees)] = np.arange(trees.size)
        for name in _NODE_ARRAYS:
            sub._arr[name][: nodes.size] = self._arr[name][nodes]
        par = sub._arr["parent"][: nodes.size]
        par[par >= 0] = remap[par[par >= 0]]
        sub._arr["tree"][: nodes.size] = tree_map[self._arr["tree"][nodes]]
        sub._n = int(nodes.size)
        sub.payload = [self.payload[i] for i in nodes]
        sub.text = [self.text[i] for i in nodes]
        for t in np.sort(trees):
            sub.task_ids.append(self.task_ids[t])
            sub.prompts.append(self.prompts[t])
            sub.max_turns.append(self.max_turns[t])
        sub._n_trees = int(trees.size)
        sub._root_nodes = remap[self.root_nodes[np.sort(trees)]].astype(np.int32)
        trajs = np.flatnonzero(keep[self.traj_origin]) if self._n_traj else np.zeros(0, dtype=np.int64)
        traj_map = np.full(max(self._n_traj, 1), -1, dtype=np.int64)
        traj_map[trajs] = np.arange(trajs.size)
        t_col = sub._arr["traj"][: nodes.size]
        t_col[t_col >= 0] = traj_map[t_col[t_col >= 0]]
        sub._n_traj = int(trajs.size)
        sub._traj_origin = remap[self.traj_origin[trajs]].astype(np.int32)
        sub._traj_leaf = remap[self.traj_leaf[trajs]].astype(np.int32)
        sub.counters["trajectories"] = sub._n_traj
        sub.backup()
        return sub, nodes

    def leaves(self) -> np.ndarray:
        """Ids of finished leaves (terminal nodes)."""
        return np.flatnonzero(self.flags & TERMINAL)

    def branchable(self) -> np.ndarray:
        """Ids of non-root, non-terminal nodes that lie on a trajectory (prefixes stage 2 may branch from)."""
        return np.flatnonzero(((self.flags & TERMINAL) == 0) & (self.parent >= 0))

    def path(self, node: int) -> list[int]:
        """Node ids from the root's child down to ``node``."""
        out = []
        parent = self._arr["parent"]
        while parent[node] >= 0:
            out.append(int(node))
            node = int(parent[node])
        return out[::-1]

    def history(self, node: int, *, oracle: bool = False) -> History:
        """The :class:`History` that ends at ``node`` (the predictor's input).

        Its ``oracle`` (the env's exact success probability) is NaN unless ``oracle=True``:
        only an oracle component (a predictor or allocator whose ``reads_oracle`` is True)
        asks for it, so no other predictor or allocator can read a true value from a
        history, by construction."""
        tree = int(self._arr["tree"][node])
        return History(
            task_id=self.task_ids[tree],
            prompt=self.prompts[tree],
            steps=tuple(self.text[i] for i in self.path(node)),
            oracle=float(self._arr["oracle"][node]) if oracle else float("nan"),
            max_turns=self.max_turns[tree],
        )

    def histories(self, nodes: Iterable[int], *, oracle: bool = False) -> list[History]:
        """:meth:`history` for each node (true values blanked unless ``oracle=True``)."""
        return [self.history(int(i), oracle=oracle) for i in nodes]

    def fingerprint(self) -> str:
        """A 16-hex-digit sha256 of what was generated: every node's parent, trajectory,
        token count, reward, text and (where its payload has them) token ids, and every
        tree's task id, in node order.

        Two forests have the same fingerprint exactly when their generations are the same
        to the token (up to sha256 collisions), whatever machine or process built them; a
        rerun whose fingerprint differs from the original's generated something else."""
        import hashlib

        h = hashlib.sha256()
        for name in ("parent", "traj", "n_tokens"):
            h.update(np.ascontiguousarray(getattr(self, name), dtype="<i4").tobytes())
        # NaN marks a non-terminal node; one canonical bit pattern keeps equal forests equal
        reward = np.where(np.isnan(self.reward), np.inf, self.reward)
        h.update(np.ascontiguousarray(reward, dtype="<f8").tobytes())
        for seq in (self.task_ids, self.text):
            for s in seq:
                h.update(s.encode("utf-8", "surrogatepass") + b"\x00")
        for p in self.payload:
            ids = getattr(p, "token_ids", None)
            if ids is not None:
                h.update(np.asarray(ids, dtype="<i8").tobytes())
            h.update(b"\x01")
        return h.hexdigest()[:16]


_NODE_ARRAYS: dict[str, tuple[np.dtype, Any]] = {
    name: (d.dtype, d.fill) for name, d in vars(Forest).items() if isinstance(d, NodeArray)
}
"""name -> (dtype, fill) of every node array, in declaration order."""
