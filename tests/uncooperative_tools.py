"""Tools that do not cooperate with the event loop, for the isolation tests. A module of its own, importing little:
``isolation: process`` workers import it by name, and every import here is paid once per worker process."""

from __future__ import annotations

import asyncio
import os
import threading
import time

from mt_env.errors import ToolError
from mt_env.tools import BaseTool

HANG_CAP_S = 30.0  # a hang ends after this long even if nothing stops it, so that a regression fails instead of hangs

BLOCK_SCHEMA = {"type": "function", "function": {
    "name": "block", "description": "Blocks its thread, or answers.",
    "parameters": {"type": "object", "properties": {
        "how": {"enum": ["sleep", "lock", "answer", "fail", "crash"]},
        "release": {"type": "string", "description": "a path whose existence ends a 'sleep' early"},
    }, "required": ["how"]}}}


class BlockingTool(BaseTool):
    """``how``: ``sleep`` (``time.sleep`` until `release` exists), ``lock`` (a C call that waits on a lock nobody
    frees), ``answer`` (the episode's label and the process id: which instance answered, and where), ``fail`` (a
    `ToolError`), ``crash`` (the process exits). Hangs end after `HANG_CAP_S` and then answer ``"woke up"``."""

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema or BLOCK_SCHEMA)
        self.labels: dict[str, str] = {}

    async def create(self, instance_id=None, **create_kwargs):
        instance_id = await super().create(instance_id)
        self.labels[instance_id] = create_kwargs.get("label", "")
        return instance_id

    async def execute(self, instance_id, arguments, **execute_kwargs):
        how = arguments["how"]
        if how == "sleep":
            deadline = time.monotonic() + HANG_CAP_S
            while not os.path.exists(arguments.get("release", "")) and time.monotonic() < deadline:
                time.sleep(0.01)
        elif how == "lock":
            lock = threading.Lock()
            lock.acquire()
            lock.acquire(timeout=HANG_CAP_S)
        elif how == "fail":
            raise ToolError(f"refused in process {os.getpid()}")
        elif how == "crash":
            os._exit(3)
        else:
            return f"{self.labels[instance_id]} {os.getpid()}", 0.0, {}
        return "woke up", 0.0, {}

    async def release(self, instance_id, **release_kwargs):
        del self.labels[instance_id]


def in_first_process(config: dict | None) -> dict:
    """`config` with the pid of the process that builds the first copy of the tool (a worker gets that config)."""
    return {"first_pid": os.getpid(), **(config or {})}


def in_worker(config: dict) -> bool:
    """Whether this copy of the tool is built in a worker process (not where the first copy was built)."""
    return config["first_pid"] != os.getpid()


class SlowStartTool(BlockingTool):
    """A `BlockingTool` that a worker process takes ``config["start_s"]`` seconds to build (the parent process builds
    its copy at once): every worker start, the first and each restart after a kill, is slow."""

    def __init__(self, config=None, tool_schema=None):
        super().__init__(in_first_process(config), tool_schema)
        if in_worker(self.config):
            time.sleep(self.config["start_s"])


class ThreadTool(BaseTool):
    """``thread(hang)``: works in a thread (``asyncio.to_thread``); with ``hang`` the thread waits for `gate` (at
    most `HANG_CAP_S`; forever when `gate` is None). `returned` counts the threads that came back."""

    def __init__(self, gate: threading.Event | None, config=None):
        super().__init__(config, {"type": "function", "function": {
            "name": "thread", "description": "Works in a thread.", "parameters": {
                "type": "object", "properties": {"hang": {"type": "boolean"}}, "required": ["hang"]}}})
        self.gate, self.returned = gate, 0

    async def execute(self, instance_id, arguments, **execute_kwargs):
        return await asyncio.to_thread(self._work, arguments["hang"]), 0.0, {}

    def _work(self, hang: bool) -> str:
        if hang and self.gate is None:
            threading.Event().wait()
        elif hang:
            self.gate.wait(HANG_CAP_S)
        self.returned += 1
        return "done"


class TimeoutOnRecreateTool(BlockingTool):
    """Its `create` raises a TimeoutError of its own once the file at ``config["recreate_fails"]`` exists: the
    instance created again in a new worker after a crash fails as the tool says, within no limit of ours."""

    async def create(self, instance_id=None, **create_kwargs):
        if os.path.exists(self.config["recreate_fails"]):
            raise TimeoutError("the tool's own upstream timed out")
        return await super().create(instance_id, **create_kwargs)


class TimeoutOnStartTool(BlockingTool):
    """A `BlockingTool` whose construction in a worker process raises a TimeoutError of its own (the parent process
    builds its copy as usual): the worker's start fails as the tool says, within no limit of ours."""

    def __init__(self, config=None, tool_schema=None):
        super().__init__(in_first_process(config), tool_schema)
        if in_worker(self.config):
            raise TimeoutError("the tool's own license server timed out")
