"""What exact mode (``rollout.exact_logprobs``, docs/exact.md) costs: the engine's generation, the trainer's
old-logprob pass and the update's forward and backward with exact mode off and on, in one process on the same
prompts, and the rollout/trainer logprob mismatch of each (0.0 in exact mode).

1. Engine: `--batch` prompts of mixed lengths (up to `--prompt`) sampled to `--new-tokens` tokens each through
   `HFBackend` (the paged engine; on CUDA in CUDA graphs, compiled as each mode compiles); tok/s = sampled tokens /
   seconds, the best of `--repeats` after a warm-up.
2. Trainer: `trainers.ppo.score` over those rollouts (packed, micro-batches of `--micro-tokens` tokens, on CUDA the
   layers compiled as the RL step's record runs them), in tokens of the batch per second, the best of `--repeats`.
3. Update: the same micro-batches through the policy with gradients (logprobs and entropy, as the smoke recipe's GRPO
   loss takes them), a loss of their masked sum, backward; tokens of the batch per second, the best of `--repeats`.
   The optimizer step, the same in both modes, is left out.

On CUDA ``on`` compiles exact mode's layers (`agents.exact.COMPILE_LAYERS` on, whatever its default); the record's
``flash_backward`` says whether the update's attention backward was flash attention's (`agents.triton_exact.
flash_backward_agrees`; ``MT_ENV_EXACT_FLASH_BACKWARD=0``: the SDPA recomputation). A third mode, ``on_eager``,
runs them uncompiled (a copy of the model made before any compilation): what compiling them gains, in the same run.

Goals (issue 28, H200, 0.5B shape): exact costs <= 1.3x the engine's time and <= 1.2x the update's.

``--profile N`` then profiles one more engine generation, trainer pass and update with exact mode on, and one more
update with it off (`torch.profiler`), and prints the N operations of each that took the most device time: where
the cost is. Off a GPU not the engine (the profiler records CPU operations of its own thread; the engine runs in a
worker thread).

    python benchmarks/bench_exact.py --device cuda --model qwen2.5-0.5b            # -> results/h200/exact.json
    python benchmarks/bench_exact.py --device cpu --model tiny --batch 16 --new-tokens 32 --prompt 64
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents.hf_backend import HFBackend  # noqa: E402
from agents.backend import SamplingParams  # noqa: E402
from benchmarks import record  # noqa: E402
from mt_env.batch import TrainBatch, collate, micro_batches  # noqa: E402
from mt_env.sample import Sample  # noqa: E402
from trainers import algos  # noqa: E402
from trainers.config import Config  # noqa: E402
from agents import exact  # noqa: E402
from trainers.modeling import PolicyModel, build_causal_lm, compile_layers  # noqa: E402
from trainers.ppo import Models, forward, score  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=4096)


def make_model(args, device):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model == "tiny":
        return build_causal_lm(config=TINY, vocab_size=args.vocab, dtype=dtype).to(device).eval()
    return build_causal_lm(preset=args.model, dtype=dtype).to(device).eval()


def prompts_of(args, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(1, args.prompt // 4), args.prompt + 1, (args.batch,), generator=g)
    return [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in lengths]


def engine_run(lm, prompts, args, exact: bool):
    """(best seconds, the turns of the last run) over `--repeats` generations after one warm-up."""
    params = [SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=i)
              for i in range(len(prompts))]

    async def main():
        async with HFBackend(lm, seed=0, max_batch_size=len(prompts), exact=exact, prefix_cache=False) as backend:
            best, turns = float("inf"), None
            for _ in range(args.repeats + 1):
                start = time.perf_counter()
                turns = await asyncio.gather(*(backend.generate(p, q) for p, q in zip(prompts, params)))
                best = min(best, time.perf_counter() - start)
            return best, turns

    return asyncio.run(main())


def batch_of(prompts, turns, device) -> TrainBatch:
    samples = [Sample.single_turn(p, t.ids, t.logprobs, episode=b) for b, (p, t) in enumerate(zip(prompts, turns))]
    return collate(samples, pad_token_id=0).to(device)


def trainer_config(args) -> Config:
    cfg = Config()
    cfg.trainer.packed, cfg.trainer.micro_batch_tokens, cfg.rollout.temperature = True, args.micro_tokens, 1.0
    return cfg


def trainer_run(lm, batch, args, exact: bool):
    """(best seconds of the old-logprob pass, the mismatch metrics)."""
    cfg = trainer_config(args)
    policy, best = PolicyModel(lm, exact=exact), float("inf")
    for _ in range(args.repeats + 1):
        start = time.perf_counter()
        scored, _ = score(batch, Models(policy, None, None), cfg)
        if batch.input_ids.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, algos.logprob_mismatch(scored, exact)


def update_run(lm, batch, args, exact: bool) -> float:
    """Best seconds of the update's forward and backward over `batch` (`trainer_run`'s micro-batches): logprobs and
    entropy with gradients, as the smoke recipe's GRPO loss takes them (``entropy_coef`` > 0), and backward of a
    loss of their masked sum. The gradients are discarded."""
    cfg = trainer_config(args)
    policy, best = PolicyModel(lm, exact=exact).train(), float("inf")
    rows = torch.arange(len(batch), device=batch.input_ids.device)
    chunks = micro_batches(batch, rows, cfg.trainer.micro_batch_size, cfg.trainer.micro_batch_tokens, True)
    trained = batch.loss_mask.sum()
    for _ in range(args.repeats + 1):
        start = time.perf_counter()
        for r in chunks:
            update_step(policy, batch[r], cfg, trained)
        if batch.input_ids.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
        lm.zero_grad(set_to_none=True)
    policy.eval()
    return best


def update_step(policy, mb: TrainBatch, cfg: Config, trained=1) -> None:
    """One micro-batch of the update without the optimizer: logprobs and entropy with gradients (as the smoke recipe's
    GRPO loss takes them), backward of their masked sum over `trained` tokens."""
    logprobs, entropy = forward(policy, mb, cfg, with_entropy=True)
    (((logprobs + 1e-3 * entropy) * mb.loss_mask).sum() / trained).backward()


def profile_exact(lm, prompts, batch, args, top: int) -> None:
    """Print the `top` operations by self device time of one exact engine generation, exact trainer pass and exact
    update, then of one update with exact mode off."""
    from torch.profiler import ProfilerActivity, profile

    cuda = batch.input_ids.is_cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    once = argparse.Namespace(**{**vars(args), "repeats": 0})
    runs = [("exact on, engine", lambda: engine_run(lm, prompts, once, True))] if cuda else []
    runs += [("exact on, trainer pass", lambda: trainer_run(lm, batch, once, True)),
             ("exact on, update", lambda: update_run(lm, batch, once, True)),
             ("exact off, update", lambda: update_run(lm, batch, once, False))]
    for name, run in runs:
        with profile(activities=activities) as prof:
            run()
        print(f"\n{name}: the {top} costliest operations")
        print(prof.key_averages().table(sort_by=sort, row_limit=top, max_name_column_width=60))


def measure(lm, prompts, args, device, figures: dict) -> TrainBatch:
    """Each mode's engine and trainer throughput and mismatch, and exact mode's costs, into `figures`; returns the
    last mode's rollouts as a batch."""
    modes = [("off", lm, False), ("on", lm, True)]
    if exact.compiles_layers(device):
        modes.append(("on_eager", copy.deepcopy(lm), True))  # copied before any layer is compiled
        compile_layers(lm)  # the off trainer pass as the RL step's record runs it
    for mode, model, on in modes:
        exact.COMPILE_LAYERS = mode != "on_eager"
        seconds, turns = engine_run(model, prompts, args, on)
        tokens = sum(len(t.ids) for t in turns)
        batch = batch_of(prompts, turns, device)
        trainer_s, mismatch = trainer_run(model, batch, args, on)
        update_s = update_run(model, batch, args, on)
        batch_tokens = int(batch.attention_mask.sum())
        figures[f"engine_tok_s_{mode}"] = tokens / seconds
        figures[f"trainer_tok_s_{mode}"] = batch_tokens / trainer_s
        figures[f"update_tok_s_{mode}"] = batch_tokens / update_s
        figures[f"mismatch_abs_max_{mode}"] = mismatch.get("mismatch/logprob_abs_max")
        print(f"exact {mode:>8}: engine {tokens / seconds:10.1f} tok/s | trainer old-logprob pass "
              f"{figures[f'trainer_tok_s_{mode}']:10.1f} tok/s | update {figures[f'update_tok_s_{mode}']:10.1f} "
              f"tok/s | mismatch abs max {figures[f'mismatch_abs_max_{mode}']}")
    for suffix in ("", "_eager") if "engine_tok_s_on_eager" in figures else ("",):
        for part in ("engine", "trainer", "update"):
            figures[f"{part}_cost_x{suffix}"] = figures[f"{part}_tok_s_off"] / figures[f"{part}_tok_s_on{suffix}"]
        print(f"exact mode{' with its layers uncompiled' if suffix else ''} costs "
              f"{figures[f'engine_cost_x{suffix}']:.2f}x the engine's time, {figures[f'trainer_cost_x{suffix}']:.2f}x "
              f"the trainer pass's, {figures[f'update_cost_x{suffix}']:.2f}x the update's")
    return batch


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="qwen2.5-0.5b", help="a preset of trainers.modeling.PRESETS, or tiny")
    ap.add_argument("--vocab", type=int, default=2000, help="tiny: vocabulary size")
    ap.add_argument("--batch", type=int, default=64, help="prompts generated together")
    ap.add_argument("--prompt", type=int, default=256, help="longest prompt (they range from a quarter of it)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--micro-tokens", type=int, default=8192, help="trainer: tokens per packed micro-batch")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print the N costliest operations of exact mode")
    record.add_arguments(ap)
    args = ap.parse_args(argv)
    rec = record.start(args, "exact", device=args.device)
    device = torch.device(args.device)
    lm = make_model(args, device)
    prompts = prompts_of(args, lm.config.vocab_size)
    figures = {"model": args.model, "batch": args.batch, "new_tokens": args.new_tokens,
               "threads": torch.get_num_threads()}
    default, exact.COMPILE_LAYERS = exact.COMPILE_LAYERS, True  # "on" compiles where it can, whatever the default
    kernels = _triton_exact() if device.type == "cuda" else None
    try:
        batch = measure(lm, prompts, args, device, figures)
        if kernels is not None:  # whether the update's attention backward was flash attention's (its check passed)
            head_dim = getattr(lm.config, "head_dim", None) or lm.config.hidden_size // lm.config.num_attention_heads
            figures["flash_backward"] = kernels.flash_backward_agrees(device, lm.dtype, head_dim)
        rec.write(figures)
        if args.profile:
            exact.COMPILE_LAYERS = True  # exact mode with its layers compiled where they can be
            profile_exact(lm, prompts, batch, args, args.profile)
    finally:
        exact.COMPILE_LAYERS = default
    return figures


def _triton_exact():
    """`agents.triton_exact`, or None where Triton does not import."""
    try:
        from agents import triton_exact
    except ImportError:
        return None
    return triton_exact


if __name__ == "__main__":
    main()
