"""OpenAI chat messages as the policy's chat template reads them, and the model's tool calls as the API
returns them.

The model writes tool calls in its own syntax (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
the Qwen / Hermes format rlfleet's ``tools`` environment trains; :mod:`rlfleet.environments.tools` parses
it). A reply that holds well-formed calls of the request's tools comes back as ``tool_calls`` (the text
before the first call is the ``content``); a reply whose calls do not parse comes back as plain text.

When an agent sends an assistant message with ``tool_calls`` back in its history, it is rendered for the
template as the model wrote it: its content followed by one ``<tool_call>`` block per call.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlfleet.environments.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Tool, ToolCall, parse_tool_calls
from rlfleet.serving.protocol import APIError

ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or the OpenAI API's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise APIError(400, f"{where}: only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(400, f"{where}: content must be a string or a list of text parts", param="messages")


def _calls(raw: Any, where: str) -> tuple[tuple[str, str], ...]:
    """An assistant message's ``tool_calls`` as ``(name, canonical JSON of the arguments)``."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise APIError(400, f"{where}: tool_calls must be a list", param="messages")
    calls = []
    for call in raw:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise APIError(400, f"{where}: each tool call needs function.name", param="messages")
        arguments = function.get("arguments", "{}")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError as exc:
            raise APIError(
                400, f"{where}: function.arguments is not JSON ({exc.msg})", param="messages"
            ) from None
        calls.append((function["name"], json.dumps(parsed, sort_keys=True)))
    return tuple(calls)


@dataclass(frozen=True)
class ChatMessage:
    """One message of a request, reduced to what the template renders (comparable: an episode's history is
    matched message by message)."""

    role: str
    content: str
    tool_calls: tuple[tuple[str, str], ...] = ()

    def for_template(self) -> dict[str, str]:
        """The message as the chat template renders it (tool calls written out in the model's syntax)."""
        content = self.content
        for name, arguments in self.tool_calls:
            call = json.dumps({"name": name, "arguments": json.loads(arguments)})
            content += f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"
        return {"role": self.role, "content": content}


def read_messages(raw: Sequence[Mapping[str, Any]]) -> tuple[ChatMessage, ...]:
    """The request's messages, checked.

    Raises:
        APIError: A message with an unknown role, non-text content or malformed tool calls (400).
    """
    messages = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in ROLES:
            raise APIError(
                400, f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}", param="messages"
            )
        calls = _calls(message.get("tool_calls"), where) if role == "assistant" else ()
        messages.append(
            ChatMessage(
                "system" if role == "developer" else role, _text(message.get("content"), where), calls
            )
        )
    return tuple(messages)


def read_tools(raw: Sequence[Mapping[str, Any]] | None) -> tuple[Tool, ...]:
    """The request's function tools, as the parser of the model's calls checks them.

    Raises:
        APIError: A tool that is not ``{"type": "function", "function": {"name", "parameters"}}`` (400).
    """
    tools = []
    for i, tool in enumerate(raw or []):
        function = (
            tool.get("function") if isinstance(tool, Mapping) and tool.get("type") == "function" else None
        )
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise APIError(400, f"tools[{i}] must be a function tool with function.name", param="tools")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, Mapping):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        tools.append(Tool(function["name"], str(function.get("description", "")), parameters, _never_called))
    return tuple(tools)


def _never_called(**_: Any) -> str:  # the server parses calls; the agent runs its tools
    raise RuntimeError("the server does not run an agent's tools")


def reply_message(text: str, tools: Sequence[Tool]) -> ChatMessage:
    """The assistant message a reply's text stands for: its tool calls when it makes well-formed ones of
    ``tools``, else plain text."""
    if not tools or TOOL_CALL_OPEN not in text:
        return ChatMessage("assistant", text)
    calls = parse_tool_calls(text, tools)
    if not isinstance(calls, list) or not calls:
        return ChatMessage("assistant", text)
    content = text[: text.find(TOOL_CALL_OPEN)].strip()
    return ChatMessage("assistant", content, tuple(_canonical(call) for call in calls))


def _canonical(call: ToolCall) -> tuple[str, str]:
    return call.name, json.dumps(call.arguments, sort_keys=True)


def message_json(message: ChatMessage) -> dict[str, Any]:
    """The ``message`` of a chat choice."""
    body: dict[str, Any] = {"role": "assistant", "content": message.content or None}
    if message.tool_calls:
        body["tool_calls"] = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(json.loads(arguments))},
            }
            for name, arguments in message.tool_calls
        ]
    else:
        body["content"] = message.content
    return body


def tool_schemas(tools: Sequence[Tool]) -> list[dict[Any, Any] | Callable[..., Any]] | None:
    """What the chat template renders into the prompt (None without tools)."""
    schemas: list[dict[Any, Any] | Callable[..., Any]] = [tool.schema() for tool in tools]
    return schemas or None
