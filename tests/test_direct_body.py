"""A stream's body written straight to the client's socket
(app/gateway/http1.py, `RequestCycle` as the scope's `DirectBody`;
docs/design/hot-path.md, "A stream's chunks"): a real uvicorn server
in-process on llmgw's protocol, clients on raw sockets. The framing is the
ASGI send's own, the response still ends through its send, a client not
reading fills the socket, and a request leaves no reference cycle behind."""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import AsyncIterator
from typing import Any

import httptools
import pytest

from app.gateway.http1 import Http1, RequestCycle, protocol
from app.router.direct_body import DIRECT_BODY
from app.router.own_answers import send_whole
from tests.support.inprocess_server import serving

# Events, and chunks on either side of the writer's table of chunk heads
# (app/router/direct_body.py: below 4 KiB from the table, else formatted).
CHUNKS = [b"data: %d\n\n" % i for i in range(50)] + [
    b"data: " + bytes([c]) * (n - 8) + b"\n\n" for c, n in ((97, 4095), (98, 4096), (99, 70000))]
seen: dict[str, Any] = {}  # what the app found, per path


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    direct = scope.get(DIRECT_BODY)
    path = scope["path"]
    seen[path + ":before"] = direct is not None and direct.writer() is not None
    if path in ("/whole", "/whole-close", "/whole-asgi"):
        extra = [(b"connection", b"close")] if path == "/whole-close" else None
        sent = []

        async def counted(message: Any) -> None:
            sent.append(message["type"])
            await send(message)

        await send_whole(counted, 200, b'{"answer": "whole"}', extra,
                         direct=None if path == "/whole-asgi" else direct)
        seen[path] = direct is not None and direct.writer() is not None
        seen[path + ":messages"] = sent
        return
    if path.startswith("/leave"):
        # The client's leaving as the watch hears it (`on_leave`): told
        # before the stream starts; or only once the client has gone
        # (`receive` says so); or for a response that completes first.
        heard = seen[path] = []
        if path == "/leave-late":
            while (await receive())["type"] != "http.disconnect":
                pass
        direct.on_leave(lambda: heard.append(len(heard)))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        if path != "/leave-after":
            flow = direct.writer() if path == "/leave-streaming" else None
            for _ in range(300):  # until the client has gone
                if heard:
                    break
                if flow is not None:
                    flow.write_chunk(b"data: more\n\n")
                await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": False})
        return
    if path == "/plain":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        seen["/plain"] = direct is not None and direct.writer() is not None
        await send({"type": "http.response.body", "body": b"{}"})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    seen[path] = direct is not None and direct.writer() is not None
    if path == "/stream" and seen[path]:
        flow = direct.writer()
        for chunk in CHUNKS:
            if not flow.write_chunk(chunk):
                await direct.drain()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})
    elif path == "/flood" and seen[path]:
        full, flow = 0, direct.writer()
        for _ in range(2000):  # 128 MiB: far more than any socket holds
            if not flow.write_chunk(b"x" * 65536):
                full += 1
                seen["/flood:full"] = full
                await asyncio.wait_for(direct.drain(), 0.3)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    else:
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.fixture
async def server() -> AsyncIterator[int]:
    try:
        async with serving(app, http=protocol(30, 30)) as served:
            yield served.port
    finally:
        seen.clear()


class Reader:
    """A raw HTTP/1.1 client: the body de-chunked by httptools."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.body = bytearray()
        self.done = False

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done = True


async def ask(port: int, request: bytes,
              conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None,
              ) -> tuple[bytes, bytes]:
    """The raw answer (head and chunked body as sent) and the body."""
    r, w = conn or await asyncio.open_connection("127.0.0.1", port)
    w.write(request)
    reader, raw = Reader(), bytearray()
    while not reader.done:
        data = await asyncio.wait_for(r.read(65536), 5)
        assert data, f"closed before the answer's end: {bytes(raw)!r}"
        raw += data
        reader.parser.feed_data(data)
    if conn is None:
        w.close()
    return bytes(raw), bytes(reader.body)


def get(path: str, method: str = "GET") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode()


async def test_a_stream_written_directly_is_framed_as_uvicorn_frames_it(server: int) -> None:
    raw, body = await ask(server, get("/stream"))
    assert seen == {"/stream:before": False, "/stream": True}
    assert body == b"".join(CHUNKS) + b"data: [DONE]\n\n"
    head, _, chunked = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    # One chunk a write, then the last message's chunk and the end.
    assert chunked == b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in CHUNKS) \
        + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"


async def test_only_a_started_chunked_response_takes_direct_writes(server: int) -> None:
    await ask(server, get("/plain"))  # its length given: not chunked
    assert seen == {"/plain:before": False, "/plain": False}
    seen.clear()
    r, w = await asyncio.open_connection("127.0.0.1", server)
    w.write(get("/head", "HEAD"))
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    w.close()
    assert seen == {"/head:before": False, "/head": False}


async def test_a_client_not_reading_fills_the_socket_and_drain_waits(server: int) -> None:
    _, w = await asyncio.open_connection("127.0.0.1", server)
    w.write(get("/flood"))
    await asyncio.sleep(1.0)  # reading nothing
    # The app's writes stopped at a full socket; drain timed out waiting.
    assert seen.get("/flood") is True
    assert seen.get("/flood:full") == 1
    w.close()


async def test_a_request_leaves_no_reference_cycle(server: int) -> None:
    conn = await asyncio.open_connection("127.0.0.1", server)
    await ask(server, get("/stream"), conn)  # warm
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(20):
            await ask(server, get("/stream"), conn)
            await ask(server, get("/plain"), conn)
            await ask(server, get("/whole"), conn)
        gc.collect()
        left = [o for o in gc.garbage if isinstance(o, (RequestCycle, Http1))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        conn[1].close()
    # Each would be a request, its scope or its connection, freed only by
    # a collection: its pause grows with the requests served since the last.
    assert left == [], f"{len(left)} objects of 60 requests left to the collector"


def data_segments_in(sock: socket.socket) -> int:
    """Segments with data this socket has received (Linux's TCP_INFO,
    tcpi_data_segs_in)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
    return int.from_bytes(info[152:156], "little")


