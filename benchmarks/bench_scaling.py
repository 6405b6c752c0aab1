"""Two GPUs against one: the synchronous trainer's weak and strong scaling, the one-step off-policy mode, DDP
correctness and FSDP2 with the 3B shape — one command that writes ``scaling.json``.

    python benchmarks/bench_scaling.py --fsdp3b       # writes benchmarks/results/h200x2/scaling.json

Every configuration runs `trainers/ppo.py` on the GSM8K smoke recipe (random init, Qwen2.5-0.5B's shape,
``gsm8k_smoke_random_0.5b.yaml``) in its own subprocess, with its own run directory and a timeout; a failure is
recorded (with its log's tail) and the others still run, and the JSON is rewritten after each one. The runs:

* ``1gpu``         — one process on GPU 0, ``--prompts`` tasks per step;
* ``2gpu_weak``    — ``accelerate launch --num_processes 2 --multi_gpu``, twice the tasks (the same per GPU);
* ``2gpu_strong``  — the same, with ``--prompts`` tasks (half per GPU);
* ``async``        — two processes with ``trainer.async_rollout=true`` (one generates, one trains), ``--prompts``;
* ``ddp_check``    — `benchmarks/ddp_check.py` on the GPUs (fp32, one update, 1 vs 2 processes);
* ``fsdp3b``       — with ``--fsdp3b``: ``gsm8k_qwen2.5_3b.yaml`` with random init and the embedded engine under
  FSDP2 (``trainers/configs/accelerate/fsdp2.yaml``), fewer tasks and tokens, peak memory per GPU.

A step's time is ``perf/step_s`` from metrics.jsonl (rollout + update, without evaluation and checkpoints); the
figure of a run is the median over the steps after ``--warmup`` (compilation, cache and graph warm-up). Episodes per
second = episodes per step / that median. ``speedup_weak`` and ``speedup_strong`` are the 2-GPU runs' episodes per
second over one GPU's; ``sync_step_s`` is ``2gpu_strong``'s step time, ``async_step_s`` the async run's (same global
batch). Out of the run directories three files go to the results (`benchmarks/record.py`): ``scaling.json``,
``scaling.txt`` (the summary and each run's log tail) and ``scaling_runs.jsonl`` (every run's step rows); the full
logs go to ``--work`` (``scaling_logs.tar.gz``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import record  # noqa: E402
from trainers.checkpoints import scan  # noqa: E402
from mt_env.trajectories import read_metrics  # noqa: E402

SMOKE = "gsm8k_smoke_random_0.5b.yaml"
#: NCCL on machines whose NVLink multicast must stay off
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def gsm8k_data(given: str | None) -> str | None:
    for candidate in (given, os.environ.get("MT_ENV_GSM8K"), ROOT / "shared" / "data" / "gsm8k",
                      ROOT.parent / "shared" / "data" / "gsm8k"):
        if candidate and Path(candidate, "train.jsonl").is_file():
            return str(Path(candidate).resolve())
    return None


def machine() -> dict:
    """The GPUs (nvidia-smi; this process does not touch CUDA) and the library versions."""
    import accelerate
    import torch
    import transformers

    smi = shutil.which("nvidia-smi")
    gpus = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.strip().splitlines() if smi else []
    return {"gpus": gpus, "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__}


def repo_env(**extra: str) -> dict:
    """The environment of a child Python: this checkout first on its path (the caller's path kept after it)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(processes: int, config_file: str | None = None) -> list[str]:
    """The command prefix that starts trainers/ppo.py on `processes` GPUs."""
    if processes == 1 and config_file is None:
        return [sys.executable, "trainers/ppo.py"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port())]
    if config_file:
        return [*cmd, "--config_file", config_file, "trainers/ppo.py"]
    threads = max(1, (os.cpu_count() or processes) // processes)  # the machine's cores, shared (1 by default)
    return [*cmd, "--num_processes", str(processes), "--multi_gpu", "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--num_cpu_threads_per_process", str(threads), "trainers/ppo.py"]


def sets(**overrides) -> list[str]:
    return [a for k, v in overrides.items() for a in ("--set", f"{k.replace('__', '.')}={v}")]


def plan(args, work: Path) -> list[dict]:
    """Every run: name, command, environment, timeout."""
    common = dict(trainer__total_steps=args.steps, trainer__eval_every=0, trainer__save_every=0,
                  trainer__time_limit_s="null", eval__episodes=2, logging__plot="false", logging__progress="false")
    p = args.prompts
    runs = [dict(name="ddp_check", cmd=[sys.executable, "benchmarks/ddp_check.py", "--device", "cuda", "--out",
                                        str(work / "ddp_check.json")], timeout=240)]
    for name, processes, prompts, extra in (("1gpu", 1, p, {}), ("2gpu_weak", 2, 2 * p, {}),
                                            ("2gpu_strong", 2, p, {}),
                                            ("async", 2, p, {"trainer__async_rollout": "true"})):
        cmd = [*launch(processes), "--config", SMOKE,
               *sets(output_dir=work / name, rollout__prompts_per_step=prompts, **common, **extra)]
        runs.append(dict(name=name, cmd=cmd, env={"CUDA_VISIBLE_DEVICES": "0"} if processes == 1 else {},
                         timeout=args.run_timeout))
    if args.fsdp3b:
        cmd = [*launch(2, "trainers/configs/accelerate/fsdp2.yaml"), "--config", "gsm8k_qwen2.5_3b.yaml",
               *sets(output_dir=work / "fsdp3b", model__path="null", model__preset="qwen2.5-3b",
                     tokenizer__name="offline:qwen2.5", rollout__backend="hf", rollout__prompts_per_step=16,
                     rollout__n=8, rollout__max_new_tokens=256, rollout__max_batch_size=128, device="cuda",
                     **dict(common, trainer__total_steps=args.fsdp_steps))]
        runs.append(dict(name="fsdp3b", cmd=cmd, timeout=args.run_timeout + 120))
    return runs


def execute(run: dict, work: Path, env: dict, seconds: float) -> dict:
    """Run one configuration in its own process group (a timeout stops the launcher and every worker, so no
    process keeps a GPU for the next run); returns its status, wall time and log path."""
    shutil.rmtree(work / run["name"], ignore_errors=True)
    log = work / f"{run['name']}.log"
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(run["cmd"], cwd=ROOT, env={**env, **run.get("env", {})}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=seconds)
            status = "ok" if code == 0 else f"failed (exit status {code})"
        except subprocess.TimeoutExpired:
            status = f"timeout after {seconds:.0f}s"
        for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):  # the workers too, whatever happened
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
    return {"status": status, "wall_s": round(time.perf_counter() - start, 1), "log": str(log),
            "command": " ".join(str(c) for c in run["cmd"])}


