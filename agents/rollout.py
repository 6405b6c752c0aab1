"""The asynchronous multi-turn rollout: many episodes in flight against one backend, each its own state machine.

    PENDING ──reset──▶ RUNNING ──turn with tool calls──▶ TOOL_CALLING ──tools returned──▶ RUNNING ─ … ─▶
        COMPLETED (terminated) | TRUNCATED (turn limit, token budget, aborted generation) | FAILED (an error)

Every episode is a coroutine that drives one env through its public Gymnasium API (`areset` / `astep`, the async
twins) and asks the backend for the next turn the moment its tools return — there is no lockstep across episodes:
a short episode finishes while a long one is still generating, and the backend batches whatever requests are in
flight. The driver tags each finished episode's samples with its group and episode (`RolloutResult.samples`), ready
for `mt_env.batch.collate`.

Failure isolation: an exception inside one episode (a tool, the parser, a generation error, a timeout) marks it
FAILED with the reason; the other episodes go on. A failed episode's tokens stay in the batch with loss mask 0 and
it is counted — never silently dropped. A prompt longer than the token budget is skipped and counted
(``rollout/skipped``). A backend that dies (`BackendError`) fails the whole rollout with that error, at once.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import hashlib
import itertools
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import gymnasium as gym

from mt_env.collector import collector_paused
from mt_env.env import ToolEnv
from mt_env.errors import BudgetError
from mt_env.info import StepInfo
from mt_env.sample import Sample

from .backend import Backend, BackendError, SamplingParams


class EpisodeState(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    TOOL_CALLING = "tool_calling"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    FAILED = "failed"


class EpisodeId(NamedTuple):
    """`group`: the task's index in the batch (GRPO groups); `index`: the sample within the group."""

    group: int
    index: int


def _stat(name: str) -> property:
    return property(lambda self: self.stats.get(name, 0), doc=f"the env's {name!r} (`ToolEnv.episode_stats`)")


@dataclass
class EpisodeRecord:
    """One episode as the driver saw it (JSON-friendly apart from `samples`).

    What the env counted — turns, tool calls and errors, parse errors, rewards — is `stats`, the env's own
    `episode_stats()` read once when the episode ends or fails; the driver adds only what it alone sees: the states,
    the finish reasons and token counts of the generations, timings."""

    id: EpisodeId
    state: EpisodeState = EpisodeState.PENDING
    history: list[str] = field(default_factory=list)  #: states in the order they were entered
    error: str | None = None  #: why it FAILED (or was skipped)
    end_reason: str | None = None
    success: bool = False
    finish_reasons: list[str] = field(default_factory=list)  #: per generated turn
    prompt_tokens: int = 0
    generated_tokens: int = 0
    stats: dict = field(default_factory=dict)  #: `ToolEnv.episode_stats()`; empty when the episode never started
    messages: list[dict] = field(default_factory=list)
    #: per tool call answered, in order: the env's ``info["tool_results"]`` entries (name, call_id, error,
    #: error_kind, duration_s, reward, metrics): what the messages do not say about a call
    tool_results: list[dict] = field(default_factory=list)
    generation_s: float = 0.0  #: time this episode spent waiting for the backend
    tool_s: float = 0.0  #: time it spent in env steps (tools, parsing, conversation bookkeeping)
    finished_at: float = 0.0  #: seconds since the rollout started
    samples: list[Sample] = field(default_factory=list, repr=False)

    turns = _stat("turns")
    tool_calls = _stat("tool_calls")
    tool_errors = _stat("tool_errors")
    parse_errors = _stat("parse_errors")
    final_reward = _stat("final_reward")
    total_reward = _stat("total_reward")

    def enter(self, state: EpisodeState) -> None:
        self.state = state
        self.history.append(state.value)

    def to_dict(self) -> dict:
        out = {k: (v.value if isinstance(v, enum.Enum) else list(v) if k == "id" else v)
               for k, v in self.__dict__.items() if k not in ("samples", "stats")}
        return {**out, **self.stats}


