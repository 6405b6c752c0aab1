"""Awaiting a tool's coroutine under a deadline, for `mt_env.tools.ToolBox`: a call that never suspends runs inline
(no task, no timer), one that suspends continues as a task under the timeout, and one that ignores its cancellation
is abandoned after a short grace instead of awaited. Each synchronous step is shown to the blocking watchdog
(`mt_env.isolation.watch_step`) as the (tool, method) it belongs to.
"""

from __future__ import annotations

import asyncio
import types
from typing import Any

from .isolation import watch_step

#: seconds a timed-out call is given to end after its cancellation before it is abandoned
CANCEL_GRACE_S = 0.1


class ToolTimeout(Exception):
    """Raised by `with_timeout` only (a tool's own TimeoutError is an ordinary exception)."""


async def with_timeout(awaitable: Any, timeout: float, step: tuple[str, str],
                        slot: asyncio.Semaphore | None = None) -> Any:
    """Await `awaitable` for at most `timeout` seconds, then cancel it and raise `ToolTimeout`. Unlike
    `asyncio.wait_for`, a call that ignores its cancellation is abandoned after a short grace instead of awaited.

    Most tools finish without ever suspending (pure computation); those run inline here, with no task and no
    timer — the event-loop overhead would otherwise dominate an env step. A tool that suspends continues as a task
    under the timeout, holding `slot` (when given) until it ends. Each synchronous step of the coroutine is shown to
    the blocking watchdog as `step`, the (tool, method) it belongs to."""
    if type(awaitable) is types.CoroutineType:
        watch = watch_step(*step)  # its first synchronous step (`_advance`, inline: most tools take only this one)
        try:
            first = awaitable.send(None)
        except StopIteration as done:
            return done.value
        finally:
            watch.exit()
        awaitable = resume(awaitable, first, step)
    if slot is not None:
        try:
            await slot.acquire()  # the tool waits where it suspended: its own await resumes once it has a slot
        except BaseException:
            awaitable.close()
            raise
    try:
        return await _timed(asyncio.ensure_future(awaitable), timeout)
    finally:
        if slot is not None:
            slot.release()


async def _timed(task: asyncio.Future, timeout: float) -> Any:
    """`task`'s result within `timeout` seconds; else it is cancelled, given a short grace, and `ToolTimeout` raised."""
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if done:
        return task.result()
    task.cancel()
    await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
    task.add_done_callback(_discard_outcome)
    raise ToolTimeout


@types.coroutine
def resume(coro, yielded, step: tuple[str, str] | None = None):
    """Drive a coroutine that was started by hand and suspended on `yielded` (what `yield from` would do, from
    the middle): values and exceptions from the event loop go in, its awaits come out."""
    while True:
        try:
            sent = yield yielded
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as e:  # cancellation and other throws go to the tool
            try:
                yielded = _advance(coro.throw, e, step)
            except StopIteration as done:
                return done.value
        else:
            try:
                yielded = _advance(coro.send, sent, step)
            except StopIteration as done:
                return done.value


def _advance(advance, value: Any, step: tuple[str, str] | None) -> Any:
    """``advance(value)`` (a coroutine's send or throw), watched as one step of `step` when it is a tool's."""
    if step is None:
        return advance(value)
    watch = watch_step(*step)
    try:
        return advance(value)
    finally:
        watch.exit()


def _discard_outcome(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieve it so that asyncio does not log "exception was never retrieved"
