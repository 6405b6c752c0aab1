"""The fast path's prefill pass by shape: does a pass cost what its tokens cost, the first time a shape comes and
after?

Why: H200 timelines of the rollout (`profile_rollout.py --timeline`) showed the last, smaller prefill pass of a turn
taking 60-110 ms where full passes of 32k tokens took 53 ms. This replays such a sequence of (rows, width) passes
on `SlotEngine` directly — the shapes the timelines listed, then the same again — and times each pass to the host
(the pass ends when its sampled tokens are read). A pass slower the first time than the next is a one-time cost
per shape; a pass slow both times is the kernels'. (`--profile` found the one-time cost: cuDNN's attention plans,
built per shape, since excluded from the prefill: `agents.fast_decode.PREFILL_ATTENTION`.)

    python benchmarks/bench_prefill.py               # on a GPU: writes benchmarks/results/h200/prefill.json
    python benchmarks/bench_prefill.py --model tiny --device cpu                     # a smoke run
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not an installed copy

import agents.fast_decode  # noqa: E402
from agents.fast_decode import RowSampling, SlotEngine, decoder_layout  # noqa: E402
from agents.policy import SamplingParams, counted  # noqa: E402
from benchmarks import record  # noqa: E402
from benchmarks.bench_rollout import build_model  # noqa: E402
from mt_env.tokenizer import load_tokenizer  # noqa: E402

#: (rows, width) of the passes of a 256-episode rollout's three turns, as the H200 timelines listed them
SHAPES = [(159, 205), (97, 205), (1, 256), (5, 346), (94, 346), (94, 346), (62, 346), (67, 346), (1, 397),
          (8, 487), (67, 487), (67, 487), (45, 487), (50, 487), (42, 487), (13, 487), (3, 487)]


def timed_pass(engine: SlotEngine, rows: int, width: int, vocab: int, rng: random.Random) -> float:
    """One prefill pass of `rows` prompts of `width` random ids into slots 0..rows-1; seconds to its tokens."""
    prompts = [[rng.randrange(vocab) for _ in range(width)] for _ in range(rows)]
    params = [SamplingParams(temperature=1.0)] * rows
    sampling = RowSampling.draw(params, [random.Random(i) for i in range(rows)], vocab)
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.prefill(list(range(rows)), prompts, sampling)  # ends with the tokens read to the host (no_grad inside)
    seconds = time.perf_counter() - start
    engine.free(list(range(rows)))
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["tiny", "qwen2.5-0.5b"], default="qwen2.5-0.5b")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--rounds", type=int, default=3, help="times the whole sequence of shapes is replayed")
    ap.add_argument("--width-step", type=int, help="experiment: agents.fast_decode.PREFILL_WIDTH_STEP (1: no "
                    "padding of the width)")
    ap.add_argument("--eager", action="store_true", help="experiment: the prefill uncompiled (does a new shape cost "
                    "more the first time without Inductor too?)")
    ap.add_argument("--profile", action="store_true", help="after the rounds, profile passes of two unseen shapes "
                    "and print their costliest host-side ops")
    record.add_arguments(ap)
    args = ap.parse_args()
    rec = record.start(args, "prefill", device=args.device)
    if args.width_step:
        agents.fast_decode.PREFILL_WIDTH_STEP = args.width_step
    vocab = len(load_tokenizer("offline:qwen2.5"))  # the other benchmarks' tokenizer
    model, shape = build_model(args.model, args.device, vocab)
    engine = SlotEngine(model, decoder_layout(model), max_slots=256, max_cache_len=4096, vocab_size=vocab,
                        cuda_graphs=False, compile=args.device == "cuda" and not args.eager)
    rng = random.Random(0)
    start = time.perf_counter()
    timed_pass(engine, 4, 64, vocab, rng)  # compiles the prefill's functions
    print(f"model: {shape}\nfirst pass{'' if args.eager else ' (compilation)'}: {time.perf_counter() - start:.1f} s\n")
    rounds = []
    for r in range(args.rounds):
        with counted(engine) as made:
            rounds.append([timed_pass(engine, rows, width, vocab, rng) * 1e3 for rows, width in SHAPES])
        print(f"round {r + 1}: {made['compilations']} compilation(s), {made['compile_s']:.1f} s")
    print(f"{'rows':>5} {'width':>6} {'tokens':>7}  " + "  ".join(f"round {r + 1} ms" for r in range(args.rounds)))
    for i, (rows, width) in enumerate(SHAPES):
        print(f"{rows:>5} {width:>6} {rows * width:>7}  " + "  ".join(f"{t[i]:>10.1f}" for t in rounds))
    if args.profile:
        profile_unseen(engine, vocab, rng)
    rec.write(dict(model=shape, shapes=SHAPES, ms=rounds, eager=args.eager,
                   width_step=agents.fast_decode.PREFILL_WIDTH_STEP))


def profile_unseen(engine: SlotEngine, vocab: int, rng: random.Random) -> None:
    """Profile prefill passes of two shapes not seen before: which host-side ops hold the time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * torch.cuda.is_available()
    with profile(activities=activities) as prof:
        for rows, width in ((11, 301), (23, 433)):
            print(f"unseen shape ({rows}, {width}): {timed_pass(engine, rows, width, vocab, rng) * 1e3:.1f} ms")
    for key in ("cpu_time_total", "self_cpu_time_total"):  # the calls that hold the time, then where it is spent
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
