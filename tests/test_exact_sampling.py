"""Exact mode's sampling (`agents.exact.sample`, on CUDA `agents.triton_sampling`): inverse CDF over the tempered
softmax in an order set by the vocabulary alone. The id drawn is the float64 reference's (up to targets within
rounding of an interval's edge), never one of zero probability, a row's id does not depend on the other rows, and
the kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``) draws the torch version's ids."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agents import exact

from .backend_hf_fixtures import DEVICE


def draw(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    stats = exact.softmax_stats(logits, temperature)
    return exact.sample(logits, temperature, stats[:, 0], uniform)


def rows_of(seed: int, n: int, vocab: int, masked: float = 0.0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 4
    logits[torch.rand(n, vocab, generator=g) < masked] = float("-inf")
    logits[:, 0] = logits[:, 0].clamp(min=-1e9)  # every row keeps one finite logit
    temperature = 0.3 + torch.rand(n, generator=g)
    uniform = torch.rand(n, generator=g, dtype=torch.float64)
    return logits.to(DEVICE), temperature.to(DEVICE), uniform.to(DEVICE)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 6), vocab=st.sampled_from([1, 2, 7, 96, 1024, 1500, 2100]),
       masked=st.sampled_from([0.0, 0.5, 0.99]), edge=st.sampled_from([None, 0.0, 1 - 2**-53]))
def test_the_id_is_the_float64_references_and_has_probability(seed, n, vocab, masked, edge):
    logits, temperature, uniform = rows_of(seed, n, vocab, masked)
    if edge is not None:
        uniform[:] = edge
    ids = draw(logits, temperature, uniform).cpu()
    z = logits.double().cpu() / temperature.double().cpu()[:, None]
    p = torch.exp(z - z.amax(-1, keepdim=True))
    cdf = p.cumsum(-1)
    target = uniform.cpu() * cdf[:, -1]
    slack = 1e-6 * cdf[:, -1]
    rows = torch.arange(n)
    before = torch.where(ids > 0, cdf[rows, (ids - 1).clamp(min=0)], 0.0)
    assert ids.dtype == torch.int64 and ((0 <= ids) & (ids < vocab)).all()
    assert (p[rows, ids] > 0).all()
    assert (before <= target + slack).all() and (cdf[rows, ids] >= target - slack).all()


def test_a_rows_id_does_not_depend_on_the_other_rows():
    logits, temperature, uniform = rows_of(3, 40, 3000, masked=0.3)
    ids = draw(logits, temperature, uniform)
    for picks in ([5], [39, 0, 17], list(range(0, 40, 3))):
        assert torch.equal(draw(logits[picks], temperature[picks], uniform[picks]), ids[picks])


def test_a_row_of_nan_gets_the_last_id():
    logits, temperature, uniform = rows_of(4, 3, 1500)
    logits[1, 7] = float("nan")
    ids = draw(logits, temperature, uniform)
    assert ids[1] == 1499 and torch.equal(ids[[0, 2]], draw(logits[[0, 2]], temperature[[0, 2]], uniform[[0, 2]]))


def test_uniforms_spread_over_the_cdf_give_each_id_its_share():
    """Many uniforms evenly spread over [0, 1): each id is drawn in proportion to its probability."""
    logits = torch.tensor([[0.0, 1.0, -2.0, 3.0, 0.5]], device=DEVICE).expand(1000, 5).contiguous()
    temperature = torch.full((1000,), 0.8, device=DEVICE)
    uniform = (torch.arange(1000, dtype=torch.float64, device=DEVICE) + 0.5) / 1000
    counts = torch.bincount(draw(logits, temperature, uniform).cpu(), minlength=5).double() / 1000
    assert torch.allclose(counts, torch.softmax(logits[0].double().cpu() / 0.8, -1), atol=1.5e-3)


@pytest.mark.skipif(DEVICE != "cuda" and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the kernel needs CUDA (MT_ENV_TEST_DEVICE=cuda) or TRITON_INTERPRET=1")
@pytest.mark.parametrize("vocab", [5, 1024, 3000])
def test_the_kernel_draws_the_torch_versions_ids(vocab, monkeypatch):
    triton_sampling = pytest.importorskip("agents.triton_sampling")
    logits, temperature, uniform = rows_of(8, 64, vocab, masked=0.2)
    strided = torch.cat([logits, logits], 1)[:, :vocab]  # rows of a wider tensor (the trainer's vocab_limit view)
    top = exact.softmax_stats(logits, temperature)[:, 0]
    ids = triton_sampling.sample(strided, temperature, top, uniform, exact.SAMPLE_BLOCK)
    monkeypatch.setattr(exact, "_kernels", lambda t: None)  # the torch version
    assert torch.equal(ids.cpu(), exact.sample(logits.cpu(), temperature.cpu(), top.cpu(), uniform.cpu()))


def test_an_untruncated_rows_token_does_not_follow_its_batchs_sampling_mode():
    """The engine's sampler in exact mode: a row without top-k/top-p draws by `exact.sample` whether its batch
    samples in "sample" mode or, because another row truncates, in "truncate" mode; truncated rows keep to their set."""
    from agents.engine.sampler import sample_tokens

    logits, temperature, uniform = rows_of(5, 6, 3000)
    top_k, top_p = torch.full((6,), 3000, device=DEVICE), torch.full((6,), float("inf"), device=DEVICE)
    alone = sample_tokens(logits, temperature, uniform, top_k, top_p, "sample", exact=True)
    top_k[3], top_p[1] = 5, 0.5
    mixed = sample_tokens(logits, temperature, uniform, top_k, top_p, "truncate", exact=True)
    rows = [0, 2, 4, 5]
    assert torch.equal(mixed[0][rows], alone[0][rows]) and torch.equal(mixed[1][rows], alone[1][rows])
    assert mixed[0][3] in logits[3].topk(5).indices
