"""GSM8kTool-v0: grade-school math word problems with a tool that checks an answer (verl's GSM8K multi-turn task).

`tool` (the ``calc_gsm8k_reward`` tool and the answer scoring), `data` (the rows, and ``python -m envs.gsm8k.data
--prepare``), `env` (`GSM8kToolEnv`, registered as ``GSM8kTool-v0`` by ``import mt_env``). The names below are
importable from here too, each loaded with its module on first use (so that running `data` as a script does not
import it twice).
"""

from __future__ import annotations

import importlib

_LAZY = {
    "GSM8kToolEnv": "env", "Gsm8kTool": "tool", "TOOL_NAME": "tool", "TOOL_SCHEMA": "tool",
    "REWARD_STYLES": "tool", "extract_final_answer": "tool", "normalize_number": "tool", "verl_score": "tool",
    "make_row": "data", "read_rows": "data", "load_rows": "data", "DATA_ENV_VAR": "data",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
