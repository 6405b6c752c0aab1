"""`agents.compiling`: one Inductor compilation per compiled function and shape class, without a wasted attempt."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from agents import compiling


class _Scaled(nn.Module):
    """A layer whose Python float attribute reaches an op, as attention's ``scaling`` reaches SDPA."""

    def __init__(self, scaling: float):
        super().__init__()
        self.scaling = scaling


def _attend(layer: _Scaled, x: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(x, x, x, scale=layer.scaling) * 2


def test_a_float_attribute_compiles_once_without_a_restarted_attempt(caplog):
    """Dynamo traced a float attribute of a module argument as a symbolic float, then threw the attempt away
    (TensorifyScalarRestartAnalysis) and traced again with it specialised: every first step paid its functions'
    tracing twice. Floats are specialised from the start: one attempt (a 'compiling' record per 'compiled' one),
    and layers with the same value share the compilation."""
    fn = compiling.Compiled(_attend)
    x = torch.randn(2, 2, 5, 16)
    with caplog.at_level(logging.INFO, logger=compiling.progress.name):
        out = fn(_Scaled(0.125), x)
        again = fn(_Scaled(0.125), torch.randn(2, 2, 5, 16))  # another layer of the same value: no compilation
    attempts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling _attend")]
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled _attend")]
    assert fn.failure is None and len(attempts) == len(done) == 1, caplog.text
    assert again.shape == (2, 2, 5, 16)
    torch.testing.assert_close(out, _attend(_Scaled(0.125), x))
