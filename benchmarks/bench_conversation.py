"""Per-turn cost of building a token-in/token-out conversation, of batching it, and of the strict drift check.

GSM8K-like turns: an ~80-token question, ~150-token assistant turns ending in a tool call, ~20-token tool responses.
Baseline, measured in the same run: what a re-tokenizing implementation does every turn — render the whole
conversation with the chat template and tokenize all of it.

Goals (issue 2): per-turn cost flat in the number of turns (16-turn ≤ 1.5× 1-turn), ≥ 10× cheaper than the
re-render baseline at 16 turns, and the drift check on a 16-turn conversation ≤ ~1 full re-tokenization.

    python benchmarks/bench_conversation.py [--repeats 30]      # writes benchmarks/results/cpu/conversation.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not an installed copy

from benchmarks import record  # noqa: E402
from mt_env.batch import collate, pack  # noqa: E402
from mt_env.chat_format import ChatFormat  # noqa: E402
from mt_env.conformance import check_template  # noqa: E402
from mt_env.conversation import Conversation  # noqa: E402
from mt_env.tokenizer import offline_tokenizer  # noqa: E402

TOOL = {"type": "function", "function": {
    "name": "calc_gsm8k_reward", "description": "A tool for calculating the reward of gsm8k",
    "parameters": {"type": "object", "properties": {"answer": {"type": "string", "description": "The answer"}},
                   "required": ["answer"]}}}
WORDS = ("the of and to a in is it that for on was with he as I his be at by had are but from or have an they which "
         "one you were her all she there would their we him been has when who will more no if out so said what up its "
         "about into than them can only other new some could time these two may then do first any my now such like "
         "our over man me even most made after also did many before must through back years where much your way well "
         "down should because each just those people how too little state good very make world still own see men work "
         "long get here between both life being under never day same another know while last might us great old year "
         "off come since against go came right used take three apples dollars cost total each per hour").split()


def words(rng: random.Random, fmt: ChatFormat, n_tokens: int) -> str:
    text = ""
    while len(fmt.encode(text)) < n_tokens:
        text += " " + rng.choice(WORDS) + (f" {rng.randint(2, 999)}" if rng.random() < 0.1 else "")
    return text.strip()


def episode(rng, fmt, turns):
    question = words(rng, fmt, 80)
    prompt = [{"role": "system", "content": "You are a math expert. Use the tool to check your answer."},
              {"role": "user", "content": question}]
    steps = []
    for t in range(turns):
        answer = str(rng.randint(1, 10000))
        text = words(rng, fmt, 130) + (
            f'\n<tool_call>\n{{"name": "calc_gsm8k_reward", "arguments": {{"answer": "{answer}"}}}}\n</tool_call>')
        steps.append((fmt.encode(text) + [fmt.end_of_turn_id], f"Current parsed answer={answer} result=0.0, retry."))
    return prompt, steps


def build(fmt, prompt, steps, strict=False):
    fmt.clear_cache()  # cold: no piece encoding reused from an earlier repetition of the same episode
    conv = Conversation(fmt, prompt, mode="incremental", strict=strict)
    for ids, response in steps:
        conv.add_assistant(ids)
        conv.add_observation([{"role": "tool", "content": response}])
    return conv


def tokenize(fmt, text):
    """Plain tokenization, as a re-tokenizing implementation does it (no reuse of earlier encodings)."""
    return fmt.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def rerender_baseline(fmt, prompt, steps):
    """Every turn: render the whole conversation and tokenize it (what re-tokenizing rollouts do)."""
    messages = list(prompt)
    ids = tokenize(fmt, fmt.render(messages, add_generation_prompt=True))
    for sampled, response in steps:
        messages += [{"role": "assistant", "content": fmt.decode(sampled[:-1])}, {"role": "tool", "content": response}]
        ids = tokenize(fmt, fmt.render(messages, add_generation_prompt=True))
    return ids


def timeit(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64, help="conversations per batch in the batching figures")
    record.add_arguments(ap)
    args = ap.parse_args()
    rec = record.start(args, "conversation")
    rng = random.Random(0)
    fmt = ChatFormat(offline_tokenizer("qwen2.5"), tools=[TOOL])
    assert check_template(fmt).conforms
    print(f"tokenizer: offline Qwen2.5 BPE; template: qwen2.5 with 1 tool; repeats={args.repeats} (median)\n")
    print("per turn = (time for the whole episode - time for its prompt alone) / turns\n")
    print(f"{'turns':>5} {'tokens':>7} {'build µs/turn':>14} {'re-render µs/turn':>18} {'speedup':>8} "
          f"{'collate µs/turn':>16} {'pack µs/turn':>13}")
    per_turn = {}
    for turns in (1, 4, 16):
        prompt, steps = episode(rng, fmt, turns)
        conv = build(fmt, prompt, steps)
        n_tokens = len(conv.context_ids)
        t_prompt = timeit(lambda: build(fmt, prompt, []), args.repeats)
        t_prompt_base = timeit(lambda: rerender_baseline(fmt, prompt, []), args.repeats)
        t_build = (timeit(lambda: build(fmt, prompt, steps), args.repeats) - t_prompt) / turns
        t_base = (timeit(lambda: rerender_baseline(fmt, prompt, steps), args.repeats) - t_prompt_base) / turns
        samples = [s for _ in range(args.batch) for s in conv.samples()]
        t_pad = timeit(lambda: collate(samples, fmt.tokenizer.pad_token_id), max(3, args.repeats // 5))
        batch = collate(samples, fmt.tokenizer.pad_token_id)
        t_pack = timeit(lambda: pack(batch), max(3, args.repeats // 5))
        per_turn[turns] = (t_build, t_base)
        print(f"{turns:>5} {n_tokens:>7} {t_build * 1e6:>14.1f} {t_base * 1e6:>18.1f} {t_base / t_build:>7.1f}x "
              f"{t_pad / args.batch / turns * 1e6:>16.1f} {t_pack / args.batch / turns * 1e6:>13.1f}")

    prompt, steps = episode(rng, fmt, 16)
    conv = build(fmt, prompt, steps)
    full_text = "".join(s.text for s in conv.current.segments)
    t_drift = timeit(conv.check_drift, args.repeats)
    t_tok = timeit(lambda: tokenize(fmt, full_text), args.repeats)
    flat = per_turn[16][0] / per_turn[1][0]
    speedup = per_turn[16][1] / per_turn[16][0]
    drift_ratio = t_drift / t_tok
    print(f"\nprompt alone: {t_prompt * 1e6:.0f} µs incremental, {t_prompt_base * 1e6:.0f} µs re-render")
    print(f"drift check, 16 turns ({len(conv.context_ids)} tokens): {t_drift * 1e6:.0f} µs; "
          f"one full tokenization: {t_tok * 1e6:.0f} µs; ratio {drift_ratio:.2f}")
    print("\ngoals:")
    print(f"  per-turn cost 16 vs 1 turns      {flat:5.2f}x  (goal <= 1.5x)  {'PASS' if flat <= 1.5 else 'FAIL'}")
    print(f"  speedup vs re-render at 16 turns {speedup:5.1f}x  (goal >= 10x)   {'PASS' if speedup >= 10 else 'FAIL'}")
    print(f"  drift check / full tokenization  {drift_ratio:5.2f}x  (goal <= ~1x)  "
          f"{'PASS' if drift_ratio <= 1.2 else 'FAIL'}")
    rec.write(dict(repeats=args.repeats, per_turn_us={t: dict(build=b * 1e6, rerender=r * 1e6)
                                                      for t, (b, r) in per_turn.items()},
                   cost_16_vs_1_turns=flat, speedup_vs_rerender_16_turns=speedup,
                   drift_check_vs_tokenization=drift_ratio))


if __name__ == "__main__":
    main()
