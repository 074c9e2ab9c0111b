"""A watch-fed copy of the whole store, kept by every gateway.

Everything that serves a request reads this copy, never the store
(DESIGN invariant 2): with etcd unreachable, routing goes on from the last
state seen. The copy is level-based: `resync()` reads the prefix in full and
replaces it; `apply()` folds in one watch batch. A batch that reports a
compaction (the store could not replay what we missed) triggers a resync,
since applying events after a gap would silently lose the ones in between.

Scale (docs/design/scale.md): the typed views (`models()`,
`replicas()`, ...) are built once per change of their prefix, not on every
call, and each value is parsed once per revision of its key; they are
shared, so they come read-only (and their values must not be mutated: use
`model_copy`). A long poll that cares about one node's replicas waits with
`wait_node_past`, which a change elsewhere in the fleet does not wake.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, TypeVar, cast

from pydantic import BaseModel, ValidationError

from app.control import state as s
from app.store.base import KeyValue, Store, StoreError, StoreUnavailable, WatchBatch

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)
Listener = Callable[[set[str]], None]


class Mirror:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._kvs: dict[str, KeyValue] = {}
        # The same keys by their first segment ("nodes/", "catalog/"): a read
        # of one prefix scans its segment, not the whole fleet's keys.
        self._segments: dict[str, dict[str, KeyValue]] = {}
        self.revision = 0
        self.ready = False
        self._listeners: list[Listener] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Typed views, by (prefix, class): dropped when a key under the
        # prefix changes. Parsed values, by key: reused while the key's
        # revision is the same (a resync re-reads every key, changing few).
        self._views: dict[tuple[str, type[BaseModel]], MappingProxyType[str, Any]] = {}
        self._values: dict[str, tuple[int, type[BaseModel], BaseModel | None]] = {}
        # Per node: the revision of the last change to a replica on it
        # (either before or after the change), and the long polls waiting.
        self._node_changed: dict[str, int] = {}
        self._resynced_at = 0
        self._node_events: dict[str, asyncio.Event] = {}

    # --- feeding -------------------------------------------------------------

    async def resync(self) -> None:
        result = await self._store.range("")
        old = self._kvs
        self._kvs = {kv.key: kv for kv in result.kvs}
        self._segments = {}
        for kv in result.kvs:
            self._segments.setdefault(_segment(kv.key), {})[kv.key] = kv
        self.revision = result.revision
        self.ready = True
        changed = {k for k in old.keys() | self._kvs.keys() if old.get(k) != self._kvs.get(k)}
        self._views.clear()
        self._values = {k: v for k, v in self._values.items() if k in self._kvs}
        # Whatever we missed may have touched any node: every long poll looks.
        self._resynced_at = self.revision
        self._node_changed.clear()
        self._notify(changed)
        self._wake()
        self._wake_nodes(None)

    def apply(self, batch: WatchBatch) -> bool:
        """Folds one batch in. False means the batch reported a gap: resync."""
        if batch.compacted:
            return False
        changed: set[str] = set()
        nodes: set[str] = set()
        for ev in batch.events:
            if ev.mod_revision <= self.revision:
                continue  # already seen (a resync raced the watch)
            if ev.key.startswith(s.REPLICAS):
                nodes.update(_node_of(kv.value) for kv in (self._kvs.get(ev.key),)
                             if kv is not None)
                if ev.kind == "put":
                    nodes.add(_node_of(ev.value))
            elif ev.key.startswith(s.NODECONF):
                # Its engine build is in the node's assignments answer.
                nodes.add(ev.key.removeprefix(s.NODECONF))
            if ev.kind == "put":
                kv = self._kvs[ev.key] = KeyValue(
                    ev.key, ev.value, ev.create_revision, ev.mod_revision, ev.lease
                )
                self._segments.setdefault(_segment(ev.key), {})[ev.key] = kv
            else:
                self._kvs.pop(ev.key, None)
                self._segments.get(_segment(ev.key), {}).pop(ev.key, None)
            changed.add(ev.key)
        self.revision = max(self.revision, batch.revision)
        self._drop_views(changed)
        nodes.discard("")
        for node in nodes:
            self._node_changed[node] = self.revision
        self._notify(changed)
        self._wake()
        self._wake_nodes(nodes)
        return True

    async def run(self) -> None:
        """Keeps the copy current until cancelled; resyncs after any gap."""
        backoff = 0.2
        while True:
            try:
                await self.resync()
                async for batch in self._store.watch("", self.revision + 1):
                    backoff = 0.2
                    if not self.apply(batch):
                        logger.warning("watch reported a gap at revision %d; resyncing",
                                       batch.revision)
                        break
                continue  # a gap: re-read at once
            except StoreUnavailable as exc:
                # Said once by the store itself when it became unreachable
                # (its health() shows on /readyz); not once per retry here.
                logger.debug("mirror lost the store (%s); retrying in %.1f s", exc, backoff)
            except StoreError as exc:
                logger.warning("mirror lost the store (%s); retrying in %.1f s", exc, backoff)
            except Exception:
                # A bug must not leave the router on a copy that never changes.
                logger.exception("mirror crashed; resyncing in %.1f s", backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="mirror")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # --- listening -------------------------------------------------------------

    def subscribe(self, listener: Listener) -> None:
        """`listener(changed_keys)` runs in the loop after every change. It must not block."""
        self._listeners.append(listener)

    def _wake(self) -> None:
        # Wake everyone waiting on the revision they saw; later waiters get a
        # fresh event.
        self._changed.set()
        self._changed = asyncio.Event()

    def _notify(self, changed: set[str]) -> None:
        if not changed:
            return
        for listener in self._listeners:
            try:
                listener(changed)
            except Exception:
                logger.exception("mirror listener failed")

    async def wait_past(self, revision: int, timeout: float) -> bool:
        """Waits until the mirror has moved past `revision`; False on timeout.

        Callers pass the revision of the state they last read, so a change
        that lands between their read and this call is not missed: waiting
        on "the next change" instead loses exactly that one.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.revision <= revision:
            left = deadline - loop.time()
            if left <= 0:
                return False
            event = self._changed  # taken with the check above: no await between
            # asyncio.timeout, not wait_for: on Python 3.11, wait_for returns
            # the result of an inner wait that completed as the caller was
            # cancelled, and the cancellation is lost (the reconciler then
            # looped on, and a gateway's stop never ended).
            try:
                async with asyncio.timeout(left):
                    await event.wait()
            except TimeoutError:
                break
        return self.revision > revision

    def node_revision(self, node: str) -> int:
        """The revision of the last change to the replicas on `node` (one
        placed there, changed, or moved or deleted from there) or to its
        conf (`nodeconf/{node}`: its engine build), as far as
        this mirror can tell: a resync counts as a change to every node."""
        return max(self._node_changed.get(node, 0), self._resynced_at)

    def _wake_nodes(self, nodes: set[str] | None) -> None:
        """Wakes the long polls on `nodes` (None: all of them)."""
        if nodes is None:
            woken, self._node_events = self._node_events, {}
            events = list(woken.values())
        else:
            events = [e for n in nodes if (e := self._node_events.pop(n, None)) is not None]
        for event in events:
            event.set()

    async def wait_node_past(self, node: str, revision: int, timeout: float) -> bool:
        """Waits until the replicas on `node` change after `revision` (the
        mirror revision the caller read them at); False on timeout.

        An agent's long poll waits here rather than in `wait_past`: with
        thousands of nodes, every status report would otherwise wake every
        poll to recompute an unchanged answer (docs/design/scale.md).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.node_revision(node) <= revision:
            left = deadline - loop.time()
            if left <= 0:
                return False
            # Taken with the check above, no await between: nothing is missed.
            event = self._node_events.setdefault(node, asyncio.Event())
            try:
                async with asyncio.timeout(left):  # not wait_for: see wait_past
                    await event.wait()
            except TimeoutError:
                break
        return self.node_revision(node) > revision

    async def wait_for(self, revision: int, timeout: float) -> bool:
        """Read-your-writes: waits until the mirror has seen `revision`."""
        return await self.wait_past(revision - 1, timeout)

    # --- reading ---------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        return self._kvs.get(key)

    def items(self, prefix: str) -> Iterator[KeyValue]:
        # Sort only the matches: one scan of the prefix's segment's keys (all
        # of them for a prefix without a "/"), not a sort of them all.
        pool = self._segments.get(_segment(prefix), {}) if "/" in prefix else self._kvs
        for key in sorted(k for k in pool if k.startswith(prefix)):
            yield pool[key]

    def parsed(self, prefix: str, cls: type[T]) -> dict[str, T]:
        """Values under `prefix` parsed as `cls`, by the key's last part.

        An unreadable value is logged and left out rather than failing every
        reader: one bad write must not stop the fleet. Each value is parsed
        once per revision of its key; the dict is the caller's own.
        """
        out: dict[str, T] = {}
        for kv in self.items(prefix):
            value = self._value(kv, cls)
            if value is not None:
                out[kv.key[len(prefix):]] = value
        return out

    def _value(self, kv: KeyValue, cls: type[T]) -> T | None:
        cached = self._values.get(kv.key)
        if cached is not None and cached[:2] == (kv.mod_revision, cls):
            return cast("T | None", cached[2])
        value: T | None = None
        try:
            value = cls.model_validate_json(kv.value)
        except ValidationError:
            logger.warning("ignoring unreadable %s", kv.key)
        self._values[kv.key] = (kv.mod_revision, cls, value)
        return value

    def _view(self, prefix: str, cls: type[T]) -> Mapping[str, T]:
        """`parsed(prefix, cls)`, built once until a key under `prefix`
        changes, and read-only since every caller shares it."""
        view = self._views.get((prefix, cls))
        if view is None:
            view = MappingProxyType(self.parsed(prefix, cls))
            self._views[(prefix, cls)] = view
        return cast("Mapping[str, T]", view)

    def _drop_views(self, changed: set[str]) -> None:
        """Brings the views `changed` touches up to date: a copy of the old
        one with those keys parsed again, not every value looked up anew (a
        status report rebuilt the 20,000 statuses of a 10,000-node fleet,
        ~200 ms on the event loop, for each publish; docs/design/scale.md).
        Kept in key order, as `parsed()` builds them."""
        for key in changed:
            self._values.pop(key, None)
        for (prefix, cls), view in list(self._views.items()):
            mine = [key for key in changed if key.startswith(prefix)]
            if not mine:
                continue
            out = view.copy()  # the dict's own copy: dict(view) went key by key, 6x slower
            added = False
            for key in mine:
                name = key[len(prefix):]
                kv = self._kvs.get(key)
                value = self._value(kv, cls) if kv is not None else None
                if value is None:
                    out.pop(name, None)  # gone, or unreadable now (logged)
                else:
                    added = added or name not in out
                    out[name] = value
            if added:
                out = dict(sorted(out.items()))
            self._views[(prefix, cls)] = MappingProxyType(out)

    def one(self, key: str, cls: type[T]) -> T | None:
        kv = self._kvs.get(key)
        if kv is None:
            return None
        return self._value(kv, cls)

    # Typed views of the state table in docs/architecture.md.
    def models(self) -> Mapping[str, s.StoredModel]:
        return self._view(s.MODELS, s.StoredModel)

    def nodes(self) -> Mapping[str, s.NodeInfo]:
        return self._view(s.NODES, s.NodeInfo)

    def replicas(self) -> Mapping[str, s.Replica]:
        return self._view(s.REPLICAS, s.Replica)

    def statuses(self) -> Mapping[str, s.ReplicaStatus]:
        return self._view(s.STATUS, s.ReplicaStatus)

    def nodeconfs(self) -> Mapping[str, s.NodeConf]:
        return self._view(s.NODECONF, s.NodeConf)

    def quotas(self) -> Mapping[str, s.Quota]:
        return self._view(s.QUOTAS, s.Quota)

    def client_keys(self) -> Mapping[str, s.ClientKey]:
        return self._view(s.KEYS, s.ClientKey)

    def usages(self) -> Mapping[str, s.Usage]:
        return self._view(s.USAGE, s.Usage)

    def gateways(self) -> Mapping[str, s.GatewayInfo]:
        return self._view(s.GATEWAYS, s.GatewayInfo)

    def leader(self) -> s.LeaderInfo | None:
        return self.one(s.LEADER, s.LeaderInfo)

    def store_id(self) -> str:
        """The store's id (app/control/storeid.py), "" until created."""
        found = self.one(s.STORE_ID, s.StoreId)
        return found.id if found is not None else ""


def _node_of(value: bytes) -> str:
    """The `node` of a stored replica, "" when unreadable: only the
    long-poll wake-ups use it, and the typed view logs a bad value."""
    try:
        data = json.loads(value)
    except ValueError:
        return ""
    node = data.get("node") if isinstance(data, dict) else None
    return node if isinstance(node, str) else ""


def _segment(key: str) -> str:
    """A key's first segment, its "/" included ("nodes/a" -> "nodes/"); a
    key without one is its own."""
    i = key.find("/")
    return key[: i + 1] if i >= 0 else key
