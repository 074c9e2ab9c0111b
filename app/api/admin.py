"""The admin API (`/admin`): catalog, nodes, replicas, leader.

Reads come from the mirror; writes go to the store and then wait (briefly)
for the mirror to see them, so a GET right after a PUT on the same gateway
reads what was written.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import yaml
from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel

from app.api.auth import admin_guard
from app.api.errors import Problem
from app.api.openapi import problems
from app.api.writes import Deadline, Precondition, etag
from app.control import catalog, fleet
from app.control import state as s
from app.control.placement import NoFit, place
from app.control.scaling import wanted_now
from app.store.base import Compare, Delete, Op, Put
from app.wire import catalog as rules

if TYPE_CHECKING:
    from app.gateway import Gateway

_SETTLE = 2.0  # seconds a write waits for this gateway's mirror to see it


class LeaderView(BaseModel):
    gateway: str
    leader: str | None
    is_leader: bool


def routes(gw: Gateway) -> APIRouter:
    require_admin = admin_guard(gw)

    r = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])

    async def settle(revision: int) -> None:
        await gw.mirror.wait_for(revision, _SETTLE)

    @r.get("/leader", response_model=LeaderView)
    async def leader() -> LeaderView:
        info = gw.mirror.leader()
        return LeaderView(gateway=gw.settings.gateway_id,
                          leader=info.id if info else None,
                          is_leader=gw.elector.is_leader)

    @r.get("/gateways")
    async def gateways() -> list[s.GatewayInfo]:
        return list(gw.mirror.parsed(s.GATEWAYS, s.GatewayInfo).values())

    # --- catalog -----------------------------------------------------------------

    def with_status(model: s.StoredModel) -> dict[str, Any]:
        """The spec, and how its replicas stand. Placement is a pure function
        of the mirrored state, so any gateway can say why a replica is not
        placed, not only the leader."""
        replicas = gw.mirror.replicas()
        statuses = gw.mirror.statuses()
        usages = gw.mirror.usages()
        mine = [r for r in replicas.values()
                if r.model == model.name and r.draining_since is None]
        nodes = gw.mirror.nodes()
        ready = sum(1 for r in mine
                    if s.replica_phase(r, statuses.get(r.id), r.node in nodes) == "ready")
        failed = [{"id": r.id, "node": r.node, "detail": st.detail}
                  for r in mine if (st := statuses.get(r.id)) is not None
                  and s.replica_phase(r, st) == "failed"]
        nofit: NoFit | None = None
        wanted = wanted_now(model, mine, usages, time.time(),
                            gw.settings.usage_refresh + gw.settings.usage_interval,
                            gw.settings.default_load_target)
        if len(mine) < wanted:
            fit = place(model.name, model, gw.mirror.nodes(), replicas,
                        nodeconfs=gw.mirror.nodeconfs(), quotas=gw.mirror.quotas(),
                        models=gw.mirror.models(), agent_versions=gw.agent_window)
            nofit = fit if isinstance(fit, NoFit) else None
        health = fleet.model_health(model, mine, nofit, displaced={
            r.id: r.drain_reason for r in replicas.values()
            if r.model == model.name and r.drain_reason})
        if model.external is not None and not gw.table.endpoints(model.name):
            # Withheld by this gateway's router (its key file): say why.
            health = fleet.Health("unplaceable", gw.table.unavailable(model.name)
                                  or "not published yet")
        return stored_view(model) | {"status": {
            "wanted": wanted, "replicas": len(mine), "ready": ready,
            "failed": failed, "unplaced": str(nofit) if nofit is not None else None,
            "health": health.as_dict()}}

    def stored_view(model: s.StoredModel) -> dict[str, Any]:
        """The spec as given (fields left out stay out), its name and creation."""
        return {"name": model.name, "created": model.created} | model.spec_dump()

    def model_etag(name: str) -> str | None:
        """What `If-Match` takes to replace or delete the model (writes.py)."""
        return etag(gw.mirror.get(s.MODELS + name))

    @r.get("/models")
    async def list_models() -> list[dict[str, Any]]:
        return [with_status(m) | {"etag": model_etag(m.name)}
                for m in gw.mirror.models().values()]

    @r.get("/models/{name:path}", responses=problems(404))
    async def get_model(name: str, response: Response) -> dict[str, Any]:
        model = gw.mirror.models().get(name)
        tag = model_etag(name)
        if model is None or tag is None:
            raise Problem(404, "No such model", f"model {name!r} is not in the catalog")
        response.headers["ETag"] = tag
        return with_status(model) | {"etag": tag}

    @r.get("/catalog", responses={200: {"content": {"application/yaml": {}}}})
    async def export_catalog(request: Request) -> Response:
        """The catalog in LLMGW_CATALOG_FILE's form: YAML if asked for
        (Accept: application/yaml), else JSON."""
        if not gw.ready:
            # An empty export saved as a file would seed an empty catalog
            # (DESIGN invariant 9: answer only from state you have).
            raise Problem(503, "State not loaded",
                          "this gateway has not loaded the catalog yet; ask another")
        body = catalog.export(gw.mirror.models())
        accept = request.headers.get("accept", "")
        if any(t in accept for t in ("application/yaml", "application/x-yaml", "text/yaml")):
            return Response(yaml.safe_dump(body, sort_keys=False),
                            media_type="application/yaml")
        return Response(json.dumps(body, indent=2), media_type="application/json")

    async def check_spec(spec: s.ModelSpec) -> None:
        errors = rules.check_spec(spec, gw.settings.model_root_list,
                                  gw.settings.provider_key_dir)
        key_file = spec.external.api_key_file if spec.external is not None else None
        if not errors and key_file is not None:
            # The file as this gateway finds it, off the loop: one the policy
            # refuses (a FIFO, outside the folder once resolved) is a 422; one
            # missing or unreadable here may be fixed on disk, and the model's
            # status says why meanwhile.
            got = await gw.provider_keys.read_now(key_file)
            if got.refused:
                errors = [rules.FieldError(("external", "api_key_file"), got.error)]
        if errors:
            raise Problem(422, "Invalid request body", "; ".join(
                f"{'.'.join(str(p) for p in e.loc)}: {e.msg}" for e in errors),
                errors=[e.as_dict(("body",)) for e in errors])

    async def write_catalog(decide: Callable[[], list[Op]], request: Request,
                            conditioned: bool = False) -> int:
        """Applies a catalog change decided on the mirror's catalog, conditioned
        on that catalog being the one the decision read (`catalog/serial`, see
        state.py). On a race lost to another gateway it waits for the winner's
        write and decides again, so the loser gets the answer the new catalog
        gives (409: the alias is now taken; 412: If-Match no longer holds)
        rather than an overwrite. Never after the request's deadline (408).
        A `conditioned` write first brings the mirror up to the store, so an
        ETag read on another gateway is compared with what is stored now."""
        deadline = Deadline(request, gw.settings.admin_write_deadline)
        if conditioned:
            current = await gw.store.get(s.CATALOG_SERIAL)
            if current is not None:
                await settle(current.mod_revision)
        for _ in range(5):
            serial = gw.mirror.get(s.CATALOG_SERIAL)
            seen = serial.mod_revision if serial is not None else 0
            ops = decide()
            bump = Put(s.CATALOG_SERIAL, json.dumps({"by": gw.settings.gateway_id}).encode())
            deadline.check()  # the client may have given up while this waited
            res = await gw.store.txn([Compare.modified_at(s.CATALOG_SERIAL, seen)], [*ops, bump])
            if res.succeeded:
                await settle(res.revision)
                return res.revision
            # Someone else's write came first: read it, then decide again.
            current = await gw.store.get(s.CATALOG_SERIAL)
            await settle(current.mod_revision if current is not None else res.revision)
        raise Problem(409, "Catalog busy", "the catalog kept changing under this request; retry")

    @r.put("/models/{name:path}", response_model=s.StoredModel,
           responses={201: {"model": s.StoredModel, "description": "created"},
                      **problems(400, 409)},
           response_model_exclude_none=True, response_model_exclude_unset=True)
    async def put_model(name: str, spec: s.ModelSpec, request: Request,
                        response: Response) -> dict[str, Any]:
        cond = Precondition.of(request)
        try:
            s.check_name(name, "model name")
        except ValueError as exc:
            raise Problem(400, "Invalid model name", str(exc)) from None
        await check_spec(spec)
        result: dict[str, Any] = {}

        def decide() -> list[Op]:
            cond.check(gw.mirror.get(s.MODELS + name), f"model {name!r}")
            models = gw.mirror.models()
            taken = {n: n for n in models} | {
                a: m.name for m in models.values() for a in m.aliases}
            for ident in (name, *spec.aliases):
                owner = taken.get(ident)
                if owner is not None and owner != name:
                    raise Problem(409, "Name already in use",
                                  f"{ident!r} already names model {owner!r}")
            # Spill-over (docs/architecture.md, Catalog): an overflow names an
            # external model, which stays external while one names it.
            problem = rules.overflow_problem(name, spec, models)
            if problem is not None:
                raise Problem(422, "Invalid request body", f"overflow: {problem}",
                              errors=[rules.FieldError(("overflow",), problem)
                                      .as_dict(("body",))])
            users = rules.overflowing_to(name, models)
            if spec.external is None and users:
                raise Problem(409, "Model in use", f"model {name!r} is the overflow of "
                              f"{', '.join(users)}: it must stay external")
            existed = name in models
            created = models[name].created if existed else time.time()
            value = catalog.stored_value(name, created, spec)
            result.update(stored=json.loads(value), existed=existed)
            return [Put(s.MODELS + name, value)]

        await write_catalog(decide, request, cond.given)
        response.status_code = 200 if result["existed"] else 201
        if (tag := model_etag(name)) is not None:
            response.headers["ETag"] = tag
        stored: dict[str, Any] = result["stored"]
        return stored

    @r.delete("/models/{name:path}", status_code=204, responses=problems(404, 409))
    async def delete_model(name: str, request: Request) -> Response:
        cond = Precondition.of(request)

        def decide() -> list[Op]:
            cond.check(gw.mirror.get(s.MODELS + name), f"model {name!r}")
            if name not in gw.mirror.models():
                raise Problem(404, "No such model", f"model {name!r} is not in the catalog")
            users = rules.overflowing_to(name, gw.mirror.models())
            if users:
                raise Problem(409, "Model in use", f"model {name!r} is the overflow of "
                              f"{', '.join(users)}: change their overflow first")
            return [Delete(s.MODELS + name)]

        await write_catalog(decide, request, cond.given)
        return Response(status_code=204)

    # --- fleet -----------------------------------------------------------------------

    @r.get("/nodes")
    async def nodes() -> list[dict[str, Any]]:
        """What each live node's agent reports, its replicas, and the
        operator's choices for it (`conf`: cordoned, draining, pool, labels,
        engine build), which outlive its agent."""
        replicas = gw.mirror.replicas()
        confs = gw.mirror.nodeconfs()
        holders = fleet.gpu_holders(replicas)
        out = []
        for node in gw.mirror.nodes().values():
            mine = sorted(rid for rid, rep in replicas.items() if rep.node == node.name)
            conf = confs.get(node.name) or s.NodeConf()
            held = holders.get(node.name, {})
            free, used = fleet.gpu_use(node, held)
            view = node.model_dump() | {"replicas": mine, "conf": conf.model_dump(),
                                        "gpus_free": free, "gpus_used": used}
            # Which replica holds each GPU (None: free).
            for gpu in view["gpus"]:
                gpu["replica"] = held.get(gpu["index"])
            out.append(view)
        return out

    @r.get("/routes", responses=problems(404))
    async def routes_for(model: str) -> dict[str, Any]:
        """How this gateway routes `model` now: each endpoint's load, cooldown,
        affinity share, and whether it is being chosen and why (not)."""
        name = gw.table.resolve(model)
        if name is None:
            raise Problem(404, "No such model", f"no model or alias {model!r} is routed here")
        return {"gateway": gw.settings.gateway_id, "model": name,
                "endpoints": gw.table.explain(name), "unavailable": gw.table.unavailable(name),
                "overflow": gw.table.overflow(name)}  # spill-over's external model, if any

    @r.get("/replicas")
    async def replicas() -> list[dict[str, Any]]:
        statuses = gw.mirror.statuses()
        nodes = gw.mirror.nodes()
        # Each engine's own counts as this gateway last polled them (fresh
        # polls only): null where unknown, never a made-up zero.
        loads = gw.table.fresh_loads()
        out = []
        for rid, rep in gw.mirror.replicas().items():
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
                "inflight": gw.table.inflight(rid),
                "running": load.running if (load := loads.get(rid)) else None,
                "waiting": load.waiting if load else None,
                "kv_cache": load.kv_cache if load else None,  # 0 to 1
            })
        return out

    return r
