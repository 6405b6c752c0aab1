"""Tool calls out of an assistant turn's text: native parsers for the Hermes/Qwen and Llama-3.1 JSON formats, and an
optional wrapper around SGLang's parsers for the other formats.

A parser never raises on model text. Whatever the model wrote becomes a `ParsedTurn`: the text outside tool calls
(`content`), the calls that parsed (`calls`) and one `ParseError` per call that did not (`errors`), each with a
``kind`` the runner turns into an observation the model can read:

==================  ===========================================================================================
``malformed_json``  the call is not JSON, or not an object with a string ``"name"``
``truncated``       the call was cut off: the turn ended on its token limit (or was aborted) inside the call
``unknown_tool``    the name is not one of the episode's tools (only checked when the parser is given schemas)
``invalid_arguments`` the arguments are not a JSON object, or fail the tool's JSON schema (idem)
``too_large``       the call's text is longer than ``max_call_chars`` and was not parsed
==================  ===========================================================================================

``parse(text, finish_reason)`` takes the engine's finish reason of the turn: only a turn that ended on ``"length"``
(or ``"abort"``) can hold a cut-off call; a turn the model ended itself (``"stop"``: EOS or a stop string) that
leaves a ``<tool_call>`` open is read as far as its JSON is complete. Lenient readings that the peers (vLLM, SGLang)
also make are counted per turn in `ParsedTurn.metrics`, so a run can see how often the model needed them.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .tool_schema import argument_error, shorten, validators_by_name

PARSE_ERROR_KINDS = ("malformed_json", "truncated", "unknown_tool", "invalid_arguments", "too_large")
#: Finish reasons of a turn that was cut off by the engine, not ended by the model.
CUT_FINISH_REASONS = ("length", "abort")
#: The keys of `ParsedTurn.metrics`: lenient readings of what the model wrote.
PARSE_METRICS = ("string_arguments", "unclosed_at_stop", "array_calls")

#: Default cap on the characters of one call (Hermes) or of the whole turn (Llama JSON) handed to the JSON decoder.
MAX_CALL_CHARS = 65_536


#: ``json.dumps(arguments, ensure_ascii=False)`` without an encoder made for every call
_ARGUMENTS_JSON = json.JSONEncoder(ensure_ascii=False)


@dataclass
class ToolCall:
    """One parsed call. `id` is None for formats without call ids (the runner numbers calls itself)."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None
    raw: str = ""  #: the exact text of the call in the turn
    #: the validator that accepted `arguments` (the parser's, when it was given schemas): a `ToolBox` whose tool
    #: checks with that very validator does not check them again; whoever changes `arguments` sets it to None
    checked_by: Any = field(default=None, repr=False, compare=False)

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry (arguments as JSON text)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": _ARGUMENTS_JSON.encode(self.arguments)}}


@dataclass
class ParseError:
    """A call the model attempted that cannot be run. `name` is the tool name when it could be read."""

    kind: str
    message: str
    raw: str = ""
    name: str | None = None


