"""Env steps per second with replayed model turns (no model): GSM8kTool-v0, 1 and 256 envs, tokenizer off and on.

Each episode replays three recorded-style model turns on a real GSM8K problem: reasoning + a tool call with a
wrong answer, a tool call with the right one, the final ``#### <n>``. The tool, parser, conversation and env logic
all run for real. An env step is one model turn consumed; resets (tool create/release, prompt rendering) run
between episodes and their time is counted in the wall time but not as steps.

Rows: mt_env's `ToolVectorEnv` (all envs' tool calls in one event loop) and, as the baseline measured in the same
run, Gymnasium's `SyncVectorEnv` (`gym.make_vec(..., vectorization_mode="sync")`, envs stepped one by one).
Each rate is the median of three runs (after a one-episode warm-up), each on the tasks that follow the previous
run's, so that the encoding caches meet new prompts and tool outputs as they do in training (at 256 envs the 7,473
GSM8K rows come round again thousands of episodes later, long after their pieces have left the caches).

Goals: (issue 3) >= 20k env-steps/s on 2 cores for GSM8kTool with the tokenizer off; (issue 12) with the tokenizer
on, 256 envs step at least as fast per env-step as one env (the ratio of the two rates, measured in the same run).

    python benchmarks/bench_envs.py [--data ../shared/data/gsm8k] [--episodes 24]   # writes results/cpu/envs.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not an installed copy

import mt_env  # noqa: F401, E402
from benchmarks import record  # noqa: E402
from envs.gsm8k_tool import GSM8kToolEnv  # noqa: E402
from mt_env.parsers import HermesParser, ToolCall  # noqa: E402
from mt_env.turn import ModelTurn  # noqa: E402
from mt_env.vector import ToolVectorEnv  # noqa: E402

REPEATS = 3  # each rate is the median of this many runs (the machine is shared and noisy)
REASONING = ("Let me work through this. First I find the quantities given in the problem, then I combine them "
             "step by step, and finally I check the result with the tool before answering.")


def model_turns(truth: str) -> list[str]:
    wrong = str(int(float(truth)) + 1)
    check = lambda answer: HermesParser.format_turn([ToolCall("calc_gsm8k_reward", {"answer": answer})])  # noqa: E731
    return [f"{REASONING}\n{check(wrong)}", f"That was off by one.\n{check(truth)}", f"So the answer is #### {truth}"]


def run(envs, num_envs: int, episodes: int, fmt=None, subset: bool = True, first_episode: int = 0) -> float:
    """env-steps/s over `episodes` episodes per env, on the tasks that follow those of `first_episode` episodes
    (new tasks each time, as in training: a replay of the same tasks would find their encodings cached). The
    replayed turns are prepared before the clock starts."""
    rows = envs_rows(envs)
    idx = list(range(num_envs))
    plan = []
    for e in range(first_episode, first_episode + episodes):
        tasks = [rows[(e * num_envs + i) % len(rows)] for i in idx]
        turns = [model_turns(t["reward_model"]["ground_truth"]) for t in tasks]
        actions = [_actions([turns[i][k] for i in idx], fmt) for k in range(3)]
        plan.append(([{"task": t} for t in tasks], actions))
    steps, start = 0, time.perf_counter()
    for options, actions in plan:
        if subset:
            envs.reset_subset(idx, options=options)
        else:
            envs.reset(options=options[0])
        for step_actions in actions:
            envs.step_subset(idx, step_actions) if subset else envs.step(step_actions)
            steps += num_envs
    return steps / (time.perf_counter() - start)


def median_run(envs, num_envs: int, episodes: int, fmt=None, subset: bool = True) -> float:
    """The median rate of `REPEATS` runs after a one-episode warm-up (chat formats, template check), each on new
    tasks."""
    run(envs, num_envs, 1, fmt, subset)
    return statistics.median(run(envs, num_envs, episodes, fmt, subset, first_episode=1 + r * episodes)
                             for r in range(REPEATS))


def _actions(texts: list[str], fmt) -> list:
    """Replayed sampled ids, encoded in one batch outside the env (an engine hands ids over: the env's encoding
    cache is not involved); the texts themselves without a tokenizer."""
    if fmt is None:
        return texts
    encoded = fmt.tokenizer(texts, add_special_tokens=False).input_ids
    return [ModelTurn(ids=ids + [fmt.end_of_turn_id]) for ids in encoded]


def envs_rows(envs):
    return envs.base_envs[0].rows if hasattr(envs, "base_envs") else envs.envs[0].unwrapped.rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_data = str(Path(__file__).resolve().parents[2] / "shared/data/gsm8k")
    ap.add_argument("--data", default=os.environ.get("MT_ENV_GSM8K", default_data))
    ap.add_argument("--episodes", type=int, default=24, help="episodes per env (each 3 steps) in each of the runs")
    record.add_arguments(ap)
    args = ap.parse_args()
    rec = record.start(args, "envs")
    print(f"GSM8kTool-v0, data {args.data}; {args.episodes} episodes x 3 steps per env, median of {REPEATS} runs; "
          f"cpu threads: {os.cpu_count()}\n")
    print(f"{'vector env':<26} {'envs':>5} {'tokenizer':>10} {'env-steps/s':>12}")
    results = {}
    for tokenizer in (None, "offline:qwen2.5"):
        for n in (1, 256):
            envs = ToolVectorEnv([lambda: GSM8kToolEnv(data_path=args.data, tokenizer=tokenizer) for _ in range(n)])
            fmt = None
            if tokenizer:
                envs.reset_subset([0])
                fmt = envs.base_envs[0].conversation.fmt
            rate = median_run(envs, n, args.episodes if n > 1 else args.episodes * 64, fmt)
            results[(tokenizer, n)] = rate
            print(f"{'mt_env ToolVectorEnv':<26} {n:>5} {('on' if tokenizer else 'off'):>10} {rate:>12,.0f}")
            envs.close()
        if tokenizer is None:
            sync = gym.make_vec("GSM8kTool-v0", num_envs=256, vectorization_mode="sync", data_path=args.data)
            rate = median_run(sync, 256, args.episodes, subset=False)
            results["sync"] = rate
            print(f"{'gymnasium SyncVectorEnv':<26} {256:>5} {'off':>10} {rate:>12,.0f}")
            sync.close()
    goal = results[(None, 256)]
    print(f"\nToolVectorEnv vs SyncVectorEnv at 256 envs: {goal / results['sync']:.2f}x")
    print(f"goal >= 20,000 env-steps/s (256 envs, tokenizer off): {goal:,.0f}  {'PASS' if goal >= 20_000 else 'FAIL'}")
    print(f"with the tokenizer on (exact template-delta ids every step): {results[('offline:qwen2.5', 256)]:,.0f}")
    ratio = results[("offline:qwen2.5", 256)] / results[("offline:qwen2.5", 1)]
    print(f"256 envs vs 1 env (tokenizer on): {ratio:.2f}x")
    print(f"goal >= 1.0x (issue 12: a step costs no more with 256 envs than with one): {ratio:.2f}x  "
          f"{'PASS' if ratio >= 1.0 else 'FAIL'}")
    sync = results.pop("sync")
    rec.write(dict(episodes=args.episodes, repeats=REPEATS, sync_vector_env_256=sync, vs_sync_256=goal / sync,
                   tool_vector_env={f"tokenizer_{'on' if t else 'off'}_{n}": r for (t, n), r in results.items()},
                   tokenizer_on_256_vs_1=ratio))


if __name__ == "__main__":
    np.set_printoptions(precision=2)
    main()
