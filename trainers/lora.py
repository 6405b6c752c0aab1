"""LoRA on the policy, through `peft`: adapters injected into the Hugging Face module in place, the base weights
frozen, and what the rest of the trainer needs from them.

* **Injection** (`add_lora`): ``peft.inject_adapter_in_model`` replaces the targeted ``nn.Linear`` modules
  (``q_proj``, ...) by LoRA layers that hold the frozen base layer and the adapters; the module keeps its class and
  its submodules, so the trainer's forward and the embedded engine — which calls ``self_attn.q_proj`` & co. itself
  (`agents.engine.decoder_layout`) — both run the adapters ("through the adapter"; no copy of the base weights).
  Adapters are kept in float32 whatever the base's dtype, as ``peft.get_peft_model`` does by default.
* **The KL reference** (`AdaptersOff`): the same module with its adapters disabled — the base weights, no second copy.
* **Checkpoints**: a `PolicyModel` around an adapted module keeps only the trained parameters in its state dict
  (`state_dict_of_trained_only`), so accelerate's checkpoints hold the adapters (and optimizer state) alone; the base
  comes from the recipe again on resume (``model.path``, or the seeded random init).
* **Merged weights** (`hf_weights`, `save_hf`): the base weights with the adapters' product added, under the
  Hugging Face class's own names — what an SGLang engine or server loads, and what `trainers/export.py` writes.
  They are computed out of place, one layer at a time: merging into the base in place and unmerging after would
  drift a half-precision base (``W + BA - BA`` is not ``W`` in bf16) a little more at every weight version.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from .config import LoraConfig

#: the name part that marks an adapter's parameters (peft's LoRA layers: lora_A, lora_B, lora_embedding_A, ...)
ADAPTER_MARK = "lora_"


def add_lora(lm: nn.Module, lora: LoraConfig) -> nn.Module:
    """`lm` with LoRA adapters of `lora` injected in place (the base frozen, the adapters trainable, in float32);
    returns `lm`. Refuses target modules the model does not have."""
    import peft

    names = {name.rsplit(".", 1)[-1] for name, _ in lm.named_modules()}
    missing = [t for t in lora.target_modules if t not in names]
    if missing:
        raise ValueError(f"model.lora.target_modules: {lm.config.model_type} has no module named {missing}; it has "
                         f"e.g. {sorted(n for n in names if n.endswith('_proj'))}")
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=list(lora.target_modules), bias="none")
    peft.inject_adapter_in_model(config, lm)
    for name, p in lm.named_parameters():
        if is_adapter(name):
            p.data = p.data.float()
    return lm


def is_adapter(name: str) -> bool:
    """Whether the parameter or state-dict key `name` belongs to an adapter."""
    return any(part.startswith(ADAPTER_MARK) for part in name.split("."))


def has_adapters(module: nn.Module) -> bool:
    return any(is_adapter(name) for name, _ in module.named_parameters())


def _tuner_layers(module: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """Inside, `module` (a model, or a wrapper of one) computes with its base weights alone."""
    layers = _tuner_layers(module)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class AdaptersOff:
    """The KL reference of a LoRA run: the (prepared) policy called with its adapters disabled — the base model,
    sharing every weight with the policy."""

    def __init__(self, policy: nn.Module):
        self.policy = policy

    def __call__(self, *args, **kwargs):
        with adapters_disabled(self.policy), torch.no_grad():
            return self.policy(*args, **kwargs)


def state_dict_of_trained_only(module: nn.Module) -> None:
    """From now on `module.state_dict()` holds only the parameters that train now (the adapters, and any head of
    its own), and `load_state_dict` does not miss the others: the frozen base is not part of the checkpoint."""
    trained = {name for name, p in module.named_parameters() if p.requires_grad}

    def drop_frozen(mod, state, prefix, local_metadata):
        for key in [k for k in state if k.startswith(prefix) and k[len(prefix):] not in trained]:
            del state[key]

    def allow_missing_frozen(mod, incompatible):
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if _names_one_of(k, trained)]

    module.register_state_dict_post_hook(drop_frozen)
    module.register_load_state_dict_post_hook(allow_missing_frozen)


def _names_one_of(key: str, names: set[str]) -> bool:
    """Whether the state-dict `key` is one of `names`, maybe under a wrapper's prefix (``module.`` under DDP)."""
    return any(key == n or key.endswith("." + n) for n in names)


# --------------------------------------------------------------------------------------------- merged weights
@torch.no_grad()
def hf_weights(lm: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`lm`'s parameters under its Hugging Face class's names, the adapters merged into the weights they adapt
    (new tensors, one layer at a time; the others as they are). Without adapters: its named parameters."""
    if not has_adapters(lm):  # (peft is an optional extra)
        yield from ((name, p.detach()) for name, p in lm.named_parameters())
        return
    tuners = set(_tuner_layers(lm))
    layers = {name: m for name, m in lm.named_modules() if m in tuners}
    for name, p in lm.named_parameters():
        if is_adapter(name):
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        if not owner:
            yield name, p.detach()
            continue
        layer = layers[owner]
        if leaf == "weight" and not layer.merged and not layer.disable_adapters:
            delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A)
            yield f"{owner}.{leaf}", (p.float() + delta).to(p.dtype)
        else:
            yield f"{owner}.{leaf}", p.detach()


def save_hf(lm: nn.Module, path: str | Path) -> None:
    """`lm` as a Hugging Face model folder (config and weights, adapters merged) that ``from_pretrained`` loads."""
    if not has_adapters(lm):
        lm.save_pretrained(path)
        return
    lm.save_pretrained(path, state_dict={name: t.contiguous() for name, t in hf_weights(lm)})
