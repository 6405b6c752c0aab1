"""Samples → one training batch, and the packed view of its rows that a model runs on.

`collate(samples, pad_token_id)` gives a `TrainBatch`: one row per sample, the sample's tokens first and padding
after, every per-token tensor ``[B, L]`` aligned with ``input_ids``. From here to the loss nothing changes layout
or name — SFT and RL read the same fields:

=====================  =======  ===================================================================================
``input_ids``          [B, L]   the sample's ids, then ``pad_token_id``
``attention_mask``     [B, L]   1 on real tokens
``position_ids``       [B, L]   0, 1, 2, … over real tokens; the last position repeated on padding (always defined)
``loss_mask``          [B, L]   1.0 exactly on sampled tokens of trainable samples
``rewards``            [B, L]   token-level rewards: each turn's on its last sampled token, the final one on the last
``rollout_logprobs``   [B, L]   the engine's logprobs of sampled tokens (0 elsewhere)
``turn_ids``           [B, L]   assistant-turn index per token (-1: the initial prompt, and padding)
``group``, ``episode`` [B]      the collector's tags (`Sample.group`, `Sample.episode`): GRPO groups, and which
                                per-turn samples are one episode
``episode_rewards``    [B]      each sample's episode return
=====================  =======  ===================================================================================

The trainer adds what it computes per token (``old_logprobs``, ``ref_logprobs``, ``values``, ``advantages``,
``returns``) to the same batch (`TrainBatch.replace`): one row selection (``batch[rows]``) is a mini- or micro-batch
of everything, as in CleanRL's flattened batch. `pack` lays a (micro-)batch's rows end to end in one row without
padding, for a model that attends block-diagonally (``seq_ids``); `Packed.unpack` puts results back in ``[B, L]``.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .sample import Sample


@dataclass(frozen=True)
class TrainBatch:
    """One training batch (see the module docstring). Per-token tensors are ``[B, L]``, per-row ones ``[B]``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    rewards: torch.Tensor
    rollout_logprobs: torch.Tensor
    turn_ids: torch.Tensor
    group: torch.Tensor
    episode: torch.Tensor
    episode_rewards: torch.Tensor
    # filled by the trainer
    old_logprobs: torch.Tensor | None = None  #: the policy's logprobs before the update, on the same ids
    ref_logprobs: torch.Tensor | None = None  #: the KL reference model's
    values: torch.Tensor | None = None  #: the critic's, before the update
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, rows: torch.Tensor | Sequence[int] | slice) -> TrainBatch:
        """The batch of `rows` (every field, per-token and per-row alike)."""
        return self._map(lambda t: t[rows])

    def to(self, device: torch.device | str) -> TrainBatch:
        return self._map(lambda t: t.to(device))

    def replace(self, **fields: torch.Tensor | None) -> TrainBatch:
        return dataclasses.replace(self, **fields)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TrainBatch:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return TrainBatch(**{name: None if value is None else fn(value) for name, value in fields.items()})


def collate(samples: Sequence[Sample], pad_token_id: int) -> TrainBatch:
    """The samples as one batch: row ``b`` is sample ``b``, right-padded to the longest sample."""
    if not samples:
        raise ValueError("cannot batch zero samples")
    B, L = len(samples), max(len(s) for s in samples)

    def per_token(values: Callable[[Sample], Sequence], fill: float, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((B, L), fill, dtype=dtype)
        for b, s in enumerate(samples):
            out[b, :len(s)] = _tensor(values(s), dtype)
        return out

    attention_mask = per_token(lambda s: [1] * len(s), 0, torch.long)
    return TrainBatch(
        input_ids=per_token(lambda s: s.ids, pad_token_id, torch.long),
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        loss_mask=per_token(Sample.loss_mask, 0.0, torch.float32),
        rewards=per_token(lambda s: _or_zeros(s.rewards, len(s)), 0.0, torch.float32),
        rollout_logprobs=per_token(lambda s: s.logprobs, 0.0, torch.float32),
        turn_ids=per_token(Sample.turns, -1, torch.long),
        group=torch.tensor([s.group for s in samples], dtype=torch.long),
        episode=torch.tensor([s.episode for s in samples], dtype=torch.long),
        episode_rewards=torch.tensor([s.episode_reward for s in samples], dtype=torch.float32),
    )


def _tensor(values: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """Per-token values (a list, or a typed array set by hand) as a tensor."""
    return torch.tensor(list(values) if isinstance(values, array) else values, dtype=dtype)


def _or_zeros(rewards: Sequence[float] | None, n: int) -> Sequence[float]:
    return rewards if rewards is not None else [0.0] * n


@dataclass(frozen=True)
class Packed:
    """A batch's rows end to end in one row of its T real tokens (``[1, T]`` each): positions restart at 0 for
    every sequence and ``seq_ids`` says which row a token came from. Restarting positions alone do not keep a model
    from attending across sequences: it must attend block-diagonally (see `trainers.modeling`)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    seq_ids: torch.Tensor
    loss_mask: torch.Tensor
    real: torch.Tensor  #: [B, L] bool: where the packed tokens sit in the batch

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """A per-token result ``[1, T]`` back in the batch's ``[B, L]`` layout (0 on padding)."""
        out = torch.zeros(self.real.shape, dtype=x.dtype, device=x.device)
        out[self.real] = x[0]
        return out


def pack(batch: TrainBatch) -> Packed:
    """The batch's rows without padding, in one row."""
    real = batch.attention_mask.bool()
    seq_ids = torch.arange(len(batch), device=real.device)[:, None].expand_as(real)
    return Packed(batch.input_ids[real][None], batch.position_ids[real][None], seq_ids[real][None],
                  batch.loss_mask[real][None], real)



def micro_batches(batch: TrainBatch, rows: torch.Tensor, max_rows: int, max_tokens: int | None = None,
                  packed: bool = False) -> list[torch.Tensor]:
    """`rows` (indices into `batch`, in order) split into consecutive micro-batches: of `max_rows` rows, or with
    `max_tokens` of at most that many tokens each — packed, the rows' real tokens; padded, rows × the longest of
    them. By tokens, each micro-batch takes rows while they fit (every one but the last is full: the next row would
    not fit), and a row longer than `max_tokens` is a micro-batch of its own. No row is dropped, repeated or
    reordered."""
    if max_tokens is None:
        return list(rows.split(max_rows))
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = batch.attention_mask[rows].sum(-1).tolist()
    out, start, longest, total = [], 0, 0, 0
    for k, n in enumerate(lengths):
        cost = total + n if packed else (k - start + 1) * max(longest, n)
        if k > start and cost > max_tokens:
            out.append(rows[start:k])
            start, longest, total = k, 0, 0
        longest, total = max(longest, n), total + n
    return out + [rows[start:]] if len(rows) else out
