"""The router as the control plane reads it: when each model was last
asked for (`LastUse`, the proxy's request observer) and what the usage
publisher snapshots (`RouterUsage`, app/control/usage.py's `UsageSource`).
Wiring, like publish.py: neither side imports the other."""

from __future__ import annotations

import time
from collections.abc import Callable

from app.control.usage import Queue
from app.gateway.publish import Publisher
from app.router.outcome import Outcome
from app.router.table import RouteTable


class LastUse:
    """One of the proxy's request observers (app/gateway/observers.py):
    notes when each model was last asked for (at the request's end, so a
    long stream counts until it ends). On the request path: one dict write."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self._wall = wall
        self.by_model: dict[str, float] = {}

    def observe(self, outcome: Outcome) -> None:
        # Every request that named a catalog model counts, a 503 for want of
        # a replica included: it asked for the model (docs/design/control-plane.md, "Reconciler").
        # An unknown model's label is dropped by the snapshot,
        # which keeps catalog models only.
        self.by_model[outcome.model] = self._wall()

    def prompt_counted(self, model: str, tokens: int) -> None:
        pass  # a use was noted at the request's end

    def continued(self, model: str, outcome: str) -> None:
        pass


class RouterUsage:
    """The router as the usage publisher reads it (app/control/usage.py's
    `UsageSource`)."""

    def __init__(self, table: RouteTable, last_use: LastUse, publisher: Publisher) -> None:
        self._table = table
        self._last_use = last_use
        self._publisher = publisher

    def inflight_by_replica(self) -> dict[str, int]:
        return self._table.inflight_by_replica()

    def last_used_by_model(self) -> dict[str, float]:
        return dict(self._last_use.by_model)

    def held_by_model(self) -> dict[str, int]:
        return self._table.held()

    def routed_revision(self) -> int:
        return self._publisher.published_revision

    def engine_loads(self) -> dict[str, float]:
        # Waiting requests count as load: they are what another replica would take.
        return {rid: load.running + load.waiting
                for rid, load in self._table.fresh_loads().items()}

    def engine_queues(self) -> dict[str, Queue]:
        return {rid: Queue(load.waiting, load.kv_cache)
                for rid, load in self._table.fresh_loads().items()}

    def adapter_inflight(self) -> dict[str, int]:
        return self._table.adapter_inflight()
