"""The paged engine (`agents.engine`) against HFBackend's transformers path, on tiny random Qwen2, Qwen3 and Llama
models: same tokens and logprobs, rows joining and leaving, slot compaction and reuse, cancellation, memory
release, reallocated weights, fallbacks; overlapped steps (the tokens of one step at a time, the wasted row-steps
counted) and the worker's switch interval; the sampler's arithmetic; property tests of the slot bookkeeping. The
prefix cache, the block pool and preemption have their own file (tests/test_prefix_cache.py).

On CPU the decode step runs eagerly (the very functions a CUDA graph captures), and compiled by Inductor in the
tests that say so; with ``MT_ENV_TEST_DEVICE=cuda`` the same tests run captured in CUDA graphs, and the equality
tests run the step as the fast path does by default there: compiled too (the other tests are about scheduling and
bookkeeping: they skip the compilations, and the run takes a minute or two).
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import threading
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from hypothesis import assume, given
from hypothesis import strategies as st
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from agents import compiling
from agents.engine import EngineConfig, decoder_layout, new_stats
from agents.engine import config as knobs
from agents.engine.blocks import BlockPool
from agents.engine.graphs import CAPTURE_ON_USE, stand_in
from agents.engine.layers import COMPILED_FUNCTIONS, STEP_FUNCTIONS
from agents.engine.model_runner import ModelRunner, PrefillRow, prefill_graph_key, prefill_width
from agents.engine.sampler import SAMPLING_MODES, RowSampling, sample_tokens
from agents.engine.scheduler import SlotTable, batch_buckets, bucket_for
from agents.backend import BackendError, GenerationError, SamplingParams
from agents.hf_backend import SERVING_SWITCH_INTERVAL_S, HFBackend

from .test_backend_hf import DEVICE, GREEDY, VOCAB, greedy_by_hand, one_cpu_thread, run, tiny_model  # noqa: F401

FAST = dict(fast_path=True, cuda_graphs=DEVICE == "cuda", compile=False)
DEFAULT_FAST = dict(fast_path=True)  #: as HFBackend runs it by default: on CUDA compiled and in CUDA graphs
TRANSFORMERS = dict(fast_path=False)
LOGPROB_TOL = 1e-5 if DEVICE == "cpu" else 1e-4
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=512)


def build(arch: str, seed: int = 0, **overrides):
    """A tiny random model of `arch` (Qwen3: q/k norms; Llama: 4 query heads per KV head)."""
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE | dict(num_key_value_heads=2) | overrides))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPE | dict(num_key_value_heads=2, head_dim=16) | overrides))
    else:
        model = LlamaForCausalLM(LlamaConfig(**SHAPE | dict(num_key_value_heads=1) | overrides))
    return model.to(DEVICE).eval()


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama"])
def arch_model(request):
    return build(request.param)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


PROMPTS = [[1, 2, 3, 4], [7] * 9, [300, 5], list(range(20, 57)), [11], [4, 8, 15, 16, 23, 42], [99] * 3,
           list(range(100, 120))]


async def generate_together(model, prompts, params, **kwargs):
    """Generate for `prompts` concurrently on one backend; returns the generations and the backend's stats."""
    async with HFBackend(model, **kwargs) as backend:
        gens = await asyncio.gather(*(backend.generate(p, q) for p, q in zip(prompts, params)))
        return gens, dict(backend.stats)


def each_alone(model, prompts, params):
    """Each request generated alone on the transformers path: what it must get in any batch."""
    return [run(generate_together(model, [p], [q], **TRANSFORMERS))[0][0] for p, q in zip(prompts, params)]


def assert_same(fast, reference):
    for f, r in zip(fast, reference, strict=True):
        assert f.ids == r.ids and f.finish_reason == r.finish_reason
        assert f.logprobs == pytest.approx(r.logprobs, abs=LOGPROB_TOL)


MIXES = {
    "greedy": [SamplingParams(temperature=0, max_new_tokens=24)] * len(PROMPTS),
    "sampled": [SamplingParams(temperature=1.0, max_new_tokens=24, seed=i) for i in range(len(PROMPTS))],
    "truncated": [SamplingParams(temperature=0.7, top_p=0.9, top_k=5 if i % 2 else -1, max_new_tokens=24, seed=i)
                  for i in range(len(PROMPTS))],
    "mixed": [SamplingParams(temperature=0 if i % 3 == 0 else 1.3, max_new_tokens=4 + 3 * i, seed=i,
                             stop_token_ids=(7,)) for i in range(len(PROMPTS))],
}


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


