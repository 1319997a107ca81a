"""The calculator, the tool schemas (rendered by a real ``apply_chat_template(tools=...)``) and the parser of
``<tool_call>`` blocks, which turns every malformed call into an observation instead of an exception."""

from __future__ import annotations

import json
import sys

import pytest

from rlfleet.environments.sandbox import SandboxLimits
from rlfleet.environments.tools import (
    CalculatorError,
    Tool,
    ToolCall,
    ToolCallError,
    calculate,
    calculator,
    calculator_tool,
    call_tool,
    default_tools,
    parse_tool_calls,
    python_tool,
    tool_schemas,
)
from rlfleet.models.tiny import train_tokenizer

# --- calculator ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("(17 + 5) * 3 ** 2", "198"),
        ("0.1 + 0.2", "0.3"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** -2", "0.25"),
        ("-(3 - 10)", "7"),
        ("1_000 * 3", "3000"),
        ("10 ** 99", "1" + "0" * 99),
        ("2 ** 0.5", "1.4142135623731"),
        (" 6*7 ", "42"),
    ],
)
def test_calculator_values(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "negative power"),
        ("10 ** 100", "too large"),
        ("10 ** 99 * 10", "too large"),
        ("9 ** 99999", "exponent 99999 is too large"),
        ("(10 ** 60) ** 2", "too large"),
        ("1e308 * 10", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("2 ^ 10", "write **"),
        ("x + 1", "unknown name 'x'"),
        ("__import__('os').system('true')", "function calls are not supported"),
        ("abs(-3)", "function calls are not supported"),
        ("(1).real", "unsupported syntax (Attribute)"),
        ("'a' * 3", "'a' is not a number"),
        ("True + 1", "True is not a number"),
        ("1j * 2", "1j is not a number"),
        ("1 << 3", "unsupported operator LShift"),
        ("[1, 2]", "unsupported syntax (List)"),
        ("", "not an arithmetic expression"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 1001, "longer than 1000 characters"),
        ("(" * 300 + "1" + ")" * 300, "not an arithmetic expression"),
        ("-" * 900 + "1", ""),  # deeply nested unary minus: a value or an error, never a crash
    ],
)
def test_calculator_refuses_with_a_reason(expression: str, message: str) -> None:
    result = calculator(expression)
    if expression.startswith("-" * 900):
        assert result in ("1", "-1") or result.startswith("error: ")
        return
    assert result.startswith("error: ") and message in result, result
    with pytest.raises(CalculatorError):
        calculate(expression)


def test_calculate_returns_numbers() -> None:
    assert calculate("2 ** 10") == 1024 and isinstance(calculate("2 ** 10"), int)
    assert calculate("1 / 4") == 0.25


# --- schemas ------------------------------------------------------------------------------------------------


def test_schemas_are_in_the_function_format() -> None:
    schemas = tool_schemas(default_tools())
    assert [s["function"]["name"] for s in schemas] == ["calculator", "python"]
    for schema in schemas:
        assert schema["type"] == "function"
        params = schema["function"]["parameters"]
        assert params["type"] == "object" and params["required"] == list(params["properties"])
        assert all(p["type"] == "string" and p["description"] for p in params["properties"].values())
        json.dumps(schema)  # serialisable as is


def test_the_calculator_schema_is_what_transformers_derives_from_the_function() -> None:
    from transformers.utils import get_json_schema

    derived = get_json_schema(calculator)
    assert derived["function"]["parameters"] == calculator_tool().schema()["function"]["parameters"]
    assert derived["function"]["name"] == "calculator"


