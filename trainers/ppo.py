#!/usr/bin/env python
"""PPO and GRPO for multi-turn tool use, readable top to bottom.

    python trainers/ppo.py                                   # the offline quickstart (Calculator-v0, CPU)
    python trainers/ppo.py --config gsm8k_qwen2.5_0.5b.yaml --set trainer.lr=2e-6 --set rollout.n=8
    accelerate launch --num_processes 2 trainers/ppo.py --config ...          # DDP
    accelerate launch --config_file trainers/configs/accelerate/fsdp2.yaml trainers/ppo.py --config ...  # FSDP2
    accelerate launch --num_processes 2 trainers/ppo.py --config ... --set trainer.async_rollout=true  # off-policy

One training step (`main`, after `build` made the run):

1. **rollout** — episodes of the env played by the policy through the async rollout driver (`agents.rollout`);
   their conversations become samples, collated into one `TrainBatch` whose ``loss_mask`` is 1 exactly on the
   tokens the model sampled. That mask keeps its name and layout down to the loss.
2. **old / reference logprobs, values** — recomputed by the trainer on those exact ids (compared with the engine's:
   the rollout/trainer mismatch); with one optimizer step per batch, the update's own, detached (`single_update`).
3. **rewards** — each turn's tool reward on its last sampled token, the final reward on the last one; optionally
   minus a KL penalty to the reference model.
4. **advantages** — GRPO: the episode's return normalised within its group of ``n`` samples of one task; PPO: GAE
   over sampled tokens only (tool and template tokens are skipped, not zero-rewarded), with a critic. Some episodes
   are recorded from this batch, token by token (`trainers.recording`).
5. **update** — epochs of masked, clipped mini-batch updates (gradient accumulation over micro-batches).
6. **log, sync, evaluate, checkpoint.**

Around the loop: `open_run` starts, resumes or declines the run in ``output_dir`` (`trainers.checkpoints`);
Ctrl-C/SIGTERM stop it at a step boundary with a checkpoint (`trainers.stopping`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# OpenMP reads its wait policy once, when torch loads it. PASSIVE: a CPU thread that waits for the others sleeps
# instead of spinning, so another busy process (or this one's engine and env threads) slows the steps in proportion
# instead of many times over (docs/trainer_config.md, "CPU threads"). A value in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelerate import Accelerator
from accelerate.utils import set_seed

from mt_env.batch import TrainBatch, collate, micro_batches, pack
from mt_env.errors import debug_flag
from trainers import algos
from trainers.async_rollout import Link, RemoteRollouts, open_link, serve
from trainers.checkpoints import Checkpointer, RunPlan, RunState, plan_run, read_sft_state
from trainers.config import Config, load_config
from trainers.distributed import (FullStateDict, across_processes, compile_totals, forward_passes_everywhere,
                                  frozen_reference, fsdp_sharding, initialize_root, peak_memory, reduce_metrics,
                                  token_means)
from trainers.lora import AdaptersOff, has_adapters
from trainers.modeling import PolicyModel
from trainers.optim import AdamW
from trainers.profiling import StepProfile
from trainers.recording import Recorder
from trainers.rollouts import LocalRollouts, eval_metrics, make_rollouts
from trainers.setup import (TaskSource, env_factory, eval_tasks, frozen_copy, lr_factor, make_accelerator,
                            make_models, make_tokenizer, model_summary)
from trainers.sft import SFTStopped, WarmStart, demonstration_samples
from trainers.stopping import EmptySteps, StopRequested, entry_point, resume_command
from trainers.tracking import Tracker


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="PPO / GRPO for multi-turn tool-using LLM agents (mt_env)")
    ap.add_argument("--config", default="quickstart.yaml", help="recipe YAML (a path or a name in trainers/configs)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. trainer.lr=1e-6")
    debug_flag(ap)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = load_config(args.config, args.set)
    accelerator, plan, link = open_run(cfg)  # a new run, a resume from its newest checkpoint, or nothing to do
    if plan.finished:
        return plan.state.summary()
    try:
        run = build(cfg, accelerator, plan, link)
    except SFTStopped as e:  # Ctrl-C during SFT: saved at an SFT step boundary
        return stopped_in_sft(e, cfg, accelerator, plan.state, sys.argv[1:] if argv is None else argv)
    if link is not None and not link.trains:  # trainer.async_rollout: this process generates for the trainer
        return serve(run.rollouts, link, run.lm)
    acc, t = run.accelerator, cfg.trainer
    if run.state.first_eval is None:
        evaluate(run, 0)  # the starting level (after SFT): what RL has to beat

    profile = StepProfile(t.profile_step, Path(cfg.output_dir) / "profile", acc.process_index, run.tracker.message)
    with StopRequested(announce=acc.is_main_process) as stop, profile:  # Ctrl-C: stop at the next step, with a save
        while run.state.step < t.total_steps and not stop.agreed(acc):
            step, step_start = run.state.step + 1, time.perf_counter()
            profile.at(step)  # trainer.profile_step: this step under torch.profiler

            # 1. ROLLOUT: each process plays its share of the step's tasks, n samples each (a GRPO group per task)
            tasks = run.tasks.next(cfg.rollout.prompts_per_step)[acc.process_index::acc.num_processes]
            result = run.rollouts.play(tasks, n=cfg.rollout.n, step=step)
            metrics = dict(result.metrics, **{"perf/rollout_s": time.perf_counter() - step_start})
            # every process needs trainable tokens for the update's collectives to line up: otherwise all skip it
            if across_processes(acc, sum(sum(s.loss_mask()) for s in result.samples), "min") == 0:
                run.tracker.message(f"step {step}: skipping the update: no trainable tokens ("
                                    f"{metrics['rollout/failed']:.0f} failed, {metrics['rollout/skipped']:.0f} "
                                    f"skipped of {len(result.episodes)} episodes)")
                run.state.step = step
                metrics = log_metrics(run, step, metrics)
                run.empty_steps.add(step, metrics, result.episodes)  # a few in a row stop the run, naming the cause
                continue
            batch = collate(result.samples, run.tokenizer.pad_token_id).to(acc.device)

            # 2. OLD / REFERENCE LOGPROBS AND VALUES on the exact ids of the rollout
            reuse = single_update(batch, acc, cfg)  # then the update's own logprobs are the old ones
            batch, score_times = score(batch, run.models, cfg, old=not reuse)
            exact = cfg.rollout.exact_logprobs
            metrics.update(score_times, **({} if reuse else algos.logprob_mismatch(batch, exact)))

            # 3. REWARDS and 4. ADVANTAGES
            batch, advantage_stats = estimate_advantages(batch, cfg)
            metrics.update(advantage_stats)
            finite = all(bool(torch.isfinite(x[batch.loss_mask > 0]).all())
                         for x in (batch.old_logprobs, batch.advantages) if x is not None)
            if across_processes(acc, float(finite), "min") == 0:  # all skip together: the update's collectives
                run.recorder.record_step(step, tasks, result, batch)  # trajectories/: a step worth looking at
                run.tracker.message(f"step {step}: skipping the update: non-finite logprobs or advantages")
                run.state.step = step
                run.empty_steps.add_non_finite(step, "non-finite logprobs or advantages", t.lr)
                continue

            # 5. UPDATE: epochs x mini-batches x micro-batches, masked and clipped; then the backend's weights
            update_start = time.perf_counter()
            update_metrics, old_logprobs = update(batch, run.models, acc, cfg, step)
            metrics.update(update_metrics)
            run.models.scheduler.step()
            update_s = time.perf_counter() - update_start
            if old_logprobs is not None:  # a single update: its own logprobs were the old ones
                batch = batch.replace(old_logprobs=old_logprobs)
            metrics.update(run.recorder.record_step(step, tasks, result, batch))  # trajectories/
            sync = run.rollouts.after_update()

            # 6. LOG, EVALUATE, CHECKPOINT
            run.state.step = step
            metrics.update({
                "perf/step_s": time.perf_counter() - step_start, "perf/update_s": update_s,
                "perf/tokens": float(batch.attention_mask.sum()), "perf/trained_tokens": float(batch.loss_mask.sum()),
                "perf/sequences": len(batch), "perf/epochs": t.epochs, "perf/profiled": float(profile.active),
                "perf/elapsed_s": run.state.elapsed(), "actor/lr": run.models.scheduler.get_last_lr()[0],
                "dist/processes": acc.num_processes, **peak_memory(acc.device), **compile_totals(),
            })
            metrics = log_metrics(run, step, metrics)
            run.empty_steps.updated(step, metrics, t.lr)  # an update whose optimizer steps were all skipped counts
            if step == 1:
                run.tracker.message(f"weights: {sync}")
            last = step == t.total_steps or _out_of_time(cfg, run.start)
            if (t.eval_every and step % t.eval_every == 0) or last:
                evaluate(run, step)
            if (t.save_every and step % t.save_every == 0) or last:
                save_checkpoint(run)
            if last and step < t.total_steps:
                run.tracker.message(f"stopping at step {step}: time limit {t.time_limit_s:.0f}s reached")
                break
    return finish(run, args.config, stopped_by=stop.name, argv=sys.argv[1:] if argv is None else argv)


# ================================================================================================== the run
@dataclass
class Models:
    """The models of a run as accelerate prepared them: the policy (a `PolicyModel`), PPO's critic, the frozen KL
    reference (the policy as RL starts), and what optimizes them."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    critic: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    reference: torch.nn.Module | None = None

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.policy.parameters()) + (list(self.critic.parameters()) if self.critic is not None else [])

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.optimizer, self.critic_optimizer) if o is not None]


