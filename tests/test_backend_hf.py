"""HFBackend on a tiny random-init Qwen2 model on CPU: outputs, logprobs, batching, seeds, weight sharing, errors —
on both of its paths (the fast slot-cache path and transformers' forward; `engine` fixture)."""

from __future__ import annotations

import asyncio
import math
import os
import time

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from agents.backend import BackendError, GenerationError, SamplingParams, counted
from agents.hf_backend import HFBackend, new_stats
from agents.scripted import ScriptedBackend
from mt_env.turn import ModelTurn

VOCAB = 512
DEVICE = os.environ.get("MT_ENV_TEST_DEVICE", "cpu")  # e.g. "cuda" to run these tests on a GPU
GREEDY = SamplingParams(temperature=0, max_new_tokens=12)
#: HFBackend arguments of each path: the fast path forced on (CUDA graphs where there is CUDA; its decode step not
#: compiled: these tests are about scheduling, tests/test_engine.py runs the compiled step), transformers' forward
PATHS = {"fast": dict(fast_path=True, cuda_graphs=DEVICE == "cuda", compile=False),
         "transformers": dict(fast_path=False)}


def tiny_model(seed: int = 0, vocab: int = VOCAB) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)
    return Qwen2ForCausalLM(config).to(DEVICE).eval()


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """Tiny matmuls on a small shared CPU run many times faster on one intra-op thread than on threads that wait
    for busy cores (tests/test_fast_decode.py imports this fixture too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(params=list(PATHS))
def engine(request) -> dict:
    """HFBackend keyword arguments choosing one of its two paths."""
    return PATHS[request.param]


#: scales `run`'s timeout, for slow instrumented runs (compute-sanitizer: benchmarks/run_gpu.sh sanitize)
TIMEOUT_SCALE = float(os.environ.get("MT_ENV_TEST_TIMEOUT_SCALE", "1"))


def run(coro, timeout: float = 30):
    """Run `coro` with a timeout, so a hanging worker fails the test instead of blocking the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout * TIMEOUT_SCALE))


def passes(backend: HFBackend) -> int:
    """Forward passes the backend ran so far (a CUDA graph replay runs no Python hook: count with the backend's
    stats, which tests/test_fast_decode.py checks against a hook on the LM head)."""
    return backend.stats["prefill_passes"] + backend.stats["decode_passes"]


def break_mlp(model, forward) -> None:
    """Replace the first layer's MLP forward (both paths call it), e.g. with one that raises."""
    model.model.layers[0].mlp.forward = forward


def restore_mlp(model) -> None:
    del model.model.layers[0].mlp.forward  # the class's forward again


def greedy_by_hand(model, prompt: list[int], n: int) -> list[int]:
    """Argmax decoding with full forward passes and no KV cache: the reference the backend must match."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -1].argmax()))
    return ids[len(prompt):]


def logprobs_by_hand(model, prompt: list[int], ids: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of `ids` after `prompt`, from one forward pass over the whole sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids], device=model.device)).logits[0, len(prompt) - 1:-1]
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, -1).gather(1, torch.tensor(ids, device=model.device)[:, None]).squeeze(1).tolist()


PROMPTS = [[1, 2, 3, 4], [7] * 9, [300, 5], list(range(20, 37))]


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
