"""HFBackend's batching, on both of its paths (`engine` fixture), with a tiny random-init Qwen2 model on CPU:
concurrent requests share forward passes, a trickle of requests shares one prefill, short requests resolve first,
rows ending at one step wake the event loop once, late requests join a running batch (also where the cache cannot
be merged: a sliding-window layer), and `max_batch_size` bounds the rows in flight."""

from __future__ import annotations

import asyncio

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from agents.backend import SamplingParams
from agents.hf_backend import HFBackend

from .backend_hf_fixtures import (
    DEVICE,
    GREEDY,
    PROMPTS,
    VOCAB,
    engine_fixture,  # noqa: F401  (a fixture)
    greedy_by_hand,
    model_fixture,  # noqa: F401  (a fixture)
    one_cpu_thread,  # noqa: F401  (one intra-op thread for tiny matmuls)
    passes,
    run,
)


# ------------------------------------------------------------------------------------------------- batching
def test_concurrent_requests_share_forward_passes(model, engine):
    lengths = [2, 4, 6, 8, 10, 12, 14, 16]

    async def main():
        async with HFBackend(model, gather_window_s=0.05, **engine) as backend:
            gens = await asyncio.gather(*(
                backend.generate([5 + i] * (3 + i), SamplingParams(max_new_tokens=n, seed=i))
                for i, n in enumerate(lengths)))
            return gens, passes(backend)

    gens, calls = run(main())
    assert [len(g.ids) for g in gens] == lengths
    # One prefill and one decode step per further token of the longest request, shared by all rows (a straggler
    # missing the gathering window would add a prefill); one request at a time would need sum(lengths) = 72.
    assert calls <= max(lengths) + 2


def test_requests_trickling_in_to_an_idle_worker_share_one_prefill(model, engine):
    """Eight requests 50 ms apart (350 ms in all), each within the 200 ms gathering window of the one before: the
    worker waits for the quiet window, not for a window after the first, and prefills them together."""

    async def main():
        async with HFBackend(model, gather_window_s=0.2, **engine) as backend:
            tasks = []
            for prompt in PROMPTS * 2:
                tasks.append(asyncio.create_task(backend.generate(prompt, GREEDY)))
                await asyncio.sleep(0.05)
            await asyncio.gather(*tasks)
            return backend.stats["prefill_passes"]

    assert run(main()) == 1


def test_short_request_resolves_before_long_one(model, engine):
    async def main():
        async with HFBackend(model, **engine) as backend:
            long = asyncio.create_task(backend.generate(PROMPTS[0], SamplingParams(max_new_tokens=80, seed=0)))
            short = asyncio.create_task(backend.generate(PROMPTS[1], SamplingParams(max_new_tokens=3, seed=1)))
            g_short = await short
            long_was_done = long.done()
            g_long = await long
            return g_short, long_was_done, g_long

    g_short, long_was_done, g_long = run(main())
    assert not long_was_done
    assert len(g_short.ids) == 3 and len(g_long.ids) == 80


def test_requests_ending_at_one_step_wake_their_event_loop_once(model, engine):
    """The requests that end at one decode step settle in one callback of the caller's event loop (a turn boundary
    ends a whole batch: one wake-up, not one per request, each competing with the worker for the interpreter
    lock), and every caller gets its own turn."""
    prompts = PROMPTS * 2

    async def main():
        loop = asyncio.get_running_loop()
        wakeups = []
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted_call(callback, *args, **kwargs):
            wakeups.append(callback)
            return call_soon_threadsafe(callback, *args, **kwargs)

        async with HFBackend(model, **engine) as backend:
            loop.call_soon_threadsafe = counted_call
            try:
                turns = await backend.generate_many(prompts, GREEDY.replace(max_new_tokens=5))
            finally:
                del loop.call_soon_threadsafe
            return turns, len(wakeups), backend.stats["prefill_passes"]

    turns, wakeups, prefill_passes = run(main())
    assert prefill_passes < len(prompts)  # (they share passes: one request per wake-up would be more wake-ups)
    assert wakeups <= prefill_passes  # the rows of a pass end at one step: one wake-up for them
    for prompt, turn in zip(prompts, turns):
        assert turn.ids == greedy_by_hand(model, prompt, 5) and turn.finish_reason == "length"


def test_requests_arriving_mid_batch_join_it_and_decode_correctly(model, engine):
    """Late requests start at the next step, share the running batch's passes, and their outputs are exactly
    what argmax decoding without cache gives (for prompts both longer and shorter than the running cache)."""
    long_prompt, late_prompts = [3, 1, 4, 1], [list(range(40, 70)), [9, 9]]

    async def main():
        async with HFBackend(model, **engine) as backend:
            long = asyncio.create_task(backend.generate(long_prompt, GREEDY.replace(max_new_tokens=60)))
            while passes(backend) < 6:
                await asyncio.sleep(0.001)
            late = await asyncio.gather(*(backend.generate(p, GREEDY.replace(max_new_tokens=4)) for p in late_prompts))
            long_was_done = long.done()
            return await long, late, long_was_done, passes(backend)

    g_long, late, long_was_done, calls = run(main())
    assert not long_was_done
    assert g_long.ids == greedy_by_hand(model, long_prompt, 60)
    for prompt, g in zip(late_prompts, late):
        assert g.ids == greedy_by_hand(model, prompt, 4)
    assert calls <= 60 + 2  # the late rows cost at most their prefill passes on top of the long request's 60


def test_sliding_window_cache_keeps_late_requests_correct():
    """Caches that cannot be merged (a sliding-window layer) run late requests as a batch of their own."""
    torch.manual_seed(7)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, use_sliding_window=True, sliding_window=6,
                         max_window_layers=1)
    sliding = Qwen2ForCausalLM(config).to(DEVICE).eval()
    lengths = [3, 12, 7, 9]

    async def main():
        async with HFBackend(sliding) as backend:
            long = asyncio.create_task(backend.generate([3, 1, 4, 1], GREEDY.replace(max_new_tokens=30)))
            await asyncio.sleep(0.01)
            late = await asyncio.gather(*(backend.generate(p, GREEDY.replace(max_new_tokens=n))
                                          for p, n in zip(PROMPTS, lengths)))
            return await long, late, backend.fast_path_reason

    long, late, reason = run(main())
    assert reason.startswith("off") and "sliding-window" in reason  # the fast path does not serve this module
    assert long.ids == greedy_by_hand(sliding, [3, 1, 4, 1], 30)
    for prompt, n, g in zip(PROMPTS, lengths, late):
        assert g.ids == greedy_by_hand(sliding, prompt, n)


def test_max_batch_size_bounds_rows_in_flight(model, engine):
    async def main():
        async with HFBackend(model, max_batch_size=2, **engine) as backend:
            return await asyncio.gather(*(backend.generate(p, GREEDY.replace(max_new_tokens=5)) for p in PROMPTS))

    for prompt, g in zip(PROMPTS, run(main())):
        assert g.ids == greedy_by_hand(model, prompt, 5)
