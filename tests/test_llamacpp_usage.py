"""A llama.cpp stream whose client asked for its usage
(`stream_options.include_usage`) gets the usage event vLLM would send,
before `[DONE]`: llama-cpp-python's server never sends one, so the gateway
has the engine count the prompt as it ends (once: the count it made after
the stream before, not a second), and the client is shown what its key is
charged. In-process, an engine stood in with llama-cpp-python's stream
shape; the real engine: tests/test_llamacpp.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from app.router.published import Endpoint
from app.wire.engine_routes import PROMPT_TOKENS
from tests.support.llamacpp_standin import PROMPT
from tests.support.llamacpp_standin import LlamaCppStandin as Engine
from tests.support.procs import until
from tests.support.proxy_rig import CHAT, CLIENT_KEY, MESSAGES, Rig


@pytest.fixture
async def engine(rig: Rig) -> AsyncIterator[Engine]:
    e = Engine()
    await e.server.start_server()
    url = str(e.server.make_url("")).rstrip("/")
    rig.table.set_endpoints({"small": [Endpoint("a", url, "engine-key-a", engine="llamacpp")]})
    try:
        yield e
    finally:
        await e.server.close()


def events(text: str) -> list[Any]:
    """The stream's events, decoded (`[DONE]` as the string)."""
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


async def stream(rig: Rig, path: str, body: dict[str, Any]) -> list[Any]:
    r = await rig.http.post(path, json={"model": "small", "stream": True} | body,
                            headers={"Authorization": f"Bearer {CLIENT_KEY}"})
    assert r.status_code == 200, r.text
    return events(r.text)


@pytest.mark.parametrize("path, body, completion", [
    (CHAT, {"messages": MESSAGES}, 4),  # 6 events: the role-only and the last carry none
    ("/v1/completions", {"prompt": "hello"}, 4),  # 5 events: the last carries none
])
async def test_a_client_that_asked_gets_the_usage_its_key_is_charged_before_done(
    rig: Rig, engine: Engine, path: str, body: dict[str, Any], completion: int,
) -> None:
    got = await stream(rig, path, body | {"stream_options": {"include_usage": True}})
    *tokens, usage, done = got
    assert done == "[DONE]"
    assert "usage" in usage, f"no usage event before [DONE]: the last was {usage}"
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": PROMPT, "completion_tokens": completion,
        "total_tokens": PROMPT + completion}, got
    # The stream's own id, object and model: an SDK parses it as a chunk of it.
    for field in ("id", "object", "created", "model"):
        assert usage[field] == tokens[-1][field], (field, usage)
    # Charged what it was shown, at once: not estimated, nothing counted after.
    assert [c for c in rig.proxy.limits.take_usage().values()] == [
        (1, PROMPT, completion, 0)]
    counts = [p for p, b in engine.asked if not b.get("stream")]
    assert len(counts) == 1, engine.asked  # the one count, made before [DONE]
    assert rig.proxy._counts.pending() == 0


async def test_a_count_that_fails_shows_and_charges_the_estimate_and_is_not_asked_again(
    rig: Rig, engine: Engine,
) -> None:
    engine.counts = False
    *_, usage, done = await stream(rig, CHAT, {"messages": MESSAGES,
                                               "stream_options": {"include_usage": True}})
    assert done == "[DONE]" and "usage" in usage, f"no usage event before [DONE]: {usage}"
    # "hello": 5 characters, 2 tokens; one completion token an event after the first.
    assert usage["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    assert [c for c in rig.proxy.limits.take_usage().values()] == [(1, 2, 5, 1)]
    assert rig.proxy._counts.pending() == 0
    assert len([p for p, b in engine.asked if not b.get("stream")]) == 1


async def test_a_client_that_did_not_ask_gets_no_usage_and_its_prompt_is_counted_after(
    rig: Rig, engine: Engine,
) -> None:
    got = await stream(rig, CHAT, {"messages": MESSAGES})
    assert got[-1] == "[DONE]" and not any("usage" in e for e in got[:-1]), got
    assert [c for c in rig.proxy.limits.take_usage().values()] == [(1, 0, 4, 0)]
    added = [0]

    def counted() -> bool:
        added[0] += sum(c[1] for c in rig.proxy.limits.take_usage().values())
        return added[0] == PROMPT

    await until(counted, "the prompt counted after the stream")


async def test_a_chat_s_prompt_is_counted_without_the_engine_running_the_chat_again(
    rig: Rig, engine: Engine,
) -> None:
    """The count goes to the route our agent adds to llama.cpp (the chat's
    template and tokenizer, the model not run), with what shapes the
    prompt and nothing else; an engine an older agent started (that route
    404) is asked the chat itself for one token, and its count is the same."""
    asked = {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
             "temperature": 0.7, "stream_options": {"include_usage": True}}
    *_, usage, _ = await stream(rig, CHAT, asked)
    assert usage["usage"]["prompt_tokens"] == PROMPT
    counts = [(p, b) for p, b in engine.asked if not b.get("stream")]
    assert counts == [(PROMPT_TOKENS, {"model": "small", "messages": MESSAGES,
                                       "tools": asked["tools"]})], counts
    engine.asked.clear()
    engine.counts_chats = False
    *_, usage, _ = await stream(rig, CHAT, asked)
    assert usage["usage"]["prompt_tokens"] == PROMPT
    paths = [(p, b.get("max_tokens")) for p, b in engine.asked if not b.get("stream")]
    assert paths == [(PROMPT_TOKENS, None), (CHAT, 1)], paths
