"""Decode attention over paged KV: each row's one query against the positions its block table names.

Two kernels, chosen per engine (`EngineConfig.attention`):

* ``"gather"`` (any device; the reference): the row's first `length` positions gathered from the flat KV into a
  dense [rows, kv_heads, length, head_dim] tensor, then one SDPA call with an additive length mask. The query heads
  of one KV head are laid out as that head's queries (no expansion of K/V).
* ``"triton"`` (CUDA): `agents.engine.triton_attention`, a split-KV kernel that reads the blocks in place — the
  gather would move every attended byte three times per layer and step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KERNELS = ("gather", "triton")


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
    [rows, 1, 1, length]; ``"triton"``: the table, the attended lengths, the block size and `length`."""
    if kernel == "triton":
        return table, at + 1, block_size, length
    positions = torch.arange(length, device=table.device)
    hidden = (positions[None, :] > at[:, None])[:, None, None, :]
    mask = torch.zeros(hidden.shape, dtype=dtype, device=table.device).masked_fill_(hidden, float("-inf"))
    return flat_positions(table, positions, block_size), mask


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attend: tuple, scale: float,
                     kernel: str) -> torch.Tensor:
    """Attention of one query per row, `q` [rows, heads, head_dim], over the flat KV `keys`/`values` [positions,
    kv_heads, head_dim] as `attend` (`decode_inputs`) says; returns [rows, heads, head_dim]."""
    if kernel == "triton":
        from .triton_attention import paged_decode_attention

        table, lengths, block_size, length = attend
        return paged_decode_attention(q, keys, values, table, lengths, scale, block_size, length)
    read_at, mask = attend
    rows, heads, dim = q.shape
    kv_heads = keys.shape[1]
    k, v = keys[read_at].transpose(1, 2), values[read_at].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.reshape(rows, kv_heads, heads // kv_heads, dim), k, v, attn_mask=mask,
                                         scale=scale)
    return out.reshape(rows, heads, dim)
