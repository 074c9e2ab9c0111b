"""The gateway's HTTP/1.1 protocol (app/gateway/http1.py) beside uvicorn's
own httptools protocol: the same app on two real uvicorn servers in-process,
the same raw requests to both, and the same bytes back (the date aside) and
the same scopes handed to the app. What the gateway adds of its own (the
header and body limits, the keep-alive timer) is in tests/test_edge.py and
tests/test_keep_alive.py; a stream's direct writes in test_direct_body.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httptools
import pytest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.gateway.http1 import MAX_HEAD, protocol
from app.router.access import ARRIVED
from app.router.direct_body import DIRECT_BODY
from tests.support.inprocess_server import serving

scopes: list[dict[str, Any]] = []  # what the app was given, request by request


failures: list[Exception] = []  # what the app's sends raised (/slow)


async def read_body(receive: Any) -> bytes:
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return body + b"<gone>"
        body += message["body"]
        if not message["more_body"]:
            return body


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    seen = {k: v for k, v in scope.items() if k not in (DIRECT_BODY, ARRIVED)}
    seen["client"] = seen["server"] = None  # ports differ between the two servers
    scopes.append(seen)
    path = scope["path"]

    async def start(status: int = 200, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers or []})

    if path == "/plain":
        await start(200, [(b"content-length", b"2"), (b"X-Mixed", b"Case")])
        await send({"type": "http.response.body", "body": b"ok"})
    elif path == "/chunked":
        await start(200, [(b"content-type", b"text/plain")])
        for part in (b"a", b"", b"bc"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    elif path == "/echo":
        body = await read_body(receive)
        await start(200, [(b"content-length", str(len(body)).encode())])
        await send({"type": "http.response.body", "body": body})
    elif path == "/scope":
        text = repr(sorted((k, repr(v)) for k, v in seen.items())).encode()
        await start(200, [(b"content-length", str(len(text)).encode())])
        await send({"type": "http.response.body", "body": text})
    elif path == "/204":
        await start(204)
        await send({"type": "http.response.body", "body": b""})
    elif path == "/close":
        await start(200, [(b"content-length", b"1"), (b"connection", b"Keep-Alive, Close")])
        await send({"type": "http.response.body", "body": b"x"})
    elif path == "/error-before":
        raise RuntimeError("the app failed before its answer")
    elif path == "/error-after":
        await start(200, [(b"content-length", b"10")])
        await send({"type": "http.response.body", "body": b"12345", "more_body": True})
        raise RuntimeError("the app failed halfway")
    elif path == "/short":
        await start(200, [(b"content-length", b"5")])
        await send({"type": "http.response.body", "body": b"12"})
    elif path == "/long":
        await start(200, [(b"content-length", b"1")])
        await send({"type": "http.response.body", "body": b"12"})
    elif path == "/bad-header":
        await start(200, [(b"x-bad", b"a\nb"), (b"content-length", b"0")])
    elif path == "/twice":
        await start(200, [(b"content-length", b"0")])
        await send({"type": "http.response.body", "body": b""})
        await send({"type": "http.response.body", "body": b""})
    elif path == "/slow":  # its answer still under way when the next request is refused
        try:
            await start(200, [(b"content-type", b"text/plain")])
            await asyncio.sleep(0.3)
            await send({"type": "http.response.body", "body": b"late", "more_body": False})
        except Exception as exc:
            failures.append(exc)
    elif path == "/none":
        return
    elif path == "/wrong-first":
        await send({"type": "http.response.body", "body": b"x"})
    else:
        await start(404, [(b"content-length", b"0")])
        await send({"type": "http.response.body", "body": b""})


@contextlib.asynccontextmanager
async def both(**config: Any) -> AsyncIterator[tuple[int, int]]:
    """`app` on uvicorn's protocol and on ours: their ports."""
    async with serving(app, http=HttpToolsProtocol, server_header=False, **config) as theirs, \
            serving(app, http=protocol(30, 30), server_header=False, **config) as ours:
        yield theirs.port, ours.port


@pytest.fixture
async def ports() -> AsyncIterator[tuple[int, int]]:
    """(uvicorn's protocol, ours)."""
    async with both() as p:
        yield p


