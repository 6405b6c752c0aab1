"""Shared setup of the Triton kernel tests: `require_kernels` skips the calling test module unless the kernels can
run (Triton installed, and CUDA via ``MT_ENV_TEST_DEVICE=cuda`` or Triton's interpreter via ``TRITON_INTERPRET=1``);
the dtypes they run in (bfloat16 on CUDA only: the interpreter reads it as raw bits in `tl.dot`), the number of
hypothesis examples, tolerances against torch, and seeded inputs on the test device."""

from __future__ import annotations

import os

import pytest
import torch

from .backend_hf_fixtures import DEVICE

DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
EXAMPLES = 30 if DEVICE == "cuda" else 15
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def require_kernels(what: str = "the Triton kernels") -> None:
    """Skip the calling test module (call it at module level) where `what` cannot run."""
    pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA builds of torch)")
    if DEVICE != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(f"{what} need CUDA (MT_ENV_TEST_DEVICE=cuda) or TRITON_INTERPRET=1", allow_module_level=True)


def randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)
