"""Token-in/token-out conversations: the exact ids a model saw and sampled, and which of them to train on.

A `Conversation` starts from prompt messages rendered by the chat template. Each assistant turn is appended
**verbatim from the sampled token ids** (never re-tokenized: a model's own split of its text, such as ``hel`` +
``lo``, is what it sampled). Each observation (tool responses, user messages) is appended as the **template
delta**: the exact tokens the template adds after the assistant turn, turn separators and the next generation
prompt included. Every token belongs to one `Segment` (prompt / generation prompt / sampled / observation, with its
turn index); the loss mask, token-level rewards and "where did this token come from" all derive from the segments.

Two modes:

* ``"incremental"`` — one training sample per episode: prompt, then sampled turns and observations. Only valid for
  templates with the prefix property (rendering incrementally equals rendering the whole conversation).
* ``"per_turn"`` — one training sample per assistant turn: for templates that re-render history (e.g. Qwen3 drops
  earlier ``<think>`` blocks), each generation prompt is the template's full rendering of the history, and only
  that turn's sampled tokens are trained on.

``"auto"`` (default) picks ``incremental`` when the format passes `mt_env.conformance.check_template`, else
``per_turn``. With ``strict=True`` (default) `samples()` of a trainable episode runs `check_drift()`, which raises
`DriftError` with a readable diff when the ids differ from what the template renders around the sampled text.

The conversation is the one record of its episode: ids, segments, messages and rewards. Whoever drives it reads the
next prompt from `context_ids` and keeps no copy of its own.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .chat_format import ChatFormat
from .conformance import check_template
from .errors import BudgetError, ChatFormatError, ConversationError, DriftError
from .render import render_ansi, render_html
from .sample import Sample, Seg, Segment
from .turn import ModelTurn


_INT = frozenset({int})


@dataclass
class TokenBudget:
    """Token limits of one episode. `None` means unlimited.

    Args:
        max_prompt_tokens: the rendered prompt; longer prompts raise `BudgetError`.
        max_response_tokens: everything after the prompt (sampled turns + observations).
        max_total_tokens: prompt + response.
        max_observation_tokens: one observation (all tool responses of one turn, with their wrappers).
        observation_keep: how an over-long observation is cut: ``"head"`` keeps its beginning, ``"tail"`` its end,
            ``"middle"`` both ends; a marker saying how many tokens were cut replaces the removed part.
        min_generation_tokens: an observation is only appended if at least this many tokens stay for the next turn.
    """

    max_prompt_tokens: int | None = None
    max_response_tokens: int | None = None
    max_total_tokens: int | None = None
    max_observation_tokens: int | None = None
    observation_keep: str = "head"
    min_generation_tokens: int = 1

    def __post_init__(self):
        if self.observation_keep not in ("head", "tail", "middle"):
            raise ValueError(f"observation_keep must be head/tail/middle, got {self.observation_keep!r}")
        for name in ("max_prompt_tokens", "max_response_tokens", "max_total_tokens", "max_observation_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be positive or None, got {v}")
        if self.min_generation_tokens < 1:
            raise ValueError("min_generation_tokens must be >= 1")


@dataclass
class AssistantTurn(ModelTurn):
    """A model turn as the conversation accepted it: `ids` cut to the token budget (the finish reason then becomes
    ``length``), `text` decoded from them without the end-of-turn token, and where it sits in the conversation —
    with the parser's view of it and the step reward it earned."""

    index: int = 0  #: assistant turns count from 0
    closed: bool = False  #: the model ended the turn itself with the end-of-turn token
    tool_calls: list[dict] | None = None
    content: str | None = None  #: display content (text outside tool calls) from a parser, if given
    reward: float = 0.0
    sample: int = 0  #: index of the `Sample` holding this turn's tokens
    message_index: int = 0  #: index of this turn's message in `Conversation.template_messages`


