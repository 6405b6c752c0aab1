"""Env steps per second with replayed model turns (no model): GSM8kTool-v0, tokenizer off and on, on two paths.

Each episode replays three recorded-style model turns on a real GSM8K problem: reasoning + a tool call with a
wrong answer, a tool call with the right one, the final ``#### <n>``. The tool, parser, conversation and env logic
all run for real. An env step is one model turn consumed; resets (tool create/release, prompt rendering) run
between episodes and their time is counted in the wall time but not as steps. Every run plays tasks that follow
the previous run's, so that the encoding caches meet new prompts and tool outputs as they do in training.

Paths (rows):

* ``async``: what the rollout driver does (`agents.rollout.RolloutDriver`): each episode in flight is an asyncio
  task that awaits ``env.unwrapped.areset`` / ``astep`` and, between steps, a generation; all in one event loop and
  one process. The generations come from a replay engine that answers every request made during one pass of the
  event loop at the next pass, as a batching engine answers its batch. 1 or 256 episodes in flight; with the
  garbage collector paused for the run as the driver pauses it (``gc paused``), and left on (``gc on``: an
  asyncio program of one's own).
* ``vector``: Gymnasium's vector API, mt_env's `ToolVectorEnv` (``step_subset`` over 1 or 256 envs); and as the
  baseline measured in the same run, Gymnasium's `SyncVectorEnv` (envs stepped one by one); and ``env.step``:
  one env through the plain `gymnasium.Env` API.

Each rate is the median of ``--repeats`` runs, the rows' runs interleaved. ``--against DIR`` measures the text-mode
rows of another checkout of this repository too (e.g. ``git worktree add /tmp/old 8b42ab8``), each run in a fresh
process, the two checkouts' processes taking turns, so that both see the same machine.

Goals: (issue 32) text-mode steps/s at least those of 8b42ab8 in the same run; on the driver's path, 256 episodes
in flight step at least as fast per step as one (``256 / 1``, gc paused). (issue 3) >= 20k env-steps/s on 2 cores
with the tokenizer off, 256 envs.

    python benchmarks/bench_envs.py [--data ../shared/data/gsm8k] [--against /tmp/old] \\
        [--out benchmarks/results/cpu/envs]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the checkout whose code is measured: this file's, or the one after --code (a worker measuring another checkout)
CODE = Path(sys.argv[sys.argv.index("--code") + 1]).resolve() if "--code" in sys.argv else ROOT
sys.path.insert(0, str(CODE))

import gymnasium as gym  # noqa: E402

import mt_env  # noqa: E402, F401
if (CODE / "envs" / "gsm8k").is_dir():
    from envs.gsm8k.env import GSM8kToolEnv  # noqa: E402
else:  # a checkout from before the envs/gsm8k/ folder (--against an older commit)
    from envs.gsm8k_tool import GSM8kToolEnv  # noqa: E402
from mt_env.parsers import HermesParser, ToolCall  # noqa: E402
from mt_env.vector import ToolVectorEnv  # noqa: E402

REASONING = ("Let me work through this. First I find the quantities given in the problem, then I combine them "
             "step by step, and finally I check the result with the tool before answering.")
TOKENIZER = "offline:qwen2.5"
#: The rows measured with the tokenizer off: those an older checkout is measured on as well (same API there).
TEXT_ROWS = ("env.step 1", "async 1", "async 256", "async 1 gc on", "async 256 gc on", "vector 1", "vector 256",
             "SyncVectorEnv 256")
TOKEN_ROWS = ("async 1 tok", "async 256 tok", "async 1 tok gc on", "async 256 tok gc on", "vector 1 tok",
              "vector 256 tok")


def model_turns(truth: str) -> list[str]:
    wrong = str(int(float(truth)) + 1)
    check = lambda answer: HermesParser.format_turn([ToolCall("calc_gsm8k_reward", {"answer": answer})])  # noqa: E731
    return [f"{REASONING}\n{check(wrong)}", f"That was off by one.\n{check(truth)}", f"So the answer is #### {truth}"]


class Episodes:
    """The episodes of the runs: tasks in order, each with its replayed turns (text, or the ids an engine would
    hand over: encoded outside the env, with the end-of-turn token)."""

    def __init__(self, rows: list[dict], fmt=None):
        self.rows, self.fmt, self.next = rows, fmt, 0

    def take(self, n: int) -> list[tuple[dict, list]]:
        tasks = [self.rows[(self.next + k) % len(self.rows)] for k in range(n)]
        self.next += n
        turns = [model_turns(t["reward_model"]["ground_truth"]) for t in tasks]
        if self.fmt is not None:
            from mt_env.turn import ModelTurn

            flat = self.fmt.tokenizer([t for ts in turns for t in ts], add_special_tokens=False).input_ids
            ids = iter(flat)
            turns = [[ModelTurn(ids=next(ids) + [self.fmt.end_of_turn_id]) for _ in ts] for ts in turns]
        return list(zip(tasks, turns))


class ReplayEngine:
    """Answers every request made during one pass of the event loop at the next pass (one batch per pass), with
    the turn it was asked for."""

    def __init__(self):
        self.pending: list[tuple[asyncio.Future, object]] = []

    def generate(self, turn) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if not self.pending:
            loop.call_soon(self._answer)
        future = loop.create_future()
        self.pending.append((future, turn))
        return future

    def _answer(self) -> None:
        batch, self.pending = self.pending, []
        for future, turn in batch:
            future.set_result(turn)


def run_async(envs: list, episodes: list[tuple[dict, list]], gc_paused: bool) -> float:
    """Steps/s of `episodes` played with ``len(envs)`` in flight, each an asyncio task as in the rollout driver."""
    queue, engine = list(reversed(episodes)), ReplayEngine()

    async def slot(env) -> int:
        steps = 0
        while queue:
            task, turns = queue.pop()
            await env.areset(options={"task": task})
            for turn in turns:
                await env.astep(await engine.generate(turn))
                steps += 1
        return steps

    async def play() -> float:
        start = time.perf_counter()
        steps = sum(await asyncio.gather(*(slot(env) for env in envs)))
        return steps / (time.perf_counter() - start)

    return _timed(lambda: asyncio.run(play()), gc_paused)


def run_vector(envs, episodes: list[tuple[dict, list]], subset: bool = True) -> float:
    """Steps/s of `episodes` through a vector env, ``envs.num_envs`` at a time, all stepped at once."""
    n, steps, idx = envs.num_envs, 0, list(range(envs.num_envs))

    def play() -> float:
        nonlocal steps
        start = time.perf_counter()
        for first in range(0, len(episodes) - n + 1, n):
            chunk = episodes[first:first + n]
            if subset:
                envs.reset_subset(idx, options=[{"task": task} for task, _ in chunk])
            else:
                envs.reset(options={"task": chunk[0][0]})
            for k in range(len(chunk[0][1])):
                actions = [turns[k] for _, turns in chunk]
                envs.step_subset(idx, actions) if subset else envs.step(actions)
                steps += n
        return steps / (time.perf_counter() - start)

    return _timed(play, gc_paused=False)  # the vector env pauses the collector in its own calls


def run_step(env, episodes: list[tuple[dict, list]]) -> float:
    """Steps/s of `episodes` through one env's plain `reset` / `step`."""

    def play() -> float:
        start, steps = time.perf_counter(), 0
        for task, turns in episodes:
            env.reset(options={"task": task})
            for turn in turns:
                env.step(turn)
                steps += 1
        return steps / (time.perf_counter() - start)

    return _timed(play, gc_paused=False)


