"""Tool calls in generated text, and the tools that answer them.

Two call formats are understood:

- the JSON-in-tags form Qwen and Hermes models are trained on:
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>``;
- a compact form a tiny character-level model can learn: ``calc(12*7)``.

A tool's answer, or what went wrong (unknown tool, bad arguments, a timeout, a crash), goes back to
the model as the tool message's text — never as an exception in the episode.
"""

from __future__ import annotations

import ast
import json
import operator
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..sandbox import run_python

TAGGED = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
COMPACT = re.compile(r"calc\(([^()]*(?:\([^()]*\)[^()]*)*)\)")
MAX_EXPRESSION = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the call could not be read; this is the message the model gets


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every tool call in ``text``, in order (tagged JSON ones, else compact ``calc(...)`` ones)."""
    tagged = TAGGED.findall(text)
    if tagged:
        return [_tagged(body) for body in tagged]
    return [ToolCall("calculator", {"expression": expr}) for expr in COMPACT.findall(text)]


def first_call_span(text: str) -> tuple[int, int] | None:
    """(start, end) of the first tool call in ``text`` (None: there is none), found with the very
    patterns ``parse_tool_calls`` reads, so a turn cut at its end holds exactly that call."""
    spans = [match.span() for match in (TAGGED.search(text), COMPACT.search(text)) if match]
    return min(spans, key=lambda span: span[1]) if spans else None


def first_call_end(text: str) -> int | None:
    """Where the first tool call in ``text`` ends (None: there is none)."""
    span = first_call_span(text)
    return span[1] if span else None


def call_text(call: ToolCall) -> str:
    """``call`` written the way ``parse_tool_calls`` reads it back: the compact form for a calculator
    call (what the tiny model writes), the tagged JSON form for any other."""
    if call.name == "calculator" and set(call.arguments) == {"expression"}:
        return f"calc({call.arguments['expression']})"
    return "<tool_call>" + json.dumps({"name": call.name, "arguments": call.arguments}) + "</tool_call>"


def _tagged(body: str) -> ToolCall:
    try:
        data = json.loads(body)
    except ValueError:
        return ToolCall("", error="the tool call is not valid JSON")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall("", error='a tool call needs {"name": ..., "arguments": {...}}')
    arguments = data.get("arguments") or {}
    if isinstance(arguments, str):  # some models send the arguments JSON-encoded
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return ToolCall(data["name"], error="the arguments are not valid JSON")
    if not isinstance(arguments, dict):
        return ToolCall(data["name"], error="the arguments must be an object")
    return ToolCall(data["name"], arguments)


_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = _value(node.operand)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponents above {MAX_EXPONENT} are not supported")
        result = _OPS[type(node.op)](left, right)
        if abs(result) > MAX_MAGNITUDE:
            raise ValueError("the result is too large")
        return result
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


# CPython keeps ast.parse's recursion-depth counter per interpreter, not per thread: tool calls
# parsed at once in rollout threads could fail with "SystemError: AST constructor recursion depth
# mismatch" (seen in CI: a rollout failed and the trainer restarted; cpython gh-106905).
_PARSE_LOCK = threading.Lock()


def calculator(expression: str) -> str:
    """Arithmetic on numbers, evaluated from the syntax tree (no names, calls or attributes)."""
    if len(expression) > MAX_EXPRESSION:
        return f"error: the expression is longer than {MAX_EXPRESSION} characters"
    try:
        with _PARSE_LOCK:
            tree = ast.parse(expression.strip(), mode="eval")
        result = _value(tree.body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError, RecursionError) as err:
        return f"error: {err}" if not isinstance(err, SyntaxError) else "error: not an arithmetic expression"
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(round(result, 6) if isinstance(result, float) else result)


def python_tool(code: str) -> str:
    """Run ``code`` in the sandbox (:mod:`kuberl.sandbox`); its output, or what stopped it."""
    outcome = run_python(code)
    return outcome.output if outcome.ok else f"error: {outcome.output}"


TOOLS: dict[str, tuple[Callable[[str], str], str]] = {  # name → (function, its one argument)
    "calculator": (calculator, "expression"),
    "python": (python_tool, "code"),
}


def run_tool(call: ToolCall) -> str:
    """The tool message for ``call``: the tool's output or an error the model can read."""
    if call.error is not None:
        return f"error: {call.error}"
    if call.name not in TOOLS:
        return f"error: unknown tool {call.name[:40]!r}; tools: {', '.join(TOOLS)}"
    function, argument = TOOLS[call.name]
    value = call.arguments.get(argument)
    if not isinstance(value, str):
        return f"error: {call.name} needs a string argument {argument!r}"
    return function(value)
