"""The tool runner: every failure is an observation, never an exception or a hang; limits hold; instances balance."""

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
from mt_env.errors import ToolConfigError, ToolError, TransientToolError
from mt_env.parsers import HermesParser, ToolCall, get_parser
from mt_env.tools import BaseTool, ToolBox, ToolResponse, cap_calls
from mt_env.vector import ToolVectorEnv

from .uncooperative_tools import (HANG_CAP_S, BlockingTool, SlowStartTool, ThreadTool, TimeoutOnRecreateTool,
                                  TimeoutOnStartTool)


def schema(name: str, properties: dict | None = None, required: list[str] | None = None) -> dict:
    parameters = {"type": "object", "properties": properties or {}, "required": required or []}
    function = {"name": name, "description": f"The {name} tool.", "parameters": parameters}
    return {"type": "function", "function": function}


ECHO_SCHEMA = schema("echo", {"text": {"type": "string"}, "delay": {"type": "number"}}, ["text"])


class EchoTool(BaseTool):
    """Echoes its text after an optional delay; records its lifecycle and how many calls run at once."""

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema or ECHO_SCHEMA)
        self.created, self.released, self.seen_kwargs = [], [], {}
        self.running = self.peak = 0

    async def create(self, instance_id=None, **create_kwargs):
        instance_id = await super().create(instance_id)
        self.created.append(instance_id)
        self.seen_kwargs[instance_id] = {"create": create_kwargs}
        return instance_id

    async def execute(self, instance_id, arguments, **execute_kwargs):
        self.seen_kwargs[instance_id]["execute"] = execute_kwargs
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(arguments.get("delay", 0))
        finally:
            self.running -= 1
        return arguments["text"], 0.5, {"chars": len(arguments["text"])}

    async def calc_reward(self, instance_id, **kwargs):
        self.seen_kwargs[instance_id]["calc_reward"] = kwargs
        return 1.0

    async def release(self, instance_id, **kwargs):
        self.seen_kwargs[instance_id]["release"] = kwargs
        self.released.append(instance_id)


class FailingTool(EchoTool):
    """Raises `error` on its first `failures` calls, then echoes."""

    def __init__(self, config=None, error: Exception = RuntimeError("boom"), failures: int = 10**9, name="failing"):
        super().__init__(config, schema(name, {"text": {"type": "string"}}))
        self.error, self.failures, self.calls = error, failures, 0

    async def execute(self, instance_id, arguments, **execute_kwargs):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "recovered", 0.0, {}


class SleepyTool(EchoTool):
    def __init__(self, config=None, ignore_cancellation=False):
        super().__init__(config, schema("sleepy"))
        self.ignore_cancellation = ignore_cancellation
        self.woke = False  #: whether a call ever finished its sleep

    async def execute(self, instance_id, arguments, **execute_kwargs):
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if not self.ignore_cancellation:
                raise
            await asyncio.sleep(10)  # a badly behaved tool
        self.woke = True
        return "woke up", 0.0, {}


class ReturnsTool(EchoTool):
    """Returns whatever it was built with."""

    def __init__(self, output, config=None):
        super().__init__(config, schema("returns"))
        self.output = output

    async def execute(self, instance_id, arguments, **execute_kwargs):
        return self.output


def run_episode(tools, calls, tools_kwargs=None, max_parallel=None):
    async def episode():
        async with ToolBox(tools) as box:
            await box.create_all(tools_kwargs)
            return await box.execute_many(calls, max_parallel=max_parallel), box

    return asyncio.run(episode())


def echo(text="hi", delay=0.0) -> ToolCall:
    return ToolCall("echo", {"text": text, "delay": delay})


