"""Decode attention over paged KV in Triton: each row's query heads of one KV head against the positions its block
table names, read in place (split-KV, as flash-decoding: the positions are cut into splits that run in parallel,
then their partial results are combined by their log-sum-exp).

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
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


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
        block = tl.load(table_ptr + row * stride_tb + positions // BLOCK_SIZE, mask=inside, other=0)
        flat = block.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
        k = tl.load(k_ptr + flat[:, None] * stride_kt + kv_head * stride_kh + dims[None, :], mask=inside[:, None],
                    other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(inside[None, :], scores * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)  # a tile with nothing inside: no NaN
        weights = tl.exp(scores - shift[:, None])
        rescale = tl.exp(best - shift)
        v = tl.load(v_ptr + flat[:, None] * stride_vt + kv_head * stride_vh + dims[None, :], mask=inside[:, None],
                    other=0.0)
        if IEEE:
            update = tl.dot(weights, v.to(tl.float32), input_precision="ieee")
        else:
            update = tl.dot(weights.to(v.dtype), v)
        acc = acc * rescale[:, None] + update
        total = total * rescale + tl.sum(weights, 1)
        best = new_best
    empty = total == 0.0  # a split past the row's length
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, total)[:, None])
    lse = tl.where(empty, float("-inf"), best + tl.log(tl.where(empty, 1.0, total)))
    tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :], out,
             mask=real_heads[:, None])
    tl.store(lse_ptr + row * stride_lb + heads * stride_lh + split, lse, mask=real_heads)


def splits_for(rows: int, kv_heads: int, length: int) -> tuple[int, int]:
    """(splits, positions per split) for a step of `rows` rows attending to up to `length` positions: enough splits
    to keep `TARGET_PROGRAMS` programs busy, each a whole number of `BLOCK_N` iterations."""
    iterations = -(-length // BLOCK_N)
    splits = max(1, min(iterations, -(-TARGET_PROGRAMS // (rows * kv_heads))))
    per_split = -(-iterations // splits) * BLOCK_N
    return -(-length // per_split), per_split


@torch.library.custom_op("mt_env::paged_decode_attention", mutates_args=())
def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                           lengths: torch.Tensor, scale: float, block_size: int, max_length: int) -> torch.Tensor:
    """Attention of `q` [rows, heads, dim] over the first ``lengths[r]`` positions of row r, which live in the flat KV
    `keys`/`values` [positions, kv_heads, dim] at ``table[r, p // block_size] * block_size + p % block_size``;
    `max_length` bounds the lengths (it sets the splits). Returns [rows, heads, dim] in q's dtype."""
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
        BLOCK_SIZE=block_size, SPLIT=per_split, IEEE=q.dtype == torch.float32, BOUNDED=_INTERPRETED)
    weights = torch.softmax(lse, dim=-1)  # each split's share: exp(lse_s) / sum(exp(lse)); empty splits get 0
    return (out * weights[..., None]).sum(dim=2).to(q.dtype)


@paged_decode_attention.register_fake
def _(q, keys, values, table, lengths, scale, block_size, max_length):
    return torch.empty_like(q)
