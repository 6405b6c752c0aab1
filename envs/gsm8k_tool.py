"""GSM8kTool-v0: grade-school math word problems, with a tool that checks an answer before the model commits to it.

Also the data preparation for it: ``python -m envs.gsm8k_tool --prepare DIR --out rows.jsonl`` turns GSM8K's
``{"question", "answer"}`` jsonl into dataset rows with per-sample ``tools_kwargs`` (the shape verl uses).

Two reward styles (``reward_style``, for the env and for the tool's config):

* ``lenient`` (default): numbers are compared by exact value (``72.0`` = ``72``, ``1,234`` = ``1234``, ``$`` and
  spaces after ``####`` ignored); the tool penalizes a check that does not beat the best answer so far (not the
  first); the final reward is the larger of the tool's last score and the final ``#### <n>`` answer's.
* ``verl``: verl's scores exactly (``verl/tools/gsm8k_tool.py`` and ``verl/utils/reward_score/gsm8k.py``): the tool
  scores ``"#### " + str(answer)`` with the flexible rule (the last number, compared as a string), answers
  ``Current parsed answer='..' reward=..``, and costs 0.05 whenever a call does not score above the previous call
  (the first call included); the final reward is the strict rule alone (``#### `` then a number, in the last 300
  characters of the final answer), which is verl's training score.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np

from mt_env.env import ToolEnv
from mt_env.errors import MtEnvError, ToolConfigError
from mt_env.info import ResetInfo
from mt_env.tool_schema import arguments_validator
from mt_env.tools import BaseTool

TOOL_NAME = "calc_gsm8k_reward"
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Check your answer to the math problem: returns whether it is correct.",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": ["string", "number"],
                                      "description": "The final numeric answer, e.g. 72"}},
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
REWARD_STYLES = ("lenient", "verl")
_ANSWER = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")
_INTEGER = re.compile(r"-?\d+")
#: verl reads an answer from the last 300 characters of a solution only.
VERL_CLIP_CHARS = 300
_VERL_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_VERL_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")


def normalize_number(text: Any) -> str | None:
    """The last number in `text`, written canonically and exactly: ``"1,234.50"`` → ``"1234.5"``, ``"72.0"`` →
    ``"72"``, however many digits; two numbers are equal iff their canonical forms are. None when there is none. A
    float (a JSON number; numpy's too, of any width, as a parquet file gives them) is read with all its digits
    (``1e+20`` would read as the number 20)."""
    if type(text) is str and _INTEGER.fullmatch(text):  # a plain integer (most answers): its canonical form at once
        return str(int(text))
    number = isinstance(text, (float, np.floating))
    found = _NUMBER.findall(format(Decimal(repr(float(text))), "f") if number else str(text))
    if not found:
        return None
    value = Decimal(found[-1].replace(",", ""))
    if value == value.to_integral_value():
        return str(int(value))
    return format(value, "f").rstrip("0")


def extract_final_answer(text: str) -> str | None:
    """The number after the last ``####`` in `text`, normalized; None if there is none."""
    found = _ANSWER.findall(text)
    return normalize_number(found[-1]) if found else None


def verl_extract_answer(text: str, method: str = "strict") -> str | None:
    """The answer verl's GSM8K scorer reads from `text`, within its last `VERL_CLIP_CHARS` characters. ``strict``:
    the number after the last ``"#### "``, commas and ``$`` removed. ``flexible``: the last run of digits, dots and
    commas other than a lone ``.``, as written. None when there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    text = text[-VERL_CLIP_CHARS:]
    if method == "strict":
        found = _VERL_STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _VERL_FLEXIBLE.findall(text)
    if not found:
        return None
    return next((number for number in reversed(found) if number != "."), found[0])


def verl_score(text: str, ground_truth: str, method: str = "strict") -> float:
    """verl's GSM8K score of `text`: 1.0 when `verl_extract_answer` equals `ground_truth` as a string (so ``72.0``
    is wrong against ``72``), else 0.0, or the int 0 when there is no answer (verl's exact values)."""
    answer = verl_extract_answer(text, method)
    if answer is None:
        return 0
    return 1.0 if answer == ground_truth else 0.0


class Gsm8kTool(BaseTool):
    """``calc_gsm8k_reward(answer)``: scores a candidate answer against the episode's ground truth.

    `create` stores the ground truth (``create_kwargs={"ground_truth": "72"}``); `execute` scores the answer (1.0
    correct, 0.0 not) and tells the model; a check that does not improve costs a small penalty
    (``config.repeat_penalty``, default 0.05) so the tool is not spammed; `calc_reward` is the score of the last
    answer checked. ``config.reward_style`` picks the rules (``lenient`` or ``verl``, see the module docstring).

    The answer may be a JSON number as well as a string (models write ``{"answer": 72}`` constantly, and verl's tool
    scores ``str(answer)``): a configured schema that declares ``answer`` a string is widened to string or number.
    """

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Mapping[str, Any] | None = None):
        super().__init__(config, tool_schema or TOOL_SCHEMA)
        answer = self.tool_schema["function"]["parameters"].get("properties", {}).get("answer")
        if not isinstance(answer, dict):
            raise ToolConfigError(f"tool {self.name!r}: the GSM8K tool's schema needs an 'answer' property")
        if answer.get("type") == "string":  # our own copy of the schema: widen it, and validate against that
            answer["type"] = ["string", "number"]
            self.validator = arguments_validator(self.tool_schema)
        self.repeat_penalty = float(self.config.get("repeat_penalty", 0.05))
        self.reward_style = self.config.get("reward_style", "lenient")
        if self.reward_style not in REWARD_STYLES:
            raise ToolConfigError(f"tool {self.name!r}: config.reward_style must be one of {REWARD_STYLES}, "
                                  f"got {self.reward_style!r}")
        self._state: dict[str, dict] = {}

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs) -> str:
        if ground_truth is None:
            raise MtEnvError("calc_gsm8k_reward needs create_kwargs={'ground_truth': ...} for each sample")
        instance_id = instance_id or f"gsm8k-{id(self)}-{len(self._state)}-{os.urandom(4).hex()}"
        truth = str(ground_truth) if self.reward_style == "verl" else normalize_number(ground_truth)
        self._state[instance_id] = {"truth": truth, "last": 0.0, "best": 0.0, "calls": 0}
        return instance_id

    async def execute(self, instance_id: str, arguments: dict, **kwargs) -> tuple[str, float, dict]:
        state = self._state[instance_id]
        check = self._check_verl if self.reward_style == "verl" else self._check_lenient
        text, score, step_reward = check(state, arguments.get("answer", ""))
        state["calls"] += 1
        state["last"], state["best"] = score, max(state["best"], score)
        return text, step_reward, {"score": score}

    def _check_lenient(self, state: dict, answer: Any) -> tuple[str, float, float]:
        """Exact numeric comparison; the penalty when a check after the first does not beat the best so far."""
        number = normalize_number(answer)
        score = 1.0 if number is not None and number == state["truth"] else 0.0
        step_reward = -self.repeat_penalty if state["calls"] and score <= state["best"] else 0.0
        verdict = "correct" if score else "not correct"
        return f"Parsed answer: {number}. This answer is {verdict}.", score, step_reward

    def _check_verl(self, state: dict, answer: Any) -> tuple[str, float, float]:
        """verl's `Gsm8kTool.execute`: the flexible score of ``#### answer``; the penalty whenever the score is not
        above the previous call's (0.0 before the first)."""
        answer = answer if isinstance(answer, str) else str(answer)
        score = verl_score(answer if answer.startswith("#### ") else "#### " + answer, state["truth"], "flexible")
        step_reward = 0.0 if score > state["last"] else -self.repeat_penalty
        return f"Current parsed answer={answer!r} reward={score!r}", score, step_reward

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

    ``reward_style="lenient"`` (default). Step: the tool's penalty (-0.05 by default) for checking again without
    improving. Final (last step): the tool's ``calc_reward`` — 1.0 if the last checked answer was correct — or, when
    the final ``#### <n>`` answer is correct, 1.0 (the larger of the two). Numbers compare by exact value.

    ``reward_style="verl"``: verl's scores exactly (see the module docstring). Step: verl's tool penalty (-0.05
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


def main(argv: list[str] | None = None) -> None:
    """``python -m envs.gsm8k_tool --prepare DIR --out rows.jsonl`` (its errors as the trainer's commands show them:
    `trainers.stopping.entry_point`)."""
    from trainers.stopping import debug_flag

    ap = argparse.ArgumentParser(description="Prepare GSM8K rows with per-sample tools_kwargs.")
    ap.add_argument("--prepare", required=True, help="directory with train.jsonl/test.jsonl, or one jsonl file")
    ap.add_argument("--split", default="train")
    ap.add_argument("--out", required=True, help="output .jsonl")
    debug_flag(ap)
    args = ap.parse_args(argv)
    rows = read_rows(args.prepare, args.split)
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    import sys

    from trainers.stopping import entry_point

    sys.exit(entry_point(main))
