"""HFBackend: the embedded engine (`agents.engine`) behind the asyncio `Backend` interface, in this process, on the
trainer's own module (no copy: an optimizer step is visible to the next generation).

A worker thread owns the engine. `submit` checks a request and queues it; the worker takes what is queued, gathers
requests that trickle in (so that a burst shares one prefill pass), runs engine steps, and settles the callers'
futures from the event loop's thread, all of one step's in one callback. Requests that arrive while rows decode
join at the next step. See docs/engine.md for the design and docs/processes.md for the threads.

    >>> import asyncio, torch, transformers
    >>> from agents.hf_backend import HFBackend
    >>> from agents.backend import SamplingParams
    >>> config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
    ...                                   num_key_value_heads=1, intermediate_size=64)
    >>> async def main():
    ...     async with HFBackend(transformers.Qwen2ForCausalLM(config), seed=0) as backend:
    ...         return await backend.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
    >>> len(asyncio.run(main()).ids)
    4
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mt_env.turn import ModelTurn

from .engine import Engine, EngineConfig, UnsupportedModel, decoder_layout, new_stats
from .engine import Sequence as EngineSequence
from .engine.layout import module_device
from .engine.scheduler import one_prefill_pass_takes
from .engine.transformers_runner import TransformersEngine
from .backend import Backend, BackendError, GenerationError, SamplingParams, check_prompt_ids

_STOP = object()  # queued by close(): the worker aborts what is left and exits
#: longest gathering of requests that keep arriving (each within `gather_window_s` of the last), in windows
GATHER_CAP_WINDOWS = 25
#: the interpreter's thread switch interval while a worker serves (see `_SwitchInterval`)
SERVING_SWITCH_INTERVAL_S = 0.0005


class _SwitchInterval:
    """Lowers the interpreter's thread switch interval while any HFBackend worker serves, so that the worker, which
    releases the GIL at every device wait, gets it back quickly while the caller's event loop is busy (with the
    default 5 ms a short decode step would stretch to several times its length). Process-wide and counted: the
    previous value comes back when the last serving worker goes idle."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holders = 0
        self._saved = 0.0

    def hold(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, SERVING_SWITCH_INTERVAL_S))
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                sys.setswitchinterval(self._saved)


_SWITCH_INTERVAL = _SwitchInterval()

#: how a future settles: (the future, its result, or the exception it raises)
Settlement = tuple[asyncio.Future, Any, BaseException | None]


def _resolve(loop: asyncio.AbstractEventLoop, settlements: list[Settlement]) -> None:
    """Settle futures of `loop` from the worker thread, all in one callback (those cancelled meanwhile are left
    alone): the requests that end at one step wake their callers in one pass of the loop."""

    def set_outcomes() -> None:
        for future, result, error in settlements:
            if future.done():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

    try:
        loop.call_soon_threadsafe(set_outcomes)
    except RuntimeError:  # the caller's event loop is closed: nobody waits for these results any more
        pass


class _RequestFuture(asyncio.Future):
    """A request's future; cancelling it (or the task awaiting it) withdraws its sequence from the engine."""

    __slots__ = ("sequence",)

    def __init__(self, loop: asyncio.AbstractEventLoop, sequence: EngineSequence):
        super().__init__(loop=loop)
        self.sequence = sequence

    def cancel(self, msg: Any = None) -> bool:
        if not super().cancel(msg):
            return False
        self.sequence.withdrawn = True
        return True


@dataclass(eq=False)
class _Caller:
    """Who waits for a sequence: its future, the future's loop, and when it was submitted."""

    future: _RequestFuture
    loop: asyncio.AbstractEventLoop
    submitted: float


