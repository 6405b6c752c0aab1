"""The tool runner: every failure is an observation, never an exception or a hang; limits hold; instances balance.
Tools that hang and tools isolated in a worker process: tests/test_tool_isolation.py."""

from __future__ import annotations

import asyncio

import pytest

from mt_env.errors import ToolConfigError, ToolError, TransientToolError
from mt_env.parsers import ToolCall, get_parser
from mt_env.tools import ToolBox, ToolResponse, cap_calls

from .tool_fixtures import ECHO_SCHEMA, EchoTool, FailingTool, ReturnsTool, SleepyTool, echo, run_episode, schema


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
