"""Exact mode's operations: batch-invariant versions of the few operations of a Llama-family decoder whose result for
one token could depend on what else is in the pass (docs/exact.md). With them, a token's logprob is a function of
its own sequence's tokens only, bit for bit, whether the engine decodes it over a KV cache, prefills it after a
cached prefix, or the trainer scores it in a padded or packed micro-batch of any size.

* `linear`: every row computed in a matmul of ``TILE_ROWS`` rows (padded to whole tiles in fresh memory), so a
  row's reduction order never depends on how many rows a pass has.
* `tree_sum`: sums by pairwise halving with elementwise additions, an order fixed by the reduced length alone
  (RMSNorm's mean `mean_last`, the log-softmax's sum, a key block's softmax weights).
* `silu`: ``x / (1 + exp(-x))`` (ATen's vectorised and scalar sigmoid differ in the last bit).
* `attention`: one function for decode, prefill and training: the key axis cut into blocks of ``KEY_BLOCK``
  positions from position 0, an online softmax over them in order; a block a query cannot see changes nothing;
  a query's products are matmuls of one shape (tiles of ``QUERY_TILE`` rows), as `linear`'s.
* `tempered_log_softmax`: the sampler's logprobs, from `softmax_stats` (max, sum of exp in a fixed order);
  `stats_logprob` and `token_logprob` (the trainer's, with a written-out gradient): the same bits for one token per
  row. `sample`: the sampler's inverse CDF, in an order set by the vocabulary alone.

`ops()` routes a module's ``F.linear``, ``F.silu`` and last-dimension ``mean`` through these while it is active (a
thread-local `TorchFunctionMode`): the engine's layer functions and the trainer's transformers forward run the
module's own code, adapters (LoRA) included, with exact operations. The trainer's attention goes through
`sequence_attention` (`trainers.modeling` passes the layout). On CUDA, where Triton imports, `linear` and `attention`
run `agents.triton_exact`'s kernels (`_kernels`: the one switch, by device alone, so the engine and the trainer
always take the same path); the torch versions here are the CPU path. There both sides can also run the decoder
layers compiled by Inductor (`compiles_layers`), the kernels opaque custom ops in the graph. Why: docs/exact.md.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from agents.compiling import compiled

#: rows per matmul call of `linear` (a pass pads its rows to whole tiles)
TILE_ROWS = 32
#: ids per block of `sample`'s walk over a row (a power of two)
SAMPLE_BLOCK = 1024
#: key positions per block of `attention`'s online softmax
KEY_BLOCK = 32
#: (query, head) rows per matmul of `attention`'s torch version (padded to whole tiles in fresh memory)
QUERY_TILE = 16


#: set to 1 to run the Triton kernels on CPU too (under ``TRITON_INTERPRET=1``: a slow check of the CUDA path's logic)
KERNELS_ON_CPU = "MT_ENV_EXACT_TRITON_ON_CPU"
_ON_CPU = os.environ.get(KERNELS_ON_CPU) == "1"
#: True: where the kernels run (CUDA), the decoder layers run compiled by Inductor on both sides (`compiles_layers`;
#: why and what it was measured to gain: docs/exact.md, "Compiled layers"). ``MT_ENV_EXACT_COMPILE_LAYERS=0`` runs
#: them eagerly. Read when an engine or an exact `PolicyModel` is made.
COMPILE_LAYERS = os.environ.get("MT_ENV_EXACT_COMPILE_LAYERS", "1") != "0"
_TRITON = None  #: `agents.triton_exact` once loaded (`_load_kernels`), False where Triton does not import


def _load_kernels():
    global _TRITON
    if _TRITON is None:
        try:
            from . import triton_exact
            _TRITON = triton_exact
        except ImportError:  # a torch build without Triton: the torch versions, slower but exact
            _TRITON = False
    return _TRITON or None


def _kernels(t: torch.Tensor):
    """`agents.triton_exact` when `t` is on CUDA (or `KERNELS_ON_CPU` is set) and Triton imports, else None (the
    torch versions below). (No import and no cache wrapper here: compiled layers trace this; `ops` loads first.)"""
    if t.device.type != "cuda" and not _ON_CPU:
        return None
    if _TRITON is None:
        return _load_kernels()
    return _TRITON or None


def runs_kernels(t: torch.Tensor) -> bool:
    """Whether exact mode's operations on `t` run the Triton kernels (else the torch versions)."""
    return _kernels(t) is not None


