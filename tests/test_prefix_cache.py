"""The engine's memory: the KV block pool's accounting (property-tested over any order of admits, growth, forks,
releases and flushes), the prefix cache across turns and within a group (only new tokens are prefilled; the same
tokens as with the cache off), invalidation by new weights, eviction, and preemption when blocks run out."""

from __future__ import annotations

import asyncio
import copy
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.engine import Engine, EngineConfig, Sequence, new_stats
from agents.engine import config as knobs
from agents.engine.blocks import NULL_BLOCK, BlockPool
from agents.engine.scheduler import Scheduler
from agents.backend import GenerationError, SamplingParams
from agents.hf_backend import HFBackend

from .backend_hf_fixtures import VOCAB, greedy_by_hand, one_cpu_thread, run, tiny_model  # noqa: F401

FAST = dict(fast_path=True, cuda_graphs=False, compile=False)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=4)


# ------------------------------------------------------------------------------------------------- the block pool
def check_pool(pool: BlockPool, holders: dict[int, list[int]]) -> None:
    """Every block but the null one is exactly one of free, cached, held; refs count the holders; the index is
    consistent."""
    counts = [0] * pool.num_blocks
    for blocks in holders.values():
        for block in blocks:
            counts[block] += 1
    assert pool.refs == counts and counts[NULL_BLOCK] == 0
    free, cached = set(pool._free), set(pool._cached)
    held = {b for b in range(pool.num_blocks) if counts[b]}
    assert not (free & cached) and not (free & held) and not (cached & held)
    assert free | cached | held == set(range(1, pool.num_blocks))
    assert all(pool.key[b] is not None for b in cached) and all(pool.key[b] is None for b in free)
    assert all(pool.key[block] == key for key, block in pool.index.items())
    assert pool.available == len(free) + len(cached) and pool.held == len(held)


OPS = st.lists(st.tuples(st.sampled_from(["admit", "grow", "fork", "end", "flush"]), st.integers(0, 10**6),
                         st.integers(1, 40)), max_size=60)


