"""Tree packing (trainers/batching.py): each tree's tokens run forward once, every token sees
exactly its own root-to-node path, every policy token is a loss token once, and the loss and
gradients equal those of one sequence per trajectory (relative 1e-5: sdpa over a packed row
and over a lone sequence round differently, about 6e-5 absolute on smollm2's logits).

The forests are built by hand with the rollout engine's records (prompts, turns with policy
and observation tokens, stage-2 branches at inner nodes, a context-limit leaf with no tokens,
a trajectory whose advantages are all zero), so every shape the engine produces is covered
without sampling. The models are the tiny preset (built offline, cached like
tests/test_trainer.py's) and SmolLM2-135M.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

import forest_reference as ref

from trace_gym.forest.forest import Forest
from trace_gym.rollout.engine import RootRecord, TurnRecord, prefix_ids, sequence
from trace_gym.trainers.batching import check_attention, path_mask, token_batch, tree_units, trajectory_units

CACHE = Path(tempfile.gettempdir()) / f"trace-gym-test-cache-{os.getuid()}"
TINY = {"envs": ["trace_gym/ContrastLab-v0"], "hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
        "intermediate_size": 128, "corpus_tasks": 100, "vocab_size": 400}


def build_forest(seed: int, vocab: int, trees: int = 3, roots: int = 2, branches: int = 3, scale: int = 1,
                 context_leaf: bool = True) -> tuple[Forest, np.ndarray]:
    """A forest shaped like the engine's (see the module docstring) and per-node advantages."""
    rng = np.random.default_rng(seed)
    f = Forest()

    def ids(n: int) -> list[int]:
        return rng.integers(3, vocab, n).tolist()

    def run(t: int, turns: int) -> None:
        for k in range(turns):
            last = k == turns - 1
            g, o = int(rng.integers(2, 7)) * scale, 0 if last else int(rng.integers(1, 5)) * scale
            prefix = len(prefix_ids(f, int(f.traj_leaf[t])))
            rec = TurnRecord(ids(g + o), [1] * g + [0] * o, (-rng.random(g) * 3).tolist() + [0.0] * o, g, prefix, "", "", "tool",
                             "stop", None, t)
            f.add_node(t, n_tokens=g, terminal=last, reward=float(rng.integers(0, 2)) if last else math.nan, payload=rec)

    for i in range(trees):
        root = f.add_root(f"task-{i}", payload=RootRecord(None, ids(int(rng.integers(5, 12)) * scale), None, [], []))
        for _ in range(roots):
            run(f.start_trajectory(root), int(rng.integers(1, 4)))
        for _ in range(branches):
            inner = [int(n) for n in f.branchable() if f.tree[n] == i]
            if inner:
                run(f.start_trajectory(int(rng.choice(inner))), int(rng.integers(1, 3)))
    if context_leaf:  # a branch that hit the context limit: an empty truncated leaf under an inner node
        inner = [int(n) for n in f.branchable()]
        t = f.start_trajectory(inner[0])
        f.add_node(t, truncated=True, reward=0.0, payload=TurnRecord([], [], [], 0, len(prefix_ids(f, inner[0])), "", "", "", "context", None, t))
    adv = rng.normal(size=len(f)).astype(np.float32)
    adv[f.root_nodes] = 0.0
    adv[f.traj == 1] = 0.0  # trajectory 1 has no signal: counted, not trained
    return f, adv


