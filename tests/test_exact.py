"""Exact mode (`agents.exact`, docs/exact.md): the logprob the engine returns for each sampled token equals, bit for
bit, the trainer's old-logprob pass over the same ids — padded or packed, in micro-batches of one row or of many,
whatever other rows shared the engine's passes, with or without a cached prefix — and the sampled token is the one
the trainer's logits give with the same uniform number. Exact mode off does not give equality on the same shapes
(so these tests can fail). ``MT_ENV_TEST_DEVICE=cuda`` runs them on a GPU."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from agents import exact
from agents.engine import EngineConfig
from agents.engine.sampler import sample_tokens
from agents.hf_backend import HFBackend
from agents.backend import SamplingParams
from mt_env.batch import TrainBatch, collate
from mt_env.sample import Sample
from trainers import algos
from trainers.config import Config, ConfigError, validate
from trainers.modeling import PolicyModel
from trainers.ppo import Models, score

from .backend_hf_fixtures import DEVICE, one_cpu_thread, packed_positions, run  # noqa: F401  (one_cpu_thread: autouse)

VOCAB = 96
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=512)
ENGINE = dict(fast_path=True, compile=False, cuda_graphs=DEVICE == "cuda")


def build(arch: str = "qwen2", seed: int = 0):
    torch.manual_seed(seed)
    if arch == "qwen3":  # q/k norms
        return Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16)).to(DEVICE).eval()
    return Qwen2ForCausalLM(Qwen2Config(**SHAPE)).to(DEVICE).eval()


@pytest.fixture(scope="module")
def model():
    return build()


def prompts_of(n: int, seed: int = 1, longest: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(1, longest, (n,), generator=g)]


def params_of(n: int, temperature: float = 1.0, new: int = 16) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, max_new_tokens=new, seed=i) for i in range(n)]


def generate(model, prompts, params, **options):
    async def main():
        async with HFBackend(model, seed=0, **{**ENGINE, **options}) as backend:
            turns = await asyncio.gather(*(backend.generate(p, q) for p, q in zip(prompts, params)))
            return turns, dict(backend.stats)

    return run(main(), 60)


def batch_of(prompts, turns) -> TrainBatch:
    """The rollouts as the trainer collates them: right-padded rows, loss mask on the sampled tokens."""
    samples = [Sample.single_turn(p, t.ids, t.logprobs, episode=b) for b, (p, t) in enumerate(zip(prompts, turns))]
    return collate(samples, pad_token_id=0).to(DEVICE)


def trainer_logprobs(policy: PolicyModel, batch: TrainBatch, packed: bool, micro: int, temperature: float = 1.0):
    """The trainer's old-logprob pass (`trainers.ppo.score`) over the batch."""
    cfg = Config()
    cfg.trainer.packed, cfg.trainer.micro_batch_size, cfg.rollout.temperature = packed, micro, temperature
    return score(batch, Models(policy, None, None), cfg)[0].old_logprobs


def assert_exact(policy, batch, temperature=1.0, micros=(1, 3, 100)):
    on = batch.loss_mask > 0
    for packed in (False, True):
        for micro in micros:
            got = trainer_logprobs(policy, batch, packed, micro, temperature)
            assert torch.equal(got[on], batch.rollout_logprobs[on]), (packed, micro)


# --------------------------------------------------------------------------------------------- bit equality
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_engine_logprobs_equal_the_trainers_bit_for_bit(arch, rows):
    """Prompts of mixed lengths sampled at several engine batch sizes; the trainer's pass, padded and packed, in
    micro-batches of 1, 3 and all rows: the same float32 bits for every sampled token."""
    model = build(arch)
    prompts = prompts_of(9, seed=rows)
    temperature = 0.7 if rows == 3 else 1.0
    turns, _ = generate(model, prompts, params_of(len(prompts), temperature), exact=True, max_batch_size=rows)
    assert_exact(PolicyModel(model, exact=True), batch_of(prompts, turns), temperature)


