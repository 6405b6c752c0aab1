"""Exact mode's sampling kernel in Triton (CUDA): `agents.exact.sample`'s contract in one launch per pass.

Inverse-CDF sampling over p ∝ exp(z - m), z = x / T, in an order set by the vocabulary's size alone: the row is cut
into blocks of `agents.exact.SAMPLE_BLOCK` ids; each block's weights are added by one fixed halving tree (`_halving_sum`, which
does not follow the compiler's lane layout), the blocks in order into a float64 total; the token is found again by
walking the blocks in order until the running sum passes u x total, then halving inside that block (is the target in
the left half's sum?) down to one id, or the nearest before it of non-zero weight (the halves' sums round apart from
the block's). A row's token depends on its own logits and u alone.

Why a kernel: the torch version materialises [rows, vocab] weights, a float64 copy and its cumulative sum: at the
0.5B's 151,936 ids and 256 rows a decode step spent ~0.7 ms there on an H100 (docs/exact.md). This reads the row
once for the total and until the target's block for the search, and writes one id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_exact import _INTERPRETED, _halving_sum
from .triton_matmul import next_power_of_2

@triton.jit
def _block_weights(x_ptr, start, n, temperature, top, BLOCK: tl.constexpr):
    """exp(z - top) of the ids [start, start + BLOCK) (0 past n), z = x / T by IEEE division (torch's bits)."""
    at = start + tl.arange(0, BLOCK)
    inside = at < n
    z = tl.math.div_rn(tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32), temperature)
    return tl.where(inside, tl.exp(z - top), 0.0)


@triton.jit(do_not_specialize=["n"])
def _sample_kernel(x_ptr, temp_ptr, top_ptr, u_ptr, out_ptr, n, stride_row, stride_top, BLOCK: tl.constexpr,
                   LEVELS: tl.constexpr, STATIC_N: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * stride_row
    temperature = tl.load(temp_ptr + row)
    top = tl.load(top_ptr + row * stride_top)
    lanes = tl.arange(0, BLOCK)
    total = tl.zeros([1], tl.float64)
    for start in range(0, STATIC_N if INTERPRETED else n, BLOCK):  # the blocks in order
        total += _halving_sum(_block_weights(x_ptr, start, n, temperature, top, BLOCK), LEVELS).to(tl.float64)
    target = tl.load(u_ptr + row).to(tl.float64) * total
    target = tl.minimum(target, total * (1.0 - 2.220446049250313e-16))  # below the total: u < 1 after rounding
    running = tl.zeros([1], tl.float64)
    choice = tl.zeros([1], tl.int64) + (n - 1)  # a NaN row passes no target: the last id (its NaN logprob reports it)
    found = tl.zeros([1], tl.int32)
    for start in range(0, STATIC_N if INTERPRETED else n, BLOCK):
        if tl.sum(found, 0) == 0:
            e = _block_weights(x_ptr, start, n, temperature, top, BLOCK)
            block = _halving_sum(e, LEVELS).to(tl.float64)
            if tl.sum((running + block > target).to(tl.int32), 0) > 0:  # the target is in this block: halve it
                lo = 0
                for level in tl.static_range(LEVELS):
                    half = BLOCK >> (level + 1)
                    left = _halving_sum(tl.where((lanes >= lo) & (lanes < lo + half), e, 0.0), LEVELS).to(tl.float64)
                    right = tl.sum((running + left <= target).to(tl.int32), 0) > 0
                    running += tl.where(right, left, 0.0)
                    lo += tl.where(right, half, 0)
                positive = e > 0  # (the halves' sums round apart from the block's: never an id of weight 0)
                last = tl.max(tl.where(positive & (lanes <= lo), lanes, -1), 0)
                lane = tl.where(last >= 0, last, tl.min(tl.where(positive & (lanes > lo), lanes, BLOCK), 0))
                choice = tl.minimum(choice * 0 + start + lane, n - 1)
                found += 1
            else:
                running += block
    tl.store(out_ptr + row + tl.arange(0, 1), choice)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top: torch.Tensor, uniform: torch.Tensor,
           block: int) -> torch.Tensor:
    """`agents.exact.sample` on CUDA: for float32 `logits` [N, V] (rows may be strided), float32 `temperature` [N],
    `top` [N] (each row's max of z, `softmax_stats`' first column; a view is fine) and `uniform` [N] in [0, 1): one id
    per row, int64 [N], walking blocks of `block` ids (a power of two; fewer where V is smaller)."""
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.dtype != torch.float32:
        raise ValueError(f"exact sample: float32 logits [N, V > 0], got {tuple(logits.shape)} {logits.dtype}")
    if not temperature.shape == top.shape == uniform.shape == logits.shape[:1]:
        raise ValueError(f"exact sample: temperature, top and uniform [N] for logits {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n = logits.shape[1]
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0]:
        block = min(block, next_power_of_2(n))
        _sample_kernel[(logits.shape[0],)](logits, temperature.to(torch.float32).contiguous(), top, uniform, out, n,
                                           logits.stride(0), top.stride(0), BLOCK=block,
                                           LEVELS=block.bit_length() - 1, STATIC_N=n if _INTERPRETED else 0,
                                           INTERPRETED=_INTERPRETED, num_warps=4 if block >= 512 else 1)
    return out
