"""A steady-state RL step of trainers/ppo.py, phase by phase, against the raw model rates measured in the same run.

1. The trainer itself: `trainers.ppo.main` on a recipe (default the GSM8K smoke recipe: a random-init model of
   Qwen2.5-0.5B's shape, bf16, 256 episodes per step through the embedded engine) for ``--steps`` steps. Each step
   logs its phases (``perf/rollout_s``, ``perf/old_logprob_s``, ``perf/ref_s``, ``perf/update_s``) and the batch's
   real tokens; the first ``--warmup`` steps (graph captures, allocator growth) are left out and the medians of the
   others reported.
2. Raw rates of the same model on the same token counts, in this process after the run: a forward pass
   (``torch.no_grad``, the plain causal-LM loss over every token) and forward + backward + AdamW, on dense rows as
   long as the step's sequences on average (no padding), micro-batched as the recipe micro-batches.

Goals (issue 12): ``step_s`` <= 6 s on the smoke recipe; each scoring pass (old logprobs, reference) >= 0.8x the raw
forward rate, and the update >= 0.8x the raw forward+backward+AdamW rate. When the update is one optimizer step over
the whole batch (the smoke recipe: one epoch, one mini-batch of 256), the trainer takes the old logprobs from the
update itself (`trainers.ppo.single_update`) and that pass does not run.

Each phase's rate is also given as MFU: 6 x parameters x tokens / seconds / peak for the update (2 x ... for a
scoring pass), peak = the GPU's dense bf16 rate (`bench_update.PEAK_TFLOPS`; null off GPU). A LoRA recipe (issue 29:
the 7B recipe on one GPU) reports step time and peak memory; its raw baseline is skipped (full fine-tuning of the
same model, with its AdamW state, is not what it is compared with, and would not fit beside it), and its MFU counts
the full model's 6 x parameters as for the others.

`first_step` holds the first step's phases, the run's seconds to its end, and the Inductor compilations by then
(issue 27: a first step <= 30 s). The record also holds `mismatch_abs_max`, the largest ``mismatch/logprob_abs_max`` of any step (the rollout's
logprobs against the trainer's; 0.0 in exact mode, issue 28), and `exact_logprobs`, the recipe's mode
(``--set rollout.exact_logprobs=true`` turns it on).

    python benchmarks/bench_rl_step.py                     # on a GPU: writes benchmarks/results/h200/rl_step.json
    python benchmarks/bench_rl_step.py --config gsm8k_qwen2.5_7b_lora.yaml --steps 4 \
        --out benchmarks/results/h200/rl_step_7b_lora.json                                # 7B LoRA on one GPU
    python benchmarks/bench_rl_step.py --config quickstart.yaml --steps 4 --set sft.steps=0  # a CPU smoke run
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not an installed copy

from benchmarks import record, trace_gaps  # noqa: E402
from trainers import ppo  # noqa: E402
from trainers.config import load_config  # noqa: E402
from trainers.modeling import build_causal_lm  # noqa: E402
from trainers.setup import make_models, make_tokenizer, random_init_vocab  # noqa: E402

from bench_update import PEAK_TFLOPS  # noqa: E402
from mt_env.trajectories import read_metrics  # noqa: E402

PHASES = ("rollout", "old_logprob", "ref", "update")
GOAL_STEP_S, GOAL_RATIO, GOAL_FIRST_S = 6.0, 0.8, 30.0


def run_trainer(args, out_dir: str) -> tuple[list[dict], list[str]]:
    """Train `--steps` steps; returns the per-step metric rows of metrics.jsonl and the overrides used."""
    overrides = [f"output_dir={out_dir}", f"trainer.total_steps={args.steps}", "trainer.save_every=0",
                 "trainer.eval_every=0", "eval.episodes=1", "logging.plot=false", *args.set]
    ppo.main(["--config", args.config, *sum((["--set", o] for o in overrides), [])])
    rows = read_metrics(Path(out_dir) / "metrics.jsonl")
    return [r for r in rows if "perf/step_s" in r], overrides


def steady(rows: list[dict], warmup: int) -> dict:
    """Medians over the steps after the warm-up: seconds per phase and tokens per step."""
    rows = [r for r in rows if not r.get("perf/profiled")] or rows  # a profiled step runs slower: not a sample
    kept = [r for r in rows if r["step"] > warmup] or rows
    median = lambda key: statistics.median(r.get(key, 0.0) for r in kept)  # noqa: E731
    out = {"steps": [r["step"] for r in kept], "step_s": median("perf/step_s"),
           "tokens": median("perf/tokens"), "trained_tokens": median("perf/trained_tokens"),
           "generated_tokens": median("rollout/generated_tokens"), "epochs": median("perf/epochs"),
           "sequences": median("perf/sequences")}
    for phase in PHASES:
        out[f"{phase}_s"] = median(f"perf/{phase}_s")
    out["peak_gib"] = max((r.get("perf/peak_gib", 0.0) for r in rows), default=0.0) or None  # over every step
    out["peak_reserved_gib"] = max((r.get("perf/peak_reserved_gib", 0.0) for r in rows), default=0.0) or None
    # what happened during the measured steps, from running totals: the caching allocator's retries (each one freed
    # its cache and synchronised) and Inductor's compilations (a steady step should have none)
    for key, total in (("alloc_retries", "perf/alloc_retries_total"), ("compilations", "perf/compilations_total")):
        totals = [r.get(total, 0.0) for r in rows if r["step"] >= kept[0]["step"] - 1]
        out[key] = max(totals, default=0.0) - min(totals, default=0.0)
    # the embedded engine's counters over a rollout (`trainers.rollouts.LocalRollouts.play`: ``engine/*``)
    out["engine"] = {key.removeprefix("engine/"): median(key) for key in kept[0] if key.startswith("engine/")}
    return out


def first_step(rows: list[dict]) -> dict:
    """The first step, where compilations and graph captures land (issue 27's warm-up goal: <= 30 s): its phases,
    the run's time up to its end (setup and the evaluation before it included), and the Inductor compilations (count,
    seconds) the process had made by then with its rollout's graph captures."""
    first = rows[0]
    out = {"step_s": first["perf/step_s"], "elapsed_s": first.get("perf/elapsed_s"),
           "compilations": first.get("perf/compilations_total"), "compile_s": first.get("perf/compile_s_total"),
           "compiling_calls_s": first.get("perf/compiling_calls_s_total")}
    out.update({f"{phase}_s": first.get(f"perf/{phase}_s", 0.0) for phase in PHASES})
    out.update({key.replace("engine/", "rollout_"): first[key] for key in ("engine/graph_captures",
                "engine/prefill_graph_captures", "engine/compilations", "engine/compile_s") if key in first})
    return out


