"""Building what `ppo.py` needs from its config: processes, tokenizer, envs and tasks, models, the generation
backend.

Kept out of `ppo.py` so the algorithm there reads top to bottom; nothing here is RL.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

import mt_env  # noqa: F401  (registers the envs)
from mt_env.conversation import TokenBudget
from mt_env.env import ToolEnv
from mt_env.tokenizer import load_tokenizer, offline_tokenizer, train_bpe_tokenizer

from .config import Config, ConfigError
from .distributed import ddp_kwargs
from .lora import add_lora, hf_weights, save_hf
from .modeling import build_causal_lm, compile_layers, declared_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------------------------- processes
def make_accelerator(cfg: Config) -> Accelerator:
    """One process, or DDP/FSDP2 under ``accelerate launch`` (checkpoints are named and kept by
    `trainers.checkpoints.Checkpointer`, not by accelerate). Checks that the global batch sizes split between the
    processes, and what FSDP can shard."""
    accelerator = Accelerator(cpu=run_device(cfg).type == "cpu", kwargs_handlers=[ddp_kwargs()])
    world = accelerator.num_processes
    for name, value in (("rollout.prompts_per_step", cfg.rollout.prompts_per_step),
                        ("trainer.minibatch_size", cfg.trainer.minibatch_size)):
        if value % world:
            raise ConfigError(f"{name}={value} is a global size: it must divide by the {world} processes")
    if accelerator.distributed_type == DistributedType.FSDP:
        _check_fsdp(cfg, accelerator)
    return accelerator


def run_device(cfg: Config) -> torch.device:
    """The device `cfg.device` names: ``auto`` is CUDA when torch sees a GPU, else the CPU; ``cuda`` without a GPU
    is a `ConfigError`, never a run on the CPU instead."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device=cuda, but torch {torch.__version__} sees no CUDA GPU"
                          f"{'' if torch.version.cuda else ' (a CPU-only build)'}: use device=auto or device=cpu")
    return torch.device("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu")


def _check_fsdp(cfg: Config, accelerator: Accelerator) -> None:
    if not accelerator.is_fsdp2:
        raise ConfigError("FSDP1 cannot gather the policy for the embedded engine: set fsdp_version: 2 in the "
                          "accelerate config (trainers/configs/accelerate/fsdp2.yaml)")
    if cfg.algorithm.name == "ppo":
        raise ConfigError("FSDP2 shards one model per run here, and PPO trains a critic too: use GRPO with FSDP, or "
                          "DDP for PPO")


def lr_factor(cfg: Config) -> Callable[[int], float]:
    """The learning-rate schedule as a factor of `trainer.lr` per step: linear warmup, then constant, linear or
    cosine decay."""
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


# --------------------------------------------------------------------------------------------- tokenizer
def make_tokenizer(cfg: Config):
    """``offline:<family>``, ``task:<env id>`` (a small BPE trained on the env's demonstrations), or a path/hub id."""
    name = cfg.tokenizer.name
    if name.startswith("task:"):
        return task_tokenizer(name.split(":", 1)[1], cfg.env.kwargs)
    return load_tokenizer(name)


def task_tokenizer(env_id: str, env_kwargs: dict | None = None, vocab_size: int = 1000, episodes: int = 300):
    """A small tokenizer for tiny models trained from scratch on one task: byte-level BPE fitted to rendered
    demonstration episodes of `env_id` (prompts with the tool schemas, tool calls, tool results, answers)."""
    env = gym.make(env_id, **{k: v for k, v in (env_kwargs or {}).items() if k != "tokenizer"}).unwrapped
    render = offline_tokenizer("qwen2.5")  # only its chat template is used, to render the demonstrations as text
    rng = np.random.default_rng(0)
    texts = []
    for _ in range(episodes):
        task = env.sample_task(rng)
        messages = env.prompt_messages(task)
        turns = env.demonstration(task, rng, skill=0.5)
        for k, text in enumerate(turns):
            messages.append({"role": "assistant" if k % 2 == 0 else "tool", "content": text})
        texts.append(render.apply_chat_template(messages, tools=[t.tool_schema for t in env.tools], tokenize=False))
    env.close()
    return train_bpe_tokenizer(texts, vocab_size=vocab_size, name=env_id)


