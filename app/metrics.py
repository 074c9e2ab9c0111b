"""The gateway's Prometheus metrics (`GET /metrics`).

Each gateway has a registry of its own (no global one), so a process can hold
several gateways. Per-request figures are counted on the request path as the
proxy reports them (`RequestObserver`); the fleet's state is read from the
mirror when Prometheus scrapes, so it costs nothing between scrapes.

Every gateway reports the whole fleet as its mirror sees it; sum requests
over gateways, but take the state gauges from any one of them.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.control.scaling import wanted_now
from app.control.state import Replica, replica_phase

if TYPE_CHECKING:
    from app.gateway import Gateway

# Whole-request durations: plain answers take tenths of seconds, long
# generations minutes.
_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self, gw: Gateway) -> None:
        # No auto-describe: it would collect at registration, before the gateway runs.
        self.registry = CollectorRegistry(auto_describe=False)
        self._requests = Counter(
            "llmgw_requests", "OpenAI API requests forwarded by this gateway, by status",
            ["model", "code"], registry=self.registry,
        )
        self._seconds = Histogram(
            "llmgw_request_duration_seconds",
            "Time from a request's arrival to the end of its answer (streams included)",
            ["model"], buckets=_BUCKETS, registry=self.registry,
        )
        self.registry.register(_FleetCollector(gw))
        # Labelled children, kept: `labels()` locks and builds a key each call.
        self._counted: dict[tuple[str, int], Any] = {}
        self._timed: dict[str, Any] = {}

    def observe(self, model: str, status: int, seconds: float) -> None:
        """`RequestObserver` for the proxy; on the request path, so cheap."""
        counter = self._counted.get((model, status))
        if counter is None:
            counter = self._counted[model, status] = self._requests.labels(model, str(status))
        counter.inc()
        timer = self._timed.get(model)
        if timer is None:
            timer = self._timed[model] = self._seconds.labels(model)
        timer.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _FleetCollector(Collector):
    """The fleet as this gateway's mirror sees it, read at scrape time."""

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw

    def collect(self) -> Iterator[Metric]:
        gw = self._gw
        leader = GaugeMetricFamily("llmgw_leader", "1 while this gateway leads")
        ready = GaugeMetricFamily("llmgw_mirror_ready", "1 once the state mirror is loaded")
        yield _store_nospace(gw)
        if not gw.ready:
            leader.add_metric([], 0)
            ready.add_metric([], 0)
            yield from (leader, ready)
            return
        mirror = gw.mirror
        leader.add_metric([], 1 if gw.elector.is_leader else 0)
        ready.add_metric([], 1)
        revision = GaugeMetricFamily("llmgw_mirror_revision", "Store revision the mirror holds")
        revision.add_metric([], mirror.revision)

        models = mirror.models()
        replicas = mirror.replicas()
        statuses = mirror.statuses()
        nodes = mirror.nodes()
        phases: Tally[tuple[str, str]] = Tally()
        inflight = GaugeMetricFamily(
            "llmgw_replica_inflight", "Requests this gateway has in flight on each replica",
            labels=["model", "replica"])
        for rid, rep in replicas.items():
            phases[rep.model, replica_phase(rep, statuses.get(rid), rep.node in nodes)] += 1
            inflight.add_metric([rep.model, rid], gw.table.inflight(rid))
        by_phase = GaugeMetricFamily("llmgw_replicas", "Replicas by model and phase",
                                     labels=["model", "phase"])
        for (model, phase), n in sorted(phases.items()):
            by_phase.add_metric([model, phase], n)
        wanted = GaugeMetricFamily(
            "llmgw_replicas_wanted", "Replicas each model wants now: its floor (min, or "
            "one while a min-0 model is in use) raised by its engines' load",
            labels=["model"])
        usages = mirror.usages()
        settings = gw.settings
        now = time.time()
        # One pass over the replicas, not one per model.
        serving: dict[str, list[Replica]] = {}
        for rep in replicas.values():
            if rep.draining_since is None:
                serving.setdefault(rep.model, []).append(rep)
        for name, spec in sorted(models.items()):
            wanted.add_metric([name], wanted_now(
                spec, serving.get(name, []), usages, now,
                settings.usage_refresh + settings.usage_interval, settings.default_load_target))

        nodes = mirror.nodes()
        gpus = GaugeMetricFamily("llmgw_node_gpus", "GPUs each live node reports",
                                 labels=["node"])
        for name, node in sorted(nodes.items()):
            gpus.add_metric([name], len(node.gpus))
        yield from (leader, ready, revision, by_phase, wanted, inflight, gpus)
        yield from _engine_loads(gw, replicas)


def _store_nospace(gw: Gateway) -> Metric:
    """1 while the store refuses writes for lack of space (etcd's NOSPACE
    alarm): alert on it, since the fleet cannot change until an operator
    acts (docs/architecture.md, A month of uptime)."""
    nospace = GaugeMetricFamily("llmgw_store_nospace", "1 while the store (etcd) refuses "
                                "writes for lack of space: its NOSPACE alarm is raised")
    nospace.add_metric([], 1 if gw.started and gw.store.health().state == "nospace" else 0)
    return nospace


def _engine_loads(gw: Gateway, replicas: Mapping[str, Replica]) -> Iterator[Metric]:
    """Each engine's own counts as this gateway last polled them (fresh ones
    only: a stale count is unknown, not zero). The same on every gateway."""
    running = GaugeMetricFamily("llmgw_engine_running", "Requests an engine runs (its "
                                "/metrics), by model and replica", labels=["model", "replica"])
    waiting = GaugeMetricFamily("llmgw_engine_waiting", "Requests waiting in an engine",
                                labels=["model", "replica"])
    kv = GaugeMetricFamily("llmgw_engine_kv_cache_usage", "An engine's KV-cache use, 0 to 1",
                           labels=["model", "replica"])
    for rid, load in sorted(gw.table.fresh_loads().items()):
        rep = replicas.get(rid)
        if rep is None:
            continue
        running.add_metric([rep.model, rid], load.running)
        waiting.add_metric([rep.model, rid], load.waiting)
        kv.add_metric([rep.model, rid], load.kv_cache)
    yield from (running, waiting, kv)
