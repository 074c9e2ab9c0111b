"""The fleet's admin routes: cordon, uncordon and drain a node, its pool and
labels, capacity quotas (docs/design/placement.md). In-process
gateways on a real etcd; writes are conditional on the revision read."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from app.control import state as s
from app.control.placement.placer import place
from app.control.placement.verdict import NoFit
from app.gateway.main import create_app
from app.gateway.settings import Settings
from app.store.base import TxnResult
from tests.support.etcd import EtcdServer, ExternalEtcd
from tests.support.procs import until
from tests.test_agent_api import ADMIN, SECRET, gateways


async def _stored(gw: Any, key: str) -> dict[str, Any] | None:
    kv = await gw.store.get(key)
    return json.loads(kv.value) if kv is not None else None


async def _add_node(gw: Any, name: str) -> None:
    info = s.NodeInfo(name=name, gpus=[s.GpuInfo(index=0, memory_mib=81559)], engines=["vllm"])
    await gw.mirror.wait_for(await gw.store.put(s.NODES + name, info.model_dump_json().encode()),
                             5)


def _problem(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json", r.headers
    body: dict[str, Any] = r.json()
    assert body["status"] == status
    return body


async def test_cordon_drain_and_uncordon_a_node(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async with gateways(etcd_server, etcd_prefix, tmp_path, 1) as [(a, c)]:
        gw = a.state.gateway
        await _add_node(gw, "h1")
        r = await c.post("/admin/nodes/h1/cordon")
        assert r.status_code == 200, r.text
        assert r.json() == {"node": "h1", "cordoned": True, "draining": False,
                            "pool": "default", "labels": {}, "engine_build": "auto",
                            "vllm_version": "", "gpu_cleared": {}}
        assert (await _stored(gw, s.NODECONF + "h1"))["cordoned"] is True  # type: ignore[index]
        # Placement, on this gateway's mirror, now refuses the node and says why.
        spec = s.StoredModel(name="m", model="org/m")
        fit = place("m", spec, gw.mirror.nodes(), {}, nodeconfs=gw.mirror.nodeconfs())
        assert isinstance(fit, NoFit) and fit.texts() == {"h1": "cordoned"}

        r = await c.post("/admin/nodes/h1/drain")
        assert (r.json()["cordoned"], r.json()["draining"]) == (True, True)
        r = await c.post("/admin/nodes/h1/uncordon")
        assert (r.json()["cordoned"], r.json()["draining"]) == (False, False)
        assert (await c.get("/admin/nodes/h1/conf")).json()["cordoned"] is False

        body = _problem(await c.post("/admin/nodes/nope/cordon"), 404)
        assert "nope" in body["detail"]
        _problem(await c.get("/admin/nodes/nope/conf"), 404)
        assert await gw.store.get(s.NODECONF + "nope") is None
        # A node whose agent is away but which still has replicas stays known.
        rep = s.Replica(id="m-1", model="m", node="away", gpus=[0], weights="org/m")
        await gw.mirror.wait_for(
            await gw.store.put(s.REPLICAS + rep.id, rep.model_dump_json().encode()), 5)
        assert (await c.post("/admin/nodes/away/drain")).json()["draining"] is True


async def test_pool_and_labels_and_their_bad_bodies(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async with gateways(etcd_server, etcd_prefix, tmp_path, 1) as [(a, c)]:
        gw = a.state.gateway
        await _add_node(gw, "r1")
        await c.post("/admin/nodes/r1/cordon")
        r = await c.put("/admin/nodes/r1/conf", json={"pool": "research",
                                                      "labels": {"rack": "b7"}})
        assert r.status_code == 200, r.text
        # The cordon is kept: the conf route sets only pool and labels.
        assert r.json() == {"node": "r1", "cordoned": True, "draining": False,
                            "pool": "research", "labels": {"rack": "b7"},
                            "engine_build": "auto",
                            "vllm_version": "", "gpu_cleared": {}}
        for bad in ({"pool": "-x"}, {"labels": {"rack": "a\nb"}}, {"colour": "blue"},
                    {"labels": {" ": "x"}}, {"pool": 3}):
            body = _problem(await c.put("/admin/nodes/r1/conf", json=bad), 422)
            assert body["title"] == "Invalid request body", body
        assert (await _stored(gw, s.NODECONF + "r1"))["pool"] == "research"  # type: ignore[index]


async def test_quotas_are_set_reported_with_their_use_and_removed(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async with gateways(etcd_server, etcd_prefix, tmp_path, 1) as [(a, c)]:
        gw = a.state.gateway
        r = await c.put("/admin/models/m", json={"model": "org/m", "gpus": 2, "quota": "team-a"})
        assert r.status_code == 201, r.text
        rep = s.Replica(id="m-1", model="m", node="h1", gpus=[0, 1], weights="org/m")
        await gw.mirror.wait_for(
            await gw.store.put(s.REPLICAS + rep.id, rep.model_dump_json().encode()), 5)
        assert (await c.get("/admin/quotas")).json() == [
            {"scope": "team-a", "max_gpus": None, "used_gpus": 2, "models": ["m"]}]

        r = await c.put("/admin/quotas/team-a", json={"max_gpus": 8})
        assert r.status_code == 200, r.text
        assert await _stored(gw, s.QUOTAS + "team-a") == {"max_gpus": 8}
        assert (await c.get("/admin/quotas")).json()[0]["max_gpus"] == 8
        for bad in ({"max_gpus": -1}, {}, {"max_gpus": 1, "extra": 1}):
            _problem(await c.put("/admin/quotas/team-a", json=bad), 422)
        _problem(await c.put("/admin/quotas/-bad", json={"max_gpus": 1}), 400)

        assert (await c.delete("/admin/quotas/team-a")).status_code == 204
        assert await gw.store.get(s.QUOTAS + "team-a") is None
        _problem(await c.delete("/admin/quotas/team-a"), 404)


@asynccontextmanager
async def lagging_b(etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
                    ) -> AsyncIterator[tuple[Any, httpx.AsyncClient, Any, list[bool]]]:
    """Two gateways and node h1; gateway b's watch stopped before a cordons
    h1, so b decides on a conf without the cordon. Yields a's gateway, b's
    client, b's gateway, and the outcomes of b's writes of h1's conf (b's
    own loops, its election, key shares and usage, write through the same
    store and are left out)."""
    async with gateways(etcd_server, etcd_prefix, tmp_path, 2) as [(a, ca), (b, cb)]:
        ga, gb = a.state.gateway, b.state.gateway
        await _add_node(ga, "h1")
        await until(lambda: "h1" in gb.mirror.nodes(), "h1 on gateway b")
        await gb.mirror.stop()
        assert (await ca.post("/admin/nodes/h1/cordon")).status_code == 200
        outcomes: list[bool] = []
        real_txn = gb.store.txn

        async def txn(compares: Any, success: Any, *args: Any, **kw: Any) -> TxnResult:
            res: TxnResult = await real_txn(compares, success, *args, **kw)
            if any(op.key == s.NODECONF + "h1" for op in success):
                outcomes.append(res.succeeded)
            return res

        gb.store.txn = txn
        yield ga, cb, gb, outcomes


async def test_a_write_decided_on_a_stale_mirror_is_refused_and_decided_again(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async with lagging_b(etcd_server, etcd_prefix, tmp_path) as (ga, cb, gb, outcomes):
        put = asyncio.ensure_future(cb.put("/admin/nodes/h1/conf", json={"pool": "research"}))
        await until(lambda: outcomes, "b's first write")
        gb.mirror.start()
        r = await put
        assert r.status_code == 200, r.text
        # The first write, decided without the cordon, was refused; the second
        # was decided on A's write and keeps it.
        assert outcomes == [False, True]
        assert await _stored(ga, s.NODECONF + "h1") == {
            "cordoned": True, "draining": False, "pool": "research", "labels": {},
            "engine_build": "auto", "vllm_version": "", "gpu_cleared": {}}


async def test_a_write_whose_mirror_does_not_catch_up_is_decided_on_the_store_s_read(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    """Gateway b's mirror stays behind (its watch stopped, as a slow resync
    under load leaves it for seconds): after its first write is refused, the
    second is decided on what the store answered, not on the stale mirror
    again. Before the fix every try was decided on the mirror's stale conf
    and refused, and the admin got 409 'kept changing' (outcomes [False,
    False, False])."""
    async with lagging_b(etcd_server, etcd_prefix, tmp_path) as (ga, cb, _, outcomes):
        r = await cb.put("/admin/nodes/h1/conf", json={"pool": "research"})
        assert r.status_code == 200, r.text
        assert outcomes == [False, True]
        stored = await _stored(ga, s.NODECONF + "h1")
        assert stored["cordoned"] is True and stored["pool"] == "research", stored


async def test_clearing_a_sick_gpu_puts_it_back_into_placement(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    reason = "XID 48: double-bit ECC error (at 2026-11-18T11:06:40Z)"
    async with gateways(etcd_server, etcd_prefix, tmp_path, 1) as [(a, c)]:
        gw = a.state.gateway
        info = s.NodeInfo(name="h1", engines=["vllm"], gpus=[
            s.GpuInfo(index=0, health="unhealthy", health_reason=reason)])
        await gw.mirror.wait_for(
            await gw.store.put(s.NODES + "h1", info.model_dump_json().encode()), 5)
        spec = s.StoredModel(name="m", model="org/m")
        fit = place("m", spec, gw.mirror.nodes(), {}, nodeconfs=gw.mirror.nodeconfs())
        assert isinstance(fit, NoFit)
        assert fit.texts() == {"h1": "needs 1 free GPUs, has 0 of 1; GPU 0 unhealthy"}
        nodes = (await c.get("/admin/nodes")).json()
        assert nodes[0]["gpus_unhealthy"] == 1 and nodes[0]["gpus"][0]["unhealthy"] is True

        r = await c.post("/admin/nodes/h1/gpus/0/clear")
        assert r.status_code == 200, r.text
        assert r.json()["gpu_cleared"] == {"0": reason} and r.headers["ETag"]
        assert (await _stored(gw, s.NODECONF + "h1"))["gpu_cleared"] == {  # type: ignore[index]
            "0": reason}
        assert not isinstance(place("m", spec, gw.mirror.nodes(), {},
                                    nodeconfs=gw.mirror.nodeconfs()), NoFit)
        nodes = (await c.get("/admin/nodes")).json()
        assert nodes[0]["gpus_unhealthy"] == 0 and nodes[0]["gpus"][0]["unhealthy"] is False

        body = _problem(await c.post("/admin/nodes/h1/gpus/3/clear"), 404)
        assert body["detail"] == "node 'h1' reports no GPU 3"
        _problem(await c.post("/admin/nodes/ghost/gpus/0/clear"), 404)
        _problem(await c.post("/admin/nodes/h1/gpus/-1/clear"), 422)
        _problem(await c.post("/admin/nodes/h1/gpus/64/clear"), 422)


async def test_fleet_routes_answer_503_until_the_state_is_loaded(tmp_path: Path) -> None:
    app = create_app(Settings(etcd_endpoints="127.0.0.1:9", secret=SECRET, admin_token=ADMIN,
                              gateway_id="gw-blind", data_dir=tmp_path, local_agent=False,
                              etcd_timeout=0.5))
    await app.state.gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw",
                                     headers={"Authorization": f"Bearer {ADMIN}"}) as c:
            # Not "unknown node", nor an empty quota list: this gateway does not know yet.
            for r in (await c.post("/admin/nodes/h1/cordon"), await c.get("/admin/quotas"),
                      await c.put("/admin/quotas/t", json={"max_gpus": 1})):
                assert _problem(r, 503)["title"] == "State not loaded"
            r = await c.get("/admin/quotas", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
    finally:
        await app.state.gateway.stop()


async def test_a_write_with_the_store_down_answers_503(own_etcd: EtcdServer,
                                                      etcd_prefix: str, tmp_path: Path) -> None:
    async with gateways(own_etcd, etcd_prefix, tmp_path, 1, etcd_timeout=0.5) as [(a, c)]:
        gw = a.state.gateway
        await _add_node(gw, "h1")
        own_etcd.stop()
        body = _problem(await c.post("/admin/nodes/h1/drain"), 503)
        assert body["title"] == "State store unavailable"
        # Read from the mirror, which stays: the node is still shown uncordoned.
        assert (await c.get("/admin/nodes/h1/conf")).json()["cordoned"] is False