# ------------------------------------------------------------------------------------------------ success
def test_successful_calls_carry_response_reward_and_metrics():
    (result,), box = run_episode([EchoTool()], [echo("hello")])
    assert result.ok and result.error_kind is None
    assert (result.name, result.call_id, result.text, result.reward) == ("echo", "call_1", "hello", 0.5)
    assert result.metrics == {"chars": 5} and result.attempts == 1 and result.duration_s >= 0
    assert result.to_message() == {"role": "tool", "content": "hello", "tool_call_id": "call_1", "name": "echo"}
    assert box.counts["calls"] == 1 and box.counts["errors"] == 0


def test_results_come_back_in_call_order():
    calls = [echo(str(i), delay=0.03 - 0.01 * i) for i in range(3)]
    results, _ = run_episode([EchoTool()], calls)
    assert [r.text for r in results] == ["0", "1", "2"]
    assert [r.call_id for r in results] == ["call_1", "call_2", "call_3"]


def test_tool_response_images_are_carried():
    (result,), _ = run_episode([ReturnsTool((ToolResponse("see image", images=["img"]), 0.0, {}))],
                               [ToolCall("returns", {})])
    assert result.ok and result.text == "see image" and result.images == ["img"]


def test_openai_shaped_calls_and_call_ids_are_accepted():
    call = {"id": "abc", "type": "function", "function": {"name": "echo", "arguments": '{"text": "x"}'}}
    (result, bad), _ = run_episode([EchoTool()], [call, {"name": "echo", "arguments": "{not json"}])
    assert result.ok and result.call_id == "abc" and result.text == "x"
    assert bad.error_kind == "parse" and "not valid JSON" in bad.text


def test_string_arguments_are_read_as_the_parsers_read_json():
    raw_newline = {"function": {"name": "echo", "arguments": '{"text": "a\nb"}'}}  # accepted, as by every parser
    nan = {"function": {"name": "echo", "arguments": '{"text": "x", "delay": NaN}'}}  # not JSON
    (result, bad), _ = run_episode([EchoTool()], [raw_newline, nan])
    assert result.ok and result.text == "a\nb"
    assert bad.error_kind == "parse" and bad.text == "Error: the arguments of 'echo' are not valid JSON: NaN is not valid JSON"


# ------------------------------------------------------------------------------------------------ failures
def test_unknown_tool():
    (result,), box = run_episode([EchoTool()], [ToolCall("search", {"q": "x"})])
    assert result.error_kind == "unknown_tool" and result.text == "Error: unknown tool 'search'; available tools: echo"
    assert box.counts["error/unknown_tool"] == 1


@pytest.mark.parametrize("arguments, expected", [
    ({"text": 3}, "3 is not of type 'string'"),
    ({}, "'text' is a required property"),
    ({"text": "x", "delay": "soon"}, "delay: 'soon' is not of type 'number'"),
    ({"text": ["x" * 1_000_000]}, "is not of type 'string'"),
])
def test_invalid_arguments_are_validated_against_the_schema(arguments, expected):
    tool = EchoTool()
    (result,), _ = run_episode([tool], [ToolCall("echo", arguments)])
    assert result.error_kind == "invalid_arguments" and expected in result.text
    assert result.text.startswith("Error: invalid arguments for 'echo'") and len(result.text) < 400
    assert result.attempts == 0 and tool.peak == 0  # the tool never ran


def test_the_toolbox_checks_arguments_unless_its_tool_s_own_check_accepted_them():
    """A call the parser checked against the tool's schema is not checked again; one it checked against another
    schema (or did not check) still is."""
    call = '<tool_call>{"name": "echo", "arguments": {"text": "hi", "delay": "soon"}}</tool_call>'
    loose = get_parser("hermes", tools=[schema("echo", {"text": {"type": "string"}})]).parse(call).calls
    (result,), _ = run_episode([EchoTool()], loose)
    assert result.error_kind == "invalid_arguments" and "'soon' is not of type 'number'" in result.text
    (parsed,) = get_parser("hermes", tools=[ECHO_SCHEMA]).parse(call.replace('"soon"', "0")).calls
    tool = EchoTool()
    assert parsed.checked_by is tool.validator  # one validator per schema in a process: the parser's is the tool's
    parsed.arguments["delay"], parsed.checked_by = "soon", None  # changed after the check, and marked so
    (result,), _ = run_episode([tool], [parsed])
    assert result.error_kind == "invalid_arguments"