# A Qwen2.5 / Hermes-style tool-aware template, trimmed: the tools as JSON lines in <tools>, the assistant's
# calls as <tool_call> JSON, tool results as <tool_response> in a user turn.
TOOL_TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call one or more functions. Function signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each call, return <tool_call>{"name": <function-name>, "arguments": <args-object>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
""".strip()


@pytest.fixture(scope="module")
def tool_tokenizer():  # type: ignore[no-untyped-def]
    corpus = ["What is 12 times 7? Let me compute that with a tool call."] * 20
    tokenizer = train_tokenizer(corpus, vocab_size=300)
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


CODE = 'print("a \\"quoted\\" <tool_call> b")\nprint(1)\n'


def test_apply_chat_template_renders_the_tools_and_the_calls_parse_back(tool_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tools = default_tools()
    calls = [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 7"}}},
        {"type": "function", "function": {"name": "python", "arguments": {"code": CODE}}},
    ]
    messages = [
        {"role": "user", "content": "What is 12 times 7?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "84"},
    ]
    rendered = tool_tokenizer.apply_chat_template(
        messages, tools=tool_schemas(tools), tokenize=False, add_generation_prompt=True
    )
    for schema in tool_schemas(tools):
        assert json.dumps(schema, ensure_ascii=False) in rendered
    assert "<tool_response>\n84\n</tool_response>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    assistant = rendered.split("<|im_start|>assistant")[1]
    parsed = parse_tool_calls(assistant, tools)
    assert parsed == [
        ToolCall("calculator", {"expression": "12 * 7"}),
        ToolCall("python", {"code": CODE}),
    ]
    ids = tool_tokenizer.apply_chat_template(messages, tools=tool_schemas(tools), tokenize=True)
    assert len(ids) > 0  # the rendered text tokenizes too


# --- parsing ------------------------------------------------------------------------------------------------


def test_parses_calls_in_the_hermes_format() -> None:
    text = (
        "I will compute it.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>\n'
        '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "2 + 2"}),
        ToolCall("python", {"code": "print(1)"}),
    ]
    assert parse_tool_calls("The answer is 4.") == []


@pytest.mark.parametrize(
    "body",
    [
        # the OpenAI API's form: arguments as a string
        '{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}',
        '{"name": "calculator", "parameters": {"expression": "1+1"}}',  # Llama 3
        '```json\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n```',  # fenced
    ],
)
def test_tolerated_variants(body: str) -> None:
    assert parse_tool_calls(f"<tool_call>{body}</tool_call>") == [
        ToolCall("calculator", {"expression": "1+1"})
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}</tool_call>',
            "not valid JSON",
        ),
        ("<tool_call>calculator(1+1)</tool_call>", "not valid JSON (Expecting value at line 1 column 1)"),
        ("<tool_call>  </tool_call>", "tool call 1 is empty"),
        ('<tool_call>["calculator"]</tool_call>', "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
        (
            '<tool_call>{"name": "browser", "arguments": {}}</tool_call>',
            "unknown tool 'browser' (available: ",
        ),
        ('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>', "missing argument 'expression'"),
        ('<tool_call>{"name": "calculator"}</tool_call>', "missing argument 'expression'"),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1", "precision": 3}}</tool_call>',
            "unexpected argument 'precision' (calculator takes: expression)",
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": 12}}</tool_call>',
            "argument 'expression' must be a string, got a integer",
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>',
            '"arguments" must be a JSON object',
        ),
        ('<tool_call>{"name": "calculator", "arguments": "{oops"}</tool_call>', "is a string but not JSON"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "never closed"),
        ('{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>', "without a <tool_call>"),
        ("<tool_call><tool_call>{}</tool_call>", "opened again"),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}}</tool_call>',
            "unexpected text '}",
        ),
        ('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}', "never closed"),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "tool call 1"),
    ],
)
def test_malformed_calls_are_observations(text: str, message: str) -> None:
    parsed = parse_tool_calls(text)
    assert isinstance(parsed, ToolCallError), parsed
    assert message in parsed.message, parsed.message
    assert parsed.observation.startswith("error: ") and "<tool_call>" in parsed.observation


def test_one_bad_call_rejects_the_message_and_numbers_it() -> None:
    good = '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
    parsed = parse_tool_calls(good + '<tool_call>{"name": "calc"}</tool_call>')
    assert isinstance(parsed, ToolCallError) and parsed.message.startswith("tool call 2: unknown tool 'calc'")


def test_the_parser_never_raises_on_garbage() -> None:
    import random

    rng = random.Random(0)
    pieces = [
        "<tool_call>",
        "</tool_call>",
        "{",
        "}",
        '"name"',
        ":",
        '"calculator"',
        '"arguments"',
        ",",
        "[",
        "x",
    ]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        parsed = parse_tool_calls(text)
        assert isinstance(parsed, list | ToolCallError)


# --- running calls ------------------------------------------------------------------------------------------


def test_call_tool_runs_the_calculator_and_the_sandbox() -> None:
    tools = default_tools(SandboxLimits(cpu_seconds=2, wall_seconds=5))
    assert call_tool(ToolCall("calculator", {"expression": "6 * 7"}), tools) == "42"
    observation = call_tool(ToolCall("python", {"code": "print(sum(range(10)))"}), tools)
    assert observation == "exit code 0\n--- stdout ---\n45"
    failing = call_tool(ToolCall("python", {"code": "import nonexistent_module"}), tools)
    assert failing.startswith("exit code 1") and "ModuleNotFoundError" in failing


def test_call_tool_turns_problems_into_observations() -> None:
    def broken(text: str) -> str:
        raise RuntimeError("disk on fire")

    tools = [calculator_tool(), Tool("echo", "Echo.", {"type": "object", "properties": {}}, broken)]
    assert call_tool(ToolCall("nope", {}), tools).startswith("error: unknown tool 'nope'")
    assert "missing argument" in call_tool(ToolCall("calculator", {}), tools)
    assert call_tool(ToolCall("echo", {}), tools).startswith("error: the tool echo failed: TypeError")
    tools[1] = Tool("echo", "Echo.", {"type": "object", "properties": {"text": {"type": "string"}}}, broken)
    assert call_tool(ToolCall("echo", {"text": "x"}), tools) == (
        "error: the tool echo failed: RuntimeError: disk on fire"
    )


@pytest.mark.skipif(sys.platform != "linux", reason="the sandbox's isolation is Linux only")
def test_python_tool_uses_its_limits() -> None:
    tool = python_tool(SandboxLimits(cpu_seconds=1, wall_seconds=1))
    assert tool.function(code="import time; time.sleep(5)") == "killed: wall-clock limit of 1 s exceeded"
