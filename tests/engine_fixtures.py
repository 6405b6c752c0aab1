"""What the paged engine's tests share (tests/test_engine*.py): the backend arguments of each path, tiny random
Qwen2, Qwen3 and Llama models (`build`; the `arch_model` and `model` fixtures), the prompts and sampling mixes, the
same-output checks against the transformers path, and a model runner with its prefill and step helpers. Not a test
module: import what you need (a fixture by its function's name, e.g. `model_fixture` for `model`)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from agents.backend import SamplingParams
from agents.engine import EngineConfig, decoder_layout, new_stats
from agents.engine.blocks import BlockPool
from agents.engine.model_runner import ModelRunner, PrefillRow
from agents.engine.sampler import RowSampling
from agents.hf_backend import HFBackend

from .backend_hf_fixtures import DEVICE, VOCAB, run, tiny_model

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


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama"], name="arch_model")
def arch_model_fixture(request):
    return build(request.param)


@pytest.fixture(scope="module", name="model")
def model_fixture():
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
