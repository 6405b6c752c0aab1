"""`Engine`: many sequences served together by one module, over paged KV with a prefix cache.

One thread drives it: `add` sequences, then `step` while `busy()`; each step is a prefill pass for sequences that
can be admitted, else a decode step for every running row, and returns the sequences that finished. The module is
the caller's (the trainer's own, no copy): new weights are noticed before each prefill pass, and the prefix cache
is dropped with them.

    >>> import torch, transformers
    >>> from agents.engine import Engine, EngineConfig, Sequence
    >>> from agents.backend import SamplingParams
    >>> torch.manual_seed(0) and None
    >>> config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
    ...                                   num_key_value_heads=1, intermediate_size=64)
    >>> engine = Engine(transformers.Qwen2ForCausalLM(config), EngineConfig(max_seqs=4, max_context_len=64))
    >>> seq = Sequence([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=5), max_new_tokens=5)
    >>> engine.add(seq)
    >>> while engine.busy():
    ...     done = engine.step()
    >>> len(seq.ids), seq.outcome
    (5, 'length')
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass

from torch import nn

from ..backend import GenerationError
from .blocks import BlockPool
from .config import EngineConfig
from .layout import decoder_layout
from .model_runner import RUNNER_COUNTERS, LaunchedStep, ModelRunner
from .sampler import SAMPLING_MODES, RowSampling
from .scheduler import Decode, Prefill, Scheduler, _ShortOfBlocks
from .sequence import Sequence


def new_stats() -> dict[str, int | float]:
    """The engine's counters, all zero (see docs/engine.md for each): passes, rows, tokens prefilled and found
    cached, preemptions, the model runner's graph and compilation counts, and seconds."""
    counts = ("prefill_passes", "decode_passes", "decoded_rows", "padded_rows", "wasted_rows", "compaction_moves",
              "prefilled_tokens", "cached_tokens", "preemptions", "evictions", "peak_blocks", "merges",
              "separate_batches", *RUNNER_COUNTERS)
    seconds = ("compile_s", "busy_s", "gather_s", "prefill_s", "launch_s", "step_wait_s")
    return dict.fromkeys(counts, 0) | dict.fromkeys(seconds, 0.0)


@dataclass(eq=False)
class _InFlight:
    """A decode step launched and not yet collected, with the (slot at launch, sequence) rows it decodes."""

    step: LaunchedStep
    rows: list[tuple[int, Sequence]]