def mismatch_of(rows: list[dict], cfg) -> dict:
    """The rollout/trainer logprob mismatch over every step (warm-up included: in exact mode each must be 0.0):
    `mismatch_abs_max`, the max of ``mismatch/logprob_abs_max`` (None when no step reports it), and the mode."""
    values = [r["mismatch/logprob_abs_max"] for r in rows if r.get("mismatch/logprob_abs_max") is not None]
    return {"mismatch_abs_max": max(values) if values else None, "exact_logprobs": bool(cfg.rollout.exact_logprobs)}


def raw_rates(cfg, tokens: int, seq: int, device: torch.device) -> dict:
    """Tokens/s of the recipe's model on dense [micro, seq] rows: forward only, and forward+backward+AdamW."""
    lm, _ = make_models(cfg, make_tokenizer(cfg), device)  # the model the run trained, as the trainer builds it
    rows = max(1, round(tokens / seq))
    ids = torch.randint(0, lm.config.vocab_size, (rows, seq), device=device)
    micro = ids.split(cfg.trainer.micro_batch_size)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-6)

    def forward():
        with torch.no_grad():
            for x in micro:
                lm(input_ids=x, labels=x, use_cache=False)

    def train():
        for x in micro:
            (lm(input_ids=x, labels=x, use_cache=False).loss * len(x) / rows).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    rates = {}
    for name, fn in (("forward", forward), ("train", train)):
        fn()  # warm-up
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        rates[f"raw_{name}_tok_s"] = rows * seq / (time.perf_counter() - start)
    return rates


