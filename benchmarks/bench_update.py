"""Update-phase throughput of trainers/ppo.py, in one process on the same tokens: today's path against the new one
(issue 29), against raw forward+backward+AdamW, and padded vs packed.

1. Raw baseline: ``model(input_ids, labels=input_ids)`` (the plain causal-LM loss on every token), backward,
   AdamW step — the same model, the same [B, L] tokens, the same micro-batching.
2. mt_env: `trainers.ppo.update` — the PPO/GRPO update as training runs it (selective logits on sampled tokens,
   clipped policy loss with the loss mask, KL term, gradient clipping, AdamW), on those tokens with a realistic mask.
3. Padded vs packed: a multi-turn batch (many short episodes, a few long ones) updated with `trainer.packed`
   false vs true (block-diagonal attention, no padding).
4. Today vs new, on that multi-turn batch (packed): the update and the old-logprob pass (`trainers.ppo.score`) as
   before issue 29 (micro-batches of ``--micro`` rows, the LM head over all scored tokens of a micro-batch at once,
   eager layers, torch's AdamW) and with its changes (micro-batches of ``--micro-tokens`` tokens, LM-head chunks
   of `agents.logprobs.CHUNK_TOKENS`, decoder layers compiled: ``trainer.compile``, and the trainer's
   `trainers.optim.AdamW`: float32 masters of the bf16 weights, fused on CUDA). MFU = 6 x parameters x tokens /
   seconds / peak for the update (2 x ... for a forward pass), peak = the GPU's dense bf16 rate (`PEAK_TFLOPS`).

Goals (issue 5): mt_env >= 0.9x raw tokens/s; packed >= 1.5x padded. Issue 29: the new update >= 2x today's.
Each path of 4 starts from an empty CUDA cache and reports the allocator's retries and peak. ``--profile N``
instead profiles the new path (after timing it unprofiled in the same process) and reports where the device
waited (`benchmarks.trace_gaps`); it records nothing.

    python benchmarks/bench_update.py --device cuda --model qwen2.5-0.5b
    python benchmarks/bench_update.py --device cuda --also-micro-tokens 32768   # and the new path at 32k tokens too
    python benchmarks/bench_update.py --device cuda --profile 12 --iters 3 --trace-dir /tmp/traces  # where it waits
    python benchmarks/bench_update.py --device cpu --model tiny --vocab 2000 --batch 2 --seq 128 --micro 2 \\
        --micro-tokens 4096 --iters 1 --warmup 1 --out /tmp/update_cpu.json                    # a CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import gzip
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelerate import Accelerator  # noqa: E402

from benchmarks import record, trace_gaps  # noqa: E402
from mt_env.batch import TrainBatch  # noqa: E402
from trainers.config import load_config  # noqa: E402
from trainers.modeling import PolicyModel, build_causal_lm, compile_layers  # noqa: E402
from trainers.optim import AdamW  # noqa: E402
from trainers.ppo import Models, score, update  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
#: dense (no sparsity) bf16 tensor-core TFLOP/s, from NVIDIA's spec sheets (H200 SXM: 1,979 with sparsity)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_model(args, device, attn="sdpa"):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model == "tiny":
        lm = build_causal_lm(config=dict(TINY, max_position_embeddings=4096), vocab_size=args.vocab, dtype=dtype,
                             attn_implementation=attn)
    else:
        lm = build_causal_lm(preset=args.model, dtype=dtype, attn_implementation=attn)
    return lm.to(device)


def batch_from_lengths(prompt_lens, response_lens, vocab, device, seed=0) -> TrainBatch:
    """A right-padded [B, L] training batch as the trainer scores it: random ids, about 70% of each response
    sampled (loss mask 1), the rest tool output; old and reference logprobs and advantages filled in."""
    g = torch.Generator().manual_seed(seed)
    B, L = len(prompt_lens), max(p + r for p, r in zip(prompt_lens, response_lens))
    ids = torch.randint(0, vocab, (B, L), generator=g)
    attn = torch.zeros(B, L, dtype=torch.long)
    loss_mask = torch.zeros(B, L)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        attn[b, :p + r] = 1
        loss_mask[b, p:p + r] = (torch.rand(r, generator=g) < 0.7).float()
    zeros, old = torch.zeros(B, L), torch.full((B, L), -1.0)
    batch = TrainBatch(
        input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0), loss_mask=loss_mask,
        rewards=zeros, rollout_logprobs=zeros, turn_ids=torch.zeros_like(ids), group=torch.arange(B),
        episode=torch.arange(B), episode_rewards=torch.zeros(B), old_logprobs=old, ref_logprobs=old,
        advantages=torch.randn(B, L, generator=g) * loss_mask)
    return batch.to(device)


def multi_turn_batch(n, vocab, device) -> TrainBatch:
    """`n` episodes: most short, about 10% long multi-turn ones."""
    g = torch.Generator().manual_seed(1)
    long = torch.rand(n, generator=g) < 0.1
    prompt = [int(x) for x in torch.randint(100, 200, (n,), generator=g)]
    response = [int(torch.randint(1200, 1800, (1,), generator=g) if lg else torch.randint(60, 300, (1,), generator=g))
                for lg in long]
    return batch_from_lengths(prompt, response, vocab, device, seed=2)


def raw_step(lm, opt, batch, micro):
    B = len(batch)
    for rows in torch.arange(B, device=batch.input_ids.device).split(micro):
        ids = batch.input_ids[rows]
        labels = ids.masked_fill(batch.attention_mask[rows] == 0, -100)
        out = lm(input_ids=ids, attention_mask=batch.attention_mask[rows], position_ids=batch.position_ids[rows],
                 labels=labels, use_cache=False)
        (out.loss * len(rows) / B).backward()
    torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def mt_env_step(policy, opt, accelerator, cfg, batch):
    models = Models(policy, opt, scheduler=None)  # the update steps optimizers; the scheduler is the loop's
    update(batch, models, accelerator, cfg, step=1)


def timed(fn, device, warmup, iters, calls: list | None = None):
    """Mean seconds of `iters` calls of `fn` after `warmup` calls, each call synchronised; with `calls`, every
    call's own seconds (warm-up included) are appended to it: a recompilation or an eager fallback shows there."""
    seconds = []
    for _ in range(warmup + iters):
        t = time.perf_counter()
        fn()
        sync(device)
        seconds.append(time.perf_counter() - t)
    if calls is not None:
        calls.extend(seconds)
    return sum(seconds[warmup:]) / iters


