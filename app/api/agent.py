"""The API agents call (`/agent/v1/nodes/{node}/...`); served by every gateway.

An agent proves its node with a token derived from the shared secret for
that node name (`llmgw ctl node-token NODE`), so a token taken from one node
cannot report for, or fetch the engine keys of, another.

Node liveness: `nodes/{node}` is bound to a lease that any gateway renews
when the agent heartbeats (the lease id is read from the mirrored key), so
heartbeats may land on any gateway. An agent silent for `node_ttl` seconds
loses its node key, and the leader re-places its replicas.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel

from app.api.errors import Problem
from app.control import state as s
from app.control.keys import check_node_token, engine_key
from app.store.base import LeaseExpired

if TYPE_CHECKING:
    from app.gateway import Gateway

_MAX_WAIT = 60.0


class StatusReport(BaseModel):
    replicas: list[s.ReplicaStatus]


def assignments(gw: Gateway, node: str) -> tuple[str, list[dict[str, Any]]]:
    """This node's desired replicas, with their engine keys, and a fingerprint."""
    mine = sorted((r for r in gw.mirror.replicas().values() if r.node == node),
                  key=lambda r: r.id)
    shape = [[r.id, r.model, r.weights, r.engine, r.gpus] for r in mine]
    fp = hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:16]
    out = [{"id": r.id, "model": r.model, "weights": r.weights, "engine": r.engine,
            "gpus": r.gpus, "key": engine_key(gw.secret, r.id)} for r in mine]
    return fp, out


async def _first(*waits: Coroutine[Any, Any, Any]) -> None:
    """Returns when the first of `waits` does; cancels the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def routes(gw: Gateway) -> APIRouter:
    r = APIRouter(prefix="/agent/v1/nodes/{node}", tags=["agents"])

    def authorize(request: Request, node: str) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not check_node_token(gw.secret, node, token.strip()):
            raise Problem(401, "Unauthorized", f"not a valid agent token for node {node!r}")

    @r.put("")
    async def heartbeat(node: str, info: s.NodeInfo, request: Request) -> dict[str, Any]:
        authorize(request, node)
        if info.name != node:
            raise Problem(400, "Node name mismatch", f"body names {info.name!r}, path {node!r}")
        current = gw.mirror.get(s.NODES + node)
        body = info.model_dump_json().encode()
        if current is not None and current.lease:
            try:
                await gw.store.keepalive(current.lease)
                if current.value != body:
                    await gw.store.put(s.NODES + node, body, lease=current.lease)
                return {"node": node, "ttl": gw.settings.node_ttl}
            except LeaseExpired:
                pass
        lease = await gw.store.grant(gw.settings.node_ttl)
        await gw.store.put(s.NODES + node, body, lease=lease)
        return {"node": node, "ttl": gw.settings.node_ttl}

    @r.get("/assignments")
    async def get_assignments(
        node: str, request: Request, since: str = "", wait: float = 0.0
    ) -> dict[str, Any]:
        authorize(request, node)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(wait, 0.0), _MAX_WAIT)
        while True:
            seen = gw.mirror.revision
            fp, replicas = assignments(gw, node)
            left = deadline - loop.time()
            if fp != since or left <= 0 or gw.closing.is_set():
                return {"fingerprint": fp, "replicas": replicas}
            await _first(gw.mirror.wait_past(seen, left), gw.closing.wait())

    @r.put("/status")
    async def put_status(node: str, report: StatusReport, request: Request) -> dict[str, int]:
        authorize(request, node)
        replicas = gw.mirror.replicas()
        written = 0
        for st in report.replicas:
            rep = replicas.get(st.id)
            if rep is None or rep.node != node or st.node != node:
                continue  # removed meanwhile, or not this node's to report
            old = gw.mirror.one(s.STATUS + st.id, s.ReplicaStatus)
            if old is not None and (old.phase, old.url, old.detail) == (
                st.phase, st.url, st.detail
            ):
                continue
            await gw.store.put(s.STATUS + st.id, st.model_dump_json().encode())
            written += 1
        return {"written": written}

    return r
