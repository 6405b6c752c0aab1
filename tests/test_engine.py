"""The paged engine (`agents.engine`) against HFBackend's transformers path, on tiny random Qwen2, Qwen3 and Llama
models: same tokens and logprobs, rows joining and leaving, arrivals gathered into prefill passes, slot compaction
and reuse, cancellation, a failed pass; overlapped steps (the tokens of one step at a time, the wasted row-steps
counted) and the worker's switch interval. The engine's other tests: tests/test_engine_*.py (memory and fallbacks,
the sampler, the slot bookkeeping, the model runner, the compiled step); the prefix cache, the block pool and
preemption: tests/test_prefix_cache.py.

On CPU the decode step runs eagerly (the very functions a CUDA graph captures); with ``MT_ENV_TEST_DEVICE=cuda`` the
same tests run captured in CUDA graphs, and the equality tests run the step as the fast path does by default there:
compiled too (the other tests are about scheduling and bookkeeping: they skip the compilations).
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import threading

import pytest
import torch

from agents.backend import GenerationError, SamplingParams
from agents.engine import config as knobs
from agents.engine.model_runner import ModelRunner
from agents.hf_backend import SERVING_SWITCH_INTERVAL_S, HFBackend

from .backend_hf_fixtures import (
    DEVICE,
    GREEDY,
    VOCAB,
    greedy_by_hand,
    one_cpu_thread,  # noqa: F401  (one intra-op thread for tiny matmuls)
    run,
    tiny_model,
)
from .engine_fixtures import (
    DEFAULT_FAST,
    FAST,
    MIXES,
    PROMPTS,
    TRANSFORMERS,
    arch_model_fixture,  # noqa: F401  (a fixture)
    assert_same,
    each_alone,
    generate_together,
    model_fixture,  # noqa: F401  (a fixture)
)


# ------------------------------------------------------------------------------------------------- equality
@pytest.mark.parametrize("mix", list(MIXES))
def test_fast_path_gives_the_transformers_paths_tokens_and_logprobs(arch_model, mix):
    params = MIXES[mix]
    fast, stats = run(generate_together(arch_model, PROMPTS, params, **DEFAULT_FAST), timeout=300)
    reference, _ = run(generate_together(arch_model, PROMPTS, params, **TRANSFORMERS))
    assert_same(fast, reference)
    assert stats["decode_passes"] > 0 and stats["merges"] == 0
    if DEVICE == "cuda":
        # every step replays a graph (its bucket's or a larger one's), but a new bucket's first uncaptured steps
        assert stats["graph_replays"] + stats["stand_in_replays"] + stats["uncaptured_steps"] == stats["decode_passes"]
        assert stats["graph_captures"] > 0


def test_rows_joining_and_leaving_get_what_they_get_alone(arch_model):
    """Requests arrive while others decode and leave at different steps; each gets the tokens it gets alone."""
    params = [SamplingParams(temperature=0.9, max_new_tokens=n, seed=i) for i, n in enumerate([40, 5, 17, 3, 25])]
    prompts = PROMPTS[:5]

    async def main():
        async with HFBackend(arch_model, **FAST) as backend:  # admitted at the next boundary
            tasks = []
            for p, q in zip(prompts, params):
                tasks.append(asyncio.create_task(backend.generate(p, q)))
                passes = backend.stats["decode_passes"]
                while backend.stats["decode_passes"] < passes + 3:  # the next one arrives 3 steps later
                    await asyncio.sleep(0.001)
            return await asyncio.gather(*tasks), dict(backend.stats)

    together, stats = run(main())
    alone = each_alone(arch_model, prompts, params)
    assert_same(together, alone)
    assert stats["prefill_passes"] == 5  # every arrival joined the running batch


def test_arrivals_are_admitted_at_the_next_step_boundary_and_get_what_they_get_alone(model):
    """Four long rows decode; three requests arrive a step or more apart: each is admitted at the next step boundary
    and decodes beside the long rows. Each row's tokens are those it gets alone."""
    params = [SamplingParams(temperature=0.9, max_new_tokens=60, seed=i) for i in range(4)]
    params += [SamplingParams(temperature=0.9, max_new_tokens=n, seed=10 + n) for n in (5, 17, 3)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]

    async def main():
        async with HFBackend(model, max_batch_size=8, gather_window_s=0.2, **FAST) as backend:
            tasks = [asyncio.create_task(backend.generate(p, q)) for p, q in zip(prompts[:4], params[:4])]
            for p, q in zip(prompts[4:], params[4:]):
                passes = backend.stats["decode_passes"]
                while backend.stats["decode_passes"] < passes + 1:  # the next one arrives at least a step later
                    await asyncio.sleep(0.001)
                tasks.append(asyncio.create_task(backend.generate(p, q)))
            return await asyncio.gather(*tasks), dict(backend.stats)

    at_once, stats = run(main())
    assert_same(at_once, each_alone(model, prompts, params))
    # (two arrivals a step apart may still meet at one boundary: the worker takes what is queued when it looks)
    assert stats["prefill_passes"] >= 3
    assert stats["decode_passes"] < 59 + 16  # they decoded beside the long rows


