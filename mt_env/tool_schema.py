"""OpenAI function-tool schemas: checking a schema once, then validating call arguments against it with jsonschema.

Shared by the tools (which check their own schema at construction) and the parsers (which validate parsed calls
against the episode's schemas), so that both say the same thing about the same arguments.
"""

from __future__ import annotations

import copy
import itertools
import json
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, best_match

from .errors import ToolConfigError

#: Longest error message shown to the model: jsonschema repeats the offending value, which may be huge.
MAX_ERROR_CHARS = 300


def shorten(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` cut to `limit` characters with an ellipsis, for error messages quoting model output."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_tool_schema(tool_schema: Any, owner: str = "tool") -> dict:
    """A deep copy of `tool_schema` after checking it is ``{"type": "function", "function": {"name", "parameters"}}``
    with a valid JSON schema as ``parameters``; `ToolConfigError` naming `owner` otherwise."""
    if not isinstance(tool_schema, Mapping):
        raise ToolConfigError(f"{owner}: tool_schema must be a mapping, got {type(tool_schema).__name__}")
    if tool_schema.get("type") != "function":
        raise ToolConfigError(f"{owner}: tool_schema.type must be 'function', got {tool_schema.get('type')!r}")
    function = tool_schema.get("function")
    if not isinstance(function, Mapping):
        raise ToolConfigError(f"{owner}: tool_schema.function must be a mapping with name/description/parameters")
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolConfigError(f"{owner}: tool_schema.function.name must be a non-empty string, got {name!r}")
    description = function.get("description", "")
    if not isinstance(description, str):
        raise ToolConfigError(f"{owner} ({name!r}): tool_schema.function.description must be a string")
    parameters = function.get("parameters")
    if not isinstance(parameters, Mapping):
        raise ToolConfigError(
            f"{owner} ({name!r}): tool_schema.function.parameters must be a JSON schema object, "
            f"e.g. {{'type': 'object', 'properties': {{}}}}; got {type(parameters).__name__}"
        )
    try:
        Draft202012Validator.check_schema(parameters)
    except SchemaError as e:
        where = "/".join(map(str, e.path)) or "(root)"
        raise ToolConfigError(f"tool {name!r}: parameters is not a valid JSON schema at {where}: {e.message}") from None
    return copy.deepcopy(dict(tool_schema))


def schema_name(tool_schema: Mapping[str, Any]) -> str:
    return tool_schema["function"]["name"]


# Keywords whose meaning is the same in JSON Schema draft-07 (what fastjsonschema compiles) and 2020-12 (what
# jsonschema checks): schemas made only of these get the compiled fast path, the rest use jsonschema alone.
_PORTABLE_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "enum", "const", "description", "title", "default",
    "examples", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
    "maxLength", "pattern", "minItems", "maxItems", "uniqueItems", "minProperties", "maxProperties",
    "anyOf", "oneOf", "allOf", "not", "format",
})


def _portable(schema: Any) -> bool:
    if isinstance(schema, bool):
        return True
    if not isinstance(schema, Mapping) or not set(schema) <= _PORTABLE_KEYWORDS | {"items"}:
        return False
    if "items" in schema and not isinstance(schema["items"], (Mapping, bool)):
        return False  # 2020-12 dropped the array form of `items`
    subs = list((schema.get("properties") or {}).values())
    subs += [schema[k] for k in ("items", "additionalProperties", "not") if isinstance(schema.get(k), (Mapping, bool))]
    subs += [sub for k in ("anyOf", "oneOf", "allOf") for sub in schema.get(k, [])]
    return all(_portable(sub) for sub in subs)


class ArgumentsValidator:
    """jsonschema's 2020-12 validator, with `is_valid` answered by a compiled fastjsonschema check when the schema
    uses only keywords that mean the same in both drafts: every tool call is validated, and jsonschema's
    interpreter would be a large part of an env step. Error messages always come from jsonschema."""

    def __init__(self, schema: Mapping[str, Any]):
        self.schema = schema
        self.jsonschema = Draft202012Validator(schema)
        self._fast = None
        if _portable(schema):
            import fastjsonschema

            try:
                self._fast = fastjsonschema.compile({**schema, "$schema": "http://json-schema.org/draft-07/schema#"})
            except Exception:  # a schema fastjsonschema cannot compile: jsonschema alone
                self._fast = None

    def is_valid(self, instance: Any) -> bool:
        if self._fast is None:
            return self.jsonschema.is_valid(instance)
        try:
            self._fast(instance)
            return True
        except Exception:
            return False

    def iter_errors(self, instance: Any):
        return self.jsonschema.iter_errors(instance)


def arguments_validator(tool_schema: Mapping[str, Any]) -> ArgumentsValidator:
    """A validator for the arguments of calls to the (already checked) `tool_schema`: the one that the tools and
    parsers of the process's envs already use for the same parameters (built on a copy of them), or a new one. A
    few hundred envs would otherwise each compile their own, and each call run its own copy of the check's code."""
    parameters = tool_schema["function"]["parameters"]
    try:
        key = json.dumps(parameters, sort_keys=True)
    except (TypeError, ValueError):  # parameters that JSON cannot write: a validator of their own
        return ArgumentsValidator(copy.deepcopy(parameters))
    validator = _in_use.get(key)
    if validator is None:
        validator = _in_use[key] = ArgumentsValidator(copy.deepcopy(parameters))
    return validator


_in_use: weakref.WeakValueDictionary[str, ArgumentsValidator] = weakref.WeakValueDictionary()


def validators_by_name(tool_schemas: Sequence[Mapping[str, Any]]) -> dict[str, ArgumentsValidator]:
    """Checked schemas' validators keyed by tool name, for parsers given the episode's schemas."""
    out = {}
    for i, schema in enumerate(tool_schemas):
        schema = check_tool_schema(schema, owner=f"tools[{i}]")
        out[schema_name(schema)] = arguments_validator(schema)
    return out


def argument_error(validator: ArgumentsValidator, arguments: Any) -> str | None:
    """Why `arguments` do not fit the schema (a short message for the model), or None when they do."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {_json_type(arguments)}"
    if validator.is_valid(arguments):  # the common case, without building error objects
        return None
    # The first few errors are enough to explain; a huge array of bad items must not cost one error per item.
    error = best_match(itertools.islice(validator.iter_errors(arguments), 20))
    if error is None:
        return None
    message = error.message
    value = repr(error.instance)
    if len(value) > 80:  # the message quotes the offending value: keep its start and the reason after it
        message = message.replace(value, shorten(value, 60))
    where = "/".join(map(str, error.absolute_path))
    return shorten(f"{where}: {message}" if where else message)


def _json_type(value: Any) -> str:
    names = {str: "a string", bool: "a boolean", int: "a number", float: "a number", list: "an array"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
