"""End to end: the quickstart recipe, shortened, must really learn — not a smoke test.

SFT on deliberately imperfect demonstrations (half of them skip the calculator and estimate), then GRPO through the
real rollout driver, env and tool lifecycle. Held-out tasks (seeds training never draws) are evaluated before RL
(after SFT) and after; the test fails if tool use and success do not clearly improve — which is what a wrong loss
mask, a sign error in the advantages or a broken reward placement would cause.
"""

from __future__ import annotations

import json

import pytest

from trainers.ppo import main as ppo_main


@pytest.mark.xdist_group("learning")
def test_quickstart_recipe_learns_to_use_the_tool(tmp_path):
    summary = ppo_main([
        "--set", f"output_dir={tmp_path}", "--set", "threads=1",
        "--set", "sft.steps=500", "--set", "trainer.total_steps=30", "--set", "trainer.eval_every=0",
        "--set", "eval.episodes=128", "--set", "trainer.time_limit_s=null", "--set", "logging.plot=false",
    ])
    before, after = summary["start_val_success"], summary["final_val_success"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    tool_rate = [r["val/tool_call_rate"] for r in rows if "val/tool_call_rate" in r]
    print(f"held-out success {before:.3f} -> {after:.3f}; tool-call rate {tool_rate[0]:.3f} -> {tool_rate[-1]:.3f}")
    assert after >= before + 0.2, f"RL did not improve held-out success enough: {before:.3f} -> {after:.3f}"
    assert after >= 0.55
    assert tool_rate[-1] >= tool_rate[0] + 0.15  # it learned to call the tool instead of estimating
