"""The rollout driver: HF rollouts of Calculator-v0 and GSM8kTool-v0 on a tiny random model, concurrency, the episode
state machine, failure isolation, engine death and bad backend output. Scripted backends give exact, model-free
turns; the whole file runs in seconds on CPU."""

from __future__ import annotations

import asyncio
import re
from collections import Counter

import pytest
import torch

import mt_env  # noqa: F401  (registers the envs)
from agents.backend import Backend, BackendError, SamplingParams
from agents.hf_backend import HFBackend
from agents.rollout import EpisodeState, RolloutDriver
from agents.scripted import ScriptedBackend
from envs.calculator import CalculatorEnv
from envs.gsm8k.data import load_rows
from mt_env.batch import collate
from mt_env.chat_format import ChatFormat
from mt_env.parsers import HermesParser, ToolCall
from mt_env.sample import Seg
from mt_env.turn import ModelTurn
from trainers.modeling import build_causal_lm

from .conftest import SHARED_GSM8K

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def gsm8k_dir() -> str:
    if not (SHARED_GSM8K / "train.jsonl").is_file():
        pytest.skip(f"GSM8K data not found at {SHARED_GSM8K} (../shared is absent)")
    return str(SHARED_GSM8K)


def run(coro, timeout: float = 20):
    """Run `coro` with a timeout, so that a hanging rollout fails the test instead of blocking the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread: on a small shared CPU, a second thread that waits for a busy core makes every forward
    pass of the tiny model tens of times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fmt(qwen25):
    env = CalculatorEnv(tokenizer=qwen25)
    env.reset(seed=0)
    return env.conversation.fmt


@pytest.fixture(scope="module")
def model(qwen25):
    return build_causal_lm(config=dict(TINY, max_position_embeddings=2048), vocab_size=len(qwen25)).eval()


class Recording(Backend):
    """Delegates to `inner` and keeps every (prompt ids, sampled ids) pair: what the driver really sent and got."""

    def __init__(self, inner: Backend):
        self.inner = inner
        self.log: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    async def generate(self, prompt_ids, params=None):
        gen = await self.inner.generate(prompt_ids, params)
        self.log.append((tuple(prompt_ids), tuple(gen.ids)))
        return gen

    async def close(self):
        await self.inner.close()


def turn(fmt, text: str) -> list[int]:
    """A complete assistant turn: the text's ids closed by the end-of-turn token."""
    return fmt.encode(text) + [fmt.end_of_turn_id]


def calculator_call(expression: str) -> str:
    return HermesParser.format_turn([ToolCall("calculator", {"expression": expression})])


def operands_of(fmt, prompt: list[int]) -> list[int]:
    return [int(x) for x in re.search(r"What is ([\d *]+)\?", fmt.decode(prompt)).group(1).split(" * ")]


def expert(fmt):
    """A scripted expert for Calculator tasks: multiplies the operands one pair at a time with the calculator (one
    call per turn, reading the previous result from its context), then answers. A task with k operands takes k turns,
    so it only succeeds if the driver hands back every tool response."""

    def script(prompt: list[int]) -> list[int]:
        operands = operands_of(fmt, prompt)
        results = re.findall(r"<tool_response>\n(-?\d+)\n</tool_response>", fmt.decode(prompt))
        if len(results) == len(operands) - 1:
            return turn(fmt, f"The answer is {results[-1]}.")
        left = results[-1] if results else operands[0]
        return turn(fmt, calculator_call(f"{left} * {operands[len(results) + 1]}"))

    return script


