"""Recorded trajectories: the episodes a run trained on (and evaluated), token by token, one file per step.

A run directory holds them under ``trajectories/``, one gzip-compressed JSON Lines file per recorded step and kind::

    trajectories/train_000001.jsonl.gz     # the episodes of training step 1 (a sample of them)
    trajectories/eval_000010.jsonl.gz      # episodes of the evaluation after step 10
    trajectories/evaluate_000100.jsonl.gz  # trainers/evaluate.py's episodes, of the checkpoint of step 100

Each file is written whole to a temporary name and renamed (`write_records`), so a run killed at any moment leaves
every file either complete or absent — the directory only grows, one readable file per step. `load_trajectories`
reads them back; `read_metrics` reads the run's ``metrics.jsonl`` (which the trainer writes).

One line is one episode (`FORMAT` 1): its step, kind, episode/group/index, task, reward, success, end, the env's
counts, its turns (text, finish reason, the weights that sampled it, tool calls and their observations) and its
training samples (segments, each token's text, and the per-token arrays of `TOKEN_DTYPES` as base64 little-endian
arrays, so float32 values round-trip exactly). Every field: docs/viewer.md ("The file format").
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

FORMAT = 1
DIRNAME = "trajectories"
KINDS = ("train", "eval", "evaluate")
#: per-token arrays of a recorded sample: name -> numpy dtype (little-endian)
TOKEN_DTYPES = {"ids": "<i4", "loss_mask": "u1", "rollout_logprobs": "<f4", "old_logprobs": "<f4",
                "ref_logprobs": "<f4", "values": "<f4", "advantages": "<f4", "returns": "<f4", "rewards": "<f4"}
_FILE = re.compile(r"^(?P<kind>[a-z]+)_(?P<step>\d+)\.jsonl\.gz$")


def encode_tokens(arrays: dict[str, np.ndarray | list]) -> dict[str, str]:
    """Per-token arrays (names of `TOKEN_DTYPES`) as base64 strings of their typed bytes."""
    out = {}
    for name, values in arrays.items():
        if name not in TOKEN_DTYPES:
            raise ValueError(f"unknown per-token array {name!r}; known: {', '.join(TOKEN_DTYPES)}")
        out[name] = base64.b64encode(np.asarray(values, dtype=TOKEN_DTYPES[name]).tobytes()).decode("ascii")
    return out


def decode_tokens(encoded: dict[str, str]) -> dict[str, np.ndarray]:
    """The inverse of `encode_tokens`."""
    return {name: np.frombuffer(base64.b64decode(text), dtype=TOKEN_DTYPES[name]) for name, text in encoded.items()}


def step_path(run_dir: str | Path, kind: str, step: int) -> Path:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return Path(run_dir) / DIRNAME / f"{kind}_{step:06d}.jsonl.gz"


def write_records(run_dir: str | Path, kind: str, step: int, records: Iterable[dict]) -> Path:
    """Write one step's episode records (JSON objects) atomically: to a temporary name, then renamed over the
    step's file. Returns its path."""
    path = step_path(run_dir, kind, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=6) as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def recorded_steps(run_dir: str | Path, kind: str | None = None) -> list[tuple[str, int, Path]]:
    """The complete step files of a run, as (kind, step, path), by kind then step (temporary files left by a killed
    run are not listed)."""
    folder = Path(run_dir) / DIRNAME
    found = []
    for path in folder.iterdir() if folder.is_dir() else ():
        m = _FILE.match(path.name)
        if m and m["kind"] in KINDS and (kind is None or m["kind"] == kind):
            found.append((m["kind"], int(m["step"]), path))
    return sorted(found, key=lambda x: (KINDS.index(x[0]), x[1]))


def read_lines(path: str | Path) -> list[str]:
    """The JSON lines of one step file, as text."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line for line in f.read().splitlines() if line]


def load_trajectories(run_dir: str | Path, step: int | None = None, kind: str = "train",
                      decode: bool = True) -> list[dict]:
    """The recorded episodes of `run_dir` (every recorded step, or only `step`), of one `kind`, in step order.
    With `decode`, each sample's ``tokens`` are numpy arrays (`decode_tokens`); else the base64 strings stored."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"no run directory {run_dir}")
    out = []
    for _, s, path in recorded_steps(run_dir, kind):
        if step is not None and s != step:
            continue
        for line in read_lines(path):
            record = json.loads(line)
            if decode:
                for sample in record["samples"]:
                    sample["tokens"] = decode_tokens(sample["tokens"])
            out.append(record)
    return out


def read_metrics(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``; a last line cut short (the process was killed while writing it) is left out."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    rows = []
    for k, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if k < len(lines) - 1 or line.endswith("\n"):
                raise ValueError(f"{path}, line {k + 1}: not a JSON row") from None
    return rows


def mismatch(sample: dict) -> np.ndarray | None:
    """A decoded sample's per-token rollout/trainer logprob mismatch (the trainer's old logprob minus the engine's,
    on trained tokens; 0 elsewhere), or None when the trainer's old logprobs were not recorded."""
    tokens = sample["tokens"]
    if "old_logprobs" not in tokens:
        return None
    return (tokens["old_logprobs"] - tokens["rollout_logprobs"]) * tokens["loss_mask"]


def remove_after(run_dir: str | Path, step: int) -> list[int]:
    """Delete the step files (both kinds) after `step`: a run resumed from that step's checkpoint records them again.
    Returns the steps removed."""
    removed = []
    for _, s, path in recorded_steps(run_dir):
        if s > step:
            path.unlink()
            removed.append(s)
    return removed