def compiles_layers(device: torch.device) -> bool:
    """Whether exact mode runs the decoder layers compiled by Inductor on `device`: where the Triton kernels run
    (CUDA), when `COMPILE_LAYERS` is on. The engine (its layer functions) and the trainer (`compile_layers`) both
    ask this, so both run the same code: Inductor rounds bf16 where eager does (``emulate_precision_casts``), but its
    arithmetic (exp, rsqrt, fused multiply-adds) is its own, the same in every graph. Embeddings, RoPE tables, the
    final norm, the LM head and the log-softmax stay eager on both sides. CPU: eager (Inductor's C++ would give a
    vectorised body and a scalar tail different bits)."""
    return COMPILE_LAYERS and torch.device(device).type == "cuda" and _load_kernels() is not None


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """The sum over `dim` by pairwise halving (zero-padded to a power of two): the same bits for a row whatever the
    other dimensions hold."""
    dim = dim % x.dim()
    n = x.shape[dim]
    size = 1 << max(0, n - 1).bit_length()
    if size != n:
        shape = list(x.shape)
        shape[dim] = size - n
        x = torch.cat([x, x.new_zeros(shape)], dim)
    while x.shape[dim] > 1:
        half = x.shape[dim] // 2
        x = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
    return x if keepdim else x.squeeze(dim)


