"""`agents.logprobs`: per-token logprobs and entropy from hidden states in chunks equal the plain full-logits
computation (values and gradients, with temperature and a vocabulary limit), never make a ``[tokens, vocab]`` tensor,
and refuse bad shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from agents.compiling import compiled
from agents.logprobs import logits_logprobs, token_logprobs

H, V = 16, 50


def _plain(hidden, weight, targets, temperature, vocab_limit):
    """The full-logits computation, op by op: log_softmax of every logit, then the targets' entries."""
    logits = hidden @ weight.T
    if isinstance(temperature, torch.Tensor):
        temperature = temperature[:, None]
    logp = torch.log_softmax(logits[:, :vocab_limit].float() / temperature, dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _inputs(n: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.5)
    hidden = torch.randn(n, H, generator=g).to(dtype)
    return hidden, head, torch.randint(0, V - 7, (n,), generator=g)


@settings(max_examples=30)
@given(n=st.integers(0, 40), chunk=st.one_of(st.none(), st.integers(1, 45)), limit=st.sampled_from([None, V - 7]),
       per_row=st.booleans(), grad=st.booleans())
def test_chunked_logprobs_equal_the_full_logits_computation(n, chunk, limit, per_row, grad):
    """Any chunking, a temperature per call or per row, a vocabulary limit, with or without autograd: the values of
    the plain computation (float32: to rounding)."""
    hidden, head, targets = _inputs(n)
    temperature = torch.rand(n, generator=torch.Generator().manual_seed(1)) + 0.3 if per_row else 0.7
    with torch.set_grad_enabled(grad):
        lp, ent = token_logprobs(hidden, head, targets, temperature=temperature, vocab_limit=limit,
                                 with_entropy=True, chunk_tokens=chunk)
    ref_lp, ref_ent = _plain(hidden, head.weight.detach(), targets, temperature, limit)
    assert lp.shape == ent.shape == (n,) and lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    assert token_logprobs(hidden, head, targets, chunk_tokens=chunk)[1] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_gradients_equal_the_full_logits_gradients(dtype):
    """Gradients w.r.t. the hidden states and the LM head's weight, through a loss on logprobs and entropy, equal the
    plain computation's (chunks recomputed in backward): float32 to rounding, bf16 within its precision."""
    hidden0, head, targets = _inputs(37, dtype=dtype)
    w_lp, w_ent = torch.randn(37), torch.randn(37)
    grads = []
    for chunked in (True, False):
        hidden = hidden0.clone().requires_grad_()
        head.weight.grad = None
        if chunked:
            lp, ent = token_logprobs(hidden, head, targets, temperature=0.7, vocab_limit=V - 7, with_entropy=True,
                                     chunk_tokens=8)
        else:
            lp, ent = _plain(hidden, head.weight, targets, 0.7, V - 7)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        grads.append((hidden.grad.float(), head.weight.grad.float()))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, **tol)
    assert float(grads[0][1][V - 7:].abs().sum()) == 0  # ids beyond the limit take no part


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op made."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_tokens_by_vocab_is_made():
    """Forward and backward of 64 tokens in chunks of 8 make no tensor larger than a chunk's logits (8 x vocab,
    the LM head's own [vocab, H] gradient, the [64, H] hidden states' gradient); all at once, the [64, vocab] logits
    appear."""
    hidden, head, targets = _inputs(64)
    hidden.requires_grad_()
    sizes = {}
    for chunk in (8, None):
        with _LargestTensor() as seen:
            lp, ent = token_logprobs(hidden, head, targets, with_entropy=True, chunk_tokens=chunk)
            (lp.sum() + ent.sum()).backward()
        sizes[chunk] = seen.largest
    assert sizes[8] <= max(8 * V, V * H, 64 * H) < 64 * V <= sizes[None]


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_logprobs_and_gradients_match_the_op_by_op_computation(compile, dtype):
    """`logits_logprobs` (compiled by Inductor where the trainer compiles it: on CUDA; here on CPU when asked) gives
    the op-by-op logprobs and entropy, and the same gradient w.r.t. the logits, for bf16 and fp32 logits."""
    torch.manual_seed(0)
    base = (torch.randn(37, 1000) * 3).to(dtype)
    targets = torch.randint(0, 1000, (37,))
    weights = torch.randn(37), torch.randn(37)
    score = compiled(logits_logprobs) if compile else logits_logprobs
    grads = []

    def plain(x):
        logp = torch.log_softmax(x.float() / 0.7, dim=-1)
        return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    for fn in (lambda x: score(x, targets, 0.7, True), plain):
        logits = base.clone().requires_grad_()
        logprobs, entropy = fn(logits)
        ((logprobs * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
        grads.append((logprobs.detach(), entropy.detach(), logits.grad.float()))
    (lp, ent, grad), (ref_lp, ref_ent, ref_grad) = grads
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)
    assert score(base, targets, 0.7, False)[1] is None
    if compile:
        assert score.failure is None, score.failure


def test_bad_shapes_and_chunk_sizes_are_refused():
    hidden, head, targets = _inputs(5)
    with pytest.raises(ValueError, match="hidden \\[N, H\\] and targets \\[N\\]"):
        token_logprobs(hidden[None], head, targets)
    with pytest.raises(ValueError, match="hidden \\[N, H\\] and targets \\[N\\]"):
        token_logprobs(hidden, head, targets[:3])
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_logprobs(hidden, head, targets, chunk_tokens=0)
