"""The calculator: exact arithmetic, clear refusals, bounded work, and nothing but arithmetic ever runs."""

from __future__ import annotations

import asyncio
import re
import tracemalloc
import warnings
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mt_env.calculator import CALCULATOR_SCHEMA, CalculatorTool, calculate, format_number
from mt_env.errors import CalculatorError, ToolConfigError
from mt_env.parsers import ToolCall
from mt_env.tools import ToolBox


@pytest.mark.parametrize("expression, expected", [
    ("1 + 2", "3"),
    ("(2 + 3) * 4", "20"),
    ("-3 + 5", "2"),
    ("--3", "3"),
    ("+4", "4"),
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("7 % 3", "1"),
    ("2 ** 10", "1024"),
    ("2 ** 3 ** 2", "512"),
    ("2 ** -2", "0.25"),
    ("10 / 4", "2.5"),
    ("1 / 3", "0.333333"),
    ("2 / 3", "0.666667"),
    ("-1 / 3", "-0.333333"),
    ("0.1 + 0.2", "0.3"),
    ("0.1 * 3 - 0.3", "0"),  # exact: floats would leave 5.55e-17
    ("12345678901234567890 + 1", "12345678901234567891"),
    ("123456789 * 987654321", "121932631112635269"),
    ("10 ** 99", "1" + "0" * 99),
    ("1e3 + 1_000", "2000"),
    ("4 ** 0.5", "2"),
    ("2 ** 0.5", "1.414214"),
    ("1 / 2000000", "5e-07"),
    ("0.999 ** 10000", "0.000045"),  # too costly to compute exactly: in floating point
    ("1.000001 ** 10000", "1.01005"),
    ("0.5 ** 10000", "0"),  # 5e-3011 underflows, like 0.1 ** 400: tiny, not "too large"
    ("(10**99)**0.5 * (10**99)**0.5", "1e+99"),  # a float: 15 significant digits, not the digits of its noise
    ("2 ** 0.5 * 10 ** 20", "1.4142135623731e+20"),
    ("(10 ** 14) ** 0.5 * 3", "30000000"),
    ("3 × 4 ÷ 2 − 1", "5"),
    ("  (1)  ", "1"),
])
def test_arithmetic(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("5 // 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2 +", "could not parse '2 +'"),
    ("(1 + 2", "could not parse"),
    ("", "the expression is empty"),
    ("x + 1", "unknown name 'x'"),
    ("2 ^ 3", "write powers with **"),
    ("1,000 + 1", "commas are not allowed"),
    ("abs(-1)", "unsupported expression 'abs(-1)'"),
    ("1 < 2", "unsupported expression"),
    ("'a' * 3", "is not a number"),
    ("True + 1", "is not a number"),
    ("2j", "is not a number"),
    ("[1] * 3", "unsupported expression"),
    ("(-8) ** (1 / 3)", "not a real number"),
    ("2 ** 100000", "the exponent 100000 is too large"),
    ("9 ** 9 ** 9", "is too large"),
    ("10 ** 100", "the result is too large"),
    ("9" * 101, "the result is too large"),
    ("1e999", "out of range"),
    ("1e-999999999", "out of range"),
    ("1" + "+1" * 300, "the limit is 500"),
])
def test_refusals_are_clear(expression, message):
    tracemalloc.start()
    try:
        with pytest.raises(CalculatorError, match=re.escape(message)):
            calculate(expression)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 200_000  # bytes: refused before any huge number (9 ** 9 ** 9, 1e-999999999) is built


@pytest.mark.parametrize("expression", ["1or 2", "1if 1else 2", "0x1for", "'\\d'", "3in 4"])
def test_parsing_never_prints_warnings(expression):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CalculatorError):
            calculate(expression)
    assert [str(w.message) for w in caught] == []


def test_code_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    for expression in (f"__import__('pathlib').Path({str(marker)!r}).touch()",
                       f"open({str(marker)!r}, 'w')", "(lambda: 1)()", "[x for x in (1,)]"):
        with pytest.raises(CalculatorError, match="unsupported expression"):
            calculate(expression)
    assert not marker.exists()


@pytest.mark.parametrize("value, expected", [
    (Fraction(7, 1), "7"), (2.0, "2"), (-0.5, "-0.5"), (Fraction(-1, 3), "-0.333333"), (Fraction(1, 8), "0.125"),
    (1e-9, "1e-09"), (Fraction(999_999_999, 1_000_000_000), "1"), (Fraction(-1, 10**9), "-1e-09"),
    (0.1 + 0.2, "0.3"), (1e16 + 2.0, "1e+16"), (-3.0000000000000004e30, "-3e+30"),
    (123456789012345.0, "123456789012345"),
])
def test_number_formatting(value, expected):
    assert format_number(value) == expected


ints = st.integers(-10**12, 10**12)


@given(ints, ints)
def test_integer_arithmetic_is_exact(a, b):
    assert calculate(f"{a} + {b}") == str(a + b)
    assert calculate(f"{a} * ({b})") == str(a * b)
    if b:
        assert calculate(f"{a} / ({b})") == format_number(Fraction(a, b))
        assert calculate(f"{a} // ({b})") == str(a // b)
        assert calculate(f"{a} % ({b})") == str(a % b)


@given(st.text(st.sampled_from("0123456789+-*/%().e_ ×^,x"), max_size=60))
def test_random_input_is_a_number_or_a_calculator_error(expression):
    try:
        result = calculate(expression)
    except CalculatorError as e:
        assert str(e)
    else:
        assert result and " " not in result


# ------------------------------------------------------------------------------------------------ the tool
def run_calls(calls, tool=None):
    async def episode():
        async with ToolBox([tool or CalculatorTool()]) as box:
            await box.create_all()
            return await box.execute_many(calls)

    return asyncio.run(episode())


def test_calculator_tool_answers_and_explains_its_refusals():
    ok, zero, syntax, missing = run_calls([
        ToolCall("calculator", {"expression": "(12 + 30) * 3 / 4"}),
        ToolCall("calculator", {"expression": "1 / (2 - 2)"}),
        ToolCall("calculator", {"expression": "2 +* 3"}),
        ToolCall("calculator", {"expr": "1 + 1"}),
    ])
    assert ok.ok and ok.text == "31.5" and ok.reward == 0.0
    assert zero.error_kind == "exception" and zero.text == "Error: division by zero"
    assert syntax.error_kind == "exception" and syntax.text.startswith("Error: could not parse '2 +* 3'")
    assert missing.error_kind == "invalid_arguments" and "'expression' is a required property" in missing.text


def test_calculator_tool_schema_and_settings():
    tool = CalculatorTool({"timeout": 1})
    assert tool.name == "calculator" and tool.tool_schema == CALCULATOR_SCHEMA and tool.settings.timeout == 1
    renamed = {**CALCULATOR_SCHEMA, "function": {**CALCULATOR_SCHEMA["function"], "name": "calc"}}
    assert CalculatorTool(tool_schema=renamed).name == "calc"
    no_expression = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
    with pytest.raises(ToolConfigError, match="needs an 'expression' property"):
        CalculatorTool(tool_schema=no_expression)
