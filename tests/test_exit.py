"""A process ends promptly once its work is done: with env processes (closed, or left open by a script that forgot
to close its driver), and with Inductor's compile workers started (even behind a sidecar process that does not
answer, which Inductor's own exit hook would wait 300 s for).

Each case is a small script run in a fresh interpreter, which prints ``END`` when its work is done; the test gives
the interpreter `EXIT_LIMIT_S` from there to exit with code 0 (a hang, not a speed, is what fails)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXIT_LIMIT_S = 60  # from END to the interpreter's exit
WORK_LIMIT_S = 600  # to END: starting interpreters and env processes on a busy machine

ENV_PROCESSES = """
import functools
from agents.rollout_processes import ProcessRolloutDriver
from agents.scripted import ScriptedBackend
from envs.calculator import CalculatorEnv
from mt_env import offline_tokenizer

def main():
    tokenizer = offline_tokenizer("qwen2.5")
    answer = tokenizer.encode("The answer is 6.", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    make_env = functools.partial(CalculatorEnv, tokenizer="offline:qwen2.5")
    drivers = [ProcessRolloutDriver(make_env, ScriptedBackend(lambda prompt: answer), processes=1) for _ in range(2)]
    for driver in drivers:
        result = driver.run([CalculatorEnv.task_for([2, 3])], n=2)
        assert result.metrics["rollout/completed"] == 2, result.metrics
    assert all(driver.pids for driver in drivers)
    drivers[0].close()  # the second driver is left open, its env process running: as a script that forgot
    print("END", flush=True)

if __name__ == "__main__":  # the env processes are spawned: they import this script
    main()
"""

COMPILE_WORKERS = """
import os
import signal
import torch._inductor.config
torch._inductor.config.compile_threads = 2  # a worker pool on any machine
from torch._inductor.async_compile import AsyncCompile
import agents.compiling

agents.compiling.COMPILE_WORKERS_STOP_S = 1.0  # the pool's grace before its sidecar is killed (5 s by default)
agents.compiling.stop_compile_workers_at_exit()  # what the first compilation through agents.compiling does
pool = AsyncCompile.process_pool()  # what Inductor's first compilation starts: its workers behind a sidecar
os.kill(pool.process.pid, signal.SIGSTOP)  # a sidecar that does not answer
print("END", flush=True)
"""


def run_script(source: str, tmp_path: Path) -> None:
    """Run `source` as a script; it must print END and then exit with code 0 within `EXIT_LIMIT_S`."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = _read_until_end(proc)
        try:
            code = proc.wait(timeout=EXIT_LIMIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the process did its work but had not exited {EXIT_LIMIT_S} s later")
        assert code == 0, "".join(lines) + proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _read_until_end(proc: subprocess.Popen) -> list[str]:
    lines: list[str] = []
    timer = threading.Timer(WORK_LIMIT_S, proc.kill)  # a script stuck before END fails, with its output
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == "END":
                return lines
    finally:
        timer.cancel()
    pytest.fail(f"the script ended (code {proc.wait()}) without finishing its work:\n{''.join(lines)}")


def test_a_script_with_env_processes_exits_promptly_closed_or_not(tmp_path):
    run_script(ENV_PROCESSES, tmp_path)


def test_compile_workers_do_not_hold_the_exit(tmp_path):
    pytest.importorskip("torch._inductor.compile_worker.subproc_pool")
    run_script(COMPILE_WORKERS, tmp_path)
