"""Gymnasium envs: the checker, gym.make/make_vec, episodes in text and token mode, bad input, tool lifecycle,
vector subset stepping, record/replay and SFT export."""

from __future__ import annotations

import asyncio
import json

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import ResetNeeded
from gymnasium.utils.env_checker import check_env

import mt_env  # noqa: F401  (registers the envs)
from envs.calculator import CalculatorEnv
from envs.gsm8k.data import make_row
from envs.gsm8k.env import GSM8kToolEnv
from envs.gsm8k.tool import Gsm8kTool, extract_final_answer
from mt_env.errors import MtEnvError
from mt_env.info import ResetInfo, StepInfo, ToolReport
from mt_env.parsers import HermesParser, ToolCall
from mt_env.sample import Seg
from mt_env.tools import BaseTool
from mt_env.turn import ModelTurn
from mt_env.vector import ToolVectorEnv
from mt_env.wrappers import RecordEpisodes, ReplayTools, episode_actions, load_episodes, sft_trace

from .conftest import SHARED_GSM8K


def call(name, **arguments):
    return HermesParser.format_turn([ToolCall(name, arguments)])


def gsm8k_dir():
    if not (SHARED_GSM8K / "train.jsonl").is_file():
        pytest.skip(f"GSM8K data not found at {SHARED_GSM8K} (../shared is absent)")
    return str(SHARED_GSM8K)


def play_demo(env, seed=0):
    obs, info = env.reset(seed=seed)
    task = env.unwrapped.task
    turns = env.unwrapped.demonstration(task, np.random.default_rng(0))
    total = 0.0
    for text in turns[::2]:
        obs, reward, terminated, truncated, info = env.step(text)
        total += reward
    return total, terminated, truncated, info


# --------------------------------------------------------------------------------------------- checker and make
@pytest.mark.parametrize("tokenizer", [None, "offline:qwen2.5"])
def test_calculator_passes_gymnasium_checker(tokenizer):
    check_env(gym.make("Calculator-v0", tokenizer=tokenizer).unwrapped, skip_render_check=True)


@pytest.mark.parametrize("tokenizer", [None, "offline:qwen2.5"])
def test_gsm8k_passes_gymnasium_checker(tokenizer):
    check_env(gym.make("GSM8kTool-v0", data_path=gsm8k_dir(), tokenizer=tokenizer).unwrapped, skip_render_check=True)


