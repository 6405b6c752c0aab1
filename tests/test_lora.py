"""LoRA through peft (`trainers.lora`): only the adapters train and are checkpointed, the KL reference is the base
with the adapters off, the embedded engine generates through them, SGLang backends and the export get the merged
weights, and a LoRA quickstart variant trains, resumes and exports on CPU."""

from __future__ import annotations

import asyncio
import copy
import json
import os

import pytest
import torch

from agents.backend import SamplingParams
from agents.hf_backend import HFBackend
from trainers.config import LoraConfig, load_config
from trainers.lora import AdaptersOff, add_lora, adapters_disabled, hf_weights, is_adapter, save_hf
from trainers.modeling import PolicyModel, build_causal_lm

from .test_checkpoints import newest
from .test_backend_sglang import servers  # noqa: F401  (the fake SGLang servers fixture)
from .test_trainer import metrics, run

DEVICE = torch.device(os.environ.get("MT_ENV_TEST_DEVICE", "cpu"))
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
IDS = torch.tensor([[5, 17, 42, 8, 99, 3, 61, 23]])


def adapted(seed: int = 0, **lora):
    """A tiny Qwen2 with LoRA adapters whose B is non-zero (peft starts B at 0: the adapters would do nothing), and
    the same model without them."""
    base = build_causal_lm(config=TINY, vocab_size=100, seed=seed).eval()
    lm = add_lora(copy.deepcopy(base), LoraConfig(rank=4, **lora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return lm, base


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_only_the_adapters_train_and_turning_them_off_gives_the_base():
    lm, base = adapted()
    trained = [n for n, p in lm.named_parameters() if p.requires_grad]
    assert trained and all(is_adapter(n) for n in trained)
    assert all(p.dtype == torch.float32 for n, p in lm.named_parameters() if is_adapter(n))
    assert not torch.allclose(logits(lm), logits(base), atol=1e-3)
    with adapters_disabled(lm):
        assert torch.equal(logits(lm), logits(base))
    assert not torch.allclose(logits(lm), logits(base), atol=1e-3)  # on again
    assert [n for n, p in lm.named_parameters() if p.requires_grad] == trained
    # the reference of a LoRA run: the prepared policy with its adapters off, sharing every weight
    policy, mask = PolicyModel(lm), torch.ones_like(IDS, dtype=torch.float)
    ref_lp, _ = AdaptersOff(policy)(IDS, mask)
    torch.testing.assert_close(ref_lp, PolicyModel(base)(IDS, mask)[0], rtol=0, atol=0)


def test_unknown_target_modules_are_refused():
    with pytest.raises(ValueError, match="has no module named \\['qkv'\\]"):
        add_lora(build_causal_lm(config=TINY, vocab_size=100), LoraConfig(rank=4, target_modules=["q_proj", "qkv"]))
    from trainers.config import ConfigError

    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        load_config("quickstart.yaml", ["model.lora.rank=4", "model.lora.target_modules=[]"])


def test_the_policy_state_dict_holds_the_adapters_and_loads_them_strictly():
    lm, _ = adapted()
    policy = PolicyModel(lm)
    state = policy.state_dict()
    assert state and all(is_adapter(k) for k in state)
    assert len(state) == sum(1 for n, _ in lm.named_parameters() if is_adapter(n))
    other = PolicyModel(adapted(seed=1)[0])
    other.load_state_dict(state)  # strict: the frozen base is not missing, the adapters are all there
    assert not torch.equal(logits(other.lm), logits(lm))  # a different base (seed 1) ...
    assert all(torch.equal(other.state_dict()[k], v) for k, v in state.items())  # ... with these adapters
    with pytest.raises(RuntimeError, match="Missing key.*lora_A"):
        other.load_state_dict({k: v for k, v in state.items() if "layers.0.self_attn.q_proj.lora_A" not in k})


@pytest.mark.parametrize("tie", [True, False])
def test_merged_weights_have_the_hf_names_and_the_adapted_logits(tmp_path, tie):
    from transformers import AutoModelForCausalLM

    lm, base = adapted() if tie else _untied()
    merged = dict(hf_weights(lm))
    assert set(merged) == {n for n, _ in base.named_parameters()}
    plain = copy.deepcopy(base)
    plain.load_state_dict(merged, strict=False)
    torch.testing.assert_close(logits(plain), logits(lm), atol=1e-5, rtol=1e-5)
    save_hf(lm, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(logits(loaded), logits(lm), atol=1e-5, rtol=1e-5)
    assert not any(is_adapter(k) or "base_layer" in k for k in loaded.state_dict())


def _untied():
    base = build_causal_lm(config=dict(TINY, tie_word_embeddings=False), vocab_size=100).eval()
    lm = add_lora(copy.deepcopy(base), LoraConfig(rank=4, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return lm, base


def test_sglang_servers_get_the_merged_weights_through_their_sync_path(tmp_path, servers):
    """`sync_weights` to SGLang servers (which cannot take tensors): the folder they are told to load is the
    adapted model, merged, under the plain class's names."""
    from transformers import AutoModelForCausalLM

    from agents.sglang_backend import SGLangServerBackend
    from trainers.setup import sync_weights

    lm, _ = adapted()
    server = servers()

    async def main():
        async with SGLangServerBackend([server.url], check_health=False) as backend:
            return await sync_weights(backend, lm, str(tmp_path))

    assert asyncio.run(main()) == "update_weights_from_disk"
    path = next(body["model_path"] for call, body in server.calls if call == "/update_weights_from_disk")
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(path).eval()), logits(lm),
                               atol=1e-5, rtol=1e-5)


def test_the_embedded_engine_generates_through_the_adapters():
    """The fast path runs the module's own q_proj & co.: peft's LoRA layers run inside it, so the engine's logprobs
    are the adapted model's (and not the base's). On CPU its steps run eagerly; with MT_ENV_TEST_DEVICE=cuda, as
    the trainer runs them (compiled, in CUDA graphs)."""
    lm, base = adapted()
    lm, base = lm.to(DEVICE), base.to(DEVICE)
    settings = {} if DEVICE.type == "cuda" else dict(cuda_graphs=False, compile=False)

    async def generate(model):
        async with HFBackend(model, fast_path=True, **settings) as engine:
            assert engine.fast_path_reason.startswith("on:"), engine.fast_path_reason  # the fast path took it
            return await engine.generate(IDS[0].tolist(), SamplingParams(temperature=0, max_new_tokens=6))

    gen = asyncio.run(generate(lm))
    ids = torch.tensor([IDS[0].tolist() + gen.ids], device=DEVICE)
    mask = torch.zeros_like(ids, dtype=torch.float)
    mask[0, IDS.shape[1]:] = 1
    lp, _ = PolicyModel(lm)(ids, mask)
    base_lp, _ = PolicyModel(base)(ids, mask)
    assert gen.logprobs == pytest.approx(lp[0, IDS.shape[1]:].tolist(), abs=1e-4)
    assert gen.logprobs != pytest.approx(base_lp[0, IDS.shape[1]:].tolist(), abs=1e-3)


LORA_RUN = ["model.lora.rank=4", "model.lora.target_modules=[q_proj, v_proj, down_proj]", "algorithm.kl_mode=loss",
            "algorithm.kl_coef=0.05", "trainer.lr=1e-2", "trainer.save_every=1"]


def test_lora_quickstart_trains_resumes_and_exports(tmp_path):
    """The quickstart's recipe with LoRA, a few steps: checkpoints hold the adapters (and the optimizer state of
    them) only, the KL to the base is measured, a resumed run continues from them, and the export is the adapted
    model merged, with the logits of the policy as resumed from the checkpoint."""
    from safetensors.torch import load_file, load_model
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from trainers import checkpoints
    from trainers.export import export
    from trainers.setup import make_models

    run(tmp_path, *LORA_RUN, steps=2)
    checkpoint = newest(tmp_path)
    saved = load_file(checkpoint / "model.safetensors")
    assert saved and all(is_adapter(k) for k in saved)
    optimizer_state = torch.load(checkpoint / "optimizer.bin", weights_only=False)["state"]
    assert len(optimizer_state) == len(saved)  # AdamW moments for the adapters alone
    rows = [r for r in metrics(tmp_path) if "actor/kl_ref" in r]
    assert rows and rows[-1]["actor/kl_ref"] > 0  # the adapters moved the policy away from the base
    assert run(tmp_path, *LORA_RUN, steps=3)["steps"] == 3  # resumed from checkpoint_2's adapters
    assert newest(tmp_path).name == "checkpoint_3"
    checkpoint = newest(tmp_path)

    out, _ = export(checkpoint, tmp_path / "exported")
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    cfg = load_config(tmp_path / "config.json", training=False)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out)
    lm, _ = make_models(cfg, tokenizer, torch.device("cpu"), critic=False)
    policy = PolicyModel(lm)
    load_model(policy, checkpoint / "model.safetensors")  # as accelerate's resume loads it: strictly
    ids = torch.tensor([tokenizer.encode("What is 12 * 34? Use the calculator.")])
    torch.testing.assert_close(logits(exported, ids), logits(lm.eval(), ids), atol=1e-5, rtol=1e-5)
    # evaluate.py --checkpoint: the recipe's model, the checkpoint's adapters (`load_policy_weights`)
    again, _ = make_models(cfg, tokenizer, torch.device("cpu"), critic=False)
    checkpoints.load_policy_weights(again, checkpoint, "the recipe's model")
    assert torch.equal(logits(again.eval(), ids), logits(lm, ids))
    plain, _ = make_models(load_config(tmp_path / "config.json", ["model.lora.rank=0"], training=False), tokenizer,
                           torch.device("cpu"), critic=False)
    with pytest.raises(RuntimeError, match="does not match"):  # adapters onto a model without them: refused
        checkpoints.load_policy_weights(plain, checkpoint, "a model without LoRA")
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
