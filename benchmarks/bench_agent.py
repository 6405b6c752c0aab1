"""Agent-shaped rollouts through the embedded engine, its prefix cache on and off in one run.

Workloads (random-init model, every sequence generating exactly its tokens: no stop tokens):

* ``A``: 32 prompts x 8 samples, 6 turns, prompt 600 tokens, 256 generated + 400 observation tokens a turn.
* ``B``: 64 prompts x 8 samples, 3 turns, prompt 300 tokens, 128 generated + 100 observation tokens a turn.
  For both, each turn is one `generate_many` over every sequence's context so far (the same shapes are played once
  before the measured run).
* ``gsm8k``: GSM8kTool-v0 through the real rollout driver and envs, GRPO groups of 8, four turns (a turn cut at
  ``--gsm8k-tokens`` gets the env's follow-up: a random model never answers).
* ``serve7b``: a Qwen2.5-7B-shaped model (bf16) serving 512 sequences at once, prompts of 256..7936 tokens (mean
  about 4k), 64 new tokens each, in a pool sized by ``--kv-gib``: peak memory, preemptions, and the pool against the
  tokens it held at its fullest.

Per workload and setting: tok/s (generated), tokens prefilled, the workload's new tokens (prompts once, then the
observations), Python's garbage-collection pauses (``gc_s_on`` / ``gc_s_off``), decode ms per step and the same
step's floor (`benchmarks/floor_step.py`, same process, at the workload's batch and mean context), peak GiB
allocated. A decode step's figure is its period: the worker's busy
seconds outside prefill passes and gathering, over its decode steps (the host's bookkeeping included: step t+1 is
launched before step t is read, so launch + wait alone, ``decode_wait_ms_per_step``, undercounts a step by the host
work it hides).
Goals (issue 27): prefilled <= 1.15x new on A and B; tok/s with the cache >= 2.0x (A) and 1.4x (B) without; decode
step <= 1.2x the floor at batch 256 on A.

    python benchmarks/bench_agent.py --device cuda --workloads A B gsm8k     # writes benchmarks/results/h200/agent.json
    python benchmarks/bench_agent.py --device cuda --workloads serve7b --kv-gib 100 \
        --out benchmarks/results/h200/agent_7b.json
    python benchmarks/bench_agent.py --scale 0.05                      # CPU: a tiny model, the shapes scaled down
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not an installed copy

from agents.backend import SamplingParams, counted  # noqa: E402
from agents.hf_backend import HFBackend  # noqa: E402
from benchmarks import record  # noqa: E402
from trainers.modeling import build_causal_lm  # noqa: E402

from floor_step import SHAPE_0_5B, floor_step_ms  # noqa: E402

QWEN_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
               tie_word_embeddings=False, vocab_size=152064)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=32768)


@dataclass(frozen=True)
class Workload:
    prompts: int
    samples: int
    turns: int
    prompt: int
    generate: int
    observe: int

    def scaled(self, scale: float) -> Workload:
        def s(n):
            return max(1, round(n * scale))
        return Workload(s(self.prompts), self.samples, self.turns, s(self.prompt), s(self.generate), s(self.observe))

    @property
    def new_tokens(self) -> int:
        """Tokens no earlier pass computed: each prompt once, then every sequence's observations."""
        return self.prompts * self.prompt + self.prompts * self.samples * (self.turns - 1) * self.observe

    @property
    def mean_context(self) -> int:
        """The mean context a decode step attends to."""
        turn = self.generate + self.observe
        return self.prompt + (self.turns - 1) * turn // 2 + self.generate // 2


WORKLOADS = {"A": Workload(32, 8, 6, 600, 256, 400), "B": Workload(64, 8, 3, 300, 128, 100)}


