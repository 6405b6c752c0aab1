"""`ToolVectorEnv` against Gymnasium's own vector-env checks and step for step against `SyncVectorEnv`: autoreset
modes, partial resets with ``reset_mask``, seeding, and the number of actions per step."""

from __future__ import annotations

import gc
import re
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import ResetNeeded
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import mt_env  # noqa: F401  (registers the envs)
from envs.calculator import CalculatorEnv
from mt_env.parsers import HermesParser, ToolCall
from mt_env.vector import ToolVectorEnv

CALL = HermesParser.format_turn([ToolCall("calculator", {"expression": "2 * 3"})])
ANSWER = "The answer is 5."
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


def both(n: int, mode: AutoresetMode, env_fn=CalculatorEnv) -> tuple[ToolVectorEnv, SyncVectorEnv]:
    return (ToolVectorEnv([env_fn] * n, autoreset_mode=mode), SyncVectorEnv([env_fn] * n, autoreset_mode=mode))


def actions_at(t: int, n: int) -> list[str]:
    """Env i answers (ending its episode) every third step, shifted by i, and calls the calculator otherwise."""
    return [ANSWER if (t + i) % 3 == 2 else CALL for i in range(n)]


def is_prompt(text: str) -> bool:
    return "user: What is" in text


def without_timings(infos):
    """Infos minus tool durations, the only part that differs between two runs of the same episode."""
    if isinstance(infos, dict):
        return {k: without_timings(v) for k, v in infos.items() if k not in ("tool_results", "_tool_results")}
    return infos


def assert_same(ours, theirs):
    for mine, gyms in zip(ours, theirs, strict=True):
        if isinstance(mine, dict):
            mine, gyms = without_timings(mine), without_timings(gyms)
        assert data_equivalence(mine, gyms), (mine, gyms)


# Gymnasium tests/vector/test_vector_env.py (test_vector_env_equal: two vectorizations step for step) and
# tests/vector/test_autoreset_mode.py (every autoreset mode; with autoreset disabled the caller resets the ended envs
# through reset_mask, as test_autoreset_disabled does).
@pytest.mark.parametrize("mode", MODES)
def test_steps_equal_sync_vector_env(mode):
    ours, theirs = both(3, mode)
    assert ours.metadata["autoreset_mode"] == theirs.metadata["autoreset_mode"] == mode
    assert_same(ours.reset(seed=0), theirs.reset(seed=0))
    for t in range(8):
        ours_out, theirs_out = ours.step(actions_at(t, 3)), theirs.step(actions_at(t, 3))
        assert_same(ours_out, theirs_out)
        ended = ours_out[2] | ours_out[3]
        if mode == AutoresetMode.DISABLED and ended.any():
            assert_same(ours.reset(options={"reset_mask": ended}), theirs.reset(options={"reset_mask": ended}))
    ours.close()
    theirs.close()


# Gymnasium tests/vector/test_autoreset_mode.py, test_autoreset_next_step / _within_step / _disabled: what the step
# after an episode's end returns in each mode.
def test_autoreset_modes():
    envs = ToolVectorEnv([CalculatorEnv] * 2)  # next step: the ended env's action is ignored, it restarts
    obs, _ = envs.reset(seed=0)
    *_, terminated, _, _ = envs.step([ANSWER, CALL])
    assert terminated.tolist() == [True, False]
    obs, rewards, terminated, truncated, infos = envs.step([CALL, CALL])
    assert rewards.tolist() == [0.0, 0.0] and not (terminated.any() or truncated.any())
    assert is_prompt(obs["text"][0]) and obs["text"][1] == "tool: 6"
    assert infos["_sample_id"].tolist() == [True, False] and infos["_turn"].tolist() == [False, True]

    envs = ToolVectorEnv([CalculatorEnv] * 2, autoreset_mode="SameStep")  # reset within the ending step
    first, _ = envs.reset(seed=0)
    envs.step([CALL, CALL])
    obs, _, terminated, _, infos = envs.step([ANSWER, CALL])
    assert terminated.tolist() == [True, False] and is_prompt(obs["text"][0])
    assert infos["_final_obs"].tolist() == [True, False] and infos["final_obs"][1] is None
    assert infos["final_obs"][0] == {"text": "", "input_ids": ()}
    assert infos["final_info"]["end_reason"][0] == "answered" and infos["final_info"]["_end_reason"].tolist() == [
        True, False]

    envs = ToolVectorEnv([CalculatorEnv] * 2, autoreset_mode=AutoresetMode.DISABLED)  # the caller resets
    envs.reset(seed=0)
    *_, terminated, _, _ = envs.step([ANSWER, CALL])
    with pytest.raises(ResetNeeded, match=r"envs \[0\] have ended: reset them with reset\(options=\{'reset_mask'"):
        envs.step([CALL, CALL])
    obs, infos = envs.reset(options={"reset_mask": terminated})
    assert is_prompt(obs["text"][0]) and obs["text"][1] == "tool: 6"
    assert infos["_sample_id"].tolist() == [True, False]
    assert [e.turn for e in envs.base_envs] == [0, 1]