# --------------------------------------------------------------------------------------------- envs and tasks
def env_factory(cfg: Config, tokenizer, eval_env: bool = False) -> Callable[[], gym.Env]:
    kwargs = dict(cfg.env.kwargs)
    if eval_env:
        kwargs.update(cfg.env.eval_kwargs)
    kwargs.setdefault("max_turns", cfg.rollout.max_turns)
    kwargs.setdefault("max_parallel_tools", cfg.rollout.max_parallel_tools)
    kwargs.setdefault("mode", cfg.rollout.mode)
    kwargs["budget"] = TokenBudget(**dataclasses.asdict(cfg.env.budget))  # the only source (env.kwargs has none)
    kwargs["tokenizer"] = tokenizer
    return lambda: gym.make(cfg.env.id, **kwargs)


@dataclass
class TaskSource:
    """Where training tasks come from, with a position that checkpoints save and restore.

    Dataset-backed envs (with ``rows``): shuffled epochs over the rows. Synthetic envs: tasks drawn from a seeded
    stream (`sample_task`), disjoint from the evaluation stream by seed.
    """

    env: ToolEnv
    seed: int
    position: int = 0
    _order: list[int] = field(default_factory=list)  #: the shuffled rows of epoch `_order_epoch`
    _order_epoch: int = -1

    def next(self, count: int) -> list[dict]:
        """The next `count` tasks; the position moves past them."""
        out = self.peek(count)
        self.position += count
        return out

    def peek(self, count: int) -> list[dict]:
        """The next `count` tasks, without moving (the one-step off-policy trainer asks for the next step's tasks
        before it trains on this step's: its checkpoints count only trained steps)."""
        return [self._task(self.position + k) for k in range(count)]

    def _task(self, position: int) -> dict:
        rows = getattr(self.env, "rows", None)
        if rows is None:
            return self.env.sample_task(np.random.default_rng([self.seed, position]))
        epoch, i = divmod(position, len(rows))
        if self._order_epoch != epoch:
            self._order = list(np.random.default_rng([self.seed, epoch]).permutation(len(rows)))
            self._order_epoch = epoch
        return rows[self._order[i]]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def eval_tasks(cfg: Config, env: ToolEnv) -> list[dict]:
    """Held-out tasks: the test split of a dataset env (first `eval.episodes` rows from `eval.seed`'s offset), or
    tasks of a synthetic env drawn from seeds that training never uses."""
    rows = getattr(env, "rows", None)
    n = cfg.eval.episodes
    if rows is not None:
        start = cfg.eval.seed % len(rows) if len(rows) > n else 0
        return [rows[(start + i) % len(rows)] for i in range(n)]
    return [env.sample_task(np.random.default_rng([cfg.eval.seed, 1 << 20, i])) for i in range(n)]


# --------------------------------------------------------------------------------------------- models
def random_init_vocab(cfg: Config, tokens: int) -> int:
    """The embedding rows of a random-init model for a tokenizer of `tokens` ids: the preset's (or
    ``model.config``'s) own vocabulary size where it holds them — the real model's shape, e.g. Qwen2.5's 151,936
    rows for its tokenizer's 151,665 ids — else exactly `tokens`. The rows beyond the tokenizer are never sampled
    nor scored (the backend's and the policy's ``vocab_limit``). Why keep the padding: an odd row count makes every
    LM-head matmul unaligned on GPUs: cuBLAS falls back to slow align-1 kernels in the engine's decode and in the
    trainer's passes (docs/training_speed.md, 2026-12-06)."""
    own = declared_config(cfg.model.preset, cfg.model.config).get("vocab_size")
    return own if own is not None and own >= tokens else tokens


