"""The one-step off-policy mode (trainers/async_rollout.py) on CPU: two processes under torchrun (gloo), one
training, one generating. Staleness, weight transfers, evaluation on the generator, stop and resume, a generator
failure, and a shortened quickstart that must still learn."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path

import gymnasium as gym
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainers.config import ConfigError, load_config
from trainers.ppo import main as ppo_main
from trainers.setup import TaskSource

from .test_trainer import TINY as TRAINER_TINY
from .test_trainer import metrics as rows
from .test_trainer import torchrun

TINY = [*TRAINER_TINY, "algorithm.entropy_coef=0.01", "threads=1", "trainer.async_rollout=true"]
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="two-process gloo runs tested on Linux")


# --------------------------------------------------------------------------------------------- config
def test_async_mode_needs_two_processes_and_the_embedded_engine(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="exactly 2 processes.*accelerate launch --num_processes 2"):
        ppo_main(["--set", f"output_dir={tmp_path}", "--set", "trainer.async_rollout=true"])
    with pytest.raises(ConfigError, match="async_rollout.*rollout.backend=hf"):
        load_config("quickstart.yaml", ["trainer.async_rollout=true", "rollout.backend=sglang_engine"])
    # truncated importance sampling corrects the one-step-old samples: on by default in this mode, as set otherwise
    assert load_config("quickstart.yaml", ["trainer.async_rollout=true"]).algorithm.tis_cap == 2.0
    assert load_config("quickstart.yaml", ["trainer.async_rollout=true", "algorithm.tis_cap=5"]).algorithm.tis_cap == 5
    assert load_config("quickstart.yaml").algorithm.tis_cap is None


# --------------------------------------------------------------------------------------------- the task stream
@pytest.fixture(scope="module")
def gsm8k_rows(tmp_path_factory):
    """A 7-problem GSM8K file in GSM8K's own format: epochs of the task stream turn over quickly."""
    path = tmp_path_factory.mktemp("gsm8k") / "train.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {k} + {k}?", "answer": f"{k} + {k} = {2 * k}\n#### "
                                        f"{2 * k}"}) + "\n" for k in range(7)))
    return str(path)


@given(counts=st.lists(st.integers(0, 9), max_size=6), dataset=st.booleans())
def test_peek_is_next_without_moving(gsm8k_rows, counts, dataset):
    """The async trainer asks for the next step's tasks with `peek` before it trains on this step's: peeking never
    moves the stream, and what it shows is exactly what `next` then returns, across epochs of a dataset."""
    env = gym.make("GSM8kTool-v0", data_path=gsm8k_rows) if dataset else gym.make("Calculator-v0")
    stream, twin = TaskSource(env.unwrapped, seed=3), TaskSource(env.unwrapped, seed=3)
    for count in counts:
        seen = stream.peek(count)
        assert stream.peek(count + 2)[:count] == seen and stream.position == twin.position
        assert stream.next(count) == seen == twin.next(count)
    restored = TaskSource(env.unwrapped, seed=3)
    restored.load_state_dict(stream.state_dict())
    assert restored.next(5) == stream.next(5)


# --------------------------------------------------------------------------------------------- a run
@linux_only
def test_async_run_staleness_weights_evaluation_stop_and_resume(tmp_path):
    """4 steps, then resumed to 6. The trainer is one process (no DDP across the two); step k trains on episodes
    of the weights of step k-2 (staleness 1; 0 at the first step of a session), which the trainer checks by
    checksum; evaluations run on the generator with the weights of their step; a resumed run restarts the
    pipeline from its checkpoint."""
    proc = torchrun(tmp_path, *TINY, "trainer.total_steps=4", "trainer.eval_every=2", "trainer.save_every=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = torchrun(tmp_path, *TINY, "trainer.total_steps=6", "trainer.eval_every=2", "trainer.save_every=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = {r["step"]: r for r in rows(tmp_path) if "actor/loss" in r}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    assert [steps[k]["async/staleness_max"] for k in steps] == [0, 1, 1, 1, 0, 1]
    assert [steps[k]["async/weights_version"] for k in steps] == [0, 0, 1, 2, 4, 4]
    for r in steps.values():
        assert r["dist/processes"] == 1 and r["rollout/episodes"] == 8 and r["actor/skipped_updates"] == 0
        assert "actor/tis_weight_mean" in r  # truncated importance sampling is on
    # the same weights generated and scored step 1: the engine's logprobs are the trainer's; later steps were
    # played one update earlier, and the gap shows
    assert steps[1]["mismatch/logprob_abs_max"] < 1e-3 and steps[5]["mismatch/logprob_abs_max"] < 1e-3
    assert max(steps[k]["mismatch/logprob_abs_max"] for k in (2, 3, 4, 6)) > 1e-3
    assert [r["step"] for r in rows(tmp_path) if "val/success" in r] == [0, 2, 4, 6]
    assert json.loads((tmp_path / "config.json").read_text())["algorithm"]["tis_cap"] == 2.0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_2", "checkpoint_4",
                                                                          "checkpoint_6"]


