"""GSM8K scoring in both reward styles, over the same episodes: mt_env's lenient rules and verl's exact ones.

The ``verl`` expectations follow verl's published code: ``verl/tools/gsm8k_tool.py`` (`Gsm8kTool.execute` scores
``"#### " + str(answer)`` with the flexible rule and returns -0.05 unless the score is above the previous call's,
starting from 0.0) and ``verl/utils/reward_score/gsm8k.py`` (`extract_solution` / `compute_score`: the last 300
characters; strict: the number after the last ``"#### "``, commas and ``$`` removed; flexible: the last number as
written; compared with the ground truth as strings), whose strict score of the response is verl's training reward.
"""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest

import mt_env  # noqa: F401  (registers the envs)
from envs.gsm8k.data import make_row
from envs.gsm8k.env import GSM8kToolEnv
from envs.gsm8k.tool import (TOOL_NAME, Gsm8kTool, extract_final_answer, normalize_number, verl_extract_answer,
                             verl_score)
from mt_env.errors import ToolConfigError
from mt_env.parsers import HermesParser, ToolCall
from mt_env.tool_config import load_tools


def check(answer) -> str:
    return HermesParser.format_turn([ToolCall(TOOL_NAME, {"answer": answer})])


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "How many?", "answer": "#### 1"}) + "\n")
    return str(path)


# truth, the answers checked with the tool, the final answer, then per style: (step rewards, final reward).
EPISODES = [
    ("72", ["72"], "#### 72", ([0.0], 1.0), ([0.0], 1.0)),
    # a wrong first check costs 0.05 in verl (0.0 is not above the starting 0.0), nothing in mt_env
    ("72", ["70", "70", "72"], "So the answer is 72.", ([0.0, -0.05, 0.0], 1.0), ([-0.05, -0.05, 0.0], 0.0)),
    # numbers: verl compares strings ("72.0" is wrong, "$72" reads as 72); mt_env compares values
    ("72", [72, "72.0", "$72"], "#### 72.0", ([0.0, -0.05, -0.05], 1.0), ([0.0, -0.05, 0.0], 0.0)),
    # verl: the flexible rule keeps the comma ("1,234" is wrong), the strict one drops it
    ("1,234", ["1,234"], "#### 1,234", ([0.0], 1.0), ([-0.05], 1.0)),
    # verl's penalty compares with the previous call, mt_env's with the best so far
    ("5", ["5", "4", "5"], "#### 5", ([0.0, -0.05, -0.05], 1.0), ([0.0, -0.05, 0.0], 1.0)),
    # integers above 2**53 that differ (equal as floats), and decimals written differently
    ("9007199254740993", ["9007199254740992"], "#### 9007199254740992", ([0.0], 0.0), ([-0.05], 0.0)),
    ("0.1", ["0.10"], "#### .1", ([0.0], 1.0), ([-0.05], 0.0)),
    # verl's strict rule: "#### " then the number, within the last 300 characters; a trailing dot is part of it
    ("72", [], "#### 72" + " (checked)" * 30, ([], 1.0), ([], 0.0)),
    ("72", [], "The answer is #### 72.", ([], 1.0), ([], 0.0)),
    ("72", ["#### 72"], "####72", ([0.0], 1.0), ([0.0], 0.0)),
]


@pytest.mark.parametrize("style", ["lenient", "verl"])
@pytest.mark.parametrize("truth, answers, final, lenient, verl", EPISODES)
def test_both_styles_score_the_same_episodes(data, style, truth, answers, final, lenient, verl):
    env = gym.make("GSM8kTool-v0", data_path=data, reward_style=style)
    env.reset(options={"task": make_row("How many?", f"... #### {truth}", 0)})
    steps = []
    for answer in answers:
        _, reward, terminated, truncated, info = env.step(check(answer))
        assert not (terminated or truncated) and info["tool_errors"] == 0
        steps.append(reward)
    *_, terminated, _, info = env.step(final)
    expected_steps, expected_final = lenient if style == "lenient" else verl
    assert terminated and steps == pytest.approx(expected_steps) and info["final_reward"] == expected_final


def test_verl_tool_answers_as_verl_does(data):
    env = gym.make("GSM8kTool-v0", data_path=data, reward_style="verl")
    env.reset(options={"task": make_row("How many?", "#### 72", 0)})
    assert env.step(check("72"))[0]["text"] == "tool: Current parsed answer='72' reward=1.0"
    assert env.step(check("none"))[0]["text"] == "tool: Current parsed answer='none' reward=0"
    assert env.step(check(7.5))[0]["text"] == "tool: Current parsed answer='7.5' reward=0.0"


