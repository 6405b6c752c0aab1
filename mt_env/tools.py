"""Tools, and the runner that calls them for one episode.

A tool is a `BaseTool` subclass shaped like verl's ``BaseTool``: one object serves every episode, and each episode
gets its own *instance* of it: ``create`` (returns the instance id), ``execute`` (any number of calls),
``calc_reward`` and finally ``release``. All four are coroutines.

A `ToolBox` holds the tools of one episode and is the only thing that calls them. It validates arguments against
the tool's JSON schema, enforces each tool's timeout, concurrency limit and retries, cuts over-long output, and
turns every failure into a `ToolResult` whose text the model reads as the observation (``"Error: ..."``), so that
a bad call or a broken tool never raises out of the runner and never hangs an episode::

    async with ToolBox(tools) as box:          # releases every instance on exit, even when cancelled
        await box.create_all(tools_kwargs)
        results = await box.execute_many(parsed.calls + parsed.errors)
        rewards = await box.calc_rewards()

Per-tool settings come from the tool's ``config`` (the YAML ``config:`` block): ``timeout``, ``max_concurrency``,
``retries``, ``max_response_chars``, ``on_error``, ``isolation`` — their defaults and meaning: docs/tools.md.

Tools must not block the event loop: run blocking work with ``await asyncio.to_thread(...)`` (on a pool of daemon
threads that nothing waits for), and declare tools that may block anyway, or run untrusted code, with
``isolation: process``. A tool step that holds the loop too long is named in a warning. `mt_env.isolation` says how.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from .checks import is_int, is_real
from .deadline import ToolTimeout, resume, with_timeout
from .errors import ToolConfigError, ToolError, TransientToolError
from .isolation import ProcessInstance, check_isolatable, created_id, use_daemon_threads
from .parsers import TOOL_CALL_JSON, ParseError, ToolCall
from .tool_schema import argument_error, arguments_validator, check_tool_schema, shorten

__all__ = [
    "BaseTool", "ToolBox", "ToolResponse", "ToolResult", "ToolSettings", "ToolError", "TransientToolError",
    "ERROR_KINDS", "KWARGS_KEYS", "cap_calls", "normalize_tools_kwargs",
]

logger = logging.getLogger(__name__)

ERROR_KINDS = ("unknown_tool", "invalid_arguments", "exception", "timeout", "bad_response", "parse", "too_many_calls")
#: The keys of one tool's entry in ``tools_kwargs`` (verl's names), one per lifecycle method.
KWARGS_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")
# How long a timed-out call may take to react to cancellation before it is abandoned (it may ignore it).


@dataclass(frozen=True)
class ToolSettings:
    """A tool's runtime limits, read from its config (see the module docstring)."""

    timeout: float = 30.0
    max_concurrency: int = 64
    retries: int = 0
    max_response_chars: int = 20_000
    on_error: str = "continue"
    isolation: str = "none"

    @classmethod
    def from_config(cls, config: Mapping[str, Any], tool: str) -> ToolSettings:
        settings = cls(**{f.name: config[f.name] for f in fields(cls) if f.name in config})
        checks = [
            ("timeout", is_real(settings.timeout) and 0 < settings.timeout < math.inf, "a positive number"),
            ("max_concurrency", is_int(settings.max_concurrency) and settings.max_concurrency >= 1, "an int >= 1"),
            ("retries", is_int(settings.retries) and settings.retries >= 0, "an int >= 0"),
            ("max_response_chars", is_int(settings.max_response_chars) and settings.max_response_chars >= 1,
             "an int >= 1"),
            ("on_error", settings.on_error in ("continue", "end_episode"), "'continue' or 'end_episode'"),
            ("isolation", settings.isolation in ("none", "process"), "'none' or 'process'"),
        ]
        for key, ok, expected in checks:
            if not ok:
                raise ToolConfigError(f"tool {tool!r}: config.{key} must be {expected}, got {getattr(settings, key)!r}")
        return settings


@dataclass
class ToolResponse:
    """What `BaseTool.execute` returns when there is more than text. Images are carried along, not rendered yet."""

    text: str
    images: list | None = None


