"""What a server may offer the relay: a stream's body written straight to
the client's socket, without an ASGI message per chunk, and a whole
answer written in one write without its two messages (docs/design/hot-path.md,
"A stream's chunks" and "A whole answer in one write").

`llmgw serve`'s server offers it in the request's scope under `DIRECT_BODY`
(app/gateway/http1.py, its HTTP/1.1 protocol); under any
other server the relay sends ASGI messages, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

# The scope key of a request's `DirectBody`, where its server offers one.
DIRECT_BODY = "llmgw.direct_body"


class DirectBody(Protocol):
    """A started response's body, written as it comes; the response still
    ends with its last ASGI message (`more_body: False`)."""

    def writer(self) -> ClientFlow | None:
        """The started response's writer of body chunks (its
        `write_chunk`), or None when it takes none (not chunked, a HEAD
        request, complete); asked once, after `http.response.start`.
        `write_chunk` writes one non-empty chunk and returns False when the
        client's socket is full and `drain()` must be awaited before the
        next; a client gone, the chunk is dropped, as the ASGI send drops
        it. The writer holds what it writes to, nothing of the request: a
        stream's chunk touches as little as the server allows, and a class
        of the compiled router is called natively
        (docs/design/hot-path.md, "A stream's chunks")."""
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

    def on_leave(self, callback: Callable[[], None]) -> None:
        """Calls `callback` once, from the connection's own callback, if the
        client leaves before the response is complete (at once if it
        already has): how the request's watch hears a client leave, with
        no task waiting on `receive` (app/router/timeouts.py). The server
        drops `callback` once the response is complete or the app returns."""
        ...


# The head of an HTTP/1.1 chunk by its length, below 4 KiB (a stream's
# chunk is mostly an event of a few hundred bytes): a lookup and two
# concatenations cost about half of formatting it.
_CHUNK_HEADS = [b"%x\r\n" % n for n in range(4096)]


class ClientFlow:
    """A client socket's flow control as the server keeps it (uvicorn's
    `FlowControl`, the same fields and steps), and the writer of a
    stream's chunks to it: `DirectBody.writer` returns it. It
    lives here, in the compiled router, because a stream's chunk runs
    through it, and holds the transport and nothing of the request: a
    chunk touches it and the transport (docs/design/hot-path.md, "A
    stream's chunks")."""

    __slots__ = ("_transport", "_writable", "read_paused", "write_paused")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.read_paused = False
        self.write_paused = False
        self._writable = asyncio.Event()
        self._writable.set()

    async def drain(self) -> None:
        await self._writable.wait()

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self._transport.resume_reading()

    def pause_writing(self) -> None:
        if not self.write_paused:
            self.write_paused = True
            self._writable.clear()

    def resume_writing(self) -> None:
        if self.write_paused:
            self.write_paused = False
            self._writable.set()

    def write_chunk(self, chunk: bytes) -> bool:
        """Writes a non-empty `chunk` framed as an HTTP/1.1 chunk (as an
        ASGI `send` frames it); False when the socket is full. A transport
        closing is a client gone: the chunk is dropped, as `send` drops it."""
        t = self._transport
        if t.is_closing():
            return True
        n = len(chunk)
        t.write(_CHUNK_HEADS[n] + chunk + b"\r\n" if n < 4096
                else b"%x\r\n%b\r\n" % (n, chunk))
        return not self.write_paused

    def write_framed(self, chunks: bytes) -> bool:
        """Writes `chunks`, one or more whole, non-empty HTTP/1.1 chunks
        framed already (the engine's own, upstream.py's `whole_chunks`), as
        `write_chunk` writes one."""
        t = self._transport
        if t.is_closing():
            return True
        t.write(chunks)
        return not self.write_paused
