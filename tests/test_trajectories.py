"""Recorded trajectories (mt_env/trajectories.py, trainers/recording.py): the records are the rows the loss used, the
episodes' turns and tool calls are all there, files are written atomically, a resumed run drops what it replays."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from agents.rollout import EpisodeId, EpisodeRecord, RolloutDriver, RolloutResult
from agents.scripted import ScriptedBackend
from envs.calculator import CalculatorEnv
from mt_env.sample import Seg
from mt_env.trajectories import (decode_tokens, encode_tokens, load_trajectories, mismatch, recorded_steps,
                                 step_path, write_records)
from trainers import ppo
from trainers.recording import Recorder, chosen_episodes, policy_version

from .conftest import ROOT, subprocess_env
from .test_rollout import calculator_call, expert, turn
from .test_trainer import TINY

pytestmark = pytest.mark.xdist_group("trajectories")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step tiny run recording 6 episodes per step (3 whole groups of 2 of its 4), with old logprobs computed
    (two mini-batches), and the batches its updates trained on."""
    out = tmp_path_factory.mktemp("run")
    trained: dict[int, object] = {}
    update = ppo.update

    def keep(batch, models, accelerator, cfg, step):
        trained[step] = batch
        return update(batch, models, accelerator, cfg, step)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ppo, "update", keep)
        overrides = [*TINY, "trainer.minibatch_size=4", "logging.record_episodes=6", "eval.episodes=4"]
        ppo.main(["--set", f"output_dir={out}", "--set", "trainer.total_steps=2",
                  *[a for o in overrides for a in ("--set", o)]])
    return out, trained


def test_records_are_the_rows_the_loss_used(run):
    out, trained = run
    for step, batch in trained.items():
        records = load_trajectories(out, step=step)
        assert [(r["group"], r["index"]) for r in records] == [(g, i) for g in range(3) for i in range(2)]
        for r in records:
            rows = (batch.episode == r["episode"]).nonzero().flatten().tolist()
            assert len(rows) == len(r["samples"]) >= 1
            assert r["reward"] == pytest.approx(float(batch.episode_rewards[rows[0]]))
            for row, sample in zip(rows, r["samples"]):
                t, n = sample["tokens"], int(batch.attention_mask[row].sum())
                for name, field in (("ids", "input_ids"), ("loss_mask", "loss_mask"),
                                    ("rollout_logprobs", "rollout_logprobs"), ("old_logprobs", "old_logprobs"),
                                    ("advantages", "advantages"), ("rewards", "rewards")):
                    assert np.array_equal(t[name], getattr(batch, field)[row, :n].numpy().astype(t[name].dtype))
                assert len(sample["pieces"]) == n
                derived = np.zeros(n)  # the loss mask is the segments' (sampled tokens of trainable samples)
                for kind, _, start, end in sample["segments"]:
                    derived[start:end] = kind == Seg.SAMPLED and sample["trainable"]
                assert np.array_equal(derived, t["loss_mask"])
                diff = mismatch(sample)
                assert np.array_equal(diff, (t["old_logprobs"] - t["rollout_logprobs"]) * t["loss_mask"])
                assert np.abs(diff).max() < 1e-3  # the engine and the trainer agree (as the metrics say)
            assert [t["policy_version"] for t in r["turns"]] == [step - 1] * len(r["turns"])


def test_a_single_update_records_the_old_logprobs_it_measured_the_mismatch_on(tmp_path):
    """One mini-batch a step: the update's own logprobs are the old ones; they are recorded, and the step's
    mismatch metric is the largest recorded difference (every episode recorded)."""
    ppo.main(["--set", f"output_dir={tmp_path}", "--set", "trainer.total_steps=1", "--set", "sft.steps=0",
              "--set", "logging.record_episodes=8", *[a for o in TINY for a in ("--set", o)]])
    records = load_trajectories(tmp_path, step=1)
    samples = [sample for r in records for sample in r["samples"]]
    assert len(records) == 8 and samples
    trained = [s["tokens"]["old_logprobs"][s["tokens"]["loss_mask"] > 0] for s in samples]
    assert all(len(lp) == 0 or (lp < 0).all() for lp in trained) and sum(map(len, trained)) > 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in metrics if m.get("step") == 1 and "mismatch/logprob_abs_max" in m)
    largest = max(float(np.abs(mismatch(s)).max()) for s in samples)
    assert largest == pytest.approx(step["mismatch/logprob_abs_max"], rel=1e-5, abs=1e-7)


