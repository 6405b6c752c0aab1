"""Exact mode's Triton kernels (`agents.triton_exact`, docs/exact.md; the matmul's tests: test_triton_matmul.py): the
attention close to `agents.exact.attention`'s torch version and a query's bits independent of which queries share the
call (decode's one, a prefill's run after a cached prefix, any subset in any order) and of the keys past its
sequence's length; the row sum close to torch's and a row's bits independent of the other rows. Runs on CUDA
(``MT_ENV_TEST_DEVICE=cuda``, float32 and bfloat16), or on CPU under Triton's interpreter (``TRITON_INTERPRET=1``,
float32: the interpreter reads bfloat16 wrongly in `tl.dot`)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM

from agents import exact
from trainers.modeling import PolicyModel

from .backend_hf_fixtures import DEVICE, layer_compiler_fixture, packed_positions  # noqa: F401  (`layer_compiler`)
from .triton_fixtures import DTYPES, EXAMPLES, TOLERANCE, randn, require_kernels

require_kernels()

from agents import triton_exact  # noqa: E402  (after the skip: it imports triton)



# --------------------------------------------------------------------------------------------- attention
def attention_case(data, dtype):
    """Random sequences (lengths up to the key axis), GQA layout, head_dim."""
    S, kv_heads = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
    group, d = data.draw(st.sampled_from([1, 2, 3, 7])), data.draw(st.sampled_from([8, 16, 24]))
    Tk = data.draw(st.integers(1, 150))
    lengths = torch.tensor([data.draw(st.integers(1, Tk)) for _ in range(S)], device=DEVICE)
    seed = data.draw(st.integers(0, 2**16))
    q = randn(S, kv_heads * group, Tk, d, seed=seed, dtype=dtype)
    k, v = randn(S, kv_heads, Tk, d, seed=seed + 1, dtype=dtype), randn(S, kv_heads, Tk, d, seed=seed + 2, dtype=dtype)
    return q, k, v, lengths, d ** -0.5


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data())
def test_attention_is_close_to_the_torch_version(data):
    dtype = data.draw(st.sampled_from(DTYPES))
    q, k, v, lengths, scale = attention_case(data, dtype)
    positions = torch.arange(q.shape[2], device=DEVICE).expand(q.shape[0], -1)
    got = triton_exact.attention(q, k, v, positions, lengths, scale)
    on_cpu = [t.cpu().float() for t in (q, k, v, positions, lengths)]
    expected = exact.attention(*on_cpu[:3], *on_cpu[3:], scale)  # the torch version (CPU)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got.cpu(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # the log-sum-exp of each row's visible scaled scores (what flash attention's backward takes)
    group = q.shape[1] // k.shape[1]
    scores = on_cpu[0].double() @ on_cpu[1].double().repeat_interleave(group, 1).transpose(-1, -2) * scale
    keys = torch.arange(k.shape[2])
    visible = (keys[None, :] <= on_cpu[3][:, :, None]) & (keys < on_cpu[4][:, None, None])
    lse = torch.logsumexp(scores.masked_fill(~visible[:, None], float("-inf")), -1)
    torch.testing.assert_close(triton_exact._attention(q, k, v, positions, lengths, scale)[1].cpu().double(), lse,
                               atol=1e-4, rtol=1e-4)


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data())
def test_a_querys_bits_do_not_depend_on_the_other_queries_or_trailing_keys(data):
    """One query (decode), a run from a cached prefix's end (prefill), or any subset in any order, over keys padded
    past the full pass's key axis with NaN (never read): each query's bits are those of the full causal pass."""
    dtype = data.draw(st.sampled_from(DTYPES))
    q, k, v, lengths, scale = attention_case(data, dtype)
    S, heads, T, d = q.shape
    positions = torch.arange(T, device=DEVICE).expand(S, -1)
    full = triton_exact.attention(q, k, v, positions, lengths, scale)
    kind = data.draw(st.sampled_from(["decode", "prefill", "any"]))
    if kind == "decode":
        chosen = [data.draw(st.integers(0, T - 1))]
    elif kind == "prefill":
        start = data.draw(st.integers(0, T - 1))
        chosen = list(range(start, data.draw(st.integers(start + 1, T))))
    else:
        chosen = data.draw(st.lists(st.integers(0, T - 1), min_size=1, max_size=70))
    extra = data.draw(st.integers(0, 100))
    nan = torch.full((S, k.shape[1], extra, d), float("nan"), dtype=dtype, device=DEVICE)
    junk_k, junk_v = torch.cat([k, nan], 2), torch.cat([v, nan], 2)
    for s in range(S):  # past each sequence's length the keys are junk too
        junk_k[s, :, int(lengths[s]):], junk_v[s, :, int(lengths[s]):] = float("nan"), float("nan")
    index = torch.tensor(chosen, device=DEVICE)
    part = triton_exact.attention(q[:, :, index], junk_k, junk_v, positions[:, index], lengths, scale)
    assert torch.equal(part, full[:, :, index])


def test_a_query_that_sees_no_key_gets_zero_and_bad_shapes_are_refused():
    q, k = randn(1, 2, 3, 16, seed=0), randn(1, 1, 5, 16, seed=1)
    out = triton_exact.attention(q, k, k, torch.tensor([[0, 1, 2]], device=DEVICE), torch.tensor([0], device=DEVICE),
                                 0.25)
    assert torch.equal(out, torch.zeros_like(out))
    with pytest.raises(ValueError, match="kv_heads dividing"):
        triton_exact.attention(randn(1, 3, 3, 16, seed=0), randn(1, 2, 5, 16, seed=1), randn(1, 2, 5, 16, seed=1),
                               torch.zeros(1, 3, dtype=torch.long, device=DEVICE),
                               torch.ones(1, dtype=torch.long, device=DEVICE), 0.25)


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data())
def test_attention_over_flat_rows_by_index_equals_the_gathered_keys(data):
    """`k_index`: the keys and values as flat rows (a paged cache, a packed batch) in a shuffled order, each
    sequence's positions named by index: the same bits as the keys gathered first; and the same gradients."""
    dtype = data.draw(st.sampled_from(DTYPES))
    q, k, v, lengths, scale = attention_case(data, dtype)
    S, kv_heads, Tk, d = k.shape
    order = torch.randperm(S * Tk, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    flat_k, flat_v = (x.transpose(1, 2).reshape(S * Tk, kv_heads, d)[order].contiguous() for x in (k, v))
    index = torch.argsort(order).view(S, Tk).to(DEVICE)  # position t of sequence s: row index[s, t]
    assert torch.equal(flat_k[index].transpose(1, 2), k)
    positions = torch.arange(Tk, device=DEVICE).expand(S, -1)
    dense = triton_exact.attention(q, k, v, positions, lengths, scale)
    assert torch.equal(triton_exact.attention(q, flat_k, flat_v, positions, lengths, scale, index), dense)
    flat = [t.clone().requires_grad_() for t in (q, flat_k, flat_v)]
    grads = torch.autograd.grad(triton_exact.attention(*flat, positions, lengths, scale, index).sum(), flat)
    gathered = [t.clone().requires_grad_() for t in (q, flat_k, flat_v)]
    out = triton_exact.attention(gathered[0], gathered[1][index].transpose(1, 2), gathered[2][index].transpose(1, 2),
                                 positions, lengths, scale)
    for a, b in zip(grads, torch.autograd.grad(out.sum(), gathered)):
        torch.testing.assert_close(a, b)


def test_the_kernels_are_differentiable_as_the_torch_versions():
    """The update's forward runs exact mode with gradients: the kernels' gradients are the torch versions'."""
    x, w = randn(37, 40, seed=0).requires_grad_(), randn(24, 40, seed=1).requires_grad_()
    q, k, v = (randn(2, h, 20, 16, seed=2 + h).requires_grad_() for h in (4, 2, 2))
    positions, lengths = torch.arange(20, device=DEVICE).expand(2, -1), torch.tensor([20, 11], device=DEVICE)
    g = torch.autograd.grad(triton_exact.matmul(x, w).square().sum(), (x, w))
    for a, b in zip(g, torch.autograd.grad((x @ w.t()).square().sum(), (x, w))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    g = torch.autograd.grad(triton_exact.attention(q, k, v, positions, lengths, 0.25).square().sum(), (q, k, v))
    cpu = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    out = exact.attention(*cpu, positions.cpu(), lengths.cpu(), 0.25)  # the torch version (CPU)
    for a, b in zip(g, torch.autograd.grad(out.square().sum(), cpu)):
        torch.testing.assert_close(a.cpu(), b, atol=1e-4, rtol=1e-4)


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data())
def test_the_trainers_attention_has_the_engines_bits_and_the_references_gradients(data):
    """`sequence_attention` (the trainer's, over transformers' flat rows: packed sequences, padding between and
    after): each real token's output has the bits of `attention` over its sequence's gathered queries (the engine's
    arithmetic), padding gets 0; its gradients (on CUDA in half precision: flash attention's backward) are close to
    those of the torch version's."""
    dtype = data.draw(st.sampled_from(DTYPES))
    rows = data.draw(st.lists(st.lists(st.integers(1, 70), min_size=1, max_size=3), min_size=1, max_size=3))
    width = max(sum(r) for r in rows) + data.draw(st.integers(0, 5))
    position_ids, real = packed_positions(rows, width)
    layout = exact.sequences(position_ids.to(DEVICE), real.to(DEVICE))
    kv_heads, group = data.draw(st.integers(1, 2)), data.draw(st.sampled_from([1, 3, 7]))
    d = data.draw(st.sampled_from([8, 64]))
    seed, N = data.draw(st.integers(0, 2**16)), len(rows) * width
    q, k, v = (randn(N, h, d, seed=seed + i, dtype=dtype) for i, h in enumerate((kv_heads * group, kv_heads, kv_heads)))
    fields = (layout.index, layout.lengths, layout.seq, layout.pos, layout.real, layout.segments)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = triton_exact.sequence_attention(*leaves, *fields, d ** -0.5)
    S, L = layout.index.shape
    engine = triton_exact.attention(q[layout.index].transpose(1, 2), k, v, torch.arange(L, device=DEVICE).expand(S, L),
                                    layout.lengths, d ** -0.5, layout.index).to(dtype).transpose(1, 2)
    assert torch.equal(got[layout.real].detach(), engine[layout.seq, layout.pos][layout.real])
    assert not got[~layout.real].any()
    weights = randn(*got.shape, seed=seed + 3)
    flash = data.draw(st.booleans())  # both backwards, whatever the default (flash's: CUDA, half precision only)
    with mock.patch.object(triton_exact, "FLASH_BACKWARD", flash):
        supported = triton_exact._flash_supported(q.device, dtype, d)
        assert triton_exact.flash_backward_agrees(q.device, dtype, d) == (flash and supported)  # its check, here
        grads = torch.autograd.grad((got.float() * weights).sum(), leaves)
    cpu = [t.detach().cpu().float().requires_grad_() for t in (q, k, v)]
    as_batch = [t.reshape(len(rows), width, t.shape[1], d).transpose(1, 2) for t in cpu]
    cpu_layout = exact.sequences(position_ids, real)
    expected = exact.sequence_attention(*as_batch, cpu_layout, d ** -0.5).reshape(N, -1, d)  # the torch version
    tolerance = 2 * TOLERANCE[dtype]
    torch.testing.assert_close(got.detach().cpu().float(), expected, atol=tolerance, rtol=tolerance)
    for a, b in zip(grads, torch.autograd.grad((expected * weights.cpu()).sum(), cpu)):
        torch.testing.assert_close(a.cpu().float(), b, atol=tolerance, rtol=tolerance)


# --------------------------------------------------------------------------------------------- row sum
@settings(max_examples=EXAMPLES, deadline=None)
@given(rows=st.integers(1, 40), picks=st.lists(st.integers(0, 39), min_size=1, max_size=10),
       n=st.sampled_from([1, 7, 64, 896, 1000, 2500]), seed=st.integers(0, 2**16))
def test_row_sum_rows_do_not_depend_on_the_other_rows(rows, picks, n, seed):
    """RMSNorm's mean and the log-softmax's sum: any selection of rows summed in a call of its own gives the same
    bits as in the full call (and as a leading block of a 3-d batch); values close to torch's sum."""
    x = randn(40, n, seed=seed) * 3
    full = triton_exact.row_sum(x)
    chosen = torch.tensor([p % rows for p in picks], device=DEVICE)
    assert full.shape == (40,) and triton_exact.row_sum(x, keepdim=True).shape == (40, 1)
    assert torch.equal(triton_exact.row_sum(x[:rows][chosen]), full[chosen])
    assert torch.equal(triton_exact.row_sum(x.reshape(8, 5, n))[:1].reshape(-1), full[:5])
    wide = torch.cat([x, x[:, :3]], 1)[:, :n]  # a strided view of the same values: the same bits
    assert torch.equal(triton_exact.row_sum(wide), full)
    torch.testing.assert_close(full.double(), x.double().sum(-1), atol=1e-4 * n ** 0.5, rtol=1e-5)


def test_row_sum_is_differentiable_and_refuses_other_dtypes():
    x = randn(6, 300, seed=3).requires_grad_()
    (g,) = torch.autograd.grad((triton_exact.row_sum(x, keepdim=True) ** 2).sum(), x)
    torch.testing.assert_close(g, 2 * x.detach().sum(-1, keepdim=True).expand_as(x), atol=1e-3, rtol=1e-5)
    assert triton_exact.row_sum(randn(0, 5, seed=0)).shape == (0,)
    with pytest.raises(ValueError, match="float32"):
        triton_exact.row_sum(randn(2, 5, seed=0, dtype=torch.float64))


# --------------------------------------------------------------------------------------------- softmax statistics
@settings(max_examples=EXAMPLES, deadline=None)
@given(rows=st.integers(1, 30), picks=st.lists(st.integers(0, 29), min_size=1, max_size=10),
       n=st.sampled_from([1, 5, 1000, 2500]), seed=st.integers(0, 2**16), dtype=st.sampled_from(DTYPES))
def test_softmax_stats_rows_do_not_depend_on_the_other_rows(rows, picks, n, seed, dtype):
    """The log-softmax's statistics (max, sum of exp, exp-weighted sum) of any selection of rows, of a column slice
    (a vocabulary limit) too, have the bits of the full call's, and so has a float32 copy of the logits (the sampler
    gets float32 logits, the trainer bfloat16); values close to torch's; the max is torch's z = x / T
    exactly (IEEE division)."""
    x = (randn(30, n + 3, seed=seed) * 5).to(dtype)[:, :n]
    temperature = torch.rand(30, generator=torch.Generator().manual_seed(seed)).to(DEVICE) + 0.2
    full = triton_exact.softmax_stats(x, temperature)
    chosen = torch.tensor([p % rows for p in picks], device=DEVICE)
    assert torch.equal(triton_exact.softmax_stats(x[:rows][chosen].contiguous(), temperature[:rows][chosen]),
                       full[chosen])
    assert torch.equal(triton_exact.softmax_stats(x.float().contiguous(), temperature), full)  # the values alone
    z = x.float() / temperature[:, None]
    assert torch.equal(full[:, 0], z.amax(-1))
    e = torch.exp(z.double() - full[:, :1].double())
    torch.testing.assert_close(full[:, 1].double(), e.sum(-1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(full[:, 2].double(), (e * z.double()).sum(-1), atol=1e-3, rtol=1e-5)
    with pytest.raises(ValueError, match="softmax_stats"):
        triton_exact.softmax_stats(x, temperature[:2])


def test_an_exact_chunks_recomputation_takes_the_forwards_logits_and_softmax_stats(monkeypatch):
    """`agents.logprobs.token_logprobs` in exact mode, under autograd: each chunk's backward recomputes its logits
    with the forward's bits (the exact kernel, not cuBLAS) and takes its softmax statistics from the forward (one
    statistics launch per chunk in all, where a full recomputation makes two); logprobs and gradients are the full
    recomputation's, bit for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from agents import logprobs

    class Record(TorchDispatchMode):  # the LM head's outputs, forward then recompute, and the statistics launches
        def __init__(self):
            super().__init__()
            self.logits, self.stats = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.logits += [out] if func.name() == "mt_env::exact_matmul" else []
            self.stats += func.name() == "mt_env::exact_softmax_stats"
            return out

    monkeypatch.setattr(exact, "_ON_CPU", True)  # the kernels, also under the interpreter
    lm_head = torch.nn.Linear(16, 40, bias=False).to(DEVICE)
    hidden = randn(10, 16, seed=1).requires_grad_()
    targets = torch.randint(0, 40, (10,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    temperature = torch.full((10,), 0.7, device=DEVICE)

    def run(saved):
        monkeypatch.setattr(logprobs, "SAVED_IN_EXACT", saved)
        hidden.grad = lm_head.weight.grad = None
        with Record() as record:
            out, entropy = logprobs.token_logprobs(hidden, lm_head, targets, temperature=temperature,
                                                   with_entropy=True, chunk_tokens=4, exact=True)
            (out.sum() + entropy.sum()).backward()
        forward, recomputed = record.logits[:3], record.logits[3:][::-1]  # backward goes from the last chunk
        assert len(recomputed) == 3 and all(torch.equal(a, b) for a, b in zip(forward, recomputed))
        return record.stats, out, entropy, hidden.grad, lm_head.weight.grad

    saved, recomputed = run(logprobs.SAVED_IN_EXACT), run(())
    assert (saved[0], recomputed[0]) == (3, 6)  # 3 chunks of 4, 4 and 2 tokens
    assert all(torch.equal(a, b) for a, b in zip(saved[1:], recomputed[1:]))


# --------------------------------------------------------------------------------------------- compiled layers
@pytest.fixture
def routed(monkeypatch) -> list:
    """The operations exact mode's routing (`_ExactOps.__torch_function__`) sees while code runs (not while dynamo
    traces it), in a list the test clears."""
    seen, route = [], exact._ExactOps.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):
        if not torch.compiler.is_compiling():
            seen.append(func)
        return route(self, func, types, args, kwargs)

    monkeypatch.setattr(exact._ExactOps, "__torch_function__", counted)
    return seen


def test_the_engines_compiled_exact_layers_route_inside_their_graph(layer_compiler, routed, monkeypatch):
    """The engine's side of the test below: where exact mode compiles the engine's layer functions, its routing is
    traced into their graph and set aside while it runs (`agents.engine.layers.RoutedLayer`), so a generation's
    routed operations do not grow with the layers (eager: 72 a layer a pass; compiled under the routing: 62),
    and the sampled logprobs are still the trainer's (its layers compiled too), bit for bit (on CPU: dynamo and
    AOTAutograd on both sides, no Inductor)."""
    import asyncio

    from agents import compiling
    from agents.backend import SamplingParams
    from agents.engine.layers import routed_layer
    from agents.hf_backend import HFBackend
    from mt_env.batch import collate
    from mt_env.sample import Sample

    from .backend_hf_fixtures import run

    monkeypatch.setattr(exact, "_ON_CPU", True)  # the kernels, also under the interpreter
    if DEVICE != "cuda":  # (as `layer_compiler` compiles the trainer's: dynamo and AOTAutograd, no Inductor)
        light = compiling.Compiled(routed_layer)
        light._compiled = torch.compile(routed_layer, backend="aot_eager", dynamic=True)
        monkeypatch.setitem(compiling._COMPILED, routed_layer, light)
    prompts = [[3, 9, 4, 1, 7], [5, 2, 8], [1, 1, 2, 3, 5, 8, 13]]
    params = [SamplingParams(temperature=1.0, max_new_tokens=4, seed=i) for i in range(len(prompts))]

    async def sample(lm):
        async with HFBackend(lm, seed=0, fast_path=True, compile=False, cuda_graphs=False, exact=True) as backend:
            return await asyncio.gather(*(backend.generate(p, q) for p, q in zip(prompts, params))), backend
    counts = {}
    for layers in (2, 4):
        for compiles in (False, True):
            monkeypatch.setattr(exact, "compiles_layers", lambda device, on=compiles: on)
            torch.manual_seed(7)
            lm = Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=64, num_hidden_layers=layers,
                                              num_attention_heads=4, num_key_value_heads=2,
                                              intermediate_size=128)).to(DEVICE).eval()
            routed.clear()
            turns, backend = run(sample(lm), 120)
            counts[layers, compiles] = len(routed) / (backend.stats["prefill_passes"] + backend.stats["decode_passes"])
            assert backend.compile_reason.startswith("on:" if compiles else "off:"), backend.compile_reason
    assert compiling.compiled(routed_layer).failure is None, compiling.compiled(routed_layer).failure
    per_layer_call = {on: (counts[4, on] - counts[2, on]) / 2 for on in (False, True)}  # (routed a pass, a layer)
    assert per_layer_call[True] == 0 and per_layer_call[False] > 50, per_layer_call
    samples = [Sample.single_turn(p, t.ids, t.logprobs, episode=b) for b, (p, t) in enumerate(zip(prompts, turns))]
    batch = collate(samples, pad_token_id=0).to(DEVICE)
    with torch.no_grad():
        logprobs, _ = PolicyModel(lm, exact=True)(batch.input_ids, batch.loss_mask, batch.attention_mask)
    on = batch.loss_mask > 0
    assert torch.equal(logprobs[on], batch.rollout_logprobs[on])


def test_compiled_exact_layers_route_inside_their_graph_and_under_activation_checkpointing(layer_compiler, routed,
                                                                                            monkeypatch):
    """Where exact mode compiles the trainer's layers (CUDA; here wherever the kernels run, on CPU captured by
    dynamo and AOTAutograd without Inductor), its routing is traced into the layers' graph and set aside while the
    graph runs: the compiled code's own Python (autograd's views, grad mode, detaches: about 170 operations a layer)
    does not go through `_ExactOps.__torch_function__`: a step's routed operations grow by at most one a layer. Under
    activation checkpointing the layers run compiled and recompute (a CheckpointError before: traced by Dynamo,
    transformers' checkpoint broke the graph), with the eager exact model's logprobs and, on CPU, gradients."""
    monkeypatch.setattr(exact, "_ON_CPU", True)  # the kernels, also under the interpreter
    monkeypatch.setattr(exact, "compiles_layers", lambda device: True)
    ids = torch.randint(0, 96, (3, 21), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    mask = torch.ones(3, 21, device=DEVICE)
    mask[:, :5] = 0
    steps = {}
    for layers in (2, 4):
        for compiles in (False, True):
            torch.manual_seed(7)
            config = Qwen2Config(vocab_size=96, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=128)
            lm = Qwen2ForCausalLM(config).to(DEVICE).train()
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if not compiles:
                monkeypatch.setattr(exact, "compiles_layers", lambda device: False)
            policy = PolicyModel(lm, exact=True)
            monkeypatch.setattr(exact, "compiles_layers", lambda device: True)
            routed.clear()
            logprobs, _ = policy(ids, mask)
            logprobs.sum().backward()
            steps[layers, compiles] = len(routed), logprobs.detach(), [p.grad for p in lm.parameters()]
    assert layer_compiler.failure is None, layer_compiler.failure
    per_layer = {compiles: (steps[4, compiles][0] - steps[2, compiles][0]) / 2 for compiles in (False, True)}
    assert per_layer[True] <= 1 < 50 < per_layer[False], per_layer  # (1: the eager checkpoint reads its input's device)
    if DEVICE != "cuda":  # the same operations as eager (on CUDA Inductor's: the engine's, test_exact.py)
        (_, plain, plain_grads), (_, compiled, grads) = steps[4, False], steps[4, True]
        assert torch.equal(compiled, plain)
        for grad, plain_grad in zip(grads, plain_grads):
            torch.testing.assert_close(grad, plain_grad, rtol=1e-5, atol=1e-6)
