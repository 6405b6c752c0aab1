"""HFBackend on a tiny random-init Qwen2 model on CPU: the data types, outputs, logprobs, seeds, weight sharing and
a conversation fed by it — on both of its paths (the fast slot-cache path and transformers' forward; `engine`
fixture). Batching: tests/test_backend_hf_batching.py; failures: tests/test_backend_hf_failures.py."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from agents.backend import SamplingParams, counted
from agents.hf_backend import HFBackend, new_stats
from agents.scripted import ScriptedBackend
from mt_env.turn import ModelTurn

from .backend_hf_fixtures import (
    DEVICE,
    GREEDY,
    PROMPTS,
    VOCAB,
    engine_fixture,  # noqa: F401  (a fixture)
    greedy_by_hand,
    logprobs_by_hand,
    model_fixture,  # noqa: F401  (a fixture)
    one_cpu_thread,  # noqa: F401  (one intra-op thread for tiny matmuls)
    run,
    tiny_model,
)


# ------------------------------------------------------------------------------------------------- data types
@pytest.mark.parametrize("bad, field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(stop_token_ids=[3, -1]), "stop_token_ids"), (dict(stop_token_ids="abc"), "stop_token_ids"),
    (dict(seed=-1), "seed"), (dict(seed=1.5), "seed"),
])
def test_sampling_params_reject_invalid_values(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_sampling_params_normalize_stop_ids():
    params = SamplingParams(stop_token_ids=[5, 6])
    assert params.stop_token_ids == (5, 6)
    assert hash(params) == hash(SamplingParams(stop_token_ids=(5, 6)))
    assert params.replace(temperature=0).greedy


def test_generation_checks_its_fields():
    with pytest.raises(ValueError, match="logprobs"):
        ModelTurn([1, 2], [0.0], "stop")
    with pytest.raises(ValueError, match="finish_reason"):
        ModelTurn([1], [0.0], "eos")


# ------------------------------------------------------------------------------------------------- outputs
def test_counted_reads_what_a_block_adds_to_a_backends_counters(model):
    """`counted`: a backend's counters over one block (the trainer's ``engine/*`` metrics of a rollout); a backend
    without counters gives none."""
    async def main():
        async with HFBackend(model, fast_path=False) as backend:
            await backend.generate([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=5))  # counted before
            with counted(backend) as grown:
                await backend.generate([4, 5], SamplingParams(temperature=0, max_new_tokens=4))
            return grown

    grown = run(main())
    assert grown.keys() == new_stats().keys()
    assert grown["prefill_passes"] == 1 and grown["decode_passes"] == 3 and grown["busy_s"] > 0
    with counted(ScriptedBackend(lambda prompt: [1])) as none:
        pass
    assert none == {}


def test_length_is_respected_exactly(model, engine):
    async def main():
        async with HFBackend(model, **engine) as backend:
            return await backend.generate([1, 2, 3], SamplingParams(max_new_tokens=7, seed=0))

    g = run(main())
    assert len(g.ids) == len(g.logprobs) == 7
    assert g.finish_reason == "length"
    assert all(lp <= 0 for lp in g.logprobs)
    assert g.meta["completion_tokens"] == 7 and g.meta["prompt_tokens"] == 3


def test_stop_token_is_included_and_ends_generation(model, engine):
    reference = greedy_by_hand(model, [1, 2, 3, 4], 12)
    k = next(i for i in range(2, 12) if reference[i] not in reference[:i])  # a stop token first sampled at step k
    stop = reference[k]

    async def main():
        async with HFBackend(model, **engine) as backend:
            return await backend.generate([1, 2, 3, 4], GREEDY.replace(stop_token_ids=(stop, VOCAB - 1)))

    g = run(main())
    assert g.ids == reference[:k + 1]
    assert g.ids[-1] == stop and g.finish_reason == "stop"
    assert len(g.logprobs) == len(g.ids)


def test_greedy_equals_argmax_without_cache_for_concurrent_prompts(model, engine):
    async def main():
        async with HFBackend(model, **engine) as backend:
            return await asyncio.gather(*(backend.generate(p, GREEDY) for p in PROMPTS))

    for prompt, g in zip(PROMPTS, run(main())):
        assert g.ids == greedy_by_hand(model, prompt, 12)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_new_tokens=10, seed=1),
    SamplingParams(temperature=1.3, max_new_tokens=10, seed=2),
    SamplingParams(temperature=0, max_new_tokens=10),
])
def test_logprobs_equal_a_full_forward_recomputation(model, params, engine):
    async def main():
        async with HFBackend(model, **engine) as backend:
            return await asyncio.gather(*(backend.generate(p, params.replace(seed=i)) for i, p in enumerate(PROMPTS)))

    for prompt, g in zip(PROMPTS, run(main())):
        expected = logprobs_by_hand(model, prompt, g.ids, params.temperature)
        assert g.logprobs == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("truncation", [dict(top_k=1), dict(top_p=1e-6)])
def test_extreme_truncation_samples_the_argmax(model, truncation, engine):
    async def main():
        async with HFBackend(model, **engine) as backend:
            return await backend.generate(PROMPTS[1], SamplingParams(temperature=1.0, max_new_tokens=8, seed=3,
                                                                    **truncation))

    assert run(main()).ids == greedy_by_hand(model, PROMPTS[1], 8)


def test_sampling_follows_the_truncated_distribution(engine):
    peaked = tiny_model(seed=5)
    with torch.no_grad():
        peaked.lm_head.weight.mul_(40)  # a few tokens carry most of the mass
        logits = peaked(input_ids=torch.tensor([PROMPTS[0]], device=DEVICE)).logits[0, -1].float().cpu()
    top2 = logits.topk(2)
    p_first = torch.softmax(top2.values, -1)[0].item()  # probability of the argmax after top-k=2 renormalizes
    n = 400

    async def main():
        async with HFBackend(peaked, **engine) as backend:
            params = SamplingParams(temperature=1.0, top_k=2, max_new_tokens=1, seed=0)
            return await backend.generate_many([PROMPTS[0]] * n, params)

    first = [g.ids[0] for g in run(main())]
    assert set(first) <= set(top2.indices.tolist())
    freq = first.count(int(top2.indices[0])) / n
    assert abs(freq - p_first) < 4 * math.sqrt(p_first * (1 - p_first) / n) + 1e-9


def test_context_length_ends_generation_with_length(model, engine):
    async def main():
        async with HFBackend(model, max_context_len=12, **engine) as backend:
            return await backend.generate(list(range(1, 9)), SamplingParams(max_new_tokens=10, seed=0))

    g = run(main())
    assert len(g.ids) == 4 and g.finish_reason == "length"

# ------------------------------------------------------------------------------------------------- seeds
def test_same_seed_same_tokens_different_seed_different_tokens(model, engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=1234)

    async def main():
        async with HFBackend(model, **engine) as backend:
            alone = await backend.generate(PROMPTS[0], params)
            together = await asyncio.gather(backend.generate(PROMPTS[0], params), backend.generate(PROMPTS[2], params),
                                            backend.generate(PROMPTS[0], params))
            other = await backend.generate(PROMPTS[0], params.replace(seed=99))
            return alone, together, other

    alone, together, other = run(main())
    assert together[0].ids == alone.ids and together[2].ids == alone.ids
    assert other.ids != alone.ids


def test_generate_many_gives_a_group_distinct_reproducible_seeds(model, engine):
    async def main():
        async with HFBackend(model, **engine) as backend:
            params = SamplingParams(max_new_tokens=12, seed=7)
            return await backend.generate_many([PROMPTS[0]] * 3, params), await backend.generate_many([PROMPTS[0]] * 3,
                                                                                                    params)

    first, second = run(main())
    assert len({tuple(g.ids) for g in first}) == 3
    assert [g.ids for g in first] == [g.ids for g in second]


# ------------------------------------------------------------------------------------------------- weights
def test_shares_weights_with_the_trainer(engine):
    model = tiny_model(seed=1).train()
    weight = model.lm_head.weight
    pointer = weight.data_ptr()
    target = 123

    async def main():
        async with HFBackend(model, **engine) as backend:
            assert backend.model is model
            before = await backend.generate(PROMPTS[0], GREEDY)
            training_after_generation = model.training
            # One optimizer step that makes `target` likely after every position of the greedy output.
            optimizer = torch.optim.SGD(model.parameters(), lr=50.0)
            logits = model(input_ids=torch.tensor([PROMPTS[0] + before.ids], device=DEVICE)).logits[0]
            loss = -torch.log_softmax(logits, -1)[:, target].mean()
            loss.backward()
            optimizer.step()
            after = await backend.generate(PROMPTS[0], GREEDY)
            return before, training_after_generation, after

    before, training_after_generation, after = run(main())
    assert training_after_generation and model.training  # the train/eval state is restored
    assert weight.data_ptr() == pointer  # updated in place, no copy made
    model.eval()
    assert after.ids == greedy_by_hand(model, PROMPTS[0], 12)
    assert after.ids != before.ids


def test_update_weights_copies_named_tensors(engine):
    model = tiny_model(seed=2)

    async def main():
        async with HFBackend(model, **engine) as backend:
            before = await backend.generate(PROMPTS[0], GREEDY)
            new = {name: torch.randn_like(p) for name, p in model.named_parameters() if "lm_head" in name}
            await backend.update_weights(new)
            after = await backend.generate(PROMPTS[0], GREEDY)
            with pytest.raises(ValueError, match="unknown parameter"):
                await backend.update_weights({"no.such.weight": torch.zeros(1)})
            with pytest.raises(NotImplementedError, match="tensors only"):
                await backend.update_weights(model_path="/some/checkpoint")
            await backend.flush_cache()  # nothing cached between requests: a no-op
            return before, after, new

    before, after, new = run(main())
    assert torch.equal(model.lm_head.weight, new["lm_head.weight"])
    assert after.ids == greedy_by_hand(model, PROMPTS[0], 12) and after.ids != before.ids

# ------------------------------------------------------------------------------------------------- integration
def test_output_feeds_a_conversation(qwen25, engine):
    """With the real vocabulary: the sampled ids and logprobs go into a Conversation verbatim."""
    from mt_env.chat_format import ChatFormat
    from mt_env.conversation import Conversation

    fmt = ChatFormat(qwen25)
    model = tiny_model(seed=6, vocab=len(qwen25))
    conversation = Conversation(fmt, [{"role": "user", "content": "What is 2+2?"}])

    async def main():
        async with HFBackend(model, **engine) as backend:
            params = SamplingParams(max_new_tokens=6, stop_token_ids=(fmt.end_of_turn_id,), seed=0)
            return await backend.generate(conversation.context_ids, params)

    g = run(main())
    turn = conversation.add_assistant(g.ids, g.logprobs, g.finish_reason)
    assert turn.ids == g.ids and turn.closed == (g.finish_reason == "stop")
    assert conversation.current.logprobs[-len(g.ids):] == g.logprobs


def test_vocab_limit_keeps_padding_rows_out_and_matches_the_trainer(model, engine):
    """A model whose embedding has more rows than the tokenizer has tokens must never sample a padding row, and its
    logprobs are over the real tokens only — the same quantity `PolicyModel(vocab_limit=...)` recomputes."""
    from trainers.modeling import PolicyModel

    limit = 300
    params = SamplingParams(temperature=1.5, max_new_tokens=40, seed=3)

    async def go():
        async with HFBackend(model, vocab_limit=limit, **engine) as backend:
            return await asyncio.gather(*(backend.generate([1, 2, 3, i], params.replace(seed=i)) for i in range(8)))

    gens = run(go())
    ids = [t for g in gens for t in g.ids]
    assert max(ids) < limit and len(ids) == 8 * 40  # with 512 rows and T=1.5, ids >= 300 would be common
    prompt, gen = [1, 2, 3, 0], gens[0]
    seq = torch.tensor([prompt + gen.ids], device=model.device)
    target = torch.zeros(seq.shape, device=model.device)
    target[0, len(prompt):] = 1
    with torch.no_grad():
        lp, _ = PolicyModel(model, vocab_limit=limit)(seq, target, temperature=1.5)
    assert torch.allclose(lp[0, len(prompt):].cpu(), torch.tensor(gen.logprobs), atol=1e-4)
    with pytest.raises(ValueError, match="vocab_limit"):
        HFBackend(model, vocab_limit=VOCAB + 1, **engine)
