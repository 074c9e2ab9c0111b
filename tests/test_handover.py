"""A new leader plans on the state it leads, not on a lagging copy of it.

Two gateways' worth of parts (store, mirror, elector, reconciler) in one
process, on a real etcd. Gateway B's watch is held back, as a watch stream
reconnecting or a mirror in its resync backoff would be, while A places
replicas and hands the lead to B. etcd's own history of `replicas/` then
shows whether any (node, GPU) was ever held by two replicas.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from app.control import state as s
from app.control.leader import Elector
from app.control.mirror import Mirror
from app.control.reconciler import Reconciler, ReconcileSettings
from app.store.base import Compare, Op, Store, StoreUnavailable, TxnResult, WatchBatch
from app.store.etcd.store import EtcdStore
from tests.support.etcd import EtcdServer, ExternalEtcd


class HeldWatch:
    """A store whose watches deliver nothing while held (from the start, or
    after `hold()`) until `release()`: everything else goes straight to the
    real store."""

    def __init__(self, inner: Store, held: bool = True) -> None:
        self.inner = inner
        self.released = asyncio.Event()
        if not held:
            self.released.set()

    def hold(self) -> None:
        self.released.clear()

    def release(self) -> None:
        self.released.set()

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[WatchBatch]:
        async for batch in self.inner.watch(prefix, start_revision):
            await self.released.wait()
            yield batch

    async def txn(self, compares: Sequence[Compare], success: Sequence[Op],
                  failure: Sequence[Op] = ()) -> TxnResult:
        return await self.inner.txn(compares, success, failure)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Side:
    """One gateway's control-plane parts."""

    store: Store
    mirror: Mirror
    elector: Elector
    reconciler: Reconciler
    wall: Clock


def side(store: Store, name: str, suffixes: list[str]) -> Side:
    mirror = Mirror(store)
    elector = Elector(store, s.GatewayInfo(id=name, url=f"http://{name}", version="t",
                                           started=0), ttl=10)
    it = iter(suffixes)
    wall = Clock(1000.0)
    rec = Reconciler(store, mirror, elector, ReconcileSettings(
            drain_seconds=5, interval=1, node_grace=30, new_suffix=lambda: next(it)), wall=wall)
    return Side(store, mirror, elector, rec, wall)


async def put(store: Store, key: str, value: s.BaseModel) -> int:
    return await store.put(key, value.model_dump_json().encode())


async def replica_history(store: Store, start: int) -> list[tuple[int, dict[str, s.Replica]]]:
    """`replicas/` as it stood after each revision from `start` on, replayed
    from etcd's own history."""
    end = await store.put("test-end-marker", b"")
    current: dict[str, s.Replica] = {}
    states: list[tuple[int, dict[str, s.Replica]]] = []
    async with asyncio.timeout(10):
        async for batch in store.watch("", start):
            assert not batch.compacted
            for ev in batch.events:
                if ev.key.startswith(s.REPLICAS):
                    rid = ev.key[len(s.REPLICAS):]
                    if ev.kind == "put":
                        current[rid] = s.Replica.model_validate_json(ev.value)
                    else:
                        current.pop(rid, None)
                    states.append((ev.mod_revision, dict(current)))
            if batch.revision >= end:
                return states
    raise AssertionError("the watch ended before the end marker")


def doubly_held(states: list[tuple[int, dict[str, s.Replica]]]) -> list[str]:
    found = []
    for revision, reps in states:
        holders: dict[tuple[str, int], list[str]] = {}
        for r in reps.values():
            for g in r.gpus:
                holders.setdefault((r.node, g), []).append(r.id)
        found += [f"revision {revision}: {node} GPU {g} held by {ids}"
                  for (node, g), ids in holders.items() if len(ids) > 1]
    return found


