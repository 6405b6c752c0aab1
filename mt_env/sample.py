"""A training sample: one token sequence with the origin of every token (its segments).

A `Conversation` builds samples turn by turn; `mt_env.batch.collate` turns them into one training batch; `render`
draws them. Every per-token view — the loss mask, the segment kinds, the turn indices — derives from the segments,
so they cannot disagree. Where samples cross a process boundary, `mt_env.wire` sends them compactly.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Seg(enum.IntEnum):
    """Where a token came from."""

    PROMPT = 0  #: the rendered prompt messages (system, user, tools)
    GEN_PROMPT = 1  #: the template's generation prompt, e.g. ``<|im_start|>assistant\n``
    SAMPLED = 2  #: sampled by the model: the only tokens with loss mask 1
    OBSERVATION = 3  #: tool responses / user messages and the separators around them


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of tokens of one kind. `turn` is the assistant turn it belongs to: the turn a SAMPLED run is, the turn
    a GEN_PROMPT opens, the turn an OBSERVATION answers; -1 for the initial prompt."""

    kind: Seg
    turn: int
    start: int
    end: int
    text: str  #: the exact text these tokens stand for (decoded ids for SAMPLED runs)

    def __len__(self) -> int:
        return self.end - self.start


@dataclass
class Sample:
    """One training sequence: `ids` with their segments, the engine's logprobs and token-level rewards.

    `group` and `episode` are tags for whoever collects episodes into a batch (the rollout driver sets them after
    `Conversation.samples()`): the GRPO group (the task) and the episode, shared by the per-turn samples of one
    episode. -1 means untagged (e.g. SFT demonstrations, which need no grouping)."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    prompt_len: int = 0  #: tokens before the first sampled turn: the prompt, generation prompt included
    n_messages: int = 0  #: template messages this sample covers (for the drift check)
    rewards: list[float] | None = None  #: token-level rewards, filled by `Conversation.samples()`
    trainable: bool = True  #: False for failed episodes: the loss mask is then all zero
    episode_reward: float = 0.0  #: the whole episode's return (the same on every sample of the episode)
    group: int = -1  #: GRPO group, set by the collector
    episode: int = -1  #: the episode's id in the collected batch, set by the collector

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def single_turn(cls, prompt: list[int], sampled: list[int], logprobs: list[float], episode: int = -1) -> Sample:
        """A one-turn sample without a template: `prompt` ids, then the `sampled` ids with their engine `logprobs`
        (to score a backend's raw generations as the trainer would; segment texts are empty, there is no tokenizer)."""
        if len(logprobs) != len(sampled):
            raise ValueError(f"{len(sampled)} sampled ids but {len(logprobs)} logprobs")
        sample = cls(prompt_len=len(prompt), group=0, episode=episode)
        sample._extend(Seg.PROMPT, -1, list(prompt), "")
        sample._extend(Seg.SAMPLED, 0, list(sampled), "", list(logprobs))
        return sample

    def kinds(self) -> list[int]:
        out: list[int] = []
        for s in self.segments:
            out += [int(s.kind)] * len(s)
        return out

    def turns(self) -> list[int]:
        out: list[int] = []
        for s in self.segments:
            out += [s.turn] * len(s)
        return out

    def loss_mask(self) -> list[int]:
        on = 1 if self.trainable else 0
        out: list[int] = []
        for s in self.segments:
            out += [on if s.kind == Seg.SAMPLED else 0] * len(s)
        return out

    def _extend(self, kind: Seg, turn: int, ids: list[int], text: str, logprobs: list[float] | None = None):
        start = len(self.ids)
        self.ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        if ids or kind == Seg.SAMPLED:  # keep empty sampled turns: they carry a turn index
            self.segments.append(Segment(kind, turn, start, start + len(ids), text))
