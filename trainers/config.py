"""Trainer configuration: one YAML file per recipe, CLI overrides, typed defaults, clear validation errors.

    python trainers/ppo.py --config trainers/configs/gsm8k_qwen2.5_0.5b.yaml --set trainer.lr=1e-6 --set rollout.n=8

Every field below is documented where it is declared; `docs/trainer_config.md` is generated from these docstrings
(`python -m trainers.config --markdown`). Unknown keys are errors (with a suggestion), values are type-checked.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class ConfigError(ValueError):
    """A configuration value or key that cannot be used."""


@dataclass
class ModelConfig:
    path: str | None = None  #: Hugging Face model id or local directory (pretrained weights)
    preset: str | None = None  #: random-init architecture preset: qwen2.5-0.5b, qwen2.5-3b (no weights needed)
    config: dict = field(default_factory=dict)  #: Qwen2Config overrides for random init (e.g. hidden_size)
    dtype: str = "float32"  #: float32 | bfloat16 | float16 (weights and compute)
    attn_implementation: str = "sdpa"  #: sdpa | eager | flex_attention
    gradient_checkpointing: bool = False  #: recompute activations in backward to save memory
    critic_path: str | None = None  #: PPO critic weights; default: initialised from the policy


@dataclass
class TokenizerConfig:
    name: str = "offline:qwen2.5"  #: offline:<qwen2.5|qwen3|llama3.1>, task:<env id> (a small BPE), a path or hub id


@dataclass
class EnvConfig:
    id: str = "Calculator-v0"  #: a registered Gymnasium id (GSM8kTool-v0, Calculator-v0, ...)
    kwargs: dict = field(default_factory=dict)  #: keyword arguments for gym.make (e.g. data_path, split, max_turns)
    eval_kwargs: dict = field(default_factory=dict)  #: overrides for the evaluation env (e.g. split: test)


@dataclass
class RolloutConfig:
    backend: str = "hf"  #: hf (embedded transformers) | sglang_engine | sglang_server
    server_urls: list = field(default_factory=list)  #: sglang_server: URLs of running servers (or one router)
    prompts_per_step: int = 16  #: distinct tasks per training step, over all processes
    n: int = 4  #: samples per task (the GRPO group size)
    max_turns: int = 5  #: assistant turns per episode
    max_parallel_tools: int = 4  #: tool calls run at once within one turn
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  #: -1 disables top-k
    max_new_tokens: int = 256  #: per assistant turn (also capped by the response budget)
    max_prompt_tokens: int = 1024
    max_response_tokens: int = 1024  #: all turns and observations after the prompt
    max_total_tokens: int | None = None
    max_observation_tokens: int = 256  #: one turn's tool responses; longer ones are cut (see observation_keep)
    observation_keep: str = "head"  #: head | tail | middle
    mode: str = "auto"  #: conversation mode: auto | incremental | per_turn
    max_batch_size: int = 256  #: hf backend: requests per forward pass
    engine_kwargs: dict = field(default_factory=dict)  #: extra arguments for sglang.Engine / the server client


@dataclass
class AlgorithmConfig:
    name: str = "grpo"  #: grpo (group-normalised outcome advantages) | ppo (GAE with a critic)
    gamma: float = 1.0  #: PPO: per-token discount
    lam: float = 1.0  #: PPO: GAE lambda
    turn_gamma: float | None = None  #: PPO: discount across turn boundaries instead of per token (None: off)
    norm_adv_by_std: bool = True  #: GRPO: divide by the group std; PPO: whiten advantages over the batch
    clip_low: float = 0.2
    clip_high: float = 0.2  #: e.g. 0.28 for the asymmetric "clip-higher" variant
    dual_clip: float | None = 3.0  #: bound on the loss of negative-advantage tokens; None disables
    loss_agg: str = "token-mean"  #: token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    kl_mode: str = "loss"  #: loss (KL term in the loss) | reward (penalty in the rewards) | none
    kl_coef: float = 0.001
    kl_estimator: str = "low_var_kl"  #: k1 | k2 | k3 | low_var_kl
    entropy_coef: float = 0.0
    value_clip: float | None = 0.2
    value_coef: float = 0.5
    tis_cap: float | None = None  #: truncated importance sampling cap for rollout/trainer logprob mismatch


@dataclass
class TrainerConfig:
    total_steps: int = 100  #: RL steps (one rollout batch each)
    lr: float = 1e-6
    critic_lr: float = 1e-5
    weight_decay: float = 0.0
    lr_schedule: str = "constant"  #: constant | linear | cosine (after warmup)
    warmup_steps: int = 0
    epochs: int = 1  #: passes over each rollout batch
    minibatch_size: int = 64  #: sequences per optimizer step, over all processes
    micro_batch_size: int = 8  #: sequences per forward/backward on each process (gradient accumulation)
    max_grad_norm: float = 1.0
    packed: bool = False  #: padding-free batches (block-diagonal attention)
    eval_every: int = 10  #: steps between evaluations (0: only at the end)
    save_every: int = 50  #: steps between checkpoints (0: only at the end)
    keep_last: int = 3  #: checkpoints kept
    resume: str | None = None  #: auto (latest in output_dir) | a checkpoint path | None
    time_limit_s: float | None = None  #: stop (with a final eval and checkpoint) after this much wall time


@dataclass
class EvalConfig:
    episodes: int = 64  #: held-out episodes per evaluation
    greedy: bool = True  #: greedy decoding; False samples with the rollout temperature
    samples: int = 1  #: samples per task for pass@k (k = samples); >1 needs greedy: false
    seed: int = 10_000  #: first held-out seed (synthetic envs) / offset into the test split


@dataclass
class SFTConfig:
    steps: int = 0  #: warm-start SFT steps on the env's demonstrations before RL (0: none)
    lr: float = 1e-3
    batch_size: int = 32
    demo_skill: float = 1.0  #: fraction of demonstrations that use the tool correctly (imperfect demos < 1)
    time_limit_s: float | None = None


@dataclass
class LoggingConfig:
    jsonl: bool = True  #: metrics.jsonl in output_dir
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "mt_env"
    plot: bool = True  #: reward/success curve PNG at the end
    progress: bool = True  #: a progress bar during rollouts (shown on terminals only)


@dataclass
class Config:
    seed: int = 0  #: seeds models (random init), task streams, sampling and shuffling
    output_dir: str = "runs/default"  #: metrics.jsonl, curves.png, config.json and checkpoints go here
    device: str = "auto"  #: auto | cpu | cuda
    threads: int | None = None  #: torch CPU threads (None: torch's default)
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_CHOICES = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.attn_implementation": ("sdpa", "eager", "flex_attention"),
    "rollout.backend": ("hf", "sglang_engine", "sglang_server"),
    "rollout.observation_keep": ("head", "tail", "middle"),
    "rollout.mode": ("auto", "incremental", "per_turn"),
    "algorithm.name": ("grpo", "ppo"),
    "algorithm.loss_agg": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "algorithm.kl_mode": ("loss", "reward", "none"),
    "algorithm.kl_estimator": ("k1", "k2", "k3", "low_var_kl"),
    "trainer.lr_schedule": ("constant", "linear", "cosine"),
    "device": ("auto", "cpu", "cuda"),
}


def _check_type(path: str, value: Any, annotation) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(path, value, a)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: {value!r} is not a valid {annotation}")
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if annotation in (int, str, bool, dict, list) and isinstance(value, annotation):
        if annotation is int and isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    raise ConfigError(f"{path}: expected {getattr(annotation, '__name__', annotation)}, got {value!r}")


def _build(cls, data: dict, prefix: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ConfigError(f"unknown config key {path!r}{hint}; valid keys: {', '.join(fields)}")
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            kwargs[key] = _build(annotation, value or {}, f"{path}.")
        else:
            kwargs[key] = _check_type(path, value, annotation)
            if path in _CHOICES and kwargs[key] not in _CHOICES[path]:
                raise ConfigError(f"{path}: {kwargs[key]!r} is not one of {_CHOICES[path]}")
    return cls(**kwargs)


def _set(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {k} is not a section")
    node[keys[-1]] = value


def validate(cfg: Config, training: bool = True) -> Config:
    """Cross-field checks that types alone cannot express (`training=False`: only what evaluation uses)."""
    t, r, a = cfg.trainer, cfg.rollout, cfg.algorithm
    positive = {"trainer.total_steps": t.total_steps, "trainer.minibatch_size": t.minibatch_size,
                "trainer.micro_batch_size": t.micro_batch_size, "trainer.epochs": t.epochs, "rollout.n": r.n,
                "rollout.prompts_per_step": r.prompts_per_step, "rollout.max_turns": r.max_turns,
                "rollout.max_new_tokens": r.max_new_tokens, "eval.episodes": cfg.eval.episodes}
    for path, v in positive.items():
        if v < 1:
            raise ConfigError(f"{path} must be >= 1, got {v}")
    if t.lr <= 0:
        raise ConfigError(f"trainer.lr must be > 0, got {t.lr}")
    if training and a.name == "grpo" and r.n < 2:
        raise ConfigError("algorithm.name=grpo needs rollout.n >= 2 (a group to normalise against)")
    if a.loss_agg == "seq-mean-token-sum-norm" and not r.max_response_tokens:
        raise ConfigError("seq-mean-token-sum-norm divides by rollout.max_response_tokens, which must be set")
    if a.dual_clip is not None and a.dual_clip <= 1:
        raise ConfigError(f"algorithm.dual_clip must be > 1 (or null), got {a.dual_clip}")
    if a.kl_mode == "reward" and a.name == "grpo":
        raise ConfigError("algorithm.kl_mode=reward has no effect on GRPO (its advantages use episode returns): "
                          "use kl_mode=loss with GRPO, or algorithm.name=ppo")
    if r.backend == "sglang_server" and not r.server_urls:
        raise ConfigError("rollout.backend=sglang_server needs rollout.server_urls")
    if not (cfg.model.path or cfg.model.preset or cfg.model.config):
        raise ConfigError("model: give a path (pretrained), a preset or a config (random init)")
    if cfg.eval.samples > 1 and cfg.eval.greedy:
        raise ConfigError("eval.samples > 1 (pass@k) needs eval.greedy: false")
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, training: bool = True) -> Config:
    """Defaults, then the YAML file at `path`, then ``key.sub=value`` overrides (values parsed as YAML)."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file() and (CONFIG_DIR / p).is_file():
            p = CONFIG_DIR / p
        if not p.is_file():
            bundled = sorted(x.name for x in CONFIG_DIR.glob("*.yaml"))
            raise ConfigError(f"config file {path} not found (bundled configs: {bundled})")
        tree = yaml.safe_load(p.read_text()) or {}
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        _set(tree, key.strip(), yaml.safe_load(raw))
    return validate(_build(Config, tree), training)


