"""mt_env: multi-turn, tool-using reinforcement learning for LLMs, as Gymnasium environments.

``import mt_env`` registers the environments, so that ``gym.make("GSM8kTool-v0")`` and
``gym.make_vec("Calculator-v0", num_envs=8)`` work. The main classes are importable from here::

    from mt_env import ChatFormat, Conversation, TokenBudget, ToolEnv, ToolVectorEnv
"""

from __future__ import annotations

import importlib

import gymnasium as gym

__version__ = "0.1.0"

#: Gymnasium id -> entry point. `gym.make_vec` defaults to mt_env's `ToolVectorEnv` (pass
#: ``vectorization_mode="sync"`` for Gymnasium's own `SyncVectorEnv`).
ENVS = {
    "GSM8kTool-v0": "envs.gsm8k.env:GSM8kToolEnv",
    "Calculator-v0": "envs.calculator:CalculatorEnv",
}


def _make_tool_vector_env(env_id: str, num_envs: int, **kwargs):
    from .vector import ToolVectorEnv

    return ToolVectorEnv(env_id=env_id, num_envs=num_envs, **kwargs)


def register_envs() -> None:
    for env_id, entry_point in ENVS.items():
        if env_id not in gym.registry:
            gym.register(
                id=env_id, entry_point=entry_point, disable_env_checker=False,
                vector_entry_point=lambda num_envs, _id=env_id, **kw: _make_tool_vector_env(_id, num_envs, **kw),
            )


register_envs()

_LAZY = {
    "ChatFormat": "mt_env.chat_format", "Conversation": "mt_env.conversation", "TokenBudget": "mt_env.conversation",
    "Seg": "mt_env.sample", "Sample": "mt_env.sample", "check_template": "mt_env.conformance",
    "collate": "mt_env.batch", "TrainBatch": "mt_env.batch", "offline_tokenizer": "mt_env.tokenizer",
    "load_tokenizer": "mt_env.tokenizer", "ToolEnv": "mt_env.env", "ModelTurn": "mt_env.turn",
    "ToolVectorEnv": "mt_env.vector", "BaseTool": "mt_env.tools", "ToolBox": "mt_env.tools",
    "load_tools": "mt_env.tool_config", "get_parser": "mt_env.parsers", "StepInfo": "mt_env.info",
    "ResetInfo": "mt_env.info",
}
__all__ = ["ENVS", "register_envs", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mt_env' has no attribute {name!r}")
