"""The trainer's side of recorded trajectories (`mt_env.trajectories`): which episodes of a step are kept, and their
records, read from the objects the loss used.

Every ``logging.record_every`` steps the trainer hands `Recorder.record_step` the step's rollout and its `TrainBatch`
once the old logprobs and advantages are in it (after the update when the update's own logprobs were the old ones):
the per-token arrays of a record are that batch's rows (ids, loss mask, rollout and old logprobs, advantages, token
rewards, and the reference logprobs, values and returns when the run has them), never recomputed; the segments and
token texts are the rows' `Sample`s'. Up to ``logging.record_episodes`` episodes are kept per step, whole GRPO groups
first, and as many of every evaluation (`Recorder.record_eval`: the samples as played, without trainer values). The
main process records its own episodes.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agents.rollout import EpisodeRecord, RolloutResult
from mt_env.batch import TrainBatch
from mt_env.render import token_pieces
from mt_env.sample import Sample, Seg
from mt_env.trajectories import FORMAT, encode_tokens, remove_after, write_records

#: record name -> `TrainBatch` field
BATCH_FIELDS = {"ids": "input_ids", "loss_mask": "loss_mask", "rollout_logprobs": "rollout_logprobs",
                "rewards": "rewards", "old_logprobs": "old_logprobs", "ref_logprobs": "ref_logprobs",
                "values": "values", "advantages": "advantages", "returns": "returns"}


class Recorder:
    """Writes a run's trajectories to ``run_dir/trajectories`` (see the module docstring). `every` 0 records
    nothing; a run resumed from the checkpoint of `resume_step` first drops the files of later steps (they run
    again)."""

    def __init__(self, run_dir: str | Path, tokenizer, every: int, episodes: int, enabled: bool = True,
                 resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.tokenizer = tokenizer
        self.every = every
        self.episodes = episodes
        self.enabled = enabled and every > 0
        if self.enabled and resume_step is not None:
            remove_after(self.run_dir, resume_step)

    def record_step(self, step: int, tasks: Sequence[dict], result: RolloutResult, batch: TrainBatch) -> dict:
        """Record the step's episodes if it is due; returns ``{"perf/record_s": seconds}`` when it recorded."""
        if not self.enabled or step % self.every:
            return {}
        start = time.perf_counter()
        version = policy_version(result, step)
        records = []
        rows = _rows_by_episode(batch)
        chosen = chosen_episodes(result.episodes, self.episodes)
        arrays = iter(batch_arrays(batch, [r for k in chosen for r in rows.get(k, [])]))
        for k in chosen:
            episode = result.episodes[k]
            tokens = [next(arrays) for _ in rows.get(k, [])]
            reward = float(batch.episode_rewards[rows[k][0]]) if k in rows else episode.total_reward
            records.append(self._record("train", step, k, episode, tasks, tokens, version, reward))
        write_records(self.run_dir, "train", step, records)
        return {"perf/record_s": time.perf_counter() - start}

    def record_eval(self, step: int, tasks: Sequence[dict], result: RolloutResult, kind: str = "eval") -> Path | None:
        """Record up to `episodes` episodes of the evaluation after `step` (played with that step's weights; `kind`
        ``evaluate``: by trainers/evaluate.py). Returns the file written."""
        if not self.enabled:
            return None
        records = []
        for k in chosen_episodes(result.episodes, self.episodes):
            episode = result.episodes[k]
            tokens = [sample_arrays(s) for s in episode.samples]
            records.append(self._record(kind, step, k, episode, tasks, tokens, step, episode.total_reward))
        return write_records(self.run_dir, kind, step, records)

    def _record(self, kind: str, step: int, k: int, episode: EpisodeRecord, tasks: Sequence[dict],
                tokens: list[dict[str, np.ndarray]], version: int, reward: float) -> dict:
        samples = episode.samples
        for sample, arrays in zip(samples, tokens, strict=True):
            if len(arrays["ids"]) != len(sample):
                raise ValueError(f"episode {k}: a batch row of {len(arrays['ids'])} tokens for a sample of "
                                 f"{len(sample)}")
        return {
            "format": FORMAT, "step": step, "kind": kind, "episode": k, "group": episode.id.group,
            "index": episode.id.index, "task_id": task_id(tasks[episode.id.group]), "prompt": _question(episode),
            "reward": _number(reward),
            "success": bool(episode.success), "state": episode.state.value, "end_reason": episode.end_reason,
            "error": episode.error, "stats": {key: _number(v) for key, v in episode.stats.items()},
            "finish_reasons": list(episode.finish_reasons), "turns": turn_records(episode, version),
            "samples": [sample_record(s, arrays, self.tokenizer) for s, arrays in zip(samples, tokens)],
        }


def policy_version(result: RolloutResult, step: int) -> int:
    """The weights that sampled a training step's episodes, as the number of updates they had: the previous step's
    (``step - 1``), or in one-step off-policy mode the version the generator reported
    (``async/weights_version``, `trainers.async_rollout`)."""
    return int(result.metrics.get("async/weights_version", step - 1))


