"""A /v1 request's whole life, in-process (tests/support/proxy_rig.py): a
client leaving, the timeouts, an engine dying, retries and cooldowns, what
is forwarded. Each test checks both what the client got and what the engine
stand-in saw."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import openai
import pytest

from app.router.published import Endpoint
from app.router.table import RouteTable
from app.router.timeouts import Timeouts
from tests.support.proxy_rig import (
    CHAT,
    CLIENT_KEY,
    MESSAGES,
    AsgiCall,
    FakeClock,
    Rig,
    refused_port,
)

STREAM = {"model": "small", "stream": True, "messages": MESSAGES}
PLAIN = {"model": "small", "messages": MESSAGES}


@pytest.fixture
async def make_rig() -> AsyncIterator[Callable[..., Awaitable[Rig]]]:
    rigs: list[Rig] = []

    async def make(**timeouts: float) -> Rig:
        base = {"connect": 2.0, "first_byte": 10.0, "idle": 10.0, "request": 10.0,
                "cooldown": 5.0}
        rig = Rig(Timeouts(**(base | timeouts)))
        await rig.proxy.start()
        rigs.append(rig)
        return rig

    try:
        yield make
    finally:
        for rig in rigs:
            await rig.close()


def _error_event(body: bytes) -> dict[str, object]:
    """The error of the stream's last event; fails if the stream ended otherwise."""
    assert b"[DONE]" not in body, body
    last = body.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"data: "), body
    error = json.loads(last[len(b"data: "):])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


# --- the client goes away --------------------------------------------------------


@pytest.mark.parametrize("body", [PLAIN, STREAM], ids=["plain", "stream"])
async def test_a_client_leaving_before_any_answer_closes_the_engine_connection_within_1s(
        make_rig: Callable[..., Awaitable[Rig]], body: dict[str, object]) -> None:
    # The engine holds the request (a long generation, a long prefill): no
    # header, no byte. The client leaving must reach the engine now, not
    # when it answers, and the request must not go to the second replica.
    rig = await make_rig()
    held = await rig.upstream("a", "hold")
    spare = await rig.upstream("b")
    rig.route("small", ("a", held.url), ("b", spare.url))
    call = AsgiCall(rig.proxy, body)
    await asyncio.wait_for(held.arrived.wait(), 2)
    call.leave.set()
    await asyncio.wait_for(held.closed.wait(), 1)
    await asyncio.wait_for(call.task, 1)
    assert call.sent.empty()  # nothing was sent to a client that has gone
    assert rig.attempts == [held.url + CHAT]
    assert spare.seen == []
    assert rig.table.inflight("a") == 0
    assert rig.observed.seen == [("small", 499)]


# --- timeouts --------------------------------------------------------------------------


async def test_a_stream_without_its_first_byte_in_time_is_504_and_not_retried(
        make_rig: Callable[..., Awaitable[Rig]]) -> None:
    rig = await make_rig(first_byte=0.3)
    slow = await rig.upstream("a", "silent-start")  # headers, then nothing
    spare = await rig.upstream("b")
    rig.route("small", ("a", slow.url), ("b", spare.url))
    r = await asyncio.wait_for(rig.http.post(
        CHAT, json=STREAM, headers={"Authorization": f"Bearer {CLIENT_KEY}"}), 3)
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert error["code"] == "upstream_timeout"
    assert error["message"] == "Replica a sent no first token within 0.3 s."
    await asyncio.wait_for(slow.closed.wait(), 1)
    # Not retried: the engine may still be working on it.
    assert rig.attempts == [slow.url + CHAT] and spare.seen == []
    assert rig.observed.seen == [("small", 504)]
    assert set(rig.table.cooldowns()) == {"a"}


@pytest.mark.parametrize("direct", [False, True], ids=["asgi", "piped"])
async def test_a_stream_that_goes_silent_ends_with_an_error_event(
        make_rig: Callable[..., Awaitable[Rig]], direct: bool) -> None:
    rig = await make_rig(idle=0.3)
    up = await rig.upstream("a", "silent")  # one chunk, then nothing
    rig.route("small", ("a", up.url))
    call = AsgiCall(rig.proxy, STREAM, direct=direct)
    assert (await call.next())["status"] == 200
    body = await call.rest()
    assert body.startswith(b'data: {"n": 1}\n\n')
    error = _error_event(body)
    assert error["code"] == "upstream_timeout"
    assert error["message"] == "Replica a sent nothing for 0.3 s."
    await asyncio.wait_for(up.closed.wait(), 1)
    await asyncio.wait_for(call.task, 1)
    assert rig.observed.seen == [("small", 504)]
    assert rig.table.inflight("a") == 0