@dataclass
class Run:
    """Everything the training loop needs, made once by `build`."""

    cfg: Config
    accelerator: Accelerator
    tracker: Tracker
    tokenizer: Any
    models: Models
    lm: torch.nn.Module  #: the plain HF module inside the policy: generation runs on it, sharing the weights
    rollouts: LocalRollouts | RemoteRollouts  #: plays the episodes (`trainers.rollouts`) and the evaluations
    tasks: TaskSource  #: training tasks, with a position that checkpoints restore
    held_out: list[dict]  #: evaluation tasks
    state: RunState  #: the step, the run's clock and its evaluations: saved in every checkpoint's manifest
    checkpointer: Checkpointer | None  #: None on the generator process of async mode (it saves nothing)
    start: float  #: `time.perf_counter()` when this session started (`trainer.time_limit_s`)
    recorder: Recorder  #: writes a sample of the episodes trained on, token by token (`trainers.recording`)
    empty_steps: EmptySteps = field(default_factory=EmptySteps)  #: steps in a row that trained nothing


def open_run(cfg: Config) -> tuple[Accelerator, RunPlan, Link | None]:
    """The processes, and what this command does with output_dir (`trainers.checkpoints.plan_run`): start a run,
    resume one, or nothing if it is finished; the main process says which, and why. In async mode the two
    processes are joined by a `Link` (each is a one-process run for accelerate)."""
    link = open_link(cfg) if cfg.trainer.async_rollout else None
    accelerator = make_accelerator(cfg)
    plan = plan_run(cfg)
    for note in plan.notes if link is None or link.trains else ():  # the checkpoint it resumes from, and why
        accelerator.print(note)
    accelerator.wait_for_everyone()  # every process has read the run directory before the main one writes to it
    if link is not None:
        link.barrier()
    return accelerator, plan, link


