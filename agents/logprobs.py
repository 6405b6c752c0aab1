"""Per-token logprobs (and entropy) of chosen ids from the last hidden state and the LM head: the one function the
trainer and the inference engine share, so both compute a token's logprob the same way.

    logprobs, entropy = token_logprobs(hidden, lm.lm_head, targets, temperature=0.7, vocab_limit=len(tokenizer),
                                       with_entropy=True)

The distribution is ``softmax(lm_head(hidden)[:, :vocab_limit].float() / temperature)``; `logits_logprobs` is that
computation on logits a caller already has (the engine's sampler), and `token_logprobs` runs it in chunks of
`chunk_tokens` hidden states: no ``[tokens, vocab]`` tensor is ever made, and under autograd each chunk is
recomputed in backward (`torch.utils.checkpoint`) instead of keeping its logits alive between forward and backward
— memory per chunk, whatever the token count, for one more LM-head matmul in backward (in exact mode the forward's
logits again, with the forward's softmax statistics: `_exact_recompute`).

Why not a library kernel (liger-kernel, read at its ``main`` of 2026-10): its fused linear cross entropy returns the
per-token loss (``reduction="none"``) but no entropy and no temperature (only by pre-scaling the half-precision hidden
state, which rounds differently from ``logits / T``), its per-token gradient was wrong before July 2026 (a silent
error in older releases), and it synchronises with the host on every call. Its chunked selective-logprob function
(``chunked_loss.fused_linear_ppo``) is private, has no entropy, and is plain torch chunking, as here. Its GRPO loss
owns the loss, which stays in `trainers.algos.policy_loss`. The chunk's arithmetic is instead compiled by Inductor on
CUDA (`agents.compiling`), which fuses the float32 cast, the log-sum-exp, the gather and the entropy into a few
reductions over the half-precision logits.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from agents.compiling import compiled
from agents.exact import forward_bits_in_recompute, ops, runs_kernels, token_logprob

#: hidden states per chunk: a float32 [chunk, 152k] is ~0.6 GB (what a chunk's backward holds a few of)
CHUNK_TOKENS = 1024
#: the ops whose outputs a chunk's recomputation takes from its forward in exact mode (`_exact_recompute`)
SAVED_IN_EXACT = ("mt_env::exact_softmax_stats",)


def logits_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor,
                    with_entropy: bool = False, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 logprobs of `targets` [N] under ``softmax(logits.float() / temperature)`` (`logits` [N, vocab], any
    float dtype; `temperature` a number or one per row, [N]), and that distribution's entropy [N] when asked.
    `exact`: the bits of `agents.exact.tempered_log_softmax`, the engine's sampler's in exact mode, through
    `agents.exact.token_logprob` (a temperature of 0 counts as 1 there, as for the sampler's greedy rows)."""
    if exact:  # one token per row: the sampler's bits without its [N, vocab] log-softmax
        per_row = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device).expand(len(logits))
        logprobs, entropy = token_logprob(logits, targets, torch.where(per_row == 0, 1.0, per_row))
        return logprobs, entropy if with_entropy else None
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.float()[:, None]
    z = logits.float() / temperature
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
    logprobs = logp.gather(-1, targets[:, None]).squeeze(-1)
    if not with_entropy:
        return logprobs, None
    return logprobs, -(logp.exp() * logp).sum(-1)


def token_logprobs(hidden: torch.Tensor, lm_head: nn.Module, targets: torch.Tensor, *,
                   temperature: float | torch.Tensor = 1.0, vocab_limit: int | None = None,
                   with_entropy: bool = False, chunk_tokens: int | None = CHUNK_TOKENS,
                   exact: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of `targets` [N] predicted from `hidden` [N, H] through `lm_head` (the module itself, so an adapter
    on it runs), over ids below `vocab_limit`, at `temperature` (a number, or one per row [N], > 0): float32 [N],
    and the entropy [N] when `with_entropy` (else None).

    Chunks of `chunk_tokens` hidden states (None: all at once, no recomputation); with gradients on, each chunk is
    recomputed in backward rather than stored. The values do not depend on the chunking. `exact`: exact mode
    (`agents.exact`): the LM head and the log-softmax batch-invariant, bit for bit the engine's."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"token_logprobs wants hidden [N, H] and targets [N], got {tuple(hidden.shape)} and "
                         f"{tuple(targets.shape)}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 or None, got {chunk_tokens}")
    per_row = isinstance(temperature, torch.Tensor)
    score = compiled(logits_logprobs) if hidden.is_cuda and not exact else logits_logprobs

    def chunk(h, t, temp):
        with ops(exact):
            return score(lm_head(h)[:, :vocab_limit], t, temp, with_entropy, exact)

    size = chunk_tokens or max(1, len(hidden))
    if len(hidden) <= size and (chunk_tokens is None or not torch.is_grad_enabled()):
        return chunk(hidden, targets, temperature)
    outputs = []
    selective = {"context_fn": _exact_recompute} if exact and runs_kernels(hidden) else {}
    for start in range(0, max(1, len(hidden)), size):
        part = slice(start, start + size)
        temp = temperature[part] if per_row else temperature
        if torch.is_grad_enabled():
            outputs.append(checkpoint(chunk, hidden[part], targets[part], temp, use_reentrant=False, **selective))
        else:
            outputs.append(chunk(hidden[part], targets[part], temp))
    logprobs = torch.cat([lp for lp, _ in outputs])
    return logprobs, torch.cat([ent for _, ent in outputs]) if with_entropy else None


def _exact_recompute():
    """Selective checkpointing for an exact chunk: its recomputation in backward makes the forward's logits again
    (the exact kernel, not cuBLAS: `agents.exact.forward_bits_in_recompute`) and takes the forward's softmax
    statistics ([chunk, 3] float32, `SAVED_IN_EXACT`) rather than reading those logits once more to make them. So the
    gradient is that of the forward's own distribution. Only where the kernels run (`agents.exact.runs_kernels`):
    selective checkpointing costs host time on every operation of the chunk (docs/exact.md), and the torch
    versions' statistics are many operations."""
    forward, recompute = create_selective_checkpoint_contexts(_save_exact_stats)
    return forward, _in_both(recompute, forward_bits_in_recompute())


@contextlib.contextmanager
def _in_both(first, second):
    with first, second:
        yield


def _save_exact_stats(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op.name() in SAVED_IN_EXACT else CheckpointPolicy.PREFER_RECOMPUTE
