"""Exact mode's matmul in Triton (CUDA; docs/exact.md, "On CUDA" and "The matmul's order over tiles"): ``x @ W^T``
whose rows' bits depend on their own values only, whatever the number of rows in the call or their places.

Why a kernel of our own: cuBLAS picks its algorithm, tile and split-K from the problem's shape, so a row's bits
depend on M. Here one thing is fixed for every call of a dtype: the reduction over K, walked from 0 in steps of
`BLOCK_K` into a float32 accumulator by ``tl.dot`` (no split-K). A `Tile` says how the output is cut and in what order
programs take the pieces; that changes no element's arithmetic where the GPU's MMA instructions give one element
the same bits in any tile shape. That is the hardware's property, not the code's, so a tile other than the dtype's
`REFERENCE` serves only where it gave the reference's bits on this device (`_agrees`: checked once per device), else
the reference does:

* ``"pointer"`` tiles: a program per output tile, loads by pointer (any strides). The reference, and `SMALL` for
  calls of few rows where the reference's tiles would leave most of the GPU idle (decode).
* ``"tma"`` tiles: persistent programs (one per SM) that load and store by TMA descriptors (made by the kernel),
  Hopper and later, for calls of at least `LARGE_M` rows (prefill, the trainer) whose operands TMA can read
  (`_tma_ready`).

Programs take tiles in groups of `Tile.group_m` tiles down M, across N within a group: the weight's tiles and the
rows' tiles in flight both stay in L2 (down M alone re-read a 32k-row x from memory once per column of tiles).
Inside a backward (activation checkpointing's recompute, whose values only feed gradients) the product is cuBLAS's,
except under `forward_bits_in_recompute` (a recompute that must give the forward's bits). In compiled code on CUDA
with `INLINE` on, the kernel is traced into the graph and Inductor launches it (`inline`; its recompute then runs
the kernel too).
Under Triton's interpreter (``TRITON_INTERPRET=1``) loop bounds are constants (`STATIC_*`), with the same masks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.library import wrap_triton
from torch.utils._python_dispatch import _disable_current_modes

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: in compiled code on CUDA, exact mode's kernels traced into the graph and launched by Inductor (`inline`); off by
#: default until a GPU has measured it (docs/exact.md, the fifteenth session): ``MT_ENV_EXACT_INLINE=1`` turns it on
INLINE = os.environ.get("MT_ENV_EXACT_INLINE", "0") == "1"
_IN_RECOMPUTE = threading.local()  #: `forward_bits_in_recompute`'s switch (on the thread the recompute runs on)


class Tile(NamedTuple):
    """How a call's output is cut: the kernel, the output tile, `block_k` (the reduction's step: every tile of a
    dtype has the reference's), warps, pipeline stages, and `group_m` (M-tiles per group of the programs' order)."""

    kernel: str
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    group_m: int = 8


#: the tile whose bits define exact mode's matmul, by input dtype (float32: IEEE products, not TF32)
REFERENCE = {torch.bfloat16: Tile("pointer", 128, 128, 64, 8, 3), torch.float16: Tile("pointer", 128, 128, 64, 8, 3),
             torch.float32: Tile("pointer", 64, 64, 32, 4, 3)}
#: tiles for few rows, (most rows, tile), the first that fits: for calls where the reference would make fewer than
#: `FULL` tiles (decode: at 32 rows a 896-wide output is 7 reference tiles; the LM head's 1,187 keep the reference)
SMALL = {torch.bfloat16: ((16, Tile("pointer", 16, 32, 64, 4, 4)), (256, Tile("pointer", 64, 32, 64, 4, 4)))}
FULL = 64
#: TMA tiles for calls of at least `LARGE_M` rows that TMA reads (`_tma_ready`), the first that makes at least 1.5
#: tiles per SM and pads N by at most a quarter; the last serves any shape
_TMA = (Tile("tma", 128, 256, 64, 8, 3), Tile("tma", 128, 128, 64, 8, 3))
LARGE = {torch.bfloat16: _TMA, torch.float16: _TMA}
LARGE_M = 1024
assert all(t.block_k == REFERENCE[dtype].block_k for dtype, tiles in LARGE.items() for t in tiles)
assert all(t.block_k == REFERENCE[dtype].block_k for dtype, tiles in SMALL.items() for _, t in tiles)


@triton.jit
def _tile_of(program, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(m, n) of the `program`-th tile: groups of GROUP_M tiles down M, each group walked down M, then across N."""
    group = program // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    size = tl.minimum(tiles_m - first_m, GROUP_M)
    in_group = program - group * GROUP_M * tiles_n
    return first_m + in_group % size, in_group // size


