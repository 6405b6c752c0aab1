"""The run directory and its checkpoints: what running a command again does, atomic saves, and resuming from the
newest *complete* checkpoint.

A run directory (``output_dir``) holds::

    config.json                the resolved config of the run
    metrics.jsonl              a row per step and per evaluation (trainers/tracking.py)
    checkpoints/
      checkpoint_<step>/       a complete checkpoint: accelerate's state (model.safetensors, optimizer.bin, RNG
                               and task-stream states, ...), hf/ (the model's config.json and the tokenizer: what
                               trainers/export.py needs) and checkpoint.json, written last; one taken during the
                               SFT warm start (always checkpoint_0) also holds sft_state_<process>.pt, SFT's own
                               state (trainers/sft.py)
      .checkpoint_<step>.tmp/  a save in progress, or one killed half-way: never resumed from

**Saves are atomic.** Everything is written into the ``.tmp`` directory, then `checkpoint.json` (the run's
progress, `RunState`, and the size of every file), and only then is the directory renamed to ``checkpoint_<step>``
(replacing one of that name: the SFT warm start saves ``checkpoint_0`` more than once).
A checkpoint is complete when its name has no ``.tmp`` and every file its manifest lists is there with its size.
Only complete checkpoints are resumed from and counted by ``trainer.keep_last``.

**Running a command again** (`plan_run`, ``trainer.resume``: ``auto``, a checkpoint path, or ``null``) starts a
run, says a finished one is finished, resumes an unfinished one from its newest complete checkpoint (changing only
`RESUMABLE` settings), or refuses, naming why: the cases in docs/trainer_config.md ("The run directory").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from .config import Config, ConfigError
from .lora import is_adapter
from mt_env.trajectories import read_metrics

MANIFEST = "checkpoint.json"
SFT_STATE = "sft_state_{}.pt"  #: SFT's own state in a checkpoint taken during SFT, one file per process
HF_DIR = "hf"  #: inside a checkpoint: the model's config.json and the tokenizer files
_NAME = re.compile(r"^(\.?)checkpoint_(\d+)(\.tmp)?$")

#: settings a resumed run may change (prefixes of dotted keys); anything else must equal the run's
RESUMABLE = ("trainer.total_steps", "trainer.time_limit_s", "trainer.resume", "trainer.eval_every",
             "trainer.save_every", "trainer.keep_last", "trainer.profile_step", "sft.save_every", "sft.time_limit_s",
             "threads", "device",
             "logging.", "rollout.max_batch_size",
             "rollout.server_urls", "rollout.engine_kwargs", "rollout.backend")


class RunDirError(ConfigError):
    """output_dir cannot be used as asked; the message names the setting that fixes it."""


@dataclass
class RunState:
    """The run's progress, saved in each checkpoint's manifest: the RL step, the SFT warm start's, the wall time of
    the whole run, the first and latest held-out evaluations (the first is the "before RL" figure, whatever resumes
    came after) and how many metrics rows had been logged."""

    step: int = 0
    prior_s: float = 0.0  #: wall time of the sessions before this one
    first_eval: dict | None = None
    last_eval: dict | None = None
    sft_steps: int = 0  #: SFT steps done
    sft_done: bool = False  #: SFT is over (or the run has none): a resume goes on with RL
    metrics_rows: int | None = None  #: rows of metrics.jsonl when this state was saved (None: not known)
    _session_start: float = field(default_factory=time.perf_counter, repr=False, compare=False)

    def elapsed(self) -> float:
        """Seconds of the whole run so far: the earlier sessions plus this one."""
        return self.prior_s + time.perf_counter() - self._session_start

    def record_eval(self, metrics: dict) -> None:
        if self.first_eval is None:
            self.first_eval = metrics
        self.last_eval = metrics

    def to_json(self) -> dict:
        return {"step": self.step, "elapsed_s": self.elapsed(), "first_eval": self.first_eval,
                "last_eval": self.last_eval, "sft_steps": self.sft_steps, "sft_done": self.sft_done,
                "metrics_rows": self.metrics_rows}

    @classmethod
    def from_json(cls, data: dict) -> RunState:
        """A manifest's state; one written before SFT could be checkpointed was written after it (SFT done)."""
        return cls(step=int(data["step"]), prior_s=float(data["elapsed_s"]), first_eval=data.get("first_eval"),
                   last_eval=data.get("last_eval"), sft_steps=int(data.get("sft_steps", 0)),
                   sft_done=bool(data.get("sft_done", True)), metrics_rows=data.get("metrics_rows"))

    def progress(self) -> dict:
        """Everything but the clock: a save of the same progress writes nothing."""
        return {k: v for k, v in self.to_json().items() if k not in ("elapsed_s", "metrics_rows")}

    def where(self) -> str:
        return f"step {self.step}" if self.sft_done else f"SFT step {self.sft_steps}"

    def summary(self) -> dict:
        return {"steps": self.step, "elapsed_s": self.elapsed(),
                "start_val_success": (self.first_eval or {}).get("val/success"),
                "final_val_success": (self.last_eval or {}).get("val/success")}


