"""Rollout throughput: the rollout driver, HFBackend doing the same token work directly, and transformers' static-cache
``generate`` doing the same token work.

Each batch size runs `batch` episodes of exactly three turns: a Calculator env whose `interaction` always asks the
model to go on, with ``length_cut="interact"``, so that a random model's turns (cut at ``--new-tokens``) are
followed by a user turn instead of ending the episode. The driver plays them all concurrently against one
`HFBackend`; it records every episode's context and generated length per turn. Three figures, generated tokens/s:

* ``driver_tok_s``: through the rollout driver (envs, tools, conversation bookkeeping, training samples).
* ``engine_tok_s``: the same `HFBackend` replaying exactly that token work without envs, tools or bookkeeping: for
  turn k = 1, 2, 3 one `generate_many` over the contexts the episodes had at turn k, each generating exactly as
  many tokens as the episode did (``max_new_tokens`` = that length, no stop tokens).
* ``hf_static_tok_s``: transformers' ``model.generate(cache_implementation="static")`` on the same module doing the
  same work: for turn k one ``generate`` call over the episodes' turn-k contexts, left-padded into one batch with
  an attention mask, ``max_new_tokens = min_new_tokens`` = the longest turn-k length (every row then generates that
  many tokens, all counted — with the length cut, every turn generates ``--new-tokens``), the same temperature
  without top-k/top-p. On CUDA, ``generate`` compiles its static-cache decode step (CUDA graphs) by itself; the
  recompile limit is raised so that the turns' shapes do not push it back to eager.

Everything is warmed up at each batch size's own shapes before timing (the first warm-up also builds the driver's
env pool, as a trainer's first step would). Goals: engine >= 2x hf_static (the fast path, on CUDA) and driver >=
0.95x engine. Also reported: the driver's wall-time split (generation in flight / tool steps only / its own
bookkeeping: resets, parsing, conversation ids, training samples with the drift check), the backend's pass counts
(prefill passes, decode steps, rows per step: decoded, wasted — launched before their row's end was read — and
padding) and its worker's time: busy, gathering the requests that trickle in (when it is idle, or while fewer rows
decode than wait), in prefill passes, launching decode steps (on CUDA enqueueing them; on CPU computing them),
waiting for their outputs, and the rest (its bookkeeping between steps, including the waits to take the GIL back
from the event loop). With overlapped steps the launches and the rest run while the device computes the step before:
where they take longer than a step, the host is the bottleneck.

    python benchmarks/bench_rollout.py                                   # CPU: tiny random Qwen2, batch 64 and 256
    python benchmarks/bench_rollout.py --model qwen2.5-0.5b --device cuda --new-tokens 128 --batch 64 256 512 \
        --env-processes 8 --repeats 5                                    # writes benchmarks/results/h200/rollout.json
    python benchmarks/bench_rollout.py ... --fast-path off               # HFBackend's transformers path instead
    python benchmarks/bench_rollout.py ... --env-processes 4             # envs in 4 processes (ProcessRolloutDriver)
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import functools
import gc
import os
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not an installed copy

import agents.hf_backend  # noqa: E402
import agents.rollout  # noqa: E402
from agents.backend import SamplingParams, counted  # noqa: E402
from agents.hf_backend import HFBackend  # noqa: E402
from agents.rollout import RolloutResult  # noqa: E402
from agents.rollout_processes import rollout_driver  # noqa: E402
from benchmarks import record  # noqa: E402
from envs.calculator import CalculatorEnv  # noqa: E402
from mt_env.sample import Seg  # noqa: E402
from mt_env.tokenizer import load_tokenizer  # noqa: E402
from trainers.modeling import build_causal_lm  # noqa: E402

TURNS = 3
GOALS = dict(engine_vs_hf_static=2.0, driver_vs_engine=0.95)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


class KeepGoingEnv(CalculatorEnv):
    """Calculator tasks played for exactly three turns: every answer, even one cut by the token limit, gets a user
    turn asking to go on (two of them), so that a random model generates `--new-tokens` tokens per turn."""

    def __init__(self, **kwargs):
        super().__init__(length_cut="interact", max_interactions=TURNS - 1, max_turns=TURNS, **kwargs)

    def interaction(self, task, final_text):
        return "Go on."


#: --fast-path's choices as HFBackend's `fast_path` argument
FAST_PATH = {"auto": "auto", "on": True, "off": False}


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


async def run_engine(backend: HFBackend, work, temperature: float) -> tuple[float, int]:
    """Replay `work` turn by turn, each turn one batched call; returns (wall seconds, generated tokens)."""
    tokens, start = 0, time.perf_counter()
    for k, turn in enumerate(work):
        params = [SamplingParams(temperature=temperature, max_new_tokens=n, seed=k * 100_003 + i)
                  for i, (_, n) in enumerate(turn)]
        generations = await backend.generate_many([ids for ids, _ in turn], params)
        got = [len(g) for g in generations]
        if got != [n for _, n in turn]:
            raise RuntimeError("the engine replay generated other lengths than the rollout: the comparison is off")
        tokens += sum(got)
    return time.perf_counter() - start, tokens


def run_hf_static(model, work, temperature: float, pad_id: int) -> tuple[float, int]:
    """The same turns through ``model.generate(cache_implementation="static")``, one call per turn; returns (wall
    seconds, generated tokens: rows x the turn's longest length, all generated)."""
    device = next(model.parameters()).device
    tokens, start = 0, time.perf_counter()
    for turn in work:
        width, n = max(len(ids) for ids, _ in turn), max(n for _, n in turn)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids, _ in turn], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in turn], device=device)
        config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=temperature > 0,
                                  temperature=temperature if temperature > 0 else None, top_k=0, top_p=1.0,
                                  cache_implementation="static", pad_token_id=pad_id)
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        tokens += (out.shape[1] - width) * len(turn)
    return time.perf_counter() - start, tokens


