"""The paged engine's sampler (`agents.engine.sampler`): inverse-CDF sampling picks the token whose interval holds
the uniform, truncation samples the kept tokens in vocabulary order and reports untruncated logprobs, greedy rows
take the argmax, NaN logits stay in the vocabulary, and `RowSampling` draws only for sampled rows."""

from __future__ import annotations

import math

import pytest
import torch

from agents.backend import SamplingParams
from agents.engine.sampler import RowSampling, sample_tokens

from .backend_hf_fixtures import one_cpu_thread  # noqa: F401  (one intra-op thread for tiny tensors)


# ------------------------------------------------------------------------------------------------- the sampler
def sample(probs, uniform, temperature=1.0, top_k=None, top_p=None, mode="sample"):
    logits = torch.tensor([probs]).log()
    vocab = len(probs)
    return sample_tokens(logits, torch.tensor([temperature]), torch.tensor([uniform], dtype=torch.float64),
                         torch.tensor([top_k or vocab]), torch.tensor([top_p or math.inf]), mode)


@pytest.mark.parametrize("uniform, token", [(0.05, 0), (0.15, 1), (0.35, 2), (0.61, 3), (0.999, 3)])
def test_inverse_cdf_picks_the_token_whose_interval_holds_the_uniform(uniform, token):
    tokens, logprobs = sample([0.1, 0.2, 0.3, 0.4], uniform)
    assert tokens.tolist() == [token]
    assert logprobs.item() == pytest.approx(math.log([0.1, 0.2, 0.3, 0.4][token]), abs=1e-6)


@pytest.mark.parametrize("uniform, token", [(0.3, 2), (0.42, 2), (0.43, 3), (0.999, 3)])
def test_truncation_samples_the_kept_tokens_in_vocabulary_order_and_reports_untruncated_logprobs(uniform, token):
    # top-2 keeps tokens 2 and 3 (p 0.3, 0.4): cdf 0, 0, 0.3, 0.7 in vocabulary order; the uniform scales to 0.7
    tokens, logprobs = sample([0.1, 0.2, 0.3, 0.4], uniform, top_k=2, mode="truncate")
    assert tokens.tolist() == [token]
    assert logprobs.item() == pytest.approx(math.log([0.1, 0.2, 0.3, 0.4][token]), abs=1e-6)


def test_greedy_rows_take_the_argmax_whatever_their_uniform():
    for mode in ("greedy", "sample", "truncate"):
        tokens, logprobs = sample([0.1, 0.5, 0.4], 0.01, temperature=0.0, mode=mode)
        assert tokens.tolist() == [1] and logprobs.item() == pytest.approx(math.log(0.5), abs=1e-6)


def test_nan_logits_stay_in_the_vocabulary_and_show_as_nan_logprobs():
    logits = torch.tensor([[0.0, 1.0, 2.0], [math.nan, 0.0, 0.0]])
    for mode in ("sample", "truncate"):
        tokens, logprobs = sample_tokens(logits, torch.ones(2), torch.tensor([0.9, 0.9], dtype=torch.float64),
                                         torch.tensor([3, 1]), torch.tensor([math.inf, math.inf]), mode)
        assert all(0 <= t < 3 for t in tokens.tolist())
        assert not math.isnan(logprobs[0].item()) and math.isnan(logprobs[1].item())


def test_row_sampling_draws_only_for_sampled_rows():
    import random

    params = [SamplingParams(temperature=0), SamplingParams(seed=1, top_k=4), SamplingParams(top_p=0.5)]
    generators = [random.Random(0), random.Random(1), random.Random(2)]
    drawn = RowSampling.draw(params, generators, vocab=10)
    assert drawn.uniform == [0.0, random.Random(1).random(), random.Random(2).random()]
    assert drawn.top_k == [10, 4, 10] and drawn.top_p == [math.inf, math.inf, 0.5] and drawn.mode == "truncate"
    assert generators[0].random() == random.Random(0).random()  # the greedy row's generator was not touched