def phase_rates(figures: dict, cfg, args, device: torch.device) -> dict:
    """Tokens/s and MFU of the scoring passes and the update; against the raw rates and the goals, unless the recipe
    trains LoRA adapters (then no raw baseline: see the module docstring)."""
    t, out = figures["tokens"], {}
    for phase in ("old_logprob", "ref"):  # 0 s: the pass did not run (no reference; old logprobs from the update)
        out[f"{phase}_tok_s"] = t / figures[f"{phase}_s"] if figures[f"{phase}_s"] else None
    out["update_tok_s"] = t * figures["epochs"] / max(figures["update_s"], 1e-9)
    name = torch.cuda.get_device_name() if device.type == "cuda" else ""
    peak = next((v * 1e12 for k, v in PEAK_TFLOPS.items() if k in name), None)
    params = parameter_count(cfg)
    out.update(parameters=params, peak_bf16_dense_tflops=None if peak is None else peak / 1e12, mfu={
        phase: None if peak is None or not out[f"{phase}_tok_s"] else
        (6 if phase == "update" else 2) * params * out[f"{phase}_tok_s"] / peak
        for phase in ("old_logprob", "ref", "update")})
    out["goals"] = {"step_s": {"target": GOAL_STEP_S, "passed": figures["step_s"] <= GOAL_STEP_S}}
    if cfg.model.lora.rank:
        return out
    seq = args.raw_seq or max(1, round(t / max(figures["sequences"], 1)))
    out.update(raw_rates(cfg, int(t), seq, device), raw_seq=seq)
    ratios = {"update": out["update_tok_s"] / out["raw_train_tok_s"]}
    ratios.update({phase: out[f"{phase}_tok_s"] / out["raw_forward_tok_s"]
                   for phase in ("old_logprob", "ref") if out[f"{phase}_tok_s"]})
    out["ratios_vs_raw"] = ratios
    out["goals"]["phases_vs_raw"] = {"target": GOAL_RATIO, "worst": min(ratios.values()),
                                     "passed": min(ratios.values()) >= GOAL_RATIO}
    return out


