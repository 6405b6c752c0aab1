"""The tool runner's isolation: an episode never hangs on a tool. Each kind of hang (a blocking tool in a worker
process, hung threads, a tool that blocks the event loop) is a timeout error for its own env while the others step
on, and holds up neither `asyncio.run`, the rollout driver nor the interpreter's exit; `isolation: process` runs a
tool's lifecycle in a worker process (reused, restarted after a crash, its own timeouts reported as its own)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from agents.rollout import RolloutDriver
from agents.scripted import ScriptedBackend
from envs.calculator import CalculatorEnv
from mt_env import isolation
from mt_env.calculator import CalculatorTool
from mt_env.errors import ToolConfigError
from mt_env.parsers import HermesParser, ToolCall
from mt_env.tools import ToolBox
from mt_env.vector import ToolVectorEnv

from .tool_fixtures import EchoTool, run_episode, schema
from .uncooperative_tools import (
    HANG_CAP_S,
    BlockingTool,
    SlowStartTool,
    ThreadTool,
    TimeoutOnRecreateTool,
    TimeoutOnStartTool,
)

# ------------------------------------------------------------------------------------------------ tools that hang
# Each kind of hang, in a vector env of 8: the hung call is a timeout error for its own env while the other envs'
# steps go on. Hangs last `HANG_CAP_S` (30 s) unless released, against timeouts of 0.5-1 s, so "the step returned
# while the tool still hung" is a behaviour, not a speed, and a regression fails (after the cap) instead of hanging.

def vector_env(tools, n=8, **env_kwargs):
    envs = ToolVectorEnv([lambda: CalculatorEnv(tools=[CalculatorTool(), *tools], **env_kwargs) for _ in range(n)])
    tasks = [dict(CalculatorEnv.task_for([6, 7]), tools_kwargs={t.name: {"create_kwargs": {"label": f"env{i}"}}
                                                                for t in tools if t.name == "block"})
             for i in range(n)]
    envs.reset_subset(range(n), options=[{"task": task} for task in tasks])
    return envs


def turn(*calls: ToolCall) -> str:
    return HermesParser.format_turn(list(calls))


def results_of(step) -> list[dict]:
    return step[4]["tool_results"]


SIX_BY_SEVEN = ToolCall("calculator", {"expression": "6 * 7"})


def process_gone(pid: int, wait_s: float = 10.0) -> bool:
    """Whether process `pid` has exited (or is a zombie), waiting up to `wait_s` for it."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between the open and the read
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("how", ["sleep", "lock"])
def test_a_blocking_tool_in_a_worker_process_is_killed_at_its_timeout_and_stalls_no_other_env(tmp_path, how):
    blocking = BlockingTool({"timeout": 1.0, "isolation": "process"})
    envs = vector_env([blocking], max_turns=5)
    first = envs.step_subset([0], [turn(ToolCall("block", {"how": "answer"}))])
    label, pid = first[0][0]["text"].split(": ", 1)[1].split()
    assert label == "env0" and int(pid) != os.getpid()  # the instance lives in a worker process

    release = tmp_path / "release"  # never created: only the kill can end the hang

    async def env0_hangs_while_the_others_step():
        hung = asyncio.ensure_future(envs.astep_subset([0], [turn(ToolCall("block", {"how": how,
                                                                                     "release": str(release)}))]))
        others = await envs.astep_subset(range(1, 8), [turn(SIX_BY_SEVEN)] * 7)
        return others, hung.done(), await hung

    others, hung_was_done, (blocked,) = asyncio.run(env0_hangs_while_the_others_step())
    assert not hung_was_done  # the other seven envs stepped while env 0's tool was blocked
    assert [results_of(step)[0]["error"] for step in others] == [None] * 7
    assert [step[0]["text"] for step in others] == ["tool: 42"] * 7
    assert results_of(blocked)[0]["error_kind"] == "timeout"
    assert process_gone(int(pid))  # killed, not left running

    again = envs.step_subset([0], [turn(ToolCall("block", {"how": "answer"}))])  # the episode goes on
    new_label, new_pid = again[0][0]["text"].split(": ", 1)[1].split()
    assert new_label == "env0" and new_pid != pid  # re-created with its create_kwargs in a fresh process
    envs.close()
    assert all(e.tool_counts["created"] == e.tool_counts["released"] for e in envs.base_envs)


