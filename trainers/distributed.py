"""What the trainer needs from torch.distributed beyond accelerate's defaults: DDP settings, and FSDP2 with the
embedded generation engine.

**DDP** (`ddp_kwargs`): buffers are not broadcast before every forward pass (a causal LM's buffers — rotary
frequencies — never change, and a broadcast in a no-grad forward would need every process to run as many forward
passes), and gradients live in DDP's communication buckets (one copy less per step).

**FSDP2** (``accelerate launch --config_file trainers/configs/accelerate/fsdp2.yaml``) shards the policy, its
gradients and its optimizer state over the processes, so a model whose policy + reference + optimizer state does
not fit one GPU still trains. The embedded engine generates on the trainer's own module, and each process plays
different episodes — different numbers of forward passes — so generation cannot run through FSDP's per-layer
all-gathers. `gathered_for_generation` gathers every FSDP unit's parameters once (all processes together), keeps
them gathered through any number of forward passes (no collective runs: each unit's parameters are plain tensors
then, the engine's own layer loop runs on them), and frees them afterwards. Outside generation every process runs
the same number of forward passes (`forward_passes_everywhere`, and `trainers.ppo.minibatches` for the update).
The KL reference is sharded like the policy (`frozen_reference`) and checkpointed as a full state dict
(`FullStateDict`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn


def ddp_kwargs():
    """accelerate's handler for the DDP wrapper's settings (see the module docstring)."""
    from accelerate.utils import DistributedDataParallelKwargs

    return DistributedDataParallelKwargs(broadcast_buffers=False, gradient_as_bucket_view=True)


# --------------------------------------------------------------------------------------------- FSDP2
def fsdp_units(module: nn.Module) -> list[nn.Module]:
    """The FSDP2 units inside `module` (each wrapped layer is its own unit, and so is the root): empty without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered_for_generation(module: nn.Module, reshard_after_forward: bool = True) -> Iterator[None]:
    """Inside, every FSDP unit of `module` holds its full parameters and keeps them through forward passes, so a
    process may run any number of them without collectives; on exit they are sharded again (the full copies
    freed) and each unit reshards after forward as configured (`reshard_after_forward`: the FSDP plugin's
    setting). Every process must enter and leave together (the gathering is collective). A no-op without FSDP."""
    units = fsdp_units(module)
    for unit in units:
        unit.unshard()
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(reshard_after_forward, recurse=False)


def initialize_root(policy: nn.Module, device: torch.device) -> None:
    """FSDP2 takes the first unit to run forward as its root. Generation calls the LM inside the prepared policy,
    not the policy itself, so the policy runs one (empty-loss) forward pass first — on every process, together."""
    if not fsdp_units(policy):
        return
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    with torch.no_grad():
        policy(ids, torch.zeros_like(ids))


def across_processes(accelerator, x, op: str) -> float:
    """`x` (a number on each process) summed, or its min or max, over the processes."""
    t = torch.as_tensor(x, dtype=torch.float32, device=accelerator.device).reshape(1)
    if accelerator.num_processes == 1:
        return float(t)
    if op == "sum":
        return float(accelerator.reduce(t, reduction="sum"))
    gathered = accelerator.gather(t)
    return float(gathered.min() if op == "min" else gathered.max())


def forward_passes_everywhere(count: int, module: nn.Module) -> int:
    """The number of forward passes each process must run for `count` of its own: under FSDP, where every forward
    pass all-gathers, the largest count over the processes; otherwise `count`."""
    if not fsdp_units(module):
        return count
    device = next(module.parameters()).device
    total = torch.tensor([count], device=device)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return int(total)


def fsdp_sharding(accelerator):
    """How accelerate shards a model under FSDP2 (its wrap policy, mesh and settings), as a function of the model;
    None without FSDP2."""
    if not accelerator.is_fsdp2:
        return None
    from accelerate.utils import fsdp2_prepare_model

    return functools.partial(fsdp2_prepare_model, accelerator)


