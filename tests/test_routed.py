"""A publish works out again only the replicas a change touched
(app/gateway/replica_endpoints.py): through random batches of changes (statuses,
drains, moves, deletions, models edited and removed, nodes gone and back,
node graces ending), a publisher told the changed keys routes exactly what
one that walks every replica routes, and works out far fewer replicas."""

from __future__ import annotations

import random

import pytest

from app.control import state as s
from app.control.keys import SecretRing
from app.control.mirror import Mirror
from app.gateway.publish import Publisher, Timing
from app.gateway.replica_endpoints import ReplicaEndpoints
from app.router.table import RouteTable
from app.store.base import Event, WatchBatch
from tests.support.proxy_rig import FakeClock

NODES = [f"n{i}" for i in range(6)]
MODELS = [f"m{i}" for i in range(5)]
PHASES = ["starting", "ready", "ready", "ready", "failed", "stopped"]


def _model(rng: random.Random, name: str) -> s.StoredModel:
    return s.StoredModel.model_validate({
        "name": name, "model": "w", "aliases": [f"{name}-{rng.randrange(3)}"],
        "profiles": [{"name": "p", "gpus": 1, "priority": rng.randrange(2)}]})


def _replica(rng: random.Random, rid: str, model: str | None = None) -> s.Replica:
    return s.Replica(id=rid, model=model or rng.choice(MODELS), node=rng.choice(NODES),
                     weights="w", profile="p",
                     draining_since=1.0 if rng.random() < 0.15 else None)


def _status(rng: random.Random, rid: str, node: str) -> s.ReplicaStatus:
    return s.ReplicaStatus(id=rid, node=node, phase=rng.choice(PHASES),  # type: ignore[arg-type]
                           url=f"http://10.0.0.1:{rng.randrange(8000, 8003)}",
                           detail=rng.choice(["", "oom"]))


def _put(key: str, value: s.BaseModel, rev: int) -> Event:
    return Event("put", key, value.model_dump_json().encode(), rev, create_revision=1)


def _changes(rng: random.Random, mirror: Mirror, rev: int, clock: FakeClock) -> list[Event]:
    replicas = mirror.replicas()
    events: list[Event] = []
    for _ in range(rng.randint(1, 4)):
        roll = rng.random()
        rid = rng.choice(sorted(replicas)) if replicas else "r-new"
        rep = replicas.get(rid)
        if roll < 0.35 and rep is not None:
            events.append(_put(s.STATUS + rid, _status(rng, rid, rep.node), rev))
        elif roll < 0.45:
            events.append(Event("delete", s.STATUS + rid, b"", rev))
        elif roll < 0.6:
            new = f"r{rng.randrange(40)}"
            events.append(_put(s.REPLICAS + new, _replica(rng, new), rev))
        elif roll < 0.65:
            events.append(Event("delete", s.REPLICAS + rid, b"", rev))
        elif roll < 0.75:
            name = rng.choice(MODELS)
            events.append(_put(s.MODELS + name, _model(rng, name), rev))
        elif roll < 0.8:
            events.append(Event("delete", s.MODELS + rng.choice(MODELS), b"", rev))
        elif roll < 0.9:
            events.append(Event("delete", s.NODES + rng.choice(NODES), b"", rev))
        elif roll < 0.97:
            name = rng.choice(NODES)
            events.append(_put(s.NODES + name, s.NodeInfo(
                name=name, memory_mib=rng.randrange(1000)), rev))
        else:
            clock.now += 4.0  # some nodes' grace ends
    return events


@pytest.mark.parametrize("seed", range(6))
async def test_a_publish_told_the_changed_keys_routes_what_a_full_walk_does(
    seed: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(seed)
    clock = FakeClock()
    mirror = Mirror(None)  # type: ignore[arg-type]  # apply() touches no store
    start = [_put(s.NODES + n, s.NodeInfo(name=n), 1) for n in NODES]
    start += [_put(s.MODELS + m, _model(rng, m), 1) for m in MODELS]
    for i in range(20):
        rep = _replica(rng, f"r{i}")
        start += [_put(s.REPLICAS + rep.id, rep, 1), _put(s.STATUS + rep.id,
                                                          _status(rng, rep.id, rep.node), 1)]
    mirror.apply(WatchBatch(start, 1))
    secrets = SecretRing("routed-test-secret-0123456789")
    told = Publisher(mirror, RouteTable(), secrets,
                     timing=Timing(node_grace=6.0, clock=clock, timer=lambda: 0.0))
    walks = Publisher(mirror, RouteTable(), secrets,
                      timing=Timing(node_grace=6.0, clock=clock, timer=lambda: 0.0))
    worked = {"told": 0, "walks": 0}
    counting = "told"
    real = ReplicaEndpoints._outcome

    def outcome(self: ReplicaEndpoints, *args: object, **kwargs: object) -> object:
        worked[counting] += 1
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ReplicaEndpoints, "_outcome", outcome)
    rev = 2
    for _ in range(150):
        assert mirror.apply(WatchBatch(_changes(rng, mirror, rev, clock), rev))
        rev += 1
        # Both publish now (each cancels the publish the change scheduled).
        counting = "told"
        told.publish()
        counting = "walks"
        walks._routed.walk_all()
        walks.publish()
        assert told._last == walks._last
        for m in MODELS:
            assert told._table.endpoints(m) == walks._table.endpoints(m)
            assert told._table.unavailable(m) == walks._table.unavailable(m)
    routable = sum(len(told._table.endpoints(m)) for m in MODELS)
    print(f"seed {seed}: {routable} routed at the end; replicas worked out: "
          f"told {worked['told']}, walking every one {worked['walks']}")
    assert worked["told"] * 3 < worked["walks"]
