"""Where tool code runs, so that a tool that does not cooperate can never hang an episode.

A `ToolBox` enforces each tool's ``timeout`` by cancelling the call. That only works for a call that yields to the
event loop; the three ways a tool can escape it each have their answer here:

* **A tool that blocks the loop** (``time.sleep`` in ``execute``, a C call that never returns) cannot be cancelled
  at all, and it stalls every episode that shares the loop (all the envs of a vector env, all the episodes of a
  rollout). A tool that may block, or that runs untrusted code, declares ``isolation: process`` in its config: each
  episode's instance then lives in a `WorkerProcess`, a process that hosts a copy of the tool object and runs its
  lifecycle calls one at a time. A call that outlives its timeout kills the process; the call is a timeout error
  like any other, the episode goes on, and the next call of that episode gets a fresh process in which the
  instance is created again with the same ``create_kwargs`` (its state is lost) — before that call's timeout
  starts, which covers the call's own work only. Worker processes are forked by a launcher process (never by the
  trainer process, whose threads make ``fork`` unsafe) that never runs the user's main script, so a script needs
  no ``__main__`` guard and may define its tool classes itself; workers are reused across episodes. This isolates
  hangs and crashes; it is not a security sandbox.
* **A tool hung in a worker thread** (``await asyncio.to_thread(...)`` that never returns) times out for the model,
  but the thread lives on, and `asyncio.run` (and the interpreter at exit) would wait for it, while a few such
  threads exhaust a thread pool. The toolbox makes a `DaemonThreadPool` the default executor of every loop its
  tools run in: its threads are daemons that are never joined, and a thread whose call was cancelled is written
  off and replaced, so the pool never runs dry.
* **Detection**: a watchdog thread warns, naming the tool, when one step of a tool coroutine holds the loop for
  longer than `BLOCKING_WARNING_S` — the sign of a tool that needs ``to_thread`` or ``isolation: process``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing.connection
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Mapping
from typing import Any

from .errors import ToolConfigError, ToolError, portable

__all__ = ["BLOCKING_WARNING_S", "DaemonThreadPool", "ProcessInstance", "WorkerProcess", "check_isolatable",
           "created_id", "use_daemon_threads", "watch_step"]

logger = logging.getLogger(__name__)

#: Seconds one step of a tool coroutine may hold the event loop before the watchdog warns about it.
BLOCKING_WARNING_S = 1.0
#: Seconds a worker process may take to start and build its copy of the tool (not part of the tool's timeout).
WORKER_START_TIMEOUT_S = 60.0


# ------------------------------------------------------------------------------------------------ threads
class DaemonThreadPool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool whose threads are daemons that nobody waits for.

    `shutdown` stops idle threads and returns at once, whatever ``wait`` says, so that neither `asyncio.run` nor
    the interpreter's exit waits for a hung thread. Cancelling a call that is already running (what a tool timeout
    does to ``asyncio.to_thread``) cannot stop it: its thread is written off — it no longer counts toward
    `max_workers`, and exits when the call eventually returns — and a new thread takes its place.

    It subclasses `ThreadPoolExecutor` only because `loop.set_default_executor` accepts nothing else; none of the
    parent's machinery is used.
    """

    def __init__(self, max_workers: int | None = None, name: str = "mt_env-tools"):
        super().__init__(max_workers, thread_name_prefix=name)
        self.max_workers: int = self._max_workers
        self.written_off = 0  #: threads abandoned to a call that was cancelled while it ran
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._counted = 0  # live threads that count toward max_workers
        self._started = 0
        self._closed = False

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future = _PoolFuture(self)
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._jobs.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and self._counted < self.max_workers:
                self._start_thread()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting work and let idle threads exit; never waits (see the class docstring)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in range(self._counted):
                self._jobs.put(None)

    def _start_thread(self) -> None:  # under self._lock
        self._counted += 1
        self._started += 1
        threading.Thread(target=self._work, name=f"{self._thread_name_prefix}_{self._started}", daemon=True).start()

    def _write_off(self) -> None:
        """The calling future's thread is stuck in a cancelled call: stop counting it, and replace it if work waits."""
        with self._lock:
            self._counted -= 1
            self.written_off += 1
            if not self._closed and not self._jobs.empty():
                self._start_thread()
        logger.warning("a tool call was cancelled while it ran in a thread; the thread is abandoned (%d so far)",
                       self.written_off)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future = job[0]
            ran = future.set_running_or_notify_cancel()
            if ran:
                _run(*job)
            del job  # an idle thread holds nothing of the last call
            if ran and future.written_off:
                return
            self._idle.release()


