"""The leader's reconcile pass, one `tick()` at a time, with injected clocks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.control import state as s
from app.control.leader import Elector
from app.control.mirror import Mirror
from app.control.reconciler import Reconciler
from app.store.embedded import EmbeddedStore


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def parts(tmp_path: Path) -> AsyncIterator[tuple[EmbeddedStore, Mirror, Elector]]:
    store = await EmbeddedStore.open(tmp_path / "state.db", expiry_interval=None)
    mirror = Mirror(store)
    mirror.start()
    elector = Elector(store, s.GatewayInfo(id="gw", url="u", version="t", started=0), ttl=10)
    try:
        yield store, mirror, elector
    finally:
        await mirror.stop()
        await store.close()


async def put(store: EmbeddedStore, mirror: Mirror, key: str, value: s.BaseModel) -> None:
    assert await mirror.wait_for(await store.put(key, value.model_dump_json().encode()), 2)


async def test_tick_places_drains_then_removes(
    parts: tuple[EmbeddedStore, Mirror, Elector],
) -> None:
    store, mirror, elector = parts
    wall = Clock(1000.0)
    suffixes = iter(["a", "b", "c"])
    rec = Reconciler(store, mirror, elector, drain_seconds=5, interval=1, node_grace=0, wall=wall,
                     new_suffix=lambda: next(suffixes))

    assert (await rec.tick()).skipped == "not leader"  # it only acts while it leads
    assert (await elector.tick()).is_leader

    await put(store, mirror, s.NODES + "n1", s.NodeInfo(
        name="n1", gpus=[s.GpuInfo(index=0), s.GpuInfo(index=1)], engines=["vllm"]))
    await put(store, mirror, s.MODELS + "m", s.StoredModel(name="m", model="w", gpus=1))
    result = await rec.tick()
    assert [r.id for r in result.plan.create] == ["m-a"]
    # The next pass waits for its own write to reach the mirror, then has
    # nothing to do: a replica is never placed twice.
    assert await mirror.wait_for(rec.written_revision, 2)
    assert (await rec.tick()).plan.empty
    assert mirror.replicas()["m-a"].gpus == [0]

    assert await store.delete(s.MODELS + "m")
    assert await mirror.wait_for((await store.range("")).revision, 2)
    assert (await rec.tick()).plan.drain == ["m-a"]
    assert await mirror.wait_for(rec.written_revision, 2)
    assert mirror.replicas()["m-a"].draining_since == 1000.0
    wall.now += 4.9
    assert (await rec.tick()).plan.empty  # still draining
    wall.now += 0.2
    assert (await rec.tick()).plan.delete == ["m-a"]
    assert await mirror.wait_for(rec.written_revision, 2)
    assert mirror.replicas() == {}


async def test_tick_reports_why_a_model_cannot_be_placed(
    parts: tuple[EmbeddedStore, Mirror, Elector],
) -> None:
    store, mirror, elector = parts
    rec = Reconciler(store, mirror, elector, drain_seconds=5, interval=1, node_grace=0)
    await elector.tick()
    await put(store, mirror, s.NODES + "n1", s.NodeInfo(
        name="n1", gpus=[s.GpuInfo(index=0)], engines=["vllm"]))
    await put(store, mirror, s.MODELS + "big", s.StoredModel(name="big", model="w", gpus=2))
    result = await rec.tick()
    assert result.plan.create == []
    assert rec.last_unplaced == {"big": "n1: needs 2 free GPUs, has 1 of 1"}



async def test_an_absent_nodes_replicas_are_kept_for_the_grace_and_a_handover_restarts_it(
    parts: tuple[EmbeddedStore, Mirror, Elector],
) -> None:
    store, mirror, a = parts
    b = Elector(store, s.GatewayInfo(id="gw-b", url="u", version="t", started=0), ttl=10)
    clock = Clock(0.0)
    recs = {e: Reconciler(store, mirror, e, drain_seconds=5, interval=1, node_grace=10,
                          clock=clock, new_suffix=lambda: "a") for e in (a, b)}
    assert (await a.tick()).is_leader
    node = s.NodeInfo(name="n1", gpus=[s.GpuInfo(index=0)], engines=["vllm"])
    await put(store, mirror, s.NODES + "n1", node)
    await put(store, mirror, s.MODELS + "m", s.StoredModel(name="m", model="w", gpus=1))
    assert [r.id for r in (await recs[a].tick()).plan.create] == ["m-a"]
    assert await mirror.wait_for(recs[a].written_revision, 2)

    async def node_gone() -> None:
        assert await store.delete(s.NODES + "n1")
        assert await mirror.wait_for((await store.range("")).revision, 2)

    async def kept(e: Elector) -> bool:
        r = await recs[e].tick()
        return r.skipped == "" and r.plan.empty and set(mirror.replicas()) == {"m-a"}

    # The node's key vanishes (its lease ran out): the replica stays.
    await node_gone()
    assert await kept(a)
    clock.now += 9.5
    assert await kept(a)
    # It comes back and goes again: the grace counts from the new absence.
    await put(store, mirror, s.NODES + "n1", node)
    assert await kept(a)
    await node_gone()
    clock.now += 1.0
    assert await kept(a)

    # A hands over to B, which has never heard from n1: a new grace.
    clock.now += 9.0
    await a.resign()
    assert (await b.tick()).is_leader
    assert await mirror.wait_for(b.lead_revision, 2)
    assert await kept(b)
    clock.now += 9.5
    assert await kept(b)
    # And back to A, whose grace from before its lead ended long ago: anew.
    await b.resign()
    assert (await a.tick()).is_leader
    assert await mirror.wait_for(a.lead_revision, 2)
    assert await kept(a)
    clock.now += 9.5
    assert await kept(a)
    clock.now += 0.5
    result = await recs[a].tick()
    assert result.plan.delete == ["m-a"] and not result.refused
    assert await mirror.wait_for(recs[a].written_revision, 2)
    assert mirror.replicas() == {}
    assert recs[a].last_unplaced == {"m": "no nodes"}
