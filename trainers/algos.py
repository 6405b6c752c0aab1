"""The RL arithmetic of `ppo.py`, as pure functions on tensors: advantages, losses, KL estimators, aggregation.

Conventions: tensors are ``[B, T]``, aligned with the batch's ``input_ids``; ``loss_mask`` is the batch's loss mask,
under the same name (1.0 on sampled tokens, 0.0 on prompt, observation, template and padding tokens). Every reduction
is masked: no statistic, loss or gradient ever sees a tool or template token.
"""

from __future__ import annotations

import logging
import typing

import torch

from .config import KLEstimator, LossAgg

#: the choices, declared once as the config's `Literal` types
LOSS_AGG_MODES = typing.get_args(LossAgg)
KL_ESTIMATORS = typing.get_args(KLEstimator)
LOG = logging.getLogger("trainers")


# --------------------------------------------------------------------------------------------- masked statistics
def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of masked-in entries. Uses `where`, not a product, so inf/NaN at masked-out positions cannot leak."""
    kept = torch.where(mask > 0, x, torch.zeros_like(x))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean over masked-in entries; 0 (not NaN) when the mask is empty."""
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Normalize masked-in entries to mean 0 / std 1 (unbiased); masked-out entries become 0."""
    n = mask.sum()
    if n < 2:
        return torch.zeros_like(x)
    mean = masked_sum(x, mask) / n
    var = masked_sum((x - mean) ** 2, mask) / (n - 1)
    return torch.where(mask > 0, (x - mean) * torch.rsqrt(var + eps), torch.zeros_like(x))


# --------------------------------------------------------------------------------------------- advantages
@torch.no_grad()
def masked_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    turn_ids: torch.Tensor | None = None,
    turn_gamma: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over sampled tokens only: positions with ``loss_mask == 0`` (observations, templates, padding) are skipped,
    as if they were not in the sequence — the next sampled token's value bootstraps across them.

    Rewards must sit on sampled tokens (mt_env puts each turn's reward on its last sampled token). With
    ``turn_gamma`` set, the discount between two consecutive sampled tokens is ``gamma`` inside a turn and
    ``turn_gamma`` across a turn boundary (``turn_ids`` tell turns apart): turn-level discounting, e.g. ``gamma=1``
    and ``turn_gamma=0.95`` discounts per tool round-trip rather than per token. Returns (advantages, returns).
    """
    B, T = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_gae = torch.zeros_like(next_value)
    next_turn = torch.full((B,), -1, dtype=torch.long, device=rewards.device)
    for t in reversed(range(T)):
        m = loss_mask[:, t] > 0
        if turn_ids is not None and turn_gamma is not None:
            crossing = (next_turn >= 0) & (turn_ids[:, t] != next_turn)
            g = torch.where(crossing, torch.full_like(next_value, turn_gamma), torch.full_like(next_value, gamma))
        else:
            g = torch.full_like(next_value, gamma)
        delta = rewards[:, t] + g * next_value - values[:, t]
        gae = delta + g * lam * next_gae
        advantages[:, t] = torch.where(m, gae, torch.zeros_like(gae))
        next_value = torch.where(m, values[:, t], next_value)
        next_gae = torch.where(m, gae, next_gae)
        if turn_ids is not None:
            next_turn = torch.where(m, turn_ids[:, t], next_turn)
    returns = torch.where(loss_mask > 0, advantages + values, torch.zeros_like(values))
    return advantages, returns


@torch.no_grad()
def grpo_advantages(
    scores: torch.Tensor, groups: list, episodes: list, normalize_std: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, dict]:
    """Group-normalised outcome advantages, one per sample: ``(score - group mean) / (group std + eps)``.

    Statistics are over distinct episodes (an episode split into per-turn samples counts once). A group whose scores
    are all equal (or of size 1) gets advantage 0: no signal, and no NaN. Returns (advantages [B], stats).
    """
    by_group: dict = {}
    for g, ep, s in zip(groups, episodes, scores.tolist()):
        by_group.setdefault(g, {})[ep] = s
    mean, std = {}, {}
    for g, eps_scores in by_group.items():
        vals = torch.tensor(list(eps_scores.values()), dtype=torch.float64)
        mean[g] = vals.mean().item()
        std[g] = vals.std(unbiased=True).item() if len(vals) > 1 else 0.0
    adv = []
    for g, s in zip(groups, scores.tolist()):
        a = s - mean[g]
        if normalize_std:
            a = a / (std[g] + eps) if std[g] > 0 else 0.0
        adv.append(a)
    zero_var = sum(1 for g in by_group if std[g] == 0.0)
    stats = {"grpo/groups": len(by_group), "grpo/zero_variance_groups": zero_var}
    return torch.tensor(adv, dtype=torch.float32, device=scores.device), stats


