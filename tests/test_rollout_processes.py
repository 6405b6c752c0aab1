"""ProcessRolloutDriver: the env work in spawned processes gives what one RolloutDriver gives with the same seed
(scripted and HF backends, GRPO groups), with the same failure rules — an episode failing in an env process, a
dying backend, a generation timeout — and a dead env process reported by its exit code, never a hang.

Starting an env process costs seconds (a fresh interpreter importing the envs and their tokenizer), so most tests
share one driver, and the module is one xdist group (its processes are started once)."""

from __future__ import annotations

import asyncio
import functools
import gc
import multiprocessing
import os
import pickle
import threading

import pytest

from agents.backend import Backend, BackendError, SamplingParams
from agents.hf_backend import HFBackend
from agents.rollout import EpisodeState, RolloutDriver, episode_ids
from agents.rollout_processes import EnvProcessError, ProcessRolloutDriver, RemoteBackend, _EnvProcess, _serve_share
from agents.scripted import ScriptedBackend
from envs.calculator import CalculatorEnv
from mt_env import wire

from .process_envs import EXITS, FAILS, GoOn, Troubled
from .test_rollout import expert, fmt, model, one_torch_thread, operands_of, run  # noqa: F401  (its fixtures)

pytestmark = pytest.mark.xdist_group("rollout_processes")

SLOW = [77, 7]  # its generation takes 30 s in the driver's process (past the driver's timeout)
TIMEOUT_S = 1.0


class Expert(Backend):
    """The driver's process's backend: the scripted calculator expert, with `latency(operands)` seconds per
    generation; raises BackendError on the operands `dies_on`. Logs each generation's end (``done``/``cancelled``
    with its operands) and counts those in flight."""

    def __init__(self, fmt):  # noqa: F811
        self.fmt = fmt
        self.scripted = ScriptedBackend(expert(fmt))
        self.latency = lambda operands: 0.0
        self.dies_on = None
        self.in_flight = 0
        self.log: list[tuple[str, list[int]]] = []

    async def generate(self, prompt_ids, params=None):
        operands = operands_of(self.fmt, prompt_ids)
        self.in_flight += 1
        try:
            await asyncio.sleep(self.latency(operands))
            if operands == self.dies_on:
                raise BackendError("the engine died")
            turn = await self.scripted.generate(prompt_ids, params)
        except asyncio.CancelledError:
            self.log.append(("cancelled", operands))
            raise
        finally:
            self.in_flight -= 1
        self.log.append(("done", operands))
        return turn


TIMING_FIELDS = {"finished_at", "generation_s", "tool_s"}


def comparable(result) -> tuple[list[dict], dict]:
    """The records (without their timings) and the metrics (without the timing ones) of a rollout."""
    records = [{k: v for k, v in r.to_dict().items() if k not in TIMING_FIELDS} for r in result.episodes]
    for r in records:  # and each tool call's duration
        r["tool_results"] = [{k: v for k, v in call.items() if k != "duration_s"} for call in r["tool_results"]]
    metrics = {k: v for k, v in result.metrics.items()
               if not (k.startswith("time/") or k in ("rollout/wall_s", "rollout/gen_tokens_per_s"))}
    return records, metrics


def tasks_for(*operands) -> list[dict]:
    return [CalculatorEnv.task_for(ops) for ops in operands]


@pytest.fixture(scope="module")
def shared(qwen25, fmt):  # noqa: F811  (fixtures imported from test_rollout)
    """One driver of 2 env processes over `Troubled` envs and an `Expert` backend, for the tests that can share it."""
    backend = Expert(fmt)
    driver = ProcessRolloutDriver(functools.partial(Troubled, tokenizer=qwen25), backend, processes=2,
                                  generation_timeout_s=TIMEOUT_S)
    yield driver, backend
    driver.close()


@pytest.fixture
def expert_driver(shared):
    """The shared driver, its backend reset to answer at once."""
    driver, backend = shared
    backend.latency, backend.dies_on = (lambda operands: 0.0), None
    backend.log.clear()
    return driver, backend