def last_sum(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """The sum over the last dimension in an order fixed by its length: `tree_sum`, or on CUDA (float32)
    `triton_exact.row_sum` (one launch)."""
    kernels = _kernels(x)
    if kernels is not None and x.dtype == torch.float32:
        return kernels.row_sum(x, keepdim)
    return tree_sum(x, -1, keepdim)


def mean_last(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """The mean over the last dimension (RMSNorm's), by `last_sum`."""
    return last_sum(x, keepdim) / x.shape[-1]


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose every row is computed in a matmul of `TILE_ROWS` rows (the bias added after); on CUDA
    `triton_matmul.matmul` (one fixed order over K)."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    padded = -(-m // TILE_ROWS) * TILE_ROWS
    kernels = _kernels(x)
    if kernels is not None:
        out = kernels.matmul(rows, weight)
    elif m == 0:
        out = rows @ weight.t()
    else:  # a fresh allocation: every tile starts at the same alignment; one matmul of [TILE_ROWS, K] per tile
        k, n = rows.shape[1], weight.shape[0]
        tiles = torch.cat([rows, rows.new_zeros(padded - m, k)]).view(-1, TILE_ROWS, k)
        out = torch.bmm(tiles, weight.t().expand(len(tiles), k, n)).view(padded, n)[:m]  # (expand: no copy)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def softmax_stats(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """For each row of `logits` [N, V] and float32 `temperature` [N], with z = logits.float() / T: float32 [N, 3] of
    (m, s, w), m the max of z, s the sum of exp(z - m) in an order set by V alone (a row's bits do not depend on the
    other rows), w the sum of exp(z - m) * z (for the entropy). On CUDA one `triton_exact.softmax_stats` launch that
    reads the logits twice; on CPU `tree_sum`."""
    kernels = _kernels(logits)
    if kernels is not None:
        return kernels.softmax_stats(logits, temperature)
    z = logits.float() / temperature.float()[:, None]
    top = z.amax(-1, keepdim=True)
    e = torch.exp(z - top)
    return torch.stack([top[:, 0], tree_sum(e), (e * z).sum(-1)], -1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One id per row of float32 `logits` [N, V], by inverse CDF over p ∝ exp(z - m) (z = logits / `temperature` [N],
    m = `top` [N], `softmax_stats`' max) at each row's `uniform` [N] in [0, 1), in an order set by V alone: the
    weights summed in blocks of `SAMPLE_BLOCK` (one `tree_sum` each), the blocks in order into a float64 total; the
    id is in the first block whose running sum passes u x total, where a running sum in id order passes it, or the
    nearest id before it of non-zero weight. A row's id depends on its own logits and u only; a NaN row gets the last
    id. On CUDA one `triton_sampling.sample` launch: the same steps, but inside the block it halves (the target in
    the left half's sum, or past it), which no lane layout can reorder; the ids agree but at an interval's edge."""
    if _kernels(logits) is not None:
        from . import triton_sampling

        return triton_sampling.sample(logits, temperature, top, uniform, SAMPLE_BLOCK)
    rows, vocab = logits.shape
    width = min(SAMPLE_BLOCK, 1 << max(0, vocab - 1).bit_length())
    blocks = -(-vocab // width)
    z = logits.float() / temperature.float()[:, None]
    weights = F.pad(torch.exp(z - top[:, None]), (0, blocks * width - vocab)).view(rows, blocks, width)
    after = tree_sum(weights, -1).double().cumsum(-1)  # the running sum after each block, in order
    total = after[:, -1]
    target = torch.minimum(uniform.double() * total, total * (1.0 - 2.0 ** -52))
    block = (after <= target[:, None]).sum(-1).clamp(max=blocks - 1)
    running = torch.where(block > 0, after.gather(1, (block - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    inside = weights[torch.arange(rows, device=logits.device), block]
    lanes = torch.arange(width, device=logits.device)
    # in the block: a float64 running sum in id order (sequential per row on CPU: a few operations, where the kernel's
    # halving would be a hundred small ones)
    lo = ((running[:, None] + inside.double().cumsum(-1)) <= target[:, None]).sum(-1).clamp(max=width - 1)
    positive = inside > 0  # (the block's sum rounds apart from its parts': never an id of weight 0)
    last = torch.where(positive, lanes, -1).cummax(-1).values.gather(1, lo[:, None])[:, 0]
    lane = torch.where(last >= 0, last, torch.where(positive, lanes, width).amin(-1))
    return torch.where(torch.isnan(total), vocab - 1, (block * width + lane).clamp(max=vocab - 1))


def stats_logprob(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                  stats: torch.Tensor) -> torch.Tensor:
    """The logprob of `targets` [N] under ``tempered_log_softmax(logits, temperature)`` from its `softmax_stats`
    `stats` [N, 3]: (z - m) - log(s) of the target's z alone, the same bits as that function's entry."""
    z = logits.gather(1, targets[:, None]).squeeze(1).float() / temperature.float()
    return (z - stats[:, 0]) - torch.log(stats[:, 1])


def tempered_log_softmax(logits: torch.Tensor, temperature: torch.Tensor,
                         stats: torch.Tensor | None = None) -> torch.Tensor:
    """``log_softmax(logits.float() / temperature[:, None])`` of `logits` [N, vocab] with a per-row float32
    `temperature` [N], as (z - m) - log(s) of `softmax_stats` (`stats`, where the caller has them already): the
    engine's sampler's logprobs in exact mode. `token_logprob` gives the trainer the same bits for one token per row."""
    if stats is None:
        stats = softmax_stats(logits, temperature)
    z = logits.float() / temperature.float()[:, None]
    return (z - stats[:, :1]) - torch.log(stats[:, 1:2])


def token_logprob(logits: torch.Tensor, targets: torch.Tensor,
                  temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logprob of `targets` [N] under ``tempered_log_softmax(logits, temperature)`` — the same bits as that
    function's entry, computed without it — and the distribution's entropy (float32 [N] each). Differentiable in
    `logits`: the backward is the softmax's gradient, written out (one pass over the logits; not compared bit for
    bit), so no [N, vocab] float32 tensor is kept or made beyond the backward's own."""
    return _TokenLogprob.apply(logits, targets, temperature)


class _TokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature):
        temperature = temperature.float()
        stats = softmax_stats(logits, temperature)
        log_normaliser = stats[:, 0] + torch.log(stats[:, 1])
        entropy = log_normaliser - stats[:, 2] / stats[:, 1]
        ctx.save_for_backward(logits, targets, temperature, log_normaliser, entropy)
        return stats_logprob(logits, targets, temperature, stats), entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, targets, temperature, log_normaliser, entropy = ctx.saved_tensors
        grad = (compiled(_logits_grad) if logits.is_cuda else _logits_grad)(
            logits, targets, temperature, log_normaliser, entropy, _or_zeros(grad_logprob, entropy),
            _or_zeros(grad_entropy, entropy))
        return grad, None, None


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad


def _logits_grad(logits, targets, temperature, log_normaliser, entropy, grad_logprob, grad_entropy):
    """d/dlogits of grad_logprob * log p(target) + grad_entropy * H, with log p = z - log_normaliser, z = x / T:
    (onehot - p) * grad_logprob - p * (log p + H) * grad_entropy, over T, in the logits' dtype. The one-hot term is a
    comparison with the column index, not a scatter: compiled, the whole gradient is one pass over the logits (a
    scatter made Inductor write a float32 [N, vocab] and read it again to divide and cast; docs/exact.md)."""
    logp = logits.float() / temperature[:, None] - log_normaliser[:, None]
    p = torch.exp(logp)
    grad_z = -p * (grad_logprob[:, None] + grad_entropy[:, None] * (logp + entropy[:, None]))
    target = torch.arange(logits.shape[1], device=logits.device) == targets[:, None]
    grad_z = torch.where(target, grad_z + grad_logprob[:, None], grad_z)
    return (grad_z / temperature[:, None]).to(logits.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_len: torch.Tensor,
              scale: float, k_index: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of queries `q` [S, heads, Tq, d] at positions `q_pos` [S, Tq] over keys/values `k`, `v`
    [S, kv_heads, Tk, d] whose index is their position, the first `k_len` [S] of them valid: [S, heads, Tq, d].
    With `k_index` [S, Tk], `k` and `v` are flat rows [P, kv_heads, d] and position t of sequence s is row
    ``k_index[s, t]`` (a paged cache, or a packed batch, read in place; the same bits as gathered keys).
    Online softmax over blocks of `KEY_BLOCK` keys from position 0, in float32; a query that sees no key gets 0.
    On CUDA `triton_exact.attention` (blocks of its own `KEY_BLOCK`), the same function for the engine and trainer."""
    kernels = _kernels(q)
    if kernels is not None:
        return kernels.attention(q, k, v, q_pos, k_len, scale, k_index)
    if k_index is not None:
        k, v = k[k_index].transpose(1, 2), v[k_index].transpose(1, 2)
    with torch._C.DisableTorchFunction():  # plain tensors in, and no op of this loop for `ops()` to route
        return _attention(q, k, v, q_pos, k_len, scale)


def _attention(q, k, v, q_pos, k_len, scale):
    """`attention` in torch operations: each (query, head) row's scores and weighted values are matmuls of one
    shape, [QUERY_TILE, d] x [d, KEY_BLOCK] and [QUERY_TILE, KEY_BLOCK] x [KEY_BLOCK, d], whatever the call holds."""
    S, heads, Tq, d = q.shape
    kv_heads, group = k.shape[1], heads // k.shape[1]
    if S == 0 or Tq == 0 or k.shape[2] == 0:
        return q.new_zeros((S, heads, Tq, d), dtype=torch.float32)
    qt, pos = _query_tiles(q, q_pos, group)
    keys, values, seen_key = _key_blocks(k, v, k_len)
    tiles, blocks = qt.shape[2], keys.shape[2]
    # a tile whose queries all precede a block is done before it (for them the block would be an exact no-op:
    # p = 0, rescale 1); tiles finish in order, so the running state covers the tiles [lo, tiles) (no in-place
    # updates: autograd differentiates the loop in the update's forward)
    tile_last = pos.view(S, tiles, QUERY_TILE).amax(-1).amax(0).tolist()  # each tile's last position, over S
    m = qt.new_full((S, kv_heads, tiles, QUERY_TILE, 1), torch.finfo(torch.float32).min)
    total, acc, lo, done = torch.zeros_like(m), torch.zeros_like(qt), 0, []
    offsets = torch.arange(KEY_BLOCK, device=q.device)
    for j in range(blocks):
        first = next((t for t, last in enumerate(tile_last) if last >= j * KEY_BLOCK), tiles)
        if first > lo:
            done.append((acc[:, :, :first - lo], total[:, :, :first - lo]))
            m, total, acc, lo = m[:, :, first - lo:], total[:, :, first - lo:], acc[:, :, first - lo:], first
        if lo == tiles:
            break
        scores = torch.matmul(qt[:, :, lo:], keys[:, :, j, None]) * scale  # [S, kv_heads, tiles - lo, tile, block]
        seen = (j * KEY_BLOCK + offsets <= pos[:, :, lo:]) & seen_key[:, j]
        scores = scores.masked_fill(~seen, float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        p = torch.exp(scores - m_new)
        alpha = torch.exp(m - m_new)
        total = total * alpha + tree_sum(p, -1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, values[:, :, j, None])
        m = m_new
    done.append((acc, total))
    acc, total = torch.cat([a for a, _ in done], 2), torch.cat([t for _, t in done], 2)
    acc = acc / torch.where(total > 0, total, torch.ones_like(total))
    acc = acc.view(S, kv_heads, tiles * QUERY_TILE, d)[:, :, :Tq * group].reshape(S, kv_heads, Tq, group, d)
    return acc.transpose(2, 3).reshape(S, heads, Tq, d)


def _query_tiles(q: torch.Tensor, q_pos: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (query, head) rows of each KV head, query-major (as the Triton kernel lays them out), in whole tiles of
    fresh float32 memory: [S, kv_heads, tiles, QUERY_TILE, d] (padding rows zero); and each row's position
    [S, 1, tiles, QUERY_TILE, 1] (padding rows -1: they see nothing)."""
    S, heads, Tq, d = q.shape
    rows = Tq * group
    tiles = -(-rows // QUERY_TILE)
    qt = q.new_zeros((S, heads // group, tiles * QUERY_TILE, d), dtype=torch.float32)
    qt[:, :, :rows] = q.float().reshape(S, heads // group, group, Tq, d).transpose(2, 3).reshape(S, -1, rows, d)
    pos = q_pos.new_full((S, tiles * QUERY_TILE), -1)
    pos[:, :rows] = q_pos.repeat_interleave(group, 1)
    return qt.view(S, heads // group, tiles, QUERY_TILE, d), pos.view(S, 1, tiles, QUERY_TILE, 1)


def _key_blocks(k: torch.Tensor, v: torch.Tensor, k_len: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Keys as [S, kv_heads, blocks, d, KEY_BLOCK] and values as [S, kv_heads, blocks, KEY_BLOCK, d] in float32,
    values zero past each sequence's `k_len` (no NaN of an unwritten position reaches a product: 0 * NaN), and
    which keys are valid, [S, blocks, 1, 1, 1, KEY_BLOCK] (broadcast against a block's scores)."""
    S, kv_heads, Tk, d = k.shape
    blocks = -(-Tk // KEY_BLOCK)
    valid = torch.arange(blocks * KEY_BLOCK, device=k.device)[None, :] < k_len[:, None]  # [S, keys]
    keys = k.new_zeros((S, kv_heads, blocks * KEY_BLOCK, d), dtype=torch.float32)
    keys[:, :, :Tk] = k  # (a key past k_len is never seen: its score is masked)
    values = torch.where(valid[:, None, :, None], F.pad(v.float(), (0, 0, 0, blocks * KEY_BLOCK - Tk)), 0.0)
    keys = keys.view(S, kv_heads, blocks, KEY_BLOCK, d).transpose(-1, -2).contiguous()
    return keys, values.view(S, kv_heads, blocks, KEY_BLOCK, d), valid.view(S, blocks, 1, 1, 1, KEY_BLOCK)


# --------------------------------------------------------------------------------------------- the trainer's layout
@dataclass(frozen=True)
class Sequences:
    """Where the sequences of a [B, T] batch (padded or packed) lie: `index` [S, L] flat token indices of each
    sequence's positions 0..L-1 (clamped past its end), `lengths` [S]; and back, each flat token's sequence `seq` and
    position `pos` [B * T] (0 for a token of none: `real` [B * T] False); and `segments` [K + 1] int32, the flat
    tokens cut into runs, each sequence one run and the tokens of none between them in runs of at most L (flash
    attention's varlen boundaries over every token, so its backward reads and writes the rows in place). Every shape
    is set by the inputs' (no boolean indexing where the attention runs: compiled layers trace it whole)."""

    index: torch.Tensor
    lengths: torch.Tensor
    seq: torch.Tensor
    pos: torch.Tensor
    real: torch.Tensor
    segments: torch.Tensor


def sequences(position_ids: torch.Tensor, real: torch.Tensor) -> Sequences:
    """The sequences of a batch whose real tokens (`real` [B, T] bool) have `position_ids` [B, T] counting from 0
    within each sequence (a sequence starts at each real token of position 0); ValueError when they do not. One host
    sync (the counts that size the layout), where each data-dependent size would cost one."""
    pos, real = position_ids.reshape(-1), real.reshape(-1).bool()
    if not len(pos):
        raise ValueError("exact attention: no sequence starts at position 0")
    flat = torch.arange(len(pos), device=pos.device)
    starts = real & (pos == 0)
    seq = torch.cumsum(starts.long(), 0) - 1  # -1: a token before the first start
    run = torch.where(real & (seq >= 0), seq, len(pos))  # a real token's sequence; others count in a bin past the end
    counts = torch.zeros(len(pos) + 1, dtype=torch.long, device=pos.device).scatter_add_(0, run, torch.ones_like(run))
    first = torch.cummax(torch.where(starts, flat, 0), 0).values  # where the token's sequence starts
    # a sequence's real tokens have positions 0, 1, ... in a run from its start: each is its offset from the start,
    # below the sequence's count (so the offsets are 0..count-1, each once)
    ok = ~real | ((seq >= 0) & (pos == flat - first) & (pos < counts[seq.clamp(min=0)]))
    longest = counts[:-1].max()
    # segment boundaries: each sequence's start, and every L-th token of a run of tokens of no sequence from its first
    other = ~real
    other_first = torch.cummax(torch.where(other & ~F.pad(other[:-1], (1, 0)), flat, 0), 0).values
    bounds = starts | (other & ((flat - other_first) % longest.clamp(min=1) == 0))
    summary = torch.stack([starts.sum(), longest, bounds.sum(), ok.all().long()])
    S, L, K, valid = summary.tolist()
    if S == 0:
        raise ValueError("exact attention: no sequence starts at position 0")
    if not valid:
        raise ValueError("exact attention needs each sequence's real tokens in a run with positions 0, 1, 2, ...")
    lengths = counts[:S]
    offsets = torch.arange(L, device=pos.device)
    index = (torch.nonzero_static(starts, size=S).squeeze(1)[:, None] + offsets[None, :]).clamp(max=len(pos) - 1)
    segments = F.pad(torch.nonzero_static(bounds, size=K).squeeze(1).to(torch.int32), (0, 1), value=len(pos))
    return Sequences(index, lengths, torch.where(real, seq, 0), torch.where(real, pos, 0), real, segments)


def sequence_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: Sequences,
                       scale: float) -> torch.Tensor:
    """`attention` for transformers' layout: `query` [B, heads, T, d], `key`/`value` [B, kv_heads, T, d], each
    sequence (`layout`) on its own; returns [B, T, heads, d] (0 on padding), what transformers' attention
    functions return."""
    B, heads, T, d = query.shape

    def rows(x):  # [B, h, T, d] -> [B * T, h, d]: a token per row
        return x.transpose(1, 2).reshape(B * T, x.shape[1], d)

    kernels = _kernels(query)
    if kernels is not None:  # the same arithmetic in one op, whose backward can be flash attention's
        out = kernels.sequence_attention(rows(query), rows(key), rows(value), layout.index, layout.lengths,
                                         layout.seq, layout.pos, layout.real, layout.segments, scale)
        return out.reshape(B, T, heads, d)
    S, L = layout.index.shape
    q_pos = torch.arange(L, device=query.device).expand(S, L)
    queries = rows(query)[layout.index].transpose(1, 2)  # [S, heads, L, d]
    out = attention(queries, rows(key), rows(value), q_pos, layout.lengths, scale, layout.index)
    flat = out.to(query.dtype).transpose(1, 2)[layout.seq, layout.pos]  # [B * T, heads, d]: each token's own row
    return torch.where(layout.real[:, None, None], flat, flat.new_zeros(())).reshape(B, T, heads, d)


def check_attention_backward(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Before a forward whose backward will run: lets `sequence_attention` differentiate by flash attention's
    backward on `device` where it gives the recomputation's gradients (`triton_exact.flash_backward_agrees`: checked
    once per device, dtype and head_dim, a warning where not). A no-op where the kernels do not run (CPU)."""
    if torch.device(device).type == "cuda" or _ON_CPU:
        kernels = _load_kernels()
        if kernels is not None:
            kernels.flash_backward_agrees(torch.device(device), dtype, head_dim)


# --------------------------------------------------------------------------------------------- the mode
class _ExactOps(TorchFunctionMode):
    """Routes ``F.linear``, ``F.silu`` and a last-dimension ``mean`` to this module's versions (others run as
    they are; the handler runs with the mode popped, so the functions it calls are the plain ones)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear(*args, **kwargs)
        if func is F.silu and not kwargs.get("inplace", args[1] if len(args) > 1 else False):
            return silu(args[0])
        if func in (torch.Tensor.mean, torch.mean) and _last_dim_mean(args, kwargs):
            return mean_last(args[0], kwargs.get("keepdim", args[2] if len(args) > 2 else False))
        return func(*args, **kwargs)


def _last_dim_mean(args: tuple, kwargs: dict) -> bool:
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    x = args[0]
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return isinstance(dim, int) and x.dim() > 0 and dim % x.dim() == x.dim() - 1 and "dtype" not in kwargs


def ops(on: bool = True):
    """A context in which the module's linears, SiLU and RMSNorm's mean run as exact operations (a no-op context
    when not `on`, or when this thread is in one already: compiled code guards on the mode stack, so a nested entry
    would compile it again). Both sides enter it on the thread that runs the model (the trainer's recompute too)."""
    if not on or routes():
        return contextlib.nullcontext()
    kernels = _load_kernels()
    if kernels is not None:  # (Triton's allocator for the kernels compiled code launches on this thread)
        kernels.use_scratch()
    return _ExactOps()


def routes() -> bool:
    """Whether exact mode's routing (`ops`) is active on this thread."""
    return any(isinstance(mode, _ExactOps) for mode in _get_current_function_mode_stack())


@contextlib.contextmanager
def routed_inside(on: bool):
    """For calling compiled code that routes its own operations (`routing` inside the compiled function): where `on`
    and exact mode's routing is this thread's innermost torch function mode, it is set aside for the call. Compiled
    code that runs under a torch function mode sends every operation of its Python wrappers through the mode's
    ``__torch_function__`` (about 145 a layer's call: autograd's views, grad mode, detaches), each a round trip
    into Python; traced inside the compiled function, the routing is in the graph and costs nothing at run time.
    (Under another mode pushed after it, the routing stays: the compiled code routes twice, the same bits, slower.)"""
    stack = _get_current_function_mode_stack()
    if not (on and stack and isinstance(stack[-1], _ExactOps)):
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


def routing(on: bool):
    """Inside a compiled function (`routed_inside` around its call): exact mode's routing where `on`."""
    return _ExactOps() if on else contextlib.nullcontext()


def forward_bits_in_recompute():
    """A context in which activation checkpointing's recompute gives the forward's bits: the matmul runs its exact
    kernel inside a backward too, where by default it runs cuBLAS (the recompute's values feed only gradients). For
    a recompute that reuses values its forward saved (`agents.logprobs`: an LM-head chunk's softmax statistics). The
    torch versions (CPU) give the forward's bits anyway."""
    kernels = _load_kernels()
    return kernels.forward_bits_in_recompute() if kernels else contextlib.nullcontext()


class RecomputeUnderOps:
    """A layer's activation-checkpointing function (transformers' ``_gradient_checkpointing_func``) whose function
    runs under `ops()`, in the forward and in backward's recompute alike. The mode is thread-local and the forward's
    ends before backward, so without this the recompute would run the plain operations and save other tensors than
    the forward did (`torch.utils.checkpoint` raises a ``CheckpointError``, or a compiled layer compiles a plain
    graph). Where Dynamo traces the checkpoint (a model its user compiles whole; `trainers.modeling.compile_layers`
    keeps the checkpoint out of its graphs), the recompute is the traced graph's and this adds nothing."""

    def __init__(self, checkpoint_fn):
        self.checkpoint_fn = checkpoint_fn

    def __call__(self, fn, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.checkpoint_fn(fn, *args, **kwargs)
        return self.checkpoint_fn(functools.partial(_under_ops, fn), *args, **kwargs)


def _under_ops(fn, *args, **kwargs):
    with ops():
        return fn(*args, **kwargs)