@settings(max_examples=300)
@given(ops=OPS, num_blocks=st.integers(2, 40), block_size=st.integers(1, 4), vocab=st.integers(1, 3))
def test_block_accounting_holds_whatever_the_order_of_admits_growth_forks_ends_and_flushes(ops, num_blocks,
                                                                                          block_size, vocab):
    """Sequences over a tiny vocabulary (so prefixes recur) are admitted with the prefix they find (full blocks,
    then a partial block left by an ended sequence, taken over), grow, fork (a group member sharing another's full
    blocks), end (their full blocks and last partial one registered) and the cache is flushed: no block is leaked,
    none is freed while held, refs equal the holders, and a match never returns a block whose content differs from
    the tokens asked."""
    pool = BlockPool(num_blocks, block_size)
    holders: dict[int, list[int]] = {}
    tokens: dict[int, list[int]] = {}
    content: dict[int, tuple] = {}  # block -> the tokens of its sequence up to its end (what its KV depends on)
    indexed: dict[int, tuple] = {}  # sequence -> where its registration stands
    matches: list[tuple[list[int], list]] = []  # (tokens, the identities their match found then)
    rng, next_id = random.Random(0), 0
    for op, pick, n in ops:
        live = sorted(holders)
        if op == "admit" or (op == "fork" and live):
            ids = [rng.randrange(vocab) for _ in range(n)] if op == "admit" else tokens[live[pick % len(live)]][:n]
            cached = pool.match(ids, len(ids) - 1)
            matches.append((list(ids), [pool.identity(block) for block in cached]))
            for i, block in enumerate(cached):
                assert content[block] == tuple(ids[:(i + 1) * block_size])
            start = len(cached) * block_size
            partial, held = pool.match_partial(ids, cached[-1] if cached else None, start, len(ids) - 1)
            if held:
                assert pool.refs[partial] == 0 and content[partial] == tuple(ids[:start + held])
            revived = sum(pool.refs[b] == 0 for b in cached) + bool(held)
            needed = pool.blocks_for(len(ids)) - len(cached) - bool(held)
            if pool.available - revived < needed:
                continue
            pool.acquire(cached)
            if held:
                pool.take(partial)
            blocks = cached + ([partial] if held else []) + pool.allocate(needed)
            indexed[next_id] = _register_checked(pool, blocks, ids, len(ids), False, pool.chain_after(cached))
            for i, block in enumerate(blocks[:len(ids) // block_size]):
                content[block] = tuple(ids[:(i + 1) * block_size])  # a matched block's is the same
            holders[next_id], tokens[next_id] = blocks, ids
            next_id += 1
        elif op == "grow" and live:
            seq = live[pick % len(live)]
            if len(tokens[seq]) == len(holders[seq]) * block_size:
                fresh = pool.allocate(1)
                if fresh is None:
                    continue
                holders[seq].append(fresh[0])
            tokens[seq].append(rng.randrange(vocab))
        elif op == "end" and live:
            seq = live[pick % len(live)]
            _register_checked(pool, holders[seq], tokens[seq], len(tokens[seq]), True, indexed.pop(seq))
            for i, block in enumerate(holders[seq][:-(-len(tokens[seq]) // block_size)]):
                if pool.key[block] is not None:
                    content[block] = tuple(tokens[seq][:(i + 1) * block_size])
            pool.release(holders.pop(seq))
        elif op == "flush":
            pool.clear()
        for block in list(content):  # a block handed out again holds new content
            if pool.key[block] is None and pool.refs[block] == 0:
                del content[block]
        check_pool(pool, holders)
        if matches:  # an earlier match, taken as known now, finds what a fresh match finds
            ids, known = matches[pick % len(matches)]
            assert pool.match(ids, len(ids) - 1, known) == pool.match(ids, len(ids) - 1)
    for seq in list(holders):
        pool.release(holders.pop(seq))
    check_pool(pool, holders)
    assert pool.held == 0


def _register_checked(pool: BlockPool, blocks, tokens, written, partial, start):
    """`pool.register` from `start`, checked against registering the whole sequence on a copy of the pool (or, for
    a chain begun before a flush, against registering nothing)."""
    whole = copy.deepcopy(pool)
    if start[0] == pool.epoch:
        whole.register(blocks, tokens, written, partial)
    point = pool.register(blocks, tokens, written, partial, start)
    assert pool.index == whole.index and pool.key == whole.key
    return point


class _CountingIndex(dict):
    lookups = 0

    def get(self, key, default=None):
        self.lookups += 1
        return super().get(key, default)


def test_registering_a_turn_costs_its_new_blocks_not_the_conversation():
    """A conversation of `turns` turns, each admitted after its cached prefix (prompt blocks registered), then
    generating and released (the rest registered): the last turn's registration looks up its own blocks, however
    long the conversation before it (registering from scratch would look up every block of it)."""
    def last_turn_lookups(turns: int) -> int:
        pool, tokens = BlockPool(4096, 4), []
        pool.index = _CountingIndex()
        for turn in range(turns):
            tokens += [turn * 100 + i for i in range(30)]  # the turn's observation, then 30 generated tokens
            cached = pool.match(tokens, len(tokens) - 1)
            pool.acquire(cached)
            blocks = cached + pool.allocate(pool.blocks_for(len(tokens) + 30) - len(cached))
            before = pool.index.lookups
            point = pool.register(blocks, tokens, len(tokens), start=pool.chain_after(cached))
            tokens += [turn * 100 + 50 + i for i in range(30)]
            pool.register(blocks, tokens, len(tokens), partial=True, start=point)
            registering = pool.index.lookups - before
            pool.release(blocks)
        return registering

    assert last_turn_lookups(16) == last_turn_lookups(4) <= 16  # 60 new tokens: 15 blocks, and a partial one


def test_a_known_match_whose_blocks_were_reused_is_not_taken():
    """Blocks evicted and registered again for other tokens (a key again, a new incarnation): a match given the old
    identities as known looks the tokens up instead of taking the blocks."""
    pool = BlockPool(3, 2)  # two blocks
    first, other = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    blocks = pool.allocate(2)
    pool.register(blocks, first, 5)
    known = [pool.identity(block) for block in pool.match(first, 4)]
    assert len(known) == 2
    pool.release(blocks)
    again = pool.allocate(2)  # both evicted, then written with other tokens and registered
    pool.register(again, other, 5)
    assert sorted(again) == sorted(blocks) and all(pool.key[block] is not None for block in again)
    assert pool.match(first, 4, known) == pool.match(first, 4) == []
    assert pool.match(other, 4, [pool.identity(block) for block in again]) == again


def test_releasing_a_block_not_held_is_an_error():
    pool = BlockPool(4, 2)
    (block,) = pool.allocate(1)
    pool.release([block])
    with pytest.raises(ValueError, match="not held"):
        pool.release([block])


def test_the_last_block_released_is_evicted_before_the_ones_it_follows():
    pool = BlockPool(4, 2)  # three blocks, all taken
    blocks = pool.allocate(3)
    pool.register(blocks, [1, 2, 3, 4, 5, 6], 6)
    pool.release(blocks)
    assert pool.allocate(1) == [blocks[2]] and pool.evictions == 1
    assert pool.match([1, 2, 3, 4, 5, 6], 6) == blocks[:2]  # the head of the chain is still cached


# ------------------------------------------------------------------------------------------------- admission
@settings(max_examples=200)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40), running=st.integers(0, 8),
       budget=st.integers(16, 2000), blocks=st.integers(20, 400), floor=st.sampled_from([16, 64, 4096]))
def test_a_prefill_pass_admits_shortest_first_within_the_budget_and_leaves_growth_room(lengths, running, budget,
                                                                                       blocks, floor):
    """Sequences of one repeated token, so that each finds a prefix cached by those admitted before it: a pass
    admits at least one, in order of length, within the budget, leaving a growth block per row, its rows' widths
    (new tokens, padded alone) within twice the narrowest (rows narrower than `floor` counted as that wide)."""
    old = knobs.PREFILL_TOKENS, knobs.PREFILL_WIDTH_FLOOR
    knobs.PREFILL_TOKENS, knobs.PREFILL_WIDTH_FLOOR = budget, floor
    try:
        pool = BlockPool(blocks, 4)
        scheduler = Scheduler(pool, max_seqs=48, max_context_len=4096, stats=new_stats())
        for i in range(running):  # rows already decoding, holding a block each
            seq = Sequence([i], SamplingParams(), 5)
            seq.blocks = pool.allocate(1) or []
            scheduler.slots.acquire([seq])
        seqs = [Sequence([7] * n, SamplingParams(), 5) for n in lengths]
        scheduler.waiting.extend(seqs)
        held_before = pool.held
        prefill = scheduler.admit()
    finally:
        knobs.PREFILL_TOKENS, knobs.PREFILL_WIDTH_FLOOR = old
    admitted = [] if prefill is None else prefill.seqs
    failed = [s for s in scheduler.take_finished()]
    assert all(pool.blocks_for(s.length) + 1 > blocks - 1 for s in failed)  # only those that could never run
    assert len(admitted) <= 48 - running
    if admitted:
        widths = [-(-(s.length - s.cached) // 16) * 16 for s in admitted]
        assert len(admitted) == 1 or len(admitted) * max(widths) <= budget
        assert max(widths) <= knobs.PREFILL_WIDTH_RATIO * max(min(widths), floor)
        waiting_fits = [s for s in scheduler.waiting if pool.blocks_for(s.length) + 1 <= blocks - 1]
        assert admitted or not waiting_fits or pool.available < running + 1 + pool.blocks_for(
            min(s.length for s in waiting_fits))  # nothing admitted: only for want of blocks
        assert pool.available >= running + len(admitted)  # a block of growth for every row
        assert sorted(s.length for s in admitted) == [s.length for s in admitted]
    assert pool.held - held_before == len({b for s in admitted for b in s.blocks})


# ------------------------------------------------------------------------------------------------- prefix cache
async def play(model, conversations, turns: int, samples: int = 1, **options):
    """`conversations` prompts, each played by `samples` sequences for `turns` turns (a turn: the context so far,
    then 5 sampled tokens, then 3 observation tokens); returns each sequence's turns and the backend's stats."""
    options = dict(max_batch_size=64, gather_window_s=0.05) | FAST | options
    async with HFBackend(model, **options) as backend:
        async def episode(prompt, seed):
            context, out = list(prompt), []
            for turn in range(turns):
                params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=seed * 100 + turn)
                generation = await backend.generate(context, params)
                out.append(generation)
                context += generation.ids + [(seed + turn) % VOCAB, 9, 10]
            return out
        episodes = await asyncio.gather(*(episode(p, 10 * i + k) for i, p in enumerate(conversations)
                                          for k in range(samples)))
        return episodes, dict(backend.stats)


PROMPTS = [list(range(1, 40)), [5] * 23, list(range(100, 161)), [7, 8]]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_the_prefix_cache_changes_no_token_and_prefills_only_what_is_new(model, block_size):
    """Three turns of four conversations, four samples each (a group per prompt): the same tokens and logprobs
    with the cache as without; with it, each later turn prefills only its new tokens (and the part of the last
    block it shares), and a group's prompt is computed once."""
    off, off_stats = run(play(model, PROMPTS, turns=3, samples=4, prefix_cache=False, block_size=block_size))
    on, on_stats = run(play(model, PROMPTS, turns=3, samples=4, block_size=block_size))
    for a, b in zip(on, off, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.ids == y.ids and x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    assert off_stats["cached_tokens"] == 0
    new_tokens = sum(len(p) for p in PROMPTS) + 16 * 2 * 3  # each prompt once, then each later turn's observation
    # and at most: each later turn's last sampled token (not fed when its row ended) and, for the 12 group members
    # after the first, their prompt's last partial block (computed by each: at least its last token)
    assert on_stats["prefilled_tokens"] <= new_tokens + 16 * 2 + 12 * block_size
    assert on_stats["prefilled_tokens"] + on_stats["cached_tokens"] == off_stats["prefilled_tokens"]


def test_a_groups_prompt_is_computed_once_in_one_pass(model):
    """Eight samples of one 37-token prompt arrive together: the first computes the prompt, the seven others only
    the tokens of its last, partial block (the pass writes before it reads)."""
    async def main():
        async with HFBackend(model, max_batch_size=8, gather_window_s=0.2, block_size=4, **FAST) as backend:
            params = [SamplingParams(temperature=1.0, max_new_tokens=4, seed=i) for i in range(8)]
            gens = await asyncio.gather(*(backend.generate(PROMPTS[0][:37], p) for p in params))
            return gens, dict(backend.stats)

    gens, stats = run(main())
    assert stats["prefill_passes"] == 1
    assert stats["prefilled_tokens"] == 37 + 7 * (37 - 36) and stats["cached_tokens"] == 7 * 36
    assert sorted(g.meta["cached_tokens"] for g in gens) == [0] + [36] * 7


def test_a_long_group_prompt_goes_first_and_its_members_follow_in_a_narrow_pass(model, monkeypatch):
    """Eight samples of one 37-token prompt, with no floor under a row's width: the first computes the prompt (48
    wide); the others, one new token each (16 wide), would pad to 48 in its pass: they follow in a pass 16 wide.
    The tokens are those of the cache off."""
    monkeypatch.setattr(knobs, "PREFILL_WIDTH_FLOOR", 16)

    async def main(prefix_cache):
        async with HFBackend(model, max_batch_size=8, gather_window_s=0.2, block_size=4, prefix_cache=prefix_cache,
                             **FAST) as backend:
            params = [SamplingParams(temperature=1.0, max_new_tokens=4, seed=i) for i in range(8)]
            gens = await asyncio.gather(*(backend.generate(PROMPTS[0][:37], p) for p in params))
            return gens, dict(backend.stats)

    gens, stats = run(main(True))
    off, _ = run(main(False))
    assert stats["prefill_passes"] == 2 and stats["prefill_padded_tokens"] == 48 + 7 * 16
    assert stats["prefilled_tokens"] == 37 + 7 and stats["cached_tokens"] == 7 * 36
    assert [g.ids for g in gens] == [g.ids for g in off]


def test_new_weights_drop_the_cached_prefixes():
    """An optimizer step between two turns (in place, as the trainer's): the second turn finds nothing cached and
    gets the new weights' tokens; `flush_cache` drops the prefixes too."""
    module = tiny_model(seed=11)
    greedy = SamplingParams(temperature=0, max_new_tokens=6)

    async def main():
        async with HFBackend(module, block_size=4, **FAST) as backend:
            first = await backend.generate(PROMPTS[0], greedy)
            context = PROMPTS[0] + first.ids + [3, 4]
            cached = (await backend.generate(context, greedy)).meta["cached_tokens"]
            with torch.no_grad():
                module.lm_head.weight.mul_(1.5)
            after = await backend.generate(context, greedy)
            again = (await backend.generate(context, greedy)).meta["cached_tokens"]
            await backend.flush_cache()
            flushed = (await backend.generate(context, greedy)).meta["cached_tokens"]
            return context, cached, after, again, flushed

    context, cached, after, again, flushed = run(main())
    assert cached > 0 and after.meta["cached_tokens"] == 0 and again > 0 and flushed == 0
    assert after.ids == greedy_by_hand(module, context, 6)


def test_a_full_pool_evicts_the_least_recently_released_prefixes(model):
    """A pool of 40 blocks of 4 tokens, four rows, and conversations in pairs that end one after another: old
    prefixes are evicted to make room, a pair's prompt is still shared, and the outputs stay those of the cache
    off."""
    prompts = [[(13 * i + j) % VOCAB for j in range(30)] for i in range(12)]
    off, _ = run(play(model, prompts, turns=2, samples=2, prefix_cache=False, kv_blocks=400, block_size=4))
    on, stats = run(play(model, prompts, turns=2, samples=2, kv_blocks=40, block_size=4, max_batch_size=4))
    assert [[g.ids for g in e] for e in on] == [[g.ids for g in e] for e in off]
    assert stats["evictions"] > 0 and stats["cached_tokens"] > 0


def test_sequences_are_preempted_when_blocks_run_out_and_get_what_they_get_unhindered(model):
    """Sixteen sequences that each grow to 80 tokens share 60 blocks of 4 (240 tokens): the newest are preempted
    and readmitted (their tokens so far prefilled again) instead of failing; every sequence gets the tokens and
    logprobs it gets with room to spare, and the pool ends with nothing held."""
    prompts = [[(7 * i + j) % VOCAB + 1 for j in range(10 + i)] for i in range(16)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=60, seed=i) for i in range(16)]

    async def main(**options):
        async with HFBackend(model, max_batch_size=16, block_size=4, **FAST, **options) as backend:
            gens = await asyncio.gather(*(backend.generate(p, q) for p, q in zip(prompts, params)))
            return gens, dict(backend.stats), backend._engine.pool.held

    roomy, roomy_stats, _ = run(main(kv_blocks=1000), timeout=120)
    tight, stats, held = run(main(kv_blocks=60), timeout=120)
    assert roomy_stats["preemptions"] == 0 and stats["preemptions"] > 0
    for a, b in zip(tight, roomy, strict=True):
        assert a.ids == b.ids and a.finish_reason == b.finish_reason == "length"
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert held == 0


def test_a_sequence_longer_than_the_pool_fails_with_what_to_change(model):
    async def main():
        async with HFBackend(model, block_size=4, kv_blocks=8, **FAST) as backend:
            with pytest.raises(ValueError, match="needs 10 KV blocks; the pool has 7: raise kv_blocks"):
                await backend.generate(list(range(1, 40)), SamplingParams(max_new_tokens=2))
            return await backend.generate([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=4))

    assert run(main()).ids == greedy_by_hand(model, [1, 2, 3], 4)


def test_one_sequence_that_outgrows_the_pool_fails_alone_and_leaks_nothing(model):
    async def main():
        async with HFBackend(model, block_size=4, kv_blocks=8, **FAST) as backend:
            with pytest.raises(GenerationError, match="more KV blocks than the pool"):
                await backend.generate([1, 2, 3], SamplingParams(max_new_tokens=100))
            return backend._engine.pool.held

    assert run(main()) == 0


def test_cancelled_sequences_release_their_blocks(model):
    async def main():
        async with HFBackend(model, block_size=4, **FAST) as backend:
            tasks = [asyncio.create_task(backend.generate(p, SamplingParams(max_new_tokens=300))) for p in PROMPTS]
            while backend.stats["decode_passes"] < 5:
                await asyncio.sleep(0.001)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await backend.generate([1], SamplingParams(max_new_tokens=1))  # a step after the cancellations
            return backend._engine.pool.held

    assert run(main()) == 0


def test_the_engine_serves_sequences_directly(model):
    """The engine without the asyncio front: add, step while busy; a second turn reuses the first's blocks."""
    engine = Engine(model, EngineConfig(max_seqs=4, block_size=4, cuda_graphs=False, compile=False))
    first = Sequence(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=8), 8)
    engine.add(first)
    done = []
    while engine.busy():
        done += engine.step()
    second = Sequence(first.tokens + [1, 2], SamplingParams(temperature=0, max_new_tokens=8), 8)
    engine.add(second)
    while engine.busy():
        done += engine.step()
    assert done == [first, second] and first.outcome == second.outcome == "length"
    assert second.cached == len(PROMPTS[0]) + 8 - 1  # all but the last sampled token, partial block included
    assert second.ids == greedy_by_hand(model, second.prompt, 8)
