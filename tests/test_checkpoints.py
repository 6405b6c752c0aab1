"""The run directory (trainers/checkpoints.py) and early stops (trainers/stopping.py): the same command run twice,
atomic checkpoints and resuming from the newest complete one, metrics that read as one run across a resume, Ctrl-C,
and steps that train nothing."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainers import checkpoints
from trainers.checkpoints import Checkpointer, RunDirError, RunPlan, RunState, plan_run
from trainers.config import ConfigError, load_config
from trainers.stopping import EmptySteps, NothingTrains, StopRequested, entry_point, resume_command, shown_path

from .conftest import subprocess_env
from .test_trainer import ROOT, TINY, metrics, run


def newest(run_dir: Path) -> Path:
    """The highest-numbered checkpoint directory, complete or not."""
    return max((run_dir / "checkpoints").glob("checkpoint_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))


def training_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in metrics(run_dir) if "rollout/episodes" in r]


# --------------------------------------------------------------------------------------------- rerun (issue 10.1)
def test_the_same_command_twice_keeps_the_run_and_exits_at_once(tmp_path, capsys):
    first = run(tmp_path, "trainer.save_every=1")
    before = (tmp_path / "metrics.jsonl").read_bytes()
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    again = run(tmp_path, "trainer.save_every=1")
    out = capsys.readouterr().out
    assert f"{tmp_path} already holds a finished run: 2 steps" in out and f"--set output_dir={tmp_path}-2" in out
    assert again == {k: first[k] for k in ("steps", "start_val_success", "final_val_success")} | {
        "elapsed_s": again["elapsed_s"]}
    assert (tmp_path / "metrics.jsonl").read_bytes() == before  # nothing rewritten
    # checkpoint_0: at the end of SFT (sft.save_every)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == saved == [
        "checkpoint_0", "checkpoint_1", "checkpoint_2"]
    # once SFT is over, its optimizer is not saved: one optimizer file, the RL one
    for step in (0, 2):
        assert sorted(p.name for p in (tmp_path / "checkpoints" / f"checkpoint_{step}").glob("optimizer*")) == [
            "optimizer.bin"]
        assert not list((tmp_path / "checkpoints" / f"checkpoint_{step}").glob("sft_state*"))


def test_a_run_without_a_complete_checkpoint_is_refused_at_start(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / ".checkpoint_5.tmp").mkdir(parents=True)
    rows = [{"step": 0, "val/success": 0.5}, {"step": 1, "rollout/episodes": 8}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config("quickstart.yaml", [f"output_dir={out}"])
    with pytest.raises(RunDirError, match=rf"{out} holds a run that logged RL steps but has no complete checkpoint "
                                          rf".*checkpoint_5.tmp: its save did not finish.*--set output_dir={out}-2"):
        plan_run(cfg)
    (out / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")  # nothing after RL started: start over
    assert plan_run(cfg).checkpoint is None and plan_run(cfg).state.step == 0


def write_checkpoint(run_dir: Path, step: int, files: dict[str, bytes] | None = None) -> Path:
    """A checkpoint directory as `Checkpointer` publishes it (the run plan only reads manifests)."""
    path = run_dir / "checkpoints" / f"checkpoint_{step}"
    path.mkdir(parents=True)
    for name, data in (files or {}).items():
        (path / name).write_bytes(data)
    state = RunState(step=step, prior_s=10.0 * step, first_eval={"val/success": 0.25}, last_eval={"val/success": 0.5})
    manifest = {"state": state.to_json(), "files": {n: len(d) for n, d in (files or {}).items()}}
    (path / checkpoints.MANIFEST).write_text(json.dumps(manifest))
    return path


def test_run_plan_resume_rules(tmp_path):
    out = tmp_path / "run"
    cfg = load_config("quickstart.yaml", [f"output_dir={out}", "trainer.total_steps=10"])
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg.to_dict()))
    write_checkpoint(out, 3)
    write_checkpoint(out, 6, {"model.safetensors": b"x" * 10})
    plan = plan_run(cfg)
    assert plan.checkpoint == out / "checkpoints" / "checkpoint_6" and not plan.finished
    assert plan.state.step == 6 and plan.state.first_eval == {"val/success": 0.25} and plan.state.elapsed() >= 60
    # a resume may extend the run, not change what it trains
    assert plan_run(load_config("quickstart.yaml", [f"output_dir={out}", "trainer.total_steps=20"])).state.step == 6
    with pytest.raises(RunDirError, match=r"other settings \(rollout.n: 8 -> 4\).*--set output_dir="):
        plan_run(load_config("quickstart.yaml", [f"output_dir={out}", "trainer.total_steps=10", "rollout.n=4"]))
    with pytest.raises(RunDirError, match="already holds a run and trainer.resume is null"):
        plan_run(load_config("quickstart.yaml", [f"output_dir={out}", "trainer.resume=null"]))
    older = out / "checkpoints" / "checkpoint_3"
    with pytest.raises(RunDirError, match="is older than .* newest checkpoint .*would mix two histories"):
        plan_run(load_config("quickstart.yaml", [f"output_dir={out}", f"trainer.resume={older}"]))
    fork = plan_run(load_config("quickstart.yaml", [f"output_dir={tmp_path / 'fork'}", f"trainer.resume={older}"]))
    assert fork.checkpoint == older and fork.state.step == 3
    renamed = out / "checkpoints" / "best"  # complete, but not one the run wrote: a clear refusal, not an IndexError
    shutil.copytree(older, renamed)
    with pytest.raises(RunDirError, match=r"is inside .* but not one of its checkpoints .*--set output_dir="):
        plan_run(load_config("quickstart.yaml", [f"output_dir={out}", f"trainer.resume={renamed}"]))
    shutil.rmtree(renamed)
    done = plan_run(load_config("quickstart.yaml", [f"output_dir={out}", "trainer.total_steps=6"]))
    assert done.finished and "already holds a finished run: 6 steps" in done.notes[0] and "25.0%" in done.notes[0]
    # a file of the newest checkpoint is short: resume from the one before, and say why
    (out / "checkpoints" / "checkpoint_6" / "model.safetensors").write_bytes(b"x" * 4)
    plan = plan_run(cfg)
    assert plan.checkpoint == older
    assert f"skipped {out / 'checkpoints' / 'checkpoint_6'}: model.safetensors has 4 bytes, not 10" in plan.notes


# --------------------------------------------------------------------------------------------- atomic saves (10.2)
class Killed(Exception):
    pass


def tiny_trainer(tmp_path, keep_last=2, model: dict | None = None, tokenizer_name: str = "task"):
    """The trainer's checkpointed objects, small: a prepared policy and its optimizer, and the `Checkpointer`."""
    from accelerate import Accelerator

    from trainers.modeling import PolicyModel, build_causal_lm
    from trainers.setup import make_tokenizer

    cfg = load_config("quickstart.yaml", [f"output_dir={tmp_path}", *TINY[:1], f"tokenizer.name={tokenizer_name}"])
    tokenizer = make_tokenizer(cfg)
    lm = build_causal_lm(config=cfg.model.config | (model or {}), vocab_size=len(tokenizer))
    accelerator = Accelerator(cpu=True)
    policy = PolicyModel(lm, vocab_limit=len(tokenizer))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    plan = RunPlan(Path(tmp_path), RunState())
    return accelerator, Checkpointer(accelerator, plan, keep_last, lm, tokenizer), tokenizer


