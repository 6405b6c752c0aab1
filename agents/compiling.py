"""Inductor compilation of the fast path's decode-step functions (`agents.engine`), with an eager fallback;
the trainer compiles its per-token logprob and entropy function the same way (`agents.logprobs`).

`torch.compile` with Inductor fuses each layer's many small kernels into a few. What it relies on:

* **Default mode**: Inductor emits kernels and no CUDA graphs of its own, so the engine captures the compiled
  step in its own graphs (per batch and length bucket).
* **One compilation for every layer and bucket**: the functions take the layer module as an argument (so all
  layers share one compiled graph) and are compiled with dynamic shapes; dynamo still specializes a few sizes.
* **Process-wide**: dynamo caches compiled code per function, so every engine reuses it. `COMPILE_COUNTS` counts
  compilations and their seconds; engines report the difference over their own calls.
* **Eager fallback**: a function whose compilation fails (no C++ compiler, no Triton, an unsupported op) runs
  eagerly from then on; `Compiled.failure` says why, and Inductor's log records on the compiling thread are
  dropped (`_QUIET`).
* ``emulate_precision_casts``: bf16 intermediates are rounded where eager rounds them.
* **A prompt exit**: from the first compilation on, `stop_compile_workers` runs at exit before Inductor's own hook:
  it gives the worker pool `COMPILE_WORKERS_STOP_S` to stop, then kills its sidecar.

Why, and the details of each point: docs/engine.md ("Inductor compilation").
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

#: compilations (dynamo frames compiled by Inductor) and the seconds Inductor spent on them, in this process; and the
#: seconds of the calls that compiled (dynamo's tracing and the first run included: what a first step waits for)
COMPILE_COUNTS: dict[str, float] = {"compilations": 0, "compile_s": 0.0, "compiling_calls_s": 0.0}
#: room for every (model architecture x dtype x one-row x full-length) variant of a function; dynamo's default (8)
#: would silently send later variants to eager
RECOMPILE_LIMIT = 64
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}
#: one line per long phase of a first step (compilations, CUDA graph captures): the trainer prints them
progress = logging.getLogger("agents.progress")
_CALLING = threading.local()  # the name of the function a `Compiled` is calling on this thread
#: how long the end of a process waits for Inductor's compile workers to stop before their sidecar is killed
COMPILE_WORKERS_STOP_S = 5.0
#: Inductor's cache (compiled graphs, kernels) when ``TORCHINDUCTOR_CACHE_DIR`` is not set: a folder that outlives
#: a reboot, where Inductor's default is under /tmp (as vLLM keeps its compile cache under ~/.cache)
CACHE_DIR = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mt_env", "inductor")


def _use_persistent_cache() -> None:
    """`CACHE_DIR` as Inductor's cache unless ``TORCHINDUCTOR_CACHE_DIR`` is set or the folder could not be made
    (an unwritable home keeps torch's default). Run on import: torch fixes its default when torch._dynamo is first
    imported (a process that imported it before keeps torch's choice)."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    parent = CACHE_DIR
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if os.path.isdir(parent) and os.access(parent, os.W_OK):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = CACHE_DIR


_use_persistent_cache()


def _inductor(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """Inductor, counting its successful compilations (dynamo's restarted attempts raise and are not counted) and
    announcing each (`progress`)."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor import config

    name = getattr(_CALLING, "name", "a function")
    progress.info("compiling %s with Inductor", name)
    stop_compile_workers_at_exit()
    start = time.perf_counter()
    options = {k: v for k, v in INDUCTOR_OPTIONS.items() if hasattr(config, k)}
    compiled = compile_fx(graph, example_inputs, config_patches=options)
    COMPILE_COUNTS["compilations"] += 1
    COMPILE_COUNTS["compile_s"] += time.perf_counter() - start
    progress.info("compiled %s in %.1f s", name, time.perf_counter() - start)
    return compiled


class _QuietThread(logging.Filter):
    """Drops the records of ``torch._inductor`` loggers made on a thread inside `quiet` (a filter on the handlers
    they reach: a filter on a logger would only see the records made by that very logger)."""

    def __init__(self):
        super().__init__()
        self._local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not (getattr(self._local, "active", False) and record.name.startswith("torch._inductor"))

    @contextlib.contextmanager
    def quiet(self):
        logger = logging.getLogger("torch._inductor")
        while logger is not None:  # the handlers a torch._inductor record reaches (torch sets them up lazily)
            for handler in logger.handlers:
                handler.addFilter(self)  # once per handler
            logger = logger.parent if logger.propagate else None
        self._local.active = True
        try:
            yield
        finally:
            self._local.active = False


_QUIET = _QuietThread()


class Compiled:
    """`fn` compiled with Inductor (dynamic shapes), or `fn` itself once its compilation failed."""

    def __init__(self, fn: Callable):
        self.eager = fn
        self.failure: str | None = None
        self._compiled = torch.compile(fn, backend=_inductor, dynamic=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failure is None:
            _CALLING.name = self.eager.__name__
            before, start = COMPILE_COUNTS["compilations"], time.perf_counter()
            try:
                with _dynamo_settings(), _QUIET.quiet():
                    return self._compiled(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:  # compilation failed: the call did not run
                self.failure = f"{self.eager.__name__}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
            finally:
                if COMPILE_COUNTS["compilations"] != before:
                    COMPILE_COUNTS["compiling_calls_s"] += time.perf_counter() - start
        return self.eager(*args, **kwargs)


_COMPILED: dict[Callable, Compiled] = {}


def compiled(fn: Callable) -> Compiled:
    """The process's one `Compiled` of `fn` (created on first use)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = Compiled(fn)
    return _COMPILED[fn]


def _dynamo_settings():
    """Dynamo's settings for one call: the recompile limit raised to `RECOMPILE_LIMIT`, and Python floats specialised
    (a float a layer carries, such as attention's ``scaling``, is otherwise traced as a symbolic float that dynamo
    then fails to turn into a tensor, throws the attempt away and traces again with it specialised: every compiled
    function paid its first tracing twice). The patch object is made once: making one is slow enough that every
    eager step of every layer would feel it."""
    global _SETTINGS
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, limit) >= RECOMPILE_LIMIT and getattr(config, "specialize_float", True):
        return contextlib.nullcontext()
    if _SETTINGS is None:
        floats = {"specialize_float": True} if hasattr(config, "specialize_float") else {}
        _SETTINGS = config.patch(**{limit: max(RECOMPILE_LIMIT, getattr(config, limit))}, **floats)
    return _SETTINGS


_SETTINGS: Any = None


def stop_compile_workers(timeout_s: float | None = None) -> None:
    """Stop Inductor's compile worker pools, if any were started, within about `timeout_s` seconds (default
    `COMPILE_WORKERS_STOP_S`): Inductor's shutdown (`shutdown_compile_workers`) is given `timeout_s`, then the sidecar
    process of a pool still running is killed (its workers exit when their parent does). Inductor starts a pool again
    if it compiles later.

    Why: Inductor's own exit hook waits up to 300 s for each sidecar to exit: one still starting when the process
    ends (a pool warmed by a late first compilation) holds the exit until it has started, one that never answers
    holds it the whole 300 s."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is None:
        return  # Inductor never loaded: no pool
    timeout_s = COMPILE_WORKERS_STOP_S if timeout_s is None else timeout_s
    stopper = threading.Thread(target=async_compile.shutdown_compile_workers, name="stop-compile-workers",
                               daemon=True)
    stopper.start()
    stopper.join(timeout_s)
    if stopper.is_alive():
        for pool in list(getattr(async_compile, "_pool_set", ())):
            sidecar = getattr(pool, "process", None)  # a SubprocPool's (Inductor's default worker start method)
            if sidecar is not None and sidecar.poll() is None:
                sidecar.kill()
        stopper.join(timeout_s)


def stop_compile_workers_at_exit() -> None:
    """Run `stop_compile_workers` at this process's exit, before Inductor's own exit hook (registered once, after
    Inductor's: exit hooks run last registered first)."""
    global _STOP_AT_EXIT
    if not _STOP_AT_EXIT:
        import torch._inductor.async_compile  # noqa: F401  (registers Inductor's hook first)

        atexit.register(stop_compile_workers)
        _STOP_AT_EXIT = True


_STOP_AT_EXIT = False