class Conversation:
    """One episode's conversation as token ids, built turn by turn. See the module docstring.

    Args:
        fmt: the `ChatFormat` (tokenizer, template, tools).
        messages: the prompt messages (OpenAI chat format; no assistant turns with tool calls needed).
        budget: token limits; hitting one truncates the episode, never exceeds it.
        mode: ``"auto"``, ``"incremental"`` or ``"per_turn"``.
        strict: run the drift check when samples are built.
    """

    def __init__(
        self,
        fmt: ChatFormat,
        messages: Sequence[Mapping[str, Any]],
        budget: TokenBudget | None = None,
        mode: str = "auto",
        strict: bool = True,
    ):
        if mode not in ("auto", "incremental", "per_turn"):
            raise ValueError(f"mode must be auto/incremental/per_turn, got {mode!r}")
        if not messages:
            raise ChatFormatError("a conversation needs at least one prompt message")
        self.fmt = fmt
        self.budget = budget or TokenBudget()
        self.mode = mode if mode != "auto" else ("incremental" if check_template(fmt).conforms else "per_turn")
        self.strict = strict
        self.template_messages: list[dict] = [fmt.clean_message(m, observation=False) for m in messages]
        self.openai_messages: list[dict] = [dict(m) for m in self.template_messages]
        self.turns: list[AssistantTurn] = []
        self.final_reward: float | None = None
        self.truncated = False  #: a token budget was hit
        self.truncation_reason: str | None = None
        self.observation_cuts = 0  #: observations shortened by the budget's policy
        self._awaiting = "assistant"
        #: per sample index, the (segments, template messages) that `check_drift` found without drift
        self._drift_checked: dict[int, tuple[int, int]] = {}

        text, gen = fmt.prompt_text(self.template_messages)
        ids = fmt.encode(text + gen)
        self.prompt_len = len(ids)
        mp = self.budget.max_prompt_tokens
        if mp is not None and len(ids) > mp:
            raise BudgetError(f"the prompt is {len(ids)} tokens, over max_prompt_tokens={mp}")
        mt = self.budget.max_total_tokens
        if mt is not None and len(ids) >= mt:
            raise BudgetError(f"the prompt is {len(ids)} tokens, leaving nothing of max_total_tokens={mt}")
        self.samples_: list[Sample] = [self._new_sample(ids, text, gen)]

    # ----------------------------------------------------------------------------------------- state
    @property
    def current(self) -> Sample:
        """The sample being extended: what the model sees next."""
        return self.samples_[-1]

    @property
    def context_ids(self) -> list[int]:
        """The token ids to send to the engine for the next assistant turn (a copy: appending goes through
        `add_assistant` / `add_observation`). In ``per_turn`` mode they start over with each new sample."""
        return list(self.current.ids)

    @property
    def response_len(self) -> int:
        return len(self.current.ids) - self.prompt_len

    @property
    def awaiting(self) -> str:
        """``"assistant"`` (generate next), ``"observation"`` (tools / env answer next) or ``"nothing"`` (truncated)."""
        return "nothing" if self.truncated else self._awaiting

    @property
    def max_new_tokens(self) -> int:
        """How many tokens the next assistant turn may sample without breaking the budget."""
        r = self._room(self.response_len, len(self.current.ids))
        return max(0, int(r)) if r != math.inf else 2**31 - 1

    def _truncate(self, reason: str) -> None:
        self.truncated, self.truncation_reason = True, reason

    def _new_sample(self, ids: list[int], text: str, gen: str) -> Sample:
        sample = Sample(n_messages=len(self.template_messages))
        cut = self.fmt.split_generation_prompt(ids)
        if cut == len(ids):
            raise ChatFormatError("the encoded prompt does not end with the generation prompt's tokens")
        turn = len(self.turns)
        sample._extend(Seg.PROMPT, turn - 1, ids[:cut], text)
        sample._extend(Seg.GEN_PROMPT, turn, ids[cut:], gen)
        sample.prompt_len = len(ids)
        return sample

    # ----------------------------------------------------------------------------------------- appending
    def add_assistant(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float] | None = None,
        finish_reason: str = "stop",
        tool_calls: Sequence[Mapping[str, Any]] | None = None,
        content: str | None = None,
    ) -> AssistantTurn:
        """Append a sampled turn verbatim. `ids` includes the end-of-turn token when the engine stopped on it.

        Ids beyond the budget (`max_new_tokens`) are cut and the turn is marked ``finish_reason="length"``; the
        conversation is then truncated. `tool_calls`/`content` are the parsed view for `messages` only.
        """
        if self.truncated:
            raise ConversationError(f"the conversation is truncated ({self.truncation_reason}); no more turns")
        if self._awaiting != "assistant":
            raise ConversationError("an assistant turn must follow the prompt or an observation, not another turn")
        ids = list(ids)
        if not (set(map(type, ids)) <= _INT and (not ids or (min(ids) >= 0 and max(ids) < self.fmt.vocab_size))):
            self.fmt.check_ids(ids)  # names the bad ids (the test above passes good ones without a call per id)
        if logprobs is not None:
            logprobs = list(map(float, logprobs))
            if len(logprobs) != len(ids):
                raise ConversationError(f"{len(logprobs)} logprobs for {len(ids)} sampled ids")
        allowed = self.max_new_tokens
        over_budget = len(ids) > allowed
        if over_budget:
            ids, finish_reason = ids[:allowed], "length"
            logprobs = logprobs[:allowed] if logprobs is not None else None
        closed = bool(ids) and ids[-1] == self.fmt.end_of_turn_id
        text = self.fmt.decode(ids[:-1] if closed else ids)
        turn = AssistantTurn(
            index=len(self.turns), ids=ids, logprobs=logprobs, finish_reason=finish_reason, text=text, closed=closed,
            sample=len(self.samples_) - 1, message_index=len(self.template_messages),
        )
        seg_text = text + self.fmt.end_of_turn if closed else text
        self.current._extend(Seg.SAMPLED, turn.index, ids, seg_text, logprobs)
        self.turns.append(turn)
        self.template_messages.append({"role": "assistant", "content": text})
        self.openai_messages.append({})
        self.set_parsed(tool_calls, content)
        self._awaiting = "observation"
        if over_budget or self.max_new_tokens == 0:
            self._truncate("token budget: response limit reached")
        return turn

    def set_parsed(self, tool_calls: Sequence[Mapping[str, Any]] | None, content: str | None = None) -> None:
        """Attach the parsed view (tool calls, display content) of the latest assistant turn to `messages`.
        The ids are not affected: this is what a parser read from them."""
        if not self.turns:
            raise ConversationError("no assistant turn to attach tool calls to")
        turn = self.turns[-1]
        turn.tool_calls = [_openai_tool_call(c, turn.index, i) for i, c in enumerate(tool_calls or [])] or None
        turn.content = content
        msg: dict[str, Any] = {"role": "assistant", "content": turn.text if content is None else content}
        if turn.tool_calls:
            msg["tool_calls"] = turn.tool_calls
        self.openai_messages[turn.message_index] = msg

    def add_observation(self, messages: Sequence[Mapping[str, Any]]) -> bool:
        """Append tool responses / user messages as the template delta (mask 0), ending with the next generation
        prompt. Over-long observations are cut by the budget's policy. Returns False (and truncates the episode)
        when not even a cut observation fits with room for the next turn."""
        if self.truncated:
            raise ConversationError(f"the conversation is truncated ({self.truncation_reason}); no observation")
        if not self.turns:
            raise ConversationError("an observation needs an assistant turn before it")
        if self._awaiting != "observation":
            raise ConversationError("two observations in a row: append the assistant turn in between")
        obs = [self.fmt.clean_message(m, observation=True) for m in messages]
        if not obs:
            raise ConversationError("an observation needs at least one message")
        closed = self.turns[-1].closed
        turn = self.turns[-1].index

        def delta_ids(msgs: list[dict]) -> tuple[list[int], str, str]:
            text, gen = self.fmt.observation_text(msgs, turn_closed=closed)
            return self.fmt.encode(text + gen), text, gen

        limit = self._observation_limit()
        ids, text, gen = delta_ids(obs)
        if limit is not None and len(ids) > limit:
            obs = self._cut_observation(obs, limit, lambda m: len(delta_ids(m)[0]))
            if obs is None:
                self._truncate("token budget: no room for the observation")
                return False
            ids, text, gen = delta_ids(obs)
            self.observation_cuts += 1

        self.template_messages += obs
        self.openai_messages += [dict(m) for m in obs]
        if self.mode == "incremental":
            cut = self.fmt.split_generation_prompt(ids)
            if cut == len(ids):  # the generation prompt merged with the observation: keep the run whole
                self.current._extend(Seg.OBSERVATION, turn, ids, text + gen)
            else:
                self.current._extend(Seg.OBSERVATION, turn, ids[:cut], text)
                self.current._extend(Seg.GEN_PROMPT, turn + 1, ids[cut:], gen)
        else:
            if not self._start_turn_sample():
                return False
        self._awaiting = "assistant"
        return True

    def _start_turn_sample(self) -> bool:
        """per_turn mode: the next generation prompt is the template's rendering of the whole history."""
        text, gen = self.fmt.prompt_text(self.template_messages)
        ids = self.fmt.encode(text + gen)
        total_room = self._room(len(ids) - self.prompt_len, len(ids))
        if total_room < self.budget.min_generation_tokens:
            self._truncate("token budget: no room for the next turn after re-rendering the history")
            return False
        self.samples_.append(self._new_sample(ids, text, gen))
        return True

    def _room(self, response_len: int, total_len: int) -> float:
        room = [math.inf]
        if self.budget.max_response_tokens is not None:
            room.append(self.budget.max_response_tokens - response_len)
        if self.budget.max_total_tokens is not None:
            room.append(self.budget.max_total_tokens - total_len)
        return min(room)

    def _observation_limit(self) -> int | None:
        """Most tokens the next delta may have: the per-observation cap and what the budget leaves for it."""
        room = self._room(self.response_len, len(self.current.ids)) - self.budget.min_generation_tokens
        caps = [room]
        if self.budget.max_observation_tokens is not None:
            caps.append(self.budget.max_observation_tokens + len(self.fmt.generation_prompt_ids))
        limit = min(caps)
        return None if limit == math.inf else int(limit)

    def _cut_observation(self, obs: list[dict], limit: int, measure) -> list[dict] | None:
        """Shorten the contents of `obs` so that `measure(obs) <= limit`, keeping the template wrappers intact."""
        empty = [dict(m, content="") for m in obs]
        overhead = measure(empty)
        if overhead > limit:
            return None
        lengths = [len(self.fmt.encode(m["content"])) for m in obs]
        budget = limit - overhead
        for _ in range(8):  # edges merge with the wrapper and the marker: re-measure and tighten
            shares = _water_fill(lengths, budget)
            cut = [dict(m, content=self._cut_text(m["content"], n, keep)) for m, n, keep in zip(obs, lengths, shares)]
            excess = measure(cut) - limit
            if excess <= 0:
                return cut
            budget -= max(excess, 1)
            if budget < 0:
                break
        return empty if measure(empty) <= limit else None

    def _cut_text(self, text: str, n_tokens: int, keep: int) -> str:
        """`text` cut to about `keep` tokens by the budget's policy, a marker saying how many were removed."""
        if keep >= n_tokens:
            return text
        ids = self.fmt.encode(text)
        marker_len = len(self.fmt.encode(f"[... {n_tokens} tokens cut ...]"))
        keep = max(0, keep - marker_len)
        marker = f"[... {len(ids) - keep} tokens cut ...]"
        policy = self.budget.observation_keep
        if policy == "head":
            return self.fmt.decode(ids[:keep]) + marker
        if policy == "tail":
            return marker + self.fmt.decode(ids[len(ids) - keep:] if keep else [])
        head = keep - keep // 2
        tail = ids[len(ids) - keep // 2:] if keep // 2 else []
        return self.fmt.decode(ids[:head]) + marker + self.fmt.decode(tail)

    # ----------------------------------------------------------------------------------------- rewards
    def add_reward(self, reward: float, turn: int | None = None) -> None:
        """Add a step reward to an assistant turn (default: the latest). It lands on that turn's last sampled token."""
        if not self.turns:
            raise ConversationError("no assistant turn to reward yet")
        self.turns[-1 if turn is None else turn].reward += float(reward)

    # ----------------------------------------------------------------------------------------- views
    @property
    def messages(self) -> list[dict]:
        """OpenAI chat-format messages (assistant ``tool_calls`` parsed, arguments as JSON strings)."""
        return [dict(m) for m in self.openai_messages]

    @property
    def total_reward(self) -> float:
        """The episode's return: all turn rewards plus the final reward."""
        return sum(t.reward for t in self.turns) + float(self.final_reward or 0.0)

    def samples(self, trainable: bool = True) -> list[Sample]:
        """The training samples with token-level rewards: each turn's reward on the last sampled token at or before
        that turn, the final reward on the episode's last sampled token. A reward with no sampled token before it
        (an empty first turn) has no token to carry it; it still counts in `Sample.episode_reward`. Runs the drift
        check first when `strict`. `trainable=False` (a failed episode, whose tokens are kept but not trained on)
        zeroes the loss mask and skips the drift check: the failure may be the drift itself."""
        if self.strict and trainable:
            self.check_drift()
        placements: list[tuple[int, int, float]] = []  # (sample, position, reward)
        last_sampled: tuple[int, int] | None = None
        for t in self.turns:
            seg = next(s for s in self.samples_[t.sample].segments if s.kind == Seg.SAMPLED and s.turn == t.index)
            if len(seg):
                last_sampled = (t.sample, seg.end - 1)
            if t.reward and last_sampled is not None:
                placements.append((*last_sampled, t.reward))
        if self.final_reward and last_sampled is not None:
            placements.append((*last_sampled, float(self.final_reward)))
        out = []
        for i, s in enumerate(self.samples_):
            rewards = [0.0] * len(s.ids)
            for si, pos, r in placements:
                if si == i:
                    rewards[pos] += r
            out.append(
                Sample(ids=list(s.ids), logprobs=list(s.logprobs), segments=list(s.segments), prompt_len=s.prompt_len,
                       n_messages=s.n_messages, rewards=rewards, trainable=trainable,
                       episode_reward=self.total_reward)
            )
        return out

    # ----------------------------------------------------------------------------------------- drift
    def check_drift(self) -> None:
        """Raise `DriftError` if the ids differ from what the chat template renders around the sampled text.

        For each sample, the text of every segment before its last sampled turn must equal the template's rendering
        of the messages so far (with the generation prompt), and the ids of every run of template segments must
        equal the encoding of that run's text. Sampled ids are never compared with a re-tokenization: how a model
        splits its own text is not drift. Cost: one render and about one tokenization of the template text. What
        an earlier call checked (e.g. `precheck_drift` while the last turn was generated) is not checked again:
        segments and messages are only ever appended, so it cannot have changed.
        """
        for index, sample in enumerate(self.samples_):
            segs = sample.segments
            last = len(segs)
            n_messages = sample.n_messages
            if segs[-1].kind == Seg.SAMPLED:
                last -= 1  # compare up to the final sampled turn, which the template renders as "last" specially
                n_messages = self.turns[segs[-1].turn].message_index
            else:
                n_messages = len(self.template_messages) if index == len(self.samples_) - 1 else n_messages
            if self._drift_checked.get(index) == (last, n_messages):
                continue
            expected = self.fmt.render(self.template_messages[:n_messages], add_generation_prompt=True)
            got = "".join(s.text for s in segs[:last])
            if got != expected:
                raise DriftError(self._text_diff(index, segs[:last], got, expected))
            for start, end, text in _template_runs(segs[:last]):
                # the system prompt's and tools' pieces are encoded once per format; that a tokenizer never merges
                # across the control tokens the pieces split at is checked when the format is built (ChatFormat)
                ids = self.fmt.encode(text)
                if sample.ids[start:end] != ids:
                    raise DriftError(self._token_diff(index, start, end, text, sample.ids[start:end], ids))
            self._drift_checked[index] = (last, n_messages)

    def precheck_drift(self) -> None:
        """Run `check_drift` on the conversation so far, e.g. while its next turn is generated: the context a turn is
        generated from is what the check compares once that turn is the last, so `samples()` then checks only what
        came after. A drift (or a template error) found now is not raised here: `samples()` checks that part again
        and raises it, so the episode fails where it always does."""
        if self.strict:
            with contextlib.suppress(Exception):  # raised again, with its own message, by samples()
                self.check_drift()

    def _text_diff(self, sample: int, segs: list[Segment], got: str, expected: str) -> str:
        at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        seg = next((s for s, off in _offsets(segs) if off <= at < off + len(s.text)), segs[-1] if segs else None)
        where = f"in the {seg.kind.name} segment of turn {seg.turn}" if seg else "at the start"
        hint = (
            " The template does not have the prefix property for this conversation (e.g. it drops earlier <think> "
            "blocks or trims contents): use Conversation(mode='per_turn'), or mode='auto'."
            if self.mode == "incremental" else ""
        )
        return (
            f"token drift in sample {sample} at character {at} {where}.{hint}\n"
            f"  ids decode to : ...{got[max(0, at - 60):at + 60]!r}\n"
            f"  template says : ...{expected[max(0, at - 60):at + 60]!r}"
        )

    def _token_diff(self, sample: int, start: int, end: int, text: str, got: list[int], want: list[int]) -> str:
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        return (
            f"token drift in sample {sample}, tokens {start}:{end} (template text {text[:80]!r}...): first difference "
            f"at token {start + k}: ids have {got[k:k + 5]} ({self.fmt.decode(got[k:k + 5])!r}), encoding the text "
            f"gives {want[k:k + 5]} ({self.fmt.decode(want[k:k + 5])!r})"
        )

    # ----------------------------------------------------------------------------------------- display
    def render_ansi(self, sample: int = -1) -> str:
        return render_ansi(self.samples_[sample], self.fmt.tokenizer)

    def render_html(self, sample: int = -1) -> str:
        return render_html(self.samples_[sample], self.fmt.tokenizer)

    def __repr__(self) -> str:
        return (
            f"Conversation(mode={self.mode}, turns={len(self.turns)}, tokens={len(self.current.ids)}, "
            f"awaiting={self.awaiting!r}, truncated={self.truncated})"
        )


# --------------------------------------------------------------------------------------------- helpers
def _openai_tool_call(call: Mapping[str, Any], turn: int, index: int) -> dict:
    """Normalize ``{"name", "arguments"}`` or an OpenAI tool call to the OpenAI shape (arguments as JSON text)."""
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"id": call.get("id") or f"call_{turn}_{index}", "type": "function",
            "function": {"name": fn.get("name"), "arguments": args}}


def _water_fill(lengths: list[int], budget: int) -> list[int]:
    """Split `budget` tokens among contents of `lengths`: equal shares, unused share handed to the longer ones."""
    shares = [0] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    left = max(0, budget)
    for k, i in enumerate(order):
        share = left // (len(order) - k)
        shares[i] = min(lengths[i], share)
        left -= shares[i]
    return shares


def _template_runs(segs: list[Segment]) -> list[tuple[int, int, str]]:
    """Maximal runs of non-sampled segments, as (start, end, text): the pieces that were encoded as one."""
    runs: list[tuple[int, int, str]] = []
    for s in segs:
        if s.kind == Seg.SAMPLED:
            continue
        if runs and runs[-1][1] == s.start and s.kind == Seg.GEN_PROMPT:
            start, _, text = runs[-1]
            runs[-1] = (start, s.end, text + s.text)
        else:
            runs.append((s.start, s.end, s.text))
    return runs


def _offsets(segs: list[Segment]):
    off = 0
    for s in segs:
        yield s, off
        off += len(s.text)
