"""trainers/export.py: a checkpoint becomes a Hugging Face model folder that transformers loads, with the run's
tokenizer, and whose logits are the trainer's."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from trainers import checkpoints
from trainers.checkpoints import RunState
from trainers.export import export

from .test_checkpoints import newest, tiny_trainer
from .test_trainer import ROOT, run

MESSAGES = [{"role": "user", "content": "What is 865 * 673?"}]


def trained_policy(tmp_path, tie: bool, tokenizer_name: str):
    """The trainer's policy after one optimizer step (so its weights are not a fresh init), saved by the trainer's
    `Checkpointer`; returns the live HF module, the tokenizer and the checkpoint."""
    _, saver, tokenizer = tiny_trainer(tmp_path / "run", model={"tie_word_embeddings": tie},
                                       tokenizer_name=tokenizer_name)
    lm = saver.lm
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-2)
    ids = torch.tensor([tokenizer.encode("What is 12 * 34?")])
    lm(ids, labels=ids).loss.backward()
    optimizer.step()
    return lm.eval(), tokenizer, saver.save(RunState(step=1))


@pytest.mark.parametrize("tie, tokenizer_name", [(False, "task"), (True, "offline:qwen2.5")])
def test_the_exported_model_has_the_trainers_logits_and_tokenizer(tmp_path, tie, tokenizer_name):
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    lm, tokenizer, checkpoint = trained_policy(tmp_path, tie, tokenizer_name)
    out, warning = export(checkpoint, tmp_path / "exported")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, lm(ids).logits)
    assert model.config.tie_word_embeddings == tie
    assert not any(k.startswith("lm.") for k in model.state_dict())
    exact = PreTrainedTokenizerFast.from_pretrained(out)
    assert exact.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == text
    assert exact.encode(text) == tokenizer.encode(text) and len(exact) == len(tokenizer)
    auto = AutoTokenizer.from_pretrained(out)
    if tokenizer_name == "task":  # Qwen2Tokenizer rebuilds Qwen's pre-tokenizer: the export says so, and how to load
        assert auto.encode(text) != tokenizer.encode(text)
        assert "PreTrainedTokenizerFast.from_pretrained" in warning
    else:
        assert warning is None and auto.encode(text) == tokenizer.encode(text) and len(auto) == len(tokenizer)


def test_export_of_a_training_run_from_the_command_line(tmp_path):
    """The run directory of trainers/ppo.py is enough: export picks its newest complete checkpoint."""
    from transformers import AutoModelForCausalLM

    run(tmp_path / "run", "trainer.save_every=1")
    proc = subprocess.run([sys.executable, "trainers/export.py", str(tmp_path / "run"), str(tmp_path / "hf")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"exported {newest(tmp_path / 'run')} -> {tmp_path / 'hf'}" in proc.stdout
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    weights = checkpoints.policy_state_dict(newest(tmp_path / "run"))
    assert weights and all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    (newest(tmp_path / "run") / "checkpoint.json").unlink()
    with pytest.raises(FileNotFoundError, match="is not a complete checkpoint: no checkpoint.json"):
        export(newest(tmp_path / "run"), tmp_path / "x")
