"""ScriptedBackend: a `Backend` that answers from a script instead of a model — real token ids, no weights.

For tests and benchmarks that need exact, repeatable model turns (replayed recordings, an expert that calls the
tool, a model that misbehaves on purpose), and for demos without a model. The script is a function of the prompt
ids (the whole context so far) returning the next turn: token ids, or a full `ModelTurn`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from mt_env.turn import ModelTurn

from .backend import Backend, BackendError, SamplingParams, check_prompt_ids


class ScriptedBackend(Backend):
    """Args:
        script: ``script(prompt_ids) -> list[int] | ModelTurn``. Plain ids get logprobs of 0 and finish reason
            ``"stop"`` when they end with a stop token, else ``"length"``; they are cut at ``max_new_tokens``.
        latency_s: seconds each generation takes (``asyncio.sleep``), or a function of the prompt ids.
        vocab_size: when given, prompts are checked against it.
    """

    def __init__(self, script: Callable[[list[int]], Sequence[int] | ModelTurn],
                 latency_s: float | Callable[[list[int]], float] = 0.0, vocab_size: int | None = None):
        self.script = script
        self.latency_s = latency_s
        self.vocab_size = vocab_size
        self.calls = 0
        self._closed = False

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> ModelTurn:
        if self._closed:
            raise BackendError("this ScriptedBackend is closed")
        params = params or SamplingParams()
        prompt = check_prompt_ids(prompt_ids, self.vocab_size)
        self.calls += 1
        delay = self.latency_s(prompt) if callable(self.latency_s) else self.latency_s
        if delay:
            await asyncio.sleep(delay)
        out = self.script(prompt)
        if isinstance(out, ModelTurn):
            return out
        ids = list(out)
        stop = next((i for i, t in enumerate(ids) if t in params.stop_token_ids), None)
        if stop is not None and stop < params.max_new_tokens:
            ids = ids[: stop + 1]
            return ModelTurn(ids, [0.0] * len(ids), "stop")
        ids = ids[: params.max_new_tokens]
        return ModelTurn(ids, [0.0] * len(ids), "length")

    async def close(self) -> None:
        self._closed = True