# verl/utils/reward_score/gsm8k.py, extract_solution: what each rule reads.
@pytest.mark.parametrize("text, strict, flexible", [
    ("#### 72", "72", "72"),
    ("#### 1,234", "1234", "1,234"),
    ("#### -3.5 and then 4", "-3.5", "4"),
    ("####72", None, "72"),
    ("#### 1 then #### 2", "2", "2"),
    ("The end.", None, "."),
    ("no number", None, None),
    ("#### 7" + "x" * 300, None, None),
])
def test_verl_extraction(text, strict, flexible):
    assert (verl_extract_answer(text, "strict"), verl_extract_answer(text, "flexible")) == (strict, flexible)


def test_verl_score_values():
    assert (verl_score("#### 72", "72"), verl_score("#### 71", "72"), verl_score("none", "72")) == (1.0, 0.0, 0)
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        verl_extract_answer("#### 1", "loose")


def test_lenient_numbers_are_exact():
    big = 2**53
    assert normalize_number(str(big + 1)) != normalize_number(str(big))
    assert normalize_number("12345678901234567890123456789012345.50") == "12345678901234567890123456789012345.5"
    assert [normalize_number(t) for t in ("1,234.50", "72.0", "$-0.00", ".5", "007", "x")] == [
        "1234.5", "72", "0", "0.5", "7", None]
    assert extract_final_answer("so #### $ 1,234") == "1234"
    # floats, numpy's too (a parquet file's numbers): read with all their digits
    assert [normalize_number(x) for x in (72.0, 1e20, np.float64(72.5), np.float32(0.5))] == [
        "72", "100000000000000000000", "72.5", "0.5"]
    # a numpy float32 is no Python float: its str ("2.5e+10") would read as 2.5
    assert normalize_number(np.float32(2.5e10)) == normalize_number(float(np.float32(2.5e10))) == "24999999488"


# verl/tools/gsm8k_tool.py scores str(answer): models write {"answer": 72} constantly.
def test_numeric_answers_pass_validation(data):
    env = gym.make("GSM8kTool-v0", data_path=data)
    env.reset(options={"task": make_row("How many?", "#### 100000000000000000000", 0)})
    _, _, _, _, info = env.step(check(72))
    assert info["tool_errors"] == 0 and info["tool_results"][0]["metrics"] == {"score": 0.0}
    _, _, _, _, info = env.step(check(1e20))  # a JSON float: read in full, not as "1e+20"
    assert info["tool_results"][0]["metrics"] == {"score": 1.0}
    _, _, _, _, info = env.step(check(True))
    assert info["tool_results"][0]["error_kind"] == "invalid_arguments"


# verl examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml: verl's own tool config, whose schema
# says the answer is a string, loads through the class alias and accepts numbers too.
VERL_GSM8K_CONFIG = {"tools": [{
    "class_name": "verl.tools.gsm8k_tool.Gsm8kTool",
    "config": {"type": "native", "reward_style": "verl"},
    "tool_schema": {"type": "function", "function": {
        "name": "calc_gsm8k_reward", "description": "Score an answer to the GSM8K problem.",
        "parameters": {"type": "object", "required": ["answer"], "properties": {
            "answer": {"type": "string", "description": "The answer, in digits"}}}}},
}]}


def test_verl_tool_config_loads_and_accepts_numbers():
    (tool,) = load_tools(VERL_GSM8K_CONFIG)
    assert isinstance(tool, Gsm8kTool) and tool.reward_style == "verl"
    assert tool.tool_schema["function"]["parameters"]["properties"]["answer"]["type"] == ["string", "number"]
    assert HermesParser([tool.tool_schema]).parse(check(72)).calls[0].arguments == {"answer": 72}
    (default,) = load_tools({"tools": [{"class_name": "verl.tools.gsm8k_tool.Gsm8kTool"}]})  # the built-in schema
    assert default.reward_style == "lenient" and default.name == TOOL_NAME


def test_bad_reward_styles_and_schemas_are_config_errors(data):
    with pytest.raises(ToolConfigError, match=r"reward_style must be one of \('lenient', 'verl'\), got 'VERL'"):
        Gsm8kTool({"reward_style": "VERL"})
    schema = {"type": "function", "function": {"name": "check", "parameters": {"type": "object"}}}
    with pytest.raises(ToolConfigError, match="needs an 'answer' property"):
        Gsm8kTool(tool_schema=schema)
    with pytest.raises(ValueError, match="reward_style must be one of"):
        GSM8kToolEnv(data_path=data, reward_style="strict")
