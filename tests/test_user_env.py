"""A user's own env, defined in a module outside this package, trains and evaluates through the command line with
Gymnasium's ``module:EnvId`` id (docs/envs.md#train-it), and the trainer says what to change when it cannot."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import pytest

from trainers.config import ConfigError, load_config

from .conftest import ROOT, subprocess_env
from .test_trainer import TINY

pytestmark = pytest.mark.filterwarnings("ignore:.*Overriding environment")  # one id, a new module per test

#: a complete env in a module of its own, as a user writes it (docs/envs.md, condensed)
USER_ENV = textwrap.dedent('''
    import gymnasium as gym

    from mt_env.calculator import CalculatorTool
    from mt_env.env import ToolEnv
    from mt_env.parsers import HermesParser, ToolCall


    class DoubleEnv(ToolEnv):
        def default_tools(self):
            return [CalculatorTool()]

        def sample_task(self, rng):
            a = int(rng.integers(100, 1000))
            return {"prompt": [{"role": "user", "content": f"What is 2 * {a}?"}], "expression": f"2 * {a}",
                    "answer": 2 * a}

        def answer_reward(self, task, final_text):
            return float(str(task["answer"]) in final_text)

        def demonstration(self, task, rng, skill=1.0):
            call = HermesParser.format_turn([ToolCall("calculator", {"expression": task["expression"]})])
            return [call, str(task["answer"]), f"It is {task['answer']}."]


    class NoDemoEnv(DoubleEnv):
        demonstration = ToolEnv.demonstration


    gym.register(id="Double-v0", entry_point=DoubleEnv)
    gym.register(id="NoDemo-v0", entry_point=NoDemoEnv)
    gym.register(id="NoDemoFactory-v0", entry_point=lambda **kwargs: NoDemoEnv(**kwargs))
''')


_names = itertools.count()


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """The module's name (unique per test: modules and registrations stay for the process), importable from
    `tmp_path` only, as a user's folder on PYTHONPATH."""
    name = f"user_envs_{os.getpid()}_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(USER_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_an_env_from_a_module_outside_the_package_trains_and_evaluates(tmp_path, user_module):
    """The README-style command lines, in fresh processes that see the module only through PYTHONPATH."""
    out = tmp_path / "run"
    env = subprocess_env(PYTHONPATH=f"{ROOT}:{tmp_path}")
    sets = [a for o in [*TINY, f"env.id={user_module}:Double-v0", f"output_dir={out}", "trainer.total_steps=1",
                        "sft.steps=1", "eval.episodes=2", "threads=1"] for a in ("--set", o)]
    train = subprocess.run([sys.executable, "trainers/ppo.py", *sets], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
    assert "sft step" in train.stdout and "done: 1 steps" in train.stdout  # SFT on its demonstrations, then RL
    evaluate = subprocess.run([sys.executable, "trainers/evaluate.py", "--config", "quickstart.yaml",
                               "--checkpoint", str(out), "--episodes", "2",
                               *sets], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert evaluate.returncode == 0, evaluate.stdout[-2000:] + evaluate.stderr[-2000:]
    assert f"{user_module}:Double-v0 · {out}" in evaluate.stdout
    assert f"per-episode records: {out / 'eval' / 'checkpoint_1.jsonl'}" in evaluate.stdout  # the run's files kept


def test_the_task_tokenizer_and_sft_follow_the_user_env(user_module):
    cfg = load_config("quickstart.yaml", [f"env.id={user_module}:Double-v0"])
    assert cfg.tokenizer.name == f"task:{user_module}:Double-v0"
    for env_id in ("NoDemo-v0", "NoDemoFactory-v0"):  # a class, and a factory function that makes one
        with pytest.raises(ConfigError, match=rf"tokenizer.name=task and sft.steps > 0 need the env's "
                                              rf"demonstrations, which {user_module}:{env_id} does not have"):
            load_config("quickstart.yaml", [f"env.id={user_module}:{env_id}"])
    cfg = load_config("quickstart.yaml", [f"env.id={user_module}:NoDemo-v0", "tokenizer.name=offline:qwen2.5",
                                          "sft.steps=0"])  # what the message says to set
    assert cfg.env.id == f"{user_module}:NoDemo-v0"


@pytest.mark.parametrize("env_id, message", [
    ("no_such_module_xyz:Double-v0", r"env.id: 'no_such_module_xyz:Double-v0': no module named "
                                     r"'no_such_module_xyz' to import: put the folder that holds it on PYTHONPATH"),
    ("{module}:Tripple-v0", r"env.id: importing {module} did not register 'Tripple-v0'"),
    ("Double-v9", r"env.id: 'Double-v9' is not a registered Gymnasium id.*an env of your own: module:EnvId"),
    ("CartPole-v1", r"env.id: CartPole-v1 makes a CartPoleEnv, not an mt_env.env.ToolEnv"),
])
def test_an_env_id_that_cannot_be_trained_says_what_to_change(user_module, env_id, message):
    with pytest.raises(ConfigError, match=message.format(module=user_module)):
        load_config("quickstart.yaml", ["sft.steps=0", "tokenizer.name=offline:qwen2.5",
                                        "env.id=" + env_id.format(module=user_module)])
