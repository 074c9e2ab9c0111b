"""The /v1 proxy in-process: a route table filled by hand, engines stood in by
aiohttp.web apps on loopback ports, the ASGI app called directly (through
httpx.ASGITransport, or by hand where a test must see or cut a stream).
The proxy's own aiohttp client code does the forwarding; its session comes
from an injected factory that also records every attempt it makes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from app.router.proxy import Proxy
from app.router.table import REASON_MAX, CatalogEntry, Endpoint, KeyGrant, RouteTable

CLIENT_KEY = "sk-client-key-0123456789"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hello"}]


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Upstream:
    """An engine stand-in that records what reached it.

    mode: "ok" answers JSON naming itself; "502"/"503" answer that status;
    "stream" sends one SSE chunk, then the rest once `release` is set;
    "endless" streams until the connection closes, then sets `closed`;
    "silent" sends one chunk, then sets `closed` once the connection closes.
    """

    def __init__(self, name: str, mode: str) -> None:
        self.name, self.mode = name, mode
        self.seen: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.release = asyncio.Event()
        self.closed = asyncio.Event()
        app = web.Application()
        app.router.add_post(CHAT, self._handle)
        self.server = TestServer(app, host="127.0.0.1")

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((dict(request.headers), body))
        if self.mode in ("502", "503"):
            return web.json_response({"error": "busy"}, status=int(self.mode))
        if self.mode == "ok":
            return web.json_response({"served_by": self.name, "model": body["model"]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.mode == "stream":
            await resp.write(b'data: {"n": 1}\n\n')
            await self.release.wait()
            await resp.write(b'data: {"n": 2}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if self.mode == "silent":  # one chunk, then nothing, like a stalled engine
            await resp.write(b'data: {"n": 1}\n\n')
            try:  # aiohttp cancels a handler whose connection is lost
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.closed.set()
                raise
            return resp  # not reached: the wait ends only by cancellation
        try:  # endless
            while True:
                await resp.write(b'data: {"tick": 1}\n\n')
                await asyncio.sleep(0.01)
        except ConnectionResetError:  # "Cannot write to closing transport"
            self.closed.set()
        except asyncio.CancelledError:
            self.closed.set()
            raise
        return resp


class Rig:
    """A proxy over a hand-filled table, its upstreams, and what its session tried."""

    def __init__(self) -> None:
        self.table = RouteTable()
        self.table.set_catalog([CatalogEntry("small", ("tiny",), 1),
                                CatalogEntry("other", (), 2)])
        self.table.set_client_keys({_hash(CLIENT_KEY): KeyGrant("k1", "tests")})
        self.attempts: list[str] = []  # every URL the proxy's session posted to
        self.upstreams: list[Upstream] = []
        trace = aiohttp.TraceConfig()

        async def on_start(_s: object, _c: object, params: aiohttp.TraceRequestStartParams
                           ) -> None:
            self.attempts.append(str(params.url))

        trace.on_request_start.append(on_start)
        self.proxy = Proxy(
            self.table, _hash, connect_timeout=2, request_timeout=10,
            session_factory=lambda timeout: aiohttp.ClientSession(
                timeout=timeout, auto_decompress=False, trace_configs=[trace]),
        )
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.proxy),
                                      base_url="http://gateway")

    async def upstream(self, name: str, mode: str = "ok") -> Upstream:
        up = Upstream(name, mode)
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


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig()
    await r.proxy.start()
    try:
        yield r
    finally:
        await r.http.aclose()
        await r.proxy.stop()
        for up in r.upstreams:
            await up.server.close()


def _openai_error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and isinstance(err["message"], str) and err["message"]
    return str(err["message"])


def _refused_port() -> int:
    """A loopback port nothing listens on: a connection to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_missing_or_wrong_key_is_401_in_openai_shape(rig: Rig) -> None:
    up = await rig.upstream("a")
    rig.route("small", ("a", up.url))
    for key in (None, "sk-wrong", ""):
        r = await rig.chat("small", key)
        _openai_error(r, 401, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
    r = await rig.http.post(CHAT, json={"model": "small"},
                            headers={"Authorization": f"Basic {CLIENT_KEY}"})
    _openai_error(r, 401, "invalid_api_key")
    assert up.seen == []
    assert (await rig.chat("small")).status_code == 200  # the right key does pass


async def test_an_unknown_or_ungranted_model_is_404_model_not_found(rig: Rig) -> None:
    up = await rig.upstream("a")
    rig.route("small", ("a", up.url))
    message = _openai_error(await rig.chat("nope"), 404, "model_not_found")
    assert "'nope'" in message
    # A key limited to another model does not learn that "small" exists.
    rig.table.set_client_keys({_hash(CLIENT_KEY): KeyGrant("k1", "t", frozenset({"other"}))})
    _openai_error(await rig.chat("small"), 404, "model_not_found")
    _openai_error(await rig.chat("tiny"), 404, "model_not_found")
    assert up.seen == []


async def test_an_alias_reaches_the_engine_as_the_catalog_name_with_the_engine_key(
        rig: Rig) -> None:
    up = await rig.upstream("a")
    rig.route("small", ("a", up.url))
    r = await rig.chat("tiny")
    assert r.status_code == 200, r.text
    assert r.json() == {"served_by": "a", "model": "small"}
    assert r.headers["x-llmgw-replica"] == "a"
    ((headers, body),) = up.seen
    assert body == {"model": "small", "messages": MESSAGES}
    assert headers["Authorization"] == "Bearer engine-key-a"
    assert not any(CLIENT_KEY in v for v in headers.values())


@pytest.mark.parametrize("failure", ["refused", "502", "503"])
async def test_a_failing_first_replica_is_retried_on_the_second(rig: Rig, failure: str) -> None:
    good = await rig.upstream("b")
    if failure == "refused":
        bad_url, bad = f"http://127.0.0.1:{_refused_port()}", None
    else:
        bad = await rig.upstream("a", failure)
        bad_url = bad.url
    rig.route("small", ("a", bad_url), ("b", good.url))  # a fresh table tries "a" first
    r = await rig.chat("small")
    assert r.status_code == 200, r.text
    assert r.json()["served_by"] == "b"
    assert r.headers["x-llmgw-replica"] == "b"
    assert rig.attempts == [bad_url + CHAT, good.url + CHAT]
    if bad is not None:
        assert len(bad.seen) == 1  # the engine did get the first attempt
    assert len(good.seen) == 1
    assert rig.table.inflight("a") == 0 and rig.table.inflight("b") == 0


class AsgiCall:
    """One POST driven through the ASGI app by hand, to see and cut a stream."""

    def __init__(self, proxy: Proxy, body: dict[str, Any]) -> None:
        self.sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.leave = asyncio.Event()  # set: the client disconnects
        self._body: bytes | None = json.dumps(body).encode()
        scope = {"type": "http", "method": "POST", "path": CHAT,
                 "headers": [(b"authorization", f"Bearer {CLIENT_KEY}".encode()),
                             (b"content-type", b"application/json")]}
        self.task = asyncio.create_task(proxy(scope, self._receive, self._send))

    async def _receive(self) -> dict[str, Any]:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Any) -> None:
        await self.sent.put(dict(message))

    async def next(self) -> dict[str, Any]:
        return await asyncio.wait_for(self.sent.get(), 2)


