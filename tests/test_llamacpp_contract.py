"""The llama.cpp contract: what llmgw relies on in llama-cpp-python's
server, asked of the stand-in the in-process tests run on
(tests/support/llamacpp_standin.py) and of the real engine (SmolLM2, started
by an all-in-one gateway's agent, tests/support/llamacpp_real.py) alike, so
that the stand-in cannot drift from the engine.

Each test sends the same requests to both, straight to the engine's port
with the replica's key, as a gateway does: a stream's shape (a role-only
event for a chat, then one event a token, the finish reason last, `[DONE]`,
no usage even when asked for: why the gateway counts a stream's prompt
itself, app/router/usage/stream_usage.py), its event separator, and the
prompt count our agent's route answers (app/wire/engine_routes.py) against
the unstreamed usage. The text the model writes differs; its shape does not.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from app.control.keys import engine_key
from app.wire.engine_routes import PROMPT_TOKENS
from tests.support.llamacpp_real import serve_smollm2
from tests.support.llamacpp_standin import LlamaCppStandin
from tests.support.procs import SECRET, Cluster

ASK = [{"role": "user", "content": "Say hi"}]


@dataclass
class Engine:
    kind: str
    url: str
    key: str

    async def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as client:
            return await client.post(self.url + path, json=body,
                                     headers={"Authorization": f"Bearer {self.key}"})


@pytest.fixture(scope="module")
def real_llamacpp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """One real engine for the module: its replica's own URL and key."""
    solo = Cluster(tmp_path_factory.mktemp("llamacpp-contract"), None, "")
    try:
        _, rep = serve_smollm2(solo)
        yield Engine("real", rep["url"], engine_key(SECRET, rep["id"]))
    finally:
        solo.close()


@pytest.fixture(params=["standin", "real"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[Engine]:
    if request.param == "real":
        yield request.getfixturevalue("real_llamacpp")
        return
    standin = LlamaCppStandin()
    await standin.server.start_server()
    try:
        yield Engine("standin", str(standin.server.make_url("")).rstrip("/"), "engine-key")
    finally:
        await standin.server.close()


def events(raw: bytes) -> list[Any]:
    """A stream's events in order, decoded (`[DONE]` as the string); its
    comments (llama-cpp-python's `: ping`) left out."""
    out: list[Any] = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = [line[len(b"data: "):] for line in block.split(b"\n")
                if line.startswith(b"data: ")]
        if data:
            text = b"\n".join(data).decode()
            out.append(text if text == "[DONE]" else json.loads(text))
    return out


async def test_a_chat_stream_is_role_first_a_token_an_event_and_never_usage(
        engine: Engine) -> None:
    r = await engine.post("/v1/chat/completions", {
        "model": "small", "messages": ASK, "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    # Events end with a blank line, LF (the stand-in sent CRLF until this
    # contract was written; app/router/sse.py reads both).
    assert r.content.endswith(b"}\n\ndata: [DONE]\n\n"), r.content[-80:]
    assert b"\r" not in r.content
    got = events(r.content)
    *chunks, done = got
    assert done == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert not chunks[0]["choices"][0]["delta"].get("content")
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    tokens = [c for c in chunks[1:-1] if c["choices"][0]["delta"].get("content")]
    assert 1 <= len(tokens) <= 4
    # Asked for, never sent: the gateway adds it (stream_usage.py).
    assert not any(c.get("usage") for c in chunks)


async def test_a_completion_stream_has_no_role_event_and_never_usage(engine: Engine) -> None:
    r = await engine.post("/v1/completions", {
        "model": "small", "prompt": "Once upon a time", "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    *chunks, done = events(r.content)
    assert done == "[DONE]"
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert sum(1 for c in chunks if c["choices"][0].get("text")) <= 4
    assert not any(c.get("usage") for c in chunks)


async def test_the_prompt_count_route_agrees_with_the_unstreamed_usage(engine: Engine) -> None:
    chat = {"model": "small", "messages": ASK, "max_tokens": 1}
    counted = await engine.post(PROMPT_TOKENS, chat)
    assert counted.status_code == 200, counted.text
    assert set(counted.json()) == {"count"}
    whole = await engine.post("/v1/chat/completions", chat)
    assert whole.status_code == 200, whole.text
    usage = whole.json()["usage"]
    assert set(usage) >= {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert counted.json()["count"] == usage["prompt_tokens"] > 0