@dataclass
class ParsedTurn:
    """One turn's text outside calls, its calls and its errors. `metrics` counts the lenient readings (keys of
    `PARSE_METRICS`): ``string_arguments`` (``"arguments"`` given as a JSON-encoded object, decoded once),
    ``unclosed_at_stop`` (a ``<tool_call>`` left open by a turn that ended on ``stop``), ``array_calls`` (calls
    read from a JSON array inside one ``<tool_call>``); a reading that did not happen is not a key."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)
    metrics: dict[str, int] = field(default_factory=dict)


class ToolCallParser:
    """Base of the parsers: `parse(text, finish_reason) -> ParsedTurn`.

    Args:
        tools: the episode's OpenAI tool schemas. When given, calls to other names become ``unknown_tool`` and
            arguments are validated against the tool's JSON schema; when None, any name and object is accepted.
        max_call_chars: calls longer than this are reported as ``too_large`` without being decoded.
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None, max_call_chars: int = MAX_CALL_CHARS):
        self.validators = validators_by_name(tools) if tools is not None else None
        self.max_call_chars = max_call_chars

    def parse(self, text: str, finish_reason: str = "stop") -> ParsedTurn:
        """The content, calls and errors of one assistant turn. `finish_reason` is the engine's (``stop``,
        ``length``, ``abort``): only a turn in `CUT_FINISH_REASONS` can hold a cut-off call."""
        raise NotImplementedError

    def _decode_call(self, body: str, raw: str, metrics: dict[str, int]) -> list[ToolCall | ParseError]:
        """One call's JSON text -> the checked call, or the reason it is not one. A JSON array of calls (which SGLang
        and vLLM accept) gives one result per element, so its valid calls run and its invalid ones are reported."""
        if len(body) > self.max_call_chars:
            return [ParseError("too_large", f"the tool call is {len(body)} characters, over the limit of "
                                            f"{self.max_call_chars}", raw)]
        try:
            obj = TOOL_CALL_JSON.decode(body)
        except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; deep nesting recurses
            return [ParseError("malformed_json", f"the tool call is not valid JSON: {shorten(str(e))}", raw)]
        if not isinstance(obj, list):
            return [self._check_call(obj, raw, metrics)]
        if not obj:
            return [ParseError("malformed_json", "the tool call is an empty JSON array: it calls nothing", raw)]
        metrics["array_calls"] = metrics.get("array_calls", 0) + len(obj)
        return [self._check_call(item, raw, metrics) for item in obj]

    def _check_call(self, obj: Any, raw: str, metrics: dict[str, int]) -> ToolCall | ParseError:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return ParseError("malformed_json", 'a tool call must be a JSON object with a string "name" and an '
                                                '"arguments" object', raw)
        name = obj["name"]
        arguments = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
        if isinstance(arguments, str) and (decoded := _json_object(arguments)) is not None:
            arguments = decoded  # the model serialized the object itself: decode once, as vLLM does
            metrics["string_arguments"] = metrics.get("string_arguments", 0) + 1
        validator = None
        if self.validators is not None:
            validator = self.validators.get(name)
            if validator is None:
                known = ", ".join(self.validators) or "none"
                return ParseError("unknown_tool", f"unknown tool {_shown(name)!r}; available tools: {known}",
                                  raw, name)
        if not isinstance(arguments, dict):
            return ParseError("invalid_arguments", f"the arguments of {_shown(name)!r} must be a JSON object", raw,
                              name)
        if validator is not None:
            problem = argument_error(validator, arguments)
            if problem:
                return ParseError("invalid_arguments", f"invalid arguments for {_shown(name)!r}: {problem}", raw,
                                  name)
        return ToolCall(name, arguments, None, raw, checked_by=validator)


def _shown(name: str) -> str:
    """A tool name as error messages quote it: without schemas a name may be any length."""
    return shorten(name, 80)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


#: The one JSON reading of tool calls (every parser here, and `ToolBox` for string arguments): raw control characters
#: inside strings accepted (models write literal tabs and newlines in code), NaN and Infinity refused.
TOOL_CALL_JSON = json.JSONDecoder(strict=False, parse_constant=_reject_constant)


