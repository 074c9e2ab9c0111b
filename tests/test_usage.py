"""Usage snapshots: the publisher's step with an injected clock, and the
leader's reading of them."""

from __future__ import annotations

from app.control import state as s
from app.control.mirror import Mirror
from app.control.usage import Queue, UsagePublisher, drain_inflight, last_used
from app.gateway.observers import Observers
from app.gateway.router_usage import LastUse
from app.router.outcome import Outcome
from app.store.embedded import EmbeddedStore


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Source:
    """The router's side, as plain values a test sets."""

    def __init__(self) -> None:
        self.inflight: dict[str, int] = {}
        self.used: dict[str, float] = {}
        self.held: dict[str, int] = {}
        self.revision = 0

    def inflight_by_replica(self) -> dict[str, int]:
        return dict(self.inflight)

    def last_used_by_model(self) -> dict[str, float]:
        return dict(self.used)

    def routed_revision(self) -> int:
        return self.revision

    def held_by_model(self) -> dict[str, int]:
        return dict(self.held)

    def engine_loads(self) -> dict[str, float]:
        return {}

    def engine_queues(self) -> dict[str, Queue]:
        return {}

    def adapter_inflight(self) -> dict[str, int]:
        return {}


async def put(store: EmbeddedStore, mirror: Mirror, key: str, value: s.BaseModel) -> int:
    rev = await store.put(key, value.model_dump_json().encode())
    assert await mirror.wait_for(rev, 2)
    return rev


async def stored(store: EmbeddedStore) -> s.Usage | None:
    kv = await store.get(s.USAGE + "gw")
    return None if kv is None else s.Usage.model_validate_json(kv.value)


async def test_a_snapshot_is_written_when_counts_change_and_last_use_at_most_every_refresh(
    parts: tuple[EmbeddedStore, Mirror],
) -> None:
    store, mirror = parts
    lease = await store.grant(10)
    wall = Clock(1000.0)
    src = Source()
    pub = UsagePublisher(store, mirror, src, "gw", lambda: lease, refresh=30, wall=wall)
    await put(store, mirror, s.MODELS + "m", s.StoredModel(name="m", model="org/m"))
    await put(store, mirror, s.REPLICAS + "r1", s.Replica(id="r1", model="m", node="n1",
                                                            weights="org/m"))

    assert await pub.step()  # the first one, even empty
    assert await stored(store) == s.Usage(gateway="gw", updated=1000.0)
    assert not await pub.step()  # unchanged: nothing written

    # A request begins: in flight, and its model in use now.
    src.inflight = {"r1": 1}
    wall.now += 2
    assert await pub.step()
    got = await stored(store)
    assert got is not None and got.inflight == {"r1": 1} and got.last_used == {"m": 1002.0}
    # Still running: its model's last use moves, but is written only after `refresh`.
    wall.now += 2
    assert not await pub.step()
    wall.now += 28
    assert await pub.step()
    got = await stored(store)
    assert got is not None and got.last_used == {"m": 1032.0}
    # It ends: the count goes at once; its end time is the last use.
    src.inflight, src.used = {}, {"m": 1033.0}
    wall.now += 2
    assert await pub.step()
    got = await stored(store)
    assert got is not None and got.inflight == {} and got.last_used == {"m": 1033.0}
    # A model outside the catalog (the proxy's "(unknown)" label) is left out.
    src.used["(unknown)"] = 1034.0
    assert not await pub.step()

    # Bound to the lease: revoked (a dead gateway), the snapshot is gone.
    await store.revoke(lease)
    assert await stored(store) is None


async def test_the_router_letting_go_of_a_drained_replica_is_written_at_once(
    parts: tuple[EmbeddedStore, Mirror],
) -> None:
    store, mirror = parts
    lease = await store.grant(10)
    src = Source()
    pub = UsagePublisher(store, mirror, src, "gw", lambda: lease, refresh=30,
                         wall=Clock(1000.0))
    rep = s.Replica(id="r1", model="m", node="n1", weights="org/m")
    await put(store, mirror, s.REPLICAS + "r1", rep)
    src.inflight = {"r1": 2}
    src.revision = mirror.revision
    assert await pub.step()
    drained_at = await put(store, mirror, s.REPLICAS + "r1",
                           rep.model_copy(update={"draining_since": 1000.0}))
    # The router has not republished yet: nothing new to say.
    assert not await pub.step()
    src.revision = drained_at
    assert await pub.step()
    got = await stored(store)
    assert got is not None and got.revision == drained_at and got.inflight == {"r1": 2}
    # The leader: both requests still in flight there.
    assert drain_inflight({"r1": drained_at}, ["gw"], {"gw": got}) == {"r1": 2}


def test_drain_inflight_counts_only_gateways_that_let_go_of_the_replica() -> None:
    a = s.Usage(gateway="a", revision=10, inflight={"r1": 1})
    b = s.Usage(gateway="b", revision=10)
    old = s.Usage(gateway="b", revision=9)
    assert drain_inflight({"r1": 10, "r2": 10}, ["a", "b"], {"a": a, "b": b}) == {
        "r1": 1, "r2": 0}
    # b has not written since the drain: it may still route to r1, so unknown.
    assert drain_inflight({"r1": 10}, ["a", "b"], {"a": a, "b": old}) == {}
    # A gateway with no snapshot at all: unknown too.
    assert drain_inflight({"r2": 10}, ["a", "b"], {"a": a}) == {}
    assert last_used({"a": s.Usage(gateway="a", last_used={"m": 5.0, "n": 1.0}),
                      "b": s.Usage(gateway="b", last_used={"m": 7.0})}) == {"m": 7.0, "n": 1.0}


def test_last_use_notes_each_request_and_passes_it_on() -> None:
    seen: list[tuple[object, ...]] = []

    class Then:
        def observe(self, outcome: Outcome) -> None:
            seen.append((outcome.model, outcome.status, outcome.seconds, outcome.first_byte,
                         outcome.prompt, outcome.completion))

        def prompt_counted(self, model: str, tokens: int) -> None:
            seen.append((model, tokens))

        def continued(self, model: str, outcome: str) -> None:
            seen.append((model, outcome))

    wall = Clock(5.0)
    lu = LastUse(wall=wall)
    told = Observers([lu, Then()])
    told.observe(Outcome("m", 200, 0.5, 0.2, 7, 3))
    wall.now = 9.0
    told.observe(Outcome("m", 503, 0.1))  # asked for, even unanswered: a use
    told.prompt_counted("m", 11)
    assert lu.by_model == {"m": 9.0}
    assert seen == [("m", 200, 0.5, 0.2, 7, 3), ("m", 503, 0.1, None, 0, 0), ("m", 11)]
