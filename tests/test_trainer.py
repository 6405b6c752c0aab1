"""trainers/ppo.py end to end on CPU (a few steps of a tiny model), checkpoint/resume and guards."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainers.ppo import main as ppo_main
from mt_env.trajectories import read_metrics

from .conftest import ROOT, subprocess_env

TINY = [
    "model.config={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
    "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 512}",
    "rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=24", "sft.steps=3", "sft.batch_size=8",
    "eval.episodes=8", "trainer.eval_every=0", "trainer.save_every=0", "trainer.time_limit_s=null",
    "trainer.micro_batch_size=4", "trainer.minibatch_size=8", "logging.plot=false",
]


def run(tmp_path, *overrides, steps=2):
    return ppo_main(["--set", f"output_dir={tmp_path}", "--set", f"trainer.total_steps={steps}",
                     *[a for o in [*TINY, *overrides] for a in ("--set", o)]])


def metrics(path) -> list[dict]:
    return read_metrics(Path(path) / "metrics.jsonl")


def torchrun(out: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """trainers/ppo.py in 2 processes (gloo on CPU) writing to `out`, with `--set` overrides."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "trainers" / "ppo.py"), "--set", f"output_dir={out}",
           *[a for o in overrides for a in ("--set", o)]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=subprocess_env(), cwd=ROOT)


