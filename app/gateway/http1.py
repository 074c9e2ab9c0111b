"""The gateway's HTTP/1.1 connections: uvicorn's server (its sockets, TLS,
workers, lifespan, signals and shutdown) runs this protocol on each
(docs/design/hot-path.md, "The server's protocol").

uvicorn's own httptools protocol took some 11 us of CPU a request more
than this one does, a ninth of a proxied request's whole cost: a
request's Python steps are its parse (llhttp's, through httptools, the same
parser), one scope, one task, and one object for the request (`RequestCycle`)
that is also its `DirectBody` (app/router/direct_body.py); no event
object per request, no per-request keyword plumbing, no subclass calling up
to a parent's method on every callback. What it keeps of uvicorn's, as
uvicorn does it: the ASGI `send` and `receive` with their checks, the
default headers, pipelining, `Expect: 100-continue`, HTTP/1.0, flow control
both ways, a 400 for a request llhttp refuses, the concurrency limit, the
keep-alive timeout, and the graceful shutdown's `shutdown()`.

And what uvicorn does not have (docs/design/security.md, "Before a client is
authenticated"): a cap on a request's head (`MAX_HEAD`: its target and
headers, held until they are all in; uvicorn's protocol took 40 MB of
headers in a request), and time limits on a client's headers and on a
stalled body.
uvicorn times only the idle gap between two requests; a connection that
sends nothing, or its headers a byte a second, or stops halfway through a
body, held a file descriptor for as long as it liked (300 such clients
locked everyone out of a gateway under a 256-descriptor limit). nginx has
`client_header_timeout` and `client_body_timeout` for this; these are the
same two. Each timer is armed when its spell begins and at most once per
limit's period after that, never cancelled and re-armed per request: when it
rings it looks at where the connection stands and arms itself again for
what is left. The keep-alive timer works the same way (under uvloop a timer
armed and cancelled per request cost some 2.4 us).

One more fix to uvicorn's keep-alive timeout: a gateway paused (SIGSTOP, a
frozen VM) past it, with a request arriving on an idle kept-open connection
meanwhile, closed that connection on resume with the request unread: uvloop
(libuv) runs overdue timers before it polls the sockets, so the timeout
fired before the read that would have cancelled it, and the client saw a
reset. The timeout looks at the socket (one ioctl, only when it fires) and
leaves a connection with bytes waiting open, to be read at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import fcntl
import functools
import logging
import termios
import time
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, cast

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import (
    HIGH_WATER_LIMIT,
    service_unavailable,
)
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE
from uvicorn.protocols.utils import is_ssl
from uvicorn.server import ServerState

from app.router.access import ARRIVED
from app.router.direct_body import DIRECT_BODY, ClientFlow

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
App = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
               Awaitable[object]]

_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
                b"content-length: 36\r\nconnection: close\r\n\r\n"
                b"request headers not complete in time")
# The most bytes of a request's target and headers held while they come in
# (nginx keeps 4 x 8 KiB by default, Node 16 KiB): a client key, trace
# headers and a long query fit many times over.
MAX_HEAD = 64 * 1024
# After a refusal of the server's own, what the client still sends is read
# and dropped, for at most this long and this many bytes, before the close
# (nginx's lingering close): a close that meets unread bytes is a reset,
# which can destroy the answer before the client has read it.
LINGER_SECONDS = 2.0
LINGER_BYTES = 4 * 1024 * 1024
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_DISCONNECT: dict[str, Any] = {"type": "http.disconnect"}


class _HeadTooLarge(Exception):
    """Raised from llhttp's callback past MAX_HEAD: the status to answer."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class Http1:
    """One client connection: an asyncio protocol (its calls as
    `asyncio.Protocol` names them; compiled, a class of the router's
    compiled library cannot derive from that Python class). `protocol()`
    gives uvicorn one with a gateway's limits."""

    transport: asyncio.Transport
    flow: ClientFlow

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, header_timeout: float = 30.0,
                 body_timeout: float = 30.0) -> None:
        if not config.loaded:
            config.load()
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.app: App = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.parser: Any = httptools.HttpRequestParser(self)
        # A response may go out before a pipelined request's body is read:
        # llhttp then reads on past the request it closed (uvicorn's too).
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.root_path: str = config.root_path
        self._root_raw = self.root_path.encode("ascii")
        self.asgi_version = config.asgi_version
        self.limit_concurrency = config.limit_concurrency
        # A float too, as uvicorn's own protocols take it: its annotation
        # says int, which compiled code would hold it to.
        untyped: Any = config
        self.timeout_keep_alive = float(untyped.timeout_keep_alive)
        self._fresh_context = config.reset_contextvars
        self.app_state = app_state
        self.server_state = server_state
        # uvicorn's sets, typed for its own protocols.
        self.connections: set[Any] = server_state.connections
        self.tasks = server_state.tasks

        # `transport` and `flow` are set once the connection is made.
        self.server: tuple[str, int | None] | None = None
        self.client: tuple[str, int | None] | None = None
        self.scheme = "http"
        # Requests whose headers came while an earlier one was answered.
        self.pipeline: deque[tuple[RequestCycle, App, Scope]] = deque()
        self.request: RequestCycle | None = None  # the latest request
        self.answering: RequestCycle | None = None  # the one whose app runs

        # The request being read.
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.expect_100_continue = False
        self.arrived = 0.0  # perf_counter when its first byte was read
        self._head_size = 0  # its target's and headers' bytes so far (MAX_HEAD)
        self._too_large = 0  # the status of a head refused past MAX_HEAD (414, 431)

        # The timers: armed once, looked at when they ring.
        self.timeout_keep_alive_task: asyncio.TimerHandle | None = None
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._lingering = -1  # after a refusal: the bytes dropped so far (-1: none)
        # Loop time the current request's headers began (the connection's
        # start for the first); None once they are all in.
        self._headers_since: float | None = None
        self._in_headers = False  # a request has begun, its headers are not all in
        self._in_body = False  # its headers are in, its body is not
        self._last_body = 0.0  # loop time of the last read during a body
        # Loop time the connection went idle after a response; None while a
        # request is under way (the keep-alive timeout runs from it).
        self._idle_since: float | None = None

    # The transport's calls.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.connections.add(self)
        # A stream transport (uvloop's are not asyncio.Transport's subclasses).
        self.transport = transport  # type: ignore[assignment]
        self.flow = ClientFlow(self.transport)
        # The addresses the transport read when it opened (uvloop's and
        # asyncio's): uvicorn's way, through the transport's socket object,
        # made five system calls more a connection.
        self.server = _address(transport.get_extra_info("sockname"), local=True)
        self.client = _address(transport.get_extra_info("peername"), local=False)
        self.scheme = "https" if is_ssl(self.transport) else "http"
        # From the connection's start: one that never sends a byte is cut too.
        self._headers_since = self.loop.time()
        self._header_timer = self.loop.call_later(self.header_timeout, self._check_headers)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        self._stop_timers()
        # The request being answered, and the latest, which differs when
        # a pipelined one waits behind it: both hear the client go.
        for req in (self.answering, self.request):
            if req is not None:
                if not req.response_complete:
                    req.disconnected = True
                req.wake()
                req.left()
        self.flow.resume_writing()
        if exc is None:
            self.transport.close()
        self.parser = None

    def _stop_timers(self) -> None:
        for timer in (self._header_timer, self._body_timer, self.timeout_keep_alive_task,
                      self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = self.timeout_keep_alive_task = None
        self._linger_timer = None

    def eof_received(self) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        if self._lingering >= 0:  # refused: dropped, until the close (_refuse)
            self._lingering += len(data)
            if self._lingering > LINGER_BYTES:
                self.transport.close()
            return
        self._idle_since = None  # not idle: the keep-alive timer looks when it rings
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No WebSocket here: the request was served as plain HTTP.
            logger.warning("Unsupported upgrade request.")
        except httptools.HttpParserError:
            if self._too_large:
                logger.info("closing a connection from %s: request head over %d bytes",
                            _peer(self.client), MAX_HEAD)
                self._refuse(self._too_large, f"request head over {MAX_HEAD} bytes")
                return
            msg = "Invalid HTTP request received."
            logger.warning(msg)
            self._refuse(400, msg)
            return
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

    def pause_writing(self) -> None:
        self.flow.pause_writing()

    def resume_writing(self) -> None:
        self.flow.resume_writing()

    # llhttp's calls, as it parses.

    def on_message_begin(self) -> None:
        self._in_headers = True
        self.url = b""
        self.headers = []
        self.expect_100_continue = False
        self._head_size = 0
        # What the router counts its own time from (app/router/access.py).
        self.arrived = time.perf_counter()

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._grow(len(url), 414)

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        # llhttp keeps trailing whitespace, which RFC 9110 (5.5) excludes from a value.
        value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))
        self._grow(len(name) + len(value), 431)

    def _grow(self, size: int, status: int) -> None:
        """Counts a piece of the head; past MAX_HEAD, parsing stops there
        (llhttp turns the exception into its error, data_received answers)."""
        self._head_size += size
        if self._head_size > MAX_HEAD:
            self._too_large = status
            raise _HeadTooLarge(status)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._headers_since = None
        self._in_body = True
        parser = self.parser
        version = parser.get_http_version()
        method = parser.get_method().decode("ascii")
        # Its fields as llhttp gives them: a missing one is None, whatever
        # the stubs say (compiled, an annotation is checked).
        url: Any = httptools.parse_url(self.url)
        raw_path: bytes = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        keep_alive = version != "1.0" and parser.should_keep_alive()
        req = RequestCycle(self, keep_alive, self.expect_100_continue, method == "HEAD")
        scope: Scope = {
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": version,
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
            "method": method,
            "path": self.root_path + path,
            "raw_path": self._root_raw + raw_path,
            "query_string": url.query or b"",
            ARRIVED: self.arrived,
            # The request holds no scope: a scope holding it is no cycle.
            DIRECT_BODY: req,
        }
        limit = self.limit_concurrency
        app = self.app
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            app = cast(App, service_unavailable)
            logger.warning("Exceeded concurrency limit.")
        before, self.request = self.request, req
        if before is None or before.response_complete:
            self._start(req, app, scope)
        else:  # pipelined: it waits for the answer before it
            self.flow.pause_reading()
            self.pipeline.appendleft((req, app, scope))

    def on_body(self, body: bytes) -> None:
        req = self.request
        if req is None or req.response_complete:
            return
        req.body.append(body)
        req.body_size += len(body)
        if req.body_size > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        req.wake()

    def on_message_complete(self) -> None:
        self._in_body = False
        req = self.request
        if req is None or req.response_complete:
            return
        req.more_body = False
        req.wake()

    # The connection's own.

    def _start(self, req: RequestCycle, app: App, scope: Scope) -> None:
        self.answering = req
        if self._fresh_context:  # uvicorn's opt-in: no context leaks between tasks
            task = self.loop.create_task(req.run_asgi(app, scope),
                                         context=contextvars.Context())
        else:
            task = self.loop.create_task(req.run_asgi(app, scope))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def on_response_complete(self) -> None:
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._idle_since = None
        self.flow.resume_reading()
        if self.pipeline:  # a pipelined request waited for this response
            self._start(*self.pipeline.pop())
            return
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def shutdown(self) -> None:
        """The server's graceful shutdown: an idle connection closes now, a
        busy one after its answer."""
        req = self.request
        if req is None or req.response_complete:
            self.transport.close()
        else:
            req.keep_alive = False

    def _refuse(self, status: int, msg: str) -> None:
        """An answer of the server's own to a request it will not read on,
        and the connection closed."""
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend([b"content-type: text/plain; charset=utf-8\r\n",
                        b"content-length: %d\r\n" % len(msg), b"connection: close\r\n", b"\r\n",
                        msg.encode("ascii")])
        t = self.transport
        t.write(b"".join(content))
        req = self.request
        if (not t.can_write_eof()  # TLS: no half-close
                or (req is not None and not req.response_complete) or self.pipeline):
            t.close()  # an answer under way: cut, as before, never written past an EOF
            return
        # Half-closed once the answer is out; what comes meanwhile is dropped
        # (data_received), the close once the client closes its side
        # (eof_received returns None) or the linger ends.
        t.write_eof()
        self._stop_timers()
        self._lingering = 0
        self.flow.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_SECONDS, t.close)

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
        self.transport.close()

    def _check_headers(self) -> None:
        self._header_timer = None
        if self._headers_since is None or self.transport.is_closing():
            return  # between requests: the keep-alive timeout rules
        left = self._headers_since + self.header_timeout - self.loop.time()
        if left > 0:
            self._header_timer = self.loop.call_later(left, self._check_headers)
            return
        logger.info("closing a connection from %s: request headers not complete within %g s",
                    _peer(self.client), self.header_timeout)
        if self.request is None or self.request.response_complete:
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


