"""Client keys through two in-process gateways on one real etcd, with the
official `openai` client and the vLLM stand-in (in-process, as an external
model's provider): limits held across both gateways, expiry, revocation,
usage counted from plain and streamed answers and written in batches
(docs/design/client-keys.md)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp.test_utils import TestServer

from app.control import state as s
from app.control.key_usage import KeyUsageWriter, usage_key
from app.control.keys import hash_client_key
from app.control.mirror import Mirror
from app.gateway.main import GatewayApp, create_app
from app.gateway.settings import Settings
from app.router.published import NO_LIMITS, Limits
from app.router.usage.limits import Limiter
from app.store.embedded import EmbeddedStore
from app.store.etcd.store import EtcdStore
from tests.fakes import fake_vllm
from tests.fakes.fake_vllm import FakeVLLM, parse_args
from tests.support.etcd import EtcdServer, ExternalEtcd
from tests.support.procs import until

SECRET = "client-keys-secret-0123456789"
ADMIN = "client-keys-admin-0123456789"
PROVIDER_KEY = "provider-key-0123456789"
MESSAGES = [{"role": "user", "content": "count my tokens please"}]


class Gw:
    """One in-process gateway: its app, an admin client, its usage writer."""

    def __init__(self, app: GatewayApp) -> None:
        self.app = app
        self.gw = app.state.gateway
        self.admin = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                       base_url="http://gw",
                                       headers={"Authorization": f"Bearer {ADMIN}"})
        # What main.py's lifespan runs every LLMGW_KEY_USAGE_INTERVAL; driven here.
        self.usage = KeyUsageWriter(self.gw.store, self.gw.mirror,
                                    self.gw.settings.gateway_id, self.gw.proxy.limits)

    def client(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            api_key=key, base_url="http://gw/v1", max_retries=0,
            http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app)))


@asynccontextmanager
async def stand_in(tmp: Path) -> AsyncIterator[tuple[FakeVLLM, dict[str, Any]]]:
    """The vLLM stand-in serving "m", and the spec of an external model at it."""
    fake_vllm._import_aiohttp()  # the stand-in imports aiohttp once its argv is good
    fake = FakeVLLM(parse_args(["serve", "org/m", "--served-model-name", "m",
                                "--api-key", PROVIDER_KEY]))
    server = TestServer(fake.make_app(), host="127.0.0.1")
    await server.start_server()
    (tmp / "keys").mkdir(exist_ok=True)
    key_file = tmp / "keys" / "provider-key"  # under LLMGW_PROVIDER_KEY_DIR, see key_dir
    key_file.write_text(PROVIDER_KEY)
    try:
        yield fake, {"external": {"url": str(server.make_url("")).rstrip("/"), "model": "m",
                                  "api_key_file": str(key_file)}}
    finally:
        await server.close()


async def _serve_m(gws: list[Gw], spec: dict[str, Any]) -> None:
    for g in gws:
        await until(lambda g=g: g.gw.ready, "mirror loaded")
    r = await gws[0].admin.put("/admin/models/m", json=spec)
    assert r.status_code == 201, r.text
    for g in gws:
        await until(lambda g=g: g.gw.table.endpoints("m"), "m routed")


@asynccontextmanager
async def fleet(etcd: EtcdServer | ExternalEtcd, prefix: str, tmp: Path
                ) -> AsyncIterator[tuple[Gw, Gw, FakeVLLM]]:
    """Two gateways serving model "m", an external model at the stand-in."""
    apps = [create_app(Settings(
        etcd_endpoints=etcd.endpoint, etcd_prefix=prefix, secret=SECRET, admin_token=ADMIN,
        gateway_id=f"gw{i}", port=19100 + i, data_dir=tmp / f"gw{i}", local_agent=False,
        provider_key_dir=str(tmp / "keys")))
        for i in range(2)]
    gws: list[Gw] = []
    async with stand_in(tmp) as (fake, spec):
        try:
            for app in apps:
                await app.state.gateway.start()
                gws.append(Gw(app))
            await _serve_m(gws, spec)
            yield gws[0], gws[1], fake
        finally:
            for g in gws:
                await g.admin.aclose()
            for app in apps:
                await app.state.gateway.stop()


async def _new_key(g: Gw, **body: Any) -> dict[str, Any]:
    r = await g.admin.post("/admin/keys", json={"name": "alice"} | body)
    assert r.status_code == 201, r.text
    created: dict[str, Any] = r.json()
    return created


async def _both_see(a: Gw, b: Gw, key: str, gateways: int = 2) -> None:
    """Each gateway's router has the key, shared among `gateways`."""
    digest = hash_client_key(key)
    for g in (a, b):
        await until(lambda g=g: (grant := g.gw.table.grant(digest)) is not None
                     and grant.gateways == gateways, "the key's grant")