def test_checkpoints_are_written_atomically_and_pruned(tmp_path, monkeypatch):
    accelerator, saver, _ = tiny_trainer(tmp_path, keep_last=2)
    state = RunState()
    incomplete = tmp_path / "checkpoints" / "checkpoint_3"  # e.g. written by an older trainer: no manifest
    incomplete.mkdir(parents=True)
    (incomplete / "model.safetensors").write_bytes(b"old")
    for step in (1, 2, 3):
        state.step = step
        saver.save(state)
    found = checkpoints.scan(tmp_path)
    assert [(f.path.name, f.problem) for f in found] == [("checkpoint_2", None), ("checkpoint_3", None)]
    assert checkpoints.read_state(found[-1].path).step == 3

    def killed_half_way(output_dir):  # the process dies while accelerate writes: model written, optimizer not
        Path(output_dir, "model.safetensors").write_bytes(b"partial")
        raise Killed

    monkeypatch.setattr(accelerator, "save_state", killed_half_way)
    state.step = 4
    with pytest.raises(Killed):
        saver.save(state)
    found = checkpoints.scan(tmp_path)
    assert [(f.path.name, f.problem) for f in found] == [
        ("checkpoint_2", None), ("checkpoint_3", None), (".checkpoint_4.tmp", "its save did not finish")]
    assert checkpoints.resolve(tmp_path).name == "checkpoint_3"
    monkeypatch.undo()
    state.step = 5
    saver.save(state)  # removes the killed save's leftovers, keeps the newest 2 complete checkpoints
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_3", "checkpoint_5"]
    assert saver.save(state) == tmp_path / "checkpoints" / "checkpoint_5"  # the same step again: nothing written