class Engine:
    """The paged engine for a Llama-family module (`layout.decoder_layout`); see the module docstring.

    `vocab_size`: sample only ids below it (default the embedding's size). `seed` seeds the generators of
    sequences that come without `SamplingParams.seed`. `stats`: a counter dict to add to (default `new_stats()`).
    """

    def __init__(self, model: nn.Module, config: EngineConfig = EngineConfig(), *, vocab_size: int | None = None,
                 seed: int | None = None, stats: dict | None = None):
        layout = decoder_layout(model)
        positions = getattr(model.config, "max_position_embeddings", None) or 2**31 - 1
        self.max_context_len = min(config.max_context_len or positions, positions)
        self.config = config = dataclasses.replace(config, max_context_len=self.max_context_len)
        self.model = model
        self.vocab_size = vocab_size or layout.embed.num_embeddings
        self.stats = stats if stats is not None else new_stats()
        for key, value in new_stats().items():
            self.stats.setdefault(key, value)
        probe = ModelRunner(model, layout, config, max_context_len=self.max_context_len, num_blocks=2,
                            vocab_size=self.vocab_size, stats=self.stats)
        blocks = config.pool_blocks(probe.bytes_per_token())
        self.runner = ModelRunner(model, layout, config, max_context_len=self.max_context_len, num_blocks=blocks,
                                  vocab_size=self.vocab_size, stats=self.stats)
        self.pool = BlockPool(blocks, config.block_size, config.prefix_cache)
        self.scheduler = Scheduler(self.pool, config.max_seqs, self.max_context_len, self.stats)
        self._rng = random.Random(seed)
        self._in_flight: _InFlight | None = None

    # ------------------------------------------------------------------------------------- API
    def add(self, seq: Sequence) -> None:
        """Queue `seq` (its prompt must leave room in the context: `max_new_tokens` is capped to it)."""
        seq.fit(self.max_context_len, self._rng)
        self.scheduler.waiting.append(seq)

    def busy(self) -> bool:
        return self.scheduler.busy() or self._in_flight is not None

    @property
    def waiting(self):
        """The sequences waiting for admission, in order."""
        return self.scheduler.waiting

    def running(self) -> int:
        """Sequences holding a decode row."""
        return self.scheduler.slots.held_count()

    def room(self) -> int:
        """Decode rows free for new sequences."""
        return self.scheduler.slots.free_count()

    def sync(self) -> None:
        """Collect the decode step in flight (its tokens are recorded; sequences it finished come with the next
        `step`): nothing runs on the device after this until the next call."""
        self._collect(self._take_in_flight())

    def step(self) -> list[Sequence]:
        """One pass: a prefill for waiting sequences that can be admitted, else a decode step (launched before the
        previous one is collected). Returns the sequences that finished (their `outcome` set)."""
        self.runner.free(self.scheduler.drop_withdrawn())
        prefill = self._admit()
        if prefill is not None:
            self._prefill(prefill)
        else:
            self._decode()
        return self.scheduler.take_finished()

    def abort(self) -> list[Sequence]:
        """End every sequence (``"abort"``, with what it sampled so far, the step in flight included)."""
        self._collect(self._take_in_flight())
        s = self.scheduler
        waiting, s.waiting = list(s.waiting), type(s.waiting)()
        for seq in waiting:
            seq.outcome = seq.outcome or "abort"
        self.runner.free(s.finish(s.running))
        return s.take_finished() + waiting

    def flush(self) -> None:
        """Forget the cached prefixes (their KV was computed with other weights)."""
        self.pool.clear()

    def release(self) -> None:
        """Free the device memory (KV pool, graphs); refused while sequences run."""
        if self.busy():
            raise GenerationError(f"cannot release memory while {len(self.scheduler.running)} sequence(s) run")
        self.pool.clear()
        self.runner.release()

    # ------------------------------------------------------------------------------------- prefill
    def _admit(self) -> Prefill | None:
        if not self.scheduler.waiting or not self.scheduler.slots.free_count():
            return None
        try:
            if self.runner.check_module(busy=bool(self.scheduler.running)):
                self.pool.clear()  # new weights: no cached KV is valid
        except Exception as e:  # the module moved while rows decode: the waiting cannot start
            waiting = self.scheduler.waiting
            for seq in waiting:
                seq.outcome = _failure("prefill", len(waiting), e)
            self.scheduler.finished += waiting
            waiting.clear()
            return None
        return self.scheduler.admit()

    def _prefill(self, prefill: Prefill) -> None:
        seqs = prefill.seqs
        sampling = RowSampling.draw([s.params for s in seqs], [s.generator for s in seqs], self.vocab_size)
        start = time.perf_counter()
        try:
            tokens, logprobs = self.runner.prefill(prefill.rows, sampling)
            _check_finite(logprobs)
        except Exception as e:
            zero = self.scheduler.prefill_failed(prefill, _failure("prefill", len(seqs), e))
            self.runner.free([row.slot for row in prefill.rows], zero_blocks=zero)
            return
        finally:
            self.stats["prefill_s"] += time.perf_counter() - start
        self.stats["prefill_passes"] += 1
        self._note_blocks()
        self.runner.free(self.scheduler.record(seqs, tokens, logprobs))

    # ------------------------------------------------------------------------------------- decode
    def _decode(self) -> None:
        """Launch the next decode step, then collect the one launched before it (without `overlap_steps`: launch
        one and collect it)."""
        previous = self._take_in_flight()
        moves = self.scheduler.compact()
        if moves:
            self.runner.move(moves)
            self.stats["compaction_moves"] += len(moves)
        plan, previous = self._plan(previous)
        if plan is None:
            self._collect(previous)
            return
        start = time.perf_counter()
        try:
            step = self.runner.launch(plan.bucket, plan.need, plan.uniforms, SAMPLING_MODES[plan.mode],
                                      plan.table_updates)
        except Exception as e:
            self._collect(previous)
            self._fail_running("decoding", e)
            return
        self.stats["launch_s"] += time.perf_counter() - start
        self.stats["decode_passes"] += 1
        self.stats["padded_rows"] += plan.bucket - len(plan.rows)
        self._note_blocks()
        launched = _InFlight(step, plan.rows)
        if self.config.overlap_steps:
            self._in_flight = launched
            self._collect(previous)
        else:
            self._collect(previous)
            self._collect(launched)

    def _plan(self, previous: _InFlight | None) -> tuple[Decode | None, _InFlight | None]:
        """The next step's plan, and the step still in flight. When blocks run short, the step in flight is
        collected first (it may finish rows, freeing theirs), then the newest sequences are preempted until the
        step fits."""
        while True:
            try:
                ahead = {seq for _, seq in previous.rows} if previous is not None else set()
                return self.scheduler.plan_decode(ahead), previous
            except _ShortOfBlocks:
                if previous is not None:
                    self._collect(previous)
                    previous = None
                    continue
                slot = self.scheduler.preempt()
                if slot is None:
                    self._fail_running("decoding", GenerationError(
                        f"one sequence needs more KV blocks than the pool's {self.pool.num_blocks - 1}"))
                    return None, None
                self.runner.free([slot])

    def _collect(self, launched: _InFlight | None) -> None:
        """Record a launched step's tokens for its rows that are still decoding, and retire those that are done."""
        if launched is None:
            return
        start = time.perf_counter()
        seqs = [seq for _, seq in launched.rows]
        try:
            tokens, logprobs = self.runner.collect(launched.step)
            self.stats["step_wait_s"] += time.perf_counter() - start
            tokens, logprobs = [tokens[s] for s, _ in launched.rows], [logprobs[s] for s, _ in launched.rows]
            _check_finite([lp for seq, lp in zip(seqs, logprobs) if not (seq.finished or seq.withdrawn)])
        except Exception as e:
            self._fail_running("decoding", e)
            return
        wasted = sum(seq.finished or seq.withdrawn for seq in seqs)
        self.stats["decoded_rows"] += len(seqs) - wasted
        self.stats["wasted_rows"] += wasted
        self.runner.free(self.scheduler.record(seqs, tokens, logprobs))

    def _take_in_flight(self) -> _InFlight | None:
        launched, self._in_flight = self._in_flight, None
        return launched

    def _fail_running(self, phase: str, error: Exception) -> None:
        """Every running sequence fails with `error`; blocks no longer held by anyone are zeroed."""
        running = self.scheduler.running
        held = {block for seq in running for block in seq.blocks}
        slots = self.scheduler.finish(running, _failure(phase, len(running), error))
        self.runner.free(slots, zero_blocks=[b for b in held if self.pool.refs[b] == 0])

    def _note_blocks(self) -> None:
        self.stats["peak_blocks"] = max(self.stats["peak_blocks"], self.pool.held)
        self.stats["evictions"] = self.pool.evictions


def _check_finite(logprobs: list[float]) -> None:
    if any(lp != lp for lp in logprobs):
        raise GenerationError("the model produced NaN logits")


def _failure(phase: str, rows: int, exc: Exception) -> GenerationError:
    if isinstance(exc, GenerationError) and str(exc).startswith("the engine:"):
        return exc
    error = GenerationError(f"the engine: the model raised during {phase} of a batch of {rows} request(s): "
                            f"{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error

