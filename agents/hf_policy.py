"""HFPolicy: a transformers causal LM in this process, serving many concurrent episodes with shared forward passes.

The policy runs the trainer's own `nn.Module` (no copy): an optimizer step is visible to the next generated token.

How requests are batched (iteration-level batching, as in Orca and vLLM):

* A background thread owns the forward passes. `generate` puts a request on a thread-safe queue and awaits a
  future, so the asyncio event loop never blocks on the model.
* When idle, the worker takes the first request and gathers more until none arrived for `gather_window_s` (at
  most 25 windows, or until `max_batch_size`; on the fast path, until they fill a prefill pass):
  requests that trickle in share one prefill.
* **Prefill** builds each new row's KV cache and samples its first token; **decode** steps then produce one token
  per row and step. Each row samples with its own `SamplingParams` and its own seeded ``random.Random``, whose
  uniform numbers drive inverse-CDF sampling on the device for the whole batch at once
  (`agents.fast_decode.sample_tokens`, shared by both paths below: the same seed gives the same tokens on both,
  whatever else is in the batch).
* A row that samples a stop token or reaches its limit is **resolved at once** and leaves the batch, so a finished
  episode never waits for the slowest row.
* **Requests that arrive while a batch runs join it at a step boundary** and share every forward pass from then
  on: at the next one (on the fast path, optionally after up to `admit_wait_steps` steps, so that arrivals a few
  steps apart share one prefill pass). On the fast path, arrivals at least as many as the decoding rows are
  gathered as by an idle worker (a batch whose turns ended together, while an early finisher decodes alone): the wait
  stalls the few decoding rows, where admitting each trickle as it comes would give it a prefill pass that
  stalls them all. The fast path's prefill passes are bounded (`fast_decode.PREFILL_TOKENS`), and between two of
  them the worker takes what arrived meanwhile, which joins the requests still waiting for a pass.
* Batch size is capped by `max_batch_size` rows in flight; more requests wait in the queue.

Two paths do the passes:

* **The fast path** (`agents.fast_decode`; default on CUDA for Llama/Qwen2/Qwen3-style decoders): a KV cache with
  one slot per row of `max_cache_len` tokens, rows joining and leaving by slot; decode steps compiled by Inductor
  (`agents.compiling`) and captured in CUDA graphs per batch and length bucket; the module's own submodules called
  by a layer loop of its own. A module it cannot serve (another architecture, sliding-window layers, a
  length-dependent RoPE, quantization, offloading) falls back to the transformers path, with the reason in
  `fast_path_reason`; a step that cannot be compiled or captured runs eagerly, with the reason in
  `compile_reason`.
* **Overlapped steps** (fast path, `overlap_steps`): each decode step is launched before the previous one's tokens
  are read, so the host's work between steps (reading tokens, stop checks, settling requests, compaction, drawing
  the next uniform numbers) runs while the device computes. A row that ends at step t (a stop token, a
  cancellation) was launched into step t+1 already: that row-step is computed and discarded
  (``stats["wasted_rows"]``) and its slot freed after. A row whose last allowed token is in flight asks for nothing
  more, and a step is launched only when some row asks (rows that all end by length waste nothing). The tokens,
  logprobs and finish reasons are those of one step at a time (a row draws its uniform numbers from its own
  generator, in the same order); requests that arrive meanwhile join one step later. Queued calls
  (`release_memory`, ...) run with no step in flight. While serving, the worker lowers the interpreter's switch
  interval (`_SwitchInterval`) and waits for the device without holding the GIL. On CPU the same code runs (a
  step is computed when it is launched: nothing overlaps).
* **The transformers path** (everywhere else, e.g. on CPU): the module's own forward over a ``DynamicCache``. The
  prompts are left-padded into one tensor with an attention mask and per-row position ids. Rows that join are
  prefilled together, then merged into the running batch by left-padding the shorter KV cache (padding is masked
  out). Merging needs plain full-attention cache layers (``DynamicLayer``); with other caches (sliding-window,
  quantized, ...) the new rows form a second batch that is stepped in turn — they still start at once, they just
  share fewer passes. When rows leave, cache columns that are padding for every remaining row are cut off.

Why not transformers' own batching:

* ``model.generate`` decodes one fixed batch until its slowest row ends, has one seed for the batch and returns
  scores after logits processors.
* The continuous-batching API (``init_continuous_batching`` / ``generate_batch``; present in 5.17 and 5.24) was
  evaluated: it switches the module's attention implementation to a paged one (the module the trainer also runs),
  pre-allocates a paged cache, has one seed per manager (no per-request generator), returns logprobs of the
  *processed* distribution (after top-k/top-p, not what a trainer recomputes), and its internals changed between
  5.17 and 5.24. A scheduler of our own avoids all of that and runs on CPU and GPU alike.

Forward passes run under ``torch.no_grad()`` (not inference mode: tensors a module caches lazily during an
inference-mode pass could not be used by the trainer's backward later) with the module in eval mode; its previous
train/eval state is restored whenever the worker goes idle. Don't run optimizer steps while a generation is in
flight on the same module.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import queue
import random
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mt_env.turn import ModelTurn

from .fast_decode import (DEFAULT_MAX_CACHE_LEN, ENGINE_COUNTERS, SAMPLING_MODES, LaunchedStep, RowSampling,
                          SlotEngine, SlotTable, UnsupportedModel, admission_waits, decoder_layout, module_device,
                          next_prefill_group, one_prefill_pass_takes, sample_tokens, sampling_mode)
from .policy import GenerationError, Policy, PolicyError, SamplingParams, check_prompt_ids

_STOP = object()  # queued by close(): the worker aborts what is left and exits
#: longest gathering of requests that keep arriving (each within `gather_window_s` of the last), in windows
GATHER_CAP_WINDOWS = 25
#: the interpreter's thread switch interval while a worker serves (see `_SwitchInterval`)
SERVING_SWITCH_INTERVAL_S = 0.0005


class _SwitchInterval:
    """Lowers the interpreter's thread switch interval (`sys.setswitchinterval`) while any HFPolicy worker serves.

    Why: between two device waits the worker runs a little Python (read a step's tokens, stop checks, launch the
    next step), and every torch call it makes releases the GIL and takes it back. While the caller's event-loop
    thread is busy (env steps for many episodes at a turn boundary), each take-back waits until that thread is
    asked to let go: after the switch interval, 5 ms by default — a 2.5 ms decode step stretched to several times
    its length. At 0.5 ms the worker waits at most that long; the event loop loses only the switches the worker
    asks for. Process-wide, counted: the previous value comes back when the last serving worker goes idle or
    closes (a value set by someone else meanwhile is overwritten then)."""

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
    """Settle asyncio futures of `loop` from the worker thread, all in one callback (those cancelled meanwhile are
    left alone). Why one: the requests that end at one step (a turn boundary: a whole batch) would otherwise wake
    the event loop once each and reach it over many of its passes, competing for the interpreter lock with the
    worker meanwhile; settled together, their callers all go on in the loop's next pass (e.g. the env processes'
    answers leave in one message each: `agents.rollout_processes`)."""

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
    """A request's future that records in a slot that its caller cancelled it (the future itself, or the task that
    awaits it): the worker, which then drops the row, reads that for every row at every step, where a slot costs a
    fraction of a `cancelled()` call."""

    __slots__ = ("withdrawn",)

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__(loop=loop)
        self.withdrawn = False

    def cancel(self, msg: Any = None) -> bool:
        if not super().cancel(msg):
            return False
        self.withdrawn = True
        return True


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int  #: `params.max_new_tokens`, capped by the model's context length
    future: _RequestFuture
    loop: asyncio.AbstractEventLoop
    submitted: float
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    generator: random.Random | None = None  #: the row's own uniform draws (seeded: reproducible samples)
    started: float | None = None
    finished: bool = False  #: its outcome is decided (it settles with the next `_settle_done`)
    arrival_step: int = 0  #: the worker's decode-step count when it took the request
    mode: int = field(init=False)  #: index in SAMPLING_MODES of the `sample_tokens` mode the row needs (0: greedy)

    def __post_init__(self):
        self.mode = SAMPLING_MODES.index(sampling_mode([self.params]))

    def settlement(self, outcome: str | BaseException) -> Settlement:
        """How the caller's future settles: with its ModelTurn for a finish reason, or raising an exception."""
        if isinstance(outcome, BaseException):
            return self.future, None, outcome
        now = time.perf_counter()
        started = self.started if self.started is not None else now
        meta = {"backend": "hf", "prompt_tokens": len(self.prompt), "completion_tokens": len(self.ids),
                "queue_s": started - self.submitted, "generate_s": now - started}
        return self.future, ModelTurn(list(self.ids), list(self.logprobs), outcome, meta), None


