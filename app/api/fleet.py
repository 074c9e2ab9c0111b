"""Admin routes for the fleet: cordon, uncordon and drain a node, its pool
and labels, clear a GPU's fault (`nodeconf/{node}`), and capacity quotas
(`quotas/{scope}`).

Every write is the control plane's (app/control/ops/node_ops.py), decided
on the mirror and conditioned on the key's revision as read, or on its
absence (DESIGN invariant 9): two admins on two gateways cannot overwrite
each other's change unseen; the loser decides again on the winner's value.
Every route answers 503 until the gateway's mirror has
loaded: a node conf decided on an empty mirror would overwrite the stored
one with defaults (uncordoning the node, moving it to the default pool).
A node's conf and a quota have an ETag (writes.py): a write may be made
conditional on it (If-Match, If-None-Match: *); none is applied past its
request's deadline (docs/design/admin-writes.md, "Catalog writes").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi import Path as PathParam
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.api.auth import admin_guard, bearer
from app.api.deps import MirrorState
from app.api.errors import Problem
from app.api.openapi import problems
from app.api.refusals import answered
from app.api.writes import deadline, etag, precondition
from app.control import gpuhealth
from app.control import state as s
from app.control.ops.node_ops import FleetOps
from app.control.placement import fleet


class NodeConfBody(BaseModel):
    """`PUT /admin/nodes/{node}/conf`: the node's pool and labels. Cordon
    and drain have routes of their own and are kept as they are."""

    model_config = ConfigDict(extra="forbid")
    pool: str = Field(default=fleet.DEFAULT_POOL, max_length=64)
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)

    @field_validator("pool")
    @classmethod
    def _pool(cls, v: str) -> str:
        return s.check_name(v, "pool")

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return s.check_labels(v)


class EngineBuildBody(BaseModel):
    """`PUT /admin/nodes/{node}/engine-build`: the vLLM build its agent
    installs (docs/design/node-operations.md)."""

    model_config = ConfigDict(extra="forbid")
    build: s.EngineBuild
    # Omitted: the gateways' LLMGW_VLLM_VERSION (the same on every node).
    vllm_version: str = Field(default="", max_length=64)

    @field_validator("vllm_version")
    @classmethod
    def _vllm_version(cls, v: str) -> str:
        return s.check_vllm_version(v) if v else v


class QuotaBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_gpus: int = Field(..., ge=0, le=100_000, description="GPUs the scope may hold")


@dataclass(frozen=True)
class FleetApi:
    """The fleet's endpoints (its methods) and what they read and write
    through; `routes` mounts them."""

    state: MirrorState
    ops: FleetOps
    write_deadline: float  # LLMGW_ADMIN_WRITE_DEADLINE

    # --- nodes -------------------------------------------------------------------

    def known(self, node: str) -> None:
        with answered():
            self.ops.check_known(node)

    def conf_view(self, node: str, response: Response) -> dict[str, Any]:
        """The conf (defaults if none is stored), its ETag in the header."""
        mirror = self.state.mirror
        conf = mirror.one(s.NODECONF + node, s.NodeConf) or s.NodeConf()
        if (tag := etag(mirror.get(s.NODECONF + node))) is not None:
            response.headers["ETag"] = tag
        return {"node": node} | conf.model_dump()

    async def change(self, node: str, edit: Callable[[s.NodeConf], s.NodeConf],
                     request: Request, response: Response) -> dict[str, Any]:
        self.known(node)
        cond = precondition(request)
        with answered():
            await self.ops.change_conf(node, edit, cond,
                                       deadline(request, self.write_deadline))
        return self.conf_view(node, response)

    async def get_conf(self, node: str, response: Response) -> dict[str, Any]:
        self.known(node)
        return self.conf_view(node, response)

    async def put_conf(self, node: str, body: NodeConfBody, request: Request,
                       response: Response) -> dict[str, Any]:
        return await self.change(node, lambda c: c.model_copy(
            update={"pool": body.pool, "labels": body.labels}), request, response)

    async def put_engine_build(self, node: str, body: EngineBuildBody, request: Request,
                               response: Response) -> dict[str, Any]:
        """auto (the newest build the driver runs), cu13, cu129, cpu (vLLM's
        CPU build, for `gpus: 0` vLLM replicas), or none (no vLLM replicas),
        and the vLLM version it installs (omitted: the gateways'
        LLMGW_VLLM_VERSION, or LLMGW_VLLM_CPU_VERSION for cpu). The node's
        agent is told within its long poll."""
        return await self.change(node, lambda c: c.model_copy(
            update={"engine_build": body.build, "vllm_version": body.vllm_version}),
            request, response)

    async def cordon(self, node: str, request: Request, response: Response) -> dict[str, Any]:
        """No new replicas go to the node; those on it stay."""
        return await self.change(node, lambda c: c.model_copy(update={"cordoned": True}),
                                 request, response)

    async def uncordon(self, node: str, request: Request,
                       response: Response) -> dict[str, Any]:
        """Replicas may be placed on the node again; ends a drain."""
        return await self.change(node, lambda c: c.model_copy(
            update={"cordoned": False, "draining": False}), request, response)

    async def drain(self, node: str, request: Request, response: Response) -> dict[str, Any]:
        """Cordons the node and moves its replicas to other nodes."""
        return await self.change(node, lambda c: c.model_copy(
            update={"cordoned": True, "draining": True}), request, response)

    async def clear_gpu(self, node: str, index: Annotated[int, PathParam(ge=0, lt=s.MAX_GPUS)],
                        request: Request, response: Response) -> dict[str, Any]:
        """Clears the fault a GPU reports: placement uses it again until its
        agent reports another (docs/design/gpu-health.md)."""
        def edit(conf: s.NodeConf) -> s.NodeConf:
            try:
                return gpuhealth.cleared(conf, self.state.mirror.nodes().get(node), node, index)
            except gpuhealth.NoSuchGpu as exc:
                raise Problem(404, "No such GPU", str(exc)) from None

        return await self.change(node, edit, request, response)

    # --- quotas ------------------------------------------------------------------

    async def quotas(self) -> list[dict[str, Any]]:
        """Every scope: its limit (null: none), GPUs held by its models'
        replicas (draining ones excluded) and those models."""
        mirror = self.state.mirror
        return [q | ({"etag": tag} if (tag := etag(mirror.get(s.QUOTAS + q["scope"])))
                     else {})
                for q in fleet.quota_report(mirror.models(), mirror.replicas(),
                                            mirror.quotas())]

    async def put_quota(self, scope: str, body: QuotaBody, request: Request,
                        response: Response) -> dict[str, Any]:
        check_scope(scope)
        cond = precondition(request)
        with answered():
            await self.ops.set_quota(scope, body.max_gpus, cond,
                                     deadline(request, self.write_deadline))
        if (tag := etag(self.state.mirror.get(s.QUOTAS + scope))) is not None:
            response.headers["ETag"] = tag
        return {"scope": scope, "max_gpus": body.max_gpus}

    async def delete_quota(self, scope: str, request: Request) -> Response:
        cond = precondition(request)
        with answered():
            await self.ops.delete_quota(scope, cond,
                                        deadline(request, self.write_deadline))
        return Response(status_code=204)


def check_scope(scope: str) -> None:
    try:
        s.check_name(scope, "quota scope")
    except ValueError as exc:
        raise Problem(400, "Invalid quota scope", str(exc)) from None


def routes(state: MirrorState, ops: FleetOps, *, admin_token: str,
           write_deadline: float) -> APIRouter:
    """`write_deadline`: LLMGW_ADMIN_WRITE_DEADLINE."""
    admin = admin_guard(admin_token)

    def require_admin(creds: Annotated[HTTPAuthorizationCredentials | None,
                                       Depends(bearer)]) -> None:
        admin(creds)
        if not state.ready:
            raise Problem(503, "State not loaded",
                          "this gateway has not loaded the fleet's state yet; ask another")

    api = FleetApi(state, ops, write_deadline)
    r = APIRouter(prefix="/admin", tags=["fleet"], dependencies=[Depends(require_admin)])
    node_write = problems(404, 409)
    r.get("/nodes/{node}/conf", responses=problems(404))(api.get_conf)
    r.put("/nodes/{node}/conf", responses=node_write)(api.put_conf)
    r.put("/nodes/{node}/engine-build", responses=node_write)(api.put_engine_build)
    r.post("/nodes/{node}/cordon", responses=node_write)(api.cordon)
    r.post("/nodes/{node}/uncordon", responses=node_write)(api.uncordon)
    r.post("/nodes/{node}/drain", responses=node_write)(api.drain)
    r.post("/nodes/{node}/gpus/{index}/clear", responses=node_write)(api.clear_gpu)
    r.get("/quotas")(api.quotas)
    r.put("/quotas/{scope}", responses=problems(400, 409))(api.put_quota)
    r.delete("/quotas/{scope}", status_code=204, responses=problems(400, 404, 409))(
        api.delete_quota)
    return r
