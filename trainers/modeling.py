"""Models for the trainer: the policy (a causal LM) and the critic, with forward passes that return per-token
logprobs / values only where they are needed (sampled tokens), and block-diagonal attention for packed batches.

Alignment: for a row of ``input_ids``, output position ``t`` holds the quantity *for token t* — the logprob the model
gave token ``t`` from the prefix before it, or the critic's value of that prefix. Both take the batch's
``loss_mask``: positions whose token is not trained (``loss_mask == 0``: prompt, observations, padding) hold 0, and
only the hidden states that predict a trained token go through the LM head, so a 150k vocabulary costs nothing on
prompt and tool tokens. Those hidden states become logprobs through `agents.logprobs.token_logprobs` (the function
the engine shares), in chunks: no ``[tokens, vocab]`` tensor is made.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from agents import exact
from agents.compiling import compiled
from agents.logprobs import CHUNK_TOKENS, token_logprobs

from .lora import has_adapters, state_dict_of_trained_only

#: Architecture presets (random init) — public shapes of real models, for speed figures without weights.
PRESETS: dict[str, dict] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, vocab_size=151936),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, vocab_size=151936),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, vocab_size=152064),
}


def declared_config(preset: str | None, config: dict | None) -> dict:
    """The config a random-init model declares: the `preset`'s keys, overridden by `config`'s."""
    if preset and preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose from {sorted(PRESETS)} or give a path")
    return {**PRESETS.get(preset or "", {}), **(config or {})}


def build_causal_lm(path: str | None = None, preset: str | None = None, config: dict | None = None,
                    vocab_size: int | None = None, dtype: torch.dtype = torch.float32, seed: int = 0,
                    attn_implementation: str = "sdpa"):
    """A causal LM: pretrained from `path`, or randomly initialised from a `preset` and/or `config` overrides.
    Random init builds a Qwen2 architecture unless `config` names another transformers ``model_type`` (e.g.
    ``llama``). `vocab_size` overrides the config's (e.g. to match a small tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if path:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                    attn_implementation=_registered(attn_implementation))
    kwargs = declared_config(preset, config)
    if vocab_size is not None:
        kwargs["vocab_size"] = vocab_size
    model_type = kwargs.pop("model_type", "qwen2")
    try:
        cfg = AutoConfig.for_model(model_type, **kwargs)
    except ValueError:
        raise ValueError(f"model config: unknown model_type {model_type!r} (a transformers model type, e.g. qwen2, "
                         "llama, qwen3)") from None
    cfg._attn_implementation = _registered(attn_implementation)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    return model.to(dtype)


# --------------------------------------------------------------------------------------------- packed attention
#: ``sdpa`` as the trainer runs it: transformers' SDPA attention, except for a half-precision model's packed rows on
#: CUDA (`VARLEN_DTYPES`), which go through flash attention's variable-length kernel (`torch.nn.attention.varlen`). A
#: packed micro-batch of T tokens then costs the sum of its sequences' attention, not T² — the dense block-diagonal mask
#: SDPA needs would compute (and mask) every pair of tokens across sequences, as much work as the rest of the model
#: at T ≈ 10k.
SDPA_VARLEN = "sdpa_varlen"
#: the dtypes flash attention's kernels take; a float32 model's packed rows get the dense block-diagonal mask
VARLEN_DTYPES = (torch.float16, torch.bfloat16)
#: the forward argument that carries exact mode's sequence layout (`agents.exact.Sequences`) to `SDPA_VARLEN`
EXACT_KWARG = "exact_sequences"


def _registered(attn_implementation: str) -> str:
    """The attention implementation a model is built with: ``sdpa`` becomes `SDPA_VARLEN` (registered with
    transformers on first use; identical to ``sdpa`` unless the call passes packed sequence boundaries)."""
    if attn_implementation != "sdpa":
        return attn_implementation
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if kwargs.get(EXACT_KWARG) is not None:  # exact mode (`PolicyModel`): the engine's attention function
            if dropout:
                raise ValueError(f"exact logprobs need attention dropout 0, the model has {dropout}")
            return exact.sequence_attention(query, key, value, kwargs[EXACT_KWARG], scaling), None
        if kwargs.get("cu_seq_lens_q") is None or not query.is_cuda:
            if attention_mask is not None and attention_mask.numel() == 0:
                raise ValueError("sdpa_varlen: no attention mask was built (`_layout_mask`) and the call carries no "
                                 "sequence layout")
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        return _varlen_attention(query, key, value, kwargs["cu_seq_lens_q"], kwargs["max_length_q"], scaling), None

    AttentionInterface.register(SDPA_VARLEN, attention)
    AttentionMaskInterface.register(SDPA_VARLEN, sdpa_mask)
    return SDPA_VARLEN