def _run(future: concurrent.futures.Future, fn, args: tuple, kwargs: dict) -> None:
    try:
        result = fn(*args, **kwargs)
    except BaseException as e:
        future.set_exception(e)
    else:
        future.set_result(result)


class _PoolFuture(concurrent.futures.Future):
    """A future that writes its thread off when it is cancelled while running."""

    def __init__(self, pool: DaemonThreadPool):
        super().__init__()
        self._pool = pool
        self.written_off = False

    def cancel(self) -> bool:
        if super().cancel():
            return True
        with self._condition:
            stuck = self.running() and not self.written_off
            self.written_off = self.written_off or stuck
        if stuck:
            self._pool._write_off()
        return False


_pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its DaemonThreadPool


def use_daemon_threads(loop: asyncio.AbstractEventLoop) -> None:
    """Make a `DaemonThreadPool` the default executor of `loop` (once), so that ``asyncio.to_thread`` in tools
    never holds up the loop's shutdown or the interpreter's exit."""
    if loop not in _pools:
        _pools[loop] = pool = DaemonThreadPool()
        loop.set_default_executor(pool)


# ------------------------------------------------------------------------------------------------ watchdog
class _Watchdog:
    """Which tool step each thread's event loop is running now, and a daemon thread that warns about long ones."""

    def __init__(self):
        self.running: dict[int, list] = {}  # thread id -> [tool, method, started, warned]
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def enter(self, tool: str, method: str) -> None:
        self.running[threading.get_ident()] = [tool, method, time.perf_counter(), False]
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._watch, name="mt_env-tool-watchdog", daemon=True)
                    self._thread.start()

    def exit(self) -> None:
        self.running.pop(threading.get_ident(), None)

    def _watch(self) -> None:
        while True:
            time.sleep(BLOCKING_WARNING_S / 4)
            now = time.perf_counter()
            for step in list(self.running.values()):
                tool, method, started, warned = step
                if not warned and now - started > BLOCKING_WARNING_S:
                    step[3] = True
                    logger.warning(
                        "tool %r has blocked the event loop for %.1fs in one step of %s(): every episode in this "
                        "loop waits for it. Run blocking work with `await asyncio.to_thread(...)`, or set "
                        "`isolation: process` in the tool's config", tool, now - started, method)


_watchdog = _Watchdog()


def watch_step(tool: str, method: str) -> _Watchdog:
    """Mark the start of one synchronous step of `tool`'s `method` in this thread; call ``.exit()`` after it."""
    _watchdog.enter(tool, method)
    return _watchdog


# ------------------------------------------------------------------------------------------------ processes
# Why not multiprocessing's forkserver or spawn: both make every worker import the main script again (so that objects
# defined there can be unpickled), and a script without an ``if __name__ == "__main__":`` guard — the usual first
# try — then runs its own work again inside the worker, which dies. Workers are instead forked by a `_Launcher`, a
# process started with `subprocess` whose main is this module: nothing re-runs the user's script, guarded or not,
# and forks stay cheap (the launcher has imported the toolbox once, and is single-threaded, so forking it is safe).
# The tool's class travels by cloudpickle: by reference when it is importable from a module (the worker imports it
# with this process's sys.path), by value when it is defined in the script or a notebook.
def check_isolatable(tool_class: type, config: Mapping[str, Any], tool_schema: Mapping[str, Any], name: str) -> None:
    """Raise `ToolConfigError` unless a worker process can rebuild the tool: its class, config and schema must be
    picklable by cloudpickle (a class defined in a function or in the main script is, by value)."""
    try:
        _spec(tool_class, config, tool_schema)
    except Exception as e:
        raise ToolConfigError(f"tool {name!r}: isolation: process sends the tool's class, config and schema to a "
                              f"worker process, and they cannot be pickled: {type(e).__name__}: {e}") from None


