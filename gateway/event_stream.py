"""A server-sent-event response that notices a client going away at once, not at its next write.

Starlette's StreamingResponse, under ASGI 2.4 servers, learns of a disconnect only when a write
fails, and leaves the body's generator to the garbage collector. A request whose client has gone
must be cancelled now, so that the router frees its KV slots (docs/design.md, Security): this
response watches for ``http.disconnect`` beside the stream and closes the generator either way
(its ``finally`` cancels the gRPC call).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = ["EventStreamResponse"]


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None) -> None:
        super().__init__(events, headers={"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with aclosing(self.events):
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    group.cancel_scope.cancel()

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(watch)