@dataclass
class RolloutResult:
    episodes: list[EpisodeRecord]
    metrics: dict[str, float]  #: everything measured about the rollout (`rollout/*`, `time/*`)

    @property
    def samples(self) -> list[Sample]:
        """Every episode's training samples, tagged with their group and episode (failed ones untrainable)."""
        return [s for e in self.episodes for s in e.samples]

    def summary(self) -> dict[str, float]:
        """The headline figures of `metrics` under short names, for evaluation tables: means over the episodes
        played to their end (not failed or skipped), and pass@n, the share of tasks that at least one of their
        `n` samples solved."""
        m = self.metrics
        return {"played": m["rollout/completed"] + m["rollout/truncated"], "success": m["rollout/success_rate"],
                "reward": m["rollout/reward_mean"], "turns": m["rollout/turns_mean"],
                "tool_call_rate": m["rollout/tool_call_rate"],
                "tool_errors_per_episode": m["rollout/tool_errors_per_episode"], "pass@n": m["rollout/pass@n"]}


class _Activity:
    """Splits wall time into generation / tools / bookkeeping: time with a generation in flight counts as
    generation; otherwise, time with a tool step running counts as tools; the rest is the driver's own work."""

    def __init__(self):
        self.active = Counter()
        self.spent = Counter()
        self.last = time.perf_counter()

    def _tick(self):
        now = time.perf_counter()
        kind = "generation" if self.active["generation"] else "tools" if self.active["tools"] else "bookkeeping"
        self.spent[kind] += now - self.last
        self.last = now

    def begin(self, kind: str):
        self._tick()
        self.active[kind] += 1

    def end(self, kind: str):
        self._tick()
        self.active[kind] -= 1

    @contextlib.contextmanager
    def during(self, kind: str, record: EpisodeRecord):
        """Count the block's time as `kind` for the rollout, and for the episode (`generation_s` / `tool_s`)."""
        self.begin(kind)
        start = time.perf_counter()
        try:
            yield
        finally:
            attr = "generation_s" if kind == "generation" else "tool_s"
            setattr(record, attr, getattr(record, attr) + time.perf_counter() - start)
            self.end(kind)


class EpisodeDriver(abc.ABC):
    """What every rollout driver offers around its own `play`: `run` and `arun` (the episode ids of a rollout, a
    progress bar when asked, the wall time; then the result, its samples tagged with their group and episode — the
    driver alone knows which samples belong together — and its metrics). Subclasses set `sampling` and `progress`."""

    sampling: SamplingParams
    progress: bool

    def run(self, tasks: Sequence[dict], n: int = 1, step: int = 0, **sampling_overrides) -> RolloutResult:
        """Synchronous `arun` (in a fresh event loop)."""
        return asyncio.run(self.arun(tasks, n, step, **sampling_overrides))

    async def arun(self, tasks: Sequence[dict], n: int = 1, step: int = 0, **sampling_overrides) -> RolloutResult:
        """Play every task `n` times (groups of `n` for GRPO), all concurrently; returns records and metrics."""
        sampling = self.sampling.replace(**sampling_overrides) if sampling_overrides else self.sampling
        ids = episode_ids(len(tasks), n)
        bar = RolloutProgress(len(ids)) if self.progress else None
        start = time.perf_counter()
        try:
            records, spent = await self.play(tasks, ids, step, sampling, bar)
        finally:
            if bar is not None:
                bar.close()
        for k, record in enumerate(records):
            for sample in record.samples:
                sample.group, sample.episode = record.id.group, k
        return RolloutResult(records, _metrics(records, time.perf_counter() - start, spent))

    @abc.abstractmethod
    async def play(self, tasks: Sequence[dict] | Mapping[int, dict], ids: Sequence[EpisodeId], step: int,
                   sampling: SamplingParams, on_finished: Callable[[EpisodeRecord], None] | None = None
                   ) -> tuple[list[EpisodeRecord], Counter]:
        """Play the episodes `ids` (episode ``(g, i)`` plays ``tasks[g]``); returns their records, in the order of
        `ids`, and the wall-time split. `on_finished` is told of each episode as it ends."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the driver keeps between rollouts (envs, env processes); a later rollout makes them again."""


