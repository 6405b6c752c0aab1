"""How a training run stops before its last step, and how the project's commands exit.

* **Interrupts.** Inside `StopRequested`, the first SIGINT (Ctrl-C) or SIGTERM only raises a flag: the loop sees it
  at the next step boundary, where it saves a checkpoint, prints how to resume and exits with status 128 + the
  signal's number (130, 143). A second signal ends the process at once, with a line saying so and the same status:
  the newest complete checkpoint is then what a rerun continues from. Every process of a distributed run stops at
  the same step (`agreed`).
* **Leaving at once** (a second signal; an interrupt before training, outside `StopRequested`) is `os._exit`, not
  an exception unwinding to the interpreter's exit: that exit stops daemon threads where they are, and one inside
  torch (the embedded engine's worker, mid-forward) then aborts the process in C++ (``terminate called ...``,
  status 134) instead of exiting.
* **Steps that train nothing** — no trainable token (every prompt over the budget, every episode failed), or
  non-finite values that skip the update (a learning rate too high) — are skipped one by one, but `EmptySteps`
  stops the run with `NothingTrains`, naming the cause, after a few in a row.
* `entry_point` runs a command (the trainer's, evaluation, export, benchmarks): the project's own errors are one
  line, ``error: <message>``, on stderr (`mt_env.errors.report`; the traceback too with ``--debug`` or
  ``MT_ENV_DEBUG=1``) — a `ConfigError` (a setting, an argument, a run directory) with exit status 2, an
  `MtEnvError` (missing data, a tokenizer, a tool) or `NothingTrains` with 1 — and an interrupt before training
  began one line and 130; errors of other kinds (bugs, a user's own code) always show their traceback.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from mt_env.errors import MtEnvError, report

from .config import ConfigError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested:
    """A context manager that turns the first SIGINT/SIGTERM into a stop request (see the module docstring)."""

    def __init__(self, announce: bool = True):
        self.announce = announce  #: print the notice (the main process only, in a distributed run)
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopRequested:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            exit_now(128 + signum, f"\n{signal.Signals(signum).name} again: exiting now, without saving (the newest "
                                   f"complete checkpoint is where the same command continues)\n"
                     if self.announce else "")
        self.signum = signum
        if self.announce:  # os.write: a handler must not re-enter a print the main thread may be in
            os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint "
                        f"(send it again to abort at once, without saving)\n".encode())

    def agreed(self, accelerator) -> bool:
        """Whether any process was asked to stop; all processes call this at the same step boundary."""
        from .distributed import across_processes  # torch only where a run needs it

        self.signum = int(across_processes(accelerator, self.signum or 0, "max")) or None
        return self.signum is not None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum else None


def exit_now(status: int, message: str = "") -> None:
    """End the process at once with `status`, after `message` on stderr (see the module docstring). Safe in a signal
    handler: the message is one `os.write`, after the lines printed before it, and a flush that would re-enter a
    print under way is skipped."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (RuntimeError, OSError, ValueError):
            pass
    if message:
        os.write(2, message.encode())
    os._exit(status)


def resume_command(argv: list[str], resume: str | None) -> str:
    """The command that continues a run: the same arguments, with ``trainer.resume=auto`` unless already so, run
    by this interpreter (a venv's ``.venv/bin/python`` works without activating the venv)."""
    args: list[str] = []
    for a in argv:
        if a.startswith("trainer.resume=") and args[-1:] == ["--set"]:
            args.pop()
        elif not a.startswith("--set=trainer.resume="):
            args.append(a)
    if resume != "auto":
        args += ["--set", "trainer.resume=auto"]
    return shlex.join([shown_path(sys.executable), shown_path(Path(__file__).with_name("ppo.py")), *args])


def shown_path(path: str | Path) -> str:
    """`path` as a command line shows it: relative to the working directory when inside it, else absolute. Symbolic
    links are kept (a venv's python is one: resolved, it would be the base interpreter, without the venv)."""
    path = Path(os.path.abspath(path))
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


class NothingTrains(RuntimeError):
    """Several steps in a row trained nothing: the run would go on doing nothing."""


class EmptySteps:
    """Counts consecutive steps that trained nothing; the `limit`-th in a row raises `NothingTrains`."""

    def __init__(self, limit: int = 3):
        self.limit = limit
        self.first = self.last = None

    def add(self, step: int, metrics: dict, episodes: list) -> None:
        """Record that `step` had no trainable token; `metrics` are the step's (combined) rollout metrics."""
        self._count(step, lambda first: _cause(first, step, metrics, episodes))

    def updated(self, step: int, metrics: dict, lr: float) -> None:
        """Record `step`'s update (its combined metrics): one that skipped every optimizer step trained nothing."""
        if metrics["actor/skipped_updates"] == metrics["actor/mini_batches"]:
            self.add_non_finite(step, "every optimizer step had a non-finite loss or gradient", lr)

    def add_non_finite(self, step: int, what: str, lr: float) -> None:
        """Record that `step`'s update was skipped for non-finite values (`what`); `lr` is the learning rate."""
        self._count(step, lambda first: (
            f"steps {first}-{step} trained nothing: {what}, so their updates were skipped; the usual cause is a "
            f"learning rate too high for the model (trainer.lr={lr:g}): lower trainer.lr"))

    def _count(self, step: int, cause: Callable[[int], str]) -> None:
        if self.last != step - 1:
            self.first = step
        self.last = step
        if step - self.first + 1 >= self.limit:
            raise NothingTrains(cause(self.first))


def _cause(first: int, last: int, metrics: dict, episodes: list) -> str:
    skipped, failed = int(metrics.get("rollout/skipped", 0)), int(metrics.get("rollout/failed", 0))
    text = (f"steps {first}-{last} trained nothing: of {int(metrics.get('rollout/episodes', len(episodes)))} "
            f"episodes per step, {skipped} were skipped and {failed} failed")
    skip_errors = [e.error for e in episodes if (e.error or "").startswith("skipped")]
    fail_errors = [e.error for e in episodes if e.error and not e.error.startswith("skipped")]
    if skipped >= failed and skip_errors:
        return f"{text} ({skip_errors[0]}): raise env.budget.max_prompt_tokens (null: no limit)"
    if fail_errors:
        return f"{text} (e.g. {fail_errors[0]}): fix what fails (trainers/evaluate.py writes every episode's error)"
    return (f"{text}; the episodes sampled no trainable token: check rollout.max_new_tokens and "
            f"env.budget.max_response_tokens")


def entry_point(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> int:
    """Run a command's `main`; returns its exit status (see the module docstring)."""
    try:
        summary = main(argv)
    except (ConfigError, MtEnvError, NothingTrains) as e:
        report(e, argv)
        return 2 if isinstance(e, ConfigError) else 1
    except KeyboardInterrupt:
        exit_now(128 + signal.SIGINT, "\ninterrupted: nothing saved since the newest complete checkpoint (if any), "
                                      "which is where the same command continues\n")
    stopped = summary.get("stopped_by") if isinstance(summary, dict) else None
    return 128 + signal.Signals[stopped].value if stopped else 0