def test_hung_threads_never_starve_the_other_threaded_calls():
    gate = threading.Event()
    tool = ThreadTool(gate, {"timeout": 0.5})
    envs = vector_env([tool], max_parallel_tools=5)
    try:  # 40 hung threads: more than any default thread pool has (at most 32)
        hung = envs.step_subset(range(8), [turn(*[ToolCall("thread", {"hang": True})] * 5)] * 8)
        assert [r["error_kind"] for step in hung for r in results_of(step)] == ["timeout"] * 40
        quick = envs.step_subset(range(8), [turn(ToolCall("thread", {"hang": False}))] * 8)
        assert [r["error"] for step in quick for r in results_of(step)] == [None] * 8
        assert tool.returned == 8 and not gate.is_set()  # the hung ones still hang
    finally:
        gate.set()
        envs.close()


def test_a_hung_thread_does_not_hold_up_the_end_of_asyncio_run():
    """`RolloutDriver.run` is `asyncio.run(arun(...))`: its loop's shutdown must not wait for a hung tool thread."""
    gate = threading.Event()
    tool = ThreadTool(gate, {"timeout": 0.2})
    try:
        (result,), _ = run_episode([tool], [ToolCall("thread", {"hang": True})])
        assert result.error_kind == "timeout" and tool.returned == 0  # asyncio.run returned; the thread still waits
    finally:
        gate.set()


def test_the_rollout_driver_does_not_wait_for_a_hung_tool_thread(qwen25):
    """The issue's case: `RolloutDriver.run` stalled at shutdown until a hung tool thread returned."""
    gate = threading.Event()
    tool = ThreadTool(gate, {"timeout": 0.2})
    probe = CalculatorEnv(tokenizer=qwen25, tools=[tool])
    probe.reset(seed=0)
    fmt = probe.conversation.fmt

    def script(prompt):
        answered = "<tool_response>" in fmt.decode(prompt)
        text = "The answer is 6." if answered else turn(ToolCall("thread", {"hang": True}))
        return fmt.encode(text) + [fmt.end_of_turn_id]

    driver = RolloutDriver(lambda: CalculatorEnv(tokenizer=qwen25, tools=[tool]), ScriptedBackend(script))
    try:
        (episode,) = driver.run([CalculatorEnv.task_for([2, 3])]).episodes
        assert episode.success and episode.tool_errors == 1 and tool.returned == 0  # returned; the thread hangs on
    finally:
        gate.set()
        driver.close()