def measure(driver, backend: HFBackend, tasks: list[dict], args, step: int) -> tuple[dict, list]:
    """The driver and the engine replaying its token work; returns the row of figures and that work."""
    driver_tok_s, engine_tok_s, splits, ends = [], [], [], Counter()
    # Warm-up at this exact size: the first pass through a range of tensor sizes (KV caches growing token by token,
    # CUDA graphs captured per bucket) pays for what later passes reuse; whichever side ran first would otherwise
    # pay for both.
    warm = driver.run(tasks, step=step + 500)
    asyncio.run(run_engine(backend, turn_work(warm), args.temperature))
    if args.gc_freeze:
        gc.freeze()
    for r in range(args.repeats):
        with counted(backend) as driver_passes:
            start = time.perf_counter()
            result = driver.run(tasks, step=step + r)
            driver_wall = time.perf_counter() - start
        bad = [rec for rec in result.episodes if rec.turns != TURNS or rec.error]
        if bad:
            raise RuntimeError(f"{len(bad)} episode(s) did not play {TURNS} turns, e.g. {bad[0].to_dict()}")
        ends.update(rec.end_reason for rec in result.episodes)
        tokens = int(result.metrics["rollout/generated_tokens"])
        work = turn_work(result)
        with counted(backend) as engine_passes:
            engine_wall, engine_tokens = asyncio.run(run_engine(backend, work, args.temperature))
        assert engine_tokens == tokens
        driver_tok_s.append(tokens / driver_wall)
        engine_tok_s.append(engine_tokens / engine_wall)
        splits.append({k: result.metrics[k] for k in ("time/generation_s", "time/tools_s", "time/bookkeeping_s")}
                      | {"driver_wall_s": driver_wall, "engine_wall_s": engine_wall, "tokens": tokens,
                         "driver_passes": driver_passes, "engine_passes": engine_passes, "work": work})
    ratios = [a / b for a, b in zip(driver_tok_s, engine_tok_s)]
    median = sorted(range(args.repeats), key=lambda i: ratios[i])[(args.repeats - 1) // 2]  # the run of median ratio
    figures = splits[median]
    row = dict(batch=len(tasks), turns=TURNS, generated_tokens=figures["tokens"],
               driver_tok_s=driver_tok_s[median], engine_tok_s=engine_tok_s[median], driver_vs_engine=ratios[median],
               driver_wall_s=figures["driver_wall_s"], engine_wall_s=figures["engine_wall_s"],
               generation_s=figures["time/generation_s"], tools_s=figures["time/tools_s"],
               bookkeeping_s=figures["time/bookkeeping_s"], driver_vs_engine_runs=ratios,
               # per run: whether a turn ended early (fewer tokens) decides the driver's extra prefill passes
               tokens_runs=[s["tokens"] for s in splits],
               prefill_passes_runs=[[s[f"{side}_passes"]["prefill_passes"] for side in ("driver", "engine")]
                                    for s in splits],
               end_reasons=dict(ends),
               driver_passes=figures["driver_passes"], engine_passes=figures["engine_passes"])
    return row, figures["work"]


def measure_hf_static(row: dict, model, work, args) -> None:
    """transformers' static-cache generate on the turns `row` measured; adds its figures to `row`."""
    try:
        run_hf_static(model, work, args.temperature, args.pad_id)  # warm-up (and compilation)
        wall, tokens = run_hf_static(model, work, args.temperature, args.pad_id)
    except Exception as e:  # e.g. out of memory at a large batch: keep the other figures
        row.update(hf_static_error=f"{type(e).__name__}: {e}")
    else:
        row.update(hf_static_tok_s=tokens / wall, hf_static_wall_s=wall, hf_static_tokens=tokens,
                   engine_vs_hf_static=row["engine_tok_s"] * wall / tokens)


def print_row(row: dict) -> None:
    if "error" in row:
        print(f"{row['batch']:>5} ERROR {row['error']}")
        return
    static = f"{row['hf_static_tok_s']:>14,.0f} {row['engine_vs_hf_static']:>7.2f}" if "hf_static_tok_s" in row \
        else f"{'error' if 'hf_static_error' in row else '-':>14} {'-':>7}"
    print(f"{row['batch']:>5} {row['generated_tokens']:>7} {row['driver_tok_s']:>12,.0f} {row['engine_tok_s']:>11,.0f} "
          f"{static} {row['driver_vs_engine']:>9.3f}   {row['generation_s']:>12.2f} {row['tools_s']:>8.3f} "
          f"{row['bookkeeping_s']:>13.3f}")
    print("      runs: " + ", ".join(f"{ratio:.3f} ({tokens} tokens, prefill passes {d} / {e})" for ratio, tokens, (d, e)
                                  in zip(row["driver_vs_engine_runs"], row["tokens_runs"], row["prefill_passes_runs"])))
    for name in ("driver", "engine"):
        p = row[f"{name}_passes"]
        steps = max(1, p["decode_passes"])
        print(f"      {name:<6} passes: {p['prefill_passes']} prefill ({p['prefill_graph_replays']} from graphs, "
              f"{p['prefill_graph_captures']} captured), {p['decode_passes']} decode "
              f"({p['decoded_rows'] / steps:.1f} rows + {p['wasted_rows'] / steps:.1f} wasted + "
              f"{p['padded_rows'] / steps:.1f} padding each), "
              f"{p['graph_replays']} graph replays, {p['stand_in_replays']} by a larger bucket's graph, "
              f"{p['graph_captures']} captures, "
              f"{p['uncaptured_steps']} uncaptured, {p['prefilled_tokens']} tokens prefilled, "
              f"{p['cached_tokens']} cached, {p['preemptions']} preemptions, "
              f"{p['compaction_moves']} slot moves, {p['merges']} merges, {p['separate_batches']} batches in turn, "
              f"{p['compilations']} compilations ({p['compile_s']:.1f} s)")
        host = p["busy_s"] - p["gather_s"] - p["prefill_s"] - p["launch_s"] - p["step_wait_s"]
        print(f"             worker busy {p['busy_s']:.2f} s: gathering {p['gather_s']:.2f}, prefill "
              f"{p['prefill_s']:.2f}, launching decode steps {p['launch_s']:.2f} ({p['launch_s'] / steps * 1e3:.2f} "
              f"ms each), waiting for them {p['step_wait_s']:.2f} ({p['step_wait_s'] / steps * 1e3:.2f} ms), "
              f"the rest {host:.2f} ({host / steps * 1e3:.2f} ms a step: bookkeeping, taking the GIL back)")


def verdict(rows: list[dict]) -> dict:
    """Each goal met at every batch size? (A size where it was not measured fails it; worst is None when no size
    measured it.)"""
    result = {}
    for goal, target in GOALS.items():
        values = [r[goal] for r in rows if goal in r]
        result[goal] = dict(target=target, worst=min(values) if values else None,
                            passed=bool(values) and len(values) == len(rows) and min(values) >= target)
    return result


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["tiny", "qwen2.5-0.5b"], default="tiny",
                    help="tiny: a random 2-layer Qwen2 (CPU); qwen2.5-0.5b: Qwen2.5-0.5B's shape, random, bf16")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="episodes per rollout")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per batch size (the median ratio is shown)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--fast-path", choices=["auto", "on", "off"], default="auto",
                    help="HFBackend's engine: auto = the paged engine on CUDA for supported models (agents/engine)")
    ap.add_argument("--no-hf-static", dest="hf_static", action="store_false",
                    help="skip the transformers generate(cache_implementation='static') baseline")
    ap.add_argument("--threads", type=int, help="torch CPU threads; default 1 on cpu (on a small shared CPU, "
                    "intra-op threads waiting for a busy core slow the tiny model many times), torch's own on cuda")
    ap.add_argument("--tokenizer", default="offline:qwen2.5")
    ap.add_argument("--switch-interval", type=float, help="experiment: the interpreter's switch interval (s) while "
                    f"the worker serves (default {agents.hf_backend.SERVING_SWITCH_INTERVAL_S})")
    ap.add_argument("--gather-cap", type=int, help="experiment: longest gathering of the worker, in gather "
                    f"windows (default {agents.hf_backend.GATHER_CAP_WINDOWS})")
    ap.add_argument("--gc-freeze", action="store_true", help="experiment: gc.freeze() after the warm-up (the "
                    "objects alive then are never scanned again)")
    ap.add_argument("--attention", choices=["auto", "gather", "triton"], default="auto",
                    help="the engine's decode attention kernel (agents/engine/attention.py)")
    ap.add_argument("--prefix-cache", choices=["on", "off"], default="on", help="the engine's prefix cache")
    ap.add_argument("--env-processes", type=int, default=0, help="the driver's env work in this many processes "
                    "(agents.rollout_processes.ProcessRolloutDriver); 0: in this process (RolloutDriver)")
    ap.add_argument("--first-step", type=int, default=0, help="the rollout step (the episodes' seeds) of the "
                    "first timed run; run r of the i-th batch size is step first + 1000 i + r (two codes compared on "
                    "the same steps play the same token work)")
    record.add_arguments(ap)
    return ap.parse_args()


