"""The leader's reconcile pass, one `tick()` at a time, with injected clocks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from app.control import state as s
from app.control.leader import Elector
from app.control.mirror import Mirror
from app.control.reconciler import Reconciler, ReconcileSettings, TickResult
from app.gateway.settings import Settings
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
    rec = Reconciler(store, mirror, elector, ReconcileSettings(
            drain_seconds=5, interval=1, node_grace=0, new_suffix=lambda: next(suffixes)),
            wall=wall)

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
    rec = Reconciler(store, mirror, elector, ReconcileSettings(
            drain_seconds=5, interval=1, node_grace=0))
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
    recs = {e: Reconciler(store, mirror, e, ReconcileSettings(
            drain_seconds=5, interval=1, node_grace=10, new_suffix=lambda: "a"),
            clock=clock) for e in (a, b)}
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


# --- rollout, drains and idle stop, from the usage snapshots --------------------------


async def status(store: EmbeddedStore, mirror: Mirror, rid: str, phase: s.Phase) -> None:
    await put(store, mirror, s.STATUS + rid, s.ReplicaStatus(id=rid, node="n1", phase=phase))


async def usage(store: EmbeddedStore, mirror: Mirror, elector: Elector, **kw: object) -> None:
    """This gateway's snapshot, as its usage publisher would write it."""
    value = s.Usage(gateway="gw", **kw)  # type: ignore[arg-type]
    rev = await store.put(s.USAGE + "gw", value.model_dump_json().encode(), lease=elector.lease)
    assert await mirror.wait_for(rev, 2)


async def applied(rec: Reconciler, mirror: Mirror) -> TickResult:
    result = await rec.tick()
    assert not result.refused and not result.skipped, result
    assert await mirror.wait_for(rec.written_revision, 2)
    return result


async def test_a_spec_change_rolls_new_first_and_the_old_drains_when_its_work_is_done(
    parts: tuple[EmbeddedStore, Mirror, Elector],
) -> None:
    store, mirror, elector = parts
    wall = Clock(1000.0)
    suffixes = iter(["a", "b"])
    rec = Reconciler(store, mirror, elector, ReconcileSettings(
            drain_seconds=60, interval=1, node_grace=0, new_suffix=lambda: next(suffixes)),
            wall=wall)
    assert (await elector.tick()).is_leader
    assert await mirror.wait_for(elector.lead_revision, 2)
    await put(store, mirror, s.NODES + "n1", s.NodeInfo(
        name="n1", gpus=[s.GpuInfo(index=0), s.GpuInfo(index=1)], engines=["vllm"]))
    await put(store, mirror, s.MODELS + "m", s.StoredModel(name="m", model="org/m"))
    assert [r.id for r in (await applied(rec, mirror)).plan.create] == ["m-a"]
    await status(store, mirror, "m-a", "ready")

    # New weights: the replacement is placed; the old one keeps serving.
    await put(store, mirror, s.MODELS + "m", s.StoredModel(name="m", model="org/m2"))
    result = await applied(rec, mirror)
    assert [r.id for r in result.plan.create] == ["m-b"] and result.plan.drain == []
    await status(store, mirror, "m-b", "starting")
    assert (await applied(rec, mirror)).plan.empty  # still loading: nothing drains
    await status(store, mirror, "m-b", "ready")
    assert (await applied(rec, mirror)).plan.drain == ["m-a"]
    drained_at = mirror.get(s.REPLICAS + "m-a")
    assert drained_at is not None

    # This gateway has not reported since the drain: the old one stays.
    await usage(store, mirror, elector, revision=drained_at.mod_revision - 1)
    wall.now += 30
    assert (await applied(rec, mirror)).plan.empty
    # It has let go of it, with a stream still running on it: stays.
    await usage(store, mirror, elector, revision=drained_at.mod_revision, inflight={"m-a": 1})
    assert (await applied(rec, mirror)).plan.empty
    # The stream ended: removed, long before the cap.
    await usage(store, mirror, elector, revision=drained_at.mod_revision)
    assert (await applied(rec, mirror)).plan.delete == ["m-a"]
    assert set(mirror.replicas()) == {"m-b"}


