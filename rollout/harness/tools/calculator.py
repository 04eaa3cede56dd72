"""Safe arithmetic: an expression parsed with ast and walked node by node; numbers, + - * / // %
** and parentheses, nothing else (no names, calls or attributes, so nothing to escape through).

Sizes are bounded before they are computed: the expression's length, and every intermediate
integer's digits (a power's result is estimated from its operands first, so 9**9**9 is refused
instead of hanging the process).
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from rollout.harness.tools.base import Tool, ToolContext, ToolError

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str, *, max_chars: int = 200, max_digits: int = 100) -> int | float:
    """The value of an arithmetic expression; ToolError saying why it cannot be computed."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("give an arithmetic expression, e.g. '12 * (3 + 4)'")
    if len(expression) > max_chars:
        raise ToolError(f"the expression is {len(expression)} characters, more than {max_chars}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"{expression!r} is not an arithmetic expression") from None
    return _Walker(max_digits).walk(tree.body)


class _Walker:
    def __init__(self, max_digits: int):
        self.max_digits = max_digits

    def walk(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ToolError(f"{value!r} is not a number")
            return self._bounded(value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self.walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.walk(node.left), self.walk(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            try:
                return self._bounded(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("the result is too large") from None
        raise ToolError(
            f"only numbers, + - * / // % ** and parentheses are allowed, not {_describe(node)}"
        )

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        if isinstance(exponent, float) or exponent < 0 or base in (0, 1, -1):
            return  # a float power overflows (caught) or stays small; these never grow
        digits = exponent * math.log10(abs(base)) if base else 0
        if digits > self.max_digits:
            raise ToolError(
                f"{base} ** {exponent} has about {int(digits)} digits, more than {self.max_digits}"
            )

    def _bounded(self, value: Any) -> int | float:
        if isinstance(value, complex):
            raise ToolError("the result is not a real number")
        # bit_length first: str() of a huge integer is the slow thing this guards against
        if (
            isinstance(value, int)
            and value.bit_length() > self.max_digits * 3.32
            and len(str(abs(value))) > self.max_digits
        ):
            raise ToolError(f"the result has more than {self.max_digits} digits")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("the result is too large")
        return value


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Call):
        return "a function call"
    return f"{type(node).__name__.lower()} syntax"


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.12g}"
    return str(value)


def calculator(*, max_chars: int = 200, max_digits: int = 100) -> Tool:
    """The built-in `calculator` tool."""
    if max_chars < 1 or max_digits < 1:
        raise ValueError("calculator: max_chars and max_digits must be at least 1")

    def run(arguments: dict[str, Any], context: ToolContext) -> str:
        value = evaluate(arguments["expression"], max_chars=max_chars, max_digits=max_digits)
        return format_number(value)

    return Tool(
        "calculator",
        "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "e.g. '123 * (45 + 6)'"}
            },
            "required": ["expression"],
            "additionalProperties": False,
        },
        run,
        example={"expression": "12 * 34"},
    )
