"""`ToolEnv`: the base class of mt_env's tool-using tasks, a real `gymnasium.Env`.

One episode is one conversation. `reset` draws a task (or takes one from ``options={"task": row}``), creates the
episode's tool instances and returns the prompt; `step` takes one model turn — token ids with a finish reason, or
text — parses its tool calls, runs them concurrently, and returns what the model sees next: the tool responses as
text, and, when the env has a tokenizer, as the exact template-delta token ids to append (built by
`mt_env.conversation.Conversation`, so the ids never drift from what the chat template renders).

A task subclasses `ToolEnv` and implements `sample_task` (and usually `answer_reward`; optionally `interaction`).
See `envs/calculator.py` for a small complete example and `envs/gsm8k/` for a dataset-backed one.

Spaces: observations are ``Dict(text, input_ids)`` — the *new* text and token ids since the last one (the model's
next prompt is always ``env.conversation.context_ids``); an action is one model turn — ``Dict(token_ids,
finish_reason)`` with a tokenizer, ``Text`` without (`step` also takes a `ModelTurn`, a ``str`` or a list of ids).
Rewards: each step's tool rewards; the last step adds the final reward (``info["final_reward"]``). ``terminated``:
the model answered without a tool call, or a tool with ``on_error: end_episode`` failed; ``truncated``: the turn
limit, the token budget, an aborted generation or a turn cut by its token limit. The keys of ``info``:
`mt_env.info.StepInfo` (`ResetInfo` for `reset`). Stepping an ended episode raises `gymnasium.error.ResetNeeded`;
tools are released when an episode ends, on `reset` mid-episode and on `close`. Each in full: docs/envs.md.
"""

from __future__ import annotations

import asyncio
import operator
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.error import ResetNeeded

from .chat_format import ChatFormat, encodable, encodable_value, shared_chat_format, unencodable_at
from .checks import is_int
from .conversation import Conversation, TokenBudget
from .errors import MtEnvError
from .info import ResetInfo, StepInfo
from .parsers import ToolCall, shared_parser
from .tool_config import select_tools
from .tools import BaseTool, ToolBox, cap_calls
from .turn import FINISH_REASONS, ModelTurn


class AnyText(spaces.Text):
    """A `Text` space that contains any string up to `max_length` characters (model output is arbitrary
    unicode); `sample` draws short printable strings."""

    def __init__(self, max_length: int = 1_000_000, seed=None):
        super().__init__(max_length=max_length, min_length=0, charset=string.printable, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask=None, probability=None) -> str:
        n = int(self.np_random.integers(0, 33))
        chars = self.np_random.choice(list(string.ascii_letters + string.digits + " .,\n"), size=n)
        return "".join(chars)

    def __repr__(self) -> str:
        return f"AnyText({self.max_length})"


class FinishReason(spaces.Discrete):
    """The engine's finish reason as an index into ``FINISH_REASONS`` (0 stop, 1 length, 2 abort). `sample` draws
    turns that ended normally (``stop``) unless given a mask or probabilities: a random policy's turns are complete
    turns, and length cuts and aborts end an episode at once."""

    def __init__(self, seed=None):
        super().__init__(len(FINISH_REASONS), seed=seed)

    def sample(self, mask=None, probability=None):
        if mask is None and probability is None:
            return np.int64(0)
        return super().sample(mask=mask, probability=probability)


class _End(NamedTuple):
    """How and why an episode ends."""

    terminated: bool  #: False: truncated
    reason: str