async def test_a_drain_ends_at_the_cap_whatever_is_in_flight(
    parts: tuple[EmbeddedStore, Mirror, Elector],
) -> None:
    store, mirror, elector = parts
    wall = Clock(1000.0)
    rec = Reconciler(store, mirror, elector, ReconcileSettings(
            drain_seconds=60, interval=1, node_grace=0, new_suffix=lambda: "a"), wall=wall)
    assert (await elector.tick()).is_leader
    assert await mirror.wait_for(elector.lead_revision, 2)
    await put(store, mirror, s.NODES + "n1", s.NodeInfo(
        name="n1", gpus=[s.GpuInfo(index=0)], engines=["vllm"]))
    await put(store, mirror, s.MODELS + "m", s.StoredModel(name="m", model="org/m"))
    await applied(rec, mirror)
    assert await store.delete(s.MODELS + "m")
    assert await mirror.wait_for((await store.range("")).revision, 2)
    assert (await applied(rec, mirror)).plan.drain == ["m-a"]
    kv = mirror.get(s.REPLICAS + "m-a")
    assert kv is not None
    await usage(store, mirror, elector, revision=kv.mod_revision, inflight={"m-a": 3})
    wall.now += 59.9
    assert (await applied(rec, mirror)).plan.empty
    wall.now += 0.1
    assert (await applied(rec, mirror)).plan.delete == ["m-a"]


async def test_a_min_zero_model_stops_after_its_idle_timeout_and_a_handover_stops_nothing(
    parts: tuple[EmbeddedStore, Mirror, Elector],
) -> None:
    store, mirror, elector = parts
    wall = Clock(1000.0)
    rec = Reconciler(store, mirror, elector, ReconcileSettings(
            drain_seconds=60, interval=1, node_grace=0, idle_slack=5, new_suffix=lambda: "a"),
            wall=wall)
    assert (await elector.tick()).is_leader
    assert await mirror.wait_for(elector.lead_revision, 2)
    await put(store, mirror, s.NODES + "n1", s.NodeInfo(
        name="n1", gpus=[s.GpuInfo(index=0)], engines=["vllm"]))
    await put(store, mirror, s.MODELS + "m", s.StoredModel(
        name="m", model="org/m", replicas=s.ReplicaRange(min=0, max=1), idle_timeout=60))
    assert (await applied(rec, mirror)).plan.empty  # never used: nothing runs
    await usage(store, mirror, elector, last_used={"m": 1000.0})
    assert [r.id for r in (await applied(rec, mirror)).plan.create] == ["m-a"]
    # A gateway restart loses its counts: the leader remembers the last use.
    await usage(store, mirror, elector)
    wall.now += 64
    assert (await applied(rec, mirror)).plan.empty  # within idle_timeout + slack
    wall.now += 1
    assert (await applied(rec, mirror)).plan.drain == ["m-a"]

    # A new lead counts a running model's idle time from when it took it.
    await store.delete(s.REPLICAS + "m-a")
    rep = s.Replica(id="m-b", model="m", node="n1", gpus=[0], weights="org/m")
    await put(store, mirror, s.REPLICAS + "m-b", rep)
    await elector.resign()
    assert (await elector.tick()).is_leader
    assert await mirror.wait_for(elector.lead_revision, 2)
    assert (await applied(rec, mirror)).plan.empty  # the first pass of the new lead
    wall.now += 64
    assert (await applied(rec, mirror)).plan.empty
    wall.now += 1
    assert (await applied(rec, mirror)).plan.drain == ["m-b"]


# --- load-based scaling, from the engines' load in the snapshots -----------------------


