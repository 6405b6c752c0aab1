"""Where an exact-mode sampled logprob differs from the one the trainer's logits give (issue 28, a diagnosis).

`tests/test_exact.py::test_the_sampled_token_is_the_one_the_trainers_logits_give` failed on an H100 (2026-12-07):
same tokens, one logprob one ulp off. This script runs that test's generation under several settings and, with CUDA
graphs off, records the logits the engine's sampler saw, so that it tells apart "the logits differ" from "the same
logits give another logprob". Its first GPU run found the logits differing (at temperature 1.0 too) with the layers
compiled and none with them eager (`MT_ENV_EXACT_COMPILE_LAYERS=0`). The test then ran the backbone itself, without
``use_cache=False`` (an HF cache in the compiled layers' inputs: another graph); it now runs the trainer's
`PolicyModel.hidden_states`. `--path direct` is the old way, `trainer` the new:

    MT_ENV_TEST_DEVICE=cuda python3 benchmarks/exact_sampler_check.py [--path direct trainer]

Prints, per setting, how many sampled logprobs differ from the test's recomputation and, for those, whether the
engine's logits row equals the trainer's bit for bit and what the logprob of that row alone gives.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents import exact  # noqa: E402
from agents.backend import SamplingParams  # noqa: E402
from agents.engine import model_runner  # noqa: E402
from agents.engine.sampler import sample_tokens  # noqa: E402
from tests.test_exact import DEVICE, build, generate, prompts_of, resample, trainer_logits  # noqa: E402
from trainers.modeling import PolicyModel, _exact_kwargs  # noqa: E402  (the old way, --path direct)

SEEN: list[tuple[torch.Tensor, torch.Tensor]] = []


def recording(logits, temperature, *args, **kwargs):
    if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        SEEN.append((logits.detach().clone(), temperature.detach().clone()))
    return sample_tokens(logits, temperature, *args, **kwargs)


def logits_of(policy, prompt, turn, path: str) -> torch.Tensor:
    """The test's logits (`trainer`), or the old way's (`direct`: the backbone called without ``use_cache=False``)."""
    if path == "trainer":
        return trainer_logits(policy, prompt, turn)
    ids = torch.tensor([prompt + turn.ids], device=DEVICE)
    with torch.no_grad(), exact.ops():
        hidden = policy.lm.model(input_ids=ids, **_exact_kwargs(ids, None, None, None)).last_hidden_state[0]
        return policy.lm.lm_head(hidden[len(prompt) - 1:-1]).float()


def check(model, temperature: float, top_p_odd: float, graphs: bool, path: str) -> None:
    SEEN.clear()
    prompts = prompts_of(5, seed=4)
    params = [SamplingParams(temperature=temperature, top_p=top_p_odd if i % 2 else 1.0, max_new_tokens=12,
                             seed=10 + i) for i in range(len(prompts))]
    turns, _ = generate(model, prompts, params, exact=True, cuda_graphs=graphs)
    policy = PolicyModel(model, exact=True)
    bad = total = 0
    for prompt, turn, p in zip(prompts, turns, params):
        logits = logits_of(policy, prompt, turn, path)
        tokens, logprobs = resample(logits, turn, p)
        for i in range(len(turn.ids)):
            total += 1
            if logprobs[i].item() == turn.logprobs[i] and tokens[i].item() == turn.ids[i]:
                continue
            bad += 1
            row = logits[i]
            hits = [(b, r) for b, (seen, _) in enumerate(SEEN) for r in range(seen.shape[0])
                    if seen.shape[1] == row.shape[0] and torch.equal(seen[r], row)]
            alone = exact.tempered_log_softmax(row[None], torch.tensor([p.temperature], device=DEVICE))[0, turn.ids[i]]
            in_batch = None
            if hits:
                b, r = hits[0]
                seen, temps = SEEN[b]
                value = exact.tempered_log_softmax(seen, torch.where(temps == 0, 1.0, temps))[r, turn.ids[i]]
                in_batch = f"{value.item()!r} (batch of {seen.shape[0]}, row {r}, T {temps[r].item()!r})"
            print(f"  token {i}: engine {turn.logprobs[i]!r}, trainer {logprobs[i].item()!r}, row alone "
                  f"{alone.item()!r}; engine logits row found bit for bit: {bool(hits)}; in its batch: {in_batch}")
    print(f"path {path}, T={temperature} top_p(odd rows)={top_p_odd} cuda_graphs={graphs}: {bad} of {total} differ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", nargs="+", choices=("trainer", "direct"), default=["trainer"],
                    help="how the trainer's logits are computed: PolicyModel.hidden_states, or the backbone directly")
    args = ap.parse_args()
    model_runner.sample_tokens = recording
    model = build()
    for path in args.path:
        for temperature, top_p, graphs in ((0.8, 0.9, True), (0.8, 0.9, False), (1.0, 0.9, False)):
            check(model, temperature, top_p, graphs, path)


if __name__ == "__main__":
    main()