def test_turns_point_at_their_sampled_tokens(run):
    out, _ = run
    for r in load_trajectories(out) + load_trajectories(out, kind="eval"):
        assert len(r["turns"]) == len(r["finish_reasons"]) == r["stats"]["turns"]
        for t in r["turns"]:
            sample = r["samples"][t["sample"]]
            kinds = {kind for kind, turn, start, end in sample["segments"] if turn == t["index"] and kind == Seg.SAMPLED
                     and (start, end) == (t["start"], t["end"])}
            assert kinds == {Seg.SAMPLED}
            assert t["finish_reason"] in ("stop", "length", "abort")


def test_evaluations_are_recorded_without_trainer_values(run):
    out, _ = run
    assert [(kind, step) for kind, step, _ in recorded_steps(out)] == [("train", 1), ("train", 2), ("eval", 0),
                                                                       ("eval", 2)]
    for r in load_trajectories(out, kind="eval"):
        assert r["kind"] == "eval" and len(r["samples"]) >= 1
        assert set(r["samples"][0]["tokens"]) == {"ids", "loss_mask", "rollout_logprobs", "rewards"}
        assert mismatch(r["samples"][0]) is None


def test_evaluate_py_records_its_episodes_with_the_checkpoints_step(run, tmp_path):
    """trainers/evaluate.py on the run's final checkpoint: every episode, token by token, kind ``evaluate``, labelled
    with the checkpoint's step, next to its per-episode JSONL."""
    from trainers.evaluate import main as evaluate_main

    out, _ = run
    summary = evaluate_main(["--config", "quickstart.yaml", "--checkpoint", str(out), "--episodes", "3",
                             "--out", str(tmp_path / "episodes.jsonl"), "--set", TINY[0]])
    assert [(kind, step) for kind, step, _ in recorded_steps(tmp_path)] == [("evaluate", 2)]
    records = load_trajectories(tmp_path, kind="evaluate")
    assert len(records) == summary["episodes"] == 3
    assert [r["group"] for r in records] == [0, 1, 2] and all(r["samples"] for r in records)


def test_tool_calls_and_results_are_recorded(qwen25, tmp_path):
    """A scripted expert's calculator calls: each turn's call with its arguments, and the tool's answer with its
    duration; a call to an unknown tool is answered with its error."""
    env = CalculatorEnv(tokenizer=qwen25)
    env.reset(seed=0)
    fmt = env.conversation.fmt
    right = expert(fmt)

    def script(prompt):  # a failing call first, then the expert
        return right(prompt) if "1 / 0" in fmt.decode(prompt) else turn(fmt, calculator_call("1 / 0"))

    for name, policy, operands in (("expert", right, [12, 34, 5]), ("divides by zero first", script, [12, 34])):
        tasks = [CalculatorEnv.task_for(operands)]  # 3 turns (the env's limit): 2 calls and the answer
        result = RolloutDriver(lambda: CalculatorEnv(tokenizer=qwen25), ScriptedBackend(policy)).run(tasks)
        path = Recorder(tmp_path / name, qwen25, every=1, episodes=4).record_eval(3, tasks, result)
        (r,) = load_trajectories(tmp_path / name, kind="eval")
        assert path == step_path(tmp_path / name, "eval", 3) and r["success"]
        calls = [(c["name"], c["arguments"]) for t in r["turns"] for c in t["tool_calls"]]
        answers = [o for t in r["turns"] for o in t["observation"]]
        assert [o["call_id"] for o in answers] == [c["id"] for t in r["turns"] for c in t["tool_calls"]]
        assert all(o["duration_s"] >= 0 for o in answers)
        if name == "expert":
            assert calls == [("calculator", '{"expression": "12 * 34"}'), ("calculator", '{"expression": "408 * 5"}')]
            assert [o["content"] for o in answers] == ["408", "2040"] and not any(o["error"] for o in answers)
        else:
            assert calls == [("calculator", '{"expression": "1 / 0"}'), ("calculator", '{"expression": "12 * 34"}')]
            assert (answers[0]["error"], answers[0]["error_kind"]) == ("division by zero", "exception")
            assert answers[0]["content"] == "Error: division by zero" and answers[1]["content"] == "408"
            assert r["stats"]["tool_errors"] == 1


