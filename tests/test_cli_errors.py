"""The commands' errors (trainers/stopping.py: entry_point): the project's own errors are one line, ``error:
<message>``, and a non-zero exit status; ``--debug`` or MT_ENV_DEBUG=1 adds the traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from trainers.evaluate import main as evaluate_main
from trainers.ppo import main as ppo_main
from trainers.stopping import entry_point

from .conftest import ROOT, subprocess_env

#: GSM8K from a folder that is not there: the env's MtEnvError, raised while the run is built
NO_DATA = ["--set", "env.id=GSM8kTool-v0", "--set", "env.kwargs.data_path=/no/such/gsm8k", "--set",
           "tokenizer.name=offline:qwen2.5", "--set", "sft.steps=0", "--set", "threads=1"]


def one_line(stderr: str) -> str:
    """The error line, checked to be all there is (warnings of libraries aside)."""
    lines = [line for line in stderr.splitlines() if "Warning" not in line and line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("command, status, message", [
    (["-m", "envs.gsm8k.data", "--prepare", "/no/such/gsm8k", "--out", "rows.jsonl"], 1,
     "error: GSM8K data not found at /no/such/gsm8k: pass data_path="),
    ([ROOT / "trainers/export.py", "/no/such/run", "exported"], 2,
     "error: no checkpoint or run directory at /no/such/run"),
    ([ROOT / "benchmarks/bench_rollout_host.py", "--data", "/no/such/gsm8k"], 1,
     "error: GSM8K data not found at /no/such/gsm8k: "),
])
def test_a_command_prints_its_error_as_one_line(tmp_path, tmp_path_factory, command, status, message):
    results = tmp_path_factory.mktemp("results")  # a benchmark's log goes here, not over the checkout's record
    proc = subprocess.run([sys.executable, *command], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=subprocess_env(MT_ENV_RESULTS=str(results)))
    assert proc.returncode == status
    line = one_line(proc.stderr)
    assert line.startswith(message), line
    assert not any(tmp_path.iterdir())  # nothing written


def test_the_trainer_prints_missing_data_as_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    argv = ["--set", f"output_dir={tmp_path}", *NO_DATA]
    assert entry_point(ppo_main, argv) == 1
    assert one_line(capsys.readouterr().err).startswith("error: GSM8K data not found at /no/such/gsm8k:")
    for debug_argv, variable in ((argv + ["--debug"], None), (argv, "1")):
        if variable:
            monkeypatch.setenv("MT_ENV_DEBUG", variable)
        assert entry_point(ppo_main, debug_argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("Traceback") and "MtEnvError" in err and err.splitlines()[-1].startswith("error: GSM8K")


def test_evaluate_prints_a_missing_checkpoint_as_one_line(tmp_path, capsys):
    assert entry_point(evaluate_main, ["--config", "quickstart.yaml", "--checkpoint", str(tmp_path / "none")]) == 2
    assert one_line(capsys.readouterr().err) == f"error: --checkpoint: no checkpoint or run directory at " \
                                                f"{tmp_path / 'none'}"


def test_errors_of_other_kinds_keep_their_traceback():
    def bug(argv):
        raise ZeroDivisionError("a bug")

    with pytest.raises(ZeroDivisionError):
        entry_point(bug, [])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there: device=cuda is right")
@pytest.mark.parametrize("main", [ppo_main, evaluate_main])
def test_device_cuda_without_a_gpu_is_an_error_not_a_cpu_run(tmp_path, capsys, main):
    argv = ["--config", "quickstart.yaml", "--set", "device=cuda", "--set", f"output_dir={tmp_path}"]
    assert entry_point(main, argv) == 2
    assert one_line(capsys.readouterr().err).startswith("error: device=cuda, but torch ")
    assert not any(tmp_path.iterdir())  # refused before anything was written
