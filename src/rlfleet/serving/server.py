"""The HTTP server: FastAPI routes over :class:`~rlfleet.serving.engine.PolicyEndpoint`, run by uvicorn.

FastAPI and uvicorn are what vLLM's own OpenAI-compatible server is built on (so both are already installed
beside vLLM, and the request and response shapes are those its users know); requests are parsed with pydantic,
as rlfleet's config is. Routes, each also under ``/episodes/<key>`` (an agent episode's base URL):
``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``; plus ``GET /health``.

Safe by default: bound to 127.0.0.1; bound to any other address only with an API key (read from an
environment variable, never from a file or the command line), which every request must then carry
(``Authorization: Bearer <key>``). A body over ``max_request_bytes`` is refused before it is read whole.
Every error is an OpenAI error body (``{"error": {"message", "type", "param", "code"}}``), never a traceback.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from rlfleet.errors import UserError
from rlfleet.serving.engine import PolicyEndpoint
from rlfleet.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, models_response

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class ServerSettings:
    """Where the server listens and what it accepts.

    ``api_key``: the key requests must carry (its value, read by the caller from an environment variable);
    required when ``host`` is not a loopback address. ``port`` 0 picks a free port."""

    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    max_request_bytes: int = 4 * 2**20


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_settings(settings: ServerSettings) -> None:
    """Raises a :class:`UserError` for a server that would be reachable from outside without a key."""
    if not is_loopback(settings.host) and not settings.api_key:
        raise UserError(
            f"the server would listen on {settings.host} without an API key: anyone who reaches this "
            "machine could use the model; set an API key (rlfleet serve --api-key-env VAR, VAR holding the "
            "key) or listen on 127.0.0.1"
        )


def _error_response(error: APIError) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status)


class _Guard:
    """ASGI middleware: the API key and the body size, checked before a route reads the body."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_bytes: int) -> None:
        self.app, self.api_key, self.max_bytes = app, api_key, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope.get("path") != "/health":
            given = headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                await _send(send, APIError(401, "a valid API key is required", code="invalid_api_key"))
                return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _send(send, _too_large(self.max_bytes))
            return
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _BodyTooLarge
            return message

        try:
            await self.app(scope, bounded, send)
        except _BodyTooLarge:
            await _send(send, _too_large(self.max_bytes))


class _BodyTooLarge(Exception):
    pass


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


async def _send(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def build_app(endpoint: PolicyEndpoint, settings: ServerSettings) -> Any:
    """The FastAPI application (wrapped in the key and size guard)."""
    from fastapi import APIRouter, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    app = FastAPI(title="rlfleet", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Any:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Any:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}" for e in exc.errors()
        )
        return _error_response(APIError(400, f"invalid request: {problems}"))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Any:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), kind=kind))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> Any:
        log.exception("request %s failed", request.url.path)
        return _error_response(APIError(500, f"internal error ({type(exc).__name__})", kind="server_error"))

    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> Any:
        return models_response(endpoint.model_name)

    @router.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, episode: str | None = None) -> Any:
        return await endpoint.chat(body, episode)

    @router.post("/v1/completions")
    async def complete(body: CompletionRequest, episode: str | None = None) -> Any:
        return await endpoint.complete(body, episode)

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok"}

    app.include_router(router)
    app.include_router(router, prefix="/episodes/{episode}")
    return _Guard(app, settings.api_key, settings.max_request_bytes)


class ServerThread:
    """The server on a thread of this process (the training run's, or ``rlfleet serve``'s)."""

    def __init__(self, endpoint: PolicyEndpoint, settings: ServerSettings) -> None:
        import uvicorn

        check_settings(settings)
        family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((settings.host, settings.port))
        except OSError as exc:
            self.socket.close()
            raise UserError(f"the server cannot listen on {settings.host}:{settings.port}: {exc}") from exc
        self.host, self.port = settings.host, self.socket.getsockname()[1]
        config = uvicorn.Config(
            build_app(endpoint, settings), log_level="warning", lifespan="off", access_log=False
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        self._wait_started()

    def _wait_started(self) -> None:
        for _ in range(600):
            if self.server.started:
                return
            if not self.thread.is_alive():
                raise RuntimeError("the HTTP server stopped while starting (see the log)")
            self.thread.join(timeout=0.05)
        raise RuntimeError("the HTTP server did not start within 30 s")

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.socket.close()
