"""Trainers: `ppo.py` (PPO with GAE, and GRPO), SFT warm start, evaluation."""
