"""Engine loads gathered once per node (docs/design/routing.md, "Choosing a replica"),
in-process: the agent's gatherer and its API route against
aiohttp test servers standing in for engines, and a gateway's poller
against an agent's answers (answering, silent, older, broken), with
injected clocks. Across real processes: tests/test_node_loads_procs.py."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from app.agent.loads import LoadGatherer, LoadTarget
from app.agent.nodeapi import NodeApi, NodeApiConfig
from app.control import state as s
from app.control.keys import SecretRing
from app.control.mirror import Mirror
from app.gateway.node_agents import NodeAgents
from app.router.choice import EngineLoad
from app.router.engine_load import LEGACY_RECHECK, EngineLoadPoller, NodeAgent
from app.router.published import Endpoint
from app.router.table import RouteTable
from app.router.upstream import UpstreamClient
from app.store.embedded import EmbeddedStore
from app.wire.loads import MAX_ANSWER, BadAnswer, Counts, read_loads_answer
from tests.test_choice import METRICS  # vLLM's gauges: 5 running, 4 waiting, KV 0.5

DEAD = "http://127.0.0.1:9"  # nothing listens: connection refused


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Fake:
    """A server whose one route answers what a test sets, counting requests."""

    def __init__(self, path: str, key: str) -> None:
        self.path, self.key = path, key
        self.hits = 0
        self.answer: Callable[[], web.Response] = lambda: web.Response(text=METRICS)
        self.server: TestServer | None = None

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"title": "Unauthorized"}, status=401)
        return self.answer()

    async def start(self) -> Fake:
        app = web.Application()
        app.router.add_get(self.path, self.handle)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return self

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")


@pytest.fixture
async def servers() -> AsyncIterator[Callable[[str, str], Any]]:
    made: list[Fake] = []

    async def make(path: str, key: str) -> Fake:
        made.append(await Fake(path, key).start())
        return made[-1]

    yield make
    for f in made:
        assert f.server is not None
        await f.server.close()


# --- the agent's gatherer ------------------------------------------------------------


class Ready:
    def __init__(self, targets: list[LoadTarget]) -> None:
        self.targets = targets

    def ready_engines(self) -> list[LoadTarget]:
        return list(self.targets)


async def test_the_agent_keeps_each_engines_figures_with_their_age(
    servers: Callable[[str, str], Any], tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    engine = await servers("/metrics", "key-a")
    clock = Clock(10.0)
    ready = Ready([LoadTarget("a", engine.url, "key-a"), LoadTarget("dead", DEAD, "key-d")])
    gatherer = LoadGatherer(ready, clock=clock)
    caplog.set_level(logging.INFO, "app.agent.loads")
    try:
        got = await gatherer.step()
        # Read with the engine's key; an engine that does not answer has no figures.
        assert got == {"a": Counts(5.0, 4.0, 0.5), "dead": None}
        assert gatherer.figures() == {"a": (Counts(5.0, 4.0, 0.5), 0.0)}
        clock.now = 12.5
        assert gatherer.figures()["a"][1] == 2.5
        # The engine stops answering: its last figures stay, ageing (the
        # gateways call them unknown past their staleness bound).
        engine.answer = lambda: web.Response(status=500)
        clock.now = 13.0
        assert (await gatherer.step())["a"] is None
        assert gatherer.figures() == {"a": (Counts(5.0, 4.0, 0.5), 3.0)}
        await gatherer.step()  # a streak is logged once, at its start
        said = [r.getMessage() for r in caplog.records]
        assert sum("engine of a: /metrics not read" in m for m in said) == 1, said
        assert sum("engine of dead: /metrics not read" in m for m in said) == 1, said
        # Served on the node API, with the node token only.
        api = NodeApi(NodeApiConfig(node="n1", token="node-token", work_dir=tmp_path,
                                    cache_dir=tmp_path), ready, gatherer)
        url = await api.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(url + "/node/v1/loads") as r:
                    assert r.status == 401
                    assert r.content_type == "application/problem+json"
                async with s.get(url + "/node/v1/loads",
                                 headers={"Authorization": "Bearer node-token"}) as r:
                    body = await r.json()
            assert body == {"node": "n1", "loads": {"a": {
                "running": 5.0, "waiting": 4.0, "kv": 0.5, "age_s": 3.0}}}
            assert read_loads_answer(json.dumps(body).encode()) == {
                "a": (Counts(5.0, 4.0, 0.5), 3.0)}
        finally:
            await api.stop()
        engine.answer = lambda: web.Response(text=METRICS)
        await gatherer.step()
        assert "engine of a: /metrics read again" in caplog.records[-1].getMessage()
        # A replica no longer ready here is dropped at once.
        ready.targets = ready.targets[1:]
        await gatherer.step()
        assert gatherer.figures() == {}
    finally:
        await gatherer.close()


# --- a gateway's poller ----------------------------------------------------------------


class Directory:
    def __init__(self, agents: dict[str, NodeAgent]) -> None:
        self.map = agents

    def agents(self) -> dict[str, NodeAgent]:
        return self.map


def loads_body(figures: dict[str, dict[str, float]]) -> Callable[[], web.Response]:
    return lambda: web.json_response({"node": "n1", "loads": figures})


async def rig(servers: Callable[[str, str], Any], clock: Clock,
              ) -> tuple[Fake, Fake, RouteTable, EngineLoadPoller, UpstreamClient]:
    agent = await servers("/node/v1/loads", "tok")
    engine = await servers("/metrics", "ek1")
    table = RouteTable(clock=clock)
    table.set_endpoints({"m": [Endpoint("r1", engine.url, "ek1"),
                               Endpoint("external:x", "http://provider", "pk")]})
    session = UpstreamClient(0.25)
    poller = EngineLoadPoller(table, lambda: session, clock=clock, directory=Directory({
        "r1": NodeAgent("n1", agent.url, ("old-secret-token", "tok"))}))
    return agent, engine, table, poller, session


async def test_a_node_answering_gives_its_replicas_loads_dated_by_their_age(
    servers: Callable[[str, str], Any],
) -> None:
    clock = Clock(100.0)
    agent, engine, table, poller, session = await rig(servers, clock)
    try:
        agent.answer = loads_body({
            "r1": {"running": 3, "waiting": 1, "kv": 0.2, "age_s": 0.5},
            # Not this node's replica: a node speaks for its own only.
            "r9": {"running": 0, "waiting": 0, "kv": 0.0, "age_s": 0.0}})
        assert await poller.poll() == {"r1": EngineLoad(3.0, 1.0, 0.2, 99.5)}
        assert engine.hits == 0  # the engine is read by its agent, not by us
        assert agent.hits == 2  # a token of the previous secret refused, then ours
        assert table.fresh_loads() == {"r1": EngineLoad(3.0, 1.0, 0.2, 99.5)}

        # The node stops answering: its last figures hold until they are
        # 3 s old (the agent's age included), then they are unknown.
        assert agent.server is not None
        await agent.server.close()
        clock.now = 101.0
        assert await poller.poll() == {"r1": EngineLoad(3.0, 1.0, 0.2, 99.5)}
        clock.now = 102.4
        assert table.fresh_loads() == {"r1": EngineLoad(3.0, 1.0, 0.2, 99.5)}
        clock.now = 102.6
        assert table.fresh_loads() == {}
        assert [r["engine"] for r in table.explain("m")] == [None, None]
    finally:
        await session.close()


async def test_an_older_agent_has_its_engines_read_one_by_one(
    servers: Callable[[str, str], Any],
) -> None:
    clock = Clock(100.0)
    agent, engine, table, poller, session = await rig(servers, clock)
    try:
        agent.answer = lambda: web.json_response({"title": "Not Found"}, status=404)
        assert await poller.poll() == {"r1": EngineLoad(5.0, 4.0, 0.5, 100.0)}
        assert table.fresh_loads() == {"r1": EngineLoad(5.0, 4.0, 0.5, 100.0)}
        assert engine.hits == 1
        asked = agent.hits
        clock.now += 1
        await poller.poll()
        assert (engine.hits, agent.hits) == (2, asked)  # not asked again for a while
        # Upgraded since: asked again after LEGACY_RECHECK, and used.
        agent.answer = loads_body({"r1": {"running": 1, "waiting": 0, "kv": 0.1,
                                          "age_s": 0.0}})
        clock.now += LEGACY_RECHECK
        assert await poller.poll() == {"r1": EngineLoad(1.0, 0.0, 0.1, clock.now)}
        assert engine.hits == 2
        # A node with no usable API URL: its engines are read from here.
        poller.directory = Directory({"r1": NodeAgent("n1", "", ())})
        assert await poller.poll() == {"r1": EngineLoad(5.0, 4.0, 0.5, clock.now)}
        assert engine.hits == 3
    finally:
        await session.close()


@pytest.mark.parametrize("answer", [
    lambda: web.Response(body=b'{"loads": {"r1": ' + b" " * MAX_ANSWER + b"}}"),
    lambda: web.Response(text="<html>busy</html>"),
    lambda: web.json_response({"loads": ["r1"]}),
    lambda: web.json_response({"loads": {"r1": {"running": "3", "waiting": 0, "kv": 0,
                                                "age_s": 0}}}),
    lambda: web.json_response({"loads": {"r1": {"running": 3, "waiting": -1, "kv": 0,
                                                "age_s": 0}}}),
    lambda: web.json_response({"loads": {"r1": {"running": 3, "waiting": 0, "kv": 7,
                                                "age_s": 0}}}),
    lambda: web.json_response({"loads": {"r1": {"running": True, "waiting": 0, "kv": 0,
                                                "age_s": 0}}}),
], ids=["oversized", "not-json", "not-an-object", "a-string", "negative", "kv-over-1",
        "a-bool"])
async def test_a_bad_answer_is_refused_whole(
    servers: Callable[[str, str], Any], answer: Callable[[], web.Response],
) -> None:
    clock = Clock(100.0)
    agent, engine, table, poller, session = await rig(servers, clock)
    try:
        agent.answer = answer
        assert await poller.poll() == {}
        assert engine.hits == 0  # refused, not read around: a broken agent is unknown
        assert table.fresh_loads() == {}
    finally:
        await session.close()


def test_the_answer_reader_refuses_nan_and_oversize() -> None:
    with pytest.raises(BadAnswer, match="numbers"):
        read_loads_answer(b'{"loads": {"r": {"running": NaN, "waiting": 0, "kv": 0, '
                          b'"age_s": 0}}}')
    with pytest.raises(BadAnswer, match="more than"):
        read_loads_answer(b" " * (MAX_ANSWER + 1))
    assert read_loads_answer(b'{"node": "n", "loads": {}}') == {}


async def test_a_fleet_larger_than_the_rate_is_asked_less_often_in_slices(
    servers: Callable[[str, str], Any],
) -> None:
    """At most `rate` nodes asked a second: four nodes at two a second make
    a round of 2 s, its asks spread over it in four slices, each slice's
    figures routed on at once, and figures fresh for three such rounds."""
    clock = Clock(100.0)
    agent = await servers("/node/v1/loads", "tok")
    fig = {"running": 1, "waiting": 0, "kv": 0.1, "age_s": 0.0}
    agent.answer = loads_body({f"r{i}": fig for i in range(4)})
    table = RouteTable(clock=clock)
    table.set_endpoints({"m": [Endpoint(f"r{i}", DEAD, "ek") for i in range(4)]})
    client = UpstreamClient(0.25)
    poller = EngineLoadPoller(table, lambda: client, clock=clock, rate=2.0, directory=Directory(
        {f"r{i}": NodeAgent(f"n{i}", agent.url, ("tok",)) for i in range(4)}))
    seen: list[tuple[float, int, int]] = []

    async def sleep(seconds: float) -> None:
        seen.append((seconds, agent.hits, len(table.fresh_loads())))
        clock.now += seconds

    try:
        loads = await poller.poll(sleep)
        assert sorted(loads) == ["r0", "r1", "r2", "r3"]
        assert seen == [(0.5, 1, 1), (0.5, 2, 2), (0.5, 3, 3)]
        assert poller.period == 2.0 and table.stale_after == 6.0
        clock.now = 100.0 + 6.0  # r0, read at 100.0: fresh for three rounds
        assert "r0" in table.fresh_loads()
        clock.now += 0.01
        assert "r0" not in table.fresh_loads() and "r3" in table.fresh_loads()
        # Without a sleep (a test's round), every ask at once.
        seen.clear()
        await poller.poll()
        assert agent.hits == 8 and seen == []
        # A fleet within the rate: a round a second, as ever.
        poller.directory = Directory({"r0": NodeAgent("n0", agent.url, ("tok",))})
        table.set_endpoints({"m": [Endpoint("r0", DEAD, "ek")]})
        await poller.poll(sleep)
        assert poller.period == 1.0 and table.stale_after == 3.0 and seen == []
    finally:
        await client.close()


async def test_a_silent_node_is_warned_of_once_and_forgotten_once_gone(
    servers: Callable[[str, str], Any], caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock(100.0)
    table = RouteTable(clock=clock)
    table.set_endpoints({"m": [Endpoint("r1", DEAD, "ek")]})
    client = UpstreamClient(0.25)
    poller = EngineLoadPoller(table, lambda: client, clock=clock, directory=Directory(
        {"r1": NodeAgent("n1", DEAD, ("tok",))}))
    try:
        for _ in range(3):
            await poller.poll()
        assert caplog.text.count("node n1: engine loads not read") == 1
        # The node leaves the fleet: nothing of it is kept (months of churn).
        table.set_endpoints({})
        await poller.poll()
        assert poller._failing == set()
    finally:
        await client.close()


async def test_a_large_answer_under_the_cap_is_read_whole(
    servers: Callable[[str, str], Any],
) -> None:
    clock = Clock(100.0)
    agent, engine, table, poller, session = await rig(servers, clock)
    fig = {"running": 1, "waiting": 2, "kv": 0.25, "age_s": 0.0}
    many = {f"r{i:05d}": fig for i in range(2000)} | {"r1": fig}
    assert MAX_ANSWER // 2 < len(json.dumps({"node": "n1", "loads": many})) < MAX_ANSWER
    try:
        agent.answer = loads_body(many)
        assert await poller.poll() == {"r1": EngineLoad(1.0, 2.0, 0.25, 100.0)}
        assert engine.hits == 0 and list(table.fresh_loads()) == ["r1"]
    finally:
        await session.close()


async def test_the_gateway_sends_the_node_token_only_to_the_nodes_own_address(
    parts: tuple[EmbeddedStore, Mirror],
) -> None:
    store, mirror = parts
    nodes = {"n1": "http://10.0.0.1:7001", "n2": "http://10.9.9.9:7001", "n3": ""}
    rev = 0
    for name, api in nodes.items():
        rev = await store.put(s.NODES + name, s.NodeInfo(
            name=name, address=f"10.0.0.{name[1]}", api_url=api).model_dump_json().encode())
        rev = await store.put(s.REPLICAS + f"m-{name}", s.Replica(
            id=f"m-{name}", model="m", node=name, weights="acme/m").model_dump_json().encode())
    assert await mirror.wait_for(rev, 5)
    ring = SecretRing("s" * 32)
    agents = NodeAgents(mirror, ring).agents()
    assert agents["m-n1"] == NodeAgent("n1", "http://10.0.0.1:7001",
                                       tuple(ring.node_tokens("n1")))
    # Another host's URL, or none (an older agent): its engines are read directly.
    assert agents["m-n2"] == NodeAgent("n2", "", ())
    assert agents["m-n3"] == NodeAgent("n3", "", ())


async def test_node_agents_are_worked_out_again_only_for_what_changed(
    parts: tuple[EmbeddedStore, Mirror],
) -> None:
    """Asked once a second: with the mirror's views unchanged the answer is
    the same one, and a node's changed record derives only that node's
    agent again (its tokens are an HMAC each)."""
    store, mirror = parts
    rev = 0
    for name in ("n1", "n2"):
        rev = await store.put(s.NODES + name, s.NodeInfo(
            name=name, address="10.0.0.1", api_url="http://10.0.0.1:7001"
        ).model_dump_json().encode())
        rev = await store.put(s.REPLICAS + f"m-{name}", s.Replica(
            id=f"m-{name}", model="m", node=name, weights="acme/m").model_dump_json().encode())
    assert await mirror.wait_for(rev, 5)
    directory = NodeAgents(mirror, SecretRing("s" * 32))
    first = directory.agents()
    assert directory.agents() is first
    # n2's agent moves port: n1's agent is the same object, n2's is new.
    rev = await store.put(s.NODES + "n2", s.NodeInfo(
        name="n2", address="10.0.0.1", api_url="http://10.0.0.1:7002").model_dump_json().encode())
    assert await mirror.wait_for(rev, 5)
    after = directory.agents()
    assert after is not first and after["m-n1"] is first["m-n1"]
    assert after["m-n2"].api_url == "http://10.0.0.1:7002"
    # A node gone: its replicas have no agent.
    assert await store.delete(s.NODES + "n1")
    assert await mirror.wait_for(rev + 1, 5)
    assert set(directory.agents()) == {"m-n2"}
