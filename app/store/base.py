"""The store contract: what llmgw needs from etcd, and nothing more.

Two implementations satisfy it: `EtcdStore` (etcd v3, for a fleet of gateways)
and `EmbeddedStore` (SQLite, for one gateway alone). One contract suite in
tests/ runs against both, so code above this line never asks which it has.

Keys are relative: the etcd adapter adds `LLMGW_ETCD_PREFIX`, so the rest of
the code writes `catalog/models/x`, never `/llmgw/catalog/models/x`.

Revisions follow etcd's meaning: one store-wide counter, bumped by every
write (a transaction is one write); `create_revision` is the revision that
created a key (0 = the key does not exist), `mod_revision` the last one that
changed it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol


class StoreError(Exception):
    """Base for every store failure the rest of the code may catch."""


class StoreUnavailable(StoreError):
    """The store cannot serve us now: unreachable (etcd down, no quorum, a name
    that does not resolve) or refusing (out of space, auth). Writes answer 503."""


class StoreFull(StoreUnavailable):
    """The store answers but refuses writes for lack of space: etcd's NOSPACE
    alarm ("mvcc: database space exceeded"), raised when its database reached
    `--quota-backend-bytes`; a full disk under the embedded store. Reads,
    deletes and lease renewals still work. A 503 like any unavailable store,
    said as what it is: an operator must compact, defragment and disarm the
    alarm (docs/design/security-operations.md, "A month of uptime")."""


class LeaseExpired(StoreError):
    """A keepalive or put named a lease the store no longer knows."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Event:
    kind: Literal["put", "delete"]
    key: str
    # For a delete, value is b"" and the revisions are those of the deletion.
    value: bytes
    mod_revision: int
    lease: int = 0
    create_revision: int = 0


@dataclass(frozen=True, slots=True)
class WatchBatch:
    """Events of one or more revisions, in revision order.

    `compacted` means the store could not replay from the asked revision (its
    history was compacted or the watch was cut for too long): the reader must
    resync by reading the prefix in full. `revision` is the store revision the
    batch brings the reader up to.
    """

    events: Sequence[Event]
    revision: int
    compacted: bool = False


@dataclass(frozen=True, slots=True)
class Compare:
    """One condition of a transaction. `target` names the field compared."""

    key: str
    target: Literal["create", "mod", "value"]
    op: Literal["==", "!="]
    # An int for "create"/"mod" (0 = absent), bytes for "value".
    expected: int | bytes

    @staticmethod
    def absent(key: str) -> Compare:
        return Compare(key, "create", "==", 0)

    @staticmethod
    def created_at(key: str, revision: int) -> Compare:
        return Compare(key, "create", "==", revision)

    @staticmethod
    def modified_at(key: str, revision: int) -> Compare:
        return Compare(key, "mod", "==", revision)


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: str


Op = Put | Delete


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int


@dataclass(frozen=True, slots=True)
class RangeResult:
    kvs: list[KeyValue] = field(default_factory=list)
    # The store revision the read saw; watch from revision + 1 to miss nothing.
    revision: int = 0


@dataclass(frozen=True, slots=True)
class StoreHealth:
    """What the store's own calls last said about reaching it.

    `unknown` until the first call ends; `unreachable` from the first failed
    call (`since`, wall-clock seconds) until one succeeds, with the latest
    failure's `reason`; `nospace` from the first write refused for lack of
    space (`StoreFull`) until a write succeeds or the store says its alarm
    is gone (reads keep succeeding meanwhile, and do not end it).
    """

    state: Literal["unknown", "reachable", "unreachable", "nospace"] = "unknown"
    reason: str = ""
    since: float | None = None


class Store(Protocol):
    def health(self) -> StoreHealth:
        """Whether the store answered its last call; never does I/O."""
        ...

    async def get(self, key: str) -> KeyValue | None: ...

    async def range(self, prefix: str) -> RangeResult:
        """Every key starting with `prefix` ("" = all), sorted by key."""
        ...

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Returns the revision of the write. Raises LeaseExpired for a dead lease."""
        ...

    async def delete(self, key: str) -> bool:
        """True when the key existed."""
        ...

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """All compares hold -> apply `success`, else `failure`; atomically."""
        ...

    async def grant(self, ttl: int) -> int:
        """A new lease of `ttl` seconds; returns its id (never 0)."""
        ...

    async def keepalive(self, lease: int) -> int:
        """Renews the lease; returns its TTL. Raises LeaseExpired if it is gone."""
        ...

    async def revoke(self, lease: int) -> None:
        """Ends the lease at once and deletes its keys. Unknown leases are ignored."""
        ...

    async def compact(self, revision: int) -> None:
        """Discards the history before `revision`: a watch from an earlier
        revision then gets `compacted`. Current keys are kept. A revision
        already compacted is no error; one not yet written is a StoreError.
        Store-wide (every prefix of a shared etcd), so only the leader calls
        it, with a revision one interval old (app/control/compaction.py)."""
        ...

    def watch(self, prefix: str, start_revision: int) -> AsyncIterator[WatchBatch]:
        """Changes under `prefix` from `start_revision` on, until cancelled.

        The iterator survives reconnects by itself; when it cannot replay
        what was missed it yields a batch with `compacted=True`.
        """
        ...

    async def close(self) -> None: ...
