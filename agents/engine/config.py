"""The engine's one configuration object: which knobs are public, and the experiments' constants beside them.

Public knobs are `EngineConfig`'s fields. The module constants below are the measured choices (docs/engine.md
says what was tried): change them for an experiment, not in a recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

#: most padded tokens (rows x widest new part) per prefill pass: bounds the activations of one pass
PREFILL_TOKENS = 32768
#: a prefill pass takes rows whose widths (new tokens) are within this ratio, those narrower than the floor counted as
#: that wide; the others wait for a pass of their own (a group's members, whose prompt the first member computes, go
#: in a later pass a few tokens wide instead of padded to the prompt's width)
PREFILL_WIDTH_RATIO = 2
PREFILL_WIDTH_FLOOR = 64
#: a prefill pass's width is padded to a multiple of this, so that passes come in fewer shapes
PREFILL_WIDTH_STEP = 16
#: a prefill pass of at most this many rows and `PREFILL_GRAPH_TOKENS` padded tokens replays a CUDA graph
PREFILL_GRAPH_ROWS = 8
PREFILL_GRAPH_TOKENS = 4096
#: decode steps attend to a length rounded up to a multiple of this (few graph shapes)
LENGTH_STEP = 256
#: KV pool size when neither `kv_blocks` nor `kv_cache_gib` is given: this many tokens per sequence slot
DEFAULT_TOKENS_PER_SEQ = 4096


@dataclass(frozen=True)
class EngineConfig:
    """How the engine serves one module.

    Args:
        max_seqs: most sequences decoded together (a decode step's rows); more wait.
        max_context_len: prompt + generation limit of one sequence; default the model's
            ``max_position_embeddings``. Generation that reaches it ends with ``"length"``.
        block_size: KV positions per block.
        kv_blocks: KV blocks in the pool (one of them the null block). Default: from `kv_cache_gib`, else enough
            for `DEFAULT_TOKENS_PER_SEQ` tokens per sequence slot. Sequences share the pool: one may use up to
            `max_context_len` while others use little; when it runs out, the newest sequences are preempted.
        kv_cache_gib: size the pool to this many GiB instead (K and V of every layer).
        prefix_cache: keep the KV of ended sequences (and of shared prompts) to be found again by content: a
            conversation's next turn prefills only its new tokens, a group's prompt is computed once.
        attention: decode attention kernel, ``"auto"`` (Triton on CUDA where it imports, else gather), or one of
            `agents.engine.attention.KERNELS`.
        cuda_graphs: replay decode steps and small prefill passes from CUDA graphs (on CUDA).
        compile: compile the layer functions with Inductor: ``"auto"`` on CUDA only, True also on CPU, False never.
        overlap_steps: launch each decode step before reading the previous step's tokens.
        exact: exact mode (`agents.exact`, docs/exact.md): each sampled token's logprob equals, bit for bit, the
            trainer's in exact mode. Attention then runs the ``"exact"`` kernel whatever `attention` says, and the
            layer functions run compiled where `agents.exact.compiles_layers` says (CUDA), as the trainer's layers,
            whatever `compile` says (True, which would compile on CPU too, is refused).
    """

    max_seqs: int = 64
    max_context_len: int | None = None
    block_size: int = 16
    kv_blocks: int | None = None
    kv_cache_gib: float | None = None
    prefix_cache: bool = True
    attention: str = "auto"
    cuda_graphs: bool = True
    compile: bool | str = "auto"
    overlap_steps: bool = True
    exact: bool = False

    def __post_init__(self):
        for name in ("max_seqs", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_context_len is not None and (not isinstance(self.max_context_len, int)
                                                 or self.max_context_len < 2):
            raise ValueError(f"max_context_len must be an integer >= 2, got {self.max_context_len!r}")
        if self.kv_blocks is not None and (not isinstance(self.kv_blocks, int) or self.kv_blocks < 2):
            raise ValueError(f"kv_blocks must be an integer >= 2 (one is the null block), got {self.kv_blocks!r}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib!r}")
        if self.attention not in ("auto", "gather", "triton"):
            raise ValueError(f"attention must be 'auto', 'gather' or 'triton', got {self.attention!r}")
        if self.compile not in (True, False, "auto"):
            raise ValueError(f"compile must be True, False or 'auto', got {self.compile!r}")
        if self.exact and self.compile is True:
            raise ValueError("exact mode compiles its layers where the trainer does (agents.exact.compiles_layers): "
                             "compile=True cannot go with exact=True")

    def pool_blocks(self, bytes_per_token: int) -> int:
        """The pool's size in blocks, the null block included, for a model whose KV takes `bytes_per_token`."""
        if self.kv_blocks is not None:
            return self.kv_blocks
        if self.kv_cache_gib is not None:
            tokens = int(self.kv_cache_gib * 2**30) // bytes_per_token
        else:
            tokens = self.max_seqs * min(self.max_context_len or DEFAULT_TOKENS_PER_SEQ, DEFAULT_TOKENS_PER_SEQ)
        return max(2, tokens // self.block_size + 1)
