"""Where a GPU waited for its host, read from a profiler trace (the Chrome trace JSON torch.profiler exports).

Every interval longer than `GAP_US` in which no kernel, copy or memset ran is a gap; it is charged to the kernel
that ended it, and through that kernel's CUDA correlation id to the runtime or driver call that launched it, and
through the launch's time and thread to the innermost frame of this repository's code and the innermost torch op
running on the host then: the code that was late to launch. Host syncs (``cudaStreamSynchronize``, device-to-host
copies, ...) are listed by frame too: after one the device drains its queue and waits for the host to refill it.
For the longest phases it lists their costliest kernels (each charged to the phase that launched it).

The trace, not `torch.profiler`'s event objects, is the input: it is a documented format (Perfetto, Holistic Trace
Analysis read it), and a trace saved on a GPU machine can be analysed again anywhere:

    python benchmarks/trace_gaps.py /tmp/update_trace.json.gz --top 20
"""

from __future__ import annotations

import argparse
import bisect
import functools
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

#: device idle intervals shorter than this (microseconds) are launch latency, not waiting for the host
GAP_US = 10.0
#: the longest phases whose kernels `report` lists
KERNEL_PHASES = 4
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
#: a frame of this repository's code: torch names frames by their path under a `sys.path` entry (the repository's
#: root for its packages), so ours start with a package's name; an installed library's "gymnasium/envs/..." does not
OUR_FRAME = re.compile(r"^((?:agents|trainers|mt_env|envs|benchmarks)/[\w/]+\.py\(\d+\): .*)$")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync", "cuStreamSynchronize")


def load(path: str | Path) -> list[dict]:
    """The complete ("X") events of a Chrome trace file, gzipped or not."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return [e for e in (data["traceEvents"] if isinstance(data, dict) else data) if e.get("ph") == "X"]


def enclosing(events: list[dict], times: list[tuple[float, int]]) -> dict[int, list[dict]]:
    """For each (time, key) of one host thread, the events of that thread running at that time, outermost first.
    Events of one thread nest (an op inside a Python call inside another), mostly; one sweep over both sorted
    lists."""
    events = sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0)))
    stack: list[dict] = []
    out, i = {}, 0
    for t, key in sorted(times):
        while i < len(events) and events[i]["ts"] <= t:
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < events[i]["ts"]:
                stack.pop()
            stack.append(events[i])
            i += 1
        while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < t:
            stack.pop()
        # a trace's events do not always nest (a Python call recorded as ending after the op it called): keep only
        # those that contain t, so an ended caller left under a longer callee is not reported as running
        out[key] = [e for e in stack if t <= e["ts"] + e.get("dur", 0)]
    return out


#: the op autograd's engine wraps each backward node in (on its own thread, where no frame of ours runs)
BACKWARD_NODE = "autograd::engine::evaluate_function: "


def label(stack: list[dict]) -> tuple[str, str]:
    """(the innermost frame of this repository's code, the innermost torch op) of a host stack, "?" where none; in
    autograd's backward thread, the frame is the backward node being evaluated ("backward of MmBackward0")."""
    frame = next((m.group(1) for e in reversed(stack) if e.get("cat") == "python_function"
                  for m in [OUR_FRAME.search(e["name"])] if m), None)
    node = next((e["name"][len(BACKWARD_NODE):] for e in stack if e["name"].startswith(BACKWARD_NODE)), None)
    op = next((e["name"] for e in reversed(stack) if e.get("cat") == "cpu_op"), "?")
    return frame or (f"backward of {node}" if node else "?"), op


def host_stacks(events: list[dict], at: dict[int, tuple[float, object]]) -> dict[int, list[dict]]:
    """The host stack at each point `at` (key: (time, thread)), per thread in one sweep."""
    by_tid: dict = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "python_function"):
            by_tid[e.get("tid")].append(e)
    times: dict = defaultdict(list)
    for key, (t, tid) in at.items():
        times[tid].append((t, key))
    stacks: dict[int, list[dict]] = {}
    for tid, queries in times.items():
        stacks.update(enclosing(by_tid.get(tid, []), queries))
    return stacks


