"""Supervised warm start on an env's demonstrations, through the same conversation layer and loss masks as RL.

Demonstrations are *played through the env*: the expert's assistant turns are the actions, the tools really run,
and the training samples come from `Conversation.samples()` — so SFT trains on exactly the tokens RL would (only
the assistant's), with the same template deltas around them.
"""

from __future__ import annotations

import time

import numpy as np

from mt_env.batch import collate
from mt_env.errors import BudgetError
from mt_env.sample import Sample
from mt_env.turn import ModelTurn

from .algos import masked_mean


def demonstration_samples(make_env, tasks: list[dict], skill: float, seed: int) -> list[Sample]:
    """Training samples of the env's demonstrations for `tasks` (imperfect when `skill` < 1)."""
    env = make_env().unwrapped
    rng = np.random.default_rng([seed, 7])
    samples: list[Sample] = []
    skipped = 0
    for task in tasks:
        try:
            env.reset(options={"task": task})
        except BudgetError:  # a prompt over the token budget: no demonstration for it, as in RL
            skipped += 1
            continue
        fmt = env.conversation.fmt
        for text in env.demonstration(task, rng, skill)[::2]:  # assistant turns; tool results come from the tools
            _, _, terminated, truncated, _ = env.step(ModelTurn(ids=fmt.encode(text) + [fmt.end_of_turn_id]))
            if terminated or truncated:
                break
        samples += env.conversation.samples()
    env.close()
    if not samples:
        raise BudgetError(f"all {skipped} demonstration prompts are over the token budget (rollout.max_prompt_tokens)")
    return samples


def sft_warm_start(policy, optimizer, samples: list[Sample], pad_token_id: int, steps: int, batch_size: int,
                   accelerator, tracker, seed: int, time_limit_s: float | None = None) -> dict:
    """`steps` of token-mean negative log-likelihood on the sampled (assistant) tokens of `samples`."""
    device = accelerator.device
    rng = np.random.default_rng([seed, 11])
    start = time.perf_counter()
    policy.train()
    losses = []
    step = 0
    for step in range(1, steps + 1):
        rows = [samples[i] for i in rng.integers(len(samples), size=batch_size)]
        batch = collate(rows, pad_token_id).to(device)
        logprobs, _ = policy(batch.input_ids, batch.loss_mask, attention_mask=batch.attention_mask,
                             position_ids=batch.position_ids)
        loss = -masked_mean(logprobs, batch.loss_mask)
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps:
            tracker.message(f"sft step {step:>4}/{steps} | loss {np.mean(losses[-50:]):.4f} | "
                            f"{time.perf_counter() - start:.0f}s")
        if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
            tracker.message(f"sft: time limit {time_limit_s:.0f}s reached after {step} steps")
            break
    return {"sft/steps": step, "sft/loss": float(np.mean(losses[-50:])) if losses else float("nan"),
            "sft/time_s": time.perf_counter() - start}