def main():
    faulthandler.enable(all_threads=True)  # a crash in native code still prints every thread's Python stack
    args = arguments()
    args.record = record.start(args, "rollout", device=args.device)
    threads = args.threads or (1 if args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    _raise_recompile_limit()
    if args.switch_interval is not None:
        agents.hf_backend.SERVING_SWITCH_INTERVAL_S = args.switch_interval
    if args.gather_cap is not None:
        agents.hf_backend.GATHER_CAP_WINDOWS = args.gather_cap

    tokenizer = load_tokenizer(args.tokenizer)
    args.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model, shape = build_model(args.model, args.device, len(tokenizer))
    largest = max(args.batch)
    backend = make_backend(HFBackend, model, args, len(tokenizer))
    header = run_header(args, backend, shape, len(tokenizer))
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens)
    driver = make_driver(functools.partial(KeepGoingEnv, tokenizer=tokenizer), backend, sampling, largest,
                         args.env_processes)
    tasks = make_tasks(largest)

    # Warm-up: the env pool (chat formats, template checks) and the model's kernels; each size warms up again in
    # `measure`, at its own shapes.
    start = time.perf_counter()
    warm = driver.run(tasks, step=10_000, max_new_tokens=1)
    asyncio.run(run_engine(backend, turn_work(warm), args.temperature))
    print(f"warm-up: {time.perf_counter() - start:.1f} s\n")
    try:
        rows = measure_sizes(driver, backend, tasks, args, header)
    finally:
        asyncio.run(backend.close())
        driver.close()
    report_end(rows, args, header)


