"""The admin API (`/admin`): catalog, nodes, replicas, leader.

Reads come from the mirror; writes are the control plane's operations
(app/control/ops/catalog_ops.py), which wait (briefly) for the mirror to
see them, so a GET right after a PUT on the same gateway reads what was
written. Their refusals are answered as problems (app/api/refusals.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml
from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel

from app.api.auth import admin_guard
from app.api.deps import MirrorState, RoutesRead
from app.api.errors import Problem
from app.api.openapi import problems
from app.api.refusals import answered
from app.api.writes import deadline, etag, precondition
from app.control import catalog, gpuhealth
from app.control import state as s
from app.control.keyfiles import ProviderKeys
from app.control.ops.catalog_ops import CatalogOps
from app.control.placement import fleet
from app.control.placement.agentversion import Window
from app.control.placement.placer import place_any, placer_of
from app.control.placement.verdict import NoFit
from app.control.plan.scaling import wanted_now
from app.wire import catalog as rules


class LeaderView(BaseModel):
    gateway: str
    leader: str | None
    is_leader: bool


@dataclass(frozen=True)
class AdminApi:
    """The admin API's endpoints (their methods) and what they read and write
    through, wired once in app/gateway/main.py; `routes` mounts them."""

    state: MirrorState
    ops: CatalogOps
    # This gateway's routes, read; `gateway_id`: this process's id, a
    # worker's under --workers.
    table: RoutesRead
    gateway_id: str
    # Its provider key files, read off the loop.
    provider_keys: ProviderKeys
    # The gateway's id and whether it leads now, the same whichever of its
    # workers answers (docs/design/workers.md).
    gateway: str
    is_leader: Callable[[], bool]
    # The leader's placement inputs, decided again here for a model's status.
    agent_window: Window
    idle_slack: float  # LLMGW_USAGE_REFRESH plus LLMGW_USAGE_INTERVAL
    default_load_target: int  # LLMGW_DEFAULT_LOAD_TARGET
    write_deadline: float  # LLMGW_ADMIN_WRITE_DEADLINE
    # Where a model's files may be (LLMGW_MODEL_ROOTS, LLMGW_PROVIDER_KEY_DIR).
    model_roots: list[str]
    provider_key_dir: str

    async def leader(self) -> LeaderView:
        info = self.state.mirror.leader()
        return LeaderView(gateway=self.gateway,
                          leader=info.id if info else None,
                          is_leader=self.is_leader())

    async def gateways(self) -> list[s.GatewayInfo]:
        return list(self.state.mirror.parsed(s.GATEWAYS, s.GatewayInfo).values())

    # --- catalog -----------------------------------------------------------------

    def with_status(self, model: s.StoredModel) -> dict[str, Any]:
        """The spec, and how its replicas stand. Placement is a pure function
        of the mirrored state, so any gateway can say why a replica is not
        placed, not only the leader."""
        mirror, table = self.state.mirror, self.table
        replicas = mirror.replicas()
        statuses = mirror.statuses()
        mine = [r for r in replicas.values()
                if r.model == model.name and r.draining_since is None]
        nodes = mirror.nodes()
        ready = sum(1 for r in mine
                    if s.replica_phase(r, statuses.get(r.id), r.node in nodes) == "ready")
        failed = [{"id": r.id, "node": r.node, "detail": st.detail}
                  for r in mine if (st := statuses.get(r.id)) is not None
                  and s.replica_phase(r, st) == "failed"]
        nofit: NoFit | None = None
        wanted = wanted_now(model, mine, mirror.usages(), time.time(),
                            self.idle_slack, self.default_load_target)
        if len(mine) < wanted and model.profile_list:
            # The leader's decision, over its inputs (any profile, in order).
            fit, _ = place_any(placer_of(mirror, self.agent_window), model.name, model)
            nofit = fit if isinstance(fit, NoFit) else None
        health = fleet.model_health(model, mine, nofit, displaced={
            r.id: r.drain_reason for r in replicas.values()
            if r.model == model.name and r.drain_reason})
        if model.external is not None and not table.endpoints(model.name):
            # Withheld by this gateway's router (its key file): say why.
            health = fleet.Health("unplaceable", table.unavailable(model.name)
                                  or "not published yet")
        extra: dict[str, Any] = {}
        if model.adapter is not None:
            # Where the leader loaded it (docs/design/lora-adapters.md).
            rec = mirror.parsed(s.ADAPTERS, s.AdapterSet).get(model.name)
            loaded = list(rec.replicas) if rec is not None else []
            extra = {"loaded_on": loaded,
                     "unloading": sorted(rec.unloading) if rec is not None else []}
            health = (fleet.Health("ok", f"loaded on {len(loaded)} replica(s) of "
                                         f"{model.adapter.base}") if loaded else
                      fleet.Health("degraded", table.unavailable(model.name)
                                   or "not loaded yet"))
        return stored_view(model) | {"status": {
            "wanted": wanted, "replicas": len(mine), "ready": ready,
            "failed": failed, "unplaced": str(nofit) if nofit is not None else None,
            "placement": nofit.as_dict() if nofit is not None else None,
            "health": health.as_dict(), **extra}}

    def model_etag(self, name: str) -> str | None:
        """What `If-Match` takes to replace or delete the model (writes.py)."""
        return etag(self.state.mirror.get(s.MODELS + name))

    async def list_models(self) -> list[dict[str, Any]]:
        return [self.with_status(m) | {"etag": self.model_etag(m.name)}
                for m in self.state.mirror.models().values()]

    async def get_model(self, name: str, response: Response) -> dict[str, Any]:
        model = self.state.mirror.models().get(name)
        tag = self.model_etag(name)
        if model is None or tag is None:
            raise Problem(404, "No such model", f"model {name!r} is not in the catalog")
        response.headers["ETag"] = tag
        return self.with_status(model) | {"etag": tag}

    async def export_catalog(self, request: Request) -> Response:
        """The catalog in LLMGW_CATALOG_FILE's form: YAML if asked for
        (Accept: application/yaml), else JSON."""
        if not self.state.ready:
            # An empty export saved as a file would seed an empty catalog
            # (DESIGN invariant 9: answer only from state you have).
            raise Problem(503, "State not loaded",
                          "this gateway has not loaded the catalog yet; ask another")
        body = catalog.export(self.state.mirror.models())
        accept = request.headers.get("accept", "")
        if any(t in accept for t in ("application/yaml", "application/x-yaml", "text/yaml")):
            return Response(yaml.safe_dump(body, sort_keys=False),
                            media_type="application/yaml")
        return Response(json.dumps(body, indent=2), media_type="application/json")

    async def check_spec(self, spec: s.ModelSpec) -> None:
        errors = rules.check_spec(spec, self.model_roots, self.provider_key_dir)
        key_file = spec.external.api_key_file if spec.external is not None else None
        if not errors and key_file is not None:
            # The file as this gateway finds it, off the loop: one the policy
            # refuses (a FIFO, outside the folder once resolved) is a 422; one
            # missing or unreadable here may be fixed on disk, and the model's
            # status says why meanwhile.
            got = await self.provider_keys.read_now(key_file)
            if got.refused:
                errors = [rules.FieldError(("external", "api_key_file"), got.error)]
        if errors:
            raise Problem(422, "Invalid request body", "; ".join(
                f"{'.'.join(str(p) for p in e.loc)}: {e.msg}" for e in errors),
                errors=[e.as_dict(("body",)) for e in errors])

    async def put_model(self, name: str, spec: s.ModelSpec, request: Request,
                        response: Response) -> dict[str, Any]:
        cond = precondition(request)
        try:
            s.check_name(name, "model name")
        except ValueError as exc:
            raise Problem(400, "Invalid model name", str(exc)) from None
        await self.check_spec(spec)
        with answered():
            done = await self.ops.put_model(
                name, spec, cond, deadline(request, self.write_deadline))
        response.status_code = 200 if done.existed else 201
        if done.etag is not None:
            response.headers["ETag"] = done.etag
        return done.stored

    async def delete_model(self, name: str, request: Request) -> Response:
        cond = precondition(request)
        with answered():
            await self.ops.delete_model(name, cond,
                                        deadline(request, self.write_deadline))
        return Response(status_code=204)

    # --- fleet -----------------------------------------------------------------------

    async def nodes(self) -> list[dict[str, Any]]:
        """What each live node's agent reports, its replicas, and the
        operator's choices for it (`conf`: cordoned, draining, pool, labels,
        engine build), which outlive its agent."""
        mirror = self.state.mirror
        replicas = mirror.replicas()
        confs = mirror.nodeconfs()
        holders = fleet.gpu_holders(replicas)
        out = []
        for node in mirror.nodes().values():
            mine = sorted(rid for rid, rep in replicas.items() if rep.node == node.name)
            conf = confs.get(node.name) or s.NodeConf()
            held = holders.get(node.name, {})
            free, used = fleet.gpu_use(node, held)
            sick = gpuhealth.sick_gpus(node, conf)
            view = node.model_dump() | {"replicas": mine, "conf": conf.model_dump(),
                                        "gpus_free": free, "gpus_used": used,
                                        "gpus_unhealthy": len(sick)}
            # Which replica holds each GPU (None: free); whether it is kept
            # out as unhealthy (`health` is as its agent reports it, and an
            # admin may have cleared that reason).
            for gpu in view["gpus"]:
                gpu["replica"] = held.get(gpu["index"])
                gpu["unhealthy"] = gpu["index"] in sick
            out.append(view)
        return out

    async def routes_for(self, model: str) -> dict[str, Any]:
        """How this gateway routes `model` now: each endpoint's load, cooldown,
        affinity share, and whether it is being chosen and why (not)."""
        table = self.table
        name = table.resolve(model)
        if name is None:
            raise Problem(404, "No such model", f"no model or alias {model!r} is routed here")
        return {"gateway": self.gateway_id, "model": name,
                "endpoints": table.explain(name), "unavailable": table.unavailable(name),
                "overflow": table.overflow(name)}  # spill-over's external model, if any

    async def replicas(self) -> list[dict[str, Any]]:
        statuses = self.state.mirror.statuses()
        nodes = self.state.mirror.nodes()
        # Each engine's own counts as this gateway last polled them (fresh
        # polls only): null where unknown, never a made-up zero.
        loads = self.table.fresh_loads()
        out = []
        for rid, rep in self.state.mirror.replicas().items():
            st = statuses.get(rid)
            detail = st.detail if st else ""
            if rep.node not in nodes and rep.draining_since is None:
                last = f"; last reported {st.phase}" if st else ""
                detail = f"node {rep.node} not heard from{last}" + (
                    f": {detail}" if detail else "")
            out.append(rep.model_dump() | {
                "phase": s.replica_phase(rep, st, rep.node in nodes),
                "url": st.url if st else "", "detail": detail,
                # Requests this gateway has in flight on it now.
                "inflight": self.table.inflight(rid),
                "running": load.running if (load := loads.get(rid)) else None,
                "waiting": load.waiting if load else None,
                "kv_cache": load.kv_cache if load else None,  # 0 to 1
            })
        return out


def stored_view(model: s.StoredModel) -> dict[str, Any]:
    """The spec as given (fields left out stay out), its name and creation."""
    return {"name": model.name, "created": model.created} | model.spec_dump()


def routes(api: AdminApi, *, admin_token: str) -> APIRouter:
    """`api`'s endpoints under /admin, behind the admin token; in this
    order in the OpenAPI document."""
    r = APIRouter(prefix="/admin", tags=["admin"],
                  dependencies=[Depends(admin_guard(admin_token))])
    r.get("/leader", response_model=LeaderView)(api.leader)
    r.get("/gateways")(api.gateways)
    r.get("/models")(api.list_models)
    r.get("/models/{name:path}", responses=problems(404))(api.get_model)
    r.get("/catalog", responses={200: {"content": {"application/yaml": {}}}})(
        api.export_catalog)
    # 404: a name no route matches (a line break in it, say) is answered as
    # a path that is not here, before any check of the name.
    r.put("/models/{name:path}", response_model=s.StoredModel,
          responses={201: {"model": s.StoredModel, "description": "created"},
                     **problems(400, 404, 409)},
          response_model_exclude_none=True, response_model_exclude_unset=True)(api.put_model)
    r.delete("/models/{name:path}", status_code=204, responses=problems(404, 409))(
        api.delete_model)
    r.get("/nodes")(api.nodes)
    r.get("/routes", responses=problems(404))(api.routes_for)
    r.get("/replicas")(api.replicas)
    return r
