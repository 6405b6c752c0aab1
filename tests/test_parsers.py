"""Tool-call parsers: every kind of bad model output gives a defined result, never an exception."""

from __future__ import annotations

import importlib.util
import json
import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mt_env.errors import ToolConfigError
from mt_env.parsers import (
    PARSE_ERROR_KINDS,
    HermesParser,
    Llama3JsonParser,
    ParsedTurn,
    ToolCall,
    get_parser,
)
from tests.conftest import LOOKUP_TOOL

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = [LOOKUP_TOOL, ADD_TOOL]


def hermes_call(name: str, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# ------------------------------------------------------------------------------------------------ Hermes / Qwen
def test_hermes_several_calls_with_text_around_them():
    text = "Let me look.\n" + hermes_call("lookup", {"query": "a"}) + "\n" + hermes_call("add", {"a": 1, "b": 2})
    text += " ok"
    turn = get_parser("qwen2.5", tools=SCHEMAS).parse(text)
    assert [(c.name, c.arguments) for c in turn.calls] == [("lookup", {"query": "a"}), ("add", {"a": 1, "b": 2})]
    assert turn.errors == []
    assert turn.content == "Let me look.\n\n ok"
    assert all(c.raw in text for c in turn.calls)


def test_hermes_tolerates_whitespace_and_newlines_inside_the_tags():
    text = '<tool_call>  \n\n {"name":\n "lookup",  "arguments": {"query": "x"}}\n\t \n</tool_call>'
    turn = HermesParser().parse(text)
    assert [(c.name, c.arguments) for c in turn.calls] == [("lookup", {"query": "x"})]
    assert turn.content == ""


def test_hermes_plain_text_is_all_content():
    turn = HermesParser().parse("  The answer is 4.\n")
    assert turn == ParsedTurn("The answer is 4.", [], [])


def test_calls_inside_think_blocks_are_ignored():
    inside = "<think>maybe " + hermes_call("add", {"a": 1, "b": 1}) + "</think>"
    turn = HermesParser().parse(inside + "\n" + hermes_call("lookup", {"query": "q"}))
    assert [c.name for c in turn.calls] == ["lookup"]
    assert inside in turn.content  # reasoning stays visible as content
    # a lone </think>: the template wrote <think>, so everything before it is reasoning
    assert [c.name for c in HermesParser().parse(hermes_call("add", {}) + "</think>done").calls] == []
    # reasoning cut off: nothing after an unclosed <think> is a call
    turn = HermesParser().parse("<think>let me call " + hermes_call("lookup", {"query": "q"}))
    assert turn.calls == [] and turn.errors == []
    # a think tag inside a call's arguments is data, not reasoning
    turn = HermesParser().parse(hermes_call("lookup", {"query": "<think>"}) + hermes_call("add", {"a": 1, "b": 2}))
    assert [c.name for c in turn.calls] == ["lookup", "add"]


@pytest.mark.parametrize("finish_reason, why", [("length", "token limit"), ("abort", "aborted")])
def test_unclosed_tool_call_at_the_end_of_a_cut_turn_is_truncated(finish_reason, why):
    text = "Checking. " + hermes_call("lookup", {"query": "a"}) + '\n<tool_call>\n{"name": "add", "arguments": {"a": 1'
    turn = HermesParser().parse(text, finish_reason)
    assert [c.name for c in turn.calls] == ["lookup"]
    assert [e.kind for e in turn.errors] == ["truncated"] and why in turn.errors[0].message
    assert turn.errors[0].raw.startswith("<tool_call>") and turn.content == "Checking."


# vLLM tests/tool_parsers/test_hermes_tool_parser.py (test_hermes_parser_non_streaming_tool_call_until_eos and
# _tool_call_invalid_json): a call the model ended without </tool_call> (EOS or a stop string) is read when its JSON
# is whole; it is not "truncated" unless the engine cut the turn.
def test_unclosed_tool_call_at_stop_is_read_when_its_json_is_whole():
    text = '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}'
    turn = HermesParser().parse(text, "stop")
    assert [(c.name, c.arguments, c.raw) for c in turn.calls] == [("final_answer", {"trigger": True}, text)]
    assert turn.errors == [] and turn.metrics["unclosed_at_stop"] == 1
    assert HermesParser().parse(text) == turn  # "stop" is the default
    assert [e.kind for e in HermesParser().parse(text, "length").errors] == ["truncated"]
    # the JSON itself is cut: vLLM calls nothing; mt_env tells the model the call is not valid JSON
    turn = HermesParser().parse(text[:-1], "stop")
    assert turn.calls == [] and [e.kind for e in turn.errors] == ["malformed_json"]
    # prose after the unclosed JSON is not part of a call
    assert [e.kind for e in HermesParser().parse(text + " done", "stop").errors] == ["malformed_json"]


# vLLM tests/tool_parsers/test_hermes_tool_parser.py (test_hermes_parser_non_streaming_serialized_arguments and
# _bare_string_arguments): arguments the model serialized itself are decoded once; a plain string is not an object.
def test_arguments_given_as_a_json_string_are_decoded_once():
    text = '<tool_call>\n{"name": "get_db_config", "arguments": "{\\"param\\": \\"max_connections\\"}"}\n</tool_call>'
    turn = HermesParser().parse(text)
    assert [(c.name, c.arguments) for c in turn.calls] == [("get_db_config", {"param": "max_connections"})]
    assert turn.metrics == {"string_arguments": 1}
    llama = Llama3JsonParser(tools=SCHEMAS).parse('{"name": "add", "parameters": "{\\"a\\": 1, \\"b\\": 2}"}')
    assert [c.arguments for c in llama.calls] == [{"a": 1, "b": 2}] and llama.metrics["string_arguments"] == 1
    bare = HermesParser().parse('<tool_call>\n{"name": "do_thing", "arguments": "hello"}\n</tool_call>')
    assert [(e.kind, e.name) for e in bare.errors] == [("invalid_arguments", "do_thing")] and not bare.metrics
    twice = HermesParser().parse(hermes_call("lookup", json.dumps(json.dumps({"query": "q"}))))
    assert [e.kind for e in twice.errors] == ["invalid_arguments"]  # decoded once only: still a string


# SGLang test/registered/unit/function_call/test_malformed_tool_call_payloads.py: a JSON array inside one
# <tool_call> calls its valid elements; mt_env also reports each invalid element (SGLang drops them silently).
def test_a_json_array_of_calls_in_one_block():
    valid = {"name": "lookup", "arguments": {"query": "Paris"}}
    turn = get_parser("qwen2.5", tools=SCHEMAS).parse(
        f"Two at once: <tool_call>{json.dumps([valid, 'junk', {'name': 'add', 'arguments': {'a': 1, 'b': 2}}])}"
        "</tool_call>")
    assert [(c.name, c.arguments) for c in turn.calls] == [("lookup", {"query": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert [e.kind for e in turn.errors] == ["malformed_json"] and turn.content == "Two at once:"
    assert turn.metrics["array_calls"] == 3
    for payload, errors in [("[1, 2]", 2), ('["x"]', 1), ("[null]", 1), ("[[]]", 1), ("[]", 1)]:
        turn = HermesParser().parse(f"<tool_call>{payload}</tool_call>")
        assert turn.calls == [] and [e.kind for e in turn.errors] == ["malformed_json"] * errors, payload


def test_tool_call_reopened_before_closing_is_malformed_and_the_next_one_still_parses():
    turn = HermesParser().parse('<tool_call>{"name": "lookup"' + hermes_call("lookup", {"query": "b"}))
    assert [e.kind for e in turn.errors] == ["malformed_json"]
    assert [c.arguments for c in turn.calls] == [{"query": "b"}]


@pytest.mark.parametrize("body", [
    '{"name": "lookup", "arguments": {"query": }}',  # broken JSON
    '{"name": "lookup", "arguments": {"query": "a"}',  # missing brace
    "lookup(query='a')",  # not JSON at all
    '{"arguments": {"query": "a"}}',  # no name
    '{"name": 3, "arguments": {}}',  # name not a string
    '"lookup"',  # not an object
    '{"name": "lookup", "arguments": {"query": NaN}}',  # not JSON (Python's json would accept it)
    "",
])
def test_malformed_calls(body):
    turn = HermesParser().parse(f"before <tool_call>{body}</tool_call> " + hermes_call("add", {"a": 1, "b": 2}))
    assert [e.kind for e in turn.errors] == ["malformed_json"]
    assert [c.name for c in turn.calls] == ["add"]  # one bad call does not spoil the others
    assert turn.content == "before"


@pytest.mark.parametrize("arguments", ['"q"', "[1, 2]", "null", "3"])
def test_arguments_that_are_not_an_object(arguments):
    turn = HermesParser().parse(f'<tool_call>{{"name": "lookup", "arguments": {arguments}}}</tool_call>')
    assert [(e.kind, e.name) for e in turn.errors] == [("invalid_arguments", "lookup")]


def test_missing_arguments_mean_no_arguments():
    assert HermesParser().parse('<tool_call>{"name": "now"}</tool_call>').calls[0].arguments == {}


def test_unknown_tool_and_schema_violations_when_schemas_are_given():
    parser = get_parser("hermes", tools=SCHEMAS)
    text = (hermes_call("search_web", {"q": "x"}) + hermes_call("add", {"a": "1", "b": 2})
            + hermes_call("add", {"a": 1}) + hermes_call("add", {"a": 1, "b": 2, "c": 3}))
    turn = parser.parse(text)
    assert turn.calls == []
    kinds = [(e.kind, e.name) for e in turn.errors]
    assert kinds == [("unknown_tool", "search_web")] + [("invalid_arguments", "add")] * 3
    assert "lookup, add" in turn.errors[0].message  # tells the model what exists
    assert "'1' is not of type 'integer'" in turn.errors[1].message
    assert "'b' is a required property" in turn.errors[2].message
    # without schemas, any name and any object goes through
    assert len(HermesParser().parse(text).calls) == 4


def test_bad_schema_given_to_a_parser_is_a_config_error():
    bad = {"type": "function", "function": {"name": "x", "parameters": {"type": "objekt"}}}
    with pytest.raises(ToolConfigError, match="'x'.*not a valid JSON schema"):
        get_parser("hermes", tools=[bad])


def decoded_lengths(monkeypatch) -> list[int]:
    """Lengths of the texts the parsers hand to the JSON decoder (json.loads and JSONDecoder.raw_decode)."""
    seen: list[int] = []
    loads, raw_decode = json.loads, json.JSONDecoder.raw_decode
    monkeypatch.setattr(json, "loads", lambda s, *a, **k: seen.append(len(s)) or loads(s, *a, **k))
    monkeypatch.setattr(json.JSONDecoder, "raw_decode",
                        lambda self, s, idx=0: seen.append(len(s) - idx) or raw_decode(self, s, idx))
    return seen


def test_one_megabyte_of_arguments_is_refused_before_decoding(monkeypatch):
    huge = hermes_call("lookup", {"query": "x" * 1_000_000})
    decoded = decoded_lengths(monkeypatch)
    turn = get_parser("hermes", tools=SCHEMAS).parse("a" + huge + "b")
    assert max(decoded, default=0) < 1000  # the body was never decoded: refused by its size
    assert [e.kind for e in turn.errors] == ["too_large"] and turn.calls == [] and turn.content == "ab"
    # under a raised cap the same call parses
    assert HermesParser(max_call_chars=2_000_000).parse(huge).calls[0].arguments["query"] == "x" * 1_000_000


def test_deeply_nested_json_is_malformed_not_a_crash():
    turn = HermesParser().parse("<tool_call>" + "[" * 50_000 + "</tool_call>")
    assert [e.kind for e in turn.errors] == ["malformed_json"]


def test_many_tags_parse_in_linear_time():
    """10x the tags costs well under 30x the time (quadratic scanning would cost ~100x): a ratio of two sizes
    measured in the same test, best of 3, so a loaded machine slows both alike."""

    def texts(n: int) -> list[str]:
        return ["<tool_call>" * (2 * n), "<think>" * (2 * n), "</think><think>" * n, "<tool_call></tool_call>" * n,
                "<think></think>" * n + hermes_call("add", {})]

    def cost(n: int) -> float:
        batch = texts(n)
        best = math.inf
        for _ in range(3):
            started = time.perf_counter()
            for text in batch:
                HermesParser().parse(text)
            best = min(best, time.perf_counter() - started)
        return best

    assert cost(50_000) < 30 * cost(5_000)


def test_control_characters_and_replacement_characters_from_the_model():
    garbage = b"\xff\xfe ok \xc3(".decode("utf-8", errors="replace")
    call = '<tool_call>{"name": "lookup", "arguments": {"query": "a\tb\x01' + garbage + '"}}</tool_call>'
    text = f"\x00\x1b[31m{garbage}\x7f" + call
    turn = get_parser("hermes", tools=SCHEMAS).parse(text)
    # raw control characters inside JSON strings are accepted (models write literal tabs and newlines in code)
    assert [c.arguments["query"] for c in turn.calls] == ["a\tb\x01" + garbage]
    assert turn.content == f"\x00\x1b[31m{garbage}\x7f"
    assert "\ufffd" in turn.content


# ------------------------------------------------------------------------------------------------ Llama-3.1 JSON
def test_llama_single_call_with_parameters():
    turn = get_parser("llama3_json", tools=SCHEMAS).parse('{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert [(c.name, c.arguments) for c in turn.calls] == [("add", {"a": 1, "b": 2})] and turn.content == ""


def test_llama_python_tag_several_calls_and_the_arguments_key():
    text = ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
            '{"name": "lookup", "arguments": {"query": "a;b"}};')
    turn = Llama3JsonParser(tools=SCHEMAS).parse(text)
    assert [(c.name, c.arguments) for c in turn.calls] == [("add", {"a": 1, "b": 2}), ("lookup", {"query": "a;b"})]
    assert turn.errors == []


@pytest.mark.parametrize("text", ["The answer is 4.", "{x} is a set with one element.", '{"answer": 4}', ""])
def test_llama_text_that_is_not_a_call_is_content(text):
    assert Llama3JsonParser().parse(text) == ParsedTurn(text, [], [])


@pytest.mark.parametrize("text, kinds", [
    ('{"name": "add", "parameters": {"a": 1, "b": ', ["truncated"]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2', ["truncated"]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2, "c": "x', ["truncated"]),
    ('{"name": "add", "parameters": {"a": 1 "b": 2}}', ["malformed_json"]),
    ('<|python_tag|>add(a=1, b=2)', ["malformed_json"]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}} and then I add', ["malformed_json"]),
    ('{"name": "add", "parameters": [1, 2]}', ["invalid_arguments"]),
    ('{"name": "mul", "parameters": {"a": 1, "b": 2}}', ["unknown_tool"]),
    ('{"name": "add", "parameters": {"a": 1.5, "b": 2}}', ["invalid_arguments"]),
])
def test_llama_bad_calls(text, kinds):
    turn = Llama3JsonParser(tools=SCHEMAS).parse(text, "length")
    assert [e.kind for e in turn.errors] == kinds
    # a turn the model ended itself is not cut off: incomplete JSON is malformed
    stopped = Llama3JsonParser(tools=SCHEMAS).parse(text, "stop")
    assert [e.kind for e in stopped.errors] == [k.replace("truncated", "malformed_json") for k in kinds]


# SGLang test/registered/unit/function_call/test_llama32_detector.py (test_normal_text_before_python_tag) and
# test_function_call_parser.py (TestLlama32Detector.test_with_python_tag_prefix): text before <|python_tag|> is the
# content and the calls after the tag are parsed.
@pytest.mark.parametrize("intro", ["Let me check. ", "Some intro.\n", "I'll use {lookup}: "])
def test_llama_python_tag_after_text(intro):
    text = intro + '<|python_tag|>{"name": "lookup", "arguments": {"query": "Tokyo"}}'
    turn = Llama3JsonParser(tools=SCHEMAS).parse(text)
    assert [(c.name, c.arguments) for c in turn.calls] == [("lookup", {"query": "Tokyo"})]
    assert turn.content == intro.strip() and turn.errors == []


# SGLang test/registered/unit/function_call/test_function_call_parser.py (TestLlama32Detector
# .test_multiple_json_with_separator_customized: one <|python_tag|> per call) and vLLM
# tests/tool_parsers/test_llama3_json_tool_parser.py (test_extract_tool_calls_streaming_parallel_separators and
# _multiple_json_with_whitespace: "; ", ";", ";\n", " ; " or a newline between calls).
@pytest.mark.parametrize("separator", ["; ", ";", ";\n", "\n", " ; ", "<|python_tag|>", "\n<|python_tag|>",
                                       "; <|python_tag|>"])
def test_llama_call_separators(separator):
    first, second = '{"name": "lookup", "parameters": {"query": "test1"}}', '{"name": "add", "parameters": {}}'
    for text in (first + separator + second, "<|python_tag|>" + first + separator + second):
        turn = Llama3JsonParser().parse(text)
        assert [(c.name, c.arguments) for c in turn.calls] == [("lookup", {"query": "test1"}), ("add", {})], text
        assert turn.errors == [] and turn.content == ""


# Where mt_env is deliberately stricter than the peers (docs/tools.md lists these):
# SGLang test_function_call_parser.py TestLlama32Detector.test_json_with_trailing_text and vLLM
# test_llama3_json_tool_parser.py test_extract_tool_calls_brace_in_trailing_text keep the call and the prose; mt_env
# runs the call and tells the model the prose is not allowed there. SGLang's test_invalid_then_valid_json recovers a
# call after a malformed one; mt_env stops at the malformed one. vLLM's test_extract_tool_calls_simple finds a bare
# call in the middle of prose; without <|python_tag|> mt_env reads such a turn as plain content.
def test_llama_where_mt_env_is_stricter_than_the_peers():
    turn = Llama3JsonParser().parse('{"name": "lookup", "parameters": {}} Some follow-up text')
    assert [c.name for c in turn.calls] == ["lookup"] and [e.kind for e in turn.errors] == ["malformed_json"]
    assert "unexpected text after a tool call" in turn.errors[0].message
    turn = Llama3JsonParser().parse('{"name": "lookup", "parameters": {{"name": "lookup", "parameters": {}}')
    assert turn.calls == [] and [e.kind for e in turn.errors] == ["malformed_json"]
    text = 'Here is the result: {"name": "lookup", "parameters": {}} Would you like to know more?'
    assert Llama3JsonParser().parse(text) == ParsedTurn(text, [], [])


def test_llama_one_megabyte_is_refused_before_decoding(monkeypatch):
    text = json.dumps({"name": "lookup", "parameters": {"query": "x" * 1_000_000}})
    decoded = decoded_lengths(monkeypatch)
    turn = Llama3JsonParser().parse(text)
    assert [e.kind for e in turn.errors] == ["too_large"] and max(decoded, default=0) < 1000


# ------------------------------------------------------------------------------------------------ registry, sglang
def test_registry():
    assert isinstance(get_parser("hermes"), HermesParser)
    assert isinstance(get_parser("qwen2.5"), HermesParser)
    assert isinstance(get_parser("llama3_json"), Llama3JsonParser)
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'"):
        get_parser("mistral")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_sglang_parser_without_sglang_says_how_to_install_it():
    with pytest.raises(ImportError, match=r'needs sglang with its dependencies.*pip install "mt-env\[sglang\]"'):
        get_parser("sglang:mistral", tools=SCHEMAS)


# One call with a raw newline and tab in its argument string, in each format whose JSON mt_env decodes itself (sglang's
# kimi_k2 detector hands the model's argument text on undecoded: ours reads it).
RAW_CONTROL_TURNS = {
    "hermes": '<tool_call>\n{"name": "lookup", "arguments": {"query": "a\nb\tc"}}\n</tool_call>',
    "llama3_json": '{"name": "lookup", "parameters": {"query": "a\nb\tc"}}',
    "sglang:kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>"
                      '{"query": "a\nb\tc"}<|tool_call_end|><|tool_calls_section_end|>',
}


@pytest.mark.parametrize("parser", RAW_CONTROL_TURNS)
def test_a_raw_newline_in_an_argument_string_reads_the_same_in_every_parser(parser):
    if parser.startswith("sglang:"):
        pytest.importorskip("sglang.srt.function_call.function_call_parser", reason="needs sglang's parsers")
    turn = get_parser(parser, tools=SCHEMAS).parse(RAW_CONTROL_TURNS[parser])
    assert turn.errors == [] and [(c.name, c.arguments) for c in turn.calls] == [("lookup", {"query": "a\nb\tc"})]


def test_a_call_sglangs_strict_detector_drops_is_an_error_not_silence():
    """SGLang's mistral detector decodes strictly: a raw newline in an argument string makes it drop the call and its
    text with no error of its own. The turn then says that something was dropped instead of reading as empty."""
    pytest.importorskip("sglang.srt.function_call.function_call_parser", reason="needs sglang's parsers")
    turn = get_parser("sglang:mistral", tools=SCHEMAS).parse('[TOOL_CALLS] [{"name": "lookup", "arguments": '
                                                             '{"query": "a\nb"}}]')
    assert turn.calls == [] and [e.kind for e in turn.errors] == ["malformed_json"]
    assert "dropped part of the turn" in turn.errors[0].message


# ------------------------------------------------------------------------------------------------ properties
TAGS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<|python_tag|>"]


def tag_free(strategy):
    """The format cannot quote its own tags (see HermesParser), so round trips exclude them from text."""
    return strategy.filter(lambda t: not any(tag in t for tag in TAGS))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | tag_free(st.text(max_size=10)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(tag_free(st.text(max_size=10)), inner, max_size=3),
    max_leaves=8,
)
tool_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,20}", fullmatch=True)
calls = st.lists(st.builds(ToolCall, tool_names, st.dictionaries(tag_free(st.text(max_size=10)), json_values,
                                                                 max_size=4)), max_size=4)
prose = tag_free(st.text())
model_text = st.lists(
    st.one_of(st.text(), st.sampled_from(TAGS + [";", "{", "}", '"', "\n", hermes_call("lookup", {"query": "x"}),
                                                 '{"name": "add", "parameters": {"a": 1, "b": 2}}', '{"name": '])),
    max_size=12,
).map("".join)


@given(model_text)
def test_random_model_text_never_raises(text):
    for name in ("hermes", "llama3_json"):
        for parser in (get_parser(name), get_parser(name, tools=SCHEMAS)):
            turn = parser.parse(text)
            assert isinstance(turn.content, str)
            assert all(e.kind in PARSE_ERROR_KINDS for e in turn.errors)
            assert all(isinstance(c.arguments, dict) and c.raw in text for c in turn.calls)
            if parser.validators is not None:
                assert all(c.name in parser.validators for c in turn.calls)


@given(calls, prose)
def test_hermes_round_trip(calls, content):
    turn = HermesParser().parse(HermesParser.format_turn(calls, content))
    assert [(c.name, c.arguments) for c in turn.calls] == [(c.name, c.arguments) for c in calls]
    assert turn.errors == [] and turn.content == content.strip()


@given(calls.filter(bool))
def test_llama_round_trip(calls):
    turn = Llama3JsonParser().parse(Llama3JsonParser.format_turn(calls))
    assert [(c.name, c.arguments) for c in turn.calls] == [(c.name, c.arguments) for c in calls]
    assert turn.errors == []


def test_hermes_format_is_what_the_qwen25_template_renders(qwen25):
    calls = [ToolCall("lookup", {"query": "é <b> \"q\""}), ToolCall("add", {"a": 1, "b": 2})]
    for content in ("", "Let me check."):
        message = {"role": "assistant", "content": content,
                   "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                  for c in calls]}
        rendered = qwen25.apply_chat_template([{"role": "user", "content": "hi"}, message], tokenize=False)
        assert "<|im_start|>assistant\n" + HermesParser.format_turn(calls, content) + "<|im_end|>" in rendered


# ------------------------------------------------------------------------------------------------ in an env
def test_the_env_reads_each_turn_by_its_finish_reason():
    import gymnasium as gym

    import mt_env  # noqa: F401  (registers the envs)
    from mt_env.env import ModelTurn

    unclosed = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}'
    env = gym.make("Calculator-v0")
    env.reset(seed=0)
    obs, _, terminated, truncated, info = env.step(ModelTurn(text=unclosed, finish_reason="stop"))
    assert obs["text"] == "tool: 42" and not (terminated or truncated)
    env.reset(seed=0)
    obs, *_, info = env.step(ModelTurn(text=unclosed, finish_reason="length"))
    assert [e["kind"] for e in info["parse_errors"]] == ["truncated"] and info["tool_calls"] == []
    # a Llama call after some text is a call, not an answer that ends the episode
    env = gym.make("Calculator-v0", tool_format="llama3_json")
    env.reset(seed=0)
    obs, _, terminated, _, info = env.step(
        'Let me compute. <|python_tag|>{"name": "calculator", "parameters": {"expression": "6 * 7"}}')
    assert obs["text"] == "tool: 42" and not terminated and info["tool_calls"][0]["function"]["name"] == "calculator"
