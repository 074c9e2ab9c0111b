"""External models: published to the router at the provider's URL with the
provider's key, read from its file at each publish."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from app.control import state as s
from app.control.keyfiles import ProviderKeys
from app.control.keys import SecretRing
from app.control.mirror import Mirror
from app.gateway.gateway import Gateway
from app.gateway.main import create_app
from app.gateway.publish import Publisher
from app.gateway.settings import Settings
from app.router.published import Endpoint
from app.router.table import RouteTable
from app.store.embedded import EmbeddedStore
from tests.support.procs import free_port, until

ADMIN = "external-test-admin-token-0123"
SECRET = "external-test-secret-0123456789"


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[EmbeddedStore]:
    st = await EmbeddedStore.open(tmp_path / "state.db", expiry_interval=None)
    yield st
    await st.close()


async def test_the_provider_key_is_read_at_each_publish(
    store: EmbeddedStore, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    key_file = keys / "provider.key"
    key_file.write_text("sk-provider-one\n")
    mirror = Mirror(store)
    table = RouteTable()
    publisher = Publisher(mirror, table, SecretRing(SECRET), keys=ProviderKeys(str(keys)))
    mirror.start()

    def key() -> list[str]:
        return [e.key for e in table.endpoints("remote")]

    try:
        spec = s.StoredModel(name="remote", aliases=["gpt"], external=s.External(
            url="https://llm.example.com/", model="gpt-x", api_key_file=str(key_file)))
        assert await mirror.wait_for(
            await store.put(s.MODELS + "remote", spec.model_dump_json().encode()), 2)
        publisher.publish()
        assert table.resolve("gpt") == "remote"
        # Read off the loop: until it is in, a request is held (not a 503).
        assert table.holdable("remote") and "is being read" in (table.unavailable("remote")
                                                                or "")
        await until(key, "the key read and published")
        assert table.endpoints("remote") == (Endpoint(
            "external:remote", "https://llm.example.com", "sk-provider-one",
            upstream_model="gpt-x"),)
        assert not publisher.publish()  # nothing changed: not republished

        # Rotated on disk: the next reread uses it, no store change needed.
        key_file.write_text("sk-provider-two")
        publisher.reread_keys()
        await until(lambda: key() == ["sk-provider-two"], "the rotated key")

        # Unreadable: not offered, and the 503 says why; logged once.
        caplog.set_level(logging.INFO, logger="app.control.keyfiles")
        key_file.unlink()
        publisher.reread_keys()
        await until(lambda: not key(), "the model withheld")
        publisher.reread_keys()
        await asyncio.sleep(0.1)
        assert not table.holdable("remote")
        assert "key file of external model 'remote' cannot be used: it does not exist" in (
            table.unavailable("remote") or "")
        assert len([r for r in caplog.records if "cannot be used" in r.getMessage()]) == 1
        key_file.write_text("sk-provider-three")
        publisher.reread_keys()
        await until(lambda: key() == ["sk-provider-three"], "the key back")
        assert "sk-provider" not in caplog.text
    finally:
        await mirror.stop()


async def test_the_periodic_publish_picks_up_a_rotated_key(
    store: EmbeddedStore, tmp_path: Path,
) -> None:
    (tmp_path / "keys").mkdir()
    key_file = tmp_path / "keys" / "provider.key"
    key_file.write_text("sk-one")
    mirror = Mirror(store)
    table = RouteTable()
    publisher = Publisher(mirror, table, SecretRing(SECRET),
                          keys=ProviderKeys(str(tmp_path / "keys")))
    mirror.start()
    runner = asyncio.create_task(publisher.run(0.05))
    try:
        spec = s.StoredModel(name="remote", external=s.External(
            url="http://127.0.0.1:9", model="m", api_key_file=str(key_file)))
        await store.put(s.MODELS + "remote", spec.model_dump_json().encode())

        async def key_is(value: str) -> None:
            for _ in range(100):
                if [e.key for e in table.endpoints("remote")] == [value]:
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"key {value!r} never published: {table.endpoints('remote')}")

        await key_is("sk-one")
        key_file.write_text("sk-two")
        await key_is("sk-two")
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await mirror.stop()


@contextlib.asynccontextmanager
async def provider_behind_a_gateway(
    tmp_path: Path, chat: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway, str]]:
    """A provider whose /v1/chat/completions is `chat`, put in an in-process
    gateway's catalog as external model "remote" (alias "gpt", "gpt-x" at
    the provider, key sk-provider-key in its file); yields a client of the
    gateway, the gateway and a client key."""
    provider = web.Application()
    provider.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(provider)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    (tmp_path / "keys").mkdir()
    key_file = tmp_path / "keys" / "provider.key"
    key_file.write_text("sk-provider-key\n")
    app = create_app(Settings(data_dir=tmp_path / "gw", admin_token=ADMIN, secret=SECRET,
                              local_agent=False, provider_key_dir=str(tmp_path / "keys")))
    gw: Gateway = app.state.gateway
    await gw.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as http:
            admin = {"Authorization": f"Bearer {ADMIN}"}
            r = await http.put("/admin/models/remote", headers=admin, json={
                "aliases": ["gpt"], "external": {"url": f"http://127.0.0.1:{port}",
                                                 "model": "gpt-x",
                                                 "api_key_file": str(key_file)}})
            assert r.status_code == 201, r.text
            key = (await http.post("/admin/keys", headers=admin, json={"name": "t"})).json()["key"]
            yield http, gw, key
    finally:
        await gw.stop()
        await runner.cleanup()


async def test_a_request_for_an_external_model_reaches_the_provider_with_its_key(
    tmp_path: Path,
) -> None:
    seen: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append({"path": request.path, "auth": request.headers.get("Authorization"),
                     "body": await request.json()})
        return web.json_response({"id": "c1", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"},
             "finish_reason": "stop"}]})

    async with provider_behind_a_gateway(tmp_path, chat) as (c, _, key):
        r = await c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"model": "gpt", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "hi"
        assert [(x["path"], x["auth"]) for x in seen] == [
            ("/v1/chat/completions", "Bearer sk-provider-key")]
        # The provider is asked for its own name of the model, not ours.
        assert seen[0]["body"]["model"] == "gpt-x"


async def test_an_external_models_answers_name_the_catalogs_model(tmp_path: Path) -> None:
    """The provider names its own model in every answer and stream chunk
    ("gpt-x-2024-07-18"); the client asked for ours, through an alias
    here, and reads the catalog's name back, as from our engines, plain
    and streamed, through the official `openai` client. Seen to fail: the
    provider's name came through."""
    import openai

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return b"data: " + json.dumps({
            "id": "c1", "object": "chat.completion.chunk", "created": 1,
            "model": "gpt-x-2024-07-18", "choices": [
                {"index": 0, "delta": delta, "finish_reason": finish}]}).encode() + b"\n\n"

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["model"] == "gpt-x"  # asked by its name at the provider
        if not body.get("stream"):
            return web.json_response({
                "id": "c1", "object": "chat.completion", "created": 1,
                "model": "gpt-x-2024-07-18", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "hi"},
                     "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in (chunk({"role": "assistant", "content": "h"}), chunk({"content": "i"}),
                      chunk({}, "stop"), b"data: [DONE]\n\n"):
            await resp.write(event)
        await resp.write_eof()
        return resp

    async with provider_behind_a_gateway(tmp_path, chat) as (http, gw, key):
        await until(lambda: gw.table.endpoints("remote"), "the provider's key read")
        client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, max_retries=0,
                                    http_client=http)
        messages: Any = [{"role": "user", "content": "x"}]
        plain = await client.chat.completions.create(model="gpt", messages=messages)
        assert plain.choices[0].message.content == "hi"
        assert plain.model == "remote"
        stream = await client.chat.completions.create(model="gpt", messages=messages,
                                                      stream=True)
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "hi"
        assert {c.model for c in chunks} == {"remote"}


def test_a_providers_responses_events_name_the_catalogs_model() -> None:
    """The Responses API's stream names the model inside each event's
    `response` (response.created, response.completed): renamed there too;
    chat chunks at the top; anything else untouched."""
    from app.router.answer_model import renamed_events

    created = {"type": "response.created", "response": {"id": "r1", "model": "gpt-x-2024"}}
    delta = {"type": "response.output_text.delta", "delta": "hi"}
    chunk = {"object": "chat.completion.chunk", "model": "gpt-x-2024", "choices": []}
    events = b"".join(b"event: x\ndata: " + json.dumps(e).encode() + b"\n\n"
                      for e in (created, delta, chunk))
    out = renamed_events(events, "remote")
    got = [json.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: ")]
    assert got == [{"type": "response.created", "response": {"id": "r1", "model": "remote"}},
                   delta, chunk | {"model": "remote"}]
    assert out.count(b"event: x\n") == 3
