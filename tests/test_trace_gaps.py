"""benchmarks/trace_gaps.py: the device's idle gaps charged to the host code that launched the next kernel, and the
host stack found by one sweep equal to a brute-force containment search."""

import gzip
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import trace_gaps


def X(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 7, "args": args}


def synthetic_trace() -> list[dict]:
    """Two kernels back to back, a 40 us gap before a kernel launched from trainers/ppo.py inside aten::mm, a 5 us
    gap (launch latency, not counted), a 100 us gap after a host sync in agents/logprobs.py, then 135 us before a
    kernel launched outside any op."""
    return [
        X("python_function", "trainers/ppo.py(10): update", 0, 1000),
        X("python_function", "transformers/modeling_qwen2.py(5): forward", 10, 300),
        X("cpu_op", "aten::mm", 20, 50),
        X("cuda_runtime", "cudaLaunchKernel", 30, 5, correlation=1),
        X("cuda_runtime", "cudaLaunchKernel", 40, 5, correlation=2),
        X("python_function", "agents/logprobs.py(3): chunked", 400, 300),
        X("cuda_runtime", "cudaStreamSynchronize", 410, 150),
        X("cpu_op", "aten::add", 600, 30),
        X("cuda_driver", "cuLaunchKernel", 610, 5, correlation=3),
        X("cuda_runtime", "cudaLaunchKernel", 650, 5, correlation=4),
        X("kernel", "gemm", 100, 200, tid=9, correlation=1),
        X("kernel", "gemm", 340, 60, tid=9, correlation=2),   # 40 us after the first: a gap
        X("gpu_memset", "memset", 405, 10, tid=9, correlation=9),  # 5 us after: launch latency
        X("kernel", "add", 515, 10, tid=9, correlation=3),    # 100 us idle while the host synced
        X("kernel", "add", 660, 10, tid=9, correlation=4),    # launched between ops: no op, a frame
    ]


def test_gaps_are_charged_to_the_code_that_launched_the_next_kernel(tmp_path):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": synthetic_trace() + [{"ph": "M", "name": "process_name"}]}, f)
    result = trace_gaps.analyse(trace_gaps.load(path))
    assert result["gaps"] == 3 and result["idle_us"] == 40 + 100 + 135
    assert result["busy_us"] == 200 + 60 + 10 + 10 + 10
    assert result["by_launch"] == {("trainers/ppo.py(10): update", "aten::mm"): [40.0, 1],
                                   ("agents/logprobs.py(3): chunked", "aten::add"): [100.0, 1],
                                   ("agents/logprobs.py(3): chunked", "?"): [135.0, 1]}
    assert result["syncs"] == {("agents/logprobs.py(3): chunked", "cudaStreamSynchronize"): [150.0, 1]}
    assert result["phases"] == {"trainers/ppo.py(10): update": [1000.0, 290.0]}
    assert result["kernels"] == {"trainers/ppo.py(10): update": {"gemm": [260.0, 2], "add": [20.0, 2]}}
    assert result["phase_gaps"] == {"trainers/ppo.py(10): update": result["by_launch"]}  # every launch in the update
    text = trace_gaps.report(result)
    assert "aten::mm" in text and "cudaStreamSynchronize" in text and "2 x gemm" in text
    assert "the device waited in trainers/ppo.py(10): update: 0.3 ms in 3 gaps" in text


def test_a_gap_is_charged_to_the_phase_whose_launch_ended_it():
    events = [X("python_function", "agents/rollout.py(1): collect", 0, 100),
              X("python_function", "trainers/ppo.py(2): update", 200, 100),
              X("cuda_runtime", "cudaLaunchKernel", 90, 5, correlation=1),
              X("cuda_runtime", "cudaLaunchKernel", 250, 5, correlation=2),
              X("cuda_runtime", "cudaLaunchKernel", 150, 5, correlation=3),  # between the phases: in neither
              X("kernel", "a", 0, 10, tid=9, correlation=9),
              X("kernel", "b", 100, 10, tid=9, correlation=1),   # 90 us gap, launched in collect
              X("kernel", "c", 160, 10, tid=9, correlation=3),   # 50 us gap, launched in no phase
              X("kernel", "d", 260, 10, tid=9, correlation=2)]   # 90 us gap, launched in update
    assert trace_gaps.analyse(events)["phase_gaps"] == {
        "agents/rollout.py(1): collect": {("agents/rollout.py(1): collect", "?"): [90.0, 1]},
        "trainers/ppo.py(2): update": {("trainers/ppo.py(2): update", "?"): [90.0, 1]}}


def test_a_kernel_is_charged_to_the_phase_that_launched_it_not_the_one_it_ran_in():
    events = [X("python_function", "agents/rollout.py(1): collect", 0, 100),
              X("python_function", "trainers/ppo.py(2): update", 200, 100),
              X("cuda_runtime", "cudaLaunchKernel", 90, 5, correlation=1),
              X("kernel", "late", 250, 10, tid=9, correlation=1),  # launched in collect, ran during update
              X("kernel", "orphan", 210, 10, tid=9, correlation=2),  # no launch in the trace: where it began
              X("kernel", "between", 150, 10, tid=9, correlation=3)]  # in no phase
    assert trace_gaps.analyse(events)["kernels"] == {"agents/rollout.py(1): collect": {"late": [10.0, 1]},
                                                     "trainers/ppo.py(2): update": {"orphan": [10.0, 1]}}