class BaseTool:
    """Base class of tools (see the module docstring for the lifecycle and settings).

    Args:
        config: per-tool settings plus anything the subclass reads (the YAML ``config:`` block).
        tool_schema: the OpenAI function-tool schema the model is shown; ``parameters`` must be a valid JSON
            schema, and the arguments of every call are validated against it before `execute` sees them.

    Subclasses override `execute` (and `create`/`calc_reward`/`release` when they keep per-episode state). To
    report a failure the model should read, raise `ToolError` with a message written for the model; raise
    `TransientToolError` (or list exception types in `transient_errors`) for failures worth retrying.
    """

    #: Exception types that are retried up to ``config["retries"]`` times (besides `TransientToolError`).
    transient_errors: tuple[type[BaseException], ...] = ()

    def __init__(self, config: Mapping[str, Any] | None, tool_schema: Mapping[str, Any]):
        self.tool_schema = check_tool_schema(tool_schema, owner=type(self).__name__)
        self.config = dict(config or {})
        self.settings = ToolSettings.from_config(self.config, self.name)
        if self.settings.isolation == "process":
            check_isolatable(type(self), self.config, self.tool_schema, self.name)
        self.validator = arguments_validator(self.tool_schema)
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._last_slot: tuple[weakref.ref, asyncio.Semaphore] | None = None  #: (its loop, the slot) of the last call

    @property
    def name(self) -> str:
        return self.tool_schema["function"]["name"]

    def get_openai_tool_schema(self) -> dict:
        """The schema shown to the model (verl's name for it)."""
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        """Start this tool's state for one episode; returns the instance id."""
        return instance_id or str(uuid.uuid4())

    async def execute(self, instance_id: str, arguments: dict, **execute_kwargs: Any
                      ) -> tuple[ToolResponse | str, float, dict]:
        """Run one call with validated `arguments`; returns (response, step reward, metrics)."""
        raise NotImplementedError(f"{type(self).__name__} must implement execute()")

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        """The reward of the instance's final state (0 unless overridden)."""
        return 0.0

    async def release(self, instance_id: str, **release_kwargs: Any) -> None:
        """Free the instance's state; called exactly once per created instance."""

    def _concurrency_slot(self) -> asyncio.Semaphore:
        """The semaphore limiting this tool's running calls in the current event loop (one per loop: semaphores
        bind to the loop that first waits on them)."""
        loop = asyncio.get_running_loop()
        if self._last_slot is not None and self._last_slot[0]() is loop:  # the usual case: the previous call's loop
            return self._last_slot[1]
        slot = self._semaphores.get(loop)
        if slot is None:
            slot = self._semaphores[loop] = asyncio.Semaphore(self.settings.max_concurrency)
        self._last_slot = (weakref.ref(loop), slot)
        return slot

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


@dataclass
class ToolResult:
    """The outcome of one call, success or failure. `text` is what the model reads; on failure it is
    ``"Error: " + error``, `error_kind` is one of `ERROR_KINDS`, and `end_episode` reflects the tool's ``on_error``."""

    name: str
    call_id: str
    text: str
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)
    error: str | None = None
    error_kind: str | None = None
    duration_s: float = 0.0
    attempts: int = 0  #: executions started (0 when the call was refused before running)
    images: list | None = None
    cut_chars: int = 0  #: characters removed by ``max_response_chars``
    end_episode: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_message(self) -> dict[str, Any]:
        """The observation message for the conversation (OpenAI ``tool`` role)."""
        return {"role": "tool", "content": self.text, "tool_call_id": self.call_id, "name": self.name}


def normalize_tools_kwargs(tools_kwargs: Mapping[str, Any] | None, known: Sequence[str], where: str = "tools_kwargs"
                           ) -> dict[str, dict[str, dict]]:
    """``{tool: {create_kwargs, execute_kwargs, calc_reward_kwargs, release_kwargs}}`` with every key present,
    after checking that each tool is in `known` and each key is one of `KWARGS_KEYS`."""
    if tools_kwargs is None:
        return {}
    if not isinstance(tools_kwargs, Mapping):
        raise ToolConfigError(f"{where} must map tool names to their kwargs, got {type(tools_kwargs).__name__}")
    unknown = [name for name in tools_kwargs if name not in known]
    if unknown:
        raise ToolConfigError(f"{where} names unknown tool(s) {unknown}; configured tools: {list(known)}")
    out = {}
    for name, per_tool in tools_kwargs.items():
        if type(per_tool) is _ToolKwargs:  # normalized before (select_tools, then the episode's ToolBox): as it is
            out[name] = per_tool
            continue
        per_tool = per_tool or {}
        if not isinstance(per_tool, Mapping):
            raise ToolConfigError(f"{where}[{name!r}] must be a mapping with keys {KWARGS_KEYS}")
        bad = [key for key in per_tool if key not in KWARGS_KEYS]
        if bad:
            raise ToolConfigError(f"{where}[{name!r}] has unknown key(s) {bad}; expected some of {KWARGS_KEYS}")
        kwargs = [per_tool.get(key) or {} for key in KWARGS_KEYS]
        if not set(map(type, kwargs)) <= _DICT:  # dicts told without the Mapping ABC's check, one by one
            for key, value in zip(KWARGS_KEYS, kwargs):
                if not isinstance(value, Mapping):
                    raise ToolConfigError(f"{where}[{name!r}][{key!r}] must be a mapping of keyword arguments")
        out[name] = _ToolKwargs(zip(KWARGS_KEYS, map(dict, kwargs)))
    return out