def _json_object(text: str) -> dict | None:
    """`text` decoded when it is a JSON object, else None (a plain string stays a string)."""
    try:
        value = TOOL_CALL_JSON.decode(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _add(turn: ParsedTurn, results: Sequence[ToolCall | ParseError]) -> None:
    for result in results:
        (turn.calls if isinstance(result, ToolCall) else turn.errors).append(result)


_CUT_WHY = {"length": "the turn hit its token limit", "abort": "the generation was aborted"}


class HermesParser(ToolCallParser):
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the
    turn, several per turn (or a JSON array of calls in one block). Text around them is the content. Calls inside
    ``<think>...</think>`` are reasoning and are ignored (so is everything before a lone ``</think>``, whose
    ``<think>`` the template wrote). A ``<tool_call>`` still open when the turn ends is cut off if the engine cut
    the turn, and read as a call if the model stopped (the closing tag is then often all that is missing).

    The format cannot quote its own tags: an argument string containing ``</tool_call>`` ends the call there, as
    in every Hermes parser."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

    def parse(self, text: str, finish_reason: str = "stop") -> ParsedTurn:
        if self.OPEN not in text and self.THINK_CLOSE not in text:  # no call, no reasoning to skip: all content
            return ParsedTurn(text.strip())
        turn = ParsedTurn("")
        content: list[str] = []
        pos = 0  # start of the text not yet assigned to content or to a call
        scan = self._after_leading_reasoning(text)  # where to look for the next call or think block
        next_call = next_think = -2  # cached positions of the next tags (-1: none left, -2: not looked up)
        while True:
            if next_call != -1 and next_call < scan:
                next_call = text.find(self.OPEN, scan)
            if next_think != -1 and next_think < scan:
                next_think = text.find(self.THINK_OPEN, scan)
            if next_think >= 0 and (next_call < 0 or next_think < next_call):  # skip the think block
                close = text.find(self.THINK_CLOSE, next_think)
                if close >= 0:
                    scan = close + len(self.THINK_CLOSE)
                    continue
                next_call = -1  # reasoning cut off: nothing after it is a call
            start = next_call
            if start < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:start])
            body_start = start + len(self.OPEN)
            reopened = text.find(self.OPEN, body_start)
            end = text.find(self.CLOSE, body_start, reopened if reopened >= 0 else len(text))
            if end < 0 and reopened < 0:
                _add(turn, self._unclosed_call(text[start:], finish_reason, turn.metrics))
                break
            if end < 0:
                turn.errors.append(ParseError("malformed_json", "a <tool_call> was opened before the previous one "
                                                                "was closed with </tool_call>", text[start:reopened]))
                pos = scan = reopened
                continue
            raw = text[start:end + len(self.CLOSE)]
            _add(turn, self._decode_call(text[body_start:end].strip(), raw, turn.metrics))
            pos = scan = end + len(self.CLOSE)
        turn.content = "".join(content).strip()
        return turn

    def _unclosed_call(self, raw: str, finish_reason: str, metrics: dict[str, int]) -> list[ToolCall | ParseError]:
        """A ``<tool_call>`` still open at the end of the turn (`raw` runs from the tag to the end)."""
        if finish_reason in CUT_FINISH_REASONS:
            return [ParseError("truncated", f"the tool call was cut off before </tool_call> "
                                            f"({_CUT_WHY[finish_reason]})", raw)]
        # the model stopped: read the call if its JSON is whole, as vLLM does
        metrics["unclosed_at_stop"] = metrics.get("unclosed_at_stop", 0) + 1
        return self._decode_call(raw[len(self.OPEN):].strip(), raw, metrics)

    def _after_leading_reasoning(self, text: str) -> int:
        """Where the answer starts when the turn begins inside reasoning (a ``</think>`` with no ``<think>`` before
        it: the template wrote the ``<think>``); 0 otherwise."""
        close = text.find(self.THINK_CLOSE)
        if close < 0 or 0 <= text.find(self.THINK_OPEN, 0, close):
            return 0
        return close + len(self.THINK_CLOSE)

    @classmethod
    def format_turn(cls, calls: Sequence[ToolCall | Mapping[str, Any]], content: str = "") -> str:
        """The assistant text the Qwen2.5 template renders for `content` and `calls` (after the generation prompt):
        for writing demonstrations and scripted policies."""
        blocks = [f"{cls.OPEN}\n{_call_json(c, 'arguments')}\n{cls.CLOSE}" for c in calls]
        return "\n".join(([content] if content else []) + blocks)


