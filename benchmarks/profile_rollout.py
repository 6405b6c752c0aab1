"""Where the rollout driver loses time against the engine: one driver run and one engine replay of the same token
work (`bench_rollout.py`'s setup) under `torch.profiler`, and a table of the device's idle time by what each
thread was doing meanwhile.

The worker's phases (gathering, prefill, launching a decode step, collecting one) and the event loop's env work
(reset, step) are marked by subclasses local to this script (host-clock ranges, aligned with the trace's clock
through an "anchor" range: the profiler records CPU ranges of the profiling thread only); the device's busy time is
the union of its kernels and copies in the trace. Every idle stretch of the device is attributed to the pair
(worker phase, event-loop activity) at its middle: e.g. ``prefill | env.step`` is the device waiting while the worker
runs a prefill pass and the event loop steps envs (both want the GIL).

    python benchmarks/profile_rollout.py --model qwen2.5-0.5b --device cuda --batch 64 --new-tokens 128 \
        --out /tmp/profile    # writes profile.json and, per run, a gzipped Chrome trace (chrome://tracing, Perfetto)
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import functools
import gc
import gzip
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import agents.hf_policy  # noqa: E402
import agents.rollout_processes  # noqa: E402
from agents.hf_policy import HFPolicy, _resolve  # noqa: E402
from agents.policy import SamplingParams  # noqa: E402
from benchmarks import record  # noqa: E402
from benchmarks.bench_rollout import (  # noqa: E402
    KeepGoingEnv, build_model, make_driver, make_policy, make_tasks, run_engine, turn_work)
from mt_env.tokenizer import load_tokenizer  # noqa: E402

GAP_S = 50e-6  # idle stretches shorter than this are launch jitter, not lost time


MARKS: list[tuple[float, float, str, str]] = []  #: (start, end) in perf_counter seconds, name, thread role
DETAILS: list[tuple[float, float, str]] = []  #: (start, end, what) of the timeline's events
ARRIVALS: list[float] = []  #: when the worker took each request
LOOP_ARRIVALS: list[float] = []  #: when this process's event loop read each generation request of an env process
RECORDS: list[float] = []  #: when this process's event loop read each episode record of an env process


@contextlib.contextmanager
def mark(name: str, role: str):
    """Record a range of this thread's work (the profiler records only the profiling thread's CPU ranges)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        MARKS.append((start, time.perf_counter(), name, role))


class MarkedPolicy(HFPolicy):
    """HFPolicy with its worker's phases marked (names without the leading underscore), and the timeline's
    details: each prefill pass's rows, width and tokens, slow launches (graph captures), request arrivals, the
    worker's idle stretches (no row decoding, nothing waiting: the device waits for the envs)."""

    _idle_since: float | None = None

    def _serving(self, on):
        now = time.perf_counter()
        if not on and self._idle_since is None:
            self._idle_since = now
        elif on and self._idle_since is not None:
            if now - self._idle_since > 1e-3:
                DETAILS.append((self._idle_since, now, f"worker idle {(now - self._idle_since) * 1e3:.1f} ms"))
            self._idle_since = None
        super()._serving(on)

    def _prefill_slots(self, requests):
        lengths = [len(r.prompt) for r in requests]
        decoding, start = self._slots.held_count(), time.perf_counter()
        with mark("prefill_slots", "worker"):
            super()._prefill_slots(requests)
        DETAILS.append((start, time.perf_counter(), f"prefill {len(requests)} rows, width {max(lengths)}, "
                        f"{sum(lengths)} tokens ({len(requests) * max(lengths) - sum(lengths)} padding), "
                        f"{decoding} rows decoding"))

    def _launch_step(self, previous):
        captures, start = self.stats["graph_captures"], time.perf_counter()
        with mark("launch_step", "worker"):
            launched = super()._launch_step(previous)
        end = time.perf_counter()
        if end - start > 1e-3:
            DETAILS.append((start, end, f"launch of {self._slots.held_count()} rows took {(end - start) * 1e3:.1f} ms"
                            f" ({self.stats['graph_captures'] - captures} captures)"))
        return launched

    def _accept(self, item):
        if hasattr(item, "prompt"):
            ARRIVALS.append(time.perf_counter())
        return super()._accept(item)

    def _gather(self):
        with mark("gather", "worker"):
            return super()._gather()

    def _collect(self, launched):
        held, start = self._slots.held_count(), time.perf_counter()
        with mark("collect", "worker"):
            super()._collect(launched)
        ended = held - self._slots.held_count()
        if ended >= 8:  # a turn boundary (many turns ending at one step)
            DETAILS.append((start, start, f"{ended} rows ended, {self._slots.held_count()} decoding"))