def _spec(tool_class: type, config: Mapping[str, Any], tool_schema: Mapping[str, Any]) -> bytes:
    """What a worker needs to build its copy of the tool: this process's import path, the class, config, schema."""
    import cloudpickle  # a dependency of gymnasium's, and of mt_env's process rollouts

    payload = cloudpickle.dumps((tool_class, dict(config), dict(tool_schema)))
    return pickle.dumps((list(sys.path), f"{tool_class.__module__}.{tool_class.__qualname__}", payload))


class _Launcher:
    """The process that forks this process's worker processes (see the comment above `check_isolatable`); one per
    process, started on first use and again if it died. Each start sends it one end of a new socket pair, and it
    answers with the pid of the worker it forked to serve that end. It exits when this process closes its end
    (at exit, too), and its workers die with it (``PR_SET_PDEATHSIG``, on Linux)."""

    _current: _Launcher | None = None
    _lock = threading.Lock()

    def __init__(self):
        self.owner = os.getpid()  # a forked child of this process needs a launcher of its own
        self._control, theirs = socket.socketpair()
        code = (f"import sys; sys.path[:] = {list(sys.path)!r}; from mt_env.isolation import _launcher_main; "
                f"_launcher_main({theirs.fileno()})")
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                        stdin=subprocess.DEVNULL)
        theirs.close()

    @classmethod
    def fork_worker(cls) -> tuple[int, multiprocessing.connection.Connection]:
        """A new worker process: its pid and this side of its connection. Blocking: call it in a thread."""
        mine, theirs = socket.socketpair()
        with cls._lock:
            for attempt in (1, 2):
                launcher = cls._current
                if launcher is None or launcher.owner != os.getpid() or launcher.process.poll() is not None:
                    launcher = cls._current = _Launcher()
                try:
                    socket.send_fds(launcher._control, [b"w"], [theirs.fileno()])
                    pid = int.from_bytes(_recv_exactly(launcher._control, 8), "little")
                    break
                except OSError:  # the launcher died (killed from outside): start another, once
                    launcher.process.kill()
                    cls._current = None
                    if attempt == 2:
                        raise
        theirs.close()
        return pid, multiprocessing.connection.Connection(mine.detach())


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("the worker launcher closed its socket")
        data += chunk
    return data


def _launcher_main(fd: int) -> None:
    """The launcher process: fork a worker for every socket received on `fd`, until that socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the main process; it stops us by closing `fd`
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    import cloudpickle  # noqa: F401  (imported once here, not in every worker)

    from . import tools  # noqa: F401
    control = socket.socket(fileno=fd)
    launcher = os.getpid()
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(control, 1, 1)
        except OSError:
            return
        if not fds:
            return  # the main process closed its end, or exited
        pid = os.fork()
        if pid == 0:
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # a tool may wait for processes of its own
            _die_with(launcher)
            os._exit(_worker_main(multiprocessing.connection.Connection(fds[0])))
        os.close(fds[0])
        control.sendall(pid.to_bytes(8, "little"))


def _die_with(parent: int) -> None:
    """Have the kernel kill this process when its parent exits (Linux; elsewhere a worker outlives a launcher
    that was killed until its pipe closes)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it exited before the request was made
        os._exit(1)


def _worker_main(conn: multiprocessing.connection.Connection) -> int:
    """A worker process: load the tool from the spec that comes first (`_spec`), then serve its calls (`_serve`)."""
    try:
        path, name, payload = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return 1
    sys.path[:] = path  # before the class's module is imported
    try:
        tool_class, config, tool_schema = pickle.loads(payload)
    except BaseException as e:  # the module of a class sent by reference does not import here, say
        conn.send((False, ToolError(
            f"its worker process could not load the class {name}: {type(e).__name__}: {e}. A class defined in a "
            f"module is imported by name in the worker (with the main process's sys.path): the module must import "
            f"there on its own, without what the main process did to make it importable")))
        return 1
    _serve(conn, tool_class, config, tool_schema)
    return 0


