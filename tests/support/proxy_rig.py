"""The /v1 proxy in-process: a route table filled by hand, engines stood in by
aiohttp.web apps on loopback ports, the ASGI app called directly (through
httpx.ASGITransport, or by hand where a test must see or cut a stream).
The proxy's own client (app/router/upstream.py) does the forwarding, told
to record every attempt it makes."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import socket
import weakref
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import httpx
from aiohttp import web
from aiohttp.test_utils import TestServer

from app.router.access import Tracer
from app.router.direct_body import DIRECT_BODY, ClientFlow
from app.router.outcome import Outcome
from app.router.proxy import Proxy
from app.router.published import CatalogEntry, Endpoint, KeyGrant
from app.router.table import RouteTable
from app.router.timeouts import Timeouts
from app.router.upstream import UpstreamClient

CLIENT_KEY = "sk-client-key-0123456789"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hello"}]
# Two SSE events, the second torn: what an engine dying mid-write leaves.
TORN = b'data: {"n": 1}\n\ndata: {"n": 2, "te'


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Upstream:
    """An engine stand-in that records what reached it (any path).

    mode: "ok" answers JSON naming itself; "502"/"503" answer that status
    (after `delay` seconds); "gzip" answers JSON gzip-compressed when the
    request accepts gzip; "gzip-stream" likewise as SSE, "gzip-stream-anyway"
    whatever the request accepts (a provider ignoring it); "hold" never
    answers; "stream" sends one SSE chunk, then the rest once `release` is
    set; "endless" streams until the connection closes; "silent" sends one
    chunk, then nothing; "silent-start" sends headers, then nothing; "die"
    sends `TORN` and drops the connection; "die-early" sends headers and
    drops it; "die-plain" sends half a JSON answer and drops it; "500:TEXT"
    answers 500 as llama-cpp-python does, TEXT its message. `closed` is
    set when a held connection is closed by the proxy.
    """

    def __init__(self, name: str, mode: str, delay: float = 0.0) -> None:
        self.name, self.mode, self.delay = name, mode, delay
        self.seen: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.paths: list[str] = []  # path and query string of each request
        self.raw: list[bytes] = []  # each request's body as it came
        self.release = asyncio.Event()
        self.arrived = asyncio.Event()  # a request reached this engine
        self.closed = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # aiohttp lets a handler run on when its client leaves, unless told:
        # vLLM does stop (it listens for the disconnect).
        self.server = TestServer(app, host="127.0.0.1", handler_cancellation=True)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(request.path_qs)
        raw = await request.read() if request.can_read_body else b""
        self.raw.append(raw)
        body = json.loads(raw) if raw else {}
        self.seen.append((dict(request.headers), body))
        self.arrived.set()
        try:
            return await self._answer(request, body)
        except (asyncio.CancelledError, ConnectionResetError):  # the proxy closed it
            self.closed.set()
            raise

    async def _answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if self.delay:
            await asyncio.sleep(self.delay)
        gzipped = ("gzip" in request.headers.get("Accept-Encoding", "")
                   or self.mode.endswith("-anyway"))
        if self.mode in ("502", "503"):
            return web.json_response({"error": "busy"}, status=int(self.mode))
        if self.mode.startswith("500:"):  # llama-cpp-python's answer to any exception
            return web.json_response({"error": {
                "message": self.mode[4:], "type": "internal_server_error", "param": None,
                "code": None}}, status=500)
        if self.mode == "ok":
            return web.json_response({"served_by": self.name, "model": body.get("model")})
        if self.mode == "gzip":
            raw = json.dumps({"served_by": self.name, "pad": "x" * 200}).encode()
            if not gzipped:
                return web.Response(body=raw, content_type="application/json")
            return web.Response(body=gzip.compress(raw), content_type="application/json",
                                headers={"Content-Encoding": "gzip"})
        if self.mode == "hold":
            await asyncio.Event().wait()  # ends only by cancellation
        if self.mode == "die-plain":
            resp = web.StreamResponse(headers={"Content-Type": "application/json",
                                               "Content-Length": "100"})
            await resp.prepare(request)
            await resp.write(b'{"served_by": ')
            return self._drop(request, resp)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if self.mode.startswith("gzip-stream") and gzipped:
            resp.headers["Content-Encoding"] = "gzip"
        await resp.prepare(request)
        if self.mode.startswith("gzip-stream"):
            packer = zlib.compressobj(wbits=31) if gzipped else None
            for event in (b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"):
                if packer is not None:
                    event = packer.compress(event) + packer.flush(zlib.Z_SYNC_FLUSH)
                await resp.write(event)
            if packer is not None:
                await resp.write(packer.flush())
            await resp.write_eof()
            return resp
        if self.mode == "die-early":
            return self._drop(request, resp)
        if self.mode == "die":
            await resp.write(TORN)
            return self._drop(request, resp)
        if self.mode == "stream":
            await resp.write(b'data: {"n": 1}\n\n')
            await self.release.wait()
            await resp.write(b'data: {"n": 2}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if self.mode == "silent":  # one chunk, then nothing, like a stalled engine
            await resp.write(b'data: {"n": 1}\n\n')
        if self.mode in ("silent", "silent-start"):
            await asyncio.Event().wait()  # ends only by cancellation
        while True:  # endless, until cancelled
            await resp.write(b'data: {"tick": 1}\n\n')
            await asyncio.sleep(0.01)

    def _drop(self, request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
        """Drops the connection mid-answer, as an engine process dying does."""
        assert request.transport is not None
        request.transport.abort()
        return resp


class Observed:
    """A `RequestObserver` that keeps what it is told."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        # (seconds, first_byte, prompt, completion) of each, as `seen`.
        self.details: list[tuple[float, float | None, int, int]] = []
        self.prompts: list[tuple[str, int]] = []  # counted after their stream
        self.continuations: list[tuple[str, str]] = []  # (model, outcome) of each
        self.outcomes: list[Outcome] = []  # whole, as `seen`
        self.any = asyncio.Event()

    def observe(self, outcome: Outcome) -> None:
        self.seen.append((outcome.model, outcome.status))
        self.details.append((outcome.seconds, outcome.first_byte, outcome.prompt,
                             outcome.completion))
        self.outcomes.append(outcome)
        self.any.set()

    def prompt_counted(self, model: str, tokens: int) -> None:
        self.prompts.append((model, tokens))

    def continued(self, model: str, outcome: str) -> None:
        self.continuations.append((model, outcome))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Rig:
    """A proxy over a hand-filled table, its upstreams, and what its session tried."""

    def __init__(self, timeouts: Timeouts | None = None, tracer: Tracer | None = None) -> None:
        self.clock = FakeClock()  # the route table's (cooldowns)
        self.table = RouteTable(clock=self.clock)
        # Draws always start at the first endpoint: with equal loads the
        # first listed is tried first, so retry order is known.
        self.table.rand = lambda: 0.0
        self.table.set_catalog([CatalogEntry("small", ("tiny",), 1),
                                CatalogEntry("other", (), 2)])
        self.table.set_client_keys({hash_key(CLIENT_KEY): KeyGrant("k1", "tests")})
        self.attempts: list[str] = []  # every URL the proxy's session posted to
        self.upstreams: list[Upstream] = []
        self.observed = Observed()
        self.timeouts = timeouts or Timeouts(connect=2, first_byte=10, idle=10, request=10,
                                             cooldown=5)
        client = UpstreamClient(self.timeouts.connect)
        client.on_request = self.attempts.append
        self.proxy = Proxy(self.table, hash_key, self.timeouts, observer=self.observed,
                           client=client, tracer=tracer)
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.proxy),
                                      base_url="http://gateway")

    async def upstream(self, name: str, mode: str = "ok", delay: float = 0.0) -> Upstream:
        up = Upstream(name, mode, delay)
        await up.server.start_server()
        self.upstreams.append(up)
        return up

    def route(self, model: str, *eps: tuple[str, str]) -> None:
        """Routes `model` to (replica id, url) pairs; replica X's engine key is "engine-key-X"."""
        self.table.set_endpoints({model: [Endpoint(rid, url, f"engine-key-{rid}")
                                          for rid, url in eps]})

    async def chat(self, model: str, key: str | None = CLIENT_KEY) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return await self.http.post(CHAT, json={"model": model, "messages": MESSAGES},
                                    headers=headers)

    async def close(self) -> None:
        await self.http.aclose()
        await self.proxy.stop()
        for up in self.upstreams:
            await up.server.close()


