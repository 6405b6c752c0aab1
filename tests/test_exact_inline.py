"""Exact mode's kernels traced into compiled code (`agents.triton_matmul.inline`, ``MT_ENV_EXACT_INLINE=1``): under
AOTAutograd's functional tracing each op's body replaces it (the matmul, the trainer's and the engine's attention,
the row sum), so that its kernel is a node of the graph that Inductor launches itself. On CPU the graphs are read, not run: Triton's NVIDIA compiler (no GPU) reads each kernel's
IR to find the tensors it writes, as it does on CUDA (a stand-in driver names an sm_90 target); the CUDA test runs
them. Needs Triton; skipped under the interpreter (its kernels cannot be traced, and the op stays opaque there)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA builds of torch)")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter's kernels are not traced: the op stays opaque", allow_module_level=True)

from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table  # noqa: E402
from torch._subclasses.fake_tensor import is_fake  # noqa: E402

from agents import exact, triton_exact  # noqa: E402
from agents import triton_matmul as tm  # noqa: E402
from .backend_hf_fixtures import DEVICE  # noqa: E402

HOP = "triton_kernel_wrapper_functional"


class _Ran(Exception):
    """Raised by the captured graphs in place of running them (CPU: no GPU to launch on)."""


class _Sm90Driver:
    """What `identify_accessed_tensors` asks of Triton's active driver: the target to compile the kernel's IR for."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@pytest.fixture
def traced_on_cpu(monkeypatch):
    """Inlining on for CPU tensors (TMA as on an H100, every tile agreeing), the kernels' writes found from their
    IR for sm_90; gives the forward graph of each compilation, and the backend (its graphs raise `_Ran`)."""
    import triton

    try:
        triton.compile  # noqa: B018  (the NVIDIA backend reads the IR below; a Triton without it skips)
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as error:
        pytest.skip(f"no NVIDIA backend in this Triton: {error}")
    monkeypatch.setattr(triton.runtime.driver, "_active", _Sm90Driver())  # (restored after the test)
    monkeypatch.setattr(tm, "INLINE", True)
    monkeypatch.setattr(tm, "_inlines", lambda x: tm.INLINE)  # (the ops look the function up when they run)
    monkeypatch.setattr(tm, "_tma_device", lambda device: True)
    for dtype, tiles in tm.LARGE.items():
        for tile in (*tiles, *(t for _, t in tm.SMALL.get(dtype, ()))):
            monkeypatch.setitem(tm._AGREES, ("cpu", None, dtype, tile), True)
    graphs = []

    def run(*args):
        raise _Ran

    def capture(gm, example_inputs):
        graphs.append(gm)
        return run

    torch._dynamo.reset()
    yield graphs, aot_autograd(fw_compiler=capture, bw_compiler=lambda gm, example_inputs: run)
    torch._dynamo.reset()


def _call(fn, *args):
    try:
        fn(*args)
    except _Ran:
        pass


