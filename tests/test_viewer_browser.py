"""The trajectory viewer (mt_env/view) over a real tiny run, in a real browser: headless Chromium — Debian's
``chromium`` package, never a downloaded one — driven by Playwright. CI installs both (.ci/run); elsewhere the browser
tests skip, saying what to install (MT_ENV_REQUIRE_BROWSER=1 makes that a failure, as in CI)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mt_env import view
from mt_env.view.build import SummaryTable
from mt_env.trajectories import (decode_tokens, encode_tokens, load_trajectories, read_lines, recorded_steps,
                                 write_records)
from trainers.ppo import main as ppo_main

from .conftest import ROOT, subprocess_env
from .test_trainer import TINY

pytestmark = pytest.mark.xdist_group("viewer")
CHROMIUM = Path(os.environ.get("MT_ENV_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 2-step tiny run recording 6 episodes per step (3 GRPO groups of 2), old logprobs computed, and its viewer."""
    out = tmp_path_factory.mktemp("run")
    overrides = [*TINY, "trainer.minibatch_size=4", "logging.record_episodes=6", "eval.episodes=4"]
    ppo_main(["--set", f"output_dir={out}", "--set", "trainer.total_steps=2",
              *[a for o in overrides for a in ("--set", o)]])
    view.build(out)
    return out


@pytest.fixture(scope="module")
def browser(run):  # after the run: Playwright's synchronous API keeps an event loop running in this thread
    if not CHROMIUM.is_file():
        why = f"no Chromium at {CHROMIUM}: `apt-get install -y chromium` (Debian) runs the viewer's browser tests"
        if os.environ.get("MT_ENV_REQUIRE_BROWSER"):
            pytest.fail(why)
        pytest.skip(why)
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra: pip install "
                                                                 "-e '.[test]'")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, run):
    """The run's viewer, opened from file:// and ready; fails the test on any error in the page's script."""
    p = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.goto((run / "viewer" / "index.html").as_uri())
    p.wait_for_selector("body[data-ready='1']")
    yield p
    p.close()
    assert errors == []


def episodes(run: Path, decode: bool = False) -> list[dict]:
    """Every recorded episode of the run, in the table's order (train steps, then evaluations)."""
    return [r for kind in ("train", "eval") for r in load_trajectories(run, kind=kind, decode=decode)]


def row_count(page) -> int:
    return page.locator("#table tbody tr").count()


def test_the_table_lists_every_recorded_episode(page, run):
    recorded = episodes(run)
    assert len(recorded) == 2 * 6 + 2 * 4  # two training steps, the evaluations before and after
    assert row_count(page) == len(recorded)
    assert page.inner_text("#count") == f"({len(recorded)} of {len(recorded)})"
    cells = page.locator("#table tbody tr").first.locator("td")
    assert [cells.nth(k).inner_text() for k in range(4)] == ["train", "1", "0", "0"]
    assert page.locator("#curves .curve[data-metric='rollout/reward_mean']").count() == 1


def test_filters_select_the_episodes_they_name(page, run):
    recorded = episodes(run)
    page.select_option("select[name=kind]", "train")
    page.fill("input[name=stepMin]", "2")
    page.fill("input[name=stepMax]", "2")
    assert row_count(page) == sum(r["kind"] == "train" and r["step"] == 2 for r in recorded) == 6
    page.select_option("select[name=kind]", "")
    assert row_count(page) == sum(r["step"] == 2 for r in recorded)
    page.fill("input[name=stepMin]", "")
    page.fill("input[name=stepMax]", "")
    page.fill("input[name=turnsMin]", "2")
    assert row_count(page) == sum(len(r["turns"]) >= 2 for r in recorded)
    page.fill("input[name=turnsMin]", "")
    page.select_option("select[name=finish]", "length")
    assert row_count(page) == sum("length" in r["finish_reasons"] for r in recorded)
    page.select_option("select[name=finish]", "")
    page.select_option("select[name=errors]", "1")
    assert row_count(page) == sum(r["stats"]["tool_errors"] > 0 for r in recorded)
    page.select_option("select[name=errors]", "")
    task = recorded[0]["task_id"]
    page.fill("input[name=text]", task)
    assert row_count(page) == sum(r["task_id"] == task for r in recorded) >= 2


def test_full_text_search_reads_the_step_files(page, run):
    recorded = episodes(run)
    table = SummaryTable()
    for pos, r in enumerate(recorded):
        table.add(0, pos, r)
    word, columns = "<tool_response>", table.columns
    summary = ["\n".join([columns["task"][i], columns["prompt"][i], columns["answer"][i], r["end_reason"] or "",
                          r["state"]]) for i, r in enumerate(recorded)]
    full = [any(word in "".join(s["pieces"]) for s in r["samples"]) for r in recorded]
    page.fill("input[name=text]", word)
    assert row_count(page) == sum(word in text for text in summary)  # the summary's text, at once
    page.check("input[name=full]")  # every token: each step file is loaded
    page.wait_for_function("document.getElementById('search-progress').textContent.startsWith('searched')")
    assert row_count(page) == sum(a or word in b for a, b in zip(full, summary)) > sum(word in b for b in summary)
    assert sorted(page.evaluate("MTV.loadedFiles()")) == ["eval_000000", "eval_000002", "train_000001",
                                                          "train_000002"]