def test_parse_errors_become_observations():
    parsed = get_parser("hermes", tools=[ECHO_SCHEMA]).parse(
        '<tool_call>{"name": "echo", "arguments": {"text": 1}}</tool_call><tool_call>{"name": "ech', "length"
    )
    results, box = run_episode([EchoTool()], parsed.calls + parsed.errors)
    assert [r.error_kind for r in results] == ["invalid_arguments", "parse"]
    assert "cut off" in results[1].text
    assert box.counts["errors"] == 2


def test_a_tool_that_raises():
    (result,), _ = run_episode([FailingTool()], [ToolCall("failing", {"text": "x"})])
    assert result.error_kind == "exception" and result.attempts == 1
    assert result.text == "Error: tool 'failing' failed: RuntimeError: boom"


def test_tool_error_messages_are_shown_as_written():
    (result,), _ = run_episode([FailingTool(error=ToolError("no such file: a.txt"))], [ToolCall("failing", {})])
    assert result.error_kind == "exception" and result.text == "Error: no such file: a.txt"


def test_a_tool_that_sleeps_past_its_timeout():
    tool = SleepyTool({"timeout": 0.05})
    (result,), box = run_episode([tool], [ToolCall("sleepy", {})])
    assert result.error_kind == "timeout" and result.text == "Error: tool 'sleepy' timed out after 0.05s"
    assert box.counts["error/timeout"] == 1 and not tool.woke


def test_a_tool_that_ignores_cancellation_is_abandoned_not_awaited():
    tool = SleepyTool({"timeout": 0.05}, ignore_cancellation=True)
    (result,), _ = run_episode([tool], [ToolCall("sleepy", {})])
    assert result.error_kind == "timeout" and not tool.woke  # the episode ended while the tool still slept


def test_transient_errors_are_retried_then_succeed():
    tool = FailingTool({"retries": 2}, error=TransientToolError("busy"), failures=2)
    (result,), box = run_episode([tool], [ToolCall("failing", {})])
    assert result.ok and result.text == "recovered" and result.attempts == 3
    assert box.counts["retries"] == 2


def test_declared_transient_errors_are_retried_up_to_the_limit():
    class NetworkTool(FailingTool):
        transient_errors = (ConnectionError,)

    tool = NetworkTool({"retries": 1}, error=ConnectionError("reset"), failures=5)
    (result,), _ = run_episode([tool], [ToolCall("failing", {})])
    assert result.error_kind == "exception" and result.attempts == 2 and tool.calls == 2


def test_other_errors_are_not_retried():
    tool = FailingTool({"retries": 3}, error=ValueError("bad"), failures=1)
    (result,), _ = run_episode([tool], [ToolCall("failing", {})])
    assert result.error_kind == "exception" and result.attempts == 1 and tool.calls == 1


@pytest.mark.parametrize("output, problem", [
    ("just text", "must return (response, reward, metrics)"),
    (("a", 1.0), "must return (response, reward, metrics)"),
    ((42, 0.0, {}), "must be a str or a ToolResponse"),
    ((ToolResponse(None), 0.0, {}), "ToolResponse.text must be a str"),
    (("a", float("nan"), {}), "finite number"),
    (("a", float("inf"), {}), "finite number"),
    (("a", "1.0", {}), "finite number"),
    (("a", 0.0, None), "metrics must be a dict"),
    (("a", 0.0, [("k", 1)]), "metrics must be a dict"),
])
def test_unusable_responses(output, problem):
    (result,), _ = run_episode([ReturnsTool(output)], [ToolCall("returns", {})])
    assert result.error_kind == "bad_response" and problem in result.text


