"""Admin routes that reach a node's agent: its logs, its model cache, its upgrade.

Any gateway answers them: it finds the node's agent API in the mirrored
inventory (`api_url`), authenticates with the node's token (derived from
the shared secret, app/control/keys.py) and relays the answer. The agent's
own answers (400 a path refused, 404 no such log, 409 weights in use) come
back as they are; a gateway never answers 500 for an agent's trouble:

- node not in the fleet: 404;
- this gateway's state not loaded: 503 (answer only from state you have);
- no API reported (an agent older than node operations), an API URL not on
  the node's own address, connection refused, an agent refusing the
  gateway's token, a broken answer: 502, saying which;
- no answer within LLMGW_NODE_API_TIMEOUT (an upgrade: LLMGW_NODE_UPGRADE_TIMEOUT): 504.

`POST /admin/nodes/{node}/upgrade {"version", "sha256"}` waits for the
agent's installer (app/agent/upgrade.py): 200 when installed (the agent
then restarts on it and adopts its engines; its heartbeat reports the new
version), 422 with the installer's last lines when it failed or the wheel's
hash differs (the agent runs on), 409 while another upgrade of that agent
runs or when the node's operator configured no upgrade source. A version
outside this gateway's agent version window is refused here (422): an
agent placement would refuse is not installed.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import aiohttp
from fastapi import APIRouter, Body, Depends, Query
from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.api.agent import check_engine_url
from app.api.auth import admin_guard
from app.api.deps import MirrorState
from app.api.errors import Problem
from app.api.openapi import problems
from app.control.keys import SecretRing
from app.control.placement.agentversion import default_window
from app.wire.masking import mask

logger = logging.getLogger(__name__)



class WeightsDelete(BaseModel):
    paths: list[str] = Field(..., min_length=1, max_length=1000,
                             description="entries to remove: relative to the node's cache "
                                         "directory, or absolute paths inside it")


class Upgrade(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str = Field(..., min_length=1, max_length=64, pattern=r"^[0-9][0-9A-Za-z.+!-]*$",
                         description="the llmgw version to install, e.g. 0.2.0")
    sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$",
                        description="the sha256 of the wheel to install (lowercase hex): "
                                    "the agent installs that file only")
    # Refused: an admin-chosen index ran any code as the agent's user. The
    # source is the node operator's (LLMGW_AGENT_UPGRADE_SOURCE).
    index_url: None = Field(None, description="not accepted: upgrades come only from the "
                                              "source each node's operator configures")

    @field_validator("index_url", mode="before")
    @classmethod
    def _no_index(cls, v: object) -> None:
        if v is not None:
            raise ValueError("not accepted: upgrades come only from the source each node's "
                             "operator configures (LLMGW_AGENT_UPGRADE_SOURCE)")
        return None


class NodeCaller:
    """Calls a node's agent API with the node's token (module docstring): the
    node caller the routes reaching an agent are handed (this module's, and
    fabric.py's)."""

    def __init__(self, state: MirrorState, secrets: SecretRing, timeout: float,
                 connect_timeout: float) -> None:
        """`timeout`: LLMGW_NODE_API_TIMEOUT; `connect_timeout`:
        LLMGW_NODE_API_CONNECT_TIMEOUT."""
        self.state = state
        self.secrets = secrets
        self.timeout = timeout
        self.connect_timeout = connect_timeout

    def url(self, node: str) -> str:
        """The node's agent API URL, once checked it may be sent the node
        token; else the problem to answer (404, 502, 503)."""
        return _agent_url(self.state, node)

    async def call(self, node: str, method: str, path: str, *,
                   params: dict[str, str] | None = None,
                   body: Any = None, timeout_s: float | None = None) -> dict[str, Any]:
        """One call to a node's agent API with the node's token; its answer,
        or the problem to answer (module docstring)."""
        return await _call_agent(self, node, method, path, params=params, body=body,
                                 timeout_s=timeout_s)


def _agent_url(state: MirrorState, node: str) -> str:
    if not state.ready:
        raise Problem(503, "State not loaded",
                      "this gateway has not loaded the fleet's state yet; retry")
    info = state.mirror.nodes().get(node)
    if info is None:
        raise Problem(404, "No such node", f"node {node!r} is not in the fleet "
                      "(its agent has not heartbeated within the node TTL)")
    if not info.api_url:
        raise Problem(502, "Agent API unknown",
                      f"node {node!r} reports no agent API: its agent predates node "
                      "operations, or could not listen on its API port (see its log)")
    # Gateways send the node token there: only to the node's own address.
    why = check_engine_url(info.api_url, info)
    if why is not None:
        raise Problem(502, "Agent API refused", f"node {node!r}'s agent API: {why}")
    return info.api_url.rstrip("/")


async def _call_agent(caller: NodeCaller, node: str, method: str, path: str, *,
                      params: dict[str, str] | None,
                      body: Any, timeout_s: float | None) -> dict[str, Any]:
    api_url = caller.url(node)
    url = api_url + path
    total = timeout_s or caller.timeout
    timeout = aiohttp.ClientTimeout(total=total,
                                    sock_connect=caller.connect_timeout)
    # During a rotation an agent may still hold the previous secret's token:
    # a 401 to the current one is asked again with that (a refused request
    # did nothing, so it is safe to send twice).
    tokens = caller.secrets.node_tokens(node)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for i, token in enumerate(tokens):
                async with session.request(
                    method, url, params=params, json=body,
                    headers={"Authorization": f"Bearer {token}"},
                ) as resp:
                    try:
                        answer = await resp.json(content_type=None)
                    except ValueError:
                        answer = None
                    status = resp.status
                if status != 401 or i == len(tokens) - 1:
                    break
    except aiohttp.ConnectionTimeoutError:
        raise Problem(504, "Agent unreachable",
                      f"node {node!r}'s agent at {api_url}: no connection within "
                      f"{caller.connect_timeout:g} s") from None
    except (aiohttp.ServerTimeoutError, TimeoutError):
        raise Problem(504, "Agent timed out",
                      f"node {node!r}'s agent at {api_url} did not answer within "
                      f"{total:g} s") from None
    except aiohttp.ClientError as exc:
        raise Problem(502, "Agent unreachable",
                      f"node {node!r}'s agent at {api_url} is unreachable: "
                      f"{exc or type(exc).__name__}") from None
    if not isinstance(answer, dict):
        raise Problem(502, "Bad agent answer",
                      f"node {node!r}'s agent answered {status} without a JSON object")
    if status == 401:
        logger.warning("agent of node %s refused this gateway's node token", node)
        raise Problem(502, "Agent refused the gateway",
                      f"node {node!r}'s agent refused the node token this gateway derives "
                      "(is its LLMGW_AGENT_TOKEN from another LLMGW_SECRET?)")
    if 400 <= status < 500:
        extra = {k: v for k, v in answer.items()
                 if k not in ("type", "title", "status", "detail")}
        raise Problem(status, str(answer.get("title", "Refused by the agent")),
                      str(answer.get("detail", "")), **extra)
    if status >= 300:
        raise Problem(502, "Agent failed",
                      f"node {node!r}'s agent answered {status}: {answer.get('detail', '')}")
    return answer


def routes(caller: NodeCaller, state: MirrorState, secrets: SecretRing, *, admin_token: str,
           min_agent_version: str | None, upgrade_timeout: float) -> APIRouter:
    """`min_agent_version`: LLMGW_MIN_AGENT_VERSION; `upgrade_timeout`:
    LLMGW_NODE_UPGRADE_TIMEOUT."""
    require_admin = admin_guard(admin_token)

    # The agent's own 4xx pass through (`call_agent`).
    r = APIRouter(prefix="/admin/nodes", tags=["nodes"], dependencies=[Depends(require_admin)],
                  responses=problems(400, 404, 409, 502, 504))

    async def call(node: str, method: str, path: str, *,
                   params: dict[str, str] | None = None, body: Any = None) -> dict[str, Any]:
        return await caller.call(node, method, path, params=params, body=body)

    @r.get("/{node:path}/logs", summary="Recent lines of a node's log (the agent's or a "
           "replica engine's), engine keys masked")
    async def logs(
        node: str,
        source: Annotated[str, Query(max_length=200, description="'agent' or a replica id")]
        = "agent",
        lines: Annotated[int, Query(ge=1, le=10_000)] = 100,
    ) -> dict[str, Any]:
        answer = await call(node, "GET", "/node/v1/logs",
                            params={"source": source, "lines": str(lines)})
        # The agent masks already; this gateway knows every key of the node's
        # replicas, so it masks again (DESIGN invariant 6).
        keys = [key for rid, rep in state.mirror.replicas().items() if rep.node == node
                for key in secrets.engine_keys(rid)]
        answer["lines"] = [mask(str(line), keys) for line in answer.get("lines", [])]
        return answer

    @r.get("/{node:path}/weights", summary="What a node's model cache holds")
    async def list_weights(node: str) -> dict[str, Any]:
        return await call(node, "GET", "/node/v1/weights")

    @r.delete("/{node:path}/weights", summary="Remove entries from a node's model cache "
              "(all or none; only inside the cache, never a running replica's weights)")
    async def delete_weights(
        node: str, req: Annotated[WeightsDelete, Body()],
    ) -> dict[str, Any]:
        return await call(node, "DELETE", "/node/v1/weights", body={"paths": req.paths})

    @r.post("/{node:path}/upgrade", summary="Install an llmgw version on a node's agent, "
            "which restarts on it and adopts its engines")
    async def upgrade(node: str, req: Annotated[Upgrade, Body()]) -> dict[str, Any]:
        why = default_window(min_agent_version).refusal(req.version)
        if why is not None:
            raise Problem(422, "Version refused", f"{why}: this gateway would place nothing "
                          "on it; upgrade the gateways first", field="version")
        body = {"version": req.version, "sha256": req.sha256}
        answer = await caller.call(node, "POST", "/node/v1/upgrade", body=body,
                                   timeout_s=upgrade_timeout)
        logger.info("node %s: agent upgraded from llmgw %s to %s, restarting", node,
                    answer.get("from"), answer.get("version"))
        return answer

    return r
