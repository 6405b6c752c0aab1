"""The paged engine's step as compiled and captured, on tiny random models: a stand-in graph (a larger bucket's)
gives the rows what their own bucket gives, warming the buckets changes no outputs, prefill attention never allows
cuDNN, the gather decode's mask layout; the step compiled by Inductor (one compilation for all layers and buckets,
the transformers path's output, a failed compilation leaves it eager and says why); prefill widths and graph keys of
few shapes, padding that changes no outputs, and small prefill passes replayed from CUDA graphs.

Some of these tests empty dynamo's caches (compiled code is shared by the whole process): benchmarks/run_gpu.sh
runs this file after the engine's other files, whose tests reuse compiled code.
"""

from __future__ import annotations

import random
import threading
from unittest import mock

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from agents import compiling
from agents.backend import SamplingParams
from agents.engine import config as knobs
from agents.engine.blocks import BlockPool
from agents.engine.graphs import CAPTURE_ON_USE, stand_in
from agents.engine.layers import COMPILED_FUNCTIONS, STEP_FUNCTIONS
from agents.engine.model_runner import ModelRunner, prefill_graph_key, prefill_width
from agents.engine.sampler import SAMPLING_MODES

from .backend_hf_fixtures import (
    DEVICE,
    VOCAB,
    one_cpu_thread,  # noqa: F401  (one intra-op thread for tiny matmuls)
    run,
    tiny_model,
)
from .engine_fixtures import (
    BLOCK,
    LOGPROB_TOL,
    MIXES,
    PROMPTS,
    TRANSFORMERS,
    arch_model_fixture,  # noqa: F401  (a fixture)
    assert_same,
    build,
    generate_together,
    make_runner,
    model_fixture,  # noqa: F401  (a fixture)
    prefill_rows,
    row_kv,
    step,
)

# ------------------------------------------------------------------------------------------------- compiled step
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
