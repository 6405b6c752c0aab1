"""Show a sample's tokens coloured by segment: what is trained on (sampled, loss mask 1) and what is not.

The first thing to open when a run behaves oddly. Token boundaries are visible (alternating shades), control tokens
are shown as they are, and bytes of a character split across tokens are shown on the token that completes it.
"""

from __future__ import annotations

import codecs
import html
from functools import cache

from .sample import Sample, Seg

# ANSI: (background of even tokens, background of odd tokens, foreground)
_ANSI = {
    Seg.PROMPT: ("48;5;236", "48;5;238", "38;5;250"),
    Seg.GEN_PROMPT: ("48;5;24", "48;5;25", "38;5;231"),
    Seg.SAMPLED: ("48;5;22", "48;5;28", "38;5;231"),
    Seg.OBSERVATION: ("48;5;94", "48;5;130", "38;5;231"),
}
#: the CSS class of each segment kind, and its legend
CSS_CLASS = {Seg.PROMPT: "prompt", Seg.GEN_PROMPT: "gen", Seg.SAMPLED: "sampled", Seg.OBSERVATION: "obs"}
LEGEND = {
    Seg.PROMPT: "prompt", Seg.GEN_PROMPT: "generation prompt", Seg.SAMPLED: "sampled (trained)",
    Seg.OBSERVATION: "observation",
}


@cache
def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {v: k for k, v in bytes_to_unicode().items()}


def token_pieces(ids: list[int], tokenizer) -> list[str]:
    """The text each token adds, with multi-byte characters attributed to the token that completes them."""
    specials = {int(i) for i in tokenizer.added_tokens_decoder}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = backend is not None and "ByteLevel" in str(backend.decoder)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    table = _byte_decoder()
    out = []
    for i in ids:
        if i in specials or not byte_level:
            out.append(decoder.decode(b"", final=True) + tokenizer.decode([i], skip_special_tokens=False))
            continue
        token = tokenizer.convert_ids_to_tokens(i)
        raw = bytes(table[c] for c in token if c in table)
        out.append(decoder.decode(raw))
    return out


def _visible(text: str) -> str:
    return text.replace("\n", "\u21b5\n").replace("\t", "\u2192")


def render_ansi(sample: Sample, tokenizer, legend: bool = True) -> str:
    """The sample for a terminal: one background colour per segment kind, alternating shades per token."""
    pieces = token_pieces(sample.ids, tokenizer)
    out = []
    if legend:
        out.append(" ".join(f"\x1b[{_ANSI[k][0]};{_ANSI[k][2]}m {name} \x1b[0m" for k, name in LEGEND.items()) + "\n")
    for seg in sample.segments:
        on = sample.trainable and seg.kind == Seg.SAMPLED
        for j in range(seg.start, seg.end):
            bg0, bg1, fg = _ANSI[seg.kind]
            style = f"{bg0 if (j - seg.start) % 2 == 0 else bg1};{fg}" + (";1" if on else "")
            for k, line in enumerate(_visible(pieces[j]).split("\n")):
                if k:
                    out.append("\n")
                if line:
                    out.append(f"\x1b[{style}m{line}\x1b[0m")
    return "".join(out)


#: the token colours of `render_html`, shared by the trajectory viewer (`mt_env.view`)
HTML_CSS = """
.mtenv{font-family:ui-monospace,monospace;white-space:pre-wrap;line-height:1.6}
.mtenv span.t{border-radius:2px;padding:0 1px}
.mtenv .prompt{background:#e8e8e8;color:#555}.mtenv .prompt.o{background:#d8d8d8}
.mtenv .gen{background:#cfe3ff}.mtenv .gen.o{background:#b5d3ff}
.mtenv .sampled{background:#bff0c4;font-weight:600}.mtenv .sampled.o{background:#9fe3a6}
.mtenv .obs{background:#ffe3b3}.mtenv .obs.o{background:#ffd28a}
.mtenv .legend span{margin-right:1em;padding:0 4px}
"""


def render_html(sample: Sample, tokenizer, title: str | None = None) -> str:
    """A standalone HTML fragment; hover a token for its id, segment, turn and logprob."""
    pieces = token_pieces(sample.ids, tokenizer)
    parts = [f"<style>{HTML_CSS}</style>", '<div class="mtenv">']
    if title:
        parts.append(f"<h3>{html.escape(title)}</h3>")
    parts.append('<div class="legend">' + "".join(
        f'<span class="t {CSS_CLASS[k]}">{name}</span>' for k, name in LEGEND.items()) + "</div>")
    for seg in sample.segments:
        cls = CSS_CLASS[seg.kind]
        for j in range(seg.start, seg.end):
            odd = " o" if (j - seg.start) % 2 else ""
            tip = f"id {sample.ids[j]} | {seg.kind.name.lower()} | turn {seg.turn}"
            if seg.kind == Seg.SAMPLED:
                tip += f" | logprob {sample.logprobs[j]:.3f} | trained: {'yes' if sample.trainable else 'no (failed)'}"
            text = html.escape(_visible(pieces[j]))
            parts.append(f'<span class="t {cls}{odd}" title="{html.escape(tip)}">{text}</span>')
    parts.append("</div>")
    return "".join(parts)