def test_a_hung_thread_does_not_hold_up_the_interpreter_exit():
    script = textwrap.dedent("""
        import asyncio
        from mt_env.parsers import ToolCall
        from mt_env.tools import ToolBox
        from tests.uncooperative_tools import ThreadTool

        async def episode():
            async with ToolBox([ThreadTool(gate=None, config={"timeout": 0.2})]) as box:  # gate None: hangs forever
                await box.create_all()
                return await box.execute(ToolCall("thread", {"hang": True}))

        print(asyncio.run(episode()).error_kind)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])  # the timeout only catches a hang
    assert done.returncode == 0 and done.stdout.split() == ["timeout"], done.stderr


def test_a_tool_that_blocks_the_loop_is_named_in_a_warning(monkeypatch):
    monkeypatch.setattr(isolation, "BLOCKING_WARNING_S", 0.05)
    warnings = []
    warned = threading.Event()

    class Collect(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())
            warned.set()

    class LoopBlocker(EchoTool):
        async def execute(self, instance_id, arguments, **execute_kwargs):
            warned.wait(HANG_CAP_S)  # blocks the event loop's thread until the watchdog speaks up
            return "done", 0.0, {}

    handler = Collect(logging.WARNING)
    logging.getLogger("mt_env.isolation").addHandler(handler)
    try:
        (result,), _ = run_episode([LoopBlocker(tool_schema=schema("blocker"))], [ToolCall("blocker", {})])
    finally:
        logging.getLogger("mt_env.isolation").removeHandler(handler)
    assert result.ok and len(warnings) == 1
    assert warnings[0].startswith("tool 'blocker' has blocked the event loop for ")
    assert "in one step of execute()" in warnings[0] and "`isolation: process`" in warnings[0]


# ------------------------------------------------------------------------------------------------ isolation: process
def isolated_episode(tool, calls, label="a"):
    (*results,), box = run_episode([tool], calls, {"block": {"create_kwargs": {"label": label}}})
    return results, box


def answer() -> ToolCall:
    return ToolCall("block", {"how": "answer"})


def test_an_isolated_tool_runs_its_lifecycle_in_a_worker_process_reused_across_episodes():
    tool = BlockingTool({"isolation": "process"})
    (first,), box = isolated_episode(tool, [answer()], label="a")
    (second,), _ = isolated_episode(tool, [answer()], label="b")
    assert first.text.split()[0] == "a" and second.text.split()[0] == "b"  # create_kwargs reached each instance
    assert first.text.split()[1] == second.text.split()[1] != str(os.getpid())  # one worker, reused
    assert box.counts["created"] == box.counts["released"] == 1
    assert tool.labels == {}  # the parent's copy of the tool never ran


def test_a_crashed_worker_is_an_error_observation_and_the_next_call_gets_a_fresh_one():
    (before, crashed, failed, after), box = isolated_episode(
        BlockingTool({"isolation": "process"}),
        [answer(), ToolCall("block", {"how": "crash"}), ToolCall("block", {"how": "fail"}), answer()])
    assert crashed.error_kind == "exception" and crashed.text == "Error: the worker process of tool 'block' died"
    assert failed.error_kind == "exception" and failed.text.startswith("Error: refused in process ")  # as written
    assert after.ok and after.text.split()[0] == "a" and after.text.split()[1] != before.text.split()[1]
    assert box.counts["released"] == 1


def test_a_tools_own_timeout_while_creating_its_instance_again_is_not_reported_as_ours(tmp_path):
    """After a crash the instance is created again in a new worker; a TimeoutError the tool's create raises there is
    the tool's error, not "could not create its instance again within Ns" (the limit did not expire)."""
    marker = tmp_path / "recreate"
    tool = TimeoutOnRecreateTool({"isolation": "process", "timeout": 30, "recreate_fails": str(marker)})

    async def episode():
        async with ToolBox([tool]) as box:
            await box.create_all({"block": {"create_kwargs": {"label": "a"}}})
            marker.touch()
            return await box.execute(ToolCall("block", {"how": "crash"})), await box.execute(answer())

    crashed, after = asyncio.run(episode())
    assert crashed.error_kind == "exception" and after.error_kind == "exception"
    assert "the tool's own upstream timed out" in after.text and "could not create" not in after.text


def test_a_tools_own_timeout_while_its_worker_starts_is_not_reported_as_ours():
    """A TimeoutError the tool's constructor raises in its worker process is the tool's error, not "did not start
    within Ns" (our limit did not expire)."""
    tool = TimeoutOnStartTool({"isolation": "process", "timeout": 30})

    async def episode():
        async with ToolBox([tool]) as box:
            await box.create_all({"block": {"create_kwargs": {"label": "a"}}})

    with pytest.raises(Exception) as caught:
        asyncio.run(episode())
    chain = f"{caught.value} {caught.value.__cause__} {caught.value.__context__}"
    assert "license server timed out" in chain and "did not start" not in chain


@pytest.mark.parametrize("same_turn", [False, True])
def test_neither_a_restart_nor_the_wait_for_a_killed_call_is_part_of_the_next_calls_timeout(tmp_path, same_turn):
    # A worker takes 0.8 s to start, the timeout is 0.3 s: the call after a hang that was killed only succeeds if its
    # timeout covers its own work, not the restart (nor, in the same turn, the wait for the hung call before it).
    tool = SlowStartTool({"isolation": "process", "timeout": 0.3, "start_s": 0.8})
    hang = ToolCall("block", {"how": "sleep", "release": str(tmp_path / "never")})

    async def episode():
        async with ToolBox([tool]) as box:
            await box.create_all({"block": {"create_kwargs": {"label": "a"}}})
            if same_turn:
                return await box.execute_many([hang, answer()]), box
            return [await box.execute(hang), await box.execute(answer())], box

    (hung, after), box = asyncio.run(episode())
    assert hung.error_kind == "timeout"
    assert after.ok and after.text.split()[0] == "a"  # answered by the instance created again in a new worker
    assert box.counts["created"] == box.counts["released"] == 1


@pytest.mark.parametrize("config, message", [
    ({"isolation": "thread"}, "config.isolation must be 'none' or 'process'"),
    ({"isolation": "process", "lock": threading.Lock()}, "isolation: process sends the tool's class, config and "
                                                         "schema to a worker process, and they cannot be pickled: "
                                                         "TypeError: cannot pickle '_thread.lock' object"),
])
def test_bad_isolation_settings(config, message):
    with pytest.raises(ToolConfigError, match=re.escape(message)):
        BlockingTool(config)


def test_a_tool_class_defined_in_a_function_runs_in_a_worker_by_value():
    """A class that is not importable by name travels to the worker by value (cloudpickle), like one defined in the
    user's main script."""
    class Local(EchoTool):
        async def execute(self, instance_id, arguments, **execute_kwargs):
            return f"{arguments['text']} from {os.getpid()}", 0.0, {}

    (result,), _ = run_episode([Local({"isolation": "process"})], [ToolCall("echo", {"text": "hi"})])
    assert result.ok and result.text.startswith("hi from ") and result.text != f"hi from {os.getpid()}"
