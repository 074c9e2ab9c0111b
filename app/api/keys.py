"""Admin routes for client keys (`/admin/keys`): create, list, show, revoke,
and read a key's usage. docs/architecture.md, "Client keys".

A key is shown once, in the answer that creates it; the store keeps its
sha256 (the name it is looked up under) and its first characters, which
listings show so an operator can tell keys apart (DESIGN invariant 6).
Reads come from the mirror and answer 503 until it has loaded (DESIGN
invariant 9): an empty list would read as "no keys".
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from app.api.auth import admin_guard
from app.api.errors import Problem
from app.api.openapi import problems
from app.api.refusals import answered
from app.api.writes import deadline as deadline_of
from app.control import state as s
from app.control.key_usage import add, totals
from app.control.keys import hash_client_key, new_client_key
from app.store.base import Compare, Delete, Put, StoreUnavailable

if TYPE_CHECKING:
    from app.gateway import Gateway

logger = logging.getLogger(__name__)

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
    async def create_key(req: KeyRequest, request: Request) -> KeyCreated:
        deadline = deadline_of(request, gw.settings.admin_write_deadline)
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
        name, value = s.KEYS + hash_client_key(key), record.model_dump_json().encode()
        try:
            # Create-only: a retry of this very write (the store client retries
            # a call whose answer was lost) is refused, and read back below.
            with answered():
                deadline.check()  # a key no client will see is not made
            res = await gw.store.txn([Compare.absent(name)], [Put(name, value)])
            rev = res.revision if res.succeeded else await read_back(name, value)
        except StoreUnavailable as exc:
            rev = await unknown_outcome(name, value, record.id, exc)
        await gw.mirror.wait_for(rev, _SETTLE)
        return KeyCreated(key=key, **record.model_dump())

    async def read_back(name: str, value: bytes) -> int:
        """The revision at which this gateway's record was saved. Raises
        StoreUnavailable when the store cannot say."""
        kv = await gw.store.get(name)
        if kv is None or kv.value != value:
            # A refused create-only write whose key holds another record: two
            # random 256-bit keys alike. Not saved, and nothing to clean up.
            raise Problem(503, "Client key not saved",
                          "the store did not save the new key; create another")
        return kv.mod_revision

    async def unknown_outcome(name: str, value: bytes, key_id: str,
                              exc: StoreUnavailable) -> int:
        """A write whose answer was lost (etcd timed out after it may have
        landed): read back, so a saved key is shown, never orphaned
        (docs/architecture.md, Security: Writes whose outcome is unknown)."""
        try:
            kv = await gw.store.get(name)
        except StoreUnavailable:
            # Whether it was saved is unknown, and its key will never be shown
            # again: revoke it once the store answers, and say so.
            logger.warning("client key %s: the store did not answer its write nor the read "
                           "after it; revoking it once the store answers (%s)", key_id, exc)
            gw.spawn(revoke_unshown(name, value, key_id), f"revoke-key-{key_id}")
            raise Problem(
                503, "Outcome unknown",
                f"the store (etcd) did not answer, so whether client key {key_id} was saved "
                "is unknown. Its key is not shown, so this gateway revokes it as soon as the "
                f"store answers; should this gateway stop first, check GET /admin/keys/{key_id} "
                "and DELETE it. Create another key.", id=key_id) from exc
        if kv is not None and kv.value == value:
            logger.warning("client key %s: the store's answer to its write was lost; read back: "
                           "saved", key_id)
            return kv.mod_revision
        raise Problem(503, "State store unavailable",
                      f"the store (etcd) did not answer the write, and client key {key_id} was "
                      f"not found after it: not saved. Create another; should GET "
                      f"/admin/keys/{key_id} ever show it (a write etcd applied later), "
                      "DELETE it.", id=key_id) from exc

    async def revoke_unshown(name: str, value: bytes, key_id: str) -> None:
        """Deletes the record of a key never shown, if it was saved: retried
        every second until the store answers, for at most an hour."""
        for _ in range(3600):
            try:
                res = await gw.store.txn([Compare(name, "value", "==", value)], [Delete(name)])
            except StoreUnavailable:
                await asyncio.sleep(1.0)
                continue
            if res.succeeded:
                logger.warning("revoked client key %s: it was saved while the store's answer "
                               "was lost, and its key was never shown", key_id)
            return
        logger.error("client key %s: the store stayed unreachable for an hour; check GET "
                     "/admin/keys/%s and DELETE it", key_id, key_id)

    @r.get("/keys")
    async def list_keys() -> list[dict[str, Any]]:
        """Every key with its prefix, limits and expiry; never the key."""
        loaded()
        return [view(rec) for rec in gw.mirror.client_keys().values()]

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

    @r.delete("/keys/{key_id}", status_code=204, responses=problems(404))
    async def delete_key(key_id: str, request: Request) -> Response:
        """Revokes the key on every gateway (by watch, within a fraction of a
        second); its usage records stay."""
        deadline = deadline_of(request, gw.settings.admin_write_deadline)
        for digest, rec in gw.mirror.client_keys().items():
            kv = gw.mirror.get(s.KEYS + digest)
            if rec.id != key_id or kv is None:
                continue
            # The very record read: a key re-created meanwhile is not deleted.
            with answered():
                deadline.check()
            res = await gw.store.txn([Compare.created_at(kv.key, kv.create_revision)],
                                     [Delete(kv.key)])
            if res.succeeded:
                await gw.mirror.wait_for(res.revision, _SETTLE)
                return Response(status_code=204)
        raise Problem(404, "No such key", f"no client key has id {key_id!r}")

    return r