def test_a_sync_execute_is_an_error_not_a_crash():
    class SyncTool(EchoTool):
        def execute(self, instance_id, arguments, **kwargs):
            return "sync", 0.0, {}

    (result,), _ = run_episode([SyncTool()], [echo()])
    assert result.error_kind == "exception"


def test_long_output_is_cut_with_a_marker_and_counted():
    (result,), box = run_episode([EchoTool({"max_response_chars": 10})], [echo("x" * 100)])
    assert result.ok and result.text == "x" * 10 + "\n[... 90 characters cut ...]" and result.cut_chars == 90
    assert box.counts["truncated"] == 1


def test_on_error_end_episode_flags_the_failing_call():
    results, _ = run_episode([FailingTool({"on_error": "end_episode"}), EchoTool()],
                             [ToolCall("failing", {}), echo(), ToolCall("nope", {})])
    assert [r.end_episode for r in results] == [True, False, False]
    (result,), _ = run_episode([FailingTool()], [ToolCall("failing", {})])
    assert not result.end_episode


def test_calls_over_the_per_turn_cap_get_one_error_observation():
    calls = [echo(str(i)) for i in range(5)]
    results, box = run_episode([EchoTool()], cap_calls(calls, 3))
    assert [r.text for r in results] == [
        "0", "1", "2", "Error: 2 more tool call(s) in this turn were not run: at most 3 calls per turn are run"]
    assert results[-1].error_kind == "too_many_calls" and box.counts["error/too_many_calls"] == 1
    assert cap_calls(calls, 5) == calls


# ------------------------------------------------------------------------------------------------ concurrency
def test_max_concurrency_is_respected():
    tool = EchoTool({"max_concurrency": 3})
    results, _ = run_episode([tool], [echo(delay=0.02) for _ in range(12)])
    assert all(r.ok for r in results) and tool.peak == 3


def test_max_concurrency_holds_across_episodes():
    tool = EchoTool({"max_concurrency": 2})

    async def two_episodes():
        boxes = [ToolBox([tool]), ToolBox([tool])]
        for box in boxes:
            await box.create_all()
        await asyncio.gather(*(box.execute_many([echo(delay=0.02)] * 4) for box in boxes))
        for box in boxes:
            await box.release_all()

    asyncio.run(two_episodes())
    assert tool.peak == 2
    asyncio.run(two_episodes())  # the tool's limit also works in a second event loop
    assert tool.peak == 2


def test_max_parallel_limits_one_batch():
    tool = EchoTool()
    run_episode([tool], [echo(delay=0.02) for _ in range(6)], max_parallel=2)
    assert tool.peak == 2
    tool = EchoTool()
    run_episode([tool], [echo(delay=0.02) for _ in range(6)])
    assert tool.peak == 6


# ------------------------------------------------------------------------------------------------ lifecycle
def test_release_counts_equal_create_counts():
    echo_tool, failing = EchoTool(), FailingTool()
    _, box = run_episode([echo_tool, failing], [echo(), ToolCall("failing", {}), ToolCall("x", {})])
    assert echo_tool.created == echo_tool.released and len(echo_tool.created) == 1
    assert failing.created == failing.released
    assert box.counts["created"] == box.counts["released"] == 2


def test_release_all_is_idempotent():
    tool = EchoTool()

    async def episode():
        box = ToolBox([tool])
        await box.create_all()
        await box.release_all()
        await box.release_all()
        return box

    box = asyncio.run(episode())
    assert len(tool.released) == 1 and box.counts["released"] == 1


def test_cancelling_an_episode_releases_everything():
    tool = EchoTool()

    async def main():
        async def episode():
            async with ToolBox([tool]) as box:
                await box.create_all()
                await box.execute_many([echo(delay=5) for _ in range(4)])

        task = asyncio.create_task(episode())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert tool.running == 0 and tool.peak == 4
    assert tool.created == tool.released and len(tool.created) == 1