def make_tasks(n: int) -> list[dict]:
    """`n` calculator tasks (two operands in 100..999), the same ones in every run."""
    rng = np.random.default_rng(0)
    return [CalculatorEnv.task_for([int(x) for x in rng.integers(100, 1000, size=2)]) for _ in range(n)]


def make_backend(cls: type[HFBackend], model, args: argparse.Namespace, vocab: int) -> HFBackend:
    """The engine measured (`cls`: HFBackend or a subclass that marks its phases), for the largest batch, with the
    command line's knobs."""
    engine = {} if FAST_PATH[args.fast_path] is False else dict(attention=args.attention,
                                                                  prefix_cache=args.prefix_cache == "on")
    return cls(model, max_batch_size=max(args.batch), seed=0, vocab_limit=vocab, fast_path=FAST_PATH[args.fast_path],
               **engine)


def make_driver(make_env, backend: HFBackend, sampling: SamplingParams, concurrency: int, env_processes: int = 0):
    """The driver measured: its env work in this process (`RolloutDriver`), or in `env_processes` processes
    (`ProcessRolloutDriver`)."""
    return rollout_driver(make_env, backend, sampling, processes=env_processes, max_concurrency=concurrency,
                          generation_timeout_s=None, seed=0)


def run_header(args, backend: HFBackend, shape: dict, vocab: int) -> dict:
    """The run's settings (the JSON's header), printed."""
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    header = dict(torch=torch.__version__,
                  transformers=transformers.__version__, threads=torch.get_num_threads(), model=shape,
                  tokenizer=args.tokenizer, fast_path=backend.fast_path_reason, turns=TURNS,
                  compile=backend.compile_reason,
                  new_tokens=args.new_tokens, temperature=args.temperature, repeats=args.repeats,
                  switch_interval_s=agents.hf_backend.SERVING_SWITCH_INTERVAL_S,
                  gather_cap_windows=agents.hf_backend.GATHER_CAP_WINDOWS, gc_freeze=args.gc_freeze,
                  env_processes=args.env_processes, first_step=args.first_step, attention=args.attention,
                  prefix_cache=args.prefix_cache)
    print(f"code: {Path(agents.rollout.__file__).resolve().parents[1]}")
    print(f"device: {device}; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} CPU thread(s)")
    print("model:", ", ".join(f"{k} {v}" for k, v in shape.items()), f"(tokenizer {args.tokenizer}, {vocab})")
    print(f"HFBackend fast path: {backend.fast_path_reason}")
    print(f"decode step: {backend.compile_reason}")
    print(f"episodes: {TURNS} turns x {args.new_tokens} new tokens, temperature {args.temperature}; "
          f"batch sizes {args.batch}; {args.repeats} timed run(s) each; driver: "
          + (f"env work in {args.env_processes} processes" if args.env_processes else "env work in this process"))
    return header


