"""The GSM8K tool, ``calc_gsm8k_reward(answer)``, and the answer scoring it shares with `envs.gsm8k.env`.

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

import os
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

import numpy as np

from mt_env.errors import MtEnvError, ToolConfigError
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

