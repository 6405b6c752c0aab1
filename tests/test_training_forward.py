"""The training forward's speed features keep today's numbers: micro-batches sized by tokens partition the rows
exactly; decoder layers compiled by Inductor and LM-head chunks give the eager, row-micro-batched update's loss
statistics and weights (within float rounding)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mt_env.batch import TrainBatch, micro_batches
from trainers.modeling import PolicyModel, build_causal_lm, compile_layers

from .backend_hf_fixtures import layer_compiler_fixture  # noqa: F401  (the `layer_compiler` fixture)

DEVICE = torch.device(os.environ.get("MT_ENV_TEST_DEVICE", "cpu"))
TINY = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def _batch(lengths: list[int], vocab: int = 100, seed: int = 0) -> TrainBatch:
    """Right-padded rows of these lengths: random ids, the second half of each row sampled, advantages random."""
    g = torch.Generator().manual_seed(seed)
    B, L = len(lengths), max(lengths)
    attn = (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]).long()
    loss_mask = ((torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None] // 2) & (attn > 0)).float()
    zeros = torch.zeros(B, L)
    return TrainBatch(
        input_ids=torch.randint(0, vocab, (B, L), generator=g) * attn, attention_mask=attn,
        position_ids=(attn.cumsum(-1) - 1).clamp(min=0), loss_mask=loss_mask, rewards=zeros, rollout_logprobs=zeros,
        turn_ids=torch.zeros(B, L, dtype=torch.long), group=torch.arange(B), episode=torch.arange(B),
        episode_rewards=torch.zeros(B), old_logprobs=torch.full((B, L), -4.0) * loss_mask,
        ref_logprobs=torch.full((B, L), -4.5) * loss_mask, advantages=torch.randn(B, L, generator=g) * loss_mask)


@settings(max_examples=200)
@given(lengths=st.lists(st.integers(1, 40), min_size=0, max_size=20), budget=st.integers(1, 120),
       packed=st.booleans(), order_seed=st.integers(0, 1000))
def test_micro_batches_by_tokens_partition_the_rows_within_the_budget(lengths, budget, packed, order_seed):
    if not lengths:
        lengths = [1]
    batch = _batch(lengths)
    rows = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(order_seed))
    parts = micro_batches(batch, rows, max_rows=4, max_tokens=budget, packed=packed)
    assert torch.equal(torch.cat(parts), rows)  # every row once, in order

    def cost(part):
        n = [lengths[r] for r in part.tolist()]
        return sum(n) if packed else len(n) * max(n)

    for k, part in enumerate(parts):
        assert len(part) >= 1
        assert cost(part) <= budget or len(part) == 1  # within the budget, or one row longer than it
        if k + 1 < len(parts):  # full: the next row would not have fitted
            assert cost(torch.cat([part, parts[k + 1][:1]])) > budget
    assert [len(p) for p in micro_batches(batch, rows, max_rows=4)] == [len(p) for p in rows.split(4)]


def test_compiled_layers_give_the_eager_logprobs_and_gradients(layer_compiler):
    """`compile_layers`: the policy's logprobs, entropy and gradients are the eager module's (padded rows here;
    packed rows in the next test); a deep copy made afterwards runs its own weights."""
    eager = build_causal_lm(config=TINY, vocab_size=100)
    fast = copy.deepcopy(eager)
    compile_layers(fast)
    batch = _batch([12, 7, 9, 3])
    results = []
    for lm in (eager, fast):
        policy = PolicyModel(lm, logprob_chunk_tokens=5)
        lp, ent = policy(batch.input_ids, batch.loss_mask, attention_mask=batch.attention_mask,
                         position_ids=batch.position_ids, temperature=0.8, with_entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), [p.grad for p in lm.parameters()]))
    (lp, ent, grads), (lp_c, ent_c, grads_c) = results
    assert layer_compiler.failure is None, layer_compiler.failure
    torch.testing.assert_close(lp_c, lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_c, ent, atol=1e-5, rtol=1e-5)
    for g_c, g in zip(grads_c, grads):
        torch.testing.assert_close(g_c, g, atol=1e-5, rtol=1e-4)
    copied = copy.deepcopy(fast)
    with torch.no_grad():
        copied.model.layers[0].mlp.down_proj.weight.zero_()
        ids = batch.input_ids[:1]
        assert not torch.allclose(copied(ids).logits, fast(ids).logits)


def test_compiled_layers_under_activation_checkpointing_compile_and_give_the_eager_gradients(layer_compiler):
    """Under transformers' activation checkpointing the layers still run compiled, in one graph without a break
    (transformers checkpoints inside the layer's ``forward``; traced, that checkpoint refused the `kernels` package's
    hook in the attention, and the layers ran eagerly), and give the eager checkpointed module's numbers."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # (a graph compiled by an earlier test would serve: none would be counted)
    eager = build_causal_lm(config=TINY, vocab_size=100).train()
    fast = copy.deepcopy(eager)
    compile_layers(fast)
    batch = _batch([12, 7, 9, 3])
    results = []
    for lm in (eager, fast):
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        lp, _ = PolicyModel(lm)(batch.input_ids, batch.loss_mask, attention_mask=batch.attention_mask,
                                position_ids=batch.position_ids)
        lp.sum().backward()
        results.append((lp.detach(), [p.grad for p in lm.parameters()]))
    assert layer_compiler.failure is None, layer_compiler.failure
    assert counters["stats"]["unique_graphs"] > graphs and sum(counters["graph_break"].values()) == breaks, \
        dict(counters["graph_break"])
    (lp, grads), (lp_c, grads_c) = results
    torch.testing.assert_close(lp_c, lp, atol=1e-5, rtol=1e-5)
    for g_c, g in zip(grads_c, grads):
        torch.testing.assert_close(g_c, g, atol=1e-5, rtol=1e-4)