async def test_load_scales_up_at_once_and_down_one_least_loaded_replica_per_window(
    parts: tuple[EmbeddedStore, Mirror, Elector],
) -> None:
    store, mirror, elector = parts
    clock = Clock(0.0)
    suffixes = iter(["a", "b", "c", "d"])
    rec = Reconciler(store, mirror, elector, ReconcileSettings(
            drain_seconds=600, interval=1, node_grace=0, scale_down_window=30,
            new_suffix=lambda: next(suffixes)), wall=Clock(1000.0), clock=clock)
    assert (await elector.tick()).is_leader
    assert await mirror.wait_for(elector.lead_revision, 2)
    await put(store, mirror, s.NODES + "n1", s.NodeInfo(
        name="n1", gpus=[s.GpuInfo(index=i) for i in range(4)], engines=["vllm"]))
    await put(store, mirror, s.MODELS + "m", s.StoredModel(
        name="m", model="org/m", replicas=s.ReplicaRange(min=1, max=3), load_target=4))
    assert [r.id for r in (await applied(rec, mirror)).plan.create] == ["m-a"]
    await status(store, mirror, "m-a", "ready")
    assert (await applied(rec, mirror)).plan.empty  # no load known: min

    # 9 requests on m-a at 4 a replica: two more, at once.
    await usage(store, mirror, elector, loads={"m-a": 9})
    assert [r.id for r in (await applied(rec, mirror)).plan.create] == ["m-b", "m-c"]
    # The load goes while they load (their load unknown): held, however long.
    await usage(store, mirror, elector, loads={"m-a": 0})
    clock.now += 100
    assert (await applied(rec, mirror)).plan.empty
    await status(store, mirror, "m-b", "ready")
    await status(store, mirror, "m-c", "ready")
    # One ready replica's load unreported (a poll that failed): held.
    await usage(store, mirror, elector, loads={"m-a": 0, "m-b": 0})
    clock.now += 100
    assert (await applied(rec, mirror)).plan.empty

    # Every load known and low (3 at 4 a replica: one is enough): one
    # replica goes after the window, the least loaded.
    await usage(store, mirror, elector, loads={"m-a": 2, "m-b": 0, "m-c": 1})
    assert (await applied(rec, mirror)).plan.empty
    clock.now += 29.9
    assert (await applied(rec, mirror)).plan.empty
    clock.now += 0.1
    assert (await applied(rec, mirror)).plan.drain == ["m-b"]
    # The next waits a window of its own.
    await usage(store, mirror, elector, loads={"m-a": 2, "m-c": 1})
    clock.now += 29.9
    assert (await applied(rec, mirror)).plan.empty
    clock.now += 0.1
    assert (await applied(rec, mirror)).plan.drain == ["m-c"]
    clock.now += 100
    assert (await applied(rec, mirror)).plan.empty  # at min: stays

    # A burst in the window's middle starts it again; load rising places at once.
    await usage(store, mirror, elector, loads={"m-a": 5})
    assert [r.id for r in (await applied(rec, mirror)).plan.create] == ["m-d"]
    await status(store, mirror, "m-d", "ready")
    await usage(store, mirror, elector, loads={"m-a": 1, "m-d": 1})
    clock.now += 20
    assert (await applied(rec, mirror)).plan.empty
    await usage(store, mirror, elector, loads={"m-a": 5, "m-d": 1})
    assert (await applied(rec, mirror)).plan.empty
    await usage(store, mirror, elector, loads={"m-a": 1, "m-d": 1})
    assert (await applied(rec, mirror)).plan.empty
    clock.now += 20
    assert (await applied(rec, mirror)).plan.empty  # 20 s since the burst, not 40
    clock.now += 10
    assert (await applied(rec, mirror)).plan.drain == ["m-d"]  # a tie: by name


# --- the election that gates it ----------------------------------------------------------


async def test_a_gateway_campaigns_only_when_its_mirror_shows_no_leader(
    parts: tuple[EmbeddedStore, Mirror, Elector],
) -> None:
    store, mirror, a = parts
    b = Elector(store, s.GatewayInfo(id="gw-b", url="u", version="t", started=0), ttl=10,
                mirror=mirror)
    txns = 0
    real_txn = store.txn

    async def counting_txn(*args: Any, **kw: Any) -> Any:
        nonlocal txns
        txns += 1
        return await real_txn(*args, **kw)

    store.txn = counting_txn  # type: ignore[method-assign]
    assert (await a.tick()).is_leader
    assert await mirror.wait_for(a.lead_revision, 2)
    txns = 0
    for _ in range(5):
        assert not (await b.tick()).is_leader
    assert txns == 0  # renewals only: it sees a leader
    await a.resign()  # the leader key goes with a's lease
    assert await mirror.wait_for((await store.range("")).revision, 2)
    assert (await b.tick()).is_leader
    assert txns == 1
    # Leading, it does not campaign either.
    assert await mirror.wait_for(b.lead_revision, 2)
    assert (await b.tick()).is_leader and txns == 1


