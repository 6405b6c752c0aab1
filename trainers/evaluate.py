#!/usr/bin/env python
"""Evaluate a policy on held-out episodes of an env: a summary table and per-episode records (JSONL).

    python trainers/evaluate.py --env GSM8kTool-v0 --model Qwen/Qwen2.5-0.5B-Instruct \\
        --env-kwargs '{"data_path": "../shared/data/gsm8k", "split": "test"}' --episodes 200
    python trainers/evaluate.py --checkpoint runs/quickstart --config quickstart.yaml

Episodes run through the same rollout driver as training, decoded as the recipe's ``eval`` section says (``greedy``,
``samples``, ``seed``); the flags below override it (``--samples k --temperature 1`` gives pass@k). With
``--checkpoint`` (a checkpoint directory, or a run directory for its newest complete checkpoint), the model is
rebuilt from the recipe and the checkpoint's weights are loaded.

The per-episode records go to a new file named for what was evaluated, in the ``eval/`` folder of the checkpoint's
run (or of the recipe's ``output_dir``): ``runs/quickstart/eval/checkpoint_100.jsonl``, then ``checkpoint_100-2.jsonl``
on the next evaluation, and so on — a run's own files and earlier evaluations are never replaced. ``--out PATH``
writes exactly there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path


if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents.backend import SamplingParams
from agents.rollout import RolloutDriver
from mt_env.errors import debug_flag
from trainers import checkpoints
from trainers.config import ConfigError, load_config
from trainers.recording import Recorder
from trainers.setup import env_factory, eval_tasks, make_backend, make_models, make_tokenizer, run_device
from trainers.stopping import entry_point


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="recipe YAML the model was trained with (tokenizer, env, budget)")
    ap.add_argument("--checkpoint", default=None, help="a checkpoint directory written by trainers/ppo.py, or its run "
                    "directory (the newest complete checkpoint)")
    ap.add_argument("--model", default=None, help="a Hugging Face model id or directory (instead of --checkpoint)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer (default: the model's, or the recipe's)")
    ap.add_argument("--env", default=None, help="Gymnasium id, e.g. GSM8kTool-v0 (default: the recipe's)")
    ap.add_argument("--env-kwargs", default=None, help="JSON dict of env keyword arguments")
    ap.add_argument("--episodes", type=int, default=None, help="held-out episodes (default: eval.episodes)")
    ap.add_argument("--samples", type=int, default=None, help="samples per task, for pass@k (eval.samples)")
    ap.add_argument("--temperature", type=float, default=None,
                    help="0: greedy; above 0: sampled at this temperature (default: the recipe's eval.greedy and "
                    "rollout.temperature)")
    ap.add_argument("--out", default=None, help="per-episode JSONL, replaced if it exists (default: a new file in "
                    "the run's eval/ folder, see above)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe overrides")
    debug_flag(ap)
    return ap.parse_args(argv)


def _overrides(args) -> list[str]:
    """The command-line flags as recipe overrides (after the explicit --set ones)."""
    overrides = list(args.set)
    if args.model:
        overrides += [f"model.path={args.model}", f"tokenizer.name={args.tokenizer or args.model}"]
    elif args.tokenizer:
        overrides.append(f"tokenizer.name={args.tokenizer}")
    if args.env:
        overrides.append(f"env.id={args.env}")
    if args.env_kwargs:
        overrides.append(f"env.eval_kwargs={args.env_kwargs}")
    if args.episodes is not None:
        overrides.append(f"eval.episodes={args.episodes}")
    if args.samples is not None:
        overrides.append(f"eval.samples={args.samples}")
    if args.temperature is not None:
        overrides += ["eval.greedy=true"] if args.temperature == 0 else [
            "eval.greedy=false", f"rollout.temperature={args.temperature}"]
    return overrides


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = load_config(args.config, _overrides(args) + ["algorithm.name=grpo"], training=False)  # grpo: no critic
    temperature = 0.0 if cfg.eval.greedy else cfg.rollout.temperature
    try:
        checkpoint = checkpoints.resolve(args.checkpoint) if args.checkpoint else None
    except FileNotFoundError as e:
        raise ConfigError(f"--checkpoint: {e}") from None
    tokenizer = make_tokenizer(cfg)
    lm, _ = make_models(cfg, tokenizer, run_device(cfg))
    if checkpoint is not None:
        try:
            checkpoints.load_policy_weights(lm, checkpoint, "the recipe's model")
        except RuntimeError as e:
            raise ConfigError(f"--checkpoint: {e}: evaluate it with the recipe it was trained with (--config, "
                              f"--set)") from None
    make_eval_env = env_factory(cfg, tokenizer, eval_env=True)
    tasks = eval_tasks(cfg, make_eval_env().unwrapped)
    backend = make_backend(cfg, lm, tokenizer, weights_changed=checkpoint is not None)
    sampling = SamplingParams(temperature=temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                              max_new_tokens=cfg.rollout.max_new_tokens)
    driver = RolloutDriver(make_eval_env, backend, sampling, seed=cfg.eval.seed, progress=True,
                           max_concurrency=len(tasks) * cfg.eval.samples)
    result = driver.run(tasks, n=cfg.eval.samples)
    episodes = result.episodes
    stats = result.summary()
    summary = {
        "episodes": len(episodes), "failed": int(result.metrics["rollout/failed"]),
        "skipped (prompt over budget)": int(result.metrics["rollout/skipped"]),
        "success": stats["success"], f"pass@{cfg.eval.samples}": stats["pass@n"],
        **{k: stats[k] for k in ("reward", "turns", "tool_call_rate", "tool_errors_per_episode")},
        "response_tokens": result.metrics["rollout/response_len_mean"],
        "wall_s": result.metrics["rollout/wall_s"],
    }
    out = Path(args.out) if args.out else records_path(cfg, checkpoint)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for e in episodes:
            f.write(json.dumps(e.to_dict(), ensure_ascii=False, default=str) + "\n")
    width = max(len(k) for k in summary)
    print(f"\n{cfg.env.id} · {checkpoint or cfg.model.path or 'random init'} · "
          f"{'greedy' if temperature == 0 else f'T={temperature}'}")
    for k, v in summary.items():
        print(f"  {k:<{width}}  {v:.3f}" if isinstance(v, float) else f"  {k:<{width}}  {v}")
    step = checkpoints.read_state(checkpoint).step if checkpoint is not None else 0  # the weights' updates
    tokens = Recorder(out.parent, tokenizer, every=1, episodes=len(episodes)).record_eval(step, tasks, result,
                                                                                         kind="evaluate")
    print(f"per-episode records: {out}; token by token: {tokens} (python -m mt_env.view {out.parent})")
    driver.close()
    asyncio.run(backend.close())  # stop the generation worker before the interpreter exits
    return summary


def records_path(cfg, checkpoint: Path | None) -> Path:
    """A file that does not exist yet, named for what is evaluated, in the eval/ folder of the checkpoint's run
    (else of the recipe's output_dir); see the module docstring."""
    if checkpoint is not None:
        folder, label = checkpoint.parent.parent / "eval", checkpoint.name
    else:
        folder, label = Path(cfg.output_dir) / "eval", Path(cfg.model.path).name if cfg.model.path else "random_init"
    path, k = folder / f"{label}.jsonl", 2
    while path.exists():
        path, k = folder / f"{label}-{k}.jsonl", k + 1
    return path


if __name__ == "__main__":
    sys.exit(entry_point(main))
