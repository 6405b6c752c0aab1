"""The trainer's arithmetic: masked GAE, GRPO, losses, KL, aggregation, numerics guards, gradients, packing."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainers.algos import (aggregate, grpo_advantages, kl_estimate, masked_gae, masked_mean, policy_loss,
                            value_loss)
from trainers.modeling import CriticModel, PolicyModel, build_causal_lm, packed_attention_mask

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)


def plain_gae(rewards, values, gamma, lam):
    adv, last, next_v = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t], next_v = last, values[t]
    return adv


@given(
    seq=st.lists(st.tuples(st.booleans(), st.floats(-2, 2), st.floats(-2, 2)), min_size=1, max_size=30),
    gamma=st.floats(0.5, 1.0), lam=st.floats(0.5, 1.0),
)
def test_gae_on_masked_sequence_equals_gae_with_observations_removed(seq, gamma, lam):
    mask = torch.tensor([[float(m) for m, _, _ in seq]])
    rewards = torch.tensor([[r if m else 0.0 for m, r, _ in seq]])
    values = torch.tensor([[v for _, _, v in seq]])
    adv, ret = masked_gae(rewards, values, mask, gamma, lam)
    kept = [i for i, (m, _, _) in enumerate(seq) if m]
    expected = plain_gae([rewards[0, i].item() for i in kept], [values[0, i].item() for i in kept], gamma, lam)
    assert torch.allclose(adv[0, kept], torch.tensor(expected), atol=1e-5)
    assert bool((adv[mask == 0] == 0).all()) and bool((ret[mask == 0] == 0).all())


def test_turn_level_discounting():
    # turn 0: tokens 0,1 ; observation token 2 ; turn 1: tokens 3,4. Reward 1 at the end, values 0.
    mask = torch.tensor([[1.0, 1, 0, 1, 1]])
    turns = torch.tensor([[0, 0, 0, 1, 1]])
    rewards = torch.tensor([[0.0, 0, 0, 0, 1]])
    adv, _ = masked_gae(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0, turn_ids=turns, turn_gamma=0.5)
    assert adv[0].tolist() == [0.5, 0.5, 0.0, 1.0, 1.0]  # discounted once per turn boundary, not per token


def test_grpo_group_normalisation_and_zero_variance():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.7])
    groups = [0, 0, 0, 0, 1, 1, 2]
    adv, stats = grpo_advantages(scores, groups, episodes=list(range(7)))
    g0 = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert torch.allclose(adv[:4], (g0 - g0.mean()) / (g0.std() + 1e-6), atol=1e-5)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0]  # all-equal group and a singleton: no signal, no NaN
    assert stats["grpo/zero_variance_groups"] == 2
    # per-turn samples of one episode count once in the statistics
    adv2, _ = grpo_advantages(torch.tensor([1.0, 1.0, 0.0]), [0, 0, 0], episodes=["a", "a", "b"])
    assert adv2[0] == adv2[1] and adv2[0] > 0 > adv2[2]


def test_aggregation_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", constant=5).item() == pytest.approx(10 / (5 * 2))
    # micro-batches with the mini-batch normalizer add up to the mini-batch loss
    parts = [aggregate(loss[i:i + 1], mask[i:i + 1], "token-mean", norm_tokens=4) for i in range(2)]
    assert sum(parts).item() == pytest.approx(10 / 4)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(loss, mask, "mean")


def test_shard_losses_with_global_normalisers_average_to_the_global_loss():
    """What DDP does: each process normalises its shard by (global count / processes), the gradients are averaged —
    equal to the gradient of the loss of the whole mini-batch, for every aggregation mode."""
    torch.manual_seed(0)
    x = torch.randn(6, 5, requires_grad=True)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[3] = 0  # a sequence with no trainable token
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        whole = torch.autograd.grad(aggregate(x**2, mask, mode), x)[0]
        world = 2
        norms = {"norm_tokens": mask.sum() / world, "norm_seqs": (mask.sum(-1) > 0).sum() / world}
        shards = [slice(0, 4), slice(4, 6)]  # unequal shares
        grads = [torch.autograd.grad(aggregate(x[s] ** 2, mask[s], mode, **norms), x)[0] for s in shards]
        assert torch.allclose(sum(grads) / world, whole, atol=1e-6), mode


def test_dual_clip_bounds_negative_advantage_loss():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[10.0, 1.0, 0.1]]))  # ratios 10, 1, 0.1
    adv = -torch.ones(1, 3)
    mask = torch.ones(1, 3)
    plain, _ = policy_loss(new, old, adv, mask, dual_clip=None, agg="seq-mean-token-sum")
    dual, _ = policy_loss(new, old, adv, mask, dual_clip=3.0, agg="seq-mean-token-sum")
    assert plain.item() == pytest.approx(10 + 1 + 0.8)
    assert dual.item() == pytest.approx(3 + 1 + 0.8)


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = lp - ref
    assert torch.allclose(kl_estimate(lp, ref, "k1"), d)
    assert torch.allclose(kl_estimate(lp, ref, "k2"), 0.5 * d**2)
    k3 = kl_estimate(lp, ref, "low_var_kl")
    assert torch.allclose(k3, torch.exp(-d) + d - 1) and bool((k3 >= 0).all())
    assert torch.equal(kl_estimate(lp, lp, "k3"), torch.zeros(2))


@pytest.mark.parametrize("case", ["empty_mask", "inf_logprobs", "nan_outside_mask"])
def test_no_nan_reaches_the_loss(case):
    lp = torch.full((2, 4), -1.0, requires_grad=True)
    old = torch.full((2, 4), -1.0)
    adv = torch.ones(2, 4)
    mask = torch.ones(2, 4)
    if case == "empty_mask":
        mask = torch.zeros(2, 4)
    elif case == "inf_logprobs":
        old = old.clone()
        old[0, 0] = -math.inf
    else:
        adv = adv.clone()
        adv[1, 3] = math.nan
        mask[1, 3] = 0
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        loss, stats = policy_loss(lp, old, adv, mask, agg=agg)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
        assert all(math.isfinite(v) for v in stats.values())
        lp.grad = None
    v, _ = value_loss(torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4), mask)
    assert torch.isfinite(v)
    assert masked_mean(torch.ones(3), torch.zeros(3)).item() == 0.0


def _batch():
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 12))
    # prompt 0-3, sampled 4-6, observation 7-8, sampled 9-11 (row 0); row 1 similar but shorter
    loss_mask = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0]]).float()
    attention = torch.tensor([[1] * 12, [1] * 10 + [0] * 2])
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return ids, loss_mask, attention, positions


def test_tool_tokens_get_exactly_zero_gradient():
    """The gradient of the loss w.r.t. the logits that predict tool/prompt/padding tokens is exactly zero."""
    lm = build_causal_lm(config=TINY, vocab_size=100)
    ids, loss_mask, attention, positions = _batch()
    logits = lm(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    logits.retain_grad()
    lp_full = torch.zeros(ids.shape)
    lp_full[:, 1:] = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss, _ = policy_loss(lp_full, lp_full.detach() - 0.1, torch.randn(ids.shape), loss_mask)
    loss.backward()
    predicts_masked = loss_mask[:, 1:] == 0  # logits at t predict token t+1
    assert bool((logits.grad[:, :-1][predicts_masked] == 0).all())
    assert bool((logits.grad[:, -1] == 0).all())
    assert float(logits.grad[:, :-1][~predicts_masked].abs().sum()) > 0
    # and the selective PolicyModel forward gives the same logprobs at the sampled tokens
    lp_sel, ent = PolicyModel(lm)(ids, loss_mask, attention_mask=attention, position_ids=positions, with_entropy=True)
    assert torch.allclose(lp_sel[loss_mask > 0], lp_full.detach()[loss_mask > 0], atol=1e-5)
    assert bool((lp_sel[loss_mask == 0] == 0).all()) and bool((ent[loss_mask > 0] > 0).all())


DEVICE = torch.device(os.environ.get("MT_ENV_TEST_DEVICE", "cpu"))
IMPLEMENTATIONS = ("sdpa", "eager") + (("flex_attention",) if DEVICE.type == "cuda" else ())


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_packed_logprobs_equal_per_sequence_logprobs(impl):
    """Packing keeps sequences apart: block-diagonal attention gives the same logprobs as running each alone
    (on CPU; on a GPU with MT_ENV_TEST_DEVICE=cuda, flex_attention's BlockMask too)."""
    config = dict(TINY, hidden_size=64)  # head dim 16: the smallest flex_attention compiles for
    lm = build_causal_lm(config=config, vocab_size=100, attn_implementation=impl).to(DEVICE).eval()
    policy = PolicyModel(lm)
    torch.manual_seed(1)
    seqs = [torch.randint(0, 100, (n,)).to(DEVICE) for n in (7, 3, 11)]
    alone = [policy(s[None], torch.ones(1, len(s), device=DEVICE))[0][0] for s in seqs]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s), device=DEVICE) for s in seqs])[None]
    seq_ids = torch.cat([torch.full((len(s),), i, device=DEVICE) for i, s in enumerate(seqs)])[None]
    loss_mask = torch.ones_like(ids, dtype=torch.float)
    starts = [0, 7, 10]
    loss_mask[0, starts] = 0  # the first token of a sequence has nothing to be predicted from
    packed, _ = policy(ids, loss_mask, position_ids=pos, seq_ids=seq_ids)
    for s, a, start in zip(seqs, alone, starts):
        diff = (packed[0, start + 1:start + len(s)] - a[1:]).abs().max().item()
        assert diff < 1e-5, f"{impl}: packed logprobs differ from the sequence alone by {diff:.2e}"
    # with a plain (all-ones) mask the second sequence sees the first: the check above is not vacuous
    if impl != "flex_attention":
        leaky, _ = policy(ids, loss_mask, attention_mask=torch.ones_like(ids), position_ids=pos)
        assert not torch.allclose(leaky[0, 8:10], alone[1][1:], atol=1e-3)
    critic = CriticModel.from_policy(lm)
    torch.nn.init.normal_(critic.head.weight)
    v_alone = critic(seqs[1][None], torch.ones(1, 3, device=DEVICE))[0]
    v_packed = critic(ids, loss_mask, position_ids=pos, seq_ids=seq_ids)[0]
    assert torch.allclose(v_packed[8:10], v_alone[1:], atol=1e-5)


def test_packed_mask_shape_and_blocks():
    m = packed_attention_mask(torch.tensor([[0, 0, 1, 1, 1]]), torch.float32, "sdpa")
    allowed = (m[0, 0] == 0).int()
    assert allowed.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