async def play(backend: HFBackend, wl: Workload, vocab: int, seed: int) -> tuple[float, int]:
    """Every turn one `generate_many` over all contexts; returns (wall seconds, tokens generated)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(wl.prompt)] for _ in range(wl.prompts)]
    contexts = [list(p) for p in prompts for _ in range(wl.samples)]
    generated, start = 0, time.perf_counter()
    for turn in range(wl.turns):
        params = [SamplingParams(temperature=1.0, max_new_tokens=wl.generate, seed=seed * 7919 + turn * 1000 + i)
                  for i in range(len(contexts))]
        turns = await backend.generate_many(contexts, params)
        for context, t in zip(contexts, turns):
            context += t.ids + [rng.randrange(10, vocab) for _ in range(wl.observe)]
        generated += sum(len(t.ids) for t in turns)
    return time.perf_counter() - start, generated


def measure(model, wl: Workload, vocab: int, prefix_cache: bool, max_batch: int, profile: int = 0,
            cuda_graphs: bool = True) -> dict:
    """One setting of one workload: warm-up at the same shapes, then the measured run (its worker thread profiled,
    the `profile` costliest functions printed, when asked)."""
    async def run():
        async with HFBackend(model, max_batch_size=max_batch, seed=0, vocab_limit=vocab, fast_path=True,
                            prefix_cache=prefix_cache, cuda_graphs=cuda_graphs) as backend:
            await play(backend, wl, vocab, seed=1)  # warm: compilations, graphs, the allocator's pools
            backend._engine.flush()  # (through the worker's queue would be the same: nothing runs now)
            _reset_peak()
            with counted(backend) as stats, _worker_profiled(profile), _collections() as gc_pauses:
                wall, generated = await play(backend, wl, vocab, seed=2)
            return wall, generated, stats, backend.fast_path_reason, gc_pauses

    wall, generated, stats, reason, gc_pauses = asyncio.run(run())
    steps = max(1, stats["decode_passes"])
    kept = ("prefill_passes", "prefill_padded_tokens", "decode_passes", "preemptions", "evictions", "graph_captures",
            "graph_replays", "stand_in_replays", "uncaptured_steps", "prefill_graph_captures", "prefill_graph_replays",
            "compilations", "compile_s", "busy_s", "gather_s", "prefill_s", "launch_s", "step_wait_s")
    period = stats["busy_s"] - stats["prefill_s"] - stats["gather_s"]
    return dict(tok_s=generated / wall, wall_s=wall, generated=generated, prefilled_tokens=stats["prefilled_tokens"],
                cached_tokens=stats["cached_tokens"], decode_ms_per_step=period / steps * 1e3,
                decode_wait_ms_per_step=(stats["launch_s"] + stats["step_wait_s"]) / steps * 1e3,
                rows_per_step=stats["decoded_rows"] / steps, peak_gib=_peak_gib(), engine=reason,
                gc_pauses=gc_pauses, **{k: stats[k] for k in kept})


@contextlib.contextmanager
def _collections():
    """Python's garbage collections inside the block, any thread's (a collection holds the GIL: the engine's
    worker waits through it): {"gen<g>_n": count, "gen<g>_s": seconds} per generation, filled in when it ends."""
    import gc

    pauses: dict = {}
    began = 0.0

    def note(phase: str, info: dict) -> None:
        nonlocal began
        if phase == "start":
            began = time.perf_counter()
            return
        gen = info["generation"]
        pauses[f"gen{gen}_n"] = pauses.get(f"gen{gen}_n", 0) + 1
        pauses[f"gen{gen}_s"] = pauses.get(f"gen{gen}_s", 0.0) + time.perf_counter() - began

    gc.callbacks.append(note)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(note)


@contextlib.contextmanager
def _worker_profiled(top: int):
    """Profile HFBackend's worker thread inside the block (cProfile follows one thread: the worker's steps are
    wrapped) and print its `top` costliest functions; nothing when `top` is 0."""
    if not top:
        yield
        return
    import cProfile
    import pstats

    profiler, serve = cProfile.Profile(), HFBackend._serve_once

    def profiled(self):
        profiler.enable()
        try:
            return serve(self)
        finally:
            profiler.disable()

    HFBackend._serve_once = profiled
    try:
        yield
    finally:
        HFBackend._serve_once = serve
        pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def run_synthetic(name: str, model, vocab: int, args) -> dict:
    wl = WORKLOADS[name].scaled(args.scale)
    graphs = not args.no_cuda_graphs
    on = measure(model, wl, vocab, True, max_batch=wl.prompts * wl.samples, profile=args.profile, cuda_graphs=graphs)
    off = measure(model, wl, vocab, False, max_batch=wl.prompts * wl.samples, cuda_graphs=graphs)
    row = dict(workload=name, shape=dataclasses.asdict(wl), new_tokens=wl.new_tokens,
               tok_s_on=on["tok_s"], tok_s_off=off["tok_s"], speedup=on["tok_s"] / off["tok_s"],
               prefilled_tokens=on["prefilled_tokens"], prefilled_tokens_off=off["prefilled_tokens"],
               prefilled_vs_new=on["prefilled_tokens"] / wl.new_tokens, decode_ms_per_step=on["decode_ms_per_step"],
               peak_gib=on["peak_gib"], peak_gib_off=off["peak_gib"],
               gc_s_on=sum(v for k, v in on["gc_pauses"].items() if k.endswith("_s")),
               gc_s_off=sum(v for k, v in off["gc_pauses"].items() if k.endswith("_s")), on=on, off=off)
    if args.device == "cuda" and graphs:  # the floor is a CUDA graph of its own
        batch = wl.prompts * wl.samples
        row.update(floor_ms_per_step=floor_step_ms(SHAPE_0_5B, batch, wl.mean_context), floor_batch=batch,
                   floor_context=wl.mean_context)
        row["decode_vs_floor"] = row["decode_ms_per_step"] / row["floor_ms_per_step"]
    return row


def run_gsm8k(model, tokenizer, args) -> dict:
    """GSM8kTool-v0 through the rollout driver: 32 problems x 8 samples, four turns each (cut turns get the env's
    follow-up), cache on and off."""
    import functools

    import gymnasium as gym

    from agents.rollout_processes import rollout_driver

    make_env = functools.partial(gym.make, "GSM8kTool-v0", tokenizer=tokenizer, data_path=args.gsm8k, split="test",
                                 interaction=True, max_interactions=3, max_turns=4, length_cut="interact")
    tasks = make_env().unwrapped.rows[:32]
    rows = {}
    for cache in (True, False):
        backend = HFBackend(model, max_batch_size=256, seed=0, vocab_limit=len(tokenizer), fast_path=True,
                          prefix_cache=cache)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=args.gsm8k_tokens,
                                  stop_token_ids=(tokenizer.eos_token_id,))
        driver = rollout_driver(make_env, backend, sampling, processes=args.env_processes, max_concurrency=256,
                                generation_timeout_s=None, seed=0)
        try:
            driver.run(tasks, n=8, step=1)  # warm-up
            backend._engine.flush()
            _reset_peak()
            with counted(backend) as stats:
                start = time.perf_counter()
                result = driver.run(tasks, n=8, step=2)
                wall = time.perf_counter() - start
        finally:
            asyncio.run(backend.close())
            driver.close()
        generated = int(result.metrics["rollout/generated_tokens"])
        rows[cache] = dict(tok_s=generated / wall, wall_s=wall, generated=generated,
                           prefilled_tokens=stats["prefilled_tokens"], cached_tokens=stats["cached_tokens"],
                           turns=sum(r.turns for r in result.episodes) / len(result.episodes), peak_gib=_peak_gib())
    on, off = rows[True], rows[False]
    return dict(workload="gsm8k", tok_s_on=on["tok_s"], tok_s_off=off["tok_s"], speedup=on["tok_s"] / off["tok_s"],
                prefilled_tokens=on["prefilled_tokens"], prefilled_tokens_off=off["prefilled_tokens"],
                peak_gib=on["peak_gib"], on=on, off=off)


def run_serve7b(args) -> dict:
    """512 sequences of a Qwen2.5-7B-shaped model at once, prompts of 256..7936 tokens, 64 new tokens each."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", **QWEN_7B)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 150000) for _ in range(rng.randint(256, 7936))] for _ in range(args.serve_seqs)]
    held = sum(len(p) + 64 for p in prompts)

    async def run():
        async with HFBackend(model, max_batch_size=args.serve_seqs, seed=0, kv_cache_gib=args.kv_gib,
                            max_context_len=8192) as backend:
            warm = [p[:512] for p in prompts[:64]]
            await backend.generate_many(warm, SamplingParams(max_new_tokens=8))  # kernels and graphs of small shapes
            _reset_peak()
            with counted(backend) as stats:
                start = time.perf_counter()
                turns = await backend.generate_many(prompts, SamplingParams(max_new_tokens=64))
                wall = time.perf_counter() - start
            engine = backend._engine
            return wall, turns, stats, engine.pool.num_blocks, engine.runner.bytes_per_token(), backend.fast_path_reason

    wall, turns, stats, blocks, per_token, reason = asyncio.run(run())
    pool_tokens = (blocks - 1) * 16
    peak_held = stats["peak_blocks"] * 16
    return dict(workload="serve7b", sequences=args.serve_seqs, tokens_wanted=held, mean_prompt=held / len(prompts) - 64,
                tok_s=sum(len(t.ids) for t in turns) / wall, wall_s=wall, prefilled_tokens=stats["prefilled_tokens"],
                preemptions=stats["preemptions"], kv_gib=pool_tokens * per_token / 2**30, peak_gib=_peak_gib(),
                pool_tokens=pool_tokens, peak_held_tokens=peak_held, kv_vs_held=pool_tokens / max(1, peak_held),
                finish=sorted({t.finish_reason for t in turns}), engine=reason,
                slot_cache_would_need_gib=args.serve_seqs * 8192 * per_token / 2**30)


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["A", "B"], choices=["A", "B", "gsm8k", "serve7b"])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scale", type=float, default=1.0, help="scale prompts, lengths and counts (CPU: e.g. 0.05)")
    ap.add_argument("--gsm8k", default=os.environ.get("MT_ENV_GSM8K", "../shared/data/gsm8k"),
                    help="GSM8K data folder (the gsm8k workload)")
    ap.add_argument("--gsm8k-tokens", type=int, default=256, help="tokens per turn of the gsm8k workload")
    ap.add_argument("--env-processes", type=int, default=4, help="the gsm8k workload's env processes")
    ap.add_argument("--kv-gib", type=float, default=100.0, help="serve7b: the KV pool's size")
    ap.add_argument("--serve-seqs", type=int, default=512, help="serve7b: sequences at once")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile the engine's worker thread in A and B with the cache on; print its N costliest calls")
    ap.add_argument("--no-cuda-graphs", action="store_true",
                    help="A and B: no CUDA graphs (compute-sanitizer with the caching allocator off: no capture then)")
    record.add_arguments(ap)
    args = ap.parse_args()
    rec = record.start(args, "agent", device=args.device)
    out = dict(torch=torch.__version__, scale=args.scale, workloads=[])
    model, tokenizer = None, None
    for name in args.workloads:
        if name != "serve7b" and model is None:
            from mt_env import offline_tokenizer

            tokenizer = offline_tokenizer("qwen2.5")
            if args.device == "cuda":
                model = build_causal_lm(preset="qwen2.5-0.5b", dtype=torch.bfloat16)
            else:
                model = build_causal_lm(config=TINY, vocab_size=len(tokenizer))
            model = model.to(args.device).eval()
        if name in WORKLOADS:
            row = run_synthetic(name, model, len(tokenizer), args)
        elif name == "gsm8k":
            row = run_gsm8k(model, tokenizer, args)
        else:
            model = None
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
            row = run_serve7b(args)
        out["workloads"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("on", "off")}, default=str))
        rec.write(out)  # after each workload: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
