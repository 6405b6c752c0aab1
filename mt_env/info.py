"""The ``info`` dicts of `mt_env.env.ToolEnv`: `ResetInfo` from `reset`, `StepInfo` from `step` — their keys, types,
and when each is there. Plain dicts at run time (Gymnasium's contract); the types are for readers and checkers::

    obs, info = env.reset(seed=0)                                  # info: ResetInfo
    obs, reward, terminated, truncated, info = env.step(turn)      # info: StepInfo
    if terminated or truncated:
        print(info["end_reason"], info["final_reward"], info["episode"]["tool_calls"])
"""

# no `from __future__ import annotations`: TypedDict reads NotRequired only from evaluated annotations (3.11)
from typing import Any, NotRequired, TypedDict


class ResetInfo(TypedDict):
    """What `ToolEnv.reset` returns beside the prompt."""

    messages: list[dict[str, Any]]  #: the prompt messages (system, user), as the chat template takes them
    tools: list[dict[str, Any]]  #: the JSON schemas of the tools this episode may call (its prompt renders them)
    sample_id: Any  #: the task row's ``sample_id`` (top level or under ``extra_info``), None when it has none


class ParseErrorInfo(TypedDict):
    """A tool call the parser could not read (answered to the model with `message`)."""

    kind: str  #: what was wrong (e.g. ``malformed_json``), as `mt_env.parsers` names it
    message: str


class ToolReport(TypedDict):
    """One tool call's outcome (`mt_env.tools.ToolResult` without its text)."""

    name: str
    call_id: str
    reward: float  #: the call's step reward
    error: str | None  #: what the model was told went wrong; None when the call succeeded
    error_kind: str | None  #: one of `mt_env.tools.ERROR_KINDS`, or None
    duration_s: float
    metrics: dict[str, Any]  #: whatever the tool reported about the call


class StepInfo(TypedDict):
    """What `ToolEnv.step` returns beside the observation, reward and end flags. Every step has the first eight
    keys; `tool_results`/`tool_errors` only a step whose turn made tool calls (or malformed ones); the last five
    only the step that ends the episode."""

    turn: int  #: the assistant turn this step took, from 1
    finish_reason: str  #: ``stop``, ``length`` or ``abort``, as kept (a turn cut to the token budget: ``length``)
    tool_calls: list[dict[str, Any]]  #: the parsed calls in OpenAI's format (``id``, ``type``, ``function``)
    parse_errors: list[ParseErrorInfo]
    parse_metrics: dict[str, int]  #: lenient readings of the model's text (`mt_env.parsers.ParsedTurn.metrics`)
    unencodable_chars: int  #: characters replaced because the tokenizer cannot encode them
    messages: list[dict[str, Any]]  #: what answered the turn: tool responses or a user follow-up (may be empty)
    step_reward: float  #: the sum of this turn's tool rewards
    tool_results: NotRequired[list[ToolReport]]  #: one per call answered, in order
    tool_errors: NotRequired[int]  #: how many of them failed
    final_reward: NotRequired[float]  #: the episode's final reward (included in this step's reward)
    tool_rewards: NotRequired[dict[str, float]]  #: each tool's ``calc_reward``
    answer_reward: NotRequired[float]  #: `ToolEnv.answer_reward` of the final answer
    end_reason: NotRequired[str]  #: why the episode ended (e.g. ``answered``, ``turn limit reached ...``)
    episode: NotRequired[dict[str, Any]]  #: `ToolEnv.episode_stats` with the end reason: counts and rewards
