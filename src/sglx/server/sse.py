"""Server-Sent Events responses that always notice a client going away.

Starlette's StreamingResponse only listens for `http.disconnect` under ASGI spec < 2.4 servers; under
2.4 it relies on writes failing, which some servers drop silently, so an abandoned stream would keep
generating. Presenting 2.3 keeps the listener on: a disconnect cancels the stream at once, and that
aborts the engine request and frees its KV.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import StreamingResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: Any) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        asgi = {**scope.get("asgi", {}), "spec_version": "2.3"}
        await super().__call__({**scope, "asgi": asgi}, receive, send)
