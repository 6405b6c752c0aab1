"""Chat-template conformance: does rendering a conversation turn by turn give the same text as rendering it whole?

That *prefix property* is what lets an episode be one training sample: the ids built incrementally (prompt, then
sampled turns verbatim, then template deltas) are then exactly the ids the template gives the finished
conversation. Templates that re-render history break it — Qwen3 drops earlier ``<think>`` blocks and gives only the
last assistant message a think block, Llama-3.1 trims message contents. `check_template` plays probe conversations
(tool rounds, parallel calls, follow-up questions, reasoning, whitespace at the edges, empty turns) turn by turn with
the same `ChatFormat` pieces an incremental `Conversation` appends — the prompt, the sampled turns verbatim, the
template deltas — and reports the first place each one differs from the template's rendering of the whole
conversation so far. `Conversation(mode="auto")` asks for the verdict to choose between one sample per episode and
one sample per turn (so this module sits below `conversation`: it needs only the format).

It also notes (without failing) where a template piece merges with its neighbour when the whole text is tokenized
at once: the model never saw such merged tokens, so they are not drift, but it is good to know.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field

from .chat_format import ChatFormat
from .errors import MtEnvError

_CALL = '<tool_call>\n{"name": "lookup", "arguments": {"query": "x"}}\n</tool_call>'

#: name -> (prompt messages, then a list of assistant texts and observation message lists, alternating)
PROBES: dict[str, tuple[list[dict], list]] = {
    "plain answer": ([{"role": "user", "content": "What is 2+2?"}], ["It is 4."]),
    "tool round": (
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Find x."}],
        [f"Let me look.\n{_CALL}", [{"role": "tool", "content": "x = 42"}], "x is 42."],
    ),
    "parallel calls, several rounds": (
        [{"role": "user", "content": "Find x and y."}],
        [f"{_CALL}\n{_CALL}", [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}],
         _CALL, [{"role": "tool", "content": "3"}], "Done: 1, 2, 3."],
    ),
    "follow-up question": (
        [{"role": "user", "content": "Name a prime."}],
        ["7", [{"role": "user", "content": "Another one?"}], "11"],
    ),
    "reasoning": (
        [{"role": "user", "content": "Think, then answer."}],
        ["<think>\nI should look it up.\n</think>\n\n" + _CALL, [{"role": "tool", "content": "42"}],
         "<think>\nGot it.\n</think>\n\nIt is 42.", [{"role": "user", "content": "Sure?"}],
         "<think>\nYes.\n</think>\n\nYes."],
    ),
    "whitespace at the edges": (
        [{"role": "user", "content": "Hi"}],
        [" spaced out \n", [{"role": "tool", "content": "\nok\n"}], "\nleading newline"],
    ),
    "empty turns": (
        [{"role": "user", "content": "Say nothing."}],
        ["", [{"role": "tool", "content": ""}], "ok"],
    ),
}


@dataclass
class ProbeResult:
    name: str
    ok: bool
    message: str = ""  #: the drift diff where it broke


@dataclass
class TemplateReport:
    """Verdict of `check_template`. `conforms` is True when every probe kept the prefix property."""

    conforms: bool
    probes: list[ProbeResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def breaks(self) -> list[ProbeResult]:
        return [p for p in self.probes if not p.ok]

    def __str__(self) -> str:
        lines = [f"prefix property: {'holds' if self.conforms else 'BROKEN'} on {len(self.probes)} probes"]
        for p in self.probes:
            lines.append(f"  [{'ok' if p.ok else 'BREAKS'}] {p.name}")
            if not p.ok:
                lines += ["      " + line for line in p.message.splitlines()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


_CACHE: dict[tuple, TemplateReport] = {}  # by what determines the verdict: tokenizer, template, tools, variables
_BY_FORMAT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # the same, one lookup per ChatFormat object


def check_template(fmt: ChatFormat, probes: dict[str, tuple[list[dict], list]] | None = None) -> TemplateReport:
    """Play the probe conversations through `fmt` turn by turn and compare with full renderings (cached per format
    for the bundled probes)."""
    if probes is None and fmt in _BY_FORMAT:
        return _BY_FORMAT[fmt]
    probes = PROBES if probes is None else probes
    key = (
        id(fmt.tokenizer), fmt.tokenizer.chat_template, json.dumps(fmt.tools, sort_keys=True),
        json.dumps(fmt.template_kwargs, sort_keys=True, default=str), fmt.end_of_turn, tuple(probes),
    )
    if probes is PROBES and key in _CACHE:
        _BY_FORMAT[fmt] = _CACHE[key]
        return _CACHE[key]
    results, notes = [], []
    for name, (prompt, steps) in probes.items():
        try:
            problem, note = _play(fmt, prompt, steps)
        except MtEnvError as e:
            problem, note = f"{type(e).__name__}: {e}", None
        results.append(ProbeResult(name, problem is None, problem or ""))
        if note:
            notes.append(f"probe {name!r}: {note}")
    report = TemplateReport(conforms=all(r.ok for r in results), probes=results, notes=notes)
    if probes is PROBES:
        _CACHE[key] = _BY_FORMAT[fmt] = report
    return report


def _play(fmt: ChatFormat, prompt: list[dict], steps: list) -> tuple[str | None, str | None]:
    """Build one probe's text and ids as an incremental conversation does: the rendered prompt, each assistant text
    encoded and closed with the end-of-turn token (kept verbatim, decoded for its message), each observation as the
    template delta. After every observation the text so far must equal the template's rendering of all messages so
    far. Returns (the difference where it broke, or None; a note on tokens merging across turn boundaries)."""
    messages = [fmt.clean_message(m, observation=False) for m in prompt]
    text, gen = fmt.prompt_text(messages)
    built, ids = text + gen, fmt.encode(text + gen)
    for step in steps:
        if isinstance(step, str):  # an assistant turn, sampled as the tokenizer splits it
            sampled = fmt.encode(step) + [fmt.end_of_turn_id]
            said = fmt.decode(sampled[:-1])
            messages.append({"role": "assistant", "content": said})
            built, ids = built + said + fmt.end_of_turn, ids + sampled
            continue
        observation = [fmt.clean_message(m, observation=True) for m in step]
        text, gen = fmt.observation_text(observation)
        messages += observation
        built, ids = built + text + gen, ids + fmt.encode(text + gen)
        whole = fmt.render(messages, add_generation_prompt=True)
        if built != whole:
            return _difference(built, whole), None
    return None, _merge_note(fmt, ids, fmt.encode(built))


def _difference(built: str, whole: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(built, whole)) if a != b), min(len(built), len(whole)))
    return (
        f"the turn-by-turn text differs from the whole rendering at character {at}\n"
        f"  turn by turn : ...{built[max(0, at - 60):at + 60]!r}\n"
        f"  whole        : ...{whole[max(0, at - 60):at + 60]!r}"
    )


def _merge_note(fmt: ChatFormat, ids: list[int], whole: list[int]) -> str | None:
    """Compare the incremental ids with one-shot tokenization of the same text (sampled parts tokenized canonically)."""
    if whole == ids:
        return None
    k = next((i for i, (a, b) in enumerate(zip(ids, whole)) if a != b), min(len(ids), len(whole)))
    return (
        f"tokenizing the whole text merges tokens across a turn boundary near token {k} "
        f"({fmt.decode(ids[max(0, k - 2):k + 2])!r}); incremental ids keep what the model saw"
    )