def test_the_compiled_forward_is_the_layer_classs_own_under_any_number_of_checkpointing_wrappers():
    """`_own_forward` unwraps transformers' checkpointing wrapper, also where a subclass (FSDP2's ``FSDP<Layer>``)
    wraps the wrapper again, and leaves a forward without one as it is."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP

    from trainers.modeling import _own_forward

    class Wrapped(LlamaDecoderLayer):  # as FSDP2 subclasses a layer: transformers wraps its forward once more
        pass

    own, checkpoints = _own_forward(LlamaDecoderLayer)
    assert checkpoints == (LlamaDecoderLayer.forward is not own)
    assert _own_forward(Wrapped) == (own, checkpoints)
    assert _own_forward(LlamaMLP) == (LlamaMLP.forward, False)


def test_the_new_update_path_equals_todays(layer_compiler):
    """`trainers.ppo.update` as today (micro-batches of rows, the LM head over all scored tokens at once, eager
    layers) and with micro-batches by tokens, LM-head chunks and compiled layers: the same loss terms and the same
    weights after the optimizer step."""
    from accelerate import Accelerator

    from trainers.config import load_config
    from trainers.ppo import Models, update

    batch = _batch([30, 12, 25, 8, 17, 22, 5, 28], vocab=90)
    accelerator = Accelerator(cpu=True)
    base = build_causal_lm(config=TINY, vocab_size=100)
    outcomes = []
    for new in (False, True):
        lm = copy.deepcopy(base)
        if new:
            compile_layers(lm)
        policy = PolicyModel(lm, vocab_limit=90, logprob_chunk_tokens=16 if new else None)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        cfg = load_config("quickstart.yaml", [
            "trainer.minibatch_size=8", "trainer.micro_batch_size=3", "trainer.packed=true",
            f"trainer.micro_batch_tokens={60 if new else 'null'}", "algorithm.kl_mode=loss", "algorithm.kl_coef=0.1",
            "algorithm.entropy_coef=0.01", "rollout.temperature=0.9"])
        stats, _ = update(batch, Models(policy, optimizer, scheduler=None), accelerator, cfg, step=1)
        outcomes.append((stats, [p.detach().clone() for p in lm.parameters()]))
    (stats, weights), (stats_new, weights_new) = outcomes
    for key in ("actor/loss", "actor/entropy", "actor/kl_ref", "actor/grad_norm"):
        assert stats_new[key] == pytest.approx(stats[key], rel=1e-4, abs=1e-6), key
    for w_new, w in zip(weights_new, weights):
        torch.testing.assert_close(w_new, w, atol=1e-5, rtol=1e-4)