@pytest.mark.parametrize("path", ["/whole", "/whole-close"])
async def test_a_whole_answer_leaves_in_one_write(server: int, path: str) -> None:
    """Head and body gathered into one write: one system call and one
    packet, not two (a loopback write costs some 7 us of CPU here). The
    connection is kept, or closed after the answer when it says so."""
    r, w = await asyncio.open_connection("127.0.0.1", server)
    try:
        for i in range(2 if path == "/whole" else 1):
            raw, body = await ask(server, get(path), (r, w))
            assert raw.startswith(b"HTTP/1.1 200 OK\r\n") and body == b'{"answer": "whole"}'
            assert b"content-length: 19\r\n" in raw
            sock = w.get_extra_info("socket")
            assert data_segments_in(sock) == i + 1, raw  # one write each
        if path == "/whole-close":
            assert await asyncio.wait_for(r.read(), 5) == b""  # closed after the answer
        assert seen[path] is False  # complete: no direct write after it
    finally:
        w.close()


async def test_a_whole_answer_is_written_as_uvicorn_writes_it_without_its_messages(
        server: int) -> None:
    """The direct answer skips uvicorn's send (two ASGI messages, its
    header checks) and writes the very bytes it would have (date aside)."""
    r, w = await asyncio.open_connection("127.0.0.1", server)
    try:
        answers = []
        for path in ("/whole", "/whole-asgi", "/whole"):  # one kept connection
            raw, body = await ask(server, get(path), (r, w))
            assert body == b'{"answer": "whole"}'
            answers.append(b"\r\n".join(line for line in raw.split(b"\r\n")
                                         if not line.startswith(b"date: ")))
        assert seen["/whole:messages"] == []
        assert seen["/whole-asgi:messages"] == ["http.response.start", "http.response.body"]
        assert answers[0] == answers[1] == answers[2], answers
    finally:
        w.close()


async def test_a_request_pipelined_behind_a_direct_answer_is_served(server: int) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", server)
    try:
        w.write(get("/whole") + get("/whole"))  # both at once: the second waits
        got = b""
        while got.count(b'{"answer": "whole"}') < 2:
            more = await asyncio.wait_for(r.read(65536), 5)
            assert more, got
            got += more
        assert got.count(b"HTTP/1.1 200 OK\r\n") == 2
    finally:
        w.close()


async def test_the_clients_leaving_mid_response_is_heard_once_from_the_connection(
        server: int) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", server)
    w.write(get("/leave"))
    await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)  # the stream started
    w.close()
    for _ in range(300):
        if seen.get("/leave"):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # the app's last send, dropped: no second call
    assert seen["/leave"] == [0]


async def test_a_hook_set_after_the_client_left_is_called_at_once(server: int) -> None:
    _, w = await asyncio.open_connection("127.0.0.1", server)
    w.write(get("/leave-late"))
    await asyncio.sleep(0.1)
    w.close()  # before the app asks to hear of it
    for _ in range(300):
        if seen.get("/leave-late"):
            break
        await asyncio.sleep(0.01)
    assert seen["/leave-late"] == [0]


async def test_a_client_that_leaves_after_its_response_is_not_heard_leaving(
        server: int) -> None:
    _, body = await ask(server, get("/leave-after"))
    assert body == b"data: 1\n\n"
    await asyncio.sleep(0.1)  # the connection closed by `ask`
    assert seen["/leave-after"] == []


async def test_a_pipelining_client_that_leaves_is_heard_by_the_request_being_answered(
        server: int) -> None:
    # The second request waits behind the first, whose stream is under way:
    # the first's engine must hear the client go, not only the one waiting.
    r, w = await asyncio.open_connection("127.0.0.1", server)
    w.write(get("/leave-streaming") + get("/plain"))
    await asyncio.wait_for(r.readuntil(b"data: more"), 5)  # the stream is flowing
    w.transport.abort()  # gone, as a client that drops its connection
    for _ in range(300):
        if seen.get("/leave-streaming"):
            break
        await asyncio.sleep(0.01)
    assert seen["/leave-streaming"] == [0]
    assert "/plain" not in seen  # never answered: its client had gone
