"""The README's code blocks run as written (a README that lies is worse than none)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

from .conftest import SHARED_GSM8K

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def block(containing: str) -> str:
    return next(b for b in BLOCKS if containing in b)


def test_drive_gsm8k_with_a_policy(monkeypatch, capsys):
    if not (SHARED_GSM8K / "test.jsonl").is_file():
        pytest.skip(f"GSM8K data not found at {SHARED_GSM8K} (../shared is absent)")
    code = block('gym.make("GSM8kTool-v0"').replace('"../shared/data/gsm8k"', repr(str(SHARED_GSM8K)))
    monkeypatch.chdir(ROOT)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert re.search(r"return: -?\d", out) and re.search(r"\d+ tokens, \d+ trained on", out)


def test_text_episode(capsys):
    exec(compile(block('gym.make("Calculator-v0")'), "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out.splitlines()
    assert "What is 865 * 673?" in "\n".join(out[:-2])
    assert out[-2] == "tool: 582145" and out[-1] == "1.0 True answered"


def test_add_your_own_env():
    namespace: dict = {}
    exec(compile(block("class SumEnv"), "README.md", "exec"), namespace)
    if "Sum-v0" not in gym.registry:
        gym.register("Sum-v0", entry_point=namespace["SumEnv"])
    env = gym.make("Sum-v0").unwrapped
    check_env(env, skip_render_check=True)
    env.reset(seed=1)
    total = env.step(f"It is {env.task['answer']}.")[1]
    assert total == 1.0


def test_readme_commands_match_ci():
    """.ci/run calls the README's test command."""
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci and "make test" in readme and "make quickstart" in readme
    assert os.access(ROOT / ".ci" / "run", os.X_OK)