def sampled_turns(record) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(context, sampled ids) for each turn of an incremental-mode episode: `env.conversation.context_ids` before a
    turn is the episode's sample up to that turn's sampled tokens (the conversation only ever appends)."""
    (sample,) = record.samples
    return [(tuple(sample.ids[:s.start]), tuple(sample.ids[s.start:s.end]))
            for s in sample.segments if s.kind == Seg.SAMPLED]


def assert_metrics_add_up(result, n_tasks: int, n: int):
    m = result.metrics
    assert m["rollout/episodes"] == len(result.episodes) == n_tasks * n
    assert m["rollout/completed"] + m["rollout/truncated"] + m["rollout/failed"] + m["rollout/skipped"] == n_tasks * n
    assert 0.0 <= m["rollout/success_rate"] <= 1.0
    assert m["rollout/generated_tokens"] == sum(r.generated_tokens for r in result.episodes)
    turns = sum(r.turns for r in result.episodes)
    assert sum(v for k, v in m.items() if k.startswith("rollout/finish_")) == turns
    ended = [r for r in result.episodes if r.state in (EpisodeState.COMPLETED, EpisodeState.TRUNCATED)]
    assert sum(v for k, v in m.items() if k.startswith("rollout/end/")) == len(ended)
    split = m["time/generation_s"] + m["time/tools_s"] + m["time/bookkeeping_s"]
    assert split == pytest.approx(m["rollout/wall_s"], rel=0.05, abs=0.01)


# --------------------------------------------------------------------------------------------- HF backend
@pytest.mark.parametrize("env_id", ["Calculator-v0", "GSM8kTool-v0"])
def test_hf_rollout_ends_every_episode_and_builds_a_grpo_batch(env_id, qwen25, model):
    if env_id == "Calculator-v0":  # a random model never calls the tool: one turn, cut by its token limit
        env_kwargs, tasks, turns = {}, [CalculatorEnv.task_for(ops) for ops in ([12, 34], [5, 6, 7], [99, 1])], 1
    else:  # every answer is wrong, so the env asks to try again: three turns with two user observations
        env_kwargs = dict(data_path=gsm8k_dir(), interaction=True, max_interactions=2, max_turns=3,
                          length_cut="interact")
        tasks, turns = load_rows(gsm8k_dir())[:2], 3
    n = 3
    backend = Recording(HFBackend(model, seed=0))
    driver = RolloutDriver(env_id, backend, SamplingParams(max_new_tokens=8),
                           env_kwargs=dict(env_kwargs, tokenizer=qwen25))
    result = run(driver.arun(tasks, n=n))
    run(backend.close())

    assert all(r.state in (EpisodeState.COMPLETED, EpisodeState.TRUNCATED) and r.error is None for r in result.episodes)
    assert all(r.history[0] == "pending" and r.history[-1] == r.state.value for r in result.episodes)
    assert [r.turns for r in result.episodes] == [turns] * len(tasks) * n
    assert_metrics_add_up(result, len(tasks), n)

    # The driver rebuilds each next context from observations; it must be exactly the env's conversation.
    assert Counter(backend.log) == Counter(t for r in result.episodes for t in sampled_turns(r))

    batch = collate(result.samples, qwen25.pad_token_id)
    assert len(batch) == len(result.samples) == len(tasks) * n
    for b, sample in enumerate(result.samples):  # the loss mask is 1 exactly on the sampled tokens
        sampled = torch.tensor([k == Seg.SAMPLED for k in sample.kinds()])
        assert torch.equal(batch.loss_mask[b, :len(sample.ids)] == 1, sampled)
    assert batch.loss_mask.sum() == result.metrics["rollout/generated_tokens"] == len(tasks) * n * turns * 8

    # the driver tags each sample with its task (GRPO group) and episode
    assert Counter(batch.group.tolist()) == {g: n for g in range(len(tasks))}
    assert sorted(batch.episode.tolist()) == list(range(len(tasks) * n))
    for g in range(len(tasks)):  # per-episode seeds: the members of a group sample different answers
        responses = {tuple(s.ids[s.prompt_len:]) for s in result.samples if s.group == g}
        assert len(responses) == n


def test_per_turn_episodes_generate_from_each_turns_own_context(qwen3):
    """Qwen3 re-renders history, so each turn is its own sample: the driver sends exactly each sample's prompt (the
    conversation's `context_ids`), and tags the samples of one episode with one group and episode."""
    env = CalculatorEnv(tokenizer=qwen3, mode="per_turn")
    env.reset(seed=0)
    backend = Recording(ScriptedBackend(expert(env.conversation.fmt)))
    driver = RolloutDriver(lambda: CalculatorEnv(tokenizer=qwen3, mode="per_turn"), backend)
    result = driver.run([CalculatorEnv.task_for([12, 34, 5]), CalculatorEnv.task_for([6, 7])], n=2)
    assert all(r.state == EpisodeState.COMPLETED and r.success for r in result.episodes)
    assert [len(r.samples) for r in result.episodes] == [r.turns for r in result.episodes] == [3, 3, 2, 2]
    sent = Counter((tuple(s.ids[:s.prompt_len]), tuple(s.ids[s.prompt_len:])) for s in result.samples)
    assert sent == Counter(backend.log)
    for k, record in enumerate(result.episodes):
        assert {(s.group, s.episode) for s in record.samples} == {(record.id.group, k)}


