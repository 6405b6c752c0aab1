"""Exact mode's row kernels (`agents.triton_exact.row_sum`, `softmax_stats`, `agents.triton_sampling.sample`)
compiled for a GPU without one, read in Triton's GPU IR: every floating-point sum they make adds pairs, so its bits
cannot follow the layout the compiler picks. Why it matters: `tl.sum` over a lane vector sums each thread's lanes in
turn, and the lanes a thread holds follow the loads' vectorisation, that is the input's dtype and alignment (8 lanes
for aligned bfloat16, 4 for aligned float32, 1 unaligned: the sampler's float32 logits and the trainer's bfloat16 ones
summed differently on an H100, docs/exact.md). Needs Triton with its NVIDIA backend (its compiler, not a GPU);
skipped under the interpreter."""

from __future__ import annotations

import math
import os
import re

import pytest

triton = pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA builds of torch)")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter runs the kernels' Python, there is no IR to read", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from agents import triton_exact, triton_sampling  # noqa: E402

#: "tt.reduce"(%x) <{axis = A : i32}> ({ combine region }) : (tensor<D0xD1x...xf32, ...>) -> ...
REDUCE = re.compile(r'"tt\.reduce"\(.*?\) <\{axis = (\d+) : i32\}> \(\{(.*?)\}\) : \(tensor<([0-9x]+)x', re.S)
KERNELS = {  # name: (kernel, pointer arguments, the row stride's index, more integer arguments)
    "row_sum": (triton_exact._row_sum_kernel, {"x_ptr": None, "out_ptr": "*fp32"}, 3, ()),
    "softmax_stats": (triton_exact._softmax_stats_kernel, {"x_ptr": None, "temp_ptr": "*fp32", "out_ptr": "*fp32"},
                      4, ()),
    "sample": (triton_sampling._sample_kernel, {"x_ptr": None, "temp_ptr": "*fp32", "top_ptr": "*fp32",
                                                "u_ptr": "*fp64", "out_ptr": "*i64"}, 6, ("stride_top",)),
}


def ttgir(name: str, dtype: str, block: int) -> str:
    """The kernel's GPU IR for an H100 (sm_90), with 16-divisible pointers and row stride (vectorised loads)."""
    kernel, pointers, stride_at, more = KERNELS[name]
    signature = {arg: kind or dtype for arg, kind in pointers.items()}
    signature.update(n="i32", stride_row="i32", **{arg: "i32" for arg in more}, BLOCK="constexpr",
                     LEVELS="constexpr", STATIC_N="constexpr", INTERPRETED="constexpr")
    constants = {"BLOCK": block, "LEVELS": block.bit_length() - 1, "STATIC_N": 0, "INTERPRETED": False}
    aligned = {(i,): [["tt.divisibility", 16]] for i in (*range(len(pointers)), stride_at)}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except (RuntimeError, FileNotFoundError) as error:  # no NVIDIA backend or ptxas in this Triton
        pytest.skip(f"Triton cannot compile for sm_90 here: {error}")
    return compiled.asm["ttgir"]


@pytest.mark.parametrize("name,dtype", [("row_sum", "*fp32"), ("softmax_stats", "*bf16"), ("softmax_stats", "*fp32"),
                                        ("sample", "*fp32")])
@pytest.mark.parametrize("block", [1024, 64])
def test_the_row_kernels_add_in_pairs_whatever_the_layout(name, dtype, block):
    reductions = [(int(axis), [int(d) for d in shape.split("x")], body) for axis, body, shape in REDUCE.findall(
        ttgir(name, dtype, block))]
    sums = [(axis, shape) for axis, shape, body in reductions if "arith.addf" in body]
    assert sums, "no sum found in the IR: the pattern no longer matches Triton's output"
    assert all(shape[axis] == 2 or math.prod(shape) == 1 for axis, shape in sums), sums
    others = [body for _, _, body in reductions if "arith.addf" not in body]
    assert all(any(op in body for op in ("max", "min", "arith.addi")) for body in others)  # exact in any order


@pytest.mark.parametrize("which", [0, 1])
def test_the_matmuls_large_tiles_compile_for_sm90_to_tma_loads_and_wgmma(which):
    """The persistent kernel of exact mode's large tiles (`agents.triton_matmul.LARGE`) compiles for an H100 without
    a GPU, its operands loaded by TMA and multiplied by wgmma (what the tiles are for), within the SM's shared
    memory; its descriptors made by the kernel, in the global memory Triton asks `triton_matmul._scratch` for."""
    import torch

    from agents import triton_matmul

    tile = triton_matmul.LARGE[torch.bfloat16][which]
    consts = dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                  IEEE=False, STATIC_K=0, STATIC_TILES=0, STATIC_PROGRAMS=0, INTERPRETED=False)
    signature = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", M="i32", N="i32", K="i32", stride_xm="i32",
                     stride_wn="i32", stride_om="i32", **{name: "constexpr" for name in consts})
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 6, 7, 8)}  # bases and row strides (`_tma_ready`)
    source = ASTSource(fn=triton_matmul._tma_kernel, signature=signature, constexprs=consts, attrs=aligned)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 128),
                                  options={"num_warps": tile.warps, "num_stages": tile.stages})
    except (RuntimeError, FileNotFoundError) as error:  # no NVIDIA backend or ptxas in this Triton
        pytest.skip(f"Triton cannot compile for sm_90 here: {error}")
    ir = compiled.asm["ttgir"]
    assert "async_tma_copy_global_to_local" in ir and "warp_group_dot" in ir
    assert "tensormap_create" in ir and compiled.metadata.global_scratch_size > 0  # descriptors made on the device
    assert compiled.metadata.shared <= 227 * 1024  # an H100's shared memory per block
