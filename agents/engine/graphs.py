"""CUDA graphs of the engine's passes: decode steps by (batch bucket, length bucket, sampling mode), small prefill
passes by their padded shape; captured on use, replayed after.

A key is captured on its `CAPTURE_ON_USE`-th use (a capture costs a synchronisation, warm-up passes and the
recording while every row waits: worth it for a shape that recurs, not for one a stray row passes through once).
Before that, a decode step runs the graph of a larger captured bucket in its place when one exists (`stand_in`:
free slots are padding rows, a longer length is masked) until its `CAPTURE_WITH_STAND_IN`-th use, else uncaptured.
All graphs share one memory pool (they never replay concurrently); their inputs and outputs are persistent
buffers, and optimizer steps update parameters in place, so graphs see new weights. A capture that fails stops
all capturing (`failure`): passes then run uncaptured.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from mt_env.collector import collector_paused

from ..compiling import progress

CAPTURE_ON_USE = 3
CAPTURE_WITH_STAND_IN = 64
WARMUP_STEPS = 2  # eager passes on the side stream before a capture (cuBLAS handles and workspaces get created)

DecodeKey = tuple[int, int, str]  # (batch bucket, length bucket, sampling mode)


def stand_in(key: DecodeKey, captured: Iterable[DecodeKey]) -> DecodeKey | None:
    """The captured key that can run a step of `key` in its place: the same sampling mode, at least as many rows
    (the extra slots are free: padding rows, which change no slot's state) and at least as long (the length mask
    hides what a row has not filled); the smallest such, or None."""
    rows, length, mode = key
    fits = [k for k in captured if k[2] == mode and k[0] >= rows and k[1] >= length]
    return min(fits, key=lambda k: (k[0], k[1]), default=None)


@dataclass(eq=False)
class PrefillGraph:
    """A captured prefill pass: the input buffers each replay fills first and the logits it computes."""

    graph: Any
    inputs: tuple[torch.Tensor, ...]
    logits: torch.Tensor


class CudaGraphs:
    """The captured graphs of one engine on one CUDA device, and when to capture. `stats` is the engine's counter
    dict (graph_captures, graph_replays, stand_in_replays, uncaptured_steps, prefill_graph_captures,
    prefill_graph_replays, capture_failures)."""

    def __init__(self, device: torch.device, stats: dict):
        self.device, self.stats = device, stats
        self.failure: str | None = None
        self.decode: dict[DecodeKey, Any] = {}
        self.prefill: dict[tuple, PrefillGraph] = {}
        self.uses: dict[tuple, int] = {}  #: kept when graphs are dropped: a key used before is captured again at once
        self._pool: Any = None
        self._side: Any = None

    @property
    def on(self) -> bool:
        return self.failure is None

    def drop(self) -> None:
        """Forget every graph (new parameter addresses, or the memory released)."""
        self.decode, self.prefill = {}, {}

    def run_decode(self, key: DecodeKey, run: Callable[[], None], warm_up: Callable[[], None]) -> None:
        """The step of `key` from its graph; before its capture from a stand-in's graph or `run` uncaptured."""
        graph = self.decode.get(key)
        if graph is None:
            uses = self.uses[key] = self.uses.get(key, 0) + 1
            larger = stand_in(key, self.decode)
            if larger is not None and uses < CAPTURE_WITH_STAND_IN:
                self.decode[larger].replay()
                self.stats["stand_in_replays"] += 1
                return
            if larger is None and uses < CAPTURE_ON_USE:
                self.stats["uncaptured_steps"] += 1
                run()
                return
            recorded = self._capture(lambda: self.on_side_stream(warm_up), run, f"decode {key}")
            if recorded is None:
                run()
                return
            graph = self.decode[key] = recorded[0]
            self.stats["graph_captures"] += 1
        graph.replay()
        self.stats["graph_replays"] += 1

    def run_prefill(self, key: tuple, inputs: tuple[torch.Tensor, ...],
                    run: Callable[..., torch.Tensor]) -> torch.Tensor:
        """`run(*inputs)` from the graph of `key` (captured on its `CAPTURE_ON_USE`-th use, uncaptured before). The
        logits returned live in the graphs' pool: read them before the next replay of any graph."""
        graph = self.prefill.get(key)
        if graph is None:
            uses = self.uses[key] = self.uses.get(key, 0) + 1
            if uses < CAPTURE_ON_USE:
                return run(*inputs)
            own = tuple(t.clone() for t in inputs)
            recorded = self._capture(lambda: self.on_side_stream(lambda: run(*own)), lambda: run(*own),
                                     f"prefill {key}")
            if recorded is None:
                return run(*inputs)
            graph = self.prefill[key] = PrefillGraph(recorded[0], own, recorded[1])
            self.stats["prefill_graph_captures"] += 1
        for buffer, value in zip(graph.inputs, inputs):
            buffer.copy_(value)
        graph.graph.replay()
        self.stats["prefill_graph_replays"] += 1
        return graph.logits

    def on_side_stream(self, run: Callable[[], Any]) -> None:
        """`run` `WARMUP_STEPS` times on the side stream graphs are captured on, after the work queued so far."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
            self._pool = torch.cuda.graph_pool_handle()
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self._side):
                for _ in range(WARMUP_STEPS):
                    run()
        finally:  # also after an error: later work on the current stream must not overtake the warm-up
            torch.cuda.current_stream(self.device).wait_stream(self._side)

    def _capture(self, warm_up: Callable[[], Any], run: Callable[[], Any], what: str) -> tuple[Any, Any] | None:
        """With nothing in flight: `warm_up` (its error is the pass's own: it propagates), then capture `run`; None
        when the capture fails (nothing is captured from then on). The garbage collector is paused during the
        capture: a collection could free pinned host memory, whose release records a CUDA event."""
        progress.info("capturing a CUDA graph: %s", what)
        torch.cuda.current_stream(self.device).synchronize()
        warm_up()
        graph = torch.cuda.CUDAGraph()
        try:
            with collector_paused(), torch.cuda.graph(graph, pool=self._pool, stream=self._side,
                                                      capture_error_mode="thread_local"):
                out = run()
        except Exception as e:
            self.failure = f"{type(e).__name__}: {str(e).strip()[:300]}"
            self.stats["capture_failures"] += 1
            return None
        return graph, out
