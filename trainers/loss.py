"""The policy loss: PPO-clip with clip-higher, loss aggregation, k3 KL, truncated IS.

Small pure functions in the style of verl's ``core_algos.py``: every input is a
``[batch, time]`` tensor, ``mask`` is 1 on policy tokens (the tokens the policy generated)
and 0 on prompt, observation, template and padding tokens, so only policy tokens carry a
gradient. Aggregation modes are registered by name in :data:`AGGREGATIONS`.

Conventions (those of TRL's GRPOTrainer and DAPO):

* ``ratio = exp(logp - old_logp)``; the per-token loss is
  ``max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))``. ``eps_high > eps_low``
  is DAPO's clip-higher.
* ``kl = exp(ref - logp) - (ref - logp) - 1`` (Schulman's k3 estimator, non-negative,
  unbiased for KL(pi || ref)), added as ``kl_coef * kl`` per token.
* When the behaviour log-probs come from another engine (vLLM, a server) the trainer's own
  log-probs under the rollout weights (``old_logp``) differ from them; each token's loss is
  then weighted by ``min(exp(old_logp - behaviour_logp), is_cap)`` (truncated importance
  sampling), a constant that carries no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Aggregation = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
AGGREGATIONS: dict[str, Aggregation] = {}


def register_aggregation(name: str) -> Callable[[Aggregation], Aggregation]:
    """Register a loss aggregation ``fn(per_token_loss, mask, normaliser) -> scalar``."""

    def add(fn: Aggregation) -> Aggregation:
        AGGREGATIONS[name] = fn
        return fn

    return add


@register_aggregation("token-mean")
def token_mean(loss: torch.Tensor, mask: torch.Tensor, normaliser: float) -> torch.Tensor:
    """Sum over all policy tokens divided by ``normaliser``: the number of policy tokens in
    the *global* batch (all micro-batches of one optimizer step), so that gradient
    accumulation gives the same gradient as one big batch (DAPO's token-level loss)."""
    return (loss * mask).sum() / max(float(normaliser), 1.0)


@register_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, normaliser: float) -> torch.Tensor:
    """Mean over each sequence's policy tokens, then sum over sequences divided by
    ``normaliser``: the number of sequences (with at least one policy token) in the global
    batch (GRPO's original per-sequence aggregation)."""
    per_seq_tokens = mask.sum(dim=-1)
    per_seq = (loss * mask).sum(dim=-1) / per_seq_tokens.clamp(min=1.0)
    return per_seq[per_seq_tokens > 0].sum() / max(float(normaliser), 1.0)


@register_aggregation("seq-mean-token-sum")
def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, normaliser: float) -> torch.Tensor:
    """Sum over each sequence's policy tokens, then sum over sequences divided by
    ``normaliser`` (the number of sequences): Dr. GRPO's length-unbiased form when the
    caller also divides by a constant maximum length."""
    return (loss * mask).sum() / max(float(normaliser), 1.0)


def batch_normaliser(mask: torch.Tensor, aggregation: str) -> float:
    """The normaliser :func:`policy_loss` needs for ``aggregation`` over the rows of ``mask``
    (sum it over micro-batches to get the global one)."""
    if aggregation == "token-mean":
        return float(mask.sum())
    if aggregation in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return float((mask.sum(dim=-1) > 0).sum())
    raise KeyError(f"unknown loss aggregation {aggregation!r} (known: {', '.join(sorted(AGGREGATIONS))})")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of ``targets`` under ``logits / temperature`` (``[B, T, V]`` and
    ``[B, T]`` -> ``[B, T]``). Sampling at temperature T draws from that distribution, so
    the ratio must be taken under it too."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.gather(torch.log_softmax(logits, dim=-1), -1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-token entropy of the sampling distribution (``[B, T, V]`` -> ``[B, T]``)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): ``exp(ref - logp) - (ref - logp) - 1``."""
    d = (ref_logp - logp).clamp(-20.0, 20.0)  # keeps exp finite on tokens the reference finds absurd
    return torch.exp(d) - d - 1.0


