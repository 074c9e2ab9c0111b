"""Spill-over in-process (docs/architecture.md, Catalog, *Spill-over*): when
a model's replicas are saturated or none is ready within the hold, its
requests go to its overflow, charged to the key's external budget."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from app.router.budget import ExternalBudget
from app.router.choice import EngineLoad
from app.router.entries import CatalogEntry, Endpoint, KeyGrant, Limits
from app.router.limits import Limiter, OverLimit
from app.router.timeouts import Timeouts
from app.wire.catalog import check_catalog, overflow_problem, overflowing_to
from app.wire.spec import ModelSpec
from tests.support.proxy_rig import CHAT, CLIENT_KEY, MESSAGES, Rig, hash_key, started

DAY = 86400.0


class Provider:
    """An outside provider: answers chats (plain or streamed) with usage."""

    def __init__(self, tokens: int = 12) -> None:
        self.seen: list[dict[str, Any]] = []
        self.tokens = tokens
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self.server = TestServer(app, host="127.0.0.1")

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        usage = {"prompt_tokens": self.tokens - 2, "completion_tokens": 2,
                 "total_tokens": self.tokens}
        if not body.get("stream"):
            return web.json_response({"id": "p1", "object": "chat.completion",
                                      "model": body["model"], "usage": usage, "choices": [
                                          {"index": 0, "finish_reason": "stop", "message": {
                                              "role": "assistant", "content": "remote"}}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in ({"choices": [{"index": 0, "delta": {"content": "remote"}}]},
                      {"choices": [], "usage": usage}):
            await resp.write(f"data: {json.dumps(chunk | {'model': body['model']})}\n\n"
                             .encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
async def spill_rig() -> AsyncIterator[tuple[Rig, Provider]]:
    """`small` on one local replica, overflowing to `remote` (model `gpt-x`
    at the provider); the key's external budget 15 tokens a day."""
    rig = Rig(Timeouts(connect=2, first_byte=10, idle=10, request=10, cooldown=5,
                       spill_hold=0.1))
    provider = Provider()
    await provider.server.start_server()
    async with started(rig):
        rig.proxy.limits = Limiter(clock=rig.clock, wall=rig.clock)
        local = await rig.upstream("local")
        rig.table.set_catalog([CatalogEntry("small", ("tiny",), 1), CatalogEntry("remote")])
        rig.table.set_endpoints({
            "small": [Endpoint("r1", local.url, "engine-key-r1", engine="vllm")],
            "remote": [Endpoint("external:remote", provider.url, "sk-provider",
                                upstream_model="gpt-x")]})
        rig.table.set_overflow({"small": "remote"})
        rig.table.set_client_keys({hash_key(CLIENT_KEY): KeyGrant(
            "k1", "tests", limits=Limits(external_tokens_per_day=15))})
        try:
            yield rig, provider
        finally:
            await provider.server.close()


def saturate(rig: Rig, waiting: float = 8, kv: float = 0.1) -> None:
    rig.table.set_loads({"r1": EngineLoad(running=4, waiting=waiting, kv_cache=kv,
                                          at=rig.clock.now)})


async def test_a_saturated_model_spills_to_its_overflow(
    spill_rig: tuple[Rig, Provider],
) -> None:
    rig, provider = spill_rig
    saturate(rig, waiting=7)  # one short of saturated: served here
    r = await rig.chat("tiny")
    assert r.status_code == 200 and r.json()["served_by"] == "local"
    assert "x-llmgw-served-by" not in r.headers and not provider.seen

    saturate(rig)
    r = await rig.chat("tiny")
    assert r.status_code == 200, r.text
    assert r.headers["x-llmgw-served-by"] == "overflow:remote"
    assert r.headers["x-llmgw-replica"] == "external:remote"
    assert r.json()["choices"][0]["message"]["content"] == "remote"
    assert provider.seen[-1]["model"] == "gpt-x"  # the provider's name of the model
    assert r.json()["model"] == "small"  # answered as our engines answer, catalog name
    assert rig.table.spills == {("small", "saturated"): 1}
    # Its usage is the overflow's, its tokens the key's external budget.
    assert rig.proxy.limits.external.used("k1") == 12
    usage = rig.proxy.limits.take_usage()
    assert usage[("k1", "remote")] == (1, 10, 2, 0)
    assert usage[("k1", "small")][0] == 1

    # A KV cache full is saturated too.
    saturate(rig, waiting=0, kv=0.99)
    assert rig.table.saturated("small")


