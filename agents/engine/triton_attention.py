"""Attention over paged KV in Triton, reading the blocks in place: decode (each row's query heads of one KV head
against the positions its block table names; split-KV, as flash-decoding: the positions are cut into splits that
run in parallel, then their partial results are combined by their log-sum-exp) and prefill over a cached prefix
(a tile of a row's new queries, all heads of one KV head, against the row's positions up to each query's own).

Why a kernel of our own: torch's SDPA needs the KV dense per row (a gather moves every attended byte three times per
layer and step), and the libraries that read paged KV (vLLM's, FlashInfer, flash-attn's kvcache API) are not in the
project's dependencies; FlexAttention's paged path needs a block mask rebuilt per step. Registered as a torch custom
op, so that Inductor compiles around it and a CUDA graph captures it. Tested against the gather kernel
(`agents.engine.attention`), on CPU too under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: positions one program reads per iteration
BLOCK_N = 64
#: programs a step should keep busy at least (about two per multiprocessor of an H100/H200)
TARGET_PROGRAMS = 264
#: launch options (num_warps, num_stages) of the decode and prefill kernels; empty: Triton's defaults
#: (benchmarks/bench_attention.py measures alternatives)
DECODE_OPTIONS: dict = {}
PREFILL_OPTIONS: dict = {}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _attend_block(q, best, total, acc, positions, inside, visible, table_row_ptr, k_ptr, v_ptr, kv_head,
                  stride_kt, stride_kh, stride_vt, stride_vh, scale,
                  DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr):
    """One block of key `positions` (those `inside` read from the paged cache through the row's block table) folded
    into the online softmax state (`best`, `total`, `acc`) of queries `q`, each seeing the keys `visible` marks."""
    dims = tl.arange(0, DIM)
    block = tl.load(table_row_ptr + positions // BLOCK_SIZE, mask=inside, other=0)
    flat = block.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
    k = tl.load(k_ptr + flat[:, None] * stride_kt + kv_head * stride_kh + dims[None, :], mask=inside[:, None],
                other=0.0)
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(visible, scores * scale, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, 1))
    shift = tl.where(new_best == float("-inf"), 0.0, new_best)  # a tile with nothing visible: no NaN
    weights = tl.exp(scores - shift[:, None])
    rescale = tl.exp(best - shift)
    v = tl.load(v_ptr + flat[:, None] * stride_vt + kv_head * stride_vh + dims[None, :], mask=inside[:, None],
                other=0.0)
    if IEEE:
        update = tl.dot(weights, v.to(tl.float32), input_precision="ieee")
    else:
        update = tl.dot(weights.to(v.dtype), v)
    return new_best, total * rescale + tl.sum(weights, 1), acc * rescale[:, None] + update


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lengths_ptr, out_ptr, lse_ptr,
                  stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_tb,
                  stride_ob, stride_oh, stride_os, stride_lb, stride_lh, scale,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, BOUNDED: tl.constexpr):
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(lengths_ptr + row)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    real_heads = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, DIM)
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=real_heads[:, None],
                other=0.0)
    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, length)
    # the loop stops at the row's own end; under Triton's interpreter (with numpy 2) a loop bound must be a constant:
    # there it runs the whole split, the positions past the end masked (same arithmetic)
    for first in range(0 if BOUNDED else start, SPLIT if BOUNDED else end, BLOCK):
        positions = (start if BOUNDED else 0) + first + tl.arange(0, BLOCK)
        inside = positions < end
        best, total, acc = _attend_block(q, best, total, acc, positions, inside, inside[None, :],
                                         table_ptr + row * stride_tb, k_ptr, v_ptr, kv_head, stride_kt, stride_kh,
                                         stride_vt, stride_vh, scale, DIM, BLOCK_SIZE, IEEE)
    empty = total == 0.0  # a split past the row's length
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, total)[:, None])
    lse = tl.where(empty, float("-inf"), best + tl.log(tl.where(empty, 1.0, total)))
    tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :], out,
             mask=real_heads[:, None])
    tl.store(lse_ptr + row * stride_lb + heads * stride_lh + split, lse, mask=real_heads)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, table_ptr, starts_ptr, counts_ptr, out_ptr,
                    stride_qb, stride_qh, stride_qw, stride_kt, stride_kh, stride_vt, stride_vh, stride_tb,
                    stride_ob, stride_ow, stride_oh, scale,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, DIM: tl.constexpr,
                    BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr, BOUNDED: tl.constexpr,
                    MAX_READ: tl.constexpr):
    row, kv_head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, count = tl.load(starts_ptr + row), tl.load(counts_ptr + row)
    lanes = tl.arange(0, BLOCK_Q * GROUP_PAD)  # (query, head of the group) pairs of this tile
    query = tile * BLOCK_Q + lanes // GROUP_PAD
    head = kv_head * GROUP + lanes % GROUP_PAD
    real = (query < count) & (lanes % GROUP_PAD < GROUP)
    position = start + query
    dims = tl.arange(0, DIM)
    q = tl.load(q_ptr + row * stride_qb + head[:, None] * stride_qh + query[:, None] * stride_qw + dims[None, :],
                mask=real[:, None], other=0.0)
    best = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM], tl.float32)
    end = tl.minimum(start + (tile + 1) * BLOCK_Q, start + count)  # keys up to the tile's last real query
    end = tl.where(tile * BLOCK_Q < count, end, 0)
    for first in range(0, MAX_READ if BOUNDED else end, BLOCK):
        keys_at = first + tl.arange(0, BLOCK)
        inside = keys_at < end
        visible = inside[None, :] & (keys_at[None, :] <= position[:, None])
        best, total, acc = _attend_block(q, best, total, acc, keys_at, inside, visible, table_ptr + row * stride_tb,
                                         k_ptr, v_ptr, kv_head, stride_kt, stride_kh, stride_vt, stride_vh, scale,
                                         DIM, BLOCK_SIZE, IEEE)
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + row * stride_ob + query[:, None] * stride_ow + head[:, None] * stride_oh + dims[None, :],
             out, mask=real[:, None])


def splits_for(rows: int, kv_heads: int, length: int) -> tuple[int, int]:
    """(splits, positions per split) for a step of `rows` rows attending to up to `length` positions: enough splits
    to keep `TARGET_PROGRAMS` programs busy, each a power of two of `BLOCK_N` iterations (the split's size is a
    compile-time constant of the kernel: few sizes, few compilations)."""
    iterations = -(-length // BLOCK_N)
    splits = max(1, min(iterations, -(-TARGET_PROGRAMS // (rows * kv_heads))))
    per_split = (1 << (-(-iterations // splits) - 1).bit_length()) * BLOCK_N  # a power of two: few kernel variants
    return -(-length // per_split), per_split


@torch.library.custom_op("mt_env::paged_decode_attention", mutates_args=())
def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                           lengths: torch.Tensor, scale: float, block_size: int, max_length: int) -> torch.Tensor:
    """Attention of `q` [rows, heads, dim] over the first ``lengths[r]`` positions of row r, which live in the flat KV
    `keys`/`values` [positions, kv_heads, dim] at ``table[r, p // block_size] * block_size + p % block_size``;
    `max_length` bounds the lengths (it sets the splits). Returns [rows, heads, dim] in q's dtype."""
    if q.dtype not in KERNEL_DTYPES:
        return _dense_decode(q, keys, values, table, lengths, scale, block_size, max_length)
    rows, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    splits, per_split = splits_for(rows, kv_heads, max_length)
    out = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
    _split_kernel[(rows, kv_heads, splits)](
        q, keys, values, table, lengths, out, lse,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), table.stride(0),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), scale,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), DIM=dim, BLOCK=BLOCK_N,
        BLOCK_SIZE=block_size, SPLIT=per_split, IEEE=q.dtype == torch.float32, BOUNDED=_INTERPRETED,
        **DECODE_OPTIONS)
    weights = torch.softmax(lse, dim=-1)  # each split's share: exp(lse_s) / sum(exp(lse)); empty splits get 0
    return (out * weights[..., None]).sum(dim=2).to(q.dtype)


