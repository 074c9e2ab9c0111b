"""vLLM's other routes through the router, in-process (app/router/passthrough.py,
responses.py, multipart_form.py): the Responses API's ids and their replica, the
routes outside /v1, the form's fields (docs/design/responses-api.md)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from app.router import responses
from app.router.multipart_form import form_fields
from app.router.own_answers import Reply
from app.router.published import Endpoint, KeyGrant, Limits
from app.router.usage.limits import Limiter
from tests.fakes import fake_vllm
from tests.fakes.fake_vllm import FakeVLLM, parse_args
from tests.support.proxy_rig import CLIENT_KEY, Rig, hash_key

AUTH = {"Authorization": f"Bearer {CLIENT_KEY}"}


def vllm(rig: Rig, model: str, *eps: tuple[str, str]) -> None:
    """As `rig.route`, the replicas being vLLM's (an external provider's get no request_id)."""
    rig.table.set_endpoints({model: [Endpoint(rid, url, f"engine-key-{rid}", engine="vllm")
                                     for rid, url in eps]})


def test_a_response_id_names_its_replica_and_nothing_else_does() -> None:
    made = responses.new_id("small-model-0a1b2c3d", "k1")
    assert made.startswith("resp_")
    assert responses.replica_of(made, "k1") == "small-model-0a1b2c3d"
    assert responses.new_id("r", "k1") != responses.new_id("r", "k1")
    for other in ("resp_0123", "resp_" + "a" * 32, "resp_" + "a" * 32 + ".Bad",
                  "chatcmpl-1", "resp_" + "g" * 32 + ".r", made + "/x", made + ".x"):
        assert responses.replica_of(other, "k1") is None, other
    # Another key's: not found, as an id nobody made.
    with pytest.raises(Reply) as refused:
        responses.replica_of(made, "k2")
    assert refused.value.status == 404


async def test_a_continuation_goes_to_the_replica_that_made_the_response(rig: Rig) -> None:
    a, b = await rig.upstream("a"), await rig.upstream("b")
    vllm(rig, "small", ("a", a.url), ("b", b.url))
    first = await rig.http.post("/v1/responses", headers=AUTH,
                                json={"model": "tiny", "input": "hi", "request_id": "mine"})
    assert first.status_code == 200, first.text
    # Draws start at the first listed: a made it, under an id naming it (the
    # client's own request_id is replaced: the id is the gateway's to set).
    made = a.seen[-1][1]["request_id"]
    assert responses.replica_of(made, "k1") == "a" and a.seen[-1][1]["model"] == "small"
    said_b = responses.new_id("b", "k1")
    for _ in range(3):  # however the draws go, the continuation goes to b
        r = await rig.http.post("/v1/responses", headers=AUTH, json={
            "model": "small", "input": "more", "previous_response_id": said_b})
        assert r.status_code == 200 and r.headers["x-llmgw-replica"] == "b"
    assert [body["previous_response_id"] for _, body in b.seen] == [said_b] * 3
    r = await rig.http.get(f"/v1/responses/{made}", headers=AUTH)
    assert r.status_code == 200 and r.headers["x-llmgw-replica"] == "a"
    assert a.seen[-1][1] == {}  # a GET, no body
    r = await rig.http.post(f"/v1/responses/{made}/cancel?x=1", headers=AUTH)
    assert r.status_code == 200
    assert a.paths[-2:] == [f"/v1/responses/{made}", f"/v1/responses/{made}/cancel?x=1"]


async def test_a_response_whose_replica_is_gone_gets_a_404_that_says_so(rig: Rig) -> None:
    a = await rig.upstream("a")
    rig.route("small", ("a", a.url))
    gone = responses.new_id("small-dead0001", "k1")
    r = await rig.http.post("/v1/responses", headers=AUTH, json={
        "model": "small", "input": "x", "previous_response_id": gone})
    assert r.status_code == 404
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("replica_gone", "previous_response_id")
    assert "small-dead0001" in err["message"] and "gone" in err["message"]
    for path in (f"/v1/responses/{gone}", f"/v1/responses/{gone}/cancel"):
        method = "GET" if not path.endswith("cancel") else "POST"
        r = await rig.http.request(method, path, headers=AUTH)
        assert (r.status_code, r.json()["error"]["code"]) == (404, "replica_gone"), path
    # An id the gateway did not make cannot be located: vLLM's own words.
    r = await rig.http.get("/v1/responses/resp_abc", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "Response with id 'resp_abc' not found.", "type": "invalid_request_error",
        "param": "response_id", "code": "response_not_found"}
    assert a.paths == []
    # A replica of another model: named to a key allowed it, else not found.
    rig.table.set_endpoints({"small": rig.table.endpoints("small"),
                             "other": [Endpoint("o", a.url, "k", engine="vllm")]})
    theirs = responses.new_id("o", "k1")
    r = await rig.http.post("/v1/responses", headers=AUTH, json={
        "model": "tiny", "input": "x", "previous_response_id": theirs})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "model_mismatch")
    assert "'other'" in r.json()["error"]["message"]
    rig.table.set_client_keys({hash_key(CLIENT_KEY): KeyGrant("k1", "t",
                                                              frozenset({"small"}))})
    r = await rig.http.post("/v1/responses", headers=AUTH, json={
        "model": "tiny", "input": "x", "previous_response_id": theirs})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "response_not_found")
    assert a.paths == []
    r = await rig.http.post("/v1/responses", headers=AUTH, json={
        "model": "small", "input": "x", "previous_response_id": 7})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "previous_response_id")
    r = await rig.http.delete(f"/v1/responses/{responses.new_id('a', 'k1')}", headers=AUTH)
    assert r.status_code == 405  # vLLM serves no DELETE


async def test_a_response_is_its_key_s_alone(rig: Rig) -> None:
    """A response id is bound to the key that made it: another key allowed
    the same model, holding the id, gets vLLM's own "not found" to a GET, a
    cancel and a continuation, and nothing reaches the replica (which would
    answer it: vLLM stores a response under its id alone). Seen to fail:
    any key allowed the model read and continued another key's response."""
    a = await rig.upstream("a")
    vllm(rig, "small", ("a", a.url))
    other = "sk-other-key-0123456789"
    rig.table.set_client_keys({hash_key(CLIENT_KEY): KeyGrant("k1", "tests"),
                               hash_key(other): KeyGrant("k2", "other")})
    first = await rig.http.post("/v1/responses", headers=AUTH,
                                json={"model": "small", "input": "hi"})
    assert first.status_code == 200, first.text
    made = a.seen[-1][1]["request_id"]
    seen = len(a.paths)
    theirs = {"Authorization": f"Bearer {other}"}
    for method, path, body in [
            ("GET", f"/v1/responses/{made}", None),
            ("POST", f"/v1/responses/{made}/cancel", None),
            ("POST", "/v1/responses", {"model": "small", "input": "x",
                                       "previous_response_id": made})]:
        r = await rig.http.request(method, path, headers=theirs, json=body)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["code"] == "response_not_found", r.text
    assert len(a.paths) == seen
    # Its own key reads and continues it.
    r = await rig.http.get(f"/v1/responses/{made}", headers=AUTH)
    assert r.status_code == 200
    r = await rig.http.post("/v1/responses", headers=AUTH, json={
        "model": "small", "input": "more", "previous_response_id": made})
    assert r.status_code == 200 and a.seen[-1][1]["previous_response_id"] == made


