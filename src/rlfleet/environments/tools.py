"""Tools a model may call: a ``calculator`` and a ``python`` sandbox, their schemas, and the calls' parser.

Schemas are in the OpenAI / transformers function format (``{"type": "function", "function": {"name",
"description", "parameters"}}``), what ``tokenizer.apply_chat_template(messages, tools=tool_schemas(...))``
renders into the model's own tool prompt. Calls are parsed in the Qwen / Hermes format those templates
teach::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}
    </tool_call>

(``"parameters"`` is accepted for ``"arguments"``, as Llama 3 writes it, and so are arguments given as a JSON
string, as the OpenAI API does). :func:`parse_tool_calls` never raises: malformed JSON, an unknown tool,
missing, unexpected or mistyped arguments, a tag never closed or closed without being opened each give a
:class:`ToolCallError` whose :attr:`~ToolCallError.observation` tells the model what was wrong and the format
expected; one bad call rejects the whole message. :func:`call_tool` runs a parsed call and returns the text
to show the model; a tool that raises gives an error observation too.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.environments.sandbox import SandboxLimits, run_python

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "CalculatorError",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "calculate",
    "calculator",
    "calculator_tool",
    "call_tool",
    "default_tools",
    "parse_tool_calls",
    "python_tool",
    "tool_schemas",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
CALL_FORMAT = '<tool_call>{"name": "<tool name>", "arguments": {<argument>: <value>, ...}}</tool_call>'

# --- calculator ---------------------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 10_000  # |exponent| of **
MAX_DIGITS = 100  # |any intermediate result| < 10**100


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_INT = 10**MAX_DIGITS


def _bounded(value: object) -> int | float:
    if not isinstance(value, int | float):  # a complex power: (-8) ** 0.5
        raise CalculatorError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if abs(value) >= _MAX_INT:
        raise CalculatorError(f"a result is too large (the calculator stays below 10**{MAX_DIGITS})")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"the exponent {exponent} is too large (at most {MAX_EXPONENT} in magnitude)")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) >= MAX_DIGITS:
        raise CalculatorError(f"a result is too large (the calculator stays below 10**{MAX_DIGITS})")
    try:
        return _bounded(base**exponent)
    except ZeroDivisionError as exc:
        raise CalculatorError("0 cannot be raised to a negative power") from exc
    except OverflowError as exc:
        raise CalculatorError("a result is too large") from exc


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"{node.value!r} is not a number")
        value: int | float = node.value
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        if type(node.op) in _BINARY:
            try:
                return _bounded(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError as exc:
                raise CalculatorError("division by zero") from exc
            except OverflowError as exc:
                raise CalculatorError("a result is too large") from exc
        if isinstance(node.op, ast.BitXor):
            raise CalculatorError("'^' is not a power here: write ** (2 ** 10)")
        raise CalculatorError(f"unsupported operator {type(node.op).__name__}: + - * / // % ** only")
    if isinstance(node, ast.Name):
        raise CalculatorError(f"unknown name {node.id!r}: the calculator takes numbers only")
    if isinstance(node, ast.Call):
        raise CalculatorError("function calls are not supported: numbers and + - * / // % ** ( ) only")
    raise CalculatorError(f"unsupported syntax ({type(node).__name__}): numbers and + - * / // % ** ( ) only")


def calculate(expression: str) -> int | float:
    """The value of an arithmetic ``expression`` (numbers, ``+ - * / // % **``, parentheses), evaluated on
    its syntax tree (never ``eval``) with bounds on exponents and magnitudes.

    Raises :class:`CalculatorError` for anything else, or a result out of bounds."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression ({exc.msg})") from exc
    except (RecursionError, MemoryError, ValueError) as exc:
        raise CalculatorError("the expression is nested too deeply") from exc
    try:
        return _evaluate(tree)
    except RecursionError as exc:
        raise CalculatorError("the expression is nested too deeply") from exc


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers combined with + - * / // % ** and parentheses, e.g. "(17 + 5) * 3 ** 2"
    """
    try:
        value = calculate(expression)
    except CalculatorError as exc:
        return f"error: {exc}"
    return str(value) if isinstance(value, int) else format(value, ".15g")


# --- tools --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, description, JSON-schema parameters, and implementation
    (keyword arguments as the schema names them; returns the text the model sees)."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    function: Callable[..., str] = field(repr=False)

    def schema(self) -> dict[str, Any]:
        """The OpenAI / transformers function schema (``apply_chat_template(tools=[...])``)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


