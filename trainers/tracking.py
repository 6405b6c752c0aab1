"""Metrics out of the trainer: a console line per step, ``metrics.jsonl``, optional TensorBoard / W&B, and the
reward / success curve PNG at the end of a run.

A resumed run's ``metrics.jsonl`` reads as one run: the rows logged after the checkpoint it resumes from (steps that
run again; SFT's row and the first evaluation, when SFT or that evaluation runs again) are dropped, and ``time_s``
is the run's clock (`RunState.elapsed`), which continues across sessions."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mt_env.trajectories import read_metrics

#: metric -> short label for the console line, in display order
CONSOLE = {
    "rollout/success_rate": "success", "rollout/reward_mean": "reward", "val/success": "val_success",
    "actor/loss": "pg_loss", "actor/kl_ref": "kl", "actor/entropy": "entropy", "actor/clip_frac": "clip",
    "actor/grad_norm": "grad", "rollout/turns_mean": "turns", "rollout/tool_call_rate": "tool_rate",
    "rollout/response_len_mean": "resp_len", "perf/step_s": "step_s",
}


def show_progress() -> None:
    """Print the engine's progress lines (``agents.progress``: each compilation and CUDA graph capture of a long
    first step) with their time, once per process."""
    logger = logging.getLogger("agents.progress")
    if any(getattr(h, "_mt_env", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("  [engine %(asctime)s] %(message)s", datefmt="%H:%M:%S"))
    handler._mt_env = True
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


class Tracker:
    def __init__(self, output_dir: str | Path, config: dict, enabled: bool = True, jsonl: bool = True,
                 tensorboard: bool = False, wandb: bool = False, wandb_project: str = "mt_env",
                 resume_step: int | None = None, clock: Callable[[], float] | None = None,
                 resume_rows: int | None = None):
        """`resume_step`: continue the metrics of a run resumed from that step's checkpoint (None: a new run), which
        had logged `resume_rows` rows when it was saved (None: all those of steps up to `resume_step`).
        `clock`: seconds since the run started (default: since this tracker was made)."""
        self.dir = Path(output_dir)
        self.enabled = enabled
        self.history: list[dict] = []
        self._jsonl = None
        self._tb = None
        self._wandb = None
        start = time.perf_counter()
        self.clock = clock or (lambda: time.perf_counter() - start)
        if not enabled:
            return
        show_progress()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        if jsonl:
            path = self.dir / "metrics.jsonl"
            if resume_step is not None and path.is_file():
                self.history = _keep_up_to(path, resume_step, resume_rows)
            self._jsonl = path.open("a" if resume_step is not None else "w", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        if wandb:
            import wandb as wb

            self._wandb = wb.init(project=wandb_project, config=config, dir=str(self.dir), resume="allow")

    def log(self, step: int, metrics: dict[str, Any], console: bool = True) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time_s": round(self.clock(), 2),
               **{k: _clean(v) for k, v in metrics.items()}}
        self.history.append(row)
        if self._jsonl:
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if self._tb:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, step)
        if self._wandb:
            self._wandb.log(row, step=step)
        if console:
            parts = [f"step {step:>4}"] + [f"{label} {_fmt(row[k])}" for k, label in CONSOLE.items() if k in row]
            print(" | ".join(parts), flush=True)

    def message(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def plot(self, title: str = "") -> Path | None:
        """Success, tool-use and reward curves (training rollouts, and held-out evaluation where logged) as a PNG."""
        if not self.enabled or not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for ax, keys, name in ((axes[0], ("rollout/success_rate", "val/success"), "success rate"),
                               (axes[1], ("rollout/tool_call_rate", "val/tool_call_rate"), "episodes calling a tool"),
                               (axes[2], ("rollout/reward_mean", "val/reward"), "reward")):
            for key in keys:
                pts = [(r["step"], r[key]) for r in self.history if key in r]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, marker="o" if key.startswith("val") else None, ms=4,
                            label="held-out eval" if key.startswith("val") else "training rollouts")
            ax.set_xlabel("RL step")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
            ax.legend()
        axes[0].set_ylim(-0.02, 1.02)
        axes[1].set_ylim(-0.02, 1.02)
        fig.suptitle(title)
        fig.tight_layout()
        path = self.dir / "curves.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()


def _keep_up_to(path: Path, step: int, count: int | None = None) -> list[dict]:
    """Rewrite `path` (atomically) without the rows of steps after `step`, and beyond the first `count` rows, which
    the resumed run logs again."""
    rows = read_metrics(path)
    kept = [r for r in rows if r["step"] <= step][:count]
    if len(kept) < len(rows):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, path)
        kept_ids = {id(r) for r in kept}
        dropped = sorted({r["step"] for r in rows if id(r) not in kept_ids})
        print(f"metrics.jsonl: dropped {len(rows) - len(kept)} rows of steps {dropped[0]}-{dropped[-1]}, logged "
              f"after the checkpoint of step {step} (they run again)", flush=True)
    return kept


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)
