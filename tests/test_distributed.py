"""Several processes on CPU (gloo): DDP gives the single-process update and metrics (benchmarks/ddp_check.py), and
FSDP2 works with the embedded engine — each process generates a different number of tokens on gathered weights
without a collective, the results equal the unsharded model's, and training, scoring and the KL reference still
work on the shards afterwards."""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import ROOT, subprocess_env

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, tie_word_embeddings=True)
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="multi-process gloo runs tested on Linux")


# --------------------------------------------------------------------------------------------- DDP
@linux_only
def test_ddp_update_equals_the_single_process_update(tmp_path):
    """One update of a fixed batch on 1 and on 2 processes (5 and 4 rows: the second runs a weight-0 micro-batch
    slot): the same parameters, and the same loss terms and per-token statistics in the logged metrics."""
    out = tmp_path / "ddp_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ddp_check.py"), "--device", "cpu", "--out",
                           str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=subprocess_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["update_matches_1gpu"] and report["relative_diff"] < 1e-4
    assert report["max_abs_update"] > 1e-3  # the update moved the weights: the comparison is not vacuous
    metrics = report["metrics"]
    assert 0 < metrics["actor/clip_frac"]["1"] < 1 and metrics["actor/ratio_mean"]["1"] != 1.0
    assert all(m["match"] for m in metrics.values())


# --------------------------------------------------------------------------------------------- FSDP2
def _shard(module, mesh):
    """Shard a `PolicyModel` the way accelerate's FSDP2 does: each decoder layer, the embedding with the (tied)
    head and the final norm in one unit that stays gathered after forward, then the root."""
    from torch.distributed.fsdp import fully_shard

    lm = module.lm
    for layer in lm.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard([lm.model.norm, lm.model.embed_tokens, lm.lm_head], mesh=mesh, reshard_after_forward=False)
    return fully_shard(module, mesh=mesh)


def _generate(lm, prompts, max_new_tokens):
    from agents.hf_backend import HFBackend
    from agents.backend import SamplingParams

    backend = HFBackend(lm, max_batch_size=4, seed=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)

    async def all_of_them():
        try:
            return await asyncio.gather(*(backend.generate(p, params) for p in prompts))
        finally:
            await backend.close()

    return asyncio.run(all_of_them())


def _full(module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [p.detach().full_tensor() if isinstance(p, DTensor) else p.detach() for p in module.parameters()]


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(_full(a), _full(b)))


def _sharded(module) -> bool:
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in module.parameters())


def _check_generation(rank, policy, plain) -> dict:
    """Different requests and lengths on each process, no collective inside the context."""
    from trainers.distributed import gathered_for_generation

    prompts, new = ([[1, 2, 3, 4], [5, 6, 7], [9]], 12) if rank == 0 else ([[8, 9]], 3)
    with gathered_for_generation(policy):
        gathered = not any(_sharded(layer) for layer in policy.lm.model.layers)
        turns = _generate(policy.lm, prompts, new)
    expected = _generate(plain.lm, prompts, new)
    return {"gathered": gathered, "resharded": _sharded(policy),
            "same_tokens": [t.ids for t in turns] == [t.ids for t in expected],
            "logprob_diff": max(abs(a - b) for t, e in zip(turns, expected) for a, b in zip(t.logprobs, e.logprobs))}


def _check_scoring(rank, policy, plain) -> dict:
    """5 rows on one process, 2 on the other, micro-batches of 2: 3 and 1 forward passes, padded to 3."""
    from mt_env.batch import TrainBatch
    from trainers.config import load_config
    from trainers.distributed import forward_passes_everywhere
    from trainers.ppo import Models, score

    rows = 5 if rank == 0 else 2
    ids = torch.randint(1, 100, (rows, 10), generator=torch.Generator().manual_seed(rank))
    ones, zeros = torch.ones_like(ids), torch.zeros(ids.shape)
    batch = TrainBatch(input_ids=ids, attention_mask=ones, position_ids=ones.cumsum(-1) - 1, loss_mask=ones.float(),
                       rewards=zeros, rollout_logprobs=zeros, turn_ids=ones * 0, group=torch.arange(rows),
                       episode=torch.arange(rows), episode_rewards=torch.zeros(rows))
    scored, _ = score(batch, Models(policy, None, None), load_config("quickstart.yaml", ["trainer.micro_batch_size=2"]))
    with torch.no_grad():
        want, _ = plain(ids, ones.float(), attention_mask=ones, position_ids=ones.cumsum(-1) - 1)
    return {"passes": forward_passes_everywhere(1 if rank else 3, policy),
            "score_diff": float((scored.old_logprobs - want).abs().max())}


