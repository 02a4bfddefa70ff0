"""The policy loss against hand-computed values, and policy-token-only gradients."""

import math

import pytest
import torch

from trace_gym.trainers.loss import batch_normaliser, k3_kl, policy_loss, token_logprobs

# Two sequences of three tokens, old log-probs 0 so that ratio = exp(logp).
# Sequence 0: advantage +1, mask [1, 1, 0] (its last token is an observation).
# Sequence 1: advantage -2, mask [1, 1, 1].
RATIOS = [[1.5, 0.9, 7.0], [0.5, 1.1, 1.0]]
ADV = [[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]
MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]


def _batch():
    logp = torch.tensor(RATIOS, dtype=torch.float64).log().requires_grad_(True)
    return logp, torch.zeros(2, 3, dtype=torch.float64), torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK, dtype=torch.float64)


def test_ppo_clip_higher_token_mean_matches_hand_computation():
    logp, old, adv, mask = _batch()
    out = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, aggregation="token-mean")
    # per token max(-A r, -A clip(r, 0.8, 1.28)):
    #   seq 0: r=1.5 -> max(-1.5, -1.28) = -1.28 (clipped high); r=0.9 -> -0.9
    #   seq 1: r=0.5 -> max(1.0, 1.6) = 1.6 (clipped low); r=1.1 -> 2.2; r=1.0 -> 2.0
    #   token mean over the 5 policy tokens: (-1.28 - 0.9 + 1.6 + 2.2 + 2.0) / 5 = 0.724
    assert out.loss.item() == pytest.approx(0.724, abs=1e-12)
    assert (out.tokens, out.clip_low, out.clip_high) == (5.0, 1.0, 1.0)
    out.loss.backward()
    # d/dlogp of -A r is -A r; clipped tokens and the observation token get 0.
    expected = torch.tensor([[0.0, -0.9 / 5, 0.0], [0.0, 2.2 / 5, 2.0 / 5]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-12)


def test_per_sequence_aggregation_matches_hand_computation():
    logp, old, adv, mask = _batch()
    out = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, aggregation="seq-mean-token-mean")
    # seq 0: (-1.28 - 0.9) / 2 = -1.09; seq 1: (1.6 + 2.2 + 2.0) / 3 = 1.9333...; mean of the two
    assert out.loss.item() == pytest.approx((-1.09 + 5.8 / 3) / 2, abs=1e-12)


def test_k3_kl_and_truncated_importance_weight():
    logp, old, adv, mask = _batch()
    ref = logp.detach() + math.log(2.0)  # k3 with d = log 2: 2 - log 2 - 1
    kl_tok = 1.0 - math.log(2.0)
    assert k3_kl(torch.zeros(1), torch.full((1,), math.log(2.0))).item() == pytest.approx(kl_tok)
    out = policy_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.5)
    assert out.loss.item() == pytest.approx(0.724 + 0.5 * kl_tok, abs=1e-12)
    assert out.kl == pytest.approx(5 * kl_tok)
    # Behaviour log-probs log 3 below the trainer's: weight min(3, cap=2) = 2 on every token.
    out = policy_loss(logp, old, adv, mask, behaviour_logp=old - math.log(3.0), is_cap=2.0)
    assert out.loss.item() == pytest.approx(2 * 0.724, abs=1e-12)
    assert out.is_weight == pytest.approx(10.0)


def test_global_normaliser_makes_accumulation_equal_one_batch():
    logp, old, adv, mask = _batch()
    full = policy_loss(logp, old, adv, mask).loss
    norm = batch_normaliser(mask, "token-mean")
    parts = sum(policy_loss(logp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], normaliser=norm).loss for i in range(2))
    assert parts.item() == pytest.approx(full.item(), abs=1e-12)
    for agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        full = policy_loss(logp, old, adv, mask, aggregation=agg).loss
        norm = batch_normaliser(mask, agg)
        parts = sum(policy_loss(logp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], aggregation=agg, normaliser=norm).loss for i in range(2))
        assert parts.item() == pytest.approx(full.item(), abs=1e-12)


def test_unknown_aggregation_is_named():
    logp, old, adv, mask = _batch()
    with pytest.raises(KeyError, match="token-mean"):
        policy_loss(logp, old, adv, mask, aggregation="tokenmean")


def test_observation_tokens_receive_no_gradient_through_a_real_transformer():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    model = transformers.Qwen3ForCausalLM(cfg).double()
    ids = torch.randint(0, 64, (2, 12))
    # prompt (0) | policy turn (1) | observation (0) | policy turn (1) | padding (0)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1]], dtype=torch.float64)
    adv = torch.tensor([[0.7], [-1.3]], dtype=torch.float64).expand(2, 12)

    def grads(old_fill: float, adv_fill: float):
        model.zero_grad()
        logits = model(ids).logits[:, :-1]
        logits.retain_grad()
        logp = token_logprobs(logits, ids[:, 1:])
        m = mask[:, 1:]
        # Garbage behaviour values on non-policy tokens must change nothing.
        old = torch.where(m > 0, logp.detach() - 0.1, torch.full_like(logp, old_fill))
        a = torch.where(m > 0, adv[:, 1:], torch.full_like(logp, adv_fill))
        out = policy_loss(logp, old, a, m, ref_logp=torch.where(m > 0, logp.detach(), torch.full_like(logp, old_fill)), kl_coef=0.1)
        out.loss.backward()
        return out.loss.detach(), logits.grad.clone(), [p.grad.clone() for p in model.parameters()]

    loss_a, glog_a, gpar_a = grads(0.0, 0.0)
    loss_b, glog_b, gpar_b = grads(float("nan"), 1e6)
    assert torch.isfinite(loss_b)
    assert loss_a.item() == pytest.approx(loss_b.item(), abs=1e-12)
    off = mask[:, 1:] == 0
    assert torch.all(glog_a[off] == 0) and torch.all(glog_b[off] == 0)  # exactly zero on observation/prompt/pad
    assert torch.all(glog_a[~off].abs().sum(-1) > 0)  # every policy token does get a gradient
    for ga, gb in zip(gpar_a, gpar_b):
        torch.testing.assert_close(ga, gb, rtol=0, atol=1e-12)