class RecordsOptions(CalculatorEnv):
    async def areset(self, *, seed=None, options=None):
        self.options_seen = options
        return await super().areset(seed=seed, options=options)


# Gymnasium tests/vector/test_vector_env.py, test_partial_reset: only the masked envs are reset (with their seeds),
# the others keep their episode and their observation.
@pytest.mark.parametrize("mode", MODES)
def test_partial_reset(mode):
    envs = ToolVectorEnv([RecordsOptions] * 3, autoreset_mode=mode)
    reset_obs, _ = envs.reset(seed=[0, 1, 2])
    envs.step([CALL] * 3)
    step_obs, *_ = envs.step([CALL] * 3)
    options = {"reset_mask": np.array([True, True, False]), "episode": 7}
    obs, infos = envs.reset(seed=[0, 1, 0], options=options)
    assert obs["text"][:2] == reset_obs["text"][:2] and obs["text"][2] == step_obs["text"][2] == "tool: 6"
    assert [e.turn for e in envs.base_envs] == [0, 0, 2] and infos["_sample_id"].tolist() == [True, True, False]
    assert [e.options_seen for e in envs.base_envs] == [{"episode": 7}, {"episode": 7}, None]  # no mask inside
    assert "reset_mask" in options  # the caller's dict is left as it was
    *_, truncated, _ = envs.step([CALL] * 3)  # env 2 goes on: its third turn is the Calculator's last
    assert truncated.tolist() == [False, False, True]


# Gymnasium tests/vector/test_vector_env.py, test_partial_reset_failure: a bad mask is refused with the messages of
# Gymnasium's SyncVectorEnv.
@pytest.mark.parametrize("mask, error, message", [
    (np.array([True]), ValueError, "`options['reset_mask']` must have shape `(3,)`, got (1,)"),
    (np.array([True, True, False, False]), ValueError, "`options['reset_mask']` must have shape `(3,)`, got (4,)"),
    (np.array([[True, True, True]]), ValueError, "`options['reset_mask']` must have shape `(3,)`, got (1, 3)"),
    (np.array([False, False, False]), ValueError, "`options['reset_mask']` must contain a boolean array with at "
                                                  "least one True value, got reset_mask=[False False False]"),
    (np.array([1, 1, 0]), TypeError, "`options['reset_mask']` must have `dtype=np.bool_`, got int64"),
    (np.array([1.0, 1.0, 0.0]), TypeError, "`options['reset_mask']` must have `dtype=np.bool_`, got float64"),
    ([True, True, False], TypeError, "`options['reset_mask']` must be a numpy array, got <class 'list'>"),
])
def test_bad_reset_masks(mask, error, message):
    ours, theirs = both(3, AutoresetMode.DISABLED)
    for envs in (ours, theirs):
        envs.reset(options={"reset_mask": np.array([True, True, True])})
        with pytest.raises(error, match=re.escape(message)):
            envs.reset(options={"reset_mask": mask})


# Gymnasium tests/vector/test_vector_env.py, test_random_seeding_basics and test_random_seeds_set_at_retrieval.
def test_seeding():
    ours, theirs = both(3, AutoresetMode.NEXT_STEP)
    assert len(set(ours.np_random_seed)) == 3
    for envs in (ours, theirs):
        envs.reset(seed=42)
        assert envs.np_random_seed == (42, 43, 44)
        envs.reset(seed=None)  # no seed: the generators go on
        assert envs.np_random_seed == (42, 43, 44)
    assert [g.bit_generator.state for g in ours.np_random] == [g.bit_generator.state for g in theirs.np_random]