class WorkerProcess:
    """A process hosting a copy of one tool object, serving its lifecycle calls one at a time over a pipe."""

    def __init__(self, tool: Any):
        self.tool_name = tool.name
        self._spec = _spec(type(tool), tool.config, tool.tool_schema)
        self.pid: int | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self.dead = False
        self.built = False  #: the process has built its copy of the tool

    @property
    def alive(self) -> bool:
        """Started and not known to be gone: a worker only writes in answer to a call, so an idle one whose pipe
        reads (end of file) has died."""
        if self.dead or self._conn is None:
            return False
        try:
            return not self._conn.poll()
        except OSError:
            return False

    async def start(self) -> None:
        """Start the process (in a thread: the first start also starts the launcher) and wait until it has built
        its tool."""
        started = asyncio.get_running_loop().run_in_executor(None, _Launcher.fork_worker)
        limit = None
        try:
            self.pid, self._conn = await asyncio.shield(started)
            self._conn.send_bytes(self._spec)
            async with asyncio.timeout(WORKER_START_TIMEOUT_S) as limit:
                await self._reply()
            self.built = True
        except asyncio.CancelledError:
            started.add_done_callback(lambda _: self._adopt_and_kill(started))  # at once, or when a start is done
            raise
        except TimeoutError:
            self.kill()
            if limit is not None and limit.expired():  # our limit, not a TimeoutError the tool's constructor raised
                raise ToolError(f"the worker process of tool {self.tool_name!r} did not start within "
                                f"{WORKER_START_TIMEOUT_S}s") from None
            raise

    def _adopt_and_kill(self, started: asyncio.Future) -> None:
        if self.pid is None and not started.cancelled() and started.exception() is None:
            self.pid, self._conn = started.result()
        self.kill()

    async def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        """``tool.<method>(*args, **kwargs)`` in the process. Cancelling the call kills the process: the call
        cannot be stopped any other way."""
        try:
            self._conn.send((method, args, kwargs))
        except OSError:  # a closed pipe: the process is gone
            raise self._died() from None
        try:
            return await self._reply()
        except asyncio.CancelledError:
            self.kill()
            raise

    def kill(self) -> None:
        if not self.dead and self.pid is not None:
            # a worker that exited was reaped by the launcher at once; its pid is not reused that soon (pids are
            # handed out in order, up to pid_max, before they wrap)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.dead = True
        if self._conn is not None:
            self._conn.close()

    def _died(self) -> ToolError:
        self.kill()
        return ToolError(f"the worker process of tool {self.tool_name!r} died"
                         + ("" if self.built else " while it built its copy of the tool (in the tool's constructor, "
                                                  "or as it loaded the tool's class)"))

    async def _reply(self) -> Any:
        if not self._conn.poll():
            loop = asyncio.get_running_loop()
            readable = loop.create_future()
            fd = self._conn.fileno()
            loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
            try:
                await readable
            finally:
                loop.remove_reader(fd)
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError):
            raise self._died() from None
        if not ok:
            raise value
        return value