def _varlen_attention(query, key, value, cu_seqlens: torch.Tensor, max_len: int, scale: float | None):
    """Causal attention within each packed sequence. `query` [1, H, T, d], `key`/`value` [1, KVH, T, d] (one packed
    row, as transformers' attention modules give them); returns [1, T, H, d], the layout they expect back."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, d]
    params = inspect.signature(varlen_attn).parameters
    extra: dict = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}  # torch 2.10 / 2.11+
    if k.shape[1] != q.shape[1]:  # grouped-query attention: torch >= 2.12 takes it as is, older versions repeat K/V
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale, **extra)
    return out[None]


def _layout_mask(device: torch.device) -> torch.Tensor:
    """The `attention_mask` of a forward whose attention takes the sequences' layout instead of a mask (flash
    attention's boundaries, exact mode's `Sequences`): an empty 4D tensor, which transformers passes on as given.
    Without it, transformers builds the packed rows' dense [1, 1, T, T] mask from the position ids (1 GiB at 32k
    tokens, and host syncs) in every forward, for an attention that never reads it."""
    return torch.empty(1, 1, 0, 0, dtype=torch.bool, device=device)


def packed_attention_mask(seq_ids: torch.Tensor, dtype: torch.dtype, implementation: str):
    """Causal attention restricted to each packed sequence (block-diagonal), for ``seq_ids`` of shape [1, T].

    Restarting position ids alone do not separate sequences: sdpa and flex attention would still let a sequence
    attend to the one packed before it. For ``flex_attention`` this returns a `BlockMask`; otherwise an additive
    float mask [1, 1, T, T] (0 where attention is allowed, the dtype's minimum elsewhere). On CUDA, half-precision
    ``sdpa`` models need no mask: they run flash attention's variable-length kernel on the sequence boundaries
    (`SDPA_VARLEN`; flash takes fp16/bf16 only, so float32 models keep the mask).
    """
    T = seq_ids.shape[-1]
    if implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        ids = seq_ids[0]

        def document_causal(b, h, q, kv):
            return (ids[q] == ids[kv]) & (q >= kv)

        return create_block_mask(document_causal, None, None, T, T, device=seq_ids.device)
    same = seq_ids[0][:, None] == seq_ids[0][None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=seq_ids.device).tril()
    allowed = same & causal
    mask = torch.zeros(T, T, dtype=dtype, device=seq_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def _attention_kwargs(model: nn.Module, input_ids, attention_mask, position_ids, seq_ids):
    """The attention arguments of `model`'s backbone forward: the caller's, or for a packed row (`seq_ids`) the
    sequence boundaries (flash attention's varlen kernel) or the block-diagonal mask, in the dtype attention
    computes in (the parameters', or autocast's)."""
    if seq_ids is None:
        return dict(attention_mask=attention_mask, position_ids=position_ids)
    # packed layout: one row, causal attention within each sequence
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    dtype = _compute_dtype(model)
    if impl == SDPA_VARLEN and input_ids.is_cuda and dtype in VARLEN_DTYPES:  # boundaries for the varlen kernel
        lengths = torch.bincount(seq_ids[0])
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        max_len = int(lengths.max())
        return dict(attention_mask=_layout_mask(input_ids.device), position_ids=position_ids,
                    cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_len, max_length_k=max_len)
    return dict(attention_mask=packed_attention_mask(seq_ids, dtype, impl), position_ids=position_ids)


def _compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype `model`'s layers compute in: autocast's where it is on, else the parameters'."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else next(model.parameters()).dtype


# --------------------------------------------------------------------------------------------- compiled layers
def compile_layers(lm: nn.Module) -> None:
    """From now on `lm`'s decoder layers run compiled by Inductor in forward passes without a KV cache (the
    trainer's): one compilation with dynamic shapes for every layer (`agents.compiling`, which falls back to eager
    if it fails). Under transformers' activation checkpointing the checkpoint runs eagerly around the compiled
    forward (`_layer_forward_compiled`). Passes with a cache (generation on the transformers path) run the layers as
    they are. Each layer's ``forward`` becomes an attribute of the layer: deep copies made after this call share the
    compiled function, not the layer."""
    for layer in getattr(lm, lm.base_model_prefix).layers:
        if "forward" not in vars(layer):
            layer.forward = functools.partial(_layer_forward_compiled, layer)


def _layer_forward(forward, exact_ops: bool, layer: nn.Module, *args, **kwargs):
    """The compiled function: the layer class's `forward`, the layer as an argument (so every layer shares it),
    under exact mode's routing where `exact_ops`, entered inside the graph (`_run_compiled` sets the caller's aside)."""
    with exact.routing(exact_ops):
        return forward(layer, *args, **kwargs)


def _run_compiled(forward, exact_ops: bool, layer: nn.Module, *args, **kwargs):
    """`_layer_forward` compiled, called with this thread's exact routing set aside (`agents.exact.routed_inside`)."""
    with exact.routed_inside(exact_ops):
        return compiled(_layer_forward)(forward, exact_ops, layer, *args, **kwargs)