def passes_of_four_rows(monkeypatch, release: threading.Event | None = None) -> tuple[threading.Event, list[int]]:
    """A prefill budget of four rows of width 16, and the rows of each pass recorded; the event returned is set at
    the first pass, which then waits for `release` when given."""
    monkeypatch.setattr(knobs, "PREFILL_TOKENS", 4 * knobs.PREFILL_WIDTH_STEP)
    started, passes = threading.Event(), []
    prefill = ModelRunner.prefill

    def recorded(runner, rows, sampling):
        passes.append(len(rows))
        if len(passes) == 1:
            started.set()
            if release is not None:
                release.wait(30)
        return prefill(runner, rows, sampling)

    monkeypatch.setattr(ModelRunner, "prefill", recorded)
    return started, passes


def test_arrivals_during_a_prefill_pass_join_the_requests_still_waiting_for_one(model, monkeypatch):
    """A burst of six requests needs two passes of at most four rows (the budget); six more arrive during the first
    pass (a second env process's burst). They join the two still waiting: passes of 4, 4 and 4 rows, not 4, 2, 4
    and 2. Each row's tokens are those it gets alone."""
    release = threading.Event()
    started, passes = passes_of_four_rows(monkeypatch, release)
    params = [SamplingParams(temperature=0.9, max_new_tokens=6, seed=i) for i in range(12)]
    prompts = [[(5 * i + j) % VOCAB for j in range(10 + i % 5)] for i in range(12)]  # one width: 16

    async def main():
        async with HFBackend(model, max_batch_size=16, gather_window_s=0.05, **FAST) as backend:
            tasks = [asyncio.create_task(backend.generate(p, q)) for p, q in zip(prompts[:6], params[:6])]
            await asyncio.to_thread(started.wait, 30)
            tasks += [asyncio.create_task(backend.generate(p, q)) for p, q in zip(prompts[6:], params[6:])]
            await asyncio.sleep(0.1)  # queued while the first pass runs
            release.set()
            return await asyncio.gather(*tasks)

    together = run(main())
    assert passes == [4, 4, 4]
    assert_same(together, each_alone(model, prompts, params))


def test_a_gather_ends_once_the_waiting_fill_a_prefill_pass(model, monkeypatch):
    """Four requests arrive at an idle worker, where a pass takes four (the budget) and the gather window is a
    minute: their pass goes at once (no later request could join it), not after a quiet window. Each row's tokens
    are those it gets alone."""
    started, passes = passes_of_four_rows(monkeypatch)
    params = [SamplingParams(temperature=0.9, max_new_tokens=6, seed=i) for i in range(4)]
    prompts = [[(3 * i + j) % VOCAB for j in range(9 + i)] for i in range(4)]  # one width: 16

    async def main():
        async with HFBackend(model, max_batch_size=16, gather_window_s=60, **FAST) as backend:
            tasks = [asyncio.create_task(backend.generate(p, q)) for p, q in zip(prompts, params)]
            assert await asyncio.to_thread(started.wait, 30), "no prefill pass within 30 s: the gather went on"
            return await asyncio.gather(*tasks)

    together = run(main())
    assert passes == [4]
    assert_same(together, each_alone(model, prompts, params))


