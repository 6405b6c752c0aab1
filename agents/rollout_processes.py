"""Rollouts whose env work runs in processes of its own, beside an engine in this process.

An episode's env work — parsing a turn, running its tools, rendering and encoding the template delta, building the
training samples — is Python, and in one process it shares one interpreter lock with the embedded engine's worker
thread: while the event loop steps hundreds of envs, the engine waits to launch its next step, and the episodes'
work at a turn boundary (when many turns end together) is done one after another. `ProcessRolloutDriver` splits the
episodes over `processes` env processes, each running a `RolloutDriver` over its share with the envs it owns; their
backend is a `RemoteBackend` that sends each turn's context ids here, where the real backend (e.g. `HFBackend`, which
needs the trainer's module) generates and the ModelTurn goes back (with the others settled at the same moment, e.g.
a turn boundary's, in one message). This process then only forwards token ids.

What stays the same as one `RolloutDriver` with the same seed: every episode's seed, sampling seeds, records,
samples and metrics (the engine's tokens depend only on each request's own seed), the failure rules (an episode
that fails is kept, untrainable; a `BackendError` — the engine died — fails the whole rollout), generation timeouts
and cancellation (a share that fails cancels the others at once). Differences: the env must be picklable by
cloudpickle (a registered Gymnasium id, a class, a function or lambda that builds one; else a TypeError says so);
`time/*` is the mean of the processes' splits; and a process that dies fails the rollout with its exit code. The
processes still playing when a rollout fails are stopped; the next rollout starts new ones.

Processes are started on first use (``spawn``: nothing of this process's threads or CUDA state is inherited) and
live until `close` (a later rollout starts them again); each keeps its envs between rollouts, as `RolloutDriver`
keeps its pool.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import multiprocessing
import pickle
import queue
import signal
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import cloudpickle
import gymnasium as gym

from mt_env.collector import collector_paused
from mt_env import wire
from mt_env.errors import portable
from mt_env.turn import ModelTurn

from .backend import Backend, SamplingParams
from .rollout import EpisodeDriver, EpisodeId, EpisodeRecord, RolloutDriver, first_error


class EnvProcessError(RuntimeError):
    """An env process died or could not run its share of a rollout."""


class ProcessRolloutDriver(EpisodeDriver):
    """`RolloutDriver`'s interface (`run`, `arun`, `close`) with the episodes' env work in `processes` processes.

    Args: those of `RolloutDriver`, and
        processes: env processes (>= 1); the episodes of a rollout are dealt to them in turn.
        max_concurrency: episodes in flight at once over all processes (each has its share of it).
    """

    def __init__(self, env: Callable[[], gym.Env] | str, backend: Backend, sampling: SamplingParams | None = None, *,
                 processes: int, env_kwargs: dict | None = None, max_concurrency: int = 256,
                 generation_timeout_s: float | None = 600, seed: int = 0, progress: bool = False):
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.backend = backend
        self.sampling = sampling or SamplingParams()
        self.processes = processes
        self.progress = progress
        per_process = max(1, -(-max_concurrency // processes))
        try:
            # what each env process builds its RolloutDriver from, given its RemoteBackend (sent once)
            self._spec = cloudpickle.dumps(functools.partial(RolloutDriver, env, env_kwargs=env_kwargs,
                                                             max_concurrency=per_process,
                                                             generation_timeout_s=generation_timeout_s, seed=seed,
                                                             precheck_drift=True))
        except Exception as e:
            raise TypeError(f"the env of a ProcessRolloutDriver must be picklable by cloudpickle (a registered "
                            f"Gymnasium id, a class, or a function that builds the env), and {env!r} with "
                            f"env_kwargs {env_kwargs!r} is not: {type(e).__name__}: {e}") from e
        self._workers: list[_EnvProcess] = []

    async def play(self, tasks: Sequence[dict], ids: Sequence[EpisodeId], step: int, sampling: SamplingParams,
                   on_finished: Callable[[EpisodeRecord], None] | None = None) -> tuple[list[EpisodeRecord], Counter]:
        """`RolloutDriver.play` over the processes: each plays every `processes`-th episode (`run` and `arun`
        return what `RolloutDriver`'s do for the same arguments)."""
        shares = [ids[k::self.processes] for k in range(self.processes)]
        try:
            workers = self._started()
            with collector_paused():  # as in RolloutDriver.play: no full collection stalls the engine meanwhile
                async with asyncio.TaskGroup() as group:  # the first failure cancels the other shares at once
                    plays = [group.create_task(w.play({g: tasks[g] for g in {e.group for e in share}}, share, step,
                                                      sampling, self.backend, on_finished))
                             for w, share in zip(workers, shares) if share]
        except BaseException as e:  # a failure, or this rollout cancelled: the processes still playing are stopped
            self._stop([w for w in self._workers if not w.idle])  # (their state is unknown)
            if isinstance(e, BaseExceptionGroup):  # raise a dead backend's error as it is, as RolloutDriver does
                raise first_error(e) from None
            raise
        outcomes = [p.result() for p in plays]
        by_id = {r.id: r for records, _ in outcomes for r in records}
        spent = sum((Counter({k: v / len(outcomes) for k, v in s.items()}) for _, s in outcomes), Counter())
        return [by_id[e] for e in ids], spent

    @property
    def pids(self) -> list[int]:
        """The process ids of the env processes started and not stopped."""
        return [w.process.pid for w in self._workers]

    def close(self) -> None:
        """Stop the env processes (their envs are closed first); a later rollout starts new ones."""
        self._stop(self._workers)

    def _started(self) -> list[_EnvProcess]:
        """The env processes, those missing started, each sent the driver's spec (through its writer thread: this
        does not wait for the processes, which import their modules side by side)."""
        self._workers = [w for w in self._workers if w.alive]
        fresh = [_EnvProcess(len(self._workers) + k) for k in range(self.processes - len(self._workers))]
        for w in fresh:
            w.send_bytes(self._spec)
        self._workers += fresh
        return self._workers

    def _stop(self, workers: list[_EnvProcess]) -> None:
        for w in workers:
            w.stop()
        self._workers = [w for w in self._workers if w not in workers]

    def __del__(self):
        # No module globals here (contextlib, ...): at interpreter exit they may be None already, and so may parts of
        # multiprocessing.
        try:
            for w in getattr(self, "_workers", []):
                w.stop(wait=False)
        except Exception:
            pass


def rollout_driver(env: Callable[[], gym.Env] | str, backend: Backend, sampling: SamplingParams | None = None, *,
                   processes: int = 0, **kwargs) -> EpisodeDriver:
    """The driver of a training rollout: a `RolloutDriver`, or with `processes` > 0 a `ProcessRolloutDriver` over
    that many env processes; `kwargs` are their common arguments (`max_concurrency`, `seed`, ...)."""
    if processes:
        return ProcessRolloutDriver(env, backend, sampling, processes=processes, **kwargs)
    return RolloutDriver(env, backend, sampling, **kwargs)


class _EnvProcess:
    """One env process, and this side of its pipe: runs a share of a rollout there and answers its generations."""

    def __init__(self, index: int):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.index = index
        self.process = context.Process(target=_env_process_main, args=(child,), name=f"mt_env-envs-{index}",
                                       daemon=True)
        self.process.start()
        child.close()
        self.idle = True
        # This side never blocks on a write: a writer thread sends, so the event loop always goes on reading the
        # process's messages — with both sides blocked in a write to a full pipe, neither would read again.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._replies: list[tuple] = []  #: answers to send at the end of this pass of the event loop (`_reply`)
        self._writer = threading.Thread(target=self._write, name=f"mt_env-envs-{index}-writer", daemon=True)
        self._writer.start()

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    async def play(self, tasks: Mapping[int, dict], ids: list[EpisodeId], step: int, sampling: SamplingParams,
                   backend: Backend, on_finished: Callable[[EpisodeRecord], None] | None
                   ) -> tuple[list[EpisodeRecord], Counter]:
        """Have the process play `ids`; serve its generations with `backend` meanwhile. Each episode's record comes
        back as the episode ends (unpickled here while the others play, not all at once after the last)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        answers: dict[int, asyncio.Future] = {}
        finished: dict[EpisodeId, EpisodeRecord] = {}

        def arrived(record: EpisodeRecord) -> None:
            finished[record.id] = record
            if on_finished is not None:
                on_finished(record)

        def on_message() -> None:
            try:
                while not done.done() and self.conn.poll():
                    self._handle(wire.loads(self.conn.recv_bytes()), backend, answers, done, arrived)
            except (EOFError, OSError):
                if not done.done():
                    self.process.join(timeout=1)
                    done.set_exception(EnvProcessError(
                        f"env process {self.index} died (exit code {self.process.exitcode})"))

        self.idle = False
        self._replies = []  # any left are from an event loop that ended before it sent them (their share is over)
        self._send(("play", tasks, ids, step, sampling))
        loop.add_reader(self.conn.fileno(), on_message)
        try:
            spent = await done
        finally:
            loop.remove_reader(self.conn.fileno())
            for future in answers.values():
                future.cancel()
            answers.clear()  # a generation that ended before its cancel is not answered either (`_answer`)
        self.idle = True
        return [finished[e] for e in ids], spent  # its RolloutDriver reports every episode before the result

    def _handle(self, message: tuple, backend: Backend, answers: dict[int, asyncio.Future], done: asyncio.Future,
                arrived: Callable[[EpisodeRecord], None]) -> None:
        kind, *body = message
        if kind == "generate":
            key, prompt_ids, params = body
            # submitted now, not at the event loop's next pass: a burst of requests read here reaches the engine
            # as it is read, so that the engine's gathering sees it arrive without gaps (and no task per request)
            answers[key] = future = backend.submit(prompt_ids, params)
            future.add_done_callback(functools.partial(self._answer, key, answers))
        elif kind == "cancel":
            future = answers.pop(body[0], None)
            if future is not None:
                future.cancel()
        elif kind == "finished":
            arrived(body[0])
        elif kind == "result":
            done.set_result(body[0])
        elif kind == "error":
            done.set_exception(body[0])

    def _answer(self, key: int, answers: dict[int, asyncio.Future], future: asyncio.Future) -> None:
        """Send a generation's outcome: its ModelTurn, or its error (raised in the env process, where the
        in-process driver would have seen it); a cancelled one (by its env process, or with the share) is not
        answered."""
        wanted = answers.pop(key, None) is not None  # not when its cancel, or its share's end, came after it ended
        if future.cancelled():
            return
        error = future.exception()  # retrieved even when not sent: no "exception never retrieved" at collection
        if not wanted:
            return
        if error is not None:
            self._reply(("failed", key, portable(error, EnvProcessError)))
        else:
            self._reply(("turn", key, future.result()))

    def _reply(self, answer: tuple) -> None:
        """Send an answer with the others settled in this pass of the event loop, in one message: an engine settles
        the turns that end at one step together (a turn boundary: a share's whole batch), and one message for
        them is one pickling, one wake-up of the writer thread and one read there, not one of each per turn."""
        if not self._replies:
            asyncio.get_running_loop().call_soon(self._send_replies)
        self._replies.append(answer)

    def _send_replies(self) -> None:
        """Send the answers `_reply` gathered. One that cannot be pickled (e.g. a backend's ModelTurn whose `meta`
        holds a handle) goes as that generation's failure, so that it costs neither the others nor a wait for the
        env process's timeout."""
        replies, self._replies = self._replies, []
        try:
            data = pickle.dumps(("answers", replies))
        except Exception:
            data = pickle.dumps(("answers", [_sendable(answer) for answer in replies]))
        self.send_bytes(data)

    def _send(self, message: tuple) -> None:
        self.send_bytes(pickle.dumps(message))

    def send_bytes(self, data: bytes) -> None:
        """Queue `data` for the writer thread."""
        self._outbox.put(data)

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except (BrokenPipeError, EOFError, OSError):
                return  # the process is gone: its reader reports that

    def stop(self, wait: bool = True) -> None:
        """Have an idle process close its envs and exit; a process mid-rollout (which would not read that) is
        terminated."""
        if self.process.is_alive() and self.idle:
            self._send(("close",))
            if wait:
                self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
            if wait:
                self.process.join(timeout=5)
        self._outbox.put(None)
        if wait:
            self._writer.join(timeout=5)  # a write to a process gone fails at once
        self.conn.close()


def _sendable(answer: tuple) -> tuple:
    """`answer`, or when it cannot be pickled, the failure of its generation saying why."""
    try:
        pickle.dumps(answer)
    except Exception as e:
        kind, key, _ = answer
        return "failed", key, EnvProcessError(f"the backend's {'answer' if kind == 'turn' else 'error'} could not be "
                                              f"sent to the env process: {type(e).__name__}: {e}")
    return answer


class RemoteBackend(Backend):
    """The backend of an env process: each generation goes to the driver's process and its ModelTurn comes back."""

    def __init__(self, conn):
        self.conn = conn
        self._pending: dict[int, asyncio.Future] = {}
        self._keys = itertools.count()

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> ModelTurn:
        key = next(self._keys)
        future = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        self.conn.send(("generate", key, list(prompt_ids), params or SamplingParams()))
        try:
            return await future
        except asyncio.CancelledError:
            self.conn.send(("cancel", key))
            raise
        finally:
            self._pending.pop(key, None)

    def on_message(self) -> None:
        """The driver's process answered (a message of answers: `_EnvProcess._reply`): settle those generations."""
        while self.conn.poll():
            _, answers = self.conn.recv()
            for kind, key, value in answers:
                future = self._pending.get(key)
                if future is None or future.done():
                    continue  # cancelled meanwhile
                if kind == "turn":
                    future.set_result(value)
                else:
                    future.set_exception(value)


def _env_process_main(conn) -> None:
    """An env process: build the driver once (from the spec that comes first), then play each share it is sent
    until told to close. Ctrl-C is the driver's process's to handle (a trainer saves at the step boundary): here
    it is ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        make_driver = cloudpickle.loads(conn.recv_bytes())
    except Exception as e:  # e.g. the env's class cannot be imported here: the first rollout raises this
        conn.send(("error", EnvProcessError(f"env process could not load its env: {type(e).__name__}: {e}")))
        return
    backend = RemoteBackend(conn)
    driver = make_driver(backend=backend)
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            if message[0] == "close":
                return
            if message[0] == "answers":  # late: answered here before the last share's cancel reached the driver
                continue
            _serve_share(driver, backend, conn, message[1:])
    finally:
        driver.close()


def _serve_share(driver: RolloutDriver, backend: RemoteBackend, conn, share: tuple) -> None:
    """Play a share (tasks, ids, step, sampling) and send its result, or its error. The collector stays paused until
    the result is sent: the young collection of the share's objects (which the driver's own pause leaves to the
    next allocation) then runs while this process waits for its next share, not between the last record and the
    result, which the rollout waits for."""
    with collector_paused():
        try:
            asyncio.run(_play_share(driver, backend, conn, *share))
        except BaseException as e:
            conn.send(("error", portable(e, EnvProcessError)))
            if not isinstance(e, Exception):
                raise


async def _play_share(driver: RolloutDriver, backend: RemoteBackend, conn, tasks, ids, step, sampling) -> None:
    """Play a share, sending each episode's record as it ends (so the encoding, and the driver's process's
    decoding, of a share's records is spread over the rollout instead of following its last turn; `mt_env.wire`),
    then the wall-time split as the result (before the event loop is torn down)."""
    loop = asyncio.get_running_loop()
    loop.add_reader(conn.fileno(), backend.on_message)

    def finished(record: EpisodeRecord) -> None:
        conn.send_bytes(wire.dumps(("finished", record)))

    try:
        _, spent = await driver.play(tasks, ids, step, sampling, on_finished=finished)
    finally:
        loop.remove_reader(conn.fileno())
    conn.send(("result", dict(spent)))