class ToolEnv(gym.Env):
    """Base class of tool-using tasks (see the module docstring).

    Args:
        tools: the configured tools (`BaseTool` instances); default `default_tools()`.
        tokenizer: a Hugging Face fast tokenizer with a chat template (or ``"offline:qwen2.5"``); enables token ids
            in observations and token actions. None: text only.
        tool_format: the tool-call parser (``hermes``, ``llama3_json``, ``sglang:<format>``).
        max_turns: assistant turns per episode; the episode is truncated after the last one.
        max_parallel_tools: tool calls of one turn run at once.
        max_calls_per_turn: tool calls of one turn that are run; the rest get one ``too_many_calls`` error
            observation.
        budget: `TokenBudget` (or its fields as a dict) for the conversation (tokenizer mode).
        mode: conversation mode (``auto``, ``incremental``, ``per_turn``).
        strict: run the conversation's drift check when samples are built.
        template_kwargs: extra chat-template variables (e.g. ``{"enable_thinking": False}``).
        max_interactions: user follow-up turns (from `interaction`) allowed per episode.
        length_cut: a turn cut by its token limit with no tool call in it: ``"truncate"`` ends the episode (it never
            finished its answer); ``"interact"`` treats it like an answer, so `interaction` may ask to go on.
        render_mode: ``"ansi"`` or ``"html"``.
    """

    metadata = {"render_modes": ["ansi", "html"], "render_fps": 1}

    def __init__(
        self,
        tools: Sequence[BaseTool] | None = None,
        tokenizer: Any = None,
        tool_format: str = "hermes",
        max_turns: int = 5,
        max_parallel_tools: int = 4,
        max_calls_per_turn: int = 8,
        budget: TokenBudget | Mapping[str, Any] | None = None,
        mode: str = "auto",
        strict: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        max_interactions: int = 0,
        length_cut: str = "truncate",
        render_mode: str | None = None,
    ):
        if length_cut not in ("truncate", "interact"):
            raise ValueError(f"length_cut must be 'truncate' or 'interact', got {length_cut!r}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']}, got {render_mode!r}")
        if max_turns < 1 or max_parallel_tools < 1 or max_calls_per_turn < 1:
            raise ValueError("max_turns, max_parallel_tools and max_calls_per_turn must be >= 1")
        if isinstance(tokenizer, str):
            from .tokenizer import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        self.tools = list(tools) if tools is not None else self.default_tools()
        self.tokenizer = tokenizer
        self.tool_format = tool_format
        self.max_turns = max_turns
        self.max_parallel_tools = max_parallel_tools
        self.max_calls_per_turn = max_calls_per_turn
        self.budget = budget if isinstance(budget, TokenBudget) or budget is None else TokenBudget(**budget)
        self.mode = mode
        self.strict = strict
        self.template_kwargs = dict(template_kwargs or {})
        self.max_interactions = max_interactions
        self.length_cut = length_cut
        self.render_mode = render_mode

        vocab = len(tokenizer) if tokenizer is not None else 1
        self.observation_space = spaces.Dict({"text": AnyText(), "input_ids": spaces.Sequence(spaces.Discrete(vocab))})
        if tokenizer is not None:
            self.action_space = spaces.Dict({"token_ids": spaces.Sequence(spaces.Discrete(vocab)),
                                             "finish_reason": FinishReason()})
        else:
            self.action_space = AnyText()

        self.toolbox_factory: Callable[[list[BaseTool]], ToolBox] = ToolBox  #: swapped by `ReplayTools`
        self._formats: dict[tuple, ChatFormat] = {}
        self._parsers: dict[tuple, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._box: ToolBox | None = None
        self._active = False
        self.task: dict | None = None
        self.conversation: Conversation | None = None
        self.messages: list[dict] = []
        self.tool_counts: dict[str, int] = {"created": 0, "released": 0}
        self._clear_episode()

    # ----------------------------------------------------------------------------------------- task hooks
    def default_tools(self) -> list[BaseTool]:
        """Tools used when none are given."""
        return []

    def sample_task(self, rng: np.random.Generator) -> dict:
        """A task row (prompt messages, tool selection/kwargs, ground truth) drawn with the env's seeded `rng`."""
        raise NotImplementedError

    def prompt_messages(self, task: Mapping[str, Any]) -> list[dict]:
        """The episode's prompt messages; default ``task["prompt"]`` (verl's key) or ``task["messages"]``."""
        messages = task.get("prompt", task.get("messages"))
        if not messages:
            raise MtEnvError("a task needs 'prompt' (or 'messages'): the prompt messages of the episode")
        return [dict(m) for m in messages]

    def answer_reward(self, task: Mapping[str, Any], final_text: str) -> float:
        """Reward of the final answer (the last assistant turn's text), added to the tools' rewards."""
        return 0.0

    def final_reward(self, task: Mapping[str, Any], final_text: str, tool_rewards: Mapping[str, float]) -> float:
        """The episode's final reward: by default the tools' ``calc_reward`` plus `answer_reward`."""
        return float(sum(tool_rewards.values())) + float(self.answer_reward(task, final_text))

    def demonstration(self, task: Mapping[str, Any], rng: np.random.Generator, skill: float = 1.0) -> list[str]:
        """An expert's turns for `task`: assistant texts and tool results, alternating (for SFT warm starts)."""
        raise NotImplementedError(f"{type(self).__name__} has no demonstrations; SFT warm start needs them")

    def success(self, info: StepInfo) -> bool:
        """Whether an ended episode counts as solved (for success rates); default: a positive final reward."""
        return float(info.get("final_reward") or 0.0) > 0

    def interaction(self, task: Mapping[str, Any], final_text: str) -> str | None:
        """A user follow-up after an answer (e.g. "that is wrong, try again"), or None to end the episode."""
        return None

    # ----------------------------------------------------------------------------------------- gymnasium API
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, ResetInfo]:
        return self._run(self.areset(seed=seed, options=options))

    def step(self, action) -> tuple[dict, float, bool, bool, StepInfo]:
        return self._run(self.astep(action))

    def close(self):
        if self._loop is not None and not self._loop.is_closed():
            self._loop.run_until_complete(self._end_episode_tools())
            self._loop.close()
        elif self._box is not None:
            asyncio.run(self._end_episode_tools())
        self._loop = None
        super().close()

    def render(self):
        if self.render_mode is None:
            gym.logger.warn("render() called without a render_mode; create the env with render_mode='ansi'")
            return None
        if self.conversation is not None:
            return self.conversation.render_ansi() if self.render_mode == "ansi" else self.conversation.render_html()
        text = "\n\n".join(f"[{m['role']}] {m.get('content') or ''}" for m in self.messages)
        if self.render_mode == "ansi":
            return text
        import html

        return f"<pre>{html.escape(text)}</pre>"

    # ----------------------------------------------------------------------------------------- async API
    async def areset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, ResetInfo]:
        """Async twin of `reset`, for drivers that run many envs in one event loop.

        Options: ``task`` (a task row to play instead of drawing one)."""
        super().reset(seed=seed)
        await self._end_episode_tools()  # a reset mid-episode releases the previous episode's tools
        options = _checked_options(options)
        task = dict(options["task"]) if "task" in options else self.sample_task(self.np_random)
        chosen = select_tools(self.tools, task)
        self.task = task
        self.tool_schemas = chosen.schemas  #: the tools this episode can call (and its prompt renders)
        self._clear_episode()
        self._box = self.toolbox_factory(chosen.tools)
        await self._box.create_all(chosen.tools_kwargs)
        self.tool_counts["created"] += len(chosen.tools)
        key = tuple(chosen.names)
        self._parser = self._parsers.get(key) or self._parsers.setdefault(
            key, shared_parser(self.tool_format, chosen.schemas))
        messages = self.prompt_messages(task)
        _check_encodable(messages, chosen.sample_id)
        self.messages = list(messages)
        if self.tokenizer is not None:
            fmt = self._formats.get(key) or self._formats.setdefault(key, shared_chat_format(
                self.tokenizer, tools=chosen.schemas or None, template_kwargs=self.template_kwargs))
            self.conversation = Conversation(fmt, messages, budget=self.budget, mode=self.mode, strict=self.strict)
            sample = self.conversation.current
            obs = {"text": "".join(s.text for s in sample.segments), "input_ids": tuple(sample.ids)}
        else:
            self.conversation = None
            obs = {"text": _plain(messages), "input_ids": ()}
        self._active = True
        info: ResetInfo = {"messages": messages, "tools": chosen.schemas, "sample_id": chosen.sample_id}
        return obs, info

    async def astep(self, action) -> tuple[dict, float, bool, bool, StepInfo]:
        """Async twin of `step`: take the turn, parse it, answer it (its tool calls, or a follow-up), observe the
        answer, and score the episode when it ends."""
        if not self._active:
            raise ResetNeeded("the episode has ended (or reset() was not called): call reset() before step()")
        turn, unencodable = _encodable_turn(self._as_turn(action))
        text, finish = self._take_turn(turn)
        parsed, info = self._parse(text, finish)
        messages, reward = [], 0.0
        end = self._end_before_answer(finish, parsed)
        if end is None and (parsed.calls or parsed.errors):
            messages, reward, end = await self._run_tools(parsed, info)
        elif end is None:
            messages, end = self._follow_up(text)
        messages, replaced = _encodable_messages(messages)
        info["unencodable_chars"] += unencodable + replaced  # with the call arguments' (see _parse)
        obs = {"text": "", "input_ids": ()}
        if messages and end is None:
            obs, end = self._observe(messages)
        self._add_reward(reward)
        info.update(messages=messages, step_reward=reward)
        if end is not None:
            reward += await self._finish(text, end, info)
        return obs, reward, end is not None and end.terminated, end is not None and not end.terminated, info

    def episode_stats(self) -> dict[str, Any]:
        """The episode so far (`info["episode"]` on its last step): tool calls and errors, parse errors, turns and
        rewards. Rewards are read from their one record: the conversation in token mode (it places them on tokens),
        the env itself in text mode."""
        if self.conversation is not None:
            step, final = sum(t.reward for t in self.conversation.turns), self.conversation.final_reward
        else:
            step, final = sum(self._text_rewards), self._text_final
        final = float(final or 0.0)
        return dict(self._counts, step_reward=step, final_reward=final, turns=self.turn, total_reward=step + final)

    # ----------------------------------------------------------------------------------------- the steps of a turn
    def _take_turn(self, turn: ModelTurn) -> tuple[str, str]:
        """Record the model's turn; returns its text and finish reason as kept (token mode: cut to the budget)."""
        self.turn += 1
        conv = self.conversation
        if conv is None:
            return (turn.text if turn.text is not None else ""), turn.finish_reason
        ids = turn.ids if turn.ids is not None else self._encode_text_turn(turn)
        kept = conv.add_assistant(ids, logprobs=turn.logprobs, finish_reason=turn.finish_reason)
        return kept.text, kept.finish_reason

    def _parse(self, text: str, finish: str) -> tuple[Any, StepInfo]:
        """The turn's tool calls and parse errors, recorded as the assistant message's parsed view; and the step's
        first info fields."""
        parsed = self._parser.parse(text, finish)
        unencodable = 0
        for i, call in enumerate(parsed.calls):  # ids shared by the assistant message and the tool responses
            call.id = call.id or f"call_{self.turn - 1}_{i}"
            if _may_hold_surrogates(call.raw):
                call.arguments, replaced = encodable_value(call.arguments)  # JSON's "\udce9" is a lone surrogate
                if replaced:
                    unencodable, call.checked_by = unencodable + replaced, None  # the toolbox checks them again
        calls = list(map(ToolCall.to_openai, parsed.calls))
        if self.conversation is not None:
            self.conversation.set_parsed(calls, parsed.content)
        else:
            message = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = calls
            self.messages.append(message)
        self._counts["parse_errors"] += len(parsed.errors)
        errors = [{"kind": e.kind, "message": e.message} for e in parsed.errors] if parsed.errors else []
        info: StepInfo = {"turn": self.turn, "finish_reason": finish, "tool_calls": calls, "parse_errors": errors,
                          "parse_metrics": parsed.metrics, "unencodable_chars": unencodable, "messages": [],
                          "step_reward": 0.0}  # the last two: set when the turn is answered
        return parsed, info

    def _end_before_answer(self, finish: str, parsed) -> _End | None:
        """An end decided by the turn alone, before anything answers it."""
        calls = parsed.calls or parsed.errors
        if finish == "abort":
            return _End(False, "generation aborted")
        if self.conversation is not None and self.conversation.truncated:
            return _End(False, self.conversation.truncation_reason)
        if calls and self.turn >= self.max_turns:
            return _End(False, "turn limit reached with a pending tool call")
        if not calls and finish == "length" and self.length_cut == "truncate":
            return _End(False, "turn cut by its token limit")
        return None

    async def _run_tools(self, parsed, info: StepInfo) -> tuple[list[dict], float, _End | None]:
        """Run the turn's calls (parse errors are answered with their message); returns the tool messages, the
        step reward, and an end if a tool with ``on_error: end_episode`` failed."""
        calls = cap_calls(parsed.calls + parsed.errors, self.max_calls_per_turn)
        results = await self._box.execute_many(calls, self.max_parallel_tools)
        messages, reports, reward, errors, end = [], [], 0.0, 0, None
        for r in results:  # one pass (usually over one result), no comprehension per field
            messages.append(r.to_message())
            reports.append({"name": r.name, "call_id": r.call_id, "reward": r.reward, "error": r.error,
                            "error_kind": r.error_kind, "duration_s": r.duration_s, "metrics": r.metrics})
            reward += r.reward
            errors += bool(r.error_kind)
            if r.end_episode:
                end = _End(True, "a tool failed with on_error=end_episode")
        self._counts["tool_calls"] += len(results)
        self._counts["tool_errors"] += errors
        info["tool_results"], info["tool_errors"] = reports, errors
        return messages, reward, end

    def _follow_up(self, final_text: str) -> tuple[list[dict], _End | None]:
        """After an answer: the user's follow-up (`interaction`) if one is allowed and comes, else the end."""
        follow = self.interaction(self.task, final_text) if self.interactions < self.max_interactions else None
        if follow is None:
            return [], _End(True, "answered")
        if self.turn >= self.max_turns:
            return [], _End(False, "turn limit reached")
        self.interactions += 1
        return [{"role": "user", "content": follow}], None

    def _observe(self, messages: list[dict]) -> tuple[dict, _End | None]:
        """Append the answer for the model to see. In token mode the ids are the template delta — or, when the
        conversation starts a new sample (``per_turn`` mode), that sample's whole context. Ends the episode when
        the budget leaves no room for it."""
        conv = self.conversation
        if conv is None:
            self.messages += messages
            return {"text": _plain(messages), "input_ids": ()}, None
        n_samples, start = len(conv.samples_), len(conv.current.ids)
        if not conv.add_observation(messages):
            return {"text": "", "input_ids": ()}, _End(False, conv.truncation_reason)
        if len(conv.samples_) != n_samples:
            start = 0
        sample = conv.current
        text = "".join(s.text for s in sample.segments if s.start >= start)
        return {"text": text, "input_ids": tuple(sample.ids[start:])}, None

    def _add_reward(self, reward: float) -> None:
        if self.conversation is not None:
            self.conversation.add_reward(reward)
        else:
            self._text_rewards.append(reward)

    async def _finish(self, final_text: str, end: _End, info: StepInfo) -> float:
        """Score the ended episode and release its tools; returns the final reward (also in `info`)."""
        tool_rewards = await self._box.calc_rewards() if self._box is not None else {}
        answer = float(self.answer_reward(self.task, final_text))
        final = float(self.final_reward(self.task, final_text, tool_rewards))
        if self.conversation is not None:
            self.conversation.final_reward = final
        else:
            self._text_final = final
        await self._end_episode_tools()
        episode = self.episode_stats()
        episode["end_reason"] = end.reason
        info.update(final_reward=final, tool_rewards=tool_rewards, answer_reward=answer, end_reason=end.reason,
                    episode=episode)
        return final

    # ----------------------------------------------------------------------------------------- internals
    def _clear_episode(self) -> None:
        self.turn = 0
        self.interactions = 0
        self._counts = {"tool_calls": 0, "tool_errors": 0, "parse_errors": 0}
        self._text_rewards: list[float] = []  # text mode's rewards (token mode keeps them in the conversation)
        self._text_final: float | None = None

    async def aabandon(self) -> None:
        """End the current episode without scoring it (e.g. after an error outside the env): its tools are released
        and `step` needs a `reset` again."""
        await self._end_episode_tools()

    async def _end_episode_tools(self) -> None:
        self._active = False
        box, self._box = self._box, None
        if box is not None:
            await box.release_all()
            self.tool_counts["released"] += box.counts["released"]

    def _as_turn(self, action) -> ModelTurn:
        """`action` as a checked `ModelTurn` (see `_checked_turn`); a text action is one by construction."""
        if type(action) is str:  # the common text action: a str with finish reason "stop" needs no check
            turn = ModelTurn(text=action)
        else:
            if isinstance(action, ModelTurn):
                turn = action
            elif isinstance(action, str):
                turn = ModelTurn(text=action)
            elif isinstance(action, Mapping):
                turn = ModelTurn(ids=action.get("token_ids"), text=action.get("text"),
                                 finish_reason=_finish_reason(action.get("finish_reason", "stop")),
                                 logprobs=action.get("logprobs"))
            elif isinstance(action, (list, tuple, np.ndarray)):
                turn = ModelTurn(ids=action)
            else:
                raise TypeError(f"an action is a ModelTurn, a str, token ids or a dict, got {type(action).__name__}")
            turn = _checked_turn(turn)
        if turn.ids is not None and self.tokenizer is None:
            raise ValueError("token-id actions need an env created with a tokenizer; pass text instead")
        return turn

    def _encode_text_turn(self, turn: ModelTurn) -> list[int]:
        """Ids for a text action in tokenizer mode: the text encoded, closed with the end-of-turn token on 'stop'.
        (Engines should pass their sampled ids instead: re-encoding text may split it differently.)"""
        fmt = self.conversation.fmt
        return fmt.encode(turn.text) + ([fmt.end_of_turn_id] if turn.finish_reason == "stop" else [])

    def _run(self, coro):
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise RuntimeError("reset()/step() were called inside a running event loop: await areset()/astep()")
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)