def build(cfg: Config, accelerator: Accelerator, plan: RunPlan, link: Link | None = None) -> Run:
    """The run described by `cfg` and `plan`: tracker, tokenizer, envs and tasks, models and optimizers (after the
    SFT warm start, or restored from the plan's checkpoint) and where the episodes come from. In async mode
    (`link`) the trainer builds no engine and the generator nothing that trains: it gets its weights from the
    trainer."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    set_seed(cfg.seed, device_specific=False)
    state, resuming, trains = plan.state, plan.checkpoint is not None, link is None or link.trains
    tracker = Tracker(Path(cfg.output_dir), cfg.to_dict(), enabled=accelerator.is_main_process and trains,
                      jsonl=cfg.logging.jsonl, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                      wandb_project=cfg.logging.wandb_project, resume_step=state.step if resuming else None,
                      resume_rows=state.metrics_rows, clock=state.elapsed)
    start = time.perf_counter()
    tokenizer = make_tokenizer(cfg)
    make_env, make_eval_env = env_factory(cfg, tokenizer), env_factory(cfg, tokenizer, eval_env=True)
    probe_env = make_env().unwrapped
    tasks = TaskSource(probe_env, seed=cfg.seed)
    held_out = eval_tasks(cfg, make_eval_env().unwrapped)
    models, reference = _trainable_models(cfg, tokenizer, accelerator, trains)
    lm = accelerator.unwrap_model(models.policy).lm
    tracker.message(model_summary(cfg, lm))
    checkpointer = Checkpointer(accelerator, plan, cfg.trainer.keep_last, lm, tokenizer, tracker) if trains else None
    if trains:
        accelerator.register_for_checkpointing(tasks)
        in_sft = not state.sft_done  # a new run, or one stopped during SFT: its checkpoint has no KL reference yet
        if resuming and in_sft:
            accelerator.load_state(str(plan.checkpoint))
        if in_sft:
            _warm_start(cfg, make_env, TaskSource(probe_env, seed=cfg.seed + 1), models.policy, accelerator, tracker,
                        state, checkpointer, plan.checkpoint)
        if reference is not None:  # the KL reference is the policy as RL starts (after SFT), or as checkpointed
            policy = accelerator.unwrap_model(models.policy)
            models.reference = frozen_reference(reference, policy, fsdp_sharding(accelerator))
            accelerator.register_for_checkpointing(FullStateDict(models.reference))
        if resuming and not in_sft:
            accelerator.load_state(str(plan.checkpoint))
    if link is not None and link.trains:
        rollouts = RemoteRollouts(link, lm, tasks, cfg.trainer.total_steps)
    else:
        weights_changed = bool(cfg.sft.steps) or resuming or not cfg.model.path
        rollouts = make_rollouts(cfg, accelerator, models.policy, lm, tokenizer, make_env, make_eval_env,
                                 weights_changed)
    recorder = Recorder(cfg.output_dir, tokenizer, cfg.logging.record_every, cfg.logging.record_episodes,
                        enabled=accelerator.is_main_process and trains, resume_step=state.step if resuming else None)
    return Run(cfg=cfg, accelerator=accelerator, tracker=tracker, tokenizer=tokenizer, models=models, lm=lm,
               rollouts=rollouts, tasks=tasks, held_out=held_out, state=state, checkpointer=checkpointer,
               start=start, recorder=recorder)


def _trainable_models(cfg: Config, tokenizer, accelerator: Accelerator,
                      trains: bool = True) -> tuple[Models, PolicyModel | None]:
    """The policy and (PPO) the critic with their optimizers and the learning-rate schedule, prepared by accelerate;
    and, when the loss has a KL term, an unprepared frozen copy of the policy for the reference (FSDP modules
    cannot be copied once sharded). The generator of async mode (`trains` false) needs only the policy."""
    lm, critic_model = make_models(cfg, tokenizer, accelerator.device, critic=trains)
    policy = PolicyModel(lm, vocab_limit=len(tokenizer), exact=cfg.rollout.exact_logprobs)
    uses_reference = trains and cfg.algorithm.kl_mode != "none" and cfg.algorithm.kl_coef > 0
    lora = has_adapters(lm)  # then the reference is the policy with its adapters off (`AdaptersOff`): no copy
    reference = PolicyModel(frozen_copy(lm), vocab_limit=len(tokenizer)) if uses_reference and not lora else None
    optimizer = AdamW(policy.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
    models = Models(*accelerator.prepare(policy, optimizer, scheduler))
    initialize_root(models.policy, accelerator.device)
    models.reference = AdaptersOff(models.policy) if uses_reference and lora else None
    if critic_model is not None:
        critic_optimizer = AdamW(critic_model.parameters(), lr=cfg.trainer.critic_lr)
        models.critic, models.critic_optimizer = accelerator.prepare(critic_model, critic_optimizer)
    return models, reference


def _warm_start(cfg: Config, make_env, demo_source: TaskSource, policy, accelerator: Accelerator, tracker: Tracker,
                state: RunState, checkpointer: Checkpointer, checkpoint: Path | None) -> None:
    """SFT on the env's demonstrations, played through the env (its own task stream, disjoint from training's),
    from ``state.sft_steps`` on (with SFT's state from `checkpoint`, a run stopped during SFT); it checkpoints as
    `WarmStart.run` says, and raises `SFTStopped` when a signal stopped it."""
    if not cfg.sft.steps:
        state.sft_done = True
        return
    demo_tasks = demo_source.next(min(4096, cfg.sft.steps * cfg.sft.batch_size))
    samples = demonstration_samples(make_env, demo_tasks, cfg.sft.demo_skill, cfg.seed)
    sft = WarmStart(policy, samples, demo_source.env.tokenizer.pad_token_id, cfg.sft, cfg.seed, accelerator)
    if checkpoint is not None:
        sft.load_state_dict(read_sft_state(checkpoint, accelerator.process_index))
    tracker.message(f"sft: {len(samples)} demonstration samples (skill {cfg.sft.demo_skill}), {cfg.sft.steps} steps"
                    + (f", from step {state.sft_steps + 1}" if state.sft_steps else ""))
    sft.run(state, tracker, save=functools.partial(checkpointer.save, state))


# ================================================================================================== one step
def forward(model, mb: TrainBatch, cfg: Config, critic: bool = False, with_entropy: bool = False):
    """`model` on one micro-batch: (logprobs, entropy or None) for the policy, values for the critic; every output
    ``[b, L]`` aligned with ``mb.input_ids`` and non-zero only where ``mb.loss_mask`` is. With ``trainer.packed``
    the rows run end to end without padding, attending block-diagonally (`mt_env.batch.pack`)."""
    temperature = max(cfg.rollout.temperature, 1e-6) if cfg.rollout.temperature > 0 else 1.0
    kwargs = {} if critic else {"temperature": temperature, "with_entropy": with_entropy}
    if not cfg.trainer.packed:
        return model(mb.input_ids, mb.loss_mask, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                     **kwargs)
    rows = pack(mb)
    out = model(rows.input_ids, rows.loss_mask, position_ids=rows.position_ids, seq_ids=rows.seq_ids, **kwargs)
    return rows.unpack(out) if critic else tuple(None if x is None else rows.unpack(x) for x in out)


@torch.no_grad()
def score(batch: TrainBatch, models: Models, cfg: Config, old: bool = True) -> tuple[TrainBatch, dict]:
    """The batch with the policy's logprobs before the update (`old_logprobs`; with `old` False, None: the update
    takes its own), the reference's and the critic's values on its exact ids, computed in micro-batches; and each
    pass's seconds (``perf/<pass>_s``)."""
    models.policy.eval()  # no dropout in the scoring passes (`update` sets train mode again)
    rows = torch.arange(len(batch), device=batch.input_ids.device)
    chunks = micro_batches(batch, rows, (t := cfg.trainer).micro_batch_size, t.micro_batch_tokens, t.packed)
    # under FSDP every forward pass all-gathers: a process with fewer chunks runs one-row passes it discards
    padding = [rows[:1]] * (forward_passes_everywhere(len(chunks), models.policy) - len(chunks))
    seconds = {}

    def each(name, model, critic=False):
        start = time.perf_counter()
        outputs = [forward(model, batch[r], cfg, critic=critic) for r in chunks + padding][:len(chunks)]
        out = torch.cat(outputs if critic else [logprobs for logprobs, _ in outputs])
        if out.is_cuda:  # the pass's kernels, not just their launches
            torch.cuda.synchronize(out.device)
        seconds[f"perf/{name}_s"] = time.perf_counter() - start
        return out

    batch = batch.replace(old_logprobs=each("old_logprob", models.policy) if old else None,
                          ref_logprobs=each("ref", models.reference) if models.reference is not None else None,
                          values=each("values", models.critic, critic=True) if models.critic is not None else None)
    return batch, seconds


