"""A request the engine client cannot send as the client asked is the
client's fault, never the replica's (app/router/relay.py, upstream.py;
docs/design/routing.md): refused with a 400 before any attempt,
and no replica cooled down for it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from app.router.access import Exchange
from app.router.call import Call
from app.router.own_answers import Reply
from app.router.relay import Upstreams
from app.router.request_line import Unsendable
from app.router.timeouts import Watch
from app.router.upstream import UpstreamClient
from tests.support.proxy_rig import CLIENT_KEY, Rig

AUTH = {"Authorization": f"Bearer {CLIENT_KEY}"}
# Bytes a query string may carry into the gateway's ASGI app (uvicorn hands
# it on as it came) that no request line to an engine may hold.
HOSTILE = (b"x=\x01", b"a=1\tb", b"q=\x7f", b"x= y", b"x=\r\nInjected: 1")
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
          "/v1/rerank", "/tokenize")


async def _raw(rig: Rig, path: str, query: bytes, body: dict[str, Any]) -> tuple[int, Any]:
    """Calls the proxy's ASGI app with `query` as it came (httpx would quote it)."""
    raw = json.dumps(body).encode()
    sent: list[dict[str, Any]] = []
    given = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if given:
            return given.pop()
        await asyncio.Event().wait()  # the client stays till the answer
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "query_string": query, "headers": [
                 (b"authorization", AUTH["Authorization"].encode()),
                 (b"content-type", b"application/json")],
             "http_version": "1.1", "scheme": "http", "server": ("gateway", 80),
             "client": ("127.0.0.1", 1), "root_path": ""}
    await rig.proxy(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent
                                       if m["type"] == "http.response.body"))


@pytest.mark.parametrize("query", HOSTILE)
async def test_a_query_the_engine_client_refuses_is_a_400_and_cools_nothing(
        rig: Rig, query: bytes) -> None:
    a = await rig.upstream("a")
    rig.route("small", ("a", a.url))
    for path in ROUTES:
        body: dict[str, Any] = {"model": "small", "messages": [{"role": "user", "content": "hi"}],
                                "prompt": "hi", "input": "hi", "query": "q",
                                "documents": ["d"]}
        status, answer = await _raw(rig, path, query, body)
        assert status == 400, (path, answer)
        err = answer["error"]
        assert (err["type"], err["code"], err["param"]) == (
            "invalid_request_error", "invalid_query", None), (path, err)
        assert "query string" in err["message"]
    assert rig.attempts == [] and a.paths == []  # refused before any attempt
    assert rig.table.cooldowns() == {}
    # The same replica serves the next plain request at once.
    status, answer = await _raw(rig, "/v1/chat/completions", b"ok=1", {
        "model": "small", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, answer
    assert a.paths == ["/v1/chat/completions?ok=1"]


async def test_what_the_engine_client_cannot_send_is_unsendable_not_the_server_s() -> None:
    client = UpstreamClient(1.0)
    # Nothing listens there: a refusal that tried to connect would say so.
    with pytest.raises(Unsendable, match="request target"):
        await client.post("http://127.0.0.1:9", "/v1/x?a=\x01", b"", [])
    with pytest.raises(Unsendable, match="request header"):
        await client.post("http://127.0.0.1:9", "/v1/x", b"", [(b"X-A", b"1\r\n")])


async def test_the_attempt_loop_blames_the_client_for_what_cannot_be_sent(rig: Rig) -> None:
    """Past the proxy's own check (a path the gateway built, a header): an
    attempt refused by the engine client is a 400, tried once, no cooldown."""
    a = await rig.upstream("a")
    b = await rig.upstream("b")
    rig.route("small", ("a", a.url), ("b", b.url))
    upstreams = Upstreams(rig.table, rig.timeouts, UpstreamClient(rig.timeouts.connect))
    loop = asyncio.get_running_loop()

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError(f"nothing is sent: {message}")

    watch = Watch(receive, rig.timeouts, loop.time())
    try:
        with pytest.raises(Reply) as refused:
            await upstreams.forward(Call(
                Exchange("POST", "/v1/chat/completions", loop.time()), watch, send, "small",
                "/v1/chat/completions?x=\x01", {"model": "small"}, stream=False))
    finally:
        watch.close()
    err = json.loads(refused.value.body)["error"]
    assert refused.value.status == 400 and err["type"] == "invalid_request_error"
    assert rig.table.cooldowns() == {} and a.paths == b.paths == []
