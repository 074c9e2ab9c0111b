"""The router's HTTP/1.1 client for engines and providers: keep-alive
connections on asyncio protocols, responses parsed by httptools (llhttp,
the parser uvicorn serves with).

Why not aiohttp's client, which the router used before: measured with
bench/router_overhead.py, `ClientSession.post` and the response's reads cost
about 55 us of CPU per proxied request (tracing hooks, cookie jars, URL
objects, payload registries, timer contexts), a third of the gateway's whole
cost per request. The router needs one narrow thing: a POST with a body it
holds whole, an answer read whole or as it comes, and the connection closed
whenever the request is abandoned (that is how vLLM learns to abort). This
client does that and nothing more; see docs/design/routing.md.

* Connections are kept per origin (scheme, host, port) and reused while the
  server keeps them open; an idle one is dropped after `keepalive` seconds
  or as soon as the server closes it (uvicorn, which vLLM and llama.cpp's
  server run on, closes idle ones after 5 s).
* A request on a reused connection that the server closed before answering
  (the keep-alive race every HTTP client meets) is sent once more on a new
  connection; any other failure is the caller's to retry or not.
* A cancelled request, or a response closed before its end, closes its
  connection: never reused, and the engine sees the client gone.
* Body reads pause the socket above `_HIGH_WATER` buffered bytes, so a slow
  client slows the engine's stream instead of growing our memory.
* A stream's body can be piped (`Response.pipe`): what one socket read brings
  goes to the relay's sink at once, inside this protocol's callback, with no
  task woken per chunk; the sink holds the pipe when its client must be
  waited for, and the socket is not read until it is piped again. A piped
  read of whole chunks is cut without llhttp and handed on with its own
  framing (`whole_chunks`, `Sink.take_framed`), for a sink writing a
  chunked body of its own to pass on as it came.
* The engine's own time is timed where it can be seen (`Response.engine_seconds`):
  from the request's last byte handed to the kernel to the arrival of what
  the reader was last given, so that composing the request, waking the
  reader and parsing the answer count as the gateway's (its own-time
  histogram, docs/design/metrics.md).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from time import perf_counter
from typing import cast

import httptools
from mypy_extensions import mypyc_attr

# What a request is made of, checked (request_line.py); its errors are those
# of every caller of this client.
from app.router.request_line import (
    UNSAFE_TARGET,
    Origin,
    Unsendable,
    UpstreamError,
    header_lines,
    origin,
)

# Buffered body bytes above which the socket stops being read until the
# reader catches up.
_HIGH_WATER = 256 * 1024
# The most bytes of an answer's header fields kept (llhttp sets no limit):
# past it the answer is refused, as the gateway's own server refuses a
# request's head (app/gateway/http1.py).
MAX_HEAD = 64 * 1024


class Response:
    """An upstream answer: its status and headers at once, its body as it comes.

    `headers` maps lower-case names to values (the last one of a repeated
    header). Call `close()` when done, whether or not the body was read:
    a whole answer hands its connection back, any other closes it.
    """

    __slots__ = ("_conn", "headers", "status")

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str]) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers

    async def read(self) -> bytes:
        """The whole body."""
        chunks = []
        while chunk := await self._conn.read_some():
            chunks.append(chunk)
        return b"".join(chunks)

    async def readany(self) -> bytes:
        """What has come of the body since the last read, waiting for some;
        b"" at its end. UpstreamError if the connection broke first."""
        return await self._conn.read_some()

    async def pipe(self, sink: Sink) -> bool:
        """Hands the body to `sink` as it comes (what is already here first):
        True at its end, False when the sink held it (returned False; the
        socket is then not read until the next call). UpstreamError if the
        connection broke first; what the sink raised, raised here."""
        return await self._conn.pipe(sink)

    def engine_seconds(self) -> float:
        """The engine's time on this request so far: from its last byte
        handed to the kernel to the arrival of the read that brought what
        the reader was last given (the head, a stream's first chunk, a whole
        answer's end). Not advanced while the body is piped."""
        c = self._conn
        return max(c.heard_at - c.sent_at, 0.0)

    def close(self) -> None:
        self._conn.finish()


@mypyc_attr(allow_interpreted_subclasses=True)
class Sink:
    """Takes what one socket read brought of a body, inside the connection's
    callback (`Response.pipe`). A class, not a callable: the compiled router
    calls a compiled sink's `take` natively, where a callable costs a
    generic call and its arguments parsed again each chunk
    (docs/design/hot-path.md, "A stream's chunks")."""

    def take(self, data: bytes) -> bool:
        """Takes `data`; False holds the pipe (the reader must wait for its
        own client)."""
        raise NotImplementedError

    def take_framed(self, data: bytes, framed: bytes) -> bool:
        """Takes `data`, which came as `framed`: one or more whole chunks of
        a chunked body, as the server framed them (`whole_chunks`), that a
        sink writing a chunked body of its own may pass on as they are."""
        return self.take(data)


def whole_chunks(read: bytes) -> bytes | None:
    """The body carried by `read` when it is one or more whole chunks of a
    chunked body (RFC 9112, 7.1): each a size in hex digits, CRLF, that many
    bytes, CRLF; no extension, none the last chunk (size 0). Anything else
    (a chunk cut by the read, an extension, the end) is None: llhttp reads
    it. A piped stream's read is mostly one event in one chunk, and this is
    its whole parse (docs/design/hot-path.md, "A stream's chunks")."""
    n = len(read)
    at = 0
    body: bytes | None = None
    pieces: list[bytes] | None = None
    while at < n:
        size = 0
        i = at
        while i < n:
            c = read[i]
            if 48 <= c <= 57:  # 0-9
                size = size * 16 + c - 48
            elif 97 <= c <= 102:  # a-f
                size = size * 16 + c - 87
            elif 65 <= c <= 70:  # A-F
                size = size * 16 + c - 55
            else:
                break
            i += 1
            if i - at > 8:
                return None  # a size past 4 GiB: not a stream's read
        start = i + 2
        end = start + size
        if (i == at or size == 0 or end + 2 > n or read[i] != 13 or read[i + 1] != 10
                or read[end] != 13 or read[end + 1] != 10):
            return None
        piece = read[start:end]
        if body is None:
            body = piece
        elif pieces is None:
            pieces = [body, piece]
        else:
            pieces.append(piece)
        at = end + 2
    return body if pieces is None else b"".join(pieces)


class _Connection(asyncio.Protocol):
    """One connection: writes a request, parses its response."""

    def __init__(self, pool: UpstreamClient, key: tuple[str, str, int],
                 loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        self._key = key
        # Kept: Python 3.11's get_running_loop() is a system call (getpid).
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._paused = False
        self.idle_since = 0.0
        self._busy = False  # an exchange is on: from send() to finish()
        # `time.perf_counter()` when the request was written, and when the
        # last read came that was not piped (Response.engine_seconds).
        self.sent_at = 0.0
        self.heard_at = 0.0
        self._reset()

    def _reset(self) -> None:
        self._header_list: list[tuple[bytes, bytes]] = []
        self._head_size = 0  # bytes of header fields so far
        self._headed = False  # the head is parsed: fields now are trailers
        self._head: asyncio.Future[tuple[int, dict[str, str]]] | None = None
        self._body: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Sink | None = None  # set while piped (pipe())
        # llhttp stands at the start of a chunk's size line of a chunked
        # body, with nothing of it fed: a read of whole chunks may then be
        # taken without it (`whole_chunks`), leaving its state as it was.
        self._boundary = False
        self._held = False  # the sink held the pipe
        self._complete = False
        self._keep_alive = False
        self._until_eof = False  # no length, not chunked: the close ends it
        self.received = False  # any byte of the answer came
        self._stray = False  # more came after the whole answer: never reused
        self._error: Exception | None = None

    # --- used by the client ------------------------------------------------------

    @property
    def usable(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    def send(self, data: bytes) -> asyncio.Future[tuple[int, dict[str, str]]]:
        self._reset()
        self._busy = True
        self._head = self._loop.create_future()
        if self._transport is None or self._transport.is_closing():
            self._fail(UpstreamError("the server closed the connection"))
        else:
            self._transport.write(data)
        self.sent_at = self.heard_at = perf_counter()
        return self._head

    async def read_some(self) -> bytes:
        while not self._body:
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._take()
        self._resume()
        return data

    async def pipe(self, sink: Sink) -> bool:
        self._held = False
        while True:
            if self._body:  # what is already here, or came with the end or an error
                self._flush(sink)
            if self._error is not None:
                raise self._error
            if self._held:
                return False
            if self._complete:
                return True
            self._resume()  # held before: the sink takes more now
            self._sink = sink
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
                self._sink = None

    def _take(self) -> bytes:
        """The buffered body, as one piece; the buffer emptied."""
        data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        self._buffered = 0
        return data

    def _resume(self) -> None:
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()

    def _flush(self, sink: Sink) -> None:
        """The buffered body to `sink`, as one piece (taken here, not by
        `_take`: once a chunk, a call less counts)."""
        body = self._body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self._buffered = 0
        try:
            go_on = sink.take(data)
        except Exception as exc:  # the reader's to raise, from pipe()
            self._sink = None
            self._fail(exc)
            return
        if not go_on:
            self._hold()

    def _give(self, sink: Sink, data: bytes, framed: bytes) -> None:
        """Whole chunks read (`framed`, carrying `data`) to `sink`, as `_flush`."""
        try:
            go_on = sink.take_framed(data, framed)
        except Exception as exc:  # the reader's to raise, from pipe()
            self._sink = None
            self._fail(exc)
            return
        if not go_on:
            self._hold()

    def _hold(self) -> None:
        """The sink held the pipe: the socket is not read until piped again."""
        self._sink = None
        self._held = True
        if not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def finish(self) -> None:
        """The exchange is over: back to the pool if whole and reusable, else
        closed. Once: a second call does nothing (the pool holds it once)."""
        if not self._busy:
            return
        self._busy = False
        if (self._complete and not self._until_eof and self._error is None
                and self._keep_alive and not self._stray and self.usable):
            self._pool.release(self._key, self)
        else:
            self.abort()

    def abort(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    # --- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self._busy:
            # Bytes nobody asked for, on an idle connection: whatever they
            # are, they must not become the start of the next answer.
            self.abort()
            return
        self.received = True
        sink = self._sink
        if sink is None:  # a piped chunk is timed by nobody
            self.heard_at = perf_counter()
        elif self._boundary and not self._body:
            body = whole_chunks(data)
            if body is not None:  # passed on as it came, llhttp not asked
                self._give(sink, body, data)
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            # What a callback of ours refused, else llhttp's own complaint.
            cause = exc.__context__
            self._fail(cause if isinstance(cause, UpstreamError)
                       else UpstreamError(f"the answer is not valid HTTP: {exc}"))
            self.abort()
        # Fed whole up to a chunk's end, or the head's: a CRLF ends the read
        # (bytes of a size line after it would end otherwise, or with a callback).
        self._boundary = self._boundary and data.endswith(b"\r\n")
        # Piped: all this read brought of the body, in one piece, at once.
        if self._sink is not None and self._body:
            self._flush(self._sink)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._until_eof and self._head is not None and self._head.done():
            self._complete = True  # a body delimited by the close ended normally
            self._wake()
        elif not self._complete:
            self._fail(UpstreamError("the server closed the connection"
                                     + (f" ({exc})" if exc else "")))
        self._pool.forget(self._key, self)

    # --- httptools callbacks --------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:  # a second message after the answer: not ours
            self._stray = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._stray or self._headed:
            return  # trailers are read and dropped
        self._head_size += len(name) + len(value) + 4
        if self._head_size > MAX_HEAD:
            raise UpstreamError(f"the answer's head passes {MAX_HEAD} bytes")
        self._header_list.append((name, value))

    def on_headers_complete(self) -> None:
        if self._stray:
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # Interim (RFC 9110, 15.2: 100 Continue, 103 Early Hints): the
            # answer is the next one. Its fields are dropped, though still
            # counted against MAX_HEAD, so endless interims fill nothing.
            self._header_list = []
            return
        self._headed = True
        headers = {name.decode("latin-1").lower(): value.decode("latin-1")
                   for name, value in self._header_list}
        # Transfer codings are case-insensitive (RFC 9112, 7): "Chunked" too.
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if "content-length" not in headers and not chunked and status not in (204, 304):
            self._until_eof = True
        self._boundary = chunked
        if self._head is not None and not self._head.done():
            self._head.set_result((status, headers))

    def on_chunk_header(self) -> None:
        self._boundary = False

    def on_chunk_complete(self) -> None:
        self._boundary = not self._complete

    def on_body(self, body: bytes) -> None:
        if self._stray:
            return
        self._body.append(body)
        self._buffered += len(body)
        if self._sink is not None:
            return  # passed on after this read's parse (data_received), no task woken
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._stray:
            return
        if not self._headed:
            return  # an interim answer's end: the answer comes after
        self._complete = True
        self._boundary = False
        # Asked here: llhttp answers it only within the message's callbacks.
        self._keep_alive = self._parser.should_keep_alive()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        self._wake()


class UpstreamClient:
    """Keep-alive connections to engines and providers, one pool per origin.

    `clock` times idle connections (monotonic, injectable)."""

    def __init__(self, connect_timeout: float, keepalive: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._clock = clock
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        # Told the URL of every attempt before it is sent (tests).
        self.on_request: Callable[[str], None] | None = None

    async def post(self, base_url: str, target: str, body: bytes,
                   headers: list[tuple[bytes, bytes]], preset: bytes = b"",
                   method: bytes = b"POST") -> Response:
        """POSTs `body` to `target` (path and query) under `base_url`; returns
        once the answer's headers came. `headers` go as given, after Host,
        Content-Length and `preset` (from `header_block`); none may hold a
        control character."""
        o = origin(base_url)
        try:
            path = o.prefix + target.encode("latin-1")
        except UnicodeEncodeError:
            raise Unsendable(f"unsafe request target {target!r}") from None
        if UNSAFE_TARGET.search(path):
            raise Unsendable(f"unsafe request target {target!r}")
        lines = [method, b" ", path, b" HTTP/1.1\r\nHost: ", o.host_header,
                 b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n", preset,
                 header_lines(headers), b"\r\n", body]
        data = b"".join(lines)
        if self.on_request is not None:
            self.on_request(base_url + target)
        key = (o.scheme, o.host, o.port)
        conn = self._take_idle(key)
        if conn is not None:
            try:
                return await self._exchange(conn, data)
            except UpstreamError:
                if conn.received:
                    raise
                # Closed by the server as we reused it, before any answer: the
                # request never reached an engine that could act on it.
        return await self._exchange(await self._connect(key, o), data)

    async def _exchange(self, conn: _Connection, data: bytes) -> Response:
        try:
            status, headers = await conn.send(data)
        except BaseException:
            conn.abort()  # cancelled or failed: the engine sees the close
            raise
        return Response(conn, status, headers)

    async def _connect(self, key: tuple[str, str, int], o: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        ssl_arg: ssl.SSLContext | None = None
        if o.scheme == "https":
            if self._ssl is None:
                # Once: loading the system's CAs takes milliseconds, which
                # the event loop must not spend on every new connection.
                self._ssl = ssl.create_default_context()
            ssl_arg = self._ssl
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, key, loop), o.host, o.port, ssl=ssl_arg,
                    server_hostname=o.host if ssl_arg is not None else None)
        except TimeoutError:
            raise UpstreamError(f"connect to {o.host}:{o.port} timed out after "
                                f"{self._connect_timeout:g} s") from None
        except OSError as exc:  # refused, unreachable, name not known, TLS
            raise UpstreamError(f"cannot connect to {o.host}:{o.port}: "
                                f"{exc.strerror or exc}") from None
        self._open.add(conn)
        return conn

    def _take_idle(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = self._clock()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely closed
            if conn.usable and now - conn.idle_since < self._keepalive:
                return conn
            conn.abort()
        return None

    def release(self, key: tuple[str, str, int], conn: _Connection) -> None:
        conn.idle_since = self._clock()
        self._idle.setdefault(key, []).append(conn)

    def forget(self, key: tuple[str, str, int], conn: _Connection) -> None:
        """A connection closed: out of the pool."""
        self._open.discard(conn)
        idle = self._idle.get(key)
        if idle and conn in idle:
            idle.remove(conn)

    def idle_count(self) -> int:
        return sum(len(v) for v in self._idle.values())

    async def close(self) -> None:
        for conn in list(self._open):
            conn.abort()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports' close callbacks run