class AsksAgain(CalculatorEnv):
    def interaction(self, task, final_text):
        return "Are you sure?"


def test_a_drifting_episode_fails_with_its_tokens_kept_untrained(qwen3):
    """Forcing incremental mode on Qwen3 drifts once a user turn follows reasoning: the episode fails at its drift
    check and keeps its tokens with loss mask 0 — read from the conversation, nothing written into it."""
    made = []

    def make_env():
        made.append(AsksAgain(tokenizer=qwen3, mode="incremental", max_interactions=1))
        return made[-1]

    fmt = ChatFormat(qwen3)
    driver = RolloutDriver(make_env, ScriptedBackend(lambda prompt: turn(fmt, "<think>\nhmm\n</think>\n\nIt is 1.")))
    (record,) = driver.run([CalculatorEnv.task_for([12, 34])]).episodes
    assert record.state == EpisodeState.FAILED and record.error.startswith("DriftError") and record.turns == 2
    (sample,) = record.samples
    assert sum(sample.loss_mask()) == 0 and sample.ids == made[0].conversation.context_ids
    assert made[0].conversation.strict  # the env's conversation is as the env made it


# --------------------------------------------------------------------------------------------- concurrency
class LoopStepLatency(Backend):
    """Delegates to `inner` after yielding to the event loop `steps(prompt)` times: latency on a virtual clock, so
    that the order of events is the same on any machine under any load. Counts the generations in flight."""

    def __init__(self, inner: Backend, steps):
        self.inner, self.steps = inner, steps
        self.in_flight = self.peak_in_flight = 0

    async def generate(self, prompt_ids, params=None):
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            for _ in range(self.steps(prompt_ids)):
                await asyncio.sleep(0)
            return await self.inner.generate(prompt_ids, params)
        finally:
            self.in_flight -= 1

    async def close(self):
        await self.inner.close()


def test_episodes_run_concurrently_and_finish_out_of_order(qwen25, fmt):
    """Five episodes of 2..5 turns at 10 loop steps per generation, one of them 200 steps slower on its first turn:
    all five generate at once, each finishes when its own turns are done, and the slow one holds nobody up."""
    operands = [[2, 3, 4, 5, 6], [7, 8], [13, 14, 15], [3, 5, 7, 9], [11, 12]]  # submitted longest-first
    slow = [11, 12]

    def latency(prompt):
        fresh = "<tool_response>" not in fmt.decode(prompt)
        return 210 if fresh and operands_of(fmt, prompt) == slow else 10

    timed = LoopStepLatency(ScriptedBackend(expert(fmt)), latency)
    backend = Recording(timed)
    driver = RolloutDriver(lambda: CalculatorEnv(tokenizer=qwen25, max_turns=6), backend)
    result = run(driver.arun([CalculatorEnv.task_for(ops) for ops in operands]))

    assert [r.state for r in result.episodes] == [EpisodeState.COMPLETED] * 5
    assert [r.turns for r in result.episodes] == [len(ops) for ops in operands]
    assert result.metrics["rollout/success_rate"] == 1.0
    assert Counter(backend.log) == Counter(t for r in result.episodes for t in sampled_turns(r))

    finished = [r.finished_at for r in result.episodes]
    order = sorted(range(5), key=finished.__getitem__)
    assert order == [1, 2, 3, 0, 4]  # by length, the slow one last (it holds nobody up): not in submission order
    assert timed.peak_in_flight == 5  # no lockstep: the rollout takes as long as its slowest episode, not the sum


