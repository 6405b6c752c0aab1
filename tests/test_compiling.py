"""`agents.compiling`: one Inductor compilation per compiled function and shape class, without a wasted attempt, kept
in a cache that outlives the process and a reboot."""

from __future__ import annotations

import logging
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn

from agents import compiling

from .conftest import subprocess_env


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


def test_inductor_keeps_its_cache_where_a_reboot_leaves_it(tmp_path):
    """Inductor's compiled graphs and kernels go to ~/.cache/mt_env/inductor (XDG_CACHE_HOME honoured) unless
    TORCHINDUCTOR_CACHE_DIR says otherwise (a later run on the machine skips most compilation), or torch's default
    when that folder cannot be made."""
    probe = ("import agents.compiling, torch._dynamo; from torch._inductor.runtime.cache_dir_utils import cache_dir; "
             "print(cache_dir())")
    env = {k: v for k, v in subprocess_env(XDG_CACHE_HOME=str(tmp_path)).items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == str(tmp_path / "mt_env" / "inductor")
    chosen = tmp_path / "elsewhere"
    run = subprocess.run([sys.executable, "-c", probe], env=env | {"TORCHINDUCTOR_CACHE_DIR": str(chosen)},
                         capture_output=True, text=True, check=True)
    assert run.stdout.strip() == str(chosen)
    blocked = tmp_path / "a-file"  # a cache folder that cannot be made: torch's own default
    blocked.write_text("")
    run = subprocess.run([sys.executable, "-c", probe], env=env | {"XDG_CACHE_HOME": str(blocked / "cache")},
                         capture_output=True, text=True, check=True)
    assert "torchinductor_" in run.stdout
