"""GPU check of HFBackend's paged engine (`agents.engine`) against its transformers path, in one run.

For the Qwen2.5-0.5B shape (random init) in each dtype (default bf16 and fp32):

* ``equality``: greedy continuations (``--new-tokens``, default 64) of ``--prompts`` (default 64) random prompts of
  8-300 tokens, all in one batch, on the transformers path and on the fast path as it runs by default (decode step
  compiled by Inductor, captured in CUDA graphs): share of identical continuations (goal: >= 0.95 in bf16, 1.0 in
  fp32), where they first differ, the largest logprob difference over the tokens before that; the compilation's
  count and seconds, and the fast run's wall time (compilation and captures included).
* ``graphs_vs_eager``: the fast path with and without CUDA graphs (a graph replays the eager step's kernels:
  expect identical output).
* ``compiled_vs_uncompiled``: the fast path with and without Inductor (fused kernels round bf16 differently in
  places: expect (nearly) identical output in fp32, the noise floor's kind of differences in bf16).
* ``noise_floor`` (bf16): the transformers path itself, the first 16 prompts in a batch of their own vs in the
  batch of all: how often bf16 rounding alone (other padding, other batch shapes) changes a greedy continuation.
  On random weights near-ties are everywhere, so the equality goal is only measurable on a trained model (below).
* ``weights`` (last: it changes the weights): after an in-place change of ``lm_head`` the fast path's output
  changes, equals the transformers path's on the new weights, and no graph is captured again (the graphs read the
  parameters in place); after ``load_state_dict(assign=True)`` (new tensors) the backend notices the reallocation,
  captures again, and again equals the transformers path.

Then ``trained``: the same random 0.5B shape trained (AdamW, lr 3e-4 after a 20-step warm-up, fp32 weights under
bf16 autocast; until the loss is below 0.05, or 40 s with ``--quick``, 60 s without) on a bigram task: 1,000 token
ids in a random cyclic order, sequences that walk along it (each next id depends on the current one only: a table
the model learns quickly, no induction heads needed). The loss is printed every 25 steps; the final loss against
ln(vocab) shows whether it learned. On it, in bf16 and fp32, with prompts that are short walks:
``decisiveness`` (the reference's greedy continuations: the share that follows the cycle; the top-1 logit margin
at each position against the dtype's logit noise — the largest change of a logit between the rows batched and
run one at a time — and the share of positions whose margin exceeds it), then ``equality`` and ``noise_floor`` —
the bf16 equality goal measured where greedy decoding is decisive, not a string of near-ties.

Each check reports its own error (with traceback) and the others still run; the JSON is rewritten after each.

    python benchmarks/gpu_engine_check.py            # H200: about 3 minutes; writes results/h200/gpu_engine_check.json
    python benchmarks/gpu_engine_check.py --quick    # fewer buckets, bf16 only
    python benchmarks/gpu_engine_check.py --model tiny --device cpu --prompts 8 --new-tokens 8 --train-steps 20 \\
        --out /tmp/c.json
    python benchmarks/gpu_engine_check.py --model tiny --device cpu --only trained --dtypes fp32 --prompts 8 \\
        --new-tokens 8 --train-lr 3e-3 --out /tmp/t.json                  # the training on CPU
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import math
import random
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not an installed copy

from agents.backend import SamplingParams  # noqa: E402
from agents.hf_backend import HFBackend  # noqa: E402
from benchmarks import record  # noqa: E402
from trainers.modeling import build_causal_lm  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GOALS = {"bf16": 0.95, "fp32": 1.0}  # share of identical greedy continuations, fast path vs transformers path
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512)
TASK_TOKENS = (10, 8000)  #: the trained model's task uses ids from this range (capped by the vocabulary)
TASK_IDS = 1000  #: how many: its bigram table has this many entries


def build(name: str, dtype: torch.dtype, device: str):
    if name == "tiny":
        return build_causal_lm(config=TINY, dtype=dtype).to(device).eval()
    return build_causal_lm(preset=name, dtype=dtype).to(device).eval()


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(8 + (37 * i) % 293)] for i in range(n)]


async def greedy_async(model, prompts, new_tokens: int, **backend_kwargs):
    """Greedy continuations of `prompts`, all in one batch; returns the generations, the backend's stats and its
    compile status."""
    async with HFBackend(model, max_batch_size=max(len(prompts), 1), **backend_kwargs) as backend:
        gens = await backend.generate_many(prompts, SamplingParams(temperature=0, max_new_tokens=new_tokens))
        return gens, dict(backend.stats), backend.compile_reason


def greedy(model, prompts, new_tokens: int, **backend_kwargs):
    return asyncio.run(greedy_async(model, prompts, new_tokens, **backend_kwargs))


def compare(a, b) -> dict:
    """Identical continuations, first differences, and logprob differences over each common prefix."""
    identical, first_diff, lp_diff = 0, [], 0.0
    for x, y in zip(a, b, strict=True):
        same = next((i for i, (s, t) in enumerate(zip(x.ids, y.ids)) if s != t), min(len(x.ids), len(y.ids)))
        if x.ids == y.ids:
            identical += 1
        else:
            first_diff.append(same)
        lp_diff = max([lp_diff] + [abs(p - q) for p, q in zip(x.logprobs[:same], y.logprobs[:same])])
    return dict(rows=len(a), identical=identical, share_identical=identical / max(1, len(a)),
                first_difference_at=sorted(first_diff), logprob_max_abs_diff=lp_diff)


# --------------------------------------------------------------------------------------------- checks
def check_equality(model, prompts, args, dtype_name) -> dict:
    reference, _, _ = greedy(model, prompts, args.new_tokens, fast_path=False)
    start = time.perf_counter()
    fast, stats, compile_reason = greedy(model, prompts, args.new_tokens, fast_path=True)
    result = compare(fast, reference)
    result.update(goal=GOALS[dtype_name], passed=result["share_identical"] >= GOALS[dtype_name],
                  compile=compile_reason, compilations=stats["compilations"], compile_s=round(stats["compile_s"], 1),
                  fast_run_s=round(time.perf_counter() - start, 1), graph_captures=stats["graph_captures"],
                  graph_replays=stats["graph_replays"], decode_passes=stats["decode_passes"])
    return result


def check_graphs_vs_eager(model, prompts, args, dtype_name) -> dict:
    graphs, _, _ = greedy(model, prompts, args.new_tokens, fast_path=True)
    eager, _, _ = greedy(model, prompts, args.new_tokens, fast_path=True, cuda_graphs=False)
    return compare(graphs, eager)


def check_compiled_vs_uncompiled(model, prompts, args, dtype_name) -> dict:
    compiled, _, reason = greedy(model, prompts, args.new_tokens, fast_path=True, compile=True)
    uncompiled, _, _ = greedy(model, prompts, args.new_tokens, fast_path=True, compile=False)
    return compare(compiled, uncompiled) | dict(compile=reason)


def check_noise_floor(model, prompts, args, dtype_name) -> dict:
    everyone, _, _ = greedy(model, prompts, args.new_tokens, fast_path=False)
    own, _, _ = greedy(model, prompts[:16], args.new_tokens, fast_path=False)
    return compare(own, everyone[:16])


def check_weights(model, prompts, args, dtype_name) -> dict:
    subset = prompts[:8]

    async def go():
        async with HFBackend(model, max_batch_size=len(subset), fast_path=True) as backend:
            params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
            before = await backend.generate_many(subset, params)
            captures = backend.stats["graph_captures"]
            with torch.no_grad():
                model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight) * model.lm_head.weight.std())
            in_place = await backend.generate_many(subset, params)
            in_place_reference = (await greedy_async(model, subset, args.new_tokens, fast_path=False))[0]
            recaptured_in_place = backend.stats["graph_captures"] - captures
            fresh = {k: v.clone() for k, v in model.state_dict().items()}
            fresh["lm_head.weight"] = fresh["lm_head.weight"].flip(0)
            model.load_state_dict(fresh, assign=True)
            reassigned = await backend.generate_many(subset, params)
            reassigned_reference = (await greedy_async(model, subset, args.new_tokens, fast_path=False))[0]
            return dict(changed_share=1 - compare(in_place, before)["share_identical"],
                        in_place_vs_reference=compare(in_place, in_place_reference),
                        captures_after_in_place_change=recaptured_in_place,
                        reassigned_vs_reference=compare(reassigned, reassigned_reference),
                        module_reallocations=backend.stats["module_reallocations"],
                        captures_total=backend.stats["graph_captures"])

    return asyncio.run(go())


CHECKS = [("equality", check_equality), ("graphs_vs_eager", check_graphs_vs_eager),
          ("compiled_vs_uncompiled", check_compiled_vs_uncompiled), ("noise_floor", check_noise_floor),
          ("weights", check_weights)]


# --------------------------------------------------------------------------------------------- the trained model
def bigram_cycle(vocab: int, ids: int, seed: int = 0) -> torch.Tensor:
    """`ids` distinct token ids from `TASK_TOKENS` (capped by the vocabulary) in a random cyclic order: each id's
    successor is the next one in the cycle (the last one's is the first)."""
    low, high = TASK_TOKENS[0], min(TASK_TOKENS[1], vocab)
    gen = torch.Generator().manual_seed(seed)
    return low + torch.randperm(high - low, generator=gen)[:min(ids, high - low)]


def cycle_walks(cycle: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """Rows of `length` ids following the cycle from each start index: shorter than the cycle, a walk never
    repeats, so the next id depends on the current one only (a bigram table: no copying from the context)."""
    return cycle[(starts[:, None] + torch.arange(length)[None, :]) % len(cycle)]


def train_bigram_task(model, cycle: torch.Tensor, args) -> dict:
    """AdamW (linear warm-up, gradient clipping; bf16 autocast over fp32 weights on CUDA) on walks of the cycle,
    the loss on every next token, until the mean of the last 5 losses is below `--train-loss`, `--train-steps`
    steps or `--train-seconds`. Prints the loss every 25 steps; returns the curve."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.train_lr, betas=(0.9, 0.95), weight_decay=0.0,
                                  fused=device.type == "cuda")
    warm = 20
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))
    model.train()
    losses, start, stop = [], time.perf_counter(), "steps"
    for step in range(args.train_steps):
        ids = cycle_walks(cycle, torch.randint(len(cycle), (args.train_batch,), generator=gen),
                          args.train_len).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 25 == 0:
            print(f"    step {step:>4} loss {losses[-1]:.4f} ({time.perf_counter() - start:.1f} s)", flush=True)
        if len(losses) >= 5 and sum(losses[-5:]) / 5 < args.train_loss:
            stop = "loss"
            break
        if time.perf_counter() - start > args.train_seconds:
            stop = "seconds"
            break
    model.eval()
    del optimizer
    return dict(task=f"bigram cycle over {len(cycle)} ids", steps=len(losses), stopped_by=stop,
                seconds=round(time.perf_counter() - start, 1), first_loss=round(losses[0], 4),
                final_loss=round(sum(losses[-5:]) / len(losses[-5:]), 4), uniform_loss=round(math.log(
                    model.config.vocab_size), 4), loss_every_25_steps=[round(x, 4) for x in losses[::25]])


def bigram_prompts(cycle: torch.Tensor, n: int) -> list[list[int]]:
    """Walks of 4-36 ids from spread-out starts: the greedy continuation should go on along the cycle."""
    starts = torch.arange(n) * (len(cycle) // max(1, n))
    return [walk[:4 + (7 * i) % 33].tolist() for i, walk in enumerate(cycle_walks(cycle, starts, 36))]


def check_decisiveness(model, prompts, args, dtype_name) -> dict:
    """How decisive the reference's greedy continuations are: at each of their positions, the top-1 margin (top-1
    minus top-2 logit) of a forward over prompt + continuation with all rows in one batch, against the logit noise
    of the dtype: the largest change of any logit when the same rows run one at a time (other padding, other
    shapes). A position whose margin exceeds the noise cannot flip between two computations."""
    reference, _, _ = greedy(model, prompts, args.new_tokens, fast_path=False)
    device = next(model.parameters()).device
    rows = [p + g.ids for p, g in zip(prompts, reference)]
    n = min(len(g.ids) for g in reference)
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                        logits_to_keep=n + 1).logits[:, :n].float()
        alone = torch.cat([model(input_ids=torch.tensor([r], device=device), logits_to_keep=n + 1).logits[:, :n]
                           for r in rows]).float()
    top2 = batched.topk(2, dim=-1).values
    margins = (top2[..., 0] - top2[..., 1]).flatten()
    noise = (batched - alone).abs().amax(dim=-1).flatten()
    return dict(positions=margins.numel(), margin_median=round(margins.median().item(), 3),
                margin_min=round(margins.min().item(), 3), logit_noise_max=round(noise.max().item(), 4),
                share_decisive=round((margins > noise.max()).float().mean().item(), 4),
                follows_the_cycle=round(follow_share(prompts, reference, model.config.vocab_size), 4))


def follow_share(prompts, generations, vocab: int) -> float:
    """Share of generated tokens that are the cycle successor of the token before them."""
    cycle = bigram_cycle(vocab, TASK_IDS).tolist()
    successor = {a: b for a, b in zip(cycle, cycle[1:] + cycle[:1])}
    pairs = [(a, b) for p, g in zip(prompts, generations) for a, b in zip([p[-1]] + g.ids[:-1], g.ids)]
    return sum(successor.get(a) == b for a, b in pairs) / max(1, len(pairs))


TRAINED_CHECKS = [("decisiveness", check_decisiveness), ("equality", check_equality),
                  ("noise_floor", check_noise_floor)]


def run_trained(args, report: dict, out: record.Record) -> None:
    section = report["checks"]["trained"] = {}
    model = build(args.model, torch.float32, args.device).train()
    cycle = bigram_cycle(model.config.vocab_size, TASK_IDS)
    section["training"] = guarded("training", lambda: train_bigram_task(model, cycle, args))
    out.write(report)
    prompts = bigram_prompts(cycle, args.prompts)
    for dtype_name in args.dtypes:  # bf16 first: fp32 then holds the bf16-rounded weights
        model = model.to(DTYPES[dtype_name])
        checks = section[dtype_name] = {}
        for name, fn in TRAINED_CHECKS:
            checks[name] = guarded(name, fn, model, prompts, args, dtype_name)
            out.write(report)


# --------------------------------------------------------------------------------------------- running
def guarded(name: str, fn, *args) -> dict:
    start = time.perf_counter()
    try:
        result = dict(ok=True, **fn(*args))
    except Exception as e:  # report and go on with the next check
        result = dict(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(f"  {name}: {summary(result)}", flush=True)
    return result


def summary(result: dict) -> str:
    if not result["ok"]:
        return f"ERROR {result['error']}"
    keys = ("share_identical", "logprob_max_abs_diff", "passed", "compilations", "compile_s", "fast_run_s",
            "changed_share", "captures_after_in_place_change", "module_reallocations", "graphs_captured", "grid_s",
            "steps", "stopped_by", "first_loss", "final_loss", "uniform_loss", "follows_the_cycle", "margin_median",
            "logit_noise_max", "share_decisive")
    text = ", ".join(f"{k} {result[k]}" for k in keys if k in result and not isinstance(result[k], list))
    for key in ("in_place_vs_reference", "reassigned_vs_reference"):
        if key in result:
            text += f", {key} {result[key]['share_identical']} identical"
    if "compile" in result:
        text += f"\n      compile: {result['compile']}"
    for row in result["steps"] if isinstance(result.get("steps"), list) else []:
        kind = f"{'graph' if row['graphs'] else 'eager'}{'+compiled' if row['compiled'] else ''}"
        text += (f"\n      batch {row['batch']:>3} length {row['length']:>4} {row['mode']:<8} {kind:<15}"
                 f"{row['ms_per_step']:8.3f} ms/step {row['tok_s']:>9,} tok/s (first step {row['first_step_s']} s)")
    return text + f" ({result['seconds']} s)"


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["qwen2.5-0.5b", "tiny"], default="qwen2.5-0.5b")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), help="default bf16 fp32 (bf16 with --quick)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--only", nargs="+", choices=[name for name, _ in CHECKS] + ["trained"],
                    help="run only these checks")
    ap.add_argument("--quick", action="store_true", help="fewer buckets, bf16 only, a shorter training")
    ap.add_argument("--train-steps", type=int, default=1000, help="most training steps of the trained model")
    ap.add_argument("--train-seconds", type=float, help="most training seconds (default 60, 40 with --quick)")
    ap.add_argument("--train-loss", type=float, default=0.05, help="training stops below this loss")
    ap.add_argument("--train-batch", type=int, default=16, help="sequences per training step")
    ap.add_argument("--train-len", type=int, default=128, help="tokens per sequence (less than the task's ids)")
    ap.add_argument("--train-lr", type=float, default=3e-4)
    record.add_arguments(ap)
    args = ap.parse_args()
    args.dtypes = args.dtypes or (["bf16"] if args.quick else ["bf16", "fp32"])
    args.train_seconds = args.train_seconds or (40.0 if args.quick else 60.0)
    return args


def main():
    faulthandler.enable(all_threads=True)  # a crash in native code still prints every thread's Python stack
    args = arguments()
    if args.device == "cpu":
        torch.set_num_threads(1)  # a small shared CPU: see benchmarks/bench_rollout.py
    import transformers

    out = record.start(args, "gpu_engine_check", device=args.device)
    report = dict(torch=torch.__version__, transformers=transformers.__version__, model=args.model, checks={})
    for dtype_name in args.dtypes if not args.only or set(args.only) - {"trained"} else ():
        print(f"{args.model} {dtype_name}:", flush=True)
        model = build(args.model, DTYPES[dtype_name], args.device)
        prompts = make_prompts(args.prompts, min(model.config.vocab_size, 151643))
        checks = report["checks"][dtype_name] = {}
        for name, fn in CHECKS:
            if (not args.only or name in args.only) and not (name == "noise_floor" and dtype_name != "bf16"):
                checks[name] = guarded(name, fn, model, prompts, args, dtype_name)
                out.write(report)  # a run cut short keeps what it measured
        del model
        if args.device == "cuda":
            checks["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    if not args.only or "trained" in args.only:
        print(f"{args.model} trained on a bigram task:", flush=True)
        run_trained(args, report, out)
    print(f"wrote {out.write(report)}")


if __name__ == "__main__":
    main()