@pytest.mark.parametrize("max_tokens", [10_000, 60])
def test_packed_rows_give_every_token_exactly_its_own_path_and_train_each_policy_token_once(max_tokens):
    forest, adv = build_forest(0, 500, trees=3, roots=3, branches=4)
    batch = tree_units(forest, adv, max_tokens=max_tokens)
    flat = trajectory_units(forest, adv)
    if max_tokens < 100:
        assert len(batch.units) > forest.n_trees  # trees were split into rows
    else:
        assert len(batch.units) == 1
    trained: dict[tuple[int, int], int] = {}
    for u in batch.units:
        seg_nodes = sorted(_row_nodes(forest, u), key=lambda n: (int(forest.tree[n]), n))
        token_node, token_off = [], []
        for s, n in enumerate(seg_nodes):
            k = int((u.segment == s).sum())
            token_node += [n] * k
            token_off += list(range(k))
        assert len(token_node) == len(u)
        m = path_mask(u).numpy()
        for i in range(len(u)):
            n, k = token_node[i], token_off[i]
            seen = np.flatnonzero(m[i])
            seen = seen[np.argsort(u.positions[seen])]
            full = prefix_ids(forest, n) if forest.parent[n] >= 0 else list(forest.payload[n].token_ids)
            want = full[: len(full) - len(forest.payload[n].token_ids) + k + 1]
            assert u.ids[seen].tolist() == want  # exactly its own root-to-node sequence, in order
            assert u.positions[i] == len(want) - 1
        for j in range(u.loss_tokens):
            s = int(u.src[j])
            # the predicting token is the one before the target on the target's path
            tgt = next(i for i in range(len(u)) if m[i, s] and u.positions[i] == u.positions[s] + 1 and u.ids[i] == u.target[j]
                       and forest.traj[token_node[i]] == u.trajs[u.group[j]])
            key = (token_node[tgt], token_off[tgt])
            assert key not in trained
            trained[key] = 1
            assert u.adv[j] == adv[token_node[tgt]]
            assert u.behaviour[j] == np.float32(forest.payload[token_node[tgt]].logprobs[token_off[tgt]])
    # every policy token of every trained trajectory, once; trajectory 1 (all-zero advantage) left out
    want = {(n, k) for n in range(len(forest)) if forest.parent[n] >= 0 and forest.traj[n] != 1
            for k, mk in enumerate(forest.payload[n].mask) if mk}
    assert set(trained) == want
    assert batch.loss_tokens == flat.loss_tokens == len(want)
    assert batch.policy_tokens == flat.policy_tokens and batch.sequences == flat.sequences
    assert batch.policy_tokens == len(want) + sum(int(np.count_nonzero(forest.payload[n].mask)) for n in np.flatnonzero(forest.traj == 1))
    assert batch.forward_tokens < flat.forward_tokens


def _row_nodes(forest: Forest, unit) -> set[int]:
    """The nodes a packed row holds: the paths of its trajectories (with their roots)."""
    out: set[int] = set()
    for t in unit.trajs:
        leaf = int(forest.traj_leaf[t])
        out.update([int(forest.root_nodes[forest.tree[leaf]]), *forest.path(leaf)])
    return out


def test_one_packed_tree_runs_each_prompt_and_span_once():
    forest, adv = build_forest(1, 500, trees=2, roots=4, branches=6)
    adv[:] = 1.0  # every trajectory trained
    batch = tree_units(forest, adv, max_tokens=100_000)
    spans = sum(len(forest.payload[n].token_ids) for n in range(len(forest)))
    assert batch.forward_tokens == spans  # every node's tokens exactly once
    flat = token_batch(forest, adv, "trajectory")
    with_tokens = [t for t in range(forest.n_trajectories) if any(forest.n_tokens[n] for n in np.flatnonzero(forest.traj == t))]
    assert len(with_tokens) == forest.n_trajectories - 1  # all but the context-limit branch
    assert flat.forward_tokens == sum(len(sequence(forest, int(forest.traj_leaf[t])).ids) for t in with_tokens)
    with pytest.raises(ValueError, match="unknown packing"):
        token_batch(forest, adv, "rows")


# ----------------------------------------------------------------------------- through the trainer


