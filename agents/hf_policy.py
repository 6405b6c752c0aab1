"""HFPolicy: a transformers causal LM in this process, serving many concurrent episodes with shared forward passes.

The policy runs the trainer's own `nn.Module` (no copy): an optimizer step is visible to the next generated token.

How requests are batched (iteration-level batching, as in Orca and vLLM, on top of transformers' ``DynamicCache``):

* A background thread owns the forward passes. `generate` puts a request on a thread-safe queue and awaits a
  future, so the asyncio event loop never blocks on the model.
* When idle, the worker takes the first request and gathers more for `gather_window_s` (or until `max_batch_size`).
* **Prefill**: the prompts are left-padded into one tensor with an attention mask and per-row position ids; one
  forward pass builds the KV cache and gives each row's first-token logits.
* **Decode**: one token per row and step, with the cache. Each row samples with its own `SamplingParams` and its
  own seeded ``torch.Generator``.
* A row that samples a stop token or reaches its limit is **resolved at once** and leaves the batch (its cache
  rows are dropped), so a finished episode never waits for the slowest row.
* **Requests that arrive while a batch runs join it at the next step boundary**: they are prefilled together, then
  merged into the running batch by left-padding the shorter KV cache (padding is masked out), and share every
  forward pass from then on. Merging needs plain full-attention cache layers (``DynamicLayer``); with other caches
  (sliding-window, quantized, ...) the new rows form a second batch that is stepped in turn — they still start at
  once, they just share fewer passes. When rows leave, cache columns that are padding for every remaining row are
  cut off.
* Batch size is capped by `max_batch_size` rows in flight; more requests wait in the queue.

Why not transformers' own batching:

* ``model.generate`` decodes one fixed batch until its slowest row ends, has one seed for the batch and returns
  scores after logits processors.
* The continuous-batching API (``init_continuous_batching`` / ``generate_batch``; present in 5.17 and 5.24) was
  evaluated: it switches the module's attention implementation to a paged one (the module the trainer also runs),
  pre-allocates a paged cache, has one seed per manager (no per-request generator), returns logprobs of the
  *processed* distribution (after top-k/top-p, not what a trainer recomputes), and its internals changed between
  5.17 and 5.24. A scheduler of our own over ``DynamicCache`` avoids all of that and runs on CPU and GPU alike.
* ``DynamicCache`` rather than a static cache: rows join and leave at different lengths; a static cache would fix
  a maximum length per row and pays off only with torch.compile / CUDA graphs.

Forward passes run under ``torch.no_grad()`` (not inference mode: tensors a module caches lazily during an
inference-mode pass could not be used by the trainer's backward later) with the module in eval mode; its previous
train/eval state is restored whenever the worker goes idle. Don't run optimizer steps while a generation is in
flight on the same module.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import random
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mt_env.turn import ModelTurn

from .policy import GenerationError, Policy, PolicyError, SamplingParams, check_prompt_ids

_STOP = object()  # queued by close(): the worker aborts what is left and exits


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int  #: `params.max_new_tokens`, capped by the model's context length
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    submitted: float
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    generator: random.Random | None = None  #: the row's own uniform draws (seeded: reproducible samples)
    started: float | None = None
    cancelled: bool = False  #: set by the caller's task when it is cancelled; the worker then drops the row

    def settle(self, outcome: str | BaseException) -> None:
        """Resolve the caller's future from the worker thread: a finish reason, or an exception to raise."""
        if isinstance(outcome, BaseException):
            result, error = None, outcome
        else:
            now = time.perf_counter()
            started = self.started if self.started is not None else now
            meta = {"backend": "hf", "prompt_tokens": len(self.prompt), "completion_tokens": len(self.ids),
                    "queue_s": started - self.submitted, "generate_s": now - started}
            result, error = ModelTurn(list(self.ids), list(self.logprobs), outcome, meta), None

        def set_outcome(fut: asyncio.Future = self.future) -> None:
            if fut.done():  # cancelled meanwhile
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        try:
            self.loop.call_soon_threadsafe(set_outcome)
        except RuntimeError:  # the caller's event loop is closed: nobody waits for this result any more
            pass


