"""An engine's 500 caused by the client's parameters (app/router/engine_errors.py):
a 400 without the engine's internals, neither retried nor counted a server
error. The real llama.cpp engine: tests/test_llamacpp.py."""

from __future__ import annotations

import json

import pytest

from app.router.entries import Endpoint
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
