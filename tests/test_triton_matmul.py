"""Exact mode's matmul (`agents.triton_matmul`, docs/exact.md): close to torch's, and a row's bits independent of how
many rows share the call, where the row sits, and which tile serves the call (the small tile for few rows, the
persistent TMA tile for many, each only where it gives the reference tile's bits). Runs on CUDA
(``MT_ENV_TEST_DEVICE=cuda``, float32 and bfloat16), or on CPU under Triton's interpreter (``TRITON_INTERPRET=1``,
float32; there the TMA kernel runs too, with a float32 tile made for the test)."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agents import exact

from .backend_hf_fixtures import DEVICE
from .triton_fixtures import DTYPES, EXAMPLES, TOLERANCE, randn, require_kernels

require_kernels()

from agents import triton_matmul as tm  # noqa: E402  (after the skip: it imports triton)

#: a TMA tile for float32 (none ships: float32 has the reference tile only), to run the TMA kernel's logic anywhere
TMA_F32 = tm.Tile("tma", 32, 32, 32, 4, 2, group_m=2)


@settings(max_examples=EXAMPLES, deadline=None)
@given(m=st.integers(1, 150), picks=st.lists(st.integers(0, 149), min_size=1, max_size=20),
       k=st.sampled_from([16, 37, 100]), n=st.sampled_from([48, 70]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_matmul_rows_do_not_depend_on_the_row_count_or_their_place(m, picks, k, n, dtype, seed):
    """Any selection of rows, in any order and with repeats, as a call of its own: the same bits as those rows of
    the full product, and of a product over the first `m` rows; values close to torch's matmul."""
    x, w = randn(150, k, seed=seed, dtype=dtype), randn(n, k, seed=seed + 1, dtype=dtype)
    full = tm.matmul(x, w)
    rows = torch.tensor([p % m for p in picks], device=DEVICE)
    assert full.dtype == dtype and full.shape == (150, n)
    assert torch.equal(tm.matmul(x[:m], w), full[:m])
    assert torch.equal(tm.matmul(x[:m][rows], w), full[rows])
    expected = x.double() @ w.double().t()
    torch.testing.assert_close(full.double(), expected, atol=TOLERANCE[dtype] * k ** 0.5, rtol=TOLERANCE[dtype])


@settings(max_examples=EXAMPLES, deadline=None)
@given(m=st.integers(1, 140), n=st.sampled_from([16, 48, 80]), k=st.sampled_from([16, 48, 112]),
       group_m=st.sampled_from([1, 2, 8]), seed=st.integers(0, 2**16))
def test_the_tma_kernel_and_any_program_order_give_the_reference_tiles_bits(m, n, k, group_m, seed):
    """The persistent TMA kernel (whole and partial tiles, fewer programs than tiles) and the pointer kernel under
    any grouping of its programs: the reference tile's bits (float32; in bfloat16 on a GPU at real shapes below)."""
    x, w = randn(m, k, seed=seed), randn(n, k, seed=seed + 1)
    want = tm.launch(x, w, torch.empty(m, n, device=DEVICE), tm.REFERENCE[torch.float32])
    if tm._tma_ready(x, w):
        got = tm.launch(x, w, torch.empty(m, n, device=DEVICE), TMA_F32._replace(group_m=group_m))
        assert torch.equal(got, want)
    regrouped = tm.REFERENCE[torch.float32]._replace(group_m=group_m)
    assert torch.equal(tm.launch(x, w, torch.empty(m, n, device=DEVICE), regrouped), want)


def test_tma_serves_only_operands_it_can_read():
    """Rows contiguous with 16-byte-aligned strides (the output's too) and bases; else the pointer kernel serves."""
    x, w = randn(40, 64, seed=0), randn(32, 64, seed=1)
    assert tm._tma_ready(x, w)
    assert not tm._tma_ready(x.t().contiguous().t(), w)  # columns contiguous
    assert not tm._tma_ready(randn(40, 65, seed=2)[:, :64], w)  # a row stride of 65 elements
    assert not tm._tma_ready(x, randn(33, 64, seed=3))  # an output row of 33 elements
    assert not tm._tma_ready(randn(2561, seed=4)[1:].view(40, 64), w)  # a base 4 bytes past alignment