async def _usage(g: Gw, key_id: str) -> dict[str, Any]:
    r = await g.admin.get(f"/admin/keys/{key_id}/usage")
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


async def test_requests_per_minute_hold_across_two_gateways(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async with fleet(etcd_server, etcd_prefix, tmp_path) as (a, b, _):
        key = await _new_key(a, limits={"requests_per_minute": 4})
        await _both_see(a, b, key["key"])
        free = await _new_key(a, name="free")
        await _both_see(a, b, free["key"])
        # A key without limits is granted NO_LIMITS itself, which the
        # limiter tells by identity (app/gateway/publish.py, `_limits`).
        limited = a.gw.table.grant(hash_client_key(key["key"]))
        unlimited = a.gw.table.grant(hash_client_key(free["key"]))
        assert limited is not None and unlimited is not None
        assert limited.limits.requests_per_minute == 4 and limited.limits is not NO_LIMITS
        assert unlimited.limits is NO_LIMITS
        clients = [a.client(key["key"]), b.client(key["key"])]
        ok: list[Any] = []
        refused: list[openai.RateLimitError] = []
        for i in range(12):  # a load balancer's round robin, at a client's pace
            try:
                ok.append(await clients[i % 2].chat.completions.create(
                    model="m", messages=MESSAGES))  # type: ignore[arg-type]
            except openai.RateLimitError as exc:
                refused.append(exc)
            await asyncio.sleep(0.2)
        # The limit, plus at most one request on a gateway whose claim was
        # still 0 (L + N - 1): not 2 x 4.
        assert 4 <= len(ok) <= 5 and len(refused) == 12 - len(ok)
        for exc in refused:
            assert exc.status_code == 429
            assert 1 <= int(exc.response.headers["retry-after"]) <= 60
            err = exc.response.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
            assert "limit 4" in err["message"]
        # Usage: the admitted requests and the tokens the stand-in reported.
        assert await a.usage.flush() == 1 and await b.usage.flush() == 1
        prompt = sum(c.usage.prompt_tokens for c in ok if c.usage)
        completion = sum(c.usage.completion_tokens for c in ok if c.usage)
        assert prompt > 0 and completion > 0
        await until(lambda: len(b.gw.mirror.parsed(s.KEY_USAGE, s.KeyUsage)) == 2,
                     "both gateways' usage")
        usage = await _usage(b, key["id"])
        expected = {"requests": len(ok), "prompt_tokens": prompt, "completion_tokens": completion,
                    "estimated": 0}
        assert usage["models"] == {"m": expected} and usage["total"] == expected
        assert sorted(usage["gateways"]) == ["gw0", "gw1"]


async def test_concurrency_is_shared_and_freed_when_an_answer_ends(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async with fleet(etcd_server, etcd_prefix, tmp_path) as (a, b, fake):
        key = await _new_key(a, limits={"concurrent_requests": 2})
        await _both_see(a, b, key["key"])
        ca, cb = a.client(key["key"]), b.client(key["key"])
        fake.token_delay = 0.5  # a few words: long enough to be held open
        held = [asyncio.create_task(ca.chat.completions.create(
            model="m", messages=MESSAGES)) for _ in range(2)]  # type: ignore[arg-type]
        # The second waits for gateway A's claim to be raised: admitted.
        await until(lambda: a.gw.proxy.limits.inflight(key["id"]) == 2, "two in flight")
        with pytest.raises(openai.RateLimitError) as over:  # the key's limit: at once
            await ca.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
        assert "concurrent" in over.value.message and "limit 2, 2 held" in over.value.message
        assert over.value.response.headers["retry-after"] == "1"
        fake.token_delay = 0.0
        # The other gateway admits its floor, one request: L + N - 1 in all.
        assert (await cb.chat.completions.create(
            model="m", messages=MESSAGES)).choices  # type: ignore[arg-type]
        await asyncio.gather(*held)
        assert a.gw.proxy.limits.inflight(key["id"]) == 0
        assert (await ca.chat.completions.create(
            model="m", messages=MESSAGES)).choices  # type: ignore[arg-type]


async def test_a_sticky_clients_bursts_are_never_refused_below_its_limits(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    """A client all on one gateway (a sticky balancer, a pooled connection)
    of two, its key 4 at once and 30 a minute: a few requests one after
    another, then 4 streams at once, on five new keys. Each round fits the
    key's limits, so none is refused: a request refused on the gateway's
    claim below the key's limit waits for the claim to be raised
    (docs/design/client-keys.md). Seen to fail without the wait:
    the second request refused, the key at 1 of 30 a minute."""
    async with fleet(etcd_server, etcd_prefix, tmp_path) as (a, b, fake):
        refused: list[str] = []

        async def one(client: openai.AsyncOpenAI, stream: bool) -> None:
            try:
                if stream:
                    async for _ in await client.chat.completions.create(
                            model="m", messages=MESSAGES, stream=True):  # type: ignore[arg-type]
                        pass
                else:
                    await client.chat.completions.create(
                        model="m", messages=MESSAGES)  # type: ignore[arg-type]
            except openai.RateLimitError as exc:
                refused.append(exc.message)

        for _ in range(5):
            key = await _new_key(a, limits={"concurrent_requests": 4,
                                            "requests_per_minute": 30})
            await _both_see(a, b, key["key"])
            client = a.client(key["key"])
            fake.token_delay = 0.0
            for _ in range(3):
                await one(client, stream=False)
            fake.token_delay = 0.1  # each stream ~0.7 s: the four are open together
            await asyncio.gather(*(one(client, stream=True) for _ in range(4)))
            assert a.gw.proxy.limits.inflight(key["id"]) == 0
        assert refused == [], refused
        assert fake.stats.success["stop"] >= 5 * 7


async def test_streamed_usage_is_counted_and_shown_only_to_a_client_that_asked(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async with fleet(etcd_server, etcd_prefix, tmp_path) as (a, b, fake):
        key = await _new_key(a)
        await _both_see(a, b, key["key"])
        client = a.client(key["key"])
        # Did not ask: no usage chunk reaches it, yet its tokens are counted.
        chunks = [c async for c in await client.chat.completions.create(
            model="m", messages=MESSAGES, stream=True)]  # type: ignore[arg-type]
        assert chunks and all(c.choices and c.usage is None for c in chunks)
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text.startswith("fake-vllm m echo")
        # Asked: its usage chunk arrives, last, with no choices.
        asked = [c async for c in await b.client(key["key"]).chat.completions.create(
            model="m", messages=MESSAGES, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True})]
        assert asked[-1].choices == [] and asked[-1].usage is not None
        assert sum(1 for c in asked if c.usage is not None) == 1
        # A text completion, streamed, and a plain chat answer.
        done = [c async for c in await client.completions.create(
            model="m", prompt="one two three", stream=True)]
        assert done and all(c.usage is None for c in done)
        plain = await client.chat.completions.create(
            model="m", messages=MESSAGES)  # type: ignore[arg-type]
        assert plain.usage is not None
        assert await a.usage.flush() == 1 and await b.usage.flush() == 1
        await until(lambda: len(a.gw.mirror.parsed(s.KEY_USAGE, s.KeyUsage)) == 2,
                     "both gateways' usage")
        usage = await _usage(a, key["id"])
        # Every token the stand-in generated or read, and nothing else.
        assert usage["total"] == {"requests": 4,
                                  "prompt_tokens": fake.stats.prompt_tokens,
                                  "completion_tokens": fake.stats.generation_tokens,
                                  "estimated": 0}


async def test_keys_are_shown_once_listed_by_prefix_expire_and_are_revoked(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async with fleet(etcd_server, etcd_prefix, tmp_path) as (a, b, _):
        key = await _new_key(a, models=["m"], expires_in=3600,
                             limits={"tokens_per_minute": 1000})
        assert key["key"].startswith(key["prefix"]) and len(key["prefix"]) == 16
        assert key["expires"] > key["created"]
        listed = (await b.admin.get("/admin/keys")).json()
        assert [k["prefix"] for k in listed] == [key["prefix"]]
        assert key["key"] not in json.dumps(listed)
        assert listed[0]["limits"]["tokens_per_minute"] == 1000
        one = (await b.admin.get(f"/admin/keys/{key['id']}")).json()
        assert one["expired"] is False and "key" not in one
        # What etcd holds: the hash and the prefix, never the key.
        stored = await a.gw.store.range(s.KEYS)
        assert [kv.key for kv in stored.kvs] == [s.KEYS + hash_client_key(key["key"])]
        assert key["key"] not in stored.kvs[0].value.decode()
        # Bad bodies name what is wrong, in problem JSON.
        for body, word in (({"name": "x", "limits": {"rpm": 5}}, "rpm"),
                           ({"name": "x", "expires": 1.0}, "past"),
                           ({"name": "x", "limits": {"requests_per_minute": 0}},
                            "requests_per_minute")):
            r = await a.admin.post("/admin/keys", json=body)
            assert r.status_code == 422 and word in r.text, r.text
        await _both_see(a, b, key["key"])
        client = b.client(key["key"])
        assert (await client.chat.completions.create(
            model="m", messages=MESSAGES)).choices  # type: ignore[arg-type]
        # Expiry: checked per request against the gateway's wall clock.
        later = Limiter(wall=lambda: key["expires"] + 1)
        b.gw.proxy.limits = later
        with pytest.raises(openai.AuthenticationError) as expired:
            await client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
        assert "expired" in expired.value.message
        # Revoked through gateway A: gateway B refuses it by watch.
        assert (await a.admin.delete(f"/admin/keys/{key['id']}")).status_code == 204
        digest = hash_client_key(key["key"])
        await until(lambda: a.gw.table.grant(digest) is None
                     and b.gw.table.grant(digest) is None, "the key revoked")
        with pytest.raises(openai.AuthenticationError):
            await a.client(key["key"]).chat.completions.create(
                model="m", messages=MESSAGES)  # type: ignore[arg-type]
        assert (await a.admin.get("/admin/keys")).json() == []
        assert (await a.admin.get(f"/admin/keys/{key['id']}/usage")).status_code == 404


async def test_a_key_stored_before_limits_existed_still_works(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async with fleet(etcd_server, etcd_prefix, tmp_path) as (a, b, _):
        old_key = "sk-llmgw-written-by-an-older-gateway"
        old = {"id": "0123456789ab", "name": "legacy", "created": 1.0, "models": []}
        await a.gw.store.put(s.KEYS + hash_client_key(old_key), json.dumps(old).encode())
        await _both_see(a, b, old_key)
        assert (await a.client(old_key).chat.completions.create(
            model="m", messages=MESSAGES)).choices  # type: ignore[arg-type]
        (listed,) = (await a.admin.get("/admin/keys")).json()
        assert listed["prefix"] == "" and listed["expires"] is None
        assert listed["limits"] == {"requests_per_minute": None, "tokens_per_minute": None,
                                    "concurrent_requests": None, "external_tokens_per_day": None}


class Counted:
    """A usage source holding what a test hands it."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], tuple[int, int, int, int]] = {}

    def take_usage(self) -> dict[tuple[str, str], tuple[int, int, int, int]]:
        taken, self.counts = self.counts, {}
        return taken


async def test_usage_writes_survive_a_lagging_mirror_and_an_unreachable_store(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str
) -> None:
    store = await EtcdStore.open([etcd_server.endpoint], prefix=etcd_prefix)
    dead = await EtcdStore.open(["127.0.0.1:9"], prefix=etcd_prefix, timeout=0.5)
    try:
        source = Counted()
        # A mirror never loaded: every record it shows is absent, i.e. stale.
        writer = KeyUsageWriter(store, Mirror(store), "gw0", source, clock=lambda: 7.0)
        source.counts = {("k1", "m"): (1, 10, 20, 0), ("k2", "m"): (2, 3, 4, 0)}
        assert await writer.flush() == 2
        # Written on a stale read, refused, redone on a fresh one: nothing lost.
        source.counts = {("k1", "m"): (1, 5, 5, 1), ("k1", "other"): (1, 1, 1, 0)}
        assert await writer.flush() == 1
        writer._store = dead  # the store is gone: the counts wait
        source.counts = {("k1", "m"): (1, 1, 1, 0)}
        assert await writer.flush() == 0 and writer.pending == 1
        writer._store = store
        assert await writer.flush() == 1 and writer.pending == 0
        kv = await store.get(usage_key("k1", "gw0"))
        assert kv is not None
        rec = s.KeyUsage.model_validate_json(kv.value)
        assert {m: (u.requests, u.prompt_tokens, u.completion_tokens, u.estimated)
                for m, u in rec.models.items()} == {"m": (3, 16, 26, 1), "other": (1, 1, 1, 0)}
        assert rec.key == "k1" and rec.gateway == "gw0" and rec.updated == 7.0
    finally:
        await dead.close()
        await store.close()


async def test_a_gateway_writes_its_usage_every_interval_and_when_it_stops(
    tmp_path: Path
) -> None:
    """main.py's wiring, through the app's own lifespan, on the embedded store."""
    settings = Settings(secret=SECRET, admin_token=ADMIN, gateway_id="solo",
                        data_dir=tmp_path / "gw", local_agent=False, key_usage_interval=0.1,
                        provider_key_dir=str(tmp_path / "keys"))
    app = create_app(settings)
    async with stand_in(tmp_path) as (fake, spec):
        async with app.router.lifespan_context(app):
            g = Gw(app)
            await _serve_m([g], spec)
            key = await _new_key(g)
            await until(lambda: g.gw.table.grant(hash_client_key(key["key"])), "the key")
            client = g.client(key["key"])
            await client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
            await until(lambda: g.gw.mirror.parsed(s.KEY_USAGE, s.KeyUsage), "usage written")
            assert (await _usage(g, key["id"]))["total"]["requests"] == 1
            # Counted just before the stop: written by the stop itself.
            g.gw.proxy.limits.admit(key["id"], "m", Limits()).release()
            await g.admin.aclose()
        store = await EmbeddedStore.open(settings.data_dir / "state.db")
        try:
            kv = await store.get(usage_key(key["id"], "solo"))
            assert kv is not None
            assert s.KeyUsage.model_validate_json(kv.value).models["m"].requests == 2
        finally:
            await store.close()
        assert fake.stats.prompt_tokens > 0
