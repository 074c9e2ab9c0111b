"""The router's HTTP client (app/router/upstream.py) against raw servers on
loopback that answer exactly as each case needs: kept-alive connections, a
server closing an idle one, bodies by length, chunks and close, a body cut
short, back-pressure, cancellation, and what it refuses to send."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import trustme

from app.router.request_line import UpstreamError
from app.router.upstream import Sink, UpstreamClient, origin, whole_chunks

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class Server:
    """A loopback server running `handler` per connection; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()  # a client closed a connection
        self.arrived = asyncio.Event()  # a request was read
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        """One request (head and Content-Length body); b"" at EOF."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.closed.set()
            return b""
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        self.arrived.set()
        return request

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 1)


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    c = UpstreamClient(connect_timeout=2.0)
    yield c
    await c.close()


async def serve(handler_of: Callable[[Server], Handler]) -> tuple[Server, str]:
    srv = Server(lambda r, w: handler_of(srv)(r, w))
    return srv, await srv.start()


def answer_ok_forever(srv: Server) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await srv.read_request(reader):
            writer.write(OK)
            await writer.drain()
    return handle


# An answer whose body stops 93 bytes short of its length.
CUT_SHORT = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial"


def answer_once(raw: bytes, linger: float = 0.0) -> Callable[[Server], Handler]:
    """Reads one request, sends `raw`, and closes `linger` s later."""
    def once(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(raw)
            await writer.drain()
            await asyncio.sleep(linger)
        return handle
    return once


def big_body(total: int) -> Callable[[Server], Handler]:
    """Answers with `total` bytes in 64 KiB writes, byte i of write n being n % 251."""
    def big(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
            for i in range(total // 65536):
                writer.write(bytes([i % 251]) * 65536)
                await writer.drain()
        return handle
    return big


class Taker(Sink):
    """A test's sink: `take` calls the function given (the router's own
    sink, relay_stream.py's chain, is a compiled class)."""

    def __init__(self, take: Callable[[bytes], bool]) -> None:
        self._take = take

    def take(self, data: bytes) -> bool:
        return self._take(data)


