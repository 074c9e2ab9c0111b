"""The gateway's Prometheus metrics (`GET /metrics`).

Each gateway has a registry of its own (no global one), so a process can hold
several gateways. Per-request figures are counted on the request path as the
proxy reports them (`RequestObserver`, app/gateway/request_metrics.py); the fleet's
state is read from the mirror when Prometheus scrapes, so it costs nothing
between scrapes.

Every gateway reports the whole fleet as its mirror sees it; sum requests
over gateways, but take the state gauges from any one of them.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app import compiled
from app.control import gpuhealth
from app.control.placement import fleet
from app.control.placement.placer import place_any, placer_of
from app.control.placement.verdict import NoFit
from app.control.plan.scaling import wanted_now
from app.control.state import LEADER, LeaderInfo, Replica, replica_phase
from app.gateway.gc_keeper import GcKeeper
from app.gateway.loop_lag import LoopLag
from app.gateway.request_metrics import RequestMetrics

if TYPE_CHECKING:
    from app.control.leader import Elector
    from app.control.mirror import Mirror
    from app.control.placement.agentversion import Window
    from app.gateway.settings import Settings
    from app.router.table import RouteTable
    from app.store.base import Store


class Observed(Protocol):
    """What the metrics read at scrape time. The gateway (app/gateway/gateway.py) is
    one; declared here so this module does not import the gateway that
    builds it (docs/architecture.md, "Folders: the packages")."""

    @property
    def ready(self) -> bool: ...

    @property
    def started(self) -> bool: ...

    @property
    def mirror(self) -> Mirror: ...

    @property
    def elector(self) -> Elector: ...

    @property
    def store(self) -> Store: ...

    @property
    def table(self) -> RouteTable: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def agent_window(self) -> Window: ...


class GatewayMetrics:
    def __init__(self, gw: Observed) -> None:
        # No auto-describe: it would collect at registration, before the gateway runs.
        self.registry = CollectorRegistry(auto_describe=False)
        # The proxy's `RequestObserver` (app/gateway/request_metrics.py).
        self.requests = RequestMetrics()
        # This process's event loop and collector (app/gateway/loop_lag.py);
        # under --workers, the scraped worker's own.
        self.loop = LoopLag()
        # Full collections kept off the mirror (app/gateway/gc_keeper.py).
        self.gc = GcKeeper()
        self._fleet = _FleetCollector(gw, lambda: self.gateway_id)
        # Under --workers: the gateway's id (its first worker's, the one that
        # campaigns), so that every worker says whether the gateway leads.
        self.gateway_id: str | None = None
        for collector in (self.requests, self.loop, self.gc, self._fleet):
            self.registry.register(collector)

    def leads(self) -> bool:
        """Whether the gateway leads (`llmgw_leader`; /admin/leader's
        `is_leader`), whichever of its workers is asked."""
        return self._fleet.leads()

    def render(self, requests: RequestMetrics | None = None) -> bytes:
        """The exposition; `requests`: request figures to show instead of
        this process's (under --workers, every worker's summed)."""
        if requests is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry(auto_describe=False)
        for collector in (requests, self.loop, self.gc, self._fleet):
            registry.register(collector)
        return generate_latest(registry)


class _FleetCollector(Collector):
    """The fleet as this gateway's mirror sees it, read at scrape time."""

    def __init__(self, gw: Observed, gateway_id: Callable[[], str | None]) -> None:
        self._gw = gw
        self._gateway_id = gateway_id

    def leads(self) -> bool:
        """This gateway holds the lead; under --workers, any of its workers
        (the first, which alone campaigns), whichever answers the scrape."""
        gw, of = self._gw, self._gateway_id()
        if of is None:
            return gw.elector.is_leader
        held = gw.mirror.one(LEADER, LeaderInfo)
        return held is not None and held.id == of

    def collect(self) -> Iterator[Metric]:
        gw = self._gw
        leader = GaugeMetricFamily("llmgw_leader", "1 while this gateway leads")
        ready = GaugeMetricFamily("llmgw_mirror_ready", "1 once the state mirror is loaded")
        yield _router_compiled()
        yield from _store_health(gw)
        if not gw.ready:
            leader.add_metric([], 0)
            ready.add_metric([], 0)
            yield from (leader, ready)
            return
        mirror = gw.mirror
        leader.add_metric([], 1 if self.leads() else 0)
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
        unplaceable = GaugeMetricFamily(
            "llmgw_model_unplaceable", "1 while a model has no replica, wants one and no "
            "node fits it (GET /admin/models says why, node by node)", labels=["model"])
        for name, spec in sorted(models.items()):
            mine = serving.get(name, [])
            want = wanted_now(spec, mine, usages, now,
                              settings.usage_refresh + settings.usage_interval,
                              settings.default_load_target)
            wanted.add_metric([name], want)
            # As the admin API's health: placement is a pure function of the
            # mirrored state, asked only for a model short of all replicas.
            # The leader's decision, over its inputs (any profile, in order).
            stuck = not mine and want > 0 and bool(spec.profile_list) and isinstance(
                place_any(placer_of(mirror, gw.agent_window), name, spec)[0], NoFit)
            unplaceable.add_metric([name], 1 if stuck else 0)

        gpus = GaugeMetricFamily("llmgw_node_gpus", "GPUs each live node reports, free or "
                                 "used (held by a replica, draining ones included)",
                                 labels=["node", "state"])
        # One series per live node, as above: as bounded as the fleet.
        sick = GaugeMetricFamily("llmgw_node_gpus_unhealthy", "GPUs each live node's agent "
                                 "reports unhealthy that no admin has cleared: kept out of "
                                 "placement (GET /admin/nodes says why)", labels=["node"])
        holders = fleet.gpu_holders(replicas)
        confs = mirror.nodeconfs()
        for name, node in sorted(nodes.items()):
            free, used = fleet.gpu_use(node, holders.get(name, {}))
            gpus.add_metric([name, "free"], free)
            gpus.add_metric([name, "used"], used)
            sick.add_metric([name], len(gpuhealth.sick_gpus(node, confs.get(name))))
        yield from (leader, ready, revision, by_phase, wanted, unplaceable, inflight, gpus,
                    sick)
        yield from _held(gw)
        yield from _engine_loads(gw, replicas)