class _Socket:
    """The client's socket under an AsgiCall's ClientFlow: never closing,
    each write handed to the call. It holds the call weakly: the call holds
    the flow, which holds it, and a request must leave no cycle for the
    collector (tests/test_request_life.py)."""

    def __init__(self, call: AsgiCall) -> None:
        self._call = weakref.ref(call)

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        call = self._call()
        assert call is not None
        call._wrote(data)


class _Leaving(asyncio.Event):
    """The client's leaving: `set()` also calls the hook the watch gave the
    server (`DirectBody.on_leave`), as `llmgw serve`'s connection does."""

    def __init__(self) -> None:
        super().__init__()
        self.hook: Callable[[], None] | None = None

    def set(self) -> None:
        super().set()
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()


class AsgiCall:
    """One POST driven through the ASGI app by hand, to see and cut a stream.

    `direct`: the server also offers the body's direct writes, as `llmgw
    serve`'s does (app/router/direct_body.py; app/gateway/http1.py's
    `RequestCycle`): a piped stream's chunks arrive here as body
    messages all the same, and a client not reading fills the socket."""

    def __init__(self, proxy: Proxy, body: dict[str, Any], path: str = CHAT,
                 direct: bool = False) -> None:
        self.sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.leave = _Leaving()  # set: the client disconnects
        self.stop_reading = False  # set: every later send blocks (a client not reading)
        self.direct_writes = 0
        self.gathered = 0  # whole answers gathered into one write
        self.answered = 0  # whole answers written directly, without messages
        self._started = self._complete = False
        self._body: bytes | None = json.dumps(body).encode()
        scope: dict[str, Any] = {
            "type": "http", "method": "POST", "path": path, "query_string": b"",
            "headers": [(b"authorization", f"Bearer {CLIENT_KEY}".encode()),
                        (b"content-type", b"application/json")]}
        if direct:
            scope[DIRECT_BODY] = self
        # The server's own writer of a stream's chunks, over a socket that
        # hands each write to `_wrote`.
        self._flow = ClientFlow(cast(asyncio.Transport, _Socket(self)))
        self.task = asyncio.create_task(proxy(scope, self._receive, self._send))

    # --- the DirectBody a server offers (direct=True) ---------------------------------

    def writer(self) -> ClientFlow | None:
        return self._flow if self._started and not self._complete else None

    def _wrote(self, data: bytes) -> None:
        """What the flow wrote: one HTTP/1.1 chunk, passed on as a body message."""
        head, framed = data.split(b"\r\n", 1)
        chunk = framed[:-2]
        assert framed.endswith(b"\r\n") and int(head, 16) == len(chunk) > 0, data[:80]
        assert self._started and not self._complete
        self.direct_writes += 1
        if self.stop_reading:
            # Buffered in the socket, never read: full, as the transport
            # tells its protocol.
            self._flow.pause_writing()
            return
        self.sent.put_nowait({"type": "http.response.body", "body": chunk, "more_body": True})

    async def drain(self) -> None:
        if self.stop_reading:
            await asyncio.Event().wait()  # a client that never reads again

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        if self._started or self.stop_reading:
            return False
        self.answered += 1
        self._started = self._complete = True
        self.sent.put_nowait({"type": "http.response.start", "status": status,
                              "headers": headers})
        self.sent.put_nowait({"type": "http.response.body", "body": body, "more_body": False})
        return True

    def on_leave(self, callback: Callable[[], None]) -> None:
        if self.leave.is_set():
            callback()
        elif not self._complete:
            self.leave.hook = callback

    def gather(self) -> None:
        assert not self._started, "gathered after the response began"
        self.gathered += 1

    def flush(self) -> None:
        assert self.gathered, "flushed without gathering"

    async def _receive(self) -> dict[str, Any]:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Any) -> None:
        if self.stop_reading:
            await asyncio.Event().wait()  # as a server's send waits for a full socket
        self._started = True
        self._complete = message["type"] == "http.response.body" and not message.get(
            "more_body", False)
        await self.sent.put(dict(message))

    async def next(self) -> dict[str, Any]:
        return await asyncio.wait_for(self.sent.get(), 2)

    async def rest(self) -> bytes:
        """The body from here to the response's end."""
        body = b""
        while True:
            msg = await self.next()
            body += msg.get("body", b"")
            if not msg.get("more_body", False):
                return body


def refused_port() -> int:
    """A loopback port nothing listens on: a connection to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def started(rig: Rig) -> AsyncIterator[Rig]:
    """`rig` with its proxy started, closed on the way out (the `rig` fixture
    in conftest.py; modules that need other timeouts make their own)."""
    await rig.proxy.start()
    try:
        yield rig
    finally:
        await rig.close()