# --------------------------------------------------------------------------------------------- state machine
def test_tool_calling_episode_history(qwen25, fmt):
    driver = RolloutDriver(lambda: CalculatorEnv(tokenizer=qwen25), ScriptedBackend(expert(fmt)))
    (record,) = driver.run([CalculatorEnv.task_for([12, 34, 5])]).episodes
    assert record.history == ["pending", "running", "tool_calling", "running", "tool_calling", "running",
                              "tool_calling", "completed"]
    assert (record.tool_calls, record.success, record.final_reward, record.end_reason) == (2, True, 1.0, "answered")


def prose(fmt):
    return lambda prompt: fmt.encode("Let me think about this for a while. " * 20)  # never stops, never calls


@pytest.mark.parametrize("env_kwargs, script, reason", [
    (dict(max_turns=2), expert, "turn limit reached with a pending tool call"),
    (dict(budget={"max_response_tokens": 30}), expert, "token budget: no room for the observation"),
    (dict(), prose, "turn cut by its token limit"),
])
def test_truncated_episodes_end_truncated(qwen25, fmt, env_kwargs, script, reason):
    driver = RolloutDriver(lambda: CalculatorEnv(tokenizer=qwen25, **env_kwargs), ScriptedBackend(script(fmt)),
                           SamplingParams(max_new_tokens=32))
    result = driver.run([CalculatorEnv.task_for([12, 34, 5, 6])], n=2)
    for record in result.episodes:
        assert record.state == EpisodeState.TRUNCATED and record.history[-1] == "truncated"
        assert record.end_reason == reason and record.error is None
    assert result.metrics["rollout/truncated"] == 2 and result.metrics[f"rollout/end/{reason}"] == 2
    if "budget" in reason:
        assert all(len(s.ids) - s.prompt_len <= 30 for s in result.samples)


# --------------------------------------------------------------------------------------------- failure isolation
BROKEN = [13, 13]  # the one task that breaks


class BrokenScoring(CalculatorEnv):
    def answer_reward(self, task, final_text):
        if task["operands"] == BROKEN:  # a TimeoutError, to check that it is not taken for a generation timeout
            raise TimeoutError("the scorer timed out on 13 * 13")
        return super().answer_reward(task, final_text)


def broken_scorer(tok, fmt):
    return lambda: BrokenScoring(tokenizer=tok), ScriptedBackend(expert(fmt)), {}


def out_of_vocab(tok, fmt):
    script = expert(fmt)
    return (lambda: CalculatorEnv(tokenizer=tok),
            ScriptedBackend(lambda p: [len(tok) + 7] if operands_of(fmt, p) == BROKEN else script(p)), {})


def timeout(tok, fmt):
    backend = ScriptedBackend(expert(fmt), latency_s=lambda p: 30.0 if operands_of(fmt, p) == BROKEN else 0.0)
    return lambda: CalculatorEnv(tokenizer=tok), backend, dict(generation_timeout_s=0.3)


def expert_failing_on_broken(fmt, error: Exception):
    """The expert's script, raising `error` on the BROKEN task."""
    script = expert(fmt)

    def answer(prompt):
        if operands_of(fmt, prompt) == BROKEN:
            raise error
        return script(prompt)

    return answer


def backend_timeout(tok, fmt):
    """The backend raises a TimeoutError of its own (a server client's request limit), well within the driver's."""
    answer = expert_failing_on_broken(fmt, TimeoutError("the server's own request timed out"))
    return lambda: CalculatorEnv(tokenizer=tok), ScriptedBackend(answer), dict(generation_timeout_s=30)


