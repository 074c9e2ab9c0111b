"""What a server may offer the relay: a stream's body written straight to
the client's socket, without an ASGI message per chunk, and a whole
answer written in one write without its two messages (docs/design/hot-path.md,
"A stream's chunks" and "A whole answer in one write").

`llmgw serve`'s server offers it in the request's scope under `DIRECT_BODY`
(app/gateway/http1.py, its HTTP/1.1 protocol); under any
other server the relay sends ASGI messages, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

# The scope key of a request's `DirectBody`, where its server offers one.
DIRECT_BODY = "llmgw.direct_body"


class DirectBody(Protocol):
    """A started response's body, written as it comes; the response still
    ends with its last ASGI message (`more_body: False`)."""

    def writer(self) -> Callable[[bytes], bool] | None:
        """The started response's writer of body chunks, or None when it
        takes none (not chunked, a HEAD request, complete); asked once,
        after `http.response.start`. The writer writes one non-empty chunk
        and returns False when the client's socket is full and `drain()`
        must be awaited before the next; a client gone, the chunk is
        dropped, as the ASGI send drops it. It holds what it writes to,
        nothing of the request: a stream's chunk touches as little as the
        server allows (docs/design/hot-path.md, "A stream's chunks")."""
        ...

    async def drain(self) -> None:
        """Returns once the client's socket takes writes again (or it is gone)."""
        ...

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """Writes a whole answer (`headers` lower-case, its length among
        them), head and body in one write, and ends the response as the
        server's own two messages would. False when it cannot (the response
        started, the client's socket is full or gone, a HEAD request, a
        header the server would refuse): the caller sends the messages."""
        ...

    def gather(self) -> None:
        """Holds what the server writes for this response from now on, until
        `flush()`: a whole answer's head and body then leave in one write
        (one system call, one packet) instead of two."""
        ...

    def flush(self) -> None:
        """Writes what `gather()` held, as one; writes go straight out again."""
        ...