class Llama3JsonParser(ToolCallParser):
    """Llama-3.1 JSON tool calls: ``{"name": ..., "parameters": {...}}`` (``"arguments"`` is accepted too). The calls
    either make up the whole turn, or follow a ``<|python_tag|>`` (the text before the tag is the content). Several
    calls are separated by ``;``, by a newline or by another ``<|python_tag|>``. A turn that neither starts like a
    call nor holds the tag is plain content; text after the calls is an error, and so is everything after a call
    that does not parse (the peers are more lenient here: see docs/tools.md). `max_call_chars` caps the calls'
    text as a whole."""

    PYTHON_TAG = "<|python_tag|>"
    _CALL_START = re.compile(r'\{\s*"(?:name|type)"\s*:')

    def parse(self, text: str, finish_reason: str = "stop") -> ParsedTurn:
        stripped = text.strip()
        start = 0 if self._CALL_START.match(stripped) else stripped.find(self.PYTHON_TAG)
        if start < 0:
            return ParsedTurn(stripped)
        turn = ParsedTurn(stripped[:start].rstrip())
        body = stripped[start:]
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].lstrip()
        if len(body) > self.max_call_chars:
            turn.errors.append(ParseError("too_large", f"the tool calls are {len(body)} characters, over the limit "
                                                       f"of {self.max_call_chars}", body))
            return turn
        pos = 0
        while pos < len(body):
            try:
                obj, end = TOOL_CALL_JSON.raw_decode(body, pos)
            except (ValueError, RecursionError) as e:
                cut = finish_reason in CUT_FINISH_REASONS and isinstance(e, json.JSONDecodeError) and (
                    e.pos >= len(body) or e.msg.startswith("Unterminated"))
                kind, why = ("truncated", "was cut off") if cut else ("malformed_json", "is not valid JSON")
                turn.errors.append(ParseError(kind, f"the tool call {why}: {shorten(str(e))}", body[pos:]))
                break
            _add(turn, [self._check_call(obj, body[pos:end], turn.metrics)])
            pos = self._next_call(body, end)
            if pos is None:
                rest = body[end:].strip()
                turn.errors.append(ParseError("malformed_json", "unexpected text after a tool call (separate calls "
                                                                f"with ';'): {shorten(rest, 80)!r}", rest))
                break
        return turn

    def _next_call(self, body: str, end: int) -> int | None:
        """Where the call after the one ending at `end` starts: past one separator (``;``, ``<|python_tag|>``, or a
        newline followed by another call) and the space around it; ``len(body)`` at the end; None when other text
        follows."""
        pos = _skip_space(body, end)
        newline = "\n" in body[end:pos]
        marked = False
        if body.startswith(";", pos):
            pos, marked = _skip_space(body, pos + 1), True
        if body.startswith(self.PYTHON_TAG, pos):
            pos, marked = _skip_space(body, pos + len(self.PYTHON_TAG)), True
        if pos == len(body) or marked or (newline and self._CALL_START.match(body, pos)):
            return pos
        return None

    @classmethod
    def format_turn(cls, calls: Sequence[ToolCall | Mapping[str, Any]], content: str = "") -> str:
        """The assistant text for `calls` in Llama-3.1 JSON format (the template renders no content next to calls)."""
        if content:
            raise ValueError("the Llama-3.1 JSON format cannot carry content next to tool calls")
        return "; ".join(_call_json(c, "parameters") for c in calls)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _call_json(call: ToolCall | Mapping[str, Any], arguments_key: str) -> str:
    name, arguments = (call.name, call.arguments) if isinstance(call, ToolCall) else (call["name"], call["arguments"])
    return json.dumps({"name": name, arguments_key: arguments}, ensure_ascii=False)