def test_a_failing_create_releases_the_others_and_says_which_tool():
    class BrokenCreate(EchoTool):
        async def create(self, instance_id=None, **kwargs):
            raise OSError("sandbox unavailable")

    good = EchoTool()

    async def episode():
        await ToolBox([good, BrokenCreate(tool_schema=schema("broken"))]).create_all()

    with pytest.raises(ToolError, match="tool 'broken' could not create.*OSError: sandbox unavailable"):
        asyncio.run(episode())
    assert good.created == good.released and len(good.created) == 1


def test_tools_kwargs_reach_each_lifecycle_method():
    tool = EchoTool()
    kwargs = {"echo": {"create_kwargs": {"seed": 1}, "execute_kwargs": {"mode": "x"},
                       "calc_reward_kwargs": {"truth": 4}, "release_kwargs": {"keep": False}}}

    async def episode():
        async with ToolBox([tool]) as box:
            await box.create_all(kwargs)
            await box.execute(echo())
            return await box.calc_rewards()

    assert asyncio.run(episode()) == {"echo": 1.0}
    (seen,) = tool.seen_kwargs.values()
    assert seen == {"create": {"seed": 1}, "execute": {"mode": "x"}, "calc_reward": {"truth": 4},
                    "release": {"keep": False}}


@pytest.mark.parametrize("tools_kwargs, message", [
    ({"search": {}}, r"unknown tool\(s\) \['search'\]"),
    ({"echo": {"execute_kwarg": {}}}, r"unknown key\(s\) \['execute_kwarg'\]"),
    ({"echo": {"create_kwargs": [1]}}, "must be a mapping"),
])
def test_bad_tools_kwargs(tools_kwargs, message):
    with pytest.raises(ToolConfigError, match=message):
        asyncio.run(ToolBox([EchoTool()]).create_all(tools_kwargs))


def test_a_failing_reward_counts_as_zero():
    class BadReward(EchoTool):
        async def calc_reward(self, instance_id, **kwargs):
            return float("nan")

    async def episode():
        async with ToolBox([BadReward(), EchoTool(tool_schema=schema("other"))]) as box:
            await box.create_all()
            return await box.calc_rewards(), box

    rewards, box = asyncio.run(episode())
    assert rewards == {"echo": 0.0, "other": 1.0} and box.counts["calc_reward_errors"] == 1


def test_executing_before_create_all_is_a_usage_error():
    with pytest.raises(ToolError, match="create_all"):
        asyncio.run(ToolBox([EchoTool()]).execute(echo()))


# ------------------------------------------------------------------------------------------------ construction
def test_invalid_parameter_schema_names_the_tool():
    bad = schema("lookup", {"q": {"type": "strin"}})
    with pytest.raises(ToolConfigError, match="tool 'lookup': parameters is not a valid JSON schema at properties/q"):
        EchoTool(tool_schema=bad)


@pytest.mark.parametrize("bad_schema", [
    None,
    {"type": "function"},
    {"type": "tool", "function": {"name": "a", "parameters": {}}},
    {"type": "function", "function": {"name": "", "parameters": {}}},
    {"type": "function", "function": {"name": "a"}},
])
def test_malformed_tool_schemas(bad_schema):
    with pytest.raises(ToolConfigError):
        EchoTool(tool_schema=bad_schema or "not a schema")


@pytest.mark.parametrize("config", [{"timeout": 0}, {"timeout": "5"}, {"max_concurrency": 0}, {"retries": -1},
                                    {"retries": 1.5}, {"max_response_chars": 0}, {"on_error": "stop"}])
def test_bad_settings(config):
    with pytest.raises(ToolConfigError, match=f"tool 'echo': config.{next(iter(config))}"):
        EchoTool(config)


def test_duplicate_names_in_one_box():
    with pytest.raises(ToolConfigError, match="two tools are named 'echo'"):
        ToolBox([EchoTool(), EchoTool()])


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
