"""Exact mode's matmul (`agents.triton_exact.matmul`) alone at Qwen2.5-0.5B's weight shapes, under several tile
configurations, against `F.linear` (cuBLAS) — to choose a tile per weight shape (issue 28).

A tile may depend on the weight's shape (N, K) and stay exact: the engine and the trainer multiply by the same weight,
so they get the same tile; what must not change a row's bits is M, the number of rows in the call. For each
configuration this script checks that too (the first rows' bits alone and among many), and whether its bits equal
today's configuration's (if tiles with the same BLOCK_K agree, the tile could follow M as well), and times the
decode shapes (M = 32, 256 rows) and a trainer micro-batch (M = 8,192) in microseconds, each call in a CUDA graph.
`--rows` times other row counts (the RL update's 32k-token micro-batches: 32768); `--weights` picks shapes, among them
the unfused ones both sides multiply today (HF's Qwen2 layers: q, k, v, gate and up apart; `q`, `kv`, `gate`).

An experiment: what it decides goes to docs/exact.md, with the command.

    python benchmarks/bench_exact_matmul.py --out /tmp/exact_matmul.json
    python benchmarks/bench_exact_matmul.py --rows 8192 32768 --weights q kv o gate down lm_head
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents import triton_exact as te  # noqa: E402

#: (N, K) of the 0.5B shape's weights: qkv and gate_up as if fused, o, down, the tied LM head (the default set), and
#: q, k or v, gate or up as the engine and the trainer multiply them today (apart)
WEIGHTS = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864), "lm_head": (151936, 896),
           "q": (896, 896), "kv": (128, 896), "gate": (4864, 896)}
DEFAULT_WEIGHTS = ["qkv", "o", "gate_up", "down", "lm_head"]
ROWS = [32, 256, 8192]  #: the default row counts; the first rows' bits are compared at ROWS[1]
#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried; the first is today's bf16 configuration
CONFIGS = [(128, 128, 64, 8, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (64, 32, 64, 4, 4),
           (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 64, 4, 4), (16, 64, 64, 4, 4),
           (256, 128, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4)]


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1000.0  # microseconds


def _invariant(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the first 3 rows' bits are the same alone, among 32 and among all of x."""
    alone = te.matmul(x[:3].clone(), w)
    return all(torch.equal(alone, te.matmul(x[:m].clone(), w)[:3]) for m in (32, len(x)))


def weight(name: str, n: int, k: int, gen: torch.Generator, rows: list[int], timed: bool = True) -> dict:
    w = torch.randn(n, k, generator=gen, device="cuda").bfloat16() * k ** -0.5
    xs = {m: torch.randn(m, k, generator=gen, device="cuda").bfloat16() for m in sorted({*rows, ROWS[1]})}
    out = dict(weight=name, n=n, k=k, configs=[],
               cublas_us={m: _bench(lambda: F.linear(xs[m], w)) for m in rows} if timed else {})
    print(f"{name} [{n}, {k}]: cuBLAS " + " ".join(f"M={m}: {us:8.1f} us" for m, us in out["cublas_us"].items()),
          flush=True)
    today = te.matmul(xs[ROWS[1]], w)  # today's tile at ROWS[1] rows
    small_tile = te.SMALL_M_CONFIGS[torch.bfloat16]
    for cfg in CONFIGS:  # each configuration for every M: the small-M tile too
        te.MATMUL_CONFIGS[torch.bfloat16] = te.SMALL_M_CONFIGS[torch.bfloat16] = cfg
        try:
            same = torch.equal(te.matmul(xs[ROWS[1]], w), today)
            us = {m: _bench(lambda: te.matmul(xs[m], w)) for m in rows} if timed else {}
        except Exception as exc:  # a tile too large for the SM's shared memory: recorded, not fatal
            out["configs"].append(dict(config=cfg, error=f"{type(exc).__name__}: {exc}"[:200]))
            print(f"  {cfg}: {type(exc).__name__}", flush=True)
            continue
        row = dict(config=cfg, us=us, vs_cublas={m: us[m] / out["cublas_us"][m] for m in us},
                   invariant=_invariant(xs[max(xs)], w), same_bits_as_today=same)
        out["configs"].append(row)
        print(f"  {cfg}: " + " ".join(f"M={m}: {us[m]:8.1f} us ({row['vs_cublas'][m]:4.2f}x)" for m in us)
              + f"  rows invariant: {row['invariant']}, bits as today's: {same}", flush=True)
    te.MATMUL_CONFIGS[torch.bfloat16], te.SMALL_M_CONFIGS[torch.bfloat16] = CONFIGS[0], small_tile
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the figures here (JSON)")
    ap.add_argument("--bits-only", action="store_true", help="check the bits, time nothing")
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS, help="row counts M to time (default: %(default)s)")
    ap.add_argument("--weights", nargs="+", choices=list(WEIGHTS), default=DEFAULT_WEIGHTS,
                    help="weight shapes to try (default: %(default)s)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_exact_matmul: needs CUDA (the kernels are timed on the GPU)")
    gen = torch.Generator("cuda").manual_seed(0)
    weights = [weight(name, *WEIGHTS[name], gen, args.rows, timed=not args.bits_only) for name in args.weights]
    figures = dict(device=torch.cuda.get_device_name(), rows=args.rows, weights=weights)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
