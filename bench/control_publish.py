"""bench/control_scale.py's publish: what a gateway's router waits behind
when the fleet changes. A `Mirror` loaded with the 10,000-node fleet (from
watch events, as a gateway's is, then frozen for the collector as
app/gateway/main.py does), a `Publisher` on it; then, one at a time, a
status report, a node's inventory and a catalog edit, each applied and
published on the event loop, timed (median of `repeat` each).

Before (2026-12-02): every change rebuilt the view it touched (20,000
statuses parsed anew per report) and the publish read every replica's
fields again: 260-500 ms on the event loop per change at 10,000 nodes.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
from typing import Any

from app.control import state as s
from app.control.keys import SecretRing
from app.control.mirror import Mirror
from app.gateway.publish import Publisher
from app.router.table import RouteTable
from app.store.base import Event, WatchBatch


def publish_times(f: Any, repeat: int = 5) -> dict[str, float]:
    """Median ms of apply + publish per kind of change; `f`: a control_scale.Fleet."""
    events = [Event("put", prefix + k, v.model_dump_json().encode(), 1, create_revision=1)
              for prefix, values in ((s.MODELS, f.models), (s.NODES, f.nodes),
                                     (s.REPLICAS, f.replicas), (s.STATUS, f.statuses))
              for k, v in values.items()]
    mirror = Mirror(None)  # type: ignore[arg-type]  # apply() touches no store
    mirror.apply(WatchBatch(events, 1))
    del events
    status_id, node, model = sorted(f.statuses)[7], sorted(f.nodes)[7], sorted(f.models)[7]

    def changed(kind: str, i: int) -> tuple[str, bytes]:
        if kind == "status":
            v: Any = f.statuses[status_id].model_copy(update={"detail": f"report {i}"})
            return s.STATUS + status_id, v.model_dump_json().encode()
        if kind == "node":
            v = f.nodes[node].model_copy(update={"memory_mib": 1000 + i})
            return s.NODES + node, v.model_dump_json().encode()
        v = f.models[model].model_copy(update={"aliases": [f"edit-{i}"]})
        return s.MODELS + model, v.model_dump_json().encode()

    async def run() -> dict[str, float]:
        publisher = Publisher(mirror, RouteTable(), SecretRing("bench-secret-" + "0" * 24))
        publisher.publish()
        gc.collect()
        gc.freeze()
        out: dict[str, float] = {}
        revision = 2
        for kind in ("status", "node", "catalog edit"):
            times = []
            for i in range(repeat):
                key, value = changed(kind, i)
                start = time.perf_counter()
                mirror.apply(WatchBatch([Event("put", key, value, revision,
                                               create_revision=1)], revision))
                publisher.publish()
                times.append((time.perf_counter() - start) * 1000)
                revision += 1
            out[kind] = statistics.median(times)
        gc.unfreeze()
        return out

    return asyncio.run(run())
