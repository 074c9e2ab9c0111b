"""Spill-over in-process (docs/design/catalog.md, "Spill-over"): when
a model's replicas are saturated or none is ready within the hold, its
requests go to its overflow, charged to the key's external budget."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from app.control import state as s
from app.control.keys import SecretRing
from app.control.mirror import Mirror
from app.gateway.key_shares import claim_floors
from app.gateway.publish import Publisher
from app.router.choice import EngineLoad
from app.router.published import CatalogEntry, Endpoint, KeyGrant, Limits
from app.router.table import RouteTable
from app.router.timeouts import Timeouts
from app.router.usage.budget import ExternalBudget
from app.router.usage.estimates import reservation
from app.router.usage.limits import Limiter
from app.router.usage.overlimit import OverLimit
from app.store.embedded import EmbeddedStore
from app.wire.catalog import check_catalog, overflow_problem, overflowing_to
from app.wire.spec import ModelSpec
from tests.support.procs import SECRET, until
from tests.support.proxy_rig import CHAT, CLIENT_KEY, MESSAGES, Rig, hash_key, started

DAY = 86400.0


class Provider:
    """An outside provider: answers chats (plain or streamed) with usage,
    `tokens` each (what it bills); while `gate` is set and clear, holds
    each request until it is set; with `status` other than 200, answers
    that, with no usage."""

    def __init__(self, tokens: int = 12) -> None:
        self.seen: list[dict[str, Any]] = []
        self.tokens = tokens
        self.billed = 0
        self.gate: asyncio.Event | None = None
        self.status = 200
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self.server = TestServer(app, host="127.0.0.1")

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        if self.gate is not None:
            await self.gate.wait()
        if self.status != 200:
            return web.json_response({"error": {"message": "down"}}, status=self.status)
        usage = {"prompt_tokens": self.tokens - 2, "completion_tokens": 2,
                 "total_tokens": self.tokens}
        self.billed += self.tokens
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
        rig.table.set_client_keys({hash_key(CLIENT_KEY): KeyGrant(
            "k1", "tests", limits=Limits(external_tokens_per_day=1000))})
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
    assert budget.reserve("k", 100, 1, "m", "x", 30) == 30  # nothing used
    budget.settle("k", 30, 60)  # its answer cost more than it reserved: charged
    now[0] += 30
    budget.charge("k", 40)
    with pytest.raises(OverLimit) as over:
        budget.reserve("k", 100, 1, "m", "x", 5)
    assert over.value.code == "external_budget_exceeded" and not over.value.short
    assert budget.loads()["k"].used == {"external_tokens_per_day": 100}
    assert budget.loads()["k"].refused == frozenset({"external_tokens_per_day"})
    # Two gateways without a claims loop: half each.
    budget2 = ExternalBudget(lambda: now[0], lambda k: None, lambda: None)
    budget2.charge("k", 50)
    with pytest.raises(OverLimit):
        budget2.reserve("k", 100, 2, "m", "x", 1)
    # With claims: this gateway's claim, below the limit: short, the loop woken.
    claims = {"k": {"external_tokens_per_day": 120}}
    assert budget.reserve("k", 200, 2, "m", "x", 15) == 15
    assert budget.reserved("k") == 15 and budget.loads()["k"].used == {
        "external_tokens_per_day": 115}  # what this gateway holds: spent and reserved
    claims = {"k": {"external_tokens_per_day": 110}}
    with pytest.raises(OverLimit) as over:
        budget.reserve("k", 200, 2, "m", "x", 1)
    assert over.value.short and woken == [True]
    assert "used 100 and 15 reserved" in str(over.value)
    budget.settle("k", 15, 0)  # failed: given back, nothing charged
    assert budget.reserved("k") == 0 and budget.used("k") == 100
    # A key without the limit reserves nothing.
    assert budget.reserve("free", None, 2, "m", "x", 50) == 0 and budget.reserved("free") == 0
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
    ticket.meter.note({"prompt_tokens": 7, "completion_tokens": 3})
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


def reserved_for(body: dict[str, Any], completion: int) -> int:
    """The reservation's rule (docs/design/catalog.md, "Spill-over"),
    stated apart from its code: the body's bytes as sent (httpx sends
    compact JSON in UTF-8), and its completion's limit."""
    return len(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()) + completion