def test_gsm8k_without_data_says_how_to_provide_it(tmp_path, monkeypatch):
    monkeypatch.delenv("MT_ENV_GSM8K", raising=False)
    with pytest.raises(MtEnvError, match="data_path"):
        gym.make("GSM8kTool-v0", data_path=str(tmp_path / "missing"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MtEnvError, match=r"offline: pass data_path=.*MT_ENV_GSM8K"):
        gym.make("GSM8kTool-v0")


def test_text_episode_end_to_end():
    env = gym.make("Calculator-v0")
    total, terminated, truncated, info = play_demo(env)
    assert (total, terminated, truncated) == (1.0, True, False)
    assert info["final_reward"] == 1.0 and info["episode"]["tool_calls"] == 1 and info["end_reason"] == "answered"
    with pytest.raises(ResetNeeded):
        env.step("again")


@pytest.mark.parametrize("tokenizer", [None, "offline:qwen2.5"])
def test_info_dicts_hold_the_keys_their_typed_dicts_name(tokenizer):
    """`ResetInfo` and `StepInfo` say what `reset` and `step` return: every required key on every step, the tool
    keys on a step that called tools, the end keys on the last step, and no key they do not name."""
    env = gym.make("Calculator-v0", tokenizer=tokenizer).unwrapped
    _, info = env.reset(seed=0)
    assert set(info) == ResetInfo.__required_keys__ and not ResetInfo.__optional_keys__
    turns = env.demonstration(env.task, np.random.default_rng(0))[::2]
    infos = [env.step(text)[4] for text in turns]
    tool_keys = {"tool_results", "tool_errors"}
    end_keys = StepInfo.__optional_keys__ - tool_keys
    for i, info in enumerate(infos):
        assert StepInfo.__required_keys__ <= set(info) <= StepInfo.__required_keys__ | StepInfo.__optional_keys__
        assert (tool_keys <= set(info)) == bool(info["tool_calls"] or info["parse_errors"])
        assert set(info) & end_keys == (end_keys if i == len(infos) - 1 else set())
    assert infos[0]["tool_results"][0].keys() == ToolReport.__required_keys__


def test_token_episode_gives_template_deltas_and_training_samples(qwen25):
    env = gym.make("Calculator-v0", tokenizer=qwen25).unwrapped
    obs, info = env.reset(seed=3)
    fmt = env.conversation.fmt
    assert list(obs["input_ids"]) == fmt.encode(fmt.render(info["messages"], add_generation_prompt=True))
    assert [t["function"]["name"] for t in info["tools"]] == ["calculator"]
    ids = list(obs["input_ids"])
    turn = fmt.encode(call("calculator", expression=env.task["expression"])) + [fmt.end_of_turn_id]
    obs, reward, terminated, truncated, info = env.step({"token_ids": turn, "finish_reason": 0})
    assert not (terminated or truncated)
    assert fmt.decode(obs["input_ids"]).startswith("\n<|im_start|>user\n<tool_response>\n")
    assert obs["text"] == fmt.decode(obs["input_ids"])
    ids += turn + list(obs["input_ids"])
    assert ids == env.conversation.context_ids  # appending observations reproduces the context exactly
    answer = fmt.encode(f"The answer is {env.task['answer']}.") + [fmt.end_of_turn_id]
    obs, reward, terminated, truncated, info = env.step(ModelTurn(ids=answer, logprobs=[-0.5] * len(answer)))
    assert terminated and reward == 1.0
    (sample,) = env.conversation.samples()
    assert sum(sample.loss_mask()) == len(turn) + len(answer)
    assert sample.rewards[-1] == 1.0 and sample.episode_reward == 1.0
    assert env.conversation.messages[2]["tool_calls"][0]["id"] == env.conversation.messages[3]["tool_call_id"]
    rendered = env.render() if env.render_mode else env.conversation.render_html()
    assert "sampled" in rendered


def test_per_turn_observations_are_the_new_context(qwen3):
    """In per_turn mode each turn starts a new sample whose prompt the template re-renders: the observation is
    that whole context, the same ids as `conversation.context_ids` (what a driver sends) — no other channel."""
    env = gym.make("Calculator-v0", tokenizer=qwen3, mode="per_turn").unwrapped
    obs, _ = env.reset(seed=3)
    fmt = env.conversation.fmt
    assert list(obs["input_ids"]) == env.conversation.context_ids
    turn = fmt.encode("<think>\nhmm\n</think>\n\n" + call("calculator", expression=env.task["expression"]))
    obs, _, terminated, truncated, info = env.step({"token_ids": turn + [fmt.end_of_turn_id], "finish_reason": 0})
    assert not (terminated or truncated) and "replace_context" not in info
    context = env.conversation.context_ids
    assert list(obs["input_ids"]) == context and len(env.conversation.samples_) == 2
    assert context == fmt.encode(fmt.render(env.conversation.template_messages, add_generation_prompt=True))
    assert obs["text"] == fmt.decode(context)


@pytest.mark.parametrize("tokenizer", [None, "offline:qwen2.5"])
def test_rewards_have_one_record(tokenizer):
    """Step rewards and the final reward are recorded once (the conversation in token mode); the episode summary,
    the step returns and the training samples all agree with it."""
    env = gym.make("GSM8kTool-v0", tokenizer=tokenizer, data_path=gsm8k_dir()).unwrapped
    env.reset(options={"task": make_row("Tom has 3 apples and buys 4 more. How many?", "3+4=7\n#### 7", 0)})
    check = call("calc_gsm8k_reward", answer="6")
    returns = [env.step(check)[1], env.step(check)[1]]  # the repeated wrong check is penalised
    _, reward, terminated, _, info = env.step("#### 7")
    returns.append(reward)
    stats = info["episode"]
    assert terminated and returns == [0.0, -0.05, 1.0] and stats["step_reward"] == pytest.approx(-0.05)
    assert stats["total_reward"] == pytest.approx(sum(returns)) == pytest.approx(env.episode_stats()["total_reward"])
    assert stats["final_reward"] == info["final_reward"] and stats["turns"] == 3
    if env.conversation is not None:
        assert env.conversation.total_reward == pytest.approx(stats["total_reward"])
        (sample,) = env.conversation.samples()
        assert sum(sample.rewards) == pytest.approx(stats["total_reward"]) == pytest.approx(sample.episode_reward)
    assert sft_trace(env)["reward"] == pytest.approx(stats["total_reward"])


def test_render_modes(qwen25):
    env = gym.make("Calculator-v0", tokenizer=qwen25, render_mode="ansi")
    env.reset(seed=0)
    env.step(call("calculator", expression="2*3"))
    assert "\x1b[" in env.render()
    env = gym.make("Calculator-v0", render_mode="html")
    env.reset(seed=0)
    assert env.render().startswith("<pre>")


def test_seeds_reproduce_tasks():
    env = gym.make("Calculator-v0")
    a = [env.reset(seed=s)[0]["text"] for s in (1, 2, 1)]
    assert a[0] == a[2] != a[1]


# --------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("turn,kind", [
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"\n</tool_call>', "parse"),
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression"', "parse"),  # cut by length
    (call("search", query="x"), "unknown_tool"),
    (call("calculator", expression=12), "invalid_arguments"),
    (call("calculator", expression="1" * 1_000_000), "parse"),
    (call("calculator", expression="1/0"), "exception"),
])
def test_bad_tool_calls_become_error_observations(turn, kind):
    env = gym.make("Calculator-v0")
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(turn)
    assert not (terminated or truncated)
    assert obs["text"].startswith("tool: Error:")
    kinds = [r["error_kind"] for r in info.get("tool_results", [])]
    assert kinds == [kind] or (kind == "parse" and info["parse_errors"])
    assert info["tool_errors"] == 1