@torch.no_grad()
def estimate_advantages(batch: TrainBatch, cfg: Config) -> tuple[TrainBatch, dict]:
    """GRPO: the episode's return normalised within its group, on every sampled token. PPO: GAE over sampled tokens
    on the token-level rewards (minus the KL penalty with ``kl_mode: reward``), with the critic's values."""
    a = cfg.algorithm
    if a.name == "grpo":
        seq_adv, stats = algos.grpo_advantages(batch.episode_rewards, batch.group.tolist(), batch.episode.tolist(),
                                               a.norm_adv_by_std)
        return batch.replace(advantages=seq_adv[:, None] * batch.loss_mask), stats
    rewards, stats = batch.rewards, {}
    if batch.ref_logprobs is not None and a.kl_mode == "reward":
        kl = algos.kl_estimate(batch.old_logprobs, batch.ref_logprobs, a.kl_estimator)
        rewards = rewards - a.kl_coef * torch.where(batch.loss_mask > 0, kl, torch.zeros_like(kl))
        stats["actor/kl_ref"] = algos.masked_mean(kl, batch.loss_mask).item()
    advantages, returns = algos.masked_gae(rewards, batch.values, batch.loss_mask, a.gamma, a.lam, batch.turn_ids,
                                           a.turn_gamma)
    if a.norm_adv_by_std:
        advantages = algos.masked_whiten(advantages, batch.loss_mask)
    return batch.replace(advantages=advantages, returns=returns), stats


