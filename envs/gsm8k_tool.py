"""GSM8kTool-v0: grade-school math word problems, with a tool that checks an answer before the model commits to it.

Also the data preparation for it: ``python -m envs.gsm8k_tool --prepare DIR --out rows.jsonl`` turns GSM8K's
``{"question", "answer"}`` jsonl into dataset rows with per-sample ``tools_kwargs`` (the shape verl uses).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mt_env.env import ToolEnv
from mt_env.errors import MtEnvError
from mt_env.tools import BaseTool

TOOL_NAME = "calc_gsm8k_reward"
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Check your answer to the math problem: returns whether it is correct.",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The final numeric answer, e.g. 72"}},
            "required": ["answer"],
        },
    },
}
SYSTEM_PROMPT = (
    "You are a careful math solver. Reason step by step, then check your answer with the `calc_gsm8k_reward` tool "
    "at least once before giving your final answer; refine it if the tool says it is wrong. "
    "Write the final answer as `#### <number>`."
)
INSTRUCTION = "Solve it step by step, check with the tool, and write the final answer after `####`."
DATA_ENV_VAR = "MT_ENV_GSM8K"
_ANSWER = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def normalize_number(text: str) -> str | None:
    """``"1,234.50"`` → ``"1234.5"``; None when `text` holds no number."""
    found = _NUMBER.findall(str(text))
    if not found:
        return None
    raw = found[-1].replace(",", "")
    try:
        value = float(raw)
    except ValueError:
        return None
    return str(int(value)) if value == int(value) else repr(value)


def extract_final_answer(text: str) -> str | None:
    """The number after the last ``####`` in `text`, normalized; None if there is none."""
    found = _ANSWER.findall(text)
    return normalize_number(found[-1]) if found else None


class Gsm8kTool(BaseTool):
    """``calc_gsm8k_reward(answer)``: scores a candidate answer against the episode's ground truth.

    `create` stores the ground truth (``create_kwargs={"ground_truth": "72"}``); `execute` parses the answer,
    scores it (1.0 correct, 0.0 not) and tells the model; calling again without improving costs a small penalty
    (``config.repeat_penalty``, default 0.05) so the tool is not spammed; `calc_reward` is the score of the last
    answer checked — the episode's final correctness as far as the tool knows.
    """

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Mapping[str, Any] | None = None):
        super().__init__(config, tool_schema or TOOL_SCHEMA)
        self.repeat_penalty = float(self.config.get("repeat_penalty", 0.05))
        self._state: dict[str, dict] = {}

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs) -> str:
        if ground_truth is None:
            raise MtEnvError("calc_gsm8k_reward needs create_kwargs={'ground_truth': ...} for each sample")
        instance_id = instance_id or f"gsm8k-{id(self)}-{len(self._state)}-{os.urandom(4).hex()}"
        self._state[instance_id] = {"truth": normalize_number(ground_truth), "last": 0.0, "best": 0.0, "calls": 0}
        return instance_id

    async def execute(self, instance_id: str, arguments: dict, **kwargs) -> tuple[str, float, dict]:
        state = self._state[instance_id]
        answer = normalize_number(arguments.get("answer", ""))
        score = 1.0 if answer is not None and answer == state["truth"] else 0.0
        step_reward = -self.repeat_penalty if state["calls"] and score <= state["best"] else 0.0
        state["calls"] += 1
        state["last"], state["best"] = score, max(state["best"], score)
        verdict = "correct" if score else "not correct"
        return f"Parsed answer: {answer}. This answer is {verdict}.", step_reward, {"score": score}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return self._state[instance_id]["last"]

    async def release(self, instance_id: str, **kwargs) -> None:
        self._state.pop(instance_id, None)


def make_row(question: str, answer: str, index: int, split: str = "train") -> dict:
    """A dataset row for one GSM8K problem: prompt messages plus the tool's per-sample kwargs (verl's shape)."""
    truth = answer.split("####")[-1].strip().replace(",", "")
    return {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                   {"role": "user", "content": f"{question.strip()}\n\n{INSTRUCTION}"}],
        "reward_model": {"ground_truth": truth},
        "extra_info": {
            "split": split, "index": index, "sample_id": f"gsm8k-{split}-{index}",
            "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": truth}}},
        },
    }


def load_rows(path: str | os.PathLike | None = None, split: str = "train") -> list[dict]:
    """Cached `read_rows`: every env of a vector or a rollout pool shares one copy of the data."""
    return _cached_rows(str(path or os.environ.get(DATA_ENV_VAR) or ""), split)


@functools.lru_cache(maxsize=8)
def _cached_rows(path: str, split: str) -> list[dict]:
    return read_rows(path or None, split)


