"""The trainer's configuration: every value checked at load time (types, choices, ranges, moved keys, cross-field
rules) with a one-line error, the env.budget section, the generated reference, and the CLIs' exit on a bad value."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from mt_env.conversation import TokenBudget
from trainers import algos
from trainers.config import (CONFIG_DIR, DOC_MARKER, DOC_PATH, BudgetConfig, Config, ConfigError, KLEstimator,
                             LossAgg, load_config, markdown_reference)

from .conftest import SHARED_GSM8K

ROOT = Path(__file__).resolve().parents[1]


def all_fields(cls=Config, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from all_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, hints[f.name]


def test_bundled_recipes_load_and_validate():
    names = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))
    assert "quickstart.yaml" in names and any("gsm8k" in n for n in names)
    for name in names:
        load_config(name)


def test_a_random_init_model_keeps_its_real_vocabulary_and_never_samples_beyond_the_tokenizer():
    """A preset's random-init model has the real model's embedding rows (Qwen2.5: 151,936 for 151,665 ids: aligned
    LM-head matmuls); a model without its own size gets the tokenizer's; the padding rows are not actions."""
    from trainers.setup import make_models, make_tokenizer, random_init_vocab

    assert random_init_vocab(load_config("gsm8k_smoke_random_0.5b.yaml"), 151_665) == 151_936
    assert random_init_vocab(load_config("gsm8k_qwen2.5_7b_lora.yaml"), 151_665) == 152_064
    assert random_init_vocab(load_config("gsm8k_smoke_random_0.5b.yaml"), 200_000) == 200_000  # too small: grown
    quick = load_config("quickstart.yaml", ["device=cpu"])
    tokenizer = make_tokenizer(quick)
    assert random_init_vocab(quick, len(tokenizer)) == len(tokenizer)  # no size of its own: the tokenizer's
    padded = load_config("quickstart.yaml", ["device=cpu", f"model.config.vocab_size={len(tokenizer) + 37}"])
    lm, _ = make_models(padded, tokenizer, torch.device("cpu"), critic=False)
    assert lm.get_input_embeddings().num_embeddings == len(tokenizer) + 37
    with torch.no_grad():  # make the padding rows the likeliest tokens: the policy still scores only real ids
        lm.get_output_embeddings().weight[len(tokenizer):] = 5.0
    from trainers.modeling import PolicyModel

    policy = PolicyModel(lm, vocab_limit=len(tokenizer))
    ids = torch.randint(0, len(tokenizer), (1, 12))
    logprobs, _ = policy(ids, torch.ones_like(ids, dtype=torch.float32))
    assert torch.isfinite(logprobs).all() and (logprobs <= 0).all()
    full = torch.log_softmax(lm(ids).logits[0, :-1].float(), -1)[:, :len(tokenizer)]
    expected = (full - torch.logsumexp(full, -1, keepdim=True)).gather(-1, ids[0, 1:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs.reshape(-1)[-11:], expected, rtol=1e-5, atol=1e-5)


def test_config_errors_are_clear():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.lrr' \(did you mean trainer.lr\?\)"):
        load_config("quickstart.yaml", ["trainer.lrr=1e-6"])
    with pytest.raises(ConfigError, match="trainer.total_steps: expected int"):
        load_config("quickstart.yaml", ["trainer.total_steps=ten"])
    with pytest.raises(ConfigError, match="algorithm.name: 'ppg' is not one of grpo, ppo"):
        load_config("quickstart.yaml", ["algorithm.name=ppg"])
    with pytest.raises(ConfigError, match="grpo needs rollout.n >= 2"):
        load_config("quickstart.yaml", ["rollout.n=1"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("nope.yaml")
    cfg = load_config("quickstart.yaml", ["trainer.lr=3e-6", "rollout.n=4", "env.kwargs={digits: 2}"])
    assert (cfg.trainer.lr, cfg.rollout.n, cfg.env.kwargs) == (3e-6, 4, {"digits": 2})


@pytest.mark.parametrize("override, message", [
    ("rollout.temperature=-1", "rollout.temperature must be >= 0, got -1.0"),
    ("rollout.top_p=2", r"rollout.top_p must be in \(0, 1\], got 2.0"),
    ("rollout.top_p=0", r"rollout.top_p must be in \(0, 1\], got 0.0"),
    ("rollout.top_k=0", "rollout.top_k must be -1 or >= 1, got 0"),
    ("eval.seed=-5", "eval.seed must be >= 0, got -5"),
    ("eval.episodes=0", "eval.episodes must be >= 1, got 0"),
    ("trainer.keep_last=0", "trainer.keep_last must be >= 1, got 0"),
    ("trainer.lr=.nan", "trainer.lr: expected a finite number"),
    ("trainer.time_limit_s=0", r"trainer.time_limit_s must be > 0 \(or null\), got 0.0"),
    ("algorithm.gamma=1.5", r"algorithm.gamma must be in \[0, 1\], got 1.5"),
    ("algorithm.dual_clip=1", r"algorithm.dual_clip must be > 1 \(or null\), got 1.0"),
    ("sft.demo_skill=2", r"sft.demo_skill must be in \[0, 1\], got 2.0"),
    ("env.budget.max_prompt_tokens=0", r"env.budget.max_prompt_tokens must be >= 1 \(or null\), got 0"),
    ("threads=0", r"threads must be >= 1 \(or null\), got 0"),
    ("seed=-1", "seed must be >= 0, got -1"),
])
def test_values_out_of_range_fail_at_load(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("quickstart.yaml", [override])


def test_every_field_is_documented_and_every_number_has_a_range():
    for path, f, annotation in all_fields():
        assert f.metadata.get("doc"), f"{path} has no doc"
        base = {a for a in typing.get_args(annotation) if a is not type(None)} or {annotation}
        if base & {int, float}:
            assert f.metadata.get("range") is not None, f"{path} is a number without a range"


def test_every_choice_the_config_allows_is_implemented_by_the_algorithms():
    """config.py declares the choices (algos.py reads its tuples from the `Literal` types): each must compute."""
    loss, ref = torch.linspace(-1, 1, 10).reshape(2, 5), torch.zeros(2, 5)
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    for mode in typing.get_args(LossAgg):
        assert torch.isfinite(algos.aggregate(loss, mask, mode, constant=5))
    for estimator in typing.get_args(KLEstimator):
        assert torch.isfinite(algos.kl_estimate(loss, ref, estimator)).all()
    with pytest.raises(ValueError, match="unknown loss aggregation 'seq-mean'; choose from .*'token-mean'"):
        algos.aggregate(loss, mask, "seq-mean")
    with pytest.raises(ConfigError, match="algorithm.loss_agg: 'seq-mean' is not one of token-mean, "):
        load_config("quickstart.yaml", ["algorithm.loss_agg=seq-mean"])


# --------------------------------------------------------------------------------------------- env.budget
def test_budget_section_is_passed_straight_to_token_budget(tmp_path):
    assert [f.name for f in dataclasses.fields(BudgetConfig)] == [f.name for f in dataclasses.fields(TokenBudget)]
    from trainers.setup import env_factory, make_tokenizer

    cfg = load_config("quickstart.yaml", ["env.budget.max_prompt_tokens=300", "env.budget.max_total_tokens=400",
                                          "env.budget.observation_keep=middle", "env.budget.min_generation_tokens=4"])
    tokenizer = make_tokenizer(cfg)
    for eval_env in (False, True):
        env = env_factory(cfg, tokenizer, eval_env=eval_env)().unwrapped
        assert env.budget == TokenBudget(**dataclasses.asdict(cfg.env.budget))
        assert (env.budget.max_prompt_tokens, env.budget.observation_keep) == (300, "middle")
        env.close()


@pytest.mark.parametrize("key", ["max_prompt_tokens", "max_response_tokens", "max_total_tokens",
                                 "max_observation_tokens", "observation_keep"])
def test_moved_budget_keys_name_their_new_place(key, tmp_path):
    with pytest.raises(ConfigError, match=rf"rollout.{key} is now env.budget.{key}"):
        load_config("quickstart.yaml", [f"rollout.{key}=64"])
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"model: {{config: {{hidden_size: 32}}}}\nrollout:\n  {key}: 64\n")
    with pytest.raises(ConfigError, match=rf"rollout.{key} is now env.budget.{key}"):
        load_config(recipe)


def test_a_budget_in_env_kwargs_is_refused():
    for section in ("kwargs", "eval_kwargs"):
        with pytest.raises(ConfigError, match=rf"env.{section}.budget: the token budget is set in env.budget"):
            load_config("quickstart.yaml", [f"env.{section}={{budget: {{max_prompt_tokens: 8}}}}"])


# --------------------------------------------------------------------------------------------- env and tokenizer
def test_changing_env_id_of_the_quickstart_names_the_settings_to_change():
    assert load_config("quickstart.yaml").tokenizer.name == "task:Calculator-v0"  # task: env.id's own BPE
    with pytest.raises(ConfigError, match="tokenizer.name=task and sft.steps > 0 need the env's demonstrations, "
                                          "which GSM8kTool-v0 does not have"):
        load_config("quickstart.yaml", ["env.id=GSM8kTool-v0"])
    with pytest.raises(ConfigError, match="tokenizer.name=task:Calculator-v0 is fitted to another env than "
                                          "env.id=GSM8kTool-v0"):
        load_config("quickstart.yaml", ["env.id=GSM8kTool-v0", "tokenizer.name=task:Calculator-v0"])
    with pytest.raises(ConfigError, match=r"env.id: 'GSM8KTool-v0' is not a registered Gymnasium id \(did you "
                                          r"mean GSM8kTool-v0\?\)"):
        load_config("quickstart.yaml", ["env.id=GSM8KTool-v0"])


def test_the_quickstart_runs_another_env_with_the_settings_named():
    if not (SHARED_GSM8K / "train.jsonl").is_file():
        pytest.skip(f"GSM8K data not found at {SHARED_GSM8K} (../shared is absent)")
    from trainers.setup import env_factory, make_tokenizer

    cfg = load_config("quickstart.yaml", ["env.id=GSM8kTool-v0", f"env.kwargs.data_path={SHARED_GSM8K}",
                                          "tokenizer.name=offline:qwen2.5", "sft.steps=0",
                                          "env.budget.max_prompt_tokens=1024"])
    env = env_factory(cfg, make_tokenizer(cfg))().unwrapped
    obs, _ = env.reset(seed=0)
    assert 0 < len(obs["input_ids"]) <= cfg.env.budget.max_prompt_tokens
    env.close()


# --------------------------------------------------------------------------------------------- reference and CLIs
def test_the_docs_reference_is_generated_from_the_declarations():
    text = DOC_PATH.read_text(encoding="utf-8")
    assert text.split(DOC_MARKER, 1)[1].strip() == markdown_reference().strip(), \
        "docs/trainer_config.md is stale: run python -m trainers.config --write"
    reference = markdown_reference()
    assert "| `rollout.top_p` | `1.0` | in (0, 1] | nucleus sampling" in reference
    assert "| `algorithm.kl_mode` | `'loss'` | `loss`, `reward`, `none` |" in reference
    assert "## env.budget" in reference


@pytest.mark.parametrize("command, message", [
    (["trainers/ppo.py", "--set", "rollout.temperature=-1"], "error: rollout.temperature must be >= 0, got -1.0"),
    (["trainers/evaluate.py", "--config", "quickstart.yaml", "--episodes", "0"],
     "error: eval.episodes must be >= 1, got 0"),
    (["trainers/evaluate.py", "--config", "quickstart.yaml", "--samples", "4", "--temperature", "0"],
     "error: eval.samples > 1 (pass@k) needs sampling"),
])
def test_a_bad_value_is_one_line_and_exit_status_2(command, message):
    proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_evaluate_follows_the_recipes_eval_section(tmp_path):
    """quickstart.yaml evaluates sampled (eval.greedy: false): the samples of one task differ, so pass@k means
    something; eval.greedy: true with samples > 1 is refused instead of reporting pass@k of identical samples."""
    from trainers.evaluate import main as evaluate_main

    out = tmp_path / "episodes.jsonl"
    summary = evaluate_main(["--config", "quickstart.yaml", "--episodes", "4", "--samples", "3", "--out", str(out)])
    assert summary["episodes"] == 12 and "pass@3" in summary
    import json

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_task: dict = {}
    for r in rows:
        by_task.setdefault(r["id"][0], set()).add(json.dumps(r["messages"]))
    assert any(len(texts) > 1 for texts in by_task.values())  # sampled, not greedy
    with pytest.raises(ConfigError, match="eval.samples > 1"):
        evaluate_main(["--config", "quickstart.yaml", "--set", "eval.greedy=true", "--samples", "4"])
    with pytest.raises(ConfigError, match=f"--checkpoint: no checkpoint or run directory at {tmp_path / 'nope'}"):
        evaluate_main(["--config", "quickstart.yaml", "--checkpoint", str(tmp_path / "nope")])