@pytest.mark.parametrize("breaker, message", [
    (broken_scorer, r"^TimeoutError: the scorer timed out on 13 \* 13$"),
    (backend_timeout, r"^TimeoutError: the server's own request timed out$"),
    (out_of_vocab, r"outside the vocabulary"),
    (timeout, r"^generation timed out after 0.3s$"),
])
def test_a_failing_episode_fails_alone_and_stays_in_the_batch(qwen25, fmt, breaker, message):
    make_env, backend, kwargs = breaker(qwen25, fmt)
    driver = RolloutDriver(make_env, backend, **kwargs)
    result = run(driver.arun([CalculatorEnv.task_for(ops) for ops in ([12, 34], BROKEN, [56, 78])], n=2))

    failed = [r for r in result.episodes if r.id.group == 1]
    ok = [r for r in result.episodes if r.id.group != 1]
    assert all(r.state == EpisodeState.FAILED and re.search(message, r.error) for r in failed)
    assert all(r.state == EpisodeState.COMPLETED and r.success for r in ok)
    assert result.metrics["rollout/failed"] == 2 and result.metrics["rollout/skipped"] == 0
    assert result.metrics["rollout/success_rate"] == 1.0  # over the episodes that ran to their end

    batch = collate(result.samples, qwen25.pad_token_id)
    failed = batch.group == 1
    assert batch.episode[failed].unique().numel() == 2  # both failed episodes stay in the batch
    assert batch.loss_mask[failed].sum() == 0 and batch.loss_mask[~failed].sum() > 0


def test_over_long_prompts_are_skipped_and_counted(qwen25, fmt):
    short = CalculatorEnv.task_for([12, 34])
    long = dict(short, prompt=[short["prompt"][0], {"role": "user", "content": "What is 12 * 34? " * 40}])
    driver = RolloutDriver(lambda: CalculatorEnv(tokenizer=qwen25, budget={"max_prompt_tokens": 300}),
                           ScriptedBackend(expert(fmt)), max_concurrency=1)  # one env, reused: nothing may leak
    result = driver.run([short, long, short])
    assert [r.state for r in result.episodes] == [EpisodeState.COMPLETED, EpisodeState.FAILED, EpisodeState.COMPLETED]
    skipped = result.episodes[1]
    assert re.match(r"skipped: the prompt is \d+ tokens, over max_prompt_tokens=300", skipped.error)
    assert skipped.samples == [] and skipped.messages == [] and skipped.turns == 0
    assert result.metrics["rollout/skipped"] == 1 and result.metrics["rollout/failed"] == 0
    assert len(collate(result.samples, qwen25.pad_token_id)) == 2

    driver = RolloutDriver(lambda: CalculatorEnv(tokenizer=qwen25, budget={"max_prompt_tokens": 10}),
                           ScriptedBackend(expert(fmt)))
    result = driver.run([short], n=3)
    assert result.metrics["rollout/skipped"] == 3 and result.metrics["rollout/episodes"] == 3
    assert result.samples == []
    with pytest.raises(ValueError, match="zero samples"):
        collate(result.samples, qwen25.pad_token_id)


# --------------------------------------------------------------------------------------------- env pool
def test_envs_are_reused_across_rollouts_and_rebuilt_after_close(qwen25, fmt):
    made = []

    def make_env():
        made.append(CalculatorEnv(tokenizer=qwen25))
        return made[-1]

    driver = RolloutDriver(make_env, ScriptedBackend(expert(fmt), latency_s=0.01), max_concurrency=2)
    tasks = [CalculatorEnv.task_for([12, 34]), CalculatorEnv.task_for([5, 6, 7])]
    for _ in range(2):
        assert run(driver.arun(tasks, n=3)).metrics["rollout/completed"] == 6
    assert len(made) == 2  # at most max_concurrency envs, kept between rollouts
    driver.close()
    assert all(env.tool_counts["created"] == env.tool_counts["released"] for env in made)
    assert run(driver.arun(tasks, n=3), timeout=5).metrics["rollout/completed"] == 6  # a fresh pool, no hang
    assert len(made) == 4


def test_envs_without_a_tokenizer_are_refused(fmt):
    driver = RolloutDriver(lambda: CalculatorEnv(), ScriptedBackend(expert(fmt)))
    with pytest.raises(TypeError, match="ToolEnv environments created with a tokenizer"):
        run(driver.arun([CalculatorEnv.task_for([12, 34])], n=2))