# ------------------------------------------------------------------------------------------------- memory, limits
def test_release_and_resume_memory(model):
    layout = decoder_layout(model)
    blocks = 4 * 512 // 16 + 1  # the default pool: 4 sequences x the 512-token context, and the null block
    expected = 2 * len(layout.layers) * blocks * 16 * layout.kv_heads * layout.head_dim * 4  # float32

    async def main():
        async with HFBackend(model, max_batch_size=4, **FAST) as backend:
            sizes = [backend.kv_cache_bytes]  # allocated on first use
            await backend.resume_memory()
            sizes.append(backend.kv_cache_bytes)
            first = await backend.generate(PROMPTS[0], SamplingParams(max_new_tokens=10, seed=1))
            await backend.release_memory()
            sizes.append(backend.kv_cache_bytes)
            running = asyncio.create_task(backend.generate(PROMPTS[1], SamplingParams(max_new_tokens=400)))
            while backend.stats["decode_passes"] < 15:
                await asyncio.sleep(0.001)
            with pytest.raises(BackendError, match="in flight"):
                await backend.release_memory()
            await running
            again = await backend.generate(PROMPTS[0], SamplingParams(max_new_tokens=10, seed=1))
            return sizes + [backend.kv_cache_bytes], first, again

    sizes, first, again = run(main())
    assert sizes == [0, expected, 0, expected]
    assert again.ids == first.ids and again.logprobs == first.logprobs


def test_max_context_len_bounds_prompt_and_generation(model):
    async def main():
        async with HFBackend(model, max_context_len=16, **FAST) as backend:
            assert backend.max_context_len == 16
            with pytest.raises(ValueError, match="no room.*16 tokens"):
                await backend.generate(list(range(1, 17)), SamplingParams(max_new_tokens=4))
            return await backend.generate(list(range(1, 11)), SamplingParams(temperature=0, max_new_tokens=20))

    g = run(main())
    assert g.finish_reason == "length" and g.ids == greedy_by_hand(model, list(range(1, 11)), 6)


@pytest.mark.parametrize("change", ["assign", "dtype"])
def test_reallocated_parameters_are_noticed(change):
    """Optimizer steps update parameters in place (the graphs keep reading them); `load_state_dict(assign=True)`
    or a dtype change gives new tensors: the engine notices (graphs captured again, cache re-made) and uses them."""
    model = tiny_model(seed=9)

    async def main():
        async with HFBackend(model, **FAST) as backend:
            before = await backend.generate(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=12))
            with torch.no_grad():
                model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))  # in place: not a reallocation
            mid = await backend.generate(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=12))
            counts = [backend.stats["module_reallocations"]]
            if change == "assign":
                fresh = {k: torch.randn_like(v) * 0.05 for k, v in model.state_dict().items()}
                model.load_state_dict(fresh, assign=True)
            else:
                model.to(torch.float64)
            after = await backend.generate(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=12))
            return before, mid, after, counts + [backend.stats["module_reallocations"]]

    before, mid, after, counts = run(main())
    assert counts == [0, 1]
    assert mid.ids != before.ids
    assert after.ids == greedy_by_hand(model, PROMPTS[0], 12)


# ------------------------------------------------------------------------------------------------- fallbacks
def unsupported_models():
    torch.manual_seed(0)
    return {
        "sliding-window": Qwen2ForCausalLM(Qwen2Config(**SHAPE, num_key_value_heads=2, use_sliding_window=True,
                                                       sliding_window=6, max_window_layers=1)),
        "RoPE type 'dynamic'": build("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                "rope_theta": 10000.0}),
        "model type 'gpt2'": GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2,
                                                        bos_token_id=0, eos_token_id=0)),
    }


@pytest.mark.parametrize("reason", ["sliding-window", "RoPE type 'dynamic'", "model type 'gpt2'"])
def test_unsupported_modules_fall_back_with_the_reason(reason):
    module = unsupported_models()[reason].to(DEVICE).eval()

    async def main():
        async with HFBackend(module, max_batch_size=2) as auto:
            g = await auto.generate([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=5))
            return auto.fast_path, auto.fast_path_reason, g

    fast, why, g = run(main())
    assert not fast and why.startswith("off: ") and reason in why
    assert g.ids == greedy_by_hand(module, [1, 2, 3], 5)
    with pytest.raises(ValueError, match=f"fast_path=True, but the module cannot take it: .*{reason}"):
        HFBackend(module, fast_path=True)