def test_a_kernel_launched_by_autograds_backward_thread_is_charged_to_its_backward_node():
    events = [X("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 0, 100, tid=5),
              X("cpu_op", "aten::mm", 10, 50, tid=5),
              X("cuda_runtime", "cudaLaunchKernel", 20, 5, tid=5, correlation=2),
              X("kernel", "a", 0, 10, tid=9, correlation=1), X("kernel", "gemm", 60, 10, tid=9, correlation=2)]
    assert trace_gaps.analyse(events)["by_launch"] == {("backward of MmBackward0", "aten::mm"): [50.0, 1]}


def test_a_kernel_without_its_launch_in_the_trace_is_counted_and_said_so():
    events = [X("kernel", "a", 0, 10, tid=9, correlation=1), X("kernel", "b", 50, 10, tid=9, correlation=2)]
    result = trace_gaps.analyse(events)
    assert result["by_launch"] == {("? (no launch found)", "?"): [40.0, 1]}


@st.composite
def nested_events(draw, depth=0, start=0, stop=1000):
    """Properly nested intervals inside [start, stop): each level splits its span into children."""
    events, t = [], start
    while t < stop and depth < 4 and draw(st.booleans()):
        a = draw(st.integers(t, stop - 1))
        b = draw(st.integers(a, stop - 1))
        events.append(X("cpu_op", f"op{len(events)}@{depth}", a, b - a))
        events += draw(nested_events(depth + 1, a, b)) if b > a else []
        t = b + 1
    return events


@settings(max_examples=150, deadline=None)
@given(nested_events(), st.lists(st.integers(0, 1000), max_size=20))
def test_the_sweep_finds_every_event_running_at_each_time(events, times):
    found = trace_gaps.enclosing(events, [(t, n) for n, t in enumerate(times)])
    for n, t in enumerate(times):
        expected = [e for e in events if e["ts"] <= t <= e["ts"] + e["dur"]]
        assert sorted(map(id, found[n])) == sorted(map(id, expected))


def test_phases_are_the_main_threads_outermost_calls_of_ours_under_main():
    events = [
        X("python_function", "threading.py(1030): _bootstrap", 0, 5000, tid=2),  # a worker thread: not main
        X("python_function", "mt_env/isolation.py(193): _watch", 0, 5000, tid=2),
        X("python_function", "trainers/ppo.py(87): main", 0, 3000),
        X("python_function", "trainers/rollouts.py(5): play", 100, 900),
        X("python_function", "agents/engine/scheduler.py(9): next_pass", 200, 100),  # inside play: not a phase
        X("python_function", "trainers/ppo.py(392): update", 1000, 1000),
        X("python_function", "trainers/ppo.py(392): update", 2200, 500),
        X("kernel", "k", 150, 100, tid=9), X("kernel", "k", 900, 300, tid=9), X("kernel", "k", 2100, 200, tid=9),
    ]
    assert trace_gaps.phases(events) == [(100, 1000, "trainers/rollouts.py(5): play"),
                                         (1000, 2000, "trainers/ppo.py(392): update"),
                                         (2200, 2700, "trainers/ppo.py(392): update")]
    result = trace_gaps.analyse(events)
    assert result["phases"] == {"trainers/rollouts.py(5): play": [900.0, 200.0],
                                "trainers/ppo.py(392): update": [1500.0, 300.0]}
    assert "trainers/rollouts.py(5): play" in trace_gaps.report(result)


def test_a_caller_recorded_as_ending_before_its_callee_is_not_reported_after_its_end():
    caller, callee = X("python_function", "a.py(1): f", 0, 100), X("cpu_op", "aten::mm", 10, 490)
    assert trace_gaps.enclosing([caller, callee], [(50, 0), (300, 1)]) == {0: [caller, callee], 1: [callee]}


def test_a_callee_recorded_as_running_to_the_traces_end_does_not_hide_the_phases_after_its_caller():
    """torch.profiler records some pybind11 methods as never ending: their caller's phase still ends with it."""
    events = [
        X("python_function", "trainers/ppo.py(87): main", 0, 10_000),
        X("python_function", "trainers/ppo.py(337): score", 100, 400),
        X("python_function", "<built-in method redispatch_boxed of pybind11 object>", 200, 9_800),
        X("python_function", "trainers/ppo.py(395): update", 600, 1000),
        X("python_function", "trainers/ppo.py(538): save_checkpoint", 2000, 500),
    ]
    assert [frame for _, _, frame in trace_gaps.phases(events)] == [
        "trainers/ppo.py(337): score", "trainers/ppo.py(395): update", "trainers/ppo.py(538): save_checkpoint"]
