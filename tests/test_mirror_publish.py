"""The mirror follows the store, and the publisher turns it into router tables."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from app.control import state as s
from app.control.keys import SecretRing, engine_key, hash_client_key
from app.control.mirror import Mirror
from app.gateway.publish import Publisher, Timing
from app.router.choice import ring_order
from app.router.published import Endpoint
from app.router.table import RouteTable
from app.store.base import Event, WatchBatch
from app.store.embedded import EmbeddedStore
from tests.support.procs import until
from tests.support.proxy_rig import FakeClock

SECRET = "mirror-test-secret-0123456789"


def test_a_compacted_batch_is_refused_so_the_reader_resyncs() -> None:
    mirror = Mirror(None)  # type: ignore[arg-type]  # apply() touches no store
    assert mirror.apply(WatchBatch([Event("put", "a", b"1", 2, create_revision=2)], 2))
    assert mirror.get("a") is not None and mirror.revision == 2
    assert not mirror.apply(WatchBatch([], 9, compacted=True))
    assert mirror.revision == 2  # nothing folded in across the gap
    # An event the mirror already saw (a resync raced the watch) is ignored.
    assert mirror.apply(WatchBatch([Event("delete", "a", b"", 2)], 2))
    assert mirror.get("a") is not None


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[EmbeddedStore]:
    st = await EmbeddedStore.open(tmp_path / "state.db", log_limit=4, expiry_interval=None)
    yield st
    await st.close()


async def test_mirror_follows_and_catches_up_after_a_stop(store: EmbeddedStore) -> None:
    mirror = Mirror(store)
    seen: list[set[str]] = []
    mirror.subscribe(seen.append)
    await store.put("a", b"1")
    mirror.start()
    try:
        assert await mirror.wait_for(await store.put("b", b"2"), 2)
        assert mirror.get("a") is not None and mirror.get("b") is not None

        # Changes the watch could not replay (the log holds 4 events) while
        # the mirror was stopped: a restart re-reads in full.
        await mirror.stop()
        await store.delete("a")
        for i in range(8):
            last = await store.put(f"k{i}", b"x")
        mirror.start()
        assert await mirror.wait_for(last, 2)
        assert mirror.get("a") is None
        assert {kv.key for kv in mirror.items("k")} == {f"k{i}" for i in range(8)}
        assert any("a" in changed for changed in seen)
    finally:
        await mirror.stop()


async def test_publisher_routes_only_ready_non_draining_replicas(store: EmbeddedStore) -> None:
    mirror = Mirror(store)
    table = RouteTable()
    Publisher(mirror, table, SecretRing(SECRET), timing=Timing(timer=lambda: 0.0))  # never paced
    mirror.start()

    async def write(key: str, value: s.BaseModel) -> None:
        rev = await store.put(key, value.model_dump_json().encode())
        assert await mirror.wait_for(rev, 2)
        await asyncio.sleep(0)  # the publish is scheduled with call_soon

    try:
        await write(s.MODELS + "m", s.StoredModel(name="m", model="w", aliases=["al"]))
        assert table.resolve("al") == "m" and table.resolve("m") == "m"
        assert table.unavailable("m") == "no replica is placed: no nodes"
        await write(s.NODES + "n", s.NodeInfo(name="n", gpus=[s.GpuInfo(index=0)]))
        rep = s.Replica(id="m-1", model="m", node="n", gpus=[0], weights="w")
        await write(s.REPLICAS + "m-1", rep)
        assert table.endpoints("m") == ()
        assert table.unavailable("m") == "replica m-1 is pending on n"
        await write(s.STATUS + "m-1", s.ReplicaStatus(id="m-1", node="n", phase="starting",
                                                     url="http://127.0.0.1:9"))
        assert table.endpoints("m") == ()
        # The 503 a client gets says why: the agent's detail, as reported.
        await write(s.STATUS + "m-1", s.ReplicaStatus(
            id="m-1", node="n", phase="failed", url="http://127.0.0.1:9",
            detail="engine killed by SIGILL, 3 times in 600 s"))
        assert table.unavailable("m") == (
            "replica m-1 is failed on n: engine killed by SIGILL, 3 times in 600 s")
        await write(s.STATUS + "m-1", s.ReplicaStatus(id="m-1", node="n", phase="ready",
                                                     url="http://127.0.0.1:9"))
        (ep,) = table.endpoints("m")
        assert table.unavailable("m") is None
        assert ep.url == "http://127.0.0.1:9" and ep.key == engine_key(SECRET, "m-1")
        assert ep.key not in repr(ep)
        await write(s.REPLICAS + "m-1", rep.model_copy(update={"draining_since": 1.0}))
        assert table.endpoints("m") == ()

        digest = hash_client_key("sk-test")
        await write(s.KEYS + digest, s.ClientKey(id="k1", name="t", created=0, models=["m"]))
        grant = table.grant(digest)
        assert grant is not None and grant.allows("m") and not grant.allows("other")
    finally:
        await mirror.stop()


def test_choose_prefers_the_least_busy_replica() -> None:
    from app.router.published import Endpoint

    table = RouteTable()
    a, b = Endpoint("a", "http://a", "ka"), Endpoint("b", "http://b", "kb")
    table.set_endpoints({"m": [a, b]})
    with table.acquire(a), table.acquire(a):
        assert table.choose("m", set()) == b
        with table.acquire(b), table.acquire(b), table.acquire(b):
            assert table.choose("m", set()) == a
    assert table.inflight("a") == 0 and table.inflight("b") == 0
    assert table.choose("m", {"a", "b"}) is None
    picks = {table.choose("m", set()).replica_id for _ in range(40)}  # type: ignore[union-attr]
    assert picks == {"a", "b"}  # idle replicas share the load


async def _next_change(mirror: Mirror, revision: int, timeout: float) -> bool:
    """`wait_past` done wrong: waits for the next change after the call."""
    try:
        await asyncio.wait_for(mirror._changed.wait(), timeout)
    except TimeoutError:
        return False
    return mirror.revision > revision


async def _sees_a_change_landed_before_the_wait(
        store: EmbeddedStore,
        wait_past: Callable[[Mirror, int, float], Awaitable[bool]]) -> bool:
    """The race of a waiter: it reads the mirror's revision, a change lands
    and is applied, and only then does it wait past what it read. True when
    that wait returns True in its first step, without waiting for a wake-up."""
    mirror = Mirror(store)
    mirror.start()
    try:
        assert await mirror.wait_for(await store.put("a", b"1"), 2)
        seen = mirror.revision  # the caller reads the state...
        assert await mirror.wait_for(await store.put("b", b"2"), 2)  # ...a change lands...
        waiter = asyncio.create_task(wait_past(mirror, seen, 5))  # ...then it waits.
        # One loop step runs the waiter up to its first await: enough only for
        # a wait that checks the revision before sleeping. No timing involved.
        await asyncio.sleep(0)
        if not waiter.done():
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
            return False
        return waiter.result()
    finally:
        await mirror.stop()


async def test_a_change_between_read_and_wait_is_not_missed(store: EmbeddedStore) -> None:
    assert await _sees_a_change_landed_before_the_wait(store, Mirror.wait_past)
    # The scenario does catch a "wait for the next change" implementation.
    assert not await _sees_a_change_landed_before_the_wait(store, _next_change)


async def test_wait_past_wakes_on_a_later_change_and_times_out_without_one(
        store: EmbeddedStore) -> None:
    mirror = Mirror(store)
    mirror.start()
    try:
        assert await mirror.wait_for(await store.put("a", b"1"), 2)
        waiter = asyncio.create_task(mirror.wait_past(mirror.revision, 5))
        await asyncio.sleep(0)
        assert not waiter.done()  # nothing new yet: it waits
        await store.put("b", b"2")
        assert await asyncio.wait_for(waiter, 2)
        assert not await mirror.wait_past(mirror.revision, 0.2)  # nothing new: times out
    finally:
        await mirror.stop()


@pytest.mark.parametrize("steps", [0, 1, 2, 3])
async def test_a_waiter_cancelled_as_the_mirror_moves_is_cancelled(steps: int) -> None:
    """Stopping a gateway cancels loops parked in `wait_past`. A cancellation
    that lands just as the mirror wakes them must still cancel: one swallowed
    left the reconciler looping for ever and `Gateway.stop()` hanging."""
    mirror = Mirror(None)  # type: ignore[arg-type]  # apply() touches no store
    waiter = asyncio.create_task(mirror.wait_past(0, 5))
    await asyncio.sleep(0)  # parked on the mirror's event
    mirror.apply(WatchBatch([Event("put", "a", b"1", 1, create_revision=1)], 1))
    for _ in range(steps):
        await asyncio.sleep(0)
    if waiter.cancel():  # still parked: the cancellation must win
        with pytest.raises(asyncio.CancelledError):
            await waiter
    else:  # it had already seen the change
        assert waiter.result() is True
    assert steps > 0 or waiter.cancelled()


async def test_other_gateways_in_flight_make_a_llamacpp_queue(store: EmbeddedStore) -> None:
    """A llama.cpp replica has no /metrics: its queue is every gateway's
    in-flight count, the others' read from their usage snapshots, so every
    gateway judges it saturated alike (docs/design/routing.md, "Choosing a replica")."""
    mirror = Mirror(store)
    table = RouteTable()
    Publisher(mirror, table, SecretRing(SECRET), gateway_id="gw-a",
              timing=Timing(timer=lambda: 0.0))
    mirror.start()

    async def write(key: str, value: s.BaseModel) -> None:
        rev = await store.put(key, value.model_dump_json().encode())
        assert await mirror.wait_for(rev, 2)
        await asyncio.sleep(0)

    try:
        table.set_endpoints({"m": [Endpoint(f"l{i}", f"http://l{i}", "k", engine="llamacpp")
                                   for i in range(3)]})
        key = "s:cpu-chat"
        order = ring_order(["l0", "l1", "l2"], key)
        assert table.choose("m", set(), key) == table.endpoints("m")[int(order[0][1])]
        await write(s.USAGE + "gw-b", s.Usage(gateway="gw-b", inflight={order[0]: 2}))
        await write(s.USAGE + "gw-a", s.Usage(gateway="gw-a", inflight={order[0]: 7}))
        assert table.queued() == {order[0]: 2}  # its own snapshot is not a peer's
        # Two in flight from gw-b, one here: one running, two waiting, saturated.
        lease = table.acquire(table.endpoints("m")[int(order[0][1])])
        picked = table.choose("m", set(), key)
        assert picked is not None and picked.replica_id == order[1]
        rows = {r["replica"]: r for r in table.explain("m")}
        assert rows[order[0]]["why"] == "saturated"
        assert rows[order[0]]["inflight_all_gateways"] == 3
        lease.release()
        picked = table.choose("m", set(), key)
        assert picked is not None and picked.replica_id == order[0]
        await store.delete(s.USAGE + "gw-b")  # gw-b gone: its lease took its snapshot
        await until(lambda: table.queued() == {}, "gw-b's count dropped")
    finally:
        await mirror.stop()


async def test_a_gateway_that_has_seen_others_never_takes_itself_for_alone(
    store: EmbeddedStore,
) -> None:
    """A lone gateway admits a key's whole limit with no claim (the bound
    L + N - 1 is L). etcd back from an outage past the TTL drops every
    gateway's registration at once, and each writes its own back first: a
    gateway that has seen others must not read that moment as being alone,
    or each admits the whole limit (docs/design/client-keys.md).
    Seen to fail: the grant said 1 gateway once only gw-a's registration
    was back, and gw-a and gw-b each held the key's whole limit."""
    mirror = Mirror(store)
    table = RouteTable()
    Publisher(mirror, table, SecretRing(SECRET), gateway_id="gw-a",
              timing=Timing(timer=lambda: 0.0))
    mirror.start()
    digest = hash_client_key("sk-test")

    async def write(key: str, value: s.BaseModel) -> None:
        rev = await store.put(key, value.model_dump_json().encode())
        assert await mirror.wait_for(rev, 2)
        await asyncio.sleep(0)

    def gateways() -> int:
        grant = table.grant(digest)
        assert grant is not None
        return grant.gateways

    def info(gw: str) -> s.GatewayInfo:
        return s.GatewayInfo(id=gw, url="http://x", version="t", started=0)

    try:
        await write(s.KEYS + digest, s.ClientKey(id="k1", name="t", created=0))
        await write(s.GATEWAYS + "gw-a", info("gw-a"))
        assert gateways() == 1  # alone so far: the whole limit, no claim
        await write(s.GATEWAYS + "gw-b", info("gw-b"))
        assert gateways() == 2
        for gw in ("gw-a", "gw-b"):  # the leases dropped at once
            await store.delete(s.GATEWAYS + gw)
        await write(s.GATEWAYS + "gw-a", info("gw-a"))  # gw-a back first
        await until(lambda: mirror.get(s.GATEWAYS + "gw-b") is None, "gw-b gone")
        assert gateways() >= 2
    finally:
        await mirror.stop()


