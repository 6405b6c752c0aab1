"""An experiment (issue 28, docs/exact.md): the host's cost of exact mode's update, where the device waits for it.

On a micro-batch so small that the device finishes each kernel before the host launches the next, a pass's wall time
is the host's: Python, the dispatcher, the launches. Measured with exact mode on and off, in one process:

1. One matmul call of a few rows: ``F.linear``, exact mode's `triton_matmul.matmul` (the custom op, its choice of
   tile), `triton_matmul.launch` under each kind of tile alone, and the op in a compiled function, opaque and
   inlined (`triton_matmul.inline`); microseconds a call.
2. The update's forward and backward (`trainers.ppo.forward` with entropy, a loss of the masked sum, backward) on
   `--sequences` packed sequences of `--tokens` tokens, activation checkpointing on and the decoder layers compiled
   as the smoke recipe runs them (off: ``trainer.compile``; on: where exact mode compiles them): milliseconds an
   iteration, and the device kernels each launched (torch.profiler).
3. ``--cprofile N``: the N Python functions of most own time over `--iters` iterations of each mode (cProfile).
4. ``--ops N``: the N operations of most host time in one iteration of each mode (torch.profiler's self CPU time,
   by operation: a custom op's dispatch, a launch, an ATen call), without cProfile's per-call inflation.
5. ``--inline``: exact mode a second time with its kernels traced into the compiled layers
   (`agents.triton_matmul.INLINE`, ``MT_ENV_EXACT_INLINE=1``), compiled afresh.

    python benchmarks/exact_host.py --device cuda                  # bash benchmarks/run_gpu.sh exact_host
    python benchmarks/exact_host.py --device cpu --model tiny --iters 3
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_exact import TINY, update_step  # noqa: E402
from mt_env.batch import collate  # noqa: E402
from mt_env.sample import Sample  # noqa: E402
from trainers.config import Config  # noqa: E402
from trainers.modeling import PolicyModel, build_causal_lm, compile_layers  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, device: torch.device, calls: int) -> float:
    """Microseconds a call of `calls` calls in a row, synchronised once at the end (after one warm-up call)."""
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / calls * 1e6


def matmul_calls(device: torch.device, calls: int) -> dict:
    """Host microseconds of one [16, 896] x [896, 896]^T bf16 product by each path."""
    from agents import triton_matmul as tm

    x = torch.randn(16, 896, device=device).bfloat16()
    w = torch.randn(896, 896, device=device).bfloat16()
    paths = {"F.linear": lambda: F.linear(x, w), "exact matmul (custom op)": lambda: tm.matmul(x, w),
             "exact matmul (no custom op)": lambda: tm._matmul(x, w)}
    for tile in (tm.REFERENCE[torch.bfloat16], *tm.LARGE[torch.bfloat16][-1:]):
        paths[f"launch {tile.kernel} {tile.block_m}x{tile.block_n}"] = (
            lambda t=tile: tm.launch(x, w, torch.empty(16, 896, dtype=x.dtype, device=device), t))
    paths["compiled: the op, opaque"] = _compiled(_opaque_call, False, x, w)
    paths["compiled: the kernel inlined"] = _compiled(_inlined_call, True, x, w)
    figures = {}
    for name, fn in paths.items():
        try:
            figures[name] = per_call_us(fn, device, calls)
        except Exception as exc:  # a tile this device cannot run
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        print(f"  {name:32s} {figures[name]:8.1f} us a call", flush=True)
    return figures


def _opaque_call(x, w):
    from agents import triton_matmul as tm

    return tm.matmul(x, w)


def _inlined_call(x, w):  # (the same body: its own code object, so its own compiled graph)
    from agents import triton_matmul as tm

    return tm.matmul(x, w)


def _compiled(fn, inline: bool, x, w):
    """`fn` compiled (and traced now) with exact mode's kernels inlined or not (the choice is the tracing's)."""
    from agents import triton_matmul as tm

    compiled, before, tm.INLINE = torch.compile(fn), tm.INLINE, inline
    try:
        compiled(x, w)
    finally:
        tm.INLINE = before
    return lambda: compiled(x, w)


def micro_batch(args, vocab: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    samples = []
    for b in range(args.sequences):
        ids = torch.randint(0, vocab, (args.tokens,), generator=g).tolist()
        half = args.tokens // 2
        samples.append(Sample.single_turn(ids[:half], ids[half:], [0.0] * (args.tokens - half), episode=b))
    return collate(samples, pad_token_id=0).to(device)


def kernels_launched(fn, device: torch.device, ops: int = 0) -> int | None:
    """The device kernels one call of `fn` launches (None off CUDA); with `ops`, also print the `ops` operations of
    most host (self CPU) time in that call, by torch.profiler: the dispatcher's view, where cProfile sees Python."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    if not (cuda or ops):
        return None
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        _sync(device)
    if ops:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=ops, max_name_column_width=50),
              flush=True)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) if cuda else None


def update_host(lm, args, device: torch.device, on: bool, label: str) -> dict:
    cfg = Config()
    cfg.trainer.packed, cfg.rollout.temperature = True, 1.0
    policy = PolicyModel(lm, exact=on).train()
    mb = micro_batch(args, lm.config.vocab_size, device)
    step = lambda: update_step(policy, mb, cfg)  # noqa: E731
    for _ in range(3):  # compilation
        step()
    ms = per_call_us(step, device, args.iters) / 1e3
    figures = {"ms": ms, "kernels": kernels_launched(step, device, args.ops)}
    print(f"  exact {label}: {ms:8.2f} ms an iteration, {figures['kernels']} kernels", flush=True)
    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.iters):
            step()
        _sync(device)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.cprofile)
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:12000], flush=True)
    lm.zero_grad(set_to_none=True)
    return figures


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="qwen2.5-0.5b", help="a preset of trainers.modeling.PRESETS, or tiny")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16, help="tokens a sequence (half prompt, half response)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--calls", type=int, default=300, help="matmul calls timed per path")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the N functions of most own time")
    ap.add_argument("--ops", type=int, default=0, metavar="N",
                    help="print the N operations of most host time in one iteration (torch.profiler)")
    ap.add_argument("--inline", action="store_true", help="also exact mode with its kernels inlined in compiled code")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = dict(config=TINY, vocab_size=2000) if args.model == "tiny" else dict(preset=args.model)
    figures = {}
    if device.type == "cuda":
        print("one matmul of 16 rows:")
        figures["matmul_us"] = matmul_calls(device, args.calls)
    print(f"the update's forward and backward, {args.sequences} sequences of {args.tokens} tokens packed:")
    modes = [("off", False, False), ("on", True, False)] + [("on, inlined", True, True)] * args.inline
    for label, on, inline in modes:  # a model each: the plain one compiled as trainer.compile does, exact mode its own
        _inline_kernels(inline)
        lm = build_causal_lm(**config, dtype=dtype).to(device)
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not on:
            compile_layers(lm)
        figures[f"update_exact_{label.replace(', ', '_')}"] = update_host(lm, args, device, on, label)
        del lm
    return figures


def _inline_kernels(on: bool) -> None:
    """Exact mode's kernels inlined in compiled code or not, from the next compilation: dynamo's caches go (the
    choice is made when AOTAutograd traces, where dynamo keeps no guard on it)."""
    try:
        from agents import triton_matmul
    except ImportError:  # no Triton: nothing to inline
        return
    if triton_matmul.INLINE != on:
        triton_matmul.INLINE = on
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