async def test_one_deadline_covers_every_attempt(
        make_rig: Callable[..., Awaitable[Rig]]) -> None:
    # Each replica takes 0.3 s to say 503: with a deadline per attempt, three
    # attempts would take 0.9 s; with one per request, it ends at 0.5 s.
    rig = await make_rig(request=0.5)
    ups = [await rig.upstream(name, "503", delay=0.3) for name in "abc"]
    rig.route("small", *[(u.name, u.url) for u in ups])
    began = time.monotonic()
    r = await rig.chat("small")
    elapsed = time.monotonic() - began
    assert r.status_code == 504, r.text
    assert r.json()["error"]["message"] == "The request did not finish within 0.5 s."
    assert elapsed < 0.85
    assert len(rig.attempts) == 2 and sum(1 for u in ups if u.seen) == 2
    (second,) = [u for u in ups if u.url + CHAT == rig.attempts[1]]
    await asyncio.wait_for(second.closed.wait(), 1)  # the second attempt was cut
    assert rig.observed.seen == [("small", 504)]


@pytest.mark.parametrize("direct", [False, True], ids=["asgi", "piped"])
async def test_the_deadline_ends_a_stream_that_is_still_going(
        make_rig: Callable[..., Awaitable[Rig]], direct: bool) -> None:
    rig = await make_rig(request=0.5)
    up = await rig.upstream("a", "endless")  # a chunk every 10 ms, never done
    rig.route("small", ("a", up.url))
    call = AsgiCall(rig.proxy, STREAM, direct=direct)
    assert (await call.next())["status"] == 200
    body = await call.rest()
    assert body.startswith(b'data: {"tick": 1}\n\n')
    error = _error_event(body)
    assert error["message"] == "The request did not finish within 0.5 s."
    await asyncio.wait_for(up.closed.wait(), 1)
    assert rig.observed.seen == [("small", 504)]
    assert rig.table.cooldowns() == {}  # the engine was not at fault
    # Piped where the server offers it: the chunks went by direct writes.
    assert (call.direct_writes > 10) if direct else call.direct_writes == 0


@pytest.mark.parametrize("direct", [False, True], ids=["asgi", "piped"])
async def test_a_client_that_stops_reading_a_stream_is_dropped_after_the_idle_limit(
        make_rig: Callable[..., Awaitable[Rig]], direct: bool) -> None:
    # Connected but reading nothing: without a limit it would hold the
    # engine's connection, its lease and its key's slot until the deadline.
    rig = await make_rig(idle=0.3)
    up = await rig.upstream("a", "endless")
    rig.route("small", ("a", up.url))
    call = AsgiCall(rig.proxy, STREAM, direct=direct)
    assert (await call.next())["status"] == 200
    await call.next()
    call.stop_reading = True
    started = time.monotonic()
    await asyncio.wait_for(call.task, 2)  # not the 10 s deadline
    assert 0.25 <= time.monotonic() - started < 1.5
    await asyncio.wait_for(up.closed.wait(), 1)  # the engine sees it closed
    assert rig.table.inflight("a") == 0
    assert rig.observed.seen == [("small", 499)]


# --- an engine that fails ----------------------------------------------------------


@pytest.mark.parametrize("direct", [False, True], ids=["asgi", "piped"])
async def test_an_engine_dying_mid_stream_ends_it_with_an_error_event(
        make_rig: Callable[..., Awaitable[Rig]], direct: bool) -> None:
    rig = await make_rig()
    up = await rig.upstream("a", "die")  # one event, half of the next, then gone
    rig.route("small", ("a", up.url))
    call = AsgiCall(rig.proxy, STREAM, direct=direct)
    assert (await call.next())["status"] == 200
    body = await call.rest()
    # The whole event passes; the torn one does not, so the error event parses.
    assert body.startswith(b'data: {"n": 1}\n\ndata: {"error": ')
    assert b'"te' not in body
    assert _error_event(body)["code"] == "upstream_error"
    assert rig.observed.seen == [("small", 502)]
    assert set(rig.table.cooldowns()) == {"a"}