def _trainer(tmp: Path, model: str, micro_batch_tokens: int = 256, **loss):
    from trace_gym.trainers.config import RLConfig
    from trace_gym.trainers.rl import RLTrainer

    cfg = RLConfig.model_validate({
        "seed": 0, "steps": 1, "output_dir": str(tmp), "envs": [{"id": "trace_gym/ContrastLab-v0", "kwargs": {"n_tasks": 16, "n_test": 8}}],
        "model": {"name": model, "tiny": TINY}, "sft": {"enabled": False}, "allocator": "grpo",
        "budget": {"trajectories": 4, "prompts": 2}, "optim": {"grad_clip": 1e9, "micro_batch_tokens": micro_batch_tokens},
        "loss": loss, "log": {"tensorboard": False, "progress": False}})
    with pytest.MonkeyPatch.context() as mp:
        if model == "tiny":
            mp.setenv("TRACE_GYM_CACHE", str(CACHE))
        trainer = RLTrainer(cfg, log=lambda msg: None)
    trainer.optimizer.step = lambda *a, **k: None  # keep the weights: both packings see the same model
    trainer.scheduler.step = lambda *a, **k: None
    return trainer


def _loss_and_grads(trainer, forest, adv, packing: str):
    trainer.cfg.loss.packing = packing
    stats = trainer._update_policy(forest, adv)
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return stats, grads


def _assert_equal_updates(a, b, rtol: float) -> None:
    (sa, ga), (sb, gb) = a, b
    assert sa["update/trained_tokens"] == sb["update/trained_tokens"] > 0
    assert sa["update/sequences"] == sb["update/sequences"] and sa["update/policy_tokens"] == sb["update/policy_tokens"]
    assert sa["update/forward_tokens"] < sb["update/forward_tokens"]
    assert abs(sa["update/loss"] - sb["update/loss"]) <= rtol * abs(sb["update/loss"])
    assert sa["update/entropy"] == pytest.approx(sb["update/entropy"], rel=rtol)
    assert sa["update/grad_norm"] == pytest.approx(sb["update/grad_norm"], rel=rtol)
    assert ga.keys() == gb.keys() and ga
    flat_a, flat_b = torch.cat([ga[n].flatten() for n in gb]), torch.cat([gb[n].flatten() for n in gb])
    assert float(flat_b.norm()) > 0
    assert float((flat_a - flat_b).norm()) <= rtol * float(flat_b.norm())  # the whole gradient
    for name in gb:  # and every tensor of it (small ones round a little worse)
        err = float((ga[name] - gb[name]).norm())
        assert err <= 10 * rtol * float(gb[name].norm()) + 1e-12, f"{name}: relative gradient error {err / float(gb[name].norm()):.2e}"


@pytest.fixture(scope="module")
def tiny_trainer(tmp_path_factory):
    return _trainer(tmp_path_factory.mktemp("tiny"), "tiny", is_correction=True, pack_tokens=96)


@pytest.mark.parametrize("attention, aggregation", [("sdpa", "token-mean"), ("eager", "seq-mean-token-mean")])
def test_tree_packing_equals_per_trajectory_loss_and_gradients_tiny(tiny_trainer, attention, aggregation):
    trainer = tiny_trainer
    trainer.model.set_attn_implementation(attention)
    assert check_attention(trainer.model) == attention
    trainer.cfg.loss.aggregation = aggregation
    forest, adv = build_forest(2, len(trainer.tokenizer), trees=3, roots=3, branches=4, scale=3)
    tree = _loss_and_grads(trainer, forest, adv, "tree")
    assert tree[0]["update/rows"] > 3  # pack_tokens=96 splits the trees; micro_batch_tokens=256 accumulates several rows
    flat = _loss_and_grads(trainer, forest, adv, "trajectory")
    _assert_equal_updates(tree, flat, rtol=1e-5)
    trainer.model.set_attn_implementation("sdpa")
    trainer.cfg.loss.aggregation = "token-mean"


def test_packing_refuses_an_attention_that_drops_the_mask(tiny_trainer):
    model = tiny_trainer.model
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="loss.packing=trajectory"):
            check_attention(model)
    finally:
        model.config._attn_implementation = "sdpa"
    assert check_attention(model) == "sdpa"


