"""The fast decode path of `agents.hf_policy.HFPolicy`: a KV cache with one slot per row, a decode step captured in
CUDA graphs, and the batched sampler that both of HFPolicy's paths use.

Why: an eager transformers forward with a ``DynamicCache`` spends a decode step on Python and kernel launches
(~36 ms per step on an H200 for a 0.5B model whatever the batch), re-pads the cache as rows join and leave, and
expands K/V for grouped-query attention. This module runs the *same* `nn.Module` (no weight copy: after an
optimizer step the next token sees the new weights) through its own layer loop:

* **Supported modules** (`decoder_layout`): Llama-family decoders — ``llama``, ``qwen2``, ``qwen3`` (with its
  ``q_norm``/``k_norm``) — with full attention in every layer and a position-only RoPE. The loop calls the module's
  own submodules (``embed_tokens``, each layer's ``input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
  ``post_attention_layernorm``, ``mlp``, then ``norm``, ``rotary_emb``, ``lm_head``) and the modeling file's own
  ``apply_rotary_pos_emb``. Anything else raises `UnsupportedModel` with the reason; HFPolicy then keeps its
  transformers path.
* **Slot KV cache** (`SlotEngine`): per layer, K and V of shape [slots, kv_heads, max_cache_len, head_dim] (views of
  one K and one V tensor over the layers: moving or clearing slots is then a few ops) in the module's dtype,
  zero-initialised (masked positions are multiplied by 0 in attention: they must hold finite
  values), allocated on first use and freeable (`SlotEngine.release`). Row *i* of a decode batch is slot *i*: a
  step over a batch bucket of B rows reads ``K[:B, :, :L]`` as a view, L being the filled length rounded up to a
  multiple of ``length_step``. Rows join by prefilling into free slots and leave by freeing theirs; nothing is
  re-padded. `SlotTable` (host side) hands out the lowest free slots and, when the rows left would fit a smaller
  batch bucket, plans moves of the few rows above it into free slots below it (`SlotEngine.move` copies only
  those rows' KV).
* **Prefill** (`prefill_layer` per layer, then `head_logits`; compiled on CUDA like the decode step): prompts
  right-padded into one tensor of a width rounded up to `PREFILL_WIDTH_STEP`, causal attention without cuDNN
  (`PREFILL_ATTENTION`: its plans are built per shape) (right padding keeps real tokens from seeing padding; the
  padding's own K/V land beyond each row's length, where they are masked and later overwritten), K/V written
  straight into the rows' slots, the LM head only at each row's last real position. A small pass (at most
  `PREFILL_GRAPH_ROWS` rows, e.g. an episode whose turn ended early, while the batch decodes) replays a CUDA graph
  of its (rows, width rounded up to a power of two), captured on its `CAPTURE_ON_USE`-th use (a lone row's, at
  every width, when the cache is allocated: `SlotEngine._capture_lone_prefills`): launched op by op, such a pass
  costs several times its device time in host time, while every decoding row waits.
* **Decode step** (`SlotEngine._decode`: `step_inputs`, `decode_layer` per layer, `head_logits`, then
  `sample_tokens`; run eagerly or captured): the new token's K/V are written in place at each row's own position;
  attention without expanding K/V — the query heads of one KV head are laid out as that head's query positions
  ([B, kv_heads, group, head_dim]) and one SDPA call with a [B, 1, 1, L] additive length mask (built once per step)
  serves them all; then sampling (below); then each live slot's next input token and length advance on the
  device. On CUDA the three step functions (not the sampler: see `head_logits`) are compiled by Inductor
  (`agents.compiling`: fused norms, RoPE, residual adds and SiLU x mul; one compilation for all layers and
  buckets; eager where compilation fails) and the step is captured per (batch bucket, length bucket, sampling
  mode) into a ``torch.cuda.CUDAGraph`` on that bucket's `CAPTURE_ON_USE`-th step (the first ones run uncaptured:
  a bucket that a few stray rows pass through once does not pay a capture), after a warm-up on a side stream,
  where compilation happens; where the graph of a larger bucket can run the step in its place (`stand_in`: free
  slots as padding rows, a longer length masked), that graph runs it until the bucket's `CAPTURE_WITH_STAND_IN`-th
  step instead. All graphs share one memory pool, and their inputs and outputs are the engine's persistent
  per-slot buffers. Optimizer steps and `copy_` update parameters in place, so graphs see new weights; a
  module whose parameters were reallocated (``.to()``, ``load_state_dict(assign=True)``) is detected by its parameters'
  addresses (`SlotEngine.check_module`) and the graphs are captured again (checked before each prefill: weights
  change between generations). A step that cannot be captured runs eagerly (`SlotEngine.capture_failure`).
* **Sampling** (`sample_tokens`): for the whole batch at once on the device: ``log_softmax(logits / T)`` (T = 1
  for greedy rows, which take the argmax), then inverse-CDF sampling with one uniform number per row drawn on the
  host from the row's own ``random.Random`` — the same draws whatever the path, so a seed gives the same tokens
  on both, whatever else is in the batch. Top-k/top-p need a sort of the vocabulary: only the ``"truncate"``
  mode (used when some row asks for it) sorts, to find each row's kept set; the CDF always runs in vocabulary
  order (near-ties that two computations sort differently would otherwise swap tokens).

Per step the host only sends the sampled rows' uniform numbers (one small copy; none for an all-greedy step) and
reads back each slot's token and logprob (one copy); tokens, lengths and sampling parameters stay on the device,
set when a row is prefilled or moved. A step is **launched** (`SlotEngine.launch`: both copies asynchronous,
through pinned host buffers, and an event marking the outputs ready) and **collected** later
(`SlotEngine.collect`): its successor needs nothing from the host but uniform numbers, so HFPolicy launches step
t+1 before it reads step t's tokens, and its per-step work (stop checks, settling requests, drawing the next
uniforms) runs while the device computes. The pinned buffers live as long as the cache (two sets: two steps may
be in flight); no pinned memory is freed during a capture (freeing it records CUDA events), and the small index
tensors of `free` and `move` go through pinned memory too (a copy from pageable memory would wait for the step in
flight). A pass that fails (an exception, NaN logits) frees its rows' slots and zeroes their KV, so that no
non-finite value is left where a later row's mask hides it.

Choices worth knowing: not transformers' ``StaticCache`` (one length for the whole batch, no slot to join or
leave by); the module is checked for reallocated parameters before each prefill rather than before each replay
(walking its parameters costs about as much as a tenth of a decode step); prefill K/V are expanded to all query
heads for SDPA (``enable_gqa`` is not served by every SDPA backend, and prefill is not the bottleneck), decode
never expands them; an all-greedy batch uses a ``"greedy"`` graph that skips the CDF.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mt_env.collector import collector_paused

from .compiling import COMPILE_COUNTS, compiled
from .policy import GenerationError, SamplingParams

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
#: RoPE variants whose cos/sin depend on the positions only (``dynamic`` and ``longrope`` also depend on the length)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SAMPLING_MODES = ("greedy", "sample", "truncate")
#: most padded tokens (rows x longest prompt) per prefill pass: bounds the activations of one pass
PREFILL_TOKENS = 32768
#: default `max_cache_len` cap: every slot holds this many tokens, so the cache is slots x this x per-token size
DEFAULT_MAX_CACHE_LEN = 4096
#: a prefill pass's width (its longest prompt) is padded to a multiple of this, so that passes come in fewer
#: shapes. Padded positions are written and later overwritten, never attended.
PREFILL_WIDTH_STEP = 16
#: the attention kernels a prefill pass may use: torch's own choice except cuDNN. On an H200 torch picks cuDNN, which
#: builds an execution plan (runtime-compiled kernels) for every new (rows, width) shape: 40-100 ms of host time at a
#: shape's first pass while every decoding row waits, and the rows and width of a pass change all the time
#: (`benchmarks/bench_prefill.py --profile`: ``aten::_cudnn_attention_forward``). Flash attention has no such cost.
#: Set inside the compiled function, so that the choice is part of its graph (and of Inductor's cache key).
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
#: a prefill pass of at most this many rows, at most `PREFILL_GRAPH_TOKENS` once its width is rounded up to a power of
#: two, replays a CUDA graph of that (rows, width), captured on its `CAPTURE_ON_USE`-th use. Why: such a pass is
#: launch-bound (an H200, 0.5B model: ~15-25 ms of host time for 24 compiled layers against ~2 ms of device time)
#: while every decoding row waits, and an episode whose turn ends early gets one of its own at each later turn.
#: Powers of two: few graphs, which recur (the padding of a few rows costs little device time).
PREFILL_GRAPH_ROWS = 8
PREFILL_GRAPH_TOKENS = 4096
#: the same for the decode step; None: torch's own choice (its shapes are few: batch and length buckets, captured)
DECODE_ATTENTION: list[SDPBackend] | None = None
WARMUP_STEPS = 2  # eager steps on a side stream before a capture (cuBLAS handles and workspaces get created)
#: a (batch, length, mode) bucket is captured the n-th time a step needs it; before that its steps run uncaptured.
#: A capture (a synchronisation, the warm-up steps, recording ~500 kernels) costs ~50-150 ms during which every row
#: waits, worth it for a bucket that recurs; buckets that a few stray rows pass through for a step or two do not.
CAPTURE_ON_USE = 3
#: a bucket that a captured graph of a larger bucket can stand in for (`stand_in`) runs that graph until its own n-th
#: use, then is captured. Rent or buy: a stand-in step costs ~1-2 ms more than the bucket's own graph would (an H200,
#: 0.5B model: padding rows up to 256, attention over a longer length), a capture ~50-150 ms; so a bucket that a lone
#: early finisher passes through for a few steps never stalls the batch for a capture or for uncaptured steps
#: (whose first run of a shape also builds the attention kernel's plan), and one that recurs is captured.
CAPTURE_WITH_STAND_IN = 64
#: the counters a `SlotEngine` adds to its caller's stats
ENGINE_COUNTERS = ("graph_captures", "graph_replays", "stand_in_replays", "uncaptured_steps", "prefill_graph_captures",
                   "prefill_graph_replays", "module_reallocations", "compilations", "compile_s", "capture_failures")


class UnsupportedModel(ValueError):
    """The module cannot take the fast path; the message says why."""


# --------------------------------------------------------------------------------------------- the module's layout
@dataclass(frozen=True)
class DecoderLayout:
    """The parts of a Llama-family causal LM that the fast path calls (the module's own submodules)."""

    embed: nn.Module
    layers: Sequence[nn.Module]
    norm: nn.Module
    rotary: nn.Module
    lm_head: nn.Module
    apply_rope: Callable
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    qk_norm: bool

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


def decoder_layout(model: nn.Module) -> DecoderLayout:
    """The fast path's view of `model`, or `UnsupportedModel` saying what stands in the way."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(f"model type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    if getattr(model, "hf_quantizer", None) is not None:
        raise UnsupportedModel("the module is quantized")
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        raise UnsupportedModel("the module has accelerate hooks (device_map / offloading)")
    body = getattr(model, "model", None)
    parts = {name: getattr(body, name, None) for name in ("embed_tokens", "layers", "norm", "rotary_emb")}
    if any(part is None for part in parts.values()) or getattr(model, "lm_head", None) is None:
        raise UnsupportedModel("the module lacks model.{embed_tokens,layers,norm,rotary_emb} or lm_head")
    rope_type = getattr(parts["rotary_emb"], "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModel(f"RoPE type {rope_type!r} depends on the sequence length")
    layers = list(parts["layers"])[:config.num_hidden_layers]
    for i, layer in enumerate(layers):
        _check_layer(i, layer, qk_norm=model_type == "qwen3")
    attn = layers[0].self_attn
    apply_rope = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    if apply_rope is None:
        raise UnsupportedModel(f"{type(attn).__module__} has no apply_rotary_pos_emb")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % kv_heads:
        raise UnsupportedModel(f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
    return DecoderLayout(parts["embed_tokens"], layers, parts["norm"], parts["rotary_emb"], model.lm_head,
                         apply_rope, heads, kv_heads, attn.head_dim, float(attn.scaling), model_type == "qwen3")


def _check_layer(i: int, layer: nn.Module, qk_norm: bool) -> None:
    attn = getattr(layer, "self_attn", None)
    needed = [(layer, "input_layernorm"), (layer, "post_attention_layernorm"), (layer, "mlp"),
              *((attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"))]
    if qk_norm:
        needed += [(attn, "q_norm"), (attn, "k_norm")]
    missing = [name for owner, name in needed if getattr(owner, name, None) is None]
    if missing:
        raise UnsupportedModel(f"layer {i} lacks {missing}")
    if getattr(attn, "sliding_window", None) is not None:
        raise UnsupportedModel(f"layer {i} uses sliding-window attention")


# --------------------------------------------------------------------------------------------- sampling
def sampling_mode(params: Sequence[SamplingParams]) -> str:
    """The cheapest `sample_tokens` mode serving all these rows: greedy < sample < truncate (top-k/top-p)."""
    sampled = [p for p in params if not p.greedy]
    if not sampled:
        return "greedy"
    return "truncate" if any(p.top_k != -1 or p.top_p < 1 for p in sampled) else "sample"


def cdf_dtype(device: torch.device) -> torch.dtype:
    """Inverse-CDF sampling accumulates in float64 (float32 where the device has no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


@dataclass
class RowSampling:
    """Per-row sampling inputs for one pass, in row order; the uniforms are drawn from each row's own generator."""

    temperature: list[float]
    top_k: list[int]  #: the vocabulary size when off
    top_p: list[float]  #: inf when off
    uniform: list[float]  #: 0 for greedy rows (they draw nothing)
    mode: str

    @classmethod
    def draw(cls, params: Sequence[SamplingParams], generators: Sequence[random.Random], vocab: int) -> RowSampling:
        return cls([p.temperature for p in params], [p.top_k if p.top_k > 0 else vocab for p in params],
                   [p.top_p if p.top_p < 1 else float("inf") for p in params],
                   [0.0 if p.greedy else g.random() for p, g in zip(params, generators)], sampling_mode(params))

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temperature float32, uniform, top_k long, top_p float32) on `device`."""
        return (_to_device(self.temperature, torch.float32, device),
                _to_device(self.uniform, cdf_dtype(device), device),
                _to_device(self.top_k, torch.long, device), _to_device(self.top_p, torch.float32, device))


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of float32 `logits` [rows, vocab] and ``log_softmax(logits / T)`` of it.

    Rows with ``temperature == 0`` take the argmax (their logprob is ``log_softmax(logits)``); the others sample
    by inverse CDF with their `uniform` number, after their own `top_k` [rows] (vocab = off) and `top_p` [rows]
    (inf = off) in ``"truncate"`` mode. No host synchronisation and no data-dependent shapes: CUDA graphs can
    capture it. A NaN in a row's logits makes its logprob NaN (the caller checks).
    """
    if mode not in SAMPLING_MODES:
        raise ValueError(f"sampling mode must be one of {SAMPLING_MODES}, got {mode!r}")
    greedy = temperature == 0
    logprobs = torch.log_softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    if mode != "greedy":
        probs = logprobs.exp()
        if mode == "truncate":
            probs = _truncate(probs, top_k, top_p)
        cdf = probs.to(uniform.dtype).cumsum(dim=-1)
        total = cdf[:, -1]
        target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
        # NaN logits would make the index point past the vocabulary: clamp it (the NaN logprob reports them).
        choice = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=logits.shape[-1] - 1)
        tokens = torch.where(greedy, tokens, choice.squeeze(1))
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _truncate(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`probs` with the tokens outside each row's top-k / top-p set zeroed, still in vocabulary order.

    The set comes from a (stable, descending) sort; sampling then runs in vocabulary order, so two tokens of
    nearly equal probability that two computations sort differently change nothing unless they straddle the
    cut (sampling in sorted order would swap their CDF intervals)."""
    vocab = probs.shape[-1]
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=probs.device)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank[None, :] < top_k[:, None]) & (mass_before < top_p[:, None])
    return probs * torch.empty_like(keep).scatter_(1, order, keep)


# --------------------------------------------------------------------------------------------- the decode step
# Module-level functions of tensors and the module's own submodules: run eagerly, or compiled once per process for
# every layer, bucket and engine (`agents.compiling`); a CUDA graph captures either.
def attention_inputs(attn: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, apply_rope: Callable,
                     qk_norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys (RoPE applied) and values, [rows, heads, time, head_dim], as the module's attention does."""
    shape = (*h.shape[:-1], -1, attn.head_dim)
    q, k = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape)
    if qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, attn.v_proj(h).view(shape).transpose(1, 2)