@pytest.fixture
async def stores(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str,
) -> AsyncIterator[tuple[EtcdStore, EtcdStore]]:
    a = await EtcdStore.open([etcd_server.endpoint], etcd_prefix)
    b = await EtcdStore.open([etcd_server.endpoint], etcd_prefix)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def test_a_new_leader_with_a_lagging_mirror_never_places_on_a_taken_gpu(
    stores: tuple[EtcdStore, EtcdStore],
) -> None:
    store_a, store_b = stores
    start = (await store_a.range("")).revision + 1
    await put(store_a, s.NODES + "n1", s.NodeInfo(
        name="n1", gpus=[s.GpuInfo(index=0)], engines=["vllm"]))
    await put(store_a, s.MODELS + "m", s.StoredModel(name="m", model="w", gpus=1))

    a = side(store_a, "a", ["a1"])
    held = HeldWatch(store_b)
    b = side(held, "b", ["b1"])  # type: ignore[arg-type]
    a.mirror.start()
    b.mirror.start()  # loads node and model, then its watch is held
    try:
        assert await a.mirror.wait_for(await store_a.put("sync", b""), 5)
        assert await b.mirror.wait_for(start + 1, 5)
        assert (await a.elector.tick()).is_leader
        assert not (await b.elector.tick()).is_leader
        assert await a.mirror.wait_for(a.elector.lead_revision, 5)  # else its pass skips

        placed = await a.reconciler.tick()
        assert [(r.id, r.node, r.gpus) for r in placed.plan.create] == [("m-a1", "n1", [0])]

        # A hands over (a clean stop); B leads on a copy that lacks m-a1.
        await a.elector.resign()
        assert (await b.elector.tick()).is_leader
        assert b.mirror.replicas() == {}
        first = await b.reconciler.tick()

        held.release()
        assert await b.mirror.wait_for((await store_b.range("")).revision, 5)
        assert set(b.mirror.replicas()) >= {"m-a1"}
        await b.reconciler.tick()
    finally:
        await a.mirror.stop()
        await b.mirror.stop()

    history = await replica_history(store_a, start)
    assert history, "the replay saw no replica at all"
    assert doubly_held(history) == []
    assert set(history[-1][1]) == {"m-a1"}
    # B waited for its copy to reach the revision at which it took the lead.
    assert first.skipped.startswith("mirror behind the revision at which we took the lead")
    assert not first.acted


@pytest.fixture
async def leader(
    stores: tuple[EtcdStore, EtcdStore],
) -> AsyncIterator[tuple[EtcdStore, HeldWatch, Side]]:
    """One leader whose watch a test can hold, on a node with two GPUs."""
    store, _ = stores
    await put(store, s.NODES + "n1", s.NodeInfo(
        name="n1", gpus=[s.GpuInfo(index=0), s.GpuInfo(index=1)], engines=["vllm"]))
    await put(store, s.MODELS + "m", s.StoredModel(name="m", model="w", gpus=1))
    held = HeldWatch(store, held=False)
    one = side(held, "a", ["c", "d", "e"])  # type: ignore[arg-type]
    one.mirror.start()
    try:
        assert await one.mirror.wait_for(await store.put("sync", b""), 5)
        assert (await one.elector.tick()).is_leader
        # Its first pass plans only once its copy has reached its own lead.
        assert await one.mirror.wait_for(one.elector.lead_revision, 5)
        yield store, held, one
    finally:
        await one.mirror.stop()


async def caught_up(store: Store, mirror: Mirror) -> None:
    assert await mirror.wait_for((await store.range("")).revision, 5)


async def test_a_create_never_overwrites_a_replica_it_has_not_seen(
    leader: tuple[EtcdStore, HeldWatch, Side],
) -> None:
    store, held, a = leader
    held.hold()
    # A replica with the very id the leader is about to pick, which its copy lacks.
    unseen = s.Replica(id="m-c", model="other", node="n1", gpus=[1], weights="x")
    await put(store, s.REPLICAS + "m-c", unseen)

    result = await a.reconciler.tick()
    assert [r.id for r in result.plan.create] == ["m-c"]
    kv = await store.get(s.REPLICAS + "m-c")
    assert kv is not None and s.Replica.model_validate_json(kv.value) == unseen
    assert "m-c" in result.refused
    # The refusal says the store holds something newer: no plan until it is seen.
    assert (await a.reconciler.tick()).skipped == "mirror behind our last write"
    held.release()
    await caught_up(store, a.mirror)
    assert [r.id for r in (await a.reconciler.tick()).plan.create] == ["m-d"]