def _string_parameter(name: str, description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {name: {"type": "string", "description": description}},
        "required": [name],
    }


def calculator_tool() -> Tool:
    return Tool(
        name="calculator",
        description="Evaluate an arithmetic expression.",
        parameters=_string_parameter(
            "expression", 'numbers combined with + - * / // % ** and parentheses, e.g. "(17 + 5) * 3 ** 2"'
        ),
        function=calculator,
    )


def python_tool(limits: SandboxLimits | None = None) -> Tool:
    """Runs the code in the sandbox (:func:`~rlfleet.environments.sandbox.run_python`) under ``limits``."""

    def python(code: str) -> str:
        return run_python(code, limits).observation

    return Tool(
        name="python",
        description=(
            "Run a Python 3 program in a sandbox and return its exit status, stdout and stderr. Only the "
            "standard library is available; there is no network, no file outside a fresh working directory, "
            "and limits on CPU time, memory and output. Print what you want to see."
        ),
        parameters=_string_parameter("code", "the complete program to run"),
        function=python,
    )


def default_tools(limits: SandboxLimits | None = None) -> list[Tool]:
    """The calculator and the Python sandbox (under ``limits``)."""
    return [calculator_tool(), python_tool(limits)]


def tool_schemas(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The ``tools=`` argument of ``apply_chat_template``."""
    return [tool.schema() for tool in tools]


# --- calls --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    """A message whose tool calls cannot be run; ``observation`` is what to tell the model."""

    message: str

    @property
    def observation(self) -> str:
        return f"error: {self.message}. Call a tool as {CALL_FORMAT}, one per block."


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def _describe(value: Any) -> str:
    for name, types in (("boolean", (bool,)), *_JSON_TYPES.items(), ("null", (type(None),))):
        if isinstance(value, types):
            return name
    return type(value).__name__


def _check_arguments(tool: Tool, arguments: dict[str, Any]) -> str | None:
    properties: Mapping[str, Any] = tool.parameters.get("properties", {})
    required = list(tool.parameters.get("required", []))
    missing = [name for name in required if name not in arguments]
    if missing:
        return (
            f"missing argument {', '.join(map(repr, missing))} ({tool.name} takes: {', '.join(properties)})"
        )
    extra = [name for name in arguments if name not in properties]
    if extra:
        return (
            f"unexpected argument {', '.join(map(repr, extra))} ({tool.name} takes: {', '.join(properties)})"
        )
    for name, value in arguments.items():
        expected = properties[name].get("type")
        types = _JSON_TYPES.get(expected) if isinstance(expected, str) else None
        wrong_bool = isinstance(value, bool) and expected in ("integer", "number")
        if types is not None and (not isinstance(value, types) or wrong_bool):
            return f"argument {name!r} must be a {expected}, got a {_describe(value)}"
    return None


def _strip_fence(body: str) -> str:
    body = body.strip()
    if body.startswith("```") and body.endswith("```") and len(body) >= 6:
        body = body[3:-3]
        body = body[4:] if body.startswith("json") else body
    return body.strip()


def _parse_one(body: str, number: int, tools: Mapping[str, Tool]) -> ToolCall | ToolCallError:
    where = f"tool call {number}"
    text = _strip_fence(body)
    if not text:
        return ToolCallError(f"{where} is empty")
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as exc:
        return ToolCallError(f"{where} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})")
    except RecursionError:
        return ToolCallError(f"{where} is nested too deeply")
    return _check_call(payload, number, tools)


def _check_call(payload: Any, number: int, tools: Mapping[str, Tool]) -> ToolCall | ToolCallError:
    where = f"tool call {number}"
    if not isinstance(payload, dict):
        return ToolCallError(
            f'{where} must be a JSON object with "name" and "arguments", got a {_describe(payload)}'
        )
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(f'{where} has no "name" (a string naming the tool)')
    if name not in tools:
        return ToolCallError(f"{where}: unknown tool {name!r} (available: {', '.join(tools)})")
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # the OpenAI API's form: the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCallError(f'{where} ({name}): "arguments" is a string but not JSON ({exc.msg})')
    if not isinstance(arguments, dict):
        return ToolCallError(
            f'{where} ({name}): "arguments" must be a JSON object, got a {_describe(arguments)}'
        )
    problem = _check_arguments(tools[name], arguments)
    if problem is not None:
        return ToolCallError(f"{where} ({name}): {problem}")
    return ToolCall(name=name, arguments=arguments)


def parse_tool_calls(text: str, tools: Sequence[Tool] | None = None) -> list[ToolCall] | ToolCallError:
    """The tool calls in a model's message, checked against ``tools`` (default: :func:`default_tools`);
    ``[]`` when it calls none. Never raises: any problem is a :class:`ToolCallError`.

    After ``<tool_call>`` the JSON object is read first, so tags inside its strings (code that prints
    ``</tool_call>``) are data; a block that is not JSON up to ``</tool_call>`` is then diagnosed. A
    generation stopped at ``</tool_call>`` without including it leaves the tag unclosed: append it back."""
    by_name = {tool.name: tool for tool in (default_tools() if tools is None else tools)}
    calls: list[ToolCall] = []
    position = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, position)
        close = text.find(TOOL_CALL_CLOSE, position)
        if close != -1 and (start == -1 or close < start):
            return ToolCallError(f"{TOOL_CALL_CLOSE} without a {TOOL_CALL_OPEN} before it")
        if start == -1:
            return calls
        number = len(calls) + 1
        body_start = start + len(TOOL_CALL_OPEN)
        parsed, position = _read_call(text, body_start, number, by_name)
        if isinstance(parsed, ToolCallError):
            return parsed
        calls.append(parsed)


_DECODER = json.JSONDecoder()


def _read_call(
    text: str, body_start: int, number: int, tools: Mapping[str, Tool]
) -> tuple[ToolCall | ToolCallError, int]:
    """The call whose body starts at ``body_start``, and the position after its ``</tool_call>``."""
    begin = len(text) - len(text[body_start:].lstrip())
    try:
        payload, end = _DECODER.raw_decode(text, begin)
    except (json.JSONDecodeError, RecursionError):
        payload, end = None, -1
    if end != -1:  # a JSON value: </tool_call> must follow it
        after = len(text) - len(text[end:].lstrip())
        if text.startswith(TOOL_CALL_CLOSE, after):
            return _check_call(payload, number, tools), after + len(TOOL_CALL_CLOSE)
        if TOOL_CALL_CLOSE in text[after:]:
            extra = text[after : after + 20]
            error = ToolCallError(f"tool call {number}: unexpected text {extra!r} after its JSON object")
            return error, len(text)
        return _unclosed(number), len(text)
    close = text.find(TOOL_CALL_CLOSE, body_start)
    if close == -1:
        return _unclosed(number), len(text)
    body = text[body_start:close]
    if TOOL_CALL_OPEN in body:
        return ToolCallError(
            f"tool call {number}: {TOOL_CALL_OPEN} opened again before {TOOL_CALL_CLOSE}"
        ), close
    return _parse_one(body, number, tools), close + len(TOOL_CALL_CLOSE)


def _unclosed(number: int) -> ToolCallError:
    return ToolCallError(f"tool call {number}: {TOOL_CALL_OPEN} is never closed with {TOOL_CALL_CLOSE}")


def call_tool(call: ToolCall, tools: Sequence[Tool]) -> str:
    """Runs ``call`` with the matching tool; the text to show the model (an ``error: ...`` line when the call
    does not fit the tools or the tool fails)."""
    by_name = {tool.name: tool for tool in tools}
    tool = by_name.get(call.name)
    if tool is None:
        return ToolCallError(f"unknown tool {call.name!r} (available: {', '.join(by_name)})").observation
    problem = _check_arguments(tool, call.arguments)
    if problem is not None:
        return ToolCallError(f"{call.name}: {problem}").observation
    try:
        return tool.function(**call.arguments)
    except Exception as exc:  # a tool's own failure is an observation, not a crash of the rollout
        return f"error: the tool {call.name} failed: {type(exc).__name__}: {exc}"
