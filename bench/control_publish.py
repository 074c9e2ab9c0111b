"""bench/control_scale.py's publish: what a gateway's router waits behind
when the fleet changes. A `Mirror` loaded with the 10,000-node fleet (from
watch events, as a gateway's is, then frozen for the collector as
app/gateway/main.py does), a `Publisher` on it; then, one at a time, a
status report, a node's inventory and a catalog edit, each applied and
published on the event loop, timed (median of `repeat` each).

`publish_stream()`: agents' reports streaming in (`rate` a second, each
its own watch batch, as 10,000 agents' ~300 writes a second arrive), the
publisher scheduling itself as a gateway's does: with publishing's share of
the loop bounded (`Publisher.share`, the default) and unbounded (share 1: a
publish at every change, as before), side by side. A probe on the loop
measures what a request would wait behind it (its lag past a 10 ms sleep).

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


def loaded(f: Any) -> Mirror:
    """A mirror holding the fleet `f` (a control_scale.Fleet)."""
    events = [Event("put", prefix + k, v.model_dump_json().encode(), 1, create_revision=1)
              for prefix, values in ((s.MODELS, f.models), (s.NODES, f.nodes),
                                     (s.REPLICAS, f.replicas), (s.STATUS, f.statuses))
              for k, v in values.items()]
    mirror = Mirror(None)  # type: ignore[arg-type]  # apply() touches no store
    mirror.apply(WatchBatch(events, 1))
    return mirror


def publish_stream(f: Any, rate: float = 300.0, seconds: float = 3.0,
                   ) -> dict[str, dict[str, float]]:
    """Per share ("bounded", "unbounded"): publishes a second, the share of
    the loop spent publishing, and the probe's lag p99 and max (ms)."""
    mirror = loaded(f)
    ids = sorted(f.statuses)

    async def run() -> dict[str, dict[str, float]]:
        publisher = Publisher(mirror, RouteTable(), SecretRing("bench-secret-" + "0" * 24))
        publisher.publish()
        gc.collect()
        gc.freeze()
        loop = asyncio.get_running_loop()
        out: dict[str, dict[str, float]] = {}
        revision = 2
        spent = [0.0, 0]
        inner = publisher.publish

        def timed() -> bool:
            start = time.perf_counter()
            try:
                return inner()
            finally:
                spent[0] += time.perf_counter() - start
                spent[1] += 1

        publisher.publish = timed  # type: ignore[method-assign]
        for name, share in (("unbounded", 1.0), ("bounded", publisher.share)):
            publisher.share = share
            inner()  # its wait after this publish is at this share's
            spent[:] = [0.0, 0]
            lags: list[float] = []
            began = loop.time()
            end = began + seconds

            revision = await _feed(mirror, f, ids, rate, began, end, revision, lags)
            await asyncio.sleep(1.0)  # the last publish, out of the next run's figures
            lags.sort()
            out[name] = {"publishes_per_s": spent[1] / seconds, "loop_share": spent[0] / seconds,
                         "lag_p99_ms": lags[int(0.99 * (len(lags) - 1))],
                         "lag_max_ms": lags[-1]}
        gc.unfreeze()
        return out

    return asyncio.run(run())


async def _feed(mirror: Mirror, f: Any, ids: list[str], rate: float, began: float,
                end: float, revision: int, lags: list[float]) -> int:
    """Status reports at `rate` a second until `end`, each its own batch, and
    beside them a probe's lag past 10 ms sleeps into `lags`; the next revision."""
    loop = asyncio.get_running_loop()

    async def probe() -> None:
        while loop.time() < end:
            at = loop.time()
            await asyncio.sleep(0.01)
            lags.append((loop.time() - at - 0.01) * 1000)

    async def feed() -> int:
        i, rev = 0, revision
        while loop.time() < end:
            mirror.apply(put(*report(f, ids[i % len(ids)], i), rev))
            rev += 1
            i += 1
            await asyncio.sleep(max(0.0, began + i / rate - loop.time()))
        return rev

    _, rev = await asyncio.gather(probe(), feed())
    return rev


def report(f: Any, rid: str, i: int) -> tuple[str, bytes]:
    """Replica `rid`'s status, its detail changed (its agent's `i`th report)."""
    v = f.statuses[rid].model_copy(update={"detail": f"report {i}"})
    return s.STATUS + rid, v.model_dump_json().encode()


def put(key: str, value: bytes, revision: int) -> WatchBatch:
    """One put, a watch batch of its own."""
    return WatchBatch([Event("put", key, value, revision, create_revision=1)], revision)


def publish_times(f: Any, repeat: int = 5) -> dict[str, float]:
    """Median ms of apply + publish per kind of change; `f`: a control_scale.Fleet."""
    mirror = loaded(f)
    status_id, node, model = sorted(f.statuses)[7], sorted(f.nodes)[7], sorted(f.models)[7]

    def changed(kind: str, i: int) -> tuple[str, bytes]:
        if kind == "status":
            return report(f, status_id, i)
        if kind == "node":
            v: Any = f.nodes[node].model_copy(update={"memory_mib": 1000 + i})
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
                mirror.apply(put(key, value, revision))
                publisher.publish()
                times.append((time.perf_counter() - start) * 1000)
                revision += 1
            out[kind] = statistics.median(times)
        gc.unfreeze()
        return out

    return asyncio.run(run())