def test_arrivals_that_outnumber_the_decoding_rows_are_gathered_into_one_prefill(model):
    """One long row decodes; six requests arrive a few milliseconds apart (a batch whose turns ended together,
    while an early finisher decodes alone). They are gathered as an idle worker gathers: one prefill pass for the
    six, not one per step boundary. Each row's tokens are those it gets alone."""
    params = [SamplingParams(temperature=0.9, max_new_tokens=300, seed=0)]
    params += [SamplingParams(temperature=0.9, max_new_tokens=8, seed=i) for i in range(1, 7)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]

    async def main():
        async with HFBackend(model, max_batch_size=8, gather_window_s=1.0, **FAST) as backend:
            tasks = [asyncio.create_task(backend.generate(prompts[0], params[0]))]
            while backend.stats["decode_passes"] < 1:
                await asyncio.sleep(0.001)
            for p, q in zip(prompts[1:], params[1:]):
                tasks.append(asyncio.create_task(backend.generate(p, q)))
                await asyncio.sleep(0.005)  # several decode steps of the tiny model apart
            return await asyncio.gather(*tasks), dict(backend.stats)

    together, stats = run(main())
    alone = each_alone(model, prompts, params)
    assert_same(together, alone)
    assert stats["prefill_passes"] == 2 and stats["gather_s"] > 0


def test_compaction_moves_the_last_rows_down_and_keeps_their_outputs(model):
    """Eight rows fill slots 0-7 (the longest prompts last); the six in slots 0-5 end after two tokens, so the two
    left move to slots 0-1 and decode in a batch of 2 instead of 8 padded rows."""
    prompts = [[5 + i] * (2 + i) for i in range(8)]
    params = [SamplingParams(temperature=0, max_new_tokens=2)] * 6 + [SamplingParams(temperature=0.8,
                                                                                     max_new_tokens=30, seed=s)
                                                                      for s in (1, 2)]
    fast, stats = run(generate_together(model, prompts, params, max_batch_size=8, gather_window_s=0.2, **FAST))
    reference, _ = run(generate_together(model, prompts, params, **TRANSFORMERS))
    assert_same(fast, reference)
    assert stats["prefill_passes"] == 1 and stats["compaction_moves"] == 2
    assert stats["padded_rows"] == 0  # without the moves: 6 padding rows in each of the 28 later steps


def test_a_reused_slot_does_not_see_its_previous_rows_cache(model):
    """One slot: a long row is cancelled mid-way, then a shorter prompt takes the slot; the positions the old row
    filled beyond the new prompt must stay invisible."""

    async def main():
        async with HFBackend(model, max_batch_size=1, **FAST) as backend:
            doomed = asyncio.create_task(backend.generate(list(range(30, 70)), SamplingParams(max_new_tokens=300)))
            while backend.stats["decode_passes"] < 20:
                await asyncio.sleep(0.001)
            doomed.cancel()
            return [await backend.generate(p, SamplingParams(temperature=0, max_new_tokens=12)) for p in PROMPTS[:3]]

    for prompt, g in zip(PROMPTS, run(main())):
        assert g.ids == greedy_by_hand(model, prompt, 12)


def test_a_failed_pass_clears_its_slots():
    """A pass that produced NaN fails its rows and zeroes their slots: masked positions are multiplied by 0 in
    attention, and 0 x NaN would poison the next row to use the slot."""
    model = tiny_model(seed=8)
    weight = model.model.layers[0].self_attn.k_proj.weight
    saved = weight.detach().clone()

    async def main():
        async with HFBackend(model, max_batch_size=1, **FAST) as backend:
            with torch.no_grad():
                weight.fill_(math.nan)
            with pytest.raises(GenerationError, match="NaN"):
                await backend.generate(list(range(1, 40)), SamplingParams(max_new_tokens=5))
            with torch.no_grad():
                weight.copy_(saved)
            return await backend.generate(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=12))

    assert run(main()).ids == greedy_by_hand(model, PROMPTS[0], 12)


