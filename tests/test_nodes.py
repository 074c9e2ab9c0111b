"""A node that stops heartbeating loses its replicas, which go elsewhere."""

from __future__ import annotations

import signal
import time

from tests.support.procs import Cluster, make_key, put_model, replicas, routes, wait_for


def test_a_dead_nodes_replica_is_replaced_on_another_node(cluster: Cluster) -> None:
    gw = cluster.gateway("gw-a", node_ttl="3")
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
