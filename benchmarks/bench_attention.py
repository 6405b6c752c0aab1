"""The engine's paged attention kernels alone (`agents.engine.triton_attention`), one layer of Qwen2.5-0.5B's shape
(14 query heads, 2 KV heads, head dim 64, bf16, blocks of 16 positions scattered over the pool), at the shapes of
`bench_agent.py`'s workloads, each call replayed in a CUDA graph:

* decode: every row's query against its own positions (A: 256 rows of 600-4,136 positions; B: 512 rows of
  300-884), for several launch settings (splits per row, warps, pipeline stages), against SDPA over the same KV laid
  out dense per row (no paging: a lower bound's stand-in) — in microseconds and in GB/s of KV read;
* prefill over a cached prefix (A's turns: rows of 400-656 new tokens after 600-3,480 cached ones), for several
  launch settings, against the layer's matmuls for the same tokens (what the attention's time is compared with).

An experiment: what it decides goes to docs/engine.md's table, with the command.

    python benchmarks/bench_attention.py --out /tmp/attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents.engine import triton_attention as ta  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 14, 2, 64, 16
HIDDEN, INTER = 896, 4864
#: (name, rows, shortest, longest) of the decode shapes
DECODE = [("A", 256, 600, 4136), ("B", 512, 300, 884)]
#: launch settings tried: (positions per split's target programs, num_warps, num_stages)
DECODE_SETTINGS = [(264, 4, 3), (264, 4, 1), (264, 8, 2), (528, 4, 3), (1056, 4, 3), (1056, 4, 2), (2112, 4, 3),
                   (2112, 8, 3), (4224, 4, 3)]
PREFILL_SETTINGS = [(4, 3), (4, 2), (8, 2), (8, 3), (4, 1)]


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=200) * 1000.0  # microseconds


def _paged(lengths: torch.Tensor, gen: torch.Generator):
    """A pool of scattered blocks holding each row's `lengths` positions: (keys, values, table)."""
    rows, longest = len(lengths), int(lengths.max())
    per_row = -(-longest // BLOCK)
    order = torch.randperm(rows * per_row, generator=gen, device="cuda").int()
    table = order.view(rows, per_row)
    keys = torch.randn(rows * per_row * BLOCK, KV_HEADS, DIM, generator=gen, device="cuda").bfloat16()
    return keys, torch.randn_like(keys), table


def decode(name: str, rows: int, low: int, high: int, gen: torch.Generator) -> dict:
    lengths = torch.randint(low, high + 1, (rows,), generator=gen, device="cuda").int()
    keys, values, table = _paged(lengths, gen)
    q = torch.randn(rows, HEADS, DIM, generator=gen, device="cuda").bfloat16()
    longest = int(lengths.max())
    kv_bytes = int(lengths.sum()) * KV_HEADS * DIM * 2 * 2
    out = dict(shape=name, rows=rows, mean_length=float(lengths.float().mean()), settings=[])
    for target, warps, stages in DECODE_SETTINGS:
        ta.TARGET_PROGRAMS, ta.DECODE_OPTIONS = target, dict(num_warps=warps, num_stages=stages)
        us = _bench(lambda: ta.paged_decode_attention(q, keys, values, table, lengths, 0.125, BLOCK, longest))
        splits = ta.splits_for(rows, KV_HEADS, longest)
        out["settings"].append(dict(target=target, warps=warps, stages=stages, splits=splits[0], us=us,
                                    gb_s=kv_bytes / us / 1e3))
        print(f"decode {name}: target {target:5} warps {warps} stages {stages} splits {splits[0]:3}: {us:8.1f} us "
              f"{kv_bytes / us / 1e3:7.0f} GB/s", flush=True)
    ta.TARGET_PROGRAMS, ta.DECODE_OPTIONS = 264, {}
    dense_k = torch.randn(rows, KV_HEADS, longest, DIM, generator=gen, device="cuda").bfloat16()
    dense_v = torch.randn_like(dense_k)
    qd = q.view(rows, KV_HEADS, HEADS // KV_HEADS, DIM)
    us = _bench(lambda: F.scaled_dot_product_attention(qd, dense_k, dense_v, scale=0.125))
    out["sdpa_dense_full_us"] = us
    print(f"decode {name}: SDPA over a dense cache of {longest} positions a row (every row full): {us:8.1f} us "
          f"{rows * longest * KV_HEADS * DIM * 4 / us / 1e3:7.0f} GB/s", flush=True)
    return out


def prefill(rows: int, gen: torch.Generator) -> dict:
    counts = torch.randint(400, 657, (rows,), generator=gen, device="cuda").int()
    starts = torch.randint(600, 3481, (rows,), generator=gen, device="cuda").int()
    keys, values, table = _paged(starts + counts, gen)
    width = int(counts.max())
    q = torch.randn(rows, HEADS, width, DIM, generator=gen, device="cuda").bfloat16()
    read = int((starts + counts).max())
    tokens = int(counts.sum())
    out = dict(rows=rows, tokens=tokens, mean_start=float(starts.float().mean()), settings=[])
    for warps, stages in PREFILL_SETTINGS:
        ta.PREFILL_OPTIONS = dict(num_warps=warps, num_stages=stages)
        us = _bench(lambda: ta.paged_prefill_attention(q, keys, values, table, starts, counts, 0.125, BLOCK, read))
        out["settings"].append(dict(warps=warps, stages=stages, us=us))
        print(f"prefill {rows} rows, {tokens} tokens: warps {warps} stages {stages}: {us:8.1f} us", flush=True)
    ta.PREFILL_OPTIONS = {}
    x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").bfloat16()
    w = [torch.randn(n, k, generator=gen, device="cuda").bfloat16() for n, k in
         [((HEADS + 2 * KV_HEADS) * DIM, HIDDEN), (HIDDEN, HEADS * DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER)]]
    h = torch.randn(tokens, 2 * INTER, generator=gen, device="cuda").bfloat16()

    def matmuls():
        F.linear(x, w[0]), F.linear(x, w[1]), F.linear(x, w[2]), F.linear(h[:, :INTER], w[3])

    out["layer_matmuls_us"] = _bench(matmuls)
    print(f"prefill {rows} rows: the layer's matmuls for the same tokens: {out['layer_matmuls_us']:8.1f} us",
          flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefill-rows", type=int, default=32)
    ap.add_argument("--out", help="write the figures here (JSON)")
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    figures = dict(device=torch.cuda.get_device_name(), decode=[decode(*shape, gen) for shape in DECODE],
                   prefill=prefill(args.prefill_rows, gen))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
