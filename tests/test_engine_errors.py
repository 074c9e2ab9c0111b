"""An engine's 500 caused by the client's parameters (app/router/engine_errors.py):
a 400 without the engine's internals, neither retried nor counted a server
error; its bare 404 for a route it does not serve (the Responses API), an
OpenAI error that says so. The real llama.cpp engine: tests/test_llamacpp.py."""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from app.router.published import Endpoint
from tests.support.proxy_rig import CHAT, CLIENT_KEY, MESSAGES, Rig

# What llama-cpp-python 0.3.36 answered (seen with SmolLM2) to OpenAI's
# `response_format: {"type": "json_schema", ...}`, which it does not take.
VALIDATION = (
    "1 validation error:\n  {'type': 'literal_error', 'loc': ('body', 'response_format', "
    "'type'), 'msg': \"Input should be 'text' or 'json_object'\", 'input': 'json_schema', "
    "'ctx': {'expected': \"'text' or 'json_object'\"}}\n\n  File \"/opt/venv/lib/python3.11/"
    "site-packages/llama_cpp/server/app.py\", line 376, in create_chat_completion\n"
    "    POST /v1/chat/completions")
TOOL = "Tool choice 'nope' not found in tools."


async def _two_llamacpp_replicas(rig: Rig, mode: str) -> None:
    first, second = await rig.upstream("a", mode), await rig.upstream("b")
    rig.table.set_endpoints({"small": [Endpoint("a", first.url, "k-a", engine="llamacpp"),
                                       Endpoint("b", second.url, "k-b", engine="llamacpp")]})


@pytest.mark.parametrize("stream", [False, True])
async def test_a_parameter_the_engine_refuses_is_a_400_naming_it(rig: Rig,
                                                                 stream: bool) -> None:
    await _two_llamacpp_replicas(rig, "500:" + VALIDATION)
    r = await rig.http.post(CHAT, headers={"Authorization": f"Bearer {CLIENT_KEY}"}, json={
        "model": "small", "messages": MESSAGES, "stream": stream,  # MESSAGES: "a" first
        "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "response_format.type"
    assert "Input should be 'text' or 'json_object'" in err["message"]
    for internal in ("File", "/opt/venv", "line 376", "validation error", "json_schema"):
        assert internal not in r.text
    assert r.headers["x-request-id"]
    assert len(rig.attempts) == 1  # not retried: "b" would refuse it alike
    assert rig.observed.seen == [("small", 400)]  # not a server error
    assert rig.table.cooldowns() == {}


async def test_a_tool_choice_naming_no_tool_is_a_400(rig: Rig) -> None:
    await _two_llamacpp_replicas(rig, "500:" + TOOL)
    r = await rig.chat("small")
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tool_choice" and "'nope'" in r.text


async def test_any_other_500_is_the_engines_failure_as_it_said(rig: Rig) -> None:
    await _two_llamacpp_replicas(rig, "500:llama_decode returned -3")
    r = await rig.chat("small")
    assert r.status_code == 500
    assert json.loads(r.text)["error"]["message"] == "llama_decode returned -3"
    assert r.headers["x-llmgw-replica"] == "a" and len(rig.attempts) == 1
    assert rig.observed.seen == [("small", 500)]


async def _not_found_engine() -> TestServer:
    """llama-cpp-python's server on a path it has no route for: FastAPI's bare 404."""
    async def handle(request: web.Request) -> web.Response:
        return web.json_response({"detail": "Not Found"}, status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


@pytest.mark.parametrize("stream", [False, True])
async def test_a_route_llamacpp_does_not_serve_is_a_404_that_says_so(
        rig: Rig, stream: bool) -> None:
    """The Responses API on a model served by llama.cpp: OpenAI's shape, the
    engine and the API named, not `{"detail": "Not Found"}`."""
    server = await _not_found_engine()
    try:
        url = str(server.make_url("")).rstrip("/")
        rig.table.set_endpoints({"small": [Endpoint("a", url, "k-a", engine="llamacpp")]})
        r = await rig.http.post("/v1/responses", headers={
            "Authorization": f"Bearer {CLIENT_KEY}"}, json={
            "model": "tiny", "input": "hi", "stream": stream})
    finally:
        await server.close()
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "model"
    assert err["code"] == "unsupported_endpoint", err
    assert "Responses API" in err["message"] and "llama.cpp" in err["message"], err
    assert "'small'" in err["message"], err  # the catalog's name of the alias asked
    assert "detail" not in r.text and r.headers["x-request-id"]
    assert rig.observed.seen == [("small", 404)]
    assert rig.table.cooldowns() == {}  # the replica is fine: the route is not there


async def test_a_route_llamacpp_does_not_serve_goes_to_a_replica_that_does(rig: Rig) -> None:
    """A model with llama.cpp and vLLM replicas: the request is the vLLM one's."""
    server = await _not_found_engine()
    vllm = await rig.upstream("b")
    try:
        url = str(server.make_url("")).rstrip("/")
        rig.table.set_endpoints({"small": [Endpoint("a", url, "k-a", engine="llamacpp"),
                                           Endpoint("b", vllm.url, "k-b", engine="vllm")]})
        r = await rig.http.post("/v1/responses", headers={
            "Authorization": f"Bearer {CLIENT_KEY}"}, json={"model": "small", "input": "hi"})
    finally:
        await server.close()
    assert r.status_code == 200 and r.json()["served_by"] == "b", r.text
    assert len(rig.attempts) == 2 and rig.table.cooldowns() == {}


# What llama-cpp-python 0.3.36 answers /v1/embeddings for a model not started
# with `--embedding true` (the quickstart's SmolLM2, seen through it).
NOT_AN_EMBEDDER = "Llama model must be created with embedding=True to call this method"


async def test_embeddings_of_a_model_not_started_for_them_is_a_404_that_says_so(
        rig: Rig) -> None:
    """Not the engine's failure (a 500), nor the client's parameters: the
    model does not serve that API. Answered as a route llama.cpp does not
    serve is, naming the model and what to do; not retried, no cooldown."""
    await _two_llamacpp_replicas(rig, "500:" + NOT_AN_EMBEDDER)
    r = await rig.http.post("/v1/embeddings", headers={"Authorization": f"Bearer {CLIENT_KEY}"},
                            json={"model": "small", "input": "hello"})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_endpoint" and err["param"] == "model", err
    assert "'small'" in err["message"] and "embedding" in err["message"], err
    assert len(rig.attempts) == 1 and rig.table.cooldowns() == {}
    assert rig.observed.seen == [("small", 404)]