def test_a_killed_writer_leaves_every_step_readable(tmp_path):
    """SIGKILL while a step's file is being written: the steps before it read back whole, that one is absent."""
    child = textwrap.dedent(f"""
        import sys, time
        from mt_env.trajectories import write_records
        write_records({str(tmp_path)!r}, "train", 1, [{{"step": 1, "samples": []}}] * 3)
        def slow():
            yield {{"step": 2, "samples": []}}
            print("writing", flush=True)
            time.sleep(60)
            yield {{"step": 2, "samples": []}}
        write_records({str(tmp_path)!r}, "train", 2, slow())
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True, env=subprocess_env(),
                            cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert (tmp_path / "trajectories" / "train_000002.jsonl.gz.tmp").is_file()  # cut short, under its temporary name
    assert [s for _, s, _ in recorded_steps(tmp_path)] == [1]
    assert [r["step"] for r in load_trajectories(tmp_path)] == [1, 1, 1]
    assert load_trajectories(tmp_path, step=2) == []


def test_a_resumed_run_drops_the_steps_it_records_again(tmp_path):
    for kind, step in (("train", 1), ("train", 2), ("train", 3), ("eval", 0), ("eval", 2), ("eval", 3)):
        write_records(tmp_path, kind, step, [{"step": step, "samples": []}])
    Recorder(tmp_path, tokenizer=None, every=1, episodes=4, resume_step=2)
    assert [(k, s) for k, s, _ in recorded_steps(tmp_path)] == [("train", 1), ("train", 2), ("eval", 0), ("eval", 2)]
    Recorder(tmp_path, tokenizer=None, every=0, episodes=4, resume_step=0)  # recording off: nothing is touched
    assert len(recorded_steps(tmp_path)) == 4


def test_whole_groups_are_chosen_first():
    episodes = [EpisodeRecord(id=EpisodeId(g, i)) for g in range(3) for i in range(4)]
    assert chosen_episodes(episodes, 8) == list(range(8))
    assert chosen_episodes(episodes, 6) == [0, 1, 2, 3, 4, 5]
    assert chosen_episodes(episodes, 100) == list(range(12))


def test_policy_version_is_the_weights_that_sampled():
    assert policy_version(RolloutResult([], {}), step=5) == 4  # on-policy: the weights after step 4
    assert policy_version(RolloutResult([], {"async/weights_version": 2.0}), step=5) == 2  # one-step off-policy


@given(st.lists(st.floats(width=32), max_size=50), st.lists(st.integers(-2**31, 2**31 - 1), max_size=50))
def test_token_arrays_round_trip_exactly(floats, ids):
    decoded = decode_tokens(encode_tokens({"old_logprobs": floats, "ids": ids, "loss_mask": [1, 0] * 3}))
    assert decoded["old_logprobs"].astype(float).tobytes() == np.asarray(floats, dtype=np.float32).astype(
        float).tobytes()
    assert decoded["ids"].tolist() == ids and decoded["loss_mask"].tolist() == [1, 0] * 3


def test_bad_input_is_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="kind must be one of"):
        load_trajectories(tmp_path, kind="test")
    with pytest.raises(FileNotFoundError, match="no run directory"):
        load_trajectories(tmp_path / "missing")
    with pytest.raises(ValueError, match="unknown per-token array 'logits'"):
        encode_tokens({"logits": torch.zeros(3).numpy()})
    assert load_trajectories(tmp_path) == []  # a run that recorded nothing yet
