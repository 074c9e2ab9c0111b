"""The /v1 proxy in-process (tests/support/proxy_rig.py): auth, names,
retries, streams. A request's timeouts and failures: tests/test_request_life.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from app.router.published import Endpoint, KeyGrant
from app.router.table import REASON_MAX
from app.wire.engine_routes import PROMPT_TOKENS
from tests.support.llamacpp_standin import LlamaCppStandin
from tests.support.procs import until
from tests.support.proxy_rig import (
    CHAT,
    CLIENT_KEY,
    MESSAGES,
    AsgiCall,
    Rig,
    refused_port,
    started,
)
from tests.support.proxy_rig import hash_key as _hash


def _openai_error(r: httpx.Response, status: int, code: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and isinstance(err["message"], str) and err["message"]
    return str(err["message"])


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


async def test_a_granted_key_is_hashed_once_and_a_revoked_one_refused(rig: Rig) -> None:
    up = await rig.upstream("a")
    rig.route("small", ("a", up.url))
    hashed: list[str] = []

    def counted(key: str) -> str:
        hashed.append(key)
        return _hash(key)

    rig.proxy._hash_key = counted
    for _ in range(3):
        assert (await rig.chat("small")).status_code == 200
    assert hashed == [CLIENT_KEY]  # remembered once granted
    for _ in range(2):
        _openai_error(await rig.chat("small", "sk-made-up"), 401, "invalid_api_key")
    assert hashed == [CLIENT_KEY, "sk-made-up", "sk-made-up"]  # a refused key is not kept
    # Revoked: the grant is looked up anew, whatever was remembered.
    rig.table.set_client_keys({})
    _openai_error(await rig.chat("small"), 401, "invalid_api_key")
    rig.table.set_client_keys({_hash(CLIENT_KEY): KeyGrant("k1", "tests")})
    assert (await rig.chat("small")).status_code == 200


async def test_the_keys_remembered_are_bounded(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    import app.router.proxy as proxy_module

    monkeypatch.setattr(proxy_module, "_KEYS_REMEMBERED", 3)
    up = await rig.upstream("a")
    rig.route("small", ("a", up.url))
    keys = [f"sk-key-{i}" for i in range(7)]
    rig.table.set_client_keys({_hash(k): KeyGrant(k, "t") for k in keys})
    for k in keys:
        assert (await rig.chat("small", k)).status_code == 200
        assert len(rig.proxy._key_names) <= 3


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
        bad_url, bad = f"http://127.0.0.1:{refused_port()}", None
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


async def test_a_stream_cut_before_its_usage_event_is_charged_an_estimate(rig: Rig) -> None:
    # The engine never got to its usage event: without an estimate a client
    # could stream for free by leaving before the end.
    up = await rig.upstream("a", "endless")
    rig.route("small", ("a", up.url))
    call = AsgiCall(rig.proxy, {"model": "small", "stream": True,
                                "messages": [{"role": "user", "content": "x" * 41}]})
    assert (await call.next())["status"] == 200
    seen = 0
    while seen < 5:
        seen += (await call.next())["body"].count(b"data: ")
    call.leave.set()
    await asyncio.wait_for(call.task, 2)
    [(key, (requests, prompt, completion, estimated))] = rig.proxy.limits.take_usage().items()
    assert key == ("k1", "small")
    assert (requests, prompt, estimated) == (1, 11, 1)  # 41 characters: 11 tokens
    assert completion >= seen - 1  # one an event, after the first (role only)


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


@pytest.mark.parametrize("counts", [True, False])
async def test_a_llamacpp_stream_is_counted_its_prompt_by_the_engine_after_it(
        rig: Rig, counts: bool) -> None:
    # llama-cpp-python's shape: a role-only event, one a token, a last with the
    # finish reason, [DONE], and no usage; its prompt counted by the engine,
    # or estimated when the engine does not answer the count.
    standin = LlamaCppStandin()
    standin.counts, standin.text_count = counts, 5
    server = standin.server
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        rig.table.set_endpoints({"small": [Endpoint("a", url, "engine-key-a",
                                                    engine="llamacpp")]})
        for path, body in ((CHAT, {"messages": MESSAGES}), ("/v1/completions",
                                                            {"prompt": "hello"})):
            r = await rig.http.post(path, json={"model": "small", "stream": True} | body,
                                    headers={"Authorization": f"Bearer {CLIENT_KEY}"})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert [(k, c[:3]) for k, c in rig.proxy.limits.take_usage().items()] == [
            (("k1", "small"), (2, 0, 8))]  # the prompts are not counted yet
        got = [0, 0, 0, 0]

        def added() -> bool:
            for more in rig.proxy.limits.take_usage().values():
                got[:] = [a + b for a, b in zip(got, more, strict=True)]
            return got[1] >= (21 + 5 if counts else 2 + 2)

        await until(added, "both prompts counted and added")
        # Counted, not estimated; else estimated: 5 characters, 2 tokens each.
        assert got == ([0, 21 + 5, 0, 0] if counts else [0, 2 + 2, 0, 2])
    finally:
        await server.close()
    asked = [(p, b) for p, b in standin.asked if not b.get("stream")]
    assert asked == [(PROMPT_TOKENS, {"model": "small", "messages": MESSAGES}),
                      ("/extras/tokenize/count", {"input": "hello"})]


async def test_hostile_json_is_a_400_in_openai_shape(rig: Rig) -> None:
    """Nesting past the parser's limit and a 5,000-digit integer are the
    client's errors. Nesting just under the limit is taken, and the walks
    after the parse (hashing for affinity, encoding for the engine) manage
    it: a 200 or a 400, never a 500, on either side of the limit."""
    a, b = await rig.upstream("a"), await rig.upstream("b")
    rig.route("small", ("a", a.url), ("b", b.url))
    auth = {"Authorization": f"Bearer {CLIENT_KEY}", "Content-Type": "application/json"}
    msg = b'[{"role": "user", "content": "hi"}]'
    bodies = [b"[" * 100_000, b'{"model": "small", "messages": ' + msg + b', "x": '
              + b"[" * 100_000 + b"}",
              b'{"model": "small", "messages": ' + msg + b', "max_tokens": ' + b"9" * 5000 + b"}"]
    for depth in range(900, 1000, 5):  # around the recursion limit, wherever it falls
        bodies.append(b'{"model": "small", "messages": [{"role": "user", "content": '
                      + b"[" * depth + b"]" * depth + b"}]}")
    statuses = []
    for body in bodies:
        r = await rig.http.post(CHAT, content=body, headers=auth)
        statuses.append(r.status_code)
        if r.status_code != 200:
            _openai_error(r, 400, None)
            assert r.json()["error"]["type"] == "invalid_request_error"
    assert statuses[:3] == [400, 400, 400], statuses
    assert 400 in statuses[3:], statuses  # the limit was reached: this tested something


async def test_the_gateway_s_own_cost_leaves_out_the_engines_time(rig: Rig) -> None:
    """`Outcome.gateway` (app/router/outcome.py): arrival to the answer's
    start, less the engines' time: a slow engine (0.3 s), or a replica that
    fails before another answers (0.2 s), adds nothing to it; a request no
    engine answered has none."""
    slow = await rig.upstream("slow", delay=0.3)
    rig.route("small", ("slow", slow.url))
    assert (await rig.chat("small")).status_code == 200
    failing = await rig.upstream("failing", "503", delay=0.2)
    rig.route("small", ("failing", failing.url), ("good", slow.url))
    slow.delay = 0.0
    assert (await rig.chat("small")).status_code == 200
    rig.route("small")
    assert (await rig.chat("small")).status_code == 503
    first, retried, refused = rig.observed.outcomes[-3:]
    assert first.seconds >= 0.3 and retried.seconds >= 0.2, (first, retried)
    for o in (first, retried):
        # Milliseconds at most on a loaded machine; were an engine's wait
        # counted, it would be 0.2 s and more.
        assert o.gateway is not None and 0.0 <= o.gateway < 0.05, o
    assert refused.gateway is None, refused


async def test_a_stream_s_gateway_cost_ends_at_its_response_start(rig: Rig) -> None:
    """A stream's is counted to its response's start: the engine's time to
    its first byte (0.3 s here) left out, and nothing of the rest of the
    stream, however long it runs."""
    up = await rig.upstream("a", "stream", delay=0.3)
    rig.route("small", ("a", up.url))
    call = AsgiCall(rig.proxy, {"model": "small", "stream": True, "messages": MESSAGES})
    assert (await call.next())["status"] == 200
    await asyncio.sleep(0.2)  # the stream goes on: not the gateway's cost
    up.release.set()
    while (await call.next())["more_body"]:
        pass
    await asyncio.wait_for(call.task, 2)
    o = rig.observed.outcomes[-1]
    assert o.first_byte is not None and o.first_byte >= 0.3 and o.seconds >= 0.5, o
    assert o.gateway is not None and 0.0 <= o.gateway < 0.05, o


def test_the_gateway_s_own_cost_is_finer_than_the_loop_s_clock() -> None:
    """The gateway serves on uvloop, whose `loop.time()` is libuv's cached
    millisecond clock: a cost of a fraction of a millisecond read from it
    comes out as 0 or 1 ms. `Outcome.gateway` is read from a clock of its
    own. Seen to fail: 0.001 exactly."""
    import uvloop

    async def one() -> float | None:
        async with started(Rig()) as rig:
            up = await rig.upstream("a")
            rig.route("small", ("a", up.url))
            for _ in range(3):
                assert (await rig.chat("small")).status_code == 200
            return rig.observed.outcomes[-1].gateway

    got = uvloop.run(one())
    assert got is not None and 0.0 < got < 0.05, got
    assert abs(got * 1000 - round(got * 1000)) > 1e-6, f"a whole millisecond count: {got!r}"
