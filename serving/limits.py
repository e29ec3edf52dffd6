"""A bound on the size of a request's body: a larger one is answered 413 in OpenAI's error
shape before any of it is parsed, so one huge body cannot hold the event loop (JSON parsing
runs on it) nor the memory of the server.

The bound is checked against the Content-Length header when there is one and against the
bytes received when the body comes in chunks. The body is read whole before the app sees it
(the app reads it whole anyway), then handed on; later messages (a client's disconnect) go
straight through.
"""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024     # 8 MiB: far above any prompt a context holds

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, status: int, message: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """An error response in OpenAI's shape, {"error": {"message", "type", "param", "code"}}."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """ASGI middleware: a body over max_bytes gets a 413 and never reaches the app."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        if max_bytes < 1:
            raise ValueError(f"the request size limit must be >= 1 byte, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = (f"the request body is over this server's limit of {self.max_bytes} bytes "
                     "(pyhlo serve --max-request-bytes)")
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await send_error(send, 413, too_large, "request_too_large")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":            # the client left before its body came
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await send_error(send, 413, too_large, "request_too_large")
            if not message.get("more_body", False):
                break
        whole: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()

        await self.app(scope, replay, send)
