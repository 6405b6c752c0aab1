"""One model turn: what a policy samples and what `ToolEnv.step` takes, as one type.

An engine returns the sampled token ids verbatim (the stop token included when it stopped on one), one logprob per
id and a finish reason; a text agent gives the turn as text instead. The conversation keeps an accepted turn as an
`mt_env.conversation.AssistantTurn`: the same turn, cut to the token budget, plus where it sits in the conversation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: ``stop``: the model ended its turn (a stop token was sampled); ``length``: the turn hit its token limit;
#: ``abort``: the engine gave up on the request.
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


@dataclass
class ModelTurn:
    """One model turn.

    Attributes:
        ids: the sampled token ids, verbatim (the stop token last when generation stopped on it); None for a turn
            given as `text`.
        logprobs: one per id: ``log_softmax(logits / temperature)`` of the sampled token (see `agents.backend`), or
            None when unknown.
        finish_reason: one of `FINISH_REASONS`.
        meta: backend details, e.g. timings (``queue_s``, ``generate_s``) and token counts.
        text: the turn as text (text agents; in token mode the env encodes it), instead of `ids`.
    """

    ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str = "stop"
    meta: dict[str, Any] = field(default_factory=dict)
    text: str | None = None

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if self.ids is None and self.text is None:
            raise ValueError("a model turn needs ids or text")
        if self.ids is not None and self.logprobs is not None and len(self.ids) != len(self.logprobs):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.ids)} ids")

    def __len__(self) -> int:
        return len(self.ids) if self.ids is not None else 0
