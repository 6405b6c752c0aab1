#!/usr/bin/env python
"""Draw the tokens of a real two-turn Calculator-v0 episode by segment, for docs/masks.md.

    python docs/make_mask_example.py

Plays one episode of ``Calculator-v0`` on the offline Qwen2.5 tokenizer through the env's token interface — turn 0
calls the calculator, the tool answers, turn 1 gives the answer — and writes

* ``docs/img/mask_example.png``: every token a box coloured by segment (prompt / generation prompt / sampled /
  observation), the token carrying the final reward outlined. The prompt is shown from the user turn on: the
  system message with the tool schemas before it is left out (the figure says how many tokens that is);
* ``docs/img/mask_example.html``: the whole sample from `Conversation.render_html()` (hover a token for its id,
  segment, turn and logprob);

and prints a plain-text view: each segment with its turn and token count, then the text with the trained spans
in ``[[...]]``. The assistant turns are scripted token ids (an engine would return the same kind of ids), so their
logprobs are 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import gymnasium as gym
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch, Patch

import mt_env  # noqa: F401  (registers Calculator-v0)
from envs.calculator import CalculatorEnv
from mt_env.parsers import HermesParser, ToolCall
from mt_env.render import token_pieces
from mt_env.sample import Sample, Seg
from mt_env.tokenizer import offline_tokenizer
from mt_env.turn import ModelTurn

OUT = ROOT / "docs" / "img"
OPERANDS = [347, 829]

# (even token, odd token) fills per segment — the colours of `Conversation.render_html()`
COLOURS = {
    Seg.PROMPT: ("#e8e8e8", "#d8d8d8"),
    Seg.GEN_PROMPT: ("#cfe3ff", "#b5d3ff"),
    Seg.SAMPLED: ("#bff0c4", "#9fe3a6"),
    Seg.OBSERVATION: ("#ffe3b3", "#ffd28a"),
}
LABELS = {
    Seg.PROMPT: "prompt (mask 0)",
    Seg.GEN_PROMPT: "generation prompt (mask 0)",
    Seg.SAMPLED: "sampled by the model (loss mask 1)",
    Seg.OBSERVATION: "observation: tool response + template delta (mask 0)",
}


def play_episode():
    """One Calculator-v0 episode with scripted token-id turns; returns the env (its conversation holds the ids)."""
    env = gym.make("Calculator-v0", tokenizer=offline_tokenizer("qwen2.5")).unwrapped
    env.reset(seed=0, options={"task": CalculatorEnv.task_for(OPERANDS)})
    fmt = env.conversation.fmt
    call = HermesParser.format_turn([ToolCall("calculator", {"expression": env.task["expression"]})],
                                    "Let me compute it.")
    # Engines return the sampled ids with the stop token (<|im_end|>) last; the env keeps them verbatim.
    env.step(ModelTurn(ids=fmt.encode(call) + [fmt.end_of_turn_id]))
    _, reward, terminated, _, info = env.step(
        ModelTurn(ids=fmt.encode(f"{env.task['expression']} = {env.task['answer']}.") + [fmt.end_of_turn_id]))
    assert terminated and reward == 1.0 and info["end_reason"] == "answered"
    return env


def shown_start(sample: Sample, tokenizer) -> int:
    """Index of the user turn's ``<|im_start|>``: the figure starts there."""
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    starts = [i for i in range(sample.prompt_len) if sample.ids[i] == im_start]
    return starts[-2]  # the last one opens the generation prompt, the one before it the user turn


def text_view(sample: Sample, tokenizer) -> str:
    """Segments with turns and sizes, then the text with trained spans in [[...]]."""
    lines = [f"{'segment':<12} {'turn':>4} {'tokens':>6}  text"]
    for s in sample.segments:
        text = s.text if s.kind != Seg.PROMPT or len(s.text) < 60 else "..." + s.text[-45:]
        lines.append(f"{s.kind.name:<12} {s.turn:>4} {len(s):>6}  {text!r}")
    lines.append("")
    start = shown_start(sample, tokenizer)
    pieces = token_pieces(sample.ids, tokenizer)
    mask = sample.loss_mask()
    out, inside = ["..."], False
    for i in range(start, len(sample.ids)):
        if mask[i] and not inside:
            out.append("[[")
        elif not mask[i] and inside:
            out.append("]]")
        inside = bool(mask[i])
        out.append(pieces[i])
    out.append("]]" if inside else "")
    lines.append("".join(out))
    return "\n".join(lines)


