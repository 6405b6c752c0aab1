"""Hypothesis strategies for random tool conversations, and a driver that plays one through a `Conversation`."""

from __future__ import annotations

import json
from dataclasses import dataclass

from hypothesis import strategies as st

from mt_env.conversation import Conversation, TokenBudget

CONTROL_TEXTS = ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<think>",
                 "</think>", "<tool_response>", "<|eot_id|>", "<|start_header_id|>", "<|begin_of_text|>"]
EDGE_WHITESPACE = ["", "", "", "\n", "\n\n", " ", " \n", "\r\n", "\t", "\n \n"]

# Any unicode except surrogates; control characters, combining marks (NFC trap) and emoji included.
_chars = st.characters(codec="utf-8", exclude_categories=("Cs",))
_core = st.one_of(
    st.text(_chars, max_size=30),
    st.text(st.sampled_from("abc xyz 0123456789.,!?é\u0301日本\n"), max_size=40),
)
_edges = st.sampled_from(EDGE_WHITESPACE)
plain_text = st.builds(lambda a, b, c: a + b + c, _edges, _core, _edges)


def _no_control(text: str) -> str:
    for c in CONTROL_TEXTS:
        text = text.replace(c, "")
    return text


# Untrusted text (tool output, user follow-ups) may contain control-token text.
untrusted_text = st.one_of(
    plain_text,
    st.builds(lambda a, c, b: a + c + b, plain_text, st.sampled_from(CONTROL_TEXTS), plain_text),
)


@st.composite
def assistant_turn(draw):
    """(text the model writes, char positions where its sampling split the text, closed by end-of-turn?)"""
    body = _no_control(draw(plain_text))
    calls = draw(st.lists(st.fixed_dictionaries({"query": _core.map(_no_control)}), max_size=3))
    text = body + "".join(
        "\n<tool_call>\n" + json.dumps({"name": "lookup", "arguments": a}, ensure_ascii=False) + "\n</tool_call>"
        for a in calls
    )
    splits = sorted(set(draw(st.lists(st.integers(0, max(0, len(text))), max_size=6))))
    return text, splits, draw(st.booleans())


@st.composite
def observation(draw):
    if draw(st.integers(0, 4)) == 0:
        return [{"role": "user", "content": draw(untrusted_text)}]
    n = draw(st.integers(1, 3))
    return [{"role": "tool", "content": draw(untrusted_text)} for _ in range(n)]


@dataclass
class Plan:
    prompt: list[dict]
    turns: list[tuple[str, list[int], bool]]
    observations: list[list[dict]]


@st.composite
def conversation_plan(draw, max_turns: int = 4):
    prompt = []
    if draw(st.booleans()):
        prompt.append({"role": "system", "content": _no_control(draw(plain_text))})
    prompt.append({"role": "user", "content": draw(untrusted_text)})
    n = draw(st.integers(1, max_turns))
    turns = [draw(assistant_turn()) for _ in range(n)]
    observations = [draw(observation()) for _ in range(n - 1)]
    return Plan(prompt, turns, observations)


def sampled_ids(fmt, text: str, splits: list[int], closed: bool) -> list[int]:
    """Ids a model could have sampled for `text`: encoded in chunks (a non-canonical split), plus end-of-turn."""
    ids, last = [], 0
    for s in [*splits, len(text)]:
        if s > last:
            ids += fmt.encode(text[last:s])
            last = s
    return ids + ([fmt.end_of_turn_id] if closed else [])


def play(fmt, plan: Plan, mode: str = "auto", strict: bool = True, budget: TokenBudget | None = None,
         canonical: bool = False) -> Conversation:
    """Build the conversation of `plan`; stops early if the budget truncates it. Logprobs are -index/1000."""
    conv = Conversation(fmt, plan.prompt, mode=mode, strict=strict, budget=budget)
    for k, (text, splits, closed) in enumerate(plan.turns):
        if conv.awaiting != "assistant":
            break
        ids = sampled_ids(fmt, text, [] if canonical else splits, closed or k < len(plan.turns) - 1)
        conv.add_assistant(ids, logprobs=[-(j + 1) / 1000 for j in range(len(ids))])
        conv.add_reward(0.1 * (k + 1))
        if k < len(plan.observations) and conv.awaiting == "observation":
            conv.add_observation(plan.observations[k])
    conv.final_reward = 1.0
    return conv