def whole(got: bytes | bytearray, total: int) -> bool:
    """`got` is all that `big_body(total)` sent, in order."""
    return len(got) == total and all(got[i * 65536] == i % 251 for i in range(total // 65536))


async def test_connections_are_kept_alive_and_reused(client: UpstreamClient) -> None:
    srv, url = await serve(answer_ok_forever)
    try:
        for _ in range(5):
            r = await client.post(url, "/v1/chat/completions", b'{"a": 1}',
                                  [(b"Authorization", b"Bearer k")])
            assert (r.status, await r.read()) == (200, b"{}")
            assert r.headers["content-type"] == "application/json"
            r.close()
        assert srv.connections == 1
        assert client.idle_count() == 1
        head = srv.requests[0]
        assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
        assert b"\r\nHost: 127.0.0.1:" in head and b"\r\nContent-Length: 8\r\n" in head
        assert b"\r\nAuthorization: Bearer k\r\n" in head and head.endswith(b'{"a": 1}')
    finally:
        await srv.close()


async def test_bytes_on_an_idle_connection_never_reach_the_next_answer(
        client: UpstreamClient) -> None:
    # A server that sends more after a whole answer (a stray response, a
    # bug): the next request must get its own answer, not those bytes.
    def chatty(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await srv.read_request(reader):
                writer.write(OK + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray")
                await writer.drain()
        return handle

    srv, url = await serve(chatty)
    try:
        for _ in range(3):
            r = await client.post(url, "/v1/completions", b"{}", [])
            assert await r.read() == b"{}"
            r.close()
            r.close()  # twice: still in the pool once at most
            assert client.idle_count() <= 1
            await asyncio.sleep(0.05)  # the stray bytes arrive on the idle connection
        assert srv.connections == 3  # each chatty connection was dropped, not reused
    finally:
        await srv.close()


async def test_a_kept_connection_the_server_closed_is_replaced_without_an_error(
        client: UpstreamClient) -> None:
    # The server answers once per connection, then closes it: as uvicorn does
    # with an idle connection after its keep-alive timeout.
    def once(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(OK.replace(b"Content-Type", b"Connection: keep-alive\r\nX-A"))
            await writer.drain()
        return handle

    srv, url = await serve(once)
    try:
        for _ in range(3):
            r = await client.post(url, "/v1/completions", b"{}", [])
            assert await r.read() == b"{}"
            r.close()
            await asyncio.sleep(0.05)  # the close reaches us (or races the next send)
        assert srv.connections == 3
        assert len(srv.requests) == 3
    finally:
        await srv.close()


async def test_a_request_sent_on_a_connection_closed_meanwhile_is_sent_once_more(
        client: UpstreamClient) -> None:
    # Kept alive, but the server closes without answering the second request:
    # the keep-alive race. Nothing was answered, so it goes on a new connection.
    def first_answers_second_dropped(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if srv.connections == 1:
                await srv.read_request(reader)
                writer.write(OK)
                await writer.drain()
                await srv.read_request(reader)  # read, then close with no answer
                return
            await answer_ok_forever(srv)(reader, writer)
        return handle

    srv, url = await serve(first_answers_second_dropped)
    try:
        for _ in range(2):
            r = await client.post(url, "/v1/completions", b"{}", [])
            assert await r.read() == b"{}"
            r.close()
        assert srv.connections == 2
        assert len(srv.requests) == 3  # the dropped one, then once more
    finally:
        await srv.close()


async def test_bodies_by_chunks_and_by_close_are_read_whole(client: UpstreamClient) -> None:
    def chunked_then_close(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
            await srv.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end")
            await writer.drain()
        return handle

    srv, url = await serve(chunked_then_close)
    try:
        r = await client.post(url, "/v1/completions", b"{}", [])
        assert await r.read() == b"hello world"
        r.close()
        r = await client.post(url, "/v1/completions", b"{}", [])
        assert await r.read() == b"until the end"
        r.close()
        assert client.idle_count() == 0  # a body ended by the close leaves nothing to reuse
    finally:
        await srv.close()


async def test_a_body_cut_short_raises_and_the_connection_is_not_reused(
        client: UpstreamClient) -> None:
    srv, url = await serve(answer_once(CUT_SHORT))
    try:
        r = await client.post(url, "/v1/completions", b"{}", [])
        assert await r.readany() == b"partial"
        with pytest.raises(UpstreamError, match="closed the connection"):
            await r.readany()
        r.close()
        assert client.idle_count() == 0
    finally:
        await srv.close()


async def test_garbage_refused_and_timeouts_are_upstream_errors() -> None:
    def garbage(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(1)
        return handle

    srv, url = await serve(garbage)
    client = UpstreamClient(connect_timeout=0.3)
    try:
        with pytest.raises(UpstreamError, match="not valid HTTP"):
            await client.post(url, "/v1/completions", b"{}", [])
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        with pytest.raises(UpstreamError, match="cannot connect"):
            await client.post(f"http://127.0.0.1:{port}", "/v1/completions", b"{}", [])
        # TEST-NET-1 (RFC 5737): nothing answers, the connect times out.
        with pytest.raises(UpstreamError, match=r"timed out|cannot connect"):
            await client.post("http://192.0.2.1:81", "/v1/completions", b"{}", [])
    finally:
        await client.close()
        await srv.close()


async def test_a_head_past_its_cap_is_refused_and_trailers_are_not_kept(
        client: UpstreamClient) -> None:
    """An answer's head is held to 64 KiB (llhttp itself sets no limit): a
    provider sending endless headers is cut off, not kept in memory; the
    trailers after a chunked body are read and dropped."""
    big = b"X-Filler: " + b"y" * 990 + b"\r\n"
    srv, url = await serve(answer_once(b"HTTP/1.1 200 OK\r\n" + big * 200 + b"\r\n", 1))
    try:
        with pytest.raises(UpstreamError, match="head passes 65536 bytes"):
            await client.post(url, "/v1/completions", b"{}", [])
    finally:
        await srv.close()
    trailers = b"".join(b"X-T%d: %s\r\n" % (i, b"t" * 100) for i in range(2000))
    srv, url = await serve(answer_once(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                                       b"X-Head: kept\r\n\r\n2\r\nok\r\n0\r\n"
                                       + trailers + b"\r\n"))
    try:
        r = await client.post(url, "/v1/completions", b"{}", [])
        assert await r.read() == b"ok"
        assert r.headers["x-head"] == "kept"
        conn = r._conn
        assert len(conn._header_list) == 2  # the head's two, none of the 2,000 trailers
        r.close()
    finally:
        await srv.close()


async def test_a_cancelled_request_closes_its_connection(client: UpstreamClient) -> None:
    def hold(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            await srv.read_request(reader)  # returns b"" when the client closes
        return handle

    srv, url = await serve(hold)
    try:
        task = asyncio.create_task(client.post(url, "/v1/completions", b"{}", []))
        await asyncio.wait_for(srv.arrived.wait(), 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(srv.closed.wait(), 1)  # the engine sees the client gone
        assert client.idle_count() == 0
    finally:
        await srv.close()


async def test_a_slow_reader_pauses_the_socket_and_loses_nothing(
        client: UpstreamClient) -> None:
    total = 4 * 1024 * 1024  # far above the high-water mark

    srv, url = await serve(big_body(total))
    try:
        r = await client.post(url, "/v1/completions", b"{}", [])
        await asyncio.sleep(0.3)  # the server writes while nobody reads
        conn = r._conn
        assert conn._paused, "the socket was not paused above the high-water mark"
        assert conn._buffered < 2 * 1024 * 1024
        got = bytearray()
        while chunk := await r.readany():
            got += chunk
        assert whole(got, total)
        r.close()
    finally:
        await srv.close()


async def test_header_values_and_targets_that_could_split_a_line_are_refused(
        client: UpstreamClient) -> None:
    with pytest.raises(UpstreamError, match="unsafe value"):
        await client.post("http://127.0.0.1:9", "/v1/completions", b"{}",
                          [(b"Accept-Encoding", b"gzip\r\nX-Injected: 1")])
    with pytest.raises(UpstreamError, match="unsafe request target"):
        await client.post("http://127.0.0.1:9", "/v1/completions?a=1 HTTP/1.1\r\nX: y", b"{}",
                          [])


def test_origins_of_base_urls() -> None:
    o = origin("https://api.example.com/openai/")
    assert (o.scheme, o.host, o.port, o.host_header, o.prefix) == (
        "https", "api.example.com", 443, b"api.example.com", b"/openai")
    o = origin("http://[::1]:8000")
    assert (o.host, o.port, o.host_header, o.prefix) == ("::1", 8000, b"[::1]:8000", b"")
    with pytest.raises(UpstreamError):
        origin("ftp://example.com")


async def test_https_providers_are_reached_over_verified_tls() -> None:
    # External models' providers are https: the certificate is checked
    # against the CA given (the system's by default) and the host name.
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    requests: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await reader.readuntil(b"\r\n\r\n"))
        await reader.readexactly(2)
        writer.write(OK)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    trusting_ctx = ssl.create_default_context()
    ca.configure_trust(trusting_ctx)
    trusting = UpstreamClient(connect_timeout=2.0, ssl_context=trusting_ctx)
    default = UpstreamClient(connect_timeout=2.0)
    try:
        r = await trusting.post(f"https://127.0.0.1:{port}/provider", "/v1/chat/completions",
                                b"{}", [])
        assert (r.status, await r.read()) == (200, b"{}")
        r.close()
        assert requests[0].startswith(b"POST /provider/v1/chat/completions HTTP/1.1\r\n")
        assert f"\r\nHost: 127.0.0.1:{port}\r\n".encode() in requests[0]
        with pytest.raises(UpstreamError, match="cannot connect"):
            await default.post(f"https://127.0.0.1:{port}", "/v1/chat/completions", b"{}", [])
        assert len(requests) == 1  # nothing was sent over the unverified connection
    finally:
        await trusting.close()
        await default.close()
        server.close()


async def test_a_piped_body_reaches_the_sink_a_read_at_a_time_without_a_task_step(
        client: UpstreamClient) -> None:
    gates = [asyncio.Event(), asyncio.Event()]  # one a request: the rest may come

    def bursts(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for more in gates:
                await srv.read_request(reader)
                # Three chunks in one write: one read on the other side.
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"2\r\nab\r\n2\r\ncd\r\n2\r\nef\r\n")
                await writer.drain()
                await more.wait()
                writer.write(b"2\r\ngh\r\n0\r\n\r\n")
                await writer.drain()
        return handle

    srv, url = await serve(bursts)
    try:
        r = await client.post(url, "/v1/completions", b"{}", [])
        got: list[bytes] = []
        steps = 0

        def sink(data: bytes) -> bool:
            got.append(data)
            if b"".join(got) == b"abcdef":
                gates[len(srv.requests) - 1].set()
            return True

        task = asyncio.create_task(r.pipe(Taker(sink)))
        while not task.done():
            steps += 1
            await asyncio.sleep(0)
        assert await task is True
        # What one read brought, in one piece; then the rest.
        assert got == [b"abcdef", b"gh"] or got == [b"ab", b"cdef", b"gh"], got
        assert b"".join(got) == b"abcdefgh"
        r.close()
        assert client.idle_count() == 1  # whole: reused
        # Piped, a read reaches the sink inside the connection's read
        # callback, where no task runs: the reading task takes no step a
        # chunk. (Asked of the running task, not by replacing a method: the
        # compiled router calls its own methods directly.)
        r = await client.post(url, "/v1/completions", b"{}", [])
        runs_in: list[asyncio.Task[object] | None] = []

        def sink_seen(data: bytes) -> bool:
            runs_in.append(asyncio.current_task())
            return sink(data)

        got.clear()
        assert await r.pipe(Taker(sink_seen)) is True
        assert b"".join(got) == b"abcdefgh"
        # What was buffered when the pipe began goes from the task; every
        # later read from the read callback.
        assert len(runs_in) > 1 and all(task is None for task in runs_in[1:]), (
            f"pieces handed over by a task step: {runs_in}")
        r.close()
    finally:
        await srv.close()


def test_whole_chunks_are_read_without_llhttp_and_anything_else_is_left_to_it() -> None:
    assert whole_chunks(b"2\r\nab\r\n") == b"ab"
    assert whole_chunks(b"2\r\nab\r\n3\r\ncde\r\n1\r\nf\r\n") == b"abcdef"
    assert whole_chunks(b"A\r\n0123456789\r\n") == b"0123456789"  # either case
    assert whole_chunks(b"0000000a\r\n0123456789\r\n") == b"0123456789"
    assert whole_chunks(b"4\r\na\r\nb\r\n") == b"a\r\nb"  # CRLF inside a chunk is data
    for read in (b"", b"2\r\nab", b"2\r\nab\r", b"2\r\nabc\r\n", b"2\r\nab\r\n1",
                 b"2\r\nab\r\n0\r\n\r\n",  # the last chunk: llhttp ends the message
                 b"0\r\n\r\n", b"2;x=y\r\nab\r\n",  # an extension
                 b"2 \r\nab\r\n", b"\r\nab\r\n", b"g\r\nab\r\n", b"-2\r\nab\r\n",
                 b"000000002\r\nab\r\n",  # nine digits
                 b"2\nab\n"):
        assert whole_chunks(read) is None, read


class FramedTaker(Taker):
    """A sink that takes whole chunks as they came (`take_framed`), as the
    router's chain does: records each read as ("framed", chunks) or
    ("parsed", data), and lets the server send its next write."""

    def __init__(self, took: asyncio.Event) -> None:
        super().__init__(self._parsed)
        self.seen: list[tuple[str, bytes]] = []
        self.body = bytearray()
        self.took = took

    def _parsed(self, data: bytes) -> bool:
        self.seen.append(("parsed", data))
        self.body += data
        self.took.set()
        return True

    def take_framed(self, data: bytes, framed: bytes) -> bool:
        self.seen.append(("framed", framed))
        self.body += data
        self.took.set()
        return True


async def test_reads_of_whole_chunks_reach_a_framing_sink_as_the_server_framed_them(
        client: UpstreamClient) -> None:
    """Whole chunks pass framed; a read that cuts a chunk, its size line or
    carries an extension goes through llhttp; the read after a cut is whole
    chunks again only once llhttp stands at a chunk's start. The 18-byte
    chunk below is cut after the first digit of its size ("1" | "2..."):
    read as if at a chunk's start, the rest would parse as two chunks of
    other bytes ("ab", then "hello world")."""
    cut_size = b"2\r\n" + b"ab\r\nb\r\nhello world" + b"\r\n"
    assert whole_chunks(cut_size) == b"abhello world"  # the misreading avoided
    writes = [b"2\r\nab\r\n", b"2\r\ncd\r\n3\r\nefg\r\n",
              b"4\r\nhi",  # a chunk cut in its data
              b"jk\r\n", b"2\r\nlm\r\n",
              b"2;ext=1\r\nno\r\n", b"2\r\npq\r\n",
              b"2\r\nrs\r\n1", cut_size, b"2\r\ntu\r\n"]
    took, piped = asyncio.Event(), asyncio.Event()

    def paced(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            await writer.drain()
            await piped.wait()
            for raw in writes:  # each its own read: the next once the last was taken
                took.clear()
                writer.write(raw)
                await writer.drain()
                await asyncio.wait_for(took.wait(), 5)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        return handle

    srv, url = await serve(paced)
    try:
        r = await client.post(url, "/v1/completions", b"{}", [])
        sink = FramedTaker(took)
        piped.set()  # the body comes once the pipe is on (set before pipe() yields)
        assert await r.pipe(sink) is True
        assert bytes(sink.body) == (b"abcdefghijklmnopqrs"
                                    + b"ab\r\nb\r\nhello world" + b"tu")
        assert sink.seen == [
            ("framed", b"2\r\nab\r\n"), ("framed", b"2\r\ncd\r\n3\r\nefg\r\n"),
            ("parsed", b"hi"), ("parsed", b"jk"), ("framed", b"2\r\nlm\r\n"),
            ("parsed", b"no"), ("framed", b"2\r\npq\r\n"),
            ("parsed", b"rs"),
            ("parsed", b"ab\r\nb\r\nhello world"), ("framed", b"2\r\ntu\r\n")], sink.seen
        r.close()
        assert client.idle_count() == 1  # whole: reused, llhttp ended it
    finally:
        await srv.close()


async def test_a_held_pipe_pauses_the_socket_and_loses_nothing(
        client: UpstreamClient) -> None:
    total = 4 * 1024 * 1024

    srv, url = await serve(big_body(total))
    try:
        r = await client.post(url, "/v1/completions", b"{}", [])
        got = bytearray()
        holds = 0

        def sink(data: bytes) -> bool:
            got.extend(data)
            return False  # the client's socket is always full

        while not await r.pipe(Taker(sink)):
            holds += 1
            conn = r._conn
            assert conn._paused, "a held pipe left the socket read"
            assert conn._sink is None
            await asyncio.sleep(0.01)  # the server writes while held
            assert conn._buffered < 2 * 1024 * 1024, "a held pipe buffered without bound"
        assert holds > 1
        assert whole(got, total)
        r.close()
    finally:
        await srv.close()


async def test_what_the_sink_raises_pipe_raises_and_the_connection_is_dropped(
        client: UpstreamClient) -> None:
    srv, url = await serve(answer_ok_forever)
    try:
        r = await client.post(url, "/v1/completions", b"{}", [])

        def sink(data: bytes) -> bool:
            raise UpstreamError("a chunk inflates past the limit")

        with pytest.raises(UpstreamError, match="inflates past"):
            await r.pipe(Taker(sink))
        r.close()
        assert client.idle_count() == 0
    finally:
        await srv.close()


async def test_a_piped_body_cut_short_raises(client: UpstreamClient) -> None:
    srv, url = await serve(answer_once(CUT_SHORT, linger=0.05))
    try:
        r = await client.post(url, "/v1/completions", b"{}", [])
        got: list[bytes] = []
        with pytest.raises(UpstreamError, match="closed the connection"):
            await r.pipe(Taker(lambda d: got.append(d) is None))
        assert got == [b"partial"]
        r.close()
        assert client.idle_count() == 0
    finally:
        await srv.close()


async def test_the_engine_s_time_ends_when_its_answer_arrives_not_when_it_is_read(
        client: UpstreamClient) -> None:
    """`Response.engine_seconds` (the engine's share, left out of the
    gateway's own-time histogram): from the request written to the arrival
    of what its reader was given. A reader that gets to an answer 0.4 s
    after it came (its loop busy elsewhere) is the gateway's delay, not the
    engine's 0.2 s; a stream's piped chunks do not move it."""
    def slow(srv: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            await asyncio.sleep(0.2)
            writer.write(OK)
            await writer.drain()
            await srv.read_request(reader)
            await asyncio.sleep(0.2)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n")
            await writer.drain()
            await asyncio.sleep(0.3)
            writer.write(b"2\r\ncd\r\n0\r\n\r\n")
            await writer.drain()
        return handle

    srv, url = await serve(slow)
    try:
        r = await client.post(url, "/v1/completions", b"{}", [])
        await asyncio.sleep(0.4)  # the answer is here, not yet read
        assert await r.read() == b"{}"
        assert 0.2 <= r.engine_seconds() < 0.35, r.engine_seconds()
        r.close()
        r = await client.post(url, "/v1/completions", b"{}", [])
        assert await r.readany() == b"ab"
        first = r.engine_seconds()
        assert 0.2 <= first < 0.35, first
        got: list[bytes] = []
        assert await r.pipe(Taker(lambda data: got.append(data) is None)) is True
        assert got == [b"cd"] and r.engine_seconds() == first
        r.close()
    finally:
        await srv.close()


@pytest.mark.parametrize("interim", [
    b"HTTP/1.1 100 Continue\r\n\r\n",
    b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"
    b"HTTP/1.1 103 Early Hints\r\nLink: </b.js>; rel=preload\r\n\r\n",
])
async def test_interim_answers_are_passed_over_for_the_final_one(
        client: UpstreamClient, interim: bytes) -> None:
    """A 1xx answer is interim (RFC 9110, 15.2): the answer is the one after."""
    srv, url = await serve(answer_once(
        interim + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Final: yes\r\n\r\n{}"))
    try:
        r = await client.post(url, "/v1/completions", b"{}", [])
        assert (r.status, r.headers.get("x-final"), "link" in r.headers) == (200, "yes", False)
        assert await r.read() == b"{}"
        r.close()
        assert client.idle_count() == 1  # whole, and reused
    finally:
        await srv.close()