def test_a_row_samples_the_same_tokens_whatever_its_neighbours_truncate(model):
    """A seeded row's tokens do not change when a truncating row shares its batch (on both paths)."""
    plain = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)
    truncating = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=16, seed=6)
    for path in (FAST, TRANSFORMERS):
        (alone,), _ = run(generate_together(model, PROMPTS[:1], [plain], **path))
        (together, _), _ = run(generate_together(model, PROMPTS[:2], [plain, truncating], **path))
        assert together.ids == alone.ids


def test_stats_count_the_passes_the_model_runs(model):
    calls = [0]
    handle = model.lm_head.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        _, stats = run(generate_together(model, PROMPTS, MIXES["mixed"], **FAST | dict(cuda_graphs=False)))
    finally:
        handle.remove()
    assert calls[0] == stats["prefill_passes"] + stats["decode_passes"] > len(PROMPTS)


STOPPING = [SamplingParams(temperature=0 if i % 4 == 0 else 1.0, max_new_tokens=1 + (7 * i) % 30, seed=i,
                           stop_token_ids=tuple(range(i % 8, VOCAB, 8))) for i in range(24)]  # 1 id in 8 stops


@pytest.mark.parametrize("mix", ["greedy", "sampled", "truncated", "mixed", "stopping"])
def test_overlapped_steps_give_the_tokens_of_one_step_at_a_time(model, mix):
    params = STOPPING if mix == "stopping" else MIXES[mix]
    prompts = [PROMPTS[i % len(PROMPTS)] + [i] for i in range(len(params))]
    overlapped, stats = run(generate_together(model, prompts, params, **FAST))
    serial, serial_stats = run(generate_together(model, prompts, params, **FAST, overlap_steps=False))
    assert_same(overlapped, serial)
    assert serial_stats["wasted_rows"] == 0
    assert stats["decoded_rows"] == serial_stats["decoded_rows"] == sum(len(g.ids) - 1 for g in serial)


def test_a_row_that_ends_costs_one_wasted_row_step_when_another_step_follows(model):
    """All rows prefilled together; row i ends at decode step k_i (its tokens - 1; 0: at the prefill) and is
    launched into step k_i + 1 before its end is read, unless its last allowed token (m_i) was already in flight.
    So the steps run are S = max(min(k_i + 1, m_i - 1)), and every row with 1 <= k_i < S wastes one row-step."""
    prompts = [PROMPTS[i % len(PROMPTS)] + [i] for i in range(len(STOPPING))]
    gens, stats = run(generate_together(model, prompts, STOPPING, max_batch_size=32, gather_window_s=0.2, **FAST))
    ends = [(len(g.ids) - 1, p.max_new_tokens) for g, p in zip(gens, STOPPING)]
    steps = max(min(k + 1, m - 1) for k, m in ends if k >= 1)
    assert stats["prefill_passes"] == 1 and stats["decode_passes"] == steps
    assert stats["wasted_rows"] == sum(1 <= k < steps for k, _ in ends)
    assert {g.finish_reason for g in gens} == {"stop", "length"} and stats["wasted_rows"] > 0
    _, serial = run(generate_together(model, prompts, STOPPING, max_batch_size=32, gather_window_s=0.2, **FAST,
                                      overlap_steps=False))
    assert serial["decode_passes"] == max(k for k, _ in ends) and serial["wasted_rows"] == 0