def measure_sizes(driver, backend: HFBackend, tasks: list[dict], args, header: dict) -> list[dict]:
    """A row of figures per batch size (an error recorded as its row), printed and written as they come."""
    print(f"{'batch':>5} {'tokens':>7} {'driver tok/s':>12} {'engine tok/s':>11} {'hf static tok/s':>14} "
          f"{'eng/hf':>7} {'drv/eng':>9}   {'generation s':>12} {'tools s':>8} {'bookkeeping s':>13}")
    rows, works = [], []  # works[i]: the token work of rows[i] (None after an error)
    for i, batch in enumerate(args.batch):
        try:
            row, work = measure(driver, backend, tasks[:batch], args, step=args.first_step + 1000 * i)
        except Exception as e:  # record it and go on with the next size
            row, work = dict(batch=batch, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()), None
        rows.append(row)
        works.append(work)
        header["compile"] = backend.compile_reason
        write(rows, args, header)  # after each size: a run cut short still leaves its figures
        if not args.hf_static:
            print_row(row)
    if args.hf_static:
        # transformers' generate last, once the engine is done: in one process, a run of the engine after the
        # compiled static generate died with a CUDA illegal memory access (see the README's Status)
        for row, work in zip(rows, works):
            if work is not None:
                measure_hf_static(row, backend.model, work, args)
            print_row(row)
            write(rows, args, header)
    return rows


def write(rows: list[dict], args, header: dict) -> None:
    args.record.write(header | dict(goals=verdict(rows), batches=rows))


def report_end(rows: list[dict], args, header: dict) -> None:
    ends = Counter()
    for r in rows:
        ends.update(r.get("end_reasons", {}))
    note = "" if set(ends) == {"answered"} else (
        " (a random model may sample <tool_call>: an error observation instead of 'Go on', still 3 turns)")
    print("episode ends:", ", ".join(f"{reason} {count}" for reason, count in ends.most_common()) + note)
    print(f"decode step at the end: {header['compile']}")
    goals = verdict(rows)
    print()
    for goal, v in goals.items():
        state = "not measured" if v["worst"] is None else \
            f"worst {v['worst']:.3f}x  {'PASS' if v['passed'] else 'FAIL'}"
        print(f"goal: {goal.replace('_vs_', ' >= ' + str(v['target']) + 'x ')} at every batch size: {state}")
    write(rows, args, header)
    print(f"wrote {args.record.json_path}")


def _raise_recompile_limit() -> None:
    """Give generate()'s compiled decode step room for every batch size and turn shape (the default limit of 8
    recompilations would send it back to eager, understating the baseline)."""
    import torch._dynamo.config as dynamo

    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, name, max(64, getattr(dynamo, name)))


if __name__ == "__main__":
    main()