class _ToolKwargs(dict):
    """One tool's entry as `normalize_tools_kwargs` returns it (checked, every key present)."""


_DICT = frozenset({dict})


def cap_calls(calls: Sequence[Any], limit: int) -> list:
    """The first `limit` of one turn's `calls`; when there are more, followed by one `ParseError` that the toolbox
    answers with a single ``too_many_calls`` error observation saying how many calls were not run."""
    if len(calls) <= limit:
        return list(calls)
    skipped = len(calls) - limit
    return [*calls[:limit], ParseError("too_many_calls", f"{skipped} more tool call(s) in this turn were not run: "
                                                         f"at most {limit} calls per turn are run")]


class ToolBox:
    """The tools of one episode: creates their instances, runs calls, collects rewards, releases everything.

    Every call goes through `execute`, which never raises for a bad call or a failing tool: the failure is a
    `ToolResult` with ``error_kind`` set. `counts` tallies calls, errors by kind, retries, cut responses, and
    created/released instances (equal once `release_all` has run).

    The lifecycle calls of an ``isolation: process`` tool go to its `ProcessInstance` (a worker process for this
    episode); those of any other tool go to the tool object itself.
    """

    def __init__(self, tools: Sequence[BaseTool]):
        self.tools: dict[str, BaseTool] = {}
        for tool in tools:
            if not isinstance(tool, BaseTool):
                raise ToolConfigError(f"a ToolBox holds BaseTool instances, got {type(tool).__name__}")
            if tool.name in self.tools:
                raise ToolConfigError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
        self._runners: dict[str, BaseTool | ProcessInstance] = {
            name: ProcessInstance(tool) if tool.settings.isolation == "process" else tool
            for name, tool in self.tools.items()}
        self.instances: dict[str, str] = {}  #: tool name -> instance id, while created
        self.kwargs: dict[str, dict[str, dict]] = {}
        self.counts: Counter = Counter()
        self._next_call = 0
        self._loop: asyncio.AbstractEventLoop | None = None  #: the loop its calls last ran in

    @property
    def schemas(self) -> list[dict]:
        """The tool schemas, in order: what the prompt must render for this episode."""
        return [tool.tool_schema for tool in self.tools.values()]

    async def __aenter__(self) -> ToolBox:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.release_all()

    # ------------------------------------------------------------------------------------------------ lifecycle
    async def create_all(self, tools_kwargs: Mapping[str, Any] | None = None) -> None:
        """Create one instance of every tool (concurrently), with its ``create_kwargs``. If any fails, the others
        are released and `ToolError` is raised: an episode cannot start without its tools."""
        if self.instances:
            raise ToolError("create_all() was already called: release_all() first (one ToolBox per episode)")
        self.kwargs = normalize_tools_kwargs(tools_kwargs, list(self.tools))
        self._loop = asyncio.get_running_loop()
        use_daemon_threads(self._loop)

        async def create(tool: BaseTool) -> None:
            created = created_id(await self._lifecycle(tool.name, "create", None))
            if not isinstance(created, str):
                raise TypeError(f"create() must return the instance id (a str), got {type(created).__name__}")
            self.instances[tool.name] = created
            self.counts["created"] += 1

        outcomes = await _gather([create(t) for t in self.tools.values()], return_exceptions=True)
        failures = [(name, e) for name, e in zip(self.tools, outcomes) if isinstance(e, BaseException)]
        if failures:
            await self.release_all()
            name, error = failures[0]
            if isinstance(error, asyncio.CancelledError):
                raise error
            why = f"timed out after {self.tools[name].settings.timeout}s" if isinstance(error, ToolTimeout) else (
                f"{type(error).__name__}: {' '.join(str(error).split()) or '(no message)'}")  # on one line
            raise ToolError(f"tool {name!r} could not create its instance for this episode: {why}") from error

    async def calc_rewards(self) -> dict[str, float]:
        """Each created tool's `calc_reward` (0.0, logged and counted, when it fails or returns a non-number)."""

        async def reward(name: str, instance_id: str) -> float:
            tool = self.tools[name]
            try:
                value = await self._lifecycle(name, "calc_reward", instance_id)
                if not (type(value) is float or is_real(value)) or not math.isfinite(value):
                    raise TypeError(f"calc_reward() must return a finite number, got {value!r}")
                return float(value)
            except Exception as e:
                self.counts["calc_reward_errors"] += 1
                logger.warning("tool %r: calc_reward failed (%s: %s); using 0.0", name, type(e).__name__, e)
                return 0.0

        names = [name for name in self.tools if name in self.instances]
        values = await _gather([reward(name, self.instances[name]) for name in names])
        return dict(zip(names, values))

    async def release_all(self) -> None:
        """Release every created instance once (idempotent). Failures are logged and counted, never raised; the
        releases finish even if the caller is cancelled meanwhile."""
        pending, self.instances = self.instances, {}

        async def release(name: str, instance_id: str) -> None:
            tool = self.tools[name]
            try:
                await with_timeout(self._runners[name].release(instance_id, **self._kwargs(name, "release")),
                                    tool.settings.timeout, (name, "release"))
            except Exception as e:
                self.counts["release_errors"] += 1
                logger.warning("tool %r: release failed (%s: %s)", name, type(e).__name__, e)
            finally:
                self.counts["released"] += 1

        if len(pending) == 1:  # the usual one-tool episode: inline unless the release suspends, then shielded
            coro = release(*next(iter(pending.items())))
            try:
                first = coro.send(None)
            except StopIteration:
                return
            await asyncio.shield(asyncio.ensure_future(resume(coro, first)))
        elif pending:
            await asyncio.shield(asyncio.gather(*(release(n, i) for n, i in pending.items())))

    async def _lifecycle(self, name: str, method: str, instance_id: str | None) -> Any:
        """The tool `name`'s `method` (``create`` or ``calc_reward``) with its kwargs, under the tool's timeout; an
        isolated tool's once it has its turn (`ProcessInstance.turn`: a worker's start is not part of the timeout)."""
        runner, timeout, kwargs = self._runners[name], self.tools[name].settings.timeout, self._kwargs(name, method)
        if isinstance(runner, ProcessInstance):
            async with runner.turn():
                return await with_timeout(getattr(runner, method)(instance_id, **kwargs), timeout, (name, method))
        return await with_timeout(getattr(runner, method)(instance_id, **kwargs), timeout, (name, method))

    def _kwargs(self, name: str, method: str) -> dict:
        """The tool `name`'s kwargs for its lifecycle `method` (``create``, ``execute``, ...) in this episode."""
        return self.kwargs.get(name, {}).get(f"{method}_kwargs", {})

    def _turn(self, name: str) -> contextlib.AbstractAsyncContextManager:
        """Entered before a call's timeout starts: an isolated tool's `ProcessInstance.turn` (the wait for the
        episode's earlier calls, a worker's start or restart), nothing for a tool that runs here."""
        runner = self._runners[name]
        return runner.turn() if isinstance(runner, ProcessInstance) else _NO_TURN

    # ------------------------------------------------------------------------------------------------ calls
    async def execute(self, call: ToolCall | ParseError | Mapping[str, Any]) -> ToolResult:
        """Run one call: a parsed `ToolCall`, a `ParseError` (answered with its message), or a mapping
        ``{"name", "arguments"}`` / an OpenAI tool call."""
        return await self._execute(call, self._new_call_id())

    async def execute_many(self, calls: Sequence[ToolCall | ParseError | Mapping[str, Any]],
                           max_parallel: int | None = None) -> list[ToolResult]:
        """Run `calls` concurrently (at most `max_parallel` at once, besides each tool's own limit); the results
        come back in call order."""
        if max_parallel is not None and max_parallel < 1:
            raise ValueError(f"max_parallel must be >= 1 or None, got {max_parallel}")
        if len(calls) == 1:  # the common case: no gathering
            return [await self._execute(calls[0], self._new_call_id())]
        gate = asyncio.Semaphore(max_parallel) if max_parallel and max_parallel < len(calls) else None

        async def run(call, call_id: str) -> ToolResult:
            if gate is None:
                return await self._execute(call, call_id)
            async with gate:
                return await self._execute(call, call_id)

        return list(await asyncio.gather(*(run(call, self._new_call_id()) for call in calls)))

    def _new_call_id(self) -> str:
        self._next_call += 1
        return f"call_{self._next_call}"

    async def _execute(self, call: Any, call_id: str) -> ToolResult:
        started = time.perf_counter()
        result = self._dispatch(call, call_id)
        if not isinstance(result, ToolResult):
            result = await result
        result.duration_s = time.perf_counter() - started
        self.counts["calls"] += 1
        if result.error_kind:
            self.counts["errors"] += 1
            self.counts[f"error/{result.error_kind}"] += 1
        if result.cut_chars:
            self.counts["truncated"] += 1
        return result

    def _dispatch(self, call: Any, call_id: str) -> ToolResult | Awaitable[ToolResult]:
        """A call refused at once (its `ToolResult`), or its run (to await)."""
        if isinstance(call, ParseError):
            kind = call.kind if call.kind in ERROR_KINDS else "parse"  # a parse-level kind reads as "parse"
            tool = self.tools.get(call.name or "")
            return self._failure(call.name or "", call_id, kind, call.message, tool)
        try:
            name, arguments, given_id = _unpack_call(call)
        except ValueError as e:
            return self._failure("", call_id, "parse", str(e))
        call_id = given_id or call_id
        tool = self.tools.get(name)
        if tool is None:
            return self._failure(name, call_id, "unknown_tool", f"unknown tool {shorten(name, 80)!r}; available "
                                                                f"tools: {', '.join(self.tools) or 'none'}")
        if name not in self.instances:
            raise ToolError(f"tool {name!r} has no instance: call create_all() before executing calls")
        checked = isinstance(call, ToolCall) and call.checked_by is tool.validator  # by the parser, with this check
        problem = None if checked else argument_error(tool.validator, arguments)
        if problem:
            return self._failure(name, call_id, "invalid_arguments", f"invalid arguments for {name!r}: {problem}",
                                 tool)
        return self._run(tool, call_id, arguments)

    async def _run(self, tool: BaseTool, call_id: str, arguments: dict) -> ToolResult:
        settings, name = tool.settings, tool.name
        attempts = 0
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # also when the episode was created in another loop
            use_daemon_threads(loop)
            self._loop = loop
        while True:
            attempts += 1
            try:
                output = await self._attempt(tool, name, arguments)
                break
            except ToolTimeout:
                return self._failure(name, call_id, "timeout", f"tool {name!r} timed out after {settings.timeout}s",
                                     tool, attempts)
            except Exception as e:
                if attempts <= settings.retries and isinstance(e, (TransientToolError, *tool.transient_errors)):
                    self.counts["retries"] += 1
                    continue
                return self._failure(name, call_id, "exception", _describe(name, e), tool, attempts)
        return self._success(tool, call_id, output, attempts)

    def _attempt(self, tool: BaseTool, name: str, arguments: dict) -> Awaitable:
        """One execution of a call to `tool` (called `name`), holding one of its concurrency slots and under its
        timeout (an awaitable: no coroutine of its own on the usual path)."""
        slot = tool._concurrency_slot()
        if isinstance(self._runners[name], ProcessInstance) or slot.locked():
            return self._attempt_in_slot(tool, name, arguments, slot)
        # A slot is free: a call that finishes without suspending never needs it (nothing else runs meanwhile);
        # one that suspends takes it then, before it goes on (`with_timeout`).
        return with_timeout(self._execution(name, arguments), tool.settings.timeout, (name, "execute"), slot)

    async def _attempt_in_slot(self, tool: BaseTool, name: str, arguments: dict, slot: asyncio.Semaphore) -> Any:
        """`_attempt` once it has the slot (and, for an isolated tool, its worker's turn)."""
        async with slot:
            async with self._turn(name):
                return await with_timeout(self._execution(name, arguments), tool.settings.timeout, (name, "execute"))

    def _execution(self, name: str, arguments: dict) -> Awaitable:
        return self._runners[name].execute(self.instances[name], arguments, **self._kwargs(name, "execute"))

    def _success(self, tool: BaseTool, call_id: str, output: Any, attempts: int) -> ToolResult:
        problem = _response_problem(output)
        if problem:
            return self._failure(tool.name, call_id, "bad_response",
                                 f"tool {tool.name!r} returned an unusable response: {problem}", tool, attempts)
        response, reward, metrics = output
        text, images = (response, None) if isinstance(response, str) else (response.text, response.images)
        text, cut = _cut(text, tool.settings.max_response_chars)
        return ToolResult(tool.name, call_id, text, float(reward), dict(metrics), attempts=attempts, images=images,
                          cut_chars=cut)

    def _failure(self, name: str, call_id: str, kind: str, message: str, tool: BaseTool | None = None,
                 attempts: int = 0) -> ToolResult:
        text = f"Error: {message}"
        cut = 0
        if tool is not None:
            text, cut = _cut(text, tool.settings.max_response_chars)
        return ToolResult(name, call_id, text, error=message, error_kind=kind, attempts=attempts, cut_chars=cut,
                          end_episode=tool is not None and tool.settings.on_error == "end_episode")


