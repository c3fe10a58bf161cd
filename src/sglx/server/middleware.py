"""Pure-ASGI middleware: API-key check, request-body size limit, and per-route request counting.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client-disconnect detection pass
through untouched.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from sglx.server.errors import APIError
from sglx.server.metrics import HttpMetrics

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("sglx.server")

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key (load balancer probes)


async def send_error(send: Send, err: APIError, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than this server's limit of {limit} bytes "
                              "(--max-request-bytes)", code="request_too_large")


class ApiKeyMiddleware:
    """With an API key, every route except /health needs `Authorization: Bearer <key>` (401 otherwise)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        if not hmac.compare_digest(given, self.expected):  # constant time: no key recovery by timing
            message = "missing API key: send 'Authorization: Bearer <key>'" if not given else "invalid API key"
            await send_error(send, APIError(401, message, code="invalid_api_key"),
                             [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a Content-Length over the limit (before reading), or once a streamed body passes it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    await send_error(send, APIError(400, "invalid Content-Length header"))
                    return
                if too_big:
                    await send_error(send, BodyTooLarge(self.max_bytes), [(b"connection", b"close")])
                    return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)  # turned into a 413 by the app's APIError handler
            return message

        await self.app(scope, limited_receive, send)


class RequestCountMiddleware:
    """Counts requests by (method, route, status) for /metrics; `label` maps a path to its route (a template
    such as /v1/videos/{video_id} for per-object paths) or "other", so labels stay few."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics, label: Callable[[str], str]) -> None:
        self.app = app
        self.metrics = metrics
        self.label = label

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        path = scope.get("path", "")
        route = self.label(path)
        self.metrics.in_flight += 1
        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.in_flight -= 1
            self.metrics.http_requests[(scope.get("method", ""), route, status[0])] += 1


class QuietShutdownMiddleware:
    """Ends a request cancelled because the grace period after SIGINT/SIGTERM ran out, with an error.

    Its engine request was aborted on the way out. The client gets a 503 (or, mid-stream, an SSE error
    event and the end of the stream) instead of a cut connection, and the log one line, not a traceback.
    """

    def __init__(self, app: ASGIApp, stopping: Callable[[], bool]) -> None:
        self.app = app
        self.stopping = stopping

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, completed, sse = [False], [False], [False]

        async def tracking_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                started[0] = True
                sse[0] = any(k == b"content-type" and v.startswith(b"text/event-stream")
                             for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                completed[0] = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if not self.stopping():
                raise
            log.warning("aborted %s %s: the shutdown grace period ran out", scope.get("method"), scope.get("path"))
            err = APIError(503, "the server shut down before this request finished", code="server_shutdown")
            if not started[0]:
                await send_error(send, err)
            elif not completed[0]:
                body = f"data: {json.dumps(err.body())}\n\n".encode() if sse[0] else b""
                await send({"type": "http.response.body", "body": body, "more_body": False})
