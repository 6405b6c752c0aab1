"""The pipe codec's cost per sample (`mt_env.wire`): encode, decode, decode and read, and a batch's decode + collate.

A 615-token sample of three turns, as an env process sends it at an episode's end; the best of 7 repeats.

    python benchmarks/bench_codec.py
"""

from __future__ import annotations

import random
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not an installed copy

from mt_env import wire  # noqa: E402
from mt_env.batch import collate  # noqa: E402
from mt_env.sample import Sample, Seg, Segment  # noqa: E402


def three_turns(tokens: int = 615, prompt: int = 300) -> Sample:
    rng = random.Random(0)
    bounds = [prompt, prompt + 3, 400, 420, 423, 500, 520, 523, tokens]
    kinds = [Seg.PROMPT] + [Seg.GEN_PROMPT, Seg.SAMPLED, Seg.OBSERVATION] * 3
    segments = [Segment(kind, (i - 1) // 3 if i else -1, start, end, kind.name)
                for i, (kind, start, end) in enumerate(zip(kinds, [0, *bounds], bounds))]
    return Sample(ids=[rng.randrange(1000, 150_000) for _ in range(tokens)], logprobs=[-rng.random()] * tokens,
                  segments=segments, rewards=[0.0] * tokens, prompt_len=prompt + 3, n_messages=3)


def best_us(f, number: int = 2000) -> float:
    return min(timeit.repeat(f, number=number, repeat=7)) / number * 1e6


def main() -> None:
    sample = three_turns()
    data = wire.dumps(sample)
    read = best_us(lambda: (lambda s: (s.ids, s.logprobs, s.rewards))(wire.loads(data)))
    print(f"{len(sample)}-token sample, {len(data)} bytes: encode {best_us(lambda: wire.dumps(sample)):.1f} us, "
          f"decode {best_us(lambda: wire.loads(data)):.1f} us, decode and read its lists {read:.1f} us")
    batch_ms = best_us(lambda: collate([wire.loads(data) for _ in range(256)], pad_token_id=0), number=3) / 1e3
    print(f"256 such samples decoded then collated: {batch_ms:.1f} ms")


if __name__ == "__main__":
    main()