def parameter_count(cfg) -> int:
    """The recipe's model's parameters (built on the meta device: no memory, no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        if cfg.model.path:
            lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.path))
        else:
            lm = build_causal_lm(preset=cfg.model.preset, config=cfg.model.config,
                                 vocab_size=random_init_vocab(cfg, len(make_tokenizer(cfg))))
    return sum(p.numel() for p in lm.parameters())


def report_profile(profile_dir: Path, keep: str | None) -> None:
    """Copy each trace the profiled step wrote (one per process) to `keep`, then print `trace_gaps`'s report of it
    (copied first: a whole step's trace takes minutes to analyse, and a time limit may end the run meanwhile)."""
    for trace in sorted(profile_dir.glob("*.json.gz")):
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(trace, Path(keep) / trace.name)
            print(f"[profile] {trace.name} ({trace.stat().st_size / 2**20:.1f} MiB) kept in {keep}", flush=True)
        print(f"\n[profile] {trace.name}:\n{trace_gaps.report(trace_gaps.analyse(trace_gaps.load(trace)), 12)}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="gsm8k_smoke_random_0.5b.yaml")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    ap.add_argument("--raw-seq", type=int, help="row length of the raw baseline (default: the steps' mean sequence)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
    ap.add_argument("--profile-step", type=int, default=0, metavar="N",
                    help="run step N under torch.profiler (trainer.profile_step; left out of the medians), print "
                         "where its time went (benchmarks/trace_gaps.py); records nothing")
    ap.add_argument("--trace-dir", help="with --profile-step: keep the step's trace here")
    record.add_arguments(ap)
    args = ap.parse_args()
    rec = record.start(args, "rl_step", device="cuda" if torch.cuda.is_available() else "cpu",
                       tee=not args.profile_step)  # a profiled run records nothing
    if args.profile_step:
        args.set.append(f"trainer.profile_step={args.profile_step}")
    with tempfile.TemporaryDirectory() as tmp:
        rows, overrides = run_trainer(args, tmp)
        if args.profile_step:
            report_profile(Path(tmp) / "profile", args.trace_dir)
    cfg = load_config(args.config, [o for o in overrides if not o.startswith("output_dir=")])
    figures = steady(rows, args.warmup)
    device = torch.device("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu")
    figures.update(phase_rates(figures, cfg, args, device))
    figures.update(mismatch_of(rows, cfg), first_step=first_step(rows))
    figures.update(config=args.config, overrides=overrides, torch=torch.__version__)
    old = f"{figures['old_logprob_s']:.2f}" if figures["old_logprob_s"] else "taken from the update"
    print(f"\nsteady steps {figures['steps']}: step {figures['step_s']:.2f} s "
          f"(rollout {figures['rollout_s']:.2f}, old logprobs {old}, "
          f"reference {figures['ref_s']:.2f}, update {figures['update_s']:.2f}); "
          f"{figures['tokens']:.0f} tokens/step, {figures['generated_tokens']:.0f} generated")
    if figures["engine"]:
        e = figures["engine"]
        print(f"rollout's engine: busy {e['busy_s']:.2f} s (gathering {e['gather_s']:.2f}, {e['prefill_passes']:.0f} "
              f"prefill passes {e['prefill_s']:.2f}, {e['decode_passes']:.0f} decode steps: launching "
              f"{e['launch_s']:.2f}, waiting for them {e['step_wait_s']:.2f}), {e['prefilled_tokens']:.0f} tokens "
              f"prefilled, {e['cached_tokens']:.0f} cached; idle {figures['rollout_s'] - e['busy_s']:.2f} s of the rollout's {figures['rollout_s']:.2f}")
    f = figures["first_step"]
    print(f"first step {f['step_s']:.1f} s (rollout {f['rollout_s']:.1f}, reference {f['ref_s']:.1f}, update "
          f"{f['update_s']:.1f}); by its end {f['elapsed_s'] or 0:.0f} s of run, {f['compilations'] or 0:.0f} Inductor "
          f"compilations ({f['compile_s'] or 0:.0f} s in Inductor, {f['compiling_calls_s'] or 0:.0f} s in the calls "
          f"that compiled); its rollout {f.get('rollout_graph_captures', 0):.0f} + "
          f"{f.get('rollout_prefill_graph_captures', 0):.0f} graph captures  "
          f"{'PASS' if f['step_s'] <= GOAL_FIRST_S else 'FAIL'} (goal <= {GOAL_FIRST_S:.0f} s)")
    print(f"logprob mismatch (rollout vs trainer), max over steps: {figures['mismatch_abs_max']} "
          f"(exact_logprobs {figures['exact_logprobs']})")
    mfu = {k: "n/a" if v is None else f"{100 * v:.1f}%" for k, v in figures["mfu"].items()}
    rates = ", ".join(f"{phase} {figures[f'{phase}_tok_s']:,.0f} tok/s (MFU {mfu[phase]})"
                      for phase in ("old_logprob", "ref", "update") if figures[f"{phase}_tok_s"])
    print(f"{figures['parameters'] / 1e9:.2f}B parameters; {rates}; peak memory "
          f"{figures['peak_gib'] or 0:.1f} GiB allocated, {figures['peak_reserved_gib'] or 0:.1f} GiB reserved; "
          f"{figures['alloc_retries']:.0f} allocator retries and {figures['compilations']:.0f} compilations in the "
          f"steady steps")
    if "raw_forward_tok_s" in figures:
        print(f"raw forward {figures['raw_forward_tok_s']:,.0f} tok/s, raw forward+backward+AdamW "
              f"{figures['raw_train_tok_s']:,.0f} tok/s")
    for name, ratio in figures.get("ratios_vs_raw", {}).items():
        print(f"  {name:<12} {ratio:.2f}x raw  {'PASS' if ratio >= GOAL_RATIO else 'FAIL'} (goal >= {GOAL_RATIO}x)")
    print(f"  step_s {figures['step_s']:.2f}  {'PASS' if figures['step_s'] <= GOAL_STEP_S else 'FAIL'} "
          f"(goal <= {GOAL_STEP_S} s)")
    if not args.profile_step:
        print(f"wrote {rec.write(figures)}")


if __name__ == "__main__":
    main()