@pytest.mark.parametrize("tokenizer", [None, "offline:qwen2.5"])
def test_control_characters_and_invalid_utf8_from_the_model(tokenizer):
    env = gym.make("Calculator-v0", tokenizer=tokenizer).unwrapped
    env.reset(seed=0)
    if tokenizer is None:
        env.step("\x00\x1b[31m\ufffd\ud800"[:3] + "\ufffd <tool_call>\x07")
    else:
        fmt = env.conversation.fmt
        broken = fmt.encode("é")[:1] + fmt.encode("\x00\x07 <tool_call>")  # half a UTF-8 character, controls
        obs, *_ = env.step({"token_ids": broken, "finish_reason": 1})
        assert env.conversation.turns[0].ids == broken
    assert env.episode_stats()["parse_errors"] == 1


class FlakyTool(BaseTool):
    """Raises, hangs or answers depending on its argument."""

    def __init__(self, config=None):
        super().__init__({"timeout": 0.05, **(config or {})}, {"type": "function", "function": {
            "name": "flaky", "description": "misbehaves", "parameters": {
                "type": "object", "properties": {"mode": {"type": "string"}}, "required": ["mode"]}}})
        self.created = self.released = 0

    async def create(self, instance_id=None, **kw):
        self.created += 1
        return await super().create(instance_id, **kw)

    async def execute(self, instance_id, arguments, **kw):
        if arguments["mode"] == "raise":
            raise RuntimeError("boom")
        if arguments["mode"] == "hang":
            await asyncio.sleep(10)
        return "fine", 0.0, {}

    async def release(self, instance_id, **kw):
        self.released += 1