def test_exact_mode_off_is_not_bit_equal_on_the_same_shapes(model):
    """Without exact mode the same rollouts differ from the trainer's pass in the last bits (the engine decodes
    over a cache with other kernels): the equality above is not a given."""
    prompts = prompts_of(9, seed=8)
    turns, _ = generate(model, prompts, params_of(len(prompts)), max_batch_size=8)
    batch = batch_of(prompts, turns)
    on = batch.loss_mask > 0
    got = trainer_logprobs(PolicyModel(model), batch, packed=False, micro=100)
    assert not torch.equal(got[on], batch.rollout_logprobs[on])
    assert (got[on] - batch.rollout_logprobs[on]).abs().max() < 1e-4  # the same distribution, to rounding


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_a_rows_bits_do_not_depend_on_which_rows_share_its_passes(model, data):
    """Any subset of the requests, in any order, at any engine batch size, then the trainer over those rows in any
    order and micro-batch size: each request's tokens and logprobs are those it gets alone, and the trainer's."""
    prompts, params = ALONE_PROMPTS, params_of(len(ALONE_PROMPTS), new=10)
    chosen = data.draw(st.lists(st.sampled_from(range(len(prompts))), min_size=1, max_size=6, unique=True))
    rows = data.draw(st.integers(1, 6))
    turns, _ = generate(model, [prompts[i] for i in chosen], [params[i] for i in chosen], exact=True,
                        max_batch_size=rows)
    alone = alone_turns(model)
    for i, turn in zip(chosen, turns):
        assert turn.ids == alone[i].ids and turn.logprobs == alone[i].logprobs
    batch = batch_of([prompts[i] for i in chosen], turns)
    order = torch.tensor(data.draw(st.permutations(range(len(chosen)))), device=DEVICE)
    micro = data.draw(st.integers(1, len(chosen)))
    packed = data.draw(st.booleans())
    got = trainer_logprobs(PolicyModel(model, exact=True), batch[order], packed, micro)
    on = batch[order].loss_mask > 0
    assert torch.equal(got[on], batch[order].rollout_logprobs[on])


ALONE_PROMPTS = prompts_of(6, seed=5, longest=30)
_ALONE: dict = {}


def alone_turns(model):
    """Each of `ALONE_PROMPTS` generated alone in exact mode (computed once)."""
    if not _ALONE:
        params = params_of(len(ALONE_PROMPTS), new=10)
        for i, (p, q) in enumerate(zip(ALONE_PROMPTS, params)):
            _ALONE[i] = generate(model, [p], [q], exact=True, max_batch_size=1)[0][0]
    return _ALONE


def test_a_cached_prefix_changes_no_bit(model):
    """A conversation's second turn (its first turn's prompt and reply as a prefix) and a group sharing a prompt:
    with the prefix cache on (prefixes found, not recomputed) and off, the same tokens and logprobs, bit for bit —
    the trainer's."""
    first = prompts_of(4, seed=3)
    turns, _ = generate(model, first, params_of(4), exact=True)
    second = [p + t.ids + [5, 6, 7] for p, t in zip(first, turns)] + [first[0]] * 3
    params = params_of(len(second))

    async def both_turns(prefix_cache: bool):
        async with HFBackend(model, seed=0, exact=True, prefix_cache=prefix_cache, **ENGINE) as backend:
            await asyncio.gather(*(backend.generate(p, q) for p, q in zip(first, params_of(4))))
            out = await asyncio.gather(*(backend.generate(p, q) for p, q in zip(second, params)))
            return out, dict(backend.stats)

    cached, stats = run(both_turns(True), 60)
    plain, plain_stats = run(both_turns(False), 60)
    assert stats["cached_tokens"] > 0 and plain_stats["cached_tokens"] == 0
    for a, b in zip(cached, plain, strict=True):
        assert a.ids == b.ids and a.logprobs == b.logprobs
    assert_exact(PolicyModel(model, exact=True), batch_of(second, cached), micros=(2,))


def test_the_sampled_token_is_the_one_the_trainers_logits_give(model):
    """In exact mode the trainer's logits at each sampled position, through the sampler with the row's uniform
    numbers (its seeded generator's draws), give back the engine's token and its logprob."""
    prompts = prompts_of(5, seed=4)
    params = [SamplingParams(temperature=0.8, top_p=0.9 if i % 2 else 1.0, max_new_tokens=12, seed=10 + i)
              for i in range(len(prompts))]
    turns, _ = generate(model, prompts, params, exact=True)
    policy = PolicyModel(model, exact=True)
    for prompt, turn, p in zip(prompts, turns, params):
        tokens, logprobs = resample(trainer_logits(policy, prompt, turn), turn, p)
        assert tokens.tolist() == turn.ids and logprobs.tolist() == turn.logprobs


