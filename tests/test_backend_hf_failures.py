"""HFBackend's failures, on both of its paths (`engine` fixture), with a tiny random-init Qwen2 model on CPU: a
model error fails the pending requests (in prefill or decoding) and the backend recovers; bad prompts and stop
tokens are rejected clearly; closing aborts running requests; a cancelled request or submitted future leaves the
others undisturbed; `submit` reaches the worker at once."""

from __future__ import annotations

import asyncio
import time

import pytest

from agents.backend import BackendError, GenerationError, counted
from agents.hf_backend import HFBackend

from .backend_hf_fixtures import (
    GREEDY,
    PROMPTS,
    VOCAB,
    break_mlp,
    engine_fixture,  # noqa: F401  (a fixture)
    greedy_by_hand,
    model_fixture,  # noqa: F401  (a fixture)
    one_cpu_thread,  # noqa: F401  (one intra-op thread for tiny matmuls)
    passes,
    restore_mlp,
    run,
    tiny_model,
)


# ------------------------------------------------------------------------------------------------- failures
def test_model_error_fails_every_pending_request_then_recovers(engine):
    model = tiny_model(seed=3)

    def broken_forward(*args, **kwargs):
        raise RuntimeError("boom: CUDA out of memory (simulated)")

    async def main():
        async with HFBackend(model, **engine) as backend:
            break_mlp(model, broken_forward)
            results = await asyncio.gather(*(backend.generate(p, GREEDY) for p in PROMPTS), return_exceptions=True)
            restore_mlp(model)
            recovered = await backend.generate(PROMPTS[0], GREEDY)
            return results, recovered

    results, recovered = run(main(), timeout=20)
    assert all(isinstance(r, GenerationError) for r in results)
    assert "boom" in str(results[0]) and "prefill" in str(results[0])
    assert recovered.ids == greedy_by_hand(model, PROMPTS[0], 12)


def test_error_during_decoding_fails_the_batch_without_hanging(engine):
    model = tiny_model(seed=4)
    original, calls = model.model.layers[0].mlp.forward, [0]

    def fails_on_third_call(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("boom at step 3")
        return original(*args, **kwargs)

    async def main():
        async with HFBackend(model, **engine) as backend:
            await backend.resume_memory()  # the cache first: on CUDA that captures the lone prefill graphs (calls)
            break_mlp(model, fails_on_third_call)  # called once per pass (a graph capture warms up with calls)
            return await asyncio.gather(*(backend.generate(p, GREEDY) for p in PROMPTS[:2]), return_exceptions=True)

    results = run(main(), timeout=20)
    assert all(isinstance(r, GenerationError) and "decoding" in str(r) for r in results)


@pytest.mark.parametrize("prompt, message", [
    ([], "empty"), ([1, VOCAB], "outside the vocabulary"), ([-1, 2], "outside the vocabulary"),
    ([1.0, 2], "integers"), ("hello", "not text"), (list(range(1, 65)), "no room"),
])
def test_bad_prompts_are_rejected_clearly(model, prompt, message, engine):
    async def main():
        async with HFBackend(model, max_context_len=64, **engine) as backend:
            await backend.generate(prompt, GREEDY)

    with pytest.raises(ValueError, match=message):
        run(main())


def test_stop_token_outside_vocabulary_is_rejected(model, engine):
    async def main():
        async with HFBackend(model, **engine) as backend:
            await backend.generate([1, 2], GREEDY.replace(stop_token_ids=(VOCAB + 5,)))

    with pytest.raises(ValueError, match="stop token"):
        run(main())


def test_close_aborts_running_requests_and_rejects_new_ones(model, engine):
    async def main():
        backend = HFBackend(model, **engine)
        running = asyncio.create_task(backend.generate(PROMPTS[0], GREEDY.replace(max_new_tokens=400)))
        while passes(backend) < 3:
            await asyncio.sleep(0.001)
        await backend.close()
        aborted = await running
        with pytest.raises(BackendError, match="closed"):
            await backend.generate(PROMPTS[0], GREEDY)
        with pytest.raises(BackendError, match="closed"):
            await backend.release_memory()
        return aborted, backend

    aborted, backend = run(main())
    assert aborted.finish_reason == "abort"
    assert 0 < len(aborted.ids) < 400 and len(aborted.logprobs) == len(aborted.ids)
    assert not backend._thread.is_alive()


def test_cancelled_request_does_not_disturb_the_others(model, engine):
    async def main():
        async with HFBackend(model, **engine) as backend:
            doomed = asyncio.create_task(backend.generate(PROMPTS[0], GREEDY.replace(max_new_tokens=300)))
            kept = asyncio.create_task(backend.generate(PROMPTS[1], GREEDY))
            await asyncio.sleep(0.02)
            doomed.cancel()
            return await kept

    assert run(main()).ids == greedy_by_hand(model, PROMPTS[1], 12)


def test_a_submitted_request_reaches_the_worker_before_the_event_loop_runs_again(model, engine):
    """`submit` hands the request to the worker at once: the worker prefills it while the event loop's thread is
    still in the code that submitted it (a burst of requests read in one callback reaches the engine as it is read,
    not at the loop's next pass, as a task's first step would)."""
    async def main():
        async with HFBackend(model, **engine) as backend:
            before = backend.stats["prefill_passes"]
            future = backend.submit(PROMPTS[0], GREEDY)
            deadline = time.monotonic() + 20  # no await until then: this thread holds the event loop
            while backend.stats["prefill_passes"] == before and time.monotonic() < deadline:
                time.sleep(0.001)
            return backend.stats["prefill_passes"] - before, await future

    prefilled, turn = run(main())
    assert prefilled == 1
    assert turn.ids == greedy_by_hand(model, PROMPTS[0], 12)


def test_cancelling_a_submitted_future_drops_its_row(model, engine):
    async def main():
        async with HFBackend(model, **engine) as backend:
            doomed = backend.submit(PROMPTS[0], GREEDY.replace(max_new_tokens=300))
            kept = backend.submit(PROMPTS[1], GREEDY)
            while passes(backend) < 3:
                await asyncio.sleep(0.001)
            doomed.cancel()
            turn = await kept
            with counted(backend) as later:
                await backend.generate(PROMPTS[2], GREEDY)
            return turn, later

    turn, later = run(main())
    assert turn.ids == greedy_by_hand(model, PROMPTS[1], 12)
    assert later["decoded_rows"] == later["decode_passes"] > 0  # one row a step: the cancelled one left
