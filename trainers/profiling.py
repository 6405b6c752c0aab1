"""One RL step under `torch.profiler` (``trainer.profile_step``), written as a Chrome trace that Perfetto
(ui.perfetto.dev) or ``python benchmarks/trace_gaps.py`` reads: where the step's time goes, kernel by kernel, and
where the GPU waited for the host.

    with StepProfile(cfg.trainer.profile_step, Path(cfg.output_dir), rank, say) as profile:
        for step in steps:
            profile.at(step)  # at the top of every step: starts the chosen one, ends it when the next begins
            ...

The profiled step runs slower than the others (Python stacks are recorded): its metrics row says
``perf/profiled: 1``, and benchmarks leave it out. Each process writes its own trace,
``profile/step_<N>_rank<R>.json.gz`` in the run's folder.
"""

from __future__ import annotations

import gzip
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Self

import torch


class StepProfile:
    """Profiles step `step` (0: none) of the loop it wraps; see the module's docstring."""

    def __init__(self, step: int, out_dir: Path, rank: int = 0, say: Callable[[str], None] = print):
        self.step, self.out_dir, self.rank, self.say = step, out_dir, rank, say
        self._profiler = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            self._stop()  # the loop ended in the profiled step (the last one, a stop, an error)
        except Exception as e:
            if exc_type is None:
                raise
            self.say(f"step {self.step}: its profile was not written ({e}): the step failed first")

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def at(self, step: int) -> None:
        """The loop is at the top of `step`: the profiled step, if it was the one before, ends here."""
        self._stop()
        if step == self.step:
            from torch.profiler import ProfilerActivity, profile

            cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            self._profiler = profile(activities=[ProfilerActivity.CPU, *cuda], with_stack=True)
            self._profiler.__enter__()

    def _stop(self) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the step's last kernels belong in its trace
        profiler.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"step_{self.step}_rank{self.rank}.json"
        profiler.export_chrome_trace(str(trace))
        with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as z:
            shutil.copyfileobj(f, z)
        trace.unlink()
        self.say(f"step {self.step}: profile written to {trace}.gz (Perfetto, or python benchmarks/trace_gaps.py)")
