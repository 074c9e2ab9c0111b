"""A client's `Accept-Encoding` cannot hide its usage: an in-process gateway
in front of a provider that honours `Accept-Encoding` (as OpenAI's does),
asked by raw HTTP clients that accept br, gzip and deflate
(docs/design/security.md)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from app.control.keys import hash_client_key
from app.gateway.gateway import Gateway
from app.gateway.main import create_app
from app.gateway.settings import Settings
from tests.support.procs import free_port, until

ADMIN = "encodings-test-admin-token-0123"
SECRET = "encodings-test-secret-0123456789"
USAGE = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
# br when this venv can make it, else gzip: either escaped the gateway's
# count before (a br answer unreadable, a gzip stream read by no one).
BR = importlib.util.find_spec("brotli") is not None


class Provider:
    """OpenAI's chat API, compressing as the request accepts."""

    def __init__(self) -> None:
        self.asked: list[str] = []  # each request's Accept-Encoding

    def _encoding(self, request: web.Request) -> str | None:
        accepted = request.headers.get("Accept-Encoding", "")
        self.asked.append(accepted)
        for name in (("br",) if BR else ()) + ("gzip", "deflate"):
            if name in accepted:
                return name
        return None

    @staticmethod
    def _packer(encoding: str | None) -> Any:
        if encoding == "br":
            import brotli
            return brotli.Compressor()
        if encoding is not None:
            return zlib.compressobj(wbits=31 if encoding == "gzip" else 15)
        return None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        encoding = self._encoding(request)
        if not body.get("stream"):
            raw = json.dumps({"id": "c1", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "a b c"},
                 "finish_reason": "stop"}], "usage": USAGE}).encode()
            packer = self._packer(encoding)
            if packer is not None:
                raw = packer.process(raw) + packer.finish() if encoding == "br" else (
                    packer.compress(raw) + packer.flush())
            return web.Response(body=raw, content_type="application/json",
                                headers={"Content-Encoding": encoding} if encoding else None)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if encoding:
            resp.headers["Content-Encoding"] = encoding
        await resp.prepare(request)
        packer = self._packer(encoding)
        events = [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in "abc"]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({"choices": [], "usage": USAGE})
        for event in [*events, "[DONE]"]:
            data = b"data: " + (event if isinstance(event, str) else json.dumps(event)).encode()
            data += b"\n\n"
            if encoding == "br":
                data = packer.process(data) + packer.flush()
            elif packer is not None:
                data = packer.compress(data) + packer.flush(zlib.Z_SYNC_FLUSH)
            await resp.write(data)
        if packer is not None:
            await resp.write(packer.finish() if encoding == "br" else packer.flush())
        await resp.write_eof()
        return resp


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient, Provider,
                                                          str]]:
    """A gateway serving external model "remote" at the provider; a client key."""
    provider = Provider()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", provider.chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    (tmp_path / "keys").mkdir()
    key_file = tmp_path / "keys" / "provider.key"  # under LLMGW_PROVIDER_KEY_DIR
    key_file.write_text("sk-provider-key")
    gw_app = create_app(Settings(data_dir=tmp_path / "gw", admin_token=ADMIN, secret=SECRET,
                                 local_agent=False, provider_key_dir=str(tmp_path / "keys")))
    gw: Gateway = gw_app.state.gateway
    await gw.start()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=gw_app),
                               base_url="http://gw")
    try:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        r = await client.put("/admin/models/remote", headers=admin, json={"external": {
            "url": f"http://127.0.0.1:{port}", "model": "m", "api_key_file": str(key_file)}})
        assert r.status_code == 201, r.text
        key = (await client.post("/admin/keys", headers=admin, json={"name": "t"})).json()["key"]
        await until(lambda: gw.table.endpoints("remote"), "remote routed")
        yield gw, client, provider, key
    finally:
        await client.aclose()
        await gw.stop()
        await runner.cleanup()


async def test_a_client_accepting_br_gets_a_counted_answer_it_can_read(
        gateway: tuple[Gateway, httpx.AsyncClient, Provider, str]) -> None:
    gw, client, provider, key = gateway
    headers = {"Authorization": f"Bearer {key}", "Accept-Encoding": "br, gzip, deflate"}
    chat = {"model": "remote", "messages": [{"role": "user", "content": "x"}]}
    plain = await client.post("/v1/chat/completions", json=chat, headers=headers)
    assert plain.status_code == 200, plain.text
    # Raw: what came on the wire is identity, valid whatever the client accepted.
    assert "content-encoding" not in plain.headers
    assert json.loads(plain.content)["usage"] == USAGE
    async with client.stream("POST", "/v1/chat/completions", headers=headers,
                             json=chat | {"stream": True}) as r:
        assert r.status_code == 200 and "content-encoding" not in r.headers
        raw = b"".join([c async for c in r.aiter_raw()])
    assert raw == b"".join(b'data: {"choices": [{"index": 0, "delta": {"content": "%s"}}]}\n\n'
                           % w for w in (b"a", b"b", b"c")) + b"data: [DONE]\n\n"
    assert provider.asked == ["identity", "identity"]
    # Both answers' tokens charged to the key, none estimated.
    grant = gw.table.grant(hash_client_key(key))
    assert grant is not None
    assert gw.proxy.limits.take_usage() == {(grant.id, "remote"): (2, 2 * 11, 2 * 3, 0)}


async def test_a_provider_compressing_anyway_is_still_counted_when_it_can_be(
        gateway: tuple[Gateway, httpx.AsyncClient, Provider, str]) -> None:
    # A provider that ignores `identity`: a gzip plain answer is read for its
    # usage and passed on as sent (the client asked for nothing).
    gw, client, provider, key = gateway
    provider._encoding = lambda request: "gzip"  # type: ignore[method-assign]
    async with client.stream("POST", "/v1/chat/completions",
                             headers={"Authorization": f"Bearer {key}"}, json={
                                 "model": "remote",
                                 "messages": [{"role": "user", "content": "x"}]}) as r:
        assert r.status_code == 200 and r.headers["content-encoding"] == "gzip"
        raw = b"".join([c async for c in r.aiter_raw()])
    assert json.loads(gzip.decompress(raw))["usage"] == USAGE
    [(_, counts)] = gw.proxy.limits.take_usage().items()
    assert counts == (1, 11, 3, 0)