def _timed(play, gc_paused: bool) -> float:
    gc.collect()  # every run starts from the same collector state
    if gc_paused:
        gc.disable()  # as RolloutDriver.play does (mt_env.collector.collector_paused)
    try:
        return play()
    finally:
        gc.enable()


class Rows:
    """The envs of every row, made once and reused by its runs; `run(row)` plays the next episodes on that row."""

    def __init__(self, data: str, episodes: int):
        self.data, self.episodes, self.made = data, episodes, {}
        self.text = Episodes(GSM8kToolEnv(data_path=data).rows)
        self.tokens: Episodes | None = None

    def _envs(self, key: str, make):
        if key not in self.made:
            self.made[key] = make()
        return self.made[key]

    def _token_episodes(self) -> Episodes:
        if self.tokens is None:
            env = self._envs("tok", lambda: [GSM8kToolEnv(data_path=self.data, tokenizer=TOKENIZER)
                                             for _ in range(256)])[0]
            env.reset(seed=0)
            self.tokens = Episodes(env.rows, env.conversation.fmt)
        return self.tokens

    def run(self, row: str) -> float:
        """One run of `row` (a name in `TEXT_ROWS` or `TOKEN_ROWS`): its steps/s."""
        name, n, *flags = row.split()
        n, tok, gc_paused = int(n), "tok" in flags, "gc" not in flags
        count = self.episodes if not tok else max(256, self.episodes // 8 // 256 * 256)  # whole rounds of 256
        episodes = (self._token_episodes() if tok else self.text).take(count)
        tokenizer = TOKENIZER if tok else None
        make = lambda k: [GSM8kToolEnv(data_path=self.data, tokenizer=tokenizer) for _ in range(k)]  # noqa: E731
        if name == "async":
            return run_async(self._envs("tok" if tok else "text", lambda: make(256))[:n], episodes, gc_paused)
        if name == "vector":
            envs = self._envs(f"vector {n} {tok}", lambda: ToolVectorEnv([lambda e=e: e for e in make(n)]))
            return run_vector(envs, episodes)
        if name == "SyncVectorEnv":
            envs = self._envs("sync", lambda: gym.make_vec("GSM8kTool-v0", num_envs=n, vectorization_mode="sync",
                                                           data_path=self.data))
            return run_vector(envs, episodes, subset=False)
        return run_step(self._envs("step", lambda: make(1))[0], episodes)


def measure(rows: list[str], data: str, episodes: int, repeats: int) -> dict[str, list[float]]:
    """Each row's rates over `repeats` runs (after one warm-up run each), the rows' runs interleaved."""
    bench = Rows(data, episodes)
    rates: dict[str, list[float]] = {row: [] for row in rows}
    for r in range(repeats + 1):
        for row in rows:
            rate = bench.run(row)
            if r:
                rates[row].append(rate)
    return rates


def measure_in(tree: Path, rows: list[str], args) -> dict[str, list[float]]:
    """`measure` run by this file in a fresh process with the code of checkout `tree`."""
    cmd = [sys.executable, __file__, "--code", str(tree), "--data", args.data, "--episodes", str(args.episodes),
           "--repeats", "1", "--worker", *rows]
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"measuring {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def compare(trees: list[Path], args) -> dict[str, dict[str, list[float]]]:
    """The text-mode rows of each checkout in `trees`, one process per checkout and round, checkouts in turn."""
    rates = {str(t): {row: [] for row in TEXT_ROWS} for t in trees}
    for _ in range(args.repeats):
        for tree in trees:
            for row, values in measure_in(tree, list(TEXT_ROWS), args).items():
                rates[str(tree)][row] += values
    return rates


def commit(tree: Path = ROOT) -> str:
    """The checkout's commit, with ``-dirty`` when its env code (mt_env, envs) has changes not committed."""
    git = lambda *a: subprocess.run(["git", *a], cwd=tree, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--", "mt_env", "envs")
                                                  else "")


def device() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"cpu: {model or platform.machine()}, {os.cpu_count()} cores; python {platform.python_version()}"


def report(rates: dict[str, list[float]], other: dict[str, list[float]] | None, against: str | None) -> list[str]:
    """The table and the goals, as lines."""
    med = {row: statistics.median(v) for row, v in rates.items()}
    lines = [f"{'row':<22} {'steps/s':>9} {'runs':>30}" + (f" {'against':>9} {'ratio':>6}" if other else "")]
    for row, values in rates.items():
        runs = " ".join(f"{v / 1000:.1f}k" for v in values)
        line = f"{row:<22} {med[row]:>9,.0f} {runs:>30}"
        if other and row in other:
            theirs = statistics.median(other[row])
            line += f" {theirs:>9,.0f} {med[row] / theirs:>5.2f}x"
        lines.append(line)
    lines.append("")

    def goal(text: str, value: float, target: float, unit: str = "x") -> None:
        lines.append(f"{text}: {value:,.2f}{unit}  (goal >= {target:,}{unit})  {'PASS' if value >= target else 'FAIL'}")

    for tok in ("", " tok"):
        if f"async 1{tok}" in med:
            goal(f"driver's path, 256 episodes vs 1{tok or ' (text)'}, gc paused", med[f"async 256{tok}"] /
                 med[f"async 1{tok}"], 1.0)
            lines.append(f"  same, gc on: {med[f'async 256{tok} gc on'] / med[f'async 1{tok} gc on']:.2f}x;  "
                         f"vector API 256 envs vs 1: {med[f'vector 256{tok}'] / med[f'vector 1{tok}']:.2f}x")
    if "SyncVectorEnv 256" in med:
        lines.append(f"ToolVectorEnv vs SyncVectorEnv at 256 envs: {med['vector 256'] / med['SyncVectorEnv 256']:.2f}x")
        goal("ToolVectorEnv, 256 envs, text (issue 3)", med["vector 256"], 20_000, " steps/s")
    if other:
        ratio = {row: med[row] / statistics.median(other[row]) for row in TEXT_ROWS if row in other}
        worst = min(ratio, key=ratio.get)
        goal(f"text mode vs {against}, the row least ahead ({worst})", ratio[worst], 1.0)
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.environ.get("MT_ENV_GSM8K", str(ROOT.parent / "shared/data/gsm8k")))
    ap.add_argument("--episodes", type=int, default=3072,
                    help="episodes per run with the tokenizer off (on: an eighth, in whole rounds of 256)")
    ap.add_argument("--repeats", type=int, default=5, help="runs per row (the median is reported)")
    ap.add_argument("--against", help="another checkout of this repository: its text-mode rows are measured too")
    ap.add_argument("--out", help="write PREFIX.json and PREFIX.txt (e.g. benchmarks/results/cpu/envs)")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)  # rows measured here, printed as JSON
    ap.add_argument("--code", help=argparse.SUPPRESS)  # the checkout a worker measures (read before the imports)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.data, args.episodes, args.repeats)))
        return
    against = f" (against {args.against}: {commit(Path(args.against))})" if args.against else ""
    head = [f"command: {shlex.join(['python', *sys.argv])}", f"commit: {commit()}{against}", f"device: {device()}",
            f"GSM8kTool-v0, data {args.data}; {args.episodes} episodes per run (tokenizer on: an eighth), "
            f"3 steps each; median of {args.repeats} runs", ""]
    print("\n".join(head), flush=True)
    other = None
    if args.against:
        both = compare([ROOT, Path(args.against).resolve()], args)
        rates, other = both[str(ROOT)], both[str(Path(args.against).resolve())]
        rates |= measure(list(TOKEN_ROWS), args.data, args.episodes, args.repeats)
    else:
        rates = measure(list(TEXT_ROWS + TOKEN_ROWS), args.data, args.episodes, args.repeats)
    lines = report(rates, other, args.against)
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".txt").write_text("\n".join(head + lines) + "\n")
        record = dict(command=head[0].split(": ", 1)[1], commit=commit(), device=device(), episodes=args.episodes,
                      repeats=args.repeats, steps_per_s=rates, against=args.against,
                      against_commit=commit(Path(args.against)) if args.against else None, against_steps_per_s=other)
        out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
