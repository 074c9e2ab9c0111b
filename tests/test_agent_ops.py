"""What agents write (app/control/ops/agent_ops.py): heartbeats bound to a
lease, and status reports fenced on their replica, in-process against the
embedded store and a running mirror: no HTTP."""

from __future__ import annotations

import pytest

from app.control import state as s
from app.control.mirror import Mirror
from app.control.ops.agent_ops import AgentOps
from app.control.ops.base import Parts
from app.control.ops.refusals import Busy
from app.store.base import TxnResult
from app.store.embedded import EmbeddedStore


async def settle(mirror: Mirror, rev: int) -> None:
    assert await mirror.wait_for(rev, 2.0)


async def test_a_heartbeat_binds_the_node_to_a_lease_then_renews_it(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = AgentOps(Parts(store, mirror), node_ttl=15)
    await ops.heartbeat(s.NodeInfo(name="n1"))
    first = await store.get(s.NODES + "n1")
    assert first is not None and first.lease
    await settle(mirror, first.mod_revision)
    # The same inventory again: the lease is kept alive, nothing rewritten.
    await ops.heartbeat(s.NodeInfo(name="n1"))
    again = await store.get(s.NODES + "n1")
    assert again is not None and again.mod_revision == first.mod_revision
    # A new inventory is written on the same lease.
    await ops.heartbeat(s.NodeInfo(name="n1", address="10.0.0.1"))
    changed = await store.get(s.NODES + "n1")
    assert changed is not None and changed.lease == first.lease
    assert s.NodeInfo.model_validate_json(changed.value).address == "10.0.0.1"


async def test_a_heartbeat_after_its_lease_expired_takes_a_new_one(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    now_s = [0.0]
    ops = AgentOps(Parts(store, mirror), node_ttl=15, clock=lambda: now_s[0])
    await ops.heartbeat(s.NodeInfo(name="n1"))
    first = await store.get(s.NODES + "n1")
    assert first is not None
    await settle(mirror, first.mod_revision)
    await store.revoke(first.lease)  # the node key goes with it
    now_s[0] += 15  # an expired lease outlived its TTL since this gateway renewed it
    await ops.heartbeat(s.NodeInfo(name="n1"))
    now = await store.get(s.NODES + "n1")
    assert now is not None and now.lease and now.lease != first.lease


async def test_an_unchanged_heartbeat_within_a_third_of_the_ttl_asks_nothing(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    """The renewal a gateway made itself covers the agent's next beats for a
    third of the TTL (docs/design/scale.md): no keepalive, no read."""
    store, mirror = parts
    now_s = [0.0]
    ops = AgentOps(Parts(store, mirror), node_ttl=15, clock=lambda: now_s[0])
    await ops.heartbeat(s.NodeInfo(name="n1"))
    first = await store.get(s.NODES + "n1")
    assert first is not None
    await settle(mirror, first.mod_revision)
    kept: list[int] = []
    real_keepalive = store.keepalive

    async def keepalive(lease: int) -> None:
        kept.append(lease)
        await real_keepalive(lease)

    store.keepalive = keepalive  # type: ignore[method-assign]
    now_s[0] += 4.9
    await ops.heartbeat(s.NodeInfo(name="n1"))
    assert kept == []
    now_s[0] += 0.2  # past a third of 15 s: renewed again
    await ops.heartbeat(s.NodeInfo(name="n1"))
    assert kept == [first.lease]
    await ops.heartbeat(s.NodeInfo(name="n1", cpus=4))  # changed: written at once
    now = await store.get(s.NODES + "n1")
    assert now is not None and b'"cpus":4' in now.value


async def test_a_node_key_that_keeps_changing_is_busy(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = AgentOps(Parts(store, mirror), node_ttl=15)
    real_txn = store.txn

    async def racing_txn(*args: object, **kwargs: object) -> TxnResult:
        # Another gateway binds the node between each read and each write.
        await store.put(s.NODES + "n1", b"{}", lease=await store.grant(15))
        return await real_txn(*args, **kwargs)  # type: ignore[arg-type]

    store.txn = racing_txn  # type: ignore[method-assign]
    with pytest.raises(Busy) as busy:
        await ops.heartbeat(s.NodeInfo(name="n1"))
    store.txn = real_txn  # type: ignore[method-assign]
    assert busy.value.what == "node"


async def test_status_is_written_only_for_the_nodes_own_live_replicas(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    for rid, node in (("r1", "n1"), ("r2", "n2")):
        rev = await store.put(s.REPLICAS + rid, s.Replica(
            id=rid, model="m", node=node, weights="org/m").model_dump_json().encode())
    await settle(mirror, rev)
    ops = AgentOps(Parts(store, mirror), node_ttl=15)
    ready = s.ReplicaStatus(id="r1", node="n1", phase="ready", url="http://10.0.0.1:8000")
    others = [s.ReplicaStatus(id="r2", node="n1", phase="ready"),  # n2's replica
              s.ReplicaStatus(id="gone", node="n1", phase="ready")]  # no such replica
    assert await ops.report_status("n1", [ready, *others]) == 1
    kv = await store.get(s.STATUS + "r1")
    assert kv is not None and s.ReplicaStatus.model_validate_json(kv.value) == ready
    assert await store.get(s.STATUS + "r2") is None and await store.get(s.STATUS + "gone") is None
    await settle(mirror, kv.mod_revision)
    assert await ops.report_status("n1", [ready]) == 0  # as stored already


async def test_a_late_report_does_not_recreate_a_deleted_replicas_status(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    rev = await store.put(s.REPLICAS + "r1", s.Replica(
        id="r1", model="m", node="n1", weights="org/m").model_dump_json().encode())
    await settle(mirror, rev)
    # The leader deletes the replica; this gateway's mirror has not seen it.
    await mirror.stop()
    await store.delete(s.REPLICAS + "r1")
    ops = AgentOps(Parts(store, mirror), node_ttl=15)
    st = s.ReplicaStatus(id="r1", node="n1", phase="failed", detail="late")
    assert await ops.report_status("n1", [st]) == 0
    assert await store.get(s.STATUS + "r1") is None
    mirror.start()
