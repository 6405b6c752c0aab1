"""ChatFormat: a tokenizer, its chat template and the episode's tool schemas, and the few operations on them that
the conversation layer needs — render, encode, decode, and the *template delta* that follows an assistant turn.

Everything here works on text rendered by the tokenizer's own `apply_chat_template` (never a separate Jinja
environment: `tojson` behaves differently there) and is tokenized as whole pieces of template output, never as
message contents on their own (their edges merge with the wrapper around them).
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ChatFormatError, ConversationError

ROLES = ("system", "user", "assistant", "tool")
OBSERVATION_ROLES = ("tool", "user", "system")

# Placeholders used to locate the delta in a rendered probe conversation. No whitespace at their edges (templates
# such as Llama-3.1 trim contents) and nothing a tokenizer could mistake for a control token.
_USER_SENTINEL = "MTENVUSERSENTINEL"
_ASSISTANT_SENTINEL = "MTENVASSISTANTSENTINEL"
# Inserted after the first character of control-token text found in observations, so that it stays plain text.
ZERO_WIDTH_SPACE = "\u200b"
# Code points that no UTF-8 text can hold: in a Python str they come from lone surrogates (a JSON "\udce9" escape,
# bytes decoded with errors="surrogateescape"), and tokenizers refuse them.
_SURROGATE = re.compile("[\ud800-\udfff]")


def unencodable_at(text: str) -> int | None:
    """The index of the first character of `text` that UTF-8 cannot encode (a surrogate), or None. The one scan for
    such characters: `encodable` and `encodable_value` ask it too."""
    found = None if text.isascii() else _SURROGATE.search(text)
    return found.start() if found else None


def encodable(text: str) -> tuple[str, int]:
    """`text` made encodable as UTF-8, and how many characters were replaced: a surrogate pair becomes its
    character, a lone surrogate becomes U+FFFD."""
    if unencodable_at(text) is None:
        return text, 0
    fixed = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return fixed, fixed.count("\ufffd") - text.count("\ufffd")


def encodable_value(value: Any) -> tuple[Any, int]:
    """`encodable` applied to every string in a JSON-like value (dict keys included); returns (value, replaced).
    The value itself when nothing needs replacing (the common case, checked without copying)."""
    if isinstance(value, str):
        return encodable(value)
    if _all_encodable(value):
        return value, 0
    if isinstance(value, dict):
        pairs = [(encodable_value(k), encodable_value(v)) for k, v in value.items()]
        return {k: v for (k, _), (v, _) in pairs}, sum(nk + nv for (_, nk), (_, nv) in pairs)
    items = [encodable_value(v) for v in value]  # a list or tuple
    return type(value)(v for v, _ in items), sum(n for _, n in items)


def _all_encodable(value: Any) -> bool:
    if isinstance(value, str):
        return unencodable_at(value) is None
    if isinstance(value, dict):
        return all(map(_all_encodable, value)) and all(map(_all_encodable, value.values()))
    if isinstance(value, list | tuple):
        return all(map(_all_encodable, value))
    return True


class ChatFormat:
    """How one tokenizer + chat template + tool set turns messages into text and token ids.

    Args:
        tokenizer: a Hugging Face *fast* tokenizer with a ``chat_template``.
        tools: OpenAI function-tool schemas rendered into the prompt (exactly the tools the episode may call).
        template_kwargs: extra variables for the template, e.g. ``{"enable_thinking": False}`` for Qwen3.
        end_of_turn: the token that ends an assistant turn; defaults to the tokenizer's EOS token.
        control_text_in_observations: what to do when untrusted text contains the text of a control token such as
            ``<|im_end|>`` (which would otherwise be encoded as the real token and could forge a turn boundary):
            ``"escape"`` (default) inserts a zero-width space after its first character, ``"error"`` raises
            `ChatFormatError`, ``"keep"`` encodes it as the control token. Untrusted text is the content of every
            ``system``, ``user`` and ``tool`` message — tool output, user follow-ups, and the task data of the
            prompt. Assistant messages are kept as written: in a prompt they are demonstrations in the model's own
            format, whose tool-call tags must stay real tokens.
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        end_of_turn: str | None = None,
        control_text_in_observations: str = "escape",
    ):
        if not getattr(tokenizer, "chat_template", None):
            raise ChatFormatError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat template; "
                "set tokenizer.chat_template or use mt_env.tokenizer.offline_tokenizer()"
            )
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ChatFormatError("mt_env needs a fast (Rust-backed) tokenizer: load it with use_fast=True")
        if control_text_in_observations not in ("escape", "error", "keep"):
            raise ChatFormatError(
                f"control_text_in_observations must be escape/error/keep, got {control_text_in_observations!r}")
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools] if tools else None
        self.template_kwargs = dict(template_kwargs or {})
        self.control_text_policy = control_text_in_observations
        self._backend = backend
        self._pieces: dict[str, list[int]] | None = None  # see below
        # Renders of the same messages are reused (a GRPO group's episodes start from one prompt, and the drift
        # check of a one-turn episode renders it again; later turns' renders are new and only fill the bounded
        # cache), unless the template reads the clock.
        templates = tokenizer.chat_template  # one template, or a dict of named ones
        source = " ".join(templates.values()) if isinstance(templates, Mapping) else templates
        self._renders: dict[str, str] | None = None if "strftime_now" in source else {}
        self.vocab_size = len(tokenizer)

        eot = end_of_turn or tokenizer.eos_token
        if not eot:
            raise ChatFormatError("the tokenizer has no EOS token; pass end_of_turn= (e.g. '<|im_end|>')")
        eot_ids = self.encode(eot)
        if len(eot_ids) != 1:
            raise ChatFormatError(f"end-of-turn text {eot!r} is {len(eot_ids)} tokens; it must be one (added) token")
        self.end_of_turn, self.end_of_turn_id = eot, eot_ids[0]

        added_tokens = list(tokenizer.added_tokens_decoder.values())
        added = sorted({t.content for t in added_tokens}, key=len, reverse=True)
        self.control_texts = tuple(added)
        self._control_re = re.compile("|".join(map(re.escape, added))) if added else None
        self._control_first_chars = frozenset(t[0] for t in added)
        # Text between control tokens is tokenized independently of its neighbours (the tokenizer splits added
        # tokens out first), so encodings of repeated pieces — system prompt and tool schemas, wrappers — can be
        # reused. Only for plain added tokens (no lstrip/rstrip/single_word/normalized matching), and verified.
        if self._control_re is not None and not any(
                t.lstrip or t.rstrip or t.single_word or t.normalized for t in added_tokens):
            self._pieces = {}

        self.generation_prompt = self._find_generation_prompt()
        self.generation_prompt_ids = self.encode(self.generation_prompt)
        self.turn_tail = self._find_turn_tail()
        if self._pieces is not None:
            probe = self.render([{"role": "user", "content": "Hi <tool_call> 12 ab"}], add_generation_prompt=True)
            probe += " ".join(self.control_texts) + " x\n\n y"
            if self.encode(probe) != self._backend.encode(probe, add_special_tokens=False).ids:
                self._pieces = None  # the tokenizer splits added tokens differently: no reuse

    # ----------------------------------------------------------------------------------------- text <-> ids
    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
               with_tools: bool = True) -> str:
        """The template's text for `messages` (with this format's template variables, and its tools unless
        `with_tools` is False)."""
        if self._renders is None:
            return self._render(messages, add_generation_prompt, with_tools)
        try:
            key = json.dumps([messages, add_generation_prompt, with_tools])
        except (TypeError, ValueError):  # content json cannot write: render it, don't keep it
            return self._render(messages, add_generation_prompt, with_tools)
        text = self._renders.get(key)
        if text is None:
            text = _remember(self._renders, key, self._render(messages, add_generation_prompt, with_tools), 1024)
        return text

    def _render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, with_tools: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tools=self.tools if with_tools else None, tokenize=False,
                add_generation_prompt=add_generation_prompt, **self.template_kwargs,
            )
        except Exception as e:  # jinja errors, raise_exception() in templates
            raise ChatFormatError(f"the chat template failed to render {len(messages)} messages: {e}") from e

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; control-token text becomes control tokens; no BOS/EOS is added."""
        if self._pieces is None or len(text) < 64:
            return self._backend.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        start = 0
        for m in self._control_re.finditer(text):
            if m.start() > start:
                ids += self._piece(text[start:m.start()])
            ids += self._piece(m[0])
            start = m.end()
        if start < len(text):
            ids += self._piece(text[start:])
        return ids

    def clear_cache(self) -> None:
        """Forget the reused renders and piece encodings (benchmarks measure the cold cost with it)."""
        if self._pieces is not None:
            self._pieces.clear()
        if self._renders is not None:
            self._renders.clear()

    def _piece(self, piece: str) -> list[int]:
        ids = self._pieces.get(piece)
        if ids is None:
            ids = _remember(self._pieces, piece, self._backend.encode(piece, add_special_tokens=False).ids, 4096)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, control tokens included (so that it can be compared with rendered templates)."""
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def check_ids(self, ids: Sequence[int]) -> None:
        bad = [i for i in ids if not (isinstance(i, int) and 0 <= i < self.vocab_size)]
        if bad:
            raise ConversationError(f"token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})")

    # ----------------------------------------------------------------------------------------- messages
    def clean_message(self, message: Mapping[str, Any], observation: bool) -> dict[str, Any]:
        """A copy of `message` ready for the template: role checked, content a string, control text handled."""
        if not isinstance(message, Mapping):
            raise ChatFormatError(f"a message must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        allowed = OBSERVATION_ROLES if observation else ROLES
        if role not in allowed:
            where = "an observation" if observation else "a conversation"
            hint = " (assistant turns are added from sampled ids with add_assistant)" if role == "assistant" else ""
            raise ChatFormatError(f"unknown or unexpected role {role!r} in {where}; expected one of {allowed}{hint}")
        content = message.get("content")
        content = "" if content is None else content  # Qwen3's template fails on None
        if not isinstance(content, str):
            raise ChatFormatError(f"message content must be a string, got {type(content).__name__} (role {role!r})")
        out = dict(message)
        out["content"] = content if role == "assistant" else self.neutralize_control_text(content)
        return out

    def neutralize_control_text(self, text: str) -> str:
        """Apply the control-text policy to untrusted text (system, user and tool message contents)."""
        if self._control_re is None or self.control_text_policy == "keep":
            return text
        if not any(c in text for c in self._control_first_chars) or not self._control_re.search(text):
            return text
        if self.control_text_policy == "error":
            found = sorted(set(self._control_re.findall(text)))
            raise ChatFormatError(f"message text contains control-token text {found}")
        return self._control_re.sub(lambda m: m[0][0] + ZERO_WIDTH_SPACE + m[0][1:], text)

    # ----------------------------------------------------------------------------------------- deltas
    def prompt_text(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
        """(text before the generation prompt, generation prompt) of the rendered prompt."""
        text = self.render(messages, add_generation_prompt=True)
        if not text.endswith(self.generation_prompt):
            raise ChatFormatError(
                f"the rendered prompt does not end with the generation prompt {self.generation_prompt!r}")
        return text[: len(text) - len(self.generation_prompt)], self.generation_prompt

    def observation_text(self, observations: Sequence[Mapping[str, Any]], turn_closed: bool = True) -> tuple[str, str]:
        """(observation text, generation prompt): the exact text the template adds after an assistant turn.

        The observation text includes turn separators (e.g. the newline after ``<|im_end|>``) and the observation
        messages with their wrappers. If `turn_closed` is False (the model stopped without its end-of-turn token,
        e.g. on length), it also starts with the template's end-of-turn token.
        """
        if not observations:
            raise ConversationError("an observation needs at least one message")
        return self._delta_after_assistant(observations, turn_closed, with_tools=not self._deltas_tool_free)

    @functools.cached_property
    def _deltas_tool_free(self) -> bool:
        """Whether the template renders what follows an assistant turn without looking at the tools (true of the
        usual templates, which put tool schemas in the system turn). Then observations are rendered without them:
        most of a render's cost is converting and printing the schemas. Decided by rendering probe observations
        both ways; any difference keeps the tools."""
        if not self.tools:
            return True
        probes = [[{"role": "tool", "content": "1"}], [{"role": "user", "content": "2"}],
                  [{"role": "tool", "content": "3"}, {"role": "tool", "content": "4"}]]
        try:
            return all(self._delta_after_assistant(p, closed, with_tools=True)
                       == self._delta_after_assistant(p, closed, with_tools=False)
                       for p in probes for closed in (True, False))
        except ChatFormatError:
            return False

    def _delta_after_assistant(self, observations: Sequence[Mapping[str, Any]], turn_closed: bool,
                               with_tools: bool) -> tuple[str, str]:
        base = [{"role": "user", "content": _USER_SENTINEL}, {"role": "assistant", "content": _ASSISTANT_SENTINEL}]
        text = self.render(base + list(observations), add_generation_prompt=True, with_tools=with_tools)
        i = text.find(_ASSISTANT_SENTINEL)
        if i < 0 or text.find(_ASSISTANT_SENTINEL, i + 1) >= 0:
            raise ChatFormatError("cannot locate the assistant turn in the rendered template (sentinel not unique)")
        after = text[i + len(_ASSISTANT_SENTINEL):]
        if not after.startswith(self.end_of_turn):
            raise ChatFormatError(
                f"the template does not end an assistant turn with {self.end_of_turn!r} (it writes {after[:40]!r})"
            )
        if turn_closed:
            after = after[len(self.end_of_turn):]
        if not after.endswith(self.generation_prompt):
            raise ChatFormatError("the rendered observation does not end with the generation prompt")
        return after[: len(after) - len(self.generation_prompt)], self.generation_prompt

    def split_generation_prompt(self, ids: list[int]) -> int:
        """Index where the trailing generation prompt starts in `ids` (len(ids) when it cannot be told apart)."""
        n = len(self.generation_prompt_ids)
        return len(ids) - n if n and ids[-n:] == self.generation_prompt_ids else len(ids)

    def _find_generation_prompt(self) -> str:
        probe = [{"role": "user", "content": _USER_SENTINEL}]
        without = self.render(probe, add_generation_prompt=False)
        with_gen = self.render(probe, add_generation_prompt=True)
        if not with_gen.startswith(without) or with_gen == without:
            raise ChatFormatError(
                "the template's generation prompt is not a suffix added by add_generation_prompt=True")
        return with_gen[len(without):]

    def _find_turn_tail(self) -> str:
        """What the template writes after the end-of-turn token of a final assistant message (``\\n`` for ChatML)."""
        base = [{"role": "user", "content": _USER_SENTINEL}, {"role": "assistant", "content": _ASSISTANT_SENTINEL}]
        text = self.render(base, add_generation_prompt=False)
        return text.split(_ASSISTANT_SENTINEL + self.end_of_turn, 1)[-1] if _ASSISTANT_SENTINEL in text else ""

    def __repr__(self) -> str:
        tools = [t.get("function", t).get("name") for t in self.tools or []]
        return f"ChatFormat({getattr(self.tokenizer, 'name_or_path', '?')!r}, tools={tools}, eot={self.end_of_turn!r})"


# The formats in use, by (tokenizer id, JSON of tools and template variables, keys in their order: the template
# writes schemas with tojson, in that order). Weak values: an entry lives as long as some env holds its format, and
# that format holds the tokenizer, so the id cannot be reused meanwhile.
_in_use: weakref.WeakValueDictionary[tuple[int, str], ChatFormat] = weakref.WeakValueDictionary()


def shared_chat_format(tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None,
                       template_kwargs: Mapping[str, Any] | None = None) -> ChatFormat:
    """The `ChatFormat` of this tokenizer, tool schemas and template variables that other envs of the process
    already use, or a new one. Sharing it shares its encodings of repeated pieces (system prompt and tool schemas,
    wrappers, recurring tool outputs): 256 envs encode and keep them once, not 256 times. Tools or variables that
    JSON cannot write get a format of their own."""
    try:
        key = (id(tokenizer), json.dumps([tools or None, dict(template_kwargs or {})]))
    except (TypeError, ValueError):
        return ChatFormat(tokenizer, tools=tools, template_kwargs=template_kwargs)
    fmt = _in_use.get(key)
    if fmt is None:
        fmt = _in_use[key] = ChatFormat(tokenizer, tools=tools, template_kwargs=template_kwargs)
    return fmt


def _remember(cache: dict, key: Any, value: Any, limit: int) -> Any:
    """Store `value` under `key` and return it; a cache at `limit` entries is emptied first (bounded: unique
    entries — tool outputs, later turns — must not grow it forever)."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value
