"""Policies (token-in/token-out generation backends) and the multi-turn rollout driver."""
