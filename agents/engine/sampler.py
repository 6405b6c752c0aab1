"""Sampling for both of the engine's runners: one token per row on the device, by inverse CDF with a uniform number the
row draws from its own seeded generator, so a seed gives the same tokens whatever else shares the batch.

``log_softmax(logits / T)`` of the sampled token is its logprob (before top-k/top-p truncation: what a trainer
recomputes). Top-k/top-p need a sort: only the ``"truncate"`` mode sorts, and sampling then runs in vocabulary
order (near-ties that two computations sort differently would otherwise swap tokens).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..backend import SamplingParams
from .. import exact as exact_ops

SAMPLING_MODES = ("greedy", "sample", "truncate")


def sampling_mode(params: Sequence[SamplingParams]) -> str:
    """The cheapest `sample_tokens` mode serving all these rows: greedy < sample < truncate (top-k/top-p)."""
    sampled = [p for p in params if not p.greedy]
    if not sampled:
        return "greedy"
    return "truncate" if any(p.top_k != -1 or p.top_p < 1 for p in sampled) else "sample"


def cdf_dtype(device: torch.device) -> torch.dtype:
    """Inverse-CDF sampling accumulates in float64 (float32 where the device has no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


@dataclass
class RowSampling:
    """Per-row sampling inputs for one pass, in row order; the uniforms are drawn from each row's own generator."""

    temperature: list[float]
    top_k: list[int]  #: the vocabulary size when off
    top_p: list[float]  #: inf when off
    uniform: list[float]  #: 0 for greedy rows (they draw nothing)
    mode: str

    @classmethod
    def draw(cls, params: Sequence[SamplingParams], generators: Sequence[random.Random], vocab: int) -> RowSampling:
        return cls([p.temperature for p in params], [p.top_k if p.top_k > 0 else vocab for p in params],
                   [p.top_p if p.top_p < 1 else float("inf") for p in params],
                   [0.0 if p.greedy else g.random() for p, g in zip(params, generators)], sampling_mode(params))

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temperature float32, uniform, top_k long, top_p float32) on `device`."""
        return (to_device(self.temperature, torch.float32, device),
                to_device(self.uniform, cdf_dtype(device), device),
                to_device(self.top_k, torch.long, device), to_device(self.top_p, torch.float32, device))


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, mode: str, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of float32 `logits` [rows, vocab] and ``log_softmax(logits / T)`` of it.

    Rows with ``temperature == 0`` take the argmax (their logprob is ``log_softmax(logits)``); the others sample
    by inverse CDF with their `uniform` number, after their own `top_k` [rows] (vocab = off) and `top_p` [rows]
    (inf = off) in ``"truncate"`` mode. No host synchronisation and no data-dependent shapes: CUDA graphs can
    capture it. A NaN in a row's logits makes its logprob NaN (the caller checks). `exact`: the logprob is the
    trainer's in exact mode (`agents.exact.softmax_stats`, `stats_logprob`), and rows sample by `agents.exact.sample`
    (an order set by the vocabulary alone; top-k/top-p rows as above, from `agents.exact.tempered_log_softmax`).
    """
    if mode not in SAMPLING_MODES:
        raise ValueError(f"sampling mode must be one of {SAMPLING_MODES}, got {mode!r}")
    greedy = temperature == 0
    scale = torch.where(greedy, 1.0, temperature)
    if exact:
        return _exact_tokens(logits, greedy, scale, uniform, top_k, top_p, mode)
    logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    if mode != "greedy":
        tokens = torch.where(greedy, tokens, _inverse_cdf(logprobs, uniform, top_k, top_p, mode))
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _exact_tokens(logits, greedy, scale, uniform, top_k, top_p, mode):
    """`sample_tokens` in exact mode: the logprob from the row's `agents.exact.softmax_stats` (no [rows, vocab]
    logprobs), the token by `agents.exact.sample` (no cumulative sum), a row with top-k/top-p by `_inverse_cdf` over
    `agents.exact.tempered_log_softmax`. Which way a row samples is its own setting, never its batch's mode."""
    stats = exact_ops.softmax_stats(logits, scale)
    tokens = logits.argmax(dim=-1)
    if mode != "greedy":
        tokens = torch.where(greedy, tokens, exact_ops.sample(logits, scale, stats[:, 0], uniform))
    if mode == "truncate":
        truncated = ~greedy & ((top_k < logits.shape[-1]) | torch.isfinite(top_p))
        choice = _inverse_cdf(exact_ops.tempered_log_softmax(logits, scale, stats), uniform, top_k, top_p, mode)
        tokens = torch.where(truncated, choice, tokens)
    return tokens, exact_ops.stats_logprob(logits, tokens, scale, stats)


def _inverse_cdf(logprobs: torch.Tensor, uniform: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 mode: str) -> torch.Tensor:
    """One id per row of `logprobs` [rows, vocab] at its `uniform` number (after top-k/top-p in "truncate" mode),
    by a float64 cumulative sum in vocabulary order."""
    probs = logprobs.exp()
    if mode == "truncate":
        probs = _truncate(probs, top_k, top_p)
    cdf = probs.to(uniform.dtype).cumsum(dim=-1)
    total = cdf[:, -1]
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    # NaN logits would make the index point past the vocabulary: clamp it (the NaN logprob reports them).
    return torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=logprobs.shape[-1] - 1).squeeze(1)


def _truncate(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`probs` with the tokens outside each row's top-k / top-p set zeroed, still in vocabulary order.

    The set comes from a (stable, descending) sort; sampling then runs in vocabulary order, so two tokens of
    nearly equal probability that two computations sort differently change nothing unless they straddle the
    cut (sampling in sorted order would swap their CDF intervals)."""
    vocab = probs.shape[-1]
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=probs.device)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank[None, :] < top_k[:, None]) & (mass_before < top_p[:, None])
    return probs * torch.empty_like(keep).scatter_(1, order, keep)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device` without waiting for the device (a plain copy from pageable
    memory would wait for the step in flight: through pinned memory, asynchronously)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