def _layer_forward_compiled(layer: nn.Module, *args, **kwargs):
    """A layer's forward with its compute compiled. Recent transformers checkpoint inside the class's ``forward``
    (a wrapper that calls ``layer._gradient_checkpointing_func``); traced by Dynamo, that checkpoint becomes a
    higher-order op that refuses any Python side effect in the layer, and the layer's attention has one there
    (the `kernels` package's hook sets a context variable), so nothing compiled: the layers ran eagerly, and exact
    mode's recompute saved other tensors than its forward (``CheckpointError``). So the checkpoint is made here,
    eagerly, as transformers' wrapper would make it, around the compiled forward it wraps; the recompute runs the
    same compiled code. Layers that checkpoint outside ``forward`` (older transformers) need nothing of this."""
    if kwargs.get("use_cache"):
        return type(layer).forward(layer, *args, **kwargs)
    forward, checkpoints = _own_forward(type(layer))
    run = functools.partial(_run_compiled, forward, exact.routes(), layer, **kwargs)
    if checkpoints and layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
        return layer._gradient_checkpointing_func(run, *args)
    return run(*args)


@functools.cache
def _own_forward(cls: type) -> tuple:
    """(`cls`'s forward without transformers' checkpointing wrappers, whether it had one)."""
    forward, wrapped = cls.forward, False
    while getattr(getattr(forward, "__code__", None), "co_name", "") == "forward_with_checkpointing":
        forward, wrapped = forward.__wrapped__, True
    return forward, wrapped


def _use_exact_attention(lm: nn.Module) -> None:
    """Make `lm` attend through `SDPA_VARLEN` (which runs exact mode's attention when a forward passes the layout),
    or ValueError for another attention implementation."""
    impl = getattr(lm.config, "_attn_implementation", None)
    if impl == "sdpa":
        lm.config._attn_implementation = _registered("sdpa")  # identical to sdpa outside exact mode
    elif impl != SDPA_VARLEN:
        raise ValueError(f"exact logprobs need the model's attention implementation 'sdpa', it has {impl!r}")


def _compile_exact_layers(lm: nn.Module) -> None:
    """Compile `lm`'s decoder layers where exact mode compiles the engine's layer functions
    (`agents.exact.compiles_layers`, on the device `lm` is on): both sides then run the same code."""
    if exact.compiles_layers(next(lm.parameters()).device):
        compile_layers(lm)


def _recompute_under_exact_ops(lm: nn.Module) -> None:
    """Under activation checkpointing, recompute `lm`'s checkpointed layers in backward under exact mode's operations
    too (`agents.exact.RecomputeUnderOps`; without it the recompute fails). Checked before each forward with
    gradients: checkpointing may be turned on after the `PolicyModel` is made."""
    for module in lm.modules():
        fn = getattr(module, "_gradient_checkpointing_func", None)
        if fn is not None and not isinstance(fn, exact.RecomputeUnderOps):
            module._gradient_checkpointing_func = exact.RecomputeUnderOps(fn)


def _exact_kwargs(input_ids, attention_mask, position_ids, seq_ids) -> dict:
    """The backbone's arguments in exact mode: positions, and the sequences' layout for the attention function."""
    if position_ids is None:
        real = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        position_ids = (real.cumsum(-1) - 1).clamp(min=0)
    real = torch.ones_like(input_ids, dtype=torch.bool) if seq_ids is not None or attention_mask is None \
        else attention_mask.bool()
    return {"attention_mask": _layout_mask(input_ids.device), "position_ids": position_ids,
            EXACT_KWARG: exact.sequences(position_ids, real)}


def _scored(input_ids: torch.Tensor, loss_mask: torch.Tensor):
    """The hidden states to score, as a boolean [B, L-1] (hidden state t predicts token t+1: those whose next token
    has loss mask 1), and the tokens they predict."""
    scored = loss_mask[:, 1:] > 0
    return scored, input_ids[:, 1:][scored]


def _scatter(values: torch.Tensor, scored: torch.Tensor, shape) -> torch.Tensor:
    """Values of the scored hidden states, placed on the tokens they are for ([B, L], 0 elsewhere)."""
    out = torch.zeros(shape, dtype=values.dtype, device=values.device)
    out[:, 1:][scored] = values
    return out


