"""The OpenAI API's shapes as rlfleet serves them: requests (checked), responses and error bodies.

Requests are pydantic models that keep the fields rlfleet reads and accept the others an OpenAI client sends
(``extra="allow"``); fields rlfleet cannot honour are refused with an OpenAI-style error rather than ignored
(``stream``, ``top_logprobs`` above 0, ``echo``), so an agent never gets silently different behaviour.

Responses follow the OpenAI API's JSON, plus two fields vLLM's server also returns, on which token-in,
token-out clients rely: ``prompt_token_ids`` (the ids the engine was given) and, per choice, ``token_ids``
(the ids it sampled).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """A request the server refuses: its HTTP status and the OpenAI error body's fields."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; -1 or 0: off
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops) or len(stops) > 4:
            raise APIError(400, "stop must hold at most 4 non-empty strings", param="stop")
        return tuple(stops)

    def refuse_unsupported(self) -> None:
        if self.stream:
            raise APIError(
                400, "stream=true is not supported by this server; send stream=false", param="stream"
            )


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs:
            raise APIError(
                400,
                "top_logprobs is not supported: the engine records the sampled token's logprob only "
                "(logprobs=true)",
                param="top_logprobs",
            )
        if self.tool_choice not in (None, "auto", "none"):
            raise APIError(400, "tool_choice must be 'auto' or 'none'", param="tool_choice")


class CompletionRequest(_Request):
    """``POST /v1/completions``: a prompt string, or the prompt's token ids."""

    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    def token_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else 16  # the OpenAI API's default

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise APIError(400, "echo=true is not supported", param="echo")
        if self.logprobs:
            raise APIError(
                400,
                "logprobs above 0 asks for alternatives; the engine records the sampled token's logprob "
                "only (logprobs=0)",
                param="logprobs",
            )


FinishReason = Literal["stop", "length", "tool_calls"]


def token_logprobs(pieces: Sequence[str], logprobs: Sequence[float]) -> list[dict[str, Any]]:
    """``logprobs.content`` of a chat choice: each sampled token's text, bytes and logprob."""
    return [
        {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8")), "top_logprobs": []}
        for piece, lp in zip(pieces, logprobs, strict=True)
    ]


def response(
    kind: Literal["chat", "completion"],
    model: str,
    prompt_ids: Sequence[int],
    choices: list[dict[str, Any]],
    completion_tokens: int,
) -> dict[str, Any]:
    """A chat completion's or a completion's body, with the prompt's ids beside the usage."""
    prefix, name = ("chatcmpl", "chat.completion") if kind == "chat" else ("cmpl", "text_completion")
    prompt_tokens = len(prompt_ids)
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": name,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "prompt_token_ids": list(prompt_ids),
    }


def models_response(model: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": 0, "owned_by": "rlfleet"}],
    }