def test_the_switch_interval_is_lowered_while_a_worker_serves_and_restored_after_the_last(model):
    """The worker's GIL take-backs must not wait 5 ms for a busy event-loop thread (see `_SwitchInterval`)."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.004)

    async def idle() -> float:
        for _ in range(2000):  # a worker goes idle just after settling its last request
            if sys.getswitchinterval() == 0.004:
                break
            await asyncio.sleep(0.001)
        return sys.getswitchinterval()

    async def main():
        async with HFBackend(model, **FAST) as first, HFBackend(model, **FAST) as second:
            # each engine's cache first (on CUDA its allocation captures graphs: the long row could end meanwhile)
            await asyncio.gather(first.generate(PROMPTS[0], GREEDY), second.generate(PROMPTS[1], GREEDY))
            seen = [await idle()]
            passes = first.stats["decode_passes"]
            long = asyncio.create_task(first.generate(PROMPTS[0], SamplingParams(max_new_tokens=400)))
            while first.stats["decode_passes"] < passes + 3:
                await asyncio.sleep(0.001)
            seen.append(sys.getswitchinterval())
            await second.generate(PROMPTS[1], GREEDY)  # the second goes idle: the first still serves
            seen.append(sys.getswitchinterval())
            await long
            return seen + [await idle()]

    try:
        assert run(main()) == [0.004, SERVING_SWITCH_INTERVAL_S, SERVING_SWITCH_INTERVAL_S, 0.004]
        assert sys.getswitchinterval() == 0.004  # both closed
    finally:
        sys.setswitchinterval(saved)


def test_hundreds_of_rows_joining_leaving_and_compacting_get_what_they_get_alone(model):
    """300 requests in three waves onto 256 slots (a GPU run crashed at this size): prompts of 1-60 tokens, 1-40
    new tokens, greedy and seeded rows, stop tokens, cancellations, the third wave waiting for free slots, slots
    compacted as rows leave. Every row gets the tokens the transformers path gives it, with overlapped steps and
    one step at a time; every slot ends free."""
    rng = random.Random(7)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 60))] for _ in range(300)]
    params = [SamplingParams(temperature=0 if i % 4 == 0 else 1.0, max_new_tokens=rng.randint(1, 40), seed=i,
                             stop_token_ids=(5,) if i % 3 == 0 else ()) for i in range(300)]
    doomed = set(range(7, 300, 23))

    async def main(**path):
        # arrivals admitted at the next step boundary: the third wave takes the slots as they free up
        async with HFBackend(model, max_batch_size=256, max_context_len=128, **path) as backend:
            tasks = []
            for wave in range(0, 300, 100):
                tasks += [asyncio.create_task(backend.generate(p, q)) for p, q in
                          zip(prompts[wave:wave + 100], params[wave:wave + 100])]
                passes = backend.stats["decode_passes"]
                while backend.stats["decode_passes"] < passes + 3:
                    await asyncio.sleep(0.001)
                for i in doomed & set(range(wave, wave + 100)):
                    tasks[i].cancel()
            gens = await asyncio.gather(*tasks, return_exceptions=True)
            lengths = await backend._in_worker(backend._engine.runner.slot_lengths) if backend.fast_path else []
            return gens, dict(backend.stats), lengths

    fast, stats, lengths = run(main(**FAST), timeout=300)
    serial, serial_stats, serial_lengths = run(main(**FAST, overlap_steps=False), timeout=300)
    reference, _, _ = run(main(**TRANSFORMERS), timeout=300)
    finished = [i for i in range(300) if i not in doomed]
    assert_same([fast[i] for i in finished], [reference[i] for i in finished])
    assert_same([serial[i] for i in finished], [reference[i] for i in finished])
    assert all(isinstance(fast[i], asyncio.CancelledError) or fast[i].finish_reason in ("stop", "length")
               for i in doomed)  # cancelled, or done before the cancellation
    assert stats["compaction_moves"] > 0 and stats["prefill_passes"] >= 4 and stats["padded_rows"] > 0
    assert stats["wasted_rows"] > 0 and serial_stats["wasted_rows"] <= len(doomed)  # serial: only cancellations
    assert lengths == serial_lengths == [0] * 256
