"""Docstrings as the developers' guide wants them: their examples run (doctest), as Gymnasium's do."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agents", "mt_env", "trainers", "envs")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: the modules whose docstrings hold an example (``>>>``): each is run as a doctest
WITH_EXAMPLES = sorted(module_name(p) for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                       if ">>> " in p.read_text(encoding="utf-8"))


def test_the_examples_are_found():
    assert {"mt_env.vector", "mt_env.wire"} <= set(WITH_EXAMPLES)


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_a_docstring_example_runs(name):
    results = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert results.attempted > 0 and results.failed == 0, f"{name}: {results}"