def _router_compiled() -> Metric:
    router = GaugeMetricFamily("llmgw_router_compiled", "1 when this process runs the "
                               "router compiled by mypyc, 0 when pure Python "
                               "(the start line says why)")
    router.add_metric([], 1 if compiled.state().startswith("compiled") else 0)
    return router


def _store_health(gw: Observed) -> Iterator[Metric]:
    """1 while the store refuses writes for lack of space (etcd's NOSPACE
    alarm): alert on it, since the fleet cannot change until an operator
    acts (docs/design/security-operations.md, "A month of uptime"). And 1 while the store's
    last call failed (etcd unreachable from this gateway)."""
    state = gw.store.health().state if gw.started else "unknown"
    nospace = GaugeMetricFamily("llmgw_store_nospace", "1 while the store (etcd) refuses "
                                "writes for lack of space: its NOSPACE alarm is raised")
    nospace.add_metric([], 1 if state == "nospace" else 0)
    unreachable = GaugeMetricFamily("llmgw_store_unreachable", "1 while this gateway's "
                                    "last call to the store (etcd) failed")
    unreachable.add_metric([], 1 if state == "unreachable" else 0)
    yield from (nospace, unreachable)


def _held(gw: Observed) -> Iterator[Metric]:
    """Scale from zero: requests this gateway holds for a replica on its
    way, and those it held that got none in time."""
    held = GaugeMetricFamily("llmgw_requests_held", "Requests this gateway holds while "
                             "their model's replica starts (scale from zero)",
                             labels=["model"])
    for model, n in sorted(gw.table.held().items()):
        held.add_metric([model], n)
    timeouts = CounterMetricFamily("llmgw_held_timeouts", "Held requests that got no "
                                   "ready replica in time (answered 503 or 504)",
                                   labels=["model"])
    for model, n in sorted(gw.table.hold_timeouts.items()):
        timeouts.add_metric([model], n)
    # Spill-over (app/router/spill.py): model is a catalog name, reason one of four.
    spills = CounterMetricFamily("llmgw_spills", "Requests sent to their model's overflow "
                                 "(an external model), by model and reason",
                                 labels=["model", "reason"])
    for (model, reason), n in sorted(gw.table.spills.items()):
        spills.add_metric([model, reason], n)
    yield from (held, timeouts, spills)


def _engine_loads(gw: Observed, replicas: Mapping[str, Replica]) -> Iterator[Metric]:
    """Each engine's own counts as this gateway last polled them (fresh ones
    only: a stale count is unknown, not zero). The same on every gateway."""
    running = GaugeMetricFamily("llmgw_engine_running", "Requests an engine runs (its "
                                "/metrics), by model and replica", labels=["model", "replica"])
    waiting = GaugeMetricFamily("llmgw_engine_waiting", "Requests waiting in an engine",
                                labels=["model", "replica"])
    kv = GaugeMetricFamily("llmgw_engine_kv_cache_usage", "An engine's KV-cache use, 0 to 1",
                           labels=["model", "replica"])
    # Per model, as vLLM names them: the sums of its engines' queues and
    # the fullest KV cache (where the next request is likely to wait).
    sums: dict[str, list[float]] = {}
    for rid, load in sorted(gw.table.fresh_loads().items()):
        rep = replicas.get(rid)
        if rep is None:
            continue
        running.add_metric([rep.model, rid], load.running)
        waiting.add_metric([rep.model, rid], load.waiting)
        kv.add_metric([rep.model, rid], load.kv_cache)
        got = sums.setdefault(rep.model, [0.0, 0.0, 0.0])
        got[0] += load.running
        got[1] += load.waiting
        got[2] = max(got[2], load.kv_cache)
    m_running = GaugeMetricFamily("llmgw_num_requests_running", "Requests a model's "
                                  "engines run, summed", labels=["model"])
    m_waiting = GaugeMetricFamily("llmgw_num_requests_waiting", "Requests waiting in a "
                                  "model's engines, summed", labels=["model"])
    m_kv = GaugeMetricFamily("llmgw_kv_cache_usage_perc", "The fullest KV cache among a "
                             "model's engines, 0 to 1", labels=["model"])
    for model, (r, w, k) in sorted(sums.items()):
        m_running.add_metric([model], r)
        m_waiting.add_metric([model], w)
        m_kv.add_metric([model], k)
    yield from (running, waiting, kv, m_running, m_waiting, m_kv)
