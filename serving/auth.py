"""API keys: with a key set, every route but /health and /metrics wants `Authorization: Bearer
<key>`, as OpenAI's clients send their api_key; anything else is a 401 in OpenAI's error shape.
/health stays open so that a load balancer's probe needs no key, and /metrics so that
Prometheus and an inference gateway's endpoint picker, which scrape without one, can read the
load (vLLM guards only its /v1 routes for the same reason)."""
from __future__ import annotations

import secrets

from serving.limits import ASGIApp, Receive, Scope, Send, send_error

OPEN_PATHS = ("/health", "/metrics")


class BearerAuth:
    """ASGI middleware: requests without the key never reach the app."""

    def __init__(self, app: ASGIApp, api_key: str):
        if not api_key:
            raise ValueError("the API key is empty: give a key, or none to serve without one")
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, key = given.partition(b" ")
        # compare_digest: the time taken says nothing of how much of the key was right.
        if scheme.lower() != b"bearer" or not secrets.compare_digest(key.strip(), self._key):
            message = ("no API key given: send the header 'Authorization: Bearer <key>'" if not given
                       else "the API key is not this server's")
            return await send_error(send, 401, message, "invalid_api_key",
                                    headers=[(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)