def chosen_episodes(episodes: Sequence[EpisodeRecord], limit: int) -> list[int]:
    """Indices of up to `limit` episodes: whole groups in group order (the last one cut to fit)."""
    groups: dict[int, list[int]] = {}
    for k, episode in enumerate(episodes):
        groups.setdefault(episode.id.group, []).append(k)
    out: list[int] = []
    for members in groups.values():
        if len(out) >= limit:
            break
        out += members[:limit - len(out)]
    return out


def batch_arrays(batch: TrainBatch, rows: list[int]) -> list[dict[str, np.ndarray]]:
    """The per-token arrays of the batch's `rows` (`BATCH_FIELDS` that are set), cut to each row's real tokens:
    one device-to-host copy per field."""
    if not rows:
        return []
    index = torch.tensor(rows, device=batch.input_ids.device)
    lengths = batch.attention_mask[index].sum(-1).tolist()
    fields = {name: getattr(batch, f) for name, f in BATCH_FIELDS.items() if getattr(batch, f) is not None}
    host = {name: (t[index] if not t.is_floating_point() else t[index].float()).cpu().numpy()
            for name, t in fields.items()}
    return [{name: a[r, :n] for name, a in host.items()} for r, n in enumerate(lengths)]


def sample_arrays(sample: Sample) -> dict[str, list]:
    """A played sample's per-token values (an evaluation's: no trainer values)."""
    return {"ids": sample.ids, "loss_mask": sample.loss_mask(), "rollout_logprobs": sample.logprobs,
            "rewards": sample.rewards if sample.rewards is not None else [0.0] * len(sample)}


def sample_record(sample: Sample, arrays: dict[str, Any], tokenizer) -> dict:
    """One training sequence: its segments (from the sample), each token's text, its per-token arrays."""
    ids = [int(i) for i in arrays["ids"]]
    return {"trainable": sample.trainable, "segments": [[int(s.kind), s.turn, s.start, s.end] for s in sample.segments],
            "pieces": token_pieces(ids, tokenizer), "tokens": encode_tokens(arrays)}


def turn_records(episode: EpisodeRecord, version: int) -> list[dict]:
    """The episode's turns: where each one's sampled tokens are, its text and finish reason, the weights that
    sampled it, its tool calls and what answered them (the tool messages joined with the env's tool results)."""
    spans = {seg.turn: (i, seg) for i, s in enumerate(episode.samples) for seg in s.segments
             if seg.kind == Seg.SAMPLED}
    results = {r.get("call_id"): r for r in episode.tool_results}
    prompt = episode.samples[0].n_messages if episode.samples else len(episode.messages)
    turns: list[dict] = []
    for message in episode.messages[prompt:]:
        if message.get("role") == "assistant":
            t = len(turns)
            sample, seg = spans.get(t, (None, None))
            calls = [{"id": c.get("id"), "name": c["function"].get("name"), "arguments": c["function"].get("arguments")}
                     for c in message.get("tool_calls") or ()]
            turns.append({
                "index": t, "sample": sample, "start": seg.start if seg else None, "end": seg.end if seg else None,
                "text": seg.text if seg else message.get("content"),
                "finish_reason": episode.finish_reasons[t] if t < len(episode.finish_reasons) else None,
                "policy_version": version, "tool_calls": calls, "observation": []})
        elif turns:
            turns[-1]["observation"].append(_observation(message, results))
    return turns


def _observation(message: dict, results: dict[str, dict]) -> dict:
    result = results.get(message.get("tool_call_id"), {})
    return {"role": message.get("role"), "name": message.get("name"), "call_id": message.get("tool_call_id"),
            "content": message.get("content"), "error": result.get("error"), "error_kind": result.get("error_kind"),
            "duration_s": _number(result.get("duration_s")), "reward": _number(result.get("reward"))}


def task_id(task: dict) -> str:
    """The task's ``sample_id`` (top level or under ``extra_info``), else a digest of its prompt messages."""
    for where in (task, task.get("extra_info") or {}):
        if where.get("sample_id") is not None:
            return str(where["sample_id"])
    prompt = json.dumps(task.get("prompt", task.get("messages")), sort_keys=True, default=str)
    return "task-" + hashlib.blake2b(prompt.encode(), digest_size=5).hexdigest()


def _question(episode: EpisodeRecord) -> str | None:
    """The content of the prompt's last user message: what the episode was asked."""
    prompt = episode.messages[:episode.samples[0].n_messages] if episode.samples else episode.messages
    users = [m.get("content") for m in prompt if m.get("role") == "user"]
    return str(users[-1]) if users else None


def _rows_by_episode(batch: TrainBatch) -> dict[int, list[int]]:
    rows: dict[int, list[int]] = {}
    for row, k in enumerate(batch.episode.tolist()):
        rows.setdefault(k, []).append(row)
    return rows


def _number(x: Any) -> Any:
    """A JSON-safe scalar: non-finite floats as None, numbers as Python numbers."""
    if isinstance(x, (bool, str)) or x is None:
        return x
    if isinstance(x, (int, float, np.number)):
        x = float(x) if not isinstance(x, int) else x
        return x if not isinstance(x, float) or math.isfinite(x) else None
    return x