class RolloutDriver(EpisodeDriver):
    """Runs episodes of one env type against one backend.

    Args:
        env: a callable returning a fresh env, or a registered Gymnasium id (with `env_kwargs`). The env must have
            a tokenizer (token-in/token-out) — the driver sends the conversation's `context_ids` to the backend.
        backend: the generation backend.
        sampling: sampling parameters; ``max_new_tokens`` is per turn and further capped by each episode's budget.
            The env's end-of-turn token is added to the stop tokens.
        max_concurrency: episodes in flight at once (= envs in the pool).
        generation_timeout_s: a generation taking longer fails its episode.
        seed: base seed for env resets and per-episode sampling seeds.
        progress: show a progress bar.
        precheck_drift: while each turn is generated, run the episode's drift check on the context it is generated
            from (`Conversation.precheck_drift`), instead of all at the episode's end. For env processes
            (`agents.rollout_processes`, which set it): they are idle while the engine generates, and the episodes
            whose last turns end at one step — at the rollout's end, all of them — are otherwise each checked there,
            one after another, while the rollout waits for their records. Beside an engine in the same process the
            extra checks (one per turn) would compete with it for the interpreter lock: off by default.
    """

    def __init__(self, env: Callable[[], gym.Env] | str, backend: Backend, sampling: SamplingParams | None = None, *,
                 env_kwargs: dict | None = None, max_concurrency: int = 256, generation_timeout_s: float | None = 600,
                 seed: int = 0, progress: bool = False, precheck_drift: bool = False):
        self.make_env = (lambda: gym.make(env, **(env_kwargs or {}))) if isinstance(env, str) else env
        self.backend = backend
        self.sampling = sampling or SamplingParams()
        self.max_concurrency = max_concurrency
        self.generation_timeout_s = generation_timeout_s
        self.seed = seed
        self.progress = progress
        self.precheck_drift = precheck_drift
        self._pool: list[gym.Env] = []
        self._created = 0

    # ----------------------------------------------------------------------------------------- public
    async def play(self, tasks: Sequence[dict] | Mapping[int, dict], ids: Sequence[EpisodeId], step: int,
                   sampling: SamplingParams, on_finished: Callable[[EpisodeRecord], None] | None = None
                   ) -> tuple[list[EpisodeRecord], Counter]:
        """`EpisodeDriver.play`, the episodes concurrently in this process (the wall-time split: `_Activity`)."""
        records = [EpisodeRecord(id=e) for e in ids]
        for r in records:
            r.enter(EpisodeState.PENDING)
        free: asyncio.Queue = asyncio.Queue()
        for env in self._pool:
            free.put_nowait(env)
        clock = _Activity()
        start = time.perf_counter()

        async def one(record: EpisodeRecord) -> None:
            env = await self._acquire(free)
            try:
                await self._play(env, tasks[record.id.group], record, sampling, step, clock)
            finally:
                record.finished_at = time.perf_counter() - start
                free.put_nowait(env)
                if on_finished is not None:
                    on_finished(record)

        try:  # the collector paused: the episodes' objects live until the end, and a full collection mid-rollout
            with collector_paused():  # would hold the interpreter lock from an engine's worker (mt_env.collector)
                async with asyncio.TaskGroup() as group:
                    for record in records:
                        group.create_task(one(record))
        except BaseExceptionGroup as eg:  # a dead backend, or an env that cannot be created: raise it as it is
            raise first_error(eg) from None
        finally:
            self._pool = [free.get_nowait() for _ in range(free.qsize())]
        clock._tick()
        return records, clock.spent

    def close(self) -> None:
        for env in self._pool:
            env.close()
        self._pool = []
        self._created = 0

    # ----------------------------------------------------------------------------------------- one episode
    async def _acquire(self, free: asyncio.Queue) -> gym.Env:
        if free.empty() and self._created < self.max_concurrency:
            env = self.make_env()
            base = env.unwrapped
            if not isinstance(base, ToolEnv) or base.tokenizer is None:
                env.close()
                raise TypeError("the rollout driver needs ToolEnv environments created with a tokenizer")
            self._created += 1  # counted once it exists: a failed creation must not shrink the pool for good
            return env
        return await free.get()

    async def _play(self, env: gym.Env, task: dict, record: EpisodeRecord, sampling: SamplingParams, step: int,
                    clock: _Activity) -> None:
        """One episode through the env's public API. Its conversation is the one record of its tokens, messages and
        rewards: the driver reads the next prompt from it and its samples at the end, and writes nothing into it."""
        base: ToolEnv = env.unwrapped
        seed = _seed(self.seed, step, record.id)
        conv = None  # this episode's conversation; until reset succeeds, base.conversation is the previous episode's
        try:
            try:
                obs, _ = await base.areset(seed=seed % 2**31, options={"task": task})
            except BudgetError as e:
                record.error = f"skipped: {e}"
                record.enter(EpisodeState.FAILED)
                return
            conv = base.conversation
            record.enter(EpisodeState.RUNNING)
            record.prompt_tokens = len(obs["input_ids"])
            info, terminated = await self._turns(base, record, sampling, seed, clock)
            record.success, record.end_reason = base.success(info), info.get("end_reason")
            record.enter(EpisodeState.COMPLETED if terminated else EpisodeState.TRUNCATED)
            record.samples = conv.samples()
        except BackendError:
            raise
        except Exception as e:  # isolate: this episode fails, the others go on
            record.error = str(e) if isinstance(e, _GenerationTimeout) else f"{type(e).__name__}: {e}"
            record.enter(EpisodeState.FAILED)
            if conv is not None:  # keep its tokens (the prompt at least: the GRPO group stays whole), train on none
                record.samples = conv.samples(trainable=False)
            await base.aabandon()
        finally:
            if conv is not None:
                record.stats, record.messages = base.episode_stats(), conv.messages

    async def _turns(self, base: ToolEnv, record: EpisodeRecord, sampling: SamplingParams, seed: int,
                     clock: _Activity) -> tuple[StepInfo, bool]:
        """Generate from the conversation's context and step the env until the episode ends; returns the last
        step's info and whether the episode terminated (else it was truncated)."""
        conv = base.conversation
        stop = tuple(dict.fromkeys((*sampling.stop_token_ids, conv.fmt.end_of_turn_id)))
        for turn in itertools.count():
            params = sampling.replace(max_new_tokens=max(1, min(sampling.max_new_tokens, conv.max_new_tokens)),
                                      stop_token_ids=stop, seed=(seed + turn) % 2**63)
            if self.precheck_drift:  # after this loop pass, which sends the requests of the turns that ended in it
                asyncio.get_running_loop().call_soon(conv.precheck_drift)
            with clock.during("generation", record):
                try:
                    async with asyncio.timeout(self.generation_timeout_s) as limit:
                        generated = await self.backend.generate(conv.context_ids, params)
                except TimeoutError:
                    if not limit.expired():  # the backend's own (a server client's, say): the episode fails with it
                        raise
                    raise _GenerationTimeout(f"generation timed out after {self.generation_timeout_s}s") from None
            record.finish_reasons.append(generated.finish_reason)
            record.generated_tokens += len(generated)
            record.enter(EpisodeState.TOOL_CALLING)
            with clock.during("tools", record):
                _, _, terminated, truncated, info = await base.astep(generated)
            record.tool_results += info.get("tool_results", ())
            if terminated or truncated:
                return info, terminated
            record.enter(EpisodeState.RUNNING)


