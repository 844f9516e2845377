"""The calculator tool and answer scoring shared by the example agents."""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable
from typing import Any, Final

from schemas import FunctionSpec, ToolCall, ToolSpec

CALCULATOR: Final = ToolSpec(
    function=FunctionSpec(
        name="calculate",
        description="Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (17 + 4) * 3"}},
            "required": ["expression"],
        },
    )
)

_OPERATORS: Final[dict[type[ast.AST], Callable[..., Any]]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def evaluate(expression: str) -> float | int:
    """The value of an arithmetic expression; ValueError for anything else (names, calls, huge powers)."""

    def value(node: ast.AST) -> float | int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            if isinstance(node.value, bool):
                raise ValueError("not arithmetic: a boolean")
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPERATORS[type(node.op)](left, right)  # type: ignore[no-any-return]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))  # type: ignore[no-any-return]
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    try:
        return value(ast.parse(expression, mode="eval").body)
    except SyntaxError as error:
        raise ValueError(f"not an expression: {error.msg}") from None
    except ZeroDivisionError:
        raise ValueError("division by zero") from None


def run_calculator(call: ToolCall) -> str:
    """The tool's reply for one call: the value, or ``error: ...`` the model can read and correct."""
    if call.function.name != CALCULATOR.function.name:
        return f"error: unknown tool {call.function.name!r}; the only tool is 'calculate'"
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as error:
        return f'error: the arguments are not valid JSON ({error.msg}); send {{"expression": "..."}}'
    if not isinstance(arguments, dict) or not isinstance(arguments.get("expression"), str):
        return 'error: the arguments must be {"expression": "<arithmetic>"}'
    try:
        result = evaluate(arguments["expression"])
    except ValueError as error:
        return f"error: {error}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def score(text: str, answer: float) -> float:
    """1.0 when the last number in the text is the answer, else 0.0."""
    numbers = _NUMBER.findall(text)
    return 1.0 if numbers and abs(float(numbers[-1]) - float(answer)) < 1e-6 else 0.0
