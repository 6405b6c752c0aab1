"""Record and replay episodes, and export finished ones as SFT traces.

* `RecordEpisodes` writes every episode of a `ToolEnv` to a JSONL file, one line per episode: the task, and per
  step the model turn and every tool result (name, arguments, text, reward, error) plus rewards and endings.
* `ReplayTools` plays recorded tool results back instead of running the tools — same observations, rewards and
  endings, deterministically, with no tool side effects (debugging, regression tests, benchmarks).
* `episode_actions` yields the recorded model turns, to replay the model's side too.
* `sft_trace` turns a finished episode into a chat-format SFT record whose messages re-render, with the same chat
  template, to exactly the tokens that were sampled.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import gymnasium as gym

from .env import ToolEnv
from .errors import MtEnvError
from .tools import ToolResult
from .turn import ModelTurn


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))


def _action_record(action: Any) -> dict:
    if isinstance(action, ModelTurn):
        return {"token_ids": action.ids, "text": action.text, "finish_reason": action.finish_reason,
                "logprobs": action.logprobs}
    if isinstance(action, str):
        return {"text": action}
    if isinstance(action, Mapping):
        return _jsonable(dict(action))
    return {"token_ids": [int(i) for i in action]}


class RecordEpisodes(gym.Wrapper):
    """Append each finished episode to `path` (JSONL). Episodes cut short by `reset` or `close` are written too,
    marked ``"complete": false``."""

    def __init__(self, env: gym.Env, path: str | Path):
        super().__init__(env)
        if not isinstance(env.unwrapped, ToolEnv):
            raise TypeError("RecordEpisodes wraps a ToolEnv")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._episode: dict | None = None

    def reset(self, *, seed=None, options=None):
        self._flush(complete=False)
        obs, info = self.env.reset(seed=seed, options=options)
        self._episode = {"seed": seed, "task": _jsonable(self.env.unwrapped.task), "tools": info.get("tools"),
                         "steps": [], "complete": False}
        return obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self._episode is not None:
            results = info.get("tool_results", [])
            texts = [m.get("content") for m in info.get("messages", []) if m.get("role") == "tool"]
            calls = info.get("tool_calls", [])
            self._episode["steps"].append({
                "action": _action_record(action), "reward": reward, "terminated": terminated, "truncated": truncated,
                "tool_calls": calls, "parse_errors": info.get("parse_errors", []),
                "tool_results": [dict(r, text=t) for r, t in zip(results, texts)],
                "messages": info.get("messages", []),
            })
            if terminated or truncated:
                self._episode.update(final_reward=info.get("final_reward"), tool_rewards=info.get("tool_rewards"),
                                     end_reason=info.get("end_reason"))
                self._flush(complete=True)
        return obs, reward, terminated, truncated, info

    def close(self):
        self._flush(complete=False)
        super().close()

    def _flush(self, complete: bool) -> None:
        if self._episode is None:
            return
        self._episode["complete"] = complete
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(_jsonable(self._episode), ensure_ascii=False) + "\n")
        self._episode = None


def load_episodes(path: str | Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:  # not str.splitlines(): U+2028 in a string is not a line end
        return [json.loads(line) for line in f if line.strip()]


def episode_actions(episode: Mapping[str, Any]) -> Iterator[ModelTurn]:
    """The recorded model turns of `episode`, as `ModelTurn`s to pass to `step`."""
    for step in episode["steps"]:
        a = step["action"]
        yield ModelTurn(ids=a.get("token_ids"), text=a.get("text"),
                        finish_reason=a.get("finish_reason", "stop"), logprobs=a.get("logprobs"))


class _ReplayBox:
    """Stands in for a `ToolBox`: returns the recorded results of one episode, step by step."""

    def __init__(self, episode: Mapping[str, Any], tools):
        self.episode = episode
        self.tools = {t.name: t for t in tools}
        self.counts: Counter = Counter()
        self._steps = iter([s for s in episode["steps"] if s.get("tool_results")])

    async def create_all(self, tools_kwargs=None) -> None:
        self.counts["created"] += len(self.tools)

    async def execute_many(self, calls, max_parallel=None) -> list[ToolResult]:
        try:
            recorded = next(self._steps)["tool_results"]
        except StopIteration:
            raise MtEnvError(
                "replay ran past the recorded tool calls: the model turns differ from the recording") from None
        if len(recorded) != len(calls):
            raise MtEnvError(f"replay expected {len(recorded)} tool calls at this step, got {len(calls)}")
        self.counts["calls"] += len(recorded)
        return [ToolResult(name=r["name"], call_id=r["call_id"], text=r["text"], reward=r["reward"],
                           metrics=r.get("metrics") or {}, error=r.get("error"), error_kind=r.get("error_kind"))
                for r in recorded]

    async def calc_rewards(self) -> dict[str, float]:
        return dict(self.episode.get("tool_rewards") or {})

    async def release_all(self) -> None:
        self.counts["released"] = self.counts["created"]


class ReplayTools(gym.Wrapper):
    """Replay recorded tool results: `reset` plays the recorded episodes in order (same tasks), and each `step`
    answers tool calls with what the tools returned then. Pass the recorded model turns (`episode_actions`) to get
    the recorded episode back exactly."""

    def __init__(self, env: gym.Env, path_or_episodes: str | Path | list[dict]):
        super().__init__(env)
        base = env.unwrapped
        if not isinstance(base, ToolEnv):
            raise TypeError("ReplayTools wraps a ToolEnv")
        self.episodes = (load_episodes(path_or_episodes) if isinstance(path_or_episodes, (str, Path))
                         else list(path_or_episodes))
        if not self.episodes:
            raise MtEnvError("nothing to replay: the recording is empty")
        self._next = 0

    def reset(self, *, seed=None, options=None):
        episode = self.episodes[self._next % len(self.episodes)]
        self._next += 1
        self.env.unwrapped.toolbox_factory = lambda tools: _ReplayBox(episode, tools)
        options = dict(options or {}, task=episode["task"])
        return self.env.reset(seed=seed if seed is not None else episode.get("seed"), options=options)


def sft_trace(env: ToolEnv) -> dict:
    """A chat-format SFT record of the env's finished episode: ``{"messages", "tools", "reward"}``.

    Assistant messages carry the exact sampled text (tool calls included, as written), so the chat template
    re-renders them to the sampled tokens; parsed tool calls are kept separately under ``"tool_calls"``.
    """
    conv = env.conversation
    if conv is not None:
        messages = [dict(m) for m in conv.template_messages]
        parsed = [m.get("tool_calls") for m in conv.messages if m["role"] == "assistant"]
    else:
        messages = [{k: v for k, v in m.items() if k != "tool_calls"} for m in env.messages]
        parsed = [m.get("tool_calls") for m in env.messages if m["role"] == "assistant"]
    return {"messages": messages, "tools": env.tool_schemas, "tool_calls": parsed,
            "reward": env.episode_stats()["total_reward"]}