async def test_a_renewal_does_not_wait_behind_a_campaign(
    parts: tuple[EmbeddedStore, Mirror, Elector],
) -> None:
    store, mirror, _ = parts
    clock = Clock(0.0)
    b = Elector(store, s.GatewayInfo(id="gw-b", url="u", version="t", started=0), ttl=10,
                clock=clock, mirror=mirror)
    await b.renew()
    stuck = asyncio.Event()
    real_txn = store.txn

    async def slow_txn(*args: Any, **kw: Any) -> Any:
        await stuck.wait()  # a campaign stuck on a slow store
        return await real_txn(*args, **kw)

    store.txn = slow_txn  # type: ignore[method-assign]
    campaign = asyncio.create_task(b.campaign())
    await asyncio.sleep(0)
    clock.now = 7.0
    async with asyncio.timeout(2):
        await b.renew()  # goes through while the campaign hangs
    assert b._renewed_at == 7.0
    stuck.set()
    await campaign
    assert b.is_leader


def test_lease_ttl_election_interval_and_etcd_timeout_are_checked_together(
    tmp_path: Path,
) -> None:
    etcd = {"etcd_endpoints": "127.0.0.1:2379", "secret": "s" * 20, "admin_token": "a" * 20}
    with pytest.raises(ValidationError, match=r"LLMGW_LEASE_TTL \(1 s\).*3 x "
                                              r"LLMGW_ELECTION_INTERVAL \(0.5 s\)"):
        Settings(data_dir=tmp_path, lease_ttl=1)
    with pytest.raises(ValidationError, match=r"LLMGW_LEASE_TTL \(4 s\).*2 x "
                                              r"LLMGW_ETCD_TIMEOUT \(5.0 s\)"):
        Settings(data_dir=tmp_path, lease_ttl=4, **etcd)
    with pytest.raises(ValidationError, match=r"LLMGW_DRAIN_SECONDS \(600.0 s\) must exceed "
                                              r"LLMGW_REQUEST_TIMEOUT \(600.0 s\)"):
        Settings(data_dir=tmp_path, drain_seconds=600)
    # A held lease is renewed every fifth of its TTL, never more often than
    # the election interval.
    assert Settings(data_dir=tmp_path).renew_interval == 2.0
    assert Settings(data_dir=tmp_path, lease_ttl=3).renew_interval == 0.6
    assert Settings(data_dir=tmp_path, lease_ttl=3, election_interval=1).renew_interval == 1.0
    # The defaults, and what the tests run with, hold.
    Settings(data_dir=tmp_path)
    Settings(data_dir=tmp_path, **etcd)
    Settings(data_dir=tmp_path, lease_ttl=4, etcd_timeout=2, **etcd)
    Settings(data_dir=tmp_path, etcd_timeout=0.3, **etcd)


async def test_a_replica_given_up_on_is_placed_again_with_a_doubling_backoff(
    parts: tuple[EmbeddedStore, Mirror, Elector],
) -> None:
    store, mirror, elector = parts
    wall = Clock(1000.0)
    suffixes = iter(f"{i:04d}" for i in range(100))
    rec = Reconciler(store, mirror, elector, ReconcileSettings(
            drain_seconds=0.0, interval=1, node_grace=30, new_suffix=lambda: next(suffixes)),
            wall=wall)
    for node in ("n1", "n2"):
        await put(store, mirror, s.NODES + node, s.NodeInfo(
            name=node, gpus=[s.GpuInfo(index=0)], engines=["vllm"]))
    await put(store, mirror, s.MODELS + "m", s.StoredModel(name="m", model="w", gpus=1))
    assert (await elector.tick()).is_leader
    assert await mirror.wait_for(elector.lead_revision, 2)
    (first,) = (await applied(rec, mirror)).plan.create

    async def give_up(rid: str, node: str) -> None:
        await put(store, mirror, s.STATUS + rid, s.ReplicaStatus(
            id=rid, node=node, phase="failed", given_up=True, updated=wall.now))

    await give_up(first.id, first.node)
    # The first time: at once, on the other node.
    p = (await applied(rec, mirror)).plan
    assert p.drain == [first.id]
    (second,) = p.create
    assert second.node != first.node
    await applied(rec, mirror)  # the drained one goes (nothing in flight: cap 0 s)
    # It dies there too: the next try waits 30 s from its death.
    wall.now = 1010.0
    await give_up(second.id, second.node)
    assert (await rec.tick()).plan.drain == []
    wall.now = 1039.0
    assert (await rec.tick()).plan.drain == []
    wall.now = 1040.0
    assert (await applied(rec, mirror)).plan.drain == [second.id]