def _plain(messages: Sequence[Mapping[str, Any]]) -> str:
    return "\n\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages)


def _checked_options(options: Any) -> Mapping[str, Any]:
    """`reset`'s options, checked: a dict whose ``task``, when given, is a task row."""
    if options is None:
        return {}
    if type(options) is dict and type(options.get("task", options)) is dict:  # the usual options, told by type
        return options
    if not isinstance(options, Mapping):
        raise TypeError(f"reset options must be a dict such as {{'task': row}} or None, got {type(options).__name__}")
    if "task" in options and not isinstance(options["task"], Mapping):
        raise TypeError("options['task'] must be a task row (a dict with the prompt messages), got "
                        f"{type(options['task']).__name__}; leave 'task' out to draw a task")
    return options


def _finish_reason(value: Any) -> str:
    """A finish reason given by name, or by its index in ``FINISH_REASONS`` (the action space's form)."""
    if is_int(value):
        value = FINISH_REASONS[int(value)] if 0 <= value < len(FINISH_REASONS) else value
    elif not isinstance(value, str):
        raise TypeError(f"finish_reason must be one of {FINISH_REASONS} or its index, got {type(value).__name__}")
    if value not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS} or its index, got {value!r}")
    return value


def _checked_turn(turn: ModelTurn) -> ModelTurn:
    """`turn` with its text checked to be a str and its ids made a list of ints (numpy arrays and integers are
    accepted); a `TypeError` or `ValueError` saying what was expected otherwise. The turn itself when it holds
    that already (the common case: an engine's list of ints), else a checked copy."""
    if turn.text is not None and not isinstance(turn.text, str):
        raise TypeError(f"a model turn's text must be a str, got {type(turn.text).__name__}")
    reason = turn.finish_reason
    if not (isinstance(reason, str) and reason in FINISH_REASONS):  # a turn changed after it was made
        reason = _finish_reason(reason)
    ids = None if turn.ids is None else _int_ids(turn.ids)
    if ids is turn.ids and reason is turn.finish_reason:
        return turn
    return replace(turn, ids=ids, finish_reason=reason)


