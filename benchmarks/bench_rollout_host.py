"""The host's share of a training rollout: a recipe's real envs and rollout driver with a backend that answers at once.

Why: on the H200 the smoke recipe's rollout (256 GSM8K episodes) took 1.7-2.1 s, of which the engine was busy only
1.3-1.8 s; the rest is this process's env work (resets, steps, training samples with their drift check) before the
first request and after the last turn. With a `ScriptedBackend` (random ids of the recipe's `max_new_tokens`, no
model) the whole rollout is that work, measured here by itself on any machine.

    python benchmarks/bench_rollout_host.py                       # the GSM8K smoke recipe: cpu/rollout_host.json
    python benchmarks/bench_rollout_host.py --data path/to/gsm8k  # GSM8K from there
    python benchmarks/bench_rollout_host.py --profile 25          # and the costliest functions of one rollout
    python benchmarks/bench_rollout_host.py --env-processes 2     # the env work in 2 processes (samples cross pipes)

GSM8K comes from ``--data`` (a directory with train.jsonl, or a jsonl/parquet file), else ``$MT_ENV_GSM8K``, else
``../shared/data/gsm8k`` beside this checkout when it is there, else the Hugging Face hub (offline: an error saying
what to pass).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not an installed copy

from agents.backend import SamplingParams  # noqa: E402
from agents.rollout_processes import rollout_driver  # noqa: E402
from agents.scripted import ScriptedBackend  # noqa: E402
from benchmarks import record  # noqa: E402
from envs.gsm8k.data import DATA_ENV_VAR  # noqa: E402
from mt_env.errors import MtEnvError  # noqa: E402
from trainers.config import load_config  # noqa: E402
from trainers.setup import TaskSource, env_factory, make_tokenizer  # noqa: E402
from mt_env.errors import debug_flag  # noqa: E402
from trainers.stopping import entry_point  # noqa: E402

#: GSM8K as the other projects of this workplace keep it (a checkout's sibling folder), used when it is there
SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def gsm8k_data(data: str | None) -> str | None:
    """Where GSM8K is read from (see the module docstring); None: the hub."""
    return data or os.environ.get(DATA_ENV_VAR) or (str(SHARED_GSM8K) if SHARED_GSM8K.is_dir() else None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="gsm8k_smoke_random_0.5b.yaml")
    ap.add_argument("--data", help="GSM8K: a directory with train.jsonl, or a jsonl/parquet file (see above)")
    ap.add_argument("--rollouts", type=int, default=5, help="timed rollouts (on new tasks each), after one warm-up")
    ap.add_argument("--env-processes", type=int, metavar="N",
                    help="the env work in N processes (agents.rollout_processes); default: the recipe's")
    ap.add_argument("--profile", type=int, metavar="N",
                    help="profile one more rollout; print its N costliest functions")
    record.add_arguments(ap)
    debug_flag(ap)
    args = ap.parse_args(argv)
    overrides = [] if args.env_processes is None else [f"rollout.env_processes={args.env_processes}"]
    cfg = load_config(args.config, ["device=cpu", *overrides])
    if cfg.env.id == "GSM8kTool-v0" and (args.data or not cfg.env.kwargs.get("data_path")):
        cfg.env.kwargs["data_path"] = gsm8k_data(args.data)
    tokenizer = make_tokenizer(cfg)
    make_env = env_factory(cfg, tokenizer)
    try:
        probe = make_env()
    except MtEnvError as e:
        raise MtEnvError(f"{e}; here: --data path/to/gsm8k") from e
    rec = record.start(args, "rollout_host")  # once the data is found: a run that cannot start leaves the record
    tasks = TaskSource(probe.unwrapped, seed=cfg.seed)
    rng = random.Random(0)
    answer = [rng.randrange(1000, len(tokenizer) // 2) for _ in range(cfg.rollout.max_new_tokens)]  # no stop token
    backend = ScriptedBackend(lambda prompt: answer, vocab_size=len(tokenizer))
    episodes = cfg.rollout.prompts_per_step * cfg.rollout.n
    driver = rollout_driver(make_env, backend, SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens),
                            processes=cfg.rollout.env_processes, seed=cfg.seed, max_concurrency=episodes)

    def rollout(step: int) -> float:
        start = time.perf_counter()
        result = driver.run(tasks.next(cfg.rollout.prompts_per_step), n=cfg.rollout.n, step=step)
        assert not result.metrics["rollout/failed"], "episodes failed: the figure would not be the host's work"
        return time.perf_counter() - start

    try:
        rollout(0)  # the env pool, the tokenizer's caches
        seconds = [rollout(1 + i) for i in range(args.rollouts)]
        median = statistics.median(seconds)
        print(f"{args.config}: {episodes} episodes x {cfg.rollout.max_new_tokens} tokens, scripted backend: "
              f"median {median:.3f} s a rollout ({median / episodes * 1e3:.2f} ms an episode; runs "
              + ", ".join(f"{s:.3f}" for s in seconds) + ")")
        rec.write(dict(config=args.config, episodes=episodes, env_processes=cfg.rollout.env_processes,
                       rollout_s=median, runs_s=seconds))
        if args.profile:
            profiler = cProfile.Profile()
            profiler.runcall(rollout, 1 + args.rollouts)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)
    finally:
        driver.close()
        probe.close()


if __name__ == "__main__":
    sys.exit(entry_point(main))