@dataclass(eq=False)
class _Batch:
    """Rows decoded together. Row i's KV cache is row i of `cache`; `mask` marks its real (non-padding) columns."""

    rows: list[_Request]
    cache: Any
    mask: torch.Tensor  #: [rows, cache length], 1 = real token
    positions: torch.Tensor  #: [rows], the position id of each row's next input token
    next_input: torch.Tensor | None = None  #: [rows], the token each row feeds next (its last sampled one)


class HFPolicy(Policy):
    """Generate with a Hugging Face causal LM (any ``AutoModelForCausalLM``-style module) in this process.

    Args:
        model: the module to run; shared, not copied. Device and dtype follow it (also if it is moved later).
        max_batch_size: most rows decoded together; further requests wait.
        gather_window_s: when idle, how long to wait for more requests after the first before starting a batch.
        max_context_len: prompt + generation limit; defaults to ``config.max_position_embeddings``. Generation
            that reaches it ends with ``"length"``; longer prompts are rejected.
        seed: seeds the generators of requests that come without `SamplingParams.seed`.
        pad_token_id: the id placed in padding positions (masked out; any valid id works).
        vocab_limit: sample only ids below this (the tokenizer's size when the model's embedding is padded beyond
            it: padding rows are not tokens). Logprobs are then over those ids — the trainer must use the same
            limit (`trainers.modeling.PolicyModel` does).
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
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"HFPolicy needs a torch nn.Module (a transformers causal LM), got {type(model).__name__}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if gather_window_s < 0:
            raise ValueError(f"gather_window_s must be >= 0, got {gather_window_s}")
        self.model = model
        self.max_batch_size = max_batch_size
        self.gather_window_s = gather_window_s
        self.vocab_size = _vocab_size(model)
        if vocab_limit is not None:
            if not 0 < vocab_limit <= self.vocab_size:
                raise ValueError(f"vocab_limit {vocab_limit} must be in (0, {self.vocab_size}]")
            self.vocab_size = vocab_limit
        config = getattr(model, "config", None)
        self.max_context_len = max_context_len or getattr(config, "max_position_embeddings", None) or 2**31 - 1
        if not 0 <= pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id {pad_token_id} is outside the vocabulary [0, {self.vocab_size})")
        self.pad_token_id = pad_token_id

        accepted = inspect.signature(model.forward).parameters
        if "cache" in accepted:  # recent transformers (5.24) name it `cache`; 5.17 still says `past_key_values`
            self._cache_arg = "cache"
        elif "past_key_values" in accepted:
            self._cache_arg = "past_key_values"
        else:
            raise TypeError(f"{type(model).__name__}.forward takes no KV cache (`cache` / `past_key_values`)")
        self._keep_last_logits = "logits_to_keep" in accepted

        self._rng = random.Random(seed)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._submit_lock = threading.Lock()  # orders submissions against close() and the worker's death
        self._model_lock = threading.Lock()  # held during each forward pass; update_weights waits for it
        self._closed = False
        self._dead: BaseException | None = None
        # Owned by the worker thread:
        self._waiting: list[_Request] = []
        self._batches: list[_Batch] = []
        self._done: list[tuple[_Request, str | BaseException]] = []
        self._restore_training = False
        #: scheduler counters, for benchmarks and debugging: forward passes, rows decoded, merges that failed, ...
        self.stats: dict[str, int] = {"prefill_passes": 0, "decode_passes": 0, "decoded_rows": 0, "merges": 0,
                                      "separate_batches": 0}
        self._thread = threading.Thread(target=self._work, name="HFPolicy-worker", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------------------- public API
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> ModelTurn:
        params = params or SamplingParams()
        prompt = check_prompt_ids(prompt_ids, self.vocab_size)
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop token id(s) {bad_stop[:5]} outside the vocabulary [0, {self.vocab_size})")
        room = self.max_context_len - len(prompt)
        if room < 1:
            raise ValueError(f"the prompt is {len(prompt)} tokens: no room left in the context of "
                             f"{self.max_context_len} tokens")
        loop = asyncio.get_running_loop()
        request = _Request(prompt, params, min(params.max_new_tokens, room), loop.create_future(), loop,
                           time.perf_counter())
        with self._submit_lock:
            if self._closed:
                raise PolicyError("this HFPolicy is closed")
            if self._dead is not None:
                raise PolicyError(f"HFPolicy's worker thread died: {self._dead!r}") from self._dead
            self._queue.put(request)
        try:
            return await request.future
        except asyncio.CancelledError:
            request.cancelled = True
            raise

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
        when the trainer holds another copy (other device, wrapped module).
        """
        if model_path is not None or kwargs:
            raise NotImplementedError("HFPolicy updates weights from tensors only (named_tensors=...); it shares "
                                      "its module with the trainer, which usually makes updates unnecessary")
        if named_tensors is None:
            raise ValueError("update_weights needs named_tensors: {name: tensor} or (name, tensor) pairs")
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        await asyncio.to_thread(self._copy_weights, items)

    async def flush_cache(self) -> None:
        """Nothing to do: HFPolicy keeps no KV cache between requests."""

    async def release_memory(self) -> None:
        raise NotImplementedError("HFPolicy runs the trainer's own module: there is no separate copy of the weights "
                                  "to release (move or offload the model yourself if needed)")

    async def resume_memory(self) -> None:
        raise NotImplementedError("HFPolicy holds no released memory to resume (see release_memory)")

    def __repr__(self) -> str:
        return (f"HFPolicy({type(self.model).__name__}, max_batch_size={self.max_batch_size}, "
                f"vocab_size={self.vocab_size}, closed={self._closed})")

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
                self._done.append((request, error))
        finally:
            self._settle_done()

    def _serve_once(self) -> bool:
        """One scheduling step: take requests, admit them, decode one token for every row. False = stop."""
        if self._take_requests():
            for request in self._everyone():
                self._done.append((request, "abort"))
            return False
        self._drop_cancelled()
        self._admit()
        for batch in list(self._batches):
            self._decode(batch)
        self._settle_done()
        return True

    def _take_requests(self) -> bool:
        """Move queued requests to `_waiting`, blocking while there is nothing to do. True when close() asks to stop."""
        if not self._batches and not self._waiting:
            item = self._queue.get()
            if item is _STOP:
                return True
            self._waiting.append(item)
            deadline = time.perf_counter() + self.gather_window_s
            while len(self._waiting) < self.max_batch_size and (timeout := deadline - time.perf_counter()) > 0:
                try:
                    item = self._queue.get(timeout=timeout)
                except queue.Empty:
                    break
                if item is _STOP:
                    return True
                self._waiting.append(item)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return False
            if item is _STOP:
                return True
            self._waiting.append(item)

    def _everyone(self) -> list[_Request]:
        """All requests the worker holds or that are still queued; clears them from the worker's state."""
        requests = [r for b in self._batches for r in b.rows] + self._waiting
        self._batches, self._waiting = [], []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                requests.append(item)
        return requests

    def _drop_cancelled(self) -> None:
        self._waiting = [r for r in self._waiting if not r.cancelled]
        for batch in list(self._batches):
            if any(r.cancelled for r in batch.rows):
                self._keep_rows(batch, [i for i, r in enumerate(batch.rows) if not r.cancelled])
                if not batch.rows:
                    self._batches.remove(batch)

    def _admit(self) -> None:
        """Prefill as many waiting requests as there is room for, then merge them into a running batch."""
        room = self.max_batch_size - sum(len(b.rows) for b in self._batches)
        if room <= 0 or not self._waiting:
            return
        new, self._waiting = self._waiting[:room], self._waiting[room:]
        try:
            batch = self._prefill(new)
        except Exception as e:
            self._fail(new, "prefill", e)
            return
        if not batch.rows:
            return
        if any(self._merge(running, batch) for running in self._batches):
            self.stats["merges"] += 1
        else:
            self.stats["separate_batches"] += bool(self._batches)  # stepped in turn with another batch
            self._batches.append(batch)

    def _prefill(self, requests: list[_Request]) -> _Batch:
        device = _device(self.model)
        now = time.perf_counter()
        for r in requests:
            r.started = now
            r.generator = random.Random(r.params.seed if r.params.seed is not None else self._rng.getrandbits(63))
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
        except Exception as e:
            self._batches.remove(batch)
            self._fail(batch.rows, "decoding", e)
            return
        batch.mask = mask
        batch.positions = batch.positions + 1
        self._advance(batch, tokens, logprobs)
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
        with self._model_lock:
            if self.model.training:
                self._restore_training = True
                self.model.eval()
            out = self.model(**kwargs)
        cache = getattr(out, self._cache_arg, None)
        if cache is None:
            raise GenerationError(f"{type(self.model).__name__} returned no KV cache for use_cache=True")
        return out.logits[:, -1, :self.vocab_size].float(), cache

    def _advance(self, batch: _Batch, tokens: list[int], logprobs: list[float]) -> None:
        """Record each row's new token and retire the rows that are done."""
        keep = []
        for i, (request, token, logprob) in enumerate(zip(batch.rows, tokens, logprobs)):
            request.ids.append(token)
            request.logprobs.append(logprob)
            if token in request.params.stop_token_ids:
                self._done.append((request, "stop"))
            elif len(request.ids) >= request.max_new_tokens:
                self._done.append((request, "length"))
            elif not request.cancelled:
                keep.append(i)
        batch.next_input = torch.tensor(tokens, dtype=torch.long, device=batch.mask.device)
        if len(keep) < len(batch.rows):
            self._keep_rows(batch, keep)

    def _sample(self, logits: torch.Tensor, rows: list[_Request]) -> tuple[list[int], list[float]]:
        """Per-row sampling. Returns the tokens and ``log_softmax(logits / T)`` of each (raw logits when greedy)."""
        if torch.isnan(logits).any():
            raise GenerationError("the model produced NaN logits")
        temperature = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=logits.device)
        greedy = temperature == 0
        logprobs = torch.log_softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            tokens[index] = _draw(logprobs[index].exp(), [rows[i] for i in sampled])
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        return tokens.tolist(), chosen.tolist()

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
            self._done.append((request, error))

    def _settle_done(self) -> None:
        """Resolve finished requests; restore the module's train mode first if nothing else is running."""
        if not self._batches and not self._waiting and self._restore_training:
            self.model.train()
            self._restore_training = False
        done, self._done = self._done, []
        for request, outcome in done:
            request.settle(outcome)

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
def _draw(probs: torch.Tensor, rows: list[_Request]) -> torch.Tensor:
    """One token per row from `probs` [rows, vocab], after each row's top-k/top-p, with each row's generator."""
    vocab = probs.shape[-1]
    order = None
    if any(r.params.top_k != -1 or r.params.top_p < 1 for r in rows):
        probs, order = probs.sort(dim=-1, descending=True)
        top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in rows], device=probs.device)
        top_p = torch.tensor([r.params.top_p if r.params.top_p < 1 else float("inf") for r in rows],
                             dtype=probs.dtype, device=probs.device)
        rank = torch.arange(vocab, device=probs.device)
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs * ((rank[None, :] < top_k[:, None]) & (mass_before < top_p[:, None]))
    # Inverse-CDF sampling: one uniform number per row from the row's own generator, drawn on the host and sent in
    # one copy (a device generator per row would cost one kernel launch per row and step).
    cdf_dtype = torch.float32 if probs.device.type == "mps" else torch.float64
    cdf = probs.to(cdf_dtype).cumsum(dim=-1)
    uniform = torch.tensor([r.generator.random() for r in rows], dtype=cdf_dtype).to(probs.device, non_blocking=True)
    total = cdf[:, -1]
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    choice = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    return choice if order is None else order.gather(1, choice[:, None]).squeeze(1)


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


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _vocab_size(model: nn.Module) -> int:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and hasattr(embeddings, "num_embeddings"):
        return int(embeddings.num_embeddings)
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if size is None:
        raise TypeError(f"cannot tell the vocabulary size of {type(model).__name__}")
    return int(size)
