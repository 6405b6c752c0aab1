"""Recorded trajectories and their viewer: what recording costs a run, and how fast the page opens when large.

1. ``recording``: the quickstart recipe for ``--steps`` RL steps with recording on (its default: 16 episodes per
   step): each step's ``perf/record_s`` against its ``perf/step_s`` (the same steps, in one run), the evaluations'
   recording time, and the trajectories' size on disk per 100 steps. With ``--ab``, the same run again with
   recording off (``logging.record_every=0``), after it: the RL steps' summed wall time of both (same seeds, same
   episodes; on a shared machine this difference is mostly noise — the direct measure is the first). ``--start``
   forks both runs from a checkpoint of a quickstart run (``trainer.resume``: its SFT is not done again; pass the
   recipe overrides that run had with ``--set``).
2. ``page``: 10,000 recorded episodes (``--episodes``; 625 steps of 16) made from a real run's records — the
   ``--template`` run directory's training episodes, repeated with their step and episode numbers changed — built
   into a viewer, then opened in headless Chromium (Debian's, through Playwright) ``--repeats`` times: the time
   from navigation to a usable page (``MTV.readyMs``, the page's own ``performance.now()`` once its table and curves
   are drawn), then opening an episode (its step file loaded and rendered) and a full-text search over every step.

    python benchmarks/bench_viewer.py recording --steps 10 --ab --out benchmarks/results/cpu/viewer.json
    python benchmarks/bench_viewer.py recording --start runs/q/checkpoints/checkpoint_1 --set sft.steps=200 ...
    python benchmarks/bench_viewer.py page --template runs/quickstart --out benchmarks/results/cpu/viewer.json

Both write into ``--out`` (their own key each) and a ``.txt`` beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not an installed copy

from mt_env import view  # noqa: E402
from mt_env.trajectories import DIRNAME, read_lines, recorded_steps, write_records  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


# --------------------------------------------------------------------------------------------- recording
def quickstart(out: Path, steps: int, extra: list[str]) -> tuple[list[dict], float]:
    """The quickstart recipe up to RL step `steps` in `out`; returns its step rows and the seconds spent recording
    evaluations."""
    from trainers import ppo
    from trainers.recording import Recorder
    from mt_env.trajectories import read_metrics

    spent = [0.0]
    record_eval = Recorder.record_eval

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return record_eval(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    Recorder.record_eval = timed
    try:
        overrides = [f"output_dir={out}", f"trainer.total_steps={steps}", "trainer.save_every=0",
                     "trainer.time_limit_s=null", "logging.plot=false", "logging.progress=false", *extra]
        ppo.main(["--config", "quickstart.yaml", *sum((["--set", o] for o in overrides), [])])
    finally:
        Recorder.record_eval = record_eval
    return [r for r in read_metrics(out / "metrics.jsonl") if "perf/step_s" in r], spent[0]


def measure_recording(args) -> dict:
    start = ([f"trainer.resume={Path(args.start).resolve()}"] if args.start else [])
    last = args.steps + (checkpoint_step(args.start) if args.start else 0)
    with tempfile.TemporaryDirectory() as tmp:
        on = Path(tmp) / "on"
        rows, eval_s = quickstart(on, last, [*args.set, *start])
        train = [p.stat().st_size for kind, _, p in recorded_steps(on) if kind == "train"]
        evals = [p.stat().st_size for kind, _, p in recorded_steps(on) if kind == "eval"]
        record_s, step_s = [r["perf/record_s"] for r in rows], [r["perf/step_s"] for r in rows]
        out = {
            "steps": len(rows), "episodes_recorded_per_step": 16, "record_s_mean": statistics.fmean(record_s),
            "record_s_max": max(record_s), "step_s_mean": statistics.fmean(step_s),
            "record_share_of_step_time": sum(record_s) / sum(step_s),
            "evaluations_recorded": len(evals), "eval_record_s_total": eval_s,
            "train_mb_per_100_steps": sum(train) / len(train) * 100 / 1e6,
            "eval_mb_per_evaluation": statistics.fmean(evals) / 1e6 if evals else None,
        }
        if args.ab:
            off_rows, _ = quickstart(Path(tmp) / "off", last, [*args.set, *start, "logging.record_every=0"])
            out["ab_step_s_sum_on"] = sum(step_s)
            out["ab_step_s_sum_off"] = sum(r["perf/step_s"] for r in off_rows)
            out["ab_ratio_on_over_off"] = out["ab_step_s_sum_on"] / out["ab_step_s_sum_off"]
        out["tokens_recorded_per_step"] = statistics.fmean(
            sum(len(s["pieces"]) for line in read_lines(p) for s in json.loads(line)["samples"])
            for kind, _, p in recorded_steps(on) if kind == "train")
    return out


def checkpoint_step(path: str) -> int:
    from trainers.checkpoints import read_state

    return read_state(Path(path)).step


# --------------------------------------------------------------------------------------------- page
def template_run(path: str | None, tmp: Path) -> Path:
    """A run directory with recorded training episodes: `path`, or a short quickstart-shaped run made here."""
    if path:
        return Path(path)
    run = tmp / "template"
    quickstart(run, 2, ["sft.steps=50", "eval.episodes=16"])
    return run


def synthetic_run(template: Path, out: Path, episodes: int, per_step: int) -> dict:
    """`episodes` recorded episodes, `per_step` a step, cycled from the template's training records."""
    records = [json.loads(line) for kind, _, p in recorded_steps(template) if kind == "train" for line in read_lines(p)]
    metrics = [json.loads(line) for line in (template / "metrics.jsonl").read_text().splitlines()]
    steps = -(-episodes // per_step)
    rows, k = [], 0
    for step in range(1, steps + 1):
        chunk = []
        for e in range(min(per_step, episodes - k)):
            chunk.append(dict(records[k % len(records)], step=step, episode=e))
            k += 1
        write_records(out, "train", step, chunk)
        rows.append(json.dumps(dict(metrics[step % len(metrics)], step=step)) + "\n")
    (out / "metrics.jsonl").write_text("".join(rows))
    return {"episodes": k, "steps": steps, "template_records": len(records)}


def open_page(index: Path, repeats: int) -> dict:
    from playwright.sync_api import sync_playwright

    ready, episode, search = [], [], None
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for k in range(repeats):
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(index.as_uri())
            page.wait_for_selector("body[data-ready='1']", timeout=60_000)
            ready.append(page.evaluate("MTV.readyMs"))
            start = page.evaluate("performance.now()")
            page.locator("#table tbody tr").nth(k).click()
            page.wait_for_selector("#episode .tokens span.t")
            episode.append(page.evaluate("performance.now()") - start)
            if k == repeats - 1:
                start = page.evaluate("performance.now()")
                page.fill("input[name=text]", "calculator")
                page.check("input[name=full]")
                page.wait_for_function("document.getElementById('search-progress').textContent.startsWith('searched')",
                                       timeout=600_000)
                search = page.evaluate("performance.now()") - start
            page.close()
        browser.close()
    return {"ready_ms": ready, "ready_ms_median": statistics.median(ready), "ready_ms_max": max(ready),
            "open_episode_ms_median": statistics.median(episode), "full_text_search_all_steps_ms": search}


def measure_page(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run = tmp / "synthetic"
        made = synthetic_run(template_run(args.template, tmp), run, args.episodes, 16)
        start = time.perf_counter()
        index = view.build(run)
        build_s = time.perf_counter() - start
        data = sum(p.stat().st_size for p in (run / "viewer" / "data").iterdir())
        stored = sum(p.stat().st_size for p in (run / DIRNAME).iterdir())
        return {**made, "build_s": build_s, "index_mb": index.stat().st_size / 1e6, "step_scripts_mb": data / 1e6,
                "trajectories_mb": stored / 1e6, **open_page(index, args.repeats),
                "goal_ready_ms": 2000}


# --------------------------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["recording", "page"])
    ap.add_argument("--steps", type=int, default=10, help="recording: RL steps of the quickstart")
    ap.add_argument("--ab", action="store_true", help="recording: also a run with recording off")
    ap.add_argument("--set", action="append", default=[], help="recording: recipe overrides (e.g. sft.steps=200)")
    ap.add_argument("--start", default=None, help="recording: a quickstart checkpoint both runs fork from")
    ap.add_argument("--template", default=None, help="page: a run directory whose recorded episodes are repeated")
    ap.add_argument("--episodes", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON results (their .txt beside it)")
    args = ap.parse_args()
    figures = measure_recording(args) if args.what == "recording" else measure_page(args)
    print(json.dumps(figures, indent=2))
    if args.out:
        save(Path(args.out), args.what, figures)


def save(out: Path, key: str, figures: dict) -> None:
    """Merge `figures` under `key` into `out`, with the command, commit and machine."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    results = json.loads(out.read_text()) if out.is_file() else {}
    results[key] = {"command": " ".join(["python", *sys.argv]), "commit": commit,
                    "device": f"{platform.processor() or platform.machine()}, shared 2-core CPU machine",
                    "date": time.strftime("%Y-%m-%d"), "load_average_1min": round(os.getloadavg()[0], 2), **figures}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".txt").write_text("".join(
        f"[{k}] {v['command']} (commit {v['commit']}, {v['date']}, {v['device']})\n"
        + "".join(f"  {name}: {value}\n" for name, value in v.items() if name not in ("command", "commit", "device"))
        for k, v in results.items()))


if __name__ == "__main__":
    main()
