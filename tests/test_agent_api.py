"""The agent API and the admin API answer only from state they have, and
every write they base on a read is conditional on it (docs/architecture.md,
invariant 9). In-process gateways on a real etcd; two of them race."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from app.control import state as s
from app.control import storeid
from app.gateway.main import GatewayApp, create_app
from app.gateway.settings import Settings
from app.store.base import Put
from app.wire.tokens import node_token
from tests.support.etcd import EtcdServer, ExternalEtcd
from tests.support.procs import until

SECRET = "agent-api-secret-0123456789"
ADMIN = "agent-api-admin-0123456789"


@asynccontextmanager
async def gateways(
    etcd: EtcdServer | ExternalEtcd, prefix: str, tmp: Path, count: int, **extra: Any
) -> AsyncIterator[list[tuple[GatewayApp, httpx.AsyncClient]]]:
    apps = [create_app(Settings(
        etcd_endpoints=etcd.endpoint, etcd_prefix=prefix, secret=SECRET, admin_token=ADMIN,
        gateway_id=f"gw{i}", port=19000 + i, data_dir=tmp / f"gw{i}", local_agent=False,
        **extra)) for i in range(count)]
    for app in apps:
        await app.state.gateway.start()
    clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                 headers={"Authorization": f"Bearer {ADMIN}"})
               for app in apps]
    try:
        for app in apps:
            await until(lambda a=app: a.state.gateway.ready, "mirror loaded")
        yield list(zip(apps, clients, strict=True))
    finally:
        for c in clients:
            await c.aclose()
        for app in apps:
            await app.state.gateway.stop()


def _node(node: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {node_token(SECRET, node)}"}


def _inventory(node: str, address: str = "127.0.0.1") -> dict[str, Any]:
    return {"name": node, "gpus": [{"index": 0}], "engines": ["vllm"], "address": address}


async def _join(c: httpx.AsyncClient, node: str = "n1") -> None:
    """`node`'s agent reports in, as its heartbeat does."""
    r = await c.put(f"/agent/v1/nodes/{node}", json=_inventory(node), headers=_node(node))
    assert r.status_code == 200, r.text