def _int_ids(ids: Any) -> list[int]:
    """`ids` as a list of ints: the list itself when it is one (checked by type, without a call per id)."""
    if type(ids) is list and set(map(type, ids)) <= _INT:
        return ids
    try:
        if isinstance(ids, str | bytes):
            raise TypeError
        return list(map(operator.index, ids))  # ints and numpy integers, never floats or strings
    except TypeError:
        raise TypeError("a model turn's token_ids must be a sequence of ints") from None


_INT = frozenset({int})


def _encodable_messages(messages: list[dict]) -> tuple[list[dict], int]:
    """`encodable_value` of a step's messages, after a quick look at their text: text that is ASCII (the usual
    tool output) holds nothing to replace."""
    for message in messages:
        try:
            if all(map(str.isascii, message.values())):
                continue
        except TypeError:  # a value that is not a str
            pass
        return encodable_value(messages)
    return messages, 0


def _may_hold_surrogates(raw: str) -> bool:
    """Whether arguments decoded from a call's JSON text `raw` may hold a lone surrogate: JSON text that is ASCII
    holds one only through a ``\\u`` escape. A call with no text (a parser that kept none) may."""
    return not raw or not raw.isascii() or "\\u" in raw


def _encodable_turn(turn: ModelTurn) -> tuple[ModelTurn, int]:
    """`turn` with text that UTF-8 cannot hold replaced (see `encodable`), and how many characters were."""
    if turn.text is None or turn.text.isascii():  # ASCII: nothing to replace, told without a call
        return turn, 0
    text, replaced = encodable(turn.text)
    return (replace(turn, text=text) if replaced else turn), replaced


def _check_encodable(messages: Sequence[Mapping[str, Any]], sample_id: Any) -> None:
    """Refuse prompt messages with text that UTF-8 cannot hold: the dataset row needs fixing, naming it."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if type(content) is str and content.isascii():  # the usual text, told without a call
            continue
        at = unencodable_at(content) if isinstance(content, str) else None
        if at is not None:
            row = f"sample {sample_id!r}" if sample_id is not None else "the task row (it has no sample_id)"
            raise ValueError(f"{row}: prompt message {i} ({message.get('role')}) has text that UTF-8 cannot encode "
                             f"(a lone surrogate {content[at]!r} at character {at}); fix the dataset row")
