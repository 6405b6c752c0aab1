#!/usr/bin/env python
"""Export a trainer checkpoint as a Hugging Face model folder.

    python trainers/export.py runs/quickstart/checkpoints/checkpoint_100 exported/quickstart
    python trainers/export.py runs/quickstart exported/quickstart          # the run's newest complete checkpoint

A checkpoint holds accelerate's training state: the policy's weights under ``lm.`` (the `PolicyModel` wrapper),
optimizer and RNG states. The export is what `transformers` loads: ``config.json``, ``model.safetensors`` with the
model's own key names, the generation config and the tokenizer the run trained with (the quickstart's task BPE
included), so ``AutoModelForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)`` work, and
``trainers/evaluate.py --model OUT`` or an SGLang server can serve it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainers import checkpoints


def export(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the policy of `checkpoint` (a checkpoint or run directory) to `out` as a Hugging Face model folder."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    source = checkpoints.resolve(checkpoint)
    hf = source / checkpoints.HF_DIR
    if not (hf / "config.json").is_file():
        raise FileNotFoundError(f"{source} has no {checkpoints.HF_DIR}/config.json (written by an older trainer)")
    state = checkpoints.policy_state_dict(source)
    config = AutoConfig.from_pretrained(hf)
    model = AutoModelForCausalLM.from_config(config, dtype=next(iter(state.values())).dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"{source} does not match its config.json: missing {sorted(set(missing) - tied)[:5]}, "
                           f"unexpected {unexpected[:5]}")
    if (hf / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(hf)
    out = Path(out)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(hf).save_pretrained(out)
    return out


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest complete checkpoint)")
    ap.add_argument("out", help="the folder to write (config.json, model.safetensors, tokenizer files)")
    args = ap.parse_args(argv)
    out = export(args.checkpoint, args.out)
    print(f"exported {checkpoints.resolve(args.checkpoint)} -> {out} (AutoModelForCausalLM / AutoTokenizer "
          f".from_pretrained)")
    return out


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, RuntimeError) as e:
        sys.exit(f"export: {e}")