class _GenerationTimeout(Exception):
    """A generation ran past `generation_timeout_s` (told apart from TimeoutErrors raised inside the env)."""


def _seed(base: int, step: int, episode: EpisodeId) -> int:
    digest = hashlib.blake2b(f"{base}/{step}/{episode.group}/{episode.index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def episode_ids(groups: int, n: int) -> list[EpisodeId]:
    """The episodes of a rollout of `groups` tasks played `n` times each, in the order of its records."""
    if n < 1:
        raise ValueError("n must be >= 1")
    return [EpisodeId(g, i) for g in range(groups) for i in range(n)]


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The error a rollout raises for the errors of its concurrent parts: a dead backend's (`BackendError`) first, as
    it is, else the first."""
    return (group.subgroup(BackendError) or group).exceptions[0]


class RolloutProgress:
    """A progress bar over episodes, with the share of the finished ones that succeeded (a callable for
    `RolloutDriver.play`'s `on_finished`)."""

    def __init__(self, total: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="rollout", unit="ep", leave=False, dynamic_ncols=True, mininterval=1.0,
                        disable=None)  # None: no bar when the output is not a terminal (logs, CI)
        self.finished = self.successes = 0  # counted here: a disabled bar (no terminal) counts nothing

    def __call__(self, record: EpisodeRecord) -> None:
        self.finished += 1
        self.successes += record.success
        self.bar.update(1)
        self.bar.set_postfix(success=f"{self.successes / self.finished:.2f}")

    def close(self) -> None:
        self.bar.close()


def _mean(xs) -> float:
    xs = list(xs)
    return float(statistics.fmean(xs)) if xs else 0.0


def _metrics(records: list[EpisodeRecord], wall: float, spent: Counter) -> dict[str, float]:
    """The one summary of a rollout (training logs it; evaluation reads it through `RolloutResult.summary`): counts
    over all episodes; per-episode means over those played to their end (not failed or skipped); pass@n over tasks."""
    played = [r for r in records if r.state != EpisodeState.PENDING and not (r.error or "").startswith("skipped")]
    ok = [r for r in played if r.state != EpisodeState.FAILED]
    solved: dict[int, bool] = {}
    for r in records:
        solved[r.id.group] = solved.get(r.id.group, False) or r.success
    rewards = [r.total_reward for r in ok]
    states = Counter(r.state.value for r in records)
    finish = Counter(f for r in records for f in r.finish_reasons)
    generated = sum(r.generated_tokens for r in records)
    responses = [len(s) - s.prompt_len for r in ok for s in r.samples]
    m = {
        "rollout/episodes": len(records),
        "rollout/completed": states.get("completed", 0),
        "rollout/truncated": states.get("truncated", 0),
        "rollout/failed": sum(1 for r in records
                              if r.state == EpisodeState.FAILED and not (r.error or "").startswith("skipped")),
        "rollout/skipped": sum(1 for r in records if (r.error or "").startswith("skipped")),
        "rollout/success_rate": _mean(r.success for r in ok),
        "rollout/pass@n": _mean(solved.values()),
        "rollout/reward_mean": _mean(rewards),
        "rollout/reward_std": float(statistics.pstdev(rewards)) if len(rewards) > 1 else 0.0,
        "rollout/turns_mean": _mean(r.turns for r in ok),
        "rollout/tool_calls_mean": _mean(r.tool_calls for r in ok),
        "rollout/tool_call_rate": _mean(r.tool_calls > 0 for r in ok),
        "rollout/tool_errors": sum(r.tool_errors for r in records),
        "rollout/tool_errors_per_episode": _mean(r.tool_errors for r in ok),
        "rollout/parse_errors": sum(r.parse_errors for r in records),
        "rollout/response_len_mean": _mean(responses),
        "rollout/response_len_max": max(responses, default=0),
        "rollout/prompt_len_mean": _mean(r.prompt_tokens for r in played),
        "rollout/generated_tokens": generated,
        "rollout/wall_s": wall,
        "rollout/gen_tokens_per_s": generated / wall if wall > 0 else 0.0,
        "time/generation_s": spent["generation"],
        "time/tools_s": spent["tools"],
        "time/bookkeeping_s": spent["bookkeeping"],
    }
    for reason, count in finish.items():
        m[f"rollout/finish_{reason}"] = count
    for reason, count in Counter(r.end_reason for r in ok if r.end_reason).items():
        m[f"rollout/end/{reason}"] = count
    return {k: (float(v) if not isinstance(v, float) or math.isfinite(v) else 0.0) for k, v in m.items()}
