"""Admin routes for client keys (`/admin/keys`): create, list, show, revoke,
and read a key's usage. docs/design/client-keys.md.

A key is shown once, in the answer that creates it; the store keeps its
sha256 (the name it is looked up under) and its first characters, which
listings show so an operator can tell keys apart (DESIGN invariant 6).
Reads come from the mirror and answer 503 until it has loaded (DESIGN
invariant 9): an empty list would read as "no keys".
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from app.api.auth import admin_guard
from app.api.deps import MirrorState
from app.api.errors import Problem
from app.api.openapi import problems
from app.api.refusals import answered
from app.api.writes import deadline as deadline_of
from app.control import state as s
from app.control.key_usage import add, totals
from app.control.ops.key_ops import KeyOps


class LimitsBody(s.KeyLimits):
    model_config = ConfigDict(extra="forbid")  # a misspelt limit must not pass unseen


class KeyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt limit must not pass unseen
    name: str = Field(..., min_length=1, max_length=128)
    models: list[str] = Field(default_factory=list,
                              description="model names this key may use; empty: all")
    limits: LimitsBody = Field(default_factory=LimitsBody,
                                description="for all gateways together; left out: none")
    # NaN or Infinity (Python's JSON takes them) would be stored as null: never.
    expires: float | None = Field(default=None, allow_inf_nan=False,
                                  description="Unix time the key stops working")
    expires_in: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                                     description="or: seconds from now until it does")


class KeyCreated(BaseModel):
    id: str
    name: str
    key: str = Field(description="shown once; only its hash is stored")
    prefix: str
    models: list[str]
    limits: s.KeyLimits
    expires: float | None
    created: float


def routes(state: MirrorState, ops: KeyOps, *, admin_token: str,
           write_deadline: float) -> APIRouter:
    """`write_deadline`: LLMGW_ADMIN_WRITE_DEADLINE."""
    require_admin = admin_guard(admin_token)

    r = APIRouter(prefix="/admin", tags=["client keys"], dependencies=[Depends(require_admin)])

    def loaded() -> None:
        if not state.ready:
            raise Problem(503, "State not loaded",
                          "this gateway has not loaded the keys yet; ask another")

    def view(rec: s.ClientKey) -> dict[str, Any]:
        expired = rec.expires is not None and time.time() >= rec.expires
        return rec.model_dump() | {"expired": expired}

    def find(key_id: str) -> s.ClientKey | None:
        return next((rec for rec in state.mirror.client_keys().values() if rec.id == key_id), None)

    @r.post("/keys", status_code=201, response_model=KeyCreated)
    async def create_key(req: KeyRequest, request: Request) -> KeyCreated:
        deadline = deadline_of(request, write_deadline)
        now = time.time()
        if req.expires is not None and req.expires_in is not None:
            raise Problem(422, "Invalid request body", "give expires or expires_in, not both")
        expires = now + req.expires_in if req.expires_in is not None else req.expires
        if expires is not None and expires <= now:
            raise Problem(422, "Invalid request body", "expires is in the past")
        with answered():
            made = await ops.create(req.name, req.models,
                                    s.KeyLimits(**req.limits.model_dump()), expires, now,
                                    deadline)
        return KeyCreated(key=made.key, **made.record.model_dump())

    @r.get("/keys")
    async def list_keys() -> list[dict[str, Any]]:
        """Every key with its prefix, limits and expiry; never the key."""
        loaded()
        return [view(rec) for rec in state.mirror.client_keys().values()]

    @r.get("/keys/{key_id}", responses=problems(404))
    async def get_key(key_id: str) -> dict[str, Any]:
        loaded()
        rec = find(key_id)
        if rec is None:
            raise Problem(404, "No such key", f"no client key has id {key_id!r}")
        return view(rec)

    @r.get("/keys/{key_id}/usage", responses=problems(404))
    async def key_usage(key_id: str) -> dict[str, Any]:
        """Requests and tokens per model, every gateway's counts together.
        Gateways write theirs every LLMGW_KEY_USAGE_INTERVAL seconds, so the
        last few seconds may be missing; `gateways` says when each wrote.
        A revoked key's usage stays readable."""
        loaded()
        records = state.mirror.parsed(f"{s.KEY_USAGE}{key_id}/", s.KeyUsage)
        rec = find(key_id)
        if rec is None and not records:
            raise Problem(404, "No such key", f"no client key has id {key_id!r}")
        models = totals(records)
        total = s.ModelUsage()
        for u in models.values():
            add(total, u)
        return {"id": key_id, "name": rec.name if rec is not None else None,
                "revoked": rec is None,
                "models": {m: u.model_dump() for m, u in sorted(models.items())},
                "total": total.model_dump(),
                "gateways": {g: r.updated for g, r in sorted(records.items())}}

    @r.delete("/keys/{key_id}", status_code=204, responses=problems(404))
    async def delete_key(key_id: str, request: Request) -> Response:
        """Revokes the key on every gateway (by watch, within a fraction of a
        second); its usage records stay."""
        with answered():
            await ops.revoke(key_id, deadline_of(request, write_deadline))
        return Response(status_code=204)

    return r