class RequestCycle:
    """One request's exchange with the app: its ASGI `receive` and `send`,
    as uvicorn's are (their checks, default headers, framing, 100-continue,
    HEAD), and the `DirectBody` the router writes through where it can.

    It holds its connection only while the app runs (`run_asgi`), not its
    scope: the scope holds it (as its `DirectBody`), and either way round
    a loop of references would be garbage only the collector can free (a
    collection's pause grows with the requests served since the last)."""

    __slots__ = ("_held", "_leave", "_news", "_waiters", "body", "body_size", "chunked_encoding",
                 "conn", "default_headers", "disconnected", "expected_content_length", "flow",
                 "head", "keep_alive", "loop", "more_body", "response_complete",
                 "response_started", "transport", "waiting_for_100_continue")

    def __init__(self, conn: Http1, keep_alive: bool, expect_100_continue: bool,
                 head: bool) -> None:
        self.conn: Http1 | None = conn
        self.loop = conn.loop
        self.transport = conn.transport
        self.flow = conn.flow
        self.default_headers: list[tuple[bytes, bytes]] = conn.server_state.default_headers
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.head = head
        self.disconnected = False
        # The body read and not yet received by the app.
        self.body: list[bytes] = []
        self.body_size = 0
        self.more_body = True
        # Whether something happened since the app's last receive, and the
        # receives waiting for it (one, but for an app that also watches
        # for the client's leaving while it reads).
        self._news = False
        self._waiters: list[asyncio.Future[None]] = []
        self.response_started = False
        self.response_complete = False
        self.chunked_encoding: bool | None = None
        self.expected_content_length = 0
        self._held: list[bytes] | None = None  # writes gathered (`gather`)
        # Told if the client leaves mid-response (`on_leave`); dropped at
        # the response's end and the app's, as it holds the request's watch.
        self._leave: Callable[[], None] | None = None

    def wake(self) -> None:
        """Body came, the body ended, the client left or the response ended."""
        self._news = True
        for w in self._waiters:
            if not w.done():
                w.set_result(None)

    def left(self) -> None:
        """The connection dropped: whoever asked (`on_leave`) hears it, once,
        if the response was not complete."""
        leave, self._leave = self._leave, None
        if leave is not None and self.disconnected:
            leave()

    async def run_asgi(self, app: App, scope: Scope) -> None:
        # The 500, if any, is sent after the try: no await in an except or
        # finally block, which compiled code gets wrong
        # (docs/design/hot-path.md, "The router compiled").
        failed = False
        try:
            result = await app(scope, self.receive, self.send)
        except BaseException as exc:
            logger.error("Exception in ASGI application\n", exc_info=exc)
            failed = True
            if self.response_started:
                self._close()
        else:
            if result is not None:
                logger.error("ASGI callable should return None, but returned '%s'.", result)
                self._close()
            elif not self.response_started and not self.disconnected:
                logger.error("ASGI callable returned without starting response.")
                failed = True
            elif not self.response_complete and not self.disconnected:
                logger.error("ASGI callable returned without completing response.")
                self._close()
        try:
            if failed and not self.response_started:
                await self._send_500()
        finally:
            self.conn = None
            self._leave = None

    async def _send_500(self) -> None:
        await self.send({"type": "http.response.start", "status": 500,
                         "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                     (b"content-length", b"21"), (b"connection", b"close")]})
        await self.send({"type": "http.response.body", "body": b"Internal Server Error",
                         "more_body": False})

    async def receive(self) -> Message:
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(_CONTINUE)
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            self.flow.resume_reading()
            if not self._news:
                waiter = self.loop.create_future()
                self._waiters.append(waiter)
                try:
                    await waiter
                finally:
                    self._waiters.remove(waiter)
            self._news = False
        if self.disconnected or self.response_complete:
            return _DISCONNECT.copy()
        body = b"".join(self.body)
        self.body.clear()
        self.body_size = 0
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def send(self, message: Message) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(
                    f"Expected ASGI message 'http.response.start', but got '{kind}'.")
            self._write_head(message["status"], message.get("headers", ()))
        elif not self.response_complete:
            if kind != "http.response.body":
                raise RuntimeError(
                    f"Expected ASGI message 'http.response.body', but got '{kind}'.")
            self._write_body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"Unexpected ASGI message '{kind}' sent, after response already "
                               "completed.")

    def _write_head(self, status: int, extra: Any) -> None:
        self.response_started = True
        self.waiting_for_100_continue = False
        content = [STATUS_LINE[status]]
        closes = False
        for name, value in (*self.default_headers, *extra):
            if HEADER_RE.search(name):
                raise RuntimeError("Invalid HTTP header name.")
            if HEADER_VALUE_RE.search(value):
                raise RuntimeError("Invalid HTTP header value.")
            name = name.lower()
            if name == b"content-length" and self.chunked_encoding is None:
                self.expected_content_length = int(value.decode())
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.expected_content_length = 0
                self.chunked_encoding = True
            elif name == b"connection":
                if b"close" in [token.lower().strip() for token in value.split(b",")]:
                    self.keep_alive = False
                    closes = True
            content.extend([name, b": ", value, b"\r\n"])
        if not self.keep_alive and not closes:
            content.append(b"connection: close\r\n")
        if self.chunked_encoding is None and not self.head and status not in (204, 304):
            # Neither a length nor an encoding given.
            self.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self._write(b"".join(content))

    def _write_body(self, body: bytes, more_body: bool) -> None:
        if self.head:
            self.expected_content_length = 0
        elif self.chunked_encoding:
            if body:
                self._write(b"%x\r\n%b\r\n%b" % (len(body), body,
                                                b"" if more_body else b"0\r\n\r\n"))
            elif not more_body:
                self._write(b"0\r\n\r\n")
        else:
            if len(body) > self.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length -= len(body)
            if body:
                self._write(body)
        if not more_body:
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self._complete()

    def _complete(self) -> None:
        self.response_complete = True
        self._leave = None
        self.wake()
        if not self.keep_alive:
            self._close()
        else:
            self.flush()
        if self.conn is not None:
            self.conn.on_response_complete()

    def _close(self) -> None:
        self.flush()  # what was gathered goes first
        self.transport.close()

    def _write(self, data: bytes) -> None:
        if self._held is not None:
            self._held.append(data)
        else:
            self.transport.write(data)

    # DirectBody (app/router/direct_body.py).

    def writer(self) -> ClientFlow | None:
        if (not self.response_started or self.response_complete
                or self.chunked_encoding is not True or self.head):
            return None
        self.flush()
        return self.flow

    async def drain(self) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        # What `send` does for a start and a last body message of a
        # response with its length, in one step and one write: one search
        # of all the names and one of all the values for what `send` refuses.
        if (self.response_started or self.disconnected or self.flow.write_paused
                or self.head or self._held is not None):
            return False
        every = [*self.default_headers, *headers]
        if (HEADER_RE.search(b"".join([name for name, _ in every]))
                or HEADER_VALUE_RE.search(b"\t".join([value for _, value in every]))):
            return False  # send refuses it, as before
        if (b"connection", b"close") in headers:
            self.keep_alive = False
        elif not self.keep_alive:
            every.append((b"connection", b"close"))
        self.response_started = True
        self.waiting_for_100_continue = False
        self.transport.write(b"".join([STATUS_LINE[status],
                                       *[b"%s: %s\r\n" % h for h in every], b"\r\n", body]))
        self._complete()
        return True

    def on_leave(self, callback: Callable[[], None]) -> None:
        if self.disconnected:
            callback()
        elif not self.response_complete:
            self._leave = callback

    def gather(self) -> None:
        if self._held is None:
            self._held = []

    def flush(self) -> None:
        held, self._held = self._held, None
        if held:
            self.transport.write(b"".join(held))


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


def _address(info: object, local: bool) -> tuple[str, int | None] | None:
    """A scope's `server` (`local`) or `client` from the transport's
    `sockname` or `peername`: host and port (IPv6 gives four fields), or for
    the server end of a Unix socket its path; None where there is neither."""
    if isinstance(info, tuple | list) and len(info) >= 2:
        return (str(info[0]), int(info[1]))
    if local and isinstance(info, str):
        return (info, None)
    return None


def _peer(client: tuple[str, int | None] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


def protocol(header_timeout: float, body_timeout: float) -> Callable[..., Http1]:
    """What uvicorn's `http=` takes: it makes each connection's protocol
    with its own keyword arguments, as it would a class; these limits
    (seconds) are added."""
    return functools.partial(Http1, header_timeout=header_timeout, body_timeout=body_timeout)