async def test_two_admins_racing_for_one_alias_cannot_both_win(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async with gateways(etcd_server, etcd_prefix, tmp_path, 2) as [(a, ca), (_, cb)]:
        for round_ in range(5):
            alias = f"shared-{round_}"
            # Both decide on a catalog in which the alias is free, then write.
            ra, rb = await asyncio.gather(
                ca.put(f"/admin/models/a{round_}", json={"model": "org/a", "aliases": [alias]}),
                cb.put(f"/admin/models/b{round_}", json={"model": "org/b", "aliases": [alias]}),
            )
            assert sorted([ra.status_code, rb.status_code]) == [201, 409], (ra.text, rb.text)
            loser = ra if ra.status_code == 409 else rb
            assert alias in loser.json()["detail"]
        # What etcd holds, not what either mirror says: each alias has one owner.
        listed = (await a.state.gateway.store.range(s.MODELS)).kvs
        owners: dict[str, list[str]] = {}
        for kv in listed:
            model = s.StoredModel.model_validate_json(kv.value)
            for al in model.aliases:
                owners.setdefault(al, []).append(model.name)
        assert len(listed) == 5 and all(len(v) == 1 for v in owners.values()), owners


async def test_agent_api_answers_503_until_the_state_is_loaded(tmp_path: Path) -> None:
    # A gateway whose store never answers: nothing listens on this port.
    app = create_app(Settings(etcd_endpoints="127.0.0.1:9", secret=SECRET, admin_token=ADMIN,
                              gateway_id="gw-blind", data_dir=tmp_path, local_agent=False,
                              etcd_timeout=0.5))
    await app.state.gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as c:
            r = await c.get("/agent/v1/nodes/n1/assignments", headers=_node("n1"))
            # Not an empty list: an agent would stop every engine on it.
            assert r.status_code == 503, r.text
            assert r.json()["title"] == "State not loaded"
            r = await c.put("/agent/v1/nodes/n1", json=_inventory("n1"), headers=_node("n1"))
            assert r.status_code == 503
            # A wrong token is still told so first.
            r = await c.get("/agent/v1/nodes/n1/assignments", headers=_node("n2"))
            assert r.status_code == 401
    finally:
        await app.state.gateway.stop()


async def test_assignments_carry_the_revision_they_were_read_at(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async with gateways(etcd_server, etcd_prefix, tmp_path, 2) as [(a, _), (b, _)]:
        gw = a.state.gateway
        rep = s.Replica(id="m-1", model="m", node="n1", gpus=[0], weights="org/m")
        rev = await gw.store.put(s.REPLICAS + rep.id, rep.model_dump_json().encode())
        bodies = []
        for app in (a, b):
            await app.state.gateway.mirror.wait_for(rev, 5)
            # Made at start, in the background (app/gateway/assembly.py).
            await until(app.state.gateway.mirror.store_id, "the store id mirrored")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gw") as c:
                r = await c.get("/agent/v1/nodes/n1/assignments", headers=_node("n1"))
            bodies.append(r.json())
        for body in bodies:
            assert [r["id"] for r in body["replicas"]] == ["m-1"]
            assert body["revision"] >= rev
        # ... and the store's id, the same from every gateway of the store:
        # revisions compare only within one store (docs/design/store.md, "The store's id").
        kept = await gw.store.get(s.STORE_ID)
        assert kept is not None and len(storeid.parse(kept.value)) == 32
        assert [body["store"] for body in bodies] == [storeid.parse(kept.value)] * 2


async def test_a_late_status_report_does_not_resurrect_a_deleted_replica(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async with gateways(etcd_server, etcd_prefix, tmp_path, 1) as [(a, c)]:
        gw = a.state.gateway
        await _join(c)
        rep = s.Replica(id="m-1", model="m", node="n1", gpus=[0], weights="org/m")
        rev = await gw.store.put(s.REPLICAS + rep.id, rep.model_dump_json().encode())
        await gw.mirror.wait_for(rev, 5)
        # This gateway's watch stops (lags); meanwhile the leader deletes the replica.
        await gw.mirror.stop()
        assert await gw.store.delete(s.REPLICAS + rep.id)
        report = {"replicas": [{"id": "m-1", "node": "n1", "phase": "ready",
                                "url": "http://127.0.0.1:8123"}]}
        r = await c.put("/agent/v1/nodes/n1/status", json=report, headers=_node("n1"))
        assert r.status_code == 200, r.text
        assert r.json() == {"written": 0}
        assert await gw.store.get(s.STATUS + "m-1") is None


async def test_a_lagging_gateway_renews_the_lease_that_holds_the_node(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async with gateways(etcd_server, etcd_prefix, tmp_path, 1, node_ttl=2) as [(a, c)]:
        gw = a.state.gateway
        await _join(c)
        await until(lambda: gw.mirror.get(s.NODES + "n1") is not None, "node mirrored")
        await gw.mirror.stop()  # from here on this gateway's view is stale
        # Another gateway bound the node to a lease of its own meanwhile.
        fresh = await gw.store.grant(2)
        body = s.NodeInfo.model_validate(_inventory("n1")).model_dump_json().encode()
        await gw.store.txn([], [Put(s.NODES + "n1", body, lease=fresh)])
        # The agent beats through the lagging gateway for longer than the TTL.
        loop = asyncio.get_running_loop()
        end = loop.time() + 3.5
        while loop.time() < end:
            r = await c.put("/agent/v1/nodes/n1", json=_inventory("n1"), headers=_node("n1"))
            assert r.status_code == 200, r.text
            await asyncio.sleep(0.4)
        # Only renewing the lease that holds the key keeps the node alive.
        assert await gw.store.get(s.NODES + "n1") is not None


async def test_engine_urls_must_be_plain_http_on_the_nodes_own_address(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async with gateways(etcd_server, etcd_prefix, tmp_path, 1) as [(a, c)]:
        gw = a.state.gateway
        r = await c.put("/agent/v1/nodes/n1", json=_inventory("n1", "127.0.0.2"),
                        headers=_node("n1"))
        assert r.status_code == 200, r.text
        rep = s.Replica(id="m-1", model="m", node="n1", gpus=[0], weights="org/m")
        rev = await gw.store.put(s.REPLICAS + rep.id, rep.model_dump_json().encode())
        await gw.mirror.wait_for(rev, 5)
        await until(lambda: gw.mirror.get(s.NODES + "n1") is not None, "node mirrored")
        for url in ("http://10.9.9.9:8000", "https://127.0.0.2:8000", "http://127.0.0.2:80/x",
                    "http://user@127.0.0.2:8000", "http://127.0.0.2", "ftp://127.0.0.2:21",
                    "http://169.254.169.254:80"):
            report = {"replicas": [{"id": "m-1", "node": "n1", "phase": "ready", "url": url}]}
            r = await c.put("/agent/v1/nodes/n1/status", json=report, headers=_node("n1"))
            assert r.status_code == 422, (url, r.text)
            assert "m-1" in r.json()["detail"]
        assert await gw.store.get(s.STATUS + "m-1") is None
        good = {"replicas": [{"id": "m-1", "node": "n1", "phase": "ready",
                              "url": "http://127.0.0.2:8000"}]}
        r = await c.put("/agent/v1/nodes/n1/status", json=good, headers=_node("n1"))
        assert r.json() == {"written": 1}
        # Nor may a node advertise a metadata or unspecified address.
        for address in ("169.254.169.254", "0.0.0.0", "ff02::1", "-x", "a b"):
            r = await c.put("/agent/v1/nodes/n1", json=_inventory("n1", address),
                            headers=_node("n1"))
            assert r.status_code == 422, (address, r.text)


async def test_model_specs_and_node_names_are_typed_at_the_boundary(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async with gateways(etcd_server, etcd_prefix, tmp_path, 1,
                        model_roots="/models,/srv/weights/") as [(a, c)]:
        refused = {
            "--help": "model", "-m": "model", "/etc/passwd": "model",
            "/models/../etc/passwd": "model", "/models//x": "model", "org/a/b": "model",
            "../models/x": "model", "/srv/weightsX/m.gguf": "model", "a b": "model",
        }
        for value, field in refused.items():
            r = await c.put("/admin/models/m", json={"model": value})
            assert r.status_code == 422, (value, r.text)
            assert [e["loc"][-1] for e in r.json()["errors"]] == [field], (value, r.text)
        r = await c.put("/admin/models/m", json={"model": "org/m", "revision": "--x"})
        assert r.status_code == 422 and r.json()["errors"][0]["loc"][-1] == "revision"
        for ok in ("org/m", "gpt2", "/models/m.gguf", "/srv/weights/org/m"):
            r = await c.put("/admin/models/m", json={"model": ok})
            assert r.status_code in (200, 201), (ok, r.text)
        r = await c.put("/admin/models/m", json={"model": "org/m", "revision": "v1.0"})
        assert r.status_code == 200 and r.json()["revision"] == "v1.0"
        assert (await c.get("/admin/models")).json()[0]["revision"] == "v1.0"
        # Nothing refused reached the store.
        stored = await a.state.gateway.store.get(s.MODELS + "m")
        assert stored is not None and b'"org/m"' in stored.value
        # Node names follow the same rule as model names.
        bad = "-n1"
        r = await c.put(f"/agent/v1/nodes/{bad}", json=_inventory(bad), headers=_node(bad))
        assert r.status_code == 422, r.text


async def test_replicas_of_a_node_not_heard_from_are_shown_unknown_not_ready(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    # The router already leaves them out; the admin API and the metrics
    # must not show an operator their last "ready" either.
    async with gateways(etcd_server, etcd_prefix, tmp_path, 1) as [(a, c)]:
        gw = a.state.gateway
        await _join(c)
        r = await c.put("/admin/models/m", json={"model": "org/m", "engine": "vllm", "gpus": 1})
        assert r.status_code == 201, r.text
        await until(lambda: gw.mirror.replicas(), "a replica placed")
        (rid,) = gw.mirror.replicas()
        report = {"replicas": [{"id": rid, "node": "n1", "phase": "ready",
                                "url": "http://127.0.0.1:8123"}]}
        r = await c.put("/agent/v1/nodes/n1/status", json=report, headers=_node("n1"))
        assert r.json() == {"written": 1}
        await until(lambda: rid in gw.mirror.statuses(), "the status mirrored")

        async def shown() -> tuple[str, str, int, str]:
            (rep,) = (await c.get("/admin/replicas")).json()
            ready = (await c.get("/admin/models/m")).json()["status"]["ready"]
            line = next(ln for ln in (await c.get("/metrics")).text.splitlines()
                        if ln.startswith('llmgw_replicas{model="m"'))
            return rep["phase"], rep["detail"], ready, line

        assert await shown() == ("ready", "", 1, 'llmgw_replicas{model="m",phase="ready"} 1.0')
        # The node's key expires (its agent or the node died).
        assert await gw.store.delete(s.NODES + "n1")
        await until(lambda: "n1" not in gw.mirror.nodes(), "the node gone from the mirror")
        assert await shown() == ("unknown", "node n1 not heard from; last reported ready", 0,
                                 'llmgw_replicas{model="m",phase="unknown"} 1.0')


async def test_replicas_wanted_is_what_the_model_wants_now_not_its_floor(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    # A min-0 model in use wants a replica: the metric said 0 (replicas.min)
    # while /admin/models said 1.
    async with gateways(etcd_server, etcd_prefix, tmp_path, 1) as [(a, c)]:
        gw = a.state.gateway
        r = await c.put("/admin/models/z", json={"model": "org/z", "engine": "vllm", "gpus": 1,
                                                 "replicas": {"min": 0, "max": 2},
                                                 "idle_timeout": 600})
        assert r.status_code == 201, r.text

        async def shown() -> tuple[int, str]:
            wanted = (await c.get("/admin/models/z")).json()["status"]["wanted"]
            line = next(ln for ln in (await c.get("/metrics")).text.splitlines()
                        if ln.startswith('llmgw_replicas_wanted{model="z"'))
            return wanted, line

        assert await shown() == (0, 'llmgw_replicas_wanted{model="z"} 0.0')
        # Another gateway's usage snapshot: a request for z a moment ago.
        used = s.Usage(gateway="gw-other", last_used={"z": time.time()})
        rev = await gw.store.put(s.USAGE + "gw-other", used.model_dump_json().encode())
        await gw.mirror.wait_for(rev, 5)
        assert await shown() == (1, 'llmgw_replicas_wanted{model="z"} 1.0')

