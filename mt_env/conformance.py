"""Chat-template conformance: does rendering a conversation turn by turn give the same text as rendering it whole?

That *prefix property* is what lets an episode be one training sample: the ids built incrementally (prompt, then
sampled turns verbatim, then template deltas) are then exactly the ids the template gives the finished
conversation. Templates that re-render history break it — Qwen3 drops earlier ``<think>`` blocks and gives only the
last assistant message a think block, Llama-3.1 trims message contents. `check_template` plays probe conversations
(tool rounds, parallel calls, follow-up questions, reasoning, whitespace at the edges, empty turns) through a
`Conversation` and reports the first place each one breaks; `Conversation(mode="auto")` uses the verdict to choose
between one sample per episode and one sample per turn.

It also notes (without failing) where a template piece merges with its neighbour when the whole text is tokenized
at once: the model never saw such merged tokens, so they are not drift, but it is good to know.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .chat_format import ChatFormat
from .errors import DriftError, MtEnvError

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


_CACHE: dict[tuple, TemplateReport] = {}


def check_template(fmt: ChatFormat, probes: dict[str, tuple[list[dict], list]] | None = None) -> TemplateReport:
    """Play the probe conversations through `fmt` incrementally and compare with full renderings."""
    from .conversation import Conversation

    probes = PROBES if probes is None else probes
    key = (
        id(fmt.tokenizer), fmt.tokenizer.chat_template, json.dumps(fmt.tools, sort_keys=True),
        json.dumps(fmt.template_kwargs, sort_keys=True, default=str), fmt.end_of_turn, tuple(probes),
    )
    if probes is PROBES and key in _CACHE:
        return _CACHE[key]
    results, notes = [], []
    for name, (prompt, steps) in probes.items():
        try:
            conv = Conversation(fmt, prompt, mode="incremental", strict=True)
            for step in steps:
                if isinstance(step, str):
                    conv.add_assistant(fmt.encode(step) + [fmt.end_of_turn_id])
                else:
                    conv.add_observation(step)
                    conv.check_drift()
            conv.check_drift()
            note = _merge_note(fmt, conv, name)
            if note:
                notes.append(note)
            results.append(ProbeResult(name, True))
        except DriftError as e:
            results.append(ProbeResult(name, False, str(e)))
        except MtEnvError as e:
            results.append(ProbeResult(name, False, f"{type(e).__name__}: {e}"))
    report = TemplateReport(conforms=all(r.ok for r in results), probes=results, notes=notes)
    if probes is PROBES:
        _CACHE[key] = report
    return report


def _merge_note(fmt: ChatFormat, conv, name: str) -> str | None:
    """Compare the incremental ids with one-shot tokenization of the same text (sampled parts tokenized canonically)."""
    ids = conv.current.ids
    whole = fmt.encode("".join(s.text for s in conv.current.segments))
    if whole == ids:
        return None
    k = next((i for i, (a, b) in enumerate(zip(ids, whole)) if a != b), min(len(ids), len(whole)))
    return (
        f"probe {name!r}: tokenizing the whole text merges tokens across a turn boundary near token {k} "
        f"({fmt.decode(ids[max(0, k - 2):k + 2])!r}); incremental ids keep what the model saw"
    )
