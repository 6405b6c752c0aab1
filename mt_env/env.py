"""`ToolEnv`: the base class of mt_env's tool-using tasks, a real `gymnasium.Env`.

One episode is one conversation. `reset` draws a task (or takes one from ``options={"task": row}``), creates the
episode's tool instances and returns the prompt; `step` takes one model turn — token ids with a finish reason, or
text — parses its tool calls, runs them concurrently, and returns what the model sees next: the tool responses as
text, and, when the env has a tokenizer, as the exact template-delta token ids to append (built by
`mt_env.conversation.Conversation`, so the ids never drift from what the chat template renders).

A task subclasses `ToolEnv` and implements `sample_task` (and usually `answer_reward`; optionally `interaction`).
See `envs/calculator.py` for a small complete example and `envs/gsm8k_tool.py` for a dataset-backed one.

Spaces
    observation: ``Dict(text=Text, input_ids=Sequence(Discrete(vocab)))`` — the *new* text and token ids since
        the last observation (the whole prompt after `reset`). Without a tokenizer ``input_ids`` is empty and
        ``text`` holds the new messages as ``role: content`` blocks; the messages themselves are in
        ``info["messages"]``.
    action: with a tokenizer, ``Dict(token_ids=Sequence(Discrete(vocab)), finish_reason=Discrete(3))`` (0 stop,
        1 length, 2 abort); without, ``Text``. `step` also accepts a `ModelTurn`, a ``str`` or a list of ids.

Rewards
    Each step returns the tool step rewards of that turn; the last step adds the episode's final reward
    (`final_reward`: by default the tools' ``calc_reward`` plus `answer_reward` of the final answer), also in
    ``info["final_reward"]``.

Episode end
    ``terminated``: the model answered without a tool call (and no interaction turn follows), or a tool with
    ``on_error: end_episode`` failed. ``truncated``: the turn limit, the token budget, an aborted generation, or a
    turn cut by its token limit without a tool call (see ``length_cut``).
    Stepping an ended episode raises `gymnasium.error.ResetNeeded`. Tools are released at the end of an episode,
    on `reset` mid-episode and on `close`.
"""

from __future__ import annotations

import asyncio
import operator
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.error import ResetNeeded

from .chat_format import ChatFormat, encodable, encodable_value, unencodable_at
from .conversation import Conversation, TokenBudget
from .errors import MtEnvError
from .parsers import get_parser
from .tool_config import select_tools
from .tools import BaseTool, ToolBox, cap_calls

FINISH_REASONS = ("stop", "length", "abort")


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


