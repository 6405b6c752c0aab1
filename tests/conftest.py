"""Shared fixtures: offline tokenizers (built once, cached on disk), the official ones when ../shared is present,
and hypothesis profiles (``ci``: 500 examples per property, the default; ``dev``: 100; ``slow``: 5000 — choose with
``--slow`` or ``HYPOTHESIS_PROFILE``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MT_ENV_SHARED", ROOT.parent / "shared"))
SHARED_TOKENIZERS = SHARED / "tokenizers"
SHARED_GSM8K = SHARED / "data" / "gsm8k"

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               derandomize=False)


def subprocess_env(**extra: str) -> dict:
    """The environment of a child Python: this repository first on its path (the caller's path kept after it),
    one CPU thread unless told otherwise."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


settings.register_profile("ci", max_examples=500, **_common)
settings.register_profile("dev", max_examples=100, **_common)
settings.register_profile("slow", max_examples=5000, **_common)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="hypothesis 'slow' profile (5000 examples per property)")


def pytest_configure(config):
    profile = "slow" if config.getoption("--slow") else os.environ.get("HYPOTHESIS_PROFILE", "ci")
    settings.load_profile(profile)
    if os.environ.get("TRITON_INTERPRET") == "1":
        _row_invariant_interpreted_dot()


def _row_invariant_interpreted_dot() -> None:
    """Under Triton's interpreter, ``tl.dot`` is numpy's float32 matmul, whose row's bits change with the row's place
    in the tile (numpy 2.4 here: docs/exact.md), so exact mode's row-invariance tests would fail on code that passes
    on GPUs. Here it sums in float64 (float32 products are exact there) and rounds once: a row's bits are its own.
    A check of the kernels' logic on CPU; their bits on a GPU are the GPU's."""
    try:
        import numpy as np
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    except ImportError:
        return
    original = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype != np.float32 or b.data.dtype != np.float32 or d.data.dtype != np.float32:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = (a.data.astype(np.float64) @ b.data.astype(np.float64)).astype(np.float32)
        return TensorHandle(product + d.data, d.dtype.scalar)

    InterpreterBuilder.create_dot = create_dot


def shared_tokenizer(name: str):
    """The official tokenizer `name` from ../shared/tokenizers, or skip saying why."""
    path = SHARED_TOKENIZERS / name
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"official tokenizer {name!r} not found at {path} (../shared is absent): offline checks only")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="session")
def qwen25():
    from mt_env.tokenizer import offline_tokenizer

    return offline_tokenizer("qwen2.5")


@pytest.fixture(scope="session")
def qwen3():
    from mt_env.tokenizer import offline_tokenizer

    return offline_tokenizer("qwen3")


@pytest.fixture(scope="session")
def llama31():
    from mt_env.tokenizer import offline_tokenizer

    return offline_tokenizer("llama3.1")


LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a fact up.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
