"""Silent wrong turns made loud: steps skipped for non-finite values stop the run with the cause, a mapping given with
``--set`` is merged into the recipe's (not a model of library defaults), and leaving at once on a second Ctrl-C or an
early one is a clean exit (status 130 and a line), never a C++ abort while torch threads run."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from trainers.config import load_config
from trainers.stopping import EmptySteps, NothingTrains, resume_command

from .conftest import ROOT, subprocess_env
from .test_trainer import metrics, run


# --------------------------------------------------------------------------------------------- non-finite steps
def test_a_run_whose_updates_are_all_skipped_stops_with_the_cause(tmp_path):
    """trainer.lr=100: the first updates overflow the weights, then every optimizer step has a non-finite loss or
    gradient and is skipped; three such steps in a row end the run (exit status 1 through `entry_point`)."""
    with pytest.raises(NothingTrains, match=r"steps (\d+)-(\d+) trained nothing: every optimizer step had a "
                                            r"non-finite loss or gradient, so their updates were skipped; .*"
                                            r"\(trainer.lr=100\): lower trainer.lr") as raised:
        run(tmp_path, "trainer.lr=100", "algorithm.entropy_coef=0.01", "sft.steps=0", "eval.episodes=2",
            "threads=1", steps=20)
    first, last = (int(x) for x in re.match(r"steps (\d+)-(\d+)", str(raised.value)).groups())
    rows = {r["step"]: r for r in metrics(tmp_path) if "actor/mini_batches" in r}
    assert last - first == 2 and max(rows) == last < 20
    assert all(rows[s]["actor/skipped_updates"] == rows[s]["actor/mini_batches"] for s in range(first, last + 1))


def test_skipped_and_empty_steps_count_together_only_in_a_row():
    guard = EmptySteps(limit=3)
    guard.add_non_finite(4, "non-finite logprobs or advantages", 1e-3)
    guard.add_non_finite(6, "non-finite logprobs or advantages", 1e-3)  # not in a row: counting starts again
    guard.add(7, {"rollout/episodes": 2, "rollout/failed": 2, "rollout/skipped": 0}, [])  # no trainable token
    with pytest.raises(NothingTrains, match=r"steps 6-8 trained nothing: non-finite logprobs or advantages, so "
                                            r"their updates were skipped; .*\(trainer.lr=0.001\)"):
        guard.add_non_finite(8, "non-finite logprobs or advantages", 1e-3)


# --------------------------------------------------------------------------------------------- --set of a mapping
def test_the_docs_quoting_example_changes_one_size_of_the_recipes_model():
    from trainers.modeling import build_causal_lm

    recipe = load_config("quickstart.yaml").model.config
    cfg = load_config("quickstart.yaml", ["model.config={hidden_size: 64}"])
    assert cfg.model.config == {**recipe, "hidden_size": 64}
    lm = build_causal_lm(config=cfg.model.config, vocab_size=708)
    assert lm.config.model_type == "llama" and lm.config.num_hidden_layers == recipe["num_hidden_layers"]
    assert sum(p.numel() for p in lm.parameters()) < 10**6


names = st.sampled_from(["a", "b", "c", "d"])
trees = st.recursive(st.integers(0, 9), lambda inner: st.dictionaries(names, inner, max_size=3), max_leaves=8)


def leaves(tree, prefix=()) -> dict:
    """{path: value} of the values of `tree` that are not a non-empty mapping."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    return {path: v for k, sub in tree.items() for path, v in leaves(sub, (*prefix, k)).items()}


def paths(tree, prefix=()) -> list[tuple]:
    """Every key path of `tree`, mappings included."""
    return [p for k, sub in tree.items() for p in [(*prefix, k), *(paths(sub, (*prefix, k))
                                                                  if isinstance(sub, dict) else [])]]


