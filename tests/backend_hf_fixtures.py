"""What the HFBackend tests share (tests/test_backend_hf*.py, and the engine's, the prefix cache's, the exact and
Triton tests): the test device (``MT_ENV_TEST_DEVICE``), a tiny random-init Qwen2 model, the one-CPU-thread autouse
fixture, the `model` and `engine` (the backend's two paths) fixtures, `run` with a timeout, argmax decoding and
logprobs by hand, the references the backend must match, `packed_positions` (exact mode's trainer layouts) and
`layer_compiler` (how the trainer's compiled layers compile in tests). Not
a test module: import what you need (a fixture is imported by its function's name, e.g. `model_fixture` for `model`:
a test's argument does not shadow the import)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from agents.backend import SamplingParams
from agents.hf_backend import HFBackend

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
    for busy cores (autouse: every test module that imports it runs with it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", name="model")
def model_fixture():
    return tiny_model()


@pytest.fixture(params=list(PATHS), name="engine")
def engine_fixture(request) -> dict:
    """HFBackend keyword arguments choosing one of its two paths."""
    return PATHS[request.param]


#: scales `run`'s timeout, for slow instrumented runs (compute-sanitizer: benchmarks/run_gpu.sh sanitize)
TIMEOUT_SCALE = float(os.environ.get("MT_ENV_TEST_TIMEOUT_SCALE", "1"))


def run(coro, timeout: float = 30):
    """Run `coro` with a timeout, so a hanging worker fails the test instead of blocking the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout * TIMEOUT_SCALE))


def passes(backend: HFBackend) -> int:
    """Forward passes the backend ran so far (a CUDA graph replay runs no Python hook: count with the backend's
    stats, which tests/test_engine.py checks against a hook on the LM head)."""
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


def packed_positions(rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids, real) [len(rows), width] of rows each packing sequences of the given lengths end to end,
    positions counting from 0 in each, padding after them: a trainer's packed or padded batch."""
    position_ids = torch.zeros(len(rows), width, dtype=torch.long)
    real = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, lengths in enumerate(rows):
        at = 0
        for n in lengths:
            position_ids[b, at:at + n], real[b, at:at + n] = torch.arange(n), True
            at += n
    return position_ids, real


@pytest.fixture(name="layer_compiler")
def layer_compiler_fixture(monkeypatch):
    """How `compile_layers` compiles here: Inductor on CUDA (MT_ENV_TEST_DEVICE=cuda), as the trainer runs it; on
    CPU, dynamo and AOTAutograd without Inductor's code generation and with static shapes (Inductor's C++ compile of
    a layer's forward and backward with dynamic shapes takes minutes on 2 cores) — the same capture of the layers,
    their arguments and their backward."""
    from agents import compiling
    from trainers.modeling import _layer_forward

    if DEVICE != "cuda":
        light = compiling.Compiled(_layer_forward)
        light._compiled = torch.compile(_layer_forward, backend="aot_eager", dynamic=False)
        monkeypatch.setitem(compiling._COMPILED, _layer_forward, light)
    return compiling.compiled(_layer_forward)