def phases(events: list[dict]) -> list[tuple[float, float, str]]:
    """The main thread's phases, in order: (start, end, frame) of each call of this repository's code that no other
    of its calls encloses except a ``main`` (the trainer's loop: its rollout, scoring passes, update, ...). The main
    thread is the one with the longest call of this repository's code among those not started by `threading` (a
    library's worker, or one of ours that watches a process)."""
    calls = [e for e in events if e.get("cat") == "python_function"]
    workers = {e.get("tid") for e in calls
               if e["name"].startswith("threading.py(") and e["name"].endswith(": _bootstrap")}
    ours = [e for e in calls if OUR_FRAME.search(e["name"]) and e.get("tid") not in workers]
    if not ours:
        return []
    main_tid = max(ours, key=lambda e: e.get("dur", 0)).get("tid")
    frame_of = functools.lru_cache(maxsize=None)(lambda name: (m := OUR_FRAME.search(name)) and m.group(1))
    stack: list[tuple[float, bool]] = []  # (end, whether it is a frame of ours other than a `main`) per open call
    inner, out = 0, []  # inner: how many of the stack's calls are frames of ours other than a `main`
    for e in sorted((e for e in calls if e.get("tid") == main_tid), key=lambda e: (e["ts"], -e.get("dur", 0))):
        while stack and stack[-1][0] <= e["ts"]:  # ended: not a caller of e
            inner -= stack.pop()[1]
        frame = frame_of(e["name"])
        is_inner = bool(frame) and not frame.endswith(": main")
        if is_inner and not inner:
            out.append((e["ts"], e["ts"] + e.get("dur", 0), frame))
        # a callee ends by its caller's end: some events (a pybind11 method's) are recorded as running to the
        # trace's end, and left so they would keep their caller "open" under them
        stack.append((min(e["ts"] + e.get("dur", 0), stack[-1][0] if stack else float("inf")), is_inner))
        inner += is_inner
    return out


def busy_within(intervals: list[tuple[float, float]], windows: list[tuple[float, float, str]]) -> dict:
    """{frame: [wall us, device-busy us]} of `windows` (sorted, disjoint), from the device's merged `intervals`."""
    out: dict = defaultdict(lambda: [0.0, 0.0])
    i = 0
    for start, end, frame in windows:
        out[frame][0] += end - start
        while i < len(intervals) and intervals[i][1] <= start:
            i += 1
        j = i
        while j < len(intervals) and intervals[j][0] < end:
            out[frame][1] += min(end, intervals[j][1]) - max(start, intervals[j][0])
            j += 1
    return dict(out)


def kernels_within(device: list[dict], launches: dict, windows: list[tuple[float, float, str]]) -> dict:
    """{frame: {kernel name: [device us, calls]}}: each kernel of `device` charged to the window (of `windows`,
    sorted, disjoint) in which it was launched, or began where its launch is not in the trace (the device runs
    behind the host: a kernel can run after the phase that launched it ended)."""
    starts = [w[0] for w in windows]
    out: dict = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for k in device:
        if k.get("cat") != "kernel":
            continue
        launch = launches.get(k.get("args", {}).get("correlation"))
        frame = _window_of(starts, windows, launch["ts"] if launch is not None else k["ts"])
        if frame is not None:
            entry = out[frame][k["name"]]
            entry[0] += k.get("dur", 0)
            entry[1] += 1
    return {frame: dict(names) for frame, names in out.items()}


def analyse(events: list[dict], gap_us: float = GAP_US) -> dict:
    """The trace's device gaps and host syncs. Returns ``busy_us`` (the union of device intervals), ``idle_us``,
    ``gaps`` (count), ``by_launch`` {(frame, op): [us, gaps]}, ``syncs`` {(frame, call): [us, calls]} and
    ``phases`` {frame: [wall us, device-busy us]} (`phases`), ``kernels`` {frame: {kernel: [us, calls]}}
    (`kernels_within`) and ``phase_gaps`` {frame: {(frame, op): [us, gaps]}} (`gaps_within`)."""
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    idle, merged = 0.0, []  # merged: the union of the device's intervals, in order
    late = {}  # gap number -> (microseconds, the launch of the kernel that ended it)
    for k in device:
        start, stop = k["ts"], k["ts"] + k.get("dur", 0)
        if merged and start - merged[-1][1] > gap_us:
            idle += start - merged[-1][1]
            late[len(late)] = (start - merged[-1][1], launches.get(k.get("args", {}).get("correlation")))
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    syncs = [e for e in events if e.get("cat") in LAUNCH_CATS and e["name"] in SYNC_CALLS]
    points = {n: (launch["ts"], launch.get("tid")) for n, (_, launch) in late.items() if launch is not None}
    points.update({-1 - n: (e["ts"], e.get("tid")) for n, e in enumerate(syncs)})
    stacks = host_stacks(events, points)
    labels = {n: label(stacks[n]) if launch is not None else ("? (no launch found)", "?")
              for n, (_, launch) in late.items()}
    by_launch: dict = defaultdict(lambda: [0.0, 0])
    for n, (us, _) in late.items():
        entry = by_launch[labels[n]]
        entry[0] += us
        entry[1] += 1
    by_sync: dict = defaultdict(lambda: [0.0, 0])
    for n, e in enumerate(syncs):
        entry = by_sync[(label(stacks[-1 - n])[0], e["name"])]
        entry[0] += e.get("dur", 0)
        entry[1] += 1
    windows = phases(events)
    return dict(busy_us=sum(b - a for a, b in merged), idle_us=idle, gaps=len(late), gap_us=gap_us,
                by_launch=dict(by_launch), syncs=dict(by_sync), phases=busy_within(merged, windows),
                kernels=kernels_within(device, launches, windows),
                phase_gaps=gaps_within(late, labels, windows))