def _check_training_step(policy, plain) -> dict:
    """Both processes see the same batch, so the averaged gradient is the unsharded model's."""
    x = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(7))
    before = [t.clone() for t in _full(plain)]
    for model in (policy, plain):
        logprobs, _ = model(x, torch.ones_like(x).float())
        logprobs.sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return {"step_size": max(float((p - b).abs().max()) for p, b in zip(_full(plain), before)),
            "step_diff": _max_diff(policy, plain)}


def _check_reference(rank, out, mesh, reference_copy, policy) -> dict:
    """The KL reference, sharded like the policy, with its weights; and its checkpoint round trip."""
    import torch.distributed as dist

    from trainers.distributed import FullStateDict, frozen_reference
    from trainers.modeling import PolicyModel, build_causal_lm
    from trainers.setup import frozen_copy

    reference = frozen_reference(reference_copy, policy, shard=lambda m: _shard(m, mesh))
    state = FullStateDict(reference).state_dict()  # gathered on the main process only
    path = Path(out) / "reference.pt"
    if rank == 0:
        torch.save(state, path)
    dist.barrier()
    restored = _shard(PolicyModel(frozen_copy(build_causal_lm(config=TINY, vocab_size=100, seed=1))), mesh)
    FullStateDict(restored).load_state_dict(torch.load(path))
    return {"reference_sharded": _sharded(reference), "reference_diff": _max_diff(reference, policy),
            "state_keys": len(state), "restored_diff": _max_diff(restored, reference)}


def _fsdp_report(rank: int, out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from trainers.distributed import initialize_root
    from trainers.modeling import PolicyModel, build_causal_lm
    from trainers.setup import frozen_copy

    mesh = init_device_mesh("cpu", (2,))
    lm = build_causal_lm(config=TINY, vocab_size=100, seed=0)
    plain = PolicyModel(copy.deepcopy(lm))  # the unsharded twin: what every result must equal
    reference_copy = PolicyModel(frozen_copy(lm))
    policy = _shard(PolicyModel(lm), mesh)
    initialize_root(policy, torch.device("cpu"))
    return {**_check_generation(rank, policy, plain), **_check_scoring(rank, policy, plain),
            **_check_training_step(policy, plain), **_check_reference(rank, out, mesh, reference_copy, policy)}


def _fsdp_worker(rank: int, out: str) -> None:
    import gc

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(_fsdp_report(rank, out)))
    gc.collect()  # the sharded modules and their pending gloo work go while the group is alive (pytorch#179291)
    dist.barrier()
    dist.destroy_process_group()


@linux_only
def test_fsdp2_with_the_embedded_engine(tmp_path):
    torch.multiprocessing.spawn(_fsdp_worker, args=(str(tmp_path),), nprocs=2)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["gathered"] and r["resharded"], r
        assert r["same_tokens"] and r["logprob_diff"] < 1e-4, r
        assert r["passes"] == 3 and r["score_diff"] < 1e-5, r
        assert r["step_size"] > 1e-3 and r["step_diff"] < 1e-5, r
        assert r["reference_sharded"] and r["reference_diff"] == 0.0, r
        assert r["restored_diff"] == 0.0, r
    assert json.loads((tmp_path / "rank0.json").read_text())["state_keys"] > 0  # the main process holds it all
    assert json.loads((tmp_path / "rank1.json").read_text())["state_keys"] == 0


def test_weights_of_a_sharded_fsdp_checkpoint_are_merged(tmp_path):
    """accelerate saves an FSDP2 policy as torch.distributed.checkpoint shards (``pytorch_model_fsdp_0``, under
    "model"): export and evaluation read them back as one Hugging Face state dict."""
    import torch.distributed.checkpoint as dcp

    from trainers.checkpoints import policy_state_dict
    from trainers.modeling import PolicyModel, build_causal_lm

    lm = build_causal_lm(config=TINY, vocab_size=100, seed=0)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": PolicyModel(lm).state_dict()}, checkpoint_id=str(tmp_path / "pytorch_model_fsdp_0"))
    weights = policy_state_dict(tmp_path)
    assert weights.keys() == lm.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in lm.state_dict().items())
