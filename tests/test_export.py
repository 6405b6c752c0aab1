"""trainers/export.py: a checkpoint becomes a Hugging Face model folder that transformers loads, with the run's
tokenizer, and whose logits are the trainer's."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from trainers import checkpoints
from trainers.checkpoints import RunState
from trainers.export import auto_tokenizer_mismatch, export

from .test_checkpoints import newest, tiny_trainer
from .test_trainer import ROOT, run

MESSAGES = [{"role": "user", "content": "What is 865 * 673?"}]
#: texts the loaded tokenizers must encode exactly as the run's: a rendered tool-calling episode, odd spacing,
#: digits, non-ASCII and combining characters (NFC), control tokens inside text
SAMPLE_MESSAGES = MESSAGES + [
    {"role": "assistant", "content": "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": "
                                     "\"865 * 673\"}}\n</tool_call>"},
    {"role": "tool", "content": "582145"}, {"role": "assistant", "content": "The answer is 582145."}]
SAMPLE_TEXTS = ["  two  spaces\n\n\ttab 1234567890 ", "héllo wörld e\u0301 ÅΩ 漢字 🙂", "don't We'LL <|im_end|>x"]


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
    # the files as saved give the run's exact tokenizer, and so does AutoTokenizer: for the quickstart's model (a
    # Llama architecture) it honours the saved tokenizer class, and for a Qwen2 model it builds Qwen2Tokenizer,
    # which is Qwen's own pipeline (a tokenizer with another pipeline on a Qwen2 model: the next test)
    assert warning is None
    loaders = [PreTrainedTokenizerFast.from_pretrained(out), AutoTokenizer.from_pretrained(out)]
    episode = tokenizer.apply_chat_template(SAMPLE_MESSAGES, tokenize=False)
    for loaded in loaders:
        assert loaded.chat_template == tokenizer.chat_template
        assert loaded.apply_chat_template(SAMPLE_MESSAGES, tokenize=False) == episode
        for sample in [text, episode, *SAMPLE_TEXTS]:
            assert loaded.encode(sample) == tokenizer.encode(sample), sample
            assert loaded.decode(loaded.encode(sample)) == tokenizer.decode(tokenizer.encode(sample))
        assert len(loaded) == len(tokenizer) and loaded.get_vocab() == tokenizer.get_vocab()
        assert loaded.special_tokens_map == tokenizer.special_tokens_map
        assert {i: (str(t), t.special) for i, t in loaded.added_tokens_decoder.items()} == {
            i: (str(t), t.special) for i, t in tokenizer.added_tokens_decoder.items()}


def test_export_names_a_tokenizer_that_autotokenizer_would_not_load_exactly(tmp_path):
    """A tokenizer whose pipeline is not Qwen2's (here: digits and byte-level only, no word split), next to a Qwen2
    model's config.json: AutoTokenizer builds Qwen2Tokenizer, which splits text differently; the check says so."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["What is the answer? What is it?"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    other = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                    unk_token=None)
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    other.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(other)).save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).encode("What is") != other.encode("What is")
    assert auto_tokenizer_mismatch(tmp_path) == (
        "AutoTokenizer.from_pretrained loads this model type's tokenizer class (Qwen2Tokenizer), which differs from "
        "the run's tokenizer in the ids of a probe text: load it with "
        f"transformers.PreTrainedTokenizerFast.from_pretrained({str(tmp_path)!r})")


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
