"""Fabric test: TCP bandwidth between nodes' agents, both ways, per pair.

    POST /admin/fabric-test {"nodes": [A, B, ...], "seconds": 1}
    GET  /admin/fabric

For each pair and each direction A -> B, this gateway asks B's agent for a
one-time sink ticket, then asks A's agent to stream bytes to B's sink with
it (app/agent/fabric.py): A never holds B's node token, and a ticket opens
B's sink once, within a minute. Directions run one at a time, so that one
test does not share the links with another; a gateway runs one fabric test
at a time (409 else). Each result is written to `fabric/{from}/{to}` and
listed, from the mirror, by GET /admin/fabric (docs/design/node-operations.md).
Errors: a node not in the fleet 404 (before anything runs),
fewer than two nodes 422, an agent unreachable 502/504 naming it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends
from pydantic import BaseModel, Field, field_validator

from app.api.auth import admin_guard
from app.api.deps import MirrorState
from app.api.errors import Problem
from app.api.nodes import NodeCaller
from app.api.openapi import problems
from app.control import state as s
from app.control.ops.node_ops import FleetOps
from app.wire.fabric import MAX_BYTES, MAX_SECONDS, SINK_PATH

logger = logging.getLogger(__name__)

MAX_NODES = 8  # 56 directions of up to 2 s: a request that ends within minutes


class FabricTest(BaseModel):
    nodes: list[str] = Field(..., min_length=2, max_length=MAX_NODES,
                             description="the nodes to test, every pair both ways")
    seconds: float = Field(1.0, gt=0, le=MAX_SECONDS, description="per direction")
    bytes: int = Field(MAX_BYTES, gt=0, le=MAX_BYTES, description="most bytes per direction")

    @field_validator("nodes")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("nodes must be distinct")
        return v


def directions(nodes: list[str]) -> list[tuple[str, str]]:
    """Every pair in the order given, each both ways, one after the other."""
    return [d for i, a in enumerate(nodes) for b in nodes[i + 1:] for d in ((a, b), (b, a))]


def routes(caller: NodeCaller, state: MirrorState, ops: FleetOps, *, admin_token: str,
           settle: float) -> APIRouter:
    """`settle`: seconds the results' write waits for the mirror to see it
    (LLMGW_ETCD_TIMEOUT)."""
    r = APIRouter(prefix="/admin", tags=["nodes"],
                  dependencies=[Depends(admin_guard(admin_token))],
                  responses=problems(400, 404, 409, 502, 504))
    running = asyncio.Lock()

    async def measure(src: str, dst: str, req: FabricTest) -> s.FabricResult:
        sink = caller.url(dst) + SINK_PATH
        ticket = await caller.call(dst, "POST", "/node/v1/fabric/ticket")
        got = await caller.call(src, "POST", "/node/v1/fabric/send", body={
            "sink_url": sink, "ticket": str(ticket.get("ticket", "")),
            "seconds": req.seconds, "bytes": req.bytes})
        count, secs = int(got.get("bytes", 0)), float(got.get("seconds", 0.0))
        gbps = count * 8 / secs / 1e9 if secs > 0 else 0.0
        return s.FabricResult.model_validate({
            "from": src, "to": dst, "gbps": round(gbps, 3), "bytes": count,
            "seconds": round(secs, 6), "at": time.time()})

    @r.post("/fabric-test", summary="Measure TCP bandwidth between nodes' agents, every "
            "pair both ways; results kept for placement")
    async def fabric_test(req: Annotated[FabricTest, Body()]) -> dict[str, Any]:
        for node in req.nodes:  # all known before any traffic
            caller.url(node)
        if running.locked():
            raise Problem(409, "Fabric test running",
                          "this gateway is running another fabric test; retry when it ends")
        async with running:
            results: list[s.FabricResult] = []
            for src, dst in directions(req.nodes):
                results.append(await measure(src, dst, req))
                logger.info("fabric %s -> %s: %.2f Gb/s", src, dst, results[-1].gbps)
            saved = await ops.save_fabric(results, settle)
        return {"results": [res.model_dump(by_alias=True) for res in results], "saved": saved}

    @r.get("/fabric", summary="The last fabric test result of each direction measured")
    async def fabric() -> list[dict[str, Any]]:
        if not state.ready:
            raise Problem(503, "State not loaded",
                          "this gateway has not loaded the fleet's state yet; retry")
        found: list[dict[str, Any]] = []
        for kv in state.mirror.items(s.FABRIC):
            try:
                found.append(s.FabricResult.model_validate_json(kv.value)
                             .model_dump(by_alias=True))
            except ValueError:
                logger.warning("ignoring unreadable %s", kv.key)
        return found

    return r
