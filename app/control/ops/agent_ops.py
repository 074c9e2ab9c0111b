"""What agents write, through any gateway: a node's heartbeat (its key
bound to a lease any gateway renews) and its replicas' status reports,
each fenced on the replica as read. docs/design/agent.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from app.control import state as s
from app.control.ops.base import State
from app.control.ops.refusals import Busy
from app.store.base import Compare, LeaseExpired, Put


class AgentOps:
    def __init__(self, state: State, node_ttl: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`node_ttl`: seconds a node's key outlives its last heartbeat."""
        self._state = state
        self._ttl = node_ttl
        self._clock = clock
        # When this gateway last renewed each node lease (taken before the
        # renewal was asked): a lease renewed less than a third of its TTL
        # ago outlives the agent's next heartbeat (it beats three times per
        # TTL) by a third of the TTL, so an unchanged inventory is answered
        # at once, with no renewal and no read: at 10,000 nodes, half the
        # heartbeats cost etcd nothing (docs/design/scale.md).
        self._renewed: dict[int, float] = {}

    def _renewed_now(self, lease: int, at: float) -> None:
        if len(self._renewed) > 4 * len(self._state.mirror.nodes()) + 64:  # nodes long gone
            for old in [k for k, t in self._renewed.items() if at - t > self._ttl]:
                del self._renewed[old]
        self._renewed[lease] = at

    async def heartbeat(self, info: s.NodeInfo) -> None:
        """Writes the node's inventory under `nodes/{name}` and keeps its
        lease alive. Refuses Busy when the key kept changing.

        Read from the mirror first (no store read in the common case), then
        from the store when the mirror proves stale. Every write is
        conditioned on the key as read, so a lagging gateway never rewrites
        the key onto a lease it no longer holds, nor renews a stale lease
        believing it keeps the node."""
        store, node = self._state.store, info.name
        key, body = s.NODES + node, info.model_dump_json().encode()
        started = self._clock()
        current = self._state.mirror.get(key)
        if (current is not None and current.lease and current.value == body
                and started - self._renewed.get(current.lease, -math.inf) < self._ttl / 3):
            return
        for _ in range(3):
            if current is not None and current.lease:
                try:
                    await store.keepalive(current.lease)
                    ops = [] if current.value == body else [
                        Put(key, body, lease=current.lease)]
                    res = await store.txn([Compare.modified_at(key, current.mod_revision)], ops)
                    if res.succeeded:
                        self._renewed_now(current.lease, started)
                        return
                except LeaseExpired:
                    pass
                current = await store.get(key)
                if current is not None and current.lease:
                    continue
            seen = current.mod_revision if current is not None else 0
            lease = await store.grant(self._ttl)
            res = await store.txn([Compare.modified_at(key, seen)],
                                  [Put(key, body, lease=lease)])
            if res.succeeded:
                self._renewed_now(lease, started)
                return
            await store.revoke(lease)  # another gateway bound the node first
            current = await store.get(key)
        raise Busy("node", f"node {node!r} kept changing; retry the heartbeat")

    async def report_status(self, node: str, statuses: Iterable[s.ReplicaStatus]) -> int:
        """Writes each changed status of a replica this node runs; returns
        how many were written. Skipped: a replica removed meanwhile or not
        this node's, and a status as already stored."""
        mirror, written = self._state.mirror, 0
        for st in statuses:
            rep = mirror.get(s.REPLICAS + st.id)
            replica = mirror.one(s.REPLICAS + st.id, s.Replica)
            if rep is None or replica is None or replica.node != node or st.node != node:
                continue  # removed meanwhile, or not this node's to report
            old = mirror.one(s.STATUS + st.id, s.ReplicaStatus)
            if old is not None and (old.phase, old.url, old.detail) == (
                st.phase, st.url, st.detail
            ):
                continue
            # Only while the replica read still exists: a late report must not
            # re-create the status of a replica the leader has deleted.
            res = await self._state.store.txn(
                [Compare.created_at(s.REPLICAS + st.id, rep.create_revision)],
                [Put(s.STATUS + st.id, st.model_dump_json().encode())])
            written += res.succeeded
        return written