@triton.jit(do_not_specialize=["M"])
def _pointer_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    IEEE: tl.constexpr, STATIC_K: tl.constexpr, INTERPRETED: tl.constexpr):
    pid_m, pid_n = _tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, STATIC_K if INTERPRETED else K, BLOCK_K):  # K in order, from 0: the only reduction order
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(rm < M)[:, None] & (kk < K)[None, :], other=0.0)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=(rn < N)[None, :] & (kk < K)[:, None], other=0.0)
        if IEEE:  # float32 in: true float32 products (not TF32)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _tma_tile(x_desc, w_desc, out_desc, program, tiles_m, tiles_n, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr):
    """One output tile of the TMA kernel: the same walk over K as `_pointer_kernel` (TMA fills what lies past M, N or
    K with zeros, as the pointer kernel's masks do, and stores nothing past M or N)."""
    pid_m, pid_n = _tile_of(program, tiles_m, tiles_n, GROUP_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = x_desc.load([pid_m * BLOCK_M, k0])
        b = w_desc.load([pid_n * BLOCK_N, k0])
        if IEEE:
            acc = tl.dot(a, b.T, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.T, acc)
    out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(out_desc.dtype))


@triton.jit(do_not_specialize=["M"])
def _tma_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr,
                STATIC_K: tl.constexpr, STATIC_TILES: tl.constexpr, STATIC_PROGRAMS: tl.constexpr,
                INTERPRETED: tl.constexpr):
    # the descriptors are made here, on the device (in global memory Triton asks `_scratch` for at each launch):
    # made on the host, each cost a Python object and an encoding in Triton's launcher, three a call
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[stride_om, 1],
                                         block_shape=[BLOCK_M, BLOCK_N])
    # the programs step by their count, read at run time: as a constant it would follow M wherever a call makes
    # fewer tiles than there are SMs, and each new value would compile the kernel again (a second or so, mid-step)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    if INTERPRETED:  # (constant loop bounds; the same tiles)
        for first in range(0, STATIC_TILES, STATIC_PROGRAMS):
            if first + tl.program_id(0) < tiles_m * tiles_n:
                _tma_tile(x_desc, w_desc, out_desc, first + tl.program_id(0), tiles_m, tiles_n, STATIC_K, BLOCK_M,
                          BLOCK_N, BLOCK_K, GROUP_M, IEEE)
    else:
        for program in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0)):
            _tma_tile(x_desc, w_desc, out_desc, program, tiles_m, tiles_n, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                      IEEE)


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for `x` [M, K] and `weight` [N, K] of one dtype (bfloat16, float16 or float32), float32
    accumulation, in x's dtype: a row's bits do not depend on M or on the row's place among the others.
    Differentiable (the backward is torch's: gradients are not compared bit for bit)."""
    return torch.ops.mt_env.exact_matmul(x, weight)


@contextlib.contextmanager
def forward_bits_in_recompute():
    """Calls made inside a backward while this context is open (on this thread) run the exact kernel, as in the
    forward, where they would run cuBLAS: for a recompute that reuses values its forward saved."""
    before = getattr(_IN_RECOMPUTE, "exact", False)
    _IN_RECOMPUTE.exact = True
    try:
        yield
    finally:
        _IN_RECOMPUTE.exact = before


@torch.library.custom_op("mt_env::exact_matmul", mutates_args=())
def _matmul_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if torch._C._current_graph_task_id() != -1 and not getattr(_IN_RECOMPUTE, "exact", False):  # a recompute
        _check(x, weight)  # (docs/exact.md: only the forward's values must be the engine's): cuBLAS
        return torch.mm(x, weight.t())
    return _matmul(x, weight)


@_matmul_op.register_fake
def _(x, weight):
    _check(x, weight)
    return x.new_empty(x.shape[0], weight.shape[0])


def inline(op, body) -> None:
    """Have custom op `op` traced as `body` (its implementation, called with ``traced=True``: its launches made
    through `kernel`) under AOTAutograd's functional tracing, that is in compiled code, where `_inlines` its first
    tensor: its kernels become nodes of the graph that Inductor launches from its own wrapper, with no custom-op
    dispatch, no host choices (they are made at trace time: thresholds on sizes become guards of the graph) and no
    Triton launcher Python at run time. Elsewhere the op stays one opaque call. (`torch.library.triton_op` does
    this on every device, and the interpreter's kernels cannot be traced: hence a rule of our own.)"""

    def rule(mode, func, types, args, kwargs):
        if not _inlines(args[0]):
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode:
            return body(*args, **kwargs, traced=True)

    op.register_torch_dispatch(FunctionalTensorMode, rule)


def _inlines(x: torch.Tensor) -> bool:
    return INLINE and x.device.type == "cuda" and not _INTERPRETED


def kernel(fn, traced: bool):
    """Triton kernel `fn` as a launch will make it: recorded as a node of the graph being traced where `traced`
    (`torch.library.wrap_triton`), else itself."""
    return wrap_triton(fn) if traced else fn


def _matmul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _matmul_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    return (grad @ weight if ctx.needs_input_grad[0] else None,
            grad.t() @ x if ctx.needs_input_grad[1] else None)


_matmul_op.register_autograd(_matmul_backward, setup_context=_matmul_setup)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"exact matmul: x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in REFERENCE:
        raise ValueError(f"exact matmul: x and weight of one dtype of {list(REFERENCE)}, got {x.dtype} and "
                         f"{weight.dtype}")


def _matmul(x: torch.Tensor, weight: torch.Tensor, traced: bool = False) -> torch.Tensor:
    """The product by the kernel; `traced`: under `inline`'s tracing (fake tensors, the launch a graph node)."""
    _check(x, weight)
    (M, K), N = x.shape, weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    return launch(x, weight, out, tile_for(x, weight, traced), traced)


inline(_matmul_op, _matmul)  # (inlined, activation checkpointing's recompute runs the kernel too, not cuBLAS)


def tile_for(x: torch.Tensor, weight: torch.Tensor, traced: bool = False) -> Tile:
    """The tile of ``x @ weight.T`` (`SMALL` or `LARGE` by the call's shape, each where it gives the reference's bits
    on this device; else `REFERENCE`). Why these: docs/exact.md, "The matmul's tiles, chosen by shape"."""
    M, N, dtype = x.shape[0], weight.shape[0], x.dtype
    if M >= LARGE_M and dtype in LARGE and _tma_ready(x, weight, traced):
        *sized, last = LARGE[dtype]
        for tile in [t for t in sized if _fills(t, M, N, x.device)] + [last]:
            if _agrees(x.device, dtype, tile, traced):
                return tile
    if dtype in SMALL and _tiles(REFERENCE[dtype], M, N) < FULL:
        tile = next((tile for rows, tile in SMALL[dtype] if M <= rows), None)
        if tile is not None and _agrees(x.device, dtype, tile, traced):
            return tile
    return REFERENCE[dtype]


def _tiles(tile: Tile, M: int, N: int) -> int:
    return cdiv(M, tile.block_m) * cdiv(N, tile.block_n)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` on the host. (Triton's `triton.cdiv` and `triton.next_power_of_2` are constexpr functions,
    whose wrapper costs about 4 µs a call on the host, where this costs 30 ns: several a kernel launch.)"""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= `n` (1 for n <= 1), on the host (see `cdiv`)."""
    return 1 << max(0, n - 1).bit_length()


def _fills(tile: Tile, M: int, N: int, device: torch.device) -> bool:
    """Whether `tile` pads N by at most a quarter and makes at least 1.5 tiles per SM of an [M, N] output (in this
    order: traced, the second is a guard on M, made only where the first holds)."""
    return -N % tile.block_n <= N / 4 and _tiles(tile, M, N) >= 1.5 * _processors(device)


def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, tile: Tile, traced: bool = False) -> torch.Tensor:
    """Write ``x @ weight.T`` into `out` (fresh, contiguous) under `tile`: the kernel itself, no choice made;
    `traced`: the launch recorded as a node of the graph being traced (`kernel`)."""
    pointer_kernel, tma_kernel = kernel(_pointer_kernel, traced), kernel(_tma_kernel, traced)
    (M, K), N = x.shape, weight.shape[0]
    consts = dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                  IEEE=x.dtype == torch.float32, STATIC_K=K if _INTERPRETED else 0, INTERPRETED=_INTERPRETED,
                  num_warps=tile.warps, num_stages=tile.stages)
    tiles = _tiles(tile, M, N)
    if tile.kernel == "pointer":
        pointer_kernel[(tiles,)](x, weight, out, M, N, K, x.stride(0), x.stride(1), weight.stride(0),
                                 weight.stride(1), out.stride(0), **consts)
        return out
    programs = torch.sym_min(tiles, _processors(x.device))  # (traced: no guard on M)
    use_scratch()
    tma_kernel[(programs,)](x, weight, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
                            STATIC_TILES=tiles if _INTERPRETED else 0,
                            STATIC_PROGRAMS=programs if _INTERPRETED else 0, **consts)
    return out


def use_scratch() -> None:
    """Let the TMA kernel's launches on this thread (and its tasks) take their global memory from `_scratch`:
    Triton's allocator is a context variable, unset on a new thread. Each eager launch sets it; `agents.exact.ops`
    does on entry, for the launches of compiled code (`inline`), which Triton's launcher makes."""
    triton.set_allocator(_scratch)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for a launch of the TMA kernel, where its programs write their descriptors (Triton's allocator
    protocol; on the current CUDA device, where Triton launches): the caching allocator's (its 512-byte alignment
    covers the `alignment` asked), freed after the launch in stream order."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _tma_ready(x: torch.Tensor, weight: torch.Tensor, traced: bool = False) -> bool:
    """Whether TMA can read `x` and `weight` and write their product on their device: a Hopper or later GPU (or the
    interpreter, which counts strides in elements), rows contiguous, row strides (the output's: N) and base
    addresses 16-byte aligned (`traced`: storage offsets, the storages' own alignment being the allocator's)."""
    if not _tma_device(x.device):
        return False
    unit = 1 if _INTERPRETED else x.element_size()
    strides = (x.stride(0), weight.stride(0), weight.shape[0])
    bases = (x.storage_offset() * unit, weight.storage_offset() * unit) if traced else (x.data_ptr(), weight.data_ptr())
    return (x.stride(1) == 1 and weight.stride(1) == 1 and all(s * unit % 16 == 0 for s in strides)
            and all(b % 16 == 0 for b in bases))  # (bases in bytes already)


def _tma_device(device: torch.device) -> bool:
    """A Hopper or later GPU, or the interpreter."""
    return _cuda_facts(device.index)[0] >= 9 if device.type == "cuda" else _INTERPRETED


def _processors(device: torch.device) -> int:
    """The persistent kernel's programs: one per SM (4 under the interpreter)."""
    return _cuda_facts(device.index)[1] if device.type == "cuda" else 4


@functools.lru_cache(maxsize=None)
def _cuda_facts(index: int | None) -> tuple[int, int]:
    """(compute capability's major, SM count) of CUDA device `index`, read once (a call's choice reads them)."""
    properties = torch.cuda.get_device_properties(index)
    return properties.major, properties.multi_processor_count


_AGREES: dict[tuple[str, int | None, torch.dtype, Tile], bool] = {}
_PROBE = (512, 640, 320)  #: (M, K, N) of `_agrees`' product: whole and partial tiles, 10 steps over K for bf16


def _agrees(device: torch.device, dtype: torch.dtype, tile: Tile, traced: bool = False) -> bool:
    """Whether `tile` gives the reference tile's bits on this device, checked once: a product of random values under
    both tiles. Where it does not (or cannot run here), the reference serves; a failure to run warns. (`traced`:
    the check runs outside the tracing's modes, on real tensors.)"""
    key = (device.type, device.index, dtype, tile)
    if key not in _AGREES and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False  # (no check inside a CUDA graph's capture: this call takes the reference, a later one checks)
    if key not in _AGREES:
        with _disable_current_modes() if traced else contextlib.nullcontext():
            _AGREES[key] = _probe(device, dtype, tile)
    return _AGREES[key]


def _probe(device: torch.device, dtype: torch.dtype, tile: Tile) -> bool:
    """`_agrees`' product under `tile` and under the reference, compared bit for bit."""
    (m, k, n), gen = _PROBE, torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = torch.randn(n, k, generator=gen, device=device).to(dtype)
    try:
        got, want = (launch(x, w, torch.empty(m, n, dtype=dtype, device=device), t) for t in (tile, REFERENCE[dtype]))
        return torch.equal(got, want)
    except Exception as exc:  # shared memory, TMA, or this Triton: the reference tile serves
        warnings.warn(f"exact matmul: the tile {tile} does not run on {device} ({type(exc).__name__}: {exc}); the "
                      "reference tile serves")
        return False