def draw(sample: Sample, tokenizer, path: Path, width_in: float = 8.2, font_pt: float = 10.5) -> None:
    start = shown_start(sample, tokenizer)
    pieces = token_pieces(sample.ids, tokenizer)
    kinds, mask = sample.kinds(), sample.loss_mask()
    reward_at = {i for i, r in enumerate(sample.rewards or []) if r}
    char_w = 0.602 * font_pt / 72  # DejaVu Sans Mono advance, inches
    pad, gap, line_h = 0.035, 0.018, 0.30
    left, right = 0.15, width_in - 0.15

    # lay the tokens out in lines: wrap at the right margin, break after a token that ends with a newline
    boxes, x, y = [], left, 0.0
    for i in range(start, len(sample.ids)):
        label = pieces[i].replace("\n", "\u21b5")
        w = max(len(label), 1) * char_w + 2 * pad
        if x + w > right and x > left:
            x, y = left, y + line_h
        boxes.append((i, label, x, y, w))
        x += w + gap
        if pieces[i].endswith("\n"):
            x, y = left, y + line_h
    text_h = y + line_h
    head_h, legend_h = 0.55, 0.75
    height = head_h + text_h + legend_h
    fig = plt.figure(figsize=(width_in, height), dpi=150)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width_in)
    ax.set_ylim(height, 0)
    ax.axis("off")

    ax.text(left, 0.22, f"Calculator-v0, offline Qwen2.5 tokenizer: one sample, {len(sample.ids)} tokens, "
            f"{sum(mask)} trained", fontsize=font_pt + 1, fontweight="bold", va="center")
    ax.text(left, 0.44, f"Shown from the user turn on; the {start} tokens before it (system message with the "
            "tool schema) are prompt too.", fontsize=font_pt - 1, color="#444", va="center")
    for i, label, bx, by, w in boxes:
        kind = Seg(kinds[i])
        seg_index = next(k for k, s in enumerate(sample.segments) if s.start <= i < s.end)
        shade = COLOURS[kind][(i - sample.segments[seg_index].start) % 2]
        edge = "#c0392b" if i in reward_at else "#00000022"
        ax.add_patch(FancyBboxPatch((bx, head_h + by + 0.03), w, line_h - 0.06,
                                    boxstyle="round,pad=0,rounding_size=0.03", facecolor=shade, edgecolor=edge,
                                    linewidth=1.8 if i in reward_at else 0.5))
        ax.text(bx + pad, head_h + by + line_h / 2, label, fontsize=font_pt, family="DejaVu Sans Mono", va="center",
                fontweight="bold" if mask[i] else "normal", color="#222")
    handles = [Patch(facecolor=COLOURS[k][0], edgecolor="#888", label=LABELS[k]) for k in LABELS]
    handles.append(Patch(facecolor="white", edgecolor="#c0392b", linewidth=1.8,
                         label="token carrying the final reward (1.0)"))
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(left / width_in, 0.01), ncol=2, frameon=False,
              fontsize=font_pt - 1.5, handlelength=1.5, columnspacing=1.5)
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    env = play_episode()
    conv = env.conversation
    (sample,) = conv.samples()  # strict: runs the drift check
    OUT.mkdir(parents=True, exist_ok=True)
    draw(sample, conv.fmt.tokenizer, OUT / "mask_example.png")
    html = ("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>mt_env mask example</title></head><body>\n"
            + conv.render_html() + "\n</body></html>\n")
    (OUT / "mask_example.html").write_text(html, encoding="utf-8")
    print(text_view(sample, conv.fmt.tokenizer))
    print(f"\nwrote {(OUT / 'mask_example.png').relative_to(ROOT)} and {(OUT / 'mask_example.html').relative_to(ROOT)}")


if __name__ == "__main__":
    main()
