"""`ToolVectorEnv`: many `ToolEnv`s in one event loop, stepped all at once or any subset at a time.

Gymnasium's `SyncVectorEnv` steps envs one after the other, so the tool calls of env 2 wait for those of env 1.
Here every env's `astep` runs concurrently in a single event loop: a step of N envs takes as long as its slowest
tool call, not the sum. And a continuous-batching engine finishes turns one by one, so `step_subset` steps only
the envs whose model turn is ready while the others keep waiting for theirs.

`step` follows Gymnasium's vector API with next-step autoreset (an env that ended is reset by the following
`step`, whose action for it is ignored). `step_subset` / `reset_subset` never autoreset: the caller decides when an
env starts its next episode (and with which task).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from .env import ToolEnv


class ToolVectorEnv(VectorEnv):
    """Args:
        env_fns: callables creating the envs, or
        env_id: a registered id, with `num_envs` and `env_kwargs` for `gym.make`.
    """

    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP, "render_modes": ["ansi", "html"]}

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]] | None = None, *, env_id: str | None = None,
                 num_envs: int | None = None, **env_kwargs: Any):
        if env_fns is None:
            if env_id is None or not num_envs:
                raise ValueError("give env_fns, or env_id and num_envs")
            env_fns = [lambda: gym.make(env_id, **env_kwargs) for _ in range(num_envs)]
        self.envs = [fn() for fn in env_fns]
        self.base_envs: list[ToolEnv] = [e.unwrapped for e in self.envs]
        if not all(isinstance(e, ToolEnv) for e in self.base_envs):
            raise TypeError("ToolVectorEnv holds ToolEnv environments")
        self.num_envs = len(self.envs)
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.spec = self.envs[0].spec
        self.render_mode = self.envs[0].render_mode
        self._needs_reset = np.zeros(self.num_envs, dtype=bool)
        self._loop = asyncio.new_event_loop()

    # ----------------------------------------------------------------------------------------- vector API
    def reset(self, *, seed: int | Sequence[int | None] | None = None, options: dict | None = None):
        seeds = self._seeds(seed)
        results = self._run(self.areset_subset(range(self.num_envs), seeds, [options] * self.num_envs))
        self._needs_reset[:] = False
        obs, infos = zip(*results)
        return self._batch_obs(obs), self._batch_infos(infos)

    def step(self, actions):
        actions = list(actions) if not isinstance(actions, dict) else _unbatch_dict(actions, self.num_envs)
        resetting = [i for i in range(self.num_envs) if self._needs_reset[i]]
        stepping = [i for i in range(self.num_envs) if not self._needs_reset[i]]

        async def both():
            return await asyncio.gather(self.areset_subset(resetting),
                                        self.astep_subset(stepping, [actions[i] for i in stepping]))

        reset_results, step_results = self._run(both())
        obs: list = [None] * self.num_envs
        rewards = np.zeros(self.num_envs)
        terminated = np.zeros(self.num_envs, dtype=bool)
        truncated = np.zeros(self.num_envs, dtype=bool)
        infos: list[dict] = [{} for _ in range(self.num_envs)]
        for i, (o, info) in zip(resetting, reset_results):
            obs[i], infos[i] = o, info
        for i, (o, r, term, trunc, info) in zip(stepping, step_results):
            obs[i], rewards[i], terminated[i], truncated[i], infos[i] = o, r, term, trunc, info
        self._needs_reset = terminated | truncated
        return self._batch_obs(obs), rewards, terminated, truncated, self._batch_infos(infos)

    def close_extras(self, **kwargs):
        for env in self.envs:
            env.close()
        if not self._loop.is_closed():
            self._loop.close()

    def render(self):
        return tuple(env.render() for env in self.envs)

    # ----------------------------------------------------------------------------------------- subsets
    def step_subset(self, indices: Sequence[int], actions: Sequence[Any]) -> list[tuple]:
        """Step only the envs in `indices` (one action each), concurrently; returns their (obs, reward,
        terminated, truncated, info) in the same order. No autoreset."""
        return self._run(self.astep_subset(indices, actions))

    def reset_subset(self, indices: Sequence[int], seeds: Sequence[int | None] | None = None,
                     options: Sequence[dict | None] | None = None) -> list[tuple]:
        """Reset only the envs in `indices` (with per-env seeds/options, e.g. ``{"task": row}``)."""
        return self._run(self.areset_subset(indices, seeds, options))

    async def astep_subset(self, indices: Sequence[int], actions: Sequence[Any]) -> list[tuple]:
        if len(indices) != len(actions):
            raise ValueError(f"{len(indices)} envs but {len(actions)} actions")
        return list(await asyncio.gather(*(self.base_envs[i].astep(a) for i, a in zip(indices, actions))))

    async def areset_subset(self, indices: Sequence[int], seeds: Sequence[int | None] | None = None,
                            options: Sequence[dict | None] | None = None) -> list[tuple]:
        indices = list(indices)
        seeds = list(seeds) if seeds is not None else [None] * len(indices)
        options = list(options) if options is not None else [None] * len(indices)
        return list(await asyncio.gather(*(
            self.base_envs[i].areset(seed=s, options=o) for i, s, o in zip(indices, seeds, options))))

    # ----------------------------------------------------------------------------------------- helpers
    def _seeds(self, seed) -> list[int | None]:
        if seed is None:
            return [None] * self.num_envs
        if isinstance(seed, int):
            return [seed + i for i in range(self.num_envs)]
        seeds = list(seed)
        if len(seeds) != self.num_envs:
            raise ValueError(f"{len(seeds)} seeds for {self.num_envs} envs")
        return seeds

    def _batch_obs(self, obs: Sequence[dict]) -> dict:
        return {key: tuple(o[key] for o in obs) for key in self.single_observation_space.spaces}

    def _batch_infos(self, infos: Sequence[dict]) -> dict:
        out: dict = {}
        for i, info in enumerate(infos):
            out = self._add_info(out, info, i)
        return out

    def _run(self, coro):
        return self._loop.run_until_complete(coro)


def _unbatch_dict(actions: dict, n: int) -> list[dict]:
    return [{k: v[i] for k, v in actions.items()} for i in range(n)]