def step_inputs(embed: nn.Module, rotary: nn.Module, tokens: torch.Tensor, lengths: torch.Tensor, length: int):
    """A decode step's inputs: embeddings [rows, 1, hidden] of each row's next token, RoPE cos/sin at its position,
    the positions (within the `length` attended, even for a stale free slot) and the additive length mask
    [rows, 1, 1, length] (built once per step, used by every layer)."""
    at = lengths.clamp(max=length - 1)
    x = embed(tokens[:, None])
    cos, sin = rotary(x, at[:, None])
    hidden = (torch.arange(length, device=x.device)[None, :] > at[:, None])[:, None, None, :]
    mask = torch.zeros(hidden.shape, dtype=x.dtype, device=x.device).masked_fill_(hidden, float("-inf"))
    return x, cos, sin, at, mask


def decode_layer(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, at: torch.Tensor,
                 mask: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, apply_rope: Callable,
                 qk_norm: bool) -> torch.Tensor:
    """One decoder layer for one token per row (slots [0, rows)): its K/V written at each row's position `at` in
    the layer's cache, attention over the first ``mask.shape[-1]`` positions without expanding K/V (a KV head's
    query heads laid out as that head's queries, [rows, kv_heads, groups, head_dim]), then the MLP."""
    attn, rows, length = layer.self_attn, x.shape[0], mask.shape[-1]
    q, k, v = attention_inputs(attn, layer.input_layernorm(x), cos, sin, apply_rope, qk_norm)
    kv_heads = k.shape[1]
    slot, head = torch.arange(rows, device=x.device)[:, None], torch.arange(kv_heads, device=x.device)[None, :]
    keys.index_put_((slot, head, at[:, None]), k[:, :, 0])  # in place on the whole cache: no copy when compiled
    values.index_put_((slot, head, at[:, None]), v[:, :, 0])
    q = q.reshape(rows, kv_heads, -1, q.shape[-1])
    with _attention_kernels(DECODE_ATTENTION):
        out = F.scaled_dot_product_attention(q, keys[:rows, :, :length], values[:rows, :, :length], attn_mask=mask,
                                             scale=attn.scaling)
    x = x + attn.o_proj(out.reshape(rows, 1, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def head_logits(norm: nn.Module, lm_head: nn.Module, x: torch.Tensor, vocab: int) -> torch.Tensor:
    """The final norm and the LM head over the first `vocab` ids: float32 logits [rows, vocab].

    Sampling (`sample_tokens`) stays out of the compiled functions: its reductions over the whole vocabulary
    (argmax, cumsum) with a symbolic row count are split reductions Inductor does not generate ("NYI
    TritonSplitDimKernel reductions" for the argmax over 151,936 ids), and they are a few large kernels, not
    launch-bound, so compiling them would gain nothing."""
    return lm_head(norm(x))[:, 0, :vocab].float()


def prefill_layer(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, apply_rope: Callable, qk_norm: bool) -> torch.Tensor:
    """One decoder layer over whole prompts [rows, width, hidden], right-padded: K/V written in place into the rows'
    `slots` at positions [0, width), causal attention (a real token never sees the padding after it), the MLP.
    Compiled, a prefill pass launches a few fused kernels per layer instead of ~40 eager ones: a pass of a few rows
    then costs milliseconds, not the tens of milliseconds the eager launches took while every decoding row waited."""
    attn, (rows, width) = layer.self_attn, x.shape[:2]
    q, k, v = attention_inputs(attn, layer.input_layernorm(x), cos, sin, apply_rope, qk_norm)
    at = (slots[:, None, None], torch.arange(k.shape[1], device=x.device)[None, :, None],
          torch.arange(width, device=x.device)[None, None, :])
    keys.index_put_(at, k)  # in place on the whole cache, as in `decode_layer`
    values.index_put_(at, v)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    with _attention_kernels(PREFILL_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
    x = x + attn.o_proj(out.transpose(1, 2).reshape(rows, width, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _attention_kernels(backends: list[SDPBackend] | None):
    """SDPA restricted to `backends` (None: torch's own choice)."""
    return sdpa_kernel(backends) if backends else contextlib.nullcontext()


STEP_FUNCTIONS = (step_inputs, decode_layer, head_logits)
#: every function the engine compiles: the decode step's and the prefill's layer (`head_logits` serves both)
COMPILED_FUNCTIONS = (*STEP_FUNCTIONS, prefill_layer)


# --------------------------------------------------------------------------------------------- slot bookkeeping
def batch_buckets(max_slots: int) -> list[int]:
    """Decode batch sizes with a graph each: powers of two from 2 to 32, multiples of 32 to 256, then of 64, and
    `max_slots` itself (at most 32 padding rows up to 256, at most 64 beyond). A single row runs in a batch of 2:
    the step costs the same, and dynamo would compile a batch of one as a case of its own."""
    if max_slots < 1:
        raise ValueError(f"max_slots must be >= 1, got {max_slots}")
    sizes = [2, 4, 8, 16, 32, *range(64, 257, 32), *range(320, max_slots + 1, 64)]
    return sorted({s for s in sizes if s < max_slots} | {max_slots})


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding `n` rows (0 rows: 0)."""
    if n == 0:
        return 0
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} rows exceed the largest bucket {buckets[-1]}")


def stand_in(key: tuple[int, int, str], captured: Iterable[tuple[int, int, str]]) -> tuple[int, int, str] | None:
    """The captured (batch bucket, length bucket, mode) that can run a step of `key` in its place: the same
    sampling mode, at least as many rows (the extra slots are free: padding rows, which change no slot's state) and
    at least as long (the length mask hides what a row has not filled); the smallest such, or None."""
    rows, length, mode = key
    fits = [k for k in captured if k[2] == mode and k[0] >= rows and k[1] >= length]
    return min(fits, key=lambda k: (k[0], k[1]), default=None)


class SlotTable:
    """Which row holds which KV slot (host side; the KV itself lives in `SlotEngine`).

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

    def acquire(self, rows: Sequence[Any]) -> list[int]:
        """Give each of `rows` one of the lowest free slots; returns the slots in row order."""
        free = [slot for slot, row in enumerate(self._rows) if row is None][:len(rows)]
        if len(free) < len(rows):
            raise ValueError(f"{len(rows)} rows but only {len(free)} free slots")
        for slot, row in zip(free, rows):
            self._rows[slot] = row
        return free

    def release(self, slots: Sequence[int]) -> None:
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
        (from, to) moves, already applied here (the caller moves the KV)."""
        target = bucket_for(self.held_count(), self.buckets)
        if self.bucket() <= target:
            return []
        free = [slot for slot in range(target) if self._rows[slot] is None]
        above = [slot for slot in range(target, len(self._rows)) if self._rows[slot] is not None]
        moves = list(zip(above, free))
        for src, dst in moves:
            self._rows[dst], self._rows[src] = self._rows[src], None
        return moves


def rounded_up(n: int, step: int, cap: int) -> int:
    """`n` rounded up to a multiple of `step`, at most `cap`: the prefill's widths and the decode step's attended
    lengths, so that passes come in few shapes."""
    return min(cap, -(-n // step) * step)


def prefill_width(longest: int, max_cache_len: int) -> int:
    """The width of a prefill pass whose longest prompt has `longest` tokens: padded to `PREFILL_WIDTH_STEP`,
    within the cache."""
    return rounded_up(longest, PREFILL_WIDTH_STEP, max_cache_len)


def prefill_graph_key(rows: int, width: int, max_cache_len: int) -> tuple[int, int] | None:
    """The (rows, width) of the CUDA graph that runs a prefill pass of `rows` prompts `width` wide: the width rounded
    up to a power of two (at least `PREFILL_WIDTH_STEP`, at most the cache); None for a pass too large to gain from
    one (`PREFILL_GRAPH_ROWS`, `PREFILL_GRAPH_TOKENS`)."""
    graph_width = min(max(PREFILL_WIDTH_STEP, 1 << (width - 1).bit_length()), max_cache_len)
    if rows > PREFILL_GRAPH_ROWS or rows * graph_width > PREFILL_GRAPH_TOKENS:
        return None
    return rows, graph_width


def lone_prefill_keys(max_cache_len: int) -> list[tuple[int, int]]:
    """The graph keys (`prefill_graph_key`) a prefill pass of one row can have, whatever its prompt's length."""
    widths = (min(PREFILL_WIDTH_STEP << k, max_cache_len) for k in range(max_cache_len.bit_length()))
    return sorted({prefill_graph_key(1, width, max_cache_len) for width in widths} - {None})


def prefill_groups(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of `lengths` (the widths passes pad them to) grouped for prefill passes: sorted by length (less
    padding), each group's padded size (rows x longest) within `max_tokens` (a longer prompt gets a group of its
    own)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def one_prefill_pass_takes(rows: int, longest: int, max_cache_len: int) -> bool:
    """Whether one prefill pass takes all of `rows` prompts whose longest has `longest` tokens (`next_prefill_group`
    then takes them all: its groups pad to the longest, within `PREFILL_TOKENS`; a longer prompt goes alone)."""
    return rows <= 1 or rows * prefill_width(longest, max_cache_len) <= PREFILL_TOKENS


def next_prefill_group(prompt_lengths: Sequence[int], max_cache_len: int) -> list[int]:
    """Indices of the prompts the next prefill pass takes: the first of `prefill_groups` over the widths the passes
    pad them to (`prefill_width`), within `PREFILL_TOKENS`."""
    return prefill_groups([prefill_width(n, max_cache_len) for n in prompt_lengths], PREFILL_TOKENS)[0]


def admission_waits(waited: Sequence[int], decoding: int, wait_steps: int) -> bool:
    """Whether requests waiting for a prefill pass (`waited`: decode steps each has waited) wait another step while
    `decoding` rows decode: while the longest wait is under `wait_steps` and they are fewer than the decoding rows.
    Why: each pass stalls every decoding row, so arrivals a few steps apart had better share one; a group at least
    as large as the decoding batch gains more from starting than the batch loses, and no wait is longer than
    `wait_steps` (see `HFPolicy`'s `admit_wait_steps`)."""
    if not waited or not decoding or len(waited) >= decoding:
        return False
    return max(waited) < wait_steps


# --------------------------------------------------------------------------------------------- the engine
@dataclass
class _SlotState:
    """Device tensors, one entry per slot (the KV cache of every layer and the decode step's inputs and outputs).

    The per-slot buffers have one spare entry past the last slot, never a row's: a step's views of them (the first
    `rows` entries) then never span a whole buffer, which dynamo would compile as a case of its own."""

    #: the KV cache, [layers, slots, kv_heads, max_cache_len, head_dim] each: one tensor over the layers, so that
    #: moving or clearing slots is a few ops, not a few per layer (each op a wait for the interpreter lock while
    #: the caller's event loop is busy: `SlotEngine.move` took 10-30 ms mid-rollout on an H200 as 24 layers' ops)
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    tokens: torch.Tensor  #: long: the token each slot feeds next
    lengths: torch.Tensor  #: long: filled cache positions (= the position of that next token)
    live: torch.Tensor  #: bool: the slot holds a row (free slots do not advance)
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    uniform: torch.Tensor  #: this step's uniform number per slot
    out: torch.Tensor  #: float64 [slots, 2]: sampled token, its logprob (a slot's pair contiguous: see `_HostSide`)
    host: tuple[_HostSide, _HostSide]  #: host buffers of the two steps that may be in flight (even, odd launches)
    launches: int = 0
    keys: list[torch.Tensor] = field(init=False)  #: each layer's view of `key_cache` (the passes' layer loops)
    values: list[torch.Tensor] = field(init=False)
    per_slot: tuple[torch.Tensor, ...] = field(init=False)

    def __post_init__(self):
        self.keys, self.values = list(self.key_cache.unbind(0)), list(self.value_cache.unbind(0))
        self.per_slot = (self.tokens, self.lengths, self.live, self.temperature, self.top_k, self.top_p)


@dataclass(eq=False)
class _HostSide:
    """Host memory of one launched step: the uniform numbers it uploads and the outputs it copies back (pinned on
    CUDA, so that both copies are asynchronous), and the event that marks its outputs ready."""

    uniform: torch.Tensor  #: [slots + 1], `cdf_dtype`
    out: torch.Tensor  #: float64 [slots + 1, 2]; the first `rows` of both are contiguous: an asynchronous copy
    #: between host and device needs both sides contiguous (else it goes through a pageable temporary, and waits)
    event: Any  #: torch.cuda.Event on CUDA, else None (a step on the CPU is done when `launch` returns)
    step: LaunchedStep | None = None  #: the step using these buffers, until it is collected

    @classmethod
    def create(cls, slots: int, device: torch.device) -> _HostSide:
        pinned = device.type == "cuda"
        return cls(torch.zeros(slots, dtype=cdf_dtype(device), pin_memory=pinned),
                   torch.zeros(slots, 2, dtype=torch.float64, pin_memory=pinned),
                   torch.cuda.Event() if pinned else None)


@dataclass(eq=False)
class _PrefillGraph:
    """A small prefill pass captured for one (rows, width): the input buffers each replay fills first (ids, lengths,
    slots) and the logits it computes."""

    graph: Any
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    logits: torch.Tensor


@dataclass(eq=False)
class LaunchedStep:
    """A decode step enqueued on the device by `SlotEngine.launch`; `SlotEngine.collect` reads its outputs."""

    rows: int
    host: _HostSide
    collected: bool = False


class SlotEngine:
    """The slot KV cache, prefill, and the (graph-captured) decode step for one module; see the module docstring.

    Slots are indices in [0, max_slots); the caller (HFPolicy with a `SlotTable`) decides which rows hold them.
    `compile`: run the decode step's functions compiled by Inductor (`agents.compiling`). `stats` is the caller's
    counter dict: this adds `ENGINE_COUNTERS` (``compilations`` and ``compile_s``: those this engine's steps
    triggered).
    """

    def __init__(self, model: nn.Module, layout: DecoderLayout, *, max_slots: int, max_cache_len: int,
                 vocab_size: int, cuda_graphs: bool = True, compile: bool = False, length_step: int = 256,
                 stats: dict[str, int] | None = None):
        if max_slots < 1 or max_cache_len < 2 or length_step < 1:
            raise ValueError(f"need max_slots >= 1, max_cache_len >= 2, length_step >= 1; got {max_slots}, "
                             f"{max_cache_len}, {length_step}")
        self.model, self.layout = model, layout
        self.max_slots, self.max_cache_len, self.vocab_size = max_slots, max_cache_len, vocab_size
        self.cuda_graphs, self.length_step = cuda_graphs, length_step
        self.stats = stats if stats is not None else {}
        for key in ENGINE_COUNTERS:
            self.stats.setdefault(key, 0)
        self._functions = {fn.__name__: compiled(fn) if compile else fn for fn in COMPILED_FUNCTIONS}
        self._step_functions = tuple(self._functions[fn.__name__] for fn in STEP_FUNCTIONS)
        #: why nothing is captured any more (decode steps and prefill passes then run uncaptured)
        self.capture_failure: str | None = None
        self._state: _SlotState | None = None
        self._graphs: dict[tuple[int, int, str], Any] = {}  #: decode steps by (batch, length, mode) bucket
        self._prefill_graphs: dict[tuple[int, int], _PrefillGraph] = {}  #: small prefill passes by (rows, width)
        #: passes of each decode bucket and prefill key before its capture (kept after: one used before is captured
        #: again at once when the graphs are dropped, e.g. for reallocated parameters)
        self._uses: dict[tuple, int] = {}
        self._pool: Any = None
        self._side_stream: Any = None
        self._module_key: tuple | None = None  #: (device, dtype, parameter addresses) the cache and graphs are for

    # ------------------------------------------------------------------------------------- memory
    @property
    def allocated(self) -> bool:
        return self._state is not None

    @property
    def graphs(self) -> int:
        """Decode steps captured so far (one per batch bucket, length bucket and sampling mode used)."""
        return len(self._graphs)

    def cache_bytes(self) -> int:
        """Size of the KV cache when allocated."""
        lay = self.layout
        itemsize = torch.empty(0, dtype=_kv_dtype(self.layout)).element_size()
        return 2 * len(lay.layers) * self.max_slots * lay.kv_heads * self.max_cache_len * lay.head_dim * itemsize

    def allocate(self) -> None:
        """Create the KV cache and slot buffers (a no-op when they exist)."""
        if self._state is not None:
            return
        self.check_module(busy=False)
        device, dtype, lay, n = module_device(self.model), _kv_dtype(self.layout), self.layout, self.max_slots
        shape = (len(lay.layers), n, lay.kv_heads, self.max_cache_len, lay.head_dim)
        try:
            keys, values = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        except torch.cuda.OutOfMemoryError as e:
            raise GenerationError(f"the fast path's KV cache ({self.cache_bytes() / 2**30:.1f} GiB for {n} slots x "
                                  f"{self.max_cache_len} tokens) does not fit: lower max_batch_size or "
                                  f"max_cache_len") from e
        n += 1  # the spare entry (see _SlotState)
        self._state = _SlotState(
            keys, values, tokens=torch.zeros(n, dtype=torch.long, device=device),
            lengths=torch.zeros(n, dtype=torch.long, device=device),
            live=torch.zeros(n, dtype=torch.bool, device=device),
            temperature=torch.ones(n, dtype=torch.float32, device=device),
            top_k=torch.full((n,), self.vocab_size, dtype=torch.long, device=device),
            top_p=torch.full((n,), float("inf"), dtype=torch.float32, device=device),
            uniform=torch.zeros(n, dtype=cdf_dtype(device), device=device),
            out=torch.zeros(n, 2, dtype=torch.float64, device=device),
            host=(_HostSide.create(n, device), _HostSide.create(n, device)))
        if device.type == "cuda" and self._functions["decode_layer"] is not decode_layer:  # a compiled step
            self.warm_buckets()
        if self._capturing(device):
            self._capture_lone_prefills()

    @torch.no_grad()
    def warm_buckets(self) -> None:
        """Run the decode step once for every batch bucket, at the shortest length, with no row holding a slot (it
        changes no slot's state). Why: a bucket's first step builds what its shapes need (Inductor's kernels for a
        new size class, the attention kernel's plan: torch picks cuDNN's for the decode step on an H200), and a
        bucket that a few stray rows reach late — one episode whose turn ended early, decoding alone — then paid
        ~100 ms for its first step while every other row waited (H200)."""
        self.allocate()
        if bool(self._state.live.any()):
            raise RuntimeError("warm_buckets runs before any row holds a slot")
        length = min(self.length_step, self.max_cache_len)
        for rows in batch_buckets(self.max_slots):
            self._run_decode(rows, length, "greedy")

    @torch.no_grad()
    def _capture_lone_prefills(self) -> None:
        """Capture the prefill pass of one row at every graph width (`lone_prefill_keys`), as the cache is allocated
        (its K/V go to slot 0, which no row holds yet). Why: a lone row's pass is the small pass that recurs — an
        episode whose turn ended before the batch's gets one at each of its later turns, while every decoding row
        waits — and its capture on a key's `CAPTURE_ON_USE`-th use (a synchronisation, two warm-up passes, the
        recording: ~50-100 ms on an H200) fell inside rollouts, where the graph saves ~10-40 ms a pass."""
        device = self._state.live.device
        for key in lone_prefill_keys(self.max_cache_len):
            if key in self._prefill_graphs or not self._capturing(device):
                continue
            rows, width = key
            try:
                self._capture_prefill(key, torch.zeros(rows, width, dtype=torch.long, device=device),
                                      torch.full((rows,), width, dtype=torch.long, device=device),
                                      torch.zeros(rows, dtype=torch.long, device=device))
            except Exception:  # its warm-up failed (e.g. out of memory): that width waits for its own uses
                continue
            self._uses[key] = max(self._uses.get(key, 0), CAPTURE_ON_USE)  # dropped graphs: captured again at once

    def release(self) -> None:
        """Drop the KV cache, buffers and graphs (they come back on the next prefill, or `allocate`)."""
        self._state, self._pool, self._side_stream = None, None, None
        self._drop_graphs()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def check_module(self, busy: bool) -> None:
        """Notice reallocated parameters (graphs are captured again) or a module moved to another device or dtype
        (the cache is dropped; impossible while rows are decoding: `busy`).

        HFPolicy calls it before each prefill: weights change between generations (optimizer steps must not run
        while a generation is in flight), and every generation starts with a prefill. Walking the module's
        parameters costs ~0.7 ms for a 24-layer model, too much for every decode step."""
        key = _module_key(self.model, self.layout)
        if key == self._module_key:
            return
        if self._module_key is not None:
            self.stats["module_reallocations"] += 1
            self._drop_graphs()
            if key[:2] != self._module_key[:2] and self._state is not None:
                if busy:
                    raise GenerationError(f"the module moved from {self._module_key[:2]} to {key[:2]} while rows "
                                          f"were decoding")
                self.release()
        self._module_key = key

    # ------------------------------------------------------------------------------------- slots
    def free(self, slots: Sequence[int], clear: bool = False) -> None:
        """Mark slots free (they no longer advance); `clear` also zeroes their KV (after a failed pass, whose
        garbage could be non-finite)."""
        if self._state is None or not slots:
            return
        s = self._state
        index = _to_device(list(slots), torch.long, s.live.device)
        s.live.index_fill_(0, index, False)
        s.lengths.index_fill_(0, index, 0)
        if clear:
            for cache in (s.key_cache, s.value_cache):
                cache.index_fill_(1, index, 0)

    def move(self, moves: Sequence[tuple[int, int]], filled: int) -> None:
        """Copy each (from, to) slot's first `filled` KV positions and its per-slot state, then free `from`."""
        if not moves:
            return
        s = self._state
        src = _to_device([a for a, _ in moves], torch.long, s.live.device)
        dst = _to_device([b for _, b in moves], torch.long, s.live.device)
        for cache in (s.key_cache, s.value_cache):
            part = cache[:, :, :, :filled]
            part.index_copy_(1, dst, part.index_select(1, src))
        for buffer in s.per_slot:
            buffer.index_copy_(0, dst, buffer.index_select(0, src))
        self.free([a for a, _ in moves])

    def slot_lengths(self) -> list[int]:
        """Filled cache positions per slot (reads the device)."""
        return self._state.lengths[:self.max_slots].tolist() if self._state is not None else [0] * self.max_slots

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V caches [slots, kv_heads, max_cache_len, head_dim] (for inspection)."""
        return self._state.keys[layer], self._state.values[layer]

    def length_bucket(self, need: int) -> int:
        """Cache positions a step attends to: `need` rounded up to `length_step`, at most `max_cache_len`."""
        if not 0 < need <= self.max_cache_len:
            raise ValueError(f"a row needs {need} cache positions; the cache holds {self.max_cache_len}")
        return rounded_up(need, self.length_step, self.max_cache_len)

    # ------------------------------------------------------------------------------------- passes
    @torch.no_grad()
    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                sampling: RowSampling) -> tuple[list[int], list[float]]:
        """Prefill `prompts` into `slots` (one pass), sample each row's first token; returns the tokens and
        their logprobs. The slots then feed those tokens at the prompts' lengths. A small pass replays a CUDA graph
        (`PREFILL_GRAPH_ROWS`). The inputs go up asynchronously: the host launches the pass while the device
        finishes a decode step in flight."""
        self.allocate()
        s = self._state
        device = s.live.device
        longest = max(len(p) for p in prompts)
        if longest > self.max_cache_len:
            raise ValueError(f"a prompt of {longest} tokens exceeds max_cache_len {self.max_cache_len}")
        width = prefill_width(longest, self.max_cache_len)
        key = prefill_graph_key(len(prompts), width, self.max_cache_len) if self._capturing(device) else None
        width = key[1] if key is not None else width
        ids = _to_device([list(p) + [0] * (width - len(p)) for p in prompts], torch.long, device)
        lengths = _to_device([len(p) for p in prompts], torch.long, device)
        index = _to_device(list(slots), torch.long, device)
        if key is None:
            logits = self._run_prefill(ids, lengths, index)
        else:
            logits = self._prefill_replay(key, ids, lengths, index)
        temperature, uniform, top_k, top_p = sampling.tensors(device)
        tokens, logprobs = sample_tokens(logits, temperature, uniform, top_k, top_p, sampling.mode)
        for buffer, value in zip(s.per_slot, (tokens, lengths, torch.ones_like(tokens, dtype=torch.bool),
                                              temperature, top_k, top_p)):
            buffer.index_copy_(0, index, value)
        return tokens.tolist(), logprobs.tolist()

    def _prefill_logits(self, ids: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The prefill's forward (what a prefill graph captures): the right-padded prompts `ids` [rows, width]
        through every layer, their K/V written into `slots`; float32 logits [rows, vocab] at each row's last real
        position."""
        s, lay = self._state, self.layout
        n, width = ids.shape
        x = lay.embed(ids)
        cos, sin = lay.rotary(x, torch.arange(width, device=x.device)[None, :].expand(n, width))
        layer_fn, head = self._functions["prefill_layer"], self._functions["head_logits"]
        for layer, keys, values in zip(lay.layers, s.keys, s.values):
            x = layer_fn(layer, x, cos, sin, slots, keys, values, lay.apply_rope, lay.qk_norm)
        last = x[torch.arange(n, device=x.device)[:, None], (lengths - 1)[:, None]]  # [n, 1, hidden], not a view
        return head(lay.norm, lay.lm_head, last, self.vocab_size)

    def _run_prefill(self, ids: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`_prefill_logits` outside a capture, adding the compilations it triggers to `stats`."""
        with self._compilations_counted():
            return self._prefill_logits(ids, lengths, slots)

    def _prefill_replay(self, key: tuple[int, int], ids: torch.Tensor, lengths: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
        """`_prefill_logits` from the graph of `key` (captured on its `CAPTURE_ON_USE`-th use, uncaptured before).
        The logits returned live in the graphs' shared pool: read them before the next replay of any graph."""
        graph = self._prefill_graphs.get(key)
        if graph is None:
            uses = self._uses[key] = self._uses.get(key, 0) + 1
            if uses < CAPTURE_ON_USE:
                return self._run_prefill(ids, lengths, slots)
            graph = self._capture_prefill(key, ids, lengths, slots)
            if graph is None:  # it cannot be captured (nor can anything from now on): run it uncaptured
                return self._run_prefill(ids, lengths, slots)
        for buffer, value in zip(graph.inputs, (ids, lengths, slots)):
            buffer.copy_(value)
        graph.graph.replay()
        self.stats["prefill_graph_replays"] += 1
        return graph.logits

    @property
    def compile_reason(self) -> str:
        """Whether the decode step and the prefill run compiled, and why not where they do not."""
        functions = list(self._functions.values())
        if functions == list(COMPILED_FUNCTIONS):
            return "off: eager decode step and prefill"
        failures = [fn.failure for fn in functions if fn.failure]
        if not failures:
            return "on: decode step and prefill compiled by Inductor"
        return f"{'off' if len(failures) == len(functions) else 'partly off'}: {'; '.join(failures)}"

    @torch.no_grad()
    def launch(self, rows: int, need: int, uniforms: Sequence[float] | None, mode: str) -> LaunchedStep:
        """Enqueue one decode step for slots [0, rows) (`rows` a batch bucket; free slots among them are padding;
        with CUDA graphs, slots from `rows` on must be free: a larger bucket's graph may run the step), and the copy
        of its outputs to host memory; on CUDA, return without waiting for the device. Each live slot feeds its next
        token and samples one. `need`: the most cache positions a live row attends to (its filled
        length + 1); `uniforms`: one per slot (None for a greedy step: nothing is drawn).

        A step's inputs (tokens, lengths) are the previous step's outputs, already on the device: the next step can
        be launched before this one is collected, so that the host reads one step's tokens while the device
        computes the next. Steps run in launch order, and so do `prefill`, `free` and `move` between them. At most
        two launched steps may be uncollected (they use alternate host buffers)."""
        s = self._state
        length = self.length_bucket(need)
        if uniforms is None and mode != "greedy":
            raise ValueError(f"a {mode!r} step needs one uniform number per slot")
        host = s.host[s.launches % 2]
        if host.step is not None and not host.step.collected:
            raise RuntimeError("two launched decode steps are not collected yet: collect the older one first")
        device = s.live.device
        with _on_device(device):
            if uniforms is not None:  # into host memory no copy still reads (its step was collected)
                host.uniform.numpy()[:rows] = uniforms  # numpy: the GIL stays held (see `collect`)
                s.uniform[:rows].copy_(host.uniform[:rows], non_blocking=True)
            if self._capturing(device):
                self._replay((rows, length, mode))
            else:
                self._run_decode(rows, length, mode)
            host.out[:rows].copy_(s.out[:rows], non_blocking=True)
            if host.event is not None:
                host.event.record()
        s.launches += 1
        host.step = LaunchedStep(rows, host)
        return host.step

    def collect(self, step: LaunchedStep) -> tuple[list[int], list[float]]:
        """Wait for a launched step's outputs (without holding the GIL) and return every slot's token and
        logprob. The host buffers are read through numpy: a torch call releases the GIL and must take it back,
        which waits while another thread runs Python (HFPolicy's caller): a step's host work makes few of them."""
        if step.host.event is not None:
            step.host.event.synchronize()
        out = step.host.out.numpy()[:step.rows]
        tokens, logprobs = out[:, 0].astype(np.int64).tolist(), out[:, 1].tolist()
        step.collected = True
        return tokens, logprobs

    def step(self, rows: int, need: int, uniforms: Sequence[float] | None, mode: str) -> tuple[list, list]:
        """`launch` and `collect` one step: every slot's token and logprob."""
        return self.collect(self.launch(rows, need, uniforms, mode))

    def _run_decode(self, rows: int, length: int, mode: str) -> None:
        """`_decode` outside a capture, adding the compilations it triggers to `stats`."""
        with self._compilations_counted():
            self._decode(rows, length, mode)

    @contextlib.contextmanager
    def _compilations_counted(self):
        """Add the compilations (and their seconds) made inside the block to `stats`."""
        before = dict(COMPILE_COUNTS)
        try:
            yield
        finally:
            self.stats["compilations"] += COMPILE_COUNTS["compilations"] - before["compilations"]
            self.stats["compile_s"] += COMPILE_COUNTS["compile_s"] - before["compile_s"]

    def _decode(self, rows: int, length: int, mode: str) -> None:
        """The decode step over slots [0, rows) attending to `length` positions: what a CUDA graph captures."""
        s, lay = self._state, self.layout
        inputs, layer_step, head = self._step_functions
        tokens, lengths, live = s.tokens[:rows], s.lengths[:rows], s.live[:rows]
        x, cos, sin, at, mask = inputs(lay.embed, lay.rotary, tokens, lengths, length)
        for layer, keys, values in zip(lay.layers, s.keys, s.values):
            x = layer_step(layer, x, cos, sin, at, mask, keys, values, lay.apply_rope, lay.qk_norm)
        logits = head(lay.norm, lay.lm_head, x, self.vocab_size)
        token, logprob = sample_tokens(logits, s.temperature[:rows], s.uniform[:rows], s.top_k[:rows], s.top_p[:rows],
                                       mode)
        s.out[:rows, 0] = token
        s.out[:rows, 1] = logprob
        tokens.copy_(torch.where(live, token, tokens))
        lengths.add_(live)

    # ------------------------------------------------------------------------------------- CUDA graphs
    def _replay(self, key: tuple[int, int, str]) -> None:
        """The step of `key` from its graph; before it is captured, from a larger bucket's graph (`stand_in`) or
        uncaptured, until its `CAPTURE_WITH_STAND_IN`-th or `CAPTURE_ON_USE`-th use."""
        graph = self._graphs.get(key)
        if graph is None:
            uses = self._uses[key] = self._uses.get(key, 0) + 1
            larger = stand_in(key, self._graphs)
            if larger is not None and uses < CAPTURE_WITH_STAND_IN:
                self._graphs[larger].replay()
                self.stats["stand_in_replays"] += 1
                return
            if larger is None and uses < CAPTURE_ON_USE:
                self.stats["uncaptured_steps"] += 1
                self._run_decode(*key)
                return
            recorded = self._try_capture(lambda: self._warm_up(key), lambda: self._decode(*key))
            if recorded is None:  # the step runs eagerly but cannot be captured: run every step eagerly
                self._run_decode(*key)
                return
            graph = self._graphs[key] = recorded[0]
            self.stats["graph_captures"] += 1
        graph.replay()
        self.stats["graph_replays"] += 1

    def _warm_up(self, key: tuple[int, int, str]) -> None:
        """Run the step eagerly on the side stream (cuBLAS handles and workspaces get created; a compiled step
        compiles and autotunes here, never during capture), then restore the tokens and lengths it advanced."""
        s = self._state
        saved = s.tokens.clone(), s.lengths.clone()
        try:
            self._on_side_stream(lambda: self._run_decode(*key))
        finally:
            s.tokens.copy_(saved[0])
            s.lengths.copy_(saved[1])

    def _capture_prefill(self, key: tuple[int, int], ids: torch.Tensor, lengths: torch.Tensor,
                         slots: torch.Tensor) -> _PrefillGraph | None:
        """Warm up and capture the prefill pass of `key` with these inputs as its buffers (the warm-up writes the
        K/V the pass itself writes); None when it cannot be captured (`capture_failure`)."""
        inputs = (ids.clone(), lengths.clone(), slots.clone())
        recorded = self._try_capture(lambda: self._on_side_stream(lambda: self._run_prefill(*inputs)),
                                     lambda: self._prefill_logits(*inputs))
        if recorded is None:
            return None
        captured = self._prefill_graphs[key] = _PrefillGraph(recorded[0], inputs, recorded[1])
        self.stats["prefill_graph_captures"] += 1
        return captured

    def _try_capture(self, warm_up: Callable[[], Any], run: Callable[[], Any]) -> tuple[Any, Any] | None:
        """With nothing in flight, `warm_up` (an error there is the pass's own: it propagates), then `_record` of
        `run`; None when the capture fails (`_capture_failed`: nothing is captured from then on)."""
        torch.cuda.current_stream(self._state.live.device).synchronize()
        warm_up()
        try:
            return self._record(run)
        except Exception as e:
            self._capture_failed(e)
            return None

    def _on_side_stream(self, run: Callable[[], Any]) -> None:
        """`run` `WARMUP_STEPS` times on the side stream graphs are captured on, after the work queued so far."""
        device = self._state.live.device
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device)
            self._pool = torch.cuda.graph_pool_handle()
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(side):
                for _ in range(WARMUP_STEPS):
                    run()
        finally:  # also after an error: later work on the current stream must not overtake the warm-up
            torch.cuda.current_stream(device).wait_stream(side)

    def _record(self, run: Callable[[], Any]) -> tuple[Any, Any]:
        """Capture `run` (warmed up) into a CUDA graph; returns the graph and what `run` returned.

        All graphs share one memory pool (they never replay concurrently): what a graph returns is read before the
        next replay of any graph (the decode step's outputs are persistent buffers outside the pool). The capture
        is ``thread_local``: other threads may use CUDA meanwhile (HFPolicy's callers, a trainer). The garbage
        collector is paused during it: a collection on this thread could free tensors whose release records CUDA
        events (pinned host memory used by asynchronous copies), which a capture forbids."""
        graph = torch.cuda.CUDAGraph()
        with collector_paused(), torch.cuda.graph(graph, pool=self._pool, stream=self._side_stream,
                                            capture_error_mode="thread_local"):
            out = run()
        return graph, out

    def _capture_failed(self, error: Exception) -> None:
        """Nothing is captured from now on: decode steps and prefill passes run eagerly."""
        self.capture_failure = f"{type(error).__name__}: {str(error).strip()[:300]}"
        self.stats["capture_failures"] += 1

    def _capturing(self, device: torch.device) -> bool:
        """Whether passes run from CUDA graphs."""
        return self.cuda_graphs and device.type == "cuda" and self.capture_failure is None

    def _drop_graphs(self) -> None:
        """Forget every graph (their uses are kept: a bucket used before is captured again at once)."""
        self._graphs, self._prefill_graphs = {}, {}


# --------------------------------------------------------------------------------------------- helpers
def module_device(model: nn.Module) -> torch.device:
    """Where the module's parameters are (CPU for a module without any)."""
    return next(model.parameters(), torch.empty(0)).device


def _kv_dtype(layout: DecoderLayout) -> torch.dtype:
    return layout.layers[0].self_attn.k_proj.weight.dtype


def _module_key(model: nn.Module, layout: DecoderLayout) -> tuple:
    addresses = tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))
    return module_device(model), _kv_dtype(layout), addresses


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device` without waiting for the device (a plain copy from pageable
    memory would wait for the step in flight: through pinned memory, asynchronously)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _on_device(device: torch.device):
    """``torch.cuda.device(device)`` for a CUDA device (a graph replays on the current device's stream)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