# --------------------------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("variant", [
    ["algorithm.name=grpo", "algorithm.kl_mode=loss", "algorithm.kl_coef=0.01", "algorithm.entropy_coef=0.01"],
    ["algorithm.name=ppo", "algorithm.kl_mode=reward", "algorithm.kl_coef=0.01", "trainer.packed=true",
     "algorithm.turn_gamma=0.9", "algorithm.tis_cap=2.0"],
])
def test_a_few_steps_end_to_end(tmp_path, variant):
    summary = run(tmp_path, *variant, "trainer.save_every=2")
    assert summary["steps"] == 2 and summary["final_val_success"] is not None
    rows = metrics(tmp_path)
    steps = [r for r in rows if "actor/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["rollout/episodes"] == 8 and r["actor/skipped_updates"] == 0
        assert r["mismatch/logprob_abs_max"] < 1e-3  # the HF backend and the trainer agree on the sampled tokens
        assert all(v is None or isinstance(v, (int, float, str)) for v in r.values())
    if "algorithm.name=ppo" in variant:
        assert "critic/loss" in steps[0]
    assert (tmp_path / "checkpoints" / "checkpoint_2").is_dir()


def test_training_episodes_play_in_env_processes(tmp_path, monkeypatch):
    """rollout.env_processes: the training driver is a ProcessRolloutDriver (the env factory travels by
    cloudpickle); the steps log the usual rollout metrics."""
    from agents.rollout_processes import ProcessRolloutDriver

    played, arun = [], ProcessRolloutDriver.arun

    async def counted(driver, tasks, *args, **kwargs):
        played.append((driver.processes, len(driver.pids)))
        return await arun(driver, tasks, *args, **kwargs)

    monkeypatch.setattr(ProcessRolloutDriver, "arun", counted)
    summary = run(tmp_path, "rollout.env_processes=2", "sft.steps=0", "eval.episodes=2", "threads=1")
    assert summary["steps"] == 2
    assert played == [(2, 0), (2, 2)]  # both steps' episodes, in the processes the first step started
    steps = [r for r in metrics(tmp_path) if "actor/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["rollout/episodes"] == 8 and r["rollout/failed"] == 0
        assert r["rollout/completed"] + r["rollout/truncated"] == 8 and r["rollout/generated_tokens"] > 0
        assert r["mismatch/logprob_abs_max"] < 1e-3 and "time/generation_s" in r
        # the engine's counters over the step's rollout: every decoded row is one generated token (first tokens
        # come from prefill passes)
        assert 0 < r["engine/decoded_rows"] < r["rollout/generated_tokens"] and r["engine/prefill_passes"] >= 1


def test_a_batch_without_trainable_tokens_is_skipped_not_crashed(tmp_path):
    summary = run(tmp_path / "skip", "env.budget.max_prompt_tokens=8", "sft.steps=0", steps=1)  # all over budget
    assert summary["steps"] == 1
    rows = metrics(tmp_path / "skip")
    step1 = next(r for r in rows if r["step"] == 1)
    assert step1["rollout/skipped"] == 8 and "actor/loss" not in step1


def test_resume_continues_as_if_never_stopped(tmp_path):
    # the entropy bonus gives non-zero gradients every step (rewards are 0 for a random model): optimizer state matters
    common = ["trainer.save_every=1", "algorithm.name=ppo", "algorithm.kl_coef=0.01", "algorithm.entropy_coef=0.01",
              "rollout.max_batch_size=1"]
    run(tmp_path / "straight", *common, steps=3)
    run(tmp_path / "resumed", *common, steps=1)
    run(tmp_path / "resumed", *common, "trainer.resume=auto", steps=3)
    a = {r["step"]: r for r in metrics(tmp_path / "straight") if "actor/loss" in r}
    b = {r["step"]: r for r in metrics(tmp_path / "resumed") if "actor/loss" in r}
    for step in (2, 3):
        assert a[step]["actor/grad_norm"] > 0
        for key in ("rollout/generated_tokens", "rollout/reward_mean", "actor/loss", "actor/grad_norm",
                    "critic/loss", "rollout/response_len_mean"):
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-5, abs=1e-7), (step, key)
    from safetensors.torch import load_file

    wa = load_file(str(sorted((tmp_path / "straight" / "checkpoints").glob("checkpoint_*"))[-1] / "model.safetensors"))
    wb = load_file(str(sorted((tmp_path / "resumed" / "checkpoints").glob("checkpoint_*"))[-1] / "model.safetensors"))
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


@pytest.mark.skipif(sys.platform != "linux", reason="two-process gloo run tested on Linux")
def test_two_process_ddp_on_cpu(tmp_path):
    """The same script under torchrun with 2 processes: DDP over gloo, global batch sizes split between them, and
    metrics combined (counts summed) even when the processes report different keys."""
    proc = torchrun(tmp_path, "trainer.total_steps=2", "threads=1", *TINY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [r for r in metrics(tmp_path) if "actor/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["dist/processes"] == 2
        assert r["rollout/episodes"] == 8  # 4 tasks x 2 samples in all: 2 tasks on each process
    # complete checkpoints (SFT's end, the last step), with both processes' RNG states; they export like a
    # single-process one
    from trainers import checkpoints
    from trainers.export import export

    assert [(f.step, f.problem) for f in checkpoints.scan(tmp_path)] == [(0, None), (2, None)]
    found = checkpoints.scan(tmp_path)[-1]
    assert {p.name for p in found.path.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}
    out, _ = export(found.path, tmp_path / "exported")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in checkpoints.policy_state_dict(found.path).items())


# --------------------------------------------------------------------------------------------- old logprobs
def _update_once(minibatch_size: int, take_old_from_update: bool):
    """One `update` of a tiny fp32 model on a fixed batch of 6 rows; returns (parameters after, metrics, whether
    `single_update` holds)."""
    from accelerate import Accelerator

    from benchmarks.bench_update import batch_from_lengths
    from trainers.config import load_config
    from trainers.modeling import PolicyModel, build_causal_lm
    from trainers.ppo import Models, score, single_update, update

    accelerator = Accelerator(cpu=True)
    lm = build_causal_lm(config={"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
                         vocab_size=300, seed=0)
    policy = PolicyModel(lm)
    models = Models(policy, torch.optim.SGD(policy.parameters(), lr=1.0), scheduler=None)
    cfg = load_config("quickstart.yaml", [f"trainer.minibatch_size={minibatch_size}", "trainer.micro_batch_size=4",
                                          "algorithm.tis_cap=2.0", "env.budget.max_response_tokens=24"])
    batch = batch_from_lengths([5, 9, 3, 7, 4, 8], [12, 6, 20, 9, 15, 11], 300, "cpu", seed=1)
    single = single_update(batch, accelerator, cfg)
    batch, seconds = score(batch.replace(old_logprobs=None, ref_logprobs=None), models, cfg,
                           old=not take_old_from_update)
    metrics, _ = update(batch, models, accelerator, cfg, step=1)
    return [p.detach().clone() for p in policy.parameters()], {**metrics, **seconds}, single


def test_one_optimizer_step_takes_the_old_logprobs_from_the_update_and_changes_nothing():
    """One epoch, one mini-batch: the update's own logprobs (detached) serve as the old ones, so that pass is
    skipped; the update is the one made after a separate old-logprob pass (fp32: ratio 1 either way), and the
    rollout/trainer mismatch is still measured. With two mini-batches the second is off-policy: the pass runs."""
    with_pass, metrics_pass, single = _update_once(minibatch_size=8, take_old_from_update=False)
    reused, metrics_reused, _ = _update_once(minibatch_size=8, take_old_from_update=True)
    assert single
    assert "perf/old_logprob_s" in metrics_pass and "perf/old_logprob_s" not in metrics_reused
    assert max(float((a - b).abs().max()) for a, b in zip(with_pass, reused)) < 1e-5
    assert metrics_reused["mismatch/logprob_abs_max"] > 0  # measured on the update's logprobs
    assert metrics_reused["actor/ratio_mean"] == pytest.approx(1.0)
    _, _, two_minibatches = _update_once(minibatch_size=4, take_old_from_update=False)
    assert not two_minibatches
