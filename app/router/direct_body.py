"""What a server may offer a stream's relay: the response body written
straight to the client's socket, without an ASGI message per chunk
(docs/design/hot-path.md, "A stream's chunks").

`llmgw serve`'s server offers it in the request's scope under `DIRECT_BODY`
(app/gateway/slowclients.py, on uvicorn's httptools protocol); under any
other server the relay sends ASGI messages, as before.
"""

from __future__ import annotations

from typing import Protocol

# The scope key of a request's `DirectBody`, where its server offers one.
DIRECT_BODY = "llmgw.direct_body"


class DirectBody(Protocol):
    """A started response's body, written as it comes; the response still
    ends with its last ASGI message (`more_body: False`)."""

    def usable(self) -> bool:
        """Whether the started response takes direct writes (chunked, not
        HEAD, not complete); asked once, after `http.response.start`."""
        ...

    def write(self, chunk: bytes) -> bool:
        """Writes one non-empty chunk of the body; False when the client's
        socket is full and `drain()` must be awaited before the next. A
        client gone: the chunk is dropped, as the ASGI send drops it."""
        ...

    async def drain(self) -> None:
        """Returns once the client's socket takes writes again (or it is gone)."""
        ...
