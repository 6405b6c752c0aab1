"""A benchmark's result as a record: one current JSON and log per benchmark and machine, under a fixed name.

``benchmarks/results/<machine>/<bench>.json`` holds the figures with the command that made them, the commit
(``git rev-parse HEAD``, and ``dirty``: whether tracked files outside the results differed from it), the device
and the machine's load average when the run started; ``<bench>.txt`` beside it is what the run printed.
``<machine>`` is ``cpu`` or the GPU's short name with the number of GPUs used (``h200``, ``h200x2``). A rerun
overwrites both files; git history keeps the old ones.

    ap = argparse.ArgumentParser()
    record.add_arguments(ap)                                    # --out (default: the fixed name), --machine
    args = ap.parse_args()
    rec = record.start(args, "rollout", device="cuda")         # from here on, what is printed also goes to the .txt
    rec.write({"tok_s": 1234.5})                                # the .json: command, commit, dirty, device, figures

``$MT_ENV_RESULTS`` moves the results folder (``benchmarks/run_gpu.sh`` points it at the machine's output folder);
``$MT_ENV_COMMIT`` (``<sha>`` or ``<sha>-dirty``) names the commit where the checkout has no git metadata.
As a command, it records any other command's output under a fixed name (the CUDA test log):

    python benchmarks/record.py cuda_tests --device cuda -- python -m pytest tests/test_engine.py
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROVENANCE = ("command", "commit", "dirty", "device", "load_average")


def results_root() -> Path:
    return Path(os.environ.get("MT_ENV_RESULTS") or RESULTS)


def command(argv: list[str] | None = None) -> str:
    """The command line as typed from the repository's root: ``python3 benchmarks/x.py --flag ...``."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    if script.is_relative_to(ROOT):
        argv[0] = str(script.relative_to(ROOT))
    return shlex.join([Path(sys.executable).name, *argv])


def commit() -> tuple[str, bool | None]:
    """(sha, dirty) of the code that runs: ``$MT_ENV_COMMIT`` when set, else git; ``("unknown", None)`` without
    either (the record's check rejects it)."""
    given = os.environ.get("MT_ENV_COMMIT", "").strip()
    if given:
        sha, dirty = re.fullmatch(r"(.*?)(-dirty)?", given).groups()
        return sha, dirty is not None

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout

    try:
        sha = git("rev-parse", "HEAD").strip()
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    except (OSError, subprocess.CalledProcessError):
        return "unknown", None
    return sha, bool(changed.strip())


def gpu_names() -> list[str]:
    """The visible GPUs' names, without starting CUDA in this process (nvidia-smi; torch when it is missing)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        names = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True).stdout.split("\n")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = [n.strip() for n in names if n.strip()]
        if visible is not None and visible.replace(",", "").isdigit():
            names = [names[int(i)] for i in visible.split(",") if int(i) < len(names)]
        if names:
            return names
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    models = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M) if cpuinfo.is_file() else []
    return f"{models[0] if models else platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def load_average() -> float | None:
    """The machine's 1-minute load average (a shared machine's timings depend on it); None where unknown."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def device_name(device: str, gpus: int = 1) -> str:
    """``NVIDIA H200``, ``2 x NVIDIA H200`` or the CPU model with its core count."""
    if device.startswith("cpu"):
        return cpu_name()
    names = gpu_names()[:gpus] or ["no GPU found"]
    return names[0] if gpus == 1 else f"{gpus} x {names[0]}"


def machine_name(device: str, gpus: int = 1) -> str:
    """``cpu``, or the GPU's short name (its model, the first word after the vendor) with the number of GPUs used:
    ``h200``, ``h200x2``, ``h100`` for "NVIDIA H100 80GB HBM3"."""
    if device.startswith("cpu"):
        return "cpu"
    model = (re.sub(r"^nvidia\s*", "", device_name(device).lower()).split() or [""])[0]
    short = re.sub(r"[^a-z0-9]+", "", model) or "gpu"
    return short if gpus == 1 else f"{short}x{gpus}"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", help="the JSON's path (its log goes beside it, .txt); default "
                                  "benchmarks/results/<machine>/<bench>.json")
    ap.add_argument("--machine", help="the results folder's name (default: cpu, or the GPU's short name and count)")


class Record:
    """Where one run's figures and log go; its provenance, taken when it starts."""

    def __init__(self, json_path: Path, device: str, gpus: int = 1, argv: list[str] | None = None):
        self.json_path = Path(json_path)
        self.txt_path = self.json_path.with_suffix(".txt")
        sha, dirty = commit()
        self.provenance = dict(command=command(argv), commit=sha, dirty=dirty, device=device_name(device, gpus),
                               load_average=load_average())
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        self.written, self.log = False, None

    def header(self) -> str:
        dirty = " (with uncommitted changes)" if self.provenance["dirty"] else ""
        return (f"command: {self.provenance['command']}\ncommit: {self.provenance['commit']}{dirty}\n"
                f"device: {self.provenance['device']}; load average {self.provenance['load_average']} at the start\n")

    def tee(self) -> Record:
        """From now on, what this process prints also goes to the log. The log is written beside the record as
        ``<bench>.txt.partial`` and replaces ``<bench>.txt`` on `close` (at exit) only once `write` has run: a run
        that fails (bad arguments, a crash, a timeout) leaves the current record as it was."""
        self.partial_path = self.txt_path.with_name(self.txt_path.name + ".partial")
        self.log = self.partial_path.open("w", buffering=1)
        self.log.write(self.header() + "\n")
        sys.stdout, sys.stderr = _Tee(sys.stdout, self.log), _Tee(sys.stderr, self.log)
        atexit.register(self.close)
        return self

    def close(self) -> None:
        """End the log; it becomes ``<bench>.txt`` if the run wrote its JSON."""
        if self.log is not None and not self.log.closed:
            self.log.close()
            if self.written:
                os.replace(self.partial_path, self.txt_path)

    def write(self, figures: dict) -> Path:
        """The JSON: the provenance first, then the figures (a figure named like a provenance key is dropped)."""
        report = self.provenance | {k: v for k, v in figures.items() if k not in PROVENANCE}
        self.json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        self.written = True
        return self.json_path


class _Tee:
    """A text stream that writes to its stream and to a log."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        if not self.log.closed:
            self.log.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        if not self.log.closed:
            self.log.flush()
        self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)  # fileno, isatty, encoding, ...


def start(args: argparse.Namespace, bench: str, device: str = "cpu", gpus: int = 1, tee: bool = True) -> Record:
    """The record of this run: ``args.out`` or ``<results>/<machine>/<bench>.json``; its log started (``tee``)."""
    machine = getattr(args, "machine", None) or machine_name(device, gpus)
    path = Path(args.out) if getattr(args, "out", None) else results_root() / machine / f"{bench}.json"
    rec = Record(path, device, gpus)
    return rec.tee() if tee else rec


def main() -> int:
    """Run a command, its output to the console and to ``<results>/<machine>/<name>.txt`` under a header."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("name")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpus", type=int, default=1)
    add_arguments(ap)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, cmd = ap.parse_args(argv[:cut]), argv[cut + 1:]
    if not cmd:
        ap.error("no command after --")
    rec = start(args, args.name, args.device, args.gpus, tee=False)
    rec.provenance["command"] = shlex.join(cmd)
    with rec.txt_path.open("w", buffering=1) as log:  # line by line: a command cut by a timeout leaves its lines
        log.write(rec.header() + "\n")
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