@paged_decode_attention.register_fake
def _(q, keys, values, table, lengths, scale, block_size, max_length):
    return torch.empty_like(q)


@torch.library.custom_op("mt_env::paged_prefill_attention", mutates_args=())
def paged_prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                            starts: torch.Tensor, counts: torch.Tensor, scale: float, block_size: int,
                            max_read: int) -> torch.Tensor:
    """Causal attention of each row's new tokens, `q` [rows, heads, width, dim] (row r's first ``counts[r]`` are
    real, at positions ``starts[r]`` on), over the row's positions up to each query's own, read from the flat KV as in
    `paged_decode_attention` (this pass's K/V written there first); `max_read` bounds ``starts + counts``. Returns
    [rows, width, heads, dim] (padding queries: zeros)."""
    if q.dtype not in KERNEL_DTYPES:
        return _dense_prefill(q, keys, values, table, starts, counts, scale, block_size, max_read)
    rows, heads, width, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, 128 // group_pad)  # 128 (query, head) lanes a program
    out = torch.zeros(rows, width, heads, dim, dtype=q.dtype, device=q.device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    _prefill_kernel[(rows, kv_heads, -(-width // block_q))](
        q, keys, values, table, starts, counts, out,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        table.stride(0), out.stride(0), out.stride(1), out.stride(2), scale,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, DIM=dim, BLOCK=BLOCK_N, BLOCK_SIZE=block_size,
        IEEE=q.dtype == torch.float32, BOUNDED=_INTERPRETED, MAX_READ=max_read if _INTERPRETED else 0,
        **PREFILL_OPTIONS)
    return out


@paged_prefill_attention.register_fake
def _(q, keys, values, table, starts, counts, scale, block_size, max_read):
    rows, heads, width, dim = q.shape
    return q.new_empty(rows, width, heads, dim)


#: the dtypes the kernels take; others (float64) go through the dense fallbacks
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _flat(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return table.long().gather(1, positions // block_size) * block_size + positions % block_size


def _dense_decode(q, keys, values, table, lengths, scale, block_size, max_length):
    rows, heads, dim = q.shape
    positions = torch.arange(max_length, device=q.device)[None, :].expand(rows, -1)
    flat = _flat(table, positions, block_size)
    k, v = keys[flat].transpose(1, 2), values[flat].transpose(1, 2)
    mask = positions[:, None, None, :] < lengths[:, None, None, None]
    kv_heads = keys.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(q.reshape(rows, kv_heads, heads // kv_heads, dim), k, v,
                                                           attn_mask=mask, scale=scale)
    return out.reshape(rows, heads, dim)


def _dense_prefill(q, keys, values, table, starts, counts, scale, block_size, max_read):
    rows, heads, width, dim = q.shape
    positions = torch.arange(max_read, device=q.device)[None, :].expand(rows, -1)
    flat = _flat(table, positions, block_size)
    groups = heads // keys.shape[1]
    k = keys[flat].transpose(1, 2).repeat_interleave(groups, dim=1)
    v = values[flat].transpose(1, 2).repeat_interleave(groups, dim=1)
    query_at = starts[:, None] + torch.arange(width, device=q.device)[None, :]
    mask = (positions[:, None, :] <= query_at[:, :, None]) & (positions < (starts + counts)[:, None])[:, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)
    real = torch.arange(width, device=q.device)[None, :] < counts[:, None]
    return (out.transpose(1, 2) * real[:, :, None, None]).contiguous()