async def test_fifty_spills_at_once_spend_at_most_the_budget_and_one_reservation(
    spill_rig: tuple[Rig, Provider],
) -> None:
    """Fifty spills in flight at once on a key whose budget a few of them
    spend: each reserves its most (its prompt's bound and max_tokens) when
    admitted, so the rest are refused while those are in flight, and what
    the provider bills stays within the budget and one reservation. Seen
    to fail: every spill was admitted (the budget was charged only as
    answers ended), and the provider billed all fifty."""
    rig, provider = spill_rig
    budget = 1000
    rig.table.set_client_keys({hash_key(CLIENT_KEY): KeyGrant(
        "k1", "tests", limits=Limits(external_tokens_per_day=budget))})
    provider.tokens = 60  # what each answer bills: under its reservation
    provider.gate = asyncio.Event()
    saturate(rig)
    body = {"model": "small", "messages": MESSAGES, "max_tokens": 50}
    one = reserved_for(body, 50)
    calls = [asyncio.create_task(rig.http.post(CHAT, json=body, headers={
        "Authorization": f"Bearer {CLIENT_KEY}"})) for _ in range(50)]
    # Every one either waits at the provider or was answered (refused).
    await until(lambda: len(provider.seen) + sum(c.done() for c in calls) == 50,
                "fifty requests admitted or refused")
    in_flight = len(provider.seen)
    provider.gate.set()
    answers = await asyncio.gather(*calls)
    assert provider.billed <= budget + one, (
        f"{in_flight} spills in flight at once billed {provider.billed} tokens on a budget "
        f"of {budget} (one reservation: {one})")
    refused = [r for r in answers if r.status_code == 429]
    assert len(refused) == 50 - in_flight and in_flight >= 1
    assert {r.json()["error"]["code"] for r in refused} == {"external_budget_exceeded"}
    assert "reserved for answers in flight" in refused[0].json()["error"]["message"]
    # Settled to what the answers said: the reservations given back.
    limits = rig.proxy.limits
    assert limits.external.used("k1") == provider.billed and limits.external.reserved("k1") == 0
    # One at a time the rest of the budget is spent, and no more than one past it.
    while (await rig.chat("small")).status_code == 200:
        pass
    assert budget <= provider.billed <= budget + one


async def test_a_key_without_a_budget_does_not_spill_unless_the_overflow_says_so(
    spill_rig: tuple[Rig, Provider],
) -> None:
    """Adding an overflow to a model does not open the provider's bill to
    every key allowed that model: a key without `external_tokens_per_day`
    is served as if the model had none (queued on its saturated replica, or
    a 503), unless the overflow says `spill_unbudgeted`. Seen to fail: such
    a key spilled, with no bound."""
    rig, provider = spill_rig
    rig.table.set_client_keys({hash_key(CLIENT_KEY): KeyGrant("k1", "tests")})  # no budget
    saturate(rig)
    r = await rig.chat("small")
    assert "x-llmgw-served-by" not in r.headers, f"spilled: {r.headers['x-llmgw-served-by']}"
    assert r.status_code == 200 and r.json()["served_by"] == "local"
    assert not provider.seen and not rig.table.spills
    remote = rig.table.endpoints("remote")
    rig.table.set_endpoints({"remote": remote})  # small: no replica, none on its way
    r = await rig.chat("small")
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_ready_replica"
    assert not provider.seen
    # The overflow opens itself to keys without a budget: they spill, unbounded.
    rig.table.set_endpoints({"remote": [replace(remote[0], spill_unbudgeted=True)]})
    r = await rig.chat("small")
    assert r.status_code == 200 and r.headers["x-llmgw-served-by"] == "overflow:remote"
    assert rig.proxy.limits.external.reserved("k1") == 0
    assert rig.proxy.limits.external.used("k1") == 12  # counted, bounded by nothing