def truncated_is_weight(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """``min(exp(old_logp - behaviour_logp), cap)``, detached: the truncated importance weight
    that corrects for rollouts sampled by another engine than the trainer."""
    return torch.exp((old_logp - behaviour_logp).clamp(max=20.0)).clamp(max=cap).detach()


@dataclass
class LossOutput:
    """The scalar loss of one micro-batch and the statistics it logs (sums over policy
    tokens, so micro-batches add up; divide by ``tokens`` for means)."""

    loss: torch.Tensor
    tokens: float
    clip_low: float  # tokens clipped at 1 - eps_low with A < 0
    clip_high: float  # tokens clipped at 1 + eps_high with A > 0
    kl: float
    ratio: float
    is_weight: float


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    aggregation: str = "token-mean",
    normaliser: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    behaviour_logp: torch.Tensor | None = None,
    is_cap: float = 2.0,
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """PPO-clip loss with clip-higher on policy tokens only.

    Args:
        logp: log-probs of the taken tokens under the current parameters (with gradient).
        old_logp: log-probs under the parameters that produced the rollouts (no gradient).
        advantages: per-token advantages (a sequence-level advantage broadcast over its tokens).
        mask: 1.0 on policy tokens, 0.0 elsewhere; other tokens get exactly zero gradient.
        eps_low, eps_high: the clip range ``[1 - eps_low, 1 + eps_high]``.
        aggregation: a name in :data:`AGGREGATIONS`.
        normaliser: the global normaliser (see :func:`batch_normaliser`); this micro-batch's own
            when None.
        ref_logp: reference-model log-probs for the k3 KL penalty (used when ``kl_coef > 0``).
        behaviour_logp: the rollout engine's log-probs, when it is not the trainer itself;
            enables the truncated importance weight against ``old_logp``.
        is_cap: the truncation of that weight.
        weights: per-token weights of the whole per-token loss (policy term, KL and IS
            weight alike; trainers/batching.py's prefix weight), 1 when None. The statistics
            stay token counts; a weighted token-mean needs the weighted normaliser.
    """
    if aggregation not in AGGREGATIONS:
        raise KeyError(f"unknown loss aggregation {aggregation!r} (known: {', '.join(sorted(AGGREGATIONS))})")
    mask = mask.to(logp.dtype)
    on = mask > 0
    # Masked positions may hold anything (padding, NaN): replace every input there by a value
    # with a finite gradient, since where() alone still lets 0 * NaN through in backward.
    safe = logp.detach()
    old_logp = torch.where(on, old_logp.detach().to(logp.dtype), safe)
    adv = torch.where(on, advantages.detach().to(logp.dtype), torch.zeros_like(safe))
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    is_w = None
    if behaviour_logp is not None:
        behaviour = torch.where(on, behaviour_logp.detach().to(logp.dtype), old_logp)
        is_w = truncated_is_weight(old_logp, behaviour, is_cap) * mask
        per_token = per_token * is_w
    kl_sum = 0.0
    if ref_logp is not None and kl_coef > 0.0:
        ref = torch.where(on, ref_logp.detach().to(logp.dtype), safe)
        kl = k3_kl(logp, ref) * mask
        per_token = per_token + kl_coef * kl
        kl_sum = float(kl.sum().detach())
    per_token = per_token * mask
    if weights is not None:
        per_token = per_token * torch.where(on, weights.detach().to(logp.dtype), torch.zeros_like(safe))
    norm = batch_normaliser(mask, aggregation) if normaliser is None else normaliser
    loss = AGGREGATIONS[aggregation](per_token, mask, norm)
    with torch.no_grad():
        low = ((ratio < 1.0 - eps_low) & (adv < 0) & on).sum()
        high = ((ratio > 1.0 + eps_high) & (adv > 0) & on).sum()
    return LossOutput(
        loss=loss,
        tokens=float(mask.sum()),
        clip_low=float(low),
        clip_high=float(high),
        kl=kl_sum,
        ratio=float((ratio.detach() * mask).sum()),
        is_weight=float((is_w * mask).sum()) if is_w is not None else float(mask.sum()),
    )

