"""Rollout overhead: tokens/s through the rollout driver vs the same HFPolicy doing the same token work directly.

Each batch size runs `batch` episodes of exactly three turns: a Calculator env whose `interaction` always asks the
model to go on, with ``length_cut="interact"``, so that a random model's turns (cut at ``--new-tokens``) are
followed by a user turn instead of ending the episode. The driver plays them all concurrently against one
`HFPolicy`; it records every episode's context and generated length per turn.

The raw baseline then replays exactly that token work on the same `HFPolicy` instance, without envs, tools or
bookkeeping: for turn k = 1, 2, 3 one `generate_many` over the contexts the episodes had at turn k, each generating
exactly as many tokens as the episode did (``max_new_tokens`` = that length, no stop tokens). Both are warmed up
first (the warm-up also builds the driver's env pool, as a trainer's first step would).

Reported per batch size: generated tokens/s through the driver and raw, their ratio (goal: rollout >= 0.95x raw),
and the driver's wall-time split (generation in flight / tool steps only / its own bookkeeping: resets, parsing,
conversation ids, training samples with the drift check).

    python benchmarks/bench_rollout.py                                   # CPU: tiny random Qwen2, batch 64 and 256
    python benchmarks/bench_rollout.py --model qwen2.5-0.5b --device cuda --new-tokens 128 --out rollout.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not an installed copy

import agents.rollout  # noqa: E402
from agents.hf_policy import HFPolicy  # noqa: E402
from agents.policy import SamplingParams  # noqa: E402
from agents.rollout import RolloutDriver, RolloutResult  # noqa: E402
from envs.calculator import CalculatorEnv  # noqa: E402
from mt_env.sample import Seg  # noqa: E402
from mt_env.tokenizer import load_tokenizer  # noqa: E402
from trainers.modeling import build_causal_lm  # noqa: E402

TURNS = 3
GOAL = 0.95
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


class KeepGoingEnv(CalculatorEnv):
    """Calculator tasks played for exactly three turns: every answer, even one cut by the token limit, gets a user
    turn asking to go on (two of them), so that a random model generates `--new-tokens` tokens per turn."""

    def __init__(self, **kwargs):
        super().__init__(length_cut="interact", max_interactions=TURNS - 1, max_turns=TURNS, **kwargs)

    def interaction(self, task, final_text):
        return "Go on."


def build_model(name: str, device: str, vocab: int):
    if name == "tiny":
        model = build_causal_lm(config=TINY, vocab_size=vocab)
    else:
        model = build_causal_lm(preset=name, dtype=torch.bfloat16)
    model = model.to(device).eval()
    c = model.config
    shape = dict(name=name, layers=c.num_hidden_layers, hidden=c.hidden_size, intermediate=c.intermediate_size,
                 heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, vocab=c.vocab_size,
                 dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
                 params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 1))
    return model, shape


def turn_work(result: RolloutResult) -> list[list[tuple[list[int], int]]]:
    """Per turn: (context ids, generated length) of every episode that played it — the exact token work."""
    work: list[list[tuple[list[int], int]]] = [[] for _ in range(TURNS)]
    for record in result.episodes:
        for sample in record.samples:
            for seg in sample.segments:
                if seg.kind == Seg.SAMPLED:
                    work[seg.turn].append((sample.ids[:seg.start], len(seg)))
    return work


async def run_raw(policy: HFPolicy, work, temperature: float) -> tuple[float, int]:
    """Replay `work` turn by turn, each turn one batched call; returns (wall seconds, generated tokens)."""
    tokens, start = 0, time.perf_counter()
    for k, turn in enumerate(work):
        params = [SamplingParams(temperature=temperature, max_new_tokens=n, seed=k * 100_003 + i)
                  for i, (_, n) in enumerate(turn)]
        generations = await policy.generate_many([ids for ids, _ in turn], params)
        got = [len(g) for g in generations]
        if got != [n for _, n in turn]:
            raise RuntimeError("the raw baseline generated other lengths than the rollout: the comparison is off")
        tokens += sum(got)
    return time.perf_counter() - start, tokens


def measure(driver: RolloutDriver, policy: HFPolicy, tasks: list[dict], repeats: int, temperature: float,
            step: int) -> dict:
    rollout, raw, splits, ends = [], [], [], Counter()
    # Warm-up at this exact size: the first pass through a range of tensor sizes (KV caches growing token by token)
    # pays for allocations that later passes reuse; whichever side ran first would otherwise pay for both.
    warm = driver.run(tasks, step=step + 500)
    asyncio.run(run_raw(policy, turn_work(warm), temperature))
    for r in range(repeats):
        before = dict(policy.stats)
        start = time.perf_counter()
        result = driver.run(tasks, step=step + r)
        rollout_wall = time.perf_counter() - start
        rollout_passes = {k: policy.stats[k] - before[k] for k in before}
        bad = [rec for rec in result.episodes if rec.turns != TURNS or rec.error]
        if bad:
            raise RuntimeError(f"{len(bad)} episode(s) did not play {TURNS} turns, e.g. {bad[0].to_dict()}")
        ends.update(rec.end_reason for rec in result.episodes)
        tokens = int(result.metrics["rollout/generated_tokens"])
        before = dict(policy.stats)
        raw_wall, raw_tokens = asyncio.run(run_raw(policy, turn_work(result), temperature))
        raw_passes = {k: policy.stats[k] - before[k] for k in before}
        assert raw_tokens == tokens
        rollout.append(tokens / rollout_wall)
        raw.append(raw_tokens / raw_wall)
        splits.append({k: result.metrics[k] for k in ("time/generation_s", "time/tools_s", "time/bookkeeping_s")}
                      | {"rollout_wall_s": rollout_wall, "raw_wall_s": raw_wall, "tokens": tokens,
                         "rollout_passes": rollout_passes, "raw_passes": raw_passes})
    median = sorted(range(repeats), key=lambda i: rollout[i] / raw[i])[(repeats - 1) // 2]  # the run of median ratio
    figures = splits[median]
    return dict(batch=len(tasks), turns=TURNS, generated_tokens=figures["tokens"],
                rollout_tok_s=rollout[median], raw_tok_s=raw[median], ratio=rollout[median] / raw[median],
                rollout_wall_s=figures["rollout_wall_s"], raw_wall_s=figures["raw_wall_s"],
                generation_s=figures["time/generation_s"], tools_s=figures["time/tools_s"],
                bookkeeping_s=figures["time/bookkeeping_s"], ratios=[a / b for a, b in zip(rollout, raw)],
                end_reasons=dict(ends), rollout_passes=figures["rollout_passes"], raw_passes=figures["raw_passes"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["tiny", "qwen2.5-0.5b"], default="tiny",
                    help="tiny: a random 2-layer Qwen2 (CPU); qwen2.5-0.5b: Qwen2.5-0.5B's shape, random, bf16")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="episodes per rollout")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per batch size (the median ratio is shown)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, help="torch CPU threads; default 1 on cpu (on a small shared CPU, "
                    "intra-op threads waiting for a busy core slow the tiny model many times), torch's own on cuda")
    ap.add_argument("--tokenizer", default="offline:qwen2.5")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    threads = args.threads or (1 if args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)

    tokenizer = load_tokenizer(args.tokenizer)
    model, shape = build_model(args.model, args.device, len(tokenizer))
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"code: {Path(agents.rollout.__file__).resolve().parents[1]}")
    print(f"device: {device}; torch {torch.__version__}, {torch.get_num_threads()} CPU thread(s)")
    print("model:", ", ".join(f"{k} {v}" for k, v in shape.items()), f"(tokenizer {args.tokenizer}, {len(tokenizer)})")
    print(f"episodes: {TURNS} turns x {args.new_tokens} new tokens, temperature {args.temperature}; "
          f"batch sizes {args.batch}; {args.repeats} timed run(s) each")

    largest = max(args.batch)
    policy = HFPolicy(model, max_batch_size=largest, seed=0, vocab_limit=len(tokenizer))
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens)
    driver = RolloutDriver(lambda: KeepGoingEnv(tokenizer=tokenizer), policy, sampling, max_concurrency=largest,
                           generation_timeout_s=None, seed=0)
    rng = np.random.default_rng(0)
    tasks = [CalculatorEnv.task_for([int(x) for x in rng.integers(100, 1000, size=2)]) for _ in range(largest)]

    # Warm-up: the env pool (chat formats, template checks) and the model's kernels; each size warms up again in
    # `measure`, at its own shapes.
    start = time.perf_counter()
    warm = driver.run(tasks, step=10_000, max_new_tokens=1)
    asyncio.run(run_raw(policy, turn_work(warm), args.temperature))
    print(f"warm-up: {time.perf_counter() - start:.1f} s\n")

    head = (f"{'batch':>5} {'tokens':>7} {'rollout tok/s':>14} {'raw tok/s':>10} {'ratio':>6}   "
            f"{'rollout s':>9} {'raw s':>7}   {'generation s':>12} {'tools s':>8} {'bookkeeping s':>13}")
    print(head)
    rows = []
    for i, batch in enumerate(args.batch):
        row = measure(driver, policy, tasks[:batch], args.repeats, args.temperature, step=1000 * i)
        rows.append(row)
        print(f"{batch:>5} {row['generated_tokens']:>7} {row['rollout_tok_s']:>14,.0f} {row['raw_tok_s']:>10,.0f} "
              f"{row['ratio']:>6.3f}   {row['rollout_wall_s']:>9.2f} {row['raw_wall_s']:>7.2f}   "
              f"{row['generation_s']:>12.2f} {row['tools_s']:>8.3f} {row['bookkeeping_s']:>13.3f}")
        for name in ("rollout", "raw"):
            p = row[f"{name}_passes"]
            print(f"      {name:<7} forward passes: {p['prefill_passes']} prefill, {p['decode_passes']} decode "
                  f"({p['decoded_rows'] / max(1, p['decode_passes']):.1f} rows each), {p['merges']} merges, "
                  f"{p['separate_batches']} batches stepped in turn")
    asyncio.run(policy.close())
    driver.close()

    ends = Counter()
    for r in rows:
        ends.update(r["end_reasons"])
    note = "" if set(ends) == {"answered"} else (
        " (a random model may sample <tool_call>: an error observation instead of 'Go on', still 3 turns)")
    print("episode ends:", ", ".join(f"{reason} {count}" for reason, count in ends.most_common()) + note)
    passed = all(r["ratio"] >= GOAL for r in rows)
    worst = min(rows, key=lambda r: r["ratio"])
    print(f"\ngoal: rollout >= {GOAL}x raw tokens/s at every batch size: worst {worst['ratio']:.3f}x "
          f"(batch {worst['batch']})  {'PASS' if passed else 'FAIL'}")
    if args.out:
        report = dict(command=shlex.join([sys.executable, *sys.argv]), device=device, torch=torch.__version__,
                      threads=torch.get_num_threads(), model=shape, tokenizer=args.tokenizer, turns=TURNS,
                      new_tokens=args.new_tokens, temperature=args.temperature, repeats=args.repeats, goal=GOAL,
                      passed=passed, results=rows)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