async def test_a_node_whose_key_just_went_is_routed_for_one_heartbeat_more(
    store: EmbeddedStore,
) -> None:
    """etcd back from an outage past the TTL drops every node's lease at
    once, agents and engines alive; each agent is registered again at its
    next heartbeat. Until then a node's ready replicas stay routed (for
    `node_grace`), not a fleet-wide 503 "node not heard from" (the chaos
    suite measured 4.4 s of those after each outage). Seen to fail: the
    replica left the table the moment its node's key went."""
    mirror = Mirror(store)
    table = RouteTable()
    clock = FakeClock()
    pub = Publisher(mirror, table, SecretRing(SECRET),
                    timing=Timing(node_grace=6.0, clock=clock, timer=lambda: 0.0))
    mirror.start()

    async def write(key: str, value: s.BaseModel) -> None:
        rev = await store.put(key, value.model_dump_json().encode())
        assert await mirror.wait_for(rev, 2)
        await asyncio.sleep(0)

    async def gone(key: str) -> None:
        await store.delete(key)
        assert await mirror.wait_for((await store.range(key)).revision, 2)
        await asyncio.sleep(0)

    try:
        await write(s.MODELS + "m", s.StoredModel(name="m", model="w"))
        node = s.NodeInfo(name="n", gpus=[s.GpuInfo(index=0)])
        await write(s.NODES + "n", node)
        await write(s.REPLICAS + "m-1", s.Replica(id="m-1", model="m", node="n", gpus=[0],
                                                  weights="w"))
        await write(s.STATUS + "m-1", s.ReplicaStatus(id="m-1", node="n", phase="ready",
                                                     url="http://127.0.0.1:9"))
        assert len(table.endpoints("m")) == 1
        await gone(s.NODES + "n")  # its lease dropped
        assert len(table.endpoints("m")) == 1  # still routed
        clock.now += 5
        await write(s.NODES + "n", node)  # its agent's next heartbeat
        clock.now += 5
        pub.publish()
        assert len(table.endpoints("m")) == 1
        # Gone for good (its agent silent): out once the grace has passed.
        await gone(s.NODES + "n")
        assert len(table.endpoints("m")) == 1
        clock.now += 6
        pub.publish()
        assert table.endpoints("m") == ()
        assert table.unavailable("m") == "replica m-1: node n not heard from"
        # A node that was never heard from is not routed at all.
        await write(s.REPLICAS + "m-2", s.Replica(id="m-2", model="m", node="n2", gpus=[0],
                                                  weights="w"))
        await write(s.STATUS + "m-2", s.ReplicaStatus(id="m-2", node="n2", phase="ready",
                                                     url="http://127.0.0.1:8"))
        assert table.endpoints("m") == ()
    finally:
        await mirror.stop()