@dataclass(eq=False)
class _Call:
    """A function for the worker thread to run between two passes (it owns the engine); resolves `future`."""

    fn: Callable[[], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def run(self) -> None:
        try:
            result, error = self.fn(), None
        except Exception as e:
            result, error = None, e
        _resolve(self.loop, [(self.future, result, error)])


@dataclass(eq=False)
class _InFlight:
    """A fast-path decode step launched and not yet collected: the (slot, request) of every row it decodes, by the
    slots they held at launch (a compaction may move them before the step is collected)."""

    step: LaunchedStep
    rows: list[tuple[int, _Request]]


@dataclass(eq=False)
class _Batch:
    """Rows decoded together. Row i's KV cache is row i of `cache`; `mask` marks its real (non-padding) columns."""

    rows: list[_Request]
    cache: Any
    mask: torch.Tensor  #: [rows, cache length], 1 = real token
    positions: torch.Tensor  #: [rows], the position id of each row's next input token
    next_input: torch.Tensor | None = None  #: [rows], the token each row feeds next (its last sampled one)


def new_stats() -> dict[str, int | float]:
    """HFPolicy's scheduler counters, for benchmarks and debugging, all zero.

    Passes and rows: prefill_passes, decode_passes, decoded_rows; merges and separate_batches are the transformers
    path's; the fast path pads decode batches to a bucket (padded_rows), computes a row-step for rows that ended at
    the step before (wasted_rows: overlapped steps), compacts slots (compaction_moves), replays graphs
    (graph_captures, graph_replays; before a bucket is captured its steps run a larger bucket's graph,
    stand_in_replays, or uncaptured, uncaptured_steps; small prefill passes: prefill_graph_captures,
    prefill_graph_replays; `fast_decode.ENGINE_COUNTERS`) and may hold arrivals back
    (admission_waits: step boundaries at which waiting requests waited, see `admit_wait_steps`). Seconds: busy_s
    (the worker serving: from taking work while idle until idle again), gather_s (gathering requests that trickle
    in, see `_gathers`), prefill_s (prefill passes), launch_s (launching decode steps: on CUDA enqueueing
    them, or capturing a graph; on CPU computing them), step_wait_s (waiting for launched steps' outputs); the rest
    of busy_s is the worker's bookkeeping, with its waits to take the GIL back."""
    counts = ("prefill_passes", "decode_passes", "decoded_rows", "merges", "separate_batches", "padded_rows",
              "wasted_rows", "compaction_moves", "admission_waits", *ENGINE_COUNTERS)
    seconds = ("compile_s", "busy_s", "gather_s", "prefill_s", "launch_s", "step_wait_s")
    return dict.fromkeys(counts, 0) | dict.fromkeys(seconds, 0.0)  # compile_s, one of ENGINE_COUNTERS, is seconds


class HFPolicy(Policy):
    """Generate with a Hugging Face causal LM (any ``AutoModelForCausalLM``-style module) in this process.

    Args:
        model: the module to run; shared, not copied. Device and dtype follow it (also if it is moved later).
        max_batch_size: most rows decoded together; further requests wait.
        gather_window_s: gather requests until none arrived for this long (see above: when idle, and on the fast
            path while fewer rows decode than wait) before their prefill.
        max_context_len: prompt + generation limit; defaults to ``config.max_position_embeddings`` (and to
            `max_cache_len` on the fast path). Generation that reaches it ends with ``"length"``; longer prompts
            are rejected.
        seed: seeds the generators of requests that come without `SamplingParams.seed`.
        pad_token_id: the id placed in padding positions (masked out; any valid id works).
        vocab_limit: sample only ids below this (the tokenizer's size when the model's embedding is padded beyond
            it: padding rows are not tokens). Logprobs are then over those ids — the trainer must use the same
            limit (`trainers.modeling.PolicyModel` does).
        fast_path: ``"auto"``: the fast path (`agents.fast_decode`) when the module is on CUDA (here, now) and
            supported; True: the fast path on any device (ValueError if the module is not supported); False:
            transformers' forward. `fast_path_reason` says which was taken and why.
        cuda_graphs: on the fast path on CUDA, capture decode steps in CUDA graphs (else they run eagerly).
        compile: on the fast path, compile the decode step with Inductor (`agents.compiling`: fused kernels, one
            compilation for all layers and buckets): ``"auto"`` on CUDA only, True also on CPU (Inductor then
            needs a C++ compiler), False never. A compilation that fails leaves that part eager; `compile_reason`
            says which.
        max_cache_len: fast path only: tokens (prompt + generation) each of the `max_batch_size` KV slots holds;
            default `max_context_len` when given, else ``min(config.max_position_embeddings, 4096)``. The cache
            takes ``2 x layers x max_batch_size x kv_heads x max_cache_len x head_dim`` elements.
        overlap_steps: fast path only: launch each decode step before reading the previous step's tokens (see
            "Overlapped steps" above); False: one step at a time (no wasted row-steps, the host's work between
            steps on the device's critical path). The tokens are the same either way.
        admit_wait_steps: fast path only: requests that arrive while rows decode wait up to this many decode steps
            (counted from the first of them) for others to share their prefill pass, which stalls every decoding
            row; they go at once when they are at least as many as the decoding rows, or no row decodes. The wait
            is bounded, not open-ended: a request arriving mid-batch is often an episode with more work than the
            rest (its turn ended early on a tool call), and holding it until the batch drains would lengthen the
            whole rollout. 0 (the default) admits every arrival at the next step boundary: on an H200 a wait of 8
            steps took the driver from 0.94-0.95x to 0.78x the engine at 64 episodes (arrivals from four env
            processes waited instead of joining; `benchmarks/bench_rollout.py --admit-wait-steps`), and changed
            nothing at 256. The tokens are the same either way.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_batch_size: int = 64,
        gather_window_s: float = 0.002,
        max_context_len: int | None = None,
        seed: int | None = None,
        pad_token_id: int = 0,
        vocab_limit: int | None = None,
        fast_path: bool | str = "auto",
        cuda_graphs: bool = True,
        compile: bool | str = "auto",
        max_cache_len: int | None = None,
        overlap_steps: bool = True,
        admit_wait_steps: int = 0,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"HFPolicy needs a torch nn.Module (a transformers causal LM), got {type(model).__name__}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if gather_window_s < 0:
            raise ValueError(f"gather_window_s must be >= 0, got {gather_window_s}")
        if admit_wait_steps < 0:
            raise ValueError(f"admit_wait_steps must be >= 0, got {admit_wait_steps}")
        self.model = model
        self.max_batch_size = max_batch_size
        self.gather_window_s = gather_window_s
        self.vocab_size = _vocab_size(model)
        if vocab_limit is not None:
            if not 0 < vocab_limit <= self.vocab_size:
                raise ValueError(f"vocab_limit {vocab_limit} must be in (0, {self.vocab_size}]")
            self.vocab_size = vocab_limit
        if not 0 <= pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id {pad_token_id} is outside the vocabulary [0, {self.vocab_size})")
        self.pad_token_id = pad_token_id
        positions = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 2**31 - 1
        self.max_context_len = max_context_len or positions

        self._cache_arg, self._keep_last_logits = _forward_arguments(model)

        self.stats = new_stats()  #: scheduler counters (see `new_stats`)
        cache_len = max_cache_len or max_context_len or min(positions, DEFAULT_MAX_CACHE_LEN)
        self._engine, self.fast_path_reason = self._fast_engine(fast_path, cuda_graphs, compile, cache_len)
        self.fast_path = self._engine is not None
        if self._engine is not None:
            self.max_context_len = min(self.max_context_len, self._engine.max_cache_len)
        self.overlap_steps = bool(overlap_steps)
        self.admit_wait_steps = admit_wait_steps

        self._rng = random.Random(seed)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._submit_lock = threading.Lock()  # orders submissions against close() and the worker's death
        self._model_lock = threading.Lock()  # held during each forward pass; update_weights waits for it
        self._closed = False
        self._dead: BaseException | None = None
        # Owned by the worker thread:
        self._waiting: list[_Request] = []
        self._batches: list[_Batch] = []  # the transformers path's batches
        self._slots = SlotTable(max_batch_size) if self.fast_path else None  # the fast path's rows, by KV slot
        self._in_flight: _InFlight | None = None  # the fast path's launched, uncollected decode step
        self._serving_since: float | None = None  # busy_s counted up to here while serving (None: idle)
        self._done: list[tuple[_Request, str | BaseException]] = []
        self._restore_training = False
        self._thread = threading.Thread(target=self._work, name="HFPolicy-worker", daemon=True)
        self._thread.start()

    def _fast_engine(self, fast_path: bool | str, cuda_graphs: bool, compile: bool | str, max_cache_len: int):
        """The fast path's engine (or None) and why it was (not) taken."""
        for name, value in (("fast_path", fast_path), ("compile", compile)):
            if value not in (True, False, "auto"):
                raise ValueError(f"{name} must be True, False or 'auto', got {value!r}")
        if not isinstance(max_cache_len, int) or max_cache_len < 2:
            raise ValueError(f"max_cache_len must be an integer >= 2, got {max_cache_len!r}")
        if fast_path is False:
            return None, "off: fast_path=False"
        try:
            layout = decoder_layout(self.model)
        except UnsupportedModel as e:
            if fast_path is True:
                raise ValueError(f"fast_path=True, but the module cannot take it: {e}") from None
            return None, f"off: {e}"
        device = module_device(self.model)
        if fast_path == "auto" and device.type != "cuda":
            return None, f"off: the module is on {device.type} (fast_path='auto' takes it on CUDA only)"
        compile_step = compile is True or (compile == "auto" and device.type == "cuda")
        engine = SlotEngine(self.model, layout, max_slots=self.max_batch_size, max_cache_len=max_cache_len,
                            vocab_size=self.vocab_size, cuda_graphs=cuda_graphs, compile=compile_step,
                            stats=self.stats)
        graphs = cuda_graphs and device.type == "cuda"
        return engine, (f"on: {max_cache_len}-token KV slots, decode steps {'compiled' if compile_step else 'eager'}"
                        f"{' in CUDA graphs' if graphs else ''}")

    # ----------------------------------------------------------------------------------------- public API
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> ModelTurn:
        return await self.submit(prompt_ids, params)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> asyncio.Future[ModelTurn]:
        """`Policy.submit`: the request is checked and queued for the worker now (a bad one's error is the
        future's); cancelling the future drops its row at the worker's next step. Every generation starts here
        (`generate` awaits it; `ProcessRolloutDriver` calls it directly): a subclass changes requests here."""
        loop = asyncio.get_running_loop()
        try:
            request = self._request(prompt_ids, params or SamplingParams(), loop)
            self._submit(request)
        except Exception as e:
            failed = loop.create_future()
            failed.set_exception(e)
            return failed
        return request.future

    def _request(self, prompt_ids: Sequence[int], params: SamplingParams, loop: asyncio.AbstractEventLoop) -> _Request:
        """A request for the worker, or ValueError saying what is wrong with it."""
        prompt = check_prompt_ids(prompt_ids, self.vocab_size)
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop token id(s) {bad_stop[:5]} outside the vocabulary [0, {self.vocab_size})")
        room = self.max_context_len - len(prompt)
        if room < 1:
            limit = " (the fast path's max_cache_len)" if self.fast_path else ""
            raise ValueError(f"the prompt is {len(prompt)} tokens: no room left in the context of "
                             f"{self.max_context_len} tokens{limit}")
        return _Request(prompt, params, min(params.max_new_tokens, room), _RequestFuture(loop), loop,
                        time.perf_counter())

    async def close(self) -> None:
        """Stop the worker: requests in flight end with ``"abort"`` and their partial output."""
        with self._submit_lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
        await asyncio.to_thread(self._thread.join)

    async def update_weights(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None = None,
        *,
        model_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        """Copy tensors into the module's parameters/buffers of the same names, between two forward passes.

        Rarely needed: the policy runs the trainer's module, so optimizer steps are visible without it. Useful
        when the trainer holds another copy (other device, wrapped module). The copies are in place, so the fast
        path's CUDA graphs see them.
        """
        if model_path is not None or kwargs:
            raise NotImplementedError("HFPolicy updates weights from tensors only (named_tensors=...); it shares "
                                      "its module with the trainer, which usually makes updates unnecessary")
        if named_tensors is None:
            raise ValueError("update_weights needs named_tensors: {name: tensor} or (name, tensor) pairs")
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        await asyncio.to_thread(self._copy_weights, items)

    async def flush_cache(self) -> None:
        """Nothing to do: HFPolicy keeps no KV cache between requests (a KV slot is reused from scratch)."""

    async def release_memory(self) -> None:
        """Free the fast path's KV cache and CUDA graphs (nothing on the transformers path, which keeps no cache
        between requests). The weights are the trainer's and stay. Refused while requests are in flight; the
        next generation (or `resume_memory`) allocates the cache again."""
        await self._in_worker(self._release)

    async def resume_memory(self) -> None:
        """Allocate the fast path's KV cache now rather than at the next generation."""
        await self._in_worker(self._allocate)

    def _allocate(self) -> None:
        """The fast path's cache, as a pass (`_pass`): on CUDA its allocation runs and captures forward passes."""
        if self._engine is not None:
            with self._pass():
                self._engine.allocate()

    @property
    def compile_reason(self) -> str:
        """Whether the fast path's decode step runs compiled and captured, and why not where it does not."""
        if self._engine is None:
            return "off: the transformers path"
        graphs = f"; CUDA graphs off: {self._engine.capture_failure}" if self._engine.capture_failure else ""
        return self._engine.compile_reason + graphs

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the fast path's KV cache holds now (0 when released, not yet allocated, or on the transformers
        path, whose caches live only while requests run)."""
        return self._engine.cache_bytes() if self._engine is not None and self._engine.allocated else 0

    def __repr__(self) -> str:
        return (f"HFPolicy({type(self.model).__name__}, max_batch_size={self.max_batch_size}, "
                f"vocab_size={self.vocab_size}, fast_path={self.fast_path}, closed={self._closed})")

    def _submit(self, item: _Request | _Call) -> None:
        with self._submit_lock:
            if self._closed:
                raise PolicyError("this HFPolicy is closed")
            if self._dead is not None:
                raise PolicyError(f"HFPolicy's worker thread died: {self._dead!r}") from self._dead
            self._queue.put(item)

    async def _in_worker(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the worker thread between two passes and return its result."""
        loop = asyncio.get_running_loop()
        call = _Call(fn, loop.create_future(), loop)
        self._submit(call)
        return await call.future

    def _release(self) -> None:
        if self._busy():
            raise PolicyError(f"cannot release memory while {len(self._held())} request(s) are in flight")
        if self._engine is not None:
            self._engine.release()

    # ----------------------------------------------------------------------------------------- worker thread
    def _work(self) -> None:
        try:
            with torch.no_grad():
                while self._serve_once():
                    pass
        except BaseException as e:  # a bug in the scheduler itself: fail everyone rather than hang them
            with self._submit_lock:
                self._dead = e
            error = PolicyError(f"HFPolicy's worker thread died: {type(e).__name__}: {e}")
            error.__cause__ = e
            for request in self._everyone():
                self._finish(request, error)
        finally:
            self._serving(False)
            self._settle_done()
            if self._engine is not None:  # the KV cache and the pinned host buffers go with the worker
                self._engine.release()

    def _serve_once(self) -> bool:
        """One scheduling step: take requests, admit them, decode one token for every row. False = stop."""
        if self._take_requests():
            self._collect_in_flight()  # the rows keep the tokens of the step the device has computed
            for request in self._everyone():
                self._finish(request, "abort")
            return False
        self._drop_cancelled()
        if self._engine is not None:
            if not self._admit_to_slots():  # more wait for a pass: take the arrivals first, then the next pass
                self._step_slots()
        else:
            self._admit()
            for batch in list(self._batches):
                self._decode(batch)
        self._serving(True)  # busy_s up to date before the callers see their results
        self._settle_done()
        return True

    def _take_requests(self) -> bool:
        """Move queued requests to `_waiting` (running queued calls), blocking while there is nothing to do, and
        gather more when `_gathers` says so. True when close() asks to stop."""
        waiting = len(self._waiting)
        if not self._busy():
            self._serving(False)
            item = self._queue.get()
            self._serving(True)
            if self._accept(item):
                return True
        if self._drain():
            return True
        if not self._gathers(arrived=len(self._waiting) - waiting):
            return False
        start = time.perf_counter()
        try:
            return self._gather()
        finally:
            self.stats["gather_s"] += time.perf_counter() - start

    def _gathers(self, arrived: int) -> bool:
        """Whether to gather requests that trickle in before the next pass: some just `arrived` and the waiting are
        at least as many as the rows decoding — always when the worker was idle; on the fast path also while rows
        decode, as long as more would fit (see the module docstring)."""
        if not arrived:
            return False
        if self._slots is None:
            return not self._batches
        return self._slots.held_count() <= len(self._waiting) < self._slots.free_count()

    def _serving(self, on: bool) -> None:
        """The worker serves (it took work while idle; called again after each scheduling step to bring busy_s up
        to date) or goes idle: the switch interval is held while it serves."""
        now = time.perf_counter()
        if self._serving_since is not None:
            self.stats["busy_s"] += now - self._serving_since
        if on != (self._serving_since is not None):
            (_SWITCH_INTERVAL.hold if on else _SWITCH_INTERVAL.release)()
        self._serving_since = now if on else None

    def _gather(self) -> bool:
        """With a first request waiting (`_gathers`): take more until none arrived for `gather_window_s`, the batch
        is full, `GATHER_CAP_WINDOWS` windows passed, or (fast path) the waiting fill the next prefill pass.
        Requests that trickle in (episodes whose turns ended together, processed one after another by the caller)
        then share one prefill, and a full pass goes as soon as it is full: the rest of a burst arrives while it
        runs. The window is a real wait on the queue: time spent waiting for the GIL (a busy caller) never counts as
        quiet."""
        deadline = time.perf_counter() + self.gather_window_s * GATHER_CAP_WINDOWS
        room = self._slots.free_count() if self._slots is not None else self.max_batch_size  # all that can join
        full = self._fills_a_pass()
        while len(self._waiting) < room and not full():
            if self._drain():
                return True
            timeout = min(self.gather_window_s, deadline - time.perf_counter())
            if len(self._waiting) >= room or timeout <= 0 or full():
                return False
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                return False
            if self._accept(item):
                return True
        return False

    def _fills_a_pass(self) -> Callable[[], bool]:
        """For `_gather` (where `_waiting` only grows): whether the waiting fill the next prefill pass, so that no
        request arriving later could join it (fast path; `fast_decode.one_prefill_pass_takes`: a pass pads its rows
        to the longest). Each call looks only at the requests that arrived since the last."""
        if self._engine is None:
            return lambda: False
        seen, longest = 0, 0

        def full() -> bool:
            nonlocal seen, longest
            longest = max([longest] + [len(r.prompt) for r in self._waiting[seen:]])
            seen = len(self._waiting)
            return not one_prefill_pass_takes(seen + 1, longest, self._engine.max_cache_len)
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
        """One queued item: close()'s stop (True), a call to run now, or a request to admit."""
        if item is _STOP:
            return True
        if isinstance(item, _Call):
            self._collect_in_flight()  # calls run between two passes: no step in flight
            item.run()
        else:
            item.arrival_step = self.stats["decode_passes"]
            self._waiting.append(item)
        return False

    def _held(self) -> list[_Request]:
        """Requests being decoded or waiting to be admitted."""
        held = [r for b in self._batches for r in b.rows] + self._waiting
        return held + ([r for _, r in self._slots.occupied()] if self._slots is not None else [])

    def _busy(self) -> bool:
        return bool(self._batches or self._waiting or self._in_flight is not None
                    or (self._slots is not None and self._slots.held_count()))

    def _everyone(self) -> list[_Request]:
        """All requests the worker holds or that are still queued; clears them from the worker's state (queued
        calls fail: the worker is going away)."""
        requests = self._held()
        self._batches, self._waiting, self._in_flight = [], [], None
        if self._slots is not None:
            self._slots = SlotTable(self._slots.size)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Call):
                _resolve(item.loop, [(item.future, None, PolicyError("this HFPolicy is closed"))])
            elif item is not _STOP:
                requests.append(item)
        return requests

    def _drop_cancelled(self) -> None:
        self._waiting = [r for r in self._waiting if not r.future.withdrawn]
        if self._slots is not None:
            self._free_slots([slot for slot, r in self._slots.occupied() if r.future.withdrawn])
        for batch in list(self._batches):
            if any(r.future.withdrawn for r in batch.rows):
                self._keep_rows(batch, [i for i, r in enumerate(batch.rows) if not r.future.withdrawn])
                if not batch.rows:
                    self._batches.remove(batch)

    def _start(self, requests: list[_Request]) -> None:
        now = time.perf_counter()
        for r in requests:
            r.started = now
            r.generator = random.Random(r.params.seed if r.params.seed is not None else self._rng.getrandbits(63))

    @contextlib.contextmanager
    def _pass(self):
        """Around each forward pass: the model lock (update_weights waits for it) and eval mode."""
        with self._model_lock:
            if self.model.training:
                self._restore_training = True
                self.model.eval()
            yield

    def _record(self, rows: list[_Request], tokens: list[int], logprobs: list[float]) -> list[int]:
        """Append each row's new token and retire the rows that are done; returns the indices of those that go on."""
        if any(math.isnan(lp) for lp in logprobs):
            raise GenerationError("the model produced NaN logits")
        keep = []
        for i, (request, token, logprob) in enumerate(zip(rows, tokens, logprobs)):
            request.ids.append(token)
            request.logprobs.append(logprob)
            if token in request.params.stop_token_ids:
                self._finish(request, "stop")
            elif len(request.ids) >= request.max_new_tokens:
                self._finish(request, "length")
            elif not request.future.withdrawn:
                keep.append(i)
        return keep

    # ----------------------------------------------------------------------------------------- fast path
    def _admit_to_slots(self) -> bool:
        """Prefill waiting requests into free slots: one pass of bounded size (`next_prefill_group`: the shortest
        prompts first). True when more could be admitted: the worker then takes the requests that arrived during
        this pass and runs the next one, without a decode step between — the arrivals join the waiting rest, so that
        a burst that the pass budget splits does not leave a small pass of its own when the next burst follows (env
        processes answer a turn boundary in bursts)."""
        room = self._slots.free_count()
        if room <= 0 or not self._waiting or self._admission_waits():
            return False
        candidates = self._waiting[:room]
        group = [candidates[i] for i in next_prefill_group([len(r.prompt) for r in candidates],
                                                           self._engine.max_cache_len)]
        chosen = set(group)
        self._waiting = [r for r in self._waiting if r not in chosen]
        self._start(group)
        try:
            self._engine.check_module(busy=self._slots.held_count() > 0)
        except Exception as e:
            self._fail(group, "prefill", e)
        else:
            self._prefill_slots(group)
        return bool(self._waiting) and self._slots.free_count() > 0

    def _admission_waits(self) -> bool:
        """Whether the waiting requests wait another step (`admit_wait_steps`, `fast_decode.admission_waits`)."""
        now = self.stats["decode_passes"]
        waits = admission_waits([now - r.arrival_step for r in self._waiting], self._slots.held_count(),
                                self.admit_wait_steps)
        self.stats["admission_waits"] += waits
        return waits

    def _prefill_slots(self, requests: list[_Request]) -> None:
        slots = self._slots.acquire(requests)
        sampling = RowSampling.draw([r.params for r in requests], [r.generator for r in requests], self.vocab_size)
        start = time.perf_counter()
        try:
            with self._pass():
                tokens, logprobs = self._engine.prefill(slots, [r.prompt for r in requests], sampling)
            self.stats["prefill_passes"] += 1
            keep = set(self._record(requests, tokens, logprobs))
        except Exception as e:
            self._free_slots(slots, clear=True)
            self._fail(requests, "prefill", e)
            return
        finally:
            self.stats["prefill_s"] += time.perf_counter() - start
        self._free_slots([slot for i, slot in enumerate(slots) if i not in keep])

    def _step_slots(self) -> None:
        """Launch the next decode step, then collect the one launched before it: the host reads a step's tokens
        while the device computes the next (without `overlap_steps`: launch one and collect it)."""
        previous, self._in_flight = self._in_flight, None
        try:
            launched = self._launch_step(previous)
        except Exception as e:
            self._collect(previous)
            held = self._slots.occupied()
            self._free_slots([slot for slot, _ in held], clear=True)
            self._fail([r for _, r in held], "decoding", e)
            return
        if self.overlap_steps:
            self._in_flight = launched
            self._collect(previous)
        else:
            self._collect(launched)

    def _launch_step(self, previous: _InFlight | None) -> _InFlight | None:
        """Launch a decode step over the batch bucket covering every held slot (after compaction); None when no
        row needs another token. A row in `previous` (uncollected) is one token ahead of its recorded ids; a row
        whose last token is in `previous` asks for nothing (it runs as a wasted row, like one that ends there)."""
        ahead = {r for _, r in previous.rows} if previous is not None else set()
        moves = self._slots.compact()
        held = self._slots.occupied()
        if moves:
            moved = {dst for _, dst in moves}
            # the positions filled on the device: a row in `previous` has one more than its recorded ids say
            self._engine.move(moves, filled=max(len(r.prompt) + len(r.ids) + (r in ahead) - 1
                                                for s, r in held if s in moved))
            self.stats["compaction_moves"] += len(moves)
        bucket = self._slots.bucket()
        uniforms, need, mode = None, 0, 0  # uniforms: None while every row is greedy (nothing to draw or send)
        for slot, r in held:  # per step and row: keep it lean
            asked = len(r.ids) + (r in ahead)  # tokens asked of the device so far
            if asked >= r.max_new_tokens:
                continue
            if len(r.prompt) + asked > need:  # the filled positions and the token fed now
                need = len(r.prompt) + asked
            if r.mode:
                if uniforms is None:
                    uniforms = [0.0] * bucket
                uniforms[slot] = r.generator.random()  # the row's next draw, whenever the step runs
                if r.mode > mode:
                    mode = r.mode
        if not need:
            return None
        start = time.perf_counter()
        with self._pass():
            step = self._engine.launch(bucket, need, uniforms, SAMPLING_MODES[mode])
        self.stats["launch_s"] += time.perf_counter() - start
        self.stats["decode_passes"] += 1
        self.stats["padded_rows"] += bucket - len(held)
        return _InFlight(step, held)

    def _collect(self, launched: _InFlight | None) -> None:
        """Record a launched step's tokens for its rows that are still decoding and retire those that are done;
        rows that ended (or were cancelled) since its launch count as wasted."""
        if launched is None:
            return
        live = [(slot, r) for slot, r in launched.rows if not (r.finished or r.future.withdrawn)]
        rows = [r for _, r in live]
        self.stats["decoded_rows"] += len(live)
        self.stats["wasted_rows"] += len(launched.rows) - len(live)
        start = time.perf_counter()
        try:
            tokens, logprobs = self._engine.collect(launched.step)
            self.stats["step_wait_s"] += time.perf_counter() - start
            keep = set(self._record(rows, [tokens[s] for s, _ in live], [logprobs[s] for s, _ in live]))
        except Exception as e:
            self._free_rows(rows, clear=True)
            self._fail(rows, "decoding", e)
            return
        self._free_rows([r for i, r in enumerate(rows) if i not in keep])

    def _collect_in_flight(self) -> None:
        launched, self._in_flight = self._in_flight, None
        self._collect(launched)

    def _free_rows(self, rows: list[_Request], clear: bool = False) -> None:
        """Free the slots `rows` hold now (a compaction since a step's launch may have moved them)."""
        if rows:
            leaving = set(rows)
            self._free_slots([slot for slot, r in self._slots.occupied() if r in leaving], clear=clear)

    def _free_slots(self, slots: list[int], clear: bool = False) -> None:
        self._slots.release(slots)
        self._engine.free(slots, clear=clear)

    # ----------------------------------------------------------------------------------------- transformers path
    def _admit(self) -> None:
        """Prefill as many waiting requests as there is room for, then merge them into a running batch."""
        room = self.max_batch_size - sum(len(b.rows) for b in self._batches)
        if room <= 0 or not self._waiting:
            return
        new, self._waiting = self._waiting[:room], self._waiting[room:]
        start = time.perf_counter()
        try:
            batch = self._prefill(new)
        except Exception as e:
            self._fail(new, "prefill", e)
            return
        finally:
            self.stats["prefill_s"] += time.perf_counter() - start
        if not batch.rows:
            return
        if any(self._merge(running, batch) for running in self._batches):
            self.stats["merges"] += 1
        else:
            self.stats["separate_batches"] += bool(self._batches)  # stepped in turn with another batch
            self._batches.append(batch)

    def _prefill(self, requests: list[_Request]) -> _Batch:
        device = module_device(self.model)
        self._start(requests)
        width = max(len(r.prompt) for r in requests)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(r.prompt)) + r.prompt for r in requests],
                                 dtype=torch.long, device=device)
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in requests],
                            dtype=torch.long, device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits, cache = self._forward(input_ids, mask, positions, cache=None)
        self.stats["prefill_passes"] += 1
        tokens, logprobs = self._sample(logits, requests)
        lengths = torch.tensor([len(r.prompt) for r in requests], dtype=torch.long, device=device)
        batch = _Batch(list(requests), cache, mask, lengths)
        self._advance(batch, tokens, logprobs)
        return batch

    def _decode(self, batch: _Batch) -> None:
        mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=1)
        try:
            logits, batch.cache = self._forward(batch.next_input[:, None], mask, batch.positions[:, None], batch.cache)
            self.stats["decode_passes"] += 1
            self.stats["decoded_rows"] += len(batch.rows)
            tokens, logprobs = self._sample(logits, batch.rows)
            batch.mask = mask
            batch.positions = batch.positions + 1
            self._advance(batch, tokens, logprobs)
        except Exception as e:
            self._batches.remove(batch)
            self._fail(batch.rows, "decoding", e)
            return
        if not batch.rows:
            self._batches.remove(batch)

    def _forward(self, input_ids, mask, position_ids, cache) -> tuple[torch.Tensor, Any]:
        """Logits of each row's last position (float32) and the KV cache."""
        kwargs: dict[str, Any] = dict(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                                      use_cache=True)
        if cache is not None:
            kwargs[self._cache_arg] = cache
        if self._keep_last_logits:
            kwargs["logits_to_keep"] = 1
        with self._pass():
            out = self.model(**kwargs)
        cache = getattr(out, self._cache_arg, None)
        if cache is None:
            raise GenerationError(f"{type(self.model).__name__} returned no KV cache for use_cache=True")
        return out.logits[:, -1, :self.vocab_size].float(), cache

    def _advance(self, batch: _Batch, tokens: list[int], logprobs: list[float]) -> None:
        """Record each row's new token and retire the rows that are done."""
        keep = self._record(batch.rows, tokens, logprobs)
        batch.next_input = torch.tensor(tokens, dtype=torch.long, device=batch.mask.device)
        if len(keep) < len(batch.rows):
            self._keep_rows(batch, keep)

    def _sample(self, logits: torch.Tensor, rows: list[_Request]) -> tuple[list[int], list[float]]:
        """Per-row sampling (`sample_tokens`). Returns the tokens and ``log_softmax(logits / T)`` of each."""
        sampling = RowSampling.draw([r.params for r in rows], [r.generator for r in rows], self.vocab_size)
        tokens, logprobs = sample_tokens(logits, *sampling.tensors(logits.device), sampling.mode)
        return tokens.tolist(), logprobs.tolist()

    # ----------------------------------------------------------------------------------------- cache surgery
    def _keep_rows(self, batch: _Batch, keep: list[int]) -> None:
        """Keep only rows `keep` of the batch (cache included), then cut padding columns nobody needs."""
        if not keep:
            batch.rows = []
            return
        index = torch.tensor(keep, dtype=torch.long, device=batch.mask.device)
        batch.cache.batch_select_indices(index)
        batch.rows = [batch.rows[i] for i in keep]
        batch.mask, batch.positions = batch.mask[index], batch.positions[index]
        if batch.next_input is not None:
            batch.next_input = batch.next_input[index]
        first_used = int(batch.mask.any(dim=0).int().argmax())
        if first_used > 0 and _mergeable(batch.cache, batch.mask.shape[1]):
            for layer in batch.cache.layers:
                layer.keys, layer.values = layer.keys[..., first_used:, :], layer.values[..., first_used:, :]
            batch.mask = batch.mask[:, first_used:]

    def _merge(self, running: _Batch, new: _Batch) -> bool:
        """Append `new`'s rows to `running`, left-padding the shorter cache. False if the caches can't merge."""
        if len(running.rows) + len(new.rows) > self.max_batch_size:
            return False
        width_a, width_b = running.mask.shape[1], new.mask.shape[1]
        if not (_mergeable(running.cache, width_a) and _mergeable(new.cache, width_b)):
            return False
        if len(running.cache.layers) != len(new.cache.layers):
            return False
        width = max(width_a, width_b)
        for a, b in zip(running.cache.layers, new.cache.layers):
            a.keys = torch.cat([_pad_time(a.keys, width - width_a), _pad_time(b.keys, width - width_b)], dim=0)
            a.values = torch.cat([_pad_time(a.values, width - width_a), _pad_time(b.values, width - width_b)], dim=0)
        running.mask = torch.cat([F.pad(running.mask, (width - width_a, 0)), F.pad(new.mask, (width - width_b, 0))])
        running.positions = torch.cat([running.positions, new.positions])
        running.next_input = torch.cat([running.next_input, new.next_input])
        running.rows += new.rows
        return True

    # ----------------------------------------------------------------------------------------- outcomes
    def _fail(self, requests: list[_Request], phase: str, exc: Exception) -> None:
        message = (f"HFPolicy: the model raised during {phase} of a batch of {len(requests)} request(s): "
                   f"{type(exc).__name__}: {exc}")
        for request in requests:
            error = GenerationError(message)
            error.__cause__ = exc
            self._finish(request, error)

    def _finish(self, request: _Request, outcome: str | BaseException) -> None:
        """Decide a request's outcome; it settles with the next `_settle_done`."""
        request.finished = True
        self._done.append((request, outcome))

    def _settle_done(self) -> None:
        """Resolve finished requests, those of one event loop together (`_resolve`); restore the module's train mode
        first if nothing else is running."""
        if not self._busy() and self._restore_training:
            self.model.train()
            self._restore_training = False
        done, self._done = self._done, []
        by_loop: dict[asyncio.AbstractEventLoop, list[Settlement]] = {}
        for request, outcome in done:
            by_loop.setdefault(request.loop, []).append(request.settlement(outcome))
        for loop, settlements in by_loop.items():
            _resolve(loop, settlements)

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


