"""ContrastLab's vectorised fast path: grows a whole forest at once with the same process as the env."""

from __future__ import annotations

import weakref

import numpy as np

from trace_gym.forest.forest import Forest
from trace_gym.task import Split

from trace_gym.sim.world import CAT_NONE, ContrastLabWorld, node_text, observation_text
from trace_gym.sim.world import _THOUGHTS, _tables

class ContrastLabSim:
    """Vectorised fast path of ContrastLab: grows a :class:`~trace_gym.forest.forest.Forest` with
    the same process as :class:`ContrastLabEnv` driven by the ``sim`` policy at
    temperature 1, all live trajectories at once.

    ``rollout(forest, origins)`` is an :data:`trace_gym.allocation.allocator.RolloutFn`: it starts a
    trajectory at every origin (a root, or an inner node it generated earlier) and runs all
    of them to the end. Nodes get ``n_tokens`` (policy tokens), ``oracle`` (exact V), the
    terminal reward and the text ``node_text(action, observation)``. The latent state of
    each node is kept per forest, so branches continue from the exact env state
    (:meth:`node_info` returns it with each turn's observation category and correctness,
    for evaluation).
    """

    def __init__(self, world: ContrastLabWorld, seed: int = 0):
        self.world = world
        self.rng = np.random.default_rng([int(seed), 0x51A])
        self._info: "weakref.WeakKeyDictionary[Forest, dict[str, np.ndarray]]" = weakref.WeakKeyDictionary()
        self._tree_task: "weakref.WeakKeyDictionary[Forest, np.ndarray]" = weakref.WeakKeyDictionary()
        tab = _tables(world)
        self._act_tokens = tab["n_tokens"]
        # every node text the fast path can write, indexed [thought, option, final, category, turn, turns]
        T = world.max_turns
        shape = (len(_THOUGHTS), world.n_options, 2, 4, T + 1, T + 1)
        self._shape = shape
        self._texts = [
            node_text(tab["texts"][a][b][c], observation_text(e, f, g))
            for a, b, c, e, f, g in np.ndindex(*shape)
        ]

    def sample_pool(self, size: int, split: Split = "train") -> np.ndarray:
        """``size`` distinct global task indices drawn uniformly from ``split``."""
        idx = self.world.split_indices(split)
        return np.sort(self.rng.choice(idx, size=min(size, idx.size), replace=False))

    def _task_of_trees(self, forest: Forest) -> np.ndarray:
        cached = self._tree_task.get(forest)
        if cached is None or cached.size < forest.n_trees:
            start = 0 if cached is None else cached.size
            new = np.array([self.world.index_of(t) for t in forest.task_ids[start:]], dtype=np.int64)
            cached = new if cached is None else np.concatenate([cached, new])
            self._tree_task[forest] = cached
        return cached

    def _node_arrays(self, forest: Forest) -> dict[str, np.ndarray]:
        """Per-node ``latent`` bit, observation ``category`` and whether the turn's option was
        ``correct`` (-1 at roots) of a forest this sim grows, sized to cover every node."""
        arrs = self._info.get(forest)
        size = 0 if arrs is None else arrs["latent"].size
        if arrs is None or size < len(forest):
            cap = max(len(forest), 2 * size, 64)
            new = {"latent": np.ones(cap, dtype=np.int8), "category": np.full(cap, CAT_NONE, dtype=np.int8),
                   "correct": np.full(cap, -1, dtype=np.int8)}
            if arrs is not None:
                for k in new:
                    new[k][:size] = arrs[k]
            arrs = new
            self._info[forest] = arrs
        return arrs

    def node_info(self, forest: Forest) -> dict[str, np.ndarray]:
        """What the simulator knows about each node of ``forest`` (length ``len(forest)``):
        ``latent`` (the on-track bit after the turn; 1 at roots), ``category`` (the
        observation shown after it: ``CAT_PROGRESS``, ``CAT_ERROR``, ``CAT_NEUTRAL``, or
        ``CAT_NONE`` at roots and final turns) and ``correct`` (1 if the turn's option was the
        task's correct one, 0 if not, -1 at roots). Nodes this sim did not generate keep the
        root values. For evaluation only: allocators and predictors never see it."""
        arrs = self._node_arrays(forest)
        return {k: v[: len(forest)].copy() for k, v in arrs.items()}

    def rollout(self, forest: Forest, origins: np.ndarray) -> None:
        """Run one trajectory from each node in ``origins`` to its end (see the class docstring)."""
        origins = np.asarray(origins, dtype=np.int64)
        if origins.size == 0:
            return
        w, rng = self.world, self.rng
        tree_task = self._task_of_trees(forest)
        lat = self._node_arrays(forest)["latent"]
        is_root = forest.parent[origins] < 0
        trajs = np.array([forest.start_trajectory(int(o)) for o in origins], dtype=np.int64)
        task = tree_task[forest.tree[origins]]
        depth = forest.depth[origins].astype(np.int64)
        on = np.where(is_root, 1, lat[origins]).astype(np.int8)
        turns = w.turns[task]
        live = np.arange(origins.size)
        while live.size:
            tk, d = task[live], depth[live] + 1
            correct = rng.random(live.size) < w.q[tk, d]
            recover = rng.random(live.size) < w.recovery
            new_on = (correct & ((on[live] == 1) | recover)).astype(np.int8)
            final = d >= turns[live]
            u_noise, u_flip = rng.random(live.size), rng.random(live.size)
            # the option the policy wrote: the correct one, or a uniformly random wrong one
            wrong = (w.correct[tk, d] + rng.integers(1, w.n_options, size=live.size)) % w.n_options
            option = np.where(correct, w.correct[tk, d], wrong)
            thought = rng.integers(0, len(_THOUGHTS), size=live.size)
            cat = np.where(final, CAT_NONE, w.observation_category(new_on, u_noise, u_flip))
            n_tok = self._act_tokens[thought, option, final.astype(np.int64)]
            oracle = w.value(tk, d, new_on)
            flat = np.ravel_multi_index((thought, option, final.astype(np.int64), cat, d, turns[live]), self._shape)
            table = self._texts
            texts = [table[k] for k in flat.tolist()]
            ids = forest.add_nodes(trajs[live], n_tokens=n_tok, terminal=final, reward=new_on.astype(np.float64),
                                   oracle=oracle, texts=texts)
            arrs = self._node_arrays(forest)
            arrs["latent"][ids] = new_on
            arrs["category"][ids] = cat
            arrs["correct"][ids] = correct
            on[live] = new_on
            depth[live] = d
            live = live[~final]