class MarkedEnvProcess(agents.rollout_processes._EnvProcess):
    """The driver's side of an env process, marking when this process's event loop reads each generation request
    (before the worker takes it: the two differ by the event loop's own work and its waits for the GIL) and the
    answers it sends."""

    def _handle(self, message, *args):
        now = time.perf_counter()
        if message[0] == "generate":
            LOOP_ARRIVALS.append(now)
        elif message[0] == "finished":
            RECORDS.append(now)
        elif message[0] == "result":
            DETAILS.append((now, now, f"result of env process {self.index}"))
        return super()._handle(message, *args)

    def _send_replies(self):
        count, start = len(self._replies), time.perf_counter()
        super()._send_replies()
        if count >= 8:
            DETAILS.append((start, time.perf_counter(), f"{count} answers sent to an env process"))


def _marked_resolve(loop, settlements):
    """`hf_policy._resolve`, also marking when the event loop ran a callback queued just before `_resolve`'s own:
    how long the callers of the requests that ended at one step waited for the loop (busy with other work)."""
    queued = time.perf_counter()

    def ran() -> None:
        now = time.perf_counter()
        DETAILS.append((queued, now, f"{len(settlements)} results settled: the event loop ran their callback "
                        f"{(now - queued) * 1e3:.1f} ms after the worker queued it"))
    if len(settlements) >= 8:  # only those: a marking callback for every lone result would be a wake-up more each
        try:
            loop.call_soon_threadsafe(ran)
        except RuntimeError:
            pass
    _resolve(loop, settlements)