def single_update(batch: TrainBatch, accelerator: Accelerator, cfg: Config) -> bool:
    """Whether the update is one optimizer step over the whole batch (one epoch, one global mini-batch) and nothing
    needs the old logprobs before it (no KL penalty in the reward). The policy is then unchanged between the old
    logprobs' pass and the update's forward, so the update's own logprobs, detached, are the old ones: ratio 1, the
    on-policy gradient, one forward pass fewer (TRL's GRPO does the same with ``num_iterations=1``)."""
    a = cfg.algorithm
    kl_in_reward = a.kl_mode == "reward" and a.name != "grpo"  # `estimate_advantages` reads old_logprobs
    return cfg.trainer.epochs == 1 and not kl_in_reward and minibatch_count(len(batch), accelerator, cfg) == 1


def update(batch: TrainBatch, models: Models, accelerator: Accelerator, cfg: Config,
           step: int) -> tuple[dict, torch.Tensor | None]:
    """The masked, clipped PPO update: `epochs` passes of shuffled mini-batches, one optimizer step each, its
    gradient accumulated over micro-batches. Without `batch.old_logprobs` (`single_update`) the update's own
    logprobs are the old ones: the rollout/trainer mismatch is then measured on them and they are returned beside
    the metrics (else None). The statistics stay on the device until the end (one read: no host sync per
    micro-batch)."""
    stats: dict[str, list] = {}
    seen = torch.zeros(batch.loss_mask.shape, device=batch.loss_mask.device) if batch.old_logprobs is None else None
    token_sums, tokens = {}, 0.0  # per-token statistics, weighted by the micro-batch's trained tokens
    generator = torch.Generator().manual_seed(hash((cfg.seed, step)) % 2**31)
    n_mini = minibatch_count(len(batch), accelerator, cfg)  # mini-batches per epoch, asked of the processes once
    models.policy.train()
    optimizer_steps = 0
    for _ in range(cfg.trainer.epochs):
        for minibatch in minibatches(batch, accelerator, cfg, generator, n_mini):
            optimizer_steps += 1
            finite = True
            for k, (rows, weight) in enumerate(minibatch.micro):
                last = k == len(minibatch.micro) - 1
                with contextlib.nullcontext() if last else accelerator.no_sync(models.policy):
                    loss, terms, token_stats, logprobs = ppo_loss(batch[rows], models, cfg, minibatch.norms, weight)
                    finite = torch.isfinite(loss) & finite
                    if seen is not None and weight:
                        seen[rows] = logprobs.float()
                    accelerator.backward(loss)
                for key, value in terms.items():  # each micro-batch's share of the mini-batch loss, scaled up
                    _add(stats, key, value.double() * len(minibatch.micro))
                n = batch.loss_mask[rows].sum().double() * weight
                for key, value in token_stats.items():
                    token_sums[key] = token_sums.get(key, 0.0) + value.double() * n
                tokens += n
            grad_norm = accelerator.clip_grad_norm_(models.trained_parameters(), cfg.trainer.max_grad_norm)
            if finite and torch.isfinite(grad_norm):
                for optimizer in models.optimizers():
                    optimizer.step()
                _add(stats, "actor/grad_norm", float(grad_norm))
            else:
                accelerator.print(f"step {step}: skipping an optimizer step: non-finite loss or gradient")
                _add(stats, "actor/skipped_updates", 1.0)
            for optimizer in models.optimizers():
                optimizer.zero_grad(set_to_none=True)
    stats = _read(stats)
    out = {k: float(np.mean(v)) for k, v in stats.items()}
    out["actor/skipped_updates"] = float(sum(stats.get("actor/skipped_updates", [0.0])))
    out["actor/mini_batches"] = float(optimizer_steps)
    exact = cfg.rollout.exact_logprobs
    mismatch = algos.logprob_mismatch(batch.replace(old_logprobs=seen), exact) if seen is not None else {}
    return {**out, **token_means(accelerator, token_sums, tokens), **mismatch}, seen