# --------------------------------------------------------------------------------------------- helpers
def _mergeable(cache: Any, width: int) -> bool:
    """True for caches made only of plain full-attention dynamic layers holding `width` positions."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers or getattr(cache, "offloading", False):
        return False
    return all(type(layer) is DynamicLayer and isinstance(getattr(layer, "keys", None), torch.Tensor)
               and layer.keys.dim() == 4 and layer.keys.shape[-2] == width for layer in layers)


def _pad_time(states: torch.Tensor, n: int) -> torch.Tensor:
    """Left-pad [batch, heads, time, dim] key/value states with `n` zero positions."""
    return F.pad(states, (0, 0, n, 0)) if n else states


def _forward_arguments(model: nn.Module) -> tuple[str, bool]:
    """The name of the forward's KV-cache argument, and whether it takes ``logits_to_keep``."""
    accepted = inspect.signature(model.forward).parameters
    if "cache" in accepted:  # recent transformers (5.24) name it `cache`; 5.17 still says `past_key_values`
        return "cache", "logits_to_keep" in accepted
    if "past_key_values" in accepted:
        return "past_key_values", "logits_to_keep" in accepted
    raise TypeError(f"{type(model).__name__}.forward takes no KV cache (`cache` / `past_key_values`)")


def _vocab_size(model: nn.Module) -> int:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and hasattr(embeddings, "num_embeddings"):
        return int(embeddings.num_embeddings)
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if size is None:
        raise TypeError(f"cannot tell the vocabulary size of {type(model).__name__}")
    return int(size)
