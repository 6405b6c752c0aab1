"""The engine's host-side decisions: which waiting sequences a prefill pass admits (with their KV blocks and the
prefix they find cached), which rows a decode step runs and the blocks they grow into, which sequences are
preempted when blocks run out, and which slot each running sequence holds.

The scheduler owns the waiting queue, the slot table and the block pool's holds; the model runner owns the
device. Admission takes waiting sequences shortest first into free slots, within a pass budget
(`config.PREFILL_TOKENS`, counted on the tokens each one must compute), keeping one free block per running row for
their growth; a pass takes rows of similar widths (new tokens), the others wait for a pass of their own. A decode
step that needs more blocks than are free preempts the newest running sequences: their blocks are released (full
ones stay cached, so a readmission often finds them) and they wait at the front of the queue; readmitted, they
prefill what they had and go on sampling where they stopped.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from .blocks import BlockPool
from . import config as knobs
from .model_runner import PrefillRow, prefill_width
from .sequence import Sequence


# --------------------------------------------------------------------------------------------- slots
def batch_buckets(max_slots: int) -> list[int]:
    """Decode batch sizes with a graph each: powers of two from 2 to 32, multiples of 32 to 256, then of 64, and
    `max_slots` itself (at most 32 padding rows up to 256, at most 64 beyond). A single row runs in a batch of 2:
    the step costs the same, and dynamo would compile a batch of one as a case of its own."""
    if max_slots < 1:
        raise ValueError(f"max_slots must be >= 1, got {max_slots}")
    sizes = [2, 4, 8, 16, 32, *range(64, 257, 32), *range(320, max_slots + 1, 64)]
    return sorted({s for s in sizes if s < max_slots} | {max_slots})


def bucket_for(n: int, buckets: Seq[int]) -> int:
    """The smallest bucket holding `n` rows (0 rows: 0)."""
    if n == 0:
        return 0
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} rows exceed the largest bucket {buckets[-1]}")


class SlotTable:
    """Which row holds which slot (host side).

    Invariants (property-tested): a row holds at most one slot; `acquire` hands out the lowest free slots; after
    `compact`, every row lies below ``bucket_for(count)``, rows that did not move keep their slots, and no row is
    lost.
    """

    def __init__(self, size: int):
        self.buckets = batch_buckets(size)
        self._rows: list[Any] = [None] * size

    @property
    def size(self) -> int:
        return len(self._rows)

    def occupied(self) -> list[tuple[int, Any]]:
        """(slot, row) of every held slot, by slot."""
        return [(slot, row) for slot, row in enumerate(self._rows) if row is not None]

    def free_count(self) -> int:
        return self._rows.count(None)

    def held_count(self) -> int:
        return len(self._rows) - self._rows.count(None)

    def acquire(self, rows: Seq[Any]) -> list[int]:
        """Give each of `rows` one of the lowest free slots; returns the slots in row order."""
        free = [slot for slot, row in enumerate(self._rows) if row is None][:len(rows)]
        if len(free) < len(rows):
            raise ValueError(f"{len(rows)} rows but only {len(free)} free slots")
        for slot, row in zip(free, rows):
            self._rows[slot] = row
        return free

    def release(self, slots: Seq[int]) -> None:
        for slot in slots:
            if self._rows[slot] is None:
                raise ValueError(f"slot {slot} is not held")
            self._rows[slot] = None

    def bucket(self) -> int:
        """The batch bucket a decode step needs: it covers the highest held slot (0 when none is held)."""
        top = next((slot for slot in range(len(self._rows) - 1, -1, -1) if self._rows[slot] is not None), -1)
        return bucket_for(top + 1, self.buckets)

    def compact(self) -> list[tuple[int, int]]:
        """Move rows held above the bucket their count needs into the lowest free slots below it; returns the
        (from, to) moves, already applied here (the caller moves the per-slot state)."""
        target = bucket_for(self.held_count(), self.buckets)
        if self.bucket() <= target:
            return []
        free = [slot for slot in range(target) if self._rows[slot] is None]
        above = [slot for slot in range(target, len(self._rows)) if self._rows[slot] is not None]
        moves = list(zip(above, free))
        for src, dst in moves:
            self._rows[dst], self._rows[src] = self._rows[src], None
        return moves


# --------------------------------------------------------------------------------------------- passes
def one_prefill_pass_takes(rows: int, longest: int, max_context_len: int) -> bool:
    """Whether one prefill pass takes `rows` prompts whose longest has `longest` tokens (counting them whole, as if
    nothing were cached)."""
    return rows <= 1 or rows * prefill_width(longest, max_context_len) <= knobs.PREFILL_TOKENS


def widths_match(narrowest: int, widest: int) -> bool:
    """Whether rows whose own widths (new tokens, padded alone) range from `narrowest` to `widest` go in one prefill
    pass: the widest at most `PREFILL_WIDTH_RATIO` times the narrowest, counting rows narrower than
    `PREFILL_WIDTH_FLOOR` as that wide (a few narrow rows cost a pass's launches more than their padding)."""
    return widest <= knobs.PREFILL_WIDTH_RATIO * max(narrowest, knobs.PREFILL_WIDTH_FLOOR)


@dataclass(eq=False)
class Prefill:
    """A prefill pass: sequences admitted into slots, with the blocks this pass allocated for them."""

    seqs: list[Sequence]
    rows: list[PrefillRow]
    new_blocks: list[int]


@dataclass(eq=False)
class Decode:
    """A decode step: the (slot, sequence) rows it decodes, the batch bucket, what it attends to, and the new
    block-table entries (slot, column, block) of rows entering a new block."""

    rows: list[tuple[int, Sequence]]
    bucket: int
    need: int
    uniforms: list[float] | None
    mode: int
    table_updates: list[tuple[int, int, int]]


class Scheduler:
    """Waiting and running sequences, their slots and their KV blocks (see the module docstring)."""

    def __init__(self, pool: BlockPool, max_seqs: int, max_context_len: int, stats: dict):
        self.pool, self.max_context_len, self.stats = pool, max_context_len, stats
        self.slots = SlotTable(max_seqs)
        self.waiting: deque[Sequence] = deque()
        self.finished: list[Sequence] = []
        self._order: dict[Sequence, int] = {}  #: admission order of the running: the newest are preempted first
        self._admitted = 0

    @property
    def running(self) -> list[Sequence]:
        return [seq for _, seq in self.slots.occupied()]

    def busy(self) -> bool:
        return bool(self.waiting or self.slots.held_count())

    # ------------------------------------------------------------------------------------- admission
    def admit(self) -> Prefill | None:
        """The next prefill pass: waiting sequences (shortest first) with the blocks they need — the cached prefix
        acquired, the rest allocated and its full prompt blocks registered at once, so that a later member of the
        same group finds them (this pass writes them before any row reads them) — within the pass budget,
        leaving a block of growth per running row, and passing over rows whose width does not match the pass's
        (`widths_match`); None when none can be admitted now."""
        room = self.slots.free_count()
        if not self.waiting or room == 0:
            return None
        candidates = sorted(list(self.waiting)[:room], key=lambda seq: seq.length)
        admitted: list[Sequence] = []
        new_blocks: list[int] = []
        widest, narrowest = 0, self.max_context_len
        for seq in candidates:
            tokens = seq.tokens
            cached = self.pool.match(tokens, seq.length - 1, seq.matched)
            seq.matched = [self.pool.identity(block) for block in cached]
            start = len(cached) * self.pool.block_size
            partial, held = self.pool.match_partial(tokens, cached[-1] if cached else None, start, seq.length - 1)
            width = prefill_width(seq.length - start - held, self.max_context_len)
            if admitted and (len(admitted) + 1) * max(widest, width) > knobs.PREFILL_TOKENS:
                break
            if admitted and not widths_match(min(narrowest, width), max(widest, width)):
                continue  # it waits for a pass nearer its width
            needed = self.pool.blocks_for(seq.length) - len(cached) - bool(held)
            revived = sum(1 for block in cached if self.pool.refs[block] == 0) + bool(held)  # off the LRU
            reserve = self.slots.held_count() + len(admitted) + 1
            if self.pool.blocks_for(seq.length) + 1 > self.pool.num_blocks - 1:  # it could never run
                self._fail_too_long(seq)
                continue
            if self.pool.available - revived - needed < reserve:
                break
            self.pool.acquire(cached)
            if held:
                self.pool.take(partial)
            fresh = self.pool.allocate(needed)
            seq.blocks = cached + ([partial] if held else []) + fresh
            seq.cached, seq.fed = start + held, seq.length
            seq.indexed = self.pool.register(seq.blocks, tokens, seq.length, start=self.pool.chain_after(cached))
            new_blocks += fresh
            admitted.append(seq)
            widest, narrowest = max(widest, width), min(narrowest, width)
        if not admitted:
            return None
        chosen = set(admitted)
        self.waiting = deque(seq for seq in self.waiting if seq not in chosen)
        slots = self.slots.acquire(admitted)
        now = time.perf_counter()
        for seq, slot in zip(admitted, slots):
            seq.slot = slot
            seq.started = seq.started or now
            self._order[seq] = self._admitted
            self._admitted += 1
            self.stats["prefilled_tokens"] += seq.length - seq.cached
            self.stats["cached_tokens"] += seq.cached
        rows = [PrefillRow(slot, seq.blocks, seq.tokens, seq.cached) for slot, seq in zip(slots, admitted)]
        return Prefill(admitted, rows, new_blocks)

    def _fail_too_long(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        seq.outcome = ValueError(f"a sequence of {seq.length} tokens needs {self.pool.blocks_for(seq.length)} KV "
                                 f"blocks; the pool has {self.pool.num_blocks - 1}: raise kv_blocks / kv_cache_gib")
        self.finished.append(seq)

    def prefill_failed(self, prefill: Prefill, error: BaseException) -> list[int]:
        """A pass that raised: its sequences fail, its slots and blocks are released (the blocks it allocated
        unregistered: their KV is not what their keys say); returns the blocks whose KV must be zeroed."""
        self.pool.forget(prefill.new_blocks)
        self.finish(prefill.seqs, error)
        return prefill.new_blocks

    # ------------------------------------------------------------------------------------- decode
    def compact(self) -> list[tuple[int, int]]:
        """Move the running rows held above the bucket their count needs into free slots below it (the caller moves
        their per-slot state); returns the (from, to) moves."""
        moves = self.slots.compact()
        rows = dict(self.slots.occupied())
        for _, dst in moves:
            rows[dst].slot = dst
        return moves

    def plan_decode(self, ahead: set[Sequence]) -> Decode | None:
        """The next decode step over every running row that asks for a token (a row in `ahead` has one more token
        in flight than recorded), with the block each row entering a new block gets; None when no row asks, or
        when the blocks run short (`preempt` first)."""
        bucket, bs = self.slots.bucket(), self.pool.block_size
        rows = self.slots.occupied()
        asking = [(slot, seq) for slot, seq in rows if len(seq.ids) + (seq in ahead) < seq.max_new_tokens]
        if not asking:
            return None
        growing = [(slot, seq) for slot, seq in asking if seq.fed == len(seq.blocks) * bs]
        if len(growing) > self.pool.available:  # before any row draws: a preemption must not move a generator
            raise _ShortOfBlocks(len(growing) - self.pool.available)
        uniforms, need, mode, updates = None, 0, 0, []
        for slot, seq in asking:  # per step and row: keep it lean
            if seq.fed >= need:
                need = seq.fed + 1  # it attends to its positions up to the one it writes now
            seq.fed += 1
            if seq.mode:
                if uniforms is None:
                    uniforms = [0.0] * bucket
                uniforms[slot] = seq.generator.random()  # the row's next draw, whenever the step runs
                if seq.mode > mode:
                    mode = seq.mode
        for slot, seq in growing:
            (block,) = self.pool.allocate(1)
            updates.append((slot, len(seq.blocks), block))
            seq.blocks.append(block)
        return Decode(rows, bucket, need, uniforms, mode, updates)

    def preempt(self) -> int | None:
        """Take the newest running sequence off the device (never the only one): its blocks are released (its
        written full blocks stay cached) and it waits at the front of the queue; returns its slot, or None."""
        running = self.running
        if len(running) < 2:
            return None
        seq = max(running, key=self._order.__getitem__)
        (slot,) = self.release([seq])
        seq.fed, seq.cached = 0, 0
        seq.preemptions += 1
        self.waiting.appendleft(seq)
        self.stats["preemptions"] += 1
        return slot

    # ------------------------------------------------------------------------------------- outcomes
    def record(self, seqs: Seq[Sequence], tokens: Seq[int], logprobs: Seq[float]) -> list[int]:
        """Append each sequence's token (those that ended since their step was launched are skipped); finish the
        ones that are done; returns the slots released."""
        done = []
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            if not (seq.finished or seq.withdrawn or seq.record(token, logprob)):
                done.append(seq)
        return self.finish(done)

    def finish(self, seqs: Seq[Sequence], error: BaseException | None = None) -> list[int]:
        """Release running sequences that are done, withdrawn (``"abort"``) or failed (`error`: their blocks are
        not registered); returns their slots."""
        slots = self.release(seqs, register=error is None)
        for seq in seqs:
            if error is not None:
                seq.outcome = error
            elif seq.outcome is None:
                seq.outcome = "abort"
            self.finished.append(seq)
        return slots

    def release(self, seqs: Seq[Sequence], register: bool = True) -> list[int]:
        """Give back the sequences' slots and blocks (`register`: their written full blocks stay cached); returns
        the slots."""
        slots = []
        for seq in seqs:
            if register:
                self.pool.register(seq.blocks, seq.tokens, min(seq.fed, seq.length), partial=True, start=seq.indexed)
            self.pool.release(seq.blocks)
            seq.blocks, seq.indexed = [], None
            slots.append(seq.slot)
            seq.slot = None
            self._order.pop(seq, None)
        self.slots.release(slots)
        return slots

    def drop_withdrawn(self) -> list[int]:
        """Finish the sequences their callers withdrew (``"abort"``); returns the slots released."""
        for seq in [seq for seq in self.waiting if seq.withdrawn]:
            self.waiting.remove(seq)
            seq.outcome = "abort"
            self.finished.append(seq)
        return self.finish([seq for seq in self.running if seq.withdrawn])

    def take_finished(self) -> list[Sequence]:
        finished, self.finished = self.finished, []
        return finished


class _ShortOfBlocks(Exception):
    """A decode step needs `missing` more blocks than are available: preempt first."""

    def __init__(self, missing: int):
        super().__init__(f"{missing} KV blocks short")
        self.missing = missing
