"""Supervised warm start on an env's demonstrations, through the same conversation layer and loss masks as RL.

Demonstrations are *played through the env*: the expert's assistant turns are the actions, the tools really run,
and the training samples come from `Conversation.samples()` — so SFT trains on exactly the tokens RL would (only
the assistant's), with the same template deltas around them.

SFT checkpoints like RL (`WarmStart.run`): every ``sft.save_every`` steps, at its last step, and at the step
boundary after Ctrl-C/SIGTERM, into the run's ``checkpoint_0`` (no RL step yet), whose manifest records the SFT
steps done. A checkpoint taken during SFT also holds SFT's own state (`WarmStart.state_dict`: its optimizer and
recent losses); the batch of step k is drawn from a generator seeded by (seed, k), so nothing else is needed to
continue exactly where it stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from mt_env.batch import collate
from mt_env.errors import BudgetError
from mt_env.sample import Sample
from mt_env.turn import ModelTurn

from .algos import masked_mean
from .checkpoints import RunState
from .optim import AdamW
from .stopping import StopRequested

#: losses averaged in the log line and in ``sft/loss``
LOSS_WINDOW = 50


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
        raise BudgetError(f"all {skipped} demonstration prompts are over the token budget "
                          f"(env.budget.max_prompt_tokens)")
    return samples


class SFTStopped(Exception):
    """SFT was stopped by a signal at a step boundary, after its checkpoint was saved; the message says which."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class WarmStart:
    """Token-mean negative log-likelihood on the sampled (assistant) tokens of `samples`, `sft_cfg.steps` steps of
    `sft_cfg.batch_size` samples each, with an AdamW of its own.

    The optimizer is not passed to ``accelerator.prepare``: prepared optimizers go into every checkpoint, and this
    one is dead once RL starts (the prepared policy already synchronises gradients across processes). A checkpoint
    taken during SFT carries it through `state_dict` instead."""

    def __init__(self, policy, samples: list[Sample], pad_token_id: int, sft_cfg, seed: int, accelerator):
        self.policy = policy
        self.samples = samples
        self.pad_token_id = pad_token_id
        self.cfg = sft_cfg
        self.seed = seed
        self.accelerator = accelerator
        self.optimizer = AdamW(policy.parameters(), lr=sft_cfg.lr)
        self.losses: list[float] = []  #: the last `LOSS_WINDOW` steps' losses

    def step(self, k: int) -> float:
        """SFT step `k` (1-based): its batch depends on the seed and `k` only. Returns the loss."""
        rng = np.random.default_rng([self.seed, 11, k])
        rows = [self.samples[i] for i in rng.integers(len(self.samples), size=self.cfg.batch_size)]
        batch = collate(rows, self.pad_token_id).to(self.accelerator.device)
        self.policy.train()
        logprobs, _ = self.policy(batch.input_ids, batch.loss_mask, attention_mask=batch.attention_mask,
                                  position_ids=batch.position_ids)
        loss = -masked_mean(logprobs, batch.loss_mask)
        self.accelerator.backward(loss)
        self.accelerator.clip_grad_norm_(self.policy.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # no SFT gradient is left for RL's first update to add to
        self.losses = (self.losses + [loss.item()])[-LOSS_WINDOW:]
        return self.losses[-1]

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "losses": list(self.losses)}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.losses = [float(x) for x in state["losses"]]

    def run(self, state: RunState, tracker, save: Callable[[dict | None], Path]) -> dict:
        """Steps from ``state.sft_steps`` on, counting them there, until `sft_cfg.steps` (or its time limit: this
        session's SFT time), then ``state.sft_done``. `save(sft_state)` checkpoints `state` (with this object's
        state while SFT is unfinished) every ``sft.save_every`` steps and at the end (when that is not 0). The
        first SIGINT/SIGTERM stops at the next step boundary: saved, then `SFTStopped`. Returns the ``sft/*``
        metrics, also logged at step 0."""
        steps, every, acc = self.cfg.steps, self.cfg.save_every, self.accelerator
        start = time.perf_counter()
        with StopRequested(announce=acc.is_main_process) as stop:
            while state.sft_steps < steps and not stop.agreed(acc):
                self.step(state.sft_steps + 1)
                state.sft_steps += 1
                if state.sft_steps % LOSS_WINDOW == 0 or state.sft_steps == steps:
                    tracker.message(f"sft step {state.sft_steps:>4}/{steps} | loss {self.mean_loss():.4f} | "
                                    f"{time.perf_counter() - start:.0f}s")
                if self.cfg.time_limit_s is not None and time.perf_counter() - start > self.cfg.time_limit_s:
                    tracker.message(f"sft: time limit {self.cfg.time_limit_s:.0f}s reached after "
                                    f"{state.sft_steps} steps")
                    break
                if every and state.sft_steps % every == 0 and state.sft_steps < steps:
                    save(self.state_dict())
            stopped = stop.agreed(acc)  # also a signal that came during the last step
        state.sft_done = state.sft_steps >= steps or not stopped
        metrics = {"sft/steps": state.sft_steps, "sft/loss": self.mean_loss(),
                   "sft/time_s": time.perf_counter() - start}
        if state.sft_done:
            tracker.log(0, metrics, console=False)
        if stopped:
            saved = save(None if state.sft_done else self.state_dict())
            held, then = (("the model", "goes on with RL") if state.sft_done else
                          ("the model and SFT's optimizer", f"continues SFT from step {state.sft_steps + 1}"))
            raise SFTStopped(stop.signum, f"{stop.name}: stopped SFT after step {state.sft_steps} of {steps}; "
                                          f"checkpoint {saved} holds {held}: the same command {then}")
        if every:
            save(None)
        return metrics

    def mean_loss(self) -> float:
        return float(np.mean(self.losses)) if self.losses else float("nan")