async def test_the_openai_sdk_raises_when_the_engine_dies_mid_stream(
        make_rig: Callable[..., Awaitable[Rig]]) -> None:
    rig = await make_rig()
    up = await rig.upstream("a", "die")
    rig.route("small", ("a", up.url))
    client = openai.AsyncOpenAI(
        base_url="http://gateway/v1", api_key=CLIENT_KEY, max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=rig.proxy)))
    async with client:
        stream = await client.chat.completions.create(model="small", messages=MESSAGES,
                                                      stream=True)
        got = []
        with pytest.raises(openai.APIError, match="broke off the stream"):
            async for chunk in stream:
                got.append(chunk)
        assert len(got) == 1  # the event before the failure did arrive


@pytest.mark.parametrize(("mode", "body"), [("die-early", STREAM), ("die-plain", PLAIN)])
async def test_an_engine_dying_before_the_client_got_a_byte_is_retried(
        make_rig: Callable[..., Awaitable[Rig]], mode: str, body: dict[str, object]) -> None:
    rig = await make_rig()
    bad = await rig.upstream("a", mode)
    good = await rig.upstream("b", "stream")
    good.release.set()
    rig.route("small", ("a", bad.url), ("b", good.url))
    r = await rig.http.post(CHAT, json=body, headers={"Authorization": f"Bearer {CLIENT_KEY}"})
    assert r.status_code == 200 and r.headers["x-llmgw-replica"] == "b", r.text
    assert r.content.endswith(b"data: [DONE]\n\n")
    assert rig.attempts == [bad.url + CHAT, good.url + CHAT]
    assert len(bad.seen) == 1 and len(good.seen) == 1
    assert rig.observed.seen == [("small", 200)]


async def test_a_failed_replica_cools_down_and_is_passed_over(
        make_rig: Callable[..., Awaitable[Rig]]) -> None:
    rig = await make_rig(cooldown=5)
    dead_url = f"http://127.0.0.1:{refused_port()}"
    good = await rig.upstream("b")
    rig.route("small", ("a", dead_url), ("b", good.url))
    assert (await rig.chat("small")).json()["served_by"] == "b"
    assert rig.attempts == [dead_url + CHAT, good.url + CHAT]
    assert rig.table.cooldowns() == {"a": 5.0}
    for _ in range(4):  # round-robin would try "a" again for two of them
        assert (await rig.chat("small")).json()["served_by"] == "b"
    assert rig.attempts.count(dead_url + CHAT) == 1
    rig.clock.now += 5
    assert rig.table.cooldowns() == {}
    for _ in range(2):
        await rig.chat("small")
    assert rig.attempts.count(dead_url + CHAT) == 2  # tried again once warm


def test_choose_takes_a_cooling_replica_only_when_no_other_is_left() -> None:
    clock = FakeClock()
    table = RouteTable(clock=clock)
    a, b = Endpoint("a", "http://127.0.0.1:1", "k"), Endpoint("b", "http://127.0.0.1:2", "k")
    table.set_endpoints({"m": [a, b]})
    table.cool_down("a", 3)
    assert {table.choose("m", set()) for _ in range(4)} == {b}
    assert table.choose("m", {"b"}) == a  # better than no replica at all
    table.cool_down("b", 1)
    assert {table.choose("m", set()) for _ in range(40)} == {a, b}  # both cooling: as usual
    clock.now += 1
    assert table.cooldowns() == {"a": 2.0}
    assert {table.choose("m", set()) for _ in range(4)} == {b}
    table.cool_down("b", 0)  # a cooldown of 0 is none
    assert table.cooldowns() == {"a": 2.0}


# --- what is forwarded ---------------------------------------------------------------


async def test_only_openai_paths_are_forwarded_and_with_their_query(
        make_rig: Callable[..., Awaitable[Rig]]) -> None:
    rig = await make_rig()
    up = await rig.upstream("a")
    rig.route("small", ("a", up.url))
    auth = {"Authorization": f"Bearer {CLIENT_KEY}"}
    # vLLM serves these too; its --api-key guards /v1 only, and some under
    # /v1 (LoRA loading) are the operator's alone. (/v1/responses, /v1/rerank,
    # /v1/score, /v1/audio/...: tests/test_passthrough.py.)
    for path in ["/v1/tokenize", "/v1/detokenize", "/v1/pooling", "/v1/classify",
                 "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/responses/",
                 "/v1/responses//cancel", "/v1/responses/x/input_items", "/v1/audio/speech",
                 "/v1/start_profile", "/v1/metrics", "/v1/health",
                 "/v1/chat/completions/", "/v1//chat/completions", "/v1/../metrics",
                 "/v1/chat/completions/../../tokenize", "/v1/rerank/"]:
        r = await rig.http.post(path, json=PLAIN, headers=auth)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["code"] == "unknown_url"
    assert up.paths == []
    for path in ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]:
        r = await rig.http.post(path + "?api-version=2024-06-01&x=%2F%20", json=PLAIN,
                                headers=auth)
        assert r.status_code == 200, r.text
    assert up.paths == [p + "?api-version=2024-06-01&x=%2F%20"
                        for p in ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]]


