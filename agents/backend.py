"""The generation backend interface: asynchronous, token-in/token-out generation.

A `Backend` turns prompt token ids into a `mt_env.turn.ModelTurn`: sampled token ids and their log-probabilities, the
very object `ToolEnv.step` takes. Prompts are token ids and
outputs are token ids; nothing is decoded and re-encoded on the way, because a model's own split of a text (``hel``
+ ``lo``) is what it sampled and what the trainer must score (see `mt_env.conversation`).

Conventions every backend follows:

* **Stop tokens are kept.** When generation stops on one of `SamplingParams.stop_token_ids`, that token is the
  last entry of `ModelTurn.ids` (with its logprob) and `finish_reason` is ``"stop"``. When it stops on
  `max_new_tokens` (or on the context length), `finish_reason` is ``"length"`` and nothing is appended.
* **Logprobs are the sampling distribution before truncation:** ``log_softmax(logits / temperature)`` of the
  sampled token, computed *before* top-p/top-k cut the distribution; with ``temperature == 0`` (greedy) it is
  ``log_softmax(logits)``. This is the quantity a trainer recomputes from a forward pass at the same temperature,
  so that importance ratios start at 1. (SGLang reports the same quantity by default.)
* ``finish_reason == "abort"``: the backend gave up on the request (closed, or the server aborted it); `ids` holds
  whatever was sampled before.

Backends: `agents.hf_backend.HFBackend` (transformers, in process, shares weights with the trainer) and
`agents.sglang_backend` (an SGLang engine in process, or SGLang servers over HTTP).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mt_env.checks import is_int, is_real
from mt_env.errors import MtEnvError
from mt_env.turn import ModelTurn


class BackendError(MtEnvError):
    """A generation backend cannot serve requests: closed, worker dead, server unhealthy, weight sync failed."""


class GenerationError(BackendError):
    """One generation request failed: the model raised, a server answered with an error, or it timed out."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one assistant turn.

    Args:
        temperature: divides the logits; 0 means greedy (argmax).
        top_p: nucleus sampling: keep the most likely tokens until their probability mass reaches `top_p` (1 = off).
        top_k: keep the `top_k` most likely tokens; -1 = off.
        max_new_tokens: at most this many tokens are sampled (the stop token included).
        stop_token_ids: generation stops after sampling one of these (it is kept in the output).
        seed: seeds this request's random generator, so the same prompt and seed sample the same tokens
            (backends without per-request seeds document what they do).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 512
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if not is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Iterable):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        stop = tuple(self.stop_token_ids)
        bad = [t for t in stop if not is_int(t) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be non-negative integers, got {bad[:5]}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be None or an integer in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


class Backend(abc.ABC):
    """An asynchronous generation backend. Many episodes call `generate` concurrently from asyncio tasks; a
    backend serves them together (batching, or a server's own scheduler).

    Subclasses implement `generate`; they may implement `close` and the weight-sync hooks, which by default raise
    `NotImplementedError` saying that this backend lacks them. A backend that counts its work (passes, seconds)
    keeps the numbers in `stats`; `counted` reads their increase over a block.
    """

    stats: Mapping[str, float] = MappingProxyType({})  #: the backend's running counters (none by default)

    @abc.abstractmethod
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> ModelTurn:
        """Sample a continuation of `prompt_ids` (default `SamplingParams()`)."""

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> asyncio.Future[ModelTurn]:
        """`generate` started now, from the running event loop's thread, as a future of its ModelTurn (cancelling
        the future cancels the generation). For callers that start many generations from one callback, e.g. a
        burst of requests read from a pipe (`agents.rollout_processes`): here `generate` runs as a task, whose
        first step — where a backend takes the request — waits for the event loop's next pass; a backend that
        takes requests synchronously overrides this so that each reaches it as soon as it is submitted."""
        return asyncio.ensure_future(self.generate(prompt_ids, params))

    async def generate_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[ModelTurn]:
        """Generate for several prompts concurrently; results in prompt order.

        `params` is one `SamplingParams` for all prompts or one per prompt. With a single `params` that has a
        seed, prompt ``i`` gets seed ``seed + i``: repeated prompts (a GRPO group) then differ, and the whole call
        is still reproducible.
        """
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            base = params or SamplingParams()
            per_prompt = [base if base.seed is None else base.replace(seed=(base.seed + i) % 2**63)
                          for i in range(len(prompts))]
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        return list(await asyncio.gather(*(self.generate(p, q) for p, q in zip(prompts, per_prompt))))

    async def close(self) -> None:
        """Release the backend (stop workers, close connections). Requests still running end as ``"abort"``."""

    # ----------------------------------------------------------------------------------------- weight sync
    async def update_weights(
        self,
        named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
        *,
        model_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        """Load new weights: from tensors (``{name: tensor}`` or ``(name, tensor)`` pairs) or from a checkpoint
        folder (`model_path`), whichever the backend supports."""
        raise NotImplementedError(f"{type(self).__name__} cannot update weights")

    async def release_memory(self) -> None:
        """Free the accelerator memory held for weights and KV cache (e.g. while the trainer runs)."""
        raise NotImplementedError(f"{type(self).__name__} cannot release its memory")

    async def resume_memory(self) -> None:
        """Take back the memory given up by `release_memory`."""
        raise NotImplementedError(f"{type(self).__name__} cannot resume released memory")

    async def flush_cache(self) -> None:
        """Drop cached prefixes (needed after a weight update on backends with a prefix cache)."""
        raise NotImplementedError(f"{type(self).__name__} has no cache to flush")

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info):
        await self.close()


# --------------------------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def counted(source: Any) -> Iterator[dict[str, float]]:
    """A dict that, when the block ends, holds how much each of `source.stats` grew during it (e.g. the embedded
    engine's passes and seconds over one rollout): a `Backend`, or anything with a `stats` mapping of numbers (a
    `SlotEngine`)."""
    before, grown = dict(source.stats), {}
    try:
        yield grown
    finally:
        grown.update({key: source.stats[key] - value for key, value in before.items()})


def check_prompt_ids(prompt_ids: Sequence[int], vocab_size: int | None = None) -> list[int]:
    """`prompt_ids` as a list of ints, or ValueError saying what is wrong (empty, not ints, outside the vocabulary)."""
    if isinstance(prompt_ids, (str, bytes)):
        raise ValueError("prompt_ids must be token ids, not text (mt_env never re-tokenizes)")
    try:
        ids = list(prompt_ids)
    except TypeError:
        raise ValueError(f"prompt_ids must be a sequence of token ids, got {type(prompt_ids).__name__}") from None
    if not ids:
        raise ValueError("the prompt is empty: a backend needs at least one prompt token")
    if set(map(type, ids)) != {int}:  # the common case, plain ints, is checked without a Python call per id
        not_int = [i for i in ids if not is_int(i)]
        if not_int:
            raise ValueError(f"prompt ids must be integers, got {not_int[:5]}")
        ids = [int(i) for i in ids]
    high = vocab_size if vocab_size is not None else math.inf
    if min(ids) < 0 or max(ids) >= high:
        bad = [i for i in ids if not 0 <= i < high]
        where = f"[0, {vocab_size})" if vocab_size is not None else "[0, inf)"
        raise ValueError(f"prompt token id(s) {bad[:5]} outside the vocabulary {where}")
    return ids