def test_resume_skips_a_half_written_newest_checkpoint(tmp_path, capsys):
    run(tmp_path, "trainer.save_every=1")
    half = newest(tmp_path)
    (half / "optimizer.bin").unlink()  # killed during its save (written before saves were atomic)
    summary = run(tmp_path, "trainer.save_every=1", steps=3)
    out = capsys.readouterr().out
    assert summary["steps"] == 3
    assert f"skipped {half}: optimizer.bin is missing" in out
    assert "resuming from" in out and "(step 1)" in out
    assert training_steps(tmp_path) == [1, 2, 3]


# --------------------------------------------------------------------------------------------- loading
def saved_perturbed(run_dir: Path, tie: bool):
    """A checkpoint whose weights differ from the fresh init that a model of the same config starts from."""
    _, saver, tokenizer = tiny_trainer(run_dir, model={"tie_word_embeddings": tie})
    with torch.no_grad():
        for p in saver.lm.parameters():
            p.add_(torch.randn_like(p))
    return saver.lm, tokenizer, saver.save(RunState(step=1))


@pytest.mark.parametrize("tie", [False, True])
def test_a_checkpoint_loads_into_a_model_of_its_shape_only(tmp_path, tie):
    """`load_policy_weights` (evaluate.py and export.py): every weight comes from the checkpoint, the output layer
    of a tied model from its embeddings (saved once); a model of another shape is refused, naming the keys."""
    from transformers import AutoModelForCausalLM

    trained, _, checkpoint = saved_perturbed(tmp_path, tie)
    where = re.escape(str(checkpoint))

    def model(**changes):
        return AutoModelForCausalLM.from_config(type(trained.config)(**trained.config.to_dict() | changes))

    lm = model()
    assert not torch.equal(lm.model.embed_tokens.weight, trained.model.embed_tokens.weight)
    checkpoints.load_policy_weights(lm, checkpoint, "the recipe's model")
    assert lm.state_dict().keys() == trained.state_dict().keys()
    assert all(torch.equal(v, trained.state_dict()[k]) for k, v in lm.state_dict().items())
    with pytest.raises(RuntimeError, match=rf"^{where} does not match its config.json: missing \[\], "
                                           rf"unexpected \['model.layers.1.input_layernorm.weight'"):
        checkpoints.load_policy_weights(model(num_hidden_layers=1), checkpoint, "its config.json")
    rows = trained.config.vocab_size  # e.g. a random-init run saved before its preset's vocabulary was kept
    with pytest.raises(RuntimeError, match=rf"^{where} has an embedding of {rows} rows but the recipe's model builds "
                                           rf"{rows + 7}: build it with --set model.config.vocab_size={rows}$"):
        checkpoints.load_policy_weights(model(vocab_size=rows + 7), checkpoint, "the recipe's model")
    if tie:  # an untied model would keep its random output layer
        with pytest.raises(RuntimeError, match=rf"^{where} does not match the recipe's model: missing "
                                               rf"\['lm_head.weight'\], unexpected \[\]$"):
            checkpoints.load_policy_weights(model(tie_word_embeddings=False), checkpoint, "the recipe's model")
    else:  # a tied model would take the checkpoint's output layer as its embeddings
        tied = model(tie_word_embeddings=True)
        before = tied.model.embed_tokens.weight.clone()
        with pytest.raises(RuntimeError, match=rf"^{where} has an output layer of its own; the recipe's model ties"):
            checkpoints.load_policy_weights(tied, checkpoint, "the recipe's model")
        assert torch.equal(tied.model.embed_tokens.weight, before)