async def test_a_spilled_stream_goes_to_the_overflow_whole(
    spill_rig: tuple[Rig, Provider],
) -> None:
    rig, provider = spill_rig
    saturate(rig)
    async with rig.http.stream("POST", CHAT, headers={"Authorization": f"Bearer {CLIENT_KEY}"},
                               json={"model": "small", "messages": MESSAGES,
                                     "stream": True}) as r:
        body = (await r.aread()).decode()
    assert r.status_code == 200 and r.headers["x-llmgw-served-by"] == "overflow:remote"
    assert '"remote"' in body and body.rstrip().endswith("data: [DONE]")
    assert '"usage"' not in body  # asked for on the client's behalf, cut from its stream
    assert '"model": "small"' in body and "gpt-x" not in body
    assert provider.seen[-1]["stream_options"] == {"include_usage": True}
    assert rig.proxy.limits.external.used("k1") == 12


async def test_the_key_external_budget_spent_is_a_429_of_its_own(
    spill_rig: tuple[Rig, Provider],
) -> None:
    rig, provider = spill_rig
    saturate(rig)
    assert (await rig.chat("small")).status_code == 200  # 12 of 15
    assert (await rig.chat("small")).status_code == 200  # 12 < 15: admitted, now 24
    r = await rig.chat("small")
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "external_budget_exceeded" and err["type"] == "tokens"
    assert "external_tokens_per_day 15" in err["message"] and "'remote'" in err["message"]
    assert int(r.headers["retry-after"]) >= 1
    assert len(provider.seen) == 2 and rig.table.spills == {("small", "saturated"): 2}

    # Local room is not charged: served at once.
    saturate(rig, waiting=0)
    r = await rig.chat("small")
    assert r.status_code == 200 and r.json()["served_by"] == "local"
    # A day later the budget is back.
    rig.clock.now += DAY
    saturate(rig)
    r = await rig.chat("small")
    assert r.status_code == 200 and r.headers["x-llmgw-served-by"] == "overflow:remote"


async def test_no_ready_replica_within_the_hold_spills(
    spill_rig: tuple[Rig, Provider],
) -> None:
    rig, provider = spill_rig
    rig.table.set_endpoints({"remote": rig.table.endpoints("remote")})  # small: none
    # None on its way: spilled at once, where the client got a 503.
    r = await rig.chat("small")
    assert r.status_code == 200 and r.headers["x-llmgw-served-by"] == "overflow:remote"
    # One on its way that is not ready within the spill hold (0.1 s).
    rig.table.set_holdable({"small"})
    t0 = asyncio.get_running_loop().time()
    r = await rig.chat("small")
    assert r.status_code == 200 and r.headers["x-llmgw-served-by"] == "overflow:remote"
    assert 0.1 <= asyncio.get_running_loop().time() - t0 < 2
    assert rig.table.spills == {("small", "no_replica"): 1, ("small", "hold_timeout"): 1}
    assert not rig.table.held()

    # Ready within the hold: served here.
    local = rig.upstreams[0]

    async def ready_soon() -> None:
        await asyncio.sleep(0.03)
        rig.table.set_endpoints({"small": [Endpoint("r1", local.url, "k")],
                                 "remote": rig.table.endpoints("remote")})

    rig.table.set_endpoints({"remote": rig.table.endpoints("remote")})
    task = asyncio.create_task(ready_soon())
    r = await rig.chat("small")
    await task
    assert r.status_code == 200 and r.json()["served_by"] == "local"
    assert len(provider.seen) == 2


async def test_a_gateway_holding_its_most_spills_at_once() -> None:
    rig = Rig(Timeouts(connect=2, first_byte=10, idle=10, request=10, cold_start_held=0))
    provider = Provider()
    await provider.server.start_server()
    async with started(rig):
        rig.table.set_endpoints({"remote": [Endpoint("external:remote", provider.url, "k",
                                                     upstream_model="gpt-x")]})
        rig.table.set_holdable({"small"})
        rig.table.set_overflow({"small": "remote"})
        t0 = asyncio.get_running_loop().time()
        r = await rig.chat("small")
        assert r.status_code == 200 and r.headers["x-llmgw-served-by"] == "overflow:remote"
        assert asyncio.get_running_loop().time() - t0 < 1  # not held for spill_hold (10 s)
        assert rig.table.spills == {("small", "hold_full"): 1}
    await provider.server.close()


async def test_a_model_without_overflow_behaves_as_before(
    spill_rig: tuple[Rig, Provider],
) -> None:
    rig, provider = spill_rig
    rig.table.set_overflow({})
    saturate(rig)
    r = await rig.chat("small")  # queued on its saturated replica, as ever
    assert r.status_code == 200 and r.json()["served_by"] == "local"
    rig.table.set_endpoints({"remote": rig.table.endpoints("remote")})
    r = await rig.chat("small")
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_ready_replica"
    assert not provider.seen and not rig.table.spills