@pytest.mark.slow
def test_tree_packing_equals_per_trajectory_loss_and_gradients_smollm2(tmp_path):
    from shared_smollm2 import smollm2_path

    trainer = _trainer(tmp_path, smollm2_path(), micro_batch_tokens=8192, is_correction=True)
    assert check_attention(trainer.model) == "sdpa"
    forest, adv = build_forest(3, 49152, trees=2, roots=2, branches=1)
    tree = _loss_and_grads(trainer, forest, adv, "tree")
    flat = _loss_and_grads(trainer, forest, adv, "trajectory")
    _assert_equal_updates(tree, flat, rtol=1e-5)


# ----------------------------------------------------------------------------- prefix weight


def test_prefix_weight_one_trains_a_tree_as_its_trajectories_duplicated(tiny_trainer):
    """With ``loss.prefix_weight=1`` a shared prefix carries the sum of its trajectories'
    leaf advantages: the loss and gradient equal those of every trajectory trained as its own
    sequence (its prefix repeated), under the token-mean normaliser of the repeated tokens."""
    trainer = tiny_trainer
    forest, _ = build_forest(4, len(trainer.tokenizer), trees=3, roots=2, branches=4, scale=3)
    assert forest.n_trajectories > forest.n_trees * 2  # branches share prefixes
    leaf_adv, adv = ref.leaf_advantages(forest, 4)
    flat_forest, flat_adv = ref.unrolled(forest, leaf_adv)
    assert len(flat_forest) > len(forest)
    trainer.cfg.loss.prefix_weight = 1.0
    try:
        weighted = _loss_and_grads(trainer, forest, adv, "tree")
        trainer.cfg.loss.prefix_weight = 0.0
        dup = _loss_and_grads(trainer, flat_forest, flat_adv, "tree")
        once = _loss_and_grads(trainer, forest, adv, "tree")
    finally:
        trainer.cfg.loss.prefix_weight = 0.0
    (sw, gw), (sd, gd), (so, go) = weighted, dup, once
    assert sw["update/policy_tokens"] < sd["update/policy_tokens"]  # the statistics still count tokens once
    assert sw["update/loss"] == pytest.approx(sd["update/loss"], rel=1e-5)
    flat_w, flat_d, flat_o = (torch.cat([g[n].flatten() for n in gd]) for g in (gw, gd, go))
    assert float((flat_w - flat_d).norm()) <= 1e-5 * float(flat_d.norm())
    assert float((flat_o - flat_d).norm()) > 1e-2 * float(flat_d.norm())  # weight 0 is a different update


def test_prefix_weight_leaves_an_unbranched_forest_alone_and_needs_token_mean():
    from trace_gym.trainers.batching import node_weights
    from trace_gym.trainers.config import LossSection

    forest, adv = build_forest(5, 500, trees=3, roots=3, branches=0, context_leaf=False)
    a, b = tree_units(forest, adv, prefix_weight=0.0), tree_units(forest, adv, prefix_weight=1.0)
    assert a.weighted_tokens == b.weighted_tokens == a.policy_tokens
    assert all(np.array_equal(u.weight, np.ones(u.loss_tokens, np.float32)) for u in b.units)
    branched, adv = build_forest(5, 500, trees=3, roots=3, branches=4)
    half = tree_units(branched, adv, prefix_weight=0.5)
    w = node_weights(branched, 0.5)
    assert half.weighted_tokens == pytest.approx(sum(w[n] * np.count_nonzero(branched.payload[n].mask)
                                                     for n in range(len(branched)) if branched.parent[n] >= 0))
    assert half.weighted_tokens > half.policy_tokens
    with pytest.raises(ValueError, match="prefix_weight must be in"):
        node_weights(branched, 2.0)
    with pytest.raises(ValueError, match="token-mean"):
        LossSection(prefix_weight=0.5, aggregation="seq-mean-token-mean")
