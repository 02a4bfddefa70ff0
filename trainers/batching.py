"""Token batches of a forest for the policy loss: each tree packed once, or one sequence per trajectory.

The loss trains every policy token of a step's forest exactly once (the token's node carries
its advantage; its behaviour log-prob comes from the rollout engine). How the forward pass
reaches those tokens is the *packing* (``loss.packing`` in trainers/config.py):

``tree`` (:func:`tree_units`)
    A tree's tokens run forward once: the prompt and every node span appear once per packed
    row, however many trajectories share them. Trajectories are taken in depth-first order
    and added to a row together with the ancestors the row does not hold yet, until the row
    would exceed ``max_tokens`` (a tree larger than that is split into rows, each repeating
    the shared ancestors it needs; several small trees share one row). Every token carries
    the position id of its place on its own root-to-node path, and the row's attention mask
    (:func:`path_mask`, shape ``(rows, 1, n, n)``) lets a token attend exactly to the tokens
    of that path up to itself. A policy token is predicted from the hidden state of the
    token before it *on its path* (for the first token of a turn: the last token of the
    parent's span), so its log-prob is that of a forward over its own root-to-node sequence.
``trajectory`` (:func:`trajectory_units`)
    One causal sequence per trajectory (the prompt, its ancestors' spans, its own spans); its
    own policy tokens carry loss, so shared prefixes run forward once per branch.

Both give :class:`LossUnit` rows. :func:`collate` turns a micro-batch of them into tensors
whose *loss layout* is ``[groups, width]``: one row per trajectory holding its loss tokens
(in path order), so the aggregations of trainers/loss.py (token-mean, per-sequence means)
see each trajectory as one sequence in either packing. In ``trajectory`` packing the loss
layout is the sequence shifted by one (column ``p - 1`` holds the token at position ``p``),
exactly the classic next-token layout.

Trajectories are counted and skipped the same way in both packings: one with no policy
token is left out; with ``skip_zero_advantage`` one whose policy tokens all have advantage 0
is counted (policy tokens, sequences) but not trained.

Prefix weight. A node shared by n trajectories (n the finished leaves below it) is one loss
token per policy token, carrying the mean of its trajectories' advantages. Trained as n
separate sequences (how GRPO trainers that duplicate a branch's prefix train a tree) it would
carry their sum instead: n times the weight. ``prefix_weight`` = alpha weights each policy
token's loss by ``n ** alpha`` and the token-mean normaliser by the same (``weighted_tokens``):
0 trains each token once (the default); 1 gives exactly the gradient of the duplicated
sequences; 0.5 is the square root between them, the weight TreeRL gives a shared prefix by
dividing duplicated sequences' advantages by ``sqrt(|L(s)|)`` (the ``treerl`` estimator
already divides, so TreeRL's own update is ``treerl`` with 1). Nodes on an unbranched path
have n = 1, so a forest without branches is trained the same under any alpha.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence, Sized

import numpy as np
import torch

from trace_gym.forest.forest import Forest

Packing = Literal["tree", "trajectory"]

MASK_ATTENTION = ("sdpa", "eager")
"""Attention implementations :func:`attention_mask` prepares a 4D mask for (sdpa takes it as
bool, eager as an additive float mask)."""


@dataclass
class LossUnit:
    """One row of the forward pass and the loss tokens it carries.

    ``ids``/``positions`` (int64 ``[n]``): tokens and their position ids. ``segment`` (int32
    ``[n]``) and ``ancestors`` (bool ``[S, S]``, ``ancestors[s, r]``: segment ``r`` lies on
    the path of segment ``s``, itself included) define the attention of a packed row; both
    are None for a plain causal sequence. Per loss token (``[K]``): ``src``, the row position
    whose output predicts it; ``target``, its id; ``group``/``col``, its place in the loss
    layout (``n_groups`` rows of ``width`` columns, one row per trajectory); ``adv``, its
    node's advantage; ``behaviour``, the rollout engine's log-prob; ``weight``, its loss weight
    (the module docstring's prefix weight; None: all 1). ``trajs`` are the forest's
    trajectory ids of the groups.
    """

    ids: np.ndarray
    positions: np.ndarray
    segment: np.ndarray | None
    ancestors: np.ndarray | None
    src: np.ndarray
    target: np.ndarray
    group: np.ndarray
    col: np.ndarray
    adv: np.ndarray
    behaviour: np.ndarray
    n_groups: int
    width: int
    trajs: tuple[int, ...]
    weight: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def loss_tokens(self) -> int:
        """Number of tokens the unit puts into the loss (``K``)."""
        return int(self.target.shape[0])


@dataclass
class TokenBatch:
    """What a forest gives the loss: ``units``; ``policy_tokens`` and ``sequences``, the
    token-mean and per-sequence normalisers (skipped zero-advantage trajectories included);
    ``forward_tokens``, the tokens the units run forward (no padding); ``weighted_tokens``,
    the token-mean normaliser under the prefix weight (``policy_tokens`` when it is 0)."""

    units: list[LossUnit]
    policy_tokens: int
    sequences: int
    weighted_tokens: float | None = None

    def __post_init__(self) -> None:
        if self.weighted_tokens is None:
            self.weighted_tokens = float(self.policy_tokens)

    @property
    def forward_tokens(self) -> int:
        """Tokens the units run forward, summed (no padding)."""
        return sum(len(u) for u in self.units)

    @property
    def loss_tokens(self) -> int:
        """Tokens the units put into the loss, summed."""
        return sum(u.loss_tokens for u in self.units)


def _span(forest: Forest, node: int) -> tuple[list[int], list[int], list[float]]:
    """``(token ids, mask, behaviour log-probs)`` of a node's span (a root: its prompt)."""
    p = forest.payload[node]
    if forest.parent[node] < 0:
        ids = getattr(p, "token_ids", None)
        if ids is None:
            raise ValueError(f"root {node} has no rendered prompt (was the tree built by a RolloutEngine?)")
        return list(ids), [0] * len(ids), [0.0] * len(ids)
    return list(p.token_ids), list(p.mask), list(p.logprobs)


def node_weights(forest: Forest, prefix_weight: float) -> np.ndarray | None:
    """Each node's loss weight (:meth:`~trace_gym.forest.forest.Forest.prefix_weights`; see the
    module docstring), or None when ``prefix_weight`` is 0 (every weight 1, nothing to weigh)."""
    return None if prefix_weight == 0.0 else forest.prefix_weights(prefix_weight)


def _trained_trajectories(forest: Forest, adv: np.ndarray, skip_zero_advantage: bool,
                          weights: np.ndarray | None = None) -> tuple[list[tuple[int, list[int]]], int, int, float]:
    """``([(trajectory, its path from the root's child to its leaf)], policy tokens, sequences,
    weighted policy tokens)`` of the trajectories to train, in the forest's trajectory order
    (see the module docstring for what is counted and skipped)."""
    out: list[tuple[int, list[int]]] = []
    n_tokens = n_seqs = 0
    n_weighted = 0.0
    traj = forest.traj
    for t in range(forest.n_trajectories):
        leaf, origin = int(forest.traj_leaf[t]), int(forest.traj_origin[t])
        if leaf == origin:
            continue  # failed before its first turn
        path = forest.path(leaf)
        own = [n for n in path if traj[n] == t]
        counts = [int(np.count_nonzero(forest.payload[n].mask)) for n in own]
        k = sum(counts)
        if k == 0:
            continue
        n_tokens += k
        n_weighted += k if weights is None else float(sum(c * weights[n] for n, c in zip(own, counts)))
        n_seqs += 1
        if skip_zero_advantage and not any(adv[n] != 0 for n, c in zip(own, counts) if c):
            continue
        out.append((t, path))
    return out, n_tokens, n_seqs, n_weighted


def trajectory_units(forest: Forest, adv: np.ndarray, *, skip_zero_advantage: bool = True,
                     prefix_weight: float = 0.0) -> TokenBatch:
    """One causal :class:`LossUnit` per trained trajectory (``trajectory`` packing)."""
    from trace_gym.rollout.engine import sequence

    weights = node_weights(forest, prefix_weight)
    chosen, n_tokens, n_seqs, n_weighted = _trained_trajectories(forest, adv, skip_zero_advantage, weights)
    units = []
    for t, path in chosen:
        seq = sequence(forest, path[-1])
        own = (seq.mask == 1) & (forest.traj[seq.node] == t)
        own[0] = False  # nothing predicts the first token (the prompt's)
        pos = np.flatnonzero(own)
        n = len(seq.ids)
        units.append(LossUnit(
            ids=seq.ids.astype(np.int64), positions=np.arange(n, dtype=np.int64), segment=None, ancestors=None,
            src=(pos - 1).astype(np.int64), target=seq.ids[pos].astype(np.int64), group=np.zeros(len(pos), dtype=np.int32),
            col=(pos - 1).astype(np.int32), adv=adv[seq.node[pos]].astype(np.float32), behaviour=seq.logprobs[pos].astype(np.float32),
            n_groups=1, width=n - 1, trajs=(t,),
            weight=None if weights is None else weights[seq.node[pos]].astype(np.float32)))
    return TokenBatch(units, n_tokens, n_seqs, n_weighted)


def tree_units(forest: Forest, adv: np.ndarray, *, skip_zero_advantage: bool = True, max_tokens: int = 2048,
               prefix_weight: float = 0.0) -> TokenBatch:
    """Packed :class:`LossUnit` rows holding each tree's tokens once (``tree`` packing; see the
    module docstring). A row exceeds ``max_tokens`` only when one trajectory alone does."""
    weights = node_weights(forest, prefix_weight)
    chosen, n_tokens, n_seqs, n_weighted = _trained_trajectories(forest, adv, skip_zero_advantage, weights)
    roots = forest.root_nodes
    tree = forest.tree
    lengths: dict[int, int] = {}

    def length(node: int) -> int:
        if node not in lengths:
            lengths[node] = len(_span(forest, node)[0])
        return lengths[node]

    # depth-first order: trajectories sharing longer prefixes end up next to each other
    chosen.sort(key=lambda tp: (int(tree[tp[1][-1]]), tp[1]))
    units: list[LossUnit] = []
    rows: list[tuple[set[int], list[int]]] = []
    nodes: set[int] = set()
    placed: list[int] = []
    size = 0
    for t, path in chosen:
        full = [int(roots[tree[path[-1]]])] + path
        need = [n for n in full if n not in nodes]
        extra = sum(length(n) for n in need)
        if placed and size + extra > max_tokens:
            rows.append((nodes, placed))
            nodes, placed, size = set(), [], 0
            need, extra = full, sum(length(n) for n in full)
        nodes.update(need)
        placed.append(t)
        size += extra
    if placed:
        rows.append((nodes, placed))
    for row_nodes, row_trajs in rows:
        units.append(_pack_row(forest, adv, sorted(row_nodes, key=lambda n: (int(tree[n]), n)), row_trajs, weights))
    return TokenBatch(units, n_tokens, n_seqs, n_weighted)


def _pack_row(forest: Forest, adv: np.ndarray, nodes: list[int], trajs: list[int], weights: np.ndarray | None = None) -> LossUnit:
    """One packed row of ``nodes`` (every ancestor of a node precedes it) whose loss tokens
    are the policy tokens of the nodes that trajectories ``trajs`` generated."""
    parent, traj = forest.parent, forest.traj
    index = {n: s for s, n in enumerate(nodes)}
    group_of = {t: g for g, t in enumerate(trajs)}
    S = len(nodes)
    ancestors = np.zeros((S, S), dtype=bool)
    ids: list[int] = []
    positions: list[np.ndarray] = []
    segment: list[np.ndarray] = []
    start_pos = np.zeros(S, dtype=np.int64)  # position id of each span's first token
    span_len = np.zeros(S, dtype=np.int64)
    last = np.full(S, -1, dtype=np.int64)  # row index of the last token on the path through each node
    src, target, group, col, a, beh, wt = [], [], [], [], [], [], []
    cols = [0] * len(trajs)
    for s, n in enumerate(nodes):
        span, mask, lps = _span(forest, n)
        p = int(parent[n])
        if p >= 0:
            ps = index[p]  # KeyError here: a node packed without its parent (a bug)
            ancestors[s] = ancestors[ps]
            start_pos[s] = start_pos[ps] + span_len[ps]
            before = int(last[ps])
        else:
            before = -1
        ancestors[s, s] = True
        span_len[s] = len(span)
        first = len(ids)
        ids.extend(span)
        positions.append(start_pos[s] + np.arange(len(span), dtype=np.int64))
        segment.append(np.full(len(span), s, dtype=np.int32))
        last[s] = first + len(span) - 1 if span else before
        g = group_of.get(int(traj[n])) if p >= 0 else None
        if g is None:
            continue
        for k, m in enumerate(mask):
            if not m:
                continue
            prev = first + k - 1 if k > 0 else before
            if prev < 0:
                raise ValueError(f"node {n}: a policy token with no token before it on its path (an empty prompt?)")
            src.append(prev)
            target.append(span[k])
            group.append(g)
            col.append(cols[g])
            cols[g] += 1
            a.append(adv[n])
            beh.append(lps[k])
            if weights is not None:
                wt.append(weights[n])
    return LossUnit(
        ids=np.asarray(ids, dtype=np.int64), positions=np.concatenate(positions) if positions else np.zeros(0, np.int64),
        segment=np.concatenate(segment) if segment else np.zeros(0, np.int32), ancestors=ancestors,
        src=np.asarray(src, dtype=np.int64), target=np.asarray(target, dtype=np.int64), group=np.asarray(group, dtype=np.int32),
        col=np.asarray(col, dtype=np.int32), adv=np.asarray(a, dtype=np.float32), behaviour=np.asarray(beh, dtype=np.float32),
        n_groups=len(trajs), width=max(cols) if cols else 0, trajs=tuple(trajs),
        weight=None if weights is None else np.asarray(wt, dtype=np.float32))


def token_batch(forest: Forest, adv: np.ndarray, packing: Packing = "tree", *, skip_zero_advantage: bool = True,
                max_tokens: int = 2048, prefix_weight: float = 0.0) -> TokenBatch:
    """The forest's :class:`TokenBatch` under ``packing`` (``tree`` or ``trajectory``) and the
    module docstring's ``prefix_weight``."""
    if packing == "tree":
        return tree_units(forest, adv, skip_zero_advantage=skip_zero_advantage, max_tokens=max_tokens, prefix_weight=prefix_weight)
    if packing == "trajectory":
        return trajectory_units(forest, adv, skip_zero_advantage=skip_zero_advantage, prefix_weight=prefix_weight)
    raise ValueError(f"unknown packing {packing!r} (known: tree, trajectory)")


def path_mask(unit: LossUnit, width: int | None = None) -> torch.Tensor:
    """Bool ``[width, width]``: ``True`` where token ``i`` may attend to token ``j``, i.e. ``j``
    is on ``i``'s root-to-node path and not after it. Padding tokens past the unit attend to
    themselves only (a query row with nothing to attend to would give NaN)."""
    n = len(unit)
    width = n if width is None else width
    out = torch.zeros((width, width), dtype=torch.bool)
    if unit.ancestors is None:
        out[:n, :n] = torch.ones((n, n), dtype=torch.bool).tril()
    else:
        seg = torch.from_numpy(unit.segment).long()
        anc = torch.from_numpy(unit.ancestors)
        out[:n, :n] = anc[seg[:, None], seg[None, :]].tril()
    pad = torch.arange(n, width)
    out[pad, pad] = True
    return out


def check_attention(model: Any) -> str:
    """The attention implementation of ``model`` when a packed row's 4D mask reaches every
    layer unchanged (:data:`MASK_ATTENTION`, full attention in every layer); otherwise a
    ``ValueError`` that names it and the way out (``loss.packing=trajectory``)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = inner.config
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in MASK_ATTENTION:
        raise ValueError(f"loss.packing=tree needs an attention implementation that takes a 4D mask ({', '.join(MASK_ATTENTION)}); "
                         f"the model uses {impl!r}: load it with attn_implementation='sdpa' or set loss.packing=trajectory")
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"loss.packing=tree packs with a full-attention path mask, but the model has layers of types "
                         f"{sorted(kinds)} (a sliding window would see other tokens than its sequence alone): set loss.packing=trajectory")
    return impl


def attention_mask(allowed: torch.Tensor, impl: str, dtype: torch.dtype) -> torch.Tensor:
    """The 4D mask ``[rows, 1, n, n]`` ``impl`` takes from a bool ``allowed`` of that shape:
    the bool itself for sdpa, 0 / the dtype's minimum (blocked) for eager."""
    if impl == "sdpa":
        return allowed
    blocked = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return blocked.masked_fill_(~allowed, torch.finfo(dtype).min)


def micro_batches(units: Sequence[Sized], max_tokens: int | None, max_rows: int | None = None) -> list[list[int]]:
    """Indices of ``units`` (loss units, or any sequences: their ``len`` is their width)
    grouped into micro-batches of at most ``max_tokens`` padded tokens (rows x widest row;
    None: no bound; a unit wider than that gets a micro-batch alone) and at most ``max_rows``
    rows (None: no bound), shortest first."""
    order = sorted(range(len(units)), key=lambda i: len(units[i]))
    batches, cur, width = [], [], 0
    for i in order:
        w = max(width, len(units[i]))
        if cur and ((max_tokens is not None and w * (len(cur) + 1) > max_tokens)
                    or (max_rows is not None and len(cur) >= max_rows)):
            batches.append(cur)
            cur, w = [], len(units[i])
        cur.append(i)
        width = w
    if cur:
        batches.append(cur)
    return batches


def collate(units: Sequence[LossUnit], pad_id: int, *, impl: str = "sdpa", dtype: torch.dtype = torch.float32,
            device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Tensors of one micro-batch.

    Forward: ``ids`` ``[R, W]`` (padded with ``pad_id``), ``attn``: a ``[R, W]`` padding mask
    when every unit is a causal sequence, else the 4D path mask of :func:`attention_mask`,
    and then ``positions`` ``[R, W]``. Gather: ``rows``/``cols`` (the row positions whose
    outputs predict the loss tokens) and ``targets`` ``[K]``, with ``slot_rows``/``slot_cols``
    their places in the loss layout. Loss layout ``[G, L]`` (G the units' groups, L their
    widest group): ``mask`` (1 on loss tokens), ``adv``, ``behaviour``, and ``weight`` (the
    loss tokens' weights, 1 where a unit has none; 0 off the loss tokens).
    """
    R, W = len(units), max(len(u) for u in units)
    G, L = sum(u.n_groups for u in units), max(max(u.width for u in units), 1)
    packed = any(u.ancestors is not None for u in units)
    ids = torch.full((R, W), int(pad_id), dtype=torch.long)
    positions = torch.zeros((R, W), dtype=torch.long)
    pad2d = torch.zeros((R, W), dtype=torch.long)
    allowed = torch.zeros((R, 1, W, W), dtype=torch.bool) if packed else None
    mask, adv, behaviour, weight = torch.zeros((G, L)), torch.zeros((G, L)), torch.zeros((G, L)), torch.zeros((G, L))
    rows, cols, targets, slot_rows, slot_cols = [], [], [], [], []
    g0 = 0
    for r, u in enumerate(units):
        n = len(u)
        ids[r, :n] = torch.from_numpy(u.ids)
        positions[r, :n] = torch.from_numpy(u.positions)
        pad2d[r, :n] = 1
        if allowed is not None:
            allowed[r, 0] = path_mask(u, W)
        sr = torch.from_numpy(u.group.astype(np.int64)) + g0
        sc = torch.from_numpy(u.col.astype(np.int64))
        mask[sr, sc] = 1.0
        adv[sr, sc] = torch.from_numpy(u.adv)
        behaviour[sr, sc] = torch.from_numpy(u.behaviour)
        weight[sr, sc] = 1.0 if u.weight is None else torch.from_numpy(u.weight)
        rows.append(torch.full((u.loss_tokens,), r, dtype=torch.long))
        cols.append(torch.from_numpy(u.src))
        targets.append(torch.from_numpy(u.target))
        slot_rows.append(sr)
        slot_cols.append(sc)
        g0 += u.n_groups
    out = {"ids": ids, "rows": torch.cat(rows), "cols": torch.cat(cols), "targets": torch.cat(targets),
           "slot_rows": torch.cat(slot_rows), "slot_cols": torch.cat(slot_cols), "mask": mask, "adv": adv, "behaviour": behaviour,
           "weight": weight}
    if allowed is not None:
        out["attn"] = attention_mask(allowed, impl, dtype)
        out["positions"] = positions
    else:
        out["attn"] = pad2d
    return {k: v.to(device) for k, v in out.items()}


__all__ = ["LossUnit", "MASK_ATTENTION", "Packing", "TokenBatch", "attention_mask", "check_attention", "collate", "micro_batches",
           "node_weights", "path_mask", "token_batch", "trajectory_units", "tree_units"]
