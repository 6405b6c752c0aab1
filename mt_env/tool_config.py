"""Tool configuration: verl-shaped YAML (or the same structure as a dict) -> tool objects, and the per-sample
selection of an episode's tools and their kwargs from a dataset row.

The YAML shape, as in verl::

    tools:
      - class_name: mt_env.calculator.CalculatorTool
        config: {timeout: 5, max_concurrency: 32}
        tool_schema:
          type: function
          function:
            name: calculator
            description: Evaluate an arithmetic expression.
            parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}

verl's own class names are mapped to mt_env's classes through `TOOL_CLASS_ALIASES`. As in verl's registry, an entry
may leave out ``tool_schema`` when its class has a built-in one (its constructor's ``tool_schema`` is optional, as
for ``CalculatorTool`` and the GSM8K tool).
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ToolConfigError
from .tools import BaseTool, normalize_tools_kwargs

#: verl class path -> mt_env class path. Extend it when an mt_env class can stand in for a verl one.
TOOL_CLASS_ALIASES: dict[str, str] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "envs.gsm8k.tool.Gsm8kTool",
}

_ENTRY_KEYS = ("class_name", "config", "tool_schema")


def load_tools(source: str | os.PathLike | Mapping[str, Any]) -> list[BaseTool]:
    """Tool objects from a YAML file path, or from the same structure as a dict (``{"tools": [...]}``), in
    config order. Any problem raises `ToolConfigError` naming the entry (index and class_name)."""
    if isinstance(source, Mapping):
        data, origin = source, "tool config"
    else:
        path = Path(source)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ToolConfigError(f"cannot read tool config {str(path)!r}: {e}") from e
        except yaml.YAMLError as e:
            raise ToolConfigError(f"tool config {str(path)!r} is not valid YAML: {e}") from e
        origin = str(path)
    if not isinstance(data, Mapping) or "tools" not in data:
        raise ToolConfigError(f"{origin}: expected a mapping with a 'tools' list at the top")
    entries = data["tools"] or []
    if not isinstance(entries, list):
        raise ToolConfigError(f"{origin}: 'tools' must be a list, got {type(entries).__name__}")

    tools: list[BaseTool] = []
    seen: dict[str, str] = {}
    for index, entry in enumerate(entries):
        where = f"{origin}: tools[{index}]"
        if isinstance(entry, Mapping) and isinstance(entry.get("class_name"), str):
            where += f" ({entry['class_name']})"
        tool = _build_tool(entry, where)
        if tool.name in seen:
            raise ToolConfigError(f"{where}: duplicate tool name {tool.name!r} (also used by {seen[tool.name]})")
        seen[tool.name] = where
        tools.append(tool)
    return tools


def _build_tool(entry: Any, where: str) -> BaseTool:
    if not isinstance(entry, Mapping):
        raise ToolConfigError(f"{where}: each entry must be a mapping with {_ENTRY_KEYS}")
    unknown = [key for key in entry if key not in _ENTRY_KEYS]
    if unknown:
        raise ToolConfigError(f"{where}: unknown key(s) {unknown}; an entry has {_ENTRY_KEYS}")
    if not isinstance(entry.get("class_name"), str) or not entry["class_name"]:
        raise ToolConfigError(f"{where}: class_name must be a dotted path, e.g. 'mt_env.calculator.CalculatorTool'")
    config = entry.get("config") or {}
    if not isinstance(config, Mapping):
        raise ToolConfigError(f"{where}: config must be a mapping, got {type(config).__name__}")
    if config.get("type", "native") != "native":
        raise ToolConfigError(f"{where}: config.type {config['type']!r} is not supported (only native tools)")
    cls = resolve_tool_class(entry["class_name"], where)
    tool_schema = entry.get("tool_schema")
    if tool_schema is None and not _has_builtin_schema(cls):
        raise ToolConfigError(f"{where}: tool_schema is missing, and {cls.__name__} has no built-in schema to use")
    try:
        return cls(config=dict(config), tool_schema=tool_schema)
    except ToolConfigError as e:
        raise ToolConfigError(f"{where}: {e}") from None
    except Exception as e:
        raise ToolConfigError(f"{where}: constructing {cls.__name__} failed: {type(e).__name__}: {e}") from e


def _has_builtin_schema(cls: type[BaseTool]) -> bool:
    """Whether `cls` can be built without a schema: its constructor's ``tool_schema`` has a default (verl's registry
    passes ``tool_schema=None`` to such classes)."""
    parameter = inspect.signature(cls).parameters.get("tool_schema")
    return parameter is not None and parameter.default is not inspect.Parameter.empty


def resolve_tool_class(class_name: str, where: str = "tool config") -> type[BaseTool]:
    """The `BaseTool` subclass at dotted path `class_name`, through `TOOL_CLASS_ALIASES`."""
    target = TOOL_CLASS_ALIASES.get(class_name, class_name)
    alias = f" (alias of {target!r})" if target != class_name else ""
    module_name, _, attr = target.rpartition(".")
    if not module_name:
        raise ToolConfigError(f"{where}: class_name {class_name!r} must be a dotted path 'package.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ToolConfigError(f"{where}: cannot import module {module_name!r}{alias}: {e}") from e
    cls = getattr(module, attr, None)
    if cls is None:
        raise ToolConfigError(f"{where}: module {module_name!r} has no class {attr!r}{alias}")
    if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
        raise ToolConfigError(f"{where}: {target!r} is not a subclass of mt_env.tools.BaseTool")
    return cls


# ---------------------------------------------------------------------------------------------- per-sample tools
@dataclass
class EpisodeTools:
    """The tools one dataset row selects, in config order, with their kwargs (``{tool: {create_kwargs, ...}}``).
    `schemas` is exactly the list the prompt must render (pass it to `ChatFormat(tools=...)`)."""

    tools: list[BaseTool]
    tools_kwargs: dict[str, dict[str, dict]] = field(default_factory=dict)
    sample_id: Any = None

    @property
    def schemas(self) -> list[dict]:
        return [tool.tool_schema for tool in self.tools]

    @property
    def names(self) -> list[str]:
        return [tool.name for tool in self.tools]


def select_tools(tools: Sequence[BaseTool], row: Mapping[str, Any]) -> EpisodeTools:
    """The episode's tools for dataset `row`.

    The row may carry, at its top level or under ``extra_info`` (verl's place): ``sample_id``; ``tools``, a list
    of tool names (absent or None: all configured tools); and ``tools_kwargs``, ``{tool name: {create_kwargs,
    execute_kwargs, calc_reward_kwargs, release_kwargs}}``. The selected tools keep the config's order whatever the
    row's order; kwargs of configured tools that the row does not select are dropped. Unknown names, in ``tools``
    or in ``tools_kwargs``, raise `ToolConfigError` naming the sample.
    """
    sample_id = _row_field(row, "sample_id", None)
    where = f"sample {sample_id!r}" if sample_id is not None else "dataset row"
    configured = [tool.name for tool in tools]
    selection = _row_field(row, "tools", where)
    if selection is None:
        chosen = list(tools)
    else:
        if isinstance(selection, str) or not isinstance(selection, Sequence):
            raise ToolConfigError(f"{where}: 'tools' must be a list of tool names, got {type(selection).__name__}")
        unknown = [name for name in selection if name not in configured]
        if unknown:
            raise ToolConfigError(f"{where}: 'tools' names unknown tool(s) {unknown}; configured tools: {configured}")
        chosen = [tool for tool in tools if tool.name in set(selection)]
    kwargs = normalize_tools_kwargs(_row_field(row, "tools_kwargs", where), configured, where=f"{where}: tools_kwargs")
    chosen_names = {tool.name for tool in chosen}
    return EpisodeTools(chosen, {name: kw for name, kw in kwargs.items() if name in chosen_names}, sample_id)


def _row_field(row: Mapping[str, Any], key: str, where: str | None) -> Any:
    """`row[key]`, or `row["extra_info"][key]`; both present and different is an error."""
    extra = row.get("extra_info") or {}
    top, nested = row.get(key), extra.get(key) if isinstance(extra, Mapping) else None
    if top is not None and nested is not None and top != nested:
        raise ToolConfigError(f"{where or 'dataset row'}: {key!r} is given both at the top level and in extra_info, "
                              "with different values")
    return top if top is not None else nested