def _serve(conn, tool_class: type, config: dict, tool_schema: dict) -> None:
    """The worker process: build the tool, then run each requested call to completion and send back
    ``(True, value)`` or ``(False, exception)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the main process; it stops us through the pipe
    try:
        tool = tool_class(config=config, tool_schema=tool_schema)
    except BaseException as e:
        conn.send((False, portable(e)))
        return
    conn.send((True, None))
    loop = asyncio.new_event_loop()
    while True:
        try:
            method, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = (True, loop.run_until_complete(getattr(tool, method)(*args, **kwargs)))
        except BaseException as e:
            reply = (False, portable(e))
        try:
            conn.send(reply)
        except Exception as e:
            conn.send((False, TypeError(f"{method}() returned a value that cannot be sent to the main process: "
                                        f"{type(e).__name__}: {e}")))


_idle: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tool object -> its idle WorkerProcesses


async def _acquire(tool: Any) -> WorkerProcess:
    idle = _idle.setdefault(tool, [])
    while idle:
        worker = idle.pop()
        if worker.alive:
            return worker
    worker = WorkerProcess(tool)
    await worker.start()
    return worker


class ProcessInstance:
    """One episode's instance of an ``isolation: process`` tool: the tool's four lifecycle coroutines, run in a
    worker process. The `ToolBox` calls it as it would call the tool, each call inside `turn`; calls run one at a
    time, in call order."""

    def __init__(self, tool: Any):
        self.tool = tool
        self.restarts = 0  #: worker processes replaced after a call was killed
        self._worker: WorkerProcess | None = None
        self._instance_id: str | None = None  # the id in the current worker
        self._create_kwargs: dict = {}
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """The instance's turn for one call: waits for the calls before it, then makes sure a live worker holds the
        instance. The `ToolBox` enters it before the call's timeout starts: a call's timeout covers its own work,
        never the wait, nor a worker's start (bounded by `WORKER_START_TIMEOUT_S`: a first start also starts the
        launcher), nor the instance created again after a kill (bounded by the tool's timeout of its own)."""
        async with self._lock:
            await self._ensure_worker()
            yield

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> Any:
        try:
            created = await self._call("create", (instance_id,), create_kwargs)
        except BaseException:
            self._give_back()  # no instance was created in it
            raise
        self._instance_id, self._create_kwargs = created_id(created), create_kwargs
        return created

    async def execute(self, instance_id: str, arguments: dict, **execute_kwargs: Any) -> Any:
        return await self._call("execute", (self._instance_id, arguments), execute_kwargs)

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> Any:
        return await self._call("calc_reward", (self._instance_id,), calc_reward_kwargs)

    async def release(self, instance_id: str, **release_kwargs: Any) -> None:
        """Release the instance and give the worker back for another episode (if its process was killed, the
        instance went with it: no new worker is started to release it)."""
        async with self._lock:
            try:
                if self._worker is not None and self._worker.alive:
                    await self._call("release", (self._instance_id,), release_kwargs)
            finally:
                self._give_back()

    def _give_back(self) -> None:
        worker, self._worker, self._instance_id = self._worker, None, None
        if worker is not None and worker.alive:
            _idle.setdefault(self.tool, []).append(worker)

    async def _ensure_worker(self) -> None:
        """Take a worker (an idle one, or a new one) unless a live one is held; after a kill, create the episode's
        instance again in it, with the same ``create_kwargs``."""
        if self._worker is not None and self._worker.alive:
            return
        self._worker = await _acquire(self.tool)
        if self._instance_id is None:
            return
        self.restarts += 1
        timeout = self.tool.settings.timeout
        try:
            async with asyncio.timeout(timeout) as limit:
                created = await self._worker.call("create", (self._instance_id,), self._create_kwargs)
        except BaseException:
            self._worker.kill()  # it holds no instance: the next call tries again in a new one
            self._worker = None
            if limit.expired():  # our limit, not a TimeoutError the tool's create raised itself
                raise ToolError(f"tool {self.tool.name!r} could not create its instance again in a new worker "
                                f"process within {timeout}s") from None
            raise
        self._instance_id = created_id(created)

    async def _call(self, method: str, args: tuple, kwargs: dict) -> Any:
        """``method`` in the worker; the caller holds the lock (`turn`)."""
        if self._worker is None:
            raise ToolError(f"tool {self.tool.name!r}: {method}() was called outside ProcessInstance.turn()")
        try:
            return await self._worker.call(method, args, kwargs)
        finally:
            if not self._worker.alive:
                self._worker = None


def created_id(created: Any) -> Any:
    """The instance id in what a tool's ``create`` returned (verl >= 0.5 returns ``(instance_id, ToolResponse)``).
    Here rather than in `mt_env.tools` because `ProcessInstance` needs it too."""
    return created[0] if isinstance(created, tuple) and created else created