@given(recipe=st.dictionaries(names, trees, max_size=3), override=st.dictionaries(names, trees, max_size=3))
def test_a_mapping_set_keeps_every_key_it_does_not_name(recipe, override):
    """Merged key by key: every value of the override is set (an empty mapping empties); a value of the recipe is
    kept unless the override names its path, a path below it, or a value above it."""
    flow = [yaml.safe_dump(tree, default_flow_style=True).strip() for tree in (recipe, override)]
    cfg = load_config(None, ["model.preset=qwen2.5-0.5b", *(f"env.kwargs={text}" for text in flow)])
    merged = leaves(cfg.env.kwargs)
    given_leaves = leaves(override)
    assert {p: merged[p] for p in given_leaves} == given_leaves
    for p, v in leaves(recipe).items():
        if p and not any(q[:len(p)] == p for q in paths(override)) and not any(p[:len(q)] == q for q in given_leaves):
            assert merged[p] == v


# --------------------------------------------------------------------------------------------- leaving at once
#: a process with the embedded engine's situation: a daemon thread inside torch ops when the command ends
BUSY_TORCH = textwrap.dedent('''
    import sys, threading, time
    import torch
    from trainers.stopping import StopRequested, entry_point

    def work():
        a = torch.randn(256, 256)
        while True:
            a = (a @ a).tanh()

    def main(argv):
        threading.Thread(target=work, daemon=True).start()
        if argv == ["early"]:  # an interrupt outside the training loop (tokenizer, SFT, first evaluation)
            print("ready", flush=True)
            time.sleep(120)
        with StopRequested():
            print("ready", flush=True)
            time.sleep(120)
        return {}

    sys.exit(entry_point(main, sys.argv[1:]))
''')


@pytest.mark.parametrize("when, signals, message", [
    ("loop", 2, "SIGINT again: exiting now, without saving"),
    ("early", 1, "interrupted: nothing saved since the newest complete checkpoint"),
])
def test_leaving_at_once_while_torch_threads_run_is_a_clean_exit(tmp_path, when, signals, message):
    script = tmp_path / "busy.py"
    script.write_text(BUSY_TORCH)
    proc = subprocess.Popen([sys.executable, str(script), when], cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        for _ in range(signals):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
        _, stderr = proc.communicate(timeout=60)  # prompt: not the script's 120 s sleep
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert message in stderr and "Traceback" not in stderr and "terminate called" not in stderr


# --------------------------------------------------------------------------------------------- commands as printed
def test_the_resume_command_runs_with_the_venv_inactive(monkeypatch, tmp_path):
    """The interpreter of the printed command is the one running (a venv's, which needs no activation), shown
    relative to the working directory when inside it, as `make quickstart` leaves it: ``.venv/bin/python``."""
    monkeypatch.chdir(ROOT)
    python, script, *args = shlex.split(resume_command(["--set", "rollout.n=8"], "auto"))
    assert os.path.samefile(python, sys.executable) and script == "trainers/ppo.py"
    assert args == ["--set", "rollout.n=8"]
    bare = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/")}  # no venv on PATH, no PYTHONPATH
    assert subprocess.run([python, "-c", "import torch, accelerate"], cwd=ROOT, env=bare).returncode == 0

    monkeypatch.setattr(sys, "executable", str(tmp_path / ".venv" / "bin" / "python"))
    monkeypatch.chdir(tmp_path)
    python, script, *_ = shlex.split(resume_command([], "auto"))
    assert python == ".venv/bin/python" and script == str(ROOT / "trainers" / "ppo.py")


def test_evaluation_records_never_replace_a_runs_files(tmp_path):
    """trainers/evaluate.py's default --out: a new file in the evaluated run's eval/ folder, named for what was
    evaluated; the next evaluation of the same gets the next free name."""
    from trainers.evaluate import records_path

    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint_100"
    cfg = load_config("quickstart.yaml", [f"output_dir={tmp_path / 'recipe'}"])
    for expected in ("checkpoint_100.jsonl", "checkpoint_100-2.jsonl", "checkpoint_100-3.jsonl"):
        path = records_path(cfg, checkpoint)
        assert path == tmp_path / "run" / "eval" / expected
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    assert records_path(cfg, None) == tmp_path / "recipe" / "eval" / "random_init.jsonl"
    cfg.model.path = "Qwen/Qwen2.5-0.5B-Instruct"
    assert records_path(cfg, None) == tmp_path / "recipe" / "eval" / "Qwen2.5-0.5B-Instruct.jsonl"