def make_models(cfg: Config, tokenizer, device: torch.device, critic: bool = True):
    """(policy LM, critic or None: PPO's, unless `critic` is false). Random init is seeded by `cfg.seed`, so runs
    repeat; its vocabulary is `random_init_vocab`'s."""
    from .modeling import CriticModel

    dtype = DTYPES[cfg.model.dtype]
    vocab = None if cfg.model.path else random_init_vocab(cfg, len(tokenizer))
    lm = build_causal_lm(path=cfg.model.path, preset=cfg.model.preset, config=cfg.model.config, vocab_size=vocab,
                         dtype=dtype, seed=cfg.seed, attn_implementation=cfg.model.attn_implementation)
    if len(tokenizer) > lm.config.vocab_size:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model only {lm.config.vocab_size}")
    if cfg.model.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.model.lora.rank:
        add_lora(lm, cfg.model.lora)
    if cfg.trainer.compile:
        compile_layers(lm)
    lm.config.pad_token_id = tokenizer.pad_token_id
    lm.to(device)
    if cfg.algorithm.name != "ppo" or not critic:
        return lm, None
    if cfg.model.critic_path:
        backbone = build_causal_lm(path=cfg.model.critic_path, dtype=dtype)
        value_model = CriticModel(getattr(backbone, backbone.base_model_prefix), backbone.config.hidden_size)
    else:
        value_model = CriticModel.from_policy(lm)
    return lm, value_model.to(device)


def model_summary(cfg: Config, lm: torch.nn.Module) -> str:
    """One line for the log: the architecture, its size and where its weights come from."""
    count = sum(p.numel() for p in lm.parameters())
    return (f"model: {lm.config.model_type}, {count / 1e6:.2f}M parameters, "
            f"{'weights from ' + cfg.model.path if cfg.model.path else 'random init'}")


def frozen_copy(lm: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(lm).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


# --------------------------------------------------------------------------------------------- generation backend
def make_backend(cfg: Config, lm: torch.nn.Module, tokenizer, weights_changed: bool = False, local_rank: int = 0):
    """The rollout's `Backend`: the embedded HF backend on the trainer's own module (shared weights, nothing to
    sync), or an SGLang engine/server (weights synced after each update by `sync_weights`).

    `weights_changed`: the module no longer equals `model.path` (after SFT, a resumed or loaded checkpoint, random
    init): an SGLang engine then starts from the module's weights saved to ``<output_dir>/weights``."""
    r = cfg.rollout
    if r.backend == "hf":
        from agents.hf_backend import HFBackend

        return HFBackend(lm, max_batch_size=r.max_batch_size, seed=cfg.seed, pad_token_id=tokenizer.pad_token_id,
                         vocab_limit=len(tokenizer), exact=r.exact_logprobs)
    if r.backend == "sglang_engine":
        from agents.sglang_backend import SGLangEngineBackend

        path = cfg.model.path
        if weights_changed or not path:
            path = str(Path(cfg.output_dir).resolve() / f"weights-rank{local_rank}")
            save_hf(lm, path)
            tokenizer.save_pretrained(path)
        kwargs = dict(r.engine_kwargs)
        kwargs.setdefault("base_gpu_id", local_rank)  # one engine per process, on that process's GPU
        return SGLangEngineBackend(model_path=path, **kwargs)
    from agents.sglang_backend import SGLangServerBackend

    return SGLangServerBackend(r.server_urls, **r.engine_kwargs)


async def sync_weights(backend: Any, lm: torch.nn.Module, output_dir: str) -> str:
    """Push the updated weights to the generation backend; returns what was done (for the log)."""
    from agents.hf_backend import HFBackend

    if isinstance(backend, HFBackend) and backend.model is lm:
        return "shared module (no copy)"
    try:
        await backend.update_weights(named_tensors=list(hf_weights(lm)))  # LoRA: the adapters merged
        await backend.flush_cache()
        return "update_weights_from_tensor"
    except NotImplementedError:
        path = str(Path(output_dir).resolve() / "weights")  # absolute: servers resolve paths on their own side
        save_hf(lm, path)
        await backend.update_weights(model_path=path)
        await backend.flush_cache()
        return "update_weights_from_disk"
