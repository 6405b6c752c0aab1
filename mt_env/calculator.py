"""A safe calculator for the ``calculator(expression)`` tool: exact arithmetic on numbers, never ``eval``.

The expression is parsed with Python's `ast` module and only whitelisted nodes are evaluated: number literals,
``+ - * / // % **``, unary ``+``/``-`` and parentheses. Arithmetic is exact (`fractions.Fraction`) except for
fractional powers and powers too large to compute exactly, which are computed in floating point. Results print as
integers when they are whole and otherwise rounded to 6 decimals; floating-point results are first rounded to 15
significant digits, so that float noise never prints as digits. Caps on the expression length, the exponent and
the size of every intermediate result keep a hostile expression from eating time or memory; every refusal is a
`CalculatorError` with a message meant for the model.
"""

from __future__ import annotations

import ast
import math
import operator
import warnings
from collections.abc import Callable, Mapping
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from .errors import CalculatorError, ToolConfigError
from .tools import BaseTool

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 10_000
MAX_MAGNITUDE_DIGITS = 100  #: results must stay below 10**100 in absolute value
DECIMALS = 6  #: non-integer results are rounded to this many decimals

_MAX_MAGNITUDE = 10**MAX_MAGNITUDE_DIGITS
_MAX_POWER_BITS = 4096  # refuse to compute an exact power bigger than this (it would be refused afterwards anyway)
_TYPOGRAPHIC = str.maketrans({"×": "*", "÷": "/", "−": "-", "–": "-"})

Number = Fraction | float


def calculate(expression: str) -> str:
    """The value of `expression`, formatted for the model (e.g. ``"42"``, ``"0.333333"``)."""
    return format_number(evaluate(expression))


def evaluate(expression: str) -> Number:
    """The exact value of `expression` (a `Fraction`, or a float after a fractional power)."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    source = expression.translate(_TYPOGRAPHIC).strip()
    if not source:
        raise CalculatorError("the expression is empty")
    if len(source) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is {len(source)} characters long; the limit is {MAX_EXPRESSION_CHARS}")
    try:
        with warnings.catch_warnings():  # "invalid decimal literal" and the like would go to stderr (training logs)
            warnings.simplefilter("ignore")
            tree = ast.parse(source, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"could not parse {source!r}: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"could not parse {source!r}") from None
    try:
        return _evaluate(tree.body, source)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None
    except OverflowError:
        raise CalculatorError(f"the result is too large (the limit is 10^{MAX_MAGNITUDE_DIGITS})") from None


def format_number(value: Number, decimals: int = DECIMALS) -> str:
    """Whole numbers without ``.0``; others rounded to `decimals` places, trailing zeros dropped; tiny non-zero
    values in scientific notation rather than as a misleading 0. A float is first rounded to 15 significant digits
    (the ones it has), and one of 10^15 or more prints in scientific notation (``1e+99``), not as the digits of
    its binary approximation."""
    if isinstance(value, float):
        text = f"{value:.15g}"
        if "e" in text and abs(value) >= 1:
            return text
        value = Decimal(text)
    exact = Fraction(value)
    if exact.denominator == 1:
        return str(exact.numerator)
    scale = 10**decimals
    if abs(exact) * scale <= Fraction(1, 2):  # would round to 0
        return f"{float(exact):.{decimals}g}"
    scaled = round(exact * scale)
    whole, frac = divmod(abs(scaled), scale)
    digits = str(frac).rjust(decimals, "0").rstrip("0")
    sign = "-" if scaled < 0 else ""
    return f"{sign}{whole}.{digits}" if digits else f"{sign}{whole}"


def _evaluate(node: ast.AST, source: str) -> Number:
    if isinstance(node, ast.Constant):
        return _literal(node, source)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand, source)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left, source), _evaluate(node.right, source)
        return _checked(_OPERATORS[type(node.op)](left, right))
    raise CalculatorError(_unsupported(node, source))


def _literal(node: ast.Constant, source: str) -> Fraction:
    value = node.value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalculatorError(f"{ast.get_source_segment(source, node)!r} is not a number")
    if isinstance(value, int):
        return _checked(Fraction(value))
    # Read decimals from their text, so that 0.1 is exactly 1/10; the exponent is checked before it is expanded.
    text = (ast.get_source_segment(source, node) or repr(value)).replace("_", "")
    try:
        decimal = Decimal(text)
    except InvalidOperation:
        raise CalculatorError(f"{text!r} is not a number") from None
    if decimal and abs(decimal.adjusted()) > MAX_MAGNITUDE_DIGITS:
        raise CalculatorError(f"the number {text} is out of range (the limit is 10^{MAX_MAGNITUDE_DIGITS})")
    return _checked(Fraction(decimal))


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(exponent, Fraction) and exponent.denominator == 1:
        n = exponent.numerator
        if abs(n) > MAX_EXPONENT:
            raise CalculatorError(f"the exponent {n} is too large (the limit is {MAX_EXPONENT})")
        if isinstance(base, Fraction) and abs(base) not in (0, 1):
            bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
            if abs(n) * bits > _MAX_POWER_BITS:  # too costly exactly (0.999 ** 10000): in floating point, where a
                return float(base) ** n  # huge result overflows (refused) and a tiny one may round to 0
        return base**n
    if base < 0:
        raise CalculatorError("a negative number to a fractional power is not a real number")
    return float(base) ** float(exponent)


def _checked(value: Number) -> Number:
    """`value` if it is within the magnitude cap; exact values with huge denominators become floats."""
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) >= _MAX_MAGNITUDE:
            raise OverflowError
        return value
    if abs(value.numerator) >= _MAX_MAGNITUDE * value.denominator:
        raise OverflowError
    if value.denominator >= _MAX_MAGNITUDE:
        return float(value)
    return value


def _unsupported(node: ast.AST, source: str) -> str:
    text = ast.get_source_segment(source, node) or type(node).__name__
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        return "'^' is not supported: write powers with **"
    if isinstance(node, ast.Tuple):
        return "commas are not allowed: write 1000, not 1,000, and one expression per call"
    if isinstance(node, ast.Name):
        return f"unknown name {text!r}: only numbers, + - * / // % ** and parentheses are allowed"
    return f"unsupported expression {text!r}: only numbers, + - * / // % ** and parentheses are allowed"


_OPERATORS: dict[type, Callable[[Any, Any], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
}

CALCULATOR_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly. Supports numbers, + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "The expression, e.g. (12 + 30) * 3 / 4"},
            },
            "required": ["expression"],
        },
    },
}


class CalculatorTool(BaseTool):
    """``calculator(expression)``: the value of an arithmetic expression, or the reason it has none (a
    `CalculatorError`, which the runner shows the model as ``Error: ...``). Stateless; no reward of its own."""

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Mapping[str, Any] | None = None):
        super().__init__(config, tool_schema or CALCULATOR_SCHEMA)
        if "expression" not in self.tool_schema["function"]["parameters"].get("properties", {}):
            raise ToolConfigError(f"tool {self.name!r}: CalculatorTool's schema needs an 'expression' property")

    async def execute(self, instance_id: str, arguments: dict, **execute_kwargs: Any) -> tuple[str, float, dict]:
        return calculate(arguments["expression"]), 0.0, {}
