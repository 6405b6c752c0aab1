"""Envs for tests/test_rollout_processes.py, in a module of their own: the env processes import it to load them,
and it imports only what an env needs (no torch, no pytest), so that they start quickly."""

from __future__ import annotations

import os

from envs.calculator import CalculatorEnv

FAILS = [13, 13]  # its scorer raises, in the env process
EXITS = [66, 6]  # its env process exits with code 3 when the episode answers


class Troubled(CalculatorEnv):
    """Calculator tasks, with trouble on purpose for two of them (importable: the env processes load it)."""

    def answer_reward(self, task, final_text):
        if task["operands"] == FAILS:
            raise RuntimeError("the scorer broke on 13 * 13")
        if task["operands"] == EXITS:
            os._exit(3)
        return super().answer_reward(task, final_text)


class GoOn(CalculatorEnv):
    """Two turns for any model: an answer, even one cut by the token limit, gets a user turn asking to go on."""

    def __init__(self, **kwargs):
        super().__init__(length_cut="interact", max_interactions=1, max_turns=2, **kwargs)

    def interaction(self, task, final_text):
        return "Go on."