def test_evaluate_loads_a_checkpoint_that_matches_its_recipe(tmp_path):
    """trainers/evaluate.py --checkpoint rebuilds the model from the recipe: a recipe whose model does not tie its
    output layer, given a tied checkpoint, is refused before any episode (not evaluated with a random layer)."""
    from trainers.evaluate import main as evaluate_main

    _, _, checkpoint = saved_perturbed(tmp_path / "run", tie=True)
    where = re.escape(str(checkpoint))
    args = ["--config", "quickstart.yaml", "--checkpoint", str(tmp_path / "run"), "--episodes", "2",
            "--out", str(tmp_path / "episodes.jsonl")]
    tied = TINY[0].replace("}", ", tie_word_embeddings: true}")
    assert evaluate_main([*args, "--set", tied])["episodes"] == 2
    with pytest.raises(ConfigError, match=rf"^--checkpoint: {where} does not match the recipe's model: missing "
                                          rf"\['lm_head.weight'\].*: evaluate it with the recipe it was trained with"):
        evaluate_main([*args, "--set", TINY[0]])


# --------------------------------------------------------------------------------------------- metrics (10.3)
def test_metrics_read_as_one_run_across_a_resume(tmp_path):
    run(tmp_path, "trainer.save_every=2", steps=3)
    shutil.rmtree(newest(tmp_path))  # killed after step 3's metrics, before its checkpoint: resume from step 2
    rows_before = metrics(tmp_path)
    step0_eval = next(r for r in rows_before if r["step"] == 0 and "val/success" in r)
    summary = run(tmp_path, "trainer.save_every=2", steps=4)
    rows = metrics(tmp_path)
    assert training_steps(tmp_path) == [1, 2, 3, 4]  # no step twice
    assert [r["step"] for r in rows if "val/success" in r] == [0, 4]  # one evaluation before RL, one at the end
    times = [r["time_s"] for r in rows]
    assert times == sorted(times)  # the run's clock continues across the resume
    elapsed = [r["perf/elapsed_s"] for r in rows if "perf/elapsed_s" in r]
    assert elapsed == sorted(elapsed) and elapsed[2] > elapsed[1]
    resumed = checkpoints.read_state(newest(tmp_path))
    assert resumed.first_eval == {k: v for k, v in step0_eval.items() if k.startswith("val/")}
    assert summary["start_val_success"] == step0_eval["val/success"]  # "before RL" is the original figure