async def test_a_key_limited_to_other_models_is_refused_on_every_route(rig: Rig) -> None:
    a = await rig.upstream("a")
    rig.route("small", ("a", a.url))
    rig.table.set_client_keys({hash_key(CLIENT_KEY): KeyGrant("k1", "t",
                                                              frozenset({"other"}))})
    made = responses.new_id("a", "k1")
    for method, path, body in [
            ("POST", "/v1/responses", {"model": "small", "input": "x"}),
            ("POST", "/v1/rerank", {"model": "small", "query": "q", "documents": ["d"]}),
            ("POST", "/tokenize", {"model": "small", "prompt": "x"}),
            ("GET", f"/v1/responses/{made}", None)]:
        r = await rig.http.request(method, path, headers=AUTH, json=body)
        assert r.status_code == 404, (path, r.text)
    r = await rig.http.post("/v1/audio/transcriptions", headers=AUTH,
                            files={"file": ("a.wav", b"RIFF")}, data={"model": "small"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert a.paths == []
    r = await rig.http.post("/tokenize", json={"model": "small", "prompt": "x"})
    assert r.status_code == 401


async def test_vllm_s_json_routes_go_to_the_model_s_replica_as_they_came(rig: Rig) -> None:
    a = await rig.upstream("a")
    rig.route("small", ("a", a.url))
    for path in ("/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score", "/tokenize",
                 "/detokenize"):
        r = await rig.http.post(path + "?q=1", headers=AUTH,
                                json={"model": "tiny", "query": "x", "stream": True})
        assert r.status_code == 200, (path, r.text)
        assert r.json() == {"served_by": "a", "model": "small"}  # read whole, not streamed
        assert a.paths[-1] == path + "?q=1"
        assert a.seen[-1][0]["Authorization"] == "Bearer engine-key-a"
    r = await rig.http.get("/v1/rerank", headers=AUTH)
    assert r.status_code == 405
    r = await rig.http.post("/v1/rerank", headers=AUTH, json={"model": 3})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "model")


async def test_a_form_goes_with_its_boundary_and_nothing_else_of_its_header(rig: Rig) -> None:
    seen: list[tuple[str, bytes]] = []

    async def engine(request: web.Request) -> web.Response:
        seen.append((request.headers["Content-Type"], await request.read()))
        return web.json_response({"text": "ok"})

    app = web.Application()
    app.router.add_post("/v1/audio/transcriptions", engine)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        vllm(rig, "small", ("a", str(server.make_url("")).rstrip("/")))
        raw, kind = _form(model="tiny")
        r = await rig.http.post("/v1/audio/transcriptions", content=raw, headers={
            **AUTH, "Content-Type": kind + "; x=\x01"})
        assert r.status_code == 200, r.text
        boundary = kind.split("boundary=")[1]
        assert seen[0][0] == f'multipart/form-data; boundary="{boundary}"'
        assert form_fields(seen[0][1], seen[0][0]).model == "small"
        assert rig.table.cooldowns() == {}
    finally:
        await server.close()


def _form(**fields: str) -> tuple[bytes, str]:
    req = httpx.Request("POST", "http://x/", files={"file": ("a.wav", b"RIFF\r\n--x--")},
                        data=fields)
    return req.read(), req.headers["content-type"]


def test_a_form_s_model_and_stream_are_read_and_the_model_rewritten() -> None:
    raw, kind = _form(model="tiny", stream="true", language="en")
    form = form_fields(raw, kind)
    assert (form.model, form.stream) == ("tiny", True)
    again = form_fields(form.with_model(raw, "small-model"), kind)
    assert again.model == "small-model" and b"RIFF\r\n--x--" in form.with_model(raw, "s")
    assert form_fields(*_form(model="m")).stream is False
    assert form.with_model(raw, "tiny") is raw  # named already: not copied


@pytest.mark.parametrize(("raw", "kind", "param"), [
    (*_form(model="m", stream="1"), "stream"),
    (*_form(model="m", stream="yes"), "stream"),
    (*_form(language="en"), "model"),
    (*_form(model=""), "model"),
    (b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n--b--",
     "multipart/form-data; boundary=b", "file"),
    (b'{"model": "m"}', "application/json", None),
    (b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm", "multipart/form-data; "
     "boundary=b", None),
    (b"--b\r\n" + b"x" * 10000, "multipart/form-data; boundary=b", None),
    (b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n--b\r\n"
     b"Content-Disposition: form-data; name=\"model\"\r\n\r\nn\r\n--b--",
     "multipart/form-data; boundary=b", "model"),
])
def test_a_form_the_gateway_cannot_read_one_way_is_refused(raw: bytes, kind: str,
                                                           param: str | None) -> None:
    with pytest.raises(Reply) as refused:
        form_fields(raw, kind)
    assert refused.value.status == 400
    assert httpx.Response(400, content=refused.value.body).json()["error"]["param"] == param


def test_the_responses_api_s_usage_is_charged_to_the_key() -> None:
    limiter = Limiter(clock=lambda: 0.0, wall=lambda: 0.0)
    ticket = limiter.admit("k", "m", Limits(tokens_per_minute=1000))
    ticket.meter.read_answer(b'{"usage": {"input_tokens": 5, "output_tokens": 7, '
                       b'"total_tokens": 12}}', None)
    ticket.release()
    streamed = limiter.admit("k", "m", Limits(tokens_per_minute=1000))
    streamed.meter.read_events(b'event: response.created\ndata: {"type": "response.created", '
                         b'"response": {"usage": null}}\n\nevent: response.completed\ndata: '
                         b'{"type": "response.completed", "response": {"usage": '
                         b'{"input_tokens": 2, "output_tokens": 3}}}\n\n')
    streamed.release()
    assert limiter.take_usage() == {("k", "m"): (2, 7, 10, 0)}


async def test_an_external_provider_keeps_its_own_ids(rig: Rig) -> None:
    up = await rig.upstream("p")
    rig.route("small", ("p", up.url))  # engine "": a provider, which knows no request_id
    r = await rig.http.post("/v1/responses", headers=AUTH, json={
        "model": "small", "input": "x", "request_id": "x"})
    assert r.status_code == 200
    assert up.seen[-1][1] == {"model": "small", "input": "x"}
    # A provider's id as the provider wrote it is nobody's to continue: it
    # reaches the client bound to its key (responses.ProviderIds).
    r = await rig.http.post("/v1/responses", headers=AUTH, json={
        "model": "small", "input": "x", "previous_response_id": "resp_theirs"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "response_not_found")
    assert len(up.seen) == 1


async def test_the_key_s_limits_count_every_route(rig: Rig) -> None:
    a = await rig.upstream("a")
    vllm(rig, "small", ("a", a.url))
    rig.table.set_client_keys({hash_key(CLIENT_KEY): KeyGrant(
        "k1", "t", limits=Limits(requests_per_minute=3))})
    made = responses.new_id("a", "k1")
    for method, path, body in [("POST", "/tokenize", {"model": "small", "prompt": "x"}),
                               ("GET", f"/v1/responses/{made}", None),
                               ("POST", "/v1/score", {"model": "small"})]:
        r = await rig.http.request(method, path, headers=AUTH, json=body)
        assert r.status_code == 200, (path, r.text)
    r = await rig.http.post("/v1/responses", headers=AUTH, json={"model": "small", "input": "x"})
    assert r.status_code == 429 and "retry-after" in r.headers
    assert len(a.paths) == 3
    # In the request metrics as a chat is, the refusal too.
    assert rig.observed.seen == [("small", 200)] * 3 + [("small", 429)]


async def test_a_response_stream_cut_short_is_charged_an_estimate(rig: Rig) -> None:
    up = await rig.upstream("a", "die")  # one event, then the connection drops
    vllm(rig, "small", ("a", up.url))
    r = await rig.http.post("/v1/responses", headers=AUTH, json={
        "model": "small", "input": "x" * 400, "stream": True})
    assert r.status_code == 200 and '"upstream_error"' in r.text  # its last event
    # 400 characters: about 100 tokens, counted as estimated.
    assert rig.proxy.limits.take_usage() == {("k1", "small"): (1, 100, 0, 1)}


@contextlib.asynccontextmanager
async def stand_in(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """The vLLM stand-in serving "small" in-process, keeping responses
    (VLLM_ENABLE_RESPONSES_API_STORE): its URL."""
    monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")
    fake_vllm._import_aiohttp()  # the stand-in imports aiohttp once its argv is good
    fake = FakeVLLM(parse_args(["serve", "org/small", "--served-model-name", "small"]))
    server = TestServer(fake.make_app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def sdk(rig: Rig, key: str = CLIENT_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://gateway/v1", api_key=key, max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=rig.proxy)))


async def test_reading_a_stored_response_costs_its_key_no_tokens(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GET of a stored response (streamed too: its last event repeats the
    usage) and a cancel are requests with no tokens: their answers' usage
    is the create's, charged once. Seen to fail: each GET was charged the
    create's tokens again, which filled the key's tokens per minute until
    it was refused."""
    async with stand_in(monkeypatch) as url:
        vllm(rig, "small", ("a", url))
        rig.proxy.limits = Limiter(clock=lambda: 0.0, wall=lambda: 0.0)
        rig.table.set_client_keys({hash_key(CLIENT_KEY): KeyGrant(
            "k1", "t", limits=Limits(tokens_per_minute=15))})
        async with sdk(rig) as client:
            made = await client.responses.create(model="small", input="hello there")
            # 3 in, 7 out: "fake-vllm small echo: hello there (turn 1)".
            assert made.usage is not None
            assert (made.usage.input_tokens, made.usage.output_tokens) == (3, 7)
            for _ in range(3):
                got = await client.responses.retrieve(made.id)
                assert got.output_text == made.output_text
            r = await rig.http.get(f"/v1/responses/{made.id}?stream=true", headers=AUTH)
            assert r.status_code == 200 and '"response.completed"' in r.text, r.text
            assert '"input_tokens":3' in r.text  # the usage, repeated
            r = await rig.http.post(f"/v1/responses/{made.id}/cancel", headers=AUTH)
            assert r.status_code == 400  # completed: vLLM's "cannot cancel"
            # The key's window holds the create's 10 tokens alone: still admitted.
            again = await client.responses.create(model="small", input="more",
                                                  previous_response_id=made.id)
            assert again.output_text.endswith("(turn 2)")
    usage = rig.proxy.limits.take_usage()
    assert again.usage is not None
    assert usage == {("k1", "small"): (7, 3 + again.usage.input_tokens,
                                       7 + again.usage.output_tokens, 0)}


async def test_a_provider_s_response_is_its_key_s_alone(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """An external provider stores a conversation under its own id alone:
    the gateway gives each key that id bound to it, and refuses it from
    another key as it does its own replicas' ids ("not found", nothing sent
    to the provider). Seen to fail: key B, given key A's id as its
    previous_response_id, continued A's conversation at the provider."""
    other = "sk-other-key-0123456789"
    rig.table.set_client_keys({hash_key(CLIENT_KEY): KeyGrant("k1", "tests"),
                               hash_key(other): KeyGrant("k2", "other")})
    async with stand_in(monkeypatch) as url:
        # An external model: the provider's endpoint (engine ""), no request_id sent.
        rig.table.set_endpoints({"small": [Endpoint("external:small", url, "sk-provider")]})
        async with sdk(rig) as a, sdk(rig, other) as b:
            made = await a.responses.create(model="small", input="secret plans")
            calls = len(rig.attempts)
            with pytest.raises(openai.NotFoundError) as refused:
                await b.responses.create(model="small", input="what did I say?",
                                         previous_response_id=made.id)
            assert refused.value.code == "response_not_found", refused.value
            with pytest.raises(openai.NotFoundError):
                await b.responses.retrieve(made.id)
            assert len(rig.attempts) == calls  # nothing reached the provider
            # Its own key continues it, by the id it was given.
            raw = made.id.rsplit(".ext_", 1)[0]
            assert made.id != raw and raw.startswith("resp_")
            turn2 = await a.responses.create(model="small", input="and then",
                                             previous_response_id=made.id)
            assert turn2.output_text.endswith("(turn 2)")
            assert turn2.previous_response_id == made.id  # echoed as the client knows it
            # Streamed: every event names the response by its bound id.
            async with a.responses.stream(model="small", input="streamed",
                                          previous_response_id=turn2.id) as stream:
                ids = {e.response.id for e in [ev async for ev in stream]
                       if hasattr(e, "response")}
                final = await stream.get_final_response()
            assert ids == {final.id} and final.output_text.endswith("(turn 3)")
            turn4 = await a.responses.create(model="small", input="last",
                                             previous_response_id=final.id)
            assert turn4.output_text.endswith("(turn 4)")
            # The provider's own id, or a tag altered, proves nothing: not found.
            for given in (raw, made.id[:-1] + ("0" if made.id[-1] != "0" else "1")):
                with pytest.raises(openai.NotFoundError):
                    await a.responses.create(model="small", input="x",
                                             previous_response_id=given)
            # B's own conversation is B's.
            mine = await b.responses.create(model="small", input="mine")
            assert (await b.responses.create(model="small", input="on",
                                             previous_response_id=mine.id)
                    ).output_text.endswith("(turn 2)")


def test_a_provider_id_s_tag_comes_from_the_shared_secret_through_a_rotation() -> None:
    """Every gateway tags alike (the tag's key derives from LLMGW_SECRET);
    during a rotation the previous secret tags, which the gateways not yet
    restarted hold as their only one, and either is taken."""
    new, old = (responses.ProviderIds(responses.tag_keys(s)) for s in ("s-new", "s-old"))
    rotating = responses.ProviderIds(responses.tag_keys("s-new", "s-old"))
    made = rotating.wrap("resp_x", "k1")
    assert made.startswith("resp_x.ext_") and responses.replica_of(made, "k1") is None
    assert old.unwrap(made, "k1", "p") == rotating.unwrap(made, "k1", "p") == "resp_x"
    assert rotating.unwrap(new.wrap("resp_x", "k1"), "k1", "p") == "resp_x"
    for ids, given, owner in ((new, made, "k1"), (rotating, made, "k2")):
        with pytest.raises(Reply) as refused:  # the window over; another key's
            ids.unwrap(given, owner, "p")
        assert refused.value.status == 404
    assert new.unwrap("resp_x", "k1", "p") is None  # not wrapped: not one of these
