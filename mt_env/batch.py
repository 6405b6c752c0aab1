"""Samples → tensors, in two layouts.

**Padded** (`pad_samples`), verl-compatible: prompts left-padded to the longest prompt, responses right-padded to the
longest response, so every response starts at the same column ``P``. Keys (B = batch, P/R = prompt/response width):

==========================  =========  ============================================================================
``prompts``                 [B, P]     prompt ids (initial prompt incl. generation prompt), left-padded
``responses``               [B, R]     everything after the prompt: sampled turns and observations, right-padded
``input_ids``               [B, P+R]   ``cat(prompts, responses)``
``attention_mask``          [B, P+R]   1 on real tokens
``position_ids``            [B, P+R]   0,1,2,… over real tokens; 0 on left padding, last position repeated on right
                                       padding (always defined: no NaN from garbage positions)
``loss_mask``               [B, R]     1.0 exactly on sampled tokens of trainable samples
``token_level_rewards``     [B, R]     turn rewards on each turn's last sampled token, final reward on the last one
``rollout_logprobs``        [B, R]     the engine's logprobs of sampled tokens (0 elsewhere)
``segment_kinds``           [B, P+R]   `Seg` value per token, -1 on padding
``turn_ids``                [B, P+R]   assistant-turn index per token (-1: initial prompt or padding)
``prompt_lengths``          [B]        real prompt lengths; ``response_lengths`` likewise
``episode_rewards``         [B]        the episode's return (sum of all its rewards), for outcome-based advantages
==========================  =========  ============================================================================

**Packed** (`pack_samples`), padding-free: all sequences concatenated into one row ``[1, T]`` with restarting
``position_ids`` and ``cu_seqlens`` ([B+1], int32, the sequence boundaries), ``seq_ids`` ([1, T], which sequence a
token belongs to); ``loss_mask``, ``token_level_rewards``, ``rollout_logprobs``, ``segment_kinds`` and ``turn_ids``
are ``[1, T]`` aligned with ``input_ids``. A model must not attend across sequences: build a block-diagonal mask
from ``seq_ids`` or ``cu_seqlens`` (see `trainers`).

Both layouts carry ``episodes`` (a list, one id per sample) for grouping (GRPO) and per-turn samples.
`unpad` / `unpack` invert them (used by the property tests: layouts round-trip).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .sample import Sample


class Batch(dict):
    """A dict of tensors (and a few lists) with `to(device)` and row selection for the padded layout."""

    def to(self, device: torch.device | str) -> Batch:
        return Batch({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()})

    def select(self, rows: Sequence[int] | torch.Tensor) -> Batch:
        """Rows of a padded batch (tensors with batch dimension first; lists indexed likewise)."""
        if "cu_seqlens" in self:
            raise ValueError("select() is for padded batches; pack the chosen samples instead")
        idx = torch.as_tensor(rows, dtype=torch.long)
        out = Batch()
        for k, v in self.items():
            out[k] = v[idx] if isinstance(v, torch.Tensor) else [v[i] for i in idx.tolist()]
        return out

    @property
    def num_sequences(self) -> int:
        return len(self["episodes"])


def _response_fields(s: Sample) -> dict[str, list]:
    n = s.prompt_len
    rewards = s.rewards if s.rewards is not None else [0.0] * len(s.ids)
    return dict(ids=s.ids[n:], mask=s.loss_mask()[n:], rewards=rewards[n:], logprobs=s.logprobs[n:])


def pad_samples(
    samples: Sequence[Sample], pad_token_id: int, prompt_width: int | None = None, response_width: int | None = None
) -> Batch:
    """The padded layout (see module docstring). Widths default to the longest prompt / response in the batch."""
    if not samples:
        raise ValueError("cannot batch zero samples")
    P = max(s.prompt_len for s in samples)
    R = max(len(s.ids) - s.prompt_len for s in samples)
    if prompt_width is not None:
        if prompt_width < P:
            raise ValueError(f"prompt_width={prompt_width} < longest prompt {P}")
        P = prompt_width
    if response_width is not None:
        if response_width < R:
            raise ValueError(f"response_width={response_width} < longest response {R}")
        R = response_width
    B = len(samples)
    prompts = torch.full((B, P), pad_token_id, dtype=torch.long)
    responses = torch.full((B, R), pad_token_id, dtype=torch.long)
    attention = torch.zeros((B, P + R), dtype=torch.long)
    loss_mask = torch.zeros((B, R), dtype=torch.float32)
    rewards = torch.zeros((B, R), dtype=torch.float32)
    logprobs = torch.zeros((B, R), dtype=torch.float32)
    kinds = torch.full((B, P + R), -1, dtype=torch.long)
    turns = torch.full((B, P + R), -1, dtype=torch.long)
    for b, s in enumerate(samples):
        n, r = s.prompt_len, len(s.ids) - s.prompt_len
        f = _response_fields(s)
        prompts[b, P - n:] = torch.tensor(s.ids[:n], dtype=torch.long)
        attention[b, P - n: P + r] = 1
        k, t = s.kinds(), s.turns()
        kinds[b, P - n: P + r] = torch.tensor(k, dtype=torch.long)
        turns[b, P - n: P + r] = torch.tensor(t, dtype=torch.long)
        if r:
            responses[b, :r] = torch.tensor(f["ids"], dtype=torch.long)
            loss_mask[b, :r] = torch.tensor(f["mask"], dtype=torch.float32)
            rewards[b, :r] = torch.tensor(f["rewards"], dtype=torch.float32)
            logprobs[b, :r] = torch.tensor(f["logprobs"], dtype=torch.float32)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return Batch(
        prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], 1),
        attention_mask=attention, position_ids=position_ids, loss_mask=loss_mask, token_level_rewards=rewards,
        rollout_logprobs=logprobs, segment_kinds=kinds, turn_ids=turns,
        prompt_lengths=torch.tensor([s.prompt_len for s in samples], dtype=torch.long),
        response_lengths=torch.tensor([len(s.ids) - s.prompt_len for s in samples], dtype=torch.long),
        episode_rewards=torch.tensor([s.episode_reward for s in samples], dtype=torch.float32),
        episodes=[s.episode for s in samples],
    )


def pack_samples(samples: Sequence[Sample]) -> Batch:
    """The packed layout (see module docstring): one row, no padding, restarting positions."""
    if not samples:
        raise ValueError("cannot batch zero samples")
    lengths = [len(s.ids) for s in samples]
    if min(lengths) == 0:
        raise ValueError("cannot pack an empty sample")
    ids, pos, seq, mask, rew, lp, kinds, turns = [], [], [], [], [], [], [], []
    for i, s in enumerate(samples):
        ids += s.ids
        pos += range(len(s.ids))
        seq += [i] * len(s.ids)
        mask += s.loss_mask()
        rew += s.rewards if s.rewards is not None else [0.0] * len(s.ids)
        lp += s.logprobs
        kinds += s.kinds()
        turns += s.turns()
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)

    def row(x, dtype):
        return torch.tensor(x, dtype=dtype).unsqueeze(0)

    return Batch(
        input_ids=row(ids, torch.long), position_ids=row(pos, torch.long), seq_ids=row(seq, torch.long),
        cu_seqlens=cu, loss_mask=row(mask, torch.float32), token_level_rewards=row(rew, torch.float32),
        rollout_logprobs=row(lp, torch.float32), segment_kinds=row(kinds, torch.long), turn_ids=row(turns, torch.long),
        prompt_lengths=torch.tensor([s.prompt_len for s in samples], dtype=torch.long),
        episode_rewards=torch.tensor([s.episode_reward for s in samples], dtype=torch.float32),
        episodes=[s.episode for s in samples],
    )


def unpad(batch: Batch) -> list[dict[str, list]]:
    """Per-sequence lists (ids, loss_mask, position_ids, rewards, logprobs, kinds, turns) of a padded batch."""
    out = []
    P = batch["prompts"].shape[1]
    for b in range(batch["input_ids"].shape[0]):
        n, r = int(batch["prompt_lengths"][b]), int(batch["response_lengths"][b])
        span = slice(P - n, P + r)
        resp = slice(0, r)
        zeros = [0.0] * n
        out.append(dict(
            ids=batch["input_ids"][b, span].tolist(),
            position_ids=batch["position_ids"][b, span].tolist(),
            loss_mask=[0.0] * n + batch["loss_mask"][b, resp].tolist(),
            rewards=zeros + batch["token_level_rewards"][b, resp].tolist(),
            logprobs=zeros + batch["rollout_logprobs"][b, resp].tolist(),
            kinds=batch["segment_kinds"][b, span].tolist(),
            turns=batch["turn_ids"][b, span].tolist(),
        ))
    return out


def unpack(batch: Batch) -> list[dict[str, list]]:
    """Per-sequence lists of a packed batch, in the same form as `unpad`."""
    cu = batch["cu_seqlens"].tolist()
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        out.append({
            key: batch[name][0, a:b].tolist()
            for key, name in [("ids", "input_ids"), ("position_ids", "position_ids"), ("loss_mask", "loss_mask"),
                              ("rewards", "token_level_rewards"), ("logprobs", "rollout_logprobs"),
                              ("kinds", "segment_kinds"), ("turns", "turn_ids")]
        })
    return out


def sample_fields(s: Sample) -> dict[str, Any]:
    """The same per-sequence lists straight from a `Sample` (what `unpad`/`unpack` must give back; float fields are
    rounded to float32 like the tensors)."""

    def f32(x):
        return torch.tensor(x, dtype=torch.float32).tolist()

    return dict(
        ids=list(s.ids), position_ids=list(range(len(s.ids))), loss_mask=f32(s.loss_mask()),
        rewards=f32(s.rewards if s.rewards is not None else [0.0] * len(s.ids)), logprobs=f32(s.logprobs),
        kinds=s.kinds(), turns=s.turns(),
    )
