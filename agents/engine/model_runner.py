"""The device side of the engine: the paged KV cache, the per-slot decode buffers, and the passes over them.

A *slot* is a row of the decode batch: its next token, position, sampling parameters and block table live in
per-slot device buffers, so that a decode step needs nothing from the host but one uniform number per sampled row
(and the few block-table entries of rows that enter a new block). The host (`Scheduler`) decides which sequence
holds which slot and which blocks.

A decode step is **launched** (`launch`: inputs and output copies asynchronous, through pinned host buffers; an
event marks the outputs ready) and **collected** later (`collect`), so the engine launches step t+1 before it reads
step t's tokens. Steps, prefill passes, frees and moves run in launch order on one stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import exact
from ..backend import GenerationError
from ..compiling import COMPILE_COUNTS, Compiled, compiled, progress
from .attention import flat_positions, prefill_inputs
from .blocks import NULL_BLOCK
from . import config as knobs
from .config import EngineConfig
from .graphs import CudaGraphs
from .layers import COMPILED_FUNCTIONS, LAYER_FUNCTIONS, STEP_FUNCTIONS, RoutedLayer
from .layout import DecoderLayout, kv_dtype, module_device
from .sampler import RowSampling, cdf_dtype, sample_tokens, to_device

#: the counters a `ModelRunner` adds to its engine's stats
RUNNER_COUNTERS = ("prefill_padded_tokens", "graph_captures", "graph_replays", "stand_in_replays",
                   "uncaptured_steps", "prefill_graph_captures", "prefill_graph_replays", "module_reallocations",
                   "compilations", "compile_s", "capture_failures")


@dataclass
class _DeviceState:
    """Device tensors: the KV pool of every layer and one entry per slot of the decode buffers (plus one spare entry,
    never a row's: a step's views of the first `rows` entries then never span a whole buffer, which dynamo would
    compile as a case of its own)."""

    key_cache: torch.Tensor  #: [layers, blocks * block_size, kv_heads, head_dim]
    value_cache: torch.Tensor
    table: torch.Tensor  #: int32 [slots + 1, max blocks per sequence]: each slot's block table
    tokens: torch.Tensor  #: long: the token each slot feeds next
    lengths: torch.Tensor  #: long: the position of that token (= KV positions before it)
    live: torch.Tensor  #: bool: the slot holds a row (free slots do not advance)
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    uniform: torch.Tensor  #: this step's uniform number per slot
    out: torch.Tensor  #: float64 [slots + 1, 2]: sampled token, its logprob
    host: tuple[_HostSide, _HostSide]  #: host buffers of the two steps that may be in flight (even, odd launches)
    launches: int = 0
    keys: list[torch.Tensor] = field(init=False)  #: each layer's view of `key_cache`
    values: list[torch.Tensor] = field(init=False)
    per_slot: tuple[torch.Tensor, ...] = field(init=False)

    def __post_init__(self):
        self.keys, self.values = list(self.key_cache.unbind(0)), list(self.value_cache.unbind(0))
        self.per_slot = (self.tokens, self.lengths, self.live, self.temperature, self.top_k, self.top_p, self.table)


@dataclass(eq=False)
class _HostSide:
    """Host memory of one launched step (pinned on CUDA, so that its copies are asynchronous): the uniform numbers
    and block-table entries it uploads, the outputs it copies back, and the event that marks them ready."""

    uniform: torch.Tensor  #: [slots + 1], `cdf_dtype`
    table_updates: torch.Tensor  #: int32 [slots + 1, 3]: slot, column, block of each new table entry
    out: torch.Tensor  #: float64 [slots + 1, 2]
    event: Any  #: torch.cuda.Event on CUDA, else None (a step on the CPU is done when `launch` returns)
    step: LaunchedStep | None = None  #: the step using these buffers, until it is collected

    @classmethod
    def create(cls, slots: int, device: torch.device) -> _HostSide:
        pinned = device.type == "cuda"
        return cls(torch.zeros(slots, dtype=cdf_dtype(device), pin_memory=pinned),
                   torch.zeros(slots, 3, dtype=torch.int32, pin_memory=pinned),
                   torch.zeros(slots, 2, dtype=torch.float64, pin_memory=pinned),
                   torch.cuda.Event() if pinned else None)


@dataclass(eq=False)
class LaunchedStep:
    """A decode step enqueued by `ModelRunner.launch`; `ModelRunner.collect` reads its outputs."""

    rows: int
    host: _HostSide
    collected: bool = False


@dataclass(frozen=True)
class PrefillRow:
    """One sequence of a prefill pass: its slot, its block table, all its tokens and how many lead ones are cached."""

    slot: int
    blocks: Sequence[int]
    tokens: Sequence[int]
    cached: int


class ModelRunner:
    """The paged KV cache, prefill, and the (graph-captured) decode step for one module.

    `stats` is the engine's counter dict: this adds `RUNNER_COUNTERS` (``compilations`` and ``compile_s``: those
    this runner's passes triggered)."""

    def __init__(self, model: nn.Module, layout: DecoderLayout, config: EngineConfig, *, max_context_len: int,
                 num_blocks: int, vocab_size: int, stats: dict):
        self.model, self.layout, self.config = model, layout, config
        self.max_context_len, self.num_blocks, self.vocab_size = max_context_len, num_blocks, vocab_size
        self.block_size, self.slots = config.block_size, config.max_seqs
        self.stats = stats
        for key in RUNNER_COUNTERS:
            stats.setdefault(key, 0)
        device = module_device(model)
        self.exact = config.exact
        if self.exact:  # the trainer's choice too (`exact.compiles_layers`): its layers compiled, nothing else
            self.compiles, chosen, compile_fn = exact.compiles_layers(device), LAYER_FUNCTIONS, RoutedLayer
        else:
            self.compiles = config.compile is True or (config.compile == "auto" and device.type == "cuda")
            chosen, compile_fn = COMPILED_FUNCTIONS, compiled
        self.kernel = "exact" if self.exact else _attention_kernel(config.attention, device, layout.head_dim)
        self._functions = {fn.__name__: compile_fn(fn) if self.compiles and fn in chosen else fn
                           for fn in COMPILED_FUNCTIONS}
        self._step_functions = tuple(self._functions[fn.__name__] for fn in STEP_FUNCTIONS)
        self.graphs = CudaGraphs(device, stats) if config.cuda_graphs and device.type == "cuda" else None
        self._state: _DeviceState | None = None
        self._module_key: tuple | None = None  #: (device, dtype, parameter addresses) the cache and graphs are for
        self._weights: int | None = None  #: the parameters' version counters' sum when last checked

    # ------------------------------------------------------------------------------------- memory
    @property
    def allocated(self) -> bool:
        return self._state is not None

    def bytes_per_token(self) -> int:
        lay = self.layout
        return 2 * len(lay.layers) * lay.kv_heads * lay.head_dim * torch.empty(0, dtype=kv_dtype(lay)).element_size()

    def cache_bytes(self) -> int:
        """Size of the KV pool when allocated."""
        return self.num_blocks * self.block_size * self.bytes_per_token()

    def allocate(self) -> None:
        """Create the KV pool and the slot buffers (a no-op when they exist)."""
        if self._state is not None:
            return
        self.check_module(busy=False)
        device, dtype, lay, n = module_device(self.model), kv_dtype(self.layout), self.layout, self.slots
        shape = (len(lay.layers), self.num_blocks * self.block_size, lay.kv_heads, lay.head_dim)
        try:
            keys, values = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        except torch.cuda.OutOfMemoryError as e:
            raise GenerationError(f"the KV cache ({self.cache_bytes() / 2**30:.1f} GiB: {self.num_blocks} blocks of "
                                  f"{self.block_size} tokens) does not fit: lower kv_blocks / kv_cache_gib") from e
        n += 1  # the spare entry (see _DeviceState)
        self._state = _DeviceState(
            keys, values, table=torch.full((n, -(-self.max_context_len // self.block_size)), NULL_BLOCK,
                                           dtype=torch.int32, device=device),
            tokens=torch.zeros(n, dtype=torch.long, device=device),
            lengths=torch.zeros(n, dtype=torch.long, device=device),
            live=torch.zeros(n, dtype=torch.bool, device=device),
            temperature=torch.ones(n, dtype=torch.float32, device=device),
            top_k=torch.full((n,), self.vocab_size, dtype=torch.long, device=device),
            top_p=torch.full((n,), float("inf"), dtype=torch.float32, device=device),
            uniform=torch.zeros(n, dtype=cdf_dtype(device), device=device),
            out=torch.zeros(n, 2, dtype=torch.float64, device=device),
            host=(_HostSide.create(n, device), _HostSide.create(n, device)))
        if device.type == "cuda" and self.compiles:
            self.warm_buckets()

    @torch.no_grad()
    def warm_buckets(self) -> None:
        """Run the decode step once for every batch bucket at the shortest length with no row holding a slot (it
        changes no slot's state): a bucket's first step builds what its shapes need (kernels for a new size class,
        the attention kernel's plan), which a bucket reached late by a few stray rows would pay while all wait."""
        from .scheduler import batch_buckets

        self.allocate()
        if bool(self._state.live.any()):
            raise RuntimeError("warm_buckets runs before any row holds a slot")
        progress.info("warming the decode step up at %d batch sizes", len(batch_buckets(self.slots)))
        for rows in batch_buckets(self.slots):
            self._run_decode(rows, min(knobs.LENGTH_STEP, self.max_context_len), "greedy")

    def release(self) -> None:
        """Drop the KV pool, buffers and graphs (they come back at the next pass, or `allocate`)."""
        self._state = None
        if self.graphs is not None:
            self.graphs = CudaGraphs(self.graphs.device, self.stats)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def check_module(self, busy: bool) -> bool:
        """Notice reallocated parameters (graphs are captured again) or a module moved to another device or dtype
        (the cache is dropped; impossible while rows decode: `busy`). True when the weights changed since the last
        check (their version counters moved: an optimizer step, a `copy_`), or it is the first: cached KV is stale.
        Called before each prefill pass (weights change between generations, and each starts with one)."""
        params = [*self.model.parameters(), *self.model.buffers()]
        key = (module_device(self.model), kv_dtype(self.layout), tuple(t.data_ptr() for t in params))
        version = sum(t._version for t in params)
        changed, self._weights = version != self._weights, version
        if key == self._module_key:
            return changed
        if self._module_key is not None:
            self.stats["module_reallocations"] += 1
            if self.graphs is not None:
                self.graphs.drop()
            if key[:2] != self._module_key[:2] and self._state is not None:
                if busy:
                    raise GenerationError(f"the module moved from {self._module_key[:2]} to {key[:2]} while rows "
                                          f"were decoding")
                self.release()
        self._module_key = key
        return True

    # ------------------------------------------------------------------------------------- slots
    def free(self, slots: Sequence[int], zero_blocks: Sequence[int] = ()) -> None:
        """Mark slots free (they no longer advance, and write the null block); `zero_blocks` also zeroes those
        blocks and the null block (after a failed pass, whose garbage could be non-finite)."""
        if self._state is None or not (slots or zero_blocks):
            return
        s = self._state
        if slots:
            index = to_device(list(slots), torch.long, s.live.device)
            s.live.index_fill_(0, index, False)
            s.lengths.index_fill_(0, index, 0)
            s.table.index_fill_(0, index, NULL_BLOCK)  # a step that writes past its blocks writes the null one
        if zero_blocks:
            bs = self.block_size
            rows = to_device([b * bs + i for b in (NULL_BLOCK, *zero_blocks) for i in range(bs)], torch.long,
                             s.live.device)
            for cache in (s.key_cache, s.value_cache):
                cache.index_fill_(1, rows, 0)

    def move(self, moves: Sequence[tuple[int, int]]) -> None:
        """Move each (from, to) slot's per-slot state (its block table included; the KV stays where it is), then
        free `from`."""
        if not moves:
            return
        s = self._state
        src = to_device([a for a, _ in moves], torch.long, s.live.device)
        dst = to_device([b for _, b in moves], torch.long, s.live.device)
        for buffer in s.per_slot:
            buffer.index_copy_(0, dst, buffer.index_select(0, src))
        self.free([a for a, _ in moves])

    def slot_lengths(self) -> list[int]:
        """Each slot's position of its next token (reads the device; 0 for free slots)."""
        return self._state.lengths[:self.slots].tolist() if self._state is not None else [0] * self.slots

    def block_table(self, slot: int) -> list[int]:
        """A slot's block table as the device holds it (for inspection)."""
        return self._state.table[slot].tolist()

    def kv(self, layer: int, positions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V at flat `positions` (``block * block_size + offset``), for inspection."""
        index = torch.tensor(list(positions), dtype=torch.long, device=self._state.live.device)
        return self._state.keys[layer][index], self._state.values[layer][index]

    def length_bucket(self, need: int) -> int:
        """Positions a decode step attends to: `need` rounded up to `LENGTH_STEP`, within the context."""
        if not 0 < need <= self.max_context_len:
            raise ValueError(f"a row needs {need} positions; the context holds {self.max_context_len}")
        return rounded_up(need, knobs.LENGTH_STEP, self.max_context_len)

    # ------------------------------------------------------------------------------------- prefill
    @torch.no_grad()
    def prefill(self, rows: Sequence[PrefillRow], sampling: RowSampling) -> tuple[list[int], list[float]]:
        """One pass over the uncached tokens of `rows`: their K/V written into their blocks, each row's first token
        sampled from its last position. The slots then feed those tokens at the sequences' lengths."""
        self.allocate()
        s = self._state
        device = s.live.device
        news = [len(r.tokens) - r.cached for r in rows]
        width = prefill_width(max(news), self.max_context_len)
        # exact mode: every row reads its whole sequence back (one attention path whether a prefix is cached or not)
        read = 0 if not (self.exact or any(r.cached for r in rows)) else prefill_width(
            max(len(r.tokens) for r in rows), self.max_context_len)
        key = prefill_graph_key(len(rows), width, read, self.max_context_len) if self._capturing() else None
        if key is not None:
            width, read = key[1], key[2]
        self.stats["prefill_padded_tokens"] += len(rows) * width
        columns = max(len(r.blocks) for r in rows)  # the rest of each row's table is null (see `free`)
        table = to_device([list(r.blocks) + [NULL_BLOCK] * (columns - len(r.blocks)) for r in rows], torch.int32,
                          device)
        slots = to_device([r.slot for r in rows], torch.long, device)
        s.table[:, :columns].index_copy_(0, slots, table)
        ids = to_device([list(r.tokens[r.cached:]) + [0] * (width - n) for r, n in zip(rows, news)], torch.long,
                        device)
        starts = to_device([r.cached for r in rows], torch.long, device)
        counts = to_device(news, torch.long, device)
        inputs = (ids, starts, counts, slots)
        with exact.ops(self.exact):
            if key is None:
                logits = self._run_prefill(read, *inputs)
            else:
                logits = self.graphs.run_prefill(key, inputs, lambda *args: self._prefill_logits(read, *args))
        temperature, uniform, top_k, top_p = sampling.tensors(device)
        tokens, logprobs = sample_tokens(logits, temperature, uniform, top_k, top_p, sampling.mode, self.exact)
        lengths = starts + counts
        for buffer, value in zip(s.per_slot, (tokens, lengths, torch.ones_like(tokens, dtype=torch.bool),
                                              temperature, top_k, top_p)):
            buffer.index_copy_(0, slots, value)
        return tokens.tolist(), logprobs.tolist()

    def _prefill_logits(self, read: int, ids: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
        """The prefill's forward (what a prefill graph captures): float32 logits [rows, vocab] at each row's last
        new token. `read`: positions each row reads back from the cache (0: no row has a cached prefix)."""
        s, lay, bs = self._state, self.layout, self.block_size
        n, width = ids.shape
        offsets = torch.arange(width, device=ids.device)
        positions = starts[:, None] + offsets[None, :]
        table = s.table.index_select(0, slots)
        real = offsets[None, :] < counts[:, None]
        write_at = torch.where(real, flat_positions(table.long(), positions, bs), NULL_BLOCK * bs)
        attend = prefill_inputs(table, starts, counts, width, read, bs, self.kernel)
        x = lay.embed(ids)
        cos, sin = lay.rotary(x, positions)
        layer_fn, head = self._functions["prefill_layer"], self._functions["head_logits"]
        for layer, k, v in zip(lay.layers, s.keys, s.values):
            x = layer_fn(layer, x, cos, sin, write_at, attend, k, v, lay.apply_rope, lay.qk_norm, self.kernel)
        last = x[torch.arange(n, device=x.device)[:, None], (counts - 1)[:, None]]  # [n, 1, hidden], not a view
        return head(lay.norm, lay.lm_head, last, self.vocab_size)

    def _run_prefill(self, read: int, *inputs: torch.Tensor) -> torch.Tensor:
        with self._compilations_counted():
            return self._prefill_logits(read, *inputs)

    # ------------------------------------------------------------------------------------- decode
    @torch.no_grad()
    def launch(self, rows: int, need: int, uniforms: Sequence[float] | None, mode: str,
               table_updates: Sequence[tuple[int, int, int]] = ()) -> LaunchedStep:
        """Enqueue one decode step for slots [0, rows) (`rows` a batch bucket; free slots among them are padding;
        with CUDA graphs, slots from `rows` on must be free: a larger bucket's graph may run the step), and the copy
        of its outputs to host memory; on CUDA, return without waiting. Each live slot feeds its next token, writes
        its K/V and samples one. `need`: the most positions a live row attends to; `uniforms`: one per slot (None
        for a greedy step); `table_updates`: (slot, column, block) entries set first. At most two launched steps
        may be uncollected (they use alternate host buffers)."""
        s = self._state
        length = self.length_bucket(need)
        if uniforms is None and mode != "greedy":
            raise ValueError(f"a {mode!r} step needs one uniform number per slot")
        host = s.host[s.launches % 2]
        if host.step is not None and not host.step.collected:
            raise RuntimeError("two launched decode steps are not collected yet: collect the older one first")
        with _on_device(s.live.device):
            if uniforms is not None:  # into host memory no copy still reads (its step was collected)
                host.uniform.numpy()[:rows] = uniforms  # numpy: the GIL stays held (see `collect`)
                s.uniform[:rows].copy_(host.uniform[:rows], non_blocking=True)
            if table_updates:
                self._update_table(host, table_updates)
            if self._capturing():
                key = (rows, length, mode)
                self.graphs.run_decode(key, lambda: self._run_decode(*key), lambda: self._warm_up(key))
            else:
                self._run_decode(rows, length, mode)
            host.out[:rows].copy_(s.out[:rows], non_blocking=True)
            if host.event is not None:
                host.event.record()
        s.launches += 1
        host.step = LaunchedStep(rows, host)
        return host.step

    def _update_table(self, host: _HostSide, updates: Sequence[tuple[int, int, int]]) -> None:
        n = len(updates)
        host.table_updates.numpy()[:n] = updates
        staged = host.table_updates[:n].to(self._state.table.device, non_blocking=True)
        self._state.table.index_put_((staged[:, 0].long(), staged[:, 1].long()), staged[:, 2])

    def collect(self, step: LaunchedStep) -> tuple[list[int], list[float]]:
        """Wait for a launched step's outputs (without holding the GIL) and return every slot's token and
        logprob (read through numpy: each torch call would release and retake the GIL)."""
        if step.host.event is not None:
            step.host.event.synchronize()
        out = step.host.out.numpy()[:step.rows]
        tokens, logprobs = out[:, 0].astype(np.int64).tolist(), out[:, 1].tolist()
        step.collected = True
        return tokens, logprobs

    def _decode(self, rows: int, length: int, mode: str) -> None:
        """The decode step over slots [0, rows) attending to `length` positions: what a CUDA graph captures."""
        s, lay = self._state, self.layout
        inputs, layer_step, head = self._step_functions
        tokens, lengths, live = s.tokens[:rows], s.lengths[:rows], s.live[:rows]
        x, cos, sin, write_at, attend = inputs(lay.embed, lay.rotary, tokens, lengths, s.table[:rows], length,
                                               self.block_size, self.kernel)
        for layer, keys, values in zip(lay.layers, s.keys, s.values):
            x = layer_step(layer, x, cos, sin, write_at, attend, keys, values, lay.apply_rope, lay.qk_norm,
                           self.kernel)
        logits = head(lay.norm, lay.lm_head, x, self.vocab_size)
        token, logprob = sample_tokens(logits, s.temperature[:rows], s.uniform[:rows], s.top_k[:rows], s.top_p[:rows],
                                       mode, self.exact)
        s.out[:rows, 0] = token
        s.out[:rows, 1] = logprob
        tokens.copy_(torch.where(live, token, tokens))
        lengths.add_(live)

    def _run_decode(self, rows: int, length: int, mode: str) -> None:
        with self._compilations_counted(), exact.ops(self.exact):
            self._decode(rows, length, mode)

    def _warm_up(self, key: tuple[int, int, str]) -> None:
        """The step run on the graphs' side stream before its capture, then the tokens and lengths it advanced
        restored (the K/V it wrote are what the captured step writes again)."""
        s = self._state
        saved = s.tokens.clone(), s.lengths.clone()
        try:
            self._run_decode(*key)
        finally:
            s.tokens.copy_(saved[0])
            s.lengths.copy_(saved[1])

    # ------------------------------------------------------------------------------------- helpers
    @property
    def compile_reason(self) -> str:
        """Whether the layer functions run compiled, and why not where they do not."""
        functions = list(self._functions.values())
        if functions == list(COMPILED_FUNCTIONS):
            return "off: eager decode step and prefill"
        compiled_functions = [f for f in (getattr(fn, "compiled", fn) for fn in functions) if isinstance(f, Compiled)]
        failures = [fn.failure for fn in compiled_functions if fn.failure]
        if not failures:
            return ("on: the decode step's and the prefill's layers compiled by Inductor (exact mode)" if self.exact
                    else "on: decode step and prefill compiled by Inductor")
        return f"{'off' if len(failures) == len(compiled_functions) else 'partly off'}: {'; '.join(failures)}"

    def _capturing(self) -> bool:
        return self.graphs is not None and self.graphs.on

    @contextlib.contextmanager
    def _compilations_counted(self):
        """Add the compilations (and their seconds) made inside the block to `stats`."""
        before = dict(COMPILE_COUNTS)
        try:
            yield
        finally:
            self.stats["compilations"] += COMPILE_COUNTS["compilations"] - before["compilations"]
            self.stats["compile_s"] += COMPILE_COUNTS["compile_s"] - before["compile_s"]


# --------------------------------------------------------------------------------------------- shapes
def rounded_up(n: int, step: int, cap: int) -> int:
    """`n` rounded up to a multiple of `step`, at most `cap`."""
    return min(cap, -(-n // step) * step)


def prefill_width(longest: int, max_context_len: int) -> int:
    """The width of a prefill pass whose longest row has `longest` new tokens: padded to `PREFILL_WIDTH_STEP`."""
    return rounded_up(longest, knobs.PREFILL_WIDTH_STEP, max_context_len)


def prefill_graph_key(rows: int, width: int, read: int, max_context_len: int) -> tuple[int, int, int] | None:
    """The (rows, width, read) of the CUDA graph that runs a prefill pass of `rows` rows `width` new tokens wide,
    reading back `read` positions (0: none): width and read rounded up to powers of two; None for a pass too large
    to gain from one (`PREFILL_GRAPH_ROWS`, `PREFILL_GRAPH_TOKENS`)."""
    def power(n: int) -> int:
        return min(max(knobs.PREFILL_WIDTH_STEP, 1 << (n - 1).bit_length()), max_context_len)

    graph_width = power(width)
    if rows > knobs.PREFILL_GRAPH_ROWS or rows * graph_width > knobs.PREFILL_GRAPH_TOKENS:
        return None
    return rows, graph_width, power(read) if read else 0


def _attention_kernel(choice: str, device: torch.device, head_dim: int) -> str:
    """The decode attention kernel for `choice` on `device` (``"auto"``: Triton on CUDA where it imports and the
    head dimension is a power of two of at least 16)."""
    if choice == "gather" or (choice == "auto" and (device.type != "cuda" or head_dim < 16
                                                    or head_dim & (head_dim - 1))):
        return "gather"
    try:
        from . import triton_attention  # noqa: F401
    except ImportError as e:
        if choice == "triton":
            raise ValueError(f"attention='triton' needs Triton on CUDA: {e}") from None
        return "gather"
    return "triton"


def _on_device(device: torch.device):
    """``torch.cuda.device(device)`` for a CUDA device (a graph replays on the current device's stream)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
