"""The API agents call (`/agent/v1/nodes/{node}/...`); served by every gateway.

An agent proves its node with a token derived from the shared secret for
that node name (`llmgw ctl node-token NODE`), so a token taken from one node
cannot report for, or fetch the engine keys of, another.

Node liveness: `nodes/{node}` is bound to a lease that any gateway renews
when the agent heartbeats (the lease id is read from the mirrored key), so
heartbeats may land on any gateway. An agent silent for `node_ttl` seconds
loses its node key, and the leader re-places its replicas. A gateway that
renewed the lease itself within a third of the TTL answers an unchanged
inventory without asking etcd (docs/design/scale.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Coroutine
from typing import Annotated, Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from app.api.deps import MirrorState
from app.api.errors import Problem
from app.api.openapi import problems
from app.api.refusals import answered
from app.control import state as s
from app.control.keys import SecretRing
from app.control.mirror import Mirror
from app.control.ops.agent_ops import AgentOps

logger = logging.getLogger(__name__)

_MAX_WAIT = 60.0


class StatusReport(BaseModel):
    replicas: list[s.ReplicaStatus] = Field(max_length=s.MAX_REPLICAS_REPORTED)


def assignments(mirror: Mirror, secrets: SecretRing, node: str
                ) -> tuple[str, list[dict[str, Any]], s.NodeConf]:
    """This node's desired replicas, with their engine keys, a fingerprint,
    and the node's conf, whose vLLM build and version are chosen for the
    node (in the fingerprint: a new choice answers the long poll)."""
    mine = sorted((r for r in mirror.replicas().values() if r.node == node),
                  key=lambda r: r.id)
    conf = mirror.one(s.NODECONF + node, s.NodeConf) or s.NodeConf()
    # The id of the secret each key derives from is in the fingerprint: a key
    # that changes (a rotation's end) answers the long poll, so the agent
    # checks its engine with the new key (docs/design/agent.md).
    shape: list[Any] = [
        [r.id, r.model, r.weights, r.weights_revision, r.engine, r.gpus, r.engine_args,
         secrets.key_secret_id(r.secret)]
        for r in mine]
    if conf.engine_build != "auto":  # fingerprints of the default stay as they were
        shape.append(conf.engine_build)
    if conf.vllm_version:
        shape.append(conf.vllm_version)
    fp = hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:16]
    out = [{"id": r.id, "model": r.model, "weights": r.weights,
            "weights_revision": r.weights_revision, "engine_args": r.engine_args,
            "engine": r.engine,
            "gpus": r.gpus, "key": secrets.engine_key(r.id, r.secret)} for r in mine]
    return fp, out, conf


def check_engine_url(url: str, node: s.NodeInfo | None) -> str | None:
    """Why `url` is not an engine address this node may report, or None.

    Gateways send prompts and the replica's engine key to this URL: a node
    that could name any URL (another host, a path, https to a look-alike)
    could collect both. So it must be plain http on the node's own address.
    """
    if node is None or not node.address:
        return "the node has not reported its address"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"{url!r} is not a URL: {exc}"
    if parts.scheme != "http" or parts.hostname is None or port is None:
        return f"{url!r} is not http://HOST:PORT"
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        return f"{url!r} has more than a scheme, host and port"
    if parts.hostname != node.address.strip("[]").lower():
        return f"{url!r} is not on the node's address {node.address}"
    return None


async def _first(*waits: Coroutine[Any, Any, Any]) -> None:
    """Returns when the first of `waits` does; cancels the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


