"""trainer.profile_step: the chosen RL step, and only it, under torch.profiler, as a Chrome trace that
benchmarks/trace_gaps.py reads."""

from __future__ import annotations

import pytest
import torch

from benchmarks import trace_gaps
from trainers.profiling import StepProfile

from .test_trainer import metrics, run


def test_only_the_chosen_step_is_profiled_and_its_trace_is_written_when_the_next_begins(tmp_path):
    said = []
    with StepProfile(2, tmp_path, rank=3, say=said.append) as profile:
        profile.at(1)
        assert not profile.active
        profile.at(2)
        assert profile.active
        torch.ones(4).add_(1)
        profile.at(3)  # step 2 ends here
        assert not profile.active and (tmp_path / "step_2_rank3.json.gz").is_file()
        profile.at(4)
    assert [p.name for p in tmp_path.iterdir()] == ["step_2_rank3.json.gz"] and len(said) == 1
    names = {e["name"] for e in trace_gaps.load(tmp_path / "step_2_rank3.json.gz")}
    assert "aten::add_" in names


def test_a_profiled_last_step_is_written_at_the_end_and_a_step_never_reached_writes_nothing(tmp_path):
    with StepProfile(2, tmp_path / "a") as profile:
        profile.at(1)
        profile.at(2)
    assert (tmp_path / "a" / "step_2_rank0.json.gz").is_file()
    with StepProfile(5, tmp_path / "b") as profile:
        profile.at(1)
    assert not (tmp_path / "b").exists()


def test_the_trainer_profiles_the_step_it_is_told_and_marks_its_row(tmp_path):
    run(tmp_path, "trainer.profile_step=2", "sft.steps=0")
    steps = [r for r in metrics(tmp_path) if "perf/step_s" in r]
    assert [r["perf/profiled"] for r in steps] == [0.0, 1.0]
    events = trace_gaps.load(tmp_path / "profile" / "step_2_rank0.json.gz")
    frames = {m.group(1).split("(")[0] + ":" + m.group(1).split(": ")[1] for e in events
              if e.get("cat") == "python_function" for m in [trace_gaps.OUR_FRAME.search(e["name"])] if m}
    assert {"trainers/ppo.py:update", "trainers/rollouts.py:play"} <= frames


def test_a_step_that_fails_keeps_its_error_when_its_trace_cannot_be_written(tmp_path):
    (tmp_path / "blocked").write_text("a file where the profile folder would go")
    said = []
    with pytest.raises(RuntimeError, match="the step's own error"):
        with StepProfile(1, tmp_path / "blocked", say=said.append) as profile:
            profile.at(1)
            raise RuntimeError("the step's own error")
    assert not profile.active and "not written" in said[0]