def read_rows(path: str | os.PathLike | None = None, split: str = "train") -> list[dict]:
    """GSM8K rows from a jsonl/parquet file, a directory holding ``{split}.jsonl``, ``$MT_ENV_GSM8K``, or the
    Hugging Face hub (``openai/gsm8k``). Raw ``{question, answer}`` records are turned into rows with `make_row`;
    prepared rows (with ``prompt``) are used as they are."""
    path = path or os.environ.get(DATA_ENV_VAR)
    if path:
        p = Path(path)
        if p.is_dir():
            candidates = [p / f"{split}.jsonl", p / f"{split}.parquet"]
            p = next((c for c in candidates if c.is_file()), candidates[0])
        if not p.is_file():
            raise MtEnvError(f"GSM8K data not found at {p}: pass data_path= a jsonl/parquet file or a directory with "
                             f"{split}.jsonl (GSM8K's own format, or rows prepared with `python -m envs.gsm8k_tool`)")
        if p.suffix == ".parquet":
            import pandas as pd

            records = pd.read_parquet(p).to_dict("records")
        else:
            with p.open(encoding="utf-8") as f:  # not str.splitlines(): U+2028 inside a string is not a line end
                records = [json.loads(line) for line in f if line.strip()]
    else:
        if os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1":
            raise MtEnvError(f"no GSM8K data and the Hugging Face hub is offline: pass data_path= (a jsonl/parquet "
                             f"file or a directory with {split}.jsonl) or set ${DATA_ENV_VAR}")
        try:
            from datasets import load_dataset

            records = list(load_dataset("openai/gsm8k", "main", split=split))
        except Exception as e:
            raise MtEnvError(
                "no GSM8K data: pass data_path= (a jsonl/parquet file or a directory with train.jsonl/test.jsonl), "
                f"set ${DATA_ENV_VAR}, or allow downloading openai/gsm8k from the Hugging Face hub ({e})"
            ) from e
    rows = [r if "prompt" in r else make_row(r["question"], r["answer"], i, split) for i, r in enumerate(records)]
    splits = {(r.get("extra_info") or {}).get("split") for r in rows}
    if split in splits:  # a prepared file that holds several splits: keep the one asked for
        rows = [r for r in rows if (r.get("extra_info") or {}).get("split") == split]
    elif splits - {None, split}:
        raise MtEnvError(f"the GSM8K rows at {path} are from split(s) {sorted(s for s in splits if s)}, not {split!r}: "
                         f"point data_path at the {split} data (e.g. env.eval_kwargs.data_path for evaluation)")
    if not rows:
        raise MtEnvError(f"the GSM8K {split} data at {path or 'openai/gsm8k'} is empty")
    return rows


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

    Step: the tool's penalty (-0.05 by default) for checking again without improving. Final (last step): the tool's
    ``calc_reward`` — 1.0 if the last checked answer was correct — or, when the final ``#### <n>`` answer is correct,
    1.0 (the larger of the two).

    ## Episode end

    Terminated when the model answers without a tool call (with ``interaction=True``, a wrong answer first gets a
    "try again" user turn, up to ``max_interactions``). Truncated at ``max_turns`` or when the token budget is hit.

    ## Arguments

    * ``data_path``: jsonl/parquet file or directory (``train.jsonl``/``test.jsonl``), else ``$MT_ENV_GSM8K``, else
      the hub dataset ``openai/gsm8k``. ``split``: ``train`` (default) or ``test``.
    * ``interaction``: enable "try again" user turns; ``max_interactions`` (default 1 when enabled).
    * ``repeat_penalty``: the tool's penalty for non-improving calls.
    * plus every `ToolEnv` argument (``tokenizer``, ``max_turns`` (default 5), ``budget``, ``render_mode``, ...).

    ``reset(options={"task": row})`` plays a given row; ``reset(options={"index": i})`` the i-th problem.

    ## Version history

    * v0: initial version.
    """

    def __init__(self, data_path: str | None = None, split: str = "train", interaction: bool = False,
                 max_interactions: int | None = None, repeat_penalty: float = 0.05, max_turns: int = 5,
                 **kwargs: Any):
        self.rows = load_rows(data_path, split)
        self.repeat_penalty = repeat_penalty
        kwargs.setdefault("max_interactions", (max_interactions if max_interactions is not None else 1)
                          if interaction else 0)
        super().__init__(max_turns=max_turns, **kwargs)

    def default_tools(self):
        return [Gsm8kTool({"repeat_penalty": self.repeat_penalty})]

    def sample_task(self, rng: np.random.Generator) -> dict:
        return self.rows[int(rng.integers(len(self.rows)))]

    async def areset(self, *, seed: int | None = None, options: dict | None = None):
        if options and "index" in options:
            options = dict(options, task=self.rows[int(options["index"]) % len(self.rows)])
        return await super().areset(seed=seed, options=options)

    def answer_reward(self, task: Mapping[str, Any], final_text: str) -> float:
        truth = normalize_number(task["reward_model"]["ground_truth"])
        return 1.0 if extract_final_answer(final_text) == truth else 0.0

    def final_reward(self, task: Mapping[str, Any], final_text: str, tool_rewards: Mapping[str, float]) -> float:
        """Correct if the last answer checked with the tool or the final ``#### <n>`` is right (not both added)."""
        return max(float(sum(tool_rewards.values())), self.answer_reward(task, final_text))

    def interaction(self, task: Mapping[str, Any], final_text: str) -> str | None:
        truth = normalize_number(task["reward_model"]["ground_truth"])
        if extract_final_answer(final_text) == truth:
            return None
        return "Your final answer is not correct. Check your reasoning and try again; end with `#### <number>`."


def main() -> None:
    ap = argparse.ArgumentParser(description="Prepare GSM8K rows with per-sample tools_kwargs.")
    ap.add_argument("--prepare", required=True, help="directory with train.jsonl/test.jsonl, or one jsonl file")
    ap.add_argument("--split", default="train")
    ap.add_argument("--out", required=True, help="output .jsonl")
    args = ap.parse_args()
    rows = read_rows(args.prepare, args.split)
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
