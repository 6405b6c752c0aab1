"""`trainers.optim.AdamW`: float32 masters for bf16 parameters, torch's AdamW for float32 ones, checkpoints that keep
the masters."""

import io
import os

import pytest
import torch

from trainers.optim import AdamW


def _grads(steps: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    """Gradients that bf16 represents exactly (so a bf16 parameter's gradient is the float32 reference's), with a
    steady direction per element (so that the updates add up) and noise."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(n, generator=g)
    return [(direction + 0.3 * torch.randn(n, generator=g)).bfloat16().float() for _ in range(steps)]


def _run(optimizer_cls, param: torch.nn.Parameter, grads, **kw) -> torch.optim.Optimizer:
    opt = optimizer_cls([param], **kw)
    for grad in grads:
        param.grad = grad.to(param.dtype)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_bf16_parameters_follow_the_float32_reference_bit_for_bit(weight_decay):
    init = (torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    grads = _grads(300, init.numel())
    reference = torch.nn.Parameter(init.float())
    _run(torch.optim.AdamW, reference, grads, lr=1e-6, weight_decay=weight_decay)
    ours = torch.nn.Parameter(init.clone())
    opt = _run(AdamW, ours, grads, lr=1e-6, weight_decay=weight_decay)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(opt.state[ours]["master"], reference.detach())
    assert torch.equal(ours.detach(), reference.detach().bfloat16())
    # the reason for the masters: a bf16 AdamW rounds almost every one of these updates away
    plain = torch.nn.Parameter(init.clone())
    _run(torch.optim.AdamW, plain, grads, lr=1e-6, weight_decay=weight_decay)
    moved = (ours.detach() != init).float().mean().item()
    moved_plain = (plain.detach() != init).float().mean().item()
    assert moved > 0.5 and moved_plain < 0.2, (moved, moved_plain)


def test_float32_parameters_are_stepped_as_torch_adamw_steps_them():
    init = torch.randn(3, 257, generator=torch.Generator().manual_seed(2))
    grads = [g.reshape(3, 257) for g in _grads(5, 3 * 257)]
    reference, ours = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    ref_opt = _run(torch.optim.AdamW, reference, grads, lr=1e-3)
    opt = _run(AdamW, ours, grads, lr=1e-3)
    assert torch.equal(ours, reference)
    assert "master" not in opt.state[ours]
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.state[ours][key], ref_opt.state[reference][key])


def test_a_checkpoint_keeps_the_masters_and_resumes_bit_for_bit():
    init = (torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    grads = _grads(40, init.numel(), seed=4)
    straight = torch.nn.Parameter(init.clone())
    _run(AdamW, straight, grads, lr=1e-6)
    first = torch.nn.Parameter(init.clone())
    opt = _run(AdamW, first, grads[:20], lr=1e-6)
    buffer = io.BytesIO()
    torch.save({"param": first.detach(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = torch.nn.Parameter(saved["param"].clone())
    opt2 = AdamW([resumed], lr=1e-6)
    opt2.load_state_dict(saved["optimizer"])
    assert opt2.state[resumed]["master"].dtype == torch.float32
    assert opt2.state[resumed]["exp_avg"].dtype == torch.float32
    for grad in grads[20:]:
        resumed.grad = grad.bfloat16()
        opt2.step()
    assert torch.equal(opt2.state[resumed]["master"], _run(AdamW, torch.nn.Parameter(init.clone()), grads,
                                                           lr=1e-6).state_dict()["state"][0]["master"])
    assert torch.equal(resumed, straight)


def test_a_torch_adamw_checkpoint_of_bf16_parameters_loads():
    """A checkpoint written by `torch.optim.AdamW` (bf16 moments, no master): the masters start from the weights."""
    param = torch.nn.Parameter(torch.randn(64).bfloat16())
    old = _run(torch.optim.AdamW, param, _grads(3, 64), lr=1e-3)
    opt = AdamW([param], lr=1e-3)
    opt.load_state_dict(old.state_dict())
    param.grad = torch.ones(64, dtype=torch.bfloat16)
    opt.step()
    state = opt.state[param]
    assert state["master"].dtype == state["exp_avg"].dtype == torch.float32
    assert torch.equal(param.detach(), state["master"].bfloat16())


def test_frozen_parameters_are_left_alone_and_a_closure_is_refused():
    frozen, trained = torch.nn.Parameter(torch.ones(4).bfloat16()), torch.nn.Parameter(torch.ones(4))
    opt = AdamW([frozen, trained], lr=0.1)
    trained.grad = torch.ones(4)
    opt.step()
    assert not opt.state[frozen] and torch.equal(frozen, torch.ones(4).bfloat16())
    assert not torch.equal(trained, torch.ones(4))
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)


@pytest.mark.skipif(os.environ.get("MT_ENV_TEST_DEVICE") != "cuda" or not torch.cuda.is_available(),
                    reason="the fused kernel needs CUDA (MT_ENV_TEST_DEVICE=cuda)")
def test_on_cuda_the_fused_step_follows_the_float32_reference():
    """On CUDA the masters are stepped by torch's fused Adam kernel: bf16 parameters end where a float32 AdamW on the
    same GPU ends (to a few float32 ulps: the fused and foreach kernels round differently), and keep moving."""
    init = (torch.randn(3, 4099, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16().cuda()
    grads = [g.reshape(3, 4099).cuda() for g in _grads(200, 3 * 4099)]
    reference = torch.nn.Parameter(init.float())
    _run(torch.optim.AdamW, reference, grads, lr=1e-6, fused=True)
    ours = torch.nn.Parameter(init.clone())
    opt = _run(AdamW, ours, grads, lr=1e-6)
    master = opt.state[ours]["master"]
    assert master.is_cuda and master.dtype == torch.float32
    torch.testing.assert_close(master, reference.detach(), rtol=1e-6, atol=1e-9)
    assert (ours.detach() != init).float().mean().item() > 0.5
