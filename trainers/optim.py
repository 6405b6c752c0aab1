"""The trainer's optimizer: AdamW with float32 master weights for low-precision (bf16/fp16) parameters.

Why not `torch.optim.AdamW` on a bf16 model: an AdamW step moves a weight by about ``lr``, and at RL learning rates
(1e-6) that is far below half a bf16 unit in the last place of almost every weight (2.4e-4 at 0.05, 3.9e-3 at 1.0):
the rounded weight does not change. Measured: 10 steps at lr 1e-6 change 2% of N(0, 0.02) bf16 weights and 0.04%
of weights near 1 (norms); the bf16 GPU recipes would not learn (`tests/test_optim.py` shows it). Mixed-precision
trainers keep float32 masters for this reason (Megatron, DeepSpeed, FSDP's float32 parameters with bf16 compute);
here the module itself stays in the recipe's dtype, because the embedded engine generates with that very module
(no weight copy), so the masters live in the optimizer.

`AdamW` keeps, for each trained low-precision parameter, its float32 master and float32 moments in the parameter's
optimizer state (keys ``master``, ``exp_avg``, ``exp_avg_sq``, ``step``), steps the masters with torch's functional
Adam (decoupled weight decay: AdamW's arithmetic) and writes them back to the parameter rounded. Float32 parameters
are stepped in place, exactly as `torch.optim.AdamW` steps them. The parameter groups hold the module's own
parameters, so schedulers, accelerate and FSDP2's parameter switch see what they expect, and a checkpoint keeps the
masters (`load_state_dict` restores them in float32).
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam

LOW_PRECISION = (torch.bfloat16, torch.float16)
_FLOAT32_STATE = ("master", "exp_avg", "exp_avg_sq")
#: parameters stepped together: their bf16 gradients' float32 copies exist for one such chunk at a time (256 MiB)
CHUNK_ELEMENTS = 1 << 26


class AdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` (same arguments and defaults, no amsgrad or closure) whose bf16/fp16 parameters are
    stepped through float32 masters; see the module docstring. Fused on CUDA tensors, foreach or per tensor
    elsewhere (torch's defaults)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("trainers.optim.AdamW takes no closure")
        for group in self.param_groups:
            stepped = [(p, self._state_of(p)) for p in group["params"] if p.grad is not None]
            for chunk in _chunks(stepped):
                self._step_chunk(group, chunk)
        return None

    def _step_chunk(self, group: dict, stepped: list[tuple[torch.Tensor, dict]]) -> None:
        """One AdamW step of some parameters of `group` (their gradients in float32 for the step only)."""
        masters = [s.get("master", p) for p, s in stepped]
        beta1, beta2 = group["betas"]
        adam(masters, [p.grad.float() for p, _ in stepped], [s["exp_avg"] for _, s in stepped],
             [s["exp_avg_sq"] for _, s in stepped], [], [s["step"] for _, s in stepped],
             fused=all(map(_fusable, masters)) or None, decoupled_weight_decay=True, amsgrad=False, beta1=beta1,
             beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        for p, s in stepped:
            if "master" in s:
                p.copy_(s["master"])

    def _state_of(self, p: torch.Tensor) -> dict:
        """`p`'s state, completed at its first step (or after loading a checkpoint of `torch.optim.AdamW`, which has
        no master): float32 moments, and the float32 master of a low-precision `p`."""
        state = self.state[p]
        if "master" not in state and p.dtype in LOW_PRECISION:
            state["master"] = p.detach().float().clone(memory_format=torch.contiguous_format)
        master = state.get("master", p)
        at = master.device if _fusable(master) else torch.device("cpu")  # where the fused kernel or the others want it
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=at)
        elif state["step"].device != at:
            state["step"] = state["step"].to(device=at, dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros_like(master, memory_format=torch.preserve_format)
            elif state[key].dtype != master.dtype:
                state[key] = state[key].to(master.dtype)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load as `torch.optim.Optimizer` does, then put back in float32 the masters and moments that it casts to
        each parameter's dtype."""
        super().load_state_dict(state_dict)
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(ids, params):
            saved = state_dict["state"].get(i, {})
            for key in _FLOAT32_STATE:
                if key in saved:
                    self.state[p][key] = saved[key].to(device=p.device, dtype=torch.float32, copy=True)


def _chunks(stepped: list, elements: int = CHUNK_ELEMENTS) -> list[list]:
    """`stepped` cut into runs of about `elements` parameter elements (a parameter larger than that alone)."""
    chunks, size = [[]], 0
    for item in stepped:
        if chunks[-1] and size + item[0].numel() > elements:
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += item[0].numel()
    return [c for c in chunks if c]


def _fusable(t: torch.Tensor) -> bool:
    """Whether torch's fused Adam kernel takes `t`: a plain (not distributed) CUDA tensor."""
    return t.is_cuda and type(t) in (torch.Tensor, torch.nn.Parameter)
