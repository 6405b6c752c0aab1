"""Docstrings as the developers' guide wants them: purpose and contract in a few lines (module docstrings of at most
25 lines, no machine names: measurements and design history live in docs/, dated, with their command), and their
examples run (doctest), as Gymnasium's do."""

from __future__ import annotations

import ast
import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agents", "mt_env", "trainers", "envs")
CHECKED = ("agents", "mt_env", "trainers")  #: the packages whose docstrings are held to the rules below
MAX_MODULE_LINES = 25


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


def docstrings(path: Path, root: Path = ROOT):
    """(where, docstring) of the module and of every class and function in `path` (where: relative to `root`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node)
            if text:
                yield f"{path.relative_to(root)}:{getattr(node, 'name', '<module>')}", text


CHECKED_FILES = sorted(p for package in CHECKED for p in (ROOT / package).rglob("*.py"))


def test_module_docstrings_are_at_most_25_lines():
    long = {where: len(text.splitlines()) for path in CHECKED_FILES for where, text in docstrings(path)
            if where.endswith(":<module>") and len(text.splitlines()) > MAX_MODULE_LINES}
    assert not long, f"module docstrings over {MAX_MODULE_LINES} lines (move the reasoning to docs/): {long}"


def test_no_docstring_names_a_machine():
    named = [where for path in CHECKED_FILES for where, text in docstrings(path) if "H200" in text]
    assert not named, f"docstrings naming the H200 (measurements go to docs/, dated): {named}"


def test_the_checks_read_docstrings_and_nothing_else(tmp_path):
    """A 26-line module docstring and an "H200" in a method's docstring are found; the same words in a comment or
    a string that is not a docstring are not."""
    module = tmp_path / "m.py"
    lines = "\n".join(f"line {i}" for i in range(26))
    body = '# H200\nX = "H200"\n\n\nclass A:\n    def f(self):\n        """On an H200."""\n'
    module.write_text(f'"""{lines}"""\n\n{body}')
    found = dict(docstrings(module, root=tmp_path))
    assert len(found["m.py:<module>"].splitlines()) == 26 and "H200" in found["m.py:f"] and len(found) == 2
