"""A chunked answer as the router's HTTP client reads it
(app/router/upstream.py), held to llhttp's own reading of the same bytes
whole: the same body, the same end, the same keep-alive (the connection
back to the pool), and an error wherever llhttp finds one, whatever the
reads the answer arrives in (every cut into two reads, and a byte a read).
The answers come from a raw loopback server; the client is the router's."""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import AsyncIterator

import httptools
import pytest

from app.router.request_line import UpstreamError
from app.router.upstream import UpstreamClient

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

VALID = {
    "one chunk": HEAD + b"5\r\nhello\r\n0\r\n\r\n",
    "events": HEAD + b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in (
        b'data: {"a":1}\n\n', b'data: {"b":2}\n\n', b"data: [DONE]\n\n")) + b"0\r\n\r\n",
    "sizes in either case, leading zeros": HEAD + b"A\r\n0123456789\r\nb\r\n0123456789a\r\n"
                                                 b"0003\r\nxyz\r\n000\r\n\r\n",
    "extensions": HEAD + b"5;name=value\r\nhello\r\n3;x\r\nabc\r\n0;last\r\n\r\n",
    "trailers": HEAD + b"5\r\nhello\r\n0\r\nX-Checksum: 1\r\nX-Other: 2\r\n\r\n",
    "data holding CRLFs": HEAD + b"6\r\n\r\n\r\n\r\n\r\n0\r\n\r\n",
    "a 64 KiB chunk": HEAD + b"10000\r\n" + b"z" * 65536 + b"\r\n0\r\n\r\n",
    "no body": HEAD + b"0\r\n\r\n",
    "gzip, chunked": HEAD.replace(b"chunked", b"gzip, chunked") + b"3\r\nabc\r\n0\r\n\r\n",
    "Chunked": HEAD.replace(b"chunked", b"Chunked") + b"3\r\nabc\r\n0\r\n\r\n",
    "connection: close": HEAD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
                          + b"3\r\nabc\r\n0\r\n\r\n",
    "not chunked: by length": b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n"
                              b"X-Note: chunked elsewhere\r\n\r\nchunked",
}
INVALID = {
    "a size not hex": HEAD + b"zz\r\nhello\r\n0\r\n\r\n",
    "a size with 0x": HEAD + b"0x5\r\nhello\r\n0\r\n\r\n",
    "a size with a sign": HEAD + b"+5\r\nhello\r\n0\r\n\r\n",
    "a size with an underscore": HEAD + b"1_0\r\n0123456789abcdef\r\n0\r\n\r\n",
    "an empty size": HEAD + b"\r\nhello\r\n0\r\n\r\n",
    "a chunk longer than its size": HEAD + b"5\r\nhelloX\r\n0\r\n\r\n",
    "a chunk shorter than its size": HEAD + b"6\r\nhello\r\n0\r\n\r\n",
}


def llhttp(answer: bytes) -> tuple[bytes, bool, bool] | None:
    """llhttp's reading of `answer` whole: (body, ended, keep-alive), None
    for an error."""
    class Reader:
        body, ended, alive = b"", False, False

        def on_body(self, body: bytes) -> None:
            self.body += body

        def on_message_complete(self) -> None:
            self.ended, self.alive = True, parser.should_keep_alive()

    got = Reader()
    parser = httptools.HttpResponseParser(got)
    try:
        parser.feed_data(answer)
    except httptools.HttpParserError:
        return None
    return got.body, got.ended, got.alive


class Server:
    """Answers each request on a connection with `answer`, written in the
    reads `cuts` makes of it (a pause between writes, Nagle off); counts
    connections."""

    def __init__(self) -> None:
        self.answer, self.cuts = b"", [0]
        self.connections = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                edges = [*self.cuts, len(self.answer)]
                for start, end in itertools.pairwise(edges):
                    writer.write(self.answer[start:end])
                    await writer.drain()
                    await asyncio.sleep(0.002)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def rig() -> AsyncIterator[tuple[Server, str, UpstreamClient]]:
    srv = Server()
    server = await asyncio.start_server(srv.serve, "127.0.0.1", 0)
    client = UpstreamClient(connect_timeout=2.0)
    try:
        yield srv, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", client
    finally:
        await client.close()
        server.close()


async def read(client: UpstreamClient, url: str) -> tuple[bytes, bool] | None:
    """The body as the router's client reads it, and whether its connection
    went back to the pool; None for an UpstreamError."""
    r = await client.post(url, "/v1/completions", b"{}", [])
    idle = client.idle_count()  # without this answer's connection
    try:
        body = await asyncio.wait_for(r.read(), 5)
    except UpstreamError:
        return None
    finally:
        r.close()
    return body, client.idle_count() > idle


def cuts_of(answer: bytes) -> list[list[int]]:
    """Every cut of `answer` into two reads, and one read a byte (not for
    the long ones: a read of each of their first and last 300 bytes)."""
    n = len(answer)
    if n > 1000:
        return [[0, *range(1, 300), *range(n - 300, n)], [0, n // 2]]
    return [[0]] + [[0, k] for k in range(1, n)] + [list(range(n))]


@pytest.mark.parametrize("name", VALID)
async def test_a_valid_answer_reads_as_llhttp_reads_it_whatever_its_reads(
        rig: tuple[Server, str, UpstreamClient], name: str) -> None:
    srv, url, client = rig
    answer = VALID[name]
    expected = llhttp(answer)
    assert expected is not None and expected[1], "llhttp reads the case whole"
    body, _, alive = expected
    for cuts in cuts_of(answer):
        srv.answer, srv.cuts = answer, cuts
        assert await read(client, url) == (body, alive), (name, cuts)


@pytest.mark.parametrize("name", INVALID)
async def test_an_answer_llhttp_refuses_is_an_upstream_error_whatever_its_reads(
        rig: tuple[Server, str, UpstreamClient], name: str) -> None:
    srv, url, client = rig
    answer = INVALID[name]
    assert llhttp(answer) is None, "llhttp refuses the case"
    for cuts in cuts_of(answer):
        srv.answer, srv.cuts = answer, cuts
        assert await read(client, url) is None, (name, cuts)


async def test_a_stream_s_answers_one_after_another_reuse_one_connection(
        rig: tuple[Server, str, UpstreamClient]) -> None:
    """Answers chunked and not, one after another on one connection."""
    srv, url, client = rig
    for answer in (VALID["events"], VALID["not chunked: by length"], VALID["trailers"],
                   VALID["events"]):
        srv.answer, srv.cuts = answer, [0]
        expected = llhttp(answer)
        assert expected is not None
        assert await read(client, url) == (expected[0], True)
    assert srv.connections == 1