def fresh_allocator(device) -> int:
    """Empty CUDA's caching allocator and reset its peak; returns its count of retries so far (0 off CUDA). A path
    timed on blocks cached by another, larger or differently shaped, can hit cudaMalloc failures: the allocator then
    frees its cache and retries, synchronising the device each time, and the path reads slower than it is."""
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


def allocator_report(device, retries_before: int) -> tuple[int, float]:
    """(allocator retries since `fresh_allocator`, peak GiB allocated); (0, 0.0) off CUDA."""
    if device.type != "cuda":
        return 0, 0.0
    stats = torch.cuda.memory_stats(device)
    return stats.get("num_alloc_retries", 0) - retries_before, torch.cuda.max_memory_allocated(device) / 2**30


def recipe(args, *overrides):
    return load_config("quickstart.yaml", [f"trainer.micro_batch_size={args.micro}",
                                           "env.budget.max_response_tokens=2048", *overrides])


# ================================================================================================== the sections
def raw_vs_update(args, lm, device, accelerator, say) -> dict:
    data = batch_from_lengths([args.seq // 2] * args.batch, [args.seq // 2] * args.batch, lm.config.vocab_size, device)
    tokens = int(data.attention_mask.sum())
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-6)
    t_raw = timed(lambda: raw_step(lm, opt, data, args.micro), device, args.warmup, args.iters)
    cfg = recipe(args, f"trainer.minibatch_size={args.batch}", "algorithm.kl_mode=loss", "algorithm.kl_coef=0.001")
    policy = PolicyModel(lm, logprob_chunk_tokens=None)
    t_ours = timed(lambda: mt_env_step(policy, opt, accelerator, cfg, data), device, args.warmup, args.iters)
    raw_tps, ours_tps = tokens / t_raw, tokens / t_ours
    ratio = ours_tps / raw_tps
    say(f"\n[update vs raw] {args.batch} x {args.seq} tokens, micro-batch {args.micro}")
    say(f"  raw forward+backward+AdamW : {raw_tps:>10,.0f} tok/s  ({t_raw * 1e3:.0f} ms/step)")
    say(f"  mt_env PPO/GRPO update     : {ours_tps:>10,.0f} tok/s  ({t_ours * 1e3:.0f} ms/step)  "
        f"ratio {ratio:.2f}x  (goal >= 0.9x)  {'PASS' if ratio >= 0.9 else 'FAIL'}")
    return dict(raw_tokens_per_s=raw_tps, update_tokens_per_s=ours_tps, update_vs_raw=ratio)


def padded_vs_packed(args, lm, device, accelerator, multi, say) -> dict:
    real, slots, results = int(multi.attention_mask.sum()), multi.attention_mask.numel(), {}
    policy, opt = PolicyModel(lm, logprob_chunk_tokens=None), torch.optim.AdamW(lm.parameters(), lr=1e-6)
    built = lm.config._attn_implementation  # `SDPA_VARLEN`: sdpa, and flash's varlen kernel on packed rows
    for layout, attn in (("padded", built), ("packed", built), ("packed", "flex_attention")):
        if attn == "flex_attention" and device.type != "cuda":
            continue
        lm.config._attn_implementation = attn
        cfg = recipe(args, f"trainer.minibatch_size={len(multi)}", "algorithm.kl_mode=none",
                     f"trainer.packed={layout == 'packed'}")
        t = timed(lambda: mt_env_step(policy, opt, accelerator, cfg, multi), device, 1, max(2, args.iters // 2))
        results[f"{layout}/{attn}"] = real / t
        say(f"  {layout:<6} ({attn:<14}): {real / t:>10,.0f} real tok/s  ({t * 1e3:.0f} ms/step)")
    lm.config._attn_implementation = built  # the sections after this one train as the trainer does
    speedup = max(v for k, v in results.items() if k.startswith("packed")) / results[f"padded/{built}"]
    say(f"\n[padded vs packed] {len(multi)} episodes, {real:,} real tokens in {slots:,} padded slots "
        f"({100 * real / slots:.0f}% real)")
    say(f"  packed / padded: {speedup:.2f}x  (goal >= 1.5x)  {'PASS' if speedup >= 1.5 else 'FAIL'}")
    return dict(packing=results, packed_vs_padded=speedup, real_tokens=real, padded_slots=slots)


def today_vs_new(args, lm, device, accelerator, multi, peak, say) -> dict:
    """The update and the old-logprob pass, as before issue 29 and with its changes, on the same packed tokens."""
    real, n_params = int(multi.attention_mask.sum()), sum(p.numel() for p in lm.parameters())
    new_lm = copy.deepcopy(lm)
    if args.compile:
        compile_layers(new_lm)
    paths = {"today": (PolicyModel(lm, logprob_chunk_tokens=None), [], torch.optim.AdamW),
             "new": (PolicyModel(new_lm), [f"trainer.micro_batch_tokens={args.micro_tokens}"], AdamW)}
    for tokens in args.also_micro_tokens:  # the new path with other token micro-batches (same layers, own optimizer)
        paths[f"new@{tokens}"] = (PolicyModel(new_lm), [f"trainer.micro_batch_tokens={tokens}"], AdamW)
    say(f"\n[today vs new] {len(multi)} episodes packed, {real:,} real tokens; today: micro-batches of {args.micro} "
        f"rows, full LM head, eager layers; new: {args.micro_tokens:,}-token micro-batches, LM-head chunks, "
        f"{'compiled' if args.compile else 'eager'} layers")
    out = {}
    for name, (policy, knobs, optimizer) in paths.items():
        cfg = recipe(args, f"trainer.minibatch_size={len(multi)}", "trainer.packed=true", "algorithm.kl_mode=loss",
                     "algorithm.kl_coef=0.001", "algorithm.entropy_coef=0.001", *knobs)
        models = Models(policy, optimizer(policy.parameters(), lr=1e-6), scheduler=None)
        update_calls, score_calls = [], []
        retries = fresh_allocator(device)  # each path from an empty cache: no blocks left by the paths before it
        t_update = timed(lambda: update(multi, models, accelerator, cfg, step=1), device, args.warmup, args.iters,
                         update_calls)
        t_score = timed(lambda: score(multi, models, cfg), device, args.warmup, args.iters, score_calls)
        retries, peak_gib = allocator_report(device, retries)
        mfu = (lambda flops: None if peak is None else flops / peak)
        out[name] = dict(update_tok_s=real / t_update, update_s=t_update, score_tok_s=real / t_score, score_s=t_score,
                         update_mfu=mfu(6 * n_params * real / t_update), score_mfu=mfu(2 * n_params * real / t_score),
                         update_calls_s=update_calls, score_calls_s=score_calls, alloc_retries=retries,
                         peak_gib=peak_gib)
        fmt = (lambda x: "n/a" if x is None else f"{100 * x:.1f}%")
        say(f"  {name:<5}: update {real / t_update:>10,.0f} tok/s (MFU {fmt(out[name]['update_mfu'])}), old-logprob "
            f"pass {real / t_score:>10,.0f} tok/s (MFU {fmt(out[name]['score_mfu'])})")
        say(f"         each call, warm-up first (ms): update {' '.join(f'{1e3 * s:.0f}' for s in update_calls)}; "
            f"old-logprob pass {' '.join(f'{1e3 * s:.0f}' for s in score_calls)}; allocator retries {retries}, "
            f"peak {peak_gib:.1f} GiB")
        del models
    ratio = out["new"]["update_tok_s"] / out["today"]["update_tok_s"]
    ratio_score = out["new"]["score_tok_s"] / out["today"]["score_tok_s"]
    say(f"  new / today: update {ratio:.2f}x (goal >= 2x) {'PASS' if ratio >= 2 else 'FAIL'}, old-logprob pass "
        f"{ratio_score:.2f}x (goal >= 2x) {'PASS' if ratio_score >= 2 else 'FAIL'}")
    return dict(today_vs_new=out, new_vs_today_update=ratio, new_vs_today_score=ratio_score,
                micro_tokens=args.micro_tokens, also_micro_tokens=args.also_micro_tokens, compiled_layers=args.compile)


def profile_new(args, lm, device, accelerator, multi, top: int, say) -> None:
    """The new path's update and old-logprob pass under torch.profiler (after warm-up): the `top` operations by
    self device time, then where the device waited for the host (`trace_gaps`, from the exported trace, kept in
    ``--trace-dir`` when given). Prints; records nothing."""
    from torch.profiler import ProfilerActivity, profile
    if args.compile:
        compile_layers(lm)
    policy = PolicyModel(lm)
    cfg = recipe(args, f"trainer.minibatch_size={len(multi)}", "trainer.packed=true", "algorithm.kl_mode=loss",
                 "algorithm.kl_coef=0.001", "algorithm.entropy_coef=0.001",
                 f"trainer.micro_batch_tokens={args.micro_tokens}")
    models = Models(policy, AdamW(policy.parameters(), lr=1e-6), scheduler=None)
    traces = Path(args.trace_dir or tempfile.mkdtemp(prefix="update_traces_"))
    traces.mkdir(parents=True, exist_ok=True)
    for name, fn in (("update", lambda: update(multi, models, accelerator, cfg, step=1)),
                     ("score", lambda: score(multi, models, cfg))):
        retries = fresh_allocator(device)
        calls: list[float] = []
        timed(fn, device, args.warmup, args.iters, calls)
        retries, peak_gib = allocator_report(device, retries)
        say(f"\n[unprofiled] {name}: each call, warm-up first (ms): {' '.join(f'{1e3 * s:.0f}' for s in calls)}; "
            f"{int(multi.attention_mask.sum()):,} tokens; allocator retries {retries}, peak "
            f"{peak_gib:.1f} GiB")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities, with_stack=True) as prof:
            wall = timed(fn, device, 0, 1)
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        say(f"\n[profile] {name}: {wall * 1e3:.0f} ms wall (Python stacks recorded: the host runs slower than "
            f"unprofiled)")
        say(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=70))
        trace = traces / f"{name}_trace.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as z:
            shutil.copyfileobj(f, z)
        trace.unlink()
        say(f"[profile] {name}: {trace_gaps.report(trace_gaps.analyse(trace_gaps.load(f'{trace}.gz')), top)}")
        say(f"[profile] {name}: trace kept in {trace}.gz (python benchmarks/trace_gaps.py {trace}.gz)")


# ================================================================================================== main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="qwen2.5-0.5b", help="qwen2.5-0.5b | qwen2.5-3b | tiny")
    ap.add_argument("--vocab", type=int, default=151936, help="the tiny model's vocabulary")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=8, help="rows per micro-batch (today's path)")
    ap.add_argument("--micro-tokens", type=int, default=16384, help="tokens per micro-batch (the new path)")
    ap.add_argument("--also-micro-tokens", type=int, nargs="*", default=[], metavar="N",
                    help="time the new path again with each of these token micro-batches (`new@N` in the record)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="compile the new path's decoder layers (trainer.compile)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="only profile the new path's update and old-logprob pass: print the N costliest operations "
                    "and where the device waited for the host")
    ap.add_argument("--trace-dir", help="with --profile: keep the profiler traces here (*_trace.json.gz)")
    record.add_arguments(ap)
    args = ap.parse_args()
    rec = record.start(args, "update", device=args.device, tee=not args.profile)  # a profile records nothing
    device = torch.device(args.device)
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=device.type == "cpu")

    def say(text: str) -> None:
        print(text, flush=True)  # the record's .txt keeps what is printed

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None) if device.type == "cuda" else None
    figures: dict = {"torch": torch.__version__, "peak_bf16_dense_tflops": peak_tflops}
    say(f"device: {name}, torch {torch.__version__}, peak "
        f"{'n/a (MFU null)' if peak_tflops is None else f'{peak_tflops:g} TFLOP/s dense bf16 (NVIDIA spec sheet)'}")
    lm = make_model(args, device)
    n_params = sum(p.numel() for p in lm.parameters())
    say(f"model: {args.model} (random init), {n_params / 1e6:.0f}M parameters, {lm.dtype}")
    figures.update(model=args.model, parameters=n_params)
    if args.profile:
        return profile_new(args, lm, device, accelerator, multi_turn_batch(args.batch * 4, lm.config.vocab_size, device),
                           args.profile, say)
    figures.update(raw_vs_update(args, lm, device, accelerator, say))
    multi = multi_turn_batch(args.batch * 4, lm.config.vocab_size, device)
    figures.update(padded_vs_packed(args, lm, device, accelerator, multi, say))
    peak = None if peak_tflops is None else peak_tflops * 1e12
    figures.update(today_vs_new(args, lm, device, accelerator, multi, peak, say))
    print(f"wrote {rec.write(figures)}")


if __name__ == "__main__":
    main()