def test_tool_that_raises_or_hangs_is_an_observation_not_a_crash():
    tool = FlakyTool()
    env = CalculatorEnv(tools=[tool])
    env.reset(seed=0)
    obs, _, terminated, truncated, info = env.step(call("flaky", mode="raise") + "\n" + call("flaky", mode="hang"))
    assert not (terminated or truncated)
    assert [r["error_kind"] for r in info["tool_results"]] == ["exception", "timeout"]
    assert "boom" in obs["text"] and "timed out" in obs["text"]


def test_tool_error_can_end_the_episode():
    env = CalculatorEnv(tools=[FlakyTool({"on_error": "end_episode"})])
    env.reset(seed=0)
    _, _, terminated, _, info = env.step(call("flaky", mode="raise"))
    assert terminated and "end_episode" in info["end_reason"]


def test_tools_are_released_at_episode_end_on_reset_and_on_close():
    tool = FlakyTool()
    env = CalculatorEnv(tools=[tool])
    env.reset(seed=0)
    env.step(call("flaky", mode="ok"))
    env.reset(seed=1)  # mid-episode reset
    assert (tool.created, tool.released) == (2, 1)
    env.step("done")  # answered: episode ends
    assert tool.released == 2
    env.reset(seed=2)
    env.close()
    assert tool.created == tool.released == 3
    assert env.tool_counts == {"created": 3, "released": 3}


def test_turn_limit_truncates():
    env = gym.make("Calculator-v0", max_turns=2)
    env.reset(seed=0)
    assert env.step(call("calculator", expression="1+1"))[3] is False
    _, _, terminated, truncated, info = env.step(call("calculator", expression="1+1"))
    assert truncated and not terminated and "turn limit" in info["end_reason"]


def test_token_budget_truncates(qwen25):
    env = gym.make("Calculator-v0", tokenizer=qwen25, budget={"max_response_tokens": 30}).unwrapped
    env.reset(seed=0)
    fmt = env.conversation.fmt
    turn = fmt.encode(call("calculator", expression="123 * 456")) + [fmt.end_of_turn_id]
    _, _, terminated, truncated, info = env.step(turn)
    assert truncated and not terminated and "budget" in info["end_reason"]
    assert env.conversation.response_len <= 30


# --------------------------------------------------------------------------------------------- GSM8K
def test_calc_gsm8k_reward_scores_penalizes_repeats_and_interaction_asks_again():
    row = make_row("Tom has 3 apples and buys 4 more. How many?", "3+4=7\n#### 7", 0)
    env = GSM8kToolEnv(data_path=gsm8k_dir(), interaction=True)
    obs, info = env.reset(options={"task": row})
    assert "Tom has 3 apples" in obs["text"]
    _, r1, *_ , i1 = env.step(call("calc_gsm8k_reward", answer="6"))
    _, r2, *_ , i2 = env.step(call("calc_gsm8k_reward", answer="6"))
    assert (r1, r2) == (0.0, -0.05) and "not correct" in i2["messages"][0]["content"]
    obs, _, terminated, _, info = env.step("I think #### 6")
    assert not terminated and "not correct" in obs["text"]  # the interaction turn
    _, r, terminated, _, info = env.step("Sorry: #### 7")
    assert terminated and info["final_reward"] == 1.0 and r == 1.0
    assert extract_final_answer("so #### 1,234") == "1234"


def test_gsm8k_reads_shared_data_and_verl_shaped_rows():
    env = gym.make("GSM8kTool-v0", data_path=gsm8k_dir(), split="test").unwrapped
    assert len(env.rows) == 1319
    obs, info = env.reset(options={"index": 5})
    assert info["sample_id"] == "gsm8k-test-5"
    kwargs = env.rows[5]["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"]
    assert kwargs["ground_truth"] == env.rows[5]["reward_model"]["ground_truth"]