def test_auto_takes_the_fast_path_on_cuda_only(model):
    async def main():
        async with HFBackend(model) as backend:
            return backend.fast_path, backend.fast_path_reason

    fast, why = run(main())
    assert fast == (DEVICE == "cuda")
    assert why.startswith("on: ") if fast else "fast_path='auto' takes it on CUDA only" in why


@pytest.mark.parametrize("kwargs, message", [(dict(fast_path="yes"), "fast_path"),
                                             (dict(max_context_len=1), "max_context_len"),
                                             (dict(block_size=0), "block_size"),
                                             (dict(kv_blocks=1), "kv_blocks"),
                                             (dict(attention="flash"), "attention"),
                                             (dict(max_cache_len=64), "max_cache_len")])
def test_bad_fast_path_arguments_are_rejected(model, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        HFBackend(model, **kwargs)


# ------------------------------------------------------------------------------------------------- the sampler
def sample(probs, uniform, temperature=1.0, top_k=None, top_p=None, mode="sample"):
    logits = torch.tensor([probs]).log()
    vocab = len(probs)
    return sample_tokens(logits, torch.tensor([temperature]), torch.tensor([uniform], dtype=torch.float64),
                         torch.tensor([top_k or vocab]), torch.tensor([top_p or math.inf]), mode)


@pytest.mark.parametrize("uniform, token", [(0.05, 0), (0.15, 1), (0.35, 2), (0.61, 3), (0.999, 3)])
def test_inverse_cdf_picks_the_token_whose_interval_holds_the_uniform(uniform, token):
    tokens, logprobs = sample([0.1, 0.2, 0.3, 0.4], uniform)
    assert tokens.tolist() == [token]
    assert logprobs.item() == pytest.approx(math.log([0.1, 0.2, 0.3, 0.4][token]), abs=1e-6)


@pytest.mark.parametrize("uniform, token", [(0.3, 2), (0.42, 2), (0.43, 3), (0.999, 3)])
def test_truncation_samples_the_kept_tokens_in_vocabulary_order_and_reports_untruncated_logprobs(uniform, token):
    # top-2 keeps tokens 2 and 3 (p 0.3, 0.4): cdf 0, 0, 0.3, 0.7 in vocabulary order; the uniform scales to 0.7
    tokens, logprobs = sample([0.1, 0.2, 0.3, 0.4], uniform, top_k=2, mode="truncate")
    assert tokens.tolist() == [token]
    assert logprobs.item() == pytest.approx(math.log([0.1, 0.2, 0.3, 0.4][token]), abs=1e-6)


def test_greedy_rows_take_the_argmax_whatever_their_uniform():
    for mode in ("greedy", "sample", "truncate"):
        tokens, logprobs = sample([0.1, 0.5, 0.4], 0.01, temperature=0.0, mode=mode)
        assert tokens.tolist() == [1] and logprobs.item() == pytest.approx(math.log(0.5), abs=1e-6)


def test_nan_logits_stay_in_the_vocabulary_and_show_as_nan_logprobs():
    logits = torch.tensor([[0.0, 1.0, 2.0], [math.nan, 0.0, 0.0]])
    for mode in ("sample", "truncate"):
        tokens, logprobs = sample_tokens(logits, torch.ones(2), torch.tensor([0.9, 0.9], dtype=torch.float64),
                                         torch.tensor([3, 1]), torch.tensor([math.inf, math.inf]), mode)
        assert all(0 <= t < 3 for t in tokens.tolist())
        assert not math.isnan(logprobs[0].item()) and math.isnan(logprobs[1].item())


def test_row_sampling_draws_only_for_sampled_rows():
    import random

    params = [SamplingParams(temperature=0), SamplingParams(seed=1, top_k=4), SamplingParams(top_p=0.5)]
    generators = [random.Random(0), random.Random(1), random.Random(2)]
    drawn = RowSampling.draw(params, generators, vocab=10)
    assert drawn.uniform == [0.0, random.Random(1).random(), random.Random(2).random()]
    assert drawn.top_k == [10, 4, 10] and drawn.top_p == [math.inf, math.inf, 0.5] and drawn.mode == "truncate"
    assert generators[0].random() == random.Random(0).random()  # the greedy row's generator was not touched


# ------------------------------------------------------------------------------------------------- properties
ops = st.lists(st.one_of(st.tuples(st.just("acquire"), st.integers(1, 40)),
                         st.tuples(st.just("release"), st.integers(0, 10**6)),
                         st.tuples(st.just("compact"), st.just(0))), max_size=40)


@given(size=st.integers(1, 300), ops=ops)
def test_slot_table_invariants(size, ops):
    table, rows, counter = SlotTable(size), {}, 0  # rows: row id -> slot, as the table should have it
    for op, arg in ops:
        if op == "acquire":
            n = min(arg, table.free_count())
            free_before = sorted(set(range(size)) - set(rows.values()))
            new = list(range(counter, counter + n))
            counter += n
            slots = table.acquire(new)
            assert slots == free_before[:n]  # the lowest free slots, in order
            rows.update(zip(new, slots))
        elif op == "release" and rows:
            row = sorted(rows)[arg % len(rows)]
            table.release([rows.pop(row)])
        elif op == "compact":
            before = dict(rows)
            moves = table.compact()
            target = bucket_for(len(rows), table.buckets)
            for src, dst in moves:
                assert src >= target > dst and dst not in before.values()
                row = next(r for r, s in before.items() if s == src)
                rows[row] = dst
            assert table.bucket() <= target
        held = table.occupied()
        assert {row: slot for slot, row in held} == rows  # no row lost, none held twice, the table agrees
        assert len({slot for slot, _ in held}) == len(held)


@given(size=st.integers(1, 1200))
def test_batch_buckets_bound_the_padding(size):
    buckets = batch_buckets(size)
    assert buckets == sorted(set(buckets)) and buckets[-1] == size
    for n in range(1, size + 1, max(1, size // 50)):
        b = bucket_for(n, buckets)
        assert n <= b <= size and b - n <= (32 if n <= 256 else 64)


# ------------------------------------------------------------------------------------------------- the model runner
BLOCK = 4  #: the runner tests' block size: a 96-position context spans 24 blocks


def make_runner(model, slots: int = 8, context: int = 96, compile: bool = False, cuda_graphs: bool = False):
    """A model runner of `slots` rows and `context` positions, with a pool that gives every row its whole context
    (the tests' steps then need no new blocks)."""
    config = EngineConfig(max_seqs=slots, max_context_len=context, block_size=BLOCK, compile=compile,
                          cuda_graphs=cuda_graphs)
    blocks = slots * context // BLOCK + 1
    runner = ModelRunner(model, decoder_layout(model), config, max_context_len=context, num_blocks=blocks,
                         vocab_size=VOCAB, stats=new_stats())
    return runner, BlockPool(blocks, BLOCK)


def prefill_rows(runner, pool, slots, prompts, params=None, generators=None):
    """Prefill `prompts` into `slots` (each with blocks for the whole context); returns the rows, and the tokens and
    logprobs sampled (greedy unless `params`)."""
    params = params or [SamplingParams(temperature=0)] * len(prompts)
    rows = [PrefillRow(slot, pool.allocate(pool.blocks_for(runner.max_context_len)), prompt, 0)
            for slot, prompt in zip(slots, prompts)]
    sampling = RowSampling.draw(params, generators or [None] * len(prompts), VOCAB)
    with torch.no_grad():
        return rows, runner.prefill(rows, sampling)


def row_kv(runner, row: PrefillRow, length: int) -> list[torch.Tensor]:
    """A row's K and V of every layer over its first `length` positions."""
    positions = [row.blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)]
    return [t.clone() for layer in range(len(runner.layout.layers)) for t in runner.kv(layer, positions)]


def step(runner, rows, need, uniforms, mode):
    return runner.collect(runner.launch(rows, need, uniforms, mode))


@pytest.fixture(scope="module")
def small_engine_model():
    return build("qwen2", seed=3)


@given(lengths=st.lists(st.integers(1, 24), min_size=1, max_size=8), data=st.data())
def test_compaction_moves_each_rows_position_and_block_table_and_no_kv(small_engine_model, lengths, data):
    runner, pool = make_runner(small_engine_model, context=32)
    table = SlotTable(8)
    ids = list(range(len(lengths)))
    slots = table.acquire(ids)
    prompts = [[(7 * r + j) % VOCAB for j in range(n)] for r, n in zip(ids, lengths)]
    rows, _ = prefill_rows(runner, pool, slots, prompts)
    leaving = data.draw(st.lists(st.sampled_from(ids), unique=True, max_size=len(ids) - 1))
    table.release([slots[r] for r in leaving])
    runner.free([slots[r] for r in leaving])
    before = {r: row_kv(runner, rows[r], lengths[r]) for _, r in table.occupied()}
    moves = table.compact()
    counter = OpCounter()
    with counter:
        runner.move(moves)
    now = runner.slot_lengths()
    for slot, r in table.occupied():
        assert now[slot] == lengths[r]
        assert runner.block_table(slot)[:len(rows[r].blocks)] == list(rows[r].blocks)
        assert all(torch.equal(a, b) for a, b in zip(row_kv(runner, rows[r], lengths[r]), before[r]))
    held = {slot for slot, _ in table.occupied()}
    assert all(now[slot] == 0 and set(runner.block_table(slot)) == {0} for slot in range(8) if slot not in held)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run inside it."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_moving_and_clearing_slots_costs_the_same_ops_whatever_the_layer_count():
    """A slot move (compaction) and a clearing free run a fixed number of ops, not a few per layer: each op of the
    host's is a wait for the interpreter lock when the caller's event loop is busy (mid-rollout, as rows end)."""
    counts = []
    for layers in (2, 6):
        model = build("qwen2", seed=3, num_hidden_layers=layers)
        runner, pool = make_runner(model, context=32)
        rows, _ = prefill_rows(runner, pool, [5, 6], [[1, 2, 3], [4, 5]])
        counter = OpCounter()
        with counter:
            runner.move([(5, 0), (6, 1)])
            runner.free([0], zero_blocks=rows[0].blocks)
        counts.append(counter.ops)
        assert runner.slot_lengths()[:2] == [0, 2]
        assert all(torch.equal(t, torch.zeros_like(t)) for t in row_kv(runner, rows[0], 3))
    assert counts[0] == counts[1]


# ------------------------------------------------------------------------------------------------- compiled step
# Last in the file: these tests empty dynamo's caches (the tests before them reuse compiled code).
CPU_INDUCTOR = pytest.mark.skipif(DEVICE != "cpu", reason="the CPU run of Inductor (on CUDA the equality tests run "
                                                          "the compiled step)")


@pytest.fixture
def fresh_compilations(monkeypatch):
    """Dynamo's caches emptied (compiled code is shared by the whole process) and a registry of compiled functions
    of the test's own (a failed compilation must not leave later tests' steps eager)."""
    torch._dynamo.reset()
    monkeypatch.setattr(compiling, "_COMPILED", {})
    yield
    torch._dynamo.reset()


def prefilled(model, rows: int, slots: int, compile: bool = False, warm: bool = False):
    """A runner (96 positions) with `rows` of four prompts (3 to 20 tokens) prefilled into slots 0.., sampled with
    seeds 0..; returns it and the prefill's tokens and logprobs. `warm`: `ModelRunner.warm_buckets` first."""
    runner, pool = make_runner(model, slots=slots, compile=compile)
    if warm:
        runner.warm_buckets()
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(rows)]
    prompts = [[1, 2, 3], [4] * 9, [5] * 20, [6, 7]][:rows]
    _, first = prefill_rows(runner, pool, list(range(rows)), prompts, params, [random.Random(i) for i in range(rows)])
    return runner, first


def engine_steps(model, compile: bool, modes=("sample",), warm: bool = False) -> tuple[list, ModelRunner]:
    """Four rows prefilled, then 24 steps: batch bucket 4 (every slot), then 2; length buckets 16 to 48."""
    rng = random.Random(0)
    with torch.no_grad(), mock.patch.object(knobs, "LENGTH_STEP", 16):
        runner, first = prefilled(model, rows=4, slots=4, compile=compile, warm=warm)
        out = [first]
        for i in range(24):
            rows = 4 if i < 12 else 2
            need = max(runner.slot_lengths()[:rows]) + 1
            out.append(step(runner, rows, need, [rng.random() for _ in range(rows)], modes[i % len(modes)]))
    return out, runner


KEYS = st.tuples(st.integers(1, 300), st.integers(1, 4096), st.sampled_from(SAMPLING_MODES))


@given(key=KEYS, captured=st.sets(KEYS, max_size=12))
def test_a_stand_in_is_the_smallest_captured_bucket_covering_the_step(key, captured):
    """The graph that runs a step of `key` in its place: captured, the same mode, no fewer rows, no shorter; the
    smallest such (rows first), and None only when none covers it."""
    rows, length, mode = key
    covering = {k for k in captured if k[2] == mode and k[0] >= rows and k[1] >= length}
    chosen = stand_in(key, captured)
    if not covering:
        assert chosen is None
        return
    assert chosen in covering
    assert all((chosen[0], chosen[1]) <= (k[0], k[1]) for k in covering)


def test_a_step_run_by_a_larger_buckets_graph_gives_the_rows_what_their_own_bucket_gives(model):
    """What a stand-in runs: the step over more slots (free ones as padding) and a longer attended length. The
    live rows get the same tokens and logprobs, and the runner the same slot state, step after step."""
    def steps(extra_rows: int, extra_length: int):
        rng = random.Random(0)
        with torch.no_grad():
            runner, first = prefilled(model, rows=3, slots=8)
            out = [first]
            for _ in range(12):
                need = max(runner.slot_lengths()[:3]) + 1
                uniforms = [rng.random() for _ in range(4)] + [0.5] * extra_rows
                tokens, logprobs = step(runner, 4 + extra_rows, need + extra_length, uniforms, "sample")
                out.append((tokens[:3], logprobs[:3]))
        return out, runner.slot_lengths()[:3]

    own, own_lengths = steps(0, 0)
    larger, larger_lengths = steps(4, 40)
    assert own_lengths == larger_lengths
    for (ids, logprobs), (ref_ids, ref_logprobs) in zip(larger, own, strict=True):
        assert ids == ref_ids and logprobs == pytest.approx(ref_logprobs, abs=1e-5)


def test_warming_the_buckets_changes_no_rows_outputs_and_needs_free_slots(model):
    warmed, runner = engine_steps(model, compile=False, modes=SAMPLING_MODES, warm=True)
    plain, _ = engine_steps(model, compile=False, modes=SAMPLING_MODES)
    assert warmed == plain
    with pytest.raises(RuntimeError, match="before any row holds a slot"):
        runner.warm_buckets()  # its rows still hold their slots


def test_prefill_attention_never_allows_cudnn_and_decode_attention_is_torchs_choice(model, monkeypatch):
    """cuDNN's attention builds a plan per new shape while every decoding row waits, and a prefill pass's shapes
    change all the time: its SDPA calls run with cuDNN disabled. The decode step's few bucketed shapes keep torch's
    choice. (A prefill pass's mask is causal or boolean; the gather decode's is additive.)"""
    import torch.nn.functional as F

    seen = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, *args, **kwargs):
        mask = kwargs.get("attn_mask")
        prefill = kwargs.get("is_causal", False) or (mask is not None and mask.dtype == torch.bool)
        seen.append((prefill, torch.backends.cuda.cudnn_sdp_enabled()))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    cudnn_before = torch.backends.cuda.cudnn_sdp_enabled()
    engine_steps(model, compile=False)
    assert {enabled for is_prefill, enabled in seen if is_prefill} == {False}
    # (on CUDA the decode step's attention is the Triton kernel: no SDPA call)
    assert {enabled for is_prefill, enabled in seen if not is_prefill} <= {cudnn_before}
    assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn_before  # restored after each call


