"""An example user tool for generate.multi_turn.tools (deployments/configs/tools-cpu.yaml): arithmetic on an
expression, the schema carried by the function's `tool_schema` attribute (OpenAI function format). It never
evals: the expression is parsed and only numbers, + - * / // % ** and parentheses are computed."""

from __future__ import annotations

import ast
import operator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The value of an arithmetic `expression`, as text."""
    return str(_value(ast.parse(expression, mode="eval").body))


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 1000:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)}")


calculate.tool_schema = {  # type: ignore[attr-defined]
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Compute an arithmetic expression (numbers, + - * / // % ** and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "For example (17 + 25) * 3."}},
            "required": ["expression"],
        },
    },
}
