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
