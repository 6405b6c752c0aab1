#!/usr/bin/env python
"""Export a trainer checkpoint as a Hugging Face model folder.

    python trainers/export.py runs/quickstart/checkpoints/checkpoint_100 exported/quickstart
    python trainers/export.py runs/quickstart exported/quickstart          # the run's newest complete checkpoint

A checkpoint holds accelerate's training state: the policy's weights under ``lm.`` (the `PolicyModel` wrapper),
optimizer and RNG states, and in ``hf/`` the model's config and the run's tokenizer. The export is what
`transformers` loads: ``config.json``, ``model.safetensors`` with the model's own key names, the generation config
and the tokenizer files as the run saved them, so ``AutoModelForCausalLM.from_pretrained(OUT)`` gives the trainer's
logits and ``PreTrainedTokenizerFast.from_pretrained(OUT)`` its exact tokenizer. A LoRA run's checkpoint holds
the adapters alone: the export rebuilds the base as the run did and writes the weights with the adapters merged.

`AutoTokenizer` honours the saved tokenizer class, except for model types that transformers maps to their own
tokenizer class regardless — Qwen2 among them: for a Qwen2 model it builds `Qwen2Tokenizer`, Qwen's pre-tokenizer
around the saved vocabulary and merges. Qwen's tokenizers (``offline:qwen2.5``, hub models) come back exactly; a
tokenizer with another pipeline on a Qwen2 model does not, and `auto_tokenizer_mismatch`, which the export runs,
says so and names the loader that is exact. (The quickstart's model is a Llama architecture for this reason: its
task BPE, whose merges cross spaces, loads exactly through `AutoTokenizer`.)
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mt_env.errors import debug_flag
from trainers import checkpoints
from trainers.config import ConfigError
from trainers.lora import is_adapter, save_hf
from trainers.stopping import entry_point


def export(checkpoint: str | Path, out: str | Path) -> tuple[Path, str | None]:
    """Write the policy of `checkpoint` (a checkpoint or run directory) to `out` as a Hugging Face model folder.
    Returns the folder and a warning when `AutoTokenizer` would not load the run's tokenizer exactly (else None)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    source = checkpoints.resolve(checkpoint)
    hf = source / checkpoints.HF_DIR
    if not (hf / "config.json").is_file():
        raise FileNotFoundError(f"{source} has no {checkpoints.HF_DIR}/config.json (written by an older trainer)")
    state = checkpoints.policy_state_dict(source)
    if any(is_adapter(k) for k in state):
        model = _merged_lora_model(source, state)
    else:
        config = AutoConfig.from_pretrained(hf)
        model = AutoModelForCausalLM.from_config(config, dtype=next(iter(state.values())).dtype)
        checkpoints.load_policy_weights(model, source, "its config.json", state)
    if (hf / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(hf)
    out = Path(out)
    save_hf(model, out)
    for f in hf.iterdir():  # the tokenizer files exactly as the run saved them
        if f.name not in ("config.json", "generation_config.json"):
            shutil.copy2(f, out / f.name)
    return out, auto_tokenizer_mismatch(out)


def _merged_lora_model(checkpoint: Path, adapters: dict):
    """The policy of a LoRA run's checkpoint, which holds the adapters only: the base model built as the run built
    it (its config.json beside ``checkpoints/``: ``model.path``, or the seeded random init), the adapters loaded into
    it (`checkpoints.load_policy_weights`: every one of them must be in the checkpoint)."""
    import torch
    from transformers import PreTrainedTokenizerFast

    from trainers.config import load_config
    from trainers.setup import make_models

    run_config = checkpoint.parent.parent / "config.json"
    if not run_config.is_file():
        raise FileNotFoundError(f"{checkpoint} holds LoRA adapters only; their base model is described by the run's "
                                f"config.json, which is not at {run_config}")
    cfg = load_config(run_config, ["device=cpu"], training=False)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(checkpoint / checkpoints.HF_DIR)
    model, _ = make_models(cfg, tokenizer, torch.device("cpu"), critic=False)
    checkpoints.load_policy_weights(model, checkpoint, "the run's model (its config.json)", adapters)
    return model


def auto_tokenizer_mismatch(folder: str | Path) -> str | None:
    """How `AutoTokenizer.from_pretrained(folder)` differs from the tokenizer files as saved (loaded as they are by
    `PreTrainedTokenizerFast`): ids of a probe text, size, special tokens or chat template; None when it does not."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    exact, auto = PreTrainedTokenizerFast.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    probe = exact.apply_chat_template([{"role": "user", "content": "What is 865 * 673?  Don't guess.\n"}],
                                      tokenize=False, add_generation_prompt=True) + " héllo wörld\n\n  1234 "
    differences = [what for what, same in (
        ("the ids of a probe text", auto.encode(probe) == exact.encode(probe)), ("the size", len(auto) == len(exact)),
        ("the special tokens", auto.special_tokens_map == exact.special_tokens_map),
        ("the chat template", auto.chat_template == exact.chat_template)) if not same]
    if not differences:
        return None
    return (f"AutoTokenizer.from_pretrained loads this model type's tokenizer class ({type(auto).__name__}), which "
            f"differs from the run's tokenizer in {', '.join(differences)}: load it with "
            f"transformers.PreTrainedTokenizerFast.from_pretrained({str(folder)!r})")


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest complete checkpoint)")
    ap.add_argument("out", help="the folder to write (config.json, model.safetensors, tokenizer files)")
    debug_flag(ap)
    args = ap.parse_args(argv)
    try:
        out, warning = export(args.checkpoint, args.out)
    except (FileNotFoundError, RuntimeError) as e:  # no checkpoint there, or not one its config describes
        raise ConfigError(str(e)) from e
    print(f"exported {checkpoints.resolve(args.checkpoint)} -> {out}: transformers.AutoModelForCausalLM"
          f".from_pretrained({str(out)!r}) loads it")
    if warning:
        print(f"note: {warning}")
    return out


if __name__ == "__main__":
    sys.exit(entry_point(main))
