"""Usage snapshots: what each gateway's router is doing, for the leader.

Every few seconds each gateway writes `usage/{gateway}` (`state.Usage`):
requests in flight per replica, each replica's engine load (running +
waiting, as its router last polled it, and apart its waiting requests and
KV-cache use, which saturation reads), when each model was last asked for,
and the store revision its router tables reflected. The key is bound to the
gateway's election lease (`Elector.lease`), so a dead gateway's snapshot
goes with its lease. The leader reads the snapshots from its mirror to end
drains when the work is done, to stop idle models and to scale on load
(docs/design/control-plane.md, "Reconciler").

The request path never waits on this: the router only counts (its in-flight
leases, the proxy's request observer) and `UsagePublisher.step()` reads the
counts on its own schedule. A snapshot is written when the counts or the
engine loads changed or the router let go of a drained replica; last-use
times alone are written at most every `refresh` seconds, so a busy gateway
writes every few seconds, never per request.

The router is not imported here (DESIGN invariant 8): `UsageSource` is what
this side needs, and app/gateway/publish.py implements it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import NamedTuple, Protocol

from app.control import state as s
from app.control.mirror import Mirror
from app.store.base import Store, StoreError, StoreUnavailable

logger = logging.getLogger(__name__)

# A KV cache this full admits no more requests: the figure the router calls
# saturated too (app/router/choice.py, SATURATED_KV).
KV_FULL = 0.98


class Queue(NamedTuple):
    """A replica's engine queue as polled: requests waiting, KV-cache use (0 to 1)."""

    waiting: float
    kv: float


class UsageSource(Protocol):
    """A gateway's router, as the usage publisher reads it."""

    def inflight_by_replica(self) -> Mapping[str, int]:
        """Requests this gateway has in flight, per replica id (routed or not)."""
        ...

    def last_used_by_model(self) -> Mapping[str, float]:
        """Unix time of the last request for each model that ended here."""
        ...

    def routed_revision(self) -> int:
        """The mirror revision the router's tables were last rebuilt at."""
        ...

    def held_by_model(self) -> Mapping[str, int]:
        """Requests held here per model, waiting for a replica (scale from zero)."""
        ...

    def engine_loads(self) -> Mapping[str, float]:
        """Each replica's engine load (running + waiting requests), from
        polls fresh enough to route on; a replica left out is unknown."""
        ...

    def engine_queues(self) -> Mapping[str, Queue]:
        """The same polls' waiting requests and KV-cache use, per replica."""
        ...

    def adapter_inflight(self) -> Mapping[str, int]:
        """Requests this gateway has in flight per LoRA adapter."""
        ...


def drain_inflight(
    draining: Mapping[str, int],
    gateways: Collection[str],
    usages: Mapping[str, s.Usage],
) -> dict[str, int]:
    """Requests still in flight on each draining replica, over all gateways.

    `draining` maps a draining replica to the revision of its drain write.
    A replica is in the answer only when every gateway (those in `gateways/`
    and any with a snapshot) has written a snapshot at or past that revision:
    such a gateway routes nothing new to it, so its count can only fall. A
    gateway that has not yet done so may still be routing to it: the replica
    is left out (unknown), and the leader waits (until the drain cap).
    """
    everyone = set(gateways) | set(usages)
    out: dict[str, int] = {}
    for rid, drained_at in draining.items():
        total = 0
        for gw in everyone:
            u = usages.get(gw)
            if u is None or u.revision < drained_at:
                break
            total += u.inflight.get(rid, 0)
        else:
            out[rid] = total
    return out


def replica_loads(usages: Mapping[str, s.Usage],
                  without_metrics: Collection[str] = ()) -> dict[str, float]:
    """Each replica's engine load over every gateway's snapshot: the largest
    report, never their sum (every gateway polls the same engine, whose
    counts cover all of them). A replica no snapshot names is left out:
    unknown.

    `without_metrics` names replicas whose engine has no load gauges
    (llama-cpp-python's server): their load is the requests every gateway
    has in flight on them, summed (each gateway counts its own), 0 when
    none does; with at least one snapshot to go by."""
    out: dict[str, float] = {}
    for u in usages.values():
        for rid, load in u.loads.items():
            out[rid] = max(out.get(rid, load), load)
    if usages:
        for rid in without_metrics:
            out[rid] = float(sum(u.inflight.get(rid, 0) for u in usages.values()))
    return out


def replica_queues(usages: Mapping[str, s.Usage]) -> dict[str, Queue]:
    """Each replica's engine queue over every gateway's snapshot: the largest
    waiting count and KV-cache use reported (every gateway polls the same
    engine). A replica no snapshot gives a waiting count for is left out
    (unknown): snapshots written before these fields, engines without
    /metrics (llama.cpp)."""
    out: dict[str, Queue] = {}
    for u in usages.values():
        for rid, waiting in u.waiting.items():
            kv = u.kv_cache.get(rid, 0.0)
            old = out.get(rid)
            out[rid] = Queue(waiting, kv) if old is None else Queue(
                max(old.waiting, waiting), max(old.kv, kv))
    return out


def last_used(usages: Mapping[str, s.Usage]) -> dict[str, float]:
    """The latest use of each model over every gateway's snapshot."""
    out: dict[str, float] = {}
    for u in usages.values():
        for model, at in u.last_used.items():
            out[model] = max(out.get(model, at), at)
    return out


def _full(kv_cache: Mapping[str, float]) -> frozenset[str]:
    return frozenset(rid for rid, kv in kv_cache.items() if kv >= KV_FULL)