# ================================================================================================== finding
@dataclass
class Found:
    """A checkpoint directory, with why it cannot be resumed from (`problem`), or None when complete."""

    path: Path
    step: int
    problem: str | None


def problem(path: Path) -> str | None:
    """Why the checkpoint directory `path` is not complete, or None."""
    if path.name.endswith(".tmp"):
        return "its save did not finish"
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (its save did not finish, or an older trainer wrote it)"
    except (ValueError, KeyError):
        return f"{MANIFEST} is unreadable"
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, not {size}"
    return None


def scan(run_dir: Path) -> list[Found]:
    """Every checkpoint directory of a run, complete or not, oldest step first."""
    root = Path(run_dir) / "checkpoints"
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        m = _NAME.match(path.name)
        if m and path.is_dir() and bool(m[1]) == bool(m[3]):  # checkpoint_<step> or .checkpoint_<step>.tmp
            found.append(Found(path, int(m[2]), problem(path)))
    return sorted(found, key=lambda f: (f.step, f.problem is None))


def complete_checkpoints(found: list[Found]) -> list[Path]:
    """The complete checkpoints of a `scan`, oldest step first. The last is the run's newest complete checkpoint:
    the one a run resumes from and the one its run directory stands for (`resolve`); the last ``keep_last`` are
    the ones pruning keeps."""
    return [f.path for f in found if f.problem is None]


def read_state(checkpoint: Path) -> RunState:
    return RunState.from_json(json.loads((checkpoint / MANIFEST).read_text())["state"])


