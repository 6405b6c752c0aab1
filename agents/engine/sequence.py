"""A generation request's state inside the engine: its prompt, what it sampled, how it samples, and its KV blocks.

The engine owns a `Sequence` from `Engine.add` until it is finished; the caller reads `ids`, `logprobs` and
`outcome` once it comes back from `Engine.step`, and may set `withdrawn` (from any thread) to drop it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from ..backend import SamplingParams
from .sampler import SAMPLING_MODES, sampling_mode


@dataclass(eq=False)
class Sequence:
    """One request: `prompt` continued by up to `max_new_tokens` sampled tokens.

    `tokens` (prompt + sampled) is what its KV describes: `fed` positions of it have their KV written (or being
    written by a launched step) in `blocks`, the block table (block i holds positions [i * block_size, ...)).
    """

    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int  #: `params.max_new_tokens`, capped by the context length
    ids: list[int] = field(default_factory=list)  #: sampled tokens
    logprobs: list[float] = field(default_factory=list)
    generator: random.Random | None = None  #: the row's own uniform draws (seeded: reproducible samples)
    blocks: list[int] = field(default_factory=list)
    slot: int | None = None  #: the decode-batch row it holds while running
    started: float | None = None  #: `time.perf_counter()` at its first admission
    fed: int = 0  #: positions whose KV is written or being written
    cached: int = 0  #: prompt tokens found in the prefix cache at its (last) admission
    matched: list = field(default_factory=list)  #: identities of the cached blocks its last `BlockPool.match` found
    indexed: tuple | None = None  #: how far its blocks are registered in the prefix index (`BlockPool.register`)
    preemptions: int = 0  #: times it was taken off the device for lack of KV blocks and queued again
    withdrawn: bool = False  #: its caller gave up on it (set from any thread): it leaves at the next step
    outcome: str | BaseException | None = None  #: a finish reason ("stop", "length", "abort") or the error
    caller: Any = None  #: whatever the caller attached (the engine never reads it)
    mode: int = field(init=False)  #: index in SAMPLING_MODES of the `sample_tokens` mode the row needs (0: greedy)

    def __post_init__(self):
        self.mode = SAMPLING_MODES.index(sampling_mode([self.params]))

    @property
    def tokens(self) -> list[int]:
        """Prompt and sampled tokens (a new list)."""
        return self.prompt + self.ids

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.ids)

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    def fit(self, max_context_len: int, rng: random.Random) -> None:
        """Made ready for an engine: `max_new_tokens` capped by the room its context leaves (ValueError when none),
        and a generator seeded by its `SamplingParams.seed`, else drawn from `rng`."""
        room = max_context_len - len(self.prompt)
        if room < 1:
            raise ValueError(f"the prompt is {len(self.prompt)} tokens: no room left in the context of "
                             f"{max_context_len} tokens")
        self.max_new_tokens = min(self.max_new_tokens, room)
        if self.generator is None:
            seed = self.params.seed
            self.generator = random.Random(seed if seed is not None else rng.getrandbits(63))

    def record(self, token: int, logprob: float) -> bool:
        """Append a sampled token; True when the sequence goes on (no stop token, no limit, not withdrawn)."""
        self.ids.append(token)
        self.logprobs.append(logprob)
        if token in self.params.stop_token_ids:
            self.outcome = "stop"
        elif len(self.ids) >= self.max_new_tokens:
            self.outcome = "length"
        return self.outcome is None and not self.withdrawn