# Gymnasium tests/vector/test_vector_env.py, test_action_count_compatibility: one action per env, or a clear error
# before any env is touched (and no coroutine left unawaited).
@pytest.mark.parametrize("actions, error, message", [
    ([CALL] * 2, ValueError, "expected 3 actions (one per env), got 2"),
    ([CALL] * 4, ValueError, "expected 3 actions (one per env), got 4"),
    (CALL, TypeError, "step takes one action per env (3): a sequence, or a dict of batched fields; got str"),
    (0, TypeError, "got int"),
    ({"token_ids": [[1]] * 2, "finish_reason": [0] * 3}, ValueError,
     "expected 3 actions (one per env), but the batched field 'token_ids' has 2"),
    ({"token_ids": [[1]] * 3, "finish_reason": 0}, TypeError, "the batched action field 'finish_reason' must hold"),
])
def test_the_number_of_actions_is_checked(actions, error, message):
    envs = ToolVectorEnv([CalculatorEnv] * 3)
    envs.reset(seed=0)
    envs.step([ANSWER, CALL, CALL])  # env 0 is due for its autoreset
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(error, match=re.escape(message)):
            envs.step(actions)
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
    assert [e.turn for e in envs.base_envs] == [1, 1, 1]  # nothing was reset or stepped
    obs, *_ = envs.step([CALL] * 3)
    assert [e.turn for e in envs.base_envs] == [0, 2, 2] and is_prompt(obs["text"][0])


# Gymnasium tests/vector/test_autoreset_mode.py, test_autoreset_metadata and test_make_vec_autoreset.
@pytest.mark.parametrize("mode", MODES)
def test_make_vec_takes_the_autoreset_mode(mode):
    for given in (mode, mode.value):
        envs = gym.make_vec("Calculator-v0", num_envs=2, autoreset_mode=given)
        assert isinstance(envs, ToolVectorEnv) and envs.metadata["autoreset_mode"] == mode
        envs.close()


def test_subset_steps_share_the_vector_state():
    """An episode ended by `step_subset` is autoreset by the next `step`; `reset_subset` clears it."""
    envs = ToolVectorEnv([CalculatorEnv] * 2)
    envs.reset(seed=0)
    ((_, _, terminated, _, _),) = envs.step_subset([1], [ANSWER])
    assert terminated
    obs, rewards, *_ = envs.step([CALL, CALL])
    assert obs["text"][0] == "tool: 6" and is_prompt(obs["text"][1]) and rewards[1] == 0.0
    envs.step_subset([0], [ANSWER])
    envs.reset_subset([0])
    obs, *_ = envs.step([CALL, CALL])
    assert obs["text"] == ("tool: 6", "tool: 6")


def test_envs_with_one_tokenizer_and_tool_set_share_their_chat_format(qwen25):
    """The prompt's repeated pieces (system prompt, tool schemas) are encoded and kept once, not once per env."""
    envs = ToolVectorEnv([lambda: CalculatorEnv(tokenizer=qwen25)] * 3)
    envs.reset(seed=0)
    formats = [env.conversation.fmt for env in envs.base_envs]
    assert formats[0] is formats[1] is formats[2]
    envs.close()


class RecordsCollector(CalculatorEnv):
    """Notes whether the garbage collector is on while it resets and steps."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.collector_on: list[bool] = []

    async def areset(self, **kwargs):
        self.collector_on.append(gc.isenabled())
        return await super().areset(**kwargs)

    async def astep(self, action):
        self.collector_on.append(gc.isenabled())
        return await super().astep(action)


@pytest.mark.parametrize("collector_on", [True, False])
def test_a_vector_call_pauses_the_collector_and_restores_it(collector_on):
    """Every vector call runs with the collector off and leaves it as it found it, also when the call raises."""
    envs = ToolVectorEnv([RecordsCollector] * 2)
    was_on = gc.isenabled()
    try:
        gc.enable() if collector_on else gc.disable()
        envs.reset(seed=0)
        envs.step([CALL, CALL])
        envs.reset_subset([1])
        envs.step_subset([0], [ANSWER])
        assert gc.isenabled() == collector_on
        with pytest.raises(ResetNeeded):
            envs.step_subset([0], [CALL])  # its episode has ended
        assert gc.isenabled() == collector_on
    finally:
        gc.enable() if was_on else gc.disable()
    assert [env.collector_on for env in envs.base_envs] == [[False] * 4, [False] * 3]
    envs.close()


def test_a_subset_step_touches_only_its_envs():
    """`step_subset` / `reset_subset` do work for the envs they name, not for all of the vector env's."""
    envs = ToolVectorEnv([RecordsCollector] * 5)
    envs.reset_subset([1, 3])
    envs.step_subset([3], [CALL])
    assert [len(env.collector_on) for env in envs.base_envs] == [0, 1, 0, 2, 0]
    envs.close()
