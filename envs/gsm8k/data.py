"""GSM8K's data: its rows read from a jsonl/parquet file, a directory, ``$MT_ENV_GSM8K`` or the Hugging Face hub,
each made into a dataset row with per-sample ``tools_kwargs`` (the shape verl uses); and the CLI that writes them::

    python -m envs.gsm8k.data --prepare DIR --out rows.jsonl [--split test]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

from mt_env.errors import MtEnvError, debug_flag, report

from .tool import TOOL_NAME

SYSTEM_PROMPT = (
    "You are a careful math solver. Reason step by step, then check your answer with the `calc_gsm8k_reward` tool "
    "at least once before giving your final answer; refine it if the tool says it is wrong. "
    "Write the final answer as `#### <number>`."
)
INSTRUCTION = "Solve it step by step, check with the tool, and write the final answer after `####`."
DATA_ENV_VAR = "MT_ENV_GSM8K"


def make_row(question: str, answer: str, index: int, split: str = "train") -> dict:
    """A dataset row for one GSM8K problem: prompt messages plus the tool's per-sample kwargs (verl's shape)."""
    truth = answer.split("####")[-1].strip().replace(",", "")
    return {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                   {"role": "user", "content": f"{question.strip()}\n\n{INSTRUCTION}"}],
        "reward_model": {"ground_truth": truth},
        "extra_info": {
            "split": split, "index": index, "sample_id": f"gsm8k-{split}-{index}",
            "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": truth}}},
        },
    }


def load_rows(path: str | os.PathLike | None = None, split: str = "train") -> list[dict]:
    """Cached `read_rows`: every env of a vector or a rollout pool shares one copy of the data."""
    return _cached_rows(str(path or os.environ.get(DATA_ENV_VAR) or ""), split)


@functools.lru_cache(maxsize=8)
def _cached_rows(path: str, split: str) -> list[dict]:
    return read_rows(path or None, split)


def read_rows(path: str | os.PathLike | None = None, split: str = "train") -> list[dict]:
    """GSM8K rows from a jsonl/parquet file, a directory holding ``{split}.jsonl``, ``$MT_ENV_GSM8K``, or the
    Hugging Face hub (``openai/gsm8k``). Raw ``{question, answer}`` records are turned into rows with `make_row`;
    prepared rows (with ``prompt``) are used as they are."""
    path = path or os.environ.get(DATA_ENV_VAR)
    if path:
        p = Path(path)
        if p.is_dir():
            candidates = [p / f"{split}.jsonl", p / f"{split}.parquet"]
            p = next((c for c in candidates if c.is_file()), candidates[0])
        if not p.is_file():
            raise MtEnvError(f"GSM8K data not found at {p}: pass data_path= a jsonl/parquet file or a directory with "
                             f"{split}.jsonl (GSM8K's own format, or rows prepared with `python -m envs.gsm8k.data`)")
        if p.suffix == ".parquet":
            import pandas as pd

            records = pd.read_parquet(p).to_dict("records")
        else:
            with p.open(encoding="utf-8") as f:  # not str.splitlines(): U+2028 inside a string is not a line end
                records = [json.loads(line) for line in f if line.strip()]
    else:
        if os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1":
            raise MtEnvError(f"no GSM8K data and the Hugging Face hub is offline: pass data_path= (a jsonl/parquet "
                             f"file or a directory with {split}.jsonl) or set ${DATA_ENV_VAR}")
        try:
            from datasets import load_dataset

            records = list(load_dataset("openai/gsm8k", "main", split=split))
        except Exception as e:
            raise MtEnvError(
                "no GSM8K data: pass data_path= (a jsonl/parquet file or a directory with train.jsonl/test.jsonl), "
                f"set ${DATA_ENV_VAR}, or allow downloading openai/gsm8k from the Hugging Face hub ({e})"
            ) from e
    rows = [r if "prompt" in r else make_row(r["question"], r["answer"], i, split) for i, r in enumerate(records)]
    splits = {(r.get("extra_info") or {}).get("split") for r in rows}
    if split in splits:  # a prepared file that holds several splits: keep the one asked for
        rows = [r for r in rows if (r.get("extra_info") or {}).get("split") == split]
    elif splits - {None, split}:
        raise MtEnvError(f"the GSM8K rows at {path} are from split(s) {sorted(s for s in splits if s)}, not {split!r}: "
                         f"point data_path at the {split} data (e.g. env.eval_kwargs.data_path for evaluation)")
    if not rows:
        raise MtEnvError(f"the GSM8K {split} data at {path or 'openai/gsm8k'} is empty")
    return rows


def main(argv: list[str] | None = None) -> None:
    """``python -m envs.gsm8k.data --prepare DIR --out rows.jsonl`` (its errors as the project's commands show them:
    `mt_env.errors.report`)."""
    ap = argparse.ArgumentParser(description="Prepare GSM8K rows with per-sample tools_kwargs.")
    ap.add_argument("--prepare", required=True, help="directory with train.jsonl/test.jsonl, or one jsonl file")
    ap.add_argument("--split", default="train")
    ap.add_argument("--out", required=True, help="output .jsonl")
    debug_flag(ap)
    args = ap.parse_args(argv)
    rows = read_rows(args.prepare, args.split)
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    import sys

    try:
        main()
    except MtEnvError as error:
        report(error)
        sys.exit(1)
