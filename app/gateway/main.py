"""The gateway's ASGI app: `create_app(settings)` puts the HTTP routes
around a gateway built by the composition root (app/gateway/assembly.py);
its lifespan starts and stops the gateway's supervisor.

Nothing here runs at import time and nothing is global, so a test can build
three differently configured gateways in one process.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from app import __version__
from app.api import admin, agent, cluster, docs, errors, fabric, fleet, keys, nodes, stats
from app.api import openapi as api_openapi
from app.api.edge import Edge
from app.api.writes import RECEIVED
from app.control.ops.agent_ops import AgentOps
from app.control.ops.catalog_ops import CatalogOps
from app.control.ops.key_ops import KeyOps
from app.control.ops.node_ops import FleetOps
from app.gateway.assembly import build_gateway
from app.gateway.gateway import Gateway
from app.gateway.settings import Settings
from app.router import openapi as v1_openapi
from app.router.passthrough import ROOT_PATHS
from app.router.proxy import Proxy
from app.store.base import StoreFull, StoreUnavailable

logger = logging.getLogger(__name__)


class GatewayApp(FastAPI):
    """FastAPI for everything but `/v1`, which goes straight to the proxy.

    The request path skips FastAPI's routing and request objects: measured
    in bench/proxy.py, they cost more CPU per request than the proxying.
    It skips uvicorn's X-Forwarded-For and X-Forwarded-Proto rewrite too (a
    coroutine and a walk of the headers a request), which only the rest
    gets (`admin`): the router reads no client address or scheme.
    """

    v1: Proxy
    edge: Edge
    admin: Any  # this app's FastAPI side, behind uvicorn's proxy-headers rewrite

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
        await self.admin(scope, receive, send)


def create_app(settings: Settings, campaign: bool = True,
               ready_first: float = 0.0, worker: tuple[int, int] | None = None) -> GatewayApp:
    """A gateway (assembly.py, `build_gateway`: what `campaign`,
    `ready_first` and `worker` mean) and its HTTP routes."""
    gw = build_gateway(settings, campaign=campaign, ready_first=ready_first, worker=worker)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gw.start(serving=True)
        try:
            yield
        finally:
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
    # Whose X-Forwarded-* to believe: uvicorn's own setting, which `llmgw
    # serve` turns off for the whole app (cli.py) to keep it off /v1.
    app.admin = ProxyHeadersMiddleware(
        functools.partial(FastAPI.__call__, app),
        trusted_hosts=os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1,::1"))
    app.edge = Edge(gw.admin_token, gw.secrets, settings.admin_max_body,
                    settings.agent_max_body)
    errors.install(app, unavailable=StoreUnavailable, full=StoreFull)
    docs.install(app)
    cluster.install(app)
    _probes(app, gw)
    _admin(app, gw)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            v1_openapi.complete(schema)
            api_openapi.complete(schema)
        return app.openapi_schema or schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _probes(app: GatewayApp, gw: Gateway) -> None:
    """/health, /healthz, /metrics and /readyz."""
    summed = gw.worker_metrics

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
        (docs/design/stopping.md)."""
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


def _admin(app: GatewayApp, gw: Gateway) -> None:
    """/admin, the agents' and the nodes' routes, and the cluster's stats."""
    settings = gw.settings
    admin_token, write_deadline = gw.admin_token, settings.admin_write_deadline
    app.include_router(admin.routes(admin.AdminApi(
        state=gw, ops=CatalogOps(gw, settings.gateway_id), table=gw.table,
        provider_keys=gw.provider_keys, gateway_id=settings.gateway_id,
        # /admin/leader answers for the gateway, as /metrics' llmgw_leader,
        # whichever worker takes the connection (docs/design/workers.md).
        gateway=gw.metrics.gateway_id or settings.gateway_id, is_leader=gw.metrics.leads,
        agent_window=gw.agent_window,
        write_deadline=write_deadline, model_roots=settings.model_root_list,
        provider_key_dir=settings.provider_key_dir,
        idle_slack=settings.usage_refresh + settings.usage_interval,
        default_load_target=settings.default_load_target), admin_token=admin_token))
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