def step_figures(run_dir: Path, warmup: int) -> dict:
    """Median step time after the warm-up, episodes per step and per second, peak memory, the median of every
    ``perf/`` and ``async/`` metric; and the step rows."""
    path = run_dir / "metrics.jsonl"
    rows = read_metrics(path) if path.is_file() else []
    steps = [r for r in rows if "perf/step_s" in r]
    timed = [r for r in steps if r["step"] > warmup] or steps
    if not timed:
        return {"rows": rows}
    step_s = statistics.median(r["perf/step_s"] for r in timed)
    episodes = statistics.median(r["rollout/episodes"] for r in timed)
    keys = sorted({k for r in timed for k in r if k.startswith(("perf/", "async/")) and isinstance(r[k], float)})
    return {"rows": rows, "steps": len(steps), "timed_steps": [r["step"] for r in timed], "step_s": step_s,
            "episodes_per_step": episodes, "episodes_per_s": episodes / step_s,
            "peak_gib": max((r["perf/peak_gib"] for r in steps if "perf/peak_gib" in r), default=None),
            "peak_reserved_gib": max((r["perf/peak_reserved_gib"] for r in steps if "perf/peak_reserved_gib" in r),
                                     default=None),
            "medians": {k: statistics.median(r[k] for r in timed if k in r) for k in keys}}


def rows_path(rec: record.Record) -> Path:
    return rec.json_path.with_name(rec.json_path.stem + "_runs.jsonl")


def earlier_runs(rec: record.Record) -> dict:
    """The runs of an earlier report at `rec`'s place (with their step rows), so that a run repeated with --only
    replaces its own entry and keeps the others."""
    if not rec.json_path.is_file():
        return {}
    runs = json.loads(rec.json_path.read_text()).get("runs", {})
    rows_file = rows_path(rec)
    for line in rows_file.read_text().splitlines() if rows_file.is_file() else []:
        row = json.loads(line)
        runs.setdefault(row.pop("run"), {}).setdefault("rows", []).append(row)
    return runs


def summary(results: dict) -> dict:
    def fig(name, key):
        return results.get(name, {}).get(key)

    def ratio(a, b):
        return a / b if a is not None and b else None

    ddp = results.get("ddp_check", {}).get("report") or {}
    return {
        "speedup_weak": ratio(fig("2gpu_weak", "episodes_per_s"), fig("1gpu", "episodes_per_s")),
        "speedup_strong": ratio(fig("2gpu_strong", "episodes_per_s"), fig("1gpu", "episodes_per_s")),
        "update_matches_1gpu": ddp.get("update_matches_1gpu"),
        "fsdp_3b_step_s": fig("fsdp3b", "step_s"), "fsdp_3b_peak_gib": fig("fsdp3b", "peak_gib"),
        "async_step_s": fig("async", "step_s"), "sync_step_s": fig("2gpu_strong", "step_s"),
        "async_speedup": ratio(fig("2gpu_strong", "step_s"), fig("async", "step_s")),
        "step_s": {k: fig(k, "step_s") for k in ("1gpu", "2gpu_weak", "2gpu_strong", "async", "fsdp3b")},
        "episodes_per_s": {k: fig(k, "episodes_per_s") for k in ("1gpu", "2gpu_weak", "2gpu_strong", "async")},
    }