def test_tool_selection_decides_the_prompt_schemas(qwen25):
    tools = [Gsm8kTool(), FlakyTool()]
    env = CalculatorEnv(tools=tools, tokenizer=qwen25)
    row = CalculatorEnv.task_for([12, 34])
    row["tools"] = ["flaky"]
    obs, info = env.reset(options={"task": row})
    assert [t["function"]["name"] for t in info["tools"]] == ["flaky"]
    assert '"name": "flaky"' in obs["text"] and "calc_gsm8k_reward" not in obs["text"]
    _, _, _, _, info = env.step(call("calc_gsm8k_reward", answer="1"))
    assert info["tool_results"][0]["error_kind"] == "unknown_tool"  # not selected: cannot be called either


# --------------------------------------------------------------------------------------------- vector envs
@pytest.mark.parametrize("mode", ["sync", "vector_entry_point"])
def test_make_vec_with_autoreset(mode):
    envs = gym.make_vec("Calculator-v0", num_envs=3, vectorization_mode=mode)
    obs, info = envs.reset(seed=0)
    assert len(obs["text"]) == 3
    obs, rewards, terminated, truncated, info = envs.step(["The answer is 1."] * 3)
    assert terminated.all() and (rewards == 0).all()
    obs, rewards, terminated, truncated, info = envs.step(["ignored"] * 3)  # next-step autoreset
    assert not terminated.any() and all("What is" in t for t in obs["text"])
    envs.close()


def test_vector_env_steps_a_subset_and_runs_tools_concurrently():
    class Together(FlakyTool):
        """Answers once three calls are running at once: calls run one after another time out instead."""

        def __init__(self, config=None):
            super().__init__(config)
            self.running, self.all_in = 0, asyncio.Event()

        async def execute(self, instance_id, arguments, **kw):
            self.running += 1
            if self.running == 3:
                self.all_in.set()
            await self.all_in.wait()
            return "together", 0.0, {}

    tool = Together({"timeout": 5})
    envs = ToolVectorEnv([lambda: CalculatorEnv(tools=[tool]) for _ in range(8)])
    envs.reset(seed=0)
    results = envs.step_subset([1, 4, 6], [call("flaky", mode="x")] * 3)
    assert [r[0]["text"] for r in results] == ["tool: together"] * 3
    assert [e.turn for e in envs.base_envs] == [0, 1, 0, 0, 1, 0, 1, 0]
    envs.close()


# --------------------------------------------------------------------------------------------- record / replay
def test_record_and_replay_give_the_same_episode(tmp_path):
    path = tmp_path / "episodes.jsonl"
    env = RecordEpisodes(gym.make("Calculator-v0"), path)
    total, *_ = play_demo(env, seed=4)
    env.close()
    (episode,) = load_episodes(path)
    assert episode["complete"] and episode["steps"][0]["tool_results"][0]["text"] == str(episode["task"]["answer"])

    replay = ReplayTools(CalculatorEnv(tools=[]), path)  # no real calculator: answers come from the recording
    replay.reset()
    rewards = []
    for action in episode_actions(episode):
        obs, r, term, trunc, info = replay.step(action)
        rewards.append(r)
    assert sum(rewards) == total == 1.0 and term


def test_sft_trace_re_renders_to_the_sampled_tokens(qwen25):
    env = gym.make("Calculator-v0", tokenizer=qwen25).unwrapped
    play_demo(env)
    trace = sft_trace(env)
    json.dumps(trace)
    fmt = env.conversation.fmt
    ids = fmt.encode(fmt.render(trace["messages"], add_generation_prompt=False))
    assert ids[: len(env.conversation.context_ids)] == env.conversation.context_ids
    assert trace["tool_calls"][0][0]["function"]["name"] == "calculator" and trace["reward"] == 1.0
    kinds = {s.kind for s in env.conversation.current.segments}
    assert Seg.OBSERVATION in kinds
