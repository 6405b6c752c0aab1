"""Where a training step's episodes come from, and its held-out evaluation.

`LocalRollouts` plays them in this process: the rollout driver on the run's generation backend (the embedded HF
engine on the trainer's own module — gathered from its FSDP shards while it generates — or SGLang).
`trainers.async_rollout.RemoteRollouts` has another process play them (one-step off-policy mode). Both offer:

* ``play(tasks, n, step)`` — the step's episodes (`agents.rollout.RolloutResult`);
* ``evaluate(tasks, step)`` — the held-out episodes of this process's share of the evaluation tasks, played with the
  weights of `step` (`eval_metrics` gives their ``val/*`` metrics);
* ``after_update()`` — what brings the updated weights to the generator (a sentence for the log);
* ``close()``.
"""

from __future__ import annotations

import asyncio
import contextlib

from accelerate import Accelerator

from agents.backend import Backend, SamplingParams, counted
from agents.rollout import EpisodeDriver, RolloutDriver, RolloutResult
from agents.rollout_processes import rollout_driver

from .config import Config
from .distributed import gathered_for_generation
from .setup import make_backend, sync_weights


class LocalRollouts:
    """Episodes played in this process (see the module docstring)."""

    def __init__(self, cfg: Config, accelerator: Accelerator, policy, lm, backend: Backend,
                 driver: EpisodeDriver,
                 eval_driver: RolloutDriver):
        self.cfg = cfg
        self.accelerator = accelerator
        self.policy = policy  #: the prepared policy: its FSDP units are gathered while the engine generates
        self.lm = lm  #: the plain HF module inside it, which the engine runs
        self.backend = backend
        self.driver = driver
        self.eval_driver = eval_driver

    def play(self, tasks: list[dict], n: int, step: int) -> RolloutResult:
        """The step's episodes; their metrics also carry the embedded engine's counters over the rollout
        (``engine/*``: every counter of `HFBackend.stats` — passes, rows, seconds busy, in prefill, waiting for
        decode steps, ...; see `agents.hf_backend.new_stats`)."""
        with self.gathered(), counted(self.backend) as engine:  # SGLang's backends keep no counters here
            result = self.driver.run(tasks, n=n, step=step)
        result.metrics.update({f"engine/{key}": float(value) for key, value in engine.items()})
        return result

    def evaluate(self, tasks: list[dict], step: int) -> RolloutResult:
        """Greedy, or sampled `eval.samples` times per task (`step` only labels: the weights are this process's)."""
        overrides = {"temperature": 0.0} if self.cfg.eval.greedy else {}
        with self.gathered():
            return self.eval_driver.run(tasks, n=self.cfg.eval.samples, step=0, **overrides)

    def after_update(self) -> str:
        """Push the updated weights to the generation backend (servers are shared: the main process syncs them
        once)."""
        acc, backend = self.accelerator, self.cfg.rollout.backend
        sync = "synced by the main process"
        # the embedded engine shares the module; an SGLang engine gets the full weights, gathered under FSDP
        with contextlib.nullcontext() if backend == "hf" else self.gathered():
            if backend != "sglang_server" or acc.is_main_process:
                sync = asyncio.run(sync_weights(self.backend, self.lm, self.cfg.output_dir))
        acc.wait_for_everyone()
        return sync

    def gathered(self):
        """The policy's full weights for the engine, under FSDP2 (a no-op otherwise)."""
        if not self.accelerator.is_fsdp2:
            return contextlib.nullcontext()
        return gathered_for_generation(self.policy, self.accelerator.state.fsdp_plugin.reshard_after_forward)

    def close(self) -> None:
        self.driver.close()
        self.eval_driver.close()
        asyncio.run(self.backend.close())


def make_rollouts(cfg: Config, accelerator: Accelerator, policy, lm, tokenizer, make_env, make_eval_env,
                  weights_changed: bool) -> LocalRollouts:
    """The generation backend on `lm` and the rollout drivers of training and evaluation, each process with its own
    seeds and its share of the episodes in flight."""
    backend = make_backend(cfg, lm, tokenizer, weights_changed, accelerator.local_process_index)
    sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                              max_new_tokens=cfg.rollout.max_new_tokens)
    rank, world = accelerator.process_index, accelerator.num_processes
    train = dict(seed=cfg.seed * 1000 + rank, progress=cfg.logging.progress and accelerator.is_main_process,
                 max_concurrency=cfg.rollout.prompts_per_step // world * cfg.rollout.n)
    driver = rollout_driver(make_env, backend, sampling, processes=cfg.rollout.env_processes, **train)
    eval_driver = RolloutDriver(make_eval_env, backend, sampling, seed=cfg.seed * 1000 + 500 + rank,
                                max_concurrency=max(1, cfg.eval.episodes * cfg.eval.samples // world))
    return LocalRollouts(cfg, accelerator, policy, lm, backend, driver, eval_driver)


def eval_metrics(result: RolloutResult, samples: int) -> dict:
    """The ``val/*`` metrics of an evaluation's episodes."""
    summary = result.summary()
    metrics = {f"val/{k}": summary[k] for k in ("success", "reward", "turns", "tool_call_rate")}
    metrics["val/failed"] = float(len(result.episodes)) - summary["played"]
    if samples > 1:
        metrics[f"val/pass@{samples}"] = summary["pass@n"]
    return metrics