@dataclass
class ModelTurn:
    """One model turn: sampled ids (verbatim), their logprobs and the engine's finish reason; or text."""

    token_ids: list[int] | None = None
    text: str | None = None
    finish_reason: str = "stop"
    logprobs: list[float] | None = None


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

    def success(self, info: Mapping[str, Any]) -> bool:
        """Whether an ended episode counts as solved (for success rates); default: a positive final reward."""
        return float(info.get("final_reward") or 0.0) > 0

    def interaction(self, task: Mapping[str, Any], final_text: str) -> str | None:
        """A user follow-up after an answer (e.g. "that is wrong, try again"), or None to end the episode."""
        return None

    # ----------------------------------------------------------------------------------------- gymnasium API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        return self._run(self.areset(seed=seed, options=options))

    def step(self, action):
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
    async def areset(self, *, seed: int | None = None, options: dict | None = None):
        """Async twin of `reset`, for drivers that run many envs in one event loop.

        Options: ``task`` (a task row to play instead of drawing one), ``episode`` (an id copied onto the
        conversation's training samples, e.g. ``(group, index)`` for GRPO)."""
        super().reset(seed=seed)
        await self._end_episode_tools()  # a reset mid-episode releases the previous episode's tools
        options = _checked_options(options)
        task = dict(options["task"]) if "task" in options else self.sample_task(self.np_random)
        chosen = select_tools(self.tools, task)
        self.task = task
        self.tool_schemas = chosen.schemas  #: the tools this episode can call (and its prompt renders)
        self.turn = 0
        self.interactions = 0
        self.totals = {"tool_calls": 0, "tool_errors": 0, "parse_errors": 0, "step_reward": 0.0, "final_reward": 0.0}
        self._box = self.toolbox_factory(chosen.tools)
        await self._box.create_all(chosen.tools_kwargs)
        self.tool_counts["created"] += len(chosen.tools)
        key = tuple(chosen.names)
        self._parser = self._parsers.get(key) or self._parsers.setdefault(
            key, get_parser(self.tool_format, chosen.schemas))
        messages = self.prompt_messages(task)
        _check_encodable(messages, chosen.sample_id)
        self.messages = list(messages)
        if self.tokenizer is not None:
            fmt = self._formats.get(key) or self._formats.setdefault(key, ChatFormat(
                self.tokenizer, tools=chosen.schemas or None, template_kwargs=self.template_kwargs))
            self.conversation = Conversation(fmt, messages, budget=self.budget, mode=self.mode, strict=self.strict,
                                             episode=options.get("episode"))
            ids = list(self.conversation.context_ids)
            obs = {"text": "".join(s.text for s in self.conversation.current.segments), "input_ids": tuple(ids)}
        else:
            self.conversation = None
            obs = {"text": _plain(messages), "input_ids": ()}
        self._active = True
        info = {"messages": messages, "tools": chosen.schemas, "sample_id": chosen.sample_id}
        return obs, info

    async def astep(self, action):
        """Async twin of `step`."""
        if not self._active:
            raise ResetNeeded("the episode has ended (or reset() was not called): call reset() before step()")
        turn, unencodable = _encodable_turn(self._as_turn(action))
        self.turn += 1
        conv = self.conversation
        if conv is not None:
            ids = turn.token_ids if turn.token_ids is not None else self._encode_text_turn(turn)
            assistant = conv.add_assistant(ids, logprobs=turn.logprobs, finish_reason=turn.finish_reason)
            text, finish = assistant.text, assistant.finish_reason
        else:
            text, finish = turn.text if turn.text is not None else "", turn.finish_reason
        parsed = self._parser.parse(text)
        for i, call in enumerate(parsed.calls):  # ids shared by the assistant message and the tool responses
            call.id = call.id or f"call_{self.turn - 1}_{i}"
            call.arguments, replaced = encodable_value(call.arguments)  # JSON's "\udce9" is a lone surrogate
            unencodable += replaced
        openai_calls = [c.to_openai() for c in parsed.calls]
        if conv is not None:
            conv.set_parsed(openai_calls, parsed.content)
        else:
            msg = {"role": "assistant", "content": text}
            if openai_calls:
                msg["tool_calls"] = openai_calls
            self.messages.append(msg)

        info: dict[str, Any] = {"turn": self.turn, "finish_reason": finish, "tool_calls": openai_calls,
                                "parse_errors": [{"kind": e.kind, "message": e.message} for e in parsed.errors]}
        self.totals["parse_errors"] += len(parsed.errors)
        reward, terminated, truncated, reason = 0.0, False, False, None
        new_messages: list[dict] = []

        if finish == "abort":
            truncated, reason = True, "generation aborted"
        elif conv is not None and conv.truncated:
            truncated, reason = True, conv.truncation_reason
        elif parsed.calls or parsed.errors:
            if self.turn >= self.max_turns:
                truncated, reason = True, "turn limit reached with a pending tool call"
            else:
                calls = cap_calls(parsed.calls + parsed.errors, self.max_calls_per_turn)
                results = await self._box.execute_many(calls, self.max_parallel_tools)
                reward = float(sum(r.reward for r in results))
                new_messages = [r.to_message() for r in results]
                info["tool_results"] = [
                    {"name": r.name, "call_id": r.call_id, "reward": r.reward, "error": r.error,
                     "error_kind": r.error_kind, "duration_s": r.duration_s, "metrics": r.metrics} for r in results]
                errors = sum(1 for r in results if r.error_kind)
                self.totals["tool_calls"] += len(results)
                self.totals["tool_errors"] += errors
                info["tool_errors"] = errors
                if any(r.end_episode for r in results):
                    terminated, reason = True, "a tool failed with on_error=end_episode"
        elif finish == "length" and self.length_cut == "truncate":
            truncated, reason = True, "turn cut by its token limit"
        else:
            follow = self.interaction(self.task, text) if self.interactions < self.max_interactions else None
            if follow is None:
                terminated, reason = True, "answered"
            elif self.turn >= self.max_turns:
                truncated, reason = True, "turn limit reached"
            else:
                self.interactions += 1
                new_messages = [{"role": "user", "content": follow}]

        new_messages, replaced = encodable_value(new_messages)
        unencodable += replaced
        info["unencodable_chars"] = unencodable  # replaced with U+FFFD in the model's turn and the observation
        obs = {"text": "", "input_ids": ()}
        if new_messages and not (terminated or truncated):
            if self.turn >= self.max_turns:
                truncated, reason = True, "turn limit reached"
            else:
                obs, replaced = self._observe(new_messages)
                info["replace_context"] = replaced
                if obs is None:
                    obs, truncated, reason = {"text": "", "input_ids": ()}, True, conv.truncation_reason
        if conv is not None and reward:
            conv.add_reward(reward)
        self.totals["step_reward"] += reward
        info["messages"] = new_messages
        info["step_reward"] = reward
        if terminated or truncated:
            final, tool_rewards, answer = await self._finish(text)
            reward += final
            info.update(final_reward=final, tool_rewards=tool_rewards, answer_reward=answer, end_reason=reason,
                        episode=dict(self.totals, turns=self.turn, total_reward=self.totals["step_reward"] + final,
                                     end_reason=reason))
        return obs, reward, terminated, truncated, info

    # ----------------------------------------------------------------------------------------- internals
    def _observe(self, new_messages: list[dict]) -> tuple[dict | None, bool]:
        """Append an observation; returns (observation, replaces_context). In tokenizer mode the ids are the template
        delta to append — or, in per-turn mode, the whole new context (the template re-rendered the history).
        None when the budget leaves no room for it."""
        conv = self.conversation
        if conv is None:
            self.messages += new_messages
            return {"text": _plain(new_messages), "input_ids": ()}, False
        n_samples, start = len(conv.samples_), len(conv.context_ids)
        if not conv.add_observation(new_messages):
            return None, False
        replaced = len(conv.samples_) != n_samples
        if replaced:
            start = 0
        text = "".join(s.text for s in conv.current.segments if s.start >= start)
        return {"text": text, "input_ids": tuple(conv.context_ids[start:])}, replaced

    async def _finish(self, final_text: str) -> tuple[float, dict, float]:
        tool_rewards = await self._box.calc_rewards() if self._box is not None else {}
        answer = float(self.answer_reward(self.task, final_text))
        final = float(self.final_reward(self.task, final_text, tool_rewards))
        self.totals["final_reward"] = final
        if self.conversation is not None:
            self.conversation.final_reward = final
        await self._end_episode_tools()
        return final, tool_rewards, answer

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
        if isinstance(action, ModelTurn):
            turn = action
        elif isinstance(action, str):
            turn = ModelTurn(text=action)
        elif isinstance(action, Mapping):
            turn = ModelTurn(token_ids=action.get("token_ids"), text=action.get("text"),
                             finish_reason=action.get("finish_reason", "stop"), logprobs=action.get("logprobs"))
        elif isinstance(action, (list, tuple, np.ndarray)):
            turn = ModelTurn(token_ids=action)
        else:
            raise TypeError(f"an action is a ModelTurn, a str, token ids or a dict, got {type(action).__name__}")
        turn = _checked_turn(turn)
        if turn.token_ids is not None and self.tokenizer is None:
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
    if not isinstance(options, Mapping):
        raise TypeError(f"reset options must be a dict such as {{'task': row}} or None, got {type(options).__name__}")
    if "task" in options and not isinstance(options["task"], Mapping):
        raise TypeError("options['task'] must be a task row (a dict with the prompt messages), got "
                        f"{type(options['task']).__name__}; leave 'task' out to draw a task")
    return options


