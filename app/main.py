"""The composition root: `create_app(settings)` builds one whole gateway.

Nothing here runs at import time and nothing is global, so a test can build
three differently configured gateways in one process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from app import __version__
from app.api import admin, agent, docs, errors
from app.gateway import Gateway
from app.settings import Settings


def create_app(settings: Settings) -> FastAPI:
    gw = Gateway(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = FastAPI(
        title="llmgw",
        version=__version__,
        summary="One OpenAI-compatible endpoint over a fleet of GPU nodes",
        lifespan=lifespan,
        docs_url=None,  # served by app/api/docs.py without a CDN
        redoc_url=None,
    )
    app.state.gateway = gw
    errors.install(app)
    docs.install(app)

    @app.get("/healthz", tags=["probes"], summary="The process is up")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["probes"], summary="The state mirror is loaded")
    async def readyz() -> JSONResponse:
        if gw.ready:
            return JSONResponse({"status": "ready", "revision": gw.mirror.revision})
        return JSONResponse({"status": "loading"}, status_code=503)

    app.include_router(gw.proxy.routes())
    app.include_router(admin.routes(gw))
    app.include_router(agent.routes(gw))
    return app
