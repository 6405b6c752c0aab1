"""Tool-call parsers: every kind of bad model output gives a defined result, never an exception."""

from __future__ import annotations

import importlib.util
import json
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


def test_unclosed_tool_call_at_the_end_is_truncated():
    text = "Checking. " + hermes_call("lookup", {"query": "a"}) + '\n<tool_call>\n{"name": "add", "arguments": {"a": 1'
    turn = HermesParser().parse(text)
    assert [c.name for c in turn.calls] == ["lookup"]
    assert [e.kind for e in turn.errors] == ["truncated"]
    assert turn.errors[0].raw.startswith("<tool_call>") and turn.content == "Checking."


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
    '["lookup", {"query": "a"}]',  # not an object
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


def test_one_megabyte_of_arguments_is_refused_quickly():
    huge = hermes_call("lookup", {"query": "x" * 1_000_000})
    started = time.perf_counter()
    turn = get_parser("hermes", tools=SCHEMAS).parse("a" + huge + "b")
    assert time.perf_counter() - started < 0.5
    assert [e.kind for e in turn.errors] == ["too_large"] and turn.calls == [] and turn.content == "ab"
    # under a raised cap the same call parses
    assert HermesParser(max_call_chars=2_000_000).parse(huge).calls[0].arguments["query"] == "x" * 1_000_000


def test_deeply_nested_json_is_malformed_not_a_crash():
    turn = HermesParser().parse("<tool_call>" + "[" * 50_000 + "</tool_call>")
    assert [e.kind for e in turn.errors] == ["malformed_json"]


def test_many_tags_parse_in_linear_time():
    started = time.perf_counter()
    texts = ["<tool_call>" * 100_000, "<think>" * 100_000, "</think><think>" * 50_000,
             "<tool_call></tool_call>" * 50_000, "<think></think>" * 50_000 + hermes_call("add", {})]
    for text in texts:
        HermesParser().parse(text)
    assert time.perf_counter() - started < 2.0


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
    ('{"name": "add", "parameters": {"a": 1 "b": 2}}', ["malformed_json"]),
    ('<|python_tag|>add(a=1, b=2)', ["malformed_json"]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}} and then I add', ["malformed_json"]),
    ('{"name": "add", "parameters": [1, 2]}', ["invalid_arguments"]),
    ('{"name": "mul", "parameters": {"a": 1, "b": 2}}', ["unknown_tool"]),
    ('{"name": "add", "parameters": {"a": 1.5, "b": 2}}', ["invalid_arguments"]),
])
def test_llama_bad_calls(text, kinds):
    turn = Llama3JsonParser(tools=SCHEMAS).parse(text)
    assert [e.kind for e in turn.errors] == kinds


def test_llama_one_megabyte_is_refused_quickly():
    started = time.perf_counter()
    turn = Llama3JsonParser().parse(json.dumps({"name": "lookup", "parameters": {"query": "x" * 1_000_000}}))
    assert [e.kind for e in turn.errors] == ["too_large"] and time.perf_counter() - started < 0.5


# ------------------------------------------------------------------------------------------------ registry, sglang
def test_registry():
    assert isinstance(get_parser("hermes"), HermesParser)
    assert isinstance(get_parser("qwen2.5"), HermesParser)
    assert isinstance(get_parser("llama3_json"), Llama3JsonParser)
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'"):
        get_parser("mistral")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_sglang_parser_without_sglang_says_how_to_install_it():
    with pytest.raises(ImportError, match=r'pip install "mt-env\[sglang\]".*pip install --no-deps sglang'):
        get_parser("sglang:mistral", tools=SCHEMAS)


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
