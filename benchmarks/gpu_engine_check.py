"""GPU check of HFPolicy's fast path (`agents.fast_decode`) against its transformers path, in one run.

For the Qwen2.5-0.5B shape (random init) in each dtype (default bf16 and fp32):

* ``equality``: greedy continuations (``--new-tokens``, default 64) of ``--prompts`` (default 64) random prompts of
  8-300 tokens, all in one batch, on the transformers path and on the fast path with CUDA graphs: share of
  identical continuations (goal: >= 0.95 in bf16, 1.0 in fp32), where they first differ, and the largest
  logprob difference over the tokens before that.
* ``graphs_vs_eager``: the same on the fast path with and without CUDA graphs (a graph replays the eager step's
  kernels: expect identical output).
* ``noise_floor`` (bf16 only): the transformers path itself, 16 prompts one at a time vs in the batch: how often
  bf16 rounding alone (other padding, other batch shapes) changes a greedy continuation of this random model.
* ``step_times``: one decode step (graph replay, plus the step's host work and copies) per batch bucket and
  length bucket, in ms and tokens/s; eager steps for comparison at two buckets; greedy and top-k modes at one.
* ``weights`` (last: it changes the weights): after an in-place change of ``lm_head`` the fast path's output
  changes, equals the transformers path's on the new weights, and no graph is captured again (the graphs read the
  parameters in place); after ``load_state_dict(assign=True)`` (new tensors) the policy notices the reallocation,
  captures again, and again equals the transformers path.

Each check reports its own error (with traceback) and the others still run. Writes JSON to ``--out``.

    python benchmarks/gpu_engine_check.py --out gpu_engine_check.json            # H200: about 2-4 minutes
    python benchmarks/gpu_engine_check.py --model tiny --device cpu --prompts 8 --new-tokens 8 --out /tmp/c.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not an installed copy

from agents.fast_decode import RowSampling, SlotEngine, decoder_layout  # noqa: E402
from agents.hf_policy import HFPolicy  # noqa: E402
from agents.policy import SamplingParams  # noqa: E402
from trainers.modeling import build_causal_lm  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GOALS = {"bf16": 0.95, "fp32": 1.0}  # share of identical greedy continuations, fast path vs transformers path
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512)


def build(name: str, dtype: torch.dtype, device: str):
    if name == "tiny":
        return build_causal_lm(config=TINY, dtype=dtype).to(device).eval()
    return build_causal_lm(preset=name, dtype=dtype).to(device).eval()


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(8 + (37 * i) % 293)] for i in range(n)]


async def greedy_async(model, prompts, new_tokens: int, **policy_kwargs):
    """Greedy continuations of `prompts`, all in one batch; returns the generations, the policy's stats and its
    fast-path reason."""
    async with HFPolicy(model, max_batch_size=max(len(prompts), 1), **policy_kwargs) as policy:
        gens = await policy.generate_many(prompts, SamplingParams(temperature=0, max_new_tokens=new_tokens))
        return gens, dict(policy.stats), policy.fast_path_reason


def greedy(model, prompts, new_tokens: int, **policy_kwargs):
    return asyncio.run(greedy_async(model, prompts, new_tokens, **policy_kwargs))


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
    fast, stats, reason = greedy(model, prompts, args.new_tokens, fast_path=True)
    result = compare(fast, reference)
    result.update(fast_path=reason, goal=GOALS[dtype_name], passed=result["share_identical"] >= GOALS[dtype_name],
                  graph_captures=stats["graph_captures"], graph_replays=stats["graph_replays"],
                  decode_passes=stats["decode_passes"])
    return result


def check_graphs_vs_eager(model, prompts, args, dtype_name) -> dict:
    graphs, _, _ = greedy(model, prompts, args.new_tokens, fast_path=True)
    eager, _, _ = greedy(model, prompts, args.new_tokens, fast_path=True, cuda_graphs=False)
    return compare(graphs, eager)


def check_noise_floor(model, prompts, args, dtype_name) -> dict:
    subset = prompts[:16]
    batched, _, _ = greedy(model, subset, args.new_tokens, fast_path=False)
    alone = [greedy(model, [p], args.new_tokens, fast_path=False)[0][0] for p in subset]
    return compare(alone, batched)


def check_step_times(model, prompts, args, dtype_name) -> dict:
    """Per (batch bucket, length bucket): ms per decode step through `SlotEngine.step`, graphs and eager. The
    rows hold 16-token prompts; a step attends to its whole length bucket whatever the rows' lengths."""
    batches = [b for b in (1, 8, 64, 128, 256, 512) if b <= args.max_batch]
    lengths = [256, 512, 1024, 2048] if args.device == "cuda" else [256]
    engine = SlotEngine(model, decoder_layout(model), max_slots=max(batches), max_cache_len=max(lengths),
                        vocab_size=model.config.vocab_size, cuda_graphs=True)
    fill(engine, prompts, max(batches), SamplingParams(temperature=1.0))
    rows, rng = [], random.Random(0)
    for b in batches:
        for length in lengths:
            rows.append(dict(batch=b, length=length, mode="sample", graphs=args.device == "cuda",
                             **time_steps(engine, b, length, "sample", rng, args.steps)))
    b, length = min(256, max(batches)), min(1024, max(lengths))
    for mode, graphs in (("sample", False), ("greedy", True), ("truncate", True)):
        if mode == "truncate":  # top-k 50 on every row: the sort runs
            fill(engine, prompts, b, SamplingParams(temperature=1.0, top_k=50))
        engine.cuda_graphs = graphs
        rows.append(dict(batch=b, length=length, mode=mode, graphs=graphs and args.device == "cuda",
                         **time_steps(engine, b, length, mode, rng, args.steps)))
    return dict(steps=rows, graphs_captured=engine.graphs, cache_gib=round(engine.cache_bytes() / 2**30, 2))


