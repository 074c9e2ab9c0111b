"""Time limits on a client's headers and on a stalled body, which uvicorn
does not have (docs/design/security.md, "Before a client is authenticated").

uvicorn times only the idle gap between two requests on a kept-open
connection (its keep-alive timeout). A connection that sends nothing, or
sends its request line and headers a byte a second, or stops halfway
through a body, holds a file descriptor for as long as it likes: 300 such
clients locked everyone out of a gateway under a 256-descriptor limit.
nginx has `client_header_timeout` and `client_body_timeout` for this; these
are the same two, on uvicorn's httptools protocol (what `llmgw serve` runs,
uvicorn's "auto" with httptools installed).

The cost on the request path: a few attribute writes per request, and a
clock read per read that leaves a request unfinished. A timer is armed when
a connection opens and at most once per limit's period after that (never
cancelled and re-armed per request); no task.

And one fix to uvicorn's keep-alive timeout: a gateway paused (SIGSTOP, a
frozen VM) past it, with a request arriving on an idle kept-open connection
meanwhile, closed that connection on resume with the request unread: uvloop
(libuv) runs overdue timers before it polls the sockets, so the timeout
fired before the read that would have cancelled it, and the client saw a
reset (a bare uvicorn app on uvloop does the same; asyncio's own loop reads
first). The timeout now looks at the socket (one ioctl, only when it fires)
and leaves a connection with bytes waiting open, to be read at once.

uvicorn's keep-alive timer itself is armed once a connection goes idle
and left armed when a request comes (it looks at the connection when it
rings), instead of armed after every response and cancelled at the next
read: under uvloop each was a libuv handle made, started, stopped and
closed, some 2.4 us of CPU a request.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import termios
import time
import weakref
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from app.router.access import ARRIVED
from app.router.direct_body import DIRECT_BODY

logger = logging.getLogger(__name__)

_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
                b"content-length: 36\r\nconnection: close\r\n\r\n"
                b"request headers not complete in time")


class TimedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol, cutting slow clients. The limits are
    class attributes: `protocol()` makes a subclass with a gateway's own.

    Timers are never cancelled on the request path: one fires, looks at
    where the connection stands, and arms itself again only while a request
    is still under way. So a connection holds at most one timer of each
    kind, armed at most once per limit's period, whatever its requests."""

    header_timeout = 30.0
    body_timeout = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        # Loop time the current request's headers began (the connection's
        # start for the first); None once they are all in.
        self._headers_since: float | None = None
        self._in_headers = False  # a request has begun, its headers are not all in
        self._in_body = False  # its headers are in, its body is not
        self._last_body = 0.0  # loop time of the last read during a body
        # Loop time the connection went idle after a response; None while a
        # request is under way (uvicorn's keep-alive timeout runs from it).
        self._idle_since: float | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        # From the connection's start: one that never sends a byte is cut too.
        self._headers_since = self.loop.time()
        self._header_timer = self.loop.call_later(self.header_timeout, self._check_headers)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._body_timer, self.timeout_keep_alive_task):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = self.timeout_keep_alive_task = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Only for a request that spans reads: most arrive whole.
        if self._in_headers and self._headers_since is None:
            self._headers_since = self.loop.time()
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(self.header_timeout,
                                                          self._check_headers)
        if self._in_body:
            self._last_body = self.loop.time()
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.body_timeout, self._check_body)

    def on_message_begin(self) -> None:
        self._in_headers = True
        super().on_message_begin()
        # When the request began to arrive: what the router counts its
        # own time from (app/router/access.py).
        self.scope[ARRIVED] = time.perf_counter()  # type: ignore[literal-required]

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._headers_since = None
        self._in_body = True
        super().on_headers_complete()
        # The request's cycle now exists (not for an upgrade); its task has
        # not run yet.
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:
            self.scope[DIRECT_BODY] = ChunkedBody(cycle)  # type: ignore[literal-required]

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()

    def _unset_keepalive_if_required(self) -> None:
        # uvicorn's, called on every read and response: the connection is
        # no longer idle; its timer stays armed and looks when it rings.
        self._idle_since = None

    def on_response_complete(self) -> None:
        # uvicorn's (0.55), but the keep-alive timer is armed only if none is.
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._idle_since = None
        self.flow.resume_reading()
        if self.pipeline:  # a pipelined request waited for this response
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def timeout_keep_alive_handler(self) -> None:
        self.timeout_keep_alive_task = None
        if self._idle_since is None or self.transport.is_closing():
            return  # a request under way: its response arms the timer again
        left = self._idle_since + self.timeout_keep_alive - self.loop.time()
        if left > 0:  # idle again since the timer was armed, for less than the timeout
            self.timeout_keep_alive_task = self.loop.call_later(
                left, self.timeout_keep_alive_handler)
            return
        if _unread(self.transport):
            # A request came while the loop was held up (the process was
            # paused): this iteration's poll, right after the timers, reads
            # it (the connection is busy when this rings again); the header
            # timer takes it from there.
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)
            return
        super().timeout_keep_alive_handler()

    def _check_headers(self) -> None:
        self._header_timer = None
        if self._headers_since is None or self.transport.is_closing():
            return  # between requests: uvicorn's keep-alive timeout rules
        left = self._headers_since + self.header_timeout - self.loop.time()
        if left > 0:
            self._header_timer = self.loop.call_later(left, self._check_headers)
            return
        logger.info("closing a connection from %s: request headers not complete within %g s",
                    _peer(self.client), self.header_timeout)
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(_TIMEOUT_408)
        self.transport.close()

    def _check_body(self) -> None:
        self._body_timer = None
        if not self._in_body or self.transport.is_closing():
            return
        now = self.loop.time()
        if self.flow.read_paused:
            # We stopped reading (the app has not taken what came): not the
            # client's stall. Counted again from when reading resumes.
            self._last_body = now
        left = self._last_body + self.body_timeout - now
        if left > 0:
            self._body_timer = self.loop.call_later(left, self._check_body)
            return
        logger.info("closing a connection from %s: no body byte for %g s",
                    _peer(self.client), self.body_timeout)
        self.transport.close()  # the app's receive() answers http.disconnect


