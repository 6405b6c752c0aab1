"""The SFT warm start checkpoints like RL (trainers/sft.py): stopped by a signal mid-SFT it saves at the step
boundary, and the same command continues SFT from there to the same result as a run that was never stopped; the
run directory's rules hold across it (atomic checkpoints, metrics.jsonl reads as one run)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys

from safetensors.torch import load_file

from trainers import checkpoints
from trainers.sft import WarmStart
from trainers.stopping import entry_point, shown_path

from .test_trainer import metrics, run

SFT = ("sft.steps=6", "sft.save_every=4", "trainer.save_every=0")


def weights(checkpoint) -> dict:
    return load_file(str(checkpoint / "model.safetensors"))


def assert_same_weights(a, b) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa), f"{a} and {b} differ"


def without_clock(rows: list[dict]) -> list[dict]:
    """Metrics rows without timings and the engine's scheduling counters (how requests happened to be batched)."""
    return [{k: v for k, v in r.items() if not k.endswith(("_s", "_per_s"))
             and not k.startswith(("perf/", "engine/", "time/", "mismatch/"))} for r in rows]


def signal_after_sft_step(monkeypatch, at: int, signum: int = signal.SIGINT) -> None:
    """A real signal to this process right after SFT step `at` (the trainer's own handler receives it)."""
    step = WarmStart.step

    def step_then_signal(self, k):
        loss = step(self, k)
        if k == at:
            os.kill(os.getpid(), signum)
        return loss

    monkeypatch.setattr(WarmStart, "step", step_then_signal)


def test_a_signal_during_sft_saves_and_the_same_command_continues_to_the_same_result(tmp_path, monkeypatch, capfd):
    whole = run(tmp_path / "whole", *SFT, steps=1)

    out = tmp_path / "stopped"
    signal_after_sft_step(monkeypatch, at=5)  # after the periodic save of step 4: the stop saves step 5
    assert entry_point(lambda argv: run(out, *SFT, steps=1)) == 130
    monkeypatch.undo()
    printed = capfd.readouterr()
    saved = out / "checkpoints" / "checkpoint_0"
    assert "SIGINT: stopping after this step with a checkpoint" in printed.err
    assert (f"SIGINT: stopped SFT after step 5 of 6; checkpoint {saved} holds the model and SFT's optimizer: the same "
            f"command continues SFT from step 6. To continue, run the same command: "
            f"{shown_path(sys.executable)} trainers/ppo.py "
            f"--set output_dir={out}") in printed.out
    assert checkpoints.problem(saved) is None and [f.path for f in checkpoints.scan(out)] == [saved]
    state = checkpoints.read_state(saved)
    assert (state.step, state.sft_steps, state.sft_done, state.metrics_rows) == (0, 5, False, 0)
    assert (saved / "sft_state_0.pt").is_file() and metrics(out) == []  # nothing logged during SFT

    resumed = run(out, *SFT, steps=1)
    assert "resuming from" in capfd.readouterr().out.split(f"{saved} (SFT step 5)")[0]
    assert resumed["final_val_success"] == whole["final_val_success"]
    assert resumed["start_val_success"] == whole["start_val_success"]
    for step in (0, 1):  # after SFT, and after the RL step: the same weights, bit for bit
        assert_same_weights(out / "checkpoints" / f"checkpoint_{step}", tmp_path / "whole" / "checkpoints" /
                            f"checkpoint_{step}")
    assert without_clock(metrics(out)) == without_clock(metrics(tmp_path / "whole"))  # one run: the same rows
    assert not list((out / "checkpoints" / "checkpoint_0").glob("sft_state*"))  # SFT over: its state is gone


def test_a_signal_during_the_last_sft_step_goes_on_with_rl_next_time(tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    signal_after_sft_step(monkeypatch, at=6, signum=signal.SIGTERM)
    assert entry_point(lambda argv: run(out, *SFT, steps=1)) == 143
    monkeypatch.undo()
    assert "stopped SFT after step 6 of 6; checkpoint" in capfd.readouterr().out
    state = checkpoints.read_state(out / "checkpoints" / "checkpoint_0")
    assert (state.sft_steps, state.sft_done, state.first_eval) == (6, True, None)
    assert [r["step"] for r in metrics(out)] == [0] and "sft/loss" in metrics(out)[0]
    summary = run(out, *SFT, steps=1)
    assert summary["steps"] == 1 and summary["start_val_success"] is not None
    assert [sorted(k for k in r if k.startswith(("sft/", "val/success"))) for r in metrics(out)] == [
        ["sft/loss", "sft/steps", "sft/time_s"], ["val/success"], [], ["val/success"]]


def test_a_kill_after_sft_before_the_first_rl_checkpoint_keeps_one_run(tmp_path):
    """Killed (no chance to save) during RL, before its first checkpoint: the run resumes from SFT's last
    checkpoint, and metrics.jsonl keeps exactly the rows logged before it (SFT's, not the first evaluation)."""
    run(tmp_path, *SFT, steps=2)
    whole = metrics(tmp_path)
    shutil.rmtree(tmp_path / "checkpoints" / "checkpoint_2")  # as if killed before the end of step 2
    manifest = json.loads((tmp_path / "checkpoints" / "checkpoint_0" / checkpoints.MANIFEST).read_text())
    assert manifest["state"]["metrics_rows"] == 1 and manifest["state"]["first_eval"] is None
    run(tmp_path, *SFT, steps=2)
    assert without_clock(metrics(tmp_path)) == without_clock(whole)