class Answers:
    """Counts the complete responses in what a client read."""

    def __init__(self, head: bool = False) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done = 0
        self.head = head

    def on_headers_complete(self) -> None:
        if self.head:  # a HEAD answer has no body, whatever its head says
            self.done += 1

    def on_message_complete(self) -> None:
        self.done += 1


async def exchange(port: int, request: bytes, answers: int, head: bool = False,
                   pause_after: bytes | None = None) -> bytes:
    """What the server sends back for `request`, once `answers` responses
    are complete or it closes the connection (date lines taken out).
    `pause_after`: sent in two parts, split after these bytes."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    if pause_after is not None:
        first, rest = request.split(pause_after, 1)
        w.write(first + pause_after)
        await asyncio.sleep(0.05)
        request = rest
    w.write(request)
    got, counter = b"", Answers(head)
    try:
        while counter.done < answers:
            data = await asyncio.wait_for(r.read(65536), 5)
            if not data:
                break
            got += data
            with contextlib.suppress(httptools.HttpParserError):
                counter.parser.feed_data(data)
        if counter.done >= answers:  # anything more, or a close, soon after
            with contextlib.suppress(asyncio.TimeoutError):
                got += await asyncio.wait_for(r.read(65536), 0.1)
    finally:
        w.close()
    return b"\r\n".join(line for line in got.split(b"\r\n") if not line.startswith(b"date: "))


def req(method: str, path: str, headers: str = "", body: bytes = b"",
        version: str = "1.1") -> bytes:
    return f"{method} {path} HTTP/{version}\r\nHost: t\r\n{headers}\r\n".encode() + body


CASES: dict[str, tuple[bytes, int]] = {
    "plain": (req("GET", "/plain"), 1),
    "http/1.0": (req("GET", "/plain", version="1.0"), 1),
    "http/1.0 kept alive": (req("GET", "/plain", "Connection: keep-alive\r\n", version="1.0"),
                            1),
    "connection close asked": (req("GET", "/plain", "Connection: close\r\n"), 1),
    "chunked answer": (req("GET", "/chunked"), 1),
    "chunked answer, http/1.0": (req("GET", "/chunked", version="1.0"), 1),
    "body with its length": (req("POST", "/echo", "Content-Length: 5\r\n", b"hello"), 1),
    "empty body": (req("POST", "/echo", "Content-Length: 0\r\n"), 1),
    "chunked body": (req("POST", "/echo", "Transfer-Encoding: chunked\r\n",
                         b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"), 1),
    "a body of 200 KiB": (req("POST", "/echo", "Content-Length: 204800\r\n",
                              b"z" * 204800), 1),
    "expect 100-continue": (req("POST", "/echo", "Expect: 100-continue\r\n"
                                "Content-Length: 3\r\n", b"abc"), 1),
    "pipelined": (req("GET", "/plain") + req("POST", "/echo", "Content-Length: 2\r\n", b"hi")
                  + req("GET", "/chunked") + req("GET", "/scope?n=4"), 4),
    "scope": (req("GET", "/scope?a=1&b=%20x", "X-Pad:  padded \t\r\nX-Two: 1\r\nx-two: 2\r\n"
                  "Expect: 100-Continue\r\n"), 1),
    "escaped path": (req("GET", "/%7Escope%20x"), 1),
    "absolute form": (b"GET http://t:80/scope?q HTTP/1.1\r\nHost: t\r\n\r\n", 1),
    "204": (req("GET", "/204"), 1),
    "the app closes": (req("GET", "/close"), 1),
    "error before the answer": (req("GET", "/error-before"), 1),
    "error halfway": (req("GET", "/error-after"), 1),
    "shorter than its length": (req("GET", "/short"), 1),
    "longer than its length": (req("GET", "/long"), 1),
    "a header value refused": (req("GET", "/bad-header"), 1),
    "two last messages": (req("GET", "/twice"), 1),
    "no answer": (req("GET", "/none"), 1),
    "body before start": (req("GET", "/wrong-first"), 1),
    "not found": (req("DELETE", "/nowhere"), 1),
    "not http": (b"NONSENSE\r\n\r\n", 1),
    "bad header line": (b"GET /plain HTTP/1.1\r\nHost t\r\n\r\n", 1),
    "bad chunk size": (req("POST", "/echo", "Transfer-Encoding: chunked\r\n", b"zz\r\n"), 1),
    "connect": (b"CONNECT t:443 HTTP/1.1\r\nHost: t:443\r\n\r\n", 1),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_the_same_bytes_as_uvicorns_protocol(ports: tuple[int, int], case: str) -> None:
    request, answers = CASES[case]
    scopes.clear()
    theirs = await exchange(ports[0], request, answers)
    their_scopes = list(scopes)
    scopes.clear()
    ours = await exchange(ports[1], request, answers)
    assert ours == theirs
    assert scopes == their_scopes
    # Something came back, so the comparison compared something; but for
    # a header refused after the answer was marked started: both close
    # without a byte.
    assert bool(theirs) is (case != "a header value refused"), theirs


async def test_a_head_answer_and_a_request_split_across_reads(ports: tuple[int, int]) -> None:
    for request, split in ((req("HEAD", "/plain"), None), (req("HEAD", "/chunked"), None),
                           (req("POST", "/echo", "Content-Length: 5\r\n", b"hello"), b"he"),
                           (req("GET", "/scope?x"), b"GET /sc"),
                           (req("POST", "/echo", "Transfer-Encoding: chunked\r\n",
                                b"3\r\nabc\r\n0\r\n\r\n"), b"3\r\na")):
        theirs = await exchange(ports[0], request, 1, head=request.startswith(b"HEAD"),
                                pause_after=split)
        ours = await exchange(ports[1], request, 1, head=request.startswith(b"HEAD"),
                              pause_after=split)
        assert ours == theirs, request
        assert theirs.startswith(b"HTTP/1.1 200 OK\r\n"), theirs


@pytest.mark.parametrize("bind", ["127.0.0.1", "::1"])
async def test_the_scope_names_both_ends_of_the_connection(bind: str) -> None:
    """The scope's `client` and `server`: the connection's two addresses,
    host and port, as uvicorn's protocol gives them (IPv6's too, whose
    addresses the socket gives as four fields)."""
    ends: list[tuple[Any, Any]] = []

    async def addresses(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        ends.append((scope["client"], scope["server"]))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    for http in (HttpToolsProtocol, protocol(30, 30)):
        async with serving(addresses, bind=bind, http=http) as served:
            r, w = await asyncio.open_connection(bind, served.port)
            w.write(req("GET", "/"))
            assert (await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)).startswith(
                b"HTTP/1.1 200")
            mine = w.get_extra_info("sockname")
            w.close()
        assert ends.pop() == ((bind, mine[1]), (bind, served.port)), http


async def test_the_concurrency_limit_answers_503() -> None:
    async with both(limit_concurrency=1) as ports:
        answers = [await exchange(port, req("GET", "/plain"), 1) for port in ports]
    assert answers[0] == answers[1]
    assert answers[0].startswith(b"HTTP/1.1 503"), answers[0]


async def test_a_client_gone_mid_body_is_told_to_the_app() -> None:
    got: list[bytes] = []

    async def reading(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            got.append(await read_body(receive))

    async with serving(reading, http=protocol(30, 30)) as served:
        _, w = await asyncio.open_connection("127.0.0.1", served.port)
        w.write(req("POST", "/echo", "Content-Length: 10\r\n", b"12345"))
        await asyncio.sleep(0.1)
        w.close()
        for _ in range(200):
            if got:
                break
            await asyncio.sleep(0.01)
    assert got == [b"12345<gone>"]


async def test_shutdown_closes_an_idle_connection_and_lets_a_busy_one_finish() -> None:
    release = asyncio.Event()

    async def slow(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/slow":
            await release.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async with serving(slow, http=protocol(30, 30)) as served:
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", served.port)
        idle_w.write(req("GET", "/fast"))
        assert (await asyncio.wait_for(idle_r.readuntil(b"ok"), 5)).startswith(b"HTTP/1.1 200")
        busy_r, busy_w = await asyncio.open_connection("127.0.0.1", served.port)
        busy_w.write(req("GET", "/slow"))
        await asyncio.sleep(0.1)
        served.server.should_exit = True
        assert await asyncio.wait_for(idle_r.read(), 5) == b""  # closed at once
        assert not served.task.done()  # waiting for the busy one
        release.set()
        answer = await asyncio.wait_for(busy_r.read(), 5)  # answered, then closed
        assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer
        await asyncio.wait_for(served.task, 5)
        idle_w.close()
        busy_w.close()


@pytest.mark.parametrize("where", ["headers", "target"])
async def test_a_head_past_its_cap_is_refused_431_and_closed(where: str) -> None:
    """A request's line and headers are held in memory until they are all
    in: past MAX_HEAD bytes the connection is answered 414 (its target) or
    431 (its headers) and closed,
    however fast they come (uvicorn's protocol took 40 MB of headers)."""
    filler = b"v" * 200
    async with serving(app, http=protocol(30, 30)) as served:
        # Just under the cap: served.
        fits = b"".join(b"X-H%d: %s\r\n" % (i, filler) for i in range(MAX_HEAD // 260))
        ok = await exchange(served.port, b"GET /plain HTTP/1.1\r\nHost: t\r\n" + fits + b"\r\n", 1)
        assert ok.startswith(b"HTTP/1.1 200 OK"), ok[:100]
        r, w = await asyncio.open_connection("127.0.0.1", served.port)
        if where == "target":
            w.write(b"GET /" + b"a" * (MAX_HEAD + 1) + b" HTTP/1.1\r\nHost: t\r\n\r\n")
        else:
            # Past the cap, never ended (megabytes: the next test).
            w.write(b"GET /plain HTTP/1.1\r\nHost: t\r\n" + b"".join(
                b"X-H%d: %s\r\n" % (i, filler) for i in range(MAX_HEAD // 200 + 20)))
        got = await asyncio.wait_for(r.read(), 5)  # then closed
        w.close()
    status = (b"414 Request-URI Too Long" if where == "target"
              else b"431 Request Header Fields Too Large")
    assert got.startswith(b"HTTP/1.1 " + status + b"\r\n"), got[:100]
    assert b"connection: close" in got


async def test_a_client_writing_on_past_the_cap_still_reads_its_431() -> None:
    """A client that sends megabytes of headers reads the 431 all the same:
    after a refusal the connection half-closes and reads on (dropping what
    comes) until the client closes or a while passes, as nginx's lingering
    close does; a close with unread bytes was a reset, which destroyed the
    answer on its way (test_a_head_past_its_cap_is_refused_431_and_closed)."""
    line = b"X-Filler: " + b"v" * 1000 + b"\r\n"
    async with serving(app, http=protocol(30, 30)) as served:
        for _ in range(3):
            r, w = await asyncio.open_connection("127.0.0.1", served.port)

            async def flood(w: asyncio.StreamWriter = w) -> None:
                with contextlib.suppress(ConnectionError):
                    w.write(b"GET /plain HTTP/1.1\r\nHost: t\r\n")
                    for _ in range(4000):  # 4 MB
                        w.write(line * 4)
                        await w.drain()
                    w.close()

            sending = asyncio.create_task(flood())
            try:
                got = await asyncio.wait_for(r.read(), 10)
            except ConnectionResetError as exc:
                got = repr(exc).encode()
            await asyncio.wait_for(sending, 10)
            w.close()
            assert got.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), got[:100]


async def test_a_refusal_behind_an_answer_under_way_closes_without_lingering() -> None:
    """A request llhttp refuses while the answer before it is still being
    written: the connection is closed as before (the late answer's writes
    are dropped), not half-closed, which would make them raise."""
    failures.clear()
    async with serving(app, http=protocol(30, 30)) as served:
        r, w = await asyncio.open_connection("127.0.0.1", served.port)
        w.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\nNOT HTTP\r\n\r\n")
        got = await asyncio.wait_for(r.read(), 5)
        w.close()
        await asyncio.sleep(0.5)  # the late answer's send
    assert b"400 Bad Request" in got, got[:200]
    assert failures == []