class UsagePublisher:
    """Writes this gateway's snapshot. `step()` is one look, `run()` repeats it."""

    def __init__(
        self,
        store: Store,
        mirror: Mirror,
        source: UsageSource,
        gateway_id: str,
        lease: Callable[[], int],
        *,
        refresh: float,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._mirror = mirror
        self._source = source
        self._gateway_id = gateway_id
        self._lease = lease  # the election lease: the snapshot dies with it
        self._refresh = refresh
        self._wall = wall
        self.written: s.Usage | None = None
        self._written_lease = 0
        self._let_go: frozenset[str] = frozenset()

    def snapshot(self) -> tuple[s.Usage, frozenset[str]]:
        """The snapshot as of now, and the drained replicas the router has let go of."""
        now = self._wall()
        revision = self._source.routed_revision()
        inflight = {rid: n for rid, n in self._source.inflight_by_replica().items() if n > 0}
        models = self._mirror.models()
        replicas = self._mirror.replicas()
        used = {m: at for m, at in self._source.last_used_by_model().items() if m in models}
        # A model with a request in flight (a long stream) is in use now,
        # however long ago that request began.
        for rid in inflight:
            if rid in replicas:
                used[replicas[rid].model] = now
        # A held request is a use now too: it is what asks the leader for a
        # replica of a model stopped while idle.
        held = {m: n for m, n in self._source.held_by_model().items() if m in models}
        for m in held:
            used[m] = now
        # A LoRA adapter's use is its base's: what keeps (or starts) the
        # replicas it is loaded on (docs/design/lora-adapters.md).
        for m, at in list(used.items()):
            adapter = spec.adapter if (spec := models.get(m)) is not None else None
            if adapter is not None and adapter.base in models:
                used[adapter.base] = max(used.get(adapter.base, 0.0), at)
        let_go = frozenset(
            rid for rid, r in replicas.items()
            if r.draining_since is not None
            and (kv := self._mirror.get(s.REPLICAS + rid)) is not None
            and kv.mod_revision <= revision)
        loads = {rid: load for rid, load in self._source.engine_loads().items()
                 if rid in replicas}
        queues = {rid: q for rid, q in self._source.engine_queues().items() if rid in replicas}
        return (s.Usage(gateway=self._gateway_id, revision=revision, inflight=inflight,
                        last_used=used, held=held, updated=now, loads=loads,
                        waiting={rid: q.waiting for rid, q in queues.items()},
                        kv_cache={rid: q.kv for rid, q in queues.items()},
                        adapters={a: n for a, n in self._source.adapter_inflight().items()
                                  if n > 0 and a in models}), let_go)

    def _due(self, usage: s.Usage, let_go: frozenset[str], lease: int) -> bool:
        old = self.written
        if old is None or lease != self._written_lease:
            return True  # never written, or written under a lease now gone
        if usage.held.keys() - old.held.keys():
            return True  # a model wanted now: the leader must hear at once
        if usage.inflight != old.inflight or let_go != self._let_go:
            # Drains wait on these: written at the next step.
            return True
        if usage.loads != old.loads or usage.waiting != old.waiting:
            return True  # scaling reads these; unchanged, the last ones still hold
        if _full(usage.kv_cache) != _full(old.kv_cache):
            # A generating engine's cache changes every poll: only reaching
            # the limit (or leaving it) is worth a write of its own.
            return True
        if usage.last_used.keys() - old.last_used.keys():
            return True  # a model used for the first time (or since a restart)
        # Last-use times alone: at most every `refresh` seconds (the leader
        # allows for that much lag before it calls a model idle).
        return usage.last_used != old.last_used and usage.updated - old.updated >= self._refresh

    async def step(self) -> bool:
        """Writes the snapshot if it is due; True when it wrote."""
        lease = self._lease()
        if lease == 0 or not self._mirror.ready:
            return False  # no lease to bind it to yet, or nothing to read
        usage, let_go = self.snapshot()
        if not self._due(usage, let_go, lease):
            return False
        await self._store.put(s.USAGE + self._gateway_id, usage.model_dump_json().encode(),
                              lease=lease)
        self.written, self._written_lease, self._let_go = usage, lease, let_go
        return True

    def newly_saturated(self) -> bool:
        """Whether an engine is saturated now (requests waiting, or its KV
        cache full) that the last snapshot written did not show so: the
        leader's saturation delay counts from when it hears, so this is
        worth a write before the usual interval (`run()` looks every second).
        Reads the router's counts only."""
        old = self.written
        if old is None:
            return False  # the first snapshot is written at the next step anyway
        return any((q.waiting > 0 and old.waiting.get(rid, 0) == 0)
                   or (q.kv >= KV_FULL and old.kv_cache.get(rid, 0.0) < KV_FULL)
                   for rid, q in self._source.engine_queues().items())

    async def run(self, interval: float, look: float = 1.0) -> None:
        """A step every `interval`, and one sooner when a look (every
        `look` seconds, no I/O) finds an engine newly saturated."""
        while True:
            try:
                await self.step()
            except StoreUnavailable as exc:
                logger.debug("usage snapshot not written: %s", exc)  # the store says so once
            except StoreError as exc:
                # A lease that just expired: the election grants a new one.
                logger.warning("usage snapshot not written: %s", exc)
            except Exception:
                logger.exception("usage snapshot crashed")
            waited = 0.0
            while waited < interval:
                await asyncio.sleep(min(look, interval - waited))
                waited += look
                if self.newly_saturated():
                    break
