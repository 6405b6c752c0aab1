"""`GSM8kTool-v0`: grade-school math word problems, with a tool that checks an answer before the model commits to
it (`envs.gsm8k.tool`), on the rows of `envs.gsm8k.data`. The env's spec is its class docstring.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mt_env.env import ToolEnv
from mt_env.info import ResetInfo

from .data import load_rows
from .tool import REWARD_STYLES, Gsm8kTool, extract_final_answer, normalize_number, verl_score


class GSM8kToolEnv(ToolEnv):
    """
    ## Description

    A GSM8K word problem per episode. The model reasons, checks candidate answers with the ``calc_gsm8k_reward``
    tool (which says whether an answer is correct), and finishes with ``#### <number>``. In the spirit of verl's
    GSM8K multi-turn tool example.

    ## Action space

    One model turn: token ids with a finish reason (env with a tokenizer) or text. Tool calls in the Hermes/Qwen2.5
    ``<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}</tool_call>`` format.

    ## Observation space

    ``Dict(text, input_ids)``: the prompt after `reset`; after a tool call, the tool's verdict (template-delta ids
    with a tokenizer). Messages in ``info["messages"]``.

    ## Rewards

    ``reward_style="lenient"`` (default). Step: the tool's penalty (-0.05 by default) for checking again without
    improving. Final (last step): the tool's ``calc_reward`` — 1.0 if the last checked answer was correct — or, when
    the final ``#### <n>`` answer is correct, 1.0 (the larger of the two). Numbers compare by exact value.

    ``reward_style="verl"``: verl's scores exactly (see `envs.gsm8k.tool`). Step: verl's tool penalty (-0.05
    whenever a check does not score above the previous one, the first included). Final: verl's strict rule on the
    final answer alone.

    ## Episode end

    Terminated when the model answers without a tool call (with ``interaction=True``, a wrong answer first gets a
    "try again" user turn, up to ``max_interactions``). Truncated at ``max_turns`` or when the token budget is hit.

    ## Arguments

    * ``data_path``: jsonl/parquet file or directory (``train.jsonl``/``test.jsonl``), else ``$MT_ENV_GSM8K``, else
      the hub dataset ``openai/gsm8k``. ``split``: ``train`` (default) or ``test``.
    * ``interaction``: enable "try again" user turns; ``max_interactions`` (default 1 when enabled).
    * ``repeat_penalty``: the tool's penalty for non-improving calls.
    * ``reward_style``: ``lenient`` (default) or ``verl``, for the final answer and the tool the env builds.
    * plus every `ToolEnv` argument (``tokenizer``, ``max_turns`` (default 5), ``budget``, ``render_mode``, ...).

    ``reset(options={"task": row})`` plays a given row; ``reset(options={"index": i})`` the i-th problem.

    ## Version history

    * v0: initial version.
    """

    def __init__(self, data_path: str | None = None, split: str = "train", interaction: bool = False,
                 max_interactions: int | None = None, repeat_penalty: float = 0.05, reward_style: str = "lenient",
                 max_turns: int = 5, **kwargs: Any):
        if reward_style not in REWARD_STYLES:
            raise ValueError(f"reward_style must be one of {REWARD_STYLES}, got {reward_style!r}")
        self.rows = load_rows(data_path, split)
        self.repeat_penalty = repeat_penalty
        self.reward_style = reward_style
        kwargs.setdefault("max_interactions", (max_interactions if max_interactions is not None else 1)
                          if interaction else 0)
        super().__init__(max_turns=max_turns, **kwargs)

    def default_tools(self):
        return [Gsm8kTool({"repeat_penalty": self.repeat_penalty, "reward_style": self.reward_style})]

    def sample_task(self, rng: np.random.Generator) -> dict:
        return self.rows[int(rng.integers(len(self.rows)))]

    async def areset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, ResetInfo]:
        if options and "index" in options:
            options = dict(options, task=self.rows[int(options["index"]) % len(self.rows)])
        return await super().areset(seed=seed, options=options)

    def answer_reward(self, task: Mapping[str, Any], final_text: str) -> float:
        truth = task["reward_model"]["ground_truth"]
        if self.reward_style == "verl":
            return float(verl_score(final_text, str(truth), "strict"))
        answer = extract_final_answer(final_text)
        return 1.0 if answer is not None and answer == normalize_number(truth) else 0.0

    def final_reward(self, task: Mapping[str, Any], final_text: str, tool_rewards: Mapping[str, float]) -> float:
        """Lenient: correct if the last answer checked with the tool or the final ``#### <n>`` is right (not both
        added). verl: the final answer's strict score alone (verl trains on it; its tool scores are only logged)."""
        if self.reward_style == "verl":
            return self.answer_reward(task, final_text)
        return max(float(sum(tool_rewards.values())), self.answer_reward(task, final_text))

    def interaction(self, task: Mapping[str, Any], final_text: str) -> str | None:
        if self.answer_reward(task, final_text) > 0:
            return None
        return "Your final answer is not correct. Check your reasoning and try again; end with `#### <number>`."
