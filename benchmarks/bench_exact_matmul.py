"""Exact mode's matmul (`agents.triton_matmul`) alone at Qwen2.5-0.5B's weight shapes, under candidate tiles, against
`F.linear` (cuBLAS): to choose the small tile (decode's few rows) and the large one (prefill, the trainer) (issue 28).

A tile may serve a call only where it gives the reference tile's bits (the order over K is BLOCK_K's in every tile;
whether the MMA instructions of two tile shapes round alike is the GPU's matter), so for each candidate this script
checks its bits against the reference's at two row counts and that a row's bits are the same alone, among 32 and among
many; then times it at the row counts of its group (each call in a CUDA graph, microseconds), and a call's host cost
outside a graph (`exact_host.per_call_us`, at the group's fewest rows). The reference under the old program order
(down M only, ``group_m`` 65536) is timed beside today's grouped order.

An experiment: what it decides goes to docs/exact.md, with the command.

    python benchmarks/bench_exact_matmul.py --out /tmp/exact_matmul.json
    python benchmarks/bench_exact_matmul.py --weights q down --groups large --bits-only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents import triton_matmul as tm  # noqa: E402
from agents.triton_matmul import Tile  # noqa: E402
from benchmarks.exact_host import per_call_us  # noqa: E402

#: (N, K) of the 0.5B shape's weights as both sides multiply them (HF's Qwen2: q, k, v, gate, up apart), the tied
#: LM head
WEIGHTS = {"q": (896, 896), "kv": (128, 896), "o": (896, 896), "gate": (4864, 896), "down": (896, 4864),
           "lm_head": (151936, 896)}
#: row counts timed per group; the LM head's calls are of at most `agents.logprobs.CHUNK_TOKENS` rows in the trainer
ROWS = {"small": [1, 2, 16, 64, 256], "large": [1024, 2048, 8192, 32768]}
MAX_LM_HEAD_ROWS = 8192
_REF = tm.REFERENCE[torch.bfloat16]
CANDIDATES = {
    "small": [_REF, Tile("pointer", 64, 32, 64, 4, 4), Tile("pointer", 16, 32, 64, 4, 4),
              Tile("pointer", 16, 64, 64, 4, 4), Tile("pointer", 32, 32, 64, 4, 4), Tile("pointer", 16, 16, 64, 4, 4)],
    "large": [_REF, _REF._replace(group_m=65536), Tile("pointer", 128, 256, 64, 8, 3), Tile("tma", 128, 128, 64, 8, 3),
              Tile("tma", 128, 256, 64, 8, 3), Tile("tma", 128, 256, 64, 8, 4), Tile("tma", 256, 128, 64, 8, 3),
              Tile("tma", 128, 256, 64, 8, 3, group_m=1)],
}


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1000.0  # microseconds


def _run(x: torch.Tensor, w: torch.Tensor, tile: Tile) -> torch.Tensor:
    return tm.launch(x, w, torch.empty(len(x), len(w), dtype=x.dtype, device=x.device), tile)


def _bits(x: torch.Tensor, w: torch.Tensor, tile: Tile) -> dict:
    """Whether `tile` gives the reference's bits on the first 300 rows and on all of x, and whether the first 3
    rows' bits are the same alone, among 32 and among all of x."""
    alone = _run(x[:3], w, tile)
    return dict(reference_bits=all(torch.equal(_run(x[:m], w, tile), _run(x[:m], w, _REF)) for m in (300, len(x))),
                rows_invariant=all(torch.equal(alone, _run(x[:m], w, tile)[:3]) for m in (32, len(x))))


def weight(name: str, gen: torch.Generator, groups: list[str], timed: bool) -> dict:
    n, k = WEIGHTS[name]
    w = torch.randn(n, k, generator=gen, device="cuda").bfloat16() * k ** -0.5
    rows = {g: [m for m in ROWS[g] if name != "lm_head" or m <= MAX_LM_HEAD_ROWS] for g in groups}
    xs = {m: torch.randn(m, k, generator=gen, device="cuda").bfloat16() for m in {2048, *sum(rows.values(), [])}}
    out = dict(weight=name, n=n, k=k, cublas_us={}, tiles=[])
    for group in groups:
        cublas = {m: _bench(lambda: F.linear(xs[m], w)) for m in rows[group]} if timed else {}
        out["cublas_us"].update(cublas)
        print(f"{name} [{n}, {k}] {group}: cuBLAS " + " ".join(f"M={m}: {us:.1f}" for m, us in cublas.items()),
              flush=True)
        for tile in CANDIDATES[group]:
            try:
                row = dict(group=group, tile=tile._asdict(), **_bits(xs[2048], w, tile))
                row["us"] = {m: _bench(lambda: _run(xs[m], w, tile)) for m in rows[group]} if timed else {}
                row["host_us"] = (per_call_us(lambda: _run(xs[rows[group][0]], w, tile), w.device, 200) if timed
                                  else None)
            except Exception as exc:  # a tile this GPU cannot run (shared memory): recorded, not fatal
                out["tiles"].append(dict(group=group, tile=tile._asdict(), error=f"{type(exc).__name__}: {exc}"[:300]))
                print(f"  {tuple(tile)}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            row["vs_cublas"] = {m: row["us"][m] / cublas[m] for m in row["us"]}
            out["tiles"].append(row)
            print(f"  {tuple(tile)}: " + " ".join(f"M={m}: {us:.1f} ({row['vs_cublas'][m]:.2f}x)"
                                                  for m, us in row["us"].items())
                  + f"  reference bits: {row['reference_bits']}, rows invariant: {row['rows_invariant']}"
                  + (f", host {row['host_us']:.1f} us a call" if timed else ""), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the figures here (JSON)")
    ap.add_argument("--bits-only", action="store_true", help="check the bits, time nothing")
    ap.add_argument("--groups", nargs="+", choices=list(CANDIDATES), default=list(CANDIDATES))
    ap.add_argument("--weights", nargs="+", choices=list(WEIGHTS), default=list(WEIGHTS),
                    help="weight shapes to try (default: %(default)s)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_exact_matmul: needs CUDA (the kernels are timed on the GPU)")
    gen = torch.Generator("cuda").manual_seed(0)
    weights = [weight(name, gen, args.groups, timed=not args.bits_only) for name in args.weights]
    figures = dict(device=torch.cuda.get_device_name(), weights=weights)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