async def test_a_stream_is_relayed_chunk_by_chunk_to_done(rig: Rig) -> None:
    up = await rig.upstream("a", "stream")
    rig.route("small", ("a", up.url))
    call = AsgiCall(rig.proxy, {"model": "tiny", "stream": True, "messages": MESSAGES})
    start = await call.next()
    assert start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"x-llmgw-replica"] == b"a"
    assert headers[b"content-type"] == b"text/event-stream"
    # The first chunk reaches the client while the engine holds back the rest:
    # a proxy that buffered the answer would time out here.
    first = await call.next()
    assert first == {"type": "http.response.body", "body": b'data: {"n": 1}\n\n',
                     "more_body": True}
    assert rig.table.inflight("a") == 1
    up.release.set()
    body = b""
    while (msg := await call.next())["more_body"]:
        body += msg["body"]
    assert body == b'data: {"n": 2}\n\ndata: [DONE]\n\n'
    await asyncio.wait_for(call.task, 2)
    assert rig.table.inflight("a") == 0
    assert up.seen[0][1]["model"] == "small"


async def test_a_client_leaving_mid_stream_frees_its_lease_and_the_engine(rig: Rig) -> None:
    up = await rig.upstream("a", "endless")
    rig.route("small", ("a", up.url))
    call = AsgiCall(rig.proxy, {"model": "small", "stream": True, "messages": MESSAGES})
    assert (await call.next())["status"] == 200
    assert (await call.next())["body"].startswith(b"data: ")
    assert rig.table.inflight("a") == 1
    call.leave.set()
    await asyncio.wait_for(call.task, 2)  # the relay stopped although the engine had not
    assert rig.table.inflight("a") == 0
    # The engine sees its connection closed: it stops generating for nobody.
    await asyncio.wait_for(up.closed.wait(), 2)


async def test_a_client_leaving_a_silent_stream_frees_it_at_once(rig: Rig) -> None:
    # The engine sends nothing more for a while (a long prefill, a stall): the
    # lease and the engine's connection must not wait for its next chunk.
    up = await rig.upstream("a", "silent")
    rig.route("small", ("a", up.url))
    call = AsgiCall(rig.proxy, {"model": "small", "stream": True, "messages": MESSAGES})
    assert (await call.next())["status"] == 200
    assert (await call.next())["body"].startswith(b"data: ")
    call.leave.set()
    await asyncio.wait_for(call.task, 2)
    assert rig.table.inflight("a") == 0
    await asyncio.wait_for(up.closed.wait(), 2)
    assert call.sent.empty()  # nothing sent after the client left


async def test_no_ready_replica_is_503_and_says_why_when_known(rig: Rig) -> None:
    message = _openai_error(await rig.chat("tiny"), 503, "no_ready_replica")
    assert message == "No replica of 'small' is ready."

    why = "replica smollm2-ab12 failed: engine killed by SIGILL (illegal instruction)"
    rig.table.set_unavailable({"small": why, "other": "nothing placed: no nodes"})
    message = _openai_error(await rig.chat("tiny"), 503, "no_ready_replica")
    assert message == f"No replica of 'small' is ready: {why}"
    message = _openai_error(await rig.chat("other"), 503, "no_ready_replica")
    assert message == "No replica of 'other' is ready: nothing placed: no nodes"

    rig.table.set_unavailable({"small": "x" * 5000})  # replaces: "other" has none now
    message = _openai_error(await rig.chat("small"), 503, "no_ready_replica")
    assert len(message) < REASON_MAX + 50 and message.endswith("…")
    assert _openai_error(await rig.chat("other"), 503, "no_ready_replica").endswith("ready.")

    # With replicas to try, the 503 names what they answered instead.
    busy = await rig.upstream("a", "503")
    rig.route("small", ("a", busy.url))
    message = _openai_error(await rig.chat("small"), 503, "no_ready_replica")
    assert "replica a failed (answered 503)" in message
    assert rig.table.inflight("a") == 0
