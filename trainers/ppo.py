#!/usr/bin/env python
"""PPO and GRPO for multi-turn tool use, readable top to bottom.

    python trainers/ppo.py                                   # the offline quickstart (Calculator-v0, CPU)
    python trainers/ppo.py --config gsm8k_qwen2.5_0.5b.yaml --set trainer.lr=2e-6 --set rollout.n=8
    accelerate launch --num_processes 2 trainers/ppo.py --config ...          # DDP / FSDP per accelerate config

One training step:

1. **rollout** — episodes of the env played by the policy through the async rollout driver (`agents.rollout`);
   their conversations become samples whose loss mask is 1 exactly on the tokens the model sampled.
2. **old / reference logprobs, values** — recomputed by the trainer on those exact ids (and compared with the
   engine's own logprobs: the rollout/trainer mismatch).
3. **rewards** — each turn's tool reward on its last sampled token, the final reward on the last one; optionally
   minus a KL penalty to the reference model.
4. **advantages** — GRPO: the episode's return normalised within its group of ``n`` samples of one task; PPO: GAE
   over sampled tokens only (tool and template tokens are skipped, not zero-rewarded), with a critic.
5. **update** — epochs of masked, clipped mini-batch updates (gradient accumulation over micro-batches).
6. **log, sync, evaluate, checkpoint.**
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed

from agents.policy import SamplingParams
from agents.rollout import RolloutDriver
from mt_env.batch import pad_samples
from trainers import algos
from trainers.checkpoints import Checkpointer, plan_run
from trainers.config import Config, ConfigError, load_config
from trainers.modeling import PolicyModel
from trainers.setup import (TaskSource, env_factory, eval_tasks, frozen_copy, make_backend, make_models,
                            make_tokenizer, sync_weights)
from trainers.sft import demonstration_samples, sft_warm_start
from trainers.stopping import EmptySteps, StopRequested, entry_point, resume_command
from trainers.tracking import Tracker


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="PPO / GRPO for multi-turn tool-using LLM agents (mt_env)")
    ap.add_argument("--config", default="quickstart.yaml", help="recipe YAML (a path or a name in trainers/configs)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. trainer.lr=1e-6")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = load_config(args.config, args.set)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir)
    cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    accelerator = Accelerator(cpu=cpu)
    rank, world = accelerator.process_index, accelerator.num_processes
    for name, value in (("rollout.prompts_per_step", cfg.rollout.prompts_per_step),
                        ("trainer.minibatch_size", cfg.trainer.minibatch_size)):
        if value % world:
            raise ConfigError(f"{name}={value} is a global size: it must divide by the {world} processes")
    if accelerator.distributed_type == DistributedType.FSDP and cfg.rollout.backend == "hf":
        raise ConfigError("FSDP shards the policy, and the embedded HF backend generates on the trainer's own module: "
                          "use rollout.backend=sglang_engine or sglang_server with FSDP (or DDP with the HF backend)")
    set_seed(cfg.seed, device_specific=False)
    plan = plan_run(cfg)  # a new run, a resume from the newest complete checkpoint, or nothing to do
    for note in plan.notes:  # which checkpoint it resumes from, and why it skipped others
        accelerator.print(note)
    if plan.finished:
        return plan.state.summary()
    accelerator.wait_for_everyone()  # every process has read the run directory before the main one writes to it
    state = plan.state
    tracker = Tracker(out, cfg.to_dict(), enabled=accelerator.is_main_process, jsonl=cfg.logging.jsonl,
                      tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                      wandb_project=cfg.logging.wandb_project,
                      resume_step=state.step if plan.checkpoint else None, clock=state.elapsed)
    run_start = time.perf_counter()

    # ---------------------------------------------------------------------------------------------- setup
    tokenizer = make_tokenizer(cfg)
    make_env, make_eval_env = env_factory(cfg, tokenizer), env_factory(cfg, tokenizer, eval_env=True)
    probe_env = make_env().unwrapped
    tasks = TaskSource(probe_env, seed=cfg.seed)
    held_out = eval_tasks(cfg, make_eval_env().unwrapped)

    lm, critic_model = make_models(cfg, tokenizer, accelerator.device)
    policy = PolicyModel(lm, vocab_limit=len(tokenizer))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    critic = critic_optimizer = None
    if critic_model is not None:
        critic_optimizer = torch.optim.AdamW(critic_model.parameters(), lr=cfg.trainer.critic_lr)
        critic, critic_optimizer = accelerator.prepare(critic_model, critic_optimizer)
    accelerator.register_for_checkpointing(tasks)
    lm = accelerator.unwrap_model(policy).lm  # the plain HF module: generation runs on it, sharing the weights
    checkpointer = Checkpointer(accelerator, plan, cfg.trainer.keep_last, lm, tokenizer)

    # ---------------------------------------------------------------------------------------------- SFT warm start
    if cfg.sft.steps and plan.checkpoint is None:
        demo_tasks = TaskSource(probe_env, seed=cfg.seed + 1).next(min(4096, cfg.sft.steps * cfg.sft.batch_size))
        samples = demonstration_samples(make_env, demo_tasks, cfg.sft.demo_skill, cfg.seed)
        # not passed to accelerator.prepare: prepared optimizers go into every checkpoint, and this one is dead once
        # RL starts (the prepared model already synchronises gradients across processes)
        sft_optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.sft.lr)
        tracker.message(f"sft: {len(samples)} demonstration samples (skill {cfg.sft.demo_skill}), "
                        f"{cfg.sft.steps} steps")
        sft_stats = sft_warm_start(policy, sft_optimizer, samples, tokenizer.pad_token_id, cfg.sft.steps,
                                   cfg.sft.batch_size, accelerator, tracker, cfg.seed, cfg.sft.time_limit_s)
        del sft_optimizer  # frees its state before RL
        tracker.log(0, sft_stats, console=False)
    # the KL reference is the policy as RL starts (after SFT); a checkpoint restores it with everything else
    reference = (PolicyModel(frozen_copy(lm), vocab_limit=len(tokenizer))
                 if cfg.algorithm.kl_mode != "none" and cfg.algorithm.kl_coef > 0 else None)
    if reference is not None:
        accelerator.register_for_checkpointing(reference)
    if plan.checkpoint is not None:
        accelerator.load_state(str(plan.checkpoint))

    weights_changed = bool(cfg.sft.steps) or plan.checkpoint is not None or not cfg.model.path
    backend = make_backend(cfg, lm, tokenizer, weights_changed, accelerator.local_process_index)
    sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                              max_new_tokens=cfg.rollout.max_new_tokens)
    driver = RolloutDriver(make_env, backend, sampling, seed=cfg.seed * 1000 + rank,
                           progress=cfg.logging.progress and accelerator.is_main_process,
                           max_concurrency=cfg.rollout.prompts_per_step // world * cfg.rollout.n)
    eval_driver = RolloutDriver(make_eval_env, backend, sampling, seed=cfg.seed * 1000 + 500 + rank,
                                max_concurrency=max(1, cfg.eval.episodes * cfg.eval.samples // world))
    layout = "packed" if cfg.trainer.packed else "padded"
    empty_steps = EmptySteps()

    def evaluate(step: int) -> dict:
        metrics = run_eval(eval_driver, held_out[rank::world], cfg, accelerator)
        tracker.log(step, metrics, console=False)
        tracker.message(f"eval  {step:>4} | success {metrics['val/success']:.3f} | reward {metrics['val/reward']:.3f} "
                        f"| tool calls {metrics['val/tool_call_rate']:.2f} | turns {metrics['val/turns']:.2f}")
        state.record_eval(metrics)
        return metrics

    if state.first_eval is None:
        evaluate(0)  # the starting level (after SFT): what RL has to beat

    # ---------------------------------------------------------------------------------------------- training loop
    with StopRequested(announce=accelerator.is_main_process) as stop:  # Ctrl-C: checkpoint at the step boundary
        while state.step < cfg.trainer.total_steps:
            if stop.agreed(accelerator):
                break
            step_start = time.perf_counter()
            step = state.step + 1

            # 1. ROLLOUT: each process plays its share of the step's tasks, n samples each (a GRPO group per task)
            batch_tasks = tasks.next(cfg.rollout.prompts_per_step)[rank::world]
            result = driver.run(batch_tasks, n=cfg.rollout.n, step=step)
            rollout_s = time.perf_counter() - step_start
            samples = result.samples
            metrics = dict(result.metrics)

            # every process needs trainable tokens for the update's collectives to line up: otherwise all skip it
            local_tokens = sum(sum(s.loss_mask()) for s in samples)
            if _global(accelerator, local_tokens, "min") == 0:
                tracker.message(f"step {step}: skipping the update: no trainable tokens "
                                f"({metrics['rollout/failed']:.0f} failed, {metrics['rollout/skipped']:.0f} skipped "
                                f"of {len(result.episodes)} episodes)")
                state.step = step
                metrics = reduce_metrics(accelerator, metrics)
                tracker.log(step, metrics)
                empty_steps.add(step, metrics, result.episodes)  # a few in a row stop the run, naming the cause
                continue
            data = to_training_tensors(samples, tokenizer.pad_token_id, accelerator.device)
            groups = [s.episode.group + rank * 10**6 for s in samples]  # episode ids: GRPO groups and per-turn samples
            episodes = [tuple(s.episode) for s in samples]

            # 2. OLD / REFERENCE LOGPROBS AND VALUES on the exact ids of the rollout
            update_start = time.perf_counter()
            with torch.no_grad():
                old_lp, _ = forward(policy, data, cfg, layout)
                ref_lp = forward(reference, data, cfg, layout)[0] if reference is not None else None
                values = forward(critic, data, cfg, layout, critic=True)[0] if critic is not None else None
            metrics.update(logprob_mismatch(old_lp, data["rollout_lp"], data["target"]))

            # 3. REWARDS: tools' turn rewards and the final reward are already on the sampled tokens
            rewards = data["rewards"]
            if ref_lp is not None and cfg.algorithm.kl_mode == "reward":
                kl = algos.kl_estimate(old_lp, ref_lp, cfg.algorithm.kl_estimator)
                rewards = rewards - cfg.algorithm.kl_coef * torch.where(data["target"] > 0, kl, torch.zeros_like(kl))
                metrics["actor/kl_ref"] = algos.masked_mean(kl, data["target"]).item()

            # 4. ADVANTAGES
            returns = None
            if cfg.algorithm.name == "grpo":
                seq_adv, grpo_stats = algos.grpo_advantages(data["episode_rewards"], groups, episodes,
                                                            cfg.algorithm.norm_adv_by_std)
                advantages = seq_adv[:, None] * data["target"]
                metrics.update(grpo_stats)
            else:
                advantages, returns = algos.masked_gae(rewards, values, data["target"], cfg.algorithm.gamma,
                                                       cfg.algorithm.lam, data["turn_ids"], cfg.algorithm.turn_gamma)
                if cfg.algorithm.norm_adv_by_std:
                    advantages = algos.masked_whiten(advantages, data["target"])
            if not all(torch.isfinite(x[data["target"] > 0]).all() for x in (old_lp, advantages)):
                tracker.message(f"step {step}: skipping the update: non-finite logprobs or advantages in the batch")
                state.step = step
                continue

            # 5. UPDATE: epochs x mini-batches x micro-batches, masked and clipped
            update_stats = update(policy, critic, optimizer, critic_optimizer, accelerator, cfg, layout, data,
                                  old_lp, ref_lp, values, advantages, returns, step)
            scheduler.step()
            update_s = time.perf_counter() - update_start
            sync = "synced by the main process"
            if cfg.rollout.backend != "sglang_server" or accelerator.is_main_process:  # servers are shared: sync once
                sync = asyncio.run(sync_weights(backend, lm, str(out)))
            accelerator.wait_for_everyone()

            # 6. LOG, EVALUATE, CHECKPOINT
            state.step = step
            metrics.update(update_stats)
            metrics.update({
                "perf/step_s": time.perf_counter() - step_start, "perf/rollout_s": rollout_s, "perf/update_s": update_s,
                "perf/update_tokens_per_s":
                    float(data["attention_mask"].sum()) * cfg.trainer.epochs / max(update_s, 1e-9),
                "perf/elapsed_s": state.elapsed(), "actor/lr": scheduler.get_last_lr()[0],
                "dist/processes": world,
            })
            metrics = reduce_metrics(accelerator, metrics)
            tracker.log(step, metrics)
            if step == 1:
                tracker.message(f"weights: {sync}")
            last = step == cfg.trainer.total_steps or _out_of_time(cfg, run_start)
            if (cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0) or last:
                evaluate(step)
            if (cfg.trainer.save_every and step % cfg.trainer.save_every == 0) or last:
                checkpointer.save(state)
            if last and step < cfg.trainer.total_steps:
                tracker.message(f"stopping at step {step}: time limit {cfg.trainer.time_limit_s:.0f}s reached")
                break

    # ---------------------------------------------------------------------------------------------- the end
    summary = state.summary()
    if stop.signum:  # interrupted: checkpoint at this step boundary, and say how to continue
        summary["stopped_by"] = stop.name
        saved = checkpointer.save(state)
        tracker.message(f"{stop.name}: stopped at step {state.step}, checkpoint {saved}. To continue, run the same "
                        f"command: {resume_command(sys.argv[1:] if argv is None else argv, cfg.trainer.resume)}")
    if cfg.logging.plot:
        path = tracker.plot(f"{cfg.env.id} · {cfg.algorithm.name.upper()} · {Path(args.config).stem}")
        summary["curves"] = str(path) if path else None
    tracker.message(
        f"{'stopped' if stop.signum else 'done'}: {summary['steps']} steps in {summary['elapsed_s']:.0f}s | "
        f"held-out success "
        f"{_pct(summary['start_val_success'])} (before RL) -> {_pct(summary['final_val_success'])} | "
        f"metrics {out / 'metrics.jsonl'}" + (f" | curves {summary.get('curves')}" if summary.get("curves") else ""))
    tracker.close()
    driver.close()
    eval_driver.close()
    asyncio.run(backend.close())
    return summary


# ================================================================================================== pieces
def to_training_tensors(samples, pad_token_id: int, device) -> dict:
    """Padded batch with every per-token tensor full length [B, L] (prompt + response), aligned with input_ids."""
    batch = pad_samples(samples, pad_token_id)
    P = batch["prompts"].shape[1]

    def full(response_part):
        return torch.cat([torch.zeros(response_part.shape[0], P), response_part], dim=1)

    data = {
        "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
        "position_ids": batch["position_ids"], "turn_ids": batch["turn_ids"],
        "target": full(batch["loss_mask"]), "rewards": full(batch["token_level_rewards"]),
        "rollout_lp": full(batch["rollout_logprobs"]), "episode_rewards": batch["episode_rewards"],
    }
    return {k: v.to(device) for k, v in data.items()}


def forward(model, data: dict, cfg: Config, layout: str, rows=None, critic: bool = False, with_entropy: bool = False):
    """Per-token logprobs (and entropy) — or values for the critic — for `rows` of `data`, in micro-batches.

    Packed layout: each micro-batch's rows are concatenated without padding and attend block-diagonally; results
    come back in the padded [rows, L] layout either way.
    """
    rows = torch.arange(data["input_ids"].shape[0], device=data["input_ids"].device) if rows is None else rows
    outs, ents = [], []
    for chunk in rows.split(cfg.trainer.micro_batch_size):
        lp, ent = _forward_micro(model, {k: data[k][chunk] for k in ("input_ids", "attention_mask", "position_ids",
                                                                     "target")}, cfg, layout, critic, with_entropy)
        outs.append(lp)
        ents.append(ent)
    return torch.cat(outs), (torch.cat(ents) if with_entropy else None)


def _forward_micro(model, mb: dict, cfg: Config, layout: str, critic: bool, with_entropy: bool):
    kwargs = {} if critic else {"temperature": max(cfg.rollout.temperature, 1e-6) if cfg.rollout.temperature > 0
                                else 1.0, "with_entropy": with_entropy}
    if layout == "padded":
        out = model(mb["input_ids"], mb["target"], attention_mask=mb["attention_mask"],
                    position_ids=mb["position_ids"], **kwargs)
        return (out, None) if critic else out
    keep = mb["attention_mask"].bool()
    seq_ids = torch.arange(keep.shape[0], device=keep.device)[:, None].expand_as(keep)[keep][None]
    packed = model(mb["input_ids"][keep][None], mb["target"][keep][None], position_ids=mb["position_ids"][keep][None],
                   seq_ids=seq_ids, **kwargs)
    lp, ent = (packed, None) if critic else packed

    def unpack(x):
        full = torch.zeros(keep.shape, dtype=x.dtype, device=x.device)
        full[keep] = x[0]
        return full

    return unpack(lp), (unpack(ent) if ent is not None else None)


def update(policy, critic, optimizer, critic_optimizer, accelerator, cfg: Config, layout: str, data: dict, old_lp,
           ref_lp, old_values, advantages, returns, step: int) -> dict:
    """The masked, clipped PPO update: `epochs` passes of mini-batches, each accumulated over micro-batches.

    Normalisers (sampled tokens, sequences) are those of the whole mini-batch across processes, so that micro-batch
    losses add up to the mini-batch loss and the gradient DDP averages is the gradient of the global loss."""
    a, t = cfg.algorithm, cfg.trainer
    B = data["input_ids"].shape[0]
    world = accelerator.num_processes
    n_mini = max(1, math.ceil(B / (t.minibatch_size // world)))  # minibatch_size is global
    n_mini = int(_global(accelerator, n_mini, "max"))
    policy.train()
    stats: dict[str, list] = {}
    generator = torch.Generator().manual_seed(hash((cfg.seed, step)) % 2**31)
    constant = cfg.env.budget.max_response_tokens
    for _ in range(t.epochs):
        order = torch.randperm(B, generator=generator).to(data["input_ids"].device)
        for mb_rows in order.tensor_split(n_mini):
            target = data["target"][mb_rows]
            # each process divides its share by (global count / processes); DDP then averages the gradients: the
            # result is exactly the gradient of the global mini-batch loss
            norms = {"norm_tokens": _global(accelerator, target.sum(), "sum") / world,
                     "norm_seqs": _global(accelerator, (target.sum(-1) > 0).sum(), "sum") / world, "constant": constant}
            micro = list(mb_rows.split(t.micro_batch_size)) or [mb_rows]
            n_micro = int(_global(accelerator, len(micro), "max"))
            micro += [mb_rows[:0]] * (n_micro - len(micro))  # equal counts on every process (collectives line up)
            bad = False
            for k, rows in enumerate(micro):
                last = k == len(micro) - 1
                empty = rows.numel() == 0
                rows = rows if not empty else mb_rows[:1]  # an empty slot runs one row with zero weight
                weight = 0.0 if empty else 1.0
                ctx = contextlib.nullcontext() if last else accelerator.no_sync(policy)
                with ctx:
                    lp, ent = forward(policy, data, cfg, layout, rows, with_entropy=a.entropy_coef > 0)
                    mask = data["target"][rows] * weight
                    is_w = (algos.truncated_is_weights(old_lp[rows], data["rollout_lp"][rows], a.tis_cap)
                            if a.tis_cap else None)
                    pg, pg_stats = algos.policy_loss(lp, old_lp[rows], advantages[rows], mask, a.clip_low,
                                                     a.clip_high, a.dual_clip, a.loss_agg, is_w, **norms)
                    loss = pg
                    if ent is not None:
                        entropy = algos.aggregate(ent, mask, a.loss_agg, **norms)
                        loss = loss - a.entropy_coef * entropy
                        _add(stats, "actor/entropy", entropy.item() * len(micro))
                    if ref_lp is not None and a.kl_mode == "loss":
                        kl = algos.aggregate(algos.kl_estimate(lp, ref_lp[rows], a.kl_estimator), mask, a.loss_agg,
                                             **norms)
                        loss = loss + a.kl_coef * kl
                        _add(stats, "actor/kl_ref", kl.item() * len(micro))
                    if critic is not None:
                        values, _ = forward(critic, data, cfg, layout, rows, critic=True)
                        vf, vf_stats = algos.value_loss(values, old_values[rows], returns[rows], mask, a.value_clip,
                                                        a.loss_agg, **norms)
                        loss = loss + a.value_coef * vf
                        _add(stats, "critic/loss", vf.item() * len(micro))
                        for key, v in vf_stats.items():
                            _add(stats, key, v)
                    if not torch.isfinite(loss):
                        bad = True
                    accelerator.backward(loss)
                _add(stats, "actor/loss", pg.item() * len(micro))
                for key, v in pg_stats.items():
                    _add(stats, key, v)
            params = list(policy.parameters()) + (list(critic.parameters()) if critic is not None else [])
            grad_norm = accelerator.clip_grad_norm_(params, t.max_grad_norm)
            if bad or not torch.isfinite(grad_norm):
                accelerator.print(f"step {step}: skipping an optimizer step: non-finite loss or gradient")
                _add(stats, "actor/skipped_updates", 1.0)
            else:
                optimizer.step()
                if critic_optimizer is not None:
                    critic_optimizer.step()
                _add(stats, "actor/grad_norm", float(grad_norm))
            optimizer.zero_grad(set_to_none=True)
            if critic_optimizer is not None:
                critic_optimizer.zero_grad(set_to_none=True)
    out = {k: float(np.mean(v)) for k, v in stats.items()}
    out["actor/skipped_updates"] = float(sum(stats.get("actor/skipped_updates", [0.0])))
    out["actor/mini_batches"] = float(n_mini * t.epochs)
    return out


def run_eval(driver: RolloutDriver, tasks: list[dict], cfg: Config, accelerator) -> dict:
    """Held-out episodes through the same rollout driver: greedy, or sampled with pass@k over `eval.samples`."""
    overrides = {"temperature": 0.0} if cfg.eval.greedy else {}
    result = driver.run(tasks, n=cfg.eval.samples, step=0, **overrides)
    summary = result.summary()
    metrics = {f"val/{k}": summary[k] for k in ("success", "reward", "turns", "tool_call_rate")}
    metrics["val/failed"] = float(len(result.episodes)) - summary["played"]
    if cfg.eval.samples > 1:
        metrics[f"val/pass@{cfg.eval.samples}"] = summary["pass@n"]
    return reduce_metrics(accelerator, metrics)


def logprob_mismatch(trainer_lp, rollout_lp, target) -> dict:
    """How far the engine's logprobs of the sampled tokens are from the trainer's recomputation."""
    on = target > 0
    if not on.any():
        return {}
    diff = (trainer_lp - rollout_lp)[on].float()
    diff = diff[torch.isfinite(diff)]
    ratio = torch.exp(diff.clamp(-20, 20))
    return {"mismatch/logprob_abs_max": diff.abs().max().item(), "mismatch/logprob_abs_mean": diff.abs().mean().item(),
            "mismatch/ratio_mean": ratio.mean().item(), "mismatch/ratio_max": ratio.max().item(),
            "mismatch/ratio_min": ratio.min().item()}


#: metrics that count things: summed over processes (everything else is averaged)
COUNT_PREFIXES = ("rollout/episodes", "rollout/completed", "rollout/truncated", "rollout/failed", "rollout/skipped",
                  "rollout/tool_errors", "rollout/parse_errors", "rollout/generated_tokens", "rollout/finish_",
                  "rollout/end/", "val/failed", "grpo/groups", "grpo/zero_variance_groups")


def reduce_metrics(accelerator, metrics: dict) -> dict:
    """Combine the processes' metrics: counts are summed, the rest averaged. Processes may report different keys
    (e.g. episode end reasons), so the dicts are gathered as objects, not as one tensor."""
    if accelerator.num_processes == 1:
        return metrics
    from accelerate.utils import gather_object

    everyone = gather_object([metrics])
    out = {}
    for key in sorted({k for d in everyone for k in d}):
        values = [float(d[key]) for d in everyone if key in d]
        out[key] = sum(values) if key.startswith(COUNT_PREFIXES) else sum(values) / len(values)
    return out


def _add(stats: dict, key: str, value: float) -> None:
    stats.setdefault(key, []).append(value)


def _global(accelerator, x, op: str) -> float:
    """`x` (a number on each process) summed, or its min or max, over the processes."""
    t = torch.as_tensor(x, dtype=torch.float32, device=accelerator.device).reshape(1)
    if accelerator.num_processes == 1:
        return float(t)
    if op == "sum":
        return float(accelerator.reduce(t, reduction="sum"))
    gathered = accelerator.gather(t)
    return float(gathered.min() if op == "min" else gathered.max())


def _lr_lambda(cfg: Config):
    t = cfg.trainer

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / (t.warmup_steps + 1)
        progress = (step - t.warmup_steps) / max(1, t.total_steps - t.warmup_steps)
        if t.lr_schedule == "linear":
            return max(0.0, 1.0 - progress)
        if t.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


def _out_of_time(cfg: Config, start: float) -> bool:
    return cfg.trainer.time_limit_s is not None and time.perf_counter() - start > cfg.trainer.time_limit_s


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


if __name__ == "__main__":
    sys.exit(entry_point(main))
