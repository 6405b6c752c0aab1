"""The results are a record (benchmarks/record.py): every file in benchmarks/results/ is quoted by the README or a
docs page (a JSON's .txt log with it), every JSON says which command, commit and device made it, every link into the results resolves, and
the README's lines stay readable."""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import record

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_WIDTH = 200


def result_files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file())


def pages_text() -> str:
    return "\n".join(p.read_text() for p in PAGES)


def quoted(path: Path, text: str) -> bool:
    return f"results/{path.relative_to(RESULTS).as_posix()}" in text


def test_every_result_file_is_referenced_by_the_readme_or_a_docs_page():
    """Quoted by its path; a JSON's log (the .txt beside it) goes with the JSON."""
    text = pages_text()
    unreferenced = [str(p.relative_to(ROOT)) for p in result_files()
                    if not quoted(p, text) and not (p.suffix == ".txt" and quoted(p.with_suffix(".json"), text))]
    assert not unreferenced, (f"files in benchmarks/results/ that no README/docs page quotes (quote them, or delete "
                              f"them: git history keeps them): {unreferenced}")


@pytest.mark.parametrize("path", [p for p in result_files() if p.suffix == ".json"],
                         ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_every_result_json_records_command_commit_and_device(path):
    report = json.loads(path.read_text())
    missing = [k for k in ("command", "commit", "device") if not report.get(k)]
    assert not missing, f"{path.relative_to(ROOT)} lacks {missing} (benchmarks/record.py writes them)"
    assert re.fullmatch(r"[0-9a-f]{7,40}", report["commit"]), f"{path.relative_to(ROOT)}: commit {report['commit']!r}"


def test_every_link_into_the_results_resolves():
    dangling = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]*benchmarks/results/[^)#\s]*)", page.read_text()):
            if not (page.parent / target).resolve().exists():
                dangling.append(f"{page.relative_to(ROOT)}: {target}")
    assert not dangling, dangling


def test_readme_lines_are_at_most_200_characters():
    long = [(n, len(line)) for n, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1)
            if len(line) > README_WIDTH]
    assert not long, f"README.md lines over {README_WIDTH} characters (line, length): {long}"


# --------------------------------------------------------------------------------------------- the helper
def test_a_record_holds_the_provenance_first_and_the_log_what_was_printed(tmp_path, monkeypatch):
    monkeypatch.setenv("MT_ENV_RESULTS", str(tmp_path))
    monkeypatch.setenv("MT_ENV_COMMIT", "0123abc-dirty")
    console = io.StringIO()
    monkeypatch.setattr(sys, "stdout", console)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    args = argparse.Namespace(out=None, machine=None)
    rec = record.start(args, "demo", device="cpu")
    print("tokens/s 123")
    rec.write({"tok_s": 123.0, "command": "a figure may not replace the provenance"})
    sys.stdout.flush()

    assert rec.json_path == tmp_path / "cpu" / "demo.json"
    report = json.loads(rec.json_path.read_text())
    assert list(report)[:4] == ["command", "commit", "dirty", "device"]
    assert report["commit"] == "0123abc" and report["dirty"] is True and report["tok_s"] == 123.0
    assert report["command"].startswith(Path(sys.executable).name + " ")  # this run's command line, not the figure
    assert report["device"] == record.cpu_name()
    rec.close()
    log = rec.txt_path.read_text()
    assert log.startswith(f"command: {report['command']}\ncommit: 0123abc (with uncommitted changes)\n")
    assert "tokens/s 123" in log and "tokens/s 123" in console.getvalue()


def test_a_run_that_fails_before_its_json_leaves_the_current_record(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    args = argparse.Namespace(out=str(tmp_path / "run.json"), machine=None)
    (tmp_path / "run.txt").write_text("the current log\n")
    failed = record.start(args, "demo")
    print("error: bad arguments")
    failed.close()
    assert (tmp_path / "run.txt").read_text() == "the current log\n" and not (tmp_path / "run.json").exists()
    rerun = record.start(args, "demo")
    print("tokens/s 7")
    rerun.write({"tok_s": 7.0})
    rerun.close()
    assert "tokens/s 7" in (tmp_path / "run.txt").read_text() and not rerun.partial_path.exists()


def test_out_names_the_json_and_its_log_goes_beside_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    rec = record.start(argparse.Namespace(out=str(tmp_path / "x" / "run.json"), machine=None), "demo")
    assert rec.write({}) == tmp_path / "x" / "run.json" and rec.txt_path == tmp_path / "x" / "run.txt"


def test_machine_names_say_the_gpu_and_how_many(monkeypatch):
    monkeypatch.setattr(record, "gpu_names", lambda: ["NVIDIA H200", "NVIDIA H200"])
    assert record.machine_name("cuda") == "h200" and record.machine_name("cuda", gpus=2) == "h200x2"
    assert record.device_name("cuda", gpus=2) == "2 x NVIDIA H200"
    assert record.machine_name("cpu", gpus=2) == "cpu"
    monkeypatch.setattr(record, "gpu_names", lambda: ["NVIDIA H100 80GB HBM3"])
    assert record.machine_name("cuda") == "h100"


def test_the_commit_is_git_head_here():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode:
        pytest.skip("not a git checkout")
    assert record.commit()[0] == head.stdout.strip()


def test_as_a_command_it_records_another_commands_output_and_exit_status(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "record.py"), "tests_log", "--device", "cpu",
                           "--", sys.executable, "-c", "print('3 passed'); raise SystemExit(3)"],
                          capture_output=True, text=True, env={"MT_ENV_RESULTS": str(tmp_path), "PATH": ""})
    log = (tmp_path / "cpu" / "tests_log.txt").read_text()
    assert proc.returncode == 3 and "3 passed" in proc.stdout
    assert log.splitlines()[0].startswith("command: ") and log.splitlines()[-1] == "3 passed"
