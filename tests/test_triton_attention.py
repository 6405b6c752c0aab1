"""The Triton decode attention over paged KV (`agents.engine.triton_attention`) against the gather kernel: random
block tables, lengths (one position to several splits), grouped-query layouts, float32 and bfloat16. Runs on CUDA
(``MT_ENV_TEST_DEVICE=cuda``), or on CPU under Triton's interpreter (``TRITON_INTERPRET=1``) where Triton is
installed."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.engine.attention import decode_attention, decode_inputs, prefill_attention, prefill_inputs

from .backend_hf_fixtures import DEVICE
from .triton_fixtures import DTYPES, require_kernels

require_kernels("the Triton decode attention's kernels")


def random_case(rows: int, kv_heads: int, group: int, dim: int, block_size: int, longest: int, dtype, seed: int,
                lengths: list[int] | None = None):
    """Queries, a shuffled pool and block tables of random rows (`lengths`, default random in 1..longest)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    lengths = lengths or [rng.randint(1, longest) for _ in range(rows)]
    columns = -(-(longest + 7) // block_size)  # the table covers the length bucket (see the test)
    blocks = list(range(1, rows * columns + 1))
    rng.shuffle(blocks)
    table = torch.zeros(rows, columns, dtype=torch.int32)
    for r in range(rows):
        for c in range(-(-lengths[r] // block_size)):
            table[r, c] = blocks.pop()
    positions = (rows * columns + 1) * block_size
    keys = torch.randn(positions, kv_heads, dim, generator=gen).to(dtype)
    values = torch.randn(positions, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(rows, kv_heads * group, dim, generator=gen).to(dtype)
    at = torch.tensor(lengths) - 1
    return [t.to(DEVICE) for t in (q, keys, values, table, at)]


@settings(max_examples=25 if DEVICE == "cuda" else 4, deadline=None)
@given(rows=st.integers(1, 9), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 7, 8]),
       dim=st.sampled_from([16, 64]), block_size=st.sampled_from([1, 4, 16]), longest=st.integers(1, 300),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_the_triton_kernel_gives_what_the_gather_kernel_gives(rows, kv_heads, group, dim, block_size, longest, dtype,
                                                             seed):
    q, keys, values, table, at = random_case(rows, kv_heads, group, dim, block_size, longest, dtype, seed)
    length = longest + 7  # a length bucket past every row
    scale = dim ** -0.5
    expected = decode_attention(q, keys, values, decode_inputs(table.long(), at, length, block_size, "gather", dtype),
                                scale, "gather")
    got = decode_attention(q, keys, values, decode_inputs(table, at, length, block_size, "triton", dtype), scale,
                           "triton")
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == q.dtype and got.shape == q.shape
    assert torch.allclose(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@settings(max_examples=25 if DEVICE == "cuda" else 4, deadline=None)
@given(rows=st.integers(1, 5), kv_heads=st.integers(1, 2), group=st.sampled_from([1, 2, 7]),
       block_size=st.sampled_from([1, 4, 16]), longest_prefix=st.integers(0, 150), longest_new=st.integers(1, 40),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_the_triton_prefill_over_a_cached_prefix_gives_what_the_gather_kernel_gives(rows, kv_heads, group, block_size,
                                                                                   longest_prefix, longest_new, dtype,
                                                                                   seed):
    """Each row's new queries (after a cached prefix of its own length) attend causally to the row's positions:
    the Triton kernel against the gather kernel's masked SDPA, real queries compared (padding queries are zeros)."""
    rng = random.Random(seed)
    starts = [rng.randint(0, longest_prefix) for _ in range(rows)]
    counts = [rng.randint(1, longest_new) for _ in range(rows)]
    width, read = max(counts), max(s + c for s, c in zip(starts, counts))
    dim = 16
    lengths = [s + c for s, c in zip(starts, counts)]
    q, keys, values, table, _ = random_case(rows, kv_heads, group, dim, block_size, read, dtype, seed, lengths)
    q = torch.randn(rows, kv_heads * group, width, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
    q = q.to(DEVICE)
    starts_t, counts_t = torch.tensor(starts, device=DEVICE), torch.tensor(counts, device=DEVICE)
    scale = dim ** -0.5
    no_new = torch.zeros(rows, kv_heads, width, dim, dtype=dtype, device=DEVICE)  # (used only without a prefix)
    expected = prefill_attention(q, no_new, no_new, keys, values,
                                 prefill_inputs(table, starts_t, counts_t, width, read, block_size, "gather"), scale,
                                 "gather")
    got = prefill_attention(q, no_new, no_new, keys, values,
                            prefill_inputs(table, starts_t, counts_t, width, read, block_size, "triton"), scale,
                            "triton")
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    for r, n in enumerate(counts):
        assert torch.allclose(got[r, :n].float(), expected[r, :n].float(), atol=tolerance, rtol=tolerance)
        assert not got[r, n:].any()