def _kernel_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and HOP in str(n.target)]


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU reading of the graphs; on CUDA the next test runs them")
def test_compiled_code_holds_the_kernel_with_the_eager_tile_writing_only_its_output(traced_on_cpu, monkeypatch):
    graphs, backend = traced_on_cpu
    probed = []  # the trace-time agreement check of the first TMA tile runs on real tensors, outside the tracing
    monkeypatch.delitem(tm._AGREES, ("cpu", None, torch.bfloat16, tm.LARGE[torch.bfloat16][0]))
    monkeypatch.setattr(tm, "_probe", lambda device, dtype, tile: probed.append(is_fake(torch.empty(1))) or True)
    weight = torch.randn(896, 640, dtype=torch.bfloat16, requires_grad=True)
    f = torch.compile(lambda x, w: tm.matmul(torch.nn.functional.silu(x), w) * 2, backend=backend, dynamic=True)
    seen, compiled = [], {}
    for rows in (2048, 64, 4096, 40):
        x = torch.randn(rows, 640, dtype=torch.bfloat16, requires_grad=True)
        before = len(graphs)
        _call(f, x, weight)
        compiled[rows] = len(graphs) > before
        (node,) = _kernel_nodes(graphs[{2048: 0, 4096: 0, 64: 1, 40: 1}[rows]])
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        tile = tm.tile_for(x, weight)
        assert getattr(kernel, "fn", kernel) is (tm._tma_kernel if tile.kernel == "tma" else tm._pointer_kernel)
        args = {**node.kwargs["kwargs"], **kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])}
        assert (args["BLOCK_M"], args["BLOCK_N"], args["BLOCK_K"]) == (tile.block_m, tile.block_n, tile.block_k)
        assert node.kwargs["tensors_to_clone"] == ["out_ptr"]  # its IR writes the output alone: no copy of inputs
        seen.append(tile.kernel)
    assert seen == ["tma", "pointer", "tma", "pointer"]
    # the tile's thresholds on M are the graphs' guards: 4,096 rows reuse 2,048's graph, 40 rows 64's
    assert compiled == {2048: True, 64: True, 4096: False, 40: False} and len(graphs) == 2
    assert probed == [False]


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU reading of the graphs")
def test_the_op_stays_one_opaque_call_where_it_is_not_inlined(traced_on_cpu, monkeypatch):
    graphs, backend = traced_on_cpu
    monkeypatch.setattr(tm, "INLINE", False)  # (as on CPU, under the interpreter, or by default)
    f = torch.compile(lambda x, w: tm.matmul(x, w) * 2, backend=backend, dynamic=True)
    _call(f, torch.randn(2048, 64, dtype=torch.bfloat16, requires_grad=True),
          torch.randn(96, 64, dtype=torch.bfloat16, requires_grad=True))
    calls = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert "mt_env.exact_matmul.default" in calls and not _kernel_nodes(graphs[0])


def _layer_like(q, k, v, index, lengths, seq, pos, real, segments):
    """What a compiled layer calls between its matmuls: the trainer's and the engine's attention, a row sum."""
    S, L = index.shape
    out = triton_exact.sequence_attention(q, k, v, index, lengths, seq, pos, real, segments, 0.125)
    engine = triton_exact.attention(q[index].transpose(1, 2), k, v, torch.arange(L, device=q.device).expand(S, L),
                                    lengths, 0.125, index)
    return triton_exact.row_sum(out.float().pow(2).flatten(1)), engine.sum()