def test_tma_wants_16_byte_bases_whatever_the_element_size(monkeypatch):
    """Off the interpreter strides count in bytes (element size x stride), a base address is bytes already: a
    bfloat16 operand 8 bytes past alignment (4 elements) is refused, as on a GPU."""
    monkeypatch.setattr(tm, "_INTERPRETED", False)
    monkeypatch.setattr(tm, "_tma_device", lambda device: True)
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    storage = torch.zeros(40 * 64 + 8, dtype=torch.bfloat16)
    start = next(i for i in range(8) if storage[i:].data_ptr() % 16 == 0)
    assert tm._tma_ready(storage[start:start + 40 * 64].view(40, 64), w)
    assert not tm._tma_ready(storage[start + 4:start + 4 + 40 * 64].view(40, 64), w)


def test_matmul_inside_a_backward_is_torchs_product():
    """Activation checkpointing recomputes a layer in backward, where only gradients read the values: there the op is
    cuBLAS's ``x @ w.T`` (torch's bits), outside a backward the kernel's."""
    x, w = randn(37, 16, seed=1), randn(24, 16, seed=2)
    inside = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            inside.append(tm.matmul(x, w))
            return grad

    Probe.apply(torch.zeros(3, device=DEVICE, requires_grad=True)).sum().backward()
    assert torch.equal(inside[0], torch.mm(x, w.t()))
    assert torch.equal(tm.matmul(x, w), tm._matmul(x, w))


@pytest.mark.parametrize("which", ["small", "large"])
def test_a_call_takes_the_small_or_large_tile_only_where_it_gives_the_same_bits(monkeypatch, which):
    """A call of few rows (where the reference makes fewer than FULL tiles) takes a SMALL tile, of at least LARGE_M
    rows a LARGE (TMA) one, each where this device's check found its bits equal to the reference tile's, the
    reference otherwise; either way a row's bits are those it gets in a call of the reference's size."""
    dtype = DTYPES[-1]
    tile = (tm.Tile("pointer", 32, 32, tm.REFERENCE[dtype].block_k, 4, 3) if which == "small"
            else tm.LARGE.get(dtype, (TMA_F32,))[-1])
    if which == "small":
        monkeypatch.setitem(tm.SMALL, dtype, ((8, tile),))
    else:  # (and no small tile: the call of 30 rows below takes the reference)
        monkeypatch.setitem(tm.SMALL, dtype, ())
        monkeypatch.setitem(tm.LARGE, dtype, (tile,))
    monkeypatch.setattr(tm, "LARGE_M", 64)
    monkeypatch.setattr(tm, "_AGREES", {})
    used, launch = [], tm.launch
    monkeypatch.setattr(tm, "launch", lambda x, w, out, t, *traced: used.append((len(x), t)) or launch(x, w, out, t))
    x, w = randn(80, 160, seed=3, dtype=dtype), randn(48, 160, seed=4, dtype=dtype)
    middle = tm.matmul(x[:30], w)  # neither few nor many rows: the reference
    assert used[-1] == (30, tm.REFERENCE[dtype])
    rows = 5 if which == "small" else 80
    got = tm.matmul(x[:rows], w)
    agrees = tm._agrees(x.device, dtype, tile)
    assert used[-1] == (rows, tile if agrees else tm.REFERENCE[dtype])
    assert torch.equal(got[:5], middle[:5])
    key = next(iter(tm._AGREES))
    for forced in (False, True):
        tm._AGREES[key] = forced
        tm.matmul(x[:rows], w)
        assert used[-1] == (rows, tile if forced else tm.REFERENCE[dtype])


