"""Admin routes for client keys (`/admin/keys`): create, list, show, revoke,
and read a key's usage. docs/architecture.md, "Client keys".

A key is shown once, in the answer that creates it; the store keeps its
sha256 (the name it is looked up under) and its first characters, which
listings show so an operator can tell keys apart (DESIGN invariant 6).
Reads come from the mirror and answer 503 until it has loaded (DESIGN
invariant 9): an empty list would read as "no keys".
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, ConfigDict, Field

from app.api.auth import admin_guard
from app.api.errors import Problem
from app.control import state as s
from app.control.key_usage import add, totals
from app.control.keys import hash_client_key, new_client_key
from app.store.base import Compare, Delete

if TYPE_CHECKING:
    from app.gateway import Gateway

_SETTLE = 2.0  # seconds a write waits for this gateway's mirror to see it
# Characters of a new key kept and listed: "sk-llmgw-" and 7 random ones
# (42 of its 256 random bits), enough to tell keys apart, far too few to guess it.
PREFIX_CHARS = 16


class LimitsBody(s.KeyLimits):
    model_config = ConfigDict(extra="forbid")  # a misspelt limit must not pass unseen


class KeyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt limit must not pass unseen
    name: str = Field(..., min_length=1, max_length=128)
    models: list[str] = Field(default_factory=list,
                              description="model names this key may use; empty: all")
    limits: LimitsBody = Field(default_factory=LimitsBody,
                                description="for all gateways together; left out: none")
    expires: float | None = Field(default=None, description="Unix time the key stops working")
    expires_in: float | None = Field(default=None, gt=0,
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


def routes(gw: Gateway) -> APIRouter:
    require_admin = admin_guard(gw)

    r = APIRouter(prefix="/admin", tags=["client keys"], dependencies=[Depends(require_admin)])

    def loaded() -> None:
        if not gw.ready:
            raise Problem(503, "State not loaded",
                          "this gateway has not loaded the keys yet; ask another")

    def view(rec: s.ClientKey) -> dict[str, Any]:
        expired = rec.expires is not None and time.time() >= rec.expires
        return rec.model_dump() | {"expired": expired}

    def find(key_id: str) -> s.ClientKey | None:
        return next((rec for rec in gw.mirror.client_keys().values() if rec.id == key_id), None)

    @r.post("/keys", status_code=201, response_model=KeyCreated)
    async def create_key(req: KeyRequest) -> KeyCreated:
        now = time.time()
        if req.expires is not None and req.expires_in is not None:
            raise Problem(422, "Invalid request body", "give expires or expires_in, not both")
        expires = now + req.expires_in if req.expires_in is not None else req.expires
        if expires is not None and expires <= now:
            raise Problem(422, "Invalid request body", "expires is in the past")
        key = new_client_key()
        record = s.ClientKey(id=secrets.token_hex(6), name=req.name, created=now,
                             models=req.models, prefix=key[:PREFIX_CHARS],
                             limits=s.KeyLimits(**req.limits.model_dump()), expires=expires)
        rev = await gw.store.put(s.KEYS + hash_client_key(key), record.model_dump_json().encode())
        await gw.mirror.wait_for(rev, _SETTLE)
        return KeyCreated(key=key, **record.model_dump())

    @r.get("/keys")
    async def list_keys() -> list[dict[str, Any]]:
        """Every key with its prefix, limits and expiry; never the key."""
        loaded()
        return [view(rec) for rec in gw.mirror.client_keys().values()]

    @r.get("/keys/{key_id}")
    async def get_key(key_id: str) -> dict[str, Any]:
        loaded()
        rec = find(key_id)
        if rec is None:
            raise Problem(404, "No such key", f"no client key has id {key_id!r}")
        return view(rec)

    @r.get("/keys/{key_id}/usage")
    async def key_usage(key_id: str) -> dict[str, Any]:
        """Requests and tokens per model, every gateway's counts together.
        Gateways write theirs every LLMGW_KEY_USAGE_INTERVAL seconds, so the
        last few seconds may be missing; `gateways` says when each wrote.
        A revoked key's usage stays readable."""
        loaded()
        records = gw.mirror.parsed(f"{s.KEY_USAGE}{key_id}/", s.KeyUsage)
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

    @r.delete("/keys/{key_id}", status_code=204)
    async def delete_key(key_id: str) -> Response:
        """Revokes the key on every gateway (by watch, within a fraction of a
        second); its usage records stay."""
        for digest, rec in gw.mirror.client_keys().items():
            kv = gw.mirror.get(s.KEYS + digest)
            if rec.id != key_id or kv is None:
                continue
            # The very record read: a key re-created meanwhile is not deleted.
            res = await gw.store.txn([Compare.created_at(kv.key, kv.create_revision)],
                                     [Delete(kv.key)])
            if res.succeeded:
                await gw.mirror.wait_for(res.revision, _SETTLE)
                return Response(status_code=204)
        raise Problem(404, "No such key", f"no client key has id {key_id!r}")

    return r