def ppo_loss(mb: TrainBatch, models: Models, cfg: Config, norms: dict, weight: float = 1.0):
    """The loss of one micro-batch, as in CleanRL: clipped policy loss − entropy bonus + KL penalty + value loss
    (terms that are off are 0). Reduced with the mini-batch's global normalisers (`norms`), so micro-batch losses
    add up to the mini-batch loss; `weight` 0 runs an empty slot without effect. Without `mb.old_logprobs` the
    policy's own logprobs, detached, are the old ones. Returns (loss, the loss terms detached, per-token
    statistics, the logprobs detached); the terms and statistics as 0-d tensors on the device."""
    a = cfg.algorithm
    loss_mask = mb.loss_mask * weight
    aggregate = functools.partial(algos.aggregate, loss_mask=loss_mask, mode=a.loss_agg, **norms)
    logprobs, entropy = forward(models.policy, mb, cfg, with_entropy=a.entropy_coef > 0)
    old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()
    is_weights = algos.truncated_is_weights(old, mb.rollout_logprobs, a.tis_cap) if a.tis_cap else None
    pg_loss, stats = algos.policy_loss(logprobs, old, mb.advantages, loss_mask, a.clip_low, a.clip_high,
                                       a.dual_clip, a.loss_agg, is_weights, **norms)
    if is_weights is not None:
        stats["actor/tis_weight_mean"] = algos.masked_mean(is_weights, loss_mask)
    terms = {"actor/loss": pg_loss}  # the terms that are on
    if entropy is not None:
        terms["actor/entropy"] = aggregate(entropy)
    if mb.ref_logprobs is not None and a.kl_mode == "loss":
        terms["actor/kl_ref"] = aggregate(algos.kl_estimate(logprobs, mb.ref_logprobs, a.kl_estimator))
    if models.critic is not None:
        values = forward(models.critic, mb, cfg, critic=True)
        terms["critic/loss"], value_stats = algos.value_loss(values, mb.values, mb.returns, loss_mask, a.value_clip,
                                                             a.loss_agg, **norms)
        stats.update(value_stats)
    zero = pg_loss.new_zeros(())
    entropy_bonus, kl, value_loss = (terms.get(k, zero) for k in ("actor/entropy", "actor/kl_ref", "critic/loss"))
    loss = pg_loss - a.entropy_coef * entropy_bonus + a.kl_coef * kl + a.value_coef * value_loss
    return loss, {k: v.detach() for k, v in terms.items()}, stats, logprobs.detach()