class SGLangParser(ToolCallParser):
    """Any format SGLang knows (``"mistral"``, ``"deepseekv3"``, ``"pythonic"``, ...), through its
    ``FunctionCallParser``. Needs the episode's tool schemas (SGLang drops calls to tools it was not given) and the
    sglang package with its dependencies: ``pip install "mt-env[sglang]"`` (its parser modules import much of its
    server: ``pip install --no-deps sglang`` is not enough since sglang 0.5)."""

    def __init__(self, fmt: str, tools: Sequence[Mapping[str, Any]] | None = None,
                 max_call_chars: int = MAX_CALL_CHARS):
        super().__init__(tools, max_call_chars)
        try:
            from sglang.srt.function_call.function_call_parser import FunctionCallParser
            try:
                from sglang.srt.entrypoints.openai.protocol import Function, Tool
            except ImportError:  # sglang < 0.4.7
                from sglang.srt.openai_api.protocol import Function, Tool
        except ImportError as e:
            raise ImportError(
                f"the 'sglang:{fmt}' parser needs sglang with its dependencies ({e}): pip install \"mt-env[sglang]\""
            ) from e
        sglang_tools = [
            Tool(type="function", function=Function(name=t["function"]["name"],
                                                    description=t["function"].get("description", ""),
                                                    parameters=t["function"].get("parameters")))
            for t in tools or []
        ]
        self.format = fmt
        self._parser = FunctionCallParser(tools=sglang_tools, tool_call_parser=fmt)

    def parse(self, text: str, finish_reason: str = "stop") -> ParsedTurn:
        if len(text) > self.max_call_chars:
            return ParsedTurn("", [], [ParseError("too_large", f"the turn is {len(text)} characters, over the "
                                                               f"limit of {self.max_call_chars}", text)])
        try:
            content, items = self._parser.parse_non_stream(text)
        except Exception as e:  # sglang's detectors raise on some malformed input
            return ParsedTurn(text.strip(), [], [ParseError("malformed_json", f"sglang could not parse the tool "
                                                                              f"calls: {shorten(str(e))}", text)])
        turn = ParsedTurn(content.strip())
        if not items and turn.content != text.strip():  # the detector took text and gave no call: say so
            turn.errors.append(ParseError("malformed_json", f"sglang's {self.format!r} detector dropped part of the "
                                                            f"turn without a tool call (e.g. JSON it could not "
                                                            f"decode strictly)", text))
        for item in items:
            try:
                arguments = TOOL_CALL_JSON.decode(item.parameters or "{}")  # raw text in some formats (kimi_k2)
            except (ValueError, RecursionError) as e:
                turn.errors.append(ParseError("malformed_json", f"the arguments are not valid JSON: "
                                                                f"{shorten(str(e))}", item.parameters or "", item.name))
                continue
            result = self._check_call({"name": item.name, "arguments": arguments}, item.parameters or "", turn.metrics)
            if isinstance(result, ToolCall):
                result.id = getattr(item, "tool_call_id", None)
            _add(turn, [result])
        return turn


#: Parser names for `get_parser`; add a format by adding a class here.
PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen2.5": HermesParser,
    "qwen3": HermesParser,
    "llama3_json": Llama3JsonParser,
}


def shared_parser(name: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ToolCallParser:
    """`get_parser(name, tools)`: the one that the process's envs already use for this format and these schemas, or
    a new one (a parser keeps nothing between turns; 256 envs share one, its validators and their code). SGLang's
    parsers, which wrap detectors of their own, are made anew."""
    if name.startswith("sglang:"):
        return get_parser(name, tools)
    try:
        key = (name, json.dumps(tools, sort_keys=True))
    except (TypeError, ValueError):  # schemas that JSON cannot write: a parser of their own
        return get_parser(name, tools)
    parser = _in_use.get(key)
    if parser is None:
        parser = _in_use[key] = get_parser(name, tools)
    return parser


_in_use: weakref.WeakValueDictionary[tuple[str, str], ToolCallParser] = weakref.WeakValueDictionary()


def get_parser(name: str, tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> ToolCallParser:
    """The parser called `name` (a key of `PARSERS`, or ``"sglang:<format>"``), checking calls against `tools`."""
    if name.startswith("sglang:"):
        return SGLangParser(name.split(":", 1)[1], tools, **kwargs)
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)} or 'sglang:<format>'")
    return PARSERS[name](tools, **kwargs)