def fill(engine: SlotEngine, prompts, rows: int, params: SamplingParams) -> None:
    """Prefill slots [0, rows) with 16-token prompts sampled with `params`."""
    with torch.no_grad():
        for start in range(0, rows, 64):
            slots = list(range(start, min(start + 64, rows)))
            sampling = RowSampling.draw([params] * len(slots), [random.Random(s) for s in slots], engine.vocab_size)
            engine.prefill(slots, [prompts[s % len(prompts)][:16] for s in slots], sampling)


def time_steps(engine: SlotEngine, rows: int, length: int, mode: str, rng: random.Random, steps: int) -> dict:
    with torch.no_grad():
        engine.step(rows, length, [rng.random() for _ in range(rows)], mode)  # captures the graph if needed
        synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step(rows, length, [rng.random() for _ in range(rows)], mode)
        synchronize()
    ms = (time.perf_counter() - start) / steps * 1e3
    return dict(ms_per_step=round(ms, 3), tok_s=round(rows / ms * 1e3))


def check_weights(model, prompts, args, dtype_name) -> dict:
    subset = prompts[:8]

    async def go():
        async with HFPolicy(model, max_batch_size=len(subset), fast_path=True) as policy:
            params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
            before = await policy.generate_many(subset, params)
            captures = policy.stats["graph_captures"]
            with torch.no_grad():
                model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight) * model.lm_head.weight.std())
            in_place = await policy.generate_many(subset, params)
            in_place_reference = (await greedy_async(model, subset, args.new_tokens, fast_path=False))[0]
            recaptured_in_place = policy.stats["graph_captures"] - captures
            fresh = {k: v.clone() for k, v in model.state_dict().items()}
            fresh["lm_head.weight"] = fresh["lm_head.weight"].flip(0)
            model.load_state_dict(fresh, assign=True)
            reassigned = await policy.generate_many(subset, params)
            reassigned_reference = (await greedy_async(model, subset, args.new_tokens, fast_path=False))[0]
            return dict(changed_share=1 - compare(in_place, before)["share_identical"],
                        in_place_vs_reference=compare(in_place, in_place_reference),
                        captures_after_in_place_change=recaptured_in_place,
                        reassigned_vs_reference=compare(reassigned, reassigned_reference),
                        module_reallocations=policy.stats["module_reallocations"],
                        captures_total=policy.stats["graph_captures"])

    return asyncio.run(go())


CHECKS = [("equality", check_equality), ("graphs_vs_eager", check_graphs_vs_eager),
          ("noise_floor", check_noise_floor), ("step_times", check_step_times), ("weights", check_weights)]


# --------------------------------------------------------------------------------------------- running
def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def guarded(name: str, fn, *args) -> dict:
    start = time.perf_counter()
    try:
        result = dict(ok=True, **fn(*args))
    except Exception as e:  # report and go on with the next check
        result = dict(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(f"  {name}: {summary(result)}", flush=True)
    return result


def summary(result: dict) -> str:
    if not result["ok"]:
        return f"ERROR {result['error']}"
    keys = ("share_identical", "logprob_max_abs_diff", "passed", "changed_share", "captures_after_in_place_change",
            "module_reallocations", "graphs_captured")
    text = ", ".join(f"{k} {result[k]}" for k in keys if k in result)
    for key in ("in_place_vs_reference", "reassigned_vs_reference"):
        if key in result:
            text += f", {key} {result[key]['share_identical']} identical"
    for row in result.get("steps", []):
        text += (f"\n      batch {row['batch']:>3} length {row['length']:>4} {row['mode']:<8} "
                 f"{'graph' if row['graphs'] else 'eager'}: {row['ms_per_step']:8.3f} ms/step {row['tok_s']:>9,} tok/s")
    return text + f" ({result['seconds']} s)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["qwen2.5-0.5b", "tiny"], default="qwen2.5-0.5b")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["bf16", "fp32"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=512, help="largest batch bucket timed")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per bucket")
    ap.add_argument("--only", nargs="+", choices=[name for name, _ in CHECKS], help="run only these checks")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # a small shared CPU: see benchmarks/bench_rollout.py
    import transformers

    report = dict(command=" ".join([sys.executable, *sys.argv]), torch=torch.__version__,
                  transformers=transformers.__version__, model=args.model,
                  device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", checks={})
    for dtype_name in args.dtypes:
        print(f"{args.model} {dtype_name}:", flush=True)
        model = build(args.model, DTYPES[dtype_name], args.device)
        prompts = make_prompts(args.prompts, min(model.config.vocab_size, 151643))
        checks = report["checks"][dtype_name] = {}
        for name, fn in CHECKS:
            if (not args.only or name in args.only) and not (name == "noise_floor" and dtype_name != "bf16"):
                checks[name] = guarded(name, fn, model, prompts, args, dtype_name)
                Path(args.out).write_text(json.dumps(report, indent=2))  # a run cut short keeps what it measured
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
            checks["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