def trainer_logits(policy: PolicyModel, prompt: list[int], turn) -> torch.Tensor:
    """float32 logits [len(turn.ids), vocab] at the turn's sampled positions, from the trainer's backbone pass
    (`PolicyModel.hidden_states`, `forward`'s) and the LM head in exact mode."""
    ids = torch.tensor([prompt + turn.ids], device=DEVICE)
    with torch.no_grad():
        hidden = policy.hidden_states(ids)[0]
        with exact.ops():
            return policy.lm.lm_head(hidden[len(prompt) - 1:-1]).float()


def resample(logits: torch.Tensor, turn, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The turn's tokens and logprobs drawn again from `logits` by the exact sampler, with the row's uniform numbers
    (its seeded generator's draws)."""
    n, g = len(turn.ids), random.Random(p.seed)
    uniform = torch.tensor([g.random() for _ in range(n)], dtype=torch.float64, device=DEVICE)
    full = lambda value, dtype: torch.full((n,), value, dtype=dtype, device=DEVICE)  # noqa: E731
    return sample_tokens(logits, full(p.temperature, torch.float32), uniform, full(VOCAB, torch.long),
                         full(p.top_p if p.top_p < 1 else float("inf"), torch.float32), "truncate", exact=True)


# --------------------------------------------------------------------------------------------- the operations
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 80), picks=st.lists(st.integers(0, 79), min_size=1, max_size=20),
       k=st.sampled_from([7, 64, 100]), bias=st.booleans())
def test_linear_rows_do_not_depend_on_the_other_rows(m, picks, k, bias):
    """`exact.linear` of any selection of rows, in any order, equals those rows of the full product."""
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(80, k, generator=g).to(DEVICE), torch.randn(48, k, generator=g).to(DEVICE)
    b = torch.randn(48, generator=g).to(DEVICE) if bias else None
    rows = torch.tensor([p % m for p in picks], device=DEVICE)
    assert torch.equal(exact.linear(x[:m][rows], w, b), exact.linear(x[:m], w, b)[rows])
    torch.testing.assert_close(exact.linear(x[:m], w, b), torch.nn.functional.linear(x[:m], w, b))


