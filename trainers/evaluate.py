#!/usr/bin/env python
"""Evaluate a policy on held-out episodes of an env: a summary table and per-episode records (JSONL).

    python trainers/evaluate.py --env GSM8kTool-v0 --model Qwen/Qwen2.5-0.5B-Instruct \\
        --env-kwargs '{"data_path": "../shared/data/gsm8k", "split": "test"}' --episodes 200
    python trainers/evaluate.py --checkpoint runs/quickstart/checkpoints/checkpoint_0 --config quickstart.yaml

Episodes run through the same rollout driver as training (greedy by default; ``--samples k --temperature 1`` gives
pass@k). With ``--checkpoint``, the model is rebuilt from the recipe and the checkpoint's weights are loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents.policy import SamplingParams
from agents.rollout import RolloutDriver
from trainers.config import load_config
from trainers.setup import env_factory, eval_tasks, make_backend, make_models, make_tokenizer


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="recipe YAML the model was trained with (tokenizer, env, budget)")
    ap.add_argument("--checkpoint", default=None, help="a checkpoint directory written by trainers/ppo.py")
    ap.add_argument("--model", default=None, help="a Hugging Face model id or directory (instead of --checkpoint)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer (default: the model's, or the recipe's)")
    ap.add_argument("--env", default=None, help="Gymnasium id, e.g. GSM8kTool-v0 (default: the recipe's)")
    ap.add_argument("--env-kwargs", default=None, help="JSON dict of env keyword arguments")
    ap.add_argument("--episodes", type=int, default=None)
    ap.add_argument("--samples", type=int, default=1, help="samples per task (pass@k)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--out", default=None, help="per-episode JSONL (default: <output_dir>/eval_episodes.jsonl)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe overrides")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    overrides = list(args.set)
    if args.model:
        overrides += [f"model.path={args.model}", f"tokenizer.name={args.tokenizer or args.model}"]
    elif args.tokenizer:
        overrides.append(f"tokenizer.name={args.tokenizer}")
    if args.env:
        overrides.append(f"env.id={args.env}")
    if args.env_kwargs:
        overrides.append(f"env.eval_kwargs={args.env_kwargs}")
    if args.episodes:
        overrides.append(f"eval.episodes={args.episodes}")
    cfg = load_config(args.config, overrides + ["algorithm.name=grpo"], training=False)  # grpo: no critic to build
    device = torch.device("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu")
    tokenizer = make_tokenizer(cfg)
    lm, _ = make_models(cfg, tokenizer, device)
    if args.checkpoint:
        _load_policy_weights(lm, Path(args.checkpoint))
    make_eval_env = env_factory(cfg, tokenizer, eval_env=True)
    tasks = eval_tasks(cfg, make_eval_env().unwrapped)
    backend = make_backend(cfg, lm, tokenizer, weights_changed=args.checkpoint is not None)
    sampling = SamplingParams(temperature=args.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                              max_new_tokens=cfg.rollout.max_new_tokens)
    driver = RolloutDriver(make_eval_env, backend, sampling, seed=cfg.eval.seed, progress=True,
                           max_concurrency=len(tasks) * args.samples)
    result = driver.run(tasks, n=args.samples)
    episodes = result.episodes
    stats = result.summary()
    summary = {
        "episodes": len(episodes), "failed": int(result.metrics["rollout/failed"]),
        "skipped (prompt over budget)": int(result.metrics["rollout/skipped"]),
        "success": stats["success"], f"pass@{args.samples}": stats["pass@n"],
        **{k: stats[k] for k in ("reward", "turns", "tool_call_rate", "tool_errors_per_episode")},
        "response_tokens": result.metrics["rollout/response_len_mean"],
        "wall_s": result.metrics["rollout/wall_s"],
    }
    out = Path(args.out or Path(cfg.output_dir) / "eval_episodes.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for e in episodes:
            f.write(json.dumps(e.to_dict(), ensure_ascii=False, default=str) + "\n")
    width = max(len(k) for k in summary)
    print(f"\n{cfg.env.id} · {args.checkpoint or cfg.model.path or 'random init'} · "
          f"{'greedy' if args.temperature == 0 else f'T={args.temperature}'}")
    for k, v in summary.items():
        print(f"  {k:<{width}}  {v:.3f}" if isinstance(v, float) else f"  {k:<{width}}  {v}")
    print(f"per-episode records: {out}")
    driver.close()
    asyncio.run(backend.close())  # stop the generation worker before the interpreter exits
    return summary


def _load_policy_weights(lm: torch.nn.Module, checkpoint: Path) -> None:
    """The policy's weights from an accelerate checkpoint (model.safetensors / pytorch_model.bin of PolicyModel)."""
    files = sorted(checkpoint.glob("model*.safetensors")) or sorted(checkpoint.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"no model weights in {checkpoint}")
    if files[0].suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(files[0]))
    else:
        state = torch.load(files[0], map_location="cpu")
    state = {k.removeprefix("lm."): v for k, v in state.items() if k.startswith("lm.")}
    missing, unexpected = lm.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


if __name__ == "__main__":
    main()
