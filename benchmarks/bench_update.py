"""Update-phase throughput of trainers/ppo.py against raw forward+backward+AdamW of the same model, in one run;
and padded vs packed updates on a multi-turn length distribution.

1. Raw baseline: ``model(input_ids, labels=input_ids)`` (the plain causal-LM loss on every token), backward,
   AdamW step — the same model, the same [B, L] tokens, the same micro-batching.
2. mt_env: `trainers.ppo.update` — the PPO/GRPO update as training runs it (selective logits on sampled tokens,
   clipped policy loss with the loss mask, KL term, gradient clipping, AdamW), on those tokens with a realistic mask.
3. Padded vs packed: a multi-turn batch (many short episodes, a few long ones) updated with `trainer.packed`
   false vs true (block-diagonal attention, no padding).

Goals (issue 5): mt_env >= 0.9x raw tokens/s; packed >= 1.5x padded on the multi-turn distribution.

    python benchmarks/bench_update.py --device cuda --model qwen2.5-0.5b      # the H200 figures
    python benchmarks/bench_update.py --device cpu --model tiny               # a CPU smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelerate import Accelerator  # noqa: E402

from benchmarks import record  # noqa: E402
from mt_env.batch import TrainBatch  # noqa: E402
from trainers.config import load_config  # noqa: E402
from trainers.modeling import PolicyModel, build_causal_lm  # noqa: E402
from trainers.ppo import Models, update  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_model(args, device, attn="sdpa"):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model == "tiny":
        lm = build_causal_lm(config=dict(TINY, max_position_embeddings=4096), vocab_size=151936, dtype=dtype,
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


def timed(fn, device, warmup, iters):
    for _ in range(warmup):
        fn()
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t) / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="qwen2.5-0.5b", help="qwen2.5-0.5b | qwen2.5-3b | tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    record.add_arguments(ap)
    args = ap.parse_args()
    rec = record.start(args, "update", device=args.device)
    device = torch.device(args.device)
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=device.type == "cpu")
    print(f"torch {torch.__version__}")
    figures: dict = {}

    # ---- 1 + 2: raw vs mt_env update on B x L padded tokens
    lm = make_model(args, device)
    vocab = lm.config.vocab_size
    n_params = sum(p.numel() for p in lm.parameters())
    print(f"model: {args.model} (random init), {n_params / 1e6:.0f}M parameters, {lm.dtype}")
    data = batch_from_lengths([args.seq // 2] * args.batch, [args.seq // 2] * args.batch, vocab, device)
    tokens = int(data.attention_mask.sum())
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-6)
    t_raw = timed(lambda: raw_step(lm, opt, data, args.micro), device, args.warmup, args.iters)
    cfg = load_config("quickstart.yaml", [f"trainer.micro_batch_size={args.micro}",
                                         f"trainer.minibatch_size={args.batch}", "algorithm.kl_mode=loss",
                                         "algorithm.kl_coef=0.001", "env.budget.max_response_tokens=2048"])
    policy = PolicyModel(lm)
    t_ours = timed(lambda: mt_env_step(policy, opt, accelerator, cfg, data), device, args.warmup, args.iters)
    raw_tps, ours_tps = tokens / t_raw, tokens / t_ours
    ratio = ours_tps / raw_tps
    print(f"\n[update vs raw] {args.batch} x {args.seq} tokens, micro-batch {args.micro}")
    print(f"  raw forward+backward+AdamW : {raw_tps:>10,.0f} tok/s  ({t_raw * 1e3:.0f} ms/step)")
    print(f"  mt_env PPO/GRPO update     : {ours_tps:>10,.0f} tok/s  ({t_ours * 1e3:.0f} ms/step)  "
          f"ratio {ratio:.2f}x  (goal >= 0.9x)  {'PASS' if ratio >= 0.9 else 'FAIL'}")
    figures.update(raw_tokens_per_s=raw_tps, update_tokens_per_s=ours_tps, update_vs_raw=ratio)

    # ---- 3: padded vs packed on a multi-turn length distribution
    g = torch.Generator().manual_seed(1)
    n = args.batch * 4
    long = torch.rand(n, generator=g) < 0.1  # a few long multi-turn episodes, many short ones
    prompt = [int(x) for x in torch.randint(100, 200, (n,), generator=g)]
    response = [int(torch.randint(1200, 1800, (1,), generator=g) if lg else torch.randint(60, 300, (1,), generator=g))
                for lg in long]
    multi = batch_from_lengths(prompt, response, vocab, device, seed=2)
    real = int(multi.attention_mask.sum())
    slots = multi.attention_mask.numel()
    results = {}
    for layout, attn in (("padded", "sdpa"), ("packed", "sdpa"), ("packed", "flex_attention")):
        if attn == "flex_attention" and device.type != "cuda":
            continue
        lm.config._attn_implementation = attn
        cfg_l = load_config("quickstart.yaml", [f"trainer.micro_batch_size={args.micro}", f"trainer.minibatch_size={n}",
                                               "env.budget.max_response_tokens=2048", "algorithm.kl_mode=none",
                                               f"trainer.packed={layout == 'packed'}"])
        t = timed(lambda: mt_env_step(policy, opt, accelerator, cfg_l, multi), device, 1, max(2, args.iters // 2))
        results[f"{layout}/{attn}"] = real / t
        print(f"  {layout:<6} ({attn:<14}): {real / t:>10,.0f} real tok/s  ({t * 1e3:.0f} ms/step)")
    lm.config._attn_implementation = "sdpa"
    best_packed = max(v for k, v in results.items() if k.startswith("packed"))
    speedup = best_packed / results["padded/sdpa"]
    print(f"\n[padded vs packed] {n} episodes, {real:,} real tokens in {slots:,} padded slots "
          f"({100 * real / slots:.0f}% real)")
    print(f"  packed / padded: {speedup:.2f}x  (goal >= 1.5x)  {'PASS' if speedup >= 1.5 else 'FAIL'}")
    figures.update(packing=results, packed_vs_padded=speedup, real_tokens=real, padded_slots=slots)
    print(f"wrote {rec.write(figures)}")


if __name__ == "__main__":
    main()