def resolve(path: str | Path) -> Path:
    """A complete checkpoint from a checkpoint directory or a run directory (then its newest complete one)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint or run directory at {path}")
    if _NAME.match(path.name):
        why = problem(path)
        if why:
            raise FileNotFoundError(f"{path} is not a complete checkpoint: {why}")
        return path
    complete = complete_checkpoints(scan(path))
    if not complete:
        raise FileNotFoundError(f"{path}: no complete checkpoint in {path / 'checkpoints'}")
    return complete[-1]


def policy_state_dict(checkpoint: Path) -> dict:
    """The policy LM's weights in a checkpoint, keyed as the Hugging Face model names them (accelerate saves the
    `PolicyModel`, i.e. ``lm.``-prefixed keys, ``module.lm.`` from a DDP-wrapped model). An FSDP run's checkpoint
    holds them as one file (full state dict) or as shards (torch.distributed.checkpoint), merged here."""
    import torch

    if (checkpoint / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(str(checkpoint / "model.safetensors"))
    elif (checkpoint / "pytorch_model.bin").is_file():
        state = torch.load(checkpoint / "pytorch_model.bin", map_location="cpu")
    elif (checkpoint / "pytorch_model_fsdp.bin").is_file():
        state = torch.load(checkpoint / "pytorch_model_fsdp.bin", map_location="cpu")
    elif (checkpoint / "pytorch_model_fsdp_0").is_dir():
        state = _merged_shards(checkpoint / "pytorch_model_fsdp_0")["model"]
    else:
        raise FileNotFoundError(f"no model weights (model.safetensors, or an FSDP run's pytorch_model_fsdp*) in "
                                f"{checkpoint}")
    state = {k.removeprefix("module."): v for k, v in state.items()}
    return {k.removeprefix("lm."): v for k, v in state.items() if k.startswith("lm.")}


def load_policy_weights(lm, checkpoint: Path, model_from: str, state: dict | None = None) -> None:
    """Load the policy's weights of `checkpoint` into `lm`, a Hugging Face model built from `model_from` (named in
    the error): every key must match, except the output layer of a model that ties it to the embeddings (saved once,
    as the embeddings; and the frozen base of a LoRA run, whose checkpoints hold the adapters alone: `lm` must have
    them, and the base it was built with stays). `state`: the checkpoint's `policy_state_dict`, when the caller has
    read it already."""
    state = policy_state_dict(checkpoint) if state is None else state
    embedding = lm.get_input_embeddings()
    embed = next(n for n, p in lm.named_parameters(remove_duplicate=False) if p is embedding.weight)
    if lm.config.tie_word_embeddings and "lm_head.weight" in state:  # loaded, it would overwrite the embeddings
        if embed in state and not state["lm_head.weight"].equal(state[embed]):
            raise RuntimeError(f"{checkpoint} has an output layer of its own; {model_from} ties it to the "
                               f"embeddings")
    rows = embedding.num_embeddings
    if embed in state and len(state[embed]) != rows:  # e.g. a random-init run from before its preset's vocabulary
        raise RuntimeError(f"{checkpoint} has an embedding of {len(state[embed])} rows but {model_from} builds "
                           f"{rows}: build it with --set model.config.vocab_size={len(state[embed])}")
    missing, unexpected = lm.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if lm.config.tie_word_embeddings else set()
    if any(is_adapter(k) for k in state):  # a LoRA run's checkpoint: its adapters, on the base `lm` was built with
        tied |= {n for n, _ in lm.named_parameters() if not is_adapter(n)}
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"{checkpoint} does not match {model_from}: missing {sorted(set(missing) - tied)[:5]}, "
                           f"unexpected {unexpected[:5]}")


def _merged_shards(directory: Path) -> dict:
    """A torch.distributed.checkpoint directory (what accelerate writes for FSDP's sharded state) as one state
    dict, in this process."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(directory, Path(tmp) / "merged.pt")
        return torch.load(Path(tmp) / "merged.pt", map_location="cpu")


# ================================================================================================== the run plan
@dataclass
class RunPlan:
    """What this command does with its output_dir: a new run, a resume from `checkpoint`, or nothing (`finished`)."""

    out: Path
    state: RunState
    checkpoint: Path | None = None
    finished: bool = False
    notes: list[str] = field(default_factory=list)  #: what was decided and why, for the log


def plan_run(cfg: Config) -> RunPlan:
    """Decide from the files alone (no process writes anything here): see the module docstring."""
    out = Path(cfg.output_dir)
    found = scan(out)
    complete = complete_checkpoints(found)
    skipped = [f"skipped {f.path}: {f.problem}" for f in found if f.problem]
    resume = cfg.trainer.resume
    if resume not in (None, "auto"):
        checkpoint = _checked_path(Path(resume), out, complete)
    elif not _holds_run(out, complete):
        return RunPlan(out, RunState())
    elif resume is None:
        raise RunDirError(f"{out} already holds a run and trainer.resume is null: resume it with --set "
                          f"trainer.resume=auto, or start a new run with --set output_dir={_free_name(out)}")
    elif not complete:
        raise RunDirError(f"{out} holds a run that logged RL steps but has no complete checkpoint to resume from"
                          f"{' (' + '; '.join(skipped) + ')' if skipped else ''}; starting over would replace its "
                          f"metrics: start a new run with --set output_dir={_free_name(out)} (or delete {out})")
    else:
        checkpoint = complete[-1]
    if checkpoint.resolve().parent.parent == out.resolve():
        _check_same_settings(cfg, out)
    state = read_state(checkpoint)
    if state.step >= cfg.trainer.total_steps:
        return RunPlan(out, state, checkpoint, finished=True, notes=[
            f"{out} already holds a finished run: {state.step} steps (trainer.total_steps={cfg.trainer.total_steps}),"
            f" held-out success {_pct(state.summary()['start_val_success'])} (before RL) -> "
            f"{_pct(state.summary()['final_val_success'])}. Nothing to do: raise trainer.total_steps to train it "
            f"further, or start a new run with --set output_dir={_free_name(out)}"])
    return RunPlan(out, state, checkpoint, notes=[*skipped, f"resuming from {checkpoint} ({state.where()})"])


def _checked_path(checkpoint: Path, out: Path, complete: list[Path]) -> Path:
    """An explicit trainer.resume path: a complete checkpoint of this run (its newest), or a fork into a new dir."""
    why = problem(checkpoint) if checkpoint.is_dir() else "no such directory"
    if why:
        raise RunDirError(f"trainer.resume={checkpoint} is not a complete checkpoint: {why}")
    own = checkpoint.resolve().parent.parent == out.resolve()
    if own and not any(checkpoint.resolve() == c.resolve() for c in complete):
        raise RunDirError(f"trainer.resume={checkpoint} is inside {out} but not one of its checkpoints (named "
                          f"checkpoint_<step>): fork it with --set output_dir={_free_name(out)}")
    if own and checkpoint.resolve() != complete[-1].resolve():
        raise RunDirError(f"trainer.resume={checkpoint} is older than {out}'s newest checkpoint {complete[-1]}: "
                          f"continuing from it here would mix two histories; fork it with "
                          f"--set output_dir={_free_name(out)}")
    if not own and _holds_run(out, complete):
        raise RunDirError(f"{out} holds another run: resuming {checkpoint} there would mix two runs; choose a new "
                          f"directory with --set output_dir={_free_name(out)}")
    return checkpoint


def _holds_run(out: Path, complete: list[Path]) -> bool:
    """A run worth keeping: a complete checkpoint, or metrics of RL steps. What comes before the first RL step (the
    SFT warm start, the first evaluation) is computed again, identically, by starting over."""
    if complete:
        return True
    metrics = out / "metrics.jsonl"
    return metrics.is_file() and any(row["step"] > 0 for row in read_metrics(metrics))


def _check_same_settings(cfg: Config, out: Path) -> None:
    path = out / "config.json"
    if not path.is_file():
        return
    before, now = _flat(json.loads(path.read_text())), _flat(cfg.to_dict())
    changed = [f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in sorted(before.keys() | now.keys())
               if before.get(k) != now.get(k) and not k.startswith(RESUMABLE)]
    if changed:
        raise RunDirError(f"{out} holds a run with other settings ({'; '.join(changed[:5])}): resume it with its own "
                          f"settings, or start a new run with --set output_dir={_free_name(out)}")


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _free_name(out: Path) -> str:
    k = 2
    while Path(f"{out}-{k}").exists():
        k += 1
    return f"{out}-{k}"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


# ================================================================================================== saving
class Checkpointer:
    """Saves the run's checkpoints atomically and keeps the newest `keep_last` complete ones.

    Every process takes part in accelerate's `save_state` (each writes its RNG state, and its `sft_state`); the
    main process writes the Hugging Face files and the manifest, renames the directory and prunes. `tracker`: the
    run's, whose rows the manifest counts (`RunState.metrics_rows`)."""

    def __init__(self, accelerator, plan: RunPlan, keep_last: int, lm, tokenizer, tracker=None):
        self.accelerator = accelerator
        self.dir = plan.out / "checkpoints"
        self.keep_last = keep_last
        self.lm = lm
        self.tokenizer = tokenizer
        self.tracker = tracker
        self.saved = plan.state.progress() if plan.checkpoint is not None else None

    def save(self, state: RunState, sft_state: dict | None = None) -> Path:
        """Checkpoint `state` as ``checkpoint_<state.step>`` (nothing is written if that progress is saved already),
        with this process's `sft_state` (`read_sft_state`) when SFT is unfinished; returns its directory."""
        final = self.dir / f"checkpoint_{state.step}"
        if state.progress() == self.saved:
            return final
        acc = self.accelerator
        tmp = self.dir / f".checkpoint_{state.step}.tmp"
        if acc.is_main_process:
            for stale in self.dir.glob(".checkpoint_*.tmp"):  # saves that were killed
                shutil.rmtree(stale)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        if sft_state is not None:
            import torch

            torch.save(sft_state, tmp / SFT_STATE.format(acc.process_index))
        acc.wait_for_everyone()
        if acc.is_main_process:
            self.lm.config.save_pretrained(tmp / HF_DIR)
            self.lm.generation_config.save_pretrained(tmp / HF_DIR)
            self.tokenizer.save_pretrained(tmp / HF_DIR)
            _write_manifest(tmp, state, len(self.tracker.history) if self.tracker is not None else None)
            _publish(tmp, final)
            for old in complete_checkpoints(scan(self.dir.parent))[:-self.keep_last]:
                shutil.rmtree(old)
        acc.wait_for_everyone()
        self.saved = state.progress()
        return final


def read_sft_state(checkpoint: Path, process_index: int) -> dict:
    """What `Checkpointer.save` stored as `sft_state` for process `process_index` in `checkpoint`."""
    import torch

    path = checkpoint / SFT_STATE.format(process_index)
    if not path.is_file():
        raise RunDirError(f"{checkpoint} was saved during SFT by fewer processes than this run has: it holds no "
                          f"{path.name}; resume it with the number of processes that saved it")
    return torch.load(path, map_location="cpu", weights_only=True)


def _write_manifest(tmp: Path, state: RunState, metrics_rows: int | None) -> None:
    """The manifest, written last: the run's progress (with the number of metrics rows logged so far) and every
    file's size, each file flushed to disk first."""
    files = {}
    for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
        with f.open("rb") as handle:
            os.fsync(handle.fileno())
        files[str(f.relative_to(tmp))] = f.stat().st_size
    with (tmp / MANIFEST).open("w", encoding="utf-8") as handle:
        json.dump({"state": state.to_json() | {"metrics_rows": metrics_rows}, "files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished save to its final name (an incomplete directory of that name is replaced)."""
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