@settings(max_examples=EXAMPLES, deadline=None)
@given(rows=st.lists(st.integers(1, 40_000), min_size=2, max_size=6), which=st.sampled_from([0, 1, 2]))
def test_a_compiled_kernels_constants_do_not_follow_the_row_count(rows, which):
    """Each new value of a compile-time constant compiles the kernel again (a second or so, mid-step): under any
    tile, calls of any row count (the trainer's last micro-batch, a prefill) pass the compiled kernel the same
    constants; only the grid follows the rows."""
    tile = (tm.REFERENCE[torch.bfloat16], *tm.LARGE[torch.bfloat16])[which]
    seen = []

    class Recorder:  # stands in for a kernel: records each launch's grid and constants
        def __getitem__(self, grid):
            return lambda *args, **consts: seen.append((grid, consts))

    w = torch.zeros(128, 64, dtype=torch.bfloat16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tm, "_INTERPRETED", False)  # (the interpreter's constant loop bounds are not compiled)
        patch.setattr(tm, "_pointer_kernel", Recorder())
        patch.setattr(tm, "_tma_kernel", Recorder())
        patch.setattr(tm, "_processors", lambda device: 132)
        for m in rows:
            x = torch.zeros(m, 64, dtype=torch.bfloat16)
            tm.launch(x, w, torch.empty(m, 128, dtype=torch.bfloat16), tile)
    assert all(consts == seen[0][1] for _, consts in seen), [consts for _, consts in seen]
    tiles = [-(-m // tile.block_m) * -(-128 // tile.block_n) for m in rows]
    assert [grid for grid, _ in seen] == [(n if tile.kernel == "pointer" else min(n, 132),) for n in tiles]


def test_the_tile_follows_the_shape(monkeypatch):
    """Which tile a shape gets, where every tile agrees: few rows a SMALL tile unless the reference already makes FULL
    tiles (the LM head), many rows the first LARGE tile that makes 1.5 tiles per SM without padding N by more than a
    quarter, else the last; rows in between the reference."""
    monkeypatch.setattr(tm, "_agrees", lambda device, dtype, tile, *traced: True)
    monkeypatch.setattr(tm, "_processors", lambda device: 132)
    monkeypatch.setattr(tm, "_tma_ready", lambda x, w, *traced: True)
    dtype = torch.bfloat16
    (_, tiny), (_, small) = tm.SMALL[dtype]
    wide, narrow = tm.LARGE[dtype]
    ref = tm.REFERENCE[dtype]

    def tile(m, n):
        return tm.tile_for(torch.empty(m, 8, dtype=dtype), torch.empty(n, 8, dtype=dtype))

    assert [tile(m, 896) for m in (1, 16, 17, 256, 257, 1023)] == [tiny, tiny, small, small, ref, ref]
    assert [tile(m, 151936) for m in (1, 256)] == [ref, ref]  # the LM head in decode: 1,187 reference tiles
    assert tile(256, 4864) == ref and tile(128, 4864) == small  # gate: 76 reference tiles at 256 rows, 38 at 128
    assert [tile(m, 896) for m in (1024, 2048, 8192)] == [narrow, narrow, wide]  # 32, 64, 256 wide tiles
    assert [tile(m, 128) for m in (1024, 32768)] == [narrow, narrow]  # a 256-wide tile would pad k's 128 by half
    assert tile(1024, 151936) == wide


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 tiles on a GPU (MT_ENV_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("n, k", [(1152, 896), (896, 4864), (4864, 896), (128, 896)])
def test_matmul_rows_keep_their_bits_across_the_tiles_at_real_shapes(n, k):
    """The 0.5B's qkv, down, gate and k weights in bf16: 3 rows alone (a small tile), among 17, 256 and 300 and
    among 1,024 and 8,192 (the TMA tiles) give the same bits, and on this GPU each tile agrees with the reference."""
    x = randn(8192, k, seed=5, dtype=torch.bfloat16)
    w = randn(n, k, seed=6, dtype=torch.bfloat16) * k ** -0.5
    alone = tm.matmul(x[:3], w)
    for m in (17, 256, 300, tm.LARGE_M - 1, tm.LARGE_M, len(x)):
        assert torch.equal(tm.matmul(x[:m], w)[:3], alone), m
    tiles = [t for _, t in tm.SMALL[torch.bfloat16]] + list(tm.LARGE[torch.bfloat16])
    assert all(tm._agrees(x.device, torch.bfloat16, t) for t in tiles)


def test_matmul_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="one dtype"):
        tm.matmul(randn(4, 16, seed=0), randn(8, 16, seed=1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        tm.matmul(randn(4, 16, seed=0), randn(8, 15, seed=1))
    assert tm.matmul(randn(0, 16, seed=0), randn(8, 16, seed=1)).shape == (0, 8)


@pytest.mark.skipif(DEVICE != "cuda", reason="exact.linear takes the Triton kernel on CUDA only")
def test_exact_linear_runs_the_kernel_on_cuda():
    x, w, b = randn(3, 5, 64, seed=0, dtype=torch.bfloat16), randn(40, 64, seed=1, dtype=torch.bfloat16), \
        randn(40, seed=2, dtype=torch.bfloat16)
    assert torch.equal(exact.linear(x, w, b), (tm.matmul(x.reshape(15, 64), w) + b).reshape(3, 5, 40))
