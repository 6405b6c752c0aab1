"""Attention over paged KV: decode (each row's one query against the positions its block table names) and prefill
(each row's new tokens, causally, after a prefix read back from the cache).

Two kernels, chosen per engine (`EngineConfig.attention`):

* ``"gather"`` (any device; the reference): the row's positions gathered from the flat KV into a dense tensor, then
  one SDPA call with a mask. For decode, the query heads of one KV head are laid out as that head's queries.
* ``"triton"`` (CUDA): `agents.engine.triton_attention`, kernels that read the blocks in place — the gather moves
  every attended byte several times per layer (and prefill expands K/V to every query head).
* ``"exact"`` (exact mode, any device): `agents.exact.attention` over the positions ``"gather"`` would gather (on
  CUDA read in place), the function the trainer's forward uses too; prefill always reads every position back.

A prefill pass in which no row has a cached prefix attends over its own new K/V with SDPA's causal kernel (flash).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import exact

KERNELS = ("gather", "triton", "exact")
#: the SDPA kernels a prefill pass may use: torch's own choice except cuDNN, which builds an execution plan for every
#: new (rows, width) shape while every decoding row waits (docs/engine.md). Flash attention has no such cost.
PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
#: a decode mask's row stride in elements (`decode_inputs`): 32 bytes in bf16, past any kernel's vector load
MASK_ALIGN = 16


def flat_positions(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Where positions of each row's sequence live in the flat KV: `table` [rows, blocks] (long), `positions`
    [rows, n], or [n] shared by the rows."""
    if positions.dim() == 1:
        positions = positions[None, :].expand(table.shape[0], -1)
    return table.gather(1, positions // block_size) * block_size + positions % block_size


def decode_inputs(table: torch.Tensor, at: torch.Tensor, length: int, block_size: int, kernel: str,
                  dtype: torch.dtype) -> tuple:
    """What `decode_attention` needs for rows whose query is at position `at` [rows] (attending to [0, at]), built
    once per step and shared by the layers: ``"gather"``: the flat positions [rows, length] and the additive mask
    [rows, 1, 1, length]; ``"triton"``: the table, the attended lengths, the block size and `length`; ``"exact"``:
    the flat positions and `at`."""
    if kernel == "triton":
        return table, at + 1, block_size, length
    # the gather mask's rows are MASK_ALIGN elements apart and it is a view of their first `length`: cuDNN's SDPA
    # reads a mask's last row past its end at odd lengths (memcheck, docs/engine.md); torch's memory-efficient
    # kernel pads its bias the same way for its own loads
    padded = torch.arange(-(-length // MASK_ALIGN) * MASK_ALIGN, device=table.device)
    read_at = flat_positions(table, padded[:length], block_size)
    if kernel == "exact":
        return read_at, at
    hidden = (padded[None, :] > at[:, None])[:, None, None, :]
    mask = torch.zeros(hidden.shape, dtype=dtype, device=table.device).masked_fill_(hidden, float("-inf"))
    return read_at, mask[..., :length]


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attend: tuple, scale: float,
                     kernel: str) -> torch.Tensor:
    """Attention of one query per row, `q` [rows, heads, head_dim], over the flat KV `keys`/`values` [positions,
    kv_heads, head_dim] as `attend` (`decode_inputs`) says; returns [rows, heads, head_dim]."""
    if kernel == "triton":
        from .triton_attention import paged_decode_attention

        table, lengths, block_size, length = attend
        return paged_decode_attention(q, keys, values, table, lengths, scale, block_size, length)
    read_at, mask = attend
    if kernel == "exact":  # the cache read in place (`mask` is each row's position here)
        out = exact.attention(q[:, :, None], keys, values, mask[:, None], mask + 1, scale, read_at)
        return out[:, :, 0].to(q.dtype)
    rows, heads, dim = q.shape
    kv_heads = keys.shape[1]
    k, v = keys[read_at].transpose(1, 2), values[read_at].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.reshape(rows, kv_heads, heads // kv_heads, dim), k, v, attn_mask=mask,
                                         scale=scale)
    return out.reshape(rows, heads, dim)


def prefill_inputs(table: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, width: int, read: int,
                   block_size: int, kernel: str) -> tuple | None:
    """What `prefill_attention` needs for a pass whose rows have `starts` cached positions and `counts` new ones
    (right-padded to `width`), reading back `read` positions: None when nothing is read back (causal attention
    over the new tokens); ``"gather"``: the flat positions [rows, read] and a boolean mask [rows, 1, width, read];
    ``"triton"``: the table, starts, counts, block size and `read`; ``"exact"`` (`read` > 0 always): the flat
    positions, each query's position [rows, width] and each row's valid length."""
    if not read:
        return None
    if kernel == "triton":
        return table, starts, counts, block_size, read
    keys = torch.arange(read, device=table.device)
    queries = starts[:, None] + torch.arange(width, device=table.device)[None, :]
    if kernel == "exact":
        return flat_positions(table.long(), keys, block_size), queries, starts + counts
    visible = (keys[None, None, :] <= queries[:, :, None]) & (keys < (starts + counts)[:, None])[:, None, :]
    return flat_positions(table.long(), keys, block_size), visible[:, None]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      attend: tuple | None, scale: float, kernel: str) -> torch.Tensor:
    """Attention of a pass's new queries `q` [rows, heads, width, dim] (their K/V `k`, `v` [rows, kv_heads, width,
    dim], already written into the flat KV `keys`/`values`); returns [rows, width, heads * dim]."""
    rows, heads, width, dim = q.shape
    if attend is not None and kernel == "triton":
        from .triton_attention import paged_prefill_attention

        table, starts, counts, block_size, read = attend
        return paged_prefill_attention(q, keys, values, table, starts, counts, scale, block_size,
                                       read).reshape(rows, width, -1)
    if kernel == "exact":  # every position read back from the cache, in place
        read_at, queries, valid = attend
        out = exact.attention(q, keys, values, queries, valid, scale, read_at).to(q.dtype)
        return out.transpose(1, 2).reshape(rows, width, -1)
    mask = None
    if attend is not None:
        read_at, mask = attend
        k, v = keys[read_at].transpose(1, 2), values[read_at].transpose(1, 2)
    groups = heads // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    with sdpa_kernel(PREFILL_SDPA):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.transpose(1, 2).reshape(rows, width, -1)