# --------------------------------------------------------------------------------------------- engine death
def test_a_dying_backend_fails_the_whole_rollout_at_once(qwen25, fmt):
    dies_on_the_second_task = expert_failing_on_broken(fmt, BackendError("the engine died"))

    latency = lambda p: 0.05 if operands_of(fmt, p) == BROKEN else 30.0  # noqa: E731  the others are in flight
    backend = Recording(ScriptedBackend(dies_on_the_second_task, latency))
    driver = RolloutDriver(lambda: CalculatorEnv(tokenizer=qwen25), backend)
    with pytest.raises(BackendError, match="the engine died"):  # not a timeout of `run`: the rollout did not wait
        run(driver.arun([CalculatorEnv.task_for(ops) for ops in ([12, 34], BROKEN, [56, 78])], n=2))
    assert backend.log == []  # the generations in flight were cancelled, none finished


def test_closing_the_hf_backend_mid_rollout_fails_the_rollout(qwen25, model):
    backend = Recording(HFBackend(model, seed=0))
    driver = RolloutDriver("Calculator-v0", backend, SamplingParams(max_new_tokens=64), max_concurrency=2,
                           env_kwargs=dict(tokenizer=qwen25))

    async def close_after_the_first_turn():
        rollout = asyncio.create_task(driver.arun([CalculatorEnv.task_for([12, 34])], n=8))
        while not backend.log:
            await asyncio.sleep(0.005)
        await backend.close()
        return await rollout

    with pytest.raises(BackendError, match="closed"):  # not a timeout of `run`: the rollout stopped
        run(close_after_the_first_turn())


# --------------------------------------------------------------------------------------------- bad backend output
@pytest.mark.parametrize("finish, state, reason", [
    ("stop", EpisodeState.COMPLETED, "answered"),
    ("length", EpisodeState.TRUNCATED, "turn cut by its token limit"),
])
def test_an_empty_turn_ends_the_episode_cleanly(qwen25, finish, state, reason):
    backend = ScriptedBackend(lambda prompt: ModelTurn([], [], finish))
    driver = RolloutDriver(lambda: CalculatorEnv(tokenizer=qwen25), backend)
    result = driver.run([CalculatorEnv.task_for([12, 34])], n=2)
    for record in result.episodes:
        assert (record.state, record.end_reason, record.turns, record.generated_tokens) == (state, reason, 1, 0)
        assert record.final_reward == 0.0 and not record.success
    assert [len(s.ids) - s.prompt_len for s in result.samples] == [0, 0]
    assert collate(result.samples, qwen25.pad_token_id).loss_mask.sum() == 0


@pytest.mark.parametrize("length_cut", ["truncate", "interact"])
def test_a_tool_call_cut_by_the_token_limit_gets_an_error_and_another_turn(qwen25, fmt, length_cut):
    """The env's defined result for a turn cut inside ``<tool_call>``: a parse error observation (whatever
    `length_cut` says: that option is for turns without a tool call), the cut turn closed by the template, and the
    model may try again."""
    cut_call = calculator_call("12 * 34")[:40]
    script = expert(fmt)
    backend = Recording(ScriptedBackend(
        lambda p: fmt.encode(cut_call) if "<tool_response>" not in fmt.decode(p) else script(p)))
    driver = RolloutDriver(lambda: CalculatorEnv(tokenizer=qwen25, length_cut=length_cut), backend)
    (record,) = run(driver.arun([CalculatorEnv.task_for([12, 34])])).episodes

    assert record.finish_reasons == ["length", "stop", "stop"] and record.state == EpisodeState.COMPLETED
    assert (record.parse_errors, record.tool_errors, record.tool_calls, record.turns) == (1, 1, 2, 3)
    second_prompt = fmt.decode(backend.log[1][0])
    assert second_prompt.endswith(cut_call + "<|im_end|>\n<|im_start|>user\n<tool_response>\nError: the tool call "
                                  "was cut off before <\u200b/tool_call> (the turn hit its token limit)\n"
                                  "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert record.success  # the expert found no result in the error, called again and answered
