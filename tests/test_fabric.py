"""Fabric test: TCP bandwidth between two agents, measured through a gateway
(real gateway and agent processes on loopback); tickets and caps in-process."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.agent import fabric
from app.agent.engines import EngineSpec
from app.agent.nodeapi import NodeApi, NodeApiConfig
from app.api.fabric import directions
from app.wire.fabric import MAX_BYTES, MAX_SECONDS, SINK_PATH
from app.wire.tokens import node_token
from tests.support.procs import SECRET, Cluster, GatewayProc, wait_for
from tests.test_ctl import ctl


class NoEngines:
    def engine_specs(self) -> list[EngineSpec]:
        return []


def test_a_ticket_opens_the_sink_once_and_within_its_minute() -> None:
    now = [100.0]
    f = fabric.Fabric(clock=lambda: now[0])
    once, late = f.issue(), f.issue()
    assert f.take(once)
    assert not f.take(once)  # spent
    assert not f.take("made-up")
    now[0] += fabric.TICKET_TTL + 1
    assert not f.take(late)  # expired
    for _ in range(fabric.MAX_TICKETS):
        f.issue()
    with pytest.raises(fabric.FabricError) as exc:
        f.issue()
    assert exc.value.status == 429


def test_send_requests_are_capped() -> None:
    ok = {"sink_url": "http://127.0.0.1:1/node/v1/fabric/sink", "ticket": "t"}
    assert fabric.check_send(ok) == (ok["sink_url"], "t", 1.0, MAX_BYTES)
    for bad in ({**ok, "seconds": MAX_SECONDS + 0.1}, {**ok, "seconds": 0},
                {**ok, "bytes": MAX_BYTES + 1}, {**ok, "bytes": True},
                {**ok, "sink_url": "file:///etc/passwd"}, {**ok, "ticket": ""}, []):
        with pytest.raises(fabric.FabricError) as exc:
            fabric.check_send(bad)
        assert exc.value.status == 400, bad


def test_every_pair_is_measured_both_ways_one_after_the_other() -> None:
    assert directions(["a", "b", "c"]) == [("a", "b"), ("b", "a"), ("a", "c"), ("c", "a"),
                                           ("b", "c"), ("c", "b")]


async def test_an_agent_streams_to_another_agents_sink_with_its_ticket(tmp_path: Path) -> None:
    apis = [NodeApi(NodeApiConfig(node=n, token=f"token-{n}", work_dir=tmp_path / n,
                                  cache_dir=tmp_path / n), NoEngines()) for n in ("a", "b")]
    url_a, url_b = [await api.start("127.0.0.1", 0) for api in apis]
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            as_a = {"Authorization": "Bearer token-a"}
            as_b = {"Authorization": "Bearer token-b"}
            ticket = (await c.post(url_b + "/node/v1/fabric/ticket", headers=as_b)).json()
            assert ticket["expires_in"] == fabric.TICKET_TTL
            body = {"sink_url": url_b + SINK_PATH, "ticket": ticket["ticket"],
                    "seconds": 2, "bytes": 3 * fabric.CHUNK + 7}
            r = await c.post(url_a + "/node/v1/fabric/send", json=body, headers=as_a)
            assert r.status_code == 200, r.text
            # The bytes cap ends it (well before 2 s), to the byte.
            assert r.json()["bytes"] == r.json()["sent"] == 3 * fabric.CHUNK + 7
            # The same ticket again: B's sink refuses it, A says so.
            r = await c.post(url_a + "/node/v1/fabric/send", json=body, headers=as_a)
            assert r.status_code == 502 and "answered 401" in r.json()["detail"], r.text
            # B's node token does not open B's sink: only a ticket does.
            r = await c.post(url_b + SINK_PATH, content=b"x", headers=as_b)
            assert r.status_code == 401
    finally:
        for api in apis:
            await api.stop()


def nodes_with_api(gw: GatewayProc, names: set[str]) -> bool:
    with gw.admin() as c:
        found = {n["name"] for n in c.get("/admin/nodes").json() if n.get("api_url")}
    return names <= found


def test_fabric_test_between_two_agents_on_loopback(cluster: Cluster) -> None:
    gw = cluster.gateway("gw-a")
    cluster.agent("node-1", [gw])
    agent_2 = cluster.agent("node-2", [gw])
    wait_for(lambda: nodes_with_api(gw, {"node-1", "node-2"}), 20, "both agents' APIs")

    with gw.admin() as c:
        c.timeout = httpx.Timeout(60)
        r = c.post("/admin/fabric-test", json={"nodes": ["node-1", "node-2"], "seconds": 0.5})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["saved"] is True
        got = {(res["from"], res["to"]): res for res in body["results"]}
        assert set(got) == {("node-1", "node-2"), ("node-2", "node-1")}
        for res in got.values():
            # Loopback carries many Gb/s; 0.1 only rules out a broken count.
            assert res["gbps"] > 0.1 and res["bytes"] > 0 and 0 < res["seconds"] <= 2, res
            assert res["gbps"] == pytest.approx(res["bytes"] * 8 / res["seconds"] / 1e9,
                                                rel=0.01)
        listed = c.get("/admin/fabric").json()
        assert {(x["from"], x["to"]) for x in listed} == set(got)

        r = c.post("/admin/fabric-test", json={"nodes": ["node-1", "node-9"]})
        assert r.status_code == 404 and "node-9" in r.json()["detail"], r.text
        r = c.post("/admin/fabric-test", json={"nodes": ["node-1"]})
        assert r.status_code == 422, r.text
        r = c.post("/admin/fabric-test", json={"nodes": ["node-1", "node-1"]})
        assert r.status_code == 422, r.text
        info = {n["name"]: n for n in c.get("/admin/nodes").json()}

    # A sink ticket of node-2's real agent, used twice: the second is refused.
    api = info["node-2"]["api_url"]
    auth = {"Authorization": f"Bearer {node_token(SECRET, 'node-2')}"}
    ticket = httpx.post(api + "/node/v1/fabric/ticket", headers=auth).json()["ticket"]
    sink = {"Authorization": f"Bearer {ticket}"}
    first = httpx.post(api + SINK_PATH, content=b"x" * 1000, headers=sink)
    assert first.status_code == 200 and first.json()["bytes"] == 1000, first.text
    again = httpx.post(api + SINK_PATH, content=b"x", headers=sink)
    assert again.status_code == 401, again.text

    done = ctl("fabric-test", "node-2", "node-1", "--seconds", "0.2", "--json",
               gateway=gw.url)
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    assert [(x["from"], x["to"]) for x in data["results"]] == [("node-2", "node-1"),
                                                               ("node-1", "node-2")]
    assert all(x["gbps"] > 0.1 for x in data["results"])
    one = ctl("fabric-test", "node-1", gateway=gw.url)
    assert one.returncode == 2 and "two or more" in one.stderr, one.stderr

    agent_2.signal(signal.SIGKILL)  # its node key lives on until the node TTL
    with gw.admin() as c:
        r = c.post("/admin/fabric-test", json={"nodes": ["node-1", "node-2"], "seconds": 0.2})
    assert r.status_code == 502, r.text
    assert "node-2" in r.json()["detail"] and "unreachable" in r.json()["detail"]