def frozen_reference(copy: nn.Module, policy: nn.Module, shard=None) -> nn.Module:
    """The KL reference: `copy` — an unsharded frozen copy of the policy made before accelerate prepared it (FSDP
    modules cannot be deep-copied) — sharded as the policy was (`shard`, from `fsdp_sharding`), with the weights of
    `policy` (the unwrapped policy, after the SFT warm start)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if shard is not None:
        copy = shard(copy)
    set_model_state_dict(copy, get_model_state_dict(policy))
    return copy


class FullStateDict:
    """A frozen module as accelerate checkpoints a registered object (the main process saves `state_dict()`, every
    process loads it): the full state dict, gathered from the shards under FSDP (every process takes part; the
    main process keeps it, on the CPU), loaded into each process's shard."""

    def __init__(self, module: nn.Module):
        self.module = module

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.module, state, options=StateDictOptions(full_state_dict=True))


# --------------------------------------------------------------------------------------------- memory
def peak_memory(device: torch.device) -> dict[str, float]:
    """This process's peak GPU memory since it started, in GiB: allocated by tensors, and reserved by the caching
    allocator (what nvidia-smi shows, minus the CUDA context); and the allocator's retries so far (a cudaMalloc that
    failed, the cache freed, the device synchronised: memory pressure slows a step without an error). Empty off
    GPU."""
    if device.type != "cuda":
        return {}
    return {"perf/peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "perf/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
            "perf/alloc_retries_total": float(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))}


def compile_totals() -> dict[str, float]:
    """Inductor's compilations in this process so far (the engine's and the trainer's, `agents.compiling`), their
    seconds, and the seconds of the calls that compiled (dynamo's tracing included): what makes a first step slow (a
    step's own share is the difference from the step before)."""
    from agents.compiling import COMPILE_COUNTS

    return {"perf/compilations_total": COMPILE_COUNTS["compilations"],
            "perf/compile_s_total": COMPILE_COUNTS["compile_s"],
            "perf/compiling_calls_s_total": COMPILE_COUNTS["compiling_calls_s"]}


#: metrics that count things: summed over processes (everything else is averaged)
COUNTS = {"rollout/episodes", "rollout/completed", "rollout/truncated", "rollout/failed", "rollout/skipped",
          "rollout/tool_errors", "rollout/parse_errors", "rollout/generated_tokens", "val/failed", "grpo/groups",
          "grpo/zero_variance_groups"}
COUNT_PREFIXES = ("rollout/finish_", "rollout/end/")
#: metrics that are maxima over the processes (memory per GPU)
MAXIMA = {"perf/peak_gib", "perf/peak_reserved_gib", "perf/alloc_retries_total", "async/staleness_max",
          "perf/compilations_total", "perf/compile_s_total", "perf/compiling_calls_s_total"}


def reduce_metrics(accelerator, metrics: dict) -> dict:
    """Combine the processes' metrics: counts are summed, maxima (`MAXIMA`) maximised, the rest averaged. Processes
    may report different keys (e.g. episode end reasons), so the dicts are gathered as objects, not as one tensor."""
    if accelerator.num_processes == 1:
        return metrics
    from accelerate.utils import gather_object

    everyone = gather_object([metrics])
    out = {}
    for key in sorted({k for d in everyone for k in d}):
        values = [float(d[key]) for d in everyone if key in d]
        if key in MAXIMA:
            out[key] = max(values)
        elif key in COUNTS or key.startswith(COUNT_PREFIXES):
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def token_means(accelerator, sums: dict[str, torch.Tensor], tokens: torch.Tensor) -> dict[str, float]:
    """Per-token statistics of the whole update over every process's tokens (what one process would log for the
    global batch): one all-reduce of the token-weighted sums, one read."""
    keys = sorted(sums)
    t = torch.stack([sums[k] for k in keys] + [torch.as_tensor(tokens, dtype=torch.float64)]).to(accelerator.device)
    if accelerator.num_processes > 1:
        t = accelerator.reduce(t, reduction="sum")
    *values, total = t.tolist()
    return {k: v / max(total, 1.0) for k, v in zip(keys, values)}
