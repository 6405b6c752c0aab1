"""``isolation: process`` from a user's point of view (mt_env/isolation.py): a tool defined in the user's own script,
which has no ``if __name__ == "__main__":`` guard, works in its worker processes (the script never runs again there);
when a worker cannot build the tool, the error names the real exception and its message, on one line."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from mt_env.tools import BaseTool, ToolBox, ToolCall, ToolError

from .conftest import ROOT, subprocess_env

SCHEMA = {"type": "function", "function": {"name": "blk", "description": "Sleeps, then answers.", "parameters": {
    "type": "object", "properties": {"s": {"type": "number"}}, "required": ["s"]}}}

UNGUARDED = """
import asyncio, json, os, sys, time
from mt_env.tools import BaseTool, ToolBox, ToolCall

with open(sys.argv[1], "a") as runs:  # how many times this script runs
    runs.write(f"{os.getpid()}\\n")

class Blk(BaseTool):
    async def execute(self, instance_id, arguments, **kwargs):
        time.sleep(arguments["s"])  # blocks: the reason for isolation: process
        return str(os.getpid()), 0.0, {}

async def episode():
    async with ToolBox([Blk({"isolation": "process", "timeout": 1}, SCHEMA)]) as box:
        await box.create_all()
        return [await box.execute(ToolCall("blk", {"s": s})) for s in (0, 60, 0)]

results = asyncio.run(episode())
print(json.dumps([[r.error_kind, r.text] for r in results]))
"""


def test_a_tool_defined_in_an_unguarded_script_runs_in_worker_processes(tmp_path):
    script, runs = tmp_path / "train_my_tool.py", tmp_path / "runs.txt"
    script.write_text(f"SCHEMA = {SCHEMA!r}\n{UNGUARDED}")
    proc = subprocess.run([sys.executable, str(script), str(runs)], capture_output=True, text=True, timeout=120,
                          env=subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (ok, first), (hung, error), (again, second) = json.loads(proc.stdout.splitlines()[-1])
    script_pid = int(runs.read_text())  # the script ran once: never again in a worker
    assert ok is None and int(first) != script_pid
    assert hung == "timeout" and error == "Error: tool 'blk' timed out after 1s"  # held to its timeout
    assert again is None and int(second) not in (script_pid, int(first))  # a new worker after the kill
    assert "Traceback" not in proc.stderr


class FailsInItsWorker(BaseTool):
    """Builds in the process that makes it first; in a worker process, fails as ``config["fail"]`` says."""

    def __init__(self, config=None, tool_schema=None):
        config = {"first_pid": os.getpid(), **(config or {})}
        super().__init__(config, tool_schema or SCHEMA)
        if config["first_pid"] != os.getpid() and config["fail"] == "raise":
            raise RuntimeError("\n    no licence for this host\n    (multi-line, as some libraries write them)\n")
        if config["first_pid"] != os.getpid() and config["fail"] == "exit":
            os._exit(3)


def create_error(tool: BaseTool) -> str:
    async def episode():
        async with ToolBox([tool]) as box:
            await box.create_all()

    with pytest.raises(ToolError) as caught:
        asyncio.run(episode())
    return str(caught.value)


def test_a_tool_that_fails_in_its_worker_says_why_on_one_line():
    assert create_error(FailsInItsWorker({"isolation": "process", "fail": "raise"})) == (
        "tool 'blk' could not create its instance for this episode: RuntimeError: no licence for this host "
        "(multi-line, as some libraries write them)")
    assert create_error(FailsInItsWorker({"isolation": "process", "fail": "exit"})) == (
        "tool 'blk' could not create its instance for this episode: ToolError: the worker process of tool 'blk' "
        "died while it built its copy of the tool (in the tool's constructor, or as it loaded the tool's class)")


def test_a_class_the_worker_cannot_import_is_named_with_the_reason(tmp_path):
    """A module the main process imported from a path that is not on sys.path: the worker cannot import it."""
    (tmp_path / "my_hidden_tools.py").write_text(textwrap.dedent(f"""
        from mt_env.tools import BaseTool

        class Hidden(BaseTool):
            async def execute(self, instance_id, arguments, **kwargs):
                return "never", 0.0, {{}}

        SCHEMA = {SCHEMA!r}
    """))
    spec = importlib.util.spec_from_file_location("my_hidden_tools", tmp_path / "my_hidden_tools.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["my_hidden_tools"] = module
    try:
        spec.loader.exec_module(module)
        message = create_error(module.Hidden({"isolation": "process"}, module.SCHEMA))
    finally:
        del sys.modules["my_hidden_tools"]
    assert message.startswith(
        "tool 'blk' could not create its instance for this episode: ToolError: its worker process could not load "
        "the class my_hidden_tools.Hidden: ModuleNotFoundError: No module named 'my_hidden_tools'. A class defined "
        "in a module is imported by name in the worker")


def test_the_launcher_and_its_workers_end_with_the_main_process(tmp_path):
    """No process is left behind when the script that used isolated tools exits (its worker sat idle)."""
    script = tmp_path / "short.py"
    script.write_text(f"SCHEMA = {SCHEMA!r}\n" + UNGUARDED.replace("(0, 60, 0)", "(0,)") + textwrap.dedent("""
        from mt_env.isolation import _Launcher
        print(json.dumps([_Launcher._current.process.pid, int(results[0].text)]))
    """))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "runs.txt")], capture_output=True, text=True,
                          timeout=120, env=subprocess_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launcher, worker = json.loads(proc.stdout.splitlines()[-1])
    for pid in (launcher, worker):
        for _ in range(100):
            if not _alive(pid):
                break
            asyncio.run(asyncio.sleep(0.05))
        assert not _alive(pid), f"process {pid} outlived the script"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
