"""The engine's view of a transformers causal LM: the module's own submodules its layer loop calls (no weight copy).

Supported: Llama-family decoders (``llama``, ``qwen2``, ``qwen3`` with its ``q_norm``/``k_norm``) with full attention
in every layer and a position-only RoPE; anything else raises `UnsupportedModel` with the reason, and the engine
falls back to the transformers runner.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
#: RoPE variants whose cos/sin depend on the positions only (``dynamic`` and ``longrope`` also depend on the length)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModel(ValueError):
    """The module cannot take the fast path; the message says why."""


# --------------------------------------------------------------------------------------------- the module's layout
@dataclass(frozen=True)
class DecoderLayout:
    """The parts of a Llama-family causal LM that the fast path calls (the module's own submodules)."""

    embed: nn.Module
    layers: Sequence[nn.Module]
    norm: nn.Module
    rotary: nn.Module
    lm_head: nn.Module
    apply_rope: Callable
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    qk_norm: bool

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


def decoder_layout(model: nn.Module) -> DecoderLayout:
    """The fast path's view of `model`, or `UnsupportedModel` saying what stands in the way."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(f"model type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    if getattr(model, "hf_quantizer", None) is not None:
        raise UnsupportedModel("the module is quantized")
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        raise UnsupportedModel("the module has accelerate hooks (device_map / offloading)")
    body = getattr(model, "model", None)
    parts = {name: getattr(body, name, None) for name in ("embed_tokens", "layers", "norm", "rotary_emb")}
    if any(part is None for part in parts.values()) or getattr(model, "lm_head", None) is None:
        raise UnsupportedModel("the module lacks model.{embed_tokens,layers,norm,rotary_emb} or lm_head")
    rope_type = getattr(parts["rotary_emb"], "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModel(f"RoPE type {rope_type!r} depends on the sequence length")
    layers = list(parts["layers"])[:config.num_hidden_layers]
    for i, layer in enumerate(layers):
        _check_layer(i, layer, qk_norm=model_type == "qwen3")
    attn = layers[0].self_attn
    apply_rope = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    if apply_rope is None:
        raise UnsupportedModel(f"{type(attn).__module__} has no apply_rotary_pos_emb")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % kv_heads:
        raise UnsupportedModel(f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
    return DecoderLayout(parts["embed_tokens"], layers, parts["norm"], parts["rotary_emb"], model.lm_head,
                         apply_rope, heads, kv_heads, attn.head_dim, float(attn.scaling), model_type == "qwen3")


def _check_layer(i: int, layer: nn.Module, qk_norm: bool) -> None:
    attn = getattr(layer, "self_attn", None)
    needed = [(layer, "input_layernorm"), (layer, "post_attention_layernorm"), (layer, "mlp"),
              *((attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"))]
    if qk_norm:
        needed += [(attn, "q_norm"), (attn, "k_norm")]
    missing = [name for owner, name in needed if getattr(owner, name, None) is None]
    if missing:
        raise UnsupportedModel(f"layer {i} lacks {missing}")
    if getattr(attn, "sliding_window", None) is not None:
        raise UnsupportedModel(f"layer {i} uses sliding-window attention")


def module_device(model: nn.Module) -> torch.device:
    """Where the module's parameters are (CPU for a module without any)."""
    return next(model.parameters(), torch.empty(0)).device


def kv_dtype(layout: DecoderLayout) -> torch.dtype:
    return layout.layers[0].self_attn.k_proj.weight.dtype