def write(rec: record.Record, results: dict, meta: dict) -> dict:
    report = {**summary(results), **meta,
              "commands": {k: v["command"] for k, v in results.items()},
              "runs": {k: {x: y for x, y in v.items() if x not in ("rows", "log_tail")} for k, v in results.items()}}
    rec.write(report)
    with rows_path(rec).open("w") as f:
        for name, r in results.items():
            for row in r.get("rows", []):
                f.write(json.dumps({"run": name, **row}) + "\n")
    lines = [rec.header()] + [f"{k}: {report[k]}" for k in (
        "speedup_weak", "speedup_strong", "update_matches_1gpu", "fsdp_3b_step_s", "fsdp_3b_peak_gib", "async_step_s",
        "sync_step_s", "async_speedup")]
    for name, r in results.items():
        lines += ["", f"== {name}: {r['status']} in {r['wall_s']}s", f"   {r['command']}"]
        if "step_s" in r:
            lines.append(f"   step_s {r['step_s']:.2f} (median of steps {r['timed_steps']}), episodes/step "
                         f"{r['episodes_per_step']:.0f}, episodes/s {r['episodes_per_s']:.1f}, peak {r['peak_gib']} "
                         f"GiB, checkpoints {r.get('checkpoints')}")
            lines += [f"     {k} {v:.3f}" for k, v in r["medians"].items()]
        lines += [f"   | {line}" for line in r.get("log_tail", [])]
    rec.txt_path.write_text("\n".join(lines) + "\n")
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    record.add_arguments(ap)
    ap.add_argument("--work", default="/tmp/bench_scaling", help="run directories and full logs")
    ap.add_argument("--data", default=None, help="GSM8K directory (train.jsonl, test.jsonl); default $MT_ENV_GSM8K "
                                                 "or shared/data/gsm8k")
    ap.add_argument("--prompts", type=int, default=32, help="tasks per step of the 1-GPU run (x8 samples)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    ap.add_argument("--fsdp3b", action="store_true", help="also the 3B shape under FSDP2")
    ap.add_argument("--fsdp-steps", type=int, default=3)
    ap.add_argument("--only", default=None, help="comma-separated run names (the earlier report at --out keeps the "
                                                 "other runs)")
    ap.add_argument("--run-timeout", type=float, default=170.0, help="seconds per run (FSDP: 120 more)")
    ap.add_argument("--budget", type=float, default=550.0, help="seconds for everything: runs that cannot start "
                                                                "with 45s left are skipped")
    args = ap.parse_args()
    start, work = time.perf_counter(), Path(args.work)
    rec = record.start(args, "scaling", device="cuda", gpus=2, tee=False)
    work.mkdir(parents=True, exist_ok=True)
    data = gsm8k_data(args.data)
    if data is None:
        raise SystemExit("bench_scaling: no GSM8K data (train.jsonl, test.jsonl): pass --data DIR or set $MT_ENV_GSM8K")
    env = repo_env(**NCCL_ENV, MT_ENV_GSM8K=data)
    meta = {"gsm8k": data, "prompts": args.prompts, "steps": args.steps,
            "warmup": args.warmup, "machine": machine()}
    results: dict = earlier_runs(rec) if args.only else {}
    runs = [r for r in plan(args, work) if not args.only or r["name"] in args.only.split(",")]
    for run in runs:
        left = args.budget - (time.perf_counter() - start)
        if left < 45:
            results[run["name"]] = {"status": "skipped: out of time", "wall_s": 0, "command": " ".join(run["cmd"])}
            continue
        print(f"[{time.perf_counter() - start:5.0f}s] {run['name']} ...", flush=True)
        r = execute(run, work, env, min(run["timeout"], left - 10)) | {"commit": rec.provenance["commit"]}
        if run["name"] == "ddp_check" and (work / "ddp_check.json").is_file():
            r["report"] = json.loads((work / "ddp_check.json").read_text())
        else:
            r.update(step_figures(work / run["name"], args.warmup if run["name"] != "fsdp3b" else 1))
            r["checkpoints"] = {f.path.name: f.problem or "complete" for f in scan(work / run["name"])}
        tail = Path(r["log"]).read_text(errors="replace").splitlines()
        r["log_tail"] = tail[-40:] if r["status"] != "ok" else tail[-6:]
        results[run["name"]] = r
        print(f"         {r['status']} in {r['wall_s']}s" + (f", step {r['step_s']:.2f}s" if "step_s" in r else ""),
              flush=True)
        report = write(rec, results, meta)
    report = write(rec, results, meta)
    logs = work / "scaling_logs.tar.gz"
    with tarfile.open(logs, "w:gz") as tar:  # the full log of every run made now
        for r in results.values():
            if "log" in r and Path(r["log"]).is_file():
                tar.add(r["log"], arcname=Path(r["log"]).name)
    print("\n".join(f"{k}: {report[k]}" for k in ("speedup_weak", "speedup_strong", "update_matches_1gpu",
                                                  "fsdp_3b_step_s", "fsdp_3b_peak_gib", "async_step_s",
                                                  "sync_step_s", "async_speedup")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