async def test_a_failed_spill_gives_its_reservation_back(
    spill_rig: tuple[Rig, Provider],
) -> None:
    rig, provider = spill_rig
    saturate(rig)
    provider.status = 503  # the provider down: nothing billed, nothing charged
    r = await rig.chat("small")
    assert r.status_code == 503, r.text
    budget = rig.proxy.limits.external
    assert budget.reserved("k1") == 0 and budget.used("k1") == 0
    provider.status = 200
    r = await rig.chat("small")
    assert r.status_code == 200 and r.headers["x-llmgw-served-by"] == "overflow:remote"
    assert budget.used("k1") == 12


def test_a_reservation_is_the_prompt_s_bound_and_the_completion_s_limit() -> None:
    body: dict[str, Any] = {"model": "m", "messages": MESSAGES}
    assert reservation(body, 40, 100) == 140  # no limit given: the default
    assert reservation(body | {"max_tokens": 7}, 40, 100) == 47
    assert reservation(body | {"max_tokens": 7, "max_completion_tokens": 9}, 40, 100) == 49
    assert reservation(body | {"max_tokens": 7, "n": 3}, 40, 100) == 40 + 3 * 7  # each choice
    assert reservation(body | {"best_of": 2, "n": 1, "max_tokens": 7}, 40, 100) == 54
    # Not counts (body_fields.py refuses such `n` and `max_tokens`): ignored.
    assert reservation(body | {"best_of": "5", "max_output_tokens": True}, 40, 100) == 140
    # An embedding completes nothing: its input, the body, is its prompt.
    assert reservation({"model": "m", "input": ["a"]}, 40, 100, completes=False) == 40


async def test_an_overflow_s_terms_reach_the_router(
    parts: tuple[EmbeddedStore, Mirror],
) -> None:
    """`external.spill_reserve_tokens` and `spill_unbudgeted`, as written in
    the catalog, on the external model's endpoint; left out, left out of
    the stored spec and the defaults on the endpoint."""
    store, mirror = parts
    table = RouteTable()
    publisher = Publisher(mirror, table, SecretRing(SECRET))
    terms = {"url": "https://llm.example.com", "model": "g"}
    for name, extra in (("open", {"spill_reserve_tokens": 64, "spill_unbudgeted": True}),
                        ("closed", {})):
        spec = s.StoredModel.model_validate({"name": name, "external": terms | extra})
        assert spec.spec_dump()["external"] == terms | extra
        rev = await store.put(s.MODELS + name, spec.model_dump_json().encode())
        assert await mirror.wait_for(rev, 2)
    publisher.publish()
    (opened,), (closed,) = table.endpoints("open"), table.endpoints("closed")
    assert (opened.spill_reserve, opened.spill_unbudgeted) == (64, True)
    assert (closed.spill_reserve, closed.spill_unbudgeted) == (0, False)
    with pytest.raises(ValueError):
        ModelSpec.model_validate({"external": terms | {"spill_reserve_tokens": 0}})


async def test_a_worker_spends_the_budget_on_its_claim_alone_and_waits_for_a_raise() -> None:
    """A worker of a gateway of several (`llmgw serve --workers`) admits on
    its claims alone, its floor 0 while they stand (app/gateway/key_shares.py,
    `claim_floors`), so that N in the bound counts gateways: the external
    budget as the per-minute limits. A spill refused on no claim waits for
    the loop to raise one, as a request does. Seen to fail: reserved on a
    floor of 1 token by every worker."""
    lim = Limiter(clock=lambda: 0.0, wall=lambda: 0.0)
    lim.floor, lim.lapsed_floor = claim_floors(1)  # a worker but the first
    lim.set_claims({"k": {}})  # standing, nothing of this key claimed here
    # Admitted (a key with a budget alone has no per-minute part to refuse on).
    ticket = lim.admit("k", "m", Limits(external_tokens_per_day=1000), 3)
    with pytest.raises(OverLimit) as over:
        lim.external.reserve("k", 1000, 3, "m", "x", 50)
    assert over.value.short and over.value.code == "external_budget_exceeded"
    raised: list[int] = []

    async def step() -> None:  # the claims loop's step: this worker's claim raised
        raised.append(1)
        lim.set_claims({"k": {"external_tokens_per_day": 400}})

    lim.settle = step
    assert await lim.reserve_external("k", 1000, 3, "m", "x", 50) == 50
    assert raised == [1] and lim.external.reserved("k") == 50
    ticket.release()