def test_an_episode_shows_its_tokens_and_what_trained(page, run, tmp_path):
    recorded = episodes(run)
    k = max(range(12), key=lambda i: len(recorded[i]["turns"]))  # a training episode with the most turns
    r = recorded[k]
    page.locator("#table tbody tr").nth(k).click()
    page.wait_for_selector("#episode .tokens span.t")
    tokens = [decode_tokens(s["tokens"]) for s in r["samples"]]  # as stored
    assert page.locator("#episode span.t").count() == sum(len(t["ids"]) for t in tokens)
    trained = sum(int(t["loss_mask"].sum()) for t in tokens)
    assert page.locator("#episode span.t.tr").count() == trained > 0  # the recorded loss mask, token for token
    assert page.locator("#episode span.t.sampled").count() >= trained
    answered = sum(bool(t["tool_calls"] or t["observation"]) for t in r["turns"])
    assert page.locator("#episode .tool").count() == answered
    page.locator("#episode span.t.tr").first.hover()
    tip = page.inner_text("#tip")
    assert "rollout logprob" in tip and "mismatch" in tip and "advantage" in tip
    for mode in ("mismatch", "advantage"):  # heat maps colour the trained tokens, grey the others
        page.check(f"input[name=mode][value={mode}]")
        assert page.locator("#episode span.t.tr[style]").count() == trained
        assert page.locator("#episode span.t.dim").count() == page.locator("#episode span.t").count() - trained
    shot = page.screenshot(path=str(tmp_path / "episode.png"), full_page=True)
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_group_side_by_side(page, run):
    recorded = episodes(run)
    page.locator("#table tbody tr").nth(2).click()
    page.wait_for_selector("#episode .tokens span.t")
    page.click("#group-button")
    r = recorded[2]
    members = [x for x in recorded if (x["kind"], x["step"], x["group"]) == (r["kind"], r["step"], r["group"])]
    assert page.locator("#group .member").count() == len(members) == 2


def test_step_files_load_only_when_needed(page, run):
    assert page.evaluate("MTV.loadedFiles()") == []
    assert page.locator("script[src^='data/']").count() == 0
    page.locator("#table tbody tr").nth(7).click()  # an episode of step 2
    page.wait_for_selector("#episode .tokens span.t")
    assert page.evaluate("MTV.loadedFiles()") == ["train_000002"]


def test_the_index_does_not_grow_with_tokens(run, tmp_path):
    """The same episodes with 4 times the tokens: the step scripts grow with them, the index page does not."""
    longer = tmp_path / "longer"
    for kind, step, path in recorded_steps(run):
        write_records(longer, kind, step, [lengthened(json.loads(line), 4) for line in read_lines(path)])
    shutil.copy(run / "metrics.jsonl", longer / "metrics.jsonl")
    index, long_index = view.build(run), view.build(longer)
    assert long_index.stat().st_size < 1.02 * index.stat().st_size
    for script in (run / "viewer" / "data").iterdir():
        assert (longer / "viewer" / "data" / script.name).stat().st_size > 3 * script.stat().st_size


def lengthened(record: dict, times: int) -> dict:
    """`record` with each sample's tokens repeated `times` times (segments, pieces and arrays alike)."""
    for s in record["samples"]:
        n = len(s["pieces"])
        s["segments"] = [[kind, turn, a + k * n, b + k * n] for k in range(times) for kind, turn, a, b in s["segments"]]
        s["pieces"] = s["pieces"] * times
        s["tokens"] = encode_tokens({name: np.tile(a, times) for name, a in decode_tokens(s["tokens"]).items()})
    return record


def test_the_command_builds_the_page_and_prints_its_path(run, tmp_path):
    cmd = [sys.executable, "-m", "mt_env.view", str(run), "--out", str(tmp_path / "page"), "--no-open"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str((tmp_path / "page" / "index.html").resolve())
    assert sorted(p.name for p in (tmp_path / "page" / "data").iterdir()) == [
        "eval_000000.js", "eval_000002.js", "train_000001.js", "train_000002.js"]
    missing = subprocess.run([*cmd[:3], str(tmp_path / "nothing"), "--no-open"], capture_output=True, text=True,
                             env=subprocess_env(), cwd=ROOT, timeout=120)
    assert missing.returncode == 2 and "no run directory" in missing.stderr
