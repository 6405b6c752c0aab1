"""The engine's forward passes over paged KV, as module-level functions of tensors and the module's own submodules:
run eagerly, or compiled once per process for every layer and shape (`agents.compiling`); a CUDA graph captures
either.

KV layout: per layer, K and V of shape [blocks * block_size, kv_heads, head_dim] (views of one tensor over the
layers); a position of a sequence lives at ``table[block] * block_size + offset``. Each pass writes its new
tokens' K/V first, then attends, so a sequence may read KV written earlier in the same pass (a group's shared
prompt, computed by its first member).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .. import exact
from ..compiling import compiled
from . import attention
from .attention import flat_positions


def attention_inputs(attn: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, apply_rope: Callable,
                     qk_norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys (RoPE applied) and values, [rows, heads, time, head_dim], as the module's attention does."""
    shape = (*h.shape[:-1], -1, attn.head_dim)
    q, k = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape)
    if qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, attn.v_proj(h).view(shape).transpose(1, 2)


def step_inputs(embed: nn.Module, rotary: nn.Module, tokens: torch.Tensor, lengths: torch.Tensor,
                table: torch.Tensor, length: int, block_size: int, kernel: str):
    """A decode step's inputs: embeddings [rows, 1, hidden] of each row's next token, RoPE cos/sin at its position,
    the flat KV position it writes, and what attention needs over the first `length` positions
    (`attention.decode_inputs`). A free row has length 0 and a table of null blocks: it writes the null block."""
    at = lengths.clamp(max=length - 1)
    x = embed(tokens[:, None])
    cos, sin = rotary(x, at[:, None])
    write_at = flat_positions(table, at[:, None], block_size)[:, 0].long()
    attend = attention.decode_inputs(table if kernel == "triton" else table.long(), at, length, block_size, kernel,
                                     x.dtype)
    return x, cos, sin, write_at, attend


def decode_layer(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write_at: torch.Tensor,
                 attend: tuple, keys: torch.Tensor, values: torch.Tensor, apply_rope: Callable, qk_norm: bool,
                 kernel: str) -> torch.Tensor:
    """One decoder layer for one token per row: its K/V written at `write_at`, attention over the row's positions
    (`attention.decode_attention`), then the MLP."""
    attn, rows = layer.self_attn, x.shape[0]
    q, k, v = attention_inputs(attn, layer.input_layernorm(x), cos, sin, apply_rope, qk_norm)
    keys.index_copy_(0, write_at, k[:, :, 0])
    values.index_copy_(0, write_at, v[:, :, 0])
    out = attention.decode_attention(q[:, :, 0], keys, values, attend, attn.scaling, kernel)
    x = x + attn.o_proj(out.reshape(rows, 1, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def head_logits(norm: nn.Module, lm_head: nn.Module, x: torch.Tensor, vocab: int) -> torch.Tensor:
    """The final norm and the LM head over the first `vocab` ids: float32 logits [rows, vocab]. (Sampling stays out
    of the compiled functions: Inductor does not generate its split reductions over the vocabulary, and they are a
    few large kernels, not launch-bound.)"""
    return lm_head(norm(x))[:, 0, :vocab].float()


def prefill_layer(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write_at: torch.Tensor,
                  attend: tuple | None, keys: torch.Tensor, values: torch.Tensor, apply_rope: Callable,
                  qk_norm: bool, kernel: str) -> torch.Tensor:
    """One decoder layer over the new tokens of each row [rows, width, hidden], right-padded: their K/V written at
    `write_at` [rows, width] (padding: the null block), then attention (`attention.prefill_attention`: causal over
    the new tokens when `attend` is None, else over each row's positions read back from the cache), the MLP."""
    attn = layer.self_attn
    q, k, v = attention_inputs(attn, layer.input_layernorm(x), cos, sin, apply_rope, qk_norm)
    kv_heads = k.shape[1]
    keys.index_copy_(0, write_at.reshape(-1), k.transpose(1, 2).reshape(-1, kv_heads, k.shape[-1]))
    values.index_copy_(0, write_at.reshape(-1), v.transpose(1, 2).reshape(-1, kv_heads, v.shape[-1]))
    out = attention.prefill_attention(q, k, v, keys, values, attend, attn.scaling, kernel)
    x = x + attn.o_proj(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


STEP_FUNCTIONS = (step_inputs, decode_layer, head_logits)
#: every function the engine compiles: the decode step's and the prefill's layer (`head_logits` serves both)
COMPILED_FUNCTIONS = (*STEP_FUNCTIONS, prefill_layer)
#: those exact mode compiles (`agents.exact.compiles_layers`): the trainer compiles its decoder layers and nothing
#: around them, so the embedding, RoPE tables, final norm and LM head stay eager on both sides
LAYER_FUNCTIONS = (decode_layer, prefill_layer)


def routed_layer(fn: Callable, *args):
    """Exact mode's compiled layer function: `fn` (of `LAYER_FUNCTIONS`) under exact mode's routing, entered inside
    the compiled function (`agents.exact.routing`)."""
    with exact.routing(True):
        return fn(*args)


class RoutedLayer:
    """`fn` as exact mode runs it compiled: `routed_layer` compiled, called with this thread's routing set aside
    (`agents.exact.routed_inside`), as the trainer calls its layers (`trainers.modeling._run_compiled`). Compiled
    code called under the routing sends every operation of its Python wrappers through it (about 145 a layer's
    call); traced inside, the routing costs nothing at run time."""

    def __init__(self, fn: Callable):
        self.fn, self.compiled = fn, compiled(routed_layer)

    def __call__(self, *args):
        with exact.routed_inside(True):
            return self.compiled(self.fn, *args)
