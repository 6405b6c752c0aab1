"""Calculator-v0: multi-digit arithmetic that a small model can only get right by calling a calculator tool."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from mt_env.calculator import CalculatorTool
from mt_env.env import ToolEnv
from mt_env.parsers import HermesParser, ToolCall

SYSTEM_PROMPT = "Use the calculator tool, then give the answer."
_LAST_INT = re.compile(r"-?\d+")


class CalculatorEnv(ToolEnv):
    """
    ## Description

    Synthetic, offline arithmetic: "What is 347 * 829?". The product of two 3-digit numbers is beyond what a small
    model computes in its head, so success needs the tool: write the expression into a ``calculator`` call, read
    the result, answer with it. Tasks are drawn from the env's seeded RNG, so seeds give reproducible, held-out
    task sets. This is the env of the offline quickstart and the worked example of README "Add your own env".

    ## Action space

    One model turn: token ids (with a finish reason) when the env has a tokenizer, otherwise text (see `ToolEnv`).
    Tool calls use the Hermes/Qwen2.5 format::

        <tool_call>
        {"name": "calculator", "arguments": {"expression": "347 * 829"}}
        </tool_call>

    ## Observation space

    ``Dict(text, input_ids)``: the prompt after `reset`, then each turn's tool responses (template-delta token ids
    when the env has a tokenizer). The structured messages are in ``info["messages"]``.

    ## Rewards

    1.0 when the last integer of the final answer equals the true result, else 0.0 (given on the last step, in
    ``info["final_reward"]``). The calculator gives no step reward.

    ## Episode end

    Terminated when the model answers without a tool call; truncated after `max_turns` turns or when the token
    budget runs out. ``info["episode"]`` summarises turns, tool calls and errors.

    ## Arguments

    * ``digits``: digits of each operand (default 3).
    * ``terms``: numbers multiplied together (default 2).
    * plus every `ToolEnv` argument (``tokenizer``, ``max_turns`` (default 3), ``budget``, ``render_mode``, ...).

    ``options={"task": row}`` in `reset` plays a given task row (``{"question", "answer", "operands"}``).

    ## Version history

    * v0: initial version.
    """

    def __init__(self, digits: int = 3, terms: int = 2, max_turns: int = 3, **kwargs: Any):
        if digits < 1 or terms < 2:
            raise ValueError("digits must be >= 1 and terms >= 2")
        self.digits, self.terms = digits, terms
        super().__init__(max_turns=max_turns, **kwargs)

    def default_tools(self):
        return [CalculatorTool()]

    def sample_task(self, rng: np.random.Generator) -> dict:
        low, high = 10 ** (self.digits - 1), 10**self.digits
        operands = [int(x) for x in rng.integers(low, high, size=self.terms)]
        return self.task_for(operands)

    @staticmethod
    def task_for(operands: list[int]) -> dict:
        expression = " * ".join(map(str, operands))
        answer = int(np.prod(np.array(operands, dtype=object)))
        return {
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                       {"role": "user", "content": f"What is {expression}?"}],
            "operands": operands, "expression": expression, "answer": answer,
        }

    def answer_reward(self, task: Mapping[str, Any], final_text: str) -> float:
        numbers = _LAST_INT.findall(final_text.replace(",", ""))
        return 1.0 if numbers and int(numbers[-1]) == task["answer"] else 0.0

    def demonstration(self, task: Mapping[str, Any], rng: np.random.Generator, skill: float = 1.0) -> list[str]:
        """An expert's turns for `task`: a list of assistant texts and tool results, alternating.

        With probability ``1 - skill`` the expert skips the tool and estimates — a wrong but plausible number —
        the deliberately imperfect demonstrations of the quickstart, which SFT imitates and RL must unlearn.
        """
        answer = task["answer"]
        if rng.random() >= skill:
            guess = answer + int(rng.integers(1, 9)) * 10 ** int(rng.integers(0, max(1, len(str(answer)) - 1)))
            return [f"My estimate is {guess}."]
        call = HermesParser.format_turn([ToolCall("calculator", {"expression": task["expression"]})])
        return [call, str(answer), f"The answer is {answer}."]