def markdown_reference() -> str:
    """The config reference (docs/trainer_config.md), generated from the dataclasses and their comments."""
    import inspect

    lines = ["# Trainer configuration reference", "",
             "Generated by `python -m trainers.config --markdown`. Set values in a recipe YAML or with",
             "`--set section.key=value` on the command line.", ""]

    def comments(cls) -> dict:
        out = {}
        for line in inspect.getsource(cls).splitlines():
            if ":" in line and "#:" in line:
                name = line.strip().split(":")[0]
                out[name] = line.split("#:", 1)[1].strip()
        return out

    def section(cls, prefix):
        docs = comments(cls)
        rows = []
        for f in dataclasses.fields(cls):
            t = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(t):
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            choices = _CHOICES.get(prefix + f.name)
            doc = docs.get(f.name, "")
            if choices and "|" not in doc:
                doc += f" Choices: {', '.join(choices)}."
            cell = doc.replace("|", "\\|")
            rows.append(f"| `{prefix}{f.name}` | `{default!r}` | {cell} |")
        return rows

    lines += ["## top level", "", "| key | default | meaning |", "|---|---|---|", *section(Config, ""), ""]
    for f in dataclasses.fields(Config):
        t = typing.get_type_hints(Config)[f.name]
        if dataclasses.is_dataclass(t):
            intro = (t.__doc__ or "").strip() if t.__doc__ and not t.__doc__.startswith(t.__name__ + "(") else ""
            lines += [f"## {f.name}", "", intro,
                      "| key | default | meaning |", "|---|---|---|", *section(t, f"{f.name}."), ""]
    text = "\n".join(lines)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text


if __name__ == "__main__":
    if "--markdown" in sys.argv:
        print(markdown_reference())
