"""What the tool runner's tests share (tests/test_tools.py, tests/test_tool_isolation.py): a schema builder, the
echo tool (records its lifecycle and how many calls run at once) and its failing, sleepy and returning variants, and
`run_episode`, one episode of calls on a ToolBox. Not a test module: import what you need."""

from __future__ import annotations

import asyncio

from mt_env.parsers import ToolCall
from mt_env.tools import BaseTool, ToolBox


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
