"""Client key usage, written in batches: `keyusage/{key id}/{gateway}`.

The router counts each key's usage per model in memory (a `UsageSource`;
app/router/usage/limits.py implements it, and this module never imports the
router, DESIGN invariant 8). Every few seconds `KeyUsageWriter.flush()` adds
what was counted since to this gateway's record of each key, in one
transaction per batch of keys: store writes grow with the keys in use, not
with the requests (DESIGN invariant 2: no request waits on them).

Each record has one writer, its gateway, so the writes do not race; each is
still conditioned on the record's revision as read (DESIGN invariant 9), so
a write based on a lagging mirror is refused and redone on a fresh read
rather than losing counts. While the store is unreachable the counts wait in
memory and go with the next flush that succeeds; a crash loses at most one
interval's counts, a clean stop none (app/gateway/assembly.py flushes last).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from app.control import state as s
from app.control.mirror import Mirror
from app.store.base import Compare, KeyValue, Op, Put, Store, StoreUnavailable

logger = logging.getLogger(__name__)

# Keys per transaction: etcd refuses more than 128 operations in one
# (--max-txn-ops); each key costs one compare and one put.
_BATCH = 64


class UsageSource(Protocol):
    """Usage counted since the last call: (key id, model) -> (requests,
    prompt tokens, completion tokens)."""

    def take_usage(self) -> Mapping[tuple[str, str], tuple[int, int, int, int]]: ...


def usage_key(key_id: str, gateway: str) -> str:
    return f"{s.KEY_USAGE}{key_id}/{gateway}"


class KeyUsageWriter:
    def __init__(self, store: Store, mirror: Mirror, gateway: str, source: UsageSource,
                 clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._mirror = mirror
        self._gateway = gateway
        self._source = source
        self._clock = clock
        # Counted but not yet written: key id -> model -> counts.
        self._pending: dict[str, dict[str, s.ModelUsage]] = {}

    @property
    def pending(self) -> int:
        """Keys with counts not yet written."""
        return len(self._pending)

    async def run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.flush()
            except Exception:
                logger.exception("writing key usage failed")

    async def flush(self) -> int:
        """Writes what was counted since the last flush; returns the number
        of keys written. Counts not written stay for the next flush."""
        for (key_id, model), counts in self._source.take_usage().items():
            u = self._pending.setdefault(key_id, {}).setdefault(model, s.ModelUsage())
            add(u, s.ModelUsage(requests=counts[0], prompt_tokens=counts[1],
                                completion_tokens=counts[2], estimated=counts[3]))
        written = 0
        ids = sorted(self._pending)
        for start in range(0, len(ids), _BATCH):
            batch = ids[start:start + _BATCH]
            try:
                if await self._write(batch, fresh=False) or await self._write(batch, fresh=True):
                    written += len(batch)
                    for key_id in batch:
                        del self._pending[key_id]
                else:
                    logger.warning("key usage of %d keys not written: their records kept "
                                   "changing; retried at the next flush", len(batch))
            except StoreUnavailable as exc:
                logger.debug("key usage kept for the next flush: %s", exc)
                break
        return written

    async def _write(self, batch: list[str], fresh: bool) -> bool:
        """One transaction adding the pending counts of `batch` to the stored
        records, read from the mirror (or, `fresh`, from the store)."""
        compares: list[Compare] = []
        ops: list[Op] = []
        now = self._clock()
        for key_id in batch:
            key = usage_key(key_id, self._gateway)
            kv = await self._store.get(key) if fresh else self._mirror.get(key)
            record = _parse(kv) or s.KeyUsage(key=key_id, gateway=self._gateway)
            for model, more in self._pending[key_id].items():
                add(record.models.setdefault(model, s.ModelUsage()), more)
            record.updated = now
            compares.append(Compare.modified_at(key, kv.mod_revision) if kv is not None
                            else Compare.absent(key))
            ops.append(Put(key, record.model_dump_json().encode()))
        res = await self._store.txn(compares, ops)
        return res.succeeded


def _parse(kv: KeyValue | None) -> s.KeyUsage | None:
    if kv is None:
        return None
    try:
        return s.KeyUsage.model_validate_json(kv.value)
    except ValueError:
        # Unreadable: counting again from zero beats never writing again.
        logger.warning("replacing unreadable %s", kv.key)
        return None


def totals(records: Mapping[str, s.KeyUsage]) -> dict[str, s.ModelUsage]:
    """Every gateway's records of one key summed per model."""
    out: dict[str, s.ModelUsage] = {}
    for rec in records.values():
        for model, u in rec.models.items():
            add(out.setdefault(model, s.ModelUsage()), u)
    return out


def add(total: s.ModelUsage, more: s.ModelUsage) -> None:
    """Adds `more`'s counts to `total`."""
    total.requests += more.requests
    total.prompt_tokens += more.prompt_tokens
    total.completion_tokens += more.completion_tokens
    total.estimated += more.estimated