def _unread(transport: asyncio.BaseTransport) -> bool:
    """Whether the connection's socket holds bytes not yet read (for TLS,
    encrypted ones: the same test). False where it cannot tell."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        waiting = fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4))
    except (OSError, ValueError):
        return False  # closed under us: nothing to serve
    return waiting != bytes(4)  # a count of bytes, nonzero whatever the byte order


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


def protocol(header_timeout: float, body_timeout: float) -> type[TimedHttpTools]:
    """The protocol class for uvicorn's `http=`, with these limits (seconds)."""
    return type("TimedHttpTools", (TimedHttpTools,),
                {"header_timeout": header_timeout, "body_timeout": body_timeout})


class ChunkedBody:
    """A request's `DirectBody` (app/router/direct_body.py) on uvicorn's
    cycle: a stream's chunk goes to the socket in one write, framed as
    uvicorn frames it, with none of the ASGI send's per-message steps; a
    whole answer is written and ended as uvicorn's send would, without its
    two messages (`answer`), or else its head and body, which uvicorn's send
    writes one message at a time, are gathered into one write.
    A stream's state in uvicorn (started, complete, disconnected, its flow
    control) is read, never changed: its last message still goes through
    uvicorn's send, which writes the final chunk and completes the cycle.
    `answer` changes what uvicorn's send would, as it would. (To gather,
    the cycle's transport is a holder of its writes for the length of the
    answer's two messages: uvicorn's send writes through it.)

    It holds its cycle weakly: the scope holds it and the cycle holds the
    scope, and a strong reference would make every request a reference
    cycle, garbage only the collector can free (a collection's pause then
    grows with the requests served since the last)."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = weakref.ref(cycle)

    def writer(self) -> Callable[[bytes], bool] | None:
        c = self._cycle()
        if (c is None or not c.response_started or c.response_complete
                or c.chunked_encoding is not True or c.scope["method"] == "HEAD"):
            return None
        return _ChunkWriter(c.transport, c.flow).write

    async def drain(self) -> None:
        c = self._cycle()
        if c is not None and c.flow.write_paused and not c.disconnected:
            await c.flow.drain()

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        # What uvicorn's send does for a start and a last body message of
        # a response with its length, in one step: the head built here (its
        # status line, its default headers, its checks of names and values,
        # one search each), then its end of a response (complete, the
        # request's event set, a close if not kept alive, the protocol told).
        c = self._cycle()
        if (c is None or c.response_started or c.disconnected or c.flow.write_paused
                or c.scope["method"] == "HEAD"):
            return False
        every = [*c.default_headers, *headers]
        if (HEADER_RE.search(b"".join([name for name, _ in every]))
                or HEADER_VALUE_RE.search(b"\t".join([value for _, value in every]))):
            return False  # uvicorn's send refuses it, as before
        if (b"connection", b"close") in headers:
            c.keep_alive = False
        elif not c.keep_alive:
            every.append((b"connection", b"close"))
        c.response_started = True
        c.waiting_for_100_continue = False
        c.transport.write(b"".join([STATUS_LINE[status],
                                    *[b"%s: %s\r\n" % h for h in every], b"\r\n", body]))
        c.response_complete = True
        c.message_event.set()
        if not c.keep_alive:
            c.transport.close()
        c.on_response()
        return True

    def gather(self) -> None:
        # uvicorn's send writes through the cycle's `transport`: for a
        # while, that is a holder of the writes (everything else, closing
        # included, goes to the real one, held bytes first).
        c = self._cycle()
        if c is not None and not isinstance(c.transport, _Gathered):
            c.transport = _Gathered(c.transport)  # type: ignore[assignment]

    def flush(self) -> None:
        c = self._cycle()
        if c is not None and isinstance(c.transport, _Gathered):
            held = c.transport
            c.transport = held.real
            held.flush()


class _ChunkWriter:
    """A stream's chunks to its client's socket, framed as uvicorn frames
    them: the transport and the flow control it reads, held directly (a
    chunk reads two objects, not the cycle through a weak reference). A
    transport closing is a client gone (uvicorn's `disconnected` is set as
    it closes): the chunk is dropped, as uvicorn's send drops it."""

    __slots__ = ("_flow", "_transport")

    def __init__(self, transport: asyncio.Transport, flow: FlowControl) -> None:
        self._transport = transport
        self._flow = flow

    def write(self, chunk: bytes) -> bool:
        t = self._transport
        if t.is_closing():
            return True
        t.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return not self._flow.write_paused


class _Gathered:
    """A transport's writes held, to be written as one by `flush()`."""

    __slots__ = ("_parts", "real")

    def __init__(self, real: asyncio.Transport) -> None:
        self.real = real
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self._parts.append(data)

    def flush(self) -> None:
        if self._parts:
            data = b"".join(self._parts)
            self._parts.clear()
            self.real.write(data)

    def close(self) -> None:
        self.flush()
        self.real.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)