def _checked_turn(turn: ModelTurn) -> ModelTurn:
    """`turn` with its finish reason as a name (an index into ``FINISH_REASONS`` is accepted, as in the action
    space) and its token ids as a list of ints; a `TypeError` or `ValueError` saying what was expected otherwise."""
    reason = turn.finish_reason
    if isinstance(reason, int | np.integer) and not isinstance(reason, bool):
        reason = FINISH_REASONS[int(reason)] if 0 <= reason < len(FINISH_REASONS) else reason
    elif not isinstance(reason, str):
        raise TypeError(f"finish_reason must be one of {FINISH_REASONS} or its index, got {type(reason).__name__}")
    if reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS} or its index, got {reason!r}")
    if turn.text is not None and not isinstance(turn.text, str):
        raise TypeError(f"a model turn's text must be a str, got {type(turn.text).__name__}")
    if turn.token_ids is None and turn.text is None:
        raise ValueError("a model turn needs token_ids or text")
    ids = None if turn.token_ids is None else _int_ids(turn.token_ids)
    return ModelTurn(token_ids=ids, text=turn.text, finish_reason=reason, logprobs=turn.logprobs)


def _int_ids(ids: Any) -> list[int]:
    try:
        if isinstance(ids, str | bytes):
            raise TypeError
        return list(map(operator.index, ids))  # ints and numpy integers, never floats or strings
    except TypeError:
        raise TypeError("a model turn's token_ids must be a sequence of ints") from None


def _encodable_turn(turn: ModelTurn) -> tuple[ModelTurn, int]:
    """`turn` with text that UTF-8 cannot hold replaced (see `encodable`), and how many characters were."""
    if turn.text is None:
        return turn, 0
    text, replaced = encodable(turn.text)
    return (replace(turn, text=text) if replaced else turn), replaced


def _check_encodable(messages: Sequence[Mapping[str, Any]], sample_id: Any) -> None:
    """Refuse prompt messages with text that UTF-8 cannot hold: the dataset row needs fixing, naming it."""
    for i, message in enumerate(messages):
        content = message.get("content")
        at = unencodable_at(content) if isinstance(content, str) else None
        if at is not None:
            row = f"sample {sample_id!r}" if sample_id is not None else "the task row (it has no sample_id)"
            raise ValueError(f"{row}: prompt message {i} ({message.get('role')}) has text that UTF-8 cannot encode "
                             f"(a lone surrogate {content[at]!r} at character {at}); fix the dataset row")
