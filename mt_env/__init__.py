"""mt_env: multi-turn, tool-using reinforcement learning for LLMs, as Gymnasium environments."""

__version__ = "0.1.0"