# --------------------------------------------------------------------------------------------- losses
def aggregate(loss: torch.Tensor, loss_mask: torch.Tensor, mode: str, norm_tokens: float | None = None,
              norm_seqs: float | None = None, constant: float | None = None) -> torch.Tensor:
    """Reduce a ``[B, T]`` loss to a scalar over masked-in tokens.

    * ``token-mean``: every sampled token weighs the same (sum / number of tokens).
    * ``seq-mean-token-sum``: per-sequence sums, averaged over sequences.
    * ``seq-mean-token-mean``: per-sequence means, averaged over sequences (the original GRPO).
    * ``seq-mean-token-sum-norm``: the sum divided by a fixed constant (Dr. GRPO: no length bias).

    With gradient accumulation pass the normalizers of the whole mini-batch (`norm_tokens`: its number of sampled
    tokens; `norm_seqs`: its number of sequences) so micro-batches add up to the mini-batch loss exactly.
    """
    if mode == "token-mean":
        tokens = norm_tokens if norm_tokens is not None else loss_mask.sum()
        return masked_sum(loss, loss_mask) / max(float(tokens), 1.0)
    seq_has = (loss_mask.sum(-1) > 0).float()
    n_seqs = max(float(norm_seqs if norm_seqs is not None else seq_has.sum()), 1.0)
    if mode == "seq-mean-token-sum":
        return masked_sum(loss, loss_mask, -1).sum() / n_seqs
    if mode == "seq-mean-token-mean":
        return (masked_sum(loss, loss_mask, -1) / loss_mask.sum(-1).clamp(min=1)).sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        if not constant:
            raise ValueError("seq-mean-token-sum-norm needs a constant (e.g. the max response length)")
        return masked_sum(loss, loss_mask) / (constant * n_seqs)
    raise ValueError(f"unknown loss aggregation {mode!r}; choose from {LOSS_AGG_MODES}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    **norms,
) -> tuple[torch.Tensor, dict]:
    """Clipped PPO surrogate (with asymmetric clip range and dual-clip), masked and aggregated.

    Dual-clip bounds the loss of negative-advantage tokens whose ratio exploded: ``min(max(l1, l2), -A * c)``.
    `is_weights` (truncated importance-sampling weights for rollout/trainer mismatch) multiply the per-token loss.
    Inputs at masked-out positions are neutralised first, so a NaN there cannot reach the gradient. The statistics
    are 0-d tensors, left on the device: the caller reads them once per update, not once per micro-batch.
    """
    on = loss_mask > 0
    advantages = torch.where(on, advantages, torch.zeros_like(advantages))
    old_logprobs = torch.where(on, old_logprobs, logprobs.detach())
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    l1 = -advantages * ratio
    l2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(l1, l2)
    clipped = (l2 > l1).float()
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        capped = torch.minimum(loss, -advantages * dual_clip)
        loss = torch.where(advantages < 0, capped, loss)
    if is_weights is not None:
        loss = loss * is_weights
    with torch.no_grad():
        stats = {
            "actor/clip_frac": masked_mean(clipped, loss_mask),
            "actor/approx_kl": masked_mean(0.5 * log_ratio**2, loss_mask),
            "actor/ratio_mean": masked_mean(ratio, loss_mask),
        }
    return aggregate(loss, loss_mask, agg, **norms), stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor,
               clip: float | None = 0.2, agg: str = "token-mean", **norms) -> tuple[torch.Tensor, dict]:
    """Clipped value loss 0.5 * max((V - R)^2, (clip(V) - R)^2), masked; its statistics as `policy_loss`'s."""
    on = loss_mask > 0
    returns = torch.where(on, returns, values.detach())
    old_values = torch.where(on, old_values, values.detach())
    err = (values - returns) ** 2
    if clip is not None:
        v_clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (v_clipped - returns) ** 2)
    with torch.no_grad():
        stats = {"critic/value_mean": masked_mean(values, loss_mask),
                 "critic/error": masked_mean((values - returns) ** 2, loss_mask)}
    return 0.5 * aggregate(err, loss_mask, agg, **norms), stats


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens' logprobs.

    ``k1``: log ratio (unbiased, high variance, can be negative); ``k2``: 0.5 * log ratio² ; ``k3`` / ``low_var_kl``:
    ``exp(-d) + d - 1`` with ``d = logp - ref`` (unbiased, non-negative, low variance; clamped to [-10, 10] as verl).
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator in ("k3", "low_var_kl"):
        return (torch.exp(-d) + d - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; choose from {KL_ESTIMATORS}")


def truncated_is_weights(logprobs_trainer: torch.Tensor, logprobs_rollout: torch.Tensor, cap: float = 2.0):
    """Truncated importance-sampling weights min(π_trainer / π_rollout, cap) for engines whose numerics differ."""
    return torch.exp((logprobs_trainer - logprobs_rollout).clamp(max=20.0)).clamp(max=cap).detach()


# --------------------------------------------------------------------------------------------- rollout/trainer mismatch
def logprob_mismatch(batch, exact: bool = False) -> dict:
    """How far the engine's logprobs of the sampled tokens are from the trainer's recomputation (`batch`: a
    `mt_env.batch.TrainBatch` with ``old_logprobs``). In exact mode (`exact`) they must be equal:
    ``mismatch/exact_violations`` counts the tokens that are not, and any is logged as a bug (a warning on the
    ``trainers`` logger)."""
    on = batch.loss_mask > 0
    if not on.any():
        return {}
    diff = (batch.old_logprobs - batch.rollout_logprobs)[on].float()
    out = {"mismatch/exact_violations": float((diff != 0).sum())} if exact else {}
    diff = diff[torch.isfinite(diff)]
    ratio = torch.exp(diff.clamp(-20, 20))
    out.update({"mismatch/logprob_abs_max": diff.abs().max().item(),
                "mismatch/logprob_abs_mean": diff.abs().mean().item(), "mismatch/ratio_mean": ratio.mean().item(),
                "mismatch/ratio_max": ratio.max().item(), "mismatch/ratio_min": ratio.min().item()})
    if exact and out["mismatch/exact_violations"]:
        LOG.warning("EXACT MODE VIOLATED: %d of %d sampled tokens' rollout logprobs differ from the trainer's (max "
                    "|diff| %.3g); rollout.exact_logprobs promises bit equality: this is a bug (docs/exact.md)",
                    out["mismatch/exact_violations"], int(on.sum()), out["mismatch/logprob_abs_max"])
    return out