async def test_publishing_takes_a_bounded_share_of_the_loop_under_a_stream_of_changes(
    store: EmbeddedStore,
) -> None:
    """A publish that took t is followed by the next no sooner than
    (1/share - 1) * t: at 10,000 nodes agents make ~300 changes a second,
    and a publish at each would take most of the event loop. A change after
    a quiet spell is published at once, and so is an operator's edit (the
    catalog, client keys), paced or not."""
    mirror = Mirror(store)
    table = RouteTable()
    now = [0.0]
    script: list[float] = []  # the timer's next readings, then `now`

    def timer() -> float:
        if script:
            now[0] = script.pop(0)
        return now[0]

    async def put(key: str, value: s.BaseModel) -> None:
        assert await mirror.wait_for(await store.put(key, value.model_dump_json().encode()), 2)

    def model(name: str) -> s.StoredModel:
        return s.StoredModel(name=name, model="w")

    pub = Publisher(mirror, table, SecretRing(SECRET), timing=Timing(share=0.5, timer=timer))
    mirror.start()
    try:
        await put(s.MODELS + "a", model("a"))
        await asyncio.sleep(0)
        assert table.unavailable("a") == "no replica is placed: no nodes"
        script[:] = [0.0, 0.1]
        assert pub.publish() is False  # this one takes 0.1 s
        # A node comes at once after it: held for (1/0.5 - 1) * 0.1 s.
        await put(s.NODES + "n", s.NodeInfo(name="n", gpus=[s.GpuInfo(index=0)]))
        started = asyncio.get_running_loop().time()
        await asyncio.sleep(0.05)
        assert table.unavailable("a") == "no replica is placed: no nodes"
        await until(lambda: table.unavailable("a") != "no replica is placed: no nodes",
                    "the node published", 2)
        waited = asyncio.get_running_loop().time() - started
        assert 0.08 < waited < 0.5, waited
        # An edit is not paced, nor is what it was waiting with.
        script[:] = [1.0, 1.1]
        pub.publish()
        await put(s.NODES + "n2", s.NodeInfo(name="n2", gpus=[s.GpuInfo(index=0)]))
        await put(s.MODELS + "b", model("b"))
        await asyncio.sleep(0)
        assert table.resolve("b") == "b"
        # Quiet since (the timer past the wait): a fleet change goes at once.
        now[0] = 10.0
        await put(s.NODES + "n3", s.NodeInfo(name="n3"))
        await asyncio.sleep(0)
        assert table.resolve("b") == "b" and pub._scheduled is None
    finally:
        await mirror.stop()