async def test_an_overflow_withheld_takes_nothing(spill_rig: tuple[Rig, Provider]) -> None:
    rig, provider = spill_rig
    saturate(rig)
    rig.table.set_endpoints({"small": rig.table.endpoints("small")})  # remote withheld
    r = await rig.chat("small")
    assert r.status_code == 200 and r.json()["served_by"] == "local"
    assert not provider.seen and not rig.table.spills
    # Nor is a request held for the spill: the cold start's hold, as without one.
    rig.table.set_endpoints({})
    rig.table.set_holdable({"small"})
    call = asyncio.create_task(rig.chat("small"))
    await asyncio.sleep(0.3)  # past the spill hold (0.1 s): still held for a replica
    assert not call.done() and rig.table.held() == {"small": 1}
    rig.table.set_endpoints({"small": [Endpoint("r1", rig.upstreams[0].url, "k")]})
    r = await call
    assert r.status_code == 200 and r.json()["served_by"] == "local"


def test_the_budget_is_a_day_window_split_by_claims() -> None:
    now = [1000.0]
    claims: dict[str, dict[str, int]] | None = None
    woken: list[bool] = []
    budget = ExternalBudget(lambda: now[0], lambda k: None if claims is None
                            else claims.get(k, {}), lambda: lambda: woken.append(True))
    budget.check("k", 100, 1, "m", "x")  # nothing used
    budget.charge("k", 60)
    now[0] += 30
    budget.charge("k", 40)
    with pytest.raises(OverLimit) as over:
        budget.check("k", 100, 1, "m", "x")
    assert over.value.code == "external_budget_exceeded" and not over.value.short
    assert budget.loads()["k"].used == {"external_tokens_per_day": 100}
    assert budget.loads()["k"].refused == frozenset({"external_tokens_per_day"})
    # Two gateways without a claims loop: half each.
    budget2 = ExternalBudget(lambda: now[0], lambda k: None, lambda: None)
    budget2.charge("k", 50)
    with pytest.raises(OverLimit):
        budget2.check("k", 100, 2, "m", "x")
    # With claims: this gateway's claim, below the limit: short, the loop woken.
    claims = {"k": {"external_tokens_per_day": 120}}
    budget.check("k", 200, 2, "m", "x")
    claims = {"k": {"external_tokens_per_day": 90}}
    with pytest.raises(OverLimit) as over:
        budget.check("k", 200, 2, "m", "x")
    assert over.value.short and woken == [True]
    # The minute's charges leave the window a day on.
    now[0] += DAY
    assert budget.used("k") == 0
    now[0] += 10
    assert "k" not in budget.loads()


def test_the_limiter_reports_the_budget_to_the_claims_loop() -> None:
    now = [5.0]
    lim = Limiter(clock=lambda: now[0], wall=lambda: now[0])
    ticket = lim.admit("k", "remote", Limits(requests_per_minute=10,
                                              external_tokens_per_day=50))
    ticket.external = True
    ticket.note({"prompt_tokens": 7, "completion_tokens": 3})
    ticket.release()
    load = lim.key_loads()["k"]
    assert load.used == {"requests_per_minute": 1, "tokens_per_minute": 0,
                         "concurrent_requests": 0, "external_tokens_per_day": 10}


def test_an_overflow_must_name_an_external_model() -> None:
    local = {"model": "acme/m", "gpus": 1}
    remote = ModelSpec.model_validate({"external": {"url": "https://x.example", "model": "g"}})
    models = {"m": ModelSpec.model_validate(local | {"overflow": "remote"}), "remote": remote,
              "other": ModelSpec.model_validate(local)}
    assert not check_catalog(models, ["/models"])
    assert overflowing_to("remote", models) == ["m"]
    assert overflow_problem("m", ModelSpec.model_validate(local | {"overflow": "nope"}),
                            models) == "'nope' is not in the catalog: add the external " \
                                       "model first"
    assert "not an external model" in (overflow_problem(
        "m", ModelSpec.model_validate(local | {"overflow": "other"}), models) or "")
    bad = check_catalog(models | {"m": ModelSpec.model_validate(local | {"overflow": "m"})},
                        ["/models"])
    assert [(e.loc, e.msg) for e in bad] == [
        (("models", "m", "overflow"), "a model cannot overflow to itself")]
    ext = check_catalog({"r": ModelSpec.model_validate(
        {"external": {"url": "https://x.example", "model": "g"}, "overflow": "r"})},
        ["/models"])
    assert ext and ext[0].loc == ("models", "r", "overflow")