def test_attention_of_one_query_equals_the_full_pass_and_the_reference():
    """A decode query over a cache padded with junk beyond its length equals the same query in a causal pass over
    the whole sequence; both match SDPA to rounding (on CUDA: the Triton kernel, `exact._kernels`)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 70, 16, generator=g).to(DEVICE) for h in (4, 2, 2))
    full = exact.attention(q, k, v, torch.arange(70, device=DEVICE)[None], torch.tensor([70], device=DEVICE), 0.25)
    junk = (torch.cat([k, torch.randn(1, 2, 60, 16, generator=g).to(DEVICE)], 2),
            torch.cat([v, torch.randn(1, 2, 60, 16).to(DEVICE)], 2))
    for t in (0, 31, 32, 69):
        one = exact.attention(q[:, :, t:t + 1], *junk, torch.tensor([[t]], device=DEVICE),
                              torch.tensor([t + 1], device=DEVICE), 0.25)
        assert torch.equal(one[:, :, 0], full[:, :, t])
    reference = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                                                 v.repeat_interleave(2, 1), is_causal=True, scale=0.25)
    torch.testing.assert_close(full, reference, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 12), vocab=st.sampled_from([1, 7, 96, 1500]), limit=st.integers(0, 5), seed=st.integers(0, 999),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_trainers_token_logprob_is_the_samplers_and_differentiates_as_log_softmax(n, vocab, limit, seed, dtype):
    """`exact.token_logprob` (the trainer's, one token per row, logits possibly a column slice: a vocabulary limit)
    gives the entry of `exact.tempered_log_softmax` (the sampler's) bit for bit, whatever rows share the call; its
    entropy and gradients are those of a plain log-softmax."""
    g = torch.Generator().manual_seed(seed)
    width = -(-(vocab + limit) // 16) * 16  # an embedding padded to a multiple of 16 rows, as real ones are
    full = (torch.randn(n, width, generator=g) * 4).to(dtype).to(DEVICE)
    logits = full[:, :vocab]
    temperature = (torch.rand(n, generator=g) + 0.3).to(DEVICE)
    targets = torch.randint(0, vocab, (n,), generator=g).to(DEVICE)
    leaf = full.detach().clone().requires_grad_()
    logprob, entropy = exact.token_logprob(leaf[:, :vocab], targets, temperature)
    for sampled in (logits.float(), full.float()[:, :vocab]):  # float32 logits, contiguous or not, as the sampler's
        sampler = exact.tempered_log_softmax(sampled, temperature)
        assert torch.equal(logprob, sampler.gather(1, targets[:, None]).squeeze(1))
    rows = torch.randperm(n, generator=g)[:max(1, n // 2)].to(DEVICE)
    assert torch.equal(exact.token_logprob(logits[rows], targets[rows], temperature[rows])[0], logprob[rows])
    weights = torch.randn(2, n, generator=g).to(DEVICE)
    grad = torch.autograd.grad((weights[0] * logprob + weights[1] * entropy).sum(), leaf)[0]
    assert not grad[:, vocab:].any()
    grad = grad[:, :vocab]
    plain = logits.detach().float().clone().requires_grad_()
    logp = torch.log_softmax(plain / temperature[:, None], -1)
    plain_entropy = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(entropy, plain_entropy, atol=1e-4, rtol=1e-4)
    target_logp = logp.gather(1, targets[:, None]).squeeze(1)
    expected = torch.autograd.grad((weights[0] * target_logp + weights[1] * plain_entropy).sum(), plain)[0]
    assert grad.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2  # z up to ~40: log p and H cancel in float32
    torch.testing.assert_close(grad.float(), expected, atol=tolerance, rtol=tolerance)


def test_the_token_logprobs_gradient_compiles_to_one_pass_over_the_logits():
    """`exact.token_logprob`'s backward (`_logits_grad`, compiled by Inductor on CUDA; here on CPU) is one kernel: a
    one-hot by scatter made two, with a float32 [N, vocab] between them. Its values are the eager function's."""
    import types

    from torch._inductor import metrics

    from agents.compiling import INDUCTOR_OPTIONS

    g = torch.Generator().manual_seed(0)
    n, vocab = 5, 300
    args = ((torch.randn(n, vocab, generator=g) * 3).bfloat16(), torch.randint(0, vocab, (n,), generator=g),
            torch.rand(n, generator=g) + 0.3, *torch.randn(4, n, generator=g))
    fresh = types.FunctionType(exact._logits_grad.__code__.replace(co_name="fresh"), exact._logits_grad.__globals__)
    metrics.reset()  # (a fresh code object: Dynamo's cache of the function itself may hold another test's compile)
    out = torch.compile(fresh, options=INDUCTOR_OPTIONS, dynamic=True)(*args)
    assert metrics.generated_kernel_count == 1
    assert torch.equal(out, exact._logits_grad(*args))


def test_lora_adapters_keep_the_bits_equal():
    """Exact mode runs the module's own code, LoRA adapters (peft) included: the engine generates through them and the
    trainer scores through them, bit for bit."""
    from trainers.config import LoraConfig
    from trainers.lora import add_lora

    model = add_lora(build(seed=4), LoraConfig(rank=4, alpha=8.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: the adapters would change nothing
            torch.nn.init.normal_(p, std=0.02)
    model.eval()
    prompts = prompts_of(6, seed=3)
    turns, _ = generate(model, prompts, params_of(len(prompts)), exact=True, max_batch_size=4)
    assert_exact(PolicyModel(model, exact=True), batch_of(prompts, turns), micros=(1, 100))


def test_compiled_code_is_called_with_the_routing_set_aside_only_where_it_is_the_innermost_mode():
    """`exact.routed_inside`: under `ops()` the routing is set aside for the call (the compiled function enters its
    own), and back after it; under a mode pushed after the routing it stays (the compiled code routes twice: the same
    bits); off, nothing changes. `routes()` sees the routing anywhere on the stack."""
    from torch.overrides import TorchFunctionMode

    x = torch.randn(3, 5)
    assert not exact.routes()
    with exact.ops():
        assert exact.routes()
        with exact.routed_inside(True):
            assert not exact.routes()
            with exact.routing(True):  # what the compiled function does inside
                assert exact.routes() and torch.equal(F.silu(x), exact.silu(x))
        assert exact.routes()
        with TorchFunctionMode(), exact.routed_inside(True):
            assert exact.routes()
        with exact.routed_inside(False):
            assert exact.routes()
    with exact.routed_inside(True):
        assert not exact.routes()


def test_activation_checkpointing_recomputes_the_layers_under_exact_operations():
    """Transformers' activation checkpointing runs each layer again in backward, after the forward's exact mode (a
    thread-local `TorchFunctionMode`) has ended; the recompute runs under it too (`exact.RecomputeUnderOps`; without
    it, `torch.utils.checkpoint` raised a CheckpointError). The logprobs are those without checkpointing; so are the
    gradients, bit for bit on CPU (where the kernels run, the recompute's matmuls are cuBLAS's: close)."""
    ids = torch.randint(0, VOCAB, (3, 21), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    mask = torch.ones(3, 21, device=DEVICE)
    mask[:, :5] = 0
    out = {}
    for checkpointing in (False, True):
        lm = build(seed=6).train()  # (dropout 0: training mode only turns checkpointing on)
        if checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        logprobs, _ = PolicyModel(lm, exact=True)(ids, mask)
        logprobs.sum().backward()
        out[checkpointing] = logprobs.detach(), {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}
    (plain, plain_grads), (recomputed, grads) = out[False], out[True]
    assert torch.equal(recomputed, plain) and grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        if exact._kernels(ids) is None:  # the torch operations (CPU): the recompute is the forward's arithmetic
            assert torch.equal(grad, plain_grads[name]), name
        else:
            torch.testing.assert_close(grad, plain_grads[name], rtol=1e-3, atol=1e-4)


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.lists(st.integers(1, 7), min_size=1, max_size=4), min_size=1, max_size=4),
       pad=st.integers(0, 3))
def test_the_layout_maps_every_real_token_to_its_sequence_and_back(rows, pad):
    """`exact.sequences` over rows packing sequences of the given lengths, right-padded: each real token's (seq, pos)
    points back at it through `index`, a padding token is not real, and every shape is the inputs' (no token
    dropped: what lets compiled layers trace the attention whole)."""
    width = max(sum(r) for r in rows) + pad
    position_ids, real = packed_positions(rows, width)
    layout = exact.sequences(position_ids, real)
    assert layout.index.shape[0] == sum(len(r) for r in rows) and layout.seq.shape == (len(rows) * width,)
    flat = torch.arange(len(rows) * width)
    assert torch.equal(layout.real, real.reshape(-1))
    assert torch.equal(layout.index[layout.seq, layout.pos][layout.real], flat[layout.real])
    assert torch.equal(layout.pos[layout.real], position_ids.reshape(-1)[layout.real])


@pytest.mark.skipif(DEVICE != "cuda", reason="exact mode compiles its layers on CUDA (MT_ENV_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_both_sides_run_compiled_layers_in_whole_graphs(dtype, monkeypatch):
    """`exact.compiles_layers`: the engine's layer functions and the trainer's decoder layers both run compiled by
    Inductor (no graph break, no eager fallback), and the bits stay equal, in float32 and in bfloat16."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(exact, "COMPILE_LAYERS", True)

    model = build(seed=5).to(dtype)
    prompts = prompts_of(7, seed=11)
    breaks = sum(counters["graph_break"].values())

    async def main():
        async with HFBackend(model, seed=0, **ENGINE, exact=True, max_batch_size=4) as backend:
            turns = await asyncio.gather(*(backend.generate(p, q) for p, q in zip(prompts, params_of(len(prompts)))))
            return turns, backend.compile_reason

    turns, reason = run(main(), 300)
    assert exact.compiles_layers(torch.device(DEVICE)) and reason.startswith("on:"), reason
    assert_exact(PolicyModel(model, exact=True), batch_of(prompts, turns), micros=(1, 100))
    layers = model.model.layers
    assert all("forward" in vars(layer) for layer in layers)  # `compile_layers` ran
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])


# --------------------------------------------------------------------------------------------- guard and settings
def test_a_mismatch_in_exact_mode_is_counted_and_logged(model, caplog):
    prompts = prompts_of(3, seed=6)
    batch = batch_of(prompts, generate(model, prompts, params_of(3), exact=True)[0])
    batch = batch.replace(old_logprobs=batch.rollout_logprobs.clone())
    assert algos.logprob_mismatch(batch, exact=True)["mismatch/exact_violations"] == 0
    on = (batch.loss_mask > 0).nonzero()[:2]
    batch.old_logprobs[on[:, 0], on[:, 1]] += 1e-6
    with caplog.at_level(logging.WARNING, logger="trainers"):
        metrics = algos.logprob_mismatch(batch, exact=True)
    assert metrics["mismatch/exact_violations"] == 2 and metrics["mismatch/logprob_abs_max"] > 0
    assert "EXACT MODE VIOLATED" in caplog.text
    assert "mismatch/exact_violations" not in algos.logprob_mismatch(batch)


def test_settings_that_cannot_be_exact_are_refused(model):
    with pytest.raises(ValueError, match="compile"):
        EngineConfig(exact=True, compile=True)
    with pytest.raises(ValueError, match="fast_path=False"):
        HFBackend(model, exact=True, fast_path=False)
    cfg = Config()
    cfg.model.preset, cfg.rollout.exact_logprobs, cfg.trainer.compile = "qwen2.5-0.5b", True, True
    with pytest.raises(ConfigError, match="exact_logprobs"):
        validate(cfg)
    eager = build()
    eager.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="attention implementation"):
        PolicyModel(eager, exact=True)


def test_the_trainers_exact_pass_builds_no_attention_mask(model, monkeypatch):
    """Exact attention takes the sequences' layout: transformers must not build the dense [T, T] mask it would derive
    from packed position ids (1 GiB at 32k tokens) or from padding; a model called without a layout still gets one."""
    from transformers.masking_utils import AttentionMaskInterface

    from trainers.modeling import SDPA_VARLEN, _layout_mask

    def no_mask(*args, **kwargs):
        raise AssertionError("an attention mask was built")

    policy = PolicyModel(model, exact=True)
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, SDPA_VARLEN, no_mask)
    turns, _ = generate(model, prompts_of(3), params_of(3, new=4), exact=True)
    batch = batch_of(prompts_of(3), turns)
    assert_exact(policy, batch, micros=(3,))
    with pytest.raises(ValueError, match="no attention mask was built"):
        model(input_ids=batch.input_ids, attention_mask=_layout_mask(batch.input_ids.device))


def test_a_single_turn_sample_trains_exactly_its_sampled_tokens():
    sample = Sample.single_turn([5, 6, 7], [8, 9], [-0.5, -0.25], episode=3)
    assert sample.ids == [5, 6, 7, 8, 9] and sample.loss_mask() == [0, 0, 0, 1, 1] and sample.episode == 3
    assert sample.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25] and sample.prompt_len == 3
    with pytest.raises(ValueError, match="2 sampled ids but 1 logprobs"):
        Sample.single_turn([5], [8, 9], [-0.5])


# --------------------------------------------------------------------------------------------- a training run
@pytest.mark.parametrize("layout", ["trainer.packed=false", "trainer.packed=true"])
def test_every_step_of_an_exact_run_has_no_mismatch(tmp_path, layout):
    """trainers/ppo.py with `rollout.exact_logprobs` (CPU, tiny recipe): the old-logprob pass of every step (two
    mini-batches, so a pass of its own) equals the engine's logprobs on every sampled token; off, it does not. The
    packed run checkpoints its activations, as the GPU recipes do."""
    from .test_trainer import metrics, run

    checkpointing = f"model.gradient_checkpointing={str(layout.endswith('true')).lower()}"
    for on in (True, False):
        out = tmp_path / str(on)
        run(out, layout, checkpointing, f"rollout.exact_logprobs={str(on).lower()}", "sft.steps=0", "eval.episodes=2",
            "trainer.minibatch_size=4", "trainer.micro_batch_size=3", "threads=1", steps=2)
        steps = [r for r in metrics(out) if "actor/loss" in r]
        assert len(steps) == 2
        if on:
            assert all(r["mismatch/logprob_abs_max"] == 0.0 and r["mismatch/exact_violations"] == 0 for r in steps)
        else:
            assert "mismatch/exact_violations" not in steps[0] and steps[0]["mismatch/logprob_abs_max"] > 0


@pytest.mark.parametrize("positions, real, problem", [
    ([[0, 1, 3, 0]], [[1, 1, 1, 1]], "a run"),  # a position skipped
    ([[0, 1, 2, 0]], [[1, 0, 1, 1]], "a run"),  # padding inside a sequence
    ([[1, 2, 0, 1]], [[1, 1, 1, 1]], "a run"),  # real tokens before the first start
    ([[0, 1, 1, 2]], [[1, 1, 1, 1]], "a run"),  # a position repeated
    ([[1, 2, 3, 4]], [[1, 1, 1, 1]], "no sequence starts"),
    ([[0, 0, 0, 0]], [[0, 0, 0, 0]], "no sequence starts"),
])
def test_the_layout_refuses_positions_that_are_not_runs_from_zero(positions, real, problem):
    with pytest.raises(ValueError, match=problem):
        exact.sequences(torch.tensor(positions), torch.tensor(real).bool())


def test_the_layout_of_a_padded_batch_and_of_rows_that_continue_a_sequence():
    """Left padding, a sequence per row; and a sequence run on from one row into the next (flat order)."""
    layout = exact.sequences(torch.tensor([[0, 0, 1, 2], [0, 1, 2, 3]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    assert layout.lengths.tolist() == [3, 4] and layout.index.tolist() == [[1, 2, 3, 4], [4, 5, 6, 7]]
    assert layout.segments.tolist() == [0, 1, 4, 8]  # the padding token, then the two sequences
    layout = exact.sequences(torch.tensor([[0, 1], [2, 0]]), torch.ones(2, 2).bool())
    assert layout.lengths.tolist() == [3, 1] and layout.seq.tolist() == [0, 0, 0, 1]


def _runs_from_zero(positions: list[int], real: list[bool]) -> list[int] | None:
    """The lengths of the sequences of a flat batch, by a scan: a real token of position 0 starts one, the next
    real token continues it only with the next position; None where a real token does neither."""
    lengths, expect = [], None
    for p, r in zip(positions, real):
        if not r:
            expect = None
        elif p == 0:
            lengths, expect = lengths + [1], 1
        elif p == expect:
            lengths[-1], expect = lengths[-1] + 1, expect + 1
        else:
            return None
    return lengths or None


@settings(max_examples=200, deadline=None)
@given(cells=st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1, max_size=24), rows=st.integers(1, 3))
def test_the_layout_accepts_exactly_the_runs_from_zero(cells, rows):
    """Any positions and padding, in `rows` rows: `exact.sequences` refuses (ValueError) exactly what the scan does,
    and otherwise its lengths are the scan's and its segments cut every token into runs: each sequence one, the
    tokens of none in runs of at most the longest sequence."""
    width = -(-len(cells) // rows)
    cells = cells + [(0, False)] * (rows * width - len(cells))
    positions, real = torch.tensor([p for p, _ in cells]), torch.tensor([r for _, r in cells])
    expected = _runs_from_zero(positions.tolist(), real.tolist())
    if expected is None:
        with pytest.raises(ValueError):
            exact.sequences(positions.view(rows, width), real.view(rows, width))
        return
    layout = exact.sequences(positions.view(rows, width), real.view(rows, width))
    assert layout.lengths.tolist() == expected
    # the segments: every token in one, in order; a sequence is one; the others hold no real token, at most L each
    bounds = layout.segments.tolist()
    assert bounds[0] == 0 and bounds[-1] == len(cells) and bounds == sorted(set(bounds))
    starts = torch.nonzero(real & (positions == 0)).squeeze(1).tolist()
    assert all((start, start + n) in zip(bounds, bounds[1:]) for start, n in zip(starts, expected))
    for a, b in zip(bounds, bounds[1:]):
        assert a in starts or (not real[a:b].any() and b - a <= max(expected))
