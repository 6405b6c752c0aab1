"""`ToolVectorEnv`: many `ToolEnv`s in one event loop, stepped all at once or any subset at a time.

Gymnasium's `SyncVectorEnv` steps envs one after the other, so the tool calls of env 2 wait for those of env 1.
Here every env's `astep` runs concurrently in a single event loop: a step of N envs takes as long as its slowest
tool call, not the sum. And a continuous-batching engine finishes turns one by one, so `step_subset` steps only
the envs whose model turn is ready while the others keep waiting for theirs.

`step` and `reset` follow Gymnasium 1.x's vector API and return what `SyncVectorEnv` returns for the same envs,
seeds and actions, in each `AutoresetMode`: ``NEXT_STEP`` (the default: an env that ended is reset by the following
`step`, whose action for it is ignored), ``SAME_STEP`` (reset within the step that ended it, the last observation
and info in ``infos["final_obs"]`` / ``infos["final_info"]``) and ``DISABLED`` (the caller resets ended envs with
``reset(options={"reset_mask": mask})``, which resets only the masked envs and keeps the others' episodes).
`step_subset` / `reset_subset` never autoreset: the caller decides when an env starts its next episode (and with
which task).

The garbage collector is paused while a call (`step`, `reset`, `step_subset`, `reset_subset`) runs and restored as
it was after it (`mt_env.collector`): at 256 envs a call holds all their new objects at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.error import ResetNeeded
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from .collector import collector_paused
from .env import ToolEnv


class ToolVectorEnv(VectorEnv):
    """N `ToolEnv`s stepped concurrently in one event loop (see the module docstring).

    Args:
        env_fns: callables creating the envs, or
        env_id: a registered id, with `num_envs` and `env_kwargs` for `gym.make`.
        autoreset_mode: an `AutoresetMode` (or its value, e.g. ``"SameStep"``); default ``NEXT_STEP``.

    Example (text mode, no tokenizer; `gym.make_vec` builds a `ToolVectorEnv` for mt_env's ids)::

        >>> import gymnasium as gym
        >>> import mt_env  # registers the envs
        >>> envs = gym.make_vec("Calculator-v0", num_envs=2)
        >>> envs
        ToolVectorEnv(Calculator-v0, num_envs=2)
        >>> obs, infos = envs.reset(seed=42)
        >>> print(obs["text"][0])
        system: Use the calculator tool, then give the answer.
        <BLANKLINE>
        user: What is 180 * 796?
        >>> call = '<tool_call>{"name": "calculator", "arguments": {"expression": "180 * 796"}}</tool_call>'
        >>> obs, rewards, terminations, truncations, infos = envs.step([call, "I do not know."])
        >>> obs["text"], rewards, terminations
        (('tool: 143280', ''), array([0., 0.]), array([False,  True]))
        >>> obs, rewards, terminations, truncations, infos = envs.step(["It is 143280.", "(ignored: a reset)"])
        >>> rewards, terminations, infos["end_reason"], infos["_end_reason"]
        (array([1., 0.]), array([ True, False]), array(['answered', None], dtype=object), array([ True, False]))
        >>> envs.close()
    """

    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP, "render_modes": ["ansi", "html"]}

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]] | None = None, *, env_id: str | None = None,
                 num_envs: int | None = None, autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
                 **env_kwargs: Any):
        if env_fns is None:
            if env_id is None or not num_envs:
                raise ValueError("give env_fns, or env_id and num_envs")
            env_fns = [lambda: gym.make(env_id, **env_kwargs) for _ in range(num_envs)]
        self.envs = [fn() for fn in env_fns]
        self.base_envs: list[ToolEnv] = [e.unwrapped for e in self.envs]
        if not all(isinstance(e, ToolEnv) for e in self.base_envs):
            raise TypeError("ToolVectorEnv holds ToolEnv environments")
        self.num_envs = len(self.envs)
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.metadata = {**self.envs[0].metadata, "autoreset_mode": self.autoreset_mode}
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.spec = self.envs[0].spec
        self.render_mode = self.envs[0].render_mode
        self._obs: list[dict] = [{"text": "", "input_ids": ()} for _ in range(self.num_envs)]  #: each env's latest
        self._needs_reset = np.zeros(self.num_envs, dtype=bool)  #: envs whose episode ended
        self._loop = asyncio.new_event_loop()

    # ----------------------------------------------------------------------------------------- vector API
    def reset(self, *, seed: int | Sequence[int | None] | None = None, options: dict | None = None):
        """Reset every env, or with ``options={"reset_mask": mask}`` only the masked ones (the others keep their
        episode and their last observation). The other options go to each env's `reset`; the infos are those of the
        envs that were reset."""
        seeds = self._seeds(seed)
        indices = list(range(self.num_envs))
        if options is not None and "reset_mask" in options:
            options = dict(options)
            indices = np.flatnonzero(self._checked_mask(options.pop("reset_mask"))).tolist()
        results = self._run(self.areset_subset(indices, [seeds[i] for i in indices], [options] * len(indices)))
        infos: dict = {}
        for i, (_, info) in zip(indices, results):
            infos = self._add_info(infos, info, i)
        return self._batch_obs(self._obs), infos

    def step(self, actions):
        """One action per env (a sequence, or a dict of batched fields), autoresetting as `autoreset_mode` says."""
        actions = self._per_env(actions)  # checked before any env is touched
        if self.autoreset_mode == AutoresetMode.DISABLED and self._needs_reset.any():
            raise ResetNeeded(f"envs {np.flatnonzero(self._needs_reset).tolist()} have ended: reset them with "
                              "reset(options={'reset_mask': mask}) first (autoreset_mode is disabled)")
        next_step = self.autoreset_mode == AutoresetMode.NEXT_STEP
        resetting_mask = self._needs_reset if next_step else np.zeros(self.num_envs, dtype=bool)
        resetting, stepping = np.flatnonzero(resetting_mask).tolist(), np.flatnonzero(~resetting_mask).tolist()
        reset_results, step_results = self._run(self._reset_and_step(resetting, stepping, actions))
        rewards = np.zeros(self.num_envs)
        terminated = np.zeros(self.num_envs, dtype=bool)
        truncated = np.zeros(self.num_envs, dtype=bool)
        env_infos: list[dict] = [{} for _ in range(self.num_envs)]
        for i, (_, info) in zip(resetting, reset_results):
            env_infos[i] = info
        for i, (_, reward, term, trunc, info) in zip(stepping, step_results):
            rewards[i], terminated[i], truncated[i], env_infos[i] = reward, term, trunc, info
        if self.autoreset_mode == AutoresetMode.SAME_STEP:
            self._reset_ended(np.flatnonzero(terminated | truncated).tolist(), env_infos)
        return self._batch_obs(self._obs), rewards, terminated, truncated, self._batch_infos(env_infos)

    @property
    def np_random_seed(self) -> tuple[int, ...]:
        """Each env's seed (as Gymnasium's vector envs give them)."""
        return tuple(env.np_random_seed for env in self.envs)

    @property
    def np_random(self) -> tuple[np.random.Generator, ...]:
        """Each env's random generator."""
        return tuple(env.np_random for env in self.envs)

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
        indices, actions = list(indices), list(actions)
        if len(indices) != len(actions):
            raise ValueError(f"{len(indices)} envs but {len(actions)} actions")
        steps = [self.base_envs[i].astep(a) for i, a in zip(indices, actions)]
        results = [await steps[0]] if len(steps) == 1 else list(await asyncio.gather(*steps))  # one: no task
        for i, (obs, _, terminated, truncated, _) in zip(indices, results):
            self._obs[i], self._needs_reset[i] = obs, terminated or truncated
        return results

    async def areset_subset(self, indices: Sequence[int], seeds: Sequence[int | None] | None = None,
                            options: Sequence[dict | None] | None = None) -> list[tuple]:
        indices = list(indices)
        seeds = list(seeds) if seeds is not None else [None] * len(indices)
        options = list(options) if options is not None else [None] * len(indices)
        if not len(seeds) == len(options) == len(indices):
            raise ValueError(f"{len(indices)} envs but {len(seeds)} seeds and {len(options)} options")
        resets = [self.base_envs[i].areset(seed=s, options=o) for i, s, o in zip(indices, seeds, options)]
        results = [await resets[0]] if len(resets) == 1 else list(await asyncio.gather(*resets))  # one: no task
        for i, (obs, _) in zip(indices, results):
            self._obs[i], self._needs_reset[i] = obs, False
        return results

    # ----------------------------------------------------------------------------------------- helpers
    async def _reset_and_step(self, resetting: list[int], stepping: list[int], actions: list) -> list[list[tuple]]:
        return await asyncio.gather(self.areset_subset(resetting),
                                    self.astep_subset(stepping, [actions[i] for i in stepping]))

    def _reset_ended(self, ended: list[int], env_infos: list[dict]) -> None:
        """Same-step autoreset: reset the envs that just ended; each one's info becomes its last observation
        (``final_obs``) and step info (``final_info``) plus its reset info, as in Gymnasium."""
        final_obs = [self._obs[i] for i in ended]
        results = self._run(self.areset_subset(ended))
        for i, last, (_, reset_info) in zip(ended, final_obs, results):
            env_infos[i] = {"final_obs": last, "final_info": env_infos[i], **reset_info}

    def _per_env(self, actions: Any) -> list:
        """`step`'s actions as one per env; TypeError/ValueError when they are not one per env."""
        n = self.num_envs
        if isinstance(actions, Mapping):
            for key, field in actions.items():
                if isinstance(field, (str, bytes)) or not hasattr(field, "__len__"):
                    raise TypeError(f"the batched action field {key!r} must hold one value per env ({n}), got "
                                    f"{type(field).__name__}")
                if len(field) != n:
                    raise ValueError(f"expected {n} actions (one per env), but the batched field {key!r} has "
                                     f"{len(field)}")
            return [{key: field[i] for key, field in actions.items()} for i in range(n)]
        if isinstance(actions, (str, bytes)) or not hasattr(actions, "__len__"):
            raise TypeError(f"step takes one action per env ({n}): a sequence, or a dict of batched fields; got "
                            f"{type(actions).__name__}")
        if len(actions) != n:
            raise ValueError(f"expected {n} actions (one per env), got {len(actions)}")
        return list(actions)

    def _checked_mask(self, mask: Any) -> np.ndarray:
        """A reset mask as Gymnasium's `SyncVectorEnv` accepts it, with its error messages."""
        if not isinstance(mask, np.ndarray):
            raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(mask)}")
        if mask.shape != (self.num_envs,):
            raise ValueError(f"`options['reset_mask']` must have shape `({self.num_envs},)`, got {mask.shape}")
        if mask.dtype != np.bool_:
            raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}")
        if not mask.any():
            raise ValueError("`options['reset_mask']` must contain a boolean array with at least one True value, "
                             f"got reset_mask={mask}")
        return mask

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
        with collector_paused():
            return self._loop.run_until_complete(coro)