class AgentApi:
    """The agents' endpoints (its methods) and what they answer from;
    `routes` mounts them."""

    def __init__(self, state: MirrorState, ops: AgentOps, secrets: SecretRing,
                 closing: asyncio.Event, *, node_ttl: int, vllm_version: str,
                 vllm_cpu_version: str) -> None:
        self.state, self.ops, self.secrets, self.closing = state, ops, secrets, closing
        self.node_ttl = node_ttl
        self.vllm_version, self.vllm_cpu_version = vllm_version, vllm_cpu_version
        # Nodes seen with a token of the previous secret, logged once each: the
        # rotation's window ends once no node is left here
        # (docs/design/security-operations.md, "Rotating the shared secret").
        self.on_previous: set[str] = set()

    def authorize(self, request: Request, node: str) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        which = self.secrets.check_node_token(node, token.strip()) if (
            scheme.lower() == "bearer") else None
        if which is None:
            raise Problem(401, "Unauthorized", f"not a valid agent token for node {node!r}")
        if which == "previous" and node not in self.on_previous:
            self.on_previous.add(node)
            logger.warning("node %s uses a token of LLMGW_PREVIOUS_SECRET: give its agent "
                           "the token of the current secret (llmgw ctl node-token) before "
                           "unsetting LLMGW_PREVIOUS_SECRET", node)
        elif which == "current":
            self.on_previous.discard(node)
        # Answer only from state we have (DESIGN invariant 9): a gateway whose
        # mirror has not loaded would hand an agent an empty assignment list,
        # and the agent would stop every engine on its node.
        if not self.state.ready:
            raise Problem(503, "State not loaded",
                          "this gateway has not loaded the fleet's state yet; ask another")

    async def heartbeat(self, node: str, info: s.NodeInfo, request: Request) -> dict[str, Any]:
        self.authorize(request, node)
        if info.name != node:
            raise Problem(400, "Node name mismatch", f"body names {info.name!r}, path {node!r}")
        with answered():
            await self.ops.heartbeat(info)
        return {"node": node, "ttl": self.node_ttl}

    async def get_assignments(
        self, node: str, request: Request, since: str = "",
        # NaN would pass min/max below unclamped and leave the poll no deadline.
        wait: Annotated[float, Query(allow_inf_nan=False)] = 0.0,
    ) -> dict[str, Any]:
        """This node's replicas. `revision` is the store revision they were
        read at and `store` the store's id ("" until created): an agent never
        applies an answer older than one it applied from the same store, even
        across its restarts, so failing over to a gateway whose watch lags
        cannot roll it back."""
        self.authorize(request, node)
        closing, mirror = self.closing, self.state.mirror
        if wait > 0 and closing.is_set():
            # A long poll here would answer at once, again and again, until
            # the stop ends: the agent moves to another gateway instead.
            raise Problem(503, "Gateway stopping", "this gateway is stopping; ask another")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(wait, 0.0), _MAX_WAIT)
        while True:
            seen = mirror.revision
            fp, replicas, conf = assignments(mirror, self.secrets, node)
            left = deadline - loop.time()
            if fp != since or left <= 0 or closing.is_set():
                return {"fingerprint": fp, "revision": seen, "store": mirror.store_id(),
                        "replicas": replicas, "engine_build": conf.engine_build,
                        "vllm_version": conf.vllm_version or (
                            self.vllm_cpu_version if conf.engine_build == "cpu"
                            else self.vllm_version)}
            # Woken only by a change to this node's replicas or conf, not by
            # every change in the fleet (docs/design/scale.md).
            await _first(mirror.wait_node_past(node, seen, left), closing.wait())

    async def put_status(self, node: str, report: StatusReport,
                         request: Request) -> dict[str, int]:
        self.authorize(request, node)
        inventory = self.state.mirror.nodes().get(node)
        bad = {st.id: why for st in report.replicas
               if st.url and (why := check_engine_url(st.url, inventory)) is not None}
        if bad:
            raise Problem(422, "Engine URL refused",
                          "; ".join(f"{rid}: {why}" for rid, why in sorted(bad.items())))
        return {"written": await self.ops.report_status(node, report.replicas)}


def routes(state: MirrorState, ops: AgentOps, secrets: SecretRing, closing: asyncio.Event,
           *, node_ttl: int, vllm_version: str, vllm_cpu_version: str) -> APIRouter:
    """`closing`: set once this gateway stops; `node_ttl`: LLMGW_NODE_TTL;
    `vllm_version`: LLMGW_VLLM_VERSION, a node's unless its conf says (on
    the `cpu` build, LLMGW_VLLM_CPU_VERSION: vllm-cpu is released apart)."""
    api = AgentApi(state, ops, secrets, closing, node_ttl=node_ttl,
                   vllm_version=vllm_version, vllm_cpu_version=vllm_cpu_version)
    r = APIRouter(prefix="/agent/v1/nodes/{node}", tags=["agents"])
    r.put("", responses=problems(400, 409))(api.heartbeat)
    r.get("/assignments")(api.get_assignments)
    r.put("/status")(api.put_status)
    return r