async def _gather(coros: list, return_exceptions: bool = False) -> list:
    """`asyncio.gather`, without its task overhead for a single coroutine (the usual one-tool episode)."""
    if len(coros) != 1:
        return await asyncio.gather(*coros, return_exceptions=return_exceptions)
    try:
        return [await coros[0]]
    except Exception as e:
        if return_exceptions:
            return [e]
        raise


_NO_TURN = contextlib.nullcontext()


def _unpack_call(call: Any) -> tuple[str, dict, str | None]:
    """(name, arguments, id) of a `ToolCall`, a ``{"name", "arguments"}`` mapping or an OpenAI tool call."""
    if isinstance(call, ToolCall):
        return call.name, call.arguments, call.id
    if not isinstance(call, Mapping):
        raise ValueError(f"a tool call must be a ToolCall or a mapping, got {type(call).__name__}")
    function = call.get("function", call)
    name, arguments = function.get("name"), function.get("arguments", {})
    if not isinstance(name, str):
        raise ValueError('a tool call needs a string "name"')
    if isinstance(arguments, str):
        try:
            arguments = TOOL_CALL_JSON.decode(arguments)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"the arguments of {name!r} are not valid JSON: {shorten(str(e))}") from None
    return name, arguments, call.get("id")


def _response_problem(output: Any) -> str | None:
    """Why `output` is not a usable ``(response, reward, metrics)``, or None."""
    if type(output) is tuple and len(output) == 3 and type(output[0]) is str and type(output[2]) is dict and (
            type(output[1]) is float and math.isfinite(output[1]) or type(output[1]) is int):
        return None  # the usual response, told by exact types (the checks below ask the number ABCs)
    if not isinstance(output, tuple | list) or len(output) != 3:
        return f"execute() must return (response, reward, metrics), got {type(output).__name__}"
    response, reward, metrics = output
    if isinstance(response, ToolResponse):
        if not isinstance(response.text, str):
            return f"ToolResponse.text must be a str, got {type(response.text).__name__}"
        if response.images is not None and not isinstance(response.images, list):
            return f"ToolResponse.images must be a list or None, got {type(response.images).__name__}"
    elif not isinstance(response, str):
        return f"the response must be a str or a ToolResponse, got {type(response).__name__}"
    if not is_real(reward) or not math.isfinite(reward):
        return f"the reward must be a finite number, got {shorten(repr(reward), 80)}"
    if not isinstance(metrics, Mapping):
        return f"the metrics must be a dict, got {type(metrics).__name__}"
    return None


def _describe(name: str, error: Exception) -> str:
    if isinstance(error, ToolError):  # written for the model
        return str(error)
    return f"tool {name!r} failed: {type(error).__name__}: {shorten(str(error))}"


def _cut(text: str, limit: int) -> tuple[str, int]:
    """`text` cut to `limit` characters plus a marker saying how many were removed, and that number."""
    if len(text) <= limit:
        return text, 0
    removed = len(text) - limit
    return f"{text[:limit]}\n[... {removed} characters cut ...]", removed