# --------------------------------------------------------------------------------------------- same results
def test_scripted_rollouts_equal_the_in_process_drivers(qwen25, expert_driver):
    driver, backend = expert_driver
    tasks = tasks_for([12, 34], [5, 6, 7], [99, 1], [2, 3, 4])
    reference = RolloutDriver(functools.partial(Troubled, tokenizer=qwen25), backend,
                              generation_timeout_s=TIMEOUT_S).run(tasks, n=3, step=4)
    for _ in range(2):  # the second rollout on the envs the processes kept
        result = driver.run(tasks, n=3, step=4)
        assert comparable(result) == comparable(reference)
        assert result.samples == reference.samples  # ids, masks, rewards, and the group and episode tags
    assert [r.state for r in result.episodes] == [EpisodeState.COMPLETED] * 12
    assert [(s.group, s.episode) for s in result.samples] == [(k // 3, k) for k in range(12)]
    assert result.metrics["rollout/success_rate"] == 1.0
    assert sum(result.metrics[k] for k in ("time/generation_s", "time/tools_s", "time/bookkeeping_s")) > 0


def test_sampled_hf_rollouts_equal_the_in_process_drivers(qwen25, model):  # noqa: F811
    """Every request carries its own seed, so the engine samples the same tokens however the requests are
    batched; the logprobs agree up to the float rounding that batch composition changes."""
    tasks, sampling = tasks_for([12, 34], [5, 6, 7], [99, 1]), SamplingParams(temperature=1.0, max_new_tokens=8)
    make_env = functools.partial(GoOn, tokenizer=qwen25)
    results = []
    for make_driver in (functools.partial(RolloutDriver, make_env), functools.partial(ProcessRolloutDriver, make_env,
                                                                                       processes=2)):
        backend = HFBackend(model, seed=0)
        driver = make_driver(backend, sampling, seed=7)
        try:
            results.append(driver.run(tasks, n=2, step=3))
        finally:
            driver.close()
            asyncio.run(backend.close())
    reference, result = results
    assert [r.turns for r in result.episodes] == [2] * 6
    assert comparable(result) == comparable(reference)
    for got, want in zip(result.samples, reference.samples, strict=True):
        assert (got.ids, got.segments, got.group, got.episode) == (want.ids, want.segments, want.group, want.episode)
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    for g in range(3):  # the members of a group sampled different answers (their own seeds)
        assert len({tuple(s.ids[s.prompt_len:]) for s in result.samples if s.group == g}) == 2


def test_each_record_reaches_the_drivers_process_whole_as_its_episode_ends(expert_driver):
    """Not all at once after the last turn: the records of the episodes that ended early are here, samples and all,
    while a slow episode still plays, and they are the records the rollout returns."""
    driver, backend = expert_driver
    slow = [5, 6, 7]  # three turns of 0.5 s
    backend.latency = lambda operands: 0.5 if operands == slow else 0.0
    arrived = []  # (record, generations still in flight when it arrived)
    ids = episode_ids(2, 2)
    records, _ = run(driver.play(tasks_for([12, 34], slow), ids, 0, SamplingParams(),
                                 on_finished=lambda r: arrived.append((r, backend.in_flight))))
    early = [(r, in_flight) for r, in_flight in arrived if r.id.group == 0]
    assert len(early) == 2 and all(in_flight > 0 for _, in_flight in early)  # the slow ones were still generating
    assert all(r.samples and r.messages and r.state == EpisodeState.COMPLETED for r, _ in arrived)
    assert sorted(map(id, records)) == sorted(id(r) for r, _ in arrived) and [r.id for r in records] == ids


class Together(Backend):
    """The scripted expert, whose generations wait in rounds: the k-th round goes on once `rounds[k]` wait, all in
    one pass of the event loop (as an engine settles a turn boundary); after the last round, each at once. A turn
    for the operands `unpicklable` carries a lock in its meta."""

    def __init__(self, fmt):  # noqa: F811
        self.fmt = fmt
        self.scripted = ScriptedBackend(expert(fmt))
        self.rounds: list[int] = []
        self.unpicklable = None
        self._gate: asyncio.Event | None = None
        self._waiting = 0

    async def generate(self, prompt_ids, params=None):
        if self.rounds:
            gate = self._gate = self._gate or asyncio.Event()
            self._waiting += 1
            if self._waiting == self.rounds[0]:
                self.rounds, self._gate, self._waiting = self.rounds[1:], None, 0
                gate.set()
            await gate.wait()
        turn = await self.scripted.generate(prompt_ids, params)
        if operands_of(self.fmt, prompt_ids) == self.unpicklable:
            turn.meta["lock"] = threading.Lock()
        return turn


@pytest.fixture(scope="module")
def gated(qwen25, fmt):  # noqa: F811
    """A driver of 2 env processes over a `Together` backend, with a generation timeout no wait here reaches."""
    backend = Together(fmt)
    driver = ProcessRolloutDriver(functools.partial(Troubled, tokenizer=qwen25), backend, processes=2,
                                  generation_timeout_s=120)
    yield driver, backend
    driver.close()


def test_the_answers_settled_together_go_to_an_env_process_in_one_message(gated, monkeypatch):
    """Four episodes of two turns over two processes; the engine settles each turn's four generations together:
    each process gets one message with its two answers a turn, not a message per answer."""
    driver, backend = gated
    backend.rounds, backend.unpicklable = [4, 4], None
    sent = []
    send = _EnvProcess.send_bytes

    def recorded(process, data):
        message = pickle.loads(data)  # a tuple, or the driver's spec for a new process
        if isinstance(message, tuple):
            sent.append((process.index, message[0], len(message[1]) if message[0] == "answers" else None))
        send(process, data)

    monkeypatch.setattr(_EnvProcess, "send_bytes", recorded)
    result = driver.run(tasks_for([12, 34], [56, 78]), n=2)
    assert [r.turns for r in result.episodes] == [2] * 4
    answers = [(index, count) for index, kind, count in sent if kind != "play"]
    assert sorted(answers) == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_an_answer_that_cannot_be_sent_fails_its_episode_alone(gated):
    """One of the two answers of each process's message holds a lock (unpicklable): that generation fails with the
    reason, at once; the other answer in the message reaches its episode, which completes."""
    driver, backend = gated
    backend.rounds, backend.unpicklable = [4], [12, 34]
    result = driver.run(tasks_for([12, 34], [56, 78]), n=2)
    for record in result.episodes:
        if record.id.group == 0:
            assert record.state == EpisodeState.FAILED
            assert "could not be sent to the env process" in record.error and "pickle" in record.error
        else:
            assert record.state == EpisodeState.COMPLETED and record.turns == 2


class RecordedConn:
    """An env process's end of its pipe, logging the kind of each message it sends into `log`."""

    def __init__(self, conn, log: list):
        self.conn, self.log = conn, log

    def send(self, message):
        self.log.append(("sent", message[0]))
        self.conn.send(message)

    def send_bytes(self, data: bytes):  # an encoded message (`mt_env.wire`): the records
        self.log.append(("sent", wire.loads(data)[0]))
        self.conn.send_bytes(data)

    def recv(self):
        return self.conn.recv()

    def poll(self, *args):
        return self.conn.poll(*args)

    def fileno(self):
        return self.conn.fileno()


def test_an_env_process_sends_a_shares_result_before_collecting_its_garbage(qwen25, fmt):  # noqa: F811
    """The rollout waits for each share's result: the young collection of the share's objects (due once the
    driver's pause of the collector ends) must come after it, when the process waits for its next share. The share
    is served here (this process as the env process, a thread as the driver's side answering with the expert)."""
    here, there = multiprocessing.Pipe()
    log: list[tuple[str, object]] = []
    conn = RecordedConn(there, log)
    backend = RemoteBackend(conn)
    driver = RolloutDriver(functools.partial(Troubled, tokenizer=qwen25), backend, generation_timeout_s=120)
    scripted = ScriptedBackend(expert(fmt))

    def answer() -> None:  # the driver's side: answer each generation, until the result (or an error) arrives
        while (message := here.recv())[0] not in ("result", "error"):
            if message[0] == "generate":
                _, key, prompt_ids, params = message
                here.send(("answers", [("turn", key, asyncio.run(scripted.generate(prompt_ids, params)))]))

    def collections(phase: str, info: dict) -> None:
        if phase == "start":
            log.append(("collection", info["generation"]))

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    gc.callbacks.append(collections)
    try:
        _serve_share(driver, backend, conn, (tasks_for([12, 34], [5, 6, 7]), episode_ids(2, 2), 0, SamplingParams()))
    finally:
        gc.callbacks.remove(collections)
        thread.join(timeout=30)
        driver.close()
    last_record = max(i for i, event in enumerate(log) if event == ("sent", "finished"))
    result = log.index(("sent", "result"))
    assert log.count(("sent", "finished")) == 4 and result > last_record
    assert [event for event in log[last_record:result] if event[0] == "collection"] == []


# --------------------------------------------------------------------------------------------- failures
def test_an_episode_failing_in_an_env_process_fails_alone(qwen25, expert_driver):
    driver, _ = expert_driver
    result = driver.run(tasks_for([12, 34], FAILS, [56, 78]), n=2)
    failed = [r for r in result.episodes if r.id.group == 1]
    assert all(r.state == EpisodeState.FAILED and r.error == "RuntimeError: the scorer broke on 13 * 13"
               for r in failed)
    assert all(r.state == EpisodeState.COMPLETED and r.success for r in result.episodes if r.id.group != 1)
    assert result.metrics["rollout/failed"] == 2
    for sample in result.samples:  # the failed episodes' tokens are kept, untrainable
        assert sample.trainable == (sample.group != 1) and len(sample.ids) > sample.prompt_len


def test_a_dying_backend_fails_the_whole_rollout_at_once_then_the_driver_works_again(expert_driver):
    driver, backend = expert_driver
    backend.dies_on = FAILS
    backend.latency = lambda operands: 0.05 if operands == FAILS else 30.0  # the others are in flight meanwhile

    async def rollout():
        try:
            await driver.arun(tasks_for([12, 34], FAILS, [56, 78]), n=2)
        except BackendError as e:
            await asyncio.sleep(0)  # the cancelled generations' turn to end
            return e, backend.in_flight

    error, in_flight = run(rollout())  # not `run`'s timeout: the rollout did not wait for the others
    assert isinstance(error, BackendError) and str(error) == "the engine died"
    assert in_flight == 0 and all(end == "cancelled" for end, _ in backend.log)  # none left running

    backend.dies_on, backend.latency = None, lambda operands: 0.0
    assert driver.run(tasks_for([12, 34], [56, 78]), n=2).metrics["rollout/completed"] == 4


def test_a_timed_out_generation_fails_its_episode_and_is_cancelled_at_once(expert_driver):
    driver, backend = expert_driver
    neighbour = [5, 6, 7]  # three turns of half the timeout each: it ends after the slow ones time out
    backend.latency = lambda operands: 30.0 if operands == SLOW else TIMEOUT_S / 2 if operands == neighbour else 0.0

    async def rollout():
        result = await driver.arun(tasks_for(SLOW, neighbour), n=2)
        return result, backend.in_flight  # counted before this event loop's end cancels anything

    result, in_flight = run(rollout())
    for record in result.episodes:
        if record.id.group == 0:
            assert record.state == EpisodeState.FAILED and record.error == f"generation timed out after {TIMEOUT_S}s"
        else:
            assert record.state == EpisodeState.COMPLETED and record.turns == 3
    assert in_flight == 0
    # each slow generation was cancelled when its env process gave up on it, not at the end of the rollout
    ends = [entry for entry in backend.log if entry[1] in (SLOW, neighbour)]
    assert ends.count(("cancelled", SLOW)) == 2 and ("done", SLOW) not in ends
    assert ends[-1] == ("done", neighbour)


def test_a_dead_env_process_fails_the_rollout_then_new_ones_start(expert_driver):
    driver, _ = expert_driver
    before = driver.pids
    with pytest.raises(EnvProcessError, match=r"env process \d died \(exit code 3\)"):
        run(driver.arun(tasks_for([12, 34], EXITS, [56, 78], [5, 6])))
    result = driver.run(tasks_for([12, 34], [56, 78], [5, 6]), n=2)
    assert result.metrics["rollout/completed"] == 6
    assert len(driver.pids) == 2 and set(driver.pids) != set(before)


# --------------------------------------------------------------------------------------------- arguments
def test_bad_arguments_are_refused_clearly(qwen25, fmt, expert_driver):  # noqa: F811
    driver, _ = expert_driver
    with pytest.raises(ValueError, match="processes must be >= 1"):
        ProcessRolloutDriver(functools.partial(Troubled, tokenizer=qwen25), ScriptedBackend(expert(fmt)), processes=0)
    with pytest.raises(ValueError, match="n must be >= 1"):
        driver.run(tasks_for([12, 34]), n=0)
    lock = threading.Lock()
    with pytest.raises(TypeError, match="must be picklable by cloudpickle.*cannot pickle '_thread.lock'"):
        ProcessRolloutDriver(lambda: (lock, CalculatorEnv(tokenizer=qwen25))[1], ScriptedBackend(expert(fmt)),
                             processes=1)


# --------------------------------------------------------------------------------------------- lifecycle
def test_close_stops_the_processes_and_a_later_rollout_starts_new_ones(expert_driver):
    driver, _ = expert_driver
    driver.run(tasks_for([12, 34]), n=2)
    started = driver.pids
    assert len(started) == 2 and all(_alive(pid) for pid in started)
    driver.close()
    assert driver.pids == [] and not any(_alive(pid) for pid in started)
    assert driver.run(tasks_for([12, 34]), n=2).metrics["rollout/completed"] == 2
    assert len(driver.pids) == 2 and not set(driver.pids) & set(started)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
