"""The quickstart's SFT steps on the CPU, alone and beside a busy process, for several thread settings, in one run.

Each candidate is ``THREADS:POLICY`` (POLICY: ``default`` — OpenMP's own, OMP_WAIT_POLICY unset — ``passive``,
``active``, or ``spin<N>``: GNU OpenMP's GOMP_SPINCOUNT=N, spin that many times, then sleep). For each, a fresh
Python process (OpenMP reads its settings once, when torch loads it) builds the quickstart config's model and
demonstrations, runs a few warm-up SFT steps, then times ``--steps`` steps: once with nothing else started, once
beside ``--busy`` processes that spin (``while True: pass``). Rounds (``--repeats``) go through every candidate in
turn, so that drifting load from other work falls on all of them; the figures are medians over the rounds. The
ratio busy / alone is what a user sees when something else runs on the machine; the issue's goal is at most ~2x.

    python benchmarks/bench_busy.py                       # writes benchmarks/results/cpu/busy.{json,txt}
    python benchmarks/bench_busy.py --steps 20 --repeats 1 --candidates 1:default 2:passive --out /tmp/busy

The machine's load from other work is not controlled: the script records ``os.getloadavg()`` before and after, and
compares settings within this one run (alone and busy measured back to back, per candidate).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("default", "passive", "active", "spin<N>")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="quickstart.yaml")
    ap.add_argument("--steps", type=int, default=40, help="timed SFT steps per measurement")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="rounds over all candidates (medians are reported)")
    ap.add_argument("--busy", type=int, default=1, help="spinning processes beside the busy measurement")
    ap.add_argument("--candidates", nargs="+", default=["2:default", "2:passive", "1:default"],
                    help="THREADS:POLICY, POLICY one of " + ", ".join(POLICIES))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu" / "busy"),
                    help="path stem of the .json and .txt results")
    ap.add_argument("--child", nargs=2, metavar=("THREADS", "STEPS"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def time_sft_steps(config: str, threads: int, steps: int, warmup: int) -> dict:
    """In this process: the config's model and demonstrations, `warmup` SFT steps, then `steps` timed ones."""
    sys.path.insert(0, str(ROOT))
    import torch
    from accelerate import Accelerator

    from trainers.config import load_config
    from trainers.modeling import PolicyModel
    from trainers.setup import TaskSource, env_factory, make_models, make_tokenizer
    from trainers.sft import WarmStart, demonstration_samples

    torch.set_num_threads(threads)
    cfg = load_config(config)
    tokenizer = make_tokenizer(cfg)
    make_env = env_factory(cfg, tokenizer)
    tasks = TaskSource(make_env().unwrapped, seed=cfg.seed + 1).next(512)
    samples = demonstration_samples(make_env, tasks, cfg.sft.demo_skill, cfg.seed)
    accelerator = Accelerator(cpu=True)
    lm, _ = make_models(cfg, tokenizer, accelerator.device, critic=False)
    policy = accelerator.prepare(PolicyModel(lm, vocab_limit=len(tokenizer)))
    sft = WarmStart(policy, samples, tokenizer.pad_token_id, cfg.sft, cfg.seed, accelerator)
    for k in range(1, warmup + 1):
        sft.step(k)
    start = time.perf_counter()
    for k in range(warmup + 1, warmup + steps + 1):
        sft.step(k)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "per_step_s": seconds / steps, "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


def measure(args, threads: int, policy: str, busy: int) -> dict:
    """One candidate in a fresh process, beside `busy` spinning processes."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    if policy.startswith("spin"):  # GNU OpenMP (torch's on Linux): spin this many times, then sleep
        env["GOMP_SPINCOUNT"] = policy.removeprefix("spin")
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy.upper()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        out = subprocess.run([sys.executable, __file__, "--config", args.config, "--warmup", str(args.warmup),
                              "--child", str(threads), str(args.steps)], env=env, cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(time_sft_steps(args.config, int(args.child[0]), int(args.child[1]), args.warmup)))
        return {}
    candidates = []
    for text in args.candidates:
        threads, _, policy = text.partition(":")
        if not threads.isdigit() or not (policy in POLICIES or policy.removeprefix("spin").isdigit()):
            raise SystemExit(f"error: candidate {text!r}: expected THREADS:POLICY, POLICY one of {POLICIES}")
        candidates.append((int(threads), policy))
    load_before = os.getloadavg()
    seconds: dict[tuple, list] = {(c, busy): [] for c in candidates for busy in (0, args.busy)}
    for round_ in range(1, args.repeats + 1):
        for threads, policy in candidates:
            for busy in (0, args.busy):
                seconds[(threads, policy), busy].append(measure(args, threads, policy, busy)["seconds"])
            alone, beside = seconds[(threads, policy), 0][-1], seconds[(threads, policy), args.busy][-1]
            print(f"round {round_} | threads {threads} | {policy:>10} | {args.steps} SFT steps: alone {alone:6.2f}s "
                  f"| beside {args.busy} busy {beside:6.2f}s", flush=True)
    rows = []
    for threads, policy in candidates:
        alone, beside = (statistics.median(seconds[(threads, policy), b]) for b in (0, args.busy))
        rows.append({"threads": threads, "policy": policy, "alone_s": alone, "busy_s": beside,
                     "ratio": beside / alone, "alone_all_s": seconds[(threads, policy), 0],
                     "busy_all_s": seconds[(threads, policy), args.busy]})
    result = {
        "command": "python " + " ".join([Path(__file__).relative_to(ROOT).as_posix(), *sys.argv[1:]]),
        "commit": _commit(), "device": f"cpu: {os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        "config": args.config, "steps": args.steps, "busy_processes": args.busy, "repeats": args.repeats,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"{result['command']}  (commit {result['commit']}, {result['device']})",
             f"load average (1/5/15 min) before {_load(load_before)}, after {_load(result['loadavg_after'])}",
             f"{args.steps} SFT steps of {args.config}, alone and beside {args.busy} spinning process(es), median of "
             f"{args.repeats} rounds (each round: every candidate in turn):"]
    lines += [f"  threads {r['threads']} {r['policy']:>10}: alone {r['alone_s']:6.2f}s, busy {r['busy_s']:6.2f}s, "
              f"x{r['ratio']:.2f}   (alone {_list(r['alone_all_s'])}; busy {_list(r['busy_all_s'])})" for r in rows]
    print("\n".join(lines))
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.txt')}")
    return result


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _list(xs: list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in xs)


def _load(load: tuple) -> str:
    return " / ".join(f"{x:.2f}" for x in load)


if __name__ == "__main__":
    main()