@dataclass
class MiniBatch:
    micro: list[tuple[torch.Tensor, float]]  #: (rows, weight) per micro-batch; weight 0: an empty slot
    norms: dict  #: the loss normalisers of the global mini-batch (see `algos.aggregate`)


def minibatches(batch: TrainBatch, accelerator: Accelerator, cfg: Config, generator: torch.Generator,
                n_mini: int) -> Iterator[MiniBatch]:
    """One epoch of `n_mini` (`minibatch_count`) shuffled mini-batches split into micro-batches, with what keeps
    DDP exact: every process runs the same number of mini- and micro-batches (its empty slots run one row with
    weight 0, so the collectives line up), and each process divides its loss by the global mini-batch's counts /
    processes — DDP averages the gradients, so the result is exactly the gradient of the global mini-batch loss."""
    t, world = cfg.trainer, accelerator.num_processes
    order = torch.randperm(len(batch), generator=generator).to(batch.input_ids.device)
    splits = order.tensor_split(n_mini)
    micro = [micro_batches(batch, r, t.micro_batch_size, t.micro_batch_tokens, t.packed) or [r] for r in splits]
    # per mini-batch: trained tokens, sequences with any, micro-batches — from every process, in one collective
    mine = torch.stack([torch.stack([batch.loss_mask[rows].sum(), (batch.loss_mask[rows].sum(-1) > 0).sum(),
                                     torch.tensor(float(len(m)), device=order.device)]).double()
                        for rows, m in zip(splits, micro)])
    everyone = (accelerator.gather(mine) if world > 1 else mine).reshape(world, n_mini, 3)
    totals = torch.cat([everyone[..., :2].sum(0), everyone[..., 2:].amax(0)], -1).tolist()  # one read
    for (tokens, seqs, slots), rows, own in zip(totals, splits, micro):
        norms = {"norm_tokens": tokens / world, "norm_seqs": seqs / world,
                 "constant": cfg.env.budget.max_response_tokens}
        padded = own + [rows[:0]] * (int(slots) - len(own))
        yield MiniBatch([(m, 1.0) if m.numel() else (order[:1], 0.0) for m in padded], norms)


def minibatch_count(rows: int, accelerator: Accelerator, cfg: Config) -> int:
    """Mini-batches per epoch: the most any process needs for its `rows` (all run as many, see `minibatches`)."""
    share = cfg.trainer.minibatch_size // accelerator.num_processes
    return int(across_processes(accelerator, max(1, math.ceil(rows / share)), "max"))