@given(rows=st.integers(1, 6), length=st.integers(1, 70), block_size=st.sampled_from([1, 4, 16]),
       seed=st.integers(0, 2**16))
def test_the_gather_decode_mask_is_a_view_whose_rows_are_padded_past_their_end(rows, length, block_size, seed):
    """cuDNN's SDPA read 4 bytes past a [1, 1, 1, 11] bfloat16 mask under compute-sanitizer: the gather decode's
    mask is the first `length` columns of rows `MASK_ALIGN` elements apart, and attention over it gives what a
    contiguous mask gives."""
    from agents.engine.attention import MASK_ALIGN, decode_attention, decode_inputs

    gen = torch.Generator().manual_seed(seed)
    at = torch.randint(0, length, (rows,), generator=gen)
    table = torch.randperm(rows * -(-length // block_size), generator=gen).reshape(rows, -1)
    read_at, mask = decode_inputs(table, at, length, block_size, "gather", torch.float32)
    assert mask.shape == (rows, 1, 1, length) and mask.stride(-1) == 1 and mask.stride(0) % MASK_ALIGN == 0
    assert mask.stride(0) >= length and mask.untyped_storage().nbytes() == rows * mask.stride(0) * 4
    hidden = torch.arange(length)[None, :] > at[:, None]
    assert torch.equal(mask[:, 0, 0], torch.zeros(rows, length).masked_fill(hidden, float("-inf")))
    keys, values = (torch.randn(table.numel() * block_size, 2, 8, generator=gen) for _ in range(2))
    q = torch.randn(rows, 4, 8, generator=gen)
    got = decode_attention(q, keys, values, (read_at, mask), 8 ** -0.5, "gather")
    expected = decode_attention(q, keys, values, (read_at, mask.contiguous()), 8 ** -0.5, "gather")
    assert torch.allclose(got, expected, atol=1e-6)


@CPU_INDUCTOR
def test_the_compiled_step_gives_the_eager_steps_output_with_one_compilation_for_all_layers_and_buckets(
        fresh_compilations, caplog):
    model = build("qwen3", num_hidden_layers=4)
    eager, _ = engine_steps(model, compile=False)
    with caplog.at_level("INFO", logger="agents.progress"):
        compiled, runner = engine_steps(model, compile=True)
    announced = {r.getMessage() for r in caplog.records if r.name == "agents.progress"}
    assert {f"compiling {fn.__name__} with Inductor" for fn in COMPILED_FUNCTIONS} <= announced  # a line per phase
    for (ids, logprobs), (ref_ids, ref_logprobs) in zip(compiled, eager, strict=True):
        assert ids == ref_ids and logprobs == pytest.approx(ref_logprobs, abs=1e-5)
    # one per function: not one per layer (4), batch bucket (2), length bucket (3) or prefill shape
    assert runner.stats["compilations"] == len(COMPILED_FUNCTIONS) and runner.compile_reason.startswith("on:")
    _, again = engine_steps(model, compile=True)
    assert again.stats["compilations"] == 0  # another runner reuses the compiled code


@CPU_INDUCTOR
def test_a_backend_with_a_compiled_step_gives_the_transformers_paths_output(fresh_compilations, arch_model):
    params = MIXES["mixed"]
    fast, stats = run(generate_together(arch_model, PROMPTS, params, fast_path=True, compile=True), timeout=600)
    reference, _ = run(generate_together(arch_model, PROMPTS, params, **TRANSFORMERS))
    assert_same(fast, reference)
    assert stats["compilations"] >= len(STEP_FUNCTIONS)


def test_inductor_records_are_dropped_only_on_a_thread_compiling_for_the_engine():
    """A failed compilation is reported by `compile_reason`; Inductor's dump of it (hundreds of lines at CRITICAL,
    from torch._inductor.scheduler) is dropped while our thread compiles. Other threads and loggers still log."""
    import logging

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    inductor, handler = logging.getLogger("torch._inductor"), Keep()
    inductor.addHandler(handler)
    try:
        with compiling._QUIET.quiet():
            logging.getLogger("torch._inductor.scheduler").critical("dropped")
            other = threading.Thread(target=lambda: logging.getLogger("torch._inductor.scheduler").critical("kept"))
            other.start()
            other.join()
        logging.getLogger("torch._inductor.scheduler").critical("kept after")
    finally:
        inductor.removeHandler(handler)
    assert seen == ["kept", "kept after"]


def test_a_failed_compilation_leaves_the_step_eager_and_says_why(fresh_compilations):
    """No working C++ compiler for Inductor on CPU (a fresh cache: nothing compiled earlier is reused)."""
    from torch._inductor import config
    from torch._inductor.utils import fresh_cache

    model = build("qwen2").cpu()
    eager, _ = engine_steps(model, compile=False, modes=("greedy", "sample"))
    with fresh_cache(), config.patch({"compile_threads": 1, "cpp.cxx": ("/nonexistent/c++",)}):
        fallback, runner = engine_steps(model, compile=True, modes=("greedy", "sample"))
    assert fallback == eager
    assert runner.compile_reason.startswith("off: ") and "InvalidCxxCompiler" in runner.compile_reason
    assert runner.stats["compilations"] == 0


@given(longest=st.integers(1, 5000), cap=st.integers(2, 5000))
def test_prefill_width_is_padded_to_few_sizes_within_the_context(longest, cap):
    """A pass's width covers its longest row, is a multiple of PREFILL_WIDTH_STEP (fewer shapes) unless the context
    ends first, and adds less than one step of padding."""
    assume(longest <= cap)  # a longer prompt is rejected before: it does not fit
    width = prefill_width(longest, cap)
    step_ = knobs.PREFILL_WIDTH_STEP
    assert longest <= width <= cap and width - longest < step_
    assert width % step_ == 0 or width == cap


@given(rows=st.integers(1, 64), longest=st.integers(1, 5000), read=st.integers(0, 5000), cap=st.integers(2, 5000))
def test_small_prefill_passes_get_a_graph_key_of_few_shapes(rows, longest, read, cap):
    """A pass of at most PREFILL_GRAPH_ROWS rows gets a graph of its rows, of a width covering its own and of a read
    length covering its own (0 when it reads nothing back): powers of two (at least PREFILL_WIDTH_STEP) unless the
    context ends first, less than twice its own, the graph within PREFILL_GRAPH_TOKENS; a pass gets none only when
    more rows or about twice those tokens."""
    assume(longest <= cap and read <= cap)
    width = prefill_width(longest, cap)
    key = prefill_graph_key(rows, width, read, cap)
    step_, most_rows, most_tokens = knobs.PREFILL_WIDTH_STEP, knobs.PREFILL_GRAPH_ROWS, knobs.PREFILL_GRAPH_TOKENS
    if key is None:
        assert rows > most_rows or 2 * rows * max(width, step_) > most_tokens
        return
    graph_rows, graph_width, graph_read = key
    assert graph_rows == rows <= most_rows and rows * graph_width <= most_tokens
    for own, graph in ((width, graph_width), (read, graph_read)):
        if own == 0:
            assert graph == 0
            continue
        assert own <= graph <= cap and graph < 2 * max(own, step_)
        assert graph == cap or (graph & (graph - 1) == 0 and graph >= step_)


def prefill_outputs(model, prompts, slots, cuda_graphs: bool = False, runner=None):
    """Greedy prefill of `prompts` into `slots` of a runner (8 slots of 160 positions); returns the runner, the
    tokens and logprobs, and each row's K/V (every layer) over its prompt."""
    runner, pool = runner or make_runner(model, context=160, cuda_graphs=cuda_graphs)
    rows, (tokens, logprobs) = prefill_rows(runner, pool, slots, prompts)
    kv = [row_kv(runner, row, len(p)) for row, p in zip(rows, prompts)]
    return (runner, pool), tokens, logprobs, kv


def assert_same_prefill(got, expected):
    (_, tokens, logprobs, kv), (_, ref_tokens, ref_logprobs, ref_kv) = got, expected
    assert tokens == ref_tokens and logprobs == pytest.approx(ref_logprobs, abs=LOGPROB_TOL)
    for row, ref_row in zip(kv, ref_kv, strict=True):
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(row, ref_row, strict=True))


@pytest.mark.parametrize("width_step", [1, 64, 160])  # 160: the whole context
def test_the_width_a_prefill_pass_is_padded_to_changes_no_rows_outputs(model, width_step):
    """Right padding is never attended and writes the null block: the tokens, logprobs and each row's K/V are those
    of the pass at its own width."""
    prompts, slots = [[1, 2, 3], list(range(30, 67)), [9] * 20], [5, 0, 2]
    with mock.patch.object(knobs, "PREFILL_WIDTH_STEP", 1):
        exact = prefill_outputs(model, prompts, slots)
    with mock.patch.object(knobs, "PREFILL_WIDTH_STEP", width_step):
        assert_same_prefill(prefill_outputs(model, prompts, slots), exact)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA (MT_ENV_TEST_DEVICE=cuda)")
def test_small_prefill_passes_replay_a_graph_that_gives_what_the_uncaptured_pass_gives():
    """A pass of a few rows is captured on its CAPTURE_ON_USE-th use and replayed from then on; every pass gives the
    tokens, logprobs and K/V a runner without graphs gives — with other prompts of the same key, other slots, after
    an in-place weight change (the graph reads the parameters), and after the parameters are reallocated (the graph
    is dropped and captured again at once)."""
    model = tiny_model(seed=5)
    runner, reference = None, None
    for k in range(CAPTURE_ON_USE + 3):
        prompts = [[(k + 3 * j) % VOCAB + 1 for j in range(10 + k)], [k + 7] * (40 - k)]  # width 48, graph 64
        slots = [k % 8, (k + 3) % 8]
        if k == CAPTURE_ON_USE + 1:
            with torch.no_grad():
                model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
        if k == CAPTURE_ON_USE + 2:
            model.load_state_dict({n: t.clone() for n, t in model.state_dict().items()}, assign=True)
            runner[0].check_module(busy=False)
        if runner is not None:  # each pass with fresh blocks
            runner = (runner[0], BlockPool(runner[1].num_blocks, BLOCK))
        got = prefill_outputs(model, prompts, slots, cuda_graphs=True, runner=runner)
        runner = got[0]
        expected = prefill_outputs(model, prompts, slots, runner=reference and (reference[0],
                                                                                BlockPool(reference[1].num_blocks,
                                                                                          BLOCK)))
        reference = expected[0]
        assert_same_prefill(got, expected)
    stats = runner[0].stats
    assert stats["prefill_graph_captures"] == 2 and stats["module_reallocations"] == 1
    assert stats["prefill_graph_replays"] == 4  # the uses from the CAPTURE_ON_USE-th on