def _layout():
    """Two packed sequences (5 and 3 tokens) and two tokens of none, as `agents.exact.sequences` lays them out."""
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 0]])
    real = torch.tensor([[True] * 8 + [False] * 2])
    layout = exact.sequences(position_ids, real)
    return (layout.index, layout.lengths, layout.seq, layout.pos, layout.real, layout.segments)


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU reading of the graphs")
def test_the_attention_and_row_sum_kernels_are_traced_too_each_writing_only_its_outputs(traced_on_cpu):
    graphs, backend = traced_on_cpu
    q, k, v = (torch.randn(10, h, 64, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
    _call(torch.compile(_layer_like, backend=backend, dynamic=True), q, k, v, *_layout())
    nodes = _kernel_nodes(graphs[0])
    kernels = [getattr(k, "fn", k) for k in (kernel_side_table.get_kernel(n.kwargs["kernel_idx"]) for n in nodes)]
    assert kernels == [triton_exact._attention_kernel, triton_exact._attention_kernel, triton_exact._row_sum_kernel]
    assert [sorted(n.kwargs["tensors_to_clone"]) for n in nodes] == [["lse_ptr", "out_ptr"]] * 2 + [["out_ptr"]]


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU reading of the graphs")
def test_a_compiled_exact_layer_launches_all_its_kernels_itself(traced_on_cpu, monkeypatch):
    """The trainer's exact model with its layers compiled as on CUDA: a layer's graph holds its ten kernels (seven
    matmuls, the attention, two row sums) and no opaque exact op, each kernel writing only its outputs; a
    micro-batch of another size class compiles one more graph, one of the first's class none."""
    from agents import compiling
    from benchmarks.bench_exact import TINY
    from benchmarks.exact_host import micro_batch
    from trainers.modeling import PolicyModel, build_causal_lm

    graphs, backend = traced_on_cpu
    monkeypatch.setattr(exact, "_ON_CPU", True)  # the kernels' ops, as on CUDA
    monkeypatch.setattr(exact, "compiles_layers", lambda device: True)
    monkeypatch.setattr(compiling, "_COMPILED", {})  # (a compiled layer function of its own, with this backend)
    monkeypatch.setattr(compiling, "_inductor", backend)
    lm = build_causal_lm(config=dict(TINY, hidden_size=128), vocab_size=500, dtype=torch.bfloat16)
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = PolicyModel(lm, exact=True).train()
    compiled = []
    for sequences, tokens in ((4, 300), (2, 40), (8, 400)):  # TMA-sized, decode-sized, TMA-sized
        batch = micro_batch(type("Args", (), {"sequences": sequences, "tokens": tokens}), 500, torch.device("cpu"))
        before = len(graphs)
        _call(policy, batch.input_ids, batch.loss_mask, batch.attention_mask)  # (padded rows: 1,200, 80, 3,200)
        compiled.append(len(graphs) - before)
    assert compiled == [1, 1, 0]
    for graph in graphs:
        calls = [n for n in graph.graph.nodes if n.op == "call_function"]
        assert not [n for n in calls if "mt_env" in str(n.target)]
        nodes = _kernel_nodes(graph)
        names = sorted(getattr(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]), "fn").__name__ for n in nodes)
        matmuls = [name for name in names if name in ("_pointer_kernel", "_tma_kernel")]
        assert len(matmuls) == 7 and names.count("_attention_kernel") == 1 and names.count("_row_sum_kernel") == 2
        assert all(set(n.kwargs["tensors_to_clone"]) <= {"out_ptr", "lse_ptr"} for n in nodes)


@pytest.mark.skipif(DEVICE != "cuda", reason="runs the inlined kernels: CUDA (MT_ENV_TEST_DEVICE=cuda)")
def test_inlined_attention_and_row_sum_have_the_eager_bits(monkeypatch):
    monkeypatch.setattr(tm, "INLINE", True)
    torch._dynamo.reset()
    q, k, v = (torch.randn(10, h, 64, device=DEVICE, dtype=torch.bfloat16) for h in (4, 2, 2))
    layout = [t.to(DEVICE) for t in _layout()]
    compiled = torch.compile(_layer_like, dynamic=True)
    got, want = compiled(q, k, v, *layout), _layer_like(q, k, v, *layout)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch._dynamo.reset()


@pytest.mark.skipif(DEVICE != "cuda", reason="runs the inlined kernels: CUDA (MT_ENV_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inlined_compiled_products_have_the_eager_bits_and_gradients(monkeypatch, dtype):
    """Compiled with the kernel inlined, the product of every row count (decode's small tiles, the reference, TMA)
    is the eager op's, bit for bit, and its gradients are the eager op's backward (cuBLAS in both)."""
    monkeypatch.setattr(tm, "INLINE", True)
    tm.use_scratch()  # (what `agents.exact.ops` does on entry: the TMA kernel's memory, for Inductor's launches)
    torch._dynamo.reset()
    weight = torch.randn(896, 640, device=DEVICE, dtype=dtype, requires_grad=True)
    f = torch.compile(lambda x, w: tm.matmul(torch.nn.functional.silu(x), w), dynamic=True)
    for rows in (1, 16, 200, 1000, 2048, 5000):
        x = torch.randn(rows, 640, device=DEVICE, dtype=dtype, requires_grad=True)
        got = f(x, weight)
        want = tm.matmul(torch.nn.functional.silu(x), weight)
        assert torch.equal(got, want), rows
        grads = torch.autograd.grad(got.float().sum(), (x, weight))
        wanted = torch.autograd.grad(want.float().sum(), (x, weight))
        assert all(torch.equal(a, b) for a, b in zip(grads, wanted)), rows
    torch._dynamo.reset()