# --------------------------------------------------------------------------------------------- interrupts (10.4)
def test_ctrl_c_saves_at_the_step_boundary_and_the_same_command_resumes(tmp_path):
    out = tmp_path / "run"
    args = ["--set", f"output_dir={out}", "--set", "trainer.total_steps=1000", "--set", "threads=1",
            *[a for o in TINY for a in ("--set", o)]]
    env = subprocess_env()
    proc = subprocess.Popen([sys.executable, str(ROOT / "trainers" / "ppo.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").is_file() and any(r["step"] >= 1 for r in metrics(out)):
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, stdout[-2000:] + stderr[-2000:]
    assert "SIGINT: stopping after this step with a checkpoint" in stderr and "Traceback" not in stderr
    stopped_at = training_steps(out)[-1]
    saved = out / "checkpoints" / f"checkpoint_{stopped_at}"
    assert f"SIGINT: stopped at step {stopped_at}, checkpoint {saved}" in stdout
    assert f"To continue, run the same command: {shown_path(sys.executable)} trainers/ppo.py {' '.join(args[:2])}" \
        in stdout
    assert checkpoints.problem(saved) is None and checkpoints.read_state(saved).step == stopped_at
    summary = run(out, "threads=1", steps=stopped_at + 1)  # resumes: one more step
    assert summary["steps"] == stopped_at + 1 and training_steps(out) == list(range(1, stopped_at + 2))


def test_signals_set_a_flag():
    """(A second signal ends the process: tests/test_wrong_turns.py sends it to a child process.)"""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    before = signal.getsignal(signal.SIGINT)
    with StopRequested(announce=False) as stop:
        assert not stop.agreed(accelerator)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed(accelerator) and stop.name == "SIGTERM"
    assert signal.getsignal(signal.SIGINT) is before
    assert entry_point(lambda argv: {"stopped_by": "SIGTERM"}) == 143
    assert entry_point(lambda argv: {"stopped_by": "SIGINT"}) == 130
    assert entry_point(lambda argv: {"steps": 3}) == 0


def test_the_resume_command_is_the_same_command(monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = ["--config", "x.yaml", "--set", "trainer.resume=runs/a/checkpoints/checkpoint_4", "--set", "rollout.n=8"]
    python = shlex.quote(shown_path(sys.executable))  # the interpreter running (tests/test_wrong_turns.py)
    assert resume_command(argv, "runs/a/checkpoints/checkpoint_4") == (
        f"{python} trainers/ppo.py --config x.yaml --set rollout.n=8 --set trainer.resume=auto")
    assert resume_command(["--set", "output_dir=my run"], "auto") == \
        f"{python} trainers/ppo.py --set 'output_dir=my run'"


# --------------------------------------------------------------------------------------------- nothing trains (10.5)
def test_a_run_where_nothing_trains_stops_with_the_cause(tmp_path, capsys):
    with pytest.raises(NothingTrains, match=r"steps 1-3 trained nothing: of 8 episodes per step, 8 were skipped and 0 "
                                            r"failed \(skipped: the prompt is \d+ tokens, over max_prompt_tokens=8\): "
                                            r"raise env.budget.max_prompt_tokens"):
        run(tmp_path, "env.budget.max_prompt_tokens=8", "sft.steps=0", steps=10)
    assert training_steps(tmp_path) == [1, 2, 3]
    assert entry_point(lambda argv: run(tmp_path / "cli", "env.budget.max_prompt_tokens=8", "sft.steps=0",
                                        steps=10)) == 1
    assert capsys.readouterr().err.startswith("error: steps 1-3 trained nothing")


def test_failed_episodes_are_named_as_the_cause():
    from agents.rollout import EpisodeId, EpisodeRecord, EpisodeState

    failed = [EpisodeRecord(EpisodeId(0, i), EpisodeState.FAILED, error="BackendError: generation timed out")
              for i in range(4)]
    guard = EmptySteps(limit=2)
    guard.add(5, {"rollout/episodes": 4, "rollout/failed": 4, "rollout/skipped": 0}, failed)
    guard.add(7, {"rollout/episodes": 4, "rollout/failed": 4, "rollout/skipped": 0}, failed)  # not in a row
    with pytest.raises(NothingTrains, match=r"steps 7-8 trained nothing: of 4 episodes per step, 0 were skipped and 4 "
                                            r"failed \(e.g. BackendError: generation timed out\)"):
        guard.add(8, {"rollout/episodes": 4, "rollout/failed": 4, "rollout/skipped": 0}, failed)


def test_a_metrics_line_cut_short_by_a_kill_is_left_out(tmp_path):
    from mt_env.trajectories import read_metrics
    from trainers.tracking import Tracker

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"')
    assert read_metrics(path) == [{"step": 1, "a": 1}, {"step": 2, "a": 2}]
    tracker = Tracker(tmp_path, {}, resume_step=1, clock=lambda: 42.0)
    tracker.log(2, {"a": 5}, console=False)
    tracker.close()
    assert read_metrics(path) == [{"step": 1, "a": 1}, {"step": 2, "time_s": 42.0, "a": 5}]
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl, line 2: not a JSON row"):
        read_metrics(path)