def _gc_timer():
    """gc.callbacks entry recording collections longer than 1 ms (they hold the GIL: every thread waits)."""
    started = {}

    def callback(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            end = time.perf_counter()
            if end - started["t"] > 1e-3:
                DETAILS.append((started["t"], end, f"gc generation {info['generation']}: "
                                f"{(end - started['t']) * 1e3:.1f} ms, {info['collected']} collected"))
    return callback


def timeline(fn, name: str) -> object:
    """Run `fn()` with the marks only (no profiler: nothing slows the threads) and print its timeline."""
    MARKS.clear(), DETAILS.clear(), ARRIVALS.clear(), LOOP_ARRIVALS.clear(), RECORDS.clear()
    callback = _gc_timer()
    gc.callbacks.append(callback)
    start = time.perf_counter()
    try:
        result = fn()
    finally:
        gc.callbacks.remove(callback)
    wall = time.perf_counter() - start
    phases = Counter()
    for a, b, label, role in MARKS:
        phases[f"{role} {label}"] += b - a
    print(f"\n{name}: wall {wall:.3f} s; " + ", ".join(f"{k} {v:.3f} s" for k, v in sorted(phases.items())))
    slow = [b - a for a, b, what in DETAILS if what.startswith("launch")]
    print(f"  launches over 1 ms: {len(slow)} taking {sum(slow) * 1e3:.0f} ms; over 4 ms: "
          f"{sum(d > 4e-3 for d in slow)} taking {sum(d for d in slow if d > 4e-3) * 1e3:.0f} ms (listed)")
    last = start
    for a, b, what in sorted(DETAILS):
        if what.startswith("launch") and b - a <= 4e-3:
            continue
        arrived = [t for t in ARRIVALS if last <= t < a]
        since = (f"; {len(arrived)} arrived over {(arrived[-1] - arrived[0]) * 1e3:.1f} ms from "
                 f"{(arrived[0] - start) * 1e3:.1f}") if arrived and what.startswith("prefill") else ""
        read = [t for t in LOOP_ARRIVALS if last <= t < a]
        if read and since:
            since += (f" (read by the event loop over {(read[-1] - read[0]) * 1e3:.1f} ms from "
                      f"{(read[0] - start) * 1e3:.1f})")
        print(f"  {(a - start) * 1e3:8.1f} ms  +{(b - a) * 1e3:6.1f} ms  {what}{since}")
        if what.startswith("prefill"):
            last = a
    if RECORDS:  # the episodes' records, read as they end; the last ones after the last turn
        tail = [t for t in RECORDS if t >= RECORDS[-1] - 0.1]
        print(f"  {len(RECORDS)} episode records read by the event loop; the last {len(tail)} from "
              f"{(tail[0] - start) * 1e3:.1f} to {(tail[-1] - start) * 1e3:.1f} ms")
    return result


class MarkedEnv(KeepGoingEnv):
    """The benchmark's env with its reset and step marked."""

    async def areset(self, **kwargs):
        with mark("env.reset", "loop"):
            return await super().areset(**kwargs)

    async def astep(self, action):
        with mark("env.step", "loop"):
            return await super().astep(action)


def intervals(events: list[dict], keep) -> list[tuple[float, float]]:
    """Merged [start, end) intervals (µs) of the events `keep` accepts."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if keep(e))
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(m) for m in merged]


def innermost(ranges: list[tuple[float, float, str]], at: float) -> str:
    """The name of the latest-starting range (of one thread) that covers `at`; '-' when none does."""
    starts = [r[0] for r in ranges]
    i = bisect.bisect_right(starts, at)
    for start, end, name in reversed(ranges[max(0, i - 64):i]):
        if start <= at < end:
            return name
    return "-"


def analyse(trace: dict, marks: list[tuple[float, float, str, str]], anchor: float) -> dict:
    """Device busy time over the run's wall time, and its idle time by (worker phase | event-loop activity).
    `anchor`: the perf_counter time of the trace's "anchor" range, which aligns the marks with the trace's clock."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    base = next(e["ts"] for e in events if e.get("name") == "anchor") - anchor * 1e6
    device = intervals(events, lambda e: e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    by_role = defaultdict(list)
    for start, end, name, role in marks:
        by_role[role].append((base + start * 1e6, base + end * 1e6, name))
    for ranges in by_role.values():
        ranges.sort()
    runs = [e for e in events if e.get("name") == "run"]
    wall = (runs[0]["ts"], runs[0]["ts"] + runs[0]["dur"])
    busy = sum(min(b, wall[1]) - max(a, wall[0]) for a, b in device if b > wall[0] and a < wall[1])
    idle = Counter()
    edges = [wall[0]] + [x for span in device for x in span] + [wall[1]]
    for a, b in zip(edges[::2], edges[1::2]):
        a, b = max(a, wall[0]), min(b, wall[1])
        if b - a >= GAP_S * 1e6:
            mid = (a + b) / 2
            idle[f"{innermost(by_role['worker'], mid)} | {innermost(by_role['loop'], mid)}"] += b - a
    phases = Counter()
    for role, ranges in by_role.items():
        for start, end, name in ranges:
            phases[f"{role} {name}"] += end - start
    counts = Counter(f"{role} {name}" for _, _, name, role in marks)
    return dict(wall_s=(wall[1] - wall[0]) / 1e6, device_busy_s=busy / 1e6,
                idle_by_phase_s={k: v / 1e6 for k, v in idle.most_common()},
                thread_phase_s={k: v / 1e6 for k, v in sorted(phases.items())}, thread_phase_counts=dict(counts))


def profiled(fn, out: Path, name: str) -> tuple[dict, object, list, float]:
    """Run `fn()` under the profiler; write the gzipped trace; return (the trace, fn's result, the marks made
    meanwhile, the anchor's perf_counter time, the seconds under the profiler)."""
    MARKS.clear()
    cuda = torch.cuda.is_available()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        with record_function("anchor"):
            anchor = time.perf_counter()
        with record_function("run"):
            result = fn()
            if cuda:
                torch.cuda.synchronize()
    profiled_s, marks = time.perf_counter() - start, list(MARKS)
    path = out / f"{name}.json.gz"
    prof.export_chrome_trace(str(path))  # gzipped by torch (the name ends in .gz)
    return json.loads(gzip.decompress(path.read_bytes())), result, marks, anchor, profiled_s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["tiny", "qwen2.5-0.5b"], default="qwen2.5-0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, nargs="+", default=[64])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--admit-wait-steps", type=int, help="HFPolicy's admit_wait_steps (default: its own)")
    ap.add_argument("--fast-path", choices=["auto", "on"], default="auto", help="on: HFPolicy's fast path also on CPU")
    ap.add_argument("--env-processes", type=int, default=0, help="--timeline: also run the driver with its env work "
                    "in this many processes")
    ap.add_argument("--timeline", action="store_true", help="no profiler: print each run's prefill passes, slow "
                    "launches and garbage collections, with the requests' arrivals")
    ap.add_argument("--out", default="/tmp/profile_rollout")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer("offline:qwen2.5")
    model, shape = build_model(args.model, args.device, len(tokenizer))
    policy = make_policy(MarkedPolicy, model, args, len(tokenizer))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    driver = make_driver(functools.partial(MarkedEnv, tokenizer=tokenizer), policy, sampling, max(args.batch))
    agents.rollout_processes._EnvProcess = MarkedEnvProcess  # the env processes this script starts are marked
    agents.hf_policy._resolve = _marked_resolve
    processes = make_driver(functools.partial(KeepGoingEnv, tokenizer=tokenizer), policy, sampling, max(args.batch),
                            args.env_processes) if args.timeline and args.env_processes else None
    tasks = make_tasks(max(args.batch))
    report = dict(model=shape, fast_path=policy.fast_path_reason, compile=policy.compile_reason, runs={})
    rec = record.Record(out / "profile.json", args.device)  # a diagnosis, not a record: its folder is --out
    try:
        for batch in args.batch:
            for warm in range(2):  # the shapes of this size: compiled, captured
                asyncio.run(run_engine(policy, turn_work(driver.run(tasks[:batch], step=50 + warm)), 1.0))
                if processes is not None:
                    processes.run(tasks[:batch], step=60 + warm)
            if args.timeline:
                result = timeline(lambda: driver.run(tasks[:batch], step=1), f"driver, {batch} episodes")
                timeline(lambda: asyncio.run(run_engine(policy, turn_work(result), 1.0)), f"engine, {batch} episodes")
                if processes is not None:
                    timeline(lambda: processes.run(tasks[:batch], step=1),
                             f"driver with {args.env_processes} env processes, {batch} episodes")
                continue
            driver_run = profiled(lambda: driver.run(tasks[:batch], step=1), out, f"driver_{batch}")
            result = driver_run[1]
            work = turn_work(result)
            engine_run = profiled(lambda: asyncio.run(run_engine(policy, work, 1.0)), out, f"engine_{batch}")
            tokens = int(result.metrics["rollout/generated_tokens"])
            for name, (trace, _, marks, anchor, _) in (("driver", driver_run), ("engine", engine_run)):
                report["runs"][f"{name}_{batch}"] = dict(tokens=tokens, **analyse(trace, marks, anchor))
            report["runs"][f"driver_{batch}"]["wall_with_profiler_s"] = driver_run[4]
            print_report(report["runs"], batch)
    finally:
        asyncio.run(policy.close())
        driver.close()
        if processes is not None:
            processes.close()
    if report["runs"]:  # --timeline profiles nothing: an earlier profile in `out` stays
        rec.write(report)


def print_report(runs: dict, batch: int) -> None:
    for name in (f"driver_{batch}", f"engine_{batch}"):
        r = runs[name]
        print(f"\n{name}: wall {r['wall_s']:.3f} s, device busy {r['device_busy_s']:.3f} s "
              f"({r['device_busy_s'] / max(r['wall_s'], 1e-9):.0%}), {r['tokens'] / r['wall_s']:,.0f} tok/s")
        print("  device idle by (worker phase | event loop):")
        for k, v in list(r["idle_by_phase_s"].items())[:12]:
            print(f"    {v:8.3f} s  {k}")
        print("  thread time in ranges:", ", ".join(f"{k} {v:.3f} s ({r['thread_phase_counts'][k]}x)"
                                                    for k, v in r["thread_phase_s"].items()))


if __name__ == "__main__":
    main()
