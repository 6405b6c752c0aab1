"""The viewer's files: ``index.html`` (page, curves and the episodes' summary table) and a script per step file."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import numpy as np

from ..render import CSS_CLASS, HTML_CSS, LEGEND
from ..sample import Seg
from ..trajectories import TOKEN_DTYPES, read_lines, read_metrics, recorded_steps

ASSETS = Path(__file__).resolve().parent / "assets"
#: the summary table's columns (one value per episode); `CATEGORIES` hold a code into a list of their values
COLUMNS = ("file", "pos", "step", "group", "index", "task", "prompt", "answer", "reward", "success", "turns", "calls",
           "errors", "finish", "state", "end", "tokens", "trained", "advantage", "mismatch")
CATEGORIES = ("finish", "state", "end")
TEXT_CHARS = 100  #: characters of the prompt and the last answer kept in the summary (the rest is in the step file)
#: curves shown when the run logged them (the page offers every other metric too)
CURVES = ("rollout/reward_mean", "rollout/success_rate", "val/success", "rollout/tool_call_rate", "actor/loss",
          "mismatch/logprob_abs_mean", "rollout/response_len_mean", "perf/step_s")


def build(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the viewer of `run_dir` to `out` (default ``run_dir/viewer``); returns the path of its index.html."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory {run_dir}")
    out = Path(out) if out is not None else run_dir / "viewer"
    (out / "data").mkdir(parents=True, exist_ok=True)
    files: list[str] = []
    table = SummaryTable()
    for kind, step, path in recorded_steps(run_dir):
        key = f"{kind}_{step:06d}"
        lines = read_lines(path)
        _write_step_script(out / "data" / f"{key}.js", key, lines, path)
        for pos, line in enumerate(lines):
            table.add(len(files), pos, json.loads(line))
        files.append(key)
    index = {
        "run": str(run_dir.resolve()), "files": files, "kinds": [f.split("_")[0] for f in files],
        "episodes": table.columns, "categories": table.categories, "metrics": metric_series(run_dir),
        "curves": list(CURVES), "segments": {int(k): CSS_CLASS[k] for k in Seg},
        "legend": {CSS_CLASS[k]: name for k, name in LEGEND.items()}, "sampled": int(Seg.SAMPLED),
        "dtypes": TOKEN_DTYPES,
    }
    page = (ASSETS / "index.html").read_text(encoding="utf-8")
    page = page.replace("/*TITLE*/", _html_text(run_dir.resolve().name))
    page = page.replace("/*CSS*/", HTML_CSS + (ASSETS / "viewer.css").read_text(encoding="utf-8"))
    page = page.replace("/*INDEX*/", _script_json(index))
    page = page.replace("/*SCRIPT*/", (ASSETS / "viewer.js").read_text(encoding="utf-8"))
    return _write_atomic(out / "index.html", page)


class SummaryTable:
    """The summary of every recorded episode, column by column (`COLUMNS`): what the table filters and sorts on."""

    def __init__(self):
        self.columns: dict[str, list] = {name: [] for name in COLUMNS}
        self.categories: dict[str, list[str]] = {name: [] for name in CATEGORIES}
        self._codes: dict[str, dict[str, int]] = {name: {} for name in CATEGORIES}

    def add(self, file: int, pos: int, record: dict) -> None:
        stats, turns = record.get("stats") or {}, record.get("turns") or []
        tokens = trained = 0
        advantage = mismatch = 0.0
        for sample in record.get("samples") or ():
            t = {name: _decode(sample["tokens"], name) for name in sample["tokens"]}
            mask = t["loss_mask"].astype(bool)
            tokens += len(t["ids"])
            trained += int(mask.sum())
            if "advantages" in t:
                advantage += float(t["advantages"][mask].sum())
            if "old_logprobs" in t and mask.any():
                mismatch = max(mismatch, float(np.abs(t["old_logprobs"] - t["rollout_logprobs"])[mask].max()))
        row = {
            "file": file, "pos": pos, "step": record["step"], "group": record["group"], "index": record["index"],
            "task": record.get("task_id") or "", "prompt": _cut(record.get("prompt")),
            "answer": _cut(turns[-1]["text"] if turns else record.get("error")), "reward": _sig(record["reward"]),
            "success": int(bool(record.get("success"))), "turns": len(turns), "calls": stats.get("tool_calls", 0),
            "errors": stats.get("tool_errors", 0), "finish": ",".join(sorted(set(record.get("finish_reasons", ())))),
            "state": record.get("state") or "", "end": record.get("end_reason") or record.get("error") or "",
            "tokens": tokens, "trained": trained, "advantage": _sig(advantage / max(trained, 1)),
            "mismatch": _sig(mismatch),
        }
        for name in COLUMNS:
            value = row[name]
            self.columns[name].append(self._code(name, value) if name in CATEGORIES else value)

    def _code(self, name: str, value: str) -> int:
        codes = self._codes[name]
        if value not in codes:
            codes[value] = len(codes)
            self.categories[name].append(value)
        return codes[value]


def metric_series(run_dir: Path) -> dict[str, list[list]]:
    """Every numeric metric of ``metrics.jsonl`` as its ``[steps, values]``."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    series: dict[str, list[list]] = {}
    for row in read_metrics(path):
        for key, value in row.items():
            if key not in ("step", "time_s") and isinstance(value, (int, float)) and not isinstance(value, bool):
                xs, ys = series.setdefault(key, [[], []])
                xs.append(row["step"])
                ys.append(_sig(value))
    return series


def _write_step_script(path: Path, key: str, lines: list[str], source: Path) -> None:
    """``MTV.put(key, [records])``: the step's records as they are stored (the page decodes the token arrays)."""
    if path.is_file() and path.stat().st_mtime >= source.stat().st_mtime:
        return
    _write_atomic(path, f"MTV.put({json.dumps(key)},[\n" + ",\n".join(lines) + "\n]);\n")


def _write_atomic(path: Path, text: str) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def _decode(tokens: dict[str, str], name: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(tokens[name]), dtype=TOKEN_DTYPES[name])


def _cut(text: str | None) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS - 1] + "\u2026"


def _sig(x, digits: int = 5):
    """`x` to `digits` significant digits (None stays None): the summary's numbers, shorter."""
    return None if x is None or not np.isfinite(x) else float(f"{float(x):.{digits}g}")


def _script_json(value) -> str:
    """JSON that can sit inside a ``<script>`` element (no ``</`` to end it early)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).replace("</", "<\\/")


def _html_text(text: str) -> str:
    import html

    return html.escape(text)
