"""Tool configuration (verl-shaped YAML or dict) and the per-sample selection of an episode's tools."""

from __future__ import annotations

import itertools
import json

import pytest

from mt_env import tool_config
from mt_env.calculator import CalculatorTool
from mt_env.chat_format import ChatFormat
from mt_env.errors import ToolConfigError
from mt_env.tool_config import EpisodeTools, load_tools, select_tools
from mt_env.tools import BaseTool, ToolBox


class NoteTool(BaseTool):
    """A tool defined outside mt_env, loaded by its class path."""

    async def execute(self, instance_id, arguments, **kwargs):
        return "noted", 0.0, {}


def entry(name: str, class_name: str = "tests.test_tool_config.NoteTool", **config) -> dict:
    return {
        "class_name": class_name,
        "config": config,
        "tool_schema": {"type": "function", "function": {
            "name": name, "description": f"The {name} tool.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        }},
    }


VERL_YAML = """
tools:
  - class_name: "mt_env.calculator.CalculatorTool"
    config:
      type: native
      timeout: 5
    tool_schema:
      type: "function"
      function:
        name: "calculator"
        description: "Evaluate an arithmetic expression."
        parameters:
          type: "object"
          properties:
            expression:
              type: "string"
              description: "The expression to evaluate."
          required: ["expression"]
  - class_name: tests.test_tool_config.NoteTool
    config: {max_concurrency: 4, on_error: end_episode}
    tool_schema:
      type: function
      function:
        name: take_note
        description: Write a note down.
        parameters: {type: object, properties: {text: {type: string}}, required: [text]}
"""


# ------------------------------------------------------------------------------------------------ loading
def test_verl_shaped_yaml_loads(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(VERL_YAML)
    calculator, note = load_tools(path)
    assert isinstance(calculator, CalculatorTool) and isinstance(note, NoteTool)
    assert [calculator.name, note.name] == ["calculator", "take_note"]
    assert calculator.settings.timeout == 5
    assert note.settings.max_concurrency == 4 and note.settings.on_error == "end_episode"
    assert calculator.tool_schema["function"]["parameters"]["required"] == ["expression"]


def test_the_same_structure_as_a_dict_loads():
    tools = load_tools({"tools": [entry("a"), entry("b", timeout=2)]})
    assert [t.name for t in tools] == ["a", "b"] and tools[1].settings.timeout == 2
    assert load_tools({"tools": []}) == [] and load_tools({"tools": None}) == []


def test_verl_class_names_map_through_the_alias_table(monkeypatch):
    verl_entry = entry("calc", "verl.tools.some_tool.SomeTool")
    verl_entry["tool_schema"]["function"]["parameters"]["properties"] = {"expression": {"type": "string"}}
    with pytest.raises(ToolConfigError, match=r"tools\[0\] \(verl.tools.some_tool.SomeTool\): cannot import"):
        load_tools({"tools": [verl_entry]})
    aliases = tool_config.TOOL_CLASS_ALIASES
    monkeypatch.setitem(aliases, "verl.tools.some_tool.SomeTool", "mt_env.calculator.CalculatorTool")
    (tool,) = load_tools({"tools": [verl_entry]})
    assert isinstance(tool, CalculatorTool)


def test_a_missing_alias_target_is_a_clear_error(monkeypatch):
    aliases = tool_config.TOOL_CLASS_ALIASES
    monkeypatch.setitem(aliases, "verl.tools.gsm8k_tool.Gsm8kTool", "envs.not_written_yet.Gsm8kTool")
    with pytest.raises(ToolConfigError, match=r"tools\[1\] \(verl.tools.gsm8k_tool.Gsm8kTool\): cannot import module "
                                              r"'envs.not_written_yet' \(alias of 'envs.not_written_yet.Gsm8kTool'\)"):
        load_tools({"tools": [entry("a"), entry("b", "verl.tools.gsm8k_tool.Gsm8kTool")]})


# verl/tools/utils/tool_registry.py (initialize_tools_from_config): an entry without tool_schema passes
# tool_schema=None to its class, which then uses its own schema.
def test_an_entry_without_tool_schema_uses_the_class_schema(tmp_path):
    from envs.gsm8k.tool import TOOL_SCHEMA, Gsm8kTool
    from mt_env.calculator import CALCULATOR_SCHEMA

    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n"
                    "  - class_name: mt_env.calculator.CalculatorTool\n    config: {type: native, timeout: 5}\n"
                    "  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native}\n"
                    "    tool_schema: null\n")
    calculator, gsm8k = load_tools(path)
    assert isinstance(calculator, CalculatorTool) and calculator.tool_schema == CALCULATOR_SCHEMA
    assert calculator.settings.timeout == 5
    assert isinstance(gsm8k, Gsm8kTool) and gsm8k.tool_schema == TOOL_SCHEMA


def test_the_gsm8k_alias_points_into_envs():
    assert tool_config.TOOL_CLASS_ALIASES["verl.tools.gsm8k_tool.Gsm8kTool"] == "envs.gsm8k.tool.Gsm8kTool"


@pytest.mark.parametrize("bad_entry, message", [
    (entry("b", "tests.no_such_module.Tool"), r"tools\[1\] \(tests.no_such_module.Tool\): cannot import module"),
    (entry("b", "tests.test_tool_config.Missing"), r"tools\[1\] \(tests.test_tool_config.Missing\): module "
                                                  r"'tests.test_tool_config' has no class 'Missing'"),
    (entry("b", "collections.OrderedDict"), r"tools\[1\] \(collections.OrderedDict\): 'collections.OrderedDict' is not "
                                           r"a subclass of mt_env.tools.BaseTool"),
    (entry("b", "NoteTool"), r"tools\[1\] \(NoteTool\): class_name 'NoteTool' must be a dotted path"),
    ({"class_name": "tests.test_tool_config.NoteTool"}, r"tools\[1\] \(tests.test_tool_config.NoteTool\): "
                                                         "tool_schema is missing, and NoteTool has no built-in schema"),
    ({**entry("b"), "tool_scheme": {}}, r"tools\[1\] .*unknown key\(s\) \['tool_scheme'\]"),
    ({**entry("b"), "class_name": None}, r"tools\[1\]: class_name must be a dotted path"),
    ({**entry("b"), "config": [1]}, r"tools\[1\] .*config must be a mapping"),
    (entry("b", type="mcp"), r"tools\[1\] .*config.type 'mcp' is not supported"),
    (entry("b", timeout=-1), r"tools\[1\] \(tests.test_tool_config.NoteTool\): tool 'b': config.timeout must be"),
    ({**entry("b"), "tool_schema": {"type": "function", "function": {"name": "b", "parameters": {"type": 5}}}},
     r"tools\[1\] \(tests.test_tool_config.NoteTool\): tool 'b': parameters is not a valid JSON schema"),
    ({**entry("b"), "tool_schema": {"function": {"name": "b"}}}, r"tools\[1\] .*tool_schema.type must be 'function'"),
    ("tests.test_tool_config.NoteTool", r"tools\[1\]: each entry must be a mapping"),
])
def test_config_errors_name_the_entry(bad_entry, message):
    with pytest.raises(ToolConfigError, match=message):
        load_tools({"tools": [entry("a"), bad_entry]})


def test_duplicate_tool_names_name_both_entries():
    with pytest.raises(ToolConfigError, match=r"tools\[2\] .*duplicate tool name 'a' \(also used by .*tools\[0\]"):
        load_tools({"tools": [entry("a"), entry("b"), entry("a")]})


@pytest.mark.parametrize("text, message", [
    ("tools: [\n  - {class_name: x", "not valid YAML"),
    ("- class_name: x", "expected a mapping with a 'tools' list"),
    ("tool: []", "expected a mapping with a 'tools' list"),
    ("tools: {class_name: x}", "'tools' must be a list"),
])
def test_bad_yaml_files(tmp_path, text, message):
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    with pytest.raises(ToolConfigError, match=message):
        load_tools(path)


def test_missing_file(tmp_path):
    with pytest.raises(ToolConfigError, match="cannot read tool config"):
        load_tools(tmp_path / "nope.yaml")


def test_yaml_is_loaded_safely(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools: !!python/object/apply:os.system ['echo unsafe']")
    with pytest.raises(ToolConfigError, match="not valid YAML"):
        load_tools(path)


# ------------------------------------------------------------------------------------------------ per-sample tools
TOOLS = load_tools({"tools": [entry("search"), entry("calculator_x"), entry("note"), entry("python")]})
NAMES = [t.name for t in TOOLS]


def test_no_selection_means_all_tools_in_config_order():
    episode = select_tools(TOOLS, {"prompt": "hi"})
    assert episode.names == NAMES and episode.tools_kwargs == {} and episode.sample_id is None


def test_selection_keeps_config_order_and_drops_unselected_kwargs():
    row = {"sample_id": "gsm8k-7", "tools": ["python", "search"],
           "tools_kwargs": {"search": {"create_kwargs": {"index": "wiki"}}, "note": {"execute_kwargs": {"x": 1}}}}
    episode = select_tools(TOOLS, row)
    assert episode.names == ["search", "python"] and episode.sample_id == "gsm8k-7"
    assert episode.tools_kwargs == {"search": {"create_kwargs": {"index": "wiki"}, "execute_kwargs": {},
                                               "calc_reward_kwargs": {}, "release_kwargs": {}}}
    assert select_tools(TOOLS, {"tools": []}).tools == []


def test_verl_extra_info_shape():
    row = {"prompt": [], "extra_info": {"index": 3, "sample_id": 3, "tools_kwargs": {
        "calculator_x": {"create_kwargs": {"ground_truth": "72"}, "calc_reward_kwargs": {}}}}}
    episode = select_tools(TOOLS, row)
    assert episode.names == NAMES and episode.sample_id == 3
    assert episode.tools_kwargs["calculator_x"]["create_kwargs"] == {"ground_truth": "72"}


@pytest.mark.parametrize("row, message", [
    ({"sample_id": 9, "tools": ["search", "web"]}, r"sample 9: 'tools' names unknown tool\(s\) \['web'\]"),
    ({"tools": "search"}, "'tools' must be a list of tool names"),
    ({"sample_id": "a", "tools_kwargs": {"web": {}}}, r"sample 'a': tools_kwargs names unknown tool\(s\) \['web'\]"),
    ({"tools_kwargs": {"search": {"create": {}}}}, r"unknown key\(s\) \['create'\]"),
    ({"tools": ["search"], "extra_info": {"tools": ["note"]}}, "both at the top level and in extra_info"),
])
def test_bad_rows(row, message):
    with pytest.raises(ToolConfigError, match=message):
        select_tools(TOOLS, row)


SELECTIONS = [list(p) for k in range(1, 4) for p in itertools.permutations(["note", "python", "search"], k)]


@pytest.mark.parametrize("selection", SELECTIONS, ids="-".join)
def test_the_prompt_renders_exactly_the_selected_schemas_in_config_order(qwen25, llama31, selection):
    episode = select_tools(TOOLS, {"tools": selection})
    expected = [t.tool_schema for t in TOOLS if t.name in selection]
    assert episode.schemas == expected and ToolBox(episode.tools).schemas == expected
    messages = [{"role": "user", "content": "hi"}]
    qwen_prompt = ChatFormat(qwen25, tools=episode.schemas).render(messages, add_generation_prompt=True)
    qwen_block = qwen_prompt.split("<tools>")[-1].split("</tools>", 1)[0]  # the last <tools> opens the list
    assert [json.loads(line) for line in qwen_block.strip().splitlines()] == expected
    llama_prompt = ChatFormat(llama31, tools=episode.schemas).render(messages, add_generation_prompt=True)
    assert "".join(json.dumps(s, indent=4, ensure_ascii=False) + "\n\n" for s in expected) in llama_prompt
    assert isinstance(episode, EpisodeTools)