@linux_only
def test_async_time_limit_discards_the_batch_in_flight(tmp_path):
    """A run stopped by its time limit after step 1 (the generator is already playing step 2): final evaluation
    and checkpoint, the batch in flight discarded, both processes exit cleanly."""
    proc = torchrun(tmp_path, *TINY, "trainer.total_steps=50", "trainer.time_limit_s=0.001", "trainer.eval_every=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "time limit" in proc.stdout
    assert [r["step"] for r in rows(tmp_path) if "actor/loss" in r] == [1]
    assert (tmp_path / "checkpoints" / "checkpoint_1").is_dir()


# --------------------------------------------------------------------------------------------- failures
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair_with_a_dead_engine(rank: int, port: int, out: str) -> None:
    """Both ends of the link; the generator's engine is closed, so its first rollout raises BackendError."""
    from accelerate import Accelerator

    from agents.backend import BackendError
    from trainers.async_rollout import GeneratorError, RemoteRollouts, open_link, serve
    from trainers.modeling import PolicyModel
    from trainers.rollouts import make_rollouts
    from trainers.setup import env_factory, make_models, make_tokenizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    cfg = load_config("quickstart.yaml", [*TINY, "device=cpu"])
    link = open_link(cfg)
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 1  # each end is a one-process run for accelerate
    tokenizer = make_tokenizer(cfg)
    lm, _ = make_models(cfg, tokenizer, accelerator.device, critic=False)
    make_env = env_factory(cfg, tokenizer)
    if link.trains:
        remote = RemoteRollouts(link, lm, TaskSource(make_env().unwrapped, seed=0), total_steps=3)
        try:
            remote.play(remote.tasks.next(2), n=2, step=1)
            outcome = "no error"
        except GeneratorError as e:
            outcome = str(e)
    else:
        rollouts = make_rollouts(cfg, accelerator, PolicyModel(lm), lm, tokenizer, make_env, make_env, False)
        asyncio.run(rollouts.backend.close())
        try:
            serve(rollouts, link, lm)
            outcome = "no error"
        except BackendError as e:
            outcome = f"raised {type(e).__name__}: {e}"
    Path(out, f"rank{rank}.txt").write_text(outcome)
    link.close()


@linux_only
def test_a_generator_failure_reaches_the_trainer(tmp_path):
    """The generator's exception is the trainer's error (with the generator's traceback), instead of a wait."""
    import torch.multiprocessing

    torch.multiprocessing.spawn(_pair_with_a_dead_engine, args=(_free_port(), str(tmp_path)), nprocs=2)
    trainer, generator = ((tmp_path / f"rank{k}.txt").read_text() for k in (0, 1))
    assert trainer.startswith("the generator process failed") and "BackendError" in trainer and "closed" in trainer
    assert generator.startswith("raised BackendError")


# --------------------------------------------------------------------------------------------- learning
@linux_only
def test_async_quickstart_learns(tmp_path):
    """The quickstart recipe, shortened, in async mode: held-out success and tool use must clearly rise."""
    proc = torchrun(tmp_path, "threads=1", "trainer.async_rollout=true", "sft.steps=300", "sft.batch_size=16",
                    "trainer.total_steps=16", "rollout.prompts_per_step=8", "trainer.lr=2e-4",
                    "trainer.eval_every=0", "eval.episodes=96", "trainer.time_limit_s=null", "logging.plot=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    evals = [r for r in rows(tmp_path) if "val/success" in r]
    before, after = evals[0], evals[-1]
    print(f"held-out success {before['val/success']:.3f} -> {after['val/success']:.3f}; tool-call rate "
          f"{before['val/tool_call_rate']:.3f} -> {after['val/tool_call_rate']:.3f}")
    assert after["val/success"] >= before["val/success"] + 0.15
    assert after["val/tool_call_rate"] >= before["val/tool_call_rate"] + 0.15
    assert max(r["async/staleness_max"] for r in rows(tmp_path) if "async/staleness_max" in r) == 1
