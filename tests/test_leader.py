"""Election and fencing, driven one step at a time with an injected clock."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from app.control import state as s
from app.control.leader import Elector, NotLeader
from app.store.base import Compare, Op, Put, Store, StoreUnavailable, TxnResult
from app.store.embedded import EmbeddedStore
from app.store.etcd.store import EtcdStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["embedded", "etcd"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    if request.param == "embedded":
        st: Store = await EmbeddedStore.open(tmp_path / "state.db")
    else:
        server = request.getfixturevalue("etcd_server")
        st = await EtcdStore.open([server.endpoint], request.getfixturevalue("etcd_prefix"))
    try:
        yield st
    finally:
        await st.close()


def gateway(name: str) -> s.GatewayInfo:
    return s.GatewayInfo(id=name, url=f"http://{name}", version="test", started=0)


async def test_one_leader_then_a_fenced_write_from_the_old_one_is_refused(store: Store) -> None:
    clock = Clock()
    a = Elector(store, gateway("a"), ttl=10, clock=clock)
    b = Elector(store, gateway("b"), ttl=10, clock=clock)

    assert (await a.tick()).is_leader
    assert not (await b.tick()).is_leader
    assert a.is_leader and not b.is_leader
    stale_fence = a.fence()
    ok = await store.txn(stale_fence, [Put(s.REPLICAS + "r1", b"{}")])
    assert ok.succeeded

    # A pauses past its TTL: it stops acting as leader on its own clock...
    clock.now += 9
    assert not a.is_leader
    with pytest.raises(NotLeader):
        a.fence()
    # ...its lease ends in the store, and B takes over.
    await store.revoke(a.lease)
    step = await b.tick()
    assert step.is_leader and step.leader_changed

    # A write A prepared while it led is refused by the store itself.
    refused = await store.txn(stale_fence, [Put(s.REPLICAS + "r2", b"{}")])
    assert not refused.succeeded
    assert await store.get(s.REPLICAS + "r2") is None

    # A comes back, finds its lease gone, and campaigns as a follower.
    step = await a.tick()
    assert not step.is_leader
    assert (await store.get(s.LEADER)) is not None


async def test_resign_frees_the_leader_key_at_once(store: Store) -> None:
    clock = Clock()
    a = Elector(store, gateway("a"), ttl=10, clock=clock)
    b = Elector(store, gateway("b"), ttl=10, clock=clock)
    await a.tick()
    await b.tick()
    assert a.is_leader
    await a.resign()
    assert await store.get(s.GATEWAYS + "a") is None
    assert (await b.tick()).is_leader


class LostAnswers:
    """A store whose next transaction is applied but its answer lost, as
    when the connection drops right after etcd committed it."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.lose_next = False

    async def txn(self, compares: Sequence[Compare], success: Sequence[Op],
                  failure: Sequence[Op] = ()) -> TxnResult:
        result = await self.inner.txn(compares, success, failure)
        if self.lose_next:
            self.lose_next = False
            raise StoreUnavailable("answer lost")
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_lead_revision_is_the_create_revision_of_our_leader_key(store: Store) -> None:
    clock = Clock()
    flaky = LostAnswers(store)
    a = Elector(flaky, gateway("a"), ttl=10, clock=clock)  # type: ignore[arg-type]
    b = Elector(store, gateway("b"), ttl=10, clock=clock)
    assert (await b.tick()).is_leader
    won = await store.get(s.LEADER)
    assert won is not None and b.lead_revision == won.create_revision
    assert (await a.tick()).is_leader is False and a.lead_revision == 0

    await b.resign()
    assert b.lead_revision == 0
    # A wins, but the answer is lost: it finds the key bound to its lease.
    flaky.lose_next = True
    assert not (await a.tick()).is_leader
    found = await store.get(s.LEADER)
    assert found is not None and found.lease == a.lease
    assert (await a.tick()).is_leader
    assert a.lead_revision == found.create_revision > won.create_revision
