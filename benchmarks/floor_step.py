"""The floor of a decode step: the same model shape's step in plain torch ops, captured in one CUDA graph — fused
QKV, RoPE, SDPA over a dense per-row cache (every row the same length), output projection, fused gate/up, down,
RMS norms, the LM head and Gumbel-max sampling — with nothing the engine needs beyond that (no paging, no
per-row parameters, no bookkeeping). `benchmarks/bench_agent.py` divides the engine's decode step by it, measured
in the same process.

    python benchmarks/floor_step.py --batch 256 --context 2400      # Qwen2.5-0.5B's shape, bf16, on CUDA
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

#: Qwen2.5-0.5B's shape
SHAPE_0_5B = dict(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, vocab=151936)


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@torch.no_grad()
def floor_step_ms(shape: dict, batch: int, context: int, dtype: torch.dtype = torch.bfloat16, iters: int = 50,
                  device: str = "cuda") -> float:
    """Milliseconds per decode step of `shape` for `batch` rows that each attend to `context` cached positions
    (the median of `iters` graph replays, after warm-up)."""
    gen = torch.Generator(device).manual_seed(0)
    hid, inter, heads, kv = shape["hidden"], shape["intermediate"], shape["heads"], shape["kv_heads"]
    dim = hid // heads

    def w(*size):
        return (torch.randn(*size, generator=gen, device=device) * 0.02).to(dtype)

    layers = [dict(qkv=w(hid, (heads + 2 * kv) * dim), bias=w((heads + 2 * kv) * dim), o=w(heads * dim, hid),
                   gate_up=w(hid, 2 * inter), down=w(inter, hid), n1=w(hid) + 1, n2=w(hid) + 1)
              for _ in range(shape["layers"])]
    embed, final = w(shape["vocab"], hid), w(hid) + 1
    keys = torch.zeros(shape["layers"], batch, kv, context + 1, dim, dtype=dtype, device=device)
    values = torch.zeros_like(keys)
    tokens = torch.zeros(batch, dtype=torch.long, device=device)
    angle = context / 10000 ** (torch.arange(0, dim, 2, device=device).float() / dim)
    cos = torch.cat([angle.cos()] * 2).to(dtype)
    sin = torch.cat([angle.sin()] * 2).to(dtype)
    uniform = torch.rand(batch, shape["vocab"], generator=gen, device=device).clamp_(1e-9, 1)

    def step():
        x = embed[tokens][:, None, :]
        for layer, k_cache, v_cache in zip(layers, keys, values):
            qkv = _rms(x, layer["n1"]) @ layer["qkv"] + layer["bias"]
            q, k, v = qkv.split([heads * dim, kv * dim, kv * dim], dim=-1)
            q = _rope(q.view(batch, kv, heads // kv, dim), cos, sin)
            k_cache[:, :, context] = _rope(k.view(batch, kv, dim), cos, sin)
            v_cache[:, :, context] = v.view(batch, kv, dim)
            out = F.scaled_dot_product_attention(q, k_cache, v_cache, scale=1 / math.sqrt(dim))
            x = x + out.reshape(batch, 1, -1) @ layer["o"]
            gate, up = (_rms(x, layer["n2"]) @ layer["gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"]
        logits = (_rms(x, final) @ embed.T)[:, 0].float()
        tokens.copy_((logits - torch.log(-torch.log(uniform))).argmax(-1))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--context", type=int, nargs="+", default=[430, 2400])
    args = ap.parse_args()
    for context in args.context:
        for batch in args.batch:
            print(f"batch {batch:>4}, context {context:>5}: {floor_step_ms(SHAPE_0_5B, batch, context):.2f} ms")


if __name__ == "__main__":
    main()
