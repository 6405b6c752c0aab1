"""`TransformersEngine`: the fallback for modules the paged engine's layer loop does not serve (other architectures,
sliding-window layers, quantization, offloading), with the same interface as `agents.engine.Engine`.

It runs the module's own forward over a ``DynamicCache``: prompts left-padded into one tensor with an attention
mask and per-row position ids; rows that join are prefilled together, then merged into the running batch by
left-padding the shorter KV cache (plain full-attention ``DynamicLayer`` caches only; others form a second batch
stepped in turn); when rows leave, cache columns that are padding for every remaining row are cut off. No prefix
cache: every request prefills its whole prompt.
"""

from __future__ import annotations

import inspect
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..backend import GenerationError
from .layout import module_device
from .sampler import RowSampling, sample_tokens
from .sequence import Sequence


@dataclass(eq=False)
class _Batch:
    """Rows decoded together. Row i's KV cache is row i of `cache`; `mask` marks its real (non-padding) columns."""

    rows: list[Sequence]
    cache: Any
    mask: torch.Tensor  #: [rows, cache length], 1 = real token
    positions: torch.Tensor  #: [rows], the position id of each row's next input token
    next_input: torch.Tensor | None = None  #: [rows], the token each row feeds next (its last sampled one)


class TransformersEngine:
    """Continuous batching with the module's own forward (see the module docstring); `Engine`'s interface."""

    def __init__(self, model: nn.Module, *, max_seqs: int, max_context_len: int, vocab_size: int, pad_token_id: int,
                 seed: int | None, stats: dict):
        self.model, self.max_seqs, self.max_context_len = model, max_seqs, max_context_len
        self.vocab_size, self.pad_token_id, self.stats = vocab_size, pad_token_id, stats
        self._cache_arg, self._keep_last_logits = _forward_arguments(model)
        self._rng = random.Random(seed)
        self.waiting: deque[Sequence] = deque()
        self._batches: list[_Batch] = []
        self._finished: list[Sequence] = []

    # ------------------------------------------------------------------------------------- Engine's interface
    def add(self, seq: Sequence) -> None:
        seq.fit(self.max_context_len, self._rng)
        self.waiting.append(seq)

    def busy(self) -> bool:
        return bool(self._batches or self.waiting)

    def running(self) -> int:
        return sum(len(b.rows) for b in self._batches)

    def room(self) -> int:
        return self.max_seqs - self.running()

    def step(self) -> list[Sequence]:
        self._drop_withdrawn()
        self._admit()
        for batch in list(self._batches):
            self._decode(batch)
        finished, self._finished = self._finished, []
        return finished

    def abort(self) -> list[Sequence]:
        everyone = [r for b in self._batches for r in b.rows] + list(self.waiting)
        self._batches, self.waiting = [], deque()
        for seq in everyone:
            seq.outcome = seq.outcome or "abort"
        finished, self._finished = self._finished + everyone, []
        return finished

    def sync(self) -> None:
        """Nothing is ever in flight here."""

    def flush(self) -> None:
        """No prefix cache to forget."""

    def release(self) -> None:
        """Nothing is held between requests."""

    # ------------------------------------------------------------------------------------- passes
    def _admit(self) -> None:
        """Prefill as many waiting requests as there is room for, then merge them into a running batch."""
        room = self.room()
        if room <= 0 or not self.waiting:
            return
        new = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
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

    def _prefill(self, seqs: list[Sequence]) -> _Batch:
        device = module_device(self.model)
        now = time.perf_counter()
        for seq in seqs:
            seq.started = seq.started or now
        width = max(len(s.prompt) for s in seqs)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(s.prompt)) + s.prompt for s in seqs],
                                 dtype=torch.long, device=device)
        mask = torch.tensor([[0] * (width - len(s.prompt)) + [1] * len(s.prompt) for s in seqs],
                            dtype=torch.long, device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits, cache = self._forward(input_ids, mask, positions, cache=None)
        self.stats["prefill_passes"] += 1
        self.stats["prefilled_tokens"] += sum(len(s.prompt) for s in seqs)
        tokens, logprobs = self._sample(logits, seqs)
        lengths = torch.tensor([len(s.prompt) for s in seqs], dtype=torch.long, device=device)
        batch = _Batch(list(seqs), cache, mask, lengths)
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
        out = self.model(**kwargs)
        cache = getattr(out, self._cache_arg, None)
        if cache is None:
            raise GenerationError(f"{type(self.model).__name__} returned no KV cache for use_cache=True")
        return out.logits[:, -1, :self.vocab_size].float(), cache

    def _advance(self, batch: _Batch, tokens: list[int], logprobs: list[float]) -> None:
        """Record each row's new token and retire the rows that are done."""
        if any(lp != lp for lp in logprobs):
            raise GenerationError("the model produced NaN logits")
        keep = []
        for i, (seq, token, logprob) in enumerate(zip(batch.rows, tokens, logprobs)):
            if seq.record(token, logprob):
                keep.append(i)
            else:
                self._finish(seq)
        batch.next_input = torch.tensor(tokens, dtype=torch.long, device=batch.mask.device)
        if len(keep) < len(batch.rows):
            self._keep_rows(batch, keep)

    def _sample(self, logits: torch.Tensor, rows: list[Sequence]) -> tuple[list[int], list[float]]:
        sampling = RowSampling.draw([r.params for r in rows], [r.generator for r in rows], self.vocab_size)
        tokens, logprobs = sample_tokens(logits, *sampling.tensors(logits.device), sampling.mode)
        return tokens.tolist(), logprobs.tolist()

    # ------------------------------------------------------------------------------------- cache surgery
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
        if len(running.rows) + len(new.rows) > self.max_seqs:
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

    # ------------------------------------------------------------------------------------- outcomes
    def _drop_withdrawn(self) -> None:
        for seq in [s for s in self.waiting if s.withdrawn]:
            self.waiting.remove(seq)
            self._finish(seq)
        for batch in list(self._batches):
            if any(r.withdrawn for r in batch.rows):
                for seq in (r for r in batch.rows if r.withdrawn):
                    self._finish(seq)
                self._keep_rows(batch, [i for i, r in enumerate(batch.rows) if not r.withdrawn])
                if not batch.rows:
                    self._batches.remove(batch)

    def _fail(self, seqs: list[Sequence], phase: str, exc: Exception) -> None:
        message = (f"the engine: the model raised during {phase} of a batch of {len(seqs)} request(s): "
                   f"{type(exc).__name__}: {exc}")
        for seq in seqs:
            error = GenerationError(message)
            error.__cause__ = exc
            seq.outcome = error
            self._finished.append(seq)

    def _finish(self, seq: Sequence) -> None:
        if seq.outcome is None:
            seq.outcome = "abort"
        self._finished.append(seq)


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
