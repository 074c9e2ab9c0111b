"""Client key writes: a key created (shown once: the store keeps its sha256
and its first characters) and a key revoked. docs/design/client-keys.md and
docs/design/security-operations.md, "Writes whose outcome is unknown".
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from app.control import state as s
from app.control.keys import hash_client_key, new_client_key
from app.control.ops.base import SETTLE, State
from app.control.ops.conditions import Deadline
from app.control.ops.refusals import NotFound, NotSaved, OutcomeUnknown
from app.store.base import Compare, Delete, Put, StoreUnavailable

logger = logging.getLogger(__name__)

# Characters of a new key kept and listed: "sk-llmgw-" and 7 random ones
# (42 of its 256 random bits), enough to tell keys apart, far too few to guess it.
PREFIX_CHARS = 16

Spawn = Callable[[Coroutine[Any, Any, None], str], None]


@dataclass(frozen=True)
class KeyMade:
    key: str  # the client key itself: shown once, never stored
    record: s.ClientKey


class KeyOps:
    def __init__(self, state: State, spawn: Spawn) -> None:
        """`spawn` runs a follow-up that must outlive the request (the
        revocation of a key whose write's outcome is unknown)."""
        self._state = state
        self._spawn = spawn

    async def create(self, name: str, models: list[str], limits: s.KeyLimits,
                     expires: float | None, now: float, deadline: Deadline) -> KeyMade:
        """Makes and saves a new key. Refuses: TooLate (nothing made),
        NotSaved, OutcomeUnknown (the store did not answer)."""
        key = new_client_key()
        record = s.ClientKey(id=secrets.token_hex(6), name=name, created=now, models=models,
                             prefix=key[:PREFIX_CHARS], limits=limits, expires=expires)
        path, value = s.KEYS + hash_client_key(key), record.model_dump_json().encode()
        store = self._state.store
        try:
            # Create-only: a retry of this very write (the store client retries
            # a call whose answer was lost) is refused, and read back below.
            deadline.check()  # a key no client will see is not made
            res = await store.txn([Compare.absent(path)], [Put(path, value)])
            rev = res.revision if res.succeeded else await self._read_back(path, value)
        except StoreUnavailable as exc:
            rev = await self._unknown_outcome(path, value, record.id, exc)
        await self._state.mirror.wait_for(rev, SETTLE)
        return KeyMade(key, record)

    async def _read_back(self, name: str, value: bytes) -> int:
        """The revision at which this gateway's record was saved. Raises
        StoreUnavailable when the store cannot say."""
        kv = await self._state.store.get(name)
        if kv is None or kv.value != value:
            # A refused create-only write whose key holds another record: two
            # random 256-bit keys alike. Not saved, and nothing to clean up.
            raise NotSaved("the store did not save the new key; create another")
        return kv.mod_revision

    async def _unknown_outcome(self, name: str, value: bytes, key_id: str,
                               exc: StoreUnavailable) -> int:
        """A write whose answer was lost (etcd timed out after it may have
        landed): read back, so a saved key is shown, never orphaned."""
        try:
            kv = await self._state.store.get(name)
        except StoreUnavailable:
            # Whether it was saved is unknown, and its key will never be shown
            # again: revoke it once the store answers, and say so.
            logger.warning("client key %s: the store did not answer its write nor the read "
                           "after it; revoking it once the store answers (%s)", key_id, exc)
            self._spawn(self.revoke_unshown(name, value, key_id), f"revoke-key-{key_id}")
            raise OutcomeUnknown(
                f"the store (etcd) did not answer, so whether client key {key_id} was saved "
                "is unknown. Its key is not shown, so this gateway revokes it as soon as the "
                f"store answers; should this gateway stop first, check GET /admin/keys/{key_id} "
                "and DELETE it. Create another key.", key_id) from exc
        if kv is not None and kv.value == value:
            logger.warning("client key %s: the store's answer to its write was lost; read back: "
                           "saved", key_id)
            return kv.mod_revision
        raise OutcomeUnknown(
            f"the store (etcd) did not answer the write, and client key {key_id} was "
            f"not found after it: not saved. Create another; should GET "
            f"/admin/keys/{key_id} ever show it (a write etcd applied later), "
            "DELETE it.", key_id, known_absent=True) from exc

    async def revoke_unshown(self, name: str, value: bytes, key_id: str,
                             tries: int = 3600, pause: float = 1.0) -> None:
        """Deletes the record of a key never shown, if it was saved: retried
        every `pause` seconds until the store answers, `tries` times at most
        (an hour)."""
        for _ in range(tries):
            try:
                res = await self._state.store.txn([Compare(name, "value", "==", value)],
                                                  [Delete(name)])
            except StoreUnavailable:
                await asyncio.sleep(pause)
                continue
            if res.succeeded:
                logger.warning("revoked client key %s: it was saved while the store's answer "
                               "was lost, and its key was never shown", key_id)
            return
        logger.error("client key %s: the store stayed unreachable for an hour; check GET "
                     "/admin/keys/%s and DELETE it", key_id, key_id)

    async def revoke(self, key_id: str, deadline: Deadline) -> None:
        """Revokes the key on every gateway (by watch, within a fraction of a
        second); its usage records stay. Refuses: NotFound, TooLate."""
        mirror = self._state.mirror
        for digest, rec in mirror.client_keys().items():
            kv = mirror.get(s.KEYS + digest)
            if rec.id != key_id or kv is None:
                continue
            # The very record read: a key re-created meanwhile is not deleted.
            deadline.check()
            res = await self._state.store.txn(
                [Compare.created_at(kv.key, kv.create_revision)], [Delete(kv.key)])
            if res.succeeded:
                await mirror.wait_for(res.revision, SETTLE)
                return
        raise NotFound("key", f"no client key has id {key_id!r}")