async def test_drains_and_deletes_are_conditional_on_the_revision_read(
    leader: tuple[EtcdStore, HeldWatch, Side],
) -> None:
    store, held, a = leader
    assert [r.id for r in (await a.reconciler.tick()).plan.create] == ["m-c"]
    await caught_up(store, a.mirror)
    assert await store.delete(s.MODELS + "m")
    await caught_up(store, a.mirror)

    # The replica changes in the store after the leader's copy showed it.
    held.hold()
    changed = a.mirror.replicas()["m-c"].model_copy(update={"weights": "changed"})
    await put(store, s.REPLICAS + "m-c", changed)
    result = await a.reconciler.tick()
    assert result.plan.drain == ["m-c"]
    kv = await store.get(s.REPLICAS + "m-c")
    assert kv is not None and s.Replica.model_validate_json(kv.value) == changed
    assert "m-c" in result.refused

    held.release()
    await caught_up(store, a.mirror)
    assert (await a.reconciler.tick()).plan.drain == ["m-c"]
    await caught_up(store, a.mirror)
    draining = a.mirror.replicas()["m-c"]
    assert draining.draining_since == 1000.0

    held.hold()
    undrained = draining.model_copy(update={"draining_since": None})
    await put(store, s.REPLICAS + "m-c", undrained)
    a.wall.now += 10
    result = await a.reconciler.tick()
    assert result.plan.delete == ["m-c"]
    kv = await store.get(s.REPLICAS + "m-c")
    assert kv is not None and s.Replica.model_validate_json(kv.value) == undrained
    assert "m-c" in result.refused


class DiesAfter:
    """A leader's store that goes dark after `writes` transactions: the
    gateway killed in the middle of applying its plan."""

    def __init__(self, inner: Store, writes: int) -> None:
        self.inner = inner
        self.left = writes

    async def txn(self, compares: Sequence[Compare], success: Sequence[Op],
                  failure: Sequence[Op] = ()) -> TxnResult:
        if self.left <= 0:
            raise StoreUnavailable("this gateway was killed")
        self.left -= 1
        return await self.inner.txn(compares, success, failure)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_leader_killed_in_the_middle_of_a_scale_up_leaves_no_double_placement(
    stores: tuple[EtcdStore, EtcdStore],
) -> None:
    store_a, store_b = stores
    start = (await store_a.range("")).revision + 1
    await put(store_a, s.NODES + "n1", s.NodeInfo(
        name="n1", gpus=[s.GpuInfo(index=i) for i in range(4)], engines=["vllm"]))
    await put(store_a, s.NODES + "n2", s.NodeInfo(
        name="n2", gpus=[s.GpuInfo(index=i) for i in range(4)], engines=["vllm"]))
    await put(store_a, s.MODELS + "m", s.StoredModel(
        name="m", model="w", gpus=1, replicas={"min": 6, "max": 6}))  # type: ignore[arg-type]

    a = side(DiesAfter(store_a, 3), "a", [f"a{i}" for i in range(9)])  # type: ignore[arg-type]
    held = HeldWatch(store_b)
    b = side(held, "b", [f"b{i}" for i in range(9)])  # type: ignore[arg-type]
    a.mirror.start()
    b.mirror.start()
    try:
        assert await a.mirror.wait_for(await store_a.put("sync", b""), 5)
        assert await b.mirror.wait_for(start + 2, 5)
        assert (await a.elector.tick()).is_leader
        # Its pass plans only once its copy has reached its own lead (else it
        # skips, writing nothing: a CI rehearsal saw "DID NOT RAISE" below).
        assert await a.mirror.wait_for(a.elector.lead_revision, 5)
        # A plans six replicas and dies after writing two of them (its third
        # transaction was its campaign's): its lease lapses, never revoked.
        with pytest.raises(StoreUnavailable):
            await a.reconciler.tick()
        await a.mirror.stop()
        await store_a.revoke(a.elector.lease)  # the TTL running out, without the wait
        # B leads on a copy that has not seen A's two creates yet.
        assert (await b.elector.tick()).is_leader
        assert b.mirror.replicas() == {}
        first = await b.reconciler.tick()
        assert not first.acted  # it waits for its copy to reach its lead
        held.release()
        assert await b.mirror.wait_for((await store_b.range("")).revision, 5)
        for _ in range(3):
            await b.reconciler.tick()
            assert await b.mirror.wait_for((await store_b.range("")).revision, 5)
    finally:
        await b.mirror.stop()

    history = await replica_history(store_a, start)
    assert doubly_held(history) == []
    final = history[-1][1]
    # Exactly the six wanted: A's two survivors, and four of B's; nothing twice.
    assert len(final) == 6 and sum(r.id.startswith("m-a") for r in final.values()) == 2
    assert len({(r.node, g) for r in final.values() for g in r.gpus}) == 6