async def test_the_engine_is_asked_for_identity_whatever_the_client_accepts(
        make_rig: Callable[..., Awaitable[Rig]]) -> None:
    # A compressed answer's usage could not always be read (docs/design/security.md):
    # the client's Accept-Encoding is not passed on.
    rig = await make_rig()
    up = await rig.upstream("a", "gzip")
    rig.route("small", ("a", up.url))
    auth = {"Authorization": f"Bearer {CLIENT_KEY}"}
    for accepted in ("gzip", "br, gzip", "identity"):
        r = await rig.http.post(CHAT, json=PLAIN, headers=auth | {"Accept-Encoding": accepted})
        assert "content-encoding" not in r.headers and r.json()["served_by"] == "a"
        assert up.seen[-1][0]["Accept-Encoding"] == "identity"


async def test_a_stream_asked_with_gzip_arrives_in_clear(
        make_rig: Callable[..., Awaitable[Rig]]) -> None:
    rig = await make_rig()
    up = await rig.upstream("a", "gzip-stream")
    rig.route("small", ("a", up.url))
    r = await rig.http.post(CHAT, json=STREAM, headers={
        "Authorization": f"Bearer {CLIENT_KEY}", "Accept-Encoding": "gzip"})
    assert r.status_code == 200
    assert "content-encoding" not in r.headers
    assert r.text == 'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
    assert rig.observed.seen == [("small", 200)]


async def test_a_stream_compressed_anyway_is_decoded_passed_in_clear_and_counted(
        make_rig: Callable[..., Awaitable[Rig]]) -> None:
    # A provider that ignores `identity`: its gzip stream would pass unread,
    # costing its key nothing (docs/design/security.md).
    rig = await make_rig()
    up = await rig.upstream("a", "gzip-stream-anyway")
    rig.route("small", ("a", up.url))
    r = await rig.http.post(CHAT, json=STREAM, headers={
        "Authorization": f"Bearer {CLIENT_KEY}", "Accept-Encoding": "gzip"})
    assert r.status_code == 200 and "content-encoding" not in r.headers
    assert r.text == 'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
    # No usage event in this stand-in's stream: its two events are estimated.
    [(requests, prompt, completion, estimated)] = rig.proxy.limits.take_usage().values()
    assert (requests, completion, estimated) == (1, 1, 1) and prompt > 0


# --- what a request leaves behind ---------------------------------------------------


@pytest.mark.parametrize("direct", [False, True], ids=["asgi", "piped"])
@pytest.mark.parametrize(("body", "answer"), [
    (PLAIN, "ok"), (STREAM, "stream"), (STREAM, "gzip-stream-anyway")],
    ids=["plain", "stream", "compressed-stream"])
async def test_a_request_leaves_no_garbage_for_the_collector(
        make_rig: Callable[..., Awaitable[Rig]], body: dict[str, object], answer: str,
        direct: bool) -> None:
    # Objects freed only by a collection (reference cycles) make each
    # collection's pause grow with the requests served since the last: at
    # 256 concurrent requests, tens of milliseconds (docs/design/hot-path.md).
    # A compressed stream is inflated by its chain, which must not hold the
    # relay that holds it.
    rig = await make_rig()
    up = await rig.upstream("a", answer)
    up.release.set()
    rig.route("small", ("a", up.url))

    async def one() -> None:
        call = AsgiCall(rig.proxy, body, direct=direct)
        assert (await call.next())["status"] == 200
        await call.rest()
        await asyncio.wait_for(call.task, 2)
        # Where the server offers it, a whole answer is written directly.
        assert call.answered == (1 if direct and body is not STREAM else 0)

    await one()  # warm: what the first request builds once
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(10):
            await one()
        gc.collect()
        ours = [o for o in gc.garbage if type(o).__module__.startswith("app.")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert ours == [], sorted({type(o).__qualname__ for o in ours})