@dataclass(eq=False)
class _Call:
    """A function for the worker thread to run between two steps (it owns the engine); resolves `future`."""

    fn: Callable[[], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def run(self) -> None:
        try:
            result, error = self.fn(), None
        except Exception as e:
            result, error = None, e
        _resolve(self.loop, [(self.future, result, error)])


class HFBackend(Backend):
    """Generate with a Hugging Face causal LM (any ``AutoModelForCausalLM``-style module) in this process.

    Args:
        model: the module to run; shared, not copied. Device and dtype follow it (also if it is moved later).
        max_batch_size: most sequences decoded together; further requests wait.
        gather_window_s: gather requests until none arrived for this long before their prefill (when idle, and
            while fewer rows decode than wait).
        max_context_len: prompt + generation limit; default ``config.max_position_embeddings``. Generation that
            reaches it ends with ``"length"``; longer prompts are rejected.
        seed: seeds the generators of requests that come without `SamplingParams.seed`.
        pad_token_id: the id in padding positions of the transformers path (masked out; any valid id works).
        vocab_limit: sample only ids below this (the tokenizer's size when the embedding is padded beyond it). The
            trainer must use the same limit (`trainers.modeling.PolicyModel` does).
        fast_path: ``"auto"``: the paged engine (`agents.engine.Engine`) when the module is supported; True: the
            engine, or ValueError; False: the transformers path (`TransformersEngine`). `fast_path_reason` says
            which was taken and why.
        block_size, kv_blocks, kv_cache_gib, prefix_cache, attention, cuda_graphs, compile, overlap_steps, exact:
            the engine's `EngineConfig` (`exact` takes the paged engine on any device, or raises ValueError).
    """

    def __init__(self, model: nn.Module, *, max_batch_size: int = 64, gather_window_s: float = 0.002,
                 max_context_len: int | None = None, seed: int | None = None, pad_token_id: int = 0,
                 vocab_limit: int | None = None, fast_path: bool | str = "auto", **engine_options: Any):
        if not isinstance(model, nn.Module):
            raise TypeError(f"HFBackend needs a torch nn.Module (a transformers causal LM), got {type(model).__name__}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if gather_window_s < 0:
            raise ValueError(f"gather_window_s must be >= 0, got {gather_window_s}")
        self.model, self.max_batch_size, self.gather_window_s = model, max_batch_size, gather_window_s
        self.vocab_size = _vocab_size(model)
        if vocab_limit is not None:
            if not 0 < vocab_limit <= self.vocab_size:
                raise ValueError(f"vocab_limit {vocab_limit} must be in (0, {self.vocab_size}]")
            self.vocab_size = vocab_limit
        if not 0 <= pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id {pad_token_id} is outside the vocabulary [0, {self.vocab_size})")
        self.stats = new_stats()  #: the engine's counters and the worker's seconds (`agents.engine.new_stats`)
        self._engine, self.fast_path_reason = self._make_engine(fast_path, max_context_len, seed, pad_token_id,
                                                                engine_options)
        self.fast_path = isinstance(self._engine, Engine)
        self.max_context_len = self._engine.max_context_len

        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._submit_lock = threading.Lock()  # orders submissions against close() and the worker's death
        self._model_lock = threading.Lock()  # held during each engine step; update_weights waits for it
        self._closed = False
        self._dead: BaseException | None = None
        self._serving_since: float | None = None  # busy_s counted up to here while serving (None: idle)
        self._restore_training = False
        self._thread = threading.Thread(target=self._work, name="HFBackend-worker", daemon=True)
        self._thread.start()

    def _make_engine(self, fast_path: bool | str, max_context_len: int | None, seed: int | None, pad_token_id: int,
                     options: dict) -> tuple[Engine | TransformersEngine, str]:
        """The engine (or the transformers fallback) and why it was taken."""
        if fast_path not in (True, False, "auto"):
            raise ValueError(f"fast_path must be True, False or 'auto', got {fast_path!r}")
        config = EngineConfig(max_seqs=self.max_batch_size, max_context_len=max_context_len, **options)
        if config.exact and fast_path is False:
            raise ValueError("exact=True needs the paged engine: fast_path=False cannot go with it")
        reason = "off: fast_path=False"
        if fast_path is not False:
            try:
                decoder_layout(self.model)
            except UnsupportedModel as e:
                if fast_path is True or config.exact:
                    raise ValueError(f"{'exact' if config.exact else 'fast_path'}=True, but the module cannot take "
                                     f"it: {e}") from None
                reason = f"off: {e}"
            else:
                if fast_path is True or config.exact or module_device(self.model).type == "cuda":
                    engine = Engine(self.model, config, vocab_size=self.vocab_size, seed=seed, stats=self.stats)
                    return engine, _describe(engine)
                reason = (f"off: the module is on {module_device(self.model).type} (fast_path='auto' takes it on CUDA "
                          "only)")
        positions = getattr(getattr(self.model, "config", None), "max_position_embeddings", None) or 2**31 - 1
        return TransformersEngine(self.model, max_seqs=self.max_batch_size, max_context_len=max_context_len or positions,
                                  vocab_size=self.vocab_size, pad_token_id=pad_token_id, seed=seed,
                                  stats=self.stats), reason

    # ----------------------------------------------------------------------------------------- public API
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> ModelTurn:
        return await self.submit(prompt_ids, params)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> asyncio.Future[ModelTurn]:
        """`Backend.submit`: the request is checked and queued for the worker now (a bad one's error is the
        future's); cancelling the future drops its row at the worker's next step. Every generation starts here."""
        loop = asyncio.get_running_loop()
        try:
            seq = self._sequence(prompt_ids, params or SamplingParams(), loop)
            self._submit(seq)
        except Exception as e:
            failed = loop.create_future()
            failed.set_exception(e)
            return failed
        return seq.caller.future

    def _sequence(self, prompt_ids: Sequence[int], params: SamplingParams,
                  loop: asyncio.AbstractEventLoop) -> EngineSequence:
        """The engine's sequence for a request, or ValueError saying what is wrong with it."""
        prompt = check_prompt_ids(prompt_ids, self.vocab_size)
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop token id(s) {bad_stop[:5]} outside the vocabulary [0, {self.vocab_size})")
        room = self.max_context_len - len(prompt)
        if room < 1:
            raise ValueError(f"the prompt is {len(prompt)} tokens: no room left in the context of "
                             f"{self.max_context_len} tokens")
        seq = EngineSequence(prompt, params, min(params.max_new_tokens, room))
        seq.caller = _Caller(_RequestFuture(loop, seq), loop, time.perf_counter())
        return seq

    async def close(self) -> None:
        """Stop the worker: requests in flight end with ``"abort"`` and their partial output."""
        with self._submit_lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
        await asyncio.to_thread(self._thread.join)

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
                             | None = None, *, model_path: str | None = None, **kwargs: Any) -> None:
        """Copy tensors into the module's parameters/buffers of the same names, between two engine steps. Rarely
        needed: the backend runs the trainer's module. The copies are in place (CUDA graphs see them), and the
        engine drops its cached prefixes before the next prefill (the weights' version counters moved)."""
        if model_path is not None or kwargs:
            raise NotImplementedError("HFBackend updates weights from tensors only (named_tensors=...); it shares "
                                      "its module with the trainer, which usually makes updates unnecessary")
        if named_tensors is None:
            raise ValueError("update_weights needs named_tensors: {name: tensor} or (name, tensor) pairs")
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        await asyncio.to_thread(self._copy_weights, items)

    async def flush_cache(self) -> None:
        """Forget the engine's cached prefixes (new weights are noticed without this; see `update_weights`)."""
        await self._in_worker(self._engine.flush)

    async def release_memory(self) -> None:
        """Free the engine's KV cache and CUDA graphs (the weights are the trainer's and stay). Refused while
        requests are in flight; the next generation (or `resume_memory`) allocates them again."""
        await self._in_worker(self._release)

    async def resume_memory(self) -> None:
        """Allocate the engine's KV cache now rather than at the next generation."""
        await self._in_worker(self._allocate)

    @property
    def compile_reason(self) -> str:
        """Whether the engine's passes run compiled and captured, and why not where they do not."""
        if not self.fast_path:
            return "off: the transformers path"
        graphs = self._engine.runner.graphs
        failure = f"; CUDA graphs off: {graphs.failure}" if graphs is not None and graphs.failure else ""
        return self._engine.runner.compile_reason + failure

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the engine's KV pool holds now (0 when released, not yet allocated, or on the transformers path)."""
        runner = self._engine.runner if self.fast_path else None
        return runner.cache_bytes() if runner is not None and runner.allocated else 0

    def __repr__(self) -> str:
        return (f"HFBackend({type(self.model).__name__}, max_batch_size={self.max_batch_size}, "
                f"vocab_size={self.vocab_size}, fast_path={self.fast_path}, closed={self._closed})")

    # ----------------------------------------------------------------------------------------- the caller's side
    def _submit(self, item: EngineSequence | _Call) -> None:
        with self._submit_lock:
            if self._closed:
                raise BackendError("this HFBackend is closed")
            if self._dead is not None:
                raise BackendError(f"HFBackend's worker thread died: {self._dead!r}") from self._dead
            self._queue.put(item)

    async def _in_worker(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the worker thread between two steps and return its result."""
        loop = asyncio.get_running_loop()
        call = _Call(fn, loop.create_future(), loop)
        self._submit(call)
        return await call.future

    def _release(self) -> None:
        if self._engine.busy():
            raise BackendError(f"cannot release memory while {self._engine.running()} request(s) are in flight")
        self._engine.release()

    def _allocate(self) -> None:
        if self.fast_path:
            with self._pass():
                self._engine.runner.allocate()

    def _copy_weights(self, items: list[tuple[str, torch.Tensor]]) -> None:
        state = self.model.state_dict(keep_vars=True)
        unknown = [name for name, _ in items if name not in state]
        if unknown:
            raise ValueError(f"unknown parameter name(s) {unknown[:5]}; the module has e.g. {list(state)[:5]}")
        wrong = [(n, tuple(t.shape), tuple(state[n].shape)) for n, t in items if t.shape != state[n].shape]
        if wrong:
            raise ValueError(f"shape mismatch (name, given, expected): {wrong[:5]}")
        with self._model_lock, torch.no_grad():
            for name, tensor in items:
                state[name].copy_(tensor)

    # ----------------------------------------------------------------------------------------- worker thread
    def _work(self) -> None:
        try:
            with torch.no_grad():
                while self._serve_once():
                    pass
        except BaseException as e:  # a bug in the scheduler itself: fail everyone rather than hang them
            with self._submit_lock:
                self._dead = e
            error = BackendError(f"HFBackend's worker thread died: {type(e).__name__}: {e}")
            error.__cause__ = e
            everyone = self._engine.abort() + self._queued()
            for seq in everyone:
                seq.outcome = error
            self._settle(everyone)
        finally:
            self._serving(False)
            with contextlib.suppress(Exception):  # the KV cache and pinned host buffers go with the worker
                if self.fast_path:
                    self._engine.runner.release()

    def _serve_once(self) -> bool:
        """One scheduling step: take requests, then one engine step. False = stop."""
        if self._take_requests():
            self._settle(self._engine.abort() + self._queued())
            return False
        with self._pass():
            finished = self._engine.step()
        self._serving(True)  # busy_s up to date before the callers see their results
        self._settle(finished)
        return True

    def _take_requests(self) -> bool:
        """Give queued requests to the engine (running queued calls), blocking while there is nothing to do, and
        gather more when `_gathers` says so. True when close() asks to stop."""
        waiting = len(self._engine.waiting)
        if not self._engine.busy():
            self._serving(False)
            item = self._queue.get()
            self._serving(True)
            if self._accept(item):
                return True
        if self._drain():
            return True
        if not self._gathers(arrived=len(self._engine.waiting) - waiting):
            return False
        start = time.perf_counter()
        try:
            return self._gather()
        finally:
            self.stats["gather_s"] += time.perf_counter() - start

    def _gathers(self, arrived: int) -> bool:
        """Whether to gather requests that trickle in before the next pass: some just `arrived` and the waiting are
        at least as many as the rows decoding (always when idle), and more would fit; the transformers path
        gathers only when idle."""
        if not arrived:
            return False
        running, waiting = self._engine.running(), len(self._engine.waiting)
        if not self.fast_path:
            return not running
        return running <= waiting < self._engine.room()

    def _gather(self) -> bool:
        """Take more requests until none arrived for `gather_window_s`, all rows are taken, `GATHER_CAP_WINDOWS`
        windows passed, or the waiting fill one prefill pass (a full pass goes at once: the rest of a burst arrives
        while it runs). The window is a real wait on the queue: time spent waiting for the GIL never counts."""
        deadline = time.perf_counter() + self.gather_window_s * GATHER_CAP_WINDOWS
        room = self._engine.room()
        full = self._fills_a_pass()
        while len(self._engine.waiting) < room and not full():
            if self._drain():
                return True
            timeout = min(self.gather_window_s, deadline - time.perf_counter())
            if len(self._engine.waiting) >= room or timeout <= 0 or full():
                return False
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                return False
            if self._accept(item):
                return True
        return False

    def _fills_a_pass(self) -> Callable[[], bool]:
        """Whether the waiting fill the next prefill pass (paged engine only), looking only at the arrivals since
        the last call (the waiting only grow while gathering)."""
        if not self.fast_path:
            return lambda: False
        seen, longest = 0, 0
        waiting = self._engine.waiting

        def full() -> bool:
            nonlocal seen, longest
            longest = max([longest] + [waiting[i].length for i in range(seen, len(waiting))])
            seen = len(waiting)
            return not one_prefill_pass_takes(seen + 1, longest, self.max_context_len)
        return full

    def _drain(self) -> bool:
        """Take everything queued now, without waiting. True when close() asks to stop."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return False
            if self._accept(item):
                return True

    def _accept(self, item: Any) -> bool:
        """One queued item: close()'s stop (True), a call to run now (nothing in flight), or a request."""
        if item is _STOP:
            return True
        if isinstance(item, _Call):
            with self._pass():
                self._engine.sync()
            item.run()
        else:
            self._engine.add(item)
        return False

    def _queued(self) -> list[EngineSequence]:
        """Requests still queued (calls fail: the worker is going away), ended as ``"abort"``."""
        requests = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return requests
            if isinstance(item, _Call):
                _resolve(item.loop, [(item.future, None, BackendError("this HFBackend is closed"))])
            elif item is not _STOP:
                item.outcome = item.outcome or "abort"
                requests.append(item)

    def _serving(self, on: bool) -> None:
        """The worker serves (it took work while idle; called after each step to bring busy_s up to date) or goes
        idle: the switch interval is held while it serves."""
        now = time.perf_counter()
        if self._serving_since is not None:
            self.stats["busy_s"] += now - self._serving_since
        if on != (self._serving_since is not None):
            (_SWITCH_INTERVAL.hold if on else _SWITCH_INTERVAL.release)()
        self._serving_since = now if on else None

    @contextlib.contextmanager
    def _pass(self):
        """Around each engine step: the model lock (update_weights waits for it) and eval mode."""
        with self._model_lock:
            if self.model.training:
                self._restore_training = True
                self.model.eval()
            yield

    def _settle(self, finished: list[EngineSequence]) -> None:
        """Resolve finished sequences' futures, those of one event loop together; restore the module's train mode
        first if nothing else runs."""
        if not self._engine.busy() and self._restore_training:
            self.model.train()
            self._restore_training = False
        by_loop: dict[asyncio.AbstractEventLoop, list[Settlement]] = {}
        now = time.perf_counter()
        for seq in finished:
            caller = seq.caller
            if isinstance(seq.outcome, BaseException):
                settlement = (caller.future, None, seq.outcome)
            else:
                started = seq.started if seq.started is not None else now
                meta = {"backend": "hf", "prompt_tokens": len(seq.prompt), "completion_tokens": len(seq.ids),
                        "cached_tokens": seq.cached, "queue_s": started - caller.submitted,
                        "generate_s": now - started}
                settlement = (caller.future, ModelTurn(list(seq.ids), list(seq.logprobs), seq.outcome, meta), None)
            by_loop.setdefault(caller.loop, []).append(settlement)
        for loop, settlements in by_loop.items():
            _resolve(loop, settlements)


def _describe(engine: Engine) -> str:
    c = engine.config
    return (f"on: paged KV ({engine.pool.num_blocks} blocks of {c.block_size} tokens, prefix cache "
            f"{'on' if c.prefix_cache else 'off'}), {engine.runner.kernel} decode attention, passes "
            f"{'compiled' if engine.runner.compiles else 'eager'}{' in CUDA graphs' if engine.runner.graphs else ''}")


def _vocab_size(model: nn.Module) -> int:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and hasattr(embeddings, "num_embeddings"):
        return int(embeddings.num_embeddings)
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if size is None:
        raise TypeError(f"cannot tell the vocabulary size of {type(model).__name__}")
    return int(size)


__all__ = ["HFBackend", "GenerationError", "new_stats"]