class PolicyModel(nn.Module):
    """Wraps a Hugging Face causal LM; `forward` returns per-token logprobs (and entropy) of the trained tokens.

    `vocab_limit`: the policy's action space is the tokenizer's ids; a model whose embedding is padded beyond them
    (Qwen2.5: 151,936 rows for 151,665 tokens) gets its distribution restricted to them, as the sampler does.

    Going through this module's `forward` (rather than reaching into submodules) keeps DDP/FSDP wrapping by
    accelerate correct. `self.lm` is the plain HF model, shared (no copy) with the generation backend.
    """

    def __init__(self, lm: nn.Module, vocab_limit: int | None = None, logprob_chunk_tokens: int | None = CHUNK_TOKENS,
                 exact: bool = False):
        super().__init__()
        self.lm = lm
        if exact:
            _use_exact_attention(lm)
            _compile_exact_layers(lm)
        self.exact = exact  #: exact mode (`agents.exact`): logprobs bit for bit the engine's in exact mode
        self.vocab_limit = vocab_limit  #: logprobs over ids below this (the tokenizer's size), as the sampler used
        #: trained tokens per LM-head chunk (`agents.logprobs.token_logprobs`; None: all at once)
        self.logprob_chunk_tokens = logprob_chunk_tokens
        # the LM's layer classes: accelerate's FSDP wraps each of them as its own unit (its auto-wrap policy reads this)
        self._no_split_modules = getattr(lm, "_no_split_modules", None)
        if has_adapters(lm):  # LoRA: checkpoints hold the adapters, not the frozen base (`trainers.lora`)
            state_dict_of_trained_only(self)

    def forward(self, input_ids, loss_mask, attention_mask=None, position_ids=None, seq_ids=None,
                temperature: float = 1.0, with_entropy: bool = False):
        hidden = self.hidden_states(input_ids, attention_mask, position_ids, seq_ids)
        scored, targets = _scored(input_ids, loss_mask)
        logprobs, entropy = token_logprobs(hidden[:, :-1][scored], self.lm.get_output_embeddings(), targets,
                                           temperature=temperature, vocab_limit=self.vocab_limit,
                                           with_entropy=with_entropy, chunk_tokens=self.logprob_chunk_tokens,
                                           exact=self.exact)
        out_lp = _scatter(logprobs, scored, input_ids.shape)
        return out_lp, None if entropy is None else _scatter(entropy, scored, input_ids.shape)

    def hidden_states(self, input_ids, attention_mask=None, position_ids=None, seq_ids=None) -> torch.Tensor:
        """The backbone's last hidden states [B, L, hidden] as `forward` scores them (in exact mode: the engine's
        bits, its layout and operations). Called outside `forward` only on an unwrapped model (tests, checks)."""
        backbone = getattr(self.lm, self.lm.base_model_prefix)
        if self.exact:
            kwargs = _exact_kwargs(input_ids, attention_mask, position_ids, seq_ids)
            if torch.is_grad_enabled():  # a backward will run: flash attention's where it checks out (once)
                _recompute_under_exact_ops(self.lm)
                config = self.lm.config
                head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
                exact.check_attention_backward(input_ids.device, _compute_dtype(self.lm), head_dim)
        else:
            kwargs = _attention_kwargs(self.lm, input_ids, attention_mask, position_ids, seq_ids)
        with exact.ops(self.exact):
            return backbone(input_ids=input_ids, use_cache=False, **kwargs).last_hidden_state


class CriticModel(nn.Module):
    """A value model: a transformer backbone plus a linear head; `forward` returns values of the trained tokens.

    Initialised from the policy's backbone weights (a copy) unless given its own backbone.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        if has_adapters(backbone):  # a copy of a LoRA policy's backbone: its base stays frozen, as the policy's
            state_dict_of_trained_only(self)

    @classmethod
    def from_policy(cls, lm: nn.Module) -> CriticModel:
        import copy

        backbone = copy.deepcopy(getattr(lm, lm.base_model_prefix))
        critic = cls(backbone, lm.config.hidden_size)
        first = next(lm.parameters())
        return critic.to(device=first.device, dtype=first.dtype)

    def forward(self, input_ids, loss_mask, attention_mask=None, position_ids=None, seq_ids=None):
        hidden = self.backbone(
            input_ids=input_ids, use_cache=False,
            **_attention_kwargs(self.backbone, input_ids, attention_mask, position_ids, seq_ids),
        ).last_hidden_state
        scored, _ = _scored(input_ids, loss_mask)
        values = self.head(hidden[:, :-1][scored]).squeeze(-1).float()
        return _scatter(values, scored, input_ids.shape)
