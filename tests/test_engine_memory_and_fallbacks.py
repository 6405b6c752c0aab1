"""The paged engine's memory and limits, and its fallbacks, on tiny random models: releasing and resuming the KV
cache, `max_context_len` bounding prompt and generation, reallocated parameters noticed; modules the fast path does
not serve fall back to transformers' forward with the reason, `fast_path='auto'` takes it on CUDA only, and bad
fast-path arguments are rejected."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from agents.backend import BackendError, SamplingParams
from agents.engine import decoder_layout
from agents.hf_backend import HFBackend

from .backend_hf_fixtures import (
    DEVICE,
    VOCAB,
    greedy_by_hand,
    one_cpu_thread,  # noqa: F401  (one intra-op thread for tiny matmuls)
    run,
    tiny_model,
)
from .engine_fixtures import (
    FAST,
    PROMPTS,
    SHAPE,
    build,
    model_fixture,  # noqa: F401  (its fixture)
)


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