# ================================================================================================== log, evaluate, save
def evaluate(run: Run, step: int) -> dict:
    """Held-out episodes through the same rollout driver (each process plays its share): greedy, or sampled with
    pass@k over `eval.samples`; a sample of the episodes is recorded (`trainers.recording`)."""
    acc = run.accelerator
    tasks = run.held_out[acc.process_index::acc.num_processes]
    result = run.rollouts.evaluate(tasks, step)
    run.recorder.record_eval(step, tasks, result)
    metrics = reduce_metrics(acc, eval_metrics(result, run.cfg.eval.samples))
    run.tracker.log(step, metrics, console=False)
    run.tracker.message(f"eval  {step:>4} | success {metrics['val/success']:.3f} | reward {metrics['val/reward']:.3f} "
                        f"| tool calls {metrics['val/tool_call_rate']:.2f} | turns {metrics['val/turns']:.2f}")
    run.state.record_eval(metrics)
    return metrics


def log_metrics(run: Run, step: int, metrics: dict) -> dict:
    """One step's metrics, combined over the processes, to the console, metrics.jsonl and any trackers; returns
    the combined metrics."""
    metrics = reduce_metrics(run.accelerator, metrics)
    run.tracker.log(step, metrics)
    return metrics


def save_checkpoint(run: Run) -> Path:
    """An atomic checkpoint of this step (`trainers.checkpoints`): models, optimizers, schedulers, RNG states and
    the task stream's position (accelerate), the model's config and tokenizer, and the run's progress."""
    return run.checkpointer.save(run.state)


def finish(run: Run, config_name: str, stopped_by: str | None = None, argv: list[str] | None = None) -> dict:
    """Plot, say how it went, close everything; returns the run's summary. A run stopped by a signal (`stopped_by`)
    is checkpointed at this step boundary first, with the command that continues it (`argv`: this one's)."""
    cfg = run.cfg
    out = Path(cfg.output_dir)
    summary = run.state.summary()
    if stopped_by:
        summary["stopped_by"] = stopped_by
        saved = save_checkpoint(run)
        run.tracker.message(f"{stopped_by}: stopped at step {run.state.step}, checkpoint {saved}. To continue, run "
                            f"the same command: {resume_command(argv or [], cfg.trainer.resume)}")
    if cfg.logging.plot:
        path = run.tracker.plot(f"{cfg.env.id} · {cfg.algorithm.name.upper()} · {Path(config_name).stem}")
        summary["curves"] = str(path) if path else None
    run.tracker.message(
        f"{'stopped' if stopped_by else 'done'}: {summary['steps']} steps in {summary['elapsed_s']:.0f}s | held-out "
        f"success {_pct(summary['start_val_success'])} (before RL) -> {_pct(summary['final_val_success'])} | "
        f"metrics {out / 'metrics.jsonl'}" + (f" | curves {summary.get('curves')}" if summary.get("curves") else ""))
    run.tracker.close()
    run.rollouts.close()
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()  # every process leaves the process group together
    return summary


def stopped_in_sft(stop: SFTStopped, cfg: Config, accelerator: Accelerator, state: RunState, argv: list[str]) -> dict:
    """Say what SFT saved when a signal stopped it and how to continue (`argv`: this command's); the summary."""
    accelerator.print(f"{stop}. To continue, run the same command: {resume_command(argv, cfg.trainer.resume)}")
    accelerator.end_training()
    return state.summary() | {"sft_steps": state.sft_steps, "stopped_by": signal.Signals(stop.signum).name}


# ================================================================================================== helpers
def _add(stats: dict, key: str, value: float | torch.Tensor) -> None:
    stats.setdefault(key, []).append(value)


def _read(stats: dict[str, list]) -> dict[str, list[float]]:
    """`stats` with its 0-d tensors read from the device in one copy (numbers stay as they are)."""
    tensors = [v for values in stats.values() for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack(tensors).tolist() if tensors else ())
    return {k: [next(read) if isinstance(v, torch.Tensor) else v for v in values] for k, values in stats.items()}


def _out_of_time(cfg: Config, start: float) -> bool:
    return cfg.trainer.time_limit_s is not None and time.perf_counter() - start > cfg.trainer.time_limit_s


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


if __name__ == "__main__":
    sys.exit(entry_point(main))