def gaps_within(late: dict, labels: dict, windows: list[tuple[float, float, str]]) -> dict:
    """{phase frame: {(frame, op): [us, gaps]}}: each gap of `late` whose late launch happened in a window of
    `windows`, charged to that phase and to the launching code (its label in `labels`, as ``by_launch``'s)."""
    starts = [w[0] for w in windows]
    out: dict = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for n, (us, launch) in late.items():
        frame = _window_of(starts, windows, launch["ts"]) if launch is not None else None
        if frame is not None:
            entry = out[frame][labels[n]]
            entry[0] += us
            entry[1] += 1
    return {frame: dict(charged) for frame, charged in out.items()}


def _window_of(starts: list[float], windows: list[tuple[float, float, str]], t: float) -> str | None:
    """The frame of the window of `windows` (sorted, disjoint; `starts` their starts) that holds time `t`, or None."""
    i = bisect.bisect_right(starts, t) - 1
    return windows[i][2] if i >= 0 and t < windows[i][1] else None


def report(result: dict, top: int = 15) -> str:
    """`analyse`'s result as lines of text, the costliest first."""
    head = (f"device busy {result['busy_us'] / 1e3:.1f} ms (the union of its kernels), idle "
            f"{result['idle_us'] / 1e3:.1f} ms in {result['gaps']} gaps over {result['gap_us']:g} us; by the code that "
            f"launched the kernel after the gap:")
    lines = ["phases (the main thread's outermost calls of this repository's code): wall, device busy"]
    lines += [f"  {wall / 1e3:9.1f} ms  {busy / 1e3:9.1f} ms ({100 * busy / max(wall, 1e-9):3.0f}%)  {frame}"
              for frame, (wall, busy) in sorted(result["phases"].items(), key=lambda kv: -kv[1][0])[:top]]
    for frame, (wall, _) in sorted(result["phases"].items(), key=lambda kv: -kv[1][0])[:KERNEL_PHASES]:
        names = result.get("kernels", {}).get(frame, {})
        total = sum(us for us, _ in names.values())
        lines.append(f"kernels launched in {frame}: {total / 1e3:.1f} ms in {sum(n for _, n in names.values())} calls")
        lines += [f"  {us / 1e3:9.2f} ms {100 * us / max(total, 1e-9):3.0f}% {n:7d} x {name[:90]}"
                  for name, (us, n) in sorted(names.items(), key=lambda kv: -kv[1][0])[:top]]
        waits = result.get("phase_gaps", {}).get(frame, {})
        lines.append(f"the device waited in {frame}: {sum(us for us, _ in waits.values()) / 1e3:.1f} ms in "
                     f"{sum(n for _, n in waits.values())} gaps, by the code that launched the kernel after the gap:")
        lines += [f"  {us / 1e3:9.2f} ms in {n:5d} gaps  {where}  [{op}]"
                  for (where, op), (us, n) in sorted(waits.items(), key=lambda kv: -kv[1][0])[:top // 2]]
    lines.append(head)
    for (frame, op), (us, n) in sorted(result["by_launch"].items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {us / 1e3:8.2f} ms in {n:5d} gaps  {frame}  [{op}]")
    lines.append("host syncs (the host waits for the device, which then waits for the host):")
    for (frame, call), (us, n) in sorted(result["syncs"].items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {n:5d} x {call:<22} {us / 1e3:8.2f} ms  {frame}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="a Chrome trace from torch.profiler (.json or .json.gz)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--gap-us", type=float, default=GAP_US)
    args = ap.parse_args()
    print(report(analyse(load(args.trace), args.gap_us), args.top))


if __name__ == "__main__":
    main()
