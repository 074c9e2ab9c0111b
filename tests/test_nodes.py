"""A node that stops heartbeating leaves the router at once, and loses its
replicas, which go elsewhere, once its grace period is over."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from app.control import state as s
from app.control.keys import SecretRing
from app.control.mirror import Mirror
from app.gateway.publish import Publisher, Timing
from app.router.table import RouteTable
from app.store.embedded import EmbeddedStore
from tests.support.procs import Cluster, make_key, put_model, replicas, routes, wait_for


async def test_replicas_of_an_absent_node_leave_the_router_and_come_back_with_it(
    tmp_path: Path,
) -> None:
    store = await EmbeddedStore.open(tmp_path / "state.db", expiry_interval=None)
    mirror = Mirror(store)
    table = RouteTable()
    Publisher(mirror, table, SecretRing("nodes-test-secret-0123456789"),
              timing=Timing(timer=lambda: 0.0))
    mirror.start()

    async def write(key: str, value: s.BaseModel | None) -> None:
        if value is None:
            assert await store.delete(key)
        else:
            await store.put(key, value.model_dump_json().encode())
        assert await mirror.wait_for((await store.range("")).revision, 2)
        await asyncio.sleep(0)  # the publish is scheduled with call_soon

    node = s.NodeInfo(name="n1", gpus=[s.GpuInfo(index=0)], engines=["vllm"])
    try:
        await write(s.MODELS + "m", s.StoredModel(name="m", model="w"))
        await write(s.NODES + "n1", node)
        await write(s.REPLICAS + "m-1", s.Replica(id="m-1", model="m", node="n1", gpus=[0],
                                                  weights="w"))
        await write(s.STATUS + "m-1", s.ReplicaStatus(id="m-1", node="n1", phase="ready",
                                                     url="http://127.0.0.1:9"))
        assert [e.replica_id for e in table.endpoints("m")] == ["m-1"]
        # The node's key expires (or a restart dropped it): its last "ready"
        # is no promise, though the leader keeps the replica for a while.
        await write(s.NODES + "n1", None)
        assert table.endpoints("m") == ()
        await write(s.NODES + "n1", node)
        assert [e.replica_id for e in table.endpoints("m")] == ["m-1"]
    finally:
        await mirror.stop()
        await store.close()


def test_a_dead_nodes_replica_is_replaced_on_another_node(cluster: Cluster) -> None:
    # A short grace: this test is about what happens once it is over.
    gw = cluster.gateway("gw-a", node_ttl="3", node_grace="1")
    first = cluster.agent("node-1", [gw], "--gpus", "1")
    key = make_key(gw)
    put_model(gw, "m", {"model": "acme/m", "gpus": 1})
    wait_for(lambda: routes(gw, key, "m"), 30, "routing")
    (rep,) = replicas(gw)
    assert rep["node"] == "node-1"

    cluster.agent("node-2", [gw], "--gpus", "1")
    wait_for(lambda: len(gw.admin().get("/admin/nodes").json()) == 2, 10, "node-2 joined")
    # node-2 is free, but the replica stays where it is while node-1 lives,
    # longer than the node TTL: heartbeats keep the node (agents beat at
    # least three times per TTL, whatever their own interval).
    time.sleep(4)
    assert [(r["id"], r["node"]) for r in replicas(gw)] == [(rep["id"], "node-1")]

    first.signal(signal.SIGKILL)  # the agent and its engines, as a node crash
    killed = time.monotonic()
    moved = wait_for(
        lambda: [r for r in replicas(gw) if r["node"] == "node-2" and r["phase"] == "ready"],
        15, "the replica ready on node-2")
    print(f"replica re-placed and ready {time.monotonic() - killed:.1f} s after the node died")
    assert moved[0]["id"] != rep["id"]
    assert [n["name"] for n in gw.admin().get("/admin/nodes").json()] == ["node-2"]
    wait_for(lambda: routes(gw, key, "m"), 5, "routing to node-2")
